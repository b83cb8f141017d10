"""Dense bf16 projections at batched-decode sizes (tens of tokens) on Hopper warpgroup MMA,
split over K: ``y[i, j] = epilogue(Σ_k x[i, k] · W[j, k])`` as in
:mod:`schedules.dense_prefill_wgmma`, for the token counts where one 128-row weight tile per
block leaves most SMs idle.

Why: at 64 tokens the ``mma.sync`` decode kernel (:mod:`schedules.dense_decode_tc`, 16 weight
rows per block) re-reads every token row from L2 for each 16 rows of weights, and took 47-106 µs
per K3 MoE-layer projection where cuBLAS takes 16-25 µs
(benchmarks/results/dense_prefill_wgmma_h200_2026-11-30.json); the prefill kernel's 128 × 256
tiles give only 14-28 blocks there.

Mapping. A block = one producer warpgroup (``cp.async`` copies into ``stages`` shared-memory
stages, ``full`` / ``empty`` mbarriers, the copy pattern of
:func:`schedules.dense_prefill_wgmma.copy_chunk`) and one consumer warpgroup, which owns
:data:`BM` = 64 tokens × :data:`BN` = 128 weight rows of one of ``splits`` equal runs of K steps:
per K step of 64 inputs four ``wgmma.m64n128k16`` (tokens as A, weight rows as B, both from
shared memory). Grid: row tiles × (splits × token tiles). Each block writes its fp32 partial
sums to a workspace ``[splits, n, N]`` (allocated by the function: TVM's device workspace);
a second kernel adds the ``splits`` partials of each output in split order, applies the fused
epilogue and stores. Two blocks per SM (96 KiB of stages each).

Reference: :func:`schedules.dense_decode_tc.dense_reference`; the split choice is tested on the
CPU (tests/test_dense_prefill_wgmma.py), the kernel against torch on the H200
(tests/gpu/check_dense_decode.py, benchmarks/moe_layer.py).
"""

from __future__ import annotations

from tvm.script import tirx as T

from schedules.dense_decode_tc import standalone_kernel

from schedules.dense_prefill_wgmma import BK, SMEM_LIMIT, acc_position, pipeline_words, stage_pipeline
from schedules.wgmma_ptx import smem_address, sw128_desc, words_to_1024

BM = 64           # tokens per tile (one wgmma M)
BN = 128          # weight rows per tile (the wgmma's N)
NC = NP = 128     # consumer threads (one warpgroup) and producer threads (one)
STAGES = 4
TARGET_BLOCKS = 264   # two blocks per SM on the H200's 132 SMs
# up to this many tokens the splits aim at TARGET_BLOCKS blocks, above at half as many (the
# partial sums' traffic grows with splits × tokens; dense_splitk_h200_2026-11-30.json: at 64
# tokens half the splits took 22.0 vs 25.6 us for 3584 x 7168, at 32 tokens 24.2 vs 20.9)
FEW_TOKENS = 32
MIN_STEPS = 4         # K steps per block at least (the pipeline's depth)
RED = 4               # outputs per thread of the reduction kernel


def fits(n_rows: int, in_width: int) -> bool:
    """Whether the kernel runs ``W [n_rows, in_width]``: rows a multiple of :data:`BN`, the input
    width a multiple of 64, under 2^31 elements."""
    return n_rows % BN == 0 and in_width % BK == 0 and n_rows * in_width < 2 ** 31


def choose_splits(n_rows: int, in_width: int, target: int = TARGET_BLOCKS) -> int:
    """Splits of K for ``W [n_rows, in_width]`` at one token tile: the largest divisor ``s`` of
    the K steps with (row tiles × s) ≤ ``target`` blocks and at least :data:`MIN_STEPS` steps per
    split (1 where none is larger)."""
    nk = in_width // BK
    tiles = n_rows // BN
    best = 1
    for s in range(1, nk + 1):
        if nk % s == 0 and tiles * s <= target and nk // s >= MIN_STEPS:
            best = s
    return best


def smem_bytes(stages: int = STAGES) -> int:
    """Dynamic shared memory per block: the stages, 1 KiB of alignment slack, the mbarriers."""
    return pipeline_words(stages, BM, BN) * 4


def dense_splitk_macro(N: int, K: int, splits: int | None = None, stages: int = STAGES,
                       token_range: tuple[int, int] | None = None):
    """The kernels as a TVMScript macro ``body(x, w, y, n, store)`` (the signature of
    :func:`schedules.dense_decode_tc.dense_tc_macro`; ``n >= 1``). ``splits``: a fixed number
    of K splits; by default :func:`choose_splits` for :data:`TARGET_BLOCKS` blocks up to
    :data:`FEW_TOKENS` tokens and for half as many above (chosen at run time from ``n``).
    ``token_range = (lo, hi)``: the function branches to the kernels only for ``lo <= n <= hi``
    (k3_compile.build); TVM allocates the workspace at the function's entry whatever branch
    runs, so outside that range it is sized for one token (the kernels must not run there).

    Raises:
        ValueError: ``N`` not a multiple of 128, ``K`` not a multiple of 64, ``splits`` below 1
            or not dividing the K steps, ``stages < 2``, a bad ``token_range``, shared memory
            over the limit.
    """
    if not fits(N, K):
        raise ValueError(f"W [{N}, {K}]: rows must be a multiple of {BN} and the input width a "
                         f"multiple of {BK} (and under 2^31 elements)")
    NK = K // BK
    S1, S2 = (splits, splits) if splits is not None else (choose_splits(N, K), choose_splits(N, K, TARGET_BLOCKS // 2))
    if NK % S1:
        raise ValueError(f"{S1} splits do not divide the {NK} K steps of {BK} inputs")
    SMAX = max(S1, S2)
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    if stages < 2:
        raise ValueError(f"stages must be at least 2, got {stages}")
    if token_range is not None and not 1 <= token_range[0] <= token_range[1]:
        raise ValueError(f"token_range must be (lo, hi) with 1 <= lo <= hi, got {token_range}")
    if 2 * smem_bytes(stages) > SMEM_LIMIT:
        raise ValueError(f"{stages} stages need {smem_bytes(stages)} bytes of shared memory per block "
                         f"(two blocks per SM: limit {SMEM_LIMIT // 2})")
    NS = stages
    XW = K // 2                  # uint32 words per row of x and W
    SM_WORDS = pipeline_words(NS, BM, BN)
    ND = BN // 2                 # fp32 accumulators per consumer thread
    TN = N // BN
    AJ = BM // 16                # token-row copies per producer thread per step
    init, addresses, produce, consume = stage_pipeline(NS, BM, BN, K, NC)

    def n_splits(n):
        return T.if_then_else(n <= FEW_TOKENS, T.int64(S1), T.int64(S2)) if S1 != S2 else T.int64(S1)

    def ws_tokens(n):
        if token_range is None:
            return n
        return T.if_then_else(T.And(n >= token_range[0], n <= token_range[1]), n, T.int64(1))

    @T.macro
    def body(x, w, y, n, store):
        xq = T.decl_buffer((n * XW,), "uint32", data=x.data)
        wq = T.decl_buffer((N * XW,), "uint32", data=w.data)
        # fp32 partial sums [split, n, N] in a device workspace (allocated at the function's
        # entry for every call: sized by ws_tokens)
        ws = T.decl_buffer((SMAX * ws_tokens(n) * N,), "float32", scope="global")
        # SMAX splits per token tile in the grid; the blocks past the run-time splits exit (a
        # grid extent that depends on n through a select gets its kernel duplicated by TVM's
        # passes with one thread variable in both copies, which its bound analysis rejects)
        for by in T.thread_binding(SMAX * ((n + BM - 1) // BM), thread="blockIdx.y"):
            for bx in T.thread_binding(TN, thread="blockIdx.x"):
                for tx in T.thread_binding(NC + NP, thread="threadIdx.x"):
                    with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 2):
                        sm = T.alloc_buffer((SM_WORDS,), "uint32", scope="shared.dyn")
                        acc = T.alloc_buffer((ND,), "float32", scope="local")
                        ga = T.alloc_buffer((AJ + 1,), "uint64", scope="local")
                        sb = T.alloc_buffer((1,), "uint32", scope="local")
                        desc = T.alloc_buffer((1,), "uint64", scope="local")
                        # [0] words from sm to its first 1024-byte boundary, [1] n, [2] token tile,
                        # [3] the split's first K step, [4] splits, [5] K steps per split
                        rr = T.alloc_buffer((6,), "int32", scope="local")
                        rr[0] = words_to_1024(sm)
                        rr[1] = T.Cast("int32", n)
                        rr[4] = T.Cast("int32", n_splits(n))
                        rr[5] = NK // rr[4]
                        rr[2] = T.Cast("int32", by) // SMAX
                        rr[3] = T.Cast("int32", by) % SMAX * rr[5]
                        if T.Cast("int32", by) % SMAX < rr[4]:
                            init(sm, tx)
                            T.tvm_storage_sync("shared.dyn")
                            if tx >= NC:
                                # ---- producers
                                addresses(ga, xq, wq, tx - NC, rr[2] * BM, rr[1], T.Cast("int32", bx) * BN,
                                          rr[3] * (BK // 2))
                                sb[0] = smem_address(T.address_of(sm[rr[0]]))
                                produce(sm, sb, ga, tx - NC, rr[5])
                            else:
                                # ---- consumers: the tile's 64 tokens × 128 rows over the split's K steps
                                desc[0] = sw128_desc(smem_address(T.address_of(sm[rr[0]])))
                                consume(sm, desc, acc, 0, rr[5])
                                # partial sums (the wgmma D fragment, acc_position)
                                for a in T.unroll(ND):
                                    if rr[2] * BM + acc_position(tx, a)[0] < rr[1]:
                                        ws[(T.Cast("int64", T.Cast("int32", by) % SMAX) * n
                                            + T.Cast("int64", rr[2] * BM + acc_position(tx, a)[0])) * N
                                           + T.Cast("int64", T.Cast("int32", bx) * BN + acc_position(tx, a)[1])] = acc[a]
        # the splits' partials of each output, in split order, through the epilogue
        for b in T.thread_binding((n * (N // RED) + 127) // 128, thread="blockIdx.x"):
            for t in T.thread_binding(128, thread="threadIdx.x"):
                red = T.alloc_buffer((RED,), "float32", scope="local")
                if T.Cast("int64", b) * 128 + T.Cast("int64", t) < n * (N // RED):
                    for v in T.vectorized(RED):
                        red[v] = ws[(T.Cast("int64", b) * 128 + T.Cast("int64", t)) * RED + v]
                    for s in range(1, T.Cast("int32", n_splits(n))):
                        for v in T.vectorized(RED):
                            red[v] = red[v] + ws[T.Cast("int64", s) * n * N
                                                 + (T.Cast("int64", b) * 128 + T.Cast("int64", t)) * RED + v]
                    for v in T.unroll(RED):
                        store(y, (T.Cast("int64", b) * 128 + T.Cast("int64", t)) // (N // RED),
                              (T.Cast("int64", b) * 128 + T.Cast("int64", t)) % (N // RED) * RED + v, red[v])

    return body


def dense_splitk_kernel(N: int, K: int, out_dtype: str = "float32", splits: int | None = None,
                        stages: int = STAGES):
    """Standalone PrimFunc ``(x [n, K] bf16, w [N, K] bf16, y [n, N] out_dtype)``, ``n >= 1``
    (``y = x @ wᵀ``), for tests and benchmarks.

    Raises:
        ValueError: as :func:`dense_splitk_macro`.
    """
    return standalone_kernel(dense_splitk_macro(N, K, splits, stages), N, K, out_dtype)
