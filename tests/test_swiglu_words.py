"""The packed jiterator kernels' C++ (minagi/swiglu_words.py) compiled with the host's C++ compiler and
held to torch: every 2-byte pattern unpacked, fp32 patterns rounded as torch rounds (ties, subnormals,
overflow), and the three kernels bit for bit against their torch stand-ins. On a GPU the same code
runs through NVRTC or hipRTC, checked there by tests/test_swiglu.py and the run-time probe; here the
bits are checked where CI runs. Skipped without a C++ compiler on PATH."""
import shutil
import subprocess

import numpy as np
import pytest
import torch
from torch import Tensor

from minagi import swiglu_jit, swiglu_words

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}

_HARNESS = r"""
#include <math.h>
#include <stdio.h>
#include <vector>
%s
// argv[1]: f(orward), b(ackward), h (backward without the gate terms), l(ane 0 unpacked), p(laced in lane 0)
int main(int argc, char** argv) {
    char kind = argv[1][0];
    int n_in = kind == 'f' ? 3 : (kind == 'l' || kind == 'p') ? 1 : 4;
    int n_out = kind == 'b' ? 3 : kind == 'h' ? 2 : 1;
    long long n;
    if (fread(&n, 8, 1, stdin) != 1) return 1;
    std::vector<long long> in(n * n_in), out(n * n_out);
    if (fread(in.data(), 8, in.size(), stdin) != in.size()) return 1;
    for (long long i = 0; i < n; ++i) {
        const long long* x = &in[i * n_in];
        long long* y = &out[i * n_out];
        if (kind == 'f') y[0] = minagi_swiglu_forward_packed_FMT<long long>(x[0], x[1], x[2]);
        else if (kind == 'b') minagi_swiglu_backward_packed_FMT<long long>(x[0], x[1], x[2], x[3], y[0], y[1], y[2]);
        else if (kind == 'h') minagi_swiglu_backward_h_packed_FMT<long long>(x[0], x[1], x[2], x[3], y[0], y[1]);
        else if (kind == 'l') y[0] = minagi_fp32_word<long long>(minagi_lane(x[0], 0));
        else y[0] = minagi_place<long long>(minagi_fp32(x[0]), 0);
    }
    fwrite(out.data(), 8, out.size(), stdout);
    return 0;
}
"""


@pytest.fixture(scope="module", params=sorted(DTYPES))
def host(request, tmp_path_factory):
    """(dtype, run): `run(kind, *int64 tensors)` -> the kernel's int64 outputs, broadcast as jiterator does."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    fmt = request.param
    entries = "".join(swiglu_words.entry(swiglu_words.kernel_name(kind, DTYPES[fmt])) for kind in swiglu_words.OUTPUTS)
    folder = tmp_path_factory.mktemp(f"kernels_{fmt}")
    (folder / "k.cpp").write_text(_HARNESS.replace("_FMT<", f"_{fmt}<") % (swiglu_words.helpers(fmt) + entries))
    subprocess.run([compiler, "-std=c++17", "-O1", "-o", str(folder / "k"), str(folder / "k.cpp")], check=True)

    def run(kind: str, *words: Tensor) -> list[Tensor]:
        inputs = torch.stack(torch.broadcast_tensors(*words), dim=-1)  # [..., n_in]
        payload = np.asarray([inputs[..., 0].numel()], np.int64).tobytes() + inputs.numpy().tobytes()
        out = subprocess.run([str(folder / "k"), kind], input=payload, capture_output=True, check=True).stdout
        n_out = {"b": 3, "h": 2}.get(kind, 1)
        got = torch.from_numpy(np.frombuffer(out, np.int64).copy()).view(*inputs.shape[:-1], n_out)
        return [t.contiguous() for t in got.unbind(-1)]
    return DTYPES[fmt], run


def _same(a: Tensor, b: Tensor, dtype: torch.dtype) -> bool:
    """Equal bit for bit as 2-byte lanes of `dtype`, any NaN equal to any NaN (torch's CPU conversion
    and CUDA's write different NaN bits)."""
    a, b = a.contiguous().view(dtype), b.contiguous().view(dtype)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


def test_every_two_byte_pattern_unpacks_to_torchs_fp32(host):
    dtype, run = host
    patterns = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int64)  # lane 0 of a word: its low 16 bits
    got = run("l", patterns & 0xFFFF)[0].to(torch.int32).view(torch.float32)
    want = patterns.to(torch.int16).view(dtype).float()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_fp32_patterns_round_as_torch_rounds(host):
    """Every exponent with random mantissas, each 2-byte value's ties and neighbours, fp16's subnormal ties."""
    dtype, run = host
    gen = torch.Generator().manual_seed(0)
    exponents = torch.arange(256, dtype=torch.int64).repeat_interleave(512)
    mantissas = torch.randint(0, 2 ** 23, (exponents.numel(),), generator=gen)
    signs = torch.randint(0, 2, (exponents.numel(),), generator=gen)
    random = (signs << 31) | (exponents << 23) | mantissas
    values = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int64).to(torch.int16).view(dtype).float()
    values = values[values.isfinite()]
    base = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    step = 1 << (16 if dtype == torch.bfloat16 else 13)  # fp32 ulps between neighbours (normal values)
    near = torch.cat([base + d for d in (step // 2, step // 2 - 1, step // 2 + 1, -step // 2, 1, -1)])
    halves = (torch.arange(2048, dtype=torch.float64) + 0.5) * 2.0 ** -24  # fp16's subnormal (and first normal) ties
    ties = torch.cat([halves, -halves]).float().view(torch.int32).to(torch.int64)
    bits = torch.cat([random, near, ties]) & 0xFFFFFFFF
    got = run("p", bits)[0]
    want = (bits.to(torch.int32).view(torch.float32).to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF)
    assert _same(got & 0xFFFF, want, dtype)
    assert torch.equal(got >> 16, torch.zeros_like(got))  # lane 0 only


def test_the_kernels_equal_their_torch_stand_ins_bit_for_bit(host):
    dtype, run = host
    gen = torch.Generator().manual_seed(11)
    rows, width = 64, 32
    h = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
    h[0, :6] = torch.tensor([float("inf"), -float("inf"), float("nan"), 6e4, -6e4, 1e-7])  # the edges
    h[1, width:width + 3] = torch.tensor([float("inf"), 0.0, -0.0])
    gate = torch.rand(rows, generator=gen) * 2 - 0.5
    # Rows 2-5: act = 128 * 1 * gate exactly (silu(128) is 128 in fp32), so the gate's low bits are the
    # rounding's ties (to even: down, then up) and the values either side of one, in bf16; fp16 keeps
    # 13 more bits, so its ties come from the gates' own patterns below.
    h[2:6, :width], h[2:6, width:] = 128.0, 1.0
    gate[2:6] = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001], dtype=torch.int32).view(torch.float32)
    if dtype == torch.float16:
        gate[2:6] = torch.tensor([0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001], dtype=torch.int32).view(torch.float32)
    grad = torch.randn(rows, width, generator=gen).to(dtype)
    words = swiglu_jit._words(h)
    a, b = words[:, :width // 4], words[:, width // 4:]
    g, grad_w = swiglu_jit._gate_words(gate), swiglu_jit._words(grad)

    def stand_in(kind, *operands):
        return swiglu_words.stand_in(swiglu_words.kernel_name(kind, dtype), swiglu_jit.torch_elementwise, *operands)
    assert _same(run("f", a, b, g)[0], stand_in("forward", a, b, g), dtype)
    got, want = run("b", a, b, grad_w, g), stand_in("backward", a, b, grad_w, g)
    assert _same(got[0], want[0], dtype) and _same(got[1], want[1], dtype)
    terms = [t.view(torch.int32)[..., 0::2].view(torch.float32) for t in (got[2], want[2])]
    assert torch.allclose(*terms, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.equal(got[2] >> 32, torch.zeros_like(got[2]))  # the bits sit in the low half
    got_h = run("h", a, b, grad_w, g)
    assert _same(got_h[0], got[0], dtype) and _same(got_h[1], got[1], dtype)
    # _gate_words leaves each word's high half unwritten: the kernels and their stand-ins read the low 32 bits only
    dirty = (g & 0xFFFFFFFF) | (0x5A5A5A5A << 32)
    assert torch.equal(run("f", a, b, dirty)[0], run("f", a, b, g)[0])
    assert all(torch.equal(x, y) for x, y in zip(run("b", a, b, grad_w, dirty), got))
    assert torch.equal(stand_in("forward", a, b, dirty), stand_in("forward", a, b, g))


def test_each_format_has_its_own_kernel_names():
    names = {swiglu_words.kernel_name(kind, dtype) for kind in swiglu_words.OUTPUTS for dtype in DTYPES.values()}
    assert len(names) == 6
    from torch.cuda.jiterator import _CodeParser  # the entry jiterator will call: the one named
    for name in names:
        assert _CodeParser(swiglu_words.code(name)).function_name == f"minagi_swiglu_{name}"
