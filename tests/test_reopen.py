"""Re-opening the free path: a clean ledger hour, or an explicit force (SPEC section 4)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from gatekeeper.celery.freeze import maybe_freeze
from gatekeeper.core.health import CleanHour, WindowHealth, clean_hour, hour_windows, should_freeze
from gatekeeper.core.ledger import window_id
from gatekeeper.errors import FreePathLocked, LedgerUnavailable
from gatekeeper.logs import make_logger
from gatekeeper.ops.cli import main
from gatekeeper.redis.flags import FlagStore
from gatekeeper.redis.keys import Keys
from gatekeeper.settings import GatekeeperSettings

KEYS = Keys()
W = 2_000_000  # a window id; "now" is its start, so time moves by window ids, not by sleeping


def at(window: int) -> float:
    return window * 900.0


def frozen_store(client: redis.Redis) -> FlagStore:
    store = FlagStore(client, GatekeeperSettings(budget_units=1000))
    store.set("free_path_enabled", "false", "slack misses", "auto", at(W))
    return store


def test_the_last_hour_is_four_windows_of_900_s() -> None:
    # The current window and four complete ones: a full hour however far into W we are.
    assert list(hour_windows(W, 900)) == [W - 4, W - 3, W - 2, W - 1, W]
    assert len(hour_windows(W, 1000)) == 5 and len(hour_windows(W, 3600)) == 2


@pytest.mark.parametrize(
    ("windows", "clean"),
    [
        ([WindowHealth(1), WindowHealth(2)], True),
        ([WindowHealth(1, killed_rows=1), WindowHealth(2)], False),
        ([WindowHealth(1, tax_units=1000.5), WindowHealth(2)], False),
        ([WindowHealth(1, tax_units=1000), WindowHealth(2)], True),
    ],
)
def test_clean_hour_needs_no_kills_and_tax_within_budget(
    windows: list[WindowHealth], clean: bool
) -> None:
    assert clean_hour(windows, budget_units=1000).clean is clean


@pytest.mark.parametrize(
    ("admitted", "misses", "freeze"),
    [(19, 19, False), (20, 0, False), (100, 1, False), (100, 2, True), (20, 1, True)],
)
def test_freeze_rule_needs_enough_admissions_and_a_rate_over_budget(
    admitted: int, misses: int, freeze: bool
) -> None:
    health = WindowHealth(1, admitted_free=admitted, slack_misses=misses)
    assert should_freeze(health, miss_error_budget=0.01, min_admissions=20) is freeze


def test_reopening_is_refused_while_the_hour_has_killed_rows(redis_client: redis.Redis) -> None:
    store = frozen_store(redis_client)
    redis_client.hset(KEYS.window(W - 2), "rows:killed", 1)
    with pytest.raises(FreePathLocked, match=f"window {W - 2} has 1 killed rows"):
        store.set("free_path_enabled", "true", "try", "oncall", at(W))
    assert not store.current().free_path_enabled


def test_reopening_is_refused_while_a_window_is_over_budget(redis_client: redis.Redis) -> None:
    store = frozen_store(redis_client)
    redis_client.hset(KEYS.window(W), "tax_units", 1500)
    with pytest.raises(FreePathLocked, match="over the budget"):
        store.unset("free_path_enabled", "try", "oncall", at(W))


def test_reopening_succeeds_after_a_clean_hour(redis_client: redis.Redis) -> None:
    store = frozen_store(redis_client)
    redis_client.hset(KEYS.window(W), "rows:killed", 2)
    later = W + 5  # windows W+1..W+5: a full hour with no killed rows
    with pytest.raises(FreePathLocked):
        store.set("free_path_enabled", "true", "too soon", "oncall", at(W + 4))
    change = store.set("free_path_enabled", "true", "clean hour", "oncall", at(later))
    assert f"windows {W + 1}..{W + 5}" in change.reason
    assert store.current().free_path_enabled


@pytest.mark.parametrize("killed_after_init", [False, True], ids=["clean", "a_killed_row"])
def test_after_an_init_the_free_path_reopens_once_an_hour_recorded_after_it_is_clean(
    redis_client: redis.Redis, killed_after_init: bool
) -> None:
    """``gatekeeper init`` after a state loss closes the path (initialising is no re-open):
    the windows before it may have been lost, so only an hour of windows all recorded after
    it lets it open again, and only a clean one."""
    redis_client.delete(KEYS.flags)  # the loss
    store = FlagStore(redis_client, GatekeeperSettings(budget_units=1000))
    store.initialise("page 88: state lost", "oncall", at(W))
    assert not store.current().free_path_enabled
    if killed_after_init:
        redis_client.hset(KEYS.window(W + 1), "rows:killed", 1)
    with pytest.raises(FreePathLocked, match="initialised at"):
        store.set("free_path_enabled", "true", "too soon", "oncall", at(W + 3) + 899)
    if killed_after_init:
        with pytest.raises(FreePathLocked, match=f"window {W + 1} has 1 killed rows"):
            store.set("free_path_enabled", "true", "an hour", "oncall", at(W + 4))
        assert not store.current().free_path_enabled
    else:
        change = store.set("free_path_enabled", "true", "an hour", "oncall", at(W + 4))
        assert f"windows {W}..{W + 4}" in change.reason
        assert store.current().free_path_enabled


class RolledBackDuringTheCheck(FlagStore):
    """A real store whose clean-hour check takes long enough for another operator (another
    client, another connection) to roll the free path back, or an auto-freeze to close it."""

    rollback: tuple[redis.Redis, str] | None = None

    def clean_hour(self, now: float) -> CleanHour:
        verdict = super().clean_hour(now)
        if self.rollback is not None:
            client, how = self.rollback
            other = FlagStore(client, GatekeeperSettings(budget_units=1000))
            if how == "unset":  # the settings close it; the operator lifts a Redis override
                other.set("dwell_gate_enabled", "true", "B: gate on", "b", now)
            else:
                other.set("free_path_enabled", "false", "B: misses on free", "b", now)
        return verdict


@pytest.mark.parametrize("how", ["set", "force", "unset"])
def test_a_rollback_made_while_a_reopen_is_checked_is_not_undone(
    redis_url: str, redis_client: redis.Redis, how: str
) -> None:
    # Two operators at once (an audit): A's re-open read a clean hour, B rolled back, then A
    # wrote `true` blindly over B's `false`, both commands said they did it, and the history
    # showed B's later change as if in force. A re-open now writes only if no flag changed
    # since it began its check; A is refused, saying why, and B's rollback stands.
    store = RolledBackDuringTheCheck(redis_client, GatekeeperSettings(budget_units=1000))
    store.set("free_path_enabled", "false", "earlier rollback", "c", at(W))
    store.rollback = (redis.Redis.from_url(redis_url), how)
    with pytest.raises(FreePathLocked, match="flags changed while the re-open was checked"):
        if how == "unset":
            store.unset("free_path_enabled", "A: resolved", "a", at(W + 5))
        else:
            store.set("free_path_enabled", "true", "A: resolved", "a", at(W + 5),
                      force=how == "force")  # fmt: skip
    stored = {k.decode(): v.decode() for k, v in redis_client.hgetall(KEYS.flags).items()}
    assert stored["free_path_enabled"] == "false"
    assert not store.current().free_path_enabled
    assert "A: resolved" not in str(store.history(5))


class AnotherWorkerFreezes(FlagStore):
    """A real store whose ``after``-th read of the flags lets another worker (another
    client) freeze the free path first: two workers whose windows crossed the budget at once."""

    other: redis.Redis | None = None
    after = 1
    reads = 0

    def stored(self) -> dict[str, str]:
        found = super().stored()
        self.reads += 1
        if self.other is not None and self.reads == self.after:
            other = FlagStore(self.other, self.settings)
            assert maybe_freeze(other, make_logger(self.settings, "alert"), W, 1, 1, at(W))
        return found


@pytest.mark.parametrize("after", [1, 2], ids=["before_its_check", "during_its_check"])
def test_two_workers_freezing_at_once_make_one_freeze(
    redis_url: str, redis_client: redis.Redis, after: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # Both read the path open, then each wrote its freeze: two flag log entries, two
    # `free_path_frozen` lines and `gatekeeper_freezes_total` 2 for one freeze (an audit). The
    # freeze is now written under WATCH only while the path is open in Redis.
    settings = GatekeeperSettings(budget_units=1000, miss_min_admissions=1)
    store = AnotherWorkerFreezes(redis_client, settings)
    store.other, store.after = redis.Redis.from_url(redis_url), after
    assert not maybe_freeze(store, make_logger(settings, "alert"), W, 1, 1, at(W))
    assert redis_client.hget(KEYS.flags, "free_path_enabled") == b"false"
    assert redis_client.hget(KEYS.totals, "freezes") == b"1"
    assert len(store.history(10)) == 1
    assert capsys.readouterr().err.count("event=free_path_frozen") == 1


def test_force_reopens_and_says_so(redis_client: redis.Redis) -> None:
    store = frozen_store(redis_client)
    redis_client.hset(KEYS.window(W), "rows:killed", 2)
    change = store.set("free_path_enabled", "true", "vendor fixed", "oncall", at(W), force=True)
    assert change.reason.startswith("vendor fixed (forced: window")
    assert store.current().free_path_enabled


def test_cli_refuses_with_the_reason_and_accepts_force(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", redis_url)
    runner = CliRunner()
    assert runner.invoke(main, ["flags", "set", "free_path_enabled", "false"]).exit_code == 0
    redis_client.hset(KEYS.window(window_id(time.time(), 900)), "rows:killed", 1)
    refused = runner.invoke(main, ["flags", "set", "free_path_enabled", "true", "--reason", "r"])
    assert refused.exit_code == 1
    assert "killed rows" in refused.output and "--force" in refused.output
    assert "event=flag_change_refused" in refused.output
    forced = runner.invoke(main, ["flags", "set", "free_path_enabled", "true", "--force"])
    assert forced.exit_code == 0 and "forced" in forced.stdout


def test_a_window_over_its_miss_budget_freezes_once_without_a_new_miss_then_not_again(
    redis_client: redis.Redis,
) -> None:
    """A reviewer: misses counted while the window had fewer than ``miss_min_admissions``
    admissions were never checked again as admissions came. A row with no miss of its own
    (``once``) now freezes such a window, once: after an operator's forced re-open the
    next such row does not freeze again; a new miss does."""
    settings = GatekeeperSettings(budget_units=1000, miss_min_admissions=3)
    store, alerts = FlagStore(redis_client, settings), make_logger(settings, "alert")
    assert not maybe_freeze(store, alerts, W, 2, 2, at(W))  # the misses, before 3 admissions
    assert maybe_freeze(store, alerts, W, 2, 5, at(W), once=True)  # an on-time row, later
    assert redis_client.hget(KEYS.flags, "free_path_enabled") == b"false"
    store.set("free_path_enabled", "true", "vendor fixed", "oncall", at(W), force=True)
    assert not maybe_freeze(store, alerts, W, 2, 6, at(W), once=True)  # the re-open holds
    assert store.current().free_path_enabled
    assert maybe_freeze(store, alerts, W, 3, 7, at(W))  # a new miss in the window: frozen
    assert redis_client.hget(KEYS.totals, "freezes") == b"2"


def test_a_freeze_whose_write_gets_no_answer_is_tried_again_by_the_next_row(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window is marked as having frozen once the flag is written, not before: a write
    with no answer leaves the next on-time row of the window to freeze it."""
    settings = GatekeeperSettings(budget_units=1000, miss_min_admissions=3)
    store, alerts = FlagStore(redis_client, settings), make_logger(settings, "alert")
    close, calls = FlagStore.close, []

    def silent_once(self: FlagStore, *args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise LedgerUnavailable("cannot write flag free_path_enabled: Timeout")
        return close(self, *args)

    monkeypatch.setattr(FlagStore, "close", silent_once)
    with pytest.raises(LedgerUnavailable):
        maybe_freeze(store, alerts, W, 2, 5, at(W), once=True)
    assert maybe_freeze(store, alerts, W, 2, 6, at(W), once=True)
    assert redis_client.hget(KEYS.flags, "free_path_enabled") == b"false"
