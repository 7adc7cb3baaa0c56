"""The SwiGLU kernels (Triton, jiterator) compute the eager function, its input gradient and its gate gradient."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi.swiglu import swiglu, swiglu_eager

HAS_TRITON = importlib.util.find_spec("triton") is not None
# (rows, F): odd widths that leave partial column blocks, one row, no rows, rows past a row block.
SHAPES = [(37, 24), (5, 300), (1, 8), (0, 16), (130, 1024)]


def reference(h, gate, grad):
    """fp64 eager output and gradients."""
    h64, g64 = h.double().requires_grad_(), gate.double().requires_grad_()
    act = swiglu_eager(h64, g64)
    act.backward(grad.double())
    return act.detach(), h64.grad, g64.grad


def relative_error(a, b):
    return ((a.double() - b).norm() / b.norm().clamp(min=1e-30)).item()


def check_kernels(device, dtype, tol):
    from minagi import swiglu_triton as kernels
    for rows, width in SHAPES:
        gen = torch.Generator().manual_seed(rows * 1000 + width)
        h = torch.randn(rows, 2 * width, generator=gen).to(device, dtype)
        gate = torch.rand(rows, generator=gen).to(device, dtype)
        grad = torch.randn(rows, width, generator=gen).to(device, dtype)
        act = kernels.forward(h, gate)
        grad_h, grad_gate = kernels.backward(h, gate, grad)
        want = reference(h.cpu(), gate.cpu(), grad.cpu())
        assert act.shape == (rows, width) and grad_h.shape == h.shape and grad_gate.shape == gate.shape
        if rows == 0:
            continue
        for name, got, ref in zip(("act", "grad h", "grad gate"), (act, grad_h, grad_gate), want):
            err = relative_error(got.cpu(), ref)
            assert err < tol, f"{rows}x{width} {dtype} {name}: relative error {err:.3g}"


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter)")
def test_kernels_match_fp64_eager_in_the_triton_interpreter():
    """Triton's interpreter runs the kernels on the CPU (it reads TRITON_INTERPRET at import: a fresh process)."""
    code = ("import sys; sys.path.insert(0, 'tests'); import torch, test_swiglu as t; "
            "t.check_kernels('cpu', torch.float32, 1e-5)")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]


# swiglu() itself through the kernels: its reshapes, the autograd Function, no rows (review finding:
# `view(*lead, -1)` cannot infer -1 from 0 elements). _use_kernels is forced, since the interpreter
# runs the kernels on CPU tensors.
_WRAPPER_CHECK = """
import torch
from minagi import swiglu as module
module._use_kernels = lambda h: True
for shape in [(7, 12), (0, 12), (3, 5, 24), (2, 0, 8)]:
    *lead, width = shape
    gen = torch.Generator().manual_seed(sum(shape))
    h = torch.randn(*lead, 2 * width, generator=gen).requires_grad_()
    gate = torch.rand(*lead, generator=gen).requires_grad_()
    grad = torch.randn(*lead, width, generator=gen)
    act = module.swiglu(h, gate)
    act.backward(grad)
    h_ref, gate_ref = h.detach().clone().requires_grad_(), gate.detach().clone().requires_grad_()
    ref = module.swiglu_eager(h_ref, gate_ref)
    ref.backward(grad)
    assert act.shape == ref.shape, (shape, act.shape)
    for got, want in ((act, ref), (h.grad, h_ref.grad), (gate.grad, gate_ref.grad)):
        torch.testing.assert_close(got.detach(), want.detach(), atol=1e-5, rtol=1e-4)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter)")
def test_swiglu_through_the_kernels_keeps_leading_dims_and_handles_no_rows_in_the_triton_interpreter():
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", _WRAPPER_CHECK], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_kernels_match_fp64_eager_on_cuda(dtype, tol):
    check_kernels("cuda", dtype, tol)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_swiglu_autograd_uses_the_kernels_and_matches_eager():
    """Leading dims are kept ([G, C, 2F] from the bucketed path); gradients reach h and the gate."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 50, 2 * 40, generator=gen).cuda().requires_grad_()
    gate = torch.rand(3, 50, generator=gen).cuda().requires_grad_()
    grad = torch.randn(3, 50, 40, generator=gen).cuda()
    act = swiglu(h, gate)
    nodes = [act.grad_fn] + [f for f, _ in act.grad_fn.next_functions if f is not None]
    assert any("SwiGLU" in type(f).__name__ for f in nodes), [type(f).__name__ for f in nodes]
    act.backward(grad)
    want = reference(h.detach().cpu(), gate.detach().cpu(), grad.cpu())
    for got, ref in zip((act.detach(), h.grad, gate.grad), want):
        assert relative_error(got.cpu(), ref) < 1e-5
    eager = swiglu(h, gate, "eager")  # pool.swiglu = "eager"
    assert not any("SwiGLU" in type(f).__name__ for f in [eager.grad_fn] +
                   [f for f, _ in eager.grad_fn.next_functions if f is not None])


# ---------------------------------------------------------------- the jiterator kernels (minagi/swiglu_jit.py)
# On the CPU forward() and backward() run with torch stand-ins for the kernels' one-element functions:
# that checks the views they build (the halves, the broadcast selector, the [R, 2, F] grad h) and the
# stand-ins' maths. On CUDA the C++ functions themselves run.

from minagi import swiglu_jit  # noqa: E402


def check_jit(device, dtype, tol, elementwise=None, chunk=swiglu_jit._CHUNK):
    for rows, width in SHAPES:
        gen = torch.Generator().manual_seed(rows * 1000 + width)
        h = torch.randn(rows, 2 * width, generator=gen).to(device, dtype)
        gate = torch.rand(rows, generator=gen).to(device, dtype)
        grad = torch.randn(rows, width, generator=gen).to(device, dtype)
        act = swiglu_jit.forward(h, gate, elementwise)
        grad_h, grad_gate = swiglu_jit.backward(h, gate, grad, elementwise=elementwise, chunk=chunk)
        assert act.shape == (rows, width) and grad_h.shape == h.shape and grad_gate.shape == gate.shape
        assert grad_h.is_contiguous() and grad_h.dtype == dtype == grad_gate.dtype == act.dtype
        if rows == 0:
            continue
        want = reference(h.cpu(), gate.cpu(), grad.cpu())
        for name, got, ref in zip(("act", "grad h", "grad gate"), (act, grad_h, grad_gate), want):
            err = relative_error(got.cpu(), ref)
            assert err < tol, f"{rows}x{width} {dtype} {name}: relative error {err:.3g}"


@pytest.mark.parametrize("chunk", [swiglu_jit._CHUNK, 50])  # 50: blocks of 1 to 6 rows, the last one short
def test_jit_views_with_torch_stand_ins_match_fp64_eager(chunk):
    check_jit("cpu", torch.float64, 1e-5, swiglu_jit.torch_elementwise, chunk)  # the stand-ins compute in fp32


@pytest.mark.parametrize("chunk", [swiglu_jit._CHUNK, 50])
@pytest.mark.parametrize("dtype,fmt", [(torch.bfloat16, "bf16"), (torch.float16, "f16")])
def test_jit_packed_words_with_torch_stand_ins_match_fp64_eager(chunk, dtype, fmt, monkeypatch):
    """bf16 (and fp16 when asked) with F a multiple of 4 read int64 words of 4 lanes; other widths, one
    element at a time. fp16 runs one lane unless asked: its packed kernels were slower on the H200."""
    called = []

    def recording(name, *tensors):
        called.append((name, {t.dtype for t in tensors}))
        return swiglu_jit.torch_elementwise(name, *tensors)
    if dtype == torch.float16:
        check_jit("cpu", dtype, 1e-2, recording, chunk)
        assert {name for name, _ in called} == {"forward", "backward"}
        called.clear()
        monkeypatch.setattr(swiglu_jit, "PACKED_BY_DEFAULT", (torch.bfloat16, torch.float16))
    check_jit("cpu", dtype, 1e-2, recording, chunk)  # SHAPES' widths are multiples of 4
    assert {name for name, _ in called} == {f"forward_packed_{fmt}", f"backward_packed_{fmt}"}
    assert all(dtypes == {torch.int64} for _, dtypes in called)  # jiterator gives every operand one type
    if dtype == torch.float16:
        return
    called.clear()
    h, grad = torch.randn(3, 12).bfloat16(), torch.randn(3, 6).bfloat16()
    grad_h, _ = swiglu_jit.backward(h, torch.rand(3).bfloat16(), grad, gate_grad=False, elementwise=recording)
    assert [name for name, _ in called] == ["backward_h"] and grad_h.dtype == torch.bfloat16
    h, gate, values = torch.randn(3, 16).bfloat16(), torch.rand(3).bfloat16(), torch.randn(3, 8).bfloat16()
    want = swiglu_jit.backward(h, gate, values, elementwise=recording)
    for grad in (torch.empty(25).bfloat16()[1:].view(3, 8),      # contiguous, but starting off a word's boundary
                 torch.empty(1, 14).bfloat16()[:, 3:11]):        # one row: contiguous, its row stride 14
        grad.copy_(values[:grad.shape[0]])
        called.clear()
        got = swiglu_jit.backward(h[:grad.shape[0]], gate[:grad.shape[0]], grad, elementwise=recording)
        assert [name for name, _ in called] == ["backward_packed_bf16"]
        assert all(torch.equal(a, b[:grad.shape[0]]) for a, b in zip(got, want))
    called.clear()
    h = torch.randn(3, 18).bfloat16()[:, 1:-1]  # F = 8, but the halves start off a word's boundary
    swiglu_jit.backward(h, torch.rand(3).bfloat16(), torch.randn(3, 8).bfloat16(), elementwise=recording)
    assert [name for name, _ in called] == ["backward"]  # not word-aligned: one lane


def test_jit_packed_gate_terms_are_summed_in_fp32_per_word():
    h = torch.randn(2, 8).bfloat16()
    grad = torch.randn(2, 4).bfloat16()
    words = swiglu_jit._words(h)
    *_, terms = swiglu_jit.torch_elementwise("backward_packed_bf16", words[:, :1], words[:, 1:],
                                             swiglu_jit._words(grad), swiglu_jit._gate_words(torch.ones(2)))
    a, b = h.float().chunk(2, dim=-1)
    want = (a * torch.sigmoid(a) * b * grad.float()).sum(-1)  # fp32, not rounded to bf16
    assert torch.equal(terms.view(torch.int32)[:, 0::2].view(torch.float32)[:, 0], want)


def test_jit_backward_without_the_gate_gradient_skips_it():
    h, grad = torch.randn(4, 16), torch.randn(4, 8)
    grad_h, grad_gate = swiglu_jit.backward(h, torch.rand(4), grad, gate_grad=False,
                                            elementwise=swiglu_jit.torch_elementwise)
    assert grad_gate is None and grad_h.shape == h.shape


def test_jit_autograd_function_saves_h_and_the_gate_and_matches_eager(monkeypatch):
    monkeypatch.setattr(swiglu_jit, "_launch", swiglu_jit.torch_elementwise)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(9, 20, generator=gen, dtype=torch.float64).requires_grad_()
    gate = torch.rand(9, generator=gen, dtype=torch.float64).requires_grad_()
    grad = torch.randn(9, 10, generator=gen, dtype=torch.float64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        act = swiglu_jit.JitSwiGLU.apply(h, gate)
    assert saved == [h.shape, (9, 1)]  # h and the gate's operand, not the eager ops' two [rows, F] products
    act.backward(grad)
    want = reference(h.detach(), gate.detach(), grad)
    for got, ref in zip((act.detach(), h.grad, gate.grad), want):
        assert relative_error(got, ref) < 1e-5


def test_jit_autograd_function_makes_the_packed_gate_words_once_and_matches_the_functions(monkeypatch):
    """A packed call's gate words (a cast kernel) are made in forward and kept for backward, not made again."""
    monkeypatch.setattr(swiglu_jit, "_launch", swiglu_jit.torch_elementwise)
    monkeypatch.setattr(swiglu_jit, "_ANSWERS", {("cpu", None, str(torch.bfloat16), "packed"): True})
    made = []
    gate_words = swiglu_jit._gate_words
    monkeypatch.setattr(swiglu_jit, "_gate_words", lambda g: made.append(g.shape) or gate_words(g))
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(7, 16, generator=gen).bfloat16().requires_grad_()
    gate = torch.rand(7, generator=gen).bfloat16().requires_grad_()
    grad = torch.randn(7, 8, generator=gen).bfloat16()
    act = swiglu_jit.JitSwiGLU.apply(h, gate)
    act.backward(grad)
    assert made == [(7,)]
    want_act = swiglu_jit.forward(h.detach(), gate.detach(), swiglu_jit.torch_elementwise)
    want_h, want_gate = swiglu_jit.backward(h.detach(), gate.detach(), grad, elementwise=swiglu_jit.torch_elementwise)
    assert torch.equal(act.detach(), want_act) and torch.equal(h.grad, want_h) and torch.equal(gate.grad, want_gate)
    assert gate.grad.dtype == torch.bfloat16


def test_jit_probe_says_no_with_why_where_the_kernels_fail_or_differ(monkeypatch):
    monkeypatch.setattr(swiglu_jit, "_ANSWERS", {})
    cpu = torch.device("cpu")
    with pytest.warns(UserWarning, match=r"jiterator SwiGLU kernels fail \(.*\) on cpu .*the eager torch ops run instead"):
        assert not swiglu_jit.works(cpu, torch.float32)  # jiterator itself refuses CPU tensors
    assert not swiglu_jit.works(cpu, torch.float32)      # asked once: no second warning (pytest would fail on none)

    def off_by_a_bit(name, *tensors):
        out = swiglu_jit.torch_elementwise(name, *tensors)
        return (*out[:2], out[2] * 1.1) if name == "backward" else out
    monkeypatch.setattr(swiglu_jit, "_ANSWERS", {})
    monkeypatch.setattr(swiglu_jit, "_launch", off_by_a_bit)
    with pytest.warns(UserWarning, match="differ from their torch stand-ins in the gate gradient"):
        assert not swiglu_jit.works(cpu, torch.float32)
    monkeypatch.setattr(swiglu_jit, "_ANSWERS", {})
    monkeypatch.setattr(swiglu_jit, "_launch", swiglu_jit.torch_elementwise)
    assert swiglu_jit.works(cpu, torch.float32)


def test_jit_packed_kernels_that_fail_their_probe_leave_the_one_lane_kernels_running(monkeypatch):
    monkeypatch.setattr(swiglu_jit, "_ANSWERS", {})
    launched = []

    def no_packed(name, *tensors):
        launched.append(name)
        if "_packed_" in name:
            raise RuntimeError("#ifdef __HIPCC__\n#define ERROR_UNSUPPORTED_CAST ;\n...\n"  # jiterator: source, then log
                               "kernel.cu(12): error: unknown type name 'T'\n1 error detected")
        return swiglu_jit.torch_elementwise(name, *tensors)
    monkeypatch.setattr(swiglu_jit, "_launch", no_packed)
    h, gate = torch.randn(6, 16).bfloat16(), torch.rand(6).bfloat16()  # packable: the packed kernels are asked
    with pytest.warns(UserWarning, match=r"packed jiterator SwiGLU kernels \(bf16\) fail \(kernel\.cu\(12\): error: unknown "
                                         r"type name 'T'\) on cpu .*the one-lane jiterator kernels run instead"):
        act = swiglu_jit.forward(h, gate)
    assert launched == ["forward_packed_bf16", "forward"] and act.dtype == torch.bfloat16  # the probe, then the call
    launched.clear()
    swiglu_jit.backward(h, gate, torch.randn(6, 8).bfloat16())  # asked once
    assert launched == ["backward"]


def test_implementation_is_eager_on_the_cpu_and_without_gradients_and_names_a_bad_setting():
    from minagi.swiglu import implementation
    h = torch.randn(3, 8, requires_grad=True)
    assert implementation(h, "auto") == implementation(h, "jiterator") == "eager"
    with pytest.raises(ValueError, match="swiglu kernels must be one of auto, jiterator, eager; got 'fast'"):
        implementation(h, "fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_jit_kernels_match_fp64_eager_on_cuda(dtype, tol):
    check_jit("cuda", dtype, tol)
    check_jit("cuda", dtype, tol, chunk=50)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swiglu_jiterator_setting_runs_the_jit_function_and_matches_eager():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(3, 50, 2 * 40, generator=gen).cuda().requires_grad_()
    gate = torch.rand(3, 50, generator=gen).cuda().requires_grad_()
    grad = torch.randn(3, 50, 40, generator=gen).cuda()
    act = swiglu(h, gate, "jiterator")
    nodes = [act.grad_fn] + [f for f, _ in act.grad_fn.next_functions if f is not None]
    assert any("JitSwiGLU" in type(f).__name__ for f in nodes), [type(f).__name__ for f in nodes]
    act.backward(grad)
    want = reference(h.detach().cpu(), gate.detach().cpu(), grad.cpu())
    for got, ref in zip((act.detach(), h.grad, gate.grad), want):
        assert relative_error(got.cpu(), ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_jit_packed_kernels_equal_the_one_lane_kernels_on_cuda(dtype):
    """The same fp32 maths and rounding: act and grad h equal bit for bit; the gate gradient's terms
    are summed in another order (fp32 per word, against 2-byte products)."""
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(3000, 2 * 512, generator=gen).cuda().to(dtype)
    h[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 6e4])  # the rounding's edges
    h[1, :3] = torch.tensor([1e-7, -3e-5, 2 ** -24])                           # fp16's subnormals
    gate = torch.rand(3000, generator=gen).cuda().to(dtype)
    grad = torch.randn(3000, 512, generator=gen).cuda().to(dtype)
    outs = {}
    for packed in (True, False):  # asked for: fp16 runs one lane unless it is
        outs[packed] = (swiglu_jit.forward(h, gate, packed=packed), *swiglu_jit.backward(h, gate, grad, packed=packed))
    for name, a, b in zip(("act", "grad h"), outs[True][:2], outs[False][:2]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name  # NaN bits included
    assert relative_error(outs[True][2][1:].cpu(), outs[False][2][1:].double().cpu()) < 1e-2
