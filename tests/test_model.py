"""The char LM: causality, the loss and aux terms, RoPE tables, dispatch resolution, parameter groups.
(The decoder against this forward: tests/test_decode.py.)"""
import torch

from minagi.config import ModelConfig, PoolConfig
from minagi.model import CharLM, build_model

CFG = ModelConfig(n_rows=2, d_model=32, n_heads=4, context=32)
POOL = PoolConfig(n_experts=4, top_k=2, d_expert=32)


def test_rope_tables_are_made_once_left_out_of_checkpoints_and_still_reach_past_the_context():
    from minagi.rowmath import rope_tables
    torch.manual_seed(0)
    model = build_model(CFG, POOL, vocab_size=11, device="cpu").eval()
    attn = model.rows[0].attn
    cos_Td, sin_Td = rope_tables(torch.arange(CFG.context), CFG.head_dim, CFG.rope_base)
    assert torch.equal(attn.rope_cos, cos_Td) and torch.equal(attn.rope_sin, sin_Td)
    assert not [k for k in model.state_dict() if "rope" in k]  # checkpoints are as before the tables
    fresh = build_model(CFG, POOL, vocab_size=11, device="cpu").eval()
    fresh.load_state_dict(model.state_dict())  # strict: the tables are not missing keys
    idx = torch.randint(0, 11, (1, 40))  # longer than the context: its tables are computed
    with torch.no_grad():
        within = model(idx[:, :CFG.context]).logits  # positions 0..31: from the tables
        longer = model(idx).logits                   # 0..39: computed
    torch.testing.assert_close(longer[:, :CFG.context], within, atol=1e-5, rtol=1e-4)


def test_causal_prefix_logits_do_not_see_the_future():
    torch.manual_seed(0)
    model = build_model(CFG, POOL, vocab_size=7, device="cpu").eval()
    a = torch.randint(0, 7, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 7
    with torch.no_grad():
        torch.testing.assert_close(model(a).logits[:, :10], model(b).logits[:, :10])


def test_loss_is_cross_entropy_and_aux_sums_the_rows():
    torch.manual_seed(0)
    model = build_model(CFG, POOL, vocab_size=9, device="cpu")
    idx, tgt = torch.randint(0, 9, (3, 12)), torch.randint(0, 9, (3, 12))
    terms = []  # each row's own aux term, as its pool returned it
    for pool in model.pools():
        pool.register_forward_hook(lambda module, args, out: terms.append(out[1].loss.detach()))
    out = model(idx, tgt)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits.view(-1, 9), tgt.view(-1)))
    assert len(terms) == CFG.n_rows >= 2 and all(t > 0 for t in terms) and not torch.equal(terms[0], terms[1])
    torch.testing.assert_close(out.aux_loss.detach(), torch.stack(terms).sum())
    (out.loss + out.aux_loss).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_auto_dispatch_resolves_to_grouped_on_cpu_and_each_row_reports_its_routing():
    model = build_model(CFG, POOL, vocab_size=5, device="cpu")
    assert {pool.path for pool in model.pools()} == {"grouped"}
    routing = model(torch.zeros(1, 4, dtype=torch.long)).routing
    assert len(routing) == 2 and all(c.path == "grouped" and c.chars == 4 for c in routing)
    assert [int(c.load_E.sum()) for c in routing] == [4 * POOL.top_k] * 2


def test_param_groups_keep_norms_out_of_weight_decay():
    model = CharLM(CFG, POOL, vocab_size=5)
    decay, no_decay = model.param_groups(0.1)
    norm_params = {id(p) for n, p in model.named_parameters() if "norm" in n}
    assert norm_params and norm_params <= {id(p) for p in no_decay["params"]}
    assert not norm_params & {id(p) for p in decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_expert_stacks_decay_apart_only_when_asked():
    model = CharLM(CFG, POOL, vocab_size=5)
    assert len(model.param_groups(0.1, 0.1)) == 2  # the same decay: the two groups of older checkpoints
    rest, experts, plain = model.param_groups(0.1, 0.5)
    stacks = {id(p) for pool in model.pools() for p in pool.experts.parameters()}
    assert {id(p) for p in experts["params"]} == stacks and experts["weight_decay"] == 0.5
    assert not stacks & {id(p) for p in rest["params"]} and rest["weight_decay"] == 0.1
    assert sum(len(g["params"]) for g in (rest, experts, plain)) == len(list(model.parameters()))


def test_expert_dropout_drops_chosen_experts_in_training_only():
    from dataclasses import replace
    from minagi.pool import PooledMLP
    torch.manual_seed(0)
    pool = PooledMLP(16, replace(POOL, expert_dropout=0.5), "loop")
    x = torch.randn(64, 16)
    pool.eval()
    want, _ = pool(x)
    pool.train()
    torch.manual_seed(1)
    dropped, _ = pool(x)
    torch.manual_seed(1)
    again, _ = pool(x)
    assert torch.equal(dropped, again)  # the mask follows the RNG, which the trainer seeds per step and rank
    assert not torch.allclose(dropped, want)
    assert torch.equal(pool.eval()(x)[0], want)


def test_expert_dropout_scales_the_kept_gates_by_one_over_one_minus_p():
    from dataclasses import replace
    from minagi.pool import PooledMLP
    p = 0.5
    torch.manual_seed(0)
    pool = PooledMLP(16, replace(POOL, expert_dropout=p), "loop").train()
    x = torch.randn(64, 16)
    routing = pool.router(x)
    torch.manual_seed(1)
    mask_NK = (torch.nn.functional.dropout(torch.ones_like(routing.gates_NK), p) > 0).float()  # the draw the pool makes
    torch.manual_seed(1)
    y, _ = pool(x)
    assert 0 < mask_NK.sum() < mask_NK.numel()
    want, _ = pool.experts_forward(x, routing.expert_ids_NK, routing.gates_NK * mask_NK / (1 - p))
    torch.testing.assert_close(y, want)
    unscaled, _ = pool.experts_forward(x, routing.expert_ids_NK, routing.gates_NK * mask_NK)
    assert not torch.allclose(y, unscaled)  # the kept experts' share is restored, as inverted dropout does


def test_a_model_to_be_loaded_is_initialised_on_its_device_not_on_the_cpu(monkeypatch):
    """`weights_loaded` (writing, evaluation): no weight is made and initialised on the CPU first.
    The meta device shows it on a machine without a GPU: every init call sees meta tensors."""
    seen = []
    normal = torch.nn.init.normal_

    def recording(tensor, *args, **kwargs):
        seen.append(tensor.device.type)
        return normal(tensor, *args, **kwargs)
    monkeypatch.setattr(torch.nn.init, "normal_", recording)
    for loaded, where in ((False, {"cpu"}), (True, {"meta"})):
        seen.clear()
        model = build_model(CFG, POOL, vocab_size=11, device="meta", weights_loaded=loaded)
        assert set(seen) == where and model.embed.weight.is_meta


def test_sequence_balance_scope_gives_the_mean_of_each_sequences_aux_loss_run_alone():
    """The model tells each pool how many sequences its characters are (B, not T): with
    pool.balance_scope = "sequence" a batch's aux loss is the mean of its sequences' own."""
    from dataclasses import replace
    torch.manual_seed(0)
    pool = replace(POOL, balance_scope="sequence", balance_coef=1.0, z_loss_coef=0.0)
    model = build_model(CFG, pool, vocab_size=9, device="cpu").eval()
    idx = torch.randint(0, 9, (3, 8))  # B = 3 sequences of T = 8: the characters split either way
    with torch.no_grad():
        whole = model(idx).aux_loss
        alone = torch.stack([model(idx[b:b + 1]).aux_loss for b in range(3)])
    assert whole > 0
    torch.testing.assert_close(whole, alone.mean())


def test_dropout_falls_on_the_embedding_each_residual_branch_and_the_attention_in_training_only(monkeypatch):
    """model.dropout reaches every site: the embedding once, each row's two residual branches and its
    attention probabilities (SDPA's dropout_p); in eval mode none of them drops."""
    from dataclasses import replace
    import torch.nn.functional as F
    p, drops, attention = 0.25, [], []
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def spy_dropout(x, prob=0.5, training=True, inplace=False):
        drops.append((prob, training))
        return dropout(x, prob, training, inplace)

    def spy_sdpa(*args, dropout_p=0.0, **kwargs):
        attention.append(dropout_p)
        return sdpa(*args, dropout_p=dropout_p, **kwargs)
    monkeypatch.setattr(F, "dropout", spy_dropout)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy_sdpa)
    torch.manual_seed(0)
    model = build_model(replace(CFG, dropout=p), POOL, vocab_size=9, device="cpu")
    idx = torch.randint(0, 9, (2, 8))
    model.train()(idx)
    assert drops == [(p, True)] * (1 + 2 * CFG.n_rows) and attention == [p] * CFG.n_rows
    drops.clear(), attention.clear()
    with torch.no_grad():
        model.eval()(idx)
    assert all(not training for _, training in drops) and attention == [0.0] * CFG.n_rows


def test_rope_base_sets_the_rope_tables_within_the_context_and_past_it():
    from dataclasses import replace
    from minagi.rowmath import rope_tables
    cfg = replace(CFG, rope_base=500.0)
    attn = CharLM(cfg, POOL, vocab_size=5).rows[0].attn
    for T, (cos_Td, sin_Td) in ((cfg.context, (attn.rope_cos, attn.rope_sin)),
                                (cfg.context + 8, attn.rope(cfg.context + 8, torch.device("cpu")))):  # computed
        want_cos, want_sin = rope_tables(torch.arange(T), cfg.head_dim, 500.0)
        assert torch.equal(cos_Td, want_cos) and torch.equal(sin_Td, want_sin)
        assert not torch.allclose(cos_Td, rope_tables(torch.arange(T), cfg.head_dim, 10000.0)[0])


def test_the_rolled_rope_the_rows_run_equals_the_readable_rotation_forward_and_backward_bit_for_bit():
    """The rows rotate q and k together with rowmath.rope_rolled: the same bits as apply_rope, one
    tensor at a time, in the values and in the gradients (the run's losses stay as they were)."""
    from minagi import rowmath
    torch.manual_seed(0)
    cos, sin = rowmath.rope_tables(torch.arange(40), 16, 10000.0)
    for dtype in (torch.float32, torch.bfloat16):
        qk = torch.randn(2, 2, 3, 40, 16).to(dtype).requires_grad_()
        grad = torch.randn(2, 2, 3, 40, 16).to(dtype)
        rolled = rowmath.rope_rolled(qk, *rowmath.rolled_tables(cos, sin))
        (got,) = torch.autograd.grad(rolled, qk, grad)
        readable = torch.stack([rowmath.apply_rope(qk[i], cos, sin) for i in range(2)])
        (want,) = torch.autograd.grad(readable, qk, grad)
        assert torch.equal(rolled, readable) and torch.equal(got, want) and got.dtype == dtype


def test_a_rows_attention_inputs_are_qkvs_columns_by_head():
    from minagi import rowmath
    torch.manual_seed(0)
    x, w, norm = torch.randn(2, 5, 8), torch.randn(24, 8), torch.ones(8)
    qk, v = rowmath.attention_inputs(x, norm, None, w, n_heads=2)
    heads = torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (8,), norm), w).view(2, 5, 3, 2, 4)
    assert qk.shape == (2, 2, 2, 5, 4) and v.shape == (2, 2, 5, 4)
    assert torch.equal(qk, heads[:, :, :2].permute(2, 0, 3, 1, 4)) and torch.equal(v, heads[:, :, 2].transpose(1, 2))
