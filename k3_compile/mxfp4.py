"""MXFP4 weights: OCP Microscaling FP4 as stored by compressed-tensors ``mxfp4-pack-quantized``.

Spec §2. A weight ``W`` of shape ``[..., out, in]`` (``in`` a multiple of 32) is stored as

* ``weight_packed``: uint8 ``[..., out, in/2]``. Byte ``j`` of a row holds two 4-bit E2M1
  codes: the **low nibble is column 2j, the high nibble column 2j+1** (compressed-tensors
  ``pack_fp4_to_uint8`` / ``unpack_fp4_from_uint8``; tested bit-exactly against them).
* ``weight_scale``: uint8 ``[..., out, in/32]``, one E8M0 byte ``s`` per 32 consecutive
  input columns: scale ``2**(s - 127)``; ``s == 255`` is NaN (OCP MX spec v1.0 §5.4.1).

An E2M1 code is ``sign(bit 3) | exponent(bits 2-1) | mantissa(bit 0)``; magnitudes of codes
0..7 are ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (:data:`E2M1_VALUES`, codes 8..15 are the negatives,
code 8 is -0.0).  ``W[o, i] = E2M1_VALUES[code[o, i]] * 2**(scale[o, i // 32] - 127)``.

Every function accepts arbitrary leading dimensions (e.g. experts stacked as
``[E, out, in/2]``) and raises :class:`ValueError` naming the argument and what was expected.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

GROUP_SIZE = 32
"""Elements sharing one E8M0 scale (OCP MX block size)."""

E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_EMAX = 2
"""Exponent of the largest E2M1 power of two (4 = 2**2); the OCP scale offset."""

E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
"""Value of each of the 16 E2M1 codes (index = 4-bit code; bit 3 is the sign)."""

_MAGNITUDES = E2M1_VALUES[:8].astype(np.float64)

ScaleRule = Literal["compressed-tensors", "ocp"]


def _as_uint8(a, what: str, min_ndim: int = 1) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.uint8:
        raise ValueError(f"{what}: expected dtype uint8, got {a.dtype}")
    if a.ndim < min_ndim:
        raise ValueError(f"{what}: expected at least {min_ndim} dimension(s), got shape {a.shape}")
    return a


def _check_pair(packed, scale) -> tuple[np.ndarray, np.ndarray]:
    packed = _as_uint8(packed, "weight_packed")
    scale = _as_uint8(scale, "weight_scale")
    in_f = packed.shape[-1] * 2
    if in_f % GROUP_SIZE:
        raise ValueError(
            f"weight_packed: shape {packed.shape} gives in = {in_f} columns, which is not a "
            f"multiple of the MXFP4 group size {GROUP_SIZE}"
        )
    want = packed.shape[:-1] + (in_f // GROUP_SIZE,)
    if scale.shape != want:
        raise ValueError(
            f"weight_scale: expected shape {want} (= weight_packed {packed.shape} with the last "
            f"dim in/{GROUP_SIZE}), got {scale.shape}"
        )
    return packed, scale


def unpack_codes(packed) -> np.ndarray:
    """Split each byte into its two E2M1 codes.

    Args:
        packed: uint8 ``[..., n]``.
    Returns:
        uint8 ``[..., 2n]`` of 4-bit codes; ``out[..., 2j] = packed[..., j] & 0xF`` (low
        nibble) and ``out[..., 2j+1] = packed[..., j] >> 4`` (compressed-tensors order).
    Raises:
        ValueError: ``packed`` is not uint8 or is 0-dimensional.
    """
    packed = _as_uint8(packed, "weight_packed")
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def pack_codes(codes) -> np.ndarray:
    """Inverse of :func:`unpack_codes`: uint8 codes ``[..., 2n]`` (each < 16) -> ``[..., n]``.

    Raises:
        ValueError: not uint8, odd last dimension, or a code >= 16.
    """
    codes = _as_uint8(codes, "codes")
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dimension must be even, got shape {codes.shape}")
    if codes.size and codes.max() > 15:
        raise ValueError(f"codes: E2M1 codes are 4-bit (0..15), found {int(codes.max())}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def e8m0_to_float(scale, dtype=np.float32) -> np.ndarray:
    """E8M0 bytes -> ``2**(s - 127)`` in ``dtype`` (NaN where ``s == 255``).

    ``dtype`` float32 represents every scale but 2**128 (s = 255 is NaN anyway); scales
    below 2**-126 are float32 subnormals and are exact.
    """
    scale = _as_uint8(scale, "weight_scale", min_ndim=0)
    out = np.ldexp(np.float64(1.0), scale.astype(np.int32) - E8M0_BIAS)
    out = np.where(scale == E8M0_NAN, np.nan, out)
    return out.astype(dtype)


def dequantize(packed, scale, dtype=np.float32) -> np.ndarray:
    """Reference MXFP4 dequantizer.

    Args:
        packed: uint8 ``[..., out, in/2]`` (``weight_packed``).
        scale: uint8 ``[..., out, in/32]`` (``weight_scale``, E8M0).
        dtype: output dtype (float32, float64, or ``ml_dtypes.bfloat16``; the product is
            formed in float64, exact, then rounded once to ``dtype``).
    Returns:
        ``[..., out, in]`` array: ``E2M1_VALUES[code] * 2**(s - 127)``; a whole block is NaN
        where its scale byte is 255. Values beyond ``dtype``'s range become ±inf (only for
        s >= 253 in float32).
    Raises:
        ValueError: wrong dtypes, ``in`` not a multiple of 32, or mismatched shapes.
    Source: spec §2; OCP MX v1.0 §5.
    """
    packed, scale = _check_pair(packed, scale)
    vals = E2M1_VALUES.astype(np.float64)[unpack_codes(packed)]
    blocks = vals.reshape(vals.shape[:-1] + (-1, GROUP_SIZE))
    s = e8m0_to_float(scale, np.float64)[..., None]
    with np.errstate(over="ignore", invalid="ignore"):
        return (blocks * s).reshape(vals.shape).astype(dtype)


def _round_e2m1(mag: np.ndarray) -> np.ndarray:
    """Magnitudes (float64, >= 0, already clamped to <= 6) -> E2M1 magnitude codes 0..7,
    round to nearest, ties to the even code (= even mantissa bit, IEEE RNE)."""
    hi = np.searchsorted(_MAGNITUDES, mag, side="left").clip(0, 7)  # first grid value >= mag
    lo = (hi - 1).clip(0, 7)
    d_hi = _MAGNITUDES[hi] - mag
    d_lo = mag - _MAGNITUDES[lo]
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.where(pick_hi, hi, lo).astype(np.uint8)


def shared_exponent(amax, rule: ScaleRule = "compressed-tensors") -> np.ndarray:
    """E8M0 scale byte for blocks with absolute maximum ``amax`` (float, >= 0, finite).

    ``rule="compressed-tensors"`` (default; also k3-nano's exporter, see its README): round
    ``amax`` to a power of two ``2**e``, rounding *up* when its mantissa is >= 1.75, then
    ``s = e - 2 + 127`` (compressed-tensors ``generate_mx_scales`` / vLLM's reference MXFP4).
    ``rule="ocp"``: ``s = floor(log2(amax)) - 2 + 127`` (OCP MX v1.0 §6.3; values above 6
    after scaling saturate to ±6).
    Both clamp ``s`` to 0..254. An all-zero block (amax 0) gets ``s = 0``.
    """
    amax = np.asarray(amax, dtype=np.float64)
    m, e = np.frexp(amax)  # amax = m * 2**e, m in [0.5, 1)
    e = e.astype(np.int64) - 1  # amax = (2m) * 2**e, 2m in [1, 2)
    if rule == "compressed-tensors":
        e = e + (m >= 0.875)
    elif rule != "ocp":
        raise ValueError(f"rule: expected 'compressed-tensors' or 'ocp', got {rule!r}")
    s = e - E2M1_EMAX + E8M0_BIAS
    s = np.where(amax > 0, s, 0)
    return s.clip(0, 254).astype(np.uint8)


def quantize(w, rule: ScaleRule = "compressed-tensors") -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``w`` to MXFP4 (round to nearest even E2M1, power-of-two shared scale).

    Args:
        w: float array ``[..., out, in]`` (float16/float32/float64/bfloat16), ``in`` a
            multiple of 32, all finite.
        rule: scale rule, see :func:`shared_exponent` (default compressed-tensors'
            ``generate_mx_scales``, which is also what k3-nano's exporter used;
            ``quantize(dequantize(p, s)) == (p, s)`` bit-exactly for its expert tensors).
    Returns:
        ``(weight_packed uint8 [..., out, in/2], weight_scale uint8 [..., out, in/32])``.
        Element: ``code = RNE_E2M1(clamp(w / 2**(s-127), -6, 6))``; values that round to
        zero get code 0 (+0) unless the input is exactly -0.0 (code 8), so every code
        round-trips through :func:`dequantize`. (compressed-tensors' CPU path stores negative
        values that underflow as code 8, -0; both decode to 0.)
    Raises:
        ValueError: non-float dtype, 0-d input, ``in`` not a multiple of 32, NaN or inf.
    Source: spec §2; OCP MX v1.0 §6.3; compressed-tensors ``generate_mx_scales`` +
        ``cast_to_fp4`` + ``pack_fp4_to_uint8``.
    """
    w = np.asarray(w)
    if w.dtype.kind != "f" and str(w.dtype) != "bfloat16":
        raise ValueError(f"w: expected a float array, got dtype {w.dtype}")
    if w.ndim < 1 or w.shape[-1] % GROUP_SIZE:
        raise ValueError(
            f"w: expected shape [..., in] with in a multiple of {GROUP_SIZE}, got {w.shape}"
        )
    x = w.astype(np.float64)
    if not np.isfinite(x).all():
        raise ValueError("w: contains NaN or inf; MXFP4 quantization needs finite weights")
    blocks = x.reshape(x.shape[:-1] + (-1, GROUP_SIZE))
    scale = shared_exponent(np.abs(blocks).max(axis=-1), rule)
    scaled = blocks / np.ldexp(1.0, scale.astype(np.int32) - E8M0_BIAS)[..., None]
    mag = _round_e2m1(np.minimum(np.abs(scaled), 6.0))
    neg = np.signbit(scaled) & ((mag != 0) | (blocks == 0))
    codes = (mag | (neg.astype(np.uint8) << 3)).reshape(x.shape)
    return pack_codes(codes), scale


def to_kernel_layout(packed, scale) -> tuple[np.ndarray, np.ndarray]:
    """The layout the TIR MXFP4 kernels consume: the checkpoint layout, made contiguous.

    Returns ``(packed uint8 [..., out, in/2], scale uint8 [..., out, in/32])``, C-contiguous.
    We keep the checkpoint layout (row-major over output features, nibble order as stored):
    a GEMV/GEMM thread reading a row's K-slice reads consecutive bytes of both arrays, the
    loader needs no repacking of 1.35 TB of experts, and per-expert slices of a stacked
    ``[E, out, in/2]`` tensor stay contiguous.

    Raises:
        ValueError: wrong dtypes, ``in`` not a multiple of 32, or mismatched shapes.
    """
    packed, scale = _check_pair(packed, scale)
    return np.ascontiguousarray(packed), np.ascontiguousarray(scale)
