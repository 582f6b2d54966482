"""``produce --meta key=value`` and labelled samples (issue 37): a request can
carry the label ``compare --label-key`` reads."""

from __future__ import annotations

import pytest

from worker.contract import decode_request
from worker.flow.errors import ConfigError
from worker.ops.requests import from_samples, from_text, parse_meta, with_meta


def test_meta_values_read_as_json_where_they_are_json() -> None:
    assert parse_meta(["label=7", "source=camera-3", "flags=[1, 2]", "ok=true", "note="]) == {
        "label": 7, "source": "camera-3", "flags": [1, 2], "ok": True, "note": "",
    }  # fmt: skip
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_meta(["label"])


def test_meta_is_added_to_each_request_keeping_its_own() -> None:
    samples = from_samples(2)
    assert all(decode_request(s.value).meta is not None for s in samples)
    labels = [decode_request(s.value).meta["label"] for s in samples]  # type: ignore[index]
    assert all(isinstance(x, int) for x in labels)  # the sample's true class
    sent = with_meta([*samples, from_text("fine")], {"batch": "b1"})
    metas = [decode_request(r.value).meta for r in sent]
    assert metas == [{"label": labels[0], "batch": "b1"}, {"label": labels[1], "batch": "b1"},
                     {"batch": "b1"}]  # fmt: skip
    assert [r.id for r in sent] == [*(s.id for s in samples), sent[2].id]
