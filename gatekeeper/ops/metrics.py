"""``gatekeeper metrics``: Prometheus metrics computed at scrape time from the gate's state in
Redis, served at ``/metrics`` (port 9808 by default; the replayer can serve them too).

A custom collector (:class:`GateCollector`), not metric objects updated in process: every
publisher, worker and replayer process writes its events into Redis, so one exporter gives
one answer for all of them, with no multi-process directory. Counters are the lifetime
totals that never expire (``totals`` in :mod:`gatekeeper.redis.keys`); gauges are read as
``gatekeeper status`` reads them: the current window, the free queue's oldest admission, the
flags in force (:func:`~gatekeeper.redis.flags.combine`: the state marker and the eviction
policy included), the broker's queue lengths (:func:`~gatekeeper.celery.broker.broker_for`:
Redis lists, or a passive declare on RabbitMQ), the nearest deferred deadline and the
replayer's last pass. The names, types and labels are ``docs/metrics.md``'s: the contract
with the alert rules and the dashboard.

A scrape reads one small hash, a few fields and keys (:func:`~gatekeeper.redis.snapshot.
read_snapshot`), never a whole large hash or list, through the gate's own client with its
short timeout (``redis_timeout_s``), so a hung Redis costs a scrape one timeout: it then
says ``gatekeeper_redis_up 0`` and nothing else but its duration.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import click
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import CollectorRegistry

from gatekeeper.celery.broker import BROKER_ERRORS, Broker, broker_for, shown_url
from gatekeeper.celery.parts import gate_client
from gatekeeper.core.dwell import Decision
from gatekeeper.core.ledger import window_id
from gatekeeper.errors import ConfigError, LedgerUnavailable
from gatekeeper.logs import make_logger
from gatekeeper.ops.context import app_of, settings_of
from gatekeeper.redis.deployment import latest, recorded
from gatekeeper.redis.flags import STATE_FIELD, combine
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.snapshot import Snapshot, read_snapshot
from gatekeeper.settings import GatekeeperSettings

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "GateCollector", "collector_for", "metrics", "serve"]

DEFAULT_PORT = 9808
"""``gatekeeper metrics``'s port (issue 13's; celery-exporter defaults to it too, so give one
of them ``--port`` where both run on one host)."""
DEFAULT_HOST = "127.0.0.1"
"""Served on the loopback unless told otherwise: the metrics name tasks and queues."""
QUEUE_ROLES = ("free", "defer", "reserved", "dead_letter")
"""The ``queue`` label's values: the role of each of gatekeeper's queues, whatever its name."""
COUNTED = (
    ("gatekeeper_slack_misses_total", "slack_misses",
     "Free attempts whose deadline was missed (SPEC section 2)."),
    ("gatekeeper_killed_rows_total", "killed_rows", "Ledger rows with outcome killed."),
    ("gatekeeper_abandoned_total", "abandoned",
     "Tasks abandoned to the dead letter (deadline passed in defer)."),
    ("gatekeeper_freezes_total", "freezes", "Times the auto-freeze closed the free path."),
)  # fmt: skip
"""Counters kept in the ``totals`` hash: (metric, field, help)."""
STATS = (
    ("gatekeeper_reruns_after_row_total", "reruns_after_row",
     "Runs of an attempt that already had its row (a finished message delivered again)."),
    ("gatekeeper_forged_runs_total", "forged_runs",
     "Runs of messages whose nonce is not their existing record's, or whose attempt the gate "
     "never writes (run unpriced, as ordinary tasks)."),
    ("gatekeeper_unverified_runs_total", "unverified_runs",
     "Runs of messages with gatekeeper headers and no nonce, or no record at all (unpriced "
     "rows)."),
)  # fmt: skip
"""Counters kept in the ``stats`` hash (``gatekeeper status`` prints them)."""


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


class Monotonic:
    """What the counters show: never less than this exporter showed before, while the state
    marker is the same. A Redis restarted from an older snapshot (RDB, the default) comes
    back with the last seconds of counts lost; shown as read, the counter went down, which
    Prometheus takes for a reset to zero, so ``rate`` and ``increase`` (the alert rules)
    counted the whole total again. From such a drop on, the counter goes on from where it was
    (the drop is kept as an offset and added). A new state marker (``gatekeeper init`` after
    the state was lost) is a reset, and shown as one."""

    def __init__(self) -> None:
        self._epoch: str | None = None
        self._shown: dict[tuple[str, ...], float] = {}
        self._offset: dict[tuple[str, ...], float] = {}

    def epoch(self, marker: str | None) -> None:
        """The state marker read with the counters: a new one forgets what was shown."""
        if marker != self._epoch:
            self._epoch = marker
            self._shown.clear()
            self._offset.clear()

    def __call__(self, key: tuple[str, ...], value: float) -> float:
        if math.isnan(value):
            return value
        shown = value + self._offset.get(key, 0.0)
        before = self._shown.get(key)
        if before is not None and shown < before:
            self._offset[key] = self._offset.get(key, 0.0) + before - shown
            shown = before
        self._shown[key] = shown
        return shown


def _number(text: str | None) -> float:
    try:
        return float(text) if text is not None else 0.0
    except ValueError:
        return math.nan


class GateCollector:
    """Reads one namespace's state at each scrape (``prometheus_client``'s custom collector).

    ``broker`` makes the broker whose queues are counted; it is made at the first scrape,
    kept, and made again after it failed. Scrapes are taken one at a time (a RabbitMQ
    connection is not shared between threads)."""

    def __init__(
        self,
        settings: GatekeeperSettings,
        client: Any,
        broker: Callable[[], Broker],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.client = client
        self.keys = Keys(settings.key_prefix, settings.namespace)
        self.clock = clock
        self.log = make_logger(settings, "metrics")
        self._make_broker = broker
        self._broker: Broker | None = None
        self._lock = threading.Lock()
        self.monotonic = Monotonic()

    def describe(self) -> list[Metric]:
        """Nothing: registering the collector must not read Redis."""
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            began = time.perf_counter()
            families = list(self._families())
            took = time.perf_counter() - began
        families.append(_gauge("gatekeeper_scrape_duration_seconds",
                               "How long the collector took.", took))  # fmt: skip
        return iter(families)

    def _families(self) -> Iterator[Metric]:
        now = self.clock()
        seconds, budget = self.settings.window_seconds, self.settings.budget_units
        try:  # the deployment's window and budget, as the clean hour reads them (deployment.py)
            judges = latest(recorded(self.client, self.keys), now)
        except (LedgerUnavailable, ConfigError) as exc:
            judges = []  # (unreadable: said, and this process's own are shown)
            if isinstance(exc, ConfigError):
                self.log.warning("metrics_deployment_unreadable", error=str(exc))
        if judges and (lowest := judges[0].budget_units) is not None:
            seconds, budget = judges[0].window_seconds, lowest
        try:
            snap = read_snapshot(self.client, self.keys, window_id(now, seconds))
        except LedgerUnavailable as exc:
            self.log.warning("metrics_redis_unreadable", error=str(exc))
            yield _gauge("gatekeeper_redis_up", "1 when the exporter read the gate's Redis.", 0)
            return
        yield _gauge("gatekeeper_redis_up", "1 when the exporter read the gate's Redis.", 1)
        yield from self._counters(snap)
        yield from self._window(snap, now, seconds, budget)
        yield from self._flags(snap)
        yield from self._queues()

    def _counters(self, snap: Snapshot) -> Iterable[Metric]:
        shown = self.monotonic
        shown.epoch(snap.flags.get(STATE_FIELD))
        decided = CounterMetricFamily(
            "gatekeeper_decisions_total",
            "Gate decisions, replays included (a replayed task is decided again).",
            labels=("task", "decision", "reason"),
        )
        for (task, decision, reason), count in sorted(snap.decisions.items()):
            decided.add_metric((task, decision, reason), shown(("", task, decision, reason), count))
        yield decided
        admitted = sum(n for (_, d, _), n in snap.decisions.items() if d == Decision.ADMIT_FREE)
        yield _counter("gatekeeper_free_admissions_total", "Attempts admitted to free.",
                       shown(("admitted_free",), admitted))  # fmt: skip
        for name, field, documentation in COUNTED:
            yield _counter(name, documentation, shown((field,), _number(snap.totals.get(field))))
        for name, field, documentation in STATS:
            yield _counter(name, documentation, shown((field,), _number(snap.stats.get(field))))

    def _window(self, snap: Snapshot, now: float, seconds: int, budget: float) -> Iterable[Metric]:
        tax = _number(snap.window.get("tax_units"))
        yield _gauge("gatekeeper_window_tax_units",
                     "The current window's retry tax, in budget units.", tax)  # fmt: skip
        yield _gauge("gatekeeper_window_exposure_units",
                     "What admissions of the current window hold reserved.",
                     _number(snap.window.get("exposure")))  # fmt: skip
        yield _gauge("gatekeeper_budget_units", "budget_units, the window's ceiling.", budget)
        yield _gauge("gatekeeper_budget_left_units",
                     "budget_units - tax for the current window.", budget - tax)  # fmt: skip
        yield _gauge("gatekeeper_window_seconds", "window_seconds.", seconds)
        yield _gauge("gatekeeper_window_free_admissions",
                     "Free admissions of the current window (the freeze rule's denominator).",
                     _number(snap.window.get("admitted_free")))  # fmt: skip
        yield _gauge("gatekeeper_window_slack_misses",
                     "Slack misses charged to the current window (the freeze rule's numerator).",
                     _number(snap.window.get("slack_misses")))  # fmt: skip
        oldest = snap.oldest_waiting_ms
        age = max(0.0, now - oldest / 1000) if oldest is not None else 0.0
        yield _gauge("gatekeeper_free_queue_age_seconds",
                     "Age of the oldest admission still waiting on free.", age)  # fmt: skip
        yield _gauge("gatekeeper_free_waiting_attempts",
                     "Admissions waiting on free (not yet started).", snap.waiting)  # fmt: skip
        if snap.next_deadline_ms is not None:
            yield _gauge("gatekeeper_defer_next_deadline_seconds",
                         "Seconds until the nearest deadline among deferred tasks.",
                         snap.next_deadline_ms / 1000 - now)  # fmt: skip
        if snap.last_pass_s is not None:
            yield _gauge("gatekeeper_replayer_last_pass_timestamp_seconds",
                         "Unix time of the replayer's last completed pass.",
                         snap.last_pass_s)  # fmt: skip

    def _flags(self, snap: Snapshot) -> Iterable[Metric]:
        flags = combine(self.settings, snap.flags, snap.policy)
        yield _gauge("gatekeeper_free_path_enabled",
                     "1 when the free path is open (flags in force, state marker included).",
                     float(flags.free_path_enabled))  # fmt: skip
        yield _gauge("gatekeeper_dwell_gate_enabled", "1 when the gate decides.",
                     float(flags.dwell_gate_enabled))  # fmt: skip
        yield _gauge("gatekeeper_canary_ratio", "canary_percent / 100.",
                     flags.canary_percent / 100)  # fmt: skip
        yield _gauge("gatekeeper_state_missing",
                     "1 when the gate's state marker is gone (SPEC: state loss).",
                     float(flags.state_missing))  # fmt: skip
        if not flags.state_missing:
            yield _gauge("gatekeeper_state_initialised_timestamp_seconds",
                         "When gatekeeper init wrote the state marker (Unix time).",
                         _number(snap.flags.get(STATE_FIELD)))  # fmt: skip
        yield _gauge("gatekeeper_redis_noeviction",
                     "1 when the gate Redis's maxmemory-policy is noeviction (else the free "
                     "path is closed).", float(flags.eviction is None))  # fmt: skip

    def _queues(self) -> Iterable[Metric]:
        settings = self.settings
        names = (settings.free_queue, settings.defer_queue, settings.reserved_queue,
                 settings.dead_letter_queue)  # fmt: skip
        try:
            broker = self._broker = self._broker or self._make_broker()
            lengths = [broker.length(name) for name in names]
            claimed = broker.claimed()
        except (*BROKER_ERRORS, ConfigError) as exc:
            self.log.warning("metrics_broker_unreadable", error=str(exc))
            self._forget_broker()
            yield _gauge("gatekeeper_broker_up", "1 when the exporter read the broker.", 0)
            return
        yield _gauge("gatekeeper_broker_up", "1 when the exporter read the broker.", 1)
        queues = GaugeMetricFamily(
            "gatekeeper_queue_messages",
            "Messages waiting in free, defer, reserved and dead_letter.",
            labels=("queue",),
        )
        for role, length in zip(QUEUE_ROLES, lengths, strict=True):
            queues.add_metric((role,), length)
        yield queues
        if claimed is not None:  # RabbitMQ holds a replayer's unacked messages itself
            yield _gauge("gatekeeper_defer_claimed_messages",
                         "Deferred messages a replayer has claimed and not yet handed on.",
                         claimed)  # fmt: skip

    def _forget_broker(self) -> None:
        broker, self._broker = self._broker, None
        if broker is not None:
            with contextlib.suppress(Exception):  # closing a broken connection may fail too
                broker.close()


def collector_for(settings: GatekeeperSettings, app: Any = None) -> GateCollector:
    """A collector on the gate's own client (``redis_timeout_s``, no retry) and the broker of
    these settings (with the app's ``broker_url``), its Redis timeouts as short."""
    timeout = settings.redis_timeout_s
    return GateCollector(settings, gate_client(settings),
                         lambda: broker_for(settings, app, timeout_s=timeout))  # fmt: skip


def serve(collector: GateCollector, host: str, port: int) -> Any:
    """Serve ``collector`` at ``http://host:port/metrics`` from a daemon thread; returns the
    server (``shutdown()`` stops it). Only gatekeeper's metrics: a registry of its own."""
    registry = CollectorRegistry()
    registry.register(collector)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server


def listening(ctx: click.Context, collector: GateCollector, host: str, port: int) -> Any:
    """:func:`serve`, or a usage error naming the address that cannot be listened on."""
    try:
        return serve(collector, host, port)
    except OSError as exc:
        raise click.UsageError(f"--port: cannot listen on {host}:{port}: {exc}", ctx=ctx) from exc


@click.command()
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="Port to serve /metrics on.")  # fmt: skip
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to listen on.")
@click.pass_context
def metrics(ctx: click.Context, port: int, host: str) -> None:
    """Serve Prometheus metrics computed from the gate's state in Redis at /metrics."""
    settings = settings_of(ctx)
    try:
        collector = collector_for(settings, app_of(ctx))
    except ConfigError as exc:
        raise click.UsageError(str(exc), ctx=ctx) from exc
    server = listening(ctx, collector, host, port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    click.echo(f"serving http://{host}:{server.server_port}/metrics "
               f"(gate {shown_url(collector.client)}, namespace {settings.namespace})")  # fmt: skip
    while not stop.wait(1.0):  # woken once a second: a signal always gets its turn
        pass
    server.shutdown()
