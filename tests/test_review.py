"""Claims from a correctness review of dispatch, the model, the trainer and checkpoints."""
import pytest
import torch

from minagi import trainer
from minagi.checkpoint import copy_checkpoint, load_checkpoint, save_checkpoint
from minagi.pool import PooledMLP
from minagi.runlog import read_history
from minagi.trainer import resume_config, train
from test_train import run_tiny  # noqa: F401  (fixtures and helpers of the trainer tests)
from test_train import data_path  # noqa: F401


def test_copy_checkpoint_onto_its_existing_hard_link_leaves_no_temp_file(tmp_path):
    # rename(2) of one hard link over another of the same file "does nothing, and returns success":
    # the temp link would be left beside best.pt.
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    save_checkpoint(last, {"step": 1})
    copy_checkpoint(last, best)
    copy_checkpoint(last, best)
    assert load_checkpoint(best)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]


@pytest.mark.parametrize("where", ["evaluation", "checkpoint write"])
@pytest.mark.parametrize("at_step", [2, 4])
def test_ctrl_c_during_an_evaluation_loses_neither_its_record_nor_best_pt(tmp_path, data_path, monkeypatch,  # noqa: F811
                                                                          where, at_step):
    # Ctrl-C while step 2's (or the last step's) evaluation runs or writes its files: the resumed
    # run must end with the uninterrupted run's history and best.pt, not skip that evaluation.
    extra = ("train.steps=4", "train.eval_every=2")
    full = run_tiny(tmp_path, data_path, *extra, run_name="full")
    name = "_evaluate" if where == "evaluation" else "save_checkpoint"
    real = getattr(trainer, name)
    calls = [0]

    def interrupting(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_step // 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(trainer, name, interrupting)
        first = run_tiny(tmp_path, data_path, *extra, run_name="cut")
    assert first.interrupted and first.step == at_step
    assert not list(first.run_dir.glob("*.tmp-*"))
    cfg, profile = resume_config(first.run_dir)
    if where == "checkpoint write":  # the handler finished the evaluation's files
        assert [r["step"] for r in read_history(first.run_dir / "history.jsonl")] == [2, 4][:at_step // 2]
    if where == "checkpoint write" and at_step == 4:
        second_losses = []  # nothing left to do: the run is complete
        with pytest.raises(trainer.ConfigError, match="already at step 4"):
            train(cfg, profile, first.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    else:
        second = train(cfg, profile, first.run_dir, progress=False, log=lambda msg: None, argv=["test"])
        assert second.step == 4 and second.heldout_loss == full.heldout_loss
        second_losses = second.losses
    assert first.losses + second_losses == full.losses
    cut, ref = read_history(first.run_dir / "history.jsonl"), read_history(full.run_dir / "history.jsonl")
    assert [r["step"] for r in cut] == [r["step"] for r in ref] == [2, 4]
    for a, b in zip(cut, ref):
        for key in ("train_loss", "aux_loss", "grad_norm", "heldout_loss", "lr", "chars_seen"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert load_checkpoint(first.run_dir / "best.pt")["step"] == load_checkpoint(full.run_dir / "best.pt")["step"]
    assert load_checkpoint(first.run_dir / "last.pt")["meter"]["since"] == 0


def test_native_dispatch_in_fp32_runs_under_torch_compile_like_eager():
    # torch's meta kernel for grouped_mm accepts bf16 only, so tracing the fp32 native path (CPU,
    # dispatch = "native", train.compile = true) failed although eager fp32 runs.
    torch.manual_seed(0)
    pool = PooledMLP(16, 24, 8, 2, dispatch="native")
    x = torch.randn(40, 16)
    eager, _ = pool(x)
    torch._dynamo.reset()
    compiled, _ = torch.compile(pool, backend="eager", fullgraph=False)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-4)
