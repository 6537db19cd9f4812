"""A gate's Redis that moves under its clients: two ``redis-server`` processes behind one
address (a symlinked Unix socket, as a VIP or a DNS name), failed over from the first to the
second; and a TCP proxy that black-holes the connections open when told to (a flow a NAT or
a load balancer forgot: nothing closes, nothing answers), or loses one request's reply (the
server applied it, the connection broke before its answer came back)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import redis

from gatekeeper.errors import EmbeddedRedisError
from gatekeeper.ops.embedded import find_redis_server
from tests.conftest import missing_server


class Server:
    """A ``redis-server`` on a Unix socket of its own."""

    def __init__(self, directory: Path, name: str) -> None:
        self.socket = directory / f"{name}.sock"
        self.process = subprocess.Popen(
            [find_redis_server(), "--port", "0", "--unixsocket", str(self.socket),
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        self.client = redis.Redis(unix_socket_path=str(self.socket))
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


class Moved:
    """Server ``a`` behind ``address`` (``url`` reaches it) until :meth:`fail_over`."""

    def __init__(self, a: Server, b: Server, address: Path) -> None:
        self.a, self.b, self.address = a, b, address
        address.symlink_to(a.socket)
        self.url = f"unix://{address}"

    def fail_over(self) -> None:
        """``b`` takes ``a``'s data (as its replica would hold it), ``a`` turns replica of
        nobody (it answers writes with READONLY, and keeps its connections), and the address
        points at ``b``."""
        for key in self.a.client.keys("*"):
            self.b.client.restore(key, 0, self.a.client.dump(key), replace=True)
        self.a.client.replicaof("127.0.0.1", "1")
        self.address.unlink()
        self.address.symlink_to(self.b.socket)


@contextmanager
def moved_redis(directory: Path) -> Iterator[Moved]:
    """Two servers behind one address; both stopped at the end."""
    try:
        find_redis_server()
    except EmbeddedRedisError as exc:
        missing_server(str(exc))
    servers: list[Server] = []
    try:
        servers += [Server(directory, "a"), Server(directory, "b")]
        yield Moved(servers[0], servers[1], directory / "gate.sock")
    finally:
        for server in servers:
            server.process.terminate()
            server.process.wait(10)


class BlackHole:
    """A TCP proxy on a free loopback port to ``target``; :meth:`forget` drops every byte of
    the connections open at that moment, both ways, without closing them (new ones work);
    :meth:`lose_reply` loses the reply of one request the server applied."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._forgotten: set[int] = set()
        self._open: list[int] = []
        self._ids = 0
        self._marker: bytes | None = None
        self._losing: set[int] = set()
        self._budget: dict[int, int] = {}
        self.lost = 0
        """How many replies :meth:`lose_reply` has lost."""
        threading.Thread(target=self._accept, daemon=True).start()

    def forget(self) -> None:
        self._forgotten.update(self._open)

    def forget_after(self, replies: int) -> None:
        """Let ``replies`` more bytes of the open connections' replies through, then drop
        every byte both ways (a reply stops in the middle of a frame)."""
        self._budget = {flow: replies for flow in self._open}

    def lose_reply(self, marker: bytes) -> None:
        """The next request that carries ``marker`` reaches the server; its reply does not
        reach the client: the connection is closed, both ways, as the reply comes back."""
        self._marker = marker

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            self._ids += 1
            self._open.append(self._ids)
            for src, dst, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, self._ids, up),
                                 daemon=True).start()  # fmt: skip

    def _pump(self, src: socket.socket, dst: socket.socket, flow: int, up: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:  # shut down first: close() alone leaves the peer's pump's recv
                with suppress(OSError):  # holding the socket, and no FIN goes out
                    dst.shutdown(socket.SHUT_RDWR)
                dst.close()
                return
            if flow in self._forgotten:
                continue
            if not up and flow in self._budget:
                left = self._budget[flow]
                if len(data) >= left:
                    data = data[:left]
                    self._forgotten.add(flow)
                else:
                    self._budget[flow] = left - len(data)
            if not up and flow in self._losing:  # the reply: both ends go, it never arrives
                self.lost += 1
                for end in (src, dst):
                    with suppress(OSError):
                        end.shutdown(socket.SHUT_RDWR)
                return
            if up and self._marker is not None and self._marker in data:
                self._marker = None
                self._losing.add(flow)  # before the request is on its way: its reply follows
            try:
                dst.sendall(data)
            except OSError:
                return
