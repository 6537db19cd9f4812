"""The gate's Redis as a Redis Cluster: ``redis+cluster://`` URLs, and what differs on one.

::

    redis+cluster://[[user]:password@]host:port[,host:port...][/0][?option=value&...]
    rediss+cluster://...   (TLS, with rediss:// options: ssl_ca_certs=..., ssl_cert_reqs=...)

The hosts are startup nodes (one that answers is enough: it names the others); the options
are redis-py's, as in ``redis://`` URLs. Every key of a namespace carries one hash tag
(:mod:`gatekeeper.redis.keys`), so a namespace is one slot, served by one primary: every script
and every transaction of the gate touches that one slot. What differs from one server:

- The client connects at its first command, not when it is made (redis-py's ``RedisCluster``
  asks for the cluster's map in its constructor, and raises when no node answers): an install
  whose cluster is away fails its decisions closed and decides again once it answers, as it
  does with one server.
- redis-py's ``RedisClusterException`` (no node answered, the slot is not served) is not a
  ``RedisError``: commands raise ``redis.ConnectionError`` for it, a Redis that did not answer
  (the breaker opens, callers fail closed).
- What is asked of one server goes to the primary that serves the namespace's slot
  (:func:`home`): ``MULTI``/``EXEC`` (redis-py before 6.1 has no transactions on a cluster),
  ``INFO`` (that node's ``maxmemory-policy`` is the one that can evict the gate's keys) and
  ``WAIT`` (that node's replicas are the ones a failover promotes).
- The breaker's probe reads a key of the namespace (:func:`probe_of`): a ``PING`` goes to one
  default node, which may be the one that died, and answers nothing about the slot.
- No wire line (:mod:`gatekeeper.redis.wire` keeps a socket to one server) and no fast publish
  (the broker is never a cluster: kombu has no cluster transport).
- No automatic retry: redis-py 5 retries a cluster command three times besides its nodes'
  policy (``cluster_error_retry_attempts``), 6 and later as the ``retry`` given says.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisClusterException

from gatekeeper.errors import ConfigError
from gatekeeper.forks import renew_in_children
from gatekeeper.urls import CLUSTER_URL_SCHEMES

__all__ = ["CLUSTER_URL_SCHEMES", "GateCluster", "cluster_client", "home", "is_cluster", "probe_of",
           "shown_nodes"]  # fmt: skip

REDIS_PY_MAJOR = int(redis.__version__.split(".")[0])

_IDLE, _CONNECTING, _CONNECTED = "idle", "connecting", "connected"
ONE_SERVER_ONLY = frozenset({"connection_pool", "connection"})
"""Attributes of a one-server client that a cluster client never has: code that tells the
two apart asks for them, and is answered without a connection."""


class GateCluster(RedisCluster):
    """A ``RedisCluster`` that connects at its first command (and again at the next one when
    that failed), and raises ``redis.ConnectionError`` where redis-py raises its cluster
    exception.

    Until it has connected it holds only its options: redis-py's own attributes are set by
    ``RedisCluster.__init__``, run by :meth:`_connect` when one is first looked up (Python asks
    ``__getattr__`` only for attributes an object does not have, so a connected client pays
    nothing for this).
    """

    def __init__(self, **options: Any) -> None:  # RedisCluster.__init__ runs in _connect
        self.__dict__.update(_gk_options=options, _gk_state=_IDLE, _gk_lock=threading.RLock())
        renew_in_children(self)

    def _forked(self) -> None:
        """In a forked child: a lock of its own, and a connect that another thread of the
        parent had under way (its lock held, half of redis-py's attributes set) started over."""
        if self.__dict__["_gk_state"] == _CONNECTING:
            self._forget()
        self.__dict__["_gk_lock"] = threading.RLock()

    def _forget(self) -> None:
        for name in [name for name in self.__dict__ if not name.startswith("_gk_")]:
            del self.__dict__[name]  # nothing half-made is used: the next call starts over
        self.__dict__["_gk_state"] = _IDLE

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("_gk_", "__")) or name in ONE_SERVER_ONLY:
            raise AttributeError(name)
        with self._gk_lock:  # a thread that finds another connecting waits for it
            if self._gk_state == _IDLE:
                self._connect()
            elif self._gk_state == _CONNECTING:  # RedisCluster.__init__ asking for itself
                raise AttributeError(name)
        return object.__getattribute__(self, name)

    def _connect(self) -> None:
        self.__dict__["_gk_state"] = _CONNECTING
        try:
            super().__init__(**self._gk_options)
        except BaseException as exc:
            self._forget()
            if isinstance(exc, RedisClusterException):
                raise redis.ConnectionError(f"no Redis Cluster node answered: {exc}") from exc
            raise
        self.__dict__["_gk_state"] = _CONNECTED

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]
        except RedisClusterException as exc:
            # The gate's keys share one slot, so no command of its is refused for crossing
            # slots: this is a cluster that could not serve the namespace's slot.
            raise redis.ConnectionError(f"the Redis Cluster did not serve it: {exc}") from exc

    def get_encoder(self) -> Any:
        """Before the first connection, the encoder the options make (``register_script``
        hashes scripts with it when a store is made, which must not connect)."""
        if self._gk_state == _CONNECTED:
            return super().get_encoder()  # type: ignore[no-untyped-call]
        names = ("encoding", "encoding_errors", "decode_responses")
        return redis.ConnectionPool(
            **{name: self._gk_options[name] for name in names if name in self._gk_options}
        ).get_encoder()

    def close(self) -> None:
        if self._gk_state == _CONNECTED:
            super().close()


def shown_nodes(client: Any) -> str:
    """The startup nodes a cluster client was given (host:port, never a password)."""
    nodes = client.__dict__.get("_gk_options", {}).get("startup_nodes") or []
    return "cluster " + ",".join(f"{node.host}:{node.port}" for node in nodes)


def is_cluster(client: Any) -> bool:
    """Whether a client talks to a Redis Cluster."""
    return isinstance(client, RedisCluster)


def home(client: redis.Redis, key: str, fresh: bool = False) -> redis.Redis:
    """The server that holds ``key``: ``client`` itself, or on a cluster a client of the
    primary that serves ``key``'s slot, as the cluster client last mapped it (a command it
    sends after a failover refreshes the map). ``fresh``: asked through the cluster client
    first (``EXISTS key``, one round trip), which follows a ``MOVED`` and maps the slot
    again: a slot moved to another primary (a reshard) is then found. Commands sent to the
    returned node alone never refresh the map: a process that sends nothing else (the
    metrics exporter) kept asking the old primary until it restarted."""
    if not isinstance(client, RedisCluster):
        return client
    try:
        if fresh:
            client.exists(key)
        node = client.get_redis_connection(client.get_node_from_key(key))
    except RedisClusterException as exc:
        raise redis.ConnectionError(f"no Redis Cluster node serves {key!r}: {exc}") from exc
    return cast(redis.Redis, node)


def probe_of(client: redis.Redis, key: str) -> Callable[[], object]:
    """What the breaker's probe sends: ``PING``; on a cluster, ``EXISTS key``, which goes to the
    primary of the namespace's slot (after a failover, the promoted one: a failed command
    refreshes the client's map)."""
    if isinstance(client, RedisCluster):
        return lambda: client.exists(key)
    return client.ping


def cluster_client(url: str, timeout_s: float, options: dict[str, Any]) -> redis.Redis:
    """A :class:`GateCluster` for a ``redis+cluster://`` or ``rediss+cluster://`` URL.

    Typed as a ``redis.Redis``: it answers every command the gate sends one server (keyed
    commands, ``EVALSHA`` and ``SCRIPT LOAD``, pipelines, locks); what differs is above, and
    each place that asks a server rather than a key (``INFO``, ``WAIT``, transactions, the
    probe, the wire line, fast publish) asks :func:`is_cluster` or :func:`home`.
    """
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # a bracketed host that is not IPv6, say
        raise ConfigError(f"redis_url: expected host:port in {url!r}: {exc}") from None
    tls = parts.scheme == "rediss+cluster"
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes = [_node(spot, url) for spot in hosts.split(",") if spot]
    if not nodes:
        raise ConfigError(f"redis_url: a cluster URL needs host:port of a node, got {url!r}")
    first = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}x"
    query = f"?{parts.query}" if parts.query else ""
    given = parse_url(first + parts.path + query)  # type: ignore[no-untyped-call]
    given.pop("host", None)
    given.pop("port", None)
    if int(given.pop("db", 0) or 0) != 0:
        raise ConfigError(f"redis_url: a Redis Cluster has database 0 only, got {url!r}")
    given.pop("connection_class", None)  # SSLConnection for rediss: ssl=True says it here
    if tls:
        given["ssl"] = True
    settings: dict[str, Any] = {
        **given,
        "socket_connect_timeout": timeout_s,
        "socket_timeout": timeout_s,
        **options,
    }
    if "retry" in settings:
        if REDIS_PY_MAJOR < 6:  # its own retries of a cluster command, besides the nodes'
            settings.setdefault("cluster_error_retry_attempts", 0)
        else:  # deprecated there (its retry policy says what is retried)
            settings.pop("retry_on_timeout", None)
    return cast(
        redis.Redis,
        GateCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],  # type: ignore[no-untyped-call]
            require_full_coverage=False,  # the gate needs its one slot, not all of them
            **settings,
        ),
    )


def _node(spot: str, url: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``), the port 6379 when none is given."""
    if spot.startswith("["):
        host, _, rest = spot[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, colon, port = spot.rpartition(":")
        if not colon:
            host, port = spot, ""
    try:
        return host or "localhost", int(port or 6379)
    except ValueError:
        raise ConfigError(f"redis_url: expected host:port in {url!r}, got {spot!r}") from None
