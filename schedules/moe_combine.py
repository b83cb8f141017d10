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

Reference: :func:`moe_combine_reference` (NumPy); tests/test_moe_combine.py compares the CPU
variant on odd sizes, benchmarks/moe_layer.py the GPU one inside the K3 MoE layer.
"""

from __future__ import annotations

import functools

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


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_combine_kernel(top_k: int, width: int, gpu: bool = True, threads: int = 128):
    """PrimFunc ``(o [n, top_k, width] bf16, w [n, top_k] fp32, y [n, width] bf16)``, ``n``
    symbolic: ``y`` = the combine (module doc). ``gpu``: thread-bound (``threads`` per block);
    else serial loops (for tests on the CPU).

    Raises:
        ValueError: ``width`` not a multiple of :data:`VEC`.
    """
    if width % VEC:
        raise ValueError(f"combine width {width} must be a multiple of {VEC}")
    K = top_k
    CH = width // VEC      # threads per token
    W2 = width // 2        # uint32 words per row

    @T.macro
    def one(oq, w, y, idx, n):
        acc = T.alloc_buffer((VEC,), "float32", scope="local")
        ov = T.alloc_buffer((K * VEC // 2,), "uint32", scope="local")
        if idx < n * CH:
            for v in T.unroll(VEC):
                acc[v] = T.float32(0)
            for j in T.unroll(K):  # every row's 16 bytes first: K independent loads in flight
                for v in T.vectorized(VEC // 2):
                    ov[j * (VEC // 2) + v] = oq[(idx // CH * K + j) * W2 + idx % CH * (VEC // 2) + v]
            for j in T.unroll(K):
                for v in T.unroll(VEC // 2):
                    # bf16 pair of a little-endian word: element 2v in the low half
                    acc[2 * v] = acc[2 * v] + w[idx // CH, j] * T.reinterpret(
                        "float32", ov[j * (VEC // 2) + v] << T.uint32(16))
                    acc[2 * v + 1] = acc[2 * v + 1] + w[idx // CH, j] * T.reinterpret(
                        "float32", ov[j * (VEC // 2) + v] & T.uint32(0xFFFF0000))
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
