"""Request inputs and their kinds: how each becomes the model's inputs.

One module per kind (``tensor``, ``image``, ``text``), what they share
(``base``), a model's inputs together (``batch``: check a request, prepare,
group and collate a batch) and the start-up rules that bind request inputs to
model inputs (``binding``). Stages see ``ModelInputs`` only.
"""

from worker.model.inputs.batch import Collated, ModelInputs, length_bucket
from worker.model.inputs.binding import (
    Binding,
    bind,
    bind_model,
    configured_inputs,
    is_classifier,
)

__all__ = [
    "Binding",
    "Collated",
    "ModelInputs",
    "bind",
    "bind_model",
    "configured_inputs",
    "is_classifier",
    "length_bucket",
]
