"""The decision records in Redis (the ``decisions`` stream): what the publish path adds to
them, and how ``gatekeeper tune`` reads them back.

``gate.lua`` writes a record with every decision it makes, in the same step (no round trip of
its own); ``record.lua`` does for a decision made in process, from :func:`in_process_inputs`.
Slack misses are written beside them by ``finish.lua`` and ``abandon.lua`` (a ``miss`` entry).
:func:`read_records` reads them back in pages. :mod:`gatekeeper.core.whatif` defines the fields
and re-decides them; docs/decision-records.md gives their size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from gatekeeper.core.whatif import DecisionRecord
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.attempt import Attempt
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.numbers import exact
from gatekeeper.redis.scripts import text_of
from gatekeeper.settings import GatekeeperSettings

__all__ = ["Entry", "Recorded", "entries", "in_process_inputs", "read_records", "stream_state"]

PAGE = 10_000
"""Entries read per ``XRANGE``."""


def in_process_inputs(attempt: Attempt, settings: GatekeeperSettings) -> dict[str, str]:
    """The record of a decision made before the gate script: the queue's age, the window's
    tax and exposure were not read (empty)."""
    return {
        "s": exact(attempt.service_s), "x": exact(attempt.tax_s), "l": exact(attempt.slack_s),
        "y": exact(attempt.delay_s), "n": str(attempt.inputs.tokens_in),
        "c": exact(settings.max_queue_age_s), "b": exact(settings.budget_units),
        "u": exact(settings.queue_wait_unit_per_second), "m": settings.budget_mode.value,
        "p": attempt.publisher,
    }  # fmt: skip


@dataclass
class Recorded:
    """What the stream holds from a moment on."""

    records: list[DecisionRecord] = field(default_factory=list)
    misses: list[tuple[str, int, int]] = field(default_factory=list)
    """Slack misses: (job id, attempt, when in ms)."""
    unreadable: int = 0
    """Entries that are neither a record nor a miss (written by another version)."""
    first_ms: int | None = None
    """The oldest entry the stream still holds (older ones were trimmed), None when empty."""
    length: int = 0
    """Entries the stream holds (``XLEN``): near the cap, the oldest are being trimmed."""


Entry = DecisionRecord | tuple[str, int, int] | None
"""A record, a slack miss ``(job_id, attempt, at_ms)``, or None for an entry that is neither
(written by another version)."""


def read_records(client: redis.Redis, keys: Keys, since_ms: int) -> Recorded:
    """Every record and miss from ``since_ms`` (Unix ms) on, oldest first, held in memory
    (``gatekeeper tune`` reads them one at a time with :func:`entries`)."""
    out = Recorded()
    out.length, out.first_ms, _ = stream_state(client, keys)
    for entry in entries(client, keys, since_ms):
        if entry is None:
            out.unreadable += 1
        elif isinstance(entry, DecisionRecord):
            out.records.append(entry)
        else:
            out.misses.append(entry)
    return out


def stream_state(client: redis.Redis, keys: Keys) -> tuple[int, int | None, int]:
    """How many entries the stream holds, when its oldest was written (None: empty), and how
    many records the server refused over the deployment's life (``records_refused``)."""
    try:
        length = int(client.xlen(keys.decisions))
        oldest = client.xrange(keys.decisions, "-", "+", count=1)
        refused = int(client.hget(keys.totals, "records_refused") or 0)
    except (redis.RedisError, RedisClusterException) as exc:
        raise LedgerUnavailable(f"cannot read the decision records: {exc}") from exc
    return length, _ms(oldest[0][0]) if oldest else None, refused


def entries(client: redis.Redis, keys: Keys, since_ms: int) -> Iterator[Entry]:
    """The stream's entries from ``since_ms`` on, oldest first, read a page at a time."""
    try:
        for ident, fields in _pages(client, keys.decisions, since_ms):
            at = _ms(ident)
            text = {text_of(k): text_of(v) for k, v in fields.items()}
            if "miss" in text:
                job_id, _, attempt = text["miss"].rpartition(":")
                yield (job_id, int(attempt), at) if attempt.isdigit() else None
                continue
            try:
                yield DecisionRecord.from_fields(text, at)
            except (KeyError, ValueError):
                yield None
    except (redis.RedisError, RedisClusterException) as exc:
        raise LedgerUnavailable(f"cannot read the decision records: {exc}") from exc


def _pages(client: redis.Redis, key: str, since_ms: int) -> Iterator[tuple[Any, Any]]:
    start: str = str(max(since_ms, 0))
    while True:
        page: list[tuple[Any, Any]] = client.xrange(key, start, "+", count=PAGE) or []
        yield from page
        if len(page) < PAGE:
            return
        ms, _, seq = text_of(page[-1][0]).partition("-")  # the next id (no "(" before 6.2)
        start = f"{ms}-{int(seq) + 1}"


def _ms(ident: Any) -> int:
    return int(text_of(ident).split("-")[0])
