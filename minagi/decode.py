"""Writing at fixed shapes: a static KV cache indexed by a position tensor, and the one-character step
that a CUDA graph captures.

Shape legend: B streams, W window (cache positions), R model rows, H heads, Dh head width, D model
width, V vocabulary, K top_k, S = B*K routed rows, F expert width, C steps of one noise table.

`Decoder` holds, for B streams written side by side, everything a step reads or writes, allocated
once: the cache [R, 2, B, H, W, Dh] (per row its keys, then its values: one index_copy_ writes
both), the character fed at each cache position `text_BW`, each stream's position `pos_B`
(where its next key goes) and input character `tok_B`, RoPE tables for positions 0..W-1, the
sampling noise of the next C steps, and the characters written. A step (`_step`) records `tok_B` in
`text_BW`, embeds it,
writes each row's new key and value at `pos_B` in place (index_copy_ into the row's flat view),
attends over the whole window with a mask that keeps keys at positions <= the query's, runs the
MLP, samples on the device and advances `pos_B`, `tok_B` and the noise slot. Its shapes never
change and it has no host sync and no Python branch on data, so one CUDA graph replays it for every
character (`graphs=True`): the kernels the eager step launches, in the same buffers, nothing copied.

The step's math is minagi/rowmath.py's, the model's own row functions, cut into pieces where the
cache write goes (minagi/decode_step.py: functions of tensors, so that `compiled=True` can hand them
to torch.compile: fused kernels; the in-place cache writes stay eager here). With few streams a
compiled step writes its products as sums (`products`, decode_step.py): inductor then fuses them
with the experts' gather, the top-k and the attention.
Each row's MLP makes its own step (`mlp.decoder(...)`, decode_step.py). The pools' is gpt-fast's
(mixtral-moe): route, gather the top_k chosen experts' weights of each routed row (frozen NF4
stacks, through the expert-weights seam, dequantize just those experts) and multiply per routed row
with bmm: no sort, no counts, no host sync. That reads an expert once per stream that chose it, so
with many streams, where the pool's own path is torch's grouped GEMM ("native") and the stack is
resident, the step runs that path instead (each chosen expert read once a step, however many
streams chose it; its sort and counts make no host sync either). Writing is dropless and computes no
aux terms. The dense twin is one SwiGLU.

A window's characters but the last are *prefilled* (`_window_forward`: the model's row over T
positions at once, causal attention among them, each MLP's window form) into the stream's slots;
the last is the next step's input. A *slide* (`slide`) restarts a stream on its last `keep`
characters from `text_BW`, on the device: no host read, and where every row's prefill has no host
sync (resident experts on torch's grouped GEMM, or the dense twin) one CUDA graph a number of
sliding streams replays it. The driver (minagi/sampling.py `write`) decides when a stream
slides and reads the characters back: each step's row is copied to pinned host memory behind the
step, so a read waits for that step only, not for the one queued after it.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from . import decode_step, rowmath
from .decode_step import StepOptions, auto_grouped
from .devices import autocast
from .dispatch import host_to_device
from .gumbel import gumbel_noise, pick, stream_keys
from .mlp import device_compute_dtype
from .model import CharLM

__all__ = ["EXPERT_PATHS", "PIECES", "Decoder", "auto_grouped", "compiled_pieces", "default_keep", "inference",
           "resolve_products"]

EXPERT_PATHS = ("auto", "gathered", "grouped")

_WARMUP_STEPS = 3          # eager steps before a capture: cuBLAS handles, allocations, Triton tables
_PRODUCTS_MAX_STREAMS = 8  # compiled, `products` up to this many streams (beyond, GEMMs reuse weights)
_NOISE_ELEMENTS = 1 << 22  # noise table size that sets C (steps of noise made at once), within 16..256


def resolve_products(products: bool | None, compiled: bool, streams: int) -> bool:
    """The step's products as sums (`Decoder`'s `products`): None = compiled for at most
    _PRODUCTS_MAX_STREAMS streams."""
    return compiled and streams <= _PRODUCTS_MAX_STREAMS if products is None else products


def default_keep(window: int) -> int:
    """Characters re-prefilled on a slide: 7/8 of the window (at least 1)."""
    return max(1, window - window // 8)


@contextlib.contextmanager
def inference(model: CharLM, device: torch.device):
    """One forward call's settings: eval mode, no autograd, bf16 autocast on CUDA. Writing's forward
    calls pass `dropless=True` too: with capacity_factor > 0 a character's output would depend on
    which other characters share the call (a prefill of 60 may drop, a step of 1 never does), so the
    cache and the recomputation would disagree. Capacity is a training-throughput knob.

    Entered per call, never across a `yield`: thread-local grad mode and the model's train flag
    would otherwise leak into the caller's code between two characters.
    """
    was_training = model.training
    if was_training:  # .eval() walks every module: skip it when there is nothing to change
        model.eval()
    try:
        with torch.inference_mode(), autocast(device):
            yield
    finally:
        if was_training:
            model.train()


class Decoder:
    """B streams of `model` over a window of W positions: prefill, advance one character, read back.

    seeds: one per stream (its noise, minagi/gumbel.py). keep: characters a slide restarts a stream on
    (default `default_keep(window)`). temperature / top_k / top_p: as `gumbel.pick` (top-k first, then
    the top-p nucleus of what it kept).
    graphs: capture the step in a CUDA graph (the model must be on a CUDA device).
    expert_path: `gathered` (each routed row's experts gathered, as gpt-fast), `grouped` (the grouped
    GEMM on the whole resident stacks), or `auto`: grouped where the pool itself runs torch's
    grouped GEMM ("native") on a trainable stack and streams x top_k >= 2 x n_experts, else
    gathered (docs/benchmarks.md §11). Gathered, a step's bits for a stream never depend on the
    others; grouped, they may by bf16 rounding (the GEMM's tiling follows how many rows each expert
    has), and so may a prefill's or a slide's, which run the streams sliding together as one batch.
    read_in_place: offloaded frozen stacks read each step's chosen experts from their pinned homes
    (minagi/offload.py), where False stages their rows.
    compiled: run the step's pieces (minagi/decode_step.py) through torch.compile: fewer, fused
    kernels for a first-use compile (CUDA only, resident experts only). pieces: the compiled
    pieces to run, in `PIECES`' order (sampling passes compile_cache.PrecompiledPieces' calls);
    None: torch.compile's, one set a process.
    products: the step's matrix-vector products as products and sums (decode_step.py); None = where
    the step is compiled for at most _PRODUCTS_MAX_STREAMS streams. Eager it is slow (it
    materialises the products) but the same math, which the CPU tests use.
    The decoder copies no state back into the model; build a new one after the weights change
    (on CUDA it holds bf16 copies of the matmul weights).
    """

    def __init__(self, model: CharLM, seeds: list[int], window: int, *, keep: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, graphs: bool = False, expert_path: str = "auto",
                 compiled: bool = False, products: bool | None = None, read_in_place: bool = False,
                 top_p: float = 1.0, pieces: tuple | None = None):
        device = model.embed.weight.device
        _check(device, window, keep, graphs, expert_path, compiled)
        self.expert_path, self.read_in_place = expert_path, read_in_place
        self.products = resolve_products(products, compiled, len(seeds))
        self.qkv_step, self.attend_step, self.tail_step, self.head_step = (
            (pieces or compiled_pieces()) if compiled else _EAGER_PIECES)
        self.model, self.device, self.window = model, device, window
        self.keep = default_keep(window) if keep is None else keep
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.n_heads, self.head_dim = model.cfg.n_heads, model.cfg.head_dim
        self.dtype = device_compute_dtype(device)  # what autocast computes in
        self.n_streams = len(seeds)
        self.chunk = max(16, min(256, _NOISE_ELEMENTS // (len(seeds) * model.vocab_size)))
        with torch.inference_mode():
            self._allocate(seeds)
            self._cast_weights(StepOptions(lambda w: w.detach().to(self.dtype), len(seeds), expert_path,
                                           self.products, compiled, read_in_place))
        self.logits_BV: Tensor | None = None  # the last step's logits (the graph's output when captured)
        self.t = 0                 # characters written per stream
        self._row = self.chunk     # rows of out_CB written in this chunk (full: the first advance starts one)
        self._read = self.chunk    # rows of out_CB already read back
        self._backlog: list[list[int]] = []
        self.graph = None
        if graphs or compiled:  # a window may be shorter than the warm-up: each warm-up step writes at position 0
            if graphs:
                self.graph, self.logits_BV = self._capture(self._step, before=self.pos_B.zero_)
            else:  # compiled, eager steps: the compile now, with the capture's warm-up, not at the first character
                self._warm_up(self._step, before=self.pos_B.zero_)
            with torch.inference_mode():  # prefill and steps overwrite or mask what the warm-up wrote
                for t in (self.pos_B, self.tok_B, self.slot_1):
                    t.zero_()
        # A slide's graph per number of streams (where every row's prefill is free of host syncs):
        # captured by `prepare_slides`, which `write` calls before writing, or at the first such slide.
        self._slides: dict[int, tuple[Tensor, "torch.cuda.CUDAGraph"]] = {}
        self._slide_pool = torch.cuda.graph_pool_handle() if graphs else None  # the slides' graphs share it
        self.slide_graphs = graphs and not any(m.host_sync for m in self.window_mlps)

    def _allocate(self, seeds: list[int]) -> None:
        """Everything a step reads or writes, once (module docstring)."""
        cfg, device = self.model.cfg, self.device
        B, W, V, H = len(seeds), self.window, self.model.vocab_size, cfg.n_heads
        self.kv_R2BHWd = torch.zeros((cfg.n_rows, 2, B, H, W, cfg.head_dim), dtype=self.dtype, device=device)
        self.k_RBHWd, self.v_RBHWd = self.kv_R2BHWd[:, 0], self.kv_R2BHWd[:, 1]  # views
        self.pos_B = torch.zeros(B, dtype=torch.long, device=device)
        self.tok_B = torch.zeros(B, dtype=torch.long, device=device)
        self.text_BW = torch.zeros(B, W, dtype=torch.long, device=device)  # the character at each cache slot
        self.positions_W = torch.arange(W, device=device)
        # The prefill's tables, bit for bit, as rowmath.rope_rolled takes them.
        self.cos_Wd, self.sin_Wd = self.model.rows[0].attn.rolled_rope(W, device)
        # The flat row of (b, k or v, h, position 0) in a cache row's [2*B*H*W, Dh] view.
        first_BH = torch.arange(B * H, device=device).view(B, 1, H) * W
        self.first_B2H = first_BH + torch.tensor([0, B * H * W], device=device)[:, None]
        self.slot_1 = torch.zeros(1, dtype=torch.long, device=device)  # this step's row of noise_CBV / out_CB
        self.out_CB = torch.zeros(self.chunk, B, dtype=torch.long, device=device)
        self.readback = _Readback(self.out_CB)
        self.keys_B2 = stream_keys(seeds, device)
        self.noise_CBV = torch.zeros(self.chunk, B, V, device=device) if self.temperature > 0 else None

    def _cast_weights(self, options: StepOptions) -> None:
        """The matmul weights in the writing dtype, once (on the CPU these are the parameters
        themselves), and each row's MLP step and window form, made by the MLP itself."""
        rows, model, cast = self.model.rows, self.model, options.cast
        self.w_qkv = [cast(row.attn.qkv.weight) for row in rows]
        self.w_proj = [cast(row.attn.proj.weight) for row in rows]
        self.w_head = cast(model.head.weight)
        norm = lambda m: (m.weight.detach(), m.eps)  # noqa: E731
        self.attn_norms, self.mlp_norms = [norm(r.attn_norm) for r in rows], [norm(r.mlp_norm) for r in rows]
        self.final_norm = norm(model.final_norm)
        for row in rows:
            if not hasattr(row.mlp, "decoder"):
                raise ValueError(f"cannot decode a row whose MLP is a {type(row.mlp).__name__} (it has no decoder())")
        self.mlps, self.window_mlps = map(list, zip(*(row.mlp.decoder(options) for row in rows)))

    # ------------------------------------------------------------------ the step (captured)

    def _attend(self, i: int, q_BH1d: Tensor, kv_B2H1d: Tensor, mask_B11W: Tensor, slots_N: Tensor) -> Tensor:
        """Write row i's new keys and values at each stream's position (in place), attend: [B, H, 1, Dh]."""
        self.kv_R2BHWd[i].view(-1, self.head_dim).index_copy_(0, slots_N, kv_B2H1d.reshape(-1, self.head_dim))
        k_BHWd, v_BHWd = self.k_RBHWd[i], self.v_RBHWd[i]
        if self.products:
            return self.attend_step(q_BH1d, k_BHWd, v_BHWd, mask_B11W)
        return rowmath.window_attention(q_BH1d, k_BHWd, v_BHWd, mask_B11W)

    def _forward(self) -> Tensor:
        """fp32 logits [B, V] of the character after tok_B (fed at pos_B); writes its keys and values."""
        model, pos_B = self.model, self.pos_B
        x_B1D = model.embed(self.tok_B)[:, None]  # one position a stream
        cos_B11d, sin_B11d = self.cos_Wd[pos_B][:, None, None], self.sin_Wd[pos_B][:, None, None]
        future_BW = self.positions_W > pos_B[:, None]  # keys a query must not see (stale slots included)
        mask_B11W = torch.zeros(future_BW.shape, dtype=self.dtype, device=self.device).masked_fill_(
            future_BW, -math.inf)[:, None, None, :]
        slots_N = (self.first_B2H + pos_B[:, None, None]).view(-1)  # N = B*2*H rows of a cache row's view
        for i in range(len(model.rows)):
            q_BH1d, kv_B2H1d = self.qkv_step(x_B1D, *self.attn_norms[i], self.w_qkv[i], cos_B11d, sin_B11d,
                                             self.n_heads, self.products)
            y_BH1d = self._attend(i, q_BH1d, kv_B2H1d, mask_B11W, slots_N)
            x_B1D = self.tail_step(x_B1D, y_BH1d, self.w_proj[i], *self.mlp_norms[i], self.mlps[i], self.products)
        return self.head_step(x_B1D, *self.final_norm, self.w_head, self.products)[:, 0]

    def _step(self) -> Tensor:
        """One character of every stream: forward, pick, record; the unit a CUDA graph captures."""
        self.text_BW.scatter_(1, self.pos_B[:, None], self.tok_B[:, None])
        logits_BV = self._forward()
        noise_BV = None if self.noise_CBV is None else self.noise_CBV.index_select(0, self.slot_1)[0]
        next_B = pick(logits_BV, self.temperature, self.top_k, noise_BV, self.top_p)
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

    def _capture(self, run, before=None, pool=None) -> tuple["torch.cuda.CUDAGraph", object]:
        """Warm up `run` on a side stream (as torch.cuda.graphs asks; `before` ahead of each warm-up
        call), then capture one call of it: (the graph, what the captured call returned). `pool`: a
        memory pool shared with other graphs that never run at once and keep no output."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            self._warm_up(run, before)
            with self._step_context(), torch.cuda.graph(graph, pool=pool):
                out = run()
        return graph, out

    def _warm_up(self, run, before=None) -> None:
        """`run` _WARMUP_STEPS times on a side stream (`before` ahead of each call), the current stream
        then waiting for it: cuBLAS handles, allocations, Triton tables and a compiled step's compile."""
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), self._step_context():
                for _ in range(_WARMUP_STEPS):
                    if before is not None:
                        before()
                    run()
            torch.cuda.current_stream().wait_stream(side)

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
        self.readback.copy(self._row)
        self._row += 1
        self.t += 1

    def _new_chunk(self) -> None:
        """Keep the unread characters, make the noise of the next C steps, start the rows over."""
        self._backlog += self.readback.rows(self._read, self._row)
        with torch.inference_mode():
            if self.noise_CBV is not None:
                counts_C = torch.arange(self.t, self.t + self.chunk, device=self.device)
                self.noise_CBV.copy_(gumbel_noise(self.keys_B2, counts_C, self.model.vocab_size))
            self.slot_1.zero_()
        self._row = self._read = 0

    def read(self, lag: int = 0) -> list[list[int]]:
        """The characters written since the last read but the last `lag` steps': one list of B ids per
        step. Waits for the last step it returns only (a host sync on that step's copy), so with
        lag 1 the step queued last runs on while the host takes the one before."""
        upto = max(self._read, self._row - lag)
        rows = self._backlog + self.readback.rows(self._read, upto)
        self._backlog, self._read = [], upto
        return rows

    def prefill(self, streams: list[int], windows: list[list[int]]) -> None:
        """Start `streams` over at position 0 on `windows` (1..W character ids each): all but the last
        character go into the stream's cache (`_window_forward`, the streams of one length at once),
        the last is the next step's input."""
        for window in windows:
            if not 1 <= len(window) <= self.window:
                raise ValueError(f"a window holds 1..{self.window} characters; got {len(window)}")
        lengths: dict[int, list[int]] = {}
        with torch.inference_mode():
            index = torch.tensor(streams, device=self.device)
            self.pos_B[index] = torch.tensor([len(w) - 1 for w in windows], device=self.device)
            self.tok_B[index] = torch.tensor([w[-1] for w in windows], device=self.device)
            for b, window in zip(streams, windows):
                lengths.setdefault(len(window) - 1, []).append(b)
                if len(window) > 1:
                    self.text_BW[b, :len(window) - 1] = torch.tensor(window[:-1], device=self.device)
        for n, group in sorted(lengths.items()):
            if n > 0:
                with inference(self.model, self.device), self._step_context():
                    self._window_forward(torch.tensor(group, device=self.device), n)

    def slide(self, streams: list[int]) -> None:
        """Restart `streams` on their last `keep` characters (the keep - 1 before the last in their cache
        and the newest as the next step's input), from `text_BW`: no host read. Call it when a stream's
        window is full and its newest character written (the step after would have no slot)."""
        T = self.keep - 1
        with torch.inference_mode():
            index = host_to_device(streams, self.device)
            if T > 0:  # the last T characters of the cache to its first T slots
                rows_BW = self.text_BW.index_select(0, index)
                self.text_BW.index_copy_(0, index, rows_BW.roll(T - self.window, 1))
                self._prefill_slid(index)
            self.pos_B.index_fill_(0, index, T)

    def _prefill_slid(self, index: Tensor) -> None:
        """The keep - 1 characters now at the front of `text_BW` of streams `index` into their cache:
        replayed from a graph per number of streams where captured (idempotent: the warm-up and the
        capture recompute what they overwrite), else eagerly."""
        if not self.slide_graphs:
            with inference(self.model, self.device), self._step_context():
                self._window_forward(index, self.keep - 1)
            return
        if index.shape[0] not in self._slides:  # captured on the sliding streams themselves
            self._capture_slide(index.clone())
        static, graph = self._slides[index.shape[0]]
        static.copy_(index)
        graph.replay()

    def prepare_slides(self, sizes) -> None:
        """Capture the slide graphs of these numbers of streams now, before a prefill (the warm-up
        writes the first streams' slots, which the prefill then writes): a capture costs tens of ms
        and a device sync, a slide's replay neither."""
        for n in sizes:
            if self.slide_graphs and self.keep > 1 and n not in self._slides:
                self._capture_slide(torch.arange(n, device=self.device))

    def _capture_slide(self, static: Tensor) -> None:
        """A slide's prefill for len(static) streams as a graph reading their ids from `static`; its
        warm-up and capture recompute the slots of the streams in `static` from their own characters."""
        graph, _ = self._capture(lambda: self._window_forward(static, self.keep - 1), pool=self._slide_pool)
        self._slides[static.shape[0]] = static, graph

    def _window_forward(self, streams_n: Tensor, T: int) -> None:
        """Keys and values of the first T characters of `text_BW` of streams_n into their cache slots
        0..T-1: the model's row over [n, T] positions (causal attention among them), each row's keys
        and values written in between. Nothing is returned: the window's last character is the next
        step's input. Static shapes; no host sync where every row's MLP window form has none."""
        Dh = self.head_dim
        x_nTD = self.model.embed(self.text_BW.index_select(0, streams_n)[:, :T])
        cos_Td, sin_Td = self.cos_Wd[:T], self.sin_Wd[:T]
        slots_N = (self.first_B2H.index_select(0, streams_n)[..., None] + self.positions_W[:T]).view(-1)  # [n, 2, H, T]
        for i in range(len(self.model.rows)):
            q_nHTd, kv_n2HTd = decode_step.qkv_step(x_nTD, *self.attn_norms[i], self.w_qkv[i], cos_Td, sin_Td,
                                                    self.n_heads)
            self.kv_R2BHWd[i].view(-1, Dh).index_copy_(0, slots_N, kv_n2HTd.reshape(-1, Dh))
            y_nHTd = rowmath.causal_attention(q_nHTd, kv_n2HTd[:, 0], kv_n2HTd[:, 1])
            x_nTD = decode_step.tail_step(x_nTD, y_nHTd, self.w_proj[i], *self.mlp_norms[i], self.window_mlps[i])


class _Readback:
    """The characters written, brought to the host behind the steps: each step's row of `out_CB` is
    copied to pinned memory right after the step (on CUDA; on the CPU the rows are already there),
    so reading rows waits for the last of them only, not for the steps queued after it."""

    def __init__(self, out_CB: Tensor):
        self.out_CB = out_CB
        self.cuda = out_CB.is_cuda
        if self.cuda:
            self.host_CB = torch.empty(out_CB.shape, dtype=out_CB.dtype, pin_memory=True)
            self.copied = [torch.cuda.Event() for _ in range(out_CB.shape[0])]

    def copy(self, row: int) -> None:
        """Start bringing `row` (written by the step just queued) to the host."""
        if self.cuda:
            with torch.inference_mode():  # both are inference tensors
                self.host_CB[row].copy_(self.out_CB[row], non_blocking=True)
            self.copied[row].record()

    def rows(self, start: int, end: int) -> list[list[int]]:
        """Rows start..end-1 (each copied): waits for the last one's copy."""
        if end <= start:
            return []
        if not self.cuda:
            return self.out_CB[start:end].tolist()
        self.copied[end - 1].synchronize()
        return self.host_CB[start:end].tolist()


def _check(device: torch.device, window: int, keep: int | None, graphs: bool, expert_path: str,
           compiled: bool) -> None:
    """A Decoder's arguments, or ValueError naming what is wrong."""
    if graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device; the model is on {device.type}")
    if expert_path not in EXPERT_PATHS:
        raise ValueError(f"expert_path must be one of {', '.join(EXPERT_PATHS)}; got {expert_path!r}")
    if compiled and device.type != "cuda":
        raise ValueError(f"a compiled step needs a CUDA device (Triton); the model is on {device.type}")
    if keep is not None and not 1 <= keep <= window:
        raise ValueError(f"keep must be 1..{window} (the window); got {keep}")


PIECES = {"qkv": decode_step.qkv_step, "attend": rowmath.attend_products, "tail": decode_step.tail_step,
          "head": decode_step.head_step}  # the step's pieces a compiled step compiles, by name
_EAGER_PIECES = tuple(PIECES.values())
_COMPILED: tuple | None = None


def compiled_pieces() -> tuple:
    """qkv_step, attend_products, tail_step and head_step through torch.compile, made once per process
    (dynamo's cache then serves every decoder of the same shapes)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = tuple(torch.compile(f, dynamic=False) for f in _EAGER_PIECES)
    return _COMPILED
