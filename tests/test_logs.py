"""The key=value renderer: grep-able during a page; ``stdlib`` lines in the app's handlers."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import Celery

import gatekeeper
from gatekeeper.lines import flush
from gatekeeper.logs import TEXTS_KEPT, KeyValueRenderer, LineWriter, make_logger
from gatekeeper.settings import GatekeeperSettings


def render(**event: object) -> str:
    return KeyValueRenderer(("event", "decision"))(None, "info", dict(event))


def test_known_keys_come_first_then_the_rest_in_order() -> None:
    assert render(z=1, decision="defer", event="e") == "event=e decision=defer z=1"


def test_booleans_render_as_true_and_false_for_grep() -> None:
    assert render(slack_miss=True, frozen=False) == "slack_miss=true frozen=false"


def test_values_with_spaces_or_quotes_are_quoted() -> None:
    assert render(reason='a b "c"') == r'reason="a b \"c\""'
    assert render(empty="") == 'empty=""'


def test_a_value_cannot_hold_a_key_value_pair_of_its_own() -> None:
    # README's page greps ('decision=admit_free' | 'slack_miss=true') must match the fields,
    # never a task id or error text a caller chose; JSON still reads the value back.
    forged = 'x decision=admit_free slack_miss=true "a=b\\='
    line = render(decision="reserved", job_id=forged)
    assert "decision=admit_free" not in line and "slack_miss=true" not in line, line
    assert line.startswith("decision=reserved job_id=")
    assert json.loads(line.split("job_id=", 1)[1]) == forged


def test_a_lone_surrogate_is_escaped_so_a_strict_utf8_log_keeps_the_line() -> None:
    # A task id from a file name decoded with surrogateescape: the line, and the lines
    # written with it, would not encode; quoted, JSON escapes it and reads it back.
    job = "embed-" + b"caf\xe9.txt".decode("utf-8", "surrogateescape")
    line = render(decision="reserved", job_id=job)
    line.encode("utf-8")  # strict, as a log file writes
    assert json.loads(line.split("job_id=", 1)[1]) == job


def test_floats_to_the_millisecond_and_none_as_empty() -> None:
    assert render(dwell_s=28.00049, x=None) == "dwell_s=28.0 x="


def test_a_text_value_renders_the_same_once_the_renderers_kept_texts_are_full() -> None:
    renderer = KeyValueRenderer(("event",))
    for n in range(3 * TEXTS_KEPT):  # unique values fill and empty what it keeps
        assert (
            renderer(None, "info", {"event": "e", "job_id": f"j {n}"}) == f'event=e job_id="j {n}"'
        )
        assert renderer(None, "info", {"reason": "a=b"}) == 'reason="a\\u003db"'
    assert len(renderer._texts) <= TEXTS_KEPT


FIELDS = {"task": "t x", "job_id": "j=1", "attempt": 1, "queue_age_s": 0.0123456,
          "dwell_s": None, "slack_miss": True, "extra": [1, 2]}  # fmt: skip


@pytest.mark.parametrize("log_format", ["kv", "json", "stdlib"])
@pytest.mark.parametrize("log_level", ["info", "warning"])
@pytest.mark.parametrize("log_buffer_s", [0.1, 0.0])
def test_the_decision_lines_writer_writes_what_the_loggers_own_call_writes(
    log_format: str, log_level: str, log_buffer_s: float, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    settings = GatekeeperSettings(log_format=log_format, log_level=log_level,
                                  log_buffer_s=log_buffer_s)  # fmt: skip
    written = []
    for way in ("own", "writer"):
        stream = io.StringIO()
        log = make_logger(settings, "decision", stream=stream)
        monkeypatch.setattr("time.time", lambda: 1_700_000_000.25)  # the same ts= in both
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="gatekeeper"):
            for level in ("debug", "info", "warning", "error"):
                if way == "own":
                    getattr(log, level)("gate_decision", **FIELDS)
                else:
                    LineWriter(log).write(level, "gate_decision", dict(FIELDS))
            monkeypatch.undo()
            flush()
        written.append(stream.getvalue() + "".join(r.getMessage() for r in caplog.records))
    assert written[0] == written[1]
    assert written[0].count("gate_decision") == (3 if log_level == "info" else 2)


def test_the_decision_lines_writer_calls_any_other_logger_as_it_is() -> None:
    calls = []

    class Logger:
        def warning(self, event: str, **fields: object) -> None:
            calls.append((event, fields))

    LineWriter(Logger()).write("warning", "gate_decision", {"job_id": "j"})
    assert calls == [("gate_decision", {"job_id": "j"})]


def test_make_logger_writes_one_line_with_logger_name() -> None:
    stream = io.StringIO()
    make_logger(GatekeeperSettings(), "decision", stream=stream).info("gate_decision", job_id="j")
    flush()  # written by gatekeeper/lines.py's thread otherwise
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("ts=") and "level=info logger=gatekeeper.decision" in line
    assert "event=gate_decision job_id=j" in line


def test_debug_lines_are_dropped_at_info_level() -> None:
    stream = io.StringIO()
    log = make_logger(GatekeeperSettings(), "decision", stream=stream)
    log.debug("gate_skipped")
    log.info("gate_decision")
    flush()
    assert "event=gate_decision" in stream.getvalue()
    assert "gate_skipped" not in stream.getvalue()


class Kept(logging.Handler):
    """An application's handler: keeps each record and the thread that emitted it."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[logging.LogRecord, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record, threading.get_ident()))


def stdlib_gated(redis_url: str, name: str, **conf: Any) -> Any:
    """A gated task of an app of its own whose gatekeeper lines go to the app's handlers."""
    app = Celery(name, broker=redis_url)
    app.conf.update(gatekeeper_log_format="stdlib", gatekeeper_dwell_gate_enabled=True,
                    gatekeeper_canary_percent=100, **conf)  # fmt: skip
    gatekeeper.install(app)

    @gatekeeper.gated(expected_service_s=1, tokens_in=10, deadline_s=60)
    @app.task(name=f"{name}.embed", max_retries=0, shared=False)
    def embed(chunk: int) -> int:
        return chunk

    return embed


@contextmanager
def kept_lines() -> Iterator[Kept]:
    """The app's handler on the ``gatekeeper`` logger, at INFO (the app routes its lines)."""
    handler, logger = Kept(), logging.getLogger("gatekeeper")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_stdlib_lines_reach_the_apps_handlers_in_the_publish_that_logs_them(
    redis_url: str, redis_client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    # README: "kv and json ...; stdlib goes to your handlers in the call": not queued for
    # gatekeeper's writer thread, however long log_buffer_s is.
    embed = stdlib_gated(redis_url, "routed", gatekeeper_log_buffer_s=5)
    with kept_lines() as handler:
        job_id = embed.delay(1).id
        seen = list(handler.records)  # as delay() returned: no flush, no wait
    ((record, thread),) = [(r, t) for r, t in seen if "event=gate_decision" in r.getMessage()]
    assert record.name == "gatekeeper.decision" and record.levelno == logging.INFO
    assert f"job_id={job_id}" in record.getMessage() and "reason=fits" in record.getMessage()
    assert thread == threading.get_ident()  # emitted by the publishing thread itself
    assert "gate_decision" not in capsys.readouterr().err  # to the handlers, not stderr


def test_a_forged_task_id_does_not_match_the_pages_grep(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A real publish whose caller-chosen id spells the page's pattern: the line says
    # reserved, and README's `grep 'decision=admit_free' | grep 'slack_miss=true'` finds none.
    embed = stdlib_gated(redis_url, "forged", gatekeeper_free_path_enabled=False)
    forged = "x decision=admit_free slack_miss=true"
    with kept_lines() as handler:
        embed.apply_async((1,), task_id=forged)
    lines = [r.getMessage() for r, _ in handler.records]
    (line,) = [text for text in lines if "event=gate_decision" in text]
    assert "decision=reserved" in line and "reason=free_path_disabled" in line, line
    paged = [text for text in lines if "decision=admit_free" in text]
    assert not [text for text in paged if "slack_miss=true" in text], paged
