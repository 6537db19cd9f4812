"""URLs of the gate's Redis and the broker: the schemes gatekeeper opens, a URL checked whole
before use (a bad port or query value is a :class:`ConfigError` naming the setting, not a
traceback at the first publish), and a URL as it may be shown (no password)."""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import urlsplit

from gatekeeper.errors import ConfigError

__all__ = [
    "CLUSTER_URL_SCHEMES",
    "GATE_URL_SCHEMES",
    "REDIS_URL_SCHEMES",
    "redis_url_of",
    "url_problem",
    "without_passwords",
]

REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://", "sentinel://")
"""The URLs of one Redis server the gate's clients open (:mod:`gatekeeper.redis.connect`;
kombu's ``redis+socket://`` is not among them): the broker's, when the gate reads it."""
CLUSTER_URL_SCHEMES = ("redis+cluster://", "rediss+cluster://")
"""A Redis Cluster, for the gate's Redis only (:mod:`gatekeeper.redis.cluster`)."""
GATE_URL_SCHEMES = (*REDIS_URL_SCHEMES, *CLUSTER_URL_SCHEMES)
"""What ``redis_url`` may be."""


def _parts(url: str) -> list[str]:
    """One URL, or a ``sentinel://`` list's (``;``-separated: kombu's form); a password of any
    other URL may hold a ``;``."""
    parts = url.split(";") if url.startswith("sentinel://") else [url]
    return parts if all("://" in part for part in filter(None, parts)) else [url]


def _masked(part: str) -> str:
    scheme, sep, rest = part.partition("://")
    if not sep:
        return part
    cut = re.search(r"[?#]", rest)  # the query: a password there is percent-encoded
    head, tail = (rest[: cut.start()], rest[cut.start() :]) if cut else (rest, "")
    if "@" in head:  # the userinfo up to the last '@' before it (a password may hold '@')
        userinfo, _, host = head.rpartition("@")
        if ":" in userinfo:
            head = f"{userinfo.partition(':')[0]}:***@{host}"
    return scheme + sep + head + re.sub(r"(?i)(password=)[^&#]*", r"\1***", tail)


def without_passwords(url: str) -> str:
    """``url`` with its password as ``***``, and any ``password=`` value (error messages end
    up in log lines); a ``sentinel://`` list that cannot be split (a ``;`` in a password) is
    shown as its scheme alone."""
    parts = _parts(url)
    if url.startswith("sentinel://") and len(parts) == 1 and ";" in url:
        return "sentinel://***"
    return ";".join(_masked(part) for part in parts)


def _said(exc: ValueError) -> str:
    """What redis-py or urllib found, in words of its own (their messages may quote a piece
    of the password, read as a port)."""
    text = str(exc)
    if named := re.search(r"Invalid value for [`'](\w+)[`']", text):  # 5.0: backquotes
        return f"the query's {named.group(1)} has a value redis-py cannot read"
    if "IPv6" in text:
        return "a broken IPv6 host"
    if "port" in text.lower():
        return (
            "a port that is not a number from 0 to 65535 (a password with '/', '@', '?' "
            "or '#' must be percent-encoded)"
        )
    return "a URL redis-py cannot read"


def url_problem(url: str) -> str | None:
    """What keeps ``url`` from being opened (a port out of range, a broken IPv6 host, a query
    value redis-py cannot read), said without its password; None when it parses."""
    from redis import connection  # redis-py's own reading of a redis:// URL

    parse_url: Callable[[str], object] = connection.parse_url

    try:
        for part in filter(None, _parts(url)):
            parts = urlsplit(part)
            for spot in parts.netloc.rpartition("@")[2].split(","):  # host:port,host:port
                if spot:
                    urlsplit(f"//{spot}").port  # noqa: B018 - raises for a bad port or host
            if part.startswith(("redis://", "rediss://", "unix://")):
                parse_url(part)
    except ValueError as exc:
        return f"expected a URL that can be opened: {_said(exc)}"
    return None


def redis_url_of(name: str, url: str | None, note: str = "") -> str:
    """``url`` when redis-py can open it; else :class:`ConfigError` naming ``name``."""
    where = f"{name} {note}".strip()
    if not url:
        raise ConfigError(f"{where}: expected a Redis URL (redis://host:port/db), got none")
    if not url.startswith(REDIS_URL_SCHEMES):
        raise ConfigError(
            f"{where}: expected a Redis URL (redis://, rediss://, unix:// or sentinel://), "
            f"got {without_passwords(url)!r}"
        )
    if problem := url_problem(url):
        raise ConfigError(f"{where}: {problem}, got {without_passwords(url)!r}")
    return url
