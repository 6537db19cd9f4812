"""gatekeeper metrics: a scrape reads the gate's state in Redis under docs/metrics.md's names.

Scraped over HTTP from the collector served on a free port (tests/scrape.py), against the
suite's real Redis; the hung Redis is a real redis-server SIGSTOPped, as in test_breaker.py.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import redis

from gatekeeper.celery.freeze import maybe_freeze
from gatekeeper.celery.replay import Replayer
from gatekeeper.core.ledger import Outcome, make_row
from gatekeeper.core.ledger import Path as RowPath
from gatekeeper.errors import EmbeddedRedisError
from gatekeeper.logs import make_logger
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.ops.metrics import collector_for
from gatekeeper.redis.attempt import Publish, carried_publish, label_of
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.store import GateStore
from gatekeeper.redis.unverified import UnverifiedRuns
from tests.apps.gated_app import create_app
from tests.calls import gate_call
from tests.conftest import gate_settings, initialised, missing_server, wait_until
from tests.processes import stopped
from tests.scrape import by_label, scrape, serving, value

KEYS = Keys()


def counters(client: redis.Redis) -> dict[bytes, bytes]:
    """The lifetime totals but ``hash_table`` (no counter: it keeps the hash a hash table)."""
    fields = client.hgetall(KEYS.totals)
    fields.pop(b"hash_table", None)
    return fields


DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def publish_mix(redis_url: str) -> dict[str, str]:
    """Three admitted, one reserved (its deadline too near), one deferred (a service time 0)."""
    embed = create_app(gate_settings(redis_url), redis_url).tasks["tests.embed"]
    for n in range(3):
        embed.delay(n)
    reserved = embed.apply_async((9,), headers={"gatekeeper_deadline_s": 1.5}).id
    deferred = embed.apply_async((8,), headers={"gatekeeper_expected_service_s": 0}).id
    return {"reserved": reserved, "deferred": deferred}


def test_a_scrape_counts_each_gated_tasks_decisions_by_decision_and_reason(
    redis_url: str, redis_client: redis.Redis
) -> None:
    publish_mix(redis_url)
    with serving(collector_for(gate_settings(redis_url))) as url:
        samples = scrape(url)
    decided = by_label(samples, "gatekeeper_decisions_total", "task", "decision", "reason")
    assert decided == {
        ("tests.embed", "admit_free", "fits"): 3,
        ("tests.embed", "reserved", "dwell_over_slack"): 1,
        ("tests.embed", "defer", "bad_service_guess"): 1,
    }
    assert value(samples, "gatekeeper_free_admissions_total") == 3
    assert value(samples, "gatekeeper_redis_up") == 1
    assert value(samples, "gatekeeper_free_waiting_attempts") == 3
    assert value(samples, "gatekeeper_window_exposure_units") == 3 * (100 + 10 * 200)
    assert value(samples, "gatekeeper_budget_left_units") == 12_000
    queues = by_label(samples, "gatekeeper_queue_messages", "queue")
    assert queues == {("free",): 3, ("defer",): 1, ("reserved",): 1, ("dead_letter",): 0}
    assert 55 < (value(samples, "gatekeeper_defer_next_deadline_seconds") or 0) <= 60


def test_every_name_the_contract_lists_is_exported_with_its_type(
    redis_url: str, redis_client: redis.Redis
) -> None:
    publish_mix(redis_url)
    Replayer(gate_settings(redis_url), broker=redis_client, gate=redis_client).run(
        threading.Event(), once=True
    )
    with serving(collector_for(gate_settings(redis_url))) as url:
        text = urllib.request.urlopen(url).read().decode()
    listed = re.findall(r"^\| `(gatekeeper_\w+)` \| (counter|gauge) \|", DOCS.read_text(), re.M)
    assert len(listed) >= 21
    for name, kind in listed:
        assert f"# TYPE {name} {kind}\n" in text, name
        assert re.search(rf"^{name}(\{{| )", text, re.M), name


def test_the_totals_never_expire_and_stay_bounded_by_the_gated_tasks(
    redis_url: str, redis_client: redis.Redis
) -> None:
    embed = create_app(gate_settings(redis_url, budget_units=1e9), redis_url).tasks["tests.embed"]
    for n in range(50):  # fifty job ids, one task: one field per decision and reason
        embed.delay(n)
    assert redis_client.ttl(KEYS.totals) == -1
    assert counters(redis_client) == {b"decided:admit_free:fits:tests.embed": b"50"}
    window = next(redis_client.scan_iter(match=f"{KEYS.base}:window:*"))
    assert redis_client.ttl(window) > 0  # the window expires; the totals outlive it


def test_a_replay_counts_under_the_task_its_gate_record_kept_not_its_header(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = create_app(gate_settings(redis_url, max_queue_age_s=1.0), redis_url)
    redis_client.zadd(KEYS.free_waiting, {"stale:1": (time.time() - 5) * 1000})
    job = app.tasks["tests.embed"].delay(1).id  # the age cap defers it
    redis_client.zrem(KEYS.free_waiting, "stale:1")
    assert redis_client.hget(KEYS.run(job, 1), "label") == b"tests.embed"
    assert redis_client.zscore(KEYS.deferred, f"{job}:1") is not None
    # The replayer knows no app: the record names the task, not the message.
    counts = Replayer(gate_settings(redis_url), broker=redis_client, gate=redis_client).run(
        threading.Event(), once=True
    )
    assert counts == {"to_free": 1}
    with serving(collector_for(gate_settings(redis_url))) as url:
        samples = scrape(url)
    decided = by_label(samples, "gatekeeper_decisions_total", "task", "decision", "reason")
    assert decided == {
        ("tests.embed", "defer", "queue_age_cap"): 1,
        ("tests.embed", "admit_free", "fits"): 1,  # the replay: decided again
    }
    assert redis_client.zcard(KEYS.deferred) == 0  # handed on: its deadline no longer counts
    assert value(samples, "gatekeeper_defer_next_deadline_seconds") is None
    last = value(samples, "gatekeeper_replayer_last_pass_timestamp_seconds")
    assert last is not None and time.time() - 30 < last <= time.time()


@pytest.mark.parametrize(
    ("publish", "label"),
    [
        (Publish("tests.embed", "j", 0, None, None, {}), "tests.embed"),  # the hook's
        (Publish("made.up", "j", 0, None, None, {}, origin="replay"), "other"),
        (carried_publish({"task": "made.up"}, "replay", "tests.embed"), "tests.embed"),
        (carried_publish({"task": "made.up"}, "requeue"), "other"),
    ],
)
def test_a_task_label_is_a_registered_gated_tasks_name_or_other(
    publish: Publish, label: str
) -> None:
    assert label_of(publish) == label


def test_the_deferred_deadlines_keep_only_the_nearest(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gatekeeper.redis.store.DEFERRED_CAP", 3)
    embed = create_app(gate_settings(redis_url), redis_url).tasks["tests.embed"]
    for n in range(5):  # deferred in process (record.lua): a service time of 0
        embed.apply_async((n,), headers={"gatekeeper_expected_service_s": 0,
                                         "gatekeeper_deadline_s": 60 + n})  # fmt: skip
    kept = redis_client.zrange(KEYS.deferred, 0, -1, withscores=True)
    assert len(kept) == 3
    assert [round(score / 1000 - time.time()) for _, score in kept] == [60, 61, 62]


def test_rows_count_killed_abandoned_and_slack_misses_where_they_are_written(
    redis_url: str, redis_client: redis.Redis
) -> None:
    ledger = RunLedger(redis_client, KEYS, window_seconds=900, queue_wait_unit_per_second=200)
    now = round(time.time() * 1000)
    abandoned = make_row(job_id="a", attempt=1, path=RowPath.FREE, outcome=Outcome.ABANDONED,
                         queue_wait_ms=0, tokens_in=0, tokens_out=0,
                         deadline_slack_ms=-5)  # fmt: skip
    assert ledger.abandon(abandoned, now, slack_miss=True).written
    assert not ledger.abandon(abandoned, now, slack_miss=True).written  # once per attempt
    killed = make_row(job_id="k", attempt=1, path=RowPath.FREE, outcome=Outcome.KILLED,
                      queue_wait_ms=10, tokens_in=5, tokens_out=0, deadline_slack_ms=5)  # fmt: skip
    UnverifiedRuns(ledger).write(killed, 1, now)  # an unverified row is a ledger row too
    with serving(collector_for(gate_settings(redis_url))) as url:
        samples = scrape(url)
    assert value(samples, "gatekeeper_abandoned_total") == 1
    assert value(samples, "gatekeeper_slack_misses_total") == 1
    assert value(samples, "gatekeeper_killed_rows_total") == 1


def test_the_auto_freeze_is_counted_and_the_flags_in_force_are_gauges(
    redis_url: str, redis_client: redis.Redis
) -> None:
    settings = gate_settings(redis_url, miss_min_admissions=1)
    flags = FlagStore(redis_client, settings)
    alerts = make_logger(settings, "alert")
    assert maybe_freeze(flags, alerts, 1, misses=1, admitted=1, now=time.time())
    assert not maybe_freeze(flags, alerts, 1, misses=2, admitted=2, now=time.time())  # frozen
    with serving(collector_for(settings)) as url:
        samples = scrape(url)
    assert value(samples, "gatekeeper_freezes_total") == 1
    assert value(samples, "gatekeeper_free_path_enabled") == 0
    assert value(samples, "gatekeeper_dwell_gate_enabled") == 1
    assert value(samples, "gatekeeper_canary_ratio") == 1.0
    assert value(samples, "gatekeeper_state_missing") == 0
    redis_client.delete(KEYS.flags)  # the state marker gone with the flags
    with serving(collector_for(gate_settings(redis_url))) as url:
        samples = scrape(url)
    assert value(samples, "gatekeeper_state_missing") == 1
    assert value(samples, "gatekeeper_free_path_enabled") == 0
    assert value(samples, "gatekeeper_state_initialised_timestamp_seconds") is None


def test_a_hung_redis_answers_quickly_with_redis_up_0_and_nothing_else(
    gate_server: EmbeddedRedis,
) -> None:
    settings = gate_settings(gate_server.url)  # redis_timeout_s 0.5, the gate's client
    with serving(collector_for(settings)) as url:
        assert value(scrape(url), "gatekeeper_redis_up") == 1
        with stopped(gate_server.process):
            began = time.monotonic()
            samples = scrape(url)
            took = time.monotonic() - began
    assert took < 2.0, took
    assert {name for name, _ in samples} == {
        "gatekeeper_redis_up",
        "gatekeeper_scrape_duration_seconds",
    }
    assert value(samples, "gatekeeper_redis_up") == 0


def test_a_redis_back_from_an_older_snapshot_never_sends_a_counter_backwards() -> None:
    # A restart from an RDB snapshot loses the last seconds of counts. Read as they came
    # back, the counters went down, which Prometheus takes for a reset to zero: rate() and
    # increase() counted every total again, and the miss-ratio alert saw a lifetime ratio (an
    # audit). The exporter now goes on from where it was; a new state marker (the state lost,
    # `gatekeeper init` again) is a reset, and shown as one.
    try:
        server = EmbeddedRedis(args=("--save", "900", "1")).start()
    except EmbeddedRedisError as exc:
        missing_server(str(exc))

    def shown(url: str) -> tuple[float | None, float | None]:
        assert wait_until(lambda: value(scrape(url), "gatekeeper_redis_up") == 1, 10)
        samples = scrape(url)
        return (value(samples, "gatekeeper_free_admissions_total"),
                value(samples, "gatekeeper_killed_rows_total"))  # fmt: skip

    def stored(client: redis.Redis) -> tuple[int, int]:
        found = counters(client)
        admitted = sum(int(n) for k, n in found.items() if k.startswith(b"decided:admit_free:"))
        return admitted, int(found.get(b"killed_rows", 0))

    try:
        client = redis.Redis.from_url(server.url)
        initialised(client)
        publish_mix(server.url)  # three admitted
        client.hincrby(KEYS.totals, "killed_rows", 2)
        client.save()
        publish_mix(server.url)  # more, and three killed rows, lost with the restart
        client.hincrby(KEYS.totals, "killed_rows", 3)
        with serving(collector_for(gate_settings(server.url))) as url:
            seen, real = [shown(url)], [stored(client)]
            server.kill()  # SIGKILL: no snapshot at shutdown
            server.start(port=server.port)
            client = redis.Redis.from_url(server.url)
            real.append(stored(client))
            seen.append(shown(url))
            publish_mix(server.url)
            real.append(stored(client))
            seen.append(shown(url))
            client.flushall()  # the state lost, then initialised again: a new marker
            client.hset(KEYS.flags, "initialised_at", "1")
            publish_mix(server.url)
            real.append(stored(client))
            seen.append(shown(url))
    finally:
        server.stop()
    assert real[0][0] > real[1][0] == 3 and real[0][1] > real[1][1] == 2  # the counts went back
    assert seen[0] == real[0] and seen[1] == real[0]  # shown where they were, not lower
    gained = real[2][0] - real[1][0]
    assert gained > 0 and seen[2] == (real[0][0] + gained, real[0][1])  # and went on from there
    assert seen[3] == real[3] == (3, 0)  # a new marker: a reset, shown as read


def test_a_broker_that_cannot_be_read_says_so_and_the_rest_is_served(
    redis_url: str, redis_client: redis.Redis
) -> None:
    settings = gate_settings(redis_url, broker_url="redis://127.0.0.1:1/0")
    with serving(collector_for(settings)) as url:
        samples = scrape(url)
    assert value(samples, "gatekeeper_broker_up") == 0
    assert value(samples, "gatekeeper_redis_up") == 1
    assert by_label(samples, "gatekeeper_queue_messages", "queue") == {}


def test_a_gate_script_sent_twice_counts_its_decision_once(redis_client: redis.Redis) -> None:
    store = GateStore(redis_client, KEYS, horizon_s=1e9)
    keys, args = store.gate_call(gate_call(time.time(), job_id="twice", task="tests.embed"))
    for _ in range(2):  # a retrying client sends the very request again
        store._gate_reply(store._reply_now(keys, args))
    assert counters(redis_client) == {b"decided:admit_free:fits:tests.embed": b"1"}


def test_a_value_gatekeeper_did_not_write_is_left_out_not_a_failed_scrape(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A decision total that is not a whole number, a replayer pass that is not a time: the
    scrape still answers (redis up), without them; the other totals are served."""
    keys = Keys()
    redis_client.hset(keys.totals, "decided:defer:queue_age_cap:t1", "3.0x")
    redis_client.hset(keys.totals, "decided:admit_free:fits:t2", "4")
    redis_client.set(keys.replayer_last_pass, "abc")
    with serving(collector_for(gate_settings(redis_url))) as url:
        samples = scrape(url)
    assert value(samples, "gatekeeper_redis_up") == 1
    decided = by_label(samples, "gatekeeper_decisions_total", "task", "decision", "reason")
    assert decided == {("t2", "admit_free", "fits"): 4.0}, decided
