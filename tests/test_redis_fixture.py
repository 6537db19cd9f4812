"""The suite's Redis is a real server: Lua runs, and the server reports a real version."""

from __future__ import annotations

import redis

from gatekeeper.ops.embedded import EmbeddedRedis, find_redis_server


def test_the_fixture_server_runs_lua(redis_client: redis.Redis) -> None:
    script = redis_client.register_script(
        "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('INCRBY', KEYS[1], ARGV[2])"
    )
    assert script(keys=["gk:test"], args=[40, 2]) == 42
    assert redis_client.info("server")["redis_version"]


def test_an_embedded_server_stops_when_its_block_ends() -> None:
    with EmbeddedRedis(find_redis_server()) as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        process = server.process
        client.close()
    assert process is not None and process.poll() is not None
