"""``gatekeeper report``: the review's three ratios over a fixed window, decisions by kind and
reason, and with ``--html`` the same as one self-contained page of charts
(:mod:`gatekeeper.ops.review_page`).

Registered on the ``gatekeeper`` group by :mod:`gatekeeper.ops.cli`.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import click

from gatekeeper.core.ledger import window_id
from gatekeeper.core.review import summarize_review
from gatekeeper.defaults import WINDOW_RETENTION_S
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.ops.context import duration_s
from gatekeeper.ops.oncall import as_deployed, redis_client
from gatekeeper.ops.review_page import review_page
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import read_windows

__all__ = ["report"]


@click.command()
@click.option(
    "--since", "since", default="7d", show_default=True, help="How far back: 7d, 24h, 90m, 900s."
)
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the review as one self-contained HTML page of charts (opens offline).",
)
@click.pass_context
def report(ctx: click.Context, since: str, html_path: Path | None) -> None:  # fmt: skip
    """The review's three ratios over a fixed window, and decisions by kind and reason."""
    seconds = duration_s(since)
    client = redis_client(ctx)
    settings = as_deployed(ctx, client)
    now = time.time()
    kept = min(seconds, WINDOW_RETENTION_S)  # older windows are gone: never read them (a
    first, last = (  # --since of centuries would pipeline a read per window)
        window_id(now - kept, settings.window_seconds),
        window_id(now, settings.window_seconds),
    )
    keys = Keys(settings.key_prefix, settings.namespace)
    try:
        windows = read_windows(client, keys, range(first, last + 1))
    except LedgerUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    try:  # the windows' figures, for the lines and the page
        review = summarize_review(windows)
        page = (
            review_page(windows, first, settings, since=since, generated_at=now)
            if html_path is not None
            else ""
        )
    except (ValueError, OverflowError) as exc:
        raise click.ClickException(
            f"a window holds a field that is not a number ({exc}): "
            "written by something other than gatekeeper?"
        ) from exc
    if seconds > WINDOW_RETENTION_S:
        click.echo(
            f"note: windows are kept {WINDOW_RETENTION_S // 86400} days; older ones "
            "are gone: the review starts where they are kept",
            err=True,
        )
    start = datetime.fromtimestamp(first * settings.window_seconds, tz=timezone.utc)
    click.echo(
        f"since={since} from={start.isoformat(timespec='minutes')} windows={len(windows)} "
        f"window_seconds={settings.window_seconds}"
    )
    for line in review.lines():
        click.echo(line)
    if html_path is not None:
        try:
            html_path.parent.mkdir(parents=True, exist_ok=True)
            html_path.write_text(page, encoding="utf-8")
        except OSError as exc:
            raise click.BadParameter(f"cannot write {html_path}: {exc.strerror}",
                                     param_hint="--html") from exc  # fmt: skip
        click.echo(f"wrote {html_path}")
