"""docker-compose.yml must be valid for ``docker compose config`` (no engine needed), and the
services that watch the gate (the exporter, Prometheus, Grafana) must fit together."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO_ROOT, missing_server


def _compose() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_file_is_valid_and_has_every_service() -> None:
    compose = _compose()
    if compose is None:
        missing_server("neither `docker compose` nor `docker-compose` is installed")
    check = subprocess.run([*compose, "config", "-q"], cwd=REPO_ROOT, capture_output=True)
    assert check.returncode == 0, check.stderr.decode()
    services = subprocess.run(
        [*compose, "config", "--services"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.split()
    assert set(services) == {"redis", "init", "free-worker", "reserved-worker", "replayer",
                             "producer", "exporter", "prometheus", "grafana"}  # fmt: skip


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    """``docker compose config`` (every profile), parsed: paths resolved, the anchors merged."""
    compose = _compose()
    if compose is None:
        missing_server("neither `docker compose` nor `docker-compose` is installed")
    config = subprocess.run(
        [*compose, "--profile", "grafana", "config"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    parsed: dict[str, Any] = yaml.safe_load(config.stdout)["services"]
    return parsed


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path (or volume name), from either form compose prints."""
    mounts: dict[str, str] = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        mounts[target] = source
    return mounts


def test_the_exporter_serves_the_gate_it_watches(services: dict[str, Any]) -> None:
    exporter = services["exporter"]
    assert exporter["command"] == ["gatekeeper", "metrics", "--port", "9808", "--host", "0.0.0.0"]
    assert exporter["image"] == services["replayer"]["image"]
    assert (
        exporter["environment"]["GATEKEEPER_REDIS_URL"]
        == (services["replayer"]["environment"]["GATEKEEPER_REDIS_URL"])
    )


def test_prometheus_scrapes_the_exporter_with_the_rules_loaded(services: dict[str, Any]) -> None:
    prometheus = services["prometheus"]
    config_dir = Path(_mounts(prometheus)["/etc/prometheus"])
    assert config_dir == REPO_ROOT / "config" / "prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    config = yaml.safe_load((config_dir / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "gatekeeper"  # what the rules' up{job=...} selects
    assert job["static_configs"] == [{"targets": ["exporter:9808"]}]
    assert config["rule_files"] == ["gatekeeper-rules.yml"]
    assert (config_dir / "gatekeeper-rules.yml").is_file()


def test_grafana_is_optional_and_provisions_the_dashboard(services: dict[str, Any]) -> None:
    grafana = services["grafana"]
    assert grafana["profiles"] == ["grafana"]  # not started by a plain `up`
    mounts = _mounts(grafana)
    provisioning = Path(mounts["/etc/grafana/provisioning"])
    assert provisioning == REPO_ROOT / "config" / "grafana" / "provisioning"
    providers = yaml.safe_load((provisioning / "dashboards" / "gatekeeper.yml").read_text())
    dashboards = providers["providers"][0]["options"]["path"]
    assert Path(mounts[f"{dashboards}/gatekeeper.json"]) == (
        REPO_ROOT / "config" / "grafana" / "gatekeeper.json"
    )


def test_redis_never_evicts_gatekeepers_keys() -> None:
    conf = (REPO_ROOT / "config" / "redis.conf").read_text()
    assert "maxmemory-policy noeviction" in conf
    assert (
        "./config/redis.conf:/usr/local/etc/redis/redis.conf"
        in (REPO_ROOT / "docker-compose.yml").read_text()
    )
