"""The training loop: AdamW + warmup/cosine, held-out evaluation, history records, checkpoints, resume.

The pieces, each on its own:
  the run folder            minagi/runlog.py `RunFolder`: run.json, history, last/best, the lock
  the training state        `TrainState`: step, best held-out, loss meters, routing counters (checkpointed
                            beside the model, optimizer, scheduler and RNG: `checkpoint_payload`)
  the model and optimizer   `build_training`: the model built whole, DDP / compile around its forward
  one training step         `train_step`
  one evaluation            `evaluate`
  the loop                  `Trainer.run`, which `train` builds and runs
  (beside it: minagi/schedule.py, the learning rate; minagi/resume.py, what a resume checks)

Each step trains on `get_batch(train_ids, batch_size, context, seed, step)`: the batch is a pure
function of the step number, so a resumed run continues at exactly the data position it left, and
on the CPU reproduces the uninterrupted run's losses (and the next step's batch can be made while a
step's kernels run, before its loss is read). Every `eval_every` steps and at the end: the
held-out loss, a history record, last.pt, and best.pt when the held-out loss improved.

Multi-process (DDP, launched by torchrun; docs/multi_gpu.md): with `world_size` > 1 the process
group must be joined (train.py does it, minagi.distributed). `train.batch_size` stays the global
batch: rank r trains on its `batch_size // world_size` rows of every step's batch, DDP averages the
gradients, and the routing counts (balance term, aux-free bias, sink diagnostics) are summed over
ranks, so N ranks train the run one process would. Rank 0 alone writes the run folder; every rank
resumes from its last.pt. The run name, the run folder check and the checkpoint are decided on
rank 0 and shared, so ranks go on, or fail, together.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor
from tqdm import tqdm

from . import devices, distributed
from .checkpoint import capture_rng_state, load_checkpoint, restore_rng_state
from .config import Config, ConfigError, config_to_dict
from .data import Vocab, batch_on, heldout_batches, load_corpus
from .diagnostics import RoutingMeter, StepCounts, reduce_over_ranks, step_counts
from .model import CharLM, build_model
from .frozen import dequant_summary, frozen_stacks
from .loading import init_from_checkpoint
from .offload import OffloadStager, offload_summary
from .recompute import clear_stale_slots
from .resume import check_same_corpus, corpus_summary, describe_corpus, open_checkpoint, resume_config
from .runlog import HISTORY_FIELDS, RunFolder
from .schedule import Schedule, as_function, lr_factor, planned_schedule

__all__ = ["NonFiniteLossError", "TrainResult", "TrainState", "Training", "build_training", "check_world_size",
           "evaluate", "lr_factor", "resume_config", "train", "train_step"]

LN2 = math.log(2.0)
# The progress line's char/s is over the last this many steps, not the interval: the first interval's
# mean holds torch.compile's minute (history.jsonl's chars_per_s stays the interval's mean).
RATE_WINDOW = 16


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN/inf; raised before the step's update or any save."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


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


def check_world_size(cfg: Config, world_size: int) -> None:
    """train.batch_size is the global batch: it must split evenly over the ranks."""
    if cfg.train.batch_size % world_size:
        raise ConfigError(f"train.batch_size = {cfg.train.batch_size} is the global batch and must be a "
                          f"multiple of the {world_size} ranks (torchrun --nproc_per_node); use e.g. "
                          f"{-(-cfg.train.batch_size // world_size) * world_size}", "train.batch_size")


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
    routing: RoutingMeter = field(default_factory=RoutingMeter)

    def add_step(self, ce: float, aux: float, gnorm: float, seconds: float, counts: StepCounts | None) -> None:
        self.loss_sum, self.aux_sum, self.norm_sum = self.loss_sum + ce, self.aux_sum + aux, self.norm_sum + gnorm
        self.since += 1
        self.wall_s += seconds
        self.routing.add(counts)

    def take_means(self) -> dict:
        """The interval's mean train loss, aux loss and gradient norm; the meters start again."""
        means = {"train_loss": self.loss_sum / self.since, "aux_loss": self.aux_sum / self.since,
                 "grad_norm": self.norm_sum / self.since}
        self.loss_sum = self.aux_sum = self.norm_sum = 0.0
        self.since = 0
        return means

    def meter(self) -> dict:
        return {"loss_sum": self.loss_sum, "aux_sum": self.aux_sum, "norm_sum": self.norm_sum,
                "since": self.since, "wall_s": self.wall_s, "eval_due": self.eval_due,
                "evals_since_best": self.evals_since_best, "routing": self.routing.state_dict()}

    @classmethod
    def from_checkpoint(cls, ckpt: dict, device: torch.device) -> "TrainState":
        m = ckpt["meter"]
        state = cls(step=ckpt["step"], best=ckpt["best_heldout_loss"], eval_due=m.get("eval_due", False),
                    loss_sum=m["loss_sum"], aux_sum=m["aux_sum"], norm_sum=m["norm_sum"], since=m["since"],
                    wall_s=m["wall_s"], evals_since_best=m.get("evals_since_best", 0))
        state.routing.load_state_dict(m.get("routing", {}), device)  # format 1 kept no routing counters
        return state


# ------------------------------------------------------------------------------------ model and optimizer

@dataclass
class Training:
    """The model and what trains it. `forward` is the training forward (DDP / compile); everything
    else (optimizer, saving, evaluation, the bias step) uses the plain `model`, so state dicts carry
    no `module.` or `_orig_mod.` prefixes."""
    model: CharLM
    forward: Callable
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    schedule: Callable[[int], float]
    params: list[Tensor]
    dropout_seed: int | None = None  # any dropout: the base of each step's seed (train.seed and rank)
    stager: OffloadStager | None = None  # experts.offload = "cpu"
    # Set by train_step when the update starts; the caller clears it once its own step counter agrees
    # with the parameters again (Ctrl-C in between leaves nothing consistent to save).
    updating: bool = False


def build_training(cfg: Config, vocab_size: int, device: torch.device, world_size: int, *, rank: int = 0,
                   init_frozen: bool = True, log: Callable[[str], None] = lambda msg: None) -> Training:
    """The model (built whole: row checkpointing, the replay pin, offload, DDP's count reducers), the
    optimizer and schedule; DDP and compile wrap the training forward. `init_frozen` False: frozen
    stacks are left to be loaded (resume, --init)."""
    tc = cfg.train
    torch.manual_seed(tc.seed)
    model = build_model(cfg.model, cfg.pool, vocab_size, device, dense_width=cfg.dense_width, compiled=tc.compile,
                        experts=cfg.experts, init_frozen=init_frozen, checkpoint_rows=tc.checkpoint_rows,
                        count_reducer=distributed.all_reduce_sum if world_size > 1 else None, log=log)
    optimizer = torch.optim.AdamW(model.param_groups(tc.weight_decay, tc.expert_weight_decay), lr=tc.lr,
                                  betas=(tc.beta1, tc.beta2), fused=device.type == "cuda")
    schedule = Schedule(total=tc.steps, warmup=tc.warmup_steps, min_ratio=tc.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, as_function(schedule))
    forward = model
    if world_size > 1:
        # Frozen stacks are the same on every rank and have no gradient: not DDP's to sync.
        frozen_buffers = [f"{name}.{b}" for name, s in frozen_stacks(model).items() for b, _ in s.named_buffers()]
        forward = distributed.wrap_ddp(model, device, ignore=frozen_buffers)
    forward = torch.compile(forward, mode=tc.compile_mode) if tc.compile else forward
    params = [p for g in optimizer.param_groups for p in g["params"]]
    dropout_seed = (tc.seed * 7919 + rank) % 2**62 if cfg.model.dropout > 0 or cfg.pool.expert_dropout > 0 else None
    return Training(model, forward, optimizer, scheduler, schedule, params, dropout_seed, model.stager)


def restore_training(training: Training, ckpt: dict) -> str | None:
    """Model, optimizer, scheduler and RNG from a checkpoint, and the schedule the run goes on with
    (`Schedule.extended`). Returns a line saying what an extension does to the learning rate, else None."""
    training.model.load_state_dict(ckpt["model"])
    training.optimizer.load_state_dict(ckpt["optimizer"])
    training.scheduler.load_state_dict(ckpt["scheduler"])
    planned, step = planned_schedule(ckpt), ckpt["step"]
    schedule = planned.extended(step, training.schedule.total)
    training.schedule = schedule
    training.scheduler.lr_lambdas = [as_function(schedule) for _ in training.optimizer.param_groups]
    # The next lr from the schedule, not the optimizer's saved one: the same value, to the bit, unless
    # the run was extended.
    for group, base_lr in zip(training.optimizer.param_groups, training.scheduler.base_lrs):
        group["lr"] = base_lr * schedule(training.scheduler.last_epoch)
    restore_rng_state(ckpt["rng"])
    if schedule is planned:
        return None
    base = training.scheduler.base_lrs[0]
    change = f"schedule: train.steps {planned.total} -> {schedule.total}"
    if schedule.bend < 0:
        return f"{change}: still warming up; the cosine after the warmup now ends at step {schedule.total}"
    return (f"{change}: the learning rate goes on from {base * schedule.bend_factor:.3g} (step {step}'s) down a "
            f"cosine to {base * schedule.min_ratio:.3g} at step {schedule.total}, without a jump (a fresh "
            "warmup and cosine is a new run: --init from this run's checkpoint)")


def checkpoint_payload(training: Training, state: TrainState, cfg: Config, corpus, run_name: str) -> dict:
    return {"model": training.model.state_dict(), "optimizer": training.optimizer.state_dict(),
            "scheduler": training.scheduler.state_dict(), "rng": capture_rng_state(),
            "config": config_to_dict(cfg), "vocab": corpus.vocab.chars, "corpus": corpus_summary(corpus),
            "step": state.step, "best_heldout_loss": state.best, "run_name": run_name, "meter": state.meter(),
            "schedule": dataclasses.asdict(training.schedule)}


# ------------------------------------------------------------------------------------ one step, one evaluation

@dataclass
class StepStats:
    ce: float                   # cross-entropy of the global batch, nats
    aux: float
    grad_norm: float
    lr: float                   # the learning rate the update used
    counts: StepCounts | None   # the step's routing, summed over ranks


def train_step(training: Training, x: Tensor, y: Tensor, *, step: int, grad_clip: float, world_size: int,
               device: torch.device, meanwhile: Callable[[], None] | None = None) -> StepStats:
    """Forward, backward, the NaN check, the update and the aux-free bias step of 0-based `step`.

    Raises NonFiniteLossError before updating anything. The one host sync: the loss (the progress
    bar needs it, and a NaN must stop the update), in the same all-reduce as the routing counts
    under DDP. `meanwhile`: host work (the next batch) done once the step's kernels are queued,
    before that sync, so the GPU is not left waiting for it after the step (docs/benchmarks.md §10).
    """
    clear_stale_slots()  # replay pins a stopped backward left behind
    if training.dropout_seed is not None:
        # Dropout masks as a function of (seed, step, rank): a resumed run draws the masks the
        # uninterrupted one drew, whatever ran before; each rank draws its own rows' masks.
        torch.manual_seed(training.dropout_seed + 1_000_003 * step)
    with devices.autocast(device):
        out = training.forward(x, y)
    (out.loss + out.aux_loss).backward()
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(training.params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in training.params if p.grad is not None])
    stats = torch.stack([out.loss.detach().float(), out.aux_loss.detach().float(), norm.detach().float()])
    if meanwhile is not None:
        meanwhile()
    (ce, aux, gnorm), counts = reduce_over_ranks(stats, step_counts(out.routing), world_size)
    if not (math.isfinite(ce) and math.isfinite(aux) and math.isfinite(gnorm)):
        what = "loss" if not math.isfinite(ce + aux) else "gradient norm"
        raise NonFiniteLossError(f"step {step + 1}: {what} is not finite (loss {ce}, aux {aux}, grad norm "
                                 f"{gnorm}); stopped before updating", step + 1)
    lr = training.optimizer.param_groups[0]["lr"]
    training.updating = True
    training.optimizer.step()
    training.scheduler.step()
    if counts is not None:
        training.model.step_router_bias(counts.load_LE)
    training.optimizer.zero_grad(set_to_none=True)
    return StepStats(ce, aux, gnorm, lr, counts)


@torch.no_grad()
def evaluate(model: CharLM, batches, device: torch.device, world_size: int) -> float:
    """Mean held-out cross-entropy in nats over `batches` (all ranks'); the aux loss is a training
    term, not part of it, and the evaluation's routing counts nothing."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    with devices.autocast(device):
        for x, y in batches:
            total += model(x.to(device, non_blocking=True), y.to(device, non_blocking=True)).loss.double()
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
    (train.py chooses it once, with the rank's GPU under DDP); None = from `train.device`.
    init: a trained checkpoint whose weights and vocabulary a new run starts from (its expert stacks
    quantized when the profile freezes them); not with `resume`.
    Raises NonFiniteLossError on a NaN/inf loss, before anything is saved for that step. Ctrl-C saves
    last.pt and returns with `interrupted=True`.
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
        self.is_main = rank == 0
        self.say = (log or (lambda msg: tqdm.write(msg, file=sys.stdout))) if self.is_main else (lambda msg: None)
        ckpt = self._open_run(profile_name, resume)
        try:
            self._set_up(ckpt, profile_name, progress, argv, init)
        except BaseException:
            # The lock, for a caller that goes on in this process; and no empty folder from a bad --data.
            self.folder.close(discard_if_empty=True)
            raise

    def _set_up(self, ckpt: dict | None, profile_name: str, progress: bool, argv: list[str] | None,
                init: str | Path | None) -> None:
        cfg, rank, world_size, device = self.cfg, self.rank, self.world_size, self.device
        start = None
        if init is not None:  # every rank reads it (rank 0 first: a bad file is one error everywhere)
            start = distributed.main_first(lambda: load_checkpoint(init, map_location="cpu"), rank, world_size)
            self.vocab = Vocab.from_chars(start["vocab"])
        # Rank 0 encodes and caches the corpus; the others then read its cache entry.
        data = cfg.data
        self.corpus = distributed.main_first(
            lambda: load_corpus(data.path, data.heldout_fraction, data.cache_dir, vocab=self.vocab,
                                strip_gutenberg=data.strip_gutenberg, heldout_files=data.heldout_files),
            rank, world_size)
        self.vocab = self.corpus.vocab
        if ckpt is not None:
            check_same_corpus(self.corpus, ckpt, data.path, self.folder.last)
        tc, mc = cfg.train, cfg.model
        self.eval_batches = heldout_batches(self.corpus.heldout_ids, tc.batch_size, mc.context, tc.eval_batches,
                                            tc.seed, rank, world_size)
        self.training = build_training(cfg, self.vocab.size, device, world_size, rank=rank,
                                       init_frozen=ckpt is None and start is None, log=self.say)
        if start is not None:
            fresh = init_from_checkpoint(self.training.model, start, init)
            self.say(f"init: weights of {init} (step {start.get('step', '?')})"
                     + (f"; {len(fresh)} adapter tensors start fresh" if fresh else ""))
            del start
        self.state, self.schedule_note = TrainState(), None
        if ckpt is not None:
            self.schedule_note = restore_training(self.training, ckpt)
            self.state = TrainState.from_checkpoint(ckpt, device)
        self._start_run_folder(profile_name, argv, resumed=ckpt is not None, record=(ckpt or {}).get("record"))
        self.result = TrainResult(run_dir=self.folder.path, start_step=self.state.step, step=self.state.step,
                                  best_heldout_loss=self.state.best)
        self.progress = progress

    def _open_run(self, profile_name: str, resume: str | Path | None) -> dict | None:
        """The run folder and, on resume, its checkpoint: decided on rank 0, shared with the others."""
        self.vocab = None
        if resume is None:
            # Timestamps may differ between ranks: rank 0 names the run for all, and claims its folder.
            def claim() -> str:
                self.folder = _claim_new_run(self.cfg, profile_name)
                return self.folder.path.name
            self.run_name = distributed.from_main(claim, self.rank, self.world_size)
            if not self.is_main:
                self.folder = RunFolder(Path(self.cfg.train.out_dir) / self.run_name)
            return None
        self.folder = RunFolder(resume)

        def open_last() -> dict:
            if self.is_main:
                self.folder.claim()  # before reading last.pt: no other process may move it on
            try:
                return open_checkpoint(self.folder.path, self.cfg)
            except BaseException:
                self.folder.close()
                raise
        # Every rank loads last.pt (rank 0 first: a bad file is one error, raised on all ranks).
        ckpt = distributed.main_first(open_last, self.rank, self.world_size)
        self.folder.last_step = ckpt["step"]
        self.vocab, self.run_name = Vocab.from_chars(ckpt["vocab"]), ckpt["run_name"]
        return ckpt

    def _start_run_folder(self, profile_name: str, argv: list[str] | None, resumed: bool, record: dict | None) -> None:
        if not self.is_main:
            return
        removed = self.folder.removed
        if removed:
            names = ", ".join(p.name for p in removed[:4]) + (", ..." if len(removed) > 4 else "")
            self.say(f"removed {len(removed)} temporary file(s) that a stopped run left: {names}")
        self.folder.start(config=config_to_dict(self.cfg), profile=profile_name,
                          device=devices.device_name(self.device), argv=argv if argv is not None else sys.argv,
                          world_size=self.world_size, resumed_at_step=self.state.step if resumed else None,
                          extra={"corpus": corpus_summary(self.corpus)})
        if self.folder.reconcile(record):
            self.say(f"history: appended the record of step {record['step']} that a stop had cut off")
        self.say(f"run folder: {self.folder.path}" + (f" (resumed at step {self.state.step})" if resumed else ""))
        self.say(describe_corpus(self.corpus, self.cfg.data.path))
        if self.schedule_note:
            self.say(self.schedule_note)

    # ---------------------------------------------------------------- the loop

    def run(self) -> TrainResult:
        tc = self.cfg.train
        state, result = self.state, self.result
        bar = tqdm(total=tc.steps, initial=state.step, file=sys.stderr, mininterval=1.0, dynamic_ncols=True,
                   disable=True if not (self.progress and self.is_main) else None, unit="step")
        devices.memory_stats(self.device)  # reset the peaks: the first record covers this call's steps only
        # Without a terminal (a log file, a job scheduler) tqdm draws nothing: a plain line instead, ten
        # per evaluation interval.
        plain = self.progress and self.is_main and bar.disable
        self.line_every = max(1, min(tc.eval_every, tc.steps) // 10) if plain else 0
        self.interval_chars, self.interval_s, self.interval_steps = 0, 0.0, 0
        self.recent_s: collections.deque[float] = collections.deque(maxlen=RATE_WINDOW)  # step seconds
        self.ahead: tuple[int, tuple[Tensor, Tensor]] | None = None  # (step, batch) made during the step before
        self.owed = None       # (payload, record, improved) of an evaluation whose files are not all written
        self.lr = self._last_lr() if state.eval_due else None
        self.training.model.train()
        try:
            while (state.step < tc.steps or state.eval_due) and not self._stop_early():
                if state.eval_due:
                    self._evaluate_and_record()
                else:
                    self._step(bar)
        except KeyboardInterrupt:
            self._on_interrupt()
        finally:
            bar.close()
            if self.is_main:
                self.folder.close()
        return result

    def _stop_early(self) -> bool:
        patience = self.cfg.train.early_stop_evals
        if self.state.eval_due or not patience or self.state.evals_since_best < patience:
            return False
        if not self.result.stopped_early:
            self.result.stopped_early = True
            self.say(f"early stop at step {self.state.step}: {patience} evaluations without a better held-out "
                     f"loss than {self.state.best:.4f}; {self.folder.best} holds the best")
        return True

    def _last_lr(self) -> float:
        return self.training.scheduler.base_lrs[0] * self.training.schedule(self.state.step - 1)

    def _batch(self, step: int) -> tuple[Tensor, Tensor]:
        """Step `step`'s batch on the device: made during the step before (`_make_ahead`), or now."""
        made, self.ahead = self.ahead, None
        return made[1] if made is not None and made[0] == step else self._make(step)

    def _make_ahead(self, step: int) -> None:
        self.ahead = (step, self._make(step))  # batches are a pure function of seed, step and rank

    def _make(self, step: int) -> tuple[Tensor, Tensor]:
        tc = self.cfg.train
        return batch_on(self.device, self.corpus.train_ids, tc.batch_size, self.cfg.model.context, tc.seed, step,
                        self.rank, self.world_size)

    def _step(self, bar) -> None:
        tc, mc, state = self.cfg.train, self.cfg.model, self.state
        t0 = time.perf_counter()
        x, y = self._batch(state.step)  # [b, T]
        try:
            stats = train_step(self.training, x, y, step=state.step, grad_clip=tc.grad_clip, world_size=self.world_size,
                               device=self.device, meanwhile=lambda: self._make_ahead(state.step + 1))
        except NonFiniteLossError as err:
            raise NonFiniteLossError(f"{err}; {self.folder.kept()}", err.step) from None
        dt = time.perf_counter() - t0
        state.step += 1
        state.eval_due = state.step % tc.eval_every == 0 or state.step == tc.steps
        state.add_step(stats.ce, stats.aux, stats.grad_norm, dt, stats.counts)
        self.training.updating = False  # only now do step, meters and parameters agree
        self.lr = stats.lr
        self.interval_s += dt
        self.interval_chars += tc.batch_size * mc.context
        self.interval_steps += 1
        self.recent_s.append(dt)
        self.result.losses.append(stats.ce)
        self.result.step = state.step
        line_due = self.line_every and state.step % self.line_every == 0
        if not bar.disable or line_due:
            mem = (f"mem {_fmt_bytes(torch.cuda.memory_allocated(self.device))}" if self.device.type == "cuda"
                   else f"rss {_fmt_bytes(devices.rss_bytes())}")
            rate = len(self.recent_s) * tc.batch_size * mc.context / sum(self.recent_s)
            status = f"loss {stats.ce:.4f} | {rate:,.0f} char/s | {mem}"
            if bar.disable:
                self.say(f"step {state.step}/{tc.steps}: {status}")
            else:
                bar.set_postfix_str(status, refresh=False)
                bar.update(1)

    def _evaluate_and_record(self) -> None:
        # Collectives follow (held-out loss): every rank runs this.
        state, tc = self.state, self.cfg.train
        # Training steps' only, per step this process trained (the counts of steps before a resume are gone).
        self.dequants = dequant_summary(self.training.model, self.interval_steps)
        self.offload = offload_summary(self.training.stager, self.interval_steps)
        heldout = evaluate(self.training.model, self.eval_batches, self.device, self.world_size)
        dequant_summary(self.training.model, 1)  # drop the evaluation's
        offload_summary(self.training.stager, 1)
        if not math.isfinite(heldout):
            raise NonFiniteLossError(f"step {state.step}: held-out loss is not finite ({heldout}); stopped "
                                     f"without saving; {self.folder.kept()}", state.step)
        record = self._record(heldout)
        improved = heldout < state.best
        state.best = min(state.best, heldout)
        state.evals_since_best = 0 if improved else state.evals_since_best + 1
        state.eval_due = False
        self.interval_chars, self.interval_s, self.interval_steps = 0, 0.0, 0
        result = self.result
        result.heldout_loss, result.heldout_bpc, result.best_heldout_loss = heldout, heldout / LN2, state.best
        if self.is_main:
            self.owed = (checkpoint_payload(self.training, state, self.cfg, self.corpus, self.run_name), record, improved)
            self.folder.write_evaluation(*self.owed)  # from here on, Ctrl-C finishes these writes
            self.owed = None
        self.say(f"step {state.step}/{tc.steps}: train {record['train_loss']:.4f} | held-out "
                 f"{heldout:.4f} nats = {heldout / LN2:.4f} bits/char" + (" (best)" if improved else ""))

    def _record(self, heldout: float) -> dict:
        state = self.state
        chars_per_step = self.cfg.train.batch_size * self.cfg.model.context
        sinks = state.routing.read(self.cfg.pool.sink_ratio, reset=True)
        record = {
            "step": state.step, "chars_seen": state.step * chars_per_step, **state.take_means(),
            "heldout_loss": heldout, "heldout_bpc": heldout / LN2, "lr": self.lr,
            "chars_per_s": self.interval_chars / self.interval_s if self.interval_s > 0 else None,
            "wall_s": state.wall_s,
            **devices.memory_stats(self.device),
            "sinks": sinks,
            "dropped_fraction": sum(d["dropped_fraction"] for d in sinks) / max(1, len(sinks)),
            "dequants": self.dequants, "offload": self.offload,
        }
        return {k: record[k] for k in HISTORY_FIELDS}

    def _on_interrupt(self) -> None:
        self.result.interrupted = True
        state = self.state
        if self.training.updating:
            # Some parameters may have moved and others not: nothing consistent to save.
            self.say(f"interrupted during the update of step {state.step + 1}; {self.folder.last} is unchanged")
            return
        if not self.is_main:
            return
        try:
            if self.owed is not None:  # stopped while writing an evaluation's files: finish them
                self.folder.write_evaluation(*self.owed)
            else:
                self.folder.save_last(checkpoint_payload(self.training, state, self.cfg, self.corpus, self.run_name))
        except KeyboardInterrupt:  # a second Ctrl-C: the atomic write left the old files whole
            self.say(f"interrupted again while saving step {state.step}; {self.folder.kept()}")
            return
        self.say(f"interrupted: saved {self.folder.last} at step {state.step}; "
                 f"continue with --resume {self.folder.path}")


def _fmt_bytes(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f}GiB"
