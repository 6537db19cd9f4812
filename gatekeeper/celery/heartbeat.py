"""A worker's heartbeat in the gate's Redis, so that the sweep tells a long run from a dead one.

Each worker of a gated app (its main process) refreshes ``worker:<hostname>`` every
``worker_heartbeat_s`` with a TTL of three intervals, from a daemon thread started when the
worker is ready, and deletes it at a clean shutdown. A run records the worker it started on;
``gatekeeper sweep`` writes ``killed`` for a stale run only once its worker's heartbeat is gone
(:func:`gatekeeper.redis.sweep.sweep`): a run that is merely long while its worker is alive is
left alone.

The heartbeat's value is when this worker process began (ms, at ``worker_init``, before its
pool and consumer start): a worker restarted under the same ``-n`` (a pod's name, ``celery
multi restart``) beats on the same key at once, and the runs its previous process left behind,
started before that, are still seen as dead (an earlier build wrote ``1``: every run alive).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from gatekeeper.redis.keys import Keys

__all__ = ["Heartbeat"]


class Heartbeat:
    """One app's worker heartbeat (main process only)."""

    def __init__(
        self, app: Celery, client: redis.Redis, keys: Keys, interval_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.app = app
        self.client = client
        self.keys = keys
        self.interval_s = interval_s
        self.clock = clock
        self._stop = threading.Event()
        self._key: str | None = None
        self.since_ms: int | None = None
        """When this worker process began (``worker_init``; else when it was ready)."""

    def on_init(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is self.app and self.since_ms is None:
            self.since_ms = round(self.clock() * 1000)

    def on_ready(self, sender: Any = None, **_: Any) -> None:
        hostname = getattr(sender, "hostname", None)
        if getattr(sender, "app", None) is not self.app or not hostname:
            return
        if self.since_ms is None:
            self.since_ms = round(self.clock() * 1000)
        self._key = self.keys.worker(str(hostname))
        self._beat()
        threading.Thread(target=self._run, name="gatekeeper-heartbeat", daemon=True).start()

    def on_shutdown(self, **_: Any) -> None:
        self._stop.set()
        if self._key is not None:
            with contextlib.suppress(redis.RedisError):
                self.client.delete(self._key)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def _beat(self) -> None:
        if self._key is None:
            return
        with contextlib.suppress(redis.RedisError):  # missed beats only make a sweep wait
            self.client.set(self._key, str(self.since_ms), px=max(1, round(self.interval_s * 3000)))
