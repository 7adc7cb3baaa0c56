"""Shared bits of the tests that train a tiny model on the CPU: the text and a one-call run."""
from __future__ import annotations

from pathlib import Path

from minagi.config import load_config
from minagi.trainer import train


def tiny_text() -> str:
    """Deterministic, varied enough that the loss falls within a few steps; ~9k characters."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "sleeps", "moon"]
    return "".join(f"{i:03d} {' '.join(words[(i * j) % len(words)] for j in range(1, 7))}.\n"
                   for i in range(200))


def train_tiny(tmp: Path, overrides: list[str], run_name: str = "tiny"):
    """Write the tiny text into tmp and train on it with `overrides`; the TrainResult."""
    data = tmp / "text.txt"
    data.write_text(tiny_text(), encoding="utf-8")
    cfg = load_config(None, [*overrides, f"data.path={data}", f"data.cache_dir={tmp / 'cache'}",
                             f"train.out_dir={tmp / 'runs'}", f"train.run_name={run_name}"])
    return train(cfg, run_name, progress=False, log=lambda msg: None, argv=["test"])
