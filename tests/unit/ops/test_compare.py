"""``infer-worker compare``'s core on hand-made results: the join on ``source``,
the agreement statistics, outcomes, latency percentiles, accuracy, coverage and
the thresholds; and the command's usage errors (exit 2, no broker needed)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np
import pytest

from worker.contract import ErrorInfo, ModelInfo, Result, Source, Tensor
from worker.ops.compare import (
    Comparison,
    Report,
    ResultRow,
    Side,
    Thresholds,
    add_arguments,
    class_of,
    failures,
    ranking,
    run,
)
from worker.ops.compare import plot as compare_plot

TOPICS: dict[Side, str] = {"baseline": "prod.results", "candidate": "shadow.results"}


def result(
    offset: int,
    outputs: dict[str, Any] | None = None,
    *,
    code: str | None = None,
    version: str = "v1",
    timing: dict[str, int] | None = None,
    meta: dict[str, Any] | None = None,
    rid: str = "",
    partition: int = 0,
) -> Result:
    tensors = {name: Tensor.from_numpy(np.asarray(v)) for name, v in (outputs or {}).items()}
    return Result(
        id=rid or f"r{offset}",
        status="ok" if code is None else "error",
        source=Source("in", partition, offset),
        model=ModelInfo("digits", version),
        outputs=tensors if code is None else {},
        error=None if code is None else ErrorInfo(code, "x"),
        meta=meta,
        timing_us=timing or {},
    )


def topk(*indices: int) -> dict[str, Any]:
    return {"topk_indices": np.array(indices, dtype=np.int64)}


def compare(
    baseline: list[Result],
    candidate: list[Result],
    label_key: str | None = None,
    top_k: int = 3,
) -> Report:
    c = Comparison(top_k=top_k, label_key=label_key)
    for side, results in (("baseline", baseline), ("candidate", candidate)):
        for r in results:
            c.add(side, ResultRow.of(r, label_key))  # type: ignore[arg-type]
    return c.report(TOPICS)


ALL = Thresholds(
    min_top1=0.99, min_topk=0.99, max_abs_diff=1e-4, min_cosine=0.999,
    min_coverage=0.99, max_error_diff=0,
)  # fmt: skip


def test_identical_sides_agree_completely_and_meet_every_threshold() -> None:
    scores = np.array([0.7, 0.2, 0.1], dtype=np.float32)
    rows = [result(i, {**topk(i, 10 + i, 20 + i), "topk_scores": scores}) for i in range(5)]
    report = compare(rows, rows)
    out = report.outputs["topk_indices"]
    assert (out.rows, out.ranked, out.top1, out.topk, out.k) == (0, 5, 1.0, 1.0, 3)
    assert out.max_abs_diff is None and out.mean_cosine is None  # class numbers: agreement only
    assert report.outputs["topk_scores"].max_abs_diff == 0.0
    assert report.outputs["topk_scores"].ranked == 0  # sorted scores rank no class
    assert report.coverage.ratio == 1.0 and report.status["differs"] == 0
    assert failures(report, ALL) == []


def test_the_join_is_on_source_whatever_the_order_ids_and_repeats() -> None:
    """The candidate's results arrive in another order, with other ids, and one
    twice (at-least-once): each request is still paired with its own answer,
    and the repeat (even a differing one) is only counted."""
    baseline = [result(i, topk(i, 0, 1)) for i in range(4)]
    candidate = [result(i, topk(i, 0, 1), rid=f"other-{i}") for i in reversed(range(4))]
    candidate.append(result(2, topk(9, 8, 7)))  # a repeat of offset 2, differing
    candidate.append(result(0, topk(0, 0, 1), partition=1))  # another partition: no match
    report = compare(baseline, candidate)
    assert report.outputs["topk_indices"].top1 == 1.0
    c = report.coverage
    assert (c.baseline, c.candidate, c.joined) == (4, 5, 4)
    assert c.duplicates == {"baseline": 0, "candidate": 1}
    assert c.to_dict()["only_candidate"] == 1 and c.ratio == 4 / 5


def test_coverage_is_joined_over_the_larger_side_and_gates_the_check() -> None:
    report = compare(
        [result(i, topk(1)) for i in range(4)], [result(i, topk(1)) for i in (2, 3, 7)]
    )
    assert report.coverage.joined == 2 and report.coverage.ratio == 0.5
    assert failures(report, Thresholds(min_coverage=0.5)) == []
    (reason,) = failures(report, Thresholds(min_coverage=0.9))
    assert "--min-coverage" in reason and "0.5000" in reason


def test_top1_and_topk_agreement_of_class_indices() -> None:
    baseline = [result(0, topk(1, 2, 3)), result(1, topk(4, 5, 6)), result(2, topk(7, 8, 9))]
    candidate = [result(0, topk(2, 1, 4)), result(1, topk(4, 5, 6)), result(2, topk(7, 9, 0))]
    out = compare(baseline, candidate).outputs["topk_indices"]
    assert out.top1 == pytest.approx(2 / 3)
    assert out.topk == pytest.approx((2 / 3 + 1 + 2 / 3) / 3)
    assert out.max_abs_diff is None  # class numbers are not compared as a tensor
    report = compare(baseline, candidate)
    reasons = failures(report, Thresholds(min_top1=0.99, min_topk=0.5))
    assert reasons == ["--min-top1 0.99: topk_indices agrees on 0.6667"]


def test_class_scores_rank_by_score_and_give_exact_tensor_statistics() -> None:
    a = np.array([0.1, 0.5, 0.5, 0.2], dtype=np.float32)  # a tie: the lower index wins
    b = np.array([0.1, 0.4, 0.6, 0.2], dtype=np.float32)
    report = compare([result(0, {"logits": a})], [result(0, {"logits": b})], top_k=2)
    out = report.outputs["logits"]
    assert out.ranked == 1 and out.top1 == 0.0 and out.topk == 1.0 and out.k == 2
    x, y = a.astype(np.float64), b.astype(np.float64)
    assert out.max_abs_diff == pytest.approx(float(np.max(np.abs(x - y))))
    expected = float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
    assert out.mean_cosine == pytest.approx(expected)
    assert failures(report, Thresholds(max_abs_diff=0.2, min_cosine=0.9)) == []
    assert len(failures(report, Thresholds(max_abs_diff=0.05, min_cosine=0.999))) == 2


def test_shapes_that_differ_and_outputs_one_side_lacks_are_counted_not_compared() -> None:
    baseline = [result(0, {"emb": np.ones(4, np.float32), "raw": np.ones(2, np.float32)})]
    candidate = [result(0, {"emb": np.ones(5, np.float32)})]
    report = compare(baseline, candidate)
    emb, raw = report.outputs["emb"], report.outputs["raw"]
    assert (emb.rows, emb.shape_mismatch, emb.max_abs_diff) == (0, 1, None)
    assert (raw.rows, raw.only_baseline) == (0, 1)
    assert failures(report, Thresholds(max_abs_diff=1.0)) == ["emb: shapes differ in 1 rows"]


def test_non_finite_values_never_pass_for_agreement() -> None:
    nan = np.array([np.nan, 1.0], dtype=np.float32)
    report = compare(
        [result(0, {"y": nan}), result(1, {"y": nan})],
        [result(0, {"y": nan.copy()}), result(1, {"y": np.array([0.0, 1.0], np.float32)})],
    )
    y = report.outputs["y"]
    assert y.max_abs_diff == math.inf and y.non_finite == 1 and y.mean_cosine == 1.0
    assert report.to_dict()["outputs"]["y"]["max_abs_diff"] == "inf"
    assert failures(report, Thresholds(max_abs_diff=1e9)) == [
        "--max-abs-diff 1e+09: y differs by inf"
    ]


def test_outcomes_that_differ_in_status_or_error_code() -> None:
    """Differences are the models'; a request one side alone read past its
    deadline (a shadow started on a backlog) is counted apart (issue 37)."""
    baseline = [result(0, topk(1)), result(1, code="too_large"), result(2, topk(1)),
                result(3, code="deadline_exceeded")]  # fmt: skip
    candidate = [result(0, code="inference_failed"), result(1, code="invalid_request"),
                 result(2, topk(1)), result(3, topk(1))]  # fmt: skip
    report = compare(baseline, candidate)
    assert report.status == {
        "joined": 4,
        "differs": 2,
        "status_differs": 1,
        "error_code_differs": 1,
        "expired_on_one_side": 1,
        "changes": {
            "error:deadline_exceeded -> ok": 1,
            "error:too_large -> error:invalid_request": 1,
            "ok -> error:inference_failed": 1,
        },
    }
    assert report.outputs["topk_indices"].ranked == 1  # only pairs both answered ok
    assert failures(report, Thresholds(max_error_diff=2)) == []
    assert failures(report, Thresholds(max_error_diff=0)) == [
        "--max-error-diff 0: the outcome differs in 2 rows"
    ]
    assert "past its deadline on one side only: 1" in report.format()


def test_latency_percentiles_per_side_model_version_and_stage_over_ok_results() -> None:
    def timed(i: int, version: str) -> Result:
        return result(i, topk(1), version=version,
                      timing={"total": 100 * (i + 1), "infer": 10, "queue": 5})  # fmt: skip

    baseline = [timed(i, "v1") for i in range(10)]
    baseline.append(result(10, code="deadline_exceeded", timing={"total": 1}))  # left out
    candidate = [timed(i, "v2") for i in range(4)]
    latency = compare(baseline, candidate).latency
    stages = latency["baseline"]["digits@v1"]
    assert list(stages) == ["queue", "infer", "total"]  # pipeline order
    # 100..1000 us, interpolated linearly between the closest ranks (NumPy's default)
    assert stages["total"] == {"n": 10, "p50_us": 550.0, "p95_us": 955.0, "p99_us": 991.0}
    assert latency["candidate"]["digits@v2"]["total"]["n"] == 4
    assert compare(baseline, candidate).models == {
        "baseline": ("digits@v1",), "candidate": ("digits@v2",),
    }  # fmt: skip


def test_accuracy_against_labels_the_results_echo_an_error_being_wrong() -> None:
    baseline = [
        result(0, topk(3, 1), meta={"label": 3}),
        result(1, topk(5, 1), meta={"label": "5"}),
        result(2, topk(2, 1), meta={"label": "cat"}),  # not a class index: ignored
        result(3, topk(0, 1)),  # no label
    ]
    candidate = [
        result(0, topk(3, 1), meta={"label": 3}),
        result(1, code="inference_failed", meta={"label": "5"}),
        result(2, topk(2, 1)),
        result(3, topk(0, 1)),
    ]
    report = compare(baseline, candidate, label_key="label")
    acc = report.accuracy["topk_indices"]
    assert (acc["baseline"].correct, acc["baseline"].labelled) == (2, 2)
    assert (acc["candidate"].correct, acc["candidate"].labelled) == (1, 2)
    assert report.unusable_labels == 1 and report.label_source == "results' meta"
    doc = report.to_dict()["accuracy"]
    assert doc["outputs"]["topk_indices"]["candidate"]["accuracy"] == 0.5


def test_labels_from_the_requests_win_over_echoed_meta_and_requests_are_counted() -> None:
    c = Comparison(label_key="label")
    for i in range(3):
        c.label(("in", 0, i), i if i < 2 else None)
    for side in ("baseline", "candidate"):
        for i in range(3):
            c.add(side, ResultRow.of(result(i, topk(i, 9), meta={"label": 9}), "label"))  # type: ignore[arg-type]
    report = c.report(TOPICS)
    acc = report.accuracy["topk_indices"]["baseline"]
    assert (acc.correct, acc.labelled) == (2, 2) and report.label_source == "requests"
    assert report.coverage.requests == 3


def test_a_threshold_with_nothing_to_measure_fails() -> None:
    report = compare([], [])
    assert report.coverage.ratio is None
    assert failures(report, ALL) == [
        "--min-top1: no classifier-like output was compared",
        "--min-topk: no classifier-like output was compared",
        "--max-abs-diff/--min-cosine: no output was compared",
        "--min-coverage 0.99: nothing to join",
    ]
    assert failures(report, Thresholds()) == []


def test_which_outputs_rank_classes() -> None:
    assert ranking("topk_indices", np.array([4, 2], np.int64)).tolist() == [4, 2]  # type: ignore[union-attr]
    assert ranking("logits", np.array([[0.1, 0.9, 0.0]], np.float32)).tolist() == [1, 0, 2]  # type: ignore[union-attr]
    assert ranking("topk_scores", np.array([0.9, 0.1], np.float32)) is None
    assert ranking("logits", np.zeros((2, 3), np.float32)) is None  # not one row of classes
    assert ranking("ids", np.array([1, 2], np.int64)) is None  # integers rank nothing
    assert ranking("score", np.array([0.3], np.float32)) is None  # one value: no classes
    assert [class_of(x) for x in (3, "7", " 2 ", True, "x", 1.0, None)] == [
        3, 7, 2, None, None, None, None,
    ]  # fmt: skip


def test_the_report_is_strict_json_and_reads_in_a_terminal() -> None:
    report = compare(
        [result(0, topk(1, 2, 3), timing={"total": 1500})],
        [result(0, topk(1, 3, 2), timing={"total": 2500}), result(1, topk(1))],
    )
    doc = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert doc["coverage"]["joined"] == 1 and doc["outputs"]["topk_indices"]["topk_agreement"] == 1
    text = report.format()
    assert "coverage: 1 joined of 1 baseline and 2 candidate results (0.5000)" in text
    assert "candidate digits@v1: total 2.50/2.50/2.50" in text


def cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--bootstrap-servers", "127.0.0.1:1", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--baseline", "a", "--candidate", "a"), "must name different topics"),
        (("--baseline", "a", "--candidate", "b", "--input-topic", "b"), "different topics"),
        (("--baseline", "a", "--candidate", "b", "--min-top1", "1.5"), "--min-top1 1.5"),
        (("--baseline", "a", "--candidate", "b", "--max-error-diff", "-1"), "--max-error-diff"),
        (("--baseline", "a", "--candidate", "b", "--top-k", "0"), "--top-k"),
        (("--baseline", "a", "--candidate", "b", "--timeout", "0"), "--timeout"),
    ],
)
def test_usage_errors_exit_2_naming_the_flag(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(cli(*argv)) == 2
    assert message in capsys.readouterr().err


def test_a_plot_without_matplotlib_is_refused_before_reading(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(compare_plot, "available", lambda: False)  # as where it is missing
    assert run(cli("--baseline", "a", "--candidate", "b", "--plot", "x.png")) == 2
    assert "--plot needs matplotlib, which is not installed" in capsys.readouterr().err


def test_class_numbers_are_compared_by_agreement_only() -> None:
    """topk_indices holds class numbers: a difference between 3 and 8 means
    nothing, so a --max-abs-diff or --min-cosine gate never reads it."""
    from worker.ops.compare.stats import OutputAgreement

    s = OutputAgreement(top_k=3)
    s.add("topk_indices", np.array([3, 1, 2]), np.array([8, 1, 2]))
    assert s.rows == 0 and s.top1_agree == 0 and s.ranked == 1


def test_accuracy_asked_for_without_a_single_label_fails_the_gate() -> None:
    """``--label-key label`` where no request carries one reported "- (0/0)" and
    passed (issue 37): the gate now fails, saying how to send labels."""
    rows = [result(i, topk(i, 1)) for i in range(3)]
    report = compare(rows, rows, label_key="label")
    missed = failures(report, Thresholds())
    assert len(missed) == 1 and "--label-key label: no joined request carries" in missed[0]
    assert "produce --meta label=N" in missed[0]
    labelled = [result(i, topk(i, 1), meta={"label": i}) for i in range(3)]
    assert failures(compare(labelled, labelled, label_key="label"), Thresholds()) == []


def test_a_window_leaves_out_the_requests_before_it() -> None:
    """``--since`` (issue 37): a shadow started on a backlog answers old requests
    late, often past their deadline; only requests written since its start are
    compared, and what was left out is reported."""
    c = Comparison(since={("in", 0): 5})  # partition 0 of "in" from offset 5
    for side in ("baseline", "candidate"):
        for i in range(8):
            late = side == "candidate" and i < 5
            row = result(i, code="deadline_exceeded") if late else result(i, topk(i % 3))
            c.add(side, ResultRow.of(row, None))  # type: ignore[arg-type]
    report = c.report(TOPICS)
    assert report.coverage.joined == 3 and report.status["differs"] == 0
    assert report.coverage.outside_window == {"baseline": 5, "candidate": 5}
    assert failures(report, Thresholds(max_error_diff=0, min_coverage=1.0)) == []
    assert "before --since: 5/5 left out" in report.format()


def test_the_decision_page_draws_every_gate_and_the_verdict(tmp_path: Any) -> None:
    """``--plot`` (issue 37): a PNG with the verdict, each gate and its value.
    Drawn from the same gates the exit status is decided on."""
    pytest.importorskip("matplotlib")
    from worker.ops.compare import gates

    baseline = [result(i, topk(i % 3, 1), meta={"label": i % 3}) for i in range(200)]
    candidate = [result(i, topk(i % 3 if i else 2, 1), meta={"label": i % 3}) for i in range(200)]
    candidate[5] = result(5, code="deadline_exceeded", meta={"label": 2})
    report = compare(baseline, candidate, label_key="label")
    decided = gates(report, Thresholds(min_top1=0.999, min_coverage=0.99, max_error_diff=0))
    assert [g.passed for g in decided] == [False, True, True, True]
    assert decided[0].measured == report.outputs["topk_indices"].top1
    path = tmp_path / "gate.png"
    compare_plot.write_plot(report, decided, str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
