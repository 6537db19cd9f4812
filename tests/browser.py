"""Headless Chromium (Debian's ``chromium`` package) for the tests of the HTML report.

Driven by its command line alone, no DevTools client: ``--dump-dom`` gives the DOM after the
page's script ran, ``--enable-logging=stderr`` prints every console message (errors,
uncaught exceptions, Content-Security-Policy refusals) as a line holding ``:CONSOLE``, and
``--screenshot`` writes a PNG. Every run goes through a proxy that does not exist
(``127.0.0.1:9``), so a page that needed the network could not get it.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser")
NO_NETWORK = ("--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>")
"""Every request, loopback included, to a port nothing listens on."""


def find_chromium() -> str | None:
    """The Chromium binary (``/usr/bin/chromium`` from Debian), or None."""
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass(frozen=True)
class Loaded:
    """What the browser made of a page."""

    dom: str
    console: list[str]
    """The console's messages, one line each (empty for a page that logged nothing)."""


def _run(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-extensions", "--disable-background-networking", f"--user-data-dir={profile}",
        *NO_NETWORK, *args,
    ]  # fmt: skip
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    return subprocess.run(command, capture_output=True, text=True, timeout=90, check=False)


def load(binary: str, page: Path, profile: Path) -> Loaded:
    """Open ``page`` and return its DOM once its scripts ran, with its console messages."""
    done = _run(binary, profile, "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri())
    if done.returncode != 0 or "<html" not in done.stdout:
        raise RuntimeError(f"chromium failed ({done.returncode}):\n{done.stderr[-4000:]}")
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return Loaded(done.stdout, console)


def screenshot(binary: str, page: Path, out: Path, profile: Path, size: tuple[int, int]) -> None:
    """Write a PNG of ``page`` as a ``size`` (width, height) window shows it."""
    done = _run(binary, profile, "--hide-scrollbars", f"--window-size={size[0]},{size[1]}",
                f"--screenshot={out}", page.as_uri())  # fmt: skip
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"chromium wrote no screenshot ({done.returncode}):\n{done.stderr}")


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's (width, height), read from its header; ValueError when it is not a PNG."""
    head = path.read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG")
    width, height = struct.unpack(">II", head[16:24])
    return width, height
