"""A model's card: its Open Inference Protocol metadata (name, versions, platform,
inputs and outputs as the model file declares them), what ``/v2/models/NAME``
shows (``worker.obs.served``)."""

from __future__ import annotations

from typing import Any

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
