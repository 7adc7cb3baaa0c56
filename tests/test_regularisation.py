"""Regularisation in training: dropout (the model's and the experts'), whose masks are a function of
seed, step and rank, and early stopping on the held-out loss."""
import pytest
import torch

from minagi import trainer
from minagi.checkpoint import load_checkpoint
from minagi.config import load_config
from minagi.loading import load_trained
from minagi.runlog import read_history
from minagi.trainer import resume_config, train
from tiny import interrupt_at, run_tiny


@pytest.mark.parametrize("extra", [("model.dropout=0.3",), ("pool.expert_dropout=0.5",)], ids=["model", "experts"])
def test_dropout_changes_training_not_evaluation_and_a_resume_draws_the_same_masks(tmp_path, data_path,
                                                                                   monkeypatch, extra):
    plain = run_tiny(tmp_path, data_path, run_name="plain")
    full = run_tiny(tmp_path, data_path, *extra, run_name="full")
    assert full.losses[0] != pytest.approx(plain.losses[0], abs=1e-4)  # masks in training
    with monkeypatch.context() as m:
        interrupt_at(m, 4)
        first = run_tiny(tmp_path, data_path, *extra, run_name="cut")
    cfg, profile = resume_config(first.run_dir)
    second = train(cfg, profile, first.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert first.losses + second.losses == full.losses and second.heldout_loss == full.heldout_loss
    model = load_trained(full.run_dir / "last.pt")[0]
    x = torch.zeros(2, 16, dtype=torch.long)
    assert torch.equal(model(x).logits, model(x).logits)  # no masks in evaluation


def test_expert_dropout_alone_draws_each_ranks_own_masks():
    cfg = load_config("cpu_tiny", ["pool.expert_dropout=0.2", "train.device=cpu"])
    seeds = [trainer.build_training(cfg, 6, torch.device("cpu"), 1, rank=r).dropout_seed for r in (0, 1)]
    assert None not in seeds and seeds[0] != seeds[1]  # masks of (seed, step, rank), as model.dropout's


def test_early_stop_ends_the_run_once_the_held_out_loss_stops_improving(tmp_path, data_path, monkeypatch):
    held = iter([3.0, 2.5, 2.6, 2.7, 2.4, 2.0])  # best at the 2nd evaluation, then two without a better one
    monkeypatch.setattr(trainer, "evaluate", lambda *args, **kwargs: next(held))
    done = run_tiny(tmp_path, data_path, "train.steps=12", "train.eval_every=2", "train.early_stop_evals=2")
    assert done.stopped_early and done.step == 8 and done.best_heldout_loss == 2.5
    assert [r["step"] for r in read_history(done.run_dir / "history.jsonl")] == [2, 4, 6, 8]
    assert load_checkpoint(done.run_dir / "best.pt")["step"] == 4
