"""The metrics contract, read from docs/metrics.md: the names, types and labels the exporter
exposes and the alert rules and the dashboard are written against; and the alert rules."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from tests.conftest import REPO_ROOT

METRICS_DOC = REPO_ROOT / "docs" / "metrics.md"
RULES = REPO_ROOT / "config" / "prometheus" / "gatekeeper-rules.yml"
_ROW = re.compile(r"^\| `(gatekeeper_[a-z_]+)` \| (counter|gauge) \|([^|]*)\|")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    """``counter`` or ``gauge``."""
    labels: frozenset[str]


def read_contract() -> dict[str, Metric]:
    """Every row of the doc's table, by name."""
    metrics: dict[str, Metric] = {}
    for line in METRICS_DOC.read_text().splitlines():
        row = _ROW.match(line)
        if row:
            name, kind, labels = row.groups()
            metrics[name] = Metric(name, kind, frozenset(re.findall(r"`([a-z_]+)`", labels)))
    return metrics


CONTRACT = read_contract()


def alerting_rules() -> dict[str, dict[str, Any]]:
    """Every alerting rule of config/prometheus/gatekeeper-rules.yml, by name."""
    document = yaml.safe_load(RULES.read_text())
    return {
        rule["alert"]: rule
        for group in document["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
