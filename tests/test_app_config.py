"""Gatekeeper configured from the Celery app: ``app.conf.gatekeeper_*`` (Django's
``CELERY_GATEKEEPER_*``), read when first needed; an eager app never needs Redis; the
``celery -A proj gatekeeper`` command."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import redis
from amqp.exceptions import NotFound
from celery import Celery
from kombu import Queue

import gatekeeper
from gatekeeper.celery.broker import broker_for
from gatekeeper.errors import BadDeclaredInput, ConfigError, DeadlineAbandoned
from gatekeeper.redis.keys import Keys
from tests.apps.conf_app import create_app
from tests.conftest import REPO_ROOT, queue_messages, wait_until

pytestmark = pytest.mark.celery
KEYS = Keys()


def env_for(redis_url: str) -> dict[str, str]:
    """A process with no GATEKEEPER_* variable: everything comes from the app's config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEKEEPER_")}
    env.update(CONF_APP_REDIS_URL=redis_url, PYTHONPATH=str(REPO_ROOT))
    return env


def run(redis_url: str, *command: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], env={**env_for(redis_url), **env},
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip


@contextmanager
def conf_worker(redis_url: str, log: Path) -> Iterator[None]:
    name = f"conf-{time.monotonic_ns()}@%h"
    command = [sys.executable, "-m", "celery", "-A", "tests.apps.conf_app", "worker", "-Q",
               "free", "-P", "prefork", "-c", "1", "-l", "INFO", "--without-heartbeat",
               "--without-gossip", "--without-mingle", "-n", name]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env=env_for(redis_url), cwd=REPO_ROOT)  # fmt: skip
    try:
        assert wait_until(lambda: b"ready." in log.read_bytes(), timeout_s=60), log.read_text()
        yield
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_an_app_configured_django_style_gates_defers_replays_and_writes_its_ledger(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = create_app(redis_url)  # installed before its config was loaded, like Django's
    embed = app.tasks["conf.embed"]
    first = embed.delay(1).id
    assert [m["headers"]["gatekeeper_reason"] for m in queue_messages(redis_client, "free")] == [
        "fits"
    ]
    time.sleep(0.6)  # older than the app's age cap (CELERY_GATEKEEPER_MAX_QUEUE_AGE_S)
    second = embed.delay(2).id
    (deferred,) = queue_messages(redis_client, "defer")
    assert deferred["headers"]["gatekeeper_reason"] == "queue_age_cap"
    with conf_worker(redis_url, tmp_path / "w.log"):
        assert wait_until(lambda: redis_client.hget(KEYS.run(first, 1), "rowed") == b"1")
        replayed = run(redis_url, "gatekeeper", "-A", "tests.apps.conf_app:app", "replay",
                       "--once")  # fmt: skip
        assert replayed.returncode == 0, replayed.stderr
        assert "to_free=1" in replayed.stdout
        assert wait_until(lambda: redis_client.hget(KEYS.run(second, 1), "rowed") == b"1")
    pattern = KEYS.window_rows(0).replace(":0:", ":*:")
    rows = [raw for key in redis_client.scan_iter(match=pattern)
            for raw in redis_client.lrange(key, 0, -1)]  # fmt: skip
    assert len(rows) == 2  # both ran on free, one row each


def test_the_celery_command_reads_the_apps_config(
    redis_url: str, redis_client: redis.Redis
) -> None:
    status = run(redis_url, "celery", "-A", "tests.apps.conf_app", "gatekeeper", "status")
    assert status.returncode == 0, status.stderr
    assert "flag dwell_gate_enabled=true (settings)" in status.stdout  # the app's own setting
    assert "state=initialised" in status.stdout


def test_config_loaded_after_install_is_the_one_used(redis_url: str) -> None:
    app = Celery("late", broker="memory://")
    gate = gatekeeper.install(app)
    app.conf.gatekeeper_redis_url = redis_url
    app.conf.gatekeeper_canary_percent = 37
    assert gate.settings.canary_percent == 37 and gate.settings.redis_url == redis_url


@pytest.mark.parametrize("fast_publish", ["auto", "off"])
def test_celerys_own_settings_loaded_after_install_are_the_ones_its_publishes_use(
    redis_url: str, redis_client: redis.Redis, fast_publish: str
) -> None:
    # The Quick start's order: install, then config_from_object. Celery makes its task sender
    # from the config (serializer, delivery mode, queues), and binds a task to it (acks_late,
    # serializer) when the task is made: made at install, or at @gated, they had the defaults:
    # JSON, persistent, acks_late off, the app's own task_queues unknown to it.
    app = Celery("late")
    gatekeeper.install(app)
    assert not app.configured  # install read nothing

    @gatekeeper.gated(expected_service_s=0.2, tokens_in=10, deadline_s=120)
    @app.task(name="late.gated", max_retries=0, shared=False)
    def gated(chunk: Any) -> Any:
        return chunk

    @app.task(name="late.plain", shared=False)
    def plain(chunk: Any) -> Any:
        return chunk

    assert not app.configured  # nor did @gated: the task is made, and bound, when first used

    class Settings:
        CELERY_BROKER_URL = redis_url
        CELERY_TASK_SERIALIZER = "pickle"
        CELERY_ACCEPT_CONTENT = ("pickle",)
        CELERY_TASK_DEFAULT_DELIVERY_MODE = "transient"
        CELERY_TASK_ACKS_LATE = True
        CELERY_TASK_CREATE_MISSING_QUEUES = False
        CELERY_TASK_QUEUES = tuple(Queue(name) for name in ("celery", "free", "defer", "reserved"))
        CELERY_GATEKEEPER_DWELL_GATE_ENABLED = True
        CELERY_GATEKEEPER_CANARY_PERCENT = 100
        CELERY_GATEKEEPER_FAST_PUBLISH = fast_publish

    app.config_from_object(Settings, namespace="CELERY")
    plain.delay(1)
    gated.delay(2)
    assert set(app.amqp.queues) == {"celery", "free", "defer", "reserved"}
    assert gated.acks_late and plain.acks_late
    (ungated,) = queue_messages(redis_client, "celery")
    (admitted,) = queue_messages(redis_client, "free")
    assert admitted["headers"]["gatekeeper_reason"] == "fits"
    for message in (ungated, admitted):
        assert message["content-type"] == "application/x-python-serialize"
        assert message["properties"]["delivery_mode"] == 1


def test_a_bad_app_setting_raises_config_error_naming_the_key_at_the_first_gated_publish(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = Celery("misconfigured", broker=redis_url)
    gatekeeper.install(app)  # reads nothing: no error yet
    app.conf.gatekeeper_dwell_gate_enabled = True
    app.conf.gatekeeper_canary_percent = 150

    @gatekeeper.gated(expected_service_s=1, tokens_in=5, deadline_s=60)
    @app.task(name="misconfigured.embed", shared=False)
    def embed(x: int) -> int:
        return x

    @app.task(name="misconfigured.plain", shared=False)
    def plain(x: int) -> int:
        return x

    plain.delay(1)  # an ungated task is never touched, nor is the config read for it
    for _ in range(2):  # the first gated publish, and every one after it: never routed
        with pytest.raises(ConfigError) as caught:
            embed.delay(2)
        assert "app.conf.gatekeeper_canary_percent" in str(caught.value)
        assert "less than or equal to 100, got 150" in str(caught.value)
    assert [len(queue_messages(redis_client, q)) for q in ("celery", "free", "reserved")] == [
        1, 0, 0]  # fmt: skip


def test_a_worker_with_a_bad_setting_does_not_start_and_takes_no_task(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # README: "A bad value stops start-up with the variable's name and what was expected".
    # Read at the first task's signal instead, a worker ran with every signal logging a
    # traceback, and a gated task's retry raised in it: Celery rejected the message, lost.
    create_app(redis_url).tasks["conf.embed"].delay(1)  # a good publisher's task, in free
    assert redis_client.llen("free") == 1
    name = f"bad-{time.monotonic_ns()}@%h"
    done = run(redis_url, "celery", "-A", "tests.apps.conf_app", "worker", "-Q", "free", "-P",
               "solo", "-l", "INFO", "--without-heartbeat", "--without-gossip",
               "--without-mingle", "-n", name, GATEKEEPER_CANARY_PERCENT="150")  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "Error: gatekeeper: invalid settings: GATEKEEPER_CANARY_PERCENT" in said, said
    assert "less than or equal to 100, got '150'" in said and "Traceback" not in said, said
    assert redis_client.llen("free") == 1  # not taken: it waits for a worker that starts


def test_an_eager_app_with_no_redis_imports_and_runs_its_gated_tasks() -> None:
    app = Celery("eager")  # no broker, no GATEKEEPER_* variable, no gatekeeper_* key
    app.conf.task_always_eager = True
    gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=1, tokens_in=5, deadline_s=60)
    @app.task(name="eager.embed", shared=False)
    def embed(x: int) -> int:
        return x * 2

    assert embed.delay(21).get(timeout=5) == 42


@pytest.mark.servers
def test_on_rabbitmq_with_no_gate_redis_a_gated_publish_fails_closed_and_says_why(
    capsys: pytest.CaptureFixture[str], rabbitmq_url: str
) -> None:
    """RabbitMQ is never the gate's Redis: without ``gatekeeper_redis_url`` there is none.
    ``install`` does not fail; the gated publish goes to reserved (``gate_unavailable``),
    never to free, and an ``event=gate_unconfigured`` line says why."""
    app = Celery("rabbit_only", broker=rabbitmq_url)
    app.conf.gatekeeper_dwell_gate_enabled = True
    app.conf.gatekeeper_canary_percent = 100
    gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=1, tokens_in=5, deadline_s=60)
    @app.task(name="rabbit_only.embed", shared=False)
    def embed(x: int) -> int:
        return x

    job = embed.delay(1).id  # published, not raised; the gate would admit it
    with app.connection_for_read() as connection:
        message = connection.SimpleQueue("reserved").get(timeout=5)
        assert (message.headers["id"], message.headers["gatekeeper_reason"]) == (
            job, "gate_unavailable")  # fmt: skip
        message.ack()
        for queue in ("free", "defer"):  # empty, or never declared at all
            with connection.channel() as channel, suppress(NotFound):
                assert not channel.queue_declare(queue, passive=True).message_count
    err = capsys.readouterr().err
    unconfigured = next(line for line in err.splitlines() if "event=gate_unconfigured" in line)
    assert "no gate Redis" in unconfigured
    assert "reason=gate_unavailable" in err


@pytest.mark.parametrize("gate_redis", [False, True])
def test_with_no_gate_redis_a_gated_publish_fails_closed_and_says_why(
    capsys: pytest.CaptureFixture[str], redis_url: str, redis_client: redis.Redis,
    gate_redis: bool,
) -> None:  # fmt: skip
    # Without a gate Redis, and with one that works (initialised, the gate on): a broker
    # gatekeeper cannot read refuses gating, whatever the gate would have decided.
    app = Celery("nowhere", broker="memory://")
    app.conf.gatekeeper_dwell_gate_enabled = True
    app.conf.gatekeeper_canary_percent = 100
    if gate_redis:
        app.conf.gatekeeper_redis_url = redis_url
    gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=1, tokens_in=5, deadline_s=60)
    @app.task(name="nowhere.embed", shared=False)
    def embed(x: int) -> int:
        return x

    embed.delay(1)  # published, not raised; the gate would admit it
    embed.apply_async((2,), headers={"gatekeeper_expected_service_s": 0})  # would defer it
    with app.connection_for_read() as connection:
        for _ in range(2):
            message = connection.SimpleQueue("reserved").get(timeout=2)
            assert message.headers["gatekeeper_reason"] == "gate_unavailable"
            message.ack()
        for queue in ("free", "defer"):
            assert not connection.default_channel.queue_declare(queue, passive=False).message_count
    assert not list(redis_client.scan_iter(match="gatekeeper:*:run:*"))  # nothing recorded
    err = capsys.readouterr().err
    assert "reason=gate_unavailable" in err
    # memory:// is no broker gatekeeper can read: deferred work would have nothing able to
    # read it, so gating is refused, and the line says why and what is expected.
    refused = next(line for line in err.splitlines() if "event=broker_unsupported" in line)
    assert "broker=memory" in refused and "RabbitMQ (amqp://" in refused


QUEUES = ("celery", "free", "defer", "reserved")


def purged(redis_url: str, client: redis.Redis, declared: bool, *extra: str) -> dict[str, int]:
    """What is left in each queue after ``celery purge -f`` (and ``extra``) of conf_app."""
    for queue in QUEUES:
        client.lpush(queue, b"{}")
    env = {"CONF_APP_DECLARED_QUEUES": "1"} if declared else {}
    done = run(redis_url, "celery", "-A", "tests.apps.conf_app", "purge", "-f", *extra, **env)
    assert done.returncode == 0, done.stderr
    left = {queue: client.llen(queue) for queue in QUEUES}
    client.delete(*QUEUES)
    return left


def test_celery_purge_leaves_the_gates_queues_unless_the_app_declares_them(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # The README's promise, and its exception: Celery purges the queues it knows, and an app
    # with task_create_missing_queues off must declare gatekeeper's (install checks): -X then.
    assert purged(redis_url, redis_client, False) == {
        "celery": 0, "free": 1, "defer": 1, "reserved": 1}  # fmt: skip
    assert purged(redis_url, redis_client, True) == dict.fromkeys(QUEUES, 0)
    assert purged(redis_url, redis_client, True, "-X", "free,defer,reserved") == {
        "celery": 0, "free": 1, "defer": 1, "reserved": 1}  # fmt: skip


def test_an_app_that_declares_its_queues_without_one_of_gatekeepers_is_told_which(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """With ``task_create_missing_queues`` off, Celery would refuse a publish to an undeclared
    queue only once the gate chose it (a deferral, say): the first gated publish says which
    queue is missing instead, and nothing is sent."""
    app = Celery("declared", broker=redis_url)
    app.conf.task_create_missing_queues = False
    app.conf.task_queues = (Queue("celery"), Queue("free"), Queue("reserved"))

    @gatekeeper.gated(expected_service_s=1, tokens_in=10, deadline_s=60)
    @app.task(name="declared.embed", shared=False)
    def embed(chunk: int) -> int:
        return chunk

    gatekeeper.install(app)  # reads nothing yet
    app.conf.gatekeeper_redis_url = redis_url
    app.conf.gatekeeper_dwell_gate_enabled = True
    with pytest.raises(ConfigError, match=r"task_create_missing_queues.*\['defer'\]"):
        embed.delay(1)
    assert {queue: redis_client.llen(queue) for queue in QUEUES} == dict.fromkeys(QUEUES, 0)


def test_the_celery_command_replayer_ends_an_abandoned_task_in_the_backend_and_its_errback(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README: run with the app (`celery -A proj gatekeeper replay`), the replayer stores
    # DeadlineAbandoned in the app's result backend and link_error callbacks run.
    monkeypatch.setenv("CONF_APP_RESULTS", "1")
    app = create_app(redis_url)
    assert app.conf.result_backend == redis_url
    soon = {"gatekeeper_deadline_s": 1, "gatekeeper_expected_service_s": 0}  # deferred
    result = app.tasks["conf.embed"].apply_async(
        (1,), headers=soon, link_error=app.tasks["conf.plain"].si()
    )
    assert len(queue_messages(redis_client, "defer")) == 1
    time.sleep(1.2)  # its deadline gone
    done = run(redis_url, "celery", "-A", "tests.apps.conf_app", "gatekeeper", "replay",
               "--once", CONF_APP_RESULTS="1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "event=task_abandoned" in done.stderr and "result=no_app" not in done.stderr
    with pytest.raises(DeadlineAbandoned, match="abandoned: its deadline"):
        result.get(timeout=10)
    errbacks = [m["headers"]["task"] for m in queue_messages(redis_client, "celery")]
    assert errbacks == ["conf.plain"]


def test_a_redis_broker_with_a_global_keyprefix_refuses_gating_and_says_why(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # kombu then keeps queue "defer" as the list "pfx:defer": a replayer reading "defer" would
    # find it empty and deferred work would wait for good. Gating is refused instead.
    app = Celery("prefixed", broker=redis_url)
    app.conf.update(broker_transport_options={"global_keyprefix": "pfx:"},
                    gatekeeper_dwell_gate_enabled=True, gatekeeper_canary_percent=100)  # fmt: skip
    gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=0.2, tokens_in=10, deadline_s=60)
    @app.task(name="prefixed.embed", shared=False)
    def embed(x: int) -> int:
        return x

    embed.apply_async((1,), headers={"gatekeeper_expected_service_s": 0})  # would be deferred
    (message,) = queue_messages(redis_client, "pfx:reserved")
    assert message["headers"]["gatekeeper_reason"] == "gate_unavailable"
    assert not redis_client.exists("defer", "pfx:defer", "free", "pfx:free")
    err = capsys.readouterr().err
    refused = next(line for line in err.splitlines() if "event=broker_unsupported" in line)
    assert "global_keyprefix\\u003d'pfx:' is not supported" in refused, refused  # = escaped
    with pytest.raises(ConfigError, match="global_keyprefix"):
        broker_for(gatekeeper.install(app).settings, app)


def test_a_task_not_made_yet_is_gated_in_every_app_that_makes_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # @gated on @app.task of an app not finalized marks the function the task will be made
    # from, without making it: the copy another app makes of it (Celery's tasks are shared by
    # default) is gated too, and so is a later task whatever another declaration does.
    first, second = Celery("first", broker=redis_url), Celery("second", broker=redis_url)
    for app in (first, second):
        app.conf.update(gatekeeper_redis_url=redis_url, gatekeeper_dwell_gate_enabled=True,
                        gatekeeper_canary_percent=100)  # fmt: skip
        gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=0.2, tokens_in=10, deadline_s=60)
    @first.task(name="shared.embed")
    def embed(x: int) -> int:
        return x

    with pytest.raises(BadDeclaredInput, match="not both"):  # at import, as for a made task

        @gatekeeper.gated(expected_service_s=0.2, deadline_s=60)
        @second.task(name="twice.declared", gatekeeper={"expected_service_s": 1, "deadline_s": 9})
        def twice(x: int) -> int:
            return x

    assert not first.configured and not second.configured
    second.tasks["shared.embed"].delay(1)  # the second app's copy, as its worker would retry it
    second.send_task("shared.embed", (2,))
    first.tasks["shared.embed"].delay(3)
    assert [m["headers"]["gatekeeper_reason"] for m in queue_messages(redis_client, "free")] == [
        "fits", "fits", "fits"]  # fmt: skip
    assert not queue_messages(redis_client, "celery")


def test_the_celery_command_shows_and_sets_flags_under_the_apps_namespace(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """README: ``celery -A proj gatekeeper flags``: the app's ``CELERY_GATEKEEPER_*`` settings
    as the settings' source, and a flag set there is the one the app's publishes read."""
    flags = ("celery", "-A", "tests.apps.conf_app", "gatekeeper", "flags")
    shown = run(redis_url, *flags)
    assert shown.returncode == 0, shown.stderr
    assert "dwell_gate_enabled: effective=true settings=true redis=-" in shown.stdout  # the app's
    assert "canary_percent: effective=100.0 settings=100.0 redis=-" in shown.stdout
    frozen = run(redis_url, *flags, "set", "free_path_enabled", "false", "--reason", "page 1")
    assert frozen.returncode == 0, frozen.stderr
    assert redis_client.hget(KEYS.flags, "free_path_enabled") == b"false"
    shown = run(redis_url, *flags)
    assert "free_path_enabled: effective=false settings=true redis=false" in shown.stdout
    create_app(redis_url).tasks["conf.embed"].delay(1)  # the app's own publish reads it
    (message,) = queue_messages(redis_client, "reserved")
    assert message["headers"]["gatekeeper_reason"] == "free_path_disabled"
