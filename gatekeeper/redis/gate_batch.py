"""Decisions for a batch of publishes, with the gate script's calls made in one round trip.

The replayer scores a batch of deferred messages at once. Each publish takes
:class:`~gatekeeper.redis.gate.Pipeline`'s own steps (``unscripted``: the flags, the inputs,
the decisions made in process; ``gate_call``: the script's request; ``scored`` or
``unscored``: its routing and its one log line), so a batch decides exactly what as many
:meth:`~gatekeeper.redis.gate.Pipeline.route` calls would; only the scripts of those that
reach step 4 go together, in one round trip
(:meth:`~gatekeeper.redis.store.GateStore.score_all`). Redis runs them one after the other,
in the batch's order, each atomic as on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gatekeeper.errors import GatekeeperError, LedgerUnavailable
from gatekeeper.redis.attempt import Attempt, Publish
from gatekeeper.redis.gate import Pipeline, Routing

__all__ = ["route_all"]


def route_all(
    pipeline: Pipeline, publishes: Sequence[Publish], alive: Callable[[], bool] = lambda: True
) -> list[Routing | Exception]:
    """The routing of each publish, in order, or the exception its decision raised (one bad
    publish does not stop the others). ``alive`` (the replayer's lock) is asked before each
    publish's steps in process and before the scripts are sent: once it is false nothing more
    is decided or written, and each publish's answer is that error."""
    routed: list[Routing | Attempt | Exception] = []
    for publish in publishes:
        if not alive():
            return [GatekeeperError("the replayer's lock was lost")] * len(publishes)
        try:
            routed.append(pipeline.unscripted(publish))
        except Exception as exc:
            routed.append(exc)
    attempts = [step for step in routed if isinstance(step, Attempt)]
    if not alive():
        return [GatekeeperError("the replayer's lock was lost")] * len(publishes)
    answers = iter(pipeline.store.score_all([pipeline.gate_call(a) for a in attempts]))
    routings: list[Routing | Exception] = []
    for step in routed:
        if not isinstance(step, Attempt):
            routings.append(step)
            continue
        answer = next(answers)
        try:
            if isinstance(answer, LedgerUnavailable):
                routings.append(pipeline.unscored(step, answer, None))
            else:
                routings.append(pipeline.scored(step, answer))
        except Exception as exc:
            routings.append(exc)
    return routings
