"""An async client for applications that call the worker from Python.

    async with InferenceClient("kafka:9092") as client:
        result = await client.infer(Path("cat.jpg").read_bytes(), timeout=10)
        print(result.status, result.outputs["topk_indices"].to_numpy())

Request/response over Kafka: each call sends one request with a fresh id and
waits for the result carrying that id (matched on the ``id`` header, without
decoding other results). Many calls may be in flight at once; one reader task
resolves them. The reader joins no consumer group and commits nothing: it reads
every partition of the output topic from the beginning when it starts, skipping
other results by header, so no answer produced after a request was sent can be
missed (a broker that answers ``seek_to_end`` correctly would allow starting at
the end; the embedded one does not). On a long output topic, give each
application its own output topic or expect that first read to take a while.

``InferenceClient.from_settings(settings.kafka)`` builds one from the worker's
own ``[kafka]`` settings (brokers, first input topic, output topic, security);
its ``start`` then diagnoses a failed connection as the worker and the tools
do: a ``ConfigError`` naming the setting to fix (a wrong password, an
untrusted CA, a listener of another protocol, a missing ACL) instead of
aiokafka's "Unable to bootstrap".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal, cast

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition

from worker.config import KafkaConfig, SchemaRegistryConfig
from worker.contract import (
    EncodedImage,
    ModelRef,
    Request,
    Result,
    Tensor,
    decode_result,
    encode_request,
    sniff_format,
)
from worker.contract.limits import DEFAULT_LIMITS
from worker.contract.oip import CONTENT_TYPE as JSON
from worker.contract.oip_client import decode_oip_result, encode_oip_request
from worker.contract.registered import Format
from worker.kafka.clients import topic_partitions
from worker.kafka.credentials import security_kwargs
from worker.kafka.diagnose import explain
from worker.kafka.registry_requests import RequestEncoder
from worker.kafka.registry_results import RegistryResults


def _as_image(image: np.ndarray | bytes | None) -> np.ndarray | bytes:
    """An image as the worker takes it: a file's bytes, or uint8 pixels. Any other
    array is refused, never cast: float pixels in [0, 1) cast to uint8 are all 0,
    and the worker would answer that black image ``ok`` (it refuses the same array
    sent through ``inputs=``: ``inputs.image.dtype: expected uint8``)."""
    if image is None:
        raise ValueError("give an image, or inputs by name")
    if isinstance(image, bytes):
        return image
    array = np.asarray(image)
    if array.dtype != np.uint8:
        raise TypeError(
            f"image: expected uint8 pixels [H, W, C] or [H, W] (or a JPEG/PNG/WebP "
            f"file's bytes), got {array.dtype}; the worker resizes and normalises "
            "images itself, so send the pixels as 0-255 uint8 (not scaled to [0, 1])"
        )
    return np.ascontiguousarray(array)


def _input(value: np.ndarray | bytes | str) -> Tensor | EncodedImage | str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        fmt = sniff_format(value)
        if fmt is None:
            raise ValueError("bytes are not a JPEG, PNG or WebP file")
        return EncodedImage(fmt, value)
    return Tensor.from_numpy(np.ascontiguousarray(value))


class InferenceClient:
    """Request/response over Kafka from asyncio code: ``infer`` sends one request
    and returns its result. Start it with ``async with`` (or ``start()`` and
    ``stop()``): a producer for the requests and a reader of the output topic
    (every partition, from the beginning, no consumer group) that hands each
    result to the call waiting for its id. Calls may overlap freely; an error
    result is returned, not raised. ``from_settings`` builds one from a worker's
    ``[kafka]`` settings, so a failed start is diagnosed as the worker would
    diagnose it (a ``ConfigError`` naming the setting)."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        input_topic: str = "infer.requests",
        output_topic: str = "infer.results",
        input_name: str = "image",
        max_request_size: int = DEFAULT_LIMITS.max_record_bytes + 64 * 1024,
        wire: Literal["msgpack", "oip", "avro", "jsonschema", "protobuf"] = "msgpack",
        security: Mapping[str, Any] | None = None,
        schema_registry: SchemaRegistryConfig | None = None,
    ) -> None:
        """``wire``: how requests travel: msgpack (contract v1), Open Inference
        Protocol v2 JSON (``content-type: application/json``), or a Schema
        Registry format (``avro``, ``jsonschema``, ``protobuf``; needs
        ``schema_registry``, and the worker's ``schema_registry.formats`` to
        include it: the request schema is made from the first request's inputs
        and registered under the input topic's subject, docs/guides/
        schema-registry.md); answers are read in any of them. ``security``:
        aiokafka's security arguments for a secured cluster
        (``security_protocol``, ``ssl_context``, ``sasl_*``); the worker's own
        settings give them with ``worker.kafka.credentials.security_kwargs``
        (docs/guides/secure.md)."""
        registered = wire in ("avro", "jsonschema", "protobuf")
        if registered and (schema_registry is None or not schema_registry.enabled):
            raise ValueError(f"wire {wire!r} needs schema_registry (its url)")
        self._wire = wire
        self._encoder = (RequestEncoder(schema_registry, cast(Format, wire), input_topic)
                         if registered and schema_registry is not None else None)  # fmt: skip
        self._results = (RegistryResults(schema_registry)
                         if schema_registry is not None and schema_registry.enabled
                         else None)  # fmt: skip
        self._bootstrap = bootstrap_servers
        self._security = dict(security or {})
        self._input_topic = input_topic
        self._output_topic = output_topic
        self._input_name = input_name
        self._max_request_size = max_request_size
        self._waiting: dict[str, asyncio.Future[Result]] = {}
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._kafka: KafkaConfig | None = None  # set by from_settings: failures diagnosed

    @classmethod
    def from_settings(cls, kafka: KafkaConfig, **options: Any) -> InferenceClient:
        """A client of the worker ``kafka`` configures: its brokers, its first
        input topic, its output topic and its security settings (``options``:
        the constructor's other arguments). A failed ``start`` raises the
        worker's diagnosis (``ConfigError``, naming the setting to fix)."""
        client = cls(
            kafka.bootstrap_servers,
            input_topic=kafka.input_topics[0],
            output_topic=kafka.output_topic,
            security=security_kwargs(kafka),
            **options,
        )
        client._kafka = kafka
        return client

    async def start(self) -> None:
        try:
            await self._start()
        except KafkaError as exc:
            await self.stop()  # a half-started client closes what it opened
            problem = None if self._kafka is None else await explain(exc, self._kafka)
            if problem is not None:
                raise problem from exc
            raise
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self._bootstrap,
            max_request_size=self._max_request_size,
            **self._security,
        )
        await self._producer.start()
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap, enable_auto_commit=False, **self._security
        )
        await self._consumer.start()
        parts = await topic_partitions(self._consumer, self._output_topic)
        if not parts:
            raise LookupError(f"output topic {self._output_topic!r} does not exist")
        tps = [TopicPartition(self._output_topic, p) for p in sorted(parts)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        self._reader = asyncio.create_task(self._read(), name="infer-client-reader")

    async def stop(self) -> None:
        """Idempotent; calls still waiting get ``asyncio.CancelledError``."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        for fut in self._waiting.values():
            fut.cancel()
        self._waiting.clear()
        for client in (self._producer, self._consumer):
            if client is not None:
                await client.stop()
        self._producer = self._consumer = None

    async def __aenter__(self) -> InferenceClient:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def infer(
        self,
        image: np.ndarray | bytes | None = None,
        *,
        inputs: Mapping[str, np.ndarray | bytes | str] | None = None,
        timeout: float = 30.0,
        meta: Mapping[str, Any] | None = None,
        key: bytes | None = None,
        model: str | None = None,
        version: str | None = None,
    ) -> Result:
        """Send one request and return its result; an error result is returned, not
        raised. ``image``: a uint8 array or a JPEG/PNG/WebP file's bytes, sent as
        the input named ``input_name`` (any other dtype raises ``TypeError``:
        nothing is cast); or ``inputs``: every input by name (an
        array is a tensor of its dtype, bytes an image file, a str a text). Raises
        ``TimeoutError`` when no result arrives within ``timeout`` seconds (the
        request's ``deadline_ms`` is set to the same moment, so a worker that
        gets to it later answers ``deadline_exceeded`` without computing it).
        ``model``: the model to answer it, where the worker serves several (on
        the default model's topics; docs/guides/models.md), and ``version`` the
        version it must be (else the result is ``unknown_model``)."""
        assert self._producer is not None, "start() first"
        request_id = uuid.uuid4().hex
        given: Mapping[str, np.ndarray | bytes | str] = (
            inputs if inputs is not None else {self._input_name: _as_image(image)}
        )
        deadline_ms = int((time.time() + timeout) * 1000)
        request = Request(
            v=1, id=request_id, inputs={n: _input(v) for n, v in given.items()},
            deadline_ms=deadline_ms, meta=meta,
            model=None if model is None else ModelRef(model, version),
        )  # fmt: skip
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        oip = self._wire == "oip"
        if self._encoder is not None and not self._encoder.registered:
            # The first request registers the schema: an HTTP call, off the loop.
            value = await asyncio.to_thread(self._encoder.encode, request)
        elif self._encoder is not None:
            value = self._encoder.encode(request)
        else:
            value = encode_oip_request(request) if oip else encode_request(request)
        headers = [("content-type", JSON.encode())] if oip else []
        try:
            await self._producer.send_and_wait(
                self._input_topic, value, key=key or request_id.encode(), headers=headers
            )
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._waiting.pop(request_id, None)

    async def _read(self) -> None:
        assert self._consumer is not None
        while True:
            fetched = await self._consumer.getmany(timeout_ms=500)
            for records in fetched.values():
                for record in records:
                    headers = dict(record.headers or ())
                    rid = headers.get("id", b"").decode(errors="replace")
                    fut = self._waiting.get(rid)
                    if fut is not None and not fut.done():
                        json_answer = headers.get("content-type", b"").startswith(JSON.encode())
                        decode = decode_oip_result if json_answer else decode_result
                        try:
                            if record.value[:1] == b"\x00" and self._results is not None:
                                # A registry format's: its schema fetched once, off the loop.
                                result = await asyncio.to_thread(self._results.result,
                                                                 record.value)  # fmt: skip
                            else:
                                result = decode(record.value)
                        except Exception as exc:  # boundary: a corrupt record is its caller's error
                            if not fut.done():
                                fut.set_exception(exc)
                            continue
                        if not fut.done():  # the caller may have given up meanwhile
                            fut.set_result(result)
