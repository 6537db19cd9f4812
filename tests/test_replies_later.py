"""Fast publish's replies read later (``publish_replies = "later"``, gatekeeper/redis/later.py):
each message pushed once whatever happens to the reply, each decision logged once."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import before_task_publish

from gatekeeper.celery.hook import install
from gatekeeper.core.ledger import window_id
from gatekeeper.errors import LedgerUnavailable
from gatekeeper.lines import flush as flush_lines
from gatekeeper.ops.embedded import EmbeddedRedis
from gatekeeper.redis import owing, wire
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.owing import OWING, settle_all
from gatekeeper.redis.store import GateStore
from tests.apps.gated_app import create_app
from tests.conftest import REPO_ROOT, gate_settings, queue_messages
from tests.processes import stopped

QUEUES = ("free", "defer", "reserved", "celery")


@pytest.fixture(autouse=True)
def read_by_the_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replies are read by the next publish or the test (``settle_all``), not the settler
    thread, unless a test asks for it: a test looks at what is owed between its calls."""
    monkeypatch.setattr(owing, "SETTLE_AFTER_S", 3600.0)


def make_app(redis_url: str, **overrides: Any) -> Celery:
    """An app whose line is warm: the gate script loaded and answered on it (a line's first
    call, and one that meets ``NOSCRIPT``, are answered at once), so each publish from here
    on is sent with its reply read later."""
    values = {"flag_cache_s": 60, "budget_units": 1e9, **overrides}
    app = create_app(gate_settings(redis_url, **values), redis_url)
    app.tasks["tests.embed"].delay("warm")
    app.tasks["tests.embed"].delay("warm")
    settle_all()
    return app


def copies(client: redis.Redis, ids: list[str]) -> dict[str, Counter[str]]:
    """For each id, the queues holding a message with it (a Counter: queue -> copies)."""
    found: dict[str, Counter[str]] = {job: Counter() for job in ids}
    for queue in QUEUES:
        for message in queue_messages(client, queue):
            job = message["headers"]["id"]
            if job in found:
                found[job][queue] += 1
    return found


def wait_for_held(seconds: float) -> None:
    """Until no message is held or being sent again (the settler's pass), and nothing owed."""
    deadline = time.monotonic() + seconds
    while (OWING._held or OWING._sending.locked()) and time.monotonic() < deadline:
        settle_all()
        time.sleep(0.01)
    settle_all()


def elsewhere(found: dict[str, Counter[str]]) -> dict[str, Counter[str]]:
    """The ids not found exactly once, in free."""
    return {job: queues for job, queues in found.items() if queues != {"free": 1}}


def decision_lines(err: str) -> Counter[str]:
    """``job_id`` -> how many ``gate_decision`` lines name it."""
    return Counter(
        part.removeprefix("job_id=")
        for line in err.splitlines()
        if "event=gate_decision" in line
        for part in line.split()
        if part.startswith("job_id=")
    )


def owed(app: Celery) -> Any:
    channel = install(app).store._line.channel
    return channel.owed if channel is not None else None


def test_a_run_of_publishes_reads_each_reply_at_the_next_and_logs_each_once(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    ids = [embed.delay(i).id for i in range(30)]
    assert owed(app) is not None  # the last one's reply is still to be read
    settle_all()
    assert owed(app) is None
    found = copies(redis_client, ids)
    assert all(c == {"free": 1} for c in found.values()), {
        k: v for k, v in found.items() if v != {"free": 1}
    }
    lines = decision_lines(capsys.readouterr().err)
    assert all(lines[job] == 1 for job in ids), lines
    for message in queue_messages(redis_client, "free"):
        assert message["headers"]["gatekeeper_decision"] == "admit_free"
        assert "__gk_" not in str(message)


def test_an_idle_publishers_reply_is_read_by_the_settler_thread(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    embed.delay(0)
    last = embed.delay(1).id
    assert owed(app) is not None
    monkeypatch.setattr(owing, "SETTLE_AFTER_S", 0.005)
    deadline = time.monotonic() + 2
    while owed(app) is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert owed(app) is None  # read within milliseconds, no other publish needed
    assert decision_lines(capsys.readouterr().err)[last] == 1


def test_a_script_error_in_a_reply_read_later_sends_that_message_to_reserved_once(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    """The window's key turned into a string between two publishes: the script fails for the
    publish whose reply is owed; read at the next publish, its message goes to reserved
    through fallback.lua, and the next publish (whose script fails too) is answered at once."""
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    first = embed.delay(0).id
    settle_all()
    raw = redis.Redis.from_url(redis_url)
    raw.delete(*[Keys().window(w) for w in _windows()])
    for win in _windows():
        raw.set(Keys().window(win), "not a hash")
    second = embed.delay(1).id
    assert owed(app) is not None
    third = embed.delay(2).id
    assert owed(app) is None  # after an error reply: one call at a time again
    settle_all()
    found = copies(redis_client, [first, second, third])
    assert found[second] == {"reserved": 1} and found[third] == {"reserved": 1}, found
    assert found[first] == {"free": 1}
    for message in queue_messages(redis_client, "reserved"):
        assert message["headers"]["gatekeeper_reason"] == "gate_unavailable"
        assert "__gk_" not in str(message)
    lines = decision_lines(capsys.readouterr().err)
    assert [lines[job] for job in (first, second, third)] == [1, 1, 1]


def _windows() -> list[int]:
    now = window_id(time.time(), 900)
    return [now, now + 1]


@pytest.mark.parametrize("breaker_open_s", [0.0, 1.0])
def test_a_connection_killed_with_a_reply_owed_loses_no_message_and_pushes_none_twice(
    redis_url: str, redis_client: redis.Redis, breaker_open_s: float,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Every other client is killed while a reply is owed. The next publish's call goes out
    on the dead socket: both replies are lost. The owed one's script ran (its message is in
    free, and fallback.lua finds it there); the new one's never did (fallback.lua pushes it
    to reserved), unless the breaker, opened by the lost reply, refuses it: then it is held
    and sent once the breaker lets calls through again."""
    app = make_app(redis_url, breaker_open_s=breaker_open_s)
    embed = app.tasks["tests.embed"]
    ids = [embed.delay(0).id, embed.delay(1).id]
    assert owed(app) is not None
    time.sleep(0.001)  # (the owed script runs meanwhile, or not: either way one copy)
    killer = redis.Redis.from_url(redis_url)  # not redis_client: it would read the reply first
    killer.client_kill_filter(_type="normal", skipme=True)
    killer.close()
    try:
        ids.append(embed.delay(2).id)
    except Exception as exc:  # the caller's own publish may fail: it is then not sent
        pytest.fail(f"the publish raised {exc!r}")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        settle_all()
        found = copies(redis_client, ids)
        if all(sum(c.values()) for c in found.values()):
            break
        time.sleep(0.05)
    found = copies(redis_client, ids)
    assert all(sum(c.values()) == 1 for c in found.values()), found
    assert found[ids[0]] == {"free": 1}
    err = capsys.readouterr().err
    assert all(decision_lines(err)[job] == 1 for job in ids), err


@pytest.mark.parametrize("breaker_open_s", [0.0, 1.0])
def test_a_message_whose_fallback_cannot_reach_redis_is_held_and_sent_once_later(
    redis_url: str, redis_client: redis.Redis, breaker_open_s: float,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Redis pauses every client for 1.5 s just as a publish returns: its reply times out
    (0.3 s), its fallback push too (or the breaker refuses it): the message is held. When
    Redis wakes, the paused script and fallback run (one of them pushes, the other finds that
    push), and the held message's fallback, sent again, finds it too: one copy."""
    app = make_app(redis_url, breaker_open_s=breaker_open_s, redis_timeout_s=0.3)
    embed = app.tasks["tests.embed"]
    first = embed.delay(0).id
    settle_all()
    pauser = redis.Redis.from_url(redis_url)
    pauser.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    started = time.monotonic()
    second = embed.delay(1).id
    assert time.monotonic() - started < 0.3  # the caller did not wait for the paused server
    settle_all()  # the reply times out; the fallback cannot be pushed: held (and sent again)
    wait_for_held(10)
    assert not OWING._held
    found = copies(redis_client, [first, second])
    assert found[first] == {"free": 1} and sum(found[second].values()) == 1, found
    err = capsys.readouterr().err
    assert "event=held_publish_sent" in err and "held_publish_lost" not in err
    assert decision_lines(err)[second] == 1


def test_the_noscript_of_a_flushed_script_cache_is_answered_by_loading_it(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    ids = [embed.delay(0).id, embed.delay(1).id]
    redis.Redis.from_url(redis_url).script_flush()  # with a reply still owed
    ids += [embed.delay(i).id for i in range(2, 6)]
    settle_all()
    found = copies(redis_client, ids)
    assert all(c == {"free": 1} for c in found.values()), {
        k: v for k, v in found.items() if v != {"free": 1}
    }
    lines = decision_lines(capsys.readouterr().err)
    assert all(lines[job] == 1 for job in ids)


def test_publishes_from_inside_a_task_wait_for_their_replies(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A worker's task that publishes (retries, canvas, ``Task.replace``) waits, as before:
    the worker side's own scripts must come after those decisions."""
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    embed.delay(0)  # the line proven
    settle_all()

    @app.task(name="tests.fan_out", shared=False)
    def fan_out() -> list[str]:
        sent = [embed.delay(i).id for i in range(3)]
        assert owed(app) is None
        return sent

    ids = fan_out.apply().get()
    assert all(c == {"free": 1} for c in copies(redis_client, ids).values())


def test_publish_replies_now_waits_for_every_reply(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url, publish_replies="now")
    embed = app.tasks["tests.embed"]
    ids = [embed.delay(i).id for i in range(5)]
    assert owed(app) is None and not OWING._channels
    assert all(c == {"free": 1} for c in copies(redis_client, ids).values())


@pytest.mark.parametrize("ending", ["return", "sys.exit(3)"])
def test_a_process_that_exits_reads_its_last_reply_and_logs_it(
    redis_url: str, redis_client: redis.Redis, ending: str
) -> None:
    script = textwrap.dedent(f"""
        import sys
        from tests.apps.gated_app import create_app
        from tests.conftest import gate_settings
        app = create_app(gate_settings({redis_url!r}, flag_cache_s=60), {redis_url!r})
        ids = [app.tasks["tests.embed"].delay(i).id for i in range(5)]
        print(" ".join(ids))
        def main():
            {ending}
        main()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60, env=env)  # fmt: skip
    ids = done.stdout.split()
    assert len(ids) == 5, done.stderr
    assert all(c == {"free": 1} for c in copies(redis_client, ids).values())
    lines = decision_lines(done.stderr)
    assert all(lines[job] == 1 for job in ids), done.stderr


def test_a_forked_child_leaves_the_parents_owed_reply_to_the_parent(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    ids = [embed.delay(0).id, embed.delay(1).id]
    assert owed(app) is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: publishes on a line of its own, never reads the parent's
        code = 1
        try:
            os.close(read)
            child = [embed.delay(i).id for i in (2, 3)]
            settle_all()
            os.write(write, " ".join(child).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    with os.fdopen(read) as pipe:
        ids += pipe.read().split()
    settle_all()
    assert all(c == {"free": 1} for c in copies(redis_client, ids).values())
    lines = decision_lines(capsys.readouterr().err)
    assert [lines[job] for job in ids[:2]] == [1, 1], lines


def test_an_interrupt_while_a_reply_is_read_loses_no_message_and_pushes_none_twice(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Ctrl-C lands while a publish reads the reply owed before its own: the line is closed,
    both calls settled as lost (fallback.lua finds each script's push, or pushes to reserved
    the message whose script never ran), and the interrupt reaches the caller."""
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    ids = [embed.delay(0).id, embed.delay(1).id]
    assert owed(app) is not None
    read = wire.Channel._next

    def interrupted(self: wire.Channel) -> Any:
        monkeypatch.setattr(wire.Channel, "_next", read)
        raise KeyboardInterrupt

    monkeypatch.setattr(wire.Channel, "_next", interrupted)
    third = embed.s(2).freeze().id
    with pytest.raises(KeyboardInterrupt):
        embed.apply_async((2,), task_id=third)
    ids.append(third)
    wait_for_held(5)  # the interrupted call's message is held, sent again by the settler
    found = copies(redis_client, ids)
    assert all(sum(c.values()) == 1 for c in found.values()), found
    assert found[ids[0]] == {"free": 1}
    ids.append(embed.delay(3).id)  # the line is usable again
    wait_for_held(5)
    assert copies(redis_client, ids[-1:])[ids[-1]] == {"free": 1}
    lines = decision_lines(capsys.readouterr().err)
    assert all(lines[job] == 1 for job in ids), lines


def test_threads_publishing_at_once_each_on_its_own_line_push_every_message_once(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Four threads publish fifty each while the settler reads what they leave owed."""
    monkeypatch.setattr(owing, "SETTLE_AFTER_S", 0.0005)
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    ids: list[str] = []

    def publish(offset: int) -> None:
        for i in range(50):
            ids.append(embed.delay(offset + i).id)
            if i % 10 == 0:
                time.sleep(0.002)  # idle now and then: the settler reads a reply first

    threads = [threading.Thread(target=publish, args=(n * 100,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    settle_all()
    assert len(ids) == 200
    found = copies(redis_client, ids)
    assert not elsewhere(found), elsewhere(found)
    lines = decision_lines(capsys.readouterr().err)
    assert all(lines[job] == 1 for job in ids)


def test_an_ordinary_publish_waits_while_the_settler_reads_the_reply_owed_on_its_line(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The server stalls (DEBUG SLEEP 0.3) with a reply owed; the settler takes it and waits
    for it under the channel's lock. The same thread then makes an ordinary gated publish
    (a publish-signal receiver makes ``auto`` stand aside): it must wait for that lock, not
    read the owed reply as its own."""
    monkeypatch.setattr(owing, "SETTLE_AFTER_S", 0.0)
    app = make_app(redis_url)
    embed, store = app.tasks["tests.embed"], install(app).store
    sleeper = redis.Redis.from_url(redis_url)
    stall = threading.Thread(target=sleeper.execute_command, args=("DEBUG", "SLEEP", "0.3"))
    stall.start()
    time.sleep(0.05)
    owed_one = embed.delay(2).id
    time.sleep(0.03)  # the settler is reading it
    channel = store._line.channel
    assert channel.owed is None and channel.holder not in (0, threading.get_ident())

    def observer(**_: Any) -> None:
        pass

    before_task_publish.connect(observer, weak=False)
    try:
        ordinary = embed.delay(3).id
    finally:
        before_task_publish.disconnect(observer)
    stall.join()
    settle_all()
    assert store.breaker is not None and store.breaker.trips == 0
    found = copies(redis_client, [owed_one, ordinary])
    assert found == {owed_one: {"free": 1}, ordinary: {"free": 1}}, found
    err = capsys.readouterr().err
    for job in (owed_one, ordinary):
        (line,) = [ln for ln in err.splitlines() if "gate_decision" in ln and job in ln]
        assert "decision=admit_free" in line and "error=" not in line, line


def test_messages_held_by_several_threads_are_each_sent_once_and_the_settler_lives(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Six threads' scripts fail, and their first fallbacks cannot reach Redis: six held
    messages, sent again by the settler while the test settles too."""
    monkeypatch.setattr(owing, "PASS_S", 0.0005)
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    ready, go, ids = threading.Barrier(7), threading.Event(), []

    def publisher() -> None:
        embed.delay("warm")
        embed.delay("warm")  # this thread's line proven
        settle_all()
        ready.wait()
        go.wait()
        ids.append(embed.delay(2).id)  # owed: its script fails

    threads = [threading.Thread(target=publisher) for _ in range(6)]
    for thread in threads:
        thread.start()
    ready.wait()
    _break_the_windows(redis_url)
    refused_once: set[str] = set()
    guard, push_fallback = threading.Lock(), GateStore.push_fallback

    def refused(self: GateStore, push: Any, job_id: str, *args: Any, **kwargs: Any) -> Any:
        with guard:  # each job's first fallback cannot reach Redis; its next one can
            first = job_id not in refused_once
            refused_once.add(job_id)
        if first:
            raise LedgerUnavailable("the gate's Redis did not answer (a test)")
        return push_fallback(self, push, job_id, *args, **kwargs)

    monkeypatch.setattr(GateStore, "push_fallback", refused)
    go.set()
    for thread in threads:
        thread.join()
    settle_all()  # each script failed; each fallback refused: held
    wait_for_held(10)
    assert not OWING._held and not died and refused_once == set(ids)
    assert OWING._thread is not None and OWING._thread.is_alive()
    found = copies(redis_client, ids)
    assert len(ids) == 6 and all(c == {"reserved": 1} for c in found.values()), found
    err = capsys.readouterr().err
    assert err.count("event=held_publish_sent") == 6
    assert all(decision_lines(err)[job] == 1 for job in ids)


def _break_the_windows(redis_url: str) -> None:
    """The window keys made strings: gate.lua fails (an error reply)."""
    raw = redis.Redis.from_url(redis_url)
    for win in _windows():
        raw.delete(Keys().window(win))
        raw.set(Keys().window(win), "not a hash")


def test_an_interrupt_while_an_earlier_reply_is_settled_holds_that_message(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """An earlier publish returned; its script fails; Ctrl-C lands in its fallback push,
    made by the next publish: the earlier message is held and sent, with one decision line."""
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    raw = redis.Redis.from_url(redis_url)
    for win in _windows():
        raw.delete(Keys().window(win))
        raw.set(Keys().window(win), "not a hash")
    earlier = embed.delay(2).id  # sent, owed: its script fails
    push_fallback = GateStore.push_fallback

    def interrupted(self: GateStore, *args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(GateStore, "push_fallback", push_fallback)
        raise KeyboardInterrupt

    monkeypatch.setattr(GateStore, "push_fallback", interrupted)
    later_one = embed.s(3).freeze().id
    with pytest.raises(KeyboardInterrupt):
        embed.apply_async((3,), task_id=later_one)
    raw.delete(*[Keys().window(win) for win in _windows()])
    wait_for_held(5)
    found = copies(redis_client, [earlier, later_one])
    assert all(sum(c.values()) == 1 for c in found.values()), found
    lines = decision_lines(capsys.readouterr().err)
    assert lines[earlier] == 1 and lines[later_one] <= 1, lines


@pytest.mark.parametrize("inside", ["send", "settle"])
def test_a_publish_made_by_a_handler_on_a_thread_inside_its_lines_lock_does_not_deadlock(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, inside: str
) -> None:
    """A signal handler publishes while its thread reads a reply under the line's lock:
    ``send``, a fast publish reading the reply owed before its own; ``settle``, an in-process
    decision's ``record.lua`` reading it first. The handler's publishes (one decided in
    process, one ordinary) go through redis-py; each message lands once."""
    app = make_app(redis_url)
    embed = app.tasks["tests.embed"]
    ids = [embed.delay(0).id]  # owed
    handled: list[str] = []
    read = wire.Channel.owed_reply

    def handler_runs(self: wire.Channel) -> Any:
        if not handled:
            handled.append("x")
            handled.append(embed.apply_async((1,), headers={"gatekeeper_tokens_in": "x"}).id)
            before_task_publish.connect(observer, weak=False)
            try:
                handled.append(embed.delay(2).id)  # the ordinary path
            finally:
                before_task_publish.disconnect(observer)
        return read(self)

    def observer(**_: Any) -> None:
        pass

    monkeypatch.setattr(wire.Channel, "owed_reply", handler_runs)

    def publish() -> None:
        if inside == "send":
            ids.append(embed.delay(3).id)
        else:
            ids.append(embed.apply_async((3,), headers={"gatekeeper_tokens_in": "x"}).id)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "deadlocked"
    settle_all()
    found = copies(redis_client, ids + handled[1:])
    assert len(found) == 4 and all(sum(c.values()) == 1 for c in found.values()), found


def test_an_exit_while_the_settler_settles_a_reply_waits_for_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The settler has read a failed reply and is in its fallback push (the server paused)
    when the process exits: the exit waits for it; the message lands once, with its line."""
    script = textwrap.dedent(f"""
        import time, redis
        from tests.test_replies_later import _break_the_windows, make_app
        app = make_app({redis_url!r})
        _break_the_windows({redis_url!r})
        print(app.tasks["tests.embed"].delay("victim").id, flush=True)
        time.sleep(0.005)  # its error reply is back
        redis.Redis.from_url({redis_url!r}).execute_command("CLIENT", "PAUSE", "1500", "ALL")
        time.sleep(0.2)  # the settler has read it and waits in fallback.lua's round trip
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60, env=env)  # fmt: skip
    (victim,) = done.stdout.split()
    found = copies(redis_client, [victim])
    assert found[victim] == {"reserved": 1}, (found, done.stderr)
    assert decision_lines(done.stderr)[victim] == 1, done.stderr


def test_with_the_breaker_open_no_reply_owed_is_waited_for(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Eight threads owe a reply when the server hangs: the first read times out and opens
    the breaker; the others are settled as lost at once (held), not one timeout each, and
    sent once the server answers again."""
    app = make_app(redis_url, redis_timeout_s=0.3, breaker_open_s=0.5)
    embed = app.tasks["tests.embed"]
    ready, go, ids = threading.Barrier(9), threading.Event(), []

    def publisher() -> None:
        embed.delay("warm")
        embed.delay("warm")
        settle_all()
        ready.wait()
        go.wait()
        ids.append(embed.delay(2).id)

    threads = [threading.Thread(target=publisher) for _ in range(8)]
    for thread in threads:
        thread.start()
    ready.wait()
    sleeper = redis.Redis.from_url(redis_url)
    stall = threading.Thread(target=sleeper.execute_command, args=("DEBUG", "SLEEP", "2"))
    stall.start()
    time.sleep(0.05)
    go.set()
    for thread in threads:
        thread.join()
    started = time.monotonic()
    settle_all()
    assert time.monotonic() - started < 1.5  # about one timeout, not eight
    stall.join()
    wait_for_held(10)
    found = copies(redis_client, ids)
    assert len(ids) == 8 and all(sum(c.values()) == 1 for c in found.values()), found
    lines = decision_lines(capsys.readouterr().err)
    assert all(lines[job] == 1 for job in ids), lines


def _publish_in_a_child(url: str, broken: bool, conn: Any) -> None:
    owing.SETTLE_AFTER_S = 3600.0  # its last reply left to the exit
    app = make_app(url)
    ids = [app.tasks["tests.embed"].delay(i).id for i in range(2)]
    if broken:  # the last publish's script fails: fallback.lua must push it to reserved
        _break_the_windows(url)
    ids.append(app.tasks["tests.embed"].delay(2).id)
    conn.send(ids)


def _published_by_a_child(method: str, redis_url: str, broken: bool) -> list[str]:
    """The ids a ``multiprocessing`` child started by ``method`` published, once it ended."""
    context = multiprocessing.get_context(method)
    parent, child_end = context.Pipe()
    child = context.Process(target=_publish_in_a_child, args=(redis_url, broken, child_end))
    child.start()
    ids: list[str] = parent.recv()
    child.join(60)
    assert child.exitcode == 0
    return ids


@pytest.mark.parametrize("broken", [False, True])
def test_a_forkserver_child_that_imports_the_gate_itself_reads_its_last_reply(
    redis_url: str, redis_client: redis.Redis, broken: bool
) -> None:
    """A child that imports gatekeeper only after it started (``forkserver``, Python 3.14's
    default on Linux; ``spawn``) leaves by ``os._exit`` too: the settler registers its exit
    pass as a finalizer when it starts there."""
    ids = _published_by_a_child("forkserver", redis_url, broken)
    found = copies(redis_client, ids)
    assert all(sum(c.values()) == 1 for c in found.values()), found


@pytest.mark.parametrize("broken", [False, True])
def test_a_multiprocessing_child_reads_its_last_reply_before_it_leaves(
    redis_url: str, redis_client: redis.Redis, capfd: pytest.CaptureFixture[str], broken: bool
) -> None:
    """A ``multiprocessing`` child leaves by ``os._exit`` after its finalizers (no atexit)."""
    ids = _published_by_a_child("fork", redis_url, broken)
    found = copies(redis_client, ids)
    assert all(sum(c.values()) == 1 for c in found.values()), found
    flush_lines()
    lines = decision_lines(capfd.readouterr().err)
    assert [lines[job] for job in ids] == [1, 1, 1], lines


@pytest.mark.parametrize("breaker_open_s", [2.0, 0.0])
def test_a_message_held_at_exit_is_tried_even_with_the_breaker_open(
    redis_url: str, redis_client: redis.Redis, breaker_open_s: float
) -> None:
    """The settler's fallback timed out while Redis was paused, which opened the breaker;
    Redis answers again just as the process exits, before the breaker's probe: the exit's
    last tries go through all the same, and the message lands once."""
    script = textwrap.dedent(f"""
        import time, redis
        from gatekeeper.redis import owing
        from tests.test_replies_later import _break_the_windows, make_app
        owing.SETTLE_AFTER_S = 0.005
        app = make_app({redis_url!r}, redis_timeout_s=0.3, breaker_open_s={breaker_open_s})
        _break_the_windows({redis_url!r})
        print(app.tasks["tests.embed"].delay("victim").id, flush=True)
        time.sleep(0.002)
        redis.Redis.from_url({redis_url!r}).execute_command("CLIENT", "PAUSE", "1300", "ALL")
        time.sleep(1.25)  # held: its fallback and a first try again timed out
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60, env=env)  # fmt: skip
    (victim,) = done.stdout.split()
    assert copies(redis_client, [victim])[victim] == {"reserved": 1}, done.stderr
    assert "held_publish_lost" not in done.stderr, done.stderr


@pytest.mark.parametrize("breaker_open_s", [2.0, 0.0])
def test_an_exit_with_the_gates_redis_hung_gives_a_held_message_up_in_about_its_bound(
    redis_url: str, gate_server: EmbeddedRedis, breaker_open_s: float
) -> None:
    """The README's bound: a held message is tried at exit for ``2 x redis_timeout_s`` more,
    then given up with ``held_publish_lost``; the exit waits no longer than that, its last
    reply's read and fallback, and one last try's timeout (a server that never answers
    again: SIGSTOPped)."""
    timeout_s = 0.3
    script = textwrap.dedent(f"""
        import sys, time
        from gatekeeper.redis import owing
        from tests.test_replies_later import _break_the_windows, make_app
        owing.SETTLE_AFTER_S = 3600.0  # its reply left to the exit
        url = {gate_server.url!r}
        app = make_app(url, redis_timeout_s={timeout_s}, breaker_open_s={breaker_open_s})
        _break_the_windows(url)  # its script fails: its fallback must reach Redis
        print(app.tasks["tests.embed"].delay("victim").id, flush=True)
        sys.stdin.readline()  # the server is stopped now: the exit reads the reply (or times
        print("exiting", flush=True)  # out), its fallback times out, the message is held
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=REPO_ROOT, env=env)  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        victim = child.stdout.readline().strip()
        with stopped(gate_server.process):
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "exiting"
            exiting = time.monotonic()
            _, err = child.communicate(timeout=30)
            took = time.monotonic() - exiting
    finally:
        child.kill()
    assert victim and child.returncode == 0, err
    assert "held_publish_lost" in err and victim in err, err
    # The reply and its fallback (two timeouts at most), the bound, a try begun before its
    # end, and the interpreter's exit; made ten times longer, the bound takes 6 s and more.
    assert took < 2 * timeout_s + 3 * timeout_s + 2.0, (took, err)
