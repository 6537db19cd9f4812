"""``gatekeeper simulate``: its lines, its determinism, its errors, the tuning rule, and the
acceptance check of issue 14 on the default night."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gatekeeper.night import TUNABLE_KNOBS, NightSettings, TuneSettings
from gatekeeper.ops.cli import main
from gatekeeper.ops.simulate import candidates, policy_line, simulate_lines, tune
from gatekeeper.ops.simulator import GateKnobs, NightResult, Policy, draw_night, run_night
from gatekeeper.settings import load_settings

REPO = Path(__file__).resolve().parents[1]
REPO_CONFIG = REPO / "config" / "gatekeeper.toml"
LINE = re.compile(
    r"^policy=(?P<policy>[a-z_]+) missed=\d+ wasted_tokens=\d+ reserved_s=\d+(\.\d+)? "
    r"free_s=\d+(\.\d+)? killed=\d+ retries=\d+ deferred=\d+ rejected=\d+ expired=\d+ "
    r"abandoned=\d+ p95_s=(\d+(\.\d+)?|nan)"
    r"(?P<tuned> knob=(none|[a-z_]+) value=(none|\d+(\.\d+)?) tuned_on_seed=-?\d+)?$"
)


def simulate(*args: str, config: Path = REPO_CONFIG) -> Result:
    return CliRunner().invoke(main, ["simulate", "--config", str(config), *args])


def fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split())


def test_prints_a_night_line_then_one_line_per_policy_in_order() -> None:
    result = simulate("--jobs", "200")
    assert result.exit_code == 0, result.output
    night, *lines = result.output.splitlines()
    assert night.startswith("night seed=7 jobs=200 ")
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    names = [match["policy"] for match in matches if match]
    assert names == ["always_free", "always_reserved", "gate", "gate_tuned"]
    assert [bool(match["tuned"]) for match in matches if match] == [False] * 3 + [True]


def test_the_same_seed_prints_the_same_bytes_and_another_seed_does_not() -> None:
    first, second = simulate("--jobs", "300"), simulate("--jobs", "300")
    assert first.output == second.output
    assert simulate("--jobs", "300", "--seed", "8").output != first.output


def test_the_group_config_option_works_too() -> None:
    grouped = CliRunner().invoke(main, ["--config", str(REPO_CONFIG), "simulate", "--jobs", "50"])
    assert grouped.exit_code == 0
    assert grouped.output == simulate("--jobs", "50").output


def test_the_seed_cannot_be_the_tuning_seed() -> None:
    result = simulate("--seed", "1")
    assert result.exit_code == 2
    assert "simulate.tune_seed: expected a seed other than simulate.seed (1)" in result.output


def test_jobs_must_be_positive() -> None:
    result = simulate("--jobs", "0")
    assert result.exit_code == 2
    assert "--jobs" in result.output


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[simulate]\nfree_slots = 0\n", "simulate.free_slots in "),
        ("[simulate]\nfree_slots = 0\n", "greater than or equal to 1, got 0"),
        ("[simulate]\nservice = 'weibull'\n", "input should be 'fixed' or 'lognormal'"),
        ("[simulate]\nkill_rate = 1.5\n", "simulate.kill_rate in "),
        ("[simulate]\nfree_slot = 3\n", "simulate.free_slot in "),
        ("[simulate]\nfree_slot = 3\n", "extra inputs are not permitted"),
        ("[simulate]\nservice_p95_s = 5.0\n", "simulate.service_p95_s: expected more than"),
        ("[simulate]\nseed = 1\n", "simulate.tune_seed: expected a seed other than"),
        ("[simulate.tune]\nbudget_units = [-1.0]\n", "simulate.tune.budget_units.0 in "),
        ("[simulate.tune]\nfree_wait_allowance_s = [0.0]\n", "expected positive seconds"),
        ("[simulate]\njobs = 'many'\n", "GATEKEEPER_SIMULATE__JOBS"),
    ],
)
def test_a_bad_night_names_the_field_and_what_was_expected(
    tmp_path: Path, toml: str, expected: str
) -> None:
    config = tmp_path / "night.toml"
    config.write_text(toml)
    result = simulate(config=config)
    assert result.exit_code == 2
    assert expected in result.output


def test_the_toml_declares_the_models_defaults() -> None:
    # `gatekeeper simulate` without the file runs the same night as with it.
    assert load_settings(REPO_CONFIG).simulate == NightSettings()


def test_the_gate_decides_with_the_top_level_settings(tmp_path: Path) -> None:
    config = tmp_path / "g.toml"
    config.write_text("budget_units = 1e6\n")  # and the default night
    default, loose = simulate("--jobs", "300"), simulate("--jobs", "300", config=config)
    gate = [
        fields(line)
        for result in (default, loose)
        for line in result.output.splitlines()
        if line.startswith("policy=gate ")
    ]
    assert int(gate[1]["rejected"]) < int(gate[0]["rejected"])


def ranked(results: list[tuple[str | None, GateKnobs, NightResult]], allowed: int) -> GateKnobs:
    """The rule, written out: within the allowance, least reserved time (fewest misses
    first when none is within it); ties to fewer misses, fewer wasted tokens, listed first."""
    within = [r for r in results if r[2].missed <= allowed]
    pool = within or [r for r in results if r[2].missed == min(x[2].missed for x in results)]
    best = min(pool, key=lambda r: (r[2].reserved_s, r[2].missed, r[2].wasted_tokens))
    return best[1]


@pytest.mark.parametrize("share", [0.0, 0.01, 0.2])
def test_gate_tuned_follows_the_stated_rule(share: float) -> None:
    night = NightSettings(jobs=300, tune=TuneSettings(max_missed_share=share))
    knobs = GateKnobs.of(load_settings(REPO_CONFIG))
    draws = draw_night(night, night.tune_seed)
    results = [
        (knob, tried, run_night(night, draws, Policy.GATE, tried))
        for knob, tried in candidates(knobs, night)
    ]
    assert len(results) == 1 + sum(len(getattr(night.tune, k)) for k in TUNABLE_KNOBS)
    chosen = tune(knobs, night)
    assert chosen.knobs == ranked(results, math.floor(share * night.jobs))


def test_gate_tuned_is_tuned_on_the_tune_seed_and_reported_on_the_seed() -> None:
    knobs = GateKnobs.of(load_settings(REPO_CONFIG))
    night = NightSettings(jobs=300)
    tuned = tune(knobs, night)
    assert tune(knobs, night.model_copy(update={"seed": 8})) == tuned  # the seed plays no part
    reported = run_night(night, draw_night(night, night.seed), Policy.GATE, tuned.knobs)
    last = simulate_lines(knobs, night)[-1]
    assert last.startswith(policy_line(reported, "gate_tuned") + " knob=")
    assert last.endswith(f" tuned_on_seed={night.tune_seed}")


def test_with_no_candidates_gate_tuned_is_the_gate() -> None:
    empty = TuneSettings(
        max_queue_age_s=[], budget_units=[], queue_wait_unit_per_second=[], free_wait_allowance_s=[]
    )
    night = NightSettings(jobs=100, tune=empty)
    knobs = GateKnobs.of(load_settings(REPO_CONFIG))
    lines = simulate_lines(knobs, night)
    gate, tuned = lines[3], lines[4]
    assert tuned == gate.replace("policy=gate", "policy=gate_tuned") + (
        f" knob=none value=none tuned_on_seed={night.tune_seed}"
    )


def default_results() -> dict[Policy, NightResult]:
    settings = load_settings(REPO_CONFIG)
    night = settings.simulate
    draws = draw_night(night, night.seed)
    return {p: run_night(night, draws, p, GateKnobs.of(settings)) for p in Policy}


def test_on_the_default_night_the_gate_misses_no_more_than_free_and_uses_less_reserved() -> None:
    # Issue 14's acceptance check. If this fails on an honest night, say why in the README;
    # do not change the night to make it pass.
    results = default_results()
    gate = results[Policy.GATE]
    assert gate.missed <= results[Policy.ALWAYS_FREE].missed
    assert gate.reserved_s < results[Policy.ALWAYS_RESERVED].reserved_s


def test_the_readme_shows_what_the_default_night_prints() -> None:
    readme = (REPO / "README.md").read_text()
    settings = load_settings(REPO_CONFIG)
    for line in simulate_lines(GateKnobs.of(settings), settings.simulate):
        assert line in readme
