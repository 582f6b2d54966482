"""Throwaway probe: the intake's per-record cost on a digits request, and its parts.

    .venv/bin/python benchmarks/results/2026-11-27-s9/micro_intake.py

Benchmark code, not shipped (run from the repository root: it binds the bundled
digits model through ``tests.models``).
"""

from __future__ import annotations

import sys
import timeit
from collections.abc import Callable

import msgpack
import numpy as np

sys.path.insert(0, ".")

from tests.models import model_inputs
from worker.config import LimitsConfig
from worker.contract import Limits, Request, Tensor, decode_request, encode_request
from worker.contract.requests import _TYPED, _id_problem, _meta_problem
from worker.contract.tensors import tensor_from_fields
from worker.kafka.intake import JobFactory


def per_call_us(name: str, fn: Callable[[], object], n: int = 50_000) -> None:
    best = min(timeit.repeat(fn, number=n, repeat=5))
    print(f"{name}: {best / n * 1e6:.2f} us")


def main() -> None:
    inputs = model_inputs()
    make = JobFactory(inputs, LimitsConfig())
    img = np.random.default_rng(0).integers(0, 16, (16, 16, 1), dtype=np.uint8)
    wire = encode_request(
        Request(v=1, id="req-12345", inputs={"image": Tensor.from_numpy(img)}, meta={"i": 7})
    )
    lim = Limits.of(LimitsConfig())
    req = decode_request(wire, lim)
    per_call_us("JobFactory", lambda: make("drain.requests", 3, 12345, b"12345", wire,
                                           1_700_000_000_000, [], 1))  # fmt: skip
    per_call_us("decode_request", lambda: decode_request(wire, lim))
    per_call_us("inputs.check", lambda: inputs.check(req, batched=False))
    typed = _TYPED.decode(wire)
    per_call_us("typed decode", lambda: _TYPED.decode(wire))
    raw = b"\x91" + bytes(typed.meta)
    per_call_us("meta unpackb", lambda: msgpack.unpackb(
        raw, raw=False, strict_map_key=True, max_ext_len=0,
        max_bin_len=lim.max_record_bytes, max_str_len=lim.max_string_bytes,
        max_array_len=lim.max_array_len, max_map_len=lim.max_map_len))  # fmt: skip
    per_call_us("meta problem", lambda: _meta_problem({"i": 7}, lim))
    per_call_us("id problem", lambda: _id_problem("req-12345", lim))
    tensor = typed.inputs["image"]
    assert not isinstance(tensor, str)
    per_call_us("tensor_from_fields", lambda: tensor_from_fields(
        tensor.dtype, tensor.shape, tensor.data, "inputs", lim, typed=True))  # fmt: skip


if __name__ == "__main__":
    main()
