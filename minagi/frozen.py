"""Frozen expert stacks: NF4 (or plain bf16) buffers that never train, LoRA adapters that do.

Shape legend: E experts, I a stack's input width, O its output width (gate_up: D -> 2F, down:
F -> D), S chosen experts, r the LoRA rank.

`FrozenExpertStack` replaces a pool's trainable `ExpertStack` through the expert-weights seam
(minagi/experts.py, which builds it): `weights(dtype)` gives `mm.RebuiltWeight`s (the stack
dequantized at each use, never kept, with its LoRA pair), which every dispatch path multiplies
through minagi/mm.py unchanged; `weights(dtype, experts=ids)` gives the chosen experts dequantized
(writing). The stacks are buffers: no gradient, no optimizer state.

A frozen stack is given, when it is built, everything it depends on: its byte source (`ResidentBytes`,
or an offload stager's `StagedBytes`: minagi/offload.py), its replay pin policy (under row
checkpointing: minagi/recompute.py `PinPolicy`), its dequant backend and its name in the model. Every
dequant is counted by phase (forward / replay / backward) in the stack's `DequantStats`.

The pin's decision: on the paths that multiply a row's gate_up and down together (grouped, loop,
rectangle: `mm.layered_bmm`, `group_bmm`), one decision for the row, taken on gate_up's whole stack; down keeps its
replay's stack when gate_up did. On the native path (`grouped_mm`) each projection decides alone,
on its own whole stack. The floor and the fit check always see whole stacks, so a stack does not
pin one step and recompute the next because of its routing.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn as nn
from torch import Tensor

from . import recompute
from .config import ExpertsConfig
from .mm import RebuiltWeight
from .nf4 import NF4Packed, dequantize_nf4, dequantize_rows, double_quantize_absmax, quantize_nf4, select_dequant

__all__ = ["DequantStats", "FrozenExpertStack", "FrozenStack", "ResidentBytes", "dequant_summary", "frozen_stacks"]

PHASES = ("forward", "replay", "backward")
_INIT_CHUNK = 1 << 24  # weights drawn and quantized per pass when a stack is initialised


class DequantStats:
    """Dequants of one stack since the last `take`, by phase; `pinned`: replays that kept theirs.
    With `timing` on (benchmarks), each dequant's GPU time is taken with CUDA events: `ms`."""

    def __init__(self) -> None:
        self.timing = False
        self.take()

    def take(self) -> dict:
        out = dict(getattr(self, "counts", {}), pinned=getattr(self, "pinned", 0))
        events = getattr(self, "events", [])
        if events:
            events[-1][1].synchronize()
            out["ms"] = sum(a.elapsed_time(b) for a, b in events)
        self.counts = dict.fromkeys(PHASES, 0)
        self.pinned, self.events = 0, []
        return out

    def timed(self, device: torch.device):
        """A context that times the dequant inside it when `timing` is on."""
        return _Timed(self.events, device) if self.timing and device.type == "cuda" else contextlib.nullcontext()


class _Timed:
    def __init__(self, events: list, device: torch.device):
        self.events, self.device = events, device

    def __enter__(self):
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.start.record(torch.cuda.current_stream(self.device))

    def __exit__(self, *exc):
        self.end.record(torch.cuda.current_stream(self.device))
        self.events.append((self.start, self.end))


class FrozenStack(nn.Module):
    """One frozen stack [E, I, O]: NF4 buffers (`quant="nf4"`) or a bf16 buffer (`"none"`)."""

    _NF4_NAMES = ("packed", "absmax", "absmax_q", "absmax2", "offset")

    def __init__(self, shape: tuple[int, int, int], cfg: ExpertsConfig, device: torch.device | str,
                 name: str = "stack"):
        super().__init__()
        self.shape, self.quant, self.blocksize = tuple(shape), cfg.quant, cfg.blocksize
        self.name = name  # its place in the model, for logs
        self.stats = DequantStats()
        self.compute_device = torch.device(device)
        self.backend = select_dequant(device)
        # offload = "cpu": the buffers are homes in pinned CPU memory (pinned once, here), staged to the
        # compute device per use through the byte source the builder gives (minagi/offload.py).
        self.offloaded = cfg.offload == "cpu"
        self.source = ResidentBytes(self)
        device = torch.device("cpu") if self.offloaded else self.compute_device
        pin = self.offloaded and torch.cuda.is_available()  # pinning needs a CUDA driver; tests stage CPU to CPU
        empty = (lambda *a, **k: torch.empty(*a, **k).pin_memory()) if pin else torch.empty
        if self.quant == "none":
            self.register_buffer("weight", empty(shape, dtype=torch.bfloat16, device=device))
            return
        n = math.prod(shape)
        if (n // shape[0]) % (2 * cfg.blocksize):
            raise ValueError(f"experts.blocksize = {cfg.blocksize}: an expert of {shape[1]} x {shape[2]} weights "
                             f"must hold a multiple of 2 x blocksize, so experts own whole blocks")
        nb = n // cfg.blocksize
        self.register_buffer("packed", empty(n // 2, dtype=torch.uint8, device=device))
        if cfg.double_quant:
            self.register_buffer("absmax_q", empty(nb, dtype=torch.uint8, device=device))
            self.register_buffer("absmax2", empty(-(-nb // 256), dtype=torch.float32, device=device))
            self.register_buffer("offset", empty((), dtype=torch.float32, device=device))
        else:
            self.register_buffer("absmax", empty(nb, dtype=torch.float32, device=device))

    def _apply(self, fn, recurse=True):
        # model.to(device) must not pull an offloaded stack's homes onto the GPU.
        return self if self.offloaded else super()._apply(fn, recurse)

    @property
    def n_experts(self) -> int:
        return self.shape[0]

    def stack_numel(self) -> int:
        """Weights the stack stands for (E x I x O)."""
        return math.prod(self.shape)

    def stored(self) -> dict[str, Tensor]:
        """The stored tensors by name (on their home: the compute device, or pinned CPU memory)."""
        return {k: getattr(self, k) for k in (*self._NF4_NAMES, "weight") if hasattr(self, k)}

    def nf4(self, phase: str | None = None, in_place: bool = False) -> NF4Packed:
        """The stored NF4 tensors as the compute device reads them, from the byte source: resident, a
        stager's slot (offloaded), or the homes read in place (`in_place`: a dequant of chosen experts
        that reads only their bytes)."""
        tensors = self.source.in_place() if in_place else self.source.fetch(phase)
        return NF4Packed.from_tensors(tensors, self.shape, self.blocksize)

    def stored_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.stored().values())

    @torch.no_grad()
    def load_weights(self, w: Tensor) -> None:
        """Quantize (or copy) full-precision weights [E, I, O] into the buffers, experts in chunks."""
        if tuple(w.shape) != self.shape:
            raise ValueError(f"shape {list(w.shape)} does not fit the frozen stack {list(self.shape)}")
        self._fill(lambda first, count: w[first:first + count])

    @torch.no_grad()
    def init_random(self, std: float, generator: torch.Generator) -> None:
        """Draw N(0, std) weights chunk by chunk (on the generator's device) and store them."""
        self._fill(lambda first, count: torch.randn((count, *self.shape[1:]), generator=generator,
                                                     device=generator.device) * std)

    def _fill(self, chunk_of: Callable[[int, int], Tensor]) -> None:
        """Store experts chunk by chunk, quantized on the compute device: never the whole stack in fp32
        at once. Experts own whole blocks, so the bytes equal quantizing the whole stack in one go."""
        per = math.prod(self.shape[1:])
        step = max(1, _INIT_CHUNK // per)
        absmax = None
        if self.quant == "nf4":
            absmax = self.absmax if hasattr(self, "absmax") else torch.empty(self.absmax_q.shape,
                                                                              device=self.absmax_q.device)
        half, blocks = per // 2, per // self.blocksize
        for first in range(0, self.n_experts, step):
            count = min(step, self.n_experts - first)
            chunk = chunk_of(first, count).float().to(self.compute_device)
            if self.quant == "none":
                self.weight[first:first + count] = chunk.to(torch.bfloat16)
                continue
            q = quantize_nf4(chunk, self.blocksize)
            self.packed[first * half:(first + count) * half] = q.packed.to(self.packed.device)
            absmax[first * blocks:(first + count) * blocks] = q.absmax.to(absmax.device)
        if self.quant == "nf4" and not hasattr(self, "absmax"):  # double quantization: once, over the stack
            for key, t in double_quantize_absmax(absmax.to(self.compute_device)).items():
                getattr(self, key).copy_(t)

    def dequantize(self, dtype: torch.dtype, experts: Tensor | None = None, phase: str | None = None,
                   in_place: bool = False) -> Tensor:
        """The stack (or experts `experts`) in `dtype`; counted under `phase` when given. `in_place`:
        chosen experts read where their bytes are homed (offloaded: across the bus, no staging)."""
        if phase is not None:
            self.stats.counts[phase] += 1
        if self.quant == "none":
            w = self.weight if experts is None else self.weight.index_select(0, experts)
            return w.to(dtype)
        q = self.nf4(phase, in_place=in_place and experts is not None)
        with self.stats.timed(self.compute_device):
            if experts is None:
                return dequantize_nf4(q, dtype, backend=self.backend)
            return dequantize_rows(q, experts, dtype, backend=self.backend)


class ResidentBytes:
    """A stack's byte source when its buffers live on the compute device: the buffers themselves."""

    def __init__(self, stack: FrozenStack):
        self.stack = stack

    def fetch(self, phase: str | None) -> dict[str, Tensor]:
        return self.stack.stored()

    def in_place(self) -> dict[str, Tensor]:
        return self.stack.stored()


class FrozenExpertStack(nn.Module):
    """A pool's experts, frozen: gate_up [E, D, 2F] and down [E, F, D] as `FrozenStack`s, and with
    `lora_rank` > 0 trainable adapters: W + (alpha / r) A B per expert, B starting at zero.

    A dequant makes only the experts it is asked for, so the grouped path multiplies a frozen stack by
    the experts it routes to and never makes idle ones: no card layer (`gather_rows` None).

    Built by minagi/experts.py `build_stack` with what it depends on: `pin` (the replay pin policy,
    under row checkpointing; None: never pin), `stager` (experts.offload = "cpu": the row's stacks are
    registered with it and read through it), `name` (its place in the model), `init` (False: the
    stacks are left to be loaded, by a resume or --init)."""

    def __init__(self, n_experts: int, d_model: int, d_expert: int, cfg: ExpertsConfig, device: torch.device | str,
                 *, init: bool = True, pin: recompute.PinPolicy | None = None, stager=None, name: str = "experts"):
        super().__init__()
        self.cfg, self.initialise, self.pin, self.name = cfg, init, pin, name
        self.gather_rows = None
        self.gate_up = FrozenStack((n_experts, d_model, 2 * d_expert), cfg, device, name=f"{name}.gate_up")
        self.down = FrozenStack((n_experts, d_expert, d_model), cfg, device, name=f"{name}.down")
        if stager is not None:
            self.gate_up.source, self.down.source = stager.add_row([self.gate_up, self.down])
        self.scale = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0
        if cfg.lora_rank:
            r = cfg.lora_rank
            self.lora_gate_up_a = nn.Parameter(torch.empty(n_experts, d_model, r, device=device))
            self.lora_gate_up_b = nn.Parameter(torch.empty(n_experts, r, 2 * d_expert, device=device))
            self.lora_down_a = nn.Parameter(torch.empty(n_experts, d_expert, r, device=device))
            self.lora_down_b = nn.Parameter(torch.empty(n_experts, r, d_model, device=device))

    @property
    def n_experts(self) -> int:
        return self.gate_up.n_experts

    def reset_parameters(self, std: float, down_std: float) -> None:
        """Random frozen weights (unless built to be loaded) and fresh adapters: A ~ N(0, 1/r), B = 0."""
        if self.initialise:
            g = torch.Generator(self.gate_up.compute_device)
            g.manual_seed(int(torch.randint(2**62, (1,))))  # from the global seed: the same run, the same stacks
            self.gate_up.init_random(std, g)
            self.down.init_random(down_std, g)
        if self.cfg.lora_rank:
            for a in (self.lora_gate_up_a, self.lora_down_a):
                nn.init.normal_(a, std=self.cfg.lora_rank ** -0.5)
            for b in (self.lora_gate_up_b, self.lora_down_b):
                nn.init.zeros_(b)

    def _lora(self, which: str, dtype: torch.dtype, experts: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
        if not self.cfg.lora_rank:
            return None
        a, b = getattr(self, f"lora_{which}_a"), getattr(self, f"lora_{which}_b")
        if experts is not None:
            a, b = a.index_select(0, experts), b.index_select(0, experts)
        return a.to(dtype), b.to(dtype)

    def weights(self, dtype: torch.dtype, experts: Tensor | None = None, *, in_place: bool = False):
        """(gate_up, down): all experts as `RebuiltWeight`s for the dispatch paths; or, with `experts`
        (int64 [S]), those experts dequantized with their adapters merged, [S, D, 2F] and [S, F, D].
        `in_place`: the experts a dequant reads come from where they are homed, not from a staged
        row (writing with offloaded stacks; the whole card of the native path is always staged)."""
        if experts is None:
            return self._rebuilt("gate_up", dtype, in_place), self._rebuilt("down", dtype, in_place)
        out = []
        for which in ("gate_up", "down"):
            w = getattr(self, which).dequantize(dtype, experts, in_place=in_place)
            lora = self._lora(which, dtype, experts)
            out.append(w if lora is None else w + self.scale * torch.bmm(*lora))
        return tuple(out)

    def _rebuilt(self, which: str, dtype: torch.dtype, in_place: bool) -> RebuiltWeight:
        stack = getattr(self, which)
        return RebuiltWeight(make=lambda experts, phase: stack.dequantize(dtype, experts, phase, in_place),
                             keep=lambda together: self._keep(which, dtype, together),
                             slot=(id(self), which), lora=self._lora(which, dtype), scale=self.scale)

    def _keep(self, which: str, dtype: torch.dtype, together: bool) -> bool:
        """The replay pin's decision for `which` in the replay running now (module docstring)."""
        if self.pin is None:
            return False
        stack = getattr(self, which)
        if together and which == "down":  # the row's decision, taken by gate_up in this same replay
            kept = (id(self), "gate_up") in recompute.active_memo().slots
        else:
            whole = self.gate_up if together else stack
            nbytes = whole.stack_numel() * dtype.itemsize
            kept = self.pin.decide(self.name if together else stack.name, nbytes, stack.compute_device)
        stack.stats.pinned += kept
        return kept


def frozen_stacks(model: nn.Module) -> dict[str, FrozenStack]:
    """Every frozen stack of `model` by its name in the state dict."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FrozenStack)}


def dequant_summary(model: nn.Module, steps: int) -> dict | None:
    """Dequants per training step since the last call, summed over the frozen stacks, by phase, with
    `pinned` (replays that kept their stack) and `stacks` (how many frozen stacks): per stack and
    row, forward + replay + backward is 3 under row checkpointing without the pin, 2 with it.
    None when the model has no frozen stacks. Resets the counts."""
    stacks = frozen_stacks(model)
    if not stacks:
        return None
    totals = dict.fromkeys((*PHASES, "pinned"), 0)
    for stack in stacks.values():
        for key, n in stack.stats.take().items():
            totals[key] = totals.get(key, 0) + n  # "ms" only when timed
    return {**{k: v / max(1, steps) for k, v in totals.items()}, "stacks": len(stacks)}
