"""The matmuls on expert weights: one module that the dispatch paths, frozen stacks and LoRA all call
down into, and that calls nothing above it.

Shape legend: E experts, I a stack's input width, O its output width, R routed rows (packed by
expert), G experts in a group, C a group's capacity, S chosen experts, r the LoRA rank.

Three matmuls, each on a stacked weight [E, I, O]:
  grouped_mm(x_RI, w, offs_E)                     rows of expert e (offs_E[e-1]:offs_E[e]) times W_e
  layered_bmm(x_PI, w, layers, experts_G)         a padded buffer: its card layer, every expert at one
                                                  capacity, [E, C, I] bmm W (no gather), and overflow
                                                  groups [g, C_g, I] bmm W[group] (gathered), into one
                                                  output buffer
  group_bmm(x_groups, w, experts_G, sizes, ...)   per group of experts: x_g [g, C, I] bmm W[group]
A weight is a tensor (a trainable stack, its gradient flowing back into it) or a `RebuiltWeight`: a
stack that is never kept, made again at each use (a frozen NF4 stack dequantized), with an optional
LoRA pair. A rebuilt weight is never saved for backward, as a saved tensor or a ctx attribute:
backward makes it again, or takes what the row's checkpoint replay kept for it (the replay pin,
minagi/recompute.py), so a row holds at most one made stack between its replay and its backward.
"""
from __future__ import annotations

from typing import Callable, Hashable, NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import recompute

__all__ = ["GROUPED_MM", "Layers", "RebuiltWeight", "Weight", "group_bmm", "grouped_mm", "layered_bmm"]

# torch >= 2.10 exposes F.grouped_mm; 2.8-2.9 only torch._grouped_mm. Both take (a_2D, b_3D, offs=int32).
GROUPED_MM: Callable | None = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class RebuiltWeight(NamedTuple):
    """A stacked weight [E, I, O] made at each use and never kept (a frozen stack, dequantized)."""
    make: Callable[[Tensor | None, str], Tensor]  # (experts [S] or None = all, phase) -> [E or S, I, O]
    keep: Callable[[bool], bool]  # in a replay: keep what it made for the row's backward? (arg: the
    #                               path multiplies gate_up and down of one row together: layered_bmm, group_bmm)
    slot: Hashable                # where the kept weight waits in the row's memo
    lora: tuple[Tensor, Tensor] | None = None  # A [E, I, r], B [E, r, O], in the compute dtype
    scale: float = 0.0            # the LoRA pair adds scale * x A B


Weight = Union[Tensor, RebuiltWeight]


def grouped_mm(x_RI: Tensor, weight: Weight, offs_E: Tensor, gemm: Callable | None = None) -> Tensor:
    """Rows of expert e (offs_E[e-1]:offs_E[e]) times expert e's weight, packed: [R, I] -> [R, O].
    `gemm(x_RI, w_EIO, offs_E)`: the grouped GEMM that multiplies (None: torch's, GROUPED_MM; the
    "triton" path passes minagi's own, minagi/grouped_triton.py)."""
    gemm = gemm or _torch_grouped_mm
    if isinstance(weight, Tensor):
        return gemm(x_RI, weight, offs_E)
    y_RO = _RebuiltGroupedMM.apply(x_RI, offs_E, weight, gemm)
    if weight.lora is None:
        return y_RO
    a_EIr, b_ErO = weight.lora
    return y_RO + weight.scale * gemm(gemm(x_RI, a_EIr, offs_E), b_ErO, offs_E)


def _torch_grouped_mm(x_RI: Tensor, w_EIO: Tensor, offs_E: Tensor) -> Tensor:
    return GROUPED_MM(x_RI, w_EIO, offs=offs_E)


def group_bmm(x_groups: list[Tensor], weight: Weight, experts_G: Tensor, sizes: list[int],
              covers_all: bool) -> list[Tensor]:
    """For each group g of `sizes[g]` experts (their ids in order in `experts_G`): x_g [g, C, I] bmm the
    group's weights [g, I, O]. `covers_all`: the groups hold every expert of the stack."""
    if not x_groups:
        return []
    if isinstance(weight, Tensor):
        return _bmm_gathered(x_groups, weight, experts_G, sizes, covers_all)
    ys = list(_RebuiltGroupBmm.apply(weight, experts_G, sizes, *x_groups))
    if weight.lora is None:
        return ys
    a_EIr, b_ErO = weight.lora
    low = _bmm_gathered(_bmm_gathered(x_groups, a_EIr, experts_G, sizes, covers_all), b_ErO, experts_G, sizes,
                        covers_all)
    return [y + weight.scale * d for y, d in zip(ys, low)]


class Layers(NamedTuple):
    """How a padded buffer's rows [P] are laid out: first the card layer, every one of `experts` at
    capacity `card` (0: no card layer), then each overflow group (its experts, its capacity)."""
    experts: int
    card: int
    groups: tuple[tuple[int, int], ...]  # (experts in the group, capacity)

    def pieces(self) -> list[tuple[int, int]]:
        return [(self.experts, self.card), *self.groups]


def layered_bmm(x_PI: Tensor, weight: Weight, layers: Layers, experts_G: Tensor) -> Tensor:
    """The padded buffer's rows times their experts' weights: [P, I] -> [P, O]. The card layer (rows
    [E, C]) multiplies the stack as it is; each overflow group multiplies its experts' weights (ids in
    order in `experts_G`), gathered. Every product is written straight into the one output buffer, and
    the weight gradient is the card layer's bmm with each group's added into its experts' rows
    (index_add_): no copy of the card, no whole-card gradient per group, no cat."""
    if isinstance(weight, Tensor):
        return _LayeredBmm.apply(x_PI, weight, layers, experts_G)
    y_PO = _RebuiltLayeredBmm.apply(x_PI, weight, layers, experts_G)
    if weight.lora is not None:
        a_EIr, b_ErO = weight.lora
        low_Pr = layered_bmm(x_PI, a_EIr, layers, experts_G)
        y_PO = y_PO + weight.scale * layered_bmm(low_Pr, b_ErO, layers, experts_G)
    return y_PO


def _layer_views(t_PX: Tensor, layers: Layers) -> list[Tensor]:
    """[P, X] as each layer's [g, C, X] view (no copy)."""
    width = t_PX.shape[-1]
    pieces = layers.pieces()
    return [v.view(g, c, width) for v, (g, c) in zip(t_PX.split([g * c for g, c in pieces]), pieces)]


def _layered_products(x_PI: Tensor, w_EIO: Tensor | None, w_GIO: Tensor | None, layers: Layers,
                      width: int) -> Tensor:
    """x's layers bmm their weights, each written into its rows of one [P, width] buffer; W may be
    given transposed (the input gradient). `w_EIO` None: the card layer is empty."""
    out_PO = x_PI.new_empty(x_PI.shape[0], width)
    xs, outs = _layer_views(x_PI, layers), _layer_views(out_PO, layers)
    group_ws = w_GIO.split([g for g, _ in layers.groups]) if layers.groups else []
    for x, out, w in zip(xs, outs, [w_EIO, *group_ws]):
        if x.shape[1] > 0:
            torch.bmm(x, w, out=out)
    return out_PO


class _LayeredBmm(torch.autograd.Function):
    """`layered_bmm` on a tensor stack (trainable: its gradient too)."""

    @staticmethod
    def forward(ctx, x_PI: Tensor, w_EIO: Tensor, layers: Layers, experts_G: Tensor) -> Tensor:
        ctx.save_for_backward(x_PI, w_EIO, experts_G)
        ctx.layers = layers
        w_GIO = w_EIO.index_select(0, experts_G) if layers.groups else None
        return _layered_products(x_PI, w_EIO if layers.card else None, w_GIO, layers, w_EIO.shape[-1])

    @staticmethod
    def backward(ctx, grad_PO: Tensor):
        x_PI, w_EIO, experts_G = ctx.saved_tensors
        layers, grad_PO = ctx.layers, grad_PO.contiguous()
        w_GIO = w_EIO.index_select(0, experts_G) if layers.groups else None  # again: gathered weights are not kept
        grad_x = _layered_products(grad_PO, w_EIO.transpose(1, 2) if layers.card else None,
                                   None if w_GIO is None else w_GIO.transpose(1, 2), layers, w_EIO.shape[1])
        xs, grads = _layer_views(x_PI, layers), _layer_views(grad_PO, layers)
        grad_w = torch.bmm(xs[0].transpose(1, 2), grads[0]) if layers.card else torch.zeros_like(w_EIO)
        if layers.groups:  # each group's product written into its rows of one buffer: no cat
            grad_GIO = w_EIO.new_empty(experts_G.shape[0], *w_EIO.shape[1:])
            for x, g, out in zip(xs[1:], grads[1:], grad_GIO.split([n for n, _ in layers.groups])):
                torch.bmm(x.transpose(1, 2), g, out=out)
            grad_w.index_add_(0, experts_G, grad_GIO)
        return grad_x, grad_w, None, None


class _RebuiltLayeredBmm(torch.autograd.Function):
    """`layered_bmm` on a rebuilt (frozen) stack: the card made once and the groups' experts taken from
    it, or, without a card layer, only the groups' experts made."""

    @staticmethod
    def forward(ctx, x_PI: Tensor, weight: RebuiltWeight, layers: Layers, experts_G: Tensor) -> Tensor:
        w, memo = _make(weight, None if layers.card else experts_G, together=True)
        ctx.save_for_backward(experts_G)
        ctx.weight, ctx.memo, ctx.layers = weight, memo, layers
        w_EIO, w_GIO = _card_and_groups(w, layers, experts_G)
        return _layered_products(x_PI, w_EIO, w_GIO, layers, w.shape[-1])

    @staticmethod
    def backward(ctx, grad_PO: Tensor):
        (experts_G,) = ctx.saved_tensors
        layers = ctx.layers
        w = _for_backward(ctx.weight, None if layers.card else experts_G, ctx.memo)
        w_EIO, w_GIO = _card_and_groups(w, layers, experts_G)
        t = lambda m: None if m is None else m.transpose(1, 2)  # noqa: E731
        return _layered_products(grad_PO.contiguous(), t(w_EIO), t(w_GIO), layers, w.shape[1]), None, None, None


def _card_and_groups(w: Tensor, layers: Layers, experts_G: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """(the card's weights, the groups' weights) from what a rebuilt weight made: the whole card (the
    groups' experts taken from it), or only the groups' experts (the card layer is empty: None)."""
    if not layers.card:
        return None, w
    return w, (w.index_select(0, experts_G) if layers.groups else None)


def _bmm_gathered(x_groups: list[Tensor], w_EIO: Tensor, experts_G: Tensor, sizes: list[int],
                  covers_all: bool) -> list[Tensor]:
    weights = _GatherGroups.apply(w_EIO, experts_G, sizes, covers_all)
    return [torch.bmm(x, w) for x, w in zip(x_groups, weights)]


class _GatherGroups(torch.autograd.Function):
    """Each group's rows of a stacked tensor: (x[index_g] for each group g), index split by `sizes`.

    Every row of x belongs to at most one group, so the backward writes each group's gradient
    straight into x's gradient (index_copy_). One gather split into group views would copy the card's
    gradient twice in backward: the split's cat, then the gather's own backward.
    """

    @staticmethod
    def forward(ctx, x, index_G, sizes: list[int], covers_all: bool):
        ctx.save_for_backward(index_G)
        ctx.sizes, ctx.shape, ctx.covers_all = sizes, x.shape, covers_all
        return tuple(x.index_select(0, index_g) for index_g in index_G.split(sizes))

    @staticmethod
    def backward(ctx, *grads):
        (index_G,) = ctx.saved_tensors
        # Rows in no group (idle experts) get zeros; when the groups cover every row, nothing is left.
        grad_x = grads[0].new_empty(ctx.shape) if ctx.covers_all else grads[0].new_zeros(ctx.shape)
        for index_g, grad_g in zip(index_G.split(ctx.sizes), grads):
            grad_x.index_copy_(0, index_g, grad_g)
        return grad_x, None, None, None


# ---------------------------------------------------------------- rebuilt weights: made, never kept

def _make(weight: RebuiltWeight, experts: Tensor | None, together: bool) -> tuple[Tensor, object]:
    """(the weight made for a forward or a replay, the row's memo): a replay may keep it for backward."""
    memo = recompute.active_memo()
    replaying = memo is not None and memo.replaying
    w = weight.make(experts, "replay" if replaying else "forward")
    if replaying and weight.keep(together):
        memo.slots[weight.slot] = w
    return w, memo


def _for_backward(weight: RebuiltWeight, experts: Tensor | None, memo) -> Tensor:
    """What this row's replay kept (taken: one-shot), else the weight made again."""
    kept = memo.slots.pop(weight.slot, None) if memo is not None else None
    return kept if kept is not None else weight.make(experts, "backward")


class _RebuiltGroupedMM(torch.autograd.Function):
    """y = grouped_mm(x, W): [R, I] -> [R, O] for packed rows of E experts (offsets offs_E)."""

    @staticmethod
    def forward(ctx, x_RI: Tensor, offs_E: Tensor, weight: RebuiltWeight, gemm: Callable) -> Tensor:
        w_EIO, memo = _make(weight, None, together=False)
        ctx.save_for_backward(offs_E)
        ctx.weight, ctx.memo, ctx.gemm = weight, memo, gemm
        return gemm(x_RI, w_EIO, offs_E)

    @staticmethod
    def backward(ctx, grad_RO: Tensor):
        (offs_E,) = ctx.saved_tensors
        w_EIO = _for_backward(ctx.weight, None, ctx.memo)
        return ctx.gemm(grad_RO.contiguous(), w_EIO.transpose(1, 2), offs_E), None, None, None


class _RebuiltGroupBmm(torch.autograd.Function):
    """For each group: x_g [g, C, I] bmm its experts' W [g, I, O]; the chosen experts made once."""

    @staticmethod
    def forward(ctx, weight: RebuiltWeight, experts_G: Tensor, sizes: list[int], *x_groups: Tensor):
        w_GIO, memo = _make(weight, experts_G, together=True)
        ctx.save_for_backward(experts_G)
        ctx.weight, ctx.memo, ctx.sizes = weight, memo, sizes
        return tuple(torch.bmm(x, w) for x, w in zip(x_groups, w_GIO.split(sizes)))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        (experts_G,) = ctx.saved_tensors
        w_GIO = _for_backward(ctx.weight, experts_G, ctx.memo)
        grad_x = tuple(None if g is None else torch.bmm(g, w.transpose(1, 2))
                       for g, w in zip(grads, w_GIO.split(ctx.sizes)))
        return (None, None, None, *grad_x)
