"""The gated SwiGLU fused without Triton: torch's jiterator kernels (minagi/swiglu.py says when they run).

`torch.cuda.jiterator` compiles a one-element C++ function at run time (NVRTC on NVIDIA, hipRTC on
ROCm) and runs it over TensorIterator's views, strided and broadcast, so a GPU that has no Triton
(Windows, ROCm) still gets one kernel each way where the eager ops take several, and keeps h and
the gate for backward where they keep two more [rows, F] products.

Shapes: h [R, 2F] (the gate half a, then the up half b), gate g [R], grad and act [R, F].
  forward    act = silu(a) * b * g                          one kernel: reads h, writes act
  backward   grad a = grad * g * b * silu'(a), grad b = grad * g * silu(a), and the gate terms
             grad * silu(a) * b                              one kernel of three outputs,
             then grad h = [grad a, grad b] (torch.cat) and grad g = the terms' sum (fp32).
             Rows go through in chunks of about _CHUNK elements, so the three outputs alive beside
             grad h stay small. (One [R, 2, F] kernel writing grad h whole, a broadcast selector
             picking the half, was twice as slow: docs/LOG.md.)
Math in fp32; results stored in h's dtype (the gate terms too, as the eager ops' products are).

`works(device, dtype)` runs them once, tiny, against their torch stand-ins (`torch_elementwise`);
a failure (no NVRTC/hipRTC, a compile error) is one warning, and the eager ops run instead.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

__all__ = ["JitSwiGLU", "backward", "forward", "torch_elementwise", "works"]

_CODE = {
    "forward": """
template <typename T> T minagi_swiglu_forward(T a, T b, T g) {
    float x = static_cast<float>(a);
    return static_cast<T>(x / (1.0f + expf(-x)) * static_cast<float>(b) * static_cast<float>(g));
}""",
    "backward": """
template <typename T> void minagi_swiglu_backward(T a, T b, T grad, T g, T& grad_a, T& grad_b, T& gate_term) {
    float x = static_cast<float>(a), s = 1.0f / (1.0f + expf(-x)), silu = x * s;
    float up = static_cast<float>(b), gr = static_cast<float>(grad), gated = gr * static_cast<float>(g);
    grad_a = static_cast<T>(gated * up * s * (1.0f + x * (1.0f - s)));
    grad_b = static_cast<T>(gated * silu);
    gate_term = static_cast<T>(silu * up * gr);
}""",
    "backward_h": """
template <typename T> void minagi_swiglu_backward_h(T a, T b, T grad, T g, T& grad_a, T& grad_b) {
    float x = static_cast<float>(a), s = 1.0f / (1.0f + expf(-x));
    float gated = static_cast<float>(grad) * static_cast<float>(g);
    grad_a = static_cast<T>(gated * static_cast<float>(b) * s * (1.0f + x * (1.0f - s)));
    grad_b = static_cast<T>(gated * x * s);
}""",
}
_OUTPUTS = {"forward": 1, "backward": 3, "backward_h": 2}
_CHUNK = 1 << 24  # elements of [rows, F] a backward kernel call covers (96 MiB of outputs in bf16)
_KERNELS: dict = {}


def _kernel(name: str):
    """The named jiterator function (made on first use; jiterator compiles per dtype on first call)."""
    if name not in _KERNELS:
        from torch.cuda import jiterator
        n = _OUTPUTS[name]
        _KERNELS[name] = (jiterator._create_jit_fn(_CODE[name]) if n == 1
                          else jiterator._create_multi_output_jit_fn(_CODE[name], num_outputs=n))
    return _KERNELS[name]


def forward(h_RF2: Tensor, gate_R: Tensor, elementwise=None) -> Tensor:
    """act [R, F]. `elementwise(name, *tensors)` runs a kernel (tests pass a torch stand-in)."""
    run = elementwise or _launch
    rows, width = h_RF2.shape[0], h_RF2.shape[1] // 2
    if rows == 0:
        return h_RF2.new_empty(0, width)
    return run("forward", h_RF2[:, :width], h_RF2[:, width:], gate_R[:, None])


def backward(h_RF2: Tensor, gate_R: Tensor, grad_RF: Tensor, gate_grad: bool = True,
             elementwise=None, chunk: int = _CHUNK) -> tuple[Tensor, Tensor | None]:
    """(grad h [R, 2F], grad gate [R] or None when `gate_grad` is False)."""
    run = elementwise or _launch
    rows, width = grad_RF.shape
    name = "backward" if gate_grad else "backward_h"
    step = max(1, chunk // max(width, 1))
    if 0 < rows <= step:  # one block (the usual case): no copies into place, fewer launches
        outs = run(name, h_RF2[:, :width], h_RF2[:, width:], grad_RF, gate_R[:, None])
        grad_gate = outs[2].sum(-1, dtype=torch.float32).to(gate_R.dtype) if gate_grad else None
        return torch.cat(outs[:2], dim=1), grad_gate
    grad_h = h_RF2.new_empty(rows, 2 * width)
    grad_gate = gate_R.new_empty(rows) if gate_grad else None
    for start in range(0, rows, step):
        r = slice(start, min(start + step, rows))
        h_CF2 = h_RF2[r]
        outs = run(name, h_CF2[:, :width], h_CF2[:, width:], grad_RF[r], gate_R[r, None])
        torch.cat(outs[:2], dim=1, out=grad_h[r])  # a block of whole rows: contiguous
        if gate_grad:
            grad_gate[r] = outs[2].sum(-1, dtype=torch.float32)
    return grad_h, grad_gate


def _launch(name: str, *tensors: Tensor):
    return _kernel(name)(*tensors)


class JitSwiGLU(torch.autograd.Function):
    """forward(h [R, 2F], gate [R]) -> act [R, F]; saves only h and the gate."""

    @staticmethod
    def forward(ctx, h_RF2: Tensor, gate_R: Tensor) -> Tensor:
        ctx.save_for_backward(h_RF2, gate_R)
        return forward(h_RF2, gate_R)

    @staticmethod
    def backward(ctx, grad_RF: Tensor):
        h_RF2, gate_R = ctx.saved_tensors
        return backward(h_RF2, gate_R, grad_RF, gate_grad=ctx.needs_input_grad[1])


_ANSWERS: dict[tuple, bool] = {}


def works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels compile and match the eager ops on `device` in `dtype` (asked once per
    device and dtype in a process; a "no" warns once, saying why)."""
    key = (device.type, device.index, str(dtype))
    if key not in _ANSWERS:
        why = _probe(device, dtype)
        _ANSWERS[key] = why is None
        if why is not None:
            warnings.warn(f"minagi's jiterator SwiGLU {why} on {device} (torch {torch.__version__}): the eager "
                          "torch ops run instead (pool.swiglu = \"eager\" chooses them without this probe)",
                          stacklevel=3)
    return _ANSWERS[key]


def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the kernels run and agree with their torch stand-ins (fp32, CPU) on a small case, else
    what went wrong. No autograd here: the probe may run inside a checkpointed forward."""
    gen = torch.Generator().manual_seed(0)
    h, grad = torch.randn(5, 48, generator=gen), torch.randn(5, 24, generator=gen)
    gate = torch.rand(5, generator=gen)
    want = (forward(h, gate, torch_elementwise), *backward(h, gate, grad, elementwise=torch_elementwise))
    try:
        h_d, gate_d, grad_d = (t.to(device, dtype) for t in (h, gate, grad))
        got = (forward(h_d, gate_d), *backward(h_d, gate_d, grad_d))
    except Exception as e:  # noqa: BLE001 - any failure to compile or run is the answer, said in the warning
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"fails ({detail[:200]})"
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(("output", "input gradient", "gate gradient"), got, want):
        err = float((a.float().cpu() - b).norm() / b.norm())
        if not err < tol:
            return f"differs from its torch stand-in in its {name} (relative error {err:.3g})"
    return None


def torch_elementwise(name: str, *tensors: Tensor):
    """The kernels' one-element functions as torch ops, in fp32, stored in the inputs' dtype: the
    probe's reference, and how the CPU tests run forward() and backward() (which build the views)."""
    dtype = tensors[0].dtype
    a, b, third, *rest = (t.float() for t in tensors)
    s = torch.sigmoid(a)
    silu = a * s
    if name == "forward":  # (a, b, g)
        return (silu * b * third).to(dtype)
    grad, gated = third, third * rest[0]  # (a, b, grad, g)
    outs = (gated * b * s * (1 + a * (1 - s)), gated * silu) + ((silu * b * grad,) if name == "backward" else ())
    return tuple(o.to(dtype) for o in outs)
