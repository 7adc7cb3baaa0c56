"""Routing as a value: which experts each character goes to, with what gates; the aux terms as functions.

Shape legend: N characters, D model width, E experts, K top_k.

The router scores E experts per character in fp32 and keeps the top_k. Gates are renormalised over
the chosen experts when top_k > 1 (with softmax scores, as the softmax of the chosen logits); top-1
keeps the raw score, as Switch does (a renormalised single gate is exactly 1, and the router would
learn from the aux terms alone). With the aux-free
bias (DeepSeek-V3), a selection-only bias is added to the scores that choose the experts; the gates
use the unbiased scores. The bias moves only when the trainer calls `step_bias` with a
training step's loads: a forward changes nothing.

Scores (`pool.router_score`): `softmax` over the E logits (Switch, GShard), or `sigmoid` of each
logit alone (DeepSeek-V3, arXiv 2412.19437 §2.1.2: top-k on the scores plus the bias, gates the
chosen scores over their sum). `route` is the one routing rule, from logits: the router and the
decoder's step (minagi/decode_step.py `route_step`) both call it. `Routing.probs_NE` is what the
balance term's P_i averages: the softmax, or with sigmoid scores each character's scores normalised
to sum to 1 (DeepSeek-V3's sequence-wise balance loss, eq. 17-20: s'_{i,t} = s_{i,t} / sum_j s_{j,t}).
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import recompute

__all__ = ["Router", "Routing", "balance_loss", "balance_probs", "choose_experts", "chosen_gates", "expert_scores",
           "route", "routed_counts", "sequence_balance_loss", "z_loss"]


class Routing(NamedTuple):
    expert_ids_NK: Tensor  # int64, distinct experts per character
    gates_NK: Tensor       # fp32 weights of the chosen experts' outputs (the compute dtype after a
    #                        compiled route, `PooledMLP.route_and_plan`)
    probs_NE: Tensor       # fp32, each row sums to 1 (unbiased): the softmax, or sigmoid scores normalised
    logits_NE: Tensor      # fp32 router logits (probs and logits None after a route whose aux loss is made)


class Router(nn.Module):
    """Linear logits D -> E, scores (softmax or sigmoid), top-k; `forward(x_ND) -> Routing`."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, aux_free_bias: bool = False,
                 score: str = "softmax"):
        super().__init__()
        self.n_experts, self.top_k, self.aux_free_bias = n_experts, top_k, aux_free_bias
        if score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}; got {score!r}")
        self.score = score
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))  # [E, D], as nn.Linear holds it
        # nn.Linear's own initialisation, so a model draws the same random numbers as before the
        # router was a module of its own (the pool re-initialises it; the golden run stays put).
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.register_buffer("selection_bias", torch.zeros(n_experts))  # aux-free, selection only

    def forward(self, x_ND: Tensor) -> Routing:
        with torch.autocast(x_ND.device.type, enabled=False):
            logits_NE = F.linear(x_ND.float(), self.weight.float())
            # The choice is not differentiable; a row's checkpoint replay takes the forward's, so a
            # recompute can neither re-draw ties nor see a bias that moved in between.
            expert_ids_NK, gates_NK, scores_NE = route(
                logits_NE, self.score, self.selection_bias if self.aux_free_bias else None, self.top_k,
                memo=lambda choose: recompute.remember((self, "expert_ids"), choose))
        return Routing(expert_ids_NK, gates_NK, balance_probs(scores_NE, self.score), logits_NE)

    @torch.no_grad()
    def step_bias(self, load_E: Tensor, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free update from one training step's loads (summed over ranks):
        b_i += rate * sign(mean_load - load_i)."""
        if not self.aux_free_bias:
            return
        load_E = load_E.float()
        self.selection_bias += torch.where(load_E.sum() > 0, rate * torch.sign(load_E.mean() - load_E), 0.0)


SCORES = ("softmax", "sigmoid")


def expert_scores(logits_NE: Tensor, score: str) -> Tensor:
    """Each character's scores of the E experts [N, E]: softmax over the logits, or sigmoid of each."""
    if score == "softmax":
        return logits_NE.softmax(-1)
    if score == "sigmoid":
        return logits_NE.sigmoid()
    raise ValueError(f"score must be one of {', '.join(SCORES)}; got {score!r}")


def balance_probs(scores_NE: Tensor, score: str) -> Tensor:
    """The distribution over experts the balance term's P_i averages [N, E]: the softmax itself, or
    sigmoid scores normalised per character (DeepSeek-V3's s'_{i,t})."""
    return scores_NE if score == "softmax" else scores_NE / scores_NE.sum(-1, keepdim=True)


def route(logits_NE: Tensor, score: str, bias_E: Tensor | None, top_k: int, *,
          top_k_fn: Callable[[Tensor, int], Tensor] | None = None,
          memo: Callable[[Callable[[], Tensor]], Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The routing rule, from fp32 logits [N, E]: (expert ids [N, K], gates [N, K], scores [N, E]).

    The top_k of the scores plus the selection bias (`choose_experts`); gates are the unbiased scores
    of the chosen experts (`chosen_gates`; with softmax scores formed from the chosen logits, the same
    values to rounding). `top_k_fn(selection_NE, k) -> ids`: how the top k are taken
    (default `topk`; the decoder's compiled step takes rounds of argmax). `memo(choose) -> ids`: where
    the choice is kept (the router's checkpoint-replay memo); the choice never records a graph.
    """
    scores_NE = expert_scores(logits_NE, score)
    choose = lambda: choose_experts(scores_NE.detach(), bias_E, top_k, top_k_fn)  # noqa: E731
    expert_ids_NK = choose() if memo is None else memo(choose)
    if score == "softmax" and top_k > 1:
        # The renormalised softmax of the chosen is the softmax of their logits: two launches where the
        # gather, sum and division took three, and backward 3 where it took 9 (docs/benchmarks.md §33).
        return expert_ids_NK, logits_NE.gather(-1, expert_ids_NK).softmax(-1), scores_NE
    return expert_ids_NK, chosen_gates(scores_NE, expert_ids_NK), scores_NE


def choose_experts(scores_NE: Tensor, bias_E: Tensor | None, top_k: int,
                   top_k_fn: Callable[[Tensor, int], Tensor] | None = None) -> Tensor:
    """The top_k experts of each row [N, K]: by score, plus the aux-free selection bias if any."""
    selection_NE = scores_NE if bias_E is None else scores_NE + bias_E
    if top_k_fn is not None:
        return top_k_fn(selection_NE, top_k)
    return selection_NE.topk(top_k, dim=-1).indices


def chosen_gates(scores_NE: Tensor, expert_ids_NK: Tensor) -> Tensor:
    """The chosen experts' scores [N, K], renormalised to sum to 1 when K > 1 (top-1: the raw score)."""
    gates_NK = scores_NE.gather(-1, expert_ids_NK)
    return gates_NK / gates_NK.sum(-1, keepdim=True) if expert_ids_NK.shape[-1] > 1 else gates_NK


def routed_counts(expert_ids_NK: Tensor, n_experts: int) -> Tensor:
    """Routed rows per expert [E] in fp32, counted with index_add (bincount on CUDA syncs the host)."""
    flat = expert_ids_NK.reshape(-1)
    return torch.zeros(n_experts, device=flat.device).index_add_(0, flat, torch.ones(flat.shape, device=flat.device))


def balance_loss(routing: Routing, counts_E: Tensor, total: int | None = None) -> Tensor:
    """Switch's `E * sum_i f_i * P_i` (unweighted): f_i the fraction of routed rows in `counts_E`
    (this rank's or the job's), P_i the mean of `routing.probs_NE` (the softmax; with sigmoid scores,
    the normalised scores, as DeepSeek-V3's balance loss: the same term for either score).
    `total`: the sum of `counts_E` where the host knows it (the call's own rows: N*K), else summed
    here. Formed as counts . column sums / (N * total): three launches where f and P apart took seven
    (the host-bound bucketed step pays each)."""
    n_chars, n_experts = routing.probs_NE.shape
    if n_chars == 0:
        return routing.probs_NE.new_zeros(())
    weighted = torch.dot(counts_E.to(routing.probs_NE.dtype), routing.probs_NE.sum(0))  # no copy when fp32
    if total is None:
        return weighted * (n_experts / n_chars) / counts_E.sum().clamp(min=1)
    return weighted * (n_experts / (n_chars * max(total, 1)))


def sequence_balance_loss(routing: Routing, sequences: int) -> Tensor:
    """The mean over `sequences` equal runs of the call's characters of `E * sum_i f_i * P_i`, f and P
    each sequence's own (`pool.balance_scope = "sequence"`): a sequence must spread its own characters,
    not only the batch. Needs no counts from other ranks."""
    n_chars, n_experts = routing.probs_NE.shape
    if n_chars == 0:
        return routing.probs_NE.new_zeros(())
    if n_chars % sequences:
        raise ValueError(f"{n_chars} characters do not split into {sequences} sequences of equal length")
    ids_SJ = routing.expert_ids_NK.reshape(sequences, -1)  # [S, T*K]: each sequence's routed rows
    counts_SE = routing.probs_NE.new_zeros(sequences, n_experts).scatter_add_(1, ids_SJ, torch.ones(
        ids_SJ.shape, device=ids_SJ.device))
    f_SE = counts_SE / ids_SJ.shape[1]
    p_SE = routing.probs_NE.view(sequences, -1, n_experts).mean(1)
    return n_experts * (f_SE * p_SE).sum(1).mean()


def z_loss(routing: Routing) -> Tensor:
    """Router z-loss `mean(logsumexp(logits)^2)` (unweighted): keeps the logits from growing. On the
    logits whatever the score (ST-MoE's term; with sigmoid scores it still bounds their size)."""
    if routing.logits_NE.shape[0] == 0:
        return routing.logits_NE.new_zeros(())
    return torch.logsumexp(routing.logits_NE, -1).square().mean()
