"""``gatekeeper simulate``: a declared night under each policy, and the gate with one knob tuned.

Prints a ``night`` line, then one line per policy, in this order::

    policy=NAME missed=INT wasted_tokens=INT reserved_s=NUM free_s=NUM killed=INT retries=INT
        deferred=INT rejected=INT expired=INT abandoned=INT p95_s=NUM

(one line each), ``gate_tuned`` followed by ``knob=NAME value=NUM tuned_on_seed=INT``. The
night is ``[simulate]`` in the TOML file (:mod:`gatekeeper.night`); ``gate`` decides with the
current settings, through the simulator in :mod:`gatekeeper.ops.simulator`.

**The tuning rule.** ``gate_tuned`` is the gate with at most one knob changed. Every candidate
(the current settings, then each value ``[simulate.tune]`` lists, one knob at a time) is
simulated on ``tune_seed``; of those that miss at most ``tune.max_missed_share`` of the jobs
(the fewest misses first when none does), the one with the least ``reserved_s`` wins; ties go
to fewer misses, then fewer wasted tokens, then the current settings and the candidates in the
order listed. The winner is then reported on ``seed``, which must be another seed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
from pydantic import ValidationError

from gatekeeper.night import TUNABLE_KNOBS, NightSettings
from gatekeeper.ops.context import format_number, settings_of
from gatekeeper.ops.simulator import GateKnobs, NightResult, Policy, draw_night, run_night

__all__ = ["Tuned", "candidates", "policy_line", "simulate", "simulate_lines", "tune"]


@dataclass(frozen=True)
class Tuned:
    """The knob ``gate_tuned`` changed (``None``: the current settings won) and its value."""

    knob: str | None
    value: float | None
    knobs: GateKnobs
    on_tune_seed: NightResult


def candidates(knobs: GateKnobs, night: NightSettings) -> Iterator[tuple[str | None, GateKnobs]]:
    """The current settings, then each listed value of each knob, in the order listed."""
    yield None, knobs
    for knob in TUNABLE_KNOBS:
        for value in getattr(night.tune, knob):
            if value != getattr(knobs, knob):
                yield knob, dataclasses.replace(knobs, **{knob: value})


def tune(knobs: GateKnobs, night: NightSettings) -> Tuned:
    """Pick ``gate_tuned``'s knob on ``night.tune_seed`` by the rule in the module docstring."""
    draws = draw_night(night, night.tune_seed)
    allowed = math.floor(night.tune.max_missed_share * night.jobs)
    best: tuple[tuple[float, ...], Tuned] | None = None
    for index, (knob, tried) in enumerate(candidates(knobs, night)):
        result = run_night(night, draws, Policy.GATE, tried)
        over = max(result.missed - allowed, 0)
        rank = (over, result.reserved_s, result.missed, result.wasted_tokens, index)
        if best is None or rank < best[0]:
            value = None if knob is None else float(getattr(tried, knob))
            best = (rank, Tuned(knob, value, tried, result))
    assert best is not None  # the current settings are always a candidate
    return best[1]


def policy_line(result: NightResult, name: str | None = None) -> str:
    """One policy's line: the three fields SPEC names first, then the rest."""
    fields = {
        "policy": name or result.policy.value,
        "missed": result.missed,
        "wasted_tokens": result.wasted_tokens,
        "reserved_s": format_number(result.reserved_s),
        "free_s": format_number(result.free_s),
        "killed": result.killed,
        "retries": result.retries,
        "deferred": result.deferred,
        "rejected": result.rejected,
        "expired": result.expired,
        "abandoned": result.abandoned,
        "p95_s": format_number(result.p95_s),
    }
    return " ".join(f"{key}={value}" for key, value in fields.items())


def simulate_lines(knobs: GateKnobs, night: NightSettings) -> list[str]:
    """Everything ``gatekeeper simulate`` prints for this night, seeded by ``night.seed``."""
    draws = draw_night(night, night.seed)
    lines = [
        f"night seed={night.seed} jobs={night.jobs} deadline_s={format_number(night.deadline_s)} "
        f"free_slots={night.free_slots} reserved_slots={night.reserved_slots}"
    ]
    for policy in Policy:
        lines.append(policy_line(run_night(night, draws, policy, knobs)))
    tuned = tune(knobs, night)
    line = policy_line(run_night(night, draws, Policy.GATE, tuned.knobs), "gate_tuned")
    value = "none" if tuned.value is None else format_number(tuned.value)
    lines.append(
        f"{line} knob={tuned.knob or 'none'} value={value} tuned_on_seed={night.tune_seed}"
    )
    return lines


@click.command()
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML settings file with the [simulate] night (default: as for `gatekeeper`).",
)
@click.option(
    "--seed", type=int, default=None, help="Seed of the night (default: [simulate].seed)."
)
@click.option(
    "--jobs", type=click.IntRange(min=1), default=None, help="Jobs (default: [simulate].jobs)."
)
@click.pass_context
def simulate(ctx: click.Context, config: Path | None, seed: int | None, jobs: int | None) -> None:
    """Simulate the declared night under each policy (no server, seeded)."""
    if config is not None:
        ctx.ensure_object(dict)["config"] = config
    settings = settings_of(ctx)
    night = settings.simulate
    changes = {name: value for name, value in (("seed", seed), ("jobs", jobs)) if value is not None}
    if changes:
        try:
            night = NightSettings.model_validate({**night.model_dump(), **changes})
        except ValidationError as exc:
            problems = "; ".join(
                str(error["msg"]).removeprefix("Value error, ") for error in exc.errors()
            )
            hint = "/".join(f"--{name}" for name in changes)
            raise click.BadParameter(problems, param_hint=hint) from exc
    for line in simulate_lines(GateKnobs.of(settings), night):
        click.echo(line)
