"""MXFP4 MoE expert GEMVs for CUDA decode (routed experts of spec §3 "MoE block"), with a
NumPy reference beside them.

For T tokens (decode: a handful) each with ``top_k`` chosen experts, entry ``i = t·top_k + j``:

    g = W1[e] z[t],  u = W3[e] z[t]                      (e = expert_ids[t, j]; L -> I)
    a[t, j] = SiTU(round(g), round(u))                    (spec §3 SiTU-GLU, fp32)
    o[t, j] = W2[e] a[t, j]                               (I -> L)

with MXFP4 weights in the compressed-tensors layout (``weight_packed [E, N, K/2]`` uint8, low
nibble = even column; ``weight_scale [E, N, K/32]`` uint8 E8M0), dequantized on the fly, fp32
accumulation; ``round`` is the cast to ``out_dtype`` that the model applies to the w1/w3
outputs (relax_modules/moe.py dtype flow; a no-op for fp32).

Three kernels (all CUDA-only, ``tirx.is_scheduled``):

- :func:`moe_expert_chain_kernel` — from ``expert_ids [T, k]`` builds ``chain [T, k, 2]``:
  ``chain[i, 0]`` = 1 if entry ``i`` is the first to pick its expert, ``chain[i, 1]`` = the
  next entry with the same expert (or -1). O((T·k)²) over threads: meant for decode (T ≤ 256).
- :func:`moe_mxfp4_gate_up_kernel` — one block per (entry, tile of rows). Blocks of entries
  that are not the first of their expert exit; the first one loads its rows of W1 and W3 into
  registers **once** and walks the chain, so each distinct expert's bytes cross HBM once
  (the roofline counts distinct experts).
- :func:`moe_mxfp4_down_kernel` — the same for W2 on ``a [T, k, I]``.

Mapping: a half-warp (16 lanes) owns an output row; lane ``l`` owns the 16-byte chunks
``c = s·16 + l`` (``s < K/512``): one ``uint4`` load = 32 E2M1 codes = exactly one scale
group, consecutive lanes read consecutive 16 bytes (coalesced). The activation vector is
staged in shared memory (fp32) in a chunk-interleaved layout (float ``4q + v`` of chunk ``c``
at ``(q·NC + c)·4 + v``) so that the 16 lanes' float4 reads hit distinct banks. A code is
dequantized with bit operations: sign and magnitude bits are placed into an fp16 (``m << 9``:
the fp16 value is exactly ``v·2^-14``, subnormals included, independent of the
flush-to-zero mode of fp32), converted to fp32, and the ``2^14`` is folded with the group's
E8M0 scale, applied once per 32 products. The 16 lanes' partial sums meet by ``__shfl_xor_sync``.

Status (benchmarks/results/moe_decode_h200.json, H200): correct (≤ 1 bf16 ulp vs a torch fp32
reference at T = 1, 7, 8) but only ~5% of the HBM roofline (1.36 ms at T = 1 vs 0.067 ms);
2.2-3.3x faster than an eager bf16 torch loop. ptxas: 248 registers/thread (2 blocks of
128 threads per SM), one serial accumulator chain per row and an fp16->fp32 convert per code:
latency/issue bound, not bandwidth bound. Next: int32 indexing, several accumulators,
fewer registers (more warps in flight), cheaper dequant (prmt / half2 pairs).

Reference: :func:`moe_experts_reference` (built from :mod:`schedules.moe_generic`'s
``mxfp4_dequant_reference`` / ``gather_gemv_reference`` / ``situ_reference``).
"""

from __future__ import annotations

import numpy as np
from tvm.script import tirx as T

from schedules import moe_generic as mg

LANES = 16           # lanes per output row
CHUNK_BYTES = 16     # packed bytes per lane load (= 32 codes = one scale group)


def _check(k_in: int) -> int:
    if k_in % (32 * LANES):
        raise ValueError(f"input dim {k_in} must be a multiple of {32 * LANES}")
    return k_in // (32 * LANES)


def moe_expert_chain_kernel(top_k: int, threads: int = 128):
    """``expert_ids [T, top_k]`` int32 -> ``chain [T, top_k, 2]`` int32 (see module doc)."""
    K = top_k

    @T.prim_func(private=True)
    def moe_expert_chain(ids_h: T.handle, chain_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        nt = T.int64()
        ids = T.match_buffer(ids_h, (nt, K), "int32")
        chain = T.match_buffer(chain_h, (nt, K, 2), "int32")
        for bx in T.thread_binding((nt * K + threads - 1) // threads, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                st = T.alloc_buffer((2,), "int32", scope="local")
                if bx * threads + tx < nt * K:
                    st[0] = 1
                    st[1] = -1
                    for i2 in range(nt * K):
                        if ids[i2 // K, i2 % K] == ids[(bx * threads + tx) // K, (bx * threads + tx) % K]:
                            if i2 < bx * threads + tx:
                                st[0] = 0
                            elif i2 > bx * threads + tx and st[1] < 0:
                                st[1] = T.Cast("int32", i2)
                    chain[(bx * threads + tx) // K, (bx * threads + tx) % K, 0] = st[0]
                    chain[(bx * threads + tx) // K, (bx * threads + tx) % K, 1] = st[1]

    return moe_expert_chain


def _code_f32(w, j: int):
    """fp32 ``v·2^-14`` of nibble ``j`` (0..7) of uint32 ``w`` (sign bit 3 of the nibble)."""
    t = w << T.Cast("uint32", 28 - 4 * j)
    bits = ((t >> T.uint32(16)) & T.uint32(0x8000)) | ((t >> T.uint32(19)) & T.uint32(0x0E00))
    return T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", bits)))


def _scale_f32(s):
    """E8M0 byte -> 2^(s-127) · 2^14 (the fp16 code offset folded in); exact for s ≤ 240."""
    return T.reinterpret("float32", (T.Cast("uint32", s) + T.uint32(14)) << T.uint32(23))


def moe_mxfp4_gate_up_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                             beta: float, beta_lin: float | None, x_dtype: str = "bfloat16",
                             out_dtype: str = "bfloat16", rows_per_block: int = 8):
    """Fused w1/w3 gather GEMV + SiTU-GLU (CUDA, ``tirx.is_scheduled``).

    PrimFunc arguments::

        z            [T, L]          x_dtype   the latent (L = ``latent``)
        w1_packed    [E, I, L/2]     uint8     gate
        w1_scale     [E, I, L/32]    uint8
        w3_packed    [E, I, L/2]     uint8     up
        w3_scale     [E, I, L/32]    uint8
        chain        [T, k, 2]       int32     from :func:`moe_expert_chain_kernel`
        expert_ids   [T, k]          int32
        a            [T, k, I]       out_dtype SiTU(round(w1 z), round(w3 z))

    ``rows_per_block`` rows per block (8 = 128 threads); L must be a multiple of 512.
    """
    E, L, I, K = num_experts, latent, inter, top_k
    S = _check(L)                 # chunks per lane
    NC = L // 32                  # chunks per row
    R = rows_per_block
    NT = R * LANES
    if I % R:
        raise ValueError(f"inter {I} must be a multiple of rows_per_block {R}")
    NTILE = I // R
    per_thread = (L + NT - 1) // NT
    B = float(beta)
    BL = float(beta_lin) if beta_lin is not None else 0.0
    use_bl = beta_lin is not None
    rnd = out_dtype != "float32"

    @T.prim_func(private=True)
    def moe_mxfp4_gate_up(z_h: T.handle, w1p_h: T.handle, w1s_h: T.handle, w3p_h: T.handle,
                          w3s_h: T.handle, chain_h: T.handle, ids_h: T.handle, a_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        nt = T.int64()
        z = T.match_buffer(z_h, (nt, L), x_dtype)
        w1p = T.match_buffer(w1p_h, (E, I, L // 2), "uint8")
        w1s = T.match_buffer(w1s_h, (E, I, L // 32), "uint8")
        w3p = T.match_buffer(w3p_h, (E, I, L // 2), "uint8")
        w3s = T.match_buffer(w3s_h, (E, I, L // 32), "uint8")
        chain = T.match_buffer(chain_h, (nt, K, 2), "int32")
        ids = T.match_buffer(ids_h, (nt, K), "int32")
        a = T.match_buffer(a_h, (nt, K, I), out_dtype)
        w1q = T.decl_buffer((E * I * (L // 8),), "uint32", data=w1p.data)
        w3q = T.decl_buffer((E * I * (L // 8),), "uint32", data=w3p.data)
        for blk in T.thread_binding(nt * K * NTILE, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                x_s = T.alloc_buffer((L,), "float32", scope="shared")
                r1 = T.alloc_buffer((S * 4,), "uint32", scope="local")
                r3 = T.alloc_buffer((S * 4,), "uint32", scope="local")
                sc = T.alloc_buffer((S * 2,), "float32", scope="local")
                xv = T.alloc_buffer((4,), "float32", scope="local")
                acc = T.alloc_buffer((4,), "float32", scope="local")
                cur = T.alloc_buffer((1,), "int32", scope="local")
                if chain[blk // NTILE // K, blk // NTILE % K, 0] == 1:
                    # this block's rows of W1 and W3: loaded once, reused by every token of the chain
                    for s in T.unroll(S):
                        for v in T.vectorized(4):
                            r1[s * 4 + v] = w1q[((T.Cast("int64", ids[blk // NTILE // K, blk // NTILE % K]) * I
                                                  + blk % NTILE * R + tx // LANES) * NC + s * LANES + tx % LANES) * 4 + v]
                        for v in T.vectorized(4):
                            r3[s * 4 + v] = w3q[((T.Cast("int64", ids[blk // NTILE // K, blk // NTILE % K]) * I
                                                  + blk % NTILE * R + tx // LANES) * NC + s * LANES + tx % LANES) * 4 + v]
                        sc[s * 2] = _scale_f32(w1s[ids[blk // NTILE // K, blk // NTILE % K], blk % NTILE * R + tx // LANES, s * LANES + tx % LANES])
                        sc[s * 2 + 1] = _scale_f32(w3s[ids[blk // NTILE // K, blk // NTILE % K], blk % NTILE * R + tx // LANES, s * LANES + tx % LANES])
                    cur[0] = T.Cast("int32", blk // NTILE)
                    while cur[0] >= 0:
                        T.tvm_storage_sync("shared")
                        for p in T.unroll(per_thread):
                            if p * NT + tx < L:
                                x_s[((p * NT + tx) % 32 // 4 * NC + (p * NT + tx) // 32) * 4 + (p * NT + tx) % 4] = \
                                    T.Cast("float32", z[cur[0] // K, p * NT + tx])
                        T.tvm_storage_sync("shared")
                        acc[0] = T.float32(0)
                        acc[1] = T.float32(0)
                        for s in T.unroll(S):
                            acc[2] = T.float32(0)
                            acc[3] = T.float32(0)
                            for q in T.unroll(8):
                                for v in T.vectorized(4):
                                    xv[v] = x_s[(q * NC + s * LANES + tx % LANES) * 4 + v]
                                for v in T.unroll(4):
                                    acc[2] = acc[2] + xv[v] * _code_f32(r1[s * 4 + q // 2], q % 2 * 4 + v)
                                    acc[3] = acc[3] + xv[v] * _code_f32(r3[s * 4 + q // 2], q % 2 * 4 + v)
                            acc[0] = acc[0] + acc[2] * sc[s * 2]
                            acc[1] = acc[1] + acc[3] * sc[s * 2 + 1]
                        for o in T.unroll(4):
                            acc[0] = acc[0] + T.call_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), acc[0], 8 >> o, 32)
                            acc[1] = acc[1] + T.call_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), acc[1], 8 >> o, 32)
                        if tx % LANES == 0:
                            if rnd:
                                acc[0] = T.Cast("float32", T.Cast(out_dtype, acc[0]))
                                acc[1] = T.Cast("float32", T.Cast(out_dtype, acc[1]))
                            if use_bl:
                                acc[1] = T.float32(BL) * T.tanh(acc[1] * T.float32(1.0 / BL))
                            a[cur[0] // K, cur[0] % K, blk % NTILE * R + tx // LANES] = T.Cast(
                                out_dtype, T.float32(B) * T.tanh(acc[0] * T.float32(1.0 / B))
                                * T.sigmoid(acc[0]) * acc[1])
                        cur[0] = chain[cur[0] // K, cur[0] % K, 1]

    return moe_mxfp4_gate_up


def moe_mxfp4_down_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                          x_dtype: str = "bfloat16", out_dtype: str = "bfloat16",
                          rows_per_block: int = 8, rows_per_thread: int = 2):
    """w2 gather GEMV over the chosen experts (CUDA, ``tirx.is_scheduled``).

    PrimFunc arguments::

        a            [T, k, I]       x_dtype
        w2_packed    [E, L, I/2]     uint8
        w2_scale     [E, L, I/32]    uint8
        chain        [T, k, 2]       int32
        expert_ids   [T, k]          int32
        o            [T, k, L]       out_dtype   Σ_i a[t, j, i]·dequant(W2[e, n, i]) (fp32 acc)

    A block covers ``rows_per_block × rows_per_thread`` rows (thread row groups are
    ``rows_per_block`` apart); I must be a multiple of 512.
    """
    E, L, I, K = num_experts, latent, inter, top_k
    S = _check(I)
    NC = I // 32
    R, RT = rows_per_block, rows_per_thread
    NT = R * LANES
    if L % (R * RT):
        raise ValueError(f"latent {L} must be a multiple of rows per block {R * RT}")
    NTILE = L // (R * RT)
    per_thread = (I + NT - 1) // NT

    @T.prim_func(private=True)
    def moe_mxfp4_down(a_h: T.handle, w2p_h: T.handle, w2s_h: T.handle, chain_h: T.handle,
                       ids_h: T.handle, o_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        nt = T.int64()
        a = T.match_buffer(a_h, (nt, K, I), x_dtype)
        w2p = T.match_buffer(w2p_h, (E, L, I // 2), "uint8")
        w2s = T.match_buffer(w2s_h, (E, L, I // 32), "uint8")
        chain = T.match_buffer(chain_h, (nt, K, 2), "int32")
        ids = T.match_buffer(ids_h, (nt, K), "int32")
        o = T.match_buffer(o_h, (nt, K, L), out_dtype)
        w2q = T.decl_buffer((E * L * (I // 8),), "uint32", data=w2p.data)
        for blk in T.thread_binding(nt * K * NTILE, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                x_s = T.alloc_buffer((I,), "float32", scope="shared")
                rw = T.alloc_buffer((RT * S * 4,), "uint32", scope="local")
                sc = T.alloc_buffer((RT * S,), "float32", scope="local")
                xv = T.alloc_buffer((4,), "float32", scope="local")
                acc = T.alloc_buffer((RT * 2,), "float32", scope="local")
                cur = T.alloc_buffer((1,), "int32", scope="local")
                if chain[blk // NTILE // K, blk // NTILE % K, 0] == 1:
                    for rr in T.unroll(RT):
                        for s in T.unroll(S):
                            for v in T.vectorized(4):
                                rw[(rr * S + s) * 4 + v] = w2q[((T.Cast("int64", ids[blk // NTILE // K, blk // NTILE % K]) * L
                                                              + blk % NTILE * (R * RT) + rr * R + tx // LANES) * NC
                                                             + s * LANES + tx % LANES) * 4 + v]
                            sc[rr * S + s] = _scale_f32(w2s[ids[blk // NTILE // K, blk // NTILE % K],
                                                            blk % NTILE * (R * RT) + rr * R + tx // LANES,
                                                            s * LANES + tx % LANES])
                    cur[0] = T.Cast("int32", blk // NTILE)
                    while cur[0] >= 0:
                        T.tvm_storage_sync("shared")
                        for p in T.unroll(per_thread):
                            if p * NT + tx < I:
                                x_s[((p * NT + tx) % 32 // 4 * NC + (p * NT + tx) // 32) * 4 + (p * NT + tx) % 4] = \
                                    T.Cast("float32", a[cur[0] // K, cur[0] % K, p * NT + tx])
                        T.tvm_storage_sync("shared")
                        for rr in T.unroll(RT):
                            acc[rr * 2] = T.float32(0)
                        for s in T.unroll(S):
                            for rr in T.unroll(RT):
                                acc[rr * 2 + 1] = T.float32(0)
                            for q in T.unroll(8):
                                for v in T.vectorized(4):
                                    xv[v] = x_s[(q * NC + s * LANES + tx % LANES) * 4 + v]
                                for rr in T.unroll(RT):
                                    for v in T.unroll(4):
                                        acc[rr * 2 + 1] = acc[rr * 2 + 1] + xv[v] * _code_f32(
                                            rw[(rr * S + s) * 4 + q // 2], q % 2 * 4 + v)
                            for rr in T.unroll(RT):
                                acc[rr * 2] = acc[rr * 2] + acc[rr * 2 + 1] * sc[rr * S + s]
                        for rr in T.unroll(RT):
                            for sh in T.unroll(4):
                                acc[rr * 2] = acc[rr * 2] + T.call_extern(
                                    "float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), acc[rr * 2], 8 >> sh, 32)
                        if tx % LANES == 0:
                            for rr in T.unroll(RT):
                                o[cur[0] // K, cur[0] % K, blk % NTILE * (R * RT) + rr * R + tx // LANES] = \
                                    T.Cast(out_dtype, acc[rr * 2])
                        cur[0] = chain[cur[0] // K, cur[0] % K, 1]

    return moe_mxfp4_down


# --------------------------------------------------------------------------- references
def expert_chain_reference(expert_ids: np.ndarray) -> np.ndarray:
    """NumPy version of :func:`moe_expert_chain_kernel`."""
    flat = np.asarray(expert_ids).reshape(-1)
    out = np.zeros((flat.size, 2), np.int32)
    for i, e in enumerate(flat):
        same = np.nonzero(flat == e)[0]
        out[i, 0] = int(same[0] == i)
        later = same[same > i]
        out[i, 1] = later[0] if later.size else -1
    return out.reshape(*expert_ids.shape, 2)


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x.astype(np.float32)
    import ml_dtypes

    return x.astype(getattr(ml_dtypes, dtype)).astype(np.float32)


def moe_experts_reference(z, w1p, w1s, w3p, w3s, w2p, w2s, expert_ids, beta, beta_lin,
                          out_dtype: str = "float32"):
    """Readable NumPy reference of the two kernels: returns ``(a [T,k,I], o [T,k,L])`` fp32.

    Same formula as the generic path (relax_modules/moe.py RoutedExperts with
    ``moe_generic.mxfp4_gather_gemv_kernel``): dequantize (``mxfp4_dequant_reference``),
    gather GEMV in fp64 (``gather_gemv_reference``), round gate/up to ``out_dtype``, SiTU in
    fp32 (``situ_reference``), round, down projection, round.
    """
    w1 = mg.mxfp4_dequant_reference(w1p, w1s)
    w3 = mg.mxfp4_dequant_reference(w3p, w3s)
    w2 = mg.mxfp4_dequant_reference(w2p, w2s)
    z = np.asarray(z, np.float32)
    g = _round(mg.gather_gemv_reference(z, w1, expert_ids), out_dtype)
    u = _round(mg.gather_gemv_reference(z, w3, expert_ids), out_dtype)
    a = _round(mg.situ_reference(g, u, beta, beta_lin), out_dtype)
    o = _round(mg.gather_gemv_reference(a, w2, expert_ids), out_dtype)
    return a, o
