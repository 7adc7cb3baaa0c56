"""The run folder: run.json (what ran, where, from which commit), history.jsonl (one record per eval),
last.pt / best.pt, and the lock that makes one process its owner (`RunFolder`).

history.jsonl is opened in append mode and every line is flushed and fsynced as it is written, so a
crash loses at most the line being written: the next start cuts that torn line off (so every line
stays JSON for jq or json.loads), and the checkpoint that carries its record gives it back (`reconcile`);
a resumed run simply continues the file.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .atomic import atomic_write, stale_temp_files
from . import __version__, watch
from .checkpoint import Checkpoint, copy_checkpoint, save_checkpoint
from .config import ConfigError

__all__ = ["HISTORY_FIELDS", "History", "RunFolder", "RunFolderError", "git_commit", "read_history", "read_run_info",
           "write_run_info"]

REPO_DIR = Path(__file__).resolve().parent.parent

# Every key of a history record, in the order written. Memory figures are bytes; the allocator ones
# are None on the CPU, where rss_bytes (the process resident memory) is the only figure.
# The sums (losses, grad norm, sinks, dropped fraction) cover every step since the previous record,
# across a resume too: the checkpoint carries them. The rates and peaks (chars_per_s, mem_peak_*,
# dequants) cover the steps that this process trained since then: after a resume, since the resume.
HISTORY_FIELDS = (
    "step",               # optimizer steps done
    "chars_seen",         # step * accum_steps * batch_size * context, all ranks together
    "train_loss",         # mean cross-entropy (nats) over the steps since the previous record
    "aux_loss",           # mean router auxiliary loss over the same steps (already weighted)
    "grad_norm",          # mean gradient norm (before clipping) over the same steps (skipped ones left out)
    "heldout_loss",       # mean cross-entropy (nats) on the fixed held-out batches
    "heldout_bpc",        # heldout_loss / ln 2
    "lr",                 # learning rate of the last step
    "chars_per_s",        # training throughput since the previous record (eval and saving excluded)
    "mfu",                # model FLOPs utilisation of that throughput (minagi/flops.py; None off CUDA)
    "wall_s",             # seconds of training since the run began, summed over resumes
    "mem_allocated", "mem_reserved", "mem_peak_allocated", "mem_peak_reserved",
    "alloc_retries", "ooms",
    "rss_bytes",
    "sinks",              # the routing meter's rows (minagi/diagnostics.py): training steps since the last record
    "dropped_fraction",   # mean over rows of the rows' dropped fraction
    "max_vio",            # mean over rows of max load / fair share - 1 (Loss-Free Balancing's MaxVio)
    "dequants",           # frozen stacks: dequants per step by phase, pinned replays, stacks (None: none)
    "offload",            # offloaded stacks: H2D bytes and unhidden H2D ms per step, resident bytes (None: none)
    "skipped_steps",      # fp16: steps since the previous record whose update a gradient overflow skipped (else 0)
    "loss_scale",         # fp16: the GradScaler's loss scale now (None: bf16 / fp32)
)


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


def git_commit(repo_dir: Path = REPO_DIR) -> str | None:
    """HEAD of the checkout this code runs from; None outside a checkout or before the first commit, and
    for an installed copy (site-packages holds no .git: a checkout around the environment is not this code's)."""
    if not (Path(repo_dir) / ".git").exists():  # a file in a git worktree, a folder in a clone
        return None
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def _write_json_atomic(path: Path, obj: dict) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    atomic_write(path, write)


def write_run_info(run_dir: Path, *, config: dict, profile: str, device: str, argv: list[str],
                   world_size: int = 1, resumed_at_step: int | None = None, extra: dict | None = None) -> dict:
    """Write run.json. On resume its `config` becomes the resumed one (train.steps may have grown)
    and the resume is appended to `resumes`; the rest still describes the run's start. `extra`
    (e.g. the corpus) is merged in at the start, and kept on resume."""
    path = Path(run_dir) / "run.json"
    entry = {"start_time": _now(), "command": list(argv), "git_commit": git_commit(),
             "device": device, "world_size": world_size}
    if resumed_at_step is not None and path.exists():
        info = read_run_info(run_dir)
        info["config"] = config
        info.setdefault("resumes", []).append({**entry, "step": resumed_at_step})
    else:
        info = {"profile": profile, "config": config, **entry,
                "python": platform.python_version(), "torch": torch.__version__, "minagi": __version__,
                "numpy": np.__version__, "platform": platform.platform(), **(extra or {}), "resumes": []}
    _write_json_atomic(path, info)
    return info


def read_run_info(run_dir: Path) -> dict:
    """run.json as a dict; a file that is not one (damaged, edited) is a ConfigError naming it."""
    path = Path(run_dir) / "run.json"
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not a run record ({err})") from None
    if not isinstance(info, dict) or not isinstance(info.get("config"), dict):
        raise ConfigError(f"{path}: not a run record (no \"config\" table)")
    return info


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
        if self.path.exists():
            self._cut_torn_line()
        self._f = open(self.path, "a", encoding="utf-8")

    def _cut_torn_line(self) -> None:
        """A crash mid-line leaves a last line without its newline: cut it off (its record is in the
        checkpoint that was written before it: `RunFolder.reconcile`)."""
        with open(self.path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            f.seek(0)
            f.truncate(f.read().rfind(b"\n") + 1)  # 0 when the torn line is the only one
            f.flush()
            os.fsync(f.fileno())

    def append(self, record: dict) -> None:
        assert tuple(record) == HISTORY_FIELDS, f"history record fields {tuple(record)} != HISTORY_FIELDS"
        self._f.write(json.dumps(_plain(record), allow_nan=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass  # the flush of a line whose append already failed (and said so): nothing more to tell

    def __enter__(self) -> "History":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_history(path: Path) -> list[dict]:
    """All records of a history.jsonl. A line torn by a crash (no newline after it, or followed by
    the newline that runs before the torn line was cut off added) is skipped; any other bad line is
    an error naming it. Torn: a record's beginning that does not end in "}", or whose JSON ends too
    soon (a record cut just after a nested object's closing brace ends in "}" too)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a history (not UTF-8 text: byte {e.start})") from None
    records = []
    for i, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            # Cut in a number, a name or an escape: it does not end as a record does. Cut just after a
            # nested object's "}": the JSON ends too soon (at the line's end, or inside a string).
            ends_too_soon = e.pos >= len(line.rstrip()) or e.msg.startswith("Unterminated string")
            if not (line.startswith("{") and (not line.endswith("}") or ends_too_soon)):
                raise ValueError(f"{path}:{i}: not a history record ({e.msg})") from None
    return records


# ---------------------------------------------------------------------------------- the run folder

class RunFolderError(RuntimeError):
    """A run folder that cannot be claimed or written; one line naming the file."""


def _describe_os_error(path: Path, err: OSError) -> str:
    reason = "no space left on device" if err.errno == errno.ENOSPC else (err.strerror or str(err)).lower()
    return f"{path}: cannot write: {reason}"


class RunFolder:
    """A run's folder, owned by one process while it trains.

    run.json (what ran), history.jsonl (one record per evaluation), last.pt and best.pt (a hard link of
    the last.pt of the best evaluation), and run.lock: held (an OS file lock, released by the system
    on any exit, a kill included) from `claim` to `close`, so a second run of the same folder stops at
    once. Each checkpoint of an evaluation carries that evaluation's record, and the record is appended
    to the history after the checkpoint: a kill in between leaves a record that `reconcile` appends on
    resume, so the history and the checkpoints cannot disagree.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.history: History | None = None
        self.mirror = None                 # a TensorBoard view of the records (minagi/watch.py), if asked
        self.last_step: int | None = None  # the step last.pt holds, once known (written or resumed)
        self.removed: list[Path] = []      # temporary files of dead processes that `claim` removed
        self._lock_fd: int | None = None
        self._made: list[Path] = []

    @property
    def last(self) -> Path:
        return self.path / "last.pt"

    @property
    def best(self) -> Path:
        return self.path / "best.pt"

    def holds_run(self) -> bool:
        history = self.path / "history.jsonl"
        return self.last.exists() or (history.exists() and history.stat().st_size > 0)

    def claim(self) -> list[Path]:
        """Create the folder if needed, take its lock, remove temporary files of dead processes
        (returned). RunFolderError when another process holds the lock."""
        made = [p for p in (self.path, *self.path.parents) if not p.exists()]  # deepest first
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock(self.path / "run.lock")
        except OSError as err:
            raise RunFolderError(_describe_os_error(self.path, err)) from None
        except _LockNotMade:  # a full disk: leave none of the folders made for this run
            _remove_empty(made)
            raise
        self._made = made[1:]  # the folders above it made for it (out_dir), which a discard removes too
        self.removed = stale_temp_files(self.path)
        for p in self.removed:
            p.unlink(missing_ok=True)
        return self.removed

    def start(self, tensorboard: bool = False, **run_info) -> None:
        """Write run.json (see `write_run_info`) and open the history for appending; `tensorboard`:
        mirror each record to TensorBoard in `tensorboard/` too."""
        watch.require(tensorboard)  # before anything is written: a missing extra leaves no run behind
        self._guard(self.path / "run.json", lambda: write_run_info(self.path, **run_info))
        self.history = History(self.path / "history.jsonl")
        if tensorboard:
            self.mirror = watch.TensorBoardMirror(self.path / "tensorboard")

    def save_last(self, ckpt: Checkpoint) -> None:
        self._guard(self.last, lambda: save_checkpoint(self.last, ckpt.to_payload()), self.kept())
        self.last_step = ckpt.step

    def kept(self) -> str:
        """What last.pt holds now, for messages about a failure."""
        if self.last_step is not None:
            return f"{self.last} keeps the last good checkpoint (step {self.last_step})"
        return f"{self.last} keeps the last good checkpoint" if self.last.exists() else "no checkpoint was written"

    def write_evaluation(self, ckpt: Checkpoint, record: dict, improved: bool) -> None:
        """last.pt carrying `record`, best.pt when `improved`, then the history line."""
        self.save_last(dataclasses.replace(ckpt, record=record))
        if improved:
            self._guard(self.best, lambda: copy_checkpoint(self.last, self.best))
        self._append(record)

    def _append(self, record: dict) -> None:
        """The one place a record is written: the history line, then its mirror."""
        self._guard(self.history.path, lambda: self.history.append(record))
        if self.mirror is not None:
            self._guard(self.mirror.log_dir, lambda: self.mirror.write(record))

    def reconcile(self, record: dict | None) -> bool:
        """Append the checkpoint's `record` if the history lacks its step (a kill between the
        checkpoint and the history line); True when it did."""
        if record is None:
            return False
        record = {k: record.get(k) for k in HISTORY_FIELDS}  # a checkpoint of older code lacks newer fields
        path = self.path / "history.jsonl"
        steps = {r.get("step") for r in read_history(path)} if path.exists() else set()
        if record["step"] in steps:
            return False
        self._append(record)
        return True

    def close(self, discard_if_empty: bool = False) -> None:
        """Close the history and let go of the lock. discard_if_empty: a start that failed before
        writing anything (a bad --data) removes the folder that `claim` made, run.lock and all."""
        if self.history is not None:
            self.history.close()
            self.history = None
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None
        if self._lock_fd is not None:
            discard = discard_if_empty and [p.name for p in self.path.iterdir()] == ["run.lock"]
            _let_go(self._lock_fd, self._discard if discard else lambda: None)
            self._lock_fd = None

    def _discard(self) -> None:
        """Remove run.lock and the folder `claim` made."""
        try:
            (self.path / "run.lock").unlink()
            self.path.rmdir()
        except OSError:
            return  # another process's run.lock appeared: the folder is theirs now
        _remove_empty(self._made)

    @staticmethod
    def _guard(path: Path, write, kept: str = "") -> None:
        try:
            write()
        except OSError as err:
            raise RunFolderError(_describe_os_error(path, err) + (f"; {kept}" if kept else "")) from None



class _LockNotMade(RunFolderError):
    """run.lock could not be created or our pid not written in it (a full disk): nothing of it is left."""


def _lock(path: Path) -> int:
    """Open and lock `path` without waiting; write our pid after byte 0 (the byte Windows locks)."""
    existed = path.exists()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise _LockNotMade(_describe_os_error(path, err)) from None
    try:
        if sys.platform == "win32":
            import msvcrt
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        else:
            import fcntl
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        owner = _lock_owner(path)
        raise RunFolderError(f"{path.parent}: another run is training in this folder ({owner}); wait for "
                             "it to end, or choose another --run-name") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f" pid {os.getpid()} on {platform.node()}\n".encode())
    except OSError as err:  # a full disk: say so rather than train without a named owner
        _let_go(fd, (lambda: _unlink_quietly(path)) if not existed else lambda: None)
        raise _LockNotMade(_describe_os_error(path, err)) from None
    return fd


def _let_go(fd: int, discard: Callable[[], None]) -> None:
    """Release run.lock (`_release`) and remove what `discard` removes: while still holding the lock where
    the system allows it (no other run can take the folder in between), after letting go on Windows,
    which deletes no file held open."""
    if sys.platform == "win32":
        _release(fd)
        discard()
    else:
        discard()
        _release(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # Windows: another process opened it once let go; the one-line error still follows


def _remove_empty(folders: list[Path]) -> None:
    """Remove `folders`, deepest first, up to the first that is not empty (another run's now)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def _release(fd: int) -> None:
    """Let go of run.lock's lock and descriptor. Windows unlocks its byte explicitly: a lock dropped at
    close is released "in a time that depends upon available system resources" (LockFileEx), and an
    immediate --resume would be told that another run is training."""
    if sys.platform == "win32":
        import msvcrt
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        except OSError:
            pass
    os.close(fd)  # closing the descriptor releases the lock (POSIX: at once)


def _lock_owner(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(1)
            return f.read(200).decode(errors="replace").strip() or "a process that has not written its pid yet"
    except OSError:
        return "a process this one cannot read"
