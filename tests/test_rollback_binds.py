"""``free_path_enabled=false`` binds every gated task: inside or outside the canary, gate on
or off (SPEC section 4). A gated task left on its normal route keeps it, unless that route is
the free queue: then it goes to reserved."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from gatekeeper.redis.flags import in_canary
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, queue_messages


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
