"""The run folder: run.json (what ran, where, from which commit) and history.jsonl (one record per eval).

A run folder holds run.json, history.jsonl, last.pt and best.pt. history.jsonl is opened in append
mode and every line is flushed and fsynced as it is written, so a crash loses at most the line being
written and a resumed run simply continues the file.
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

__all__ = ["HISTORY_FIELDS", "History", "git_commit", "read_history", "read_run_info", "write_run_info"]

REPO_DIR = Path(__file__).resolve().parent.parent

# Every key of a history record, in the order written. Memory figures are bytes; the allocator ones
# are None on the CPU, where rss_bytes (the process resident memory) is the only figure.
HISTORY_FIELDS = (
    "step",               # optimizer steps done
    "chars_seen",         # step * batch_size * context, all ranks together
    "train_loss",         # mean cross-entropy (nats) over the steps since the previous record
    "aux_loss",           # mean router auxiliary loss over the same steps (already weighted)
    "grad_norm",          # mean gradient norm (before clipping) over the same steps
    "heldout_loss",       # mean cross-entropy (nats) on the fixed held-out batches
    "heldout_bpc",        # heldout_loss / ln 2
    "lr",                 # learning rate of the last step
    "chars_per_s",        # training throughput since the previous record (eval and saving excluded)
    "wall_s",             # seconds of training since the run began, summed over resumes
    "mem_allocated", "mem_reserved", "mem_peak_allocated", "mem_peak_reserved",
    "alloc_retries", "ooms",
    "rss_bytes",
    "sinks",              # model.sink_diagnostics(reset=True): one dict per row, training steps only
    "dropped_fraction",   # mean over rows of the rows' dropped fraction
)


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


def git_commit(repo_dir: Path = REPO_DIR) -> str | None:
    """HEAD of the checkout this code runs from; None outside a checkout or before the first commit."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_run_info(run_dir: Path, *, config: dict, profile: str, device: str, argv: list[str],
                   world_size: int = 1, resumed_at_step: int | None = None) -> dict:
    """Write run.json. On resume its `config` becomes the resumed one (train.steps may have grown)
    and the resume is appended to `resumes`; the rest still describes the run's start."""
    path = Path(run_dir) / "run.json"
    entry = {"start_time": _now(), "command": list(argv), "git_commit": git_commit(),
             "device": device, "world_size": world_size}
    if resumed_at_step is not None and path.exists():
        info = read_run_info(run_dir)
        info["config"] = config
        info.setdefault("resumes", []).append({**entry, "step": resumed_at_step})
    else:
        info = {"profile": profile, "config": config, **entry,
                "python": platform.python_version(), "torch": torch.__version__,
                "numpy": np.__version__, "platform": platform.platform(), "resumes": []}
    _write_json_atomic(path, info)
    return info


def read_run_info(run_dir: Path) -> dict:
    with open(Path(run_dir) / "run.json", encoding="utf-8") as f:
        return json.load(f)


def _plain(value):
    """JSON-safe: non-finite floats become None (json would write NaN, which is not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class History:
    """Append-only writer of history.jsonl; each record is on disk when `append` returns."""

    def __init__(self, path: Path):
        self.path = Path(path)
        torn = self.path.exists() and self.path.stat().st_size > 0 and not self._ends_with_newline()
        self._f = open(self.path, "a", encoding="utf-8")
        if torn:  # a crash mid-line: keep the fragment on its own line rather than glue a record to it
            self._f.write("\n")

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def append(self, record: dict) -> None:
        assert tuple(record) == HISTORY_FIELDS, f"history record fields {tuple(record)} != HISTORY_FIELDS"
        self._f.write(json.dumps(_plain(record), allow_nan=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "History":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_history(path: Path) -> list[dict]:
    """All records of a history.jsonl. A line torn by a crash (no newline after it, or followed by
    the newline a resumed run adds) is skipped; any other bad line is an error naming it."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    records = []
    for i, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if not line.startswith("{") or line.endswith("}"):
                raise ValueError(f"{path}:{i}: not a history record ({e.msg})") from None
    return records
