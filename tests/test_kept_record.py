"""A run record cut after its row (gatekeeper/redis/kept.py): a finished attempt keeps only
what later reads need, and what comes after its row (a redelivery, a signal fired twice, a
forged copy) is recorded as it was before the cut. Real Redis, real scripts."""

from __future__ import annotations

from dataclasses import replace

import redis

from gatekeeper.core.ledger import BudgetMode, LedgerRow, Outcome
from gatekeeper.defaults import RECORD_RETENTION_S
from gatekeeper.redis.kept import OWN_FIELDS
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger, RunRecord
from gatekeeper.redis.scripts import read_rows
from gatekeeper.redis.store import GateStore
from tests.calls import gate_call

KEYS = Keys()
NOW = 1_800_000_000.0
WINDOW = 7
OWN = {"task": "t", "retries": "0", "max_retries": "3", "time_limit_s": "0.0",
       "tokens_out": "50", "worker": "w1"}  # fmt: skip
CUT = {"nonce", "decision", "reason", "free_admitted", "runs", "rowed", "rowed_by", "kept"}
COMPACT = {b"ziplist", b"listpack"}


def ms(seconds: float) -> int:
    return round(seconds * 1000)


def ledger(client: redis.Redis) -> RunLedger:
    return RunLedger(client, KEYS, window_seconds=900, queue_wait_unit_per_second=200,
                     wait_allowance_s=10)  # fmt: skip


def admitted(client: redis.Redis, job: str, at: float = NOW) -> str:
    """gate.lua admits ``job`` to free at ``at`` (its record, exposure and TTL); its nonce."""
    call = gate_call(at, window_id=WINDOW, job_id=job, tokens_in=1200, budget_units=1e9,
                     queue_wait_unit_per_second=200, wait_allowance_s=10, deadline_slack_s=90,
                     budget_mode=BudgetMode.EXPOSURE)  # fmt: skip
    assert GateStore(client, KEYS).score(call).decision.value == "admit_free"
    return call.nonce


def run_once(runs: RunLedger, job: str, nonce: str, at: float, outcome: Outcome) -> RunRecord:
    """Start and end one run of ``job`` (attempt 1) as a worker does; its record at start."""
    started = runs.start(job, 1, nonce, OWN, ms(at))
    assert started.record is not None and started.dead is None
    row = runs.row_for(job, 1, started.record, outcome, ms(at + 1))
    assert runs.finish(row, started.run, started.record, ms(at + 1)).written
    return started.record


def stored(client: redis.Redis, job: str) -> dict[str, str]:
    raw = client.hgetall(KEYS.run(job, 1))
    return {k.decode(): v.decode() for k, v in raw.items()}


def rows_of(client: redis.Redis, job: str) -> list[dict[str, object]]:
    return [r for r in read_rows(client, KEYS, WINDOW) if r["job_id"] == job]


def test_the_record_of_a_finished_attempt_keeps_only_what_later_reads_need(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    whole = len(redis_client.hkeys(KEYS.run("A", 1)))
    run_once(runs, "A", nonce, NOW + 2, Outcome.OK)
    record = stored(redis_client, "A")
    assert set(record) == CUT, whole
    assert (record["nonce"], record["runs"], record["rowed"]) == (nonce, "1", "1")
    assert record["kept"] == f"{ms(NOW)}|{ms(NOW + 90)}|1200|{WINDOW}|ok"


def test_the_cut_record_keeps_the_ttl_the_gate_gave_the_record(redis_client: redis.Redis) -> None:
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    run_once(runs, "A", nonce, NOW + 2, Outcome.OK)
    assert RECORD_RETENTION_S - 5 < redis_client.ttl(KEYS.run("A", 1)) <= RECORD_RETENTION_S


def test_a_record_with_a_run_still_going_is_not_cut(redis_client: redis.Redis) -> None:
    """A dead run's row, written when the redelivered copy starts: the live run still needs
    the whole record (the sweep reads its worker, start time and time limit)."""
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    runs.start("A", 1, nonce, OWN, ms(NOW + 2))  # its worker dies
    again = runs.start("A", 1, nonce, OWN, ms(NOW + 5))
    assert again.dead is not None
    row = runs.row_for("A", 1, again.dead, Outcome.KILLED, ms(NOW + 5))
    assert runs.finish(row, again.dead_run, again.dead, ms(NOW + 5), current=False).written
    record = stored(redis_client, "A")
    assert "kept" not in record and runs.fields("A", 1)["worker"] == "w1" and record["started_ms"]


def test_a_redelivery_after_the_cut_gets_the_row_the_whole_record_would_give(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    first = run_once(runs, "A", nonce, NOW + 2, Outcome.OK)
    tax = float(redis_client.hget(KEYS.window(WINDOW), "tax_units") or 0)
    again = runs.start("A", 1, nonce, OWN, ms(NOW + 30))  # the ack was lost: delivered again
    assert again.record is not None and (again.run, again.dead) == (2, None)
    row = runs.row_for("A", 1, again.record, Outcome.OK, ms(NOW + 31))
    done = runs.finish(row, again.run, again.record, ms(NOW + 31))
    assert done.written and row.retry_tax > 0  # priced in Python before the cap
    assert done.retry_tax == 0  # what the worker's ledger_row line shows: the row's
    expected = runs.row_for("A", 1, replace(first, started_ms=ms(NOW + 30)), Outcome.OK,
                            ms(NOW + 31))  # fmt: skip
    second = rows_of(redis_client, "A")[1]
    assert {**second, "retry_tax": None} == {**expected.to_json(), "retry_tax": None}
    assert second["queue_wait_ms"] == 30_000 and second["deadline_slack_ms"] == 59_000
    assert second["retry_tax"] == 0  # the reservation closed with the first row
    assert float(redis_client.hget(KEYS.window(WINDOW), "tax_units") or 0) == tax
    assert set(stored(redis_client, "A")) == CUT and stored(redis_client, "A")["rowed"] == "2"


def test_a_redelivery_that_dies_after_the_cut_gets_its_killed_row_before_the_next_runs(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    run_once(runs, "A", nonce, NOW + 2, Outcome.OK)
    runs.start("A", 1, nonce, OWN, ms(NOW + 30))  # delivered again; that worker dies too
    third = runs.start("A", 1, nonce, OWN, ms(NOW + 40))
    assert third.record is not None and third.dead is not None and third.dead_run == 2
    assert third.dead.started_ms == ms(NOW + 30)
    dead = runs.row_for("A", 1, third.dead, Outcome.KILLED, ms(NOW + 40))
    assert runs.finish(dead, 2, third.dead, ms(NOW + 40), current=False).written
    row = runs.row_for("A", 1, third.record, Outcome.OK, ms(NOW + 41))
    assert runs.finish(row, third.run, third.record, ms(NOW + 41)).written
    found = rows_of(redis_client, "A")
    assert [(r["outcome"], r["queue_wait_ms"], r["tokens_in"]) for r in found] == [
        ("ok", 2000, 1200), ("killed", 30_000, 1200), ("ok", 40_000, 1200)
    ]  # fmt: skip
    assert [r["retry_tax"] for r in found[1:]] == [0, 0]


def test_a_failure_signalled_twice_after_the_cut_writes_one_row(redis_client: redis.Redis) -> None:
    """Celery 5.7's hard time limit fires task_failure twice; the second is ended from the
    main process, from the record as stored (gatekeeper/celery/worker.py _finish_elsewhere)."""
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    run_once(runs, "A", nonce, NOW + 2, Outcome.KILLED)
    tax = float(redis_client.hget(KEYS.window(WINDOW), "tax_units") or 0)
    found = runs.record("A", 1)
    assert found is not None and found[1].nonce == nonce
    run, record = found
    row: LedgerRow = runs.row_for("A", 1, record, Outcome.KILLED, ms(NOW + 4))
    assert not runs.finish(row, run, record, ms(NOW + 4)).written
    assert len(rows_of(redis_client, "A")) == 1
    assert float(redis_client.hget(KEYS.window(WINDOW), "tax_units") or 0) == tax


def test_a_copy_with_another_nonce_after_the_cut_is_still_refused(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    run_once(runs, "A", nonce, NOW + 2, Outcome.OK)
    forged = runs.start("A", 1, "not-" + nonce, OWN, ms(NOW + 30))
    assert forged.record is None and forged.refused == "forged"
    assert stored(redis_client, "A")["runs"] == "1"


def test_a_publish_of_the_same_attempt_after_the_cut_is_decided_anew(
    redis_client: redis.Redis,
) -> None:
    """Not taken for a duplicate of a live publish: every run of the cut record has its row."""
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    run_once(runs, "A", nonce, NOW + 2, Outcome.OK)
    again = admitted(redis_client, "A", NOW + 100)
    assert again != nonce and stored(redis_client, "A")["nonce"] == again
    run_once(runs, "A", again, NOW + 103, Outcome.OK)
    found = rows_of(redis_client, "A")
    assert [(r["outcome"], r["queue_wait_ms"]) for r in found] == [("ok", 2000), ("ok", 3000)]
    kept = stored(redis_client, "A")["kept"]
    assert kept == f"{ms(NOW + 100)}|{ms(NOW + 190)}|1200|{WINDOW}|ok"


def test_a_started_record_packs_four_of_the_workers_numbers_and_stays_compact(
    redis_client: redis.Redis,
) -> None:
    """Four numbers the worker knows of a run are one field while it goes on (``own``: three
    fields less for start.lua and finish.lua to walk), read back as the four, dropped by the
    cut; the record stays a compact hash throughout (one value past 64 bytes would turn it
    into a hash table for good: about four times the memory after the cut)."""
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    before = set(stored(redis_client, "A"))
    started = runs.start("A", 1, nonce, OWN, ms(NOW + 2))
    added = set(stored(redis_client, "A")) - before
    assert added == {"own", "task", "worker", "runs", "started_ms", "start_token", "start_dead"}
    assert stored(redis_client, "A")["own"] == "0|3|0.0|50"
    assert {name: runs.fields("A", 1)[name] for name in OWN} == OWN
    assert started.record is not None and started.record.worker == "w1"
    assert started.record.max_retries == 3 and started.record.tokens_out == 50
    live = runs.record("A", 1)
    assert live is not None and live[1] == started.record  # read back as the start saw it
    assert redis_client.object("encoding", KEYS.run("A", 1)) in COMPACT
    row = runs.row_for("A", 1, started.record, Outcome.OK, ms(NOW + 3))
    assert runs.finish(row, started.run, started.record, ms(NOW + 3)).written
    assert set(stored(redis_client, "A")) == CUT
    assert redis_client.object("encoding", KEYS.run("A", 1)) in COMPACT


def test_numbers_too_long_to_pack_are_written_laid_out(redis_client: redis.Redis) -> None:
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    huge = {**OWN, "time_limit_s": repr(1e300 / 3), "tokens_out": str(10**50)}  # 78 bytes packed
    started = runs.start("A", 1, nonce, huge, ms(NOW + 2))
    assert "own" not in stored(redis_client, "A")
    assert started.record is not None and started.record.tokens_out == 10**50
    assert {name: runs.fields("A", 1)[name] for name in huge} == huge
    assert redis_client.object("encoding", KEYS.run("A", 1)) in COMPACT


def test_a_record_an_older_worker_started_reads_back_and_is_finished_as_before(
    redis_client: redis.Redis,
) -> None:
    """An older worker wrote its own fields laid out (a rolling upgrade): they read back the
    same, a field stored on its own wins over ``own``, and the row is written once."""
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    token = "t" * 16
    older = [KEYS.run("A", 1), KEYS.started, KEYS.free_waiting, KEYS.stats]
    args = ["A:1", str(ms(NOW + 2)), nonce, token, *(x for kv in OWN.items() for x in kv)]
    assert runs._start(keys=older, args=args)[0] == 1  # start.lua as an older worker called it
    stored_then = runs.record("A", 1)
    assert stored_then is not None
    run, record = stored_then
    assert (run, record.worker, record.task, record.max_retries) == (1, "w1", "t", 3)
    redis_client.hset(KEYS.run("A", 1), "own", "9|9|9.0|9")
    assert runs.fields("A", 1)["max_retries"] == "3"  # its own field wins
    redis_client.hset(KEYS.run("A", 1), "own", "not four parts")
    assert runs.fields("A", 1)["tokens_out"] == "50" and "own" not in runs.fields("A", 1)
    row = runs.row_for("A", 1, record, Outcome.OK, ms(NOW + 3))
    assert runs.finish(row, run, record, ms(NOW + 3)).written
    assert not runs.finish(row, run, record, ms(NOW + 3)).written
    assert [r["outcome"] for r in rows_of(redis_client, "A")] == ["ok"]
    # The cut drops what this version writes; the four numbers an older worker laid out stay.
    assert set(stored(redis_client, "A")) == CUT | set(OWN_FIELDS)


def test_a_record_a_long_name_made_a_hash_table_is_compact_again_after_the_cut(
    redis_client: redis.Redis,
) -> None:
    """A task name and a worker past 64 bytes (``proj.apps.<...>.tasks.<...>``,
    ``celery@<pod>.<namespace>.svc``) turn the running record into a hash table; the cut
    writes it again, compact, with the same fields and values HDEL would leave, under the TTL
    it had. The four laid-out numbers of an older worker stay through that rewrite too."""
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    task = "proj.apps." + "embeddings." * 8 + "tasks.embed_batch"
    worker = "celery@" + "worker-embeddings-7d9f8c6b5-x2x9k." * 3 + "svc"
    long_names = {**OWN, "task": task, "worker": worker}
    started = runs.start("A", 1, nonce, long_names, ms(NOW + 2))
    assert started.record is not None and started.record.task == long_names["task"]
    assert redis_client.object("encoding", KEYS.run("A", 1)) == b"hashtable"
    redis_client.hset(KEYS.run("A", 1), mapping={"tokens_out": "50"})  # an older worker's
    redis_client.pexpire(KEYS.run("A", 1), 123_456_789)
    row = runs.row_for("A", 1, started.record, Outcome.OK, ms(NOW + 3))
    assert runs.finish(row, started.run, started.record, ms(NOW + 3)).written
    assert redis_client.object("encoding", KEYS.run("A", 1)) in COMPACT
    record = stored(redis_client, "A")
    assert set(record) == CUT | {"tokens_out"} and record["nonce"] == nonce
    assert record["kept"] == f"{ms(NOW)}|{ms(NOW + 90)}|1200|{WINDOW}|ok"
    assert 123_456_789 - 60_000 < redis_client.pttl(KEYS.run("A", 1)) <= 123_456_789
    assert [r["outcome"] for r in rows_of(redis_client, "A")] == ["ok"]
    again = runs.start("A", 1, nonce, long_names, ms(NOW + 30))  # delivered again after the cut
    assert again.record is not None and again.run == 2
    row = runs.row_for("A", 1, again.record, Outcome.OK, ms(NOW + 31))
    assert runs.finish(row, again.run, again.record, ms(NOW + 31)).written
    assert [r["queue_wait_ms"] for r in rows_of(redis_client, "A")] == [2000, 30_000]
    assert redis_client.object("encoding", KEYS.run("A", 1)) in COMPACT


def test_a_record_whose_kept_fields_are_long_is_left_as_it_is_by_the_cut(
    redis_client: redis.Redis,
) -> None:
    """What stays is too long for a compact hash (a replayer's handoff JSON): rewriting would
    not make it compact, so the cut only drops fields, as before (the worker's long name
    takes the cut to its rewrite)."""
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    handoff = '{"queue": "free", "set": {"gatekeeper_replays": 1}, "drop": ["x-long-header"]}'
    redis_client.hset(KEYS.run("A", 1), "handoff", handoff)
    worker = "celery@" + "worker-embeddings-7d9f8c6b5-x2x9k." * 2 + "svc"
    started = runs.start("A", 1, nonce, {**OWN, "worker": worker}, ms(NOW + 2))
    assert started.record is not None
    row = runs.row_for("A", 1, started.record, Outcome.OK, ms(NOW + 3))
    assert runs.finish(row, started.run, started.record, ms(NOW + 3)).written
    assert redis_client.object("encoding", KEYS.run("A", 1)) == b"hashtable"
    record = stored(redis_client, "A")
    assert set(record) == CUT | {"handoff"} and record["handoff"] == handoff


def test_a_record_with_thousands_of_fields_is_cut_without_a_rewrite(
    redis_client: redis.Redis,
) -> None:
    """Thousands of ``dup:*`` fields (a flood of re-sent publishes) and a long worker: the
    record could not be compact anyway, and rewriting it would pass Lua's ``unpack`` limit and
    fail the script after its row; the row is written once and the fields stay."""
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    worker = "celery@" + "worker-embeddings-7d9f8c6b5-x2x9k." * 2 + "svc"
    redis_client.hset(KEYS.run("A", 1), mapping={f"dup:{n:032x}": "admit_free|fits"
                                                 for n in range(5000)})  # fmt: skip
    started = runs.start("A", 1, nonce, {**OWN, "worker": worker}, ms(NOW + 2))
    assert started.record is not None
    row = runs.row_for("A", 1, started.record, Outcome.OK, ms(NOW + 3))
    assert runs.finish(row, started.run, started.record, ms(NOW + 3)).written
    assert [r["outcome"] for r in rows_of(redis_client, "A")] == ["ok"]
    record = stored(redis_client, "A")
    assert len(record) == len(CUT) + 5000 and record["kept"]


def test_a_record_rewritten_in_its_last_millisecond_never_loses_its_ttl(
    redis_client: redis.Redis,
) -> None:
    """The cut's rewrite of a record a millisecond from expiring (PTTL 0 inside the script,
    the key not yet gone): written again without a TTL it would stay for good."""
    runs = ledger(redis_client)
    worker = "celery@" + "worker-embeddings-7d9f8c6b5-x2x9k." * 2 + "svc"
    jobs = [f"J{n}" for n in range(300)]
    for job in jobs:
        nonce = admitted(redis_client, job)
        started = runs.start(job, 1, nonce, {**OWN, "worker": worker}, ms(NOW + 2))
        assert started.record is not None
        row = runs.row_for(job, 1, started.record, Outcome.OK, ms(NOW + 3))
        seconds, micros = redis_client.time()
        redis_client.pexpireat(KEYS.run(job, 1), seconds * 1000 + micros // 1000 + 1)
        runs.finish(row, started.run, started.record, ms(NOW + 3))
    assert [job for job in jobs if redis_client.pttl(KEYS.run(job, 1)) == -1] == []


def test_a_redelivery_to_a_worker_with_a_short_name_leaves_a_compact_record(
    redis_client: redis.Redis,
) -> None:
    """Run 1 started on a worker with a long name and died; run 2, on a worker with a short
    name, finishes: the record the first made a hash table is compact after the cut."""
    runs = ledger(redis_client)
    nonce = admitted(redis_client, "A")
    far = "celery@" + "worker-embeddings-7d9f8c6b5-x2x9k." * 2 + "svc"
    runs.start("A", 1, nonce, {**OWN, "worker": far}, ms(NOW + 2))  # its worker dies
    assert redis_client.object("encoding", KEYS.run("A", 1)) == b"hashtable"
    again = runs.start("A", 1, nonce, OWN, ms(NOW + 5))
    assert again.dead is not None and again.record is not None
    dead = runs.row_for("A", 1, again.dead, Outcome.KILLED, ms(NOW + 5))
    assert runs.finish(dead, again.dead_run, again.dead, ms(NOW + 5), current=False).written
    row = runs.row_for("A", 1, again.record, Outcome.OK, ms(NOW + 6))
    assert runs.finish(row, again.run, again.record, ms(NOW + 6)).written
    assert [r["outcome"] for r in rows_of(redis_client, "A")] == ["killed", "ok"]
    assert set(stored(redis_client, "A")) == CUT
    assert redis_client.object("encoding", KEYS.run("A", 1)) in COMPACT
