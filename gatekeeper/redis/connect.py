"""A client for a Redis URL: ``redis://``, ``rediss://`` (TLS), ``unix://``, ``sentinel://``, or
``redis+cluster://`` and ``rediss+cluster://`` (a Redis Cluster: :mod:`gatekeeper.redis.cluster`).

Sentinel URLs name the Sentinels and the master (kombu's ``;``-joined form is read too)::

    sentinel://[:password@]host:26379[,host2:26379]/<db>?master_name=<name>

and give a client that asks the Sentinels for the master: after a failover, its connections
to the old master (now a replica, answering ``READONLY``) are dropped and the new master
found, so the gate decides again with no restart (the breaker, :mod:`gatekeeper.redis.
breaker`, keeps publishes off the socket meanwhile). What a failover can lose: writes the old
master acknowledged but had not replicated yet (the last decisions' records and counters, a
flag change; flag writes and the auto-freeze ``WAIT`` for replicas for that reason).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
from redis.sentinel import Sentinel

from gatekeeper.errors import ConfigError
from gatekeeper.redis.cluster import cluster_client
from gatekeeper.settings import CLUSTER_URL_SCHEMES

__all__ = ["SENTINEL", "client_for"]

SENTINEL = "sentinel://"


def client_for(url: str, timeout_s: float, **options: Any) -> redis.Redis:
    """A client on ``url`` with connect and read timeouts of ``timeout_s``."""
    if url.startswith(SENTINEL):
        return _sentinel_master(url, timeout_s, options)
    if url.startswith(CLUSTER_URL_SCHEMES):
        return cluster_client(url, timeout_s, options)
    return redis.Redis.from_url(
        url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, **options
    )


def _sentinel_master(url: str, timeout_s: float, options: dict[str, Any]) -> redis.Redis:
    hosts: list[tuple[str, int]] = []
    db, master, password = 0, None, None
    for part in filter(None, url.split(";")):
        parsed = urlsplit(part)
        for spot in parsed.netloc.rpartition("@")[2].split(","):
            host, _, port = spot.rpartition(":")
            try:
                hosts.append((host or "localhost", int(port or 26379)))
            except ValueError:
                raise ConfigError(f"redis_url: expected host:port in {url!r}") from None
        password = parsed.password or password
        if parsed.path.strip("/").isdigit():
            db = int(parsed.path.strip("/"))
        master = parse_qs(parsed.query).get("master_name", [master])[0]
    if not master or not hosts:
        raise ConfigError(
            f"redis_url: a sentinel URL needs hosts and ?master_name=<name>, got {url!r}"
        )
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    # Untyped before redis-py 8.2, typed since (keyword by keyword): taken as Any, so that
    # mypy passes with either.
    sentinel_class: Any = Sentinel
    sentinels = sentinel_class(hosts, sentinel_kwargs=dict(timeouts), **timeouts)
    client: redis.Redis = sentinels.master_for(
        master, db=db, password=password, **timeouts, **options
    )
    return client
