"""Addressing a decided publish: the queue it goes to, and the headers it carries there.

To make the message really land in the chosen queue whatever the caller or a router chose,
it is addressed to the queue by name on the default exchange: ``exchange`` and
``routing_key`` are cleared so that an explicit ``queue=``, a route, or a retry's previous
``delivery_info`` cannot send it elsewhere. The headers it carries are the decision's: what
the caller (or the message a retry copies) set in their place, or in the replayer's, is not
forwarded.
"""

from __future__ import annotations

from typing import Any

from gatekeeper.celery.deadletter import H_REPLAY_ERRORS
from gatekeeper.core.dwell import Decision
from gatekeeper.core.headers import (
    CLAIMS,
    H_ATTEMPT,
    H_COPY,
    H_REPLAY_AFTER,
    H_REPLAYS,
    earlier_claims,
)
from gatekeeper.redis.gate import Routing

__all__ = ["REPLAYERS", "address"]

REPLAYERS = (H_REPLAY_AFTER, H_REPLAYS, H_COPY, H_REPLAY_ERRORS)
"""Headers only the replayer (a requeue, the expiry) writes, on a message it hands on: a
routed publish carries none. A caller's, or a retry's copied from a replayed message, would
hold the task in defer past its deadline, fail its replays, or pass it off as a copy."""


def address(
    message: Any, options: dict[str, Any], routing: Routing, attempt: int | None = None
) -> None:
    """Point the publish at the chosen queue; bad inputs are not forwarded; :data:`CLAIMS`
    go only as this decision wrote them (a retry copies its message's, a caller may set
    any), :data:`REPLAYERS` not at all; a retry on its own route goes without its earlier
    claims."""
    if routing.queue is None:  # untouched: its normal route (mostly: nothing to look at)
        given = (options.get("headers") or {}).get(H_ATTEMPT, message.headers.get(H_ATTEMPT))
        drop: tuple[str, ...] = earlier_claims(given, attempt)
        if not drop:
            return
    else:
        options.update(queue=routing.queue, exchange=None, routing_key=None)
        options.pop("exchange_type", None)
        if routing.decision is Decision.DEFER:
            # Celery turns ``expires`` into the message's TTL too; in defer (no dead-letter
            # exchange of its own) that would drop the task unseen. The worker enforces
            # the ``expires`` header and stores the task's state.
            options.pop("expiration", None)
        drop = (*routing.drop, *REPLAYERS,
                *(name for name in CLAIMS if name not in routing.headers))  # fmt: skip
    headers = {**(options.get("headers") or {}), **routing.headers}
    for name in drop:
        headers.pop(name, None)
        message.headers.pop(name, None)
    options["headers"] = headers
