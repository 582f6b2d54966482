"""The invariant every served model satisfies (issue 26): a batch mixing
free-dimension sizes answers each request exactly as that request alone (the
same shapes, values within float tolerance). Checked for every model in
tests/served.py, the real third-party ones included, on batches hypothesis
draws: how many requests, in what order, of which sizes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.served import CATALOGUE, Runner


@pytest.fixture(params=list(CATALOGUE), scope="module")
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Runner]]:  # fmt: skip
    served = CATALOGUE[request.param]
    r = Runner(served.config(tmp_path_factory.mktemp(served.name)))
    yield served.name, r
    r.close()


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
async def test_a_mixed_batch_answers_each_request_as_alone(
    runner: tuple[str, Runner], data: st.DataObject
) -> None:
    name, r = runner
    served = CATALOGUE[name]
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    n = data.draw(st.integers(2, served.max_batch), label="requests")
    rng = np.random.default_rng(seed)
    requests = [served.request(rng) for _ in range(n)]
    batch = await r.answer(requests)
    for answer, request in zip(batch, requests, strict=True):
        (alone,) = await r.answer([request])
        assert answer.error is None and alone.error is None, (answer.error, alone.error)
        assert answer.outputs is not None and alone.outputs is not None
        assert answer.outputs.keys() == alone.outputs.keys()
        for output, value in alone.outputs.items():
            got = answer.outputs[output]
            assert got.shape == value.shape, (name, output, got.shape, value.shape)
            np.testing.assert_allclose(got, value, rtol=1e-4, atol=1e-5, err_msg=f"{name}.{output}")
