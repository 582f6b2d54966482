"""Why a secured connection failed, in the settings' words.

aiokafka reports a refused password, an untrusted broker certificate and a
refused client certificate alike, as "Unable to bootstrap" (the cause only in a
log line of its own). A worker that then exits 1 looks like a broker outage and
is restarted forever. At start-up, when bootstrapping failed, ``diagnose`` opens
one connection of its own with the same settings and turns what it meets into a
``ConfigError`` (exit 2) naming the setting to fix; a broker that cannot be
reached at all stays a ``BrokerUnavailable`` (exit 1: restart and retry).
"""

from __future__ import annotations

import asyncio
import datetime
import ssl
from typing import Any

from aiokafka.conn import create_conn
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)

from worker.config import KafkaConfig
from worker.flow.errors import ConfigError
from worker.kafka.credentials import security_kwargs


async def diagnose(k: KafkaConfig) -> ConfigError | None:
    """A ``ConfigError`` saying which security setting the broker refused, or None
    (PLAINTEXT, a broker that cannot be reached, or nothing found)."""
    if k.security_protocol == "PLAINTEXT":
        return None
    host, _, port = k.bootstrap_servers.split(",")[0].strip().rpartition(":")
    kwargs: dict[str, Any] = security_kwargs(k)
    try:
        conn = await asyncio.wait_for(
            create_conn(
                host.strip("[]"), int(port), request_timeout_ms=k.request_timeout_ms, **kwargs
            ),
            k.request_timeout_ms / 1000,
        )
    except SaslAuthenticationFailed as exc:
        return ConfigError(
            f"kafka.sasl_plain_username / sasl_plain_password: the broker at {host}:{port} "
            f"refused the credentials ({k.sasl_mechanism}): {_message(exc)}"
        )
    except UnsupportedSaslMechanismError as exc:
        return ConfigError(
            f"kafka.sasl_mechanism: the broker's listener at {host}:{port} does not take "
            f"{k.sasl_mechanism}: {_message(exc)}"
        )
    except ssl.SSLCertVerificationError as exc:
        return ConfigError(
            f"kafka.ssl_cafile: the broker's certificate at {host}:{port} is not trusted "
            f"({exc.verify_message}); set kafka.ssl_cafile to the authority that signed it"
        )
    except (KafkaConnectionError, ssl.SSLError, ConnectionError) as exc:
        if k.ssl_certfile and "SSL" in k.security_protocol:
            return _refused_certificate(k, f"{host}:{port}", exc)
        return None
    except (KafkaError, OSError, TimeoutError, ValueError):
        return None
    conn.close()
    return None


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
