"""Generic (every target) TIR kernels of the MoE block, each with a NumPy reference.

Spec: ``K3-ARCHITECTURE.md`` §2 (MXFP4) and §3 ("MoE block", "SiTU-GLU").

Kernels (builders return a ``tvm.tir.PrimFunc`` with a symbolic token count ``num_tokens``,
int64, so that one compiled function serves prefill and decode):

- :func:`mxfp4_dequant_kernel` — dequantize one ``[N, K]`` MXFP4 matrix (tests, debugging).
- :func:`mxfp4_gather_gemv_kernel` — for token ``t`` and choice ``j``:
  ``y[t, j, n] = Σ_i x[t(, j), i] · dequant(W[expert[t, j], n, i])``, dequantizing on the fly
  from packed E2M1 codes and E8M0 scales, fp32 accumulation.
- :func:`gather_gemv_kernel` — the same for unquantized stacked experts ``W [E, N, K]``.
- :func:`moe_route_kernel` — sigmoid router top-k with ``e_score_correction_bias``,
  renormalization and ``routed_scaling_factor``.

Written as plain TE computes / simple TIR loops: correct on CPU (llvm) as they are. With
``gpu=True`` the builders return thread-bound variants (``tirx.is_scheduled`` set), simple
and unoptimized: gather GEMV one block per (token, choice, 128 outputs), one thread per output
with the K loop inside and a register accumulator; routing one warp per token.

MXFP4 layout (compressed-tensors ``mxfp4-pack-quantized``, spec §2, k3-nano README):
``weight_packed[e, n, i // 2]`` holds column ``i``: the **low** nibble is the even column,
the **high** nibble the odd column. A nibble is an E2M1 code: bit 3 is the sign, bits 0-2
index the magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``. ``weight_scale[e, n, i // 32]`` is an
E8M0 byte ``s``: scale ``2^(s-127)`` (``s == 255`` is NaN; ``s == 0`` is the subnormal
``2^-127``). The product code·scale is exact in fp32 for every scale byte except where it
underflows below 2^-149 (never for real checkpoints).
"""

from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm import te, tirx as tir
from tvm.script import tirx as T

MXFP4_GROUP = 32
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


# --------------------------------------------------------------------------- dequant exprs
def e2m1_to_f32(code: tir.PrimExpr) -> tir.PrimExpr:
    """fp32 value of a 4-bit E2M1 code (any integer dtype holding 0..15).

    ``m = code & 7`` (exponent bits ``m >> 1``, mantissa bit ``m & 1``): exponent 0 gives
    ``0.5·mant``, else ``(2 + mant) · 2^(exp-2)``; bit 3 negates (code 8 is -0.0, as in
    compressed-tensors' ``unpack_fp4_from_uint8``).
    """
    c = code.astype("int32")
    m = c & 7
    ex = m >> 1
    mant = m & 1
    mag = tir.Select(
        ex == 0,
        mant.astype("float32") * tir.const(0.5, "float32"),
        ((mant + 2) << ex).astype("float32") * tir.const(0.25, "float32"),
    )
    return tir.Select((c & 8) != 0, -mag, mag)


def e8m0_to_f32(s: tir.PrimExpr) -> tir.PrimExpr:
    """fp32 value ``2^(s-127)`` of an E8M0 scale byte, built from its bits (exact).

    ``s == 0`` gives the subnormal 2^-127 (bits 0x00400000); ``s == 255`` gives NaN.
    """
    su = s.astype("uint32")
    normal = tir.reinterpret("float32", su << tir.const(23, "uint32"))
    sub = tir.reinterpret("float32", tir.const(0x00400000, "uint32"))
    nan = tir.reinterpret("float32", tir.const(0x7FC00000, "uint32"))
    return tir.Select(su == 0, sub, tir.Select(su == 255, nan, normal))


def mxfp4_value(packed_byte: tir.PrimExpr, scale_byte: tir.PrimExpr, col: tir.PrimExpr) -> tir.PrimExpr:
    """Dequantized fp32 weight of column ``col`` from its packed byte and its scale byte."""
    shift = ((col % 2) * 4).astype("uint8")
    code = (packed_byte >> shift) & tir.const(15, "uint8")
    return e2m1_to_f32(code) * e8m0_to_f32(scale_byte)


# --------------------------------------------------------------------------- kernels
def mxfp4_dequant_kernel(n_out: int, k_in: int, num_experts: int = 1) -> tir.PrimFunc:
    """``w[e, n, i] = dequant(packed[e, n, i//2], scale[e, n, i//32])`` (fp32).

    Args: ``packed [E, N, K/2]`` uint8, ``scale [E, N, K/32]`` uint8 -> ``w [E, N, K]`` fp32.
    Reference: :func:`mxfp4_dequant_reference`.
    """
    assert k_in % MXFP4_GROUP == 0
    packed = te.placeholder((num_experts, n_out, k_in // 2), "uint8", name="packed")
    scale = te.placeholder((num_experts, n_out, k_in // MXFP4_GROUP), "uint8", name="scale")
    w = te.compute(
        (num_experts, n_out, k_in),
        lambda e, n, i: mxfp4_value(packed[e, n, i // 2], scale[e, n, i // MXFP4_GROUP], i),
        name="dequant",
    )
    return te.create_prim_func([packed, scale, w]).with_attr("global_symbol", "mxfp4_dequant")


def _gather_gemv(n_out, k_in, num_experts, top_k, x_per_choice, x_dtype, out_dtype, weights, weight_of,
                 gpu=False):
    num_tokens = tir.Var("num_tokens", "int64")
    x_shape = (num_tokens, top_k, k_in) if x_per_choice else (num_tokens, k_in)
    x = te.placeholder(x_shape, x_dtype, name="x")
    ids = te.placeholder((num_tokens, top_k), "int32", name="expert_ids")
    i = te.reduce_axis((0, k_in), name="i")

    def body(t, j, n):
        e = ids[t, j].astype("int64")
        xv = x[t, j, i] if x_per_choice else x[t, i]
        return te.sum(xv.astype("float32") * weight_of(e, n, i), axis=i)

    acc = te.compute((num_tokens, top_k, n_out), body, name="gemv")
    if out_dtype == "float32":
        y = acc
    else:
        y = te.compute((num_tokens, top_k, n_out), lambda t, j, n: acc[t, j, n].astype(out_dtype), name="cast")
    func = te.create_prim_func([x, *weights, ids, y])
    if gpu:
        func = _schedule_gather_gemv_gpu(func, n_out, cast=out_dtype != "float32")
    return func


_GEMV_THREADS = 128


def _schedule_gather_gemv_gpu(func: tir.PrimFunc, n_out: int, cast: bool) -> tir.PrimFunc:
    """Thread bindings for the gather GEMV: blockIdx.x over (token, choice, N / 128),
    threadIdx.x over 128 outputs; the K reduction runs inside the thread into a local
    accumulator (then cast / stored)."""
    sch = tvm.s_tir.Schedule(func)
    gemv = sch.get_sblock("gemv")
    consumer = sch.get_sblock("cast") if cast else sch.cache_write(gemv, 0, "local")
    t, j, n = sch.get_loops(consumer)
    tx = min(_GEMV_THREADS, n_out)
    n_o, n_i = sch.split(n, [None, tx])
    sch.bind(sch.fuse(t, j, n_o), "blockIdx.x")
    sch.bind(n_i, "threadIdx.x")
    sch.compute_at(gemv, n_i)
    if cast:
        sch.set_scope(gemv, 0, "local")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def mxfp4_gather_gemv_kernel(
    n_out: int,
    k_in: int,
    num_experts: int,
    top_k: int,
    x_per_choice: bool,
    x_dtype: str = "float32",
    out_dtype: str = "float32",
    gpu: bool = False,
) -> tir.PrimFunc:
    """MXFP4 gather GEMV over the chosen experts of every token.

    Args (in order):
        x: ``[T, K]`` (``x_per_choice=False``: the latent z feeds w1/w3) or ``[T, top_k, K]``
            (``x_per_choice=True``: the activation feeds w2), ``x_dtype``.
        packed: ``[E, N, K/2]`` uint8; scale: ``[E, N, K/32]`` uint8 (E8M0).
        expert_ids: ``[T, top_k]`` int32.
    Returns ``y [T, top_k, N]`` in ``out_dtype``: fp32 accumulation of ``x·dequant(W)``,
    one rounding to ``out_dtype`` at the end. Reference: :func:`gather_gemv_reference`.
    """
    assert k_in % MXFP4_GROUP == 0
    packed = te.placeholder((num_experts, n_out, k_in // 2), "uint8", name="packed")
    scale = te.placeholder((num_experts, n_out, k_in // MXFP4_GROUP), "uint8", name="scale")
    return _gather_gemv(
        n_out, k_in, num_experts, top_k, x_per_choice, x_dtype, out_dtype, [packed, scale],
        lambda e, n, i: mxfp4_value(packed[e, n, i // 2], scale[e, n, i // MXFP4_GROUP], i),
        gpu=gpu,
    )


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def gather_gemv_kernel(
    n_out: int,
    k_in: int,
    num_experts: int,
    top_k: int,
    x_per_choice: bool,
    w_dtype: str = "float32",
    x_dtype: str = "float32",
    out_dtype: str = "float32",
    gpu: bool = False,
) -> tir.PrimFunc:
    """Gather GEMV for unquantized stacked experts ``weight [E, N, K]`` (``w_dtype``).

    Same arguments as :func:`mxfp4_gather_gemv_kernel` with ``weight`` instead of
    ``packed, scale``; fp32 accumulation.
    """
    w = te.placeholder((num_experts, n_out, k_in), w_dtype, name="weight")
    return _gather_gemv(
        n_out, k_in, num_experts, top_k, x_per_choice, x_dtype, out_dtype, [w],
        lambda e, n, i: w[e, n, i].astype("float32"),
        gpu=gpu,
    )


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_route_kernel(
    num_experts: int, top_k: int, routed_scaling_factor: float = 1.0, renormalize: bool = True,
    gpu: bool = False,
) -> tir.PrimFunc:
    """Sigmoid router (spec §3 MoE step 1; mlx-lm ``_group_expert_select`` with one group).

    Args: ``logits [T, E]`` fp32 (``x @ gate.weight.T`` in fp32), ``bias [E]`` fp32
    (``e_score_correction_bias``). Returns ``expert_ids [T, top_k]`` int32 and
    ``weights [T, top_k]`` fp32:

    - ``s = sigmoid(logits)``; choose the ``top_k`` largest ``s + bias``, in descending
      order; **ties: the lowest expert index wins** (strict ``>`` scan; mlx-lm's
      ``argpartition`` leaves tie order unspecified).
    - ``w = s[chosen]``; if ``renormalize`` and ``top_k > 1``: ``w /= Σw + 1e-20``;
      ``w *= routed_scaling_factor``.

    One sequential loop per token (O(top_k · E)): trivially parallel over tokens.
    ``gpu=True``: one warp per token (:func:`_moe_route_gpu`), the same choices and weights.
    Where fewer than ``top_k`` scores are finite (NaN logits) both kernels fill the remaining
    slots with expert 0 (the NumPy reference's stable sort takes the NaN experts instead).

    Raises:
        ValueError: ``gpu=True`` with ``top_k`` over 32 or more than 8192 experts.
    """
    E, K = num_experts, top_k
    rsf = float(routed_scaling_factor)
    do_norm = bool(renormalize and top_k > 1)
    neg_inf = float("-inf")
    if gpu:
        return _moe_route_gpu(E, K, rsf, do_norm)

    @T.prim_func(s_tir=True)
    def moe_route(logits_h: T.handle, bias: T.Buffer((E,), "float32"), ids_h: T.handle, w_h: T.handle):
        T.func_attr({"tir.noalias": True})
        num_tokens = T.int64()
        logits = T.match_buffer(logits_h, (num_tokens, E), "float32")
        ids = T.match_buffer(ids_h, (num_tokens, K), "int32")
        w = T.match_buffer(w_h, (num_tokens, K), "float32")
        sel = T.sblock_alloc_buffer((num_tokens, E), "float32")
        best_v = T.sblock_alloc_buffer((num_tokens,), "float32")
        best_i = T.sblock_alloc_buffer((num_tokens,), "int32")
        total = T.sblock_alloc_buffer((num_tokens,), "float32")
        for t in T.serial(num_tokens):
            with T.sblock("route"):
                vt = T.axis.spatial(num_tokens, t)
                T.reads(logits[vt, 0:E], bias[0:E], sel[vt, 0:E], best_v[vt], best_i[vt], total[vt])
                T.writes(ids[vt, 0:K], w[vt, 0:K], sel[vt, 0:E], best_v[vt], best_i[vt], total[vt])
                for e in T.serial(E):
                    sel[vt, e] = T.sigmoid(logits[vt, e]) + bias[e]
                total[vt] = T.float32(0)
                for j in T.serial(K):
                    best_v[vt] = T.float32(neg_inf)
                    best_i[vt] = 0
                    for e in T.serial(E):
                        if sel[vt, e] > best_v[vt]:
                            best_v[vt] = sel[vt, e]
                            best_i[vt] = T.Cast("int32", e)
                    ids[vt, j] = best_i[vt]
                    w[vt, j] = T.sigmoid(logits[vt, best_i[vt]])
                    total[vt] = total[vt] + w[vt, j]
                    sel[vt, best_i[vt]] = T.float32(neg_inf)
                for j in T.serial(K):
                    if do_norm:
                        w[vt, j] = w[vt, j] / (total[vt] + T.float32(1e-20)) * T.float32(rsf)
                    else:
                        w[vt, j] = w[vt, j] * T.float32(rsf)

    return moe_route


def _order_key(f):
    """uint32 whose unsigned order is the order of the non-NaN fp32 ``f`` (sign bit set for
    positives, all bits flipped for negatives; -0.0 keyed as +0.0, which compare equal; -inf
    lowest)."""
    b = T.reinterpret("uint32", f)
    return T.if_then_else(b == T.uint32(0x80000000), T.uint32(0x80000000),
                          T.if_then_else(b >> T.uint32(31) == T.uint32(1), ~b, b | T.uint32(0x80000000)))


def _moe_route_gpu(E: int, K: int, rsf: float, do_norm: bool) -> tir.PrimFunc:
    """GPU router: one warp per token. Lane ``l`` keeps the scores of experts ``l + 32j`` in
    registers (a NaN score as -inf: never chosen). Each of the ``top_k`` rounds:

    - the lane's best by a pairwise tree over its scores (the right one of a pair, i.e. the
      higher expert index, only if strictly larger: the lower index wins ties), none (index
      ``E``) if all are -inf;
    - the warp's winner by two ``__reduce_*_sync`` (sm_80+): the largest score as an
      order-preserving uint32 key, then the smallest index among the lanes holding it —
      larger score, then lower index wins, as :func:`moe_route_reference`;
    - the owner lane retires the winner, lane ``r`` keeps round ``r``'s winner (no finite score
      left: expert 0, as the CPU kernel's scan, never an id ``E``).

    After the rounds lane ``r`` reads its winner's logit (the ``top_k`` reads at once) and the
    weights' sum is taken in round order (``__shfl_sync`` from lanes 0, 1, ...), as the CPU
    kernel adds them. Before (a sequential scan and five shuffle steps on (score, index) per
    round, and one dependent logit read per round) one call took 7.0 µs at one token on the
    H200 (benchmarks/results/moe_layer_gemv_h200_2026-11-30.json).

    Raises:
        ValueError: ``top_k`` over 32 (one winner per lane), more than 8192 experts.
    """
    if K > 32:
        raise ValueError(f"the GPU router keeps one winner per lane: top_k must be at most 32, got {K}")
    if E > 32 * 256:
        raise ValueError(f"the GPU router handles up to 8192 experts, got {E}")
    TX = 128
    W = TX // 32                  # tokens per block
    EPL = (E + 31) // 32          # experts per lane
    LEVELS = []                   # the tree's sizes: EPL, ceil(EPL / 2), ..., 2 (8 levels)
    m = EPL
    while m > 1:
        LEVELS.append(m)
        m = (m + 1) // 2
    LEVELS += [1] * (8 - len(LEVELS))
    neg_inf = float("-inf")
    full = T.uint32(0xFFFFFFFF)

    @T.macro
    def level(tv, ti, m):
        # pairs (2i, 2i + 1) -> i; an odd last one carried
        for i in T.unroll(m // 2):
            if tv[2 * i + 1] > tv[2 * i]:
                tv[i] = tv[2 * i + 1]
                ti[i] = ti[2 * i + 1]
            else:
                tv[i] = tv[2 * i]
                ti[i] = ti[2 * i]
        if m % 2 == 1 and m > 1:
            tv[m // 2] = tv[m - 1]
            ti[m // 2] = ti[m - 1]

    @T.prim_func
    def moe_route_gpu(logits_h: T.handle, bias: T.Buffer((E,), "float32"), ids_h: T.handle,
                      w_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        num_tokens = T.int64()
        logits = T.match_buffer(logits_h, (num_tokens, E), "float32")
        ids = T.match_buffer(ids_h, (num_tokens, K), "int32")
        w = T.match_buffer(w_h, (num_tokens, K), "float32")
        for bx in T.thread_binding((num_tokens + W - 1) // W, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                sel = T.alloc_buffer((EPL,), "float32", scope="local")
                tv = T.alloc_buffer((EPL,), "float32", scope="local")   # the tree's scores
                ti = T.alloc_buffer((EPL,), "int32", scope="local")     # and indices
                bk = T.alloc_buffer((2,), "uint32", scope="local")      # lane key, warp best key
                bi = T.alloc_buffer((3,), "int32", scope="local")     # lane best, winner, own winner
                bv = T.alloc_buffer((1,), "float32", scope="local")   # own winner's weight
                total = T.alloc_buffer((1,), "float32", scope="local")
                if bx * W + tx // 32 < num_tokens:
                    for j in T.unroll(EPL):
                        sel[j] = T.if_then_else(
                            tx % 32 + 32 * j < E,
                            T.sigmoid(logits[bx * W + tx // 32, T.min(tx % 32 + 32 * j, E - 1)])
                            + bias[T.min(tx % 32 + 32 * j, E - 1)],
                            T.float32(neg_inf))
                        if T.isnan(sel[j]):
                            sel[j] = T.float32(neg_inf)
                    bi[2] = 0
                    for r in range(K):
                        for j in T.unroll(EPL):
                            tv[j] = sel[j]
                            ti[j] = tx % 32 + 32 * j
                        level(tv, ti, LEVELS[0])
                        level(tv, ti, LEVELS[1])
                        level(tv, ti, LEVELS[2])
                        level(tv, ti, LEVELS[3])
                        level(tv, ti, LEVELS[4])
                        level(tv, ti, LEVELS[5])
                        level(tv, ti, LEVELS[6])
                        level(tv, ti, LEVELS[7])
                        bk[0] = _order_key(tv[0])
                        bi[0] = T.if_then_else(tv[0] == T.float32(neg_inf), E, ti[0])
                        bk[1] = T.call_extern("uint32", "__reduce_max_sync", full, bk[0])
                        bi[1] = T.Cast("int32", T.call_extern(
                            "uint32", "__reduce_min_sync", full,
                            T.if_then_else(bk[0] == bk[1], T.Cast("uint32", bi[0]), T.uint32(0xFFFFFFFF))))
                        for j in T.unroll(EPL):
                            if tx % 32 + 32 * j == bi[1]:
                                sel[j] = T.float32(neg_inf)
                        if tx % 32 == r:
                            bi[2] = T.if_then_else(bi[1] >= E, 0, bi[1])
                    # the K winners' weights at once, their sum in round order
                    bv[0] = T.sigmoid(logits[bx * W + tx // 32, bi[2]])
                    total[0] = T.float32(0)
                    for r in range(K):
                        total[0] = total[0] + T.call_extern("float32", "__shfl_sync", full, bv[0], r, 32)
                    if tx % 32 < K:
                        ids[bx * W + tx // 32, tx % 32] = bi[2]
                        if do_norm:
                            w[bx * W + tx // 32, tx % 32] = bv[0] / (total[0] + T.float32(1e-20)) * T.float32(rsf)
                        else:
                            w[bx * W + tx // 32, tx % 32] = bv[0] * T.float32(rsf)

    return moe_route_gpu


# --------------------------------------------------------------------------- references
def e2m1_reference(codes: np.ndarray) -> np.ndarray:
    """fp32 values of E2M1 codes (uint8 0..15); bit 3 the sign."""
    codes = codes.astype(np.uint8)
    mag = E2M1_VALUES[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(np.float32)


def e8m0_reference(s: np.ndarray) -> np.ndarray:
    """``2^(s-127)`` as fp32 (255 -> NaN)."""
    v = np.ldexp(np.float32(1.0), s.astype(np.int32) - 127).astype(np.float32)
    return np.where(s == 255, np.float32(np.nan), v).astype(np.float32)


def mxfp4_dequant_reference(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``[..., N, K/2]`` uint8 + ``[..., N, K/32]`` uint8 -> ``[..., N, K]`` fp32.

    Low nibble = even column, high nibble = odd column (compressed-tensors order).
    """
    lo = packed & 0x0F
    hi = packed >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    vals = e2m1_reference(codes)
    sc = np.repeat(e8m0_reference(scale), MXFP4_GROUP, axis=-1)
    with np.errstate(over="ignore"):  # 6 · 2^127 overflows to inf, as in compressed-tensors
        return (vals * sc).astype(np.float32)


def gather_gemv_reference(x: np.ndarray, weight: np.ndarray, expert_ids: np.ndarray) -> np.ndarray:
    """``y[t, j, n] = Σ_i x[t(, j), i] · weight[expert_ids[t, j], n, i]`` in fp64 -> fp32.

    ``x`` is ``[T, K]`` or ``[T, top_k, K]``; ``weight`` is dense ``[E, N, K]`` (dequantize
    MXFP4 first with :func:`mxfp4_dequant_reference`).
    """
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)[expert_ids]  # [T, k, N, K]
    if x.ndim == 2:
        return np.einsum("ti,tjni->tjn", x, w).astype(np.float32)
    return np.einsum("tji,tjni->tjn", x, w).astype(np.float32)


def moe_route_reference(
    logits: np.ndarray, bias: np.ndarray, top_k: int, routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """NumPy version of :func:`moe_route_kernel` (same tie rule: lowest index first).

    Returns ``(expert_ids [T, top_k] int32, weights [T, top_k] fp32)``, ids ordered by
    descending biased score.
    """
    logits = np.asarray(logits, np.float32)
    s = (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)
    biased = s + bias.astype(np.float32)[None]
    ids = np.argsort(-biased, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    w = np.take_along_axis(s, ids, axis=-1)
    if renormalize and top_k > 1:
        w = w / (w.sum(-1, keepdims=True) + np.float32(1e-20))
    return ids, (w * np.float32(routed_scaling_factor)).astype(np.float32)


def situ_reference(gate: np.ndarray, up: np.ndarray, beta: float, linear_beta: float | None) -> np.ndarray:
    """SiTU-GLU activation in fp32: ``β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)`` (spec §3)."""
    g = np.asarray(gate, np.float32)
    u = np.asarray(up, np.float32)
    a = beta * np.tanh(g / beta) * (1.0 / (1.0 + np.exp(-g)))
    if linear_beta is not None:
        u = linear_beta * np.tanh(u / linear_beta)
    return (a * u).astype(np.float32)
