"""minagi.dense: the dense twin equals a one-expert pool, trains (a golden run of its own), writes,
resumes, and has the parameters its width says."""
import pytest
import torch

from minagi.config import load_config
from minagi.dense import DenseMLP, dense_swiglu
from minagi.dispatch import GROUPED_MM
from minagi.loading import load_trained
from minagi.model import build_model
from minagi.sampling import generate, write
from minagi.trainer import resume_config, train
from tiny import interrupt_at, new_pool, run_tiny

D, F_ = 16, 24
PATHS = ["loop", "grouped", "rectangle"] + (["native"] if GROUPED_MM is not None else [])

# The golden tiny run of the dense twin (tests/tiny.py TINY, model.mlp = "dense"): per-step train
# cross-entropy and the final held-out loss. Regenerate as tests/test_train.py says for its own.
GOLDEN_DENSE_LOSSES = [3.6678, 3.6167, 3.5687, 3.5236, 3.3849, 3.3832]
GOLDEN_DENSE_HELDOUT = 3.3809


@pytest.mark.parametrize("path", PATHS)
def test_one_expert_pool_equals_the_dense_swiglu_in_outputs_and_gradients(path):
    torch.manual_seed(0)
    pool = new_pool(D, F_, 1, 1, path, balance_coef=0.0)
    dense = DenseMLP(D, F_)
    with torch.no_grad():
        pool.experts.gate_up.normal_(0, 0.3)
        pool.experts.down.normal_(0, 0.3)
        dense.gate_up.copy_(pool.experts.gate_up[0])
        dense.down.copy_(pool.experts.down[0])
    x = torch.randn(37, D)
    weight = torch.randn(37, D)
    outs = []
    for mlp in (pool, dense):
        xi = x.clone().requires_grad_(True)
        y, aux = mlp(xi)
        ((y * weight).sum() + aux.loss).backward()
        outs.append((y.detach(), xi.grad))
    (y_pool, gx_pool), (y_dense, gx_dense) = outs
    torch.testing.assert_close(y_pool, y_dense, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gx_pool, gx_dense, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pool.experts.gate_up.grad[0], dense.gate_up.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.experts.down.grad[0], dense.down.grad, atol=1e-5, rtol=1e-5)
    assert pool.router.weight.grad.abs().max() == 0  # one expert: the softmax gate is 1 whatever the logit


def test_dense_swiglu_is_silu_gate_times_up_then_down():
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(5, 4), torch.randn(4, 6), torch.randn(3, 4)
    h = x @ w1
    torch.testing.assert_close(dense_swiglu(x, w1, w2), (torch.nn.functional.silu(h[:, :3]) * h[:, 3:]) @ w2)


def test_dense_model_has_the_parameters_its_width_gives_and_no_pools():
    cfg = load_config(None, ["model.mlp=dense", "model.n_rows=3", "model.d_model=48", "pool.top_k=4",
                             "pool.d_expert=40"])
    assert cfg.dense_width == 160
    vocab = 11
    model = build_model(cfg.model, cfg.pool, vocab, "cpu", dense_width=cfg.dense_width)
    d, h, rows = 48, 160, 3
    per_row = 4 * d * d + 3 * d * h + 2 * d  # qkv + proj, gate_up + down, two norms
    assert sum(p.numel() for p in model.parameters()) == rows * per_row + 2 * vocab * d + d
    assert model.pools() == []
    out = model(torch.zeros(1, 4, dtype=torch.long))
    assert out.routing == [None] * rows and out.aux_loss.item() == 0.0


def test_a_training_builds_the_twin_at_model_d_dense_when_it_is_set():
    from minagi.assemble import build_training
    sets = ["model.mlp=dense", "model.n_rows=2", "model.d_model=16", "model.n_heads=2", "pool.top_k=2",
            "pool.d_expert=8", "train.device=cpu"]
    for extra, width in (([], 16), (["model.d_dense=40"], 40)):
        training = build_training(load_config(None, sets + extra), 11, torch.device("cpu"), 1)
        assert {tuple(row.mlp.down.shape) for row in training.model.rows} == {(width, 16)}, extra


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    return run_tiny(tmp_path_factory.mktemp("dense"), None, "model.mlp=dense")


def test_golden_tiny_dense_run_losses_are_pinned(dense_run):
    print("GOLDEN_DENSE_LOSSES =", [round(x, 4) for x in dense_run.losses])
    print("GOLDEN_DENSE_HELDOUT =", round(dense_run.heldout_loss, 4))
    assert dense_run.losses == pytest.approx(GOLDEN_DENSE_LOSSES, abs=1e-4)
    assert dense_run.heldout_loss == pytest.approx(GOLDEN_DENSE_HELDOUT, abs=1e-4)
    assert dense_run.losses[-1] < dense_run.losses[0]


def test_the_dense_twin_writes_and_records_no_sinks(dense_run):
    from minagi.runlog import read_history
    assert all(r["sinks"] == [] and r["dropped_fraction"] == 0.0
               for r in read_history(dense_run.run_dir / "history.jsonl"))
    model, vocab, _ = load_trained(dense_run.run_dir / "best.pt")
    text = "".join(generate(model, vocab, "the ", 30, temperature=0.8, seed=3))
    assert len(text) == 30 and set(text) <= set(vocab.chars)
    assert text == "".join(c for (c,) in write(model, vocab, ["the "], 30, temperature=0.8, seed=3))  # the fast path


def test_the_dense_twin_resumes_to_the_uninterrupted_losses(tmp_path, data_path, monkeypatch, dense_run):
    with monkeypatch.context() as m:
        interrupt_at(m, 4)
        first = run_tiny(tmp_path, None, "model.mlp=dense", run_name="cut")
    assert first.interrupted and first.step == 4
    cfg, profile = resume_config(first.run_dir)
    second = train(cfg, profile, first.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert first.losses + second.losses == dense_run.losses
