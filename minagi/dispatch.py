"""Dispatch and combine for PooledMLP: sort routed rows by expert, run the experts, put results back.

Every path computes the same function; they differ only in how rows are padded:
  loop      — one expert at a time, no padding. The readable reference.
  native    — torch's grouped GEMM on the packed rows, no padding, offsets stay on the device.
  triton    — the same packed rows through minagi's own Triton grouped GEMM (minagi/grouped_triton.py):
              GPUs with Triton where torch's grouped GEMM is not fast (below sm90 it loops on the host).
  grouped   — a card layer: every expert at one capacity C, the whole stack multiplied at once (no
              weight gather); and overflow groups for the rows past C of busier experts (a sink),
              their weights gathered. C is chosen per call, on the host, to cost least in padded rows
              plus gathered experts (`layered_layout`); capacities are rounded by `round_capacity`
              (an overflow group's perhaps up to a power of two: `group_capacity`).
  rectangle — every expert padded to the busiest one's load (the old path; a card layer alone).

Weights come from the pool's expert stack (minagi/experts.py): tensors, or frozen stacks' rebuilt
weights; the runners only ever multiply through minagi/mm.py (`grouped_mm`, `layered_bmm`, `group_bmm`).

Shape legend:
  N characters, D model width, E experts, K top_k, F expert width, R = N*K routed rows,
  P padded rows (grouped / rectangle), G experts in a group, C a layer's capacity,
  I the rows a gather writes (R or P), S the rows it reads from (or the segments of a layout).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from . import probe
from .layout import GATHER_ROWS, Layout, layered_layout, layout_runs, overflow_starts
from .mm import GROUPED_MM, Layers, Weight, group_bmm, grouped_mm, layered_bmm
from .swiglu import TRITON_AVAILABLE, swiglu, swiglu_eager

PATHS = ("grouped", "native", "triton", "rectangle", "loop")
PADDED = ("grouped", "rectangle")  # the paths that run a host-made layout (`host_layout`)
PACKED = ("native", "triton")      # the paths that run the packed rows and device offsets: no host sync


def native_supported(device: torch.device, dtype: torch.dtype, warn: bool = True) -> bool:
    """Whether torch's grouped GEMM runs (fast) for this device and compute dtype.

    CUDA (ROCm included): bf16 only, and only where the probe (minagi/probe.py) finds the kernel
    running there exact and without host syncs: asked of the device once, not read off its capability
    number. CPU: torch runs it eagerly in fp32/bf16 (a per-group loop, correct but not fast).
    """
    if GROUPED_MM is None:
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and probe.grouped_mm_works(device, dtype, warn)
    return device.type == "cpu"


def triton_supported(device: torch.device, dtype: torch.dtype, warn: bool = True) -> bool:
    """Whether `auto` may take minagi's Triton grouped GEMM: an NVIDIA GPU of sm80 or newer (bf16 in
    Triton's dot; where it was run), bf16 or fp16 compute, Triton here, and the probe passed (exact,
    no host sync)."""
    return (_triton_runs(device, dtype) and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (8, 0)
            and probe.triton_grouped_mm_works(device, dtype, warn))


def _triton_runs(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _has_triton()


def _has_triton() -> bool:
    return TRITON_AVAILABLE  # importable: asked once, by minagi/swiglu.py (a function, so tests can fake it)


def resolve_dispatch(choice: str, device: torch.device | str, dtype: torch.dtype, compiled: bool = False) -> str:
    """Turn the configured dispatch choice into a concrete path, once, when the model is built.

    `auto` on CUDA takes torch's grouped GEMM where it is fast (bf16, the probe passed:
    `native_supported`), else minagi's Triton grouped GEMM where it runs (`triton_supported`), else
    the bucketed bmm path, saying in one warning each why neither grouped GEMM was taken; the CPU
    takes the bucketed path. An explicit `native` is taken as asked, the probe not asked (forcing it is
    how one runs a kernel the probe refused), and is an error only where torch has no grouped GEMM.
    `native` in another dtype than bf16 on CUDA, or under torch.compile, takes the bucketed path:
    the CUDA kernel and the meta kernel compile traces with are bf16-only (torch 2.13: fp32 fails to
    trace though it runs eagerly on the CPU). An explicit `triton` runs on any GPU with Triton (AMD
    too: asked for, never run here) where the probe passes it, in bf16 or fp16; elsewhere it takes
    the bucketed path (the same function: a checkpoint trained with it loads anywhere). Each of these
    replacements is said once, in a warning.
    """
    device = torch.device(device)
    if choice == "auto":
        if device.type != "cuda":
            return "grouped"
        if native_supported(device, dtype, warn=False):
            return "native"
        if triton_supported(device, dtype, warn=False):
            return "triton"
        native_supported(device, dtype)  # neither: each refusal said once, with its reason
        triton_supported(device, dtype)
        return "grouped"
    if choice not in PATHS:
        raise ValueError(f"dispatch must be one of auto, {', '.join(PATHS)}; got {choice!r}")
    if choice == "native" and GROUPED_MM is None:
        raise ValueError(f"dispatch = 'native' needs torch.nn.functional.grouped_mm or torch._grouped_mm; "
                         f"torch {torch.__version__} has neither (use 'grouped')")
    if choice == "native" and dtype != torch.bfloat16 and (device.type == "cuda" or compiled):
        return _instead(choice, f"torch's grouped GEMM {'compiles' if compiled else 'runs on CUDA'} in bf16 only, "
                                f"not {str(dtype).removeprefix('torch.')}")
    if choice == "triton" and not _triton_runs(device, dtype):
        return _instead(choice, "minagi's Triton grouped GEMM needs a GPU, bf16 or fp16, and Triton: "
                                f"{device.type}, {str(dtype).removeprefix('torch.')}, Triton "
                                f"{'present' if _has_triton() else 'missing'}")
    if choice == "triton" and not probe.triton_grouped_mm_works(device, dtype):
        return "grouped"  # the probe said why, once
    return choice


_SAID: set[tuple[str, str]] = set()


def _instead(choice: str, why: str) -> str:
    """An explicit pool.dispatch this machine cannot run: the bucketed path (the same function), said once."""
    if (choice, why) not in _SAID:
        _SAID.add((choice, why))
        warnings.warn(f"pool.dispatch = {choice!r}: {why}; the experts take the bucketed path (\"grouped\") "
                      "instead, the same function", stacklevel=3)
    return "grouped"


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
    position_R: Tensor | None = None  # each sorted row's place among its expert's rows (None: not made)

    @property
    def kept_counts_E(self) -> Tensor:
        return self.counts_E if self.capacity == 0 else self.counts_E.clamp(max=self.capacity)

    def tensors(self) -> tuple[Tensor | None, ...]:
        """The plan's tensors, in the order `from_tensors` takes them (what a compiled function returns)."""
        return (self.order_R, self.inverse_R, self.token_R, self.expert_R, self.counts_E, self.starts_E, self.ends_E,
                self.kept_R, self.position_R)

    @classmethod
    def from_tensors(cls, tensors, capacity: int, n_chars: int, top_k: int) -> "DispatchPlan":
        *fields, position_R = tensors
        return cls(*fields, capacity=capacity, n_chars=n_chars, top_k=top_k, position_R=position_R)

    def positions(self) -> Tensor:
        """Each sorted row's place among its expert's rows [R] (made here if the plan has none)."""
        return self.position_R if self.position_R is not None else _positions(self.expert_R, self.starts_E)


def _positions(expert_R: Tensor, starts_E: Tensor) -> Tensor:
    """Each sorted row's place among its expert's rows: its sorted position minus its expert's first."""
    return _arange(expert_R.shape[0], expert_R.device) - starts_E[expert_R]


_ARANGES: dict[tuple[int, torch.device], Tensor] = {}  # (n, device) -> arange(n): read, never written


def _arange(n: int, device: torch.device) -> Tensor:
    """0..n-1 (int64) on `device`, made once per size: an eager call launches no kernel for it (a
    bucketed step is bound by its launches, docs/benchmarks.md section 22). Made afresh where a graph
    is being recorded (torch.compile, CUDA graph capture), whose memory is its own."""
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.arange(n, device=device)
    key = (n, device)
    if key not in _ARANGES:
        if len(_ARANGES) >= 32:  # writing's calls change size: keep a few
            _ARANGES.clear()
        _ARANGES[key] = torch.arange(n, device=device)
    return _ARANGES[key]


def sort_key_dtype(n_experts: int) -> torch.dtype:
    """The narrowest integer dtype holding ids 0..n_experts-1. On an H100 a stable sort of 32,768 ids
    launched 22 kernels as int64, 11 as int16, 9 as uint8 (docs/benchmarks.md section 31)."""
    if n_experts <= 256:
        return torch.uint8
    return torch.int16 if n_experts <= 2**15 else torch.int32 if n_experts <= 2**31 else torch.int64


def make_plan(expert_ids_NK: Tensor, n_experts: int, capacity: int = 0, positions: bool = False) -> DispatchPlan:
    """The plan of one call. `positions`: make each sorted row's place among its expert's rows too
    (the padded paths' slots need it; made here when the plan is compiled with the router)."""
    n_chars, top_k = expert_ids_NK.shape
    flat_R = expert_ids_NK.reshape(-1)
    # Sorted on the narrowest key that holds every id (a radix sort's passes follow its bits), stable:
    # earlier characters win capacity.
    key_R, order_R = torch.sort(flat_R.to(sort_key_dtype(n_experts)), stable=True)
    expert_R = key_R.long()
    # Expert boundaries in the sorted ids: no host sync (bincount on CUDA syncs to size its output).
    bounds_E1 = torch.searchsorted(expert_R, _arange(n_experts + 1, flat_R.device))
    starts_E, ends_E, counts_E = bounds_E1[:-1], bounds_E1[1:], bounds_E1.diff()
    inverse_R = torch.empty_like(order_R)
    inverse_R[order_R] = _arange(order_R.numel(), order_R.device)
    kept_R = position_R = None
    if capacity > 0 or positions:
        position_R = _positions(expert_R, starts_E)
        kept_R = position_R < capacity if capacity > 0 else None
    return DispatchPlan(order_R=order_R, inverse_R=inverse_R, token_R=order_R // top_k, expert_R=expert_R, counts_E=counts_E,
                        starts_E=starts_E, ends_E=ends_E, kept_R=kept_R, capacity=capacity, n_chars=n_chars, top_k=top_k,
                        position_R=position_R)


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


class _PlaceRows(torch.autograd.Function):
    """out[slot[i]] = x[i] for the N*K routed rows x (character order), zero in the slots no row is
    placed in (padding) [P]: the padded buffer's gates, so that a padding slot's SwiGLU output is zero
    whatever its input, and no gradient that reaches it goes further. Backward: grad_x = grad[slot]
    (slot -1: a row dropped by capacity, placed in a spare last slot forward, gets zero)."""

    @staticmethod
    def forward(ctx, x_R, slot_R, n_slots: int, padding: bool, masked: bool):
        ctx.save_for_backward(slot_R)
        ctx.masked = masked
        out = (x_R.new_zeros if padding or masked else x_R.new_empty)(n_slots + masked, *x_R.shape[1:])
        out.index_copy_(0, torch.where(slot_R < 0, n_slots, slot_R) if masked else slot_R, x_R)
        return out[:n_slots] if masked else out

    @staticmethod
    def backward(ctx, grad_P):
        (slot_R,) = ctx.saved_tensors
        return _take(grad_P.contiguous(), slot_R, ctx.masked), None, None, None, None


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

    Backward hands each row its character's gradient: grad_y[i] = grad[token_I[i]]. Every row names a
    character: a padded path's padding rows name character 0 and have gate zero (`run_padded`), so
    what they are handed goes no further.
    """

    @staticmethod
    def forward(ctx, y_ID, slot_flat, token_I, top_k: int, slot_masked: bool):
        ctx.save_for_backward(token_I)
        return gather_sum(y_ID, slot_flat, top_k, slot_masked)

    @staticmethod
    def backward(ctx, grad_ND):
        (token_I,) = ctx.saved_tensors
        return grad_ND.contiguous().index_select(0, token_I), None, None, None, None


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
    return _CombineRows.apply(y_RD, plan.inverse_R, plan.token_R, plan.top_k, False)


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
# `kernels`: pool.swiglu, which of the SwiGLU's implementations may run (minagi/swiglu.py).

def run_loop(x_ND: Tensor, gates_NK: Tensor, gate_up: Weight, down: Weight, plan: DispatchPlan,
             stats: dict, kernels: str = "auto", layout: "Layout | None" = None) -> Tensor:
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
               stats: dict, kernels: str = "auto", layout: "Layout | None" = None) -> Tensor:
    """torch's grouped GEMM on the packed rows: no padding and no host sync."""
    return _run_packed(x_ND, gates_NK, gate_up, down, plan, stats, kernels, gemm=None)


def run_triton(x_ND: Tensor, gates_NK: Tensor, gate_up: Weight, down: Weight, plan: DispatchPlan,
               stats: dict, kernels: str = "auto", layout: "Layout | None" = None) -> Tensor:
    """minagi's Triton grouped GEMM on the packed rows (minagi/grouped_triton.py): no padding, no host sync."""
    from .grouped_triton import grouped_mm as gemm  # imports Triton: only runs that take this path pay for it
    return _run_packed(x_ND, gates_NK, gate_up, down, plan, stats, kernels, gemm=gemm)


def _run_packed(x_ND: Tensor, gates_NK: Tensor, gate_up: Weight, down: Weight, plan: DispatchPlan,
                stats: dict, kernels: str, gemm) -> Tensor:
    x_RD, gate_R = dispatch(x_ND, plan), sorted_gates(gates_NK, plan)
    offs_E = plan.ends_E.to(torch.int32)
    h_RF2 = grouped_mm(x_RD, gate_up, offs_E, gemm)
    stats["padded_rows"] = x_RD.shape[0]  # dropped rows are computed, with gate zero
    return combine(grouped_mm(swiglu(h_RF2, gate_R, kernels), down, offs_E, gemm), plan)


# ---------------------------------------------------------------- the padded paths' layout (minagi/layout.py)

def host_layout(path: str, plan: DispatchPlan, gather_rows: int | None = GATHER_ROWS) -> Layout | None:
    """The layout a padded path runs (grouped: `layered_layout`; rectangle: every expert at the
    busiest one's load): the call's one host sync, as the bmm shapes must be known to launch them.
    None for the paths that need none (native: offsets stay on the device; loop: its own).
    `gather_rows`: what taking an expert out of the stack costs (the stack's own figure)."""
    if path not in PADDED:
        return None
    kept = plan.kept_counts_E.tolist()
    if path == "rectangle":
        return Layout(tuple(kept), max(kept), ())
    return layered_layout(kept, gather_rows)


def _slots(plan: DispatchPlan, layout: Layout, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(slot_flat: the padded slot of each routed row [N*K] in character order, -1 when dropped by
    capacity; token_P: the character each padded slot reads [P], 0 for padding (its gate is zero);
    experts_G: the overflow groups' experts in order). A routed row at position p among its expert e's
    rows sits at e*card + p in the card layer, or at e's overflow start + p - card. No host sync: the
    layout is on the host, and its tables go to the device in one copy."""
    overflow_start, grouped = overflow_starts(layout)
    token_P = torch.zeros(layout.padded_rows + 1, dtype=torch.long, device=device)  # the last: dropped rows
    if plan.kept_R is None:  # dropless: every routed row has a slot, found by its run (`layout_runs`)
        bounds, offsets = layout_runs(layout, overflow_start)
        bounds_S1, offset_S, experts_G = host_to_device(bounds + offsets + grouped, device).split(
            [len(bounds), len(offsets), len(grouped)])
        sorted_R = _arange(plan.order_R.shape[0], device)
        dest_R = sorted_R + offset_S.index_select(0, torch.searchsorted(bounds_S1, sorted_R, right=True))
        token_P.index_copy_(0, dest_R, plan.token_R)
        return dest_R.index_select(0, plan.inverse_R), token_P[:-1], experts_G
    E, card = len(layout.kept), layout.card
    base_2E, experts_G = host_to_device([e * card for e in range(E)] + [s - card for s in overflow_start] + grouped,
                                        device).split([2 * E, len(grouped)])
    position_R = plan.positions()
    dest_R = position_R + base_2E.index_select(0, plan.expert_R + (position_R >= card) * E)
    # Each slot's character: scattered from the kept rows (dropped ones go to a last, spare slot).
    token_P.index_copy_(0, torch.where(plan.kept_R, dest_R, layout.padded_rows), plan.token_R)
    return torch.where(plan.kept_R, dest_R, -1).index_select(0, plan.inverse_R), token_P[:-1], experts_G


def run_padded(x_ND: Tensor, gates_NK: Tensor, gate_up: Weight, down: Weight, plan: DispatchPlan,
               layout: Layout, stats: dict, kernels: str = "auto") -> Tensor:
    """Run a layout's card layer and overflow groups as bmm pairs (`mm.layered_bmm`).

    The rows of every layer live in one flat padded buffer [P, D]. Characters are gathered straight
    into it and summed straight out of it (no intermediate [R, D] in expert order). Padding slots read
    character 0 with gate zero: their output is zero, so the combine's backward may hand them any
    gradient (character 0's: no mask to make) and none goes back through them.
    """
    P, E = layout.padded_rows, len(layout.kept)
    stats["padded_rows"] = P
    if sum(layout.kept) == 0:  # no rows at all (a capacity is at least 1: some row is always kept)
        return x_ND.new_zeros(x_ND.shape[0], x_ND.shape[-1])
    slot_flat, token_P, experts_G = _slots(plan, layout, x_ND.device)  # padding reads character 0
    dropped = plan.kept_R is not None
    padding = P > sum(layout.kept)
    x_PD = _DispatchRows.apply(x_ND, token_P, slot_flat, plan.top_k, dropped)
    gate_P = _PlaceRows.apply(gates_NK.reshape(-1), slot_flat, P, padding, dropped)  # padding: 0
    layers = Layers(E, layout.card, tuple((len(m), cap) for cap, m in layout.groups))
    h_PF2 = layered_bmm(x_PD, gate_up, layers, experts_G)
    y_PD = layered_bmm(swiglu(h_PF2, gate_P, kernels), down, layers, experts_G)
    return _CombineRows.apply(y_PD, slot_flat, token_P, plan.top_k, dropped)


def run_grouped(x_ND, gates_NK, gate_up, down, plan, stats, kernels: str = "auto", layout: Layout | None = None):
    """The card layer and overflow groups of `layered_layout` (made here unless given: one host sync)."""
    layout = layout if layout is not None else host_layout("grouped", plan)
    return run_padded(x_ND, gates_NK, gate_up, down, plan, layout, stats, kernels)


def run_rectangle(x_ND, gates_NK, gate_up, down, plan, stats, kernels: str = "auto", layout: Layout | None = None):
    """Every expert padded to the busiest one's load: one card layer, no overflow (the old path)."""
    layout = layout if layout is not None else host_layout("rectangle", plan)
    return run_padded(x_ND, gates_NK, gate_up, down, plan, layout, stats, kernels)


RUNNERS = {"loop": run_loop, "native": run_native, "triton": run_triton, "grouped": run_grouped,
           "rectangle": run_rectangle}
