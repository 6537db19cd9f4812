"""``free_path_enabled=false`` binds every gated task: inside or outside the canary, gate on
or off (SPEC section 4). A gated task left on its normal route keeps it, unless that route is
the free queue: then it goes to reserved."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Exchange, Queue

import gatekeeper
import gatekeeper.lines
from gatekeeper.core.ledger import window_id
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis.flags import FlagStore, in_canary
from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, queue_messages, unused_port

KEYS = Keys()


def make_app(redis_url: str, **overrides: Any) -> Celery:
    return create_app(gate_settings(redis_url, **overrides), redis_url)


def close_in_redis(client: redis.Redis) -> None:
    client.hset("gatekeeper:{default}:flags", "free_path_enabled", "false")


@pytest.mark.parametrize("where", ["redis", "settings"])
def test_a_rollback_binds_the_canarys_outside_too(
    redis_url: str, redis_client: redis.Redis, where: str
) -> None:
    overrides: dict[str, Any] = {"canary_percent": 5}
    if where == "settings":
        overrides["free_path_enabled"] = False
    else:
        close_in_redis(redis_client)
    app = make_app(redis_url, **overrides)
    ids = [app.tasks["tests.embed"].apply_async((n,), queue="free").id for n in range(200)]
    assert redis_client.llen("free") == 0
    reserved = queue_messages(redis_client, "reserved")
    assert len(reserved) == 200
    assert {m["headers"]["gatekeeper_reason"] for m in reserved} == {"free_path_disabled"}
    outside = [job for job in ids if not in_canary(job, 5)]
    assert len(outside) > 150  # the test is about the 95% the canary leaves alone


@pytest.mark.parametrize("fast_publish", [True, False])
def test_a_rollback_binds_a_gate_that_is_off(
    redis_url: str, redis_client: redis.Redis, fast_publish: bool
) -> None:
    close_in_redis(redis_client)
    app = make_app(redis_url, dwell_gate_enabled=False, fast_publish=fast_publish)
    embed = app.tasks["tests.embed"]
    embed.apply_async((1,), queue="free")
    embed.apply_async((2,))  # its own route is the default queue: kept, untouched
    assert redis_client.llen("free") == 0
    (moved,) = queue_messages(redis_client, "reserved")
    assert moved["headers"]["gatekeeper_reason"] == "free_path_disabled"
    (kept,) = queue_messages(redis_client, "celery")
    assert not any(key.startswith("gatekeeper_") for key in kept["headers"])


def test_with_the_free_path_open_the_canarys_outside_keeps_its_free_route(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url, canary_percent=0)
    app.tasks["tests.embed"].apply_async((1,), queue="free")
    (message,) = queue_messages(redis_client, "free")
    assert not any(key.startswith("gatekeeper_") for key in message["headers"])


def test_the_environments_rollback_beats_an_apps_config_that_opens_the_free_path(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The runbook: "set GATEKEEPER_FREE_PATH_ENABLED=false and restart: either source turns
    # it off", in a project whose Django settings.py says CELERY_GATEKEEPER_FREE_PATH_ENABLED.
    monkeypatch.setenv("GATEKEEPER_FREE_PATH_ENABLED", "false")
    app = Celery("restarted")
    gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=0.2, tokens_in=10, deadline_s=120)
    @app.task(name="restarted.embed", max_retries=0, shared=False)
    def embed(chunk: Any) -> Any:
        return chunk

    class DjangoSettings:
        CELERY_BROKER_URL = redis_url
        CELERY_GATEKEEPER_FREE_PATH_ENABLED = True
        CELERY_GATEKEEPER_DWELL_GATE_ENABLED = True
        CELERY_GATEKEEPER_CANARY_PERCENT = 100

    app.config_from_object(DjangoSettings, namespace="CELERY")
    embed.delay(1)
    embed.apply_async((2,), queue="free")
    assert redis_client.llen("free") == 0
    reasons = [m["headers"]["gatekeeper_reason"] for m in queue_messages(redis_client, "reserved")]
    assert reasons == ["free_path_disabled"] * 2


def publisher(redis_url: str, routes: dict[str, Any]) -> Celery:
    """A publishing app with gatekeeper installed and these routes, registering no task."""
    app = Celery("publisher", broker=redis_url)
    app.conf.task_routes = routes
    gatekeeper.install(app, gate_settings(redis_url))
    return app


@pytest.mark.parametrize("closed", [True, False])
def test_a_publish_by_a_name_the_app_does_not_know_is_not_sent_to_free_while_it_is_closed(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str], closed: bool
) -> None:
    # An audit: a publisher that never imported the gated task's module sends it by name;
    # the gate cannot tell it is gated and lets it pass, and with a route naming free it ran
    # on free while the free path was frozen. Not decided (no record), but not sent to free.
    if closed:
        close_in_redis(redis_client)
    app = publisher(redis_url, {"unknown.*": {"queue": "free"}})
    app.send_task("unknown.embed", (1,))
    app.send_task("unknown.plain", (2,), queue="celery")  # a route of its own: left alone
    assert len(queue_messages(redis_client, "celery")) == 1
    there = "reserved" if closed else "free"
    (message,) = queue_messages(redis_client, there)
    assert message["headers"]["task"] == "unknown.embed"
    assert not any(key.startswith("gatekeeper_") for key in message["headers"])
    assert redis_client.llen("free" if closed else "reserved") == 0
    gatekeeper.lines.flush()
    assert ("event=routed_off_free task=unknown.embed" in capsys.readouterr().err) is closed


def test_a_map_of_a_gated_task_routed_to_free_is_not_sent_to_free_while_it_is_closed(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # An audit: Celery routes ``task.map(...)`` (a ``celery.map`` task, not gated) by the
    # gated task's name: to free, while the free path was frozen.
    close_in_redis(redis_client)
    app = make_app(redis_url)
    app.conf.task_routes = {"tests.embed": {"queue": "free"}}
    app.tasks["tests.embed"].map([(1,), (2,)]).apply_async()
    (message,) = queue_messages(redis_client, "reserved")
    assert message["headers"]["task"] == "celery.map"
    assert redis_client.llen("free") == 0


def tasks_in(client: redis.Redis) -> dict[str, list[str]]:
    return {queue: sorted(m["headers"]["task"] for m in queue_messages(client, queue))
            for queue in ("free", "reserved", "celery")}  # fmt: skip


def test_an_unknown_name_routed_to_frees_exchange_is_not_sent_to_free_while_it_is_closed(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: a route by exchange and key (the free queue's own, as Celery makes it)
    # reached free; a gated task with the same route went to reserved.
    close_in_redis(redis_client)
    app = publisher(redis_url, {"unknown.a": {"exchange": "free", "routing_key": "free"}})
    with app.connection_for_write() as connection:  # bound as a worker's -Q free binds it
        Queue("free", Exchange("free"), "free")(connection.default_channel).declare()
    app.send_task("unknown.a", (1,))
    app.send_task("unknown.b", (2,), exchange="free", routing_key="free")
    assert tasks_in(redis_client) == {"free": [], "reserved": ["unknown.a", "unknown.b"],
                                      "celery": []}  # fmt: skip


@pytest.mark.parametrize("closed", [False, True])
def test_a_routing_key_alone_is_not_a_route_to_free(
    redis_url: str, redis_client: redis.Redis, closed: bool
) -> None:
    """Celery sends it to the default queue (a reviewer: it was moved to reserved)."""
    if closed:
        close_in_redis(redis_client)
    app = publisher(redis_url, {"unknown.k": {"routing_key": "free"}})
    app.send_task("unknown.k", (1,))
    assert tasks_in(redis_client) == {"free": [], "reserved": [], "celery": ["unknown.k"]}


def test_with_the_flags_never_read_nothing_routed_to_free_goes_there(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: the gate's Redis unreachable (the broker is not), the gated task failed
    # closed, and an unknown name and a map of the gated task went to free: a rollback
    # stored in Redis may hold, which the publisher cannot see.
    app = create_app(gate_settings(f"redis://127.0.0.1:{unused_port()}/0"), redis_url)
    app.conf.task_routes = {"tests.embed": {"queue": "free"}, "pkg.*": {"queue": "free"}}
    app.tasks["tests.embed"].apply_async((1,))
    app.send_task("pkg.embed", (2,))
    app.tasks["tests.embed"].map([(3,)]).apply_async()
    assert tasks_in(redis_client) == {
        "free": [],
        "celery": [],
        "reserved": ["celery.map", "pkg.embed", "tests.embed"],
    }


@pytest.mark.parametrize("mode", ["gate_off", "outside_canary"])
def test_a_rollback_the_publisher_cannot_read_again_sends_nothing_more_to_free(
    redis_url: str, redis_client: redis.Redis, gate_server: EmbeddedRedis, mode: str
) -> None:
    # A reviewer: the flags read open, a rollback written, then the gate's Redis gone before
    # the publisher read them again: the old read stayed in force for as long as Redis was
    # away, and tasks whose own route is free (gate off, outside the canary, an ungated name)
    # went to free. Flags that could not be read again are stale now: never to free on them.
    off = {"dwell_gate_enabled": False} if mode == "gate_off" else {"canary_percent": 0}
    app = create_app(gate_settings(gate_server.url, flag_cache_s=0.5, **off), redis_url)
    app.conf.task_routes = {"pkg.*": {"queue": "free"}}
    app.tasks["tests.embed"].apply_async((0,), queue="free")  # the flags read: open
    assert tasks_in(redis_client)["free"] == ["tests.embed"]
    redis_client.delete("free")
    close_in_redis(redis.Redis.from_url(gate_server.url))
    gate_server.kill()  # right after the rollback, before the publisher reads it
    time.sleep(0.7)  # past flag_cache_s: the next publish tries to read them again
    app.tasks["tests.embed"].apply_async((1,), queue="free")
    app.send_task("pkg.embed", (2,))
    assert tasks_in(redis_client) == {"free": [], "celery": [],
                                      "reserved": ["pkg.embed", "tests.embed"]}  # fmt: skip


def test_a_task_the_gate_leaves_alone_is_not_scored_while_its_flags_are_stale(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reviewer: one flags read failed (a timeout), Redis answering again; a gate-off task
    # routed to free was then decided by gate.lua (a record, an admission counted in the
    # window) until the flags were read again. It goes to reserved without the script.
    app = make_app(redis_url, flag_cache_s=0.5, dwell_gate_enabled=False)
    app.tasks["tests.embed"].apply_async((0,), queue="free", task_id="before")  # read: open
    stored, failed = FlagStore.stored, []

    def once(self: FlagStore) -> dict[str, str]:
        if not failed:
            failed.append(1)
            raise LedgerUnavailable("cannot read flags: Timeout reading from socket")
        return stored(self)

    monkeypatch.setattr(FlagStore, "stored", once)
    time.sleep(0.6)  # past flag_cache_s: the next publish reads them, and fails
    app.tasks["tests.embed"].apply_async((1,), queue="free", task_id="during")
    assert failed and tasks_in(redis_client)["reserved"] == ["tests.embed"]
    assert not redis_client.exists("gatekeeper:{default}:run:during:1")
    assert not redis_client.hget(KEYS.window(window_id(time.time(), 900)), "admitted_free")


@pytest.mark.parametrize("kind", ["topic", "fanout"])
def test_an_ungated_publish_to_a_queue_of_its_own_exchange_is_left_alone(
    redis_url: str, redis_client: redis.Redis, kind: str
) -> None:
    """A reviewer: with the free queue not declared, the route check could not tell, and a
    topic or fanout queue's publish was moved to reserved during a rollback."""
    close_in_redis(redis_client)
    app = publisher(redis_url, {"audit.*": {"queue": "events", "routing_key": "events.audit"}})
    app.conf.task_queues = [Queue("celery"),
                            Queue("events", Exchange("events", type=kind), "events.#")]  # fmt: skip
    with app.connection_for_write() as connection:
        app.conf.task_queues[1](connection.default_channel).declare()
    app.send_task("audit.write", (1,))
    assert [m["headers"]["task"] for m in queue_messages(redis_client, "events")] == ["audit.write"]
    assert redis_client.llen("reserved") == 0


def test_a_queue_on_frees_exchange_with_another_exchange_type_is_not_sent_to_free_closed(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A reviewer: ``exchange_type`` (which Celery reads before the queue's own) sent a queue
    bound to free's exchange and key there, past the check's quick answer for direct queues."""
    close_in_redis(redis_client)
    app = publisher(redis_url, {})
    tap = Queue("tap", Exchange("free"), routing_key="free")
    app.conf.task_queues = [Queue("celery"), Queue("free", Exchange("free"), "free"), tap]
    with app.connection_for_write() as connection:
        for queue in app.conf.task_queues:
            queue(connection.default_channel).declare()
    app.send_task("unknown.x", (1,), queue=tap, exchange_type="topic")
    assert redis_client.llen("free") == 0 and redis_client.llen("tap") == 0
    assert [m["headers"]["task"] for m in queue_messages(redis_client, "reserved")] == ["unknown.x"]
