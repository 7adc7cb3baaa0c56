"""The Triton SwiGLU kernels compute the eager function, its input gradient and its gate gradient."""
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
    eager = swiglu(h, gate, fused=False)  # pool.swiglu = "eager"
    assert not any("SwiGLU" in type(f).__name__ for f in [eager.grad_fn] +
                   [f for f, _ in eager.grad_fn.next_functions if f is not None])
