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
