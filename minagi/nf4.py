"""NF4 codec: 4-bit NormalFloat with bitsandbytes' byte layout, written from its definition.

Shapes: x any shape with n elements, flattened row-major; blocksize B; nb = ceil(n / B) blocks
(a block may cross rows, the last may be partial); packed [ceil(n/2)] uint8; absmax [nb] fp32.
Double quantization: absmax_q [nb] uint8, absmax2 [ceil(nb / 256)] fp32, offset [] fp32.
A stack of experts [E, ...] with P elements per expert: packed_EP2 [E, P/2], absmax_EN [E, P/B];
index_K picks K experts (any order, repeats allowed) -> [K, ...].

Rules (docs/nf4.md has them in full, with the storage formula):
  quantize  s = clamp(x * (1 / absmax.clamp(min=1e-38)), -1, 1) in fp32; code = number of fp32
            midpoints of the table strictly below s (ties go to the lower code); element 2i in the
            high nibble, 2i+1 in the low one; an odd length pads nibble 7 (the code of 0).
  dequant   table[code] * absmax in fp32, then one cast (round to nearest even) to the output dtype.
  double    offset = mean(absmax); absmax - offset quantized in blocks of 256 to bnb's signed
            8-bit dynamic map; back as table2[q] * absmax2, then + offset: two fp32 ops, no fused
            multiply-add, so any implementation gets the same bits.

Two dequantizers, one function: `backend="torch"` (the reference, any device) and
`backend="triton"` (minagi/nf4_triton.py, bitwise equal). `select_dequant(device)` picks one by
capability, once, when a caller builds its frozen stack.
"""
from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BLOCKSIZES", "DQ_BLOCKSIZE", "NF4_TABLE", "NF4Packed", "dequantize_absmax", "dequantize_nf4",
           "dequantize_rows", "double_quantize_absmax", "dynamic_map_signed", "quantize_nf4", "select_dequant"]

# bitsandbytes' NF4 table: index -> value, exactly these fp32 numbers.
NF4_TABLE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DQ_BLOCKSIZE = 256  # the second level's blocks (bitsandbytes' compress_statistics)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Backend = Literal["torch", "triton"]
_QUANTIZE_CHUNK = 1 << 24  # elements per pass: bounds quantize's fp32 temporaries on a large stack


def dynamic_map_signed() -> Tensor:
    """bitsandbytes' `create_dynamic_map(signed=True)` (7 exponent bits, 8 bits), from its definition:
    for decades 10^-6 .. 10^0, decade i contributes the 2^i midpoints of linspace(0.1, 1, 2^i + 1)
    times 10^(i-6), with both signs; then 0 and 1. 256 fp32 values, sorted."""
    values = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32, device="cpu")  # the same bits anywhere
        means = (edges[:-1] + edges[1:]) / 2.0
        values += (10 ** (i - 6) * means).tolist() + (-(10 ** (i - 6)) * means).tolist()
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32, device="cpu")


_TABLES: dict[torch.device, tuple[Tensor, Tensor, Tensor, Tensor]] = {}


def _tables(device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(nf4 table, its midpoints, dynamic map, its midpoints) on `device`, fp32. Kept: a CUDA graph
    capture must not copy from the host, so the first (warm-up) call makes them. A plain dict, not
    functools.cache: torch.compile traces through a cache wrapper and would rebuild them each call."""
    tables = _TABLES.get(device)
    if tables is None:
        # Made outside any graph being traced. The disable is applied here, not as a decorator:
        # `torch.compiler.disable` imports dynamo (~1 s), which a process that never compiles skips.
        make = torch.compiler.disable(_make_tables) if torch.compiler.is_compiling() else _make_tables
        tables = _TABLES[device] = make(device)
    return tables


def _make_tables(device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    nf4 = torch.tensor(NF4_TABLE, dtype=torch.float32, device="cpu")
    dyn = dynamic_map_signed()
    out = (nf4, (nf4[:-1] + nf4[1:]) / 2, dyn, (dyn[:-1] + dyn[1:]) / 2)  # midpoints in fp32
    return tuple(t.to(device) for t in out)


@dataclass(frozen=True, eq=False)
class NF4Packed:
    """A quantized tensor. Exactly one of `absmax` or the double-quant triple is set.

    The tensors are what a module keeps as buffers (`to_tensors`); `shape` and `blocksize` are
    configuration, so `from_tensors(tensors, shape, blocksize)` rebuilds the object after a
    state_dict load.
    """
    packed: Tensor                  # uint8 [ceil(n/2)]
    shape: tuple[int, ...]
    blocksize: int
    absmax: Tensor | None = None    # fp32 [nb]
    absmax_q: Tensor | None = None  # uint8 [nb]
    absmax2: Tensor | None = None   # fp32 [ceil(nb / 256)]
    offset: Tensor | None = None    # fp32 []

    def __post_init__(self):
        _check_blocksize(self.blocksize)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        n, nb = self.numel, self.n_blocks
        _check_tensor("packed", self.packed, torch.uint8, ((n + 1) // 2,))
        if self.absmax is not None:
            if any(t is not None for t in (self.absmax_q, self.absmax2, self.offset)):
                raise ValueError("NF4Packed: give absmax or (absmax_q, absmax2, offset), not both")
            _check_tensor("absmax", self.absmax, torch.float32, (nb,))
        elif any(t is None for t in (self.absmax_q, self.absmax2, self.offset)):
            raise ValueError("NF4Packed: needs absmax, or all of absmax_q, absmax2 and offset")
        else:
            _check_tensor("absmax_q", self.absmax_q, torch.uint8, (nb,))
            _check_tensor("absmax2", self.absmax2, torch.float32, (-(-nb // DQ_BLOCKSIZE),))
            _check_tensor("offset", self.offset, torch.float32, ())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_blocks(self) -> int:
        return -(-self.numel // self.blocksize)

    @property
    def double_quant(self) -> bool:
        return self.absmax is None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes stored: 4 + 32/B bits per element, or 4 + 8/B + 32/(256 B) with double quant."""
        return sum(t.numel() * t.element_size() for t in self.to_tensors().values())

    def to_tensors(self) -> dict[str, Tensor]:
        names = ("packed", "absmax_q", "absmax2", "offset") if self.double_quant else ("packed", "absmax")
        return {name: getattr(self, name) for name in names}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor], shape, blocksize: int) -> NF4Packed:
        known = {"packed", "absmax", "absmax_q", "absmax2", "offset"}
        unknown = sorted(set(tensors) - known)
        if unknown:
            raise ValueError(f"NF4Packed.from_tensors: unknown tensors {unknown}; valid: {sorted(known)}")
        return cls(shape=tuple(shape), blocksize=blocksize, **tensors)

    def to(self, device, non_blocking: bool = False) -> NF4Packed:
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.to_tensors().items()}
        return NF4Packed.from_tensors(moved, self.shape, self.blocksize)


def _check_blocksize(blocksize) -> None:
    if not isinstance(blocksize, int) or isinstance(blocksize, bool) or blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be a power of two from 32 to 4096; got {blocksize!r}")


def _check_tensor(name: str, t, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor) or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
        got = type(t).__name__
        if isinstance(t, Tensor):
            got = f"{'' if t.is_contiguous() else 'a non-contiguous '}{t.dtype} {list(t.shape)}"
        raise ValueError(f"NF4Packed.{name}: expected a contiguous {dtype} {list(shape)}; got {got}")


def _check_dtype(dtype) -> None:
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32; got {dtype}")


def _check_backend(backend) -> None:
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton'; got {backend!r}")


# ---------------------------------------------------------------- quantize

def _blockwise_codes(values: Tensor, blocksize: int, midpoints: Tensor) -> tuple[Tensor, Tensor]:
    """[m] -> (codes uint8 [nb * blocksize], zero-padded at the end; absmax fp32 [nb])."""
    m = values.numel()
    nb = -(-m // blocksize)
    v = F.pad(values.float(), (0, nb * blocksize - m)).view(nb, blocksize)  # zeros: no effect on absmax
    absmax = v.abs().amax(dim=1)
    s = (v * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp(-1, 1)  # the reciprocal, as bnb does
    # bucketize (right=False) returns the number of midpoints strictly below s: ties to the lower code.
    return torch.bucketize(s, midpoints, out_int32=True).to(torch.uint8).view(-1), absmax


def quantize_nf4(x: Tensor, blocksize: int = 64, double_quant: bool = False) -> NF4Packed:
    """Any floating tensor (on any device) -> NF4Packed on the same device."""
    _check_blocksize(blocksize)
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor; got {getattr(x, 'dtype', type(x).__name__)}")
    if x.numel() == 0:
        raise ValueError(f"x must have elements; got shape {list(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x has inf or nan values: NF4 cannot represent them")
    flat = x.detach().reshape(-1)
    n, nb = flat.numel(), -(-flat.numel() // blocksize)
    nf4_mid = _tables(x.device)[1]
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(nb, dtype=torch.float32, device=x.device)
    step = max(1, _QUANTIZE_CHUNK // blocksize) * blocksize  # whole blocks, so whole bytes
    for start in range(0, n, step):
        part = flat[start:start + step]
        codes, part_absmax = _blockwise_codes(part, blocksize, nf4_mid)
        codes = codes[:2 * ((part.numel() + 1) // 2)]  # an odd length keeps one pad code (7)
        absmax[start // blocksize:start // blocksize + part_absmax.numel()] = part_absmax
        packed[start // 2:start // 2 + codes.numel() // 2] = (codes[0::2] << 4) | codes[1::2]
    if not double_quant:
        return NF4Packed(packed=packed, shape=tuple(x.shape), blocksize=blocksize, absmax=absmax)
    return NF4Packed(packed=packed, shape=tuple(x.shape), blocksize=blocksize, **double_quantize_absmax(absmax))


def double_quantize_absmax(absmax: Tensor) -> dict[str, Tensor]:
    """fp32 absmax [nb] -> {absmax_q [nb] uint8, absmax2 [ceil(nb/256)] fp32, offset [] fp32}."""
    _, _, _, dyn_mid = _tables(absmax.device)
    offset = absmax.mean()
    codes, absmax2 = _blockwise_codes(absmax - offset, DQ_BLOCKSIZE, dyn_mid)
    return {"absmax_q": codes[:absmax.numel()], "absmax2": absmax2, "offset": offset}


# ---------------------------------------------------------------- dequantize

def _absmax_from_codes(absmax_q: Tensor, blocks: Tensor, absmax2: Tensor, offset: Tensor) -> Tensor:
    """Second-level codes of global blocks `blocks` (same shape) -> fp32 absmax, in two ops."""
    _, _, dyn, _ = _tables(absmax_q.device)
    scaled = dyn[absmax_q.int()] * absmax2[blocks // DQ_BLOCKSIZE]
    return scaled + offset  # a separate add: no fused multiply-add, the bits match any backend


def dequantize_absmax(q: NF4Packed) -> Tensor:
    """fp32 [nb]: the absmax as stored, or rebuilt from the double quantization."""
    if not q.double_quant:
        return q.absmax
    blocks = torch.arange(q.n_blocks, device=q.device)
    return _absmax_from_codes(q.absmax_q, blocks, q.absmax2, q.offset)


def _dequant_torch(packed: Tensor, absmax: Tensor, blocksize: int, n_out: int, dtype: torch.dtype) -> Tensor:
    """The reference. packed [..., bytes], absmax [..., nb] (rows of equal size) -> [..., n_out]."""
    nf4 = _tables(packed.device)[0]
    lead, n_bytes, nb = packed.shape[:-1], packed.shape[-1], absmax.shape[-1]
    codes = torch.stack((packed >> 4, packed & 15), dim=-1).view(*lead, 2 * n_bytes)
    if nb * blocksize > 2 * n_bytes:  # a partial last block
        codes = F.pad(codes, (0, nb * blocksize - 2 * n_bytes), value=7)
    values = nf4[codes.int()].view(*lead, nb, blocksize) * absmax.unsqueeze(-1)  # fp32
    return values.view(*lead, nb * blocksize)[..., :n_out].to(dtype)  # round to nearest even


def dequantize_nf4(q: NF4Packed, dtype: torch.dtype = torch.bfloat16, *, backend: Backend = "torch") -> Tensor:
    """NF4Packed -> q.shape in `dtype`. backend="torch" is the reference; "triton" the fast kernel."""
    _check_dtype(dtype)
    _check_backend(backend)
    absmax = dequantize_absmax(q)
    if backend == "triton":
        table = _tables(q.device)[0]
        out = _triton().dequantize(q.packed.view(1, -1), absmax.view(1, -1), table, q.blocksize, q.numel, dtype)
    else:
        out = _dequant_torch(q.packed, absmax, q.blocksize, q.numel, dtype)
    return out.view(q.shape)


def _per_expert(q: NF4Packed) -> int:
    """Elements per expert of a stack [E, ...]; they must fill whole bytes and whole blocks."""
    per = math.prod(q.shape[1:])
    if len(q.shape) < 2 or per % (2 * q.blocksize):
        raise ValueError(f"dequantize_rows: shape {list(q.shape)} with blocksize {q.blocksize}: each expert's "
                         f"element count must be a multiple of 2 * blocksize ({2 * q.blocksize})")
    return per


def _rows_absmax(q: NF4Packed, index_K: Tensor, per: int) -> Tensor:
    """fp32 [K, P/B]: only the chosen experts' absmax entries (and second-level entries)."""
    blocks_per = per // q.blocksize
    if not q.double_quant:
        return q.absmax.view(-1, blocks_per).index_select(0, index_K)
    absmax_q = q.absmax_q.view(-1, blocks_per).index_select(0, index_K)
    blocks = index_K.long().unsqueeze(1) * blocks_per + torch.arange(blocks_per, device=q.device)
    return _absmax_from_codes(absmax_q, blocks, q.absmax2, q.offset)


def dequantize_rows(q: NF4Packed, index: Tensor, dtype: torch.dtype = torch.bfloat16, *,
                    backend: Backend = "torch") -> Tensor:
    """Experts `index` of a stack q [E, ...] -> [K, ...]; equal to dequantize_nf4(q)[index], bit for bit.

    Reads only the chosen experts' bytes and absmax entries, and never syncs with the host (index
    stays on the device: CUDA-graph capturable once the tables exist, i.e. after one warm-up call).
    """
    _check_dtype(dtype)
    _check_backend(backend)
    per = _per_expert(q)
    if not isinstance(index, Tensor) or index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"index must be a 1-D int64 or int32 tensor of expert numbers; got "
                         f"{getattr(index, 'dtype', type(index).__name__)} {list(getattr(index, 'shape', []))}")
    packed_EP2 = q.packed.view(-1, per // 2)
    if backend == "triton" and not q.double_quant:  # the kernel reads the chosen experts' absmax itself
        out = _triton().dequantize(packed_EP2, q.absmax.view(-1, per // q.blocksize), _tables(q.device)[0],
                                   q.blocksize, per, dtype, index=index, absmax_by_index=True)
    elif backend == "triton":
        out = _triton().dequantize(packed_EP2, _rows_absmax(q, index, per), _tables(q.device)[0],
                                   q.blocksize, per, dtype, index=index)
    else:
        out = _dequant_torch(packed_EP2.index_select(0, index), _rows_absmax(q, index, per), q.blocksize,
                             per, dtype)
    return out.view(index.numel(), *q.shape[1:])


# ---------------------------------------------------------------- backend choice

_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def select_dequant(device: torch.device | str) -> Backend:
    """'triton' on NVIDIA CUDA sm80+ with triton installed, else 'torch' (CPU, ROCm: the kernel has
    not been run on an AMD GPU). Decided once, when a caller builds its frozen stack."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None or not _TRITON_FOUND:
        return "torch"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "triton" if torch.cuda.get_device_capability(index) >= (8, 0) else "torch"


_TRITON_MODULE = None


def _triton():
    """Import the kernel on first use: importing triton is slow, and CPU runs never need it."""
    global _TRITON_MODULE
    if _TRITON_MODULE is None:
        from . import nf4_triton
        _TRITON_MODULE = nf4_triton
    return _TRITON_MODULE
