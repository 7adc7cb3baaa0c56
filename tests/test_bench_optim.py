"""tools/bench_optim.py times the optimizers side by side, each on its own copy of a profile's weights."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_optim  # noqa: E402


def test_each_optimizer_steps_its_own_copy_from_the_same_gradients():
    groups, _ = bench_optim.param_groups("cpu_tiny", [], torch.device("cpu"))
    a, b = (bench_optim.copies(groups, torch.Generator().manual_seed(0)) for _ in range(2))
    assert [g["weight_decay"] for g in a] == [g["weight_decay"] for g in groups]
    for p, q, r in zip(a[0]["params"], b[0]["params"], groups[0]["params"]):
        assert p is not r and p.data_ptr() != q.data_ptr() and torch.equal(p.grad, q.grad) and torch.equal(p, r)


def test_a_cpu_smoke_run_prints_both_forms_that_run_there(capsys):
    assert bench_optim.main(["--device", "cpu", "--profiles", "cpu_tiny", "--rounds", "2", "--block", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch AdamW, fp32 states" in out and "AdamWBF16, foreach" in out and "Triton kernel" not in out


def test_a_bad_setting_is_one_line_and_exit_2(capsys):
    assert bench_optim.main(["--device", "cpu", "--profiles", "cpu_tiny", "--set", "train.lr=fast"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_optim.py: ") and "train.lr" in err and err.count("\n") == 1
