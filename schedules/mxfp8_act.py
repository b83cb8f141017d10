"""MXFP8 activations for the MoE decode GEMVs (the W4A8 variant of
:mod:`schedules.moe_mxfp4_decode_tc`): the activation quantizer, the "fp8" layout of the
MXFP4 expert codes, and the bit recipes the kernel relies on, each with its numpy reference.

**MXFP8 (OCP Microscaling Formats spec v1.0, §5.4 and §6.3):** a row of ``K`` activations
becomes E4M3 elements with one E8M0 scale per 32. For a group with largest magnitude
``amax``, the shared exponent is ``floor(log2(amax)) - 8``, where 8 is E4M3's largest
exponent. Each element ``x / 2^shared`` is rounded to nearest-even E4M3, saturated at ±448.
:func:`quantize_reference` and :func:`quantize_kernel` (CUDA,
``cvt.rn.satfinite.e4m3x2.f32``) implement it. Here the biased shared exponent is clamped to
1..247, so ``2^shared`` is always a normal fp32 (an all-zero group gets byte 1).

**E2M1 -> E4M3 without a table:** with an E2M1 code ``s e1 e0 m`` placed in an E4M3 byte as
sign bit 7 and ``e1 e0 m`` at bits 4-2 (exponent field ``0 0 e1 e0``, mantissa ``m 0 0``),
the byte reads as the E2M1 value times 2^-6. This holds for the normal codes (``2^(e-7)(1 +
m/2)`` against ``2^(e-1)(1 + m/2)``) and for the subnormal one alike (``m/2 · 2^-6``). The
kernel folds the 2^6 into the group's scale factor (:func:`weight_factor`).

**The fp8 code layout ("e2m1-fp8-v1"):** the 64 bytes of a row's K block of 128 inputs are
16 uint32 words. Word ``4q + G`` (lane ``q`` of the mma quad reads words ``4q .. 4q+3`` as one
16-byte load) holds inputs ``32G + 8q .. 32G + 8q + 7`` of scale group ``G``. Within the
word, byte ``j`` has input ``8q + j`` in its low nibble and ``8q + 4 + j`` in its high
nibble, so two masked shifts give the mma's two E4M3 registers:

- :func:`e4m3_lo` gives inputs ``8q + 0..3``;
- :func:`e4m3_hi` gives inputs ``8q + 4..7``.

One ``mma.m16n8k32`` (E4M3) step then takes the 32 inputs of one scale group from the 4
lanes, so each step has a single scale per (row, column). :func:`repack_reference` is the
numpy definition of the layout; :func:`repack_kernel` is the in-place TIR kernel that the
benchmark runs on uploaded ``weight_packed`` tensors.

**Per mma:** one weight scale per row and one activation scale per column. The kernel adds
``c · wf(row) · af(col)`` to fp32 accumulators, both factors by :func:`scale_factor`:
``2^(s-127)`` for the activations, ``2^(s-127+6)`` for the weights (their scale word plus
:data:`WEIGHT_BIAS4`, so weight scale bytes up to :data:`MAX_WEIGHT_SCALE_BYTE` only).

tests/test_mxfp8_act.py checks, on the CPU, the references against torch's and ml_dtypes' E4M3
and the E2M1 table, the TIR recipes (:func:`e4m3_lo`, :func:`e4m3_hi`, :func:`scale_factor`)
and the repack kernel on llvm, and the kernel's register and scale mapping
(``schedules.moe_mxfp4_decode_tc.fp8_*``) lane by lane; the CUDA-only parts (the quantizer
kernel, the mma itself) are checked bit for bit on the H200 by benchmarks/moe.py.

**Status:** measured, not dispatched (benchmarks/moe.py ``run_mxfp8``;
benchmarks/results/moe_decode_mxfp8_h200_2026-11-30.json). On the H200 the W4A8 decode path
runs at 0.80–0.82× / 0.86–0.88× / 0.89–0.90× the speed of the W4A16 path at 1 / 8 / 64 tokens.
Hopper's mma applies no block scale, so each mma's 4 products need 8 fp32 operations of scale
math on the CUDA cores, and halving the activation bytes, which come from L1/L2, does not pay
for that. It also costs accuracy: 7–11% of max|o| against the W4A16 reference on random
activations. docs/DESIGN.md has the details.
"""

from __future__ import annotations

import functools

import numpy as np

LAYOUT = "e2m1-fp8-v1"
"""Name of the fp8 code layout (for a library's ``expert_code_layout`` metadata once the form
is dispatched; the benchmark builds it alone)."""

E4M3_EMAX = 8          # largest unbiased exponent of E4M3 (448 = 1.75 · 2^8)
E4M3_MAX = 448.0
GROUP = 32             # elements per E8M0 scale
SHARED_MIN, SHARED_MAX = 1, 247   # biased shared exponent range this quantizer emits

E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
"""E2M1 code -> value (OCP MX spec v1.0 §5.3.3)."""

LO_MAG, LO_SIGN = 0x1C1C1C1C, 0x80808080


# --------------------------------------------------------------------------- quantizer
def quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP8 (E4M3, E8M0 per 32) of ``x`` along its last axis (numpy, via ml_dtypes' E4M3).

    Args:
        x: float ``[..., K]``, ``K`` a multiple of 32 (bf16 values upcast to fp32).
    Returns:
        ``(codes uint8 [..., K], scales uint8 [..., K/32])``: E4M3 bytes of
        ``x / 2^(s - 127)`` (nearest-even, saturated at ±448) and biased shared exponents
        ``s = clamp(floor(log2(amax)) - 8 + 127, 1, 247)`` per group of 32.
    Raises:
        ValueError: ``K`` not a multiple of 32.
    """
    import ml_dtypes

    x = np.asarray(x, np.float32)
    if x.shape[-1] % GROUP:
        raise ValueError(f"MXFP8 rows must be a multiple of {GROUP} wide, got {x.shape[-1]}")
    g = x.reshape(*x.shape[:-1], -1, GROUP)
    amax = np.abs(g).max(-1)
    biased = (amax.view(np.uint32) >> 23).astype(np.int64) & 0xFF   # floor(log2(amax)) + 127
    s = np.clip(biased - E4M3_EMAX, SHARED_MIN, SHARED_MAX)
    scaled = g * np.exp2(127.0 - s)[..., None].astype(np.float32)
    scaled = np.where(np.isnan(scaled), scaled, np.clip(scaled, -E4M3_MAX, E4M3_MAX))
    codes = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(x.shape)
    return codes, s.astype(np.uint8)


def dequantize_reference(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """fp32 values of MXFP8 codes (ml_dtypes' E4M3 decode times ``2^(s - 127)``).

    Args:
        codes: uint8 ``[..., K]`` E4M3 bytes, ``K`` a multiple of 32.
        scales: uint8 ``[..., K/32]`` E8M0 bytes.
    Returns:
        float32 ``[..., K]``.
    Raises:
        ValueError: the shapes do not pair up (``scales`` not ``codes`` with the last axis / 32).
    """
    import ml_dtypes

    codes, scales = np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)
    if codes.shape[-1] % GROUP or scales.shape != (*codes.shape[:-1], codes.shape[-1] // GROUP):
        raise ValueError(f"MXFP8: codes {codes.shape} need scales {(*codes.shape[:-1], codes.shape[-1] // GROUP)}, "
                         f"got {scales.shape}")
    v = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    f = np.exp2(scales.astype(np.float64) - 127).astype(np.float32)
    return (v.reshape(*v.shape[:-1], -1, GROUP) * f[..., None]).reshape(v.shape)


_E4M3X4 = r"""
__forceinline__ __device__ unsigned k3_e4m3x4(float a, float b, float c, float d) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
  return (unsigned)lo | ((unsigned)hi << 16);
}
"""


@functools.cache
def quantize_kernel(width: int):
    """CUDA TIR kernel (``tirx.is_scheduled``): ``x [n, width]`` bf16 -> ``codes [n, width]``
    uint8 (E4M3), ``scales [n, width/32]`` uint8 (E8M0), as :func:`quantize_reference`
    (a group holding a NaN gets the reference's scale 247; its NaN codes are E4M3 NaN, sign
    as ``cvt`` gives it). One thread per group of 32: four 16-byte loads, the group's amax as
    the integer max of the magnitudes' bits, its biased exponent from those bits,
    ``x · 2^(127 - s)`` (exact), ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+). CUDA only: checked
    bit for bit against torch on the H200 (benchmarks/moe.py ``run_mxfp8``).

    Raises:
        ValueError: ``width`` not a multiple of 32.
    """
    from tvm.backend.cuda.op import cuda_func_call
    from tvm.script import tirx as T

    if width % GROUP:
        raise ValueError(f"MXFP8 rows must be a multiple of {GROUP} wide, got {width}")
    G = width // GROUP

    def bits(xw, i):
        """fp32 bits of bf16 element ``i`` (0..31, unrolled) of the group's 16 words."""
        return (xw[i // 2] << T.uint32(16 - 16 * (i % 2))) & T.uint32(0xFFFF0000)

    def f32(xw, i):
        return T.reinterpret("float32", bits(xw, i))

    @T.prim_func(private=True)
    def mxfp8_quantize(x_h: T.handle, q_h: T.handle, s_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        n = T.int64()
        x = T.match_buffer(x_h, (n, width), "bfloat16")
        q = T.match_buffer(q_h, (n, width), "uint8")
        s = T.match_buffer(s_h, (n, G), "uint8")
        xq = T.decl_buffer((n * width // 2,), "uint32", data=x.data)
        qq = T.decl_buffer((n * width // 4,), "uint32", data=q.data)
        for b in T.thread_binding((n * G + 127) // 128, thread="blockIdx.x"):
            for t in T.thread_binding(128, thread="threadIdx.x"):
                xw = T.alloc_buffer((16,), "uint32", scope="local")
                m = T.alloc_buffer((1,), "float32", scope="local")   # 2^(127-s)
                sb = T.alloc_buffer((2,), "uint32", scope="local")   # [0] bits of amax, [1] s
                if b * 128 + t < n * G:
                    for u in T.unroll(4):
                        for v in T.vectorized(4):
                            xw[u * 4 + v] = xq[(b * 128 + t) * 16 + u * 4 + v]
                    # amax as the integer max of the magnitudes' bits: a NaN (bits above
                    # inf's) wins, as in the reference's max
                    sb[0] = T.uint32(0)
                    for i in T.unroll(32):
                        sb[0] = T.max(sb[0], bits(xw, i) & T.uint32(0x7FFF0000))
                    sb[1] = T.max(T.min((sb[0] >> T.uint32(23)) & T.uint32(0xFF), T.uint32(SHARED_MAX + E4M3_EMAX)),
                                  T.uint32(SHARED_MIN + E4M3_EMAX)) - T.uint32(E4M3_EMAX)
                    m[0] = T.reinterpret("float32", (T.uint32(254) - sb[1]) << T.uint32(23))
                    s[(b * 128 + t) // G, (b * 128 + t) % G] = T.Cast("uint8", sb[1])
                    for w in T.unroll(8):
                        qq[(b * 128 + t) * 8 + w] = cuda_func_call(
                            "k3_e4m3x4", f32(xw, 4 * w) * m[0], f32(xw, 4 * w + 1) * m[0],
                            f32(xw, 4 * w + 2) * m[0], f32(xw, 4 * w + 3) * m[0],
                            source_code=_E4M3X4, return_type="uint32")

    return mxfp8_quantize


# --------------------------------------------------------------------------- code layout
def _nibble_order() -> list[int]:
    """Stored nibble position of checkpoint nibble ``i`` (input ``8q + i`` of the word):
    inputs 0..3 -> low nibbles of bytes 0..3, inputs 4..7 -> their high nibbles."""
    return [2 * i if i < 4 else 2 * (i - 4) + 1 for i in range(8)]


def repack_reference(packed: np.ndarray) -> np.ndarray:
    """Checkpoint-layout codes -> the fp8 layout (numpy; the definition of the layout).

    Args:
        packed: uint8 ``[..., K/2]`` (``weight_packed``, low nibble = even input), ``K`` a
            multiple of 128.
    Returns:
        uint8 array of the same shape: per K block of 128 inputs, word ``4q + G`` = the
        checkpoint word ``4G + q`` (inputs ``32G + 8q ..``) with its nibbles in
        :func:`_nibble_order`.
    Raises:
        ValueError: not uint8, or the last dimension not a multiple of 64 bytes.
    """
    packed = np.ascontiguousarray(packed)
    if packed.dtype != np.uint8 or packed.shape[-1] % 64:
        raise ValueError(f"weight_packed: expected uint8 with a last dimension that is a multiple of 64 "
                         f"(K a multiple of 128), got {packed.dtype} {packed.shape}")
    w = packed.view("<u4").reshape(*packed.shape[:-1], -1, 4, 4)     # [..., kb, G, q]
    w = np.swapaxes(w, -1, -2)                                        # [..., kb, q, G]
    out = np.zeros_like(w)
    for i, p in enumerate(_nibble_order()):
        out |= ((w >> np.uint32(4 * i)) & np.uint32(15)) << np.uint32(4 * p)
    return np.ascontiguousarray(out).reshape(*packed.shape[:-1], -1).view(np.uint8).reshape(packed.shape)


def e4m3_words_reference(stored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Emulation of :func:`e4m3_lo` / :func:`e4m3_hi` on fp8-layout words (uint32 ``[...]``):
    the mma registers of inputs ``0..3`` and ``4..7`` of the word, E4M3 bytes worth the E2M1
    values times 2^-6."""
    w = np.asarray(stored, np.uint32)
    lo = ((w << np.uint32(2)) & np.uint32(LO_MAG)) | ((w << np.uint32(4)) & np.uint32(LO_SIGN))
    hi = ((w >> np.uint32(2)) & np.uint32(LO_MAG)) | (w & np.uint32(LO_SIGN))
    return lo, hi


def e4m3_lo(w):
    """TIR: E4M3 mma register of inputs ``8q + 0..3`` of the fp8-layout word ``w`` (uint32)."""
    from tvm.script import tirx as T

    return ((w << T.uint32(2)) & T.uint32(LO_MAG)) | ((w << T.uint32(4)) & T.uint32(LO_SIGN))


def e4m3_hi(w):
    """TIR: E4M3 mma register of inputs ``8q + 4..7`` of the fp8-layout word ``w`` (uint32)."""
    from tvm.script import tirx as T

    return ((w >> T.uint32(2)) & T.uint32(LO_MAG)) | (w & T.uint32(LO_SIGN))


MAX_WEIGHT_SCALE_BYTE = 248
"""Largest E8M0 weight scale byte the fp8 form reads correctly: :data:`WEIGHT_BIAS4` is added to
the four bytes of a scale word at once, so a byte of 250 or more carries into its neighbour
(and 249 overflows to +inf); E8M0 255 (NaN) is not supported either. The form is not
dispatched; a checkpoint would need :func:`check_weight_scales` first."""

WEIGHT_BIAS4 = 0x06060606
"""Added to a weight scale word (4 E8M0 bytes) before :func:`scale_factor`: the E4M3
placement's 2^6 in each byte's exponent, one integer add for the 4 groups."""


def scale_factor(word, g):
    """TIR fp32 with byte ``g`` (0..3, an unrolled loop variable) of the uint32 ``word`` as its
    biased exponent: ``2^(s - 127)`` for an activation scale word (the quantizer emits bytes
    1..247: always a normal fp32), ``2^(s - 127 + 6)`` for a weight scale word with
    :data:`WEIGHT_BIAS4` added (bytes up to :data:`MAX_WEIGHT_SCALE_BYTE`). A shift pair and a
    mask (nvcc folds the shifts once ``g`` is a constant)."""
    from tvm.script import tirx as T

    return T.reinterpret("float32", ((word >> T.Cast("uint32", 8 * g)) << T.uint32(23)) & T.uint32(0x7F800000))


def scale_factor_reference(words: np.ndarray) -> np.ndarray:
    """numpy twin of :func:`scale_factor`: uint32 ``[...]`` -> fp32 ``[..., 4]`` (byte g's factor)."""
    w = np.asarray(words, np.uint32)
    return np.stack([(((w >> np.uint32(8 * g)) << np.uint32(23)) & np.uint32(0x7F800000)).view(np.float32)
                     for g in range(4)], -1)


def check_weight_scales(scale: np.ndarray, name: str) -> None:
    """Raise if a ``weight_scale`` tensor holds an E8M0 byte the fp8 form cannot scale by.

    Raises:
        ValueError: a byte over :data:`MAX_WEIGHT_SCALE_BYTE` (255, NaN, included), with the
            tensor's name and the byte's index.
    """
    from schedules.mxfp4_tc_layout import raise_first_bad

    s = np.asarray(scale)
    raise_first_bad(s, s > MAX_WEIGHT_SCALE_BYTE, name,
                    f"the MXFP8-activation GEMVs take bytes up to {MAX_WEIGHT_SCALE_BYTE} (no NaN)")


@functools.cache
def repack_kernel(gpu: bool = False):
    """In-place TIR kernel: ``weight_packed`` uint8 ``[e, n, kh]`` (``kh`` a multiple of 64)
    from the checkpoint layout to the fp8 layout (:func:`repack_reference`), one K block of
    16 words per thread (a transpose of its 4 × 4 words, then the nibble order).
    ``gpu``: 256 threads per block."""
    from tvm.script import tirx as T

    from schedules.mxfp4_tc_layout import inplace_words_kernel

    order = _nibble_order()
    shifts: dict[int, int] = {}
    for i, p in enumerate(order):
        shifts[4 * (p - i)] = shifts.get(4 * (p - i), 0) | (15 << (4 * i))

    def permute(w):
        acc = None
        for sh, m in sorted(shifts.items()):
            x = w & T.uint32(m)
            x = x << T.uint32(sh) if sh > 0 else (x >> T.uint32(-sh) if sh < 0 else x)
            acc = x if acc is None else acc | x
        return acc

    @T.macro
    def block(words, kb):
        buf = T.alloc_buffer((16,), "uint32", scope="local")
        for i in T.unroll(16):
            buf[i] = words[kb * 16 + i]
        for q in T.unroll(4):
            for g in T.unroll(4):
                words[kb * 16 + 4 * q + g] = permute(buf[4 * g + q])

    return inplace_words_kernel(16, block, gpu)
