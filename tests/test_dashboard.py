"""The Grafana dashboard (config/grafana/gatekeeper.json) is provisionable, and every query in
it returns data from a real Prometheus that scrapes the gatekeeper metrics with the shipped
scrape config and alert rules; every metric of docs/metrics.md is drawn or alerted on."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO_ROOT, missing_server, unused_port
from tests.fake_exporter import exposition, fake_exporter
from tests.metrics_contract import CONTRACT, METRICS_DOC, RULES, alerting_rules
from tests.prometheus import PrometheusServer, find_prometheus, finite_values

DASHBOARD = REPO_ROOT / "config" / "grafana" / "gatekeeper.json"
PROVISIONING = REPO_ROOT / "config" / "grafana" / "provisioning"
SCRAPE_CONFIG = REPO_ROOT / "config" / "prometheus" / "prometheus.yml"
GRAFANA_VARIABLES = {
    # What Grafana puts in before it sends a query; "All" exporters is the regex ".*".
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "5m",
    "${instance}": ".*",
    "$instance": ".*",
}


def _dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def panels() -> list[dict[str, Any]]:
    """Every panel but the rows, those inside collapsed rows included."""
    found: list[dict[str, Any]] = []
    for panel in _dashboard()["panels"]:
        found.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return found


def queries() -> list[tuple[str, str]]:
    """(panel title / refId, expr) of every target of every panel."""
    return [
        (f"{panel['title']} / {target['refId']}", target["expr"])
        for panel in panels()
        for target in panel["targets"]
    ]


def as_sent(expr: str) -> str:
    """The query as Grafana sends it to Prometheus."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable the test does not know: {expr}"
    return expr


def metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\bgatekeeper_[a-z_]+\b", expr))


# --- the files, no server -----------------------------------------------------------------


def test_dashboard_is_provisionable_json() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "gatekeeper"
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    # A provisioned dashboard with an "id" would clash with the one Grafana assigns.
    assert "id" not in dashboard
    ids = [panel["id"] for panel in dashboard["panels"]] + [
        inner["id"] for panel in dashboard["panels"] for inner in panel.get("panels", [])
    ]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels():
        where = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["targets"], where
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), where
        assert all(target["expr"].strip() for target in panel["targets"]), where
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, where


def test_provisioning_loads_the_dashboard_and_a_default_prometheus() -> None:
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert (source["type"], source["isDefault"]) == ("prometheus", True)
    assert source["url"] == "http://prometheus:9090"  # the compose service
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "gatekeeper.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_the_contract_table_is_read_whole() -> None:
    rows = [line for line in METRICS_DOC.read_text().splitlines()
            if line.startswith("| `gatekeeper_")]  # fmt: skip
    assert len(CONTRACT) == len(rows) > 0


def test_every_metric_of_the_contract_is_drawn_or_alerted_on() -> None:
    drawn = set().union(*(metrics_in(expr) for _, expr in queries()))
    alerted = set().union(*(metrics_in(rule["expr"]) for rule in alerting_rules().values()))
    assert drawn <= set(CONTRACT), (
        f"panels name metrics not in the contract: {drawn - set(CONTRACT)}"
    )
    assert set(CONTRACT) - (drawn | alerted) == set(), "metrics neither drawn nor alerted on"


def test_the_fixture_exposition_is_the_contract() -> None:
    """Every metric of docs/metrics.md, with its type and its labels, and nothing else: what
    the Prometheus tests below see is what the exporter is to expose."""
    text = exposition(1, time.time())
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    assert types == {name: metric.kind for name, metric in CONTRACT.items()}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample = re.match(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$", line)
        assert sample, line
        name, labels, _ = sample.groups()
        assert set(re.findall(r'(\w+)="', labels or "")) == CONTRACT[name].labels, line


# --- against a real Prometheus ------------------------------------------------------------


@pytest.fixture(scope="module")
def exporter_target() -> Iterator[str]:
    """``host:port`` serving the gatekeeper metrics at ``/metrics`` (tests/fake_exporter.py)."""
    with fake_exporter() as target:
        yield target


@pytest.fixture(scope="module")
def prometheus(
    exporter_target: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PrometheusServer]:
    """Prometheus with the shipped scrape config (job, rules) pointed at ``exporter_target``,
    scraping and evaluating every second; yielded once it has scraped three times."""
    if find_prometheus() is None:
        missing_server("prometheus is not installed (apt-get install prometheus)")
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    (job,) = config["scrape_configs"]
    job["scrape_timeout"] = "1s"
    job["static_configs"] = [{"targets": [exporter_target]}]
    directory: Path = tmp_path_factory.mktemp("prometheus")
    with PrometheusServer(directory, config, unused_port()) as server:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            scraped = finite_values(server.query("count_over_time(gatekeeper_redis_up[1m])"))
            evaluated = [
                rule.get("lastEvaluation", "").startswith("0001")
                for group in server.api("rules")["groups"]
                for rule in group["rules"]
            ]
            if scraped and scraped[0] >= 3 and evaluated and not any(evaluated):
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"no three scrapes and an evaluation in 30 s:\n{server.tail()}")
        yield server


@pytest.mark.servers
def test_the_exporter_is_scraped_as_job_gatekeeper(prometheus: PrometheusServer) -> None:
    (target,) = prometheus.api("targets")["activeTargets"]
    assert target["health"] == "up", target["lastError"]
    assert target["labels"]["job"] == "gatekeeper"  # what the rules' up{job=...} selects


@pytest.mark.servers
def test_scraped_types_are_the_contracts(prometheus: PrometheusServer) -> None:
    metadata = prometheus.api("metadata")
    scraped = {name: entries[0]["type"] for name, entries in metadata.items()
               if name.startswith("gatekeeper_")}  # fmt: skip
    assert scraped == {name: metric.kind for name, metric in CONTRACT.items()}


@pytest.mark.servers
@pytest.mark.parametrize(("panel", "expr"), queries(), ids=[where for where, _ in queries()])
def test_every_panel_query_returns_data(
    prometheus: PrometheusServer, panel: str, expr: str
) -> None:
    result = prometheus.query(as_sent(expr))
    assert finite_values(result), f"{panel}: {as_sent(expr)} returned {result}"


@pytest.mark.servers
def test_the_exporter_variable_lists_the_scraped_exporter(
    prometheus: PrometheusServer, exporter_target: str
) -> None:
    (variable,) = [item for item in _dashboard()["templating"]["list"]
                   if item["name"] == "instance"]  # fmt: skip
    call = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"])
    assert call, variable["query"]
    metric, label = call.groups()
    assert prometheus.api(f"label/{label}/values", **{"match[]": metric}) == [exporter_target]


@pytest.mark.servers
def test_every_rule_evaluates_without_error(prometheus: PrometheusServer) -> None:
    rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
    assert {rule["name"] for rule in rules} == set(alerting_rules())
    for rule in rules:
        assert (rule["health"], rule.get("lastError", "")) == ("ok", ""), rule["name"]


@pytest.mark.servers
@pytest.mark.parametrize("alert", sorted(alerting_rules()))
def test_no_alert_holds_on_a_healthy_gate(prometheus: PrometheusServer, alert: str) -> None:
    """The fixture is a healthy gate: no alert's condition is true of it (the promtool tests
    show each one true of a sick one)."""
    assert prometheus.query(alerting_rules()[alert]["expr"]) == []
