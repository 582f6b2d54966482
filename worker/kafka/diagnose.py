"""Why a connection to Kafka failed, in the settings' words: the one diagnosis
the worker and every tool (produce, consume, verify, compare, build-engine's
calibration read) use.

aiokafka reports a refused password, an untrusted broker certificate, a refused
client certificate and a listener of another protocol alike, as "Unable to
bootstrap" (the cause only in a log line of its own). A worker that then exits 1
looks like a broker outage and is restarted forever; a tool printed a traceback.
When bootstrapping failed, ``diagnose`` opens connections of its own with the
same settings (and, to tell a protocol mismatch, probes the listener for TLS,
for plaintext Kafka and for SASL) and turns what it meets into a
``ConfigError`` (exit 2) naming the setting to fix. ``explain`` adds the
refused permissions (a missing ACL). A broker that cannot be reached at all
stays a ``BrokerUnavailable`` for the worker (exit 1: restart and retry); for a
tool (``run_tool``) it is named too, exit 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ssl
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiokafka.conn import AIOKafkaConnection, create_conn
from aiokafka.errors import (
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.protocol.admin import SaslHandShakeRequest

from worker.config import KafkaConfig
from worker.flow.errors import ConfigError
from worker.kafka.credentials import security_kwargs
from worker.kafka.permissions import refused

_T = TypeVar("_T")
_PROBE_S = 10.0  # the longest one probe of the listener may take


async def explain(exc: BaseException, k: KafkaConfig) -> ConfigError | None:
    """A Kafka failure as the setting or permission to fix, or None (the broker
    is out of reach, or nothing was found)."""
    return refused(exc, k) or await diagnose(k)


def run_tool(k: KafkaConfig, work: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run(work)`` for a command-line tool: a Kafka failure becomes the
    worker's diagnosis, raised as ``ConfigError`` (the CLI prints one line and
    exits 2, no traceback); a broker nothing answers at is named as such."""

    async def diagnosed() -> _T:
        try:
            return await work
        except KafkaError as exc:
            problem = await explain(exc, k)
            if problem is not None:
                raise problem from exc
            raise ConfigError(unreachable(exc, k)) from exc

    return asyncio.run(diagnosed())


def unreachable(exc: BaseException, k: KafkaConfig) -> str:
    """The one line for a broker nothing answers at, the worker's and the tools'
    (the worker exits 1 on it, a restart retrying; a tool exits 2)."""
    return (
        f"kafka.bootstrap_servers: no Kafka broker answers at {k.bootstrap_servers} "
        f"(a wrong address or port, or the broker is down): {_message(exc)}"
    )


def _first_broker(k: KafkaConfig) -> tuple[str, int]:
    host, _, port = k.bootstrap_servers.split(",")[0].strip().rpartition(":")
    return host.strip("[]"), int(port)


async def diagnose(k: KafkaConfig) -> ConfigError | None:
    """A ``ConfigError`` saying which security setting the broker refused, or
    that the listener speaks another protocol; None when the broker cannot be
    reached or nothing was found."""
    try:
        host, port = _first_broker(k)
    except ValueError:
        return None
    where = f"{host}:{port}"
    kwargs: dict[str, Any] = security_kwargs(k)
    try:
        conn = await asyncio.wait_for(
            create_conn(host, port, request_timeout_ms=k.request_timeout_ms, **kwargs),
            k.request_timeout_s,
        )
    except SaslAuthenticationFailed as exc:
        return ConfigError(
            f"kafka.sasl_plain_username / sasl_plain_password: the broker at {where} "
            f"refused the credentials ({k.sasl_mechanism}): {_message(exc)}"
        )
    except UnsupportedSaslMechanismError as exc:
        return ConfigError(
            f"kafka.sasl_mechanism: the broker's listener at {where} does not take "
            f"{k.sasl_mechanism}: {_message(exc)}"
        )
    except IllegalSaslStateError:
        tls = "SSL" in k.security_protocol
        return _mismatch(k, where, "takes no SASL (it refused the SASL handshake)",
                         tls=tls, sasl=False)  # fmt: skip
    except ssl.SSLCertVerificationError as exc:
        return ConfigError(
            f"kafka.ssl_cafile: the broker's certificate at {where} is not trusted "
            f"({exc.verify_message}); set kafka.ssl_cafile to the authority that signed it"
        )
    except (KafkaConnectionError, ssl.SSLError, ConnectionError) as exc:
        problem = await _other_protocol(k, host, port)
        if problem is None and k.ssl_certfile and "SSL" in k.security_protocol:
            return _refused_certificate(k, where, exc)
        return problem
    except (KafkaError, OSError, TimeoutError, ValueError):
        return None
    try:
        # Connected (and authenticated, with SASL), yet bootstrapping failed: a
        # listener that wants SASL answers ApiVersions, then drops the client.
        if not k.security_protocol.startswith("SASL") and await _wants_sasl(conn):
            tls = "SSL" in k.security_protocol
            return _mismatch(k, where, "asks for SASL authentication", tls=tls, sasl=True)
    finally:
        conn.close()
    return None


async def _other_protocol(k: KafkaConfig, host: str, port: int) -> ConfigError | None:
    """The listener's own protocol, where it differs from the setting's: TLS
    where plaintext is configured, or plaintext Kafka where TLS is."""
    where = f"{host}:{port}"
    sasl = k.security_protocol.startswith("SASL")
    if "SSL" in k.security_protocol:
        if not await _speaks_tls(host, port) and await _answers_plaintext(host, port):
            what = "does not speak TLS (it answered plaintext Kafka)"
            return _mismatch(k, where, what, tls=False, sasl=sasl)
    elif await _speaks_tls(host, port):
        return _mismatch(k, where, "speaks TLS", tls=True, sasl=sasl)
    return None


def _mismatch(k: KafkaConfig, where: str, what: str, *, tls: bool, sasl: bool) -> ConfigError:
    """The listener at ``where`` does ``what``: it wants ``tls`` and ``sasl``."""
    wanted = ("SASL_" if sasl else "") + ("SSL" if tls else "PLAINTEXT")
    return ConfigError(
        f"kafka.security_protocol: {k.security_protocol} is configured, but the listener at "
        f"{where} {what}: set security_protocol = {wanted}, or point bootstrap_servers at "
        f"the broker's {k.security_protocol} listener"
    )


async def _speaks_tls(host: str, port: int) -> bool:
    """A TLS handshake completes at ``host:port`` (certificates not checked)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=context), _PROBE_S
        )
    except (ssl.SSLError, OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(ssl.SSLError, OSError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), _PROBE_S)
    return True


async def _answers_plaintext(host: str, port: int) -> bool:
    """Plaintext Kafka (an ApiVersions exchange) is spoken at ``host:port``."""
    try:
        conn = await asyncio.wait_for(
            create_conn(host, port, request_timeout_ms=int(_PROBE_S * 1000)), _PROBE_S
        )
    except (KafkaError, OSError, TimeoutError):
        return False
    conn.close()
    return True


async def _wants_sasl(conn: AIOKafkaConnection) -> bool:
    """The listener takes a SASL handshake (one without SASL refuses it as
    ``ILLEGAL_SASL_STATE``); False when the question cannot be asked."""
    try:
        response = await asyncio.wait_for(conn.send(SaslHandShakeRequest("PLAIN")), _PROBE_S)
    except (KafkaError, OSError, TimeoutError):
        return False
    return bool(response.error_code != IllegalSaslStateError.errno)


def _refused_certificate(k: KafkaConfig, where: str, exc: BaseException) -> ConfigError:
    """The broker closed the connection while a client certificate was offered:
    it refused the certificate. An expired one is named as such (its dates are
    read locally); otherwise the likely reasons are listed."""
    assert k.ssl_certfile is not None
    not_after = _not_after(k.ssl_certfile)
    if not_after is not None and not_after < datetime.datetime.now(datetime.UTC):
        return ConfigError(
            f"kafka.ssl_certfile: {k.ssl_certfile} expired on {not_after:%Y-%m-%d %H:%M} "
            f"UTC; the broker at {where} refused it"
        )
    return ConfigError(
        f"kafka.ssl_certfile: the broker at {where} closed the connection during the TLS "
        f"handshake: it refused the client certificate {k.ssl_certfile} (signed by an "
        f"authority it does not trust, revoked, or not yet valid) ({exc!r})"
    )


def _not_after(path: str) -> datetime.datetime | None:
    """A PEM certificate's expiry, through the ``ssl`` module's decoder (private,
    but in every CPython since 3.x; None where it is not there or fails)."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        text = decode(path)["notAfter"]
        return datetime.datetime.fromtimestamp(ssl.cert_time_to_seconds(text), datetime.UTC)
    except (OSError, ValueError, KeyError, ssl.SSLError):
        return None


def _message(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
