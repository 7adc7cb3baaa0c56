"""Sink diagnostics: routing counts of training steps, summed per row until a record reads them.

Shape legend: L pooled rows, E experts.

The pools return their counts (minagi/mlp.py `RouteCounts`); the trainer hands one training step's
counts to `RoutingMeter.add` once — summed over ranks already under DDP, with the step's loss in one
all-reduce (`reduce_over_ranks`) — so a row recomputed in
backward, an evaluation or a sampling call never counts. The meter is part of the checkpointed
training state: a record after a resume covers the same steps as its train loss.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .distributed import all_reduce_sum
from .mlp import RouteCounts

__all__ = ["RoutingMeter", "StepCounts", "max_vio", "mean_max_vio", "reduce_over_ranks", "step_counts", "summarise"]


class StepCounts:
    """One step's counts of every pooled row: loads [L, E] and dropped [L] on the device; chars and
    padded rows [L] as host ints; the dispatch path of each row."""

    def __init__(self, load_LE: Tensor, dropped_L: Tensor, chars: list[int], padded: list[int], paths: list[str]):
        self.load_LE, self.dropped_L = load_LE, dropped_L
        self.chars, self.padded, self.paths = chars, padded, paths


def step_counts(per_row: Sequence[RouteCounts | None]) -> StepCounts | None:
    """The pooled rows' counts of one forward as one StepCounts; None for a model without pools."""
    rows = [c for c in per_row if c is not None]
    if not rows:
        return None
    load_LE = torch.stack([c.load_E for c in rows])
    dropped = [c.dropped for c in rows]
    dropped_L = (torch.stack([d if d is not None else load_LE.new_zeros(()) for d in dropped])
                 if any(d is not None for d in dropped) else load_LE.new_zeros(len(rows)))
    return StepCounts(load_LE, dropped_L, [c.chars for c in rows], [c.padded_rows for c in rows],
                      [c.path for c in rows])


def reduce_over_ranks(stats: Tensor, counts: StepCounts | None, world_size: int) -> tuple[list[float], StepCounts | None]:
    """(mean loss, aux, grad norm over ranks, the routing counts summed over ranks): one all-reduce.

    (The gradient norm is already the same everywhere: DDP averaged the gradients.)
    """
    if world_size == 1:
        return stats.tolist(), counts
    parts = [stats.double()]
    if counts is not None:
        host = torch.tensor(counts.chars + counts.padded, dtype=torch.float64)
        host = host.pin_memory().to(stats.device, non_blocking=True) if stats.is_cuda else host
        parts += [counts.load_LE.flatten().double(), counts.dropped_L.double(), host]
    summed = all_reduce_sum(torch.cat(parts))
    values = summed.tolist()
    means = [v / world_size for v in values[:3]]
    if counts is None:
        return means, None
    n_rows, n_experts = counts.load_LE.shape
    load_LE, dropped_L = summed[3:3 + n_rows * n_experts], summed[3 + n_rows * n_experts:3 + n_rows * (n_experts + 1)]
    host_values = [int(v) for v in values[3 + n_rows * (n_experts + 1):]]
    return means, StepCounts(load_LE.view(n_rows, n_experts).long(), dropped_L.long(), host_values[:n_rows],
                             host_values[n_rows:], counts.paths)


class RoutingMeter:
    """Sums of StepCounts since the last `read`; `state_dict` / `load_state_dict` for checkpoints."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.load_LE: Tensor | None = None
        self.dropped_L: Tensor | None = None
        self.chars: list[int] = []
        self.padded: list[int] = []
        self.paths: list[str] = []

    def add(self, step: StepCounts | None) -> None:
        if step is None:
            return
        if self.load_LE is None:
            self.load_LE, self.dropped_L = step.load_LE.clone(), step.dropped_L.clone()
            self.chars, self.padded = list(step.chars), list(step.padded)
        else:
            self.load_LE += step.load_LE
            self.dropped_L += step.dropped_L
            self.chars = [a + b for a, b in zip(self.chars, step.chars)]
            self.padded = [a + b for a, b in zip(self.padded, step.padded)]
        self.paths = list(step.paths)

    def read(self, sink_ratio: float, reset: bool = True) -> list[dict]:
        """Each pooled row's diagnostics as plain Python numbers (one host sync); [] before any step."""
        if self.load_LE is None:
            return []
        loads, dropped = self.load_LE.tolist(), self.dropped_L.tolist()
        out = [{"row": i, **summarise(load, d, c, p, path, sink_ratio)}
               for i, (load, d, c, p, path) in enumerate(zip(loads, dropped, self.chars, self.padded, self.paths))]
        if reset:
            self.reset()
        return out

    def state_dict(self) -> dict:
        if self.load_LE is None:
            return {}
        return {"load": self.load_LE.cpu(), "dropped": self.dropped_L.cpu(), "chars": list(self.chars),
                "padded": list(self.padded), "paths": list(self.paths)}

    def load_state_dict(self, state: dict, device: torch.device | str) -> None:
        self.reset()
        if state:
            self.load_LE, self.dropped_L = state["load"].to(device), state["dropped"].to(device)
            self.chars, self.padded, self.paths = list(state["chars"]), list(state["padded"]), list(state["paths"])


def summarise(load: list[int], dropped: int, chars: int, padded: int, path: str, sink_ratio: float) -> dict:
    """One row's sink diagnostics from its summed counts."""
    n_experts = len(load)
    routed = sum(load)
    fair = routed / n_experts if routed else 0.0
    top = max(range(n_experts), key=load.__getitem__)
    return {
        "path": path,
        "chars": chars,
        "routed": routed,
        "load": load,
        "fair_share": fair,
        "max_over_fair": load[top] / fair if fair else 0.0,
        "sinks": sum(1 for n in load if fair and n > sink_ratio * fair),
        "top_expert": top,
        # An expert is picked at most once per character, so its load counts characters.
        "top_share": load[top] / chars if chars else 0.0,
        "dead": sum(1 for n in load if n == 0) if routed else 0,
        "dropped_fraction": dropped / routed if routed else 0.0,
        "padding_ratio": padded / routed if routed else 0.0,
        "max_vio": max_vio(load),
    }


def max_vio(load: Sequence[int]) -> float:
    """MaxVio, the Loss-Free Balancing paper's measure of imbalance (Wang et al. 2024, arXiv 2408.15664):
    the busiest expert's load over the fair share (the mean load), minus 1. 0 when even, and when
    nothing was routed."""
    routed = sum(load)
    return max(load) * len(load) / routed - 1.0 if routed else 0.0


def mean_max_vio(rows: Sequence[dict]) -> float | None:
    """A record's MaxVio: the mean over its pooled rows (its `sinks`) of each row's MaxVio, from the
    row's loads (so histories written before the field existed read too); None without pools."""
    return sum(max_vio(r["load"]) for r in rows) / len(rows) if rows else None
