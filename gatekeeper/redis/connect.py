"""A client for a Redis URL: ``redis://``, ``rediss://`` (TLS), ``unix://``, ``sentinel://``, or
``redis+cluster://`` and ``rediss+cluster://`` (a Redis Cluster: :mod:`gatekeeper.redis.cluster`).

Sentinel URLs name the Sentinels and the master (kombu's ``;``-joined form is read too)::

    sentinel://[[user]:password@]host:26379[,host2:26379]/<db>?master_name=<name>[&...]

The user and password are the master's (an ACL user, or the default one). Query options:
``sentinel_password`` and ``sentinel_username`` (the Sentinels' own ``requirepass`` or ACL
user), ``ssl=true`` with ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` and
``ssl_cert_reqs`` (``required``, ``optional``, ``none``) for TLS to the master, and
``sentinel_ssl=true`` for TLS to the Sentinels too (the same certificates); as kombu reads a
broker's URL, any ``ssl_*`` option turns TLS on and ``ssl_cert_reqs`` may be written
``CERT_REQUIRED``. On the gate's own URL any other option is refused by name (ignored, a
misspelt ``ssl_ca_certs`` would leave the connection in plain text without a word); a
broker's URL may carry options for kombu (``connect_timeout``...), left alone here.

and give a client that asks the Sentinels for the master: after a failover, its connections
to the old master (now a replica, answering ``READONLY``) are dropped and the new master
found, so the gate decides again with no restart (the breaker, :mod:`gatekeeper.redis.
breaker`, keeps publishes off the socket meanwhile). What a failover can lose: writes the old
master acknowledged but had not replicated yet (the last decisions' records and counters, a
flag change; flag writes and the auto-freeze ``WAIT`` for replicas for that reason).

A broker's URL may leave the master out, as Celery's documented set-up does (kombu reads
the master only from its transport options, and refuses a one-host broker URL's
``?master_name=``): the transport options (Celery's ``broker_transport_options``) then name
it, ``{"master_name": "mymaster"}``, with the Sentinels' own connection options (their
password) in ``sentinel_kwargs``, as kombu reads them. The URL's ``?master_name`` wins over
the options'; the password in the URL is the master's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from gatekeeper.core.flagvalues import FALSE, TRUE
from gatekeeper.errors import ConfigError
from gatekeeper.redis.cluster import cluster_client
from gatekeeper.urls import CLUSTER_URL_SCHEMES, without_passwords

__all__ = ["SENTINEL", "client_for"]

SENTINEL = "sentinel://"


def client_for(
    url: str,
    timeout_s: float,
    transport_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> redis.Redis:
    """A client on ``url`` with connect and read timeouts of ``timeout_s``. When ``url`` is a
    broker's, ``transport_options`` are its kombu transport options (a sentinel URL's master
    and the Sentinels' ``sentinel_kwargs``); None for a URL that is no broker's."""
    if url.startswith(SENTINEL):
        return _sentinel_master(url, timeout_s, transport_options, options)
    if url.startswith(CLUSTER_URL_SCHEMES):
        return cluster_client(url, timeout_s, options)
    return redis.Redis.from_url(
        url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, **options
    )


def _sentinel_master(
    url: str,
    timeout_s: float,
    transport_options: Mapping[str, Any] | None,
    options: dict[str, Any],
) -> redis.Redis:
    hosts: list[tuple[str, int]] = []
    db, master, password, username = 0, None, None, None
    query: dict[str, str] = {}
    for part in filter(None, url.split(";")):
        parsed = urlsplit(part)
        for spot in parsed.netloc.rpartition("@")[2].split(","):
            host, _, port = spot.rpartition(":")
            try:
                hosts.append((host or "localhost", int(port or 26379)))
            except ValueError:
                raise ConfigError(f"redis_url: expected host:port in {_shown(url)!r}") from None
        password = unquote(parsed.password) if parsed.password else password
        username = unquote(parsed.username) if parsed.username else username
        if parsed.path.strip("/").isdigit():
            db = int(parsed.path.strip("/"))
        query.update({k: v[-1] for k, v in parse_qs(parsed.query).items()})
    master = query.pop("master_name", None) or _master_option(transport_options)
    if not master or not hosts:
        raise ConfigError(_no_master(url, transport_options is not None))
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    broker = transport_options is not None
    field = "broker_url" if broker else "redis_url"
    own, tls, sentinel_tls = _sentinel_options(query, url, field, strict=not broker)
    # The Sentinels' own options (a password) as kombu takes them, then the URL's; our
    # timeouts win, so that an unreachable Sentinel costs a publish what Redis would.
    sentinel_kwargs = {**_sentinel_kwargs(transport_options), **own, **sentinel_tls, **timeouts}
    # Untyped before redis-py 8.2, typed since (keyword by keyword): taken as Any, so that
    # mypy passes with either.
    sentinel_class: Any = Sentinel
    sentinels = sentinel_class(hosts, sentinel_kwargs=sentinel_kwargs, **timeouts)
    client: redis.Redis = sentinels.master_for(
        master, db=db, password=password, username=username, **tls, **timeouts, **options
    )
    return client


_SENTINEL_AUTH = {"sentinel_password": "password", "sentinel_username": "username"}
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_TLS_FLAGS = ("ssl", "sentinel_ssl", "ssl_check_hostname")
_CERT_REQS = ("required", "optional", "none")


def _sentinel_options(
    query: dict[str, str], url: str, field: str, strict: bool
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A sentinel URL's query options: the Sentinels' auth, TLS to the master, TLS to the
    Sentinels. As kombu reads them, any ``ssl_*`` option turns TLS on and ``ssl_cert_reqs``
    may be ``CERT_REQUIRED``. ``strict`` (the gate's own URL, no broker's): any other option
    is refused by name; a broker's URL may hold options for kombu, which this leaves alone."""
    own = {_SENTINEL_AUTH[k]: query.pop(k) for k in list(query) if k in _SENTINEL_AUTH}
    if not strict and "ssl_check_hostname" in query:  # kombu: anything but "false" is on
        query["ssl_check_hostname"] = str(query["ssl_check_hostname"].lower() != "false")
    flags = {k: _flag(query.pop(k), k, url, field) for k in _TLS_FLAGS if k in query}
    tls: dict[str, Any] = {k: query.pop(k) for k in _TLS_FILES if k in query}
    if "ssl_cert_reqs" in query:
        reqs = query.pop("ssl_cert_reqs")
        if reqs.lower().removeprefix("cert_") not in _CERT_REQS:
            raise ConfigError(f"{field}: ssl_cert_reqs: expected one of {', '.join(_CERT_REQS)}"
                              f", got {reqs!r} in {_shown(url)!r}")  # fmt: skip
        tls["ssl_cert_reqs"] = reqs.lower().removeprefix("cert_")
    if "ssl_check_hostname" in flags:
        tls["ssl_check_hostname"] = flags.pop("ssl_check_hostname")
    if strict and query:
        raise ConfigError(
            f"{field}: a sentinel URL takes master_name, {', '.join(_SENTINEL_AUTH)}, "
            f"{', '.join(_TLS_FLAGS)}, {', '.join(_TLS_FILES)} and ssl_cert_reqs; got "
            f"{', '.join(sorted(query))} in {_shown(url)!r}"
        )
    master = flags.get("ssl", bool(tls))  # kombu: any ssl_* option means TLS
    if tls and not (master or flags.get("sentinel_ssl")):
        raise ConfigError(f"{field}: {', '.join(sorted(tls))} with ssl=false in {_shown(url)!r}")
    master_tls = {"ssl": True, **tls} if master else {}
    sentinel_tls = {"ssl": True, **tls} if flags.get("sentinel_ssl") else {}
    return own, master_tls, sentinel_tls


def _flag(text: str, name: str, url: str, field: str) -> bool:
    if text.lower() in TRUE:
        return True
    if text.lower() in FALSE:
        return False
    raise ConfigError(f"{field}: {name}: expected true or false, got {text!r} in {_shown(url)!r}")


def _master_option(transport_options: Mapping[str, Any] | None) -> str | None:
    master = (transport_options or {}).get("master_name")
    if master is not None and not (isinstance(master, str) and master):
        raise ConfigError(
            f"broker_transport_options: master_name: expected the master's name, got {master!r}"
        )
    return master


def _sentinel_kwargs(transport_options: Mapping[str, Any] | None) -> dict[str, Any]:
    kwargs = (transport_options or {}).get("sentinel_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise ConfigError(
            "broker_transport_options: sentinel_kwargs: expected a mapping of the Sentinels' "
            f"connection options ({{'password': ...}}), got {type(kwargs).__name__}"
        )
    return dict(kwargs)


def _no_master(url: str, is_broker: bool) -> str:
    if not is_broker:
        return f"redis_url: a sentinel URL needs hosts and ?master_name=<name>, got {_shown(url)!r}"
    return (
        "broker_url: a sentinel broker needs hosts and its master's name: ?master_name=<name> "
        "in the URL, or master_name in the broker's transport options (the app's "
        "broker_transport_options = {'master_name': '<name>'}, or "
        f"GATEKEEPER_BROKER_TRANSPORT_OPTIONS), got {_shown(url)!r}"
    )


def _shown(url: str) -> str:
    """``url`` without its passwords (error messages end up in log lines)."""
    return without_passwords(url)
