"""The key=value renderer: grep-able during a page."""

from __future__ import annotations

import io

from gatekeeper.lines import flush
from gatekeeper.logs import KeyValueRenderer, make_logger
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


def test_floats_to_the_millisecond_and_none_as_empty() -> None:
    assert render(dwell_s=28.00049, x=None) == "dwell_s=28.0 x="


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
