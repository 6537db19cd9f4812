"""Fast publish's guards: when it stands aside, and what it never does twice or swallows."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Producer

from gatekeeper.errors import LedgerUnavailable
from gatekeeper.fastpath import (
    Push,
    capture_message,
    fast_path_possible,
    publish_observed,
    same_server,
)
from gatekeeper.keys import Keys
from gatekeeper.ledger import BudgetMode
from gatekeeper.store import GateStore

QUEUES = ("free", "defer", "reserved")


INPUTS: dict[str, Any] = dict(
    window_id=1, job_id="job", attempt=1, expected_service_s=1, retry_tax_s=0,
    deadline_slack_s=60, max_queue_age_s=30, tokens_in=1, budget_units=1e9,
    queue_wait_unit_per_second=0, budget_mode=BudgetMode.EXPOSURE, deadline_slack_ms=0,
)  # fmt: skip


def score(store: GateStore, push: Push | None) -> tuple[str, str]:
    scored = store.score(**INPUTS, now_s=time.time(), push=push)
    return scored.decision.value, scored.reason.value


def a_push() -> Push:
    template = json.dumps(
        {
            "headers": {"id": "job", "d": "__gk_decision__", "r": "__gk_reason__",
                        "w": "__gk_dwell__", "f": "__gk_free__", "n": "__gk_window__"},
            "properties": {"delivery_info": {"routing_key": "__gk_queue__"}},
        }
    )  # fmt: skip
    return Push(template, QUEUES, QUEUES)


def test_a_retried_script_call_pushes_the_message_once(redis_client: redis.Redis) -> None:
    store = GateStore(redis_client, Keys(), horizon_s=1e9)
    push = a_push()
    assert score(store, push) == ("admit_free", "fits")
    # The same request sent again through redis-py, as its retry on a timeout would send it.
    keys, args = store._gate_call(**INPUTS, now_s=time.time(), push=push)
    again = store._gate_reply(store._reply_now(keys, args))
    assert (again.decision.value, again.reason.value) == ("admit_free", "fits")
    (raw,) = redis_client.lrange("free", 0, -1)
    message = json.loads(raw)
    assert message["headers"]["d"] == "admit_free" and message["headers"]["f"] is True
    assert message["properties"]["delivery_info"]["routing_key"] == "free"
    # The key names this request as the one whose message was pushed, and its decision.
    assert redis_client.get(Keys().fast("job", 1)) == f"{push.nonce}|admit_free|fits".encode()
    assert float(redis_client.hget(Keys().window(1), "exposure") or 0) == 1


def test_another_publish_of_the_same_task_id_and_attempt_is_pushed_too(
    redis_client: redis.Redis,
) -> None:
    # Celery publishes a task id given twice twice; so does the gate (each request its nonce).
    store = GateStore(redis_client, Keys(), horizon_s=1e9)
    assert score(store, a_push()) == ("admit_free", "fits")
    keys, args = store._gate_call(**INPUTS, now_s=time.time(), push=a_push())
    store._gate_reply(store._reply_now(keys, args))  # redis-py's own call, the reload path's
    assert redis_client.llen("free") == 2


def test_the_fallback_pushes_once_whoever_comes_first(redis_client: redis.Redis) -> None:
    store = GateStore(redis_client, Keys(), horizon_s=1e9)
    push = a_push()
    # The script ran (its reply lost): the fallback finds the push and adds nothing.
    assert score(store, push) == ("admit_free", "fits")
    assert store.push_fallback(push, "job", 1, "reserved", "gate_unavailable", "reserved") == (
        "admit_free",
        "fits",
    )
    assert (redis_client.llen("free"), redis_client.llen("reserved")) == (1, 0)
    # The fallback first (the script stalled): it pushes, sent again it does not, and the
    # script, when it runs at last, pushes nothing and takes no exposure.
    later = a_push()
    assert store.push_fallback(later, "job", 1, "reserved", "gate_unavailable", "reserved") is None
    assert store.push_fallback(later, "job", 1, "reserved", "gate_unavailable", "reserved") == (
        "reserved",
        "gate_unavailable",
    )
    with pytest.raises(LedgerUnavailable, match="gate_unavailable"):  # not a gate.lua reason:
        score(store, later)  # its caller's fallback then finds its own push
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
            placeholders = {k: f"__gk_{k}__" for k in ("decision", "reason", "dwell", "window")}
            mine = {"headers": {"id": "mine", **placeholders}, "body": "y",
                    "properties": {"priority": 0, "delivery_info": {}}}  # fmt: skip
            channel._put("other", other)
            channel._put("free", mine)

        message = SimpleNamespace(headers={})
        push = capture_message(sender, producer, ("t", message), {}, QUEUES, "mine")
        assert "_put" not in vars(channel)  # put back as it was
    assert push is not None and '"mine"' in push.template
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
        assert not fast_path_possible(app, producer, producer.channel, QUEUES)
    plain = Celery("plain", broker=redis_url)
    with plain.producer_or_acquire() as producer:
        assert fast_path_possible(plain, producer, producer.channel, QUEUES)


def test_a_producer_subclass_that_overrides_publishing_counts_as_an_observer() -> None:
    class Counting(Producer):
        def _publish(self, *args: Any, **kwargs: Any) -> Any:
            return super()._publish(*args, **kwargs)

    class Plain(Producer):
        pass

    assert not publish_observed(Producer) and not publish_observed(Plain)
    assert publish_observed(Counting)
