"""How many instructions one publish takes in the publishing process, plain and gated,
counted by valgrind's callgrind: a figure that moves by about 0.2% between runs where
``bench/publish.py``'s ratio moves by 5% or more on a shared VM.

Run on demand (this is not a test)::

    python bench/publish_ir.py                     # runs of 200 and 1200 publishes of each kind
    python bench/publish_ir.py --short 100 --long 600

Each kind (``plain``, ``gated``: ``bench/publish.py``'s tasks, on one embedded
``redis-server`` that is broker and gate, fast publish and ``publish_replies`` as configured)
is published in two processes side by side under ``valgrind --tool=callgrind``, ``--short``
and ``--long`` publishes after the same warm-up, callgrind counting only from just before the
publishes to just after the last one's reply is read and its line written (``callgrind_control
--instr``): the difference of the two totals over ``--long - --short`` is one publish's, the
instrumentation's switching cancelled out. The lines' thread and the settler are counted too
(every thread of the process is), with their timers set out of the way (``log_buffer_s = 5``;
the settler's pass 1,000 s): each run ends with the lines' flush and every owed reply read.
``PYTHONHASHSEED=0``. The Redis server is not counted, nor the checks (they grow with the
count), but ``bench/publish.py``'s probes are: the wrappers that record each routing
(about 14,000 instructions of a plain publish and 18,000 of a gated one by a reviewer's
count, 2026-12-07), alike in both versions of an A/B. The line ``gatekeeper measured:``
names the package the counted processes imported (``PYTHONPATH`` picks another checkout).

It checks each counted process before it prints a figure (as ``bench/publish.py`` checks its
timed publishes): every gated publish decided ``admit_free/fits`` on the path the settings
claim, each owed reply read and none held, one decision line each; no plain one decided.
Otherwise ``bench: ...`` on stderr, no figure, exit 1; without valgrind, exit 2.

Instructions are not microseconds (a cache miss costs more than an add; the syscalls' kernel
time is not counted, nor the wait for Redis that a plain publish has and a gated one does
not), so ``ratio_ir`` is not the ratio the issue sets; it is the way to compare two versions
of the code on a loud machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import celery

import gatekeeper

HERE = Path(__file__).resolve().parent
COUNTED_ENV = {"PYTHONHASHSEED": "0", "GATEKEEPER_LOG_BUFFER_S": "5",
               "GATEKEEPER_FLAG_CACHE_S": "60"}  # fmt: skip
"""What makes two runs of the same code count the same (see the module docstring)."""
WARMUP = 100
REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def inner(kind: str, count: int) -> int:
    """One counted process: warm up, publish ``count`` of ``kind``, check, print the checks
    as one JSON line (problems: empty when it measured what it claims)."""
    sys.path.insert(0, str(HERE))
    import publish  # bench/publish.py

    from gatekeeper.redis import owing

    problems = [] if hasattr(owing, "SETTLE_AFTER_S") else ["this gatekeeper has no settler"]
    owing.PASS_S = owing.SETTLE_AFTER_S = 1000.0  # read by each next publish and at the end
    lines: list[str] = []
    with publish.redis_urls(None, False) as (broker_url, gate_url, _):
        bench = publish.Bench(broker_url, gate_url, separate=False, fast="auto")
        try:
            bench.publish(kind, WARMUP)
            bench.trim()
            bench.probes.clear()
            phases = {name: publish.Phase(name) for name in ("plain", "gated")}
            _instructions("on")  # counted: the publishes, their replies read, their lines
            bench.publish(kind, count)
            _instructions("off")  # not counted: the checks (which grow with the count)
            bench.probes.take(phases[kind])
            phases[kind].count = count
            problems += publish.check(bench, phases)
            lines = publish.checked_lines(bench, phases) if kind == "gated" else []
        finally:
            bench.close()
    print(json.dumps({"problems": problems, "lines": lines,
                      "gatekeeper": str(Path(gatekeeper.__file__).parent)}))  # fmt: skip
    return 0


def _instructions(state: str) -> None:
    """callgrind's instrumentation of this process on or off (its start-up runs without)."""
    subprocess.run(["callgrind_control", f"--instr={state}", str(os.getpid())], check=True,
                   capture_output=True, timeout=60)  # fmt: skip


def counted(kind: str, count: int) -> tuple[int, list[str], list[str], str]:
    """(instructions, problems, checked lines, the gatekeeper measured) of one process under
    callgrind."""
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               "--callgrind-out-file=/dev/null",
               sys.executable, str(Path(__file__).resolve()), "--inner", kind,
               str(count)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                            env={**os.environ, **COUNTED_ENV})  # fmt: skip
    refs = REFS.search(result.stderr)
    reports = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or refs is None or len(reports) != 1:
        tail = (result.stdout + result.stderr).strip().splitlines()[-5:]
        return 0, [f"{kind} x{count}: the counted process failed: {' | '.join(tail)}"], [], ""
    report = json.loads(reports[0])
    found = [f"{kind} x{count}: {problem}" for problem in report["problems"]]
    return int(refs.group(1).replace(",", "")), found, report["lines"], report["gatekeeper"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", type=int, default=200, help="publishes in the short run")
    parser.add_argument("--long", type=int, default=1200, help="publishes in the long run")
    parser.add_argument("--inner", nargs=2, metavar=("KIND", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inner:
        return inner(args.inner[0], int(args.inner[1]))
    if not 0 < args.short < args.long:
        parser.error("--short must be positive and less than --long")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("bench: valgrind is not installed (Debian: apt-get install valgrind)",
              file=sys.stderr)  # fmt: skip
        return 2
    print(
        f"bench/publish_ir.py {datetime.datetime.now().isoformat(timespec='seconds')} "
        f"short={args.short} long={args.long} python={platform.python_version()} "
        f"celery={celery.__version__} gatekeeper={gatekeeper.__version__}"
    )
    per_publish: dict[str, float] = {}
    problems: list[str] = []
    checked: list[str] = []
    measured: set[str] = set()
    for kind in ("gated", "plain"):  # the gated runs first: a run that fails stops the bench
        with ThreadPoolExecutor(2) as pool:  # the two runs of a kind side by side
            short, long = pool.map(counted, (kind, kind), (args.short, args.long))
        problems += short[1] + long[1]
        checked = long[2] or checked
        measured |= {short[3], long[3]} - {""}
        per_publish[kind] = (long[0] - short[0]) / (args.long - args.short)
        if problems:
            break
    if problems or min(per_publish.values()) <= 0:
        for problem in problems or ["callgrind counted no instructions per publish"]:
            print(f"bench: {problem}", file=sys.stderr)
        return 1
    plain, gated = per_publish["plain"], per_publish["gated"]
    print(f"gatekeeper measured: {', '.join(sorted(measured))}")
    for line in checked:
        print(line)
    print(f"plain: instructions_per_publish={plain:,.0f}")
    print(f"gated: instructions_per_publish={gated:,.0f}")
    print(f"gate_instructions_per_publish={gated - plain:,.0f} (gated minus plain)")
    print(f"ratio_ir={plain / gated:.3f} (plain/gated instructions per publish; not the timed "
          "ratio: no kernel time, no wait for Redis)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
