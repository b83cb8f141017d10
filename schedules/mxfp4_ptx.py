"""Inline-PTX device functions for the tensor-core MXFP4 kernels, called from TIR through
``cuda_func_call`` (one CUDA source per function), with the bit layouts they rely on.

- :func:`mma_bf16` — ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` on fragments
  held in registers (PTX ISA, "Matrix fragments for mma.m16n8k16": thread ``(g, q) = (lane/4,
  lane%4)`` holds A rows ``g, g+8`` × k ``2q, 2q+1, 2q+8, 2q+9``, B column ``g`` × the same
  k, C rows ``g, g+8`` × columns ``2q, 2q+1``).
- :func:`dequant8` — 8 E2M1 codes (one ``uint32``, nibble i = input i; compressed-tensors
  packing, low nibble first) times a bf16x2 E8M0 scale -> four bf16x2 words, by ``prmt``
  look-ups (magnitude -> low / high byte of the bf16; sign bits gathered by one more ``prmt``)
  and ``mul.rn.bf16x2`` (sm_90+; exact: a code has two significant bits). tests/
  test_moe_prefill_cuda.py emulates it instruction by instruction against the E2M1 table.
- :func:`scale_bf16` / :func:`dup_half` / :func:`scale_bf16x2` — an E8M0 byte as bf16 bits
  (0 -> 2^-127, 255 -> NaN), a bf16x2 of one half of a word, and a byte of a word straight to
  a bf16x2 scale.
- :func:`cp_async16`, :func:`cp_async4`, :func:`commit`, :func:`wait` — 16-byte
  ``cp.async.cg`` (zero-filled when not ``valid``) and 4-byte ``cp.async.ca`` global -> shared
  copies and their group accounting. The copies and the wait carry a ``"memory"`` clobber, so
  nvcc keeps shared-memory reads of a stage after the wait that completes it and before the
  copy that overwrites it (a thread reading only what it copied itself needs no barrier).
"""

from __future__ import annotations

from tvm.backend.cuda.op import cuda_func_call
from tvm.script import tirx as T

_MMA = r"""
__forceinline__ __device__ void k3_mma_bf16(float* d, unsigned a0, unsigned a1, unsigned a2,
                                            unsigned a3, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""
_CP_ASYNC = r"""
__forceinline__ __device__ void k3_cp_async16(void* smem, const void* gmem, int valid) {
  unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(gmem), "r"(n) : "memory");
}
"""
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
# prmt look-up words: magnitude code m (0..7) -> low / high byte of its bf16
# (0, .5, 1, 1.5 | 2, 3, 4, 6): byte m of {b, a}.
LO_TABLE = (0xC0800000, 0xC0804000)
HI_TABLE = (0x3F3F3F00, 0x40404040)
# 8 E2M1 codes (nibble i of w = input i) times the bf16x2 scale s2 -> 4 bf16x2 words
# (inputs 0-1, 2-3, 4-5, 6-7). prmt look-ups: magnitude -> low / high byte of its bf16;
# the sign bits (nibble bit 3) are gathered into bit 7 of the high bytes by one more prmt.
# The "a" words of the tables come in as registers (lo_a, hi_a: see _TABLES); the "b"
# words are immediates, which the SASS prmt takes in its immediate slot.
DEQUANT_SRC = r"""
__forceinline__ __device__ void k3_e2m1x8_bf16(unsigned* out, unsigned w, unsigned s2, unsigned lo_a,
                                               unsigned hi_a) {
  const unsigned lo_b = %(lo_b)#xu, hi_b = %(hi_b)#xu;
  unsigned t = w << 4;
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    unsigned sel = (w >> (16 * h)) & 0x7777u;
    unsigned lo, hi, sg;
    asm("prmt.b32 %%0, %%1, %%2, %%3;\n" : "=r"(lo) : "r"(lo_a), "r"(lo_b), "r"(sel));
    asm("prmt.b32 %%0, %%1, %%2, %%3;\n" : "=r"(hi) : "r"(hi_a), "r"(hi_b), "r"(sel));
    asm("prmt.b32 %%0, %%1, %%2, %%3;\n" : "=r"(sg) : "r"(t), "r"(w), "r"(h ? 0x7362u : 0x5140u));
    hi |= sg & 0x80808080u;
    unsigned p0, p1;
    asm("prmt.b32 %%0, %%1, %%2, 0x5140;\n" : "=r"(p0) : "r"(lo), "r"(hi));
    asm("prmt.b32 %%0, %%1, %%2, 0x7362;\n" : "=r"(p1) : "r"(lo), "r"(hi));
    asm("mul.rn.bf16x2 %%0, %%1, %%2;\n" : "=r"(out[2 * h]) : "r"(p0), "r"(s2));
    asm("mul.rn.bf16x2 %%0, %%1, %%2;\n" : "=r"(out[2 * h + 1]) : "r"(p1), "r"(s2));
  }
}
""" % {"lo_b": LO_TABLE[1], "hi_b": HI_TABLE[1]}
# the "a" look-up words, read once per thread from a global (volatile: neither nvcc nor ptxas
# may fold them into constants, which they re-materialize from a uniform register before every
# prmt; a folded __shfl_sync or inline-PTX shfl of a constant did not help)
_TABLES = r"""
__device__ unsigned k3_e2m1_tables[2] = {%(lo_a)#xu, %(hi_a)#xu};
__forceinline__ __device__ unsigned k3_e2m1_table(int i) {
  return *(volatile unsigned*)&k3_e2m1_tables[i];
}
""" % {"lo_a": LO_TABLE[0], "hi_a": HI_TABLE[0]}


def mma_bf16(d, a0, a1, a2, a3, b0, b1):
    return cuda_func_call("k3_mma_bf16", d, a0, a1, a2, a3, b0, b1, source_code=_MMA)


def cp_async16(dst, src, valid):
    return cuda_func_call("k3_cp_async16", dst, src, valid, source_code=_CP_ASYNC)


def cp_async4(dst, src):
    """4-byte ``cp.async.ca`` global -> shared copy."""
    return cuda_func_call("k3_cp_async4", dst, src, source_code=_CP_ASYNC4)


def commit():
    return cuda_func_call("k3_cp_async_commit", source_code=_COMMIT)


def wait(n: int):
    """Wait until at most ``n`` committed cp.async groups are in flight."""
    return cuda_func_call(f"k3_cp_async_wait{n}", source_code=_WAIT.format(n=n))


def dequant8(out, w, s2, tables):
    """8 E2M1 codes of ``w`` times the bf16x2 scale ``s2`` into ``out[0:4]`` (bf16x2 words);
    ``tables``: a 2-word local buffer filled once per thread by :func:`load_tables`."""
    return cuda_func_call("k3_e2m1x8_bf16", out, w, s2, tables[0], tables[1], source_code=DEQUANT_SRC)


def _table(i: int):
    return cuda_func_call("k3_e2m1_table", T.int32(i), source_code=_TABLES, return_type="uint32")


@T.macro
def load_tables(tables):
    """Fill the 2-word local buffer ``tables`` with the "a" look-up words for :func:`dequant8`
    (two loads: do it once, at the top of the kernel)."""
    tables[0] = _table(0)
    tables[1] = _table(1)


def scale_bf16(s):
    """uint32 holding the bf16 bits of the E8M0 byte ``s`` (uint32 0..255): 2^(s-127);
    0 -> 2^-127 (the subnormal 0x0040), 255 -> NaN (0x7FC0)."""
    return T.Select(s == T.uint32(0), T.uint32(0x40),
                    T.Select(s == T.uint32(255), T.uint32(0x7FC0), s << T.uint32(7)))


# scale_bf16x2's constants (shared with its test): prmt selector of byte b = base + b, the
# multiplier placing a byte in both bf16 exponent fields, E8M0 0 / 255 as bf16x2
SCALE_SELECT, SCALE_MUL, SCALE_MIN, SCALE_NAN = 0x4440, 0x00800080, 0x00400040, 0x7FC07FC0


def scale_bf16x2(word, byte):
    """bf16x2 word with both halves = the E8M0 byte ``byte`` (0..3) of uint32 ``word`` as bf16
    (as :func:`scale_bf16`: 0 -> 2^-127, 255 -> NaN): one ``prmt`` extracts the byte ``s``,
    ``s · 0x00800080`` places it in both exponent fields, a max makes s = 0 the subnormal
    0x0040, a select makes 255 NaN."""
    s = T.call_pure_extern("uint32", "__byte_perm", word, T.uint32(0),
                           T.uint32(SCALE_SELECT) + T.Cast("uint32", byte))
    d = T.max(s * T.uint32(SCALE_MUL), T.uint32(SCALE_MIN))
    return T.Select(s == T.uint32(255), T.uint32(SCALE_NAN), d)


def dup_half(w, hi):
    """bf16x2 word with both halves = half ``hi`` (0 low, 1 high; a constant after unrolling)
    of ``w``: one ``prmt`` (selector 0x1010 or 0x3232)."""
    return T.call_pure_extern("uint32", "__byte_perm", w, w,
                              T.uint32(0x1010) + T.Cast("uint32", hi) * T.uint32(0x2222))
