"""The character-level MoE language model: rows of attention + PooledMLP (or the dense twin).

The modules hold the weights; a row's math is minagi/rowmath.py's functions of tensors, which the
decoder (minagi/decode.py: the static cache, the one-character step, the prefill) runs on the same
weights. The model has no cache: the growing `KVCache` and the cached `generate` it served were
removed (the decoder replaced them); writing's readable reference, `sampling.generate`, runs this
forward over the whole window for every character.

Shape legend: B batch, T positions, D model width, H heads, Dh head width, V vocabulary, N = B*T characters.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import recompute, rowmath
from .config import ExpertsConfig, ModelConfig, PoolConfig
from .dense import DenseMLP
from .devices import Compile
from .dispatch import resolve_dispatch
from .experts import StackServices, build_stack, stack_services
from .mlp import BalanceArgs, MLPAux, compute_dtype, device_compute_dtype
from .plan import gib
from .pool import PooledMLP
from .router import Router


class LMOutput(NamedTuple):
    logits: Tensor            # [B, T, V]
    loss: Tensor | None       # mean cross-entropy in nats, when targets are given
    aux_loss: Tensor          # routing terms (balance + z-loss), already weighted; add to loss to train
    routing: list             # per row: its pool's RouteCounts (None for a dense row); the trainer counts them


class Attention(nn.Module):
    """A row's attention weights (qkv, proj) and its RoPE tables; the math is minagi/rowmath.py's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_base = cfg.n_heads, cfg.head_dim, cfg.rope_base
        self.dropout = cfg.dropout  # on the attention probabilities, in training only (as nanoGPT)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        # RoPE tables for the context's positions, made once: computed in forward, a compiled step
        # fused the cos/sin into every rotated element (37 of a 156 ms h200 step, docs/benchmarks.md §10).
        # Not persistent: checkpoints stay as they were.
        # On the CPU always (also when a loaded model is made on its device): the same bits everywhere.
        cos_Td, sin_Td = rowmath.rope_tables(torch.arange(cfg.context, device="cpu"), cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos_Td, persistent=False)
        self.register_buffer("rope_sin", sin_Td, persistent=False)
        cos_Td2, sin_Td2 = rowmath.rolled_tables(cos_Td, sin_Td)  # as rowmath.rope_rolled takes them
        self.register_buffer("rope_cos_rolled", cos_Td2, persistent=False)
        self.register_buffer("rope_sin_rolled", sin_Td2, persistent=False)

    def rope(self, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos, sin [T, Dh/2] of positions 0..T-1: the tables' rows, or made for positions past the
        context (a longer sequence) and for tables a dtype cast has rounded (model.half())."""
        if T <= self.rope_cos.shape[0] and self.rope_cos.dtype == torch.float32:
            return self.rope_cos[:T], self.rope_sin[:T]
        return rowmath.rope_tables(torch.arange(T, device=device), self.head_dim, self.rope_base)

    def rolled_rope(self, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """`rope`'s tables as rowmath.rope_rolled takes them, [T, Dh]: [cos, cos] and [-sin, sin]."""
        if T <= self.rope_cos_rolled.shape[0] and self.rope_cos_rolled.dtype == torch.float32:
            return self.rope_cos_rolled[:T], self.rope_sin_rolled[:T]
        return rowmath.rolled_tables(*self.rope(T, device))


class Row(nn.Module):
    """Pre-norm causal self-attention, then an MLP: pooled experts, or the dense twin. `checkpointed`:
    recomputed in backward (row checkpointing, minagi/recompute.py). `compiled_regions`: the row's
    attention half (norm, attention, residual, the MLP's norm) run through torch.compile in training
    calls, with a pool's router and dispatch plan in the same graph (where the pool allows it:
    `PooledMLP.graph_route_args`), or a dense twin's MLP and residual (the whole row); the expert dispatch eager
    (train.compile = "rows"). Its value says how (train.compile_mode and train.compile_backend), None for
    no compiled regions."""

    def __init__(self, cfg: ModelConfig, make_mlp: Callable[[], nn.Module], checkpointed: bool = False,
                 compiled_regions: Compile | None = None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp = make_mlp()  # built after the attention: the order in which parameters draw from the seed
        self.resid_drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.checkpointed = checkpointed
        # Compiled lazily, at the first training call; shapes never change there, so it compiles once.
        # Evaluation (no grad) keeps the eager functions: no second graph for another grad mode.
        how = compiled_regions
        self._compiled_half = how(self._attention_half, dynamic=False) if how else None
        # One graph a row (forward and backward) where there were two, and the MLP's input never copied
        # into a second graph's inputs: a dense twin's whole row, or a pool's route with the attention half.
        self._compiled_dense_row = how(self._dense_row, dynamic=False) if how and isinstance(self.mlp, DenseMLP) else None
        self._compiled_half_route = (how(self._attention_half_and_route, dynamic=False)
                                     if how and isinstance(self.mlp, PooledMLP) else None)

    def forward(self, x_BTD: Tensor, dropless: bool = False, step_counts_E: Tensor | None = None
                ) -> tuple[Tensor, MLPAux]:
        """`step_counts_E`: the optimizer step's routed rows per expert, for the pool's balance term."""
        if self.checkpointed:
            return recompute.checkpointed(self._forward, x_BTD, dropless, step_counts_E)
        return self._forward(x_BTD, dropless, step_counts_E)

    def _forward(self, x_BTD: Tensor, dropless: bool, step_counts_E: Tensor | None = None) -> tuple[Tensor, MLPAux]:
        """rowmath's row on this row's weights (the decoder runs the same functions on its copies)."""
        compiled = self._compiled_half is not None and torch.is_grad_enabled()
        if isinstance(self.mlp, DenseMLP):  # drops nothing: `dropless` changes nothing
            return (self._compiled_dense_row if compiled else self._dense_row)(x_BTD)
        balance = BalanceArgs(x_BTD.shape[0], step_counts_E)
        B, T, _ = x_BTD.shape
        args = self.mlp.graph_route_args(B * T, x_BTD.dtype, dropless, balance, compute_dtype(x_BTD)) if compiled else None
        if args is None:
            x_BTD, mlp_in_ND = (self._compiled_half if compiled else self._attention_half)(x_BTD)
            y_ND, aux = self.mlp(mlp_in_ND, dropless=dropless, balance=balance)
        else:
            x_BTD, mlp_in_ND, routed = self._compiled_half_route(x_BTD, *args)
            y_ND, aux = self.mlp(mlp_in_ND, dropless=dropless, balance=balance, routed=routed)
        return rowmath.mlp_residual(x_BTD, y_ND, drop=self.resid_drop), aux

    def _dense_row(self, x_BTD: Tensor) -> tuple[Tensor, MLPAux]:
        """A dense twin's row: the attention half, the MLP, its residual."""
        x_BTD, mlp_in_ND = self._attention_half(x_BTD)
        y_ND, aux = self.mlp(mlp_in_ND)
        return rowmath.mlp_residual(x_BTD, y_ND, drop=self.resid_drop), aux

    def _attention_half_and_route(self, x_BTD: Tensor, *route_args) -> tuple[Tensor, Tensor, tuple]:
        """The attention half, then the pool's route of its output (`PooledMLP.route_and_plan`)."""
        x_BTD, mlp_in_ND = self._attention_half(x_BTD)
        routed, mlp_in_ND = self.mlp.route_and_plan(mlp_in_ND, *route_args)
        return x_BTD, mlp_in_ND, routed

    def _attention_half(self, x_BTD: Tensor) -> tuple[Tensor, Tensor]:
        """x + attention(norm(x)) [B, T, D], and the MLP's input norm(that) [N, D]."""
        attn, T = self.attn, x_BTD.shape[1]
        qk_2BHTd, v = rowmath.attention_inputs(x_BTD, self.attn_norm.weight, self.attn_norm.eps, attn.qkv.weight,
                                               attn.n_heads)
        q, k = rowmath.rope_rolled(qk_2BHTd, *attn.rolled_rope(T, x_BTD.device))  # each [B, H, T, Dh]
        y_BHTd = rowmath.causal_attention(q, k, v, attn.dropout if self.training else 0.0)
        x_BTD = rowmath.attention_residual(x_BTD, y_BHTd, attn.proj.weight, drop=self.resid_drop)
        return x_BTD, rowmath.mlp_input(x_BTD, self.mlp_norm.weight, self.mlp_norm.eps)


class CharLM(nn.Module):
    """Embedding, `n_rows` rows, final norm, head. `forward(idx, targets=None, dropless=False) -> LMOutput`.

    Built whole (`build_model` resolves the pieces for a device): `stacks`, the services each row's
    expert stack is built with (minagi/experts.py; trainable stacks without); `checkpoint_rows`, rows
    recomputed in backward; `count_reducer`, what sums the pools' balance counts over ranks (DDP);
    `compiled_regions`, each row's attention half with its router (or a dense twin's whole row) compiled
    so, one graph a row (train.compile = "rows"; None: not compiled).
    `stager`: the offload stager the frozen stacks are staged by (None without offload). `exchange`:
    expert parallelism's (minagi/exchange.py; `stacks` then builds this rank's slices of the cards).
    """

    def __init__(self, cfg: ModelConfig, pool: PoolConfig, vocab_size: int, path: str = "grouped",
                 dense_width: int = 0, *, stacks: StackServices | None = None, checkpoint_rows: bool = False,
                 count_reducer: Callable[[Tensor], Tensor] | None = None, compiled_regions: Compile | None = None,
                 exchange=None):
        super().__init__()
        self.cfg, self.pool_cfg, self.vocab_size = cfg, pool, vocab_size
        stacks = stacks if stacks is not None else StackServices()
        self.stager = stacks.stager
        self.embed = nn.Embedding(vocab_size, cfg.d_model)

        def make_mlp(row: int) -> nn.Module:
            if cfg.mlp != "pooled":
                return DenseMLP(cfg.d_model, dense_width or pool.dense_width)
            experts = build_stack(stacks, row, pool.n_experts, cfg.d_model, pool.d_expert)
            return PooledMLP(cfg.d_model, pool, path, experts, count_reducer, exchange,
                             route_in_graph=compiled_regions is not None)
        self.embed_drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.rows = nn.ModuleList(Row(cfg, lambda i=i: make_mlp(i), checkpoint_rows, compiled_regions)
                                  for i in range(cfg.n_rows))
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

    def forward(self, idx_BT: Tensor, targets_BT: Tensor | None = None, dropless: bool = False,
                step_counts_LE: Tensor | None = None) -> LMOutput:
        """`dropless`: the pools compute every routed row whatever their capacity (writing).
        `step_counts_LE`: the optimizer step's routed rows per expert of each pooled row, for the
        balance term over the whole step (`pool.balance_scope = "step"` with train.accum_steps > 1); row i
        takes row i's (a model's rows are all pooled or all dense)."""
        x = self.embed_drop(self.embed(idx_BT))
        aux = x.new_zeros((), dtype=torch.float32)
        routing = []
        for i, row in enumerate(self.rows):
            x, row_aux = row(x, dropless, None if step_counts_LE is None else step_counts_LE[i])
            aux = aux + row_aux.loss
            routing.append(row_aux.counts)
        logits = rowmath.head(x, self.final_norm.weight, self.final_norm.eps, self.head.weight)
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets_BT.reshape(-1))
        return LMOutput(logits, loss, aux, routing)

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
                count_reducer: Callable[[Tensor], Tensor] | None = None, compiled_regions: Compile | None = None,
                log: Callable[[str], None] | None = None, dtype: torch.dtype | None = None,
                exchange=None, weights_loaded: bool = False) -> CharLM:
    """Build on `device`, resolving dispatch `auto` once for it and the compute dtype `dtype` (None:
    `mlp.device_compute_dtype`'s; a run's is its train.precision).

    `compiled`: the model will run under torch.compile (some paths do not trace there).
    `experts`: with `frozen`, the pools hold frozen stacks (minagi/frozen.py), made on `device`
    directly (a large pool is never built in fp32), given their pin policy and byte source by
    `experts.stack_services`; `init_frozen` False leaves them to be loaded.
    `checkpoint_rows`: rows recomputed in backward. `count_reducer`: DDP's sum of the balance counts.
    `compiled_regions`: how the rows' attention halves and routers (or dense MLPs) are compiled, the
    dispatch eager (train.compile = "rows"; `devices.Compile`); None: none compiled.
    `exchange`: expert parallelism (minagi/exchange.py): each pool holds this rank's experts only.
    `weights_loaded`: every weight is loaded next (writing, evaluation): the modules are made on
    `device` directly, their random init done there (not the seeded CPU init a training run starts
    from), instead of a CPU init of every weight and a copy (docs/sampling.md, the fixed cost).
    """
    device = torch.device(device)
    path = resolve_dispatch(pool.dispatch, device, dtype or device_compute_dtype(device), compiled)
    stacks = stack_services(experts, device, checkpoint_rows=checkpoint_rows, init=init_frozen, log=log,
                            local=exchange.local_experts if exchange is not None else None)
    with device if weights_loaded else contextlib.nullcontext():
        model = CharLM(cfg, pool, vocab_size, path, dense_width, stacks=stacks, checkpoint_rows=checkpoint_rows,
                       count_reducer=count_reducer, compiled_regions=compiled_regions, exchange=exchange).to(device)
    if stacks.stager is not None and log is not None:
        homed = sum(s.stored_bytes() for row in stacks.stager.rows for s in row)
        log(f"offload: {len(stacks.stager.rows)} rows of frozen stacks homed in "
            f"{'pinned ' if device.type == 'cuda' else ''}CPU memory ({gib(homed)}), staged to "
            f"{device} {'with' if experts.prefetch else 'without'} prefetch"
            + ("" if device.type == "cuda" else "; on the CPU this saves no memory"))
    return model
