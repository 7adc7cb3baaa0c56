"""One optimizer step: its micro-batches, the routing pre-pass of the balance term over the whole step,
the loss scale of fp16, the NaN check, the update and the aux-free bias step (`train_step`). Moved out
of minagi/trainer.py, which runs the loop.

A step trains on `train.accum_steps` micro-batches of `train.batch_size` sequences (this rank's
`batch_size // world_size` of each), one forward and backward each, the gradients summed into
`.grad` with each micro-batch's loss divided by their number: the step's gradient is that of the mean
loss over all its sequences, as one forward of accum_steps x batch_size would give. Under DDP the
gradients are all-reduced once, in the last micro-batch's backward (`no_sync` around the others); the
losses and routing counts of all micro-batches are summed here and reduced over ranks in one
all-reduce, as with one micro-batch. The aux-free bias moves once, from the whole step's counts.

The balance term over the whole step (`pool.balance_scope = "step"`, accum_steps > 1) needs the
step's counts before the first backward: `routing_prepass` runs the step's micro-batches forward
without a graph (the same dropout masks, so the same routing) and hands the pools their summed
counts, reduced over ranks, through `CharLM.forward(step_counts_LE=...)`: about one forward more per step.
"""
from __future__ import annotations

import contextlib
import math
import re
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import devices, distributed, optim
from .assemble import Training
from .diagnostics import StepCounts, reduce_over_ranks, step_counts
from .recompute import clear_stale_slots

__all__ = ["MIN_LOSS_SCALE", "NonFiniteLossError", "StepStats", "routing_prepass", "train_step"]

# fp16: a loss scale that would fall below this after an overflow means the gradients overflow without
# any scaling: a real NaN or inf, not fp16's range. The run stops there, as with bf16 or fp32.
MIN_LOSS_SCALE = 1.0


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN/inf; raised before the step's update or any save."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


@dataclass
class StepStats:
    ce: float                   # cross-entropy of the global batch, nats
    aux: float
    grad_norm: float            # before clipping; inf on a skipped step
    lr: float                   # the learning rate the update used
    counts: StepCounts | None   # the step's routing, summed over micro-batches and ranks
    skipped: bool = False       # fp16: the gradients overflowed, the update was skipped


def train_step(training: Training, x: Tensor, y: Tensor, *, step: int, grad_clip: float, world_size: int,
               device: torch.device, meanwhile: Callable[[], None] | None = None) -> StepStats:
    """Forward and backward of the micro-batches, the NaN check, the update and the aux-free bias step
    of 0-based `step`. x, y: this rank's rows of the step, micro-batch after micro-batch ([accum_steps x b, T]).

    Raises NonFiniteLossError before updating anything. The one host sync: the loss (the progress
    bar needs it, and a NaN must stop the update), in the same all-reduce as the routing counts
    under DDP. `meanwhile`: host work (the next batch) done once the last micro-batch's kernels are
    queued, before that sync, so the GPU is not left waiting for it after the step (docs/benchmarks.md §10).
    """
    clear_stale_slots()  # replay pins a stopped backward left behind
    xs, ys = x.chunk(training.accum_steps), y.chunk(training.accum_steps)
    step_counts_LE = routing_prepass(training, xs, step, world_size) if training.balance_prepass else None
    losses, counts = [], None
    for micro, (x_j, y_j) in enumerate(zip(xs, ys)):
        loss_aux, micro_counts = _micro_batch(training, x_j, y_j, step, micro, step_counts_LE)
        losses.append(loss_aux)
        counts = _add_counts(counts, micro_counts)
    norm, divisor = _grad_norm(training, grad_clip)
    stats = torch.cat([torch.stack(losses).mean(0), norm.detach().float().view(1)])
    if meanwhile is not None:
        meanwhile()
    (ce, aux, gnorm), counts = reduce_over_ranks(stats, counts, world_size)
    overflow = training.scaler is not None and math.isfinite(ce + aux) and not math.isfinite(gnorm)
    if not (math.isfinite(ce) and math.isfinite(aux) and (math.isfinite(gnorm) or overflow)):
        what = "loss" if not math.isfinite(ce + aux) else "gradient norm"
        raise NonFiniteLossError(f"step {step + 1}: {what} is not finite (loss {ce}, aux {aux}, grad norm "
                                 f"{gnorm}); stopped before updating", step + 1)
    if overflow:
        _check_loss_scale(training, step)
    lr = training.optimizer.param_groups[0]["lr"]
    _update(training, counts, skip=overflow, divisor=divisor)
    return StepStats(ce, aux, gnorm, lr, counts, overflow)


def _seed_dropout(training: Training, step: int, micro: int) -> None:
    """Dropout masks as a function of (seed, step, micro-batch, rank): a resumed run draws the masks the
    uninterrupted one drew, whatever ran before; each rank draws its own rows' masks. The micro-batch
    counts in the low 32 bits, the only ones torch's CPU generator reads (an addend of 2**40 gave every
    micro-batch of a step the same masks on the CPU); with one micro-batch a step, the seeds are as before."""
    if training.dropout_seed is not None:
        micro_batches = step * training.accum_steps + micro
        torch.manual_seed((training.dropout_seed + 1_000_003 * micro_batches) % 2**63)


def _micro_batch(training: Training, x: Tensor, y: Tensor, step: int, micro: int,
                 step_counts_LE: Tensor | None) -> tuple[Tensor, StepCounts | None]:
    """Forward and backward of one micro-batch: ([its loss, aux] detached, its routing counts)."""
    _seed_dropout(training, step, micro)
    last = micro == training.accum_steps - 1
    # DDP all-reduces the gradients in the last micro-batch's backward only: the sum of all of them.
    sync = contextlib.nullcontext() if last or training.ddp is None else training.ddp.no_sync()
    with sync:
        with devices.autocast(x.device, training.dtype):
            out = (training.forward(x, y) if step_counts_LE is None else
                   training.forward(x, y, step_counts_LE=step_counts_LE))
        loss = out.loss + out.aux_loss
        if training.accum_steps > 1:
            loss = loss / training.accum_steps
        (loss if training.scaler is None else training.scaler.scale(loss)).backward()
    return torch.stack([out.loss.detach().float(), out.aux_loss.detach().float()]), step_counts(out.routing)


@torch.no_grad()
def routing_prepass(training: Training, xs: tuple[Tensor, ...], step: int, world_size: int) -> Tensor:
    """The step's routed rows per expert of every pooled row [L, E], summed over its micro-batches `xs`
    and over ranks: the micro-batches forward without a graph, their dropout masks those of the real
    pass (so their routing is too: exact in eager mode; compiled, a no-grad graph may round otherwise)."""
    pools = training.model.pools()
    zeros_LE = torch.zeros(len(pools), pools[0].n_experts, device=xs[0].device)
    total_LE = None
    for micro, x in enumerate(xs):
        _seed_dropout(training, step, micro)
        with devices.autocast(x.device, training.dtype):
            # Zeros as the step's counts: the pass's balance term is thrown away, and its pools must not
            # sum their counts over ranks (a collective per pool and micro-batch).
            out = training.forward(x, step_counts_LE=zeros_LE)
        load_LE = torch.stack([c.load_E for c in out.routing if c is not None]).float()
        total_LE = load_LE if total_LE is None else total_LE + load_LE
    return distributed.all_reduce_sum(total_LE) if world_size > 1 else total_LE


def _add_counts(total: StepCounts | None, more: StepCounts | None) -> StepCounts | None:
    """Two micro-batches' counts as one step's (loads, drops, characters and padded rows summed)."""
    if total is None or more is None:
        return more if total is None else total
    return StepCounts(total.load_LE + more.load_LE, total.dropped_L + more.dropped_L,
                      [a + b for a, b in zip(total.chars, more.chars)],
                      [a + b for a, b in zip(total.padded, more.padded)], more.paths)


def _grad_norm(training: Training, grad_clip: float) -> tuple[Tensor, Tensor | None]:
    """The step's gradient norm before clipping (fp16: of the unscaled gradients), and what the update
    divides the gradients by to clip them to `grad_clip` (None: clipped here already, or no clip).
    torch's fused AdamW clips inside its update (`optim.clips_in_update`): no multiply over the
    gradients. The divisor is clip_grad_norm_'s factor inverted: max(1, (norm + 1e-6) / grad_clip)."""
    if training.scaler is not None:
        training.scaler.unscale_(training.optimizer)
    if (grad_clip > 0 and training.scaler is None and not training.parallel.sharded
            and optim.clips_in_update(training.optimizer)):
        norm = training.parallel.clip_grads(training.params, 0.0)  # the norm alone
        return norm, ((norm.float() + 1e-6) / grad_clip).clamp(min=1.0)  # fp32: what the fused kernel takes
    return training.parallel.clip_grads(training.params, grad_clip), None  # the whole model's, however it is split


def _check_loss_scale(training: Training, step: int) -> None:
    """fp16 overflow: NonFiniteLossError (nothing updated) if the loss scale would fall below MIN_LOSS_SCALE."""
    scale = training.scaler.get_scale()
    if scale * training.scaler.get_backoff_factor() < MIN_LOSS_SCALE:
        raise NonFiniteLossError(f"step {step + 1}: the gradients are not finite even at fp16 loss scale {scale:g} "
                                 "(a NaN or inf, not fp16's range); stopped before updating", step + 1)


def _update(training: Training, counts: StepCounts | None, skip: bool, divisor: Tensor | None = None) -> None:
    """The optimizer, loss scale, schedule and aux-free bias steps; `skip` (fp16 overflow): no update and
    no bias step, the loss scale lowered, the schedule and the step count go on (the step's data is spent).
    `divisor`: the clip the update makes (`_grad_norm`)."""
    training.updating = True
    if not skip:
        optim.step_divided(training.optimizer, divisor)
    if training.scaler is not None:
        training.scaler.update()  # lowers the scale after an overflow (its unscale_ saw the inf), else may raise it
    with warnings.catch_warnings():
        # After a skipped first update torch warns that the schedule stepped before the optimizer: meant.
        warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"), UserWarning)
        training.scheduler.step()
    if counts is not None and not skip:
        training.model.step_router_bias(counts.load_LE)
    training.optimizer.zero_grad(set_to_none=True)
