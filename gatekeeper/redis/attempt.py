"""One publish of a gated task, and the attempt it becomes once its inputs are resolved.

Pure bookkeeping between the hook and the gate's steps (:mod:`gatekeeper.redis.gate`): the
inputs from the spec and the headers (:func:`gatekeeper.core.spec.resolve_inputs`), the
headers the message will carry, the fields of its decision line, and the gate's record of
the attempt (what its ledger row needs, written to Redis with the decision).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from gatekeeper.core.dwell import retry_tax_s
from gatekeeper.core.headers import (
    ATTEMPTS,
    H_ATTEMPT,
    H_ATTEMPT_PUBLISHED_AT,
    H_BAD_INPUT,
    H_DEADLINE_AT,
    H_EXPECTED_SERVICE_S,
    H_FIRST_PUBLISHED_AT,
    H_MAX_RETRIES,
    H_NONCE,
    H_PUBLISHED_AT,
    H_TOKENS_IN,
    NUMERIC,
)
from gatekeeper.core.ledger import window_id
from gatekeeper.core.spec import DeclaredInputs, GatedSpec, header_number, resolve_inputs
from gatekeeper.core.whatif import NOTHING_KNOWN
from gatekeeper.errors import BadDeclaredInput
from gatekeeper.redis.keys import OTHER_TASK
from gatekeeper.redis.numbers import exact

__all__ = [
    "Attempt",
    "Publish",
    "Service",
    "bad_headers",
    "bad_input_stamp",
    "carried_publish",
    "delay_of",
    "identity",
    "label_of",
    "no_attempt",
    "resolve",
    "retries_of",
    "unrecorded",
]


@dataclass(slots=True)
class Publish:
    """One publish of a gated task, as the hook (or the replayer) saw it."""

    task: str
    job_id: str
    retries: int
    max_retries: int | None
    spec: GatedSpec | None
    headers: Mapping[str, Any]
    """Headers the message carries (retries, replays) and the caller's overrides."""
    spec_error: BadDeclaredInput | None = None
    origin: str = "publish"
    """``publish`` (the hook) or ``replay`` (the replayer re-scoring a deferred task)."""
    label: str = ""
    """The task's label in the metrics' totals when it is not ``task`` (:func:`label_of`)."""

    @property
    def attempt(self) -> int:
        return self.retries + 1


@dataclass(slots=True)
class Attempt:
    """A publish whose inputs resolved: what every later step of the decision reads."""

    publish: Publish
    now: float
    window: int
    inputs: DeclaredInputs
    delay_s: float
    tax_s: float
    slack_s: float
    published_s: float
    """This attempt's first publish: a replayed (deferred) attempt keeps it, so its wait
    includes parking; a delayed one starts waiting when it is due."""
    nonce: str
    headers: dict[str, Any]
    fields: dict[str, Any]
    prev_nonce: str = ""
    """The nonce a replayed attempt's message carries (its record's, if it is the gate's)."""
    service_s: float = math.nan
    """The service time the decision uses: the declared one, or the learned p95."""
    publisher: str = NOTHING_KNOWN
    """The decision record's ``p`` field (:data:`gatekeeper.core.whatif.FIELDS`)."""

    def record(self, dwell_s: float) -> dict[str, str]:
        """The gate's record of this attempt, for a decision made without ``gate.lua`` (the
        script writes the same fields itself)."""
        return {
            "nonce": self.nonce,
            "tokens_in": str(self.inputs.tokens_in),
            "admitted_ms": str(round((self.now + self.delay_s) * 1000)),
            "published_ms": str(round(self.published_s * 1000)),
            "deadline_ms": str(round(self.inputs.deadline_at * 1000)),
            "dwell_s": f"{dwell_s:.6f}" if math.isfinite(dwell_s) else "nan",
        }


def label_of(publish: Publish) -> str:
    """The task's name as the lifetime totals count it, bounded by the gated tasks an app
    registers: the hook decides only tasks it found gated in its app, so a publish's own name;
    a replay or requeue the label its gate record kept (``label``, set by the caller), else
    ``other`` (a message's ``task`` header alone proves nothing)."""
    if publish.label:
        return publish.label
    return publish.task if publish.origin == "publish" else OTHER_TASK


def retries_of(headers: Mapping[str, Any]) -> tuple[int, BadDeclaredInput | None]:
    """A message's ``retries`` (0 when it has none), or 0 and why no attempt can be counted
    from it: only a plain ``int`` from 0 to ``ATTEMPTS - 2`` makes an attempt the worker reads
    as the gate's (:mod:`gatekeeper.celery.message`). Admitted under any other (-1 is attempt
    0), no run could match its record, and its hold on the free queue would stay."""
    retries = headers.get("retries")
    if retries is None:
        return 0, None
    if type(retries) is int and 0 <= retries < ATTEMPTS - 1:
        return retries, None
    return 0, BadDeclaredInput("retries", f"a whole number from 0 to {ATTEMPTS - 2}", retries)


def no_attempt(publish: Publish) -> bool:
    """Whether the publish's ``retries`` make no attempt (:func:`retries_of`)."""
    return publish.spec_error is not None and publish.spec_error.field == "retries"


def identity(publish: Publish) -> dict[str, Any]:
    """The fields every decision line starts with."""
    fields: dict[str, Any] = {"task": publish.task, "job_id": publish.job_id,
                              "attempt": publish.attempt, "retries": publish.retries}  # fmt: skip
    if no_attempt(publish):  # as the message said it: no attempt is counted from it
        fields.update(attempt=None, retries=publish.headers.get("retries"))
    if publish.origin != "publish":
        fields["origin"] = publish.origin
    return fields


Service = Callable[[str, float], tuple[float, dict[str, Any]]]
"""The service time to decide with for a task and its declared value, with the decision
line's fields for it (:meth:`gatekeeper.redis.service_times.LearnedService.choose`)."""


def resolve(
    publish: Publish,
    now: float,
    window_seconds: int,
    nonce: str,
    service: Service | None = None,
    wait_allowance_s: float = 0.0,
) -> Attempt:
    """The attempt's inputs and headers; raises :class:`BadDeclaredInput` naming the field.

    ``service`` picks the service time the decision uses (declared or learned); the headers
    carry the declared one on (a retry or a replay chooses again). ``wait_allowance_s`` goes
    into the decision record only."""
    if publish.spec_error is not None:
        raise publish.spec_error
    if publish.spec is None:
        raise BadDeclaredInput("gatekeeper", "a GatedSpec", None)
    dropped = publish.headers.get(H_BAD_INPUT)
    if dropped is not None:  # an earlier attempt's header was not a number, and was dropped
        raise BadDeclaredInput(str(dropped), "a number (an earlier attempt's was not)", None)
    inputs = resolve_inputs(publish.spec, publish.headers, now)
    delay = delay_of(publish.headers.get("eta"), now)
    left = 0 if publish.max_retries is None else publish.max_retries - publish.retries
    declared = inputs.expected_service_s
    service_s, chosen = (declared, {}) if service is None else service(publish.task, declared)
    tax_s = retry_tax_s(left, service_s)
    slack = inputs.deadline_at - now
    p95 = chosen.get("service_learned_p95_s")  # exact in the decision record, 6 places in the line
    learned = "" if p95 is None else exact(p95)
    if p95 is not None:  # the chooser's own dict, made for this publish
        chosen["service_learned_p95_s"] = round(p95, 6)
    samples = chosen.get("service_samples", 0)
    publisher = f"{exact(declared)}|{learned}|{samples}|{max(left, 0)}|{exact(wait_allowance_s)}"
    fields = identity(publish)
    if delay:
        fields["delay_s"] = delay
    fields.update(expected_service_s=service_s, **chosen, retry_tax_s=tax_s,
                  deadline_slack_s=slack, tokens=inputs.tokens_in)  # fmt: skip
    # Only a message the gate decided before (a replay, a requeue) carries its attempt's
    # first publish and nonce on: a caller's publish that sets them (not among the headers a
    # caller may set) would move its wait, and its row's price, where it likes.
    same_attempt = publish.origin != "publish" and publish.headers.get(H_ATTEMPT) == publish.attempt
    carried = publish.headers.get(H_ATTEMPT_PUBLISHED_AT) if same_attempt else None
    prev = publish.headers.get(H_NONCE) if same_attempt else None
    if carried is not None:
        carried = header_number(H_ATTEMPT_PUBLISHED_AT, carried)
    published = now + delay if carried is None else carried
    headers: dict[str, Any] = {
        H_DEADLINE_AT: inputs.deadline_at,
        H_FIRST_PUBLISHED_AT: inputs.first_published_at,
        H_PUBLISHED_AT: now,
        H_ATTEMPT_PUBLISHED_AT: published,
        H_ATTEMPT: publish.attempt,
        H_EXPECTED_SERVICE_S: inputs.expected_service_s,
        H_TOKENS_IN: inputs.tokens_in,
        H_NONCE: nonce,
    }
    if publish.max_retries is not None:
        headers[H_MAX_RETRIES] = publish.max_retries
    return Attempt(publish, now, window_id(now, window_seconds), inputs, delay, tax_s, slack,
                   published, nonce, headers, fields,
                   prev if isinstance(prev, str) else "", service_s, publisher)  # fmt: skip


def bad_input_stamp(publish: Publish, now: float) -> dict[str, Any]:
    """What can be known of an attempt whose inputs are bad, so that it still gets its
    (unverified) row and a retry cannot start a new deadline; the bad input is left as it
    was."""
    bad = bad_headers(publish.headers)
    carried_first = publish.headers.get(H_FIRST_PUBLISHED_AT)
    stamp: dict[str, Any] = {
        H_FIRST_PUBLISHED_AT: now if carried_first is None or H_FIRST_PUBLISHED_AT in bad
        else carried_first,
        H_PUBLISHED_AT: now,
        H_ATTEMPT_PUBLISHED_AT: now,
    }  # fmt: skip
    if not no_attempt(publish):  # else no attempt is claimed: its run gets no row at all
        stamp[H_ATTEMPT] = publish.attempt
    if H_DEADLINE_AT in publish.headers and H_DEADLINE_AT not in bad:
        stamp[H_DEADLINE_AT] = publish.headers[H_DEADLINE_AT]
    if bad or publish.headers.get(H_BAD_INPUT) is not None:
        stamp[H_BAD_INPUT] = ",".join(bad) or str(publish.headers[H_BAD_INPUT])
    return stamp


def bad_headers(headers: Mapping[str, Any]) -> list[str]:
    """The gatekeeper headers present that are not a header's number: they are dropped from
    the message (py-amqp cannot even encode ``10**100``), named in ``gatekeeper_bad_input``."""
    bad = []
    for name in NUMERIC:
        if name not in headers:
            continue
        try:
            header_number(name, headers[name])
        except BadDeclaredInput:
            bad.append(name)
    return bad


def delay_of(eta: Any, now: float) -> float:
    """Seconds until a delayed task is due (Celery's ``eta`` header, ISO 8601); 0 if none.

    An ``eta`` that cannot be read counts as no delay (Celery itself writes this header, and
    would not have built the message with a bad one).
    """
    if not eta:
        return 0.0
    try:
        due = datetime.fromisoformat(str(eta))
    except ValueError:
        return 0.0
    if due.tzinfo is None:
        due = due.replace(tzinfo=timezone.utc)
    return max(0.0, due.timestamp() - now)


def carried_publish(headers: dict[str, Any], origin: str, label: str = "") -> Publish:
    """A publish of a message already decided once (a replay, a requeue), scored from the
    inputs its headers carry; types are checked where the pipeline resolves them (a bad one
    fails closed there, as ``spec_error``). ``label``: the task label its gate record kept."""
    try:
        spec: GatedSpec | None = GatedSpec(
            expected_service_s=headers.get(H_EXPECTED_SERVICE_S),  # type: ignore[arg-type]
            tokens_in=headers.get(H_TOKENS_IN) or 0,
            deadline_at=headers.get(H_DEADLINE_AT),
        )
        spec_error = None
    except BadDeclaredInput as exc:
        spec, spec_error = None, exc
    return Publish(task=str(headers.get("task")), job_id=str(headers.get("id")),
                   retries=int(headers.get("retries") or 0),
                   max_retries=headers.get(H_MAX_RETRIES), spec=spec, headers=headers,
                   spec_error=spec_error, origin=origin, label=label)  # fmt: skip


def unrecorded(headers: Mapping[str, Any]) -> dict[str, Any]:
    """Headers for a decision the gate could not record: no nonce, so the message claims no
    record (its row is unverified, not mistaken for a forgery)."""
    return {key: value for key, value in headers.items() if key != H_NONCE}
