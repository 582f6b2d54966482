"""Two models served from a model repository (``[repository]``, issue 68): the
bundled digits file with its settings for every version, and a tabular scorer in
two versions of which the latest is served. Beside it, a worker of the same
files configured as ``[models.NAME]`` reads the same requests in a group of its
own: every answer of the repository's worker equals the configured one's (the
same model, the same version hash, the same outputs), the scorer's equal its
version 2 run alone, and a request pinning version 1's hash is ``unknown_model``."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.onnx_models import run_alone, tabular
from tests.serving import wire
from worker.contract import ModelRef, Result, Tensor
from worker.model.files import bundled_file, content_version
from worker.ops.broker import Broker, create_topics
from worker.ops.processes import WorkerProcess, spawn_worker
from worker.ops.samples import labelled_samples
from worker.ops.topics import Collector, committed_offsets, produce_all

pytestmark = pytest.mark.integration
pytest.importorskip("onnx")


def _repository(root: Path, topics: dict[str, str]) -> Path:
    repo = root / "models"
    (repo / "digits" / "1").mkdir(parents=True)
    shutil.copy(bundled_file("digits.onnx"), repo / "digits" / "1" / "model.onnx")
    (repo / "digits" / "model.toml").write_text(
        f'topics = ["{topics["digits"]}"]\ninput = "image"\n'
    )
    for version in (1, 2):
        (repo / "scorer" / str(version)).mkdir(parents=True)
        tabular(repo / "scorer" / str(version) / "model.onnx", seed=version)
    (repo / "scorer" / "2" / "model.toml").write_text(f'topics = ["{topics["scorer"]}"]\n')
    return repo


async def test_repository_models_answer_as_the_same_models_configured(
    broker: Broker, names: dict[str, str], tmp_path: Path
) -> None:
    topic = {m: f"{names['requests']}.{m}" for m in ("digits", "scorer")}
    results = {"repository": f"{names['results']}.repository",
               "configured": f"{names['results']}.configured"}  # fmt: skip
    await create_topics(broker.bootstrap, {**{t: 2 for t in topic.values()},
                                           **{t: 1 for t in results.values()},
                                           names["dlq"]: 1})  # fmt: skip
    repo = _repository(tmp_path, topic)
    latest, older = repo / "scorer" / "2" / "model.onnx", repo / "scorer" / "1" / "model.onnx"
    rng = np.random.default_rng(5)
    features = {f"s-{i}": rng.normal(size=4).astype(np.float32) for i in range(40)}
    images = {f"d-{s.id}": s.image for s in labelled_samples(1)[:40]}
    sent = {
        topic["scorer"]: [(rid.encode(), wire(rid, {"features": Tensor.from_numpy(v)}))
                          for rid, v in features.items()],
        topic["digits"]: [(rid.encode(), wire(rid, {"image": Tensor.from_numpy(v)}))
                          for rid, v in images.items()],
    }  # fmt: skip
    pinned = wire("pinned", {"features": Tensor.from_numpy(features["s-0"])},
                  ModelRef("scorer", content_version(older)))  # fmt: skip
    sent[topic["scorer"]].append((b"pinned", pinned))
    total = sum(len(v) for v in sent.values())
    envs = {
        "repository": {"INFER_WORKER_REPOSITORY__PATH": str(repo)},
        "configured": {
            "INFER_WORKER_MODELS__DIGITS__PATH": str(repo / "digits" / "1" / "model.onnx"),
            "INFER_WORKER_MODELS__DIGITS__INPUT": "image",
            "INFER_WORKER_MODELS__DIGITS__TOPICS": topic["digits"],
            "INFER_WORKER_MODELS__SCORER__PATH": str(latest),
            "INFER_WORKER_MODELS__SCORER__TOPICS": topic["scorer"],
        },
    }
    workers: dict[str, WorkerProcess] = {}
    answers: dict[str, dict[str, Result]] = {}
    try:
        for kind, env in envs.items():
            workers[kind] = spawn_worker(
                broker.bootstrap, input_topics=list(topic.values()), output_topic=results[kind],
                dlq_topic=names["dlq"], group_id=f"{names['group']}.{kind}", extra_env=env,
            )  # fmt: skip
        for kind, w in workers.items():
            await asyncio.to_thread(
                w.wait_until, lambda m: m.get("infer_assigned_partitions", 0) >= 4, 90.0,
                f"the {kind} worker's assignment of both models' partitions",
            )  # fmt: skip
        for t, records in sent.items():
            await produce_all(broker.bootstrap, t, records)
        for kind, out in results.items():
            c = Collector(broker.bootstrap, [out, names["dlq"]])
            await c.start()
            try:
                done = await c.collect(lambda c: c.count() >= total, 90.0)
                assert done, f"{kind}: {c.count()} of {total}\n{workers[kind].log_tail()}"
            finally:
                await c.stop()
            assert not c.records.get(names["dlq"]), f"{kind}: a request went to the DLQ"
            answers[kind] = {r.result().id: r.result() for r in c.records[out]}
            assert len(answers[kind]) == total, kind
    finally:
        for w in workers.values():
            assert w.terminate() == 0, w.log_tail()

    ours, theirs = answers["repository"], answers["configured"]
    for rid, r in ours.items():
        other = theirs[rid]
        assert (r.status, r.model, r.error) == (other.status, other.model, other.error), rid
        assert r.outputs.keys() == other.outputs.keys(), rid
        for name, tensor in r.outputs.items():
            np.testing.assert_array_equal(tensor.to_numpy(), other.outputs[name].to_numpy())
    for rid, v in features.items():  # the latest version answers, as that file alone
        r = ours[rid]
        assert (r.status, r.model.name, r.model.version) == (
            "ok", "scorer", content_version(latest)), r.error  # fmt: skip
        alone = run_alone(latest, {"features": v})
        np.testing.assert_allclose(r.outputs["probabilities"].to_numpy(),
                                   alone["probabilities"], rtol=1e-5, atol=1e-6)  # fmt: skip
    correct = 0
    for s in labelled_samples(1)[:40]:
        r = ours[f"d-{s.id}"]
        assert (r.status, r.model.name) == ("ok", "digits"), r.error
        correct += int(r.outputs["topk_indices"].to_numpy()[0] == s.label)
    assert correct >= 36
    old = ours["pinned"]
    assert old.error is not None and old.error.code == "unknown_model", old.error
    assert content_version(latest) in old.error.message
    for t, records in sent.items():
        committed = await committed_offsets(broker.bootstrap, f"{names['group']}.repository", t, 2)
        assert sum(committed.values()) == len(records), (t, committed)
