"""A real RabbitMQ for the suite: Debian's ``rabbitmq-server`` started on free loopback ports in
a temporary directory, stopped at the end of the session.

Debian's ``/usr/sbin/rabbitmq-server`` switches to the ``rabbitmq`` user; the script it runs
(``/usr/lib/rabbitmq/bin/rabbitmq-server``) is started directly, with its node name, data,
logs and Erlang cookie all under the temporary directory, and no plugins.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path
from types import TracebackType

from tests.processes import stop_group, wait_started

DEBIAN_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


def find_rabbitmq_server() -> str | None:
    """The server script to start, or None when RabbitMQ is not installed."""
    if os.access(DEBIAN_SERVER, os.X_OK):
        return DEBIAN_SERVER
    return shutil.which("rabbitmq-server")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RabbitServer:
    """``with RabbitServer(tmp) as server: server.url`` (guest on loopback, vhost ``/``)."""

    def __init__(self, directory: Path, start_timeout_s: float = 90.0) -> None:
        self.directory = directory
        self.port = _free_port()
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RabbitServer:
        server = find_rabbitmq_server()
        if server is None:
            raise FileNotFoundError("rabbitmq-server is not installed")
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "plugins").write_text("[].\n")
        name = f"gatekeeper{os.getpid()}x{self.port}@localhost"
        env = {
            **os.environ,
            "HOME": str(self.directory),
            "RABBITMQ_NODENAME": name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(_free_port()),
            "RABBITMQ_MNESIA_BASE": str(self.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.directory / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.directory / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.directory / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.directory / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(self.directory / "pid"),
        }
        self.log = self.directory / "server.log"
        with self.log.open("wb") as out:
            self._process = subprocess.Popen(
                [server], stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=self.directory, start_new_session=True,
            )  # fmt: skip
        wait_started(self._process, "rabbitmq-server", self.log, self._started,
                     self.start_timeout_s)  # fmt: skip
        return self

    def _started(self) -> bool:
        return b"completed with" in self.log.read_bytes() and self._answers()

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        stop_group(self._process)
