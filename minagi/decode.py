"""Writing at fixed shapes: a static KV cache indexed by a position tensor, and the one-character step
that a CUDA graph captures.

Shape legend: B streams, W window (cache positions), R model rows, H heads, Dh head width, D model
width, V vocabulary, K top_k, S = B*K routed rows, F expert width, C steps of one noise table.

`Decoder` holds, for B streams written side by side, everything a step reads or writes, allocated
once: the cache [R, 2, B, H, W, Dh] (per row its keys, then its values: one index_copy_ writes
both), each stream's position `pos_B`
(where its next key goes) and input character `tok_B`, RoPE tables for positions 0..W-1, the
sampling noise of the next C steps, and the characters written. A step (`_step`) embeds `tok_B`,
writes each row's new key and value at `pos_B` in place (index_copy_ into the row's flat view),
attends over the whole window with a mask that keeps keys at positions <= the query's, runs the
MLP, samples on the device and advances `pos_B`, `tok_B` and the noise slot. Its shapes never
change and it has no host sync and no Python branch on data, so one CUDA graph replays it for every
character (`graphs=True`): the kernels the eager step launches, in the same buffers, nothing copied.

The step's math is minagi/decode_step.py: functions of tensors only, so that `compiled=True` can hand
them to torch.compile (fused kernels; the in-place cache writes stay eager here). With few streams a
compiled step writes its products as sums (`products`, decode_step.py): inductor then fuses them
with the experts' gather, the top-k and the attention.
The expert path is gpt-fast's (mixtral-moe): route, gather the top_k chosen experts' weights of each
routed row (frozen NF4 stacks, through the expert-weights seam, dequantize just those experts) and
multiply per routed row with bmm: no sort, no counts, no host sync. That reads an expert once per
stream that chose it, so with many streams, where the pool's own path is torch's grouped GEMM
("native") and the stack is resident, the step runs that path instead (each chosen expert read once
a step, however many streams chose it; its sort and counts make no host sync either). Writing is
dropless and computes no aux terms. The dense twin is one SwiGLU.

A window's characters but the last are *prefilled* by the model's own forward (outside the graph,
its usual dispatch) and copied into the stream's slots; the last is the next step's input. The
driver (minagi/sampling.py `write`) decides when a stream slides and reads the characters back.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import decode_step
from .decode_step import MLPWeights
from .dense import DenseMLP
from .devices import autocast
from .experts import ExpertStack
from .gumbel import gumbel_noise, pick, stream_keys
from .model import CharLM
from .pool import PooledMLP

__all__ = ["EXPERT_PATHS", "Decoder", "auto_grouped", "inference"]

EXPERT_PATHS = ("auto", "gathered", "grouped")

_WARMUP_STEPS = 3          # eager steps before a capture: cuBLAS handles, allocations, Triton tables
_PRODUCTS_MAX_STREAMS = 8  # compiled, `products` up to this many streams (beyond, GEMMs reuse weights)
_NOISE_ELEMENTS = 1 << 22  # noise table size that sets C (steps of noise made at once), within 16..256


@contextlib.contextmanager
def inference(model: CharLM, device: torch.device):
    """One forward call's settings: eval mode, no autograd, bf16 autocast on CUDA, dropless experts.

    Entered per call, never across a `yield`: thread-local grad mode and module attributes would
    otherwise leak into the caller's code between two characters.
    Dropless: with capacity_factor > 0 a character's output would depend on which other characters
    share the call (a prefill of 60 may drop, a step of 1 never does), so the cache and the
    recomputation would disagree. Capacity is a training-throughput knob; writing uses none.
    """
    pools = model.pools()
    saved = [pool.capacity_factor for pool in pools]
    was_training = model.training
    if was_training:  # .eval() walks every module: skip it when there is nothing to change
        model.eval()
    for pool in pools:
        pool.capacity_factor = 0.0
    try:
        with torch.inference_mode(), autocast(device):
            yield
    finally:
        for pool, c in zip(pools, saved):
            pool.capacity_factor = c
        if was_training:
            model.train()


def auto_grouped(pool: PooledMLP, n_streams: int) -> bool:
    """Whether expert_path `auto` runs a resident pool grouped: where the pool itself runs torch's
    grouped GEMM and many streams choose each expert several times a step (there it was 1.8x faster
    on the H200); at batch 1 its sort and plan cost more than gathering 4 experts."""
    return pool.path == "native" and n_streams * pool.cfg.top_k >= 2 * pool.n_experts


class Decoder:
    """B streams of `model` over a window of W positions: prefill, advance one character, read back.

    seeds: one per stream (its noise, minagi/gumbel.py). temperature / top_k: as `gumbel.pick`.
    graphs: capture the step in a CUDA graph (the model must be on a CUDA device).
    expert_path: `gathered` (each routed row's experts gathered, as gpt-fast), `grouped` (the grouped
    GEMM on the whole resident stacks), or `auto`: grouped where the pool itself runs torch's
    grouped GEMM ("native") on a trainable stack and streams x top_k >= 2 x n_experts, else
    gathered (docs/benchmarks.md §11). Gathered, a stream's bits never depend on the others; grouped,
    they may by bf16 rounding (the GEMM's tiling follows how many rows each expert has).
    compiled: run the step's pieces (minagi/decode_step.py) through torch.compile: fewer, fused
    kernels for a first-use compile (CUDA only, resident experts only).
    products: the step's matrix-vector products as products and sums (decode_step.py); None = where
    the step is compiled for at most _PRODUCTS_MAX_STREAMS streams. Eager it is slow (it
    materialises the products) but the same math, which the CPU tests use.
    The decoder copies no state back into the model; build a new one after the weights change
    (on CUDA it holds bf16 copies of the matmul weights).
    """

    def __init__(self, model: CharLM, seeds: list[int], window: int, *, temperature: float = 0.0,
                 top_k: int = 0, graphs: bool = False, expert_path: str = "auto", compiled: bool = False,
                 products: bool | None = None):
        device = model.embed.weight.device
        if graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {device.type}")
        if expert_path not in EXPERT_PATHS:
            raise ValueError(f"expert_path must be one of {', '.join(EXPERT_PATHS)}; got {expert_path!r}")
        if compiled and device.type != "cuda":
            raise ValueError(f"a compiled step needs a CUDA device (Triton); the model is on {device.type}")
        self.expert_path = expert_path
        self.products = compiled and len(seeds) <= _PRODUCTS_MAX_STREAMS if products is None else products
        self.qkv_step, self.attend_step, self.tail_step, self.head_step = (
            _compiled_pieces() if compiled else
            (decode_step.qkv_step, decode_step.attend_step, decode_step.tail_step, decode_step.head_step))
        cfg = model.cfg
        self.model, self.device, self.window = model, device, window
        self.temperature, self.top_k = temperature, top_k
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what autocast computes in
        B, W, V = len(seeds), window, model.vocab_size
        self.n_streams = B
        self.chunk = max(16, min(256, _NOISE_ELEMENTS // (B * V)))
        with torch.inference_mode():
            shape = (cfg.n_rows, 2, B, cfg.n_heads, W, cfg.head_dim)
            self.kv_R2BHWd = torch.zeros(shape, dtype=self.dtype, device=device)
            self.k_RBHWd, self.v_RBHWd = self.kv_R2BHWd[:, 0], self.kv_R2BHWd[:, 1]  # views
            self.pos_B = torch.zeros(B, dtype=torch.long, device=device)
            self.tok_B = torch.zeros(B, dtype=torch.long, device=device)
            self.positions_W = torch.arange(W, device=device)
            cos_Wd, sin_Wd = model.rows[0].attn.rope(0, W, device)  # the prefill's tables, bit for bit
            self.cos_Wd, self.sin_Wd = torch.cat([cos_Wd, cos_Wd], -1), torch.cat([-sin_Wd, sin_Wd], -1)  # rope_step's
            # The flat row of (b, k or v, h, position 0) in a cache row's [2*B*H*W, Dh] view.
            first_BH = torch.arange(B * cfg.n_heads, device=device).view(B, 1, cfg.n_heads) * W
            self.first_B2H = first_BH + torch.tensor([0, B * cfg.n_heads * W], device=device)[:, None]
            self.slot_1 = torch.zeros(1, dtype=torch.long, device=device)  # this step's row of noise_CBV / out_CB
            self.out_CB = torch.zeros(self.chunk, B, dtype=torch.long, device=device)
            self.keys_B2 = stream_keys(seeds, device)
            self.noise_CBV = torch.zeros(self.chunk, B, V, device=device) if temperature > 0 else None
            self._cast_weights()
        self.logits_BV: Tensor | None = None  # the last step's logits (the graph's output when captured)
        self.t = 0                 # characters written per stream
        self._row = self.chunk     # rows of out_CB written in this chunk (full: the first advance starts one)
        self._read = self.chunk    # rows of out_CB already read back
        self._backlog: list[list[int]] = []
        self.graph = self._capture() if graphs else None

    def _cast_weights(self) -> None:
        """The matmul weights in the writing dtype, once (on the CPU these are the parameters themselves)."""
        def cast(w: Tensor) -> Tensor:
            return w.detach().to(self.dtype)
        rows, model = self.model.rows, self.model
        self.w_qkv = [cast(row.attn.qkv.weight) for row in rows]
        self.w_proj = [cast(row.attn.proj.weight) for row in rows]
        self.w_head = cast(model.head.weight)
        norm = lambda m: (m.weight.detach(), m.eps)  # noqa: E731
        self.attn_norms, self.mlp_norms = [norm(r.attn_norm) for r in rows], [norm(r.mlp_norm) for r in rows]
        self.final_norm = norm(model.final_norm)
        self.mlps = [self._mlp(row.mlp, cast) for row in rows]

    def _mlp(self, mlp, cast) -> MLPWeights:
        if isinstance(mlp, DenseMLP):
            return MLPWeights("dense", (cast(mlp.gate_up), cast(mlp.down)), products=self.products)
        if not isinstance(mlp, PooledMLP):
            raise ValueError(f"cannot decode a row whose MLP is a {type(mlp).__name__}")
        router = mlp.router
        route = (router.weight.detach(), router.selection_bias if router.aux_free_bias else None)
        if not isinstance(mlp.experts, ExpertStack):  # frozen: through the seam
            if self.expert_path == "grouped":
                raise ValueError("expert_path 'grouped' runs whole resident stacks; this pool's experts are "
                                 "frozen (their chosen experts are dequantized: use 'gathered' or 'auto')")
            if self.qkv_step is not decode_step.qkv_step:
                raise ValueError("a compiled step runs resident experts; this pool's experts are frozen")
            return MLPWeights("stack", route, mlp.cfg.top_k, stack=mlp.experts, products=self.products)
        grouped = self.expert_path == "grouped" or (self.expert_path == "auto" and auto_grouped(mlp, self.n_streams))
        stacks = (cast(mlp.experts.gate_up), cast(mlp.experts.down))
        if self.products and not grouped:  # decode_step.gathered_products sums along contiguous memory
            stacks = tuple(s.transpose(1, 2).contiguous() for s in stacks)
        return MLPWeights("grouped" if grouped else "gathered", route + stacks, mlp.cfg.top_k,
                          fused=mlp.cfg.swiglu == "auto", products=self.products)

    # ------------------------------------------------------------------ the step (captured)

    def _attend(self, i: int, q_BHd: Tensor, kv_B2Hd: Tensor, mask_B11W: Tensor, slots_N: Tensor) -> Tensor:
        """Write row i's new keys and values at each stream's position (in place), attend: [B, H, 1, Dh]."""
        self.kv_R2BHWd[i].view(-1, self.head_dim).index_copy_(0, slots_N, kv_B2Hd.reshape(-1, self.head_dim))
        k_BHWd, v_BHWd = self.k_RBHWd[i], self.v_RBHWd[i]
        if self.products:
            return self.attend_step(q_BHd, k_BHWd, v_BHWd, mask_B11W)
        return F.scaled_dot_product_attention(q_BHd.unsqueeze(2), k_BHWd, v_BHWd, attn_mask=mask_B11W)

    def _forward(self) -> Tensor:
        """fp32 logits [B, V] of the character after tok_B (fed at pos_B); writes its keys and values."""
        model, pos_B = self.model, self.pos_B
        x_BD = model.embed(self.tok_B)
        cos_B11d, sin_B11d = self.cos_Wd[pos_B][:, None, None], self.sin_Wd[pos_B][:, None, None]
        future_BW = self.positions_W > pos_B[:, None]  # keys a query must not see (stale slots included)
        mask_B11W = torch.zeros(future_BW.shape, dtype=self.dtype, device=self.device).masked_fill_(
            future_BW, -math.inf)[:, None, None, :]
        slots_N = (self.first_B2H + pos_B[:, None, None]).view(-1)  # N = B*2*H rows of a cache row's view
        for i in range(len(model.rows)):
            q, kv = self.qkv_step(x_BD, *self.attn_norms[i], self.w_qkv[i], cos_B11d, sin_B11d, self.n_heads,
                                  self.products)
            y_BH1d = self._attend(i, q, kv, mask_B11W, slots_N)
            x_BD = self.tail_step(x_BD, y_BH1d, self.w_proj[i], *self.mlp_norms[i], self.mlps[i])
        return self.head_step(x_BD, *self.final_norm, self.w_head, self.products)

    def _step(self) -> Tensor:
        """One character of every stream: forward, pick, record; the unit a CUDA graph captures."""
        logits_BV = self._forward()
        noise_BV = None if self.noise_CBV is None else self.noise_CBV.index_select(0, self.slot_1)[0]
        next_B = pick(logits_BV, self.temperature, self.top_k, noise_BV)
        self.out_CB.index_copy_(0, self.slot_1, next_B[None])
        self.tok_B.copy_(next_B)
        self.pos_B.add_(1)
        self.slot_1.add_(1)
        return logits_BV

    @contextlib.contextmanager
    def _step_context(self):
        """What an eager step or the capture runs under: no autograd, and on CUDA bf16 autocast
        without its cast cache (a capture must not keep casts made outside it)."""
        cast = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if self.device.type == "cuda"
                else contextlib.nullcontext())
        with torch.inference_mode(), cast:
            yield

    def _capture(self) -> "torch.cuda.CUDAGraph":
        """Warm up on a side stream (as torch.cuda.graphs asks), capture one step, undo the warm-up."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), self._step_context():
                for _ in range(_WARMUP_STEPS):
                    self.pos_B.zero_()  # a window may be shorter than the warm-up
                    self._step()
            torch.cuda.current_stream().wait_stream(side)
            with self._step_context(), torch.cuda.graph(graph):
                self.logits_BV = self._step()
        with torch.inference_mode():  # warm-up wrote at positions 0..2: prefill and steps overwrite or mask them
            for t in (self.pos_B, self.tok_B, self.slot_1):
                t.zero_()
        return graph

    # ------------------------------------------------------------------ host side

    def advance(self) -> None:
        """Write one character of every stream (no host sync: `read` brings them back)."""
        if self._row == self.chunk:
            self._new_chunk()
        if self.graph is not None:
            self.graph.replay()
        else:
            with self._step_context():
                self.logits_BV = self._step()
        self._row += 1
        self.t += 1

    def _new_chunk(self) -> None:
        """Keep the unread characters, make the noise of the next C steps, start the rows over."""
        self._backlog += self.out_CB[self._read:self._row].tolist()
        with torch.inference_mode():
            if self.noise_CBV is not None:
                counts_C = torch.arange(self.t, self.t + self.chunk, device=self.device)
                self.noise_CBV.copy_(gumbel_noise(self.keys_B2, counts_C, self.model.vocab_size))
            self.slot_1.zero_()
        self._row = self._read = 0

    def read(self) -> list[list[int]]:
        """The characters written since the last read: one list of B ids per step (one host sync)."""
        rows = self._backlog + self.out_CB[self._read:self._row].tolist()
        self._backlog, self._read = [], self._row
        return rows

    def prefill(self, streams: list[int], windows: list[list[int]]) -> None:
        """Start `streams` over at position 0 on `windows` (1..W character ids each): all but the last
        character go into the stream's cache (the model's forward; equal windows run once), the last is
        the next step's input."""
        for window in windows:
            if not 1 <= len(window) <= self.window:
                raise ValueError(f"a window holds 1..{self.window} characters; got {len(window)}")
        targets: dict[tuple[int, ...], list[int]] = {}
        for b, window in zip(streams, windows):
            targets.setdefault(tuple(window), []).append(b)
        with inference(self.model, self.device):
            for n in sorted({len(w) - 1 for w in targets} - {0}):
                self._prefill_group([w for w in targets if len(w) - 1 == n], targets, n)
            index = torch.tensor(streams, device=self.device)
            self.pos_B[index] = torch.tensor([len(w) - 1 for w in windows], device=self.device)
            self.tok_B[index] = torch.tensor([w[-1] for w in windows], device=self.device)

    def _prefill_group(self, group: list[tuple[int, ...]], targets: dict, n: int) -> None:
        """Distinct windows of n + 1 characters: their first n through the model at once, into their streams."""
        cache = self.model.new_cache(len(group), n)
        self.model(torch.tensor([w[:-1] for w in group], device=self.device), cache=cache)
        dest = [(b, j) for j, w in enumerate(group) for b in targets[w]]
        streams = torch.tensor([b for b, _ in dest], device=self.device)
        rows = torch.tensor([j for _, j in dest], device=self.device)
        self.k_RBHWd[:, streams, :, :n] = cache.k[:, rows].to(self.dtype)
        self.v_RBHWd[:, streams, :, :n] = cache.v[:, rows].to(self.dtype)


_COMPILED: tuple | None = None


def _compiled_pieces() -> tuple:
    """qkv_step, attend_step, tail_step and head_step through torch.compile, made once per process
    (dynamo's cache then serves every decoder of the same shapes)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = tuple(torch.compile(f, dynamic=False) for f in
                          (decode_step.qkv_step, decode_step.attend_step, decode_step.tail_step, decode_step.head_step))
    return _COMPILED
