"""MXFP4 MoE prefill for CUDA: token permutation into expert order and a grouped GEMM on tensor
cores over only the experts that received tokens, with the NumPy reference beside it.

Spec §3 "MoE block" (routed experts, SiTU-GLU) and §2 (MXFP4: E2M1 codes, one E8M0 scale per
32 inputs). For ``T`` tokens with ``top_k`` experts each, entry (pair) ``p = t·top_k + j``
goes to expert ``e = expert_ids[t, j]``::

    g = W1[e] z[t],  u = W3[e] z[t]                 (latent L -> expert width I)
    a[p] = SiTU(round(g), round(u))                   (fp32, rounded to bf16)
    o[p] = round(W2[e] a[p])                          (I -> L, fp32 accumulation)

— the same values as the decode kernels (schedules/moe_mxfp4_decode_tc.py) and the generic gather
GEMV (schedules/moe_generic.py); only the order of the fp32 sums differs.

Kernels (CUDA only, ``tirx.is_scheduled``; ``P = T·top_k`` pairs, ``BM`` rows per tile):

1. :func:`moe_sort_kernel` — one block: tokens per expert (shared-memory atomics), their
   exclusive scan and that of the tiles per expert ``⌈count/BM⌉`` give the tile table
   ``tiles [MAXT, 3]`` = (expert, first sorted row, end row of the expert) and ``num_tiles``
   (``MAXT = ⌈P/BM⌉ + min(P, E)`` bounds the tile count for any routing), then every pair is placed
   in expert order: ``sorted_pair [P]``.
2. :func:`moe_grouped_gate_up_kernel` — per (tile, 64 columns of I): ``a_sorted[r] =
   SiTU(W1 z, W3 z)`` for the tile's rows, tokens gathered from ``z`` through
   ``sorted_pair``; output in sorted order ``[P, I]``.
3. :func:`moe_grouped_down_kernel` — per (tile, 128 columns of L): ``o[pair(r)] = W2 a_sorted[r]``,
   written back in pair order ``[T, top_k, L]`` (the model's combine reads it unchanged).

GEMM mapping (both GEMM kernels; ``mma.sync.m16n8k16`` bf16 x bf16 -> fp32, Ampere/Hopper/
Blackwell): a block of 8 warps computes a ``BM × 128`` tile (gate_up: 64 gate + the same 64
up columns, so SiTU is applied in registers); warps are 2 (tokens) × 4 (weight rows), each
``BM/2 × 32``. The weights are the mma's A operand (m16: 16 weight rows, dequantized straight
into the four registers each A fragment needs) and the tokens its B operand (n8: 8 tokens,
one 16-byte read per token feeding the warp's 2·NU mmas of that half-step pair); with the
roles the other way round, ptxas
spent 178 moves per 64 mmas assembling A quads from two reads (5% slower at 8192 tokens).
The K loop moves 64 inputs per step through a ``STAGES``-deep ``cp.async`` pipeline (one
barrier per step): activations (bf16 rows of 128 bytes, 16-byte chunks XOR-swizzled by row
parity so that fragment reads are free of bank conflicts; rows gathered through
``sorted_pair``, rows past the expert's end zero-filled) and packed codes (rows padded to 48
bytes); the E8M0 scales of the block's 128 weight rows stay in shared memory for the whole K.
Warps (and n8 token tiles) holding no row of the expert skip their work, so the token reads
and mmas of a tile follow its rows in steps of 8 (the dequant is paid per warp, for 64 rows
at a time). Dequantization happens in registers, once per warp and reused
by all of its token tiles: a ``uint32`` of 8 codes in the tc layout
(:mod:`schedules.mxfp4_tc_layout`; the library permutes the expert codes at load time) becomes
four bf16x2 words by masked rotations (each code at the bf16 bits where it reads as its value
× 2^-126), then one ``mul.rn.bf16x2`` by the factor ``2^(s-1)`` (exact: a code has two
significant bits). The
inputs of one k-step are taken in a permuted order that makes both operands' fragments
contiguous — thread ``(g, q)`` of a warp (``g = lane/4``, ``q = lane%4``) holds inputs
``8q .. 8q+7`` of each 32, which the mma sees as its ``k = 2q, 2q+1, 2q+8, 2q+9`` (first
half-step) and the same +4 (second): one 16-byte activation read per token and one 4-byte
code read per weight row feed two mmas. A sum over k does not depend on the order of k, and the
scale group (32 inputs) is the same for all. The kernels place their own barriers
(:mod:`schedules.barriers`).

E8M0 scale bytes: ``s = 255`` (NaN) gives NaN weights, as the reference; bytes 129..254 are
outside the tc layout's range (the loader rejects them, mxfp4_tc_layout.check_scales).

On cuda-sm90a the model runs the grouped GEMMs of :mod:`schedules.moe_mxfp4_prefill_wgmma`
instead (Hopper warpgroup MMA, same tile table and outputs, 1.66× faster at 8192 tokens); the
ones here serve the other CUDA targets.

Reference: :func:`moe_prefill_plan_reference` (counts, offsets, tiles) and
``schedules.moe_mxfp4_cuda.moe_experts_reference`` (values).
"""

from __future__ import annotations

import functools

from tvm.script import tirx as T

from schedules.barriers import mark
# BM (rows = token-expert pairs per tile), the tile bound and the NumPy reference of the sort
# live in schedules/moe_plan.py, which imports no TVM: the GPU machine's runtime-only TVM
# cannot import this module, and benchmarks/moe.py checks the kernels there against it.
from schedules.moe_plan import BM, max_tiles, moe_prefill_plan_reference  # noqa: F401
from schedules.mxfp4_ptx import (commit as _commit, cp_async16 as _cp_async16, dequant8 as _dequant8,
                                 dup_half as _dup_half, mma_bf16 as _mma, wait as _wait)
from schedules.mxfp4_tc_layout import factor_bf16 as _factor_bf16

BN = 128          # weight rows per block (gate_up: 64 of W1 + 64 of W3)
BK = 64           # inputs per pipeline step
NT = 256          # threads per GEMM block (8 warps: 2 along the tokens, 4 along the weight rows)
PLAN_THREADS = 1024
WARPS_M = 2       # warps along the tokens (of 8): each warp covers BM/WARPS_M tokens × 32·WARPS_M/2 weight rows
# The permuted k order (module doc): per 32 inputs a thread holds, for A (weights), the
# ``dequant8`` words ``[0..3]`` = inputs 8q..8q+7 of weight row g (two bf16 each) and
# ``[4..7]`` the same of row g+8; for B (tokens) the four words of one 16-byte read (inputs
# 8q..8q+7 of token g). The two mma half-steps take these registers (a0..a3, b0..b1);
# tests/test_moe_prefill_cuda.py checks the order.
MMA_A_REGS = ((0, 4, 1, 5), (2, 6, 3, 7))
MMA_B_REGS = ((0, 1), (2, 3))
def weight_row(gate_up: bool, cpw: int, wn, j, g):
    """Shared-memory weight row (of the block's BN) of row ``g`` (0..7) of the 8-row group
    ``j`` of warp column ``wn``, which covers ``cpw`` weight rows: groups 2u and 2u+1 are rows
    g and g+8 of the warp's m16 tile u; gate_up: the first half of the groups are W1 rows
    (shared rows 0..63), the second half the same rows of W3 (64..127). Python ints or TIR
    expressions."""
    nj = cpw // 8
    if gate_up:
        return (j // (nj // 2)) * 64 + wn * (cpw // 2) + (j % (nj // 2)) * 8 + g
    return wn * cpw + j * 8 + g


def out_column(gate_up: bool, cpw: int, wn, u, half, g):
    """Output column, within the block's (gate_up: 64, down: BN), that C rows ``g + 8·half``
    of the warp's m16 tile u hold (gate_up: u < the warp's tiles / 2, the W1 tiles)."""
    return wn * (cpw // 2 if gate_up else cpw) + u * 16 + half * 8 + g


def acc_word(nt8: int, u, t, c):
    """Accumulator register of C element ``c`` (0..3) of the warp's (m16 tile u, n8 token
    tile t); element c is weight row g + 8·(c // 2) and token 2q + c % 2 of the tile."""
    return (u * nt8 + t) * 4 + c


SMEM_LIMIT = 227 * 1024  # dynamic shared memory per block on sm_90 / sm_100
STAGES = 3        # cp.async pipeline depth (k-steps in flight): with the tc code layout's cheaper
                  # dequant, 3 is 4-6% faster than 2 on the H200 (moe_tc_layout_h200_2026-11-30.json)
ROW_WORDS = 32    # uint32 per 64-element bf16 activation row in shared memory (16-byte chunks
                  # XOR-swizzled by row parity: conflict-free fragment reads, no padding)
B_ROW_WORDS = 12  # uint32 per packed weight row in shared memory (64 codes + 16 bytes pad)

# ----------------------------------------------------------------------------- permutation
@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_sort_kernel(num_experts: int, top_k: int, bm: int = BM, bm_large: int | None = None,
                    large_from_pairs: int | None = None, bm_small: int | None = None,
                    small_until_pairs: int | None = None):
    """Token-expert pairs into expert order, and the GEMM tile table (CUDA, one block of
    1024 threads; E ≤ 1024).

    PrimFunc arguments::

        expert_ids   [T, k]          int32   from the router
        sorted_pair  [T·k]           int32   out: pairs grouped by expert (expert 0 first)
        tiles        [MAXT, 3]       int32   out: (expert, first sorted row, expert's end row)
                                             for the first num_tiles rows (the rest untouched)
        num_tiles    [1]             int32   out: Σ_e ⌈count_e / BM⌉
        counts       [E]             int32   out: pairs per expert

    BM is ``bm``, or ``bm_large`` where the pairs (T·k) reach ``large_from_pairs`` (the tiles
    of the warp-specialized wgmma kernels, schedules/moe_mxfp4_prefill_wgmma.py, which branch
    on the same count), or ``bm_small`` below ``small_until_pairs`` (their small-tile form).

    Steps: shared-memory counters zeroed, one ``atomicAdd`` per pair; Hillis-Steele scans of
    the counts and of the tiles per expert; the counters become cursors at each expert's
    offset and a second ``atomicAdd`` pass places every pair. Every output is written without
    being read first, so the buffers need no initialisation. Pairs of one expert come in the
    order of the atomics; every GEMM row is computed on its own, so results do not depend on it.
    One block of 1024 threads, two passes over the pairs: at T = 8192, top-16, each thread
    does 128 shared-memory atomics per pass (0.2 ms on the H200).
    """
    E, K = num_experts, top_k
    TX = PLAN_THREADS
    if (bm_large is None) != (large_from_pairs is None):
        raise ValueError("bm_large and large_from_pairs go together")
    if (bm_small is None) != (small_until_pairs is None):
        raise ValueError("bm_small and small_until_pairs go together")
    SMALL = bm_small is not None
    LARGE = bm_large is not None
    BML = bm_large if LARGE else bm
    FROM = large_from_pairs if LARGE else 0
    if E > TX:
        raise ValueError(f"moe_sort_kernel handles at most {TX} experts, got {E}")
    steps = (TX - 1).bit_length()
    fin = steps % 2 * 2 * TX  # buffer holding the inclusive scans at the end

    @T.prim_func(private=True)
    def moe_sort(ids_h: T.handle, sorted_h: T.handle, tiles_h: T.handle,
                 num_tiles: T.Buffer((1,), "int32"), counts: T.Buffer((E,), "int32")):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        nt = T.int64()
        mt = T.int64()
        ids = T.match_buffer(ids_h, (nt, K), "int32")
        sorted_pair = T.match_buffer(sorted_h, (nt * K,), "int32")
        tiles = T.match_buffer(tiles_h, (mt, 3), "int32")
        for bx in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                cnt = T.alloc_buffer((TX,), "int32", scope="shared")
                sc = T.alloc_buffer((2 * 2 * TX,), "int32", scope="shared")  # [buf, {rows, tiles}, e]
                mine = T.alloc_buffer((2,), "int32", scope="local")
                tr = T.alloc_buffer((1,), "int32", scope="local")   # rows per tile
                i = T.alloc_buffer((1,), "int32", scope="local")
                p = T.alloc_buffer((1,), "int32", scope="local")
                cnt[tx] = 0
                if LARGE:
                    tr[0] = T.if_then_else(nt * K >= FROM, BML, bm)
                else:
                    tr[0] = bm
                if SMALL:
                    if nt * K < small_until_pairs:
                        tr[0] = bm_small
                T.tvm_storage_sync("shared")
                p[0] = tx
                while p[0] < T.Cast("int32", nt * K):
                    T.evaluate(T.call_extern("int32", "atomicAdd", T.address_of(cnt[ids[p[0] // K, p[0] % K]]), 1))
                    p[0] = p[0] + TX
                T.tvm_storage_sync("shared")
                mine[0] = cnt[tx]
                mine[1] = (mine[0] + tr[0] - 1) // tr[0]
                sc[tx] = mine[0]
                sc[TX + tx] = mine[1]
                for s in range(steps):
                    T.tvm_storage_sync("shared")
                    sc[(s + 1) % 2 * 2 * TX + tx] = sc[s % 2 * 2 * TX + tx] + T.if_then_else(
                        tx >= (1 << s), sc[s % 2 * 2 * TX + T.max(tx - (1 << s), 0)], 0)
                    sc[(s + 1) % 2 * 2 * TX + TX + tx] = sc[s % 2 * 2 * TX + TX + tx] + T.if_then_else(
                        tx >= (1 << s), sc[s % 2 * 2 * TX + TX + T.max(tx - (1 << s), 0)], 0)
                T.tvm_storage_sync("shared")
                # the counter becomes the cursor at the expert's first sorted row
                cnt[tx] = sc[fin + tx] - mine[0]
                if tx < E:
                    counts[tx] = mine[0]
                    i[0] = 0
                    while i[0] < mine[1]:
                        tiles[sc[fin + TX + tx] - mine[1] + i[0], 0] = tx
                        tiles[sc[fin + TX + tx] - mine[1] + i[0], 1] = sc[fin + tx] - mine[0] + i[0] * tr[0]
                        tiles[sc[fin + TX + tx] - mine[1] + i[0], 2] = sc[fin + tx]
                        i[0] = i[0] + 1
                if tx == TX - 1:
                    num_tiles[0] = sc[fin + TX + tx]
                T.tvm_storage_sync("shared")
                p[0] = tx
                while p[0] < T.Cast("int32", nt * K):
                    sorted_pair[T.call_extern("int32", "atomicAdd", T.address_of(cnt[ids[p[0] // K, p[0] % K]]), 1)] = p[0]
                    p[0] = p[0] + TX

    return moe_sort


# ----------------------------------------------------------------------------- grouped GEMM
def _grouped_gemm(kind: str, E: int, N: int, KD: int, top_k: int, beta: float = 0.0,
                  beta_lin: float | None = None, out_dtype: str = "bfloat16", stages: int = STAGES,
                  warps_m: int = WARPS_M):
    """Builder of the two grouped GEMMs (see module doc); ``N`` output columns, ``KD`` inputs.

    gate_up: args ``z [T, L] bf16, w1p, w1s, w3p, w3s, sorted_pair [P], tiles [MAXT, 3],
    num_tiles [1], a_sorted [P, I]``. down: ``a_sorted [P, I] bf16, w2p, w2s, sorted_pair,
    tiles, num_tiles, o [T, k, L]``.
    """
    K = top_k
    NS = stages
    if NS < 2:
        raise ValueError(f"stages must be at least 2, got {NS}")
    gate_up = kind == "gate_up"
    if KD % 128:  # a k-step is 64 inputs; the scale rows are read as uint32 words (4 groups)
        raise ValueError(f"input width {KD} must be a multiple of 128")
    cols = BN // 2 if gate_up else BN          # output columns per block
    if N % cols:
        raise ValueError(f"output width {N} must be a multiple of {cols}")
    NTN = N // cols
    NK = KD // BK
    KG = KD // 32                               # scale groups per row
    KGW = KG // 4                               # uint32 words of E8M0 bytes per row (global)
    KGH = KG // 2                               # uint32 words of bf16 scale pairs per row (shared)
    RW = KD // 8                                # uint32 words of packed codes per row
    if E * N * RW >= 2 ** 31:
        raise ValueError("weights too large for int32 word indexing")
    smem = NS * (BM * ROW_WORDS + BN * B_ROW_WORDS) * 4 + BN * (KG // 2) * 4 + BM * 8
    if smem > SMEM_LIMIT:
        raise ValueError(f"input width {KD} needs {smem} bytes of shared memory per block "
                         f"(limit {SMEM_LIMIT}): the scale table grows with it")
    if warps_m not in (1, 2, 4):
        raise ValueError(f"warps_m must be 1, 2 or 4, got {warps_m}")
    WMN = warps_m                               # warps along the tile's token rows
    WN = 8 // WMN                               # warps along its weight rows
    WM = BM // WMN                              # token rows per warp
    NT8 = WM // 8                               # n8 tiles (8 tokens: the mma's B columns) per warp
    CPW = BN // WN                              # weight rows per warp
    NJ = CPW // 8                               # 8-row groups of weight rows per warp
    NU = CPW // 16                              # m16 tiles (16 weight rows: the mma's A) per warp
    if NU < (2 if gate_up else 1):
        raise ValueError(f"warps_m={warps_m} leaves {CPW} weight rows per warp: too few for the mma's 16 "
                         f"rows{' of W1 and of W3' if gate_up else ''}")
    A_CH = BM * (BK // 8) // NT                 # 16-byte activation chunks per thread per step
    B = float(beta)
    BL = float(beta_lin) if beta_lin is not None else 0.0
    use_bl = beta_lin is not None

    (A0, A1), (B0, B1) = MMA_A_REGS, MMA_B_REGS  # registers of the two mma half-steps

    def b_row(wn, j, g):
        return weight_row(gate_up, CPW, wn, j, g)

    @T.macro
    def issue(step, a_s, b_s, row_s, xf, wq0, wq1, tiles, blk, tx):
        """cp.async of k-step ``step`` (activations and packed codes) into stage step % NS."""
        for c in T.unroll(A_CH):
            T.evaluate(_cp_async16(
                T.address_of(a_s[(step % NS * BM + (c * NT + tx) // 8) * ROW_WORDS
                                 + ((c * NT + tx) % 8 ^ (c * NT + tx) // 8 % 2 * 4) * 4]),
                T.address_of(xf[T.max(row_s[(c * NT + tx) // 8], T.int64(0)) + step * BK + (c * NT + tx) % 8 * 8]),
                row_s[(c * NT + tx) // 8] >= T.int64(0)))
        if gate_up:
            if tx // 2 < 64:
                T.evaluate(_cp_async16(
                    T.address_of(b_s[(step % NS * BN + tx // 2) * B_ROW_WORDS + tx % 2 * 4]),
                    T.address_of(wq0[(tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * 64
                                      + tx // 2) * RW + step * (BK // 8) + tx % 2 * 4]), 1))
            else:
                T.evaluate(_cp_async16(
                    T.address_of(b_s[(step % NS * BN + tx // 2) * B_ROW_WORDS + tx % 2 * 4]),
                    T.address_of(wq1[(tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * 64
                                      + tx // 2 - 64) * RW + step * (BK // 8) + tx % 2 * 4]), 1))
        else:
            T.evaluate(_cp_async16(
                T.address_of(b_s[(step % NS * BN + tx // 2) * B_ROW_WORDS + tx % 2 * 4]),
                T.address_of(wq0[(tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * BN
                                  + tx // 2) * RW + step * (BK // 8) + tx % 2 * 4]), 1))

    @T.macro
    def grouped(xf, wq0, wq1, sq0, sq1, sorted_pair, tiles, num_tiles, y, nt, mt):
        """The kernel on the buffers and views of :func:`grouped_gemm_primfunc`."""
        for blk in T.thread_binding(mt * NTN, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                a_s = T.alloc_buffer((NS * BM * ROW_WORDS,), "uint32", scope="shared.dyn")
                b_s = T.alloc_buffer((NS * BN * B_ROW_WORDS,), "uint32", scope="shared.dyn")
                sc_s = T.alloc_buffer((BN * KGH,), "uint32", scope="shared.dyn")
                sw = T.alloc_buffer((1,), "uint32", scope="local")
                row_s = T.alloc_buffer((BM,), "int64", scope="shared.dyn")  # element offset of the row in x, or -1
                acc = T.alloc_buffer((NU * NT8 * 4,), "float32", scope="local")
                bf = T.alloc_buffer((NJ * 4,), "uint32", scope="local")
                ar = T.alloc_buffer((4,), "uint32", scope="local")
                ok = T.alloc_buffer((1,), "int64", scope="local")
                nv = T.alloc_buffer((1,), "int32", scope="local")
                if T.Cast("int32", blk // NTN) < num_tiles[0]:
                    nv[0] = tiles[blk // NTN, 2] - tiles[blk // NTN, 1]  # rows of the expert from here
                    # ---- tile metadata: gathered rows, scales of the block's weight rows
                    if tx < BM:
                        if gate_up:
                            row_s[tx] = T.if_then_else(
                                tiles[blk // NTN, 1] + tx < tiles[blk // NTN, 2],
                                T.Cast("int64", sorted_pair[T.min(tiles[blk // NTN, 1] + tx, T.Cast("int32", nt * K) - 1)] // K) * KD,
                                T.int64(-1))
                        else:
                            row_s[tx] = T.if_then_else(
                                tiles[blk // NTN, 1] + tx < tiles[blk // NTN, 2],
                                T.Cast("int64", tiles[blk // NTN, 1] + tx) * KD, T.int64(-1))
                    # scales of the block's weight rows for the whole K, as bf16 (word = 2 groups)
                    for it in range((BN * KGW + NT - 1) // NT):
                        if it * NT + tx < BN * KGW:
                            sw[0] = block_scale_word(gate_up, sq0, sq1, tiles, blk, it * NT + tx, N, NTN, KGW)
                            for h in T.unroll(2):
                                sc_s[(it * NT + tx) * 2 + h] = _factor_bf16(
                                    (sw[0] >> T.uint32(16 * h)) & T.uint32(255)) | (_factor_bf16(
                                        (sw[0] >> T.uint32(16 * h + 8)) & T.uint32(255)) << T.uint32(16))
                    for i in range(NU * NT8 * 4):
                        acc[i] = T.float32(0)
                    T.tvm_storage_sync("shared.dyn")
                    # ---- K loop: NS-deep cp.async pipeline, one barrier per step
                    for st in T.unroll(NS - 1):
                        if st < NK:
                            issue(st, a_s, b_s, row_s, xf, wq0, wq1, tiles, blk, tx)
                        T.evaluate(_commit())
                    for ks in range(NK):
                        T.evaluate(_wait(NS - 2))
                        T.tvm_storage_sync("shared.dyn")
                        # refill the stage computed in the previous step
                        if ks + NS - 1 < NK:
                            issue(ks + NS - 1, a_s, b_s, row_s, xf, wq0, wq1, tiles, blk, tx)
                        T.evaluate(_commit())
                        if tx // (32 * WN) * WM < nv[0]:  # the warp has rows in this tile
                            for hk in T.unroll(2):
                                # A: the warp's weight rows (m16 tile u: rows g and g+8), dequantized
                                # straight into the registers the mma takes (no moves)
                                for j in T.unroll(NJ):
                                    T.evaluate(_dequant8(
                                        T.address_of(bf[j * 4]),
                                        b_s[(ks % NS * BN + b_row(tx // 32 % WN, j, tx % 32 // 4))
                                            * B_ROW_WORDS + hk * 4 + tx % 4],
                                        _dup_half(sc_s[b_row(tx // 32 % WN, j, tx % 32 // 4) * KGH + ks], hk),
                                        ))
                                for t in T.unroll(NT8):
                                    # n8 token tiles past the expert's last row are skipped (warp-uniform)
                                    if tx // (32 * WN) * WM + t * 8 < nv[0]:
                                        # B: token g of the tile, inputs 8q .. 8q+7 (one 16-byte read)
                                        for v in T.vectorized(4):
                                            ar[v] = a_s[(ks % NS * BM + tx // (32 * WN) * WM + t * 8 + tx % 32 // 4)
                                                        * ROW_WORDS + ((hk * 4 + tx % 4) ^ (tx % 32 // 4 % 2 * 4)) * 4 + v]
                                        for u in T.unroll(NU):
                                            T.evaluate(_mma(T.address_of(acc[acc_word(NT8, u, t, 0)]),
                                                            bf[u * 8 + A0[0]], bf[u * 8 + A0[1]],
                                                            bf[u * 8 + A0[2]], bf[u * 8 + A0[3]],
                                                            ar[B0[0]], ar[B0[1]]))
                                            T.evaluate(_mma(T.address_of(acc[acc_word(NT8, u, t, 0)]),
                                                            bf[u * 8 + A1[0]], bf[u * 8 + A1[1]],
                                                            bf[u * 8 + A1[2]], bf[u * 8 + A1[3]],
                                                            ar[B1[0]], ar[B1[1]]))
                    # ---- epilogue: c0, c1 = weight row g, tokens 2q, 2q+1; c2, c3 = row g+8
                    for t in T.unroll(NT8):
                        for q in T.unroll(4):
                            # (a shared-memory read in an if condition trips TVM's sync planner)
                            ok[0] = row_s[tx // (32 * WN) * WM + t * 8 + tx % 4 * 2 + q % 2]
                            if ok[0] >= T.int64(0):
                                if gate_up:
                                    for u in T.unroll(NU // 2):
                                        y[tiles[blk // NTN, 1] + tx // (32 * WN) * WM + t * 8 + tx % 4 * 2 + q % 2,
                                          T.Cast("int32", blk % NTN) * 64
                                          + out_column(True, CPW, tx // 32 % WN, u, q // 2, tx % 32 // 4)] = \
                                            T.Cast(out_dtype, situ_expr(
                                                T.Cast("float32", T.Cast("bfloat16", acc[acc_word(NT8, u, t, q)])),
                                                T.Cast("float32", T.Cast("bfloat16", acc[acc_word(NT8, u + NU // 2, t, q)])),
                                                B, BL, use_bl))
                                else:
                                    for u in T.unroll(NU):
                                        y[sorted_pair[tiles[blk // NTN, 1] + tx // (32 * WN) * WM + t * 8 + tx % 4 * 2 + q % 2] // K,
                                          sorted_pair[tiles[blk // NTN, 1] + tx // (32 * WN) * WM + t * 8 + tx % 4 * 2 + q % 2] % K,
                                          T.Cast("int32", blk % NTN) * BN
                                          + out_column(False, CPW, tx // 32 % WN, u, q // 2, tx % 32 // 4)] = \
                                            T.Cast(out_dtype, acc[acc_word(NT8, u, t, q)])

    # its barriers are its own (TVM's planner cannot follow the cp.async pipeline):
    # compile inside schedules.barriers.respect_manual_barriers()
    return grouped_gemm_primfunc(kind, E, N, KD, top_k, out_dtype, grouped)


def block_scale_word(gate_up: bool, sq0, sq1, tiles, blk, w, N: int, NTN: int, KGW: int):
    """uint32 word ``w`` (of ``BN · KGW``) of the E8M0 scale bytes of grouped-GEMM block
    ``blk``'s weight rows: word ``w % KGW`` of block row ``w // KGW``, where the block covers
    column tile ``blk % NTN`` of the tile table entry ``blk // NTN``'s expert (gate_up: rows
    0..63 from W1's scales ``sq0``, 64..127 the same rows from W3's ``sq1``; down: BN rows of
    ``sq0``). A TIR expression; shared by the ``mma.sync`` and wgmma kernels."""
    if gate_up:
        return T.if_then_else(
            w // KGW < 64,
            sq0[(tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * 64 + w // KGW) * KGW + w % KGW],
            sq1[(tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * 64 + w // KGW - 64) * KGW + w % KGW])
    return sq0[(tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * BN + w // KGW) * KGW + w % KGW]


def situ_expr(g, u, beta, beta_lin, use_bl):
    """SiTU-GLU (spec §3) of fp32 TIR expressions: ``β·tanh(g/β)·σ(g) · u'`` with
    ``u' = β_lin·tanh(u/β_lin)`` (``use_bl``) or ``u``."""
    up = T.float32(beta_lin) * T.tanh(u * T.float32(1.0 / beta_lin)) if use_bl else u
    return T.float32(beta) * T.tanh(g * T.float32(1.0 / beta)) * T.sigmoid(g) * up


def grouped_gemm_primfunc(kind: str, E: int, N: int, KD: int, top_k: int, out_dtype: str, body,
                          ws_body=None, ws_from: int = 0, small_body=None, small_until: int = 0):
    """The PrimFunc of a grouped GEMM (both kernel families): the arguments of
    :func:`_grouped_gemm` matched to buffers, the flat uint32 / bf16 views every body reads
    (``xf``, ``wq0``, ``wq1``, ``sq0``, ``sq1``), then the kernel body — ``body``, or with
    ``ws_body`` a host-side branch to it where the pairs (tokens · top_k) reach ``ws_from``
    (schedules/moe_mxfp4_prefill_wgmma.py's warp-specialized form), and with ``small_body`` one
    to it below ``small_until`` pairs (its small-tile form). A body is a ``T.macro``
    taking ``(xf, wq0, wq1, sq0, sq1, sorted_pair, tiles, num_tiles, y, nt, mt)``. Barriers
    are placed by hand: compile inside schedules.barriers.respect_manual_barriers()."""
    K = top_k
    KG = KD // 32
    KGW = KG // 4
    RW = KD // 8
    gate_up = kind == "gate_up"
    BOTH = ws_body is not None
    SMALL = small_body is not None

    @T.prim_func(private=True)
    def grouped(x_h: T.handle, wp0_h: T.handle, ws0_h: T.handle, wp1_h: T.handle, ws1_h: T.handle,
                sorted_h: T.handle, tiles_h: T.handle, num_tiles: T.Buffer((1,), "int32"),
                y_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        nt = T.int64()
        mt = T.int64()
        if gate_up:
            x = T.match_buffer(x_h, (nt, KD), "bfloat16")
            y = T.match_buffer(y_h, (nt * K, N), out_dtype)
        else:
            y = T.match_buffer(y_h, (nt, K, N), out_dtype)
            x = T.match_buffer(x_h, (nt * K, KD), "bfloat16")
        wp0 = T.match_buffer(wp0_h, (E, N, KD // 2), "uint8")
        ws0 = T.match_buffer(ws0_h, (E, N, KG), "uint8")
        wp1 = T.match_buffer(wp1_h, (E, N, KD // 2), "uint8")
        ws1 = T.match_buffer(ws1_h, (E, N, KG), "uint8")
        sorted_pair = T.match_buffer(sorted_h, (nt * K,), "int32")
        tiles = T.match_buffer(tiles_h, (mt, 3), "int32")
        xf = T.decl_buffer((x.shape[0] * KD,), "bfloat16", data=x.data)
        wq0 = T.decl_buffer((E * N * RW,), "uint32", data=wp0.data)
        wq1 = T.decl_buffer((E * N * RW,), "uint32", data=wp1.data)
        sq0 = T.decl_buffer((E * N * KGW,), "uint32", data=ws0.data)
        sq1 = T.decl_buffer((E * N * KGW,), "uint32", data=ws1.data)
        if SMALL and BOTH:
            if nt * K >= ws_from:
                ws_body(xf, wq0, wq1, sq0, sq1, sorted_pair, tiles, num_tiles, y, nt, mt)
            elif nt * K < small_until:
                small_body(xf, wq0, wq1, sq0, sq1, sorted_pair, tiles, num_tiles, y, nt, mt)
            else:
                body(xf, wq0, wq1, sq0, sq1, sorted_pair, tiles, num_tiles, y, nt, mt)
        elif BOTH:
            if nt * K >= ws_from:
                ws_body(xf, wq0, wq1, sq0, sq1, sorted_pair, tiles, num_tiles, y, nt, mt)
            else:
                body(xf, wq0, wq1, sq0, sq1, sorted_pair, tiles, num_tiles, y, nt, mt)
        else:
            body(xf, wq0, wq1, sq0, sq1, sorted_pair, tiles, num_tiles, y, nt, mt)

    return mark(grouped)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_grouped_gate_up_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                               beta: float, beta_lin: float | None, out_dtype: str = "bfloat16",
                               stages: int = STAGES, warps_m: int = WARPS_M):
    """Grouped MXFP4 GEMM for W1/W3 with SiTU fused (CUDA, ``tirx.is_scheduled``).

    PrimFunc arguments::

        z            [T, L]          bf16    latent activations
        w1_packed    [E, I, L/2]     uint8   w1_scale [E, I, L/32] uint8   (codes in the tc layout)
        w3_packed    [E, I, L/2]     uint8   w3_scale [E, I, L/32] uint8
        sorted_pair  [T·k]           int32   from moe_sort
        tiles        [MAXT, 3]       int32   from moe_sort
        num_tiles    [1]             int32
        a_sorted     [T·k, I]        bf16    row r = SiTU(round(W1 z), round(W3 z)) of pair sorted_pair[r]

    L and I must be multiples of 128. Grid: ``MAXT × I/64`` blocks of 256 threads;
    blocks past ``num_tiles`` exit at once.
    """
    return _grouped_gemm("gate_up", num_experts, inter, latent, top_k, beta, beta_lin, out_dtype, stages,
                         warps_m)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_grouped_down_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                            out_dtype: str = "bfloat16", stages: int = STAGES, warps_m: int = WARPS_M):
    """Grouped MXFP4 GEMM for W2 (CUDA, ``tirx.is_scheduled``).

    PrimFunc arguments::

        a_sorted     [T·k, I]        bf16
        w2_packed    [E, L, I/2]     uint8   w2_scale [E, L, I/32] uint8   (codes in the tc layout)
        w2_packed, w2_scale          (passed twice: the builder shares the gate_up signature)
        sorted_pair  [T·k]           int32
        tiles        [MAXT, 3]       int32
        num_tiles    [1]             int32
        o            [T, k, L]       out_dtype  entry sorted_pair[r] = round(W2 a_sorted[r])

    I must be a multiple of 128, L of 128.
    """
    return _grouped_gemm("down", num_experts, latent, inter, top_k, out_dtype=out_dtype, stages=stages,
                         warps_m=warps_m)
