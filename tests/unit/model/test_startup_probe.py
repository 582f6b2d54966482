"""The start-up probe checks every model's declared outputs, free spatial
dimensions too: a fully convolutional detector (a 12x12 receptive field) fails
on 1x1 zeros and is probed at the first length it runs at; a model that runs at
no length is named in a warning, never silently unchecked."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
from structlog.testing import capture_logs

from worker.app.probe import check_declarations
from worker.compute.engines import Engine, load_engine
from worker.config import BatchingConfig, LimitsConfig, ModelConfig
from worker.flow.errors import ConfigError
from worker.model.inputs import bind_model

pytest.importorskip("onnx")


def _probe(path: Path) -> list[dict[str, object]]:
    cfg = ModelConfig(path=str(path))
    engine = cast(Engine, load_engine(cfg))
    binding = bind_model(cfg, engine.info.io, LimitsConfig(), BatchingConfig())
    try:
        with capture_logs() as logs:
            check_declarations(engine, binding.io, binding.outputs, cfg.name)
    finally:
        engine.close()
    return logs


def test_a_detector_whose_declaration_holds_is_probed_where_it_runs(tmp_path: Path) -> None:
    from tests.onnx_models import conv_detector

    logs = _probe(conv_detector(tmp_path / "det.onnx"))
    assert [e["event"] for e in logs] == ["startup_probe"]
    assert logs[0]["free_dimensions"] == 16 and logs[0]["model"] == "det"


def test_a_detector_whose_declaration_breaks_is_refused_though_1x1_fails(
    tmp_path: Path,
) -> None:
    """It was let through: its 1x1 probe failed, and the probe was skipped."""
    from tests.onnx_models import conv_detector

    with pytest.raises(ConfigError, match=r"model\.path: a run on zeros \(free dimensions of "
                       r"length 16\): .*heat"):  # fmt: skip
        _probe(conv_detector(tmp_path / "det.onnx", squeezed=True))


def test_a_model_that_runs_at_no_length_is_named_in_a_warning(tmp_path: Path) -> None:
    """Zeros of every probed length (a power of two) reach a Reshape to rows of 7
    values, which none of them fills."""
    from onnx import TensorProto, helper

    from tests.onnx_models import _save

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])], "never",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 7])],
        [helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 7])],
    )  # fmt: skip
    logs = _probe(_save(graph, tmp_path / "never.onnx"))
    (warning,) = [e for e in logs if e["event"] == "startup_probe_skipped"]
    assert warning["log_level"] == "warning" and warning["model"] == "never"
