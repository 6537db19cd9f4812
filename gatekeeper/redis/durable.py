"""A flag write that outlives the server it was written to: its replicas (``WAIT``) and its
disk (``WAITAOF``, or a snapshot taken after it).

SPEC: a Redis that loses its data must not silently undo a rollback or an auto-freeze. A
total loss removes the state marker too, and the gate then sends nothing to free. A partial
one does not: a server that snapshots its data (RDB, Redis's default) and restarts comes back
with the snapshot's marker and the flags as they were then, the rollbacks written after it
gone. So after a flag write, :func:`on_disk` asks the server to put it on disk: an AOF server
fsyncs it (``WAITAOF``, Redis 7.2 and later; earlier ones fsync within about a second with
``appendfsync everysec``), a snapshotting one takes a snapshot (``BGSAVE``), and ``gatekeeper
flags`` waits until it is written and says so. A server with no persistence at all loses
the marker with everything else (state missing: closed).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time

import redis

__all__ = ["REPLICA_WAIT_S", "finish_pending", "on_disk", "replicated"]

REPLICA_WAIT_S = 4.0
"""How long ``gatekeeper flags`` waits for the replicas (``WAIT``): under the on-call
commands' 5 s socket timeout (gatekeeper/ops/oncall.py), which would cut a longer one off."""

_pending: list[threading.Thread] = []
"""Snapshots this process still has to begin (``rdb_pending``): :func:`finish_pending`."""
_pending_lock = threading.Lock()


def _forked() -> None:
    """In a new child: a fresh lock (another thread may have held it at the fork, and a pool
    child's end waits on it), and none of the parent's snapshots to wait for."""
    global _pending_lock
    _pending_lock = threading.Lock()
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def replicated(client: redis.Redis, timeout_s: float) -> tuple[int, int] | None:
    """Wait (``WAIT``) until every connected replica has the writes made so far, so that a
    failover cannot drop the last rollback; returns how many acknowledged and how many are
    connected (None: no replicas, or the server cannot say). A replica that does not answer
    in ``timeout_s`` is left behind: the write stands on the primary, and the caller is not
    failed (``gatekeeper flags`` says so, and exits 1).

    ``client`` is the server written to (on a Redis Cluster, :func:`~gatekeeper.redis.
    cluster.home`'s node client: ``WAIT`` counts that primary's replicas, for the writes of
    the connection it is sent on, the one the writes just gave back to the pool)."""
    replicas = 0
    try:
        replicas = int(client.info("replication").get("connected_slaves", 0))
        if not replicas:
            return None
        acked = client.execute_command(  # type: ignore[no-untyped-call]
            "WAIT", replicas, max(1, round(timeout_s * 1000))
        )
        return int(acked), replicas
    except redis.TimeoutError:  # the client's own timeout cut the WAIT off: none it knows of
        return (0, replicas) if replicas else None
    except (redis.RedisError, TypeError, ValueError, AttributeError):
        return None


def on_disk(client: redis.Redis, timeout_s: float, wait: bool = True) -> str:
    """Put the writes made so far on the server's disk where it keeps one, and say how:

    - ``aof``: fsynced (``WAITAOF``);
    - ``aof_everysec``: an AOF server without ``WAITAOF`` (before Redis 7.2): on disk within
      about a second with ``appendfsync everysec`` (Redis's default for AOF);
    - ``rdb``: in a snapshot begun after them (``BGSAVE``, waited for up to ``timeout_s``);
      ``rdb_started`` when ``wait`` is false (the auto-freeze: a worker does not wait for a
      dump; begun now, or once the fork running now ends) or the snapshot was still being
      written at ``timeout_s``; ``rdb_pending`` when a snapshot was being written then (it
      may hold none of them): a thread of this process begins one once it ends, which a
      pool child waits for as it ends (:func:`finish_pending`; not when SIGKILLed);
    - ``none``: the server keeps nothing on disk (a restart loses everything, the state
      marker included: the gate then sends nothing to free);
    - ``unknown: <why>``: the server would not say or do it (a managed Redis that renames
      ``CONFIG`` or ``BGSAVE``, an ACL): a restart may undo the write."""
    try:
        info = client.info("persistence")
        if int(info.get("aof_enabled", 0)):
            return _aof(client, timeout_s)
        save = client.config_get("save").get("save")
        if save == "":
            return "none"
        return _snapshot(client, timeout_s, wait)
    except (redis.RedisError, TypeError, ValueError, AttributeError) as exc:
        return f"unknown: {exc}"


def _aof(client: redis.Redis, timeout_s: float) -> str:
    try:
        local, _ = client.execute_command(  # type: ignore[no-untyped-call]
            "WAITAOF", 1, 0, max(1, round(timeout_s * 1000))
        )
    except redis.ResponseError as exc:
        if "unknown command" in str(exc).lower():
            return "aof_everysec"
        raise
    return "aof" if int(local) >= 1 else "unknown: WAITAOF timed out"


LATER_S = 600.0
"""How long a pending snapshot's thread waits for the one running to end (a large dataset's
takes minutes); :func:`finish_pending` bounds how long an exiting process waits for it."""


def _later(client: redis.Redis) -> None:
    """Begin a snapshot once the one running ends (not waited for past its beginning)."""
    with contextlib.suppress(redis.RedisError):  # the write stands; only its disk is late
        _begin(client, time.monotonic() + LATER_S)


def _begin(client: redis.Redis, deadline: float) -> None:
    """``BGSAVE``, refused while another fork runs: tried again until one is begun by it."""
    while True:
        try:
            client.execute_command("BGSAVE")  # type: ignore[no-untyped-call]
            return
        except redis.ResponseError as exc:
            busy = any(word in str(exc).lower() for word in ("in progress", "another child"))
            if not busy or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _snapshot(client: redis.Redis, timeout_s: float, wait: bool) -> str:
    """A snapshot begun after the writes. Not waited for (``wait`` false), ``BGSAVE
    SCHEDULE``: one is begun at once, or as soon as the fork running now (an AOF rewrite)
    ends; a snapshot running now may hold none of the writes, so a thread begins one once it
    ends. Waited for, a plain ``BGSAVE``: refused while another fork runs, so tried again
    until one is begun by it, then waited out."""
    if not wait:
        try:
            client.execute_command("BGSAVE", "SCHEDULE")  # type: ignore[no-untyped-call]
        except redis.ResponseError as exc:  # a snapshot runs now: begin one once it ends
            if "in progress" not in str(exc).lower():
                raise
            later = threading.Thread(target=_later, args=(client,), daemon=True,
                                     name="gatekeeper-snapshot")  # fmt: skip
            with _pending_lock:
                if not _pending:  # a process that ends normally waits too (a solo worker)
                    atexit.register(finish_pending)
                _pending[:] = [t for t in _pending if t.is_alive()] + [later]
            later.start()
            return "rdb_pending"
        return "rdb_started"
    deadline = time.monotonic() + timeout_s
    _begin(client, deadline)
    while int(client.info("persistence").get("rdb_bgsave_in_progress", 0)):
        if time.monotonic() > deadline:
            return "rdb_started"
        time.sleep(0.05)
    status = client.info("persistence").get("rdb_last_bgsave_status")
    return "rdb" if status == "ok" else f"unknown: the snapshot failed ({status})"


def finish_pending(timeout_s: float = 30.0, **_: object) -> None:
    """Wait, up to ``timeout_s``, for the snapshots this process has still to begin (an
    auto-freeze's, while another was being written), until each is begun: a worker's pool
    child ends with ``os._exit``, which ended their thread first, and the freeze was then on
    no disk. Connected to ``worker_process_shutdown`` (pool children) and, once a snapshot is
    pending, run at exit (a solo or threads worker's process); a handler's keywords are
    ignored."""
    deadline = time.monotonic() + timeout_s
    with _pending_lock:
        waiting = list(_pending)
    for thread in waiting:
        thread.join(max(0.0, deadline - time.monotonic()))
