"""Secrets and permissions without a broker: where a secret comes from, that it
is never printed, how tokens are read and refreshed, and which permissions the
start-up check asks for and reports missing. The broker's side is
tests/faults/test_secured_kafka.py."""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path

import pytest

from worker.config import KafkaConfig, LimitsConfig, Settings, load_settings
from worker.config.loading import redacted_tree
from worker.config.topics import needed_topics
from worker.flow.errors import ConfigError
from worker.kafka import credentials
from worker.kafka.credentials import CommandToken, FileToken, read_secret, token_expiry
from worker.kafka.permissions import READ, WRITE, missing, needed


def jwt(exp: float) -> str:
    def part(obj: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    return f"{part({'alg': 'none'})}.{part({'sub': 'w', 'exp': exp})}."


def test_a_password_file_is_read_when_the_client_is_built(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("first\n")
    k = KafkaConfig(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
        sasl_plain_username="w", sasl_plain_password_file=str(secret),
    )  # fmt: skip
    assert credentials.security_kwargs(k)["sasl_plain_password"] == "first"
    secret.write_text("rotated")
    assert credentials.security_kwargs(k)["sasl_plain_password"] == "rotated"


def test_an_unreadable_or_empty_secret_file_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"kafka\.x_file: cannot read"):
        read_secret(str(tmp_path / "absent"), "kafka.x_file")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_secret(str(tmp_path / "empty"), "kafka.x_file")


def test_a_secret_and_its_file_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="not both"):
        KafkaConfig(sasl_plain_password="a", sasl_plain_password_file="/f")
    with pytest.raises(ConfigError, match="not both"):
        KafkaConfig(ssl_password="a", ssl_password_file="/f")


def test_oauthbearer_takes_exactly_one_token_source() -> None:
    base = {"security_protocol": "SASL_SSL", "sasl_mechanism": "OAUTHBEARER"}
    with pytest.raises(ConfigError, match="exactly one"):
        KafkaConfig(**base)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="exactly one"):
        KafkaConfig(**base, sasl_oauth_token_file="/t", sasl_oauth_token_command="x")  # type: ignore[arg-type]
    KafkaConfig(**base, sasl_oauth_token_file="/t")  # type: ignore[arg-type]


def test_secrets_are_masked_in_the_settings_dump() -> None:
    k = KafkaConfig(sasl_plain_password="hunter2", ssl_password="swordfish")
    dump = json.dumps(redacted_tree(Settings(kafka=k)))
    assert "hunter2" not in dump and "swordfish" not in dump and "***" in dump


def test_a_password_is_a_secret_whatever_prints_it(tmp_path: Path) -> None:
    """Issue 38: secret settings are typed (``Secret``), so no way of printing
    the settings shows one: repr, str, format, the settings' repr, a log line;
    only the client's credentials reveal it."""
    from worker.config import load_settings
    from worker.config.secret import Secret

    toml = tmp_path / "w.toml"
    toml.write_text("[kafka]\nsecurity_protocol = 'SASL_SSL'\nsasl_mechanism = 'PLAIN'\n"
                    "sasl_plain_username = 'u'\nsasl_plain_password = 'hunter2'\n")  # fmt: skip
    from_file = load_settings(toml, env={"INFER_WORKER_KAFKA__SSL_PASSWORD": "swordfish"}).kafka
    in_code = KafkaConfig(sasl_plain_password="hunter2", ssl_password="swordfish")
    for k in (from_file, in_code):
        assert isinstance(k.sasl_plain_password, Secret) and isinstance(k.ssl_password, Secret)
        shown = [repr(k), str(k), f"{k.sasl_plain_password}", f"{k.ssl_password:>12}",
                 repr(Settings(kafka=k))]  # fmt: skip
        assert not any("hunter2" in s or "swordfish" in s for s in shown), shown
    assert credentials.security_kwargs(from_file)["sasl_plain_password"] == "hunter2"
    toml.write_text("[kafka]\nsasl_plain_password = 1234567\n")  # not a string
    with pytest.raises(ConfigError, match=r"kafka\.sasl_plain_password: expected a string") as bad:
        load_settings(toml, env={})
    assert "1234567" not in str(bad.value)


@pytest.mark.parametrize(
    ("mechanism", "shown"),
    [("PLAIN", {"sasl_plain_username", "sasl_plain_password"}),
     ("SCRAM-SHA-512", {"sasl_plain_username", "sasl_plain_password"}),
     ("GSSAPI", set())],
)  # fmt: skip
def test_each_mechanism_is_given_what_its_row_says_and_nothing_else(
    mechanism: str, shown: set[str]
) -> None:
    """One table (``SASL_CREDENTIALS``) says what a mechanism authenticates with:
    a password mechanism gets the username and password, GSSAPI (the system's
    Kerberos ticket) neither, even where they are set."""
    k = KafkaConfig(security_protocol="SASL_PLAINTEXT", sasl_mechanism=mechanism,  # type: ignore[arg-type]
                    sasl_plain_username="u", sasl_plain_password="p")  # fmt: skip
    kwargs = credentials.security_kwargs(k)
    assert kwargs["sasl_mechanism"] == mechanism
    assert {key for key in kwargs if key.startswith("sasl_plain")} == shown


def test_a_certificate_that_cannot_be_loaded_names_the_setting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"kafka\.ssl_cafile"):
        credentials.ssl_context(KafkaConfig(security_protocol="SSL", ssl_cafile=str(bad)))
    with pytest.raises(ConfigError, match=r"kafka\.ssl_certfile"):
        credentials.ssl_context(KafkaConfig(security_protocol="SSL", ssl_certfile=str(bad)))


def test_token_expiry_reads_a_jwt_and_ignores_anything_else() -> None:
    assert token_expiry(jwt(1234.0)) == 1234.0
    assert token_expiry("opaque-token") is None
    assert token_expiry("a.!!!.c") is None


async def test_a_file_token_is_read_at_every_authentication(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(jwt(time.time() + 600) + "\n")
    provider = FileToken(str(path))
    first = await provider.token()
    path.write_text("second-token")
    assert first.count(".") == 2 and await provider.token() == "second-token"


async def test_a_command_token_is_kept_until_shortly_before_it_expires(tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    script = tmp_path / "token.py"
    script.write_text(
        "import base64, json, pathlib, sys, time\n"
        f"p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) + 1 if p.exists() else 1\n"
        "p.write_text(str(n))\n"
        "part = lambda o: base64.urlsafe_b64encode(json.dumps(o).encode()).decode().rstrip('=')\n"
        "exp = time.time() + float(sys.argv[1])\n"
        "print(part({'alg': 'none'}) + '.' + part({'sub': 'w', 'exp': exp}) + '.')\n"
    )
    long_lived = CommandToken(f"{sys.executable} {script} 3600", timeout_s=30)
    await long_lived.token()
    await long_lived.token()
    assert counter.read_text() == "1"  # valid for an hour: fetched once
    short_lived = CommandToken(f"{sys.executable} {script} 30", timeout_s=30)
    await short_lived.token()
    await short_lived.token()
    assert counter.read_text() == "3"  # inside the refresh margin: fetched each time


async def test_a_failing_token_command_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="sasl_oauth_token_command: exit 3"):
        await CommandToken(f"{sys.executable} -c 'import sys; sys.exit(3)'", 30).token()


def test_the_permissions_asked_for_and_what_is_missing() -> None:
    k = KafkaConfig(input_topics=("in",), output_topic="out", dlq_topic="dlq",
                    crash_guard_topic="guard")  # fmt: skip
    need = needed(needed_topics(Settings(kafka=k)))
    assert need == {"in": {READ}, "out": {WRITE}, "dlq": {WRITE}, "guard": {READ, WRITE}}
    unguarded = Settings(kafka=k, limits=LimitsConfig(max_crash_attempts=0))
    assert "guard" not in needed(needed_topics(unguarded))
    bits = lambda *ops: sum(1 << op for op in ops)  # noqa: E731
    answer = {"in": (0, bits(READ, 8)), "out": (0, bits(8)), "dlq": (0, bits(WRITE)),
              "guard": (29, -(2**31))}  # fmt: skip
    assert missing({**answer, "in": (3, -(2**31))}, {"in": {READ}}) == []  # absent: said elsewhere
    assert missing(answer, need) == [
        "Write on topic out",
        "Read on topic guard",
        "Write on topic guard",
    ]


def test_a_shadow_asks_for_no_dlq_or_crash_guard_permission() -> None:
    k = KafkaConfig(input_topics=("in",), output_topic="shadow.out", dlq_topic="dlq",
                    crash_guard_topic="guard", shadow=True)  # fmt: skip
    assert needed(needed_topics(Settings(kafka=k))) == {"in": {READ}, "shadow.out": {WRITE}}


def test_a_pipeline_step_s_audit_topic_is_asked_to_be_writable() -> None:
    """The permissions come from the one list of needed topics that topics create
    and the start-up check read (worker.config.topics): a step's audit topic was
    in theirs but not in the permissions asked for."""
    s = load_settings(env={
        "INFER_WORKER_KAFKA__INPUT_TOPICS": "in,chain.in",
        "INFER_WORKER_MODEL__TOPICS": "in",
        "INFER_WORKER_PIPELINES__CHAIN__TOPICS": "chain.in",
        "INFER_WORKER_PIPELINES__CHAIN__STEPS":
            '[{name = "d", model = "digits", topic = "chain.audit"}]',
        "INFER_WORKER_PIPELINES__CHAIN__OUTPUTS": '{out = "d.topk_indices"}',
    })  # fmt: skip
    topics = needed_topics(s)
    assert needed(topics)["chain.audit"] == {WRITE}
    audit = [t.setting for t in topics if t.name == "chain.audit"]
    assert audit == ["pipelines.chain.steps[0].topic"]
