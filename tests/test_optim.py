"""train.optimizer_states (minagi/optim.py): AdamW with bf16 moments against torch's AdamW, its
stochastic rounding, its checkpoint round trip, and runs that learn and resume exactly."""
import io

import pytest
import torch

from minagi.checkpoint import load_checkpoint
from minagi.optim import AdamWBF16, build_optimizer, state_bytes, stochastic_round_
from minagi.runlog import read_history
from minagi.trainer import resume_config, train
from tiny import interrupt_at, run_tiny

CPU = torch.device("cpu")


def _pair(seed: int = 0, n: int = 4000, **kwargs):
    torch.manual_seed(seed)
    w = torch.randn(n)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, **kwargs}
    return a, b, torch.optim.AdamW([a], **settings), AdamWBF16([b], **settings)


def test_bf16_states_are_bf16_and_half_the_bytes_of_fp32_ones():
    params = [torch.nn.Parameter(torch.randn(30, 20)), torch.nn.Parameter(torch.randn(7))]
    fp32 = build_optimizer([{"params": params}], lr=1e-3, betas=(0.9, 0.95), states="fp32", device=CPU)
    bf16 = build_optimizer([{"params": params}], lr=1e-3, betas=(0.9, 0.95), states="bf16", device=CPU)
    for p in params:
        p.grad = torch.randn_like(p)
    fp32.step()
    bf16.step()
    for p in params:
        state = bf16.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert state["exp_avg"].shape == p.shape and state["step"].item() == 1
    assert state_bytes(fp32) == 8 * 607 and state_bytes(bf16) == 4 * 607


def test_bf16_states_follow_torchs_adamw():
    a, b, reference, lean = _pair()
    for _ in range(50):
        g = torch.randn_like(a)
        a.grad, b.grad = g.clone(), g.clone()
        reference.step()
        lean.step()
    torch.manual_seed(0)
    moved = (a.detach() - torch.randn(4000)).abs().mean()  # how far 50 steps took the weights
    # The same updates, up to the moments' rounding (~0.4% an element and step, a random walk over 50 steps).
    assert (a - b).abs().max() < 0.05 * moved
    assert (a - b).abs().mean() < 0.01 * moved


def test_a_weight_stored_transposed_follows_torchs_adamw_too():
    """A strided weight (its moments made alike by zeros_like) is read and written in its logical order;
    it failed at `view(-1)` before (found by the fused update's test, which leaves such weights to this form)."""
    torch.manual_seed(0)
    w = torch.randn(40, 30).t()
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    assert not b.is_contiguous()
    reference, lean = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1), AdamWBF16([b], lr=1e-2, weight_decay=0.1)
    for _ in range(30):
        g = torch.randn(30, 40)
        a.grad, b.grad = g.clone(), g.clone()
        reference.step()
        lean.step()
    moved = (a.detach() - w).abs().mean()
    assert (a - b).abs().max() < 0.05 * moved and (a - b).abs().mean() < 0.01 * moved


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbouring_bf16():
    value = torch.full((200_000,), 1.0 + 2 ** -10)  # between the bf16 neighbours 1 and 1 + 2^-7
    out = torch.empty(200_000, dtype=torch.bfloat16)
    stochastic_round_(out, value, torch.Generator().manual_seed(0))
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert out.float().mean().item() == pytest.approx(1.0 + 2 ** -10, rel=2e-5)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), -2.5, 0.0])
    rounded = torch.empty(5, dtype=torch.bfloat16)
    stochastic_round_(rounded, special, torch.Generator().manual_seed(0))
    assert rounded[0] == float("inf") and rounded[1] == -float("inf") and rounded[2].isnan()
    assert rounded[3] == -2.5 and rounded[4] == 0


def test_a_decaying_second_moment_does_not_stall_in_bf16():
    # beta2 = 0.999: each step takes 0.1% off v, below bf16's resolution; rounded to nearest, v would stay put.
    a, b, reference, lean = _pair(betas=(0.9, 0.999), n=20_000)
    for step in range(400):
        g = torch.randn_like(a) if step == 0 else torch.zeros_like(a)
        a.grad, b.grad = g.clone(), g.clone()
        reference.step()
        lean.step()
    want, got = reference.state[a]["exp_avg_sq"], lean.state[b]["exp_avg_sq"].float()
    assert got.mean().item() == pytest.approx(want.mean().item(), rel=0.01)  # 0.999^399 of the first step's


def test_each_group_and_chunk_draws_its_own_rounding_bits_and_a_step_redraws_the_same(monkeypatch):
    """Shared rounding bits would round the same error into every group and chunk at once (a bias
    that does not average out); seeded by (seed, step, group, chunk), a step is still reproducible."""
    from minagi import optim
    monkeypatch.setattr(optim, "CHUNK", 1000)  # the first group's two tensors: two chunks

    def stepped():
        torch.manual_seed(0)
        w, g = torch.randn(1000), torch.randn(1000)
        params = [torch.nn.Parameter(w.clone()) for _ in range(3)]
        for p in params:
            p.grad = g.clone()
        opt = AdamWBF16([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, seed=3)
        opt.step()
        return [opt.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq")]

    first = stepped()  # exp_avg and exp_avg_sq of: group 0 chunk 0, group 0 chunk 1, group 1 chunk 0
    for a, b in [(0, 2), (0, 4), (2, 4), (1, 3), (1, 5), (3, 5)]:
        assert not torch.equal(first[a], first[b]), (a, b)
    assert all(torch.equal(a, b) for a, b in zip(first, stepped()))


def test_bf16_states_round_trip_a_checkpoint_and_go_on_exactly():
    a, b, _, lean = _pair()
    grads = [torch.randn_like(b) for _ in range(6)]
    for g in grads[:3]:
        b.grad = g.clone()
        lean.step()
    buf = io.BytesIO()
    torch.save({"optimizer": lean.state_dict(), "param": b.detach().clone()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    c = torch.nn.Parameter(saved["param"])
    resumed = AdamWBF16([c], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    resumed.load_state_dict(saved["optimizer"])
    assert resumed.state[c]["exp_avg"].dtype == torch.bfloat16  # torch's load would have made it fp32
    assert torch.equal(resumed.state[c]["exp_avg_sq"], lean.state[b]["exp_avg_sq"])
    for g in grads[3:]:
        b.grad, c.grad = g.clone(), g.clone()
        lean.step()
        resumed.step()
    assert torch.equal(b, c)


def test_a_run_with_bf16_states_learns_and_resumes_exactly(tmp_path, data_path, monkeypatch):
    extra = ("train.optimizer_states=bf16", "train.steps=8", "train.eval_every=4")
    full = run_tiny(tmp_path, data_path, *extra, run_name="full")
    fp32 = run_tiny(tmp_path, data_path, "train.steps=8", "train.eval_every=4", run_name="fp32")
    assert full.losses[-1] < full.losses[0] - 0.3 and full.heldout_loss == pytest.approx(fp32.heldout_loss, abs=0.02)
    last = load_checkpoint(full.run_dir / "last.pt")
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in last["optimizer"]["state"].values())
    with monkeypatch.context() as m:
        interrupt_at(m, 5)
        cut = run_tiny(tmp_path, data_path, *extra, run_name="cut")
    rest = train(*resume_config(cut.run_dir), cut.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert cut.losses + rest.losses == full.losses
    assert [r["heldout_loss"] for r in read_history(cut.run_dir / "history.jsonl")] == \
        [r["heldout_loss"] for r in read_history(full.run_dir / "history.jsonl")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_run_with_bf16_states_resumes_as_it_runs_uninterrupted(tmp_path, data_path, monkeypatch):
    """The fused update's rounding bits come from (seed, step, tensor): a run cut at step 5 and resumed
    takes the uninterrupted run's steps on the GPU too (first: two uninterrupted runs agree there)."""
    extra = ("train.device=cuda", "train.optimizer_states=bf16", "train.steps=8", "train.eval_every=4")
    full = run_tiny(tmp_path, data_path, *extra, run_name="full")
    again = run_tiny(tmp_path, data_path, *extra, run_name="again")
    assert again.losses == full.losses
    with monkeypatch.context() as m:
        interrupt_at(m, 5)
        cut = run_tiny(tmp_path, data_path, *extra, run_name="cut")
    rest = train(*resume_config(cut.run_dir), cut.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert cut.losses + rest.losses == full.losses
