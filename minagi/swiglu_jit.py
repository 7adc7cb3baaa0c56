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

Packed words (bf16, F a multiple of 4: the usual case; fp16 when asked): every operand read as int64 words of
4 lanes, 8-byte loads and stores where the halves of h would be read 2 bytes at a time
(minagi/swiglu_words.py); where they cannot run, the one-lane kernels above.

`works(device, dtype)` runs them once, tiny, against their torch stand-ins (`torch_elementwise`);
a failure (no NVRTC/hipRTC, a compile error) is one warning, and the eager ops run instead.
"""
from __future__ import annotations

import re
import warnings

import torch
from torch import Tensor

from . import swiglu_words
from .swiglu_words import LANES

__all__ = ["JitSwiGLU", "PACK_WORDS", "backward", "forward", "packed_works", "torch_elementwise", "works"]

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
        packed = "_packed_" in name
        source = swiglu_words.code(name) if packed else _CODE[name]
        n = swiglu_words.OUTPUTS[name.partition("_packed_")[0]] if packed else _OUTPUTS[name]
        _KERNELS[name] = (jiterator._create_jit_fn(source) if n == 1
                          else jiterator._create_multi_output_jit_fn(source, num_outputs=n))
    return _KERNELS[name]


PACK_WORDS = True  # bf16 runs the packed kernels where it can; tools/bench_swiglu.py turns it off to compare
# Where a call packs unless told: bf16. fp16's kernels unpack and round each lane by hand, and ran slower
# than one lane on the H200 (2.46 against 1.79 ms at the bench's size, docs/benchmarks.md section 26):
# they run when asked for (`packed=True`), as the tests do.
PACKED_BY_DEFAULT = (torch.bfloat16,)


def _packable(h_RF2: Tensor) -> bool:
    """Whether h can be read as int64 words of 4 lanes (bf16 or fp16)."""
    width = h_RF2.shape[1] // 2
    return (h_RF2.dtype in swiglu_words.FORMATS and width % LANES == 0 and h_RF2.stride(1) == 1
            and h_RF2.stride(0) % LANES == 0 and h_RF2.storage_offset() % LANES == 0)


def _packs(h_RF2: Tensor, elementwise, packed: bool | None) -> bool:
    """Whether this call runs the `_packed` kernels: where h can be read so, unless `packed` says
    otherwise, or the packed kernels failed their probe on this device (the one-lane ones run then)."""
    if packed is not None:
        return packed
    return (PACK_WORDS and h_RF2.dtype in PACKED_BY_DEFAULT and _packable(h_RF2)
            and (elementwise is not None or packed_works(h_RF2.device, h_RF2.dtype)))


def _words(t_RN: Tensor) -> Tensor:
    """[R, N] bf16 or fp16 -> [R, N/4] int64 words over the same memory."""
    return t_RN.view(torch.int64)


def _gate_words(gate_R: Tensor) -> Tensor:
    """[R] -> [R, 1] int64 words, each gate's fp32 bits in the low 32 (the kernels mask the high half,
    left unwritten): one cast-and-copy kernel, made once in forward and saved for backward."""
    words_R1 = torch.empty(gate_R.shape[0], 1, dtype=torch.int64, device=gate_R.device)
    words_R1.view(torch.float32)[:, :1].copy_(gate_R[:, None])  # little-endian: the low half first
    return words_R1


def gate_operand(h_RF2: Tensor, gate_R: Tensor, elementwise=None, packed: bool | None = None) -> tuple[bool, Tensor]:
    """(whether the kernels for h pack, the gate as they take it: [R, 1] of the gate's dtype, or its
    fp32 bits in int64 words). JitSwiGLU makes it once in forward and keeps it for backward."""
    packs = _packs(h_RF2, elementwise, packed)
    return packs, (_gate_words(gate_R) if packs else gate_R[:, None])


def forward(h_RF2: Tensor, gate_R: Tensor, elementwise=None, packed: bool | None = None) -> Tensor:
    """act [R, F]. `elementwise(name, *tensors)` runs a kernel (tests pass a torch stand-in); `packed`
    chooses the kernels (None: the packed ones where they run)."""
    return forward_with(h_RF2, *gate_operand(h_RF2, gate_R, elementwise, packed), elementwise)


def forward_with(h_RF2: Tensor, packs: bool, gate_in: Tensor, elementwise=None) -> Tensor:
    """forward() with the gate as `gate_operand` made it."""
    run = elementwise or _launch
    rows, width = h_RF2.shape[0], h_RF2.shape[1] // 2
    if rows == 0:
        return h_RF2.new_empty(0, width)
    if packs:
        h_RW2 = _words(h_RF2)  # W = F/4 words a half
        words = width // LANES
        name = swiglu_words.kernel_name("forward", h_RF2.dtype)
        return run(name, h_RW2[:, :words], h_RW2[:, words:], gate_in).view(h_RF2.dtype)
    return run("forward", h_RF2[:, :width], h_RF2[:, width:], gate_in)


def backward(h_RF2: Tensor, gate_R: Tensor, grad_RF: Tensor, gate_grad: bool = True,
             elementwise=None, chunk: int = _CHUNK, packed: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """(grad h [R, 2F], grad gate [R] or None when `gate_grad` is False)."""
    packs, gate_in = gate_operand(h_RF2, gate_R, elementwise, packed)
    return backward_with(h_RF2, packs, gate_in, gate_R.dtype, grad_RF, gate_grad, elementwise, chunk)


def backward_with(h_RF2: Tensor, packed: bool, gate_in: Tensor, gate_dtype: torch.dtype, grad_RF: Tensor,
                  gate_grad: bool = True, elementwise=None, chunk: int = _CHUNK) -> tuple[Tensor, Tensor | None]:
    """backward() with the gate as `gate_operand` made it; the gate's gradient in `gate_dtype`."""
    run = elementwise or _launch
    rows, width = grad_RF.shape
    dtype = h_RF2.dtype
    name = "backward" if gate_grad else "backward_h"
    if packed:  # the same loop over int64 words; the gate terms come back as fp32 bits
        name = swiglu_words.kernel_name(name, dtype)
        if not (grad_RF.stride(1) == 1 and grad_RF.stride(0) % LANES == 0 and grad_RF.storage_offset() % LANES == 0):
            grad_RF = grad_RF.clone(memory_format=torch.contiguous_format)  # whole words, a row apart
        h_RF2, grad_RF = _words(h_RF2), _words(grad_RF)
        width //= LANES
    step = max(1, chunk // max(width * (LANES if packed else 1), 1))

    def terms_sum(terms: Tensor) -> Tensor:
        if packed:  # each word's low 32 bits, read in place as fp32 (little-endian, as every GPU is)
            terms = terms.view(torch.int32)[:, 0::2].view(torch.float32)
        return terms.sum(-1, dtype=torch.float32)

    if 0 < rows <= step:  # one block (the usual case): no copies into place, fewer launches
        outs = run(name, h_RF2[:, :width], h_RF2[:, width:], grad_RF, gate_in)
        grad_gate = terms_sum(outs[2]).to(gate_dtype) if gate_grad else None
        grad_h = torch.cat(outs[:2], dim=1)
        return (grad_h.view(dtype) if packed else grad_h), grad_gate
    grad_h = h_RF2.new_empty(rows, 2 * width)
    grad_gate = h_RF2.new_empty(rows, dtype=gate_dtype) if gate_grad else None
    for start in range(0, rows, step):
        r = slice(start, min(start + step, rows))
        h_CF2 = h_RF2[r]
        outs = run(name, h_CF2[:, :width], h_CF2[:, width:], grad_RF[r], gate_in[r])
        torch.cat(outs[:2], dim=1, out=grad_h[r])  # a block of whole rows: contiguous
        if gate_grad:
            grad_gate[r] = terms_sum(outs[2])
    return (grad_h.view(dtype) if packed else grad_h), grad_gate


def _launch(name: str, *tensors: Tensor):
    return _kernel(name)(*tensors)


class JitSwiGLU(torch.autograd.Function):
    """forward(h [R, 2F], gate [R]) -> act [R, F]; saves only h and the gate's operand ([R, 1]: the gate,
    or its words, made once: a packed call at T = 2,048 is bound by its launches, docs/benchmarks.md §27)."""

    @staticmethod
    def forward(ctx, h_RF2: Tensor, gate_R: Tensor) -> Tensor:
        packs, gate_in = gate_operand(h_RF2, gate_R)
        ctx.save_for_backward(h_RF2, gate_in)
        ctx.packs, ctx.gate_dtype = packs, gate_R.dtype
        return forward_with(h_RF2, packs, gate_in)

    @staticmethod
    def backward(ctx, grad_RF: Tensor):
        h_RF2, gate_in = ctx.saved_tensors
        return backward_with(h_RF2, ctx.packs, gate_in, ctx.gate_dtype, grad_RF, gate_grad=ctx.needs_input_grad[1])


_ANSWERS: dict[tuple, bool] = {}


def works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels compile and match the eager ops on `device` in `dtype` (asked once per
    device and dtype in a process; a "no" warns once, saying why)."""
    return _asked((device.type, device.index, str(dtype)), lambda: _probe(device, dtype, packed=False),
                  f"jiterator SwiGLU kernels {{}} on {device} (torch {torch.__version__}): the eager torch ops run "
                  "instead (pool.swiglu = \"eager\" chooses them without this probe)")


def packed_works(device: torch.device, dtype: torch.dtype) -> bool:
    """The same question for the packed kernels (bf16, fp16); a "no" leaves the one-lane kernels running."""
    return _asked((device.type, device.index, str(dtype), "packed"), lambda: _probe(device, dtype, packed=True),
                  f"packed jiterator SwiGLU kernels ({swiglu_words.FORMATS[dtype]}) {{}} on {device} (torch "
                  f"{torch.__version__}): the one-lane jiterator kernels run instead")


def _asked(key: tuple, probe, warning: str) -> bool:
    if key not in _ANSWERS:
        why = probe()
        _ANSWERS[key] = why is None
        if why is not None:
            warnings.warn("minagi's " + warning.format(why), stacklevel=4)
    return _ANSWERS[key]


def _probe(device: torch.device, dtype: torch.dtype, packed: bool) -> str | None:
    """None if the kernels run and agree with their torch stand-ins (fp32, CPU) on a small case, else
    what went wrong. No autograd here: the probe may run inside a checkpointed forward."""
    gen = torch.Generator().manual_seed(0)
    h, grad = torch.randn(5, 48, generator=gen), torch.randn(5, 24, generator=gen)
    gate = torch.rand(5, generator=gen)

    def results(h, gate, grad, run, packed):  # each kernel: forward, backward, backward without the gate's gradient
        return (forward(h, gate, run, packed), *backward(h, gate, grad, elementwise=run, packed=packed),
                backward(h, gate, grad, gate_grad=False, elementwise=run, packed=packed)[0])
    want = results(h, gate, grad, torch_elementwise, packed=False)
    try:
        got = results(*(t.to(device, dtype) for t in (h, gate, grad)), None, packed)
    except Exception as e:  # noqa: BLE001 - any failure to compile or run is the answer, said in the warning
        return f"fail ({_first_error_line(e)[:200]})"
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    names = ("output", "input gradient", "gate gradient", "input gradient without the gate's")
    for name, a, b in zip(names, got, want):
        err = float((a.float().cpu() - b).norm() / b.norm())
        if not err < tol:
            return f"differ from their torch stand-ins in the {name} (relative error {err:.3g})"
    return None


def _first_error_line(e: Exception) -> str:
    """The line of a failure that says what went wrong: jiterator raises the generated source followed
    by the compiler's log, so the first line is the source's (`#ifdef ...`), not the error."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror\s*:", line, re.IGNORECASE)]  # not ERROR_UNSUPPORTED_CAST
    return (errors or lines[-1:] or [type(e).__name__])[0]


def torch_elementwise(name: str, *tensors: Tensor):
    """The kernels' one-element functions as torch ops, in fp32, stored in the inputs' dtype: the
    probe's reference, and how the CPU tests run forward() and backward() (which build the views)."""
    if "_packed_" in name:
        return swiglu_words.stand_in(name, torch_elementwise, *tensors)
    dtype = tensors[0].dtype
    a, b, third, *rest = (t.float() for t in tensors)
    s = torch.sigmoid(a)
    silu = a * s
    if name == "forward":  # (a, b, g)
        return (silu * b * third).to(dtype)
    grad, gated = third, third * rest[0]  # (a, b, grad, g)
    outs = (gated * b * s * (1 + a * (1 - s)), gated * silu) + ((silu * b * grad,) if name == "backward" else ())
    return tuple(o.to(dtype) for o in outs)
