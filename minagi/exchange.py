"""Expert parallelism's exchange: each routed row sent to the rank that holds its expert, and back.

Shape legend:
  N characters of this rank, D model width, E experts of the whole card, K top_k, R = N*K routed rows
  of this rank, G ranks of the expert-parallel group, L = E / G experts a rank holds, M rows this rank
  receives (its L experts' rows from every rank of the group).

Rank g of an expert-parallel group holds experts [g*L, (g+1)*L) (minagi/experts.py `LocalExpertStack`).
A pool built with an `ExpertExchange` (minagi/pool.py: the one seam, `experts_forward`) runs its
experts as torchtitan's MoE dispatches tokens (torchtitan/distributed/expert_parallel.py):
  1. the plan over all E experts of this rank's characters (`dispatch.make_plan`): rows sorted by
     expert, so the rows bound for rank g are one contiguous block;
  2. the sizes exchanged first: counts [G, L] with all_to_all_single, read on the host (the splits of
     the row exchanges; the step's one host sync here, kept for a row's checkpoint replay);
  3. the rows, their gates as one more column, sent with all_to_all_single;
  4. the received rows run through the pool's own dispatch path over the local experts: a local plan
     of M routed rows (top_k 1: each received row is one routed row), gated there as at home, so
     `dispatch.RUNNERS` and their loop reference are the same code whatever the layout;
  5. the outputs sent back with a second all_to_all_single and summed per character (`dispatch.combine`).
Backward runs both exchanges the other way (`_AllToAll`). The counts returned are this rank's routing
over all E experts, as without the exchange: the balance term, the aux-free bias and the meters sum
them over every rank (minagi/diagnostics.py), so they see the whole job's routing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from . import recompute
from .dispatch import RUNNERS, combine, dispatch, host_layout, make_plan, sorted_gates
from .mlp import RouteCounts, compute_dtype

__all__ = ["ExpertExchange", "Splits"]


@dataclass(frozen=True)
class Splits:
    """One call's sizes: rows sent to and received from each rank of the group, and the local expert
    of each received row."""
    send: list[int]       # [G]
    recv: list[int]       # [G]
    local_M: Tensor       # int64 [M], in 0..L-1


class _AllToAll(torch.autograd.Function):
    """all_to_all_single as a differentiable op: `x` [sum(send), ...] -> [sum(recv), ...]; backward
    sends each row's gradient back to the rank the row came from."""

    @staticmethod
    def forward(ctx, x: Tensor, recv: list[int], send: list[int], group) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _all_to_all(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def _all_to_all(x: Tensor, recv: list[int], send: list[int], group) -> Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class ExpertExchange:
    """The expert-parallel group of this rank and the exchange of a pool's routed rows over it."""

    def __init__(self, group, n_experts: int):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if n_experts % self.size:
            raise ValueError(f"{n_experts} experts do not split over {self.size} ranks")
        self.n_experts, self.n_local = n_experts, n_experts // self.size

    @property
    def local_experts(self) -> tuple[int, int]:
        """(first, count): the experts this rank holds."""
        return self.rank * self.n_local, self.n_local

    def splits(self, counts_E: Tensor) -> Splits:
        """The sizes of a call's exchanges, from this rank's routed rows per expert (int64 [E])."""
        recv_GL = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_GL, counts_E.contiguous(), group=self.group)  # L counts to each rank
        host = torch.cat([counts_E, recv_GL]).view(2, self.size, self.n_local).sum(-1).tolist()
        local_M = torch.repeat_interleave(torch.arange(self.n_local, device=counts_E.device).repeat(self.size),
                                          recv_GL, output_size=sum(host[1]))
        return Splits(host[0], host[1], local_M)

    def experts_forward(self, pool, x_ND: Tensor, expert_ids_NK: Tensor, gates_NK: Tensor,
                        path: str) -> tuple[Tensor, RouteCounts]:
        """`PooledMLP.experts_forward` with the experts spread over the group: [N, D] and the counts."""
        dtype = compute_dtype(x_ND)
        plan = make_plan(expert_ids_NK, self.n_experts)
        # Routing is remembered for a row's replay, so are its sizes: no second exchange of counts.
        splits = recompute.remember((pool, "ep_splits"), lambda: self.splits(plan.counts_E))
        rows_RD1 = torch.cat([dispatch(x_ND.to(dtype), plan), sorted_gates(gates_NK.to(dtype), plan)[:, None]], 1)
        got_MD1 = _AllToAll.apply(rows_RD1, splits.recv, splits.send, self.group)
        local = make_plan(splits.local_M[:, None], self.n_local)
        layout = recompute.remember((pool, "layout"), lambda: host_layout(path, local, pool.experts.gather_rows))
        gate_up, down = pool.experts.weights(dtype)
        stats: dict = {}
        y_MD = RUNNERS[path](got_MD1[:, :-1], got_MD1[:, -1:], gate_up, down, local, stats,
                             kernels=pool.cfg.swiglu, layout=layout)
        if not splits.local_M.numel():
            # No rows arrived (a sink elsewhere): the output still depends on the exchange and the stack,
            # so this rank's backward runs the exchange's (a collective: every rank must) and gives its
            # experts a zero gradient, as a whole card gets in one process (the same optimizer step).
            y_MD = y_MD + 0 * (got_MD1.sum() + gate_up.sum() + down.sum())
        y_RD = _AllToAll.apply(y_MD, splits.send, splits.recv, self.group)
        return combine(y_RD, plan).to(x_ND.dtype), RouteCounts(plan.counts_E, None, plan.n_chars,
                                                                stats["padded_rows"], path)
