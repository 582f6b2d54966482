"""Settings: a frozen dataclass tree built from one TOML file plus environment overrides.

The key names are a public surface (see README "Configuration"): every key can be
overridden by ``INFER_WORKER_<SECTION>__<KEY>`` (nested sections add more ``__``
parts, e.g. ``INFER_WORKER_MODEL__PREPROCESS__MEAN``). Unknown keys, in the file or
in the environment, are errors, so a typo never silently falls back to a default.
This module does no I/O beyond reading the file it is given.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from worker.errors import ConfigError

ENV_PREFIX = "INFER_WORKER_"


def _derive(section: object, name: str, value: object) -> None:
    """Fill in a default derived from other settings (sections are frozen)."""
    object.__setattr__(section, name, value)


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {message}")


@dataclass(frozen=True)
class KafkaConfig:
    bootstrap_servers: str = "localhost:9092"
    input_topics: tuple[str, ...] = ("infer.requests",)
    output_topic: str = "infer.results"
    dlq_topic: str = "infer.dlq"
    group_id: str = "infer-worker"
    # Static membership (KIP-345): a member restarting within session_timeout_ms
    # keeps its partitions, so a rolling restart causes no rebalances. Unique per
    # worker: set it from the pod name (e.g. "$(POD_NAME)"); empty = dynamic.
    group_instance_id: str = ""
    # Where crash-loop marks live (compacted; one key per group and partition).
    crash_guard_topic: str = "infer.crash-guard"
    client_id: str = "infer-worker"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "OAUTHBEARER"] = (
        "PLAIN"
    )
    # OAUTHBEARER (OAuth clusters, MSK IAM): "module:callable", a zero-argument
    # factory returning an aiokafka AbstractTokenProvider (see README).
    sasl_oauth_token_provider: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    session_timeout_ms: int = 10000
    heartbeat_interval_ms: int = 0  # 0 = min(3000, session_timeout_ms / 3), Kafka's advice
    max_poll_interval_ms: int = 300000
    max_poll_records: int = 500
    fetch_max_bytes: int = 52428800
    # How long the broker may hold a fetch waiting for data: an upper bound on the
    # latency an idle partition adds to a new request.
    fetch_max_wait_ms: int = 100
    max_partition_fetch_bytes: int = 8388608
    # Producer side: results can carry tensors, so allow more than Kafka's 1 MB default.
    max_request_size: int = 16777216
    compression_type: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "none"
    linger_ms: int = 2
    request_timeout_ms: int = 30000
    # Producer: how long to wait between redelivery attempts of unacknowledged
    # results (doubling up to 10 s) while the broker is unreachable.
    retry_backoff_ms: int = 200
    metadata_max_age_ms: int = 300000
    # Idempotent producer (the producer's own retries never duplicate a result):
    # "auto" tries it and, where the broker refuses InitProducerId (the embedded
    # broker does), warns and produces without; true requires it; false: off.
    enable_idempotence: Literal["auto", True, False] = "auto"
    # Any other aiokafka consumer/producer argument, passed through as given
    # ([kafka.consumer_options] in TOML, INFER_WORKER_KAFKA__CONSUMER_OPTIONS__<ARG>).
    # Arguments the worker sets itself are refused: they carry its guarantees.
    consumer_options: dict[str, str | int | float | bool] = field(default_factory=dict)
    producer_options: dict[str, str | int | float | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(bool(self.bootstrap_servers.strip()), "kafka.bootstrap_servers", "must not be empty")
        _check(len(self.input_topics) > 0, "kafka.input_topics", "needs at least one topic")
        topics = (*self.input_topics, self.output_topic, self.dlq_topic)
        _check(all(t.strip() for t in topics), "kafka.*_topic(s)", "topic names must not be empty")
        _check(
            self.output_topic not in self.input_topics and self.dlq_topic not in self.input_topics,
            "kafka.output_topic",
            "output and DLQ topics must differ from the input topics (a result would loop)",
        )
        _check(bool(self.group_id), "kafka.group_id", "must not be empty")
        _check(self.session_timeout_ms >= 100, "kafka.session_timeout_ms", "must be >= 100")
        if self.heartbeat_interval_ms == 0:
            _derive(self, "heartbeat_interval_ms", max(1, min(3000, self.session_timeout_ms // 3)))
        _check(
            0 < self.heartbeat_interval_ms < self.session_timeout_ms,
            "kafka.heartbeat_interval_ms",
            "must be > 0 and below session_timeout_ms",
        )
        _check(self.max_poll_records >= 1, "kafka.max_poll_records", "must be >= 1")
        _check(self.max_request_size >= 1024, "kafka.max_request_size", "must be >= 1024")
        _check(self.request_timeout_ms > 0, "kafka.request_timeout_ms", "must be > 0")
        _check(
            isinstance(self.enable_idempotence, bool) or self.enable_idempotence == "auto",
            "kafka.enable_idempotence",
            'must be "auto", true or false',
        )
        if self.security_protocol.startswith("SASL") and self.sasl_mechanism in (
            "PLAIN",
            "SCRAM-SHA-256",
            "SCRAM-SHA-512",
        ):
            _check(
                self.sasl_plain_username is not None and self.sasl_plain_password is not None,
                "kafka.sasl_plain_username",
                f"{self.security_protocol} with {self.sasl_mechanism} needs username and password",
            )
        if self.security_protocol.startswith("SASL") and self.sasl_mechanism == "OAUTHBEARER":
            _check(
                ":" in (self.sasl_oauth_token_provider or ""),
                "kafka.sasl_oauth_token_provider",
                "OAUTHBEARER needs a token provider factory as 'module:callable'",
            )


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_size: int = 64
    # Measured from the oldest request in the forming batch.
    max_queue_delay_ms: float = 5.0
    # Sizes the engine is tuned for; a batch of one of these is sent without waiting.
    # Empty (Triton's default): batches flush when full, on the delay or a deadline.
    preferred_batch_sizes: tuple[int, ...] = ()
    max_inflight_batches: int = 4
    # Decoded requests waiting for a batch; consumption blocks beyond this.
    # 0 = max(2048, 2 * max_batch_size).
    queue_capacity: int = 0
    # Backpressure: partitions are paused while this many records (or bytes) are
    # read but not yet answered, and resumed at half of it.
    # 0 = max(1024, 2 * max_batch_size * max_inflight_batches).
    max_inflight_records: int = 0
    max_inflight_bytes: int = 268435456
    # A failing batch is split in halves until the failing request is alone; a lone
    # failing request is run this many times before it is answered inference_failed.
    max_attempts: int = 2
    # > 0: a record whose Kafka timestamp is older than this when its batch is
    # dispatched is answered deadline_exceeded without engine time (stale backlogs
    # after an outage). With a request's deadline_ms, the earlier rule wins.
    max_record_age_ms: int = 0

    def __post_init__(self) -> None:
        _check(self.max_batch_size >= 1, "batching.max_batch_size", "must be >= 1")
        _check(self.max_record_age_ms >= 0, "batching.max_record_age_ms", "must be >= 0 (0: off)")
        _check(
            math.isfinite(self.max_queue_delay_ms) and self.max_queue_delay_ms >= 0,
            "batching.max_queue_delay_ms",
            "must be a finite number >= 0",
        )
        for size in self.preferred_batch_sizes:
            _check(
                1 <= size <= self.max_batch_size,
                "batching.preferred_batch_sizes",
                f"{size} is outside 1..max_batch_size ({self.max_batch_size})",
            )
        _check(self.max_inflight_batches >= 1, "batching.max_inflight_batches", "must be >= 1")
        # Defaults that depend on another setting are derived from it, so that no
        # default can conflict with a valid value of that setting.
        if self.queue_capacity == 0:
            _derive(self, "queue_capacity", max(2048, 2 * self.max_batch_size))
        if self.max_inflight_records == 0:
            per_flight = 2 * self.max_batch_size * self.max_inflight_batches
            _derive(self, "max_inflight_records", max(1024, per_flight))
        _check(self.queue_capacity >= 1, "batching.queue_capacity", "must be >= 1 (0: derived)")
        _check(
            self.max_inflight_records >= 1,
            "batching.max_inflight_records",
            "must be >= 1 (0: derived)",
        )
        _check(self.max_inflight_bytes > 0, "batching.max_inflight_bytes", "must be > 0")
        _check(self.max_attempts >= 1, "batching.max_attempts", "must be >= 1")


@dataclass(frozen=True)
class PreprocessConfig:
    size: tuple[int, int] = (8, 8)  # model input (height, width)
    channels: int = 1
    scale: float = 1.0 / 255.0  # applied to uint8 before mean/std
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    dtype: Literal["float32", "float16"] = "float32"
    device: Literal["cpu", "gpu"] = "cpu"

    def __post_init__(self) -> None:
        p = "model.preprocess"
        _check(len(self.size) == 2 and min(self.size) >= 1, f"{p}.size", "must be [height, width]")
        _check(self.channels in (1, 3, 4), f"{p}.channels", "must be 1, 3 or 4")
        _check(len(self.mean) == self.channels, f"{p}.mean", "needs one value per channel")
        _check(len(self.std) == self.channels, f"{p}.std", "needs one value per channel")
        _check(all(s > 0 for s in self.std), f"{p}.std", "values must be > 0")
        _check(math.isfinite(self.scale) and self.scale > 0, f"{p}.scale", "must be > 0")


@dataclass(frozen=True)
class PostprocessConfig:
    softmax: bool = True
    top_k: int = 3  # 0 disables top-k outputs
    include_raw: bool = False  # also return the engine's raw output tensor

    def __post_init__(self) -> None:
        _check(self.top_k >= 0, "model.postprocess.top_k", "must be >= 0")


@dataclass(frozen=True)
class TorchConfig:
    """How the torch backend runs its model (``[model.torch]``).

    Batches are padded up to a bucket (``batching.preferred_batch_sizes``, else
    powers of two up to ``batching.max_batch_size``), and every bucket is run
    (compiled, and captured as a CUDA graph per slot) before the worker joins
    its consumer group, so no request waits on compilation or a new shape.
    """

    # torch.compile mode for exported programs (.pt2); TorchScript files run as
    # they are. "off" runs the module eagerly. CUDA graphs are captured by the
    # engine itself (cuda_graphs), which is why the "reduce-overhead" mode (its
    # own graphs, per thread) is not offered.
    compile: Literal["off", "default", "max-autotune-no-cudagraphs"] = "default"
    # The dtype the model computes in; "auto" = model.preprocess.dtype. bf16 casts
    # the preprocessed input on the device, inside the captured graph.
    precision: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    channels_last: bool = True  # 4-D inputs and weights in NHWC memory order
    # One CUDA graph per (slot, bucket), replayed on the slot's stream. A model
    # that cannot be captured stops start-up (exit 2) naming this key: set false.
    cuda_graphs: bool = True


@dataclass(frozen=True)
class ModelConfig:
    name: str = "digits"
    path: str = "builtin:digits"
    backend: Literal["onnxruntime", "tensorrt", "torch"] = "onnxruntime"
    input: str = "image"  # the request input fed to the model
    output: str | None = None  # engine output to postprocess; None = the first one
    intra_op_threads: int = 1
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    postprocess: PostprocessConfig = field(default_factory=PostprocessConfig)
    torch: TorchConfig = field(default_factory=TorchConfig)

    def __post_init__(self) -> None:
        _check(bool(self.name), "model.name", "must not be empty")
        _check(
            not (self.backend == "onnxruntime" and self.preprocess.device == "gpu"),
            "model.preprocess.device",
            "'gpu' needs backend tensorrt or torch (onnxruntime preprocesses on the CPU)",
        )
        _check(bool(self.path), "model.path", "must not be empty")
        _check(self.intra_op_threads >= 0, "model.intra_op_threads", "must be >= 0")


@dataclass(frozen=True)
class GpuConfig:
    """Provisioning of the GPU stage (backends ``tensorrt`` and ``torch``)."""

    device: int = 0
    # Batches in flight on the device (one CUDA stream + buffers each);
    # 0 = batching.max_inflight_batches. TensorRT plans need one profile per slot.
    num_slots: int = 0
    # Packed uint8 image bytes one slot stages for GPU preprocessing.
    max_input_bytes: int = 32 * 1024 * 1024
    cuda_graphs: bool = False  # TensorRT: a CUDA graph per slot for full batches (README)
    # Where encoded JPEGs are decoded: "host" (Pillow on the stage's threads) or
    # "nvjpeg" (torchvision's batched nvJPEG on the slot's stream, straight into
    # device memory; PNG, WebP and JPEGs nvJPEG refuses are decoded on the host).
    decode: Literal["host", "nvjpeg"] = "host"
    poll_interval_ms: float = 50.0  # safety net behind the completion callback
    batch_timeout_ms: int = 60000  # a batch still running after this: device hung

    def __post_init__(self) -> None:
        _check(self.device >= 0, "gpu.device", "must be >= 0")
        _check(self.num_slots >= 0, "gpu.num_slots", "must be >= 0")
        _check(self.max_input_bytes > 0, "gpu.max_input_bytes", "must be > 0")
        _check(self.poll_interval_ms > 0, "gpu.poll_interval_ms", "must be > 0")
        _check(self.batch_timeout_ms > 0, "gpu.batch_timeout_ms", "must be > 0")


@dataclass(frozen=True)
class LimitsConfig:
    max_record_bytes: int = 8 * 1024 * 1024
    max_tensor_bytes: int = 4 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    # Crashes of whole processes with the same record at the head of a partition
    # before that record is quarantined to the DLQ (crash_loop); 0 disables.
    # Needs kafka.crash_guard_topic to exist.
    max_crash_attempts: int = 3

    def __post_init__(self) -> None:
        _check(self.max_crash_attempts >= 0, "limits.max_crash_attempts", "must be >= 0")
        _check(self.max_record_bytes > 0, "limits.max_record_bytes", "must be > 0")
        _check(self.max_tensor_bytes > 0, "limits.max_tensor_bytes", "must be > 0")
        _check(self.max_image_pixels > 0, "limits.max_image_pixels", "must be > 0")


@dataclass(frozen=True)
class DlqConfig:
    """A budget on records that fail (DLQ records and ``inference_failed`` results):
    past it the worker halts with an error instead of draining a whole topic into
    the DLQ because of something systematic (a wrong serializer upstream, a
    broken model)."""

    max_consecutive: int = 1000  # 0 disables
    max_ratio: float = 0.5  # failures / records over the last ``window`` records
    window: int = 2000

    def __post_init__(self) -> None:
        _check(self.max_consecutive >= 0, "dlq.max_consecutive", "must be >= 0")
        _check(0.0 < self.max_ratio <= 1.0, "dlq.max_ratio", "must be in (0, 1]")
        _check(self.window >= 1, "dlq.window", "must be >= 1")


@dataclass(frozen=True)
class ShutdownConfig:
    # SIGTERM: stop fetching, drain, commit and leave within this budget.
    drain_timeout_ms: int = 30000

    def __post_init__(self) -> None:
        _check(self.drain_timeout_ms >= 0, "shutdown.drain_timeout_ms", "must be >= 0")


@dataclass(frozen=True)
class MetricsConfig:
    port: int = 9108  # 0 disables the HTTP endpoint
    host: str = "0.0.0.0"
    # /livez fails once the event loop has not ticked for this long.
    liveness_timeout_ms: int = 10000

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "metrics.port", "must be 0..65535")
        _check(self.liveness_timeout_ms > 0, "metrics.liveness_timeout_ms", "must be > 0")


@dataclass(frozen=True)
class LoggingConfig:
    format: Literal["auto", "json", "console"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass(frozen=True)
class Settings:
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    dlq: DlqConfig = field(default_factory=DlqConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# --- loading ---------------------------------------------------------------------------


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Defaults, then the TOML file (if any), then ``INFER_WORKER_*`` variables."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    _apply_env(data, env if env is not None else _os_environ())
    settings: Settings = _build(Settings, data, "")
    return settings


def _os_environ() -> Mapping[str, str]:
    import os

    return os.environ


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> None:
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
        if len(parts) < 2 or not all(parts):
            raise ConfigError(
                f"{name}: expected {ENV_PREFIX}<SECTION>__<KEY> (e.g. "
                f"{ENV_PREFIX}KAFKA__BOOTSTRAP_SERVERS)"
            )
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name}: {part} is not a section")
            node = child
        node[parts[-1]] = _EnvValue(raw)


@dataclass(frozen=True)
class _EnvValue:
    """A raw environment string; converted once the target field's type is known."""

    raw: str


def _build(cls: type[Any], data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (known: {', '.join(sorted(names))})")
    kwargs = {key: _convert(hints[key], value, f"{prefix}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # defensive: a shape we did not convert
        raise ConfigError(f"{prefix.rstrip('.')}: {exc}") from exc


def _convert(tp: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(tp):
        if isinstance(value, _EnvValue):
            raise ConfigError(f"{name}: is a section; set its keys instead")
        return _build(typing.cast(type[Any], tp), value, f"{name}.")
    if isinstance(value, _EnvValue):
        value = _parse_env(tp, value.raw)
    origin = get_origin(tp)
    args = get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, name)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{name}: {value!r} is not one of {choices}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name}: expected a list, got {type(value).__name__}")
        item_tp = args[0]
        if len(args) != 2 or args[1] is not Ellipsis:  # fixed-length tuple
            if len(value) != len(args):
                raise ConfigError(f"{name}: expected {len(args)} items, got {len(value)}")
            return tuple(
                _convert(a, v, f"{name}[{i}]")
                for i, (a, v) in enumerate(zip(args, value, strict=True))
            )
        return tuple(_convert(item_tp, v, f"{name}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name}: expected a table, got {type(value).__name__}")
        return {str(k): _option(v, f"{name}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{name}: unsupported setting type {tp!r}")  # pragma: no cover


def _option(value: Any, name: str) -> str | int | float | bool:
    """A passed-through client argument: a TOML scalar as written; from the
    environment, a TOML literal where one parses (``true``, ``5``), else the text."""
    if isinstance(value, _EnvValue):
        try:
            value = tomllib.loads(f"v = {value.raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = value.raw
    if not isinstance(value, str | int | float | bool):
        raise ConfigError(f"{name}: expected a string, number or boolean, got {value!r}")
    return value


def _parse_env(tp: Any, raw: str) -> Any:
    """Environment values are TOML literals where that parses (``true``, ``[8, 8]``,
    ``5``); strings may be given bare, and string lists as ``a,b,c``."""
    try:
        parsed = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = None
    else:
        if get_origin(tp) is tuple and _accepts_str(get_args(tp)[0]):
            if isinstance(parsed, list):
                return parsed
            # A scalar for a list of strings names one or more items: ``2024`` and
            # ``true`` are valid topic names, not an integer or a boolean.
            text = parsed if isinstance(parsed, str) else raw
            return [part.strip() for part in text.split(",") if part.strip()]
        if isinstance(parsed, str) or not _accepts_str(tp):
            return parsed
    if _accepts_str(tp):
        return raw
    if get_origin(tp) is tuple:
        return [part.strip() for part in raw.split(",") if part.strip()]
    return raw


def _accepts_str(tp: Any) -> bool:
    if tp is str:
        return True
    args = get_args(tp)
    if get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in args)
    if get_origin(tp) in (types.UnionType, typing.Union):
        return any(_accepts_str(a) for a in args)
    return False


def redacted(settings: Settings) -> dict[str, Any]:
    """The settings as a dict for start-up logs, with secrets masked."""
    out = dataclasses.asdict(settings)
    if out["kafka"].get("sasl_plain_password") is not None:
        out["kafka"]["sasl_plain_password"] = "***"
    return out
