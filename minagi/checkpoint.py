"""The typed checkpoint, atomic save, strict load, and RNG state capture / restore.

On disk a checkpoint is a dict (the payload) saved with torch.save and read back with
torch.load(weights_only=True): only tensors and plain containers / numbers / strings, so loading
never runs pickled code. The RNG states are therefore stored as tensors and plain lists, never as
numpy arrays or tuples of foreign types.

In memory it is a `Checkpoint`: `Checkpoint.from_payload` is the one place a payload is taken apart
(a format-1 payload upgraded, the config parsed, once) and `Checkpoint.to_payload` the one place one
is made. `save_checkpoint` / `load_checkpoint` move payloads (any plain dict) to and from a file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zipfile
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .atomic import atomic_write
from .config import Config, ConfigError, config_from_dict, config_to_dict, upgrade_config_dict
from .data import DataError, Vocab
from .schedule import Schedule

__all__ = ["FORMAT_VERSION", "Checkpoint", "CheckpointError", "CorpusSummary", "Meter", "capture_rng_state",
           "copy_checkpoint", "load_checkpoint", "restore_rng_state", "save_checkpoint", "upgrade_payload"]

FORMAT_VERSION = 2  # 2: the [pool] config section and the pool's router / experts submodules

# What torch.load(weights_only=True) accepts that a payload may hold (checked at save time, so a bad
# payload fails when it is written, not at resume hours later).
# Scalars by exact type: np.float64 subclasses float yet is refused at load.
_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_TORCH_PLAIN = (torch.Tensor, torch.dtype, torch.device, torch.Size)


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; one line naming the file."""


def _one_line(e: BaseException) -> str:
    """torch's error as one line, without torch's advice (weights_only=False, allowlisting globals):
    the advice is for files one trusts, and a minagi checkpoint never needs it."""
    text = str(e)
    marker = "WeightsUnpickler error:"
    if marker in text:  # torch's weights_only refusal: a paragraph, then the refusal itself
        detail = " ".join(text.split(marker, 1)[1].split())
        for advice in ("Please use", "Check the documentation", "You can use"):
            detail = detail.split(advice, 1)[0].strip()
        return f"{type(e).__name__}: {marker} {detail}".rstrip(": ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = (lines or [""])[0]
    return f"{type(e).__name__}: {line}".rstrip(": ")


def _os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind `e`: torch.save reports a failed write of its file (a full disk) as an opaque
    RuntimeError ("unexpected pos ...") raised while handling the file's own OSError."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _check_plain(value: Any, where: str, path: str) -> None:
    if type(value) in _SCALARS or isinstance(value, _TORCH_PLAIN):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if type(k) not in _SCALARS:
                raise CheckpointError(f"{path}: payload key {where}[{k!r}] is a {type(k).__name__}; "
                                      "use str or int keys")
            _check_plain(v, f"{where}[{k!r}]", path)
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]", path)
        return
    raise CheckpointError(f"{path}: payload {where} holds a {type(value).__module__}.{type(value).__qualname__}, "
                          "which torch.load(weights_only=True) refuses; store a tensor, list or number instead")


def save_checkpoint(path: str | os.PathLike, payload: dict) -> None:
    """Write payload (+ format_version) to path atomically: the old file stays whole until the rename
    (minagi/atomic.py); on any failure, Ctrl-C included, the temporary file is removed."""
    path = Path(path)
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: payload must be a dict, got {type(payload).__name__}")
    payload = {**payload, "format_version": FORMAT_VERSION}
    _check_plain(payload, "payload", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            try:
                torch.save(payload, f)
            except RuntimeError as e:
                os_error = _os_error_in(e)
                if os_error is None:
                    raise
                raise os_error from None  # the disk's own error (ENOSPC, EIO, ...), not torch's wrapper
    atomic_write(path, write)


def copy_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Make dst the same checkpoint as src, atomically, without serialising it again.

    A hard link where the filesystem has them (instant, where torch.save of a large checkpoint takes
    tens of seconds: docs/LOG.md, "Checkpoints"), else a byte copy. Safe because save_checkpoint never
    writes into an existing file: it replaces it with a new one, so a later last.pt leaves the linked
    best.pt as it was.
    """
    src = Path(src)

    def write(tmp: Path) -> None:
        try:
            os.link(src, tmp)
        except OSError:  # no hard links here (FAT, some network mounts): copy the bytes
            shutil.copyfile(src, tmp)
    atomic_write(Path(dst), write)


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict:
    """The payload of a file written by save_checkpoint, as stored (`Checkpoint.load` reads a checkpoint);
    CheckpointError (one line naming the file) for a missing, truncated or corrupt file, a file that
    is not a minagi checkpoint, or a newer format. `mmap`: tensors read from the file's pages as they
    are used (torch.load(mmap=True)), so ranks of one machine that load one file share one copy in the
    page cache (a sharded resume: every rank reads the whole model and keeps its shards)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file (a checkpoint is one .pt file)")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; torch.load's own error advises
        size = path.stat().st_size    # re-saving it with an option, which misleads here
        raise CheckpointError(f"{path}: not a torch checkpoint ({'an empty file' if size == 0 else 'not a zip archive'}"
                              f"{'' if size == 0 else ', or truncated before its end'}; {size:,} bytes)")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:      # torch raises RuntimeError / UnpicklingError / EOFError / ... here
        detail = _one_line(e)
        if "Unsupported operand" in detail:  # not a pickle at all: random bytes, another format
            raise CheckpointError(f"{path}: cannot read checkpoint, truncated, corrupt or not a torch file "
                                  f"({detail})") from e
        if "WeightsUnpickler" in detail:
            raise CheckpointError(f"{path}: not a minagi checkpoint, it holds objects that "
                                  f"torch.load(weights_only=True) refuses ({detail})") from e
        raise CheckpointError(f"{path}: cannot read checkpoint, truncated or corrupt ({detail})") from e
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: not a minagi checkpoint (holds a {type(payload).__name__}, not a dict)")
    version = payload.get("format_version")
    if version is None:
        raise CheckpointError(f"{path}: not a minagi checkpoint (no 'format_version' key)")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{path}: not a minagi checkpoint (format_version {version!r} is not a positive int)")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format_version {version} is newer than this code reads "
                              f"({FORMAT_VERSION}); update minagi to load it")
    return payload


# Format 1 held the pool's stacks and bias on the pool itself; format 2 in its router and experts.
_RENAMED_IN_FORMAT_2 = ((".mlp.gate_up", ".mlp.experts.gate_up"), (".mlp.down", ".mlp.experts.down"),
                        (".mlp.selection_bias", ".mlp.router.selection_bias"))


def upgrade_payload(payload: dict) -> dict:
    """A format-1 checkpoint as format 2: config sections and model keys renamed, nothing recomputed
    (the parameters keep their order, so the optimizer state still fits)."""
    payload = dict(payload)
    if isinstance(payload.get("config"), dict):
        payload["config"] = upgrade_config_dict(payload["config"])
    if isinstance(payload.get("model"), dict):
        renamed = {}
        for key, value in payload["model"].items():
            for old, new in _RENAMED_IN_FORMAT_2:
                if key.endswith(old):
                    key = key[:-len(old)] + new
                    break
            renamed[key] = value
        payload["model"] = renamed
    payload["format_version"] = FORMAT_VERSION
    return payload


# ----------------------------------------------------------------------------------------------
# The typed checkpoint
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CorpusSummary:
    """What identifies and describes a run's corpus: in run.json and in every checkpoint."""
    content_key: str
    files: int
    vocab_size: int
    train_chars: int
    heldout_chars: int
    heldout_files: tuple[str, ...] = ()

    @classmethod
    def of(cls, corpus) -> "CorpusSummary":
        """Of a loaded `data.Corpus`."""
        return cls(corpus.content_key, len(corpus.sources), corpus.vocab.size, corpus.train_chars,
                   corpus.heldout_chars, tuple(corpus.heldout_sources))

    @property
    def chars(self) -> int:
        return self.train_chars + self.heldout_chars

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "heldout_files": list(self.heldout_files)}


@dataclass(frozen=True, eq=False)
class Meter:
    """The training state's meters since the last record (`trainer.TrainState`), as checkpointed."""
    loss_sum: float = 0.0
    aux_sum: float = 0.0
    norm_sum: float = 0.0
    since: int = 0
    wall_s: float = 0.0
    eval_due: bool = False         # the evaluation of `step` is still to run
    evals_since_best: int = 0      # format 1 had no early stop...
    skipped: int = 0               # fp16: steps whose update an overflow skipped (older checkpoints: none)
    routing: dict = field(default_factory=dict)  # ... and no routing counters (`RoutingMeter.state_dict()`)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # tensors not copied


# What a resume needs beyond a model checkpoint's model, config and vocab.
_TRAINING_KEYS = ("optimizer", "scheduler", "rng", "step", "run_name", "meter")


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A minagi checkpoint. A model checkpoint needs only `model`, `config` and `vocab` (sampling,
    reports, --init); a training checkpoint (a run's last.pt / best.pt, what a resume reads) has
    every field but `corpus` (format 1 did not record it) and `record` (only an evaluation's has one)."""
    model: dict                        # the unwrapped model's state dict: no `module.` / `_orig_mod.`
    config: Config
    vocab: Vocab
    optimizer: dict | None = None
    scheduler: dict | None = None
    rng: dict | None = None            # `capture_rng_state()`
    corpus: CorpusSummary | None = None
    step: int | None = None            # optimizer steps done
    best_heldout_loss: float = math.inf
    run_name: str | None = None
    meter: Meter | None = None
    schedule: Schedule | None = None   # the learning rate the run goes on with (an extension bends it)
    record: dict | None = None         # the history record of the evaluation that wrote it
    scaler: dict | None = None         # fp16 runs: torch's GradScaler state (the loss scale)
    source: str = ""                   # the file it was read from, for messages (not saved)

    @classmethod
    def load(cls, path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> "Checkpoint":
        return cls.from_payload(load_checkpoint(path, map_location, mmap), str(path))

    @classmethod
    def from_payload(cls, payload: dict, source: str) -> "Checkpoint":
        """A payload as `load_checkpoint` returns it (format 1 upgraded here); every problem is a
        one-line CheckpointError naming `source`."""
        if payload.get("format_version", FORMAT_VERSION) < FORMAT_VERSION:
            payload = upgrade_payload(payload)
        missing = [key for key in ("model", "config", "vocab") if key not in payload]
        if missing:
            raise CheckpointError(f"{source}: not a minagi model checkpoint (missing {', '.join(missing)})")
        try:
            config = config_from_dict(payload["config"], source=source)
            vocab = Vocab.from_chars(payload["vocab"])
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        except DataError as e:  # a vocabulary string that is not sorted / unique / empty
            raise CheckpointError(f"{source}: not a usable vocabulary ({e})") from None
        try:
            return cls(model=payload["model"], config=config, vocab=vocab, **_training_fields(payload, config),
                       source=source)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: not a minagi checkpoint ({e})") from None

    def to_payload(self) -> dict:
        """The dict `save_checkpoint` writes (it adds `format_version`); fields that are None are left out.
        Keys in the order minagi always wrote them: torch.save keeps it, so files stay the same bytes."""
        payload = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "rng": self.rng,
                   "config": config_to_dict(self.config), "vocab": self.vocab.chars,
                   "corpus": self.corpus.to_dict() if self.corpus is not None else None, "step": self.step,
                   "best_heldout_loss": self.best_heldout_loss, "run_name": self.run_name,
                   "meter": self.meter.to_dict() if self.meter is not None else None,
                   "schedule": dataclasses.asdict(self.schedule) if self.schedule is not None else None,
                   "record": self.record, "scaler": self.scaler}
        return {key: value for key, value in payload.items() if value is not None}

    def check_trains(self) -> None:
        """CheckpointError unless this checkpoint can be resumed: a model checkpoint cannot."""
        missing = [key for key in _TRAINING_KEYS if getattr(self, key) is None]
        if missing:
            raise CheckpointError(f"{self.source}: not a training checkpoint (no {', '.join(missing)}): it can be "
                                  "sampled from or used with --init, not resumed")


def _training_fields(payload: dict, config: Config) -> dict:
    """The fields of `Checkpoint` beyond the model's, with format 1's gaps filled."""
    fields = {key: payload[key] for key in ("optimizer", "scheduler", "rng", "step", "run_name", "record", "scaler")
              if key in payload}
    if "best_heldout_loss" in payload:
        fields["best_heldout_loss"] = float(payload["best_heldout_loss"])
    if payload.get("corpus") is not None:
        corpus = dict(payload["corpus"])
        fields["corpus"] = CorpusSummary(**{**corpus, "heldout_files": tuple(corpus.get("heldout_files", ()))})
    if "meter" in payload:
        fields["meter"] = Meter(**payload["meter"])
    tc = config.train  # checkpoints before the schedule was saved trained with their config's
    fields["schedule"] = (Schedule(**payload["schedule"]) if "schedule" in payload
                          else Schedule(total=tc.steps, warmup=tc.warmup_steps, min_ratio=tc.min_lr_ratio))
    return fields


# ----------------------------------------------------------------------------------------------
# RNG state
# ----------------------------------------------------------------------------------------------

def capture_rng_state() -> dict:
    """Python random, numpy's global RandomState, torch CPU and (if available) every CUDA device,
    as tensors and plain lists so the dict survives torch.load(weights_only=True)."""
    version, internal, gauss_next = random.getstate()
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {
        "python": [version, list(internal), gauss_next],
        "numpy": {"bit_generator": str(name), "key": key.tolist(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of capture_rng_state. CUDA states are restored for as many devices as both the saved
    state and this machine have; a state saved without CUDA leaves the CUDA generators alone."""
    missing = [k for k in ("python", "numpy", "torch") if k not in state]
    if missing:
        raise CheckpointError(f"rng state lacks {', '.join(map(repr, missing))} (has: {', '.join(map(repr, state))})")
    version, internal, gauss_next = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss_next))
    n = state["numpy"]
    np.random.set_state((n["bit_generator"], np.asarray(n["key"], dtype=np.uint32), int(n["pos"]),
                         int(n["has_gauss"]), float(n["cached_gaussian"])))
    # map_location may have moved the tensors; the setters want CPU uint8 tensors.
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        saved = [t.cpu() for t in state["cuda"]]
        for device, t in enumerate(saved[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(t, device)
