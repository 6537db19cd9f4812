"""RunLedger against a real Redis: one row per run, exposure released once, sweeps, the CLI."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.core.ledger import Outcome, window_id
from gatekeeper.core.service import bucket_of
from gatekeeper.ops.cli import main
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import Finished, RunLedger, RunRecord, Started
from gatekeeper.redis.scripts import load_lua, read_rows
from gatekeeper.redis.store import GateStore
from gatekeeper.redis.sweep import sweep
from tests.conftest import clear_of_a_window_edge, unused_port

KEYS = Keys()
T0_MS = 1_800_000_000_000


def ledger(client: redis.Redis) -> RunLedger:
    return RunLedger(client, KEYS, window_seconds=900, queue_wait_unit_per_second=200)


def record(**changes: object) -> RunRecord:
    values: dict[str, object] = {
        "task": "t", "path": "free", "decision": "admit_free", "published_ms": T0_MS,
        "admitted_ms": T0_MS, "window": window_id(T0_MS / 1000, 900),
        "deadline_ms": T0_MS + 90_000, "tokens_in": 1200, "tokens_out": 50, "dwell_s": 28.0,
        "retries": 0,
    }  # fmt: skip
    values.update(changes)
    return RunRecord(**values)  # type: ignore[arg-type]


def start_run(
    runs: RunLedger, client: redis.Redis, job: str, attempt: int, rec: RunRecord, now_ms: int
) -> Started:
    """Start a run as a worker would, after writing the record the gate writes when it
    decides (the worker trusts only that, through the message's nonce)."""
    nonce = f"nonce-{job}-{attempt}"
    free = rec.path == "free"
    client.hset(KEYS.run(job, attempt), mapping={
        "nonce": nonce, "decision": rec.decision, "window": rec.window if free else "",
        "tokens_in": rec.tokens_in, "admitted_ms": rec.admitted_ms,
        "published_ms": rec.published_ms, "deadline_ms": rec.deadline_ms,
        "dwell_s": rec.dwell_s, "free_admitted": "1" if free or rec.free_admitted else "0",
    })  # fmt: skip
    own = {"task": rec.task, "retries": str(rec.retries), "max_retries": str(rec.max_retries),
           "time_limit_s": str(rec.time_limit_s), "tokens_out": str(rec.tokens_out)}  # fmt: skip
    return runs.start(job, attempt, nonce, own, now_ms)


def admit(client: redis.Redis, member: str, tokens: int) -> None:
    """What gate.lua leaves behind for an admitted free attempt."""
    client.hset(KEYS.inflight, member, tokens)
    client.hincrbyfloat(KEYS.window(window_id(T0_MS / 1000, 900)), "exposure", tokens)


def window_hash(client: redis.Redis, at_ms: int) -> dict[bytes, bytes]:
    return client.hgetall(KEYS.window(window_id(at_ms / 1000, 900)))


def no_slack_miss(client: redis.Redis) -> bool:
    """No slack miss counted, in the lifetime totals nor in the admission's window."""
    window = int(window_hash(client, T0_MS).get(b"slack_misses") or 0)
    return client.hget(KEYS.totals, "slack_misses") is None and window == 0


def test_the_worked_vector_through_the_run_ledger(redis_client: redis.Redis) -> None:
    runs = ledger(redis_client)
    admit(redis_client, "job:1", 1200)
    started = start_run(runs, redis_client, "job", 1, record(), T0_MS + 2100)
    assert (started.run, started.dead) == (1, None)
    stored = runs.record("job", 1)
    assert stored is not None
    run, rec = stored
    row = runs.row_for("job", 1, rec, Outcome.KILLED, T0_MS + 3000)
    assert (row.queue_wait_ms, row.tokens_in, row.retry_tax) == (2100, 1200, 1620)
    assert runs.finish(row, run, rec, T0_MS + 3000).written
    state = window_hash(redis_client, T0_MS)
    assert float(state[b"tax_units"]) == 1620 and float(state[b"exposure"]) == 0
    assert int(state[b"rows:killed"]) == 1


def test_a_free_row_is_charged_the_wait_since_its_admission_not_its_time_parked_in_defer(
    redis_client: redis.Redis,
) -> None:
    """Published at T0, parked in defer a minute, replayed and admitted to free at T0+60 s,
    started 1 s later: its row records the whole wait, and is charged the second on free."""
    runs = ledger(redis_client)
    admit(redis_client, "job:1", 1200)
    replayed = record(admitted_ms=T0_MS + 60_000, deadline_ms=T0_MS + 190_000)
    start_run(runs, redis_client, "job", 1, replayed, T0_MS + 61_000)
    _, rec = runs.record("job", 1) or (0, record())
    row = runs.row_for("job", 1, rec, Outcome.KILLED, T0_MS + 62_000)
    assert (row.queue_wait_ms, row.tokens_in, row.retry_tax) == (61_000, 1200, 1400)


def test_a_second_finish_of_the_same_run_writes_nothing(redis_client: redis.Redis) -> None:
    runs = ledger(redis_client)
    admit(redis_client, "job:1", 1200)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 100)
    _, rec = runs.record("job", 1) or (0, record())
    row = runs.row_for("job", 1, rec, Outcome.KILLED, T0_MS + 200)
    assert runs.finish(row, 1, rec, T0_MS + 200).written
    assert not runs.finish(row, 1, rec, T0_MS + 300).written
    assert len(read_rows(redis_client, KEYS, window_id(T0_MS / 1000, 900))) == 1
    state = window_hash(redis_client, T0_MS)
    assert float(state[b"exposure"]) == 0 and float(state[b"tax_units"]) == 1220


def test_a_second_start_without_a_row_reveals_the_dead_run(redis_client: redis.Redis) -> None:
    runs = ledger(redis_client)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 100)
    again = start_run(runs, redis_client, "job", 1, record(), T0_MS + 60_000)
    assert (again.run, again.dead_run) == (2, 1)
    assert again.dead is not None and again.dead.started_ms == T0_MS + 100


def test_a_second_start_after_a_row_is_just_another_run(redis_client: redis.Redis) -> None:
    runs = ledger(redis_client)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 100)
    _, rec = runs.record("job", 1) or (0, record())
    runs.finish(runs.row_for("job", 1, rec, Outcome.KILLED, T0_MS + 200), 1, rec, T0_MS + 200)
    again = start_run(runs, redis_client, "job", 1, record(), T0_MS + 300)
    assert (again.run, again.dead) == (2, None)


def test_a_dead_runs_row_overtaken_by_its_redelivered_runs_row_is_still_written_once(
    redis_client: redis.Redis,
) -> None:
    """A reviewer: the dead run's row (written at the redelivered copy's start) got no answer
    and was kept to send again; the redelivered run's own row came first, and the dead run's
    was then refused for good (`rowed` read as a high-water mark). Each run has its row."""
    runs = ledger(redis_client)
    admit(redis_client, "job:1", 1200)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 100)
    again = start_run(runs, redis_client, "job", 1, record(), T0_MS + 60_000)
    assert (again.run, again.dead_run) == (2, 1) and again.dead is not None
    _, rec = runs.record("job", 1) or (0, record())
    latest = runs.row_for("job", 1, rec, Outcome.OK, T0_MS + 70_000)
    dead = runs.row_for("job", 1, again.dead, Outcome.KILLED, T0_MS + 60_000)
    assert runs.finish(latest, 2, rec, T0_MS + 70_000, token="t2").written  # overtakes
    first, resent, other = (
        runs.finish(dead, 1, again.dead, T0_MS + 80_000, current=False, token=token)
        for token in ("t1", "t1", "t3")
    )
    assert first.written and resent == first and not other.written
    written = read_rows(redis_client, KEYS, window_id(T0_MS / 1000, 900))
    assert sorted(row["outcome"] for row in written) == ["killed", "ok"]
    assert runs.finish(latest, 2, rec, T0_MS + 90_000, token="t2").written  # its reply kept
    assert not runs.finish(dead, 1, again.dead, T0_MS + 90_000, current=False).written
    # Its reply, for that call sent again: written after run 2's row closed the reservation,
    # it was charged nothing (the tax written, 0, follows the token).
    assert redis_client.hget(KEYS.run("job", 1), "owed") == b",1=t1|0|0,"
    assert float(window_hash(redis_client, T0_MS)[b"exposure"]) == 0


def test_reserved_rows_are_recorded_but_not_charged(redis_client: redis.Redis) -> None:
    runs = ledger(redis_client)
    rec = record(path="reserved", decision="reserved", started_ms=T0_MS + 100)
    row = runs.row_for("job", 1, rec, Outcome.KILLED, T0_MS + 200)
    assert runs.finish(row, 1, rec, T0_MS + 200).written
    assert b"tax_units" not in window_hash(redis_client, T0_MS)


@pytest.mark.parametrize("path", ["free", "reserved"])
def test_a_rows_exposure_goes_back_to_the_window_its_entry_names_only_while_it_exists(
    redis_client: redis.Redis, path: str
) -> None:
    """The in-flight entry gate.lua writes names the window that holds the reservation: a
    run's row gives the exposure back there, free row or reserved (an entry still held for a
    run decided reserved), and never to a window gone past its retention (finish.lua made
    it again with the exposure negative, and a reserved row's with no TTL: a known gap
    until 2026-12-08)."""
    runs = ledger(redis_client)
    admitted = window_id(T0_MS / 1000, 900)
    later_ms = T0_MS + 1_000_000  # the row in a later window than the admission's
    for job in ("kept", "gone"):
        redis_client.hset(KEYS.inflight, f"{job}:1", f"1200|{admitted}|{T0_MS}|pad")
        redis_client.hincrbyfloat(KEYS.window(admitted), "exposure", 1200)
        decided = record(path=path, decision="admit_free" if path == "free" else "reserved")
        start_run(runs, redis_client, job, 1, decided, T0_MS + 100)
        redis_client.hset(KEYS.run(job, 1), "window", admitted)
    for job in ("kept", "gone"):
        if job == "gone":
            redis_client.delete(KEYS.window(admitted))  # past its retention
        run, rec = runs.record(job, 1) or (0, record())
        row = runs.row_for(job, 1, rec, Outcome.KILLED, later_ms)
        assert runs.finish(row, run, rec, later_ms).written
        assert not redis_client.hexists(KEYS.inflight, f"{job}:1")
        if job == "kept":  # (the other job's reservation still held)
            assert float(redis_client.hget(KEYS.window(admitted), "exposure")) == 1200
    if path == "free":  # the free row's window, made again by the row, under its TTL
        assert b"exposure" not in window_hash(redis_client, T0_MS)
        assert redis_client.ttl(KEYS.window(admitted)) > 0
    else:
        assert not redis_client.exists(KEYS.window(admitted))
    assert b"exposure" not in window_hash(redis_client, later_ms)
    # An entry that names another window than the record's: that one gets it back.
    elsewhere = admitted + 5
    redis_client.hset(KEYS.window(elsewhere), "exposure", 700)
    redis_client.hset(KEYS.inflight, "moved:1", f"700|{elsewhere}|{T0_MS}|pad")
    start_run(runs, redis_client, "moved", 1, decided, T0_MS + 100)
    redis_client.hset(KEYS.run("moved", 1), "window", admitted)
    run, rec = runs.record("moved", 1) or (0, record())
    assert runs.finish(runs.row_for("moved", 1, rec, Outcome.OK, later_ms), run, rec,
                       later_ms).written  # fmt: skip
    assert float(redis_client.hget(KEYS.window(elsewhere), "exposure")) == 0
    assert b"exposure" not in redis_client.hgetall(KEYS.window(admitted))


def test_sweep_records_only_stale_runs(redis_client: redis.Redis) -> None:
    runs = ledger(redis_client)
    start_run(runs, redis_client, "old", 1, record(), T0_MS)
    start_run(runs, redis_client, "new", 1, record(), T0_MS + 50_000)
    swept = sweep(runs, T0_MS + 60_000, older_than_s=30)
    assert [(row.job_id, row.outcome, verified) for row, verified in swept] == [
        ("old", Outcome.KILLED, True)
    ]
    assert sweep(runs, T0_MS + 60_000, older_than_s=30) == []


def test_sweep_says_the_rows_it_wrote_when_the_broker_cannot_be_read(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweep writes its killed rows, then asks the broker for purged admissions. With the
    # broker down it exited 1 with the broker's error alone: the rows written (and taxed) were
    # never said, and the error did not say it was the broker's (an audit).
    now_ms = round(time.time() * 1000)
    hour_ago = now_ms - 3_600_000
    runs = ledger(redis_client)
    rec = record(published_ms=hour_ago - 1000, admitted_ms=hour_ago - 1000,
                 window=window_id(hour_ago / 1000, 900), deadline_ms=now_ms + 90_000)  # fmt: skip
    start_run(runs, redis_client, "vanished", 1, rec, hour_ago)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    monkeypatch.setenv("GATEKEEPER_BROKER_URL", f"redis://127.0.0.1:{unused_port()}/0")
    result = CliRunner().invoke(main, ["sweep"])
    assert result.exit_code == 1, result.output
    said = result.output  # stdout and stderr: the row's line, then the error
    (line,) = [ln for ln in said.splitlines() if "event=ledger_row" in ln]
    assert "job_id=vanished attempt=1 reason=vanished" in line and "outcome=killed" in line
    assert "Error: swept=1, then the broker could not be read for purged admissions" in said
    assert runs.record("vanished", 1) is not None and not sweep(runs, now_ms, 60)  # rowed once


def test_ledger_command_prints_the_summary_and_writes_the_rows(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = ledger(redis_client)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 2100)
    _, rec = runs.record("job", 1) or (0, record())
    runs.finish(runs.row_for("job", 1, rec, Outcome.KILLED, T0_MS + 3000), 1, rec, T0_MS + 3000)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    out = tmp_path / "ledger.json"
    ident = str(window_id(T0_MS / 1000, 900))
    result = CliRunner().invoke(main, ["ledger", "--window", ident, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "finished=0 killed_rows=1 rejected=0 abandoned=0 budget_left=10380",
        f"wrote {out}",
    ]
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["job_id"], row["retry_tax"]) == ("job", 1620)


def test_ledger_command_reads_the_current_window_by_default_and_the_previous_when_asked(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runbook's page attachment (``--window previous``): a killed row of the window
    before this one, an ok row of this one; each command shows its own."""
    clear_of_a_window_edge(900, 10)
    now_ms = round(time.time() * 1000)
    runs = ledger(redis_client)
    for job, at_ms, outcome in (("before", now_ms - 900_000, Outcome.KILLED),
                                ("now", now_ms, Outcome.OK)):  # fmt: skip
        rec = record(published_ms=at_ms - 5000, admitted_ms=at_ms - 5000,
                     window=window_id(at_ms / 1000, 900), deadline_ms=at_ms + 90_000)  # fmt: skip
        start_run(runs, redis_client, job, 1, rec, at_ms - 2000)
        _, rec = runs.record(job, 1) or (0, rec)
        runs.finish(runs.row_for(job, 1, rec, outcome, at_ms), 1, rec, at_ms)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    shown = {}
    for args in ([], ["--window", "previous"], ["--window", "current"]):
        out = tmp_path / f"ledger{len(shown)}.json"
        result = CliRunner().invoke(main, ["ledger", *args, "--json", str(out)])
        assert result.exit_code == 0, result.output
        rows = json.loads(out.read_text())["rows"]
        shown[" ".join(args)] = (result.stdout.split()[:2], [row["job_id"] for row in rows])
    assert shown == {
        "": (["finished=1", "killed_rows=0"], ["now"]),
        "--window previous": (["finished=0", "killed_rows=1"], ["before"]),
        "--window current": (["finished=1", "killed_rows=0"], ["now"]),
    }


def test_ledger_command_names_a_bad_window(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["ledger", "--window", "yesterday"])
    assert result.exit_code == 2 and "--window" in result.output


def test_sweep_gives_back_the_exposure_of_an_admission_that_never_started(
    redis_client: redis.Redis,
) -> None:
    """Past ``older_than_s`` and past the gate's horizon (when gate.lua stops counting it,
    300 s here): an admission still within the horizon may be waiting in the queue, and
    keeps what it reserved whatever ``--older-than-s`` says (0 included)."""
    window = window_id(T0_MS / 1000, 900)
    redis_client.hset(KEYS.inflight, "lost:1", f"1200|{window}|{T0_MS}")
    redis_client.hset(KEYS.window(window), "exposure", 1700)
    redis_client.hset(KEYS.inflight, "waiting:1", f"500|{window}|{T0_MS + 200_000}")
    store = GateStore(redis_client, KEYS, horizon_s=300)
    sweep(ledger(redis_client), T0_MS + 400_000, older_than_s=0, store=store)
    assert redis_client.hkeys(KEYS.inflight) == [b"waiting:1"]
    assert float(redis_client.hget(KEYS.window(window), "exposure") or 0) == 500


def test_a_run_after_the_attempt_has_its_row_is_counted_as_a_rerun(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 100)
    _, rec = runs.record("job", 1) or (0, record())
    runs.finish(runs.row_for("job", 1, rec, Outcome.OK, T0_MS + 200), 1, rec, T0_MS + 200)
    start_run(
        runs, redis_client, "job", 1, record(), T0_MS + 300
    )  # delivered again after it finished
    assert redis_client.hget(KEYS.stats, "reruns_after_row") == b"1"


def first_run(
    runs: RunLedger, client: redis.Redis, outcome: Outcome, ends: bool = False,
    went_on: bool = False,
) -> Finished:  # fmt: skip
    """An admitted attempt's first run, ended at once (well before its deadline)."""
    admit(client, "job:1", 1200)
    start_run(runs, client, "job", 1, record(), T0_MS + 100)
    _, rec = runs.record("job", 1) or (0, record())
    row = runs.row_for("job", 1, rec, outcome, T0_MS + 200)
    return runs.finish(row, 1, rec, T0_MS + 200, ends=ends, went_on=went_on)


def ok_late(runs: RunLedger, at_ms: int) -> Finished:
    """The attempt's latest run, started at ``at_ms`` and ended ok 100 ms later, past its
    deadline (a slack miss as the worker sees it)."""
    run, rec = runs.record("job", 1) or (0, record())
    row = runs.row_for("job", 1, rec, Outcome.OK, at_ms + 100)
    return runs.finish(row, run, rec, at_ms + 100, slack_miss=True)


def test_a_rerun_after_the_attempts_ok_row_is_no_slack_miss_even_when_late(
    redis_client: redis.Redis,
) -> None:
    """A lost ack: the job finished in time, its message ran again after the deadline."""
    runs = ledger(redis_client)
    on_time = first_run(runs, redis_client, Outcome.OK)
    assert on_time.written and not on_time.slack_miss
    runs.start("job", 1, "nonce-job-1", {"task": "t"}, T0_MS + 120_000)  # a redelivery's start
    rerun = ok_late(runs, T0_MS + 120_000)
    assert rerun.written and not rerun.slack_miss
    assert no_slack_miss(redis_client)


def test_a_new_publish_of_the_attempt_after_its_ok_row_that_ends_late_is_a_slack_miss(
    redis_client: redis.Redis,
) -> None:
    """Not a rerun: the gate decided the attempt again (its record's fields written anew)."""
    runs = ledger(redis_client)
    first_run(runs, redis_client, Outcome.OK)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 120_000)  # published again
    done = ok_late(runs, T0_MS + 120_000)
    assert done.written and done.slack_miss
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"


def test_a_redelivery_after_a_killed_row_that_ends_late_is_one_slack_miss_reruns_none(
    redis_client: redis.Redis,
) -> None:
    """The sweep wrote the run killed (its worker gone); the message ran again, late: the
    job's only finish missed its deadline. A lost ack then runs it a third time: no miss."""
    runs = ledger(redis_client)
    first_run(runs, redis_client, Outcome.KILLED)
    for at_ms, missed in ((T0_MS + 120_000, True), (T0_MS + 200_000, False)):
        runs.start("job", 1, "nonce-job-1", {"task": "t"}, at_ms)  # a redelivery's start
        done = ok_late(runs, at_ms)
        assert done.written and done.slack_miss is missed
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"


def test_a_late_ok_row_after_the_cut_ends_the_job_so_a_late_rerun_is_no_slack_miss(
    redis_client: redis.Redis,
) -> None:
    """A reviewer: run 1 ended ok in time, its row kept (no answer); its redelivered copy,
    run 2, was killed and requeued, and its row cut the record with the job not ended. Run
    1's row then came, late: the job had ended, in time, so a third copy ending past the
    deadline is a rerun, no slack miss (`kept` did not say the job ended)."""
    runs = ledger(redis_client)
    admit(redis_client, "job:1", 1200)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 100)
    again = start_run(runs, redis_client, "job", 1, record(), T0_MS + 60_000)
    assert again.dead is not None
    _, rec = runs.record("job", 1) or (0, record())
    killed = runs.row_for("job", 1, rec, Outcome.KILLED, T0_MS + 70_000)
    assert runs.finish(killed, 2, rec, T0_MS + 70_000).written  # requeued: the job goes on
    assert not redis_client.hget(KEYS.run("job", 1), "kept").endswith(b"|ok")  # type: ignore[union-attr]
    ok = runs.row_for("job", 1, again.dead, Outcome.OK, T0_MS + 200)
    late = runs.finish(ok, 1, again.dead, T0_MS + 200, current=False, ends=True)
    assert late.written and not late.slack_miss
    assert redis_client.hget(KEYS.run("job", 1), "kept").endswith(b"|ok")  # type: ignore[union-attr]
    runs.start("job", 1, "nonce-job-1", {"task": "t"}, T0_MS + 120_000)  # a third copy
    rerun = ok_late(runs, T0_MS + 120_000)
    assert rerun.written and not rerun.slack_miss
    assert no_slack_miss(redis_client)


def test_a_rerun_after_a_late_final_failure_counts_no_second_miss(
    redis_client: redis.Redis,
) -> None:
    """A free attempt failed for good after its deadline: the job's miss. Copies of its
    message then ran (a lost ack): one lost and requeued (no end of the job), one failed for
    good late again, one ok late: the miss stays one (a reviewer found the second counted
    once a row in between had not ended the job)."""
    runs = ledger(redis_client)
    admit(redis_client, "job:1", 1200)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 100)
    for at_ms, outcome, ends, missed in (
        (T0_MS + 120_000, Outcome.KILLED, True, True),
        (T0_MS + 200_000, Outcome.KILLED, False, False),
        (T0_MS + 300_000, Outcome.KILLED, True, False),
        (T0_MS + 400_000, Outcome.OK, True, False),
    ):
        if at_ms > T0_MS + 120_000:
            runs.start("job", 1, "nonce-job-1", {"task": "t"}, at_ms)  # a copy's start
        run, rec = runs.record("job", 1) or (0, record())
        row = runs.row_for("job", 1, rec, outcome, at_ms + 100)
        done = runs.finish(row, run, rec, at_ms + 100, slack_miss=ends, ends=ends)
        assert done.written and done.slack_miss is missed
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"
    assert int(window_hash(redis_client, T0_MS).get(b"slack_misses") or 0) == 1


def test_a_rerun_after_a_final_failure_in_time_is_no_slack_miss_even_when_late(
    redis_client: redis.Redis,
) -> None:
    """The job failed for good in time (its end); a copy that ran again late is a rerun, as
    after an ``ok`` row."""
    runs = ledger(redis_client)
    failed = first_run(runs, redis_client, Outcome.KILLED, ends=True)
    assert failed.written and not failed.slack_miss
    runs.start("job", 1, "nonce-job-1", {"task": "t"}, T0_MS + 120_000)  # a copy's start
    rerun = ok_late(runs, T0_MS + 120_000)
    assert rerun.written and not rerun.slack_miss
    assert no_slack_miss(redis_client)


def retried_first_run(client: redis.Redis) -> RunLedger:
    """An admitted attempt whose first run asked for a retry (its row ``went_on``)."""
    runs = ledger(client)
    assert first_run(runs, client, Outcome.KILLED, went_on=True).written
    return runs


def test_a_copy_of_an_attempt_that_retried_is_no_slack_miss_its_next_attempt_judges_the_job(
    redis_client: redis.Redis,
) -> None:
    """The attempt's run asked for a retry (the job went on in attempt 2, judged there); a
    copy of its message that ran later, past the deadline, ok or failed for good, is no miss:
    ``kept`` ends in ``|on1``. A run requeued within the attempt (the job goes on in it) is
    still judged (the test of a redelivery after a killed row above)."""
    runs = retried_first_run(redis_client)
    assert redis_client.hget(KEYS.run("job", 1), "kept").endswith(b"|on1")  # type: ignore[union-attr]
    for at_ms, outcome in ((T0_MS + 120_000, Outcome.KILLED), (T0_MS + 200_000, Outcome.OK)):
        runs.start("job", 1, "nonce-job-1", {"task": "t"}, at_ms)  # a copy's start
        run, rec = runs.record("job", 1) or (0, record())
        row = runs.row_for("job", 1, rec, outcome, at_ms + 100)
        done = runs.finish(row, run, rec, at_ms + 100, slack_miss=True, ends=True)
        assert done.written and not done.slack_miss
    assert no_slack_miss(redis_client)


def test_a_late_row_of_a_copy_started_after_the_retrys_row_is_no_slack_miss_either(
    redis_client: redis.Redis,
) -> None:
    """A reviewer: run 1 retried (``|on1``); copies ran as runs 2 and 3, both ok past
    the deadline; run 3's row came first, run 2's late (kept while Redis was silent). Both
    started after the retry's row: neither is a miss, in whichever order their rows come."""
    runs = retried_first_run(redis_client)
    copies = {}
    for run, at_ms in ((2, T0_MS + 100_000), (3, T0_MS + 110_000)):
        runs.start("job", 1, "nonce-job-1", {"task": "t"}, at_ms)
        started, copies[run] = runs.record("job", 1) or (0, record())
        assert started == run
    late = {"slack_miss": True, "ends": True}
    third = runs.finish(runs.row_for("job", 1, copies[3], Outcome.OK, T0_MS + 111_000), 3,
                        copies[3], T0_MS + 111_000, **late)  # fmt: skip
    second = runs.finish(runs.row_for("job", 1, copies[2], Outcome.OK, T0_MS + 105_000), 2,
                         copies[2], T0_MS + 105_000, current=False, **late)  # fmt: skip
    assert third.written and second.written
    assert not third.slack_miss and not second.slack_miss
    assert no_slack_miss(redis_client)


@pytest.mark.parametrize("retry_first", [True, False], ids=["retry_row_first", "late_row_first"])
def test_a_late_end_of_the_job_kept_past_a_copys_retry_is_one_slack_miss_whatever_the_order(
    redis_client: redis.Redis, retry_first: bool
) -> None:
    """A reviewer: run 1 ended ok past the deadline (the job's end: a miss), its row kept
    (Redis gave no answer); a copy, run 2, asked for a retry, and its row cut the record
    ``|on``. Run 1's row, late (``owed``), is still the miss it would have been first."""
    runs = ledger(redis_client)
    admit(redis_client, "job:1", 1200)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 100)
    copy = runs.start("job", 1, "nonce-job-1", {"task": "t"}, T0_MS + 95_000)
    assert copy.dead is not None
    _, rec = runs.record("job", 1) or (0, record())
    ok = runs.row_for("job", 1, copy.dead, Outcome.OK, T0_MS + 91_000)  # deadline: 90 s
    retry = runs.row_for("job", 1, rec, Outcome.KILLED, T0_MS + 96_000)
    late = {"current": False, "slack_miss": True, "ends": True}
    rows = [
        lambda: runs.finish(retry, 2, rec, T0_MS + 96_000, went_on=True),
        lambda: runs.finish(ok, 1, copy.dead, T0_MS + 91_000, **late),
    ]
    for write in rows if retry_first else rows[::-1]:
        assert write().written
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"


def test_a_window_made_again_by_a_late_row_gets_no_exposure_back_from_anything(
    redis_client: redis.Redis,
) -> None:
    """A reviewer: a window gone past its retention, made again by one attempt's free row
    (its tax and rows, no exposure), exists: release.lua and unscore.lua, asking whether it
    existed, gave exposure back to it (negative), and a later row then found it held. Every
    script asks whether it still holds an exposure."""
    runs = ledger(redis_client)
    admitted = window_id(T0_MS / 1000, 900)
    for job, amount in (("a", 1200), ("b", 300), ("c", 400), ("d", 500)):
        redis_client.hset(KEYS.inflight, f"{job}:1", f"{amount}|{admitted}|{T0_MS}|pad")
        redis_client.hincrbyfloat(KEYS.window(admitted), "exposure", amount)
    redis_client.hincrby(KEYS.window(admitted), "admitted_free", 4)
    for job in ("a", "d"):
        start_run(runs, redis_client, job, 1, record(), T0_MS + 100)
    redis_client.delete(KEYS.window(admitted))  # past its retention, all four held
    run, rec = runs.record("a", 1) or (0, record())
    assert runs.finish(runs.row_for("a", 1, rec, Outcome.OK, T0_MS + 200), run, rec,
                       T0_MS + 200).written  # fmt: skip
    redis_client.hset(KEYS.run("b", 1), mapping={"nonce": "n-b", "charged": "0"})
    unscore = redis_client.register_script(load_lua("unscore.lua"))
    keys = [KEYS.run("b", 1), KEYS.inflight, KEYS.free_waiting, KEYS.window(admitted)]
    assert unscore(keys=keys, args=["n-b", "msg", "", "b:1", "1", "0"]) == 1
    assert GateStore(redis_client, KEYS).release("c", 1, admitted, unpublished=True) == 400
    run, rec = runs.record("d", 1) or (0, record())
    assert runs.finish(runs.row_for("d", 1, rec, Outcome.OK, T0_MS + 300), run, rec,
                       T0_MS + 300).written  # fmt: skip
    again = window_hash(redis_client, T0_MS)
    assert b"exposure" not in again and b"admitted_free" not in again
    assert again[b"rows:ok"] == b"2" and not redis_client.hgetall(KEYS.inflight)


def test_a_free_jobs_retry_that_went_to_reserved_and_ended_late_is_a_miss_of_its_admission(
    redis_client: redis.Redis,
) -> None:
    """SPEC: a free-admitted job that finishes after its deadline is a slack miss, whichever
    path its last attempt ran on (a reviewer: the retry's reserved row counted none). It is
    attempt 1's admission's miss, counted in its window and marked on its record (owner.py)."""
    runs = retried_first_run(redis_client)  # attempt 1, admitted to free, asked for a retry
    retry = record(path="reserved", decision="reserved", window=0, free_admitted=True)
    late_ms = T0_MS + 3_600_000  # past the deadline, in a later window than the admission's
    start_run(runs, redis_client, "job", 2, retry, late_ms)
    run, rec = runs.record("job", 2) or (0, record())
    assert rec.free_admitted and rec.window == 0
    done = runs.finish(runs.row_for("job", 2, rec, Outcome.OK, late_ms + 100), run, rec,
                       late_ms + 100, slack_miss=True, ends=True)  # fmt: skip
    assert done.written and done.slack_miss
    assert done.window == window_id(T0_MS / 1000, 900) and done.slack_misses == 1
    assert window_hash(redis_client, T0_MS)[b"slack_misses"] == b"1"
    assert b"slack_misses" not in window_hash(redis_client, late_ms)  # not the row's window
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"
    assert redis_client.hget(KEYS.run("job", 1), "missed") == b"job:2"
    assert not redis_client.exists(KEYS.window(0))


def test_a_finish_sent_again_with_its_token_is_told_its_row_its_capped_tax_and_its_miss(
    redis_client: redis.Redis,
) -> None:
    """Its reply was lost: the same call again (its token) gets that reply, for the worker to
    log; another call for the run (a signal fired twice: another token) is told nothing."""
    runs = ledger(redis_client)
    admit(redis_client, "job:1", 1200)
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 9000)  # a wait taxed 1800
    redis_client.hset(KEYS.run("job", 1), "reserved", 1000)  # what the admission reserved
    run, rec = runs.record("job", 1) or (0, record())
    row = runs.row_for("job", 1, rec, Outcome.OK, T0_MS + 120_000)
    first, again, other = (
        runs.finish(row, run, rec, T0_MS + 120_000, slack_miss=True, token=token)
        for token in ("t1", "t1", "t2")
    )
    assert row.retry_tax == 1800  # more than the reservation: written capped
    window = window_id(T0_MS / 1000, 900)
    assert first == again == Finished(True, 1, 0, 1000.0, slack_miss=True, window=window)
    assert not other.written
    assert len(read_rows(redis_client, KEYS, window_id(T0_MS / 1000, 900))) == 1
    assert redis_client.hget(KEYS.totals, "slack_misses") == b"1"


def test_a_row_that_counts_adds_its_run_to_the_tasks_buckets_in_the_same_step_once(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    admit(redis_client, "job:1", 1200)
    start_run(runs, redis_client, "job", 1, record(task="tasks.embed"), T0_MS + 100)
    _, rec = runs.record("job", 1) or (0, record())
    row = runs.row_for("job", 1, rec, Outcome.KILLED, T0_MS + 30_100)
    assert runs.finish(row, 1, rec, T0_MS + 30_100, service_s=30.0, lower_bound=True).written
    assert not runs.finish(row, 1, rec, T0_MS + 30_200, service_s=30.1, lower_bound=True).written
    stored = redis_client.hgetall(KEYS.service("tasks.embed"))
    assert stored == {f"b{bucket_of(30.0)}".encode(): b"1", b"lower_bounds": b"1"}
    assert redis_client.smembers(KEYS.service_tasks) == {b"tasks.embed"}
    assert redis_client.ttl(KEYS.service("tasks.embed")) == -1


def test_a_row_that_does_not_count_leaves_the_learned_service_times_alone(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    start_run(runs, redis_client, "job", 1, record(task="tasks.embed"), T0_MS + 100)
    _, rec = runs.record("job", 1) or (0, record())
    assert runs.finish(runs.row_for("job", 1, rec, Outcome.OK, T0_MS + 200), 1, rec,
                       T0_MS + 200).written  # fmt: skip
    assert not redis_client.exists(KEYS.service("tasks.embed"), KEYS.service_tasks)


def test_runs_start_and_finish_after_the_server_forgot_the_scripts(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    assert runs.line is not None  # the worker's own line, as the gate script's
    start_run(runs, redis_client, "job", 1, record(), T0_MS + 100)
    redis_client.script_flush()
    started = start_run(runs, redis_client, "job", 2, record(), T0_MS + 100)
    redis_client.script_flush()
    assert started.record is not None
    row = runs.row_for("job", 2, started.record, Outcome.OK, T0_MS + 200)
    assert runs.finish(row, started.run, started.record, T0_MS + 200).written


def test_a_client_of_one_connection_starts_and_finishes_runs_through_redis_py(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url, single_connection_client=True)
    runs = ledger(client)
    assert runs.line is None
    started = start_run(runs, client, "job", 1, record(), T0_MS + 100)
    assert started.record is not None
    row = runs.row_for("job", 1, started.record, Outcome.OK, T0_MS + 200)
    assert runs.finish(row, started.run, started.record, T0_MS + 200).written
    client.close()


def test_a_start_reads_back_the_record_as_stored_before_and_after_its_row(
    redis_client: redis.Redis,
) -> None:
    """start.lua sends back only the gate's fields of the record, the start adds its own: the
    record a run gets must still be the one stored, every field (GATE in start.lua misses
    none), for a live record and for one cut after its row (gatekeeper/redis/kept.py)."""
    runs = ledger(redis_client)
    window = window_id(T0_MS / 1000, 900)
    redis_client.hset(KEYS.run("job", 1), mapping={  # every field gate.lua writes, none default
        "nonce": "n1", "decision": "admit_free", "reason": "fits", "window": window,
        "tokens_in": 1200, "admitted_ms": T0_MS + 7, "published_ms": T0_MS + 3,
        "deadline_ms": T0_MS + 90_000, "dwell_s": "28.5", "free_admitted": "1",
        "reserved": "1234.5", "prev_nonce": "n0", "label": "nightly",
    })  # fmt: skip
    own = {"task": "t", "retries": "2", "max_retries": "5", "time_limit_s": "30.0",
           "tokens_out": "77", "worker": "w@host"}  # fmt: skip
    first = runs.start("job", 1, "n1", own, T0_MS + 100)
    stored = runs.record("job", 1)
    assert stored is not None and first.record == stored[1]
    assert first.record.reserved == 1234.5 and first.record.worker == "w@host"
    row = runs.row_for("job", 1, first.record, Outcome.OK, T0_MS + 200)
    assert runs.finish(row, 1, first.record, T0_MS + 200).written
    again = runs.start("job", 1, "n1", {**own, "worker": "v@host"}, T0_MS + 300)
    stored = runs.record("job", 1)  # dwell_s is dropped from a cut record: nan, not equal
    assert stored is not None and again.record is not None
    assert math.isnan(again.record.dwell_s) and math.isnan(stored[1].dwell_s)
    assert replace(again.record, dwell_s=0) == replace(stored[1], dwell_s=0)
    assert again.record.published_ms == T0_MS + 3 and again.record.worker == "v@host"


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "abc"])
def test_sweep_names_a_bad_older_than_s(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["sweep", "--older-than-s", value])
    assert result.exit_code == 2 and "--older-than-s" in result.output, result.output
