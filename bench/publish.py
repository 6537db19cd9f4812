"""Publish throughput and latency of plain Celery versus gated publishing, in one process.

Run on demand (this is not a test)::

    python bench/publish.py [--redis-url URL] [-n N] [--rounds R] [--fast-publish auto|on|off]
                            [--separate-gate] [--interleave call|round] [--profile]

What it measures. One Celery app publishes ``N`` tasks of a plain task (to ``celery``), ``N``
of a ``@gatekeeper.gated`` task (admitted to ``free``) and ``N`` of a yardstick (a ``PING`` to
the gate's Redis, then a plain publish) in ``R`` rounds. Within a round the three kinds take
turns call by call, in every order equally often, so that drift on the machine (CPU
frequency, other load, a neighbour) hits all of them alike; ``--interleave round`` publishes
blocks of ``N/R`` of plain and gated instead, the order alternating. All kinds are warmed up
first. Between rounds, outside the timed sections, the broker lists (``celery``, ``free``)
and the gate's waiting set's attempts are deleted so that nothing grows without bound (its
pad, which stays in a live set, is kept: keys.py).

Without ``--redis-url`` one embedded ``redis-server`` is both broker and gate (the usual
deployment, where fast publish, the default, decides and publishes in the one round trip;
``--fast-publish off`` measures the ordinary path, the script and then Celery's publish); with
``--separate-gate`` two are started, and the gate's server counts gate commands alone. With
``--redis-url`` that one Redis is both broker and gate. It must be a scratch Redis: the
bench deletes the ``celery`` and ``free`` lists and the attempts of the gate's waiting set.

How to read the output:

``plain:`` / ``gated:``
    Throughput (tasks/s over the timed phases) and per-call latency of ``task.delay()``.
``ratio=``
    Gated throughput divided by plain throughput (1.0 = the gate costs nothing). ``per-round``
    gives the spread of the same ratio over the rounds.
``ratio_with_one_extra_round_trip=``
    The yardstick's throughput divided by plain throughput: what a gate that did nothing but
    one round trip of its own would reach on this machine.
``gate_route_us``
    Time spent in ``Pipeline.route`` per gated publish (flags, inputs, the gate script's round
    trip and reply, the decision log line), minus the time Celery's own sender runs inside it
    (fast publish builds the message there, for the script to push): the gate's own time on
    the publishing thread, p50/p99 in microseconds.
``gate_hook_us``
    Time spent in gatekeeper's wrapped sender (``Installed.send_task_message``) minus the time
    in Celery's own sender: the decision (``gate_route_us``), the header merge and
    re-addressing for gated publishes, and the pass-through cost the hook adds to plain ones.
``redis_ping_us``
    A ``PING`` to the gate's Redis back to back, and after the client spent 1 ms on other work
    (as a publisher does between its calls). On some virtual machines an idle server's CPU
    takes hundreds of microseconds to wake, and every Redis call a publish makes pays that:
    plain Celery once (its ``LPUSH``), the gate's ordinary path a second time (its script);
    fast publish has no round trip of its own.
``redis_round_trips_per_decision=``
    Measured on the gate's Redis server: the rise of ``total_reads_processed`` (one socket read
    per request for a synchronous client) per gated publish minus its rise per plain publish,
    over an untimed pass of up to 500 of each (the timed phases with ``--interleave round``).
    ``redis_commands_per_decision`` uses ``total_commands_processed`` the same way; it also
    counts the commands ``gate.lua`` runs inside its one ``EVALSHA``. Both are corrected for
    the ``INFO`` calls that take the readings (measured by two back-to-back readings). In call
    mode (the default), an untimed pass during which any connection to the server opened or
    closed is measured again, ``COUNT_TRIES`` passes at most (the line says how many were
    measured again, and when none was clean): the server counts a closing connection's end of
    file as a read, and another process's client (a test suite's leftovers, collected while
    the bench runs) is not the gate's round trip. The timed phases of ``--interleave round``
    cannot be measured again and are counted as they were.
``broker per publish``
    The same counters on the broker (two-server mode only): what one ``delay()`` costs Celery.
``decisions``
    The routing of every timed gated publish, as ``decision/reason=count``: what
    ``Pipeline.route`` returned (or ``Pipeline.fail_closed``, when the hook caught a fault).
``fast_publish=``
    The setting, the path the run claims (``fast`` when the setting is ``auto`` or ``on`` and
    broker and gate are one server, else ``ordinary``), and for how many timed gated publishes
    that path was taken (``Routing.published``: ``gate.lua`` pushed the message itself).

The bench checks what it measured before it reports a number: every timed gated publish must
have been decided ``admit_free`` with reason ``fits`` on the path the run claims, and there must
be exactly one recorded decision per timed gated publish (and none for the plain ones).
Otherwise it prints the ``decisions:`` and ``fast_publish=`` lines, one ``bench: ...`` line per
failed check to stderr, and exits with status 1 without printing ``ratio=``: a gate that
failed closed, or a path not taken, must not pass for a measurement of the admit path.

The gate writes one log line per decision to stderr, rendered and written by a thread within
``log_buffer_s`` (:mod:`gatekeeper.lines`). The bench points that stream at a sink that counts
the decision lines and drops them, while installing the gate (the logger keeps the file it
was built with), and checks at the end that every gated publish it made wrote its line. No
rendering escapes the timing: each gated round ends with ``gatekeeper.lines.flush()``, timed
as part of the gated phase (with ``--interleave call``, the thread may also render a line
while a plain or ping call is timed: ``--interleave round`` keeps each kind's work in its own
block). ``GATEKEEPER_LOG_BUFFER_S=0`` measures the lines written in the publish, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import itertools
import os
import platform
import pstats
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import celery
import redis
from celery import Celery
from options import positive  # bench/options.py (this folder is on sys.path)

import gatekeeper
from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.lines import flush as flush_lines
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis import wire
from gatekeeper.redis.gate import Routing
from gatekeeper.redis.keys import ATTEMPTS
from gatekeeper.redis.owing import settle_all
from gatekeeper.settings import GatekeeperSettings

COUNTERS = ("total_reads_processed", "total_commands_processed")
"""Server counters read before and after each phase: round trips, then commands."""
WARMUP = 200
COUNT_TRIES = 5
"""Untimed counting passes tried before one with no connection opened or closed is given up on."""
BROKER_QUEUES = ("celery", "free")


class LineSink(io.TextIOBase):
    """The decision logger's stream: counts the ``event=gate_decision`` lines, keeps none."""

    def __init__(self) -> None:
        super().__init__()
        self.decisions = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.decisions += text.count(" event=gate_decision ")
        return len(text)


class ServerCounters:
    """Readings of one Redis server's ``INFO stats``, corrected for the reading itself."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        first = self.read()
        second = self.read()
        # What one reading costs in each counter (an INFO round trip): measured, not assumed.
        self.overhead = {name: second[name] - first[name] for name in COUNTERS}

    def read(self) -> dict[str, int]:
        info = self.client.info("stats")
        return {name: int(info[name]) for name in COUNTERS}

    def delta(self, before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        return {name: after[name] - before[name] - self.overhead[name] for name in COUNTERS}


@dataclass
class Phase:
    """Everything measured for one kind of publish, summed over the rounds."""

    name: str
    seconds: float = 0.0
    count: int = 0
    call_ns: list[int] = field(default_factory=list)
    hook_ns: list[int] = field(default_factory=list)
    sender_ns: list[int] = field(default_factory=list)
    route_ns: list[int] = field(default_factory=list)
    routings: list[Routing] = field(default_factory=list)
    """What the gate returned for each publish of this kind (none for ungated ones)."""
    gate_server: Counter[str] = field(default_factory=Counter)
    broker_server: Counter[str] = field(default_factory=Counter)
    round_rates: list[float] = field(default_factory=list)
    counted: int = 0
    """Publishes the server counters cover (``count`` if 0: the timed phases themselves)."""
    recounted: int = 0
    """Untimed passes measured again because a connection opened or closed during them."""
    unsteady: bool = False
    """No untimed pass of ``COUNT_TRIES`` was free of a connection opening or closing."""
    later: int = 0
    """Gated publishes (of all passes) sent with their replies read later."""

    @property
    def rate(self) -> float:
        return self.count / self.seconds


@dataclass
class Probes:
    """Wrappers around the gate: ``Pipeline.route`` (and ``fail_closed``), the whole hook and
    Celery's own sender; what they saw since the last :meth:`take`."""

    route_ns: list[int] = field(default_factory=list)
    hook_ns: list[int] = field(default_factory=list)
    sender_ns: list[int] = field(default_factory=list)
    routings: list[Routing] = field(default_factory=list)
    """Every routing the pipeline returned to the hook, in order: one per gated publish, but
    for those sent with their reply read later (``publish_replies``), counted in ``owed``."""
    owed: int = 0
    settled: list[Routing | None] = field(default_factory=list)
    """The routings of the publishes in ``owed``, as their replies were read (None: held)."""

    def take(self, phase: Phase) -> None:
        """Move what was seen into ``phase``."""
        phase.route_ns.extend(self.route_ns)
        phase.hook_ns.extend(self.hook_ns)
        phase.sender_ns.extend(self.sender_ns)
        phase.routings.extend(self.routings)
        self.clear(owed=False)

    def clear(self, owed: bool = True) -> None:
        """Forget what was seen; ``owed``: the replies read later too (their count and
        routings belong to the gated phase as a whole, whichever call read them)."""
        if owed:
            self.owed = 0
            self.settled.clear()
        self.route_ns.clear()
        self.hook_ns.clear()
        self.sender_ns.clear()
        self.routings.clear()


def percentiles_us(samples_ns: list[int]) -> tuple[float, float]:
    """p50 and p99 of nanosecond samples, in microseconds."""
    if len(samples_ns) < 2:
        value = samples_ns[0] / 1000 if samples_ns else float("nan")
        return value, value
    cuts = statistics.quantiles(samples_ns, n=100, method="inclusive")
    return cuts[49] / 1000, cuts[98] / 1000


def install_probes(app: Celery, installed: gatekeeper.Installed) -> Probes:
    """Wrap the installed gate's ``pipeline.route``, ``pipeline.fail_closed``, its sender and
    Celery's sender under it, on this instance only.

    The wrappers pass every argument through as given (whatever ``route`` takes next, they
    take too) and record each routing the hook gets back: from ``route``, or from
    ``fail_closed`` when the hook caught a fault (``reserved/gate_error``), so that a broken
    probe or gate shows in ``decisions:`` instead of vanishing.
    """
    probes = Probes()
    clock = time.perf_counter_ns
    pipeline = installed.pipeline
    route, fail_closed = pipeline.route, pipeline.fail_closed
    inner = installed.original_sender
    hook = app.amqp.send_task_message

    def celery_ns(since: int) -> int:
        """Time in Celery's sender since ``since`` samples (fast publish renders with it)."""
        return sum(probes.sender_ns[since:])

    def timed_route(*args: Any, **kwargs: Any) -> Routing:
        senders = len(probes.sender_ns)
        start = clock()
        routing = route(*args, **kwargs)
        probes.route_ns.append(clock() - start - celery_ns(senders))
        if routing.is_owed:  # its reply read later
            probes.owed += 1
        else:
            probes.routings.append(routing)
        return routing

    def recorded_fail_closed(*args: Any, **kwargs: Any) -> Routing:
        routing = fail_closed(*args, **kwargs)
        probes.routings.append(routing)
        return routing

    def timed_inner(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            probes.sender_ns.append(clock() - start)

    def timed_hook(producer: Any, name: str, message: Any, **options: Any) -> Any:
        senders = len(probes.sender_ns)
        start = clock()
        result = hook(producer, name, message, **options)
        probes.hook_ns.append(clock() - start - celery_ns(senders))
        return result

    later = pipeline.later
    if later is not None:
        settled = later.settled

        def recorded_settled(*args: Any, **kwargs: Any) -> Routing | None:
            routing = settled(*args, **kwargs)
            probes.settled.append(routing)
            return routing

        later.settled = recorded_settled  # type: ignore[method-assign]
    pipeline.route = timed_route  # type: ignore[method-assign]
    pipeline.fail_closed = recorded_fail_closed  # type: ignore[method-assign]
    installed.original_sender = timed_inner
    app.amqp.send_task_message = timed_hook
    return probes


def label(routing: Routing) -> str:
    """``decision/reason`` of one routing (``untouched`` when it kept its own route)."""
    decision = routing.decision.value if routing.decision is not None else "untouched"
    return f"{decision}/{routing.reason.value}"


def tally(routings: list[Routing]) -> str:
    """``label xcount`` for each kind of routing, the most frequent first."""
    counts = Counter(label(routing) for routing in routings)
    return ", ".join(f"{name} x{count}" for name, count in counts.most_common())


def check(bench: Bench, phases: dict[str, Phase]) -> list[str]:
    """Why the timed phases do not measure what the run claims; empty when they do."""
    gated = phases["gated"]
    problems = []
    settle_all()
    flush_lines()
    probes = bench.probes
    if probes.owed != len(probes.settled):
        problems.append(f"{probes.owed} publishes sent with their replies read later, "
                        f"{len(probes.settled)} replies read")  # fmt: skip
    held = sum(routing is None for routing in probes.settled)
    if held:
        problems.append(f"{held} publishes held: their fallback push could not reach Redis")
    gated.routings.extend(routing for routing in probes.settled if routing is not None)
    gated.later, probes.owed = probes.owed, 0
    probes.settled.clear()
    if bench.sink.decisions != bench.gated_published:
        problems.append(
            f"{bench.sink.decisions} gate_decision log lines written for "
            f"{bench.gated_published} gated publishes (expected one each)"
        )
    if len(gated.routings) != gated.count:
        problems.append(
            f"recorded {len(gated.routings)} gate decisions for {gated.count} timed gated "
            "publishes (expected one each: are the probes on the hook's path?)"
        )
    for phase in phases.values():
        if phase is not gated and phase.routings:
            problems.append(
                f"recorded {len(phase.routings)} gate decisions for {phase.count} timed "
                f"{phase.name} publishes, which must not be gated: {tally(phase.routings)}"
            )
    if not gated.routings:
        return problems
    total = len(gated.routings)
    unfit = [
        routing
        for routing in gated.routings
        if routing.decision is not Decision.ADMIT_FREE or routing.reason is not Reason.FITS
    ]
    if unfit:
        problems.append(
            f"{len(unfit)} of {total} gated publishes were not admit_free/fits: {tally(unfit)}"
        )
    setting = bench.installed.settings.fast_publish
    off_path = [routing for routing in gated.routings if routing.published != bench.claims_fast]
    if off_path and bench.claims_fast:
        problems.append(
            f"{len(off_path)} of {total} gated publishes did not take the fast path (gate.lua "
            f"did not push the message) though fast_publish={setting} claims it: "
            f"{tally(off_path)}"
        )
    elif off_path:
        problems.append(
            f"{len(off_path)} of {total} gated publishes were pushed by a gate script though "
            f"fast_publish={setting} claims the ordinary path ({bench.path_note}): "
            f"{tally(off_path)}"
        )
    return problems


def checked_lines(bench: Bench, phases: dict[str, Phase]) -> list[str]:
    """The ``decisions:`` and ``fast_publish=`` lines: what :func:`check` looked at."""
    gated = phases["gated"]
    counts = Counter(label(routing) for routing in gated.routings)
    decisions = " ".join(f"{name}={count}" for name, count in sorted(counts.items()))
    taken = sum(routing.published == bench.claims_fast for routing in gated.routings)
    path = "fast" if bench.claims_fast else "ordinary"
    how = (
        "gate.lua pushed the message"
        if bench.claims_fast
        else "the gate script decided, then Celery's own publish"
    )
    return [
        f"decisions: {decisions}",
        f"fast_publish={bench.installed.settings.fast_publish} path={path} taken for "
        f"{taken}/{gated.count} timed gated publishes ({how}; {bench.path_note})",
        f"publish_replies={bench.installed.settings.publish_replies} read later for "
        f"{gated.later}/{gated.count} timed gated publishes",
    ]


def ping_us(client: redis.Redis, idle_us: int, count: int) -> float:
    """p50 of a PING, each after ``idle_us`` of busy work in this process."""
    samples = []
    for _ in range(count):
        end = time.perf_counter_ns() + idle_us * 1000
        while time.perf_counter_ns() < end:
            pass
        start = time.perf_counter_ns()
        client.ping()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def round_sizes(n: int, rounds: int) -> list[int]:
    return [n // rounds + (1 if i < n % rounds else 0) for i in range(rounds)]


class Bench:
    """One Celery app with a plain and a gated task, the gate installed and probed."""

    def __init__(self, broker_url: str, gate_url: str, separate: bool, fast: str = "auto") -> None:
        self.separate = separate
        self.app = Celery("bench", broker=broker_url)
        self.app.conf.task_default_queue = "celery"

        @self.app.task(name="bench.plain", shared=False)  # type: ignore[untyped-decorator]
        def plain(x: int) -> int:
            return x

        @gatekeeper.gated(expected_service_s=1.0, tokens_in=10, deadline_s=3600)
        @self.app.task(name="bench.gated", shared=False, max_retries=1)  # type: ignore[untyped-decorator]
        def gated_task(x: int) -> int:
            return x

        self.tasks: dict[str, Any] = {"plain": plain, "gated": gated_task}
        settings = GatekeeperSettings(
            redis_url=gate_url,
            dwell_gate_enabled=True,
            canary_percent=100,
            budget_units=1e12,
            queue_wait_unit_per_second=0,
            max_queue_age_s=1e9,
            log_format="kv",
            fast_publish=fast,
        )
        # The decision logger binds sys.stderr when it is built: build it on the sink.
        self.sink = LineSink()
        saved, sys.stderr = sys.stderr, self.sink
        try:
            self.installed = gatekeeper.install(self.app, settings)
            # A scratch namespace, like a new deployment: initialised, so the gate may admit.
            self.installed.flags.initialise(
                "bench: a scratch namespace", "bench", time.time(), open_path=True
            )
        finally:
            sys.stderr = saved
        self.probes = install_probes(self.app, self.installed)
        self.claims_fast = fast != "off" and not separate
        """The path this run claims to measure: fast publish needs broker and gate on one
        server (and ``auto`` needs nothing observing publishes, as here)."""
        if fast == "off":
            self.path_note = "fast publish off"
        elif separate:
            self.path_note = "broker and gate are two servers: fast publish cannot apply"
        else:
            self.path_note = "broker and gate are one server"
        self.broker = redis.Redis.from_url(broker_url)
        self.gate = redis.Redis.from_url(gate_url)
        self.waiting_key = self.installed.keys.free_waiting
        self.ping_line = wire.Line()
        self.gated_published = 0
        """Gated publishes made (warm-up, counting and timed alike): one decision line each."""

    def close(self) -> None:
        self.trim()
        self.broker.close()
        self.gate.close()
        self.app.close()

    def trim(self) -> None:
        self.broker.delete(*BROKER_QUEUES)
        self.gate.zremrangebyscore(self.waiting_key, "-inf", ATTEMPTS)

    def publish(self, kind: str, count: int, call_ns: list[int] | None = None) -> float:
        """Publish ``count`` tasks of one kind; returns the elapsed seconds (for gated ones,
        with the flush of their log lines)."""
        delay = self.tasks[kind].delay
        clock = time.perf_counter_ns
        start = time.perf_counter()
        if call_ns is None:
            for i in range(count):
                delay(i)
        else:
            append = call_ns.append
            for i in range(count):
                t0 = clock()
                delay(i)
                append(clock() - t0)
        if kind == "gated":
            settle_all()
            flush_lines()
            self.gated_published += count
        return time.perf_counter() - start

    def run(self, n: int, rounds: int, interleave: str = "call") -> dict[str, Phase]:
        for kind in self.tasks:
            self.publish(kind, WARMUP)
        self.trim()
        self.probes.clear()
        phases = {kind: Phase(kind) for kind in self.tasks}
        if interleave == "call":
            self.count_round_trips(phases, min(n, 500))
            for index, size in enumerate(round_sizes(n, rounds)):
                self.trim()
                self.interleaved_round(phases, size, seed=index)
            return phases
        gate_counters = ServerCounters(self.gate)
        broker_counters = ServerCounters(self.broker) if self.separate else None
        for index, size in enumerate(round_sizes(n, rounds)):
            order = ("plain", "gated") if index % 2 == 0 else ("gated", "plain")
            for kind in order:
                phase = phases[kind]
                self.trim()
                gate_before = gate_counters.read()
                broker_before = broker_counters.read() if broker_counters else None
                seconds = self.publish(kind, size, phase.call_ns)
                phase.gate_server.update(gate_counters.delta(gate_before, gate_counters.read()))
                if broker_counters is not None and broker_before is not None:
                    after = broker_counters.read()
                    phase.broker_server.update(broker_counters.delta(broker_before, after))
                self.take_probes(phase)
                phase.seconds += seconds
                phase.count += size
                phase.round_rates.append(size / seconds)
        return phases

    def take_probes(self, phase: Phase) -> None:
        self.probes.take(phase)

    def count_round_trips(self, phases: dict[str, Phase], count: int) -> None:
        """Server counters over ``count`` publishes of each kind, untimed, scaled to a phase."""
        gate_counters = ServerCounters(self.gate)
        broker_counters = ServerCounters(self.broker) if self.separate else None
        for kind, phase in phases.items():
            for again in range(COUNT_TRIES):
                self.trim()
                connections = self.connections()
                gate_before = gate_counters.read()
                broker_before = broker_counters.read() if broker_counters else None
                self.publish(kind, count)
                gate_delta = gate_counters.delta(gate_before, gate_counters.read())
                broker_delta = None
                if broker_counters is not None and broker_before is not None:
                    broker_delta = broker_counters.delta(broker_before, broker_counters.read())
                phase.recounted += 1 if again else 0  # a pass measured again
                if self.connections() == connections:
                    break
                # A connection opened or closed meanwhile (another process's, or a pool's):
                # a close is a read without a command, and it is not this publish's. Again.
            else:
                phase.unsteady = True  # no pass was clean: the last one is counted as it was
            phase.gate_server.update(gate_delta)
            if broker_delta is not None:
                phase.broker_server.update(broker_delta)
            phase.counted = count
        self.probes.clear()

    def connections(self) -> tuple[tuple[frozenset[str], int], ...]:
        """The ids of every connection open to the gate's Redis and the broker (anyone's), and
        how many each server has accepted (a connection opened and closed between two
        readings leaves the ids as they were, not that count)."""
        servers = (self.gate, self.broker) if self.separate else (self.gate,)
        return tuple(
            (frozenset(c["id"] for c in server.client_list()),
             int(server.info("stats")["total_connections_received"]))
            for server in servers
        )  # fmt: skip

    def ping_then_plain(self, i: int) -> Any:
        """The yardstick: a plain publish after one PING to the gate's Redis, sent the way the
        gate sends its script (:mod:`gatekeeper.redis.wire`), so it pays one round trip and nothing
        else a gate does."""
        line = self.ping_line.take(self.gate.connection_pool)
        assert line is not None
        try:
            line.send(["PING"])
            line.read()
        finally:
            line.release()
        return self.tasks["plain"].delay(i)

    def interleaved_round(self, phases: dict[str, Phase], size: int, seed: int) -> None:
        """``size`` publishes of each kind, one of each in turn, in every order equally often
        (shuffled), so that no kind always follows the same other kind."""
        clock = time.perf_counter_ns
        plain, gated = phases["plain"], phases["gated"]
        ping = phases.setdefault("ping+plain", Phase("ping+plain"))
        kinds = [(plain, self.tasks["plain"].delay), (gated, self.tasks["gated"].delay)]
        kinds.append((ping, self.ping_then_plain))
        spent = {"plain": 0, "gated": 0, "ping+plain": 0}
        orders = list(itertools.permutations(kinds))  # every kind before and after every other
        shuffle = random.Random(seed).shuffle
        for i in range(size):
            if i % len(orders) == 0:
                shuffle(orders)
            for phase, delay in orders[i % len(orders)]:
                t0 = clock()
                delay(i)
                took = clock() - t0
                phase.call_ns.append(took)
                spent[phase.name] += took
                self.take_probes(phase)
        t0 = clock()
        settle_all()  # the round's last reply read, charged to the gated phase
        flush_lines()  # the round's lines not yet written, charged to the gated phase
        spent["gated"] += clock() - t0
        self.gated_published += size
        for phase in (plain, gated, ping):
            phase.seconds += spent[phase.name] / 1e9
            phase.count += size
            phase.round_rates.append(size / (spent[phase.name] / 1e9))

    def profile(self, count: int, top: int) -> str:
        """cProfile one extra gated phase (not part of the numbers above)."""
        self.trim()
        profiler = cProfile.Profile()
        profiler.enable()
        self.publish("gated", count)
        profiler.disable()
        self.trim()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
        out.write(f"== cProfile of {count} gated publishes: gatekeeper's own functions ==\n")
        stats.print_stats(r"/gatekeeper/", top)
        out.write("== where route, the script call and the log line spend it (callees) ==\n")
        stats.print_callees(r"gate.py:\d+\((route|_scored|_finish)\)|store.py:\d+\(score\)")
        stats.print_callees(r"structlog/_base.py:\d+\(_process_event\)")
        return out.getvalue()


def report(bench: Bench, phases: dict[str, Phase]) -> list[str]:
    plain, gated = phases["plain"], phases["gated"]
    lines = []
    for phase in (plain, gated):
        p50, p99 = percentiles_us(phase.call_ns)
        lines.append(
            f"{phase.name}: {phase.rate:.0f} tasks/s  delay() p50={p50:.1f}us p99={p99:.1f}us"
        )
    ratios = sorted(g / p for g, p in zip(gated.round_rates, plain.round_rates, strict=True))
    lines.append(
        f"ratio={gated.rate / plain.rate:.3f} (gated/plain tasks/s; per-round min="
        f"{ratios[0]:.3f} median={statistics.median(ratios):.3f} max={ratios[-1]:.3f})"
    )
    ping = phases.get("ping+plain")
    if ping is not None and ping.count:
        lines.append(
            f"ratio_with_one_extra_round_trip={ping.rate / plain.rate:.3f} (a plain publish "
            "after one PING to the gate's Redis: what any gate with a round trip of its own "
            "could reach on this machine)"
        )
    p50, p99 = percentiles_us(gated.route_ns)
    lines.append(
        f"gate_route_us p50={p50:.1f} p99={p99:.1f} (Pipeline.route per gated publish, "
        "less Celery's sender inside it)"
    )
    g50, g99 = percentiles_us(gated.hook_ns)
    h50, h99 = percentiles_us(plain.hook_ns)
    lines.append(
        f"gate_hook_us gated p50={g50:.1f} p99={g99:.1f}; plain (pass-through) "
        f"p50={h50:.1f} p99={h99:.1f}"
    )
    g50, g99 = percentiles_us(gated.sender_ns)
    h50, h99 = percentiles_us(plain.sender_ns)
    lines.append(
        f"celery_sender_us gated p50={g50:.1f} p99={g99:.1f}; plain p50={h50:.1f} p99={h99:.1f}"
        " (Celery's own send_task_message, after the hook)"
    )
    per = {
        phase.name: {k: v / (phase.counted or phase.count) for k, v in phase.gate_server.items()}
        for phase in (plain, gated)
    }
    trips = per["gated"]["total_reads_processed"] - per["plain"]["total_reads_processed"]
    commands = per["gated"]["total_commands_processed"] - per["plain"]["total_commands_processed"]
    recounted = plain.recounted + gated.recounted
    again = ""
    if recounted:
        passes = "pass" if recounted == 1 else "passes"
        again = f"; {recounted} {passes} measured again (a connection opened or closed)"
    if plain.unsteady or gated.unsteady:
        again += f"; no pass of {COUNT_TRIES} was clean, the last is counted"
    lines.append(
        f"redis_round_trips_per_decision={trips:.3f} (redis_commands_per_decision="
        f"{commands:.3f}, counting those inside gate.lua{again})"
    )
    if bench.separate:
        parts = []
        for phase in (plain, gated):
            counted = phase.counted or phase.count
            reads = phase.broker_server["total_reads_processed"] / counted
            cmds = phase.broker_server["total_commands_processed"] / counted
            parts.append(f"{phase.name} round_trips={reads:.3f} commands={cmds:.3f}")
        lines.append("broker per publish: " + "; ".join(parts))
    lines.extend(checked_lines(bench, phases))
    return lines


@contextlib.contextmanager
def redis_urls(url: str | None, separate: bool) -> Iterator[tuple[str, str, str]]:
    """(broker URL, gate URL, description): ``url`` for both, else embedded server(s)."""
    if url:
        yield url, url, f"redis={url} (broker and gate)"
        return
    if not separate:
        with EmbeddedRedis() as both:
            yield both.url, both.url, f"redis=embedded :{both.port} (broker and gate)"
        return
    with EmbeddedRedis() as broker, EmbeddedRedis() as gate:
        yield broker.url, gate.url, f"redis=embedded broker :{broker.port}, gate :{gate.port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis-url",
        help="a scratch Redis used as broker and gate (its celery/free lists are deleted); "
        "default: one embedded redis-server for both",
    )
    parser.add_argument(
        "--separate-gate",
        action="store_true",
        help="two embedded servers, broker and gate apart: the gate's round trip is then its "
        "own (fast publish needs them on one server)",
    )
    parser.add_argument(
        "--fast-publish",
        choices=("auto", "on", "off"),
        default="auto",
        help="the fast_publish setting (default auto, as in a deployment): the gate script "
        "pushes the message itself when broker and gate are one server; off measures the "
        "ordinary path (the script, then Celery's own publish)",
    )
    parser.add_argument(
        "--interleave",
        choices=("call", "round"),
        default="call",
        help="call (default): plain and gated publishes one after the other, so both see the "
        "same moment of a noisy machine; round: blocks of N/rounds of each kind in turn",
    )
    parser.add_argument("-n", type=positive, default=5000, help="tasks per path (default 5000)")
    parser.add_argument("--rounds", type=positive, default=10, help="rounds (default 10)")
    parser.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=2000,
        metavar="COUNT",
        help="then cProfile COUNT extra gated publishes (default 2000) and print the top entries",
    )
    args = parser.parse_args(argv)
    if args.rounds > args.n:
        parser.error("--rounds must not exceed -n")

    print(
        f"bench/publish.py {datetime.datetime.now().isoformat(timespec='seconds')} "
        f"N={args.n} rounds={args.rounds} python={platform.python_version()} "
        f"celery={celery.__version__} gatekeeper={gatekeeper.__version__} cpus={os.cpu_count()}"
    )
    started = time.perf_counter()
    status = 0
    with redis_urls(args.redis_url, args.separate_gate) as (broker_url, gate_url, where):
        bench = Bench(broker_url, gate_url, separate=broker_url != gate_url, fast=args.fast_publish)
        try:
            version = bench.gate.info("server")["redis_version"]
            print(f"{where} redis_version={version} hiredis={wire.RAW}")
            print(
                f"redis_ping_us back_to_back p50={ping_us(bench.gate, 0, 500):.0f} "
                f"after_1ms_busy p50={ping_us(bench.gate, 1000, 300):.0f}"
            )
            phases = bench.run(args.n, args.rounds, args.interleave)
            problems = check(bench, phases)
            if problems:
                # No numbers: they would not be those of the path this run claims.
                for line in checked_lines(bench, phases):
                    print(line)
                sys.stdout.flush()
                for problem in problems:
                    print(f"bench: {problem}", file=sys.stderr)
                status = 1
            else:
                for line in report(bench, phases):
                    print(line)
                if args.profile:
                    print(bench.profile(args.profile, top=30))
        finally:
            bench.close()
    print(f"elapsed={time.perf_counter() - started:.1f}s")
    return status


if __name__ == "__main__":
    sys.exit(main())
