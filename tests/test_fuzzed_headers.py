"""Fuzzed header keys and values, through fast publish and the ordinary path.

Whatever a caller writes in headers or arguments: every message in the broker parses, every
task runs, none is admitted to free that the pure core would refuse, and for each decision
fast publish pushes the very message the ordinary path publishes (the nonce and kombu's
delivery tag aside; both apps share one fixed clock, so no time differs).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper.celery.hook import install
from gatekeeper.core.dwell import Decision, GateInputs, decide, retry_tax_s
from gatekeeper.core.ledger import admit
from gatekeeper.core.spec import GatedSpec, resolve_inputs
from gatekeeper.errors import BadDeclaredInput
from gatekeeper.redis.keys import Keys
from gatekeeper.settings import GatekeeperSettings
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import gate_settings, running_worker, wait_until

pytestmark = pytest.mark.celery
KEYS = Keys()
QUEUES = ("free", "defer", "reserved")
SCRIPTED = {"fits", "queue_age_cap", "dwell_over_slack", "retry_tax_budget"}
"""The reasons only gate.lua gives (the free path is on, so it never says free_path_disabled)."""
EMBED = GatedSpec(expected_service_s=1, tokens_in=100, deadline_s=60)  # tests.embed's
CELERYS_OWN = {"id", "task", "retries", "eta", "expires", "root_id", "parent_id", "group",
               "lang", "argsrepr", "kwargsrepr", "origin", "timelimit", "shadow",
               "ignore_result", "replaced_task_nesting", "stamped_headers", "stamps",
               "group_index"}  # fmt: skip

tricky_text = st.one_of(
    st.sampled_from(['"', "\\", '\\"', "__gk_free__", "__gk_queue__", '"__gk_decision__"',
                     "}", '{"a": 1}', "\u2028", "\x00", "٦٠", " 5 ", "5\n", "60"]),
    st.text(max_size=12),
)  # fmt: skip
placeholder_like = st.builds(lambda s: f"__gk_{s}__", st.text(max_size=8))
header_keys = st.one_of(
    placeholder_like,
    tricky_text,
    st.sampled_from(["gatekeeper_decision", "gatekeeper_free_admitted", "gatekeeper_window",
                     "gatekeeper_nonce", "gatekeeper_dwell_s", "gatekeeper_reason",
                     "gatekeeper_queue", "x-note"]),
).filter(lambda key: key not in CELERYS_OWN)  # fmt: skip
values = st.one_of(
    tricky_text,
    st.integers(min_value=-(10**30), max_value=10**100),
    st.floats(allow_nan=False),  # kombu's JSON writes nan as NaN, which no parser reads back
    st.booleans(),
    st.none(),
    st.lists(tricky_text, max_size=3),
)
overrides = st.fixed_dictionaries(
    {},
    optional={
        "gatekeeper_tokens_in": st.one_of(st.integers(-5, 10**100), tricky_text, st.floats()),
        "gatekeeper_expected_service_s": st.one_of(st.floats(), tricky_text, st.integers()),
        "gatekeeper_deadline_s": st.one_of(st.floats(), tricky_text, st.integers(-5, 10**9)),
    },
)


def core_admits(headers: dict[str, Any], now: float, settings: GatekeeperSettings) -> bool:
    """What the pure core says of this publish on an empty free queue and an empty window
    (an admission reserves its tokens and, in exposure mode, its wait allowance: tokens
    within the allowance's units of the budget are refused, as hypothesis once found)."""
    try:
        inputs = resolve_inputs(EMBED, headers, now)
    except BadDeclaredInput:
        return False
    tax_s = retry_tax_s(1, inputs.expected_service_s)  # tests.embed: max_retries=1
    gate = decide(GateInputs(0.0, inputs.expected_service_s, tax_s, inputs.deadline_at - now))
    if gate.decision is not Decision.ADMIT_FREE:
        return False
    budget = admit(tax_units=0, exposure=0, queue_age_s=0, tokens_in=inputs.tokens_in,
                   budget_units=settings.budget_units, mode=settings.budget_mode,
                   queue_wait_unit_per_second=settings.queue_wait_unit_per_second,
                   wait_allowance_s=settings.free_wait_allowance_s)  # fmt: skip
    return budget.admitted


def newest(client: redis.Redis, before: dict[str, int]) -> tuple[str, dict[str, Any]]:
    """The one message a publish added, and its queue; it must parse."""
    grown = [q for q in QUEUES if client.llen(q) > before[q]]
    assert len(grown) == 1, grown
    raw = client.lindex(grown[0], 0)
    assert raw is not None
    return grown[0], json.loads(raw)


def comparable(message: dict[str, Any]) -> dict[str, Any]:
    """A message without what differs between any two publishes of it."""
    copy = json.loads(json.dumps(message))
    copy["headers"].pop("gatekeeper_nonce", None)
    copy["properties"].pop("delivery_tag", None)
    copy["properties"].pop("reply_to", None)  # the publishing app's own id
    return copy


class BothWays:
    """Two apps on one broker and gate, one with fast publish, one without, one clock."""

    def __init__(self, redis_url: str) -> None:
        self.now = time.time()
        clock = lambda: self.now  # noqa: E731 - both apps decide at the same instant
        self.fast = create_app(gate_settings(redis_url, fast_publish="on"), redis_url, clock)
        self.ordinary = create_app(gate_settings(redis_url, fast_publish="off"), redis_url,
                                   clock)  # fmt: skip
        self.gate = install(self.fast)
        self.pushed: list[bool] = []
        self.queues: list[str] = []
        route = self.gate.pipeline.route

        def recorded(*args: Any, **kwargs: Any) -> Any:
            routing = route(*args, **kwargs)
            self.pushed.append(routing.published)
            return routing

        self.gate.pipeline.route = recorded  # type: ignore[method-assign]


def publish_both_ways(
    both: BothWays, client: redis.Redis, extra: dict[str, Any], declared: dict[str, Any],
    argument: str,
) -> str:  # fmt: skip
    """Publish one fuzzed task through fast publish and the ordinary path; check both."""
    both.now = now = time.time()
    both.pushed.clear()
    fast, ordinary, gate, pushed = both.fast, both.ordinary, both.gate, both.pushed
    headers = {**extra, **declared}
    job = str(uuid.uuid4())
    seen = []
    for app in (fast, ordinary):
        stale = [KEYS.free_waiting, KEYS.inflight, KEYS.run(job, 1),
                 *client.scan_iter(match=f"{KEYS.base}:window:*")]  # fmt: skip
        client.delete(*stale)  # each decision sees an empty queue and window, and no record
        before = {q: client.llen(q) for q in QUEUES}
        app.tasks["tests.embed"].apply_async((argument,), task_id=job, headers=dict(headers))
        seen.append(newest(client, before))
    (fast_queue, fast_message), (queue, message) = seen
    assert fast_queue == queue
    assert comparable(fast_message) == comparable(message)
    assert (queue == "free") == core_admits(headers, now, gate.settings)
    # What gate.lua decides, fast publish pushed; what was decided in process, it did not.
    scripted = message["headers"].get("gatekeeper_reason") in SCRIPTED
    assert pushed == [scripted]
    both.queues.append(queue)
    return job


def test_fuzzed_headers_publish_the_same_parseable_message_both_ways_and_all_run(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    jobs: list[str] = []
    both = BothWays(redis_url)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(extra=st.dictionaries(header_keys, values, max_size=4), declared=overrides,
           argument=st.one_of(tricky_text, placeholder_like))  # fmt: skip
    def one(extra: dict[str, Any], declared: dict[str, Any], argument: str) -> None:
        jobs.append(publish_both_ways(both, redis_client, extra, declared, argument))

    one()
    # Not vacuous: some examples were admitted (fast publish pushed them), some were not.
    assert {"free", "reserved"} <= set(both.queues), set(both.queues)
    # Every message the fuzzing left in free, defer and reserved (two per example) runs on a
    # worker that consumes all three. (Failed examples leave theirs too: hypothesis replays.)
    redis_client.delete(RUNS_KEY)
    total = sum(redis_client.llen(q) for q in QUEUES)
    assert total >= 2 * len(jobs) > 0
    with running_worker(redis_url, tmp_path / "w.log", queues="free,defer,reserved"):
        assert wait_until(lambda: redis_client.llen(RUNS_KEY) >= total, timeout_s=120)
    ran = {json.loads(raw)["id"] for raw in redis_client.lrange(RUNS_KEY, 0, -1)}
    assert set(jobs) <= ran
    assert sum(redis_client.llen(q) for q in QUEUES) == 0
