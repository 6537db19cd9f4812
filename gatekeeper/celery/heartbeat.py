"""A worker's heartbeat in the gate's Redis, so that the sweep tells a long run from a dead one.

Each worker of a gated app (its main process) refreshes ``worker:<hostname>#<process id>``
every ``worker_heartbeat_s`` with a TTL of three intervals, from a daemon thread started when
the worker is ready, and deletes it at a clean shutdown. The process id is drawn at
``worker_init`` in the main process, before its pool forks, so its pool children inherit it;
a run records ``<hostname>#<process id>`` as the worker it started on (:func:`worker_name`).
``gatekeeper sweep`` writes ``killed`` for a stale run only once that heartbeat is gone
(:func:`gatekeeper.redis.sweep.sweep`): a run that is merely long while its worker is alive is
left alone, and the runs a SIGKILLed worker left are not hidden by a worker restarted under the
same ``-n`` (a pod's name, ``celery multi restart``), nor those of one of two live workers
sharing a name (two units on one host, each ``celery@%h``) taken for dead.

It also refreshes ``worker:<hostname>``, which runs recorded by an earlier build name (alive
while any worker of that name beats, as before).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from gatekeeper.redis.keys import Keys

__all__ = ["Heartbeat", "worker_name"]

_process: list[str] = []
"""This worker process's id (one value, drawn at ``worker_init``; inherited by pool children
forked after it). Empty outside a worker, or in a process that did not inherit it."""


def worker_name(hostname: str) -> str:
    """The worker a run records: the node's name and its main process's id, or the name
    alone where there is no id (an earlier build's runs: their node's plain heartbeat)."""
    return f"{hostname}#{_process[0]}" if hostname and _process else hostname


def _drawn() -> None:
    if not _process:
        _process.append(secrets.token_hex(4))


class Heartbeat:
    """One app's worker heartbeat (main process only)."""

    def __init__(
        self, app: Celery, client: redis.Redis, keys: Keys, interval_s: float,
        also: Callable[[], object] | None = None,
    ) -> None:  # fmt: skip
        """``also``: called at each beat (the worker's window kept in Redis, at most once a
        minute: it writes rows in its own windows, gatekeeper/redis/deployment.py)."""
        self.app = app
        self.also = also
        self.client = client
        self.keys = keys
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._keys: tuple[str, ...] = ()

    def on_init(self, sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is self.app:
            _drawn()  # before the pool forks: its children inherit it

    def on_ready(self, sender: Any = None, **_: Any) -> None:
        hostname = getattr(sender, "hostname", None)
        if getattr(sender, "app", None) is not self.app or not hostname:
            return
        # No id drawn (gatekeeper installed after worker_init): none now either, since the
        # pool has forked; runs, requests and beats all use the name alone, as before.
        named = {self.keys.worker(worker_name(str(hostname))), self.keys.worker(str(hostname))}
        self._keys = tuple(sorted(named, key=len, reverse=True))
        self._beat()
        threading.Thread(target=self._run, name="gatekeeper-heartbeat", daemon=True).start()

    def on_shutdown(self, **_: Any) -> None:
        self._stop.set()
        if self._keys:
            with contextlib.suppress(redis.RedisError):  # its own; the name's may be another
                if len(self._keys) == 2:  # live worker's too (two of one -n): it expires
                    self.client.delete(self._keys[0])

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def _beat(self) -> None:
        if not self._keys:
            return
        if self.also is not None:
            with contextlib.suppress(Exception):  # (it never raises)
                self.also()
        ttl = max(1, round(self.interval_s * 3000))
        with contextlib.suppress(redis.RedisError):  # missed beats only make a sweep wait
            pipe = self.client.pipeline(transaction=False)
            for key in self._keys:
                pipe.set(key, b"1", px=ttl)
            pipe.execute()
