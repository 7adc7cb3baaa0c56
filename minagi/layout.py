"""The padded paths' layout, decided on the host from a call's loads: where each expert's rows go in the
padded buffer — a card layer (every expert at one capacity, the stack multiplied as it is) and at most
MAX_GROUPS overflow groups (the rows past the card of busier experts, their weights gathered).

Pure host arithmetic (numpy and lists): minagi/dispatch.py turns a layout into device tensors and bmms.

Shape legend: E experts, C a layer's capacity, M candidate card capacities.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["GATHER_ROWS", "GROUP_ROWS", "MAX_GROUPS", "SHAPE_ROWS", "Layout", "group_capacity", "layered_layout",
           "layout_runs", "overflow_starts", "round_capacity"]

# What gathering one overflow expert costs (its weights copied in forward and again in backward, its
# gradient added back into the card's), in padded rows of that expert it could have computed instead:
# ~14 I x O bytes against 6 I x O FLOPs a row, at the ~150 FLOP/byte of the cards this path serves.
GATHER_ROWS = 256
# What one more layer (an overflow group: its gathers, bmms, their backward) costs beyond its rows, in
# padded rows: the launches and their latency, at the scale of a consumer card's rows per 50 us.
GROUP_ROWS = 512
MAX_GROUPS = 4  # overflow groups of one call at most (each adds its launches, forward and backward)
# A bmm shape new to the process costs the host its kernel's choice: ~0.4 ms on average on an H100's
# host (some 3-5 ms), against ~25 us for a launch (docs/benchmarks.md section 33), and an overflow
# group's shapes change with the loads. So a group's capacity goes up to a power of two where that pads
# the group by at most SHAPE_ROWS rows: the small groups, whose capacities vary most, repeat their shapes
# (a group's bmm shape is its experts and its capacity: the capacity is the part that varied most).
SHAPE_ROWS = 512


def round_capacity(n: int) -> int:
    """A capacity for `n` rows: powers of two up to 16, then 8 steps a power of two (at most 12.5%
    padding, few sizes for the allocator). 0 stays 0."""
    if n <= 16:
        return 0 if n <= 0 else 1 << (n - 1).bit_length()
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def _round_capacities(n: np.ndarray) -> np.ndarray:
    """`round_capacity` of each element of an int array (a look-up in `_capacity_table`)."""
    n = np.asarray(n, dtype=np.int64)
    return _capacity_table(int(n.max()) if n.size else 0)[np.maximum(n, 0)]


_TABLE = np.zeros(1, dtype=np.int64)  # round_capacity(i) at i, grown by doubling (the layout runs every call)


def _capacity_table(largest: int) -> np.ndarray:
    """round_capacity of 0..largest (at least), made once for each doubling of the largest load seen."""
    global _TABLE
    if largest >= len(_TABLE):
        n = np.arange(max(2 * len(_TABLE), largest + 1), dtype=np.int64)
        bits = np.where(n > 1, np.ceil(np.log2(np.maximum(n, 1))), 0).astype(np.int64)  # 2^(bits-1) < n <= 2^bits
        step = np.left_shift(1, np.maximum(bits - 4, 0))
        _TABLE = np.where(n > 0, np.where(n <= 16, np.left_shift(1, bits), -(-n // step) * step), 0)
    return _TABLE


@dataclass(frozen=True)
class Layout:
    """Where each expert's kept rows go in the padded buffer, decided on the host (after the call's sync).

    The card layer: every expert at capacity `card`, multiplied as the whole stack at once (no weight
    gather; 0 = no card layer). Overflow groups: (capacity, experts) for the rows past `card` of
    experts with more (a sink), their weights gathered."""
    kept: tuple[int, ...]                         # kept rows per expert
    card: int
    groups: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def padded_rows(self) -> int:
        return len(self.kept) * self.card + sum(cap * len(members) for cap, members in self.groups)


def group_capacity(overflow: int, experts: int, shape_rows: int = SHAPE_ROWS) -> int:
    """An overflow group's capacity for its largest `overflow` over `experts` experts: `round_capacity`,
    or the power of two above it where that adds at most `shape_rows` padded rows to the group."""
    rounded = round_capacity(overflow)
    wide = 1 << (rounded - 1).bit_length() if rounded > 0 else 0
    return wide if experts * (wide - rounded) <= shape_rows else rounded


def layered_layout(kept: list[int], gather_rows: int | None = GATHER_ROWS, group_rows: int = GROUP_ROWS,
                   shape_rows: int = SHAPE_ROWS) -> Layout:
    """The layout that costs least — padded rows, plus `gather_rows` for each overflow expert and
    `group_rows` for each overflow group: the card capacity from the rounded loads (and none), judged
    with each overflow expert at its own rounded overflow; then the chosen card's overflow in groups,
    split where a split saves more rows than a group costs (at most MAX_GROUPS groups), each group at
    `group_capacity` (`shape_rows`: the padding a power of two may add to repeat a shape).
    `gather_rows` None: no card layer (a stack that makes only the experts it is asked for: frozen)."""
    kept = [int(n) for n in kept]
    loads = np.asarray(kept, dtype=np.int64)
    E = len(loads)
    cards = np.unique(np.concatenate([[0], _round_capacities(loads[loads > 0]) if gather_rows is not None else []]))
    over_ME = np.maximum(loads[None, :] - cards[:, None], 0)
    n_M = (over_ME > 0).sum(1)
    # The overflow's rows as if each expert had its own group (the split below comes close), and the
    # groups it will take.
    overflow_M = _round_capacities(over_ME).sum(1) + group_rows * np.minimum(n_M, MAX_GROUPS)
    m = int(np.argmin(E * cards + overflow_M + (gather_rows or 0) * n_M))
    card = int(cards[m])
    over_E = loads - card
    order = np.flatnonzero(over_E > 0)
    order = order[np.argsort(-over_E[order], kind="stable")].tolist()  # largest overflow first, ties by expert
    groups = []  # (capacity, experts): a group widened to the capacity of the one before joins it
    for lo, hi in _split_overflow([kept[e] - card for e in order], group_rows):
        capacity = group_capacity(kept[order[lo]] - card, hi - lo, shape_rows)
        if groups and groups[-1][0] == capacity:
            groups[-1] = (capacity, groups[-1][1] + order[lo:hi])
        else:
            groups.append((capacity, order[lo:hi]))
    return Layout(tuple(kept), card, tuple((capacity, tuple(sorted(members))) for capacity, members in groups))


def _split_overflow(over: list[int], group_rows: int, most: int = MAX_GROUPS) -> list[tuple[int, int]]:
    """Contiguous groups [lo, hi) of overflows sorted largest first, each costed at its first one's
    rounded overflow: split greedily where a split saves more padded rows than a group costs (the
    capacities the groups then take are `group_capacity`'s)."""
    if not over:
        return []
    caps = _round_capacities(np.asarray(over))
    groups = [(0, len(over))]
    while len(groups) < most:
        best = (group_rows, None)  # a split must save more than one group's cost
        for i, (lo, hi) in enumerate(groups):
            if hi - lo < 2:
                continue
            saved = (hi - np.arange(lo + 1, hi)) * (caps[lo] - caps[lo + 1:hi])  # split before each k
            k = int(np.argmax(saved))  # the first of the largest, as a scan in order would keep
            if saved[k] > best[0]:
                best = (int(saved[k]), (i, lo + 1 + k))
        if best[1] is None:
            break
        i, k = best[1]
        lo, hi = groups[i]
        groups[i:i + 1] = [(lo, k), (k, hi)]
    return groups


def overflow_starts(layout: Layout) -> tuple[list[int], list[int]]:
    """Host lists: where each expert's overflow rows start in the padded buffer (0 for an expert with
    none), and the overflow groups' experts in order (the weights the groups gather)."""
    starts, grouped, start = [0] * len(layout.kept), [], len(layout.kept) * layout.card
    for capacity, members in layout.groups:
        for e in members:
            starts[e], start = start, start + capacity
            grouped.append(e)
    return starts, grouped


def layout_runs(layout: Layout, overflow_start: list[int]) -> tuple[list[int], list[int]]:
    """Dropless rows in expert order as runs that each move into the padded buffer by one offset:
    expert e's first min(n_e, card) rows go to its card slots, the rest to its overflow slots.
    (The first sorted row of every run but the first, each run's offset = slot - sorted row), so a
    sorted row r's slot is r + offset[number of those firsts <= r]: three launches where positions
    and a per-expert table took seven. An empty run starts where the next one does, which the count
    passes over."""
    firsts, offsets, start = [], [], 0
    for e, n in enumerate(layout.kept):
        firsts.append(start)
        offsets.append(e * layout.card - start)
        if n > layout.card:
            firsts.append(start + layout.card)
            offsets.append(overflow_start[e] - layout.card - start)
        start += n
    return firsts[1:], offsets
