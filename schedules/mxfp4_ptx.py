"""Inline-PTX device functions for the tensor-core MXFP4 kernels, called from TIR through
``cuda_func_call`` (one CUDA source per function), with the bit layouts they rely on.

- :func:`mma_bf16` — ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` on fragments
  held in registers (PTX ISA, "Matrix fragments for mma.m16n8k16": thread ``(g, q) = (lane/4,
  lane%4)`` holds A rows ``g, g+8`` × k ``2q, 2q+1, 2q+8, 2q+9``, B column ``g`` × the same
  k, C rows ``g, g+8`` × columns ``2q, 2q+1``); :func:`mma_e4m3` — its E4M3 ``m16n8k32``
  twin with a zero accumulator (the MXFP8-activation GEMVs, schedules/mxfp8_act.py).
- :func:`dequant8` — 8 E2M1 codes of one ``uint32`` in the tc layout
  (:mod:`schedules.mxfp4_tc_layout`: the expert codes are permuted at load time) times a
  bf16x2 factor ``2^(s-1)`` -> four bf16x2 words: masked rotations put each code at the bf16
  bits where it reads as its value × 2^-126, one ``mul.rn.bf16x2`` (sm_90+) scales; 13
  instructions per 8 codes. tests/test_mxfp4_tc_layout.py emulates it against the E2M1 table.
- :func:`factor_bf16x2` / :func:`dup_half` — a byte of a word straight to the bf16x2 factor
  ``2^(s-1)`` (255 -> NaN), and a bf16x2 of one half of a word.
- :func:`cp_async16`, :func:`cp_async4`, :func:`commit`, :func:`wait` — 16-byte
  ``cp.async.cg`` (zero-filled when not ``valid``) and 4-byte ``cp.async.ca`` global -> shared
  copies and their group accounting. The copies and the wait carry a ``"memory"`` clobber, so
  nvcc keeps shared-memory reads of a stage after the wait that completes it and before the
  copy that overwrites it (a thread reading only what it copied itself needs no barrier).
"""

from __future__ import annotations

from tvm.backend.cuda.op import cuda_func_call
from tvm.script import tirx as T

from schedules import mxfp4_tc_layout as _L

_MMA = r"""
__forceinline__ __device__ void k3_mma_bf16(float* d, unsigned a0, unsigned a1, unsigned a2,
                                            unsigned a3, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""
_MMA_E4M3 = r"""
__forceinline__ __device__ void k3_mma_e4m3(float* d, unsigned a0, unsigned a1, unsigned a2,
                                            unsigned a3, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}
"""
# {name}: the function's name, {hint}: "" or an L2 prefetch-size qualifier such as ".L2::128B"
_CP_ASYNC = r"""
__forceinline__ __device__ void {name}(void* smem, const void* gmem, int valid) {{
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global{hint} [%0], [%1], 16, %2;\n" :: "r"(s), "l"(gmem), "r"(n) : "memory");
}}
"""
L2_PREFETCH_BYTES = (0, 64, 128, 256)   # cp.async's .level::prefetch_size (0: no hint)


def check_l2_prefetch(l2_prefetch) -> None:
    """Raise ValueError unless ``l2_prefetch`` is one of :data:`L2_PREFETCH_BYTES`."""
    if l2_prefetch not in L2_PREFETCH_BYTES:
        raise ValueError(f"l2_prefetch must be 0, 64, 128 or 256 (bytes), got {l2_prefetch}")
_CP_ASYNC4 = r"""
__forceinline__ __device__ void k3_cp_async4(void* smem, const void* gmem) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(s), "l"(gmem) : "memory");
}
"""
_COMMIT = r"""
__forceinline__ __device__ void k3_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
"""
_WAIT = r"""
__forceinline__ __device__ void k3_cp_async_wait{n}() {{ asm volatile("cp.async.wait_group {n};\n" ::: "memory"); }}
"""
# 8 E2M1 codes of a tc-layout word (schedules/mxfp4_tc_layout.py) times the bf16x2 factor f2
# = 2^(s-1) -> 4 bf16x2 words (inputs 0-1, 2-3, 4-5, 6-7): masked rotations (shf.r.wrap +
# lop3) place each code's sign at bf16 bit 15 and e1 e0 m at bits 8-6 (= value · 2^-126),
# one mul.rn.bf16x2 scales (exact: a code has two significant bits).
DEQUANT_SRC = r"""
__forceinline__ __device__ void k3_e2m1x8_tc(unsigned* out, unsigned w, unsigned f2) {
  unsigned r[4];
  r[0] = w & %(t)#xu;
  r[1] = __funnelshift_r(w, w, %(r1)d) & %(t)#xu;
  r[2] = __funnelshift_r(w, w, %(r2)d) & %(t)#xu;
  r[3] = (__funnelshift_r(w, w, %(ra)d) & %(ma)#xu) | (__funnelshift_r(w, w, %(rb)d) & %(mb)#xu);
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    asm("mul.rn.bf16x2 %%0, %%1, %%2;\n" : "=r"(out[i]) : "r"(r[i]), "r"(f2));
  }
}
""" % {"t": _L.T_MASK, "r1": _L.PIECES[1][2], "r2": _L.PIECES[2][2], "ra": _L.PIECES[3][2],
       "ma": _L.PIECES[3][1], "rb": _L.PIECES[4][2], "mb": _L.PIECES[4][1]}


def mma_bf16(d, a0, a1, a2, a3, b0, b1):
    return cuda_func_call("k3_mma_bf16", d, a0, a1, a2, a3, b0, b1, source_code=_MMA)


def mma_e4m3(d, a0, a1, a2, a3, b0, b1):
    """``d[0:4] = A·B`` by ``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32`` (sm_89+) with
    a zero accumulator: each register holds 4 E4M3 bytes; thread ``(g, q)``: a0 / a1 = rows
    g / g+8 at k ``4q .. 4q+3``, a2 / a3 the same rows at ``16 + 4q ..``; b0 / b1 = column g
    at those k; d as ``mma_bf16``'s (PTX ISA, "Matrix fragments for mma.m16n8k32")."""
    return cuda_func_call("k3_mma_e4m3", d, a0, a1, a2, a3, b0, b1, source_code=_MMA_E4M3)


def cp_async16(dst, src, valid, l2_prefetch: int = 0):
    """16-byte ``cp.async.cg`` global -> shared copy (zero-filled where ``valid`` is 0);
    ``l2_prefetch`` 64, 128 or 256: the ``.L2::<n>B`` hint that L2 fetch that many bytes
    around the address (PTX ISA, cp.async ``.level::prefetch_size``).

    Raises:
        ValueError: ``l2_prefetch`` not 0, 64, 128 or 256 (:func:`check_l2_prefetch`)."""
    check_l2_prefetch(l2_prefetch)
    name = f"k3_cp_async16_l2_{l2_prefetch}" if l2_prefetch else "k3_cp_async16"
    hint = f".L2::{l2_prefetch}B" if l2_prefetch else ""
    return cuda_func_call(name, dst, src, valid, source_code=_CP_ASYNC.format(name=name, hint=hint))


def cp_async4(dst, src):
    """4-byte ``cp.async.ca`` global -> shared copy."""
    return cuda_func_call("k3_cp_async4", dst, src, source_code=_CP_ASYNC4)


def commit():
    return cuda_func_call("k3_cp_async_commit", source_code=_COMMIT)


def wait(n: int):
    """Wait until at most ``n`` committed cp.async groups are in flight."""
    return cuda_func_call(f"k3_cp_async_wait{n}", source_code=_WAIT.format(n=n))


def dequant8(out, w, f2):
    """8 E2M1 codes of the tc-layout word ``w`` (uint32) times the bf16x2 factor ``f2``
    (:func:`factor_bf16x2`) into ``out[0:4]`` (bf16x2 words of inputs 0-1, 2-3, 4-5, 6-7)."""
    return cuda_func_call("k3_e2m1x8_tc", out, w, f2, source_code=DEQUANT_SRC)


# factor_bf16x2's constants (shared with its test): prmt selector of byte b = base + b, the
# multiplier placing a byte in both bf16 exponent fields, the exponent offset (126: 2^(s-1)),
# E8M0 255 as bf16x2 NaN
FACTOR_SELECT, FACTOR_MUL, FACTOR_OFFSET, FACTOR_NAN2 = 0x4440, 0x00800080, 126, 0x7FC07FC0


def factor_bf16x2(word, byte):
    """bf16x2 word with both halves ``2^(s-1)`` for the E8M0 byte ``s`` = byte ``byte`` (0..3)
    of the uint32 ``word`` (the tc layout's scale factor, mxfp4_tc_layout.factor_bf16): one
    ``prmt`` extracts ``s``, ``(s + 126) · 0x00800080`` places it in both exponent fields, a
    select makes 255 NaN."""
    s = T.call_pure_extern("uint32", "__byte_perm", word, T.uint32(0),
                           T.uint32(FACTOR_SELECT) + T.Cast("uint32", byte))
    return T.Select(s == T.uint32(255), T.uint32(FACTOR_NAN2),
                    (s + T.uint32(FACTOR_OFFSET)) * T.uint32(FACTOR_MUL))


def dup_half(w, hi):
    """bf16x2 word with both halves = half ``hi`` (0 low, 1 high; a constant after unrolling)
    of ``w``: one ``prmt`` (selector 0x1010 or 0x3232)."""
    return T.call_pure_extern("uint32", "__byte_perm", w, w,
                              T.uint32(0x1010) + T.Cast("uint32", hi) * T.uint32(0x2222))
