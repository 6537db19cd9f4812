"""The demo workload's task: one embedding batch of a nightly job (declared, not a model call).

It sleeps for its declared service time and reports the tokens it declared. Gating it is the
publish-time gate's job (gatekeeper issue 3); until then it is an ordinary Celery task.
"""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

__all__ = ["embed_chunk"]


@shared_task(name="workers.embed_chunk", bind=True, max_retries=1)  # type: ignore[untyped-decorator]
def embed_chunk(self: Any, chunk_id: int, service_s: float = 1.5) -> dict[str, Any]:
    """Pretend to embed one chunk: wall-clock time is the point, not the vectors."""
    time.sleep(service_s)
    return {"chunk_id": chunk_id, "attempt": self.request.retries + 1}
