"""The private Celery API the hook relies on: these fail loudly if its shape changes."""

from __future__ import annotations

import inspect
import threading
from typing import Any, ClassVar

import celery
import pytest
import redis
from celery import Celery
from celery.app.amqp import AMQP
from kombu import Exchange, Queue
from kombu.utils.objects import cached_property

import gatekeeper
from gatekeeper.celery.private import (
    CHANNEL_API,
    SENDER_PARAMETERS,
    CelerySender,
    bound_for,
    cached_value,
    check_celery_shape,
    checked_sender,
    outstanding,
    promised_task,
)
from gatekeeper.errors import CeleryShapeError
from tests.conftest import queue_messages


def test_celery_is_in_the_supported_range() -> None:
    major, minor = (int(part) for part in celery.__version__.split(".")[:2])
    assert (5, 5) <= (major, minor) < (5, 8), celery.__version__


def test_send_task_message_is_a_cached_property_settable_per_app() -> None:
    first, second = Celery("a", broker="memory://"), Celery("b", broker="memory://")
    assert isinstance(
        inspect.getattr_static(type(first.amqp), "send_task_message"), cached_property
    )
    original = second.amqp.send_task_message

    def replacement(*args: object, **kwargs: object) -> None:
        return None

    first.amqp.send_task_message = replacement
    assert first.amqp.send_task_message is replacement
    assert second.amqp.send_task_message is original


def test_the_task_sender_takes_the_parameters_the_hook_passes() -> None:
    sender = Celery("c", broker="memory://").amqp._create_task_sender()
    params = list(inspect.signature(sender).parameters)
    assert params[:3] == ["producer", "name", "message"]
    assert set(SENDER_PARAMETERS) <= set(params)
    assert checked_sender(sender) is sender
    check_celery_shape(Celery("d", broker="memory://"))  # raises CeleryShapeError otherwise


def test_send_task_calls_the_sender_with_a_message_carrying_id_task_and_retries() -> None:
    app = Celery("e", broker="memory://")
    seen: dict[str, object] = {}

    def spy(producer: object, name: str, message: object, **options: object) -> None:
        seen.update(name=name, headers=message.headers, options=options)  # type: ignore[attr-defined]

    app.amqp.send_task_message = spy
    app.send_task("some.task", task_id="abc", retries=2, queue="q1")
    headers = seen["headers"]
    assert isinstance(headers, dict)
    assert (headers["id"], headers["task"], headers["retries"]) == ("abc", "some.task", 2)
    assert "queue" in seen["options"]  # type: ignore[operator]


def test_a_changed_sender_is_refused() -> None:
    app = Celery("f", broker="memory://")
    app.amqp.send_task_message = lambda producer, message: None
    with pytest.raises(CeleryShapeError, match="changed shape"):
        CelerySender(app)  # one the app held before install: checked at once
    fresh = Celery("f2", broker="memory://")
    fresh.amqp._create_task_sender = lambda: lambda producer, message: None
    sender = CelerySender(fresh)  # made at the first publish, and checked then
    with pytest.raises(CeleryShapeError, match="changed shape"):
        sender(None, "t", None)


def test_the_sender_is_made_at_the_first_publish_or_is_the_one_held_before() -> None:
    app = Celery("h", broker="memory://")
    sender = CelerySender(app)
    assert sender.sender is None and not app.configured  # nothing made, no config read
    held = Celery("i", broker="memory://")
    seen: list[str] = []

    def wrapper(
        producer: Any, name: str, message: Any, exchange: Any = None, routing_key: Any = None,
        queue: Any = None, headers: Any = None,
    ) -> None:  # fmt: skip
        seen.append(name)

    held.amqp.send_task_message = wrapper  # another extension's wrapper, set first
    CelerySender(held)(None, "some.task", None)
    assert seen == ["some.task"]


def test_kombus_redis_channel_has_what_fast_publish_catches(redis_url: str) -> None:
    app = Celery("g", broker=redis_url)
    with app.producer_or_acquire() as producer:
        channel = producer.channel
        for name in CHANNEL_API:
            assert callable(getattr(channel, name)), name
        params = list(inspect.signature(channel._put).parameters)
        assert params[:2] == ["queue", "message"]
        assert channel._q_for_pri("q", 0) == "q"
        assert channel._q_for_pri("q", 5) == "q\x06\x163"


def test_kombus_cached_properties_keep_their_values_where_fast_publish_reads_them(
    redis_url: str,
) -> None:
    app = Celery("g", broker=redis_url)
    with app.producer_or_acquire() as producer:
        channel = producer.channel
        for owner, name in ((app, "amqp"), (app.amqp, "queues"), (channel, "client")):
            value = getattr(owner, name)  # computed
            assert owner.__dict__.get(name) is value, (owner, name)  # else: slower, not wrong
            assert cached_value(owner, name) is value
        app.amqp.queues = [Queue("free")]  # a setter's value is kept there too
        assert cached_value(app.amqp, "queues") is app.amqp.queues
    assert cached_value(object(), "client") is None


@pytest.mark.parametrize(
    "publish",
    [
        {"queue": "free"},
        {},
        {"routing_key": "free"},
        {"queue": "bulk"},
        {"exchange": "gk", "routing_key": "free.key"},
        {"exchange": "gk", "routing_key": "other.key"},
    ],
)
def testbound_for_free_agrees_with_where_celery_puts_the_message(
    redis_url: str, redis_client: redis.Redis, publish: dict[str, Any]
) -> None:
    app = Celery("bound", broker=redis_url)
    gk = Exchange("gk", type="direct")
    app.conf.task_queues = [
        Queue("celery"), Queue("free", gk, routing_key="free.key"),
        Queue("bulk", routing_key="free"), Queue("other", gk, routing_key="other.key"),
    ]  # fmt: skip
    with app.connection_for_write() as connection:  # bound, as a worker would have them
        for queue in app.conf.task_queues:
            queue.bind(connection.default_channel).declare()
    seen: list[bool] = []
    sender = app.amqp.send_task_message

    def record(producer: Any, name: str, message: Any, **options: Any) -> Any:
        seen.append(bound_for(app, options, "free"))
        return sender(producer, name, message, **options)

    app.amqp.send_task_message = record
    app.send_task("t.plain", **publish)
    assert seen == [redis_client.llen("free") == 1]


def test_the_workers_request_still_has_what_the_wait_allowance_check_uses() -> None:
    from gatekeeper.celery.private import check_request_shape

    check_request_shape()  # raises CeleryShapeError, naming what is gone


def test_an_on_failure_that_no_longer_asks_whether_success_was_stored_fails_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Celery 5.7 sends no task_failure for a child lost after it stored SUCCESS, and the
    # request class learns of it through _success_was_stored(): should on_failure stop asking
    # it, such a run would silently get no row.
    from celery.worker import request

    from gatekeeper.celery.private import check_request_shape

    def on_failure(self: Any, exc_info: Any, send_failed_event: bool = True) -> None:
        return None

    monkeypatch.setattr(request.Request, "_success_was_stored", lambda self: False, raising=False)
    monkeypatch.setattr(request.Request, "on_failure", on_failure)
    with pytest.raises(CeleryShapeError, match="_success_was_stored"):
        check_request_shape()


def test_a_task_promise_gives_its_function_name_and_options_without_being_made() -> None:
    app = Celery("p", broker="memory://")

    def work(x: int) -> int:
        return x

    promise = app.task(name="p.work", gatekeeper={"expected_service_s": 1})(work)
    unnamed = app.task(work)
    options = {"name": "p.work", "gatekeeper": {"expected_service_s": 1}}
    assert promised_task(promise) == (work, "p.work", options, app.Task)
    assert promised_task(unnamed) == (work, f"{__name__}.work", {}, app.Task)
    assert not app.configured and not app.finalized  # nothing made, no config read
    assert promise.name == "p.work"  # made now
    assert promised_task(promise) is None and promised_task(work) is None


class TracingAMQP(AMQP):  # an extension that wraps Celery's sender the subclass way
    seen: ClassVar[list[str]] = []

    @cached_property
    def send_task_message(self) -> Any:
        inner = self._create_task_sender()
        return self.traced(inner)

    @staticmethod
    def traced(inner: Any) -> Any:
        def send(producer: Any, name: str, message: Any, exchange: Any = None,
                 routing_key: Any = None, queue: Any = None, headers: Any = None,
                 **options: Any) -> Any:  # fmt: skip
            TracingAMQP.seen.append(name)
            headers = {**(headers or {}), "traced": "yes"}
            return inner(producer, name, message, exchange=exchange, routing_key=routing_key,
                         queue=queue, headers=headers, **options)  # fmt: skip

        return send


class ParentTracingAMQP(TracingAMQP):  # wraps what its parent's property makes: super()
    @cached_property
    def send_task_message(self) -> Any:
        return super().send_task_message


@pytest.mark.parametrize("amqp", [TracingAMQP, ParentTracingAMQP])
def test_an_amqp_subclasss_own_sender_is_the_one_wrapped(
    redis_url: str, redis_client: redis.Redis, amqp: type[AMQP]
) -> None:
    TracingAMQP.seen.clear()
    app = Celery("traced", broker=redis_url, amqp=amqp)
    app.conf.gatekeeper_redis_url = redis_url
    gatekeeper.install(app)

    @app.task(name="traced.plain", shared=False)
    def plain(x: int) -> int:
        return x

    plain.delay(1)
    assert TracingAMQP.seen == ["traced.plain"]
    (message,) = queue_messages(redis_client, "celery")
    assert message["headers"]["traced"] == "yes"


def first_publish(ready: threading.Barrier, task: Any) -> None:
    ready.wait()
    task.delay(1)


def test_first_publishes_from_many_threads_keep_the_wrapper_on_an_amqp_subclass() -> None:
    # Eight threads' first publishes at once, on a fresh app each round: a thread that looked
    # the sender up while the subclass made it would cache the subclass's unwrapped sender
    # over gatekeeper's, for good (seen in 2-8 rounds of 300 before the property's lock).
    for round_ in range(300):
        app = Celery(f"threads{round_}", broker="memory://", amqp=TracingAMQP)
        gate = gatekeeper.install(app)

        @app.task(name=f"threads{round_}.plain", shared=False)
        def plain(x: int) -> int:
            return x

        app.finalize()  # the task made now: Celery's lazy proxy is not thread-safe
        ready = threading.Barrier(8)
        threads = [threading.Thread(target=first_publish, args=(ready, plain)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert vars(app.amqp)["send_task_message"] == gate.send_task_message, round_


def test_the_workers_held_requests_are_told_apart_by_identity() -> None:
    # Celery keeps the requests it holds in weak sets; outstanding() must read them (it raised
    # on every Celery when it expected a set, so Received could tell no ended request apart).
    from celery.worker import state

    class Request:  # two requests with one task id: Celery's have no __eq__
        id = "J"

    first, second = Request(), Request()
    state.active_requests.add(first)
    state.reserved_requests.add(second)
    try:
        assert outstanding(first) and outstanding(second)
        state.active_requests.discard(first)
        assert not outstanding(first) and outstanding(second)
    finally:
        state.active_requests.discard(first)
        state.reserved_requests.discard(second)
