"""Dense bf16 projections at prefill sizes on Hopper warpgroup MMA (``wgmma``, sm_90a):
``y[i, j] = epilogue(Σ_k x[i, k] · W[j, k])`` for ``n`` tokens (``x [n, K]`` bf16, ``W [N, K]``
bf16 as the checkpoint stores it, fp32 accumulation), both operands read by the tensor cores
from shared memory.

Why: the ``mma.sync`` kernel of :mod:`schedules.dense_decode_tc` is built for decode (16 weight
rows per block, tokens from L2); at 8192 tokens the K3 MoE layer's dense projections took 37.7
ms with it, cuBLAS 4.5 ms (benchmarks/results/moe_layer_h200_2026-11-30.json). The compile
pipeline (``k3_compile.build.low_batch_specialize``) gives each projection this kernel from
``k3_compile.build.WGMMA_FROM`` (256) tokens on, on targets with ``wgmma``.

Mapping. A block computes a tile of :data:`BM` = 128 tokens × ``BN`` (256, else 128) weight
rows. Its two consumer warpgroups take 64 tokens each: per K step of :data:`BK` = 64 inputs,
four ``wgmma.m64n{BN}k16`` (one per k16 slice) with the tokens as A (M = 64) and the weight
rows as B (N = ``BN``), both from shared memory through matrix descriptors
(:func:`schedules.wgmma_ptx.wgmma_bf16_ss`): the accumulator ``d[4j + c]`` of thread ``(w, g,
q)`` (warp ``w`` of its warpgroup, ``g = lane / 4``, ``q = lane % 4``) is token ``16w + g +
8·(c // 2)``, weight row ``8j + 2q + c % 2`` of the tile (:func:`acc_position`). One producer
warpgroup issues every ``cp.async`` copy: each K step's token tile (128 rows of 128 bytes) and
weight tile (``BN`` rows) into one of ``stages`` shared-memory stages, 128-byte rows with the
128-byte swizzle the descriptors name (:func:`copy_chunk`), and arrives on the stage's ``full``
mbarrier when its copies land; the consumers wait on it and, once a step's wgmmas are done,
arrive on its ``empty`` mbarrier, which the producers wait on before refilling the stage (the
pipeline of :mod:`schedules.moe_mxfp4_prefill_wgmma`'s warp-specialized kernels, without the
dequantization). ``setmaxnreg``: 232 registers per consumer thread (``BN`` = 256 needs 128 fp32
accumulators), 40 per producer thread; one block per SM. Blocks walk the tiles in groups of
:data:`GROUP_M` token tiles (the token tile fastest), so that the blocks in flight share
weight tiles in L2. Token rows past ``n`` are copied from row ``n - 1`` and never stored.

Reference: :func:`schedules.dense_decode_tc.dense_reference` (NumPy); the copy and accumulator
mappings are checked on the CPU (tests/test_dense_prefill_wgmma.py), the kernel against torch
on the H200 (tests/gpu/check_dense_decode.py, benchmarks/moe_layer.py).
"""

from __future__ import annotations

from tvm.script import tirx as T

from schedules.dense_decode_tc import standalone_kernel

from schedules.mxfp4_ptx import wait
from schedules.wgmma_ptx import (cp_async16_raw, cp_async_mbar_arrive, fence_proxy_async, global_address,
                                 mbar_arrive, mbar_init, mbar_wait, setmaxnreg, smem_address, sw128_desc,
                                 swizzle128_word, wgmma_bf16_ss, wgmma_commit, wgmma_fence, wgmma_wait,
                                 words_to_1024)

BM = 128          # tokens per tile (two consumer warpgroups of 64)
BK = 64           # inputs per K step (one 128-byte row of bf16)
NC, NP = 256, 128  # consumer threads (two warpgroups) and producer threads (one)
REGS = (40, 232)  # registers per producer / consumer thread (setmaxnreg)
GROUP_M = 8       # token tiles per group of the tile order
STAGES = 4
SMEM_LIMIT = 227 * 1024


def tile_rows(n_rows: int) -> int | None:
    """Weight rows per tile (the wgmma's N) for a ``W [n_rows, K]`` projection: 256 where
    ``n_rows`` is a multiple of 256, else 128 where it is a multiple of 128, else None."""
    return next((b for b in (256, 128) if n_rows % b == 0), None)


def fits(n_rows: int, in_width: int) -> bool:
    """Whether the kernel runs ``W [n_rows, in_width]``: rows a multiple of 128, the input width
    a multiple of :data:`BK`, under 2^31 elements."""
    return tile_rows(n_rows) is not None and in_width % BK == 0 and n_rows * in_width < 2 ** 31


def copy_chunk(p, j):
    """(tile row, 16-byte chunk) of producer thread ``p`` (0..127)'s ``j``-th copy of a tile:
    row ``p / 8 + 16 j``, chunk ``p % 8`` (a warp copies 4 whole 128-byte rows). Its word in the
    stage is ``swizzle128_word(row, chunk)``; ``row % 8 = (p / 8) % 8`` for every ``j``."""
    return p // 8 + 16 * j, p % 8


def acc_position(tx, a):
    """(token, weight row) within the tile of consumer thread ``tx`` (0..255)'s accumulator
    ``a``: warpgroup ``tx / 128`` owns tokens ``64·(tx / 128) ..``; warp ``w``, lane ``(g, q)``:
    token ``16w + g + 8·(c / 2)``, row ``8j + 2q + c % 2`` for ``a = 4j + c`` (the wgmma D
    fragment, PTX ISA 9.7.15.5.1)."""
    w, lane = tx // 32, tx % 32
    j, c = a // 4, a % 4
    return 16 * w + lane // 4 + 8 * (c // 2), 8 * j + 2 * (lane % 4) + c % 2


def tile_of(bid, tiles_m, tiles_n, group: int = GROUP_M):
    """(token tile, row tile) of block ``bid``: groups of ``group`` token tiles, the token tile
    fastest within a group (Python ints or TIR expressions)."""
    per_group = group * tiles_n
    first = bid // per_group * group
    size = T.min(tiles_m - first, group) if not isinstance(tiles_m, int) else min(tiles_m - first, group)
    r = bid % per_group
    return first + r % size, r // size


def pipeline_words(stages: int, a_rows: int, b_rows: int, base: int = 256) -> int:
    """uint32 words of the shared buffer of :func:`stage_pipeline`: ``base`` words of alignment
    slack (1 KiB), ``stages`` × (``a_rows`` + ``b_rows``) rows of 128 bytes, the mbarriers
    (two uint64 per stage)."""
    return base + stages * (a_rows + b_rows) * 32 + 4 * stages


def smem_bytes(n_rows: int, stages: int = STAGES, bn: int | None = None) -> int:
    """Dynamic shared memory of a block: ``stages`` × (128 + BN) rows of 128 bytes, 1 KiB of
    alignment slack, the mbarriers (BN = ``bn`` or :func:`tile_rows`)."""
    return pipeline_words(stages, BM, bn or tile_rows(n_rows) or 128) * 4


def stage_word(stage, row, chunk, a_rows: int, b_rows: int, weights: bool):
    """uint32 word offset, from the pipeline's aligned base, of 16-byte chunk ``chunk`` of row
    ``row`` of a stage's token tile (``weights`` False) or weight tile (True): stages of
    ``a_rows`` token rows then ``b_rows`` weight rows of 128 bytes, each tile under the 128-byte
    swizzle (:func:`schedules.wgmma_ptx.swizzle128_word`). Python ints or TIR expressions; the
    producers' copies (:func:`stage_pipeline`) write here."""
    off = stage * (a_rows + b_rows) * 32
    if weights:
        off = off + a_rows * 32
    return off + swizzle128_word(row, chunk)


def stage_desc(stage, s, a_rows: int, b_rows: int, weights: bool, a_row0=0):
    """Offset, in 16-byte descriptor units from stage 0's tile, of the matrix descriptor of k16
    slice ``s`` (0..3) of a stage: the token rows from ``a_row0`` (the wgmma's A, 64 rows) or the
    weight tile (its B). The consumers' wgmmas (:func:`stage_pipeline`) read there."""
    off = stage * ((a_rows + b_rows) * 32 // 4)
    off = off + (a_rows if weights else a_row0) * (128 // 16)
    return off + 2 * s


def stage_pipeline(stages: int, a_rows: int, b_rows: int, K: int, consumers: int, base: int = 256):
    """TVMScript macros of the shared-memory pipeline both Hopper dense kernels run (this module
    and :mod:`schedules.dense_splitk_wgmma`): ``stages`` stages of ``a_rows`` token rows then
    ``b_rows`` weight rows (128 bytes each, 128-byte swizzle) from word ``base`` of the aligned
    buffer, then ``full[stages]`` / ``empty[stages]`` mbarriers; inputs of width ``K``; one
    producer warpgroup and ``consumers`` consumer threads. Returns
    ``(init, addresses, produce, consume)``:

    - ``init(sm, tx)``: thread 0 initialises the mbarriers (the caller barriers the block);
    - ``addresses(ga, xq, wq, p, tok0, n, row0, k0)``: producer thread ``p``'s step-0 global
      addresses into ``ga`` — its token rows ``tok0 + copy_chunk(p, j)`` (clamped to the last
      of ``n``) of ``xq`` and its weight rows from ``row0`` of ``wq`` (uint32 views of rows of
      ``K / 2`` words), from word ``k0`` of each row (None: 0);
    - ``produce(sm, sb, ga, p, steps)``: producer thread ``p`` (0..127) copies ``steps`` K steps,
      its token rows from ``ga[j]`` and weight rows from ``ga[a_rows / 16]`` (uint64 global
      addresses of step 0, :func:`copy_chunk`'s rows), to the stage at shared address ``sb[0]``;
    - ``consume(sm, desc, acc, a_row0, steps)``: per K step four ``wgmma.m64n{b_rows}k16`` into
      ``acc`` from the 64 token rows from ``a_row0`` (``desc[0]``: stage
      0's descriptor), each stage released once its wgmmas are done.
    """
    NS = stages
    SW = (a_rows + b_rows) * 32
    OB = base + NS * SW
    AJ, WJ = a_rows // 16, b_rows // 16

    @T.macro
    def init(sm, tx):
        if tx == 0:
            for i in range(NS):
                T.evaluate(mbar_init(T.address_of(sm[OB + 2 * i]), NP))                # full: producer threads
                T.evaluate(mbar_init(T.address_of(sm[OB + 2 * (NS + i)]), consumers))  # empty: consumer threads

    def from_k0(word, k0):
        return word if k0 is None else word + k0

    @T.macro
    def addresses(ga, xq, wq, p, tok0, n, row0, k0):
        for j in T.unroll(AJ):
            ga[j] = global_address(T.address_of(xq[
                from_k0(T.Cast("int64", T.min(tok0 + copy_chunk(p, j)[0], n - 1)) * (K // 2), k0)
                + copy_chunk(p, j)[1] * 4]))
        ga[AJ] = global_address(T.address_of(wq[
            from_k0(T.Cast("int64", row0 + copy_chunk(p, 0)[0]) * (K // 2), k0) + copy_chunk(p, 0)[1] * 4]))

    @T.macro
    def produce(sm, sb, ga, p, steps):
        for ks in range(steps):
            if ks >= NS:
                T.evaluate(mbar_wait(T.address_of(sm[OB + 2 * (NS + ks % NS)]), T.Cast("uint32", (ks // NS + 1) % 2)))
            for j in T.unroll(AJ):
                T.evaluate(cp_async16_raw(
                    sb[0] + T.Cast("uint32", stage_word(ks % NS, *copy_chunk(p, j), a_rows, b_rows, False) * 4),
                    ga[j] + T.Cast("uint64", ks * BK * 2)))
            for j in T.unroll(WJ):
                T.evaluate(cp_async16_raw(
                    sb[0] + T.Cast("uint32", stage_word(ks % NS, *copy_chunk(p, j), a_rows, b_rows, True) * 4),
                    ga[AJ] + T.Cast("uint64", j * 16 * K * 2 + ks * BK * 2)))
            T.evaluate(cp_async_mbar_arrive(T.address_of(sm[OB + 2 * (ks % NS)])))
        T.evaluate(wait(0))

    @T.macro
    def consume(sm, desc, acc, a_row0, steps):
        for ks in range(steps):
            T.evaluate(mbar_wait(T.address_of(sm[OB + 2 * (ks % NS)]), T.Cast("uint32", ks // NS % 2)))
            T.evaluate(fence_proxy_async())
            T.evaluate(wgmma_fence())
            for s in T.unroll(4):
                T.evaluate(wgmma_bf16_ss(
                    b_rows, T.address_of(acc[0]),
                    desc[0] + T.Cast("uint64", stage_desc(ks % NS, s, a_rows, b_rows, False, a_row0)),
                    desc[0] + T.Cast("uint64", stage_desc(ks % NS, s, a_rows, b_rows, True)),
                    T.Cast("int32", ks + s > 0)))
            T.evaluate(wgmma_commit())
            T.evaluate(wgmma_wait(1))
            if ks > 0:  # step ks - 1's wgmmas are done: its stage may be refilled
                T.evaluate(mbar_arrive(T.address_of(sm[OB + 2 * (NS + (ks + NS - 1) % NS)])))
        T.evaluate(wgmma_wait(0))

    return init, addresses, produce, consume


def dense_wgmma_macro(N: int, K: int, stages: int = STAGES, group: int = GROUP_M, bn: int | None = None):
    """The kernel as a TVMScript macro ``body(x, w, y, n, store)``, as
    :func:`schedules.dense_decode_tc.dense_tc_macro`: ``x`` bf16 ``[n, K]`` (``n >= 1``), ``w``
    bf16 ``[N, K]``, ``store(y, i, j, acc)`` emitting the store of the fp32 sum ``acc`` of token
    ``i``, row ``j`` (int64). ``bn``: weight rows per tile (128 or 256; default
    :func:`tile_rows`).

    Raises:
        ValueError: ``N`` not a multiple of 128 (of ``bn``), ``K`` not a multiple of 64, over
            2^31 elements, ``stages < 2``, ``group < 1``, shared memory over the per-block limit.
    """
    if not fits(N, K):
        raise ValueError(f"W [{N}, {K}]: rows must be a multiple of 128 and the input width a "
                         f"multiple of {BK} (and under 2^31 elements)")
    if stages < 2:
        raise ValueError(f"stages must be at least 2, got {stages}")
    if group < 1:
        raise ValueError(f"group must be at least 1 token tile, got {group}")
    BN = bn or tile_rows(N)
    if BN not in (128, 256) or N % BN:
        raise ValueError(f"tile of {BN} weight rows: 128 or 256, dividing the {N} rows")
    if smem_bytes(N, stages, BN) > SMEM_LIMIT:
        raise ValueError(f"{stages} stages need {smem_bytes(N, stages, BN)} bytes of shared memory (limit {SMEM_LIMIT})")
    NS = stages
    NK = K // BK
    XW = K // 2                  # uint32 words per row of x and W
    SM_WORDS = pipeline_words(NS, BM, BN)
    ND = BN // 2                 # fp32 accumulators per consumer thread
    TN = N // BN                 # row tiles
    AJ = BM // 16                # token-row copies per producer thread per step
    init, addresses, produce, consume = stage_pipeline(NS, BM, BN, K, NC)
    if NP * REGS[0] + NC * REGS[1] > (NP + NC) * (65536 // (NP + NC) // 8 * 8):
        raise ValueError("setmaxnreg totals exceed the block's registers")

    @T.macro
    def body(x, w, y, n, store):
        xq = T.decl_buffer((n * XW,), "uint32", data=x.data)
        wq = T.decl_buffer((N * XW,), "uint32", data=w.data)
        for bid in T.thread_binding((n + BM - 1) // BM * TN, thread="blockIdx.x"):
            for tx in T.thread_binding(NC + NP, thread="threadIdx.x"):
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1):
                    sm = T.alloc_buffer((SM_WORDS,), "uint32", scope="shared.dyn")
                    acc = T.alloc_buffer((ND,), "float32", scope="local")
                    ga = T.alloc_buffer((AJ + 1,), "uint64", scope="local")  # producer: step-0 addresses
                    sb = T.alloc_buffer((1,), "uint32", scope="local")
                    desc = T.alloc_buffer((1,), "uint64", scope="local")
                    # [0] words from sm to its first 1024-byte boundary, [1] n, [2] token tile, [3] row tile
                    rr = T.alloc_buffer((4,), "int32", scope="local")
                    rr[0] = words_to_1024(sm)
                    rr[1] = T.Cast("int32", n)
                    rr[2] = tile_of(T.Cast("int32", bid), (rr[1] + BM - 1) // BM, TN, group)[0]
                    rr[3] = tile_of(T.Cast("int32", bid), (rr[1] + BM - 1) // BM, TN, group)[1]
                    init(sm, tx)
                    T.tvm_storage_sync("shared.dyn")
                    if tx >= NC:
                        # ---- producers
                        T.evaluate(setmaxnreg("dec", REGS[0]))
                        addresses(ga, xq, wq, tx - NC, rr[2] * BM, rr[1], rr[3] * BN, None)
                        sb[0] = smem_address(T.address_of(sm[rr[0]]))
                        produce(sm, sb, ga, tx - NC, NK)
                    else:
                        # ---- consumers: warpgroup tx / 128 takes token rows 64·(tx / 128) .. of the tile
                        T.evaluate(setmaxnreg("inc", REGS[1]))
                        desc[0] = sw128_desc(smem_address(T.address_of(sm[rr[0]])))
                        consume(sm, desc, acc, tx // 128 * 64, NK)
                        for a in T.unroll(ND):
                            if rr[2] * BM + tx // 128 * 64 + acc_position(tx % 128, a)[0] < rr[1]:
                                store(y, T.Cast("int64", rr[2] * BM + tx // 128 * 64 + acc_position(tx % 128, a)[0]),
                                      T.Cast("int64", rr[3] * BN + acc_position(tx % 128, a)[1]), acc[a])

    return body


def dense_wgmma_kernel(N: int, K: int, out_dtype: str = "float32", stages: int = STAGES,
                       group: int = GROUP_M, bn: int | None = None):
    """Standalone PrimFunc ``(x [n, K] bf16, w [N, K] bf16, y [n, N] out_dtype)``, ``n >= 1``,
    of the kernel (``y = x @ wᵀ``), for tests and benchmarks; the compile pipeline splices
    :func:`dense_wgmma_macro` into the model's fused functions instead.

    Raises:
        ValueError: as :func:`dense_wgmma_macro`.
    """
    return standalone_kernel(dense_wgmma_macro(N, K, stages, group, bn), N, K, out_dtype)
