"""Throwaway: per-record cost of the intake (JobFactory) on a digits request, and its parts."""
import timeit, sys
sys.path.insert(0, '.')
import numpy as np
from tests.models import model_inputs
from worker.config import LimitsConfig
from worker.contract import Request, Tensor, encode_request, decode_request
from worker.kafka.intake import JobFactory
inputs = model_inputs()
make = JobFactory(inputs, LimitsConfig())
img = np.random.default_rng(0).integers(0, 16, (16, 16, 1), dtype=np.uint8)
wire = encode_request(Request(v=1, id="req-12345", inputs={"image": Tensor.from_numpy(img)}, meta={"i": 7}))
from worker.contract import Limits
lim = Limits.of(LimitsConfig())
req = decode_request(wire, lim)
def t(name, fn, n=50000):
    best = min(timeit.repeat(fn, number=n, repeat=5)); print(f"{name}: {best/n*1e6:.2f} us")
t("JobFactory", lambda: make("drain.requests", 3, 12345, b"12345", wire, 1700000000000, [], 1))
t("decode_request", lambda: decode_request(wire, lim))
t("inputs.check", lambda: inputs.check(req, batched=False))
import msgpack, msgspec
from worker.contract.requests import _TYPED, _id_problem, _meta_problem
from worker.contract.tensors import tensor_from_fields
w = _TYPED.decode(wire)
t("typed decode", lambda: _TYPED.decode(wire))
raw = bytes(w.meta)
t("meta unpackb", lambda: msgpack.unpackb(b"\x91" + raw, raw=False, strict_map_key=True, max_ext_len=0, max_bin_len=lim.max_record_bytes, max_str_len=lim.max_string_bytes, max_array_len=lim.max_array_len, max_map_len=lim.max_map_len))
t("meta problem", lambda: _meta_problem({"i": 7}, lim))
t("id problem", lambda: _id_problem("req-12345", lim))
tt = w.inputs["image"]
t("tensor_from_fields", lambda: tensor_from_fields(tt.dtype, tt.shape, tt.data, "inputs", lim, typed=True))
from worker.flow.values import Request as R
t("Request()", lambda: R(v=1, id="x", inputs={}, deadline_ms=None, meta=None, sequence_start=False, sequence_end=False))
