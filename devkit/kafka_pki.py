"""Certificates made at test time for a secured Apache Kafka (``devkit.kafka_security``).

One throw-away certificate authority signs a broker certificate for 127.0.0.1 and
localhost and one client certificate per name asked for; a second, unknown
authority signs a client certificate the broker must refuse, and the first signs
one that has already expired. Everything is PEM, unencrypted keys in PKCS#8 (what
Kafka's ``ssl.keystore.type=PEM`` reads and what Python's ``ssl`` module loads).

Test-only: keys are 2048-bit RSA made fresh each run and never leave the
temporary directory.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)
_CA_USAGE = x509.KeyUsage(
    digital_signature=True, content_commitment=False, key_encipherment=False,
    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
    encipher_only=False, decipher_only=False,
)  # fmt: skip
_CA_USAGE = x509.KeyUsage(
    digital_signature=True, content_commitment=False, key_encipherment=False,
    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
    encipher_only=False, decipher_only=False,
)  # fmt: skip


@dataclass(frozen=True)
class ClientCert:
    """A client's certificate and key files (what ``kafka.ssl_certfile`` and
    ``kafka.ssl_keyfile`` name)."""

    name: str
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path  # the authority's certificate: the broker's truststore, kafka.ssl_cafile
    broker_keystore: Path  # the broker's key and certificate chain, one PEM file
    clients: dict[str, ClientCert]
    expired: ClientCert  # signed by the CA, valid until yesterday
    stranger: ClientCert  # signed by an authority the broker does not trust
    stranger_ca: Path  # that authority (a client trusting it cannot verify the broker)


def make_pki(directory: Path, clients: tuple[str, ...]) -> Pki:
    """A CA, the broker's keystore and the clients' certificates, under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key, ca_cert = _authority("infer-worker test CA", now)
    other_key, other_cert = _authority("some other CA", now)
    ca = _write_cert(directory / "ca.pem", ca_cert)
    stranger_ca = _write_cert(directory / "stranger-ca.pem", other_cert)

    broker_key = _key()
    broker = _signed(
        "broker", broker_key, ca_key, ca_cert, now - _DAY, now + 30 * _DAY, server=True
    )
    keystore = directory / "broker-keystore.pem"
    keystore.write_bytes(_pem_key(broker_key) + _pem_cert(broker) + _pem_cert(ca_cert))

    def client(name: str, issuer_key: rsa.RSAPrivateKey, issuer: x509.Certificate,
               start: datetime.datetime, end: datetime.datetime) -> ClientCert:  # fmt: skip
        key = _key()
        cert = _signed(name, key, issuer_key, issuer, start, end, server=False)
        key_path = directory / f"{name}.key"
        key_path.write_bytes(_pem_key(key))
        key_path.chmod(0o600)
        return ClientCert(name, _write_cert(directory / f"{name}.pem", cert), key_path)

    return Pki(
        ca=ca,
        broker_keystore=keystore,
        clients={n: client(n, ca_key, ca_cert, now - _DAY, now + 30 * _DAY) for n in clients},
        expired=client("expired", ca_key, ca_cert, now - 30 * _DAY, now - _DAY),
        stranger=client("stranger", other_key, other_cert, now - _DAY, now + 30 * _DAY),
        stranger_ca=stranger_ca,
    )


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _authority(
    common_name: str, now: datetime.datetime
) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    key = _key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _DAY)
        .not_valid_after(now + 30 * _DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _signed(
    common_name: str,
    key: rsa.RSAPrivateKey,
    issuer_key: rsa.RSAPrivateKey,
    issuer: x509.Certificate,
    start: datetime.datetime,
    end: datetime.datetime,
    *,
    server: bool,
) -> x509.Certificate:
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        # A broker is also a client of its peers (inter-broker TLS): both usages.
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                if server
                else [usage]
            ),
            critical=False,
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(_pem_cert(cert))
    return path
