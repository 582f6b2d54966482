"""The delivery verifier's rules, on plain tuples: what counts as lost, duplicated,
out of order and unknown, and what the report makes of it. The command line is
test_verify_cli.py's; the reading half is exercised against the real broker in
tests/integration/test_verify.py."""

from __future__ import annotations

import json

from worker.ops.verify import (
    Duplicate,
    InputRecord,
    OrderingViolation,
    Reply,
    Unparseable,
    check,
    verify,
)

T = "req"


def answers_in_order(
    topic: str, partition: int, offsets: list[int]
) -> list[tuple[int, int, str, int, int]]:
    """Results for ``offsets`` of one source partition, in that order on output
    partition 0."""
    return [(0, i, topic, partition, o) for i, o in enumerate(offsets)]


def test_all_answered_is_ok() -> None:
    report = verify({T: {0: [0, 1, 2]}}, answers_in_order(T, 0, [0, 1, 2]))
    assert report.ok and report.failures() == []
    (p,) = report.partitions
    assert (p.topic, p.partition, p.requests, p.answered, p.results, p.dlq) == (T, 0, 3, 3, 3, 0)
    assert p.lost == () and p.duplicates == () and p.unknown == ()
    assert p.ordering_violations == 0
    assert report.totals.requests == 3 and report.totals.lost == 0


def test_dlq_record_answers_a_request() -> None:
    report = verify({T: {0: [0, 1, 2]}}, answers_in_order(T, 0, [0, 2]), dlq=[(T, 0, 1)])
    assert report.ok
    (p,) = report.partitions
    assert (p.answered, p.results, p.dlq, p.lost) == (3, 2, 1, ())


def test_lost_offsets_fail_and_are_listed_sorted() -> None:
    report = verify({T: {0: [4, 0, 1, 2, 3]}}, answers_in_order(T, 0, [1, 3]))
    assert not report.ok
    (p,) = report.partitions
    assert p.lost == (0, 2, 4)
    assert (p.requests, p.answered) == (5, 2)
    assert report.totals.lost == 3
    assert report.failures() == ["3 lost"]


def test_duplicate_results_are_counted_but_not_fatal_by_default() -> None:
    outputs = answers_in_order(T, 0, [0, 1, 1, 2, 1])
    report = verify({T: {0: [0, 1, 2]}}, outputs)
    assert report.ok
    (p,) = report.partitions
    assert p.duplicates == (Duplicate(offset=1, results=3, dlq=0),)
    assert p.duplicates[0].count == 3
    assert (p.answered, p.results) == (3, 5)
    assert report.totals.duplicates == 1 and report.totals.surplus_answers == 2


def test_result_and_dlq_for_one_request_is_a_duplicate() -> None:
    report = verify({T: {0: [0, 1]}}, answers_in_order(T, 0, [0, 1]), dlq=[(T, 0, 1)])
    (p,) = report.partitions
    assert p.duplicates == (Duplicate(offset=1, results=1, dlq=1),)
    assert report.ok


def test_strict_mode_fails_on_duplicates() -> None:
    inputs = {T: {0: [0, 1]}}
    outputs = answers_in_order(T, 0, [0, 1, 1])
    assert verify(inputs, outputs).ok
    strict = verify(inputs, outputs, strict=True)
    assert not strict.ok and strict.strict
    assert strict.failures() == ["1 duplicated (strict)"]
    # Strict without duplicates is still ok.
    assert verify(inputs, answers_in_order(T, 0, [0, 1]), strict=True).ok


def test_ordering_violation_within_one_output_partition() -> None:
    # Output partition 0 carries source offsets 0, 2, 1, 3: one step backwards.
    report = verify({T: {0: [0, 1, 2, 3]}}, answers_in_order(T, 0, [0, 2, 1, 3]))
    (p,) = report.partitions
    assert p.ordering_violations == 1
    assert p.ordering_examples == (
        OrderingViolation(
            output_partition=0,
            output_offset=2,
            offset=1,
            previous_offset=2,
            previous_output_offset=1,
        ),
    )
    assert report.ok  # reported, but ordering alone does not fail delivery


def test_one_early_answer_counts_once_not_per_overtaken_request() -> None:
    report = verify({T: {0: list(range(10))}}, answers_in_order(T, 0, [9, *range(9)]))
    assert report.partitions[0].ordering_violations == 1


def test_ordering_is_judged_by_output_position_not_input_order_of_rows() -> None:
    rows = answers_in_order(T, 0, [0, 1, 2, 3])
    assert (
        verify({T: {0: [0, 1, 2, 3]}}, list(reversed(rows))).partitions[0].ordering_violations == 0
    )


def test_no_ordering_across_output_partitions_or_source_partitions() -> None:
    outputs = [
        # Output partition 0 gets source 0/5 then 0/1; output partition 1 gets 0/2.
        (0, 0, T, 0, 3),
        (1, 0, T, 0, 1),  # earlier offset, different output partition: fine
        (0, 1, T, 1, 0),  # other source partition interleaved: fine
        (0, 2, T, 0, 4),
        (0, 3, T, 1, 1),
    ]
    report = verify({T: {0: [1, 3, 4], 1: [0, 1]}}, outputs)
    assert report.totals.ordering_violations == 0


def test_redelivered_answers_are_duplicates_not_reorderings() -> None:
    # Crash after 0..3 were answered, replay from 2: first answers stay in order.
    report = verify({T: {0: [0, 1, 2, 3, 4]}}, answers_in_order(T, 0, [0, 1, 2, 3, 2, 3, 4]))
    (p,) = report.partitions
    assert p.ordering_violations == 0
    assert [d.offset for d in p.duplicates] == [2, 3]


def test_dlq_rows_without_position_take_no_part_in_ordering() -> None:
    report = verify({T: {0: [0, 1, 2]}}, answers_in_order(T, 0, [1, 2]), dlq=[(T, 0, 0)])
    assert report.totals.ordering_violations == 0 and report.ok


def test_ordering_examples_are_capped_but_the_count_is_exact() -> None:
    offsets = [1, 0, 3, 2, 5, 4, 7, 6, 9, 8]
    report = verify({T: {0: list(range(10))}}, answers_in_order(T, 0, offsets), max_examples=2)
    (p,) = report.partitions
    assert p.ordering_violations == 5 and len(p.ordering_examples) == 2
    assert [v.offset for v in p.ordering_examples] == [0, 2]


def test_unknown_offsets_and_unknown_partitions() -> None:
    outputs = [
        (0, 0, T, 0, 0),
        (0, 1, T, 0, 7),  # never requested in a known partition
        (0, 2, T, 0, 7),
        (0, 3, T, 5, 0),  # partition not among the inputs
        (0, 4, "other", 0, 3),  # topic not among the inputs
    ]
    report = verify({T: {0: [0]}}, outputs)
    assert report.ok
    by_name = {(p.topic, p.partition): p for p in report.partitions}
    assert list(by_name) == [("other", 0), (T, 0), (T, 5)]
    assert by_name[(T, 0)].unknown == (7, 7)
    assert by_name[(T, 0)].answered == 1
    assert by_name[(T, 5)].unknown == (0,) and by_name[(T, 5)].requests == 0
    assert by_name[("other", 0)].unknown == (3,)
    assert report.totals.unknown == 4


def test_multiple_topics_and_partitions_are_reported_separately_and_sorted() -> None:
    inputs = {"b": {1: [0, 1], 0: [0]}, "a": {0: [0, 1, 2]}}
    outputs = [
        (0, 0, "b", 1, 0),
        (1, 0, "a", 0, 0),
        (1, 1, "a", 0, 2),
        (0, 1, "b", 0, 0),
        (1, 2, "b", 1, 1),
    ]
    report = verify(inputs, outputs, dlq=[("a", 0, 1)])
    assert [(p.topic, p.partition) for p in report.partitions] == [("a", 0), ("b", 0), ("b", 1)]
    assert [p.requests for p in report.partitions] == [3, 1, 2]
    assert [p.answered for p in report.partitions] == [3, 1, 2]
    assert report.ok and report.totals.requests == 6 and report.totals.dlq == 1


def test_loss_in_one_partition_is_attributed_to_it() -> None:
    inputs = {"a": {0: [0, 1]}, "b": {0: [0, 1]}}
    report = verify(inputs, [(0, 0, "a", 0, 0), (0, 1, "a", 0, 1), (0, 2, "b", 0, 0)])
    assert [p.lost for p in report.partitions] == [(), (1,)]


def test_empty_input_and_no_answers_is_ok() -> None:
    report = verify({})
    assert report.ok and report.partitions == ()
    assert report.totals.requests == 0
    empty_partition = verify({T: {0: [], 1: []}})
    assert empty_partition.ok
    assert [p.requests for p in empty_partition.partitions] == [0, 0]


def test_check_takes_answer_objects_and_the_result_is_independent_of_their_order() -> None:
    answers = [Reply(InputRecord(T, 0, o), 0, i, "result") for i, o in enumerate([0, 2, 1, 1])] + [
        Reply(InputRecord(T, 0, 3), 0, 0, "dlq")
    ]
    inputs = {T: {0: [0, 1, 2, 3, 4]}}
    a = check(inputs, answers)
    b = check(inputs, list(reversed(answers)))
    assert a == b
    assert a.to_dict() == b.to_dict()
    (p,) = a.partitions
    assert p.lost == (4,) and p.dlq == 1 and p.ordering_violations == 1


def test_unparseable_records_are_reported_and_do_not_fail_on_their_own() -> None:
    bad = [Unparseable("res", 0, 9, "not a result"), Unparseable("res", 0, 2, "garbage")]
    report = verify({T: {0: [0]}}, [(0, 0, T, 0, 0)], unparseable=bad)
    assert report.ok
    assert [u.offset for u in report.unparseable] == [2, 9]
    assert report.totals.unparseable == 2


def test_to_dict_is_json_and_complete() -> None:
    report = verify(
        {T: {0: [0, 1, 2, 3]}},
        answers_in_order(T, 0, [0, 2, 1, 1]),
        unparseable=[Unparseable("res", 0, 4, "garbage")],
        strict=True,
    )
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["ok"] is False and doc["strict"] is True
    assert doc["failures"] == ["1 lost", "1 duplicated (strict)"]
    assert doc["totals"]["lost"] == 1 and doc["totals"]["surplus_answers"] == 1
    (p,) = doc["partitions"]
    assert p["lost"] == [3]
    assert p["duplicates"] == [{"offset": 1, "count": 2, "results": 2, "dlq": 0}]
    assert p["ordering_violations"] == 1
    assert p["ordering_examples"][0] == {
        "output_partition": 0,
        "output_offset": 2,
        "offset": 1,
        "previous_offset": 2,
        "previous_output_offset": 1,
    }
    assert doc["unparseable"] == [
        {"topic": "res", "partition": 0, "offset": 4, "reason": "garbage"}
    ]


def test_format_shows_table_problems_and_verdict() -> None:
    report = verify(
        {T: {0: list(range(10)), 1: [0]}},
        [*answers_in_order(T, 0, [0, 1, 5, 4, 6, 6]), (1, 0, T, 1, 0)],
    )
    text = report.format()
    lines = text.splitlines()
    assert lines[0].split() == [
        "topic",
        "partition",
        "requests",
        "answered",
        "results",
        "dlq",
        "lost",
        "duplicates",
        "out-of-order",
        "unknown",
    ]
    assert lines[1].split() == [T, "0", "10", "5", "6", "0", "5", "1", "1", "0"]
    assert lines[3].split()[0] == "total"
    assert "lost        req/0: 2-3, 7-9" in text
    assert "duplicate   req/0@6: answered 2x" in text
    assert "order       req/0: offset 4 at output 0@3 after offset 5" in text
    assert lines[-1] == "FAILED: 5 lost of 11 requests"
    ok_text = verify({T: {0: [0]}}, answers_in_order(T, 0, [0, 0])).format()
    assert ok_text.splitlines()[-1] == "OK: 1 requests, all answered (1 duplicated)"


def test_format_truncates_long_lists() -> None:
    inputs = {T: {0: list(range(0, 200))}}
    answered = list(range(0, 200, 2))  # every odd offset lost: 100 runs
    text = verify(inputs, answers_in_order(T, 0, answered)).format(max_items=3)
    assert "lost        req/0: 1, 3, 5, ... (97 more ranges)" in text
