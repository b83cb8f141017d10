"""Weighted combine of the routed experts' outputs back into token order (spec §3, MoE block,
step 4): ``y[t, l] = bf16(Σ_j w[t, j] · o[t, j, l])``, products and sums in fp32 over the
``top_k`` experts of token ``t`` in slot order ``j = 0 .. top_k - 1``.

Why: the Relax form (``sum(astype(o, f32) * w[..., None], axis=1)``) is scheduled by dlight's
reduction rules with the 16-long reduction in the middle axis; on the H200 it took 3.2 ms for
8192 tokens (940 MB of bf16 outputs, 0.23 ms of HBM time) and 28.7 µs at 64 tokens
(benchmarks/results/moe_layer_dense_wgmma_h200_2026-11-30.json, the kernel
``fused_cast_cast1_cast3_expand_dims_multiply_sum``). Here one thread owns 8 consecutive
outputs of a token: it reads the token's ``top_k`` rows of 16 bytes each (independent loads)
and its ``top_k`` weights, and writes 16 bytes.

With ``norm_eps`` the kernel also applies the latent ``routed_expert_norm`` (RMSNorm) to each
token's row, and with ``round_w`` it first rounds the router weights to bf16 (the model's dtype
flow), so that the combine and the norm take one launch on the GPU.

Reference: :func:`moe_combine_reference` / :func:`moe_combine_norm_reference` (NumPy);
tests/test_moe_combine.py compares the CPU variant on odd sizes, benchmarks/moe_layer.py the GPU
one inside the K3 MoE layer.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
from tvm.script import tirx as T

VEC = 8  # outputs per thread (16 bytes of bf16)


def moe_combine_reference(o: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``o [n, k, L]`` (bf16 or fp32), ``w [n, k]`` fp32 -> ``[n, L]`` fp32 sums (before the
    rounding to bf16), accumulated in slot order."""
    o = np.asarray(o).astype(np.float32)
    w = np.asarray(w, np.float32)
    y = np.zeros((o.shape[0], o.shape[2]), np.float32)
    for j in range(o.shape[1]):
        y += w[:, j, None] * o[:, j, :]
    return y


def bf16_round(x):
    """fp32 ``x`` rounded to the nearest bf16 value (ties to even), as fp32: the integer form of
    the rounding, for the CPU variant, because TVM's llvm backend folds ``float32(bfloat16(x))``
    in TIR back to ``x``. (The CUDA backend keeps the cast, which the GPU variant uses: a cvt
    instead of this Select, 4.4-4.5 µs per call of the combine + norm kernel at one token on the
    H200 against 5.4-5.6, moe_layer_combine_norm_cast_h200_2026-12-01.json.) ±inf stay ±inf,
    finite values past the largest bf16 round to ±inf, and a NaN stays a NaN (its quiet bit set:
    the GPU's canonical NaN 0x7FFFFFFF would otherwise carry into the sign bit and come out as
    −0)."""
    b = T.reinterpret("uint32", x)
    r = (b + T.uint32(0x7FFF) + ((b >> T.uint32(16)) & T.uint32(1))) & T.uint32(0xFFFF0000)
    return T.reinterpret("float32", T.Select((b & T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000),
                                             (b | T.uint32(0x00400000)) & T.uint32(0xFFFF0000), r))


def moe_combine_norm_reference(o: np.ndarray, w: np.ndarray, norm_weight: np.ndarray, eps: float,
                               round_w: bool = True) -> np.ndarray:
    """The combine followed by ``routed_expert_norm`` in the model's bf16 dtype flow (spec §3
    MoE block steps 4-5; relax_modules/moe.py ``LatentMoE``), in NumPy: the router weights
    rounded to bf16 (``round_w``), the fp32 sums rounded to bf16, then RMSNorm in fp32
    (``r · rsqrt(mean(r²) + eps)``, cast to bf16) times ``norm_weight`` (bf16 product).
    ``o [n, k, L]``, ``w [n, k]`` fp32, ``norm_weight [L]`` -> ``[n, L]`` fp32 holding bf16
    values."""
    bf = ml_dtypes.bfloat16
    w = np.asarray(w, np.float32)
    if round_w:
        w = w.astype(bf).astype(np.float32)
    r = moe_combine_reference(o, w).astype(bf).astype(np.float32)
    ms = (r * r).sum(-1, keepdims=True, dtype=np.float32) / np.float32(r.shape[-1])
    normed = (r * (np.float32(1) / np.sqrt(ms + np.float32(eps)))).astype(bf).astype(np.float32)
    return (np.asarray(norm_weight).astype(np.float32) * normed).astype(bf).astype(np.float32)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_combine_kernel(top_k: int, width: int, gpu: bool = True, threads: int = 128,
                       round_w: bool = False, norm_eps: float | None = None):
    """PrimFunc ``(o [n, top_k, width] bf16, w [n, top_k] fp32, y [n, width] bf16)``, ``n``
    symbolic: ``y`` = the combine (module doc). ``gpu``: thread-bound (``threads`` per block);
    else serial loops (for tests on the CPU).

    ``round_w``: each weight is first rounded to bf16 (the model's ``w.astype(dtype)``, mlx-lm),
    so that the rounding needs no kernel of its own. ``norm_eps``: the latent ``routed_expert_norm``
    fused in (RMSNorm, :func:`moe_combine_norm_reference`): the PrimFunc, named ``moe_combine_norm``,
    takes ``norm_weight [width]`` bf16 before ``y``, and on the GPU one block of ``width / 8``
    threads (rounded up to a warp; ``threads`` is then unused) owns a token's row, its sum of
    squares met by warp shuffles and shared memory — one launch instead of the combine's and the
    norm's three (cast, square, mean + scale). The CPU variant takes any width.

    Raises:
        ValueError: ``width`` not a multiple of :data:`VEC`; with ``norm_eps`` on the GPU, a
        row wider than 1024 threads × 8.
    """
    if width % VEC:
        raise ValueError(f"combine width {width} must be a multiple of {VEC}")
    K = top_k
    CH = width // VEC      # threads per token
    W2 = width // 2        # uint32 words per row
    NORM = norm_eps is not None
    if NORM and gpu and CH > 1024:
        raise ValueError(f"combine + norm: width {width} needs {CH} threads per row, over 1024")
    NTN = -(-CH // 32) * 32   # threads per block with the norm (whole warps)
    EPS = float(norm_eps) if NORM else 0.0

    def rnd(x):   # to bf16 and back: the native cast on the GPU (kept there), else the integer form
        return T.Cast("float32", T.Cast("bfloat16", x)) if gpu else bf16_round(x)

    def wv(w, t, j):   # the weight of slot j of token t, as the combine uses it
        return rnd(w[t, j]) if round_w else w[t, j]

    @T.macro
    def sums(oq, w, acc, ov, t, c):
        """acc[v] = Σ_j w[t, j] · o[t, j, 8c + v] in fp32, slot order."""
        wr = T.alloc_buffer((K,), "float32", scope="local")
        for v in T.unroll(VEC):
            acc[v] = T.float32(0)
        for j in T.unroll(K):  # every row's 16 bytes first: K independent loads in flight
            for v in T.vectorized(VEC // 2):
                ov[j * (VEC // 2) + v] = oq[(t * K + j) * W2 + c * (VEC // 2) + v]
        for j in T.unroll(K):   # the weights, each read and rounded once
            wr[j] = wv(w, t, j)
        for j in T.unroll(K):
            for v in T.unroll(VEC // 2):
                # bf16 pair of a little-endian word: element 2v in the low half
                acc[2 * v] = acc[2 * v] + wr[j] * T.reinterpret(
                    "float32", ov[j * (VEC // 2) + v] << T.uint32(16))
                acc[2 * v + 1] = acc[2 * v + 1] + wr[j] * T.reinterpret(
                    "float32", ov[j * (VEC // 2) + v] & T.uint32(0xFFFF0000))

    def normed(nw, acc, l, v, ss):   # output l of the norm: acc[v] already rounded to bf16
        return T.Cast("bfloat16", T.Cast("float32", nw[l]) * rnd(
            acc[v] * T.rsqrt(ss / T.float32(width) + T.float32(EPS))))

    @T.macro
    def one(oq, w, y, idx, n):
        acc = T.alloc_buffer((VEC,), "float32", scope="local")
        ov = T.alloc_buffer((K * VEC // 2,), "uint32", scope="local")
        if idx < n * CH:
            sums(oq, w, acc, ov, idx // CH, idx % CH)
            for v in T.vectorized(VEC):
                y[idx // CH, idx % CH * VEC + v] = T.Cast("bfloat16", acc[v])

    @T.macro
    def gpu_loops(oq, w, y, n):
        for bx in T.thread_binding((n * CH + threads - 1) // threads, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                one(oq, w, y, bx * threads + tx, n)

    @T.macro
    def cpu_loops(oq, w, y, n):
        for idx in range(n * CH):
            one(oq, w, y, idx, n)

    @T.macro
    def gpu_norm(oq, w, nw, y, n):
        for t in T.thread_binding(n, thread="blockIdx.x"):
            for tx in T.thread_binding(NTN, thread="threadIdx.x"):
                red = T.alloc_buffer((NTN // 32,), "float32", scope="shared")
                acc = T.alloc_buffer((VEC,), "float32", scope="local")
                ov = T.alloc_buffer((K * VEC // 2,), "uint32", scope="local")
                ss = T.alloc_buffer((1,), "float32", scope="local")
                ss[0] = T.float32(0)
                if tx < CH:
                    sums(oq, w, acc, ov, t, tx)
                    for v in T.unroll(VEC):
                        acc[v] = rnd(acc[v])
                        ss[0] = ss[0] + acc[v] * acc[v]
                for o in T.unroll(5):   # the warp's sum in every lane, then the warps' partials
                    ss[0] = ss[0] + T.call_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF),
                                                  ss[0], 16 >> o, 32)
                if tx % 32 == 0:
                    red[tx // 32] = ss[0]
                T.tvm_storage_sync("shared")
                ss[0] = T.float32(0)
                for i in T.unroll(NTN // 32):
                    ss[0] = ss[0] + red[i]
                if tx < CH:
                    for v in T.unroll(VEC):
                        y[t, tx * VEC + v] = normed(nw, acc, tx * VEC + v, v, ss[0])

    @T.macro
    def cpu_norm(oq, w, nw, y, n):
        for t in range(n):
            acc = T.alloc_buffer((VEC,), "float32", scope="local")
            ov = T.alloc_buffer((K * VEC // 2,), "uint32", scope="local")
            ss = T.alloc_buffer((1,), "float32", scope="local")
            ss[0] = T.float32(0)
            for c in range(CH):   # the sum of squares of the bf16-rounded row, then the row again
                sums(oq, w, acc, ov, t, c)
                for v in range(VEC):
                    ss[0] = ss[0] + rnd(acc[v]) * rnd(acc[v])
            for c in range(CH):
                sums(oq, w, acc, ov, t, c)
                for v in range(VEC):
                    acc[v] = rnd(acc[v])
                    y[t, c * VEC + v] = normed(nw, acc, c * VEC + v, v, ss[0])

    if NORM:
        norm_loops = gpu_norm if gpu else cpu_norm

        @T.prim_func(private=True)
        def moe_combine_norm(o_h: T.handle, w_h: T.handle, nw_h: T.handle, y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            n = T.int64()
            o = T.match_buffer(o_h, (n, K, width), "bfloat16")
            w = T.match_buffer(w_h, (n, K), "float32")
            nw = T.match_buffer(nw_h, (width,), "bfloat16")
            y = T.match_buffer(y_h, (n, width), "bfloat16")
            oq = T.decl_buffer((n * K * W2,), "uint32", data=o.data)
            norm_loops(oq, w, nw, y, n)

        return moe_combine_norm

    loops = gpu_loops if gpu else cpu_loops

    @T.prim_func(private=True)
    def moe_combine(o_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n = T.int64()
        o = T.match_buffer(o_h, (n, K, width), "bfloat16")
        w = T.match_buffer(w_h, (n, K), "float32")
        y = T.match_buffer(y_h, (n, width), "bfloat16")
        oq = T.decl_buffer((n * K * W2,), "uint32", data=o.data)
        loops(oq, w, y, n)

    return moe_combine
