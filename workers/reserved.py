"""``python -m workers.reserved``: a Celery worker consuming the reserved queue."""

from __future__ import annotations

from workers.run import exit_on_config_error, worker

if __name__ == "__main__":
    exit_on_config_error(lambda: worker("reserved"))
