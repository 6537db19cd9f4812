"""``gatekeeper status``: what an on-call reads first. The flags (every source that closes the
free path, who changed them, when, why), the state marker, the free queue's age, the queues'
lengths, this window's budget, the workers' and replayer's counts and the decision records.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

import click
import redis

from gatekeeper.celery.broker import BROKER_ERRORS
from gatekeeper.core.ledger import window_id
from gatekeeper.errors import ConfigError, LedgerUnavailable
from gatekeeper.ops.context import app_of
from gatekeeper.ops.oncall import as_deployed, broker_of, redis_client, show_value
from gatekeeper.ops.service_status import service_lines
from gatekeeper.redis.cluster import home
from gatekeeper.redis.decisions import stream_state
from gatekeeper.redis.flags import (
    FLAG_NAMES,
    STATE_FIELD,
    STATE_MISSING,
    Flags,
    FlagStore,
    combine,
    parse_flag,
)
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import read_windows, text_of
from gatekeeper.redis.service_times import ServiceTimes
from gatekeeper.redis.snapshot import read_waiting, waiting_of
from gatekeeper.settings import GatekeeperSettings

__all__ = ["status"]


@click.command()
@click.pass_context
def status(ctx: click.Context) -> None:
    """Flags (who changed them, when, why), queue age and lengths, this window's budget."""
    gate, broker = redis_client(ctx), broker_of(ctx)
    settings = as_deployed(ctx, gate)  # the deployment's window and budget, said if not ours
    keys = Keys(settings.key_prefix, settings.namespace)
    store = FlagStore(gate, settings, keys)
    now = time.time()
    try:
        stored = store.stored()
        policy = store.eviction_policy()
        history = store.history(limit=50)
        # one transaction (a size less its pad), on a cluster the slot's primary's
        pipe = home(gate, keys.free_waiting, fresh=True).pipeline(transaction=True)
        read_waiting(pipe, keys)
        oldest_ms, waiting = waiting_of(*pipe.execute())
        current = window_id(now, settings.window_seconds)
        (window,) = read_windows(gate, keys, range(current, current + 1))
    except (redis.RedisError, LedgerUnavailable) as exc:
        raise click.ClickException(f"cannot read the gate's Redis: {exc}") from exc
    effective = combine(settings, stored, policy)
    if effective.eviction is not None:
        click.echo(f"redis maxmemory-policy={policy}: the free path is closed until it is "
                   "noeviction (an evicted key undoes a budget or a rollback)")  # fmt: skip
    if effective.state_missing:
        click.echo(f"state=MISSING: {STATE_MISSING}")
    else:
        click.echo(f"state=initialised {STATE_FIELD}={stored[STATE_FIELD]}")
    for name in FLAG_NAMES:
        source = "redis" if name in stored else "settings"
        says_off = name == "free_path_enabled" and not effective.free_path_enabled
        if says_off:  # every source that closes it: the one a page must change is among them
            source = ", ".join(_closing(settings, stored, effective))
        line = f"flag {name}={show_value(getattr(effective, name))} ({source})"
        last = next((c for c in history if c.name == name), None)
        if says_off and "redis" not in source:
            last = None  # Redis's last change did not set this value: it does not explain it
        if last is not None:
            when = datetime.fromtimestamp(last.at, tz=timezone.utc).isoformat(timespec="seconds")
            line += f" changed {when} by {last.actor}: {last.reason}"
        click.echo(line)
    age = max(0.0, now - oldest_ms / 1000) if oldest_ms is not None else 0.0
    click.echo(f"free_queue_age_s={age:.3f} waiting_free={waiting}")
    lengths = []
    for queue in (settings.free_queue, settings.defer_queue, settings.reserved_queue,
                  settings.dead_letter_queue):  # fmt: skip
        try:
            lengths.append(f"{queue}={broker.length(queue)}")
        except BROKER_ERRORS as exc:
            raise click.ClickException(f"cannot read the broker ({broker.shown}): {exc}") from exc
    try:
        claimed = broker.claimed()  # None: RabbitMQ holds a replayer's unacked messages itself
        delayed = broker.delayed(settings.defer_queue)  # RabbitMQ: waiting out a backoff
    except BROKER_ERRORS as exc:
        raise click.ClickException(f"cannot read the broker ({broker.shown}): {exc}") from exc
    if claimed is not None:
        lengths.append(f"{settings.defer_queue}:replaying={claimed}")
    if delayed is not None:
        lengths.append(f"{settings.defer_queue}:delayed={delayed}")
    broker.close()
    click.echo("queues " + " ".join(lengths) + f" (broker {broker.shown})")
    try:
        stats = {text_of(k): text_of(v) for k, v in gate.hgetall(keys.stats).items()}
    except redis.RedisError as exc:
        raise click.ClickException(f"cannot read the gate's Redis: {exc}") from exc
    try:
        tax = float(window.get("tax_units", 0))
        exposure = float(window.get("exposure", 0))
        admitted = int(window.get("admitted_free", 0))
        misses = int(window.get("slack_misses", 0))
    except (ValueError, OverflowError) as exc:
        raise click.ClickException(
            f"window {window_id(now, settings.window_seconds)} holds a counter that is not a "
            f"number ({exc}): written by something other than gatekeeper?"
        ) from exc
    rate = f"{misses / admitted:.4f}" if admitted else "n/a"
    click.echo(
        f"window={window_id(now, settings.window_seconds)} tax_units={tax:.1f} "
        f"exposure={exposure:.0f} budget_units={settings.budget_units:.0f} "
        f"budget_left={settings.budget_units - tax:.0f} admitted_free={admitted} "
        f"slack_misses={misses} miss_rate={rate}"
    )
    # Runs of messages the gate has no record of: forged (a nonce that is not the record's,
    # or an attempt the gate never writes: run as ordinary tasks, priced nothing) and
    # unverified (no nonce: an older publisher, or a decision made without Redis; unpriced
    # rows).
    counters = ("reruns_after_row", "forged_runs", "unverified_runs")
    click.echo(" ".join(f"{name}={stats.get(name, 0)}" for name in counters))
    try:  # per task: the declared service time and the learned p95 (SPEC section 6)
        service = service_lines(ServiceTimes(gate, keys), settings, app_of(ctx))
    except LedgerUnavailable as exc:
        raise click.ClickException(f"cannot read the gate's Redis: {exc}") from exc
    click.echo("\n".join(service) if service else "service no task has observed runs yet")
    try:  # what gatekeeper tune can re-decide
        length, first_ms, refused = stream_state(gate, keys)
    except LedgerUnavailable as exc:
        raise click.ClickException(f"cannot read the gate's Redis: {exc}") from exc
    since = "-" if first_ms is None else datetime.fromtimestamp(
        first_ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")  # fmt: skip
    click.echo(f"records entries={length} since={since} "
               f"decision_record_cap={settings.decision_record_cap} refused={refused}")  # fmt: skip


def _closing(settings: GatekeeperSettings, stored: dict[str, str], effective: Flags) -> list[str]:
    """Every source that closes the free path (SPEC: false in the settings or in Redis; the
    state marker missing and an eviction policy close it too)."""
    closing = [] if settings.free_path_enabled else ["settings"]
    if "free_path_enabled" in stored:
        try:
            opened = parse_flag("free_path_enabled", stored["free_path_enabled"])
        except ConfigError:
            opened = False  # a corrupt value closes it (combine)
        if not opened:
            closing.append("redis")
    if effective.state_missing:
        closing.append("state missing")
    if effective.eviction is not None:
        closing.append(f"maxmemory-policy {effective.eviction}")
    return closing
