"""What a client shows the broker: TLS context, SASL credentials, OAuth tokens.

Secrets come from the settings, from ``INFER_WORKER_KAFKA__*`` variables, or from
files (``*_file`` keys: a mounted Kubernetes or Docker secret). A file is read
each time a client is built, so a rotated secret is used from the next client on
(the producer is rebuilt after a fatal error, the crash guard per check). Neither
a secret nor a file's contents ever reaches a log line, an error message or a
metric: errors name the setting and the file, never what it holds.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib
import json
import shlex
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
from aiokafka.abc import AbstractTokenProvider

from worker.config import KafkaConfig
from worker.config.secret import Secret
from worker.flow.errors import ConfigError

log = structlog.get_logger(__name__)

# A command's token is used until this long before its "exp" claim, then the
# command runs again (a token without "exp" is fetched for every connection).
REFRESH_MARGIN_S = 60.0


def read_secret(path: str, setting: str) -> str:
    """The secret in the file ``path`` (one trailing newline dropped, as
    ``echo`` and ``kubectl create secret --from-file`` leave one)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from None
    text = text.removesuffix("\n")
    if not text:
        raise ConfigError(f"{setting}: {path} is empty")
    return text


def security_kwargs(k: KafkaConfig) -> dict[str, Any]:
    """aiokafka's security arguments for ``k`` (none for PLAINTEXT)."""
    kwargs: dict[str, Any] = {"security_protocol": k.security_protocol}
    if k.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = ssl_context(k)
    credentials = k.sasl_credentials
    if credentials is not None:
        kwargs["sasl_mechanism"] = k.sasl_mechanism
    if credentials == "token":
        kwargs["sasl_oauth_token_provider"] = oauth_provider(k)
    elif credentials == "password":
        kwargs["sasl_plain_username"] = k.sasl_plain_username
        kwargs["sasl_plain_password"] = _password(
            k.sasl_plain_password, k.sasl_plain_password_file, "kafka.sasl_plain_password_file"
        )
    return kwargs  # "kerberos": the system's ticket, nothing from the settings


def _password(value: Secret | None, file: str | None, setting: str) -> str | None:
    """A password setting's value: its file's contents (read now: a rotated
    secret is used by the next client), or the Secret revealed, or None."""
    if file:
        return read_secret(file, setting)
    return None if value is None else value.reveal()


def ssl_context(k: KafkaConfig) -> ssl.SSLContext:
    """A TLS context that verifies the broker (against ``ssl_cafile``, else the
    system's authorities) and presents the client certificate where one is set.
    A file that cannot be loaded is a configuration error naming its setting."""
    password = _password(k.ssl_password, k.ssl_password_file, "kafka.ssl_password_file")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if k.ssl_cafile:
        try:
            context.load_verify_locations(cafile=k.ssl_cafile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"kafka.ssl_cafile: cannot load {k.ssl_cafile}: {exc}") from None
    if k.ssl_certfile:
        try:
            context.load_cert_chain(k.ssl_certfile, k.ssl_keyfile or None, password)
        except (OSError, ssl.SSLError) as exc:
            # The message names the files; ssl's own never quotes a password.
            raise ConfigError(
                f"kafka.ssl_certfile: cannot load {k.ssl_certfile} with key "
                f"{k.ssl_keyfile or '(in the same file)'}: {exc} (an encrypted key needs "
                "kafka.ssl_password or kafka.ssl_password_file)"
            ) from None
    elif k.ssl_keyfile:
        raise ConfigError("kafka.ssl_keyfile: set only with kafka.ssl_certfile")
    return context


def oauth_provider(k: KafkaConfig) -> Any:
    """One provider per process for the configured token source (the consumer,
    the producers and the crash guard share it)."""
    if k.sasl_oauth_token_file:
        return _file_token(k.sasl_oauth_token_file)
    if k.sasl_oauth_token_command:
        return _command_token(k.sasl_oauth_token_command, k.request_timeout_s)
    return token_provider(k.sasl_oauth_token_provider)


@functools.cache
def token_provider(spec: str | None) -> Any:
    """Call the ``module:callable`` factory named by kafka.sasl_oauth_token_provider
    and check that it returned an aiokafka ``AbstractTokenProvider``. Called once
    per process: the consumer, the producer and the crash guard share the one
    provider (a factory may open sessions or start refresh tasks)."""
    name = "kafka.sasl_oauth_token_provider"
    module_name, _, attr = (spec or "").partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{name}: cannot import {spec!r}: {exc}") from exc
    provider = factory()
    if not isinstance(provider, AbstractTokenProvider):
        raise ConfigError(
            f"{name}: {spec} returned {type(provider).__name__}, not an "
            "aiokafka.abc.AbstractTokenProvider"
        )
    return provider


def token_expiry(token: str) -> float | None:
    """The ``exp`` claim of a JWT (seconds since the epoch), None for a token
    that is not a JWT or has none. Read, not verified: the broker verifies."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        exp = claims.get("exp") if isinstance(claims, dict) else None
    except ValueError:
        return None
    return float(exp) if isinstance(exp, int | float) else None


class FileToken(AbstractTokenProvider):  # type: ignore[misc]
    """The token in a file, read at every authentication: whatever refreshes the
    file (a sidecar, a projected service-account token) is picked up by the next
    connection. A token whose ``exp`` has passed is logged (the broker will
    refuse it) without its value."""

    def __init__(self, path: str) -> None:
        self._path = path

    async def token(self) -> str:
        # Off the event loop: the file may sit on a slow network volume.
        token = await asyncio.to_thread(read_secret, self._path, "kafka.sasl_oauth_token_file")
        token = token.strip()
        exp = token_expiry(token)
        if exp is not None and exp <= time.time():
            log.warning("oauth_token_expired", file=self._path, expired_s_ago=time.time() - exp)
        return token


class CommandToken(AbstractTokenProvider):  # type: ignore[misc]
    """The token a command prints (``shlex``-split, run without a shell), kept
    until ``REFRESH_MARGIN_S`` before its ``exp`` claim, then fetched again."""

    def __init__(self, command: str, timeout_s: float) -> None:
        self._argv = shlex.split(command)
        self._timeout = timeout_s
        self._token: str | None = None
        self._refresh_at = 0.0

    async def token(self) -> str:
        if self._token is None or time.time() >= self._refresh_at:
            self._token = await self._run()
            exp = token_expiry(self._token)
            self._refresh_at = 0.0 if exp is None else exp - REFRESH_MARGIN_S
        return self._token

    async def _run(self) -> str:
        setting = "kafka.sasl_oauth_token_command"
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise ConfigError(f"{setting}: cannot run {self._argv[0]!r}: {exc}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self._timeout)
        except TimeoutError:
            proc.kill()
            raise ConfigError(f"{setting}: no token within {self._timeout:.0f} s") from None
        if proc.returncode != 0:
            # Its stderr, not its stdout: stdout would be the token.
            raise ConfigError(
                f"{setting}: exit {proc.returncode}: {err.decode(errors='replace')[-300:]}"
            )
        token = out.decode().strip()
        if not token:
            raise ConfigError(f"{setting}: printed no token")
        return token


@functools.cache
def _file_token(path: str) -> FileToken:
    return FileToken(path)


@functools.cache
def _command_token(command: str, timeout_s: float) -> CommandToken:
    return CommandToken(command, timeout_s)


Connection = str | Mapping[str, Any]
"""Where a tool's client connects: a bootstrap string (PLAINTEXT, as the tests'
brokers and the demo serve), or aiokafka's connection arguments with security
(``connection(kafka)``)."""


def connection(k: KafkaConfig) -> dict[str, Any]:
    """The connection arguments of ``k``: bootstrap, identity and security."""
    return {
        "bootstrap_servers": k.bootstrap_servers,
        "client_id": k.client_id,
        "request_timeout_ms": k.request_timeout_ms,
        **security_kwargs(k),
    }


def connect_kwargs(c: Connection) -> dict[str, Any]:
    """aiokafka keyword arguments for ``c``."""
    return {"bootstrap_servers": c} if isinstance(c, str) else dict(c)
