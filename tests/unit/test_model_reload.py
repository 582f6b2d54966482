"""The checks a new model version passes before it is swapped in (``worker.app.
reload``), without a broker: a version that binds other request inputs or drops
a returned output is refused, an engine that cannot run fails its self-test.
The swap under load on Apache Kafka: tests/faults/test_model_swap.py."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from worker.app.reload import compatible, self_test
from worker.compute.engines import load_engine
from worker.config import LimitsConfig, ModelConfig
from worker.flow.errors import ConfigError
from worker.model.files import bundled_file
from worker.model.inputs import bind_model
from worker.model.inputs.binding import configured_inputs


def binding(path: str, **model: object) -> object:
    cfg = ModelConfig(path=path, **model)  # type: ignore[arg-type]
    return bind_model(cfg, load_engine(cfg).info.io, LimitsConfig())


def test_the_same_model_is_compatible_and_runs_its_self_test() -> None:
    b = binding("builtin:digits")
    assert compatible(b, binding("builtin:digits")) is None  # type: ignore[arg-type]
    assert self_test(load_engine(ModelConfig(path="builtin:digits"))) is None  # type: ignore[arg-type]


def test_other_request_inputs_are_refused() -> None:
    problem = compatible(binding("builtin:digits"), binding("builtin:sentiment"))  # type: ignore[arg-type]
    assert problem is not None and "request inputs differ" in problem


def test_a_version_that_drops_a_returned_output_is_refused(tmp_path: Path) -> None:
    m = onnx.load(str(bundled_file("sentiment.onnx")))
    kept = [o for o in m.graph.output if o.name == "logits"]
    del m.graph.output[:]
    m.graph.output.extend(kept)
    smaller = tmp_path / "smaller.onnx"
    onnx.save(m, str(smaller))
    text = configured_inputs(ModelConfig(path="builtin:sentiment"))  # its text input
    problem = compatible(
        binding("builtin:sentiment"),  # type: ignore[arg-type]
        binding(str(smaller), inputs=text),  # type: ignore[arg-type]
    )
    assert problem is not None and "token_scores" in problem


def test_reloading_is_refused_on_the_gpu_path() -> None:
    from worker.app.plan import RunPlan
    from worker.config import load_settings

    s = load_settings(env={"INFER_WORKER_MODEL__BACKEND": "torch",
                           "INFER_WORKER_MODEL__RELOAD_INTERVAL_S": "5"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"model\.reload_interval_s"):
        RunPlan.of(s)
