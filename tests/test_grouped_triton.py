"""minagi/grouped_triton.py and the dispatch path "triton": minagi's own grouped GEMM against a loop of
matmuls, in the output and both gradients; the path chosen by `auto` only where its probe passes; a
whole step with it compiled as one graph and replayed as a CUDA graph. The kernels need a CUDA GPU
with Triton; the choices around them are tested on the CPU."""
import sys
import warnings

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
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w-transposed"])
def test_the_kernels_equal_a_loop_of_matmuls_in_output_and_both_gradients(case, transposed):
    from minagi.grouped_triton import grouped_mm
    counts, I, O = CASES[case]
    gen = torch.Generator().manual_seed(1)
    R, E = sum(counts), len(counts)
    x = torch.randn(R, I, generator=gen).cuda().bfloat16().requires_grad_()
    w_full = torch.randn(E, O, I, generator=gen).cuda().bfloat16() if transposed else \
        torch.randn(E, I, O, generator=gen).cuda().bfloat16()
    w = (w_full.transpose(1, 2) if transposed else w_full).detach().requires_grad_()  # a strided view when transposed
    grad = torch.randn(R, O, generator=gen).cuda().bfloat16()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    y = grouped_mm(x, w, offs)
    y.backward(grad)
    for name, got, want in zip(("output", "input gradient", "weight gradient"), (y, x.grad, w.grad),
                               loop_reference(x.detach(), w.detach(), grad, counts)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape, name
        err = (got.float().cpu() - want.cpu()).norm() / want.norm().clamp(min=1e-6)
        assert err < 1e-2, f"{name}: relative error {err:.3g}"
        if name == "weight gradient":  # an expert without rows gets zeros, not what the memory held
            empty = [e for e, n in enumerate(counts) if n == 0]
            assert not got[empty].any()


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
    answers = {}
    monkeypatch.setattr(dispatch, "native_supported", lambda device, dtype: answers["torch"])
    monkeypatch.setattr(dispatch, "triton_supported", lambda device, dtype: answers["triton"])
    for torch_ok, triton_ok, want in [(True, True, "native"), (False, True, "triton"), (False, False, "grouped")]:
        answers.update(torch=torch_ok, triton=triton_ok)
        assert resolve_dispatch("auto", "cuda", torch.bfloat16) == want
    assert resolve_dispatch("auto", "cpu", torch.bfloat16) == "grouped"


def test_an_explicit_triton_path_where_it_cannot_run_takes_the_bucketed_path(monkeypatch):
    # The same function: a checkpoint trained on a Triton card loads and writes on the CPU.
    assert resolve_dispatch("triton", "cpu", torch.float32) == "grouped"
    assert resolve_dispatch("triton", "cpu", torch.bfloat16) == "grouped"
    monkeypatch.setattr(dispatch, "_has_triton", lambda: True)
    assert resolve_dispatch("triton", "cuda", torch.float32) == "grouped"  # tl.dot in fp32 would be tf32
    assert resolve_dispatch("triton", "cuda", torch.bfloat16) == "triton"
    monkeypatch.setattr(dispatch, "_has_triton", lambda: False)
    assert resolve_dispatch("triton", "cuda", torch.bfloat16) == "grouped"


def test_the_probe_refuses_the_kernel_in_one_warning_when_triton_cannot_load(monkeypatch):
    monkeypatch.setattr(probe, "_ANSWERS", {})
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
