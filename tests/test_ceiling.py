"""The budget is a ceiling (SPEC section 2): for every window, the tax charged to it never
exceeds ``budget_units``, whatever the number of publishers, however long admitted work waits,
and whichever window the attempt finishes in.

8 publisher processes x 150 gated tasks of 100 tokens, ``budget_units = 5000``, a prefork free
worker with 2 slots, 3-second windows (so admitted work finishes in later windows), a 1 s wait
allowance (so work queued behind the 2 slots expires to reserved): attempts all raising, and
all succeeding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from gatekeeper.core.dwell import Decision
from gatekeeper.core.ledger import BudgetMode, Outcome, window_id
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.store import GateStore
from tests.calls import gate_call
from tests.conftest import REPO_ROOT, initialised, running_worker, wait_until

pytestmark = pytest.mark.celery
KEYS = Keys()
BUDGET, WINDOW_S, PUBLISHERS, TASKS = 5000.0, 3, 8, 150
SETTINGS = {
    "GATEKEEPER_DWELL_GATE_ENABLED": "true",
    "GATEKEEPER_CANARY_PERCENT": "100",
    "GATEKEEPER_BUDGET_UNITS": str(BUDGET),
    "GATEKEEPER_WINDOW_SECONDS": str(WINDOW_S),
    "GATEKEEPER_FREE_WAIT_ALLOWANCE_S": "1",
    "GATEKEEPER_FLAG_CACHE_S": "0.5",
}


def publish_all(redis_url: str, folder: Path, fail: bool) -> None:
    """Start the publishers, then let them all go half a second before a window ends."""
    go = folder / "go"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(SETTINGS, GATEKEEPER_REDIS_URL=redis_url, PYTHONPATH=str(REPO_ROOT))
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.apps.tax_publisher",
                redis_url,
                str(go),
                str(TASKS),
                "1" if fail else "0",
                "0.3",
            ],
            env=env,
            cwd=folder,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(PUBLISHERS)
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    while WINDOW_S - time.time() % WINDOW_S > 0.5 or WINDOW_S - time.time() % WINDOW_S < 0.4:
        time.sleep(0.01)
    go.touch()
    for child in children:
        assert child.wait(timeout=120) == 0


def settled(client: redis.Redis) -> bool:
    return (client.llen("free") == 0 and client.hlen(KEYS.inflight) == 0
            and client.zcard(KEYS.started) == 0)  # fmt: skip


@pytest.mark.parametrize("fail", [True, False], ids=["all_raising", "all_succeeding"])
def test_no_window_is_charged_more_than_its_budget(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, fail: bool
) -> None:
    worker_env = {k: v for k, v in SETTINGS.items() if k.startswith("GATEKEEPER_")}
    with running_worker(redis_url, tmp_path / "w.log", concurrency=2, **worker_env):
        publish_all(redis_url, tmp_path, fail)
        assert wait_until(lambda: settled(redis_client), timeout_s=90)
        time.sleep(0.5)
    charged: dict[int, float] = {}
    rows: dict[int, list[dict[str, object]]] = {}
    for key in redis_client.scan_iter(match=KEYS.window(0)[:-1] + "*"):
        text = key.decode()
        ident = int(text.rsplit(":", 2)[-2] if text.endswith(":rows") else text.rsplit(":", 1)[-1])
        if text.endswith(":rows"):
            rows[ident] = [json.loads(raw) for raw in redis_client.lrange(key, 0, -1)]
        else:
            charged[ident] = float(redis_client.hget(key, "tax_units") or 0)
            assert float(redis_client.hget(key, "exposure") or 0) == pytest.approx(0, abs=1e-6)
    assert charged, "no window was charged anything: the test measured nothing"
    for ident, tax in charged.items():
        assert tax <= BUDGET + 1e-6, (ident, tax)
        free_rows = [r for r in rows.get(ident, []) if r["path"] == "free"]
        assert sum(float(r["retry_tax"]) for r in free_rows) == pytest.approx(tax)  # type: ignore[arg-type]
    outcomes = {r["outcome"] for found in rows.values() for r in found if r["path"] == "free"}
    assert ("killed" if fail else "ok") in outcomes and "rejected" in outcomes
    assert "expired" in outcomes  # work queued behind two slots waited past its allowance
    runs = RunLedger(redis_client, KEYS, window_seconds=WINDOW_S, queue_wait_unit_per_second=1)
    crossed = 0  # a free row is written when its run ends: at its deadline less its slack
    for ident, found in rows.items():
        for row in found:
            if row["path"] == "free" and row["outcome"] in ("ok", "killed"):
                record = runs.fields(str(row["job_id"]), 1)  # kept after its row
                ended_ms = int(record["deadline_ms"]) - int(row["deadline_slack_ms"])  # type: ignore[call-overload]
                crossed += window_id(ended_ms / 1000, WINDOW_S) > ident
    assert crossed, "no admitted attempt finished in a later window than its admission's"


def test_a_redelivered_attempt_keeps_its_reservation_until_its_last_run_ends(
    redis_client: redis.Redis,
) -> None:
    """A run lost under ``acks_late`` gets its ``killed`` row when the redelivered copy
    starts: only that row's tax leaves the exposure, so new admissions cannot take what the
    live copy may still be charged; its own row closes the reservation (found in review: a
    window reached 9,600 of a 7,600 budget)."""
    from gatekeeper.core.ledger import BudgetMode, Outcome
    from gatekeeper.redis.store import GateStore
    from tests.calls import gate_call

    now, window, budget = 1_800_000_000.0, 7, 7600.0
    store = GateStore(redis_client, KEYS)
    ledger = RunLedger(redis_client, KEYS, window_seconds=900, queue_wait_unit_per_second=200,
                       wait_allowance_s=10)  # fmt: skip

    def admit(job: str, at: float) -> tuple[str, str]:
        call = gate_call(at, window_id=window, job_id=job, tokens_in=1200, budget_units=budget,
                         queue_wait_unit_per_second=200, wait_allowance_s=10,
                         budget_mode=BudgetMode.EXPOSURE)  # fmt: skip
        return store.score(call).decision.value, call.nonce

    def exposure() -> float:
        return float(redis_client.hget(KEYS.window(window), "exposure") or 0)

    decision, nonce = admit("A", now)
    assert decision == "admit_free" and exposure() == 3200  # 1,200 tokens + 10 s x 200
    ledger.start("A", 1, nonce, {"task": "t"}, round(now * 1000))  # run 1: its worker is lost
    again = ledger.start("A", 1, nonce, {"task": "t"}, round((now + 10) * 1000))
    assert again.dead is not None and again.record is not None
    dead_row = ledger.row_for("A", 1, again.dead, Outcome.KILLED, round((now + 10) * 1000))
    ledger.finish(dead_row, again.dead_run, again.dead, round((now + 10) * 1000), current=False)
    assert exposure() == 3200 - dead_row.retry_tax  # the rest is still held for run 2
    for job in ("B", "C"):  # what the held rest leaves room for, and no more
        decision, other = admit(job, now + 10)
        if decision == "admit_free":
            started = ledger.start(job, 1, other, {"task": "t"}, round((now + 20) * 1000))
            assert started.record is not None
            row = ledger.row_for(job, 1, started.record, Outcome.KILLED, round((now + 21) * 1000))
            ledger.finish(row, started.run, started.record, round((now + 21) * 1000))
    last = ledger.row_for("A", 1, again.record, Outcome.KILLED, round((now + 30) * 1000))
    ledger.finish(last, again.run, again.record, round((now + 30) * 1000))
    tax = float(redis_client.hget(KEYS.window(window), "tax_units") or 0)
    assert tax <= budget and exposure() == pytest.approx(0, abs=1e-6)
    # A third delivery after its last row is charged nothing: the reservation closed.
    third = ledger.start("A", 1, nonce, {"task": "t"}, round((now + 40) * 1000))
    assert third.record is not None
    row = ledger.row_for("A", 1, third.record, Outcome.KILLED, round((now + 41) * 1000))
    ledger.finish(row, third.run, third.record, round((now + 41) * 1000))
    assert float(redis_client.hget(KEYS.window(window), "tax_units") or 0) == tax


def test_in_optimistic_mode_a_free_row_is_priced_by_the_sources_formula_wait_included(
    redis_client: redis.Redis,
) -> None:
    """A reviewer: optimistic mode's budget check leaves the wait allowance out of an
    admission, and its record's cap (``reserved``) did too, so a killed free row was charged
    its tokens alone (1200, not 1200 + 1 s x 200). The cap is tokens + allowance in both
    modes; the check is still the source's."""
    initialised(redis_client)
    now = 1_800_000_000.0
    call = gate_call(now, job_id="job", tokens_in=1200, budget_mode=BudgetMode.OPTIMISTIC,
                     wait_allowance_s=10.0, queue_wait_unit_per_second=200.0)  # fmt: skip
    assert GateStore(redis_client, KEYS).score(call).decision is Decision.ADMIT_FREE
    runs = RunLedger(redis_client, KEYS, window_seconds=900, queue_wait_unit_per_second=200,
                     wait_allowance_s=10)  # fmt: skip
    started = runs.start("job", 1, call.nonce, {"task": "t"}, round((now + 1) * 1000))
    assert started.record is not None
    end_ms = round((now + 2) * 1000)
    row = runs.row_for("job", 1, started.record, Outcome.KILLED, end_ms)
    done = runs.finish(row, started.run, started.record, end_ms)
    assert row.retry_tax == 1400 and done.retry_tax == 1400  # 1200 tokens, 1 s waited x 200
