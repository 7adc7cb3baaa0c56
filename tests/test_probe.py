"""minagi/probe.py: torch's grouped GEMM is chosen by running it once on the device, not by a capability
number; a kernel that fails, or is not exact, sends dispatch `auto` to the bucketed path with one warning."""
import warnings

import pytest
import torch

from minagi import dispatch, mm, probe
from minagi.dispatch import resolve_dispatch

pytestmark = pytest.mark.skipif(mm.GROUPED_MM is None, reason="this torch has no grouped GEMM")
REAL = mm.GROUPED_MM


@pytest.fixture(autouse=True)
def fresh_answers(monkeypatch):
    monkeypatch.setattr(probe, "_ANSWERS", {})
    monkeypatch.setattr(probe, "_WARNED", set())


def _asked(device="cpu", dtype=torch.bfloat16) -> tuple[bool, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        works = probe.grouped_mm_works(device, dtype)
    return works, [str(w.message) for w in caught]


def test_torchs_own_kernel_passes_the_probe_on_the_cpu_in_bf16_and_fp32():
    assert _asked(dtype=torch.bfloat16) == (True, [])
    assert _asked(dtype=torch.float32) == (True, [])


def _failing(*args, **kwargs):
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore text")


class _BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, offs):
        return REAL(a, b, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("grouped_mm backward: not supported on this architecture")


@pytest.mark.parametrize("kernel, why", [
    (_failing, "fails (CUDA error: no kernel image is available for execution on the device)"),
    (lambda a, b, offs: _BadBackward.apply(a, b, offs), "fails (grouped_mm backward: not supported"),
    (lambda a, b, offs: a @ b[0], "differs from a loop of matmuls in its output"),         # offsets ignored
    (lambda a, b, offs: REAL(a, b, offs=offs) * 1.01, "differs from a loop of matmuls in its output"),
], ids=["fails", "backward-fails", "ignores-offsets", "inexact"])
def test_a_failing_or_inexact_kernel_is_refused_with_one_warning_naming_why(monkeypatch, kernel, why):
    monkeypatch.setattr(mm, "GROUPED_MM", kernel)
    works, said = _asked()
    assert not works and len(said) == 1, said
    assert why in said[0] and "\n" not in said[0]
    assert "takes minagi's Triton grouped GEMM where it runs, else the bucketed path" in said[0]


def test_a_kernel_wrong_only_in_a_gradient_is_refused(monkeypatch):
    class WrongWeightGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, offs):
            ctx.save_for_backward(a, b, offs)
            return REAL(a, b, offs=offs)

        @staticmethod
        def backward(ctx, grad):
            a, b, offs = ctx.saved_tensors
            return REAL(grad, b.transpose(1, 2), offs=offs), torch.zeros_like(b), None
    monkeypatch.setattr(mm, "GROUPED_MM", lambda a, b, offs: WrongWeightGrad.apply(a, b, offs))
    works, said = _asked()
    assert not works and "in its weight gradient" in said[0]


def test_the_answer_is_asked_once_per_device_torch_version_and_dtype(monkeypatch):
    calls = []

    def counting(a, b, offs):
        calls.append(1)
        return REAL(a, b, offs=offs)
    monkeypatch.setattr(mm, "GROUPED_MM", counting)
    assert _asked() == (True, []) and _asked() == (True, [])
    once = len(calls)
    assert once >= 1
    monkeypatch.setattr(mm, "GROUPED_MM", _failing)
    assert _asked() == (True, [])  # the kept answer: the kernel is not run again
    assert len(calls) == once
    assert _asked(dtype=torch.float32)[0] is False  # another dtype is another question


def test_a_failed_probe_sends_auto_to_the_bucketed_path_and_a_passed_one_to_native(monkeypatch):
    asked = []

    def answer(works):
        def grouped_mm_works(device, dtype, warn=True):
            asked.append((torch.device(device).type, dtype, warn))
            return works
        return grouped_mm_works
    monkeypatch.setattr(dispatch, "triton_supported", lambda device, dtype, warn=True: False)  # its own tests
    monkeypatch.setattr(probe, "grouped_mm_works", answer(False))
    assert resolve_dispatch("auto", "cuda", torch.bfloat16) == "grouped"
    # asked quietly first (minagi's kernel might take over), then again to say why neither was taken
    assert asked == [("cuda", torch.bfloat16, False), ("cuda", torch.bfloat16, True)]
    monkeypatch.setattr(probe, "grouped_mm_works", answer(True))
    assert resolve_dispatch("auto", "cuda", torch.bfloat16) == "native"
    assert asked[2:] == [("cuda", torch.bfloat16, False)]
    # The cheap checks stay before the probe: not bf16, or the CPU, asks nothing.
    assert resolve_dispatch("auto", "cuda", torch.float32) == "grouped"
    assert resolve_dispatch("auto", "cpu", torch.bfloat16) == "grouped"
    assert not dispatch.native_supported(torch.device("cuda"), torch.float16)
    assert len(asked) == 3


def test_a_refusal_asked_quietly_is_said_once_when_asked_aloud(monkeypatch):
    monkeypatch.setattr(mm, "GROUPED_MM", _failing)
    monkeypatch.setattr(probe, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert probe.grouped_mm_works("cpu", torch.bfloat16, warn=False) is False
        assert not caught
        assert probe.grouped_mm_works("cpu", torch.bfloat16) is False
        assert probe.grouped_mm_works("cpu", torch.bfloat16) is False
    assert len(caught) == 1 and "fails (CUDA error: no kernel image" in str(caught[0].message)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_probe_on_this_gpu_answers_and_says_why_when_it_refuses():
    answer = probe.probe(torch.device("cuda"), torch.bfloat16)
    print(f"grouped GEMM probe on {torch.cuda.get_device_name()}: {answer}")
    if torch.cuda.get_device_capability() in ((9, 0), (10, 0)) and torch.version.hip is None:
        assert answer.works, answer.why  # H100/H200/B200: torch's CUTLASS kernel
    assert answer.works or answer.why
