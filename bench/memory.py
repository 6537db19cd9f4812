"""What a finished gated job leaves in Redis (issue 15: beyond its ledger row, <= 300 bytes),
measured after publishing and running N gated no-op tasks on a real Celery worker.

Run on demand (this is not a test)::

    python bench/memory.py [-n 10000] [--pool solo]

One embedded ``redis-server`` is broker and gate. The bench publishes ``N`` tasks of
``bench/worker.py``'s gated no-op (decided ``admit_free``, to ``free``), runs them all with a
real worker of that bench's app, stops it, and then reads every key (``SCAN``, ``MEMORY USAGE
<key> SAMPLES 0``), grouped by what it is (``gatekeeper/redis/keys.py``): the gate's run
records, the ledger rows, the decision records, the window hashes, the rest of gatekeeper's
keys, and the broker's. It prints bytes per finished job for each group, the server's
``used_memory`` growth per job over the whole run beside the groups' sum (``MEMORY USAGE``
leaves out a key's entry in the expiry table, hash-table buckets and allocator rounding), and
last ``beyond_row_bytes_per_job=`` (everything gatekeeper keeps but the rows, per job, by
``MEMORY USAGE``) with the target.

It checks what it measured before printing: every task was decided ``admit_free/fits``, ran
once (its record says ``runs=1 rowed=1``, and was cut after its row: it has ``kept``,
gatekeeper/redis/kept.py) and has exactly one ``free``/``ok`` row; the free queue and its
waiting set are empty; the decision records hold one record per decision.
Otherwise ``bench: ...`` on stderr, no figure, exit 1.

Each group's retention turns bytes per job into memory at a rate (printed for 10 and 100
jobs a second): the run records' TTL is ``RECORD_RETENTION_S`` (2 days), the rows' the
window retention (8 days), the decision records' the cap (``decision_record_cap`` records,
whatever the rate).

``GATEKEEPER_DECISION_RECORD_CAP=0 python bench/memory.py`` measures a job with decision
records off (the check then expects none).

``--replayed`` measures jobs the replayer handed on: published while a member of the free
queue's waiting set 5 s old makes the queue older than a 1 s age cap (each decided ``defer/
queue_age_cap``, as tests/test_replay.py defers), then, that member removed, one pass of the
real replayer (``Replayer.run(once=True)``) moves each to free (``to_free`` for every job,
checked) before the worker runs them. The checks then expect two decision records and one
kept handoff (``handoff:<job_id>:<attempt>``, a group of its own) a job.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import ModuleType

import redis

from gatekeeper.celery.replay import Replayer
from gatekeeper.defaults import RECORD_RETENTION_S, WINDOW_RETENTION_S
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis.decisions import read_records
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import ATTEMPTS, Keys
from gatekeeper.redis.scripts import read_rows, text_of

KEYS = Keys()
GROUPS = ("run records", "handoffs", "ledger rows", "decision records", "windows",
          "gatekeeper other", "broker")  # fmt: skip


def load_worker_bench() -> ModuleType:
    path = Path(__file__).with_name("worker.py")
    spec = importlib.util.spec_from_file_location("bench_worker", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_worker"] = module
    spec.loader.exec_module(module)
    return module


def group_of(key: str) -> str:
    if not key.startswith(KEYS.base):
        return "broker"
    rest = key[len(KEYS.base) + 1 :]
    if rest.startswith("run:"):
        return "run records"
    if rest.startswith("handoff:"):
        return "handoffs"
    if rest.startswith("window:") and rest.endswith(":rows"):
        return "ledger rows"
    if rest == "decisions":
        return "decision records"
    if rest.startswith("window:"):
        return "windows"
    return "gatekeeper other"


def sizes(client: redis.Redis) -> tuple[Counter[str], Counter[str]]:
    """Bytes and key counts by group."""
    total: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for raw in client.scan_iter(count=1000):
        key = text_of(raw)
        group = group_of(key)
        total[group] += int(client.memory_usage(raw, samples=0) or 0)
        count[group] += 1
    return total, count


def encodings(client: redis.Redis, ids: list[str]) -> Counter[str]:
    """How the server holds each job's run record (``OBJECT ENCODING``), counted: one value
    past ``hash-max-ziplist-value`` makes it a hash table for good."""
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.object("encoding", KEYS.run(job_id, 1))
    return Counter(text_of(kind) if kind is not None else "none" for kind in pipe.execute())


def decisions(client: redis.Redis, ids: list[str]) -> Counter[tuple[str, ...]]:
    """(decision, reason) of each job's run record, counted."""
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(KEYS.run(job_id, 1), "decision", "reason")
    return Counter(tuple(text_of(v) if v is not None else "" for v in f) for f in pipe.execute())


def checks(
    client: redis.Redis, ids: list[str], window_ids: set[int], cap: int, scorings: int
) -> list[str]:
    problems = []
    rows = [row for w in sorted(window_ids) for row in read_rows(client, KEYS, w)]
    by_job = Counter(row["job_id"] for row in rows)
    wrong_rows = [r for r in rows if (r["path"], r["outcome"]) != ("free", "ok")]
    if set(by_job) != set(ids) or any(n != 1 for n in by_job.values()) or wrong_rows:
        problems.append(f"{len(rows)} rows for {len(ids)} jobs ({len(wrong_rows)} not free/ok)")
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(KEYS.run(job_id, 1), "decision", "reason", "runs", "rowed", "kept")
    seen = Counter((*(text_of(v) if v is not None else "" for v in f[:4]), f[4] is not None)
                   for f in pipe.execute())  # fmt: skip
    if set(seen) != {("admit_free", "fits", "1", "1", True)}:
        problems.append("run records not all admit_free/fits runs=1 rowed=1, cut after the "
                        f"row (kept): {dict(seen)}")  # fmt: skip
    if (
        client.llen("free")
        or client.zcount(KEYS.free_waiting, "-inf", ATTEMPTS)
        or client.hlen(KEYS.inflight)
    ):
        problems.append("work left in free, its waiting set or inflight")
    handoffs = sum(client.exists(KEYS.handoff(job_id, 1)) for job_id in ids)
    if handoffs != (len(ids) if scorings > 1 else 0):  # replayed: one kept handoff a job
        problems.append(f"{handoffs} kept handoffs for {len(ids)} jobs ({scorings} scorings)")
    records = read_records(client, KEYS, 0).records
    if len(records) != (scorings * len(ids) if cap else 0):  # decision_record_cap = 0: off
        problems.append(f"{len(records)} decision records for {scorings * len(ids)} decisions "
                        f"(cap {cap})")  # fmt: skip
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=10_000)
    parser.add_argument("--pool", default="solo", choices=["solo", "prefork"])
    parser.add_argument("--hostname", help="the worker's -n (a name past 64 bytes: the records' "
                        "hash-table case, gatekeeper/redis/kept.py)")  # fmt: skip
    parser.add_argument("--replayed", action="store_true",
                        help="every job deferred at publish (the age cap), then replayed to "
                        "free by the replayer, before it runs: the handoff's records")  # fmt: skip
    args = parser.parse_args()
    wb = load_worker_bench()
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        client = redis.Redis.from_url(server.url)
        FlagStore(client, wb.bench_settings(server.url)).initialise(
            "bench/memory.py", "bench", time.time(), open_path=True
        )
        before = int(client.info("memory")["used_memory"])
        devnull = open(os.devnull, "w")  # noqa: SIM115 - closed below
        saved, sys.stderr = sys.stderr, devnull
        try:
            settings = wb.bench_settings(server.url)
            if args.replayed:  # a free queue older than the cap at publish: each is deferred
                settings = settings.model_copy(update={"max_queue_age_s": 1.0})
                client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})
            app = wb.create_app(server.url, settings=settings)
            task = app.tasks[wb.TASKS[wb.GATED]]
            ids = [task.delay().id for _ in range(50)]  # warm up, run below with the rest
            started = time.time()
            ids = [task.delay().id for _ in range(args.n)] + ids
            if args.replayed:
                client.zrem(KEYS.free_waiting, "stale:1")
                parked = decisions(client, ids)
                replayer = Replayer(wb.bench_settings(server.url), broker=client, gate=client)
                moved = dict(replayer.run(threading.Event(), once=True))
        finally:
            sys.stderr = saved
        window_ids = {int(started // 900), int(time.time() // 900) + 1}
        if args.replayed and (set(parked) != {("defer", "queue_age_cap")}
                              or moved != {"to_free": len(ids)}):  # fmt: skip
            print(f"bench: not every task was deferred, then replayed to free: {dict(parked)} "
                  f"{moved}", file=sys.stderr)  # fmt: skip
            return 1
        decided = decisions(client, ids)
        if set(decided) != {("admit_free", "fits")}:  # the worker would wait for nothing
            print(f"bench: not every task was admitted to free: {dict(decided)}", file=sys.stderr)
            return 1
        with wb.worker(server.url, args.pool, folder, hostname=args.hostname):
            wb.wait_for(folder, wb.GATED, len(ids), timeout_s=60 + len(ids) / 20)
        window_ids |= {int(time.time() // 900)}
        window_ids = set(range(min(window_ids), max(window_ids) + 1))
        cap = wb.bench_settings(server.url).decision_record_cap
        problems = checks(client, ids, window_ids, cap, 2 if args.replayed else 1)
        if problems:
            for problem in problems:
                print(f"bench: {problem}", file=sys.stderr)
            return 1
        total, count = sizes(client)
        kinds = encodings(client, ids)
        grown = int(client.info("memory")["used_memory"]) - before
        version = client.info("server")["redis_version"]
        app.close()
        devnull.close()
    jobs = len(ids)
    named = f" hostname_bytes={len(args.hostname.encode())}" if args.hostname else ""
    named += " replayed=every job (deferred, then handed on to free)" if args.replayed else ""
    print(f"bench/memory.py {time.strftime('%Y-%m-%dT%H:%M:%S')} jobs={jobs} pool={args.pool} "
          f"redis={version} decision_record_cap={cap}{named}")  # fmt: skip
    for group in GROUPS:
        print(f"{group.replace(' ', '_')}: bytes_per_job={total[group] / jobs:.1f} "
              f"keys={count[group]}")  # fmt: skip
    shown = " ".join(f"{kind}={n}" for kind, n in sorted(kinds.items()))
    print(f"run_record_encodings: {shown} (a hash table costs about four times a compact one)")
    beyond = sum(total[g] for g in GROUPS if g not in ("ledger rows", "broker")) / jobs
    retention = {"run records": RECORD_RETENTION_S, "handoffs": RECORD_RETENTION_S,
                 "ledger rows": WINDOW_RETENTION_S,
                 "windows": WINDOW_RETENTION_S, "gatekeeper other": RECORD_RETENTION_S}  # fmt: skip
    for rate in (10, 100):
        parts = []
        for group, seconds in retention.items():
            parts.append(
                f"{group.replace(' ', '_')}={total[group] / jobs * rate * seconds / 1e9:.2f}GB"
            )
        records = min(cap, rate * WINDOW_RETENTION_S)
        parts.append(f"decision_records={total['decision records'] / jobs * records / 1e9:.2f}GB")
        print(f"rate={rate}/s " + " ".join(parts))
    print(f"used_memory_growth_per_job={grown / jobs:.1f} (the server's used_memory after the "
          f"run minus before the publishes; MEMORY USAGE of every group: "
          f"{sum(total.values()) / jobs:.1f}: the expiry table, hash buckets and allocator "
          "rounding are the difference)")  # fmt: skip
    print(f"beyond_row_bytes_per_job={beyond:.1f} (all but the ledger rows and the broker's "
          "keys, per finished job; target <= 300)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
