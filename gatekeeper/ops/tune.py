"""``gatekeeper tune --since 7d --<knob> VALUE``: the recorded decisions re-decided under one
changed knob, side by side with the decisions as they were (SPEC section 7).

Prints, in this order::

    tune since=7d from=<ISO> records=INT misses=INT knob=NAME value=V recorded=V[,V...]
    decision                        as_was  would_be  change      (one row per decision/reason)
    kind admit_free ...                                         (the same, by kind)
    changed=INT undecidable=INT superseded=INT
    change job_id=ID attempt=INT task=NAME as_was=D/R would_be=D/R   (the first --show)
    review free_missed as_was=R would_be=R slack_misses=A/B free_admissions=A/B unknown_outcome=N
    review defer_savable ...  /  review reserved_age_shift ...

With no knob it re-decides the records as they were, and must find ``changed=0``. A record
the knob would send past an input that was never read (a decision made before the gate
script, which read no queue age) is ``undecidable`` and counted in no ``would_be`` row; a
replay of a deferred attempt that the knob would have admitted or reserved at an earlier
scoring is ``superseded`` (counted once, where the knob decides it). Each decision is
re-decided against the window state it saw (:mod:`gatekeeper.core.whatif`).

Registered on the ``gatekeeper`` group by :mod:`gatekeeper.ops.cli`.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone

import click

from gatekeeper.core.review import Review
from gatekeeper.core.whatif import Comparison, DecisionRecord, Knob, Tally
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.ops.context import duration_s, format_number, settings_of
from gatekeeper.ops.oncall import redis_client
from gatekeeper.redis.decisions import entries, stream_state
from gatekeeper.redis.keys import Keys

__all__ = ["tune", "tune_lines"]


def _iso(ms: float) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="minutes")


def _non_negative(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise click.BadParameter(f"expected a finite number >= 0, got {value}")
    return value


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _table(was: dict[str, int], now: dict[str, int], width: int) -> list[str]:
    lines = []
    for name in sorted(set(was) | set(now)):
        before, after = was.get(name, 0), now.get(name, 0)
        lines.append(f"{name:<{width}} {before:>8} {after:>9} {after - before:>+7}")
    return lines


def _review_lines(was: Review, now: Review, unknown: int) -> list[str]:
    return [
        f"review free_missed as_was={_ratio(was.free_missed)} "
        f"would_be={_ratio(now.free_missed)} slack_misses={was.slack_misses}/{now.slack_misses} "
        f"free_admissions={was.free_admissions}/{now.free_admissions} unknown_outcome={unknown}",
        f"review defer_savable as_was={_ratio(was.defer_savable)} "
        f"would_be={_ratio(now.defer_savable)} "
        f"defers_dwell_fit={was.defers_savable}/{now.defers_savable} "
        f"defers={was.defers}/{now.defers}",
        f"review reserved_age_shift as_was={_ratio(was.reserved_age_shift)} "
        f"would_be={_ratio(now.reserved_age_shift)} "
        f"reserved_dwell_fit_without_age={was.reserved_age_shifts}/{now.reserved_age_shifts} "
        f"reserved={was.reserved}/{now.reserved}",
    ]


def tune_lines(result: Comparison, show: int) -> list[str]:
    """Everything after the ``tune`` line: the two columns, the changes, the review."""
    width = max([len(n) for n in (*result.as_was, *result.would_be)] + [len("decision")]) + 1
    lines = [f"{'decision':<{width}} {'as_was':>8} {'would_be':>9} {'change':>7}"]
    lines += _table(result.as_was, result.would_be, width)
    was, now = result.review_was.by_kind, result.review_now.by_kind
    lines += ["kind " + line for line in _table(was, now, width - 5)]
    lines.append(f"changed={result.changed} undecidable={result.undecidable} "
                 f"superseded={result.superseded}")  # fmt: skip
    for change in result.changes[:show]:
        record = change.record
        lines.append(f"change job_id={record.job_id} attempt={record.attempt} task={record.task} "
                     f"as_was={change.was} would_be={change.now or 'undecidable'}")  # fmt: skip
    hidden = result.changed + result.undecidable - min(show, len(result.changes))
    if hidden > 0:
        lines.append(f"changes_not_shown={hidden} (--show N lists more)")
    lines += _review_lines(result.review_was, result.review_now, result.unknown_outcomes)
    return lines


def _knob(
    max_queue_age_s: float | None,
    budget_units: float | None,
    queue_wait_unit_per_second: float | None,
    service_time: str | None,
) -> Knob | None:
    given = [Knob(name, value) for name, value in (
        ("max_queue_age_s", max_queue_age_s), ("budget_units", budget_units),
        ("queue_wait_unit_per_second", queue_wait_unit_per_second),
        ("service_time", service_time),
    ) if value is not None]  # fmt: skip
    if len(given) > 1:
        names = ", ".join("--" + k.name.replace("_", "-") for k in given)
        raise click.UsageError(f"one knob at a time (got {names}): the review changes one cap "
                               "and compares")  # fmt: skip
    return given[0] if given else None


def _recorded(values: set[float | str], knob: Knob | None) -> str:
    if knob is None or knob.name == "service_time":
        return "as_decided"
    return ",".join(format_number(float(v)) for v in sorted(values, key=float)) or "none"


@click.command()
@click.option("--since", default="7d", show_default=True, help="How far back: 7d, 24h, 90m.")
@click.option("--max-queue-age-s", type=float, callback=_non_negative, help="The age cap.")
@click.option("--budget-units", type=float, callback=_non_negative, help="The window's budget.")
@click.option("--queue-wait-unit-per-second", type=float, callback=_non_negative,
              help="The wait's price in units per second.")  # fmt: skip
@click.option("--service-time", type=click.Choice(["declared", "learned", "max"],
              case_sensitive=False), help="Which service time decisions use.")  # fmt: skip
@click.option("--show", default=20, show_default=True, type=click.IntRange(min=0),
              help="How many changed decisions to list.")  # fmt: skip
@click.pass_context
def tune(
    ctx: click.Context,
    since: str,
    max_queue_age_s: float | None,
    budget_units: float | None,
    queue_wait_unit_per_second: float | None,
    service_time: str | None,
    show: int,
) -> None:
    """Re-decide the recorded decisions under one changed knob, side by side with as they were."""
    settings = settings_of(ctx)
    knob = _knob(max_queue_age_s, budget_units, queue_wait_unit_per_second,
                 service_time.lower() if service_time else None)  # fmt: skip
    start_ms = max(0.0, (time.time() - duration_s(since)) * 1000)
    keys = Keys(settings.key_prefix, settings.namespace)
    tally = Tally(knob, settings.service_time_min_samples, show)
    misses: list[tuple[str, int, int]] = []
    unreadable = 0
    values: set[float | str] = set()  # the knob's values as recorded
    try:
        client = redis_client(ctx)
        length, first_ms, refused = stream_state(client, keys)
        for entry in entries(client, keys, int(start_ms)):
            if isinstance(entry, DecisionRecord):
                tally.add(entry)
                value = getattr(entry, knob.name, None) if knob is not None else None
                if isinstance(value, float) and math.isfinite(value):  # not a bad input's
                    values.add(value)
            elif entry is None:
                unreadable += 1
            else:
                misses.append(entry)
    except LedgerUnavailable as exc:
        raise click.ClickException(str(exc)) from exc
    result = tally.result(misses)
    shown, value = "none", ""
    if knob is not None:
        text = knob.value if isinstance(knob.value, str) else format_number(knob.value)
        shown, value = knob.name, f" value={text}"
    click.echo(f"tune since={since} from={_iso(start_ms)} records={result.records} "
               f"misses={len(misses)} knob={shown}{value} "
               f"recorded={_recorded(values, knob)}")  # fmt: skip
    if settings.decision_record_cap == 0:
        click.echo("note: decision_record_cap is 0: no decisions are being recorded", err=True)
    cap = settings.decision_record_cap
    if first_ms is not None and first_ms > start_ms + 60_000:
        why = (
            f"older ones were trimmed at decision_record_cap={cap}"
            if cap and length >= 0.9 * cap
            else "none were recorded before"
        )
        click.echo(f"note: the record begins at {_iso(first_ms)}, after --since: {why}",
                   err=True)  # fmt: skip
    if refused:
        click.echo(f"note: {refused} decisions could not be recorded (the server refused the "
                   "XADD: an ACL without +xadd, or the key is not a stream)", err=True)  # fmt: skip
    if unreadable:
        click.echo(f"note: {unreadable} entries are not records of this version "
                   "and were left out", err=True)  # fmt: skip
    for line in tune_lines(result, show):
        click.echo(line)
