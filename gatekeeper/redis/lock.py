"""One replayer per namespace: its lock (redis-py's ``Lock``) and the claims it holds.

redis-py's ``Lock`` refreshes and releases with a Lua check of its own token, so a holder
whose lock expired and was taken by another can never extend or drop its successor's (the
GET-then-PEXPIRE/DEL this replaced could). Its key is ``replayer:lock`` (see
:mod:`gatekeeper.redis.keys`). The holder checks it before every decision, not once a pass,
and keeps the time of its last renewal on a monotonic clock: a holder that went longer than
the TTL without renewing (stopped, swapped out, paused) has lost the lock, whatever Redis
answers, since a successor may have taken it and taken back its claims meanwhile.

Each tenure of the lock claims into a processing list of its own, registered on the broker
with a heartbeat that outlives the lock (refreshed after every renewal and with every claim).
A heartbeat that expired is a tenure that will never decide again (its holder finds its lock
lost first), so its claims are the next holder's to take back; a live tenure's never are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Literal

import redis
from redis.client import Pipeline
from redis.exceptions import LockError

__all__ = ["RENEW_AFTER", "Claims", "OneHolder"]

RENEW_AFTER = 1 / 3
"""A check renews the lock once this fraction of its TTL has passed since the last renewal."""


class OneHolder:
    """Take, keep and give back a lock that expires on its own when its holder dies;
    ``on_renew`` runs after each renewal of a lock already held."""

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        ttl_s: float,
        monotonic: Callable[[], float] = time.monotonic,
        on_renew: Callable[[], object] = lambda: None,
    ) -> None:
        self._lock = client.lock(key, timeout=ttl_s, blocking=False, thread_local=False)
        self.ttl_s = ttl_s
        self.held = False
        self._monotonic = monotonic
        self._on_renew = on_renew
        self._renewed = -math.inf
        self.lost_why = ""
        """What is known of why the lock was last found lost."""

    def take(self) -> Literal["taken", "kept", "lost", "held_elsewhere"]:
        """``taken`` (newly: a new tenure), ``kept`` (held and renewed), ``lost`` (it had
        expired, or was dropped after a stall, and another holds it now) or ``held_elsewhere``."""
        if self.held:
            if self.check(renew_after=0):
                return "kept"
            if self._acquire():
                return "taken"
            self.lost_why = "another replayer holds it"
            return "lost"
        return "taken" if self._acquire() else "held_elsewhere"

    def check(self, renew_after: float = RENEW_AFTER) -> bool:
        """Whether this holder still holds the lock, renewing it when ``renew_after`` of the
        TTL has passed since the last renewal. Redis errors propagate (the pass fails)."""
        if not self.held:
            return False
        started = self._monotonic()
        since = started - self._renewed
        if since < self.ttl_s * renew_after:
            return True
        if since >= self.ttl_s:
            # Expired while we were not looking: lost even if Redis still has our token.
            # Given back if it is ours (the release fails when another holds it), so that
            # the next take starts a new tenure instead of waiting out our own lock.
            self.held = False
            self.lost_why = f"not renewed for {since:.3g} s, past its TTL (this holder stalled)"
            with suppress(LockError, redis.RedisError):
                self._lock.release()
            return False
        try:
            self._lock.reacquire()
        except LockError:  # taken by another, or the key is gone (failover, a person)
            self.held = False
            self.lost_why = "not ours in Redis any more (taken by another, or the key is gone)"
            return False
        self._renewed = started
        self._on_renew()
        return True

    def _acquire(self) -> bool:
        started = self._monotonic()
        self.held = bool(self._lock.acquire(blocking=False))
        if self.held:
            self._renewed = started  # a new tenure: the caller starts it (no ``on_renew``)
        return self.held

    def give_back(self) -> None:
        """Release it if held; raises redis-py's errors (the caller logs them)."""
        if not self.held:
            return
        self.held = False
        self._lock.release()


class Claims:
    """The processing lists of one replayer's tenures, on the broker's Redis, and the
    taking back of what dead tenures left claimed (key names in :mod:`gatekeeper.redis.keys`)."""

    def __init__(self, broker: redis.Redis, queue: str, ttl_s: float, ident: str) -> None:
        self.broker = broker
        self.queue = queue
        self.legacy = f"{queue}:replaying"
        """The one processing list of versions before per-tenure lists (still taken back)."""
        self.registry = f"{queue}:replayers"
        self.ttl_ms = max(1, math.ceil(ttl_s * 1000))
        self.ident = ident
        self._tenures = 0
        self.tenure = f"{ident}:0"  # claims nothing: the first take of the lock begins ``:1``

    def list_of(self, tenure: str) -> str:
        return f"{self.queue}:replaying:{tenure}"

    def heartbeat_of(self, tenure: str) -> str:
        return f"{self.queue}:replayer:{tenure}"

    @property
    def current(self) -> str:
        """This tenure's processing list."""
        return self.list_of(self.tenure)

    def begin(self) -> None:
        """A new tenure, alive (the lock was taken): the previous one's claims are left to be
        taken back, and nothing is claimed into its list again."""
        self.end()
        self._tenures += 1
        self.tenure = f"{self.ident}:{self._tenures}"
        self.beat()

    def end(self) -> None:
        """This tenure decides nothing more: its heartbeat goes, so the holder of the lock
        takes back what it left claimed. When Redis cannot be reached it expires on its own."""
        with suppress(redis.RedisError):
            self.broker.delete(self.heartbeat_of(self.tenure))

    def beat(self) -> None:
        """Prove this tenure alive for another TTL (called after each renewal of the lock)."""
        self.broker.set(self.heartbeat_of(self.tenure), b"1", px=self.ttl_ms)

    def claim(self, source: str) -> bytes | None:
        """Move the oldest message of ``source`` into this tenure's list; ``None`` if empty."""
        claimed = self.claim_many(source, 1)
        return claimed[0] if claimed else None

    def claim_many(self, source: str, n: int) -> list[bytes]:
        """Move the ``n`` oldest messages of ``source`` (fewer when it holds fewer) into this
        tenure's list, in one transaction; returns them, oldest first.

        Registering the tenure and refreshing its heartbeat in the same transaction means a
        claim can never land in a list the registry forgot (a stalled holder that claims once
        more after its tenure was taken back re-registers it)."""
        with self.broker.pipeline(transaction=True) as pipe:
            pipe.sadd(self.registry, self.tenure)
            pipe.set(self.heartbeat_of(self.tenure), b"1", px=self.ttl_ms)
            for _ in range(n):
                pipe.rpoplpush(source, self.current)
            replies = pipe.execute()[2:]
        return [raw for raw in replies if isinstance(raw, bytes)]

    def take_back(self) -> int:
        """Put back in the queue what dead tenures left claimed: the legacy list, this
        tenure's own (between passes nothing is in flight) and every registered tenure whose
        heartbeat expired. A live tenure's claims are never touched. Returns how many."""
        moved = self._drain(self.legacy) + self._drain(self.current)
        for member in self.broker.smembers(self.registry):
            tenure = member.decode() if isinstance(member, bytes) else str(member)
            if tenure != self.tenure and not self.broker.exists(self.heartbeat_of(tenure)):
                moved += self._forget(tenure)
        return moved

    @staticmethod
    def held(broker: redis.Redis, queue: str) -> int:
        """How many messages replayers hold claimed (every tenure's list and the legacy one):
        what ``gatekeeper status`` shows as ``<defer>:replaying``."""
        probe = Claims(broker, queue, 1.0, "status")
        lists = [probe.legacy] + [
            probe.list_of(m.decode() if isinstance(m, bytes) else str(m))
            for m in broker.smembers(probe.registry)
        ]
        return sum(int(broker.llen(name)) for name in lists)

    def _drain(self, claims: str) -> int:
        moved = 0
        while self.broker.rpoplpush(claims, self.queue) is not None:
            moved += 1
        return moved

    def _forget(self, tenure: str) -> int:
        """Take back a dead tenure's claims, then drop it from the registry only if its list
        is still empty then (WATCH): a claim made meanwhile is taken back on the next round."""
        claims, moved, forgotten = self.list_of(tenure), 0, False

        def drop_if_empty(pipe: Pipeline) -> None:
            nonlocal forgotten
            forgotten = not pipe.llen(claims)
            if forgotten:
                pipe.multi()
                pipe.srem(self.registry, tenure)

        while not forgotten:
            moved += self._drain(claims)
            self.broker.transaction(drop_if_empty, claims)
        return moved
