"""The expert-weights seam: where a pool's experts' weights come from, and the one builder of stacks.

Shape legend: E experts, D model width, F expert width, S selected experts.

A pool never reads stacked weights itself: it asks its expert stack for them,

    gate_up, down = stack.weights(dtype)                    # the whole card, as minagi/mm.py multiplies it
    gate_up, down = stack.weights(dtype, experts=ids_S)     # only the chosen experts: [S, D, 2F], [S, F, D]

and hands them to the dispatch paths (minagi/dispatch.py), which multiply through minagi/mm.py.
Trainable stacks give tensors; a frozen stack (minagi/frozen.py: NF4 with LoRA, possibly offloaded to
the CPU) gives `mm.RebuiltWeight`s, made at each use, so it replaces this one without touching the
router, the dispatch paths or the model. With `experts` given, every stack returns tensors of just
those experts: writing one character reads top_k experts, not the card.

`build_stack(row, ...)` builds a row's stack with everything it depends on, from `StackServices` made
once for the model (`stack_services`): the replay pin policy (frozen stacks under row checkpointing),
the offload stager (their CPU homes and staging), whether to initialise them. Nothing is set on a
stack after it is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch import Tensor

from .config import ExpertsConfig
from .layout import GATHER_ROWS
from .frozen import FrozenExpertStack
from .offload import OffloadStager
from .recompute import PinPolicy

__all__ = ["ExpertStack", "LocalExpertStack", "StackServices", "build_stack", "stack_services"]


class ExpertStack(nn.Module):
    """Trainable SwiGLU experts held stacked: gate_up [E, D, 2F] (gate half, then up half), down [E, F, D]."""

    # What taking some experts out of the stack costs against multiplying the whole card, in padded
    # rows an expert (the grouped path's layout weighs it: minagi/layout.py `layered_layout`).
    gather_rows = GATHER_ROWS

    def __init__(self, n_experts: int, d_model: int, d_expert: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_expert))
        self.down = nn.Parameter(torch.empty(n_experts, d_expert, d_model))

    @property
    def n_experts(self) -> int:
        return self.gate_up.shape[0]

    def reset_parameters(self, std: float, down_std: float) -> None:
        nn.init.normal_(self.gate_up, std=std)
        nn.init.normal_(self.down, std=down_std)

    def weights(self, dtype: torch.dtype, experts: Tensor | None = None, *, in_place: bool = False
                ) -> tuple[Tensor, Tensor]:
        """(gate_up, down) in `dtype`: all experts, or those of `experts` (int64 [S], on the stack's
        device). `in_place` is the frozen stacks' (a resident stack is always read where it is)."""
        if experts is None:
            return self.gate_up.to(dtype), self.down.to(dtype)
        # Select, then cast: only the chosen experts are read.
        return self.gate_up.index_select(0, experts).to(dtype), self.down.index_select(0, experts).to(dtype)


class LocalExpertStack(ExpertStack):
    """Experts [first, first + count) of a card of `of` (expert parallelism: each rank holds a slice;
    minagi/exchange.py sends it the rows of its experts). Its state-dict entries are the slice; the
    checkpoint holds the whole card (minagi/parallel.py gathers and splits the expert dimension)."""

    def __init__(self, of: int, first: int, count: int, d_model: int, d_expert: int):
        super().__init__(count, d_model, d_expert)
        self.of, self.first = of, first

    @torch.no_grad()
    def reset_parameters(self, std: float, down_std: float) -> None:
        # The whole card drawn, the slice kept (a row's card at a time): the random numbers one
        # process's stack draws, so the slice, and every parameter drawn after it, equal one process's.
        for w, s in ((self.gate_up, std), (self.down, down_std)):
            card = nn.init.normal_(w.new_empty(self.of, *w.shape[1:]), std=s)
            w.copy_(card[self.first:self.first + w.shape[0]])


@dataclass(frozen=True)
class StackServices:
    """What a model's expert stacks are built with, made once per model (`stack_services`)."""
    experts: ExpertsConfig | None = None  # None or not frozen: trainable stacks
    device: torch.device = torch.device("cpu")
    pin: PinPolicy | None = None          # frozen stacks under row checkpointing
    stager: OffloadStager | None = None   # experts.offload = "cpu"
    init: bool = True                     # False: frozen stacks are left to be loaded
    local: tuple[int, int] | None = None  # expert parallelism: (first, count), the experts this rank holds

    @property
    def frozen(self) -> bool:
        return self.experts is not None and self.experts.frozen


def stack_services(experts: ExpertsConfig | None, device: torch.device | str, *, checkpoint_rows: bool = False,
                   init: bool = True, log: Callable[[str], None] | None = None,
                   local: tuple[int, int] | None = None) -> StackServices:
    """The services of a model's stacks for `experts` on `device`: a pin policy where frozen rows are
    recomputed (the pin keeps a replay's dequant for backward; without a replay it has nothing to
    keep), an offload stager where frozen stacks are homed on the CPU. `local`: the experts this rank
    holds under expert parallelism (trainable stacks only: config.py refuses frozen ones)."""
    device = torch.device(device)
    if experts is None or not experts.frozen:
        return StackServices(experts, device, local=local)
    pin = (PinPolicy(experts.replay_pin, int(experts.pin_floor_mib * 2**20), log=log)
           if checkpoint_rows else None)
    stager = OffloadStager(device, experts.prefetch) if experts.offload == "cpu" else None
    return StackServices(experts, device, pin, stager, init)


def build_stack(services: StackServices, row: int, n_experts: int, d_model: int, d_expert: int) -> nn.Module:
    """Row `row`'s expert stack: trainable, or frozen with its byte source, pin policy and name. Rows
    are built in order (an offload stager numbers them as they register)."""
    if not services.frozen:
        if services.local is not None:
            return LocalExpertStack(n_experts, *services.local, d_model, d_expert)
        return ExpertStack(n_experts, d_model, d_expert)
    return FrozenExpertStack(n_experts, d_model, d_expert, services.experts, services.device, init=services.init,
                             pin=services.pin, stager=services.stager, name=f"rows.{row}.mlp.experts")
