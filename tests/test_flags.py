"""Live flags: SPEC section 4's precedence, the cache, the canary hash and the CLI."""

from __future__ import annotations

import time

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.core.ledger import window_id
from gatekeeper.errors import ConfigError, FreePathLocked
from gatekeeper.ops.cli import main
from gatekeeper.redis.flags import STATE_FIELD, FlagStore, combine, in_canary, parse_flag
from gatekeeper.redis.keys import Keys
from gatekeeper.redis.store import GateStore
from gatekeeper.settings import GatekeeperSettings
from tests.calls import gate_call
from tests.conftest import initialised

KEYS = Keys()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store(client: redis.Redis, clock: Clock | None = None, **settings: object) -> FlagStore:
    return FlagStore(client, GatekeeperSettings(**settings), clock=clock or Clock())


@pytest.mark.parametrize(
    ("in_settings", "in_redis", "effective"),
    [
        (True, None, True),
        (True, "false", False),
        (False, None, False),
        (False, "true", False),  # re-enabling needs both sources
        (True, "true", True),
        (True, "garbage", False),  # a corrupt override never opens the free path
    ],
)
def test_free_path_is_off_when_either_source_says_off(
    redis_client: redis.Redis, in_settings: bool, in_redis: str | None, effective: bool
) -> None:
    flags = store(redis_client, free_path_enabled=in_settings)
    if in_redis is not None:
        redis_client.hset(flags.keys.flags, "free_path_enabled", in_redis)
    assert flags.current().free_path_enabled is effective


def test_redis_overrides_the_other_flags_until_unset(redis_client: redis.Redis) -> None:
    flags = store(redis_client, dwell_gate_enabled=False, canary_percent=5)
    flags.set("dwell_gate_enabled", "true", "canary start", "me", 1.0)
    flags.set("canary_percent", "50", "widen", "me", 2.0)
    assert (flags.current().dwell_gate_enabled, flags.current().canary_percent) == (True, 50.0)
    flags.unset("dwell_gate_enabled", "done", "me", 3.0)
    assert flags.current().dwell_gate_enabled is False


def test_flags_are_read_at_most_flag_cache_s_stale(redis_client: redis.Redis) -> None:
    clock = Clock()
    flags = store(redis_client, clock, flag_cache_s=5)
    assert flags.current().free_path_enabled
    redis_client.hset(flags.keys.flags, "free_path_enabled", "false")
    clock.now = 4.9
    assert flags.current().free_path_enabled  # still cached
    clock.now = 5.0
    assert not flags.current().free_path_enabled


def test_every_change_is_logged_with_reason_and_actor(redis_client: redis.Redis) -> None:
    flags = store(redis_client)
    flags.set("free_path_enabled", "false", "slack misses", "oncall@host", 10.0)
    flags.unset("free_path_enabled", "clean hour", "oncall@host", 20.0)
    newest, oldest = flags.history()
    assert (oldest.name, oldest.value, oldest.reason, oldest.at) == (
        "free_path_enabled",
        "false",
        "slack misses",
        10.0,
    )
    assert newest.value is None
    assert newest.reason.startswith("clean hour (clean hour: (900 s) windows")


def test_a_rollback_never_expires_the_flags_keep_no_ttl(redis_client: redis.Redis) -> None:
    """A stored ``free_path_enabled=false`` that expired would open the free path again by
    itself: none of the writes (init, set, the auto-freeze's close, unset) gives the flags
    hash or their log a TTL, and decisions that read them do not either."""
    redis_client.delete(store(redis_client).keys.flags)  # as before `gatekeeper init`
    flags = store(redis_client)
    keys = flags.keys
    steps = [
        lambda: flags.initialise("deploy", "me", 1.0, open_path=True),
        lambda: flags.set("free_path_enabled", "false", "rollback", "me", 2.0),
        lambda: flags.set("canary_percent", "50", "widen", "me", 3.0),
        lambda: flags.unset("canary_percent", "narrow", "me", 4.0),
        lambda: flags.close("auto-freeze", "gatekeeper:auto-freeze", 5.0),
        flags.current,
    ]
    for step in steps:
        step()
        assert redis_client.ttl(keys.flags) == -1 and redis_client.ttl(keys.flags_log) == -1
    assert redis_client.hget(keys.flags, "free_path_enabled") == b"false"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("canary_percent", "150"),
        ("canary_percent", "nan"),
        ("free_path_enabled", "maybe"),
        ("x", "1"),
    ],
)
def test_bad_flag_values_name_the_flag(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name if name != "x" else "flag name"):
        parse_flag(name, value)


def test_the_canary_slice_is_a_stable_share_of_job_ids() -> None:
    ids = [f"job-{n}" for n in range(10_000)]
    inside = [job for job in ids if in_canary(job, 5)]
    assert 400 < len(inside) < 600
    assert inside == [job for job in ids if in_canary(job, 5)]
    assert set(inside) <= {job for job in ids if in_canary(job, 50)}
    assert not any(in_canary(job, 0) for job in ids) and all(in_canary(j, 100) for j in ids)


def test_cli_shows_both_sources_and_the_history(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    runner = CliRunner()
    assert (
        runner.invoke(main, ["flags", "set", "canary_percent", "25", "--reason", "r1"]).exit_code
        == 0
    )
    output = runner.invoke(main, ["flags"]).output
    assert "canary_percent: effective=25.0 settings=5.0 redis=25.0" in output
    assert "free_path_enabled: effective=true settings=true redis=-" in output
    assert "canary_percent=25.0 by " in output and ": r1" in output
    assert runner.invoke(main, ["flags", "unset", "canary_percent"]).exit_code == 0
    assert (
        "canary_percent: effective=5.0 settings=5.0 redis=-"
        in runner.invoke(main, ["flags"]).output
    )


def test_a_flag_written_to_a_namespace_never_initialised_says_so(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rollback written to a namespace no deployment uses (a typo, or the app's namespace
    # set only in its Celery config and the command run without -A) said it was done, and the
    # real namespace stayed open (an audit). It is written, and the command says where.
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    monkeypatch.setenv("GATEKEEPER_NAMESPACE", "typo")
    runner = CliRunner()
    result = runner.invoke(main, ["flags", "set", "free_path_enabled", "false"])
    assert result.exit_code == 0, result.output
    assert "warning: namespace 'typo' has no state marker" in result.stderr, result.output
    monkeypatch.setenv("GATEKEEPER_NAMESPACE", "default")  # initialised by the suite
    result = runner.invoke(main, ["flags", "set", "canary_percent", "5"])
    assert result.exit_code == 0 and "warning" not in result.stderr, result.output


def test_cli_refuses_a_bad_value_naming_the_flag(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    result = CliRunner().invoke(main, ["flags", "set", "canary_percent", "150"])
    assert result.exit_code == 2 and "canary_percent" in result.output


def test_cli_without_a_redis_url_says_which_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(main, ["flags"])
    assert result.exit_code == 2 and "GATEKEEPER_REDIS_URL" in result.output


def test_a_reopen_while_the_settings_keep_the_path_closed_says_so(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It printed free_path_enabled=true alone, while the path stayed closed where the
    # settings say false (re-opening needs both).
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    monkeypatch.setenv("GATEKEEPER_FREE_PATH_ENABLED", "false")
    result = CliRunner().invoke(main, ["flags", "set", "free_path_enabled", "true", "--force"])
    assert result.exit_code == 0, result.output
    assert "free_path_enabled=true" in result.stdout
    assert "warning: the settings here still say free_path_enabled=false" in result.stderr


@pytest.mark.parametrize(
    ("stored", "closed"),
    [("false", True), ("0", True), (" OFF ", True), ("no", True), ("garbage", True),
     ("true", False), ("1", False), ("Yes", False), (" on", False)],
)  # fmt: skip
def test_a_value_written_by_hand_closes_the_path_as_the_settings_would_read_it(
    redis_client: redis.Redis, stored: str, closed: bool
) -> None:
    """A reviewer: gate.lua (every publisher's check, cache or not) took only ``false`` for
    closed, the Python side any value but a true one (a corrupt one too); and ``flags
    unset`` lifted a hand's ``0`` without a clean hour. Both read a value alike now."""
    initialised(redis_client)
    redis_client.hset(KEYS.flags, "free_path_enabled", stored)
    scored = GateStore(redis_client, KEYS).score(gate_call(1_800_000_000.0, job_id=stored))
    assert (scored.reason.value == "free_path_disabled") is closed
    assert (combine(GatekeeperSettings(), {"free_path_enabled": stored, STATE_FIELD: "1"})
            .free_path_enabled) is not closed  # fmt: skip
    if closed:  # lifting it is a re-open: refused without a clean hour (a killed row here)
        redis_client.hset(KEYS.window(window_id(time.time(), 900)), "rows:killed", 1)
        with pytest.raises(FreePathLocked):
            store(redis_client).unset("free_path_enabled", "x", "oncall", time.time())
