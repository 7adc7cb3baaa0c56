"""minagi/checkpoint.py: atomic save, strict one-line load errors, RNG state round trip."""

import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from minagi import checkpoint
from minagi.checkpoint import (FORMAT_VERSION, CheckpointError, capture_rng_state, copy_checkpoint, load_checkpoint,
                               restore_rng_state, save_checkpoint)


def _payload(step=7):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "config": {"model": {"d_model": 64, "dispatch": "auto"}, "train": {"lr": 3e-3, "compile": False}},
        "vocab": "\n !abc", "step": step, "rng": capture_rng_state(), "best_heldout_loss": float("inf"),
        "run_name": "cpu_tiny-20250101-000000",
    }


def _one_line_naming(err: pytest.ExceptionInfo, path: Path) -> None:
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg, msg


def _no_temp_files(directory: Path) -> bool:
    return not any(".tmp-" in p.name for p in directory.iterdir())


def test_round_trip_restores_payload_and_adds_format_version(tmp_path):
    payload = _payload()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, payload)
    loaded = load_checkpoint(path)
    assert loaded["format_version"] == FORMAT_VERSION and "format_version" not in payload
    assert loaded["step"] == 7 and loaded["vocab"] == "\n !abc" and loaded["config"] == payload["config"]
    assert loaded["best_heldout_loss"] == float("inf") and loaded["run_name"] == payload["run_name"]
    for k, v in payload["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], payload["optimizer"]["state"][0]["exp_avg"])
    assert loaded["scheduler"]["last_epoch"] == payload["scheduler"]["last_epoch"]
    assert _no_temp_files(tmp_path)


def test_round_trip_state_loads_into_fresh_model_and_optimizer(tmp_path):
    payload = _payload()
    save_checkpoint(tmp_path / "c.pt", payload)
    loaded = load_checkpoint(tmp_path / "c.pt")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    model.load_state_dict(loaded["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(loaded["optimizer"])
    assert opt.state_dict()["param_groups"][0]["betas"] == (0.9, 0.95)


def test_save_creates_missing_parent_directory(tmp_path):
    path = tmp_path / "runs" / "x" / "latest.pt"
    save_checkpoint(path, {"step": 1})
    assert load_checkpoint(path)["step"] == 1


@pytest.mark.parametrize("fail_in", ["torch.save", "os.replace", "os.fsync"])
def test_interrupted_write_keeps_previous_checkpoint_and_no_temp_file(tmp_path, monkeypatch, fail_in):
    path = tmp_path / "latest.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(3)})

    if fail_in == "torch.save":
        def broken(obj, f, *args, **kwargs):
            f.write(b"PK\x03\x04 half a zip")          # partial bytes, then the crash
            raise KeyboardInterrupt

        monkeypatch.setattr(checkpoint.torch, "save", broken)
        expected = KeyboardInterrupt
    else:
        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(checkpoint.os, fail_in.split(".")[1], broken)
        expected = OSError

    with pytest.raises(expected):
        save_checkpoint(path, {"step": 2, "w": torch.zeros(3)})
    monkeypatch.undo()
    loaded = load_checkpoint(path)
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.ones(3))
    assert _no_temp_files(tmp_path)


def test_missing_file_is_one_line_error_naming_it(tmp_path):
    path = tmp_path / "nothing.pt"
    with pytest.raises(CheckpointError, match="no such checkpoint") as err:
        load_checkpoint(path)
    _one_line_naming(err, path)


def test_truncated_file_is_one_line_error_naming_it(tmp_path):
    path = tmp_path / "cut.pt"
    save_checkpoint(path, _payload())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"not a torch checkpoint \(not a zip archive, or truncated before its "
                                              r"end; [\d,]+ bytes\)$") as err:
        load_checkpoint(path)
    _one_line_naming(err, path)
    path.write_bytes(b"")
    for mmap in (False, True):  # torch's own error advised re-saving with _use_new_zipfile_serialization
        with pytest.raises(CheckpointError, match=r"not a torch checkpoint \(an empty file; 0 bytes\)$") as err:
            load_checkpoint(path, mmap=mmap)
        _one_line_naming(err, path)


@pytest.mark.parametrize("kind", ["text", "random_bytes", "tensor", "dict_without_version", "numpy_pickle"])
def test_foreign_file_is_one_line_error_naming_it_without_torchs_advice(tmp_path, kind):
    path = tmp_path / f"{kind}.pt"
    if kind == "text":
        path.write_text("hello, I am not a checkpoint\n")
    elif kind == "random_bytes":
        path.write_bytes(random.Random(0).randbytes(4096))
    elif kind == "tensor":
        torch.save(torch.arange(5), path)
    elif kind == "dict_without_version":
        torch.save({"model": {}, "step": 3}, path)
    else:
        torch.save({"format_version": 1, "x": np.arange(3)}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    _one_line_naming(err, path)
    if kind in ("tensor", "dict_without_version", "numpy_pickle"):
        assert "not a minagi checkpoint" in str(err.value)
    if kind in ("text", "random_bytes"):
        assert "not a torch checkpoint (not a zip archive" in str(err.value)
    # torch's advice (load with weights_only=False, allowlist globals) is for files one trusts: not ours to give.
    assert not re.search(r"weights_only`? set to `?False|weights_only=False|safe_globals|trusted source",
                         str(err.value)), str(err.value)


def test_newer_format_version_is_one_line_error_naming_it(tmp_path):
    path = tmp_path / "future.pt"
    torch.save({"format_version": FORMAT_VERSION + 1, "step": 1}, path)
    with pytest.raises(CheckpointError, match=f"format_version {FORMAT_VERSION + 1} is newer") as err:
        load_checkpoint(path)
    _one_line_naming(err, path)


def test_save_refuses_payload_that_weights_only_load_would_refuse(tmp_path):
    path = tmp_path / "bad.pt"
    with pytest.raises(CheckpointError, match=r"\['rng'\]\['x'\].*numpy") as err:
        save_checkpoint(path, {"rng": {"x": np.float64(1.0)}})
    _one_line_naming(err, path)
    assert not path.exists() and _no_temp_files(tmp_path)


def _draw():
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(),
            torch.rand(4).tolist(), torch.randn(2).tolist())


def test_rng_state_round_trip_through_a_checkpoint_reproduces_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)          # leaves python's cached gauss_next set
    np.random.randn()           # leaves numpy's cached gaussian set
    save_checkpoint(tmp_path / "r.pt", {"rng": capture_rng_state()})
    expected = _draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    _draw()
    restore_rng_state(load_checkpoint(tmp_path / "r.pt")["rng"])
    assert _draw() == expected


def test_restore_rng_state_names_missing_parts():
    with pytest.raises(CheckpointError, match="'numpy'"):
        restore_rng_state({"python": capture_rng_state()["python"], "torch": torch.get_rng_state()})


def test_copy_checkpoint_is_atomic_and_survives_the_next_save_of_its_source(tmp_path):
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    save_checkpoint(last, {"step": 1, "w": torch.arange(4.0)})
    save_checkpoint(best, {"step": 0})
    copy_checkpoint(last, best)
    assert load_checkpoint(best)["step"] == 1
    save_checkpoint(last, {"step": 2, "w": torch.zeros(4)})  # replaces last.pt with a new file
    kept = load_checkpoint(best)
    assert kept["step"] == 1 and torch.equal(kept["w"], torch.arange(4.0))
    assert load_checkpoint(last)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]


def test_copy_checkpoint_falls_back_to_a_copy_without_hard_links(tmp_path, monkeypatch):
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    save_checkpoint(last, {"step": 5})

    def no_links(*args, **kwargs):
        raise OSError("hard links not supported")
    monkeypatch.setattr(os, "link", no_links)
    copy_checkpoint(last, best)
    assert load_checkpoint(best)["step"] == 5
    assert os.stat(best).st_ino != os.stat(last).st_ino


def test_copy_checkpoint_onto_its_existing_hard_link_leaves_no_temp_file(tmp_path):
    # rename(2) of one hard link over another of the same file "does nothing, and returns success":
    # the temp link would be left beside best.pt.
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    save_checkpoint(last, {"step": 1})
    copy_checkpoint(last, best)
    copy_checkpoint(last, best)
    assert load_checkpoint(best)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]


def test_a_format_1_run_resumes_with_the_losses_its_own_code_gave_and_writes(tmp_path, data_path):
    # tests/assets/format1_run: 3 steps by the code before the [pool] section (commit 12eb8bc).
    import json
    import shutil

    from minagi.loading import load_trained
    from minagi.sampling import generate
    from minagi.trainer import resume_config, train
    run_dir = tmp_path / "fmt1"
    shutil.copytree(Path(__file__).parent / "assets" / "format1_run", run_dir)
    expected = json.loads((run_dir / "expected_losses.json").read_text())
    assert load_checkpoint(run_dir / "last.pt")["format_version"] == 1  # the payload as stored...
    old = checkpoint.Checkpoint.load(run_dir / "last.pt")  # ... read as this code's
    assert old.config.pool.n_experts == 4 and old.corpus is None and old.meter.evals_since_best == 0
    assert "rows.0.mlp.experts.gate_up" in old.model and "rows.0.mlp.router.selection_bias" in old.model
    model, vocab, _ = load_trained(run_dir / "last.pt")
    assert len("".join(generate(model, vocab, "the ", 12, seed=1))) == 12
    # Its data path was another machine's: say where the same text is now.
    cfg, profile = resume_config(run_dir, ["train.steps=6", f"data.path={data_path}",
                                           f"data.cache_dir={tmp_path / 'cache'}"])
    resumed = train(cfg, profile, run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert resumed.start_step == 3 and resumed.step == 6
    assert resumed.losses == pytest.approx(expected["losses"][3:], abs=1e-6)
    assert resumed.heldout_loss == pytest.approx(expected["heldout"], abs=1e-6)


@pytest.mark.skipif(os.name != "posix", reason="mapped only on POSIX (Windows could not replace a mapped file)")
def test_a_model_to_write_with_maps_its_checkpoint_and_owns_its_weights(tmp_path, data_path, monkeypatch):
    # sample.py and evaluate.py load through load_trained: the optimizer's moments (twice the model)
    # are mapped, never read; the model's weights are its own copies, so the file may be replaced.
    from minagi.loading import load_trained
    from tiny import run_tiny
    run = run_tiny(tmp_path, data_path)
    maps = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: maps.append(k.get("mmap")) or real(*a, **k))
    model, _, ckpt = load_trained(run.run_dir / "last.pt")
    assert maps == [True]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (run.run_dir / "last.pt").unlink()
    for key, value in model.state_dict().items():
        assert value.data_ptr() != ckpt.model[key].data_ptr() and torch.equal(value, before[key])


@pytest.mark.parametrize("platform", ["win32", "linux"])
def test_a_file_held_open_elsewhere_is_replaced_once_it_is_let_go_on_windows(tmp_path, monkeypatch, platform):
    """Windows refuses os.replace over a file another process has open (a reader of best.pt): the write
    waits for it (a few retries), where POSIX never refuses and a PermissionError is a real one."""
    from minagi import atomic
    real, calls = os.replace, []

    def held_twice(src, dst):
        calls.append(dst)
        if len(calls) <= 2:
            raise PermissionError(13, "The process cannot access the file", str(dst))
        real(src, dst)
    monkeypatch.setattr(atomic.sys, "platform", platform)
    monkeypatch.setattr(atomic.os, "replace", held_twice)
    monkeypatch.setattr(atomic.time, "sleep", lambda s: None)
    target = tmp_path / "best.pt"
    target.write_text("old")
    if platform == "linux":
        with pytest.raises(PermissionError):
            atomic.atomic_write(target, lambda tmp: tmp.write_text("new"))
        assert target.read_text() == "old" and len(calls) == 1
    else:
        atomic.atomic_write(target, lambda tmp: tmp.write_text("new"))
        assert target.read_text() == "new" and len(calls) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["best.pt"]  # no temporary file left either way


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_an_atomic_write_leaves_the_permissions_a_plain_open_gives(tmp_path):
    """safetensors creates its files 0600: an exported model others on the machine could not read."""
    from minagi import atomic
    plain = tmp_path / "plain"
    plain.write_text("x")

    def private(tmp):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
    atomic.atomic_write(tmp_path / "model.safetensors", private)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def test_a_payload_without_a_schedule_goes_on_with_its_configs():
    """Format 1 saved no schedule: the run trained with its config's warmup and floor, so it goes on with them."""
    from minagi.schedule import Schedule
    payload = {**_payload(), "format_version": 1}
    payload["config"] = {**payload["config"], "train": {**payload["config"]["train"], "steps": 300,
                                                         "warmup_steps": 20, "min_lr_ratio": 0.1}}
    old = checkpoint.Checkpoint.from_payload(payload, "old.pt")
    assert old.schedule == Schedule(total=300, warmup=20, min_ratio=0.1)


@pytest.mark.parametrize("key", ["optimizer", "scheduler", "rng", "step", "run_name", "meter"])
def test_a_checkpoint_without_one_of_the_training_keys_is_refused_for_a_resume_naming_it(key):
    full = {**_payload(), "format_version": 1, "meter": checkpoint.Meter().to_dict()}  # _payload's config: format 1
    checkpoint.Checkpoint.from_payload(full, "last.pt").check_trains()
    without = checkpoint.Checkpoint.from_payload({k: v for k, v in full.items() if k != key}, "last.pt")
    with pytest.raises(CheckpointError, match=rf"^last\.pt: not a training checkpoint \(no {key}\)"):
        without.check_trains()
