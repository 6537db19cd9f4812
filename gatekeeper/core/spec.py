"""What a gated task declares, and how one attempt's inputs are resolved from it.

A task is gated by ``@gatekeeper.gated(...)`` (:mod:`gatekeeper.celery.gating`) or by the task
option ``gatekeeper={...}``; both come down to a :class:`GatedSpec`. Per-call overrides travel
in ``apply_async(headers={...})`` (:mod:`gatekeeper.core.headers`):

``gatekeeper_deadline_s``        deadline, seconds after the first publish
``gatekeeper_deadline_at``       deadline, Unix seconds
``gatekeeper_expected_service_s`` service time of one attempt
``gatekeeper_tokens_in``         input tokens of one attempt

The hook writes the other headers; they survive retries and deferral, and the deadline and
first-publish time, once written, are never changed (a deadline is never extended).

A header takes numbers only, as the decorator does: an ``int`` or a ``float``, finite and of
at most :data:`MAX_MAGNITUDE` (text such as ``"60"``, booleans, ``nan`` and ``10**100`` are
refused, naming the header). A declared service time may be infinite (the gate's guard
defers it), never larger than that; a declared deadline may not: the gate's record keeps it in
milliseconds and the message carries it on, and neither can hold an infinite one, so it is a
bad input (reserved, ``bad_input``, naming the field).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gatekeeper.core.headers import (
    H_DEADLINE_AT,
    H_DEADLINE_S,
    H_EXPECTED_SERVICE_S,
    H_FIRST_PUBLISHED_AT,
    H_TOKENS_IN,
    H_TOKENS_OUT,
)
from gatekeeper.errors import BadDeclaredInput

__all__ = [
    "MAX_MAGNITUDE",
    "DeclaredInputs",
    "GatedSpec",
    "declared_number",
    "header_number",
    "resolve_inputs",
    "whole_tokens",
]

MAX_MAGNITUDE = 1e12
"""The largest number of seconds or tokens an input may be: ample for a Unix time (the year
33658) or a night's tokens, small enough that milliseconds and sums of tokens stay exact in a
double and in Redis's 64-bit counters (``10**100`` tokens or a deadline of ``1e308`` s would
overflow them)."""


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


@dataclass(frozen=True)
class DeclaredInputs:
    """The numbers one attempt is scored with, after overrides and carried headers."""

    deadline_at: float
    first_published_at: float
    expected_service_s: float
    tokens_in: int
    tokens_out: int


def _number(field: str, value: Any) -> float:
    """A declared value as a float (infinity passes, for the guard); text that reads as a
    number passes here only for a declared value a dict task option gave."""
    if isinstance(value, bool):
        raise BadDeclaredInput(field, "a number", value)
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise BadDeclaredInput(field, "a number", value) from None
    if math.isfinite(number) and abs(number) > MAX_MAGNITUDE:
        raise BadDeclaredInput(field, f"a number of at most {MAX_MAGNITUDE:g}", value)
    return number


def header_number(field: str, value: Any) -> float:
    """A header's value: an ``int`` or ``float`` (never text or a boolean), finite, of at
    most :data:`MAX_MAGNITUDE`; raises :class:`BadDeclaredInput` naming the header."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadDeclaredInput(field, "a number (not text or a boolean)", value)
    try:  # the value itself, as a serializer writes it (a subclass's __float__ aside)
        number = float.__float__(value) if isinstance(value, float) else int.__float__(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or abs(number) > MAX_MAGNITUDE:
        raise BadDeclaredInput(field, f"a finite number of at most {MAX_MAGNITUDE:g}", value)
    return number


def whole_tokens(field: str, value: Any) -> int:
    number = _number(field, value)
    if not math.isfinite(number) or number < 0 or number != int(number):
        raise BadDeclaredInput(field, "a non-negative whole number of tokens", value)
    return int(number)


def resolve_inputs(spec: GatedSpec, headers: Mapping[str, Any], now: float) -> DeclaredInputs:
    """Merge the spec, per-call overrides and carried headers; never extend a deadline.

    A deadline and first-publish time already in the headers (a retry, a replay) win over
    everything. Non-finite service times pass through: the gate's guard defers them; a
    non-finite deadline is refused.
    Errors name where the bad value came from: a header, else the declaration's field.
    """
    first = headers.get(H_FIRST_PUBLISHED_AT)
    first_published_at = now if first is None else header_number(H_FIRST_PUBLISHED_AT, first)
    if H_DEADLINE_AT in headers:
        field, deadline_at = H_DEADLINE_AT, header_number(H_DEADLINE_AT, headers[H_DEADLINE_AT])
    elif H_DEADLINE_S in headers:
        field = H_DEADLINE_S
        deadline_at = first_published_at + header_number(H_DEADLINE_S, headers[H_DEADLINE_S])
    elif spec.deadline_at is not None:
        field, deadline_at = "deadline_at", _number("deadline_at", spec.deadline_at)
    else:
        field = "deadline_s"
        deadline_at = first_published_at + _number("deadline_s", spec.deadline_s)
    if math.isnan(deadline_at):
        raise BadDeclaredInput(field, "a number", deadline_at)
    if math.isinf(deadline_at):  # neither the record nor the message can carry it
        raise BadDeclaredInput(field, "a finite deadline", deadline_at)
    if abs(deadline_at) > MAX_MAGNITUDE:
        # Checked as the deadline it makes: the header that carries it on is held to this.
        raise BadDeclaredInput(field, f"a deadline before {MAX_MAGNITUDE:g} Unix seconds",
                               deadline_at)  # fmt: skip
    return DeclaredInputs(
        deadline_at=deadline_at,
        first_published_at=first_published_at,
        expected_service_s=_number(*_source(headers, H_EXPECTED_SERVICE_S, "expected_service_s",
                                            spec.expected_service_s)),
        tokens_in=whole_tokens(*_source(headers, H_TOKENS_IN, "tokens_in", spec.tokens_in)),
        tokens_out=whole_tokens(*_source(headers, H_TOKENS_OUT, "tokens_out", spec.tokens_out)),
    )  # fmt: skip


def _source(headers: Mapping[str, Any], header: str, field: str, declared: Any) -> tuple[str, Any]:
    """The value a header overrides with (and the header's name), checked as a header's
    number, else the declared one."""
    if header in headers:
        return header, header_number(header, headers[header])
    return field, declared


def declared_number(name: str, value: Any) -> Any:
    """``value`` when it is a number in the code that declares it ("8" and True are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadDeclaredInput(name, "a number", value)
    try:
        too_large = math.isfinite(value) and abs(float(value)) > MAX_MAGNITUDE
    except OverflowError:  # an int or a Fraction past a float's range (10**400)
        too_large = True
    if too_large:
        raise BadDeclaredInput(name, f"a number of at most {MAX_MAGNITUDE:g}", value)
    return value
