"""The dense twin of a pool: one SwiGLU MLP over every character, with the pool's `(y, aux)` contract.

Shape legend: N characters, D model width, H hidden width.

At `H = (top_k + shared_experts) * d_expert` (`PoolConfig.dense_width`; the profile's `model.d_dense`,
or that width when 0) it does the active compute of a pool per character: the baseline that says
whether the experts help, and the checkpoint a pool is upcycled from (minagi/upcycle.py).
`dense_swiglu` is the one dense SwiGLU of the codebase: the tests and the dispatch benchmark use it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .mlp import BalanceArgs, MLPAux, compute_dtype

__all__ = ["DenseMLP", "dense_swiglu"]


def dense_swiglu(x_ND: Tensor, gate_up_DH2: Tensor, down_HD: Tensor) -> Tensor:
    """silu(x W_gate) * (x W_up) @ W_down, with gate_up holding the gate half, then the up half."""
    h_gate, h_up = (x_ND @ gate_up_DH2).chunk(2, dim=-1)  # [N, H] each
    return (F.silu(h_gate) * h_up) @ down_HD


class DenseMLP(nn.Module):
    """`forward(x_ND, dropless=False, balance=...) -> (y_ND, MLPAux)` with no aux loss and no routing
    counts (it drops nothing and balances nothing, so `dropless` and `balance` change nothing)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(d_model, 2 * hidden))  # [D, 2H]
        self.down = nn.Parameter(torch.empty(hidden, d_model))         # [H, D]
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, down_std: float | None = None) -> None:
        nn.init.normal_(self.gate_up, std=std)
        nn.init.normal_(self.down, std=std if down_std is None else down_std)

    def forward(self, x_ND: Tensor, dropless: bool = False, balance: BalanceArgs | None = None
                ) -> tuple[Tensor, MLPAux]:
        dtype = compute_dtype(x_ND)
        y_ND = dense_swiglu(x_ND.to(dtype), self.gate_up.to(dtype), self.down.to(dtype))
        return y_ND.to(x_ND.dtype), MLPAux(x_ND.new_zeros((), dtype=torch.float32), None)

    def decoder(self, options):
        """This MLP's decode step and prefill form (minagi/decode_step.py `dense_steps`)."""
        from . import decode_step  # here: decode_step imports dense_swiglu from this module
        return decode_step.dense_steps(self, options)
