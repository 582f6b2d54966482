"""Calibration samples for an INT8 build: exactly the feeds the engine sees when serving.

A quantized model is only as good as the activation ranges it was calibrated
on, and those must be the ranges of what the worker feeds the engine: pixels
after its resize and normalisation, token ids after its tokenizer, rows padded
as its batches pad them. So samples are never fed to the quantizer as they are:
each becomes a request, checked by the model's binding (``bind_model``: the
same ``ModelInputs.check`` the intake runs), prepared (image files decoded,
texts tokenized) and collated by the same code as a served batch, grouped and
chunked as the CPU stage runs them (a model of fixed batch in runs of that
size, the last filled with its own last row).

Two sources:

- files (``--calibration-files``): ``.npy`` arrays (samples stacked on the first
  axis, for a model taking one request input), ``.npz`` archives (one array per
  request input, by name; ``labels`` ignored; for a model of one request input an
  archive of one other array is read as it), image files (``.jpg``, ``.png``,
  ``.webp``, for a model whose one request input is an image), or directories
  of those. A sample the binding refuses is a ``ConfigError`` naming the file,
  the input and what it takes: calibrating on anything else would calibrate a
  different model.
- a Kafka topic of requests (``--calibration-topic``): read from the beginning
  without a consumer group (``worker.ops.topics.Collector``, with the worker's
  connection and security settings), each record decoded by the worker's own
  intake (``JobFactory``: msgpack or Open Inference Protocol JSON); records the
  worker would refuse are skipped and counted.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from worker.config import KafkaConfig, LimitsConfig
from worker.contract import EncodedImage, Request, Tensor, sniff_format
from worker.flow.errors import ConfigError, InvalidRequest
from worker.flow.messages import Job, TopicPartition
from worker.kafka.credentials import connection
from worker.kafka.diagnose import run_tool
from worker.kafka.intake import JobFactory
from worker.model.inputs import ModelInputs
from worker.model.inputs.image import BoundImage
from worker.model.inputs.text import BoundText
from worker.model.rows import Row
from worker.ops.topics import Collector, TopicUnreadable

Feeds = dict[str, np.ndarray]

ARRAYS: Final = (".npy", ".npz")
IMAGES: Final = (".jpg", ".jpeg", ".png", ".webp")
FILES_FLAG: Final = "--calibration-files"
TOPIC_FLAG: Final = "--calibration-topic"


@dataclass(frozen=True)
class CalibrationSet:
    """The engine runs calibration feeds the quantizer, and where they came from."""

    runs: tuple[Feeds, ...]
    samples: int  # requests collated into ``runs`` (fillers of a fixed batch not counted)
    source: dict[str, Any]  # for the build record: files or topic, skipped records

    def sha256(self) -> str:
        """The feeds' identity: names, dtypes, shapes and bytes, in run order. Two
        builds calibrated on equal feeds (the same files, preprocessed alike, or
        the same records) have equal keys, however the samples were stored."""
        digest = hashlib.sha256()
        for feeds in self.runs:
            for name in sorted(feeds):
                array = np.ascontiguousarray(feeds[name])
                digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
                digest.update(array.tobytes())
        return digest.hexdigest()


def engine_runs(inputs: ModelInputs, jobs: Sequence[Job], batch_size: int) -> list[Feeds]:
    """The feeds of the engine runs that answer ``jobs``, as the CPU stage makes
    them; raises ``ConfigError`` naming the sample where preparing one fails (an
    image file that does not decode)."""
    rows = [Row.of(job) for job in jobs]
    runnable = inputs.prepare(rows)
    failed = next((r for r in rows if r.error is not None), None)
    if failed is not None and failed.error is not None:
        raise ConfigError(f"calibration sample {_origin(failed.job)}: {failed.error.message}")
    runs: list[Feeds] = []
    size = inputs.batch or batch_size
    for group in inputs.groups(runnable):
        for start in range(0, len(group), size):
            part = group[start : start + size]
            if inputs.batch is not None:
                part = part + [part[-1]] * (inputs.batch - len(part))
            runs.append(inputs.collate(part).feeds)
    return runs


def _origin(job: Job) -> str:
    request = job.request
    return request.id if request is not None else f"{job.tp.topic}[{job.tp.partition}]@{job.offset}"


# --- files -----------------------------------------------------------------------


def from_files(
    paths: Sequence[Path], inputs: ModelInputs, limit: int, batch_size: int
) -> CalibrationSet:
    """At most ``limit`` samples from ``paths`` (see the module docstring), in
    the order given (a directory's files sorted by name)."""
    jobs: list[Job] = []
    files = list(_expand(paths))
    used: list[str] = []
    for path in files:
        if len(jobs) >= limit:
            break
        used.append(str(path))
        for i, values in enumerate(_samples(path, inputs)):
            if len(jobs) >= limit:
                break
            jobs.append(_checked(inputs, f"{path} [sample {i}]", values, len(jobs)))
    if not jobs:
        raise ConfigError(f"{FILES_FLAG}: no samples in {', '.join(map(str, paths))}")
    runs = engine_runs(inputs, jobs, batch_size)
    return CalibrationSet(tuple(runs), len(jobs), {"files": used})


def _expand(paths: Sequence[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in ARRAYS + IMAGES)
            if not found:
                raise ConfigError(
                    f"{FILES_FLAG} {path}: no {', '.join(ARRAYS + IMAGES)} files in the directory"
                )
            yield from found
        elif path.is_file():
            if path.suffix.lower() not in ARRAYS + IMAGES:
                raise ConfigError(
                    f"{FILES_FLAG} {path}: expected {', '.join(ARRAYS + IMAGES)} or a directory"
                )
            yield path
        else:
            raise ConfigError(f"{FILES_FLAG} {path}: no such file or directory")


def _samples(path: Path, inputs: ModelInputs) -> Iterator[dict[str, Any]]:
    """Each sample of ``path`` as request values by request input name."""
    names = [k.name for k in inputs.kinds]
    suffix = path.suffix.lower()
    if suffix in IMAGES:
        kind = inputs.kinds[0]
        if len(names) != 1 or not isinstance(kind, BoundImage):
            raise ConfigError(
                f"{FILES_FLAG} {path}: an image file calibrates a model whose one request input "
                f"is an image; this one takes {_takes(inputs)}"
            )
        data = path.read_bytes()
        fmt = sniff_format(data)
        if fmt is None:
            raise ConfigError(f"{FILES_FLAG} {path}: not a JPEG, PNG or WebP file")
        yield {kind.name: EncodedImage(fmt, data)}
        return
    arrays = _arrays(path, names, inputs)
    counts = {name: len(a) for name, a in arrays.items()}
    if len(set(counts.values())) > 1:
        raise ConfigError(f"{FILES_FLAG} {path}: the inputs' sample counts differ: {counts}")
    for i in range(next(iter(counts.values()))):
        yield {name: _value(inputs, name, a[i]) for name, a in arrays.items()}


def _arrays(path: Path, names: list[str], inputs: ModelInputs) -> dict[str, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{FILES_FLAG} {path}: cannot read it: {exc}") from None
    if isinstance(loaded, np.ndarray):
        if len(names) != 1:
            raise ConfigError(
                f"{FILES_FLAG} {path}: a .npy holds one request input, but the model takes "
                f"{_takes(inputs)}: give an .npz with one array per input, named after it"
            )
        arrays = {names[0]: loaded}
    else:
        with loaded:
            present = {k: np.asarray(loaded[k]) for k in loaded.files if k != "labels"}
        if len(names) == 1 and names[0] not in present and len(present) == 1:
            present = {names[0]: next(iter(present.values()))}
        missing = [n for n in names if n not in present]
        if missing:
            raise ConfigError(
                f"{FILES_FLAG} {path}: no array {missing[0]!r} (the model takes "
                f"{_takes(inputs)}; the archive has {', '.join(sorted(present)) or 'none'})"
            )
        arrays = {n: present[n] for n in names}
    for name, array in arrays.items():
        if array.ndim < 1:
            raise ConfigError(
                f"{FILES_FLAG} {path}: {name!r} is a scalar; samples are stacked on the first axis"
            )
    return arrays


def _value(inputs: ModelInputs, name: str, sample: np.ndarray) -> Any:
    if isinstance(inputs.by_name[name], BoundText) and sample.dtype.kind in "US":
        return str(sample.item() if sample.dtype.kind == "U" else sample.item().decode())
    return Tensor.from_numpy(np.ascontiguousarray(sample))


def _checked(inputs: ModelInputs, where: str, values: dict[str, Any], index: int) -> Job:
    """The sample as the intake would queue it; a sample the binding refuses
    names the input and what the model takes."""
    request = Request(v=1, id=where, inputs=values)
    try:
        checked, lengths = inputs.check(request)
    except InvalidRequest as exc:
        raise ConfigError(
            f"{FILES_FLAG} {where}: {exc}; the model takes {_takes(inputs)}"
        ) from None
    return Job(TopicPartition("calibration", 0), index, None, arrived=0.0, deadline=None,
               request=request, inputs=checked, lengths=lengths)  # fmt: skip


def _takes(inputs: ModelInputs) -> str:
    return "; ".join(k.describe() for k in inputs.kinds)


# --- a topic ---------------------------------------------------------------------


@dataclass(frozen=True)
class TopicSource:
    kafka: KafkaConfig  # the cluster and its security (``connection``), and for diagnosis
    topic: str
    count: int
    idle_timeout: float = 2.0  # the topic is read to its end once quiet this long
    timeout: float = 120.0


def from_topic(
    source: TopicSource, inputs: ModelInputs, limits: LimitsConfig, content_type: str,
    batch_size: int,
) -> CalibrationSet:  # fmt: skip
    """The first ``source.count`` requests of the topic the model takes."""
    factory = JobFactory(inputs, limits, 0, content_type)
    try:
        # A Kafka failure is diagnosed as the worker's is (``run_tool``): the
        # setting or permission to fix.
        jobs, seen, refused, first_refusal = run_tool(source.kafka, _read(source, factory))
    except TopicUnreadable as exc:
        raise ConfigError(f"{TOPIC_FLAG} {source.topic}: {exc}") from None
    if not jobs:
        if seen == 0:
            raise ConfigError(
                f"{TOPIC_FLAG} {source.topic}: the topic is empty (no record within "
                f"{source.idle_timeout:g} s of reading it from the beginning)"
            )
        raise ConfigError(
            f"{TOPIC_FLAG} {source.topic}: none of its {seen} records is a request the model "
            f"takes ({first_refusal}); the model takes {_takes(inputs)}"
        )
    runs = engine_runs(inputs, jobs, batch_size)
    return CalibrationSet(
        tuple(runs), len(jobs), {"topic": source.topic, "records_read": seen, "refused": refused}
    )


async def _read(source: TopicSource, factory: JobFactory) -> tuple[list[Job], int, int, str]:
    """Requests the intake accepts (up to ``count``), records read, records the
    intake refused among those looked at, the first refusal."""
    jobs: list[Job] = []
    seen = refused = 0
    refusal = ""
    last_new: float | None = None

    def take(c: Collector) -> None:
        nonlocal seen, refused, refusal, last_new
        bucket = c.records[source.topic]
        if bucket or last_new is None:
            last_new = time.monotonic()
        for rec in bucket:
            seen += 1
            if len(jobs) >= source.count:
                continue
            job = factory(source.topic, rec.partition, rec.offset, rec.record_key, rec.value,
                          None, list(rec.headers.items()))  # fmt: skip
            if job.failure is None:
                jobs.append(job)
                continue
            refused += 1
            if not refusal:
                refusal = f"partition {rec.partition} offset {rec.offset}: {job.failure}"
        bucket.clear()

    def done(_: Collector) -> bool:
        quiet = last_new is not None and time.monotonic() - last_new >= source.idle_timeout
        return len(jobs) >= source.count or quiet

    collector = Collector(connection(source.kafka), [source.topic])
    await collector.start()
    try:
        await collector.collect(done, source.timeout, progress=take)
    finally:
        await collector.stop()
    take(collector)
    return jobs, seen, refused, refusal
