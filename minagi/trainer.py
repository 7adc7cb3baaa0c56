"""The training loop: AdamW + warmup/cosine, held-out evaluation, history records, checkpoints, resume.

  the training state        `TrainState`: step, best held-out, loss meters, routing counters
  one training step         step.py: `train_step` (micro-batches, fp16's loss scale);  one evaluation: `evaluate`
  the loop                  `Trainer.run`, which `train` builds and runs; minagi/progress.py: `Interval`,
                            this process's steps since the last record, and what is shown of them
  beside it                 start.py: a run's start (folder, checkpoint, corpus); assemble.py: model,
                            optimizer, schedule, wrappers; checkpoint.py, runlog.py, schedule.py, resume.py

Each step trains on `get_batch(train_ids, batch_size, context, seed, step, ..., accum_steps)`: its
`accum_steps` micro-batches are a pure function of the step number, so a resumed run continues at
exactly the data position it left, and
on the CPU reproduces the uninterrupted run's losses (and the next step's batch can be made while a
step's kernels run, before its loss is read). Every `eval_every` steps and at the end: the
held-out loss, a history record, last.pt, and best.pt when the held-out loss improved. Ctrl-C saves
last.pt at the step reached (one during the optimizer update waits the milliseconds it takes).

Multi-process (DDP, FSDP2, expert parallelism, launched by torchrun; docs/multi_gpu.md):
`train.batch_size` stays the global batch: rank r trains on its `batch_size // world_size` rows of
every step's batch, the gradients are averaged (minagi/parallel.py), and the routing counts (balance
term, aux-free bias, sink diagnostics) are summed over ranks, so N ranks train the run one process
would. Rank 0 alone writes the run folder; under FSDP or expert parallelism every rank helps gather
what it writes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor
from tqdm import tqdm

from . import devices, distributed, flops
from .assemble import Training, build_training, check_world_size
from .checkpoint import Checkpoint, CorpusSummary, Meter, capture_rng_state
from .config import Config, ConfigError
from .data import batch_on
from .diagnostics import RoutingMeter, StepCounts, mean_max_vio
from .frozen import dequant_summary
from .model import CharLM
from .offload import offload_summary
from .progress import Interval, Progress
from .resume import resume_config
from .runlog import HISTORY_FIELDS
from .schedule import lr_factor
from .start import start_run
from .step import NonFiniteLossError, StepStats, train_step

__all__ = ["NonFiniteLossError", "StepStats", "TrainResult", "TrainState", "Training", "build_training",
           "check_world_size", "evaluate", "lr_factor", "resume_config", "train", "train_step"]

LN2 = math.log(2.0)


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int                   # steps done when this call began (0 unless resumed)
    step: int                         # steps done when it returned
    losses: list[float] = field(default_factory=list)  # train cross-entropy of steps start_step+1..step
    heldout_loss: float | None = None  # the last evaluation's, in nats
    heldout_bpc: float | None = None
    best_heldout_loss: float = math.inf
    interrupted: bool = False         # Ctrl-C: last.pt holds `step`
    stopped_early: bool = False       # train.early_stop_evals: the held-out loss stopped improving


# ------------------------------------------------------------------------------------ the training state

@dataclass
class TrainState:
    """What a checkpoint carries besides the model, optimizer, scheduler and RNG.

    The meters cover the steps since the last record (they may straddle a resume), the routing
    counters included, so every field of a record covers the same steps.
    """
    step: int = 0
    best: float = math.inf
    eval_due: bool = False  # the evaluation of `step` is still to run (Ctrl-C stopped it: the resume runs it first)
    loss_sum: float = 0.0
    aux_sum: float = 0.0
    norm_sum: float = 0.0
    since: int = 0          # steps since the last record
    wall_s: float = 0.0     # training seconds since the run began, summed over resumes
    evals_since_best: int = 0  # evaluations since the best held-out loss (train.early_stop_evals)
    skipped: int = 0        # fp16: steps since the last record whose update an overflow skipped
    routing: RoutingMeter = field(default_factory=RoutingMeter)

    def add_step(self, ce: float, aux: float, gnorm: float, seconds: float, counts: StepCounts | None,
                 skipped: bool = False) -> None:
        """A step's figures; a skipped step's gradient norm (inf) is left out of the mean."""
        self.loss_sum, self.aux_sum = self.loss_sum + ce, self.aux_sum + aux
        self.norm_sum += 0.0 if skipped else gnorm
        self.since += 1
        self.skipped += int(skipped)
        self.wall_s += seconds
        self.routing.add(counts)

    def take_means(self) -> dict:
        """The interval's mean train loss, aux loss and gradient norm (of the steps that updated), and
        the steps skipped; the meters start again."""
        means = {"train_loss": self.loss_sum / self.since, "aux_loss": self.aux_sum / self.since,
                 "grad_norm": self.norm_sum / (self.since - self.skipped) if self.since > self.skipped else None,
                 "skipped_steps": self.skipped}
        self.loss_sum = self.aux_sum = self.norm_sum = 0.0
        self.since = self.skipped = 0
        return means

    def meter(self) -> Meter:
        return Meter(**{name: getattr(self, name) for name in _METERED}, routing=self.routing.state_dict())

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, device: torch.device) -> "TrainState":
        state = cls(step=ckpt.step, best=ckpt.best_heldout_loss, **{n: getattr(ckpt.meter, n) for n in _METERED})
        state.routing.load_state_dict(ckpt.meter.routing, device)
        return state


_METERED = [f.name for f in dataclasses.fields(Meter) if f.name != "routing"]  # the same names in TrainState


# ------------------------------------------------------------------------------------ one step, one evaluation

@torch.no_grad()
def evaluate(model: CharLM, batches, device: torch.device, world_size: int, dtype: torch.dtype | None = None) -> float:
    """Mean held-out cross-entropy in nats over `batches` (all ranks'), computed in `dtype` (the run's
    train.precision; None: the device's); the aux loss is a training term, not part of it, and the
    evaluation's routing counts nothing. Dropless, as writing and tools/evaluate.py are: a capacity is
    a training-throughput setting, and with it a character's loss would depend on the batch it shares."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    with devices.autocast(device, dtype):
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            total += model(x, y, dropless=True).loss.double()
    model.train(was_training)
    t = torch.stack([total, total.new_tensor(float(len(batches)))])
    summed, count = distributed.mean_over_ranks(t, world_size).tolist()
    return summed / count


# ------------------------------------------------------------------------------------ the loop

def train(cfg: Config, profile_name: str, resume: str | Path | None = None, *,
          rank: int = 0, world_size: int = 1, device: torch.device | None = None, progress: bool = True,
          argv: list[str] | None = None, log: Callable[[str], None] | None = None,
          init: str | Path | None = None) -> TrainResult:
    """Train (or resume) one run; returns its per-step losses and held-out figures.

    resume: a run folder; its last.pt sets model, optimizer, scheduler, RNG and step, and `cfg` must
    equal the run's config but for RESUMABLE_KEYS (see `resume_config`). device: where to train
    (train.py chooses it once, with the rank's GPU under DDP); None = from `train.device`. init: a
    trained checkpoint whose weights and vocabulary a new run starts from (its expert stacks quantized
    when the profile freezes them); not with `resume`. Raises NonFiniteLossError on a NaN/inf loss,
    before anything is saved for that step. Ctrl-C saves last.pt and returns with `interrupted=True`.
    """
    if init is not None and resume is not None:
        raise ConfigError("--init starts a new run from a checkpoint's weights: not with --resume")
    trainer = Trainer(cfg, profile_name, resume, rank=rank, world_size=world_size,
                      device=device if device is not None else devices.choose_device(cfg.train.device),
                      progress=progress, argv=argv, log=log, init=init)
    return trainer.run()


class Trainer:
    """One call of `train`: the run folder, the corpus, the training objects and state, the loop."""

    def __init__(self, cfg: Config, profile_name: str, resume: str | Path | None, *, rank: int, world_size: int,
                 device: torch.device, progress: bool, argv: list[str] | None, log: Callable[[str], None] | None,
                 init: str | Path | None = None):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.is_main, self.progress = rank == 0, progress
        self.say = (log or (lambda msg: tqdm.write(msg, file=sys.stdout))) if self.is_main else (lambda msg: None)
        # The loop's state besides `Interval`: the batch made ahead, an evaluation's files still owed.
        self.ahead: tuple[int, tuple[Tensor, Tensor]] | None = None
        self.owed: tuple[Checkpoint, dict, bool] | None = None
        self.held_interrupt = False  # a Ctrl-C held back during an update
        start = start_run(cfg, profile_name, resume, init=init, rank=rank, world_size=world_size, device=device,
                          argv=argv, say=self.say)
        self.folder, self.run_name, self.corpus = start.folder, start.run_name, start.corpus
        self.eval_batches, self.training = start.eval_batches, start.training
        try:
            self.state = TrainState.from_checkpoint(start.ckpt, device) if start.ckpt is not None else TrainState()
        except BaseException:
            self.folder.close()  # the lock, for a caller that goes on in this process
            raise
        self.result = TrainResult(run_dir=self.folder.path, start_step=self.state.step, step=self.state.step,
                                  best_heldout_loss=self.state.best)
        # MFU's two constants: the model's FLOPs a character, the device's matmul rate (measured once; None off CUDA).
        self.per_char, self.tflops = flops.flops_per_char(cfg, self.corpus.vocab.size), flops.matmul_tflops(device)

    def _mfu(self, chars_per_s: float | None) -> float | None:
        return flops.mfu(self.per_char, chars_per_s, self.tflops, self.world_size)

    def _checkpoint(self) -> Checkpoint | None:
        """The run as it stands, what last.pt holds, on rank 0 (None elsewhere). Under FSDP or expert
        parallelism every rank gathers it together (minagi/parallel.py), so every rank calls this."""
        t, state = self.training, self.state
        states = t.parallel.full_states(t.model, t.optimizer, self.is_main)
        if states is None:
            return None
        return Checkpoint(model=states[0], optimizer=states[1],
                          scheduler=t.scheduler.state_dict(), rng=capture_rng_state(), config=self.cfg,
                          vocab=self.corpus.vocab, corpus=CorpusSummary.of(self.corpus), step=state.step,
                          best_heldout_loss=state.best, run_name=self.run_name, meter=state.meter(),
                          schedule=t.schedule, scaler=t.scaler.state_dict() if t.scaler is not None else None)

    # ---------------------------------------------------------------- the loop

    def run(self) -> TrainResult:
        tc, state = self.cfg.train, self.state
        self.shown = Progress(shown=self.progress and self.is_main, steps=tc.steps, start=state.step,
                              eval_every=tc.eval_every, device=self.device, say=self.say, mfu=self._mfu)
        devices.memory_stats(self.device)  # reset the peaks: the first record covers this call's steps only
        # A resume whose evaluation is due records the learning rate of the step before it.
        last_lr = self.training.scheduler.base_lrs[0] * self.training.schedule(state.step - 1)
        self.interval = Interval(lr=last_lr if state.eval_due else None)
        self.training.model.train()
        try:
            with self._interrupts_wait_for_updates():
                while (state.step < tc.steps or state.eval_due) and not self._stop_early():
                    if state.eval_due:
                        self._evaluate_and_record()
                    else:
                        self._step()
        except KeyboardInterrupt:
            self._on_interrupt()
        finally:
            self.shown.close()
            if self.is_main:
                self.folder.close()
        return self.result

    @contextlib.contextmanager
    def _interrupts_wait_for_updates(self):
        """Ctrl-C during an optimizer update is held until the update and the step count agree again
        (milliseconds), then raised (`_step`): the handler saves the new step. Elsewhere it is raised at
        once, as by Python's own handler (left alone off the main thread or where replaced). SIGTERM
        (`kill`, `timeout`, a scheduler's time limit) is taken as a Ctrl-C, where nothing else handles it:
        Python's default would end the process and lose the steps since the last checkpoint."""
        def on_signal(signum, frame):
            if not self.training.updating:
                raise KeyboardInterrupt
            self.held_interrupt = True
        defaults = {signal.SIGINT: (signal.default_int_handler,), signal.SIGTERM: (signal.SIG_DFL, None)}
        main = threading.current_thread() is threading.main_thread()
        ours = {sig: signal.signal(sig, on_signal) for sig, plain in defaults.items()
                if main and signal.getsignal(sig) in plain}
        try:
            yield
        finally:
            for sig, previous in ours.items():
                signal.signal(sig, previous)

    def _stop_early(self) -> bool:
        patience = self.cfg.train.early_stop_evals
        if self.state.eval_due or not patience or self.state.evals_since_best < patience:
            return False
        if not self.result.stopped_early:
            self.result.stopped_early = True
            self.say(f"early stop at step {self.state.step}: {patience} evaluations without a better held-out "
                     f"loss than {self.state.best:.4f}; {self.folder.best} holds the best")
        return True

    def _batch(self, step: int) -> tuple[Tensor, Tensor]:
        """Step `step`'s batch on the device: made during the step before (`_make_ahead`), or now."""
        made, self.ahead = self.ahead, None
        return made[1] if made is not None and made[0] == step else self._make(step)

    def _make_ahead(self, step: int) -> None:
        self.ahead = (step, self._make(step))  # batches are a pure function of seed, step and rank

    def _make(self, step: int) -> tuple[Tensor, Tensor]:
        tc = self.cfg.train
        return batch_on(self.device, self.corpus.train_ids, tc.batch_size, self.cfg.model.context, tc.seed, step,
                        self.rank, self.world_size, tc.accum_steps)

    def _step(self) -> None:
        tc, state = self.cfg.train, self.state
        t0 = time.perf_counter()
        x, y = self._batch(state.step)  # [b, T]
        try:
            stats = train_step(self.training, x, y, step=state.step, grad_clip=tc.grad_clip, world_size=self.world_size,
                               device=self.device, meanwhile=lambda: self._make_ahead(state.step + 1))
        except NonFiniteLossError as err:
            raise NonFiniteLossError(f"{err}; {self.folder.kept()}", err.step) from None
        dt = time.perf_counter() - t0
        chars = self._chars_per_step()
        state.step += 1
        state.eval_due = state.step % tc.eval_every == 0 or state.step == tc.steps
        state.add_step(stats.ce, stats.aux, stats.grad_norm, dt, stats.counts, stats.skipped)
        self.interval.add(chars, dt, stats.lr)
        self.result.losses.append(stats.ce)
        self.result.step = state.step
        self.training.updating = False  # only now do step, meters and parameters agree
        if self.held_interrupt:
            raise KeyboardInterrupt  # held back during the update: `_interrupts_wait_for_updates`
        self.shown.step(state.step, stats.ce, dt, chars)

    def _evaluate_and_record(self) -> None:
        # Collectives follow (held-out loss): every rank runs this.
        state, model, stager = self.state, self.training.model, self.training.stager
        # Training steps' only, per step this process trained (the counts of steps before a resume are gone).
        dequants, offload = dequant_summary(model, self.interval.steps), offload_summary(stager, self.interval.steps)
        heldout = evaluate(model, self.eval_batches, self.device, self.world_size, self.training.dtype)
        dequant_summary(model, 1)  # drop the evaluation's
        offload_summary(stager, 1)
        if not math.isfinite(heldout):
            raise NonFiniteLossError(f"step {state.step}: held-out loss is not finite ({heldout}); stopped "
                                     f"without saving; {self.folder.kept()}", state.step)
        record = self._record(heldout, dequants, offload)
        improved = heldout < state.best
        state.best = min(state.best, heldout)
        state.evals_since_best = 0 if improved else state.evals_since_best + 1
        state.eval_due = False
        self.interval = Interval()
        result = self.result
        result.heldout_loss, result.heldout_bpc, result.best_heldout_loss = heldout, heldout / LN2, state.best
        ckpt = self._checkpoint()  # collectives under FSDP or expert parallelism
        if self.is_main:
            self.owed = (ckpt, record, improved)
            self.folder.write_evaluation(*self.owed)  # from here on, Ctrl-C finishes these writes
            self.owed = None
        self.say(f"step {state.step}/{self.cfg.train.steps}: train {record['train_loss']:.4f} | held-out "
                 f"{heldout:.4f} nats = {heldout / LN2:.4f} bits/char" + (" (best)" if improved else ""))

    def _chars_per_step(self) -> int:
        """Characters of one optimizer step, all ranks and micro-batches."""
        tc = self.cfg.train
        return tc.accum_steps * tc.batch_size * self.cfg.model.context

    def _record(self, heldout: float, dequants: dict | None, offload: dict | None) -> dict:
        state, scaler = self.state, self.training.scaler
        sinks = state.routing.read(self.cfg.pool.sink_ratio, reset=True)
        record = {"step": state.step, "chars_seen": state.step * self._chars_per_step(), **state.take_means(),
                  "heldout_loss": heldout, "heldout_bpc": heldout / LN2, "lr": self.interval.lr,
                  "chars_per_s": self.interval.chars_per_s, "mfu": self._mfu(self.interval.chars_per_s),
                  "wall_s": state.wall_s,
                  **devices.memory_stats(self.device), "sinks": sinks,
                  "dropped_fraction": sum(d["dropped_fraction"] for d in sinks) / max(1, len(sinks)),
                  "max_vio": mean_max_vio(sinks),
                  "dequants": dequants, "offload": offload,
                  "loss_scale": scaler.get_scale() if scaler is not None else None}
        return {k: record[k] for k in HISTORY_FIELDS}

    def _on_interrupt(self) -> None:
        self.result.interrupted = True
        state = self.state
        if self.training.updating:
            # Where Ctrl-C could not be held back: some parameters may have moved and others not.
            self.say(f"interrupted during the update of step {state.step + 1}; {self.folder.last} is unchanged")
            return
        if not self.is_main:
            return
        if self.owed is None and self.training.parallel.sharded:
            # Gathering the state is a collective, and the interrupt may have stopped the ranks in
            # different places: a gather could wait for ever.
            self.say(f"interrupted at step {state.step}: sharded (train.parallel = fsdp or expert parallelism), "
                     f"so nothing was gathered; {self.folder.kept()}")
            return
        try:
            if self.owed is not None:  # stopped while writing an evaluation's files: finish them
                self.folder.write_evaluation(*self.owed)
            else:
                self.folder.save_last(self._checkpoint())
        except KeyboardInterrupt:  # a second Ctrl-C: the atomic write left the old files whole
            self.say(f"interrupted again while saving step {state.step}; {self.folder.kept()}")
            return
        self.say(f"interrupted: saved {self.folder.last} at step {state.step}; "
                 f"continue with --resume {self.folder.path}")
