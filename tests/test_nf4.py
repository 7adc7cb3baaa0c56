"""The NF4 codec writes bitsandbytes' bytes (golden bytes derived by hand from the rules in
minagi/nf4.py), reconstructs within NF4's error, double-quantizes its absmax within the dynamic map's
step, dequantizes expert subsets bit for bit, and its Triton kernel equals the torch reference."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minagi import nf4
from minagi.nf4 import NF4Packed, dequantize_absmax, dequantize_nf4, dequantize_rows, quantize_nf4

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
ROOT = Path(__file__).resolve().parent.parent
TABLE = np.array(nf4.NF4_TABLE, dtype=np.float32)
MID = (TABLE[:-1] + TABLE[1:]) / np.float32(2)  # the rule's fp32 midpoints
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def up(v):
    return np.nextafter(np.float32(v), np.float32(np.inf))


def packed_list(q):
    return q.packed.tolist()


def relative_error(x, y):
    return ((x.double() - y.double()).norm() / x.double().norm()).item()


# ---------------------------------------------------------------- the code table

def test_the_code_table_is_qloras_normal_map_bit_for_bit():
    """Every test above builds its expectations from nf4.NF4_TABLE, so the table is held here to its
    definition (QLoRA's `create_normal_map(offset=0.9677083, use_extra_value=True)`, as bitsandbytes
    builds it): 8 normal quantiles from the offset to 1/2 on the positive side, 7 on the negative, a 0,
    sorted and divided by the largest, in fp32."""
    offset = 0.9677083
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).float().sort().values
    values /= values.max()
    assert torch.equal(torch.tensor(nf4.NF4_TABLE, dtype=torch.float32).view(torch.int32), values.view(torch.int32))


# ---------------------------------------------------------------- golden bytes

# Shape [3, 11], blocksize 32: block 0 = elements 0..31 crosses two row ends, absmax 2 (x = 2 s, exact);
# block 1 = element 32 alone (partial), absmax 3; 33 elements: 17 bytes, the last low nibble is the pad 7.
# s and its code (midpoints strictly below s): -1 -> 0, .5 -> 12, 0 -> 7, .25 -> 10, -.25 -> 4, .75 -> 14,
# -.5 -> 2, .0625 -> 8, -.03125 -> 7, -.0625 -> 6, .875 -> 15 | -.625 -> 1, .125 -> 9, -.1875 -> 5,
# .3125 -> 11, .5625 -> 13, -.375 -> 3, zeros -> 7, 1 -> 15 (element 31) | -3 * fp32(1/3) -> -1 -> 0.
GOLDEN_X = [-2.0, 1.0, 0.0, 0.5, -0.5, 1.5, -1.0, 0.125, -0.0625, -0.125, 1.75,
            -1.25, 0.25, -0.375, 0.625, 1.125, -0.75, 0.0, 0.0, 0.0, 0.0, 0.0,
            0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, -3.0]
GOLDEN_CODES = [0, 12, 7, 10, 4, 14, 2, 8, 7, 6, 15, 1, 9, 5, 11, 13, 3] + [7] * 14 + [15, 0]
GOLDEN_BYTES = [0x0C, 0x7A, 0x4E, 0x28, 0x76, 0xF1, 0x95, 0xBD, 0x37] + [0x77] * 6 + [0x7F, 0x07]


@pytest.mark.parametrize("dtype", DTYPES)
def test_golden_bytes_with_odd_length_partial_last_block_and_a_block_crossing_rows(dtype):
    x = torch.tensor(GOLDEN_X, dtype=dtype).view(3, 11)
    q = quantize_nf4(x, blocksize=32)
    assert packed_list(q) == GOLDEN_BYTES
    assert q.absmax.tolist() == [2.0, 3.0]
    want = TABLE[GOLDEN_CODES] * np.array([2.0] * 32 + [3.0], dtype=np.float32)  # table * absmax in fp32
    got = dequantize_nf4(q, torch.float32)
    assert got.shape == (3, 11) and got.flatten().tolist() == want.tolist()


def test_golden_bytes_for_ties_at_midpoints_and_values_equal_to_plus_minus_absmax():
    # Block 0, absmax 1: s = x exactly. A midpoint goes to the lower code, the next float up to the upper.
    block0 = [-1.0, MID[7], up(MID[7]), MID[14], up(MID[14]), MID[0], up(MID[0]), 1.0] + [0.0] * 24
    # Block 1, absmax 4 (a power of two: s = x / 4 exactly): +absmax, a tie at MID[3], the float above it, -absmax.
    block1 = [4.0, 4 * MID[3], 4 * up(MID[3]), -4.0] + [0.0] * 28
    q = quantize_nf4(torch.tensor(np.array(block0 + block1, dtype=np.float32)), blocksize=32)
    # codes 0 7 8 14 15 0 1 15 | 15 3 4 0
    assert packed_list(q) == [0x07, 0x8E, 0xF0, 0x1F] + [0x77] * 12 + [0xF3, 0x40] + [0x77] * 14
    assert q.absmax.tolist() == [1.0, 4.0]


@pytest.mark.parametrize("length", [32, 34])
def test_scaling_multiplies_by_the_reciprocal_of_absmax_not_divides(length):
    """A pair where x * (1/absmax) lands above MID[9] but x / absmax on it: code 10, not 9. Checked in a
    full block and in a partial last block (bitsandbytes 0.50's CPU path divides there)."""
    absmax, x = np.float32(2.0924041), np.float32(0.42584872)
    assert x * (np.float32(1) / absmax) > MID[9] and x / absmax == MID[9] and x * (np.float32(1) / absmax) < MID[10]
    values = np.zeros(length, dtype=np.float32)
    values[[0, 1]] = absmax, x
    values[-2:] = absmax, x
    q = quantize_nf4(torch.tensor(values), blocksize=32)
    assert packed_list(q)[0] == 0xFA and packed_list(q)[-1] == 0xFA  # codes 15, 10


def test_an_all_zero_block_is_0x77_with_absmax_zero_and_dequantizes_to_zeros():
    x = torch.ones(4, 24)
    x.view(-1)[32:64] = 0.0  # block 1 of 3
    q = quantize_nf4(x, blocksize=32)
    assert packed_list(q)[16:32] == [0x77] * 16
    assert q.absmax.tolist() == [1.0, 0.0, 1.0]
    assert packed_list(q)[:16] == [0xFF] * 16  # 1 = +absmax -> 15
    zero = quantize_nf4(torch.zeros(3, 7), blocksize=64)
    assert packed_list(zero) == [0x77] * 11 and zero.absmax.tolist() == [0.0]
    assert dequantize_nf4(zero, torch.float32).tolist() == [[0.0] * 7] * 3


def tie_packed() -> NF4Packed:
    """Products table[15] * absmax (and table[0] * absmax) exactly halfway between bf16 and fp16 values."""
    ties = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -11, 1 + 3 * 2 ** -11, 3 * 2 ** -20 * (1 + 2 ** -8)]
    packed = torch.full((16 * len(ties),), 0xF0, dtype=torch.uint8)  # codes 15, 0: +absmax, -absmax
    return NF4Packed(packed=packed, shape=(len(ties), 32), blocksize=32, absmax=torch.tensor(ties))


def test_dequant_rounds_to_nearest_even_in_bf16_and_fp16():
    q = tie_packed()
    bf16 = dequantize_nf4(q, torch.bfloat16).float()[:, :2].tolist()
    assert bf16[0] == [1.0, -1.0]                  # 1 + 2^-8: tie between 1 and 1 + 2^-7 -> even 1
    assert bf16[1] == [1.015625, -1.015625]        # 1 + 3 * 2^-8: tie -> even 1 + 2^-6
    assert bf16[2] == [-1.0, 1.0]
    fp16 = dequantize_nf4(q, torch.float16).float()[:, :2].tolist()
    assert fp16[3] == [1.0, -1.0] and fp16[4] == [1 + 2 ** -9, -(1 + 2 ** -9)]


# ---------------------------------------------------------------- round trip

def test_gaussian_relative_error_at_blocksize_64_is_nf4s():
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    q = quantize_nf4(x)
    assert 0.088 < relative_error(x, dequantize_nf4(q, torch.float32)) < 0.096  # QLoRA-style Gaussian weights: ~0.092 at blocksize 64
    assert relative_error(x, dequantize_nf4(q, torch.bfloat16)) < 0.097


def test_every_blocksize_round_trips_within_half_a_table_step_and_requantizes_to_the_same_bytes():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3001, generator=gen) * torch.rand(5, 1, generator=gen)  # odd length, partial blocks
    half_step = float(np.max(np.diff(TABLE))) / 2
    errors = []
    for blocksize in nf4.BLOCKSIZES:
        q = quantize_nf4(x, blocksize)
        y = dequantize_nf4(q, torch.float32)
        per_element_absmax = q.absmax.repeat_interleave(blocksize)[:x.numel()].view_as(x)
        assert ((x - y).abs() <= half_step * per_element_absmax * (1 + 1e-6)).all(), blocksize
        again = quantize_nf4(y, blocksize)  # y's blocks hold +-absmax exactly and table values elsewhere
        assert torch.equal(again.packed, q.packed) and torch.equal(again.absmax, q.absmax), blocksize
        errors.append(relative_error(x, y))
    assert errors == sorted(errors)  # larger blocks, larger absmax, coarser steps


@pytest.mark.parametrize("blocksize", [16, 48, 96, 8192, 0, -64, 64.0, True, "64"])
def test_other_blocksizes_are_rejected_with_a_one_line_error(blocksize):
    with pytest.raises(ValueError, match="^blocksize must be a power of two from 32 to 4096; got") as caught:
        quantize_nf4(torch.ones(128), blocksize)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("x, message", [
    (torch.arange(64), "x must be a floating-point tensor"),
    (torch.ones(0), r"x must have elements; got shape \[0\]"),
    (torch.tensor([1.0, float("inf")]), "x has inf or nan values"),
    (torch.tensor([float("nan"), 1.0]), "x has inf or nan values"),
])
def test_quantize_rejects_what_nf4_cannot_hold(x, message):
    with pytest.raises(ValueError, match=message):
        quantize_nf4(x)


def test_dequantize_rejects_bad_dtypes_and_backends():
    q = quantize_nf4(torch.ones(64))
    with pytest.raises(ValueError, match="^dtype must be torch.bfloat16, torch.float16 or torch.float32; got torch.float64$"):
        dequantize_nf4(q, torch.float64)
    with pytest.raises(ValueError, match="^backend must be 'torch' or 'triton'; got 'cuda'$"):
        dequantize_nf4(q, backend="cuda")


def test_large_inputs_are_quantized_in_chunks_with_the_same_bytes(monkeypatch):
    x = torch.randn(7, 1000, generator=torch.Generator().manual_seed(2))
    whole = quantize_nf4(x, 64)
    monkeypatch.setattr(nf4, "_QUANTIZE_CHUNK", 256)  # 4 blocks a pass: many passes, a partial one last
    chunked = quantize_nf4(x, 64)
    assert torch.equal(chunked.packed, whole.packed) and torch.equal(chunked.absmax, whole.absmax)


# ---------------------------------------------------------------- double quantization

def test_dynamic_map_follows_its_definition():
    code = nf4.dynamic_map_signed()
    assert code.dtype == torch.float32 and code.numel() == 256
    assert (code[1:] > code[:-1]).all()  # sorted, no repeats
    assert (code < 0).sum() == 127 and (code == 0).sum() == 1 and code[-1] == 1.0
    # the top decade: midpoints of linspace(0.1, 1, 65); the largest is 1 - 0.9/128
    assert code[0].item() == pytest.approx(-(1 - 0.9 / 128), abs=1e-7)
    assert code[-2].item() == pytest.approx(1 - 0.9 / 128, abs=1e-7)
    assert code[128].item() == pytest.approx(0.55e-6, rel=1e-6)  # the smallest positive: 10^-6 * (0.1 + 1) / 2
    torch.testing.assert_close(-code[:127].flip(0), code[128:255], rtol=0, atol=0)  # symmetric but for 1.0


def test_double_quant_absmax_is_within_half_a_dynamic_step_and_keeps_the_reconstruction_error():
    x = torch.randn(96, 1000, generator=torch.Generator().manual_seed(3)) * 0.02  # 1500 blocks: 6 second-level
    single, double = quantize_nf4(x, 64), quantize_nf4(x, 64, double_quant=True)
    assert torch.equal(double.packed, single.packed)
    assert double.offset.item() == single.absmax.mean().item()
    code = nf4.dynamic_map_signed()
    half_step = (code[1:] - code[:-1]).max().item() / 2  # 0.9/128 near +-1
    absmax2 = double.absmax2.repeat_interleave(nf4.DQ_BLOCKSIZE)[:single.n_blocks]
    error = (dequantize_absmax(double) - single.absmax).abs()
    assert (error <= half_step * absmax2 * (1 + 1e-5) + 1e-9).all()
    assert error.max() > 0  # it is lossy: this test sees the second level at all
    e_single = relative_error(x, dequantize_nf4(single, torch.float32))
    e_double = relative_error(x, dequantize_nf4(double, torch.float32))
    assert abs(e_double - e_single) < 0.002 * e_single


def test_storage_bytes_follow_the_formula_4_5_and_4_127_bits_per_element():
    n = 1 << 20
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    single, double = quantize_nf4(x, 64), quantize_nf4(x, 64, double_quant=True)
    assert single.nbytes == n // 2 + 4 * (n // 64)
    assert double.nbytes == n // 2 + n // 64 + 4 * (n // 64 // 256) + 4
    assert single.nbytes * 8 / n == 4.5
    assert round(double.nbytes * 8 / n, 3) == 4.127  # 4 + 8/64 + 32/(64 * 256), plus one offset
    odd = quantize_nf4(torch.ones(3, 1001), 128, double_quant=True)  # 3003 elements, 24 blocks
    assert odd.nbytes == 1502 + 24 + 4 * 1 + 4
    assert {k: tuple(v.shape) for k, v in odd.to_tensors().items()} == {
        "packed": (1502,), "absmax_q": (24,), "absmax2": (1,), "offset": ()}


# ---------------------------------------------------------------- expert subsets

STACKS = [((5, 8, 96), 64, False), ((5, 8, 96), 64, True), ((7, 3072), 32, True), ((3, 2, 4096), 4096, False)]


@pytest.mark.parametrize("shape, blocksize, double_quant", STACKS)
def test_dequantize_rows_equals_the_full_dequant_indexed_bit_for_bit(shape, blocksize, double_quant):
    """Repeated, unsorted experts; (7, 3072) at 32 has experts straddling second-level blocks."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    q = quantize_nf4(x, blocksize, double_quant)
    E = shape[0]
    for index in (torch.tensor([E - 1, 0, E - 1, 1, 2]), torch.tensor([2, 2], dtype=torch.int32), torch.arange(E)):
        for dtype in DTYPES:
            got = dequantize_rows(q, index, dtype)
            assert torch.equal(got, dequantize_nf4(q, dtype)[index.long()]), (index, dtype)
    assert dequantize_rows(q, torch.tensor([], dtype=torch.int64)).shape == (0, *shape[1:])


@pytest.mark.parametrize("shape", [(4, 3, 32), (4, 64), (256,)])
def test_misaligned_expert_sizes_are_a_one_line_error_naming_shape_and_blocksize(shape):
    q = quantize_nf4(torch.ones(shape), 64)
    with pytest.raises(ValueError) as caught:
        dequantize_rows(q, torch.tensor([0]))
    message = str(caught.value)
    assert str(list(shape)) in message and "blocksize 64" in message and "\n" not in message


@pytest.mark.parametrize("index", [torch.tensor([0.0]), torch.tensor([[0]]), [0]])
def test_dequantize_rows_wants_a_1d_integer_index(index):
    q = quantize_nf4(torch.ones(2, 128), 64)
    with pytest.raises(ValueError, match="^index must be a 1-D int64 or int32 tensor"):
        dequantize_rows(q, index)


# ---------------------------------------------------------------- storage and rebuilding

@pytest.mark.parametrize("double_quant", [False, True])
def test_packed_tensors_round_trip_through_a_module_state_dict(double_quant):
    q = quantize_nf4(torch.randn(4, 640, generator=torch.Generator().manual_seed(6)), 128, double_quant)

    def holder(tensors):
        module = torch.nn.Module()
        for name, t in tensors.items():
            module.register_buffer(name, t)
        return module

    fresh = holder({k: torch.zeros_like(v) for k, v in q.to_tensors().items()})
    fresh.load_state_dict(holder(q.to_tensors()).state_dict())
    rebuilt = NF4Packed.from_tensors(dict(fresh.named_buffers()), q.shape, q.blocksize)
    assert rebuilt.double_quant == double_quant
    assert torch.equal(dequantize_nf4(rebuilt), dequantize_nf4(q))
    assert torch.equal(dequantize_nf4(q.to("cpu")), dequantize_nf4(q))


def test_from_tensors_rejects_wrong_missing_or_unknown_tensors():
    q = quantize_nf4(torch.randn(2, 640, generator=torch.Generator().manual_seed(7)), 64)
    dq = quantize_nf4(torch.randn(2, 640, generator=torch.Generator().manual_seed(7)), 64, True)
    cases = [
        ({**q.to_tensors(), "absmax": q.absmax.half()}, r"NF4Packed.absmax: expected a contiguous torch.float32 \[20\]; got torch.float16 \[20\]"),
        ({**q.to_tensors(), "packed": q.packed[:-1]}, r"NF4Packed.packed: expected a contiguous torch.uint8 \[640\]"),
        ({**q.to_tensors(), "packed": torch.stack([q.packed, q.packed], 1)[:, 0]}, "got a non-contiguous torch.uint8"),
        ({**q.to_tensors(), "scale": q.absmax}, r"unknown tensors \['scale'\]"),
        ({"packed": q.packed}, "needs absmax, or all of absmax_q, absmax2 and offset"),
        ({**dq.to_tensors(), "absmax": q.absmax}, "give absmax or"),
        ({k: v for k, v in dq.to_tensors().items() if k != "absmax2"}, "needs absmax, or all of"),
    ]
    for tensors, message in cases:
        with pytest.raises(ValueError, match=message):
            NF4Packed.from_tensors(tensors, (2, 640), 64)
    with pytest.raises(ValueError, match="^blocksize must be"):
        NF4Packed.from_tensors(q.to_tensors(), (2, 640), 100)


# ---------------------------------------------------------------- backend choice

def test_select_dequant_picks_triton_only_on_nvidia_sm80_with_triton(monkeypatch):
    assert nf4.select_dequant("cpu") == "torch"
    monkeypatch.setattr(nf4, "_TRITON_FOUND", True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert nf4.select_dequant("cuda") == "triton" and nf4.select_dequant(torch.device("cuda", 1)) == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    assert nf4.select_dequant("cuda") == "torch"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert nf4.select_dequant("cuda") == "torch"
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(nf4, "_TRITON_FOUND", False)
    assert nf4.select_dequant("cuda") == "torch"


# ---------------------------------------------------------------- the Triton kernel

KERNEL_CASES = [((3, 1000), 64, False), ((7, 65), 32, True), ((5, 4096), 4096, False), ((2, 37), 128, False),
                ((1,), 64, False), ((4, 8192), 64, True), ((3, 4, 2048), 1024, False), ((6, 8, 96), 64, False),
                ((7, 3072), 32, True)]


def check_kernel_matches_reference(device: str) -> None:
    """Full tensors and expert subsets, every output dtype, bit for bit (run by the tests below)."""
    from minagi import nf4_triton
    gen = torch.Generator().manual_seed(8)
    cases = [(quantize_nf4(torch.randn(shape, generator=gen), bs, dq), name)
             for name, (shape, bs, dq) in enumerate(KERNEL_CASES)]
    cases.append((tie_packed(), "ties"))
    for q, name in cases:
        q = q.to(device)
        for dtype in DTYPES:
            want = dequantize_nf4(q, dtype)
            assert torch.equal(dequantize_nf4(q, dtype, backend="triton"), want), (name, dtype)
            if len(q.shape) > 1 and (q.numel // q.shape[0]) % (2 * q.blocksize) == 0:
                index = torch.tensor([q.shape[0] - 1, 0, q.shape[0] - 1, 1 % q.shape[0]], device=device)
                assert torch.equal(dequantize_rows(q, index, dtype, backend="triton"), want[index]), (name, dtype)
    q = quantize_nf4(torch.randn(2, 8192, generator=gen), 4096).to(device)
    tile = nf4_triton.TILE_BYTES
    try:  # a tile smaller than half a block: several programs share one absmax
        nf4_triton.TILE_BYTES = 64
        assert torch.equal(dequantize_nf4(q, backend="triton"), dequantize_nf4(q))
    finally:
        nf4_triton.TILE_BYTES = tile


def run_in_interpreter(code: str) -> subprocess.CompletedProcess:
    """Triton reads TRITON_INTERPRET at import: a fresh process."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter); CI has no triton")
def test_triton_kernel_equals_the_reference_bit_for_bit_in_the_interpreter():
    done = run_in_interpreter("import sys; sys.path.insert(0, 'tests'); import test_nf4 as t; "
                              "t.check_kernel_matches_reference('cpu')")
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_triton_kernel_equals_the_reference_bit_for_bit_on_cuda():
    assert nf4.select_dequant("cuda") == "triton", "the test GPU should be sm80+"
    check_kernel_matches_reference("cuda")
    x = torch.randn(64, 256, 512, device="cuda", dtype=torch.bfloat16)
    for dq in (False, True):
        q = quantize_nf4(x, 64, dq)
        assert torch.equal(dequantize_nf4(q, backend="triton"), dequantize_nf4(q))
        index = torch.randint(0, 64, (20,), device="cuda")
        assert torch.equal(dequantize_rows(q, index, backend="triton"), dequantize_rows(q, index))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_dequantize_rows_on_cuda_needs_no_host_sync_and_replays_in_a_cuda_graph(backend, double_quant):
    q = quantize_nf4(torch.randn(16, 64, 128, device="cuda"), 64, double_quant)
    index = torch.tensor([3, 1, 3, 9], device="cuda")
    dequantize_rows(q, index, backend=backend)  # warm-up: tables made, kernel compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dequantize_rows(q, index, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dequantize_rows(q, index, backend=backend)
    index.copy_(torch.tensor([15, 0, 7, 7], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, dequantize_nf4(q)[index])


# ---------------------------------------------------------------- bitsandbytes as an oracle

def bnb_functional():
    import bitsandbytes.functional as bnb_f
    return bnb_f


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes (an optional oracle)")
@pytest.mark.parametrize("blocksize", nf4.BLOCKSIZES)
def test_bytes_and_values_equal_bitsandbytes_on_cpu(blocksize):
    """Shapes whose last dimension is a multiple of the blocksize: bnb 0.50's CPU dequant is wrong
    for some others (docs/nf4.md)."""
    bnb_f = bnb_functional()
    gen = torch.Generator().manual_seed(blocksize)
    for shape in ((3, 2 * blocksize), (2, 3, blocksize)):
        for dtype in DTYPES:
            x = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
            packed, state = bnb_f.quantize_4bit(x, blocksize=blocksize, quant_type="nf4")
            q = quantize_nf4(x, blocksize)
            assert torch.equal(packed.view(-1), q.packed) and torch.equal(state.absmax, q.absmax), (shape, dtype)
            assert torch.equal(bnb_f.dequantize_4bit(packed, state), dequantize_nf4(q, dtype)), (shape, dtype)


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes (an optional oracle)")
def test_dynamic_map_and_double_quant_agree_with_bitsandbytes():
    """bnb's second-level bytes are not reproducible across its devices: absmax within one map step."""
    bnb_f = bnb_functional()
    assert torch.equal(nf4.dynamic_map_signed(), bnb_f.create_dynamic_map(signed=True))
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(9)) * 0.02
    packed, state = bnb_f.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    q = quantize_nf4(x, 64, double_quant=True)
    assert torch.equal(packed.view(-1), q.packed)
    torch.testing.assert_close(state.offset, q.offset, rtol=1e-6, atol=0)
    torch.testing.assert_close(state.state2.absmax, q.absmax2, rtol=1e-6, atol=0)
    theirs = bnb_f.dequantize_blockwise(state.absmax, state.state2) + state.offset
    step = (nf4.dynamic_map_signed().diff().max() * q.absmax2.max()).item()
    assert (theirs - dequantize_absmax(q)).abs().max().item() <= step
    torch.testing.assert_close(bnb_f.dequantize_4bit(packed, state), dequantize_nf4(q, torch.float32),
                               rtol=0, atol=step)


def test_importing_the_model_and_the_writer_does_not_import_the_compiler():
    """dynamo costs ~1 s to import; a process that never compiles (sample.py, evaluate.py) skips it.
    minagi's one `torch.compiler.disable` is applied when a trace reaches it, not at import."""
    code = "import sys, minagi.model, minagi.sample, minagi.loading; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_tables_made_inside_a_compiled_trace_are_made_outside_its_graph(monkeypatch):
    """The first dequant under torch.compile makes the tables eagerly (a graph break), and the
    compiled dequant's bits are the eager ones; aot_eager: dynamo's part only, no compiler needed."""
    q = quantize_nf4(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)), 64)
    eager = dequantize_nf4(q, torch.float32)
    monkeypatch.setattr(nf4, "_TABLES", {})
    made = []
    real = nf4._make_tables
    monkeypatch.setattr(nf4, "_make_tables", lambda device: made.append(torch.compiler.is_compiling()) or real(device))
    torch._dynamo.reset()
    compiled = torch.compile(lambda packed: dequantize_nf4(packed, torch.float32), backend="aot_eager")
    assert torch.equal(compiled(q), eager) and torch.equal(compiled(q), eager)
    assert made == [False]  # made once, and not while being traced
    torch._dynamo.reset()
