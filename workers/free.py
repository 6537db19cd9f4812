"""``python -m workers.free``: a Celery worker consuming the free queue."""

from __future__ import annotations

from workers.run import worker

if __name__ == "__main__":
    worker("free")
