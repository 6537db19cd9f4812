"""The message headers gatekeeper reads and writes, by name.

A caller may set the four override headers (``gatekeeper_deadline_s``, ``_deadline_at``,
``_expected_service_s``, ``_tokens_in``); the hook writes the others. None of them is trusted
by the worker side: the gate's own record in Redis is (see ``docs/design.md``), and
:data:`H_NONCE`, the random value the gate wrote into that record, is what ties a message to it.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ATTEMPTS",
    "CLAIMS",
    "H_ATTEMPT",
    "H_ATTEMPT_PUBLISHED_AT",
    "H_BAD_INPUT",
    "H_COPY",
    "H_DEADLINE_AT",
    "H_DEADLINE_S",
    "H_DECISION",
    "H_DWELL_S",
    "H_EXPECTED_SERVICE_S",
    "H_FIRST_PUBLISHED_AT",
    "H_FREE_ADMITTED",
    "H_MAX_RETRIES",
    "H_NONCE",
    "H_PUBLISHED_AT",
    "H_REASON",
    "H_REPLAYS",
    "H_REPLAY_AFTER",
    "H_TOKENS_IN",
    "H_TOKENS_OUT",
    "H_WINDOW",
    "NUMERIC",
    "OVERRIDES",
    "earlier_claims",
]

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
H_NONCE = "gatekeeper_nonce"
"""The random per-publish value of the gate's record of this attempt (``run:<job_id>:
<attempt>``)."""
H_COPY = "gatekeeper_copy"
"""A random value per copy the replayer (or a requeue, or the expiry) publishes: one decision
handed on twice (a crash between publish and ack) is two copies, and a worker runs one."""

ATTEMPTS = 10**9
"""Every attempt the gate writes is below this (1 to 999,999,999: retries 0 to 999,999,998);
the worker side reads nothing else as the gate's (``int()`` of a caller's thousands of digits
would raise in a signal handler)."""

CLAIMS = (H_NONCE, H_ATTEMPT, H_ATTEMPT_PUBLISHED_AT, H_PUBLISHED_AT)
"""The headers that claim an attempt and its record: a routed publish carries them only as
its own decision wrote them (never as a caller, or the retried message, left them)."""


def earlier_claims(earlier: Any, attempt: int | None) -> tuple[str, ...]:
    """:data:`CLAIMS` when a message's :data:`H_ATTEMPT` (``earlier``) is an earlier attempt
    than ``attempt`` (a retry's, copied from the message it retries), else none."""
    stale = attempt is not None and type(earlier) is int and 1 <= earlier < attempt
    return CLAIMS if stale else ()


OVERRIDES = frozenset({"gatekeeper_deadline_s", H_DEADLINE_AT, H_EXPECTED_SERVICE_S, H_TOKENS_IN})
"""The headers a caller may set: per-call overrides of the declared inputs."""

NUMERIC = (H_DEADLINE_S, H_DEADLINE_AT, H_EXPECTED_SERVICE_S, H_TOKENS_IN, H_TOKENS_OUT,
           H_FIRST_PUBLISHED_AT, H_ATTEMPT_PUBLISHED_AT)  # fmt: skip
"""The headers the gate reads as numbers; one that is not a number is not forwarded."""
H_BAD_INPUT = "gatekeeper_bad_input"
"""Set on a message whose gatekeeper header was not a number (named here) and was dropped:
its retries stay on reserved (``bad_input``) rather than fall back to the declared values."""
