"""minagi.upcycle: a dense twin's MLP split into a pool's experts in virtual groups reproduces the dense
row exactly before training (outputs and input gradients), through --init end to end; what it cannot
map is a one-line error naming the tensor and both shapes."""
import pytest
import torch

from minagi.checkpoint import Checkpoint, CheckpointError
from minagi.config import PoolConfig
from minagi.dense import DenseMLP
from minagi.loading import init_from_checkpoint, load_trained
from minagi.model import build_model
from minagi.upcycle import gate_scale, upcycle_mlp
from tiny import new_pool, run_tiny, tiny_cfg

D, F_ = 16, 8


def upcycled_pool(E, K, S, score="softmax", path="grouped", **pool_settings):
    """(pool upcycled from a random dense twin, the twin)."""
    torch.manual_seed(0)
    dense = DenseMLP(D, (K + S) * F_)
    with torch.no_grad():
        dense.gate_up.normal_(0, 0.3)
        dense.down.normal_(0, 0.3)
    pool = new_pool(D, F_, E, K, path, shared_experts=S, router_score=score, **pool_settings)
    with torch.no_grad():
        pool.router.weight.normal_(0, 1.0)  # a fresh router, far from even: the ties come from the groups
    state = upcycle_mlp(dense.gate_up.detach(), dense.down.detach(), pool.cfg, pool.router.weight.detach())
    pool.load_state_dict(state)
    return pool, dense


@pytest.mark.parametrize("E, K, S, score, path", [
    (8, 2, 0, "softmax", "grouped"), (8, 4, 0, "sigmoid", "loop"), (12, 3, 1, "softmax", "rectangle"),
    (6, 2, 2, "sigmoid", "grouped"), (4, 4, 0, "softmax", "loop")])
def test_an_upcycled_pool_computes_its_dense_twin_exactly_before_training(E, K, S, score, path):
    pool, dense = upcycled_pool(E, K, S, score, path)
    x = torch.randn(64, D)
    r = pool.router(x)
    # Each character chooses one whole copy (K consecutive experts, one of each slice), at 1/K each.
    copies = r.expert_ids_NK // K
    assert torch.equal(copies, copies[:, :1].expand_as(copies))
    assert torch.equal((r.expert_ids_NK % K).sort(-1).values, torch.arange(K).expand(64, K))
    assert len(copies.unique()) > 1 or E == K  # different characters choose different copies
    torch.testing.assert_close(r.gates_NK, torch.full((64, K), 1 / K))
    outs = []
    for mlp in (pool, dense):
        xi = x.clone().requires_grad_(True)
        y, _ = mlp(xi)
        (y * torch.linspace(-1, 1, D)).sum().backward()
        outs.append((y.detach(), xi.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-6, rtol=1e-5)


def test_the_split_puts_each_slice_of_hidden_units_where_the_docstring_says():
    K, S, E = 2, 1, 4
    cfg = PoolConfig(n_experts=E, top_k=K, d_expert=F_, shared_experts=S)
    H = (K + S) * F_
    gate_up = torch.arange(D * 2 * H, dtype=torch.float32).view(D, 2 * H)
    down = torch.arange(H * D, dtype=torch.float32).view(H, D)
    out = upcycle_mlp(gate_up, down, cfg, torch.randn(E, D))
    gate, up = gate_up[:, :H], gate_up[:, H:]
    assert torch.equal(out["shared.gate_up"], torch.cat([gate[:, :F_], up[:, :F_]], -1))
    assert torch.equal(out["shared.down"], down[:F_])
    for e in range(E):
        j = S + e % K  # the slice of hidden units expert e holds
        cols = slice(j * F_, (j + 1) * F_)
        assert torch.equal(out["experts.gate_up"][e], torch.cat([gate[:, cols], up[:, cols]], -1))
        assert torch.equal(out["experts.down"][e], down[cols] * K)
    assert torch.equal(out["router.weight"][1], out["router.weight"][0])
    assert torch.equal(out["router.weight"][3], out["router.weight"][2])
    assert not torch.equal(out["router.weight"][2], out["router.weight"][0])
    assert out["router.selection_bias"].abs().sum() == 0


def test_top1_scales_by_the_even_routers_gate_and_is_exact_for_equal_logits():
    assert gate_scale(PoolConfig(n_experts=8, top_k=1)) == 8.0
    assert gate_scale(PoolConfig(n_experts=8, top_k=1, router_score="sigmoid")) == 2.0
    assert gate_scale(PoolConfig(n_experts=8, top_k=4)) == 4.0
    for score in ("softmax", "sigmoid"):
        pool, dense = upcycled_pool(8, 1, 1, score)
        with torch.no_grad():
            pool.router.weight.zero_()  # all logits equal: the gate is exactly 1/E (softmax) or 1/2 (sigmoid)
        x = torch.randn(10, D)
        torch.testing.assert_close(pool(x)[0], dense(x)[0], atol=1e-6, rtol=1e-5)


def test_experts_past_the_last_whole_copy_start_from_a_slice_with_a_router_row_of_their_own():
    pool, dense = upcycled_pool(5, 2, 0)  # copies {0, 1}, {2, 3}; expert 4 holds slice 0 alone
    w = pool.router.weight
    assert torch.equal(w[4], w[4]) and not torch.equal(w[4], w[2]) and not torch.equal(w[4], w[0])
    assert torch.equal(pool.experts.gate_up[4], pool.experts.gate_up[0])
    x = torch.randn(200, D)
    whole = (pool.router(x).expert_ids_NK < 4).all(-1)  # characters that chose a whole copy
    assert whole.any()
    torch.testing.assert_close(pool(x)[0][whole], dense(x)[0][whole], atol=1e-6, rtol=1e-5)


# --- through --init -------------------------------------------------------------------------------

SHARED = ["pool.shared_experts=1", "pool.top_k=1", "pool.n_experts=4"]  # the twin: (1 + 1) x 32 = 64 wide


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    return run_tiny(tmp_path_factory.mktemp("twin"), None, "model.mlp=dense")


@pytest.mark.parametrize("extra", [[], ["pool.top_k=1", "pool.shared_experts=1", "pool.router_score=sigmoid"]],
                         ids=["top2", "shared-top1-sigmoid"])
def test_init_from_a_dense_twin_checkpoint_upcycles_it_and_the_model_writes_the_same_logits(dense_run, tmp_path,
                                                                                          extra):
    dense, vocab, _ = load_trained(dense_run.run_dir / "best.pt")
    cfg = tiny_cfg(tmp_path, None, *extra)
    assert cfg.pool.dense_width == dense.rows[0].mlp.down.shape[0] == 64
    model = build_model(cfg.model, cfg.pool, vocab.size, "cpu").eval()
    ckpt = Checkpoint.load(dense_run.run_dir / "best.pt", map_location="cpu")
    assert init_from_checkpoint(model, ckpt, dense_run.run_dir / "best.pt") == []
    if cfg.pool.top_k == 1:  # the top-1 rule: exact for an even router
        for pool in model.pools():
            torch.nn.init.zeros_(pool.router.weight)
    idx = torch.randint(0, vocab.size, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, dense(idx).logits, atol=1e-5, rtol=1e-5)
    for key in ("embed.weight", "rows.0.attn.qkv.weight", "rows.0.mlp_norm.weight", "head.weight"):
        assert torch.equal(model.state_dict()[key], ckpt.model[key])


def test_train_init_from_the_dense_twin_trains_the_upcycled_model(dense_run, tmp_path):
    result = run_tiny(tmp_path, dense_run.run_dir.parent.parent / "text.txt", run_name="upcycled",
                      init=dense_run.run_dir)  # a run folder: its best.pt, as sample.py reads one
    assert result.losses[0] < dense_run.losses[0]  # it starts where the twin ended, not from scratch
    assert result.losses[0] == pytest.approx(dense_run.losses[-1], abs=0.3)


def test_init_says_when_the_same_weights_would_compute_another_attention(dense_run, tmp_path):
    """n_heads and rope_base keep every shape, so the copy succeeds: it is said, not refused."""
    from minagi.trainer import train
    text, said = dense_run.run_dir.parent.parent / "text.txt", []
    for name, extra in (("heads", ["model.n_heads=4"]), ("same", [])):
        cfg = tiny_cfg(tmp_path, text, "train.steps=2", "train.warmup_steps=1", *extra, run_name=name)
        train(cfg, "tiny", progress=False, log=said.append, argv=["test"], init=dense_run.run_dir / "best.pt")
        said.append(f"-- {name}")
    warnings = [m for m in said if m.startswith(("warning: --init", "--"))]
    assert len(warnings) == 3 and warnings[1:] == ["-- heads", "-- same"]
    assert "model.n_heads = 4 here, 2 in the run it comes from" in warnings[0]


def test_init_into_another_rope_base_says_so_naming_model_rope_base(dense_run, tmp_path):
    """rope_base keeps every shape as n_heads does: the same weights rotated otherwise, said."""
    from minagi.trainer import train
    text, said = dense_run.run_dir.parent.parent / "text.txt", []
    cfg = tiny_cfg(tmp_path, text, "train.steps=2", "train.warmup_steps=1", "model.rope_base=500", run_name="rope")
    train(cfg, "tiny", progress=False, log=said.append, argv=["test"], init=dense_run.run_dir / "best.pt")
    warnings = [m for m in said if m.startswith("warning: --init")]
    assert len(warnings) == 1 and "model.rope_base = 500 here, 10000 in the run it comes from" in warnings[0]


def test_init_from_an_exported_folder_says_to_start_from_the_run_instead(dense_run, tmp_path):
    exported = tmp_path / "out"
    exported.mkdir()
    for name in ("model.safetensors", "config.json", "vocab.json"):
        (exported / name).write_text("{}")
    with pytest.raises(CheckpointError, match=r"--init .*out: an exported model \(for writing and scoring\); a run "
                                              r"starts from a checkpoint: the run folder it was exported from"):
        run_tiny(tmp_path, dense_run.run_dir.parent.parent / "text.txt", run_name="x", init=exported)


def test_a_dense_twin_of_another_width_is_a_one_line_error_naming_the_tensor_and_both_shapes(dense_run, tmp_path):
    cfg = tiny_cfg(tmp_path, None, "pool.d_expert=16")  # the twin is 64 wide; this pool's twin would be 32
    _, vocab, _ = load_trained(dense_run.run_dir / "best.pt")
    model = build_model(cfg.model, cfg.pool, vocab.size, "cpu")
    ckpt = Checkpoint.load(dense_run.run_dir / "best.pt", map_location="cpu")
    with pytest.raises(CheckpointError) as info:
        init_from_checkpoint(model, ckpt, "twin.pt")
    message = str(info.value)
    assert "\n" not in message
    assert message == ("twin.pt: rows.0.mlp.gate_up is [32, 128]; upcycling into 4 experts top-2 with 0 shared of "
                       "width 16 needs [32, 64] (the dense twin's width (top_k + shared_experts) x d_expert = 32)")


def test_a_dense_twin_with_fewer_rows_is_a_one_line_error(dense_run, tmp_path):
    cfg = tiny_cfg(tmp_path, None, "model.n_rows=2")
    _, vocab, _ = load_trained(dense_run.run_dir / "best.pt")
    model = build_model(cfg.model, cfg.pool, vocab.size, "cpu")
    ckpt = Checkpoint.load(dense_run.run_dir / "best.pt", map_location="cpu")
    with pytest.raises(CheckpointError, match=r"^twin.pt: has no rows.1.mlp.gate_up: not the dense twin"):
        init_from_checkpoint(model, ckpt, "twin.pt")
