"""A child forked while another thread of its parent waits on Redis inside one of gatekeeper's
locks (the flags' or the learned service times' refresh, the install's first build, a cluster
client's first connect, the snapshots a pool child's end waits for) gets that lock fresh, and
a connect under way is started over: a lock copied held would never be released in the
child, whose first refresh would then wait for ever (a prefork pool forks new children at
any time)."""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import pytest
import redis

import gatekeeper
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis import durable
from gatekeeper.redis.cluster import cluster_client
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.service_times import LearnedService, ServiceTimes
from gatekeeper.settings import GatekeeperSettings
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, wait_until
from tests.processes import stopped


def _in_a_forked_child(work: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """Whether a child forked now finished ``work`` within ``timeout_s``, and what it
    returned (the child is killed either way)."""
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("fork").Process(target=_answer, args=(work, theirs))
    child.start()
    try:
        answered = ours.poll(timeout_s)
        return answered, ours.recv() if answered else None
    finally:
        child.kill()
        child.join(5)


def _answer(work: Callable[[], Any], pipe: Connection) -> None:
    pipe.send(work())


HUNG = "the child waited for a lock its parent's thread held at the fork"


def _flags(settings: GatekeeperSettings) -> tuple[Callable[[], Any], threading.Lock]:
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=settings.redis_timeout_s)
    flags = FlagStore(client, settings, Keys(settings.key_prefix, settings.namespace))
    return flags.current, flags._lock


def _service(settings: GatekeeperSettings) -> tuple[Callable[[], Any], threading.Lock]:
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=settings.redis_timeout_s)
    times = ServiceTimes(client, Keys(settings.key_prefix, settings.namespace), None)
    learned = LearnedService(times, settings, None)
    return lambda: learned.histogram("tests.embed", 30.0), learned._lock


@pytest.mark.parametrize("make", [_flags, _service], ids=["flags", "learned_service"])
def test_a_child_forked_mid_refresh_refreshes_on_its_own(
    gate_server: EmbeddedRedis, make: Callable[[GatekeeperSettings], Any]
) -> None:
    settings = gate_settings(gate_server.url, redis_timeout_s=2.0, flag_cache_s=0)
    refresh, lock = make(settings)
    with stopped(gate_server.process):
        reading = threading.Thread(target=refresh, daemon=True)
        reading.start()  # waits on the stopped server, inside the lock
        assert wait_until(lock.locked, timeout_s=5)
        # The server is still stopped in the child: its own timeout, then stale or unread.
        refreshed, _ = _in_a_forked_child(lambda: refresh() and None, 4 * settings.redis_timeout_s)
        reading.join(10)
    assert refreshed, HUNG


def test_a_child_forked_mid_build_of_the_install_builds_its_own(
    redis_url: str, gate_server: EmbeddedRedis
) -> None:
    app = create_app(gate_settings(gate_server.url), redis_url)
    installed = gatekeeper.install(app)
    held, release = threading.Event(), threading.Event()

    def building() -> None:  # stands for a first build waiting on a server, in its lock
        with installed._building:
            held.set()
            release.wait(30)

    threading.Thread(target=building, daemon=True).start()
    assert held.wait(5)
    try:
        built, _ = _in_a_forked_child(lambda: installed.parts() and None, 15)
    finally:
        release.set()
    assert built, HUNG


def _ping_twice(client: Any) -> list[str]:
    answers = []

    def ping() -> None:  # from a new thread too: its id may be the parent's connecting one
        try:
            client.ping()
            answers.append("ok")
        except redis.ConnectionError:
            answers.append("refused")  # what a new client of that address says
        except Exception as exc:
            answers.append(repr(exc))

    ping()
    pinging = threading.Thread(target=ping)
    pinging.start()
    pinging.join(10)
    return answers


def test_a_child_forked_mid_connect_of_a_cluster_client_connects_on_its_own() -> None:
    listener = socket.socket()  # accepts, never answers: a first connect waits its timeout
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    client = cluster_client(f"redis+cluster://127.0.0.1:{listener.getsockname()[1]}", 3.0, {})
    connecting = threading.Thread(target=_quietly, args=(client.ping,), daemon=True)
    connecting.start()
    assert wait_until(lambda: client.__dict__["_gk_state"] == "connecting", timeout_s=5)
    listener.close()  # the child's own connect is refused at once
    answered, answers = _in_a_forked_child(lambda: _ping_twice(client), 15)
    connecting.join(10)
    assert answered, HUNG
    assert answers == ["refused", "refused"]


def _quietly(call: Callable[[], Any]) -> None:
    with contextlib.suppress(Exception):
        call()


def test_a_pool_childs_end_does_not_wait_for_the_snapshot_list_held_at_its_fork() -> None:
    """``finish_pending`` (a pool child's ``worker_process_shutdown``) takes the list of
    snapshots still to begin under a lock that a thread of the parent may hold at the fork."""
    with durable._pending_lock:  # as a thread adding an auto-freeze's snapshot holds it
        ended, _ = _in_a_forked_child(lambda: durable.finish_pending(timeout_s=1.0), 5.0)
    assert ended, HUNG
