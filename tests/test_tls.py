"""The gate's Redis over TLS (``rediss://``), against a redis-server with TLS on (Debian's; the
bundled one has none): the gate decides through it, both ways a publish talks to it."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.apps.gated_app import create_app
from tests.conftest import (
    answers,
    gate_settings,
    initialised,
    missing_server,
    queue_messages,
    unused_port,
    wait_until,
)

pytestmark = [pytest.mark.celery, pytest.mark.servers]


def _tls_servers() -> list[str]:
    """redis-server binaries to try: on PATH (perhaps the bundled one, built without TLS),
    then Debian's."""
    found = [shutil.which("redis-server"), "/usr/bin/redis-server"]
    return list(dict.fromkeys(path for path in found if path and Path(path).exists()))


@pytest.fixture()
def tls_url(tmp_path: Path) -> Iterator[str]:
    openssl = shutil.which("openssl")
    if openssl is None:
        missing_server("TLS needs openssl on PATH to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)  # fmt: skip
    for server in _tls_servers():
        port = unused_port()
        process = subprocess.Popen(
            [server, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
             str(cert), "--tls-auth-clients", "no", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
        client = redis.Redis.from_url(url)
        started = wait_until(lambda p=process, c=client: p.poll() is not None or answers(c), 10)
        if started and process.poll() is None:
            break
        process.kill()
        process.wait()
    else:
        missing_server("no redis-server with TLS (Debian's redis-server has it)")
    try:
        initialised(client)
        yield url
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("fast_publish", ["on", "off"])
def test_the_gate_decides_over_tls(
    redis_url: str, redis_client: redis.Redis, tls_url: str, fast_publish: str
) -> None:
    app = create_app(gate_settings(tls_url, fast_publish=fast_publish), redis_url)
    for n in range(3):
        app.tasks["tests.embed"].delay(n)
    reasons = [m["headers"]["gatekeeper_reason"] for m in queue_messages(redis_client, "free")]
    assert reasons == ["fits"] * 3
    gate = redis.Redis.from_url(tls_url)
    assert gate.hlen("gatekeeper:{default}:inflight") == 3  # the gate's state is over there
