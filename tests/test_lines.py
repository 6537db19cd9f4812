"""Lines written off the caller's path (gatekeeper/lines.py): every line once, in order, within
``log_buffer_s``, at a task's end, across a fork, at exit; never a failed caller."""

from __future__ import annotations

import io
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from gatekeeper.lines import LINES, MIN_INTERVAL_S, MOST_QUEUED, Lines, flush
from gatekeeper.logs import make_logger
from gatekeeper.settings import GatekeeperSettings
from tests.apps.gated_app import create_app
from tests.conftest import REPO_ROOT, gate_settings, running_worker, wait_until


def logger(stream: Any, buffer_s: float = 5.0) -> Any:
    return make_logger(GatekeeperSettings(log_buffer_s=buffer_s), "decision", stream=stream)


def test_a_line_waits_for_the_flush_and_is_written_once() -> None:
    stream = io.StringIO()
    logger(stream).info("gate_decision", job_id="j")
    assert stream.getvalue() == ""  # queued, not yet rendered (5 s interval)
    flush()
    flush()
    (line,) = stream.getvalue().splitlines()
    assert "event=gate_decision job_id=j" in line


def test_without_a_flush_the_thread_writes_within_the_interval() -> None:
    stream = io.StringIO()
    logger(stream, buffer_s=0.05).info("gate_decision", job_id="soon")
    assert wait_until(lambda: "job_id=soon" in stream.getvalue(), timeout_s=5)


def test_zero_writes_each_line_in_the_call() -> None:
    stream = io.StringIO()
    logger(stream, buffer_s=0).info("gate_decision", job_id="now")
    assert "job_id=now" in stream.getvalue()


def test_lines_of_many_threads_and_loggers_keep_their_order_and_count() -> None:
    stream, other = io.StringIO(), io.StringIO()
    first, second = logger(stream), logger(other)

    def log(n: int) -> None:
        for i in range(500):
            (first if i % 2 else second).info("e", thread=n, i=i)

    threads = [threading.Thread(target=log, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    flush()
    for out, parity in ((stream, 1), (other, 0)):
        seen = [tuple(map(int, found)) for found in
                re.findall(r"thread=(\d+) i=(\d+)", out.getvalue())]  # fmt: skip
        assert len(seen) == 4 * 250
        for n in range(4):
            assert [i for t, i in seen if t == n] == list(range(parity, 500, 2))


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_a_line_that_cannot_be_rendered_is_named_and_the_others_written() -> None:
    stream = io.StringIO()
    log = logger(stream)
    log.info("before")
    log.info("broken", value=Unprintable())
    log.info("after")
    flush()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "event=before" in lines[0] and "event=after" in lines[2]
    assert lines[1].startswith("ts=") and lines[1].endswith(
        " level=error logger=gatekeeper.decision event=log_render_failed lost_event=broken"
        " error=RuntimeError"
    )


def test_a_closed_stream_loses_its_lines_without_failing_the_caller() -> None:
    closed, open_ = io.StringIO(), io.StringIO()
    logger(closed).info("gone")
    logger(open_).info("kept")
    closed.close()
    flush()  # raises nothing
    assert "event=kept" in open_.getvalue()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_neither_repeats_nor_loses_the_parents_lines(tmp_path: Path) -> None:
    path = tmp_path / "lines.log"
    with path.open("w") as stream:
        log = logger(stream)
        log.info("parent_before_fork")
        pid = os.fork()
        if pid == 0:  # the child: its own line, written at its exit
            try:
                log.info("child_line")
                flush()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        log.info("parent_after_fork")
        flush()
    events = re.findall(r"event=(\w+)", path.read_text())
    assert sorted(events) == ["child_line", "parent_after_fork", "parent_before_fork"]
    assert events.index("parent_before_fork") < events.index("child_line")
    assert not LINES._queue


def test_an_interrupt_after_a_chunk_is_written_writes_no_line_twice() -> None:
    class Interrupting(io.StringIO):
        fired = False

        def write(self, text: str) -> int:
            written = super().write(text)
            if not Interrupting.fired:  # Ctrl-C just after the first chunk's write
                Interrupting.fired = True
                raise KeyboardInterrupt
            return written

    lines, sink = Lines(), Interrupting()
    lines.interval = 3600.0  # the thread asleep: this thread drains, as at a task's end
    for n in range(300):  # more than one chunk (256 lines)
        lines.put(sink, lambda _l, _m, e: e["event"], {"event": f"line{n}"})
    with pytest.raises(KeyboardInterrupt):
        lines.flush()
    lines.flush()
    written = sink.getvalue().splitlines()
    assert sorted(written) == sorted(f"line{n}" for n in range(300))


def test_a_multiprocessing_childs_lines_are_written_when_it_ends(tmp_path: Path) -> None:
    path = tmp_path / "lines.log"
    with path.open("w") as stream:
        log = logger(stream)  # the child's line written at its end, not in the call
        context = multiprocessing.get_context("fork")
        child = context.Process(target=log.info, args=("child_line",))
        child.start()
        child.join(30)
    assert child.exitcode == 0
    assert re.findall(r"event=(\w+)", path.read_text()) == ["child_line"]


def test_a_process_that_exits_writes_its_queued_lines(tmp_path: Path) -> None:
    script = (
        "from gatekeeper.logs import make_logger\n"
        "from gatekeeper.settings import GatekeeperSettings\n"
        "make_logger(GatekeeperSettings(log_buffer_s=5)).info('at_exit', n=1)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "event=at_exit n=1" in done.stderr, done.stderr


@pytest.mark.celery
def test_a_childs_lines_are_written_at_its_tasks_end_before_it_is_killed(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The flaky task's retry is decided (and logged) in the prefork child; the next task
    SIGKILLs that child at once, long before its thread would write a 5 s buffer."""
    app = create_app(gate_settings(redis_url), redis_url)
    log_path = tmp_path / "worker.log"
    with running_worker(redis_url, log_path, GATEKEEPER_LOG_BUFFER_S="5"):
        job = app.tasks["tests.flaky"].delay().id
        app.tasks["tests.die"].apply_async(queue="free")
        retried = f"job_id={job} attempt=2"
        assert wait_until(lambda: "WorkerLostError" in log_path.read_text(errors="replace"),
                          timeout_s=60), log_path.read_text(errors="replace")  # fmt: skip
        text = log_path.read_text(errors="replace")
    decided = [line for line in text.splitlines() if "event=gate_decision" in line]
    assert [line for line in decided if retried in line], text


def test_a_queue_past_its_bound_is_written_by_the_caller() -> None:
    stream = io.StringIO()
    log = logger(stream)
    for i in range(MOST_QUEUED + 5):
        log.info("e", i=i)
        assert len(LINES._queue) <= MOST_QUEUED + 1
    flush()
    assert stream.getvalue().count("event=e ") == MOST_QUEUED + 5


class Chatty:
    def __init__(self, stream: io.StringIO) -> None:
        self.log = logger(stream)

    def __str__(self) -> str:
        self.log.info("from_str")
        flush()  # re-entered from inside a flush: returns, its line follows in the next pass
        return "chatty"


def test_a_value_that_logs_while_rendered_neither_hangs_nor_reorders_the_flush() -> None:
    stream = io.StringIO()
    log = logger(stream)
    log.info("first")
    log.info("outer", value=Chatty(stream))
    log.info("last")
    done = threading.Thread(target=flush, daemon=True)
    done.start()
    done.join(timeout=10)
    assert not done.is_alive()
    flush()
    assert re.findall(r"event=(\w+)", stream.getvalue()) == ["first", "outer", "last", "from_str"]


class Refusing(io.StringIO):
    def write(self, text: str) -> int:
        raise RuntimeError("reentrant call inside <_io.BufferedWriter>")


def test_a_stream_that_raises_neither_fails_the_caller_nor_stops_the_thread() -> None:
    broken, good = Refusing(), io.StringIO()
    logger(broken, buffer_s=0.05).info("lost")
    flush()  # raises nothing
    assert LINES._thread is not None and LINES._thread.is_alive()
    logger(good, buffer_s=0.05).info("kept")
    assert wait_until(lambda: "event=kept" in good.getvalue(), timeout_s=5)


def test_a_dead_thread_is_started_again_by_the_next_line() -> None:
    stream = io.StringIO()
    logger(stream, buffer_s=0.05).info("before")
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    LINES._thread = dead  # as if the thread had died
    logger(stream, buffer_s=0.05).info("after")
    assert LINES._thread is not dead and LINES._thread.is_alive()
    assert wait_until(lambda: "event=after" in stream.getvalue(), timeout_s=5)


def test_the_smallest_interval_asked_wins_and_none_spins() -> None:
    lines = Lines()
    lines.want(2.0)
    assert lines.interval == 2.0
    lines.want(0.5)
    lines.want(3.0)
    assert lines.interval == 0.5
    lines.want(1e-9)
    assert lines.interval == MIN_INTERVAL_S


def test_lines_are_written_while_a_producer_never_pauses() -> None:
    stream = io.StringIO()
    log = logger(stream, buffer_s=0.05)
    until, logged, written_during = time.monotonic() + 1.0, 0, False
    while time.monotonic() < until and not written_during:
        log.info("steady", i=logged)
        logged += 1
        written_during = logged % 100 == 0 and "event=steady" in stream.getvalue()
    assert written_during  # a pass writes what was queued when it began, not all that follows
    flush()


def _log_and_return(path: str) -> None:
    stream = open(path, "w")  # noqa: SIM115 (the child's own: left open, as a log file is)
    make_logger(GatekeeperSettings(), "decision", stream=stream).info("spawned_child_line")


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_multiprocessing_child_that_imported_gatekeeper_itself_writes_its_last_lines(
    tmp_path: Path, method: str
) -> None:
    # It leaves by os._exit after its finalizers, without atexit: a line queued in its
    # last log_buffer_s would be lost with its queue.
    path = tmp_path / "child.log"
    child = multiprocessing.get_context(method).Process(target=_log_and_return, args=(str(path),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert "event=spawned_child_line" in path.read_text()
