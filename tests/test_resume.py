"""Resume: after Ctrl-C (also mid-update and mid-evaluation) the resumed run reproduces the uninterrupted
one, extending a run continues its schedule and random streams, and a resume refuses any change but the
keys that change no weight.

Every run here is a tiny CPU model (1 row, width 32, 4 experts, 4 x 16 characters a step) on a
generated text written into tmp_path, so the whole file takes seconds.
"""
import json
import math
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from minagi import runlog, start, trainer
from minagi.checkpoint import load_checkpoint
from minagi.config import ConfigError
from minagi.runlog import read_history
from minagi.trainer import lr_factor, resume_config, train
from tiny import interrupt_at, run_tiny, tiny_cfg


def test_resume_after_ctrl_c_reproduces_the_uninterrupted_losses_and_records(tmp_path, data_path, monkeypatch):
    extra = ("train.steps=8", "train.eval_every=2")
    full = run_tiny(tmp_path, data_path, *extra, run_name="full")

    with monkeypatch.context() as m:
        interrupt_at(m, 5)
        first = run_tiny(tmp_path, data_path, *extra, run_name="cut")
    assert first.interrupted and first.step == 5
    assert load_checkpoint(first.run_dir / "last.pt")["step"] == 5

    cfg, profile = resume_config(first.run_dir)
    assert profile == "tiny"
    second = train(cfg, profile, first.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert second.start_step == 5 and second.step == 8
    # Exactly: the same batches (indexed by step), the same state, the same order of operations.
    assert first.losses + second.losses == full.losses
    assert second.heldout_loss == full.heldout_loss
    # One history file, continued: the same records as the uninterrupted run's (wall time aside). The
    # record of step 6 straddles the resume after step 5: its losses and its routing counters (the
    # checkpoint carries both) cover steps 5 and 6 alike.
    cut, ref = read_history(first.run_dir / "history.jsonl"), read_history(full.run_dir / "history.jsonl")
    assert [r["step"] for r in cut] == [r["step"] for r in ref] == [2, 4, 6, 8]
    for a, b in zip(cut, ref):
        for key in ("train_loss", "aux_loss", "grad_norm", "heldout_loss", "lr", "chars_seen", "dropped_fraction"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (a["step"], key)
        assert a["sinks"] == b["sinks"], a["step"]  # counts, and ratios of counts: exact
        assert a["sinks"][0]["routed"] == 2 * 4 * 16 * 2  # 2 steps of 4 x 16 characters, top-2
    assert len(json.loads((first.run_dir / "run.json").read_text())["resumes"]) == 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_during_the_optimizer_update_saves_last_pt_at_that_step_and_resumes_exactly(tmp_path, data_path,
                                                                                         monkeypatch, sig):
    # The update takes milliseconds: a Ctrl-C in it waits for its end, then last.pt holds the new step
    # (it used to save nothing: "interrupted during the update of step 3; last.pt is unchanged"). SIGTERM
    # (kill, a scheduler's time limit) is a Ctrl-C: it used to end the process, the steps since the last
    # checkpoint lost.
    extra = ("train.eval_every=4",)
    full = run_tiny(tmp_path, data_path, *extra, run_name="full")
    real_step, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:  # the signal from inside step 3's update, handled before its first parameter moves
            os.kill(os.getpid(), sig)
        return real_step(self, *args, **kwargs)
    lines = []
    with monkeypatch.context() as m:
        m.setattr(torch.optim.AdamW, "step", step)  # before the optimizer is made: its scheduler wraps this
        cut = train(tiny_cfg(tmp_path, data_path, *extra, run_name="cut"), "tiny", progress=False, log=lines.append,
                    argv=["test"])
    assert cut.interrupted and cut.step == 3 and len(cut.losses) == 3
    assert lines[-1] == f"interrupted: saved {cut.run_dir / 'last.pt'} at step 3; continue with --resume {cut.run_dir}"
    assert load_checkpoint(cut.run_dir / "last.pt")["step"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handlers are back
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    rest = train(*resume_config(cut.run_dir), cut.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert cut.losses + rest.losses == full.losses and rest.heldout_loss == full.heldout_loss


def test_extending_a_finished_run_with_train_steps_equals_running_longer(tmp_path, data_path):
    # A flat schedule after warmup (min_lr_ratio=1): then the lr does not depend on train.steps and
    # "6 steps, extended to 10" must be the same run as "10 steps". (With a cosine the extension
    # follows the new, longer cosine from the resumed step on, so the curves differ by design.)
    flat = ("train.min_lr_ratio=1.0", "train.eval_every=2")
    full = run_tiny(tmp_path, data_path, *flat, "train.steps=10", run_name="full")
    short = run_tiny(tmp_path, data_path, *flat, "train.steps=6", run_name="short")
    cfg, profile = resume_config(short.run_dir, ["train.steps=10"])
    assert cfg.train.steps == 10
    longer = train(cfg, profile, short.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert longer.start_step == 6 and longer.step == 10
    assert short.losses + longer.losses == pytest.approx(full.losses, abs=1e-6)
    assert [r["step"] for r in read_history(short.run_dir / "history.jsonl")] == [2, 4, 6, 8, 10]
    assert json.loads((short.run_dir / "run.json").read_text())["config"]["train"]["steps"] == 10


def _record_lrs(monkeypatch) -> list[float]:
    """The learning rate of every training step from here on."""
    lrs, real = [], trainer.train_step

    def spy(*args, **kwargs):
        stats = real(*args, **kwargs)
        lrs.append(stats.lr)
        return stats
    monkeypatch.setattr(trainer, "train_step", spy)
    return lrs


def test_extending_a_run_continues_the_learning_rate_it_had_reached_without_a_jump(tmp_path, data_path,
                                                                                    monkeypatch):
    short = run_tiny(tmp_path, data_path, "train.eval_every=2")  # 6 steps: warmup 2, cosine to 0.1 x 3e-3
    reached = read_history(short.run_dir / "history.jsonl")[-1]["lr"]  # the lr of its last step
    assert reached == pytest.approx(3e-3 * lr_factor(5, 6, 2, 0.1))
    floor = 3e-3 * 0.1
    # From the last step's rate, a cosine down to the floor at the new end (Schedule's docstring).
    expected = [floor + (reached - floor) * 0.5 * (1 + math.cos(math.pi * (s - 5) / (10 - 5))) for s in range(6, 10)]

    lrs, notes = _record_lrs(monkeypatch), []
    cfg, profile = resume_config(short.run_dir, ["train.steps=10"])
    train(cfg, profile, short.run_dir, progress=False, log=notes.append, argv=["test"])
    assert lrs == pytest.approx(expected, rel=1e-9)
    assert reached > lrs[0] > lrs[-1] > floor  # on down from where it was: no jump (the plain cosine: 2.4x)
    assert [n for n in notes if n.startswith("schedule:")] == [
        f"schedule: train.steps 6 -> 10: the learning rate goes on from {reached:.3g} (step 6's) down a cosine to "
        f"{floor:.3g} at step 10, without a jump (a fresh warmup and cosine is a new run: --init from this run's "
        "checkpoint)"]

    # A Ctrl-C inside the extension, resumed: the checkpoint carries the bent schedule.
    again = run_tiny(tmp_path, data_path, "train.eval_every=2", run_name="again")
    lrs.clear()
    with monkeypatch.context() as m:
        interrupt_at(m, 8)
        train(*resume_config(again.run_dir, ["train.steps=10"]), again.run_dir, progress=False,
              log=lambda msg: None, argv=["test"])
    train(*resume_config(again.run_dir), again.run_dir, progress=False, log=notes.append, argv=["test"])
    assert lrs == pytest.approx(expected, rel=1e-9)


def test_a_resume_continues_the_random_streams_the_checkpoint_saved(tmp_path, data_path, monkeypatch):
    with monkeypatch.context() as m:
        interrupt_at(m, 3)
        cut = run_tiny(tmp_path, data_path)
    saved = load_checkpoint(cut.run_dir / "last.pt")["rng"]
    random.seed(99)  # another process, with a history of its own
    np.random.seed(99)
    torch.manual_seed(99)
    after_restore = {}
    real = start.restore_training

    def restoring(training, ckpt):
        note = real(training, ckpt)
        after_restore.update(trainer.capture_rng_state())
        return note
    monkeypatch.setattr(start, "restore_training", restoring)
    train(*resume_config(cut.run_dir), cut.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert after_restore["python"] == saved["python"] and after_restore["numpy"] == saved["numpy"]
    assert torch.equal(after_restore["torch"], saved["torch"])


def test_a_resume_parses_the_config_of_run_json_and_of_last_pt_once_each(tmp_path, data_path, monkeypatch):
    from minagi import checkpoint, resume
    done = run_tiny(tmp_path, data_path, "train.steps=2", "train.warmup_steps=1")
    parsed = []
    for module in (checkpoint, resume):  # the only modules that parse a config dict
        real = module.config_from_dict
        monkeypatch.setattr(module, "config_from_dict",
                            lambda d, source="<dict>", real=real: parsed.append(Path(source).name) or real(d, source))
    train(*resume_config(done.run_dir, ["train.steps=4"]), done.run_dir, progress=False, log=lambda m: None,
          argv=["test"])
    assert sorted(parsed) == ["last.pt", "run.json"]


def _with_run_json(run_dir: Path, copy: Path, **train_settings) -> Path:
    """A copy of a run folder whose run.json says other [train] settings (what resume_config reads)."""
    shutil.copytree(run_dir, copy)
    info = json.loads((copy / "run.json").read_text())
    info["config"]["train"].update(train_settings)
    (copy / "run.json").write_text(json.dumps(info))
    return copy


def test_resume_refuses_any_change_but_train_steps(tmp_path, data_path):
    done = run_tiny(tmp_path, data_path, "train.steps=2", "train.warmup_steps=1")
    with pytest.raises(ConfigError, match=r"--set model\.d_model: cannot be changed when resuming"):
        resume_config(done.run_dir, ["model.d_model=64"])
    with pytest.raises(ConfigError, match=r"unknown key 'train\.stepz'.*did you mean 'steps'"):
        resume_config(done.run_dir, ["train.stepz=5"])  # a misspelling, not a refused change
    with pytest.raises(ConfigError, match=r"^--set train\.steps: the run warms up over 50 steps \(train\.warmup_steps, "
                                          r"fixed when it began\), so it trains at least that far: --set "
                                          r"train\.steps=50 or more$"):
        resume_config(_with_run_json(done.run_dir, tmp_path / "long", steps=60, warmup_steps=50), ["train.steps=3"])
    with pytest.raises(ConfigError, match=r"--set train\.warmup_steps"):  # not said as a train.steps problem
        resume_config(tmp_path / "long", ["train.warmup_steps=99999"])
    with pytest.raises(ConfigError, match="already at step 2"):
        train(resume_config(done.run_dir)[0], "tiny", done.run_dir, progress=False, log=lambda m: None)
    # A library caller passing a different config is stopped by last.pt itself.
    cfg = tiny_cfg(tmp_path, data_path, "train.steps=4", "train.lr=1e-2", "train.warmup_steps=1")
    with pytest.raises(ConfigError, match=r"train\.lr = 0\.01 differs from the resumed run's 0\.003"):
        train(cfg, "tiny", done.run_dir, progress=False, log=lambda m: None)


def test_a_resume_from_no_folder_a_checkpoint_file_or_a_damaged_run_json_is_one_line_naming_it(tmp_path, data_path):
    done = run_tiny(tmp_path, data_path, "train.steps=2", "train.warmup_steps=1")
    with pytest.raises(ConfigError, match=r"^--resume \S*nope: no such folder$"):
        resume_config(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"^--resume \S*last\.pt: a file; --resume takes its run folder \("):
        resume_config(done.run_dir / "last.pt")
    damaged = tmp_path / "damaged"
    shutil.copytree(done.run_dir, damaged)
    (damaged / "run.json").write_text("{bad")
    with pytest.raises(ConfigError, match=r"damaged/run\.json: not a run record \(Expecting property name"):
        resume_config(damaged)
    (damaged / "run.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"damaged/run\.json: not a run record \(no \"config\" table\)$"):
        resume_config(damaged)


def test_a_fresh_run_refuses_to_overwrite_an_existing_run_folder(tmp_path, data_path):
    run_tiny(tmp_path, data_path, "train.steps=2", "train.warmup_steps=1")
    with pytest.raises(ConfigError, match="already holds a run; resume it with --resume"):
        run_tiny(tmp_path, data_path, "train.steps=2", "train.warmup_steps=1")


@pytest.mark.parametrize("where", ["evaluation", "checkpoint write"])
@pytest.mark.parametrize("at_step", [2, 4])
def test_ctrl_c_during_an_evaluation_loses_neither_its_record_nor_best_pt(tmp_path, data_path, monkeypatch,
                                                                          where, at_step):
    # Ctrl-C while step 2's (or the last step's) evaluation runs or writes its files: the resumed
    # run must end with the uninterrupted run's history and best.pt, not skip that evaluation.
    extra = ("train.steps=4", "train.eval_every=2")
    full = run_tiny(tmp_path, data_path, *extra, run_name="full")
    module, name = (trainer, "evaluate") if where == "evaluation" else (runlog, "save_checkpoint")
    real = getattr(module, name)
    calls = [0]

    def interrupting(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_step // 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(module, name, interrupting)
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
