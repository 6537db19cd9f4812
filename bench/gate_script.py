"""How much Redis server time one ``gate.lua`` decision takes, by path, from ``INFO
commandstats``: what every gated publish costs the server, whoever waits for it.

Run on demand (this is not a test)::

    python bench/gate_script.py                    # 10 blocks of 2000 calls per path
    python bench/gate_script.py --calls 500 --blocks 4
    python bench/gate_script.py --baseline old_gate.lua   # the same blocks, another script too

Each path calls the gate script through :meth:`gatekeeper.redis.store.GateStore.score` (the
publish path's own call) in its own namespace of one embedded ``redis-server``:

- ``admit``: ``admit_free/fits``, the free queue's age growing by 1 ms a call (nothing drains
  it, so the window's ``free_age_max_ms`` is written every call, as on a busy queue);
- ``admit_fast``: the same with fast publish (the script pushes a 1 kB message too);
- ``defer``: ``defer/queue_age_cap`` (a waiting member 100 s old, the cap 30 s);
- ``reserved``: ``reserved/dwell_over_slack`` (an 8 s task with 5 s of slack).

Blocks of ``--calls`` calls take turns path by path (the order rotating), after ``--warmup``
untimed calls of each; before each block ``CONFIG RESETSTAT``, after it ``INFO
commandstats``: ``gate_lua_us`` is the median over the blocks of ``evalsha``'s
``usec_per_call``; ``inner_us`` and ``redis_calls`` are the commands the script ran (counted
in commandstats too) per decision. ``empty_evalsha_us`` is a script that returns at once,
called with the admit path's keys and arguments: the floor of any script here.

It checks what it measured before it prints a figure: every timed call decided what its path
claims (decision and reason, from the script's reply), ``evalsha`` ran exactly once per timed
call (no reload, no retry), each call left one decision record (when records are kept), and on
``admit_fast`` every timed message landed in the free list and nowhere else. Otherwise it
prints ``bench: ...`` lines on stderr, no figure, and exits 1. **It runs CONFIG RESETSTAT**:
with ``--redis-url``, use a scratch Redis only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import redis
from options import positive  # bench/options.py (this folder is on sys.path)

import gatekeeper
from gatekeeper.core.ledger import BudgetMode
from gatekeeper.defaults import DECISION_RECORD_CAP
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.push import Push, new_nonce, placeholders
from gatekeeper.redis.scripts import load_lua
from gatekeeper.redis.store import GateCall, GateStore

T0 = 1_800_000_000.0
WINDOW = 2_000_000
PATHS = {
    "admit": "admit_free/fits",
    "admit_fast": "admit_free/fits",
    "defer": "defer/queue_age_cap",
    "reserved": "reserved/dwell_over_slack",
}
"""Each path and the decision every one of its calls must get."""
EMPTY = "return {'admit_free', 'fits', '0', '8.000000', '0', '1'}"
QUEUES = ("free", "defer", "reserved")


@dataclass
class Phase:
    """One path under one script: its store, its clock and what its blocks measured."""

    path: str
    script: str
    store: GateStore
    keys: Keys
    budget_units: float
    records: bool
    """Whether the store keeps decision records (``--record-cap`` above 0)."""
    calls: int = 0
    block_us: list[float] = field(default_factory=list)
    usec: float = 0.0
    inner_usec: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Server microseconds of the commands the script ran, by command."""
    inner_calls: Counter[str] = field(default_factory=Counter)
    decided: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path if self.script == "gate.lua" else f"{self.path}[{self.script}]"

    def next_call(self) -> GateCall:
        """The next call of this path, its clock 1 ms on."""
        self.calls += 1
        now = T0 + self.calls * 0.001
        job = f"{self.calls:032x}"
        slack = 5.0 if self.path == "reserved" else 3600.0
        push = self.push(job) if self.path == "admit_fast" else None
        nonce = push.nonce if push is not None else new_nonce()
        return GateCall(
            now_s=now, window_id=WINDOW, job_id=job, attempt=1, expected_service_s=8.0,
            retry_tax_s=0.0, deadline_slack_s=slack,
            max_queue_age_s=600.0 if self.path.startswith("admit") else 30.0, tokens_in=1000,
            budget_units=self.budget_units, queue_wait_unit_per_second=200.0,
            budget_mode=BudgetMode.EXPOSURE, nonce=nonce, published_s=now,
            deadline_s=now + slack, wait_allowance_s=10.0, task="reports.embed_batch",
            publisher="8.0||0|1|10.0", push=push,
        )  # fmt: skip

    def lists(self) -> tuple[str, str, str]:
        """This phase's broker lists (fast publish), in its namespace."""
        free, defer, reserved = (f"{self.keys.base}:bench:{queue}" for queue in QUEUES)
        return free, defer, reserved

    def push(self, job: str) -> Push:
        """A kombu-like message of about 1 kB, cut at its placeholders."""
        nonce = new_nonce()
        marks = placeholders(nonce)
        headers = {f"gatekeeper_{name}": marks[name] for name in marks if name != "queue"}
        message = {
            "body": "e30=" * 150, "content-encoding": "utf-8",
            "headers": {"id": job, "task": "reports.embed_batch", **headers},
            "properties": {"delivery_info": {"routing_key": marks["queue"]}},
        }  # fmt: skip
        cut = Push.cut(json.dumps(message), nonce, self.lists(), QUEUES)
        assert cut is not None
        return cut


def phases_for(
    client: redis.Redis, scripts: dict[str, str], cap: int, budget_units: float
) -> list[Phase]:
    """A phase per path and script, each in a namespace of its own, its state initialised."""
    phases: list[Phase] = []
    for label, text in scripts.items():
        for path in PATHS:
            keys = Keys("gatekeeper", f"bench-gate-{len(phases)}")
            stale = list(client.scan_iter(f"{keys.base}:*"))
            if stale:  # a scratch Redis's earlier run
                client.delete(*stale)
            client.hset(keys.flags, "initialised_at", "-inf")
            store = GateStore(client, keys, decision_record_cap=cap)
            store._gate = client.register_script(text)  # the script under test
            client.script_load(text)
            if path == "defer":  # the free queue 100 s old: past the 30 s cap
                client.zadd(keys.free_waiting, {"stale:1": (T0 - 100) * 1000})
            phases.append(Phase(path, label, store, keys, budget_units, cap > 0))
    return phases


def run_block(client: redis.Redis, phase: Phase, size: int, timed: bool) -> None:
    """``size`` calls of one phase; timed: between CONFIG RESETSTAT and INFO commandstats."""
    calls = [phase.next_call() for _ in range(size)]
    lists = phase.lists()
    client.delete(*lists)
    records = int(client.xlen(phase.keys.decisions))  # 0 for a missing key
    if timed:
        client.config_resetstat()
    scored = [phase.store.score(call) for call in calls]
    if not timed:
        return
    stats = client.info("commandstats")
    lengths = [int(client.llen(name)) for name in lists]
    evalsha = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0, "usec_per_call": 0.0})
    for result in scored:
        phase.decided[f"{result.decision.value}/{result.reason.value}"] += 1
    if int(evalsha["calls"]) != size:
        phase.problems.append(f"{phase.name}: evalsha ran {evalsha['calls']} times, {size} calls")
    grown = int(client.xlen(phase.keys.decisions)) - records
    if phase.records and grown != size:
        phase.problems.append(f"{phase.name}: {grown} decision records for {size} calls")
    if phase.path == "admit_fast" and lengths != [size, 0, 0]:
        phase.problems.append(f"{phase.name}: free/defer/reserved lists held {lengths}, "
                              f"not [{size}, 0, 0]")  # fmt: skip
    phase.block_us.append(float(evalsha["usec_per_call"]))
    phase.usec += float(evalsha["usec"])
    for name, stat in stats.items():
        if name not in ("cmdstat_evalsha", "cmdstat_config", "cmdstat_info"):
            phase.inner_usec[name.removeprefix("cmdstat_")] += float(stat["usec"])
            phase.inner_calls[name.removeprefix("cmdstat_")] += int(stat["calls"])


def empty_us(client: redis.Redis, phase: Phase, size: int, blocks: int) -> float:
    """evalsha's usec_per_call for a script that returns at once, the admit path's arguments."""
    sha = client.script_load(EMPTY)
    found = []
    for _ in range(blocks):
        calls = [phase.store.gate_call(phase.next_call()) for _ in range(size)]
        client.config_resetstat()
        for keys, args in calls:
            client.evalsha(sha, len(keys), *keys, *args)
        found.append(float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]))
    return statistics.median(found)


def check(phases: list[Phase], timed: int) -> list[str]:
    problems = []
    for phase in phases:
        problems += phase.problems
        claim = PATHS[phase.path]
        wrong = {k: v for k, v in phase.decided.items() if k != claim}
        if wrong or phase.decided[claim] != timed:
            seen = " ".join(f"{k} x{v}" for k, v in sorted(phase.decided.items()))
            problems.append(f"{phase.name}: {timed - phase.decided[claim]} of {timed} timed "
                            f"calls were not {claim}: {seen}")  # fmt: skip
    return problems


@contextmanager
def server(url: str | None) -> Iterator[tuple[redis.Redis, str]]:
    if url is not None:
        yield redis.Redis.from_url(url), f"{url} (scratch)"
        return
    with EmbeddedRedis() as embedded:
        yield redis.Redis.from_url(embedded.url), f"embedded :{embedded.port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=positive, default=2000, help="calls per block")
    parser.add_argument("--blocks", type=positive, default=10, help="timed blocks per path")
    parser.add_argument("--warmup", type=int, default=500, help="untimed calls per path")
    parser.add_argument("--record-cap", type=int, default=DECISION_RECORD_CAP)
    parser.add_argument("--budget-units", type=float, default=1e12)
    parser.add_argument("--baseline", help="another gate.lua to time in the same blocks")
    parser.add_argument("--redis-url", help="a scratch Redis instead of an embedded one")
    parser.add_argument("--commands", action="store_true", help="the inner commands, by path")
    args = parser.parse_args(argv)
    scripts = {"gate.lua": load_lua("gate.lua")}
    if args.baseline:
        with open(args.baseline, encoding="utf-8") as handle:
            scripts["baseline"] = handle.read()
    began = datetime.datetime.now(datetime.timezone.utc)
    with server(args.redis_url) as (client, where):
        phases = phases_for(client, scripts, args.record_cap, args.budget_units)
        for phase in phases:
            if args.warmup:
                run_block(client, phase, args.warmup, timed=False)
        for block in range(args.blocks):
            shift = block % len(phases)
            for phase in phases[shift:] + phases[:shift]:
                run_block(client, phase, args.calls, timed=True)
        problems = check(phases, args.calls * args.blocks)
        if problems:
            for problem in problems:
                print(f"bench: {problem}", file=sys.stderr)
            return 1
        floor = empty_us(client, phases[0], args.calls, args.blocks)
        version = client.info("server")["redis_version"]
    print(f"bench/gate_script.py {began:%Y-%m-%dT%H:%M:%S} calls={args.calls} "
          f"blocks={args.blocks} record_cap={args.record_cap} python={platform.python_version()} "
          f"gatekeeper={gatekeeper.__version__} cpus={os.cpu_count()}")  # fmt: skip
    print(f"redis={where} redis_version={version}")
    timed = args.calls * args.blocks
    for phase in phases:
        us = phase.block_us
        print(f"path={phase.name} decided {PATHS[phase.path]} x{timed} "
              f"gate_lua_us={statistics.median(us):.1f} (blocks: min={min(us):.1f} "
              f"max={max(us):.1f}; mean={phase.usec / timed:.1f}) "
              f"inner_us={sum(phase.inner_usec.values()) / timed:.1f} "
              f"redis_calls={sum(phase.inner_calls.values()) / timed:.2f}")  # fmt: skip
        if args.commands:
            by = sorted(phase.inner_usec, key=lambda name: -phase.inner_usec[name])
            print(f"  {phase.name} inner us/decision: " + " ".join(
                f"{name}={phase.inner_usec[name] / timed:.2f}"
                f"(x{phase.inner_calls[name] / timed:.2f})" for name in by))  # fmt: skip
    print(
        f"empty_evalsha_us={floor:.1f} (a script that returns at once, the admit path's "
        "keys and arguments)"
    )
    medians = (f"{phase.name}={statistics.median(phase.block_us):.1f}" for phase in phases)
    print("gate_lua_us " + " ".join(medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
