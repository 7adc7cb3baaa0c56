"""Row checkpointing, applied from outside the model, and what a row's replay must not redo.

`apply_row_checkpointing(model)` wraps every row's forward in
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the forward keeps only each row's
input, and backward recomputes the row (the *replay*) just before it needs the row's saved tensors.
Anything a row computes that is not a pure function of its inputs must not change in the replay:
the experts it chose (ties, a selection bias that moved, a count reduced over ranks). `remember`
keeps such a value from the forward for the replay; outside row checkpointing it just computes.

The replay is told apart from the forward by checkpoint's `context_fn`: one context around the
forward, another around the recompute, both sharing one `RowMemo` made for that row's call.
The recompute runs while the caller's thread waits in backward, so one module-level slot for the
active memo is enough (and torch.compile can read it).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Hashable, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["RowMemo", "active_memo", "apply_row_checkpointing", "remember"]

T = TypeVar("T")


class RowMemo:
    """One checkpointed row call's values kept from its forward for its replay (each read once)."""

    def __init__(self) -> None:
        self.values: dict[Hashable, Any] = {}
        self.replaying = False


class _Active:
    _memo: RowMemo | None = None


def active_memo() -> RowMemo | None:
    """The memo of the checkpointed row running now (forward or replay); None outside one."""
    return _Active._memo


@contextlib.contextmanager
def _activate(memo: RowMemo, replaying: bool):
    previous = _Active._memo
    _Active._memo, memo.replaying = memo, replaying
    try:
        yield
    finally:
        _Active._memo = previous


def remember(key: Hashable, compute: Callable[[], T]) -> T:
    """compute(), kept under `key` for the replay of the row running now; in that replay, the kept value.

    `key` must be unique within a row call (e.g. `(module, "name")`).
    """
    memo = _Active._memo
    if memo is None:
        return compute()
    if memo.replaying and key in memo.values:
        return memo.values.pop(key)
    value = compute()
    if not memo.replaying:
        memo.values[key] = value
    return value


def _row_contexts():
    memo = RowMemo()
    return _activate(memo, replaying=False), _activate(memo, replaying=True)


def apply_row_checkpointing(model: torch.nn.Module) -> int:
    """Recompute every row of `model` in backward; returns how many rows were wrapped.

    Only calls that record a graph are checkpointed (evaluation and writing run as before). The
    module's parameters and state dict are untouched: only each row's bound `forward` is replaced.
    """
    wrapped = 0
    for row in model.rows:
        if getattr(row, "checkpointed", False):
            continue
        inner = row.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=_row_contexts, **kwargs)

        row.forward = forward
        row.checkpointed = True
        wrapped += 1
    return wrapped
