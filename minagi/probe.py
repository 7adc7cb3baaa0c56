"""Whether torch's grouped GEMM works on a device: asked of the device, not read off a capability number.

`dispatch.native_supported` used to say yes for CUDA `capability >= (9, 0)`: the predicate that
crashed transformers' MoE forward on RTX 5090 (sm120) with torch <= 2.8 (huggingface/transformers#47999),
and one that says nothing of the torch installed. Instead, the first time a model is built for a
device, `grouped_mm_works` runs the grouped GEMM there once, tiny (4 experts, one of them empty, 16
routed rows of width 16), forward and backward through `mm.grouped_mm` as the native path calls it,
and asks three things:

  does it run          no error (a kernel this architecture or this torch lacks)
  is it exact          against a loop of per-expert matmuls in fp32 on the CPU: the inputs are small
                       integers, so every product and sum is exact in bf16 as in fp32
  is it free of host   on CUDA, by torch's sync debug mode: where torch has no grouped kernel for the
  syncs                device it loops over the groups on the host, correct but slow

The answer is kept for the process, per device and torch version. A "no" is one warning line, and
dispatch `auto` takes minagi's own Triton grouped GEMM ("triton") where it runs, else the bucketed
path ("grouped"). `triton_grouped_mm_works` asks the same three things of minagi's kernel
(minagi/grouped_triton.py) before `auto` takes it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from . import devices, mm

__all__ = ["Answer", "grouped_mm_works", "triton_grouped_mm_works"]

_COUNTS = (3, 0, 5, 8)  # routed rows per expert: one expert empty, as routing leaves some
_WIDTH = 16             # input and output width: a multiple of 8 bf16 (the 16 bytes CUTLASS aligns to)


@dataclass(frozen=True)
class Answer:
    works: bool
    why: str = ""  # what failed, for the warning


_ANSWERS: dict[tuple, Answer] = {}


def grouped_mm_works(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, warn: bool = True) -> bool:
    """Whether torch's grouped GEMM runs on `device` in `dtype`, exactly and (CUDA) without a host sync.
    Probed once per device, torch version and dtype in a process; a "no" warns once, saying why
    (`warn` False: not yet; dispatch `auto` says nothing where minagi's kernel takes over)."""
    return _ask(device, dtype, "torch", warn, "torch's grouped GEMM", "dispatch \"auto\" takes minagi's Triton "
                "grouped GEMM where it runs, else the bucketed path; pool.dispatch = \"triton\" or \"grouped\" "
                "chooses one without this probe")


def triton_grouped_mm_works(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, warn: bool = True) -> bool:
    """The same question of minagi's Triton grouped GEMM (minagi/grouped_triton.py)."""
    return _ask(device, dtype, "triton", warn, "minagi's Triton grouped GEMM", "the experts take the bucketed "
                "path (dispatch \"grouped\"); pool.dispatch = \"grouped\" chooses it without this probe")


_WARNED: set[tuple] = set()


def _ask(device: torch.device | str, dtype: torch.dtype, kernel: str, warn: bool, name: str, instead: str) -> bool:
    device = torch.device(device)
    key = (_device_key(device), torch.__version__, str(dtype), kernel)
    answer = _ANSWERS.get(key)
    if answer is None:
        answer = _ANSWERS[key] = probe(device, dtype, kernel)
    if warn and not answer.works and key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"{name} {answer.why} on {_device_name(device)} (torch {torch.__version__}, "
                      f"{str(dtype).removeprefix('torch.')}): {instead}", stacklevel=3)
    return answer.works


def probe(device: torch.device, dtype: torch.dtype, kernel: str = "torch") -> Answer:
    """Run the probe (uncached): the grouped GEMM's output and gradients against the loop's.
    `kernel`: "torch" (torch's, mm.GROUPED_MM) or "triton" (minagi's)."""
    if kernel == "triton":
        try:
            from .grouped_triton import grouped_mm as gemm
        except Exception as e:  # noqa: BLE001 - no Triton, or one that cannot build the kernels: the answer
            return Answer(False, f"cannot load ({type(e).__name__}: {str(e).strip()[:200]})")
    elif mm.GROUPED_MM is None:
        return Answer(False, "is missing (this torch has neither F.grouped_mm nor torch._grouped_mm)")
    else:
        gemm = None  # mm.grouped_mm's default: torch's
    gen = torch.Generator().manual_seed(0)
    rows, experts = sum(_COUNTS), len(_COUNTS)
    x_RI, w_EIO, grad_RO = (torch.randint(-2, 3, shape, generator=gen).float()
                            for shape in ((rows, _WIDTH), (experts, _WIDTH, _WIDTH), (rows, _WIDTH)))
    offs_E = torch.tensor(_COUNTS).cumsum(0).to(torch.int32)
    want = _loop_reference(x_RI, w_EIO, grad_RO, offs_E)
    try:
        got, syncs = _run(x_RI, w_EIO, grad_RO, offs_E, device, dtype, gemm)
    except Exception as e:  # noqa: BLE001 - any failure of the kernel is the answer, and said in the warning
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return Answer(False, f"fails ({detail[:200]})")
    for name, a, b in zip(("output", "input gradient", "weight gradient"), got, want):
        if not torch.equal(a, b):
            return Answer(False, f"differs from a loop of matmuls in its {name} (by up to "
                                 f"{float((a - b).abs().max()):g} on exact small integers)")
    if syncs:
        return Answer(False, f"makes {len(syncs)} host sync(s) a call here (a loop over the groups on the "
                             f"host: correct but slow)")
    return Answer(True)


def _run(x_RI: Tensor, w_EIO: Tensor, grad_RO: Tensor, offs_E: Tensor, device: torch.device,
         dtype: torch.dtype, gemm=None) -> tuple[tuple[Tensor, Tensor, Tensor], list[str]]:
    """(output, input gradient, weight gradient) as fp32 CPU tensors, and the host syncs of the call."""
    x, w = (t.to(device, dtype).requires_grad_() for t in (x_RI, w_EIO))
    grad, offs = grad_RO.to(device, dtype), offs_E.to(device)  # copied before the sync check
    out = {}

    def call() -> None:
        y = mm.grouped_mm(x, w, offs, gemm)
        y.backward(grad)
        out["y"] = y.detach()
    # Built anywhere (inference mode, no_grad, autocast): the probe runs the training call.
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        syncs = devices.host_syncs(call) if device.type == "cuda" else []
        if device.type != "cuda":
            call()
    return tuple(t.float().cpu() for t in (out["y"], x.grad, w.grad)), syncs


def _loop_reference(x_RI: Tensor, w_EIO: Tensor, grad_RO: Tensor, offs_E: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """y = x_e W_e per expert's rows, dx = dy_e W_e^T, dW_e = x_e^T dy_e: one expert at a time, fp32."""
    y, dx, dw = torch.zeros_like(grad_RO), torch.zeros_like(x_RI), torch.zeros_like(w_EIO)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        x_e, g_e = x_RI[start:end], grad_RO[start:end]
        y[start:end], dx[start:end], dw[e] = x_e @ w_EIO[e], g_e @ w_EIO[e].T, x_e.T @ g_e
        start = end
    return y, dx, dw


def _device_key(device: torch.device) -> tuple:
    if device.type != "cuda":
        return (device.type,)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (device.type, index, torch.cuda.get_device_name(index))


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
