"""Dense bf16 projections on tensor cores: ``y[i, j] = epilogue(Σ_k x[i, k] · W[j, k])`` for
``n`` tokens ``i`` (``x [n, K]`` bf16, ``W [N, K]`` bf16 as the checkpoint stores it, fp32
accumulation), with ``mma.sync.m16n8k16``; built for decode sizes (a block takes
:data:`MAX_TOKENS` tokens, the grid's y dimension covers more).

Why: dlight has no bf16 tensor-core schedule (its ``MatmulTensorization`` is float16-only), so
above a few tokens the model's dense projections ran on CUDA cores: 0.53 ms at 8 tokens and
3.2 ms at 64 for the K3 MoE layer's 380 MB of dense weights (90 µs of HBM time; cuBLAS 0.127 ms;
benchmarks/results/moe_layer_decode_h200_2026-11-30.json). The compile pipeline
(``k3_compile.build.low_batch_specialize``) gives each dense matmul this kernel from 3 tokens
on, with the fused epilogue (casts, SiTU factors, residual adds) applied to
the fp32 sums before the store.

Mapping (as :mod:`schedules.moe_mxfp4_decode_tc`, with bf16 weights instead of MXFP4): a block
owns 16 rows of ``W`` (the mma's A, m16) and up to 64 tokens (the B columns, up to 8 n8 tiles;
``blockIdx.y`` picks the 64-token tile); its ``warps`` warps split K, each an equal run of K blocks of :data:`KB` inputs, and
meet in shared memory at the end. Thread ``(g, q) = (lane / 4, lane % 4)`` owns rows ``g``,
``g + 8`` and token ``8t + g`` of each tile ``t``; in a K block it takes inputs ``8q .. 8q + 7``
and ``32 + 8q .. 32 + 8q + 7`` (:func:`lane_input`: two 16-byte copies per row, the four lanes
of a row covering 64 contiguous bytes per copy) and for mma step ``s`` (0..3) supplies its
words ``2s`` as ``k = 2q, 2q + 1`` and ``2s + 1`` as ``k = 2q + 8, 2q + 9``: a bijection of
each step's 16 k, applied to A and B alike, so every fragment register is one 32-bit word of
a row as stored. Weights stream through ``stages``
per-thread ``cp.async`` slots (each thread reads back only what it copied: no barrier in the K
loop); the token rows are read from L1/L2 (every block reads the same ``x``), tile 0's
before the wait for the weights, each further tile's during the previous tile's mmas.

At prefill sizes the same kernel replaces dlight's CUDA-core Matmul on CUDA targets without
``wgmma`` (82 TFLOP/s on the K3 MoE layer's projections at 8192 tokens against dlight's 18;
cuBLAS is 8-9x faster: each block re-reads its weights and tokens from L2,
moe_layer_h200_2026-11-30.json). On sm_90a the projections with rows a multiple of 128 take
:mod:`schedules.dense_splitk_wgmma` from 17 tokens and :mod:`schedules.dense_prefill_wgmma` from
256 instead.

Reference: :func:`dense_reference` (NumPy); checked on the CPU through the fragment mapping
(tests/test_dense_decode_tc.py) and on the H200 (tests/gpu/check_dense_decode.py: odd sizes,
1-200 tokens; benchmarks/moe_layer.py: the K3 MoE layer against a torch reference).
"""

from __future__ import annotations

import numpy as np
from tvm.script import tirx as T

from schedules.mxfp4_ptx import commit, cp_async16, mma_bf16, wait

KB = 64           # inputs per K block (4 lanes x 16)
MAX_TOKENS = 64   # tokens per block (8 n8 tiles); blockIdx.y covers more
ROWS = 16         # weight rows per block (the mma's m16)


def dense_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x [n, K] @ w [N, K]ᵀ`` in fp32 (the kernel's sums before its epilogue)."""
    return x.astype(np.float32) @ w.astype(np.float32).T


def fits(n_rows: int, in_width: int) -> bool:
    """Whether a ``W [n_rows, in_width]`` projection fits the tiling: rows a multiple of 16,
    the input width a multiple of :data:`KB`, fewer than 2^31 elements (int32 indices)."""
    return n_rows % ROWS == 0 and in_width % KB == 0 and n_rows * in_width < 2 ** 31


def split_k_warps(in_width: int) -> int:
    """Warps per block (ways the K blocks are split): 8 where that leaves each warp at least 14
    K blocks (K3's 7168-wide inputs), else 4, 2 or 1, the most that divide the K blocks.
    Measured on the H200 (dense_decode_contig_h200_2026-11-30.json): for 7168 inputs 8 warps beat 4
    at every token count (e.g. 19.2 vs 21.7 us at one token, 50 vs 87 at 64, 3584 rows); for
    3584 / 6144 inputs 4 warps beat 8 (17.0 vs 21.7 us, 26.2 vs 33.2)."""
    nkb = in_width // KB
    if nkb % 8 == 0 and nkb // 8 >= 14:
        return 8
    return next(w for w in (4, 2, 1) if nkb % w == 0)


def lane_input(q: int, word: int, h: int) -> int:
    """Input index, within a K block, of half ``h`` of word ``word`` (0..7) of lane ``q``: the
    lane's first 4 words are inputs ``8q .. 8q + 7``, its last 4 inputs ``32 + 8q .. 32 + 8q + 7``
    (so the four lanes of a row copy 64 contiguous bytes per instruction)."""
    return word // 4 * 32 + 8 * q + 2 * (word % 4) + h


def lane_word(q, c):
    """Word offset, in a row's K block (32 words), of lane ``q``'s 16-byte chunk ``c`` (0, 1):
    its words ``4c .. 4c + 3`` in :func:`lane_input`'s order. The kernel's copies use it."""
    return 4 * q + 16 * c


def step_word(s: int, i: int) -> int:
    """Index, in a lane's 8 words of a row's K block (:func:`lane_input`), of mma register
    ``i`` (0: ``k = 2q, 2q + 1``; 1: ``k = 2q + 8, 2q + 9``) at
    step ``s``."""
    return 2 * s + i


def dense_tc_macro(N: int, K: int, stages: int | None = None, warps: int | None = None):
    """The kernel as a TVMScript macro ``body(x, w, y, n, store)``: ``x`` a bf16 buffer
    ``[n, K]`` (``n >= 1``: blocks of :data:`MAX_TOKENS` tokens), ``w`` bf16 ``[N, K]``, ``y``
    the output buffer,
    ``store(y, i, j, acc)`` a macro emitting the store of the fp32 sum ``acc`` of token ``i``,
    row ``j`` (int64 indices) into ``y``.

    Raises:
        ValueError: ``N`` not a multiple of 16, ``K`` not a multiple of 64, over 2^31
            elements, ``stages < 2``, the K blocks not splitting over ``warps``.
    """
    if not fits(N, K):
        raise ValueError(f"W [{N}, {K}]: rows must be a multiple of {ROWS} and the input width "
                         f"a multiple of {KB} (and under 2^31 elements)")
    NW = warps or split_k_warps(K)
    if stages is None:  # 4 stages of 4 warps, 3 of 8
        stages = 4 if NW <= 4 else 3
    if stages < 2:
        raise ValueError(f"stages must be at least 2, got {stages}")
    if (K // KB) % NW:
        raise ValueError(f"the {K // KB} K blocks of {KB} inputs must split evenly over {NW} warps")
    NT = 32 * NW
    NKB = K // KB
    KPW = NKB // NW
    NS = stages
    NTILE = MAX_TOKENS // 8
    XW = K // 2                # uint32 words per row
    SL = 4                     # 16-byte slots per thread and stage: (row g / g + 8, chunk)

    @T.macro
    def issue(kb, j, w_s, wq, row, tx):
        # rows g, g + 8: the lane's 32 bytes of K block kb (two 16-byte copies each; the four
        # lanes of a row cover 64 contiguous bytes per copy) into stage j % NS, slot h * 2 + c
        for h in T.unroll(2):
            for c in T.unroll(2):
                T.evaluate(cp_async16(
                    T.address_of(w_s[(((j % NS) * SL + h * 2 + c) * NT + tx) * 4]),
                    T.address_of(wq[(row + h * 8) * XW + kb * (KB // 2) + lane_word(tx % 4, c)]), 1))

    @T.macro
    def load_x(xcur, off, xq, rr, kb, tx, t):
        # token 8t + g's 16 inputs of the warp's K block kb (clamped to the last token: columns
        # past n feed only outputs that are not stored) into xcur[off : off + 8]
        for c in T.unroll(2):
            for v in T.vectorized(4):
                xcur[off + c * 4 + v] = xq[T.min(rr[4] + t * 8 + tx % 32 // 4, rr[3] - 1) * XW
                                           + (rr[1] + kb) * (KB // 2) + lane_word(tx % 4, c) + v]

    @T.macro
    def body(x, w, y, n, store):
        xq = T.decl_buffer((n * XW,), "uint32", data=x.data)
        wq = T.decl_buffer((N * XW,), "uint32", data=w.data)
        for ty in T.thread_binding((n + MAX_TOKENS - 1) // MAX_TOKENS, thread="blockIdx.y"):
            for blk in T.thread_binding(N // ROWS, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    w_s = T.alloc_buffer((NS * SL * NT * 4,), "uint32", scope="shared.dyn")
                    red_s = T.alloc_buffer((NW * NTILE * 4 * 32,), "float32", scope="shared.dyn")
                    wcur = T.alloc_buffer((SL * 4,), "uint32", scope="local")
                    xcur = T.alloc_buffer((16,), "uint32", scope="local")  # two tiles' token rows
                    acc = T.alloc_buffer((NTILE * 4,), "float32", scope="local")
                    # [0] weight row g, [1] first K block of the warp, [2] n8 tiles in use, [3] n,
                    # [4] the block's first token
                    rr = T.alloc_buffer((5,), "int32", scope="local")
                    rr[0] = blk * ROWS + tx % 32 // 4
                    rr[1] = tx // 32 * KPW
                    rr[3] = T.Cast("int32", n)
                    rr[4] = T.Cast("int32", ty) * MAX_TOKENS
                    rr[2] = T.min((rr[3] - rr[4] + 7) // 8, NTILE)
                    for i in T.unroll(NTILE * 4):
                        acc[i] = T.float32(0)
                    for r in T.unroll(NS - 1):
                        if r < KPW:
                            issue(rr[1] + r, r, w_s, wq, rr[0], tx)
                        T.evaluate(commit())
                    for kb in range(KPW):
                        if kb + NS - 1 < KPW:
                            issue(rr[1] + kb + NS - 1, kb + NS - 1, w_s, wq, rr[0], tx)
                        T.evaluate(commit())
                        load_x(xcur, 0, xq, rr, kb, tx, 0)  # tile 0's token rows while the weights land
                        T.evaluate(wait(NS - 1))  # K block kb has landed
                        for sl in T.unroll(SL):
                            for v in T.vectorized(4):
                                wcur[sl * 4 + v] = w_s[(((kb % NS) * SL + sl) * NT + tx) * 4 + v]
                        for t in T.unroll(NTILE):
                            if t < rr[2]:
                                if t + 1 < rr[2]:  # the next tile's token rows during this one's mmas
                                    load_x(xcur, (t + 1) % 2 * 8, xq, rr, kb, tx, t + 1)
                                for s in T.unroll(4):
                                    # A: row g = wcur[0..7], row g + 8 = wcur[8..15]
                                    T.evaluate(mma_bf16(
                                        T.address_of(acc[t * 4]),
                                        wcur[step_word(s, 0)], wcur[8 + step_word(s, 0)],
                                        wcur[step_word(s, 1)], wcur[8 + step_word(s, 1)],
                                        xcur[t % 2 * 8 + step_word(s, 0)],
                                        xcur[t % 2 * 8 + step_word(s, 1)]))
                    # split-K: the warps' partial sums meet in shared memory (merged with the
                    # stages: every warp must be done reading them), warp 0 adds them
                    T.tvm_storage_sync("shared")
                    for i in T.unroll(NTILE * 4):
                        red_s[(tx // 32 * NTILE * 4 + i) * 32 + tx % 32] = acc[i]
                    T.tvm_storage_sync("shared")
                    if tx < 32:
                        for wi in T.unroll(1, NW):
                            for i in T.unroll(NTILE * 4):
                                acc[i] = acc[i] + red_s[(wi * NTILE * 4 + i) * 32 + tx]
                        # c0, c1: row g, tokens 8t + 2q, + 1; c2, c3: row g + 8
                        for t in T.unroll(NTILE):
                            for c in T.unroll(4):
                                if rr[4] + t * 8 + tx % 4 * 2 + c % 2 < rr[3]:
                                    store(y, T.Cast("int64", rr[4] + t * 8 + tx % 4 * 2 + c % 2),
                                          T.Cast("int64", blk * ROWS + tx // 4 + c // 2 * 8),
                                          acc[t * 4 + c])

    return body


def dense_nt_tc_kernel(N: int, K: int, out_dtype: str = "float32", stages: int | None = None,
                       warps: int | None = None):
    """Standalone PrimFunc ``(x [n, K] bf16, w [N, K] bf16, y [n, N] out_dtype)``, ``n >= 1``, of the kernel
    (``y = x @ wᵀ``, fp32 sums rounded to ``out_dtype``), for tests and benchmarks; the compile
    pipeline splices :func:`dense_tc_macro` into the model's fused functions instead.

    Raises:
        ValueError: as :func:`dense_tc_macro`.
    """
    return standalone_kernel(dense_tc_macro(N, K, stages, warps), N, K, out_dtype)


def standalone_kernel(body, N: int, K: int, out_dtype: str):
    """PrimFunc ``(x [n, K] bf16, w [N, K] bf16, y [n, N] out_dtype)`` (``n`` symbolic) running
    the kernel macro ``body(x, w, y, n, store)`` of any of the dense kernels
    (:func:`dense_tc_macro`, ``dense_prefill_wgmma.dense_wgmma_macro``,
    ``dense_splitk_wgmma.dense_splitk_macro``) with a plain store: ``y = x @ wᵀ`` rounded to
    ``out_dtype``."""

    @T.macro
    def store(y, i, j, a):
        y[i, j] = T.Cast(out_dtype, a)

    @T.prim_func(private=True)
    def dense(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n = T.int64()
        x = T.match_buffer(x_h, (n, K), "bfloat16")
        w = T.match_buffer(w_h, (N, K), "bfloat16")
        y = T.match_buffer(y_h, (n, N), out_dtype)

        body(x, w, y, n, store)

    return dense


# --------------------------------------------------------------------------- pipeline splice
def _is_load(e) -> bool:
    """A buffer load (``tvm.ir.expr.TensorLoad`` in TVM 0.27: ``.source`` the buffer)."""
    return type(e).__name__ == "TensorLoad"


def _rebuild(e, vmap: dict, acc_buf, acc_at, acc):
    """``e`` (a TIR expression) with the vars of ``vmap`` replaced and every load of
    ``acc_buf`` at the indices ``acc_at`` replaced by ``acc``.

    Raises:
        TypeError: a node kind it does not rebuild, or a load of ``acc_buf`` elsewhere.
    """
    from tvm import tirx

    def r(x):
        return _rebuild(x, vmap, acc_buf, acc_at, acc)

    name = type(e).__name__
    if _is_load(e):
        if e.source.same_as(acc_buf):
            if len(e.indices) != len(acc_at) or not all(
                    i.same_as(a) for i, a in zip(e.indices, acc_at)):
                raise TypeError("the matmul result is read at other indices than the store's")
            return acc
        return tirx.BufferLoad(e.source, [r(i) for i in e.indices])
    if isinstance(e, tirx.Var):
        for k, v in vmap.items():
            if k.same_as(e):
                return v
        return e
    if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
        return e
    if isinstance(e, tirx.Cast):
        return tirx.Cast(str(e.ty), r(e.value))
    if isinstance(e, (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Mod, tirx.FloorDiv, tirx.FloorMod,
                      tirx.Min, tirx.Max, tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE,
                      tirx.And, tirx.Or)):
        return type(e)(r(e.a), r(e.b))
    if isinstance(e, tirx.Not):
        return tirx.Not(r(e.a))
    if isinstance(e, tirx.Select):
        return tirx.Select(r(e.condition), r(e.true_value), r(e.false_value))
    if name == "Call":
        return tirx.call_intrin(str(e.ty), e.op, *[r(a) for a in e.args])
    raise TypeError(f"epilogue node {name} not rebuilt")


def _same(a, b) -> bool:
    """Two shape extents equal (the same var, or equal constants)."""
    from tvm import tirx

    if isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm):
        return int(a) == int(b)
    return a.same_as(b)


def match_dense(func):
    """If ``func`` (a fused PrimFunc after ``FuseTIR``) is a dense projection this kernel can
    run, return ``(x, w, out, n, epilogue)``: ``x [n, K]`` and ``w [N, K]`` bf16 parameters,
    ``out [n, N]`` the output parameter, ``n`` the symbolic token count and
    ``epilogue(acc, i, j)`` the expression stored at ``out[i, j]`` for the fp32 sum ``acc`` of
    token ``i``, row ``j`` (the fused casts, activations and adds); else None. Never raises.

    Matched: one reduction block ``C[i, j] = 0; C[i, j] += f32(x[i, k]) * f32(w[j, k])`` over
    ``[n, N, K]`` (Relax ``matmul`` with ``out_dtype="float32"`` after ``FuseTransposeMatmul``),
    then either nothing (``C`` is the output) or injective blocks that inline into one store
    ``out[i, j] = f(C[i, j], other buffers ...)`` over ``[n, N]``, with ``C`` an intermediate."""
    import tvm
    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import normalize_prim_func
    from tvm.s_tir.dlight.base import try_inline_contiguous_spatial

    try:
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
    except Exception:  # noqa: BLE001 - not a block-structured function
        return None
    if infos is None:
        return None
    reds = [i for i in infos if i.is_reduction()]
    if len(reds) != 1 or infos[0] is not reds[0]:
        return None

    def param(buf):
        for p in func.params:
            if p.same_as(buf):
                return p
        return None

    red = sch.get(reds[0].block_rv)
    if len(red.iter_vars) != 3 or [int(v.iter_type) for v in red.iter_vars] != [0, 0, 2]:
        return None
    vi, vj, vk = (v.var for v in red.iter_vars)
    st = red.body
    if not isinstance(st, tirx.BufferStore) or st.buffer.dtype != "float32":
        return None
    if len(st.indices) != 2 or not (st.indices[0].same_as(vi) and st.indices[1].same_as(vj)):
        return None
    init = red.init
    if not (isinstance(init, tirx.BufferStore) and isinstance(init.value, tirx.FloatImm)
            and float(init.value.value) == 0.0):
        return None
    c_buf = st.buffer
    v = st.value
    if not (isinstance(v, tirx.Add) and _is_load(v.a) and v.a.source.same_as(c_buf)
            and isinstance(v.b, tirx.Mul)):
        return None
    ops = []
    for t in (v.b.a, v.b.b):
        if isinstance(t, tirx.Cast) and str(t.ty) == "float32":
            t = t.value
        if not _is_load(t) or t.source.dtype != "bfloat16" or len(t.indices) != 2:
            return None
        ops.append(t)
    xl, wl = ops
    if not (xl.indices[0].same_as(vi) and xl.indices[1].same_as(vk)
            and wl.indices[0].same_as(vj) and wl.indices[1].same_as(vk)):
        return None
    x, w = param(xl.source), param(wl.source)
    if x is None or w is None:
        return None
    n = x.ty.shape[0]
    wshape = list(w.ty.shape)
    if not isinstance(n, tirx.Var) or not all(isinstance(d, tirx.IntImm) for d in wshape):
        return None
    N, K = (int(d) for d in wshape)
    if not fits(N, K) or len(x.ty.shape) != 2 or not _same(x.ty.shape[1], wshape[1]):
        return None
    dom = [iv.dom.extent for iv in red.iter_vars]
    if not (_same(dom[0], n) and _same(dom[1], wshape[0]) and _same(dom[2], wshape[1])):
        return None

    def out_ok(buf):
        return (buf is not None and len(buf.ty.shape) == 2 and _same(buf.ty.shape[0], n)
                and _same(buf.ty.shape[1], wshape[0]))

    try:
        rest = try_inline_contiguous_spatial(sch, [i for i in infos if not i.is_reduction()])
    except Exception:  # noqa: BLE001 - an epilogue that does not inline
        return None
    if not rest:
        out = param(c_buf)
        if not out_ok(out):
            return None
        return x, w, out, n, lambda acc, i, j: acc
    if len(rest) != 1 or param(c_buf) is not None:
        return None
    blk = sch.get(rest[0].block_rv)
    st = blk.body
    if (len(blk.iter_vars) != 2 or not isinstance(st, tirx.BufferStore)
            or any(int(iv.iter_type) != 0 for iv in blk.iter_vars)):
        return None
    u0, u1 = (iv.var for iv in blk.iter_vars)
    if not (_same(blk.iter_vars[0].dom.extent, n) and _same(blk.iter_vars[1].dom.extent, wshape[0])):
        return None
    out = param(st.buffer)
    if not out_ok(out) or len(st.indices) != 2 or not (st.indices[0].same_as(u0)
                                                        and st.indices[1].same_as(u1)):
        return None
    value = st.value
    try:  # rebuildable at all (checked once with placeholder vars)
        _rebuild(value, {u0: tirx.Var("i", "int64"), u1: tirx.Var("j", "int64")}, c_buf,
                 (u0, u1), tirx.FloatImm("float32", 0.0))
    except (TypeError, ValueError, tvm.error.TVMError):
        return None
    return x, w, out, n, lambda acc, i, j: _rebuild(value, {u0: i, u1: j}, c_buf, (u0, u1), acc)


def splice_body(func, kernel=None, fits_kernel=None):
    """The body (a TIR ``Stmt``) of the kernel for ``func`` (see :func:`match_dense`), writing
    ``func``'s own output parameter through its epilogue, to sit in a branch of ``func`` for
    ``n >= 1`` tokens; None where ``func`` does not match.

    ``kernel(N, K)``: the macro builder (default :func:`dense_tc_macro`; e.g.
    :func:`schedules.dense_prefill_wgmma.dense_wgmma_macro`, same signature) and
    ``fits_kernel(N, K)`` its shape predicate (None where the shape does not fit)."""
    m = match_dense(func)
    if m is None:
        return None
    x, w, out, n, epi = m
    N, K = (int(d) for d in w.ty.shape)
    if fits_kernel is not None and not fits_kernel(N, K):
        return None
    body = (kernel or dense_tc_macro)(N, K)

    @T.macro
    def store(y, i, j, a):
        y[i, j] = epi(a, i, j)

    @T.prim_func(private=True, check_well_formed=False)
    def spliced():
        body(x, w, out, n, store)

    return spliced.body
