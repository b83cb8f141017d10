"""MXFP4 MoE prefill grouped GEMMs on Hopper warpgroup MMA (``wgmma``, sm_90a): the tile
table, math and outputs of :mod:`schedules.moe_mxfp4_prefill_cuda` (the ``mma.sync`` kernels,
kept for other CUDA targets), with the tokens read by the tensor cores from shared memory.

Why: the ``mma.sync`` kernels issue one instruction per 16×8×16 product and read every token
fragment into registers; at 8192 tokens they are issue-bound at ~26% of the bf16 peak. One
``wgmma.m64n128k16`` covers 64 weight rows × 128 tokens for a warpgroup, with the tokens
(operand B) taken from shared memory through a matrix descriptor.

Mapping. A block (256 threads = 2 warpgroups) computes the tile's 128 token rows (``BM``, the
wgmma's N) × 128 weight rows (gate_up: warpgroup 0 the 64 W1 rows, warpgroup 1 the same 64 W3
rows, exchanged through shared memory for SiTU; down: 64 W2 rows each). The weights are the
wgmma's A operand from registers: each warp dequantizes its 16 rows straight into the A
fragment (the tc code layout, :mod:`schedules.mxfp4_tc_layout`; a lane holds inputs
``8q .. 8q+7`` of each 32, as in the ``mma.sync`` kernels). The tokens are B in shared memory:
128-byte rows (64 inputs per K step) with the 128-byte swizzle that the descriptor names
(:mod:`schedules.wgmma_ptx`), staged by ``cp.async`` in a ``STAGES``-deep pipeline.

The k order. The A fragment of a lane holds inputs ``8q + {0,1}`` as ``k = 2q, 2q+1`` and
``8q + {2,3}`` as ``k = 2q+8, 2q+9`` (first k16 slice of 32 inputs; the second: ``8q + 4..7``);
a descriptor reads B in its natural k order. So the kernels read activations whose inputs are
permuted: in every group of 32, the 16 pairs of inputs are a 4×4 matrix transposed
(:func:`permuted_position`; an involution). gate_up reads ``z`` permuted (the model permutes it
with a reshape-transpose-reshape, :func:`permute_inputs_reference`) and writes ``a_sorted`` in
the permuted order that down reads. Sums over k do not depend on the order of k.

Pipeline (plain form): ``STAGES`` shared-memory stages; at K step ``ks`` a block waits for its stage,
refills the stage of step ks - 2 (``cp.async``; each thread's copy addresses are computed once
per block), dequantizes into one half of a double-buffered A (4 ``dequant8`` per thread),
issues the step's four wgmmas (one per k16 slice; N = 32, 64 or 128, the least that covers
the tile's rows, one copy of the K loop each) and waits for the previous step's. Two blocks
per SM where their shared memory fits (``__launch_bounds__(256, 2)``: 128 registers, 12 bytes
of spills at K3 sizes).

Warp-specialized form (:func:`_grouped_wgmma_ws`, large prefills). The plain kernels run each
expert's ~146 tokens (8192 tokens × top-16 over 896 experts) as a 128-row and an ~18-row tile,
each dequantizing the whole weight tile, and every warp spends ~40% of a K step on copy
addressing and the block barrier. Here a block is two consumer warpgroups and one producer
warpgroup: the producers alone issue the ``cp.async`` copies of a K step (token rows gathered
by ``sorted_pair``, addresses kept in registers) into one of 4 stages and arrive on its
``full`` mbarrier when they land; the consumers wait on it, dequantize their 64 weight rows
once for up to :data:`TM_WS` = 192 tokens (a wgmma of N 128 and one of N 32 / 64 into
accumulators 64..95) and, after the step's wgmmas, arrive on its ``empty`` mbarrier. No block
barrier in the K loop; ``setmaxnreg`` gives the consumers 224 registers and the producers 56
(one block per SM); gate_up's SiTU epilogue is split between the two warpgroups. Both forms sit
in one PrimFunc behind a host-side branch on the pair count (:func:`ws_min_pairs`: 112 per
expert, :data:`schedules.moe_plan.WS_MIN_PAIRS_PER_EXPERT`), and ``moe_sort_kernel`` builds
its tile table with 192 rows from the same count; only where both widths are at least 512.

Small-tile form (the plain kernels with ``bm`` = 32 token rows per tile and 6 stages, below
:func:`small_max_pairs`: 24 pairs per expert, prefill chunks of up to ~1300 tokens at K3). With
a few tokens per expert the GEMMs are weight-bound, and the plain form's 16 KiB token stages
left room for loads only 2 K steps ahead: all 896 experts' weights streamed at ~1.6 TB/s
(9.7 ms at 256-1024 tokens against 3.7 ms of HBM time). 4 KiB token stages take 6 stages at
two blocks per SM: 7.97 / 8.29 / 8.96 ms at 256 / 512 / 1024 tokens, bit-identical
(benchmarks/results/moe_prefill_dispatch_small_h200_2026-11-30.json; 10 stages, or 64-row tiles
with 8, were slower, moe_prefill_small_tiles_h200_2026-11-30.json). Still 45% of the HBM bound:
each block streams one 128-row weight tile over 56 short K steps, its start and the barrier of
every step unhidden.

Status (H200, K3 shapes; benchmarks/results/moe_prefill_ws_h200_2026-11-30.json): 8192
tokens × top-16 as dispatched (warp-specialized) 19.1 ms = 452 TFLOP/s = 57.5% of the bf16 peak
measured in the same run (787 TFLOP/s; later runs 19.0 ms = 59.1% of 772 and 20.0 ms = 60.3%
of 717, moe_prefill_ws_final_h200_2026-11-30.json), 1.63× ``torch._grouped_mm`` on bf16
weights, 1.31× the plain kernels (25.2 ms; 42–46% in earlier runs); 6144 / 4096 / 2048 tokens with the plain kernels
17.0 / 14.7 / 11.0 ms (1.6× / 1.6× / 1.8× torch). Outputs equal the ``mma.sync`` kernels' bit
for bit. What limits the warp-specialized form (ncu, docs/DESIGN.md): consumers wait on their
stage's data, the producer on free stages — a latency-bound 4-stage ring at one block per SM —
and each block's start (scales, first stages) and epilogue leave the tensor cores idle.

Reference: :func:`schedules.moe_mxfp4_cuda.moe_experts_reference` (values) and the ``mma.sync``
kernels (benchmarks/moe.py compares the outputs and times both in one run).
"""

from __future__ import annotations

import functools

import numpy as np
from tvm.script import tirx as T

from schedules.barriers import mark
from schedules.moe_mxfp4_prefill_cuda import (B_ROW_WORDS, BK, BN, MMA_A_REGS, SMEM_LIMIT, block_scale_word,
                                              grouped_gemm_primfunc, situ_expr)
from schedules.moe_plan import (BM, BM_SMALL, BM_WS, SMALL_MAX_PAIRS_PER_EXPERT, SMALL_STAGES,
                                WS_MIN_PAIRS_PER_EXPERT, warp_specialized_shapes)
from schedules.mxfp4_ptx import commit, cp_async16, dequant8, factor_bf16x2, wait
from schedules.wgmma_ptx import (cp_async16_raw, cp_async_mbar_arrive, fence_proxy_async, global_address, mbar_arrive,
                                 mbar_init, mbar_wait, named_barrier, setmaxnreg, smem_address, sw128_desc,
                                 swizzle128_word, wgmma_bf16_rs, wgmma_commit, wgmma_fence, wgmma_wait,
                                 words_to_1024)

NT = 256          # threads per block: two warpgroups
STAGES = 4        # shared-memory stages: loads run STAGES - 2 K steps ahead, one step of wgmmas in flight
TOK_WORDS = BM * 32   # uint32 words of one stage's token tile (BM rows of 128 bytes)
SM_SMEM = 228 * 1024  # shared memory per SM (sm_90), of which 1 KiB per block is reserved


def permuted_position(i):
    """Position of input ``i`` in the permuted k order (module doc): in each group of 32, pair
    ``p = (i % 32) // 2`` moves to slot ``4·(p % 4) + p // 4``. An involution. Python ints,
    NumPy arrays or TIR expressions."""
    p = i % 32 // 2
    return i - i % 32 + (p % 4 * 4 + p // 4) * 2 + i % 2


def permute_inputs_reference(x: np.ndarray) -> np.ndarray:
    """``x [..., K]`` with its last axis in the permuted k order (K a multiple of 32):
    ``out[..., permuted_position(i)] = x[..., i]``."""
    x = np.asarray(x)
    k = x.shape[-1]
    if k % 32:
        raise ValueError(f"input width {k} must be a multiple of 32")
    out = np.empty_like(x)
    out[..., permuted_position(np.arange(k))] = x
    return out


@T.macro
def tile_prologue(tiles, sorted_pair, sq0, sq1, sm, al, ncols, row_s, dst_s, sc_s, blk, tx, nt,
                  gate_up: bool, rows: int, threads: int, N: int, NTN: int, K: int, KGW: int):
    """Start of a grouped-GEMM block (both forms): ``ncols`` = ⌈tile rows / 32⌉ (at most
    ``rows``), ``al`` = words from ``sm`` to its first 1024-byte boundary, ``row_s`` = each
    tile row's row of x (gate_up: the token, sorted_pair / k; down: the sorted row) or -1 past
    the tile, ``dst_s`` (down, when given) = its row of o (t·k + j) or -1, ``sc_s`` = the E8M0
    words of the block's weight rows (:func:`schedules.moe_mxfp4_prefill_cuda.block_scale_word`)."""
    ncols[0] = (T.min(tiles[blk // NTN, 2] - tiles[blk // NTN, 1], rows) + 31) // 32
    al[0] = words_to_1024(sm)
    if tx < rows:
        if gate_up:
            row_s[tx] = T.if_then_else(
                tiles[blk // NTN, 1] + tx < tiles[blk // NTN, 2],
                sorted_pair[T.min(tiles[blk // NTN, 1] + tx, T.Cast("int32", nt * K) - 1)] // K, -1)
        else:
            row_s[tx] = T.if_then_else(
                tiles[blk // NTN, 1] + tx < tiles[blk // NTN, 2],
                tiles[blk // NTN, 1] + tx, -1)
            if dst_s is not None:
                dst_s[tx] = T.if_then_else(
                    tiles[blk // NTN, 1] + tx < tiles[blk // NTN, 2],
                    sorted_pair[T.min(tiles[blk // NTN, 1] + tx, T.Cast("int32", nt * K) - 1)], -1)
    for it in range((BN * KGW + threads - 1) // threads):
        if it * threads + tx < BN * KGW:
            sc_s[it * threads + tx] = block_scale_word(gate_up, sq0, sq1, tiles, blk, it * threads + tx, N, NTN, KGW)


@T.macro
def dequant_step(bf, buf, sm, al, sc_s, ks, tx, codes: int, stages: int, KGW: int):
    """The A fragments of K step ``ks`` into half ``buf`` of ``bf`` (both forms): rows g, g+8 of
    the warp's 16 (warpgroup tx // 128: its 64 rows of the block's 128), inputs 8q .. 8q+7 of
    each 32 of the step's 64 (scale groups 2ks + hk), from the codes of stage ks % ``stages``
    (word ``codes`` on from the aligned base) and the E8M0 words ``sc_s``."""
    for hk in T.unroll(2):
        for h in T.unroll(2):
            T.evaluate(dequant8(
                T.address_of(bf[buf * 16 + (hk * 2 + h) * 4]),
                sm[al[0] + codes + (ks % stages * BN + tx // 32 * 16 + tx % 32 // 4 + h * 8) * B_ROW_WORDS
                   + hk * 4 + tx % 4],
                factor_bf16x2(sc_s[(tx // 32 * 16 + tx % 32 // 4 + h * 8) * KGW + ks // 2], buf * 2 + hk)))


@T.macro
def situ_store(y, row_s, tiles, blk, t, i, val, ok, NTN: int, out_dtype: str):
    """gate_up output ``i`` of thread ``t`` of a warpgroup (both forms): row i // 4 · 8 + 2(t % 4)
    + i % 2 of the tile, column 16(t / 32) + (t % 32) / 4 + 8((i % 4) / 2) of the block's 64,
    permuted; rows past the tile's end (``row_s`` -1) are skipped."""
    ok[0] = row_s[i // 4 * 8 + t % 4 * 2 + i % 2]
    if ok[0] >= 0:
        y[tiles[blk // NTN, 1] + i // 4 * 8 + t % 4 * 2 + i % 2,
          permuted_position(T.Cast("int32", blk % NTN) * 64 + t // 32 * 16 + t % 32 // 4 + i % 4 // 2 * 8)] = \
            T.Cast(out_dtype, val)


def _sizes(kind: str, E: int, N: int, KD: int, stages: int):
    """(gate_up, output columns per block, column tiles, K steps, scale groups, their words, code
    words per row) of a grouped GEMM with ``N`` outputs over ``KD`` inputs (both forms).

    Raises:
        ValueError: fewer than 3 stages; KD not a multiple of 128; N not a multiple of the
            block's columns; weights past int32 word indexing.
    """
    if stages < 3:
        raise ValueError(f"stages must be at least 3, got {stages}")
    gate_up = kind == "gate_up"
    if KD % 128:
        raise ValueError(f"input width {KD} must be a multiple of 128")
    cols = BN // 2 if gate_up else BN
    if N % cols:
        raise ValueError(f"output width {N} must be a multiple of {cols}")
    if E * N * (KD // 8) >= 2 ** 31:
        raise ValueError("weights too large for int32 word indexing")
    return gate_up, cols, N // cols, KD // BK, KD // 32, KD // 128, KD // 8


def _grouped_wgmma(kind: str, E: int, N: int, KD: int, top_k: int, beta: float = 0.0,
                   beta_lin: float | None = None, out_dtype: str = "bfloat16", stages: int = STAGES,
                   short_tiles: bool = True, staged: bool = False, bm: int = BM):
    """Body (a macro for ``grouped_gemm_primfunc``) of both kernels; arguments as :func:`schedules.moe_mxfp4_prefill_cuda.
    _grouped_gemm`, with the activations (gate_up's ``z``, down's ``a_sorted``) and gate_up's
    output in the permuted k order. ``short_tiles``: tiles of at most 64 (32) rows use a
    wgmma of N = 64 (32) instead of 128; ``staged`` (gate_up): the outputs go through shared
    memory and leave in 16-byte stores of whole rows, instead of 2-byte stores straight from the
    registers (correct on the H200; its speed alone not yet measured, see docs/DESIGN.md).
    ``bm``: token rows per tile and per stage (128, 64 or 32; the sort's tile rows): smaller
    tiles leave room for deeper pipelines where experts get few tokens."""
    K = top_k
    NS = stages
    gate_up, cols, NTN, NK, KG, KGW, RW = _sizes(kind, E, N, KD, NS)
    if bm not in (32, 64, 128):
        raise ValueError(f"token rows per tile must be 32, 64 or 128, got {bm}")
    TW = bm * 32                 # uint32 words of one stage's token tile (bm rows of 128 bytes)
    SM_WORDS = 256 + NS * TW + NS * BN * B_ROW_WORDS  # + up to 1 KiB to align the token tiles
    smem = SM_WORDS * 4 + BN * KGW * 4 + bm * 4
    if smem > SMEM_LIMIT:
        raise ValueError(f"input width {KD} needs {smem} bytes of shared memory per block (limit {SMEM_LIMIT})")
    # the SiTU exchange (gate_up's epilogue) reuses the token stages: 64 words per thread of
    # warpgroup 1 fit in NS >= 3 stages
    # two blocks per SM where their shared memory fits (K3: 104 KiB each), else one
    MINB = 2 if 2 * (smem + 1024) <= SM_SMEM else 1
    CODES = NS * TW              # word offset (from the aligned base) of the code stages
    # staged epilogue (gate_up): the tile's outputs as bf16 [token][column] (rows padded by 16
    # bytes) in the code stages, no longer in use (the SiTU exchange holds the token stages)
    OUT_ROW = cols + 8           # bf16 per row
    OUT_TILE = CODES
    if staged and (not gate_up or bm * OUT_ROW // 2 > NS * BN * B_ROW_WORDS or out_dtype != "bfloat16"):
        raise ValueError("the staged epilogue is gate_up's, with bf16 outputs and at least 3 stages")
    A_CH = bm * (BK // 8) // NT  # 16-byte token chunks per thread per step
    ND = bm // 2                 # fp32 accumulators per thread (64 rows × bm tokens / 128)
    if gate_up and ND * 128 > NS * TW:
        raise ValueError("the SiTU exchange does not fit in the token stages")
    B = float(beta)
    BL = float(beta_lin) if beta_lin is not None else 0.0
    use_bl = beta_lin is not None
    A0, A1 = MMA_A_REGS  # dequant8 words of the A fragment of the two k16 slices of 32 inputs

    @T.macro
    def issue(step, sm, pre, tsrc, xf, wq0, wq1, tx):
        """cp.async of K step ``step`` into stage step % NS: the thread's A_CH token chunks
        (rows tx/8 + 32c, swizzled; source rows ``tsrc``, validity bits ``pre[1]``) and its
        16 bytes of packed codes (``pre[2]``: word offset of its chunk at step 0)."""
        for c in T.unroll(A_CH):
            T.evaluate(cp_async16(
                T.address_of(sm[pre[0] + step % NS * TW + c * (NT // 8) * 32]),
                T.address_of(xf[T.Cast("int64", tsrc[c]) * KD + (step * BK + tx % 8 * 8)]), (pre[1] >> c) & 1))
        if gate_up and tx // 2 >= 64:
            T.evaluate(cp_async16(T.address_of(sm[pre[3] + step % NS * BN * B_ROW_WORDS]),
                                  T.address_of(wq1[pre[2] + step * (BK // 8)]), 1))
        else:
            T.evaluate(cp_async16(T.address_of(sm[pre[3] + step % NS * BN * B_ROW_WORDS]),
                                  T.address_of(wq0[pre[2] + step * (BK // 8)]), 1))

    @T.macro
    def slice_mma(n, buf, hk, desc, bf, acc, ks):
        """The two wgmmas (k16 slices 2hk, 2hk + 1) of K step ``ks`` over the first ``n``
        token rows (a Python int); ``desc[0]``: the descriptor of stage 0's tile (a k16 slice
        is 32 bytes further: 2 descriptor units); the very first overwrites the accumulators."""
        T.evaluate(wgmma_bf16_rs(
            n, T.address_of(acc[0]), bf[buf * 16 + hk * 8 + A0[0]], bf[buf * 16 + hk * 8 + A0[1]],
            bf[buf * 16 + hk * 8 + A0[2]], bf[buf * 16 + hk * 8 + A0[3]],
            desc[0] + T.Cast("uint64", ks % NS * (TW // 4) + hk * 4), T.Cast("int32", ks + hk > 0)))
        T.evaluate(wgmma_bf16_rs(
            n, T.address_of(acc[0]), bf[buf * 16 + hk * 8 + A1[0]], bf[buf * 16 + hk * 8 + A1[1]],
            bf[buf * 16 + hk * 8 + A1[2]], bf[buf * 16 + hk * 8 + A1[3]],
            desc[0] + T.Cast("uint64", ks % NS * (TW // 4) + hk * 4 + 2)))

    @T.macro
    def kstep(n, ks, buf, sm, al, pre, tsrc, desc, sc_s, xf, wq0, wq1, bf, acc, tx):
        """K step ``ks`` over ``n`` token rows (``buf`` = ks % 2, a Python int: the A registers'
        half): its stage has
        landed; refill the stage of step ks - 2 (its wgmmas are done: every warpgroup waited
        for them before this barrier); dequantize into half ``buf`` of ``bf`` while step
        ks - 1's wgmmas run; issue this step's four and wait for step ks - 1's."""
        T.evaluate(wait(NS - 3))
        T.evaluate(fence_proxy_async())  # the copies, visible to the wgmma's reads
        T.tvm_storage_sync("shared.dyn")
        if ks + NS - 2 < NK:
            issue(ks + NS - 2, sm, pre, tsrc, xf, wq0, wq1, tx)
        T.evaluate(commit())
        dequant_step(bf, buf, sm, al, sc_s, ks, tx, CODES, NS, KGW)
        T.evaluate(wgmma_fence())
        for hk in T.unroll(2):  # k16 slices 2hk (registers A0) and 2hk + 1 (A1)
            slice_mma(n, buf, hk, desc, bf, acc, ks)
        T.evaluate(wgmma_commit())
        T.evaluate(wgmma_wait(1))

    @T.macro
    def kloop(n, sm, al, pre, tsrc, desc, sc_s, xf, wq0, wq1, bf, acc, tx):
        for k2 in range(NK // 2):
            kstep(n, k2 * 2, 0, sm, al, pre, tsrc, desc, sc_s, xf, wq0, wq1, bf, acc, tx)
            kstep(n, k2 * 2 + 1, 1, sm, al, pre, tsrc, desc, sc_s, xf, wq0, wq1, bf, acc, tx)

    @T.macro
    def grouped(xf, wq0, wq1, sq0, sq1, sorted_pair, tiles, num_tiles, y, nt, mt):
        """The kernel on the buffers and views of ``grouped_gemm_primfunc`` (``nt`` tokens,
        ``mt`` tile rows)."""
        yq = T.decl_buffer((y.shape[0] * (N // 2) * (1 if gate_up else K),), "uint32", data=y.data)
        for blk in T.thread_binding(mt * NTN, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                # two blocks per SM: ptxas keeps the registers at 128 (65536 / 512 threads)
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MINB):
                    sm = T.alloc_buffer((SM_WORDS,), "uint32", scope="shared.dyn")
                    smb = T.decl_buffer((SM_WORDS * 2,), "bfloat16", data=sm.data, scope="shared.dyn")
                    sc_s = T.alloc_buffer((BN * KGW,), "uint32", scope="shared.dyn")  # E8M0 bytes, whole K
                    row_s = T.alloc_buffer((bm,), "int32", scope="shared.dyn")  # the row of x, or -1
                    al = T.alloc_buffer((1,), "int32", scope="local")   # words to the 1024-byte-aligned base
                    acc = T.alloc_buffer((ND,), "float32", scope="local")
                    bf = T.alloc_buffer((32,), "uint32", scope="local")  # A fragments of two K steps
                    ok = T.alloc_buffer((1,), "int32", scope="local")
                    ncols = T.alloc_buffer((1,), "int32", scope="local")  # ⌈tile rows / 32⌉
                    # [0] token chunk 0's stage-0 word, [1] validity bits of the token chunks,
                    # [2] the code chunk's source word at step 0, [3] its stage-0 word
                    pre = T.alloc_buffer((4,), "int32", scope="local")
                    tsrc = T.alloc_buffer((A_CH,), "int32", scope="local")  # token chunks' source rows
                    desc = T.alloc_buffer((1,), "uint64", scope="local")  # stage 0's token tile
                    if T.Cast("int32", blk // NTN) < num_tiles[0]:
                        # ---- tile metadata: gathered rows, scales of the block's weight rows
                        tile_prologue(tiles, sorted_pair, sq0, sq1, sm, al, ncols, row_s, None, sc_s, blk, tx, nt,
                                      gate_up, bm, NT, N, NTN, K, KGW)
                        T.tvm_storage_sync("shared.dyn")
                        # ---- K loop (NK is even: KD % 128 == 0)
                        # per-thread copy addresses, fixed for the whole K loop
                        pre[0] = al[0] + swizzle128_word(tx // 8, tx % 8)
                        pre[1] = 0
                        for c in T.unroll(A_CH):
                            ok[0] = row_s[c * (NT // 8) + tx // 8]
                            tsrc[c] = T.max(ok[0], 0)
                            pre[1] = pre[1] | T.Cast("int32", ok[0] >= 0) << c
                        if gate_up:
                            pre[2] = (tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * 64 + tx // 2 % 64) * RW \
                                + tx % 2 * 4
                        else:
                            pre[2] = (tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * BN + tx // 2) * RW + tx % 2 * 4
                        pre[3] = al[0] + CODES + tx // 2 * B_ROW_WORDS + tx % 2 * 4
                        desc[0] = sw128_desc(smem_address(T.address_of(sm[al[0]])))
                        for st in T.unroll(NS - 2):
                            if st < NK:
                                issue(st, sm, pre, tsrc, xf, wq0, wq1, tx)
                            T.evaluate(commit())
                        # wgmma N: 32, 64 or 128, the least that covers the tile's rows (an
                        # expert's last tile is mostly short); one copy of the K loop per N
                        # (more copies cost ptxas the registers to pipeline the wgmmas)
                        if bm == 32:
                            kloop(32, sm, al, pre, tsrc, desc, sc_s, xf, wq0, wq1, bf, acc, tx)
                        elif bm == 64:
                            if not short_tiles or ncols[0] >= 2:
                                kloop(64, sm, al, pre, tsrc, desc, sc_s, xf, wq0, wq1, bf, acc, tx)
                            else:
                                kloop(32, sm, al, pre, tsrc, desc, sc_s, xf, wq0, wq1, bf, acc, tx)
                        elif not short_tiles or ncols[0] >= 3:
                            kloop(128, sm, al, pre, tsrc, desc, sc_s, xf, wq0, wq1, bf, acc, tx)
                        elif ncols[0] == 2:
                            kloop(64, sm, al, pre, tsrc, desc, sc_s, xf, wq0, wq1, bf, acc, tx)
                        else:
                            kloop(32, sm, al, pre, tsrc, desc, sc_s, xf, wq0, wq1, bf, acc, tx)
                        T.evaluate(wgmma_wait(0))
                        T.evaluate(wait(0))
                        T.tvm_storage_sync("shared.dyn")
                        # ---- epilogue: acc[4j + c] = weight row 16w + g + 8(c // 2) of the warpgroup's 64,
                        # token 8j + 2q + c % 2 of the tile
                        if gate_up:
                            # warpgroup 1 (W3 rows) hands its rounded sums to warpgroup 0 (W1 rows)
                            if tx >= 128:
                                for i in T.unroll(ND):
                                    sm[al[0] + i * 128 + tx - 128] = T.reinterpret(
                                        "uint32", T.Cast("float32", T.Cast("bfloat16", acc[i])))
                            T.tvm_storage_sync("shared.dyn")
                            if tx < 128:
                                for i in T.unroll(ND):
                                    if staged:
                                        # the tile's [token][column] bf16 in shared memory, columns permuted
                                        smb[(al[0] + OUT_TILE) * 2 + (i // 4 * 8 + tx % 4 * 2 + i % 2) * OUT_ROW
                                            + permuted_position(tx // 32 * 16 + tx % 32 // 4 + i % 4 // 2 * 8)] = \
                                            T.Cast(out_dtype, situ_expr(
                                                T.Cast("float32", T.Cast("bfloat16", acc[i])),
                                                T.reinterpret("float32", sm[al[0] + i * 128 + tx]), B, BL, use_bl))
                                    else:
                                        situ_store(y, row_s, tiles, blk, tx, i, situ_expr(
                                            T.Cast("float32", T.Cast("bfloat16", acc[i])),
                                            T.reinterpret("float32", sm[al[0] + i * 128 + tx]), B, BL, use_bl),
                                            ok, NTN, out_dtype)
                            if staged:
                                T.tvm_storage_sync("shared.dyn")
                                # 16-byte stores: row r's 64 columns are 128 contiguous bytes of a_sorted
                                for it in T.unroll(bm * 8 // NT):
                                    ok[0] = row_s[(it * NT + tx) // 8]
                                    if ok[0] >= 0:
                                        for v in T.vectorized(4):
                                            yq[((T.Cast("int64", tiles[blk // NTN, 1]) + (it * NT + tx) // 8) * N
                                                + T.Cast("int32", blk % NTN) * 64 + (it * NT + tx) % 8 * 8) // 2 + v] = \
                                                sm[al[0] + OUT_TILE + ((it * NT + tx) // 8 * OUT_ROW + (it * NT + tx) % 8 * 8) // 2 + v]
                        else:
                            for i in T.unroll(ND):
                                ok[0] = row_s[i // 4 * 8 + tx % 4 * 2 + i % 2]
                                if ok[0] >= 0:
                                    y[sorted_pair[tiles[blk // NTN, 1] + i // 4 * 8 + tx % 4 * 2 + i % 2] // K,
                                      sorted_pair[tiles[blk // NTN, 1] + i // 4 * 8 + tx % 4 * 2 + i % 2] % K,
                                      T.Cast("int32", blk % NTN) * BN + tx // 32 * 16 + tx % 32 // 4
                                      + i % 4 // 2 * 8] = T.Cast(out_dtype, acc[i])

    return grouped


TM_WS = BM_WS      # token rows per tile of the warp-specialized kernels (the sort's bm): 192
REGS_WS = (56, 224)  # registers per thread of their producer / consumer warpgroups (setmaxnreg)
NCW, NPW = 8, 4    # their consumer warps (two warpgroups: wgmma) and producer warps (a warpgroup: copies)


def ws_token_chunk(p, j, producers: int):
    """(tile row, 16-byte chunk) that producer thread ``p`` copies as its token chunk ``j`` in a
    K step of the warp-specialized kernels: row p / 8 + (producers / 8)·j, chunk p % 8 (a warp
    copies 4 whole 128-byte rows). Python ints or TIR expressions."""
    return p // 8 + producers // 8 * j, p % 8


def ws_code_chunk(p, i, producers: int):
    """(block weight row, 16-byte half) that producer thread ``p`` copies as its code chunk ``i``:
    row p / 2 + (producers / 2)·i, half p % 2 (gate_up: rows below 64 are W1's, the rest W3's)."""
    return p // 2 + producers // 2 * i, p % 2


def ws_entry_registers(threads: int) -> int:
    """Registers per thread of a one-block-per-SM launch of ``threads`` threads: 65536 / threads
    rounded down to a multiple of 8 (384 threads: 168)."""
    return 65536 // threads // 8 * 8


def _grouped_wgmma_ws(kind: str, E: int, N: int, KD: int, top_k: int, beta: float = 0.0,
                      beta_lin: float | None = None, out_dtype: str = "bfloat16", stages: int = STAGES):
    """Warp-specialized builder of both kernels (arguments as :func:`_grouped_wgmma`; tiles of
    up to :data:`TM_WS` token rows, the tile table of ``moe_sort_kernel(..., bm=TM_WS)``).

    A block = 8 consumer warps (two warpgroups, 64 weight rows each, as in
    :func:`_grouped_wgmma`) + :data:`NPW` producer warps. The producers alone issue the
    ``cp.async`` copies of a K step's token rows and codes into stage ks % NS and arrive on the
    stage's ``full`` mbarrier when their copies land (``cp.async.mbarrier.arrive.noinc``); the
    consumers wait on it, dequantize the weights into the wgmma's A registers once for all the
    tile's tokens (wgmmas over tokens 0-127 and, where the tile has more, 128-191 into
    accumulators 64..95) and, once a step's wgmmas are done, arrive on its stage's ``empty``
    mbarrier, which the producers wait on before refilling it. No block-wide barrier and no
    copy addressing in the consumers' K loop (setmaxnreg: 224 registers per consumer thread, 56
    per producer thread; one block per SM)."""
    K = top_k
    NS = stages
    gate_up, cols, NTN, NK, KG, KGW, RW = _sizes(kind, E, N, KD, NS)
    TM = TM_WS
    NC = NCW * 32                # consumer threads
    NP = NPW * 32                # producer threads
    NTH = NC + NP                # threads per block
    # setmaxnreg only moves the registers the block got at launch (ptxas: 65536 / threads, in
    # multiples of 8); a larger total leaves the consumers' increase waiting for ever
    if NP * REGS_WS[0] + NC * REGS_WS[1] > (NTH * ws_entry_registers(NTH)):
        raise ValueError(f"setmaxnreg {REGS_WS} over the {ws_entry_registers(NTH)} registers per thread the "
                         f"block gets at launch ({NP} + {NC} threads)")
    if gate_up and (NP // 2) % 64:
        raise ValueError("a producer's code chunk i must be all W1 or all W3 rows")
    TW = TM * 32                 # uint32 words of one stage's token tile (TM rows of 128 bytes)
    # word offset from sm[0] of the mbarriers (full[NS], empty[NS]), past the aligned data; even,
    # and sm's offset in the merged shared memory is a multiple of 8 bytes (checked on the
    # generated source: tests/test_moe_prefill_wgmma.py)
    OB = 256 + NS * TW + NS * BN * B_ROW_WORDS
    SM_WORDS = OB + 4 * NS
    smem = SM_WORDS * 4 + BN * KGW * 4 + TM * 8
    if smem > SMEM_LIMIT:
        raise ValueError(f"input width {KD} needs {smem} bytes of shared memory per block (limit {SMEM_LIMIT})")
    ND = TM // 2                 # fp32 accumulators per consumer thread (64 rows × TM tokens / 128)
    if gate_up and ND * (NC // 2) > NS * TW:
        raise ValueError("the SiTU exchange does not fit in the token stages")
    CODES = NS * TW
    TCH = TM * (BK // 8) // NP   # token chunks per producer thread per step
    CCH = BN * 2 // NP           # code chunks (16 bytes) per producer thread per step
    HALF = 128 * 128 // 16       # descriptor units from token row 0 to token row 128
    B = float(beta)
    BL = float(beta_lin) if beta_lin is not None else 0.0
    use_bl = beta_lin is not None
    A0, A1 = MMA_A_REGS

    @T.macro
    def wg(n, regs, buf, hk, m, half, desc, bf, acc, ks):
        """One wgmma: k16 slice 2hk + m of step ks (A registers ``regs``) over ``n`` token rows
        from row 128·half into acc[64·half:]; the first of each accumulator half overwrites."""
        if m == 0:
            T.evaluate(wgmma_bf16_rs(
                n, T.address_of(acc[64 * half]), bf[buf * 16 + hk * 8 + regs[0]], bf[buf * 16 + hk * 8 + regs[1]],
                bf[buf * 16 + hk * 8 + regs[2]], bf[buf * 16 + hk * 8 + regs[3]],
                desc[0] + T.Cast("uint64", ks % NS * (TW // 4) + hk * 4 + half * HALF), T.Cast("int32", ks + hk > 0)))
        else:
            T.evaluate(wgmma_bf16_rs(
                n, T.address_of(acc[64 * half]), bf[buf * 16 + hk * 8 + regs[0]], bf[buf * 16 + hk * 8 + regs[1]],
                bf[buf * 16 + hk * 8 + regs[2]], bf[buf * 16 + hk * 8 + regs[3]],
                desc[0] + T.Cast("uint64", ks % NS * (TW // 4) + hk * 4 + 2 + half * HALF)))

    @T.macro
    def cstep(n, n2, ks, buf, sm, al, desc, sc_s, bf, acc, tx):
        """Consumer K step ``ks``: wait for its stage, dequantize into half ``buf`` of ``bf``
        (while step ks - 1's wgmmas run), issue this step's wgmmas, wait for step ks - 1's and
        release its stage."""
        T.evaluate(mbar_wait(T.address_of(sm[OB + 2 * (ks % NS)]), T.Cast("uint32", ks // NS % 2)))
        dequant_step(bf, buf, sm, al, sc_s, ks, tx, CODES, NS, KGW)
        T.evaluate(fence_proxy_async())  # the producers' copies, visible to the wgmma's reads
        T.evaluate(wgmma_fence())
        for hk in T.unroll(2):
            wg(n, A0, buf, hk, 0, 0, desc, bf, acc, ks)
            if n2 > 0:
                wg(n2, A0, buf, hk, 0, 1, desc, bf, acc, ks)
            wg(n, A1, buf, hk, 1, 0, desc, bf, acc, ks)
            if n2 > 0:
                wg(n2, A1, buf, hk, 1, 1, desc, bf, acc, ks)
        T.evaluate(wgmma_commit())
        T.evaluate(wgmma_wait(1))
        if ks > 0:  # step ks - 1's wgmmas are done: its stage may be refilled
            T.evaluate(mbar_arrive(T.address_of(sm[OB + 2 * (NS + (ks + NS - 1) % NS)])))

    @T.macro
    def cloop(n, n2, sm, al, desc, sc_s, bf, acc, tx):
        # unrolled by 4 where NS = 4: the stage, the A buffer and the parity's arithmetic
        # (k4 & 1) are then simple
        if NS == 4 and NK % 4 == 0:
            for k4 in range(NK // 4):
                cstep(n, n2, k4 * 4, 0, sm, al, desc, sc_s, bf, acc, tx)
                cstep(n, n2, k4 * 4 + 1, 1, sm, al, desc, sc_s, bf, acc, tx)
                cstep(n, n2, k4 * 4 + 2, 0, sm, al, desc, sc_s, bf, acc, tx)
                cstep(n, n2, k4 * 4 + 3, 1, sm, al, desc, sc_s, bf, acc, tx)
        else:
            for k2 in range(NK // 2):
                cstep(n, n2, k2 * 2, 0, sm, al, desc, sc_s, bf, acc, tx)
                cstep(n, n2, k2 * 2 + 1, 1, sm, al, desc, sc_s, bf, acc, tx)

    @T.macro
    def grouped(xf, wq0, wq1, sq0, sq1, sorted_pair, tiles, num_tiles, y, nt, mt):
        """The kernel on the buffers and views of ``grouped_gemm_primfunc`` (``nt`` tokens,
        ``mt`` tile rows)."""
        yf = T.decl_buffer((y.shape[0] * (1 if gate_up else K) * N,), out_dtype, data=y.data)
        for blk in T.thread_binding(mt * NTN, thread="blockIdx.x"):
            for tx in T.thread_binding(NTH, thread="threadIdx.x"):
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1):
                    sm = T.alloc_buffer((SM_WORDS,), "uint32", scope="shared.dyn")
                    sc_s = T.alloc_buffer((BN * KGW,), "uint32", scope="shared.dyn")  # E8M0 bytes, whole K
                    row_s = T.alloc_buffer((TM,), "int32", scope="shared.dyn")  # the row of x, or -1
                    dst_s = T.alloc_buffer((TM,), "int32", scope="shared.dyn")  # down: the row of o (t·k + j), or -1
                    al = T.alloc_buffer((1,), "int32", scope="local")
                    acc = T.alloc_buffer((ND,), "float32", scope="local")
                    bf = T.alloc_buffer((32,), "uint32", scope="local")
                    ok = T.alloc_buffer((1,), "int32", scope="local")
                    ncols = T.alloc_buffer((1,), "int32", scope="local")  # ⌈tile rows / 32⌉
                    desc = T.alloc_buffer((1,), "uint64", scope="local")
                    ga = T.alloc_buffer((TCH + CCH,), "uint64", scope="local")  # producer: step-0 global addresses
                    sb = T.alloc_buffer((1,), "uint32", scope="local")   # producer: its stage-0 shared address
                    if T.Cast("int32", blk // NTN) < num_tiles[0]:
                        tile_prologue(tiles, sorted_pair, sq0, sq1, sm, al, ncols, row_s, dst_s, sc_s, blk, tx, nt,
                                      gate_up, TM, NTH, N, NTN, K, KGW)
                        if tx == 0:
                            for i in range(NS):
                                T.evaluate(mbar_init(T.address_of(sm[OB + 2 * i]), NP))        # full: producer lanes
                                T.evaluate(mbar_init(T.address_of(sm[OB + 2 * (NS + i)]), NC))   # empty: consumer threads
                        T.tvm_storage_sync("shared.dyn")
                        if tx >= NC:
                            T.evaluate(setmaxnreg("dec", REGS_WS[0]))
                            # ---- producers: token chunk j of producer thread p is row p / 8 + (NP / 8)·j,
                            # 16 bytes p % 8; code chunk i is row p / 2 + (NP / 2)·i (gate_up: W1 rows
                            # below 64, then W3), half p % 2. Global addresses of step 0 in registers,
                            # advanced by a step's bytes (128 per token row, 32 per code row).
                            for j in T.unroll(TCH):
                                ga[j] = global_address(T.address_of(xf[
                                    T.Cast("int64", T.max(row_s[ws_token_chunk(tx - NC, j, NP)[0]], 0)) * KD
                                    + ws_token_chunk(tx - NC, j, NP)[1] * 8]))
                            for i in T.unroll(CCH):
                                if gate_up and i * 2 >= CCH:
                                    ga[TCH + i] = global_address(T.address_of(wq1[
                                        (tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * 64
                                         + ws_code_chunk(tx - NC, i, NP)[0] % 64) * RW + ws_code_chunk(tx - NC, i, NP)[1] * 4]))
                                elif gate_up:
                                    ga[TCH + i] = global_address(T.address_of(wq0[
                                        (tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * 64
                                         + ws_code_chunk(tx - NC, i, NP)[0] % 64) * RW + ws_code_chunk(tx - NC, i, NP)[1] * 4]))
                                else:
                                    ga[TCH + i] = global_address(T.address_of(wq0[
                                        (tiles[blk // NTN, 0] * N + T.Cast("int32", blk % NTN) * BN
                                         + ws_code_chunk(tx - NC, i, NP)[0]) * RW + ws_code_chunk(tx - NC, i, NP)[1] * 4]))
                            sb[0] = smem_address(T.address_of(sm[al[0]]))
                            for ks in range(NK):
                                if ks >= NS:
                                    T.evaluate(mbar_wait(T.address_of(sm[OB + 2 * (NS + ks % NS)]),
                                                         T.Cast("uint32", (ks // NS + 1) % 2)))
                                for i in T.unroll(CCH):
                                    T.evaluate(cp_async16_raw(
                                        sb[0] + T.Cast("uint32", (CODES + (ks % NS * BN + ws_code_chunk(tx - NC, i, NP)[0])
                                                                  * B_ROW_WORDS + ws_code_chunk(tx - NC, i, NP)[1] * 4) * 4),
                                        ga[TCH + i] + T.Cast("uint64", ks * (BK // 2))))
                                for j in T.unroll(TCH):
                                    # rows of the tile's ⌈rows / 32⌉·32; a 3-column tile's wgmma (N 128)
                                    # also reads rows 96..127, left from an earlier step: they only reach
                                    # the outputs of rows past the tile, never stored
                                    if ws_token_chunk(tx - NC, j, NP)[0] < ncols[0] * 32:
                                        T.evaluate(cp_async16_raw(
                                            sb[0] + T.Cast("uint32", (ks % NS * TW + swizzle128_word(*ws_token_chunk(tx - NC, j, NP)))
                                                           * 4),
                                            ga[j] + T.Cast("uint64", ks * BK * 2)))
                                T.evaluate(cp_async_mbar_arrive(T.address_of(sm[OB + 2 * (ks % NS)])))
                            T.evaluate(wait(0))
                        else:
                            # ---- consumers
                            T.evaluate(setmaxnreg("inc", REGS_WS[1]))
                            desc[0] = sw128_desc(smem_address(T.address_of(sm[al[0]])))
                            # wgmma N by the tile's rows: 32, 64, 128, then 128 + 32 / 64
                            if ncols[0] >= 6:
                                cloop(128, 64, sm, al, desc, sc_s, bf, acc, tx)
                            elif ncols[0] == 5:
                                cloop(128, 32, sm, al, desc, sc_s, bf, acc, tx)
                            elif ncols[0] >= 3:
                                cloop(128, 0, sm, al, desc, sc_s, bf, acc, tx)
                            elif ncols[0] == 2:
                                cloop(64, 0, sm, al, desc, sc_s, bf, acc, tx)
                            else:
                                cloop(32, 0, sm, al, desc, sc_s, bf, acc, tx)
                            T.evaluate(wgmma_wait(0))
                            # every step's stage has landed and been read: the token stages are free
                            T.evaluate(named_barrier(1, NC))
                            if gate_up:
                                # SiTU split between the warpgroups: outputs i < ND/2 on the W1 one (u from
                                # the W3 one), i >= ND/2 on the W3 one (g from the W1 one); thread t = tx %
                                # (NC/2) of either holds the same rows and columns
                                if tx >= NC // 2:
                                    for i in T.unroll(ND // 2):
                                        sm[al[0] + i * (NC // 2) + tx - NC // 2] = T.reinterpret(
                                            "uint32", T.Cast("float32", T.Cast("bfloat16", acc[i])))
                                else:
                                    for i in T.unroll(ND // 2):
                                        sm[al[0] + (ND // 2 + i) * (NC // 2) + tx] = T.reinterpret(
                                            "uint32", T.Cast("float32", T.Cast("bfloat16", acc[ND // 2 + i])))
                                T.evaluate(named_barrier(1, NC))
                                if tx < NC // 2:
                                    for i in T.unroll(ND // 2):
                                        situ_store(y, row_s, tiles, blk, tx, i, situ_expr(
                                            T.Cast("float32", T.Cast("bfloat16", acc[i])),
                                            T.reinterpret("float32", sm[al[0] + i * (NC // 2) + tx]), B, BL, use_bl), ok, NTN, out_dtype)
                                else:
                                    for i in T.unroll(ND // 2):
                                        situ_store(y, row_s, tiles, blk, tx - NC // 2, ND // 2 + i, situ_expr(
                                            T.reinterpret("float32", sm[al[0] + (ND // 2 + i) * (NC // 2) + tx - NC // 2]),
                                            T.Cast("float32", T.Cast("bfloat16", acc[ND // 2 + i])), B, BL, use_bl), ok, NTN, out_dtype)
                            else:
                                for i in T.unroll(ND):
                                    ok[0] = dst_s[i // 4 * 8 + tx % 4 * 2 + i % 2]
                                    if ok[0] >= 0:
                                        yf[T.Cast("int64", ok[0]) * N + T.Cast("int32", blk % NTN) * BN + tx // 32 * 16
                                           + tx % 32 // 4 + i % 4 // 2 * 8] = T.Cast(out_dtype, acc[i])

    return grouped


def ws_min_pairs(num_experts: int) -> int:
    """Token-expert pairs from which the kernels take their warp-specialized form (tiles of
    :data:`TM_WS` rows): :data:`schedules.moe_plan.WS_MIN_PAIRS_PER_EXPERT` per expert."""
    return WS_MIN_PAIRS_PER_EXPERT * num_experts


def moe_sort_wgmma_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                          warp_specialized: bool | str = "auto", bm: int = BM):
    """The sort (``moe_sort_kernel``) whose tile table the wgmma kernels built with the same
    ``warp_specialized`` (and ``bm``) read: 192-row tiles (:data:`TM_WS`) from :func:`ws_min_pairs` pairs
    where the widths have the warp-specialized form ("auto"), always (True) or never (False,
    tiles of ``bm`` rows)."""
    from schedules.moe_mxfp4_prefill_cuda import moe_sort_kernel

    if warp_specialized == "auto":
        if not warp_specialized_shapes(latent, inter):
            return moe_sort_kernel(num_experts, top_k)
        return moe_sort_kernel(num_experts, top_k, bm_large=TM_WS, large_from_pairs=ws_min_pairs(num_experts),
                               bm_small=BM_SMALL, small_until_pairs=small_max_pairs(num_experts))
    return moe_sort_kernel(num_experts, top_k, TM_WS if warp_specialized else bm)


def small_max_pairs(num_experts: int) -> int:
    """Token-expert pairs below which the "auto" kernels take their small-tile form (tiles of
    :data:`schedules.moe_plan.BM_SMALL` rows, :data:`schedules.moe_plan.SMALL_STAGES` stages):
    :data:`schedules.moe_plan.SMALL_MAX_PAIRS_PER_EXPERT` per expert."""
    return SMALL_MAX_PAIRS_PER_EXPERT * num_experts


def _primfunc(kind, E, N, KD, top_k, out_dtype, plain, ws, ws_from, small=None):
    """The PrimFunc (``grouped_gemm_primfunc``) of the plain body, the warp-specialized one, or
    both behind the host-side branch at ``ws_from`` pairs (and the small-tile one below
    :func:`small_max_pairs`), which the sort's tile table follows (:func:`moe_sort_wgmma_kernel`)."""
    if plain is None:
        return grouped_gemm_primfunc(kind, E, N, KD, top_k, out_dtype, ws)
    return grouped_gemm_primfunc(kind, E, N, KD, top_k, out_dtype, plain, ws, ws_from,
                                 small, small_max_pairs(E) if small is not None else 0)


def _bodies(kind, E, N, KD, top_k, beta, beta_lin, out_dtype, stages, short_tiles, staged, warp_specialized,
            bm=BM):
    """(plain body or None, warp-specialized body or None, the branch's pair count, small-tile
    body or None) for the ``warp_specialized`` choice (False, True or "auto": all three where
    ``moe_plan.warp_specialized_shapes``, else plain)."""
    if warp_specialized not in (False, True, "auto"):
        raise ValueError(f"warp_specialized must be False, True or 'auto', got {warp_specialized!r}")
    if warp_specialized == "auto" and not warp_specialized_shapes(KD, N):  # (L, I) or (I, L)
        warp_specialized = False
    plain = ws = small = None
    if warp_specialized is not True:
        plain = _grouped_wgmma(kind, E, N, KD, top_k, beta, beta_lin, out_dtype, stages, short_tiles, staged, bm)
    if warp_specialized:
        ws = _grouped_wgmma_ws(kind, E, N, KD, top_k, beta, beta_lin, out_dtype, STAGES)
    if warp_specialized == "auto":
        small = _grouped_wgmma(kind, E, N, KD, top_k, beta, beta_lin, out_dtype, SMALL_STAGES, short_tiles,
                               False, BM_SMALL)
    return plain, ws, ws_min_pairs(E), small


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_grouped_gate_up_wgmma_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                                     beta: float, beta_lin: float | None, out_dtype: str = "bfloat16",
                                     stages: int = STAGES, short_tiles: bool = True, staged: bool = False,
                                     warp_specialized: bool | str = "auto", bm: int = BM):
    """Grouped MXFP4 GEMM for W1/W3 with SiTU fused, on wgmma (cuda-sm90a). Arguments as
    :func:`schedules.moe_mxfp4_prefill_cuda.moe_grouped_gate_up_kernel`, except: ``z [T, L]``
    in the permuted k order, ``a_sorted [T·k, I]`` written in the permuted k order;
    ``warp_specialized``: False (plain), True (warp-specialized, tiles of TM_WS rows) or
    "auto" (both behind a host branch at :func:`ws_min_pairs` pairs, where
    ``moe_plan.warp_specialized_shapes``); ``stages``, ``short_tiles``, ``staged``, ``bm``
    (token rows per tile: the sort's, :func:`moe_sort_wgmma_kernel`): the plain form's (the
    warp-specialized one has 4 stages).

    Raises:
        ValueError: L not a multiple of 128, I not a multiple of 64; ``stages < 3``; shared
            memory over the limit (the scale table grows with L).
    """
    plain, ws, ws_from, small = _bodies("gate_up", num_experts, inter, latent, top_k, beta, beta_lin, out_dtype,
                                        stages, short_tiles, staged, warp_specialized, bm)
    return _primfunc("gate_up", num_experts, inter, latent, top_k, out_dtype, plain, ws, ws_from, small)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_grouped_down_wgmma_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                                  out_dtype: str = "bfloat16", stages: int = STAGES,
                                  short_tiles: bool = True, warp_specialized: bool | str = "auto", bm: int = BM):
    """Grouped MXFP4 GEMM for W2 on wgmma (cuda-sm90a). Arguments as :func:`schedules.
    moe_mxfp4_prefill_cuda.moe_grouped_down_kernel`, with ``a_sorted`` in the permuted k order;
    ``warp_specialized`` as for :func:`moe_grouped_gate_up_wgmma_kernel`.

    Raises:
        ValueError: I not a multiple of 128, L not a multiple of 128; ``stages < 3``; shared
            memory over the limit.
    """
    plain, ws, ws_from, small = _bodies("down", num_experts, latent, inter, top_k, 0.0, None, out_dtype, stages,
                                        short_tiles, False, warp_specialized, bm)
    return _primfunc("down", num_experts, latent, inter, top_k, out_dtype, plain, ws, ws_from, small)
