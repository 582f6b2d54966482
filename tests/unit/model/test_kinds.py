"""Each request is checked against the model's inputs at intake: every way a
request can be wrong is an error naming the input and what was expected (the
worker answers it, never the DLQ, since the envelope decoded)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from worker.config import BatchingConfig, LimitsConfig, ModelConfig
from worker.config.model import TensorInput, TextInput
from worker.contract import EncodedImage, Request, Tensor
from worker.flow.errors import InvalidRequest, TensorTooLarge
from worker.flow.messages import Job, TopicPartition
from worker.model.inputs import bind, length_bucket
from worker.model.io import ModelIO, TensorDesc
from worker.model.rows import Row

F32, I64 = np.dtype(np.float32), np.dtype(np.int64)
RANKER = ModelIO(
    (TensorDesc("features", F32, (4,)), TensorDesc("ids", I64, ("sequence",))),
    (TensorDesc("score", F32, (1,)), TensorDesc("token_scores", F32, ("sequence",))),
)
LIMITED = ModelConfig(inputs={"ids": TensorInput(max_length=16, pad_value=0)})


def request(**inputs: Any) -> Request:
    return Request(v=1, id="r-1", inputs=inputs, meta={"m": 1})


def good(n: int = 3) -> dict[str, Any]:
    return {
        "features": Tensor.from_numpy(np.ones(4, np.float32)),
        "ids": Tensor.from_numpy(np.arange(1, n + 1, dtype=np.int64)),
    }


def test_a_good_request_gives_its_rows_and_lengths() -> None:
    inputs = bind(LIMITED, RANKER, LimitsConfig())
    values, lengths = inputs.check(request(**good(5)))
    assert values["ids"].tolist() == [1, 2, 3, 4, 5] and values["features"].shape == (4,)
    assert lengths == {"sequence": 5}


F4, I1 = np.ones(4, np.float32), np.ones(1, np.int64)
BAD_TENSORS: list[tuple[dict[str, Any], type[InvalidRequest], str]] = [
    ({"features": None}, InvalidRequest,
     r"inputs\.features: missing \(the model takes features, ids; got ids\)"),
    ({"extra": Tensor.from_numpy(F4)}, InvalidRequest,
     r"inputs\.extra: unknown input; the model takes features, ids"),
    ({"features": Tensor.from_numpy(F4.astype(np.float64))}, InvalidRequest,
     r"inputs\.features\.dtype: expected float32, got float64"),
    ({"features": Tensor.from_numpy(np.ones(5, np.float32))}, InvalidRequest,
     r"inputs\.features\.shape\[0\]: expected 4 \(float32 \[4\]\), got 5"),
    ({"features": Tensor.from_numpy(F4[None])}, InvalidRequest,
     r"inputs\.features\.shape: expected 1 dimensions float32 \[4\] \(one row, no batch "
     r"dimension\), got \[1, 4\]"),
    ({"ids": Tensor.from_numpy(I1[:0])}, InvalidRequest,
     r"inputs\.ids\.shape\[0\]: the free dimension 'sequence' must be >= 1"),
    ({"ids": Tensor.from_numpy(np.ones(17, np.int64))}, TensorTooLarge,
     r"inputs\.ids\.shape\[0\]: 17 exceeds the limit 16 on the free dimension 'sequence' "
     r"\(model\.inputs\.ids\.max_length\)"),
    ({"ids": "some text"}, InvalidRequest,
     r"inputs\.ids: expected a tensor int64 \[sequence\].*got a string"),
    ({"ids": EncodedImage("png", b"\x89PNG\r\n\x1a\n")}, InvalidRequest,
     r"inputs\.ids: expected a tensor.*got an image file \(png, msgpack bin\)"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "error", "message"), BAD_TENSORS)
def test_each_bad_tensor_input_is_an_error_naming_it(
    change: dict[str, Any], error: type[InvalidRequest], message: str
) -> None:
    inputs = bind(LIMITED, RANKER, LimitsConfig())
    given = {**good(), **change}
    given = {k: v for k, v in given.items() if v is not None}
    with pytest.raises(error, match=message) as caught:
        inputs.check(request(**given))
    assert type(caught.value) is error
    assert caught.value.request_id == "r-1" and caught.value.meta == {"m": 1}


def test_inputs_sharing_a_free_dimension_must_agree_on_it() -> None:
    io = ModelIO(
        (TensorDesc("ids", I64, ("sequence",)), TensorDesc("mask", I64, ("sequence",))),
        RANKER.outputs,
    )
    inputs = bind(ModelConfig(), io, LimitsConfig())
    ids, mask = np.ones(5, np.int64), np.ones(6, np.int64)
    with pytest.raises(InvalidRequest, match=r"inputs\.mask: dimension 'sequence' is 6 but 5"):
        inputs.check(request(ids=Tensor.from_numpy(ids), mask=Tensor.from_numpy(mask)))


TEXT = ModelConfig(inputs={"text": TextInput(tokenizer="builtin:sentiment", max_length=8)})
SENTIMENT = ModelIO(
    (
        TensorDesc("input_ids", I64, ("batch_seq",)),
        TensorDesc("attention_mask", I64, ("batch_seq",)),
    ),
    (TensorDesc("token_scores", F32, ("batch_seq",)),),
)


BAD_TEXTS: list[tuple[Any, str]] = [
    (Tensor.from_numpy(np.ones(3, np.int64)),
     r"inputs\.text: expected a text \(a UTF-8 string\), got a tensor \(int64 \[3\]\)"),
    (EncodedImage("jpeg", b"\xff\xd8\xff"), r"inputs\.text: expected a text.*got an image file"),
    ("", r"inputs\.text: the text is empty"),
]  # fmt: skip


@pytest.mark.parametrize(("value", "message"), BAD_TEXTS)
def test_a_text_input_takes_a_non_empty_string(value: Any, message: str) -> None:
    inputs = bind(TEXT, SENTIMENT, LimitsConfig())
    with pytest.raises(InvalidRequest, match=message):
        inputs.check(request(text=value))


def answers_for(inputs: Any, texts: list[str]) -> list[Row]:
    out = []
    for i, text in enumerate(texts):
        values, lengths = inputs.check(request(text=text))
        job = Job(TopicPartition("t", 0), i, None, time.monotonic(), None, inputs=values,
                  lengths=lengths)  # fmt: skip
        out.append(Row.of(job))
    return out


def test_texts_are_tokenized_truncated_and_padded_per_run() -> None:
    inputs = bind(TEXT, SENTIMENT, LimitsConfig())
    answers = answers_for(inputs, ["great", "the phone was very slow and noisy, avoid it"])
    assert inputs.pending(answers)
    inputs.prepare(answers)
    # [CLS] great [SEP]; the long one truncated at max_length (8), [SEP] kept last.
    assert [a.lengths["batch_seq"] for a in answers] == [3, 8]
    collated = inputs.collate(answers)
    assert collated.padded == {"batch_seq": 8}
    ids, mask = collated.feeds["input_ids"], collated.feeds["attention_mask"]
    assert ids.shape == mask.shape == (2, 8) and ids.dtype == np.int64
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8]
    assert ids[0, 3:].tolist() == [0] * 5  # the tokenizer's pad id
    assert ids[1, -1] == ids[0, 2]  # [SEP] survives truncation


def test_runs_are_grouped_by_length_bucket_in_batch_order() -> None:
    inputs = bind(LIMITED, RANKER, LimitsConfig())
    answers = []
    for i, n in enumerate([3, 16, 4, 2, 9, 1]):
        values, lengths = inputs.check(request(**good(n)))
        job = Job(TopicPartition("t", 0), i, None, time.monotonic(), None, inputs=values,
                  lengths=lengths)  # fmt: skip
        answers.append(Row.of(job))
    groups = inputs.groups(answers)
    assert [[a.job.offset for a in g] for g in groups] == [[0, 2], [1, 4], [3], [5]]
    # Lengths 3 and 4 share bucket 4: padded to 4, not to the batch's 16.
    collated = inputs.collate(groups[0])
    assert collated.feeds["ids"].tolist() == [[1, 2, 3, 0], [1, 2, 3, 4]]
    data, total = inputs.waste(groups[0], collated.padded)
    assert (data, total) == (7, 8)
    # One run for all: the waste the grouping avoids.
    assert inputs.waste(answers, inputs.padded(answers)) == (35, 96)
    unsplit = bind(LIMITED, RANKER, LimitsConfig(), BatchingConfig(split_by_length=False))
    assert [len(g) for g in unsplit.groups(answers)] == [6]


def test_length_buckets() -> None:
    assert [length_bucket(n, ()) for n in (1, 2, 3, 4, 5, 100)] == [1, 2, 4, 4, 8, 128]
    assert [length_bucket(n, (16, 64)) for n in (1, 16, 17, 64, 65)] == [16, 16, 64, 64, 128]
