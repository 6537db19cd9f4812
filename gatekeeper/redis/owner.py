"""Which free admission a slack miss belongs to, and the window that counts it.

SPEC: a free-admitted job that finishes or is abandoned after its deadline is a slack miss.
An attempt of it that was not itself admitted to free (a retry the gate sent to reserved, a
deferred attempt the replayer abandons, one requeued from the dead letter) belongs to the
job's latest free admission before it, as ``gatekeeper tune`` attributes a miss
(:meth:`gatekeeper.core.whatif.Tally.result`). Each admission counts one miss at most:
``finish.lua`` and ``abandon.lua`` mark its record (``missed`` = the member that counted it)
as they count, so another end of the same job counts none (an attempt ended ``ok`` while
the retry it published with ``retry(throw=False)`` ran on; the abandoned attempt requeued and
ended late again). The miss is counted in the admission's window, the cohort the freeze rule
divides by (``slack_misses`` over ``admitted_free``).

Found here, before the script, only for a run that would be a miss (few) of an attempt not
admitted itself (an admitted one owns its miss): the records of the attempt and the ones
before it, newest first, in one round trip. An attempt was admitted
when its record says ``admit_free``, or ``free_wait_expired`` (admitted, then moved to
reserved: ``expire.lua`` keeps its window as ``free_window``). A record that does not carry
``free_admitted`` ends the search: no admission before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from gatekeeper.errors import LedgerUnavailable
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import text_of

__all__ = ["LOOK_BACK", "Owner", "owner_of"]

LOOK_BACK = 32
"""Attempts read back at most (the attempt itself included)."""

_FIELDS = ("decision", "reason", "window", "kept", "free_admitted", "free_window")


@dataclass(frozen=True)
class Owner:
    """The admitting attempt's record key, and its window (None: not known)."""

    record: str
    window: int | None


def owner_of(client: redis.Redis, keys: Keys, job_id: str, attempt: int) -> Owner:
    """The free admission a miss of ``job_id``'s ``attempt`` belongs to; the attempt's own
    record, its window unknown, when none is found (records expired or lost)."""
    attempts = range(attempt, max(0, attempt - LOOK_BACK), -1)
    pipe = client.pipeline(transaction=False)
    for number in attempts:
        pipe.hmget(keys.run(job_id, number), *_FIELDS)
    try:
        found = pipe.execute()
    except redis.RedisError as exc:  # the row is kept and sent again (pending.py)
        raise LedgerUnavailable(f"cannot read the records of {job_id}: {exc}") from exc
    for number, values in zip(attempts, found, strict=True):
        decision, reason, window, kept, free, free_window = (_text(v) for v in values)
        if reason == "free_wait_expired":  # (its `kept`, if any, is an earlier life's)
            return Owner(keys.run(job_id, number), _window(free_window))
        if decision == "admit_free":  # (its `free_window`, if any, is an earlier life's)
            return Owner(keys.run(job_id, number), _window(window, _kept_window(kept)))
        if free != "1":
            break
    return Owner(keys.run(job_id, attempt), None)


def _text(value: Any) -> str:
    return "" if value is None else text_of(value)


def _kept_window(kept: str) -> str:
    """The window as the record's cut kept it: ``kept``'s fourth part."""
    return kept.split("|")[3] if kept.count("|") >= 3 else ""


def _window(*texts: str) -> int | None:
    """The first that is a window id: the record's own, or as its cut or an expiry kept it.
    A new life of the attempt writes ``window`` and ``kept`` anew (gate.lua, finish.lua), and
    an expiry ``free_window``: which one is this life's, the record's reason says."""
    for text in texts:
        if text.isdigit():
            return int(text)
    return None
