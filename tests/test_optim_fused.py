"""AdamWBF16's fused update (minagi/adamw_triton.py) against the arithmetic it replaces: the weight as the
foreach form moves it, each moment on one of the two bf16 neighbours of its fp32 value, rounded without
bias, reproducibly, and inf and NaN kept. The checks run on CUDA (marked gpu) and in Triton's CPU
interpreter (a fresh process: Triton reads TRITON_INTERPRET at import; CI has no Triton and skips them)."""
import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from minagi import optim
from minagi.optim import AdamWBF16

HAS_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _reference(p, g, m, v, *, lr, betas, eps, weight_decay, step):
    """The foreach form's fp32 arithmetic (minagi/optim.py `_update`), before the moments' rounding."""
    beta1, beta2 = betas
    m, v, p = m.float().lerp(g.float(), 1 - beta1), v.float() * beta2, p * (1 - lr * weight_decay)
    v = v.addcmul(g.float(), g.float(), value=1 - beta2)
    denom = v.sqrt() / (1 - beta2 ** step) ** 0.5 + eps
    return p.addcdiv(m, denom, value=-lr / (1 - beta1 ** step)), m, v


def _neighbours(x):
    """The bf16 values just below and above fp32 x (equal where x is a bf16 value), as fp32."""
    down = (x.view(torch.int32) & -65536).view(torch.float32)
    up = (x.view(torch.int32) & -65536).add(65536).view(torch.float32)
    exact = (x.view(torch.int32) & 0xFFFF) == 0
    lo, hi = torch.minimum(down, torch.where(exact, down, up)), torch.maximum(down, torch.where(exact, down, up))
    return lo, hi


def check_kernel(device: str) -> None:
    from minagi import adamw_triton
    gen = torch.Generator().manual_seed(0)
    n = 3 * adamw_triton.BLOCK + 17  # a partial last block
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen)
    m = (0.1 * torch.randn(n, generator=gen)).bfloat16()
    v = torch.rand(n, generator=gen).mul(0.01).bfloat16()
    step = 7
    want_p, want_m, want_v = _reference(p, g, m, v, step=step, **SETTINGS)
    got = [t.clone().to(device) for t in (p, g, m, v)]
    adamw_triton.update_(*got, lr=SETTINGS["lr"], beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step, seed=5)
    got_p, _, got_m, got_v = (t.cpu() for t in got)
    torch.testing.assert_close(got_p, want_p, rtol=1e-6, atol=1e-7)
    for name, got_x, want_x in (("exp_avg", got_m, want_m), ("exp_avg_sq", got_v, want_v)):
        lo, hi = _neighbours(want_x)
        slack = 1e-6 * want_x.abs()  # the fp32 value itself may differ by an ulp (fused multiply-adds)
        inside = (got_x.float() >= lo - slack) & (got_x.float() <= hi + slack)
        assert inside.all(), f"{name}: {int((~inside).sum())} of {n} off their bf16 neighbours"
        assert (got_x.float() != lo).any() and (got_x.float() != hi).any(), f"{name}: rounded one way only"

    # eps where it weighs (added to the bias-corrected root, not under it, nor before the correction).
    for eps in (1e-2, 0.3):
        want_p, _, _ = _reference(p, g, m, v, step=step, **{**SETTINGS, "eps": eps})
        got = [t.clone().to(device) for t in (p, g, m, v)]
        adamw_triton.update_(*got, lr=SETTINGS["lr"], beta1=0.9, beta2=0.95, eps=eps, weight_decay=0.1, step=step,
                             seed=5)
        torch.testing.assert_close(got[0].cpu(), want_p, rtol=1e-6, atol=1e-7)

    # Unbiased: with beta1 = beta2 = 0 the moments are g and g^2, here between two bf16 values.
    value = 1.0 + 2 ** -10
    big = 200_000
    ones = [torch.zeros(big, device=device), torch.full((big,), value, device=device),
            torch.zeros(big, dtype=torch.bfloat16, device=device), torch.zeros(big, dtype=torch.bfloat16, device=device)]
    adamw_triton.update_(*ones, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, step=1, seed=11)
    rounded = ones[2].float().cpu()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert rounded.mean().item() == pytest.approx(value, rel=2e-5)
    assert ones[3].float().cpu().mean().item() == pytest.approx(value ** 2, rel=2e-5)
    # The two moments draw apart: m (fraction 1/8 above its lower neighbour) rounds up 1 in 8, v (1/4) 1 in 4;
    # from one draw v would round up wherever m did (1 in 8 both), from two 1 in 32.
    up_m, up_v = ones[2].float().cpu() > value, ones[3].float().cpu() > value ** 2
    assert (up_m & up_v).float().mean().item() == pytest.approx(1 / 32, abs=0.005)

    # inf and NaN stay what they are; the same seed draws the same bits, another seed others.
    # 0x7FFFFFFF is the NaN NVIDIA's units produce: rounding up must not carry it into the sign bit.
    nvidia_nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    special = torch.cat([torch.tensor([float("inf"), -float("inf"), float("nan"), -2.5, 0.0]), nvidia_nan]).to(device)
    moments = [torch.zeros(6, dtype=torch.bfloat16, device=device) for _ in range(2)]
    adamw_triton.update_(torch.zeros(6, device=device), special, *moments, lr=1e-3, beta1=0.0, beta2=0.5, eps=1e-8,
                         weight_decay=0.0, step=1, seed=3)
    # m as torch's lerp gives it (inf - inf * 0 is NaN there too), v = 0.5 g^2: values bf16 holds exactly.
    want_m, want_v = torch.zeros(6).lerp(special.cpu(), 1.0), 0.5 * special.cpu() ** 2
    torch.testing.assert_close(moments[0].float().cpu(), want_m, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(moments[1].float().cpu(), want_v, equal_nan=True, rtol=0, atol=0)
    assert moments[1][0] == float("inf") and moments[1][2].isnan() and moments[0][5].isnan() and moments[1][5].isnan()

    def drawn(seed):
        t = [torch.zeros(big, device=device), torch.full((big,), value, device=device),
             torch.zeros(big, dtype=torch.bfloat16, device=device), torch.zeros(big, dtype=torch.bfloat16, device=device)]
        adamw_triton.update_(*t, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, step=1, seed=seed)
        return t[2]
    assert torch.equal(drawn(11), ones[2]) and not torch.equal(drawn(12), ones[2])

    # The probe passes this kernel, and refuses one that does not move the weights or rounds wrongly.
    assert adamw_triton._probe(torch.device(device)) == ""
    update = adamw_triton.update_many_
    try:
        adamw_triton.update_many_ = lambda *a, **k: None
        assert "moved the weights" in adamw_triton._probe(torch.device(device))

        def off_by_a_step(tensors, **k):
            update(tensors, **k)
            tensors[-1][3].mul_(1.03)
        adamw_triton.update_many_ = off_by_a_step
        assert "rounded the moments" in adamw_triton._probe(torch.device(device))
    finally:
        adamw_triton.update_many_ = update


def check_many(device: str) -> None:
    """One launch over many tensors (sizes whole and part blocks, their own steps, fp32 and bf16 grads, an
    empty one) gives each tensor bit for bit what it gets updated alone."""
    from minagi import adamw_triton
    gen = torch.Generator().manual_seed(1)
    sizes, steps, seeds = [2 * adamw_triton.BLOCK, 7, 0, adamw_triton.BLOCK + 1, 300], [3, 9, 1, 4, 2], [5, 6, 7, 8, 2**62]
    grads = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]

    def start():
        gen.manual_seed(1)
        return [tuple(t.to(device) for t in (torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(dtype),
                                                (0.1 * torch.randn(n, generator=gen)).bfloat16(),
                                                (0.01 * torch.rand(n, generator=gen)).bfloat16()))
                for n, dtype in zip(sizes, grads)]
    together, alone = start(), start()
    settings = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    adamw_triton.update_many_(together, steps=steps, seeds=seeds, **settings)
    for t, step, seed in zip(alone, steps, seeds):
        adamw_triton.update_(*t, step=step, seed=seed, **settings)
    for i, (a, b) in enumerate(zip(together, alone)):
        for name, x, y in zip(("weight", "grad", "exp_avg", "exp_avg_sq"), a, b):
            assert torch.equal(x.cpu(), y.cpu()), f"tensor {i}'s {name}"
        assert sizes[i] == 0 or not torch.equal(a[0].cpu(), start()[i][0].cpu()), f"tensor {i} not moved"


def check_optimizer(device: str) -> None:
    """The fused optimizer follows torch's AdamW as the foreach one does; what the kernel cannot take (a
    weight stored transposed) goes through the foreach form in the same step."""
    torch.manual_seed(0)
    shapes = [(40, 30), (7,), (30, 40)]
    start = [torch.randn(*s) for s in shapes]
    start[2] = start[2].t()  # non-contiguous: left to the foreach form
    ref = [torch.nn.Parameter(w.clone().to(device)) for w in start]
    fused = [torch.nn.Parameter(w.clone().to(device)) for w in start]
    assert not fused[2].is_contiguous()
    reference, lean = torch.optim.AdamW(ref, **SETTINGS), AdamWBF16(fused, **SETTINGS, fused=True)
    from minagi import adamw_triton
    calls, update = [], adamw_triton.update_many_
    adamw_triton.update_many_ = lambda ts, **k: (calls.append([t[0].shape for t in ts]), update(ts, **k))[1]
    try:
        for _ in range(50):
            _one_step(ref, fused, reference, lean, device)
    finally:
        adamw_triton.update_many_ = update
    assert calls == [[(40, 30), (7,)]] * 50  # one launch took the contiguous two, every step
    for a, b, w in zip(ref, fused, start):
        moved = (a.detach().cpu() - w).abs().mean()
        assert (a - b).abs().max() < 0.05 * moved and (a - b).abs().mean() < 0.01 * moved
        state = lean.state[b]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and int(state["step"]) == 50


def _one_step(ref, fused, reference, lean, device) -> None:
    for a, b in zip(ref, fused):
        g = torch.randn(a.shape).to(device)
        a.grad, b.grad = g.clone(), g.clone()
    reference.step()
    lean.step()


def _in_interpreter(check: str) -> None:
    code = f"import sys; sys.path.insert(0, 'tests'); import test_optim_fused as t; t.{check}('cpu')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter); CI has no triton")
def test_the_kernel_moves_weights_as_the_foreach_form_and_rounds_without_bias_in_the_triton_interpreter():
    _in_interpreter("check_kernel")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter); CI has no triton")
def test_the_fused_optimizer_follows_torchs_adamw_in_the_triton_interpreter():
    _in_interpreter("check_optimizer")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter); CI has no triton")
def test_one_launch_over_many_tensors_equals_each_alone_in_the_triton_interpreter():
    _in_interpreter("check_many")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_the_kernel_on_cuda():
    check_kernel("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_one_launch_over_many_tensors_on_cuda():
    check_many("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_the_fused_optimizer_on_cuda_and_chosen_there_by_default():
    check_optimizer("cuda")
    assert AdamWBF16([torch.nn.Parameter(torch.zeros(2, device="cuda"))]).fuses(torch.device("cuda")) == \
        (torch.version.hip is None)


def test_a_kernel_that_fails_its_probe_is_said_once_and_the_foreach_form_taken(monkeypatch):
    """Faked (no GPU, no Triton here): the probe's answer decides, and its reason is one warning a device."""
    import types

    import minagi
    fake = types.SimpleNamespace(works=lambda device: "failed to run (CompilationError: no such instruction)")
    monkeypatch.setitem(sys.modules, "minagi.adamw_triton", fake)
    monkeypatch.setattr(minagi, "adamw_triton", fake, raising=False)
    monkeypatch.setattr(optim, "_TRITON", True)
    monkeypatch.setattr(optim, "_WARNED", set())
    monkeypatch.setattr(torch.version, "hip", None)
    opt = AdamWBF16([torch.nn.Parameter(torch.zeros(3))])
    with pytest.warns(UserWarning, match="fused bf16 AdamW kernel failed to run .*foreach ops instead"):
        assert not opt.fuses(torch.device("cuda"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not opt.fuses(torch.device("cuda"))  # said once
    fake.works = lambda device: ""
    assert opt.fuses(torch.device("cuda"))


def test_the_foreach_form_runs_where_the_kernel_does_not(monkeypatch):
    """None fuses only on an NVIDIA GPU with Triton; asking for the kernel without Triton is refused at once."""
    p = torch.nn.Parameter(torch.zeros(3))
    assert not AdamWBF16([p]).fuses(torch.device("cpu"))
    assert AdamWBF16([p], fused=False).fuses(torch.device("cuda")) is False
    monkeypatch.setattr(optim, "_TRITON", False)
    assert not AdamWBF16([p]).fuses(torch.device("cuda"))
    with pytest.raises(RuntimeError, match="needs Triton"):
        AdamWBF16([p], fused=True)


def test_the_kernel_choice_survives_a_copy_and_a_pickle():
    """torch's Optimizer pickles only defaults, state and groups; `fused` travels too (None where unpickled from
    an optimizer that had none)."""
    import copy
    import pickle
    opt = AdamWBF16([torch.nn.Parameter(torch.zeros(3))], fused=False)
    assert copy.deepcopy(opt).fused is False and pickle.loads(pickle.dumps(opt)).fused is False
    state = opt.__getstate__()
    del state["fused"]
    old = AdamWBF16.__new__(AdamWBF16)
    old.__setstate__(state)
    assert old.fused is None and not old.fuses(torch.device("cpu"))

