"""pool.balance_scope: the Switch term E * sum_i f_i P_i over the whole optimizer step, each micro-batch
or each sequence, against references computed by hand (minagi/router.py, minagi/pool.py, minagi/step.py)."""
import numpy as np
import pytest
import torch

from minagi.assemble import build_training
from minagi.config import ConfigError, load_config
from minagi.data import get_batch
from minagi.mlp import BalanceArgs
from minagi.step import train_step
from tiny import new_pool

CPU = torch.device("cpu")
E, K, D = 6, 2, 16


def _pool(scope: str):
    torch.manual_seed(0)
    return new_pool(D, 16, E, K, path="loop", balance_scope=scope, balance_coef=1.0)


def _term_by_hand(probs_NE: torch.Tensor, ids_NK: torch.Tensor) -> torch.Tensor:
    f_E = torch.bincount(ids_NK.reshape(-1), minlength=E).float() / ids_NK.numel()
    return E * (f_E * probs_NE.mean(0)).sum()


def test_sequence_scope_is_the_mean_of_each_sequences_own_term():
    pool, S, T = _pool("sequence"), 5, 12
    x = torch.randn(S * T, D, requires_grad=True)
    _, aux = pool(x, balance=BalanceArgs(sequences=S))
    routing = pool.router(x)
    by_hand = torch.stack([_term_by_hand(routing.probs_NE[s * T:(s + 1) * T], routing.expert_ids_NK[s * T:(s + 1) * T])
                           for s in range(S)]).mean()
    assert aux.loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    grad = torch.autograd.grad(aux.loss, pool.router.weight)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(by_hand, pool.router.weight)[0])
    whole = _term_by_hand(routing.probs_NE, routing.expert_ids_NK)
    assert abs(whole.item() - by_hand.item()) > 1e-4  # not the batch's term


def test_batch_and_step_scopes_are_the_calls_own_term_without_the_steps_counts():
    x = torch.randn(40, D)
    (_, batch), (_, step) = _pool("batch")(x), _pool("step")(x)
    routing = _pool("step").router(x)
    assert torch.equal(batch.loss, step.loss)  # bit for bit: today's term
    assert batch.loss.item() == pytest.approx(_term_by_hand(routing.probs_NE, routing.expert_ids_NK).item(), rel=1e-6)


def test_the_batch_terms_gradient_reaches_the_router_through_p_alone():
    """f counts choices (no gradient); P is the mean of the softmax, through which the router learns."""
    pool, x = _pool("batch"), torch.randn(40, D)
    _, aux = pool(x)
    routing = pool.router(x)
    by_hand = _term_by_hand(routing.probs_NE, routing.expert_ids_NK)
    (grad,), (want,) = (torch.autograd.grad(t, pool.router.weight) for t in (aux.loss, by_hand))
    assert want.abs().max() > 0
    torch.testing.assert_close(grad, want)


def test_step_scope_takes_f_from_the_steps_counts_and_p_from_the_call():
    pool, x = _pool("step"), torch.randn(40, D)
    counts_E = torch.tensor([10.0, 0, 30, 5, 5, 30])
    _, aux = pool(x, balance=BalanceArgs(step_counts_E=counts_E))
    probs = pool.router(x).probs_NE
    assert aux.loss.item() == pytest.approx((E * (counts_E / counts_E.sum()) * probs.mean(0)).sum().item(), rel=1e-6)
    _, batch = _pool("batch")(x, balance=BalanceArgs(step_counts_E=counts_E))
    assert batch.loss.item() == pytest.approx(_pool("batch")(x)[1].loss.item())  # batch scope: its own counts


MODEL = ["model.n_rows=2", "model.d_model=32", "model.n_heads=2", "model.context=16", "pool.n_experts=4",
         "pool.top_k=2", "pool.d_expert=32", "pool.balance_coef=0.05", "train.device=cpu", "train.batch_size=4",
         "train.accum_steps=3", "train.warmup_steps=1"]


def test_batch_scope_is_the_mean_of_the_micro_batches_own_terms():
    cfg = load_config(None, [*MODEL, "pool.balance_scope=batch"])
    training = build_training(cfg, 20, CPU, 1)
    ids = np.random.default_rng(1).integers(0, 20, 3000).astype(np.uint8)
    x, y = get_batch(ids, 4, 16, cfg.train.seed, 0, 0, 1, 3)
    with torch.no_grad():  # each micro-batch's own term at the step's weights
        terms = [training.model(x_j, y_j).aux_loss for x_j, y_j in zip(x.chunk(3), y.chunk(3))]
        whole = training.model(x, y).aux_loss  # the step's batch as one forward: another term
    stats = train_step(training, x, y, step=0, grad_clip=1.0, world_size=1, device=CPU)
    assert stats.aux == pytest.approx(torch.stack(terms).mean().item(), rel=1e-6)
    assert abs(stats.aux - whole.item()) > 1e-7


def test_balance_scope_is_strict():
    with pytest.raises(ConfigError, match=r"pool.balance_scope = \"global\" is not one of: step, batch, sequence"):
        load_config(None, ["pool.balance_scope=global"])
