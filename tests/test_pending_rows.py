"""A run's row that the gate's Redis did not answer for is sent again until it answers.

A real worker runs a task while the gate's Redis (a server of its own, not the broker) stops
answering for three seconds (``CLIENT PAUSE``) across the run's end: the finish gets no answer
(the client's timeout, twice), is kept by the pool child and sent again once the server
answers. The run gets its one row, ``ok`` as it ended, its exposure is released, and the sweep
after the worker is gone finds nothing to write ``killed``. Gated and unverified runs alike
(gatekeeper/celery/pending.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.celery.pending import PendingRows
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.ops.cli import main
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, initialised, running_worker, unused_port, wait_until
from tests.processes import stopped

pytestmark = pytest.mark.celery
KEYS = Keys()


def rows(client: redis.Redis) -> list[dict[str, Any]]:
    found = []
    for key in sorted(client.scan_iter(match=f"{KEYS.base}:window:*:rows")):
        found += [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    return found


def exposure(client: redis.Redis) -> float:
    return sum(
        float(client.hget(key, "exposure") or 0)
        for key in client.scan_iter(match=f"{KEYS.base}:window:*", _type="hash")
    )


def swept_after_the_worker(gate_url: str, broker_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``gatekeeper sweep`` once the worker's heartbeats are gone (every run counts as stale)."""
    gate = redis.Redis.from_url(gate_url)
    assert wait_until(lambda: not any(gate.scan_iter(match=KEYS.worker("*"))), 20)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", gate_url)
    monkeypatch.setenv("GATEKEEPER_BROKER_URL", broker_url)
    return CliRunner().invoke(main, ["sweep", "--older-than-s", "0"]).output


@pytest.mark.parametrize("verified", [True, False])
def test_a_row_the_gate_did_not_answer_for_as_the_run_ended_is_written_when_it_answers(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    verified: bool,
) -> None:  # fmt: skip
    with EmbeddedRedis() as gate:
        gate_client = redis.Redis.from_url(gate.url)
        initialised(gate_client)
        if verified:  # the gate's decision (free, with a nonce)
            app = create_app(gate_settings(gate.url), redis_url, recorder_url=redis_url)
            queue, counted = "free", lambda job: KEYS.run(job, 1)
        else:  # decided while the gate was unreachable: reserved, no nonce
            down = f"redis://127.0.0.1:{unused_port()}/0"
            app = create_app(gate_settings(down, redis_timeout_s=0.2), redis_url,
                             recorder_url=redis_url)  # fmt: skip
            queue, counted = "reserved", lambda job: KEYS.unverified(job, 1)
        log = tmp_path / "w.log"
        with running_worker(redis_url, log, queues=queue, GATEKEEPER_REDIS_URL=gate.url,
                            GATEKEEPER_TEST_RECORDER_URL=redis_url,
                            GATEKEEPER_WORKER_HEARTBEAT_S="1"):  # fmt: skip
            job = app.tasks["tests.sleepy"].delay(sleep_s=2).id
            assert wait_until(lambda: gate_client.hget(counted(job), "runs") == b"1")
            time.sleep(1.0)
            gate_client.execute_command("CLIENT", "PAUSE", "3000", "ALL")  # the run ends in it
            time.sleep(3.5)
            assert wait_until(lambda: len(rows(gate_client)) == 1, 10), log.read_text()
            time.sleep(1.0)  # a second row, if any, would land now
        text = log.read_text()
        assert "event=ledger_row_pending " in text and "event=ledger_write_failed" not in text
        (written,) = [line for line in text.splitlines() if "ledger_row_pending_written" in line]
        assert f"job_id={job}" in written and "run=1" in written, written
        swept = swept_after_the_worker(gate.url, redis_url, monkeypatch)
        found = rows(gate_client)
        assert [(r["job_id"], r["outcome"], r.get("verified", True)) for r in found] == [
            (job, "ok", verified)
        ], (swept, found)
        assert "swept=0" in swept
        assert exposure(gate_client) == 0
        assert gate_client.zcard(KEYS.started) == gate_client.zcard(KEYS.unverified_started) == 0


def test_a_written_row_whose_freeze_check_gets_no_answer_is_logged_and_alerted_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # A reviewer: the auto-freeze's flag read after a written row got no answer, and the row's
    # write, kept to send again, was sent again: its ledger_row line and slack-miss alert came
    # twice. A written row is not kept; the check says it failed.
    app = create_app(gate_settings(redis_url), redis_url)
    log = tmp_path / "w.log"
    late = {"headers": {"gatekeeper_deadline_s": 1.3}}  # admitted (dwell 1 s), runs 1.5 s
    with running_worker(redis_url, log, GATEKEEPER_MISS_MIN_ADMISSIONS="1",
                        GATEKEEPER_TEST_FREEZE_READ_SILENT="1"):  # fmt: skip
        job = app.tasks["tests.sleepy"].apply_async(kwargs={"sleep_s": 1.5}, **late).id
        assert wait_until(lambda: len(rows(redis_client)) == 1, timeout_s=20)
        time.sleep(2.5)  # a kept call's resend (1 s after), if any
    lines = [ln for ln in log.read_text().splitlines() if f"job_id={job}" in ln]
    assert len([ln for ln in lines if "event=ledger_row " in ln]) == 1, lines
    assert len([ln for ln in lines if "event=slack_miss " in ln]) == 1, lines
    assert [ln for ln in lines if "event=freeze_check_failed" in ln], lines
    assert len(rows(redis_client)) == 1


class Said:
    """A log that keeps its events (the worker's log is a structlog logger)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.events.append(event)


def test_a_resend_under_way_at_exit_is_waited_for_not_logged_lost() -> None:
    # A reviewer: the process's clean exit while the retry thread was sending a kept row (its
    # Redis slow to answer) took the row for lost at once, logged ledger_rows_lost, and never
    # sent what was left. The exit's send now waits for the thread's to end.
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        slow = redis.Redis.from_url(server.url, socket_timeout=2.0)
        said, written = Said(), []

        def write() -> bool:  # a row's write: the pending list keeps it while Redis is silent
            try:
                written.append(slow.incr("row"))
            except redis.RedisError as exc:
                raise LedgerUnavailable("no answer") from exc
            return True

        pending = PendingRows(said, max_interval_s=1.0)
        admin.execute_command("CLIENT", "PAUSE", "4000", "ALL")
        begun = time.monotonic()
        pending.write("job-1", 1, write)  # no answer in 2 s: kept; resent 1 s later, and waits
        assert said.events == ["ledger_row_pending"] and len(pending) == 1
        time.sleep(max(0.0, begun + 3.5 - time.monotonic()))  # the resend waits for the pause
        pending.at_exit()
        assert said.events == ["ledger_row_pending", "ledger_row_pending_written"]
        assert len(pending) == 0 and admin.get("row") == b"1"


def test_a_row_still_unanswered_at_a_clean_exit_is_logged_lost_and_the_sweep_writes_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate's Redis hung (SIGSTOP) from before the run's end until after the worker's
    clean exit: the row kept is tried once more as the pool child exits, then logged
    ``event=ledger_rows_lost`` with its job; once the worker's heartbeat is gone the sweep
    writes the run ``killed``, its one row."""
    with EmbeddedRedis() as gate:
        gate_client = redis.Redis.from_url(gate.url)
        initialised(gate_client)
        app = create_app(gate_settings(gate.url), redis_url, recorder_url=redis_url)
        log = tmp_path / "w.log"
        worker = running_worker(redis_url, log, GATEKEEPER_REDIS_URL=gate.url,
                                GATEKEEPER_TEST_RECORDER_URL=redis_url,
                                GATEKEEPER_WORKER_HEARTBEAT_S="1")  # fmt: skip
        with contextlib.ExitStack() as silent, worker:  # the worker stops first, then the gate
            job = app.tasks["tests.sleepy"].delay(sleep_s=1.5).id
            assert wait_until(lambda: gate_client.hget(KEYS.run(job, 1), "runs") == b"1")
            silent.enter_context(stopped(gate.process))  # the run ends in it, and the worker
            assert wait_until(lambda: "event=ledger_row_pending " in log.read_text(), 15)
        # the worker stopped (a warm shutdown) before the gate answered again
        text = log.read_text()
        (lost,) = [line for line in text.splitlines() if "event=ledger_rows_lost" in line]
        assert all(f in lost.split() for f in (f"job_id={job}", "run=1", "reason=exit")), lost
        assert rows(gate_client) == []
        swept = swept_after_the_worker(gate.url, redis_url, monkeypatch)
        assert "swept=1" in swept, swept
        assert [(r["job_id"], r["outcome"]) for r in rows(gate_client)] == [(job, "killed")]
        assert exposure(gate_client) == 0
