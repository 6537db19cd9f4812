"""What the worker side reads of a message: whether it claims to be gated (or is forged on
its face: an attempt the gate never writes), its nonce, and what the worker adds to the gate's
record itself.

Nothing read here is trusted for pricing: a message is the gate's only when its nonce is the
one in the gate's record (``start.lua`` checks). :func:`unverified` builds the row of a
message with no nonce at all (an old publisher, or a decision made without Redis) from its
headers, for a row that is marked unverified and charges nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from gatekeeper.celery.gating import spec_of
from gatekeeper.celery.heartbeat import worker_name
from gatekeeper.core.headers import (
    ATTEMPTS,
    H_ATTEMPT,
    H_ATTEMPT_PUBLISHED_AT,
    H_DEADLINE_AT,
    H_DECISION,
    H_DWELL_S,
    H_NONCE,
    H_PUBLISHED_AT,
    H_REPLAYS,
    H_TOKENS_IN,
    H_TOKENS_OUT,
)
from gatekeeper.core.ledger import Path
from gatekeeper.errors import GatekeeperError
from gatekeeper.redis.runs import RunRecord

__all__ = [
    "attempt_of",
    "claims",
    "forged_attempt",
    "nonce_of",
    "own_fields",
    "replays_of",
    "request_headers",
    "unverified",
]

READ = (H_ATTEMPT, H_DECISION, H_NONCE, H_ATTEMPT_PUBLISHED_AT, H_PUBLISHED_AT, H_DEADLINE_AT,
        H_TOKENS_IN, H_TOKENS_OUT, H_DWELL_S, "retries")  # fmt: skip
"""The headers the worker side reads (from the request context, or the received message)."""


def claims(headers: Mapping[str, Any]) -> bool:
    """Whether a message claims to be one the gate routed: a decision, and an attempt that
    is a whole number of a few digits (the gate writes one; anything else is a caller's, and
    ``int()`` of it, thousands of digits included, would raise in a signal handler), or no
    attempt at all: a publish the gate failed closed (``gate_error``) carries its decision
    alone, and its run is owed an unverified row as much as any decision made without
    Redis (with no nonce, ``start.lua`` answers ``unverified``)."""
    if headers.get(H_DECISION) is None:
        return False
    attempt = headers.get(H_ATTEMPT)
    if attempt is None:  # its attempt is then its retries plus one: bounded as an attempt is
        retries = headers.get("retries")
        return retries is None or _the_gates(retries, least=0)
    return _the_gates(attempt)


def attempt_of(headers: Mapping[str, Any]) -> int:
    """The attempt of a message that :func:`claims`: its header, else (a publish the gate
    failed closed) its retries plus one, as the gate counts attempts."""
    attempt = headers.get(H_ATTEMPT)
    if attempt is None:
        return _whole(headers.get("retries")) + 1
    return int(attempt)


def forged_attempt(headers: Mapping[str, Any]) -> bool:
    """Whether a message claims the gate's decision with an attempt the gate never writes
    (present, but not a whole number of a few digits): forged, whatever its nonce. A decision
    with no attempt at all is not: a publish the gate failed closed carries its decision alone."""
    attempt = headers.get(H_ATTEMPT)
    decided = headers.get(H_DECISION) is not None
    return decided and attempt is not None and not _the_gates(attempt)


def _the_gates(value: Any, least: int = 1) -> bool:
    """An attempt as the gate writes one (``least`` 1: from 1, below :data:`ATTEMPTS`), or
    the retries it counts one from (``least`` 0: one less), as an ``int`` or as text. The
    gate never writes attempt 0 (it refuses ``retries`` of -1: ``bad_input``)."""
    if isinstance(value, str) and value.isdecimal() and len(value) < 10:
        value = int(value)
    return type(value) is int and least <= value < ATTEMPTS - 1 + least


def nonce_of(headers: Mapping[str, Any]) -> str:
    """The message's nonce, '' when it has none (or one that is not text)."""
    nonce = headers.get(H_NONCE)
    return nonce if isinstance(nonce, str) else ""


def replays_of(headers: Mapping[str, Any]) -> int:
    """How many times the replayer scored the message again: a plain ``int`` below
    :data:`ATTEMPTS` as it writes one; any other (not its own) counts 0."""
    replays = headers.get(H_REPLAYS)
    return replays if type(replays) is int and 0 <= replays < ATTEMPTS else 0


def request_headers(request: Any) -> dict[str, Any]:
    """Gatekeeper's headers (and ``retries``) from a task's request context."""
    found = {name: getattr(request, name, None) for name in READ}
    return {name: value for name, value in found.items() if value is not None}


def _whole(value: Any) -> int:
    """A token count from a header; a bad one counts 0."""
    try:
        number = int(value or 0)
    except (TypeError, ValueError):
        return 0
    return max(number, 0)


def _declared_out(task: Any) -> int:
    try:
        spec = spec_of(task)
    except GatekeeperError:
        spec = None
    return spec.tokens_out if spec is not None else 0


def own_fields(task: Any, headers: Mapping[str, Any]) -> dict[str, str]:
    """What the worker knows of a run itself, added to the gate's record when it starts."""
    limit = getattr(task, "time_limit", None) or getattr(
        getattr(getattr(task, "app", None), "conf", None), "task_time_limit", None
    )
    max_retries = getattr(task, "max_retries", None)
    return {
        "task": getattr(task, "name", "") or "",
        "retries": str(_whole(headers.get("retries"))),
        "max_retries": str(-1 if max_retries is None else int(max_retries)),
        "time_limit_s": str(float(limit or 0)),
        "tokens_out": str(_declared_out(task)),
        "worker": worker_name(str(getattr(getattr(task, "request", None), "hostname", None) or "")),
    }


def _seconds(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if math.isfinite(number) else 0.0


def with_dwell(record: RunRecord, headers: Mapping[str, Any]) -> RunRecord:
    """A verified run's record with the dwell it was decided with: a record cut after an
    earlier run's row keeps none (gatekeeper/redis/kept.py), so a late rerun's slack-miss
    alert takes it from the message, the gate's own (its nonce is the record's), as the
    replayer's abandonment alert does."""
    if not math.isnan(record.dwell_s):
        return record
    try:
        dwell = float(headers.get(H_DWELL_S))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return record
    return dataclasses.replace(record, dwell_s=dwell) if math.isfinite(dwell) else record


def unverified(task: Any, headers: Mapping[str, Any], started_ms: int) -> RunRecord:
    """A run record from a message's own headers, for its unverified (unpriced) row, of a
    run that started at ``started_ms``. A message that says nothing of its publish (a publish
    the gate failed closed) is taken as published then: its row's wait is 0, not the time
    since 1970."""
    published = _seconds(headers.get(H_ATTEMPT_PUBLISHED_AT) or headers.get(H_PUBLISHED_AT))
    published = published or started_ms / 1000
    decision = str(headers.get(H_DECISION))
    return RunRecord(
        task=getattr(task, "name", "") or "",
        path=(Path.FREE if decision == "admit_free" else Path.RESERVED).value,
        decision=decision,
        published_ms=round(published * 1000),
        admitted_ms=round(published * 1000),
        window=0,
        deadline_ms=round(_seconds(headers.get(H_DEADLINE_AT)) * 1000),
        tokens_in=_whole(headers.get(H_TOKENS_IN)),
        tokens_out=_whole(headers.get(H_TOKENS_OUT, _declared_out(task))),
        dwell_s=math.nan,
        retries=_whole(headers.get("retries")),
        started_ms=started_ms,
    )
