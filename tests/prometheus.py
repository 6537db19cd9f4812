"""A real Prometheus for the suite: Debian's ``/usr/bin/prometheus`` started on a free loopback
port with a configuration the test gives, its storage in a temporary directory, stopped at
the end; and a small client of its HTTP API (``/api/v1/...``)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from tests.processes import log_tail, stop_group, wait_started

DEBIAN_SERVER = "/usr/bin/prometheus"


def find_prometheus() -> str | None:
    """The server binary to start, or None when Prometheus is not installed."""
    if os.access(DEBIAN_SERVER, os.X_OK):
        return DEBIAN_SERVER
    return shutil.which("prometheus")


class PrometheusServer:
    """``with PrometheusServer(tmp, config) as server: server.query("up")``."""

    def __init__(
        self, directory: Path, config: dict[str, Any], port: int, start_timeout_s: float = 60.0
    ) -> None:
        self.directory = directory
        self.config = config
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PrometheusServer:
        server = find_prometheus()
        if server is None:
            raise FileNotFoundError("prometheus is not installed")
        self.directory.mkdir(parents=True, exist_ok=True)
        config_file = self.directory / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.log = self.directory / "server.log"
        with self.log.open("wb") as out:
            self._process = subprocess.Popen(
                [server, f"--config.file={config_file}",
                 f"--storage.tsdb.path={self.directory / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=out, stderr=subprocess.STDOUT, cwd=self.directory,
                start_new_session=True,
            )  # fmt: skip
        wait_started(self._process, "prometheus", self.log, self._ready, self.start_timeout_s)
        return self

    def tail(self) -> str:
        return log_tail(self.log)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def api(self, path: str, **params: str | list[str]) -> Any:
        """``GET /api/v1/<path>``'s ``data``; an error reply raises with Prometheus's own word."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:  # 400 and 422 carry the PromQL error
            body = json.load(exc)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query now: a vector's series, or a scalar as one series."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        stop_group(self._process)


def finite_values(series: list[dict[str, Any]]) -> list[float]:
    """The finite sample values of an instant query's result (NaN and infinities dropped)."""
    values = (float(item["value"][1]) for item in series)
    return [value for value in values if math.isfinite(value)]
