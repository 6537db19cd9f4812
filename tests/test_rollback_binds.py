"""``free_path_enabled=false`` binds every gated task: inside or outside the canary, gate on
or off (SPEC section 4). A gated task left on its normal route keeps it, unless that route is
the free queue: then it goes to reserved."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

import gatekeeper
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
