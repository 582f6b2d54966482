"""Every model an equal (issue 64), served by a real worker on both brokers: a
worker of one ``[models.NAME]`` section answers every topic as that model (no
bundled model appears beside it), and on ``[model]``'s topic a request may name
a ``[models.NAME]`` that has no topic of its own. Each answer equals the model
run on that request alone, and names the model that gave it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.serving import serve, wire
from worker.config import ModelConfig
from worker.contract import ModelRef, Tensor
from worker.ops.broker import Broker
from worker.ops.samples import labelled_samples, offline_correct, sentiment_samples

pytestmark = pytest.mark.integration


def _digits(n: int) -> list[tuple[str, bytes, int]]:
    samples = labelled_samples(1)[:n]
    return [(f"d-{s.id}", wire(f"d-{s.id}", {"image": Tensor.from_numpy(s.image)}), s.label)
            for s in samples]  # fmt: skip


async def test_one_models_section_is_a_whole_worker(
    broker: Broker, names: dict[str, str]
) -> None:
    digits = _digits(40)
    env = {"INFER_WORKER_MODELS__SCORER__PATH": "builtin:digits"}  # no [model]
    results = await serve(broker, names, [(rid, v) for rid, v, _ in digits], env)
    correct = 0
    for rid, _, label in digits:
        r = results[rid]
        assert (r.status, r.model.name) == ("ok", "scorer"), r.error
        correct += int(r.outputs["topk_indices"].to_numpy()[0] == label)
    alone = offline_correct(labelled_samples(1)[:40], ModelConfig())
    assert correct == alone  # the same answers as the model run by hand


async def test_a_model_without_a_topic_is_named_on_the_shared_topic(
    broker: Broker, names: dict[str, str]
) -> None:
    """[model] (the text model) answers the topic; [models.scorer] has no topic of
    its own (it was refused: 'names the input topics this model answers')."""
    digits = _digits(30)
    texts = sentiment_samples()[:30]
    images = [s.image for s in labelled_samples(1)[:30]]
    requests = [(rid, wire(rid, {"image": Tensor.from_numpy(image)}, ModelRef("scorer")))
                for (rid, _, _), image in zip(digits, images, strict=True)]  # fmt: skip
    requests += [(f"t-{s.id}", wire(f"t-{s.id}", {"text": s.text})) for s in texts]
    env = {"INFER_WORKER_MODEL__PATH": "builtin:sentiment",
           "INFER_WORKER_MODELS__SCORER__PATH": "builtin:digits"}  # fmt: skip
    results = await serve(broker, names, requests, env)
    correct = 0
    for rid, _, label in digits:
        r = results[rid]
        assert (r.status, r.model.name) == ("ok", "scorer"), r.error
        correct += int(r.outputs["topk_indices"].to_numpy()[0] == label)
    assert correct == offline_correct(labelled_samples(1)[:30], ModelConfig())
    right = sum(int(np.argmax(results[f"t-{s.id}"].outputs["logits"].to_numpy()) == s.label)
                for s in texts)  # fmt: skip
    assert all(results[f"t-{s.id}"].model.name == "sentiment" for s in texts)
    assert right >= 0.8 * len(texts)

