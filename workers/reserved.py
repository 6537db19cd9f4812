"""``python -m workers.reserved``: a Celery worker consuming the reserved queue."""

from __future__ import annotations

from workers.run import worker

if __name__ == "__main__":
    worker("reserved")
