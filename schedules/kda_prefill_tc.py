"""KDA chunked prefill on tensor cores (mma.sync m16n8k8 TF32, fp32 accumulate), CUDA.

Same algorithm, inputs, scratch tensors and reference as ``schedules/kda_prefill_cuda.py``
(spec §3 "KDA layer" step 5, chunked WY / UT form of fla's ``naive_chunk_kda``, chunk C = 64;
reference :func:`schedules.kda_prefill_cuda.kda_prefill_reference`); the matrix products of
both kernels run on tensor cores:

* ``kda_prefill_intra_tc_kernel`` — one block per (chunk, head), 8 warps, about 103 KB of
  shared memory and ≤ 128 registers so that two blocks share an SM. ``L = β·(k e^{Γ−r})
  (k e^{r−Γ})ᵀ`` and ``Aqk = (q e^{Γ−r})(k e^{r−Γ})ᵀ`` (per 16-row sub-block, one n-tile of 8
  columns per warp), ``w = Tm (k e^Γ)`` and ``u = Tm v`` (lower-triangular Tm: only the k-steps
  at or below the diagonal) are mma tiles; the triangular solve Tm = (I + L)^{-1} diag(β) runs
  on CUDA cores (two warps, one column per thread in registers, right-looking).
* ``kda_prefill_state_tc_kernel`` — one block per (sequence, head, ``block_v`` columns of
  V), 8 warps; per chunk::

      X  = w S,  Y = qg S            warps 0-3: X rows 16·wi…, warps 4-7: Y rows 16·(wi−4)…
      vn = u − X                     (warps 0-3, to shared memory)
      S  ← diag(ge) S + kgᵀ vn       (every warp: 16 rows of S, kept in fp32 registers)
      o  = Y + Aqk vn                (warps 4-7; causal: k-steps ≤ the diagonal only)

  The state slice lives in the accumulator registers for the whole sequence (fp32, never
  rounded); a copy in shared memory (rounded to TF32 when it is read as an mma operand) feeds
  the next chunk's ``w S`` / ``qg S``. The A operands (w, qg, kgᵀ, Aqk) and u are read from
  global memory straight into fragments (``a_batch`` k-steps at a time, so that their
  latencies overlap), the next chunk's rows are prefetched into L2; shared memory holds only
  S and vn.

Precision: TF32 operands (``cvt.rna``, 10-bit mantissa), fp32 accumulation, like fla's
``chunk_kda`` on fp32 inputs (Triton's ``tl.dot`` defaults to TF32). Measured on the H200
(``benchmarks/results/kda_prefill_h200_2026-11-29.json``): max |o − o_naive| 9.1e-5 and
|S − S_naive| 7.9e-4 over ragged checks up to 8192 tokens, vs 1.4e-4 / 1.6e-3 for fla
``chunk_kda`` (naive = fla ``naive_recurrent_kda``). With ``hoist_loads`` (the default: the
intra kernel's loads issued together instead of one branch at a time): 96 heads 6.9 ms at
8192 tokens and 6.5 ms at 4 × 2048 (fla in the same run 4.75 / 4.56 ms: 0.69× / 0.71×; intra
4.5 ms + state 2.4 / 1.9 ms); 12 heads 1.40 ms / 0.87 ms (fla from an earlier run the same
day 1.36 / 1.05 ms: 0.97× / 1.21×). Without it: 9.3 ms at 96 heads (intra 6.9 ms). The
state kernel at 12 heads is latency-bound (~6.6 µs per chunk: dependent L2 round trips).

Fragment layout of ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` (PTX ISA,
"Matrix Fragments for mma.m16n8k8", .tf32): lane = 4·gr + tg;
A (16×8): a0 = A[gr, tg], a1 = A[gr+8, tg], a2 = A[gr, tg+4], a3 = A[gr+8, tg+4];
B (8×8): b0 = B[tg, gr], b1 = B[tg+4, gr]; C/D (16×8): c_e = D[gr + 8·(e//2), 2·tg + e%2].

Emulation (``emulate=True``, for CPU tests): block / thread loops serial, shared tiles global,
per-thread "registers" as [threads, n] buffers, and each mma replaced by what it computes for
the calling lane (its four accumulator entries c_e += Σ_k A[row_e, k] B[k, col_e] in fp32), so
the CPU run checks every index map, mask and phase of the kernels; the fragment loads and the
mma instruction itself are checked on the GPU (``benchmarks/kda.py run --only prefill``).

Two TVM 0.27 behaviours these kernels work around: shared buffers are compacted to the
accessed region (a padded row stride is lost), so padded tiles are flat 1-D buffers; and the
shared-memory merging pass reuses the space of a buffer whose last access precedes another's
first access in the same thread loop even when other threads still read it, so buffers that a
phase reads and writes at once (L and Tm) are regions of one buffer.
"""

from __future__ import annotations

import functools

from tvm.script import tirx as T

from schedules.barriers import mark
from schedules.kda_prefill_cuda import (C, SUB, block_thread_loops, kda_prefill_reference,  # noqa: F401
                                        max_chunks, prefill_scratch_shapes)

NT = 256         # threads per block (8 warps)

MMA_TF32_SRC = r"""
__device__ __forceinline__ unsigned k3_to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void k3_mma_tf32(float* d, float a0, float a1, float a2, float a3,
                                            float b0, float b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(k3_to_tf32(a0)), "r"(k3_to_tf32(a1)), "r"(k3_to_tf32(a2)), "r"(k3_to_tf32(a3)),
        "r"(k3_to_tf32(b0)), "r"(k3_to_tf32(b1)));
}
"""

PREFETCH_SRC = r"""
__device__ __forceinline__ void k3_prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}
"""


def mma_tf32_macros(emulate: bool):
    """TVMScript macros for the warp-level m16n8k8 steps.

    ``load_a(af, ab, A, lane, k0)``: the lane's A fragment of A[0:16, k0:k0+8] into
    ``af[ab:ab+4]`` (``A(r, k)`` a Python callable giving the element expression); loading the
    fragments of several k-steps before their mma lets their memory latencies overlap.
    ``mma(acc, acc_row, off, af, ab, A, B, lane, k0, n0)``: acc[acc_row, off + e] (e < 4) += the
    lane's entries of A[0:16, k0:k0+8] · B[k0:k0+8, n0:n0+8] (``B(k, n)`` callable).
    On the GPU ``mma`` uses the fragment in ``af[ab:ab+4]`` and ``A`` is not read; emulated,
    ``af`` is not used and the four dot products are computed from ``A`` and ``B`` directly.
    ``prefetch(elem)``: ``prefetch.global.L2`` of the line holding the buffer element (a
    no-op when emulated)."""
    from tvm.backend.cuda.op import cuda_func_call

    if emulate:
        @T.macro
        def load_a(af, ab, A, lane, k0):
            af[0] = T.float32(0)

        @T.macro
        def mma(acc, acc_row, off, af, ab, A, B, lane, k0, n0):
            for e in range(4):
                for kk in range(8):
                    acc[acc_row, off + e] = acc[acc_row, off + e] + A(lane // 4 + e // 2 * 8, k0 + kk) * B(k0 + kk, n0 + lane % 4 * 2 + e % 2)

        @T.macro
        def prefetch(elem):
            T.evaluate(0)
    else:
        @T.macro
        def load_a(af, ab, A, lane, k0):
            af[ab] = A(lane // 4, k0 + lane % 4)
            af[ab + 1] = A(lane // 4 + 8, k0 + lane % 4)
            af[ab + 2] = A(lane // 4, k0 + lane % 4 + 4)
            af[ab + 3] = A(lane // 4 + 8, k0 + lane % 4 + 4)

        @T.macro
        def mma(acc, acc_row, off, af, ab, A, B, lane, k0, n0):
            cuda_func_call("k3_mma_tf32", T.address_of(acc[acc_row, off]), af[ab], af[ab + 1], af[ab + 2], af[ab + 3],
                           B(k0 + lane % 4, n0 + lane // 4), B(k0 + lane % 4 + 4, n0 + lane // 4),
                           source_code=MMA_TF32_SRC)

        @T.macro
        def prefetch(elem):
            cuda_func_call("k3_prefetch_l2", T.address_of(elem), source_code=PREFETCH_SRC)
    return load_a, mma, prefetch


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def kda_prefill_state_tc_kernel(H: int, K: int, V: int, block_v: int = 32, a_batch: int = 8,
                                emulate: bool = False):
    """Inter-chunk pass on tensor cores, one block per (sequence, head, ``block_v`` columns).
    Arguments (as :func:`schedules.kda_prefill_cuda.kda_prefill_state_kernel`)::

        w, qg, kg   [T, H, K]        float32   from the intra kernel
        u           [T, H, V]        float32
        aqk         [T, H, C]        float32   (zero above the diagonal)
        ge          [NC, H, K]       float32
        cu_seqlens  [B+1]            int32
        seq_slots   [B]              int32
        kda_state   [L, S, H, K, V]  float32   in place (argument index 8)
        layer       int32
        o           [T, H, V]        float32   out

    Per chunk (rows past the sequence end read as zero, so they change nothing):
    ``vn = u − w S``; ``o = qg S + Aqk vn``; ``S ← diag(ge) S + kgᵀ vn``.
    ``a_batch`` (4, 8 or 16): k-steps whose A fragments are loaded from global memory before
    their mma (more overlap of load latencies, 4·a_batch more registers; at most 8 in the
    kgᵀ vn / Aqk vn phase, whose products have 8 k-steps). Measured on the H200 (2026-11-29):
    4 and 8 (best: block_v 32 / 64 at 96 heads, 16 / 64 at 12 heads); 16 not measured yet.
    """
    BV = block_v
    if K != 128 or V % BV or BV % 8 or BV > 64 or a_batch not in (4, 8, 16):
        raise ValueError(f"unsupported block_v={BV} / a_batch={a_batch} for K={K}, V={V} "
                         "(K = 128, 8 | block_v ≤ 64, a_batch 4, 8 or 16)")
    AB = a_batch
    ABB = min(AB, C // 8)
    BLK, THR, SH = block_thread_loops(emulate)
    SYNC = not emulate
    RT = NT if emulate else 1   # rows of the per-thread register buffers
    EM = 1 if emulate else 0    # register row of thread tx: tx·EM
    NVB = V // BV
    N8 = BV // 8                # n-tiles per warp
    SP = BV + 8                 # padded row stride of S / vn tiles (conflict-free B fragments)
    NR = N8 * 4                 # accumulator registers per thread
    EG = 0 if emulate else 1    # A-fragment registers: a_batch k-steps on the GPU, unused emulated
    AFN = 4 + (4 * AB - 4) * EG
    load_a, mma, prefetch = mma_tf32_macros(emulate)

    # element accessors; b = sequence, h = head, c = chunk of the sequence, wi = warp
    def row0(cu, b, c):
        return cu[b] + c * C

    def masked(buf, cu, b, t, h, d):
        return T.if_then_else(t < cu[b + 1], buf[t, h, d], T.float32(0))

    def a_rows(buf, cu, b, c, r0, h):   # A(i, d) = buf[chunk row r0 + i, h, d]
        return lambda i, d: masked(buf, cu, b, row0(cu, b, c) + r0 + i, h, d)

    def a_kgt(buf, cu, b, c, d0, h):    # A(i, j) = buf[chunk row j, h, d0 + i]  (kgᵀ)
        return lambda i, j: masked(buf, cu, b, row0(cu, b, c) + j, h, d0 + i)

    @T.macro
    def gemm(acc, af, A, B, steps, batch, tx, last):
        """acc[tx·EM, nt·4 + e] += the warp's A[0:16, 0:8·steps] · B over the N8 n-tiles, the A
        fragments of ``batch`` k-steps loaded before their mmas; k-steps past ``last`` (a
        bound on the step index, or None for all) are skipped."""
        for kh in T.unroll(steps // batch):
            for ks in T.unroll(batch):
                if last is None or kh * batch + ks <= last:
                    load_a(af, ks * 4 * EG, A, tx % 32, (kh * batch + ks) * 8)
            for ks in T.unroll(batch):
                if last is None or kh * batch + ks <= last:
                    for nt in T.unroll(N8):
                        mma(acc, tx * EM, nt * 4, af, ks * 4 * EG, A, B, tx % 32, (kh * batch + ks) * 8, nt * 8)

    @T.prim_func(private=True)
    def kda_prefill_state_tc(w_h: T.handle, u_h: T.handle, qg_h: T.handle, kg_h: T.handle,
                             aqk_h: T.handle, ge_h: T.handle, cu_h: T.handle, slots_h: T.handle,
                             state_h: T.handle, layer: T.int32, o_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_cu, n_ch, n_seq, n_layer, n_slot = (T.int64(), T.int64(), T.int64(), T.int64(),
                                                     T.int64(), T.int64())
        w = T.match_buffer(w_h, (n_tok, H, K), "float32")
        u = T.match_buffer(u_h, (n_tok, H, V), "float32")
        qg = T.match_buffer(qg_h, (n_tok, H, K), "float32")
        kg = T.match_buffer(kg_h, (n_tok, H, K), "float32")
        aqk = T.match_buffer(aqk_h, (n_tok, H, C), "float32")
        ge = T.match_buffer(ge_h, (n_ch, H, K), "float32")
        cu = T.match_buffer(cu_h, (n_cu,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
        o = T.match_buffer(o_h, (n_tok, H, V), "float32")
        for blk in BLK((n_cu - 1) * (H * NVB)):
            Ss = T.alloc_buffer((K * SP,), "float32", scope=SH)   # S slice (mma B operand), row stride SP
            vn = T.alloc_buffer((C * SP,), "float32", scope=SH)   # u − w S of the chunk, row stride SP
            Sr = T.alloc_buffer((RT, NR), "float32", scope="local")  # S rows 16·wi… (fp32)
            Yr = T.alloc_buffer((RT, NR), "float32", scope="local")  # w S / qg S, then o
            ch0 = T.alloc_buffer((RT, 1), "int32", scope="local")    # first chunk id of b
            # S slice → registers and shared memory; the sequence's first chunk id
            for tx in THR(NT):
                ch0[tx * EM, 0] = 0
                for bb in range(blk // (H * NVB)):
                    ch0[tx * EM, 0] = ch0[tx * EM, 0] + (cu[bb + 1] - cu[bb] + C - 1) // C
                for nt in T.unroll(N8):
                    for e in T.unroll(4):
                        Sr[tx * EM, nt * 4 + e] = S[layer, slots[blk // (H * NVB)], blk // NVB % H, tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8, blk % NVB * BV + nt * 8 + tx % 4 * 2 + e % 2]
                        Ss[(tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8) * SP + nt * 8 + tx % 4 * 2 + e % 2] = Sr[tx * EM, nt * 4 + e]
            for c in range((cu[blk // (H * NVB) + 1] - cu[blk // (H * NVB)] + C - 1) // C):
                # phase A: X = w S (warps 0-3) / Y = qg S (warps 4-7); vn = u − X. The A
                #          fragments of 8 k-steps are loaded before their mma (latencies overlap);
                #          the next chunk's rows are prefetched into L2 meanwhile.
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    af = T.alloc_buffer((AFN,), "float32", scope="local")
                    if row0(cu, blk // (H * NVB), c + 1) + tx // 4 < cu[blk // (H * NVB) + 1]:
                        prefetch(w[row0(cu, blk // (H * NVB), c + 1) + tx // 4, blk // NVB % H, tx % 4 * 32])
                        prefetch(qg[row0(cu, blk // (H * NVB), c + 1) + tx // 4, blk // NVB % H, tx % 4 * 32])
                        prefetch(kg[row0(cu, blk // (H * NVB), c + 1) + tx // 4, blk // NVB % H, tx % 4 * 32])
                        if tx % 4 < 2:
                            prefetch(aqk[row0(cu, blk // (H * NVB), c + 1) + tx // 4, blk // NVB % H, tx % 4 * 32])
                        if tx % 4 * 32 < BV:
                            prefetch(u[row0(cu, blk // (H * NVB), c + 1) + tx // 4, blk // NVB % H, blk % NVB * BV + tx % 4 * 32])
                    for r in T.unroll(NR):
                        Yr[tx * EM, r] = T.float32(0)
                    if tx // 32 < 4:
                        gemm(Yr, af, a_rows(w, cu, blk // (H * NVB), c, tx // 32 * 16, blk // NVB % H),
                             lambda d, j: Ss[d * SP + j], K // 8, AB, tx, None)
                        for nt in T.unroll(N8):
                            for e in T.unroll(4):
                                vn[(tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8) * SP + nt * 8 + tx % 4 * 2 + e % 2] = masked(u, cu, blk // (H * NVB), row0(cu, blk // (H * NVB), c) + tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8, blk // NVB % H, blk % NVB * BV + nt * 8 + tx % 4 * 2 + e % 2) - Yr[tx * EM, nt * 4 + e]
                    else:
                        gemm(Yr, af, a_rows(qg, cu, blk // (H * NVB), c, (tx // 32 - 4) * 16, blk // NVB % H),
                             lambda d, j: Ss[d * SP + j], K // 8, AB, tx, None)
                # phase B: S ← diag(ge) S + kgᵀ vn (all warps); o = Y + Aqk vn (warps 4-7,
                #          causal: k-steps ≤ the diagonal)
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    af = T.alloc_buffer((AFN,), "float32", scope="local")
                    for nt in T.unroll(N8):
                        for e in T.unroll(4):
                            Sr[tx * EM, nt * 4 + e] = Sr[tx * EM, nt * 4 + e] * ge[ch0[tx * EM, 0] + c, blk // NVB % H, tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8]
                    gemm(Sr, af, a_kgt(kg, cu, blk // (H * NVB), c, tx // 32 * 16, blk // NVB % H),
                         lambda j, n: vn[j * SP + n], C // 8, ABB, tx, None)
                    for nt in T.unroll(N8):
                        for e in T.unroll(4):
                            Ss[(tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8) * SP + nt * 8 + tx % 4 * 2 + e % 2] = Sr[tx * EM, nt * 4 + e]
                    if tx // 32 >= 4:
                        # causal: k-steps up to the diagonal of the warp's 16 rows
                        gemm(Yr, af, a_rows(aqk, cu, blk // (H * NVB), c, (tx // 32 - 4) * 16, blk // NVB % H),
                             lambda j, n: vn[j * SP + n], C // 8, ABB, tx, (tx // 32 - 4) * 2 + 1)
                        for nt in T.unroll(N8):
                            for e in T.unroll(4):
                                if row0(cu, blk // (H * NVB), c) + (tx // 32 - 4) * 16 + tx % 32 // 4 + e // 2 * 8 < cu[blk // (H * NVB) + 1]:
                                    o[row0(cu, blk // (H * NVB), c) + (tx // 32 - 4) * 16 + tx % 32 // 4 + e // 2 * 8, blk // NVB % H, blk % NVB * BV + nt * 8 + tx % 4 * 2 + e % 2] = Yr[tx * EM, nt * 4 + e]
            # registers → the pooled state
            for tx in THR(NT):
                for nt in T.unroll(N8):
                    for e in T.unroll(4):
                        S[layer, slots[blk // (H * NVB)], blk // NVB % H, tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8, blk % NVB * BV + nt * 8 + tx % 4 * 2 + e % 2] = Sr[tx * EM, nt * 4 + e]

    return kda_prefill_state_tc if emulate else mark(kda_prefill_state_tc)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def kda_prefill_intra_tc_kernel(H: int, K: int, V: int, scale: float, hoist_loads: bool = True,
                                emulate: bool = False):
    """Intra-chunk precompute on tensor cores, one block per (chunk, head), 8 warps.
    Arguments and outputs as :func:`schedules.kda_prefill_cuda.kda_prefill_intra_kernel`::

        k, q        [T, H, K]   float32   L2-normalized
        v           [T, H, V]   float32
        g           [T, H, K]   float32   log decay (lower-bound gate: −5 < g ≤ 0)
        beta        [T, H]      float32
        cu_seqlens  [B+1]       int32
        w, qg, kg   [T, H, K]   float32   out
        u           [T, H, V]   float32   out
        aqk         [T, H, C]   float32   out (row i of the chunk's Aqk, zero above diagonal)
        ge          [NC, H, K]  float32   out, NC ≥ max_chunks(T, B)

    Phases (a barrier before each): locate the chunk; stage β; Γ = column cumsum of g; qg, kg,
    ge; per 16-row sub-block I (r = Γ_{16I}): ``L = β (k e^{Γ−r})(k e^{r−Γ})ᵀ`` (j < i) and
    ``Aqk = (scale q e^{Γ−r})(k e^{r−Γ})ᵀ`` (j ≤ i) as mma tiles (warp wi: columns 8wi…8wi+7);
    ``Tm = (I+L)^{-1} diag(β)`` on CUDA cores — warps 0-1, one column c per thread, right-looking
    substitution with the column in registers (x = e_c; for j: x_i −= L[i, j] x_j, i > j), while
    warps 2-7 stage k e^Γ; ``w = Tm (k e^Γ)``, ``u = Tm v`` as mma tiles (warp wi: product
    wi // 4, columns 32(wi % 4)…, k-steps ≤ the diagonal; v staged in Γ's place, which is dead
    by then). q, k, v of the chunk are prefetched into L2 at the start.

    Shared memory (about 103 KB, so that two blocks fit on an SM): Γ / v [C, K+8]; kb [C, K+4]
    (k e^{r−Γ}, then k e^Γ); one buffer ``ax`` = L [C, C] then a region used as ka / qa
    [16, K+4] in the L / Aqk phase and as Tm [C, C+4] afterwards (one buffer, so that TVM's
    shared-memory merging cannot overlap L and Tm, which the solve reads and writes together).
    k is read from global memory (L2) where needed instead of being staged.

    ``hoist_loads``: each thread first loads all the global values of a phase (g, q, k, v) into
    registers without conditions (rows clamped into the tensor), then masks rows past the chunk
    end with selects. Without it (the version measured on the H200 on 2026-11-29) the loads sit
    in per-row branches behind a shared-memory read of the chunk start, so ptxas issues them one
    after the other (64 dependent HBM round trips for the Γ cumsum alone, per SASS).
    """
    if K != 128 or V != 128:
        raise ValueError("the prefill kernels are written for K = V = 128")
    BLK, THR, SH = block_thread_loops(emulate)
    SYNC = not emulate
    RT = NT if emulate else 1
    EM = 1 if emulate else 0
    KS = K + 4        # row stride of ka / qa / kb (conflict-free A and Bᵀ fragments)
    GS = K + 8        # row stride of Γ / the v tile (conflict-free B fragments)
    MS = C + 4        # row stride of Tm (A operand)
    NSUB = C // SUB
    XO = C * C        # offset of the ka / qa / Tm region in ax
    QO = XO + SUB * KS  # offset of qa
    assert 2 * SUB * KS <= C * MS
    load_a, mma, prefetch = mma_tf32_macros(emulate)

    def ldc(buf, t, n_tok, h, d):      # unconditional load, row clamped into the tensor
        return buf[T.min(T.Cast("int64", t), n_tok - 1), h, d]

    HL = hoist_loads

    @T.prim_func(private=True)
    def kda_prefill_intra_tc(k_h: T.handle, q_h: T.handle, v_h: T.handle, g_h: T.handle,
                             beta_h: T.handle, cu_h: T.handle, w_h: T.handle, u_h: T.handle,
                             qg_h: T.handle, kg_h: T.handle, aqk_h: T.handle, ge_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_cu, n_ch = T.int64(), T.int64(), T.int64()
        k = T.match_buffer(k_h, (n_tok, H, K), "float32")
        q = T.match_buffer(q_h, (n_tok, H, K), "float32")
        v = T.match_buffer(v_h, (n_tok, H, V), "float32")
        g = T.match_buffer(g_h, (n_tok, H, K), "float32")
        beta = T.match_buffer(beta_h, (n_tok, H), "float32")
        cu = T.match_buffer(cu_h, (n_cu,), "int32")
        w = T.match_buffer(w_h, (n_tok, H, K), "float32")
        u = T.match_buffer(u_h, (n_tok, H, V), "float32")
        qg = T.match_buffer(qg_h, (n_tok, H, K), "float32")
        kg = T.match_buffer(kg_h, (n_tok, H, K), "float32")
        aqk = T.match_buffer(aqk_h, (n_tok, H, C), "float32")
        ge = T.match_buffer(ge_h, (n_ch, H, K), "float32")
        for blk in BLK(((n_tok + C - 1) // C + n_cu - 1) * H):
            meta = T.alloc_buffer((4,), "int32", scope=SH)       # -, c0, n
            gam = T.alloc_buffer((C * GS,), "float32", scope=SH)  # Γ; v in the last phase
            bt = T.alloc_buffer((C,), "float32", scope=SH)       # β
            kb = T.alloc_buffer((C * KS,), "float32", scope=SH)  # k e^{r−Γ}, then k e^Γ
            ax = T.alloc_buffer((XO + C * MS,), "float32", scope=SH)  # L | ka, qa → Tm
            # phase 0: which (sequence, chunk) this block is
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                acc = T.alloc_buffer((4,), "int32", scope="local")
                if tx == 0:
                    acc[0] = 0   # chunks before sequence bb
                    acc[1] = 0   # c0
                    acc[2] = 0   # n
                    for bb in range(n_cu - 1):
                        if T.Cast("int32", blk // H) >= acc[0] and T.Cast("int32", blk // H) < acc[0] + (cu[bb + 1] - cu[bb] + C - 1) // C:
                            acc[1] = cu[bb] + (T.Cast("int32", blk // H) - acc[0]) * C
                            acc[2] = T.min(C, cu[bb + 1] - cu[bb] - (T.Cast("int32", blk // H) - acc[0]) * C)
                        acc[0] = acc[0] + (cu[bb + 1] - cu[bb] + C - 1) // C
                    meta[1] = acc[1]
                    meta[2] = acc[2]
            # phase 1: β (rows past the chunk end are zero); Γ = cumsum of g down each column
            #          (rows past the end add 0, so Γ_{C-1} = Γ_{n-1}); thread tx sums column
            #          tx % K and writes the rows of its half
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                nm = T.alloc_buffer((1,), "int32", scope="local")  # shared reads cannot sit in an if condition
                run = T.alloc_buffer((1,), "float32", scope="local")
                nm[0] = meta[2]
                if tx // 4 < nm[0]:  # q, k, v rows of the chunk into L2 (read again below)
                    prefetch(q[meta[1] + tx // 4, blk % H, tx % 4 * 32])
                    prefetch(k[meta[1] + tx // 4, blk % H, tx % 4 * 32])
                    prefetch(v[meta[1] + tx // 4, blk % H, tx % 4 * 32])
                if tx < C:
                    if tx < nm[0]:
                        bt[tx] = beta[meta[1] + tx, blk % H]
                    else:
                        bt[tx] = T.float32(0)
                run[0] = T.float32(0)
                if HL:
                    c0 = T.alloc_buffer((1,), "int32", scope="local")
                    gl = T.alloc_buffer((C,), "float32", scope="local")
                    c0[0] = meta[1]
                    for i in T.unroll(C):
                        gl[i] = ldc(g, c0[0] + i, n_tok, blk % H, tx % K)
                    for i in T.unroll(C):
                        run[0] = run[0] + T.Select(i < nm[0], gl[i], T.float32(0))
                        if i // (C * K // NT) == tx // K:
                            gam[(i) * GS + tx % K] = run[0]
                else:
                    for i in T.unroll(C):
                        run[0] = run[0] + T.if_then_else(i < nm[0], g[meta[1] + i, blk % H, tx % K], T.float32(0))
                        if i // (C * K // NT) == tx // K:
                            gam[(i) * GS + tx % K] = run[0]
            # phase 2: qg, kg per token, ge per chunk
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                nm = T.alloc_buffer((1,), "int32", scope="local")
                nm[0] = meta[2]
                if HL:
                    c0 = T.alloc_buffer((1,), "int32", scope="local")
                    ql = T.alloc_buffer((C * K // NT,), "float32", scope="local")
                    kl = T.alloc_buffer((C * K // NT,), "float32", scope="local")
                    c0[0] = meta[1]
                    for it in T.unroll(C * K // NT):
                        ql[it] = ldc(q, c0[0] + it * (NT // K) + tx // K, n_tok, blk % H, tx % K)
                        kl[it] = ldc(k, c0[0] + it * (NT // K) + tx // K, n_tok, blk % H, tx % K)
                    for it in T.unroll(C * K // NT):
                        if it * (NT // K) + tx // K < nm[0]:
                            qg[c0[0] + it * (NT // K) + tx // K, blk % H, tx % K] = T.float32(scale) * ql[it] * T.exp(gam[(it * (NT // K) + tx // K) * GS + tx % K])
                            kg[c0[0] + it * (NT // K) + tx // K, blk % H, tx % K] = kl[it] * T.exp(gam[(C - 1) * GS + tx % K] - gam[(it * (NT // K) + tx // K) * GS + tx % K])
                else:
                    for it in T.unroll(C * K // NT):
                        if it * (NT // K) + tx // K < nm[0]:
                            qg[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K] = T.float32(scale) * q[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K] * T.exp(gam[(it * (NT // K) + tx // K) * GS + tx % K])
                            kg[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K] = k[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K] * T.exp(gam[(C - 1) * GS + tx % K] - gam[(it * (NT // K) + tx // K) * GS + tx % K])
                if tx < K and nm[0] > 0:
                    ge[blk // H, blk % H, tx] = T.exp(gam[(C - 1) * GS + tx])
            # phase 3: L and Aqk, one 16-row sub-block I at a time (reference r = Γ_{16I})
            for I in range(NSUB):
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    nm = T.alloc_buffer((1,), "int32", scope="local")
                    nm[0] = meta[2]
                    if HL:
                        c0 = T.alloc_buffer((1,), "int32", scope="local")
                        kl = T.alloc_buffer((C * K // NT,), "float32", scope="local")
                        sl = T.alloc_buffer((2 * SUB * K // NT,), "float32", scope="local")
                        c0[0] = meta[1]
                        for it in T.unroll(C * K // NT):
                            kl[it] = ldc(k, c0[0] + it * (NT // K) + tx // K, n_tok, blk % H, tx % K)
                        for it in T.unroll(SUB * K // NT):
                            sl[it] = ldc(k, c0[0] + I * SUB + it * (NT // K) + tx // K, n_tok, blk % H, tx % K)
                            sl[SUB * K // NT + it] = ldc(q, c0[0] + I * SUB + it * (NT // K) + tx // K, n_tok, blk % H, tx % K)
                        for it in T.unroll(C * K // NT):
                            kb[(it * (NT // K) + tx // K) * KS + tx % K] = T.Select(it * (NT // K) + tx // K < I * SUB + SUB and it * (NT // K) + tx // K < nm[0], kl[it] * T.exp(gam[(I * SUB) * GS + tx % K] - gam[(it * (NT // K) + tx // K) * GS + tx % K]), T.float32(0))
                        for it in T.unroll(SUB * K // NT):
                            ax[XO + (it * (NT // K) + tx // K) * KS + tx % K] = T.Select(I * SUB + it * (NT // K) + tx // K < nm[0], sl[it] * T.exp(gam[(I * SUB + it * (NT // K) + tx // K) * GS + tx % K] - gam[(I * SUB) * GS + tx % K]), T.float32(0))
                            ax[QO + (it * (NT // K) + tx // K) * KS + tx % K] = T.Select(I * SUB + it * (NT // K) + tx // K < nm[0], T.float32(scale) * sl[SUB * K // NT + it] * T.exp(gam[(I * SUB + it * (NT // K) + tx // K) * GS + tx % K] - gam[(I * SUB) * GS + tx % K]), T.float32(0))
                    else:
                        for it in T.unroll(C * K // NT):
                            if it * (NT // K) + tx // K < I * SUB + SUB and it * (NT // K) + tx // K < nm[0]:
                                kb[(it * (NT // K) + tx // K) * KS + tx % K] = k[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K] * T.exp(gam[(I * SUB) * GS + tx % K] - gam[(it * (NT // K) + tx // K) * GS + tx % K])
                            else:
                                kb[(it * (NT // K) + tx // K) * KS + tx % K] = T.float32(0)
                        for it in T.unroll(SUB * K // NT):
                            if I * SUB + it * (NT // K) + tx // K < nm[0]:
                                ax[XO + (it * (NT // K) + tx // K) * KS + tx % K] = k[meta[1] + I * SUB + it * (NT // K) + tx // K, blk % H, tx % K] * T.exp(gam[(I * SUB + it * (NT // K) + tx // K) * GS + tx % K] - gam[(I * SUB) * GS + tx % K])
                                ax[QO + (it * (NT // K) + tx // K) * KS + tx % K] = T.float32(scale) * q[meta[1] + I * SUB + it * (NT // K) + tx // K, blk % H, tx % K] * T.exp(gam[(I * SUB + it * (NT // K) + tx // K) * GS + tx % K] - gam[(I * SUB) * GS + tx % K])
                            else:
                                ax[XO + (it * (NT // K) + tx // K) * KS + tx % K] = T.float32(0)
                                ax[QO + (it * (NT // K) + tx // K) * KS + tx % K] = T.float32(0)
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    nm = T.alloc_buffer((1,), "int32", scope="local")
                    nm[0] = meta[2]
                    af = T.alloc_buffer((4,), "float32", scope="local")
                    acc = T.alloc_buffer((RT, 8), "float32", scope="local")  # L tile, Aqk tile
                    for r in T.unroll(8):
                        acc[tx * EM, r] = T.float32(0)
                    if tx // 32 * 8 < I * SUB + SUB:
                        for ks in T.unroll(K // 8):
                            load_a(af, 0, lambda i, d: ax[XO + i * KS + d], tx % 32, ks * 8)
                            mma(acc, tx * EM, 0, af, 0, lambda i, d: ax[XO + i * KS + d], lambda d, j: kb[j * KS + d], tx % 32, ks * 8, tx // 32 * 8)
                            load_a(af, 0, lambda i, d: ax[QO + i * KS + d], tx % 32, ks * 8)
                            mma(acc, tx * EM, 4, af, 0, lambda i, d: ax[QO + i * KS + d], lambda d, j: kb[j * KS + d], tx % 32, ks * 8, tx // 32 * 8)
                    # entry e: row I·16 + lane//4 + 8(e//2), column 8·wi + 2(lane%4) + e%2
                    for e in T.unroll(4):
                        if tx // 32 * 8 + tx % 4 * 2 + e % 2 < I * SUB + tx % 32 // 4 + e // 2 * 8:
                            ax[(I * SUB + tx % 32 // 4 + e // 2 * 8) * C + tx // 32 * 8 + tx % 4 * 2 + e % 2] = bt[I * SUB + tx % 32 // 4 + e // 2 * 8] * acc[tx * EM, e]
                        else:
                            ax[(I * SUB + tx % 32 // 4 + e // 2 * 8) * C + tx // 32 * 8 + tx % 4 * 2 + e % 2] = T.float32(0)
                        if I * SUB + tx % 32 // 4 + e // 2 * 8 < nm[0]:
                            aqk[meta[1] + I * SUB + tx % 32 // 4 + e // 2 * 8, blk % H, tx // 32 * 8 + tx % 4 * 2 + e % 2] = T.if_then_else(tx // 32 * 8 + tx % 4 * 2 + e % 2 <= I * SUB + tx % 32 // 4 + e // 2 * 8, acc[tx * EM, 4 + e], T.float32(0))
            # phase 4: Tm = (I + L)^{-1} diag(β) (warps 0-1, column tx); k e^Γ (warps 2-7)
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                nm = T.alloc_buffer((1,), "int32", scope="local")
                nm[0] = meta[2]
                col = T.alloc_buffer((RT, C), "float32", scope="local")  # column tx of (I+L)^{-1}
                if tx < C:
                    for i in T.unroll(C):
                        col[tx * EM, i] = T.if_then_else(i == tx, T.float32(1), T.float32(0))
                    for j in T.unroll(C):
                        for i in T.unroll(C):
                            if i > j:
                                col[tx * EM, i] = col[tx * EM, i] - ax[i * C + j] * col[tx * EM, j]
                    for i in T.unroll(C):
                        ax[XO + i * MS + tx] = col[tx * EM, i] * bt[tx]
                elif HL:
                    c0 = T.alloc_buffer((1,), "int32", scope="local")
                    kl = T.alloc_buffer(((C * K + NT - C - 1) // (NT - C),), "float32", scope="local")
                    c0[0] = meta[1]
                    for it in T.unroll((C * K + NT - C - 1) // (NT - C)):
                        kl[it] = ldc(k, c0[0] + T.min((it * (NT - C) + tx - C) // K, C - 1), n_tok, blk % H, (it * (NT - C) + tx - C) % K)
                    for it in T.unroll((C * K + NT - C - 1) // (NT - C)):
                        if it * (NT - C) + tx - C < C * K:
                            kb[(it * (NT - C) + tx - C) // K * KS + (it * (NT - C) + tx - C) % K] = T.Select((it * (NT - C) + tx - C) // K < nm[0], kl[it] * T.exp(gam[((it * (NT - C) + tx - C) // K) * GS + (it * (NT - C) + tx - C) % K]), T.float32(0))
                else:
                    for it in T.unroll((C * K + NT - C - 1) // (NT - C)):
                        if it * (NT - C) + tx - C >= C * K:
                            T.evaluate(0)
                        elif (it * (NT - C) + tx - C) // K < nm[0]:
                            kb[(it * (NT - C) + tx - C) // K * KS + (it * (NT - C) + tx - C) % K] = k[meta[1] + (it * (NT - C) + tx - C) // K, blk % H, (it * (NT - C) + tx - C) % K] * T.exp(gam[((it * (NT - C) + tx - C) // K) * GS + (it * (NT - C) + tx - C) % K])
                        else:
                            kb[(it * (NT - C) + tx - C) // K * KS + (it * (NT - C) + tx - C) % K] = T.float32(0)
            # phase 4b: the v tile into Γ's space (rows past the chunk end: 0)
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                nm = T.alloc_buffer((1,), "int32", scope="local")
                nm[0] = meta[2]
                if HL:
                    c0 = T.alloc_buffer((1,), "int32", scope="local")
                    vl = T.alloc_buffer((C * V // NT,), "float32", scope="local")
                    c0[0] = meta[1]
                    for it in T.unroll(C * V // NT):
                        vl[it] = ldc(v, c0[0] + it * (NT // V) + tx // V, n_tok, blk % H, tx % V)
                    for it in T.unroll(C * V // NT):
                        gam[(it * (NT // V) + tx // V) * GS + tx % V] = T.Select(it * (NT // V) + tx // V < nm[0], vl[it], T.float32(0))
                else:
                    for it in T.unroll(C * V // NT):
                        if it * (NT // V) + tx // V < nm[0]:
                            gam[(it * (NT // V) + tx // V) * GS + tx % V] = v[meta[1] + it * (NT // V) + tx // V, blk % H, tx % V]
                        else:
                            gam[(it * (NT // V) + tx // V) * GS + tx % V] = T.float32(0)
            # phase 5: w = Tm (k e^Γ) (warps 0-3), u = Tm v (warps 4-7); warp tile: 4 m-tiles ×
            #          4 n-tiles (columns 32(wi % 4)…), k-steps ≤ the diagonal (Tm is lower triangular)
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                nm = T.alloc_buffer((1,), "int32", scope="local")
                nm[0] = meta[2]
                af = T.alloc_buffer((4,), "float32", scope="local")
                acc = T.alloc_buffer((RT, 64), "float32", scope="local")
                for r in T.unroll(64):
                    acc[tx * EM, r] = T.float32(0)
                for mi in T.unroll(C // 16):
                    for ks in T.unroll(C // 8):
                        if ks <= mi * 2 + 1:
                            load_a(af, 0, lambda i, j: ax[XO + (mi * 16 + i) * MS + j], tx % 32, ks * 8)
                            for nt in T.unroll(4):
                                if tx // 32 < 4:
                                    mma(acc, tx * EM, (mi * 4 + nt) * 4, af, 0, lambda i, j: ax[XO + (mi * 16 + i) * MS + j],
                                        lambda j, d: kb[j * KS + d], tx % 32, ks * 8, tx // 32 % 4 * 32 + nt * 8)
                                else:
                                    mma(acc, tx * EM, (mi * 4 + nt) * 4, af, 0, lambda i, j: ax[XO + (mi * 16 + i) * MS + j],
                                        lambda j, d: gam[j * GS + d], tx % 32, ks * 8, tx // 32 % 4 * 32 + nt * 8)
                for mi in T.unroll(C // 16):
                    for nt in T.unroll(4):
                        for e in T.unroll(4):
                            if mi * 16 + tx % 32 // 4 + e // 2 * 8 < nm[0]:
                                if tx // 32 < 4:
                                    w[meta[1] + mi * 16 + tx % 32 // 4 + e // 2 * 8, blk % H, tx // 32 % 4 * 32 + nt * 8 + tx % 4 * 2 + e % 2] = acc[tx * EM, (mi * 4 + nt) * 4 + e]
                                else:
                                    u[meta[1] + mi * 16 + tx % 32 // 4 + e // 2 * 8, blk % H, tx // 32 % 4 * 32 + nt * 8 + tx % 4 * 2 + e % 2] = acc[tx * EM, (mi * 4 + nt) * 4 + e]

    return kda_prefill_intra_tc if emulate else mark(kda_prefill_intra_tc)
