"""A ``redis-server`` under valgrind's callgrind, for the benches that count instructions
(``gate_ir.py``, ``worker_ir.py``): only the scripts' execution is counted
(``--toggle-collect=evalGenericCommand``), the same figure on every run however loud the
machine is."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from gatekeeper.ops.embedded import _free_port

__all__ = ["FUNCTIONS", "Counted", "have_valgrind", "inclusive", "server", "shares", "total"]

FUNCTIONS = ("call'2", "luaRedisGenericCommand", "luaSetGlobalArray", "luaB_tonumber",
             "luaB_tostring", "str_format", "luaC_step")  # fmt: skip
"""The server functions named under each figure, in this order (those the binary has):
``call'2`` is the Redis commands the script ran, ``luaRedisGenericCommand`` every
``redis.call`` with its arguments and reply (``call'2`` inside it), ``luaSetGlobalArray`` the
``KEYS``/``ARGV`` tables, ``luaB_tonumber``/``luaB_tostring``/``str_format`` the script's
conversions, ``luaC_step`` Lua's collector. Inclusive shares: never summed."""
INCLUSIVE = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(?:\S*:)?([^\s:]+) ")


def have_valgrind() -> bool:
    return bool(shutil.which("valgrind") and shutil.which("callgrind_control"))


class Counted:
    """A server under callgrind: its client, and the counters' controls."""

    def __init__(self, client: redis.Redis, pid: int) -> None:
        self.client = client
        self.pid = pid

    def control(self, option: str) -> None:
        """``callgrind_control --zero`` or ``--dump`` (which zeroes too), taken while the
        server runs, before the calls that come next."""
        subprocess.run(["callgrind_control", option, str(self.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        self.client.ping()


@contextlib.contextmanager
def server(binary: str, out: Path) -> Iterator[Counted]:
    """``binary`` on a free loopback port under callgrind, counts written to ``out`` (and
    ``out.<n>`` for each ``--dump``); shut down (which writes the last counts) on leaving."""
    port = _free_port()
    process = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
         "--toggle-collect=evalGenericCommand", binary, "--port", str(port),
         "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(port=port, socket_timeout=120)
        for _ in range(300):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        else:
            raise SystemExit(f"bench: {binary} under valgrind did not answer on :{port}")
        yield Counted(client, process.pid)
        with contextlib.suppress(redis.ConnectionError):  # SHUTDOWN closes the connection
            client.shutdown(nosave=True)  # callgrind writes its counts as the server exits
    finally:
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def total(out: Path) -> int:
    """The instructions callgrind counted in ``out`` (0 when it counted none)."""
    if not out.exists():
        return 0
    totals = [line for line in out.read_text().splitlines()
              if line.startswith(("totals:", "summary:"))]  # fmt: skip
    return int(totals[0].split()[1]) if totals else 0


def inclusive(out: Path) -> list[tuple[str, int]]:
    """Each function callgrind names in ``out`` and its inclusive instructions, most first
    (unnamed addresses left out)."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out)],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    found: dict[str, int] = {}
    for line in text.splitlines():
        match = INCLUSIVE.match(line)
        if match and not match.group(2).startswith("0x"):
            found.setdefault(match.group(2), int(match.group(1).replace(",", "")))
    return sorted(found.items(), key=lambda item: -item[1])


def shares(
    out: Path, count: int, functions: int
) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """The share of ``count`` instructions in each of :data:`FUNCTIONS` the binary names, and
    the ``functions`` heaviest below the event loop's frames (which hold the whole count)."""
    every = inclusive(out)
    found = {function: n / count for function, n in every if function in FUNCTIONS}
    top = [(function, n / count) for function, n in every if n < 0.99 * count][:functions]
    return {function: found[function] for function in FUNCTIONS if function in found}, top
