"""The gated SwiGLU between an expert's two GEMMs: act = silu(h_gate) * h_up * gate.

Shapes: h [rows, 2F] (the gate half, then the up half), gate [rows] -> act [rows, F].
Gating here is linear, so it equals gating the expert's output, and spares the combine a pass over
[R, D] and its backward.

Three implementations of one function, chosen by `swiglu(..., kernels=)` (the setting `pool.swiglu`;
train.py maps the environment variable MINAGI_SWIGLU onto it):
  eager      torch ops. CPU, and every call that needs no gradient (decoding); "eager" asks for
             them everywhere.
  triton     NVIDIA GPUs (sm80+) in calls that need gradients, under "auto": one hand-written kernel
             each way. The backward reads h and the output gradient once and writes both halves of
             grad h and the gate's gradient in the same pass; torch.compile's backward for the same
             function took two kernels that read h twice (docs/LOG.md has the H200 times). Rows may
             change from call to call (the bucketed path): nothing is recompiled.
  jiterator  other GPUs (ROCm, a Python without Triton) under "auto", and every GPU under
             "jiterator" (how a Triton-equipped machine measures the Triton-less one): torch's
             run-time compiled elementwise kernels, one pass forward and two backward, saving only h
             and the gate; in bf16 and fp16 they read and write int64 words of 4 lanes
             (minagi/swiglu_jit.py, minagi/swiglu_words.py).
             Probed once per device; where they fail, eager ops.
             Inside torch.compile the eager ops run instead: inductor fuses them itself.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

from . import swiglu_jit

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
_KERNELS_TESTED_HERE = TRITON_AVAILABLE and torch.version.hip is None  # run on NVIDIA GPUs only


def swiglu_eager(h: Tensor, gate: Tensor) -> Tensor:
    """[..., 2F], [...] -> [..., F]."""
    h_gate, h_up = h.chunk(2, dim=-1)
    return F.silu(h_gate) * h_up * gate.unsqueeze(-1)


KERNELS = ("auto", "jiterator", "eager")  # the values of pool.swiglu


def swiglu(h: Tensor, gate: Tensor, kernels: str = "auto") -> Tensor:
    """[..., 2F], [...] -> [..., F] through the implementation `kernels` and the call choose (above).
    Inside torch.compile the Triton kernels run as the custom op `minagi::swiglu`, so a compiled model
    keeps their one-pass backward."""
    chosen = implementation(h, kernels)
    if chosen == "eager":
        return swiglu_eager(h, gate)
    lead = h.shape[:-1]
    h_RF2, gate_R = h.reshape(-1, h.shape[-1]), gate.reshape(-1)
    if chosen == "jiterator":
        act = swiglu_jit.JitSwiGLU.apply(h_RF2.contiguous(), gate_R.contiguous())  # [rows, F]
    elif torch.compiler.is_compiling():
        act = _swiglu_op(h_RF2, gate_R)
    else:
        act = _SwiGLU.apply(h_RF2, gate_R)
    return act.view(*lead, act.shape[-1])  # not -1: ambiguous when there are no rows


def implementation(h: Tensor, kernels: str = "auto") -> str:
    """"triton", "jiterator" or "eager": which one `swiglu(h, ..., kernels)` runs for this call."""
    if kernels not in KERNELS:
        raise ValueError(f"swiglu kernels must be one of {', '.join(KERNELS)}; got {kernels!r}")
    if kernels == "eager" or not (h.is_cuda and h.requires_grad):
        return "eager"
    if kernels == "auto" and _KERNELS_TESTED_HERE and _capable(h.device.index):  # a CUDA tensor has an index
        return "triton"
    if torch.compiler.is_compiling() or not swiglu_jit.works(h.device, h.dtype):
        return "eager"
    return "jiterator"


_CAPABLE: dict[int, bool] = {}


def _capable(device_index: int) -> bool:
    """Ampere or newer: bf16 in Triton needs sm80 (the kernels were run on sm90). Kept in a dict, not
    functools.cache: a compiled step traces this, and dynamo warns at every cache wrapper it meets."""
    if device_index not in _CAPABLE:
        _CAPABLE[device_index] = torch.cuda.get_device_capability(device_index) >= (8, 0)
    return _CAPABLE[device_index]


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_RF2: Tensor, gate_R: Tensor) -> Tensor:
        h_RF2, gate_R = h_RF2.contiguous(), gate_R.contiguous()
        ctx.save_for_backward(h_RF2, gate_R)
        return _kernels().forward(h_RF2, gate_R)

    @staticmethod
    def backward(ctx, grad_RF: Tensor):
        h_RF2, gate_R = ctx.saved_tensors
        return _kernels().backward(h_RF2, gate_R, grad_RF.contiguous())


_KERNELS = None


def _kernels():
    """Import the Triton kernels on first use (importing triton costs ~1 s; CPU runs never do)."""
    global _KERNELS
    if _KERNELS is None:
        from . import swiglu_triton
        _KERNELS = swiglu_triton
    return _KERNELS


# The same kernels as custom ops, for compiled models (torch.compile traces through neither a
# Triton launch nor an autograd Function's backward; an op with a fake and an autograd formula it can).

@torch.library.custom_op("minagi::swiglu", mutates_args=())
def _swiglu_op(h_RF2: Tensor, gate_R: Tensor) -> Tensor:
    return _kernels().forward(h_RF2.contiguous(), gate_R.contiguous())


@_swiglu_op.register_fake
def _(h_RF2: Tensor, gate_R: Tensor) -> Tensor:
    return h_RF2.new_empty(h_RF2.shape[0], h_RF2.shape[1] // 2)


@torch.library.custom_op("minagi::swiglu_backward", mutates_args=())
def _swiglu_backward_op(h_RF2: Tensor, gate_R: Tensor, grad_RF: Tensor) -> tuple[Tensor, Tensor]:
    return _kernels().backward(h_RF2.contiguous(), gate_R.contiguous(), grad_RF.contiguous())


@_swiglu_backward_op.register_fake
def _(h_RF2: Tensor, gate_R: Tensor, grad_RF: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(h_RF2), torch.empty_like(gate_R)


def _op_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _op_backward(ctx, grad_RF: Tensor):
    h_RF2, gate_R = ctx.saved_tensors
    return _swiglu_backward_op(h_RF2, gate_R, grad_RF)


_swiglu_op.register_autograd(_op_backward, setup_context=_op_setup)
