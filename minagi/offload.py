"""CPU offload of frozen expert stacks: pinned CPU homes, staged to the GPU row by row, with prefetch.

Shape legend: L rows, two stacks a row (gate_up, down), each a dict of NF4 tensors.

`attach_offload(model, device)` gives every frozen stack of `model` (homed in pinned CPU memory by
`experts.offload = "cpu"`) one `OffloadStager`. A stack asks the stager for its tensors whenever it
dequantizes (forward, checkpoint replay, backward); the stager keeps two preallocated GPU slots:
the row in use and the next one. When row i is fetched, row i+1 (forward) or i-1 (replay and
backward run the rows in reverse) is copied into the other slot on a side stream, from pinned
memory, while row i computes. Ordering is by CUDA events, not `record_stream`: the compute stream
waits for a slot's copy before reading it, and the copy stream waits until the compute stream has
finished reading a slot before overwriting it. Nothing depends on a hook after a row (a replay
that stops early simply fetches again), and no autograd Function holds a staged tensor: what stays
alive is the dequantized stack a matmul needs, never a slot.

Figures per step (`take_stats`): bytes copied host to device, the time the compute stream waited
for copies (the H2D time compute did not hide), and the slots' resident bytes.

Writing reads fewer experts than a row holds: with `read_chosen` set (minagi/sampling.py decides),
a stack's chosen experts are read straight from its pinned home by the dequant kernel, through a
device alias of the host memory (`host_alias`: unified addressing, no copy call, no host sync), so
only the chosen experts' bytes cross the bus and the step stays capturable in a CUDA graph.
"""
from __future__ import annotations

import re
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["OffloadStager", "attach_offload", "host_alias", "offload_summary"]

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


class OffloadStager:
    """Two GPU slots for L rows of frozen stacks; `fetch(stack, phase)` -> the stack's tensors on the GPU."""

    def __init__(self, rows: list[list], device: torch.device, prefetch: bool = True):
        self.rows, self.device, self.prefetch = rows, torch.device(device), prefetch
        self.row_of = {id(stack): (r, j) for r, stacks in enumerate(rows) for j, stack in enumerate(stacks)}
        # Every row's stacks have the shapes of row 0's: one slot fits any row. Without prefetch, one slot.
        n_slots = 2 if prefetch else 1
        self.slots = [[{k: torch.empty_like(t, device=self.device) for k, t in s.stored().items()} for s in rows[0]]
                      for _ in range(n_slots)]
        self.slot_row: list[int | None] = [None] * n_slots
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.copied = [self._event(), self._event()]  # the slot's copy is done
        self.read = [self._event(), self._event()]    # the compute stream is done with the slot
        self.bytes_copied, self.waits = 0, []
        self.timing, self.copies = False, []  # timing (benchmarks): each row copy's events on the copy stream
        self.read_chosen = False  # writing: chosen experts read from the homes in place (`chosen_source`)
        self._aliases: dict[int, dict[str, Tensor]] = {}

    def _event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.device.type == "cuda" else None

    @property
    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.slots for stack in slot for t in stack.values())

    def fetch(self, stack, phase: str | None) -> dict[str, Tensor]:
        row, j = self.row_of[id(stack)]
        slot = self._stage(row)
        self._wait_for(slot)
        if self.prefetch:
            ahead = row + 1 if phase in (None, "forward") else row - 1
            if 0 <= ahead < len(self.rows):
                self._stage(ahead)
        return self.slots[slot][j]

    def chosen_source(self, stack) -> dict[str, Tensor]:
        """The stack's homes as device tensors (aliases of the pinned memory, made once): a dequant of
        chosen experts reads only their bytes from them, across the bus."""
        if id(stack) not in self._aliases:
            self._aliases[id(stack)] = {k: host_alias(t, self.device) for k, t in stack.stored().items()}
        return self._aliases[id(stack)]

    def _stage(self, row: int) -> int:
        """The slot holding `row`, its copy issued if it was not there (evicting the other row)."""
        if row in self.slot_row:
            return self.slot_row.index(row)
        current = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        empty = [s for s, r in enumerate(self.slot_row) if r is None]
        slot = empty[0] if empty else self._victim(row)
        if current is not None:
            self.read[slot].record(current)  # reads of the evicted row queued so far
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.read[slot])
                start = self._event(timing=True) if self.timing else None
                if start is not None:
                    start.record(self.copy_stream)
                self._copy(row, slot)
                self.copied[slot].record(self.copy_stream)
                if start is not None:
                    end = self._event(timing=True)
                    end.record(self.copy_stream)
                    self.copies.append((start, end))
        else:
            self._copy(row, slot)
        self.slot_row[slot] = row
        return slot

    def _victim(self, row: int) -> int:
        """Evict the slot whose row is farther from `row` (the one the run has left behind)."""
        return max(range(len(self.slots)), key=lambda s: abs(self.slot_row[s] - row))

    def _copy(self, row: int, slot: int) -> None:
        for stack, target in zip(self.rows[row], self.slots[slot]):
            for key, home in stack.stored().items():
                target[key].copy_(home, non_blocking=True)
                self.bytes_copied += home.numel() * home.element_size()

    def _wait_for(self, slot: int) -> None:
        if self.copy_stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        before, after = self._event(timing=True), self._event(timing=True)
        before.record(current)
        current.wait_event(self.copied[slot])
        after.record(current)
        self.waits.append((before, after))  # after - before: how long compute stood waiting for the copy

    def take_stats(self) -> dict:
        """Since the last call: H2D bytes, the waited milliseconds (synchronizes), resident bytes."""
        if self.waits:
            self.waits[-1][1].synchronize()
        waited = sum(a.elapsed_time(b) for a, b in self.waits)
        out = {"h2d_bytes": self.bytes_copied, "h2d_exposed_ms": waited, "resident_bytes": self.resident_bytes}
        if self.copies:
            self.copies[-1][1].synchronize()
            out["h2d_copy_ms"] = sum(a.elapsed_time(b) for a, b in self.copies)
        self.bytes_copied, self.waits, self.copies = 0, [], []
        return out


def _rows(model: torch.nn.Module) -> Iterator[tuple[int, list]]:
    from .frozen import frozen_stacks
    by_row: dict[int, list] = {}
    for name, stack in frozen_stacks(model).items():
        match = re.match(r"rows\.(\d+)\.", name)
        if match and stack.offloaded:
            by_row.setdefault(int(match.group(1)), []).append(stack)
    for row in sorted(by_row):
        yield row, by_row[row]


def attach_offload(model: torch.nn.Module, device: torch.device, prefetch: bool = True) -> OffloadStager:
    """One stager for every offloaded frozen stack of `model`, computing on `device`. On the CPU the
    stacks are copied into the slots all the same (the path the CPU tests run; no memory is saved)."""
    device = torch.device(device)
    rows = [stacks for _, stacks in _rows(model)]
    if not rows:
        raise ValueError("experts.offload = \"cpu\" found no offloaded frozen stacks in the model "
                         "(set experts.frozen = true)")
    stager = OffloadStager(rows, device, prefetch)
    for stacks in rows:
        for stack in stacks:
            stack.stager = stager
    return stager


def offload_summary(stager: OffloadStager | None, steps: int) -> dict | None:
    """For the history: H2D bytes and the milliseconds compute waited for copies, per step since the
    last call; the slots' bytes. None without offload."""
    if stager is None:
        return None
    s = stager.take_stats()
    return {"h2d_bytes_per_step": s["h2d_bytes"] / max(1, steps), "h2d_exposed_ms_per_step":
            s["h2d_exposed_ms"] / max(1, steps), "resident_expert_bytes": s["resident_bytes"]}
