"""How a call of `train` starts: the run folder claimed (a new run) or opened with its last.pt (a
resume), the corpus loaded and checked (minagi/resume.py), the training objects built and restored
(minagi/assemble.py), run.json written and the history mended. Moved out of minagi/trainer.py, whose
`Trainer` runs the loop on what `start_run` returns.

Under DDP the run name, the run folder check and the checkpoint are decided on rank 0 and shared,
so ranks go on, or fail, together; rank 0 alone writes the run folder.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from . import devices, distributed, watch
from .assemble import Training, build_training, restore_training
from .checkpoint import Checkpoint, CheckpointError, CorpusSummary
from .config import Config, ConfigError, config_to_dict
from .data import Corpus, heldout_batches
from .loading import init_from_checkpoint, resolve_model_path
from .resume import check_corpus_fits, check_same_corpus, describe_corpus, load_run_corpus, open_checkpoint
from .runlog import RunFolder

__all__ = ["RunStart", "start_run"]


@dataclass
class RunStart:
    """What the loop trains with."""
    folder: RunFolder                  # claimed (its lock held) on rank 0
    run_name: str
    corpus: Corpus
    eval_batches: list[tuple[Tensor, Tensor]]
    training: Training
    ckpt: Checkpoint | None = None     # the last.pt a resume goes on from


def start_run(cfg: Config, profile_name: str, resume: str | Path | None, *, init: str | Path | None, rank: int,
              world_size: int, device: torch.device, argv: list[str] | None,
              say: Callable[[str], None]) -> RunStart:
    """A new run (`resume` None; from the weights of `init` if given) or the resumed run in `resume`."""
    watch.require(cfg.train.tensorboard)  # on every rank, before the folder is claimed
    folder, run_name, ckpt = _open_folder(cfg, profile_name, resume, rank, world_size)
    try:
        start, schedule_note = _set_up(cfg, folder, run_name, ckpt, init, rank, world_size, device, say)
        if rank == 0:
            _start_folder(start, cfg, profile_name, argv, device, world_size, say)
            if schedule_note:
                say(schedule_note)
        return start
    except BaseException:
        # The lock, for a caller that goes on in this process; and no empty folder from a bad --data.
        folder.close(discard_if_empty=True)
        raise


def _claim_new_run(cfg: Config, profile_name: str) -> RunFolder:
    """The folder of train.run_name or <profile>-<timestamp>, claimed (its lock taken) and empty of runs.

    Claimed first: a folder that another process trains in is refused as such, and no other run can
    start in it between the check and this run's first write."""
    tc = cfg.train
    run_name = tc.run_name or f"{profile_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder = RunFolder(Path(tc.out_dir) / run_name)
    folder.claim()
    if folder.holds_run():
        folder.close()
        raise ConfigError(f"train.run_name: {folder.path} already holds a run; resume it with "
                          f"--resume {folder.path} or choose another --run-name", "train.run_name")
    return folder


def _open_folder(cfg: Config, profile_name: str, resume: str | Path | None, rank: int,
                 world_size: int) -> tuple[RunFolder, str, Checkpoint | None]:
    """The run folder, its name and, on resume, its checkpoint: decided on rank 0, shared with the others."""
    if resume is None:
        # Timestamps may differ between ranks: rank 0 names the run for all, and claims its folder.
        claimed = []

        def claim() -> str:
            claimed.append(_claim_new_run(cfg, profile_name))
            return claimed[0].path.name
        run_name = distributed.from_main(claim, rank, world_size)
        return (claimed[0] if claimed else RunFolder(Path(cfg.train.out_dir) / run_name)), run_name, None
    folder = RunFolder(resume)

    def open_last() -> Checkpoint:
        if rank == 0:
            folder.claim()  # before reading last.pt: no other process may move it on
        try:
            return open_checkpoint(folder.path, cfg)
        except BaseException:
            folder.close()
            raise
    # Every rank loads last.pt (rank 0 first: a bad file is one error, raised on all ranks).
    ckpt = distributed.main_first(open_last, rank, world_size)
    folder.last_step = ckpt.step
    return folder, ckpt.run_name, ckpt


def _set_up(cfg: Config, folder: RunFolder, run_name: str, ckpt: Checkpoint | None, init: str | Path | None,
            rank: int, world_size: int, device: torch.device,
            say: Callable[[str], None]) -> tuple[RunStart, str | None]:
    """The corpus (checked against a resumed run's), the held-out batches and the training objects; and
    what a resume's extension does to the learning rate (`restore_training`)."""
    start, vocab = None, ckpt.vocab if ckpt is not None else None
    if init is not None:  # every rank reads it (rank 0 first: a bad file is one error everywhere)
        init = _init_file(init)
        start = distributed.main_first(lambda: Checkpoint.load(init, map_location="cpu"), rank, world_size)
        vocab = start.vocab
    # Rank 0 encodes and caches the corpus; the others then read its cache entry.
    resumed = folder.path if ckpt is not None else None
    corpus = distributed.main_first(lambda: load_run_corpus(cfg.data, vocab, resumed=resumed, init=init),
                                    rank, world_size)
    if ckpt is not None:
        check_same_corpus(corpus, ckpt, cfg.data.path, folder.last)
    check_corpus_fits(corpus, cfg.data.path, cfg.model.context)
    tc = cfg.train
    eval_batches = heldout_batches(corpus.heldout_ids, tc.batch_size, cfg.model.context, tc.eval_batches,
                                   tc.seed, rank, world_size, tc.accum_steps)
    training = build_training(cfg, corpus.vocab.size, device, world_size, rank=rank,
                              init_frozen=ckpt is None and start is None, log=say)
    if start is not None:
        if training.parallel.sharded:  # init_from_checkpoint writes whole tensors into the model's own
            raise ConfigError(f"--init {init}: a new run from a checkpoint's weights starts whole, not sharded: "
                              "start it with train.parallel = \"ddp\" and train.expert_parallel = 1 (both may "
                              "change when it resumes)")
        _warn_reread_attention(cfg, start, init, say)
        fresh = init_from_checkpoint(training.model, start, init)
        say(f"init: weights of {init} (step {'?' if start.step is None else start.step})"
            + (f"; {len(fresh)} adapter tensors start fresh" if fresh else ""))
        del start
    note = restore_training(training, ckpt) if ckpt is not None else None
    return RunStart(folder, run_name, corpus, eval_batches, training, ckpt), note


def _init_file(init: str | Path) -> Path:
    """--init's checkpoint: a file as given, or a run folder's best.pt (else last.pt), as sample.py reads one."""
    from . import export
    if Path(init).is_dir() and export.is_export(Path(init)):
        raise CheckpointError(f"--init {init}: an exported model (for writing and scoring); a run starts from a "
                              "checkpoint: the run folder it was exported from, or its best.pt")
    return resolve_model_path(init)


def _warn_reread_attention(cfg: Config, start: Checkpoint, init, say: Callable[[str], None]) -> None:
    """Settings that keep every tensor's shape but change what the copied weights compute: said, not
    refused (a researcher may mean it)."""
    for key in ("n_heads", "rope_base"):
        here, there = getattr(cfg.model, key), getattr(start.config.model, key)
        if here != there:
            say(f"warning: --init {init}: model.{key} = {here:g} here, {there:g} in the run it comes from: the "
                "same attention weights compute another function (heads split or rotated otherwise), so "
                "the run does not start from the trained model")


def _start_folder(start: RunStart, cfg: Config, profile_name: str, argv: list[str] | None, device: torch.device,
                  world_size: int, say: Callable[[str], None]) -> None:
    """run.json written, the history opened and mended, and what the run is said at its start."""
    folder, ckpt, corpus = start.folder, start.ckpt, start.corpus
    removed = folder.removed
    if removed:
        names = ", ".join(p.name for p in removed[:4]) + (", ..." if len(removed) > 4 else "")
        say(f"removed {len(removed)} temporary file(s) that a stopped run left: {names}")
    resumed_at = ckpt.step if ckpt is not None else None
    folder.start(tensorboard=cfg.train.tensorboard, config=config_to_dict(cfg), profile=profile_name, device=devices.device_name(device),
                 argv=argv if argv is not None else sys.argv, world_size=world_size, resumed_at_step=resumed_at,
                 extra={"corpus": CorpusSummary.of(corpus).to_dict()})
    record = ckpt.record if ckpt is not None else None
    if folder.reconcile(record):
        say(f"history: appended the record of step {record['step']} that a stop had cut off")
    say(f"run folder: {folder.path}" + (f" (resumed at step {resumed_at})" if ckpt is not None else ""))
    say(describe_corpus(corpus, cfg.data.path))
