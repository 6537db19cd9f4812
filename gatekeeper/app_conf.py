"""A Celery app's ``conf`` as a settings source: ``app.conf.gatekeeper_<setting>`` keys (as
redbeat reads ``redbeat_*``), and the app's own ``broker_url`` as gatekeeper's broker, with its
``broker_transport_options`` (a Sentinel broker's master name is there).

:func:`gatekeeper.settings.load_settings` adds it, between the environment and ``.env``, when
it is given an app.
"""

from __future__ import annotations

from difflib import get_close_matches
from typing import Any

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource

from gatekeeper.errors import ConfigError

__all__ = ["APP_CONF_PREFIX", "AppConfSource", "CheckedToml"]

APP_CONF_PREFIX = "gatekeeper_"
"""A Celery app's keys for gatekeeper's settings: ``gatekeeper_<setting>``, lower case."""


class AppConfSource(PydanticBaseSettingsSource):
    """The ``gatekeeper_<setting>`` keys of a Celery app's ``conf``, and its ``broker_url`` and
    ``broker_transport_options`` as the broker's (so the gate's Redis is the app's broker when
    that is Redis)."""

    def __init__(self, settings_cls: type[BaseSettings], conf: Any) -> None:
        super().__init__(settings_cls)
        self.conf = conf

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self.conf.get(APP_CONF_PREFIX + field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        self._check_names()
        values: dict[str, Any] = {}
        for name in self.settings_cls.model_fields:
            value = self.conf.get(APP_CONF_PREFIX + name)
            if value is not None:
                values[name] = value
        broker = self.conf.get("broker_url")
        if "broker_url" not in values and isinstance(broker, str) and broker:
            values["broker_url"] = broker
        options = self.conf.get("broker_transport_options")
        if "broker_transport_options" not in values and isinstance(options, dict) and options:
            values["broker_transport_options"] = options
        return values

    def _check_names(self) -> None:
        """The keys this reads must be settings: ``gatekeeper_<setting>``, or under Django's
        namespace ``CELERY_GATEKEEPER_<SETTING>``; a misspelt one (a rollback) is refused by
        name. So is ``GATEKEEPER_<SETTING>``, a setting's name in a case Celery's config is
        never read in. Other keys (``GATEKEEPER_SSO_URL`` of an unrelated Django app) are not
        gatekeeper's: left alone."""
        fields, prefix = self.settings_cls.model_fields, APP_CONF_PREFIX
        keys = [str(key) for key in self.conf]  # loads a lazy config first
        namespace = getattr(self.conf, "prefix", None) or ""  # Django's "CELERY_"
        wrong, unread = [], []
        spaced = (namespace + prefix).lower()
        for key in keys:
            if key.startswith(prefix):  # read as it is: lower case
                name = key[len(prefix) :]
            elif namespace and key.lower().startswith(spaced):  # CELERY_GATEKEEPER_*, as given
                name = key[len(spaced) :].lower()
            else:
                if key.startswith(prefix.upper()) and key[len(prefix) :].lower() in fields:
                    unread.append(key)
                continue
            if name not in fields:
                wrong.append(key)
        if wrong:  # a misspelt rollback must not be ignored without a word
            hint = _nearest(wrong[0], prefix, self.settings_cls)
            raise ConfigError(f"app.conf: {', '.join(sorted(wrong))}: not a gatekeeper setting "
                              f"({hint})")  # fmt: skip
        if unread:
            raise ConfigError(
                f"app.conf: {', '.join(sorted(unread))}: never read in that case: Celery's keys "
                f"are lower case ({unread[0].lower()}), or {namespace or 'CELERY_'}"
                f"{unread[0]} under Django's namespace"
            )


class CheckedToml(TomlConfigSettingsSource):
    """The TOML file's settings; a top-level key that is no setting is refused by name (as
    the ``[drill]`` and ``[simulate]`` tables refuse theirs)."""

    def __call__(self) -> dict[str, Any]:
        unknown = sorted(k for k in self.toml_data if k not in self.settings_cls.model_fields)
        if unknown:
            hint = _nearest(unknown[0], "", self.settings_cls)
            raise ConfigError(f"{self.toml_file_path}: {', '.join(unknown)}: not a gatekeeper "
                              f"setting ({hint})")  # fmt: skip
        return super().__call__()


def _nearest(key: str, prefix: str, settings_cls: type[BaseSettings]) -> str:
    """The setting nearest a misspelt key, written as the key was (its prefix, its case)."""
    head, _, name = key.lower().rpartition(prefix) if prefix else ("", "", key.lower())
    close = get_close_matches(name, list(settings_cls.model_fields), n=1)
    if not close:
        return "see README: Settings"
    near = f"{head}{prefix}{close[0]}"
    return f"did you mean {near.upper() if key.isupper() else near}?"
