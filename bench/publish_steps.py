"""Where a gated publish's time goes, step by step, beside a plain publish's (issue 15).

Run on demand (this is not a test)::

    python bench/publish_steps.py [-n 6000] [--fast-publish auto|off] [--warmup 2000]
                                  [--redis-url URL]

``bench/publish.py``'s app (its ``Bench``: one embedded ``redis-server``, broker and gate;
``--redis-url``: that scratch Redis for both), warmed up by one of its runs (``-n WARMUP
--rounds 2``, untimed here). Then ``N`` gated
publishes with a timer wrapped around each of a few of gatekeeper's functions (below, by
path), and ``N`` plain ones with a timer around redis-py's send and read of kombu's
``LPUSH``. Each line is a step's time per publish (its calls' total over ``N``) and its calls
per publish; steps are nested as indented (an indented step runs inside the one above it:
never sum a column). The lines' thread renders and writes the decision lines on the same
interpreter (the GIL): its time is the publishes' too, and is shown per publish. Time
another thread of the process holds the GIL lands in the step that was in a system call then:
the lines' thread's shows in ``sendall`` and the reply's read (``log_buffer_s = 0``, the lines
written at once, takes it out of them and puts it in ``Pipeline._finish``). A wrapper costs
about half a microsecond a call, in its step and in the steps around it. The gated and the
plain publishes run one block after the other, not in turn: their ``delay()`` figures move
with the machine between the blocks (``publish.py`` measures the ratio).

cProfile (``publish.py --profile``) slows every Python call and so overstates the gate's own
Python against the system calls; these timers slow only the functions they wrap.

It checks what it measured before printing: every timed gated publish was decided
``admit_free/fits`` and took the path the run claims (fast: its reply read later, each step
called once a publish; ordinary: the script's reply read at once, Celery's own publish).
Otherwise ``bench: ...`` on stderr, no figure, exit 1.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from options import positive  # bench/options.py (this folder is on sys.path)
from publish import Bench, label  # bench/publish.py

from gatekeeper.lines import flush as flush_lines
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis import wire
from gatekeeper.redis.owing import settle_all

Step = tuple[str, str, str]
"""(module, ``Class.attribute`` or function name, what it is, indented by its nesting)."""
DRAIN = "decision lines rendered, written (the lines' thread, and the last flush)"
PROBED = "probed"
"""A step timed by ``publish.py``'s probes, not by a wrapper of this bench."""
HOOK = "hook less Celery's"
"""``Probes.hook_ns``: gatekeeper's wrapped sender, less Celery's own sender inside it."""
CELERY = "Celery's sender"
"""``Probes.sender_ns``: Celery's own ``send_task_message`` under the hook."""

LPUSH: tuple[Step, ...] = (
    ("redis.connection", "AbstractConnection.send_packed_command",
     "    redis-py sends kombu's LPUSH"),
    ("redis.connection", "AbstractConnection.read_response", "    its reply waited for, read"),
)  # fmt: skip
"""Inside kombu's put: what a publish through it waits for."""

FAST: tuple[Step, ...] = (
    (PROBED, HOOK, "gatekeeper's hook, less Celery's sender inside it"),
    ("gatekeeper.redis.gate", "Pipeline.unscripted", "  flags, inputs, headers (steps 1-3)"),
    ("gatekeeper.celery.hook", "Installed._fits", "  fast publish's checks (observers, queues)"),
    ("gatekeeper.redis.push", "Push.cut", "  the message cut at its placeholders"),
    ("gatekeeper.redis.store", "GateStore.gate_call", "  the script's keys and arguments"),
    ("gatekeeper.redis.later", "send", "  the call sent; the reply before it read and settled"),
    ("gatekeeper.redis.wire", "Channel.send", "    hiredis packs it, sendall"),
    ("gatekeeper.redis.wire", "Channel.owed_reply", "    the reply before it read"),
    ("gatekeeper.redis.later", "Owed.settle", "    that reply settled: routing, line queued"),
    ("gatekeeper.redis.gate", "Pipeline._finish", "      the decision's headers and line queued"),
    (PROBED, CELERY, "Celery's own sender, to kombu's channel (caught, serialized there)"),
    ("gatekeeper.lines", "Lines._drain", DRAIN),
)  # fmt: skip
ORDINARY: tuple[Step, ...] = (
    (PROBED, HOOK, "gatekeeper's hook, less Celery's sender inside it"),
    ("gatekeeper.redis.gate", "Pipeline.unscripted", "  flags, inputs, headers (steps 1-3)"),
    ("gatekeeper.redis.store", "GateStore.score", "  the script called, its reply waited for"),
    ("gatekeeper.redis.store", "GateStore.gate_call", "    the script's keys and arguments"),
    ("gatekeeper.redis.wire", "Channel.send", "    hiredis packs it, sendall"),
    ("gatekeeper.redis.wire", "Channel.read", "    its reply waited for and read"),
    ("gatekeeper.redis.gate", "Pipeline._finish", "  the decision's headers and line queued"),
    (PROBED, CELERY, "Celery's own sender (its publish)"),
    ("kombu.transport.redis", "Channel._put", "  kombu's Redis channel puts the message"),
    *LPUSH,
    ("gatekeeper.lines", "Lines._drain", DRAIN),
)  # fmt: skip
PLAIN: tuple[Step, ...] = (
    (PROBED, HOOK, "gatekeeper's hook, passing it on"),
    (PROBED, CELERY, "Celery's own sender (its publish)"),
    ("kombu.transport.redis", "Channel._put", "  kombu's Redis channel puts the message (fast "
     "publish does not)"),
    *LPUSH,
)  # fmt: skip
ONCE_A_PUBLISH = {
    "fast": (HOOK, "Installed._fits", CELERY, "Push.cut", "Pipeline.unscripted",
             "GateStore.gate_call", "send", "Channel.send", "Channel.owed_reply", "Owed.settle",
             "Pipeline._finish"),
    "ordinary": (HOOK, "Pipeline.unscripted", "GateStore.score", "GateStore.gate_call",
                 "Channel.send", "Channel.read", "Pipeline._finish", CELERY, "Channel._put"),
    "plain": (HOOK, CELERY, "Channel._put"),
}  # fmt: skip
"""The steps each timed publish calls exactly once on its path (else it is not that path).
Not redis-py's: the flags, read again every few seconds, go through it too (at least once)."""
NEVER = (
    ("gatekeeper.redis.gate", "Pipeline.push_reserved"),  # fallback.lua: a reply lost or failed
    ("gatekeeper.redis.store", "GateStore._reply_now"),  # the script asked through redis-py
)
"""Functions no timed gated publish may call: a publish that did took another path."""


@contextmanager
def timed(steps: tuple[Step, ...], spent: Counter[str], calls: Counter[str]) -> Iterator[None]:
    """Each step's function wrapped by a timer while inside; put back after."""
    clock = time.perf_counter_ns
    saved: list[tuple[Any, str, Any]] = []

    def wrapper(function: Callable[..., Any], name: str) -> Callable[..., Any]:
        def timer(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += clock() - start
                calls[name] += 1

        return timer

    try:
        for module, name, _ in [*steps, *((module, name, "") for module, name in NEVER)]:
            if module == PROBED:
                continue
            owner: Any = importlib.import_module(module)
            *path, attribute = name.split(".")
            for part in path:
                owner = getattr(owner, part)
            function = owner.__dict__[attribute] if path else getattr(owner, attribute)
            saved.append((owner, attribute, function))
            kind = type(function)
            if kind in (classmethod, staticmethod):  # wrapped inside, kept what it is
                setattr(owner, attribute, kind(wrapper(function.__func__, name)))
            else:
                setattr(owner, attribute, wrapper(function, name))
        yield
    finally:
        for owner, attribute, function in reversed(saved):
            setattr(owner, attribute, function)


Spent = tuple[float, Counter[str], Counter[str]]
"""µs a publish; each step's nanoseconds in all; each step's calls."""


def measure(bench: Bench, kind: str, n: int, steps: tuple[Step, ...]) -> Spent:
    """``n`` publishes of one kind with ``steps`` timed: µs a publish, and each step's total
    nanoseconds and calls (the probes cleared first: they see these publishes only)."""
    bench.trim()
    settle_all()
    flush_lines()
    bench.probes.clear()
    spent: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    with timed(steps, spent, calls):
        seconds = bench.publish(kind, n)  # gated: its last reply settled, its lines written
    for name, samples in ((HOOK, bench.probes.hook_ns), (CELERY, bench.probes.sender_ns)):
        spent[name], calls[name] = sum(samples), len(samples)
    bench.trim()
    return seconds / n * 1e6, spent, calls


def problems(bench: Bench, fast: bool, n: int, calls: Counter[str]) -> list[str]:
    """Why the gated publishes were not the path the run claims, decided admit_free/fits."""
    probes = bench.probes
    found = [f"{name} called {calls[name]} times: not the path claimed" for _, name in NEVER
             if calls[name]]  # fmt: skip
    routings = [*probes.routings, *probes.settled]
    labels = ["held (its fallback push failed)" if r is None else label(r) for r in routings]
    bad = Counter(text for text in labels if text != "admit_free/fits")
    if len(routings) != n or bad:
        found.append(f"{len(routings)} routings for {n} gated publishes, not admit_free/fits: "
                     f"{dict(bad) or 'none'}")  # fmt: skip
    if fast and probes.owed != n:
        found.append(f"{probes.owed} of {n} gated publishes had their reply read later (fast)")
    if not fast and probes.owed:
        found.append(f"{probes.owed} gated publishes took the fast path (claimed: ordinary)")
    for name in ONCE_A_PUBLISH["fast" if fast else "ordinary"]:
        if calls[name] != n:
            found.append(f"{name} called {calls[name]} times for {n} gated publishes")
    return found


def plain_problems(bench: Bench, n: int, calls: Counter[str]) -> list[str]:
    """Why the plain publishes were not Celery's own, one ``LPUSH`` each."""
    probes = bench.probes
    found = []
    if probes.routings or probes.owed:
        found.append(f"{len(probes.routings) + probes.owed} plain publishes were gated")
    for name in ONCE_A_PUBLISH["plain"]:
        if calls[name] != n:
            found.append(f"{name} called {calls[name]} times for {n} plain publishes")
    for name in ("AbstractConnection.send_packed_command", "AbstractConnection.read_response"):
        if calls[name] < n:
            found.append(f"{name} called {calls[name]} times for {n} plain publishes")
    return found


def lines_for(steps: tuple[Step, ...], measured: Spent, n: int) -> list[str]:
    us, spent, calls = measured
    width = max(len(what) for _, _, what in steps)
    out = [f"  delay() {us:.1f} us a publish (the whole call)"]
    for _, name, what in steps:
        out.append(f"  {what:<{width}} {spent[name] / n / 1000:7.1f} us "
                   f"x{calls[name] / n:.2f}  ({name})")  # fmt: skip
    return out


@contextmanager
def redis_url(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with EmbeddedRedis() as both:
        yield both.url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=positive, default=6000, help="publishes of each kind")
    parser.add_argument("--fast-publish", choices=("auto", "off"), default="auto",
                        help="auto (default): fast publish; off: the ordinary path")  # fmt: skip
    parser.add_argument("--warmup", type=positive, default=2000,
                        help="publishes of each kind first, untimed (default 2000)")  # fmt: skip
    parser.add_argument("--redis-url", help="a scratch Redis as broker and gate (its celery and "
                        "free lists are deleted); default: an embedded redis-server")  # fmt: skip
    args = parser.parse_args(argv)
    fast = args.fast_publish != "off"
    if not wire.RAW:  # the gate's line would go through redis-py, timed as Celery's publish
        print("bench: needs hiredis (pip install hiredis): without it the gate's calls go "
              "through redis-py, whose timers count Celery's publish", file=sys.stderr)  # fmt: skip
        return 2
    print(f"bench/publish_steps.py {datetime.datetime.now().isoformat(timespec='seconds')} "
          f"n={args.n} fast_publish={args.fast_publish}")  # fmt: skip
    with redis_url(args.redis_url) as url:
        bench = Bench(url, url, separate=False, fast=args.fast_publish)
        try:
            bench.run(args.warmup, 2, "call")  # warm-up (publish.py's run, untimed here)
            steps = FAST if fast else ORDINARY
            gated = measure(bench, "gated", args.n, steps)
            found = problems(bench, fast, args.n, gated[2])
            plain = measure(bench, "plain", args.n, PLAIN)
            found += plain_problems(bench, args.n, plain[2])
        finally:
            bench.close()
    if found:
        for problem in found:
            print(f"bench: {problem}", file=sys.stderr)
        return 1
    path = "fast" if fast else "ordinary"
    print(f"gated ({path} path; every publish admit_free/fits, each step shown x1.00 checked "
          f"to be called once a publish):")  # fmt: skip
    print("\n".join(lines_for(steps, gated, args.n)))
    print("plain:")
    print("\n".join(lines_for(PLAIN, plain, args.n)))
    print(f"gated_minus_plain_us={gated[0] - plain[0]:.1f} (delay() a publish)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
