"""Each rule of the decision order, end to end: a real worker consumes only ``free``.

For every rule a witness task that the gate admits runs on the worker, and the task under
test is then found in its queue in the broker, never run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from click.testing import CliRunner

from gatekeeper.core.ledger import window_id
from gatekeeper.ops.cli import main
from gatekeeper.redis.flags import in_canary
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.store import GateStore
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.calls import gate_call
from tests.conftest import gate_settings, queue_messages, running_worker, wait_until

pytestmark = pytest.mark.celery


@pytest.fixture(scope="module")
def free_worker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with running_worker(redis_url, log, queues="free"):
        yield log


def ran_ids(client: redis.Redis) -> set[str]:
    return {json.loads(raw)["id"] for raw in client.lrange(RUNS_KEY, 0, -1)}


def in_queue(client: redis.Redis, queue: str) -> dict[str, str]:
    """job id -> the reason in its gatekeeper headers, for every message in a queue."""
    return {
        m["headers"]["id"]: m["headers"].get("gatekeeper_reason", "")
        for m in queue_messages(client, queue)
    }


def witness_runs(app: Celery, client: redis.Redis) -> str:
    job: str = app.tasks["tests.embed"].delay("witness").id
    assert wait_until(lambda: job in ran_ids(client)), "the admitted witness never ran"
    return job


def h(**headers: Any) -> dict[str, Any]:
    """apply_async options carrying per-call overrides: h(deadline_s=1) -> gatekeeper_deadline_s."""
    return {"headers": {f"gatekeeper_{name}": value for name, value in headers.items()}}


# name, settings overrides, apply_async options, queue it must sit in, reason
RULES: list[tuple[str, dict[str, Any], dict[str, Any], str, str]] = [
    ("dwell over slack", {}, h(deadline_s=1.5), "reserved", "dwell_over_slack"),
    ("bad service guess", {}, h(expected_service_s=0), "defer", "bad_service_guess"),
    ("deadline passed", {}, h(deadline_at=1.0), "defer", "deadline_passed"),
    ("bad declared input", {}, h(tokens_in=-1), "reserved", "bad_input"),
    ("budget exceeded", {"budget_units": 2150}, {}, "reserved", "retry_tax_budget"),
    (
        "free path off in settings",
        {"free_path_enabled": False},
        {},
        "reserved",
        "free_path_disabled",
    ),
    ("gate disabled", {"dwell_gate_enabled": False}, {}, "celery", ""),
]


@pytest.mark.parametrize(
    ("overrides", "options", "queue", "reason"),
    [case[1:] for case in RULES],
    ids=[case[0] for case in RULES],
)
def test_rule_sends_the_task_to_its_queue_while_free_work_runs(
    free_worker: Path,
    redis_url: str,
    redis_client: redis.Redis,
    overrides: dict[str, Any],
    options: dict[str, Any],
    queue: str,
    reason: str,
) -> None:
    witness_app = create_app(gate_settings(redis_url), redis_url)
    app = create_app(gate_settings(redis_url, **overrides), redis_url)
    if overrides.get("budget_units"):
        # Reserves 100 tokens and the 10 s wait allowance (2,000): 2,100 of 2,150 units. An
        # admission with no message: one in free was run (and its reservation closed) by the
        # free worker before the task under test was published, on a slow CI run.
        settings = gate_settings(redis_url, **overrides)
        now = time.time()
        held = GateStore(redis_client, Keys()).score(gate_call(
            now, window_id=window_id(now, settings.window_seconds), job_id="uses-the-budget",
            tokens_in=100, budget_units=settings.budget_units,
            queue_wait_unit_per_second=settings.queue_wait_unit_per_second,
            wait_allowance_s=settings.free_wait_allowance_s))  # fmt: skip
        assert held.decision.value == "admit_free"
    job = app.tasks["tests.embed"].apply_async(("under test",), **options).id
    witness_runs(witness_app, redis_client)
    assert in_queue(redis_client, queue) == {job: reason}
    assert job not in ran_ids(redis_client)


def test_age_cap_defers_when_the_free_queue_backs_up(
    free_worker: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    app = create_app(gate_settings(redis_url, max_queue_age_s=0.3), redis_url)
    embed = app.tasks["tests.embed"]
    # Occupies the worker while the rest is published and decided (5 s: room on a loaded VM).
    busy = embed.apply_async(("busy",), kwargs={"sleep_s": 5.0}).id
    assert wait_until(lambda: busy in ran_ids(redis_client))
    waiting = [embed.delay(n).id for n in range(2)]  # admitted, not started yet
    time.sleep(0.5)
    job = embed.delay("late").id
    assert in_queue(redis_client, "defer") == {job: "queue_age_cap"}
    assert wait_until(lambda: set(waiting) <= ran_ids(redis_client))
    assert job not in ran_ids(redis_client)


def test_free_path_disabled_with_the_cli_is_obeyed_within_the_cache_time(
    free_worker: Path, redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(gate_settings(redis_url, flag_cache_s=1.0), redis_url)
    embed = app.tasks["tests.embed"]
    before = embed.delay("before").id
    assert wait_until(lambda: before in ran_ids(redis_client))
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    args = ["flags", "set", "free_path_enabled", "false", "--reason", "rollback drill"]
    assert CliRunner().invoke(main, args).exit_code == 0
    time.sleep(1.1)
    after = embed.delay("after").id
    assert in_queue(redis_client, "reserved") == {after: "free_path_disabled"}
    time.sleep(0.5)
    assert after not in ran_ids(redis_client)


def test_only_the_canary_slice_is_scored(
    free_worker: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    # A budget no slice can spend: with the default one, more than about 7 admissions in the
    # slice (random ids) sent the next to reserved (retry_tax_budget), where nothing runs.
    settings = gate_settings(redis_url, canary_percent=30, budget_units=10**9)
    app = create_app(settings, redis_url)
    ids = [app.tasks["tests.embed"].delay(n).id for n in range(20)]
    inside = {job for job in ids if in_canary(job, 30)}
    assert wait_until(lambda: inside <= ran_ids(redis_client))
    assert set(in_queue(redis_client, "celery")) == set(ids) - inside
    assert inside and set(ids) - inside


def test_an_explicit_queue_is_overridden_and_the_task_runs_on_free(
    free_worker: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    app = create_app(gate_settings(redis_url), redis_url)
    job = app.tasks["tests.embed"].apply_async(("x",), queue="reserved").id
    assert wait_until(lambda: job in ran_ids(redis_client))
    assert redis_client.llen("reserved") == 0
