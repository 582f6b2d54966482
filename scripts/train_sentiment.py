"""Train the small bundled text model (``builtin:sentiment``) and export it to ONNX by hand.

What it is for: the text path end to end (a tokenizer.json, batch tokenization,
padding per batch, a per-token output cut back to each request's length) in a
model small and fast enough for the demo and CI. What it is not: language
understanding. It is a bag-of-words sentiment classifier (softmax regression
on the mean of its tokens' weights) trained on synthetic product reviews that
this script generates from word lists, with a fixed seed (no data set of real
labelled text ships offline with the libraries this project may use). It
knows nothing of negation or word order.

    input_ids int64 [batch, sequence], attention_mask int64 [batch, sequence]
      -> logits float32 [batch, 2]           (0 = negative, 1 = positive)
      -> token_scores float32 [batch, sequence]  (each token's pull towards positive;
                                                  0 at padding)

The tokenizer is a word-level model learnt with Hugging Face ``tokenizers`` from
the same reviews (lower-cased, ``[CLS] text [SEP]``, pad id 0).

Outputs (in ``--out-dir``, default ``worker/model/bundled``):

* ``sentiment.onnx``           - the model (opset 17; symbolic dims "batch", "sequence")
* ``sentiment.tokenizer.json`` - its tokenizer
* ``sentiment_samples.json``   - held-out reviews and labels (the demo sends them)
* ``sentiment.json``           - metadata, including the held-out accuracy (ONNX Runtime)

To rebuild (deterministic for a given ``--seed``)::

    .venv/bin/python scripts/train_sentiment.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

OPSET = 17
IR_VERSION = 8
MAX_LENGTH = 64
PRODUCER = "infer-worker/scripts/train_sentiment.py"

SUBJECTS = (
    "the phone", "this blender", "the delivery", "customer service", "the battery",
    "the screen", "this jacket", "the hotel room", "the staff", "the app", "the headphones",
    "the coffee", "this book", "the film", "the keyboard", "the mattress", "the checkout",
    "the camera", "our order", "the support team",
)  # fmt: skip
VERBS = ("is", "was", "seems", "felt", "has been", "turned out")
INTENSIFIERS = ("", "", "really", "very", "quite", "so", "extremely", "pretty", "truly")
POSITIVE = (
    "great", "excellent", "fantastic", "wonderful", "reliable", "comfortable", "fast",
    "friendly", "amazing", "perfect", "brilliant", "helpful", "delightful", "solid",
    "smooth", "lovely", "superb", "sturdy", "quiet", "generous",
)  # fmt: skip
NEGATIVE = (
    "terrible", "awful", "broken", "slow", "rude", "disappointing", "useless", "noisy",
    "cheap", "flimsy", "horrible", "faulty", "dreadful", "annoying", "poor", "leaky",
    "unreliable", "overpriced", "late", "uncomfortable",
)  # fmt: skip
CLOSERS = {
    1: ("i love it", "highly recommended", "would buy again", "five stars",
        "worth every penny", "thank you", "exactly what i wanted"),
    0: ("i want a refund", "do not buy", "never again", "one star",
        "what a waste of money", "sending it back", "avoid"),
}  # fmt: skip


def reviews(n: int, rng: np.random.Generator) -> tuple[list[str], np.ndarray]:
    """``n`` synthetic reviews and their labels (1 positive, 0 negative), balanced.
    One clause in six carries a word of the other polarity, so the model has to
    weigh words, not spot one."""
    texts, labels = [], []
    for i in range(n):
        label = i % 2
        words, others = (POSITIVE, NEGATIVE) if label else (NEGATIVE, POSITIVE)
        clauses = []
        for _ in range(int(rng.integers(1, 3))):
            adj = str(rng.choice(words))
            if rng.random() < 1 / 6:
                adj = f"{adj} but a bit {rng.choice(others)}"
            elif rng.random() < 0.4:
                adj = f"{adj} and {rng.choice(words)}"
            parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(INTENSIFIERS), adj]
            clauses.append(" ".join(str(p) for p in parts if p))
        text = ", ".join(clauses)
        if rng.random() < 0.5:
            text += ". " + str(rng.choice(CLOSERS[label]))
        texts.append(text[0].upper() + text[1:] + ("!" if rng.random() < 0.3 else "."))
        labels.append(label)
    order = rng.permutation(n)
    return [texts[i] for i in order], np.asarray(labels, dtype=np.int64)[order]


SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """A word-level vocabulary learnt from ``texts`` (words seen at least twice),
    numbered in a canonical order (special tokens, then alphabetically): the
    trainer's own numbering follows hash-map order, which differs run to run."""
    learner = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    learner.normalizer = normalizers.BertNormalizer(lowercase=True)
    learner.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL), min_frequency=2)
    learner.train_from_iterator(texts, trainer=trainer)
    words = sorted(set(learner.get_vocab()) - set(SPECIAL))
    vocab = {token: i for i, token in enumerate((*SPECIAL, *words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(max_length=MAX_LENGTH)
    return tok


def encode(tok: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encodings = tok.encode_batch(texts)
    ids = np.asarray([e.ids for e in encodings], dtype=np.int64)
    mask = np.asarray([e.attention_mask for e in encodings], dtype=np.int64)
    return ids, mask


def fit(ids: np.ndarray, mask: np.ndarray, y: np.ndarray, vocab: int) -> tuple[np.ndarray, ...]:
    """Softmax regression on the mean of one-hot tokens: weights [vocab, 2], bias [2]."""
    n = len(y)
    bag = np.zeros((n, vocab), dtype=np.float64)
    for i in range(n):
        np.add.at(bag[i], ids[i][mask[i] == 1], 1.0)
    bag /= mask.sum(axis=1, keepdims=True)
    w = np.zeros((vocab, 2))
    b = np.zeros(2)
    onehot = np.eye(2)[y]
    for _ in range(600):  # full-batch gradient descent, L2 0.001
        logits = bag @ w + b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        grad = p - onehot
        w -= 4.0 * (bag.T @ grad / n + 1e-3 * w)
        b -= 4.0 * grad.mean(axis=0)
    return w.astype(np.float32), b.astype(np.float32)


def build_onnx(w: np.ndarray, b: np.ndarray, seed: int) -> onnx.ModelProto:
    direction = np.array([[-1.0], [1.0]], dtype=np.float32)  # positive minus negative
    nodes = [
        helper.make_node("Gather", ["weights", "input_ids"], ["token_weights"], axis=0),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "last"], ["mask3"]),
        helper.make_node("Mul", ["token_weights", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "seq_axis"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["maskf", "seq_axis"], ["count"], keepdims=1),
        helper.make_node("Max", ["count", "one"], ["count1"]),
        helper.make_node("Div", ["summed", "count1"], ["mean"]),
        helper.make_node("Add", ["mean", "bias"], ["logits"]),
        helper.make_node("MatMul", ["masked", "direction"], ["scores3"]),
        helper.make_node("Squeeze", ["scores3", "last"], ["token_scores"]),
    ]
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])
    graph = helper.make_graph(
        nodes,
        "sentiment",
        [ids, mask],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2]),
            helper.make_tensor_value_info("token_scores", TensorProto.FLOAT, ["batch", "sequence"]),
        ],
        [
            numpy_helper.from_array(w, "weights"),
            numpy_helper.from_array(b, "bias"),
            numpy_helper.from_array(direction, "direction"),
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
            numpy_helper.from_array(np.array([1], np.int64), "seq_axis"),
            numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name=PRODUCER
    )
    model.ir_version = IR_VERSION
    model.doc_string = f"bag-of-words sentiment on synthetic reviews, seed {seed}"
    onnx.checker.check_model(model)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("worker/model/bundled"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    texts, labels = reviews(4000, rng)
    train, test = slice(0, 3600), slice(3600, None)
    tok = train_tokenizer(texts[train])
    ids, mask = encode(tok, texts)
    w, b = fit(ids[train], mask[train], labels[train], tok.get_vocab_size())
    model = build_onnx(w, b, args.seed)
    data = model.SerializeToString()
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    logits, _ = session.run(None, {"input_ids": ids[test], "attention_mask": mask[test]})
    correct = int((np.asarray(logits).argmax(axis=1) == labels[test]).sum())
    accuracy = correct / len(labels[test])
    print(f"onnxruntime held-out accuracy: {accuracy:.4f} ({correct}/{len(labels[test])})")
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "sentiment.onnx").write_bytes(data)
    tok.save(str(out / "sentiment.tokenizer.json"))
    samples = {"texts": texts[test], "labels": labels[test].tolist()}
    (out / "sentiment_samples.json").write_text(json.dumps(samples, indent=0) + "\n")
    meta = {
        "name": "sentiment",
        "inputs": {"text": {"kind": "text", "tokenizer": "builtin:sentiment",
                            "max_length": MAX_LENGTH}},
        "outputs": {"logits": "float32 [2]: 0 negative, 1 positive",
                    "token_scores": "float32 [sequence]: each token's pull towards positive"},
        "vocab_size": tok.get_vocab_size(),
        "heldout_accuracy": accuracy,
        "heldout_samples": len(labels[test]),
        "train_samples": len(labels[train]),
        "seed": args.seed,
        "dataset": "synthetic product reviews generated by this script (word lists, seeded)",
        "onnx_opset": OPSET,
    }  # fmt: skip
    (out / "sentiment.json").write_text(json.dumps(meta, indent=2) + "\n")
    for name in ("sentiment.onnx", "sentiment.tokenizer.json", "sentiment_samples.json",
                 "sentiment.json"):  # fmt: skip
        print(f"wrote {out / name} ({(out / name).stat().st_size} bytes)")


if __name__ == "__main__":
    main()
