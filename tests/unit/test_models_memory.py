"""The models' memory budget (``limits.max_models_memory_mb``): each model measured
as it loads, a configuration over the budget refused before the worker contacts
Kafka, naming every model and its size."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from worker.app.memory import check_budget, measured, resident_bytes
from worker.flow.errors import ConfigError

TWO = """
[kafka]
bootstrap_servers = "127.0.0.1:1"  # nothing listens: the budget refuses first
input_topics = ["digits.requests", "wide.requests"]
[limits]
max_models_memory_mb = {budget}
[model]
path = "builtin:digits"
[models.wide]
path = "{wide}"
topics = ["wide.requests"]
"""


def wide(path: Path) -> Path:
    """``x`` float32 [batch, 1024] @ 16 MiB of weights: a model whose load is seen."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).normal(size=(1024, 4096)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4096])],
        [numpy_helper.from_array(w, "w")],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


async def test_a_load_is_measured_by_the_resident_memory_it_adds() -> None:
    if resident_bytes() is None:
        pytest.skip("no /proc/self/statm here")
    block, size = await measured(lambda: np.ones(64 << 20, np.uint8))  # touched: resident
    assert block.nbytes <= size < 2 * block.nbytes


def test_the_budget_names_every_model_and_its_size() -> None:
    sizes = {"churn": ("v1", 300 << 20), "sentiment": ("v2", 500 << 20)}
    check_budget(sizes, 800)  # fits exactly
    check_budget(sizes, 0)  # no budget
    with pytest.raises(ConfigError) as refused:
        check_budget(sizes, 700)
    assert str(refused.value) == (
        "limits.max_models_memory_mb: the models hold 800 MiB together (churn 300 MiB, "
        "sentiment 500 MiB), over the budget of 700 MiB: raise it, or serve some of them "
        "from a deployment of their own"
    )


def test_a_worker_over_its_budget_stops_before_contacting_kafka(tmp_path: Path) -> None:
    """A worker process of its own, as deployed: a process that freed memory before
    (a test run's) may load a model into pages it already holds, and measure less."""
    if resident_bytes() is None:
        pytest.skip("no /proc/self/statm here")
    path, model = tmp_path / "worker.toml", wide(tmp_path / "wide.onnx")

    def run(budget: int) -> subprocess.CompletedProcess[str]:
        path.write_text(TWO.format(budget=budget, wide=model))
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFER_WORKER_")}
        return subprocess.run([sys.executable, "-m", "worker", "run", "--config", str(path)],
                              capture_output=True, text=True, timeout=60, env=env,
                              check=False)  # fmt: skip

    refused = run(8)
    assert refused.returncode == 2, refused.stderr
    found = re.search(r"limits\.max_models_memory_mb: the models hold \d+ MiB together "
                      r"\(digits \d+ MiB, wide (\d+) MiB\), over the budget of 8 MiB: ",
                      refused.stderr)  # fmt: skip
    # Its 16 MiB of weights at least (onnxruntime may keep a prepacked copy beside them).
    assert found and 16 <= int(found[1]) < 128, refused.stderr
    within = run(4096)  # on to the (absent) broker
    assert within.returncode != 0 and "max_models_memory_mb" not in within.stderr
    assert "kafka.bootstrap_servers" in within.stderr, within.stderr
