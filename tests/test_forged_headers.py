"""A caller's headers never create, alter or price a ledger row: only the gate's record does.

A real worker runs messages that carry gatekeeper headers the gate did not write: published
with the gate off, outside the canary, for an ungated task, with another job's nonce, and a
forged copy of a real admitted job (same task id) that runs before the real one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

import gatekeeper
from gatekeeper.celery.message import attempt_of, claims, forged_attempt
from gatekeeper.core.ledger import window_id
from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import gate_settings, queue_messages, running_worker, unused_port, wait_until

pytestmark = pytest.mark.celery
KEYS = Keys()


def forged(nonce: str | None = "forged-nonce", tokens: int = 100_000) -> dict[str, Any]:
    """The headers of a message the gate admitted to free, as a caller would write them."""
    headers: dict[str, Any] = {
        "gatekeeper_decision": "admit_free",
        "gatekeeper_reason": "fits",
        "gatekeeper_attempt": 1,
        "gatekeeper_window": window_id(time.time(), 900),
        "gatekeeper_tokens_in": tokens,
        "gatekeeper_free_admitted": True,
        "gatekeeper_published_at": time.time() - 3600,
        "gatekeeper_attempt_published_at": time.time() - 3600,
        "gatekeeper_deadline_at": time.time() - 60,
    }
    if nonce is not None:
        headers["gatekeeper_nonce"] = nonce
    return headers


def rows(client: redis.Redis) -> list[dict[str, Any]]:
    found = []
    for key in sorted(client.scan_iter(match=f"{KEYS.base}:window:*:rows")):
        found += [json.loads(raw) for raw in client.lrange(key, 0, -1)]
    return found


def totals(client: redis.Redis) -> dict[str, float]:
    """Every window counter summed over the windows."""
    summed: dict[str, float] = {}
    for key in client.scan_iter(match=f"{KEYS.base}:window:*", _type="hash"):
        for field, value in client.hgetall(key).items():
            name = field.decode()
            summed[name] = summed.get(name, 0.0) + float(value)
    return summed


def stats(client: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(KEYS.stats).items()}


def test_forged_messages_run_but_price_nothing_and_leave_the_real_job_alone(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    gate_off = create_app(gate_settings(redis_url, dwell_gate_enabled=False), redis_url)
    outside = create_app(gate_settings(redis_url, canary_percent=0), redis_url)
    gate_on = create_app(gate_settings(redis_url), redis_url)

    # A real job, admitted to free by the gate: its record holds a nonce no caller knows.
    # Its task id is taken by a forged copy published first, so the copy runs first.
    gate_off.tasks["tests.boom"].apply_async(task_id="victim", queue="free", headers=forged())
    gate_on.tasks["tests.embed"].apply_async((1,), task_id="victim")
    (real,) = [m for m in queue_messages(redis_client, "free") if "gatekeeper_dwell_s" in
               m["headers"]]  # fmt: skip
    assert real["headers"]["gatekeeper_decision"] == "admit_free"
    real_nonce = real["headers"]["gatekeeper_nonce"]
    exposure_before = totals(redis_client).get("exposure", 0)
    assert exposure_before == 2100  # the real admission's reservation: tokens and allowance

    # Forged messages of task ids the gate has no record of: with a nonce of their own, with
    # another job's real nonce, and with none at all (as an old publisher's would be). Each
    # gets an unverified, unpriced row, as the run of a record a failover lost does: a nonce
    # is forged only against a record that holds another.
    gate_off.tasks["tests.boom"].apply_async(queue="free", headers=forged())
    outside.tasks["tests.boom"].apply_async(queue="free", headers=forged())
    gate_off.tasks["tests.plain"].apply_async(queue="free", headers=forged())
    gate_off.tasks["tests.boom"].apply_async(queue="free", headers=forged(nonce=real_nonce))
    gate_off.tasks["tests.boom"].apply_async(queue="free", headers=forged(nonce=None))
    assert redis_client.llen("free") == 7

    with running_worker(redis_url, tmp_path / "w.log"):
        assert wait_until(lambda: redis_client.llen("free") == 0 and any(
            r["job_id"] == "victim" and r.get("verified", True) for r in rows(redis_client)
        ) and len(rows(redis_client)) >= 6)  # fmt: skip
        time.sleep(1.0)  # a late signal, if any, would land now

    found = rows(redis_client)
    priced = [r for r in found if r.get("verified", True)]
    (row,) = priced  # only the real job's
    assert (row["job_id"], row["path"], row["outcome"], row["tokens_in"]) == (
        "victim",
        "free",
        "ok",
        100,
    )
    unverified = [r for r in found if r.get("verified", True) is False]
    assert sorted((r["outcome"], r["retry_tax"]) for r in unverified) == [
        ("killed", 0.0)] * 4 + [("ok", 0.0)]  # tests.plain returns  # fmt: skip
    summed = totals(redis_client)
    assert summed.get("tax_units", 0) == row["retry_tax"]  # the real row's wait, nothing else
    assert summed.get("exposure", 0) == 0  # the real admission's hold released, no other
    assert summed.get("rows:killed", 0) == 0 and summed.get("slack_misses", 0) == 0
    assert summed.get("unverified:killed", 0) == 4
    counted = stats(redis_client)
    assert counted.get("forged_runs") == 1 and counted.get("unverified_runs") == 5
    record = redis_client.hgetall(KEYS.run("victim", 1))
    assert record[b"nonce"] == real_nonce.encode() and record[b"runs"] == b"1"
    log = (tmp_path / "w.log").read_text()
    assert log.count("event=ledger_unverified_message") == 6


BAD_ATTEMPTS = ("12345678901", "x", "1.5", "-1", [1], True, "1" * 5000)
"""Attempts the gate never writes: ten digits or more, not a whole number, not a number."""


@pytest.mark.parametrize("nonce", ["forged-nonce", None])
def test_a_forged_attempt_the_gate_never_writes_is_counted_and_logged_once_as_forged(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, nonce: str | None
) -> None:
    """A message that claims the gate's decision with an attempt the gate never writes runs
    as an ordinary task, is counted and logged once as forged (with a nonce or without), and
    charges nothing; no signal handler of the gate raises over it (Celery would log each).
    Failed ones too: ``tests.boom`` raises, so its end signals fire in the child and the
    main process."""
    gate_off = create_app(gate_settings(redis_url, dwell_gate_enabled=False), redis_url)
    for attempt in BAD_ATTEMPTS:
        headers = {**forged(nonce=nonce), "gatekeeper_attempt": attempt}
        gate_off.tasks["tests.plain"].apply_async(queue="free", headers=headers)
    headers = {**forged(nonce=nonce), "gatekeeper_attempt": "12345678901"}
    gate_off.tasks["tests.boom"].apply_async(queue="free", headers=headers)
    ran = len(BAD_ATTEMPTS)
    with running_worker(redis_url, tmp_path / "w.log"):
        assert wait_until(lambda: redis_client.llen(RUNS_KEY) == ran + 1)
        time.sleep(0.5)  # a late signal, if any, would land now
    log = (tmp_path / "w.log").read_text()
    assert "Signal handler" not in log and "event=ledger_write_failed" not in log, log
    assert log.count("Traceback") == 1, log  # tests.boom's own ValueError, no other
    assert rows(redis_client) == [] and stats(redis_client) == {"forged_runs": ran + 1}
    forged_lines = [line for line in log.splitlines() if "event=ledger_unverified_message" in line]
    assert len(forged_lines) == ran + 1 and all("kind=forged" in line for line in forged_lines)
    assert not [key for key in redis_client.scan_iter(match=f"{KEYS.base}:*")
                if key not in (KEYS.stats.encode(), KEYS.flags.encode(), KEYS.deployment.encode())
                and not key.startswith(KEYS.worker("").encode())]  # heartbeats expire  # fmt: skip


def test_a_decision_made_without_redis_gets_an_unverified_unpriced_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # The gate's Redis is unreachable at publish: reserved, gate_unavailable, no record and
    # no nonce. The worker (whose Redis is up) still gives the run a row, unverified.
    down = f"redis://127.0.0.1:{unused_port()}/0"
    app = create_app(gate_settings(down, redis_timeout_s=0.2), redis_url)
    job = app.tasks["tests.boom"].delay().id
    (message,) = queue_messages(redis_client, "reserved")
    assert message["headers"]["gatekeeper_reason"] == "gate_unavailable"
    assert "gatekeeper_nonce" not in message["headers"]
    with running_worker(redis_url, tmp_path / "w.log", queues="reserved"):
        assert wait_until(lambda: len(rows(redis_client)) == 1)
    (row,) = rows(redis_client)
    assert (row["job_id"], row["outcome"], row["path"]) == (job, "killed", "reserved")
    assert (row["verified"], row["retry_tax"]) == (False, 0.0)
    summed = totals(redis_client)
    assert summed.get("rows:killed", 0) == 0 and summed.get("unverified:killed") == 1
    assert stats(redis_client).get("unverified_runs") == 1


@pytest.mark.parametrize("fast_publish", ["auto", "off"])
def test_a_publish_the_gate_failed_closed_gets_an_unverified_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, fast_publish: str
) -> None:
    # A fault inside the gate (gate_error): reserved, with the decision alone (no attempt,
    # no nonce, no publish time). Its run is owed an unverified row like any decision made
    # without a record, its attempt counted from its retries, its wait not since 1970.
    app = create_app(gate_settings(redis_url, fast_publish=fast_publish), redis_url)

    def fault(*_: Any, **__: Any) -> None:
        raise RuntimeError("a fault inside the gate")

    gatekeeper.install(app).pipeline.route = fault  # type: ignore[method-assign]
    job = app.tasks["tests.embed"].delay(1).id
    (message,) = queue_messages(redis_client, "reserved")
    assert message["headers"]["gatekeeper_reason"] == "gate_error"
    assert "gatekeeper_attempt" not in message["headers"]
    with running_worker(redis_url, tmp_path / "w.log", queues="reserved"):
        assert wait_until(lambda: len(rows(redis_client)) == 1)
        time.sleep(0.5)  # a second row, if any, would land now
    (row,) = rows(redis_client)
    shown = {name: row[name] for name in ("job_id", "attempt", "outcome", "path")}
    assert shown == {"job_id": job, "attempt": 1, "outcome": "ok", "path": "reserved"}
    assert (row["verified"], row["retry_tax"]) == (False, 0.0)
    assert 0 <= row["queue_wait_ms"] < 60_000
    assert stats(redis_client) == {"unverified_runs": 1}
    log = (tmp_path / "w.log").read_text()
    assert "kind=unverified" in log and "event=ledger_write_failed" not in log, log


def test_a_failed_closed_retry_is_its_retries_plus_one() -> None:
    # Celery's own retries header is the only count a decision-only message carries.
    failed_closed = {"gatekeeper_decision": "reserved", "gatekeeper_reason": "gate_error"}
    assert claims(failed_closed) and attempt_of(failed_closed) == 1
    assert attempt_of({**failed_closed, "retries": 2}) == 3
    assert attempt_of({**failed_closed, "retries": "x", "gatekeeper_attempt": 4}) == 4
    assert not claims({**failed_closed, "gatekeeper_attempt": "x"})  # forged, not this
    # A count no publish makes is a caller's: no claim (a signal handler must not take int()
    # of infinity, nor write a row for attempt 10**300).
    for retries in (float("inf"), 1e300, 10**300, -1, "x", "1" * 12, True, [1]):
        assert not claims({**failed_closed, "retries": retries}), retries
    assert not claims({**failed_closed, "gatekeeper_attempt": 10**12})


def test_attempt_zero_is_forged_never_read_as_attempt_one() -> None:
    # The gate counts attempts from 1 (it refuses retries of -1): a message claiming attempt 0
    # is not its own, and retries that would make attempt 10**9 are bounded as attempts are.
    decided = {"gatekeeper_decision": "admit_free", "gatekeeper_attempt": 0}
    assert not claims(decided) and forged_attempt(decided)
    assert not claims({**decided, "gatekeeper_attempt": "0"})
    assert claims({**decided, "gatekeeper_attempt": "7"}) and attempt_of(decided | {
        "gatekeeper_attempt": "7"}) == 7  # fmt: skip
    failed_closed = {"gatekeeper_decision": "reserved", "gatekeeper_reason": "gate_error"}
    assert claims({**failed_closed, "retries": 10**9 - 2})
    assert not claims({**failed_closed, "retries": 10**9 - 1})


def test_a_second_publish_of_a_live_attempt_cannot_orphan_its_record(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # The same task id published twice through the gate (idempotent ids are common): the
    # first, admitted to free, keeps its record; the second goes to reserved unrecorded.
    app = create_app(gate_settings(redis_url), redis_url)
    app.tasks["tests.boom"].apply_async(task_id="victim")  # admitted, will be killed
    app.tasks["tests.embed"].apply_async((1,), task_id="victim")
    (second,) = queue_messages(redis_client, "reserved")
    assert second["headers"]["gatekeeper_reason"] == "duplicate_publish"
    with running_worker(redis_url, tmp_path / "w.log", queues="free,reserved"):
        assert wait_until(lambda: redis_client.llen("free") + redis_client.llen("reserved") == 0
                          and len(rows(redis_client)) >= 1)  # fmt: skip
        time.sleep(1.0)
    (row,) = rows(redis_client)  # the duplicate ran unpriced, with no row
    assert (row["job_id"], row["path"], row["outcome"]) == ("victim", "free", "killed")
    assert row["retry_tax"] > 0
    summed = totals(redis_client)
    assert summed.get("tax_units") == row["retry_tax"] and summed.get("exposure", 0) == 0
    assert stats(redis_client).get("forged_runs") == 1


def test_a_copy_of_a_running_jobs_id_killed_in_the_main_process_leaves_its_row_alone(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # A hard time limit (seen in the worker's main process, by task id alone) ends a plain
    # copy that carries a running gated job's id: the gated job's run is not the one killed.
    gate_on = create_app(gate_settings(redis_url), redis_url)
    gate_off = create_app(gate_settings(redis_url, dwell_gate_enabled=False), redis_url)
    gate_on.tasks["tests.sleepy"].apply_async((4,), task_id="victim")  # admitted to free
    gate_off.tasks["tests.hard"].apply_async(task_id="victim", queue="free")  # dies at 1 s
    with running_worker(redis_url, tmp_path / "w.log", concurrency=2):
        assert wait_until(lambda: len(rows(redis_client)) >= 1, timeout_s=30)
        time.sleep(1.0)
    log = (tmp_path / "w.log").read_text()
    assert "TimeLimitExceeded" in log or "Hard time limit" in log  # the copy did die
    (row,) = rows(redis_client)
    assert (row["job_id"], row["path"], row["outcome"]) == ("victim", "free", "ok")
    summed = totals(redis_client)
    assert summed.get("rows:killed", 0) == 0 and summed.get("exposure", 0) == 0


def test_a_copys_meter_never_prices_the_real_jobs_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # An ungated copy that meters its tokens runs first in the same child, then the real
    # gated attempt with that id: its row has the real attempt's tokens, not the copy's.
    gate_on = create_app(gate_settings(redis_url), redis_url)
    gate_off = create_app(gate_settings(redis_url, dwell_gate_enabled=False), redis_url)
    gate_off.tasks["tests.metered"].apply_async(task_id="victim", queue="free")
    gate_on.tasks["tests.boom"].apply_async(task_id="victim")  # declares 1200, killed
    with running_worker(redis_url, tmp_path / "w.log"):
        assert wait_until(lambda: len(rows(redis_client)) >= 1)
        time.sleep(0.5)
    (row,) = rows(redis_client)
    assert (row["job_id"], row["outcome"], row["tokens_in"]) == ("victim", "killed", 1200)


def test_a_callers_attempt_headers_neither_move_its_wait_nor_pass_for_a_replay(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """``gatekeeper_attempt_published_at`` (a day ago, or a day ahead: a wait of 0, a wait
    tax of 0) and another publish's nonce, set by a caller on a fresh publish: the gate's
    record, which prices the row, takes the publish's own time, and the live record of the
    same attempt is not taken over (a replay alone presents its nonce)."""
    app = create_app(gate_settings(redis_url), redis_url)
    now = time.time()
    for job, shift in (("past", -86_400), ("ahead", 86_400)):
        forged_time = {"gatekeeper_attempt": 1, "gatekeeper_attempt_published_at": now + shift}
        app.tasks["tests.embed"].apply_async((1,), task_id=job, headers=forged_time)
        published = float(redis_client.hget(KEYS.run(job, 1), "published_ms") or 0) / 1000
        assert abs(published - now) < 60, (job, published - now)
    app.tasks["tests.embed"].apply_async((1,), task_id="live")
    nonce = (redis_client.hget(KEYS.run("live", 1), "nonce") or b"").decode()
    taken = {"gatekeeper_attempt": 1, "gatekeeper_nonce": nonce}
    app.tasks["tests.embed"].apply_async((1,), task_id="live", headers=taken)
    assert (redis_client.hget(KEYS.run("live", 1), "nonce") or b"").decode() == nonce
    reasons = [m["headers"]["gatekeeper_reason"] for m in queue_messages(redis_client, "reserved")]
    assert reasons == ["duplicate_publish"]


def test_a_retry_decided_without_a_record_goes_out_without_the_earlier_attempts_claims(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Celery copies the running message's headers into its retry: attempt 1's nonce, its
    number and its publish times. A retry the gate sends to reserved unrecorded (bad input;
    its Redis unreachable) goes out with its own attempt and times and no nonce, so its run
    gets its own unverified row (not counted as forged, nor as attempt 1 run again)."""
    app = create_app(gate_settings(redis_url), redis_url)
    app.tasks["tests.embed"].apply_async((1,), task_id="first")  # attempt 1, recorded
    nonce = (redis_client.hget(KEYS.run("first", 1), "nonce") or b"").decode()
    copied = {"gatekeeper_nonce": nonce, "gatekeeper_attempt": 1,
              "gatekeeper_attempt_published_at": 1.0, "gatekeeper_published_at": 1.0}  # fmt: skip
    bad = {**copied, "gatekeeper_expected_service_s": "abc"}
    app.tasks["tests.embed"].apply_async((1,), task_id="first", retries=1, headers=bad)
    down = create_app(gate_settings(f"redis://127.0.0.1:{unused_port()}/0",
                                    redis_timeout_s=0.2), redis_url)  # fmt: skip
    down.tasks["tests.embed"].apply_async((1,), task_id="first", retries=1, headers=copied)
    sent = queue_messages(redis_client, "reserved")
    assert [m["headers"]["gatekeeper_reason"] for m in sent] == ["bad_input", "gate_unavailable"]
    for message in sent:
        headers = message["headers"]
        assert "gatekeeper_nonce" not in headers and headers["gatekeeper_attempt"] == 2
        assert headers["gatekeeper_attempt_published_at"] > time.time() - 60
        assert headers["gatekeeper_published_at"] > time.time() - 60


def test_a_retry_left_on_its_own_route_goes_without_its_earlier_attempts_claims(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The gate turned off between attempt 1 and its retry: the retry keeps its own route,
    without attempt 1's nonce and number that Celery copied into it (else its run would pass
    for attempt 1 run again, and attempt 2 get no row). A publish that claims no earlier
    attempt keeps its headers as they are (a caller's forgeries are the worker's to count)."""
    app = create_app(gate_settings(redis_url), redis_url)
    app.tasks["tests.embed"].apply_async((1,), task_id="first")  # attempt 1, recorded
    nonce = (redis_client.hget(KEYS.run("first", 1), "nonce") or b"").decode()
    copied = {"gatekeeper_nonce": nonce, "gatekeeper_attempt": 1,
              "gatekeeper_attempt_published_at": 1.0}  # fmt: skip
    off = create_app(gate_settings(redis_url, dwell_gate_enabled=False), redis_url)
    off.tasks["tests.embed"].apply_async((1,), task_id="first", retries=1, headers=copied,
                                         queue="celery")  # fmt: skip
    off.tasks["tests.embed"].apply_async((1,), task_id="other", headers=copied, queue="celery")
    retry, other = queue_messages(redis_client, "celery")
    assert retry["headers"]["id"] == "first" and other["headers"]["id"] == "other"
    for name in ("gatekeeper_nonce", "gatekeeper_attempt", "gatekeeper_attempt_published_at"):
        assert name not in retry["headers"], name
        assert name in other["headers"], name  # attempt 1 claimed by attempt 1: left alone
