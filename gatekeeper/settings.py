"""Gatekeeper's settings: one pydantic-settings model, read only at the edges.

Sources, highest first: keyword arguments, ``GATEKEEPER_*`` environment variables, the Celery
app's ``gatekeeper_*`` keys (``app.conf.gatekeeper_redis_url``, which Django's
``CELERY_GATEKEEPER_REDIS_URL`` becomes with ``namespace='CELERY'``; and the app's own
``broker_url`` and ``broker_transport_options`` as the broker's), a ``.env`` file in the
working directory, the TOML file (``GATEKEEPER_CONFIG_FILE``, else ``config/gatekeeper.toml``
when it exists), then the defaults below. Nested tables use ``__`` in variable names:
``GATEKEEPER_DRILL__SEED=11``.

Library objects take a settings object as an argument; only the CLI and ``workers/`` call
:func:`load_settings`. A bad value raises :class:`~gatekeeper.errors.ConfigError` naming the
variable and what was expected.
"""

from __future__ import annotations

import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from gatekeeper import defaults
from gatekeeper.app_conf import APP_CONF_PREFIX, AppConfSource, CheckedToml
from gatekeeper.core.ledger import BudgetMode
from gatekeeper.errors import ConfigError
from gatekeeper.night import NightSettings
from gatekeeper.urls import (
    CLUSTER_URL_SCHEMES,
    GATE_URL_SCHEMES,
    redis_url_of,
    url_problem,
    without_passwords,
)

__all__ = [
    "CONFIG_FILE_ENV",
    "DEFAULT_CONFIG_FILE",
    "DrillSettings",
    "GatekeeperSettings",
    "load_settings",
]

ENV_PREFIX = "GATEKEEPER_"
CONFIG_FILE_ENV = "GATEKEEPER_CONFIG_FILE"
"""Environment variable naming the TOML settings file."""
DEFAULT_CONFIG_FILE = Path("config/gatekeeper.toml")
"""Read when it exists (relative to the working directory) and no other file is named."""

_toml_file: ContextVar[Path | None] = ContextVar("gatekeeper_toml_file", default=None)
_app_conf: ContextVar[Any] = ContextVar("gatekeeper_app_conf", default=None)


Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Units = Annotated[float, Field(ge=0, allow_inf_nan=False)]
QueueName = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.:\-]+$")]


class DrillSettings(BaseModel):
    """The ledger drill's declared workload (SPEC section 5); the TOML's ``[drill]`` table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    jobs: int = Field(40, ge=1, le=100_000)
    input_tokens_per_job: int = Field(1200, ge=0)
    output_tokens_per_job: int = Field(300, ge=0)
    window_seconds: int = Field(defaults.WINDOW_SECONDS, ge=1, le=86_400)
    service_s: PositiveSeconds = 1.5
    seed: int = 7
    kill_fraction: float = Field(0.25, ge=0, le=1)
    """Share of first free attempts the coin flip kills."""
    kill_detect_s: Seconds = 6.0
    """How long after a free slot dies mid-task its death is noticed (a heartbeat or visibility
    timeout): the killed row is written then, and a retry that finds its deadline gone is
    abandoned."""
    max_retries: int = Field(1, ge=0, le=100)
    deadline_slack_s: PositiveSeconds = 10.0
    """Slack each job is granted at its first publish."""
    queue_wait_max_s: Seconds = 4.0
    """Queue waits are drawn uniformly from [0, this] under the seed."""
    max_queue_age_s: Seconds = defaults.MAX_QUEUE_AGE_S
    queue_wait_unit_per_second: Units = defaults.QUEUE_WAIT_UNIT_PER_SECOND
    budget_units: Units = defaults.BUDGET_UNITS
    """jobs x input tokens x kill_fraction = 40 x 1200 x 0.25: the source's rule (start from
    tokens times jobs, cut by the fail fraction). Under the default seed the first jobs fit and
    the later ones are rejected once their queue-wait charge has used the window up."""
    budget_mode: BudgetMode = BudgetMode.EXPOSURE


class GatekeeperSettings(BaseSettings):
    """Every knob SPEC names, with its default."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        env_nested_delimiter="__",
        extra="ignore",
        frozen=True,
    )

    redis_url: str | None = None
    """The gate's Redis (state, ledger, flags); unset, ``gatekeeper demo`` embeds one. A Redis
    Cluster is ``redis+cluster://host:port[,host:port...]`` (:mod:`gatekeeper.redis.cluster`)."""
    broker_url: str | None = None
    """Celery's broker for ``workers/`` and the demo; unset means ``redis_url``. Never a Redis
    Cluster: kombu has no cluster transport."""
    broker_transport_options: dict[str, Any] = Field(default_factory=dict)
    """The broker's kombu transport options, the Celery app's ``broker_transport_options``
    unless set here: a ``sentinel://`` broker URL with no ``?master_name`` takes its master
    from their ``master_name``, and the Sentinels' password from ``sentinel_kwargs``."""
    key_prefix: QueueName = "gatekeeper"
    namespace: QueueName = "default"
    """Hash tag of every key: ``{key_prefix}:{{{namespace}}}:...`` (one slot in Redis Cluster)."""

    free_queue: QueueName = "free"
    defer_queue: QueueName = "defer"
    reserved_queue: QueueName = "reserved"
    dead_letter_queue: QueueName = "dead_letter"

    max_queue_age_s: Seconds = defaults.MAX_QUEUE_AGE_S
    window_seconds: int = Field(defaults.WINDOW_SECONDS, ge=1, le=86_400)
    budget_units: Units = defaults.BUDGET_UNITS
    """Per window, in declared units; same derivation as the drill's (40 x 1200 x 0.25)."""
    queue_wait_unit_per_second: Units = defaults.QUEUE_WAIT_UNIT_PER_SECOND
    budget_mode: BudgetMode = BudgetMode.EXPOSURE
    free_wait_allowance_s: PositiveSeconds = defaults.FREE_WAIT_ALLOWANCE_S
    """The wait an admission to free reserves, and after which a waiting attempt is moved to
    reserved (``expired``); see :data:`gatekeeper.defaults.FREE_WAIT_ALLOWANCE_S`."""

    dwell_gate_enabled: bool = False
    free_path_enabled: bool = True
    canary_percent: float = Field(defaults.CANARY_PERCENT, ge=0, le=100, allow_inf_nan=False)
    flag_cache_s: float = Field(defaults.FLAG_CACHE_S, ge=0, le=60, allow_inf_nan=False)
    """How stale a live flag read from Redis may be."""
    miss_error_budget: float = Field(defaults.MISS_ERROR_BUDGET, ge=0, le=1, allow_inf_nan=False)
    miss_min_admissions: int = Field(defaults.MISS_MIN_ADMISSIONS, ge=1)
    """A window's miss rate can freeze the free path only after this many free admissions."""
    service_time: Literal["declared", "learned", "max"] = "declared"
    """The service time decisions use: ``declared`` (always, until an operator switches),
    ``learned`` (the observed p95) or ``max`` (the larger); :mod:`gatekeeper.core.service`."""
    service_time_min_samples: int = Field(defaults.SERVICE_TIME_MIN_SAMPLES, ge=1)
    """Runs a task needs before its p95 is used or said to drift (the declared value till then)."""
    service_drift_factor: float = Field(defaults.SERVICE_DRIFT_FACTOR, ge=1, allow_inf_nan=False)
    decision_record_cap: int = Field(defaults.DECISION_RECORD_CAP, ge=0, le=10**9)
    """Decisions kept, inputs and all, for ``gatekeeper tune`` (0: none are kept)."""
    worker_heartbeat_s: float = Field(defaults.WORKER_HEARTBEAT_S, gt=0, allow_inf_nan=False)
    """How often a worker proves itself alive to the sweep (TTL: three intervals)."""
    stale_attempt_s: float = Field(defaults.STALE_ATTEMPT_S, gt=0, allow_inf_nan=False)
    """``gatekeeper sweep`` records a run started longer ago than this, with no row, as killed."""

    replay_backoff_s: float = Field(1.0, gt=0, allow_inf_nan=False)
    """A task deferred again waits this long before its next replay, doubling each time."""
    replay_backoff_max_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    replay_lock_ttl_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """A dead replayer's lock expires after this; the next one then recovers its claims."""
    replay_poll_s: float = Field(0.5, gt=0, allow_inf_nan=False)
    """How long the replayer sleeps when nothing in ``defer`` is due."""
    replay_batch_size: int = Field(defaults.REPLAY_BATCH_SIZE, ge=1, le=10_000)
    """Messages a replayer hands on together on a Redis broker (RabbitMQ: one at a time)."""

    fast_publish: Literal["auto", "on", "off"] = "auto"
    """When the broker is the gate's Redis (same server and database), ``gate.lua`` decides
    and pushes the message Celery built, in the one round trip a plain publish costs
    (gatekeeper/celery/fastpath.py lists the set-ups where it stands aside). Celery's publish
    signals and ``task-sent`` events would then see the free queue and placeholder headers,
    so ``auto`` takes it only while nothing observes publishes (no ``before_task_publish``,
    ``after_task_publish`` or ``task_sent`` receivers, no task-sent events, and kombu's own
    ``Producer.publish`` and ``_publish``, neither wrapped by a tracer such as Sentry's nor
    overridden); ``on`` takes it whenever it can; ``off`` never. ``true``/``false`` mean
    ``on``/``off``."""

    publish_replies: Literal["later", "now"] = "later"
    """Fast publish outside a worker's task: ``later`` returns once ``gate.lua``'s call is
    sent and reads its reply at the thread's next publish, or within about 5 ms
    (:mod:`gatekeeper.redis.later`); ``now`` waits for it, as a plain publish waits for its
    ``LPUSH``."""

    redis_timeout_s: float = Field(defaults.REDIS_TIMEOUT_S, gt=0, le=30, allow_inf_nan=False)
    """Connect and read timeout of the gate's Redis client: past it a publish fails closed."""
    breaker_open_s: float = Field(defaults.BREAKER_OPEN_S, ge=0, le=60, allow_inf_nan=False)
    """After the gate's Redis did not answer (a timeout, a lost connection), decisions are made
    without it (reserved, ``gate_unavailable``), no socket touched, until a probe finds it back:
    the first probe this long after the failure, then one per this interval. 0: no breaker
    (every decision waits its own timeout)."""
    queue_age_horizon_s: float = Field(defaults.QUEUE_AGE_HORIZON_S, gt=0, allow_inf_nan=False)
    """A free attempt published longer ago than this no longer holds the queue's age up, so a
    purged or lost message defers new work for at most this long (ten times the default age
    cap: a queue that is really stuck is seen again as soon as new admissions age)."""

    log_format: Literal["kv", "json", "stdlib"] = "kv"
    """``kv``: one key=value line per event on stderr; ``json``: one JSON object per line;
    ``stdlib``: hand the event dict to the ``gatekeeper`` stdlib logger."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_buffer_s: float = Field(0.1, ge=0, le=5, allow_inf_nan=False)
    """``kv`` and ``json`` lines are rendered and written by a thread at most this long after
    they are logged, and at the end of each task (:mod:`gatekeeper.lines`); 0: each line is
    written in the call that logs it."""

    drill: DrillSettings = DrillSettings()
    simulate: NightSettings = NightSettings()
    """The declared night of ``gatekeeper simulate`` (:mod:`gatekeeper.night`)."""

    @field_validator("log_format", "log_level", "service_time", "publish_replies", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("fast_publish", mode="before")
    @classmethod
    def _on_off(cls, value: Any) -> Any:
        if isinstance(value, (bool, int)) and value in (0, 1):
            return "on" if value else "off"
        if isinstance(value, str):  # every spelling of a boolean pydantic accepts
            text = value.strip().lower()
            if text in ("1", "true", "t", "yes", "y"):
                return "on"
            if text in ("0", "false", "f", "no", "n"):
                return "off"
            return text
        return value

    @field_validator("redis_url", mode="after")
    @classmethod
    def _a_redis_url(cls, value: str | None) -> str | None:
        if value and not value.startswith(GATE_URL_SCHEMES):
            raise ValueError(
                "expected a Redis URL (redis://, rediss://, unix://, sentinel:// or "
                "redis+cluster://)"
            )
        if value and (problem := url_problem(value)):
            raise ValueError(problem)
        return value

    @field_validator("broker_url", mode="after")
    @classmethod
    def _not_a_cluster(cls, value: str | None) -> str | None:
        if value and value.startswith(CLUSTER_URL_SCHEMES):
            raise ValueError(
                "a Redis Cluster cannot be Celery's broker (kombu has no cluster transport): "
                "set redis_url to the cluster and broker_url to a plain Redis"
            )
        if value and (problem := url_problem(value)):
            raise ValueError(problem)
        return value

    @property
    def effective_broker_url(self) -> str | None:
        """The broker Celery should use: ``broker_url``, else ``redis_url`` unless that is a
        Redis Cluster (never a broker)."""
        if self.broker_url or (self.redis_url or "").startswith(CLUSTER_URL_SCHEMES):
            return self.broker_url
        return self.redis_url

    def gate_redis_url(self) -> str:
        """The gate's Redis URL: ``redis_url``, else the broker's; :class:`ConfigError` names
        the variable when there is none, or the broker's is not a URL redis-py can open."""
        if self.redis_url:
            return self.redis_url
        note = "(unset, so the broker's URL is used)" if self.broker_url else ""
        return redis_url_of("GATEKEEPER_REDIS_URL", self.broker_url, note)

    def transport_options_for(self, url: str) -> dict[str, Any] | None:
        """``broker_transport_options`` when ``url`` is the broker's (so is the gate's Redis
        when it is the broker), None for a URL of its own (its master named in it)."""
        return dict(self.broker_transport_options) if url == self.effective_broker_url else None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        conf = _app_conf.get()
        if conf is not None:
            sources.append(AppConfSource(settings_cls, conf))
        sources.append(dotenv_settings)
        toml_file = _toml_file.get()
        if toml_file is not None:
            sources.append(CheckedToml(settings_cls, toml_file=toml_file))
        return tuple(sources)


def _resolve_config_file(config_file: str | os.PathLike[str] | None) -> Path | None:
    named = config_file if config_file is not None else os.environ.get(CONFIG_FILE_ENV)
    if named:
        path = Path(named)
        if not path.is_file():
            raise ConfigError(
                f"{CONFIG_FILE_ENV}: expected an existing TOML file, got {str(path)!r}"
            )
        return path
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


def _describe(error: dict[str, Any], config_file: Path | None, app: bool = False) -> str:
    loc = [str(part) for part in error["loc"]]
    env_name = ENV_PREFIX + "__".join(part.upper() for part in loc)
    where = env_name
    if app:
        where += f" (or app.conf.{APP_CONF_PREFIX}{'__'.join(loc)})"
    if config_file is not None:
        where += f" (or {'.'.join(loc)} in {config_file})"
    value = error.get("input")
    if isinstance(value, str) and "://" in value:
        value = without_passwords(value)
    shown = "" if isinstance(value, dict) else f", got {value!r}"
    message = str(error["msg"])
    if message.startswith("Value error, "):  # a validator's own words
        message = message[len("Value error, ") :]
    return f"{where}: {message[:1].lower()}{message[1:]}{shown}"


def load_settings(
    config_file: str | os.PathLike[str] | None = None, app: Any = None, **overrides: Any
) -> GatekeeperSettings:
    """Build settings from the environment, the Celery ``app``'s config (when given), ``.env``
    and the TOML file; fail with named fields."""
    path = _resolve_config_file(config_file)
    token = _toml_file.set(path)
    conf_token = _app_conf.set(getattr(app, "conf", None))
    try:
        return GatekeeperSettings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(_describe(dict(err), path, app is not None) for err in exc.errors())
        raise ConfigError(f"invalid settings: {problems}") from exc
    except ConfigError:  # a key that is no setting, named by its source
        raise
    except ValueError as exc:  # a TOML syntax error, an unreadable .env, a variable's JSON
        field = re.search(r'field "(\w+)" from source "EnvSettingsSource"', str(exc))
        if field:  # not the file's: the environment's value of a dict or list setting
            name = ENV_PREFIX + field.group(1).upper()
            raise ConfigError(
                f"{name}: expected JSON (it holds a mapping or a list), got "
                "text that is not JSON (not shown: it may hold a password)"
            ) from exc
        named = f"{path} (or .env)" if path is not None else ".env"
        raise ConfigError(f"invalid settings file {named}: {exc}") from exc
    finally:
        _toml_file.reset(token)
        _app_conf.reset(conf_token)
