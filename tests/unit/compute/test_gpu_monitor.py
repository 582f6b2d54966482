"""The NVML gauges are optional: where NVML cannot be used (no nvidia-ml-py, no
driver, as on CI) the monitor says why once and returns, so the worker serves on
without them. The sampling itself is checked on a GPU (tests/gpu)."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from worker.compute.gpu.monitor import NvmlDevice, NvmlUnavailable, watch_gpu


def nvml_reason() -> str | None:
    try:
        NvmlDevice(0).close()
    except NvmlUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.skipif(nvml_reason() is None, reason="NVML works here: see tests/gpu")
async def test_without_nvml_the_monitor_says_why_and_returns() -> None:
    with capture_logs() as logs:
        await asyncio.wait_for(watch_gpu(0, interval=0.01), timeout=10)
    (event,) = [e for e in logs if e["event"] == "gpu_metrics_unavailable"]
    assert event["log_level"] == "warning" and event["device"] == 0
    assert event["reason"] == nvml_reason()  # names the cause: library, driver or device


def test_an_unknown_device_is_refused_with_its_address() -> None:
    reason = nvml_reason()
    with pytest.raises(NvmlUnavailable) as caught:
        NvmlDevice(0, pci_bus_id="0000:FF:1F.0").close()
    if reason is None:  # NVML works: only the bogus address can be the cause
        assert "0000:FF:1F.0" in str(caught.value)


class _Proc:
    def __init__(self, pid: int, used: int | None) -> None:
        self.pid, self.usedGpuMemory = pid, used


class _FakeNvml:
    """The NVML calls the monitor makes, as nvidia-ml-py names them (a stand-in
    for the library, not for the monitor under test)."""

    class NVMLError(Exception):
        pass

    def __init__(self, procs: list[_Proc], uuid: str | bytes) -> None:
        self.procs, self.uuid, self.shut = procs, uuid, False

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetUUID(self, h: str) -> str | bytes:
        return self.uuid

    def nvmlDeviceGetMemoryInfo(self, h: str) -> object:
        return type("M", (), {"used": 5 * 2**30, "total": 80 * 2**30})()

    def nvmlDeviceGetUtilizationRates(self, h: str) -> object:
        return type("U", (), {"gpu": 37})()

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[_Proc]:
        return self.procs


def test_a_sample_holds_this_process_memory_and_the_device_uuid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Several processes on one device publish its gauges; the uuid tells a
    dashboard they are one device, and each process's own memory adds up."""
    import os
    import sys

    others = [_Proc(os.getpid() + 1, 3 * 2**30), _Proc(os.getpid(), 2**30)]
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(others, b"GPU-1234"))
    device = NvmlDevice(0)
    s = device.sample()
    assert device.uuid == "GPU-1234" and s.utilization_ratio == 0.37
    assert (s.memory_used_bytes, s.process_memory_bytes) == (5 * 2**30, 2**30)
    # Not listed (a container's own pid namespace): unknown, not zero.
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml([_Proc(1, 2**30)], "GPU-9"))
    assert NvmlDevice(0).sample().process_memory_bytes is None
