"""One optimizer step (minagi/step.py): gradient accumulation against one large forward, the routing
pre-pass of the balance term over the whole step, DDP's no_sync, fp16's loss scale and skipped steps.
Tiny CPU models; each test takes about a second."""
import contextlib
import dataclasses
import math

import numpy as np
import pytest
import torch

from minagi import assemble, step as step_module
from minagi.assemble import build_training
from minagi.checkpoint import load_checkpoint
from minagi.config import load_config
from minagi.data import get_batch
from minagi.runlog import read_history
from minagi.step import NonFiniteLossError, routing_prepass, train_step
from tiny import interrupt_at, run_tiny
from minagi.trainer import resume_config, train

CPU = torch.device("cpu")
# Two rows (the second routes on what the first computed), 4 experts top-2, the balance term over the
# step and the aux-free bias on (a large rate, so it moves within a few steps), no dropout.
MODEL = ["model.n_rows=2", "model.d_model=32", "model.n_heads=2", "model.context=16", "pool.n_experts=4",
         "pool.top_k=2", "pool.d_expert=32", "pool.aux_free_bias=true", "pool.bias_update_rate=0.01",
         "pool.balance_coef=0.05", "train.device=cpu", "train.warmup_steps=1", "train.steps=10"]
IDS = np.random.default_rng(0).integers(0, 20, 5000).astype(np.uint8)


def _training(batch_size: int, accum_steps: int, *extra: str):
    cfg = load_config(None, [*MODEL, f"train.batch_size={batch_size}", f"train.accum_steps={accum_steps}", *extra])
    return cfg, build_training(cfg, 20, CPU, 1)


def _run(batch_size: int, accum_steps: int, steps: int = 4, *extra: str) -> dict:
    """Per step: the stats, the gradients the update used, the selection biases after it."""
    cfg, t = _training(batch_size, accum_steps, *extra)
    grads = []
    t.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.append([p.grad.clone() for p in t.params]))
    stats, biases = [], []
    for s in range(steps):
        x, y = get_batch(IDS, batch_size, 16, cfg.train.seed, s, 0, 1, accum_steps)
        stats.append(train_step(t, x, y, step=s, grad_clip=1.0, world_size=1, device=CPU))
        biases.append(torch.stack([p.router.selection_bias.clone() for p in t.model.pools()]))
    return {"stats": stats, "grads": grads, "biases": biases, "model": t.model}


def test_a_step_batch_is_the_same_sequences_whatever_the_micro_batches():
    whole_x, whole_y = get_batch(IDS, 32, 16, 1337, 3)
    x, y = get_batch(IDS, 8, 16, 1337, 3, 0, 1, 4)
    assert torch.equal(whole_x, x) and torch.equal(whole_y, y)
    halves = [get_batch(IDS, 8, 16, 1337, 3, r, 2, 4)[0] for r in range(2)]  # rank r: its rows of each micro-batch
    for micro in range(4):
        assert torch.equal(torch.cat([h.chunk(4)[micro] for h in halves]), x.chunk(4)[micro])


def test_four_micro_batches_of_8_train_as_one_batch_of_32():
    one, four = _run(32, 1), _run(8, 4)
    for a, b in zip(one["stats"], four["stats"]):
        assert b.ce == pytest.approx(a.ce, rel=1e-5)
        assert b.aux == pytest.approx(a.aux, rel=1e-5)  # the balance term over the whole step
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert torch.equal(b.counts.load_LE, a.counts.load_LE)  # the routing meters: every micro-batch once
        assert b.counts.chars == a.counts.chars == [32 * 16] * 2
    for ga, gb in zip(one["grads"], four["grads"]):
        for a, b in zip(ga, gb):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    for a, b in zip(one["biases"], four["biases"]):
        assert torch.equal(a, b)  # moved once a step, from the whole step's loads
    assert torch.stack(four["biases"]).abs().sum() > 0
    # Adam divides by the root of the second moment: a near-zero gradient's float noise moves its weight by
    # a little of the learning rate (3e-3): 2e-6 at most here, on weights of ~0.08.
    for (name, a), b in zip(one["model"].state_dict().items(), four["model"].state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)


def test_the_prepass_gives_the_pools_the_steps_counts_of_the_real_pass_even_with_dropout():
    # Dropout masks are drawn per (seed, step, micro-batch, rank): the no-grad pass routes as the real one.
    cfg, t = _training(4, 3, "model.dropout=0.2", "pool.expert_dropout=0.2")
    x, y = get_batch(IDS, 4, 16, 1337, 0, 0, 1, 3)
    pre = routing_prepass(t, x.chunk(3), step=0, world_size=1)
    stats = train_step(t, x, y, step=0, grad_clip=1.0, world_size=1, device=CPU)
    assert t.balance_prepass and torch.equal(pre.long(), stats.counts.load_LE)


def test_each_micro_batch_and_each_step_draws_its_own_dropout_masks():
    """The same sequences in both micro-batches of a step, and again at the next step: only the masks
    (drawn from seed, step and micro-batch) can make their losses differ."""
    cfg, t = _training(2, 2, "model.dropout=0.5", "pool.balance_coef=0")
    forward, losses = t.forward, []
    t.forward = lambda *a, **k: (out := forward(*a, **k)) and losses.append(out.loss.item()) or out
    x, y = get_batch(IDS, 1, 16, 1337, 0)
    for s in range(2):
        train_step(t, x.repeat(2, 1), y.repeat(2, 1), step=s, grad_clip=1.0, world_size=1, device=CPU)
    assert len(losses) == 4 and len(set(losses)) == 4, losses


def test_the_prepass_runs_only_for_the_balance_term_over_an_accumulated_step(monkeypatch):
    calls = []
    monkeypatch.setattr(step_module, "routing_prepass", lambda *a: calls.append(1) or routing_prepass(*a))
    for batch, accum, extra, expected in ((8, 1, (), 0), (4, 2, (), 1), (4, 2, ("pool.balance_scope=batch",), 0),
                                          (4, 2, ("pool.balance_coef=0",), 0)):
        calls.clear()
        cfg, t = _training(batch, accum, *extra)
        x, y = get_batch(IDS, batch, 16, 1337, 0, 0, 1, accum)
        train_step(t, x, y, step=0, grad_clip=1.0, world_size=1, device=CPU)
        assert len(calls) == expected, (batch, accum, extra)


def test_ddp_syncs_gradients_in_the_last_micro_batch_only():
    cfg, t = _training(4, 3)
    entered = []

    class FakeDDP:  # what train_step asks of DDP: no_sync around every micro-batch but the last
        @contextlib.contextmanager
        def no_sync(self):
            entered.append("no_sync")
            yield
    t.ddp = FakeDDP()
    x, y = get_batch(IDS, 4, 16, 1337, 0, 0, 1, 3)
    train_step(t, x, y, step=0, grad_clip=1.0, world_size=1, device=CPU)
    assert entered == ["no_sync", "no_sync"]


def test_a_resume_in_the_middle_of_an_accumulating_run_equals_the_uninterrupted_run(tmp_path, data_path, monkeypatch):
    extra = ("train.batch_size=2", "train.accum_steps=2", "train.steps=6", "train.eval_every=2", "model.dropout=0.1")
    full = run_tiny(tmp_path, data_path, *extra, run_name="full")
    with monkeypatch.context() as m:
        interrupt_at(m, 3)
        cut = run_tiny(tmp_path, data_path, *extra, run_name="cut")
    assert cut.interrupted and cut.step == 3
    rest = train(*resume_config(cut.run_dir), cut.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert cut.losses + rest.losses == full.losses
    for a, b in zip(read_history(cut.run_dir / "history.jsonl"), read_history(full.run_dir / "history.jsonl")):
        assert a["sinks"] == b["sinks"] and a["chars_seen"] == b["chars_seen"] == a["step"] * 2 * 2 * 16
        assert a["sinks"][0]["chars"] == 2 * 2 * 2 * 16  # two steps of two micro-batches of 2 x 16 characters


# ------------------------------------------------------------------------------ fp16

def test_fp16_keeps_its_loss_scale_in_the_checkpoint_and_the_history(tmp_path, data_path):
    result = run_tiny(tmp_path, data_path, "train.precision=fp16", run_name="fp16")
    assert all(math.isfinite(x) for x in result.losses) and result.losses[-1] < result.losses[0]
    records = read_history(result.run_dir / "history.jsonl")
    assert [r["loss_scale"] for r in records] == [assemble.INIT_LOSS_SCALE] * 2
    assert [r["skipped_steps"] for r in records] == [0, 0]
    assert load_checkpoint(result.run_dir / "last.pt")["scaler"]["scale"] == assemble.INIT_LOSS_SCALE
    plain = run_tiny(tmp_path, data_path, run_name="fp32")
    assert "scaler" not in load_checkpoint(plain.run_dir / "last.pt")
    assert [r["loss_scale"] for r in read_history(plain.run_dir / "history.jsonl")] == [None, None]


def test_an_fp16_overflow_skips_the_update_and_is_counted_not_a_nan_stop(tmp_path, data_path, monkeypatch):
    monkeypatch.setattr(assemble, "INIT_LOSS_SCALE", 2.0 ** 100)  # every gradient overflows fp16
    seen = []
    monkeypatch.setattr(assemble, "build_model", _keeping(assemble.build_model, seen))
    result = run_tiny(tmp_path, data_path, "train.precision=fp16", "train.steps=3", "train.eval_every=3",
                      run_name="overflow")
    assert result.step == 3 and all(math.isfinite(x) for x in result.losses)
    (record,) = read_history(result.run_dir / "history.jsonl")
    assert record["skipped_steps"] == 3 and record["grad_norm"] is None
    assert record["loss_scale"] == 2.0 ** 97  # halved at each overflow
    initial = seen[0]
    for key, value in load_checkpoint(result.run_dir / "last.pt")["model"].items():
        assert torch.equal(value, initial[key]), key  # no update ran
    assert load_checkpoint(result.run_dir / "last.pt")["scaler"]["scale"] == 2.0 ** 97


def test_an_fp16_resume_goes_on_with_the_loss_scale_it_had(tmp_path, data_path, monkeypatch):
    monkeypatch.setattr(assemble, "INIT_LOSS_SCALE", 2.0 ** 100)
    extra = ("train.precision=fp16", "train.steps=4", "train.eval_every=2")
    full = run_tiny(tmp_path, data_path, *extra, run_name="full")
    with monkeypatch.context() as m:
        interrupt_at(m, 2)
        cut = run_tiny(tmp_path, data_path, *extra, run_name="cut")
    rest = train(*resume_config(cut.run_dir), cut.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert cut.losses + rest.losses == full.losses
    assert [r["loss_scale"] for r in read_history(cut.run_dir / "history.jsonl")] == [2.0 ** 98, 2.0 ** 96]


def test_fp16_gradients_that_overflow_at_every_scale_stop_the_run_before_updating(tmp_path, data_path, monkeypatch):
    monkeypatch.setattr(assemble, "INIT_LOSS_SCALE", 2.0 ** 100)
    monkeypatch.setattr(step_module, "MIN_LOSS_SCALE", 2.0 ** 99)  # the second overflow would go below it
    with pytest.raises(NonFiniteLossError, match="step 2: the gradients are not finite even at fp16 loss scale") as e:
        run_tiny(tmp_path, data_path, "train.precision=fp16", run_name="nan")
    assert e.value.step == 2


def _keeping(build, seen: list):
    def keeping(*args, **kwargs):
        model = build(*args, **kwargs)
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return model
    return keeping


def _fused(t):
    """The training with torch's fused AdamW (what build_optimizer takes on CUDA; it runs on the CPU
    too) over the same groups and schedule."""
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in t.optimizer.param_groups]
    fused = torch.optim.AdamW(groups, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(fused, t.scheduler.lr_lambdas[0])
    return dataclasses.replace(t, optimizer=fused, scheduler=scheduler)


@pytest.mark.parametrize("clip", [0.05, 100.0])  # clipping every step, and never
def test_the_fused_update_clips_as_clip_grad_norm_does(monkeypatch, clip):
    runs = {}
    for folded in (True, False):
        monkeypatch.setattr(step_module.optim, "clips_in_update", lambda o, folded=folded: folded)
        cfg, t = _training(8, 1)
        t = _fused(t)
        seen = []  # the gradients the update is handed: unclipped where it clips them itself
        t.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
            (torch.cat([p.grad.flatten() for p in t.params]).norm().item(), getattr(opt, "grad_scale", None))))
        norms = []
        for s in range(3):
            x, y = get_batch(IDS, 8, 16, cfg.train.seed, s, 0, 1)
            norms.append(train_step(t, x, y, step=s, grad_clip=clip, world_size=1, device=CPU).grad_norm)
        assert not hasattr(t.optimizer, "grad_scale")  # set for the update only
        runs[folded] = (t.model, norms, seen)
    (folded_model, folded_norms, folded_seen), (plain_model, plain_norms, plain_seen) = runs[True], runs[False]
    assert folded_norms == pytest.approx(plain_norms, rel=1e-5)
    for (handed, divisor), norm in zip(folded_seen, folded_norms):
        assert handed == pytest.approx(norm, rel=1e-5)  # not clipped before the update
        assert divisor.item() == pytest.approx(max(1.0, norm / clip), rel=1e-5)
    for (handed, divisor), norm in zip(plain_seen, plain_norms):
        assert divisor is None and handed == pytest.approx(min(norm, clip), rel=1e-4)
    for a, b in zip(folded_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_only_torchs_fused_adamw_clips_in_its_update():
    from minagi import optim
    _, t = _training(8, 1)
    assert not optim.clips_in_update(t.optimizer)  # the CPU's AdamW is not fused
    assert optim.clips_in_update(_fused(t).optimizer)
    _, bf16 = _training(8, 1, "train.optimizer_states=bf16")
    assert not optim.clips_in_update(bf16.optimizer)
