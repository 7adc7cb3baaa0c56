"""The character-level MoE language model: rows of attention + PooledMLP (or the dense twin), and a KV cache.

`KVCache` grows with a Python length (prefill, `generate`'s one-position steps); the static cache
and the fixed-shape step that writing runs live in minagi/decode.py, on the same weights, RoPE
(`rope_tables`, `apply_rope`) and modules.

Shape legend: B batch, T positions, D model width, H heads, Dh head width, V vocabulary,
L cached length, N = B*T characters.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import recompute
from .config import ExpertsConfig, ModelConfig, PoolConfig
from .dense import DenseMLP
from .dispatch import resolve_dispatch
from .experts import StackServices, build_stack, stack_services
from .mlp import BalanceArgs, MLPAux, device_compute_dtype
from .pool import PooledMLP
from .router import Router


class LMOutput(NamedTuple):
    logits: Tensor            # [B, T, V]
    loss: Tensor | None       # mean cross-entropy in nats, when targets are given
    aux_loss: Tensor          # routing terms (balance + z-loss), already weighted; add to loss to train
    routing: list             # per row: its pool's RouteCounts (None for a dense row); the trainer counts them


class KVCache:
    """Keys and values of every row for incremental decoding: [rows, B, H, max_len, Dh]."""

    def __init__(self, n_rows: int, batch_size: int, n_heads: int, head_dim: int, max_len: int):
        self.shape = (n_rows, batch_size, n_heads, max_len, head_dim)
        self.max_len = max_len
        self.length = 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def update(self, row: int, k_BHTd: Tensor, v_BHTd: Tensor) -> tuple[Tensor, Tensor]:
        """Append this call's keys/values for `row`; return all cached so far (this call included)."""
        if self.k is None:  # allocated lazily, in the dtype attention runs in
            self.k = k_BHTd.new_zeros(self.shape)
            self.v = v_BHTd.new_zeros(self.shape)
        end = self.length + k_BHTd.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache is full: {end} positions > max_len {self.max_len}")
        self.k[row, :, :, self.length:end] = k_BHTd
        self.v[row, :, :, self.length:end] = v_BHTd
        return self.k[row, :, :, :end], self.v[row, :, :, :end]


def rope_tables(positions_T: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions_T.device, dtype=torch.float32) / head_dim)
    angles_Td = torch.outer(positions_T.float(), inv_freq)  # [T, Dh/2]
    return angles_Td.cos(), angles_Td.sin()


def apply_rope(x_BHTd: Tensor, cos_Td: Tensor, sin_Td: Tensor) -> Tensor:
    x1, x2 = x_BHTd.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos_Td - x2 * sin_Td, x1 * sin_Td + x2 * cos_Td), dim=-1)
    return rotated.to(x_BHTd.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_base = cfg.n_heads, cfg.head_dim, cfg.rope_base
        self.dropout = cfg.dropout  # on the attention probabilities, in training only (as nanoGPT)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        # RoPE tables for the context's positions, made once: computed in forward, a compiled step
        # fused the cos/sin into every rotated element (37 of a 156 ms h200 step, docs/benchmarks.md §10).
        # Not persistent: checkpoints stay as they were.
        cos_Td, sin_Td = rope_tables(torch.arange(cfg.context), cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos_Td, persistent=False)
        self.register_buffer("rope_sin", sin_Td, persistent=False)

    def rope(self, start: int, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos, sin [T, Dh/2] of positions start..start+T-1: the tables' rows, or made for positions
        past the context (a longer cache) and for tables a dtype cast has rounded (model.half())."""
        if start + T <= self.rope_cos.shape[0] and self.rope_cos.dtype == torch.float32:
            return self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        return rope_tables(torch.arange(start, start + T, device=device), self.head_dim, self.rope_base)

    def forward(self, x_BTD: Tensor, row: int, cache: KVCache | None) -> Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x [B,H,T,Dh]
        start = cache.length if cache is not None else 0
        cos, sin = self.rope(start, T, x_BTD.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(row, k, v)  # [B, H, L, Dh]
        if start == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        elif T == 1:  # one new position sees everything cached
            y = F.scaled_dot_product_attention(q, k, v)
        else:  # a chunk appended to a cache: query i sees keys up to start + i
            mask_TL = torch.arange(k.shape[2], device=x_BTD.device) <= torch.arange(start, start + T, device=x_BTD.device)[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_TL)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Row(nn.Module):
    """Pre-norm causal self-attention, then an MLP: pooled experts, or the dense twin. `checkpointed`:
    recomputed in backward (row checkpointing, minagi/recompute.py)."""

    def __init__(self, cfg: ModelConfig, make_mlp: Callable[[], nn.Module], checkpointed: bool = False):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp = make_mlp()  # built after the attention: the order in which parameters draw from the seed
        self.resid_drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.checkpointed = checkpointed

    def forward(self, x_BTD: Tensor, row: int, cache: KVCache | None, dropless: bool = False,
                step_counts_E: Tensor | None = None) -> tuple[Tensor, MLPAux]:
        """`step_counts_E`: the optimizer step's routed rows per expert, for the pool's balance term."""
        if self.checkpointed:
            return recompute.checkpointed(self._forward, x_BTD, row, cache, dropless, step_counts_E)
        return self._forward(x_BTD, row, cache, dropless, step_counts_E)

    def _forward(self, x_BTD: Tensor, row: int, cache: KVCache | None, dropless: bool,
                 step_counts_E: Tensor | None = None) -> tuple[Tensor, MLPAux]:
        x_BTD = x_BTD + self.resid_drop(self.attn(self.attn_norm(x_BTD), row, cache))
        B, T, D = x_BTD.shape
        y_ND, aux = self.mlp(self.mlp_norm(x_BTD).reshape(B * T, D), dropless=dropless,
                             balance=BalanceArgs(B, step_counts_E))
        return x_BTD + self.resid_drop(y_ND.view(B, T, D)), aux


class CharLM(nn.Module):
    """Embedding, `n_rows` rows, final norm, head.
    `forward(idx, targets=None, cache=None, dropless=False) -> LMOutput`.

    Built whole (`build_model` resolves the pieces for a device): `stacks`, the services each row's
    expert stack is built with (minagi/experts.py; trainable stacks without); `checkpoint_rows`, rows
    recomputed in backward; `count_reducer`, what sums the pools' balance counts over ranks (DDP).
    `stager`: the offload stager the frozen stacks are staged by (None without offload).
    """

    def __init__(self, cfg: ModelConfig, pool: PoolConfig, vocab_size: int, path: str = "grouped",
                 dense_width: int = 0, *, stacks: StackServices | None = None, checkpoint_rows: bool = False,
                 count_reducer: Callable[[Tensor], Tensor] | None = None):
        super().__init__()
        self.cfg, self.pool_cfg, self.vocab_size = cfg, pool, vocab_size
        stacks = stacks if stacks is not None else StackServices()
        self.stager = stacks.stager
        self.embed = nn.Embedding(vocab_size, cfg.d_model)

        def make_mlp(row: int) -> nn.Module:
            if cfg.mlp != "pooled":
                return DenseMLP(cfg.d_model, dense_width or pool.dense_width)
            experts = build_stack(stacks, row, pool.n_experts, cfg.d_model, pool.d_expert)
            return PooledMLP(cfg.d_model, pool, path, experts, count_reducer)
        self.embed_drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.rows = nn.ModuleList(Row(cfg, lambda i=i: make_mlp(i), checkpoint_rows) for i in range(cfg.n_rows))
        self.final_norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: 0.02 everywhere, residual outputs scaled by 1/sqrt(2 * rows).
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_rows)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, Router)):
                nn.init.normal_(module.weight, std=0.02)
        for row in self.rows:
            nn.init.normal_(row.attn.proj.weight, std=residual_std)
            row.mlp.reset_parameters(std=0.02, down_std=residual_std)

    def forward(self, idx_BT: Tensor, targets_BT: Tensor | None = None, cache: KVCache | None = None,
                dropless: bool = False, step_counts_LE: Tensor | None = None) -> LMOutput:
        """`dropless`: the pools compute every routed row whatever their capacity (writing).
        `step_counts_LE`: the optimizer step's routed rows per expert of each pooled row, for the
        balance term over the whole step (`pool.balance_scope = "step"` with train.accum_steps > 1); row i
        takes row i's (a model's rows are all pooled or all dense)."""
        x = self.embed_drop(self.embed(idx_BT))
        aux = x.new_zeros((), dtype=torch.float32)
        routing = []
        for i, row in enumerate(self.rows):
            x, row_aux = row(x, i, cache, dropless, None if step_counts_LE is None else step_counts_LE[i])
            aux = aux + row_aux.loss
            routing.append(row_aux.counts)
        if cache is not None:
            cache.length += idx_BT.shape[1]
        logits = self.head(self.final_norm(x))
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets_BT.reshape(-1))
        return LMOutput(logits, loss, aux, routing)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return KVCache(self.cfg.n_rows, batch_size, self.cfg.n_heads, self.cfg.head_dim, max_len)

    def pools(self) -> list[PooledMLP]:
        """The rows' pools, in row order ([] for the dense twin)."""
        return [row.mlp for row in self.rows if isinstance(row.mlp, PooledMLP)]

    def step_router_bias(self, load_LE: Tensor) -> None:
        """The aux-free bias step of every pool from one training step's loads [pools, E]."""
        for pool, load_E in zip(self.pools(), load_LE):
            pool.router.step_bias(load_E, pool.cfg.bias_update_rate)

    def param_groups(self, weight_decay: float, expert_weight_decay: float = -1.0) -> list[dict]:
        """Decay matrices and expert stacks (these by `expert_weight_decay`; < 0: `weight_decay`);
        not norms, gains, biases, any other 1-D parameter or the LoRA adapters of frozen experts
        (decay would pull them to zero: towards no adaptation). Two groups (decayed, not), or three when
        the experts decay apart: the two of older checkpoints' optimizer states whenever they can be."""
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        decays = lambda n, p: p.dim() >= 2 and ".lora_" not in n  # noqa: E731
        plain = [{"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
        if expert_weight_decay < 0 or expert_weight_decay == weight_decay:
            return [{"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay}, *plain]
        expert = lambda n: ".experts." in n  # noqa: E731  (a trainable stack's gate_up and down)
        groups = [{"params": [p for n, p in named if decays(n, p) and not expert(n)], "weight_decay": weight_decay},
                  {"params": [p for n, p in named if decays(n, p) and expert(n)], "weight_decay": expert_weight_decay}]
        return [g for g in groups if g["params"]] + plain  # frozen experts: nothing of theirs decays


def build_model(cfg: ModelConfig, pool: PoolConfig, vocab_size: int, device: torch.device | str, *,
                dense_width: int = 0, compiled: bool = False, experts: ExpertsConfig | None = None,
                init_frozen: bool = True, checkpoint_rows: bool = False,
                count_reducer: Callable[[Tensor], Tensor] | None = None,
                log: Callable[[str], None] | None = None, dtype: torch.dtype | None = None) -> CharLM:
    """Build on `device`, resolving dispatch `auto` once for it and the compute dtype `dtype` (None:
    `mlp.device_compute_dtype`'s; a run's is its train.precision).

    `compiled`: the model will run under torch.compile (some paths do not trace there).
    `experts`: with `frozen`, the pools hold frozen stacks (minagi/frozen.py), made on `device`
    directly (a large pool is never built in fp32), given their pin policy and byte source by
    `experts.stack_services`; `init_frozen` False leaves them to be loaded.
    `checkpoint_rows`: rows recomputed in backward. `count_reducer`: DDP's sum of the balance counts.
    """
    device = torch.device(device)
    path = resolve_dispatch(pool.dispatch, device, dtype or device_compute_dtype(device), compiled)
    stacks = stack_services(experts, device, checkpoint_rows=checkpoint_rows, init=init_frozen, log=log)
    model = CharLM(cfg, pool, vocab_size, path, dense_width, stacks=stacks, checkpoint_rows=checkpoint_rows,
                   count_reducer=count_reducer).to(device)
    if stacks.stager is not None and log is not None:
        homed = sum(s.stored_bytes() for row in stacks.stager.rows for s in row)
        log(f"offload: {len(stacks.stager.rows)} rows of frozen stacks homed in "
            f"{'pinned ' if device.type == 'cuda' else ''}CPU memory ({homed / 2**30:.2f} GiB), staged to "
            f"{device} {'with' if experts.prefetch else 'without'} prefetch"
            + ("" if device.type == "cuda" else "; on the CPU this saves no memory"))
    return model
