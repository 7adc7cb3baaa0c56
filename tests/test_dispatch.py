"""Dispatch paths compute the same function: grouped == rectangle == loop (== native where it runs)."""
import pytest
import torch

from minagi import dispatch
from minagi.dispatch import GROUPED_MM, make_plan, resolve_dispatch, run_padded
from minagi.layout import MAX_GROUPS, SHAPE_ROWS, Layout, layered_layout, round_capacity
from minagi.swiglu import swiglu_eager
from tiny import new_pool

D, F_, E, K = 16, 24, 8, 2
# The paths a CUDA GPU runs against the fp32 loop: minagi's Triton grouped GEMM where Triton is here.
GPU_PATHS = ("grouped", "rectangle", "native") + (("triton",) if dispatch._has_triton() else ())


def routing(n_chars, bias_E, k=K, seed=0):
    """Distinct top-k experts per character, skewed by bias_E; random positive gates."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.rand(n_chars, len(bias_E), generator=g) + torch.tensor(bias_E)).topk(k, -1).indices
    gates = torch.rand(n_chars, k, generator=g) + 0.1
    return ids, gates / gates.sum(-1, keepdim=True)


SCENARIOS = {
    "one_character": (1, [0.0] * E),
    "uneven_two_groups": (300, [3.0, 1.5, 1.2, 0.9, 0.6, 0.3, 0.1, 0.0]),
    "empty_experts": (64, [0.0] * 4 + [-10.0] * 4),
    "sink": (257, [10.0] + [0.0] * (E - 1)),
}


def make_pool(seed=0, **kw):
    torch.manual_seed(seed)
    pool = new_pool(D, F_, E, K, "loop", **kw)
    with torch.no_grad():  # larger weights than the init so differences would show
        pool.experts.gate_up.normal_(0, 0.3)
        pool.experts.down.normal_(0, 0.3)
    return pool


def run(pool, path, x, ids, gates, seed=1):
    """Outputs and gradients (input, both stacks, gates) of one path on cloned inputs."""
    pool.zero_grad()
    x = x.clone().requires_grad_(True)
    gates = gates.clone().requires_grad_(True)
    y, _ = pool.experts_forward(x, ids, gates, path=path)
    # Not y.sum(): grouped_mm's backward can fail on the zero-stride gradient of a sum.
    weight = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    (y * weight).sum().backward()
    return y.detach(), x.grad, pool.experts.gate_up.grad.clone(), pool.experts.down.grad.clone(), gates.grad


def per_character_reference(x, ids, gates, gate_up, down):
    """Independent of minagi.dispatch: each character's K experts, one at a time, summed by their gates."""
    y = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[n, k]
            y[n] += swiglu_eager(x[n:n + 1] @ gate_up[e], gates[n, k:k + 1])[0] @ down[e]
    return y


def assert_same(a, b, atol=1e-5):
    for name, u, v in zip(("output", "input grad", "gate_up grad", "down grad", "gate grad"), a, b):
        torch.testing.assert_close(u, v, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_capacities_round_to_powers_of_two_then_eight_steps_a_power_of_two():
    got = [round_capacity(n) for n in (0, 1, 3, 16, 17, 100, 128, 129, 910, 1000, 1025)]
    assert got == [0, 1, 4, 16, 18, 104, 128, 144, 960, 1024, 1152]
    from minagi.layout import _round_capacities
    n = torch.randint(0, 5000, (500,)).numpy()
    assert _round_capacities(n).tolist() == [round_capacity(int(v)) for v in n]


def test_a_small_overflow_group_takes_a_power_of_two_and_a_large_one_its_rounded_capacity():
    from minagi.layout import group_capacity
    assert group_capacity(100, 2) == 128            # 2 x (128 - 104) = 48 padded rows more: within SHAPE_ROWS
    assert group_capacity(100, 30) == 104           # 30 x 24 = 720 more: not
    assert group_capacity(5000, 1) == 5120          # 8192 would pad 3,072 rows
    assert group_capacity(9, 3) == 16 and group_capacity(0, 1) == 0
    assert group_capacity(100, 2, shape_rows=0) == round_capacity(100)
    merged = layered_layout([1031, 76, 667, 16, 346, 1653, 1653, 1791])  # a widened group meets the one before
    assert merged.groups == ((1792, (5, 6, 7)), (1024, (0, 2)), (512, (1, 4)))
    layout = layered_layout([20] * 60 + [150, 140, 9000, 30])  # two busy experts and a sink past the card
    assert {cap for cap, _ in layout.groups} <= {1 << b for b in range(15)} | {round_capacity(9000 - layout.card)}


def reference_layout(kept, gather_rows, group_rows, shape_rows=SHAPE_ROWS):
    """`layered_layout`'s rule written plainly, one candidate and one split at a time: (card, groups)."""
    E = len(kept)
    cards = sorted({0} | ({round_capacity(n) for n in kept if n > 0} if gather_rows is not None else set()))

    def cost(card):
        over = [n - card for n in kept if n > card]
        return (E * card + sum(round_capacity(o) for o in over) + group_rows * min(len(over), MAX_GROUPS)
                + (gather_rows or 0) * len(over))
    card = min(cards, key=cost)  # the smallest card of the least cost
    order = sorted((e for e in range(E) if kept[e] > card), key=lambda e: -(kept[e] - card))  # ties by expert
    caps = [round_capacity(kept[e] - card) for e in order]
    groups = [(0, len(order))] if order else []
    while 0 < len(groups) < MAX_GROUPS:
        best, split = group_rows, None  # a split must save more padded rows than a group costs
        for i, (lo, hi) in enumerate(groups):
            for k in range(lo + 1, hi):  # the first split of the most saved rows
                if (hi - k) * (caps[lo] - caps[k]) > best:
                    best, split = (hi - k) * (caps[lo] - caps[k]), (i, k)
        if split is None:
            break
        i, k = split
        groups[i:i + 1] = [(groups[i][0], k), (k, groups[i][1])]
    settled = []
    for lo, hi in groups:  # a power of two where it pads the group by at most shape_rows rows
        wide = 1 << (caps[lo] - 1).bit_length()
        cap = wide if (hi - lo) * (wide - caps[lo]) <= shape_rows else caps[lo]
        if settled and settled[-1][0] == cap:  # widened to the group before's capacity: one group
            settled[-1] = (cap, settled[-1][1] + order[lo:hi])
        else:
            settled.append((cap, order[lo:hi]))
    return card, tuple((cap, tuple(sorted(members))) for cap, members in settled)


def test_the_layout_is_the_plainly_written_rule_on_random_loads_with_ties():
    g = torch.Generator().manual_seed(7)
    for case in range(1500):
        E = [1, 2, 8, 16, 64, 128][case % 6]
        values = torch.tensor([0, 1, 5, 16, 17, 100, 129, 500, 1000, 1024, 15000])
        kept = (values[torch.randint(0, len(values), (E,), generator=g)] if case % 2 else
                torch.randint(0, 3000, (E,), generator=g) * (torch.rand(E, generator=g) < 0.8)).tolist()
        for gather_rows, group_rows, shape_rows in ((256, 512, 512), (None, 512, 512), (0, 0, 0), (16, 64, 4096)):
            layout = layered_layout(kept, gather_rows, group_rows, shape_rows)
            assert (layout.card, layout.groups) == reference_layout(kept, gather_rows, group_rows, shape_rows), (
                kept, gather_rows)
            capacities = [cap for cap, _ in layout.groups]
            assert capacities == sorted(set(capacities), reverse=True), kept  # distinct, largest first


def test_the_layout_keeps_a_sink_out_of_the_card_and_everything_in_it_when_loads_are_even():
    sink = layered_layout([900, 1010, 950, 15523] + [980] * 124)
    assert sink.card == 1024 and sink.groups == ((round_capacity(15523 - 1024), (3,)),)
    even = layered_layout([1000, 1100, 1050, 990] * 32)
    assert even.card == round_capacity(1100) and even.groups == ()
    collapse = layered_layout([16384] * 8 + [0] * 120)  # a card for every expert would be 16x the rows
    assert collapse.card == 0 and collapse.groups == ((16384, tuple(range(8))),)
    assert layered_layout([0] * 8) == Layout((0,) * 8, 0, ())


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_loop_matches_a_per_character_reference(scenario):
    n_chars, bias = SCENARIOS[scenario]
    pool = make_pool()
    x = torch.randn(n_chars, D)
    ids, gates = routing(n_chars, bias)
    with torch.no_grad():
        want = per_character_reference(x, ids, gates, pool.experts.gate_up, pool.experts.down)
    torch.testing.assert_close(run(pool, "loop", x, ids, gates)[0], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_grouped_matches_rectangle_and_loop_outputs_and_grads(scenario):
    n_chars, bias = SCENARIOS[scenario]
    pool = make_pool()
    x = torch.randn(n_chars, D)
    ids, gates = routing(n_chars, bias)
    ref = run(pool, "loop", x, ids, gates)
    assert_same(run(pool, "grouped", x, ids, gates), ref)
    assert_same(run(pool, "rectangle", x, ids, gates), ref)


def test_uneven_scenario_really_splits_into_several_groups_and_sink_really_sinks():
    n_chars, bias = SCENARIOS["uneven_two_groups"]
    ids, _ = routing(n_chars, bias)
    split = layered_layout(torch.bincount(ids.flatten(), minlength=E).tolist(), gather_rows=0, group_rows=0)
    assert 2 <= len(split.groups) <= MAX_GROUPS  # split where it saves rows, at most MAX_GROUPS groups
    n_chars, bias = SCENARIOS["sink"]
    ids, _ = routing(n_chars, bias)
    assert layered_layout(torch.bincount(ids.flatten(), minlength=E).tolist()).groups  # the sink overflows
    n_chars, bias = SCENARIOS["sink"]
    ids, _ = routing(n_chars, bias)
    assert (ids == 0).any(-1).all()
    n_chars, bias = SCENARIOS["empty_experts"]
    ids, _ = routing(n_chars, bias)
    assert torch.bincount(ids.flatten(), minlength=E)[4:].sum() == 0


@pytest.mark.skipif(GROUPED_MM is None, reason="this torch has no grouped_mm")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_native_matches_loop_outputs_and_grads(scenario):
    n_chars, bias = SCENARIOS[scenario]
    pool = make_pool()
    x = torch.randn(n_chars, D)
    ids, gates = routing(n_chars, bias)
    assert_same(run(pool, "native", x, ids, gates), run(pool, "loop", x, ids, gates))


def _layouts(kept: list[int]) -> list[Layout]:
    """Every kind of layout for these loads: card alone, card + overflow groups, overflow alone."""
    top = max(kept)
    out = [Layout(tuple(kept), top, ()), layered_layout(kept, gather_rows=0, group_rows=0), layered_layout(kept)]
    for card in (0, 1, min(n for n in kept if n > 0), top // 2):
        groups = {}
        for e, n in enumerate(kept):
            if n > card:
                groups.setdefault(round_capacity(n - card) + (e % 2), []).append(e)  # uneven capacities too
        out.append(Layout(tuple(kept), card, tuple((c, tuple(m)) for c, m in sorted(groups.items()))))
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_layout_of_the_padded_path_gives_the_loops_outputs_and_grads(scenario):
    n_chars, bias = SCENARIOS[scenario]
    pool = make_pool()
    x = torch.randn(n_chars, D)
    ids, gates = routing(n_chars, bias)
    ref = run(pool, "loop", x, ids, gates)
    kept = make_plan(ids, E).counts_E.tolist()
    for layout in _layouts(kept):
        pool.zero_grad()
        x_ = x.clone().requires_grad_(True)
        gates_ = gates.clone().requires_grad_(True)
        stats = {}
        gate_up, down = pool.experts.weights(torch.float32)
        y = run_padded(x_, gates_, gate_up, down, make_plan(ids, E), layout, stats)
        weight = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        (y * weight).sum().backward()
        got = (y.detach(), x_.grad, pool.experts.gate_up.grad.clone(), pool.experts.down.grad.clone(), gates_.grad)
        assert_same(got, ref)
        assert stats["padded_rows"] == layout.padded_rows >= sum(kept)


@pytest.mark.parametrize("path", ["loop", "grouped", "rectangle", "native"])
def test_capacity_drops_exactly_what_it_reports(path):
    if path == "native" and GROUPED_MM is None:
        pytest.skip("no grouped_mm")
    pool = make_pool(capacity_factor=1.0)
    n_chars, bias = SCENARIOS["sink"]
    x = torch.randn(n_chars, D)
    ids, gates = routing(n_chars, bias)
    cap = pool.capacity(n_chars)
    counts = torch.bincount(ids.flatten(), minlength=E)
    expected_dropped = (counts - cap).clamp(min=0).sum().item()
    assert expected_dropped > 0
    y, counts = pool.experts_forward(x, ids, gates, path=path)
    assert counts.dropped.item() == expected_dropped and counts.load_E.tolist() == counts_list(ids)
    # Reference: the uncapped loop with the dropped (character, expert) pairs' gates set to zero.
    seen = torch.zeros(E, dtype=torch.long)
    kept_gates = gates.clone()
    for n in range(n_chars):  # characters in order: earlier characters keep their place
        for k in range(K):
            e = ids[n, k]
            if seen[e] >= cap:
                kept_gates[n, k] = 0.0
            seen[e] += 1
    uncapped = make_pool()
    uncapped.load_state_dict(pool.state_dict())
    torch.testing.assert_close(y, uncapped.experts_forward(x, ids, kept_gates, path="loop")[0], atol=1e-5, rtol=1e-4)


def counts_list(ids):
    return torch.bincount(ids.flatten(), minlength=E).tolist()


def test_uncapped_drops_nothing():
    pool = make_pool()
    n_chars, bias = SCENARIOS["sink"]
    ids, gates = routing(n_chars, bias)
    _, counts = pool.experts_forward(torch.randn(n_chars, D), ids, gates, path="grouped")
    assert counts.dropped is None and counts.load_E.tolist() == counts_list(ids)


def test_the_plans_aranges_are_made_once_a_size_and_never_written():
    """make_plan keeps its aranges between calls (a launch each saved): a training step's forward and
    backward leave them as made, and a second call with the same routing makes the same plan."""
    dispatch._ARANGES.clear()
    pool = make_pool()
    n_chars, bias = SCENARIOS["sink"]
    ids, gates = routing(n_chars, bias)
    x = torch.randn(n_chars, D, requires_grad=True)
    first = make_plan(ids, E)
    y, _ = pool.experts_forward(x, ids, gates.requires_grad_(), path="grouped")
    y.square().sum().backward()
    assert {n for n, _ in dispatch._ARANGES} == {E + 1, n_chars * ids.shape[1]}
    assert all(torch.equal(a, torch.arange(n)) for (n, _), a in dispatch._ARANGES.items())
    again = make_plan(ids, E)
    assert all(torch.equal(a, b) for a, b in zip(first.tensors()[:7], again.tensors()[:7]))
    assert torch.equal(first.positions(), again.positions())


@pytest.mark.parametrize("n_experts, key", [(8, torch.uint8), (256, torch.uint8), (257, torch.int16),
                                             (2**15, torch.int16), (2**15 + 1, torch.int32)])
def test_the_plan_sorts_on_a_narrow_key_in_the_order_of_a_stable_int64_sort(n_experts, key):
    """The sort key is the narrowest dtype holding every id (fewer radix passes); ties keep character
    order as a stable int64 sort does, ids at the top of the key's range included."""
    assert dispatch.sort_key_dtype(n_experts) == key
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, n_experts, (257, 4), generator=g)
    ids[::3, 0] = n_experts - 1  # the largest id, and many ties
    plan = make_plan(ids, n_experts)
    expert_R, order_R = torch.sort(ids.reshape(-1), stable=True)
    assert plan.expert_R.dtype == torch.int64
    assert torch.equal(plan.expert_R, expert_R) and torch.equal(plan.order_R, order_R)
    assert torch.equal(plan.counts_E, torch.bincount(ids.reshape(-1), minlength=n_experts))


def test_the_rectangle_pads_every_expert_to_the_busiest():
    pool = make_pool()
    n_chars, bias = SCENARIOS["sink"]
    ids, gates = routing(n_chars, bias)
    x = torch.randn(n_chars, D)
    _, counts = pool.experts_forward(x, ids, gates, path="rectangle")
    _, grouped = pool.experts_forward(x, ids, gates, path="grouped")
    busiest = torch.bincount(ids.flatten(), minlength=E).max().item()
    assert counts.path == "rectangle" and counts.padded_rows == E * busiest
    assert grouped.path == "grouped" and grouped.padded_rows < counts.padded_rows


def test_dispatch_is_resolved_once_for_the_device_dtype_and_compile():
    assert resolve_dispatch("auto", "cpu", torch.float32) == "grouped"
    assert resolve_dispatch("loop", "cpu", torch.float32) == "loop"
    if GROUPED_MM is not None:
        assert resolve_dispatch("native", "cpu", torch.float32) == "native"
        with pytest.warns(UserWarning, match=r"pool.dispatch = 'native': torch's grouped GEMM compiles in bf16 "
                                             r"only, not float32; the experts take the bucketed path"):
            assert resolve_dispatch("native", "cpu", torch.float32, compiled=True) == "grouped"
    with pytest.raises(ValueError, match="dispatch must be one of"):
        resolve_dispatch("fast", "cpu", torch.float32)


def test_an_explicit_dispatch_this_machine_cannot_run_is_replaced_in_one_warning_said_once(monkeypatch):
    """pool.dispatch = "triton" on the CPU trains on the bucketed path: said, not silent, and once per reason."""
    monkeypatch.setattr(dispatch, "_SAID", set())
    with pytest.warns(UserWarning) as said:
        for _ in range(3):  # a model's rows each resolve their pool's dispatch
            assert resolve_dispatch("triton", "cpu", torch.float32) == "grouped"
    assert len(said) == 1 and str(said[0].message).startswith(
        "pool.dispatch = 'triton': minagi's Triton grouped GEMM needs a GPU, bf16 or fp16, and Triton: cpu, float32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cuda_bf16_paths_match_fp32_loop(scenario):
    n_chars, bias = SCENARIOS[scenario]
    pool = make_pool()
    x = torch.randn(n_chars, D)
    ids, gates = routing(n_chars, bias)
    ref = pool.experts_forward(x, ids, gates, path="loop")[0].detach()
    pool = pool.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for path in GPU_PATHS:
            y = pool.experts_forward(x.cuda(), ids.cuda(), gates.cuda(), path=path)[0].float().cpu()
            err = (y - ref).norm() / ref.norm()
            assert err < 2e-2, f"{path}: relative error {err:.3g}"


@pytest.mark.parametrize("router", ["random", "sink"])
def test_full_forward_router_and_stack_grads_match_across_paths(router):
    """Routing included: the router's gradient (through the gates and the balance term) agrees too."""
    torch.manual_seed(0)
    pool = new_pool(D, F_, E, K, "loop", z_loss_coef=1e-3)
    with torch.no_grad():
        pool.experts.gate_up.normal_(0, 0.3)
        pool.experts.down.normal_(0, 0.3)
        pool.router.weight.normal_(0, 0.5)
        if router == "sink":
            pool.router.weight[0] = 1.0
    x = torch.randn(96, D).abs()
    weight = torch.randn(96, D)
    grads = {}
    paths = ["loop", "grouped", "rectangle"] + (["native"] if GROUPED_MM is not None else [])
    for path in paths:
        pool.zero_grad()
        pool.path = path
        xi = x.clone().requires_grad_(True)
        y, aux = pool(xi)
        ((y * weight).sum() + aux.loss).backward()
        grads[path] = (y.detach(), xi.grad, pool.router.weight.grad.clone(), pool.experts.gate_up.grad.clone(),
                       pool.experts.down.grad.clone())
    if router == "sink":
        assert aux.counts.load_E[0] == 96  # every character picked expert 0
    for path in paths[1:]:
        for name, u, v in zip(("output", "input", "router", "gate_up", "down"), grads[path], grads["loop"]):
            torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-4, msg=lambda m: f"{path} {name}: {m}")


@pytest.mark.parametrize("path", ["grouped", "rectangle"])
def test_paths_traced_by_torch_compile_match_eager_in_gradients(path):
    """train.compile = true traces the dispatch Functions (gather-groups, masked takes, host sync)."""
    n_chars, bias = SCENARIOS["empty_experts"]
    pool = make_pool(capacity_factor=1.0)
    x = torch.randn(n_chars, D)
    ids, gates = routing(n_chars, bias)
    want = run(pool, path, x, ids, gates)
    torch._dynamo.reset()
    forward = torch.compile(lambda x, g: pool.experts_forward(x, ids, g, path=path)[0], backend="eager")
    pool.zero_grad()
    xc, gc = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
    y = forward(xc, gc)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    assert_same((y.detach(), xc.grad, pool.experts.gate_up.grad, pool.experts.down.grad, gc.grad), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("swiglu", ["auto", "jiterator"])
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cuda_bf16_training_paths_match_fp32_loop_in_gradients(scenario, capacity_factor, swiglu):
    """With gradients on CUDA the SwiGLU runs minagi's Triton kernels (or the jiterator ones); the
    bucketed paths pass their [G, C, 2F] groups, the native path its packed [R, 2F] rows; capacity
    drops rows on the way."""
    n_chars, bias = SCENARIOS[scenario]
    pool = make_pool(capacity_factor=capacity_factor, swiglu=swiglu)
    x = torch.randn(n_chars, D)
    ids, gates = routing(n_chars, bias)
    ref = run(pool, "loop", x, ids, gates)
    pool = pool.cuda()
    weight = torch.randn(ref[0].shape, generator=torch.Generator().manual_seed(1)).cuda()  # run()'s
    for path in GPU_PATHS:
        pool.zero_grad()
        xc = x.cuda().requires_grad_(True)
        gc = gates.cuda().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = pool.experts_forward(xc, ids.cuda(), gc, path=path)
        (y.float() * weight).sum().backward()
        got = (y.detach(), xc.grad, pool.experts.gate_up.grad, pool.experts.down.grad, gc.grad)
        for name, u, v in zip(("output", "input grad", "gate_up grad", "down grad", "gate grad"), got, ref):
            err = (u.float().cpu() - v).norm() / v.norm().clamp(min=1e-12)
            assert err < 3e-2, f"{path} {name}: relative error {err:.3g}"


def test_native_dispatch_in_fp32_built_for_torch_compile_runs_like_eager():
    # torch's meta kernel for grouped_mm accepts bf16 only, so tracing the fp32 native path (CPU,
    # dispatch = "native", train.compile = true) failed although eager fp32 runs: a model built
    # for compile takes the bucketed path there.
    from minagi.config import ModelConfig, PoolConfig
    from minagi.model import build_model
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_rows=1, d_model=16, n_heads=2, context=8),
                        PoolConfig(n_experts=8, top_k=2, d_expert=24, dispatch="native"), 7, "cpu", compiled=True)
    assert [pool.path for pool in model.pools()] == ["grouped"]
    idx = torch.randint(0, 7, (2, 8))
    eager = model(idx).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=False)(idx).logits
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-4)
