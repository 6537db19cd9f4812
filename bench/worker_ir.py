"""How many instructions a gated run's two worker-side scripts take in ``redis-server``,
``start.lua`` and ``finish.lua``, counted by valgrind's callgrind: the same figure on every
run, however loud the machine is.

Run on demand (this is not a test)::

    python bench/worker_ir.py                       # 1000 runs after 500
    python bench/worker_ir.py --baseline-finish old_finish.lua   # A/B another finish.lua
    python bench/worker_ir.py --functions 25        # more of the server's functions

``bench/worker.py`` times real workers, and on a shared 2-core VM its ratio moves by more
than a change to either script is worth. This bench counts what those scripts cost the
server instead, as ``bench/gate_ir.py`` counts ``gate.lua``: one ``redis-server``
(``find_redis_server()``, as the embedded one) under ``valgrind --tool=callgrind
--toggle-collect=evalGenericCommand``. Each run is what a worker does for a gated task that
returns: the gate admits it (``gate.lua``, as ``bench/gate_script.py``'s admit path calls it),
then :class:`gatekeeper.redis.runs.RunLedger` starts it (``start.lua``, with the fields a
worker adds: ``own_fields``) and writes its ``ok`` row (``row_for`` and ``finish``, with its
learned service time, as ``WorkerSide._end`` does). ``--warmup`` whole runs first, uncounted,
grow the windows' rows and the service-time hash; then ``--runs`` attempts are admitted
(uncounted: the counters are zeroed after), all started (counted, then ``callgrind_control
--dump``) and all finished (counted). ``Ir_per_run`` is callgrind's instruction total for one
script over those runs. Under it, the inclusive shares of the server functions
``bench/callgrind.py`` names (never summed: they overlap).

It checks what it counted before it prints a figure: every counted start was the gate's
message (verified, run 1, no dead run) and every counted finish wrote its one ``free``/``ok``
row and cut its record (``kept``); ``evalsha`` ran once per run in each phase; nothing is left
started or in flight; the namespace's rows grew by one per run; and callgrind counted
instructions at all. Otherwise ``bench: ...`` on stderr, no figure, exit 1; without
valgrind, exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import callgrind  # bench/callgrind.py
import redis
from gate_script import WINDOW, Phase  # bench/gate_script.py
from options import positive  # bench/options.py

import gatekeeper
from gatekeeper.core.ledger import Outcome
from gatekeeper.defaults import DECISION_RECORD_CAP
from gatekeeper.ops.embedded import find_redis_server
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger, Started
from gatekeeper.redis.scripts import load_lua
from gatekeeper.redis.store import GateStore

SCRIPTS = ("start.lua", "finish.lua")
OWN = {"task": "reports.embed_batch", "retries": "0", "max_retries": "3",
       "time_limit_s": "0.0", "tokens_out": "0", "worker": "celery@bench"}  # fmt: skip
"""What ``own_fields`` gives ``start.lua`` for the bench's task (gate_script.py's name)."""
RUN_MS = 40
"""How long each run takes on the bench's clock (it starts 5 ms after its admission)."""


@dataclass
class Counts:
    """One server's run: the instructions counted per script, and what was wrong."""

    version: str = ""
    totals: dict[str, int] = field(default_factory=dict)
    outs: dict[str, Path] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def runs_of(client: redis.Redis, keys: Keys, scripts: dict[str, str]) -> RunLedger:
    runs = RunLedger(client, keys, window_seconds=900, queue_wait_unit_per_second=200.0,
                     wait_allowance_s=10.0, decision_record_cap=DECISION_RECORD_CAP)  # fmt: skip
    runs._start = client.register_script(scripts["start.lua"])  # the scripts under test
    runs._finish = client.register_script(scripts["finish.lua"])
    return runs


def admit(phase: Phase, count: int) -> list[tuple[str, str, int]]:
    """``count`` admissions of the gate's admit path: each job, its nonce and admission ms."""
    admitted = []
    for _ in range(count):
        call = phase.next_call()
        result = phase.store.score(call)
        if (result.decision.value, result.reason.value) == ("admit_free", "fits"):
            admitted.append((call.job_id, call.nonce, round(call.now_s * 1000)))
        else:
            phase.problems.append(f"gate.lua decided {result.decision.value}/"
                                  f"{result.reason.value}, not admit_free/fits")  # fmt: skip
    return admitted


def start_all(runs: RunLedger, admitted: list[tuple[str, str, int]], problems: list[str],
              ) -> list[tuple[str, Started]]:  # fmt: skip
    """Each admitted job started as a worker starts it, 5 ms after its admission."""
    started = []
    for job, nonce, at in admitted:
        one = runs.start(job, 1, nonce, OWN, at + 5)
        if one.record is None or one.run != 1 or one.dead is not None:
            problems.append(
                f"start of {job}: run={one.run} refused={one.refused!r} "
                f"dead run={one.dead_run}, not run 1 of the gate's message"
            )
        started.append((job, one))
    return started


def finish_all(runs: RunLedger, started: list[tuple[str, Started]], problems: list[str]) -> None:
    """Each started run's ``ok`` row, ``RUN_MS`` after its start, with its service time."""
    for job, one in started:
        record = one.record
        if record is None:
            continue
        now = record.started_ms + RUN_MS
        row = runs.row_for(job, 1, record, Outcome.OK, now)
        done = runs.finish(row, one.run, record, now, service_s=RUN_MS / 1000)
        if not done.written or (row.path.value, row.outcome.value) != ("free", "ok"):
            problems.append(
                f"finish of {job}: written={done.written} "
                f"{row.path.value}/{row.outcome.value}, not one free/ok row"
            )


def evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {"calls": 0})["calls"])


def counted(binary: str, scripts: dict[str, str], args: argparse.Namespace, scratch: Path,
            label: str) -> Counts:  # fmt: skip
    """Both scripts' counts on a server of their own, ``args.runs`` runs after the warm-up."""
    counts = Counts()
    out = scratch / f"callgrind.{label}"
    with callgrind.server(binary, out) as counting:
        client = counting.client
        counts.version = str(client.info("server")["redis_version"])
        keys = Keys("gatekeeper", "bench-worker-ir")
        client.hset(keys.flags, "initialised_at", "-inf")
        store = GateStore(client, keys, decision_record_cap=DECISION_RECORD_CAP)
        phase = Phase("admit", "gate.lua", store, keys, 1e12, True)
        runs = runs_of(client, keys, scripts)
        problems = counts.problems
        if args.warmup:
            finish_all(runs, start_all(runs, admit(phase, args.warmup), problems), problems)
        rows = int(client.llen(keys.window_rows(WINDOW)))
        admitted = admit(phase, args.runs)
        client.config_resetstat()
        counting.control("--zero")
        started = start_all(runs, admitted, problems)
        if (ran := evalsha_calls(client)) != args.runs:
            problems.append(f"start.lua: evalsha ran {ran} times, {args.runs} runs")
        counting.control("--dump")  # the starts' counts, in <out>.1
        client.config_resetstat()
        finish_all(runs, started, problems)
        if (ran := evalsha_calls(client)) != args.runs:
            problems.append(f"finish.lua: evalsha ran {ran} times, {args.runs} runs")
        grown = int(client.llen(keys.window_rows(WINDOW))) - rows
        if grown != args.runs:
            problems.append(f"finish.lua: {grown} rows for {args.runs} runs")
        left = (int(client.zcard(keys.started)), int(client.hlen(keys.inflight)))
        if left != (0, 0):
            problems.append(f"started, inflight = {left} after every run ended, not (0, 0)")
        uncut = [job for job, _ in started if not client.hexists(keys.run(job, 1), "kept")]
        if uncut:
            problems.append(f"{len(uncut)} records not cut after their row, e.g. {uncut[0]}")
    counts.outs = {"start.lua": out.with_name(f"{out.name}.1"), "finish.lua": out}
    counts.totals = {name: callgrind.total(path) for name, path in counts.outs.items()}
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=positive, default=1000, help="counted runs (1000)")
    parser.add_argument("--warmup", type=int, default=500, help="uncounted runs first (500)")
    parser.add_argument("--baseline-start", help="another start.lua, counted the same way")
    parser.add_argument("--baseline-finish", help="another finish.lua, counted the same way")
    parser.add_argument(
        "--functions", type=int, default=0,
        help="then the N server functions with most instructions, per script",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup: expected 0 or more, got {args.warmup}")
    if not callgrind.have_valgrind():
        print("bench: valgrind is not installed (Debian: apt-get install valgrind)",
              file=sys.stderr)  # fmt: skip
        return 2
    ours = {name: load_lua(name) for name in SCRIPTS}
    sets = {"": ours}
    if args.baseline_start or args.baseline_finish:
        other = dict(ours)
        for name, given in (("start.lua", args.baseline_start),
                            ("finish.lua", args.baseline_finish)):  # fmt: skip
            if given:
                other[name] = Path(given).read_text(encoding="utf-8")
        sets["[baseline]"] = other
    binary = find_redis_server()
    began = datetime.datetime.now(datetime.timezone.utc)
    results: list[tuple[str, float, dict[str, float], list[tuple[str, float]]]] = []
    problems: list[str] = []
    version = ""
    with tempfile.TemporaryDirectory(prefix="gatekeeper-bench-worker-ir-") as scratch:
        for label, scripts in sets.items():
            counts = counted(binary, scripts, args, Path(scratch), label or "ours")
            version = counts.version
            problems += [f"{label or 'ours'}: {problem}" for problem in counts.problems]
            for name in SCRIPTS:
                total = counts.totals[name]
                shown = name.removesuffix(".lua") + label
                if total <= 0:
                    problems.append(f"{shown}: callgrind counted no instruction (is "
                                    f"evalGenericCommand a symbol of {binary}?)")  # fmt: skip
                    continue
                found, top = callgrind.shares(counts.outs[name], total, args.functions)
                results.append((shown, total / args.runs, found, top))
    if problems:
        for problem in problems[:20]:
            print(f"bench: {problem}", file=sys.stderr)
        return 1
    print(f"bench/worker_ir.py {began:%Y-%m-%dT%H:%M:%S} runs={args.runs} warmup={args.warmup} "
          f"record_cap={DECISION_RECORD_CAP} python={platform.python_version()} "
          f"gatekeeper={gatekeeper.__version__}")  # fmt: skip
    print(f"redis={binary} redis_version={version}")
    claims = {"start": "every start the gate's message, run 1, no dead run",
              "finish": "every finish one free/ok row written, the record cut"}  # fmt: skip
    for name, per_run, found, top in results:
        split = " ".join(f"{function}={share:.1%}" for function, share in found.items())
        print(f"script={name}.lua {claims[name.split('[')[0]]} x{args.runs} "
              f"Ir_per_run={per_run:.0f} ({split or 'no function named'})")  # fmt: skip
        for function, share in top:
            print(f"  {function} {share:.1%} ({share * per_run:.0f} Ir a run, inclusive)")
    figures = {name: per_run for name, per_run, _, _ in results}
    for label in sets:
        figures[f"total{label}"] = sum(figures[name + label] for name in ("start", "finish"))
    print("worker_lua_ir " + " ".join(f"{name}={value:.0f}" for name, value in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
