"""A model's card: its Open Inference Protocol metadata (name, versions, platform,
inputs and outputs as the model file declares them), what ``/v2/models/NAME``
shows (``worker.obs.served``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from worker.compute.stage import Described
from worker.contract.oip import datatype_of
from worker.model.io import EngineInfo, TensorDesc
from worker.obs import served


def model_card(info: EngineInfo) -> dict[str, Any]:
    """``info`` as OIP model metadata; a free dimension (the batch's included) is -1."""
    return {
        "name": info.name,
        "versions": [info.version],
        "platform": info.backend,
        "inputs": [_tensor(t) for t in info.io.inputs],
        "outputs": [_tensor(t) for t in info.io.outputs],
    }


def _tensor(t: TensorDesc) -> dict[str, Any]:
    shape = [d if isinstance(d, int) else -1 for d in t.shape]
    if t.batch_axis is not None:
        shape.insert(t.batch_axis, -1)
    return {"name": t.name, "datatype": datatype_of(t.dtype), "shape": shape}


def publish(*infos: EngineInfo) -> None:
    """Show each model's card on the metrics port."""
    for info in infos:
        served.publish(info.name, model_card(info))


def publish_pipeline(info: EngineInfo, outputs: Mapping[str, Described]) -> None:
    """Show a pipeline's card: the request its first model takes, and the
    pipeline's outputs (``datatype``/``shape`` where the steps declare them; one
    stacked from regions has them first, a free dimension)."""
    card = model_card(info)
    card["outputs"] = [
        {"name": name} if desc is None else
        {"name": name, "datatype": datatype_of(np.dtype(desc[0])),
         "shape": [-1, *(d if isinstance(d, int) else -1 for d in desc[1])]}
        for name, desc in outputs.items()
    ]  # fmt: skip
    served.publish(info.name, card)
