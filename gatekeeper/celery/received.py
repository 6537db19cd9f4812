"""The worker's main process: which received message a failure or revocation was about.

Those signals fire in the main process naming only a task id (``sender.request`` is empty
on Celery 5.5 and 5.6), and two messages can carry one id: a caller's copy of a gated job's
id must never be taken for the gate's message. Every request of the app is kept here with
its headers, gated or not; Celery stops holding a request just before it sends its end
signal (:func:`gatekeeper.celery.private.outstanding`), so the one that ended is among those
it no longer holds.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import suppress
from typing import Any

from gatekeeper.celery.heartbeat import worker_name
from gatekeeper.celery.message import attempt_of, claims, nonce_of
from gatekeeper.celery.private import outstanding

__all__ = ["NOWHERE", "RECEIVED_CACHE_SIZE", "RanIn", "Received"]

RanIn = tuple[int, str]
"""Where a request ran: its pool child's pid (Celery's ``worker_pid``) and the worker's name."""
NOWHERE: RanIn = (0, "")

RECEIVED_CACHE_SIZE = 10_000
"""Task ids kept at most (past it, the oldest of which the worker holds no request goes
first: :meth:`Received._forget_one`)."""
PRUNE_EVERY = 100
"""Ended requests are forgotten every this many arrivals (a pass over what is kept)."""
FORGET_SCAN = 8
"""Ids looked at, at most, for one the worker no longer holds when the cache is full (a few:
each arrival pays for them while every id kept is held)."""


class Received:
    """Per task id, the requests received and their headers, while the worker holds them."""

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, list[tuple[Any, dict[str, Any]]]] = OrderedDict()
        self._arrivals = 0

    def add(self, request: Any, headers: dict[str, Any]) -> None:
        self._arrivals += 1
        if self._arrivals % PRUNE_EVERY == 0:
            self._prune()
        held = self._by_id.setdefault(request.id, [])
        # A retry's request: the run before it ended (in its pool child): forget that one. (A
        # changed Celery: keep them; the cache is bounded anyway.)
        if held:  # (most ids arrive once: nothing to look at)
            with suppress(Exception):
                held[:] = [entry for entry in held if not _ran_out(entry[0])]
        held.append((request, headers))
        while len(self._by_id) > RECEIVED_CACHE_SIZE:
            self._forget_one()

    def ended(self, job_id: str, runs: Any = None) -> tuple[dict[str, Any] | None, RanIn]:
        """The gatekeeper headers of the request with this id that just ended (a request
        waiting to run is none); ``{}`` when none of ours claims any. When the ended ones
        disagree (two messages with one id, both ended since the last prune: a
        ``Task.replace`` replacement came while the run it replaced was going), the one
        :func:`_recorded` tells through ``runs`` (a ``RunLedger``); else None: nothing may be
        attributed then. And where it ran, when one request is told (:data:`NOWHERE`:
        unknown)."""
        held = self._by_id.get(job_id)
        if not held:
            return {}, NOWHERE
        try:
            ended = [entry for entry in held if not outstanding(entry[0]) and not
                     _waiting(entry[0])]  # fmt: skip
        except Exception:  # a changed Celery: only a lone request can be told
            ended = held if len(held) == 1 else []
        left = [entry for entry in held if entry not in ended]
        if left:
            self._by_id[job_id] = left
        else:
            del self._by_id[job_id]
        headers = [h for _, h in ended]
        ran_in = _ran_in(ended[0][0]) if len(ended) == 1 else NOWHERE
        if not any(claims(h) for h in headers):
            return {}, ran_in
        if len({nonce_of(h) for h in headers}) != 1 or not all(claims(h) for h in headers):
            return _recorded(job_id, ended, runs)
        return headers[0], ran_in

    def _forget_one(self) -> None:
        """Make room: forget the oldest id of which the worker holds no request (one that
        never started and was let go, as a broker reconnect drops them), so that a live
        request's end still finds its headers. Ids found held go to the newest end, so that
        the next look starts past them; when the :data:`FORGET_SCAN` ids looked at are all
        held (or with a changed Celery), the id then first in line is forgotten, held or not.

        A request that waits unheld (on a rate limit; on its ETA under Celery 5.5) looks like
        one let go, and is forgotten before held ones too."""
        with suppress(Exception):
            for _ in range(min(FORGET_SCAN, len(self._by_id))):
                job_id, held = next(iter(self._by_id.items()))
                if not any(outstanding(request) for request, _ in held):
                    del self._by_id[job_id]
                    return
                self._by_id.move_to_end(job_id)
        self._by_id.popitem(last=False)

    def _prune(self) -> None:
        """Forget the requests the worker no longer holds."""
        try:
            gone = [job_id for job_id, held in self._by_id.items()
                    if all(_ran_out(request) for request, _ in held)]  # fmt: skip
        except Exception:  # a changed Celery: keep them; the cache is bounded anyway
            return
        for job_id in gone:
            del self._by_id[job_id]


def _recorded(
    job_id: str, ended: list[tuple[Any, dict[str, Any]]], runs: Any
) -> tuple[dict[str, Any] | None, RanIn]:
    """Of ended requests that disagree, the one that ran (a request that never started, a
    message moved to reserved or one waiting outside Celery's sets, is no run that ended)
    whose nonce is its attempt's record's now (the gate's record is the truth: a caller's
    copy with another nonce is never taken for it); of several such (a retry's, come before
    the run it retries was let go), the one whose run is still owed its row. None when not
    exactly one is, or the records cannot be read."""
    if runs is None:
        return None, NOWHERE
    mine: list[tuple[Any, dict[str, Any], bool]] = []
    try:
        for request, headers in ended:
            if getattr(request, "time_start", None) is None or not nonce_of(headers):
                continue
            fields = runs.fields(job_id, attempt_of(headers)) if claims(headers) else {}
            if fields.get("nonce") == nonce_of(headers):
                owed = int(fields.get("runs") or 0) > int(fields.get("rowed") or 0)
                mine.append((request, headers, owed))
    except Exception:  # (LedgerUnavailable: Redis silent) nothing attributed, as before
        return None, NOWHERE
    if len(mine) > 1:
        mine = [entry for entry in mine if entry[2]]
    if len(mine) != 1:
        return None, NOWHERE
    return mine[0][1], _ran_in(mine[0][0])


def _ran_in(request: Any) -> RanIn:
    pid, hostname = getattr(request, "worker_pid", None), getattr(request, "hostname", None)
    return (
        pid if isinstance(pid, int) else 0,
        worker_name(hostname) if isinstance(hostname, str) else "",
    )


def _waiting(request: Any) -> bool:
    """Never started and not revoked (nor moved by the request check, which marks it so): a
    request waiting on a rate limit or an ETA, held in no set of Celery's, whose run is still
    to come. Another request's end never forgets it."""
    return getattr(request, "time_start", None) is None and not getattr(
        request, "_already_revoked", False
    )


def _ran_out(request: Any) -> bool:
    """Whether a request started and the worker no longer holds it: it ended. One that never
    started is kept (it may be waiting on its ETA, a countdown or a rate limit, where Celery
    5.5 holds it in no set of its own)."""
    return getattr(request, "time_start", None) is not None and not outstanding(request)
