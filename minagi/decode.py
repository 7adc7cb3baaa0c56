"""Writing at fixed shapes: a static KV cache indexed by a position tensor, and the one-character step
that a CUDA graph captures.

Shape legend: B streams, W window (cache positions), R model rows, H heads, Dh head width, D model
width, V vocabulary, K top_k, S = B*K routed rows, F expert width, C steps of one noise table.

`Decoder` holds, for B streams written side by side, everything a step reads or writes, allocated
once: the cache [R, B, H, W, Dh] (per row a contiguous [B, H, W, Dh]), each stream's position `pos_B`
(where its next key goes) and input character `tok_B`, RoPE tables for positions 0..W-1, the
sampling noise of the next C steps, and the characters written. A step (`_step`) embeds `tok_B`,
writes each row's new key and value at `pos_B` in place (index_copy_ into the row's flat view),
attends over the whole window with a mask that keeps keys at positions <= the query's, runs the
MLP, samples on the device and advances `pos_B`, `tok_B` and the noise slot. Its shapes never
change and it has no host sync and no Python branch on data, so one CUDA graph replays it for every
character (`graphs=True`): the kernels the eager step launches, in the same buffers, nothing copied.

The expert path is gpt-fast's (mixtral-moe): route, gather the top_k chosen experts' weights of each
routed row through the expert-weights seam (`stack.weights(dtype, experts=ids_S)`: [S, D, 2F],
[S, F, D]; frozen NF4 stacks dequantize just those experts) and multiply per routed row with bmm.
One character reads top_k experts; no sort, no counts, no host sync. Writing is dropless and
computes no aux terms. The dense twin is one SwiGLU.

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

from .dense import DenseMLP, dense_swiglu
from .devices import autocast
from .experts import ExpertStack
from .gumbel import gumbel_noise, pick, stream_keys
from .model import CharLM, rope_tables
from .pool import PooledMLP, compute_dtype
from .swiglu import swiglu_eager

__all__ = ["Decoder", "inference"]

_WARMUP_STEPS = 3          # eager steps before a capture: cuBLAS handles, allocations, Triton tables
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


class _CastStack:
    """A trainable stack held once in the writing dtype (bf16 on CUDA), so that each character reads
    its top_k experts in that dtype instead of reading fp32 and casting. Same `weights` contract."""

    def __init__(self, stack: ExpertStack, dtype: torch.dtype):
        self.gate_up, self.down = stack.gate_up.detach().to(dtype), stack.down.detach().to(dtype)

    def weights(self, dtype: torch.dtype, experts: Tensor) -> tuple[Tensor, Tensor]:
        return self.gate_up.index_select(0, experts).to(dtype), self.down.index_select(0, experts).to(dtype)


def rope_step(x: Tensor, cos_d: Tensor, sin_d: Tensor) -> Tensor:
    """model.apply_rope's rotation, bit for bit, in fewer kernels: x cos + roll(x) sin, with tables
    cos_d = [cos, cos] and sin_d = [-sin, sin] ([..., Dh], broadcast against x [..., Dh])."""
    x_f = x.float()
    return (x_f * cos_d + x_f.roll(x.shape[-1] // 2, -1) * sin_d).to(x.dtype)


def routed_step(pool: PooledMLP, stack, x_BD: Tensor) -> Tensor:
    """[B, D] -> [B, D] in the compute dtype: each character through its top_k experts, one bmm pair
    over the S routed rows. (The residual add promotes it: the same bits as casting first.)"""
    routing = pool.router(x_BD)
    B, D = x_BD.shape
    K = routing.expert_ids_NK.shape[1]
    dtype = compute_dtype(x_BD)
    gate_up_SDF2, down_SFD = stack.weights(dtype, experts=routing.expert_ids_NK.reshape(-1))
    x_S1D = x_BD.to(dtype)[:, None, :].expand(B, K, D).reshape(B * K, 1, D)
    act_S1F = swiglu_eager(torch.bmm(x_S1D, gate_up_SDF2), routing.gates_NK.to(dtype).reshape(B * K, 1))
    return torch.bmm(act_S1F, down_SFD).view(B, K, D).sum(1)  # the K outputs in routing order, as combine


def dense_step(gate_up_DH2: Tensor, down_HD: Tensor, x_BD: Tensor) -> Tensor:
    """[B, D] -> [B, D] in the compute dtype: DenseMLP's SwiGLU."""
    return dense_swiglu(x_BD.to(compute_dtype(x_BD)), gate_up_DH2, down_HD)


class Decoder:
    """B streams of `model` over a window of W positions: prefill, advance one character, read back.

    seeds: one per stream (its noise, minagi/gumbel.py). temperature / top_k: as `gumbel.pick`.
    graphs: capture the step in a CUDA graph (the model must be on a CUDA device).
    The decoder copies no state back into the model; build a new one after the weights change
    (on CUDA it holds bf16 copies of the matmul weights).
    """

    def __init__(self, model: CharLM, seeds: list[int], window: int, *, temperature: float = 0.0,
                 top_k: int = 0, graphs: bool = False):
        device = model.embed.weight.device
        if graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {device.type}")
        cfg = model.cfg
        self.model, self.device, self.window = model, device, window
        self.temperature, self.top_k = temperature, top_k
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what autocast computes in
        B, W, V = len(seeds), window, model.vocab_size
        self.chunk = max(16, min(256, _NOISE_ELEMENTS // (B * V)))
        with torch.inference_mode():
            shape = (cfg.n_rows, B, cfg.n_heads, W, cfg.head_dim)
            self.k_RBHWd = torch.zeros(shape, dtype=self.dtype, device=device)
            self.v_RBHWd = torch.zeros(shape, dtype=self.dtype, device=device)
            self.pos_B = torch.zeros(B, dtype=torch.long, device=device)
            self.tok_B = torch.zeros(B, dtype=torch.long, device=device)
            self.positions_W = torch.arange(W, device=device)
            cos_Wd, sin_Wd = rope_tables(self.positions_W, cfg.head_dim, cfg.rope_base)
            self.cos_Wd, self.sin_Wd = torch.cat([cos_Wd, cos_Wd], -1), torch.cat([-sin_Wd, sin_Wd], -1)  # rope_step's
            self.first_BH = torch.arange(B * cfg.n_heads, device=device).view(B, cfg.n_heads) * W  # flat row of (b, h, 0)
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
        rows = self.model.rows
        self.w_qkv = [cast(row.attn.qkv.weight) for row in rows]
        self.w_proj = [cast(row.attn.proj.weight) for row in rows]
        self.w_head = cast(self.model.head.weight)
        self.mlps = []
        for row in rows:
            if isinstance(row.mlp, PooledMLP):
                stack = row.mlp.experts
                if isinstance(stack, ExpertStack) and stack.gate_up.dtype != self.dtype:
                    stack = _CastStack(stack, self.dtype)
                self.mlps.append(lambda x, pool=row.mlp, stack=stack: routed_step(pool, stack, x))
            elif isinstance(row.mlp, DenseMLP):
                self.mlps.append(lambda x, gu=cast(row.mlp.gate_up), dn=cast(row.mlp.down): dense_step(gu, dn, x))
            else:
                raise ValueError(f"cannot decode a row whose MLP is a {type(row.mlp).__name__}")

    # ------------------------------------------------------------------ the step (captured)

    def _attention(self, i: int, x_BD: Tensor, cos_B11d: Tensor, sin_B11d: Tensor, mask_B11W: Tensor,
                   slots_N: Tensor) -> Tensor:
        B, Dh = x_BD.shape[0], self.head_dim
        qkv_B3Hd = F.linear(x_BD, self.w_qkv[i]).view(B, 3, self.n_heads, Dh)
        qk_B2Hd = rope_step(qkv_B3Hd[:, :2], cos_B11d, sin_B11d)  # q and k rotated together
        q, k, v = qk_B2Hd[:, 0], qk_B2Hd[:, 1], qkv_B3Hd[:, 2]  # [B, H, Dh] each
        k_BHWd, v_BHWd = self.k_RBHWd[i], self.v_RBHWd[i]
        k_BHWd.view(-1, Dh).index_copy_(0, slots_N, k.reshape(-1, Dh))  # in place, at each stream's pos
        v_BHWd.view(-1, Dh).index_copy_(0, slots_N, v.reshape(-1, Dh))
        y_BH1d = F.scaled_dot_product_attention(q.unsqueeze(2), k_BHWd, v_BHWd, attn_mask=mask_B11W)
        return F.linear(y_BH1d.reshape(B, -1), self.w_proj[i])

    def _forward(self) -> Tensor:
        """fp32 logits [B, V] of the character after tok_B (fed at pos_B); writes its keys and values."""
        model, pos_B = self.model, self.pos_B
        x_BD = model.embed(self.tok_B)
        cos_B11d, sin_B11d = self.cos_Wd[pos_B][:, None, None], self.sin_Wd[pos_B][:, None, None]
        future_BW = self.positions_W > pos_B[:, None]  # keys a query must not see (stale slots included)
        mask_B11W = torch.zeros(future_BW.shape, dtype=self.dtype, device=self.device).masked_fill_(
            future_BW, -math.inf)[:, None, None, :]
        slots_N = (self.first_BH + pos_B[:, None]).view(-1)  # N = B*H rows of a cache row's [B*H*W, Dh] view
        for i, row in enumerate(model.rows):
            x_BD = x_BD + self._attention(i, row.attn_norm(x_BD), cos_B11d, sin_B11d, mask_B11W, slots_N)
            x_BD = x_BD + self.mlps[i](row.mlp_norm(x_BD))
        return F.linear(model.final_norm(x_BD), self.w_head).float()

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
