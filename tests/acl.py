"""The README's ACL for the gate's user, read from the README itself, so that the tests hold
the gate to exactly what it tells an operator to grant."""

from __future__ import annotations

from typing import Any

import redis
from redis.utils import str_if_bytes

from tests.conftest import REPO_ROOT

USER = "gate"
PASSWORD = "gate-test-password"


def acl_rules(cluster: bool) -> list[list[str]]:
    """The README's ``ACL SETUSER gate ...`` lines as commands: the gate's own, and with
    ``cluster`` the line a Redis Cluster client needs besides."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    lines = [line.strip() for line in readme.splitlines()]
    rules = [line.replace(">PASSWORD", f">{PASSWORD}").split() for line in lines
             if line.startswith(f"ACL SETUSER {USER} ")]  # fmt: skip
    assert len(rules) == 2, "the README shows the gate's ACL in two lines"
    return rules if cluster else rules[:1]


def refused(node: redis.Redis) -> list[dict[str, Any]]:
    """The server's ``ACL LOG``, but for ``CLIENT SETINFO``: redis-py sends it when it connects
    and ignores a refusal, and before Redis 7.2 no ACL rule can grant it."""
    entries: list[dict[Any, Any]] = node.acl_log()
    text = [{str(k, "utf-8") if isinstance(k, bytes) else k: v for k, v in e.items()}
            for e in entries]  # fmt: skip
    return [e for e in text if str_if_bytes(e["object"]) not in ("client", "client|setinfo")]
