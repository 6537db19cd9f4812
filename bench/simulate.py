"""How long ``gatekeeper simulate`` takes on a night of 10,000 jobs (issue 14: under 10 s).

Run on demand (this is not a test)::

    python bench/simulate.py [--jobs 10000] [--rounds 3] [--limit-s 10] [--config FILE]

Each round runs the command as a user does, ``python -m gatekeeper simulate --config FILE
--jobs N`` in a fresh process (interpreter start and imports included), and times it with the
wall clock; the CPU time the child used is read from ``getrusage`` (on a busy machine the two
differ). Then, in this process, ``simulate_lines`` alone (the four policies and the tuning,
without start-up) is timed once.

It checks what it measured before it prints a number: every round must exit 0 and print a
``night`` line saying ``jobs=N``, then exactly one line per policy, ``always_free``,
``always_reserved``, ``gate`` and ``gate_tuned`` in that order, each starting ``policy=NAME
missed=INT wasted_tokens=INT reserved_s=NUM`` (``gate_tuned`` naming its knob); every round's
output must be byte-identical (same seed, same output), and the same as the in-process run.
Otherwise it prints one ``bench: ...`` line per failed check on stderr, no figure, and exits
with status 1. It also exits 1, after printing the figures, when the slowest round took longer
than ``--limit-s``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("always_free", "always_reserved", "gate", "gate_tuned")
HEAD = re.compile(r"^policy=(?P<name>[a-z_]+) missed=\d+ wasted_tokens=\d+ reserved_s=[\d.]+ ")
TUNED = re.compile(r" knob=[a-z_]+ value=\S+ tuned_on_seed=-?\d+$")


def check_output(stdout: str, jobs: int) -> list[str]:
    """What is wrong with one run's output (nothing: an empty list)."""
    lines = stdout.splitlines()
    if not lines or not lines[0].startswith("night ") or f" jobs={jobs} " not in lines[0]:
        return [f"the first line is not a night line with jobs={jobs}: {lines[:1]!r}"]
    problems = []
    names = []
    for line in lines[1:]:
        match = HEAD.match(line)
        if match is None:
            problems.append(f"not a policy line: {line!r}")
            continue
        names.append(match["name"])
        if match["name"] == "gate_tuned" and not TUNED.search(line):
            problems.append(f"gate_tuned does not name its knob: {line!r}")
    if tuple(names) != POLICIES:
        problems.append(f"policy lines {names}, expected {list(POLICIES)} once each, in order")
    return problems


def child_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit-s", type=float, default=10.0)
    parser.add_argument("--config", type=Path, default=REPO / "config" / "gatekeeper.toml")
    args = parser.parse_args()
    command = [sys.executable, "-m", "gatekeeper", "simulate", "--config", str(args.config),
               "--jobs", str(args.jobs)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    walls, cpus, outputs, problems = [], [], [], []
    for _ in range(args.rounds):
        cpu, start = child_cpu_s(), time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        cpus.append(child_cpu_s() - cpu)
        outputs.append(done.stdout)
        if done.returncode != 0:
            problems.append(f"exit status {done.returncode}: {done.stderr.strip()[-300:]}")
        problems.extend(check_output(done.stdout, args.jobs))

    sys.path.insert(0, str(REPO))
    from gatekeeper.ops.simulate import simulate_lines
    from gatekeeper.ops.simulator import GateKnobs
    from gatekeeper.settings import load_settings

    for name in [k for k in os.environ if k.startswith("GATEKEEPER_")]:
        del os.environ[name]  # as the rounds ran
    settings = load_settings(args.config)
    night = settings.simulate.model_copy(update={"jobs": args.jobs})
    start = time.perf_counter()
    in_process = simulate_lines(GateKnobs.of(settings), night)
    in_process_s = time.perf_counter() - start

    if len(set(outputs)) != 1:
        problems.append("the rounds printed different outputs for the same seed")
    elif outputs[0] != "\n".join(in_process) + "\n":
        problems.append("the command's output differs from simulate_lines in process")
    if problems:
        for problem in dict.fromkeys(problems):
            print(f"bench: {problem}", file=sys.stderr)
        return 1
    print(
        f"python={platform.python_version()} cpus={os.cpu_count()} load1={os.getloadavg()[0]:.2f}"
    )
    print(outputs[0], end="")
    print(
        f"simulate jobs={args.jobs} rounds={args.rounds} policies={len(POLICIES)} "
        f"wall_s min={min(walls):.2f} median={statistics.median(walls):.2f} "
        f"max={max(walls):.2f} cpu_s median={statistics.median(cpus):.2f} "
        f"in_process_s={in_process_s:.2f} limit_s={args.limit_s:g}"
    )
    if max(walls) > args.limit_s:
        print(f"bench: the slowest round took {max(walls):.2f} s > {args.limit_s:g} s",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
