"""What a caller hands ``apply_async`` that the gate cannot take as it is.

Each publish here still goes out (Celery alone would publish it), to reserved when the gate
cannot decide it, with one decision line saying why; none is admitted under an attempt, a
deadline or an id that a run or the gate's own Redis could not match.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import redis

import gatekeeper.celery.hook
from gatekeeper.redis.keys import WAITING_PAD, Keys
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import gate_settings, queue_messages, running_worker, wait_until

pytestmark = pytest.mark.celery
KEYS = Keys()
QUEUES = ("free", "defer", "reserved")

NO_ATTEMPT: list[dict[str, Any]] = [
    {"retries": -1}, {"retries": 10**9 - 1}, {"retries": 10**12},
    {"headers": {"retries": 10**40}}, {"headers": {"retries": "3"}},
    {"headers": {"retries": [1]}}, {"headers": {"retries": 1e300}},
    {"headers": {"retries": 1.0}}, {"headers": {"retries": True}},
]  # fmt: skip
"""``retries`` the worker reads no attempt of the gate's from: negative, ``10**9 - 1`` and
above (attempt ``10**9``), anything but a plain ``int``."""


def lengths(client: redis.Redis) -> dict[str, int]:
    return {queue: client.llen(queue) for queue in QUEUES}


def decision_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "event=gate_decision" in line]


def rows(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for key in client.scan_iter(match=f"{KEYS.base}:window:*:rows")
            for raw in client.lrange(key, 0, -1)]  # fmt: skip


@pytest.mark.parametrize("fast_publish", ["on", "off"])
@pytest.mark.parametrize("options", NO_ATTEMPT)
def test_retries_no_attempt_is_counted_from_is_a_bad_input_with_no_record(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str],
    options: dict[str, Any], fast_publish: str,
) -> None:  # fmt: skip
    app = create_app(gate_settings(redis_url, fast_publish=fast_publish), redis_url)
    app.tasks["tests.embed"].apply_async((1,), **options)
    assert lengths(redis_client) == {"free": 0, "defer": 0, "reserved": 1}
    (line,) = decision_lines(capsys)
    assert "reason=bad_input" in line and "field=retries" in line, line
    (message,) = queue_messages(redis_client, "reserved")
    assert "gatekeeper_attempt" not in message["headers"]  # it claims no attempt
    assert "gatekeeper_nonce" not in message["headers"]
    assert not list(redis_client.scan_iter(match=f"{KEYS.base}:run:*"))
    assert set(redis_client.zrange(KEYS.free_waiting, 0, -1)) <= {WAITING_PAD.encode()}
    assert not redis_client.hgetall(KEYS.inflight)


def test_a_bad_retries_decision_record_names_no_attempt(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: its decision record named attempt 1, one never counted, which `tune` could
    # take for a real attempt 1 of the job (its outcome, its slack miss).
    app = create_app(gate_settings(redis_url), redis_url)
    job = app.tasks["tests.embed"].apply_async((1,), retries=-1).id
    (entry,) = redis_client.xrange(KEYS.decisions)
    assert entry[1][b"j"].decode() == f"{job}:0"  # attempt 0: none has it


def test_a_run_of_retries_minus_one_holds_nothing_on_the_free_queue(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Once admitted to free as attempt 0 (read back as attempt 1 by the worker): no row, and
    # its wait held in free:waiting until the horizon made the free queue look old.
    app = create_app(gate_settings(redis_url, max_queue_age_s=1), redis_url)
    app.tasks["tests.embed"].apply_async((1,), retries=-1)
    with running_worker(redis_url, tmp_path / "w.log", queues="free,reserved"):
        assert wait_until(lambda: redis_client.llen(RUNS_KEY) == 1)
        time.sleep(1.5)  # older than max_queue_age_s, had it been held
    assert rows(redis_client) == [] and not redis_client.hget(KEYS.stats, "forged_runs")
    app.tasks["tests.embed"].delay(2)
    assert lengths(redis_client) == {"free": 1, "defer": 0, "reserved": 0}


@pytest.mark.parametrize("fast_publish", ["on", "off"])
@pytest.mark.parametrize(
    ("declared", "field"),
    [({"deadline_s": math.inf}, "deadline_s"), ({"deadline_at": -math.inf}, "deadline_at"),
     ({"deadline_s": "inf"}, "deadline_s")],
)  # fmt: skip
def test_an_infinite_declared_deadline_is_a_bad_input_naming_its_field(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str],
    declared: dict[str, Any], field: str, fast_publish: str,
) -> None:  # fmt: skip
    # Once an OverflowError in the gate's record (round(inf * 1000)): gate_error, unstamped.
    app = create_app(gate_settings(redis_url, fast_publish=fast_publish), redis_url)

    @app.task(name="tests.forever", shared=False, max_retries=1,
              gatekeeper={"expected_service_s": 1, "tokens_in": 1, **declared})  # fmt: skip
    def forever() -> None: ...

    app.tasks["tests.forever"].delay()
    assert lengths(redis_client) == {"free": 0, "defer": 0, "reserved": 1}
    (line,) = decision_lines(capsys)
    assert "reason=bad_input" in line and f"field={field}" in line, line
    (message,) = queue_messages(redis_client, "reserved")
    assert "gatekeeper_deadline_at" not in message["headers"]
    assert message["headers"]["gatekeeper_attempt"] == 1  # its run's unverified row


@pytest.mark.parametrize("fast_publish", ["on", "off"])
def test_headers_as_key_value_pairs_are_taken_as_celery_takes_them(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str],
    fast_publish: str,
) -> None:  # fmt: skip
    # Celery's sender merges them with dict.update; the hook once raised TypeError merging
    # them with ** (and on the ordinary path, after the gate had admitted the task).
    app = create_app(gate_settings(redis_url, fast_publish=fast_publish), redis_url)
    job = app.tasks["tests.embed"].apply_async((1,), headers=[("x-trace", "abc")]).id
    assert lengths(redis_client) == {"free": 1, "defer": 0, "reserved": 0}
    (message,) = queue_messages(redis_client, "free")
    assert (message["headers"]["id"], message["headers"]["x-trace"]) == (job, "abc")
    (line,) = decision_lines(capsys)
    assert "decision=admit_free" in line


def test_an_admission_whose_message_cannot_be_addressed_is_given_back(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ordinary path: the gate admits, then the publish fails before the broker has it.
    app = create_app(gate_settings(redis_url, fast_publish="off"), redis_url)

    def unaddressable(*_: Any, **__: Any) -> None:
        raise TypeError("cannot address this message")

    monkeypatch.setattr(gatekeeper.celery.hook, "address", unaddressable)
    with pytest.raises(TypeError, match="cannot address"):
        app.tasks["tests.embed"].delay(1)
    assert lengths(redis_client) == {"free": 0, "defer": 0, "reserved": 0}
    assert not redis_client.hgetall(KEYS.inflight)
    assert set(redis_client.zrange(KEYS.free_waiting, 0, -1)) <= {WAITING_PAD.encode()}


@pytest.mark.parametrize("fast_publish", ["auto", "on", "off"])
def test_a_task_id_redis_cannot_be_sent_fails_closed_through_celerys_own_sender(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str],
    fast_publish: str,
) -> None:  # fmt: skip
    # A file name decoded with surrogateescape (Celery publishes it: its JSON escapes it).
    # Fast publish once raised UnicodeEncodeError from the gate's call and its fallback push:
    # no message, no decision line.
    job = "embed-" + b"caf\xe9.txt".decode("utf-8", "surrogateescape")
    app = create_app(gate_settings(redis_url, fast_publish=fast_publish), redis_url)
    app.tasks["tests.embed"].apply_async((1,), task_id=job)
    assert lengths(redis_client) == {"free": 0, "defer": 0, "reserved": 1}
    (message,) = queue_messages(redis_client, "reserved")
    assert message["headers"]["id"] == job
    (line,) = decision_lines(capsys)
    assert "reason=gate_error" in line and "UnicodeEncodeError" in line, line
    app.tasks["tests.embed"].delay(2)  # the gate's connection is as good as before
    assert lengths(redis_client) == {"free": 1, "defer": 0, "reserved": 1}
