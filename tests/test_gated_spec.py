"""Declaring a gated task, and how declared inputs, overrides and carried headers combine."""

from __future__ import annotations

import inspect
import math
import subprocess
import sys
import types
from fractions import Fraction
from typing import Any

import pytest
from celery import Celery

import gatekeeper
from gatekeeper.celery.gating import spec_of
from gatekeeper.core.spec import GatedSpec, resolve_inputs
from gatekeeper.errors import BadDeclaredInput
from tests.conftest import REPO_ROOT, queue_messages


def test_gated_keeps_the_tasks_name_signature_and_max_retries() -> None:
    app = Celery("spec", broker="memory://")

    @app.task(name="reports.build", max_retries=3, shared=False)
    def build(report_id: int, *, draft: bool = False) -> int:
        return report_id

    plain_signature = inspect.signature(build.run)
    gated_task = gatekeeper.gated(expected_service_s=8, tokens_in=1200, deadline_s=90)(build)
    assert gated_task is build
    assert (gated_task.name, gated_task.max_retries) == ("reports.build", 3)
    assert inspect.signature(gated_task.run) == plain_signature
    assert spec_of(gated_task) == GatedSpec(expected_service_s=8, tokens_in=1200, deadline_s=90)


def test_the_task_option_form_gates_too() -> None:
    app = Celery("spec2", broker="memory://")

    @app.task(name="t.opt", shared=False, gatekeeper={"expected_service_s": 2, "deadline_s": 60})
    def opt() -> None:
        return None

    assert spec_of(app.tasks["t.opt"]) == GatedSpec(expected_service_s=2, deadline_s=60)


def test_ungated_tasks_have_no_spec() -> None:
    app = Celery("spec3", broker="memory://")

    @app.task(name="t.plain", shared=False)
    def plain() -> None:
        return None

    assert spec_of(app.tasks["t.plain"]) is None


def test_a_spec_needs_exactly_one_deadline() -> None:
    with pytest.raises(BadDeclaredInput, match="exactly one"):
        GatedSpec(expected_service_s=1)
    with pytest.raises(BadDeclaredInput, match="exactly one"):
        GatedSpec(expected_service_s=1, deadline_s=1, deadline_at=2)


def test_a_malformed_task_option_names_the_field() -> None:
    task = types.SimpleNamespace(gatekeeper={"expected_service": 1})
    with pytest.raises(BadDeclaredInput, match="gatekeeper"):
        spec_of(task)


SPEC = GatedSpec(expected_service_s=8, tokens_in=1200, tokens_out=50, deadline_s=90)


def test_first_publish_sets_the_deadline_relative_to_now() -> None:
    inputs = resolve_inputs(SPEC, {}, now=1000.0)
    assert (inputs.first_published_at, inputs.deadline_at, inputs.tokens_in) == (1000, 1090, 1200)


def test_an_absolute_deadline_is_taken_as_is() -> None:
    spec = GatedSpec(expected_service_s=8, deadline_at=5000.0)
    assert resolve_inputs(spec, {}, now=1000.0).deadline_at == 5000


def test_per_call_overrides_win_over_the_declaration() -> None:
    headers = {
        "gatekeeper_deadline_s": 30,
        "gatekeeper_tokens_in": 10,
        "gatekeeper_expected_service_s": 2,
    }
    inputs = resolve_inputs(SPEC, headers, now=1000.0)
    assert (inputs.deadline_at, inputs.tokens_in, inputs.expected_service_s) == (1030, 10, 2)


def test_a_carried_deadline_is_never_extended() -> None:
    carried = {
        "gatekeeper_deadline_at": 1090.0,
        "gatekeeper_first_published_at": 1000.0,
        "gatekeeper_deadline_s": 9999,
    }
    inputs = resolve_inputs(SPEC, carried, now=1500.0)
    assert (inputs.deadline_at, inputs.first_published_at) == (1090, 1000)


@pytest.mark.parametrize(
    ("headers", "field"),
    [
        ({"gatekeeper_tokens_in": -1}, "gatekeeper_tokens_in"),
        ({"gatekeeper_tokens_in": 1.5}, "gatekeeper_tokens_in"),
        ({"gatekeeper_tokens_in": "many"}, "gatekeeper_tokens_in"),
        ({"gatekeeper_deadline_s": "soon"}, "gatekeeper_deadline_s"),
        ({"gatekeeper_deadline_s": True}, "gatekeeper_deadline_s"),
        ({"gatekeeper_deadline_at": None, "gatekeeper_deadline_s": 60}, "gatekeeper_deadline_at"),
        ({"gatekeeper_deadline_s": "60"}, "gatekeeper_deadline_s"),
        ({"gatekeeper_deadline_s": " 5 "}, "gatekeeper_deadline_s"),
        ({"gatekeeper_deadline_s": "5\n"}, "gatekeeper_deadline_s"),
        ({"gatekeeper_deadline_s": "\u0666\u0660"}, "gatekeeper_deadline_s"),
        ({"gatekeeper_deadline_s": 1e308}, "gatekeeper_deadline_s"),
        ({"gatekeeper_deadline_at": math.inf}, "gatekeeper_deadline_at"),
        ({"gatekeeper_tokens_in": 10**100}, "gatekeeper_tokens_in"),
        ({"gatekeeper_tokens_in": "100"}, "gatekeeper_tokens_in"),
        ({"gatekeeper_tokens_in": None}, "gatekeeper_tokens_in"),
        ({"gatekeeper_expected_service_s": math.inf}, "gatekeeper_expected_service_s"),
        ({"gatekeeper_expected_service_s": False}, "gatekeeper_expected_service_s"),
        ({"gatekeeper_deadline_s": math.nan}, "gatekeeper_deadline_s"),
        ({"gatekeeper_first_published_at": math.nan}, "gatekeeper_first_published_at"),
        ({"gatekeeper_expected_service_s": "8s"}, "gatekeeper_expected_service_s"),
    ],
)
def test_bad_inputs_name_the_field(headers: dict[str, object], field: str) -> None:
    with pytest.raises(BadDeclaredInput) as caught:
        resolve_inputs(SPEC, headers, now=1000.0)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("declared", "field"),
    [
        ({"expected_service_s": "fast", "deadline_s": 60}, "expected_service_s"),
        ({"expected_service_s": 1, "tokens_in": "lots", "deadline_s": 60}, "tokens_in"),
        ({"expected_service_s": 1, "tokens_out": -3, "deadline_s": 60}, "tokens_out"),
        ({"expected_service_s": 1, "deadline_s": math.nan}, "deadline_s"),
        ({"expected_service_s": 1, "deadline_at": "tonight"}, "deadline_at"),
    ],
)
def test_a_bad_declaration_names_its_own_field(declared: dict[str, Any], field: str) -> None:
    # A task option (a dict, checked at publish) and the decorator (checked at import).
    with pytest.raises(BadDeclaredInput) as at_publish:
        resolve_inputs(GatedSpec(**declared), {}, now=1000.0)
    with pytest.raises(BadDeclaredInput) as at_import:
        gatekeeper.gated(**declared)
    assert at_publish.value.field == at_import.value.field == field


@pytest.mark.parametrize("field", ["expected_service_s", "tokens_in", "deadline_s"])
def test_the_decorator_takes_numbers_not_numeric_text(field: str) -> None:
    declared: dict[str, Any] = {"expected_service_s": 1, "tokens_in": 5, "deadline_s": 60}
    declared[field] = str(declared[field])
    with pytest.raises(BadDeclaredInput) as caught:
        gatekeeper.gated(**declared)
    assert caught.value.field == field


def test_a_service_time_the_gate_will_defer_is_still_a_declaration() -> None:
    # A number the gate cannot score is the gate's to judge at publish time (it defers).
    gatekeeper.gated(expected_service_s=0, deadline_s=60)
    gatekeeper.gated(expected_service_s=math.inf, deadline_s=60)


def test_gated_placed_below_app_task_says_so() -> None:
    def build() -> None:
        return None

    with pytest.raises(TypeError, match=r"above @app\.task"):
        gatekeeper.gated(expected_service_s=1, deadline_s=60)(build)


SHARED_TASKS_BEFORE_THEIR_APP = """
import gatekeeper
from celery import Celery, shared_task
from gatekeeper.celery.gating import spec_of

@gatekeeper.gated(expected_service_s=1, deadline_s=60)
@shared_task(name="t.shared")
def shared():
    return 1

@gatekeeper.gated(expected_service_s=2, deadline_s=60)
@shared_task(name="t.bound", bind=True)
def bound(self):
    return 1

@gatekeeper.gated(expected_service_s=3, deadline_s=60)
@shared_task(name="t.typed", pydantic=True)
def typed(n: int) -> int:
    return n

def twice():
    return 1

@gatekeeper.gated(expected_service_s=4, deadline_s=60)
@shared_task(name="t.twice.gated")
def gated_twice():
    return twice()

shared_task(name="t.twice.plain")(gated_twice.run)  # the same function, not gated

app = Celery("made-after-the-tasks", broker="memory://")
for name in ("t.shared", "t.bound", "t.typed", "t.twice.gated", "t.twice.plain"):
    spec = spec_of(app.tasks[name])
    print(spec.expected_service_s if spec else "-")
"""


def test_a_shared_task_gated_before_its_app_exists_is_gated_in_that_app() -> None:
    # Its own process: shared tasks are registered for every app made after them.
    done = subprocess.run(
        [sys.executable, "-c", SHARED_TASKS_BEFORE_THEIR_APP],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "2", "3", "4", "-"]


def test_the_decorator_and_the_task_option_together_are_refused() -> None:
    app = Celery("both", broker="memory://")
    option = {"expected_service_s": 50, "deadline_s": 60}

    @app.task(name="t.both", shared=False, gatekeeper=option)
    def both() -> None:
        return None

    with pytest.raises(BadDeclaredInput, match="not both"):
        gatekeeper.gated(expected_service_s=5, deadline_s=60)(both)

    class Declared(app.Task):  # type: ignore[name-defined,misc]
        gatekeeper = option  # a base class's declaration is one too

    @app.task(name="t.based", shared=False, base=Declared)
    def based() -> None:
        return None

    with pytest.raises(BadDeclaredInput, match="not both"):
        gatekeeper.gated(expected_service_s=5, deadline_s=60)(based)
    assert not app.configured  # neither task made to find out

    @app.task(name="t.once", shared=False)
    def once() -> None:
        return None

    again = gatekeeper.gated(expected_service_s=5, deadline_s=60)
    assert spec_of(again(again(once))) == GatedSpec(expected_service_s=5, deadline_s=60)


def test_a_non_finite_declared_service_time_passes_through_for_the_guard_to_defer() -> None:
    # Declared in code (a task option's dict): the guard defers it. In a header it is a bad
    # input (above): headers take finite numbers only.
    spec = GatedSpec(expected_service_s=math.inf, deadline_s=60)
    assert resolve_inputs(spec, {}, now=1.0).expected_service_s == math.inf


@pytest.mark.parametrize(
    ("declared", "field"),
    [({"deadline_s": math.inf}, "deadline_s"), ({"deadline_s": "inf"}, "deadline_s"),
     ({"deadline_at": -math.inf}, "deadline_at"), ({"deadline_at": math.inf}, "deadline_at")],
)  # fmt: skip
def test_an_infinite_declared_deadline_is_a_bad_input(declared: dict[str, Any], field: str) -> None:
    # Unlike a service time, no record (milliseconds) or header could carry it on.
    with pytest.raises(BadDeclaredInput) as caught:
        resolve_inputs(GatedSpec(expected_service_s=1, **declared), {}, now=1.0)
    assert caught.value.field == field
    if not isinstance(declared[field], str):  # the decorator takes numbers only (above)
        with pytest.raises(BadDeclaredInput, match=f"{field}: expected a finite deadline"):
            gatekeeper.gated(expected_service_s=1, **declared)  # at import, not at each publish


def test_a_declaration_too_large_to_count_is_refused_at_import_and_at_publish() -> None:
    with pytest.raises(BadDeclaredInput, match="tokens_in: expected a number of at most"):
        gatekeeper.gated(expected_service_s=1, tokens_in=10**100, deadline_s=60)
    for past_a_float in (10**400, Fraction(10**400), -(10**400)):  # OverflowError, before
        with pytest.raises(BadDeclaredInput, match="expected_service_s: expected a number of"):
            gatekeeper.gated(expected_service_s=past_a_float, deadline_s=60)
        with pytest.raises(BadDeclaredInput, match="deadline_s: expected a number of at most"):
            gatekeeper.gated(expected_service_s=1, deadline_s=past_a_float)
    with pytest.raises(BadDeclaredInput) as caught:
        resolve_inputs(GatedSpec(expected_service_s=1, deadline_s=1e308), {}, now=1.0)
    assert caught.value.field == "deadline_s"


def test_a_number_subclass_in_a_header_is_refused() -> None:
    class Sneaky(int):
        def __float__(self) -> float:
            return 1.0

    with pytest.raises(BadDeclaredInput) as caught:
        resolve_inputs(SPEC, {"gatekeeper_deadline_s": Sneaky(10**100)}, now=1000.0)
    assert caught.value.field == "gatekeeper_deadline_s"


def test_a_relative_deadline_is_held_to_the_deadline_it_makes() -> None:
    # 1e12 s after the first publish is past what a carried deadline header may be: refused
    # at the first publish, not at the retry that carries it on.
    with pytest.raises(BadDeclaredInput) as caught:
        resolve_inputs(SPEC, {"gatekeeper_deadline_s": 1e12}, now=1_800_000_000.0)
    assert caught.value.field == "gatekeeper_deadline_s"


OPTIONS: list[tuple[dict[str, Any], str, str]] = [
    ({"expected_service_s": "0.2", "tokens_in": "10", "deadline_s": "60"}, "fits", ""),
    ({"expected_service_s": True, "deadline_s": 60}, "bad_input", "field=expected_service_s"),
    ({"expected_service_s": "fast", "deadline_s": 60}, "bad_input", "field=expected_service_s"),
    ({"expected_service_s": 0.2, "tokens_in": 1.5, "deadline_s": 60}, "bad_input",
     "field=tokens_in"),
    ({"expected_service_s": 0.2, "deadline_s": 60, "deadline_at": 2e9}, "bad_input",
     "field=deadline_s/deadline_at"),
]  # fmt: skip


@pytest.mark.parametrize(("option", "reason", "field"), OPTIONS)
def test_the_task_option_is_checked_at_publish_numeric_text_taken(
    redis_url: str, redis_client: Any, option: dict[str, Any], reason: str, field: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # The README: the option's values are checked at publish; text that reads as a number is
    # that number; anything else goes to reserved, bad_input, naming the field.
    app = Celery("option", broker=redis_url)
    app.conf.update(gatekeeper_redis_url=redis_url, gatekeeper_dwell_gate_enabled=True,
                    gatekeeper_canary_percent=100)  # fmt: skip
    gatekeeper.install(app)

    @app.task(name="t.option", shared=False, gatekeeper=option)
    def task() -> None:
        return None

    task.delay()
    queue = "free" if reason == "fits" else "reserved"
    (message,) = queue_messages(redis_client, queue)
    assert message["headers"]["gatekeeper_reason"] == reason
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "gate_decision" in line]
    assert f"reason={reason}" in line and field in line, line
