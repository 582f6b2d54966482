"""What this principal may do, asked of the broker at start-up.

On a cluster that enforces ACLs, a worker without Read on an input topic starts
and then fails every fetch; one without Write on the result topic starts and
fails its first answer. Both look like a healthy worker until traffic comes.
So, on a secured connection, start-up asks the broker which operations the
principal has on each topic it uses (a Metadata request, version 8, with
``include_topic_authorized_operations``: KIP-430, Kafka 2.3+) and stops with
exit 2 naming every missing permission at once (docs/guides/secure.md).

aiokafka's protocol layer stops at Metadata version 5, so the version 8 request
and response are declared here, from Kafka's ``MetadataRequest.json`` and
``MetadataResponse.json``. A broker that does not serve version 8 (the embedded
one) is not checked: the errors then come at run time, named as they come.

Missing permissions on the group and on the transactional id are reported by
the broker itself when the consumer joins and the producer starts;
``refused`` turns those errors into the same kind of message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    IncompatibleBrokerVersion,
    KafkaError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Schema, String

from worker.config import KafkaConfig
from worker.config.topics import NeededTopic
from worker.flow.errors import ConfigError

# Refusals an operator can undo (an ACL granted again): at run time the worker
# waits for them, not-ready, and neither answers nor commits what they hold up.
NOT_AUTHORISED = (
    TopicAuthorizationFailedError,
    GroupAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    ClusterAuthorizationFailedError,
)

READ, WRITE, DESCRIBE = 3, 4, 8  # Kafka's AclOperation codes: bit n of the answer
_NAMES = {READ: "Read", WRITE: "Write", DESCRIBE: "Describe"}
_NOT_ASKED = -(2**31)  # what the broker answers when operations were not requested
_TOPIC_AUTHORIZATION_FAILED = 29
_UNKNOWN_TOPIC = 3

ACL_HINT = 'docs/guides/secure.md lists every ACL a worker needs'


class _MetadataResponseV8(Response):  # type: ignore[misc]
    API_KEY = 3
    API_VERSION = 8
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "brokers",
            Array(
                ("node_id", Int32),
                ("host", String("utf-8")),
                ("port", Int32),
                ("rack", String("utf-8")),
            ),
        ),
        ("cluster_id", String("utf-8")),
        ("controller_id", Int32),
        (
            "topics",
            Array(
                ("error_code", Int16),
                ("name", String("utf-8")),
                ("is_internal", Boolean),
                (
                    "partitions",
                    Array(
                        ("error_code", Int16),
                        ("partition_index", Int32),
                        ("leader_id", Int32),
                        ("leader_epoch", Int32),
                        ("replica_nodes", Array(Int32)),
                        ("isr_nodes", Array(Int32)),
                        ("offline_replicas", Array(Int32)),
                    ),
                ),
                ("topic_authorized_operations", Int32),
            ),
        ),
        ("cluster_authorized_operations", Int32),
    )


class _MetadataRequestV8(RequestStruct):  # type: ignore[misc]
    API_KEY = 3
    API_VERSION = 8
    RESPONSE_TYPE = _MetadataResponseV8
    SCHEMA = Schema(
        ("topics", Array(String("utf-8"))),
        ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
    )


class _AuthorizedOperations(Request[_MetadataRequestV8]):  # type: ignore[misc]
    API_KEY = 3

    def __init__(self, topics: Iterable[str]) -> None:
        self._topics = list(topics)

    def build(self, request_struct_class: type[_MetadataRequestV8]) -> _MetadataRequestV8:
        return request_struct_class(self._topics, False, False, True)


def needed(topics: Iterable[NeededTopic]) -> dict[str, set[int]]:
    """The operations the worker needs per topic (Read and Write imply Describe),
    from the one list of the topics it uses (``worker.config.topics``)."""
    ops = {"read": {READ}, "write": {WRITE}, "both": {READ, WRITE}}
    need: dict[str, set[int]] = {}
    for topic in topics:
        need.setdefault(topic.name, set()).update(ops[topic.use])
    return need


def missing(answer: Mapping[str, tuple[int, int]], need: Mapping[str, set[int]]) -> list[str]:
    """``Operation on topic name`` for each needed operation the broker's answer
    (topic -> (error code, authorized-operations bits)) does not grant."""
    out = []
    for topic, ops in need.items():
        error, bits = answer.get(topic, (_TOPIC_AUTHORIZATION_FAILED, 0))
        if error == _UNKNOWN_TOPIC:
            continue  # it does not exist (and this principal may know that): said elsewhere
        granted = 0 if error == _TOPIC_AUTHORIZATION_FAILED or bits == _NOT_ASKED else bits
        out += [f"{_NAMES[op]} on topic {topic}" for op in sorted(ops) if not granted >> op & 1]
    return out


async def check_topics(client: Any, k: KafkaConfig, topics: Iterable[NeededTopic]) -> None:
    """Raise ``ConfigError`` naming every permission on ``topics`` the principal
    lacks (a topic that does not exist is said elsewhere). ``client``: a started
    aiokafka client (the producer's). Skipped where the broker does not serve
    Metadata version 8."""
    need = needed(topics)
    try:
        response = await client.send(client.get_random_node(), _AuthorizedOperations(need))
    except (IncompatibleBrokerVersion, KafkaError):
        return
    answer = {t[1]: (t[0], t[4]) for t in response.topics}
    if answer and all(bits == _NOT_ASKED for _, bits in answer.values()):
        return  # a broker that ignores the flag tells nothing either way
    lacking = missing(answer, need)
    if lacking:
        raise ConfigError(
            f"kafka: the principal ({principal_setting(k)}) is not allowed "
            f"{'; '.join(lacking)}; grant these ACLs ({ACL_HINT})"
        )


def refused(exc: BaseException, k: KafkaConfig) -> ConfigError | None:
    """A start-up authorization error as the permission to grant, or None."""
    who = principal_setting(k)
    if isinstance(exc, GroupAuthorizationFailedError):
        return ConfigError(
            f"kafka.group_id: the principal ({who}) is not allowed Read on group "
            f"{k.group_id}; grant it ({ACL_HINT})"
        )
    if isinstance(exc, TransactionalIdAuthorizationFailed):
        return ConfigError(
            f'kafka.processing_guarantee = "exactly-once": the principal ({who}) is not '
            "allowed Write on its transactional id; grant Write on transactional id "
            f"{k.member_transactional_id} ({ACL_HINT})"
        )
    if isinstance(exc, TopicAuthorizationFailedError):
        return ConfigError(
            f"kafka: the principal ({who}) is not allowed to use topic(s) {exc}; "
            f"grant the ACLs ({ACL_HINT})"
        )
    if isinstance(exc, ClusterAuthorizationFailedError):
        return ConfigError(
            f"kafka: the principal ({who}) is not allowed a cluster operation ({exc}); "
            f"grant IdempotentWrite on the cluster if the broker asks for it ({ACL_HINT})"
        )
    return None


def principal_setting(k: KafkaConfig) -> str:
    """Who the broker sees, in the settings' words (never a secret)."""
    if k.security_protocol.startswith("SASL"):
        if k.sasl_mechanism == "OAUTHBEARER":
            return "the OAuth token's subject"
        return f"{k.sasl_mechanism} user {k.sasl_plain_username}"
    if k.ssl_certfile:
        return f"the subject of {k.ssl_certfile}"
    return "ANONYMOUS"
