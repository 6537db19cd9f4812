"""A run's start is sent before its body and read after it (gatekeeper/redis/run_start.py).

What must hold although the worker does not wait: the start is applied while the run goes on
(the sweep sees it), a lost reply is asked for again without counting a second run, a server
without the script still gets the start before the body runs on a new connection, and replies
on one thread's line never reach another's call.
"""

from __future__ import annotations

import threading
import time

import redis

from gatekeeper.core.ledger import window_id
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.run_start import StartCall
from gatekeeper.redis.runs import RunLedger
from gatekeeper.redis.sent import call_script

KEYS = Keys()
T0_MS = 1_800_000_000_000
WINDOW = window_id(T0_MS / 1000, 900)


def ledger(client: redis.Redis) -> RunLedger:
    return RunLedger(client, KEYS, window_seconds=900, queue_wait_unit_per_second=200)


def decided(client: redis.Redis, job: str, tokens_in: int = 1200) -> None:
    """The gate's record of ``job``'s attempt 1, nonce ``n-<job>`` (``tokens_in``: a field of
    the gate's alone, not of the start's, tells one job's reply from another's)."""
    client.hset(KEYS.run(job, 1), mapping={"nonce": f"n-{job}", "decision": "admit_free",
                                           "window": WINDOW, "tokens_in": tokens_in,
                                           "dwell_s": "28.0"})  # fmt: skip


def applied(client: redis.Redis, job: str) -> bool:
    return client.zscore(KEYS.started, f"{job}:1") is not None


def wait_applied(client: redis.Redis, job: str) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if applied(client, job):
            return True
        time.sleep(0.01)
    return False


def one_run(client: redis.Redis, call: StartCall) -> None:
    """The start's reply counts run 1, and Redis holds one run of the attempt."""
    assert call.started().run == 1
    assert client.hget(KEYS.run("job", 1), "runs") == b"1"


def warm(runs: RunLedger, client: redis.Redis) -> None:
    """One start read to its end, so the line's connection has answered a script call."""
    decided(client, "warm")
    runs.start("warm", 1, "n-warm", {}, T0_MS)


def test_a_start_is_applied_before_its_reply_is_read(redis_client: redis.Redis) -> None:
    runs = ledger(redis_client)
    warm(runs, redis_client)
    decided(redis_client, "job")
    call = runs.send_start("job", 1, "n-job", {"worker": "w1"}, T0_MS + 100)
    assert wait_applied(redis_client, "job")  # nobody has read the reply yet
    assert runs.fields("job", 1)["worker"] == "w1"  # the worker's own fields, read back laid out
    started = call.started()
    assert (started.run, started.dead_run) == (1, 0)
    assert started.record is not None and started.record.started_ms == T0_MS + 100


def test_a_reply_lost_with_its_connection_is_asked_again_and_counts_one_run(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    warm(runs, redis_client)
    decided(redis_client, "job")
    call = runs.send_start("job", 1, "n-job", {}, T0_MS + 100)
    assert wait_applied(redis_client, "job")
    redis_client.client_kill_filter(_type="normal", skipme=True)  # the line's reply is lost
    started = call.started()
    assert (started.run, started.dead_run, started.dead) == (1, 0, None)
    assert redis_client.hget(KEYS.run("job", 1), "runs") == b"1"


def test_on_a_new_connection_a_server_without_the_script_gets_the_start_at_once(
    redis_client: redis.Redis,
) -> None:
    redis_client.script_flush()  # as after a failover to a replica, or a restart
    decided(redis_client, "job")
    call = ledger(redis_client).send_start("job", 1, "n-job", {}, T0_MS + 100)
    assert applied(redis_client, "job")  # read (and loaded) before the body would run
    one_run(redis_client, call)


def test_a_script_flushed_under_a_connected_line_is_applied_when_the_run_ends(
    redis_client: redis.Redis,
) -> None:
    """The documented exception: nothing applied until the reply is read, then once."""
    runs = ledger(redis_client)
    warm(runs, redis_client)
    redis_client.script_flush()
    decided(redis_client, "job")
    call = runs.send_start("job", 1, "n-job", {}, T0_MS + 100)
    time.sleep(0.1)
    assert not applied(redis_client, "job")
    one_run(redis_client, call)
    assert applied(redis_client, "job")


def test_a_second_start_while_one_awaits_its_reply_goes_through_redis_py(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    warm(runs, redis_client)
    decided(redis_client, "outer", tokens_in=1)
    decided(redis_client, "inner", tokens_in=2)
    outer = runs.send_start("outer", 1, "n-outer", {}, T0_MS)
    inner = runs.send_start("inner", 1, "n-inner", {}, T0_MS)  # a task run inside a task
    inner_started, outer_started = inner.started(), outer.started()
    assert inner_started.record is not None and inner_started.record.tokens_in == 2
    assert outer_started.record is not None and outer_started.record.tokens_in == 1


def test_threads_with_starts_in_flight_each_read_their_own_reply(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    jobs = [f"job{i}" for i in range(8)]
    for number, job in enumerate(jobs):
        decided(redis_client, job, tokens_in=number)
    sent = threading.Barrier(len(jobs))
    tokens: dict[str, int] = {}

    def run(job: str) -> None:
        warm_job = f"warm-{job}"
        decided(redis_client, warm_job)
        runs.start(warm_job, 1, f"n-{warm_job}", {}, T0_MS)  # this thread's line, connected
        call = runs.send_start(job, 1, f"n-{job}", {}, T0_MS)
        sent.wait()  # every thread's reply waits on its own line
        record = call.started().record
        tokens[job] = record.tokens_in if record is not None else -1

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert tokens == {job: number for number, job in enumerate(jobs)}


def test_a_client_of_one_connection_has_no_line_and_waits_for_the_start(
    redis_url: str, redis_client: redis.Redis
) -> None:
    single = redis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        decided(redis_client, "job")
        call = ledger(single).send_start("job", 1, "n-job", {}, T0_MS)
        assert applied(redis_client, "job")  # before the body would run
        one_run(redis_client, call)
    finally:
        single.close()


def test_a_start_inside_a_run_whose_start_awaits_its_reply_is_applied_at_once(
    redis_client: redis.Redis,
) -> None:
    runs = ledger(redis_client)
    warm(runs, redis_client)
    decided(redis_client, "outer")
    decided(redis_client, "inner")
    outer = runs.send_start("outer", 1, "n-outer", {}, T0_MS)
    runs.send_start("inner", 1, "n-inner", {}, T0_MS)  # the line is busy with outer's reply
    assert applied(redis_client, "inner")
    assert outer.started().run == 1


def test_after_a_failover_whose_first_script_was_another_the_next_start_is_applied_at_once(
    redis_client: redis.Redis,
) -> None:
    """A line knows which scripts its connection has had answered, not only that it has
    answered one: after a reconnection the run's finish may load its own script alone."""
    runs = ledger(redis_client)
    warm(runs, redis_client)
    redis_client.script_flush()  # a replica promoted, or a restart: no scripts, no clients
    redis_client.client_kill_filter(_type="normal", skipme=True)
    assert runs.line is not None
    other = redis_client.register_script("return {1}")  # as finish.lua, first on the new one
    assert call_script(runs.line, redis_client, other, [], []) == [1]
    decided(redis_client, "job")
    call = runs.send_start("job", 1, "n-job", {}, T0_MS)
    assert applied(redis_client, "job")
    one_run(redis_client, call)
