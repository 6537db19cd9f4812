"""The on-call's commands: ledger, sweep and the replayer.

``status`` is in :mod:`gatekeeper.ops.status`, the flag commands in
:mod:`gatekeeper.ops.flag_commands`, ``report`` (and its ``--html`` page) in
:mod:`gatekeeper.ops.report`.

Registered on the ``gatekeeper`` group by :mod:`gatekeeper.ops.cli`. Each reads settings at the edge
and talks to the gate's Redis (``GATEKEEPER_REDIS_URL``) and, for queue lengths and the
replayer, the broker (``GATEKEEPER_BROKER_URL``, else the same Redis).
"""

from __future__ import annotations

import json
import math
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
import redis

from gatekeeper.celery.broker import BROKER_ERRORS, Broker, broker_for, shown_url
from gatekeeper.celery.replay import Replayer
from gatekeeper.core.ledger import LedgerRow, summarize, window_id
from gatekeeper.errors import ConfigError, LedgerUnavailable
from gatekeeper.logs import make_logger
from gatekeeper.ops.context import app_of, settings_of
from gatekeeper.ops.metrics import DEFAULT_HOST, collector_for, listening
from gatekeeper.redis.breaker import no_retry
from gatekeeper.redis.connect import client_for
from gatekeeper.redis.deployment import latest, recorded, shown
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.scripts import read_rows
from gatekeeper.redis.store import GateStore
from gatekeeper.redis.sweep import forget_purged
from gatekeeper.redis.sweep import sweep as sweep_runs
from gatekeeper.settings import GatekeeperSettings

__all__ = [
    "as_deployed",
    "broker_of",
    "ledger",
    "redis_client",
    "replay",
    "show_value",
    "sweep",
]


def redis_client(ctx: click.Context) -> redis.Redis:
    """A client on the gate's Redis, from settings."""
    settings = settings_of(ctx)
    try:
        url = settings.gate_redis_url()
    except ConfigError as exc:
        raise click.UsageError(str(exc), ctx=ctx) from exc
    # No automatic retry, said explicitly as for the publish path's client: a re-sent flag
    # write could apply twice; the replayer tries again on its own.
    try:
        return client_for(url, 5.0, settings.transport_options_for(url), **no_retry())
    except ConfigError as exc:  # a sentinel URL without its master, say
        raise click.UsageError(str(exc), ctx=ctx) from exc


def as_deployed(
    ctx: click.Context, client: redis.Redis, writes: bool = False
) -> GatekeeperSettings:
    """The settings with the deployment's ``window_seconds`` and ``budget_units`` (the pair
    :func:`gatekeeper.redis.deployment.latest` puts first: of the workers' window size, with
    the lowest budget), said on stderr where they are not this shell's or several were seen;
    the shell's own when none is recorded or what is recorded cannot be read (said too;
    ``writes``: refused instead)."""
    settings = settings_of(ctx)
    try:
        judges = latest(recorded(client, Keys(settings.key_prefix, settings.namespace)),
                        time.time())  # fmt: skip
    except LedgerUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    except ConfigError as exc:
        if writes:  # rows or a decision in the shell's window could be read by nobody
            raise click.ClickException(f"{exc}; nothing was done") from exc
        click.echo(f"warning: {exc}; this shell's window_seconds and budget_units are used",
                   err=True)  # fmt: skip
        return settings
    chosen, note = shown(settings, judges)
    if note:
        click.echo(f"note: {note}", err=True)
    if chosen is None or chosen.budget_units is None:
        return settings
    return settings.model_copy(update={"window_seconds": chosen.window_seconds,
                                       "budget_units": chosen.budget_units})  # fmt: skip


def broker_of(ctx: click.Context) -> Broker:
    """The broker whose queues the command reads (Redis or RabbitMQ), from settings (and the
    app's ``broker_url`` with ``-A``)."""
    try:
        return broker_for(settings_of(ctx), app_of(ctx))
    except ConfigError as exc:
        raise click.UsageError(str(exc), ctx=ctx) from exc


def show_value(value: object) -> str:
    """A flag's value as the CLI prints it (booleans lower-case)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _window_option(value: str, now: float, window_seconds: int) -> int:
    current = window_id(now, window_seconds)
    if value == "current":
        return current
    if value == "previous":
        return current - 1
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(
            f"expected current, previous or a window id, got {value!r}", param_hint="--window"
        ) from None


@click.command()
@click.option(
    "--window",
    "window",
    default="current",
    show_default=True,
    help="current, previous, or a window id (Unix seconds // window_seconds).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the window's rows (default: the temp dir).",
)
@click.pass_context
def ledger(ctx: click.Context, window: str, json_path: Path | None) -> None:  # fmt: skip
    """Print a window's summary line and write its rows as JSON."""
    client = redis_client(ctx)
    settings = as_deployed(ctx, client)
    ident = _window_option(window, time.time(), settings.window_seconds)
    keys = Keys(settings.key_prefix, settings.namespace)
    try:
        rows = read_rows(client, keys, ident)
    except LedgerUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        parsed = [LedgerRow.from_json(row) for row in rows]
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise click.ClickException(
            f"window {ident} holds a row that is not a ledger row ({exc!r}): written by "
            "something other than gatekeeper?"
        ) from exc
    summary = summarize(parsed, settings.budget_units)
    click.echo(summary.line())
    out = json_path or Path(tempfile.gettempdir()) / f"gatekeeper-ledger-{ident}.json"
    document = {
        "window_id": ident,
        "window_seconds": settings.window_seconds,
        "budget_units": settings.budget_units,
        "summary": summary.line(),
        "tax_units": summary.tax_units,
        "rows": rows,
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise click.BadParameter(
            f"cannot write {out}: {exc.strerror}", param_hint="--json"
        ) from exc
    click.echo(f"wrote {out}")


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"expected a number of seconds, 0 or more; got {value!r}")
    return value


@click.command()
@click.option(
    "--older-than-s",
    type=click.FloatRange(min=0, max=1e12),
    default=None,
    callback=lambda _ctx, _param, value: _finite(value),
    help="Runs started longer ago with no row (default: stale_attempt_s; seconds, 0 or "
    "more). Admissions never started are given back only past queue_age_horizon_s too.",
)
@click.pass_context
def sweep(ctx: click.Context, older_than_s: float | None) -> None:  # fmt: skip
    """Record runs whose worker vanished without any signal as killed, and stop counting
    admissions whose message is gone from the broker (after ``celery purge -Q free``)."""
    client = redis_client(ctx)
    settings = as_deployed(ctx, client, writes=True)  # a killed row: the deployment's window
    store = RunLedger.from_settings(client, settings)
    limit = settings.stale_attempt_s if older_than_s is None else older_than_s
    now_ms = round(time.time() * 1000)
    try:
        gate_store = GateStore(store.client, store.keys, horizon_s=settings.queue_age_horizon_s)
        rows = sweep_runs(store, now_ms, limit, gate_store)
    except (LedgerUnavailable, *BROKER_ERRORS) as exc:
        raise click.ClickException(str(exc)) from exc
    log = make_logger(settings, "worker")
    for row, verified in rows:  # said before the broker is asked: they are written
        log.warning(
            "ledger_row", job_id=row.job_id, attempt=row.attempt, path=row.path.value,
            outcome=row.outcome.value, reason="vanished", retry_tax=row.retry_tax,
            **({} if verified else {"verified": False}),
        )  # fmt: skip
    try:
        broker = broker_of(ctx)
        present = broker.waiting(settings.free_queue)  # None: RabbitMQ cannot list a queue
    except (LedgerUnavailable, *BROKER_ERRORS) as exc:
        raise click.ClickException(f"swept={len(rows)}, then the broker could not be read "
                                   f"for purged admissions: {exc}") from exc  # fmt: skip
    try:
        forgotten = None if present is None else forget_purged(gate_store, present, now_ms)
    except (LedgerUnavailable, redis.RedisError) as exc:
        raise click.ClickException(f"swept={len(rows)}, then the gate's Redis could not "
                                   f"forget purged admissions: {exc}") from exc  # fmt: skip
    if forgotten:
        log.warning("free_admissions_forgotten", count=forgotten, queue=settings.free_queue,
                    reason="message no longer in the broker")  # fmt: skip
    if forgotten is None:
        click.echo(f"swept={len(rows)} forgotten=n/a ({broker.shown}: a queue cannot be "
                   "listed without consuming it; purged admissions stop counting at the "
                   "horizon)")  # fmt: skip
    else:
        click.echo(f"swept={len(rows)} forgotten={forgotten}")


def _incomplete(totals: Counter[str]) -> list[str]:
    """Why a ``replay --once`` pass did not do all its work, each with its count (none: it
    handed on every message it took); the command then exits 1, for a cron job or a Job to see."""
    why: list[str] = []
    if totals["pass_failed"]:
        why.append("the pass failed (replay_pass_failed above says why)")
    if totals["lock_held"]:
        why.append("another replayer holds the lock: nothing replayed")
    if totals["lock_lost"]:
        why.append("the lock was lost mid-pass: the rest is left to its holder")
    if given_back := totals["given_back"]:
        why.append(
            f"given_back={given_back}: {given_back} message{'s' * (given_back != 1)} not handed "
            "on (a move refused: this replayer's tenure ended, or the lock's holder took the "
            "copy back; or the broker's connection dropped). None is lost: the next pass "
            "hands them on"
        )
    return why


@click.command()
@click.option("--once", is_flag=True,
              help="One pass, then exit: 1 if it did not hand on all it took.")  # fmt: skip
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Also serve gatekeeper metrics at /metrics on this port.")  # fmt: skip
@click.option("--metrics-host", default=DEFAULT_HOST, show_default=True,
              help="Address the metrics are served on.")  # fmt: skip
@click.pass_context
def replay(ctx: click.Context, once: bool, metrics_port: int | None, metrics_host: str) -> None:
    """Score deferred tasks again and hand them to free, reserved, defer or the dead letters.

    With --once, one pass, then exit 0 when it handed on every message it took; 1, saying
    what happened and to how many, when the pass failed, another replayer holds the lock,
    the lock was lost mid-pass, or messages were given back, not handed on (given_back=N: a
    move refused, or the broker's connection dropped; none is lost, the next pass hands them
    on). Without --once it runs until stopped (SIGINT, SIGTERM), and exits 0.
    """
    settings = settings_of(ctx)  # its own: a process of the deployment, whose pair it keeps
    replayer = Replayer(settings, broker_of(ctx), redis_client(ctx), app=app_of(ctx))
    if metrics_port is not None:
        collector = collector_for(settings, app_of(ctx))
        listening(ctx, collector, metrics_host, metrics_port)  # a daemon thread: ends with us
    stop = threading.Event()

    def on_signal(signum: int, _: Any) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    broker = replayer.broker.shown
    replayer.log.info("replay_started", queue=settings.defer_queue, replayer=replayer.ident,
                      broker=broker, gate=shown_url(replayer.gate_client))  # fmt: skip
    totals = replayer.run(stop, once=once)
    done = " ".join(f"{k}={v}" for k, v in sorted(totals.items())) or "nothing to replay"
    click.echo(f"{done} (broker {broker}, queue {settings.defer_queue})")
    if once and (why := _incomplete(totals)):
        raise click.ClickException("; ".join(why))
