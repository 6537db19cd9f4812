"""A Redis Cluster moving the namespace's slot (``MIGRATING``/``IMPORTING``, as ``redis-cli
--cluster reshard`` leaves it while it moves keys): the scripts that give exposure back read
the window an in-flight entry names, a key not passed in ``KEYS``. When that window has moved
already, the server refuses the script there; each script reads it before its first write, so
the call is refused whole, and sent again once the slot is settled it does its work once (a
reviewer: an expiry's record was left ``reserved`` with no row, a slack miss never counted)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
from redis.crc import key_slot

from gatekeeper.core.ledger import Outcome, window_id
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import Finished, RunLedger
from gatekeeper.redis.scripts import load_lua
from gatekeeper.redis.store import GateStore
from tests.local_cluster import LocalCluster
from tests.test_runs import T0_MS, record, start_run

pytestmark = pytest.mark.servers

KEYS = Keys()
W = window_id(T0_MS / 1000, 900)
"""The window the in-flight entry names (moved away first); the caller names W + 1."""
SLOT = key_slot(KEYS.inflight.encode())
LONG = "t" * 70
"""A task name past a compact hash's values: its run's cut writes the record again."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("reshard"), primaries=2)
    try:
        yield local.start()
    finally:
        local.stop()


@pytest.fixture()
def nodes(cluster: LocalCluster) -> Iterator[tuple[redis.Redis, redis.Redis]]:
    """The slot's primary and the other one, emptied, the slot stable again afterwards."""
    admins = [cluster.admin(port) for port in cluster.ports]
    owner = next(node for node in admins if _serves(node))
    other = next(n for n in admins if n is not owner)
    for node in admins:
        node.flushall()
    try:
        yield owner, other
    finally:
        for node in admins:
            node.execute_command("CLUSTER", "SETSLOT", SLOT, "STABLE")
            node.flushall()


def _serves(node: redis.Redis) -> bool:
    """Whether ``node`` holds SLOT (``CLUSTER SLOTS``: the first address of a range serves)."""
    port = node.connection_pool.connection_kwargs["port"]
    return any(start <= SLOT <= end and int(primary[1]) == port
               for start, end, primary, *_ in node.execute_command("CLUSTER", "SLOTS"))  # fmt: skip


def _moving(owner: redis.Redis, other: redis.Redis, window: bool = True) -> None:
    """The slot on its way from ``owner`` to ``other``, the entry's window moved already
    (``window``; else nothing moved yet)."""
    ids = [node.execute_command("CLUSTER", "MYID") for node in (owner, other)]
    other.execute_command("CLUSTER", "SETSLOT", SLOT, "IMPORTING", ids[0])
    owner.execute_command("CLUSTER", "SETSLOT", SLOT, "MIGRATING", ids[1])
    if not window:
        return
    port = other.connection_pool.connection_kwargs["port"]
    owner.execute_command("MIGRATE", "127.0.0.1", port, KEYS.window(W), 0, 5000)


def _settled(owner: redis.Redis, other: redis.Redis) -> None:
    """The reshard called off: the slot stable on ``owner``, the window back there."""
    for node in (owner, other):
        node.execute_command("CLUSTER", "SETSLOT", SLOT, "STABLE")
    owner.hset(KEYS.window(W), "exposure", 100)


def _state(node: redis.Redis) -> dict[bytes, bytes]:
    return {key: node.dump(key) for key in node.scan_iter(count=1000)}


def _admitted(owner: redis.Redis, job: str) -> None:
    """An admission in W (its entry, its exposure) scored again in W + 1 (the record), and
    every key the scripts are passed present: one missing while the slot moves has the call
    refused before it runs (TRYAGAIN), which would not try the script's order."""
    owner.hset(KEYS.inflight, f"{job}:1", f"100|{W}|{T0_MS}|pad")
    owner.hset(KEYS.window(W), "exposure", 100)
    owner.hset(KEYS.window(W + 1), mapping={"exposure": 0, "admitted_free": 1})
    owner.rpush(KEYS.window_rows(W + 1), "{}")
    owner.zadd(KEYS.free_waiting, {f"{job}:1": T0_MS})
    owner.hset(KEYS.totals, "records_refused", 0)
    owner.xadd(KEYS.decisions, {"d": ""})
    owner.hset(KEYS.service("t"), "b1", 0)
    owner.sadd(KEYS.service_tasks, "t")


def _expire(owner: redis.Redis) -> Callable[[], object]:
    owner.hset(KEYS.run("e", 1), mapping={"nonce": "n", "decision": "admit_free",
                                          "admitted_ms": T0_MS, "window": W + 1})  # fmt: skip
    script = owner.register_script(load_lua("expire.lua"))
    keys = [KEYS.run("e", 1), KEYS.inflight, KEYS.free_waiting, KEYS.window(W + 1),
            KEYS.window_rows(W + 1)]  # fmt: skip
    args = ["e:1", "n", str(T0_MS + 10**6), "100", "0", "1000", '{"a": 1', str(W + 1), ""]
    return lambda: script(keys=keys, args=args)


def _finish(owner: redis.Redis, task: str = "t") -> Callable[[], Finished]:
    """A run of the admission started; its late ``ok`` row, to send (``task``: its name)."""
    owner.hset(KEYS.service(task), "b1", 0)
    runs = RunLedger(owner, KEYS, window_seconds=900, queue_wait_unit_per_second=200)
    start_run(runs, owner, "e", 1, record(window=W + 1, task=task), T0_MS + 100)
    _, rec = runs.record("e", 1) or (0, record())
    late_ms = T0_MS + 1_000_000  # in W + 1, past its deadline: a slack miss
    row = runs.row_for("e", 1, rec, Outcome.OK, late_ms)
    return lambda: runs.finish(row, 1, rec, late_ms, slack_miss=True, ends=True, token="t")


def _unscore(owner: redis.Redis) -> Callable[[], object]:
    owner.hset(KEYS.run("e", 1), mapping={"nonce": "n", "decision": "admit_free",
                                          "window": W + 1})  # fmt: skip
    script = owner.register_script(load_lua("unscore.lua"))
    keys = [KEYS.run("e", 1), KEYS.inflight, KEYS.free_waiting, KEYS.window(W + 1)]
    return lambda: script(keys=keys, args=["n", "m", "", "e:1", "1", "0"])


def _release(owner: redis.Redis) -> Callable[[], object]:
    owner.hset(KEYS.run("e", 1), mapping={"charged": "0", "reserved": "100"})
    return lambda: GateStore(owner, KEYS).release("e", 1, W + 1, unpublished=True)


@pytest.mark.parametrize("call", [_expire, _finish, _unscore, _release],
                         ids=["expire", "finish", "unscore", "release"])  # fmt: skip
def test_a_give_back_refused_mid_reshard_writes_nothing_and_is_done_once_sent_again(
    nodes: tuple[redis.Redis, redis.Redis], call: Callable[[redis.Redis], Callable[[], object]]
) -> None:
    owner, other = nodes
    _admitted(owner, "e")
    send = call(owner)
    _moving(owner, other)
    before = _state(owner)
    with pytest.raises((redis.ResponseError, LedgerUnavailable), match="non local key"):
        send()
    assert _state(owner) == before  # refused whole: nothing written
    _settled(owner, other)
    send()
    assert float(owner.hget(KEYS.window(W), "exposure")) == 0  # given back where it was held
    assert float(owner.hget(KEYS.window(W + 1), "exposure")) == 0
    assert not owner.hexists(KEYS.inflight, "e:1")
    if call is _finish:  # its slack miss, counted once
        assert owner.hget(KEYS.window(W + 1), "slack_misses") == b"1"
        assert owner.hget(KEYS.totals, "slack_misses") == b"1"


def test_a_row_while_the_slot_starts_moving_is_written_whole_its_record_left_as_it_is(
    nodes: tuple[redis.Redis, redis.Redis],
) -> None:
    # A reviewer: a record past a compact hash's values (here its task's name) is written
    # again by its row's cut (DEL, then HSET); a node moving the slot away refuses the HSET
    # of a key it no longer holds, so the script failed after the row's writes, and sent
    # again wrote the row twice. The cut now leaves the record as it is on such a node.
    owner, other = nodes
    _admitted(owner, "e")
    send = _finish(owner, LONG)
    _moving(owner, other, window=False)
    assert send().written
    assert owner.llen(KEYS.window_rows(W + 1)) == 2  # ("{}" and the row)
    assert owner.hget(KEYS.totals, "slack_misses") == b"1"
    assert owner.hget(KEYS.run("e", 1), "kept") is not None  # cut, in place
    assert owner.object("encoding", KEYS.run("e", 1)) == b"hashtable"
    _settled(owner, other)  # the same row sent again: told it was written
    assert send().written
    assert owner.llen(KEYS.window_rows(W + 1)) == 2
    assert owner.hget(KEYS.totals, "slack_misses") == b"1"


def test_on_a_settled_slot_the_cut_still_writes_a_long_record_again_compact(
    nodes: tuple[redis.Redis, redis.Redis],
) -> None:
    # The check above (a key of the slot that never exists) must not stop the cut where the
    # slot is not moving: there the record is written again in a compact hash, as on one
    # server (bench/memory.py --hostname).
    owner, _ = nodes
    _admitted(owner, "e")
    send = _finish(owner, LONG)
    assert owner.object("encoding", KEYS.run("e", 1)) == b"hashtable"
    assert send().written
    assert owner.object("encoding", KEYS.run("e", 1)) in (b"ziplist", b"listpack")
