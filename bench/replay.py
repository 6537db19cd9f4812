"""How many deferred tasks the replayer (``gatekeeper replay``) moves per second, none lost.

Run on demand (this is not a test)::

    python bench/replay.py [-n N] [--rounds R] [--rabbitmq] [--profile] [--batch-size B]

What it measures. One embedded ``redis-server`` is broker and gate; the replayer works in
batches of ``--batch-size`` (``replay_batch_size``, default 100) on it. Each round publishes
``N`` gated tasks while the gate defers them (a member of the free queue's waiting set, 200 s
old, makes the queue older than ``max_queue_age_s``, 120 s here: ``defer/queue_age_cap``, as
in tests/test_replay.py), then removes that member, so the same tasks fit again, and times
one pass of :class:`gatekeeper.celery.replay.Replayer` (what ``gatekeeper replay --once``
runs, built the way the command builds it: broker from the settings, the app for the
dead-letter results) from the start of ``run(once=True)`` to its end. Before the publishes
one pass runs on an empty ``defer`` (the sweep that a replayer makes once a minute is made
there, as a long-running replayer would have made it already). Publishing is not timed.

With ``--rabbitmq`` the same rounds run with RabbitMQ as broker (Debian's ``rabbitmq-server``,
started as tests/rabbit.py starts it, on free loopback ports) and the embedded Redis as the
gate only; the replayer then consumes ``defer`` through kombu with acks and publisher confirms.

How to read the output:

``redis:`` / ``rabbitmq:``
    ``moved_per_s`` over all rounds (tasks moved over the time of the timed passes), each
    round's figure, and the pass's counts (``to_free=N`` is the only passing value).
``redis per moved task``
    ``round_trips``: how many times the bench process waited for Redis during the timed
    passes, each wait for a reply that follows a request (a command, a pipeline, a
    transaction, or a batch's scripts sent one after the other and then read), counted on
    redis-py's connections and the gate script's own line (:mod:`gatekeeper.redis.wire`);
    ``reads``: ``INFO stats`` ``total_reads_processed``, the server's socket reads (a large
    request, a batch's pipeline, takes several); ``commands``: ``total_commands_processed``
    (a script's own commands included). Per moved task, on the one server (Redis broker), the
    server's figures corrected for the readings themselves.
``moved_per_s=``
    The Redis broker's figure, last (the issue's target: at least 3000/s).

The bench checks what it measured before it prints a number: after publishing, ``defer`` must
hold exactly the N published tasks, each decided ``defer`` by the gate (its run record); after
the pass the replayer must report ``to_free=N`` and nothing else, and every published task id
must be in ``free`` or ``reserved`` exactly once (the broker's lists read in full: on RabbitMQ
the queues drained and counted), none left in ``defer``, ``dead_letter`` or a replayer's
processing list, each handed on with ``gatekeeper_replays=1``. Otherwise it prints one
``bench: ...`` line per failed check on stderr, no figure, and exits with status 1.

The gate's decision line (one per replayed task) is rendered and written to ``os.devnull``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celery
import redis
from celery import Celery
from options import positive  # bench/options.py (this folder is on sys.path)
from redis.connection import AbstractConnection

import gatekeeper
from gatekeeper.celery.broker import broker_for
from gatekeeper.celery.replay import Replayer
from gatekeeper.defaults import REPLAY_BATCH_SIZE
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.wire import Channel
from gatekeeper.settings import GatekeeperSettings

TASK = "bench.deferred_noop"
KEYS = Keys()
STALE = "bench:stale:1"
"""The free queue's waiting-set member that makes the queue look too old (the age cap)."""
QUEUES = ("free", "reserved", "defer", "dead_letter")
COUNTERS = ("total_reads_processed", "total_commands_processed")
REPO = Path(gatekeeper.__file__).resolve().parents[1]


def bench_settings(gate_url: str, broker_url: str, batch_size: int) -> GatekeeperSettings:
    """The gate on for every job, the age cap at 120 s (the stale member is 200 s old, inside
    the 300 s horizon; the tasks the pass moves to free age while it runs), and a budget no
    round can exhaust, so that every replayed task fits."""
    return GatekeeperSettings(
        redis_url=gate_url,
        broker_url=broker_url,
        dwell_gate_enabled=True,
        canary_percent=100,
        max_queue_age_s=120.0,
        budget_units=1e12,
        free_wait_allowance_s=600,
        replay_batch_size=batch_size,
    )


class RoundTrips:
    """Counts this process's round trips to Redis while ``counting``: each wait for a reply
    that follows a request on a connection (a command, a pipeline or a transaction, or
    commands sent one after the other and then read), on redis-py's
    connections and on the gate script's own line."""

    def __init__(self) -> None:
        self.waits = 0
        self._sent: set[int] = set()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        send: Callable[..., Any] = AbstractConnection.send_packed_command
        read: Callable[..., Any] = AbstractConnection.read_response
        line_send, line_read = Channel.send, Channel.read

        def sent(conn: Any) -> None:
            self._sent.add(id(conn))

        def waited(conn: Any) -> None:
            if id(conn) in self._sent:
                self._sent.discard(id(conn))
                self.waits += 1

        def counted_send(conn: Any, *args: Any, **kwargs: Any) -> Any:
            sent(conn)
            return send(conn, *args, **kwargs)

        def counted_read(conn: Any, *args: Any, **kwargs: Any) -> Any:
            waited(conn)
            return read(conn, *args, **kwargs)

        def counted_line_send(line: Channel, parts: Any) -> None:
            sent(line)
            line_send(line, parts)

        def counted_line_read(line: Channel) -> Any:
            waited(line)
            return line_read(line)

        patches = [(AbstractConnection, "send_packed_command", counted_send, send),
                   (AbstractConnection, "read_response", counted_read, read),
                   (Channel, "send", counted_line_send, line_send),
                   (Channel, "read", counted_line_read, line_read)]  # fmt: skip
        for owner, name, patched, _ in patches:
            setattr(owner, name, patched)
        try:
            yield
        finally:
            for owner, name, _, original in patches:
                setattr(owner, name, original)


def create_app(settings: GatekeeperSettings) -> Celery:
    app = Celery("bench_replay", broker=settings.effective_broker_url)
    app.conf.update(task_default_queue="reserved", broker_connection_retry_on_startup=True)

    @gatekeeper.gated(expected_service_s=0.01, tokens_in=1, deadline_s=600)
    @app.task(name=TASK, shared=False)  # type: ignore[untyped-decorator]
    def deferred_noop() -> None:
        return None

    gatekeeper.install(app, settings)
    return app


@dataclass
class Pass:
    ids: list[str]
    seconds: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    server: dict[str, int] = field(default_factory=dict)
    round_trips: int = 0
    problems: list[str] = field(default_factory=list)


class Kind:
    """What differs between brokers: emptying the queues and reading back what they hold."""

    name = "redis"

    def __init__(self, broker_url: str, gate: redis.Redis) -> None:
        self.broker_url = broker_url
        self.gate = gate

    def clear(self) -> None:
        self.gate.delete(*QUEUES)

    def messages(self, queue: str) -> list[dict[str, Any]]:
        """Every message of ``queue`` (Redis: read in place, oldest first)."""
        return [json.loads(raw) for raw in reversed(self.gate.lrange(queue, 0, -1))]

    def drained(self, queue: str) -> list[dict[str, Any]]:
        """Every message of ``queue``, taken out of it (a RabbitMQ queue cannot be read in
        place)."""
        messages = self.messages(queue)
        self.gate.delete(queue)
        return messages

    def claimed(self) -> int:
        lists = self.gate.scan_iter(match="defer:replaying*", _type="list")
        return sum(int(self.gate.llen(name)) for name in lists)

    def close(self) -> None:
        """Nothing of its own: the gate's client is the bench's."""


class Rabbit(Kind):
    name = "rabbitmq"

    def __init__(self, broker_url: str, gate: redis.Redis) -> None:
        from kombu import Connection  # type: ignore[attr-defined]

        super().__init__(broker_url, gate)
        self.connection: Any = Connection(broker_url)  # type: ignore[no-untyped-call]
        self.channel: Any = self.connection.channel()  # type: ignore[no-untyped-call]

    def clear(self) -> None:
        from amqp.exceptions import NotFound

        for name in QUEUES:
            try:
                self.channel.queue_purge(name)
            except NotFound:  # never declared: its channel is closed, take another
                self.channel = self.connection.channel()

    def messages(self, queue: str) -> list[dict[str, Any]]:
        raise NotImplementedError("a RabbitMQ queue is only drained")

    def drained(self, queue: str) -> list[dict[str, Any]]:
        from amqp.exceptions import NotFound

        taken = []
        try:
            while (message := self.channel.basic_get(queue, no_ack=True)) is not None:
                headers = dict(message.headers or {})
                taken.append({"headers": headers, "body": message.body})
        except NotFound:
            self.channel = self.connection.channel()
        return taken

    def claimed(self) -> int:
        return 0  # RabbitMQ holds a replayer's unacked messages itself (checked by drains)

    def close(self) -> None:
        self.connection.close()


class Bench:
    def __init__(self, kind: Kind, gate_url: str, batch_size: int) -> None:
        self.kind = kind
        self.gate = kind.gate
        self.settings = bench_settings(gate_url, kind.broker_url, batch_size)
        FlagStore(self.gate, self.settings).initialise(
            "bench/replay.py: a new namespace", "bench", time.time(), open_path=True
        )
        # The decision and replay loggers bind sys.stderr when built: build them on devnull.
        self.devnull = open(os.devnull, "w")  # noqa: SIM115 - closed in close()
        saved, sys.stderr = sys.stderr, self.devnull
        try:
            self.app = create_app(self.settings)
            self.replayer = Replayer(self.settings, broker_for(self.settings, self.app),
                                     self.gate, app=self.app)  # fmt: skip
            self.defer_tasks(20)
            self.gate.zrem(KEYS.free_waiting, STALE)
            self.replayer.run(threading.Event(), once=True)  # warm: scripts, connections
        finally:
            sys.stderr = saved
        self.kind.clear()
        self.gate.delete(KEYS.free_waiting, KEYS.inflight)

    def close(self) -> None:
        self.replayer.broker.close()
        self.app.close()
        self.kind.close()
        self.devnull.close()

    def defer_tasks(self, n: int) -> list[str]:
        """Publish ``n`` gated tasks while the free queue looks older than the age cap."""
        self.gate.zadd(KEYS.free_waiting, {STALE: (time.time() - 200) * 1000})
        task = self.app.tasks[TASK]
        return [task.delay().id for _ in range(n)]

    def round(self, n: int, profile: cProfile.Profile | None = None) -> Pass:
        self.kind.clear()
        self.gate.delete(KEYS.free_waiting, KEYS.inflight)
        stop = threading.Event()
        self.replayer.run(stop, once=True)  # an empty pass: the once-a-minute sweep is made
        self.replayer.counts.clear()
        result = Pass(self.defer_tasks(n))
        result.problems.extend(self.deferred_as_published(result.ids))
        self.gate.zrem(KEYS.free_waiting, STALE)
        before = self.counters()
        trips = RoundTrips()
        if profile is not None:
            profile.enable()
        with trips.counting():
            start = time.perf_counter()
            self.replayer.run(stop, once=True)
            result.seconds = time.perf_counter() - start
        if profile is not None:
            profile.disable()
        after = self.counters()
        result.round_trips = trips.waits
        result.counts = Counter(self.replayer.counts)
        result.server = {c: after[c] - before[c] - self.overhead[c] for c in COUNTERS}
        result.problems.extend(self.none_lost(result))
        return result

    def counters(self) -> dict[str, int]:
        info = self.gate.info("stats")
        return {c: int(info[c]) for c in COUNTERS}

    @property
    def overhead(self) -> dict[str, int]:
        first = self.counters()
        second = self.counters()
        return {c: second[c] - first[c] for c in COUNTERS}

    def deferred_as_published(self, ids: list[str]) -> list[str]:
        problems = []
        if isinstance(self.kind, Rabbit):
            length = self.kind.channel.queue_declare("defer", passive=True).message_count
        else:
            found = Counter(m["headers"]["id"] for m in self.kind.messages("defer"))
            length = sum(found.values())
            if found != Counter(ids):
                problems.append(f"defer does not hold exactly the {len(ids)} published tasks")
        if length != len(ids):
            problems.append(f"defer holds {length} messages after {len(ids)} deferred publishes")
        pipe = self.gate.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(KEYS.run(job_id, 1), "decision", "reason")
        decided = Counter(
            "/".join((v or b"none").decode() for v in pair) for pair in pipe.execute()
        )
        if set(decided) != {"defer/queue_age_cap"}:
            problems.append(f"published tasks not all decided defer/queue_age_cap: {decided}")
        return problems

    def none_lost(self, result: Pass) -> list[str]:
        problems = []
        n = len(result.ids)
        if result.counts != Counter({"to_free": n}):
            problems.append(f"the pass counted {dict(result.counts)}, expected to_free={n}")
        placed: Counter[str] = Counter()  # ids in free or reserved
        left: Counter[str] = Counter()  # messages of this round still in defer or dead_letter
        replays: Counter[str] = Counter()
        ids = set(result.ids)
        for queue in QUEUES:
            for message in self.kind.drained(queue):
                headers = message["headers"]
                if queue in ("free", "reserved"):
                    placed[headers.get("id")] += 1
                    replays[str(headers.get("gatekeeper_replays"))] += 1
                elif headers.get("id") in ids:
                    left[queue] += 1
        missing = [i for i in result.ids if placed[i] == 0]
        twice = [i for i in result.ids if placed[i] > 1]
        strangers = set(placed) - ids
        if missing or twice or strangers:
            problems.append(f"of {n} tasks {len(missing)} are in neither free nor reserved, "
                            f"{len(twice)} are there more than once; {len(strangers)} others "
                            "are there")  # fmt: skip
        if left:
            problems.append(f"tasks left behind: {dict(left)}")
        if self.kind.claimed():
            problems.append(f"{self.kind.claimed()} messages left in processing lists")
        if set(replays) != {"1"}:
            problems.append(f"gatekeeper_replays of the messages: {dict(replays)}")
        return problems


class Failed(Exception):
    """The rounds did not measure what the bench claims: ``problems`` says why."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def run_broker(
    kind: Kind, gate_url: str, n: int, rounds: int, profile: bool, batch_size: int
) -> list[str]:
    """The rounds on one broker: the lines to print, or raises Failed with the reasons."""
    bench = Bench(kind, gate_url, batch_size)
    try:
        passes = [bench.round(n) for _ in range(rounds)]
        profiled = None
        if profile:
            profiler = cProfile.Profile()
            profiled = (bench.round(n, profiler), profiler)
    finally:
        bench.close()
    problems = [f"{kind.name} round {i}: {p}" for i, ps in enumerate(passes, 1)
                for p in ps.problems]  # fmt: skip
    if problems:
        raise Failed(problems)
    per = [n / p.seconds for p in passes]
    total = n * rounds / sum(p.seconds for p in passes)
    counts = " ".join(f"{k}={v}" for k, v in sorted(passes[0].counts.items()))
    lines = [
        f"{kind.name}: moved_per_s={total:.0f} (rounds: {' '.join(f'{r:.0f}' for r in per)}; "
        f"each pass {counts})"
    ]
    if kind.name == "redis":
        trips = sum(p.round_trips for p in passes) / (n * rounds)
        reads = sum(p.server["total_reads_processed"] for p in passes) / (n * rounds)
        cmds = sum(p.server["total_commands_processed"] for p in passes) / (n * rounds)
        lines.append(f"redis per moved task: round_trips={trips:.2f} reads={reads:.2f} "
                     f"commands={cmds:.2f}")  # fmt: skip
    if profiled is not None:
        result, profiler = profiled
        out = io.StringIO()
        out.write(f"== cProfile of one {kind.name} pass of {n} ({n / result.seconds:.0f}/s "
                  "under the profiler): by own time ==\n")  # fmt: skip
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(20)
        out.write("== gatekeeper's own functions, cumulative ==\n")
        stats.sort_stats("cumulative").print_stats(r"/gatekeeper/", 25)
        lines.append(out.getvalue())
    return lines


@contextlib.contextmanager
def rabbitmq() -> Iterator[str | None]:
    """A RabbitMQ started as the tests start one, or None with the reason printed."""
    sys.path.insert(0, str(REPO))
    try:
        from tests.rabbit import RabbitServer, find_rabbitmq_server
    except ImportError as exc:
        print(f"rabbitmq: skipped ({exc})")
        yield None
        return
    if find_rabbitmq_server() is None:
        print("rabbitmq: skipped (rabbitmq-server is not installed)")
        yield None
        return
    with (
        tempfile.TemporaryDirectory(prefix="gatekeeper-bench-rabbit-") as tmp,
        RabbitServer(Path(tmp)) as server,
    ):
        yield server.url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=positive, default=5000, help="deferred tasks per round")
    parser.add_argument("--rounds", type=positive, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--rabbitmq", action="store_true", help="the same rounds with RabbitMQ as broker too"
    )
    parser.add_argument(
        "--profile", action="store_true", help="then cProfile one extra pass (Redis broker)"
    )
    parser.add_argument("--batch-size", type=positive, default=REPLAY_BATCH_SIZE,
                        help=f"replay_batch_size (default {REPLAY_BATCH_SIZE})")  # fmt: skip
    args = parser.parse_args(argv)
    print(
        f"bench/replay.py {datetime.datetime.now().isoformat(timespec='seconds')} "
        f"N={args.n} rounds={args.rounds} batch={args.batch_size} "
        f"python={platform.python_version()} "
        f"celery={celery.__version__} gatekeeper={gatekeeper.__version__} cpus={os.cpu_count()}"
    )
    started = time.perf_counter()
    lines: list[str] = []
    problems: list[str] = []
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        version = client.info("server")["redis_version"]
        print(f"redis=embedded :{server.port} (broker and gate) redis_version={version}")
        try:
            redis_lines = run_broker(Kind(server.url, client), server.url, args.n,
                                     args.rounds, args.profile, args.batch_size)  # fmt: skip
        except Failed as failed:
            problems.extend(failed.problems)
            redis_lines = []
        if args.rabbitmq:
            client.flushdb()
            with rabbitmq() as url:
                if url is not None:
                    try:
                        lines.extend(run_broker(Rabbit(url, client), server.url, args.n,
                                                args.rounds, False, args.batch_size))  # fmt: skip
                    except Failed as failed:
                        problems.extend(failed.problems)
        client.close()
    if problems:  # no figure: it would not be that of a replay that lost nothing
        sys.stdout.flush()
        for problem in problems:
            print(f"bench: {problem}", file=sys.stderr)
        print(f"elapsed={time.perf_counter() - started:.1f}s")
        return 1
    for line in [*lines, *redis_lines]:
        print(line)
    if redis_lines:
        print(f"moved_per_s={redis_lines[0].split('moved_per_s=')[1].split()[0]} (Redis broker; "
              "target >= 3000)")  # fmt: skip
    print(f"elapsed={time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
