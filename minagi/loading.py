"""Load a trained model from a checkpoint, for sampling and reports (not for resuming training)."""
from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_checkpoint
from .config import ConfigError, config_from_dict
from .data import Vocab
from .model import CharLM, build_model


def load_trained(path: str | Path, device: torch.device | str = "cpu") -> tuple[CharLM, Vocab, dict]:
    """(model in eval mode on `device`, its vocabulary, the checkpoint payload).

    Every problem is a one-line CheckpointError naming the file. Checkpoints of format 1 (before the
    [pool] section) are read through `checkpoint.upgrade_payload`.
    """
    payload = load_checkpoint(path, map_location="cpu")
    missing = [key for key in ("model", "config", "vocab") if key not in payload]
    if missing:
        raise CheckpointError(f"{path}: not a minagi model checkpoint (missing {', '.join(missing)})")
    try:
        cfg = config_from_dict(payload["config"], source=str(path))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    vocab = Vocab.from_chars(payload["vocab"])
    model = build_model(cfg.model, cfg.pool, vocab.size, device, dense_width=cfg.dense_width)
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(f"{path}: the weights do not fit the model its config describes ({first})") from None
    return model.eval(), vocab, payload
