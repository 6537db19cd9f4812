"""What a gated task declares, and the message headers that carry it.

A task is gated by ``@gatekeeper.gated(...)`` above ``@app.task`` or by the task option
``gatekeeper={...}``; both set the task attribute ``gatekeeper`` to a :class:`GatedSpec`
(or a dict of its fields). Per-call overrides travel in ``apply_async(headers={...})``:

``gatekeeper_deadline_s``        deadline, seconds after the first publish
``gatekeeper_deadline_at``       deadline, Unix seconds
``gatekeeper_expected_service_s`` service time of one attempt
``gatekeeper_tokens_in``         input tokens of one attempt

The hook writes the other headers; they survive retries and deferral, and the deadline and
first-publish time, once written, are never changed (a deadline is never extended).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from gatekeeper.errors import GatekeeperError

__all__ = [
    "GATED_ATTRIBUTE",
    "H_ATTEMPT",
    "H_ATTEMPT_PUBLISHED_AT",
    "H_DEADLINE_AT",
    "H_DEADLINE_S",
    "H_DECISION",
    "H_DWELL_S",
    "H_EXPECTED_SERVICE_S",
    "H_FIRST_PUBLISHED_AT",
    "H_FREE_ADMITTED",
    "H_MAX_RETRIES",
    "H_PUBLISHED_AT",
    "H_REASON",
    "H_REPLAYS",
    "H_REPLAY_AFTER",
    "H_TOKENS_IN",
    "H_TOKENS_OUT",
    "H_WINDOW",
    "BadDeclaredInput",
    "DeclaredInputs",
    "GatedSpec",
    "gated",
    "resolve_inputs",
    "spec_of",
]

GATED_ATTRIBUTE = "gatekeeper"
"""The task attribute (and task option) that marks a task as gated."""

H_DEADLINE_AT = "gatekeeper_deadline_at"
H_DEADLINE_S = "gatekeeper_deadline_s"
H_FIRST_PUBLISHED_AT = "gatekeeper_first_published_at"
H_PUBLISHED_AT = "gatekeeper_published_at"
H_ATTEMPT_PUBLISHED_AT = "gatekeeper_attempt_published_at"
H_MAX_RETRIES = "gatekeeper_max_retries"
H_FREE_ADMITTED = "gatekeeper_free_admitted"
"""True once any attempt of the job was admitted to the free path (for abandoned slack misses)."""
H_REPLAYS = "gatekeeper_replays"
H_WINDOW = "gatekeeper_window"
"""The ledger window whose budget holds an admitted attempt's exposure."""
H_REPLAY_AFTER = "gatekeeper_replay_after"
H_ATTEMPT = "gatekeeper_attempt"
H_EXPECTED_SERVICE_S = "gatekeeper_expected_service_s"
H_TOKENS_IN = "gatekeeper_tokens_in"
H_TOKENS_OUT = "gatekeeper_tokens_out"
H_DECISION = "gatekeeper_decision"
H_REASON = "gatekeeper_reason"
H_DWELL_S = "gatekeeper_dwell_s"


class BadDeclaredInput(GatekeeperError, ValueError):
    """A declared input (decorator, task option or header) is not usable; names the field."""

    def __init__(self, field: str, expected: str, got: object) -> None:
        super().__init__(f"{field}: expected {expected}, got {got!r}")
        self.field = field


@dataclass(frozen=True)
class GatedSpec:
    """The declared inputs of a gated task; exactly one of the two deadline forms."""

    expected_service_s: float
    tokens_in: int = 0
    tokens_out: int = 0
    deadline_s: float | None = None
    deadline_at: float | None = None

    def __post_init__(self) -> None:
        if (self.deadline_s is None) == (self.deadline_at is None):
            raise BadDeclaredInput(
                "deadline_s/deadline_at",
                "exactly one of the two",
                (self.deadline_s, self.deadline_at),
            )


T = TypeVar("T")


def gated(
    *,
    expected_service_s: float,
    tokens_in: int = 0,
    tokens_out: int = 0,
    deadline_s: float | None = None,
    deadline_at: float | None = None,
) -> Callable[[T], T]:
    """Gate an existing task; place it above ``@app.task`` (it receives the task object).

    The task keeps its name, signature and ``max_retries``; only the ``gatekeeper`` attribute
    is set, on the task and on the function Celery made it from. Values of the wrong type
    (text included), negative or fractional token counts, and a missing or
    doubled deadline raise :class:`BadDeclaredInput` here, at import. Values that are numbers
    but cannot be scored (a service time of 0, a deadline already past) are the gate's to
    judge at publish time, where they fail closed.
    """
    _declared_number("expected_service_s", expected_service_s)
    _tokens("tokens_in", _declared_number("tokens_in", tokens_in))
    _tokens("tokens_out", _declared_number("tokens_out", tokens_out))
    for name, value in (("deadline_s", deadline_s), ("deadline_at", deadline_at)):
        if value is not None and math.isnan(_declared_number(name, value)):
            raise BadDeclaredInput(name, "a number", value)
    spec = GatedSpec(
        expected_service_s=expected_service_s,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        deadline_s=deadline_s,
        deadline_at=deadline_at,
    )

    def mark(task: T) -> T:
        if inspect.isfunction(task) or inspect.ismethod(task):
            raise TypeError(
                f"gatekeeper.gated: expected a Celery task, got the function "
                f"{getattr(task, '__qualname__', task)!r}; place @gatekeeper.gated above "
                "@app.task, not below it"
            )
        current = _current(task)
        existing = getattr(current, GATED_ATTRIBUTE, None)
        if existing is not None and existing != spec:
            raise BadDeclaredInput(
                "gatekeeper",
                "one declaration (@gatekeeper.gated or the gatekeeper= task option, not both)",
                existing,
            )
        setattr(current, GATED_ATTRIBUTE, spec)
        name = getattr(current, "name", None)
        for function in _task_functions(current):  # a shared task is made again per app
            function.__dict__.setdefault(_BY_TASK_NAME, {})[name] = spec
        return task

    return mark


def _declared_number(name: str, value: Any) -> Any:
    """``value`` when it is a number in the code that declares it ("8" and True are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadDeclaredInput(name, "a number", value)
    return value


_BY_TASK_NAME = "_gatekeeper_by_task_name"
"""A function attribute: the specs of the gated tasks made from it, by task name (one
function can be registered under several names, gated or not)."""


def _current(task: object) -> object:
    """The task itself: a ``@shared_task`` proxy evaluated (as setting an attribute would)."""
    current = getattr(task, "_get_current_object", None)
    return current() if callable(current) else task


def _task_functions(task: object) -> list[Any]:
    """The function a decorator made the task from, and the one that wraps (pydantic).

    ``@shared_task`` makes its task again for every app, from that function alone: a mark
    set only on the task made for the first app would be lost. Celery keeps the function in
    the task class: ``_decorated_fun`` (5.7, as the caller passed it) or ``__wrapped__``
    (a staticmethod unless ``bind=True``; on 5.5 and 5.6, with ``pydantic=True``, a wrapper
    made for each app, whose ``__wrapped__`` is the function). Empty for a task class.
    """
    attributes = type(task).__dict__
    held = attributes.get("_decorated_fun", attributes.get("__wrapped__"))
    function = getattr(held, "__func__", held)
    if not inspect.isfunction(function):
        return []
    inner = getattr(function, "__wrapped__", None)
    return [function, inner] if inspect.isfunction(inner) else [function]


def spec_of(task: object) -> GatedSpec | None:
    """The task's spec, or None when it is not gated; raises BadDeclaredInput when malformed."""
    raw = getattr(task, GATED_ATTRIBUTE, None)
    if raw is None:
        name = getattr(task, "name", None)
        for function in _task_functions(_current(task)):
            raw = function.__dict__.get(_BY_TASK_NAME, {}).get(name)
            if raw is not None:
                break
    if raw is None or isinstance(raw, GatedSpec):
        return raw
    if isinstance(raw, Mapping):
        try:
            return GatedSpec(**raw)
        except TypeError as exc:
            raise BadDeclaredInput("gatekeeper", "GatedSpec fields", dict(raw)) from exc
    raise BadDeclaredInput("gatekeeper", "a GatedSpec or a dict", raw)


@dataclass(frozen=True)
class DeclaredInputs:
    """The numbers one attempt is scored with, after overrides and carried headers."""

    deadline_at: float
    first_published_at: float
    expected_service_s: float
    tokens_in: int
    tokens_out: int


def _number(field: str, value: Any) -> float:
    if isinstance(value, bool):
        raise BadDeclaredInput(field, "a number", value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadDeclaredInput(field, "a number", value) from None
    return number


def _tokens(field: str, value: Any) -> int:
    number = _number(field, value)
    if not math.isfinite(number) or number < 0 or number != int(number):
        raise BadDeclaredInput(field, "a non-negative whole number of tokens", value)
    return int(number)


def resolve_inputs(spec: GatedSpec, headers: Mapping[str, Any], now: float) -> DeclaredInputs:
    """Merge the spec, per-call overrides and carried headers; never extend a deadline.

    A deadline and first-publish time already in the headers (a retry, a replay) win over
    everything. Non-finite service times pass through: the gate's guard defers them.
    Errors name where the bad value came from: a header, else the declaration's field.
    """
    first = headers.get(H_FIRST_PUBLISHED_AT)
    first_published_at = now if first is None else _number(H_FIRST_PUBLISHED_AT, first)
    if math.isnan(first_published_at):
        raise BadDeclaredInput(H_FIRST_PUBLISHED_AT, "a number", first)
    if headers.get(H_DEADLINE_AT) is not None:
        field, deadline_at = H_DEADLINE_AT, _number(H_DEADLINE_AT, headers[H_DEADLINE_AT])
    elif headers.get(H_DEADLINE_S) is not None:
        field = H_DEADLINE_S
        deadline_at = first_published_at + _number(H_DEADLINE_S, headers[H_DEADLINE_S])
    elif spec.deadline_at is not None:
        field, deadline_at = "deadline_at", _number("deadline_at", spec.deadline_at)
    else:
        field = "deadline_s"
        deadline_at = first_published_at + _number("deadline_s", spec.deadline_s)
    if math.isnan(deadline_at):
        raise BadDeclaredInput(field, "a number", deadline_at)
    return DeclaredInputs(
        deadline_at=deadline_at,
        first_published_at=first_published_at,
        expected_service_s=_number(*_source(headers, H_EXPECTED_SERVICE_S, "expected_service_s",
                                            spec.expected_service_s)),
        tokens_in=_tokens(*_source(headers, H_TOKENS_IN, "tokens_in", spec.tokens_in)),
        tokens_out=_tokens(*_source(headers, H_TOKENS_OUT, "tokens_out", spec.tokens_out)),
    )  # fmt: skip


def _source(headers: Mapping[str, Any], header: str, field: str, declared: Any) -> tuple[str, Any]:
    """The value a header overrides with (and the header's name), else the declared one."""
    if header in headers:
        return header, headers[header]
    return field, declared
