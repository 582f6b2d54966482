"""Settings: TOML + environment overrides, and errors that name the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.documentation import documentation
from worker.config import load_settings, redacted
from worker.flow.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "worker.example.toml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "w.toml"
    p.write_text(text)
    return p


def test_defaults_match_the_design() -> None:
    s = load_settings(env={})
    assert s.kafka.input_topics == ("infer.requests",)
    assert s.batching.max_batch_size == 64
    assert s.batching.preferred_batch_sizes == ()  # Triton's default: never conflicts
    assert s.batching.queue_capacity == 2048 and s.batching.max_inflight_records == 1024
    assert s.kafka.heartbeat_interval_ms == 3000
    assert s.model.path == "builtin:digits" and s.model.backend == "onnxruntime"
    assert s.metrics.port == 9108


def test_example_config_in_repo_loads() -> None:
    s = load_settings(EXAMPLE, env={})
    assert s.kafka.output_topic


def test_the_example_file_holds_the_defaults_and_says_them_as_readme_does() -> None:
    """worker.example.toml's values are the configuration types' defaults, and a
    derived default is written the same in the example, in README and in the code
    (issue 56: the example said 8 MiB where the code derives 1 MiB)."""
    import re

    from worker.config import KafkaConfig, LaneConfig

    example, defaults = load_settings(EXAMPLE, env={}), load_settings(env={})
    # [model] spells out the digits classifier's preprocessing, which the default derives.
    for section in (f.name for f in dataclasses.fields(defaults) if f.name != "model"):
        assert getattr(example, section) == getattr(defaults, section), section
    plain = KafkaConfig().max_partition_fetch_bytes
    lanes = KafkaConfig(input_topics=("a", "b"),
                        lanes=(LaneConfig(("a",)), LaneConfig(("b",), 1))).max_partition_fetch_bytes
    assert (plain, lanes) == (1 << 20, 64 << 10)
    said = "0 = 1 MiB, or 64 KiB with"
    assert re.search(r"^max_partition_fetch_bytes = 0 +# " + said, EXAMPLE.read_text(), re.M)
    readme = documentation()
    assert "`max_partition_fetch_bytes` (" + said in readme


def test_file_then_env_override(tmp_path: Path) -> None:
    p = write(tmp_path, '[kafka]\nbootstrap_servers = "file:9092"\ngroup_id = "g"\n')
    s = load_settings(
        p,
        env={
            "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": "env:9092",
            "INFER_WORKER_KAFKA__INPUT_TOPICS": "a, b",
            "INFER_WORKER_BATCHING__MAX_BATCH_SIZE": "32",
            "INFER_WORKER_BATCHING__PREFERRED_BATCH_SIZES": "[8, 32]",
            "INFER_WORKER_MODEL__PREPROCESS__SIZE": "[16, 16]",
            "INFER_WORKER_MODEL__POSTPROCESS__SOFTMAX": "false",
            "OTHER_VARIABLE": "ignored",
        },
    )
    assert s.kafka.bootstrap_servers == "env:9092"
    assert s.kafka.group_id == "g"
    assert s.kafka.input_topics == ("a", "b")
    assert s.batching.max_batch_size == 32
    assert s.batching.preferred_batch_sizes == (8, 32)
    assert s.model.preprocess.size == (16, 16)
    assert s.model.postprocess.softmax is False


def test_string_field_keeps_values_that_look_like_toml() -> None:
    s = load_settings(env={"INFER_WORKER_KAFKA__GROUP_ID": "true"})
    assert s.kafka.group_id == "true"


@pytest.mark.parametrize(
    ("raw", "topics"),
    [("2024", ("2024",)), ("true", ("true",)), ('"a"', ("a",)), ("1e3, b", ("1e3", "b"))],
)
def test_string_list_keeps_names_that_look_like_toml(raw: str, topics: tuple[str, ...]) -> None:
    """Valid topic names such as ``2024`` parse as TOML scalars; they are names."""
    s = load_settings(env={"INFER_WORKER_KAFKA__INPUT_TOPICS": raw})
    assert s.kafka.input_topics == topics


@pytest.mark.parametrize(
    ("text", "env", "field"),
    [
        ("[kafka]\nbootstrap = 'x'\n", {}, "kafka.bootstrap"),
        ("[nope]\n", {}, "nope"),
        ("", {"INFER_WORKER_KAFKA__NOPE": "1"}, "kafka.nope"),
        ("[batching]\nmax_batch_size = 'big'\n", {}, "batching.max_batch_size"),
        ("[batching]\nmax_batch_size = -1\n", {}, "batching.max_batch_size"),
        (
            "[batching]\nmax_batch_size = 8\npreferred_batch_sizes = [16]\n",
            {},
            "batching.preferred_batch_sizes",
        ),
        ("[kafka]\nheartbeat_interval_ms = 20000\n", {}, "kafka.heartbeat_interval_ms"),
        ("[kafka]\nsecurity_protocol = 'TLS'\n", {}, "kafka.security_protocol"),
        ("[kafka]\noutput_topic = 'infer.requests'\n", {}, "kafka.output_topic"),
        ("[model]\nbackend = 'tensorflow'\n", {}, "model.backend"),
        ("[model.preprocess]\nchannels = 3\nmean = [0.1, 0.2]\n", {}, "model.preprocess.mean"),
        ("[model.preprocess]\nstd = [0.0]\n", {}, "model.preprocess.std"),
        ("[model.preprocess]\nsize = [8]\n", {}, "model.preprocess.size"),
        ("[kafka]\nsession_timeout_ms = true\n", {}, "kafka.session_timeout_ms"),
        ("", {"INFER_WORKER_BATCHING": "1"}, "INFER_WORKER_BATCHING"),
        ("[kafka]\nsecurity_protocol = 'SASL_SSL'\n", {}, "kafka.sasl_plain_username"),
    ],
)
def test_invalid_config_names_the_field(
    tmp_path: Path, text: str, env: dict[str, str], field: str
) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.").replace("[", r"\[")):
        load_settings(write(tmp_path, text), env=env)


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_settings(write(tmp_path, "[kafka\n"), env={})
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "absent.toml", env={})


def test_redacted_masks_password(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "[kafka]\nsecurity_protocol = 'SASL_PLAINTEXT'\n"
        "sasl_plain_username = 'u'\nsasl_plain_password = 'secret'\n",
    )
    out = redacted(load_settings(p, env={}))
    assert out["kafka"]["sasl_plain_password"] == "***"
    assert "secret" not in repr(out)


def test_gpu_preprocessing_needs_a_gpu_backend() -> None:
    with pytest.raises(ConfigError, match=r"model\.preprocess\.device"):
        load_settings(env={"INFER_WORKER_MODEL__PREPROCESS__DEVICE": "gpu"})
    s = load_settings(
        env={
            "INFER_WORKER_MODEL__PREPROCESS__DEVICE": "gpu",
            "INFER_WORKER_MODEL__BACKEND": "torch",
        }
    )
    assert s.model.preprocess.device == "gpu"


def test_client_options_tables_take_toml_scalars_only(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    path.write_text('[kafka.consumer_options]\nisolation_level = "read_committed"\n')
    assert load_settings(path, env={}).kafka.consumer_options == {
        "isolation_level": "read_committed"
    }
    path.write_text("[kafka.producer_options]\nenable_idempotence = [1]\n")
    with pytest.raises(ConfigError, match=r"kafka\.producer_options\.enable_idempotence"):
        load_settings(path, env={})


def _numeric_fields() -> list[tuple[str, str, object]]:
    """Every int/float setting: (section, key, its type), nested model sections too."""
    import dataclasses
    import typing

    from worker.config import Settings

    out: list[tuple[str, str, object]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")  # type: ignore[arg-type]
            elif tp in (int, float):
                out.append((prefix.rstrip("."), f.name, tp))

    walk(Settings, "")
    return out


# Settings whose own rule starts above 1 (every other numeric setting accepts 1).
_OWN_MINIMUM = {
    ("kafka", "max_request_size"): "1024",
    ("kafka", "session_timeout_ms"): "100",
    ("metrics", "lag_interval_ms"): "100",
}


@pytest.mark.parametrize(("section", "key", "tp"), _numeric_fields())
def test_a_small_valid_value_of_any_setting_never_conflicts_with_a_default(
    section: str, key: str, tp: object
) -> None:
    """Issue 10: ``max_batch_size = 32`` refused to start against the default
    preferred sizes. Every numeric setting, set alone to a small value its own
    rule accepts, must load with every other setting at its default."""
    value = _OWN_MINIMUM.get((section, key), "1" if tp is int else "1.0")
    env_key = f"INFER_WORKER_{section.upper().replace('.', '__')}__{key.upper()}"
    s = load_settings(env={env_key: value})
    node: object = s
    for part in (*section.split("."), key):
        node = getattr(node, part)
    assert node == (int(value) if tp is int else float(value))


@pytest.mark.parametrize("size", [1, 16, 32, 4096])
def test_max_batch_size_alone_loads_and_derives_what_depends_on_it(size: int) -> None:
    s = load_settings(env={"INFER_WORKER_BATCHING__MAX_BATCH_SIZE": str(size)})
    assert s.batching.max_batch_size == size
    assert s.batching.queue_capacity >= size and s.batching.max_inflight_records >= size


def test_short_session_timeout_derives_the_heartbeat() -> None:
    s = load_settings(env={"INFER_WORKER_KAFKA__SESSION_TIMEOUT_MS": "1500"})
    assert s.kafka.heartbeat_interval_ms == 500
