"""Unverified runs (a decision made without the gate's record: no nonce): one unverified row
for each run, however it ends. A run killed with its pool child gets its row from the main
process, a run that died unseen gets it from its redelivered copy's start, and a signal that
fires twice writes one."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import celery
import pytest
import redis

from gatekeeper.celery.message import unverified
from gatekeeper.celery.running import Running
from gatekeeper.celery.worker import WorkerSide
from gatekeeper.core.ledger import Outcome, make_row
from gatekeeper.core.ledger import Path as RowPath
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger, RunRecord
from gatekeeper.redis.sweep import sweep
from gatekeeper.redis.unverified import UnverifiedRuns
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import gate_settings, queue_messages, running_worker, unused_port, wait_until

pytestmark = pytest.mark.celery
KEYS = Keys()


def rows(client: redis.Redis) -> list[dict[str, Any]]:
    found = []
    for key in sorted(client.scan_iter(match=KEYS.window_rows(0).replace(":0:", ":*:"))):
        found += [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    return found


def runs(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(RUNS_KEY, 0, -1)]


def kill_run(client: redis.Redis, index: int, started: int = 1) -> None:
    """SIGKILL the pool child of the ``index``-th run, once ``started`` runs have begun."""
    assert wait_until(lambda: len(runs(client)) >= started)
    os.kill(runs(client)[index]["pid"], signal.SIGKILL)


def wait_rows(client: redis.Redis, count: int, log: Path) -> list[dict[str, Any]]:
    assert wait_until(lambda: len(rows(client)) >= count, 30), log.read_text()
    time.sleep(1.0)  # a duplicate signal, if any, would land now
    return rows(client)


def gate_down(redis_url: str) -> Any:
    """An app whose gate's Redis is unreachable: its publishes go to reserved, unrecorded."""
    down = f"redis://127.0.0.1:{unused_port()}/0"
    return create_app(gate_settings(down, redis_timeout_s=0.2), redis_url)


def unverified_publish(redis_url: str, redis_client: redis.Redis, task: str, **kw: Any) -> str:
    """Publish ``task`` with the gate's Redis unreachable: reserved, no record, no nonce."""
    job = str(gate_down(redis_url).tasks[task].apply_async(kwargs=kw).id)
    (message,) = queue_messages(redis_client, "reserved")
    assert message["headers"]["gatekeeper_reason"] == "gate_unavailable"
    assert "gatekeeper_nonce" not in message["headers"]
    return job


def shown(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["job_id"], row["attempt"], row["outcome"], row["path"], row["verified"]


def test_a_sigkilled_unverified_run_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    job = unverified_publish(redis_url, redis_client, "tests.sleepy")
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="reserved"):
        kill_run(redis_client, 0)
        (row,) = wait_rows(redis_client, 1, log)
    assert shown(row) == (job, 1, "killed", "reserved", False)
    assert row["retry_tax"] == 0.0 and 0 <= row["queue_wait_ms"] < 60_000
    assert "reason=WorkerLostError" in log.read_text()
    assert redis_client.hget(KEYS.totals, "killed_rows") == b"1"  # a ledger row all the same
    assert redis_client.hget(KEYS.stats, "unverified_runs") == b"1"


def test_a_hard_time_limit_on_an_unverified_run_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # On Celery 5.7 the main process sends task_failure twice: still one row, one line.
    job = unverified_publish(redis_url, redis_client, "tests.hard")
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="reserved"):
        (row,) = wait_rows(redis_client, 1, log)
        time.sleep(1.0)
    assert shown(row) == (job, 1, "killed", "reserved", False)
    text = log.read_text()
    assert text.count("event=ledger_row") == 1 and "reason=TimeLimitExceeded" in text, text


def test_an_unverified_run_that_died_unseen_is_rowed_by_its_redelivered_copy(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # acks_late and reject_on_worker_lost: no signal when the child dies; the broker delivers
    # the message again, and that run's start finds the run before it without its row.
    job = unverified_publish(redis_url, redis_client, "tests.lost_late")
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="reserved"):
        kill_run(redis_client, 0)
        first, second = wait_rows(redis_client, 2, log)
    assert [r["id"] for r in runs(redis_client)] == [job, job]
    assert shown(first) == (job, 1, "killed", "reserved", False)
    assert shown(second) == (job, 1, "ok", "reserved", False)
    assert "reason=worker_lost_redelivered" in log.read_text()
    assert redis_client.hget(KEYS.stats, "unverified_runs") == b"2"
    assert redis_client.ttl(KEYS.unverified(job, 1)) > 0  # kept a while, not for good


def test_a_revoke_that_terminates_an_unverified_run_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    job = unverified_publish(redis_url, redis_client, "tests.sleepy")
    app = create_app(gate_settings(redis_url), redis_url)
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="reserved"):
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        app.control.revoke(job, terminate=True, signal="SIGKILL")
        (row,) = wait_rows(redis_client, 1, log)
    assert shown(row) == (job, 1, "killed", "reserved", False)
    assert "reason=revoked" in log.read_text()


def test_an_unverified_run_whose_whole_worker_vanished_is_swept(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # No signal at all (the main process dies too): the sweep rows it from what its start
    # kept of the message, once its worker's heartbeat is gone.
    job = unverified_publish(redis_url, redis_client, "tests.sleepy")
    settings = gate_settings(redis_url)
    ledger = RunLedger.from_settings(redis_client, settings)
    with running_worker(redis_url, tmp_path / "w.log", queues="reserved", session=True,
                        GATEKEEPER_WORKER_HEARTBEAT_S="1") as worker:  # fmt: skip
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        assert sweep(ledger, round(time.time() * 1000), 0) == []  # merely long: alive
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    assert rows(redis_client) == []
    assert wait_until(lambda: not list(redis_client.scan_iter(match=KEYS.worker("*"))), 10)
    ((swept, verified),) = sweep(ledger, round(time.time() * 1000), 0)
    (row,) = rows(redis_client)
    assert (swept.job_id, swept.outcome.value, verified) == (job, "killed", False)
    assert shown(row) == (job, 1, "killed", "reserved", False)
    assert row["tokens_in"] == 1200 and row["retry_tax"] == 0.0
    assert sweep(ledger, round(time.time() * 1000), 0) == []  # once
    assert redis_client.zcard(KEYS.unverified_started) == 0


def worker_side(redis_url: str, redis_client: redis.Redis) -> tuple[WorkerSide, Any]:
    settings = gate_settings(redis_url)
    app = create_app(settings, redis_url)
    side = WorkerSide(app, settings, redis_client, FlagStore(redis_client, settings))
    return side, app.tasks["tests.sleepy"]


def test_a_dead_runs_row_that_fails_costs_the_running_run_nothing_and_is_swept_later(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    side, task = worker_side(redis_url, redis_client)
    written: list[int] = []
    real = UnverifiedRuns.write

    def flaky(self: UnverifiedRuns, row: Any, run: int, now_ms: int, token: Any = None) -> bool:
        written.append(run)
        if len(written) == 1:  # the dead run's row: Redis refuses it, once (an answer: dropped)
            raise LedgerUnavailable("cannot write an unverified row: refused")
        return real(self, row, run, now_ms, token)

    monkeypatch.setattr(UnverifiedRuns, "write", flaky)
    task.push_request(id="J", gatekeeper_decision="reserved", gatekeeper_attempt=1, retries=0,
                      delivery_info={"redelivered": True}, hostname="gone@nowhere")  # fmt: skip
    try:
        side.on_prerun(sender=task, task_id="J")  # run 1: its worker dies unseen
        side.on_prerun(sender=task, task_id="J")  # run 2, redelivered: run 1's row fails
        side.on_success(sender=task)
    finally:
        task.pop_request()
    assert written == [1, 2]
    assert [(r["attempt"], r["outcome"]) for r in rows(redis_client)] == [(1, "ok")]
    ledger = RunLedger.from_settings(redis_client, gate_settings(redis_url))
    assert redis_client.zcard(KEYS.unverified_started) == 1  # run 1 is still owed its row
    assert len(sweep(ledger, round(time.time() * 1000) + 3_600_000, 0)) == 1  # worker gone
    assert [(r["attempt"], r["outcome"]) for r in rows(redis_client)] == [(1, "ok"), (1, "killed")]
    assert redis_client.zcard(KEYS.unverified_started) == 0


def test_a_run_rowed_after_its_hash_expired_leaves_nothing_for_good(
    redis_url: str, redis_client: redis.Redis
) -> None:
    side, task = worker_side(redis_url, redis_client)
    record = unverified(task, {"gatekeeper_decision": "reserved"}, 1000)
    assert not redis_client.exists(KEYS.unverified("J", 1))  # never started here, or expired
    side.unverified.end("J", Running(1, 1, record, False), Outcome.OK, "ok")
    side.unverified.end("J", Running(1, 1, record, False), Outcome.KILLED, "twice")
    assert [r["outcome"] for r in rows(redis_client)] == ["ok"]
    assert redis_client.ttl(KEYS.unverified("J", 1)) > 0


def script(redis_url: str, redis_client: redis.Redis) -> Any:
    return UnverifiedRuns(RunLedger.from_settings(redis_client, gate_settings(redis_url)))._script


def start(
    run_script: Any, now_ms: int, token: str, redelivered: str = "0", worker: str = "w@host"
) -> list[Any]:
    keys = [KEYS.unverified("J", 1), KEYS.stats, KEYS.unverified_started]
    args = ["start", "J:1", str(now_ms), "100", token, redelivered, "4242", worker,
            "task", "tests.sleepy", "decision", "reserved"]  # fmt: skip
    return list(run_script(keys=keys, args=args))


def row(run_script: Any, run: int, token: str) -> int:
    keys = [KEYS.unverified("J", 1), KEYS.window_rows(1), KEYS.window(1), KEYS.totals,
            KEYS.unverified_started]  # fmt: skip
    args = ["row", "J:1", str(run), json.dumps({"run": run}), "ok", "100", "", "100", token]
    (written,) = run_script(keys=keys, args=args)
    return int(written)


def test_a_start_sent_again_with_its_token_counts_one_run(
    redis_url: str, redis_client: redis.Redis
) -> None:
    run_script = script(redis_url, redis_client)
    assert start(run_script, 1000, "t1") == start(run_script, 2000, "t1") == [1, 0, b"0"]
    # A second copy of the id, not redelivered: run 1 may be live (a caller's copy), not dead.
    assert start(run_script, 3000, "t2") == [2, 0, b"0"]
    # Redelivered: the run before it has no row, so it died with its worker.
    assert start(run_script, 4000, "t3", redelivered="1") == [3, 2, b"3000"]
    # The first start sent again after the others (its reply lost, read at its run's end).
    assert start(run_script, 5000, "t1") == [1, 0, b"0"]
    assert redis_client.hget(KEYS.stats, "unverified_runs") == b"3"
    assert redis_client.hget(KEYS.unverified("J", 1), "open") == b"3"


def test_a_row_sent_again_with_its_token_is_written_once_and_told_so(
    redis_url: str, redis_client: redis.Redis
) -> None:
    run_script = script(redis_url, redis_client)
    start(run_script, 1000, "t1")
    start(run_script, 2000, "t2")  # two runs without a row: the sweep's set holds the attempt
    assert row(run_script, 2, "a") == 1
    assert row(run_script, 2, "a") == 1  # the same call again (its reply was lost): told so
    assert row(run_script, 2, "b") == 0  # another call for the run (a second signal): not
    assert redis_client.llen(KEYS.window_rows(1)) == 1
    assert redis_client.zscore(KEYS.unverified_started, "J:1") == 2000  # run 1 still owed
    assert row(run_script, 1, "c") == 1  # rowed after a later run: each run on its own
    assert redis_client.zscore(KEYS.unverified_started, "J:1") is None
    assert redis_client.llen(KEYS.window_rows(1)) == 2


def test_each_run_is_judged_by_its_own_worker_and_pool_child(
    redis_url: str, redis_client: redis.Redis
) -> None:
    run_script = script(redis_url, redis_client)
    store = UnverifiedRuns(RunLedger.from_settings(redis_client, gate_settings(redis_url)))
    start(run_script, 1000, "t1", worker="gone@nowhere")
    start(run_script, 2000, "t2", worker="alive@host")  # a second copy, on a live worker
    redis_client.set(KEYS.worker("alive@host"), "1")
    ledger = RunLedger.from_settings(redis_client, gate_settings(redis_url))
    assert len(sweep(ledger, 10**13, 0)) == 1  # run 1 only: its worker is gone, not run 2's
    assert [run for run, _, _ in store.open_runs("J", 1) or []] == [2]
    # The main process names the run its child ran: by pid and worker, never another's.
    assert store.ended_in("J", 1, (4242, "alive@host")) is not None
    assert store.ended_in("J", 1, (4242, "other@host")) is None  # same pid, another host
    assert store.ended_in("J", 1, (9999, "alive@host")) is None  # rowed already, or not its
    assert store.ended_in("J", 1, (0, ""))[0] == 2  # type: ignore[index]  # the one left


def test_an_unverified_abandonment_given_back_and_abandoned_again_is_rowed_once(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # The replayer's abandonment of a message with no nonce (run 0: no run of its own), its
    # move refused and the message abandoned again by the next pass.
    store = UnverifiedRuns(RunLedger.from_settings(redis_client, gate_settings(redis_url)))
    row = make_row(job_id="J", attempt=1, path=RowPath.FREE, outcome=Outcome.ABANDONED,
                   queue_wait_ms=0, tokens_in=0, tokens_out=0, deadline_slack_ms=-5)  # fmt: skip
    assert store.write(row, 0, 1000) and not store.write(row, 0, 2000)
    assert [(r["outcome"], r["verified"]) for r in rows(redis_client)] == [("abandoned", False)]
    assert redis_client.hget(KEYS.totals, "abandoned") == b"1"


def test_a_row_sent_again_after_a_lost_connection_is_logged_once(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    side, task = worker_side(redis_url, redis_client)
    record = unverified(task, {"gatekeeper_decision": "reserved"}, 1000)
    calls: list[list[str]] = []
    call = side.runs.call

    def lost(script_: Any, keys: list[str], args: list[str]) -> Any:
        calls.append(args)
        reply = call(script_, keys, args)
        if len(calls) == 1:  # applied, and its reply lost with the connection
            raise redis.ConnectionError("connection reset by peer")
        return reply

    monkeypatch.setattr(side.runs, "call", lost)
    lines: list[dict[str, Any]] = []
    monkeypatch.setattr(side.unverified.log, "info", lambda event, **kw: lines.append(kw))
    side.unverified.end("J", Running(1, 1, record, False), Outcome.OK, "ok")
    assert len(calls) == 2 and calls[0] == calls[1]  # sent again, with its token
    assert len(rows(redis_client)) == 1 and len(lines) == 1


@pytest.mark.parametrize("kill_first", [False, True])
def test_two_copies_of_one_id_run_at_once_each_get_their_own_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, kill_first: bool
) -> None:
    # A caller's second copy of an unverified job's id, run while the first runs: neither is
    # taken for dead (nothing was redelivered), each run gets its own row; and when the first
    # copy's child is killed, the main process rows the run that child ran (by its pid), not
    # the latest run.
    task, log = gate_down(redis_url).tasks["tests.sleepy"], tmp_path / "w.log"
    with running_worker(redis_url, log, queues="reserved", concurrency=2):
        task.apply_async(kwargs={"sleep_s": 30.0 if kill_first else 3.0}, task_id="J")
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        task.apply_async(kwargs={"sleep_s": 0.5}, task_id="J")
        if kill_first:
            kill_run(redis_client, 0, started=2)
        found = wait_rows(redis_client, 2, log)
    expected = ["killed", "ok"] if kill_first else ["ok", "ok"]
    assert sorted(r["outcome"] for r in found) == expected, log.read_text()
    assert all(shown(r)[:2] == ("J", 1) and not r["verified"] for r in found)


def test_an_unverified_child_killed_under_retry_on_worker_lost_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Celery 5.7 retries it from the main process, with task_retry, not task_failure.
    job = unverified_publish(redis_url, redis_client, "tests.lost_retry")
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="free,reserved"):
        kill_run(redis_client, 0)
        retried = hasattr(celery.Task, "retry_on_worker_lost")
        assert wait_until(lambda: len(runs(redis_client)) == 1 + retried, 30), log.read_text()
        killed = wait_rows(redis_client, 1, log)[0]
    assert shown(killed) == (job, 1, "killed", "reserved", False), log.read_text()
    assert [r["attempt"] for r in rows(redis_client) if r["outcome"] == "killed"] == [1]


def lost_record_publish(
    redis_url: str, redis_client: redis.Redis, task: str, stub: bool = False, **kw: Any
) -> str:
    """Publish ``task`` through the gate (free, with a nonce), then drop its record, as a
    failover drops what the old master had not replicated (README, Sentinel). ``stub``: then
    an earlier run's row, kept by its worker while Redis was silent, is sent again and written
    (finish.lua), leaving a record with its row's marks and no nonce."""
    app = create_app(gate_settings(redis_url), redis_url)
    job = str(app.tasks[task].apply_async(kwargs=kw).id)
    (message,) = queue_messages(redis_client, "free")
    assert message["headers"]["gatekeeper_nonce"]
    record = RunRecord.from_fields(
        {k.decode(): v.decode() for k, v in redis_client.hgetall(KEYS.run(job, 1)).items()}
    )
    assert redis_client.delete(KEYS.run(job, 1)) == 1
    if stub:
        ledger = RunLedger.from_settings(redis_client, gate_settings(redis_url))
        now_ms = round(time.time() * 1000)
        row = ledger.row_for(job, 1, record, Outcome.KILLED, now_ms)
        assert ledger.finish(row, 1, record, now_ms, current=False).written
        assert redis_client.hget(KEYS.run(job, 1), "rowed") == b"1"
        assert redis_client.hget(KEYS.run(job, 1), "nonce") is None
    return job


@pytest.mark.parametrize(("killed", "stub"), [(False, False), (True, False), (False, True),
                                               (True, True)])  # fmt: skip
def test_a_run_whose_record_a_failover_lost_gets_an_unverified_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, killed: bool, stub: bool
) -> None:
    # Its nonce names no record at all: not forged (a nonce that is not an existing record's),
    # but a decision the gate's Redis no longer holds. Ended in its pool child, or SIGKILLed
    # before it read its start (the main process then counts the run for its row). Or all
    # that is left is the mark of a row written after the loss (a reviewer: it was forged).
    job = lost_record_publish(redis_url, redis_client, "tests.sleepy", stub,
                              sleep_s=5 if killed else 0)  # fmt: skip
    log = tmp_path / "w.log"
    with running_worker(redis_url, log):
        if killed:
            kill_run(redis_client, 0)
        *_, row = wait_rows(redis_client, 1 + stub, log)
    outcome = "killed" if killed else "ok"
    assert shown(row) == (job, 1, outcome, "free", False) and row["retry_tax"] == 0.0
    stats = {k.decode(): int(v) for k, v in redis_client.hgetall(KEYS.stats).items()}
    assert stats == {"unverified_runs": 1}
    assert "kind=unverified" in log.read_text()
    assert redis_client.zcard(KEYS.unverified_started) == 0


def test_an_unverified_dead_run_whose_redelivered_copy_is_revoked_before_it_starts_is_killed(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    job = unverified_publish(redis_url, redis_client, "tests.lost_late")
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="reserved"):
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        gate_down(redis_url).control.revoke(job)  # not terminated: the run goes on
        time.sleep(1)
        kill_run(redis_client, 0)
        (row,) = wait_rows(redis_client, 1, log)
    assert len(runs(redis_client)) == 1  # the copy never ran
    assert shown(row) == (job, 1, "killed", "reserved", False)
    assert "reason=worker_lost_redelivered" in log.read_text()
    assert redis_client.zcard(KEYS.unverified_started) == 0
