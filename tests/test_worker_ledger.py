"""The worker side against a real prefork worker: one row per run, for every way a run ends."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import celery
import pytest
import redis
from celery.exceptions import Reject
from celery.states import IGNORED, REJECTED, SUCCESS
from click.testing import CliRunner

import gatekeeper
from gatekeeper.celery.metering import _metered
from gatekeeper.celery.postrun import ended_at_postrun
from gatekeeper.ops.cli import main
from gatekeeper.redis.kept import unpack
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import load_lua, text_of
from tests.apps.gated_app import HELD_KEY, RUNS_KEY, create_app
from tests.conftest import clear_of_a_window_edge, gate_settings, running_worker, wait_until
from tests.moved import BlackHole

pytestmark = pytest.mark.celery
KEYS = Keys()
ON_SUCCESS_ERROR_IS_LOGGED = tuple(map(int, celery.__version__.split(".")[:2])) >= (5, 7)
"""Celery 5.7 logs an ordinary exception from ``on_success`` and sends ``task_success``; older
ones send ``task_failure`` (the result stored as a success all the same)."""


def rows(client: redis.Redis) -> list[dict[str, Any]]:
    found = []
    for key in sorted(client.scan_iter(match=KEYS.window_rows(0).replace(":0:", ":*:"))):
        found += [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    return found


def window_totals(client: redis.Redis, field: str) -> float:
    total = 0.0
    for key in client.scan_iter(match=KEYS.window(0)[:-1] + "*"):
        if client.type(key) == b"hash":
            total += float(client.hget(key, field) or 0)
    return total


def runs(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(RUNS_KEY, 0, -1)]


def wait_rows(client: redis.Redis, count: int, timeout_s: float = 30) -> list[dict[str, Any]]:
    assert wait_until(lambda: len(rows(client)) >= count, timeout_s), rows(client)
    time.sleep(0.5)  # a duplicate signal, if any, would land now
    return rows(client)


def app_for(redis_url: str, **overrides: Any) -> Any:
    return create_app(gate_settings(redis_url, **overrides), redis_url)


def the_killed_row(client: redis.Redis) -> dict[str, Any]:
    (row,) = wait_rows(client, 1)
    assert (row["outcome"], row["path"], row["attempt"]) == ("killed", "free", 1)
    assert row["tokens_in"] == 1200
    assert row["retry_tax"] == 1200 + row["queue_wait_ms"] * 200 / 1000
    assert window_totals(client, "tax_units") == row["retry_tax"]
    assert window_totals(client, "exposure") == 0
    return row


def test_an_exception_is_one_killed_row_priced_as_the_worked_vector(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    published = float(int(time.time()))
    app = create_app(gate_settings(redis_url), redis_url, clock=lambda: published)
    started = published + 2.1  # the worker's clock: 2100 ms of queue wait
    with running_worker(redis_url, tmp_path / "w.log", GATEKEEPER_TEST_CLOCK=repr(started)):
        job = app.tasks["tests.boom"].delay().id
        row = the_killed_row(redis_client)
    assert (row["job_id"], row["queue_wait_ms"], row["retry_tax"]) == (job, 2100, 1620)
    assert "reason=ValueError" in (tmp_path / "w.log").read_text()
    grep = subprocess.run(  # the README's runbook: the attempts that died
        f"grep 'event=ledger_row' {tmp_path / 'w.log'} | grep 'outcome=killed'",
        shell=True, capture_output=True, text=True, check=True,
    )  # fmt: skip
    (died,) = grep.stdout.splitlines()
    assert f"job_id={job}" in died and "attempt=1" in died


def test_a_task_that_raises_ignore_is_one_ok_row_and_leaves_nothing_started(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Celery ends an ``Ignore`` (``Task.replace`` raises it too) with ``task_postrun``
    alone: no success, failure or retry signal."""
    with running_worker(redis_url, tmp_path / "w.log"):
        job = app_for(redis_url).tasks["tests.ignores"].delay().id
        (row,) = wait_rows(redis_client, 1)
    assert (row["job_id"], row["outcome"], row["path"]) == (job, "ok", "free")
    assert redis_client.zcard(KEYS.started) == 0
    assert redis_client.hlen(KEYS.inflight) == 0
    assert window_totals(redis_client, "exposure") == 0
    assert "reason=ignored" in (tmp_path / "w.log").read_text()


def test_a_run_rejected_without_requeue_is_one_killed_row_and_gives_back_its_reservation(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """``Reject(requeue=False)``: no copy will run to find the run dead, so it ends at
    ``task_postrun``, not at the sweep (which leaves a live worker's runs alone)."""
    with running_worker(redis_url, tmp_path / "w.log"):
        job = app_for(redis_url).tasks["tests.rejects"].delay(requeue=False).id
        row = the_killed_row(redis_client)  # its exposure given back too
    assert row["job_id"] == job and [r["id"] for r in runs(redis_client)] == [job]
    assert redis_client.hmget(KEYS.run(job, 1), "runs", "rowed") == [b"1", b"1"]
    assert redis_client.zcard(KEYS.started) == 0 and redis_client.hlen(KEYS.inflight) == 0
    assert re.search(r"reason=reject(\s|$)", (tmp_path / "w.log").read_text(), re.MULTILINE)


def test_a_rejected_run_is_not_held_by_the_process_that_ran_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = app_for(redis_url)
    with running_worker(redis_url, tmp_path / "w.log"):  # one child: it runs both, in turn
        job = app.tasks["tests.rejects"].delay(requeue=False).id
        app.tasks["tests.held"].apply_async(queue="free")
        assert wait_until(lambda: redis_client.llen(HELD_KEY) == 1)
    assert [r["id"] for r in runs(redis_client)] == [job]
    assert json.loads(redis_client.lindex(HELD_KEY, 0) or "null") == []


@pytest.mark.parametrize("task", ["tests.rejects", "tests.rejects_after"])
def test_a_rejected_and_requeued_run_is_killed_at_once_and_its_copy_is_a_rerun_that_rows_ok(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, task: str
) -> None:
    """``Reject(requeue=True)`` ends the run at ``task_postrun`` too, on the worker that ran
    it: its copy may run on another worker, or never. The copy is a new run of an attempt
    that has its row, counted as a rerun like any message delivered again after its row.
    The same when the body returned and ``on_success`` raised it (``tests.rejects_after``):
    Celery sends ``task_postrun`` (state SUCCESS) but no ``task_success``, and requeues the
    message; the run ends there as a rejected one does."""
    with running_worker(redis_url, tmp_path / "w.log"):
        job = app_for(redis_url).tasks[task].delay().id
        found = wait_rows(redis_client, 2)
    assert [(r["job_id"], r["outcome"]) for r in found] == [(job, "killed"), (job, "ok")]
    assert redis_client.hget(KEYS.stats, "reruns_after_row") == b"1"
    assert redis_client.zcard(KEYS.started) == 0 and redis_client.hlen(KEYS.inflight) == 0
    assert window_totals(redis_client, "exposure") == 0
    log = (tmp_path / "w.log").read_text()
    assert re.search(r"reason=reject(\s|$)", log, re.MULTILINE)
    assert "reason=worker_lost_redelivered" not in log


@pytest.mark.parametrize("how", ["drop", "raise"])
def test_a_run_whose_on_success_raises_is_one_row_and_not_held_by_its_process(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, how: str
) -> None:
    """``Reject(requeue=False)`` from ``on_success``: killed, as a rejected run (Celery 5.7's
    main process also sends ``task_failure``: still one row). An ordinary exception: Celery
    5.7 logs it and sends ``task_success`` (ok); 5.5 and 5.6 send ``task_failure`` (killed)."""
    app = app_for(redis_url)
    with running_worker(redis_url, tmp_path / "w.log"):  # one child: it runs both, in turn
        job = app.tasks["tests.rejects_after"].delay(how=how).id
        (row,) = wait_rows(redis_client, 1)
        app.tasks["tests.held"].apply_async(queue="free")
        assert wait_until(lambda: redis_client.llen(HELD_KEY) == 1)
    assert json.loads(redis_client.lindex(HELD_KEY, 0) or "null") == []
    assert [r["id"] for r in runs(redis_client)] == [job] and row["job_id"] == job
    assert redis_client.zcard(KEYS.started) == 0 and redis_client.hlen(KEYS.inflight) == 0
    assert window_totals(redis_client, "exposure") == 0
    log = (tmp_path / "w.log").read_text()
    if how == "drop":
        assert row["outcome"] == "killed"
        assert re.search(r"reason=reject(\s|$)", log, re.MULTILINE)
    else:
        assert row["outcome"] == ("ok" if ON_SUCCESS_ERROR_IS_LOGGED else "killed")


POSTRUN_ENDS = [
    (IGNORED, None, ("ok", "ignored")),
    (REJECTED, None, ("killed", "reject")),
    (SUCCESS, Reject("after the body", requeue=True), ("killed", "reject")),
    (SUCCESS, RuntimeError("on_success, before Celery 5.7"), ("killed", "RuntimeError")),
    (SUCCESS, None, ("killed", "no_end_signal")),
]
"""A run open at its ``task_postrun``: its state, the exception on its way out, its row."""


@pytest.mark.parametrize(("state", "raised", "ended"), POSTRUN_ENDS)
def test_a_run_open_at_postrun_ends_by_its_state_or_the_exception_on_its_way_out(
    state: str, raised: Exception | None, ended: tuple[str, str]
) -> None:
    seen = []
    with contextlib.suppress(Exception):
        try:
            if raised is not None:
                raise raised
        finally:  # where Celery's trace sends task_postrun
            seen.append(ended_at_postrun(state))
    assert [(outcome.value, reason) for outcome, reason in seen] == [ended]


def test_a_soft_time_limit_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with running_worker(redis_url, tmp_path / "w.log"):
        app_for(redis_url).tasks["tests.soft"].delay()
        the_killed_row(redis_client)
    assert "reason=SoftTimeLimitExceeded" in (tmp_path / "w.log").read_text()


def test_a_hard_time_limit_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with running_worker(redis_url, tmp_path / "w.log"):
        app_for(redis_url).tasks["tests.hard"].delay()
        time.sleep(1.5)  # on Celery 5.7 the failure signal fires twice: still one row
        the_killed_row(redis_client)
    assert "reason=TimeLimitExceeded" in (tmp_path / "w.log").read_text()


def test_a_sigkilled_child_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with running_worker(redis_url, tmp_path / "w.log"):
        app_for(redis_url).tasks["tests.sleepy"].delay()
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        os.kill(runs(redis_client)[0]["pid"], signal.SIGKILL)
        the_killed_row(redis_client)
    assert "reason=WorkerLostError" in (tmp_path / "w.log").read_text()


def test_a_task_revoked_with_terminate_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = app_for(redis_url)
    with running_worker(redis_url, tmp_path / "w.log"):
        job = app.tasks["tests.sleepy"].delay().id
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        app.control.revoke(job, terminate=True, signal="SIGKILL")
        the_killed_row(redis_client)
    assert "reason=revoked" in (tmp_path / "w.log").read_text()


def test_a_redelivered_message_reveals_the_run_that_died(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    with running_worker(redis_url, tmp_path / "w.log"):
        job = app_for(redis_url).tasks["tests.lost_late"].delay().id
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        os.kill(runs(redis_client)[0]["pid"], signal.SIGKILL)
        first, second = wait_rows(redis_client, 2)
    assert [r["id"] for r in runs(redis_client)] == [job, job]
    assert (first["outcome"], first["attempt"], first["tokens_in"]) == ("killed", 1, 1200)
    assert (second["outcome"], second["attempt"]) == ("ok", 1)
    assert "reason=worker_lost_redelivered" in (tmp_path / "w.log").read_text()


def test_a_redelivered_run_that_dies_too_leaves_both_dead_runs_their_rows(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A start's reply is read when its run ends, but a redelivered run's at once: the row of
    the run that died before it is written before its own body runs, so a second death loses
    no row (the next start reveals only the run just before it)."""
    with running_worker(redis_url, tmp_path / "w.log"):
        job = app_for(redis_url).tasks["tests.lost_late"].delay(deaths=2).id
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        os.kill(runs(redis_client)[0]["pid"], signal.SIGKILL)
        assert wait_until(lambda: len(runs(redis_client)) == 2, 30)
        assert [row["outcome"] for row in rows(redis_client)] == ["killed"]  # before run 2 ends
        os.kill(runs(redis_client)[1]["pid"], signal.SIGKILL)
        first, second, third = wait_rows(redis_client, 3)
    assert [r["id"] for r in runs(redis_client)] == [job] * 3
    assert [(r["outcome"], r["attempt"]) for r in (first, second, third)] == [
        ("killed", 1), ("killed", 1), ("ok", 1)
    ]  # fmt: skip


@pytest.mark.parametrize("how", ["revoked", "expires"])
def test_a_dead_run_whose_redelivered_copy_is_discarded_before_it_starts_is_killed(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, how: str
) -> None:
    """``acks_late`` + ``reject_on_worker_lost``: the redelivered copy's start writes the dead
    run's row. A copy revoked meanwhile (not terminated: the run went on), or past its
    ``expires``, never starts: the main process writes the row as it discards the copy."""
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    with running_worker(redis_url, log):
        options: dict[str, Any] = {"expires": 4} if how == "expires" else {}
        job = app.tasks["tests.lost_late"].apply_async(**options).id
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        if how == "revoked":
            app.control.revoke(job)
            time.sleep(1)
        else:
            time.sleep(4.5)  # past the message's expiry
        os.kill(runs(redis_client)[0]["pid"], signal.SIGKILL)
        (row,) = wait_rows(redis_client, 1)
    assert len(runs(redis_client)) == 1  # the copy never ran
    assert (row["job_id"], row["outcome"], row["attempt"]) == (job, "killed", 1)
    assert "reason=worker_lost_redelivered" in log.read_text()
    assert redis_client.zcard(KEYS.started) == 0 and window_totals(redis_client, "exposure") == 0


def test_a_child_killed_after_its_result_was_stored_is_one_killed_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Killed in ``on_success``, after its result was stored: Celery 5.7 sends no
    ``task_failure`` then (it warns "succeeded before the worker was lost"), older ones do.
    Either way the main process writes the run ``killed``, once."""
    log = tmp_path / "w.log"
    backend = redis_url.rsplit("/", 1)[0] + "/1"
    with running_worker(redis_url, log, GATEKEEPER_TEST_RESULT_BACKEND=backend):
        job = app_for(redis_url).tasks["tests.dies_after"].delay().id
        (row,) = wait_rows(redis_client, 1)
        time.sleep(1.0)  # a second row, if any, would land now
    assert (row["job_id"], row["outcome"], row["attempt"]) == (job, "killed", 1)
    assert len(rows(redis_client)) == 1 and "reason=WorkerLostError" in log.read_text()
    assert redis_client.zcard(KEYS.started) == 0 and window_totals(redis_client, "exposure") == 0
    redis.Redis.from_url(backend).flushdb()


def test_a_worker_that_vanishes_without_a_signal_is_swept(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A heartbeat each second, a key of 3 s: a pause of the worker under load keeps it.
    with running_worker(redis_url, tmp_path / "w.log", GATEKEEPER_WORKER_HEARTBEAT_S="1") as worker:
        job = app_for(redis_url).tasks["tests.sleepy"].delay().id
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
        # Merely long: its worker is alive, so the sweep leaves it alone.
        alive = CliRunner().invoke(main, ["sweep", "--older-than-s", "0"])
        assert alive.stdout.startswith("swept=0"), alive.output
        hostname = unpack(
            {k.decode(): v.decode() for k, v in redis_client.hgetall(KEYS.run(job, 1)).items()}
        )["worker"]
        assert hostname and redis_client.exists(KEYS.worker(hostname))
        os.kill(runs(redis_client)[0]["pid"], signal.SIGKILL)
        worker.kill()  # the main process goes too, before it can notice
        worker.wait()
    assert rows(redis_client) == []
    assert wait_until(lambda: not redis_client.exists(KEYS.worker(hostname)), 10)
    result = CliRunner().invoke(main, ["sweep", "--older-than-s", "0"])
    assert result.stdout.startswith("swept=1 ")
    the_killed_row(redis_client)
    again = CliRunner().invoke(main, ["sweep", "--older-than-s", "0"])
    assert again.stdout.startswith("swept=0 ")


@pytest.mark.parametrize(("fail", "outcome", "tokens_out"), [(False, "ok", 5), (True, "killed", 5)])
def test_metered_tokens_replace_the_declared_ones(
    redis_url: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    fail: bool,
    outcome: str,
    tokens_out: int,
) -> None:
    with running_worker(redis_url, tmp_path / "w.log"):
        app_for(redis_url).tasks["tests.metered"].delay(fail=fail)
        (row,) = wait_rows(redis_client, 1)
    assert (row["outcome"], row["tokens_in"], row["tokens_out"]) == (outcome, 777, tokens_out)


def test_a_metering_task_called_directly_runs_and_keeps_nothing(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """``embed(chunk)``: no message, no attempt (an audit: meter() raised RuntimeError there).
    Its values are still checked; outside any task meter() still says it needs one."""
    metered = app_for(redis_url).tasks["tests.metered"]
    assert metered() is None
    assert not _metered
    with pytest.raises(RuntimeError, match="needs a running task"):
        gatekeeper.meter(tokens_in=1)
    assert rows(redis_client) == []


def test_a_metering_task_called_directly_inside_another_keeps_nothing_for_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Inside a running gated task, a metering task called directly keeps nothing (the outer
    attempt keeps its declared tokens, not the inner's 777); the outer meters its own attempt
    with ``task_id=self.request.id``."""
    calls = app_for(redis_url).tasks["tests.calls_metered"]
    with running_worker(redis_url, tmp_path / "w.log"):
        declared = calls.delay().id
        (row,) = wait_rows(redis_client, 1)
        assert (row["job_id"], row["outcome"], row["tokens_in"]) == (declared, "ok", 10)
        own = calls.delay(own=50).id
        (row,) = [r for r in wait_rows(redis_client, 2) if r["job_id"] == own]
    assert (row["outcome"], row["tokens_in"]) == ("ok", 50)


def test_a_batch_with_injected_kills_has_one_row_per_attempt_and_releases_exposure(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = app_for(redis_url, budget_units=1e9)  # the worker publishes the retries
    with running_worker(redis_url, tmp_path / "w.log", GATEKEEPER_BUDGET_UNITS="1e9"):
        for chunk in range(12):
            app.tasks["tests.coinflip"].delay(chunk)
        found = wait_rows(redis_client, 16, timeout_s=60)  # 12 first attempts, 4 killed + retried
    attempts = Counter((r["job_id"], r["attempt"]) for r in found)
    assert len(found) == 16 and set(attempts.values()) == {1}
    assert Counter(r["outcome"] for r in found) == {"ok": 12, "killed": 4}
    free_tax = sum(r["retry_tax"] for r in found if r["path"] == "free")
    assert window_totals(redis_client, "tax_units") == pytest.approx(free_tax)
    assert window_totals(redis_client, "exposure") == 0
    assert redis_client.hlen(KEYS.inflight) == 0 and redis_client.zcard(KEYS.started) == 0


def late_sleepers(app: Any, count: int) -> None:
    """``count`` runs of ``tests.sleepy`` admitted to free (dwell 1 s, deadline 1.3 s) that
    end late (1.5 s): each a slack miss."""
    for _ in range(count):
        app.tasks["tests.sleepy"].apply_async(
            kwargs={"sleep_s": 1.5}, headers={"gatekeeper_deadline_s": 1.3}
        )


def test_slack_misses_alert_and_freeze_the_free_path(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, GATEKEEPER_MISS_MIN_ADMISSIONS="3"):
        late_sleepers(app, 3)
        wait_rows(redis_client, 3)
    assert redis_client.hget(KEYS.flags, "free_path_enabled") == b"false"
    time.sleep(0.3)  # the publisher's flag cache
    job = app.tasks["tests.sleepy"].apply_async(kwargs={"sleep_s": 0}).id
    (message,) = [json.loads(raw) for raw in redis_client.lrange("reserved", 0, -1)]
    assert (message["headers"]["id"], message["headers"]["gatekeeper_reason"]) == (
        job,
        "free_path_disabled",
    )
    grep = subprocess.run(
        f"grep 'decision=admit_free' {log} | grep 'slack_miss=true'",
        shell=True, capture_output=True, text=True, check=True,
    )  # fmt: skip
    alerts = grep.stdout.splitlines()
    assert len(alerts) == 3
    assert all("dwell_s=" in a and "deadline_slack_s=-" in a and "retries=0" in a for a in alerts)
    assert "event=free_path_frozen" in log.read_text()
    (change,) = [json.loads(raw) for raw in redis_client.lrange(KEYS.flags_log, 0, -1)]
    assert change["actor"] == "gatekeeper:auto-freeze" and "slack misses" in change["reason"]


def test_misses_counted_before_the_minimum_admissions_freeze_once_the_window_has_them(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A reviewer: two misses while the window had 2 admissions (the minimum 3), then three
    on time: 2 of 5 is far over the 1% budget, and nothing froze (the rule was checked at a
    miss alone). A free row of a window with misses now checks it too."""
    clear_of_a_window_edge(900, 60)
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, GATEKEEPER_MISS_MIN_ADMISSIONS="3"):
        late_sleepers(app, 2)
        wait_rows(redis_client, 2)
        assert redis_client.hget(KEYS.flags, "free_path_enabled") is None  # 2 of 2: too few
        for _ in range(3):  # on time
            app.tasks["tests.sleepy"].apply_async(kwargs={"sleep_s": 0})
        wait_rows(redis_client, 5)
        assert wait_until(lambda: "event=free_path_frozen" in log.read_text(), 10)
    assert redis_client.hget(KEYS.flags, "free_path_enabled") == b"false"
    assert redis_client.hget(KEYS.totals, "freezes") == b"1"


def test_free_attempts_that_fail_for_good_after_their_deadline_are_slack_misses_and_freeze(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A job admitted to free that fails after its deadline (no retry left) ended late, as an
    ok one that ends late does: a miss, alerted, and counted toward the freeze."""
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    late = {"headers": {"gatekeeper_deadline_s": 1.3}}  # admitted, fails after 1.5 s
    with running_worker(redis_url, log, GATEKEEPER_MISS_MIN_ADMISSIONS="3"):
        for _ in range(3):
            app.tasks["tests.taxed"].apply_async(kwargs={"fail": True, "sleep_s": 1.5}, **late)
        found = wait_rows(redis_client, 3)
        assert wait_until(lambda: "event=free_path_frozen" in log.read_text(), 10)
    assert {(row["path"], row["outcome"]) for row in found} == {("free", "killed")}
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"3"
    assert window_totals(redis_client, "slack_misses") == 3
    assert redis_client.hget(KEYS.flags, "free_path_enabled") == b"false"
    alerts = [
        line for line in log.read_text().splitlines()
        if "decision=admit_free" in line and "slack_miss=true" in line
    ]  # fmt: skip
    assert len(alerts) == 3 and all("event=slack_miss" in a for a in alerts), alerts


def test_a_hard_time_limit_whose_message_is_requeued_is_no_slack_miss_its_job_goes_on(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Celery 5.7 sends ``task_failure`` for a hard time limit and then requeues an
    ``acks_late`` message that does not ack on timeout: not the job's end (a reviewer: the
    miss was counted there, and again when the copy's retry was abandoned)."""
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    late = {"headers": {"gatekeeper_deadline_s": 2.3}}  # admitted (dwell 2 s), cut at 3 s
    with running_worker(redis_url, log, GATEKEEPER_MISS_MIN_ADMISSIONS="1"):
        job = app.tasks["tests.hard_requeued"].apply_async(**late).id
        found = wait_rows(redis_client, 2, timeout_s=40)
    assert [(row["job_id"], row["attempt"], row["outcome"]) for row in found] == [
        (job, 1, "killed"), (job, 1, "killed"),
    ], log.read_text()  # fmt: skip
    assert "reason=retry" in log.read_text()
    assert redis_client.hget(KEYS.totals, "slack_misses") is None, log.read_text()
    assert "slack_miss=true" not in log.read_text()


def test_a_late_free_run_that_rejects_its_message_for_good_is_a_slack_miss(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """``Reject(requeue=False)`` drops the message: the job ends there (a reviewer: the row was
    written at postrun as not the job's end, and 5.7's later ``task_failure`` found it
    written)."""
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    late = {"headers": {"gatekeeper_deadline_s": 1.3}}  # admitted (dwell 1 s), ends at 1.5 s
    with running_worker(redis_url, log, GATEKEEPER_MISS_MIN_ADMISSIONS="1"):
        app.tasks["tests.rejects"].apply_async(kwargs={"requeue": False, "sleep_s": 1.5}, **late)
        (row,) = wait_rows(redis_client, 1)
        assert wait_until(lambda: "event=slack_miss" in log.read_text(), 10), log.read_text()
    assert (row["path"], row["outcome"]) == ("free", "killed")
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"


def test_a_late_free_attempt_that_retries_is_no_slack_miss_its_job_goes_on(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Its retry is the job's next attempt: the job has not ended, so its row counts no miss
    (the job's end, or its abandonment, is judged once)."""
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    late = {"headers": {"gatekeeper_deadline_s": 2.3}}  # admitted (dwell 2 s: one retry)
    with running_worker(redis_url, log, GATEKEEPER_MISS_MIN_ADMISSIONS="1"):
        job = app.tasks["tests.flaky"].apply_async(kwargs={"sleep_s": 2.5}, **late).id
        (row,) = wait_rows(redis_client, 1)
    assert (row["job_id"], row["attempt"], row["path"], row["outcome"]) == (
        job, 1, "free", "killed",
    )  # fmt: skip
    assert "reason=retry" in log.read_text()
    assert redis_client.hget(KEYS.totals, "slack_misses") is None
    assert "slack_miss=true" not in log.read_text()
    assert redis_client.hget(KEYS.flags, "free_path_enabled") != b"false"


def test_a_late_free_attempt_that_raises_retry_itself_ends_its_job_a_slack_miss(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A bare ``raise Retry()`` publishes nothing (``Task.retry`` publishes first): no attempt
    goes on, so the job ends with that run, late, a miss (taken for a retry, it counted none)."""
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    late = {"headers": {"gatekeeper_deadline_s": 1.3}}  # admitted: dwell 1 s
    with running_worker(redis_url, log, GATEKEEPER_MISS_MIN_ADMISSIONS="1"):
        job = app.tasks["tests.bare_retry"].apply_async(kwargs={"sleep_s": 1.5}, **late).id
        (row,) = wait_rows(redis_client, 1)
        assert wait_until(lambda: "event=slack_miss" in log.read_text(), 10), log.read_text()
    assert (row["job_id"], row["attempt"], row["path"], row["outcome"]) == (
        job, 1, "free", "killed",
    )  # fmt: skip
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"
    assert redis_client.hget(KEYS.run(job, 1), "kept").endswith(b"|end")  # the job's end
    assert not redis_client.exists(KEYS.run(job, 2))


def retried_late_on_reserved(app: Any, client: redis.Redis, task: str) -> str:
    """``task`` (one retry; ``then_s=3``: its retry's run) published admitted to free (dwell
    2 s, deadline 2.3 s), then the free path closed, so that its retry goes to reserved and
    ends late; its id."""
    job = app.tasks[task].apply_async(kwargs={"then_s": 3}, headers={"gatekeeper_deadline_s": 2.3})
    client.hset(KEYS.flags, "free_path_enabled", "false")  # for the retry's publish
    return str(job.id)


def test_a_free_jobs_retry_sent_to_reserved_that_ends_late_is_a_slack_miss(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """SPEC: a free-admitted job that finishes after its deadline is a miss, whichever path
    its last attempt took (a reviewer: a retry decided reserved counted none). The free path
    is closed once attempt 1 is admitted, so its retry goes to reserved and ends late."""
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, "free,reserved", GATEKEEPER_MISS_MIN_ADMISSIONS="1"):
        job = retried_late_on_reserved(app, redis_client, "tests.flaky")
        found = sorted(wait_rows(redis_client, 2), key=lambda row: row["attempt"])
        assert wait_until(lambda: "event=slack_miss" in log.read_text(), 10), log.read_text()
    assert [(row["job_id"], row["attempt"], row["path"], row["outcome"]) for row in found] == [
        (job, 1, "free", "killed"), (job, 2, "reserved", "ok"),
    ]  # fmt: skip
    assert redis_client.hget(KEYS.run(job, 2), "reason") == b"free_path_disabled"
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"
    assert window_totals(redis_client, "slack_misses") == 1
    assert not redis_client.exists(KEYS.window(0))  # counted in attempt 1's admission window
    (alert,) = [line for line in log.read_text().splitlines() if "slack_miss=true" in line]
    assert "decision=admit_free" in alert and f"job_id={job}" in alert and "attempt=2" in alert


def test_a_job_that_ends_ok_late_beside_the_retry_it_published_is_one_slack_miss(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A reviewer: ``retry(throw=False)`` publishes attempt 2 (to reserved: the path closed
    meanwhile) and attempt 1 returns; both end late. One admission, one miss (owner.py)."""
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, "free,reserved", GATEKEEPER_MISS_MIN_ADMISSIONS="1"):
        job = retried_late_on_reserved(app, redis_client, "tests.nothrow")
        found = sorted(wait_rows(redis_client, 2, timeout_s=40), key=lambda row: row["attempt"])
        time.sleep(1)  # a second miss, if any, would be counted by now
    assert [(row["job_id"], row["attempt"], row["path"], row["outcome"]) for row in found] == [
        (job, 1, "free", "ok"), (job, 2, "reserved", "ok"),
    ]  # fmt: skip
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"
    assert len([line for line in log.read_text().splitlines() if "slack_miss=true" in line]) == 1


def test_a_copy_of_an_attempt_that_retried_run_after_the_deadline_is_no_slack_miss(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A reviewer: attempt 1 asked for a retry and attempt 2 ended ok in time, the job's end.
    A copy of attempt 1's message (a lost ack's redelivery, or a caller who saw it: its
    nonce) that runs after the deadline is judged with the job, by the attempt that went on:
    no slack miss and no freeze (it counted one, and froze the free path, before)."""
    app = app_for(redis_url)
    published = time.time()
    # Ample: the worker starts after the publish (its message is copied first), and attempt 2
    # must still fit (dwell 1 s) when a loaded machine has it retried.
    deadline_s = 12.3
    app.tasks["tests.flaky"].apply_async(headers={"gatekeeper_deadline_s": deadline_s})
    (raw,) = redis_client.lrange("free", 0, -1)  # attempt 1, as the gate sent it
    copy = json.loads(raw)
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, GATEKEEPER_MISS_MIN_ADMISSIONS="1"):
        ended = wait_rows(redis_client, 2)
        assert sorted((r["attempt"], r["outcome"]) for r in ended) == [(1, "killed"), (2, "ok")]
        assert all(r["deadline_slack_ms"] > 0 for r in ended)
        time.sleep(max(0.0, published + deadline_s + 0.3 - time.time()))  # the deadline passes
        copy["headers"]["retries"] = 1  # this run of the body returns
        copy["properties"]["delivery_tag"] = "copy"
        redis_client.lpush("free", json.dumps(copy))
        rerun = [r for r in wait_rows(redis_client, 3) if r not in ended]
    assert [(r["attempt"], r["outcome"]) for r in rerun] == [(1, "ok")]
    assert rerun[0]["deadline_slack_ms"] < 0  # late, judged with the job all the same
    assert redis_client.hget(KEYS.totals, "slack_misses") is None
    assert "slack_miss=true" not in log.read_text()
    assert redis_client.hget(KEYS.flags, "free_path_enabled") != b"false"


def test_a_row_whose_reply_was_lost_is_logged_once_with_its_slack_miss_and_freeze(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The worker's finish wrote the row and counted the miss, and its reply was lost (the
    connection broke): sent again, it is told so, and the log has what the ledger has."""
    finish = redis_client.script_load(load_lua("finish.lua"))  # loaded, as on a running server
    address = redis_client.connection_pool.connection_kwargs
    hole = BlackHole((address.get("host", "127.0.0.1"), int(address.get("port", 6379))))
    hole.lose_reply(finish.encode())  # the worker's gate Redis is reached through the proxy
    log = tmp_path / "w.log"
    sleepy = app_for(redis_url).tasks["tests.sleepy"]
    late = {"headers": {"gatekeeper_deadline_s": 1.3}}  # admitted (dwell 1 s), runs 1.5 s
    try:
        with running_worker(redis_url, log, GATEKEEPER_MISS_MIN_ADMISSIONS="1",
                            GATEKEEPER_REDIS_URL=f"redis://127.0.0.1:{hole.port}/0"):  # fmt: skip
            job = sleepy.apply_async(kwargs={"sleep_s": 1.5}, **late).id
            wait_rows(redis_client, 1)
            wait_until(lambda: "event=free_path_frozen" in log.read_text(), 10)  # the last line
    finally:
        hole.close()
    assert hole.lost == 1  # the finish's reply, after its row
    lines = [line for line in log.read_text().splitlines() if f"job_id={job}" in line]
    assert len([line for line in lines if "event=ledger_row" in line]) == 1, lines
    assert len([line for line in lines if "event=slack_miss" in line]) == 1, lines
    assert redis_client.hget(KEYS.flags, "free_path_enabled") == b"false"
    assert "event=free_path_frozen" in log.read_text()


def test_a_task_revoked_before_it_starts_gives_back_its_exposure_and_has_no_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = app_for(redis_url)
    sleepy = app.tasks["tests.sleepy"]
    with running_worker(redis_url, tmp_path / "w.log"):
        busy = sleepy.apply_async(kwargs={"sleep_s": 5}).id  # the revoke must land before it ends
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        waiting = sleepy.apply_async(kwargs={"sleep_s": 0}).id
        assert redis_client.hexists(KEYS.inflight, f"{waiting}:1")
        app.control.revoke(waiting)
        (row,) = wait_rows(redis_client, 1)  # the busy one's
        assert wait_until(lambda: not redis_client.hexists(KEYS.inflight, f"{waiting}:1"))
    assert row["job_id"] == busy
    assert [r["id"] for r in runs(redis_client)] == [busy]
    assert window_totals(redis_client, "exposure") == 0


def test_a_workers_heartbeat_lives_while_it_runs_and_goes_at_shutdown(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Two keys: the worker process's (``<name>#<process id>``, which its runs name) and its
    name's (which runs an earlier build recorded name); a clean shutdown deletes the first
    (the name may be another live worker's too: it expires)."""
    pattern = KEYS.worker("*")
    with running_worker(redis_url, tmp_path / "w.log"):
        assert wait_until(lambda: len(list(redis_client.scan_iter(match=pattern))) == 2)
        keys = sorted(text_of(key) for key in redis_client.scan_iter(match=pattern))
        name, process = keys
        assert process.startswith(name + "#") and len(process) == len(name) + 9
        for key in keys:
            assert 0 < redis_client.pttl(key) <= 30_000  # three intervals of the default 10 s
    assert [text_of(key) for key in redis_client.scan_iter(match=pattern)] == [name]


def test_a_whole_worker_killed_under_acks_late_loses_nothing_and_rows_each_run_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The main process and its child SIGKILLed mid-run of an ``acks_late`` task: kombu
    restores the unacked message to its queue, a new worker runs it, and the dead run gets
    its ``killed`` row when the redelivered copy starts: one row per run, exposure released."""
    env = {"GATEKEEPER_TEST_VISIBILITY_S": "2"}
    with running_worker(redis_url, tmp_path / "w1.log", **env) as worker:
        job = app_for(redis_url).tasks["tests.late"].delay().id
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        os.kill(runs(redis_client)[0]["pid"], signal.SIGKILL)
        worker.kill()
        worker.wait()
    assert rows(redis_client) == [] and redis_client.hlen("unacked") == 1
    time.sleep(2.5)  # past the visibility timeout: the next worker restores it
    with running_worker(redis_url, tmp_path / "w2.log", **env):
        first, second = wait_rows(redis_client, 2, timeout_s=60)
    assert [r["id"] for r in runs(redis_client)] == [job, job]
    assert (first["outcome"], first["attempt"], first["path"]) == ("killed", 1, "free")
    assert (second["outcome"], second["attempt"]) == ("ok", 1)
    assert window_totals(redis_client, "exposure") == 0 and redis_client.hlen(KEYS.inflight) == 0
    assert redis_client.zcard(KEYS.started) == 0


RETRIES_ON_WORKER_LOST = hasattr(celery.Task, "retry_on_worker_lost")
"""Celery 5.7's ``retry_on_worker_lost``: the main process publishes a retry of a task whose
child died, and sends ``task_retry`` (not ``task_failure``)."""


def test_a_child_killed_under_retry_on_worker_lost_is_one_killed_row_then_its_retry(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = app_for(redis_url)
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, queues="free,reserved"):
        job = app.tasks["tests.lost_retry"].delay().id
        assert wait_until(lambda: len(runs(redis_client)) == 1)
        os.kill(runs(redis_client)[0]["pid"], signal.SIGKILL)
        found = wait_rows(redis_client, 2 if RETRIES_ON_WORKER_LOST else 1)
    shown = [(row["job_id"], row["attempt"], row["outcome"]) for row in found]
    expected = [(job, 1, "killed")] + [(job, 2, "ok")] * RETRIES_ON_WORKER_LOST
    assert shown == expected, log.read_text()
    assert "reason=WorkerLostError" in log.read_text()


def test_a_late_rerun_after_a_cut_record_alerts_with_the_dwell_it_was_admitted_with(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Its first run rejected and requeued (a killed row; the record cut, which drops dwell_s),
    # its copy ends ok after the deadline: the slack-miss alert said dwell_s=nan. SPEC: the
    # alert carries the dwell; the gate's own message (its nonce is the record's) has it.
    log = tmp_path / "w.log"
    late = {"headers": {"gatekeeper_deadline_s": 1.3}}  # admitted (dwell 1 s), runs 2 x 0.8 s
    with running_worker(redis_url, log):
        job = app_for(redis_url).tasks["tests.rejects"].apply_async(kwargs={"sleep_s": 0.8},
                                                                     **late).id  # fmt: skip
        found = wait_rows(redis_client, 2)
    assert [(r["job_id"], r["outcome"]) for r in found] == [(job, "killed"), (job, "ok")]
    (alert,) = [line for line in log.read_text().splitlines() if "slack_miss=true" in line]
    dwell = float(re.search(r" dwell_s=(\S+)", alert).group(1))  # type: ignore[union-attr]
    assert dwell == pytest.approx(1.0, abs=0.2), alert
