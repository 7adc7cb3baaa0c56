"""Row checkpointing, what a row's replay must not redo, and the replay pin.

A row built with `checkpoint_rows` runs its forward through `checkpointed(fn, ...)`:
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, so the forward keeps only the row's
input and backward recomputes the row (the *replay*) just before it needs the row's saved tensors.
Anything a row computes that is not a pure function of its inputs must not change in the replay:
the experts it chose (ties, a selection bias that moved, a count reduced over ranks). `remember`
keeps such a value from the forward for the replay; outside row checkpointing it just computes.

The replay is told apart from the forward by checkpoint's `context_fn`: one context around the
forward, another around the recompute, both sharing one `RowMemo` made for that row's call. The
memo of the row running now is a `ContextVar` owned by this module: each context sets it in the
thread that runs the row's code (the recompute runs on autograd's thread, inside its own context).

The replay pin: a frozen stack is dequantized in the forward, again in the replay and again in
backward. A `PinPolicy` says whether the replay's dequantized stack is kept in the row's memo
(`RowMemo.slots`, one-shot) for that row's backward: two dequants instead of three, the same bits.
Slots a backward did not take are cleared at the next step (`clear_stale_slots`).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import time
import weakref
from typing import Any, Callable, Hashable, Literal, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["PinPolicy", "RowMemo", "active_memo", "checkpointed", "clear_stale_slots", "cuda_headroom",
           "device_headroom", "remember"]

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
_ACTIVE: contextvars.ContextVar[RowMemo | None] = contextvars.ContextVar("minagi_row_memo", default=None)


def clear_stale_slots() -> int:
    """Drop every slot still held (a backward that stopped early); called as a step starts. The count."""
    dropped = 0
    for memo in list(_LIVE):
        dropped += len(memo.slots)
        memo.slots.clear()
    return dropped


def active_memo() -> RowMemo | None:
    """The memo of the checkpointed row running now (forward or replay); None outside one. Inside
    torch.compile there is none (a compiled step does not checkpoint rows): reading the ContextVar
    there would break the graph."""
    if torch.compiler.is_compiling():
        return None
    return _ACTIVE.get()


@contextlib.contextmanager
def _activate(memo: RowMemo, replaying: bool):
    token = _ACTIVE.set(memo)
    memo.replaying = replaying
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def remember(key: Hashable, compute: Callable[[], T]) -> T:
    """compute(), kept under `key` for the replay of the row running now; in that replay, the kept value.

    `key` must be unique within a row call (e.g. `(module, "name")`).
    """
    memo = active_memo()
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


def checkpointed(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) recomputed in backward (a row's forward); plain where no graph is recorded
    (evaluation, writing)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_row_contexts, **kwargs)


# ---------------------------------------------------------------------------- the replay pin

def cuda_headroom(device: torch.device) -> int:
    """Bytes a new tensor can take without the allocator asking the driver for more than it has:
    the driver's free memory plus what the allocator holds but does not use."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _host_available() -> int | None:
    """The host's available memory (Linux MemAvailable, else free pages); None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # Windows: no sysconf
        return None


def device_headroom(device: torch.device) -> int | None:
    """What a dequantized stack kept on `device` can take: the CUDA allocator's headroom on a GPU
    (ROCm too), the host's available memory on the CPU (a kept stack lives there). None: unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return cuda_headroom(device)
    return _host_available()


class PinPolicy:
    """Whether a row's replay keeps a dequantized stack for its backward, decided per stack and row.

    off: never. on: whenever it fits. auto: when the stack is at least `floor_bytes` (a small stack's
    dequant costs less than the memory it would hold) and it fits. Fits: headroom >= 2 x the stack's
    bytes (unsloth's rule), the headroom query cached for `cache_s` (a driver query per replay costs
    more than a small dequant); an unknown headroom fits. `nbytes` is always the whole stack's
    dequantized size, on every dispatch path, so the decision does not follow the step's routing.
    `headroom` is injectable (tests); `log` hears each stack's first decision and every change.
    """

    def __init__(self, mode: Literal["auto", "on", "off"] = "off", floor_bytes: int = 512 * 2**20,
                 headroom: Callable[[torch.device], int | None] = device_headroom, cache_s: float = 0.5,
                 log: Callable[[str], None] | None = None):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"replay pin mode must be auto, on or off; got {mode!r}")
        self.mode, self.floor_bytes, self.headroom, self.cache_s = mode, floor_bytes, headroom, cache_s
        self.log = log or (lambda msg: None)
        self.decisions: dict[str, bool] = {}
        self._cached: tuple[float, int | None] | None = None

    def decide(self, name: str, nbytes: int, device: torch.device) -> bool:
        if self.mode == "off":
            pin = False
        else:
            pin = (self.mode == "on" or nbytes >= self.floor_bytes) and self._fits(nbytes, device)
        if self.decisions.get(name) != pin:
            self.log(f"replay pin ({self.mode}): {name} ({nbytes / 2**20:.0f} MiB) "
                     f"{'pinned' if pin else 'recomputed'}")
        self.decisions[name] = pin
        return pin

    def _fits(self, nbytes: int, device: torch.device) -> bool:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > self.cache_s:
            self._cached = (now, self.headroom(device))
        room = self._cached[1]
        return room is None or room >= 2 * nbytes
