"""The MLP contract: what a row's MLP (pooled experts or the dense twin) returns, and the one rule for
the dtype matmuls compute in.

Shape legend: E experts.

A row's MLP is called `mlp(x_ND, dropless=...) -> (y_ND, MLPAux)`. `MLPAux` carries the call's aux
loss (already weighted: add it to the training loss) and its routing counts (`RouteCounts`, None for
a dense MLP); the MLP keeps nothing from a call, so whoever runs it decides what counts (the trainer
adds a training step's counts once; evaluation and writing drop them).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["MLPAux", "RouteCounts", "compute_dtype", "device_compute_dtype"]


class RouteCounts(NamedTuple):
    """One pool call's routing, for the diagnostics and the aux-free bias."""
    load_E: Tensor       # routed rows per expert before capacity, int64 (on the device)
    dropped: Tensor | None  # rows dropped by capacity, int64 scalar on the device (None: uncapped)
    chars: int           # characters routed
    padded_rows: int     # rows the dispatch path computed (padding included)
    path: str            # the dispatch path that ran


class MLPAux(NamedTuple):
    loss: Tensor                  # fp32 scalar, already weighted: add it to the training loss
    counts: RouteCounts | None    # None for a dense MLP


def device_compute_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype a model computes its matmuls in on `device`: bf16 on CUDA (autocast there), fp32
    elsewhere (CPU bf16 is slow and would change the golden run)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype matmuls run in for input `x`: autocast's where it is on (bmm / grouped_mm take
    explicit casts), else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
