"""``Task.replace`` of a gated task by a gated task: Celery publishes the replacement with the
running task's id, before that run ends. The run ends at the replacement's publish, with its
row, so the gate takes the replacement for the attempt begun again: its own decision, record,
verified run and row, never a duplicate publish run as a forged message."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.states import IGNORED

from gatekeeper.celery.running import Running
from gatekeeper.redis.runs import RunRecord
from tests.conftest import running_worker, wait_until
from tests.test_unverified_runs import worker_side
from tests.test_worker_ledger import KEYS, app_for, rows, runs, window_totals

pytestmark = pytest.mark.celery


def lines(log: Path, event: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if f"event={event} " in line]


@pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 1), ("threads", 2), ("gevent", 4)])
def test_a_gated_replacement_is_decided_anew_and_each_run_has_its_verified_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, pool: str, concurrency: int
) -> None:
    log = tmp_path / "w.log"
    # reserved too: before the fix the replacement went there (reserved/duplicate_publish)
    with running_worker(redis_url, log, queues="free,reserved", pool=pool,
                        concurrency=concurrency):  # fmt: skip
        job = app_for(redis_url).tasks["tests.replaces"].delay(7).id
        assert wait_until(lambda: len(rows(redis_client)) >= 2, 20), rows(redis_client)
        time.sleep(0.5)  # a third row or a late line, if any, would land now
    ran = [(r["task"], r["id"], r["queue"]) for r in runs(redis_client)]
    assert ran == [("tests.replaces", job, "free"), ("tests.embed", job, "free")]
    found = rows(redis_client)
    assert [(r["job_id"], r["attempt"], r["path"], r["outcome"]) for r in found] == [
        (job, 1, "free", "ok"),
        (job, 1, "free", "ok"),
    ]
    assert [r["tokens_in"] for r in found] == [1200, 100]  # the original's, then embed's
    ended = lines(log, "ledger_row")
    assert [re.search(r" task=(\S+) .* reason=(\S+) ", line).groups() for line in ended] == [  # type: ignore[union-attr]
        ("tests.replaces", "replaced"),
        ("tests.embed", "ok"),
    ]
    assert lines(log, "ledger_unverified_message") == []
    totals = {k.decode(): v for k, v in redis_client.hgetall(KEYS.totals).items()}
    assert not [k for k in totals if "duplicate_publish" in k or "forged" in k], totals
    assert totals["decided:admit_free:fits:tests.embed"] == b"1"
    record = redis_client.hgetall(KEYS.run(job, 1))
    assert (record[b"runs"], record[b"rowed"]) == (b"1", b"1")  # the attempt begun again
    assert not [k for k in record if k.startswith(b"dup:")]
    assert redis_client.zcard(KEYS.started) == 0 and redis_client.hlen(KEYS.inflight) == 0
    assert window_totals(redis_client, "exposure") == 0


def test_a_run_replaced_by_an_ungated_task_is_one_ok_row_reason_ignored(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The replacement is no attempt of the gate's: the replaced run ends at ``task_postrun``
    (Celery's ``Ignore``), ``ok``, reason ``ignored``, its exposure given back; the
    replacement runs on the app's own queue, with no row."""
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="free,reserved,celery"):
        job = app_for(redis_url).tasks["tests.replaces"].delay(7, ungated=True).id
        assert wait_until(lambda: len(runs(redis_client)) >= 2, 20), runs(redis_client)
        assert wait_until(lambda: len(rows(redis_client)) >= 1, 20)
        time.sleep(0.5)  # a second row or a late line, if any, would land now
    ran = [(r["task"], r["id"], r["queue"]) for r in runs(redis_client)]
    assert ran == [("tests.replaces", job, "free"), ("tests.plain", job, "celery")]
    assert [(r["job_id"], r["outcome"]) for r in rows(redis_client)] == [(job, "ok")]
    (ended,) = lines(log, "ledger_row")
    assert f"job_id={job}" in ended and " reason=ignored " in ended
    assert redis_client.zcard(KEYS.started) == 0 and redis_client.hlen(KEYS.inflight) == 0
    assert window_totals(redis_client, "exposure") == 0


def record_of(nonce: str) -> RunRecord:
    return RunRecord(task="tests.sleepy", path="free", decision="admit_free", published_ms=1,
                     admitted_ms=1, window=0, deadline_ms=10**13, tokens_in=1, tokens_out=0,
                     dwell_s=1.0, retries=0, started_ms=2, nonce=nonce)  # fmt: skip


def test_a_runs_end_at_postrun_leaves_another_run_of_its_task_id_alone(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A threads pool may hold the replacement's run (same task id, another nonce) when the
    replaced run reaches ``task_postrun`` (its ``Ignore``): that entry is not this run's."""
    side, task = worker_side(redis_url, redis_client)
    headers: dict[str, Any] = {"gatekeeper_decision": "admit_free", "gatekeeper_attempt": 1,
                               "gatekeeper_nonce": "original", "retries": 0}  # fmt: skip
    side._running["J"] = Running(1, 1, record_of("replacement"), True)
    task.push_request(id="J", **headers)
    try:
        side.on_postrun(sender=task, task_id="J", state=IGNORED)
        assert side._running["J"].record.nonce == "replacement"  # left to its own end
        side._running["J"] = Running(1, 1, record_of("original"), True)
        side.on_postrun(sender=task, task_id="J", state=IGNORED)
        assert "J" not in side._running  # its own run: ended here
    finally:
        task.pop_request()


def test_a_chain_that_replaces_a_run_has_each_run_rowed_once_the_last_decided_anew(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A chain's last task takes the replaced task's id, but Celery publishes it only once
    the first has run: the replaced run ends at its ``Ignore`` (``ignored``), as before."""
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="free,reserved"):
        job = app_for(redis_url).tasks["tests.replaces"].delay(7, chained=True).id
        assert wait_until(lambda: len(rows(redis_client)) >= 3, 20), rows(redis_client)
        time.sleep(0.5)
    ran = [(r["task"], r["id"] == job, r["queue"]) for r in runs(redis_client)]
    assert ran == [("tests.replaces", True, "free"), ("tests.embed", False, "free"),
                   ("tests.embed", True, "free")]  # fmt: skip
    found = [(r["job_id"] == job, r["outcome"], r["path"]) for r in rows(redis_client)]
    assert found == [(True, "ok", "free"), (False, "ok", "free"), (True, "ok", "free")]
    ended = lines(log, "ledger_row")
    assert [re.search(r" reason=(\S+) ", line).group(1) for line in ended] == [  # type: ignore[union-attr]
        "ignored", "ok", "ok",
    ]  # fmt: skip
    assert lines(log, "ledger_unverified_message") == []


@pytest.mark.parametrize("how", ["sigkill", "revoked"])
def test_a_replacement_ended_by_the_main_process_gets_its_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, how: str
) -> None:
    """A reviewer: the main process holds both requests of the task id (the replacement came
    while the replaced run was going), so a replacement it ended itself (its pool child
    SIGKILLed, or revoked before it started) was an ambiguous end: no row, its exposure held.
    The request whose nonce the attempt's record holds now is the one that ended."""
    log = tmp_path / "w.log"
    app = app_for(redis_url)
    with running_worker(redis_url, log, queues="free,reserved"):
        if how == "sigkill":
            job = app.tasks["tests.replaces"].delay(7, sleep_s=30).id
            assert wait_until(lambda: len(runs(redis_client)) >= 2, 20)
            os.kill(runs(redis_client)[1]["pid"], signal.SIGKILL)
        else:  # a countdown: held by the worker, revoked before it runs (discarded when due)
            job = app.tasks["tests.replaces"].delay(7, countdown=3).id
            assert wait_until(lambda: len(rows(redis_client)) >= 1, 20)
            assert wait_until(lambda: window_totals(redis_client, "exposure") > 0, 10)
            app.control.revoke(job)
        expected = 2 if how == "sigkill" else 1
        assert wait_until(lambda: len(rows(redis_client)) >= expected, 20), rows(redis_client)
        assert wait_until(lambda: window_totals(redis_client, "exposure") == 0, 10)
        time.sleep(0.5)
    found = [(r["job_id"], r["outcome"]) for r in rows(redis_client)]
    assert found == [(job, "ok"), (job, "killed")][:expected]
    assert lines(log, "ledger_ambiguous_end") == []
    assert redis_client.zcard(KEYS.started) == 0 and redis_client.hlen(KEYS.inflight) == 0
