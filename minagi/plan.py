"""Will it fit: the memory a profile's training step takes on one device, from its config alone
(`plan_memory`); nothing is built, nothing touches a GPU. `train.py --plan` prints it (`describe`).

Shape legend: L rows, D width, H heads, T context, V vocabulary, E experts, K top_k, F expert width,
N characters of one forward on this rank, R = N*K routed rows, c the compute dtype's bytes.

The model of memory, from what the code saves for backward (counted tensor by tensor against
autograd's saved tensors on the CPU: tests/test_plan.py) and from the H200 figures it is checked
against (docs/benchmarks.md §15):
- persistent: fp32 trainable weights, AdamW's moments (8 or 4 bytes a weight: train.optimizer_states),
  frozen NF4 stacks (all resident, or the offload stager's slots), CUDA's library workspaces;
  gradients too under DDP (its buckets keep them) and during accumulation's later micro-batches;
- saved for backward, per character and row: the residual stream's input (fp32), the norms' rstd (and on
  the CPU their normalised output), the compute-dtype casts and qkv/rope/attention outputs, the
  router's input and probabilities (softmax top-k > 1, eager: its logits too), and per routed row the
  experts' input, SwiGLU input, activation (and the eager SwiGLU's two products): `row_saved`. Per row
  besides: the bf16 casts of its weights (autocast's cache, the expert stacks' casts); none for frozen
  stacks (they are dequantized at each use);
  and the head's weight cast, kept until the head's backward (`head_copy`);
- row checkpointing keeps only each row's input and recomputes one row at a time in backward (the
  replay), with the replay pin's dequantized stacks kept until that row's backward;
- the step is walked phase by phase (forward, then each row's backward from the last, the optimizer),
  with the transients of each matmul's backward (`_Tape`); the peak is the largest sum met;
- padded dispatch paths (grouped, rectangle) compute padded rows: modelled with one sink expert at
  `pool.sink_ratio` x its fair share and the others even (layout.layered_layout's layout for it);
- compiled (train.compile) rows save ~3.2 D bytes a character less (inductor recomputes casts and norm
  outputs: fitted to the h200 profile's 37.6 GiB eager against 36.0 compiled);
- the allocator's slack over the allocated peak: ~2% with expandable segments, ~15% without (measured).

`world_size` divides the batch (DDP: everything else is replicated). `weight_shards` / `expert_shards`
divide the persistent terms of the dense weights and of the trainable expert stacks for sharded runs
(FSDP, expert parallelism; frozen stacks are buffers, whole on every rank), and FSDP's gathered rows
are a part of their own. minagi/plan_report.py says what the plan is for a run's layout and card.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import Config
from .dispatch import PACKED
from .layout import layered_layout

__all__ = ["TARGETS", "MemoryPlan", "Part", "Target", "gib", "plan_memory", "row_saved", "weight_counts"]

GiB = 2 ** 30
CUDA_WORKSPACES = 72 * 2 ** 20   # allocated beyond the tensors after a step (cuBLAS/cuBLASLt): H200 figures
# Bytes per character, row and unit of width that a compiled row does not save: 3.2 fitted on the H200
# against an eager count that still held the projection input's bf16 copy (2), which no eager row makes now.
COMPILED_SAVING_PER_D = 1.2
TORCH_DEQUANT_TEMP = 9           # bytes per weight the eager (torch) NF4 dequant holds while it works


@dataclass(frozen=True)
class Target:
    """The device kind a plan is for: what the code does there."""
    name: str
    gpu: bool
    bf16: bool          # native bf16: "auto" precision is bf16
    native: bool        # torch's grouped GEMM is the auto dispatch path (sm90+, bf16)
    kernels: bool       # minagi's Triton SwiGLU and NF4 kernels run
    fused_norm: bool    # rms_norm saves its input and rstd only (CUDA's fused kernel)
    about: str


TARGETS = {
    "sm90": Target("sm90", True, True, True, True, True,
                   "NVIDIA sm90+ (H100/H200): native grouped GEMM, Triton kernels"),
    "sm80": Target("sm80", True, True, False, True, True, "NVIDIA sm80-89 (A100, RTX 30/40): minagi's Triton grouped GEMM"),
    "sm75": Target("sm75", True, False, False, False, True, "NVIDIA sm70-75 (V100, RTX 20): no bf16 (fp32, or fp16)"),
    "rocm": Target("rocm", True, True, False, False, True,
                   "AMD under ROCm (Radeon 8060S): bucketed path, eager kernels"),
    "cpu": Target("cpu", False, False, False, False, False, "the CPU: fp32, bucketed path, eager kernels"),
}


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    how: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted peak of one rank, by part: `parts` add up to `peak_allocated`; the allocator's
    slack on top is `peak_reserved`. `notes`: what the parts assumed, and figures beside them."""
    target: Target
    parts: tuple[Part, ...]
    slack: Part
    phase: str                       # where in the step the peak falls
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def peak_allocated(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def peak_reserved(self) -> int:
        return self.peak_allocated + self.slack.bytes


@dataclass(frozen=True)
class _Shape:
    """What the model of memory reads of a config on a target, per rank (the legend's letters; N: the
    characters of one forward, a micro-batch, on this rank; c: the compute dtype's bytes)."""
    L: int; D: int; H: int; T: int; V: int; N: int; E: int; K: int; F: int; c: int  # noqa: E702
    autocast: bool
    pooled: bool
    dense_width: int
    path: str
    eager_swiglu: bool
    fused_norm: bool
    math_attention: bool  # the CPU: attention with dropout takes SDPA's math path (its probabilities kept)
    frozen: bool
    quant: str
    lora: int
    torch_dequant: bool
    pad: float            # padded rows / routed rows of the dispatch path
    dropout: bool
    z_loss: bool
    expert_dropout: bool
    compiled: bool
    softmax_gates: bool = False  # gates as the softmax of the chosen logits (router.route): the logits kept

    @property
    def R(self) -> int:
        return self.N * self.K


def _resolve(cfg: Config, target: Target, world_size: int, vocab_size: int) -> _Shape:
    m, p, tc, x = cfg.model, cfg.pool, cfg.train, cfg.experts
    precision = tc.precision if tc.precision != "auto" else ("bf16" if target.bf16 else "fp32")
    c = {"bf16": 2, "fp16": 2, "fp32": 4}[precision]
    path = p.dispatch
    triton = target.gpu and c == 2  # resolve_dispatch: minagi's Triton grouped GEMM runs in bf16/fp16 on a GPU
    if path == "auto":  # ... and `auto` takes it where minagi's Triton kernels are run (NVIDIA sm80+)
        path = "native" if target.native and precision == "bf16" else ("triton" if triton and target.kernels else "grouped")
    elif path == "native" and target.gpu and (precision != "bf16" or not target.native):
        path = "grouped"  # resolve_dispatch: the CUDA kernel is bf16-only; elsewhere it loops with syncs
    elif path == "triton" and not triton:
        path = "grouped"
    N = tc.batch_size // world_size * m.context
    pad = _padding(path, p.n_experts, p.top_k, N, p.sink_ratio, frozen=x.frozen) if m.mlp == "pooled" else 1.0
    return _Shape(L=m.n_rows, D=m.d_model, H=m.n_heads, T=m.context, V=vocab_size, N=N, E=p.n_experts, K=p.top_k,
                  F=p.d_expert, c=c, autocast=c == 2, pooled=m.mlp == "pooled", dense_width=cfg.dense_width,
                  path=path, eager_swiglu=_eager_swiglu(p.swiglu, target, c),
                  fused_norm=target.fused_norm, math_attention=not target.gpu, frozen=x.frozen, quant=x.quant,
                  lora=x.lora_rank,
                  torch_dequant=not target.kernels, pad=pad, dropout=m.dropout > 0, z_loss=p.z_loss_coef > 0,
                  expert_dropout=p.expert_dropout > 0, compiled=tc.compile and target.gpu and tc.compile_backend == "inductor",
                  softmax_gates=p.router_score == "softmax" and p.top_k > 1)


def _eager_swiglu(setting: str, target: Target, c: int) -> bool:
    """Whether the SwiGLU keeps the eager ops' two [rows, F] products for backward. The kernels (Triton
    under "auto", jiterator when asked) keep h and the gate only; "auto" where Triton does not run
    counts the eager ops: its jiterator kernels are probed at run time and may not be there."""
    fused = (setting == "auto" and target.kernels) or (setting == "jiterator" and target.gpu)
    return not (fused and c == 2)


def _padding(path: str, n_experts: int, top_k: int, n_chars: int, sink_ratio: float, frozen: bool) -> float:
    """Padded / routed rows of `path` with one expert at `sink_ratio` x its fair share, the rest even."""
    if path in (*PACKED, "loop"):
        return 1.0
    routed = n_chars * top_k
    fair = routed / n_experts
    sink = min(routed, round(sink_ratio * fair))
    rest = (routed - sink) / max(1, n_experts - 1)
    loads = [sink] + [int(rest)] * (n_experts - 1)
    if path == "rectangle":
        return n_experts * max(loads) / routed
    return layered_layout(loads, None if frozen else 256).padded_rows / routed


# ---------------------------------------------------------------------------------------- counts

def weight_counts(cfg: Config, vocab_size: int) -> dict[str, int]:
    """Trainable weights (`trainable`, of which `experts` in trainable stacks), frozen expert weights
    (`frozen`) and their stored bytes (`stored`), as the model built from `cfg` holds them."""
    m, p, x = cfg.model, cfg.pool, cfg.experts
    D, E, F = m.d_model, p.n_experts, p.d_expert
    per_row = 4 * D * D + 2 * D
    experts = frozen = stored = 0
    if m.mlp == "dense":
        per_row += 3 * D * cfg.dense_width
    else:
        per_row += E * D
        stack = E * D * 3 * F
        if x.frozen:
            frozen = stack
            per_row += E * x.lora_rank * (D + 2 * F + F + D) if x.lora_rank else 0
            stored = m.n_rows * _stored_bytes(stack, x)
        else:
            experts = m.n_rows * stack
    trainable = m.n_rows * per_row + experts + 2 * vocab_size * D + D
    return {"trainable": trainable, "experts": experts, "frozen": m.n_rows * frozen, "stored": stored}


def _stored_bytes(stack: int, x) -> int:
    """Bytes of one row's frozen stacks (gate_up and down) as stored."""
    if x.quant == "none":
        return 2 * stack
    blocks = stack // x.blocksize
    if x.double_quant:  # 8-bit absmax, an fp32 absmax per 256 of them and an offset, per stack
        return stack // 2 + blocks + 4 * math.ceil(blocks / 256) + 8
    return stack // 2 + 4 * blocks


# ---------------------------------------------------------------------------------------- a row's saved tensors

def row_saved(s: _Shape, checkpointed: bool = False) -> dict[str, int]:
    """Bytes one row keeps for its backward, by what keeps them, for N characters (its input included;
    `checkpointed`: the input alone). The expert terms count padded rows (s.pad)."""
    N, D, c = s.N, s.D, s.c
    out = {"input": 4 * D * N}
    if checkpointed:
        return out
    norm = 4 + (0 if s.fused_norm else 4 * D)  # rstd; the CPU's decomposed norm keeps its normalised output
    # rstd; the qkv input cast; qkv (kept whole by v, a view); q and k after RoPE (one tensor); attention's
    # output and logsumexp (the projection's input is a view of that output: RoPE keeps qkv's layout,
    # [B, T, H, Dh], which the attention's output takes); dropout's two masks, and on the CPU the math
    # path's probabilities and their dropout (measured: ~12 bytes per head and key, and ~4 D) and its
    # output's reshaped copy (the math path writes [B, H, T, Dh])
    out["attention"] = int(N * (norm + c * D + 3 * c * D + 2 * c * D + c * D + 4 * s.H
                            + (2 * D if s.dropout else 0)
                            + (12 * s.H * s.T + 4 * D + c * D if s.dropout and s.math_attention else 0)
                            - (COMPILED_SAVING_PER_D * D if s.compiled else 0)))
    out["mlp norm"] = N * (4 * D + norm)
    if not s.pooled:
        Hd = s.dense_width
        out["dense MLP"] = N * ((c if s.autocast else 4) * D + 4 * c * Hd)
        return out
    # Its input and scores, the chosen ids [8K], and the gates' own: softmax gates keep their softmax [4K]
    # and, eager, the logits their gather read [4E] (compiled: its shape only); renormalised scores their
    # division's numerator and sum [4K + 4]; top-1 nothing more. z-loss: the logits (if not kept) and its result.
    logits_kept = s.softmax_gates and not s.compiled
    if s.K == 1:
        gates = 8 * s.K
    else:
        gates = 12 * s.K + (4 * s.E if logits_kept else 0 if s.softmax_gates else 4)
    z_loss = (4 if logits_kept else 4 * s.E + 4) if s.z_loss else 0
    out["router"] = N * (4 * D + 4 * s.E + gates + z_loss + (5 * s.K if s.expert_dropout else 0))
    out["dispatch index"] = s.R * 16
    per_row = _expert_row_bytes(s)
    out["experts"] = s.R * per_row
    if s.pad > 1:  # padded rows: their activations, and their character index
        out["dispatch padding"] = (round(s.R * s.pad) - s.R) * (per_row + 8)
    return out


def head_saved(s: _Shape) -> int:
    """Bytes the final norm, head and loss keep for backward (the last row's output counted as its
    output, not here), with the logits the forward returns."""
    norm = 4 + (0 if s.fused_norm else 4 * s.D)
    return s.N * (norm + (s.c if s.autocast else 4) * s.D + s.c * s.V + 4 * s.V + 16)


def _expert_parts(s: _Shape) -> dict[str, int]:
    """Bytes saved per routed (or padded) row, by the node whose backward frees them: the down matmul
    (its input, the activation), SwiGLU (its input and gate; eager: its two products), gate_up (its
    input; with LoRA the two low-rank products too). A frozen stack's own matmul saves nothing but offsets."""
    c, D, F = s.c, s.D, s.F
    keeps_inputs = not s.frozen or s.lora > 0
    return {"down": c * F if keeps_inputs else 0,
            "swiglu": 2 * c * F + c + (2 * c * F if s.eager_swiglu else 0),
            "gate_up": (c * D if keeps_inputs else 0) + (2 * c * s.lora if s.frozen and s.lora else 0)}


def _expert_row_bytes(s: _Shape) -> int:
    return sum(_expert_parts(s).values())


def head_copy(s: _Shape) -> int:
    """Bytes of the head's weight cast to the compute dtype (autocast's), kept for the head's backward."""
    return s.V * s.D * s.c if s.autocast else 0


def weight_copies(s: _Shape) -> int:
    """Bytes a row keeps of its weights cast to the compute dtype (autocast's cache, the stacks' casts)."""
    if not s.autocast:
        return 0
    D, E, F = s.D, s.E, s.F
    total = 4 * D * D * s.c
    if not s.pooled:
        return total + 3 * D * s.dense_width * s.c
    if not s.frozen:
        total += E * D * 3 * F * s.c
    elif s.lora:
        total += E * s.lora * (2 * D + 3 * F) * s.c
    return total



# ---------------------------------------------------------------------------------------- the step, phase by phase

class _Tape:
    """Live bytes by part as the step runs, and the largest total met, with its parts and phase."""

    def __init__(self, parts: dict[str, int]):
        self.live = {k: int(v) for k, v in parts.items()}
        self.phase = "start"
        self.best, self.best_parts, self.best_phase = sum(self.live.values()), dict(self.live), self.phase

    def alloc(self, part: str, n: float) -> None:
        self.live[part] = self.live.get(part, 0) + int(n)
        total = sum(self.live.values())
        if total > self.best:
            self.best, self.best_parts, self.best_phase = total, dict(self.live), self.phase

    def free(self, part: str, n: float) -> None:
        self.live[part] = self.live.get(part, 0) - int(n)

    def hold(self, part: str, n: float) -> None:
        """A transient: allocated, then freed (the peak sees it)."""
        self.alloc(part, n)
        self.free(part, n)


@dataclass(frozen=True)
class _Step:
    """How the step runs: row checkpointing, the replay pin of each stack, gradients already whole
    (DDP's buckets, accumulation's later micro-batches), the trainable weights of a row."""
    checkpointed: bool
    pinned: tuple[bool, bool]   # gate_up, down
    grads_whole: bool
    row_grads: int              # bytes of a row's gradients besides its trainable stacks'
    stacks: tuple[int, int]     # weights of a row's gate_up and down


def _made(tape: _Tape, s: _Shape, stack: int, part: str = "weight copies") -> int:
    """A frozen stack dequantized for a matmul (the eager dequant's temporaries held while it works)."""
    if s.quant == "none":
        return 0  # a bf16 stack is used as stored
    if s.torch_dequant:
        tape.hold("forward transients", stack * TORCH_DEQUANT_TEMP)
    tape.alloc(part, stack * s.c)
    return stack * s.c


def _row_forward(tape: _Tape, s: _Shape, st: _Step, saving: bool, replay: bool = False) -> None:
    """A row's forward in order: attention, router and dispatch, gate_up, SwiGLU, down, combine; each
    saved tensor kept (`saving`) or passing through (a checkpointed row's first forward); the weight
    casts; a frozen stack dequantized for its matmul (kept when a replay pins it); the widest
    intermediates: a LoRA branch's product and sum, the experts' outputs and the combine's gather."""
    saved, made_parts = row_saved(s), []
    early = {k: v for k, v in saved.items() if k not in ("input", "experts", "dispatch padding")}
    copies = weight_copies(s)
    tape.alloc("weight copies", copies)
    tape.alloc("activations", sum(early.values()))
    P = round(s.R * s.pad)
    if s.pooled:
        per_row = _expert_parts(s)
        _alloc_rows(tape, s, 8, index=True)
        stages = ((st.stacks[0], st.pinned[0], 2 * s.F, ("gate_up", "swiglu")),
                  (st.stacks[1], st.pinned[1], s.D, ("down",)))
        for stack, pin, width, parts in stages:
            made = _made(tape, s, stack) if s.frozen else 0
            for part in parts:  # the stage's input, and what its output feeds (SwiGLU's saved input)
                _alloc_rows(tape, s, per_row[part])
            if s.frozen and s.lora:
                tape.hold("forward transients", 2 * P * width * s.c)  # the stack's product and the scaled LoRA one
            if not (replay and pin):
                tape.free("weight copies", made)
            made_parts.append(parts)
        tape.hold("forward transients", 2 * P * s.c * s.D)  # the experts' outputs and the combine's gather
    if not saving:
        tape.free("activations", sum(early.values()))
        tape.free("weight copies", copies)
        if s.pooled:
            _free_rows(tape, s, sum(per_row.values()))
            _free_rows(tape, s, 8, index=True)
    if not replay:  # a replay stops once its saved tensors are made again: its output is not
        tape.alloc("activations", saved["input"])  # the row's output: the next row's input


def _alloc_rows(tape: _Tape, s: _Shape, per_row: int, index: bool = False) -> None:
    """`_free_rows`' allocation."""
    if not index:
        tape.alloc("activations", s.R * per_row)
    tape.alloc("dispatch padding", (round(s.R * s.pad) - s.R) * per_row)


def _stage_backward(tape: _Tape, s: _Shape, st: _Step, rows: int, i: int, o: int, stack: int, pinned: bool) -> None:
    """One expert matmul's backward (rows x [E, i, o]): d x, and for a trainable stack d W (compute
    dtype, then fp32 into .grad); a frozen stack made again unless pinned; a LoRA pair's gradients."""
    c = s.c
    if not s.frozen:
        tape.alloc("backward transients", stack * c)
        if st.grads_whole:
            tape.hold("backward transients", stack * 4)  # added into the whole gradient
        else:
            tape.alloc("gradients", stack * 4)
        tape.free("backward transients", stack * c)
        tape.alloc("backward transients", rows * i * c)
        return
    if s.lora:
        tape.hold("backward transients", rows * o * c)  # the scaled gradient of the LoRA branch
        tape.alloc("backward transients", rows * i * c)  # d x through A
    made = 0 if pinned else _made(tape, s, stack, "backward transients")
    tape.alloc("backward transients", rows * i * c)
    tape.free("backward transients", made + (rows * i * c if s.lora else 0))  # the two d x summed in place


def _free_rows(tape: _Tape, s: _Shape, per_row: int, index: bool = False) -> None:
    """Free `per_row` bytes of every routed row (activations) and padded row (dispatch padding);
    `index`: the padded rows' character index only (routed rows' index is the dispatch index's)."""
    if not index:
        tape.free("activations", s.R * per_row)
    tape.free("dispatch padding", (round(s.R * s.pad) - s.R) * per_row)


def _row_backward(tape: _Tape, s: _Shape, st: _Step) -> None:
    """A row's backward from its saved tensors (the pool: combine, down, SwiGLU, gate_up, dispatch;
    then attention), each freed as its node runs; the row's gradients left behind."""
    c, D, F, N = s.c, s.D, s.F, s.N
    saved = row_saved(s)
    P = round(s.R * s.pad)
    tape.alloc("backward transients", N * (4 * D + c * D))  # the residual's gradient and its cast
    if s.pooled:
        per_row = _expert_parts(s)
        tape.alloc("backward transients", P * c * D)  # d y of the experts' rows
        _stage_backward(tape, s, st, P, F, D, st.stacks[1], st.pinned[1])  # -> d act
        _free_rows(tape, s, per_row["down"])
        tape.free("backward transients", P * c * D)  # d y
        tape.alloc("backward transients", P * 2 * c * F)  # d h
        tape.free("backward transients", P * c * F)  # d act
        _free_rows(tape, s, per_row["swiglu"])
        _stage_backward(tape, s, st, P, D, 2 * F, st.stacks[0], st.pinned[0])  # -> d x
        _free_rows(tape, s, per_row["gate_up"])
        tape.free("backward transients", P * 2 * c * F + P * c * D)
        if s.frozen:
            tape.free("weight copies", sum(n * s.c for n, pin in zip(st.stacks, st.pinned) if pin))
        _free_rows(tape, s, 8, index=True)
    else:
        tape.hold("backward transients", N * (c * D + 4 * c * s.dense_width))
    for part, n in saved.items():
        if part not in ("input", "attention", "experts", "dispatch padding"):
            tape.free("activations", n)
    tape.hold("backward transients", N * (3 * c * D + 12 * D))  # d q, k, v; flash's fp32 d q; rope's fp32 grads
    tape.free("activations", saved["attention"] + saved["input"])
    tape.free("weight copies", weight_copies(s))
    tape.free("backward transients", N * (4 * D + c * D))
    if st.grads_whole:
        tape.hold("backward transients", st.row_grads)
    else:
        tape.alloc("gradients", st.row_grads)


def _persistent(cfg: Config, target: Target, counts: dict[str, int], grads_whole: bool, weight_shards: int,
                expert_shards: int) -> dict[str, int]:
    """What is allocated between steps (and the gradients, when they stay whole all step)."""
    tc, x = cfg.train, cfg.experts
    dense = counts["trainable"] - counts["experts"]
    sharded = dense / weight_shards + counts["experts"] / expert_shards
    state_bytes = {"fp32": 8, "bf16": 4}[tc.optimizer_states]
    if x.frozen and x.offload == "cpu":  # the stager's slots: one row's stacks each
        nf4 = counts["stored"] // cfg.model.n_rows * (2 if x.prefetch else 1)
    else:  # buffers: FSDP shards parameters only, and expert parallelism refuses frozen stacks
        nf4 = counts["stored"]
    return {"weights": 4 * sharded, "NF4 stacks": nf4, "optimizer states": state_bytes * sharded,
            "gradients": 4 * sharded if grads_whole else 0,
            "CUDA workspaces": CUDA_WORKSPACES if target.gpu else 0}


def _pins(cfg: Config, s: _Shape) -> tuple[bool, bool]:
    """The replay pin's decision for a row's gate_up and down (experts.replay_pin; "auto" assumed to fit)."""
    x = cfg.experts
    if not (x.frozen and cfg.train.checkpoint_rows and s.pooled) or x.replay_pin == "off":
        return False, False
    stacks = (s.E * s.D * 2 * s.F * s.c, s.E * s.F * s.D * s.c)
    if s.path in ("grouped", "rectangle", "loop"):  # a bucketed path's two stacks follow gate_up's decision
        keep = x.replay_pin == "on" or stacks[0] >= x.pin_floor_mib * 2 ** 20
        return keep, keep
    return tuple(x.replay_pin == "on" or n >= x.pin_floor_mib * 2 ** 20 for n in stacks)


def _optimizer_transient(cfg: Config, s: _Shape, counts: dict[str, int], target: Target) -> int:
    """The update's temporaries: none for fused AdamW (CUDA) and for minagi's bf16 AdamW where its Triton
    kernel runs (NVIDIA with Triton: minagi/adamw_triton.py); torch's per-tensor loop (CPU) one fp32 tensor
    of the largest; the bf16 AdamW's foreach form a chunk's fp32 moments, denominator and rounding."""
    largest = s.E * s.D * 2 * s.F if s.pooled and not s.frozen else 4 * s.D * s.D
    if cfg.train.optimizer_states == "bf16" and target.kernels and target.name != "rocm":
        return 0
    if cfg.train.optimizer_states == "bf16":
        from .optim import CHUNK, UPDATE_TEMP
        return UPDATE_TEMP * max(largest, min(CHUNK, counts["trainable"]))
    return 0 if target.gpu else 4 * largest


def _walk(cfg: Config, s: _Shape, st: _Step, persistent: dict[str, int], counts: dict[str, int],
          target: Target) -> _Tape:
    """The step phase by phase: the forward of every row, the head, each row's backward from the last
    (a checkpointed row replayed first), the optimizer's update."""
    tape = _Tape(persistent)
    tape.phase = "forward"
    tape.alloc("activations", 4 * s.D * s.N + 8 * s.N)  # the embedding's output (row 1's input), its indices
    for row in range(s.L):
        tape.phase = f"forward, row {row + 1}"
        _row_forward(tape, s, st, saving=not st.checkpointed)
    tape.phase = "forward, head and loss"
    head = head_saved(s)
    tape.alloc("weight copies", head_copy(s))
    tape.alloc("activations", head)
    tape.phase = "backward, head and loss"
    tape.hold("backward transients", s.N * (8 * s.V + 2 * s.c * s.V + 4 * s.D + s.c * s.D))
    tape.free("activations", head)
    tape.free("weight copies", head_copy(s))
    tape.alloc("gradients", 0 if st.grads_whole else 4 * s.V * s.D)
    for row in reversed(range(s.L)):
        tape.phase = f"backward, row {row + 1}" + (" (its replay)" if st.checkpointed else "")
        if st.checkpointed:
            _row_forward(tape, s, st, saving=True, replay=True)
            tape.phase = f"backward, row {row + 1}"
        _row_backward(tape, s, st)
    tape.free("activations", 4 * s.D * s.N + 8 * s.N)  # the last row's output, the embedding's indices
    tape.alloc("gradients", 0 if st.grads_whole else 4 * (s.V * s.D + s.D))
    tape.phase = "optimizer step"
    tape.hold("optimizer transients", _optimizer_transient(cfg, s, counts, target))
    return tape


_ORDER = ("weights", "NF4 stacks", "optimizer states", "gradients", "gathered rows", "activations", "dispatch padding",
          "weight copies", "forward transients", "backward transients", "optimizer transients", "CUDA workspaces")
_HOW = {
    "weights": "fp32 trainable weights",
    "NF4 stacks": "frozen expert stacks as stored (offload: the stager's slots)",
    "optimizer states": "AdamW's two moments",
    "gradients": "fp32 gradients alive at the peak",
    "gathered rows": "FSDP: the row in use and the one prefetched, whole (fp32 weights and gradients)",
    "activations": "tensors saved for backward (rows' inputs, attention, router, experts' rows)",
    "dispatch padding": "the padded rows' saved tensors",
    "weight copies": "weights cast to the compute dtype, frozen stacks dequantized",
    "forward transients": "intermediates of the forward not kept",
    "backward transients": "gradients of activations, weight gradients before .grad",
    "optimizer transients": "the update's temporaries",
    "CUDA workspaces": "cuBLAS / cuBLASLt workspaces (measured on the H200)",
}


def plan_memory(cfg: Config, target: Target | str = "sm90", *, vocab_size: int = 256, world_size: int = 1,
                weight_shards: int = 1, expert_shards: int = 1) -> MemoryPlan:
    """The predicted peak of one rank training `cfg` on `target` (a `Target` or a name in TARGETS), by part.

    `vocab_size`: the corpus's (a plan reads no corpus; the head's share is small). `world_size`: ranks
    sharing train.batch_size (DDP). `weight_shards` / `expert_shards`: how many ways the dense weights and
    the expert stacks are sharded (1: replicated; the seam for FSDP and expert parallelism).
    """
    target = TARGETS[target] if isinstance(target, str) else target
    tc = cfg.train
    s = _resolve(cfg, target, world_size, vocab_size)
    counts = weight_counts(cfg, vocab_size)
    grads_whole = world_size > 1 or tc.accum_steps > 1  # DDP's buckets; a later micro-batch adds into them
    row_weights = (counts["trainable"] - counts["experts"] - 2 * vocab_size * s.D - s.D) // s.L
    st = _Step(checkpointed=tc.checkpoint_rows, pinned=_pins(cfg, s), grads_whole=grads_whole,
               row_grads=4 * row_weights,
               stacks=(s.E * s.D * 2 * s.F, s.E * s.F * s.D) if s.pooled else (0, 0))
    persistent = _persistent(cfg, target, counts, grads_whole, weight_shards, expert_shards)
    if weight_shards > 1:  # FSDP gathers a row's shards whole (expert slices of expert parallelism stay local)
        experts_gathered = counts["experts"] // s.L if tc.expert_parallel == 1 else 0
        persistent["gathered rows"] = 2 * 8 * (row_weights + experts_gathered)
    tape = _walk(cfg, s, st, persistent, counts, target)
    parts = tape.best_parts
    ordered = tuple(Part(k, parts[k], _HOW[k]) for k in _ORDER if parts.get(k, 0) > 0)
    peak = sum(p.bytes for p in ordered)
    expandable = "expandable_segments:True" in cfg.memory.alloc_conf
    slack = Part("allocator slack", int(peak * (0.02 if expandable else 0.15)) if target.gpu else 0,
                 "reserved over allocated: ~2% with expandable segments, ~15% without (measured)")
    return MemoryPlan(target, ordered, slack, tape.best_phase, _notes(cfg, s, st, counts))


def _notes(cfg: Config, s: _Shape, st: _Step, counts: dict[str, int]) -> tuple[str, ...]:
    """What the parts assumed, and the per-row figures beside them."""
    per_row = sum(row_saved(s).values())
    notes = [f"{s.N:,} characters a forward on this rank ({s.N // s.T} sequences of {s.T}"
             + (f", {cfg.train.accum_steps} micro-batches a step" if cfg.train.accum_steps > 1 else "") + "), "
             f"compute in {dict([(2, 'bf16/fp16'), (4, 'fp32')])[s.c]}, dispatch path {s.path}",
             f"weights: {counts['trainable']:,} trainable"
             + (f", {counts['frozen']:,} frozen" if counts["frozen"] else ""),
             f"activations a row: {gib(per_row)} without row checkpointing, {gib(row_saved(s, True)['input'])} with "
             f"({per_row / s.N:,.0f} and {4 * s.D} bytes a character; checkpointed, one row at a time is replayed "
             f"in full); weight copies a row: {gib(weight_copies(s))}"]
    if s.pooled and s.path not in PACKED:
        notes.append(f"dispatch {s.path}: padded / routed rows {s.pad:.2f} with one expert at pool.sink_ratio = "
                     f"{cfg.pool.sink_ratio:g} x its fair share")
    if any(st.pinned):
        notes.append("replay pin: a row's dequantized stacks kept from its replay to its backward")
    if cfg.train.compile and cfg.train.compile_backend == "inductor":
        notes.append(f"compiled: rows save ~{COMPILED_SAVING_PER_D:g} x D bytes a character less (fitted on the H200)")
    return tuple(notes)


def gib(n: float) -> str:
    """A byte count as GiB from 1 GiB up, MiB below."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"
