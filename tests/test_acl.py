"""The README's minimal ACL for the gate's Redis, on a real redis-server: a user held to
gatekeeper's keys and the commands the README lists runs everything the gate does there (init,
gated publishes, a worker's rows, status, ledger, flags, sweep, a replayer pass), and the
server's ``ACL LOG`` shows no command refused."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.ops.cli import main
from gatekeeper.ops.embedded import EmbeddedRedis, EmbeddedRedisError
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from tests.acl import PASSWORD, USER, acl_rules, refused
from tests.apps.gated_app import RUNS_KEY, create_app
from tests.conftest import (
    REPO_ROOT,
    gate_settings,
    missing_server,
    queue_messages,
    running_worker,
    wait_until,
)

pytestmark = pytest.mark.celery

KEYS = Keys()


@pytest.fixture()
def gate_admin() -> Iterator[tuple[redis.Redis, str]]:
    """A gate Redis of its own with the README's user, that snapshots (a flag write takes a
    snapshot: ``CONFIG GET save``, ``BGSAVE``): its default user's client, and the gate
    user's URL."""
    try:
        server = EmbeddedRedis(args=("--save", "900", "1")).start()
    except EmbeddedRedisError as exc:
        missing_server(str(exc))
    admin = redis.Redis.from_url(server.url)
    for rule in acl_rules(cluster=False):
        admin.execute_command(*rule)
    try:
        yield admin, f"redis://{USER}:{PASSWORD}@127.0.0.1:{server.port}/0"
    finally:
        server.stop()


def cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_the_readmes_acl_is_enough_for_everything_the_gate_does_on_its_redis(
    redis_url: str,
    redis_client: redis.Redis,
    gate_admin: tuple[redis.Redis, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin, url = gate_admin
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", url)
    monkeypatch.setenv("GATEKEEPER_BROKER_URL", redis_url)
    cli("init", "--open", "--reason", "acl test")
    app = create_app(gate_settings(url), redis_url, recorder_url=redis_url)
    embed = app.tasks["tests.embed"]
    admitted = [embed.delay(n).id for n in range(2)]
    embed.apply_async((9,), headers={"gatekeeper_deadline_s": 1.5})  # reserved, by gate.lua
    late = embed.apply_async((8,), headers={"gatekeeper_deadline_at": 1.0}).id  # record.lua
    # A worker named past 64 bytes: finish.lua's cut writes its records again (kept.py).
    long_name = f"test-{time.monotonic_ns():020d}@worker-7d9f8c6b5-x2x9k.batch-nightly.svc.local"
    with running_worker(redis_url, tmp_path / "worker.log", GATEKEEPER_REDIS_URL=url,
                        GATEKEEPER_TEST_RECORDER_URL=redis_url, hostname=long_name):  # fmt: skip
        assert wait_until(lambda: redis_client.llen(RUNS_KEY) == 2)
        assert wait_until(lambda: admin.zcard(KEYS.started) == 0)
    assert len(long_name) > 64
    for job in admitted:
        assert admin.hget(KEYS.run(job, 1), "kept") is not None  # cut after its row
        assert admin.object("encoding", KEYS.run(job, 1)) in (b"ziplist", b"listpack")
    assert "state=initialised" in cli("status")
    assert "finished=2 killed_rows=0" in cli("ledger", "--json", str(tmp_path / "rows.json"))
    cli("flags", "set", "canary_percent", "50", "--reason", "acl test")
    # The auto-freeze and a re-open are written under WATCH (a reviewer: the README's line
    # lacked it, and both were refused).
    flags = FlagStore(redis.Redis.from_url(url), gate_settings(url))
    assert flags.close("acl test: misses", "gatekeeper:auto-freeze", time.time()) is not None
    assert admin.hget(KEYS.flags, "free_path_enabled") == b"false"
    cli("flags", "set", "free_path_enabled", "true", "--force", "--reason", "acl test")
    assert admin.hget(KEYS.flags, "free_path_enabled") == b"true"
    cli("sweep")
    cli("replay", "--once")  # its deadline is gone: dead letter, with an abandoned row
    assert [m["headers"]["id"] for m in queue_messages(redis_client, "dead_letter")] == [late]
    window = int(time.time() // 900)
    rows = [json.loads(raw) for raw in admin.lrange(KEYS.window_rows(window), 0, -1)]
    assert sorted((row["job_id"], row["outcome"]) for row in rows) == sorted(
        [(job, "ok") for job in admitted] + [(late, "abandoned")]
    )
    # Decision records were written (gate.lua, record.lua) and tune reads them back.
    assert "changed=0 undecidable=0 superseded=0" in cli("tune", "--since", "1h")
    assert admin.hget(KEYS.totals, "records_refused") is None
    assert refused(admin) == []


GATE_SCRIPTS = sorted(set((REPO_ROOT / "gatekeeper" / "lua").glob("*.lua")) - {
    REPO_ROOT / "gatekeeper" / "lua" / "move.lua"})  # fmt: skip
"""The scripts run on the gate's Redis (``move.lua`` runs on the broker's: what kombu needs)."""


def _code(line: str) -> str:
    """A line of Lua without its comment (a ``--`` outside a quoted string)."""
    quote = ""
    for at, char in enumerate(line):
        if quote:
            quote = "" if char == quote and line[at - 1] != "\\" else quote
        elif char in "'\"":
            quote = char
        elif line.startswith("--", at):
            return line[:at]
    return line


def test_every_command_the_gates_scripts_run_is_granted_by_the_readmes_acl() -> None:
    # A script's commands are checked against its caller's ACL. The run-through above reaches
    # the usual paths only: a rarer one (a withdrawn expiry, an entry naming another window)
    # asked HEXISTS, which the README never granted, and failed halfway under it (a reviewer).
    (rule,) = acl_rules(cluster=False)
    granted = {word[1:].lower() for word in rule if word.startswith("+")}
    used: dict[str, set[str]] = {}
    unread: list[str] = []
    for script in GATE_SCRIPTS:
        lines = script.read_text(encoding="utf-8").splitlines()
        code = "\n".join(_code(line) for line in lines)
        assert "[[" not in code, f"{script.name}: a long string this test does not read"
        for call in re.finditer(r"redis\.p?call\b(\s*\(\s*(['\"])([A-Za-z]+)\2)?", code):
            if call.group(1) is None:  # a command this test cannot read: name it literally
                unread.append(f"{script.name}: {code[call.start() : call.start() + 40]!r}")
            else:
                used.setdefault(call.group(3).lower(), set()).add(script.name)
    assert unread == []
    assert {"evalsha", "hset", "xadd"} <= granted and len(used) > 20  # read as meant
    assert {command: sorted(by) for command, by in used.items() if command not in granted} == {}
