"""all-MiniLM-L6-v2 through the worker against plain loops over the same ONNX
Runtime model, same run:

    .venv/bin/python -m benchmarks.minilm --texts 2000 [--repeat 3] [--json out.json]

Needs the export of ``scripts/export_minilm.py`` (its default directory, or
``--model-dir``). The texts are the bundled text model's held-out reviews joined
one to four at a time (seeded): 7 to 85 tokens, median 37, so padding matters.
Measured, in alternating order, ``--repeat`` times:

* ``loop-1``: what an application would write without the worker: tokenize one
  text, run the session on it, next (no padding, no batching);
* ``loop-64``: the same session on batches of 64 texts, tokenized with one
  ``encode_batch`` call and padded to the longest (the compute's ceiling for
  this corpus order, without Kafka);
* ``worker``: an ``infer-worker run`` process draining the texts as a Kafka
  backlog on the embedded broker (rate from its first result to its last), with
  length grouping on (the default) and, as ``worker-nosplit``, off.

Both loops use a session with every core (``intra_op_num_threads`` = cores); the
worker runs its defaults (``--threads`` sets ``model.intra_op_threads``). Every
worker answer is checked against ``loop-1``'s embedding of the same text
(cosine >= 0.9999). Benchmark code: not part of the installed package.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.summary import emit
from worker.bench.ceiling import Drain
from worker.contract import Request, encode_request
from worker.ops.broker import EmbeddedBroker, create_topics
from worker.ops.children import children_die_with_this_process
from worker.ops.processes import mean_batch_size, spawn_worker
from worker.ops.samples import sentiment_samples
from worker.ops.topics import Collector, produce_all

MAX_LENGTH = 256


def corpus(n: int, seed: int = 0) -> list[str]:
    reviews = [s.text for s in sentiment_samples()]
    rng = np.random.default_rng(seed)
    return [
        " ".join(str(t) for t in rng.choice(reviews, int(rng.integers(1, 5)))) for _ in range(n)
    ]


def session(model_dir: Path) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = os.cpu_count() or 1
    return ort.InferenceSession(
        str(model_dir / "model.onnx"), sess_options=opts, providers=["CPUExecutionProvider"]
    )


def tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=MAX_LENGTH)
    return tok


def loop_one(model_dir: Path, texts: list[str]) -> tuple[Drain, np.ndarray]:
    tok, sess = tokenizer(model_dir), session(model_dir)
    out = []
    started = time.monotonic()
    for text in texts:
        enc = tok.encode(text)
        feeds = {
            "input_ids": np.array([enc.ids], np.int64),
            "attention_mask": np.array([enc.attention_mask], np.int64),
            "token_type_ids": np.array([enc.type_ids], np.int64),
        }
        out.append(sess.run(["sentence_embedding"], feeds)[0][0])
    return Drain("loop-1", len(texts), time.monotonic() - started), np.stack(out)


def loop_batched(model_dir: Path, texts: list[str], batch: int = 64) -> Drain:
    tok, sess = tokenizer(model_dir), session(model_dir)
    started = time.monotonic()
    for i in range(0, len(texts), batch):
        encs = tok.encode_batch(texts[i : i + batch])
        width = max(len(e.ids) for e in encs)
        feeds = {n: np.zeros((len(encs), width), np.int64) for n in
                 ("input_ids", "attention_mask", "token_type_ids")}  # fmt: skip
        for row, e in enumerate(encs):
            feeds["input_ids"][row, : len(e.ids)] = e.ids
            feeds["attention_mask"][row, : len(e.ids)] = e.attention_mask
            feeds["token_type_ids"][row, : len(e.ids)] = e.type_ids
        sess.run(["sentence_embedding"], feeds)
    return Drain(f"loop-{batch}", len(texts), time.monotonic() - started)


def worker_env(model_dir: Path, split: bool, threads: int | None) -> dict[str, str]:
    env = {
        "INFER_WORKER_LOGGING__LEVEL": "warning",
        "INFER_WORKER_MODEL__NAME": "all-minilm-l6-v2",
        "INFER_WORKER_MODEL__PATH": str(model_dir / "model.onnx"),
        "INFER_WORKER_MODEL__OUTPUT": "sentence_embedding",
        "INFER_WORKER_MODEL__OUTPUTS": "sentence_embedding",
        "INFER_WORKER_MODEL__INPUTS__TEXT__KIND": "text",
        "INFER_WORKER_MODEL__INPUTS__TEXT__TOKENIZER": str(model_dir / "tokenizer.json"),
        "INFER_WORKER_MODEL__INPUTS__TEXT__MAX_LENGTH": str(MAX_LENGTH),
        "INFER_WORKER_LIMITS__MAX_TEXT_BYTES": "65536",
        "INFER_WORKER_BATCHING__SPLIT_BY_LENGTH": "true" if split else "false",
    }
    if threads is not None:
        env["INFER_WORKER_MODEL__INTRA_OP_THREADS"] = str(threads)
    return env


async def drain_worker(
    bootstrap: str, topics: dict[str, str], n: int, group: str, env: dict[str, str]
) -> tuple[Drain, dict[int, np.ndarray], float]:
    """The drain, every answer's embedding by text index, and the padding share of
    the inputs the engine ran (padding / data elements, from the worker's metrics)."""
    collector = Collector(bootstrap, [topics["results"]])
    await collector.start()
    worker = spawn_worker(
        bootstrap, input_topics=[topics["requests"]], output_topic=topics["results"],
        dlq_topic=topics["dlq"], group_id=group, extra_env=env,
    )  # fmt: skip
    try:
        await collector.collect(lambda c: c.count() >= n or worker.proc.poll() is not None, 900)
        if collector.count() < n:
            raise RuntimeError(f"worker answered {collector.count()} of {n}:\n{worker.log_tail()}")
        m = worker.metrics()
        assert await asyncio.to_thread(worker.terminate) == 0, worker.log_tail()
    finally:
        worker.kill()
        await collector.stop()
    records = collector.records[topics["results"]]
    embeddings = {}
    for rec in records:
        r = rec.result()
        if r.status != "ok":
            raise RuntimeError(f"{r.id}: {r.error}")
        embeddings[int(r.id)] = r.outputs["sentence_embedding"].to_numpy()
    times = [rec.received_at for rec in records]
    data = m.get('infer_padded_elements_total{kind="data"}', 0.0)
    padding = m.get('infer_padded_elements_total{kind="padding"}', 0.0)
    drain = Drain(group, sum(1 for t in times if t > times[0]), times[-1] - times[0],
                  mean_batch_size(m))  # fmt: skip
    return drain, embeddings, padding / data if data else 0.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(args.model_dir)
    texts = corpus(args.texts)
    records: list[tuple[bytes | None, bytes]] = [
        (str(i).encode(), encode_request(Request(v=1, id=str(i), inputs={"text": t})))
        for i, t in enumerate(texts)
    ]
    names = ["loop-1", "loop-64", "worker", "worker-nosplit"]
    runs: dict[str, list[Drain]] = {n: [] for n in names}
    padding: dict[str, list[float]] = {"worker": [], "worker-nosplit": []}
    cosines: list[float] = []
    reference: np.ndarray | None = None
    with EmbeddedBroker() as broker:
        topics = {"requests": "minilm.requests", "dlq": "minilm.dlq", "results": ""}
        await create_topics(broker.bootstrap, {topics["requests"]: args.partitions,
                                               topics["dlq"]: 1})  # fmt: skip
        await produce_all(broker.bootstrap, topics["requests"], records,
                          partition_of=lambda i: i % args.partitions)  # fmt: skip
        for rep in range(args.repeat):
            for name in names if rep % 2 == 0 else names[::-1]:
                if name == "loop-1":
                    d, reference = await asyncio.to_thread(loop_one, model_dir, texts)
                elif name == "loop-64":
                    d = await asyncio.to_thread(loop_batched, model_dir, texts)
                else:
                    topics["results"] = f"minilm.results.{name}.{rep}"
                    await create_topics(broker.bootstrap, {topics["results"]: args.partitions})
                    env = worker_env(model_dir, name == "worker", args.threads)
                    d, got, pad = await drain_worker(broker.bootstrap, topics, len(texts),
                                                     f"{name}-{rep}", env)  # fmt: skip
                    padding[name].append(pad)
                    if reference is not None:
                        cosines += [float(got[i] @ reference[i]) for i in range(len(texts))]
                    d.name = name
                runs[name].append(d)
                print(f"  {name:15s} {d.rate:8.1f} texts/s ({d.records} in {d.seconds:.1f} s)",
                      file=sys.stderr, flush=True)  # fmt: skip
    med = {n: statistics.median(d.rate for d in runs[n]) for n in names}
    return {
        "texts": len(texts),
        "tokens_per_text": _token_stats(model_dir, texts),
        "partitions": args.partitions,
        "cores": os.cpu_count(),
        "worker_intra_op_threads": args.threads,
        "rates_texts_per_s": {n: [round(d.rate, 1) for d in runs[n]] for n in names},
        "median_texts_per_s": {n: round(v, 1) for n, v in med.items()},
        "ratio_worker_to_loop1": round(med["worker"] / med["loop-1"], 2),
        "ratio_worker_to_loop64": round(med["worker"] / med["loop-64"], 2),
        "ratio_split_to_nosplit": round(med["worker"] / med["worker-nosplit"], 2),
        "padding_per_data_element": {n: [round(p, 3) for p in v] for n, v in padding.items()},
        "worker_mean_batch": {
            n: [round(d.mean_batch, 1) for d in runs[n]] for n in ("worker", "worker-nosplit")
        },
        "cosine_worker_vs_loop1_min": round(min(cosines), 7) if cosines else None,
    }


def _token_stats(model_dir: Path, texts: list[str]) -> dict[str, float]:
    lengths = [len(e.ids) for e in tokenizer(model_dir).encode_batch(texts)]
    return {"min": min(lengths), "median": float(np.median(lengths)), "max": max(lengths)}


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from export_minilm import default_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(default_dir()))
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="model.intra_op_threads")
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    if not (Path(args.model_dir) / "model.onnx").is_file():
        parser.error(f"no export in {args.model_dir}: run scripts/export_minilm.py first")
    with children_die_with_this_process("benchmarks.minilm"):
        summary = asyncio.run(run(args))
    emit(summary, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
