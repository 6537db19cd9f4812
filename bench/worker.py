"""Worker throughput of a gated no-op task against the same task ungated, on real Celery workers.

Run on demand (this is not a test)::

    python bench/worker.py [-n N] [--rounds R] [--blocks B] [--pools prefork,solo] [--profile]

What it measures. One embedded ``redis-server`` is broker and gate. In each round the bench
publishes ``N`` tasks of a plain no-op task (to ``celery``), ``N`` of the same no-op task gated
with ``@gatekeeper.gated`` (decided ``admit_free``, to ``free``) and ``N`` of a yardstick (a
plain task whose body sends three ``PING`` commands to the same Redis, to ``bench_pings``),
then moves each queue aside into ``--blocks`` lists (10) and starts a real Celery worker
(``celery worker -Q free,celery,bench_pings``, this file's app, as a subprocess), and waits
until it is ready. It then gives the worker one block of one kind at a time (``RENAMENX``
onto the queue's name: atomic, and the worker's blocking pop wakes at once), the three kinds
in every order alike, and times each block from the rename to the end of its last task (each
run notes its end, after gatekeeper's worker hooks, in a per-process file: one ``write`` per
task). So all kinds see the same moments of a shared machine; worker start-up and publishing
are not timed. The worker is stopped after each round; a pool (``solo``, ``prefork`` with 2
children) runs all its rounds before the next.

The Redis counters come from the same timed sections: ``INFO stats`` and ``INFO
commandstats`` read before the rename and after the last task, corrected for the readings
themselves. They include the worker's idle traffic while the bench polls for the end (a
blocking pop and kombu's housekeeping about once a second), a few commands per section.

How to read the output:

``<pool> plain:`` / ``<pool> gated:``
    Tasks/s over the timed sections of the rounds (all rounds' tasks over all rounds' time),
    then each round's figure.
``<pool> pings:``
    The yardstick's tasks/s.
``<pool> ratio=``
    Gated tasks/s divided by plain tasks/s, with the per-round spread (each round's kinds run
    on the same worker process, block by block).
``<pool> ratio_with_3_extra_round_trips=``
    The yardstick's tasks/s divided by plain tasks/s: what a gate that cost a run nothing but
    its three round trips (the figure measured below) would reach on this machine.
``redis per gated attempt``
    ``total_reads_processed`` (one socket read per request of a synchronous client: round
    trips) and ``total_commands_processed`` (every command, those inside Lua scripts too) per
    task, gated and plain, and their difference: the gate's share of what a task costs Redis;
    the yardstick's for comparison.
``commandstats per gated attempt``
    ``INFO commandstats`` calls per gated task minus per plain task, by command.
``server cpu_us per task``
    The server's CPU time per task of each kind over its blocks (``INFO cpu``), then
    ``commandstats`` ``usec`` per task by command (wall time inside each command; a script's
    own commands are in its ``evalsha`` figure and again under their names, so they are
    never summed).
``checks:``
    What the bench verified before printing any figure (below).
``ratio=``
    The solo pool's ratio, last: the issue's figure (target >= 0.80).

The bench checks what it measured before it prints a number: every published gated task must
have been decided ``admit_free/fits`` by the gate (its run record in Redis), sit in ``free``
after publishing (and every plain one in ``celery``), have run exactly once, taken from
``free``, with one start in its record (``runs=1``, ``rowed=1``) and exactly one ledger row,
``path=free`` ``outcome=ok``, in the window rows; every plain task (and every yardstick) must
have run exactly once, taken from ``celery`` (``bench_pings``). Otherwise it prints one
``bench: ...`` line per failed check on stderr, no figure, and exits with status 1.

The worker writes its log (Celery's at ``WARNING``, gatekeeper's ``ledger_row`` line per gated
run at its default ``info``) to a file, as a deployment does. Settings the bench does not set
itself come from ``GATEKEEPER_*`` variables (``GATEKEEPER_LOG_LEVEL=warning`` measures the
gate without its per-run line).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import itertools
import json
import os
import platform
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celery
import redis
from celery import Celery, signals
from options import positive  # bench/options.py (this folder is on sys.path)

import gatekeeper
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from gatekeeper.settings import GatekeeperSettings

PLAIN, GATED, YARDSTICK = "plain", "gated", "pings"
KINDS = (PLAIN, GATED, YARDSTICK)
TASKS = {PLAIN: "bench.noop_plain", GATED: "bench.noop_gated", YARDSTICK: "bench.noop_pings"}
QUEUES = {PLAIN: "celery", GATED: "free", YARDSTICK: "bench_pings"}
YARDSTICK_PINGS = 3
"""PINGs the yardstick task sends: the round trips the gate adds to a run (measured below)."""
ORDERS = list(itertools.permutations(KINDS))
"""The kinds' orders within a block, cycled, so that each kind follows each other alike."""
POOLS = {"solo": ("solo", 1), "prefork": ("prefork", 2)}
COUNTERS = ("total_reads_processed", "total_commands_processed")
CPU_US = "server_cpu_us"
"""The server's own CPU time (``INFO cpu``: ``used_cpu_user`` + ``used_cpu_sys``), in us."""
KEYS = Keys()
REPO = Path(gatekeeper.__file__).resolve().parents[1]
"""The checkout whose gatekeeper this process imported: the worker imports the same one."""


def bench_settings(url: str) -> GatekeeperSettings:
    """The gate on for every job; a budget, a wait allowance and an age cap no round can
    exhaust (N tasks wait in ``free`` while the others are published), so that every one of
    N tasks published at once fits (the bench measures the admit path)."""
    return GatekeeperSettings(
        redis_url=url,
        dwell_gate_enabled=True,
        canary_percent=100,
        budget_units=1e12,
        free_wait_allowance_s=600,
        max_queue_age_s=600,
    )


def create_app(
    url: str, records: Path | None = None, settings: GatekeeperSettings | None = None
) -> Celery:
    """The bench's app: the no-op ungated, gated, and with the yardstick's PINGs; with
    ``records``, each run appends ``kind id routing_key end_time`` to a file of its process's
    own there. Gated with ``settings`` (default :func:`bench_settings`)."""
    app = Celery("bench_worker", broker=url)
    app.conf.update(
        task_default_queue=QUEUES[PLAIN],
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )

    @app.task(name=TASKS[PLAIN], shared=False)  # type: ignore[untyped-decorator]
    def noop_plain() -> None:
        return None

    @gatekeeper.gated(expected_service_s=0.01, tokens_in=1, deadline_s=600)
    @app.task(name=TASKS[GATED], shared=False)  # type: ignore[untyped-decorator]
    def noop_gated() -> None:
        return None

    pinger = Pinger(url)

    @app.task(name=TASKS[YARDSTICK], queue=QUEUES[YARDSTICK], shared=False)  # type: ignore[untyped-decorator]
    def noop_pings() -> None:
        pinger.ping(YARDSTICK_PINGS)

    gatekeeper.install(app, settings or bench_settings(url))
    if records is not None:
        note = RunNotes(records)
        for kind in KINDS:
            signals.task_postrun.connect(note.receiver(kind), sender=app.tasks[TASKS[kind]],
                                         weak=False)  # fmt: skip
    return app


class Pinger:
    """A Redis client per process (a prefork child makes its own), for the yardstick."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: redis.Redis | None = None
        self._pid = -1

    def ping(self, count: int) -> None:
        if self._pid != os.getpid():
            self._pid, self._client = os.getpid(), redis.Redis.from_url(self.url)
        assert self._client is not None
        for _ in range(count):
            self._client.ping()


class RunNotes:
    """One line per finished run, written by the process that ran it (task_postrun fires
    after task_success, so after gatekeeper's row): one unbuffered ``write``, no Redis."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._fd = -1
        self._pid = -1

    def receiver(self, kind: str) -> Any:
        def noted(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
            if self._pid != os.getpid():  # a prefork child: a file of its own
                self._pid = os.getpid()
                name = self.folder / f"runs.{self._pid}"
                self._fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            queue = (sender.request.delivery_info or {}).get("routing_key")
            os.write(self._fd, f"{kind} {task_id} {queue} {time.time():.6f}\n".encode())

        return noted


def serve(
    url: str, pool: str, concurrency: int, folder: Path, profile: bool, hostname: str | None = None
) -> int:
    """The worker subprocess: this file's app, consuming the three kinds' queues."""
    app = create_app(url, folder)

    def ready(**_: Any) -> None:
        (folder / "ready").write_text(str(os.getpid()))

    signals.worker_ready.connect(ready, weak=False)
    argv = [
        "worker", "-P", pool, "-c", str(concurrency), "-Q", ",".join(QUEUES.values()),
        "-l", "WARNING",
        "--without-heartbeat", "--without-gossip", "--without-mingle",
        "-n", hostname or f"bench-{os.getpid()}@%h",
    ]  # fmt: skip
    profiler = cProfile.Profile() if profile else None
    try:
        if profiler is not None:
            profiler.enable()
        app.worker_main(argv)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(folder / "profile")
    return 0


# -- the bench side ----------------------------------------------------------------------


@dataclass
class Section:
    """One kind's timed blocks in one round, summed."""

    kind: str
    seconds: float
    counters: Counter[str]
    commands: Counter[str]
    usec: Counter[str]


@dataclass
class Round:
    pool: str
    ids: dict[str, list[str]] = field(default_factory=dict)
    sections: dict[str, Section] = field(default_factory=dict)
    runs: list[tuple[str, str, str, float]] = field(default_factory=list)
    """Every run the worker noted: kind, id, the queue it was taken from, its end time."""
    queued: dict[str, int] = field(default_factory=dict)
    """Messages in each kind's queue after publishing."""


class Server:
    """Readings of the server's counters, corrected for what a reading itself costs."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        first = self.read()
        second = self.read()
        self.overhead = {name: second[0][name] - first[0][name] for name in (*COUNTERS, CPU_US)}
        self.overhead_commands = second[1] - first[1]

    def read(self) -> tuple[dict[str, int], Counter[str], Counter[str]]:
        stats = self.client.info("stats")
        calls: Counter[str] = Counter()
        usec: Counter[str] = Counter()
        for name, value in self.client.info("commandstats").items():
            command = name.removeprefix("cmdstat_")
            calls[command] = int(value["calls"])
            usec[command] = int(value["usec"])
        counters = {name: int(stats[name]) for name in COUNTERS}
        cpu = self.client.info("cpu")
        counters[CPU_US] = round((float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])) * 1e6)
        return counters, calls, usec

    def since(
        self, before: tuple[dict[str, int], Counter[str], Counter[str]]
    ) -> tuple[dict[str, int], Counter[str], Counter[str]]:
        after = self.read()
        counters = {n: after[0][n] - before[0][n] - self.overhead[n] for n in (*COUNTERS, CPU_US)}
        calls = after[1].copy()
        calls.subtract(before[1])
        calls.subtract(self.overhead_commands)
        usec = after[2].copy()
        usec.subtract(before[2])
        del usec["info"]  # the readings' own
        return counters, +calls, +usec


def noted_runs(folder: Path) -> list[tuple[str, str, str, float]]:
    runs = []
    for path in folder.glob("runs.*"):
        for line in path.read_text().splitlines():
            kind, job_id, queue, end = line.split(" ")
            runs.append((kind, job_id, queue, float(end)))
    return runs


@contextlib.contextmanager
def worker(
    url: str, pool: str, folder: Path, profile: bool = False, hostname: str | None = None
) -> Iterator[None]:
    """A worker subprocess of this file's app, ready; stopped (warm shutdown) on leaving
    (``hostname``: its ``-n``, ``bench-<pid>@<host>`` when None)."""
    name, concurrency = POOLS[pool]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--serve", "--redis-url", url, "--pool", name,
               "--concurrency", str(concurrency), "--folder", str(folder)]  # fmt: skip
    if profile:
        command.append("--profile")
    if hostname is not None:
        command += ["--hostname", hostname]
    with (folder / "worker.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (folder / "ready").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the {pool} worker did not start:\n"
                    + (folder / "worker.log").read_text(errors="replace")[-3000:]
                )
            time.sleep(0.05)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for(folder: Path, kind: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(run[0] == kind for run in noted_runs(folder)) >= count:
            return
        time.sleep(0.05)


class Bench:
    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.server = Server(self.client)
        FlagStore(self.client, bench_settings(url)).initialise(
            "bench/worker.py: a new namespace", "bench", time.time(), open_path=True
        )
        # The decision logger binds sys.stderr when it is built (at the first gated publish):
        # build it on /dev/null, so the line is rendered and written, not shown.
        self.devnull = open(os.devnull, "w")  # noqa: SIM115 - closed in close()
        saved, sys.stderr = sys.stderr, self.devnull
        try:
            self.app = create_app(url)
            self.publish(GATED, 50)  # and warm the publisher: its script, its connections
        finally:
            sys.stderr = saved
        # The warm-up's admissions would hold the free queue's age up: forgotten.
        self.client.delete(*QUEUES.values(), KEYS.free_waiting, KEYS.inflight)
        self.profile_text = ""

    def close(self) -> None:
        self.app.close()
        self.client.close()
        self.devnull.close()

    def publish(self, kind: str, n: int) -> list[str]:
        task = self.app.tasks[TASKS[kind]]
        return [task.delay().id for _ in range(n)]

    def round(self, pool: str, n: int, blocks: int, turn: int, profile: bool = False) -> Round:
        """Publish ``n`` of each kind, hold them aside in ``blocks`` lists per kind, start a
        worker and give it the blocks one kind at a time, in every order alike (``turn``:
        where this round starts in :data:`ORDERS`)."""
        result = Round(pool)
        self.client.delete(*QUEUES.values())
        for kind in KINDS:
            result.ids[kind] = self.publish(kind, n)
        held = {kind: self.hold(kind, n, blocks) for kind in KINDS}
        for kind in KINDS:
            result.queued[kind] = sum(size for _, size in held[kind])
        if any(result.queued[kind] != n for kind in held):
            return result  # not what the round must time: check() says why, nothing timed
        order = [ORDERS[(turn + b) % len(ORDERS)] for b in range(blocks)]
        with tempfile.TemporaryDirectory(prefix="gatekeeper-bench-worker-") as tmp:
            folder = Path(tmp)
            with worker(self.url, pool, folder, profile):
                done = Counter[str]()
                for b, kinds in enumerate(order):
                    for kind in kinds:
                        name, size = held[kind][b]
                        done[kind] += size
                        self.timed_block(result, folder, kind, name, done[kind])
            result.runs = noted_runs(folder)
            if profile and (folder / "profile").exists():
                self.profile_text = profile_summary(folder / "profile")
        return result

    def hold(self, kind: str, n: int, blocks: int) -> list[tuple[str, int]]:
        """Move the kind's queue into ``blocks`` lists of about ``n / blocks`` messages each,
        oldest first (kombu pops from the right; RPOPLPUSH keeps the order)."""
        queue, held = QUEUES[kind], []
        for b in range(blocks):
            name, size = f"bench:held:{queue}:{b}", n // blocks + (b < n % blocks)
            self.client.delete(name)
            pipe = self.client.pipeline(transaction=False)
            for _ in range(size):
                pipe.rpoplpush(queue, name)
            pipe.execute()
            held.append((name, int(self.client.llen(name))))
        return held

    def timed_block(self, result: Round, folder: Path, kind: str, name: str, total: int) -> None:
        """Give the worker one held block and time it, up to the end of its last task."""
        before = self.server.read()
        start = time.time()
        # RENAMENX: the queue's list is gone (the worker took the last block), never replaced.
        if not self.client.renamenx(name, QUEUES[kind]):
            raise RuntimeError(f"{QUEUES[kind]} still holds messages: not renamed over")
        wait_for(folder, kind, total, timeout_s=60.0)
        counters, calls, usec = self.server.since(before)
        ends = sorted(run[3] for run in noted_runs(folder) if run[0] == kind)
        end = ends[-1] if len(ends) >= total else time.time()
        section = result.sections.setdefault(
            kind, Section(kind, 0.0, Counter(), Counter(), Counter())
        )
        section.seconds += end - start
        section.counters.update(counters)
        section.commands.update(calls)
        section.usec.update(usec)


def check(rounds: list[Round], client: redis.Redis) -> list[str]:
    """Why the rounds do not measure what the bench claims; empty when they do."""
    problems: list[str] = []
    rows = ledger_rows(client)
    for number, rnd in enumerate(rounds, 1):
        where = f"{rnd.pool} round {number}"
        for kind in KINDS:
            ids = rnd.ids[kind]
            if rnd.queued[kind] != len(ids):
                problems.append(f"{where}: {rnd.queued[kind]} of {len(ids)} {kind} tasks were "
                                f"in {QUEUES[kind]} after publishing")  # fmt: skip
            ran = Counter(run[1] for run in rnd.runs if run[0] == kind)
            missing = [i for i in ids if ran[i] == 0]
            twice = [i for i in ids if ran[i] > 1]
            strangers = set(ran) - set(ids)
            if missing or twice or strangers:
                problems.append(f"{where}: {kind} runs: {len(missing)} of {len(ids)} never ran, "
                                f"{len(twice)} ran more than once, {len(strangers)} not "
                                "published this round")  # fmt: skip
            elsewhere = Counter(run[2] for run in rnd.runs
                                if run[0] == kind and run[2] != QUEUES[kind])  # fmt: skip
            if elsewhere:
                problems.append(f"{where}: {kind} runs taken from another queue than "
                                f"{QUEUES[kind]}: {dict(elsewhere)}")  # fmt: skip
            if kind not in rnd.sections:
                problems.append(f"{where}: no timed section for {kind}")
        problems.extend(f"{where}: {p}" for p in gated_checks(client, rnd.ids[GATED], rows))
    return problems


def ledger_rows(client: redis.Redis) -> dict[str, list[dict[str, Any]]]:
    """Every ledger row in the window rows, by job id."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for key in client.scan_iter(match=f"{KEYS.base}:window:*:rows", _type="list"):
        for raw in client.lrange(key, 0, -1):
            row = json.loads(raw)
            rows.setdefault(row["job_id"], []).append(row)
    return rows


def gated_checks(client: redis.Redis, ids: list[str], rows: dict[str, Any]) -> list[str]:
    """Each gated task: decided admit_free/fits, started once, one ok row on the free path."""
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(KEYS.run(job_id, 1), "decision", "reason", "runs", "rowed")
    records = pipe.execute()
    decided: Counter[str] = Counter()
    started: Counter[str] = Counter()
    rowed: Counter[str] = Counter()
    for job_id, (decision, reason, runs, done) in zip(ids, records, strict=True):
        text = [(v or b"").decode() for v in (decision, reason, runs, done)]
        decided[f"{text[0] or 'none'}/{text[1] or 'none'}"] += 1
        started[f"runs={text[2] or 0} rowed={text[3] or 0}"] += 1
        mine = rows.get(job_id, [])
        rowed[", ".join(sorted(f"{r['path']}/{r['outcome']}" for r in mine)) or "none"] += 1
    problems = []
    if set(decided) != {"admit_free/fits"}:
        problems.append(f"gated tasks not all decided admit_free/fits: {dict(decided)}")
    if set(started) != {"runs=1 rowed=1"}:
        problems.append(f"gated records not all started once with their row: {dict(started)}")
    if set(rowed) != {"free/ok"}:
        problems.append(f"gated ledger rows not one free/ok each: {dict(rowed)}")
    return problems


def profile_summary(path: Path) -> str:
    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    out.write("== cProfile of the worker (an extra solo round, all kinds): by own time ==\n")
    stats.sort_stats("tottime").print_stats(20)
    out.write("== gatekeeper's own functions, cumulative ==\n")
    stats.sort_stats("cumulative").print_stats(r"/gatekeeper/", 25)
    return out.getvalue()


def rate(rounds: list[Round], kind: str, n: int) -> tuple[float, list[float]]:
    per = [n / r.sections[kind].seconds for r in rounds]
    total = n * len(rounds) / sum(r.sections[kind].seconds for r in rounds)
    return total, per


def report(pool: str, rounds: list[Round], n: int) -> tuple[list[str], float]:
    lines = []
    rates = {}
    for kind in KINDS:
        total, per = rate(rounds, kind, n)
        rates[kind] = (total, per)
        shown = " ".join(f"{r:.0f}" for r in per)
        lines.append(f"{pool} {kind}: {total:.0f} tasks/s (rounds: {shown})")
    ratios = sorted(g / p for g, p in zip(rates[GATED][1], rates[PLAIN][1], strict=True))
    ratio = rates[GATED][0] / rates[PLAIN][0]
    lines.append(
        f"{pool} ratio={ratio:.3f} (gated/plain tasks/s; per-round min={ratios[0]:.3f} "
        f"median={statistics.median(ratios):.3f} max={ratios[-1]:.3f})"
    )
    lines.append(
        f"{pool} ratio_with_{YARDSTICK_PINGS}_extra_round_trips="
        f"{rates[YARDSTICK][0] / rates[PLAIN][0]:.3f} (a plain no-op that sends "
        f"{YARDSTICK_PINGS} PINGs: what a gate with the gate's round trips and nothing else "
        "would reach here)"
    )
    per_task: dict[str, dict[str, float]] = {}
    calls: dict[str, Counter[str]] = {}
    usec: dict[str, Counter[str]] = {}
    for kind in KINDS:
        sections = [r.sections[kind] for r in rounds]
        count = n * len(sections)
        per_task[kind] = {
            c: sum(s.counters[c] for s in sections) / count for c in (*COUNTERS, CPU_US)
        }
        calls[kind] = sum((s.commands for s in sections), Counter())
        usec[kind] = sum((s.usec for s in sections), Counter())
    trips = {k: v["total_reads_processed"] for k, v in per_task.items()}
    cmds = {k: v["total_commands_processed"] for k, v in per_task.items()}
    lines.append(
        f"{pool} redis per gated attempt: round_trips={trips[GATED]:.2f} "
        f"commands={cmds[GATED]:.2f} (plain: round_trips={trips[PLAIN]:.2f} "
        f"commands={cmds[PLAIN]:.2f}; the gate's: round_trips={trips[GATED] - trips[PLAIN]:.2f} "
        f"commands={cmds[GATED] - cmds[PLAIN]:.2f}; pings: round_trips="
        f"{trips[YARDSTICK]:.2f} commands={cmds[YARDSTICK]:.2f})"
    )
    count = n * len(rounds)
    extra = calls[GATED].copy()
    extra.subtract(calls[PLAIN])
    shown = " ".join(
        f"{c}={v / count:+.2f}" for c, v in extra.most_common() if abs(v) >= count / 20
    )
    lines.append(f"{pool} commandstats per gated attempt, minus plain: {shown}")
    cpu = {kind: per_task[kind][CPU_US] for kind in KINDS}
    # A script's own commands are counted in its EVALSHA's usec and again under their names:
    # the usec are shown by command, never summed; the server's CPU time is the total.
    by_command = "; ".join(
        kind + " " + " ".join(f"{c}={v / count:.1f}" for c, v in usec[kind].most_common(9))
        for kind in (GATED, PLAIN)
    )
    lines.append(
        f"{pool} server cpu_us per task gated={cpu[GATED]:.0f} plain={cpu[PLAIN]:.0f} "
        f"pings={cpu[YARDSTICK]:.0f} (INFO cpu); commandstats usec per task, by command "
        f"(evalsha's includes the commands its script ran, also shown under their names): "
        f"{by_command}"
    )
    return lines, ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=positive, default=2000, help="tasks per kind per round")
    parser.add_argument("--rounds", type=positive, default=3, help="rounds per pool (default 3)")
    parser.add_argument(
        "--blocks", type=positive, default=10, help="blocks per kind per round (default 10)"
    )
    parser.add_argument(
        "--pools",
        default="prefork,solo",
        help="comma-separated, in this order (default prefork,solo)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="then one extra solo round under cProfile"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--pool", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--hostname", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.redis_url, args.pool, args.concurrency, Path(args.folder), args.profile,
                     args.hostname)  # fmt: skip
    pools = [p for p in args.pools.split(",") if p]
    unknown = [p for p in pools if p not in POOLS]
    if unknown:
        parser.error(f"--pools: expected solo and/or prefork, got {unknown}")
    if args.blocks > args.n:
        parser.error("--blocks must not exceed -n")

    print(
        f"bench/worker.py {datetime.datetime.now().isoformat(timespec='seconds')} "
        f"N={args.n} rounds={args.rounds} blocks={args.blocks} python={platform.python_version()} "
        f"celery={celery.__version__} gatekeeper={gatekeeper.__version__} cpus={os.cpu_count()}"
    )
    started = time.perf_counter()
    with EmbeddedRedis() as server:
        bench = Bench(server.url)
        try:
            status = run(bench, server.port, pools, args, args.profile)
        finally:
            bench.close()
    print(f"elapsed={time.perf_counter() - started:.1f}s")
    return status


def run(bench: Bench, port: int, pools: list[str], args: argparse.Namespace, profile: bool) -> int:
    n, rounds, blocks = args.n, args.rounds, args.blocks
    version = bench.client.info("server")["redis_version"]
    print(f"redis=embedded :{port} (broker and gate) redis_version={version}", flush=True)
    results: dict[str, list[Round]] = {}
    for pool in pools:  # the order of the kinds alternates round by round
        results[pool] = [bench.round(pool, n, blocks, i * blocks) for i in range(rounds)]
    problems = check([r for rs in results.values() for r in rs], bench.client)
    if problems:  # no figure: it would not be that of the path the bench claims
        sys.stdout.flush()
        for problem in problems:
            print(f"bench: {problem}", file=sys.stderr)
        return 1
    ratios = {}
    for pool in pools:
        lines, ratios[pool] = report(pool, results[pool], n)
        for line in lines:
            print(line)
    print(
        "checks: every gated task admit_free/fits, run once from free, one free/ok ledger "
        "row; every plain task run once from celery, every pings task from bench_pings"
    )
    if profile:
        extra = bench.round("solo", n, blocks, 0, profile=True)
        failed = check([extra], bench.client)
        if failed:
            print("bench: the profiled round failed its checks: " + "; ".join(failed),
                  file=sys.stderr)  # fmt: skip
            return 1
        print(bench.profile_text)
    if "solo" in ratios:
        print(f"ratio={ratios['solo']:.3f} (solo pool, gated/plain tasks/s; target >= 0.80)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
