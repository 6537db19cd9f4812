"""docker-compose.yml must be valid for ``docker compose config`` (no engine needed)."""

from __future__ import annotations

import shutil
import subprocess

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
                             "producer"}  # fmt: skip


def test_redis_never_evicts_gatekeepers_keys() -> None:
    conf = (REPO_ROOT / "config" / "redis.conf").read_text()
    assert "maxmemory-policy noeviction" in conf
    assert (
        "./config/redis.conf:/usr/local/etc/redis/redis.conf"
        in (REPO_ROOT / "docker-compose.yml").read_text()
    )
