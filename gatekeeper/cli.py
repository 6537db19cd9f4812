"""The ``gatekeeper`` command line: the drill, one-off decisions, and (later) operations.

Settings are read here, at the edge, from the environment, ``.env`` and the TOML file
(``--config`` or ``GATEKEEPER_CONFIG_FILE``). Exit codes: 0 success, 2 bad usage or settings.
"""

from __future__ import annotations

import getpass
import json
import math
import socket
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import click
import redis

from gatekeeper.drill import dwell_table_lines, run_ledger_drill, write_ledger
from gatekeeper.dwell import GateInputs, decide
from gatekeeper.errors import ConfigError, LedgerUnavailable
from gatekeeper.flags import FLAG_NAMES, FlagStore, FreePathLocked, combine
from gatekeeper.keys import Keys
from gatekeeper.ledger import LedgerRow, summarize, window_id
from gatekeeper.logs import make_logger
from gatekeeper.runs import RunLedger
from gatekeeper.runs import sweep as sweep_runs
from gatekeeper.settings import GatekeeperSettings, load_settings

__all__ = ["main"]

DEFAULT_LEDGER_FILE = Path(tempfile.gettempdir()) / "retry-tax-ledger.json"
"""Where ``gatekeeper drill`` writes its JSON ledger unless ``--out`` says otherwise."""


def _settings(ctx: click.Context) -> GatekeeperSettings:
    """Load settings once per invocation; a bad value is a usage error naming the variable."""
    obj = ctx.ensure_object(dict)
    if "settings" not in obj:
        try:
            obj["settings"] = load_settings(obj.get("config"))
        except ConfigError as exc:
            raise click.UsageError(str(exc), ctx=ctx) from exc
    settings: GatekeeperSettings = obj["settings"]
    return settings


def format_number(value: float) -> str:
    """Whole numbers without a decimal point (``28``), others to the millisecond (``28.5``)."""
    if not math.isfinite(value):
        return str(value)
    if float(value).is_integer():
        return str(int(value))
    return str(round(value, 3))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML settings file (default: $GATEKEEPER_CONFIG_FILE, else config/gatekeeper.toml).",
)
@click.pass_context
def main(ctx: click.Context, config: Path | None) -> None:
    """Deadline-aware admission control for Celery."""
    ctx.ensure_object(dict)["config"] = config


@main.command()
@click.option(
    "--seed", type=int, default=None, help="Seed of the ledger drill (default: [drill].seed)."
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_LEDGER_FILE,
    show_default=True,
    help="Where to write the JSON ledger.",
)
@click.pass_context
def drill(ctx: click.Context, seed: int | None, out: Path) -> None:
    """Run both local drills: the dwell-gate table, then the retry-tax ledger."""
    cfg = _settings(ctx).drill
    if seed is not None:
        cfg = cfg.model_copy(update={"seed": seed})
    for line in dwell_table_lines():
        click.echo(line)
    result = run_ledger_drill(cfg)
    for _, summary in result.summaries:
        click.echo(summary.line())
    try:
        written = write_ledger(result, out)
    except OSError as exc:
        raise click.BadParameter(f"cannot write {out}: {exc.strerror}", param_hint="--out") from exc
    click.echo(f"wrote {written}")


@main.command(name="decide")
@click.option(
    "--queue-age-s", type=float, required=True, help="Age of the free queue's oldest task."
)
@click.option("--expected-service-s", type=float, required=True, help="Declared service time.")
@click.option(
    "--retry-tax-s", type=float, default=0.0, show_default=True, help="retries_left x service."
)
@click.option("--deadline-slack-s", type=float, required=True, help="Deadline minus now.")
@click.option(
    "--max-queue-age-s", type=float, default=None, help="Queue-age cap (default: from settings)."
)
@click.pass_context
def decide_command(
    ctx: click.Context,
    queue_age_s: float,
    expected_service_s: float,
    retry_tax_s: float,
    deadline_slack_s: float,
    max_queue_age_s: float | None,
) -> None:
    """Print what the dwell gate would decide for these inputs."""
    cap = _settings(ctx).max_queue_age_s if max_queue_age_s is None else max_queue_age_s
    inputs = GateInputs(queue_age_s, expected_service_s, retry_tax_s, deadline_slack_s, cap)
    result = decide(inputs)
    line = (
        f"dwell={format_number(result.dwell_s)} slack={format_number(deadline_slack_s)} "
        f"decision={result.decision.value} reason={result.reason.value}"
    )
    if result.field is not None:
        line += f" field={result.field}"
    click.echo(line)


def _redis(ctx: click.Context) -> redis.Redis:
    settings = _settings(ctx)
    url = settings.redis_url or settings.broker_url
    if not url:
        raise click.UsageError(
            "GATEKEEPER_REDIS_URL: expected the gate's Redis URL (redis://host:port/db), got none",
            ctx=ctx,
        )
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)


def _flag_store(ctx: click.Context) -> FlagStore:
    return FlagStore(_redis(ctx), _settings(ctx))


def _actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@main.group(invoke_without_command=True)
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
    for name in FLAG_NAMES:
        setting = getattr(store.settings, name)
        click.echo(
            f"{name}: effective={_show(getattr(effective, name))} settings={_show(setting)} "
            f"redis={stored.get(name, '-')}"
        )
    for change in history:
        when = datetime.fromtimestamp(change.at, tz=timezone.utc).isoformat(timespec="seconds")
        value = "(unset)" if change.value is None else change.value
        click.echo(f"changed {when} {change.name}={value} by {change.actor}: {change.reason}")


def _show(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


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
        change = store.set(name, value, why, _actor(), time.time(), force=force)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="VALUE") from exc
    except (LedgerUnavailable, FreePathLocked) as exc:
        make_logger(store.settings, "flags").warning(
            "flag_change_refused", name=name, value=value, reason=why, refusal=str(exc)
        )
        raise click.ClickException(str(exc)) from exc
    make_logger(store.settings, "flags").info(
        "flag_changed", name=name, value=change.value, reason=change.reason, actor=change.actor
    )
    click.echo(f"{name}={change.value} (reason: {change.reason})")


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
        change = store.unset(name, why, _actor(), time.time(), force=force)
    except (LedgerUnavailable, FreePathLocked) as exc:
        make_logger(store.settings, "flags").warning(
            "flag_change_refused", name=name, value=None, reason=why, refusal=str(exc)
        )
        raise click.ClickException(str(exc)) from exc
    make_logger(store.settings, "flags").info(
        "flag_changed", name=name, value=None, reason=change.reason, actor=change.actor
    )
    click.echo(f"{name} unset (reason: {change.reason})")


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


@main.command()
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
    settings = _settings(ctx)
    ident = _window_option(window, time.time(), settings.window_seconds)
    store = RunLedger(
        _redis(ctx), Keys(settings.key_prefix, settings.namespace),
        window_seconds=settings.window_seconds,
        queue_wait_unit_per_second=settings.queue_wait_unit_per_second,
    )  # fmt: skip
    try:
        rows = store.window_rows(ident)
    except LedgerUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    summary = summarize([LedgerRow.from_json(row) for row in rows], settings.budget_units)
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


@main.command()
@click.option(
    "--older-than-s",
    type=float,
    default=None,
    help="Runs started longer ago with no row (default: stale_attempt_s).",
)
@click.pass_context
def sweep(ctx: click.Context, older_than_s: float | None) -> None:  # fmt: skip
    """Record runs whose worker vanished without any signal as killed."""
    settings = _settings(ctx)
    store = RunLedger(
        _redis(ctx), Keys(settings.key_prefix, settings.namespace),
        window_seconds=settings.window_seconds,
        queue_wait_unit_per_second=settings.queue_wait_unit_per_second,
    )  # fmt: skip
    limit = settings.stale_attempt_s if older_than_s is None else older_than_s
    try:
        rows = sweep_runs(store, round(time.time() * 1000), limit)
    except LedgerUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    log = make_logger(settings, "worker")
    for row in rows:
        log.warning(
            "ledger_row", job_id=row.job_id, attempt=row.attempt, path=row.path.value,
            outcome=row.outcome.value, reason="vanished", retry_tax=row.retry_tax,
        )  # fmt: skip
    click.echo(f"swept={len(rows)}")
