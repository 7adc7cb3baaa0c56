"""The jiterator SwiGLU's packed kernels: every operand read as int64 words of 4 half-precision lanes.

TensorIterator vectorises its loads only when every operand is contiguous, and the two halves of h are
not (row stride 2F): read one 2-byte element at a time, minagi's one-lane jiterator kernels reach about
half of Triton's bandwidth (docs/LOG.md, session 15). Viewed as int64 words ([R, F/4] views of the same
memory, strided or not), the same kernels load and store 8 bytes at a time (docs/benchmarks.md §25:
the forward 1.64x on the H200). A kernel unpacks a word's 4 lanes to fp32, computes as the one-lane
kernels do, and packs the results rounded to nearest even, as torch rounds, for the two formats:
  bf16   the top half of an fp32 (8 exponent bits): unpacking is a shift
  fp16   5 exponent bits: unpacked and rounded by hand, subnormals, infinities and NaN included
jiterator gives every operand one type, so the gate goes in as its fp32 bits in an int64 word, and the
gate terms come out as one fp32 sum of a word's 4 lanes in its low 32 bits.

Shapes as minagi/swiglu_jit.py: words a [R, W], b [R, W], grad [R, W], gate g [R, 1]; W = F / 4.
`code(name)` is a kernel's C++ ("forward_packed_bf16", ...); `stand_in` the same kernel as torch ops.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FORMATS", "LANES", "OUTPUTS", "code", "kernel_name", "stand_in"]

LANES = 4  # 2-byte lanes in an int64 word
FORMATS = {torch.bfloat16: "bf16", torch.float16: "f16"}
OUTPUTS = {"forward": 1, "backward": 3, "backward_h": 2}

# Helpers are templates written before the entry: jiterator's parser takes the last
# `template <...> type name(...) {...}` as the entry, and must find a template first.
_FP32_WORDS = """
template <typename T> float minagi_fp32(T word) {
    union { unsigned int u; float f; } v;
    v.u = static_cast<unsigned int>(static_cast<unsigned long long>(word) & 0xFFFFFFFFull);
    return v.f;
}
template <typename T> T minagi_fp32_word(float x) {
    union { float f; unsigned int u; } v;
    v.f = x;
    return static_cast<T>(static_cast<unsigned long long>(v.u));  // in the low 32 bits
}
"""
_LANE_CODE = {
    "bf16": """
template <typename T> float minagi_lane(T word, int lane) {
    union { unsigned int u; float f; } v;  // a bf16 is the top half of an fp32
    v.u = static_cast<unsigned int>((static_cast<unsigned long long>(word) >> (16 * lane)) & 0xFFFFull) << 16;
    return v.f;
}
template <typename T> T minagi_place(float x, int lane) {
    union { float f; unsigned int u; } v;  // x rounded to bf16, nearest-even; NaN as CUDA's 0x7FFF
    v.f = x;
    unsigned int bits = (v.u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FFFu : (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16;
    return static_cast<T>(static_cast<unsigned long long>(bits) << (16 * lane));
}
""",
    "f16": """
template <typename T> float minagi_lane(T word, int lane) {
    unsigned int h = static_cast<unsigned int>((static_cast<unsigned long long>(word) >> (16 * lane)) & 0xFFFFull);
    unsigned int sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    union { unsigned int u; float f; } v;
    if (exponent == 0x1Fu) {
        v.u = sign | 0x7F800000u | (mantissa << 13);             // infinity, NaN
    } else if (exponent != 0) {
        v.u = sign | ((exponent + 112u) << 23) | (mantissa << 13);  // normal: bias 15 -> 127
    } else if (mantissa == 0) {
        v.u = sign;                                               // zero
    } else {                                                      // subnormal: normalised
        unsigned int e = 113u;
        while ((mantissa & 0x400u) == 0) { mantissa <<= 1; --e; }
        v.u = sign | (e << 23) | ((mantissa & 0x3FFu) << 13);
    }
    return v.f;
}
template <typename T> T minagi_place(float x, int lane) {
    union { float f; unsigned int u; } v;  // x rounded to fp16, nearest-even; NaN as CUDA's 0x7FFF
    v.f = x;
    unsigned int sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7FFFFFFFu, h;
    if (a > 0x7F800000u) {
        h = 0x7FFFu;
    } else if (a >= 0x477FF000u) {
        h = sign | 0x7C00u;                                        // from 65520 up: infinity
    } else if (a >= 0x38800000u) {                                 // normal: rebias, round 13 bits off
        h = (a >> 13) - (112u << 10);
        unsigned int rest = a & 0x1FFFu;
        h += (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ? 1u : 0u;
        h |= sign;
    } else if (a >= 0x33000000u) {                                 // subnormal: units of 2^-24
        unsigned int shift = 126u - (a >> 23), mantissa = (a & 0x7FFFFFu) | 0x800000u;
        unsigned int rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        h = mantissa >> shift;
        h += (rest > half || (rest == half && (h & 1u))) ? 1u : 0u;
        h |= sign;
    } else {
        h = sign;                                                  // below 2^-25 (a tie at it: even, 0)
    }
    return static_cast<T>(static_cast<unsigned long long>(h) << (16 * lane));
}
""",
}
_ENTRIES = {
    "forward": """
template <typename T> T minagi_swiglu_forward_packed_FORMAT(T a, T b, T g) {
    float gate = minagi_fp32(g);
    T act = 0;
    for (int lane = 0; lane < 4; ++lane) {
        float x = minagi_lane(a, lane);
        act |= minagi_place<T>(x / (1.0f + expf(-x)) * minagi_lane(b, lane) * gate, lane);
    }
    return act;
}""",
    "backward": """
template <typename T> void minagi_swiglu_backward_packed_FORMAT(T a, T b, T grad, T g, T& grad_a, T& grad_b, T& gate_term) {
    float gate = minagi_fp32(g), term = 0.0f;
    T ga = 0, gb = 0;
    for (int lane = 0; lane < 4; ++lane) {
        float x = minagi_lane(a, lane), s = 1.0f / (1.0f + expf(-x)), silu = x * s;
        float up = minagi_lane(b, lane), gr = minagi_lane(grad, lane), gated = gr * gate;
        ga |= minagi_place<T>(gated * up * s * (1.0f + x * (1.0f - s)), lane);
        gb |= minagi_place<T>(gated * silu, lane);
        term += silu * up * gr;
    }
    grad_a = ga;
    grad_b = gb;
    gate_term = minagi_fp32_word<T>(term);
}""",
    "backward_h": """
template <typename T> void minagi_swiglu_backward_h_packed_FORMAT(T a, T b, T grad, T g, T& grad_a, T& grad_b) {
    float gate = minagi_fp32(g);
    T ga = 0, gb = 0;
    for (int lane = 0; lane < 4; ++lane) {
        float x = minagi_lane(a, lane), s = 1.0f / (1.0f + expf(-x));
        float gated = minagi_lane(grad, lane) * gate;
        ga |= minagi_place<T>(gated * minagi_lane(b, lane) * s * (1.0f + x * (1.0f - s)), lane);
        gb |= minagi_place<T>(gated * x * s, lane);
    }
    grad_a = ga;
    grad_b = gb;
}""",
}


def kernel_name(kind: str, dtype: torch.dtype) -> str:
    """"forward_packed_bf16" and the like: a kernel kind ("forward", "backward", "backward_h") in a format.
    Each format's entry has a name of its own, so a compiled kernel is never mistaken for the other
    format's whatever jiterator's caches key on."""
    return f"{kind}_packed_{FORMATS[dtype]}"


def _split(name: str) -> tuple[str, str]:
    kind, _, fmt = name.rpartition("_packed_")
    return kind, fmt


def code(name: str) -> str:
    """The C++ of the kernel `name` (`kernel_name`'s): its format's helpers, then its entry."""
    kind, fmt = _split(name)
    return _FP32_WORDS + _LANE_CODE[fmt] + _ENTRIES[kind].replace("_FORMAT(", f"_{fmt}(")


def helpers(fmt: str) -> str:
    """A format's helpers alone (the host test compiles them with every entry)."""
    return _FP32_WORDS + _LANE_CODE[fmt]


def entry(name: str) -> str:
    kind, fmt = _split(name)
    return _ENTRIES[kind].replace("_FORMAT(", f"_{fmt}(")


def stand_in(name: str, one_lane, *words: Tensor):
    """The kernel `name` as torch ops: the lanes unpacked, `one_lane(kind, ...)` (the one-lane kernels'
    stand-in) in fp32, the results packed as the kernels pack them, the gate terms summed over a word's
    lanes in fp32."""
    kind, fmt = _split(name)
    dtype = next(d for d, f in FORMATS.items() if f == fmt)
    *halves, g = words
    lanes = [w.contiguous().view(dtype).float() for w in halves]  # [R, F] each
    gate = g.to(torch.int32).view(torch.float32)                  # [R, 1]
    outs = one_lane(kind, *lanes, gate)
    outs = (outs,) if kind == "forward" else outs
    packed = [o.to(dtype).view(torch.int64) for o in outs[:2]]
    if kind == "backward":
        a, b, grad = lanes
        terms = (a * torch.sigmoid(a) * b * grad).view(a.shape[0], -1, LANES).sum(-1)  # [R, F/4] fp32
        packed.append(terms.view(torch.int32).to(torch.int64) & 0xFFFFFFFF)           # the bits in the low half
    return packed[0] if kind == "forward" else tuple(packed)
