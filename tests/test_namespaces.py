"""Two namespaces on one Redis (one per team, the README's way to share a gate Redis): each has
its own state marker, flags and budget; nothing one does is seen by the other."""

from __future__ import annotations

import time

import redis

from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, initialised, queue_messages

TEAMS = ("team-a", "team-b")


def reasons(client: redis.Redis) -> dict[str, list[str]]:
    """Each queue's messages as ``<task id>:<reason>``, oldest first."""
    return {queue: [f"{m['headers']['id']}:{m['headers']['gatekeeper_reason']}"
                    for m in queue_messages(client, queue)]
            for queue in ("free", "reserved")}  # fmt: skip


def test_two_namespaces_on_one_redis_keep_their_state_flags_and_budgets_apart(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # One admission's reservation (100 tokens, 10 for 0.1 s of wait) fits a budget of 150: the
    # second in one namespace is refused, whatever the other namespace holds.
    apps = {team: create_app(gate_settings(redis_url, namespace=team, budget_units=150,
                                           free_wait_allowance_s=0.1,
                                           queue_wait_unit_per_second=100), redis_url)
            for team in TEAMS}  # fmt: skip
    embed = {team: apps[team].tasks["tests.embed"] for team in TEAMS}
    initialised(redis_client, Keys(namespace="team-a"))  # team-b never initialised
    embed["team-a"].apply_async((1,), task_id="a1")
    embed["team-b"].apply_async((1,), task_id="b1")
    initialised(redis_client, Keys(namespace="team-b"))
    time.sleep(0.3)  # past flag_cache_s (0.2): team-b's publisher reads the marker again
    embed["team-b"].apply_async((2,), task_id="b2")
    embed["team-a"].apply_async((2,), task_id="a2")  # team-a's budget is held by a1
    flags = FlagStore(redis_client, gate_settings(redis_url), Keys(namespace="team-b"))
    flags.set("free_path_enabled", "false", "team-b rolls back", "test", time.time())
    time.sleep(0.3)  # past flag_cache_s (0.2): team-b's publisher reads the flag
    embed["team-b"].apply_async((3,), task_id="b3")
    assert reasons(redis_client) == {
        "free": ["a1:fits", "b2:fits"],
        "reserved": ["b1:state_missing", "a2:retry_tax_budget", "b3:free_path_disabled"],
    }
    assert redis_client.hget(Keys().flags, "free_path_enabled") is None  # default untouched
    for team in TEAMS:
        assert redis_client.hlen(Keys(namespace=team).inflight) == 1
