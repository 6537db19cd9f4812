"""Locks that a forked child gets fresh.

A lock held by another thread at a fork is copied held into the child, which has no such
thread to release it: the child's first use of it waits for ever. A prefork pool forks new
children at any time, while its parent's threads may be waiting on Redis inside one of
gatekeeper's locks (the flags' refresh, the learned service times', the install's first
build, a cluster client's first connect). Each object that holds such a lock across I/O
registers here and gets ``_forked()`` called in every child forked after that. The fork
hook is registered when this module is imported, as :mod:`gatekeeper.lines` registers its
own: registered with the first object instead, a fork at the moment of that registration
would leave the child this module's own lock held.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Protocol

__all__ = ["Forked", "in_a_multiprocessing_child", "renew_in_children"]


class Forked(Protocol):
    def _forked(self) -> None:
        """In a new child, its only thread: new locks (and whatever else the parent keeps)."""


_owners: weakref.WeakSet[Forked] = weakref.WeakSet()
_guard = threading.Lock()


def renew_in_children(owner: Forked) -> None:
    """Call ``owner._forked()`` in every child forked from now on (held weakly)."""
    with _guard:
        _owners.add(owner)


def _after_fork() -> None:
    global _guard
    _guard = threading.Lock()
    for owner in list(_owners):
        owner._forked()


def in_a_multiprocessing_child() -> bool:
    """Whether ``multiprocessing`` started this process: it leaves by ``os._exit`` (after
    its finalizers, without atexit) when it was forked or started by ``forkserver``."""
    processes = sys.modules.get("multiprocessing")
    return processes is not None and processes.parent_process() is not None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
