"""The worker side on Celery's other pools: threads, gevent and eventlet (each task a greenlet).

Tasks of one worker run side by side there in one process, each on a line of its own to
the run ledger (a thread's, a greenlet's: gatekeeper/redis/run_start.py waits for every start
made on a new line). Whatever the pool, each attempt gets exactly one row, killed runs are
priced, and nothing stays reserved or marked started.

Eventlet is deprecated upstream (it says so when the worker imports it), but Celery 5.5 to
5.7 still run it, and its monkey patching deletes ``select.poll``: the lines must do without
it (gatekeeper/redis/wire.py).
"""

from __future__ import annotations

import datetime
import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest
import redis

from tests.conftest import missing_server, running_worker
from tests.test_worker_ledger import KEYS, app_for, wait_rows, window_totals

pytestmark = pytest.mark.celery


SUCCEEDED = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/[^\]]*\] "
    r"Task tests\.embed\[[^\]]+\] succeeded in ([0-9.e-]+)s",
    re.MULTILINE,
)


def overlapping(log: str) -> int:
    """The most ``tests.embed`` runs under way at one moment, from the worker's own lines
    (each run's end and how long it took)."""
    spans = []
    for stamp, took in SUCCEEDED.findall(log):
        end = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        spans.append((end - float(took), end))
    return max((sum(s <= at < e for s, e in spans) for at, _ in spans), default=0)


def needs(pool: str) -> None:
    """Skip (fail under CI) when the pool's library is not installed."""
    if pool in ("gevent", "eventlet") and importlib.util.find_spec(pool) is None:
        missing_server(
            f"{pool} is not installed (it is in the test extra: pip install -e '.[test]')"
        )


@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_tasks_side_by_side_in_one_process_have_one_row_per_attempt(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, pool: str
) -> None:
    needs(pool)
    # A long wait allowance: Celery 5.5.0's threads pool with a prefetch of one a thread (the
    # test app's) stops fetching until kombu's 10 s timer wakes its loop, gatekeeper or not
    # (measured with a plain Celery app), and waits that long must not expire the attempts.
    app = app_for(redis_url, budget_units=1e9, free_wait_allowance_s=120)  # it retries too
    log = tmp_path / "w.log"
    with running_worker(redis_url, log, concurrency=4, pool=pool, GATEKEEPER_BUDGET_UNITS="1e9",
                        GATEKEEPER_FREE_WAIT_ALLOWANCE_S="120"):  # fmt: skip
        for chunk in range(12):
            app.tasks["tests.coinflip"].delay(chunk)
        for n in range(8):  # overlapping runs: four at a time for 0.3 s each
            app.tasks["tests.embed"].delay(n, sleep_s=0.3)
        found = wait_rows(redis_client, 24, timeout_s=120)  # 12 + 4 retried + 8
    text = log.read_text(errors="replace")
    assert f"concurrency: 4 ({pool.removesuffix('s')})" in text and "Traceback" not in text
    assert "ledger_write_failed" not in text
    assert overlapping(text) >= 2, text  # the embed runs really ran side by side
    attempts = Counter((r["job_id"], r["attempt"]) for r in found)
    assert len(found) == 24 and set(attempts.values()) == {1}, found
    assert Counter(r["outcome"] for r in found) == {"ok": 20, "killed": 4}
    assert {r["path"] for r in found} == {"free"}
    free_tax = sum(r["retry_tax"] for r in found)
    assert window_totals(redis_client, "tax_units") == pytest.approx(free_tax)
    assert window_totals(redis_client, "exposure") == 0
    assert redis_client.hlen(KEYS.inflight) == 0 and redis_client.zcard(KEYS.started) == 0
    for job_id, attempt in attempts:  # each record cut after its one run's row
        record = redis_client.hgetall(KEYS.run(job_id, attempt))
        assert (record[b"runs"], record[b"rowed"]) == (b"1", b"1") and b"kept" in record


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_fifty_greenlets_at_once_each_get_their_own_runs_row(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, pool: str
) -> None:
    """``-c 50``: fifty runs under way in one thread, each start sent and its reply read on
    its greenlet's own line. Each job declares its own token count, so a row built from
    another run's start reply would carry another job's count."""
    needs(pool)
    app = app_for(redis_url, budget_units=1e9, free_wait_allowance_s=120)
    log = tmp_path / "w.log"
    before = len(redis_client.client_list())  # the session's Redis: earlier tests' too
    with running_worker(redis_url, log, concurrency=50, pool=pool, GATEKEEPER_BUDGET_UNITS="1e9",
                        GATEKEEPER_FREE_WAIT_ALLOWANCE_S="120"):  # fmt: skip
        tokens = {}
        for n in range(100):  # a count of its own each (a per-call header)
            headers = {"gatekeeper_tokens_in": 100 + n}
            sent = app.tasks["tests.embed"].apply_async((n,), {"sleep_s": 1}, headers=headers)
            tokens[sent.id] = 100 + n
        found = wait_rows(redis_client, 100, timeout_s=60)
        connected = len(redis_client.client_list()) - before  # the worker's, its runs ended
    text = log.read_text(errors="replace")
    assert f"concurrency: 50 ({pool})" in text and "Traceback" not in text
    assert "ledger_write_failed" not in text and "ledger_unverified_message" not in text
    assert overlapping(text) >= 25, text  # the runs really ran side by side
    assert len(found) == 100 and {r["job_id"] for r in found} == set(tokens), found
    assert {(r["attempt"], r["outcome"], r["path"]) for r in found} == {(1, "ok", "free")}
    assert all(r.get("verified", True) for r in found)  # priced: the gate's own records
    assert {r["job_id"]: r["tokens_in"] for r in found} == tokens
    free_tax = sum(r["retry_tax"] for r in found)
    assert free_tax > 0 and window_totals(redis_client, "tax_units") == pytest.approx(free_tax)
    assert window_totals(redis_client, "exposure") == 0
    assert redis_client.hlen(KEYS.inflight) == 0 and redis_client.zcard(KEYS.started) == 0
    assert connected < 50, connected  # a greenlet's line closes with it (else 100 and more)
