"""CPU offload of frozen expert stacks: pinned CPU homes, staged to the GPU row by row, with prefetch.

Shape legend: L rows, two stacks a row (gate_up, down), each a dict of NF4 tensors.

One `OffloadStager` serves a model. The model's builder registers each row's offloaded stacks with it
as the row is built (`add_row`), in row order, and gives each stack the `StagedBytes` it returns: the
stack's byte source. A stack asks its source for its tensors whenever it dequantizes (forward,
checkpoint replay, backward); the stager keeps two preallocated GPU slots: the row in use and the
next one. When row i is fetched, row i+1 (forward) or i-1 (replay and backward run the rows in
reverse) is copied into the other slot while row i computes. The copies and their ordering are a
`Copies`: on CUDA (`CudaCopies`) a side stream from pinned memory, ordered by events rather than
`record_stream` — the compute stream waits for a slot's copy before reading it, and the copy stream
waits until the compute stream has finished reading a slot before overwriting it; on the CPU
(`InlineCopies`) each copy runs at once. Nothing depends on a hook after a row (a replay that stops
early simply fetches again), and no autograd Function holds a staged tensor: what stays alive is the
dequantized stack a matmul needs, never a slot.

Figures per step (`take_stats`): bytes copied host to device, the time the compute stream waited
for copies (the H2D time compute did not hide), and the slots' resident bytes.

Writing reads fewer experts than a row holds: a dequant of chosen experts asked to read them in place
(`StagedBytes.in_place`: the decoder's choice, minagi/sampling.py) reads them straight from the pinned
homes through a device alias of the host memory (`host_alias`: unified addressing, no copy call, no
host sync), so only the chosen experts' bytes cross the bus and the step stays capturable in a CUDA
graph.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import Tensor

__all__ = ["Copies", "CudaCopies", "InlineCopies", "OffloadStager", "StagedBytes", "host_alias", "offload_summary"]

# __cuda_array_interface__ type strings; bf16 has none, so it travels as int16 and is viewed back.
_TYPESTR = {torch.uint8: "|u1", torch.int16: "<i2", torch.float32: "<f4"}


class _HostArray:
    """A pinned CPU tensor described as device memory (the CUDA array interface), for torch.as_tensor."""

    def __init__(self, home: Tensor):
        self.home = home  # kept alive as long as the alias is
        self.__cuda_array_interface__ = {"shape": tuple(home.shape), "typestr": _TYPESTR[home.dtype],
                                         "data": (home.data_ptr(), False), "version": 3}


def host_alias(home: Tensor, device: torch.device) -> Tensor:
    """`home` (pinned CPU memory) as a tensor on CUDA `device`, without a copy: kernels that read it
    read host memory across the bus (unified virtual addressing maps pinned memory into the device's
    address space). On a CPU compute device, the home itself."""
    device = torch.device(device)
    if device.type != "cuda":
        return home
    if not (home.is_pinned() and home.is_contiguous()):
        raise ValueError("host_alias needs contiguous pinned CPU memory (an offloaded stack's home)")
    flat = home.reshape(-1)
    store = flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat
    if store.dtype not in _TYPESTR:
        raise ValueError(f"host_alias: no device alias for {home.dtype} (NF4 homes are uint8 and float32)")
    alias = torch.as_tensor(_HostArray(store), device=device)
    if alias.data_ptr() != home.data_ptr():  # as_tensor copied (the memory is another device's): no alias
        raise ValueError(f"host_alias: the pinned memory is not addressable as {device}; "
                         f"use --offload-read rows")
    return alias.view(flat.dtype).view(home.shape)


# ---------------------------------------------------------------------------- copies and their order

class Copies(Protocol):
    """How the stager's copies run and are ordered against compute, slot by slot."""

    def released(self, slot: int) -> None:
        """Compute has queued its last read of `slot` (its row is about to be overwritten)."""

    def copy(self, slot: int, row: int, fill: Callable[[], None]) -> None:
        """Run `fill` (the copies of `row` into `slot`) once compute has released the slot."""

    def wait(self, slot: int) -> None:
        """Make compute wait until `slot`'s copy is done, before it reads the slot."""

    def take_ms(self) -> tuple[float, float | None]:
        """(ms compute waited for copies, ms the copies took or None) since the last call."""


class InlineCopies:
    """The CPU's: each copy runs at once, in order; nothing to wait for."""

    timing = False

    def released(self, slot: int) -> None:
        pass

    def copy(self, slot: int, row: int, fill: Callable[[], None]) -> None:
        fill()

    def wait(self, slot: int) -> None:
        pass

    def take_ms(self) -> tuple[float, float | None]:
        return 0.0, None


class CudaCopies:
    """Copies on a side stream from pinned memory, ordered against the compute stream by events (no
    `record_stream`). With `timing` (benchmarks) each copy's own time is taken too."""

    def __init__(self, device: torch.device, n_slots: int):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.copied = [torch.cuda.Event() for _ in range(n_slots)]  # the slot's copy is done
        self.read = [torch.cuda.Event() for _ in range(n_slots)]    # compute is done with the slot
        self.timing, self.waits, self.copies = False, [], []

    def _compute(self):
        return torch.cuda.current_stream(self.device)

    def released(self, slot: int) -> None:
        self.read[slot].record(self._compute())  # reads of the evicted row queued so far

    def copy(self, slot: int, row: int, fill: Callable[[], None]) -> None:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.read[slot])
            timed = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.timing else None
            if timed:
                timed[0].record(self.stream)
            fill()
            self.copied[slot].record(self.stream)
            if timed:
                timed[1].record(self.stream)
                self.copies.append(timed)

    def wait(self, slot: int) -> None:
        compute = self._compute()
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(self.copied[slot])
        after.record(compute)
        self.waits.append((before, after))  # after - before: how long compute stood waiting for the copy

    def take_ms(self) -> tuple[float, float | None]:
        copy_ms = None
        if self.waits:
            self.waits[-1][1].synchronize()
        waited = sum(a.elapsed_time(b) for a, b in self.waits)
        if self.copies:
            self.copies[-1][1].synchronize()
            copy_ms = sum(a.elapsed_time(b) for a, b in self.copies)
        self.waits, self.copies = [], []
        return waited, copy_ms


# ---------------------------------------------------------------------------- the stager

class StagedBytes:
    """An offloaded stack's byte source: its row's slot on the compute device (`fetch`), or its pinned
    homes as device tensors for a dequant of chosen experts that reads them in place (`in_place`)."""

    def __init__(self, stager: "OffloadStager", row: int, index: int, stack):
        self.stager, self.row, self.index, self.stack = stager, row, index, stack
        self._aliases: dict[str, Tensor] | None = None

    def fetch(self, phase: str | None) -> dict[str, Tensor]:
        return self.stager.fetch(self.row, self.index, phase)

    def in_place(self) -> dict[str, Tensor]:
        if self._aliases is None:  # made once: the homes never move
            self._aliases = {k: host_alias(t, self.stager.device) for k, t in self.stack.stored().items()}
        return self._aliases


class OffloadStager:
    """Slots on the compute device for L rows of offloaded stacks, registered row by row as the model
    is built; `fetch(row, j, phase)` -> stack j of that row's tensors on the device."""

    def __init__(self, device: torch.device, prefetch: bool = True, copies: Copies | None = None):
        self.device, self.prefetch = torch.device(device), prefetch
        self.n_slots = 2 if prefetch else 1  # without prefetch, one slot
        self.copies = copies if copies is not None else (
            CudaCopies(self.device, self.n_slots) if self.device.type == "cuda" else InlineCopies())
        self.rows: list[list] = []
        self.slots: list[list[dict[str, Tensor]]] = []  # made with the first row
        self.slot_row: list[int | None] = [None] * self.n_slots
        self.bytes_copied = 0

    def add_row(self, stacks: list) -> list[StagedBytes]:
        """Register the next row's offloaded stacks (in row order); their byte sources, in order.
        Every row's stacks have the shapes of the first row's, so one slot fits any row."""
        row = len(self.rows)
        self.rows.append(list(stacks))
        if row == 0:  # the slots, once (made here, not at a first use that may be under inference mode)
            self.slots = [[{k: torch.empty_like(t, device=self.device) for k, t in s.stored().items()}
                           for s in stacks] for _ in range(self.n_slots)]
        return [StagedBytes(self, row, j, stack) for j, stack in enumerate(stacks)]

    @property
    def timing(self) -> bool:
        return self.copies.timing

    @timing.setter
    def timing(self, on: bool) -> None:
        self.copies.timing = on

    @property
    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.slots for stack in slot for t in stack.values())

    def fetch(self, row: int, index: int, phase: str | None) -> dict[str, Tensor]:
        slot = self._stage(row)
        self.copies.wait(slot)
        if self.prefetch:
            ahead = row + 1 if phase in (None, "forward") else row - 1  # replay and backward run in reverse
            if 0 <= ahead < len(self.rows):
                self._stage(ahead, keep=slot)
        return self.slots[slot][index]

    def _stage(self, row: int, keep: int | None = None) -> int:
        """The slot holding `row`, its copy issued if it was not there (evicting another row, never the
        one in slot `keep`: the row the caller is about to read)."""
        if row in self.slot_row:
            return self.slot_row.index(row)
        empty = [s for s, r in enumerate(self.slot_row) if r is None]
        slot = empty[0] if empty else self._victim(row, keep)
        self.copies.released(slot)
        self.copies.copy(slot, row, lambda: self._fill(row, slot))
        self.slot_row[slot] = row
        return slot

    def _victim(self, row: int, keep: int | None) -> int:
        """Evict the slot whose row is farther from `row` (the one the run has left behind), not `keep`.
        (With rows 3 and 2 staged, a fetch of row 0 takes row 3's slot, and its prefetch of row 1 is as
        far from rows 0 and 2: without `keep` the tie evicted row 0 before it was read.)"""
        return max((s for s in range(self.n_slots) if s != keep), key=lambda s: abs(self.slot_row[s] - row))

    def _fill(self, row: int, slot: int) -> None:
        for stack, target in zip(self.rows[row], self.slots[slot]):
            for key, home in stack.stored().items():
                target[key].copy_(home, non_blocking=True)
                self.bytes_copied += home.numel() * home.element_size()

    def take_stats(self) -> dict:
        """Since the last call: H2D bytes, the waited milliseconds (synchronizes), resident bytes."""
        waited, copy_ms = self.copies.take_ms()
        out = {"h2d_bytes": self.bytes_copied, "h2d_exposed_ms": waited, "resident_bytes": self.resident_bytes}
        if copy_ms is not None:
            out["h2d_copy_ms"] = copy_ms
        self.bytes_copied = 0
        return out


def offload_summary(stager: OffloadStager | None, steps: int) -> dict | None:
    """For the history: H2D bytes and the milliseconds compute waited for copies, per step since the
    last call; the slots' bytes. None without offload."""
    if stager is None:
        return None
    s = stager.take_stats()
    return {"h2d_bytes_per_step": s["h2d_bytes"] / max(1, steps), "h2d_exposed_ms_per_step":
            s["h2d_exposed_ms"] / max(1, steps), "resident_expert_bytes": s["resident_bytes"]}
