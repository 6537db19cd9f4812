"""One holder per namespace (the replayer): redis-py's ``Lock``, refreshed while held.

redis-py's ``Lock`` refreshes and releases with a Lua check of its own token, so a holder
whose lock expired and was taken by another can never extend or drop its successor's (the
GET-then-PEXPIRE/DEL this replaced could). Its key is ``replayer:lock`` (see
:mod:`gatekeeper.redis.keys`).
"""

from __future__ import annotations

from typing import Literal

import redis
from redis.exceptions import LockError

__all__ = ["OneHolder"]


class OneHolder:
    """Take, keep and give back a lock that expires on its own when its holder dies."""

    def __init__(self, client: redis.Redis, key: str, ttl_s: float) -> None:
        self._lock = client.lock(key, timeout=ttl_s, blocking=False, thread_local=False)
        self.held = False

    def take(self) -> Literal["taken", "kept", "lost", "held_elsewhere"]:
        """``taken`` (newly: the caller recovers what a dead holder left), ``kept`` (held and
        refreshed), ``lost`` (it had expired and another holds it now) or ``held_elsewhere``."""
        if self.held:
            try:
                self._lock.reacquire()
                return "kept"
            except LockError:
                self.held = False
                if not self._lock.acquire(blocking=False):
                    return "lost"
                self.held = True
                return "taken"
        if self._lock.acquire(blocking=False):
            self.held = True
            return "taken"
        return "held_elsewhere"

    def give_back(self) -> None:
        """Release it if held; raises redis-py's errors (the caller logs them)."""
        if not self.held:
            return
        self.held = False
        self._lock.release()
