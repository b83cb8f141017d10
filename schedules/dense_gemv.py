"""Dense bf16 projections at one or two tokens: ``y[i, j] = epilogue(Σ_k x[i, k] · W[j, k])``
for ``n <= MAX_TOKENS`` tokens (``x [n, K]`` bf16, ``W [N, K]`` bf16 as the checkpoint stores
it, fp32 sums), on CUDA cores.

Why: at one token a projection is a pure weight stream, and its speed is the number of weight
bytes in flight. dlight's LowBatchGEMV, which the model's projections took at 1-2 tokens, keeps
few in flight on the projections with few rows: the MoE router (896 x 7168, 12.8 MB) took
15.5 µs against 3.0 µs of HBM time, the latent down projection (3584 x 7168) 18.8 against 12.1
(benchmarks/results/moe_layer_final_h200_2026-11-30.json).

Mapping (:func:`gemv_layout`): a block of :data:`THREADS` threads owns ``rows`` weight rows;
``tpr = THREADS / rows`` threads share a row. A row's ``K / 8`` 16-byte chunks go to its
threads round-robin (thread ``t`` of the row takes chunks ``t, t + tpr, ...``: each
instruction of a warp reads 512 contiguous bytes), ``group`` of them at a time: a thread issues
all ``group`` weight loads before the first multiply, so a block has ``THREADS · group · 16``
bytes in flight (28 KB at K3's 7168 inputs; 32 registers, 8 blocks per SM: 1056 resident on
the H200, the router's 448 blocks in one wave, the 3584-row projections' 1792 in two).
The token rows (the same for every block) come from L1/L2. Each thread's fp32 partial sums
meet across the warp (shuffles), then across the row's warps in shared memory; thread
``(row, token)`` applies the epilogue and stores.

Reference: :func:`schedules.dense_decode_tc.dense_reference` (NumPy) and :func:`emulate` (the
kernel's partition of the sums, tests/test_dense_gemv.py); on the H200
tests/gpu/check_dense_decode.py (odd sizes, against torch) and benchmarks/moe_layer.py (the
K3 MoE layer against a torch reference).
"""

from __future__ import annotations

import numpy as np
from tvm.backend.cuda.op import cuda_func_call
from tvm.script import tirx as T

from schedules.moe_mxfp4_cuda import bf16_half

THREADS = 256     # threads per block
# tokens a call handles (the model's branch for n <= 2). Built for 4 (dense_gemv_t4_h200_2026-11-30.json)
# it is as fast as the tensor-core decode kernel at 3 tokens and 6-18% slower at 4 on K3's
# 3584-7168-row projections (the token rows' L1 reads and conversions grow with the tokens),
# and 2-4% slower at one token.
MAX_TOKENS = 2
CHUNK = 8         # bf16 inputs per 16-byte chunk
MIN_GROUP = 4     # fewest chunks in flight per thread that a layout aims for
MAX_GROUP = 8     # most chunks a thread holds in registers at once


def gemv_layout(in_width: int) -> tuple[int, int, int]:
    """``(tpr, group, passes)`` for ``in_width`` (K) inputs: ``tpr`` threads per row (a
    multiple of 32 dividing :data:`THREADS`; the most that leave each thread at least
    :data:`MIN_GROUP` chunks, else 32), ``group`` chunks a thread loads before its multiplies
    (the largest divisor of its chunk count up to :data:`MAX_GROUP`) and ``passes`` such groups.

    Raises:
        ValueError: ``in_width`` not a multiple of 256 (32 threads x 8 inputs).
    """
    if in_width <= 0 or in_width % (32 * CHUNK):
        raise ValueError(f"the input width must be a positive multiple of {32 * CHUNK}, got {in_width}")
    chunks = in_width // CHUNK
    options = [t for t in (256, 128, 64, 32) if t <= THREADS and chunks % t == 0]
    tpr = next((t for t in options if chunks // t >= MIN_GROUP), options[-1])
    per_thread = chunks // tpr
    group = max(g for g in range(1, MAX_GROUP + 1) if per_thread % g == 0)
    return tpr, group, per_thread // group


def rows_per_block(in_width: int) -> int:
    """Weight rows a block owns: ``THREADS / tpr`` (:func:`gemv_layout`)."""
    return THREADS // gemv_layout(in_width)[0]


def fits(n_rows: int, in_width: int) -> bool:
    """Whether ``W [n_rows, in_width]`` fits: the input width a multiple of 256 (a
    :func:`gemv_layout` exists), the rows a multiple of :func:`rows_per_block`, fewer than 2^31
    elements (int32 indices)."""
    try:
        rows = rows_per_block(in_width)
    except ValueError:
        return False
    return n_rows % rows == 0 and n_rows * in_width < 2 ** 31


def chunk_index(p, u, t, tpr: int, group: int):
    """Chunk (of :data:`CHUNK` inputs, within a row) that thread ``t`` (0..tpr-1) of a row
    reads in pass ``p``, group slot ``u``: ``(p · group + u) · tpr + t`` (the kernel's loads use
    it; ints or TIR expressions)."""
    return (p * group + u) * tpr + t


def weight_word(blk, tx, p, u, K: int):
    """uint32-word offset in ``W`` of the 16-byte chunk that thread ``tx`` of block ``blk``
    loads in pass ``p``, group slot ``u`` (its row ``blk · rows + tx // tpr``; the kernel's
    weight loads use it; ints or TIR expressions)."""
    tpr, G, _ = gemv_layout(K)
    return (blk * (THREADS // tpr) + tx // tpr) * (K // 2) + chunk_index(p, u, tx % tpr, tpr, G) * 4


def token_word(i, tx, p, u, K: int):
    """uint32-word offset in ``x`` of token ``i``'s inputs that multiply that weight chunk."""
    tpr, G, _ = gemv_layout(K)
    return i * (K // 2) + chunk_index(p, u, tx % tpr, tpr, G) * 4


def partial_slot(tx, i, max_tokens: int = MAX_TOKENS):
    """Shared-memory slot where lane 0 of thread ``tx``'s warp leaves the warp's sum for token ``i``."""
    return tx // 32 * max_tokens + i


def final_slot(tx, wi, K: int, max_tokens: int = MAX_TOKENS):
    """Slot of the ``wi``-th partial that thread ``tx < rows · max_tokens`` adds for its output
    (token ``tx % max_tokens`` of the block's row ``tx // max_tokens``): the partial of warp
    ``wi`` of that row's warps."""
    wpr = gemv_layout(K)[0] // 32
    return (tx // max_tokens * wpr + wi) * max_tokens + tx % max_tokens


def output_of(blk, tx, K: int, max_tokens: int = MAX_TOKENS):
    """(token, row) that thread ``tx < rows · max_tokens`` of block ``blk`` stores."""
    return tx % max_tokens, blk * rows_per_block(K) + tx // max_tokens


def thread_chunks(in_width: int, t: int) -> list[int]:
    """The chunk indices that thread ``t`` of a row reads, in the kernel's order."""
    tpr, group, passes = gemv_layout(in_width)
    return [chunk_index(p, u, t, tpr, group) for p in range(passes) for u in range(group)]


def emulate(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The kernel's sums formed as it forms them: per row, each thread's partial over its
    :func:`thread_chunks`, then the sum over the row's threads (fp64 here)."""
    n, K = x.shape
    tpr = gemv_layout(K)[0]
    y = np.zeros((n, w.shape[0]), np.float64)
    for t in range(tpr):
        cols = [c * CHUNK + v for c in thread_chunks(K, t) for v in range(CHUNK)]
        y += x[:, cols].astype(np.float64) @ w[:, cols].astype(np.float64).T
    return y


_LD_STREAM = r"""
__forceinline__ __device__ void k3_ld_stream16(unsigned* dst, const void* src) {
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3]) : "l"(src));
}
"""


def ld_stream16(dst, src):
    """16-byte read-only global load into 4 registers (``dst``: the address of the first)
    that leaves no copy in L1 (``ld.global.nc.L1::no_allocate``): the weights stream past,
    the token rows that every block re-reads stay in L1."""
    return cuda_func_call("k3_ld_stream16", dst, src, source_code=_LD_STREAM)


def _check_fits(N: int, K: int):
    if not fits(N, K):
        raise ValueError(f"W [{N}, {K}]: the input width must be a multiple of {32 * CHUNK} and "
                         f"the rows a multiple of the rows per block (under 2^31 elements)")


def _block_macro(N: int, K: int, stream: bool, max_tokens: int = MAX_TOKENS):
    """Macro ``one(xq, w, y, n, blk, tx, store)``: block ``blk`` (0 .. N / rows - 1) of the
    GEMV of ``w [N, K]`` on the tokens ``xq`` (``x`` as uint32 words; the first
    ``min(n, max_tokens)``), thread ``tx``."""
    tpr, G, P = gemv_layout(K)
    R = THREADS // tpr
    WPR = tpr // 32           # warps per row
    XW = K // 2               # uint32 words per row
    MT = max_tokens

    @T.macro
    def one(xq, w, y, n, blk, tx, store):
        wq = T.decl_buffer((N * XW,), "uint32", data=w.data)
        red = T.alloc_buffer((THREADS // 32 * MT,), "float32", scope="shared")
        wr = T.alloc_buffer((G * 4,), "uint32", scope="local")
        xr = T.alloc_buffer((4,), "uint32", scope="local")
        acc = T.alloc_buffer((MT,), "float32", scope="local")
        nt = T.alloc_buffer((1,), "int32", scope="local")  # tokens, as int32
        nt[0] = T.Cast("int32", n)
        for i in T.unroll(MT):
            acc[i] = T.float32(0)
        for p in range(P):
            # the group's weight chunks, all in flight before the first multiply
            for u in T.unroll(G):
                if stream:
                    T.evaluate(ld_stream16(T.address_of(wr[u * 4]),
                                           T.address_of(wq[weight_word(blk, tx, p, u, K)])))
                else:
                    for v in T.vectorized(4):
                        wr[u * 4 + v] = wq[weight_word(blk, tx, p, u, K) + v]
            for u in T.unroll(G):
                for i in T.unroll(MT):
                    if i < nt[0]:
                        for v in T.vectorized(4):
                            xr[v] = xq[token_word(i, tx, p, u, K) + v]
                        for v in T.unroll(4):
                            for h in T.unroll(2):
                                acc[i] = acc[i] + bf16_half(wr[u * 4 + v], h) * bf16_half(xr[v], h)
        # the row's partial sums: across the warp, then across the row's warps
        for i in T.unroll(MT):
            for o in T.unroll(5):
                acc[i] = acc[i] + T.call_extern("float32", "__shfl_xor_sync",
                                                T.uint32(0xFFFFFFFF), acc[i], 16 >> o, 32)
            if tx % 32 == 0:
                red[partial_slot(tx, i, MT)] = acc[i]
        T.tvm_storage_sync("shared")
        if tx < R * MT:
            if tx % MT < nt[0]:
                acc[0] = T.float32(0)
                for wi in T.unroll(WPR):
                    acc[0] = acc[0] + red[final_slot(tx, wi, K, MT)]
                store(y, T.Cast("int64", output_of(blk, tx, K, MT)[0]),
                      T.Cast("int64", output_of(blk, tx, K, MT)[1]), acc[0])

    return one


def dense_gemv_macro(N: int, K: int, stream: bool = True, max_tokens: int = MAX_TOKENS):
    """The kernel as a TVMScript macro ``body(x, w, y, n, store)`` (the interface of
    :func:`schedules.dense_decode_tc.dense_tc_macro`): ``x`` bf16 ``[n, K]`` with
    ``n <= max_tokens`` (the caller's branch guarantees it; tokens past it are not computed,
    ``n = 0`` stores nothing), ``w`` bf16 ``[N, K]``, ``store(y, i, j, acc)`` the
    store of the fp32 sum ``acc`` of token ``i``, row ``j`` (int64 indices). ``stream``: the
    weights are read past L1 (:func:`ld_stream16`; False: plain cached 16-byte loads).
    ``max_tokens``: the most tokens it computes (the caller's branch bound; default
    :data:`MAX_TOKENS`). The one-projection case of :func:`multi_gemv_macro`.

    Raises:
        ValueError: a shape that does not :func:`fits`; ``max_tokens`` not in 1..8.
    """
    multi = multi_gemv_macro([N], K, stream, max_tokens)

    @T.macro
    def body(x, w, y, n, store):
        multi(x, (w,), (y,), n, (store,))

    return body


def multi_gemv_macro(Ns, K: int, stream: bool = True, max_tokens: int = MAX_TOKENS):
    """Several projections of the same tokens in one launch: a TVMScript macro
    ``body(x, ws, ys, n, stores)`` with ``ws``, ``ys``, ``stores`` sequences (one per
    ``Ns[i]``-row weight ``ws[i] [Ns[i], K]``, its output and its store macro, as
    :func:`dense_gemv_macro`, as are ``stream`` and ``max_tokens``). The grid is the concatenation of the projections' blocks
    (projection ``i`` owns blocks ``offsets[i] .. offsets[i + 1] - 1``); each block runs the
    single kernel's work for its projection. One launch instead of one per projection: each
    launch of a weight stream pays its start and its tail (~3 µs per call on the H200 beside
    its HBM time, benchmarks/results/dense_gemv_h200_2026-11-30.json).

    Raises:
        ValueError: no projection, one that does not :func:`fits`, ``max_tokens`` not in 1..8.
    """
    Ns = [int(v) for v in Ns]
    if not Ns:
        raise ValueError("multi_gemv_macro needs at least one projection")
    for N in Ns:
        _check_fits(N, K)
    if not 1 <= max_tokens <= 8:
        raise ValueError(f"max_tokens must be in 1..8, got {max_tokens}")
    R = rows_per_block(K)
    offs = [0]
    for N in Ns:
        offs.append(offs[-1] + N // R)
    ones = [_block_macro(N, K, stream, max_tokens) for N in Ns]

    def segment(i):
        """Macro for the blocks of projections i, i + 1, ...: an if-chain on the block index."""
        if i == len(Ns) - 1:
            @T.macro
            def last(xq, ws, ys, n, stores, blk, tx):
                ones[i](xq, ws[i], ys[i], n, blk - offs[i], tx, stores[i])
            return last
        rest = segment(i + 1)

        @T.macro
        def seg(xq, ws, ys, n, stores, blk, tx):
            if blk < offs[i + 1]:
                ones[i](xq, ws[i], ys[i], n, blk - offs[i], tx, stores[i])
            else:
                rest(xq, ws, ys, n, stores, blk, tx)
        return seg

    first = segment(0)

    @T.macro
    def body(x, ws, ys, n, stores):
        xq = T.decl_buffer((n * (K // 2),), "uint32", data=x.data)
        for blk in T.thread_binding(offs[-1], thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                first(xq, ws, ys, n, stores, blk, tx)

    return body


def dense_gemv_kernel(N: int, K: int, out_dtype: str = "float32", stream: bool = True,
                      max_tokens: int = MAX_TOKENS):
    """Standalone PrimFunc ``(x [n, K] bf16, w [N, K] bf16, y [n, N] out_dtype)``, ``1 <= n <=
    MAX_TOKENS``, of the kernel (``y = x @ wᵀ`` rounded to ``out_dtype``), for tests and
    benchmarks; the compile pipeline splices :func:`dense_gemv_macro` into the model's fused
    functions instead.

    Raises:
        ValueError: as :func:`dense_gemv_macro`.
    """
    from schedules.dense_decode_tc import standalone_kernel

    return standalone_kernel(dense_gemv_macro(N, K, stream, max_tokens), N, K, out_dtype)
