"""The DLQ record's headers (contract v1, schemas/README.md): written by the
worker (``kafka.delivery.outgoing``), read by ``verify`` and ``consume``. Plain
``str`` constants, not an enum: aiokafka's record builder takes exact ``str``
header names."""

from __future__ import annotations

from typing import Final


class DlqHeader:
    ERROR_CODE: Final = "error.code"
    ERROR_MESSAGE: Final = "error.message"
    SOURCE_TOPIC: Final = "source.topic"
    SOURCE_PARTITION: Final = "source.partition"
    SOURCE_OFFSET: Final = "source.offset"
    STAGE: Final = "stage"  # where it was set aside: decode, crash_loop, produce
    WORKER_VERSION: Final = "worker.version"
    VALUE_OMITTED_BYTES: Final = "value.omitted_bytes"  # a record too large even for the DLQ
