"""A task abandoned to the dead letter ends in the result backend: ``AsyncResult.get()`` raises
:class:`~gatekeeper.errors.DeadlineAbandoned`, a chord with it fails and calls its error
callback (the replayer knows the app: ``gatekeeper -A proj replay``)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis
from celery import Celery, chord
from celery.exceptions import ChordError
from celery.result import AsyncResult
from click.testing import CliRunner

from gatekeeper.celery.replay import Replayer
from gatekeeper.errors import DeadlineAbandoned
from gatekeeper.ops.cli import main
from gatekeeper.redis.keys import Keys
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, queue_messages, unused_port
from tests.test_replay import replay_once
from tests.test_replay_batch import moves_refused
from tests.test_replay_strikes import scored_by_a_killed_pass

pytestmark = pytest.mark.celery
KEYS = Keys()
SOON = {"gatekeeper_deadline_s": 1, "gatekeeper_expected_service_s": 0}
"""Deferred (a service time of 0 cannot be scored), and its deadline gone a second later."""


def with_results(redis_url: str) -> tuple[Any, Celery]:
    """The test's settings and a gated app that keeps results in the test's Redis."""
    settings = gate_settings(redis_url)
    app = create_app(settings, redis_url)
    app.conf.result_backend = redis_url
    return settings, app


def test_an_abandoned_task_and_its_chord_end_in_the_backend(
    redis_url: str, redis_client: redis.Redis
) -> None:
    settings, app = with_results(redis_url)
    embed, plain = app.tasks["tests.embed"], app.tasks["tests.plain"]
    alone = embed.apply_async((1,), headers=SOON)
    body = plain.si().on_error(plain.si())
    together = chord([embed.s(2).set(headers=SOON)], body).apply_async()
    assert len(queue_messages(redis_client, "defer")) == 2
    time.sleep(1.2)
    replayer = Replayer(settings, broker=redis_client, gate=redis_client, app=app)
    assert replayer.run(threading.Event(), once=True)["dead_lettered"] == 2
    with pytest.raises(DeadlineAbandoned, match="abandoned: its deadline"):
        alone.get(timeout=10)
    with pytest.raises((ChordError, DeadlineAbandoned)):  # the chord ends, as failed
        together.get(timeout=10)
    # The chord's error callback was called: its task is published to the app's own queue.
    callbacks = [m["headers"]["task"] for m in queue_messages(redis_client, "celery")]
    assert callbacks == ["tests.plain"]


def test_without_the_app_the_dead_letter_still_works_and_says_no_result(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = gate_settings(redis_url)
    app = create_app(settings, redis_url)
    app.tasks["tests.embed"].apply_async((1,), headers=SOON)
    time.sleep(1.2)
    replayer = Replayer(settings, broker=redis_client, gate=redis_client)
    assert replayer.run(threading.Event(), once=True)["dead_lettered"] == 1
    assert len(queue_messages(redis_client, "dead_letter")) == 1
    assert "result=no_app" in capsys.readouterr().err


def test_a_result_backend_that_is_down_hides_no_abandonment_alert(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # The backend's error was raised before the alerts: the task went to the dead letter with
    # no task_abandoned line (nor a slack miss, nor the freeze check) and counted as a replay
    # error (a reviewer). The alerts come first now, saying the result was not stored.
    settings = gate_settings(redis_url)
    create_app(settings, redis_url).tasks["tests.embed"].apply_async((1,), headers=SOON)
    app = create_app(settings, redis_url)  # the replayer's, whose backend is down
    app.conf.result_backend = f"redis://127.0.0.1:{unused_port()}/0"  # nothing listens
    time.sleep(1.2)
    replayer = Replayer(settings, broker=redis_client, gate=redis_client, app=app)
    assert dict(replayer.run(threading.Event(), once=True)) == {"dead_lettered": 1}
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "event=task_abandoned" in ln]
    assert 'result="not_stored: ' in line, line
    assert len(queue_messages(redis_client, "dead_letter")) == 1


def dead_lettered(redis_url: str, client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> str:
    """One gated task abandoned to the dead letter by the replayer, and the publisher's
    settings set for the CLI; returns its id."""
    settings = gate_settings(redis_url)
    app = create_app(settings, redis_url)
    deferred = app.tasks["tests.embed"].apply_async((2,), headers=SOON).id
    time.sleep(1.2)
    Replayer(settings, broker=client, gate=client).run(threading.Event(), once=True)
    cli_settings(redis_url, monkeypatch)
    return str(deferred)


def cli_settings(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The publisher's settings (gate_settings'), for the CLI."""
    for name, value in (("REDIS_URL", redis_url), ("DWELL_GATE_ENABLED", "true"),
                        ("CANARY_PERCENT", "100")):  # fmt: skip
        monkeypatch.setenv(f"GATEKEEPER_{name}", value)


def test_dead_letters_are_listed_and_one_requeued_with_a_new_deadline(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    deferred = dead_lettered(redis_url, redis_client, monkeypatch)
    listed = CliRunner().invoke(main, ["dead-letter", "list"])
    assert listed.exit_code == 0 and f"job_id={deferred} " in listed.output
    assert "dead_lettered=1" in listed.output
    requeue = ["dead-letter", "requeue", deferred, "--deadline-s", "120"]
    done = CliRunner().invoke(main, requeue)
    assert done.exit_code == 0, done.output
    # Scored again with its new deadline: its service time of 0 still cannot be scored, so
    # the gate defers it, now with two minutes to go.
    assert "to defer (reason bad_service_guess" in done.output
    (again,) = queue_messages(redis_client, "defer")
    assert again["headers"]["id"] == deferred
    assert again["headers"]["gatekeeper_deadline_at"] > time.time() + 100
    assert redis_client.llen("dead_letter") == 0  # moved, not copied
    gone = CliRunner().invoke(main, requeue)
    assert gone.exit_code != 0 and "no task" in gone.output


def test_a_forged_dead_message_does_not_end_another_jobs_result(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A caller puts a message in defer that names a real job's id, with a passed deadline:
    it goes to the dead letters, but the real job's result is left alone."""
    settings, app = with_results(redis_url)
    real = app.tasks["tests.embed"].apply_async((1,))  # admitted to free, still waiting
    forged = dict(queue_messages(redis_client, "free")[0])
    forged["headers"] = {**forged["headers"], "gatekeeper_deadline_at": time.time() - 5,
                         "gatekeeper_nonce": "made-up"}  # fmt: skip
    redis_client.lpush("defer", json.dumps(forged))
    replayer = Replayer(settings, broker=redis_client, gate=redis_client, app=app)
    assert replayer.run(threading.Event(), once=True)["dead_lettered"] == 1
    assert real.state == "PENDING"  # not marked failed by the forgery


def test_an_abandonment_given_back_and_done_again_ends_the_task_once(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first pass stores the failure, then its move to the dead letters is refused (its
    # tenure over): the message is given back, and the next pass abandons it again. Stored
    # again, its link_error callback would be published twice (and a chord counted twice).
    settings, app = with_results(redis_url)
    plain = app.tasks["tests.plain"]
    result = app.tasks["tests.embed"].apply_async((1,), headers=SOON, link_error=plain.si())
    time.sleep(1.2)
    moves_back = moves_refused(monkeypatch, redis_client)
    first = Replayer(settings, broker=redis_client, gate=redis_client, app=app)
    assert first.run(threading.Event(), once=True)["given_back"] == 1
    moves_back()
    again = Replayer(settings, broker=redis_client, gate=redis_client, app=app)
    assert again.run(threading.Event(), once=True)["dead_lettered"] == 1
    assert len(queue_messages(redis_client, "dead_letter")) == 1
    with pytest.raises(DeadlineAbandoned):
        result.get(timeout=10)
    errbacks = [m["headers"]["task"] for m in queue_messages(redis_client, "celery")]
    assert errbacks == ["tests.plain"]


def test_an_abandoned_task_whose_id_failed_before_still_ends_abandoned(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A caller's own stable id (a nightly job's), whose earlier run failed: today's run,
    # abandoned, is stored as abandoned and its errback called; only this very abandonment
    # stored already is left alone.
    settings, app = with_results(redis_url)
    app.backend.mark_as_failure("nightly-report", RuntimeError("yesterday's run failed"))
    plain = app.tasks["tests.plain"]
    result = app.tasks["tests.embed"].apply_async((1,), headers=SOON, task_id="nightly-report",
                                                  link_error=plain.si())  # fmt: skip
    time.sleep(1.2)
    replayer = Replayer(settings, broker=redis_client, gate=redis_client, app=app)
    assert replayer.run(threading.Event(), once=True)["dead_lettered"] == 1
    with pytest.raises(DeadlineAbandoned):
        result.get(timeout=10)
    errbacks = [m["headers"]["task"] for m in queue_messages(redis_client, "celery")]
    assert errbacks == ["tests.plain"]


def test_a_requeue_says_the_deadline_it_moved_whatever_the_gate_decided(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one place a deadline is ever moved logs it (job, old and new deadline, who), even
    where the gate is off and no decision line is written."""
    deferred = dead_lettered(redis_url, redis_client, monkeypatch)
    monkeypatch.setenv("GATEKEEPER_DWELL_GATE_ENABLED", "false")  # gate_disabled: no line
    done = CliRunner().invoke(main, ["dead-letter", "requeue", deferred, "--deadline-s", "600"])
    assert done.exit_code == 0, done.output
    assert "reason gate_disabled" in done.output
    (line,) = [line for line in done.output.splitlines() if "event=deadline_moved" in line]
    assert f"job_id={deferred}" in line and "level=warning" in line
    assert "deadline_at=" in line and " was=" in line and " actor=" in line


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5"])
def test_a_requeue_refuses_a_deadline_that_is_not_a_positive_finite_number(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # `--deadline-s inf` was taken (a deadline never reached) and printed "deadline in inf s".
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["dead-letter", "requeue", "job", "--deadline-s", value])
    assert result.exit_code == 2, result.output
    assert "--deadline-s" in result.output and "positive, finite" in result.output


def test_a_copy_with_the_records_old_nonce_and_a_deadline_made_past_ends_no_live_job(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A reviewer: a pass scored a deferred message and died before its handoff; someone who
    # saw the message put a copy of it in defer, its deadline made past. Taken as the
    # record's own (scored, never handed on), it was abandoned as the job's end: its failure
    # stored in the backend and the attempt ended, while the job's own message, back, ran.
    settings = gate_settings(redis_url, max_queue_age_s=1.0)
    app = create_app(settings, redis_url)
    app.conf.result_backend = redis_url
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})
    job = app.tasks["tests.embed"].apply_async((1,)).id
    redis_client.zrem(KEYS.free_waiting, "stale:1")
    first = Replayer(settings, broker=redis_client, gate=redis_client)
    assert scored_by_a_killed_pass(first, redis_client, redis_client) == "free"
    original = redis_client.rpop("defer")
    forged = json.loads(original)
    forged["headers"]["gatekeeper_deadline_at"] = time.time() - 1
    redis_client.lpush("defer", json.dumps(forged))
    replayer = Replayer(settings, broker=redis_client, gate=redis_client, app=app)
    assert dict(replayer.run(threading.Event(), once=True)) == {"dead_lettered": 1}
    assert AsyncResult(job, app=app).state == "PENDING"
    assert redis_client.hget(KEYS.run(job, 1), "abandoned") is None
    redis_client.lpush("defer", original)  # the job's own message comes back
    assert replay_once(redis_url, redis_client, max_queue_age_s=1.0) == {"to_free": 1}
