"""Dispatch and combine for PooledMLP: sort routed rows by expert, run the experts, put results back.

Every path computes the same function; they differ only in how rows are padded:
  loop      — one expert at a time, no padding. The readable reference.
  native    — torch's grouped GEMM on the packed rows, no padding, offsets stay on the device.
  grouped   — experts grouped by load rounded with `_bucket`; one bmm pair per group.
  rectangle — every expert padded to the busiest one's load (the old path; one bmm pair).

Weights come from the pool's expert stack (minagi/experts.py): tensors, or frozen stacks' rebuilt
weights; the runners only ever multiply through minagi/mm.py's `grouped_mm` and `group_bmm`.

Shape legend:
  N characters, D model width, E experts, K top_k, F expert width, R = N*K routed rows,
  P padded rows (grouped / rectangle), G experts in a group, C a group's capacity,
  I the rows a gather writes (R or P), S the rows it reads from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .mm import GROUPED_MM, Weight, group_bmm, grouped_mm
from .swiglu import swiglu, swiglu_eager

PATHS = ("grouped", "native", "rectangle", "loop")


def _bucket(n: int) -> int:
    """Round a load up: powers of two up to 128, then multiples of 128 (few allocator sizes)."""
    if n <= 0:
        return 0
    if n <= 128:
        return 1 << (n - 1).bit_length()
    return -(-n // 128) * 128


def native_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs (fast) for this device and compute dtype.

    CUDA: the CUTLASS kernel needs sm90+ and bf16 (elsewhere torch loops per group with a host
    sync). CPU: torch runs it eagerly in fp32/bf16 (a per-group loop, correct but not fast).
    """
    if GROUPED_MM is None:
        return False
    if device.type == "cuda":
        if torch.version.hip is not None:
            return False
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


def resolve_dispatch(choice: str, device: torch.device | str, dtype: torch.dtype, compiled: bool = False) -> str:
    """Turn the configured dispatch choice into a concrete path, once, when the model is built.

    `auto` takes native grouped GEMM where it is fast (CUDA sm90+, bf16) and the bucketed bmm path
    everywhere else (ROCm, older GPUs, CPU). An explicit `native` that cannot run is an error.
    `native` in another dtype than bf16 on CUDA, or under torch.compile, takes the bucketed path:
    the CUDA kernel and the meta kernel compile traces with are bf16-only (torch 2.13: fp32 fails to
    trace though it runs eagerly on the CPU).
    """
    device = torch.device(device)
    if choice == "auto":
        return "native" if device.type == "cuda" and native_supported(device, dtype) else "grouped"
    if choice not in PATHS:
        raise ValueError(f"dispatch must be one of auto, {', '.join(PATHS)}; got {choice!r}")
    if choice == "native" and GROUPED_MM is None:
        raise ValueError(f"dispatch = 'native' needs torch.nn.functional.grouped_mm or torch._grouped_mm; "
                         f"torch {torch.__version__} has neither (use 'grouped')")
    if choice == "native" and dtype != torch.bfloat16 and (device.type == "cuda" or compiled):
        return "grouped"
    return choice


@dataclass(frozen=True)
class DispatchPlan:
    """Sorting, counts and capacity of one call, computed once and shared by dispatch and combine."""
    order_R: Tensor          # flat routed-row ids (into [N*K]) sorted by expert, stable
    inverse_R: Tensor        # position of each flat routed row in the sorted order
    token_R: Tensor          # the character of each sorted row
    expert_R: Tensor         # the expert of each sorted row (non-decreasing)
    counts_E: Tensor         # routed rows per expert, before capacity (int64)
    starts_E: Tensor         # first sorted position of each expert
    ends_E: Tensor           # one past its last (the grouped GEMM's offsets)
    kept_R: Tensor | None    # sorted row is inside its expert's capacity (None: uncapped)
    capacity: int            # 0 = uncapped
    n_chars: int
    top_k: int

    @property
    def kept_counts_E(self) -> Tensor:
        return self.counts_E if self.capacity == 0 else self.counts_E.clamp(max=self.capacity)


def make_plan(expert_ids_NK: Tensor, n_experts: int, capacity: int = 0) -> DispatchPlan:
    n_chars, top_k = expert_ids_NK.shape
    flat_R = expert_ids_NK.reshape(-1)
    expert_R, order_R = torch.sort(flat_R, stable=True)  # stable: earlier characters win capacity
    # Expert boundaries in the sorted ids: no host sync (bincount on CUDA syncs to size its output).
    bounds_E1 = torch.searchsorted(expert_R, torch.arange(n_experts + 1, device=flat_R.device))
    starts_E, ends_E, counts_E = bounds_E1[:-1], bounds_E1[1:], bounds_E1.diff()
    inverse_R = torch.empty_like(order_R)
    inverse_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    kept_R = None
    if capacity > 0:
        position_R = torch.arange(flat_R.numel(), device=flat_R.device) - starts_E[expert_R]
        kept_R = position_R < capacity
    return DispatchPlan(order_R=order_R, inverse_R=inverse_R, token_R=order_R // top_k, expert_R=expert_R, counts_E=counts_E,
                        starts_E=starts_E, ends_E=ends_E, kept_R=kept_R, capacity=capacity, n_chars=n_chars, top_k=top_k)


def _take(x: Tensor, index: Tensor, masked: bool) -> Tensor:
    """x[index] along dim 0; rows where index < 0 are zero (only looked for when `masked`)."""
    if not masked:
        return x.index_select(0, index)
    # Read a zero row appended to x: one copy of x, where masking the gathered rows afterwards was a
    # broadcast masked_fill over the whole output (slower on the H200: docs/LOG.md, masked gathers).
    with_zero = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return with_zero.index_select(0, torch.where(index < 0, x.shape[0], index))


class _GatherRows(torch.autograd.Function):
    """out = x[index] whose backward is a gather too: grad_x = grad[inverse].

    Valid when every row of x feeds at most one output row (a permutation, or padding that reads a
    row whose output is never used). Torch's own index_select backward is an index_add: atomics,
    which serialise when many padding rows point at one row.
    """

    @staticmethod
    def forward(ctx, x, index, inverse, index_masked: bool, inverse_masked: bool):
        ctx.save_for_backward(inverse)
        ctx.inverse_masked = inverse_masked
        return _take(x, index, index_masked)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _take(grad.contiguous(), inverse, ctx.inverse_masked), None, None, None, None


def gather_rows(x: Tensor, index: Tensor, inverse: Tensor, index_masked: bool = False,
                inverse_masked: bool = False) -> Tensor:
    return _GatherRows.apply(x, index, inverse, index_masked, inverse_masked)


class _DispatchRows(torch.autograd.Function):
    """out[i] = x_ND[token_I[i]]: each character copied to the rows its experts read.

    Backward sums each character's K copies: grad_x[n] = sum_k grad[slot_NK[n, k]], where slot_NK
    (flat [N*K]) says which output row holds routed row (n, k); -1 (dropped) adds nothing.
    """

    @staticmethod
    def forward(ctx, x_ND, token_I, slot_flat, top_k: int, slot_masked: bool):
        ctx.save_for_backward(slot_flat)
        ctx.top_k, ctx.slot_masked = top_k, slot_masked
        return x_ND.index_select(0, token_I)

    @staticmethod
    def backward(ctx, grad_ID):
        (slot_flat,) = ctx.saved_tensors
        return gather_sum(grad_ID.contiguous(), slot_flat, ctx.top_k, ctx.slot_masked), None, None, None, None


class _CombineRows(torch.autograd.Function):
    """out[n] = sum_k y[slot_NK[n, k]] (slot -1: dropped, contributes zero).

    Backward hands each row its character's gradient: grad_y[i] = grad[token_I[i]] (token -1:
    a padding row, gets zero).
    """

    @staticmethod
    def forward(ctx, y_ID, slot_flat, token_I, top_k: int, slot_masked: bool, token_masked: bool):
        ctx.save_for_backward(token_I)
        ctx.token_masked = token_masked
        return gather_sum(y_ID, slot_flat, top_k, slot_masked)

    @staticmethod
    def backward(ctx, grad_ND):
        (token_I,) = ctx.saved_tensors
        return _take(grad_ND.contiguous(), token_I, ctx.token_masked), None, None, None, None, None


def host_to_device(values: list[int], device: torch.device) -> Tensor:
    """A small index list onto the device without a host sync (pinned memory, asynchronous copy)."""
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def dispatch(x_ND: Tensor, plan: DispatchPlan) -> Tensor:
    """Rows of x in expert order: [R, D]."""
    return _DispatchRows.apply(x_ND, plan.token_R, plan.inverse_R, plan.top_k, False)


def combine(y_RD: Tensor, plan: DispatchPlan) -> Tensor:
    """Sum of each character's (already gated) expert outputs, back in character order: [N, D].

    A gather and a sum over K (no index_add), so the result is deterministic.
    """
    return _CombineRows.apply(y_RD, plan.inverse_R, plan.token_R, plan.top_k, False, False)


def sorted_gates(gates_NK: Tensor, plan: DispatchPlan) -> Tensor:
    """Each sorted row's gate [R]; zero for rows dropped by capacity, so their output is zero."""
    gate_R = gather_rows(gates_NK.reshape(-1), plan.order_R, plan.inverse_R)
    return gate_R if plan.kept_R is None else torch.where(plan.kept_R, gate_R, 0)


def gather_sum(src_SD: Tensor, index_flat: Tensor, top_k: int, masked: bool) -> Tensor:
    """out[n] = sum_k src[index[n*K + k]]; index -1 reads zero (looked for when `masked`). [N, D].

    Two eager passes (gather, then the K-way sum): a torch.compile'd one-pass version was slower on
    the H200 (docs/LOG.md, "a compiled one-pass gather-and-sum").
    """
    return _take(src_SD, index_flat, masked).view(-1, top_k, src_SD.shape[-1]).sum(1)


# ---------------------------------------------------------------- paths: [N, D] -> [N, D]
# Each takes the characters x_ND and their routing (plan, gates_NK), returns the gate-weighted sum
# of their experts' outputs (rows dropped by capacity add nothing), and puts padded_rows into `stats`.
# `fused`: the SwiGLU may use minagi's Triton kernels where they run (minagi/swiglu.py).

def run_loop(x_ND: Tensor, gates_NK: Tensor, gate_up: Weight, down: Weight, plan: DispatchPlan,
             stats: dict, fused: bool = True) -> Tensor:
    """The reference: one expert at a time over its kept rows (each its own group of one); dropped
    rows get zeros; eager SwiGLU ops."""
    x_RD, gate_R = dispatch(x_ND, plan), sorted_gates(gates_NK, plan)
    counts, kept, starts = plan.counts_E.tolist(), plan.kept_counts_E.tolist(), plan.starts_E.tolist()
    experts = [e for e, n in enumerate(kept) if n > 0]
    rows = [slice(starts[e], starts[e] + kept[e]) for e in experts]
    ids_G = host_to_device(experts, x_ND.device)
    ones, covers_all = [1] * len(experts), len(experts) == len(counts)
    h = group_bmm([x_RD[r].unsqueeze(0) for r in rows], gate_up, ids_G, ones, covers_all)  # each [1, n, 2F]
    act = [swiglu_eager(h_e, gate_R[r].unsqueeze(0)) for h_e, r in zip(h, rows)]
    y = iter(group_bmm(act, down, ids_G, ones, covers_all))
    width = x_ND.shape[-1]
    pieces = []
    for total, n in zip(counts, kept):
        if n > 0:
            pieces.append(next(y)[0])
        if total > n:
            pieces.append(x_RD.new_zeros(total - n, width))
    stats["padded_rows"] = sum(kept)
    return combine(torch.cat(pieces) if pieces else x_RD.new_zeros(0, width), plan)


def run_native(x_ND: Tensor, gates_NK: Tensor, gate_up: Weight, down: Weight, plan: DispatchPlan,
               stats: dict, fused: bool = True) -> Tensor:
    """torch's grouped GEMM on the packed rows: no padding and no host sync."""
    x_RD, gate_R = dispatch(x_ND, plan), sorted_gates(gates_NK, plan)
    offs_E = plan.ends_E.to(torch.int32)
    h_RF2 = grouped_mm(x_RD, gate_up, offs_E)
    stats["padded_rows"] = x_RD.shape[0]  # dropped rows are computed, with gate zero
    return combine(grouped_mm(swiglu(h_RF2, gate_R, fused), down, offs_E), plan)


def group_by_bucket(kept_counts: list[int]) -> list[tuple[int, list[int]]]:
    """[(capacity C, experts)] with C = _bucket(load), empty experts left out, largest C first."""
    groups: dict[int, list[int]] = {}
    for e, n in enumerate(kept_counts):
        if n > 0:
            groups.setdefault(_bucket(n), []).append(e)
    return sorted(groups.items(), reverse=True)


def run_padded(x_ND: Tensor, gates_NK: Tensor, gate_up: Weight, down: Weight, plan: DispatchPlan,
               groups: list[tuple[int, list[int]]], kept_rows: int, stats: dict, fused: bool = True) -> Tensor:
    """Run groups of experts as bmm pairs, each group padded to its own capacity.

    The rows of all groups live in one flat padded buffer [P, D]; each group's expert weights are
    gathered for it (`group_bmm`), and their gradients written straight into the card's.
    Characters are gathered straight into the padded buffer and summed straight out of it (no
    intermediate [R, D] in expert order). Padding slots read character 0 and their outputs are
    never read back, so they send no gradient.
    """
    device = x_ND.device
    experts = [e for _, members in groups for e in members]
    caps = [c for c, members in groups for _ in members]
    if not experts:  # every row dropped or no rows at all
        stats["padded_rows"] = 0
        return x_ND.new_zeros(x_ND.shape[0], x_ND.shape[-1])
    padded = sum(caps)
    n_experts, n_grouped = plan.counts_E.shape[0], len(experts)
    group_of = [-1] * n_experts       # each expert's place in the grouped order (-1: in no group)
    for i, e in enumerate(experts):
        group_of[e] = i
    perm_G, caps_G, group_of_E = host_to_device(experts + caps + group_of, device).split(
        [n_grouped, n_grouped, n_experts])
    pad_start_G = caps_G.cumsum(0) - caps_G
    # Which sorted row feeds each padded slot.
    slot_expert_P = torch.repeat_interleave(torch.arange(len(experts), device=device), caps_G, output_size=padded)
    slot_pos_P = torch.arange(padded, device=device) - pad_start_G[slot_expert_P]
    valid_P = slot_pos_P < plan.kept_counts_E[perm_G][slot_expert_P]
    src_P = torch.where(valid_P, plan.starts_E[perm_G][slot_expert_P] + slot_pos_P, 0)
    # Which padded slot holds each routed row's output (-1: dropped by capacity, reads zero).
    position_R = torch.arange(plan.expert_R.shape[0], device=device) - plan.starts_E[plan.expert_R]
    dest_R = pad_start_G.index_select(0, group_of_E[plan.expert_R].clamp(min=0)) + position_R
    dropped = plan.kept_R is not None
    if dropped:
        dest_R = torch.where(plan.kept_R, dest_R, -1)
    slot_flat = dest_R.index_select(0, plan.inverse_R)      # [N*K] in character order
    token_P = plan.token_R.index_select(0, src_P)            # the character each slot reads
    padding = padded > kept_rows
    token_or_none_P = torch.where(valid_P, token_P, -1) if padding else token_P  # padding gets no gradient

    x_PD = _DispatchRows.apply(x_ND, token_P, slot_flat, plan.top_k, dropped)
    gate_P = gather_rows(gates_NK.reshape(-1), plan.order_R.index_select(0, src_P), slot_flat, inverse_masked=dropped)
    sizes = [len(members) for _, members in groups]
    covers_all = n_grouped == n_experts  # else experts in no group get a zero gradient
    # split (not slicing): its backward is one cat; a slice's backward allocates the whole tensor.
    slots = [cap * g for (cap, _), g in zip(groups, sizes)]
    shapes = [(g, cap) for (cap, _), g in zip(groups, sizes)]
    x_groups = [x.view(g, cap, -1) for x, (g, cap) in zip(x_PD.split(slots), shapes)]
    h_groups = group_bmm(x_groups, gate_up, perm_G, sizes, covers_all)                       # [G, C, 2F]
    act_groups = [swiglu(h, gate.view(g, cap), fused) for h, gate, (g, cap) in zip(h_groups, gate_P.split(slots), shapes)]
    outputs = [y.view(g * cap, -1) for y, (g, cap) in zip(group_bmm(act_groups, down, perm_G, sizes, covers_all), shapes)]
    stats["padded_rows"] = padded
    y_PD = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return _CombineRows.apply(y_PD, slot_flat, token_or_none_P, plan.top_k, dropped, padding)


def run_grouped(x_ND, gates_NK, gate_up, down, plan, stats, fused: bool = True):
    # One host sync: group shapes must be known to launch the bmms.
    kept = plan.kept_counts_E.tolist()
    groups = group_by_bucket(kept)
    stats["groups"] = len(groups)
    return run_padded(x_ND, gates_NK, gate_up, down, plan, groups, sum(kept), stats, fused)


def run_rectangle(x_ND, gates_NK, gate_up, down, plan, stats, fused: bool = True):
    kept = plan.kept_counts_E.tolist()
    groups = [(max(kept), list(range(len(kept))))] if max(kept) > 0 else []
    return run_padded(x_ND, gates_NK, gate_up, down, plan, groups, sum(kept), stats, fused)


RUNNERS = {"loop": run_loop, "native": run_native, "grouped": run_grouped, "rectangle": run_rectangle}
