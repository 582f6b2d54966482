"""Settings: a frozen dataclass tree built from one TOML file plus environment overrides.

The key names are a public surface (see docs/guides/configure.md): every key can be
overridden by ``INFER_WORKER_<SECTION>__<KEY>`` (nested sections add more ``__``
parts, e.g. ``INFER_WORKER_MODEL__PREPROCESS__MEAN``). Unknown keys, in the file or
in the environment, are errors, so a typo never silently falls back to a default.
This module does no I/O beyond reading the file it is given and the model
repository's directory it names (``worker.config.repository_files``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.config.checks import check
from worker.config.kafka import KafkaConfig
from worker.config.lanes import LaneConfig
from worker.config.loading import ENV_PREFIX, load_tree, redacted_tree
from worker.config.model import (
    BundledModel,
    ModelConfig,
    PostprocessConfig,
    PreprocessConfig,
    TorchConfig,
)
from worker.config.models import check_models
from worker.config.pipelines import PipelineConfig, StepConfig
from worker.config.registry import SchemaRegistryConfig
from worker.config.repository import RepositoryConfig
from worker.config.repository_files import with_repository
from worker.config.runtime import (
    BatchingConfig,
    DlqConfig,
    GpuConfig,
    LimitsConfig,
    LoggingConfig,
    MetricsConfig,
    ShutdownConfig,
    TracingConfig,
)
from worker.config.secret import Secret


@dataclass(frozen=True)
class Settings:
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    # One model: the shorthand for a worker of one model, named from its path; the bundled
    # digits model where no model is configured at all (BundledModel marks it unset).
    model: ModelConfig = field(default_factory=BundledModel)
    # Models, each a [models.NAME] with every key [model] has and the input topics it
    # answers (models.NAME.topics; a [model] beside them answers the rest), each key also
    # INFER_WORKER_MODELS__<NAME>__<KEY>: docs/guides/models.md. A configuration of
    # [models.NAME] sections alone is complete: no [model] is served then.
    models: dict[str, ModelConfig] = field(default_factory=dict)
    # A model repository: a directory of models, each served as a [models.NAME] of its own
    # settings file, at the version a policy names, read at start-up: docs/guides/models.md.
    repository: RepositoryConfig = field(default_factory=RepositoryConfig)
    # Models run one after another, one answer per request: each a [pipelines.NAME] with its
    # input topics, its steps (models of the worker, functions between them) and its outputs:
    # docs/guides/pipelines.md.
    pipelines: dict[str, PipelineConfig] = field(default_factory=dict)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    dlq: DlqConfig = field(default_factory=DlqConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # Requests and results in a Schema Registry's wire format (Avro):
    # docs/guides/schema-registry.md.
    schema_registry: SchemaRegistryConfig = field(default_factory=SchemaRegistryConfig)

    def __post_init__(self) -> None:
        check_models(self)  # every input topic answered by exactly one model or pipeline
        check(not self.kafka.control_topic or bool(self.repository.path), "kafka.control_topic",
              "sets the versions of the repository's models: it needs [repository] path")


def load_settings(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Defaults, then the TOML file (if any), then ``INFER_WORKER_*`` variables;
    then the models of ``[repository]`` (its directory read here, once)."""
    return load_tree(Settings, path, env, complete=with_repository)


def redacted(settings: Settings) -> dict[str, Any]:
    """The settings as a dict for start-up logs, with secrets masked."""
    return redacted_tree(settings)


__all__ = [
    "ENV_PREFIX",
    "BatchingConfig",
    "DlqConfig",
    "GpuConfig",
    "KafkaConfig",
    "LaneConfig",
    "LimitsConfig",
    "LoggingConfig",
    "MetricsConfig",
    "ModelConfig",
    "PipelineConfig",
    "PostprocessConfig",
    "PreprocessConfig",
    "RepositoryConfig",
    "SchemaRegistryConfig",
    "Secret",
    "Settings",
    "ShutdownConfig",
    "StepConfig",
    "TorchConfig",
    "TracingConfig",
    "load_settings",
    "redacted",
]
