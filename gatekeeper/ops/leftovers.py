"""What ``gatekeeper demo`` removes when it ends on servers it did not start (a
``GATEKEEPER_REDIS_URL``): its namespace's keys and its queues. ``--keep`` keeps them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
import redis
from kombu.connection import Connection
from kombu.exceptions import ChannelError

from gatekeeper.redis.keys import Keys
from gatekeeper.urls import without_passwords

__all__ = ["remove_demo"]


def _glob(text: str) -> str:
    """``text`` matched as written in a ``SCAN`` pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def remove_demo(url: str, broker: str, keys: Keys, run_id: str, delays: Sequence[int] = ()) -> None:
    """Remove what the demo wrote to servers it did not start, once its workers are stopped:
    its namespace's keys in the gate's Redis, and its queues on the broker: on Redis their
    lists (priority lists and the replayer's claims included) and kombu's bindings of them
    (``binding_permanent``: kombu 5.5 and later); on another transport (RabbitMQ) the queues,
    the replayer's delay queues of each (``<queue>.delay.<ms>`` for ``delays``, whichever
    were made) and their exchanges, through kombu."""
    queues = f"{_glob(run_id)}.*"
    on_redis = (f"{queues}", f"_kombu.binding.{queues}", f"_kombu.binding_permanent.{queues}")
    if broker == url:
        _remove_keys(url, (f"{_glob(keys.base)}:*", *on_redis))
        return
    _remove_keys(url, (f"{_glob(keys.base)}:*",))
    if broker.split(":", 1)[0] in ("redis", "rediss", "unix"):
        _remove_keys(broker, on_redis)
        return
    roles = [f"{run_id}.{role}" for role in ("free", "defer", "reserved", "dead_letter")]
    names = [*roles, *(f"{queue}.delay.{ms}" for queue in roles for ms in delays)]
    removed = 0
    try:
        with Connection(broker, connect_timeout=5) as connection:  # type: ignore[no-untyped-call]
            connection.ensure_connection(max_retries=1)
            for name in names:
                removed += _delete_queue(connection, name)
    except Exception as exc:  # the broker gone: say so, never hide the demo's own result
        click.echo(f"could not remove the demo's queues from {without_passwords(broker)}: "
                   f"{exc}", err=True)  # fmt: skip
        return
    click.echo(f"removed the demo's {removed} queues from {without_passwords(broker)}")


def _delete_queue(connection: Any, name: str) -> int:
    """Delete a queue and its exchange of the same name; 0 when there was none (asked
    first, passively: a failed operation closes its channel, which is then dropped)."""
    channel = connection.channel()
    try:
        channel.queue_declare(name, passive=True)
    except ChannelError:
        return 0
    channel.queue_delete(name)
    channel.exchange_delete(name)  # Celery's queue is bound to an exchange of its name
    channel.close()
    return 1


def _remove_keys(url: str, patterns: tuple[str, ...]) -> None:
    removed, where, pattern = 0, without_passwords(url), patterns[0]
    try:
        client = redis.Redis.from_url(url)
        for pattern in patterns:
            for name in client.scan_iter(match=pattern, count=1000):
                removed += int(client.delete(name))
    except redis.RedisError as exc:
        click.echo(f"could not remove the demo's keys from {where} ({pattern}): {exc}", err=True)
        return
    click.echo(f"removed the demo's {removed} keys from {where} (--keep keeps them)")
