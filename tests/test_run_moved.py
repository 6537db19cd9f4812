"""A run's start and row when the gate's Redis moves under the worker's line, or the line's
flow is forgotten: a failover that moved the address answers the line with READONLY, and the
start is asked again on a new connection, which reaches the new primary; a finish that gets
no answer (a flow a NAT forgot) is sent again, once, and writes its row once; and one whose
answer is lost after its row was written is told, sent again, what it wrote."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gatekeeper.core.ledger import Outcome
from gatekeeper.redis import wire
from gatekeeper.redis.breaker import no_retry
from gatekeeper.redis.connect import client_for
from gatekeeper.redis.runs import Finished, RunLedger, RunRecord
from tests.moved import BlackHole, moved_redis
from tests.test_run_start import KEYS, WINDOW, applied, decided, ledger, warm


def test_a_start_that_meets_a_demoted_primary_is_applied_on_the_new_one(tmp_path: Path) -> None:
    with moved_redis(tmp_path) as moved:
        client = redis.Redis.from_url(moved.url, socket_timeout=1, **no_retry())
        runs = ledger(client)
        warm(runs, moved.a.client)  # the line is on A and has had start.lua answered
        decided(moved.a.client, "job")
        moved.fail_over()
        client.connection_pool.disconnect()  # its idle connections too (Sentinel's would go)
        started = runs.send_start("job", 1, "n-job", {"worker": "w"}, 2000).started()
        assert started.run == 1 and started.record is not None
        assert moved.b.client.hget(KEYS.run("job", 1), "runs") == b"1"
        assert moved.b.client.zscore(KEYS.started, "job:1") == 2000


@pytest.fixture()
def forgetful(redis_url: str, redis_client: redis.Redis) -> Iterator[BlackHole]:
    """A proxy to the suite's Redis whose open flows can be forgotten."""
    kwargs = redis_client.connection_pool.connection_kwargs
    hole = BlackHole((kwargs.get("host", "127.0.0.1"), int(kwargs.get("port", 6379))))
    try:
        yield hole
    finally:
        hole.close()


def started_through(forgetful: BlackHole, redis_client: redis.Redis) -> tuple[RunLedger, RunRecord]:
    """A run ledger through the proxy, and the record of a run it started."""
    client = client_for(f"redis://127.0.0.1:{forgetful.port}/0", 0.3, **no_retry())
    runs: RunLedger = ledger(client)
    for script in (runs._start, runs._finish):  # loaded long ago, as on a running server
        redis_client.script_load(script.script)
    decided(redis_client, "job")
    started = runs.start("job", 1, "n-job", {"task": "t", "worker": "w"}, 1000)
    assert started.record is not None
    return runs, started.record


def test_a_finish_that_gets_no_answer_is_sent_again_and_writes_one_row(
    redis_client: redis.Redis, forgetful: BlackHole
) -> None:
    runs, record = started_through(forgetful, redis_client)
    forgetful.forget()  # the line's flow: nothing closes, nothing answers
    row = runs.row_for("job", 1, record, Outcome.OK, 2000)
    done = runs.finish(row, 1, record, 2000)
    assert done.written
    assert redis_client.hget(KEYS.run("job", 1), "rowed") == b"1"
    assert redis_client.zscore(KEYS.started, "job:1") is None
    assert not runs.finish(row, 1, record, 2000).written  # one row per run


def test_a_finish_whose_reply_is_lost_after_its_row_is_told_its_row_and_miss_when_sent_again(
    redis_client: redis.Redis, forgetful: BlackHole
) -> None:
    """The script ran (the row, its tax, a slack miss), its reply never came back: the call
    sent again gets the reply the first had, so the worker logs the row and the miss and
    checks the freeze. Another finish of the run (a signal fired twice) still writes nothing."""
    runs, record = started_through(forgetful, redis_client)
    forgetful.lose_reply(runs._finish.sha.encode())
    row = runs.row_for("job", 1, record, Outcome.OK, 2000)
    done = runs.finish(row, 1, record, 2000, slack_miss=True)
    assert forgetful.lost == 1  # the first call's reply, after its row
    assert done == Finished(True, 1, 0, row.retry_tax, slack_miss=True, window=WINDOW)
    assert redis_client.llen(KEYS.window_rows(WINDOW)) == 1
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"
    assert not runs.finish(row, 1, record, 2000, slack_miss=True).written


def test_a_start_on_a_line_idle_past_its_limit_is_applied_before_the_run_goes_on(
    redis_client: redis.Redis, forgetful: BlackHole, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its flow forgotten while it idled: the start is waited for (and sent again on a new
    connection), so a worker killed during the run leaves a start the sweep sees."""
    monkeypatch.setattr(wire, "IDLE_PROVEN_S", 0.2)
    client = client_for(f"redis://127.0.0.1:{forgetful.port}/0", 0.3, **no_retry())
    runs = ledger(client)
    warm(runs, redis_client)  # the line has had start.lua answered
    time.sleep(0.3)  # idle past the limit
    forgetful.forget()
    decided(redis_client, "job")
    runs.send_start("job", 1, "n-job", {"worker": "w"}, 2000)  # the run would go on now
    assert applied(redis_client, "job")
