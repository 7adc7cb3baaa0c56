"""What the command lines share (train.py, sample.py, tools/): a parser whose errors are one line, and
argument types that check values as the config does. Nothing here reads argv: the entry points pass it.
"""
from __future__ import annotations

import argparse

from .config import SEED_RULE, valid_seed

__all__ = ["OneLineParser", "non_negative_int", "positive_int", "seed"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one stderr line and exit 2 (argparse's own prints the usage first)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def non_negative_int(text: str) -> int:
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seed(text: str) -> int:
    """A seed by train.seed's rule (minagi.config.valid_seed), so a seed one command takes the other takes."""
    value = _whole_number(text)
    if not valid_seed(value):
        raise argparse.ArgumentTypeError(f"{SEED_RULE}, got {value}")
    return value
