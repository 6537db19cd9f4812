"""What a decision record costs: bytes per decision in Redis, and the gate script's server time
with records kept and without, measured side by side on one embedded redis-server.

Run on demand (this is not a test)::

    python bench/records.py [--decisions 20000] [--task reports.embed_batch]

It publishes ``--decisions`` gated attempts through the real publish pipeline and
``gate.lua`` (:class:`gatekeeper.redis.gate.Pipeline`, the ordinary path: no broker), with
random UUIDs as task ids (Celery's) and a scripted clock that walks the free queue's age up
and down, so that the records hold admissions, age-cap defers, shifts to reserved and
refusals by the budget, in two namespaces: one with ``decision_record_cap`` above the count
(records kept), one with it 0 (none). Then:

- ``bytes_per_decision``: ``MEMORY USAGE`` of the stream (``SAMPLES 0``: every node counted)
  divided by the records it holds; ``used_memory_per_decision``: the server's ``used_memory``
  growth over the run with records minus the run without, per decision (allocator included);
- ``gate_lua_us``: ``INFO commandstats`` ``evalsha`` microseconds per call in each run, and
  their difference (what the record adds to a decision's server time);
- ``tune_records_per_s``: records ``gatekeeper tune``'s loop reads, parses and re-decides a
  second (with a knob), and what a full default cap takes;
- coverage: how long the default cap (``DECISION_RECORD_CAP``) lasts at 10 and 100 decisions
  a second, and the cap and memory a week needs at each.

It checks what it measured before printing a figure: the stream holds exactly one record per
decision, every record parses, and re-decided with no knob every record gives the decision
its publish was routed to (the run without records must leave no stream). Otherwise it prints
``bench: ...`` lines on stderr, no figure, and exits 1.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import uuid
from typing import Any

import redis

from gatekeeper.core.spec import GatedSpec
from gatekeeper.core.whatif import DecisionRecord, Knob, Tally, redecide
from gatekeeper.defaults import DECISION_RECORD_CAP
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis.attempt import Publish
from gatekeeper.redis.decisions import entries, read_records
from gatekeeper.redis.gate import Pipeline
from gatekeeper.redis.keys import Keys
from gatekeeper.settings import GatekeeperSettings

WEEK_S = 7 * 24 * 3600
T0 = 1_800_000_000.0


def run(url: str, namespace: str, cap: int, decisions: int, task: str) -> dict[str, Any]:
    """Publish ``decisions`` attempts; returns what was routed and the server's figures."""
    client = redis.Redis.from_url(url)
    keys = Keys("gatekeeper", namespace)
    client.hset(keys.flags, "initialised_at", "-inf")
    settings = GatekeeperSettings(
        redis_url=url, namespace=namespace, dwell_gate_enabled=True, canary_percent=100,
        decision_record_cap=cap, budget_units=60_000, log_level="error",
    )  # fmt: skip
    clock = {"t": T0}
    pipeline = Pipeline.create(settings, client, lambda: clock["t"])
    specs = [GatedSpec(expected_service_s=8, tokens_in=1200, deadline_s=s) for s in (120, 40)]
    client.config_resetstat()
    before = int(client.info("memory")["used_memory"])
    routed: list[str] = []
    for i in range(decisions):
        clock["t"] = T0 + (i % 50) * 0.8  # the free queue's age climbs to 39 s, then resets
        if i % 50 == 0:
            windows = [keys.window(w) for w in range(2_000_000, 2_000_002)]
            client.delete(keys.free_waiting, keys.inflight, *windows)
        spec = specs[i % 3 == 0]
        routing = pipeline.route(Publish(task, str(uuid.uuid4()), i % 2, 1, spec, {}))
        assert routing.decision is not None
        routed.append(f"{routing.decision.value}/{routing.reason.value}")
    used = int(client.info("memory")["used_memory"]) - before
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return {"client": client, "keys": keys, "routed": routed, "used_memory": used,
            "evalsha_us": float(stats.get("usec_per_call", "nan"))}  # fmt: skip


def check(kept: dict[str, Any], none: dict[str, Any], decisions: int) -> list[str]:
    problems = []
    client, keys = kept["client"], kept["keys"]
    recorded = read_records(client, keys, 0)
    if len(recorded.records) != decisions or recorded.unreadable:
        problems.append(f"{len(recorded.records)} records for {decisions} decisions "
                        f"({recorded.unreadable} unreadable)")  # fmt: skip
    for record, routed in zip(recorded.records, kept["routed"], strict=False):
        again = redecide(record)
        recorded_as = f"{record.decision}/{record.reason}"
        if f"{again.decision}/{again.reason}" != routed or recorded_as != routed:
            problems.append(f"record of {record.job_id} does not reproduce {routed}")
            break
    kinds = {name.split("/")[0] for name in kept["routed"]}
    if kinds != {"admit_free", "defer", "reserved"}:
        problems.append(f"the run decided only {sorted(kinds)}: not a realistic mix")
    if none["client"].exists(none["keys"].decisions):
        problems.append("the run without records left a stream")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--task", default="reports.embed_batch")
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        none = run(server.url, "bench-none", 0, args.decisions, args.task)
        kept = run(server.url, "bench-kept", args.decisions * 2, args.decisions, args.task)
        problems = check(kept, none, args.decisions)
        if problems:
            for problem in problems:
                print(f"bench: {problem}", file=sys.stderr)
            return 1
        client, keys = kept["client"], kept["keys"]
        length = int(client.xlen(keys.decisions))
        stream = int(client.memory_usage(keys.decisions, samples=0) or 0)
        version = client.info("server")["redis_version"]
        began = time.perf_counter()  # what tune does: read, parse, re-decide under a knob
        tally = Tally(Knob("max_queue_age_s", 20.0), show=20)
        for entry in entries(client, keys, 0):
            if isinstance(entry, DecisionRecord):
                tally.add(entry)
        tally.result()
        tune_s = time.perf_counter() - began
    per = stream / length
    growth = (kept["used_memory"] - none["used_memory"]) / args.decisions
    mix: dict[str, int] = {}
    for name in kept["routed"]:
        mix[name] = mix.get(name, 0) + 1
    print(f"redis={version} python={platform.python_version()} decisions={args.decisions} "
          f"task={args.task} job_ids=uuid4 date={time.strftime('%Y-%m-%d')}")  # fmt: skip
    print("mix " + " ".join(f"{k}={v}" for k, v in sorted(mix.items())))
    print(f"bytes_per_decision={per:.1f} (MEMORY USAGE of the stream / {length} records)")
    print(f"used_memory_per_decision={growth:.1f} (used_memory growth with records minus "
          "without, per decision)")  # fmt: skip
    print(
        f"gate_lua_us with_records={kept['evalsha_us']:.2f} "
        f"without={none['evalsha_us']:.2f} "
        f"added={kept['evalsha_us'] - none['evalsha_us']:.2f} (INFO commandstats evalsha)"
    )
    rate = length / tune_s
    print(f"tune_records_per_s={rate:.0f} (XRANGE pages, parse, re-decide with a knob: "
          f"{DECISION_RECORD_CAP / rate:.0f} s for a full default cap)")  # fmt: skip
    cap = DECISION_RECORD_CAP
    for rate in (10, 100):
        hours = cap / rate / 3600
        week = rate * WEEK_S
        print(f"rate={rate}/s default_cap={cap} covers_h={hours:.1f} "
              f"memory_mb={cap * per / 1e6:.0f} week_needs_cap={week} "
              f"week_memory_gb={week * per / 1e9:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
