"""The expert-weights seam: where a pool gets its experts' weights from.

Shape legend: E experts, D model width, F expert width, S selected experts.

A pool never reads stacked weights itself: it asks its expert stack for them,

    gate_up, down = stack.weights(dtype)                    # the whole card: [E, D, 2F], [E, F, D]
    gate_up, down = stack.weights(dtype, experts=ids_S)     # only the chosen experts: [S, D, 2F], [S, F, D]

and hands them to the dispatch runners (minagi/dispatch.py). Trainable stacks give tensors. A stack
whose weights are not plain tensors (frozen NF4 with LoRA, offloaded to the CPU) gives objects that
implement the two matmuls the runners call (`dispatch.grouped_mm`, `dispatch.group_bmm`) instead, so it
replaces this one without touching the router, the runners or the model. With `experts` given, every
stack returns tensors of just those experts: writing one character reads top_k experts, not the card.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["ExpertStack"]


class ExpertStack(nn.Module):
    """Trainable SwiGLU experts held stacked: gate_up [E, D, 2F] (gate half, then up half), down [E, F, D]."""

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

    def weights(self, dtype: torch.dtype, experts: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(gate_up, down) in `dtype`: all experts, or those of `experts` (int64 [S], on the stack's device)."""
        if experts is None:
            return self.gate_up.to(dtype), self.down.to(dtype)
        # Select, then cast: only the chosen experts are read.
        return self.gate_up.index_select(0, experts).to(dtype), self.down.index_select(0, experts).to(dtype)
