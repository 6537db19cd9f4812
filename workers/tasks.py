"""The demo workload's task: one embedding chunk of a nightly batch (declared, not a model call).

It sleeps for its declared service time (times ``GATEKEEPER_DEMO_TIME_SCALE``) and meters the
declared tokens. On a worker started with ``GATEKEEPER_DEMO_ROLE=free`` a seeded coin flip
kills a share (``[drill] kill_fraction``) of first attempts half-way through, the way a free
slot dies mid-task; the attempt then retries, and the retry is scored again by the gate.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from celery import Celery

import gatekeeper
from gatekeeper.settings import GatekeeperSettings

__all__ = ["SlotDied", "register_tasks", "slot_dies"]

TASK_NAME = "workers.embed_chunk"


class SlotDied(RuntimeError):
    """The free slot running the attempt went away (the demo's injected failure)."""


def slot_dies(seed: int, job_id: str, attempt: int, kill_fraction: float) -> bool:
    """The source's coin flip, seeded per job and attempt so a rerun kills the same ones."""
    return random.Random(f"{seed}:{job_id}:{attempt}").random() < kill_fraction


def register_tasks(app: Celery, settings: GatekeeperSettings) -> None:
    """Define the demo task on ``app``, gated with the declared workload of ``[drill]``."""
    drill = settings.drill
    spec = {
        "expected_service_s": drill.service_s,
        "tokens_in": drill.input_tokens_per_job,
        "tokens_out": drill.output_tokens_per_job,
        "deadline_s": drill.deadline_slack_s,
    }

    @app.task(bind=True, name=TASK_NAME, max_retries=drill.max_retries, gatekeeper=spec)  # type: ignore[untyped-decorator]
    def embed_chunk(self: Any, chunk_id: int) -> dict[str, Any]:
        scale = float(os.environ.get("GATEKEEPER_DEMO_TIME_SCALE", "1"))
        service = drill.service_s * scale
        attempt = self.request.retries + 1
        on_free = os.environ.get("GATEKEEPER_DEMO_ROLE") == "free"
        dies = slot_dies(drill.seed, self.request.id, attempt, drill.kill_fraction)
        if on_free and attempt == 1 and dies:  # the source kills a share of first attempts
            time.sleep(service / 2)
            gatekeeper.meter(tokens_in=drill.input_tokens_per_job, tokens_out=0)
            raise self.retry(countdown=0, exc=SlotDied(f"chunk {chunk_id} lost its slot"))
        time.sleep(service)
        gatekeeper.meter(
            tokens_in=drill.input_tokens_per_job, tokens_out=drill.output_tokens_per_job
        )
        return {"chunk_id": chunk_id, "attempt": attempt}
