"""minagi/grouped_triton.py and the dispatch path "triton": minagi's own grouped GEMM against a loop of
matmuls, in the output and both gradients; the path chosen by `auto` only where its probe passes; a
whole step with it compiled as one graph and replayed as a CUDA graph. The kernels need a CUDA GPU
with Triton; the choices around them are tested on the CPU."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from minagi import dispatch, probe
from minagi.dispatch import resolve_dispatch

HAS_TRITON = dispatch._has_triton()
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")


def loop_reference(x, w, grad, counts):
    """y = x_e W_e, dx = dy_e W_e^T, dW_e = x_e^T dy_e, one expert at a time in fp32."""
    x, w, grad = x.float(), w.float(), grad.float()
    y, dx, dw = torch.zeros_like(grad), torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        y[rows], dx[rows], dw[e] = x[rows] @ w[e], grad[rows] @ w[e].T, x[rows].T @ grad[rows]
        start += n
    return y, dx, dw


# rows per expert: empty experts, a sink, fewer rows than a tile, widths that are no multiple of a tile
CASES = {
    "uneven, empty experts": ([3, 0, 5, 70, 0, 1, 129, 64], 40, 150),
    "all empty": ([0, 0, 0, 0], 32, 32),
    "one expert": ([300], 64, 96),
    "sink": ([2000] + [17] * 15, 256, 384),
    "many experts": ([int(n) for n in torch.randint(0, 90, (128,), generator=torch.Generator().manual_seed(0))],
                     128, 256),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("form", ["bf16", "fp16", "w-transposed", "strided-x", "summed"])
def test_the_kernels_equal_a_loop_of_matmuls_in_output_and_both_gradients(case, form):
    """Element by element against fp32 (the kernels accumulate in fp32 and round once); W given
    transposed (the input gradient's form), x a strided view, and the output gradient of a sum
    (stride 0) too. Expert rows' memory is filled with NaN first: an expert without rows must get
    zeros written, not what the memory held."""
    from minagi.grouped_triton import grouped_mm
    counts, I, O = CASES[case]
    dtype = torch.float16 if form == "fp16" else torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    R, E = sum(counts), len(counts)
    x_wide = torch.randn(R, 2 * I, generator=gen).cuda().to(dtype)
    x = (x_wide[:, ::2] if form == "strided-x" else x_wide[:, :I].contiguous()).detach().requires_grad_()
    if form == "w-transposed":  # a [E, I, O] view of [E, O, I] memory
        w = torch.randn(E, O, I, generator=gen).cuda().to(dtype).transpose(1, 2).detach().requires_grad_()
    else:
        w = torch.randn(E, I, O, generator=gen).cuda().to(dtype).requires_grad_()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    torch.full((E, I, O), float("nan"), device="cuda", dtype=dtype)  # freed: the weight gradient's block
    y = grouped_mm(x, w, offs)
    grad = torch.ones(R, O, device="cuda", dtype=dtype) if form == "summed" else \
        torch.randn(R, O, generator=gen).cuda().to(dtype)
    if form == "summed":
        y.sum().backward()
    else:
        y.backward(grad)
    for name, got, want in zip(("output", "input gradient", "weight gradient"), (y, x.grad, w.grad),
                               loop_reference(x.detach(), w.detach(), grad, counts)):
        assert got.dtype == dtype and got.shape == want.shape, name
        scale = float(want.abs().max()) if want.numel() else 1.0
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2 * scale, msg=lambda m: f"{name}: {m}")
    empty = [e for e, n in enumerate(counts) if n == 0]
    assert torch.equal(w.grad[empty], torch.zeros_like(w.grad[empty]))


def check_rows_kernel(device: str, dtype: torch.dtype) -> None:
    """The rows kernel (the forward, and the input gradient as W transposed) against the loop on every
    case; run on the CPU by Triton's interpreter below, whose fp16 dot is right (its bf16 is not)."""
    from minagi.grouped_triton import _rows
    for case, (counts, I, O) in CASES.items():
        gen = torch.Generator().manual_seed(2)
        R, E = sum(counts), len(counts)
        x, grad = torch.randn(R, I, generator=gen), torch.randn(R, O, generator=gen)
        w = torch.randn(E, I, O, generator=gen)
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        want_y, want_dx, _ = loop_reference(x.to(dtype), w.to(dtype), grad.to(dtype), counts)
        on = {"device": device, "dtype": dtype}
        got_y = _rows(x.to(**on), w.to(**on), offs.to(device))
        got_dx = _rows(grad.to(**on), w.to(**on).transpose(1, 2), offs.to(device))
        for name, got, want in (("output", got_y, want_y), ("input gradient", got_dx, want_dx)):
            scale = float(want.abs().max()) if want.numel() else 1.0
            torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=1e-2 * scale,
                                       msg=lambda m: f"{case} {name}: {m}")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter); CI has no triton")
def test_the_rows_kernel_equals_the_loop_in_the_triton_interpreter():
    """Every row of every tile schedule written once and right, on the CPU. (The weight kernel's loop
    over rows loaded from memory is one the interpreter cannot run; the GPU test above covers it.)"""
    root = Path(__file__).resolve().parent.parent
    code = "import sys; sys.path.insert(0, 'tests'); import torch, test_grouped_triton as t; " \
           "t.check_rows_kernel('cpu', torch.float16)"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_ops_refuse_operands_that_do_not_fit_in_one_line():
    """The kernels read memory by the shapes they are given: a mismatch must be an error, not a read
    out of bounds. The checks run before any launch (here on the CPU, where Triton never runs)."""
    pytest.importorskip("triton")
    from minagi.grouped_triton import grouped_mm, weight_grad
    x, offs = torch.zeros(8, 16, dtype=torch.bfloat16), torch.tensor([3, 8], dtype=torch.int32)
    cases = [
        (lambda: grouped_mm(x, torch.zeros(2, 32, 8, dtype=torch.bfloat16), offs), "do not fit"),
        (lambda: grouped_mm(x, torch.zeros(3, 16, 8, dtype=torch.bfloat16), offs), "do not fit"),
        (lambda: grouped_mm(x.float(), torch.zeros(2, 16, 8), offs), "must both be bf16 or fp16"),
        (lambda: grouped_mm(x, torch.zeros(2, 16, 8, dtype=torch.bfloat16), offs.long()), "offsets must be int32"),
        (lambda: weight_grad(x, torch.zeros(7, 8, dtype=torch.bfloat16), offs, 2), "do not fit 2 experts"),
        (lambda: grouped_mm(x, torch.zeros(16, 8, dtype=torch.bfloat16), offs), "w 3-D"),
    ]
    for call, said in cases:
        with pytest.raises(RuntimeError, match=said):
            call()


@pytest.mark.gpu
@needs_gpu
def test_the_probe_passes_minagis_kernel_on_this_gpu():
    answer = probe.probe(torch.device("cuda"), torch.bfloat16, "triton")
    print(f"Triton grouped GEMM probe on {torch.cuda.get_device_name()}: {answer}")
    if torch.cuda.get_device_capability() >= (8, 0) and torch.version.hip is None:
        assert answer.works, answer.why


@pytest.mark.gpu
@needs_gpu
def test_a_whole_step_with_the_triton_path_compiles_once_replays_as_a_cuda_graph_and_equals_eager():
    from test_compile import losses
    from torch._dynamo.utils import counters
    sets = ["pool.dispatch=triton"]
    eager = losses(sets, "cuda", steps=6)
    torch._dynamo.reset()
    counters.clear()
    compiled = losses(sets + ["train.compile=true", "train.compile_mode=reduce-overhead"], "cuda", steps=6)
    breaks, skips = dict(counters["graph_break"]), counters["inductor"]["cudagraph_skips"]
    torch._dynamo.reset()
    assert not breaks and skips == 0, (breaks, skips)  # no host sync, no changing shape: one graph, replayed
    assert compiled == pytest.approx(eager, rel=2e-2)


def test_auto_takes_the_triton_path_only_where_torchs_kernel_is_refused_and_minagis_passes(monkeypatch):
    answers, asked = {}, []

    def fake(kernel):
        def supported(device, dtype, warn=True):
            asked.append((kernel, warn))
            return answers[kernel]
        return supported
    monkeypatch.setattr(dispatch, "native_supported", fake("torch"))
    monkeypatch.setattr(dispatch, "triton_supported", fake("triton"))
    for torch_ok, triton_ok, want in [(True, True, "native"), (False, True, "triton"), (False, False, "grouped")]:
        answers.update(torch=torch_ok, triton=triton_ok)
        assert resolve_dispatch("auto", "cuda", torch.bfloat16) == want
    # quiet while one of them may still be taken; both refusals said when neither is
    assert asked == [("torch", False), ("torch", False), ("triton", False), ("torch", False), ("triton", False),
                     ("torch", True), ("triton", True)]
    assert resolve_dispatch("auto", "cpu", torch.bfloat16) == "grouped"


@pytest.mark.parametrize("capability, hip, want", [((8, 6), None, True), ((9, 0), None, True), ((7, 5), None, False),
                                                   ((8, 6), "6.2", False)], ids=["sm86", "sm90", "sm75", "rocm"])
def test_auto_asks_minagis_kernel_only_of_nvidia_gpus_of_sm80_or_newer(monkeypatch, capability, hip, want):
    asked = []
    monkeypatch.setattr(dispatch, "_has_triton", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(probe, "triton_grouped_mm_works", lambda device, dtype, warn=True: asked.append(warn) or True)
    assert dispatch.triton_supported(torch.device("cuda"), torch.bfloat16) is want
    assert asked == ([True] if want else [])
    assert dispatch.triton_supported(torch.device("cuda"), torch.float32) is False  # tl.dot in fp32 would be tf32


def test_an_explicit_triton_path_runs_where_the_probe_passes_it_and_elsewhere_takes_the_bucketed_path(monkeypatch):
    # The same function: a checkpoint trained on a Triton card loads and writes on the CPU.
    assert resolve_dispatch("triton", "cpu", torch.float32) == "grouped"
    assert resolve_dispatch("triton", "cpu", torch.bfloat16) == "grouped"
    monkeypatch.setattr(dispatch, "_has_triton", lambda: True)
    passes = {"answer": True}
    monkeypatch.setattr(probe, "triton_grouped_mm_works", lambda device, dtype, warn=True: passes["answer"])
    assert resolve_dispatch("triton", "cuda", torch.float32) == "grouped"  # tl.dot in fp32 would be tf32
    assert resolve_dispatch("triton", "cuda", torch.bfloat16) == "triton"
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert resolve_dispatch("triton", "cuda", torch.float16) == "triton"  # asked for on AMD: the probe decides
    passes["answer"] = False
    assert resolve_dispatch("triton", "cuda", torch.bfloat16) == "grouped"
    monkeypatch.setattr(dispatch, "_has_triton", lambda: False)
    passes["answer"] = True
    assert resolve_dispatch("triton", "cuda", torch.bfloat16) == "grouped"


def test_the_probe_refuses_the_kernel_in_one_warning_when_triton_cannot_load(monkeypatch):
    monkeypatch.setattr(probe, "_ANSWERS", {})
    monkeypatch.setattr(probe, "_WARNED", set())
    monkeypatch.setitem(sys.modules, "minagi.grouped_triton", None)  # importing it fails as without Triton
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert probe.triton_grouped_mm_works("cpu", torch.bfloat16) is False
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith("minagi's Triton grouped GEMM cannot load (ModuleNotFoundError")
    assert "the experts take the bucketed path (dispatch \"grouped\")" in said[0]


@pytest.mark.gpu
@needs_gpu
def test_a_frozen_nf4_stack_with_lora_on_the_triton_path_computes_what_the_bucketed_path_does():
    """The rebuilt (dequantized) weight and its LoRA pair go through the same kernels (mm.grouped_mm's gemm)."""
    from minagi.config import ExpertsConfig, ModelConfig, PoolConfig
    from minagi.model import build_model
    cfg = ModelConfig(n_rows=2, d_model=64, n_heads=2, context=16)
    x, y = (torch.randint(0, 11, (4, 16), generator=torch.Generator().manual_seed(s)).cuda() for s in (1, 2))
    got = {}
    for path in ("grouped", "triton"):
        torch.manual_seed(0)
        model = build_model(cfg, PoolConfig(n_experts=8, top_k=2, d_expert=64, dispatch=path), 11, "cuda",
                            experts=ExpertsConfig(frozen=True, lora_rank=8, blocksize=64))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.1)
        assert {pool.path for pool in model.pools()} == {path}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, y)
        (out.loss + out.aux_loss).backward()
        got[path] = (out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if "lora_" in n})
    assert got["triton"][0].item() == pytest.approx(got["grouped"][0].item(), rel=1e-2)
    for name, want in got["grouped"][1].items():
        err = (got["triton"][1][name] - want).norm() / want.norm()
        assert err < 3e-2, f"{name}: relative error {err:.3g}"
