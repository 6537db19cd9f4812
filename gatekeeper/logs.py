"""Gatekeeper's own structlog loggers; the application's logging is never reconfigured.

Each logger is built with :func:`structlog.wrap_logger` and a processor chain of its own, so
``key=value`` lines (the default) can be grepped during a page::

    ts=2026-11-30T02:14:03.120Z level=info event=gate_decision task=embed ... decision=admit_free

``log_format = "json"`` writes one JSON object per line instead; ``"stdlib"`` renders the same
key=value text and hands it to the stdlib logger ``gatekeeper.<name>`` for apps that route logs
centrally. :func:`configure_logging` is for the CLI and ``workers/`` only.

``kv`` and ``json`` lines are rendered and written by a thread of their own at most
``log_buffer_s`` after they are logged, and at the end of every task (:mod:`gatekeeper.lines`).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any, TextIO

import structlog
from structlog.processors import add_log_level
from structlog.typing import Processor

from gatekeeper.lines import DeferredLogger
from gatekeeper.settings import GatekeeperSettings

__all__ = ["DECISION_FIELDS", "KeyValueRenderer", "LineWriter", "configure_logging", "make_logger"]

DECISION_FIELDS = (
    "event",
    "task",
    "job_id",
    "attempt",
    "queue_age_s",
    "expected_service_s",
    "retry_tax_s",
    "dwell_s",
    "deadline_slack_s",
    "decision",
    "reason",
    "retries",
    "tokens",
    "token_pressure",
)
"""The fields SPEC section 3 requires on every decision line, in the order they are written."""

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR


def _round_floats(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Floats to the millisecond: ``dwell_s=28.004`` reads better than 17 digits."""
    for key, value in event.items():
        if isinstance(value, float):
            event[key] = round(value, 3)
    return event


_NEEDS_QUOTES = re.compile(r'[\s="\\\ud800-\udfff]')
"""Also a lone surrogate (a file name decoded with ``surrogateescape``): a stream that writes
strict UTF-8 (a log file) cannot encode it, and the line, with the chunk written with it,
would be lost; quoted, it is escaped (``\\udce9``)."""
_CONSTANTS = {None: "", True: "true", False: "false"}
TEXTS_KEPT = 512
"""A renderer's text values kept as written at most (:class:`KeyValueRenderer`)."""


def _quoted(text: str) -> str:
    """A JSON string whose ``=`` is written ``\\u003d`` (JSON reads it back the same): a
    value a caller chose (a task id, a task name, an error's text) can then never hold a
    ``key=value`` of its own, so ``grep 'decision=admit_free'`` matches only the field."""
    return json.dumps(text).replace("=", "\\u003d")


def _kv_value(value: Any) -> str:
    kind = type(value)
    if kind is str:  # the commonest first: most of a decision line's values are text
        return value if value and not _NEEDS_QUOTES.search(value) else _quoted(value)
    if kind is float:
        return repr(round(value, 3))  # digits, a dot, "e", "-", "inf" or "nan": never quoted
    if kind is int:
        return str(value)
    if kind is bool or value is None:
        return _CONSTANTS[value]
    text = str(value)
    return _quoted(text) if not text or _NEEDS_QUOTES.search(text) else text


class _UtcTimestamp:
    """``ts=`` in ISO 8601 UTC with microseconds, as structlog's ``TimeStamper(fmt="iso",
    utc=True)`` writes it, formatting the date and time once per second."""

    def __init__(self) -> None:
        self._formatted = (-1, "")
        """The second last formatted and its text, one object: threads stamping either side
        of a second's turn never pair one second with the other's text."""

    def __call__(
        self, _: Any, __: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        now = time.time()
        second = int(now)
        formatted = self._formatted
        if formatted[0] != second:
            formatted = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
            self._formatted = formatted
        event["ts"] = f"{formatted[1]}.{int((now - second) * 1e6):06d}Z"
        return event


class KeyValueRenderer:
    """``key=value`` pairs, known keys first in a fixed order; quotes only where needed.

    Written for the publish path: one pass, no per-key sorting, booleans as ``true``/``false``
    (so ``grep slack_miss=true`` works), ``None`` as an empty value.
    """

    def __init__(self, key_order: tuple[str, ...]) -> None:
        self.key_order = key_order
        self._texts: dict[str, str] = {}
        """Text values as written, for the ones that repeat line after line (the task's name,
        the decision, the reason, the queue): emptied when full (unique ones fill it)."""

    def __call__(self, _: Any, __: str, event: MutableMapping[str, Any]) -> str:
        get, pop, text = self._texts.get, event.pop, self._text
        parts = []
        for key in self.key_order:
            if key in event:
                value = pop(key)
                written = get(value) if type(value) is str else None
                parts.append(key + "=" + (text(value) if written is None else written))
        for key, value in event.items():
            written = get(value) if type(value) is str else None
            parts.append(key + "=" + (text(value) if written is None else written))
        return " ".join(parts)

    def _text(self, value: Any) -> str:
        written = _kv_value(value)
        if type(value) is str:
            if len(self._texts) >= TEXTS_KEPT:
                self._texts.clear()
            self._texts[value] = written
        return written


def _renderer(fmt: str) -> Processor:
    if fmt == "json":
        return structlog.processors.JSONRenderer(sort_keys=False)
    return KeyValueRenderer(("ts", "level", "logger", *DECISION_FIELDS))


class LineWriter:
    """``write(level, event, fields)``: the line ``getattr(log, level)(event, **fields)``
    writes, in fewer steps when ``log`` is one :func:`make_logger` built for the lines'
    thread (the decision line, once per gated publish: about half the cost of structlog's
    own call). The same fields in the same order, the same level filter and stamps; any
    other logger is called as it is."""

    def __init__(self, log: Any) -> None:
        self._log = log
        target = getattr(log, "_logger", None)
        processors = list(getattr(log, "_processors", ()))
        self._queue: Callable[[MutableMapping[str, Any]], None] | None = None
        if isinstance(target, DeferredLogger) and len(processors) >= 2:
            chain = processors[0] is add_log_level and processors[-1] == target.defer
            self._queue = target.queue if chain else None  # (its chain: level, stamps, defer)
        self._context = dict(getattr(log, "_context", {}))
        self._stamps = processors[1:-1]
        self._enabled = {name: log.is_enabled_for(level) for name, level in _LEVELS.items()
                         if self._queue is not None}  # fmt: skip

    def write(self, level: str, event: str, fields: dict[str, Any]) -> None:
        if self._queue is None:
            getattr(self._log, level)(event, **fields)
            return
        if not self._enabled[level]:
            return
        stamped: MutableMapping[str, Any] = {**self._context, **fields}
        stamped["event"], stamped["level"] = event, level
        for stamp in self._stamps:
            stamped = stamp(None, level, stamped)
        self._queue(stamped)


def make_logger(
    settings: GatekeeperSettings, name: str = "decision", stream: TextIO | None = None
) -> Any:
    """A bound logger for ``gatekeeper.<name>`` with the format and level from settings."""
    fmt = "kv" if settings.log_format == "stdlib" else settings.log_format
    processors: list[Processor] = [
        add_log_level,
        _UtcTimestamp(),
    ]
    if fmt == "json":
        processors.append(_round_floats)
    level = _LEVELS[settings.log_level]
    target: Any
    if settings.log_format == "stdlib":
        target = logging.getLogger(f"gatekeeper.{name}")
        processors.append(_renderer(fmt))
    elif settings.log_buffer_s > 0:  # rendered and written by gatekeeper/lines.py's thread
        target = DeferredLogger(stream or sys.stderr, _renderer(fmt), settings.log_buffer_s)
        processors.append(target.defer)
    else:
        target = structlog.PrintLogger(file=stream or sys.stderr)
        processors.append(_renderer(fmt))
    return structlog.wrap_logger(
        target,
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
    ).bind(logger=f"gatekeeper.{name}")


def configure_logging(settings: GatekeeperSettings) -> None:
    """For the CLI and workers: send the ``gatekeeper`` stdlib logger's records to stderr."""
    logger = logging.getLogger("gatekeeper")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(_LEVELS[settings.log_level])
