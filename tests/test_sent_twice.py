"""Every script is safe to send twice: a request re-sent after a lost reply changes nothing.

The gate's client does not retry on its own (gatekeeper/redis/breaker.py), but the stores send
``fallback.lua`` and ``start.lua`` again after a timeout, and a client an application passes
may retry anything. ``gate.lua`` and ``fallback.lua`` are held to this in
tests/test_fastpath.py, ``finish.lua`` in tests/test_runs.py; these are the others.
"""

from __future__ import annotations

import redis

from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.core.ledger import Outcome, Path, make_row, window_id
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger, Started
from gatekeeper.redis.scripts import evalsha, load_lua
from gatekeeper.redis.store import GateStore

KEYS = Keys()
T0_MS = 1_800_000_000_000
WINDOW = window_id(T0_MS / 1000, 900)


def ledger(client: redis.Redis) -> RunLedger:
    return RunLedger(client, KEYS, window_seconds=900, queue_wait_unit_per_second=200)


def start(client: redis.Redis, token: str, now_ms: int) -> Started:
    """A worker's start of job:1 whose message carries the gate record's nonce."""
    record = {"nonce": "n1", "decision": "admit_free", "window": WINDOW, "tokens_in": 1200,
              "dwell_s": "28.0"}  # fmt: skip
    client.hset(KEYS.run("job", 1), mapping=record)
    client.hset(KEYS.inflight, "job:1", f"1200|{WINDOW}|{T0_MS}")
    return ledger(client).start("job", 1, "n1", {"task": "t"}, now_ms, token=token)


def test_a_start_sent_again_with_its_token_counts_one_run_and_no_dead_one(
    redis_client: redis.Redis,
) -> None:
    first = start(redis_client, "token-a", T0_MS + 100)
    again = start(redis_client, "token-a", T0_MS + 100)
    assert (first.run, first.dead_run, first.dead) == (1, 0, None)
    assert (again.run, again.dead_run, again.dead) == (1, 0, None)
    assert again.record == first.record
    assert redis_client.hget(KEYS.run("job", 1), "runs") == b"1"
    assert redis_client.hget(KEYS.stats, "reruns_after_row") is None


def test_a_redelivery_sent_twice_reports_its_dead_run_both_times(
    redis_client: redis.Redis,
) -> None:
    start(redis_client, "token-a", T0_MS + 100)  # this run's worker died: no row
    second = start(redis_client, "token-b", T0_MS + 60_000)  # another start: another token
    again = start(redis_client, "token-b", T0_MS + 60_000)
    assert (second.run, second.dead_run) == (2, 1)
    assert second.dead is not None and second.dead.started_ms == T0_MS + 100
    assert (again.run, again.dead_run, again.dead) == (second.run, second.dead_run, second.dead)
    assert redis_client.hget(KEYS.run("job", 1), "runs") == b"2"


def test_a_release_sent_twice_gives_the_exposure_back_once(redis_client: redis.Redis) -> None:
    store = GateStore(redis_client, KEYS)
    redis_client.hset(KEYS.inflight, "job:1", f"1200|{WINDOW}|{T0_MS}")
    redis_client.hset(KEYS.window(WINDOW), mapping={"exposure": 2000, "admitted_free": 2})
    assert store.release("job", 1, WINDOW, unpublished=True) == 1200
    assert store.release("job", 1, WINDOW, unpublished=True) == 0
    window = redis_client.hgetall(KEYS.window(WINDOW))
    assert (float(window[b"exposure"]), int(window[b"admitted_free"])) == (800, 1)


def test_an_abandoned_row_sent_twice_is_written_once(redis_client: redis.Redis) -> None:
    runs = ledger(redis_client)
    row = make_row(job_id="job", attempt=1, path=Path.RESERVED, outcome=Outcome.ABANDONED,
                   queue_wait_ms=0, tokens_in=0, tokens_out=0,
                   deadline_slack_ms=-1)  # fmt: skip
    assert runs.abandon(row, T0_MS, slack_miss=True).written
    assert not runs.abandon(row, T0_MS, slack_miss=True).written
    assert redis_client.llen(KEYS.window_rows(WINDOW)) == 1
    window = redis_client.hgetall(KEYS.window(WINDOW))
    assert (window[b"rows:abandoned"], window[b"slack_misses"]) == (b"1", b"1")


def test_a_move_sent_twice_pushes_once(redis_client: redis.Redis) -> None:
    move = redis_client.register_script(load_lua("move.lua"))
    redis_client.lpush("defer:replaying:t", "claimed")
    redis_client.set("defer:replayer:t", "1")  # the tenure's heartbeat: alive
    keys, args = ["defer:replaying:t", "defer:replayer:t", "free"], ["claimed", "rewritten"]
    assert evalsha(redis_client, move, keys, args) == [1]
    assert evalsha(redis_client, move, keys, args) == [0]
    assert redis_client.lrange("free", 0, -1) == [b"rewritten"]
    assert redis_client.llen("defer:replaying:t") == 0


def test_record_sent_twice_counts_once_and_keeps_the_nonce(redis_client: redis.Redis) -> None:
    """A decision made in process, its record.lua re-sent after a lost reply: counted once,
    and the answer is still "recorded" (so the message keeps its nonce, its row verified)."""
    keys = Keys()
    store = GateStore(redis_client, keys)
    record = {"nonce": "n-1", "tokens_in": "5", "admitted_ms": "1", "published_ms": "1",
              "deadline_ms": "2", "dwell_s": "nan"}  # fmt: skip
    args = (3, "job", 1, Decision.RESERVED, Reason.FREE_PATH_DISABLED, (False, False), record)
    first, again = store.record_decision(*args), store.record_decision(*args)
    assert first is False and again is False  # recorded both times (None: unrecorded)
    counted = redis_client.hget(keys.window(3), "decided:reserved:free_path_disabled")
    assert counted == b"1"
