"""Assembly: the model, optimizer, schedule and parallel wrappers a config describes (`build_training`),
and the same restored from a checkpoint (`restore_training`). Moved out of minagi/trainer.py, which
keeps the training state, the step, the evaluation and the loop.

The model is built whole (`model.build_model`): row checkpointing, the replay pin, the offload
stager, DDP's count reducers and, under expert parallelism, this rank's expert slices are part of it
from its construction; only DDP or FSDP (minagi/parallel.py) and torch.compile wrap it here. The
optimizer is `optim.build_optimizer`'s (train.optimizer_states), the compute dtype train.precision's
(`mlp.precision_dtype`), with torch's GradScaler for fp16.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import devices, distributed, parallel
from .checkpoint import Checkpoint, restore_rng_state
from .config import Config, ConfigError, check_cuda_graphs, uses_cuda_graphs
from .dispatch import PADDED
from .mlp import precision_dtype
from .model import CharLM, build_model
from .offload import OffloadStager
from .optim import build_optimizer
from .schedule import Schedule, as_function

__all__ = ["INIT_LOSS_SCALE", "Training", "build_training", "check_world_size", "restore_training"]

INIT_LOSS_SCALE = 2.0 ** 16  # fp16's first loss scale (torch's default); GradScaler finds its level from there


def check_world_size(cfg: Config, world_size: int, resuming: bool = False) -> None:
    """train.batch_size is the global batch: it must split evenly over the ranks. A resumed run keeps
    its batch, so then the advice is a rank count that divides it."""
    batch = cfg.train.batch_size
    if batch % world_size:
        if resuming:
            counts = [n for n in range(1, batch + 1) if batch % n == 0 and n % cfg.train.expert_parallel == 0]
            raise ConfigError(f"train.batch_size = {batch} is the run's global batch, which {world_size} ranks "
                              f"cannot split evenly; resume it on {', '.join(map(str, counts[:8]))} rank(s)",
                              "train.batch_size")
        raise ConfigError(f"train.batch_size = {batch} is the global batch and must be a "
                          f"multiple of the {world_size} ranks (--nproc-per-node, or torchrun --nproc_per_node); use e.g. "
                          f"{-(-batch // world_size) * world_size}", "train.batch_size")
    parallel.check_layout(cfg, world_size)


@dataclass
class Training:
    """The model and what trains it. `forward` is the training forward (DDP / compile); everything
    else (optimizer, saving, evaluation, the bias step) uses the plain `model`, so state dicts carry
    no `module.` or `_orig_mod.` prefixes."""
    model: CharLM
    forward: Callable
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    schedule: Schedule
    params: list[Tensor]
    dropout_seed: int | None = None  # any dropout: the base of each step's seed (train.seed and rank)
    stager: OffloadStager | None = None  # experts.offload = "cpu"
    accum_steps: int = 1                 # micro-batches per optimizer step (train.accum_steps)
    dtype: torch.dtype = torch.float32   # what autocast computes in (train.precision)
    scaler: torch.amp.GradScaler | None = None  # fp16: the loss scale
    ddp: torch.nn.parallel.DistributedDataParallel | None = None  # under `forward`, for no_sync
    balance_prepass: bool = False        # the balance term over the whole step needs its counts first
    # The layout's clipping, saving and loading (minagi/parallel.py): the whole model's on every rank
    # under DDP, gathered and split by every rank together under FSDP or expert parallelism.
    parallel: parallel.Parallel = dataclasses.field(default_factory=parallel.Parallel)
    # Set by train_step when the update starts; the caller clears it once its own step counter agrees
    # with the parameters again (a Ctrl-C in between waits for that: minagi.trainer).
    updating: bool = False


def build_training(cfg: Config, vocab_size: int, device: torch.device, world_size: int, *, rank: int = 0,
                   init_frozen: bool = True, log: Callable[[str], None] = lambda msg: None) -> Training:
    """The model (built whole: row checkpointing, the replay pin, offload, DDP's count reducers, this
    rank's expert slices), the optimizer and schedule; DDP or FSDP (minagi/parallel.py) and compile wrap
    the training forward. `init_frozen` False: frozen stacks are left to be loaded (resume, --init)."""
    tc = cfg.train
    devices.check_compiler(tc.compile, device, tc.compile_backend)
    check_cuda_graphs(tc)
    how = devices.Compile.of(tc)
    dtype = precision_dtype(tc.precision, device)
    layout = parallel.Layout(cfg, world_size, device)  # the meshes and the experts' exchange, if any
    torch.manual_seed(tc.seed)
    model = build_model(cfg.model, cfg.pool, vocab_size, device, dense_width=cfg.dense_width,
                        compiled=tc.compile is True,
                        experts=cfg.experts, init_frozen=init_frozen, checkpoint_rows=tc.checkpoint_rows,
                        count_reducer=distributed.all_reduce_sum if world_size > 1 else None,
                        compiled_regions=how if tc.compile == "rows" else None, log=log, dtype=dtype,
                        exchange=layout.exchange)
    _warn_whole_step_on_padded_paths(tc.compile, model, device, log)
    if tc.compile == "rows" and uses_cuda_graphs(tc):
        # Each row's graphs are replayed while the rows before it still await their backward, which
        # keeps cudagraph trees off their fast path and makes them say so once; expected here, and the
        # replays are still the gain (docs/benchmarks.md section 22).
        warnings.filterwarnings("ignore", message="Unable to hit fast path of CUDAGraphs",
                                module="torch._inductor.cudagraph_trees")
    if tc.compile and dtype != torch.float32:
        # In a bf16 or fp16 step the fp32 matmuls are the router's, fp32 on purpose (minagi/router.py):
        # inductor's advice, printed at the first compile, to run float32 matmuls as TF32 does not apply.
        warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication",
                                category=UserWarning)
    forward, wrapped = parallel.wrap(model, layout, device)  # FSDP shards the parameters: before the optimizer
    optimizer = build_optimizer(model.param_groups(tc.weight_decay, tc.expert_weight_decay), lr=tc.lr,
                                betas=(tc.beta1, tc.beta2), states=tc.optimizer_states, device=device, seed=tc.seed)
    schedule = Schedule(total=tc.steps, warmup=tc.warmup_steps, min_ratio=tc.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, as_function(schedule))
    ddp = forward if isinstance(forward, torch.nn.parallel.DistributedDataParallel) else None
    forward = how(forward) if tc.compile is True else forward
    params = [p for g in optimizer.param_groups for p in g["params"]]
    dropout_seed = (tc.seed * 7919 + rank) % 2**62 if cfg.model.dropout > 0 or cfg.pool.expert_dropout > 0 else None
    scaler = torch.amp.GradScaler(device.type, init_scale=INIT_LOSS_SCALE) if dtype == torch.float16 else None
    prepass = (tc.accum_steps > 1 and cfg.model.mlp == "pooled" and cfg.pool.balance_coef > 0
               and cfg.pool.balance_scope == "step")
    return Training(model, forward, optimizer, scheduler, schedule, params, dropout_seed, model.stager,
                    parallel=wrapped, accum_steps=tc.accum_steps, dtype=dtype, scaler=scaler, ddp=ddp,
                    balance_prepass=prepass)


def _warn_whole_step_on_padded_paths(compile_setting, model, device: torch.device, log: Callable[[str], None]) -> None:
    """A whole-step compile around a bucketed path on a GPU: its layouts change the step's shapes with
    the routing, so torch.compile recompiles at new ones until its limit and then runs the step
    eagerly. Said once at start; "rows" compiles around the experts instead. (The CPU's own note is
    train.py's `compile_note`.)"""
    padded = sorted({pool.path for pool in model.pools()} & set(PADDED))
    if compile_setting is True and padded and device.type != "cpu":
        log(f"train.compile = true with the bucketed dispatch ({', '.join(padded)}): its shapes change with the "
            "routing, so the step recompiles at new ones; train.compile = \"rows\" compiles around the experts")


def restore_training(training: Training, ckpt: Checkpoint) -> str | None:
    """Model, optimizer, scheduler and RNG from a training checkpoint, and the schedule the run goes on
    with (`Schedule.extended`). Returns a line saying what an extension does to the learning rate, else None."""
    source = ckpt.source or "checkpoint"
    training.parallel.load_states(training.model, training.optimizer, ckpt.model, ckpt.optimizer, source)
    training.scheduler.load_state_dict(ckpt.scheduler)
    if training.scaler is not None and ckpt.scaler is not None:
        training.scaler.load_state_dict(ckpt.scaler)
    planned, step = ckpt.schedule, ckpt.step
    schedule = planned.extended(step, training.schedule.total)
    training.schedule = schedule
    training.scheduler.lr_lambdas = [as_function(schedule) for _ in training.optimizer.param_groups]
    # The next lr from the schedule, not the optimizer's saved one: the same value, to the bit, unless
    # the run was extended.
    for group, base_lr in zip(training.optimizer.param_groups, training.scheduler.base_lrs):
        group["lr"] = base_lr * schedule(training.scheduler.last_epoch)
    restore_rng_state(ckpt.rng)
    if schedule is planned:
        return None
    base = training.scheduler.base_lrs[0]
    change = f"schedule: train.steps {planned.total} -> {schedule.total}"
    if schedule.bend < 0:
        return f"{change}: still warming up; the cosine after the warmup now ends at step {schedule.total}"
    return (f"{change}: the learning rate goes on from {base * schedule.bend_factor:.3g} (step {step}'s) down a "
            f"cosine to {base * schedule.min_ratio:.3g} at step {schedule.total}, without a jump (a fresh "
            "warmup and cosine is a new run: --init from this run's checkpoint)")
