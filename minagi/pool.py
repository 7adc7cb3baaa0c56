"""PooledMLP: a router and a card of SwiGLU experts held as stacked tensors, with sink diagnostics.

Shape legend:
  N characters, D model width, E experts, K top_k, F expert width, R = N*K routed rows.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .dispatch import RUNNERS, _bucket, make_plan, resolve_dispatch  # noqa: F401  (_bucket re-exported)

__all__ = ["PooledMLP", "_bucket"]


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype matmuls run in: autocast's where it is on (bmm/grouped_mm get explicit casts)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class PooledMLP(nn.Module):
    """Top-k routed SwiGLU experts; `forward(x_ND) -> (y_ND, aux_loss)`.

    Routing runs in fp32. Gates are renormalised over the chosen experts (top_k > 1; top-1 keeps the
    raw probability, as Switch does, so the router still learns from the loss). The balance term
    `balance_coef * E * sum_i f_i * P_i` uses f_i, the actual fraction of routed rows of expert i
    (reduced across ranks by `count_reducer` when set), and P_i, the mean router probability.
    With `aux_free_bias`, a selection-only bias is nudged after each optimizer step
    (DeepSeek-V3: b_i += rate * sign(mean_load - load_i)).
    """

    # False sends the grouped path through the rectangle (every expert padded to the busiest).
    grouped_dispatch: bool = True

    def __init__(self, d_model: int, d_expert: int, n_experts: int, top_k: int, *,
                 capacity_factor: float = 0.0, dispatch: str = "auto", balance_coef: float = 0.01,
                 z_loss_coef: float = 0.0, aux_free_bias: bool = False, bias_update_rate: float = 1e-3,
                 sink_ratio: float = 4.0):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in 1..n_experts ({n_experts}); got {top_k}")
        if capacity_factor < 0:
            raise ValueError(f"capacity_factor must be >= 0 (0 = uncapped); got {capacity_factor}")
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor = capacity_factor
        self.dispatch = resolve_dispatch(dispatch, "cpu", torch.float32)
        self.balance_coef, self.z_loss_coef = balance_coef, z_loss_coef
        self.aux_free_bias, self.bias_update_rate = aux_free_bias, bias_update_rate
        self.sink_ratio = sink_ratio
        self.count_reducer: Callable[[Tensor], Tensor] | None = None

        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(n_experts, d_model, 2 * d_expert))  # [E, D, 2F]
        self.down = nn.Parameter(torch.empty(n_experts, d_expert, d_model))          # [E, F, D]
        self.register_buffer("selection_bias", torch.zeros(n_experts))               # aux-free, selection only
        # Diagnostics accumulate on the device; read_diagnostics() is the only host sync.
        self.register_buffer("_diag_load", torch.zeros(n_experts, dtype=torch.long), persistent=False)
        self.register_buffer("_diag_dropped", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("_bias_load", torch.zeros(n_experts, dtype=torch.long), persistent=False)
        # Counters are tensors, not Python ints: torch.compile would recompile on every new int value.
        self.register_buffer("_diag_chars", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("_diag_padded", torch.zeros((), dtype=torch.long), persistent=False)
        self._diag_path = self.dispatch
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, down_std: float | None = None) -> None:
        nn.init.normal_(self.router.weight, std=std)
        nn.init.normal_(self.gate_up, std=std)
        nn.init.normal_(self.down, std=std if down_std is None else down_std)

    def capacity(self, n_chars: int) -> int:
        """Rows kept per expert: ceil(c * fair share); 0 = uncapped."""
        if self.capacity_factor == 0:
            return 0
        return math.ceil(self.capacity_factor * n_chars * self.top_k / self.n_experts)

    # ------------------------------------------------------------------ routing
    def route(self, x_ND: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(expert_ids_NK, gates_NK, aux_loss). Runs in fp32 whatever autocast says."""
        with torch.autocast(x_ND.device.type, enabled=False):
            logits_NE = F.linear(x_ND.float(), self.router.weight.float())
            probs_NE = logits_NE.softmax(-1)
            scores_NE = probs_NE + self.selection_bias if self.aux_free_bias else probs_NE
            expert_ids_NK = scores_NE.topk(self.top_k, dim=-1).indices
            gates_NK = probs_NE.gather(-1, expert_ids_NK)
            if self.top_k > 1:
                # Renormalised over the chosen experts. Not for top-1 (Switch keeps the raw
                # probability): a renormalised single gate is exactly 1 and the router would learn
                # from the aux terms alone.
                gates_NK = gates_NK / gates_NK.sum(-1, keepdim=True)
            aux = self._aux_loss(logits_NE, probs_NE, expert_ids_NK)
        return expert_ids_NK, gates_NK, aux

    def _aux_loss(self, logits_NE: Tensor, probs_NE: Tensor, expert_ids_NK: Tensor) -> Tensor:
        aux = logits_NE.new_zeros(())
        if self.balance_coef > 0 and probs_NE.shape[0] > 0:
            # Counted with index_add (exact for whole numbers in fp32): bincount on CUDA syncs the host.
            flat = expert_ids_NK.reshape(-1)
            counts_E = probs_NE.new_zeros(self.n_experts).index_add_(0, flat, probs_NE.new_ones(flat.shape))
            if self.count_reducer is not None:
                counts_E = self.count_reducer(counts_E)
            f_E = counts_E / counts_E.sum().clamp(min=1)
            aux = aux + self.balance_coef * self.n_experts * (f_E * probs_NE.mean(0)).sum()
        if self.z_loss_coef > 0 and logits_NE.shape[0] > 0:
            aux = aux + self.z_loss_coef * torch.logsumexp(logits_NE, -1).square().mean()
        return aux

    # ------------------------------------------------------------------ experts
    def path_for(self, x_ND: Tensor) -> str:
        path = self.dispatch
        if path == "grouped" and not self.grouped_dispatch:
            return "rectangle"
        # The grouped GEMM kernel on CUDA is bf16-only, and so is its meta kernel that torch.compile
        # traces with (torch 2.13: fp32 fails there though it runs eagerly on the CPU); fp32 calls
        # there use the bucketed bmm path.
        if (path == "native" and (x_ND.is_cuda or torch.compiler.is_compiling())
                and _compute_dtype(x_ND) != torch.bfloat16):
            return "grouped"
        return path

    def experts_forward(self, x_ND: Tensor, expert_ids_NK: Tensor, gates_NK: Tensor,
                        path: str | None = None) -> Tensor:
        """Run the routed experts for given routing: dispatch, the path's matmuls, combine. [N, D]."""
        path = path or self.path_for(x_ND)
        dtype = _compute_dtype(x_ND)
        plan = make_plan(expert_ids_NK, self.n_experts, self.capacity(x_ND.shape[0]))
        stats: dict = {}
        y_ND = RUNNERS[path](x_ND.to(dtype), gates_NK.to(dtype), self.gate_up.to(dtype), self.down.to(dtype),
                             plan, stats)
        self._record(plan, path, stats["padded_rows"])
        return y_ND.to(x_ND.dtype)

    def forward(self, x_ND: Tensor) -> tuple[Tensor, Tensor]:
        expert_ids_NK, gates_NK, aux = self.route(x_ND)
        return self.experts_forward(x_ND, expert_ids_NK, gates_NK), aux

    # ------------------------------------------------------------------ diagnostics and bias
    @torch.no_grad()
    def _record(self, plan, path: str, padded_rows: int) -> None:
        self._diag_load += plan.counts_E
        if plan.capacity > 0:
            self._diag_dropped += (plan.counts_E - plan.capacity).clamp(min=0).sum()
        self._diag_chars += plan.n_chars
        self._diag_padded += padded_rows
        self._diag_path = path
        if self.aux_free_bias and self.training:
            self._bias_load += plan.counts_E

    @torch.no_grad()
    def step_bias(self) -> None:
        """DeepSeek-V3 aux-loss-free update from the loads seen since the last step."""
        if not self.aux_free_bias:
            return
        load_E = self._bias_load.float()
        if self.count_reducer is not None:
            load_E = self.count_reducer(load_E)
        if load_E.sum() > 0:
            self.selection_bias += self.bias_update_rate * torch.sign(load_E.mean() - load_E)
        self._bias_load.zero_()

    @torch.no_grad()
    def read_diagnostics(self, reset: bool = True) -> dict:
        """Sink diagnostics since the last reset, as plain Python numbers (one host sync).

        With a `count_reducer` (DDP) the counters are summed over ranks first, so every rank reads
        the whole job's routing; that is a collective: every rank must call this alike.
        """
        counters = torch.cat([self._diag_load, torch.stack([self._diag_dropped, self._diag_chars,
                                                            self._diag_padded])])  # [E + 3]
        if self.count_reducer is not None:
            counters = self.count_reducer(counters)
        *load, dropped, chars, padded = counters.tolist()
        routed = sum(load)
        fair = routed / self.n_experts if routed else 0.0
        top = max(range(self.n_experts), key=load.__getitem__)
        out = {
            "path": self._diag_path,
            "chars": chars,
            "routed": routed,
            "load": load,
            "fair_share": fair,
            "max_over_fair": load[top] / fair if fair else 0.0,
            "sinks": sum(1 for n in load if fair and n > self.sink_ratio * fair),
            "top_expert": top,
            # An expert is picked at most once per character, so its load counts characters.
            "top_share": load[top] / chars if chars else 0.0,
            "dead": sum(1 for n in load if n == 0) if routed else 0,
            "dropped_fraction": dropped / routed if routed else 0.0,
            "padding_ratio": padded / routed if routed else 0.0,
        }
        if reset:
            self._diag_load.zero_()
            self._diag_dropped.zero_()
            self._diag_chars.zero_()
            self._diag_padded.zero_()
        return out
