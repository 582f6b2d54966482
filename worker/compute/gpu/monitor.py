"""GPU memory and utilisation gauges, sampled from NVML (nvidia-ml-py) off the loop.

Optional by design: without nvidia-ml-py or an NVIDIA driver the worker serves
as before, without these gauges, and says why once at start-up; an NVML error
later stops the sampling, never the worker (a gauge is not worth a request).

NVML numbers devices in its own order, which ``CUDA_VISIBLE_DEVICES`` does not
change, so the worker's CUDA device is found in NVML by its PCI bus id.

Several processes on one device (``run --procs N``) each publish the device's
gauges: they carry the device's ``uuid``, so a dashboard takes one series per
physical device (``max by (uuid)``) instead of adding N copies, and each process
publishes its own memory (``infer_gpu_process_memory_bytes``), which does add up.
NVML lists processes by their host pid: inside a container with a pid namespace
of its own this process is not found there, and that gauge is left unset.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import structlog

from worker.obs import metrics

log = structlog.get_logger(__name__)


class NvmlUnavailable(Exception):
    """NVML cannot be used here: no nvidia-ml-py, no driver, or no such device."""


@dataclass(frozen=True)
class GpuSample:
    memory_used_bytes: int  # every process's
    memory_total_bytes: int
    utilization_ratio: float  # fraction of the driver's last sample period a kernel ran
    process_memory_bytes: int | None = None  # this process's, where NVML lists it


class NvmlDevice:
    """One device's NVML handle. Opening initialises NVML; ``close`` releases it."""

    def __init__(self, device: int, pci_bus_id: str | None = None) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable("nvidia-ml-py is not installed (the gpu extra has it)") from exc
        self._nvml: ModuleType = pynvml
        self.error: type[Exception] = pynvml.NVMLError
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML did not initialise: {exc}") from exc
        try:
            self._handle: Any = (
                pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
                if pci_bus_id
                else pynvml.nvmlDeviceGetHandleByIndex(device)
            )
            uuid = pynvml.nvmlDeviceGetUUID(self._handle)  # str, or bytes in older bindings
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            where = f"PCI bus id {pci_bus_id}" if pci_bus_id else f"index {device}"
            raise NvmlUnavailable(f"no NVML device at {where}: {exc}") from exc
        self.uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)

    def sample(self) -> GpuSample:
        nvml = self._nvml
        memory = nvml.nvmlDeviceGetMemoryInfo(self._handle)
        rates = nvml.nvmlDeviceGetUtilizationRates(self._handle)
        mine = [
            int(p.usedGpuMemory) for p in nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
            if p.pid == os.getpid() and p.usedGpuMemory is not None
        ]  # fmt: skip
        return GpuSample(int(memory.used), int(memory.total), float(rates.gpu) / 100.0,
                         sum(mine) if mine else None)  # fmt: skip

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def cuda_pci_bus_id(device: int) -> str | None:
    """The CUDA device's PCI bus id through CuPy (the GPU path's runtime), or None."""
    try:
        import cupy

        return str(cupy.cuda.runtime.deviceGetPCIBusId(device))
    except Exception:  # boundary: no CuPy or no device; fall back to NVML's index
        return None


async def watch_gpu(device: int, interval: float = 2.0) -> None:
    """Publish the device's memory and utilisation every ``interval`` seconds."""
    label = str(device)
    try:
        # Off the loop: both the CUDA query and NVML's initialisation can block.
        nvml = await asyncio.to_thread(lambda: NvmlDevice(device, cuda_pci_bus_id(device)))
    except NvmlUnavailable as exc:
        log.warning("gpu_metrics_unavailable", device=device, reason=str(exc))
        return
    try:
        while True:
            try:
                s = await asyncio.to_thread(nvml.sample)
            except nvml.error as exc:
                log.warning("gpu_metrics_stopped", device=device, reason=str(exc))
                return
            labels = (label, nvml.uuid)
            metrics.GPU_MEMORY_USED.labels(*labels).set(s.memory_used_bytes)
            metrics.GPU_MEMORY_TOTAL.labels(*labels).set(s.memory_total_bytes)
            metrics.GPU_UTILIZATION.labels(*labels).set(s.utilization_ratio)
            if s.process_memory_bytes is not None:
                metrics.GPU_PROCESS_MEMORY.labels(*labels).set(s.process_memory_bytes)
            await asyncio.sleep(interval)
    finally:
        nvml.close()
