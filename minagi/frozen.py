"""Frozen expert stacks: NF4 (or plain bf16) buffers that never train, LoRA adapters that do, and
the matmuls that dequantize the stacks on the fly.

Shape legend: E experts, I a stack's input width, O its output width (gate_up: D -> 2F, down:
F -> D), S chosen experts, r the LoRA rank, R routed rows, G experts in a group, C its capacity.

`FrozenExpertStack` replaces a pool's trainable `ExpertStack` through the expert-weights seam
(minagi/experts.py): `weights(dtype)` gives `FrozenWeight`s, which bring their own `grouped_mm` /
`group_bmm`, so every dispatch path runs on them unchanged; `weights(dtype, experts=ids)` gives the
chosen experts dequantized (writing). The stacks are buffers: no gradient, no optimizer state.

Each matmul on a frozen stack is an autograd Function that saves only index tensors: the
dequantized stack is never kept for backward (as a saved tensor or a ctx attribute); backward
dequantizes again, or takes what the row's checkpoint replay pinned (minagi/recompute.py). Every
dequant is counted by phase (forward / replay / backward) in the stack's `DequantStats`.
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
from .dispatch import GROUPED_MM, group_bmm, grouped_mm
from .nf4 import NF4Packed, dequantize_nf4, dequantize_rows, double_quantize_absmax, quantize_nf4, select_dequant

__all__ = ["DequantStats", "FrozenExpertStack", "FrozenStack", "FrozenWeight", "dequant_summary", "frozen_stacks"]

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

    def __init__(self, shape: tuple[int, int, int], cfg: ExpertsConfig, device: torch.device | str):
        super().__init__()
        self.shape, self.quant, self.blocksize = tuple(shape), cfg.quant, cfg.blocksize
        self.name = "stack"  # its place in the model, for logs (set by frozen_stacks)
        self.stats = DequantStats()
        self.compute_device = torch.device(device)
        self.backend = select_dequant(device)
        # offload = "cpu": the buffers are homes in pinned CPU memory (pinned once, here), staged to the
        # compute device per use by a stager (minagi/offload.py) that `attach_offload` sets.
        self.offloaded = cfg.offload == "cpu"
        self.stager = None
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

    def nf4(self, phase: str | None = None, chosen: bool = False) -> NF4Packed:
        """The stored NF4 tensors on the compute device: staged a row at a time by the stager when
        offloaded, or, for a dequant of `chosen` experts while the stager reads those in place, the
        homes themselves (minagi/offload.py)."""
        if self.stager is None:
            tensors = self.stored()
        elif chosen and self.stager.read_chosen:
            tensors = self.stager.chosen_source(self)
        else:
            tensors = self.stager.fetch(self, phase)
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

    def dequantize(self, dtype: torch.dtype, experts: Tensor | None = None, phase: str | None = None) -> Tensor:
        """The stack (or experts `experts`) in `dtype`; counted under `phase` when given."""
        if phase is not None:
            self.stats.counts[phase] += 1
        if self.quant == "none":
            w = self.weight if experts is None else self.weight.index_select(0, experts)
            return w.to(dtype)
        q = self.nf4(phase, chosen=experts is not None)
        with self.stats.timed(self.compute_device):
            if experts is None:
                return dequantize_nf4(q, dtype, backend=self.backend)
            return dequantize_rows(q, experts, dtype, backend=self.backend)


def _phase() -> tuple[str, recompute.RowMemo | None]:
    memo = recompute.active_memo()
    return ("replay" if memo is not None and memo.replaying else "forward"), memo


def _materialize(weight: "FrozenWeight", experts: Tensor | None, memo, phase: str) -> Tensor:
    """Dequantize for a forward or a replay; a replay may pin the result for the row's backward."""
    w = weight.stack.dequantize(weight.dtype, experts, phase)
    if phase == "replay" and weight.pin is not None:
        if weight.pin.decide(weight.stack.name, w.numel() * w.element_size(), w.device):
            memo.slots[weight.slot_key] = w
            weight.stack.stats.pinned += 1
    return w


def _for_backward(weight: "FrozenWeight", experts: Tensor | None, memo) -> Tensor:
    """The pinned stack of this row's replay (taken: one-shot), else a fresh dequant."""
    w = memo.slots.pop(weight.slot_key, None) if memo is not None else None
    return w if w is not None else weight.stack.dequantize(weight.dtype, experts, "backward")


class _FrozenGroupedMM(torch.autograd.Function):
    """y = grouped_mm(x, W): [R, I] -> [R, O] for packed rows of E experts (offsets offs_E)."""

    @staticmethod
    def forward(ctx, x_RI: Tensor, offs_E: Tensor, weight: "FrozenWeight") -> Tensor:
        phase, memo = _phase()
        w_EIO = _materialize(weight, None, memo, phase)
        ctx.save_for_backward(offs_E)
        ctx.weight, ctx.memo = weight, memo
        return GROUPED_MM(x_RI, w_EIO, offs=offs_E)

    @staticmethod
    def backward(ctx, grad_RO: Tensor):
        (offs_E,) = ctx.saved_tensors
        w_EIO = _for_backward(ctx.weight, None, ctx.memo)
        return GROUPED_MM(grad_RO.contiguous(), w_EIO.transpose(1, 2), offs=offs_E), None, None


class _FrozenGroupBmm(torch.autograd.Function):
    """For each group: x_g [g, C, I] bmm its experts' W [g, I, O]; the chosen experts dequantized once."""

    @staticmethod
    def forward(ctx, weight: "FrozenWeight", experts_G: Tensor, sizes: list[int], *x_groups: Tensor):
        phase, memo = _phase()
        w_GIO = _materialize(weight, experts_G, memo, phase)
        ctx.save_for_backward(experts_G)
        ctx.weight, ctx.memo, ctx.sizes = weight, memo, sizes
        return tuple(torch.bmm(x, w) for x, w in zip(x_groups, w_GIO.split(sizes)))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        (experts_G,) = ctx.saved_tensors
        w_GIO = _for_backward(ctx.weight, experts_G, ctx.memo)
        grad_x = tuple(None if g is None else torch.bmm(g, w.transpose(1, 2))
                       for g, w in zip(grads, w_GIO.split(ctx.sizes)))
        return (None, None, None, *grad_x)


class FrozenWeight:
    """A frozen stack in a compute dtype, with its LoRA pair, as the dispatch runners multiply it."""

    def __init__(self, stack: FrozenStack, dtype: torch.dtype, lora: tuple[Tensor, Tensor] | None, scale: float,
                 pin: recompute.PinPolicy | None):
        self.stack, self.dtype, self.lora, self.scale, self.pin = stack, dtype, lora, scale, pin
        self.slot_key = (id(stack), "dequantized")

    def grouped_mm(self, x_RI: Tensor, offs_E: Tensor) -> Tensor:
        y_RO = _FrozenGroupedMM.apply(x_RI, offs_E, self)
        if self.lora is None:
            return y_RO
        a_EIr, b_ErO = self.lora
        return y_RO + self.scale * grouped_mm(grouped_mm(x_RI, a_EIr, offs_E), b_ErO, offs_E)

    def group_bmm(self, x_groups: list[Tensor], experts_G: Tensor, sizes: list[int], covers_all: bool) -> list[Tensor]:
        ys = list(_FrozenGroupBmm.apply(self, experts_G, sizes, *x_groups))
        if self.lora is None:
            return ys
        a_EIr, b_ErO = self.lora
        low = group_bmm(group_bmm(x_groups, a_EIr, experts_G, sizes, covers_all), b_ErO, experts_G, sizes, covers_all)
        return [y + self.scale * d for y, d in zip(ys, low)]


class FrozenExpertStack(nn.Module):
    """A pool's experts, frozen: gate_up [E, D, 2F] and down [E, F, D] as `FrozenStack`s, and with
    `lora_rank` > 0 trainable adapters: W + (alpha / r) A B per expert, B starting at zero."""

    def __init__(self, n_experts: int, d_model: int, d_expert: int, cfg: ExpertsConfig, device: torch.device | str,
                 init: bool = True):
        super().__init__()
        self.cfg, self.initialise = cfg, init
        self.gate_up = FrozenStack((n_experts, d_model, 2 * d_expert), cfg, device)
        self.down = FrozenStack((n_experts, d_expert, d_model), cfg, device)
        self.pin: recompute.PinPolicy | None = None  # set by the trainer under row checkpointing
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

    def weights(self, dtype: torch.dtype, experts: Tensor | None = None):
        if experts is None:
            return tuple(FrozenWeight(getattr(self, which), dtype, self._lora(which, dtype), self.scale, self.pin)
                         for which in ("gate_up", "down"))
        out = []
        for which in ("gate_up", "down"):
            w = getattr(self, which).dequantize(dtype, experts)
            lora = self._lora(which, dtype, experts)
            out.append(w if lora is None else w + self.scale * torch.bmm(*lora))
        return tuple(out)


def frozen_stacks(model: nn.Module) -> dict[str, FrozenStack]:
    """Every frozen stack of `model` by its name (also written into each stack's `name`)."""
    stacks = {name: m for name, m in model.named_modules() if isinstance(m, FrozenStack)}
    for name, stack in stacks.items():
        stack.name = name
    return stacks


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
