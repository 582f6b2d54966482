"""A secret setting's value (a password): typed, so that it cannot be printed.

``str()``, ``repr()``, f-strings, ``json.dumps`` of the settings (``redacted_tree``)
and log lines all show ``***``; the one caller that needs the value (the client's
credentials, ``worker.kafka.credentials``) asks for it with ``reveal()``. Which
settings are secret is said by their type, in one place: nothing keeps a list of
names beside it.
"""

from __future__ import annotations

import hmac
from typing import Final

MASK: Final = "***"


class Secret:
    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The value itself: for the Kafka client's credentials, nothing else."""
        return self._value

    def __repr__(self) -> str:
        return f"Secret({MASK!r})"

    def __str__(self) -> str:
        return MASK

    def __format__(self, spec: str) -> str:
        return format(MASK, spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(
            self._value.encode(), other._value.encode()
        )

    def __hash__(self) -> int:
        return hash(Secret)  # equal secrets must hash alike; the value is not hashed
