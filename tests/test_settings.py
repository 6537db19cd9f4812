"""Settings: defaults, the three sources and their precedence, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from gatekeeper.celery.broker import broker_for
from gatekeeper.celery.parts import gate_client
from gatekeeper.core.ledger import BudgetMode
from gatekeeper.errors import ConfigError
from gatekeeper.settings import GatekeeperSettings, load_settings
from workers.app import create_app

REPO_CONFIG = Path(__file__).resolve().parents[1] / "config" / "gatekeeper.toml"


def test_defaults_match_the_spec() -> None:
    settings = load_settings()
    assert (settings.dwell_gate_enabled, settings.free_path_enabled, settings.canary_percent) == (
        False,
        True,
        5.0,
    )
    assert settings.max_queue_age_s == 30
    assert settings.window_seconds == 900
    assert settings.queue_wait_unit_per_second == 200
    assert settings.budget_mode is BudgetMode.EXPOSURE
    assert settings.miss_error_budget == 0.01
    assert (settings.service_time, settings.service_time_min_samples) == ("declared", 100)
    assert settings.service_drift_factor == 1.5
    assert (settings.free_queue, settings.defer_queue, settings.reserved_queue) == (
        "free",
        "defer",
        "reserved",
    )


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("GATEKEEPER_MAX_QUEUE_AGE_S", "-1", "greater than or equal to 0"),
        ("GATEKEEPER_BUDGET_MODE", "maybe", "'exposure' or 'optimistic'"),
        ("GATEKEEPER_CANARY_PERCENT", "150", "less than or equal to 100"),
        ("GATEKEEPER_WINDOW_SECONDS", "0", "greater than or equal to 1"),
        ("GATEKEEPER_FREE_PATH_ENABLED", "perhaps", "valid boolean"),
        ("GATEKEEPER_MAX_QUEUE_AGE_S", "nan", "finite number"),
        ("GATEKEEPER_DRILL__SEED", "x", "valid integer"),
        ("GATEKEEPER_FREE_QUEUE", "fr ee", "pattern '^[A-Za-z0-9_.:\\-]+$'"),  # case kept
        ("GATEKEEPER_REDIS_URL", "localhost:6379", "expected a Redis URL (redis://"),
        ("GATEKEEPER_REDIS_URL", "redis://127.0.0.1:99999/0", "a port that is not a number"),
        ("GATEKEEPER_REDIS_URL", "redis://[::1", "a broken IPv6 host"),
        ("GATEKEEPER_REDIS_URL", "redis://h:6379/0?socket_timeout=abc", "query's socket_timeout"),
        ("GATEKEEPER_REDIS_URL", "sentinel://h1:26379;sentinel://h2:263790", "a port that"),
        ("GATEKEEPER_REDIS_URL", "redis+cluster://h:700000", "a port that is not a number"),
        ("GATEKEEPER_BROKER_URL", "amqp://guest:guest@h:99999//", "a port that is not a"),
        ("GATEKEEPER_SERVICE_TIME", "p95", "'declared', 'learned' or 'max'"),
        ("GATEKEEPER_SERVICE_TIME_MIN_SAMPLES", "0", "greater than or equal to 1"),
        ("GATEKEEPER_SERVICE_DRIFT_FACTOR", "0.5", "greater than or equal to 1"),
        ("GATEKEEPER_SERVICE_DRIFT_FACTOR", "inf", "finite number"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_was_expected(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert variable in str(caught.value)
    assert expected in str(caught.value)


def test_environment_beats_dotenv_which_beats_toml(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("config").mkdir()
    Path("config/gatekeeper.toml").write_text(
        "max_queue_age_s = 11\nbudget_units = 111\ncanary_percent = 11\n"
    )
    Path(".env").write_text("GATEKEEPER_BUDGET_UNITS=222\nGATEKEEPER_CANARY_PERCENT=22\n")
    monkeypatch.setenv("GATEKEEPER_CANARY_PERCENT", "33")
    settings = load_settings()
    assert (settings.max_queue_age_s, settings.budget_units, settings.canary_percent) == (
        11,
        222,
        33,
    )


SOURCES = [
    # setting, environment, the app's CELERY_GATEKEEPER_*, .env, TOML -> in force
    ("free_path_enabled", "false", True, "true", "true", False),  # the runbook's rollback
    ("canary_percent", "44", 33, "22", "11", 44.0),
    ("budget_units", None, 333, "222", "111", 333.0),
    ("max_queue_age_s", None, None, "22", "11", 22.0),
    ("window_seconds", None, None, None, "11", 11),
]


def test_environment_beats_the_apps_config_which_beats_dotenv_and_toml(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The README's order, highest first: GATEKEEPER_*, the app's gatekeeper_* keys, .env, TOML.
    # The runbook's rollback (GATEKEEPER_FREE_PATH_ENABLED=false and restart) rests on the
    # first row: the environment turns off a free path a Django settings.py leaves on.
    monkeypatch.chdir(tmp_path)
    Path("config").mkdir()
    toml, dotenv = [], []
    django: dict[str, object] = {}
    for name, env, app_value, dotenv_value, toml_value, _ in SOURCES:
        if env is not None:
            monkeypatch.setenv(f"GATEKEEPER_{name.upper()}", env)
        if app_value is not None:
            django[f"CELERY_GATEKEEPER_{name.upper()}"] = app_value
        if dotenv_value is not None:
            dotenv.append(f"GATEKEEPER_{name.upper()}={dotenv_value}\n")
        toml.append(f"{name} = {toml_value}\n")
    Path("config/gatekeeper.toml").write_text("".join(toml))
    Path(".env").write_text("".join(dotenv))
    app = Celery("django_style")
    app.config_from_object(type("DjangoSettings", (), django), namespace="CELERY")
    assert app.conf.gatekeeper_free_path_enabled is True  # what Celery itself reads
    settings = load_settings(app=app)
    assert {name: getattr(settings, name) for name, *_ in SOURCES} == {
        name: expected for name, *_, expected in SOURCES
    }


def test_a_bad_toml_value_names_the_key_and_the_file(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('budget_mode = "maybe"\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    assert "budget_mode" in str(caught.value) and str(config) in str(caught.value)


def test_a_key_that_is_no_setting_is_refused_by_name_with_the_nearest(tmp_path: Path) -> None:
    # A misspelt rollback (free_path_enable) was ignored without a word, in the TOML file and
    # in the app's config alike (an audit): the free path stayed open.
    toml = tmp_path / "gatekeeper.toml"
    toml.write_text("free_path_enable = false\n")
    with pytest.raises(ConfigError, match="free_path_enable: not a gatekeeper setting "
                       r"\(did you mean free_path_enabled\?\)") as caught:  # fmt: skip
        load_settings(config_file=toml)
    assert str(toml) in str(caught.value)
    app = Celery("typo")
    app.conf.gatekeeper_free_path_enable = False
    with pytest.raises(ConfigError, match=r"app.conf: gatekeeper_free_path_enable: not a "
                       r"gatekeeper setting \(did you mean "
                       r"gatekeeper_free_path_enabled\?\)"):  # fmt: skip
        load_settings(app=app)
    django = Celery("django_style")  # CELERY_GATEKEEPER_* through the CELERY namespace
    django.config_from_object(type("Settings", (), {"CELERY_GATEKEEPER_CANARY_PERCNT": 5}),
                              namespace="CELERY")  # fmt: skip
    with pytest.raises(ConfigError, match="CELERY_GATEKEEPER_CANARY_PERCNT: not a gatekeeper "
                       r"setting \(did you mean CELERY_GATEKEEPER_CANARY_PERCENT\?\)"):  # fmt: skip
        load_settings(app=django)
    lower = Celery("lower_namespace")  # Celery reads celery_gatekeeper_* too
    lower.config_from_object(type("Settings", (), {"celery_gatekeeper_free_path_enable": False}),
                             namespace="celery")  # fmt: skip
    with pytest.raises(ConfigError, match="celery_gatekeeper_free_path_enable: not a"):
        load_settings(app=lower)
    fine = Celery("fine")
    fine.conf.gatekeeper_free_path_enabled = False
    assert load_settings(app=fine).free_path_enabled is False
    # A Django project's own settings that merely share the prefix are not gatekeeper's; a
    # setting's name in the case Celery never reads is refused, or the rollback is ignored.
    other = Celery("django_app")
    other.config_from_object(type("Settings", (), {"GATEKEEPER_SSO_URL": "https://sso",
                                                   "CELERY_GATEKEEPER_CANARY_PERCENT": 7}),
                             namespace="CELERY")  # fmt: skip
    assert load_settings(app=other).canary_percent == 7
    cased = Celery("cased")
    cased.config_from_object(type("Settings", (), {"GATEKEEPER_FREE_PATH_ENABLED": False}),
                             namespace="CELERY")  # fmt: skip
    with pytest.raises(ConfigError, match=r"GATEKEEPER_FREE_PATH_ENABLED: never read in that "
                       r"case.*CELERY_GATEKEEPER_FREE_PATH_ENABLED"):  # fmt: skip
        load_settings(app=cased)


def test_a_named_config_file_that_is_missing_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEKEEPER_CONFIG_FILE", "/nonexistent/gatekeeper.toml")
    with pytest.raises(ConfigError, match="GATEKEEPER_CONFIG_FILE"):
        load_settings()


def test_a_toml_syntax_error_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text("budget_units = = 3\n")
    with pytest.raises(ConfigError, match=r"broken\.toml"):
        load_settings(config)


def test_a_broker_url_redis_py_cannot_open_is_no_gate_redis(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in ("GATEKEEPER_REDIS_URL", "GATEKEEPER_BROKER_URL"):
        monkeypatch.delenv(variable, raising=False)
    # Celery takes amqp:// as a broker; without GATEKEEPER_REDIS_URL the gate has no Redis.
    settings = GatekeeperSettings(broker_url="amqp://guest@rabbit//")
    with pytest.raises(ConfigError, match=r"GATEKEEPER_REDIS_URL .*'amqp://guest@rabbit//'"):
        settings.gate_redis_url()
    with pytest.raises(ConfigError, match=r"GATEKEEPER_REDIS_URL: .*got none"):
        GatekeeperSettings().gate_redis_url()
    assert GatekeeperSettings(broker_url="redis://b/1").gate_redis_url() == "redis://b/1"


def test_the_shipped_toml_declares_the_source_workload() -> None:
    drill = load_settings(REPO_CONFIG).drill
    assert (drill.jobs, drill.input_tokens_per_job, drill.window_seconds, drill.service_s) == (
        40,
        1200,
        900,
        1.5,
    )


def test_nested_drill_variables_override_the_toml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEKEEPER_DRILL__SEED", "11")
    assert load_settings(REPO_CONFIG).drill.seed == 11


def test_a_redis_cluster_is_the_gates_redis_and_never_the_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = "redis+cluster://n1:7000,n2:7000"
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", cluster)
    settings = load_settings()
    assert settings.gate_redis_url() == cluster
    assert settings.effective_broker_url is None  # the broker is never the cluster
    monkeypatch.setenv("GATEKEEPER_BROKER_URL", "rediss+cluster://n1:7000")
    with pytest.raises(ConfigError, match=r"GATEKEEPER_BROKER_URL: a Redis Cluster cannot be"):
        load_settings()


def test_the_workers_need_a_broker_besides_a_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEKEEPER_BROKER_URL", raising=False)
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", "redis+cluster://n1:7000")
    with pytest.raises(
        ConfigError, match=r"^GATEKEEPER_BROKER_URL: .* unless it is a Redis Cluster"
    ):
        create_app()


def test_the_workers_give_celery_the_brokers_transport_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEKEEPER_BROKER_URL", "sentinel://s1:26379/0")
    monkeypatch.setenv("GATEKEEPER_BROKER_TRANSPORT_OPTIONS", '{"master_name": "mymaster"}')
    assert create_app().conf.broker_transport_options == {"master_name": "mymaster"}


def test_the_service_time_setting_reads_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEKEEPER_SERVICE_TIME", "MAX")
    assert load_settings().service_time == "max"


SENTINEL_MASTERS = [
    # (the app's broker_url, its broker_transport_options, the master the gate asks for)
    ("sentinel://s1:26379/0", {"master_name": "mymaster"}, "mymaster"),
    ("sentinel://s1:26379;sentinel://s2:26379", {"master_name": "mymaster"}, "mymaster"),
    ("sentinel://s1:26379/0?master_name=own", {"master_name": "mymaster"}, "own"),  # URL wins
]


def test_a_sentinel_broker_takes_its_master_from_celerys_transport_options() -> None:
    for broker, options, master in SENTINEL_MASTERS:
        app = Celery("sentinel", broker=broker)
        app.conf.broker_transport_options = options
        settings = load_settings(app=app)  # no redis_url: the gate's Redis is the broker
        for client in (gate_client(settings), broker_for(settings, app).client):
            assert client.connection_pool.service_name == master, broker  # nothing connected


def test_the_sentinels_password_comes_from_sentinel_kwargs_the_masters_from_the_url() -> None:
    app = Celery("sentinel", broker="sentinel://:masterpw@s1:26379/2")
    app.conf.broker_transport_options = {
        "master_name": "mymaster",
        "sentinel_kwargs": {"password": "sentinelpw"},
    }
    pool = gate_client(load_settings(app=app)).connection_pool
    assert pool.connection_kwargs["password"] == "masterpw"
    assert pool.connection_kwargs["db"] == 2
    assert pool.sentinel_manager.sentinel_kwargs["password"] == "sentinelpw"


def test_a_sentinel_url_with_no_master_anywhere_names_where_to_set_it() -> None:
    app = Celery("sentinel", broker="sentinel://:secret@s1:26379/0")
    with pytest.raises(ConfigError) as raised:
        gate_client(load_settings(app=app))
    message = str(raised.value)  # the broker's: in its URL or in its transport options
    assert "?master_name=<name>" in message and "broker_transport_options" in message
    assert "secret" not in message  # the error is logged: no password in it
    app.conf.broker_transport_options = {"master_name": "mymaster"}
    app.conf.gatekeeper_redis_url = "sentinel://g1:26379/0"  # a gate Redis of its own
    with pytest.raises(ConfigError, match=r"^redis_url: a sentinel URL needs .*master_name"):
        gate_client(load_settings(app=app))  # the broker's options are not its


def test_a_bad_url_is_shown_without_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nor any piece of it: a password holding '/', '@' or ';' (a base64 one), one in the
    query, and redis-py's message, which quotes what it read as a port."""
    for variable, url in (("GATEKEEPER_REDIS_URL", "redis://:s3cret@h:99999/0"),
                          ("GATEKEEPER_BROKER_URL", "amqp://u:s3cret@h:99999//"),
                          ("GATEKEEPER_REDIS_URL", "foo://u:s3cret@h"),
                          ("GATEKEEPER_REDIS_URL", "redis://:s3cret+Ym/cXV4@h:6379/0"),
                          ("GATEKEEPER_REDIS_URL", "redis://:s3c@ret@h:99999/0"),
                          ("GATEKEEPER_REDIS_URL", "unix:///r.sock?db=x&password=s3cret"),
                          ("GATEKEEPER_REDIS_URL", "sentinel://:s3cret@h:26379;"
                                                   "sentinel://:s3cret@h:263790")):  # fmt: skip
        monkeypatch.setenv(variable, url)
        with pytest.raises(ConfigError) as caught:
            load_settings()
        said = str(caught.value)
        assert variable in said and "s3c" not in said and "ret@" not in said, said
        assert ":***@h" in said or "password=***" in said, said
        monkeypatch.delenv(variable)


def test_a_password_may_hold_a_semicolon_outside_a_sentinel_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEKEEPER_REDIS_URL", "redis://:pa;ss@127.0.0.1:6393/0")
    assert load_settings().redis_url == "redis://:pa;ss@127.0.0.1:6393/0"


def test_a_broker_url_the_gate_reads_is_checked_when_it_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker's URL, read as the gate's Redis (no redis_url): a bad port is a
    ConfigError naming it, not redis-py's bare ValueError at the first publish."""
    settings = load_settings(broker_url=None)
    broken = settings.model_copy(
        update={"redis_url": None, "broker_url": "redis://:pw@127.0.0.1:99999/0"}
    )
    with pytest.raises(ConfigError) as caught:
        broken.gate_redis_url()
    assert "GATEKEEPER_REDIS_URL" in str(caught.value) and "a port that" in str(caught.value)
    assert ":pw@" not in str(caught.value)


def test_a_variable_that_is_not_json_is_named_not_blamed_on_dotenv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It said "invalid settings file .env" when there was no .env at all.
    monkeypatch.setenv("GATEKEEPER_BROKER_TRANSPORT_OPTIONS", "{'password': 'hunter2'")
    with pytest.raises(ConfigError) as caught:
        load_settings()
    said = str(caught.value)
    assert said.startswith("GATEKEEPER_BROKER_TRANSPORT_OPTIONS: expected JSON"), said
    assert ".env" not in said and "hunter2" not in said
