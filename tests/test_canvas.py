"""Canvas around gated tasks on a real worker: a chord's ungated callback stays on the app's
own queue (README: "ungated tasks, and a chord's ungated callback, stay on them")."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from celery import chord

from tests.apps.gated_app import create_app
from tests.conftest import gate_settings, queue_messages, running_worker, wait_until

pytestmark = pytest.mark.celery


def test_a_chords_ungated_callback_stays_on_the_apps_own_queue(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The gated header runs on free; the worker that runs its last task publishes the
    callback through gatekeeper's hook, which leaves an ungated task on its route: `celery`,
    which this worker does not consume, with none of gatekeeper's headers."""
    app = create_app(gate_settings(redis_url), redis_url)
    app.conf.result_backend = redis_url
    embed, plain = app.tasks["tests.embed"], app.tasks["tests.plain"]
    with running_worker(redis_url, tmp_path / "w.log", GATEKEEPER_TEST_RESULT_BACKEND=redis_url):
        chord([embed.s(1), embed.s(2)], plain.si()).apply_async()
        assert wait_until(lambda: queue_messages(redis_client, "celery"), 30), (
            tmp_path / "w.log"
        ).read_text()
    (callback,) = queue_messages(redis_client, "celery")
    assert callback["headers"]["task"] == "tests.plain"
    assert not any(key.startswith("gatekeeper_") for key in callback["headers"])
    for queue in ("free", "defer", "reserved"):
        assert not queue_messages(redis_client, queue), queue
