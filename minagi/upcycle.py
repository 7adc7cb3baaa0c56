"""Sparse upcycling: a pooled model's first weights from its trained dense twin (`train.py --profile P
--init runs/<dense>/best.pt`, the checkpoint of P with `model.mlp = "dense"`).

Shape legend: D model width, H the twin's hidden width, E experts, K top_k, S shared experts, F expert
width (d_expert), C = E // K whole copies.

Attention, norms, embedding and head are copied as they are (minagi/loading.py `init_from_checkpoint`);
each row's dense MLP becomes the pool's experts here, and the router starts fresh.

**The dense width is split, not copied.** The twin has H = (K + S)·F hidden units (`PoolConfig.dense_width`,
equal active compute): exactly K + S experts' worth. Copying the whole MLP into every expert (Komatsuzaki
et al. 2022, arXiv 2212.05055) needs F = H, which the twin of a pool never has; so its hidden units are cut
into K + S slices of width F: the first S go to the shared experts (one SwiGLU of width S·F, as the pool
holds them), the other K to the routed ones, expert e holding slice e mod K with its down projection
scaled by K (`gate_scale`). This is fine-grained upcycling with **virtual groups** (He et al. 2024, arXiv
2410.07524; OLMo-core's virtual-group upcycling): the K consecutive experts cK .. cK + K - 1 hold the
whole routed MLP between them, and their router rows are one fresh row (the model's own draw for expert
cK), so the K experts of a copy tie. Whichever copy scores highest for a character, top_k takes all of
it, each gate is 1/K (softmax or sigmoid, normalised over the chosen), and the upcycled row computes the
dense row exactly, before training, up to the order of fp32 sums (tests/test_upcycle.py). Training
breaks the ties at once: the slices' outputs differ, so do their router rows' gradients.

Where it is not exact: top-1 (the gate is the raw score, not renormalised: the down projection is scaled
by the inverse of the gate an even router gives, E for softmax, 2 for sigmoid, so it is exact only when
the router's logits are all equal), and experts past the last whole copy when E is not a multiple of K
(a partial copy with a router row of its own: a character it wins takes experts of the next copy too).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .checkpoint import CheckpointError
from .config import PoolConfig

__all__ = ["gate_scale", "upcycle_mlp", "upcycled_state"]


def gate_scale(cfg: PoolConfig) -> float:
    """1 / the gate each chosen expert gets from an even router (all logits equal): K for top_k > 1
    (gates normalised over the chosen), E for a top-1 softmax, 2 for a top-1 sigmoid (sigmoid(0))."""
    if cfg.top_k > 1:
        return float(cfg.top_k)
    return float(cfg.n_experts) if cfg.router_score == "softmax" else 2.0


def upcycle_mlp(gate_up_DH2: Tensor, down_HD: Tensor, cfg: PoolConfig, router_ED: Tensor) -> dict[str, Tensor]:
    """One row's pool tensors, named as the pool's state dict names them, from its dense twin's MLP
    (gate_up [D, 2H]: the gate half, then the up half; down [H, D]) and the pool's fresh router [E, D].
    The shapes must already fit: H = (top_k + shared_experts) * d_expert."""
    K, S, F, E = cfg.top_k, cfg.shared_experts, cfg.d_expert, cfg.n_experts
    D = gate_up_DH2.shape[0]
    gate_DH, up_DH = gate_up_DH2.chunk(2, dim=-1)
    out: dict[str, Tensor] = {}
    if S:
        out["shared.gate_up"] = torch.cat([gate_DH[:, :S * F], up_DH[:, :S * F]], -1).contiguous()  # [D, 2SF]
        out["shared.down"] = down_HD[:S * F].contiguous()                                           # [SF, D]
    slice_E = torch.arange(E) % K  # expert e holds routed slice e mod K
    gate_KDF = gate_DH[:, S * F:].reshape(D, K, F).transpose(0, 1)
    up_KDF = up_DH[:, S * F:].reshape(D, K, F).transpose(0, 1)
    out["experts.gate_up"] = torch.cat([gate_KDF, up_KDF], -1)[slice_E].contiguous()               # [E, D, 2F]
    out["experts.down"] = (down_HD[S * F:].reshape(K, F, D)[slice_E] * gate_scale(cfg)).contiguous()  # [E, F, D]
    first_E = torch.arange(E) // K * K  # the first expert of each one's copy: its row is the copy's
    out["router.weight"] = router_ED[first_E.to(router_ED.device)].clone()
    out["router.selection_bias"] = torch.zeros(E, dtype=router_ED.dtype, device=router_ED.device)
    return out


def upcycled_state(state: dict, model, source: str | Path) -> dict:
    """A dense twin's state dict as the pooled `model`'s: each row's `mlp.gate_up` / `mlp.down` replaced by
    the pool's tensors (`upcycle_mlp`), everything else as it is (loaded, and checked, by name and shape).
    A dense MLP whose shape cannot map is a one-line CheckpointError naming the tensor and both shapes."""
    out = {k: v for k, v in state.items() if not (k.startswith("rows.") and k.split(".", 3)[2:3] == ["mlp"])}
    for i, row in enumerate(model.rows):
        cfg, prefix = row.mlp.cfg, f"rows.{i}.mlp."
        D, H = model.cfg.d_model, cfg.dense_width
        wanted = {"gate_up": [D, 2 * H], "down": [H, D]}
        for name, shape in wanted.items():
            value = state.get(prefix + name)
            if value is None:
                raise CheckpointError(f"{source}: has no {prefix}{name}: not the dense twin of this profile "
                                      f"({model.cfg.n_rows} rows with model.mlp = \"dense\")")
            if list(value.shape) != shape:
                raise CheckpointError(
                    f"{source}: {prefix}{name} is {list(value.shape)}; upcycling into {cfg.n_experts} experts "
                    f"top-{cfg.top_k} with {cfg.shared_experts} shared of width {cfg.d_expert} needs {shape} "
                    f"(the dense twin's width (top_k + shared_experts) x d_expert = {H})")
        router_ED = row.mlp.router.weight.detach()
        pool_state = upcycle_mlp(state[prefix + "gate_up"], state[prefix + "down"], cfg, router_ED.to("cpu"))
        out.update({prefix + k: v for k, v in pool_state.items()})
    return out
