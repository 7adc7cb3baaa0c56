"""PooledMLP routing: the balance term sees load, the aux-free bias fights sinks, diagnostics find sinks."""
import pytest
import torch

from minagi.pool import PooledMLP

D, F_, E, K = 16, 16, 8, 2


def sink_router_pool(**kw):
    """A pool whose router sends every (positive) input to expert 0 first."""
    torch.manual_seed(0)
    pool = PooledMLP(D, F_, E, K, dispatch="grouped", **kw)
    with torch.no_grad():
        pool.router.weight.normal_(0, 0.02)
        pool.router.weight[0] = 0.5
    return pool


def test_balance_term_is_larger_for_sink_routing_than_uniform():
    x = torch.randn(512, D).abs()
    sink = sink_router_pool()
    uniform = sink_router_pool()
    with torch.no_grad():
        uniform.router.weight.normal_(0, 0.02)
    _, _, aux_sink = sink.route(x)
    _, _, aux_uniform = uniform.route(x)
    assert aux_uniform.item() == pytest.approx(0.01, rel=0.1)  # E * sum(1/E * 1/E) * coef at uniform
    assert aux_sink.item() > 2 * aux_uniform.item()


def test_balance_term_uses_reduced_counts_when_a_reducer_is_set():
    x = torch.randn(64, D).abs()
    pool = sink_router_pool()
    _, _, local = pool.route(x)
    pool.count_reducer = lambda counts: torch.ones_like(counts)  # pretend the world is balanced
    _, _, reduced = pool.route(x)
    assert reduced.item() < local.item()


def test_z_loss_adds_mean_squared_logsumexp():
    x = torch.randn(32, D)
    pool = sink_router_pool(balance_coef=0.0, z_loss_coef=1e-3)
    _, _, aux = pool.route(x)
    logits = x @ pool.router.weight.T
    assert aux.item() == pytest.approx(1e-3 * torch.logsumexp(logits, -1).square().mean().item(), rel=1e-5)


def test_aux_free_bias_update_lowers_the_sinks_selection():
    x = torch.randn(512, D).abs()
    pool = sink_router_pool(aux_free_bias=True, bias_update_rate=0.2)
    pool.train()
    picks = []
    for step in range(6):
        ids, _, _ = pool.route(x)
        if step == 1:
            assert pool.selection_bias[0] < 0 and pool.selection_bias.argmin() == 0
        picks.append((ids == 0).any(-1).float().mean().item())
        pool.experts_forward(x, ids, torch.full(ids.shape, 0.5))
        pool.step_bias()
    assert picks[0] == 1.0 and min(picks[1:]) < 0.5, picks  # every character picked the sink, then most did not
    assert picks[1] <= picks[0]


def test_aux_free_bias_off_never_moves():
    pool = sink_router_pool()
    pool.train()
    x = torch.randn(64, D).abs()
    pool(x)
    pool.step_bias()
    assert pool.selection_bias.abs().sum() == 0


def test_gates_are_renormalised_over_the_chosen_experts():
    pool = sink_router_pool()
    ids, gates, _ = pool.route(torch.randn(50, D))
    torch.testing.assert_close(gates.sum(-1), torch.ones(50))
    assert ids.unique(dim=-1).shape == ids.shape  # no repeated expert per character


def test_sink_diagnostics_find_an_injected_sink_and_its_ratio():
    torch.manual_seed(0)
    n_experts = 32  # the seed case: 94% of characters on one of many experts
    pool = PooledMLP(D, F_, n_experts, K, dispatch="grouped")
    n_chars, sink = 1000, 3
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(n_chars, n_experts, generator=g)
    scores[:940, sink] += 10  # 94% of characters pick expert 3
    scores[:, 7] -= 10        # expert 7 is never picked
    scores[:, 9] -= 10        # nor expert 9
    ids = scores.topk(K, -1).indices
    pool.experts_forward(torch.randn(n_chars, D), ids, torch.full((n_chars, K), 0.5))
    diag = pool.read_diagnostics()
    load = torch.bincount(ids.flatten(), minlength=n_experts)
    fair = n_chars * K / n_experts
    assert diag["top_expert"] == sink
    assert diag["load"] == load.tolist()
    assert diag["max_over_fair"] == pytest.approx(load[sink].item() / fair)
    assert diag["top_share"] == pytest.approx((ids == sink).any(-1).float().mean().item())
    assert diag["top_share"] >= 0.94
    assert diag["sinks"] == int((load > 4 * fair).sum())
    assert diag["sinks"] >= 1
    assert diag["dead"] == int((load == 0).sum()) >= 2
    assert diag["fair_share"] == fair


def test_diagnostics_accumulate_until_read_and_reset_after():
    pool = sink_router_pool()
    x = torch.randn(20, D)
    pool(x)
    pool(x)
    assert pool.read_diagnostics()["routed"] == 2 * 20 * K
    assert pool.read_diagnostics()["routed"] == 0


def test_top1_router_learns_from_the_loss_not_only_from_the_aux_terms():
    torch.manual_seed(0)
    pool = PooledMLP(D, F_, E, 1, dispatch="grouped", balance_coef=0.0)
    x = torch.randn(64, D)
    y, aux = pool(x)
    assert aux.item() == 0.0
    (y * torch.randn_like(y)).sum().backward()
    assert pool.router.weight.grad.abs().max() > 1e-4  # a renormalised top-1 gate (== 1) gives ~0
