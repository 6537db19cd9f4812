"""The publish-time gate against a real Redis broker: each rule puts the task in its queue."""

from __future__ import annotations

import base64
import contextlib
import functools
import gc
import inspect
import json
import threading
import time
import types
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import before_task_publish
from click.testing import CliRunner
from kombu import Producer
from kombu.exceptions import OperationalError

from gatekeeper.celery.hook import install
from gatekeeper.core.ledger import window_id
from gatekeeper.errors import ConfigError
from gatekeeper.logs import DECISION_FIELDS
from gatekeeper.ops.cli import main
from gatekeeper.redis.flags import in_canary
from gatekeeper.redis.keys import ATTEMPTS, Keys
from gatekeeper.redis.owing import settle_all
from tests.apps.gated_app import create_app
from tests.conftest import clear_of_a_window_edge, gate_settings, queue_messages


def make_app(redis_url: str, **overrides: Any) -> Celery:
    return create_app(gate_settings(redis_url, **overrides), redis_url)


def lengths(client: redis.Redis) -> dict[str, int]:
    return {q: client.llen(q) for q in ("free", "defer", "reserved", "celery")}


def only_message(client: redis.Redis, queue: str) -> dict[str, Any]:
    (message,) = queue_messages(client, queue)
    return message


def reads_of(client: redis.Redis, action: Callable[[], Any]) -> int:
    """The socket reads the Redis server did while ``action`` ran: its round trips.

    A client connection opening or closing counts as a read too (the server reads its EOF),
    so unreachable clients are collected first and the collector is held off meanwhile, and
    a measure during which any connection to the server came or went (one another thread or
    an earlier test left) is taken again: the action runs again, at most three times in all.
    """

    def stats() -> tuple[int, int]:
        info = client.info("stats")
        return int(info["total_reads_processed"]), int(info["total_connections_received"])

    def clients() -> set[str]:
        return {str(entry["id"]) for entry in client.client_list()}

    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            held = clients()
            base, opened = stats()
            action()
            after, opened_after = stats()
            if opened_after == opened and clients() == held:
                break
        return after - base - 1  # the INFO that read the counter is one read
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("fast_publish", [True, False])
def test_admitted_task_lands_in_free_with_its_headers(
    redis_url: str, redis_client: redis.Redis, fast_publish: bool
) -> None:
    app = make_app(redis_url, fast_publish=fast_publish)
    before = time.time()
    result = app.tasks["tests.embed"].apply_async((1,))
    assert lengths(redis_client) == {"free": 1, "defer": 0, "reserved": 0, "celery": 0}
    headers = only_message(redis_client, "free")["headers"]
    assert headers["id"] == result.id
    assert headers["gatekeeper_decision"] == "admit_free"
    assert headers["gatekeeper_attempt"] == 1
    assert headers["gatekeeper_tokens_in"] == 100
    first = headers["gatekeeper_first_published_at"]
    assert before <= first <= time.time()
    assert headers["gatekeeper_deadline_at"] == pytest.approx(first + 60)


def test_age_cap_defers_when_the_free_queue_is_old(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url, max_queue_age_s=0.2)
    embed = app.tasks["tests.embed"]
    embed.delay(1)  # admitted, and nobody consumes free
    time.sleep(0.3)
    embed.delay(2)
    assert lengths(redis_client)["free"] == 1
    assert only_message(redis_client, "defer")["headers"]["gatekeeper_reason"] == "queue_age_cap"


def test_dwell_over_slack_goes_to_reserved(redis_url: str, redis_client: redis.Redis) -> None:
    app = make_app(redis_url)
    # service 1 + one retry 1 = dwell 2 against 1.5 s of slack
    app.tasks["tests.embed"].apply_async((1,), headers={"gatekeeper_deadline_s": 1.5})
    message = only_message(redis_client, "reserved")
    assert message["headers"]["gatekeeper_reason"] == "dwell_over_slack"


def test_bad_service_guess_defers(redis_url: str, redis_client: redis.Redis) -> None:
    app = make_app(redis_url)
    app.tasks["tests.embed"].apply_async((1,), headers={"gatekeeper_expected_service_s": 0})
    assert only_message(redis_client, "defer")["headers"]["gatekeeper_reason"] == (
        "bad_service_guess"
    )


@pytest.mark.parametrize("fast_publish", [True, False])
def test_budget_refusal_goes_to_reserved_with_a_rejected_row(
    redis_url: str, redis_client: redis.Redis, fast_publish: bool
) -> None:
    app = make_app(
        redis_url, budget_units=250, queue_wait_unit_per_second=0, fast_publish=fast_publish
    )
    embed = app.tasks["tests.embed"]
    clear_of_a_window_edge(900, 5)  # the three in one window, its rows read below
    ids = [embed.delay(n).id for n in range(3)]  # 100 tokens each: two fit in 250
    assert lengths(redis_client)["free"] == 2
    refused = only_message(redis_client, "reserved")["headers"]
    assert (refused["id"], refused["gatekeeper_reason"]) == (ids[2], "retry_tax_budget")
    rows_key = Keys().window_rows(window_id(time.time(), 900))
    (row,) = [json.loads(raw) for raw in redis_client.lrange(rows_key, 0, -1)]
    assert (row["job_id"], row["outcome"], row["path"], row["tokens_in"]) == (
        ids[2],
        "rejected",
        "free",
        0,
    )


def test_free_path_disabled_by_the_cli_is_obeyed_within_the_cache_time(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(redis_url, flag_cache_s=0.5)
    embed = app.tasks["tests.embed"]
    embed.delay(1)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(
        main, ["flags", "set", "free_path_enabled", "false", "--reason", "page 4411"]
    )
    assert result.exit_code == 0, result.output
    time.sleep(0.6)
    embed.delay(2)
    assert lengths(redis_client)["free"] == 1
    assert only_message(redis_client, "reserved")["headers"]["gatekeeper_reason"] == (
        "free_path_disabled"
    )


def test_gate_disabled_leaves_the_normal_route(redis_url: str, redis_client: redis.Redis) -> None:
    app = make_app(redis_url, dwell_gate_enabled=False)
    app.tasks["tests.embed"].delay(1)
    message = only_message(redis_client, "celery")
    assert not any(key.startswith("gatekeeper_") for key in message["headers"])


def test_only_the_canary_slice_is_gated(redis_url: str, redis_client: redis.Redis) -> None:
    app = make_app(redis_url, canary_percent=50, budget_units=1e9)
    ids = [app.tasks["tests.embed"].delay(n).id for n in range(40)]
    gated = {m["headers"]["id"] for m in queue_messages(redis_client, "free")}
    untouched = {m["headers"]["id"] for m in queue_messages(redis_client, "celery")}
    assert gated == {job for job in ids if in_canary(job, 50)}
    assert untouched == set(ids) - gated
    assert gated and untouched


def test_an_explicit_queue_is_overridden(redis_url: str, redis_client: redis.Redis) -> None:
    app = make_app(redis_url)
    app.tasks["tests.embed"].apply_async((1,), queue="celery", routing_key="celery")
    assert lengths(redis_client) == {"free": 1, "defer": 0, "reserved": 0, "celery": 0}


def test_a_task_router_is_overridden(redis_url: str, redis_client: redis.Redis) -> None:
    app = make_app(redis_url)
    app.conf.task_routes = {"tests.embed": {"queue": "celery"}}
    app.tasks["tests.embed"].delay(1)
    assert lengths(redis_client)["free"] == 1


@pytest.mark.parametrize("fast_publish", ["auto", "off"])
@pytest.mark.parametrize(
    "routes",
    [
        {"tests.embed": {"queue": "celery", "headers": {"gatekeeper_deadline_s": 1.5}}},
        [lambda name, args, kwargs, options, task=None, **kw: {"headers": {
            "gatekeeper_deadline_s": 1.5}}],
    ],
    ids=["mapping", "router function"],
)  # fmt: skip
def test_a_routes_gatekeeper_headers_are_decided_on_once(
    redis_url: str,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    routes: Any,
    fast_publish: str,
) -> None:
    # Routes that can add headers: the decision waits for them (no early start, no redo).
    app = make_app(redis_url, fast_publish=fast_publish)
    app.conf.task_routes = routes
    app.tasks["tests.embed"].delay(1)
    assert only_message(redis_client, "reserved")["headers"]["gatekeeper_reason"] == (
        "dwell_over_slack"
    )
    err = capsys.readouterr().err
    assert err.count("event=gate_decision") == 1 and "decision_redone" not in err


def test_ungated_tasks_are_never_touched(redis_url: str, redis_client: redis.Redis) -> None:
    app = make_app(redis_url, free_path_enabled=False)
    app.tasks["tests.plain"].apply_async(queue="celery")
    message = only_message(redis_client, "celery")
    assert not any(key.startswith("gatekeeper_") for key in message["headers"])


@pytest.mark.parametrize(
    ("headers", "field"),
    [
        ({"gatekeeper_tokens_in": -5}, "gatekeeper_tokens_in"),
        ({"gatekeeper_deadline_s": "soon"}, "gatekeeper_deadline_s"),
        ({"gatekeeper_deadline_at": "tomorrow"}, "gatekeeper_deadline_at"),
        ({"gatekeeper_expected_service_s": [1]}, "gatekeeper_expected_service_s"),
    ],
)
def test_bad_declared_inputs_reserve_and_name_the_field(
    redis_url: str,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    headers: dict[str, Any],
    field: str,
) -> None:
    app = make_app(redis_url)
    app.tasks["tests.embed"].apply_async((1,), headers=headers)
    routed = only_message(redis_client, "reserved")["headers"]
    assert routed["gatekeeper_reason"] == "bad_input"
    # Still an attempt with a first publish: it gets its row, and a retry keeps the clock.
    assert routed["gatekeeper_attempt"] == 1 and routed["gatekeeper_first_published_at"] > 0
    assert f"field={field}" in capsys.readouterr().err


def test_one_log_line_per_decision_with_every_field_and_no_arguments(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    app = make_app(redis_url)
    app.tasks["tests.embed"].apply_async(("PROMPT-SECRET",), headers={"gatekeeper_tokens_in": 7})
    lines = [line for line in capsys.readouterr().err.splitlines() if "event=gate_decision" in line]
    assert len(lines) == 1
    (line,) = lines
    for name in DECISION_FIELDS:
        assert f" {name}=" in f" {line}", name
    assert "decision=admit_free" in line and "reason=fits" in line
    assert "tokens=7" in line and "token_pressure=" in line
    assert "PROMPT-SECRET" not in line


def test_json_log_format(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    app = make_app(redis_url, log_format="json")
    app.tasks["tests.embed"].delay(1)
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "gate_decision" in ln]
    record = json.loads(line)
    assert set(DECISION_FIELDS) <= set(record)
    assert record["decision"] == "admit_free"


def test_installing_twice_returns_the_same_gate(redis_url: str) -> None:
    app = make_app(redis_url)
    first = install(app)
    assert install(app) is first
    assert app.amqp.send_task_message == first.send_task_message


def test_a_second_install_with_other_settings_is_refused_not_dropped(redis_url: str) -> None:
    # A rollback passed to a second install (free_path_enabled=False) was dropped unsaid: the
    # first install's settings stayed in force (an audit).
    app = Celery("twice", broker=redis_url)
    settings = gate_settings(redis_url)
    first = install(app, settings)
    assert install(app, settings) is first and install(app) is first  # the same, or nothing
    with pytest.raises(ConfigError, match="installed on this app already with other settings"):
        install(app, gate_settings(redis_url, free_path_enabled=False))
    with pytest.raises(ConfigError, match="another client"):
        install(app, settings, client=redis.Redis.from_url(redis_url))
    later = Celery("lazy", broker=redis_url)
    first_later = install(later)  # settings read at first use
    with pytest.raises(ConfigError):
        install(later, settings)
    assert install(later, first_later.settings) is first_later  # the same as it read them


def test_a_deadline_is_never_extended_by_a_later_override(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url)
    deadline = time.time() + 30
    app.tasks["tests.embed"].apply_async(
        (1,), headers={"gatekeeper_deadline_at": deadline, "gatekeeper_deadline_s": 9999}
    )
    headers = only_message(redis_client, "free")["headers"]
    assert headers["gatekeeper_deadline_at"] == deadline


def test_a_countdown_counts_in_the_dwell(redis_url: str, redis_client: redis.Redis) -> None:
    app = make_app(redis_url)
    # 180 s of countdown can never fit 60 s of slack: the free path would be a sure miss.
    app.tasks["tests.embed"].apply_async((1,), countdown=180)
    assert only_message(redis_client, "reserved")["headers"]["gatekeeper_reason"] == (
        "dwell_over_slack"
    )


def test_a_delayed_task_joins_the_free_queues_wait_when_it_is_due(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url, max_queue_age_s=1.0)
    before = time.time()
    job = app.tasks["tests.embed"].apply_async((1,), countdown=5).id
    due_ms = redis_client.zscore(Keys().free_waiting, f"{job}:1")
    assert due_ms is not None and due_ms >= (before + 5) * 1000
    headers = only_message(redis_client, "free")["headers"]
    assert headers["gatekeeper_attempt_published_at"] >= before + 5  # its wait starts then
    time.sleep(1.2)  # older than the cap since its publish, but not yet due: no veto
    app.tasks["tests.embed"].delay(2)
    assert lengths(redis_client)["free"] == 2


def test_a_freeze_in_redis_holds_for_a_publisher_with_a_cached_flag(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url, flag_cache_s=60)
    embed = app.tasks["tests.embed"]
    embed.delay(1)  # flags read and cached: free path on
    redis_client.hset(Keys().flags, "free_path_enabled", "false")
    embed.delay(2)  # the cache says on; the script reads the freeze itself
    assert lengths(redis_client)["free"] == 1
    assert only_message(redis_client, "reserved")["headers"]["gatekeeper_reason"] == (
        "free_path_disabled"
    )


def test_a_publish_the_broker_refuses_gives_back_what_the_gate_took(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # The ordinary path: the gate admits, then Celery publishes (fast publish does both at once).
    app = make_app(redis_url, fast_publish="off")
    gate = install(app)

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker down")

    gate.original_sender = broker_down
    with pytest.raises(OperationalError):  # Celery wraps the connection error
        app.tasks["tests.embed"].delay(1)
    keys = Keys()
    assert redis_client.hlen(keys.inflight) == 0
    assert redis_client.zcount(keys.free_waiting, "-inf", ATTEMPTS) == 0
    window = redis_client.hgetall(keys.window(window_id(time.time(), 900)))
    assert float(window.get(b"exposure", 0)) == 0
    assert int(window.get(b"admitted_free", 0)) == 0  # never published: not an admission


def test_a_publish_celery_refuses_to_build_takes_nothing_from_the_gate(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # Celery refuses to build the message (args must be a list) before the sender runs:
    # nothing is published, and the gate holds nothing for it.
    app = make_app(redis_url, fast_publish="off")
    install(app)
    with pytest.raises(TypeError, match="args must be a list"):
        app.send_task("tests.embed", args=5)
    keys = Keys()
    assert redis_client.hlen(keys.inflight) == 0
    assert redis_client.zcount(keys.free_waiting, "-inf", ATTEMPTS) == 0
    assert lengths(redis_client) == {"free": 0, "defer": 0, "reserved": 0, "celery": 0}
    window = redis_client.hgetall(keys.window(window_id(time.time(), 900)))
    assert int(window.get(b"admitted_free", 0)) == 0
    assert "event=gate_decision" not in capsys.readouterr().err


def test_one_gate_script_per_decision_on_the_ordinary_path(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url, fast_publish="off")
    install(app)
    app.tasks["tests.embed"].delay(0)  # the script loaded, whatever ran before
    redis_client.delete("free")
    redis_client.config_resetstat()
    result = app.tasks["tests.embed"].apply_async((1,), task_id="ordinary-1")
    calls = redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert calls == 1  # one gate script per decision
    assert only_message(redis_client, "free")["headers"]["id"] == result.id == "ordinary-1"


@pytest.mark.parametrize("fast_publish", ["auto", "off"])
def test_a_task_id_passed_by_position_is_still_gated(
    redis_url: str, redis_client: redis.Redis, fast_publish: str
) -> None:
    app = make_app(redis_url, fast_publish=fast_publish)
    app.send_task("tests.embed", (1,), None, None, None, "by-position")
    assert only_message(redis_client, "free")["headers"]["id"] == "by-position"


@pytest.mark.parametrize("fast_publish", ["auto", "off"])
def test_an_eta_counts_in_the_dwell(
    redis_url: str, redis_client: redis.Redis, fast_publish: str
) -> None:
    app = make_app(redis_url, fast_publish=fast_publish)
    eta = datetime.now(timezone.utc) + timedelta(seconds=180)
    app.tasks["tests.embed"].apply_async((1,), eta=eta)
    assert only_message(redis_client, "reserved")["headers"]["gatekeeper_reason"] == (
        "dwell_over_slack"
    )


def test_fast_publish_decides_and_publishes_in_one_round_trip(
    redis_url: str, redis_client: redis.Redis
) -> None:
    plain = make_app(redis_url)
    gated = make_app(redis_url, flag_cache_s=60, fast_publish=True)
    plain.tasks["tests.plain"].delay()  # connections, declarations and flags warm
    gated.tasks["tests.embed"].delay(0)
    plain_cost = reads_of(redis_client, plain.tasks["tests.plain"].delay)
    gated_cost = reads_of(redis_client, lambda: gated.tasks["tests.embed"].delay(1))
    assert gated_cost == plain_cost == 1
    headers = queue_messages(redis_client, "free")[-1]["headers"]
    assert (headers["gatekeeper_decision"], headers["gatekeeper_reason"]) == ("admit_free", "fits")
    assert not any("__gk_" in str(value) for value in headers.values())


def test_a_fast_publish_that_the_gate_defers_carries_no_placeholders(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url, fast_publish=True)
    app.tasks["tests.embed"].apply_async((1,), headers={"gatekeeper_deadline_s": 1.5})
    (message,) = queue_messages(redis_client, "reserved")
    headers = message["headers"]
    assert headers["gatekeeper_free_admitted"] is False and headers["gatekeeper_window"] is None
    assert message["properties"]["delivery_info"]["routing_key"] == "reserved"


def test_a_fast_publish_whose_script_fails_is_sent_once_to_reserved(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The script fails before pushing (the window's key holds a string): the message Celery
    already built is pushed to reserved, not built and sent a second time."""
    app = make_app(redis_url, fast_publish=True)
    now = window_id(time.time(), 900)
    for win in (now, now + 1):  # the publish may fall in the next window
        redis_client.set(Keys().window(win), "not a hash")
    fired: list[str] = []

    def count(sender: Any = None, headers: Any = None, **_: Any) -> None:
        fired.append(str(headers.get("id")))

    before_task_publish.connect(count, weak=False)
    try:
        result = app.tasks["tests.embed"].delay(1)
    finally:
        before_task_publish.disconnect(count)
    assert fired == [result.id]
    message = only_message(redis_client, "reserved")
    headers = message["headers"]
    assert headers["id"] == result.id
    assert (headers["gatekeeper_decision"], headers["gatekeeper_reason"]) == (
        "reserved",
        "gate_unavailable",
    )
    assert headers["gatekeeper_free_admitted"] is False
    assert message["properties"]["delivery_info"]["routing_key"] == "reserved"
    assert "__gk_" not in json.dumps(message)
    assert lengths(redis_client) == {"free": 0, "defer": 0, "reserved": 1, "celery": 0}
    assert redis_client.object("encoding", Keys().totals) == b"hashtable"  # as gate.lua's


def test_the_window_and_totals_of_decisions_made_in_process_are_hash_tables(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A night with the free path off: record.lua makes every decision, and creates the window
    # and the totals. They are hash tables from their first write, as gate.lua makes them (a
    # compact hash is searched field by field).
    app = make_app(redis_url, free_path_enabled=False)
    app.tasks["tests.embed"].delay(1)
    assert only_message(redis_client, "reserved")["headers"]["gatekeeper_reason"] == (
        "free_path_disabled"
    )
    pattern = Keys().window(0).removesuffix("0") + "*"
    windows = [k for k in redis_client.scan_iter(match=pattern) if not k.endswith(b":rows")]
    assert windows and all(redis_client.object("encoding", k) == b"hashtable" for k in windows)
    assert redis_client.object("encoding", Keys().totals) == b"hashtable"


def test_a_fast_publish_through_a_redis_stall_is_published_once(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Redis stalls past the gate's timeout (0.5 s): the script's reply times out, the
    fallback's first try too; when Redis wakes it runs the stalled script (which pushes),
    and the fallback, sent again, finds that push instead of adding a second copy."""
    app = make_app(redis_url, flag_cache_s=60)
    embed = app.tasks["tests.embed"]
    embed.delay(0)  # connections, script and flags warm
    redis_client.delete("free")
    staller = redis.Redis.from_url(redis_url)
    slept: list[Any] = []

    def sleep() -> None:
        slept.append(staller.execute_command("DEBUG", "SLEEP", "1.2"))

    stall = threading.Thread(target=sleep)
    stall.start()
    time.sleep(0.1)
    try:
        result = embed.delay(1)
    finally:
        stall.join()
    assert slept == [b"OK"]  # the server did stall (Redis 7 refuses DEBUG unless allowed)
    copies = {q: [m["headers"]["id"] for m in queue_messages(redis_client, q)].count(result.id)
              for q in ("free", "defer", "reserved")}  # fmt: skip
    assert sum(copies.values()) == 1, copies


@pytest.mark.parametrize("fast_publish", ["auto", "off"])
def test_a_task_id_published_twice_is_published_twice(
    redis_url: str, redis_client: redis.Redis, fast_publish: str
) -> None:
    # As Celery does; the second time through redis-py's own call (the script reloaded). The
    # first publish's record is live, so the second goes to reserved, unrecorded.
    app = make_app(redis_url, fast_publish=fast_publish)
    embed = app.tasks["tests.embed"]
    embed.apply_async((1,), task_id="twice")
    redis_client.script_flush()
    embed.apply_async((2,), task_id="twice")
    settle_all()  # a NOSCRIPT reply read later: the script loaded and run again then
    assert [m["headers"]["id"] for m in queue_messages(redis_client, "free")] == ["twice"]
    (second,) = queue_messages(redis_client, "reserved")
    assert second["headers"]["id"] == "twice"
    assert second["headers"]["gatekeeper_reason"] == "duplicate_publish"


def test_after_a_publish_that_cannot_take_fast_publish_the_next_ones_ask_again(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    def publish_reads(n: int) -> int:
        return reads_of(redis_client, lambda: embed.delay(n))

    app = make_app(redis_url, flag_cache_s=60)
    embed = app.tasks["tests.embed"]
    embed.delay(0)
    other_db = redis_url.rsplit("/", 1)[0] + "/3"
    with app.connection_for_write(other_db) as connection:
        embed.apply_async((1,), connection=connection)  # another database: not fast
    assert redis.Redis.from_url(other_db).llen("free") == 1
    assert publish_reads(2) == 1  # asked again at once: fast
    assert publish_reads(3) == 1
    assert publish_reads(4) == 1


class _BoundEachTime:
    """A class attribute that, like a wrapt wrapper, gives a new bound wrapper on each read."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self.call = call

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return functools.wraps(self.call)(lambda *args, **kwargs: self.call(*args, **kwargs))
        return types.MethodType(self.call, instance)


@contextlib.contextmanager
def publishes_watched(observer: str) -> Iterator[list[tuple[str, str]]]:
    """What an observer of publishes sees of each: its routing key and decision header.

    ``signal``: a ``before_task_publish`` receiver. The others wrap one of kombu's
    ``Producer`` methods, as tracers without Celery signals do: ``publish`` or ``_publish``
    with ``functools.wraps``, ``wrapt-like`` ``_publish`` with :class:`_BoundEachTime`.
    """
    seen: list[tuple[str, str]] = []

    def watch(routing_key: str = "", headers: Any = None, **_: Any) -> None:
        seen.append((routing_key, headers.get("gatekeeper_decision")))

    if observer == "signal":
        before_task_publish.connect(watch, weak=False)
        try:
            yield seen
        finally:
            before_task_publish.disconnect(watch)
        return
    name = "publish" if observer == "publish" else "_publish"
    original = Producer.__dict__[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def traced(self: Producer, *args: Any, **kwargs: Any) -> Any:
        watch(**signature.bind(self, *args, **kwargs).arguments)
        return original(self, *args, **kwargs)

    setattr(Producer, name, _BoundEachTime(traced) if observer == "wrapt-like" else traced)
    try:
        yield seen
    finally:
        setattr(Producer, name, original)


@pytest.mark.parametrize("observer", ["signal", "publish", "_publish", "wrapt-like"])
def test_auto_fast_publish_is_taken_only_while_nothing_observes_publishes(
    redis_url: str, redis_client: redis.Redis, observer: str
) -> None:
    app = make_app(redis_url, flag_cache_s=60)  # fast_publish = "auto", the default
    install(app)
    embed = app.tasks["tests.embed"]
    embed.delay(0)  # connections, declarations and flags warm
    assert reads_of(redis_client, lambda: embed.delay(1)) == 1  # fast: decided and pushed

    with publishes_watched(observer) as seen:
        embed.apply_async((2,), headers={"gatekeeper_deadline_s": 1.5})
        # A task id by position: the sender itself stands aside, whatever called it.
        app.send_task("tests.embed", (3,), None, None, None, "by-position",
                      headers={"gatekeeper_deadline_s": 1.5})  # fmt: skip
    # The observer saw the decisions, not the free queue and placeholders.
    assert seen == [("reserved", "reserved")] * 2
    reasons = [m["headers"]["gatekeeper_reason"] for m in queue_messages(redis_client, "reserved")]
    assert reasons == ["dwell_over_slack"] * 2
    assert reads_of(redis_client, lambda: embed.delay(4)) == 1  # observer gone: fast again


def test_auto_fast_publish_stands_aside_for_task_sent_events(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url)
    app.conf.task_send_sent_event = True
    events = redis_client.pubsub(ignore_subscribe_messages=True)
    events.psubscribe("*celeryev*")
    app.tasks["tests.embed"].apply_async((1,), headers={"gatekeeper_deadline_s": 1.5})
    event: dict[str, Any] = {}
    deadline = time.monotonic() + 5
    while not event and time.monotonic() < deadline:
        raw = events.get_message(timeout=0.5)
        if raw is not None:
            message = json.loads(raw["data"])
            event = json.loads(base64.b64decode(message["body"]))
    events.close()
    assert event["type"] == "task-sent" and event["queue"] == "reserved"
    assert lengths(redis_client)["reserved"] == 1

    app.tasks["tests.embed"].delay(2)  # and the next one, decided the ordinary way
    assert lengths(redis_client)["free"] == 1


def test_a_header_that_looks_like_a_placeholder_takes_the_ordinary_path(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url, fast_publish=True)
    app.tasks["tests.embed"].apply_async((1,), headers={"x_note": "__gk_queue__"})
    headers = only_message(redis_client, "free")["headers"]
    assert headers["x_note"] == "__gk_queue__" and headers["gatekeeper_decision"] == "admit_free"


@pytest.mark.parametrize("fast_publish", ["on", "off"])
def test_a_callers_id_header_is_the_id_decided_and_the_message_published_once(
    redis_url: str, redis_client: redis.Redis, fast_publish: str
) -> None:
    # Celery lets a caller's headers override its own, id included: the gate decides for the
    # id the message carries, and fast publish still recognises its own message.
    app = make_app(redis_url, fast_publish=fast_publish)
    app.tasks["tests.embed"].apply_async((1,), task_id="a", headers={"id": "b"})
    (message,) = [m for q in ("free", "defer", "reserved") for m in queue_messages(redis_client, q)]
    headers = message["headers"]
    assert headers["id"] == "b" and headers["gatekeeper_decision"] == "admit_free"
    nonce = redis_client.hget(Keys().run("b", 1), "nonce")
    assert nonce is not None and nonce.decode() == headers["gatekeeper_nonce"]
