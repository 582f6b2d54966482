"""A torch engine's slot, made ready before the worker joins its group: every shape
run, then captured as one CUDA graph each.

Shapes are run largest first (the largest sizes the caching allocator's pools),
``WARM_RUNS`` times each: the first call compiles (dynamic in the batch and the
padded dimensions: one compilation for the buckets; each shape's first call
marks them, so a compilation that the batch of 1 or a model's own
specialisation forces is dynamic in the rest) and lets cuDNN time its
algorithms; later calls must hit the compiled code with nothing left to set
up, which is what the graphs then capture. Progress is logged per shape
(``torch_shape_warmed``): for a large model the first slot's compilation is the
bulk of the worker's start-up.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

import structlog

from worker.flow.errors import ConfigError, EngineDead, InferenceFailed
from worker.model.shapes import shape_key

log = structlog.get_logger(__name__)

WARM_RUNS: Final = 3


class Context(Protocol):
    stream: Any
    graphs: dict[Any, Any]


RunInto = Callable[[Any, int, Mapping[str, int], bool], None]
"""Runs the module on (context, rows, lengths, mark dynamic dims)."""


@dataclass(frozen=True)
class SlotWarming:
    """One slot's shapes (``combos``), run and captured on its stream (``c``)."""

    torch: Any
    device: Any
    slot: int
    c: Context
    combos: list[tuple[int, dict[str, int]]]
    run_into: RunInto

    def run(self, cuda_graphs: bool) -> None:
        """Run every shape of ``combos`` on the slot's stream, then capture them."""
        torch, c = self.torch, self.c
        started = time.monotonic()
        shape_ms: dict[str, float] = {}
        on_cuda = self.device.type == "cuda"
        try:
            with (
                torch.cuda.device(self.device) if on_cuda else contextlib.nullcontext(),
                torch.cuda.stream(c.stream) if c.stream is not None else contextlib.nullcontext(),
                torch.inference_mode(),
            ):
                for i, (batch, lengths) in enumerate(self.combos):
                    t0 = time.monotonic()
                    for run in range(WARM_RUNS):
                        self.run_into(c, batch, lengths, run == 0)
                    if c.stream is not None:
                        c.stream.synchronize()
                    name = _name(batch, lengths)
                    shape_ms[name] = round((time.monotonic() - t0) * 1e3, 1)
                    log.info("torch_shape_warmed", slot=self.slot, shape=name, ms=shape_ms[name],
                             done=i + 1, of=len(self.combos))  # fmt: skip
        except (InferenceFailed, EngineDead, ConfigError):
            raise
        except Exception as exc:  # boundary: compilation or the model failing
            raise ConfigError(f"model.path: the torch model fails while warming up: {exc}") from exc
        if cuda_graphs:
            self.capture()
        log.info("torch_slot_warmed", slot=self.slot, seconds=round(time.monotonic() - started, 2),
                 shape_ms=shape_ms, graphs=len(c.graphs))  # fmt: skip

    def capture(self) -> None:
        """One CUDA graph per shape on the slot's stream, sharing one pool.

        A failed capture stops start-up (exit 2) rather than falling back: on torch
        2.11 a capture that fails leaves the caching allocator believing a capture is
        still under way (``CUDAGraph::capture_end`` throws before it ends the pool;
        fixed upstream in pytorch#180395), after which ``empty_cache`` and every later
        capture in the process fail. Recovering in process is not safe.
        """
        torch, c = self.torch, self.c
        pool = None
        try:
            with torch.cuda.device(self.device), torch.inference_mode():
                for batch, lengths in self.combos:
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: other threads' CUDA calls during start-up (the NVML
                    # monitor, CuPy on the legacy stream) must not invalidate it.
                    with torch.cuda.graph(
                        graph, pool=pool, stream=c.stream, capture_error_mode="thread_local"
                    ):
                        self.run_into(c, batch, lengths, False)
                    pool = graph.pool() if pool is None else pool
                    c.graphs[shape_key(batch, lengths)] = graph
        except Exception as exc:  # boundary: a model that cannot be captured
            raise ConfigError(
                f"model.torch.cuda_graphs: the model cannot be captured as a CUDA graph "
                f"(slot {self.slot}): {type(exc).__name__}: {exc}. A model that reads device "
                f"values in forward (.item(), bool(tensor), printing) cannot be; set "
                f"model.torch.cuda_graphs = false"
            ) from exc


def _name(batch: int, lengths: Mapping[str, int]) -> str:
    return f"{batch}" + "".join(f" {s}={n}" for s, n in sorted(lengths.items()))
