"""``gatekeeper dead-letter list`` and ``... requeue``: see and re-drive abandoned tasks.

A task whose deadline passed in defer waits in the dead-letter queue (kombu's Redis lists;
the broker must be Redis, as for the replayer). ``requeue`` gives it a new deadline, given
explicitly (an operator's decision: it is the one place a deadline is ever moved, and the
decision line says so), scores it again through the same pipeline as a publish, and moves it
to the queue decided, in one atomic step (``move.lua``): never in two places.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from gatekeeper.celery.lists import PRIORITY_STEPS, queue_list
from gatekeeper.core.headers import (
    H_ATTEMPT,
    H_DEADLINE_AT,
)
from gatekeeper.ops.context import settings_of
from gatekeeper.ops.oncall import redis_client
from gatekeeper.redis.attempt import carried_publish
from gatekeeper.redis.gate import Pipeline
from gatekeeper.redis.scripts import evalsha, load_lua

__all__ = ["dead_letter"]


def _messages(broker: Any, queue: str) -> list[tuple[str, bytes, dict[str, Any]]]:
    """(list, raw, message) of every message in a queue's lists, oldest first."""
    found = []
    for name in (queue_list(queue, step) for step in PRIORITY_STEPS):
        for raw in reversed(broker.lrange(name, 0, -1)):
            try:
                found.append((name, raw, json.loads(raw)))
            except ValueError:
                continue
    return found


@click.group(name="dead-letter")
def dead_letter() -> None:
    """Tasks abandoned because their deadline passed: list them, requeue one."""


@dead_letter.command(name="list")
@click.pass_context
def list_command(ctx: click.Context) -> None:
    """One line per dead-lettered task, oldest first."""
    settings = settings_of(ctx)
    broker = redis_client(ctx, broker=True)
    found = _messages(broker, settings.dead_letter_queue)
    for _, _, message in found:
        headers = message.get("headers") or {}
        click.echo(f"job_id={headers.get('id')} task={headers.get('task')} "
                   f"attempt={headers.get(H_ATTEMPT)} deadline_at={headers.get(H_DEADLINE_AT)} "
                   f"reason={headers.get('gatekeeper_reason')}")  # fmt: skip
    click.echo(f"dead_lettered={len(found)} queue={settings.dead_letter_queue}")


@dead_letter.command(name="requeue")
@click.argument("job_id")
@click.option("--deadline-s", type=float, required=True,
              help="Its new deadline, in seconds from now (given explicitly).")  # fmt: skip
@click.pass_context
def requeue(ctx: click.Context, job_id: str, deadline_s: float) -> None:
    """Score one dead-lettered task again with a new deadline, and move it where it goes."""
    if not deadline_s > 0:
        raise click.BadParameter("expected a positive number of seconds", param_hint="--deadline-s")
    settings = settings_of(ctx)
    broker, gate = redis_client(ctx, broker=True), redis_client(ctx)
    match = [m for m in _messages(broker, settings.dead_letter_queue)
             if (m[2].get("headers") or {}).get("id") == job_id]  # fmt: skip
    if not match:
        raise click.ClickException(f"no task {job_id} in {settings.dead_letter_queue}")
    source, raw, message = match[0]
    headers: dict[str, Any] = message["headers"]
    now = time.time()
    headers[H_DEADLINE_AT] = now + deadline_s
    routing = Pipeline.create(settings, gate, time.time).route(carried_publish(headers, "requeue"))
    headers.update(routing.headers)
    for name in routing.drop:
        headers.pop(name, None)
    queue = routing.queue or settings.reserved_queue
    properties = message["properties"]
    properties["delivery_info"] = {"exchange": "", "routing_key": queue}
    target = queue_list(queue, int(properties.get("priority") or 0))
    move = broker.register_script(load_lua("move.lua"))
    if not evalsha(broker, move, [source, target], [raw, json.dumps(message)]):
        raise click.ClickException(f"{job_id} left {settings.dead_letter_queue} meanwhile")
    click.echo(f"requeued {job_id} to {queue} (reason {routing.reason.value}, "
               f"deadline in {deadline_s:g} s)")  # fmt: skip
