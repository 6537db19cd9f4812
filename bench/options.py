"""Command-line option types the benches share."""

from __future__ import annotations

import argparse

__all__ = ["positive"]


def positive(text: str) -> int:
    """An ``argparse`` type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value
