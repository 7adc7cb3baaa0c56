"""PooledMLP: a router and a card of SwiGLU experts held as stacked tensors.

Shape legend:
  N characters, D model width, E experts, K top_k, F expert width, R = N*K routed rows.

`forward(x_ND, dropless=False) -> (y_ND, MLPAux)` (the MLP contract, minagi/mlp.py): the output (the
routed experts' combined output, plus the shared experts' when `pool.shared_experts` > 0), and
what the caller needs of this call — the aux loss (balance term + z-loss, already weighted) and the
routing counts. The pool keeps nothing from a call: counts are returned, so whoever runs the pool
decides what counts (the trainer adds a training step's counts once, whatever recomputes the row;
evaluation and writing drop them), and the aux-free bias moves only when the trainer calls
`router.step_bias` after an optimizer step. Everything a call depends on is fixed when the pool is
built (its dispatch path, its stack, the reducer of its balance counts) or passed to the call
(`dropless`): nothing is set on it between calls.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import decode_step, recompute
from .config import PoolConfig
from .dense import DenseMLP
from .dispatch import PADDED, RUNNERS, DispatchPlan, host_layout, make_plan
from .experts import ExpertStack
from .mlp import BalanceArgs, MLPAux, RouteCounts, compute_dtype
from .router import Router, Routing, balance_loss, routed_counts, sequence_balance_loss, z_loss

__all__ = ["PooledMLP"]


class PooledMLP(nn.Module):
    """Top-k routed SwiGLU experts, built from a whole `[pool]` section and a resolved dispatch path.

    The balance term `balance_coef * E * sum_i f_i * P_i` uses f_i, the actual fraction of routed
    rows of expert i (summed across ranks by `count_reducer` when given: DDP), and P_i, the mean
    router probability. `experts`: the row's stack (minagi/experts.py `build_stack`), trainable by
    default. `exchange`: expert parallelism's (minagi/exchange.py), where `experts` holds this rank's
    slice of the card and the routed rows run on the ranks that hold their experts.

    Shared experts (`pool.shared_experts` = S > 0, DeepSeekMoE, arXiv 2401.06066): S always-on SwiGLU
    experts of width F, each with weight 1, added to the routed output. S SwiGLUs of width F summed are
    one SwiGLU of width S*F (the hidden units side by side), so they are held as one `DenseMLP`
    (`shared`): two GEMMs instead of 2S smaller ones, as DeepSeek-V3's and torchtitan's shared experts
    are one MLP of S times the expert width. Always trainable (never frozen, quantized or offloaded),
    never routed, dropped or counted; decayed by `train.weight_decay` as the dense weights are.

    `route_in_graph` (train.compile = "rows"): in training calls the router, its aux terms and the
    dispatch plan, whose shapes never change, may run inside the caller's compiled graph: the row
    compiles its attention half and `route_and_plan` as one (minagi/model.py `Row`), asks
    `graph_route_args` whether this call may, and hands the graph's outputs to `forward` as `routed`.
    The experts stay eager, their shapes following the routing.
    """

    def __init__(self, d_model: int, cfg: PoolConfig, path: str = "grouped", experts: nn.Module | None = None,
                 count_reducer: Callable[[Tensor], Tensor] | None = None, exchange=None,
                 route_in_graph: bool = False):
        super().__init__()
        if path not in RUNNERS:
            raise ValueError(f"path must be one of {', '.join(RUNNERS)} (resolve 'auto' with "
                             f"dispatch.resolve_dispatch); got {path!r}")
        self.cfg, self.path, self.count_reducer = cfg, path, count_reducer
        self.exchange = exchange  # expert parallelism (minagi/exchange.py): `experts` holds this rank's slice
        router = Router(d_model, cfg.n_experts, cfg.top_k, cfg.aux_free_bias, cfg.router_score)
        # The stack is registered first: parameters() keeps the order of checkpoints of format 1.
        self.experts = experts if experts is not None else ExpertStack(cfg.n_experts, d_model, cfg.d_expert)
        self.router = router
        self.shared = self._shared_experts(d_model)
        self.reset_parameters()
        self.route_in_graph = route_in_graph

    def _shared_experts(self, d_model: int) -> DenseMLP | None:
        """The always-on experts as one SwiGLU of width shared_experts x d_expert; None without them
        (registered after the router: a pool without them has the parameters it always had)."""
        width = self.cfg.shared_experts * self.cfg.d_expert
        return DenseMLP(d_model, width) if width else None

    @property
    def n_experts(self) -> int:
        return self.cfg.n_experts

    def reset_parameters(self, std: float = 0.02, down_std: float | None = None) -> None:
        nn.init.normal_(self.router.weight, std=std)
        self.experts.reset_parameters(std, std if down_std is None else down_std)
        if self.shared is not None:
            self.shared.reset_parameters(std, down_std)

    def capacity(self, n_chars: int, dropless: bool = False) -> int:
        """Rows kept per expert: ceil(c * fair share); 0 = uncapped (also whenever `dropless`)."""
        if dropless or self.cfg.capacity_factor == 0:
            return 0
        share = self.cfg.capacity_factor * n_chars * self.cfg.top_k / self.cfg.n_experts
        return math.ceil(round(share, 9))  # 1.1 * 100 * 2 / 4 is 55.00000000000001 in floats: 55, not 56

    def forward(self, x_ND: Tensor, dropless: bool = False, in_place: bool = False,
                balance: BalanceArgs = BalanceArgs(), routed: tuple | None = None) -> tuple[Tensor, MLPAux]:
        """`dropless`: compute every routed row whatever the capacity (writing: a character's output
        must not depend on which others share the call). `in_place`: offloaded frozen stacks read the
        experts this call multiplies from their pinned homes instead of staging the row (writing).
        `balance`: what the balance term's scope needs (`balance_term`). `routed`: what
        `route_and_plan` returned for x with `graph_route_args`'s arguments (the caller's graph);
        None: routed here, eagerly."""
        if routed is None:
            routing, plan, aux, experts_in_ND = self.router(x_ND), None, None, x_ND
        else:
            routing, plan, aux, experts_in_ND = self._unpack_route(routed, x_ND, dropless)
        gates_NK = routing.gates_NK
        if self.training and self.cfg.expert_dropout > 0:  # (a checkpoint replay restores the RNG: same mask)
            gates_NK = F.dropout(gates_NK, self.cfg.expert_dropout)  # kept gates scaled by 1 / (1 - p)
        y_ND, counts = self.experts_forward(experts_in_ND, routing.expert_ids_NK, gates_NK, dropless=dropless,
                                            in_place=in_place, plan=plan)
        if self.shared is not None:  # summed in x's dtype (the routed output is in the compute dtype)
            y_ND = y_ND.to(x_ND.dtype) + self.shared(x_ND)[0]
        if aux is None:  # the plan's counts are this rank's routed rows per expert: not counted again
            aux = self.aux_loss(routing, balance, counts.load_E if self.exchange is None else None)
        return y_ND, MLPAux(aux, counts)

    def graph_route_args(self, n_chars: int, x_dtype: torch.dtype, dropless: bool, balance: BalanceArgs,
                         compute: torch.dtype) -> tuple | None:
        """The arguments of `route_and_plan` after x, for a call whose route runs in the caller's graph;
        None where it must run eagerly: outside training calls, in a checkpointed row (a replay must take
        the forward's choice from the row's memo), where experts sit on other ranks. The aux loss goes in
        the graph when no count crosses ranks (DDP sums the balance counts: a collective stays out).
        `compute`: the matmuls' dtype (the experts' input is cast to it in the graph)."""
        if not (self.route_in_graph and torch.is_grad_enabled() and self.exchange is None
                and recompute.active_memo() is None):
            return None
        # Gates cast before a dropout would round twice: cast after it, eagerly, as without the graph.
        cast_gates = not (self.training and self.cfg.expert_dropout > 0)
        return (self.capacity(n_chars, dropless), balance if self.count_reducer is None else None,
                compute if compute != x_dtype else None, cast_gates)

    def _unpack_route(self, routed: tuple, x_ND: Tensor, dropless: bool
                      ) -> tuple[Routing, DispatchPlan, Tensor | None, Tensor]:
        """(routing, its dispatch plan, the aux loss or None, the experts' input) from `route_and_plan`'s tuples."""
        routing, plan, aux, experts_in_ND = routed
        capacity = self.capacity(x_ND.shape[0], dropless)
        return (Routing(*routing), DispatchPlan.from_tensors(plan, capacity, x_ND.shape[0], self.cfg.top_k), aux,
                x_ND if experts_in_ND is None else experts_in_ND)

    def route_and_plan(self, x_ND: Tensor, capacity: int, balance: BalanceArgs | None, dtype: torch.dtype | None,
                       cast_gates: bool):
        """The route a caller's graph runs: (routed, x as the graph should hand it on). `routed`, what
        `forward` takes, is tuples of tensors: (routing, the plan's tensors, aux or None, x in `dtype` or
        None where it is x's own). The casts are fused into the graph, forward and backward; with the aux
        loss made here the routing's scores and logits are None, and x goes on detached where only its
        shape is read after the graph (the experts read the cast copy, no shared expert): an output
        nobody reads still gets a zero gradient made for it in backward. Gates in `dtype` where `cast_gates`."""
        routing = self.router(x_ND)
        # Positions only where capacity marks drops: dropless slots come from runs (layout.layout_runs).
        plan = make_plan(routing.expert_ids_NK, self.cfg.n_experts, capacity, positions=self.path in PADDED and capacity > 0)
        aux = self.aux_loss(routing, balance) if balance is not None else None
        gates_NK = routing.gates_NK.to(dtype) if dtype is not None and cast_gates else routing.gates_NK
        kept = (routing.expert_ids_NK, gates_NK) + ((None, None) if aux is not None else tuple(routing[2:]))
        read_after = dtype is None or self.shared is not None
        return (kept, plan.tensors(), aux, None if dtype is None else x_ND.to(dtype)), x_ND if read_after else x_ND.detach()

    def decoder(self, options: decode_step.StepOptions):
        """This pool's decode step and prefill form (minagi/decode_step.py `pooled_steps`)."""
        return decode_step.pooled_steps(self, options)

    def aux_loss(self, routing, balance: BalanceArgs = BalanceArgs(), counts_E: Tensor | None = None) -> Tensor:
        """The weighted aux terms (a zero without any). `counts_E`: the call's routed rows per expert
        where the caller has them (the dispatch plan's), so the balance term does not count them again."""
        terms = []
        if self.cfg.balance_coef > 0:
            terms.append(self.cfg.balance_coef * self.balance_term(routing, balance, counts_E))
        if self.cfg.z_loss_coef > 0:
            terms.append(self.cfg.z_loss_coef * z_loss(routing))
        if not terms:
            return routing.logits_NE.new_zeros(())
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]  # no zero added first: two launches less

    def balance_term(self, routing, balance: BalanceArgs = BalanceArgs(), counts_E: Tensor | None = None) -> Tensor:
        """The unweighted Switch term over `pool.balance_scope`: "sequence", each of the call's
        `balance.sequences` sequences' own; "step" with the step's counts given (accumulation: the
        trainer's routing pre-pass), f from them and P from this call; else this call's counts
        (`counts_E` when given, else counted from the routing), summed over ranks (the micro-batch:
        "batch", and "step" without accumulation)."""
        scope = self.cfg.balance_scope
        if scope == "sequence":
            return sequence_balance_loss(routing, balance.sequences)
        if scope == "step" and balance.step_counts_E is not None:
            return balance_loss(routing, balance.step_counts_E)
        # Counted once per forward: a replay takes the forward's counts (and its reduction over ranks).
        counts_E = recompute.remember((self, "balance_counts"), lambda: self._balance_counts(routing, counts_E))
        # This call's own counts sum to its routed rows, N*K (dropped ones included); summed over ranks, unknown here.
        own = self.count_reducer is None
        return balance_loss(routing, counts_E, routing.expert_ids_NK.numel() if own else None)

    def _balance_counts(self, routing, counts_E: Tensor | None) -> Tensor:
        """fp32 routed rows per expert [E] (exact: integers below 2^24), summed over ranks by the reducer."""
        counts_E = routed_counts(routing.expert_ids_NK, self.cfg.n_experts) if counts_E is None else counts_E.float()
        return counts_E if self.count_reducer is None else self.count_reducer(counts_E)

    def experts_forward(self, x_ND: Tensor, expert_ids_NK: Tensor, gates_NK: Tensor, path: str | None = None,
                        dropless: bool = False, in_place: bool = False, plan: DispatchPlan | None = None
                        ) -> tuple[Tensor, RouteCounts]:
        """Run the routed experts for given routing: dispatch, the path's matmuls, combine. [N, D], in
        the compute dtype.
        `path`: another dispatch path than the built one (tests and benchmarks compare them). `plan`:
        the routing's dispatch plan, when the caller made it (the compiled route)."""
        path = path or self.path
        if self.exchange is not None:  # the rows run where their experts are, and come back
            return self.exchange.experts_forward(self, x_ND, expert_ids_NK, gates_NK, path)
        dtype = compute_dtype(x_ND)
        plan = plan or make_plan(expert_ids_NK, self.cfg.n_experts, self.capacity(x_ND.shape[0], dropless))
        # The host sync of a padded path, once per forward: a checkpoint replay takes the forward's layout.
        layout = recompute.remember((self, "layout"), lambda: host_layout(path, plan, self.experts.gather_rows))
        gate_up, down = self.experts.weights(dtype, in_place=in_place)
        stats: dict = {}
        y_ND = RUNNERS[path](x_ND.to(dtype), gates_NK.to(dtype), gate_up, down, plan, stats,
                             kernels=self.cfg.swiglu, layout=layout)
        dropped = (plan.counts_E - plan.capacity).clamp(min=0).sum() if plan.capacity > 0 else None
        # y stays in the compute dtype: the row's residual add promotes it (rowmath.mlp_residual), one
        # cast's launch less, the same bits.
        return y_ND, RouteCounts(plan.counts_E, dropped, plan.n_chars, stats["padded_rows"], path)

