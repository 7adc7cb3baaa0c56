"""The matmuls on expert weights: one module that the dispatch paths, frozen stacks and LoRA all call
down into, and that calls nothing above it.

Shape legend: E experts, I a stack's input width, O its output width, R routed rows (packed by
expert), G experts in a group, C a group's capacity, S chosen experts, r the LoRA rank.

Three matmuls, each on a stacked weight [E, I, O]:
  grouped_mm(x_RI, w, offs_E)                     rows of expert e (offs_E[e-1]:offs_E[e]) times W_e
  layered_bmm(x_ECI, x_groups, w, experts_G, ...) the whole card at one capacity, x [E, C, I] bmm W (no
                                                  gather), and overflow groups: x_g [g, C_g, I] bmm
                                                  W[group] (those experts' weights gathered)
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

__all__ = ["GROUPED_MM", "RebuiltWeight", "Weight", "group_bmm", "grouped_mm", "layered_bmm"]

# torch >= 2.10 exposes F.grouped_mm; 2.8-2.9 only torch._grouped_mm. Both take (a_2D, b_3D, offs=int32).
GROUPED_MM: Callable | None = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class RebuiltWeight(NamedTuple):
    """A stacked weight [E, I, O] made at each use and never kept (a frozen stack, dequantized)."""
    make: Callable[[Tensor | None, str], Tensor]  # (experts [S] or None = all, phase) -> [E or S, I, O]
    keep: Callable[[bool], bool]  # in a replay: keep what it made for the row's backward? (arg: the
    #                               path multiplies gate_up and down of one row together: group_bmm)
    slot: Hashable                # where the kept weight waits in the row's memo
    lora: tuple[Tensor, Tensor] | None = None  # A [E, I, r], B [E, r, O], in the compute dtype
    scale: float = 0.0            # the LoRA pair adds scale * x A B


Weight = Union[Tensor, RebuiltWeight]


def grouped_mm(x_RI: Tensor, weight: Weight, offs_E: Tensor) -> Tensor:
    """Rows of expert e (offs_E[e-1]:offs_E[e]) times expert e's weight, packed: [R, I] -> [R, O]."""
    if isinstance(weight, Tensor):
        return GROUPED_MM(x_RI, weight, offs=offs_E)
    y_RO = _RebuiltGroupedMM.apply(x_RI, offs_E, weight)
    if weight.lora is None:
        return y_RO
    a_EIr, b_ErO = weight.lora
    return y_RO + weight.scale * GROUPED_MM(GROUPED_MM(x_RI, a_EIr, offs=offs_E), b_ErO, offs=offs_E)


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


def layered_bmm(x_ECI: Tensor, x_groups: list[Tensor], weight: Weight, experts_G: Tensor,
                sizes: list[int]) -> tuple[Tensor, list[Tensor]]:
    """(x_ECI bmm W: the card layer, [E, C, O]; for each overflow group g of `sizes[g]` experts, their
    ids in order in `experts_G`: x_g [g, C_g, I] bmm those experts' W). The card layer reads the stack
    as it is; only the overflow groups' experts are gathered, and their weight gradients are added into
    the card's in place (the card's own gradient is written once, by its bmm)."""
    if isinstance(weight, Tensor):
        y_ECO, *ys = _LayeredBmm.apply(weight, experts_G, sizes, x_ECI, *x_groups)
        return y_ECO, ys
    y_ECO, *ys = _RebuiltLayeredBmm.apply(weight, experts_G, sizes, x_ECI, *x_groups)
    if weight.lora is not None:
        a_EIr, b_ErO = weight.lora
        low_ECr, low_groups = layered_bmm(x_ECI, x_groups, a_EIr, experts_G, sizes)
        d_ECO, d_groups = layered_bmm(low_ECr, low_groups, b_ErO, experts_G, sizes)
        y_ECO = y_ECO + weight.scale * d_ECO
        ys = [y + weight.scale * d for y, d in zip(ys, d_groups)]
    return y_ECO, ys


def _layer_products(w_EIO: Tensor | None, w_GIO: Tensor | None, sizes: list[int], x_ECI: Tensor,
                    x_groups: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The card layer's product and each overflow group's, the groups' weights given gathered
    (`w_EIO` None: the card layer is empty)."""
    weights = w_GIO.split(sizes) if x_groups else ()
    card = (torch.bmm(x_ECI, w_EIO) if w_EIO is not None else
            x_ECI.new_empty(x_ECI.shape[0], 0, w_GIO.shape[-1]))
    return (card, *(torch.bmm(x, w) for x, w in zip(x_groups, weights)))


def _layer_input_grads(w_EIO: Tensor | None, w_GIO: Tensor | None, sizes: list[int], grads: tuple) -> list:
    """d x of the card layer and of each group: grad bmm W^T."""
    weights = w_GIO.split(sizes) if len(grads) > 1 else ()
    card = (torch.bmm(grads[0], w_EIO.transpose(1, 2)) if w_EIO is not None else
            grads[0].new_empty(grads[0].shape[0], 0, w_GIO.shape[1]))
    return [card] + [torch.bmm(g, w.transpose(1, 2)) for g, w in zip(grads[1:], weights)]


class _LayeredBmm(torch.autograd.Function):
    """`layered_bmm` on a tensor stack: the weight gradient is the card layer's bmm, with each
    overflow group's added into its experts' rows (index_add_): no whole-card gradient per group."""

    @staticmethod
    def forward(ctx, w_EIO: Tensor, experts_G: Tensor, sizes: list[int], x_ECI: Tensor, *x_groups: Tensor):
        w_GIO = w_EIO.index_select(0, experts_G) if x_groups else None
        ctx.save_for_backward(w_EIO, experts_G, x_ECI, *x_groups)
        ctx.sizes = sizes
        return _layer_products(w_EIO, w_GIO, sizes, x_ECI, x_groups)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        w_EIO, experts_G, x_ECI, *x_groups = ctx.saved_tensors
        grads = tuple(g.contiguous() for g in grads)
        w_GIO = w_EIO.index_select(0, experts_G) if x_groups else None  # again: gathered weights are not kept
        grad_w = torch.bmm(x_ECI.transpose(1, 2), grads[0])  # [E, I, O]
        if x_groups:
            grad_groups = [torch.bmm(x.transpose(1, 2), g) for x, g in zip(x_groups, grads[1:])]
            grad_w.index_add_(0, experts_G, torch.cat(grad_groups))
        return (grad_w, None, None, *_layer_input_grads(w_EIO, w_GIO, ctx.sizes, grads))


class _RebuiltLayeredBmm(torch.autograd.Function):
    """`layered_bmm` on a rebuilt (frozen) stack: the card made once, the groups' experts taken from it."""

    @staticmethod
    def forward(ctx, weight: RebuiltWeight, experts_G: Tensor, sizes: list[int], x_ECI: Tensor, *x_groups: Tensor):
        ctx.card = x_ECI.shape[1] > 0  # without a card layer, only the groups' experts are made
        w, memo = _make(weight, None if ctx.card else experts_G, together=True)
        ctx.save_for_backward(experts_G)
        ctx.weight, ctx.memo, ctx.sizes = weight, memo, sizes
        return _layer_products(*_card_and_groups(w, ctx.card, experts_G), sizes, x_ECI, x_groups)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        (experts_G,) = ctx.saved_tensors
        w = _for_backward(ctx.weight, None if ctx.card else experts_G, ctx.memo)
        w_EIO, w_GIO = _card_and_groups(w, ctx.card, experts_G)
        grads = tuple(g.contiguous() for g in grads)
        return (None, None, None, *_layer_input_grads(w_EIO, w_GIO, ctx.sizes, grads))


def _card_and_groups(w: Tensor, card: bool, experts_G: Tensor) -> tuple[Tensor | None, Tensor]:
    """(the card's weights, the groups' weights) from what a rebuilt weight made: the whole card (the
    groups' experts taken from it), or only the groups' experts (the card layer is empty: None)."""
    return (w, w.index_select(0, experts_G)) if card else (None, w)


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
    def forward(ctx, x_RI: Tensor, offs_E: Tensor, weight: RebuiltWeight) -> Tensor:
        w_EIO, memo = _make(weight, None, together=False)
        ctx.save_for_backward(offs_E)
        ctx.weight, ctx.memo = weight, memo
        return GROUPED_MM(x_RI, w_EIO, offs=offs_E)

    @staticmethod
    def backward(ctx, grad_RO: Tensor):
        (offs_E,) = ctx.saved_tensors
        w_EIO = _for_backward(ctx.weight, None, ctx.memo)
        return GROUPED_MM(grad_RO.contiguous(), w_EIO.transpose(1, 2), offs=offs_E), None, None


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
