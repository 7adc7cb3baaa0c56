"""minagi.pool and minagi.router: routing as a value, the balance term sees load, the aux-free bias
fights sinks, the pool keeps nothing from a call, and the counts it returns find sinks."""
import pytest
import torch

from minagi.diagnostics import RoutingMeter, step_counts
from minagi.router import balance_loss, routed_counts
from tiny import new_pool

D, F_, E, K = 16, 16, 8, 2


def sink_router_pool(**kw):
    """A pool whose router sends every (positive) input to expert 0 first."""
    torch.manual_seed(0)
    pool = new_pool(D, F_, E, K, "grouped", **kw)
    with torch.no_grad():
        pool.router.weight.normal_(0, 0.02)
        pool.router.weight[0] = 0.5
    return pool


def aux_of(pool, x):
    return pool.aux_loss(pool.router(x))


def test_routing_is_a_value_with_ids_gates_probabilities_and_logits():
    pool = sink_router_pool()
    x = torch.randn(50, D)
    r = pool.router(x)
    torch.testing.assert_close(r.logits_NE, x @ pool.router.weight.T)
    torch.testing.assert_close(r.probs_NE, r.logits_NE.softmax(-1))
    assert torch.equal(r.expert_ids_NK, r.probs_NE.topk(K, -1).indices)
    torch.testing.assert_close(r.gates_NK, r.probs_NE.gather(-1, r.expert_ids_NK) /
                               r.probs_NE.gather(-1, r.expert_ids_NK).sum(-1, keepdim=True))


def test_balance_term_is_larger_for_sink_routing_than_uniform():
    x = torch.randn(512, D).abs()
    sink = sink_router_pool()
    uniform = sink_router_pool()
    with torch.no_grad():
        uniform.router.weight.normal_(0, 0.02)
    assert aux_of(uniform, x).item() == pytest.approx(0.01, rel=0.1)  # E * sum(1/E * 1/E) * coef at uniform
    assert aux_of(sink, x).item() > 2 * aux_of(uniform, x).item()


def test_balance_loss_is_e_times_sum_of_load_fraction_times_mean_probability():
    pool = sink_router_pool()
    r = pool.router(torch.randn(64, D))
    counts = routed_counts(r.expert_ids_NK, E)
    assert counts.sum() == 64 * K
    expected = E * ((counts / counts.sum()) * r.probs_NE.mean(0)).sum()
    torch.testing.assert_close(balance_loss(r, counts), expected)


def test_balance_loss_with_the_counts_total_given_equals_it_summed_on_the_device_with_gradients():
    routing = sink_router_pool().router(torch.randn(64, D))
    counts = routed_counts(routing.expert_ids_NK, E)
    terms, grads = [], []
    for total in (None, 64 * K):
        probs = routing.probs_NE.detach().requires_grad_(True)
        r = routing._replace(probs_NE=probs)
        term = balance_loss(r, counts, total)
        term.backward()
        expected = E * ((counts / (64 * K)) * probs.detach().mean(0)).sum()
        torch.testing.assert_close(term.detach(), expected)
        terms.append(term.detach())
        grads.append(probs.grad)
    torch.testing.assert_close(terms[0], terms[1])
    torch.testing.assert_close(grads[0], grads[1])  # d/dP_ne = E * counts_e / (N * total)
    torch.testing.assert_close(balance_loss(routing, counts.long(), 64 * K), terms[1])  # integer counts (the plan's)


def test_balance_term_uses_reduced_counts_when_a_reducer_is_set():
    x = torch.randn(64, D).abs()
    pool = sink_router_pool()
    local = aux_of(pool, x)
    pool.count_reducer = lambda counts: torch.ones_like(counts)  # pretend the world is balanced
    assert aux_of(pool, x).item() < local.item()


def test_z_loss_adds_mean_squared_logsumexp_and_its_gradient_reaches_the_router():
    x = torch.randn(32, D)
    pool = sink_router_pool(balance_coef=0.0, z_loss_coef=1e-3)
    logits = x @ pool.router.weight.T
    by_hand = 1e-3 * torch.logsumexp(logits, -1).square().mean()
    aux = aux_of(pool, x)
    assert aux.item() == pytest.approx(by_hand.item(), rel=1e-5)
    (grad,), (want,) = (torch.autograd.grad(t, pool.router.weight) for t in (aux, by_hand))
    assert want.abs().max() > 0
    torch.testing.assert_close(grad, want)


def test_aux_free_bias_step_lowers_the_sinks_selection():
    x = torch.randn(512, D).abs()
    pool = sink_router_pool(aux_free_bias=True, bias_update_rate=0.2)
    picks = []
    for step in range(6):
        _, aux = pool(x)
        ids = pool.router(x).expert_ids_NK
        picks.append((ids == 0).any(-1).float().mean().item())
        pool.router.step_bias(aux.counts.load_E, pool.cfg.bias_update_rate)
        if step == 0:
            assert pool.router.selection_bias[0] < 0 and pool.router.selection_bias.argmin() == 0
    assert picks[0] == 1.0 and min(picks[1:]) < 0.5, picks  # every character picked the sink, then most did not


def test_aux_free_bias_off_never_moves():
    pool = sink_router_pool()
    _, aux = pool(torch.randn(64, D).abs())
    pool.router.step_bias(aux.counts.load_E, 1.0)
    assert pool.router.selection_bias.abs().sum() == 0


def test_a_forward_changes_no_buffer_of_the_pool_in_training_or_eval_mode():
    # The pool keeps nothing from a call: counts are returned, the bias moves only in step_bias.
    pool = sink_router_pool(aux_free_bias=True)
    before = {k: v.clone() for k, v in pool.state_dict().items()}
    for training in (True, False):
        pool.train(training)
        y, aux = pool(torch.randn(40, D))
        y.sum().backward()
    assert all(torch.equal(before[k], v) for k, v in pool.state_dict().items())
    assert not [name for name, _ in pool.named_buffers() if name != "router.selection_bias"]


def test_gates_are_renormalised_over_the_chosen_experts():
    r = sink_router_pool().router(torch.randn(50, D))
    torch.testing.assert_close(r.gates_NK.sum(-1), torch.ones(50))
    assert r.expert_ids_NK.unique(dim=-1).shape == r.expert_ids_NK.shape  # no repeated expert per character


def test_softmax_gates_are_the_chosen_probabilities_renormalised_in_value_and_gradient():
    from minagi.router import chosen_gates, route
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(200, 16, generator=g)).requires_grad_(True)
    bias = torch.randn(16, generator=g)
    weight = torch.randn(200, 4, generator=g)
    for bias_E in (None, bias):
        ids, gates, probs = route(logits, "softmax", bias_E, 4)
        by_hand = chosen_gates(logits.softmax(-1), ids)  # gather, then divide by the chosen ones' sum
        torch.testing.assert_close(gates, by_hand, atol=1e-6, rtol=1e-6)
        grad, = torch.autograd.grad((gates * weight).sum() + probs[:, 0].sum(), logits)
        want, = torch.autograd.grad((by_hand * weight).sum() + logits.softmax(-1)[:, 0].sum(), logits)
        torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-5)


def test_counts_find_an_injected_sink_and_its_ratio():
    torch.manual_seed(0)
    n_experts = 32  # the seed case: 94% of characters on one of many experts
    pool = new_pool(D, F_, n_experts, K, "grouped")
    n_chars, sink = 1000, 3
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(n_chars, n_experts, generator=g)
    scores[:940, sink] += 10  # 94% of characters pick expert 3
    scores[:, 7] -= 10        # expert 7 is never picked
    scores[:, 9] -= 10        # nor expert 9
    ids = scores.topk(K, -1).indices
    _, counts = pool.experts_forward(torch.randn(n_chars, D), ids, torch.full((n_chars, K), 0.5))
    meter = RoutingMeter()
    meter.add(step_counts([counts]))
    (diag,) = meter.read(sink_ratio=4.0)
    load = torch.bincount(ids.flatten(), minlength=n_experts)
    fair = n_chars * K / n_experts
    assert diag["row"] == 0 and diag["top_expert"] == sink and diag["path"] == "grouped"
    assert diag["load"] == load.tolist()
    assert diag["max_over_fair"] == pytest.approx(load[sink].item() / fair)
    assert diag["top_share"] == pytest.approx((ids == sink).any(-1).float().mean().item())
    assert diag["top_share"] >= 0.94
    assert diag["sinks"] == int((load > 4 * fair).sum()) >= 1
    assert diag["dead"] == int((load == 0).sum()) >= 2
    assert diag["fair_share"] == fair


def test_meter_sums_steps_until_read_then_starts_again_and_round_trips_its_state():
    pool = sink_router_pool()
    x = torch.randn(20, D)
    meter = RoutingMeter()
    for _ in range(2):
        meter.add(step_counts([pool(x)[1].counts, None]))  # a dense row counts nothing
    restored = RoutingMeter()
    restored.load_state_dict(meter.state_dict(), "cpu")
    (diag,) = meter.read(4.0)
    assert diag["routed"] == 2 * 20 * K and diag["chars"] == 2 * 20
    assert restored.read(4.0) == [diag]
    assert meter.read(4.0) == [] == restored.read(4.0)  # a read starts the sums again


def test_capacity_is_the_factor_times_the_fair_share_rounded_up_by_hand():
    """Every capacity test takes pool.capacity(n) from the code itself: here it is held to numbers."""
    assert new_pool(D, F_, 8, 2, capacity_factor=1.0).capacity(257) == 65    # 257 * 2 / 8 = 64.25
    assert new_pool(D, F_, 8, 2, capacity_factor=1.25).capacity(257) == 81   # 80.3
    assert new_pool(D, F_, 8, 1, capacity_factor=1.0).capacity(256) == 32    # exact: not rounded up
    assert new_pool(D, F_, 4, 2, capacity_factor=1.1).capacity(100) == 55    # exact, though 55.00000000000001 in floats
    assert new_pool(D, F_, 8, 2, capacity_factor=1.0).capacity(257, dropless=True) == 0
    assert new_pool(D, F_, 8, 2).capacity(257) == 0                          # factor 0: uncapped


def test_meter_sums_dropped_and_padded_rows_over_steps_into_their_fractions():
    from minagi.diagnostics import StepCounts
    meter = RoutingMeter()
    for load, dropped, padded in (([4, 2, 1, 1], 3, 10), ([2, 2, 2, 2], 5, 20)):
        meter.add(StepCounts(torch.tensor([load]), torch.tensor([dropped]), [4], [padded], ["grouped"]))
    (diag,) = meter.read(4.0)
    assert diag["routed"] == 16 and diag["load"] == [6, 4, 3, 3]
    assert diag["dropped_fraction"] == 8 / 16 and diag["padding_ratio"] == 30 / 16


def test_an_expert_is_dead_at_load_zero_only():
    from minagi.diagnostics import summarise
    assert summarise([5, 1, 0, 2], 0, 4, 8, "loop", 4.0)["dead"] == 1
    assert summarise([0, 0, 0, 0], 0, 0, 0, "loop", 4.0)["dead"] == 0  # nothing routed: nothing judged


def test_the_loop_path_counts_the_rows_it_computes_as_padded_rows():
    """Kept rows only: the rows capacity drops are not computed there (native computes them, gate 0)."""
    torch.manual_seed(0)
    pool = sink_router_pool(capacity_factor=1.0)
    pool_loop = new_pool(D, F_, E, K, "loop", capacity_factor=1.0)
    pool_loop.load_state_dict(pool.state_dict())
    x = torch.randn(40, D).abs()
    counts = pool_loop(x)[1].counts
    kept = counts.load_E.clamp(max=pool_loop.capacity(40)).sum().item()
    assert counts.dropped.item() > 0 and counts.padded_rows == kept == 40 * K - counts.dropped.item()


def test_top1_router_learns_from_the_loss_not_only_from_the_aux_terms():
    torch.manual_seed(0)
    pool = new_pool(D, F_, E, 1, "grouped", balance_coef=0.0)
    x = torch.randn(64, D)
    y, aux = pool(x)
    assert aux.loss.item() == 0.0
    (y * torch.randn_like(y)).sum().backward()
    assert pool.router.weight.grad.abs().max() > 1e-4  # a renormalised top-1 gate (== 1) gives ~0


@pytest.mark.parametrize("path", ["loop", "grouped", "rectangle", "native"])
def test_every_dispatch_path_gives_whole_expert_stacks_a_gradient_when_an_expert_is_idle(path):
    # Why DDP needs no find_unused_parameters: the stack is one parameter and it always gets a
    # gradient, zero for the idle expert.
    torch.manual_seed(0)
    pool = new_pool(8, 8, 4, 2, path, aux_free_bias=True)
    with torch.no_grad():
        pool.router.selection_bias[3] = -10.0  # expert 3 is never selected
    y, aux = pool(torch.randn(16, 8))
    (y.square().sum() + aux.loss).backward()
    for p in pool.parameters():
        assert p.grad is not None
    stacks = pool.experts
    assert stacks.gate_up.grad[3].abs().sum() == 0 and stacks.down.grad[3].abs().sum() == 0
    assert stacks.gate_up.grad[:3].abs().sum() > 0


# --- router_score = "sigmoid" (DeepSeek-V3) ------------------------------------------------------

def hand_router(score, aux_free_bias=False, top_k=2):
    """A router over 4 experts whose logits are the input itself (weight = identity)."""
    from minagi.router import Router
    router = Router(4, 4, top_k, aux_free_bias=aux_free_bias, score=score)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    return router


def test_sigmoid_gates_are_the_chosen_sigmoid_scores_over_their_sum_by_hand():
    import math
    r = hand_router("sigmoid")(torch.tensor([[2.0, 0.0, -1.0, 1.0]]))
    s = [1 / (1 + math.exp(-v)) for v in (2.0, 0.0, -1.0, 1.0)]  # 0.8808, 0.5, 0.2689, 0.7311
    assert r.expert_ids_NK.tolist() == [[0, 3]]
    assert r.gates_NK[0].tolist() == pytest.approx([s[0] / (s[0] + s[3]), s[3] / (s[0] + s[3])], rel=1e-6)
    assert r.gates_NK.sum().item() == pytest.approx(1.0, rel=1e-6)
    # P of the balance term: each character's scores normalised to sum to 1 (DeepSeek-V3's s').
    assert r.probs_NE[0].tolist() == pytest.approx([v / sum(s) for v in s], rel=1e-6)


def test_sigmoid_selection_takes_the_aux_free_bias_and_the_gates_do_not():
    import math
    router = hand_router("sigmoid", aux_free_bias=True)
    with torch.no_grad():
        router.selection_bias.copy_(torch.tensor([0.0, 0.5, 0.0, 0.0]))  # lifts expert 1 over expert 3
    r = router(torch.tensor([[2.0, 0.0, -1.0, 1.0]]))
    s0, s1 = 1 / (1 + math.exp(-2.0)), 0.5
    assert sorted(r.expert_ids_NK[0].tolist()) == [0, 1]
    gates = dict(zip(r.expert_ids_NK[0].tolist(), r.gates_NK[0].tolist()))
    assert gates == pytest.approx({0: s0 / (s0 + s1), 1: s1 / (s0 + s1)}, rel=1e-6)


def test_sigmoid_gates_sum_to_one_over_the_chosen_k_and_train_the_router():
    torch.manual_seed(0)
    pool = new_pool(D, F_, E, 3, "loop", router_score="sigmoid", balance_coef=0.0)
    x = torch.randn(40, D)
    r = pool.router(x)
    logits = x @ pool.router.weight.T
    torch.testing.assert_close(r.logits_NE, logits)
    assert torch.equal(r.expert_ids_NK, logits.sigmoid().topk(3, -1).indices)
    want = logits.sigmoid().gather(-1, r.expert_ids_NK)
    torch.testing.assert_close(r.gates_NK, want / want.sum(-1, keepdim=True))
    torch.testing.assert_close(r.gates_NK.sum(-1), torch.ones(40))
    y, _ = pool(x)
    (y * torch.randn_like(y)).sum().backward()
    assert pool.router.weight.grad.abs().max() > 1e-4


def test_sigmoid_top1_keeps_the_raw_score_as_its_gate():
    r = hand_router("sigmoid", top_k=1)(torch.tensor([[2.0, 0.0, -1.0, 1.0]]))
    assert r.expert_ids_NK.tolist() == [[0]]
    assert r.gates_NK.item() == pytest.approx(torch.tensor(2.0).sigmoid().item())


def test_sigmoid_balance_term_is_e_sum_f_times_mean_normalised_score_and_z_loss_is_on_the_logits():
    torch.manual_seed(0)
    pool = new_pool(D, F_, E, K, "grouped", router_score="sigmoid", balance_coef=0.01, z_loss_coef=1e-3)
    x = torch.randn(64, D)
    r = pool.router(x)
    logits = x @ pool.router.weight.T
    counts = routed_counts(r.expert_ids_NK, E)
    s = logits.sigmoid()
    P = (s / s.sum(-1, keepdim=True)).mean(0)  # DeepSeek-V3 eq. 19-20
    torch.testing.assert_close(balance_loss(r, counts), E * ((counts / counts.sum()) * P).sum())
    want = 0.01 * E * ((counts / counts.sum()) * P).sum() + 1e-3 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(aux_of(pool, x), want)


def test_an_even_sigmoid_routing_has_a_balance_term_of_one():
    from minagi.router import Routing
    ids = torch.arange(8).view(4, 2)  # each of 8 experts routed once
    probs = torch.full((4, 8), 1 / 8)
    routing = Routing(ids, torch.full((4, 2), 0.5), probs, torch.zeros(4, 8))
    assert balance_loss(routing, routed_counts(ids, 8)).item() == pytest.approx(1.0)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("products", [False, True])
def test_the_decode_step_routes_as_the_router(score, products):
    from minagi.decode_step import route_step
    torch.manual_seed(0)
    pool = new_pool(D, F_, E, 3, "grouped", router_score=score, aux_free_bias=True)
    with torch.no_grad():
        pool.router.selection_bias.normal_(0, 0.01)
    x = torch.randn(30, D)
    r = pool.router(x)
    ids, gates = route_step(x, pool.router.weight, pool.router.selection_bias, 3, products, score)
    assert torch.equal(ids.sort(-1).values, r.expert_ids_NK.sort(-1).values)
    order = lambda i, g: g.gather(-1, i.argsort(-1))  # noqa: E731  (gates in expert order)
    torch.testing.assert_close(order(ids, gates), order(r.expert_ids_NK, r.gates_NK), rtol=1e-5, atol=1e-6)


def test_the_default_router_scores_with_a_softmax():
    r = hand_router("softmax")(torch.tensor([[2.0, 0.0, -1.0, 1.0]]))
    torch.testing.assert_close(r.probs_NE, r.logits_NE.softmax(-1))
    with pytest.raises(ValueError, match="score must be one of softmax, sigmoid"):
        hand_router("tanh")


# --- shared experts (DeepSeekMoE) ----------------------------------------------------------------

def shared_reference(pool, x):
    """The routed experts one character and expert at a time, plus S separate SwiGLUs of width F."""
    from minagi.dense import dense_swiglu
    r = pool.router(x)
    S, F = pool.cfg.shared_experts, pool.cfg.d_expert
    gate_up, down = pool.experts.gate_up, pool.experts.down
    rows = []
    for n in range(x.shape[0]):
        y = sum(r.gates_NK[n, k] * dense_swiglu(x[n:n + 1], gate_up[e], down[e])[0]
                for k, e in enumerate(r.expert_ids_NK[n].tolist()))
        rows.append(y)
    y_ND = torch.stack(rows)
    W, H = pool.shared.gate_up, S * F
    for s in range(S):  # shared expert s: hidden units s*F .. (s+1)*F of the gate half and of the up half
        gate_up_s = torch.cat([W[:, s * F:(s + 1) * F], W[:, H + s * F:H + (s + 1) * F]], -1)
        y_ND = y_ND + dense_swiglu(x, gate_up_s, pool.shared.down[s * F:(s + 1) * F])
    return y_ND


@pytest.mark.parametrize("path", ["loop", "grouped", "rectangle", "native"])
def test_shared_experts_add_s_swiglus_of_the_expert_width_to_the_routed_output_in_outputs_and_grads(path):
    torch.manual_seed(0)
    pool = new_pool(D, F_, E, K, path, shared_experts=2)
    with torch.no_grad():
        pool.shared.gate_up.normal_(0, 0.3)
        pool.shared.down.normal_(0, 0.3)
    assert tuple(pool.shared.gate_up.shape) == (D, 2 * 2 * F_) and tuple(pool.shared.down.shape) == (2 * F_, D)
    x = torch.randn(23, D)
    weight = torch.randn(23, D)
    grads = []
    for fn in (lambda xi: pool(xi)[0], lambda xi: shared_reference(pool, xi)):
        pool.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        (y * weight).sum().backward()
        grads.append((y.detach(), xi.grad, *[p.grad.clone() for p in pool.parameters()]))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_pool_without_shared_experts_has_the_parameters_it_always_had():
    pool = new_pool(D, F_, E, K)
    assert pool.shared is None
    assert list(pool.state_dict()) == ["experts.gate_up", "experts.down", "router.weight", "router.selection_bias"]
    with_shared = new_pool(D, F_, E, K, shared_experts=1)
    assert list(with_shared.state_dict())[4:] == ["shared.gate_up", "shared.down"]


def test_shared_experts_are_not_dropped_with_the_chosen_experts():
    torch.manual_seed(0)
    pool = new_pool(D, F_, E, K, "loop", shared_experts=1, expert_dropout=0.999999).train()
    x = torch.randn(16, D)
    y, _ = pool(x)  # every routed gate dropped: the shared expert's output alone
    torch.testing.assert_close(y, pool.shared(x)[0])


def test_shared_experts_stay_trainable_beside_frozen_routed_experts():
    from minagi.config import ExpertsConfig, ModelConfig, PoolConfig
    from minagi.frozen import FrozenExpertStack
    from minagi.model import build_model
    cfg = ModelConfig(n_rows=1, d_model=32, n_heads=2, context=8)
    model = build_model(cfg, PoolConfig(n_experts=4, top_k=2, d_expert=32, shared_experts=1), 7, "cpu",
                        experts=ExpertsConfig(frozen=True, quant="none"))
    (pool,) = model.pools()
    assert isinstance(pool.experts, FrozenExpertStack)
    assert all(p.requires_grad for p in pool.shared.parameters())
    groups = model.param_groups(0.1, 0.5)
    decayed = {id(p) for g in groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert {id(pool.shared.gate_up), id(pool.shared.down)} <= decayed  # the dense weights' decay
    out = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    out.loss.backward()
    assert pool.shared.gate_up.grad.abs().sum() > 0


def test_the_dense_twin_width_counts_the_shared_experts():
    from minagi.config import PoolConfig
    assert PoolConfig(top_k=4, d_expert=512).dense_width == 2048
    assert PoolConfig(top_k=3, d_expert=512, shared_experts=1).dense_width == 2048


# --- MaxVio ----------------------------------------------------------------------------------------

def test_max_vio_is_the_busiest_load_over_the_mean_minus_one_by_hand():
    from minagi.diagnostics import max_vio, mean_max_vio, summarise
    assert max_vio([8, 8, 0, 0]) == 1.0      # fair share 4: the busiest carries 2x
    assert max_vio([4, 4, 4, 4]) == 0.0
    assert max_vio([13, 1, 1, 1]) == 13 / 4 - 1
    assert max_vio([0, 0, 0]) == 0.0         # nothing routed
    rows = [summarise([8, 8, 0, 0], 0, 8, 16, "loop", 4.0), summarise([5, 3, 4, 4], 0, 8, 16, "loop", 4.0)]
    assert [r["max_vio"] for r in rows] == [1.0, 0.25]
    assert rows[0]["max_vio"] == rows[0]["max_over_fair"] - 1
    assert mean_max_vio(rows) == 0.625
    assert mean_max_vio([{"load": [8, 8, 0, 0]}]) == 1.0  # a history row written before the field: from its load
    assert mean_max_vio([]) is None
