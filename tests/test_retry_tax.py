"""The retry tax a publish is priced at: the retries ``max_retries`` still leaves, times the
service time; with ``max_retries=None`` (Celery's "retry forever") there is no count to take
and the tax is 0 (README, "Gating an existing task"), on the ordinary path and fast publish."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

import gatekeeper
from tests.conftest import gate_settings, queue_messages
from tests.test_publish_gate import reads_of

PATHS = [("off", "ordinary"), ("auto", "fast")]
"""fast_publish, and the path a publish on the gate's own Redis then takes."""


ROUND_TRIPS = {"ordinary": 2, "fast": 1}
"""A warm gated publish's round trips: the gate script, then kombu's push; or fast publish's
one, ``gate.lua`` deciding and pushing together."""


def decision_line(err: str, job_id: str) -> str:
    (line,) = [ln for ln in err.splitlines() if "event=gate_decision" in ln and job_id in ln]
    return line


@pytest.mark.parametrize(("fast_publish", "path"), PATHS)
def test_a_task_that_retries_forever_pays_no_retry_tax(
    redis_url: str,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    fast_publish: str,
    path: str,
) -> None:
    app = Celery("forever", broker=redis_url)  # the broker is the gate's Redis
    spec: dict[str, Any] = {"expected_service_s": 8, "tokens_in": 1200, "deadline_s": 90}

    @gatekeeper.gated(**spec)
    @app.task(bind=True, name="forever.embed", max_retries=None, shared=False)
    def forever(self: Any, chunk: int) -> int:
        return chunk

    @gatekeeper.gated(**spec)
    @app.task(bind=True, name="counted.embed", max_retries=2, shared=False)
    def counted(self: Any, chunk: int) -> int:
        return chunk

    gatekeeper.install(
        app, gate_settings(redis_url, fast_publish=fast_publish, flag_cache_s=60, budget_units=1e9)
    )
    assert forever.max_retries is None
    for task in (forever, counted):
        task.delay(0)  # connections, queues, script and flags warm
    taxes = {}
    for task in (forever, counted):
        sent: list[str] = []
        trips = reads_of(redis_client, lambda t=task, ids=sent: ids.append(t.delay(1).id))
        assert trips == ROUND_TRIPS[path]  # the path the parameter names was taken
        job_id = sent[-1]  # reads_of publishes again when a connection came or went meanwhile
        line = decision_line(capsys.readouterr().err, job_id)
        assert "decision=admit_free reason=fits" in line
        taxes[task.name] = next(f for f in line.split() if f.startswith("retry_tax_s="))
    # 2 retries left x 8 s for the counted task; nothing to count for the one that retries forever.
    assert taxes == {"forever.embed": "retry_tax_s=0.0", "counted.embed": "retry_tax_s=16.0"}
    assert len(queue_messages(redis_client, "free")) >= 4


def test_each_retry_is_taxed_for_the_retries_it_still_has(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """Attempt 2 of a task with ``max_retries=2`` has one retry left: half its first
    attempt's tax; its last attempt none (as Celery's ``Task.retry`` publishes it, with the
    ``retries`` it has had)."""
    app = Celery("retried", broker=redis_url)

    @gatekeeper.gated(expected_service_s=8, tokens_in=1200, deadline_s=90)
    @app.task(bind=True, name="retried.embed", max_retries=2, shared=False)
    def embed(self: Any, chunk: int) -> int:
        return chunk

    gatekeeper.install(app, gate_settings(redis_url, budget_units=1e9))
    taxes = []
    for retries in (0, 1, 2):
        job_id = embed.apply_async((retries,), retries=retries).id
        line = decision_line(capsys.readouterr().err, job_id)
        assert f"attempt={retries + 1} " in line and "decision=admit_free" in line
        taxes.append(next(f for f in line.split() if f.startswith("retry_tax_s=")))
    assert taxes == ["retry_tax_s=16.0", "retry_tax_s=8.0", "retry_tax_s=0.0"]
    assert len(queue_messages(redis_client, "free")) == 3
