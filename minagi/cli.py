"""What the command lines share (train.py, sample.py, tools/): a parser whose errors are one line, and
argument types that check values as the config does. Nothing here reads argv: the entry points pass it.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from .config import SEED_RULE, valid_seed

__all__ = ["OneLineParser", "non_negative_int", "one_line_warnings", "positive_int", "seed", "utf8_stdout"]

MINAGI_DIR = Path(__file__).resolve().parent


def utf8_stdout() -> None:
    """Written text as UTF-8 on every platform. Windows writes a redirected stdout (a file, a pipe) in its
    ANSI code page (cp1252): the first written character outside it would stop the command."""
    if sys.platform == "win32" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")


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


def one_line_warnings(is_main: bool = True, categories: tuple[type[Warning], ...] = ()):
    """warnings.showwarning for minagi's own warnings (raised in minagi/, or of `categories` wherever a
    tool's call puts them): `warning: <message>` on stderr, on rank 0 only (every rank reads the same
    files); others (torch's) as Python shows them."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, categories) or MINAGI_DIR in Path(filename).resolve().parents:
            if is_main:
                print(f"warning: {message}", file=sys.stderr)
            return
        shown(message, category, filename, lineno, file, line)
    return show
