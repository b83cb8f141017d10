"""MXFP4 MoE expert GEMVs for CUDA decode on tensor cores (routed experts of spec §3 "MoE
block"): the math and arguments of :mod:`schedules.moe_mxfp4_cuda` (the CUDA-core GEMVs, kept
as the benchmark's baseline), with the dot products done by ``mma.sync.m16n8k16``.
Dispatched by the model for CUDA decode (relax_modules/moe.py ``RoutedExperts``).

Why: the CUDA-core GEMVs spend ~6 instructions per E2M1 code (dequant to fp32, FMA) and are
instruction-bound at ~52% of the HBM roofline. Here the codes are in the tc layout
(:mod:`schedules.mxfp4_tc_layout`, permuted at load time): masked rotations and one
``mul.rn.bf16x2`` by ``2^(s-1)`` give the bf16 mma operands (:func:`schedules.mxfp4_ptx.
dequant8`, 13 instructions per 8 codes), the products run on the tensor cores.

Mapping. Weights are the mma's A operand: a block owns 16 rows of one expert (m16; gate_up:
the same 16 rows of W1 and W3), and its ``warps`` warps split K, each taking an equal run of
K blocks of 128 inputs; their partial sums meet in shared memory at the end. The entries
(token, choice) that chose the expert are the B columns (n8): one block per (entry, row
tile), and only the block of an expert's first entry (``chain[.., 0] == 1``,
:func:`schedules.moe_mxfp4_cuda.moe_expert_chain_kernel`) works, walking the chain 8 entries
per pass, so each distinct expert is streamed once for all its tokens (a later pass re-reads
it from L2). Thread ``(g, q) = (lane/4, lane%4)`` owns rows ``g`` and ``g+8`` and column
``g``; in a K block it takes inputs ``32q .. 32q+31`` (16 bytes per row = one scale group)
and for mma step ``s`` (0..7) supplies inputs ``32q + 4s + {0,1}`` as ``k = 2q, 2q+1`` and
``32q + 4s + {2,3}`` as ``k = 2q+8, 2q+9`` — a bijection of each step's 16 k, applied to A and
to B (the column's activations, read from L1) alike.

Pipeline: per thread, ``stages`` K blocks in flight as ``cp.async`` copies (16 bytes per row
and matrix, 4 bytes of scales; the weight copies ask L2 for the aligned 128 bytes around
them, ``l2_prefetch``) into the thread's own shared-memory slots: a thread reads back
only what it copied, so ``cp.async.wait_group`` suffices and no barrier is needed in the K
loop; registers stay below 100 (gate_up), so 5 blocks of 4 warps fit on an SM. Splitting K
over the warps (rather than rows) gives 3072 blocks for W1/W3 at one token instead of 768,
i.e. 4.7 waves instead of 1.2 (a partial second wave left most SMs idle).

fp32 accumulation; the outputs are rounded as the model's dtype flow says
(relax_modules/moe.py).

Status (H200, K3 shapes, GPU time of chain + gate_up + down): with the L2 hint 77–78% /
79–81% / 74–78% of the HBM roofline at 1 / 8 / 64 tokens (benchmarks/results/
moe_decode_l2pf_h200_2026-12-02.json, _b_); before it (moe_decode_tuned_h200_2026-11-30.json,
_variants_, _parts_, _skipx_, _pair_, _final_) 70–73% / 76–80% / 71–74% with the defaults (tc
layout, ``chains=2``, ``unroll``; W2 with ``skip_x``, ``pair`` and 3 stages); the previous version (prmt look-ups on the
checkpoint layout, one chain, rolled loop) 57–58% / 61–62% / 57–59% in the same runs, the
CUDA-core GEMVs 52–53% / 55% / 35–36%. Chains and unrolling turned the K loop from
latency-bound (8 dependent mmas per K block) into overlapped work. Per kernel at one token
(graph replays): W1/W3 81% of its share of the roofline, W2 59% — ncu: W2 is bound by the
L1/TEX pipe (84%), where each lane's 64-byte activation read weighs twice what it does in W1/W3
(one matrix instead of two); ``skip_x`` (only the lanes of real columns load) brings W2 to 65%
(slower for W1/W3, so off there); ``pair`` (two row tiles as the two matrices) helps W2 at 8
and 64 tokens (1.27 -> 1.15 ms at 64). Tried and not faster (options since removed): 2–8 row
tiles per block through one pipeline (the ramp and the partial last wave are not what
limits), capping W1/W3 at 5 blocks per SM with ``__launch_bounds__`` (spills; W2 at 5 blocks
without spills: no faster, moe_decode_mxfp8_h200_2026-11-30.json), a register ring
instead of cp.async stages, 2 or 8 warps per block, deeper stages.

``act="mxfp8"`` builds the W4A8 form (MXFP8 activations, :mod:`schedules.mxfp8_act`):
measured at 0.80–0.90× the speed of this W4A16 form, not dispatched.

Reference: ``schedules.moe_mxfp4_cuda.moe_experts_reference``; the fragment mapping is
checked on the CPU (tests/test_moe_prefill_cuda.py), the kernels on the H200 by
``benchmarks/moe.py run`` (every variant at T = 7 and T = 20, a chain of 3 passes).
"""

from __future__ import annotations

import functools

from tvm.script import tirx as T

from schedules.barriers import mark
from schedules.moe_mxfp4_prefill_cuda import situ_expr
from schedules import mxfp8_act as A8
from schedules.mxfp4_ptx import (check_l2_prefetch, commit, cp_async4, cp_async16, dequant8, factor_bf16x2,
                                 mma_bf16, mma_e4m3, wait)

KB = 128        # inputs per K block (4 lanes × 32 codes)
COLS = 8        # mma columns = entries per pass over a chain (the mma's n8)


def _round(x, rnd: bool, dtype: str):
    """fp32 ``x`` rounded to ``dtype`` and back (the model rounds the w1/w3 outputs to its
    dtype before SiTU, relax_modules/moe.py); ``x`` itself if ``rnd`` is false."""
    return T.Cast("float32", T.Cast(dtype, x)) if rnd else x


def _check(kd: int, n: int, rows_per_block: int, E: int):
    if kd % KB:
        raise ValueError(f"input width {kd} must be a multiple of {KB}")
    if n % rows_per_block:
        raise ValueError(f"output width {n} must be a multiple of the rows per block {rows_per_block}")
    if E * n * (kd // 8) >= 2 ** 31:
        raise ValueError(f"{E} experts x {n} rows x {kd // 8} words = {E * n * (kd // 8)} uint32 "
                         f"words of codes: over the int32 indexing limit 2^31")


def _gemv_tc(kind: str, E: int, N: int, KD: int, top_k: int, beta: float = 0.0,
             beta_lin: float | None = None, out_dtype: str = "bfloat16", warps: int = 4,
             stages: int = 4, chains: int = 1, unroll: bool = False, skip_x: bool = False,
             pair: bool = False, act: str = "bf16", l2_prefetch: int = 0):
    """Builder of both kernels (``kind`` "gate_up": two weight matrices + SiTU; "down": one).
    ``chains``: accumulators per matrix, mma step ``s`` adding into chain ``s % chains`` (shorter
    dependency chains of mmas); ``unroll``: unroll the K loop; ``skip_x``: lanes of columns past
    the pass's entries do not load activations; ``pair`` (down): a block is two row tiles of 16, the
    second taken as the mma's second matrix (as W3 in gate_up), so the activations each lane
    loads feed twice the rows; ``act``: "bf16" activations (m16n8k16 bf16 mmas on the tc
    layout) or "mxfp8" (E4M3 + E8M0 per 32, :mod:`schedules.mxfp8_act`: one m16n8k32 E4M3 mma per
    scale group on the fp8 layout, its product scaled into the fp32 accumulators)."""
    K = top_k
    if act not in ("bf16", "mxfp8"):
        raise ValueError(f"act must be 'bf16' or 'mxfp8', got {act!r}")
    fp8 = act == "mxfp8"
    if chains not in (1, 2, 4, 8):
        raise ValueError(f"chains must be 1, 2, 4 or 8, got {chains}")
    CH = 1 if fp8 else chains   # mxfp8: each E4M3 mma starts from zero, no chain to split
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 1, 2, 4, 8 or 16, got {warps}")
    if stages < 2:
        raise ValueError(f"stages must be at least 2, got {stages}")
    check_l2_prefetch(l2_prefetch)   # before any TVMScript parsing, which would wrap the error
    NW = warps
    NT = 32 * NW
    RB = 16                      # weight rows per matrix tile (the mma's m16); the warps split K
    if pair and kind == "gate_up":
        raise ValueError("pair is for the down kernel (gate_up already pairs W1 with W3)")
    NP = 2 if pair else 1        # row tiles of 16 per block
    ROW1 = RB if pair else 0     # rows from the first matrix to the second (W3: same rows)
    BR = RB * NP                 # weight rows per block
    _check(KD, N, BR, E)
    NTILE = N // BR              # blocks per entry
    NKB = KD // KB
    if NKB % NW:
        raise ValueError(f"the {NKB} K blocks of 128 inputs must split evenly over {NW} warps")
    KPW = NKB // NW              # K blocks per warp
    NS = stages
    RW = KD // 8                 # uint32 words per packed weight row
    KG = KD // 32                # scale groups per row (a multiple of 4: KD % 128 == 0)
    XW = KD // 4 if fp8 else KD // 2   # uint32 words per activation row
    gate_up = kind == "gate_up"
    NM = 2 if gate_up or pair else 1
    SLOTS = NM * 2               # (matrix, row g / g+8) chunks per thread per stage
    # code and scale stages, split-K partials, the pass's entries and count (64-byte aligned)
    smem = NS * SLOTS * NT * (16 + 4) + NW * NM * 4 * 32 * 4 + 2 * 64
    if smem > 48 * 1024:
        raise ValueError(f"{NS} stages of {NW} warps need {smem} bytes of shared memory (> 48 KiB)")
    B = float(beta)
    BL = float(beta_lin) if beta_lin is not None else 0.0
    use_bl = beta_lin is not None
    rnd = out_dtype != "float32"

    def xrow(entry):
        """Activation row of an entry: its token (gate_up reads z) or itself (down reads a)."""
        return entry // K if gate_up else entry

    @T.macro
    def issue(kb, j, w_s, s_s, wq, sw, slot0, row, tx):
        """cp.async of the thread's 16 bytes (32 codes = one scale group, inputs
        ``kb·128 + 32q ..``) of rows ``row`` and ``row + 8`` of one matrix, and of the 4 scale
        bytes of each row's K block (lane q's is byte q), into stage ``j % NS`` (``j``: the
        warp's own K-block count), slots
        ``slot0``, ``slot0 + 1``: each thread reads back only what it copied itself."""
        for h in T.unroll(2):
            T.evaluate(cp_async16(T.address_of(w_s[((j % NS * SLOTS + slot0 + h) * NT + tx) * 4]),
                                  T.address_of(wq[(row + h * 8) * RW + kb * 16 + tx % 4 * 4]), 1,
                                  l2_prefetch))
            T.evaluate(cp_async4(T.address_of(s_s[(j % NS * SLOTS + slot0 + h) * NT + tx]),
                                 T.address_of(sw[(row + h * 8) * (KG // 4) + kb])))

    @T.macro
    def load_x(dst, kb, xq, xr, q):
        """Thread's 32 activations of activation row ``xr`` into ``dst``: bf16, ``dst[0:16]`` =
        inputs ``kb·128 + 32q ..`` (64 bytes); mxfp8, ``dst[2G], dst[2G+1]`` = inputs
        ``kb·128 + 32G + 8q .. +7`` of each scale group ``G`` (4 × 8 bytes)."""
        if fp8:
            for G in T.unroll(4):
                for v in T.vectorized(2):
                    dst[fp8_x_slot(G, v)] = xq[xr * XW + kb * 32 + fp8_x_word(G, q, v)]
        else:
            for i in T.unroll(4):
                for v in T.vectorized(4):
                    dst[i * 4 + v] = xq[xr * XW + kb * 64 + q * 16 + i * 4 + v]

    @T.macro
    def mma_fp8(wcur, s2, sa, c4, xcur, acc):
        """The K block's 4 scale groups × ``NM`` matrices: an E4M3 mma per (group, matrix) into
        ``c4``, added to the accumulators times the (row, column) scale product."""
        for sl in T.unroll(SLOTS):
            s2[sl] = s2[sl] + T.uint32(A8.WEIGHT_BIAS4)
        for G in T.unroll(4):
            for m in T.unroll(NM):
                T.evaluate(mma_e4m3(T.address_of(c4[0]),
                                    fp8_a_register(wcur, m, G, 0), fp8_a_register(wcur, m, G, 1),
                                    fp8_a_register(wcur, m, G, 2), fp8_a_register(wcur, m, G, 3),
                                    xcur[fp8_x_slot(G, 0)], xcur[fp8_x_slot(G, 1)]))
                for i in T.unroll(4):
                    acc[m * 4 + i] = acc[m * 4 + i] + c4[i] * (
                        A8.scale_factor(s2[m * 2 + fp8_scale_of(i)[0]], G) * A8.scale_factor(sa[fp8_scale_of(i)[1]], G))

    @T.macro
    def kstep(kb, w_s, s_s, wq0, wq1, sw0, sw1, xq, xs, xcur, wcur, s2, bf, acc, rr, sa, c4, tx):
        """K block ``kb`` of the warp: refill the stage ``NS - 1`` ahead, then dequantize and
        multiply the one that has landed."""
        if kb + NS - 1 < KPW:
            issue(rr[3] + kb + NS - 1, kb + NS - 1, w_s, s_s, wq0, sw0, 0, rr[0], tx)
            if NM == 2:
                issue(rr[3] + kb + NS - 1, kb + NS - 1, w_s, s_s, wq1, sw1, 2, rr[0] + ROW1, tx)
        T.evaluate(commit())
        # activations from L1 (every block of the pass reads the same rows)
        if skip_x:
            # only lanes of the pass's columns load (B column g feeds only C column g, which is
            # not stored past the entries): one token's pass reads 1/8 of the activation bytes
            if rr[4] != 0:
                load_x(xcur, rr[3] + kb, xq, rr[1], tx % 4)
        else:
            load_x(xcur, rr[3] + kb, xq, rr[1], tx % 4)
        if fp8:  # the scale words (4 groups) of the activation rows of columns 2q, 2q+1
            for c in T.unroll(2):
                sa[c] = xs[rr[5 + c] * (KG // 4) + rr[3] + kb]
        T.evaluate(wait(NS - 1))  # K block kb has landed
        for sl in T.unroll(SLOTS):
            for v in T.vectorized(4):
                wcur[sl * 4 + v] = w_s[((kb % NS * SLOTS + sl) * NT + tx) * 4 + v]
            if fp8:
                s2[sl] = s_s[(kb % NS * SLOTS + sl) * NT + tx]
            else:
                s2[sl] = factor_bf16x2(s_s[(kb % NS * SLOTS + sl) * NT + tx], tx % 4)
        if fp8:
            mma_fp8(wcur, s2, sa, c4, xcur, acc)
        else:
            for s in T.unroll(8):
                if s % 2 == 0:
                    for sl in T.unroll(SLOTS):
                        T.evaluate(dequant8(T.address_of(bf[sl * 4]), wcur[sl * 4 + s // 2], s2[sl]))
                # A: rows g / g+8 at k (2q, 2q+1) and (2q+8, 2q+9) = inputs
                # 32q + 4s + {0, 1} and {2, 3}; B: the same inputs of column g
                for m in T.unroll(NM):
                    T.evaluate(mma_bf16(T.address_of(acc[(s % CH * NM + m) * 4]),
                                        bf[m * 8 + a_word(s, 0)], bf[m * 8 + a_word(s, 1)],
                                        bf[m * 8 + a_word(s, 2)], bf[m * 8 + a_word(s, 3)],
                                        xcur[b_word(s, 0)], xcur[b_word(s, 1)]))

    @T.macro
    def one_pass(w_s, s_s, red_s, wq0, wq1, sw0, sw1, xq, xs, xcur, wcur, s2, bf, acc, rr, sa, c4, ent_s, cnt_s,
                 y, blk, tx):
        """The block's rows for the pass's entries: K loop, split-K reduction, outputs."""
        for i in T.unroll(CH * NM * 4):
            acc[i] = T.float32(0)
        if unroll:
            for kb in T.unroll(KPW):
                kstep(kb, w_s, s_s, wq0, wq1, sw0, sw1, xq, xs, xcur, wcur, s2, bf, acc, rr, sa, c4, tx)
        else:
            for kb in range(KPW):
                kstep(kb, w_s, s_s, wq0, wq1, sw0, sw1, xq, xs, xcur, wcur, s2, bf, acc, rr, sa, c4, tx)
        # ---- the accumulator chains of each matrix summed into chain 0
        for c in T.unroll(1, CH):
            for i in T.unroll(NM * 4):
                acc[i] = acc[i] + acc[c * NM * 4 + i]
        # ---- split-K: the warps' partial sums meet in shared memory, warp 0 adds them
        for i in T.unroll(NM * 4):
            red_s[(tx // 32 * NM * 4 + i) * 32 + tx % 32] = acc[i]
        T.tvm_storage_sync("shared")
        if tx < 32:
            for w in T.unroll(1, NW):
                for i in T.unroll(NM * 4):
                    acc[i] = acc[i] + red_s[(w * NM * 4 + i) * 32 + tx]
        # ---- outputs: c0, c1 -> row g, columns 2q, 2q+1; c2, c3 -> row g+8
        for c in T.unroll(2):
            if tx < 32 and tx % 4 * 2 + c < cnt_s[0]:
                for h in T.unroll(2):
                    if gate_up:
                        y[ent_s[tx % 4 * 2 + c] // K, ent_s[tx % 4 * 2 + c] % K,
                          T.Cast("int32", blk % NTILE) * BR + tx % 32 // 4 + h * 8] = T.Cast(
                            out_dtype, situ_expr(_round(acc[h * 2 + c], rnd, out_dtype),
                                                 _round(acc[4 + h * 2 + c], rnd, out_dtype),
                                                 B, BL, use_bl))
                    else:
                        for m in T.unroll(NM):
                            y[ent_s[tx % 4 * 2 + c] // K, ent_s[tx % 4 * 2 + c] % K,
                              T.Cast("int32", blk % NTILE) * BR + m * RB + tx % 32 // 4 + h * 8] = \
                                T.Cast(out_dtype, acc[m * 4 + h * 2 + c])
        T.tvm_storage_sync("shared")

    @T.macro
    def body(nt, xq, xs, wq0, wq1, sw0, sw1, chain, ids, y):
        """The kernel: one block per (entry slot, row tile); allocations, then the chain passes."""
        for blk in T.thread_binding(nt * K * NTILE, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                ent_s = T.alloc_buffer((COLS + 1,), "int32", scope="shared")  # entries; [COLS] = next
                cnt_s = T.alloc_buffer((1,), "int32", scope="shared")
                w_s = T.alloc_buffer((NS * SLOTS * NT * 4,), "uint32", scope="shared")
                s_s = T.alloc_buffer((NS * SLOTS * NT,), "uint32", scope="shared")
                red_s = T.alloc_buffer((NW * NM * 4 * 32,), "float32", scope="shared")  # split-K partials
                wcur = T.alloc_buffer((SLOTS * 4,), "uint32", scope="local")
                xcur = T.alloc_buffer((16,), "uint32", scope="local")
                bf = T.alloc_buffer((SLOTS * 4,), "uint32", scope="local")
                # chain c of matrix m: acc[(c * NM + m) * 4 ..] (chain 0 = the layout used after the K loop)
                acc = T.alloc_buffer((CH * NM * 4,), "float32", scope="local")
                s2 = T.alloc_buffer((SLOTS,), "uint32", scope="local")
                sa = T.alloc_buffer((2,), "uint32", scope="local")     # mxfp8: columns 2q, 2q+1
                c4 = T.alloc_buffer((4,), "float32", scope="local")    # mxfp8: one mma's product
                # [0] weight row g of the block's 16 rows, [1] activation row of column g,
                # [2] chain cursor, [3] first K block of this warp, [4] column g holds an entry,
                # [5], [6] activation rows of columns 2q, 2q+1 (their scales, mxfp8)
                rr = T.alloc_buffer((7 if fp8 else 5,), "int32", scope="local")
                # (the row is read before the chain test so that both loads are in flight at once)
                rr[0] = ids[T.Cast("int32", blk // NTILE) // K, T.Cast("int32", blk // NTILE) % K] * N \
                    + T.Cast("int32", blk % NTILE) * BR + tx % 32 // 4
                rr[3] = tx // 32 * KPW
                if chain[T.Cast("int32", blk // NTILE) // K, T.Cast("int32", blk // NTILE) % K, 0] == 1:
                    rr[2] = T.Cast("int32", blk // NTILE)
                    while rr[2] >= 0:
                        # the first stages of weights: they do not depend on the chain (a later
                        # pass re-reads them, from L2)
                        for r in T.unroll(NS - 1):
                            if r < KPW:
                                issue(rr[3] + r, r, w_s, s_s, wq0, sw0, 0, rr[0], tx)
                                if NM == 2:
                                    issue(rr[3] + r, r, w_s, s_s, wq1, sw1, 2, rr[0] + ROW1, tx)
                            T.evaluate(commit())
                        # ---- up to 8 entries of the chain = the mma's columns
                        if tx == 0:
                            cnt_s[0] = 0
                            for _i in range(COLS):
                                if rr[2] >= 0:
                                    ent_s[cnt_s[0]] = rr[2]
                                    cnt_s[0] = cnt_s[0] + 1
                                    rr[2] = chain[rr[2] // K, rr[2] % K, 1]
                            ent_s[COLS] = rr[2]
                        T.tvm_storage_sync("shared")
                        # column g's activation row; columns past the pass's entries repeat the
                        # last one (B column g only feeds C column g, which is then not stored)
                        rr[1] = xrow(ent_s[T.min(tx % 32 // 4, cnt_s[0] - 1)])
                        rr[4] = T.Cast("int32", tx % 32 // 4 < cnt_s[0])  # column g holds an entry
                        if fp8:
                            for c in T.unroll(2):
                                rr[5 + c] = xrow(ent_s[T.min(tx % 4 * 2 + c, cnt_s[0] - 1)])
                        rr[2] = ent_s[COLS]
                        one_pass(w_s, s_s, red_s, wq0, wq1, sw0, sw1, xq, xs, xcur, wcur, s2, bf, acc, rr,
                                 sa, c4, ent_s, cnt_s, y, blk, tx)

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
            w1b = T.decl_buffer((E * N * KG // 4,), "uint32", data=w1s.data)
            w3b = T.decl_buffer((E * N * KG // 4,), "uint32", data=w3s.data)
            body(nt, zq, zq, w1q, w3q, w1b, w3b, chain, ids, a)

        @T.prim_func(private=True)
        def moe_mxfp4_gate_up_tc_mxfp8(z_h: T.handle, zs_h: T.handle, w1p_h: T.handle, w1s_h: T.handle,
                                       w3p_h: T.handle, w3s_h: T.handle, chain_h: T.handle, ids_h: T.handle,
                                       a_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            nt = T.int64()
            z = T.match_buffer(z_h, (nt, KD), "uint8")
            zs = T.match_buffer(zs_h, (nt, KG), "uint8")
            w1p = T.match_buffer(w1p_h, (E, N, KD // 2), "uint8")
            w1s = T.match_buffer(w1s_h, (E, N, KG), "uint8")
            w3p = T.match_buffer(w3p_h, (E, N, KD // 2), "uint8")
            w3s = T.match_buffer(w3s_h, (E, N, KG), "uint8")
            chain = T.match_buffer(chain_h, (nt, K, 2), "int32")
            ids = T.match_buffer(ids_h, (nt, K), "int32")
            a = T.match_buffer(a_h, (nt, K, N), out_dtype)
            zq = T.decl_buffer((nt * XW,), "uint32", data=z.data)
            zsq = T.decl_buffer((nt * KG // 4,), "uint32", data=zs.data)
            w1q = T.decl_buffer((E * N * RW,), "uint32", data=w1p.data)
            w3q = T.decl_buffer((E * N * RW,), "uint32", data=w3p.data)
            w1b = T.decl_buffer((E * N * KG // 4,), "uint32", data=w1s.data)
            w3b = T.decl_buffer((E * N * KG // 4,), "uint32", data=w3s.data)
            body(nt, zq, zsq, w1q, w3q, w1b, w3b, chain, ids, a)

        func = moe_mxfp4_gate_up_tc_mxfp8 if fp8 else moe_mxfp4_gate_up_tc
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
            w2b = T.decl_buffer((E * N * KG // 4,), "uint32", data=w2s.data)
            body(nt, aq, aq, w2q, w2q, w2b, w2b, chain, ids, o)

        @T.prim_func(private=True)
        def moe_mxfp4_down_tc_mxfp8(a_h: T.handle, as_h: T.handle, w2p_h: T.handle, w2s_h: T.handle,
                                    chain_h: T.handle, ids_h: T.handle, o_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            nt = T.int64()
            a = T.match_buffer(a_h, (nt, K, KD), "uint8")
            a_s = T.match_buffer(as_h, (nt, K, KG), "uint8")
            w2p = T.match_buffer(w2p_h, (E, N, KD // 2), "uint8")
            w2s = T.match_buffer(w2s_h, (E, N, KG), "uint8")
            chain = T.match_buffer(chain_h, (nt, K, 2), "int32")
            ids = T.match_buffer(ids_h, (nt, K), "int32")
            o = T.match_buffer(o_h, (nt, K, N), out_dtype)
            aq = T.decl_buffer((nt * K * XW,), "uint32", data=a.data)
            asq = T.decl_buffer((nt * K * KG // 4,), "uint32", data=a_s.data)
            w2q = T.decl_buffer((E * N * RW,), "uint32", data=w2p.data)
            w2b = T.decl_buffer((E * N * KG // 4,), "uint32", data=w2s.data)
            body(nt, aq, asq, w2q, w2q, w2b, w2b, chain, ids, o)

        func = moe_mxfp4_down_tc_mxfp8 if fp8 else moe_mxfp4_down_tc

    # barriers placed by hand (one per chain pass): compile inside
    # schedules.barriers.respect_manual_barriers()
    return mark(func)


def a_word(s, i):
    """Index, in a matrix's 8 dequantized words (rows g: 0..3, g+8: 4..7; word w = inputs
    2w, 2w+1 of the code word being used), of mma A register ``a_i`` at step ``s`` (0..7):
    a0 / a1 = rows g / g+8 at inputs 4s + {0, 1}, a2 / a3 = the same rows at 4s + {2, 3}
    (of the lane's 32). Python ints or TIR expressions."""
    return s % 2 * 2 + i % 2 * 4 + i // 2


def b_word(s, j):
    """Index, in the lane's 16 activation words (word w = inputs 2w, 2w+1 of its 32), of mma B
    register ``b_j`` at step ``s``: inputs 4s + {0, 1} (b0) and 4s + {2, 3} (b1)."""
    return 2 * s + j


def fp8_a_source(i):
    """(row half ``h``, word half) of mma A register ``a_i`` (0..3) in the mxfp8 form: a0 / a1 =
    rows g / g+8 (``h`` 0 / 1) from :func:`~schedules.mxfp8_act.e4m3_lo` (half 0, k 4q..4q+3),
    a2 / a3 the same rows from :func:`~schedules.mxfp8_act.e4m3_hi` (half 1, k 16+4q..)."""
    return i % 2, i // 2


def fp8_a_register(wcur, m, G, i):
    """TIR expression of mma A register ``a_i`` for scale group ``G`` of matrix ``m``, from the
    thread's code words ``wcur`` (slot ``2m + h`` holds row ``g + 8h``; its word ``G`` the 8
    codes of group ``G``), as :func:`fp8_a_source` says."""
    h, half = fp8_a_source(i)
    w = wcur[(m * 2 + h) * 4 + G]
    return A8.e4m3_lo(w) if half == 0 else A8.e4m3_hi(w)


def fp8_x_slot(G, j):
    """Index, in the thread's activation words ``xcur`` (mxfp8 form), of mma B register ``b_j``
    of scale group ``G``."""
    return 2 * G + j


def fp8_x_word(G, q, j):
    """Word offset, in a K block's 32 words of an MXFP8 activation row, of lane ``q``'s B
    register ``b_j`` of group ``G``: inputs ``32G + 8q + 4j .. +3`` (k ``16j + 4q ..`` of the
    mma, as :func:`fp8_a_register`'s lo / hi halves)."""
    return G * 8 + q * 2 + j


def fp8_scale_of(i):
    """(weight row half, activation column) of mma output ``c_i``: c0 / c1 = row g, columns 2q /
    2q+1; c2 / c3 = row g+8 (PTX ISA C fragment): its weight scale is slot ``2m + row half``'s,
    its activation scale that of column ``2q + column``."""
    return i // 2, i % 2


def split_k_warps(in_width: int) -> int:
    """Warps per block (= ways the K blocks of 128 inputs are split) for an input width: 4
    where they divide the K blocks (K3: 28 and 24 K blocks), else 2 or 1 (k3-nano)."""
    nkb = in_width // KB
    return next(w for w in (4, 2, 1) if nkb % w == 0)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_mxfp4_gate_up_tc_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                                beta: float, beta_lin: float | None, out_dtype: str = "bfloat16",
                                warps: int = 4, stages: int = 4, chains: int = 2, unroll: bool = True,
                                skip_x: bool = False, act: str = "bf16", l2_prefetch: int = 128):
    """Fused W1/W3 GEMV + SiTU on tensor cores. Arguments as
    :func:`schedules.moe_mxfp4_cuda.moe_mxfp4_gate_up_kernel`, codes in the tc layout
    (:mod:`schedules.mxfp4_tc_layout`): ``z [T, L] bf16, w1_packed,
    w1_scale, w3_packed, w3_scale, chain [T, k, 2], expert_ids [T, k], a [T, k, I]``.
    ``act="mxfp8"``: ``z`` is MXFP8 (``z [T, L]`` uint8 E4M3 and ``z_scale [T, L/32]`` uint8
    E8M0 from :func:`schedules.mxfp8_act.quantize_kernel`, two arguments), the codes are in
    the fp8 layout (:mod:`schedules.mxfp8_act`), weight scale bytes up to
    ``mxfp8_act.MAX_WEIGHT_SCALE_BYTE``, and ``chains`` does not apply (each E4M3 mma starts
    from zero). ``l2_prefetch`` (0, 64, 128 or 256): the weight copies' L2 prefetch-size
    hint in bytes (:func:`schedules.mxfp4_ptx.cp_async16`), 0 for none; 128 (L2 fetches the
    aligned 128 bytes around each 64-byte K block of a row) took 3% / 0–2% / 3–4% less time at
    1 / 8 / 64 tokens on the H200, 256 about as much, 64 none (benchmarks/results/
    moe_decode_l2pf_h200_2026-12-02.json, ``_b_``).

    Raises:
        ValueError: ``act`` not "bf16" or "mxfp8"; ``chains`` not 1, 2, 4 or 8;
            L not a multiple of 128; I not a multiple of 16; ``warps`` not 1, 2, 4, 8
            or 16 or not dividing L/128; ``stages < 2``; ``l2_prefetch`` not 0, 64, 128 or
            256; the stages (10 KiB each at 4 warps) and the other buffers over 48 KiB of
            shared memory; the codes over 2^31 words.
    """
    return _gemv_tc("gate_up", num_experts, inter, latent, top_k, beta, beta_lin, out_dtype, warps, stages,
                    chains, unroll, skip_x, act=act, l2_prefetch=l2_prefetch)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_mxfp4_down_tc_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                             out_dtype: str = "bfloat16", warps: int = 4, stages: int = 3,
                             chains: int = 2, unroll: bool = True, skip_x: bool = True,
                             pair: bool = True, act: str = "bf16", l2_prefetch: int = 128):
    """W2 GEMV on tensor cores. Arguments as :func:`schedules.moe_mxfp4_cuda.
    moe_mxfp4_down_kernel`, codes in the tc layout: ``a [T, k, I] bf16, w2_packed, w2_scale, chain, expert_ids, o [T, k, L]``.
    ``act="mxfp8"``: ``a`` is MXFP8 (``a [T, k, I]`` uint8 E4M3 and ``a_scale [T, k, I/32]``
    uint8 E8M0), the codes are in the fp8 layout (:mod:`schedules.mxfp8_act`), weight scale
    bytes up to ``mxfp8_act.MAX_WEIGHT_SCALE_BYTE``; ``chains`` does not apply.
    ``l2_prefetch``: as in :func:`moe_mxfp4_gate_up_tc_kernel`.

    Raises:
        ValueError: ``act`` not "bf16" or "mxfp8"; ``chains`` not 1, 2, 4 or 8;
            I not a multiple of 128; L not a multiple of 32 (16 without ``pair``);
            ``warps`` not 1, 2, 4, 8 or 16 or not dividing I/128; ``stages < 2``;
            ``l2_prefetch`` not 0, 64, 128 or 256; the stages (10 KiB each at 4 warps with
            ``pair``) and the other buffers over 48 KiB of shared memory; the codes over 2^31
            words.
    """
    return _gemv_tc("down", num_experts, latent, inter, top_k, out_dtype=out_dtype, warps=warps,
                    stages=stages, chains=chains, unroll=unroll, skip_x=skip_x, pair=pair, act=act,
                    l2_prefetch=l2_prefetch)
