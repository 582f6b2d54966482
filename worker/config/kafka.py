"""``[kafka]``: brokers, topics, the group, security and client tuning."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Final, Literal, get_args

from worker.config.checks import check, derive
from worker.config.lanes import LaneConfig, check_lanes, ranked
from worker.config.secret import Secret

SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "OAUTHBEARER"]
SaslCredentials = Literal["password", "token", "kerberos"]
# What each SASL mechanism authenticates with, the one table the settings' checks
# and the client's credentials (``worker.kafka.credentials``) both read: a
# mechanism added to ``SaslMechanism`` without its row fails at import.
SASL_CREDENTIALS: Final[dict[str, SaslCredentials]] = {
    "PLAIN": "password",
    "SCRAM-SHA-256": "password",
    "SCRAM-SHA-512": "password",
    "OAUTHBEARER": "token",
    "GSSAPI": "kerberos",  # the system's Kerberos ticket: nothing from the settings
}
assert set(SASL_CREDENTIALS) == set(get_args(SaslMechanism))


# Missing at start-up, this one turns crash-loop protection off with a warning;
# any other name must exist (a typo is refused: worker.app.worker._check_topics).
DEFAULT_CRASH_GUARD_TOPIC: Final = "infer.crash-guard"


@dataclass(frozen=True)
class KafkaConfig:
    # Where the Kafka cluster is: host:port[,host:port...] of one or more brokers.
    bootstrap_servers: str = "localhost:9092"
    # The topics requests are read from (each must exist: the worker refuses to start
    # without them); a TOML list, or comma-separated in the environment variable.
    input_topics: tuple[str, ...] = ("infer.requests",)
    # Priority lanes over the input topics ([[kafka.lanes]], docs/guides/lanes.md); () = every input
    # topic in one lane.
    lanes: tuple[LaneConfig, ...] = ()
    # Where every result goes, keyed like its request (must exist).
    output_topic: str = "infer.results"
    # Where records that cannot be read as requests go, bytes unchanged, with the reason in
    # headers (must exist; a shadow writes none).
    dlq_topic: str = "infer.dlq"
    # The consumer group: workers of one group share the input partitions; its committed
    # offsets are where a restart resumes.
    group_id: str = "infer-worker"
    # Static membership (KIP-345): a member restarting within session_timeout_ms
    # keeps its partitions, so a rolling restart causes no rebalances. Unique per
    # worker: set it from the pod name (e.g. "$(POD_NAME)"); empty = dynamic.
    group_instance_id: str = ""
    # Where crash-loop marks live (compacted; one key per group and partition).
    crash_guard_topic: str = DEFAULT_CRASH_GUARD_TOPIC
    # A stateful model's state changelog (compacted; as many partitions as each
    # input topic: docs/guides/stateful.md). "" = states in memory only.
    state_topic: str = ""
    # The models' control topic (compacted; key = a repository model's name, value = its
    # desired state as JSON, {"version": 3}): every member reads it from the beginning
    # and serves each model at the version its last record names, swapped in while
    # serving; a tombstone unloads it, and a record naming a repository model not served
    # brings it, on its topics (read beside input_topics, as served repository models'
    # topics are) (docs/guides/models.md). Needs [repository]. "" = the repository's policy.
    control_topic: str = ""
    # A shadow deployment (a candidate read beside production, docs/guides/rollout.md): it writes no
    # DLQ records (one is only logged, and counted in infer_requests_rejected_total) and neither
    # writes nor reads crash-guard marks. It needs a group_id and an output_topic of its own.
    shadow: bool = False
    # Names this worker's clients on the broker (its logs, quotas); run --procs N suffixes
    # member i's with -i; every log line carries it as member.
    client_id: str = "infer-worker"
    # How clients connect: plaintext, TLS, SASL over plaintext or SASL over TLS
    # (docs/guides/secure.md).
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    # SASL mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (sasl_plain_username and a
    # password), GSSAPI (Kerberos, needs the gssapi package) or OAUTHBEARER (a token,
    # below).
    sasl_mechanism: SaslMechanism = "PLAIN"
    # OAUTHBEARER (OAuth clusters, MSK IAM): "module:callable", a zero-argument
    # factory returning an aiokafka AbstractTokenProvider (docs/guides/secure.md).
    sasl_oauth_token_provider: str | None = None
    # OAUTHBEARER without code: a file holding the token, read at every
    # authentication (a sidecar or a projected volume keeps it fresh), or a
    # command that prints one (run again before the token's "exp").
    sasl_oauth_token_file: str | None = None
    # OAUTHBEARER: a command whose output is the token, run again before the token's exp.
    sasl_oauth_token_command: str | None = None
    # The SASL user (PLAIN and SCRAM).
    sasl_plain_username: str | None = None
    # The password, or a file holding it (a mounted secret; read when a client
    # is built, so a rotated secret is used by the next connection's client).
    # A Secret (a str given in code is wrapped): never printed or logged.
    sasl_plain_password: Secret | None = None
    # A file holding the SASL password (a mounted secret), instead of sasl_plain_password.
    sasl_plain_password_file: str | None = None
    # TLS: the certificate authority (PEM) that signed the brokers' certificates; unset =
    # the system's.
    ssl_cafile: str | None = None
    # TLS client authentication (mTLS): this worker's certificate (PEM).
    ssl_certfile: str | None = None
    # TLS client authentication: the private key of ssl_certfile (PEM).
    ssl_keyfile: str | None = None
    # The password of an encrypted ssl_keyfile, or a file holding it.
    ssl_password: Secret | None = None
    # A file holding the password of an encrypted ssl_keyfile, instead of ssl_password.
    ssl_password_file: str | None = None
    # How long the group waits for a silent member before giving its partitions to others (a
    # crashed worker's partitions move after this).
    session_timeout_ms: int = 10000
    heartbeat_interval_ms: int = 0  # 0 = min(3000, session_timeout_ms / 3), Kafka's advice
    # The longest a member may go between reads before the group considers it stuck.
    max_poll_interval_ms: int = 300000
    # The most records one read hands over.
    max_poll_records: int = 500
    # The most bytes one fetch response holds, all partitions together.
    fetch_max_bytes: int = 52428800
    # How long the broker may hold a fetch waiting for data: an upper bound on the
    # latency an idle partition adds to a new request.
    fetch_max_wait_ms: int = 100
    # Per partition and fetch (a larger record still comes whole). 0 = derived:
    # 1 MiB (Kafka's own default), or 64 KiB with priority lanes, where a lower
    # lane's large fetch held the urgent lane's records back (urgent p99 91 ms at
    # 64 KiB against about 270 at 8 MiB). It was 8 MiB without lanes: responses of
    # up to 32 MiB cost the event loop more to read than they saved in round
    # trips (a 100,000-record drain: 1.19x the records per second at 1 MiB, 15%
    # less CPU per record; BENCHMARKS.md, "The fetch size"). Records near 1 MiB
    # (raw image tensors) come one or two per partition per fetch: set it higher.
    max_partition_fetch_bytes: int = 0
    # Producer side: results can carry tensors, so allow more than Kafka's 1 MB default.
    max_request_size: int = 16777216
    # Compression of the result records the worker produces.
    compression_type: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "none"
    # How long the producer waits to fill a record batch before sending it.
    linger_ms: int = 2
    # At-least-once: the most often acknowledged offsets are committed (a commit
    # carries every partition's watermark that moved since the last). Each
    # commit is a broker round trip; one per acknowledged batch cost about 6% of
    # a core in a backlog drain. A crash re-answers at most this much more of
    # the stream. Revocation, shutdown and the crash guard commit at once.
    # 0 = after every acknowledgement. Exactly-once commits in its transactions.
    commit_interval_ms: int = 100
    # How long a client waits for a broker's answer to one request before it counts as
    # failed.
    request_timeout_ms: int = 30000
    # Producer: how long to wait between redelivery attempts of unacknowledged
    # results (doubling up to 10 s) while the broker is unreachable.
    retry_backoff_ms: int = 200
    # How often clients refresh the cluster's metadata (new partitions, moved leaders) even
    # when nothing failed.
    metadata_max_age_ms: int = 300000
    # Idempotent producer (the producer's own retries never duplicate a result):
    # "auto" tries it and, where the broker refuses InitProducerId (the embedded
    # broker does), warns and produces without; true requires it; false: off.
    enable_idempotence: Literal["auto", True, False] = "auto"
    # "exactly-once": results, DLQ records and the input offsets they answer are
    # committed in one Kafka transaction, so a read_committed reader sees each
    # request answered once across crashes and rebalances (Apache Kafka only; the
    # worker refuses it at start-up on a broker without transactions).
    processing_guarantee: Literal["at-least-once", "exactly-once"] = "at-least-once"
    # Exactly-once: the member's transactional id, which must survive its restarts
    # (a restarted member then fences its former self) and be unique per member.
    # "" = "<group_id>.<group_instance_id>", so group_instance_id must be set.
    transactional_id: str = ""
    # Exactly-once: the broker aborts a transaction left open this long (a member
    # that died for good); until then read_committed readers of the partitions it
    # wrote to wait. A member that restarts aborts its own at once.
    transaction_timeout_ms: int = 60000
    # Exactly-once: the most completed batches one transaction carries; a
    # transaction takes those completed while the previous one committed, and
    # never waits for more. 0 = batching.max_inflight_batches.
    transaction_batches: int = 0
    # How a record without a content-type header is read: msgpack (contract v1) or
    # the Open Inference Protocol's JSON (for topics whose producers cannot set
    # headers: kcat, Kafka Connect). A record's own header always wins.
    content_type: Literal["application/msgpack", "application/json"] = "application/msgpack"
    # Any other aiokafka consumer/producer argument, passed through as given
    # ([kafka.consumer_options] in TOML, INFER_WORKER_KAFKA__CONSUMER_OPTIONS__<ARG>).
    # Arguments the worker sets itself are refused: they carry its guarantees.
    consumer_options: dict[str, str | int | float | bool] = field(default_factory=dict)
    # Any other aiokafka producer argument, passed through the same way
    # ([kafka.producer_options]).
    producer_options: dict[str, str | int | float | bool] = field(default_factory=dict)

    @property
    def exactly_once(self) -> bool:
        """The guarantee, decided here once: every other layer asks this."""
        return self.processing_guarantee == "exactly-once"

    @cached_property
    def ranked_lanes(self) -> tuple[LaneConfig, ...]:
        """The priority lanes, most urgent first (rank = index), decided here once:
        without ``lanes``, one lane holding every input topic."""
        return ranked(self.input_topics, self.lanes)

    @property
    def has_lanes(self) -> bool:
        """Two lanes or more: what lanes change (fetch sizes and order, the urgent
        lane's own fetcher and producer) applies only then."""
        return len(self.ranked_lanes) > 1

    @cached_property
    def lane_rank(self) -> dict[str, int]:
        """Each input topic's lane (its rank in ``ranked_lanes``)."""
        return {t: r for r, lane in enumerate(self.ranked_lanes) for t in lane.topics}

    @property
    def request_timeout_s(self) -> float:
        """``request_timeout_ms`` in seconds, for every wait it bounds."""
        return self.request_timeout_ms / 1000.0

    @property
    def sasl_credentials(self) -> SaslCredentials | None:
        """What the client shows the broker for SASL (None: no SASL)."""
        if not self.security_protocol.startswith("SASL"):
            return None
        return SASL_CREDENTIALS[self.sasl_mechanism]

    @property
    def member_transactional_id(self) -> str:
        """Exactly-once: this member's transactional id (the setting, else
        ``<group_id>.<group_instance_id>``), decided here once."""
        return self.transactional_id or f"{self.group_id}.{self.group_instance_id}"

    def __post_init__(self) -> None:
        check(bool(self.bootstrap_servers.strip()), "kafka.bootstrap_servers", "must not be empty")
        check(len(self.input_topics) > 0, "kafka.input_topics", "needs at least one topic")
        topics = (*self.input_topics, self.output_topic, self.dlq_topic)
        check(all(t.strip() for t in topics), "kafka.*_topic(s)", "topic names must not be empty")
        check(
            self.output_topic not in self.input_topics and self.dlq_topic not in self.input_topics,
            "kafka.output_topic",
            "output and DLQ topics must differ from the input topics (a result would loop)",
        )
        check(
            self.state_topic not in (*self.input_topics, self.output_topic, self.dlq_topic),
            "kafka.state_topic",
            "must be a topic of its own (compacted; states only)",
        )
        check(
            not self.control_topic or self.control_topic not in (
                *self.input_topics, self.output_topic, self.dlq_topic, self.state_topic),
            "kafka.control_topic",
            "must be a topic of its own (compacted; the models' desired states only)",
        )  # fmt: skip
        check_lanes(self.input_topics, self.lanes)
        if self.max_partition_fetch_bytes == 0:
            derive(self, "max_partition_fetch_bytes", 65536 if self.has_lanes else 1048576)
        check(
            self.max_partition_fetch_bytes >= 1,
            "kafka.max_partition_fetch_bytes",
            "must be >= 1 (0: derived)",
        )
        check(bool(self.group_id), "kafka.group_id", "must not be empty")
        check(self.session_timeout_ms >= 100, "kafka.session_timeout_ms", "must be >= 100")
        if self.heartbeat_interval_ms == 0:
            derive(self, "heartbeat_interval_ms", max(1, min(3000, self.session_timeout_ms // 3)))
        check(
            0 < self.heartbeat_interval_ms < self.session_timeout_ms,
            "kafka.heartbeat_interval_ms",
            "must be > 0 and below session_timeout_ms",
        )
        check(self.max_poll_records >= 1, "kafka.max_poll_records", "must be >= 1")
        check(self.max_request_size >= 1024, "kafka.max_request_size", "must be >= 1024")
        check(self.request_timeout_ms > 0, "kafka.request_timeout_ms", "must be > 0")
        check(self.commit_interval_ms >= 0, "kafka.commit_interval_ms", "must be >= 0")
        check(
            isinstance(self.enable_idempotence, bool) or self.enable_idempotence == "auto",
            "kafka.enable_idempotence",
            'must be "auto", true or false',
        )
        check(
            self.processing_guarantee in ("at-least-once", "exactly-once"),
            "kafka.processing_guarantee",
            'must be "at-least-once" or "exactly-once"',
        )
        check(self.transaction_timeout_ms > 0, "kafka.transaction_timeout_ms", "must be > 0")
        check(self.transaction_batches >= 0, "kafka.transaction_batches", "must be >= 0")
        if self.processing_guarantee == "exactly-once":
            check(
                self.enable_idempotence is not False,
                "kafka.enable_idempotence",
                'false contradicts processing_guarantee = "exactly-once" (a transactional '
                "producer is idempotent)",
            )
            check(
                bool(self.transactional_id or self.group_instance_id),
                "kafka.processing_guarantee",
                '"exactly-once" needs a transactional id that survives restarts: set '
                "kafka.group_instance_id (unique per member, e.g. the pod name) or "
                "kafka.transactional_id",
            )
        self._check_security()

    def _check_security(self) -> None:
        for name in ("sasl_plain_password", "ssl_password"):
            value = getattr(self, name)
            if isinstance(value, str):  # given in code: typed here, once
                derive(self, name, Secret(value))
        check(
            self.sasl_plain_password is None or self.sasl_plain_password_file is None,
            "kafka.sasl_plain_password_file",
            "set sasl_plain_password or sasl_plain_password_file, not both",
        )
        check(
            self.ssl_password is None or self.ssl_password_file is None,
            "kafka.ssl_password_file",
            "set ssl_password or ssl_password_file, not both",
        )
        if self.sasl_credentials == "password":
            check(
                self.sasl_plain_username is not None
                and (self.sasl_plain_password is not None or bool(self.sasl_plain_password_file)),
                "kafka.sasl_plain_username",
                f"{self.security_protocol} with {self.sasl_mechanism} needs a username and a "
                "password (sasl_plain_password or sasl_plain_password_file)",
            )
        if self.sasl_credentials == "token":
            sources = [
                self.sasl_oauth_token_provider,
                self.sasl_oauth_token_file,
                self.sasl_oauth_token_command,
            ]
            check(
                sum(bool(x) for x in sources) == 1,
                "kafka.sasl_oauth_token_provider",
                "OAUTHBEARER needs exactly one of sasl_oauth_token_file, "
                "sasl_oauth_token_command, or sasl_oauth_token_provider (a factory as "
                "'module:callable')",
            )
            check(
                not self.sasl_oauth_token_provider or ":" in self.sasl_oauth_token_provider,
                "kafka.sasl_oauth_token_provider",
                "OAUTHBEARER needs a token provider factory as 'module:callable'",
            )
