"""The gate's Redis as a Redis Cluster (``redis+cluster://``): six real ``redis-server``
processes in cluster mode (three primaries, a replica each), the gate's user held by the
README's ACL, a plain Redis as Celery's broker. Gated publishes are decided on the cluster and
a worker's rows land there; what is asked of one server goes to the namespace's primary; fast
publish stands aside; an install made while its cluster is away decides once it answers; TLS;
a primary killed while a thread publishes sends nothing undecided to free, and the gate
decides again on the promoted replica, no restart."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from click.testing import CliRunner
from redis.cluster import RedisCluster
from redis.crc import key_slot

import gatekeeper
from gatekeeper.celery.broker import shown_url
from gatekeeper.celery.fastpath import same_server
from gatekeeper.errors import ConfigError
from gatekeeper.ops.cli import main
from gatekeeper.redis.cluster import GateCluster, home, is_cluster
from gatekeeper.redis.connect import client_for
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import ATTEMPTS, Keys
from gatekeeper.redis.snapshot import read_snapshot
from tests.acl import PASSWORD, USER, refused
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import (
    gate_settings,
    initialised,
    missing_server,
    queue_messages,
    running_worker,
    wait_until,
)
from tests.local_cluster import LocalCluster, cluster_port, replica_of

pytestmark = [pytest.mark.celery, pytest.mark.servers]

KEYS = Keys()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("cluster"), primaries=3, replicas=1)
    try:
        yield local.start()
    finally:
        local.stop()


@pytest.fixture()
def admin(cluster: LocalCluster) -> Iterator[RedisCluster]:
    """The default user's cluster client, on an empty, initialised cluster."""
    client = RedisCluster(host="127.0.0.1", port=cluster.ports[0], socket_timeout=2)
    client.flushall()  # every primary
    initialised(client)  # type: ignore[arg-type]
    try:
        yield client
    finally:
        client.close()


def reasons(broker: redis.Redis, queue: str) -> list[str]:
    return [m["headers"]["gatekeeper_reason"] for m in queue_messages(broker, queue)]


def h(**headers: Any) -> dict[str, Any]:
    return {"headers": {f"gatekeeper_{name}": value for name, value in headers.items()}}


def test_every_gate_key_of_a_namespace_is_in_one_slot() -> None:
    """gate.lua builds stale admissions' window and record keys from its record key's
    prefix: they too must carry the namespace's tag (a job id may hold ':run:')."""
    keys = Keys("gk", "tenant-a")
    names = [keys.flags, keys.flags_log, keys.free_waiting, keys.inflight, keys.stats,
             keys.started, keys.run("a:run:b", 2), keys.handoff("a:run:b", 2),
             keys.abandoned("j", 1), keys.worker("w@h"), keys.replayer_lock, keys.window(7),
             keys.window_rows(7), keys.deployment]  # fmt: skip
    assert {key_slot(name.encode()) for name in names} == {key_slot(b"tenant-a")}


def test_gated_publishes_are_decided_on_the_cluster_and_the_worker_writes_rows_there(
    redis_url: str,
    redis_client: redis.Redis,
    cluster: LocalCluster,
    admin: RedisCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = cluster.url()
    app = create_app(gate_settings(url, max_queue_age_s=0.5), redis_url, recorder_url=redis_url)
    embed = app.tasks["tests.embed"]
    admitted = [embed.delay(n).id for n in range(2)]
    reserved = embed.apply_async((9,), **h(deadline_s=1.5)).id  # dwell 2 s over 1.5 s of slack
    deferred = embed.apply_async((8,), **h(expected_service_s=0)).id  # a guard, in process
    time.sleep(0.6)  # the admitted two, waiting on free, now past the age cap
    aged = embed.delay(7).id
    assert reasons(redis_client, "free") == ["fits", "fits"]
    assert reasons(redis_client, "reserved") == ["dwell_over_slack"]
    assert reasons(redis_client, "defer") == ["bad_service_guess", "queue_age_cap"]
    assert [m["headers"]["id"] for m in queue_messages(redis_client, "defer")] == [deferred, aged]
    assert (
        admin.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 2
    )  # the gate's state is on the cluster
    assert admin.hlen(KEYS.run(reserved, 1)) > 0 and not redis_client.exists(KEYS.run(reserved, 1))
    assert list(admin.hgetall(KEYS.deployment)) == [b"900|12000.0"]  # what it decides with

    with running_worker(redis_url, tmp_path / "worker.log", GATEKEEPER_REDIS_URL=url,
                        GATEKEEPER_TEST_RECORDER_URL=redis_url):  # fmt: skip
        assert wait_until(lambda: redis_client.llen(RUNS_KEY) == 2)
        assert wait_until(lambda: admin.zcard(KEYS.started) == 0)
    window = int(time.time() // 900)
    rows = [json.loads(raw) for raw in admin.lrange(KEYS.window_rows(window), 0, -1)]
    assert sorted(row["job_id"] for row in rows) == sorted(admitted)
    assert {(row["path"], row["outcome"]) for row in rows} == {("free", "ok")}
    assert "verified" not in rows[0]  # priced from the gate's records, on the cluster

    monkeypatch.setenv("GATEKEEPER_REDIS_URL", url)
    monkeypatch.setenv("GATEKEEPER_BROKER_URL", redis_url)
    status = CliRunner().invoke(main, ["status"])
    assert status.exit_code == 0, status.output
    assert "state=initialised" in status.output and "waiting_free=0" in status.output
    assert "queues free=0 defer=2 reserved=1 dead_letter=0" in status.output
    assert "admitted_free=2" in status.output
    ledger = CliRunner().invoke(main, ["ledger", "--json", str(tmp_path / "rows.json")])
    assert ledger.exit_code == 0 and "finished=2 killed_rows=0" in ledger.output, ledger.output
    monkeypatch.setenv("GATEKEEPER_DWELL_GATE_ENABLED", "true")
    monkeypatch.setenv("GATEKEEPER_CANARY_PERCENT", "100")
    replay = CliRunner().invoke(main, ["replay", "--once"])  # its lock, on the cluster
    assert replay.exit_code == 0, replay.output
    # What the replayer's start line says of its gate: the cluster's nodes, not "?:?".
    assert shown_url(client_for(url, 1.0)).startswith("cluster 127.0.0.1:")
    assert [m["headers"]["id"] for m in queue_messages(redis_client, "free")] == [aged]
    for port in cluster.ports:  # the README's ACL let every command through, on every node
        assert refused(cluster.admin(port)) == []


def test_a_replay_batch_of_several_scripts_is_decided_on_the_cluster(
    redis_url: str,
    redis_client: redis.Redis,
    cluster: LocalCluster,
    admin: RedisCluster,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replayer batch of many gate scripts (a cluster has no line: redis-py's cluster
    pipeline carries them) is decided script by script, every one to free."""
    url = cluster.url()
    app = create_app(gate_settings(url, max_queue_age_s=1.0), redis_url)
    admin.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})  # the free queue old
    ids = [app.tasks["tests.embed"].delay(n).id for n in range(12)]
    admin.zrem(KEYS.free_waiting, "stale:1")
    assert reasons(redis_client, "defer") == ["queue_age_cap"] * 12
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", url)
    monkeypatch.setenv("GATEKEEPER_BROKER_URL", redis_url)
    monkeypatch.setenv("GATEKEEPER_DWELL_GATE_ENABLED", "true")
    monkeypatch.setenv("GATEKEEPER_CANARY_PERCENT", "100")
    monkeypatch.setenv("GATEKEEPER_BUDGET_UNITS", "1e9")  # no admission refused for the budget
    replay = CliRunner().invoke(main, ["replay", "--once"])
    assert replay.exit_code == 0, replay.output
    assert sorted(m["headers"]["id"] for m in queue_messages(redis_client, "free")) == sorted(ids)
    assert set(reasons(redis_client, "free")) == {"fits"}
    assert admin.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 12
    # The pass was recorded, and a scrape reads it (both one transaction on the slot's primary).
    snap = read_snapshot(client_for(url, 1.0), KEYS, int(time.time() // 900))
    assert snap.waiting == 12 and snap.last_pass_s is not None


def test_any_startup_node_that_answers_is_enough(
    cluster: LocalCluster, admin: RedisCluster
) -> None:
    gone = cluster_port()
    url = f"redis+cluster://{USER}:{PASSWORD}@127.0.0.1:{gone},127.0.0.1:{cluster.ports[3]}/0"
    assert client_for(url, 0.5).hgetall(KEYS.flags) == {b"initialised_at": b"-inf"}


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis+cluster://", "needs host:port"),
        ("redis+cluster://n1:7000/1", "database 0 only"),
        ("redis+cluster://n1:port", "expected host:port"),
        ("redis+cluster://[127.0.0.1]:7000", "expected host:port"),
    ],
)
def test_a_cluster_url_it_cannot_use_names_redis_url(url: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=f"redis_url: .*{expected}"):
        client_for(url, 0.5)


def test_fast_publish_stands_aside_for_a_cluster_even_on_one_of_its_nodes(
    cluster: LocalCluster, admin: RedisCluster
) -> None:
    gate = client_for(cluster.url(), 0.5)
    node = gate.get_default_node()  # type: ignore[attr-defined]
    broker = redis.Redis(host=node.host, port=node.port)
    # The server check alone would be fooled: the cluster's INFO answers with that node's.
    assert broker.info("server")["run_id"] == gate.info("server")["run_id"]
    assert is_cluster(gate) and same_server(broker, gate) is False


def test_fast_publish_on_with_a_cluster_takes_celerys_own_publish(
    redis_url: str, redis_client: redis.Redis, cluster: LocalCluster, admin: RedisCluster
) -> None:
    app = create_app(gate_settings(cluster.url(), fast_publish="on"), redis_url)
    for n in range(3):
        app.tasks["tests.embed"].delay(n)
    assert reasons(redis_client, "free") == ["fits"] * 3  # in the broker, decided
    assert admin.zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 3 and not admin.exists("free")
    assert gatekeeper.install(app).store._line.channel is None  # no line: redis-py's cluster client


def away_from_home(client: redis.Redis) -> None:
    """Point the cluster client's default node (where it sends ``INFO`` and ``WAIT`` unless
    told otherwise) at a primary that does not hold the namespace's slot."""
    slot_primary = home(client, KEYS.flags).connection_pool.connection_kwargs["port"]
    cluster_client = cast(RedisCluster, client)
    other = next(n for n in cluster_client.get_primaries() if n.port != slot_primary)
    cluster_client.set_default_node(other)


def test_a_flag_write_waits_for_the_replica_of_the_slots_primary(
    cluster: LocalCluster, admin: RedisCluster
) -> None:
    """The flag write and its log are one MULTI on the slot's primary (redis-py before 6.1
    has no transaction on a cluster), and its WAIT goes there, on the connection that wrote:
    with that primary's replica stopped, the write waits the timeout out."""
    gate = client_for(cluster.url(), 0.5)
    away_from_home(gate)
    store = FlagStore(gate, gate_settings(cluster.url(), redis_timeout_s=0.5))
    primary = home(admin, KEYS.flags)  # type: ignore[arg-type]
    replica = next(p for p in cluster.ports if replica_of(cluster.admin(p), primary))
    os.kill(cluster.processes[replica].pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        store.set("canary_percent", "40", "test", "tester", time.time())
        waited = time.monotonic() - began
    finally:
        os.kill(cluster.processes[replica].pid, signal.SIGCONT)
    assert waited >= 0.45, f"WAIT did not wait for the slot's replica ({waited:.3f} s)"
    assert store.stored()["canary_percent"] == "40.0"
    assert [change.name for change in store.history()] == ["canary_percent"]
    assert all(refused(cluster.admin(port)) == [] for port in cluster.ports)  # the README's ACL


def test_the_eviction_check_reads_the_slots_primary(
    cluster: LocalCluster, admin: RedisCluster
) -> None:
    gate = client_for(cluster.url(), 0.5)
    away_from_home(gate)
    store = FlagStore(gate, gate_settings(cluster.url()))
    default = cast(RedisCluster, gate).get_default_node()
    slot_primary = home(admin, KEYS.flags)  # type: ignore[arg-type]
    elsewhere = cluster.admin(default.port)
    elsewhere.config_set("maxmemory-policy", "allkeys-lru")  # another slot's keys may go
    try:
        assert store.eviction_policy() == "noeviction"
        slot_primary.config_set("maxmemory-policy", "volatile-lru")
        assert store.eviction_policy() == "volatile-lru"
    finally:
        elsewhere.config_set("maxmemory-policy", "noeviction")
        slot_primary.config_set("maxmemory-policy", "noeviction")


def move_slot(cluster: LocalCluster, key: str, from_port: int, to_port: int) -> None:
    """Reshard: move ``key``'s slot and its keys from one primary to another, as ``redis-cli
    --cluster reshard`` does (IMPORTING, MIGRATING, MIGRATE, then SETSLOT NODE everywhere)."""
    slot = key_slot(key.encode())
    source, target = cluster.admin(from_port), cluster.admin(to_port)
    source_id, target_id = (node.execute_command("CLUSTER", "MYID") for node in (source, target))
    target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    while keys := source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
        source.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
    for port in cluster.ports:
        if cluster.admin(port).execute_command("ROLE")[0] == b"master":
            cluster.admin(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


def test_after_a_reshard_the_exporter_and_the_flags_find_the_slots_new_primary(
    cluster: LocalCluster, admin: RedisCluster
) -> None:
    # A slot moved to another primary (a reshard): the exporter's reads and the flag writes go
    # to the slot's primary as the client mapped it, a plain node client, and a MOVED from it
    # never refreshed the map: `gatekeeper_redis_up 0` until a restart, and a rollback
    # refused (an audit). They ask the cluster client first now, which maps the slot again.
    gate = client_for(cluster.url(), 2.0)
    store = FlagStore(gate, gate_settings(cluster.url()))
    assert read_snapshot(gate, KEYS, 1).flags.get("initialised_at")  # mapped, as before
    old = home(admin, KEYS.flags).connection_pool.connection_kwargs["port"]  # type: ignore[arg-type]
    new = next(p for p in cluster.ports if p != old and cluster.admin(p).execute_command(
        "ROLE")[0] == b"master")  # fmt: skip
    move_slot(cluster, KEYS.flags, old, new)
    assert read_snapshot(gate, KEYS, 1).flags.get("initialised_at")  # the slot's new primary
    store.set("free_path_enabled", "false", "rollback after a reshard", "test", time.time())
    assert cluster.admin(new).hget(KEYS.flags, "free_path_enabled") == b"false"


def test_an_install_made_while_its_cluster_is_away_decides_once_it_answers(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    port = cluster_port()
    url = f"redis+cluster://127.0.0.1:{port}"
    app = create_app(gate_settings(url, breaker_open_s=0.2), redis_url, recorder_url=redis_url)
    embed = app.tasks["tests.embed"]
    embed.delay(1)  # made the client: no node answers
    assert reasons(redis_client, "reserved") == ["gate_unavailable"]
    assert isinstance(gatekeeper.install(app).client, GateCluster)
    late = LocalCluster(tmp_path, primaries=1)
    try:
        late.start([port])
        initialised(RedisCluster(host="127.0.0.1", port=port))  # type: ignore[arg-type]
        assert wait_until(lambda: bool(embed.delay(2)) and "fits" in reasons(redis_client, "free"),
                          timeout_s=10, every_s=0.3)  # fmt: skip
    finally:
        late.stop()
    gone = embed.delay(3).id  # every node gone after it connected: a Redis not answering
    reserved = {m["headers"]["id"]: m["headers"]["gatekeeper_reason"]
                for m in queue_messages(redis_client, "reserved")}  # fmt: skip
    assert gone in reserved and set(reserved.values()) == {"gate_unavailable"}
    assert gatekeeper.install(app).store.breaker.is_open  # type: ignore[union-attr]


def test_a_primary_killed_while_publishing_sends_nothing_undecided_to_free(
    redis_url: str, redis_client: redis.Redis, cluster: LocalCluster, admin: RedisCluster
) -> None:
    """The last test on the module's cluster: it leaves the killed primary down."""
    primary = home(admin, KEYS.flags)  # type: ignore[arg-type]
    port = int(primary.connection_pool.connection_kwargs["port"])
    assert primary.execute_command("WAIT", 1, 2000) == 1  # the state marker is on the replica
    replica = next(p for p in cluster.ports if replica_of(cluster.admin(p), primary))
    settings = gate_settings(cluster.url(), budget_units=1e9, breaker_open_s=0.25)
    embed = create_app(settings, redis_url).tasks["tests.embed"]
    stop, published = threading.Event(), []

    def publish() -> None:
        while not stop.is_set():
            published.append(embed.delay(len(published)).id)
            time.sleep(0.01)

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        time.sleep(1.0)
        cluster.kill(port)
        promoted = wait_until(
            lambda: cluster.admin(replica).info("replication")["role"] == "master", 20
        )
        assert promoted, "the replica was not promoted"
        failed_over = time.time()

        def decided_again() -> bool:  # an admission published a second after the promotion
            return any(m["headers"]["gatekeeper_published_at"] > failed_over + 1
                       for m in queue_messages(redis_client, "free"))  # fmt: skip

        wait_until(decided_again, timeout_s=20, every_s=0.2)  # asserted below, once stopped
    finally:
        stop.set()
        thread.join()
    free = queue_messages(redis_client, "free")
    reserved = queue_messages(redis_client, "reserved")
    assert len(free) + len(reserved) == len(published)  # nothing lost, no publish failed
    assert {m["headers"]["gatekeeper_reason"] for m in free} == {"fits"}  # decided by gate.lua
    assert reserved, "the gate never found its primary gone"
    assert {m["headers"]["gatekeeper_reason"] for m in reserved} == {"gate_unavailable"}
    after = [m for m in free if m["headers"]["gatekeeper_published_at"] > failed_over + 1]
    assert after, "the gate did not decide again on the promoted replica"
    promoted_node = cluster.admin(replica)
    assert all(promoted_node.exists(KEYS.run(m["headers"]["id"], 1)) for m in after)


def test_the_gate_decides_over_tls_on_a_cluster(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        missing_server("TLS needs openssl on PATH to make a certificate")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"), "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    tls = LocalCluster(tmp_path, primaries=1, tls=tmp_path)
    try:
        url = tls.start().url()
        initialised(tls.admin(tls.ports[0]))
        app = create_app(gate_settings(url), redis_url, recorder_url=redis_url)
        for n in range(3):
            app.tasks["tests.embed"].delay(n)
        assert reasons(redis_client, "free") == ["fits"] * 3
        assert tls.admin(tls.ports[0]).zcount(KEYS.free_waiting, "-inf", ATTEMPTS) == 3
    finally:
        tls.stop()
