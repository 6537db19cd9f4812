"""The gate's Redis behind Redis Sentinel: a failover while a thread publishes. Nothing goes to
free that the gate did not decide on a primary, and the gate decides again after the
failover without a restart. And a Sentinel broker set up as Celery documents it (the master
named in ``broker_transport_options``): gated, and replayed. Real servers: a primary, a
replica, a Sentinel."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from click.testing import CliRunner

import gatekeeper
from gatekeeper.ops.cli import main
from gatekeeper.ops.embedded import EmbeddedRedis, EmbeddedRedisError, find_redis_server
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


def _server(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([find_redis_server(), *args], stdout=subprocess.DEVNULL)


@pytest.fixture()
def sentinel_url(tmp_path: Path) -> Iterator[tuple[str, redis.Redis, int]]:
    """A Sentinel watching a primary with one replica: its URL, a client on the Sentinel,
    and the replica's port (the master after a failover)."""
    try:
        primary = EmbeddedRedis().start()
    except EmbeddedRedisError as exc:
        missing_server(str(exc))
    initialised(redis.Redis.from_url(primary.url))  # replicated to the replica
    replica_port, sentinel_port = unused_port(), unused_port()
    replica = _server("--port", str(replica_port), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no", "--replicaof", "127.0.0.1",
                      str(primary.port))  # fmt: skip
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {sentinel_port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor gate 127.0.0.1 {primary.port} 1\n"
        "sentinel down-after-milliseconds gate 1000\nsentinel failover-timeout gate 5000\n"
    )
    sentinel = _server(str(conf), "--sentinel")
    watcher = redis.Redis(host="127.0.0.1", port=sentinel_port)
    try:
        replica_client = redis.Redis(host="127.0.0.1", port=replica_port)
        assert wait_until(lambda: _linked(replica_client))
        assert wait_until(lambda: answers(watcher) and bool(
            watcher.execute_command("SENTINEL", "REPLICAS", "gate")))  # fmt: skip
        yield f"sentinel://127.0.0.1:{sentinel_port}/0?master_name=gate", watcher, replica_port
    finally:
        for process in (sentinel, replica):
            process.kill()
            process.wait()
        primary.stop()


def _linked(replica: redis.Redis) -> bool:
    """The replica is up and synced with its primary (False while it is still starting)."""
    try:
        return replica.info("replication").get("master_link_status") == "up"
    except redis.RedisError:
        return False


def test_a_failover_while_publishing_sends_nothing_undecided_to_free(
    redis_url: str,
    redis_client: redis.Redis,
    sentinel_url: tuple[str, redis.Redis, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, watcher, replica_port = sentinel_url
    app = create_app(gate_settings(url, budget_units=1e9, redis_timeout_s=0.5), redis_url)
    embed = app.tasks["tests.embed"]
    stop, published = threading.Event(), []

    def publish() -> None:
        while not stop.is_set():
            published.append((time.time(), embed.delay(len(published)).id))
            time.sleep(0.01)

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        time.sleep(1.0)
        watcher.execute_command("SENTINEL", "FAILOVER", "gate")
        moved = wait_until(lambda: int(watcher.execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", "gate")[1]) == replica_port,
            timeout_s=30)  # fmt: skip
        assert moved, "the Sentinel did not fail over"
        failed_over = time.time()

        def decided_again() -> bool:  # an admission published a second after the failover
            return any(m["headers"]["gatekeeper_published_at"] > failed_over + 1
                       for m in queue_messages(redis_client, "free"))  # fmt: skip

        wait_until(decided_again, timeout_s=20, every_s=0.2)  # asserted below, once stopped
    finally:
        stop.set()
        thread.join()
    free = queue_messages(redis_client, "free")
    reserved = queue_messages(redis_client, "reserved")
    assert len(free) + len(reserved) == len(published)  # nothing lost
    assert {m["headers"]["gatekeeper_reason"] for m in free} == {"fits"}  # decided, on a primary
    assert {m["headers"]["gatekeeper_reason"] for m in reserved} <= {"gate_unavailable"}
    after = [m for m in free if m["headers"]["gatekeeper_published_at"] > failed_over + 1]
    assert after, "the gate did not decide again after the failover"
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", url)
    status = CliRunner().invoke(main, ["status"])
    assert status.exit_code == 0 and "state=initialised" in status.output, status.output


def test_a_sentinel_broker_named_in_celerys_transport_options_is_gated_and_replayed(
    sentinel_url: tuple[str, redis.Redis, int],
) -> None:
    url, watcher, _ = sentinel_url
    app = Celery("sentinel_broker", broker=url.partition("?")[0])  # no ?master_name
    app.conf.update(
        broker_transport_options={"master_name": "gate"},  # where Celery's docs put it
        task_default_queue="celery",
        gatekeeper_dwell_gate_enabled=True,
        gatekeeper_canary_percent=100,
        gatekeeper_max_queue_age_s=0.3,
        gatekeeper_queue_age_horizon_s=2.0,
    )
    gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=0.2, tokens_in=10, deadline_s=120)
    @app.task(name="sentinel.embed", shared=False)
    def embed(chunk: int) -> int:
        return chunk

    port = int(watcher.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "gate")[1])
    primary = redis.Redis(host="127.0.0.1", port=port)
    embed.delay(1)
    time.sleep(0.5)  # the first admission is older than the age cap: the next is deferred
    embed.delay(2)
    assert [m["headers"]["gatekeeper_reason"] for m in queue_messages(primary, "free")] == ["fits"]
    assert [m["headers"]["gatekeeper_reason"] for m in queue_messages(primary, "defer")] == [
        "queue_age_cap"
    ]
    time.sleep(2.0)  # past the horizon, the first no longer holds the free queue's age up
    replayed = CliRunner().invoke(main, ["replay", "--once"], obj={"app": app})  # as with -A
    assert replayed.exit_code == 0 and "to_free=1" in replayed.output, replayed.output
    assert "(broker sentinel gate/0, queue defer)" in replayed.output  # whose queues it read
    assert len(queue_messages(primary, "free")) == 2 and not queue_messages(primary, "defer")
    status = CliRunner().invoke(main, ["status"], obj={"app": app})
    assert status.exit_code == 0 and "state=initialised" in status.output, status.output


@pytest.fixture()
def guarded_sentinel(tmp_path: Path) -> Iterator[int]:
    """A Sentinel with a password of its own (``sentpw``) watching a master that has one too
    (``masterpw``): the Sentinel's port."""
    try:
        primary = EmbeddedRedis().start()
    except EmbeddedRedisError as exc:
        missing_server(str(exc))
    redis.Redis.from_url(primary.url).config_set("requirepass", "masterpw")
    sentinel_port = unused_port()
    conf = tmp_path / "guarded-sentinel.conf"
    conf.write_text(
        f"port {sentinel_port}\nbind 127.0.0.1\ndir {tmp_path}\nrequirepass sentpw\n"
        f"sentinel monitor gate 127.0.0.1 {primary.port} 1\nsentinel auth-pass gate masterpw\n"
    )
    sentinel = _server(str(conf), "--sentinel")
    watcher = redis.Redis(host="127.0.0.1", port=sentinel_port, password="sentpw")
    try:
        assert wait_until(lambda: answers(watcher))
        yield sentinel_port
    finally:
        sentinel.kill()
        sentinel.wait()
        primary.stop()


def test_a_sentinel_url_carries_the_sentinels_password_the_masters_user_and_tls(
    guarded_sentinel: int,
) -> None:
    # Before, the gate's own sentinel URL could not give the Sentinels' password (every
    # publish failed closed for good), dropped the master's ACL user, and took a misspelt
    # or any TLS option without a word, connecting in plain text (an audit).
    from gatekeeper.errors import ConfigError
    from gatekeeper.redis.connect import client_for

    base = f"127.0.0.1:{guarded_sentinel}/0?master_name=gate"
    for auth in (":masterpw@", "default:masterpw@"):
        client = client_for(f"sentinel://{auth}{base}&sentinel_password=sentpw", 2.0)
        client.set("sentinel-auth", "ok")
        assert client.get("sentinel-auth") == b"ok"
    with pytest.raises(redis.ConnectionError):  # the Sentinel refuses: no master found
        client_for(f"sentinel://:masterpw@{base}", 2.0).ping()
    with pytest.raises(ConfigError, match="got ssl_ca_cert in"):  # misspelt: refused
        client_for(f"sentinel://:masterpw@{base}&ssl=true&ssl_ca_cert=/ca.pem", 2.0)
    with pytest.raises(ConfigError, match="with ssl=false"):
        client_for(f"sentinel://:masterpw@{base}&ssl=false&ssl_ca_certs=/ca.pem", 2.0)
    for options in ("ssl=true&ssl_ca_certs=/ca.pem", "ssl_ca_certs=/ca.pem",  # kombu: ssl_* is TLS
                    "ssl_cert_reqs=CERT_REQUIRED&ssl_ca_certs=/ca.pem"):  # fmt: skip
        pool = client_for(f"sentinel://:masterpw@{base}&{options}", 2.0).connection_pool
        assert "SSL" in pool.connection_class.__name__, options  # TLS to the master, its CA
        assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    # A broker's URL may carry options for kombu: left alone (refused, gating stopped).
    broker = client_for(f"sentinel://:masterpw@{base}&sentinel_password=sentpw"
                        "&connect_timeout=3", 2.0, {"master_name": "gate"})  # fmt: skip
    assert broker.ping()
    with pytest.raises(ConfigError, match="broker_url: ssl_cert_reqs: expected"):
        client_for(f"sentinel://{base}&ssl_cert_reqs=maybe", 2.0, {})
    for said, checked in (("0", True), ("off", True), ("maybe", True), ("false", False)):
        options = f"ssl_ca_certs=/ca.pem&ssl_check_hostname={said}"  # kombu's reading of it
        pool = client_for(f"sentinel://{base}&{options}", 2.0, {}).connection_pool
        assert pool.connection_kwargs["ssl_check_hostname"] is checked, said


def test_a_sentinel_broker_with_no_master_named_anywhere_fails_closed_and_says_where(
    sentinel_url: tuple[str, redis.Redis, int], capsys: pytest.CaptureFixture[str]
) -> None:
    """README: a Sentinel broker with no ``?master_name`` and no ``master_name`` in
    ``broker_transport_options`` fails closed, its ``event=gate_unconfigured`` line naming
    both places, and the commands stop with the same words. The Sentinel and its master are
    up: nothing reaches ``free``."""
    url, watcher, _ = sentinel_url
    app = Celery("sentinel_unnamed", broker=url.partition("?")[0])  # no master anywhere
    app.conf.update(gatekeeper_dwell_gate_enabled=True, gatekeeper_canary_percent=100)
    gatekeeper.install(app)  # does not fail: the config is read at the first gated publish

    @gatekeeper.gated(expected_service_s=0.2, tokens_in=10, deadline_s=120)
    @app.task(name="sentinel.unnamed", shared=False)
    def embed(chunk: int) -> int:
        return chunk

    with pytest.raises(ValueError, match="master_name"):  # kombu cannot publish it either
        embed.delay(1)
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "event=gate_unconfigured" in line)
    # (a quoted value's "=" is written \u003d: gatekeeper/logs.py _quoted)
    assert "?master_name\\u003d<name>" in line and "broker_transport_options" in line, line
    assert "reason=gate_unavailable" in err and "decision=reserved" in err, err
    port = int(watcher.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "gate")[1])
    assert not queue_messages(redis.Redis(host="127.0.0.1", port=port), "free")
    flags = CliRunner().invoke(main, ["flags"], obj={"app": app})
    assert flags.exit_code != 0, flags.output
    assert "?master_name=<name>" in flags.output and "broker_transport_options" in flags.output
