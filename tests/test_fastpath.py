"""Fast publish's guards: when it stands aside, and what it never does twice or swallows."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import given
from hypothesis import strategies as st
from kombu import Producer, Queue

from gatekeeper.celery.fastpath import possible, publish_observed, same_server
from gatekeeper.celery.private import capture_message
from gatekeeper.core.dwell import Decision, Reason
from gatekeeper.core.ledger import BudgetMode
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.push import Push, dwell_text, new_nonce, placeholders, values_for
from gatekeeper.redis.store import GateStore
from tests.calls import gate_call

QUEUES = ("free", "defer", "reserved")


INPUTS: dict[str, Any] = dict(
    window_id=1, job_id="job", attempt=1, expected_service_s=1, retry_tax_s=0,
    deadline_slack_s=60, max_queue_age_s=30, tokens_in=1, budget_units=1e9,
    queue_wait_unit_per_second=0, budget_mode=BudgetMode.EXPOSURE, deadline_slack_ms=0,
)  # fmt: skip


def score(store: GateStore, push: Push | None) -> tuple[str, str]:
    scored = store.score(gate_call(**INPUTS, now_s=time.time(), push=push))
    return scored.decision.value, scored.reason.value


def a_push() -> Push:
    nonce = new_nonce()
    marks = placeholders(nonce)
    template = json.dumps(
        {
            "headers": {"id": "job", "d": marks["decision"], "r": marks["reason"],
                        "w": marks["dwell"], "f": marks["free"], "n": marks["window"]},
            "properties": {"delivery_info": {"routing_key": marks["queue"]}},
        }
    )  # fmt: skip
    push = Push.cut(template, nonce, QUEUES, QUEUES)
    assert push is not None
    return push


def fallback(store: GateStore, push: Push) -> tuple[Decision, Reason] | None:
    text = push.filled(values_for("reserved", "gate_unavailable", None, False, None, "reserved"))
    return store.push_fallback(push, "job", 1, Decision.RESERVED, Reason.GATE_UNAVAILABLE, text, {})


def score_with(store: GateStore, push: Push) -> tuple[str, str]:
    scored = store.score(gate_call(**INPUTS, now_s=time.time(), push=push, nonce=push.nonce))
    return scored.decision.value, scored.reason.value


def test_a_retried_script_call_pushes_the_message_once(redis_client: redis.Redis) -> None:
    store = GateStore(redis_client, Keys(), horizon_s=1e9)
    push = a_push()
    assert score_with(store, push) == ("admit_free", "fits")
    # The same request sent again through redis-py, as its retry on a timeout would send it.
    keys, args = store.gate_call(
        gate_call(**INPUTS, now_s=time.time(), push=push, nonce=push.nonce)
    )
    again = store._gate_reply(store._reply_now(keys, args))
    assert (again.decision.value, again.reason.value) == ("admit_free", "fits")
    (raw,) = redis_client.lrange("free", 0, -1)
    message = json.loads(raw)
    assert message["headers"]["d"] == "admit_free" and message["headers"]["f"] is True
    assert message["properties"]["delivery_info"]["routing_key"] == "free"
    # The record names this request as the one whose message was pushed, and its decision.
    record = redis_client.hmget(Keys().run("job", 1), "nonce", "decision", "reason")
    assert record == [push.nonce.encode(), b"admit_free", b"fits"]
    assert float(redis_client.hget(Keys().window(1), "exposure") or 0) == 1


def test_another_publish_of_the_same_task_id_and_attempt_is_pushed_too(
    redis_client: redis.Redis,
) -> None:
    # Celery publishes a task id given twice twice; so does the gate (each request its
    # nonce), the second to reserved: the first's record is live, and must not be orphaned.
    store = GateStore(redis_client, Keys(), horizon_s=1e9)
    first = a_push()
    assert score_with(store, first) == ("admit_free", "fits")
    again = a_push()
    keys, args = store.gate_call(
        gate_call(**INPUTS, now_s=time.time(), push=again, nonce=again.nonce)
    )
    scored = store._gate_reply(store._reply_now(keys, args))  # redis-py's call, as on reload
    assert (scored.decision, scored.reason) == (Decision.RESERVED, Reason.DUPLICATE_PUBLISH)
    assert redis_client.llen("free") == 1 and redis_client.llen("reserved") == 1
    assert redis_client.hget(Keys().run("job", 1), "nonce") == first.nonce.encode()
    # The duplicate, sent again, is not pushed again.
    assert score_with(store, again) == ("reserved", "duplicate_publish")
    assert redis_client.llen("reserved") == 1


def test_the_fallback_pushes_once_whoever_comes_first(redis_client: redis.Redis) -> None:
    store = GateStore(redis_client, Keys(), horizon_s=1e9)
    push = a_push()
    # The script ran (its reply lost): the fallback finds the push and adds nothing.
    assert score_with(store, push) == ("admit_free", "fits")
    assert fallback(store, push) == (Decision.ADMIT_FREE, Reason.FITS)
    assert (redis_client.llen("free"), redis_client.llen("reserved")) == (1, 0)
    # The fallback first (the script stalled): it pushes, sent again it does not, and the
    # script, when it runs at last, pushes nothing and takes no exposure.
    later = a_push()
    assert fallback(store, later) is None
    assert fallback(store, later) == (Decision.RESERVED, Reason.GATE_UNAVAILABLE)
    # The stalled script finds the fallback's push under its own nonce: the same answer.
    assert score_with(store, later) == ("reserved", "gate_unavailable")
    assert (redis_client.llen("free"), redis_client.llen("reserved")) == (1, 1)
    message = json.loads(redis_client.lindex("reserved", 0) or b"")
    assert message["headers"]["d"] == "reserved" and message["headers"]["f"] is False
    assert message["properties"]["delivery_info"]["routing_key"] == "reserved"
    assert float(redis_client.hget(Keys().window(1), "exposure") or 0) == 1


def test_capture_passes_on_other_publishes_on_a_shared_channel(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = Celery("shared", broker=redis_url)
    with app.producer_or_acquire() as producer:
        channel = producer.channel

        def sender(producer: Any, *args: Any, **options: Any) -> None:
            other = {"headers": {"id": "someone-else"}, "body": "x",
                     "properties": {"priority": 0, "delivery_info": {}}}  # fmt: skip
            mine = {"headers": {"id": "mine", "mark": "ours"}, "body": "y",
                    "properties": {"priority": 0, "delivery_info": {}}}  # fmt: skip
            channel._put("other", other)
            channel._put("free", mine)

        message = SimpleNamespace(headers={})
        text, lists = capture_message(
            sender, producer, ("t", message), {}, QUEUES, ("mark", "ours"), "QUEUE", json.dumps
        )
        assert "_put" not in vars(channel)  # put back as it was
    assert '"mine"' in text and '"routing_key": "QUEUE"' in text and lists == QUEUES
    assert redis_client.llen("other") == 1 and redis_client.llen("free") == 0


def test_same_server_asks_the_servers(redis_url: str) -> None:
    ours = redis.Redis.from_url(redis_url)
    assert same_server(redis.Redis.from_url(redis_url), ours)
    other_db = redis_url.rsplit("/", 1)[0] + "/1"
    assert not same_server(redis.Redis.from_url(other_db), ours)
    assert not same_server(object(), ours)


def test_fast_publish_stands_aside_for_a_global_key_prefix(redis_url: str) -> None:
    app = Celery("prefixed", broker=redis_url)
    app.conf.broker_transport_options = {"global_keyprefix": "pfx:"}
    with app.producer_or_acquire() as producer:
        assert not possible(app, producer, QUEUES)
    plain = Celery("plain", broker=redis_url)
    with plain.producer_or_acquire() as producer:
        assert possible(plain, producer, QUEUES)


def test_fast_publish_stands_aside_for_a_queue_that_expires(redis_url: str) -> None:
    """kombu renews the expiry of a Redis queue declared with one at each push, which the
    script's one LPUSH would skip: declared so in the app (the three queues then no longer
    alike), or on the channel alone."""
    declared = Celery("declared", broker=redis_url)
    declared.conf.task_queues = [Queue("free", expires=60), Queue("defer"), Queue("reserved")]
    with declared.producer_or_acquire() as producer:
        assert not possible(declared, producer, QUEUES)
    on_the_channel = Celery("on_the_channel", broker=redis_url)
    with on_the_channel.producer_or_acquire() as producer:
        assert possible(on_the_channel, producer, QUEUES)
        if not hasattr(producer.channel, "_expires"):
            return  # kombu before 5.6: no expiry kept on the channel, none renewed at a push
        Queue("free", expires=60).bind(producer.channel).declare()
        assert not possible(on_the_channel, producer, QUEUES)
        Queue("free").bind(producer.channel).declare()  # declared again without: it fits
        assert possible(on_the_channel, producer, QUEUES)


def test_fast_publish_sees_the_apps_queues_replaced_or_one_added_after_its_first_publish(
    redis_url: str,
) -> None:
    app = Celery("later", broker=redis_url)
    with app.producer_or_acquire() as producer:
        assert possible(app, producer, QUEUES)  # remembered for this map of queues
        app.amqp.queues.add(Queue("reserved", expires=60))  # the same map, one more entry
        assert not possible(app, producer, QUEUES)
        app.amqp.queues = [Queue("free"), Queue("defer"), Queue("reserved")]  # a new map
        assert possible(app, producer, QUEUES)
        app.amqp.queues = [Queue("free", expires=60), Queue("defer"), Queue("reserved")]
        assert not possible(app, producer, QUEUES)


def test_fast_publish_sees_one_of_its_queues_declared_again_under_the_same_name(
    redis_url: str,
) -> None:
    """The map keeps its identity and its size: the queue itself is what changed."""
    app = Celery("again", broker=redis_url)
    app.conf.task_queues = [Queue("free"), Queue("defer"), Queue("reserved")]
    with app.producer_or_acquire() as producer:
        assert possible(app, producer, QUEUES)
        size = len(app.amqp.queues)
        app.amqp.queues.add(Queue("free", expires=60))
        assert len(app.amqp.queues) == size
        assert not possible(app, producer, QUEUES)
        app.amqp.queues.add(Queue("free"))
        assert possible(app, producer, QUEUES)


@pytest.mark.skipif(not hasattr(Producer, "batch"), reason="kombu before 5.7 has no batches")
def test_fast_publish_stands_aside_inside_a_producers_publish_batch(redis_url: str) -> None:
    """kombu 5.7's batch keeps each publish until it flushes: there is no push to catch."""
    app = Celery("batched", broker=redis_url)
    with app.producer_or_acquire() as producer:
        assert possible(app, producer, QUEUES)
        with producer.batch():
            assert not possible(app, producer, QUEUES)
            seen_from = []  # the batch is the publishing thread's own
            other = threading.Thread(
                target=lambda: seen_from.append(possible(app, producer, QUEUES))
            )
            other.start()
            other.join()
            assert seen_from == [True]
        assert possible(app, producer, QUEUES)


def test_a_producer_subclass_that_overrides_publishing_counts_as_an_observer() -> None:
    class Counting(Producer):
        def _publish(self, *args: Any, **kwargs: Any) -> Any:
            return super()._publish(*args, **kwargs)

    class Plain(Producer):
        pass

    assert not publish_observed(Producer) and not publish_observed(Plain)
    assert publish_observed(Counting)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_the_ordinary_paths_dwell_is_the_double_the_scripts_text_reads_back_as(x: float) -> None:
    # The ordinary path stamps round(dwell, 6); gate.lua writes string.format('%.6f', dwell).
    assert round(x, 6) == float(dwell_text(x)) == json.loads(dwell_text(x))
