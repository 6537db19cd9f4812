"""The on-call's flag commands: ``gatekeeper flags``, ``flags set``, ``flags unset``, and
``gatekeeper init`` (the state marker).

Registered on the ``gatekeeper`` group by :mod:`gatekeeper.ops.cli`. Every change is written to
the flag log with its reason and actor, and logged; re-opening the free path needs a clean
ledger hour or ``--force`` (:class:`gatekeeper.redis.flags.FreePathLocked`).
"""

from __future__ import annotations

import getpass
import socket
import time
from datetime import datetime, timezone

import click

from gatekeeper.errors import ConfigError, FreePathLocked, LedgerUnavailable
from gatekeeper.logs import make_logger
from gatekeeper.ops.context import settings_of
from gatekeeper.ops.oncall import redis_client, show_value
from gatekeeper.redis.durable import REPLICA_WAIT_S
from gatekeeper.redis.flags import FLAG_NAMES, STATE_FIELD, STATE_MISSING, FlagStore, combine

__all__ = ["flags", "init"]


DISK_WAIT_S = 30.0
"""How long a flag command waits for the snapshot that puts its change on disk."""


def _flag_store(ctx: click.Context) -> FlagStore:
    store = FlagStore(redis_client(ctx), settings_of(ctx))
    store.disk_wait_s = DISK_WAIT_S
    return store


def _said_unused(store: FlagStore) -> None:
    """A namespace without the state marker: written to, but likely not the one in use."""
    try:
        missing = STATE_FIELD not in store.stored()
    except LedgerUnavailable:
        return
    if missing:
        click.echo(f"warning: namespace {store.keys.namespace!r} has no state marker: never "
                   "initialised (not your deployment's? check GATEKEEPER_NAMESPACE or -A proj), "
                   "or its state was lost (then nothing goes to free until `gatekeeper init`: "
                   "see `gatekeeper status`)", err=True)  # fmt: skip


def _said_on_disk(store: FlagStore) -> bool:
    """How the change reached the server's disk and its replicas, and what a restart or a
    failover would do; False when not every replica has it (the command then exits 1: the
    change stands on the primary)."""
    replicated = _said_replicated(store)
    how = store.persisted
    if how in ("aof", "rdb"):
        click.echo(f"on_disk={how}")
    elif how == "aof_everysec":
        click.echo("on_disk=aof_everysec (Redis before 7.2 has no WAITAOF: on disk within "
                   "about a second with appendfsync everysec)")  # fmt: skip
    elif how == "none":
        click.echo("on_disk=none: this Redis keeps nothing on disk; a restart loses every "
                   "flag and the state marker (nothing then goes to free until gatekeeper "
                   "init)")  # fmt: skip
    else:
        click.echo(f"on_disk={how}: a restart of this Redis before its next snapshot may undo "
                   "this change; for a rollback that must hold, set it in the settings too "
                   "(GATEKEEPER_FREE_PATH_ENABLED=false)")  # fmt: skip
    return replicated


def _said_replicated(store: FlagStore) -> bool:
    if not store.replicas:
        return True
    acked, connected = (int(part) for part in store.replicas.split("/"))
    if acked >= connected:  # (a replica that connected after INFO may acknowledge too)
        click.echo(f"replicated={store.replicas}")
        return True
    click.echo(f"replicated={store.replicas}: in force on the primary, but not every replica "
               f"had it within {REPLICA_WAIT_S:g} s; a failover to one that lacks it would "
               "undo it: check `gatekeeper flags` once the replicas catch up, and for a "
               "rollback that must hold set it in the settings too "
               "(GATEKEEPER_FREE_PATH_ENABLED=false)", err=True)  # fmt: skip
    return False


def actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@click.group(invoke_without_command=True)
@click.pass_context
def flags(ctx: click.Context) -> None:
    """Show the live flags: the settings, the Redis overrides, and what is in force."""
    if ctx.invoked_subcommand is not None:
        return
    store = _flag_store(ctx)
    try:
        stored = store.stored()
        history = store.history(limit=5)
    except LedgerUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    effective = combine(store.settings, stored)
    if effective.state_missing:
        click.echo(f"state: MISSING: {STATE_MISSING}")
    for name in FLAG_NAMES:
        setting = getattr(store.settings, name)
        now = show_value(getattr(effective, name))
        click.echo(
            f"{name}: effective={now} settings={show_value(setting)} redis={stored.get(name, '-')}"
        )
    for change in history:
        when = datetime.fromtimestamp(change.at, tz=timezone.utc).isoformat(timespec="seconds")
        value = "(unset)" if change.value is None else change.value
        click.echo(f"changed {when} {change.name}={value} by {change.actor}: {change.reason}")


FORCE = click.option(
    "--force", is_flag=True, help="Re-open the free path without a clean ledger hour."
)


@flags.command(name="set")
@click.argument("name", type=click.Choice(FLAG_NAMES))
@click.argument("value")
@click.option("--reason", default="", help="Why: written to the flag log and the log line.")
@FORCE
@click.pass_context
def flags_set(ctx: click.Context, name: str, value: str, reason: str, force: bool) -> None:
    """Override a flag in Redis; new decisions obey within flag_cache_s.

    Setting free_path_enabled to true is refused unless the last hour of ledger windows is
    clean (no killed rows, every window's tax within budget), or --force is given.
    """
    store = _flag_store(ctx)
    why = reason or "(no reason given)"
    try:
        change = store.set(name, value, why, actor(), time.time(), force=force)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="VALUE") from exc
    except (LedgerUnavailable, FreePathLocked) as exc:
        make_logger(store.settings, "flags").warning(
            "flag_change_refused", name=name, value=value, reason=why, refusal=str(exc)
        )
        raise click.ClickException(str(exc)) from exc
    make_logger(store.settings, "flags").info(
        "flag_changed", name=name, value=change.value, reason=change.reason, actor=change.actor,
        on_disk=store.persisted,
    )  # fmt: skip
    click.echo(f"{name}={change.value} (reason: {change.reason})")
    if (
        name == "free_path_enabled"
        and change.value == "true"
        and not store.settings.free_path_enabled
    ):
        click.echo("warning: the settings here still say free_path_enabled=false: the free path "
                   "stays closed where they do (re-opening needs both)", err=True)  # fmt: skip
    replicated = _said_on_disk(store)
    _said_unused(store)
    if not replicated:
        ctx.exit(1)


@flags.command(name="unset")
@click.argument("name", type=click.Choice(FLAG_NAMES))
@click.option("--reason", default="", help="Why: written to the flag log and the log line.")
@FORCE
@click.pass_context
def flags_unset(ctx: click.Context, name: str, reason: str, force: bool) -> None:
    """Remove a flag's Redis override: the settings decide again."""
    store = _flag_store(ctx)
    why = reason or "(no reason given)"
    try:
        change = store.unset(name, why, actor(), time.time(), force=force)
    except (LedgerUnavailable, FreePathLocked) as exc:
        make_logger(store.settings, "flags").warning(
            "flag_change_refused", name=name, value=None, reason=why, refusal=str(exc)
        )
        raise click.ClickException(str(exc)) from exc
    make_logger(store.settings, "flags").info(
        "flag_changed", name=name, value=None, reason=change.reason, actor=change.actor,
        on_disk=store.persisted,
    )  # fmt: skip
    click.echo(f"{name} unset (reason: {change.reason})")
    replicated = _said_on_disk(store)
    _said_unused(store)
    if not replicated:
        ctx.exit(1)


@click.command()
@click.option("--reason", default="", help="Why: written to the flag log and the log line.")
@click.option(
    "--open", "open_path", is_flag=True,
    help="Leave the free path open: a new deployment, or an upgrade whose state is intact.",
)  # fmt: skip
@click.pass_context
def init(ctx: click.Context, reason: str, open_path: bool) -> None:
    """Initialise the gate's state in Redis, or acknowledge that it was lost.

    Until this has run on a namespace (a new deployment, one upgraded from a version without
    the state marker, or a Redis that lost its data: a restart without persistence, a flush,
    a failover to an empty replica), nothing is sent to free. It is not a re-open: it closes
    the free path (free_path_enabled=false in Redis), which opens again only with `flags set
    free_path_enabled true` after a clean hour of ledger windows recorded after it (or
    --force). With --open (you know nothing was lost) it leaves the path open. Running it
    again on an initialised namespace changes nothing.
    """
    store = _flag_store(ctx)
    why = reason or "(no reason given)"
    try:
        change = store.initialise(why, actor(), time.time(), open_path=open_path)
        since = store.stored().get(STATE_FIELD)
    except LedgerUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    if change is None:
        click.echo(f"state: initialised already ({STATE_FIELD}={since}); nothing changed")
        return
    make_logger(store.settings, "flags").warning(
        "state_initialised", namespace=store.settings.namespace, reason=why, actor=change.actor
    )
    click.echo(f"state: initialised ({STATE_FIELD}={change.value}, reason: {why})")
    replicated = _said_on_disk(store)
    if not open_path:
        click.echo("free_path_enabled=false: re-open with `gatekeeper flags set "
                   "free_path_enabled true` after a clean hour (or --force)")  # fmt: skip
    if not replicated:
        ctx.exit(1)
