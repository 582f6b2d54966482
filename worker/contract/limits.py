"""Bounds on what one record may make the worker do."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from worker.config import LimitsConfig
from worker.contract.wire import REQUEST_FIELDS
from worker.flow.values import is_int

# The bounds operators set ([limits]) have one home, the settings: their
# defaults here are the settings' defaults, not a second declaration.
_SET: Final = LimitsConfig()


@dataclass(frozen=True)
class Limits:
    """Bounds on what one record may make the worker do.

    ``max_record_bytes`` is checked before decoding; the msgpack ``max_*_len``
    limits during it; the rest after, when a violation can still be answered
    with an error result. Tensor bytes are bounded by ``max_tensor_bytes`` after
    decoding rather than by msgpack's ``max_bin_len``, so an oversized image
    gets a ``too_large`` reply instead of vanishing into the DLQ; msgpack's
    bins are still bounded by the record size, which is already in memory.
    """

    max_record_bytes: int = _SET.max_record_bytes
    max_tensor_bytes: int = _SET.max_tensor_bytes
    max_inputs: int = 8
    max_rank: int = 4
    max_id_chars: int = 256
    max_meta_bytes: int = 4096
    max_map_len: int = 64
    max_array_len: int = 64
    max_str_len: int = 4096
    max_text_bytes: int = _SET.max_text_bytes  # a text input; msgpack's string limit is the larger
    # msgpack's string limit: text inputs may be longer than the other strings.
    max_string_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "max_record_bytes",
            "max_tensor_bytes",
            "max_inputs",
            "max_rank",
            "max_id_chars",
            "max_meta_bytes",
            "max_map_len",
            "max_array_len",
            "max_str_len",
            "max_text_bytes",
        ):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"limits.{name}: expected an int >= 1, got {value!r}")
        # The request's own top-level map and its inputs map are read under
        # max_map_len; a smaller value would turn valid requests into DLQ records.
        if self.max_map_len < max(len(REQUEST_FIELDS), self.max_inputs):
            raise ValueError(
                f"limits.max_map_len: must be >= max_inputs ({self.max_inputs}) "
                f"and >= {len(REQUEST_FIELDS)}, got {self.max_map_len}"
            )
        if self.max_array_len < self.max_rank:
            raise ValueError(
                f"limits.max_array_len: must be >= max_rank ({self.max_rank}), "
                f"got {self.max_array_len}"
            )
        object.__setattr__(self, "max_string_bytes", max(self.max_str_len, self.max_text_bytes))

    @classmethod
    def of(cls, limits: LimitsConfig) -> Limits:
        """The codec's bounds for the operator's ``[limits]``."""
        return cls(
            max_record_bytes=limits.max_record_bytes,
            max_tensor_bytes=limits.max_tensor_bytes,
            max_text_bytes=limits.max_text_bytes,
        )


DEFAULT_LIMITS: Final = Limits()
