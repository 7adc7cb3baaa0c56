"""Row checkpointing, applied from outside the model; what a row's replay must not redo; the replay pin.

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

The replay pin: a frozen stack is dequantized in the forward, again in the replay and again in
backward. A `PinPolicy` says whether the replay's dequantized stack is kept in the row's memo
(`RowMemo.slots`, one-shot) for that row's backward: two dequants instead of three, the same bits.
Slots a backward did not take are cleared at the next step (`clear_stale_slots`).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable, Hashable, Literal, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["PinPolicy", "RowMemo", "active_memo", "apply_row_checkpointing", "clear_stale_slots", "cuda_headroom",
           "remember"]

T = TypeVar("T")


class RowMemo:
    """One checkpointed row call's values kept from its forward for its replay (each read once), and
    the slots its replay fills for its backward (each taken once)."""

    def __init__(self) -> None:
        self.values: dict[Hashable, Any] = {}
        self.slots: dict[Hashable, torch.Tensor] = {}
        self.replaying = False
        _LIVE.add(self)


_LIVE: "weakref.WeakSet[RowMemo]" = weakref.WeakSet()  # memos whose graph may still hold them


def clear_stale_slots() -> int:
    """Drop every slot still held (a backward that stopped early); called as a step starts. The count."""
    dropped = 0
    for memo in list(_LIVE):
        dropped += len(memo.slots)
        memo.slots.clear()
    return dropped


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


# ---------------------------------------------------------------------------- the replay pin

def cuda_headroom(device: torch.device) -> int:
    """Bytes a new tensor can take without the allocator asking the driver for more than it has:
    the driver's free memory plus what the allocator holds but does not use."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class PinPolicy:
    """Whether a row's replay keeps a dequantized stack for its backward, decided per stack and row.

    on: always; off: never; auto: when the stack is at least `floor_bytes` (a small stack's
    dequant costs less than the memory it would hold) and it fits: headroom >= 2 x its bytes, the
    headroom query cached for `cache_s` (a driver query per replay costs more than a small dequant).
    `headroom` is injectable (tests); `log` hears each stack's first decision and every change.
    """

    def __init__(self, mode: Literal["auto", "on", "off"] = "off", floor_bytes: int = 512 * 2**20,
                 headroom: Callable[[torch.device], int] = cuda_headroom, cache_s: float = 0.5,
                 log: Callable[[str], None] | None = None):
        self.mode, self.floor_bytes, self.headroom, self.cache_s = mode, floor_bytes, headroom, cache_s
        self.log = log or (lambda msg: None)
        self.decisions: dict[str, bool] = {}
        self._cached: tuple[float, int] | None = None

    def decide(self, name: str, nbytes: int, device: torch.device) -> bool:
        if self.mode == "off":
            pin = False
        elif self.mode == "on":
            pin = True
        else:
            pin = nbytes >= self.floor_bytes and self._headroom(device) >= 2 * nbytes
        if self.decisions.get(name) != pin:
            self.log(f"replay pin ({self.mode}): {name} ({nbytes / 2**20:.0f} MiB) "
                     f"{'pinned' if pin else 'recomputed'}")
        self.decisions[name] = pin
        return pin

    def _headroom(self, device: torch.device) -> int:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > self.cache_s:
            self._cached = (now, self.headroom(device))
        return self._cached[1]
