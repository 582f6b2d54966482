"""A real Schema Registry for the tests and the dev kit: Apicurio Registry's
ready-to-run bundle from Maven Central, fetched once, started on a free port.

``io.apicurio:apicurio-registry-app:3.0.9`` (type ``zip``, classifier ``all``:
the Quarkus runner jar and its libraries, about 110 MB) is unpacked by Maven
into ``<cache>/apicurio-registry-<version>/`` (the cache of
``devkit.kafka_runtime``) under a lock, once. It runs on Java 17 with in-memory
storage and serves the Confluent-compatible API at ``/apis/ccompat/v7``
(``SchemaRegistryServer.url``), Avro, Protobuf and JSON Schema. Known
differences from Confluent's registry: the default compatibility is NONE, and
some error bodies differ.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from devkit.kafka_runtime import INSTALL_HINT, KafkaUnavailable, _locked, cache_root, java_binary
from worker.ops.broker import free_port

APICURIO_VERSION = "3.0.9"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:zip:all"
RUNNER = f"apicurio-registry-app-{APICURIO_VERSION}-runner.jar"
API = "/apis/ccompat/v7"


class RegistryUnavailable(KafkaUnavailable):
    """No registry here: no ``java``, no ``mvn``, the fetch failed, or it did not start."""

    code = "registry_unavailable"


def registry_home(version: str = APICURIO_VERSION, timeout: float = 900.0) -> Path:
    """The unpacked bundle's directory (its runner jar in it), fetched on first use."""
    home = cache_root() / f"apicurio-registry-{version}"
    app = home / "app"
    if (app / ".complete").is_file():
        return app
    java_binary()
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RegistryUnavailable(f"no mvn on PATH. {INSTALL_HINT}")
    home.mkdir(parents=True, exist_ok=True)
    with _locked(home / ".lock"):
        if (app / ".complete").is_file():
            return app
        staging = home / "app.partial"
        shutil.rmtree(staging, ignore_errors=True)
        log = home / "mvn.log"
        with open(log, "wb") as out:
            done = subprocess.run(
                [mvn, "-q", "-B", "dependency:unpack", f"-Dartifact={ARTIFACT}",
                 f"-DoutputDirectory={staging}"],
                cwd=home, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                timeout=timeout, check=False,
            )  # fmt: skip
        if done.returncode != 0 or not (staging / RUNNER).is_file():
            tail = log.read_text(errors="replace")[-2000:]
            raise RegistryUnavailable(
                f"fetching {ARTIFACT} with Maven failed (exit {done.returncode}); log: {log}\n"
                f"{tail}\n{INSTALL_HINT}"
            )
        (staging / ".complete").write_text("fetched\n")
        shutil.rmtree(app, ignore_errors=True)
        staging.rename(app)
    return app


class SchemaRegistryServer:
    """One Apicurio Registry process (in-memory: empty at each start)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="registry-", suffix=".log")[1])

    @property
    def url(self) -> str:
        """The Confluent-compatible API's base URL (``schema_registry.url``)."""
        return f"http://127.0.0.1:{self.port}{API}"

    def start(self, timeout: float = 90.0) -> SchemaRegistryServer:
        app = registry_home()
        with open(self._log, "wb") as out:
            self._proc = subprocess.Popen(
                [java_binary(), "-Xmx512m", f"-Dquarkus.http.port={self.port}",
                 "-Dquarkus.http.host=127.0.0.1", "-jar", str(app / RUNNER)],
                cwd=app, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RegistryUnavailable(f"the registry exited ({self._proc.returncode}): "
                                          f"{self.log_tail()}")  # fmt: skip
            try:
                with urllib.request.urlopen(f"{self.url}/subjects", timeout=2.0) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RegistryUnavailable(f"the registry did not answer in {timeout:.0f}s: "
                                  f"{self.log_tail()}")  # fmt: skip

    def log_tail(self, chars: int = 2000) -> str:
        return self._log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> SchemaRegistryServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class SecuredFront:
    """HTTPS with basic auth in front of a registry (``url``), as a secured
    registry presents itself: every call must carry ``username``/``password``
    (401 otherwise) over TLS with ``keystore`` (a PEM of key and certificate
    chain, e.g. ``devkit.kafka_pki``'s for 127.0.0.1), and is passed on to the
    registry as it came. Test-only; ``seen`` counts the calls let through."""

    def __init__(self, backend: str, keystore: Path, username: str, password: str) -> None:
        import base64
        import http.server
        import ssl
        import threading

        expected = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
        front = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self) -> None:
                if self.headers.get("Authorization") != expected:
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="registry"')
                    self.end_headers()
                    return
                front.seen += 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                target = backend.split("/apis/", maxsplit=1)[0] + self.path
                req = urllib.request.Request(target, data=body, method=self.command, headers={
                    k: v for k, v in self.headers.items()
                    if k.lower() in ("content-type", "accept")})  # fmt: skip
                try:
                    with urllib.request.urlopen(req, timeout=10) as resp:
                        status, payload = resp.status, resp.read()
                except urllib.error.HTTPError as exc:
                    status, payload = exc.code, exc.read()
                self.send_response(status)
                self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _forward

            def log_message(self, *args: object) -> None:
                pass

        self.seen = 0
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(str(keystore))
        self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._server.server_address[1]}{API}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
