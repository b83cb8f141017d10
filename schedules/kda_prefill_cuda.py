"""KDA chunked prefill for CUDA over a ragged batch: two kernels, with the reference beside.

Spec §3 "KDA layer", step 5, for prefill (many tokens per sequence), in the chunked WY / UT
form of fla's ``naive_chunk_kda`` (chunk C = 64). Inputs are the preprocessed ones (q, k
L2-normalized, g the log-space decay, β after the sigmoid), as in
``schedules/kda_generic.py::kda_chunk_prefill_kernel``; the state is the pooled fp32
``kda_state[layer, slot, h]`` [K×V], read and written in place.

Per chunk (n ≤ C tokens, local index i, Γ_i = Σ_{j≤i} g_j the in-chunk cumulative decay)::

    L[i,j]  = β_i Σ_d k_i[d] k_j[d] e^{Γ_i[d] − Γ_j[d]}       (j < i)
    Tm      = (I + L)^{-1} diag(β)                            (forward substitution)
    w       = Tm (e^Γ ⊙ k),   u = Tm v
    Aqk[i,j]= scale Σ_d q_i[d] k_j[d] e^{Γ_i[d] − Γ_j[d]}     (j ≤ i)
    vn      = u − w S
    o_i     = scale (q_i ⊙ e^{Γ_i})ᵀ S + Σ_{j≤i} Aqk[i,j] vn_j
    S      ← diag(e^{Γ_last}) S + Σ_j (e^{Γ_last − Γ_j} ⊙ k_j) vn_jᵀ

Split into two kernels (as fla does), so that the part without a recurrence runs in parallel
over every chunk of every head:

1. ``kda_prefill_intra_kernel`` — one block per (chunk, head), 256 threads, tiles in shared
   memory: Γ (a column cumsum), L and Aqk, the triangular solve (one thread per column of
   (I+L)^{-1}, no barriers), w and u. Writes per token ``w, u, qg = scale·q⊙e^Γ,
   kg = e^{Γ_last−Γ}⊙k`` and ``Aqk``, per chunk ``ge = e^{Γ_last}``, to scratch tensors.
   The exponentials of L / Aqk are factored per 16-row sub-block I with the reference
   r = Γ_{16I}: ``e^{Γ_i−Γ_j} = e^{Γ_i−r}·e^{r−Γ_j}``; with the lower-bound gate
   (g > −5) both factors stay within fp32 range (e^{±80}), so 2·C·K + Σ_I 16(I+1)·K
   exps per chunk instead of C²·K.
2. ``kda_prefill_state_kernel`` — one block per (sequence, head, BV columns of V): the
   columns of the state evolve independently, so V is split over blocks to get parallelism
   where there are few heads; the chunks of a sequence run in order. Per chunk: vn = u − wS
   and the inter-chunk output qg·S (register tiles of RI×2), then S ← ge⊙S + kgᵀ vn and
   o = qg·S + Aqk vn. The state slice lives in shared memory for the whole sequence.

Chunk numbering: chunk ``id`` enumerates the chunks of sequence 0, then 1, …
(Σ_b ⌈len_b / C⌉ ≤ ⌈T/C⌉ + B of them); the intra kernel's grid is ``(⌈T/C⌉ + B) × H``
blocks and a block finds its (sequence, chunk) by a scan of ``cu_seqlens``.

Both builders take ``emulate=True`` to return the same loop nest with the block / thread
loops serial and the shared tiles as ordinary buffers, which compiles for ``llvm``: every
phase of a block is its own loop over threads (barriers between phases are inserted by
TVM's thread-sync pass on CUDA), so the serial version computes what the GPU one does —
tests/test_kda_prefill_cuda.py runs it against the reference on the CPU.

Reference: :func:`kda_prefill_reference` (NumPy float64, chunked as above), checked against
fla's ``naive_chunk_kda`` / ``naive_recurrent_kda``.
"""

from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm.script import tirx as T

from schedules.barriers import mark

C = 64       # chunk length
SHSCOPE = "shared.dyn"
NT = 256     # threads per block
SUB = 16     # sub-block of rows for the factored exponentials


def block_thread_loops(emulate: bool):
    """``(blocks, threads, shared scope)`` for the hand-written CUDA kernels: ``blocks(n)`` /
    ``threads(n)`` bind blockIdx.x / threadIdx.x and tiles live in dynamic shared memory; with
    ``emulate`` both are serial loops and the tiles ordinary (global) buffers, so that the same
    loop nest compiles for llvm and each phase runs for every thread before the next."""
    if emulate:
        return (lambda n: T.serial(n)), (lambda n: T.serial(n)), "global"
    return ((lambda n: T.thread_binding(n, thread="blockIdx.x")),
            (lambda n: T.thread_binding(n, thread="threadIdx.x")), SHSCOPE)


def max_chunks(n_tok: int, n_seq: int) -> int:
    """Rows of the per-chunk scratch ``ge``: an upper bound of Σ_b ⌈len_b / C⌉."""
    return (n_tok + C - 1) // C + n_seq


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def kda_prefill_intra_kernel(H: int, K: int, V: int, scale: float, emulate: bool = False):
    """Intra-chunk precompute, one block per (chunk, head). PrimFunc arguments::

        k, q        [T, H, K]   float32   L2-normalized
        v           [T, H, V]   float32
        g           [T, H, K]   float32   log decay (lower-bound gate: −5 < g ≤ 0)
        beta        [T, H]      float32
        cu_seqlens  [B+1]       int32
        w, qg, kg   [T, H, K]   float32   out
        u           [T, H, V]   float32   out
        aqk         [T, H, C]   float32   out (row i of the chunk's Aqk, zero above diagonal)
        ge          [NC, H, K]  float32   out, NC ≥ max_chunks(T, B)
    """
    if K != 128 or V != 128:
        raise ValueError("the prefill kernels are written for K = V = 128")
    BLK, THR, SH = block_thread_loops(emulate)
    SYNC = not emulate
    KP = K + 1  # padded row stride of tiles read down a column by a warp
    NSUB = C // SUB

    @T.prim_func(private=True)
    def kda_prefill_intra(k_h: T.handle, q_h: T.handle, v_h: T.handle, g_h: T.handle,
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
            kt = T.alloc_buffer((C, K), "float32", scope=SH)     # k tile
            vt = T.alloc_buffer((C, V), "float32", scope=SH)     # v tile
            gam = T.alloc_buffer((C, K), "float32", scope=SH)    # Γ
            bt = T.alloc_buffer((C,), "float32", scope=SH)       # β
            kb = T.alloc_buffer((C, KP), "float32", scope=SH)    # k e^{r−Γ}, then k e^Γ
            ka = T.alloc_buffer((SUB, K), "float32", scope=SH)   # k e^{Γ−r} of sub-block
            qa = T.alloc_buffer((SUB, K), "float32", scope=SH)   # scale q e^{Γ−r}
            # L (AMM[0]) and Tm (AMM[1]) in one buffer: as two buffers, TVM's shared-memory
            # merging gave them the same offset (their live ranges end / start in the same
            # thread loop), a race between the solve's reads of L and other threads' writes of Tm
            AMM = T.alloc_buffer((2, C, C), "float32", scope=SH)
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
            # phase 1: stage k, v, g, β (rows past the chunk end are zero)
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                nm = T.alloc_buffer((1,), "int32", scope="local")  # shared reads cannot sit in an if condition
                nm[0] = meta[2]
                for it in T.unroll(C * K // NT):
                    if it * (NT // K) + tx // K < nm[0]:
                        kt[it * (NT // K) + tx // K, tx % K] = k[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K]
                        vt[it * (NT // K) + tx // K, tx % K] = v[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K]
                    else:
                        kt[it * (NT // K) + tx // K, tx % K] = T.float32(0)
                        vt[it * (NT // K) + tx // K, tx % K] = T.float32(0)
                if tx < C:
                    if tx < nm[0]:
                        bt[tx] = beta[meta[1] + tx, blk % H]
                    else:
                        bt[tx] = T.float32(0)
            # phase 2: Γ = cumsum of g down each column, a running sum in a register (rows past
            #          the chunk end add 0, so Γ_{C-1} = Γ_{n-1}); thread tx sums column tx % K
            #          and writes rows of its half (no shared writes inside a loop: TVM's sync
            #          planner would want a barrier there)
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                nm = T.alloc_buffer((1,), "int32", scope="local")
                run = T.alloc_buffer((1,), "float32", scope="local")
                nm[0] = meta[2]
                run[0] = T.float32(0)
                for i in T.unroll(C):
                    run[0] = run[0] + T.if_then_else(i < nm[0], g[meta[1] + i, blk % H, tx % K], T.float32(0))
                    if i // (C * K // NT) == tx // K:
                        gam[i, tx % K] = run[0]
            # phase 3: qg, kg per token, ge per chunk
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                nm = T.alloc_buffer((1,), "int32", scope="local")  # shared reads cannot sit in an if condition
                nm[0] = meta[2]
                for it in T.unroll(C * K // NT):
                    if it * (NT // K) + tx // K < nm[0]:
                        qg[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K] = T.float32(scale) * q[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K] * T.exp(gam[it * (NT // K) + tx // K, tx % K])
                        kg[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K] = kt[it * (NT // K) + tx // K, tx % K] * T.exp(gam[C - 1, tx % K] - gam[it * (NT // K) + tx // K, tx % K])
                if tx < K and nm[0] > 0:
                    ge[blk // H, blk % H, tx] = T.exp(gam[C - 1, tx])
            # phase 4: L and Aqk, one 16-row sub-block I at a time (reference r = Γ_{16I})
            for I in range(NSUB):
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    nm = T.alloc_buffer((1,), "int32", scope="local")  # shared reads cannot sit in an if condition
                    nm[0] = meta[2]
                    for it in T.unroll(C * K // NT):
                        if it * (NT // K) + tx // K < I * SUB + SUB:
                            kb[it * (NT // K) + tx // K, tx % K] = kt[it * (NT // K) + tx // K, tx % K] * T.exp(gam[I * SUB, tx % K] - gam[it * (NT // K) + tx // K, tx % K])
                        else:
                            kb[it * (NT // K) + tx // K, tx % K] = T.float32(0)
                    for it in T.unroll(SUB * K // NT):
                        ka[it * (NT // K) + tx // K, tx % K] = kt[I * SUB + it * (NT // K) + tx // K, tx % K] * T.exp(gam[I * SUB + it * (NT // K) + tx // K, tx % K] - gam[I * SUB, tx % K])
                        if I * SUB + it * (NT // K) + tx // K < nm[0]:
                            qa[it * (NT // K) + tx // K, tx % K] = T.float32(scale) * q[meta[1] + I * SUB + it * (NT // K) + tx // K, blk % H, tx % K] * T.exp(gam[I * SUB + it * (NT // K) + tx // K, tx % K] - gam[I * SUB, tx % K])
                        else:
                            qa[it * (NT // K) + tx // K, tx % K] = T.float32(0)
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    nm = T.alloc_buffer((1,), "int32", scope="local")  # shared reads cannot sit in an if condition
                    nm[0] = meta[2]
                    acc = T.alloc_buffer((2,), "float32", scope="local")
                    for it in T.unroll(SUB * C // NT):
                        # row i = I·16 + it·4 + tx//64, column j = tx % 64
                        acc[0] = T.float32(0)
                        acc[1] = T.float32(0)
                        if tx % C <= I * SUB + it * (NT // C) + tx // C:
                            for d in range(K):
                                acc[0] = acc[0] + ka[it * (NT // C) + tx // C, d] * kb[tx % C, d]
                                acc[1] = acc[1] + qa[it * (NT // C) + tx // C, d] * kb[tx % C, d]
                        if tx % C < I * SUB + it * (NT // C) + tx // C:
                            AMM[0, I * SUB + it * (NT // C) + tx // C, tx % C] = bt[I * SUB + it * (NT // C) + tx // C] * acc[0]
                        else:
                            AMM[0, I * SUB + it * (NT // C) + tx // C, tx % C] = T.float32(0)
                        if I * SUB + it * (NT // C) + tx // C < nm[0]:
                            aqk[meta[1] + I * SUB + it * (NT // C) + tx // C, blk % H, tx % C] = acc[1]
            # phase 5: Tm = (I + L)^{-1} diag(β), one thread per column (no barriers);
            #          the other threads stage k e^Γ
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                nm = T.alloc_buffer((1,), "int32", scope="local")  # shared reads cannot sit in an if condition
                nm[0] = meta[2]
                acc = T.alloc_buffer((1,), "float32", scope="local")
                col = T.alloc_buffer((C,), "float32", scope="local")  # column tx % C of (I+L)^{-1}
                # every thread solves column tx % C (4 copies) and writes rows of its quarter
                for i in range(C):
                    if i == tx % C:
                        col[i] = T.float32(1)
                    elif i > tx % C:
                        acc[0] = T.float32(0)
                        for m in range(i - tx % C):
                            acc[0] = acc[0] - AMM[0, i, tx % C + m] * col[tx % C + m]
                        col[i] = acc[0]
                    else:
                        col[i] = T.float32(0)
                for i in T.unroll(C * C // NT):
                    AMM[1, tx // C * (C * C // NT) + i, tx % C] = col[tx // C * (C * C // NT) + i] * bt[tx % C]
                for it in T.unroll(C * K // NT):
                    kb[it * (NT // K) + tx // K, tx % K] = kt[it * (NT // K) + tx // K, tx % K] * T.exp(gam[it * (NT // K) + tx // K, tx % K])
            # phase 6: w = Tm (k e^Γ), u = Tm v
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                nm = T.alloc_buffer((1,), "int32", scope="local")  # shared reads cannot sit in an if condition
                nm[0] = meta[2]
                acc = T.alloc_buffer((2,), "float32", scope="local")
                for it in range(C * K // NT):
                    if it * (NT // K) + tx // K < nm[0]:
                        acc[0] = T.float32(0)
                        acc[1] = T.float32(0)
                        for j in range(it * (NT // K) + tx // K + 1):
                            acc[0] = acc[0] + AMM[1, it * (NT // K) + tx // K, j] * kb[j, tx % K]
                            acc[1] = acc[1] + AMM[1, it * (NT // K) + tx // K, j] * vt[j, tx % K]
                        w[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K] = acc[0]
                        u[meta[1] + it * (NT // K) + tx // K, blk % H, tx % K] = acc[1]

    # its barriers are its own (the planner rejects it): compile inside
    # schedules.barriers.respect_manual_barriers()
    return kda_prefill_intra if emulate else mark(kda_prefill_intra)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def kda_prefill_state_kernel(H: int, K: int, V: int, block_v: int = 32, emulate: bool = False):
    """Inter-chunk pass, one block per (sequence, head, ``block_v`` columns). Arguments::

        w, qg, kg   [T, H, K]        float32   from the intra kernel
        u           [T, H, V]        float32
        aqk         [T, H, C]        float32
        ge          [NC, H, K]       float32
        cu_seqlens  [B+1]            int32
        seq_slots   [B]              int32
        kda_state   [L, S, H, K, V]  float32   in place (argument index 8)
        layer       int32
        o           [T, H, V]        float32   out
    """
    BV = block_v
    if K != 128 or V % BV or BV % 2 or (C * BV) % (2 * NT) or (K * BV) % (2 * NT):
        raise ValueError(f"unsupported block_v={BV} for K={K}, V={V}")
    BLK, THR, SH = block_thread_loops(emulate)
    SYNC = not emulate
    KP = K + 1
    NVB = V // BV
    EG = BV // 2              # thread groups along the columns (2 columns each)
    NG = NT // EG             # thread groups along the rows
    RI = C // NG              # rows of vn / o per thread
    RD = K // NG              # rows of S per thread

    @T.prim_func(private=True)
    def kda_prefill_state(w_h: T.handle, u_h: T.handle, qg_h: T.handle, kg_h: T.handle,
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
            meta = T.alloc_buffer((4,), "int32", scope=SH)       # first chunk id
            St = T.alloc_buffer((K, BV), "float32", scope=SH)
            wt = T.alloc_buffer((C, KP), "float32", scope=SH)
            qt = T.alloc_buffer((C, KP), "float32", scope=SH)
            kt = T.alloc_buffer((C, KP), "float32", scope=SH)
            at = T.alloc_buffer((C, C), "float32", scope=SH)
            vn = T.alloc_buffer((C, BV), "float32", scope=SH)
            op = T.alloc_buffer((C, BV), "float32", scope=SH)
            gt = T.alloc_buffer((K,), "float32", scope=SH)
            # sequence b = blk // (H·NVB), head h = blk // NVB % H, columns (blk % NVB)·BV + e
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                acc = T.alloc_buffer((1,), "int32", scope="local")
                if tx == 0:
                    acc[0] = 0
                    for bb in range(blk // (H * NVB)):
                        acc[0] = acc[0] + (cu[bb + 1] - cu[bb] + C - 1) // C
                    meta[0] = acc[0]
                    meta[1] = acc[0]  # unused: a 1-element shared.dyn buffer trips TVM's merge pass
                for it in T.unroll(K * BV // NT):
                    St[(it * NT + tx) // BV, (it * NT + tx) % BV] = S[layer, slots[blk // (H * NVB)], blk // NVB % H, (it * NT + tx) // BV, blk % NVB * BV + (it * NT + tx) % BV]
            for c in range((cu[blk // (H * NVB) + 1] - cu[blk // (H * NVB)] + C - 1) // C):
                # stage the chunk's w, qg, kg, Aqk, u (→ vn) and ge (rows past the end: 0)
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    for it in T.unroll(C * K // NT):
                        if cu[blk // (H * NVB)] + c * C + it * (NT // K) + tx // K < cu[blk // (H * NVB) + 1]:
                            wt[it * (NT // K) + tx // K, tx % K] = w[cu[blk // (H * NVB)] + c * C + it * (NT // K) + tx // K, blk // NVB % H, tx % K]
                            qt[it * (NT // K) + tx // K, tx % K] = qg[cu[blk // (H * NVB)] + c * C + it * (NT // K) + tx // K, blk // NVB % H, tx % K]
                            kt[it * (NT // K) + tx // K, tx % K] = kg[cu[blk // (H * NVB)] + c * C + it * (NT // K) + tx // K, blk // NVB % H, tx % K]
                        else:
                            wt[it * (NT // K) + tx // K, tx % K] = T.float32(0)
                            qt[it * (NT // K) + tx // K, tx % K] = T.float32(0)
                            kt[it * (NT // K) + tx // K, tx % K] = T.float32(0)
                    for it in T.unroll(C * C // NT):
                        if cu[blk // (H * NVB)] + c * C + (it * NT + tx) // C < cu[blk // (H * NVB) + 1]:
                            at[(it * NT + tx) // C, tx % C] = aqk[cu[blk // (H * NVB)] + c * C + (it * NT + tx) // C, blk // NVB % H, tx % C]
                        else:
                            at[(it * NT + tx) // C, tx % C] = T.float32(0)
                    for it in T.unroll(C * BV // NT):
                        if cu[blk // (H * NVB)] + c * C + (it * NT + tx) // BV < cu[blk // (H * NVB) + 1]:
                            vn[(it * NT + tx) // BV, (it * NT + tx) % BV] = u[cu[blk // (H * NVB)] + c * C + (it * NT + tx) // BV, blk // NVB % H, blk % NVB * BV + (it * NT + tx) % BV]
                        else:
                            vn[(it * NT + tx) // BV, (it * NT + tx) % BV] = T.float32(0)
                    if tx < K:
                        gt[tx] = ge[meta[0] + c, blk // NVB % H, tx]
                # vn = u − w S and op = qg S; thread tile: rows tx//EG + NG·r, columns 2(tx%EG)+{0,1}
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    acc = T.alloc_buffer((RI * 4,), "float32", scope="local")
                    sv = T.alloc_buffer((2,), "float32", scope="local")
                    for r in T.unroll(RI * 4):
                        acc[r] = T.float32(0)
                    for d in range(K):
                        sv[0] = St[d, tx % EG * 2]
                        sv[1] = St[d, tx % EG * 2 + 1]
                        for r in T.unroll(RI):
                            acc[r * 4] = acc[r * 4] + wt[tx // EG + NG * r, d] * sv[0]
                            acc[r * 4 + 1] = acc[r * 4 + 1] + wt[tx // EG + NG * r, d] * sv[1]
                            acc[r * 4 + 2] = acc[r * 4 + 2] + qt[tx // EG + NG * r, d] * sv[0]
                            acc[r * 4 + 3] = acc[r * 4 + 3] + qt[tx // EG + NG * r, d] * sv[1]
                    for r in T.unroll(RI):
                        vn[tx // EG + NG * r, tx % EG * 2] = vn[tx // EG + NG * r, tx % EG * 2] - acc[r * 4]
                        vn[tx // EG + NG * r, tx % EG * 2 + 1] = vn[tx // EG + NG * r, tx % EG * 2 + 1] - acc[r * 4 + 1]
                        op[tx // EG + NG * r, tx % EG * 2] = acc[r * 4 + 2]
                        op[tx // EG + NG * r, tx % EG * 2 + 1] = acc[r * 4 + 3]
                # S ← ge ⊙ S + kgᵀ vn (rows tx//EG + NG·r), o = op + Aqk vn
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    acc = T.alloc_buffer((RD * 2,), "float32", scope="local")
                    ao = T.alloc_buffer((RI * 2,), "float32", scope="local")
                    sv = T.alloc_buffer((2,), "float32", scope="local")
                    for r in T.unroll(RD):
                        acc[r * 2] = St[tx // EG + NG * r, tx % EG * 2] * gt[tx // EG + NG * r]
                        acc[r * 2 + 1] = St[tx // EG + NG * r, tx % EG * 2 + 1] * gt[tx // EG + NG * r]
                    for r in T.unroll(RI):
                        ao[r * 2] = op[tx // EG + NG * r, tx % EG * 2]
                        ao[r * 2 + 1] = op[tx // EG + NG * r, tx % EG * 2 + 1]
                    for j in range(C):
                        sv[0] = vn[j, tx % EG * 2]
                        sv[1] = vn[j, tx % EG * 2 + 1]
                        for r in T.unroll(RD):
                            acc[r * 2] = acc[r * 2] + kt[j, tx // EG + NG * r] * sv[0]
                            acc[r * 2 + 1] = acc[r * 2 + 1] + kt[j, tx // EG + NG * r] * sv[1]
                        for r in T.unroll(RI):
                            ao[r * 2] = ao[r * 2] + at[tx // EG + NG * r, j] * sv[0]
                            ao[r * 2 + 1] = ao[r * 2 + 1] + at[tx // EG + NG * r, j] * sv[1]
                    for r in T.unroll(RD):
                        St[tx // EG + NG * r, tx % EG * 2] = acc[r * 2]
                        St[tx // EG + NG * r, tx % EG * 2 + 1] = acc[r * 2 + 1]
                    for r in T.unroll(RI):
                        if cu[blk // (H * NVB)] + c * C + tx // EG + NG * r < cu[blk // (H * NVB) + 1]:
                            o[cu[blk // (H * NVB)] + c * C + tx // EG + NG * r, blk // NVB % H, blk % NVB * BV + tx % EG * 2] = ao[r * 2]
                            o[cu[blk // (H * NVB)] + c * C + tx // EG + NG * r, blk // NVB % H, blk % NVB * BV + tx % EG * 2 + 1] = ao[r * 2 + 1]
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                for it in T.unroll(K * BV // NT):
                    S[layer, slots[blk // (H * NVB)], blk // NVB % H, (it * NT + tx) // BV, blk % NVB * BV + (it * NT + tx) % BV] = St[(it * NT + tx) // BV, (it * NT + tx) % BV]

    return kda_prefill_state if emulate else mark(kda_prefill_state)


def prefill_scratch_shapes(n_tok: int, n_seq: int, H: int, K: int = 128, V: int = 128) -> dict:
    """Shapes of the scratch tensors between the two kernels (all float32)."""
    return {"w": (n_tok, H, K), "u": (n_tok, H, V), "qg": (n_tok, H, K), "kg": (n_tok, H, K),
            "aqk": (n_tok, H, C), "ge": (max_chunks(n_tok, n_seq), H, K)}


def kda_prefill_reference(q, k, v, g, beta, cu_seqlens, seq_slots, kda_state, layer, scale,
                          chunk: int = C):
    """NumPy float64 reference of the two kernels (chunked form, partial last chunk).

    Shapes as in :func:`kda_prefill_intra_kernel`; ``kda_state`` [L, S, H, K, V] is updated
    in place. Returns ``o [T, H, V]`` float32.
    """
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    o = np.zeros(v.shape, np.float64)
    H, K = q.shape[1], q.shape[2]
    for b in range(len(cu_seqlens) - 1):
        s0, s1, slot = int(cu_seqlens[b]), int(cu_seqlens[b + 1]), int(seq_slots[b])
        for h in range(H):
            S = kda_state[layer, slot, h].astype(np.float64)
            for c0 in range(s0, s1, chunk):
                n = min(chunk, s1 - c0)
                sl = slice(c0, c0 + n)
                qc, kc, vc, bc = q[sl, h], k[sl, h], v[sl, h], beta[sl, h]
                gam = np.cumsum(g[sl, h], axis=0)                          # [n, K]
                D = np.exp(gam[:, None, :] - gam[None, :, :])              # [i, j, K]
                L = np.tril(np.einsum("id,jd,ijd->ij", kc, kc, D), -1) * bc[:, None]
                Tm = np.linalg.inv(np.eye(n) + L) * bc[None, :]
                w = Tm @ (np.exp(gam) * kc)
                u = Tm @ vc
                Aqk = np.tril(np.einsum("id,jd,ijd->ij", qc, kc, D)) * scale
                vn = u - w @ S
                o[sl, h] = scale * (qc * np.exp(gam)) @ S + Aqk @ vn
                S = np.exp(gam[-1])[:, None] * S + (np.exp(gam[-1] - gam) * kc).T @ vn
            kda_state[layer, slot, h] = S
    return o.astype(np.float32)
