"""The glue a user writes today between two workers (benchmarks.pipeline's
``chained`` setup, issue 59): reads the first worker's results, turns each into
the second worker's request (openWakeWord's window between its two models,
``tests.pipeline_functions.mel_window``) and produces it, same id and key;
commits what it read once the requests are acknowledged (at-least-once).

    python -m benchmarks.pipeline_glue BOOTSTRAP RESULTS REQUESTS GROUP

aiokafka and the contract's own codec: what a Python user of this project would
write. A failed first step is passed on as a request the second worker refuses,
so every request still gets one final answer. Benchmark code, not shipped.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from tests.pipeline_functions import mel_window
from worker.contract import Request, Tensor, decode_result, encode_request


async def glue(bootstrap: str, results: str, requests: str, group: str) -> None:
    consumer = AIOKafkaConsumer(results, bootstrap_servers=bootstrap, group_id=group,
                                enable_auto_commit=False, auto_offset_reset="earliest")  # fmt: skip
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2,
                                max_request_size=16 << 20)  # fmt: skip
    await consumer.start()
    await producer.start()
    try:
        while True:
            fetched = await consumer.getmany(timeout_ms=200, max_records=500)
            sends = []
            for records in fetched.values():
                for r in records:
                    value = encode_request(Request(v=1, id=decode_result(r.value).id,
                                                   inputs=_next_inputs(r.value)))  # fmt: skip
                    sends.append(await producer.send(requests, value, key=r.key))
            if sends:
                await asyncio.gather(*sends)
                await consumer.commit()
    finally:
        await producer.stop()
        await consumer.stop()


def _next_inputs(value: bytes) -> dict[str, Tensor]:
    """The second model's request for the first model's result; for a failed one,
    an input the second model does not take (answered invalid_request)."""
    result = decode_result(value)
    try:
        assert result.status == "ok"
        frames = mel_window(result.outputs["output"].to_numpy())["frames"]
    except (AssertionError, ValueError, KeyError):
        return {"failed": Tensor.from_numpy(np.zeros(1, np.float32))}
    return {"input_1": Tensor.from_numpy(frames)}


if __name__ == "__main__":
    asyncio.run(glue(*sys.argv[1:5]))
