"""Per-call override headers take numbers only, as the decorator does.

Every value of each of the four override headers that is not a finite number of a sane size
(numeric text included: ``"60"``, ``" 5 "``, ``"5\\n"``, Arabic-Indic digits) sends the task
to reserved with ``reason=bad_input``, names the header, and is not forwarded as it was (py-amqp
cannot even encode ``10**100``); the header it replaced is named in ``gatekeeper_bad_input``,
so a retry of the task stays on reserved.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import redis

from gatekeeper.celery.hook import install
from gatekeeper.core.headers import H_BAD_INPUT, OVERRIDES
from gatekeeper.redis.gate import Publish
from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, queue_messages

NOT_NUMBERS: list[Any] = [
    "60", " 5 ", "5\n", "\u0666\u0660", "", "nan", True, False, None, [5], {"n": 5},
    10**100, -(10**100), 1e308, -1e308, math.inf, -math.inf, math.nan,
]  # fmt: skip
"""Values a header must refuse: text (however numeric), booleans, containers, None, and
numbers that are not finite or too large to count in milliseconds and Redis counters."""


@pytest.mark.parametrize("fast_publish", [True, False])
@pytest.mark.parametrize("header", sorted(OVERRIDES))
def test_every_non_number_in_each_override_header_is_a_bad_input(
    redis_url: str,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    header: str,
    fast_publish: bool,
) -> None:
    app = create_app(gate_settings(redis_url, fast_publish=fast_publish), redis_url)
    task = app.tasks["tests.embed"]
    for value in NOT_NUMBERS:
        capsys.readouterr()
        task.apply_async((1,), headers={header: value})
        assert redis_client.llen("free") == 0 and redis_client.llen("defer") == 0, value
        message = queue_messages(redis_client, "reserved")[0]  # the newest
        headers = message["headers"]
        assert headers["gatekeeper_reason"] == "bad_input", value
        assert header not in headers, value  # not forwarded as it was
        assert headers[H_BAD_INPUT] == header, value
        err = capsys.readouterr().err
        line = next(line for line in err.splitlines() if "event=gate_decision" in line)
        assert "reason=bad_input" in line and f"field={header}" in line, (value, line)
    assert redis_client.llen("reserved") == len(NOT_NUMBERS)


def test_numbers_in_headers_are_still_taken(redis_url: str, redis_client: redis.Redis) -> None:
    app = create_app(gate_settings(redis_url), redis_url)
    app.tasks["tests.embed"].apply_async(
        (1,), headers={"gatekeeper_tokens_in": 5.0, "gatekeeper_deadline_s": 120}
    )
    (message,) = queue_messages(redis_client, "free")
    assert message["headers"]["gatekeeper_tokens_in"] == 5
    assert H_BAD_INPUT not in message["headers"]


def test_a_retry_of_a_bad_input_stays_on_reserved(redis_url: str) -> None:
    """The retry carries the marker, not the bad header: it cannot fall back to the
    declared values and reach free."""
    app = create_app(gate_settings(redis_url), redis_url)
    gate = install(app)
    spec = gate._spec("tests.embed")
    assert spec is not None and spec.spec is not None
    retry = Publish("tests.embed", "job-1", 1, 1, spec.spec,
                    {H_BAD_INPUT: "gatekeeper_tokens_in", "gatekeeper_attempt": 1,
                     "gatekeeper_first_published_at": time.time()})  # fmt: skip
    routing = gate.pipeline.route(retry)
    assert routing.queue == "reserved" and routing.reason.value == "bad_input"
    assert routing.headers[H_BAD_INPUT] == "gatekeeper_tokens_in"
