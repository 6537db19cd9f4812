"""The alert rules (config/prometheus/gatekeeper-rules.yml) load in promtool, pass their unit
tests (gatekeeper-rules.test.yml), and every alert there has a case where it fires and one
where it does not."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from gatekeeper import defaults
from tests.conftest import missing_server
from tests.metrics_contract import CONTRACT, RULES, alerting_rules

RULES_DIR = RULES.parent
RULE_TESTS = RULES_DIR / "gatekeeper-rules.test.yml"
SEVERITIES = {"critical", "warning"}


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        missing_server("promtool is not installed (apt-get install prometheus)")
    assert found is not None
    return found


def test_rules_file_passes_promtool_check() -> None:
    check = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(alerting_rules())} rules found" in check.stdout


def test_scrape_config_passes_promtool_check() -> None:
    """config/prometheus/prometheus.yml (compose's Prometheus) parses and finds the rules."""
    check = subprocess.run(
        [_promtool(), "check", "config", "prometheus.yml"],
        cwd=RULES_DIR, capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 1 rule files found" in check.stdout


def test_every_rule_passes_its_promtool_unit_tests() -> None:
    run = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name],
        cwd=RULES_DIR, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = set(alerting_rules())
    # promtool passes a quiet case for a name no rule has: such a case tests nothing.
    assert (firing | quiet) <= names, f"tests name no rule: {(firing | quiet) - names}"
    assert names - firing == set(), "alerts with no firing case"
    assert names - quiet == set(), "alerts with no case where they stay quiet"


def test_every_alert_says_how_bad_and_what_to_do() -> None:
    for name, rule in alerting_rules().items():
        assert "for" in rule, name
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"]["summary"], name
        # Each description names at least one command an on-call can run.
        assert re.search(r"`(gatekeeper|curl|redis-cli|grep|python) [^`]+`",
                         rule["annotations"]["description"]), name  # fmt: skip


@pytest.mark.parametrize(
    ("restated", "value"),
    [
        ("window_seconds", f"[{defaults.WINDOW_SECONDS // 60}m]"),
        ("miss_error_budget", f") > {defaults.MISS_ERROR_BUDGET:g}"),
        ("miss_min_admissions", f">= {defaults.MISS_MIN_ADMISSIONS}"),
    ],
)
def test_slack_miss_rule_restates_the_auto_freeze_defaults(restated: str, value: str) -> None:
    """The rules file cannot read gatekeeper's settings: it repeats the defaults it depends
    on, and this holds it to them (config/prometheus/gatekeeper-rules.yml's header)."""
    assert defaults.WINDOW_SECONDS % 60 == 0
    expr = alerting_rules()["GatekeeperSlackMissesOverBudget"]["expr"]
    assert value in expr, f"{restated}: expected {value!r} in {expr!r}"


def test_slack_miss_summary_names_the_error_budget_in_force() -> None:
    summary = alerting_rules()["GatekeeperSlackMissesOverBudget"]["annotations"]["summary"]
    assert f"(error budget {defaults.MISS_ERROR_BUDGET:.0%})" in summary


def test_rules_file_names_only_metrics_of_the_contract() -> None:
    used: set[str] = set()
    for rule in alerting_rules().values():
        used.update(re.findall(r"\bgatekeeper_[a-z_]+\b", rule["expr"]))
    assert used <= set(CONTRACT), f"not in docs/metrics.md: {used - set(CONTRACT)}"
