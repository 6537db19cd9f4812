"""A worker runs one copy of a message the replayer handed on twice.

On RabbitMQ the replayer acks a deferred message only once its rewritten copy is confirmed;
one killed in between leaves the original to come back, and the replayer hands it on again
exactly as before (:mod:`gatekeeper.redis.handoff`): two copies with one nonce, each with a
copy value of its own (``gatekeeper_copy``, stamped on every copy the replayer, a requeue or
the expiry publishes). Before a copy runs, the worker's main process asks ``take.lua`` (the
gate's record): the first copy of the decision runs, and so does that same copy delivered
again (the broker's own retry after its worker died: ``start.lua`` counts it); any other copy
is a duplicate, acked and not run, with a ``duplicate_skipped`` line, whether the broker
redelivered it or not (given back by a restarted worker, a requeue, a peek).

Only messages with a copy value can be copies, so no other message pays the round trip. A
fault reading the record lets the copy run: a duplicate is less harmful than a lost task.
"""

from __future__ import annotations

from typing import Any

import redis

from gatekeeper.celery.message import nonce_of
from gatekeeper.core.headers import H_ATTEMPT, H_COPY, H_DECISION
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.scripts import evalsha, load_lua, text_of

__all__ = ["Duplicates"]


class Duplicates:
    """The duplicate check of one app's gated tasks (worker main process)."""

    def __init__(self, client: redis.Redis, keys: Keys, log: Any) -> None:
        self.client = client
        self.keys = keys
        self.log = log
        self._script = client.register_script(load_lua("take.lua"))

    def verdict(self, request: Any, headers: dict[str, Any]) -> str:
        """``run`` or ``skip`` (a duplicate: acked, not run)."""
        nonce, attempt, copy = nonce_of(headers), headers.get(H_ATTEMPT), headers.get(H_COPY)
        if not (isinstance(copy, str) and copy and nonce and type(attempt) is int):
            return "run"
        job_id = str(headers.get("id"))
        decision = str(headers.get(H_DECISION))
        try:
            keys = [self.keys.run(job_id, attempt)]
            answer = text_of(evalsha(self.client, self._script, keys, [nonce, decision, copy]))
        except redis.RedisError as exc:
            self.log.warning("duplicate_check_failed", job_id=job_id, error=repr(exc))
            return "run"
        if answer != "again":
            return "run"
        self.log.warning("duplicate_skipped", task=getattr(request, "name", None), job_id=job_id,
                         attempt=attempt, decision=decision,
                         reason="another copy of this handoff ran")  # fmt: skip
        return "skip"
