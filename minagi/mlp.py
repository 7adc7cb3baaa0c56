"""The MLP contract: what a row's MLP (pooled experts or the dense twin) returns, and the one rule for
the dtype matmuls compute in.

Shape legend: E experts.

A row's MLP is called `mlp(x_ND, dropless=..., balance=BalanceArgs(...)) -> (y_ND, MLPAux)`. `MLPAux`
carries the call's aux loss (already weighted: add it to the training loss) and its routing counts
(`RouteCounts`, None for a dense MLP); the MLP keeps nothing from a call, so whoever runs it decides
what counts (the trainer adds a training step's counts once; evaluation and writing drop them).
`BalanceArgs` is what the balance term's scope needs beyond the call (a dense MLP ignores it).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .config import ConfigError

__all__ = ["PRECISIONS", "BalanceArgs", "MLPAux", "RouteCounts", "compute_dtype", "device_compute_dtype",
           "precision_dtype"]


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


class BalanceArgs(NamedTuple):
    """What a pool's balance term needs of the call beyond its characters (`pool.balance_scope`)."""
    sequences: int = 1                   # the call's characters are this many sequences of equal length
    step_counts_E: Tensor | None = None  # the whole optimizer step's routed rows per expert, summed over
    #                                      micro-batches and ranks (scope "step" with accumulation)


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def device_compute_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype a model computes its matmuls in on `device` (`train.precision = "auto"`): bf16 on a
    GPU with native bf16 (autocast there), fp32 elsewhere (CPU bf16 is slow and would change the golden
    run; a GPU without bf16 units, Turing or Volta, gets fp32 unless train.precision asks for fp16)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if _native_bf16(device) else torch.float32


def _native_bf16(device: torch.device) -> bool:
    if torch.version.hip:  # ROCm builds: every GPU torch supports computes bf16
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 0)


def precision_dtype(precision: str, device: torch.device | str) -> torch.dtype:
    """`train.precision` on `device` as the dtype autocast computes in ("auto": `device_compute_dtype`).
    ConfigError (one line naming the key) for bf16 on a GPU without it."""
    device = torch.device(device)
    if precision == "auto":
        return device_compute_dtype(device)
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision must be auto, bf16, fp16 or fp32; got {precision!r}", "train.precision")
    if precision == "bf16" and device.type == "cuda" and not _native_bf16(device):
        raise ConfigError(f"train.precision = \"bf16\": {torch.cuda.get_device_name(device)} has no native bf16; "
                          "use \"fp16\" (loss scaling) or \"fp32\"", "train.precision")
    return PRECISIONS[precision]


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype matmuls run in for input `x`: autocast's where it is on (bmm / grouped_mm take
    explicit casts), else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
