"""A secured Apache Kafka for the tests: TLS, mutual TLS, SASL and ACLs.

``Security`` adds three client listeners to every node of a ``KafkaCluster``:

- ``SASL_SSL``: TLS with SASL SCRAM-SHA-512 or PLAIN (users and passwords from
  ``users``; SCRAM credentials are written at storage format, as a KRaft
  cluster takes them before it first starts);
- ``SSL``: mutual TLS, a client certificate required; its principal is the
  certificate's common name (``User:worker`` for ``CN=worker``);
- ``OAUTH``: TLS with SASL OAUTHBEARER, tokens checked by Kafka's built-in
  unsecured-JWS validator (``alg: none``; the ``sub`` claim is the principal).
  Enough to test how the worker gets and refreshes tokens; never for production.

Authorisation is Kafka's ``StandardAuthorizer`` with
``allow.everyone.if.no.acl.found=false``: a principal may do only what an ACL
grants (``grant``/``revoke`` below). The node's own ``PLAINTEXT`` listener stays:
brokers talk to each other and the controller over it, and the test harness
creates topics and ACLs through it; its principal, ``User:ANONYMOUS``, is a super
user. No worker or client under test is ever given that listener.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.admin import CreateAclsRequest, DeleteAclsRequest

from devkit.kafka_pki import Pki, make_pki

if TYPE_CHECKING:
    from devkit.apache_kafka import KafkaCluster

LISTENERS = ("SASL_SSL", "SSL", "OAUTH")  # one port each per node, in this order

_SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"
_PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
_OAUTH = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"


@dataclass(frozen=True)
class Security:
    """What a secured cluster is made with: its certificates and its users."""

    pki: Pki
    users: Mapping[str, str] = field(default_factory=dict)  # name -> password (SCRAM, PLAIN)

    def properties(self) -> dict[str, str]:
        """A node's settings for the secured listeners and the authorizer."""
        plain_users = " ".join(f'user_{u}="{p}"' for u, p in self.users.items())
        return {
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.pki.broker_keystore),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.pki.ca),
            "listener.name.ssl.ssl.client.auth": "required",
            # User:worker rather than User:CN=worker for a certificate's subject.
            "ssl.principal.mapping.rules": "RULE:^CN=([^,]+)$/$1/,DEFAULT",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN,OAUTHBEARER",
            "listener.name.sasl_ssl.sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": f"{_SCRAM} required;",
            "listener.name.sasl_ssl.plain.sasl.jaas.config": f"{_PLAIN} required {plain_users};",
            "listener.name.oauth.sasl.enabled.mechanisms": "OAUTHBEARER",
            "listener.name.oauth.oauthbearer.sasl.jaas.config": (
                f'{_OAUTH} required unsecuredLoginStringClaim_sub="broker";'
            ),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": "User:ANONYMOUS",
        }

    def format_arguments(self) -> list[str]:
        """``StorageTool format`` arguments that create the SCRAM users."""
        args = []
        for user, password in self.users.items():
            args += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
        return args


PROTOCOL_MAP = "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL,SSL:SSL,OAUTH:SASL_SSL"


def unsecured_token(principal: str, lifetime_s: float = 3600.0) -> str:
    """An unsecured JWS (``alg: none``) for ``principal``, valid ``lifetime_s``
    from now: what the broker's built-in validator accepts."""

    def part(obj: object) -> str:
        raw = json.dumps(obj, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    now = time.time()
    claims = {"sub": principal, "iat": int(now), "exp": int(now + lifetime_s)}
    return f"{part({'alg': 'none'})}.{part(claims)}."


# --- ACLs ----------------------------------------------------------------------------

RESOURCE = {"topic": 2, "group": 3, "cluster": 4, "transactional_id": 5}
OPERATION = {
    "All": 2, "Read": 3, "Write": 4, "Create": 5, "Delete": 6, "Alter": 7,
    "Describe": 8, "ClusterAction": 9, "DescribeConfigs": 10, "AlterConfigs": 11,
    "IdempotentWrite": 12,
}  # fmt: skip
_LITERAL, _PREFIXED, _ALLOW = 3, 4, 3


@dataclass(frozen=True)
class Acl:
    """``principal`` may do ``operation`` on the resource ``kind``/``name`` (a name
    ending in ``*`` is a prefix: ``infer-worker.*``)."""

    principal: str  # "User:worker"
    operation: str  # a key of OPERATION
    kind: str  # a key of RESOURCE
    name: str

    def request_fields(self) -> tuple[int, str, int, str, str, int, int]:
        prefixed = self.name.endswith("*") and self.name != "*"
        return (
            RESOURCE[self.kind],
            self.name[:-1] if prefixed else self.name,
            _PREFIXED if prefixed else _LITERAL,
            self.principal,
            "*",
            OPERATION[self.operation],
            _ALLOW,
        )


async def grant(bootstrap: str, acls: Iterable[Acl]) -> None:
    """Create ``acls`` through the harness's PLAINTEXT listener (a super user's).
    aiokafka has no ACL calls; its protocol layer has the requests."""
    await _each(bootstrap, [CreateAclsRequest(*a.request_fields()) for a in acls], "creation")


async def revoke(bootstrap: str, acls: Iterable[Acl]) -> None:
    await _each(bootstrap, [DeleteAclsRequest(*a.request_fields()) for a in acls], "filter")


async def _each(bootstrap: str, requests: list[object], what: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for request in requests:
            response = await admin._send_request(request)  # type: ignore[arg-type]
            for error_code, message, *_ in getattr(response, f"{what}_responses"):
                if error_code:
                    raise RuntimeError(f"ACL request failed ({error_code}): {message}")
    finally:
        await admin.close()


def worker_acls(
    principal: str,
    *,
    inputs: Iterable[str],
    output: str,
    dlq: str,
    group: str,
    crash_guard: str,
    transactional_id: str | None = None,
) -> list[Acl]:
    """What a worker needs and nothing more: the table in README "Secured Kafka"
    (tests/unit/devkit/test_kafka_security.py checks the two agree). Read and
    Write imply Describe; an idempotent producer needs no IdempotentWrite on
    Kafka 3.0 and later (KIP-679)."""
    acls = [Acl(principal, "Read", "topic", t) for t in inputs]
    acls += [Acl(principal, "Read", "group", group)]
    acls += [Acl(principal, "Write", "topic", t) for t in (output, dlq)]
    acls += [Acl(principal, op, "topic", crash_guard) for op in ("Read", "Write")]
    if transactional_id is not None:
        acls += [Acl(principal, "Write", "transactional_id", transactional_id)]
    return acls


def client_settings(
    listener: str,
    bootstrap: str,
    pki: Pki,
    *,
    user: str | None = None,
    password: str | None = None,
    mechanism: str = "SCRAM-SHA-512",
) -> dict[str, str]:
    """``INFER_WORKER_KAFKA__*`` variables for a worker on ``listener``."""
    env = {
        "INFER_WORKER_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "INFER_WORKER_KAFKA__SSL_CAFILE": str(pki.ca),
    }
    if listener == "SSL":
        cert = pki.clients[user or "worker"]
        env |= {
            "INFER_WORKER_KAFKA__SECURITY_PROTOCOL": "SSL",
            "INFER_WORKER_KAFKA__SSL_CERTFILE": str(cert.cert),
            "INFER_WORKER_KAFKA__SSL_KEYFILE": str(cert.key),
        }
    else:
        env |= {
            "INFER_WORKER_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
            "INFER_WORKER_KAFKA__SASL_MECHANISM": mechanism,
        }
        if mechanism != "OAUTHBEARER":
            env |= {
                "INFER_WORKER_KAFKA__SASL_PLAIN_USERNAME": user or "worker",
                "INFER_WORKER_KAFKA__SASL_PLAIN_PASSWORD": password or "",
            }
    return env


def secured_cluster(directory: Path, password: str) -> tuple[KafkaCluster, Pki]:
    """A single-node secured cluster whose user ``worker`` (SCRAM password
    ``password``, or the client certificate CN=worker) may use every topic and
    group: the benchmarks' cluster, where what is measured is the wire, not ACLs."""
    from devkit.apache_kafka import KafkaCluster

    pki = make_pki(directory, ("worker",))
    return KafkaCluster(security=Security(pki, {"worker": password})), pki


async def grant_everything(bootstrap: str, principal: str) -> None:
    await grant(bootstrap, [
        *(Acl(principal, op, "topic", "*") for op in ("Read", "Write", "Describe")),
        Acl(principal, "Read", "group", "*"),
        Acl(principal, "Write", "transactional_id", "*"),
    ])  # fmt: skip


def listener_variants(cluster: KafkaCluster, pki: Pki, password: str) -> dict[str, dict[str, str]]:
    """Worker settings per secured listener (``benchmarks.drain --broker kafka-secured``)."""
    return {
        "sasl_ssl": client_settings(
            "SASL_SSL", cluster.listener("SASL_SSL"), pki, user="worker", password=password
        ),
        "mtls": client_settings("SSL", cluster.listener("SSL"), pki, user="worker"),
    }
