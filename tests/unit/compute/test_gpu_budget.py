"""A process's share of a GPU's memory (worker.compute.gpu.budget), on the CPU:
the share decided once (``run --procs N``'s members get 1/N each), both
allocators capped through their documented calls, and a slot ring or a warm-up
that does not fit refused at start-up naming the settings that size it."""

from __future__ import annotations

from typing import Any

import pytest

from worker.app.plan import RunPlan
from worker.app.supervisor import members
from worker.compute.gpu.budget import MemoryBudget, cap, resolve_fraction, used_bytes
from worker.config import GpuConfig, ModelConfig, Settings, load_settings
from worker.flow.errors import ConfigError
from worker.ops.processes import override_env

GIB = 2**30


def test_the_share_is_the_setting_else_an_equal_one() -> None:
    assert resolve_fraction(0.0, 1) == 1.0
    assert resolve_fraction(0.0, 4) == 0.25
    assert resolve_fraction(0.4, 4) == 0.4  # set: kept
    gpu = Settings(model=ModelConfig(backend="torch", path="m.pt"))
    assert RunPlan.of(gpu).gpu_memory_fraction == 1.0
    assert RunPlan.of(Settings()).gpu_memory_fraction == 0.0  # the CPU path: none
    with pytest.raises(ConfigError, match=r"gpu.memory_fraction: must be in \[0, 1\]"):
        GpuConfig(memory_fraction=1.5)


def test_run_procs_gives_each_member_on_the_device_an_equal_share() -> None:
    gpu = Settings(model=ModelConfig(backend="torch", path="m.pt"))
    shares = {m["INFER_WORKER_GPU__MEMORY_FRACTION"] for m in members(gpu, 4)}
    assert shares == {"0.25"}
    fixed = Settings(model=gpu.model, gpu=GpuConfig(memory_fraction=0.2))
    assert {m["INFER_WORKER_GPU__MEMORY_FRACTION"] for m in members(fixed, 4)} == {"0.2"}
    assert all("INFER_WORKER_GPU__MEMORY_FRACTION" not in m for m in members(Settings(), 4))


def test_a_gpu_model_among_several_gives_the_members_their_shares() -> None:
    """Several models, one of them on the GPU stage: each member's share is as
    for one GPU model (the models' rings share it), and the plan has the GPU's
    slots for that model and the CPU's threads for the other."""
    env = override_env({"kafka.input_topics": '["a", "b"]', "gpu.num_slots": "3",
                        "batching.max_inflight_batches": "5",
                        "models.cpu.path": "builtin:digits", "models.cpu.topics": '["a"]',
                        "models.gpu.path": "m.pt", "models.gpu.backend": "torch",
                        "models.gpu.topics": '["b"]'})  # fmt: skip
    s = load_settings(env=env)
    assert {m["INFER_WORKER_GPU__MEMORY_FRACTION"] for m in members(s, 2)} == {"0.5"}
    plan = RunPlan.of(s)
    assert (plan.device, plan.inflight_of("onnxruntime"), plan.inflight_of("torch")) == (
        "gpu", 5, 3)  # fmt: skip
    twin = load_settings(env={**env, "INFER_WORKER_MODELS__GPU__BACKEND": "gpu-twin"})
    assert RunPlan.of(twin).device_name == "gpu-twin"


def test_a_slot_ring_that_leaves_the_engine_too_little_is_refused() -> None:
    budget = MemoryBudget(device=0, total_bytes=80 * GIB, fraction=0.25)  # 20 GiB
    budget.check_slots(slot_bytes=2 * GIB, slots=4)  # 8 GiB: room for the engine
    with pytest.raises(ConfigError) as err:
        budget.check_slots(slot_bytes=3 * GIB, slots=4)
    text = str(err.value)
    assert text.startswith("gpu.memory_fraction 0.25 of cuda:0 (20,480 MiB of 81,920 MiB)")
    assert "12,288 MiB (4 slots x 3,072 MiB" in text
    assert "gpu.num_slots" in text and "--procs" in text


def test_a_warm_up_past_the_share_is_refused_and_what_it_holds_is_logged() -> None:
    import structlog

    budget = MemoryBudget(device=1, total_bytes=16 * GIB, fraction=0.5)
    with structlog.testing.capture_logs() as logs:
        budget.check_used(6 * GIB)
        with pytest.raises(ConfigError, match=r"holds 9,216 MiB"):
            budget.check_used(9 * GIB)
    assert [(e["used_mib"], e["budget_mib"]) for e in logs] == [(6144.0, 8192.0),
                                                                 (9216.0, 8192.0)]


class _Pool:
    def __init__(self) -> None:
        self.limit: dict[str, float] = {}

    def set_limit(self, **kwargs: float) -> None:
        self.limit = kwargs

    def total_bytes(self) -> int:
        return 3 * GIB


class _Cupy:
    """The two CuPy calls the budget makes, as CuPy documents them."""

    def __init__(self) -> None:
        self.pool = _Pool()

    def get_default_memory_pool(self) -> _Pool:
        return self.pool


class _Cuda:
    def __init__(self) -> None:
        self.fraction: tuple[float, int] | None = None

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        self.fraction = (fraction, device)

    def memory_reserved(self, device: int) -> int:
        return 2 * GIB


class _Torch:
    def __init__(self) -> None:
        self.cuda = _Cuda()


def test_both_allocators_are_capped_and_counted() -> None:
    cupy, torch = _Cupy(), _Torch()
    budget = MemoryBudget(device=2, total_bytes=80 * GIB, fraction=0.25)
    cap(cupy, torch, budget)
    assert cupy.pool.limit == {"fraction": 0.25} and torch.cuda.fraction == (0.25, 2)
    assert used_bytes(cupy, torch, 2) == 5 * GIB
    alone: Any = _Cupy()
    cap(alone, None, budget)  # TensorRT: CuPy's pool only
    assert used_bytes(alone, None, 2) == 3 * GIB
