"""MXFP4 MoE expert GEMVs for CUDA decode on tensor cores (routed experts of spec §3 "MoE
block"): the same math and arguments as :mod:`schedules.moe_mxfp4_cuda`, with the dot products
done by ``mma.sync.m16n8k16`` instead of CUDA-core FMAs.

Why: the CUDA-core GEMVs spend ~5-6 instructions per E2M1 code (dequant to fp32, FMA) and are
instruction-bound at ~52% of the HBM roofline (ncu, benchmarks/results/
moe_decode_ncu_h200_2026-11-29.txt). Here a code costs ~2.7 instructions (``prmt`` dequant
to bf16, :mod:`schedules.mxfp4_ptx`) and the products go to the tensor cores. The tokens that
chose the same expert are the rows of the mma's A operand (up to 16 per pass), so each
distinct expert's weights are streamed once for all of them; for one token 15 of the 16 rows
are zero, which costs tensor-core time that is free here.

Mapping: a warp owns 8 weight rows (the mma's n8; gate_up: the same 8 rows of W1 and W3);
a block of ``NW`` warps owns ``8·NW`` rows; one block per (entry, row tile), and only the
block of an expert's first entry (``chain[.., 0] == 1``, :func:`schedules.moe_mxfp4_cuda.
moe_expert_chain_kernel`) works: it walks the chain, 16 entries per pass. K goes in blocks of
128 inputs: thread ``(g, q) = (lane/4, lane%4)`` loads 16 bytes of weight row ``g`` — inputs
``32q .. 32q+31`` of the block, one E8M0 scale group — and dequantizes them with that group's
scale; for mma step ``s`` (0..7) it supplies inputs ``32q + 4s + {0,1}`` as the mma's
``k = 2q, 2q+1`` and ``32q + 4s + {2,3}`` as ``k = 2q+8, 2q+9`` (a bijection of the 16 k of
each step, applied to A — 8 bytes of activations of entries ``g`` and ``g+8`` — and B alike).
The next block's weights are loaded before the current one is used. fp32 accumulation; the
outputs are rounded as the model's dtype flow says (relax_modules/moe.py).

Status (H200, benchmarks/results/moe_h200_2026-11-29.json, same run as the CUDA-core
kernels): correct (T = 7 with shared experts, ≤ 1 bf16 ulp); 0.157 ms = 42% of the HBM
roofline at T = 1 (CUDA-core: 0.131 ms, 51%), 50% at T = 8 (54%), 49% at T = 64 (36%: 1.35×
faster there, where chains are long). Variants in the same run: one K block in flight
instead of four, 39-47%; 8 warps per block, 40-47%. Not dispatched. What limits it at one
token is not the prefetch depth (above); candidates: the per-thread 1-byte scale loads
(8 sectors per warp request), 15 of 16 mma rows idle, 20 warps per SM at 96 registers.

Reference: ``schedules.moe_mxfp4_cuda.moe_experts_reference``.
"""

from __future__ import annotations

from tvm.script import tirx as T

from schedules.barriers import mark
from schedules.moe_mxfp4_prefill_cuda import situ_expr
from schedules.mxfp4_ptx import dequant8, dup_half, mma_bf16, scale_bf16

KB = 128        # inputs per K block (4 lanes × 32 codes)
ROWS = 16       # mma rows = entries per pass over a chain


def _check(kd: int, n: int, rows_per_block: int, E: int):
    if kd % KB:
        raise ValueError(f"input width {kd} must be a multiple of {KB}")
    if n % rows_per_block:
        raise ValueError(f"output width {n} must be a multiple of the rows per block {rows_per_block}")
    if E * n * (kd // 8) >= 2 ** 31:
        raise ValueError("weights too large for int32 word indexing")


def _gemv_tc(kind: str, E: int, N: int, KD: int, top_k: int, beta: float = 0.0,
             beta_lin: float | None = None, out_dtype: str = "bfloat16", warps: int = 4,
             prefetch: int = 4):
    """Builder of both kernels (``kind`` "gate_up": two weight matrices + SiTU; "down": one)."""
    K = top_k
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 1, 2, 4, 8 or 16, got {warps}")
    if prefetch < 1:
        raise ValueError(f"prefetch must be at least 1 K block, got {prefetch}")
    NW = warps
    NT = 32 * NW
    RB = 8 * NW
    _check(KD, N, RB, E)
    NTILE = N // RB
    NKB = KD // KB
    PF = next(p for p in (prefetch, 2, 1) if NKB % p == 0)  # K blocks in flight per thread
    RW = KD // 8                 # uint32 words per packed weight row
    KG = KD // 32                # scale groups per row
    XW = KD // 2                 # uint32 words per activation row
    gate_up = kind == "gate_up"
    NM = 2 if gate_up else 1
    B = float(beta)
    BL = float(beta_lin) if beta_lin is not None else 0.0
    use_bl = beta_lin is not None

    def xrow(entry):
        """Activation row of an entry: its token (gate_up reads z) or itself (down reads a)."""
        return entry // K if gate_up else entry

    @T.macro
    def load_weights(dst, off, kb, wq0, wq1, sb0, sb1, rowg, tx):
        """Thread's 16 bytes (32 codes) of each matrix for K block ``kb``, and their scales,
        into ``dst[off : off + 10]``."""
        for v in T.vectorized(4):
            dst[off + v] = wq0[rowg * RW + kb * 16 + tx % 4 * 4 + v]
        dst[off + 8] = T.Cast("uint32", sb0[rowg * KG + kb * 4 + tx % 4])
        if gate_up:
            for v in T.vectorized(4):
                dst[off + 4 + v] = wq1[rowg * RW + kb * 16 + tx % 4 * 4 + v]
            dst[off + 9] = T.Cast("uint32", sb1[rowg * KG + kb * 4 + tx % 4])

    @T.macro
    def body(nt, xq, wq0, wq1, sb0, sb1, chain, ids, y):
        for blk in T.thread_binding(nt * K * NTILE, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                ent_s = T.alloc_buffer((ROWS + 1,), "int32", scope="shared")  # entries; [ROWS] = next
                cnt_s = T.alloc_buffer((1,), "int32", scope="shared")
                wcur = T.alloc_buffer((10,), "uint32", scope="local")
                ring = T.alloc_buffer((PF * 10,), "uint32", scope="local")
                bf = T.alloc_buffer((2 * 4,), "uint32", scope="local")
                xa = T.alloc_buffer((2,), "uint32", scope="local")
                xb = T.alloc_buffer((2,), "uint32", scope="local")
                acc = T.alloc_buffer((8,), "float32", scope="local")
                s2 = T.alloc_buffer((2,), "uint32", scope="local")
                rr = T.alloc_buffer((3,), "int32", scope="local")  # row of g, entries of g and g+8
                cur = T.alloc_buffer((1,), "int32", scope="local")
                if chain[T.Cast("int32", blk // NTILE) // K, T.Cast("int32", blk // NTILE) % K, 0] == 1:
                    rr[0] = ids[T.Cast("int32", blk // NTILE) // K, T.Cast("int32", blk // NTILE) % K] * N \
                        + T.Cast("int32", blk % NTILE) * RB + tx // 32 * 8 + tx % 32 // 4
                    cur[0] = T.Cast("int32", blk // NTILE)
                    while cur[0] >= 0:
                        # ---- up to 16 entries of the chain
                        if tx == 0:
                            cnt_s[0] = 0
                            for _i in range(ROWS):
                                if cur[0] >= 0:
                                    ent_s[cnt_s[0]] = cur[0]
                                    cnt_s[0] = cnt_s[0] + 1
                                    cur[0] = chain[cur[0] // K, cur[0] % K, 1]
                            ent_s[ROWS] = cur[0]
                        T.tvm_storage_sync("shared")
                        rr[1] = T.if_then_else(tx % 32 // 4 < cnt_s[0], ent_s[tx % 32 // 4], -1)
                        rr[2] = T.if_then_else(tx % 32 // 4 + 8 < cnt_s[0], ent_s[tx % 32 // 4 + 8], -1)
                        cur[0] = ent_s[ROWS]
                        for i in T.unroll(8):
                            acc[i] = T.float32(0)
                        # K blocks PF ahead in a register ring
                        for r in T.unroll(PF):
                            load_weights(ring, r * 10, r, wq0, wq1, sb0, sb1, rr[0], tx)
                        for kb0 in range(NKB // PF):
                            for r in T.unroll(PF):
                                for v in T.unroll(10):
                                    wcur[v] = ring[r * 10 + v]
                                if kb0 * PF + r + PF < NKB:
                                    load_weights(ring, r * 10, kb0 * PF + r + PF, wq0, wq1, sb0, sb1, rr[0], tx)
                                for m in T.unroll(NM):
                                    s2[m] = dup_half(scale_bf16(wcur[8 + m]), 0)
                                for s in T.unroll(8):
                                    if s % 2 == 0:
                                        for m in T.unroll(NM):
                                            T.evaluate(dequant8(T.address_of(bf[m * 4]), wcur[m * 4 + s // 2], s2[m]))
                                    # activations of entries g and g + 8: inputs 32q + 4s .. +3
                                    for v in T.unroll(2):
                                        xa[v] = T.uint32(0)
                                        xb[v] = T.uint32(0)
                                    if rr[1] >= 0:
                                        for v in T.vectorized(2):
                                            xa[v] = xq[xrow(rr[1]) * XW + (kb0 * PF + r) * 64 + tx % 4 * 16 + 2 * s + v]
                                    if rr[2] >= 0:
                                        for v in T.vectorized(2):
                                            xb[v] = xq[xrow(rr[2]) * XW + (kb0 * PF + r) * 64 + tx % 4 * 16 + 2 * s + v]
                                    for m in T.unroll(NM):
                                        T.evaluate(mma_bf16(T.address_of(acc[m * 4]), xa[0], xb[0], xa[1], xb[1],
                                                            bf[m * 4 + s % 2 * 2], bf[m * 4 + s % 2 * 2 + 1]))
                        # ---- outputs: c0, c1 -> entry g, rows 2q, 2q+1 of the warp; c2, c3 -> entry g+8
                        for h in T.unroll(2):
                            if rr[1 + h] >= 0:
                                for c in T.unroll(2):
                                    if gate_up:
                                        y[rr[1 + h] // K, rr[1 + h] % K,
                                          T.Cast("int32", blk % NTILE) * RB + tx // 32 * 8 + tx % 4 * 2 + c] = T.Cast(
                                            out_dtype, situ_expr(T.Cast("float32", T.Cast("bfloat16", acc[h * 2 + c])),
                                                             T.Cast("float32", T.Cast("bfloat16", acc[4 + h * 2 + c])),
                                                             B, BL, use_bl))
                                    else:
                                        y[rr[1 + h] // K, rr[1 + h] % K,
                                          T.Cast("int32", blk % NTILE) * RB + tx // 32 * 8 + tx % 4 * 2 + c] = \
                                            T.Cast(out_dtype, acc[h * 2 + c])
                        T.tvm_storage_sync("shared")

    if gate_up:
        @T.prim_func(private=True)
        def moe_mxfp4_gate_up_tc(z_h: T.handle, w1p_h: T.handle, w1s_h: T.handle, w3p_h: T.handle,
                                 w3s_h: T.handle, chain_h: T.handle, ids_h: T.handle, a_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            nt = T.int64()
            z = T.match_buffer(z_h, (nt, KD), "bfloat16")
            w1p = T.match_buffer(w1p_h, (E, N, KD // 2), "uint8")
            w1s = T.match_buffer(w1s_h, (E, N, KG), "uint8")
            w3p = T.match_buffer(w3p_h, (E, N, KD // 2), "uint8")
            w3s = T.match_buffer(w3s_h, (E, N, KG), "uint8")
            chain = T.match_buffer(chain_h, (nt, K, 2), "int32")
            ids = T.match_buffer(ids_h, (nt, K), "int32")
            a = T.match_buffer(a_h, (nt, K, N), out_dtype)
            zq = T.decl_buffer((nt * XW,), "uint32", data=z.data)
            w1q = T.decl_buffer((E * N * RW,), "uint32", data=w1p.data)
            w3q = T.decl_buffer((E * N * RW,), "uint32", data=w3p.data)
            w1b = T.decl_buffer((E * N * KG,), "uint8", data=w1s.data)
            w3b = T.decl_buffer((E * N * KG,), "uint8", data=w3s.data)
            body(nt, zq, w1q, w3q, w1b, w3b, chain, ids, a)

        func = moe_mxfp4_gate_up_tc
    else:
        @T.prim_func(private=True)
        def moe_mxfp4_down_tc(a_h: T.handle, w2p_h: T.handle, w2s_h: T.handle, chain_h: T.handle,
                              ids_h: T.handle, o_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            nt = T.int64()
            a = T.match_buffer(a_h, (nt, K, KD), "bfloat16")
            w2p = T.match_buffer(w2p_h, (E, N, KD // 2), "uint8")
            w2s = T.match_buffer(w2s_h, (E, N, KG), "uint8")
            chain = T.match_buffer(chain_h, (nt, K, 2), "int32")
            ids = T.match_buffer(ids_h, (nt, K), "int32")
            o = T.match_buffer(o_h, (nt, K, N), out_dtype)
            aq = T.decl_buffer((nt * K * XW,), "uint32", data=a.data)
            w2q = T.decl_buffer((E * N * RW,), "uint32", data=w2p.data)
            w2b = T.decl_buffer((E * N * KG,), "uint8", data=w2s.data)
            body(nt, aq, w2q, w2q, w2b, w2b, chain, ids, o)

        func = moe_mxfp4_down_tc

    # barriers placed by hand (one per chain pass): compile inside
    # schedules.barriers.respect_manual_barriers()
    return mark(func)


def moe_mxfp4_gate_up_tc_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                                beta: float, beta_lin: float | None, out_dtype: str = "bfloat16",
                                warps: int = 4, prefetch: int = 4):
    """Fused W1/W3 GEMV + SiTU on tensor cores. Arguments as
    :func:`schedules.moe_mxfp4_cuda.moe_mxfp4_gate_up_kernel`: ``z [T, L] bf16, w1_packed,
    w1_scale, w3_packed, w3_scale, chain [T, k, 2], expert_ids [T, k], a [T, k, I]``.
    L must be a multiple of 128, I of ``8·warps``; ``prefetch`` K blocks of 128 inputs are in
    flight per thread (fewer where they do not divide the K blocks)."""
    return _gemv_tc("gate_up", num_experts, inter, latent, top_k, beta, beta_lin, out_dtype, warps, prefetch)


def moe_mxfp4_down_tc_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                             out_dtype: str = "bfloat16", warps: int = 4, prefetch: int = 4):
    """W2 GEMV on tensor cores. Arguments as :func:`schedules.moe_mxfp4_cuda.
    moe_mxfp4_down_kernel`: ``a [T, k, I] bf16, w2_packed, w2_scale, chain, expert_ids, o [T, k, L]``.
    I must be a multiple of 128, L of ``8·warps``."""
    return _gemv_tc("down", num_experts, latent, inter, top_k, out_dtype=out_dtype, warps=warps,
                    prefetch=prefetch)
