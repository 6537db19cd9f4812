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

__all__ = ["DeclaredInputs", "GatedSpec", "declared_number", "resolve_inputs", "whole_tokens"]


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
    if isinstance(value, bool):
        raise BadDeclaredInput(field, "a number", value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadDeclaredInput(field, "a number", value) from None
    return number


def whole_tokens(field: str, value: Any) -> int:
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
        tokens_in=whole_tokens(*_source(headers, H_TOKENS_IN, "tokens_in", spec.tokens_in)),
        tokens_out=whole_tokens(*_source(headers, H_TOKENS_OUT, "tokens_out", spec.tokens_out)),
    )  # fmt: skip


def _source(headers: Mapping[str, Any], header: str, field: str, declared: Any) -> tuple[str, Any]:
    """The value a header overrides with (and the header's name), else the declared one."""
    if header in headers:
        return header, headers[header]
    return field, declared


def declared_number(name: str, value: Any) -> Any:
    """``value`` when it is a number in the code that declares it ("8" and True are not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadDeclaredInput(name, "a number", value)
    return value
