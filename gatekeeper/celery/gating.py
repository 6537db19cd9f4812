"""Marking a Celery task as gated: ``@gatekeeper.gated(...)`` and the ``gatekeeper=`` option.

Both set the task attribute ``gatekeeper`` to a :class:`~gatekeeper.core.spec.GatedSpec` (or a
dict of its fields); :func:`spec_of` reads it back. ``@shared_task`` makes its task again for
every app, so the mark is also kept on the function Celery made the task from, by task name
(where Celery keeps that function is private: :func:`gatekeeper.celery.private.task_functions`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import TypeVar

from gatekeeper.celery.private import current_task, promised_task, task_functions
from gatekeeper.core.spec import GatedSpec, declared_number, whole_tokens
from gatekeeper.errors import BadDeclaredInput

__all__ = ["GATED_ATTRIBUTE", "gated", "spec_of"]

GATED_ATTRIBUTE = "gatekeeper"
"""The task attribute (and task option) that marks a task as gated."""


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
    (text included), negative or fractional token counts, a missing, doubled or infinite
    deadline raise :class:`BadDeclaredInput` here, at import. Values that are numbers but
    cannot be scored (a service time of 0 or infinite, a deadline already past) are the
    gate's to judge at publish time, where they fail closed.
    """
    declared_number("expected_service_s", expected_service_s)
    whole_tokens("tokens_in", declared_number("tokens_in", tokens_in))
    whole_tokens("tokens_out", declared_number("tokens_out", tokens_out))
    for name, value in (("deadline_s", deadline_s), ("deadline_at", deadline_at)):
        if value is not None and not math.isfinite(declared_number(name, value)):
            raise BadDeclaredInput(name, "a finite deadline", value)  # (publishes refuse it)
    spec = GatedSpec(
        expected_service_s=expected_service_s,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        deadline_s=deadline_s,
        deadline_at=deadline_at,
    )

    def mark(task: T) -> T:
        promised = promised_task(task)  # before any other look at it: that would make it
        if promised is not None:
            function, name, options, base = promised
            refuse_second(options.get(GATED_ATTRIBUTE))
            refuse_second(getattr(base, GATED_ATTRIBUTE, None))  # a base class's declaration
            refuse_second(function.__dict__.get(_BY_TASK_NAME, {}).get(name))
            function.__dict__.setdefault(_BY_TASK_NAME, {})[name] = spec  # every app's copy
            return task
        if inspect.isfunction(task) or inspect.ismethod(task):
            raise TypeError(
                f"gatekeeper.gated: expected a Celery task, got the function "
                f"{getattr(task, '__qualname__', task)!r}; place @gatekeeper.gated above "
                "@app.task, not below it"
            )
        current = current_task(task)
        refuse_second(getattr(current, GATED_ATTRIBUTE, None))
        setattr(current, GATED_ATTRIBUTE, spec)
        for function in task_functions(current):  # a shared task is made again per app
            function.__dict__.setdefault(_BY_TASK_NAME, {})[getattr(current, "name", None)] = spec
        return task

    def refuse_second(existing: object) -> None:
        if existing is not None and existing != spec:
            raise BadDeclaredInput(
                "gatekeeper",
                "one declaration (@gatekeeper.gated or the gatekeeper= task option, not both)",
                existing,
            )

    return mark


_BY_TASK_NAME = "_gatekeeper_by_task_name"
"""A function attribute: the specs of the gated tasks made from it, by task name (one
function can be registered under several names, gated or not)."""


def spec_of(task: object) -> GatedSpec | None:
    """The task's spec, or None when it is not gated; raises BadDeclaredInput when malformed."""
    raw = getattr(task, GATED_ATTRIBUTE, None)
    if raw is None:
        name = getattr(task, "name", None)
        for function in task_functions(current_task(task)):
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
