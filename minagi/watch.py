"""Watching a run: each history record mirrored to TensorBoard (`train.tensorboard = true`).

history.jsonl stays the record; the mirror is a view of it, written by `RunFolder` where it writes a
record (the run's own records and one a resume appends), into `tensorboard/` in the run folder at
the record's step. Scalars, grouped by what they measure:

  loss/train, loss/aux, loss/heldout          nats
  bits_per_char/train, bits_per_char/heldout
  train/lr, train/grad_norm, train/chars_seen
  speed/chars_per_s, speed/mfu, speed/wall_s
  memory/<field>                              the allocator's figures (bytes; CUDA) and rss_bytes
  routing/<measure>/row<i>                    every number of a row's sink diagnostics: max_over_fair,
                                              sinks, dead, top_share, dropped_fraction, padding_ratio,
                                              and any a routing recipe adds (MaxVio, when present)
  routing/dropped_fraction                    the mean over rows
  dequants/<phase>, offload/<figure>          frozen and offloaded stacks (when there are)
  other/<field>                               a numeric field this table does not know yet

and a histogram a row, routing/load/row<i>: the routed rows each expert received, expert i's bucket
at i (TensorBoard's histogram and distribution panes draw the load over the experts).

TensorBoard is an optional extra (`pip install tensorboard`, or `pip install minagi[tensorboard]`);
without it a run that asks for the mirror stops at its start, in one line (`require`).
"""
from __future__ import annotations

import math
from pathlib import Path

from .config import ConfigError

__all__ = ["TensorBoardMirror", "require"]

LN2 = math.log(2.0)
_TAGS = {"train_loss": "loss/train", "aux_loss": "loss/aux", "heldout_loss": "loss/heldout",
         "heldout_bpc": "bits_per_char/heldout", "lr": "train/lr", "grad_norm": "train/grad_norm",
         "chars_seen": "train/chars_seen", "chars_per_s": "speed/chars_per_s", "mfu": "speed/mfu",
         "wall_s": "speed/wall_s", "dropped_fraction": "routing/dropped_fraction"}
_MEMORY = ("mem_allocated", "mem_reserved", "mem_peak_allocated", "mem_peak_reserved", "alloc_retries", "ooms",
           "rss_bytes")
_NOT_MEASURES = {"step", "row", "top_expert"}  # numbers that name something rather than measure it


def require(enabled: bool) -> None:
    """ConfigError (one line) when `train.tensorboard` is on and the tensorboard package is missing."""
    if enabled:
        _summary_writer()


def _summary_writer():
    try:
        import tensorboard  # noqa: F401 - torch.utils.tensorboard needs it, and says so less plainly
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("train.tensorboard = true needs the tensorboard package, which this Python does not have: "
                          "pip install tensorboard (or pip install minagi[tensorboard]), or set "
                          "train.tensorboard = false", "train.tensorboard") from None
    return SummaryWriter


class TensorBoardMirror:
    """Writes each record it is given to the event files in `log_dir` (flushed at once)."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self.writer = _summary_writer()(log_dir=str(self.log_dir))

    def write(self, record: dict) -> None:
        step = record["step"]
        for tag, value in scalars(record):
            self.writer.add_scalar(tag, value, step)
        for row in record.get("sinks") or ():
            load = row.get("load")
            if load:
                self.writer.add_histogram_raw(f"routing/load/row{row['row']}", **_load_histogram(load),
                                              global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def scalars(record: dict) -> list[tuple[str, float]]:
    """(tag, value) of every number of a history record (module docstring); None and NaN left out."""
    out = []
    for name, value in record.items():
        if name in _NOT_MEASURES:
            continue
        if name == "sinks":
            for row in value or ():
                out += [(f"routing/{key}/row{row['row']}", v) for key, v in row.items()
                        if key not in _NOT_MEASURES and _number(v)]
        elif isinstance(value, dict):
            out += [(f"{name}/{key}", v) for key, v in value.items() if _number(v)]
        elif _number(value):
            tag = _TAGS.get(name) or (f"memory/{name}" if name in _MEMORY else f"other/{name}")
            out.append((tag, value))
            if name == "train_loss":
                out.append(("bits_per_char/train", value / LN2))
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _load_histogram(load: list[int]) -> dict:
    """TensorBoard's raw histogram of routed rows over expert ids: expert i's bucket ends at i + 0.5;
    min and max are those of the samples, the first and last expert that received a row."""
    ids = range(len(load))
    used = [i for i in ids if load[i]] or [0]
    return {"min": float(used[0]), "max": float(used[-1]), "num": float(sum(load)),
            "sum": float(sum(i * n for i, n in zip(ids, load))),
            "sum_squares": float(sum(i * i * n for i, n in zip(ids, load))),
            "bucket_limits": [i + 0.5 for i in ids], "bucket_counts": [float(n) for n in load]}
