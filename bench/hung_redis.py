"""Publish latency while the gate's Redis is hung (SIGSTOPped), the broker on another server.

Run on demand (this is not a test)::

    python bench/hung_redis.py [--seconds 4] [--breaker-open-s 1.0] [--redis-timeout-s 0.5]

Two embedded ``redis-server`` processes: the broker, and the gate's Redis. One Celery app
publishes a ``@gatekeeper.gated`` task (the gate on for every job) once to warm up, then the
gate's server is stopped with SIGSTOP (the kernel still accepts connections; nothing is
answered) and one thread publishes as fast as it can for ``--seconds``. The first second is
not timed: it holds the one publish that waits out the gate's timeout and opens the breaker.
Then it prints the p50/p99/max of ``task.delay()`` over the rest (the target: p99 under
20 ms), the publishes per second, and the breaker's count of calls that waited.

It checks what it measured before it prints a number: every publish made while the server
was stopped must have landed in the broker's ``reserved`` list with
``gatekeeper_reason=gate_unavailable`` (and none in ``free`` besides the warm-up), and the
gate's server must really have been stopped throughout (its process state ``T`` in
``/proc`` before and after the loop, where there is one, and a ``PING`` refused an answer
after the loop). Otherwise it prints one ``bench: ...`` line per failed check on stderr, no
latency figure, and exits with status 1. ``--breaker-open-s 0`` (no breaker) measures the
behaviour before the breaker: every publish waits the timeout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import celery
import redis
from celery import Celery

import gatekeeper
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.settings import GatekeeperSettings

UNTIMED_S = 1.0
"""The first second after the stop is not timed: the breaker opens in it."""


def process_state(pid: int) -> str | None:
    """The process's state letter from ``/proc`` (``T``: stopped), None without ``/proc``."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return None


def answers(port: int, timeout_s: float = 0.2) -> bool:
    """Whether the server answers a PING within ``timeout_s`` (a stopped one does not)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def make_app(broker_url: str, gate_url: str, args: argparse.Namespace) -> tuple[Celery, Any]:
    app = Celery("bench_hung", broker=broker_url)
    app.conf.task_default_queue = "celery"

    @gatekeeper.gated(expected_service_s=1.0, tokens_in=10, deadline_s=3600)
    @app.task(name="bench.gated", shared=False, max_retries=1)  # type: ignore[untyped-decorator]
    def gated_task(x: int) -> int:
        return x

    settings = GatekeeperSettings(
        redis_url=gate_url, dwell_gate_enabled=True, canary_percent=100, budget_units=1e12,
        queue_wait_unit_per_second=0, max_queue_age_s=1e9, flag_cache_s=0.2,
        redis_timeout_s=args.redis_timeout_s, breaker_open_s=args.breaker_open_s,
    )  # fmt: skip
    # The decision logger binds sys.stderr when it is built: build it on /dev/null (every
    # decision line is still rendered and written).
    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    saved, sys.stderr = sys.stderr, devnull
    try:
        installed = gatekeeper.install(app, settings)
    finally:
        sys.stderr = saved
    return app, installed


def landed(client: redis.Redis, queue: str) -> dict[str, str]:
    """Task id -> gatekeeper_reason of every message in a kombu queue's list."""
    found = {}
    for raw in client.lrange(queue, 0, -1):
        headers = json.loads(raw)["headers"]
        found[headers["id"]] = headers.get("gatekeeper_reason", "")
    return found


def run(args: argparse.Namespace) -> int:
    with EmbeddedRedis() as broker_server, EmbeddedRedis() as gate_server:
        assert gate_server.process is not None
        pid = gate_server.process.pid
        app, installed = make_app(broker_server.url, gate_server.url, args)
        # A scratch namespace, like a new deployment: initialised, so the warm-up is admitted.
        installed.flags.initialise(
            "bench: a scratch namespace", "bench", time.time(), open_path=True
        )
        delay = app.tasks["bench.gated"].delay
        broker = redis.Redis.from_url(broker_server.url)
        warm = delay(0).id
        samples: list[tuple[float, int, str]] = []  # (since the stop, ns, task id)
        problems: list[str] = []
        os.kill(pid, signal.SIGSTOP)
        try:
            state_before = process_state(pid)
            clock = time.perf_counter_ns
            start = time.monotonic()
            while (since := time.monotonic() - start) < args.seconds:
                t0 = clock()
                job = delay(1).id
                samples.append((since, clock() - t0, job))
            state_after = process_state(pid)
            answered = answers(gate_server.port)
        finally:
            os.kill(pid, signal.SIGCONT)
        breaker = installed.store.breaker
        if state_before not in (None, "T") or state_after not in (None, "T"):
            problems.append(f"the gate's redis-server was not stopped: state {state_before} "
                            f"before the loop, {state_after} after it")  # fmt: skip
        if answered:
            problems.append("the gate's redis-server answered a PING while it was to be stopped")
        reserved, free = landed(broker, "reserved"), landed(broker, "free")
        wrong = [job for _, _, job in samples if reserved.get(job) != "gate_unavailable"]
        if wrong:
            where = {
                job: ("free" if job in free else reserved.get(job, "missing")) for job in wrong
            }
            problems.append(
                f"{len(wrong)} of {len(samples)} publishes did not land in reserved with "
                f"gatekeeper_reason=gate_unavailable, e.g. {list(where.items())[:3]}"
            )
        if set(free) != {warm}:
            problems.append(f"free holds {len(free)} messages, expected only the warm-up")
        timed = [ns for since, ns, _ in samples if since >= UNTIMED_S]
        if len(timed) < 2:
            problems.append(f"only {len(timed)} publishes after the first second: nothing to time")
        print(
            f"gate redis pid={pid} state_during={state_before},{state_after} "
            f"answered_ping={answered}; broker :{broker_server.port}, gate :{gate_server.port}"
        )
        print(f"publishes={len(samples)} in {args.seconds:.1f}s, timed (after {UNTIMED_S:.0f}s)="
              f"{len(timed)}; breaker_open_s={args.breaker_open_s} redis_timeout_s="
              f"{args.redis_timeout_s}; calls that waited="
              f"{breaker.trips if breaker is not None else 'n/a (no breaker)'}")  # fmt: skip
        broker.close()
        app.close()
    if problems:
        sys.stdout.flush()
        for problem in problems:
            print(f"bench: {problem}", file=sys.stderr)
        return 1
    cuts = statistics.quantiles(timed, n=100, method="inclusive")
    span = args.seconds - UNTIMED_S
    print(f"delay() while hung: p50={cuts[49] / 1e6:.3f}ms p99={cuts[98] / 1e6:.3f}ms "
          f"max={max(timed) / 1e6:.3f}ms; {len(timed) / span:.0f} publishes/s "
          f"(target p99 < 20 ms)")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="how long to publish with the gate stopped (default 4)")  # fmt: skip
    parser.add_argument("--breaker-open-s", type=float, default=1.0,
                        help="the breaker_open_s setting (default 1.0; 0: no breaker)")  # fmt: skip
    parser.add_argument("--redis-timeout-s", type=float, default=0.5,
                        help="the redis_timeout_s setting (default 0.5)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.seconds <= UNTIMED_S + 0.5:
        parser.error(f"--seconds must exceed {UNTIMED_S + 0.5}")
    print(f"bench/hung_redis.py {datetime.datetime.now().isoformat(timespec='seconds')} "
          f"python={platform.python_version()} celery={celery.__version__} "
          f"redis-py={redis.__version__} gatekeeper={gatekeeper.__version__} "
          f"cpus={os.cpu_count()}")  # fmt: skip
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
