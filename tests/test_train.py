"""The training loop, its run folder, failure handling and the train.py entry point (resume:
tests/test_resume.py).

Every run here is a tiny CPU model (1 row, width 32, 4 experts, 4 x 16 characters a step) on a
generated text written into tmp_path, so the whole file takes seconds.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi import train as train_py
from minagi import runlog, trainer
from minagi import step as step_module
from minagi.checkpoint import load_checkpoint
from minagi.config import load_config
from minagi.model import CharLM
from minagi.runlog import HISTORY_FIELDS, read_history
from minagi.trainer import NonFiniteLossError, lr_factor
from tiny import TINY, interrupt_at, run_tiny, tiny_argv, tiny_cfg, tiny_text, write_tiny_text

REPO = Path(__file__).resolve().parent.parent

# The golden tiny run (torchtitan's stored loss curves, nanoGPT's stated val loss): per-step train
# cross-entropy of TINY with steps=6, and its final held-out loss. A change to the model, the
# initialisation, the data pipeline, the optimizer or the schedule moves these. When the change is
# intended, regenerate with
#     python -m pytest tests/test_train.py -k golden -s
# (the test prints the new values on failure) and paste them here, saying why in the commit.
GOLDEN_LOSSES = [3.6949, 3.628, 3.5486, 3.46, 3.4171, 3.3425]
GOLDEN_HELDOUT = 3.3604


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return run_tiny(tmp_path_factory.mktemp("golden"), None)


# ------------------------------------------------------------------------------ the golden run

def test_golden_tiny_cpu_run_losses_are_pinned(golden):
    print("GOLDEN_LOSSES =", [round(x, 4) for x in golden.losses])
    print("GOLDEN_HELDOUT =", round(golden.heldout_loss, 4))
    assert golden.step == 6 and len(golden.losses) == 6
    assert golden.losses == pytest.approx(GOLDEN_LOSSES, abs=1e-4)
    assert golden.heldout_loss == pytest.approx(GOLDEN_HELDOUT, abs=1e-4)
    assert golden.heldout_bpc == pytest.approx(golden.heldout_loss / math.log(2))


def test_run_folder_holds_run_json_history_and_both_checkpoints(golden):
    names = {p.name for p in golden.run_dir.iterdir()}
    assert {"run.json", "history.jsonl", "last.pt", "best.pt"} <= names
    assert not [n for n in names if ".tmp-" in n]
    info = json.loads((golden.run_dir / "run.json").read_text())
    assert info["profile"] == "tiny" and info["command"] == ["test"]
    assert info["config"]["train"]["steps"] == 6
    assert info["torch"] == torch.__version__ and info["python"] and info["numpy"]
    assert info["device"] and info["start_time"]
    assert "git_commit" in info  # None outside a checkout / before the first commit
    last = load_checkpoint(golden.run_dir / "last.pt")
    assert last["step"] == 6 and last["run_name"] == "run"
    assert last["best_heldout_loss"] == pytest.approx(golden.best_heldout_loss)
    assert not any(k.startswith("_orig_mod.") for k in last["model"])


def test_history_lines_carry_every_history_field(golden):
    lines = (golden.run_dir / "history.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [3, 6]
    for r in records:
        assert tuple(r) == HISTORY_FIELDS
        assert r["chars_seen"] == r["step"] * 4 * 16
        assert r["heldout_bpc"] == pytest.approx(r["heldout_loss"] / math.log(2))
        assert r["chars_per_s"] > 0 and r["wall_s"] > 0 and r["lr"] > 0
        # CPU: no allocator figures, but the process resident memory.
        assert r["mem_allocated"] is None and r["ooms"] is None and r["rss_bytes"] > 0
        assert len(r["sinks"]) == 1 and r["sinks"][0]["row"] == 0
        assert r["sinks"][0]["routed"] == 3 * 4 * 16 * 2  # 3 training steps of 64 chars, top-2
        assert r["dropped_fraction"] == 0.0
    assert records[0]["train_loss"] == pytest.approx(sum(golden.losses[:3]) / 3)
    assert records[1]["train_loss"] == pytest.approx(sum(golden.losses[3:]) / 3)


def test_a_records_dropped_fraction_and_max_vio_are_the_means_of_its_rows(tmp_path):
    done = run_tiny(tmp_path, None, "model.n_rows=2", "pool.capacity_factor=0.5", "train.steps=3")
    (record,) = read_history(done.run_dir / "history.jsonl")
    rows = record["sinks"]
    assert len(rows) == 2 and all(row["dropped_fraction"] > 0 for row in rows)
    assert record["dropped_fraction"] == pytest.approx(sum(row["dropped_fraction"] for row in rows) / 2)
    assert record["max_vio"] == pytest.approx(sum(row["max_vio"] for row in rows) / 2)


def test_each_steps_batch_is_made_once_while_the_step_before_runs_before_its_loss_is_read(tmp_path, monkeypatch):
    # The GPU would otherwise wait for the host to make a batch after each step (docs/benchmarks.md §10).
    events, make, read = [], trainer.batch_on, step_module.reduce_over_ranks

    def making(device, ids, batch_size, context, seed, step, *args):
        events.append(("batch", step))
        return make(device, ids, batch_size, context, seed, step, *args)

    def reading(*args):
        events.append(("read",))
        return read(*args)
    monkeypatch.setattr(trainer, "batch_on", making)
    monkeypatch.setattr(step_module, "reduce_over_ranks", reading)
    result = run_tiny(tmp_path, None)
    assert events[:5] == [("batch", 0), ("batch", 1), ("read",), ("batch", 2), ("read",)]
    assert [e for e in events if e[0] == "batch"] == [("batch", s) for s in range(7)]  # the last, ahead, unused
    assert result.losses == pytest.approx(GOLDEN_LOSSES, abs=1e-4)


def test_lr_warms_up_linearly_then_follows_cosine_to_its_floor():
    factors = [lr_factor(s, total=10, warmup=2, min_ratio=0.1) for s in range(12)]
    assert factors[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert all(a >= b for a, b in zip(factors[1:], factors[2:]))
    assert factors[6] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert factors[10] == factors[11] == pytest.approx(0.1)
    # No warmup (train.warmup_steps = 0, or a profile's warmup fitted to a few steps): the peak from the
    # first step, and the step "before" the first (asked at a run's start) neither divides by 0 nor
    # climbs above the peak.
    assert [lr_factor(s, total=4, warmup=0, min_ratio=0.1) for s in (-1, 0)] == [1.0, 1.0]
    assert lr_factor(-1, total=10, warmup=2, min_ratio=0.1) == 0.0


def test_a_run_extended_within_its_warmup_follows_the_longer_run_and_after_it_bends():
    from minagi.schedule import Schedule
    plain = Schedule(total=6, warmup=2, min_ratio=0.1)
    for done in (0, 1, 2):  # the cosine not begun (step 2's factor is still the peak): no bend
        assert [plain.extended(done, 10)(s) for s in range(12)] == [lr_factor(s, 10, 2, 0.1) for s in range(12)], done
    bent = plain.extended(3, 10)  # from the factor step 3 was trained at, down to the floor at 10
    assert bent(2) == lr_factor(2, 6, 2, 0.1) and bent(3) < 1.0 and bent(10) == pytest.approx(0.1)


def test_a_run_without_warmup_trains(tmp_path, data_path):
    # What `--set train.steps=2` once made of a profile's warmup (a tenth of the steps: 0, now at least 1);
    # it once divided by zero at the start of the run. train.warmup_steps = 0 of one's own is allowed.
    run = run_tiny(tmp_path, data_path, "train.steps=2", "train.eval_every=2", "train.warmup_steps=0")
    assert run.step == 2 and math.isfinite(run.heldout_loss)


def test_a_run_split_into_micro_batches_evaluates_the_same_held_out_sample(tmp_path):
    """batch 4 x 1 and batch 2 x 2 (accumulated) train the same model; their held-out losses agree too."""
    whole = run_tiny(tmp_path, None, run_name="whole")  # TINY: batch 4
    split = run_tiny(tmp_path, None, "train.batch_size=2", "train.accum_steps=2", run_name="split")
    assert split.losses == pytest.approx(whole.losses, rel=1e-5)
    assert split.heldout_loss == pytest.approx(whole.heldout_loss, rel=1e-5)


def test_the_held_out_loss_is_dropless_so_the_split_of_its_batches_does_not_change_it():
    """With a capacity, a held-out character's loss would depend on the micro-batch it shares: held
    out at 2 x 2 and 4 x 1 would differ, and differ from what the model writes and scores (dropless)."""
    from minagi.pool import PooledMLP
    torch.manual_seed(0)
    cfg = load_config(None, [*TINY, "pool.capacity_factor=0.5"])
    model = CharLM(cfg.model, cfg.pool, 11, "grouped")
    x, y = torch.randint(0, 11, (2, 4, 16)), torch.randint(0, 11, (2, 4, 16))
    whole = trainer.evaluate(model, list(zip(x, y)), torch.device("cpu"), 1)
    halves = trainer.evaluate(model, [(a, b) for xs, ys in zip(x, y) for a, b in zip(xs.chunk(2), ys.chunk(2))],
                              torch.device("cpu"), 1)
    assert isinstance(model.rows[0].mlp, PooledMLP) and model.rows[0].mlp.capacity(64) > 0
    with torch.no_grad():
        dropless = sum(model(a, b, dropless=True).loss.item() for a, b in zip(x, y)) / 2
    assert whole == pytest.approx(halves, rel=1e-6) and whole == pytest.approx(dropless, rel=1e-6)


# ------------------------------------------------------------------------------ failures

def test_interrupted_checkpoint_write_leaves_the_previous_checkpoint_loadable(tmp_path, data_path,
                                                                              monkeypatch):
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        if obj["step"] == 4:  # half a file, then the disk fills up
            f.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(runlog.RunFolderError, match=r"last\.pt: cannot write: no space left on device; .*"
                                                    r"last\.pt keeps the last good checkpoint \(step 2\)$"):
        run_tiny(tmp_path, data_path, "train.steps=6", "train.eval_every=2")
    run_dir = tmp_path / "runs" / "run"
    last = load_checkpoint(run_dir / "last.pt")
    assert last["step"] == 2
    cfg = tiny_cfg(tmp_path, data_path)
    model = CharLM(cfg.model, cfg.pool, len(last["vocab"]))
    model.load_state_dict(last["model"])
    assert [r["step"] for r in read_history(run_dir / "history.jsonl")] == [2]
    assert not list(run_dir.glob("*.tmp-*"))


def _spoil_training_call(monkeypatch, n: int, spoil=lambda model, loss: loss * float("nan")) -> None:
    """The n-th training forward's loss replaced by spoil(model, loss) (default: NaN)."""
    real = CharLM.forward
    calls = [0]

    def forward(self, idx, targets=None, dropless=False):
        out = real(self, idx, targets, dropless)
        if self.training:
            calls[0] += 1
            if calls[0] == n:
                return out._replace(loss=spoil(self, out.loss))
        return out
    monkeypatch.setattr(CharLM, "forward", forward)


def _nan_at_training_call(monkeypatch, n: int) -> None:
    _spoil_training_call(monkeypatch, n)


def test_nan_loss_stops_at_its_step_and_leaves_the_checkpoints_of_the_step_before(tmp_path, data_path,
                                                                                  monkeypatch):
    _nan_at_training_call(monkeypatch, 3)
    with pytest.raises(NonFiniteLossError, match=r"^step 3: loss is not finite") as err:
        run_tiny(tmp_path, data_path, "train.eval_every=1")
    assert err.value.step == 3 and "\n" not in str(err.value)
    run_dir = tmp_path / "runs" / "run"
    assert load_checkpoint(run_dir / "last.pt")["step"] == 2
    assert load_checkpoint(run_dir / "best.pt")["step"] <= 2
    records = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(tuple(r) == HISTORY_FIELDS and math.isfinite(r["heldout_loss"]) for r in records)


def test_a_held_out_loss_that_is_not_finite_stops_and_keeps_the_last_good_checkpoint(tmp_path, data_path,
                                                                                       monkeypatch):
    from minagi import trainer
    real, calls = trainer.evaluate, [0]

    def evaluate(*args, **kwargs):
        calls[0] += 1
        return float("nan") if calls[0] == 2 else real(*args, **kwargs)
    monkeypatch.setattr(trainer, "evaluate", evaluate)
    with pytest.raises(NonFiniteLossError, match=r"^step 2: held-out loss is not finite \(nan\)") as err:
        run_tiny(tmp_path, data_path, "train.eval_every=1")
    assert err.value.step == 2 and "\n" not in str(err.value)
    run_dir = tmp_path / "runs" / "run"
    assert load_checkpoint(run_dir / "last.pt")["step"] == 1 == load_checkpoint(run_dir / "best.pt")["step"]
    assert [r["step"] for r in read_history(run_dir / "history.jsonl")] == [1]


def test_a_gradient_norm_that_is_not_finite_stops_before_updating_even_with_a_finite_loss(tmp_path, data_path,
                                                                                         monkeypatch):
    # sqrt'(0) is inf: a zero added to the loss, with a NaN gradient.
    _spoil_training_call(monkeypatch, 3, lambda model, loss: loss + torch.sqrt(next(model.parameters()).sum() * 0.0) * 0.0)
    with pytest.raises(NonFiniteLossError, match=r"^step 3: gradient norm is not finite \(loss 3\.\d+, aux "):
        run_tiny(tmp_path, data_path, "train.eval_every=1")
    last = load_checkpoint(tmp_path / "runs" / "run" / "last.pt")
    assert last["step"] == 2 and all(torch.isfinite(t).all() for t in last["model"].values())


# ------------------------------------------------------------------------------ train.py

def _tiny_profile(tmp_path) -> Path:
    lines = ["[model]"] + [s.split(".", 1)[1] for s in TINY if s.startswith("model.")]
    lines += ["[train]"] + [s.split(".", 1)[1].replace("=cpu", '="cpu"') for s in TINY if s.startswith("train.")]
    lines += [f'out_dir = "{(tmp_path / "runs").as_posix()}"', "[data]",
              f'cache_dir = "{(tmp_path / "cache").as_posix()}"']
    path = tmp_path / "tiny.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_train_py_end_to_end_writes_a_complete_run_folder(tmp_path, data_path):
    done = subprocess.run([sys.executable, "train.py", "--profile", str(_tiny_profile(tmp_path)),
                           "--data", str(data_path), "--run-name", "e2e"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "e2e"
    assert {"run.json", "history.jsonl", "last.pt", "best.pt"} <= {p.name for p in run_dir.iterdir()}
    assert f"run folder: {run_dir}" in done.stdout
    assert "bits/char" in done.stdout.splitlines()[-1]
    assert json.loads((run_dir / "run.json").read_text())["profile"] == "tiny"


def test_train_py_config_error_is_one_stderr_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "train.py", "--profile", str(_tiny_profile(tmp_path)),
                           "--set", "model.n_expert=3"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.n_expert" in lines[0], done.stderr


def test_h200_on_the_cpu_warns_in_one_line_that_its_compiled_step_recompiles(tmp_path, capsys):
    # The corpus is missing: the run stops at its first read, after what train.py says at start.
    argv = ["--profile", "h200", "--set", "train.device=cpu", "--data", str(tmp_path / "none.txt"),
            "--set", f"train.out_dir={tmp_path / 'runs'}"]
    assert train_py.main(argv) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith("warning: train.compile is on, but on the CPU") and "recompile" in warning
    assert warning.endswith("--set train.compile=false trains it eagerly from the start")
    assert error.startswith("error: data path")
    assert train_py.main([*argv, "--set", "train.compile=false"]) == 2
    assert "train.compile" not in capsys.readouterr().err


def test_the_compile_warning_is_for_pooled_models_on_the_cpu_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    h200, dense = load_config("h200"), load_config("h200_shakespeare_dense")
    assert train_py.compile_note(h200, cpu) and not train_py.compile_note(h200, cuda)
    assert not train_py.compile_note(dense, cpu)  # one SwiGLU a row: shapes that routing does not change
    assert not train_py.compile_note(load_config("cpu_tiny"), cpu)  # compile off


def test_minagi_swiglu_sets_pool_swiglu():
    assert train_py.environment_overrides({"MINAGI_SWIGLU": "eager"}) == ["pool.swiglu=eager"]
    assert train_py.environment_overrides({"MINAGI_SWIGLU": "jiterator"}) == ["pool.swiglu=jiterator"]
    assert train_py.environment_overrides({}) == []


@pytest.mark.parametrize("value, expected", [
    *[(v, ["experts.replay_pin=on"]) for v in ("1", "true", "on", "yes", "ON", " Yes ")],
    *[(v, ["experts.replay_pin=off"]) for v in ("0", "false", "off", "no", "No")],
    *[(v, []) for v in ("", "auto", "maybe", "2")],
])
def test_minagi_replay_pin_overrides_the_profiles_setting(value, expected):
    assert train_py.environment_overrides({"MINAGI_REPLAY_PIN": value}) == expected
    cfg = load_config(None, ["experts.frozen=true", "experts.replay_pin=auto", *expected])
    assert cfg.experts.replay_pin == (expected[0].split("=")[1] if expected else "auto")


def test_minagi_swiglu_bad_value_is_a_one_line_error():
    done = subprocess.run([sys.executable, "train.py", "--set", "train.steps=1"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "MINAGI_SWIGLU": "fast"}, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: environment variable MINAGI_SWIGLU: must be 'auto', 'jiterator' or 'eager'; got 'fast'"


def test_train_py_exit_codes_for_resume_misuse_nan_and_ctrl_c(tmp_path, data_path, monkeypatch, capsys):
    base = ["--profile", str(_tiny_profile(tmp_path)), "--data", str(data_path)]
    with monkeypatch.context() as m:
        interrupt_at(m, 2)
        assert train_py.main([*base, "--run-name", "cut"]) == 130
    run_dir = tmp_path / "runs" / "cut"
    assert load_checkpoint(run_dir / "last.pt")["step"] == 2
    capsys.readouterr()

    assert train_py.main(["--resume", str(run_dir), "--set", "train.lr=0.1"]) == 2
    other = tmp_path / "other.txt"
    other.write_text(data_path.read_text() + "one more line\n")
    assert train_py.main(["--resume", str(run_dir), "--data", str(other)]) == 2
    assert train_py.main(["--resume", str(run_dir), "--profile", "cpu_tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "train.lr" in err[0] and "--profile" in err[2]
    assert err[1].startswith(f"error: data.path {other}: its content") and "differs from the corpus" in err[1]

    with monkeypatch.context() as m:
        _nan_at_training_call(m, 2)  # the second step after resuming: step 4
        assert train_py.main(["--resume", str(run_dir)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: step 4: loss is not finite")
    assert load_checkpoint(run_dir / "last.pt")["step"] == 3  # eval_every=3: the record at step 3


def test_a_second_ctrl_c_while_the_first_is_saving_says_what_last_pt_still_holds(tmp_path, data_path,
                                                                                  monkeypatch, capsys):
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if obj["step"] == 3:  # the first Ctrl-C's checkpoint, half written, then the second Ctrl-C
            f.write(b"PK\x03\x04 half a checkpoint")
            raise KeyboardInterrupt
        return real_save(obj, f, *args, **kwargs)
    with monkeypatch.context() as m:
        interrupt_at(m, 3)
        m.setattr(torch, "save", save)
        assert train_py.main(tiny_argv(tmp_path, data_path, "train.eval_every=2", run_name="twice")) == 130
    out, err = capsys.readouterr()
    run_dir = tmp_path / "runs" / "twice"
    assert "before training began" not in out + err and err == ""
    assert out.splitlines()[-1] == (f"interrupted again while saving step 3; {run_dir / 'last.pt'} keeps the last "
                                    "good checkpoint (step 2)")
    assert load_checkpoint(run_dir / "last.pt")["step"] == 2 and not list(run_dir.glob("*.tmp-*"))


def test_a_nan_before_the_first_checkpoint_says_that_none_was_written(tmp_path, data_path, monkeypatch, capsys):
    with monkeypatch.context() as m:
        _nan_at_training_call(m, 2)
        assert train_py.main(tiny_argv(tmp_path, data_path, run_name="early")) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: step 2: loss is not finite"), err
    assert err[0].endswith("; stopped before updating; no checkpoint was written")
    assert not (tmp_path / "runs" / "early" / "last.pt").exists()


def test_ctrl_c_while_train_py_starts_up_is_one_line_and_exit_130(tmp_path):
    fake = tmp_path / "site" / "torch"  # a torch whose import is cut short, as a Ctrl-C while it loads would
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise KeyboardInterrupt\n")
    done = subprocess.run([sys.executable, "train.py"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(fake.parent)})
    assert (done.returncode, done.stdout) == (130, "")
    assert done.stderr == "interrupted before training began; no checkpoint was written\n"


def test_a_resume_finds_its_corpus_from_any_directory_and_refuses_one_whose_content_changed(tmp_path, monkeypatch,
                                                                                         capsys):
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    elsewhere.mkdir()
    text = write_tiny_text(start if start.mkdir() is None else start)
    monkeypatch.chdir(start)
    assert train_py.main(tiny_argv(tmp_path, Path(text.name), run_name="moved")) == 0  # --data text.txt
    run_dir = tmp_path / "runs" / "moved"
    assert json.loads((run_dir / "run.json").read_text())["config"]["data"]["path"] == str(text)

    monkeypatch.chdir(elsewhere)
    assert train_py.main(["--resume", str(run_dir), "--set", "train.steps=8"]) == 0
    text.write_text(tiny_text().replace("fox", "cat"))  # the same path and characters, another text
    capsys.readouterr()
    assert train_py.main(["--resume", str(run_dir), "--set", "train.steps=10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: data.path {text}: its content (key "), err
    assert f"differs from the corpus of the run in {run_dir} ({text} when it trained: key " in err[0]
    # The run's text in another place: --data says where, and its content is checked.
    copy = elsewhere / "copy.txt"
    copy.write_text(tiny_text())
    assert train_py.main(["--resume", str(run_dir), "--data", "copy.txt", "--set", "train.steps=10"]) == 0
    assert json.loads((run_dir / "run.json").read_text())["config"]["data"]["path"] == str(copy)
    assert [r["step"] for r in read_history(run_dir / "history.jsonl")] == [3, 6, 8, 9, 10]
