"""The ACLs docs/guides/secure.md lists are the ones the secured-Kafka tests
grant the worker (``devkit.kafka_security.worker_acls``), and only those; the
test-time certificates are what the broker and the clients are told they are."""

from __future__ import annotations

import datetime
import re
import ssl
from pathlib import Path

from devkit.kafka_pki import make_pki
from devkit.kafka_security import Acl, unsecured_token, worker_acls
from tests.documentation import documentation
from worker.kafka.credentials import token_expiry

ROOT = Path(__file__).resolve().parents[3]
SETTING = {"kafka.input_topics": "in", "kafka.group_id": "g", "kafka.output_topic": "out",
           "kafka.dlq_topic": "dlq", "kafka.crash_guard_topic": "guard",
           "kafka.transactional_id": "tx"}  # fmt: skip
KIND = {"topic": "topic", "group": "group", "transactional id": "transactional_id"}


def readme_acls() -> set[tuple[str, str, str]]:
    text = documentation()
    table = text[text.index("| operation | resource | for |") :].split("\n\n")[0]
    rows = set()
    for line in table.splitlines()[2:]:
        operations, resource, _ = (c.strip() for c in line.strip("|").split("|"))
        kind = next(k for k in KIND if resource.startswith(k))
        setting = re.search(r"`(kafka\.\w+)`", resource)
        assert setting is not None, line
        for op in operations.split(", "):
            rows.add((op, KIND[kind], SETTING[setting.group(1)]))
    return rows


def test_the_readme_lists_exactly_the_acls_the_tests_grant() -> None:
    acls = worker_acls("User:w", inputs=["in"], output="out", dlq="dlq", group="g",
                       crash_guard="guard", transactional_id="tx")  # fmt: skip
    assert {(a.operation, a.kind, a.name) for a in acls} == readme_acls()


def test_a_prefix_acl_is_sent_as_a_prefixed_pattern() -> None:
    assert Acl("User:w", "Read", "topic", "infer.*").request_fields()[1:3] == ("infer.", 4)
    assert Acl("User:w", "Read", "topic", "infer").request_fields()[1:3] == ("infer", 3)


def test_certificates_made_for_a_run(tmp_path: Path) -> None:
    pki = make_pki(tmp_path, ("worker",))
    client = ssl.create_default_context(cafile=str(pki.ca))  # the CA loads as a trust root
    client.load_cert_chain(pki.clients["worker"].cert, pki.clients["worker"].key)
    decode = ssl._ssl._test_decode_cert  # type: ignore[attr-defined]
    expired = decode(str(pki.expired.cert))["notAfter"]
    assert ssl.cert_time_to_seconds(expired) < datetime.datetime.now().timestamp()
    assert decode(str(pki.clients["worker"].cert))["subject"] == ((("commonName", "worker"),),)


def test_an_unsecured_token_carries_its_subject_and_expiry() -> None:
    token = unsecured_token("worker", lifetime_s=60)
    exp = token_expiry(token)
    assert token.endswith(".") and exp is not None
    assert 0 < exp - datetime.datetime.now().timestamp() <= 60
