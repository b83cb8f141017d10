"""MXFP4 MoE expert GEMVs for CUDA decode on CUDA cores (routed experts of spec §3 "MoE
block"), with a NumPy reference beside them.

The model dispatches the tensor-core GEMVs of :mod:`schedules.moe_mxfp4_decode_tc` (same
arguments, 1.1–1.7× faster); this module keeps :func:`moe_expert_chain_kernel` (used by
both), the reference, and these GEMVs as the benchmark's baseline (benchmarks/moe.py).

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
  next entry with the same expert (or -1). O((T·k)²) work (a warp per entry, 32 ids a step):
  meant for decode (T ≤ 256).
- :func:`moe_mxfp4_gate_up_kernel` — one block per (entry, tile of 16 rows). Blocks of
  entries that are not the first of their expert exit; the first one walks the chain, so
  each distinct expert is read from HBM once (later tokens of the chain re-read it from L2;
  the roofline counts distinct experts).
- :func:`moe_mxfp4_down_kernel` — the same for W2 on ``a [T, k, I]`` (2 rows per half-warp).

Mapping: a half-warp (16 lanes) owns an output row (both W1 and W3 rows in gate_up); lane
``l`` streams the 16-byte chunks ``c = s·16 + l`` (``s < K/512``): one ``uint4`` load =
32 E2M1 codes = exactly one scale group, consecutive lanes read consecutive 16 bytes. The
weights are loaded chunk by chunk inside the compute loop (not held in registers: loading a
whole row up front let nvcc hoist the dequant and use 255 registers, see the ``prefetch``
option). All index arithmetic is int32 (uint32-word offsets, E·N·K/8 < 2^31 is checked).
The activation (bf16) is staged once per token in shared memory, raw, in a chunk-interleaved
layout (uint4 ``q`` of chunk ``c`` at ``q·NC + c``: the 16 lanes' ``uint4`` reads are
consecutive, the two half-warps of a warp read the same words). Dequant works on pairs: from
a uint32 of 8 codes, shifts and two masks place nibbles ``j`` and ``j+4`` as an fp16x2 of
``v·2^-14`` (subnormals included), each half converted to fp32 (the ``2^14`` is folded in
the group's E8M0 scale, applied once per 32 products); bf16 activations become fp32 by a
shift/mask. Four independent fp32 accumulators per row per chunk; the 16 lanes' partial
sums meet by ``__shfl_xor_sync``.

Status (benchmarks/results/moe_decode_h200.json, H200): correct (≤ 1 bf16 ulp vs a torch fp32
reference at T = 1, 7, 8) and 0.129 ms at T = 1 = 51.6% of the HBM roofline (0.066 ms),
0.91 ms = 54.7% at T = 8, 7.1 ms = 35.6% at T = 64; 18-22x faster than an eager bf16 torch
loop over the selected experts. Build with ``--ptxas-options=--register-usage-level=5``
(benchmarks/moe.py ``PTXAS_REGISTER_LEVEL``): TVM 0.27's nvcc flags pass level 10, with which
ptxas gives the w2 kernel 255 registers and 1.4 KB of spills (ncu: 12.5% occupancy, 316 µs of
the 0.375 ms at T = 1; benchmarks/results/moe_decode_ncu_h200_2026-11-29.txt); at level 5
both GEMV kernels use 48 registers. ncu before the fix: gate_up 109 µs at 78% SM / 36% DRAM
throughput, i.e. instruction bound (~5-6 instructions per E2M1 code). Next: a cheaper dequant
(prmt / LOP3 in inline PTX producing half2), loads one chunk ahead to keep more bytes in
flight, and the T = 64 case (many distinct experts: more L2 traffic from the chain walk).

Reference: :func:`moe_experts_reference` (built from :mod:`schedules.moe_generic`'s
``mxfp4_dequant_reference`` / ``gather_gemv_reference`` / ``situ_reference``).
"""

from __future__ import annotations

import functools

import numpy as np
from tvm.script import tirx as T

from schedules import moe_generic as mg

LANES = 16           # lanes per output row
CHUNK_BYTES = 16     # packed bytes per lane load (= 32 codes = one scale group)


def _check(k_in: int) -> int:
    if k_in % (32 * LANES):
        raise ValueError(f"input dim {k_in} must be a multiple of {32 * LANES}")
    return k_in // (32 * LANES)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_expert_chain_kernel(top_k: int, warps: int = 4):
    """``expert_ids [T, top_k]`` int32 -> ``chain [T, top_k, 2]`` int32 (see module doc).

    One warp per entry ``i``: the warp's lanes compare 32 ids at a time with entry ``i``'s
    expert, and two ``__ballot_sync`` masks (matches before ``i``, matches after ``i``) give
    "first of its expert" and, from the lowest set bit, the next entry with it: T·k/32 steps per
    warp. (The earlier one-thread-per-entry scan of the ids in shared memory took 25 µs at T = 64
    on the H200, a serial loop of T·k steps per thread; benchmarks/results/
    moe_layer_gemv_h200_2026-11-30.json.) ``warps`` entries per block.

    Raises:
        ValueError: ``warps`` not in 1..32.
    """
    K = top_k
    if not 1 <= warps <= 32:
        raise ValueError(f"warps must be in 1..32, got {warps}")
    TX = 32 * warps

    def ballot(cond):
        return T.call_extern("uint32", "__ballot_sync", T.uint32(0xFFFFFFFF), T.Cast("int32", cond))

    @T.prim_func(private=True)
    def moe_expert_chain(ids_h: T.handle, chain_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        nt = T.int64()
        ids = T.match_buffer(ids_h, (nt, K), "int32")
        chain = T.match_buffer(chain_h, (nt, K, 2), "int32")
        idf = T.decl_buffer((nt * K,), "int32", data=ids.data)
        for bx in T.thread_binding((nt * K + warps - 1) // warps, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                # [0] first to pick its expert, [1] next entry with it, [2] the entry, [3] its
                # expert, [4] the number of entries, [5] the lane's entry of the step
                st = T.alloc_buffer((6,), "int32", scope="local")
                mk = T.alloc_buffer((2,), "uint32", scope="local")  # matches before / after
                st[0] = 1
                st[1] = -1
                st[2] = T.Cast("int32", bx) * warps + tx // 32
                st[4] = T.Cast("int32", nt * K)
                if st[2] < st[4]:  # warp-uniform
                    st[3] = idf[st[2]]
                    for c in range((st[4] + 31) // 32):
                        st[5] = c * 32 + tx % 32
                        mk[0] = ballot(T.And(st[5] < st[2], idf[T.min(st[5], st[4] - 1)] == st[3]))
                        mk[1] = ballot(T.And(T.And(st[5] > st[2], st[5] < st[4]),
                                             idf[T.min(st[5], st[4] - 1)] == st[3]))
                        if mk[0] != T.uint32(0):
                            st[0] = 0
                        if st[1] < 0 and mk[1] != T.uint32(0):
                            st[1] = c * 32 + T.call_extern("int32", "__ffs", mk[1]) - 1
                    if tx % 32 == 0:
                        chain[st[2] // K, st[2] % K, 0] = st[0]
                        chain[st[2] // K, st[2] % K, 1] = st[1]

    return moe_expert_chain


def _code_f32(w, j: int):
    """fp32 ``v·2^-14`` of nibble ``j`` (0..7) of uint32 ``w`` (sign bit 3 of the nibble)."""
    t = w << T.Cast("uint32", 28 - 4 * j)
    bits = ((t >> T.uint32(16)) & T.uint32(0x8000)) | ((t >> T.uint32(19)) & T.uint32(0x0E00))
    return T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", bits)))


def _pair_f16x2(w, j):
    """uint32 holding two fp16 ``v·2^-14``: low half = nibble ``j``, high half = nibble
    ``j + 4`` of ``w`` (``j`` in 0..3, an unrolled loop variable): shifts and two masks
    for two codes (nvcc folds the shifts once ``j`` is a constant)."""
    t = w >> T.Cast("uint32", 4 * j)
    return ((t << T.uint32(9)) & T.uint32(0x0E000E00)) | ((t << T.uint32(12)) & T.uint32(0x80008000))


def bf16_half(x, jp):
    """fp32 of bf16 half ``jp`` (0 = low, 1 = high; an unrolled loop variable) of ``x``."""
    return T.reinterpret("float32", (x << T.Cast("uint32", 16 - 16 * jp)) & T.uint32(0xFFFF0000))


def _h_lo(h):
    return T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", h)))


def _h_hi(h):
    return T.Cast("float32", T.reinterpret("float16", T.Cast("uint16", h >> T.uint32(16))))


def _scale_f32(s):
    """E8M0 byte -> 2^(s-127) · 2^14 (the fp16 code offset folded in); exact for s ≤ 240."""
    return T.reinterpret("float32", (T.Cast("uint32", s) + T.uint32(14)) << T.uint32(23))


def _gemv_kernel(kind: str, E: int, N: int, KD: int, top_k: int, R: int, RT: int, NM: int,
                 x_dtype: str, out_dtype: str, epilogue):
    """Sizes shared by the two GEMV kernels (and their checks).

    ``NM`` weight matrices of ``[E, N, KD]`` (packed ``KD/2`` bytes per row), a block of
    ``R`` half-warps, each half-warp ``RT`` rows (``R`` apart) of each of the ``NM``
    matrices; the activation is row ``x_row(entry)`` of a bf16 ``[*, KD]`` tensor.
    """
    S = _check(KD)               # chunks per lane
    NC = KD // 32                # chunks per row
    NT = R * LANES
    RB = R * RT                  # rows per block
    if N % RB:
        raise ValueError(f"{N} rows must be a multiple of the rows per block {RB}")
    NTILE = N // RB
    NU = KD // 8                 # uint4 of bf16 activations per row
    per_thread = (NU + NT - 1) // NT
    RW = KD // 8                 # uint32 words per packed row
    if E * N * RW >= 2 ** 31:
        raise ValueError("weights too large for int32 word indexing")
    NW = NM * RT                 # (matrix, row) pairs per thread
    K = top_k
    if x_dtype != "bfloat16":
        raise ValueError("activations must be bfloat16")

    return S, NC, NT, RB, NTILE, NU, per_thread, RW, NW, K


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_mxfp4_gate_up_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                             beta: float, beta_lin: float | None, x_dtype: str = "bfloat16",
                             out_dtype: str = "bfloat16", rows_per_block: int = 16,
                             prefetch: bool = False):
    """Fused w1/w3 gather GEMV + SiTU-GLU (CUDA, ``tirx.is_scheduled``).

    PrimFunc arguments::

        z            [T, L]          x_dtype   the latent (L = ``latent``), bf16
        w1_packed    [E, I, L/2]     uint8     gate
        w1_scale     [E, I, L/32]    uint8
        w3_packed    [E, I, L/2]     uint8     up
        w3_scale     [E, I, L/32]    uint8
        chain        [T, k, 2]       int32     from :func:`moe_expert_chain_kernel`
        expert_ids   [T, k]          int32
        a            [T, k, I]       out_dtype SiTU(round(w1 z), round(w3 z))

    ``rows_per_block`` rows per block (one half-warp each: 16 = 256 threads); L must be a
    multiple of 512.
    """
    E, L, I, K = num_experts, latent, inter, top_k
    R = rows_per_block
    S, NC, NT, RB, NTILE, NU, per_thread, RW, NW, _ = _gemv_kernel(
        "gu", E, I, L, K, R, 1, 2, x_dtype, out_dtype, None)
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
        w1q = T.decl_buffer((E * I * RW,), "uint32", data=w1p.data)
        w3q = T.decl_buffer((E * I * RW,), "uint32", data=w3p.data)
        w1b = T.decl_buffer((E * I * (L // 32),), "uint8", data=w1s.data)
        w3b = T.decl_buffer((E * I * (L // 32),), "uint8", data=w3s.data)
        zq = T.decl_buffer((nt * (L // 2),), "uint32", data=z.data)
        for blk in T.thread_binding(nt * K * NTILE, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                x_s = T.alloc_buffer((L // 2,), "uint32", scope="shared")
                rw = T.alloc_buffer((2 * S * 4,), "uint32", scope="local")
                sc = T.alloc_buffer((2 * S,), "float32", scope="local")
                xv = T.alloc_buffer((4,), "uint32", scope="local")
                acc = T.alloc_buffer((2 * 5,), "float32", scope="local")
                cur = T.alloc_buffer((1,), "int32", scope="local")
                rbase = T.alloc_buffer((1,), "int32", scope="local")
                ent = T.Cast("int32", blk // NTILE)
                if chain[ent // K, ent % K, 0] == 1:
                    # row index of this half-warp's row (int32: E·I·L/8 < 2^31 is checked)
                    rbase[0] = ids[ent // K, ent % K] * I + T.Cast("int32", blk % NTILE) * R + tx // LANES
                    cur[0] = ent
                    while cur[0] >= 0:
                        if prefetch:
                            for s in T.unroll(S):
                                for v in T.vectorized(4):
                                    rw[s * 4 + v] = w1q[(rbase[0] * NC + s * LANES + tx % LANES) * 4 + v]
                                for v in T.vectorized(4):
                                    rw[(S + s) * 4 + v] = w3q[(rbase[0] * NC + s * LANES + tx % LANES) * 4 + v]
                                sc[s] = _scale_f32(w1b[rbase[0] * NC + s * LANES + tx % LANES])
                                sc[S + s] = _scale_f32(w3b[rbase[0] * NC + s * LANES + tx % LANES])
                        T.tvm_storage_sync("shared")
                        for p in T.unroll(per_thread):
                            if p * NT + tx < NU:
                                for v in T.vectorized(4):
                                    x_s[(((p * NT + tx) % 4) * NC + (p * NT + tx) // 4) * 4 + v] = \
                                        zq[(cur[0] // K) * (L // 2) + (p * NT + tx) * 4 + v]
                        T.tvm_storage_sync("shared")
                        acc[4] = T.float32(0)
                        acc[9] = T.float32(0)
                        for s in T.unroll(S):
                            if not prefetch:
                                for v in T.vectorized(4):
                                    rw[s * 4 + v] = w1q[(rbase[0] * NC + s * LANES + tx % LANES) * 4 + v]
                                for v in T.vectorized(4):
                                    rw[(S + s) * 4 + v] = w3q[(rbase[0] * NC + s * LANES + tx % LANES) * 4 + v]
                                sc[s] = _scale_f32(w1b[rbase[0] * NC + s * LANES + tx % LANES])
                                sc[S + s] = _scale_f32(w3b[rbase[0] * NC + s * LANES + tx % LANES])
                            for m in T.unroll(2):
                                for c4 in T.unroll(4):
                                    acc[m * 5 + c4] = T.float32(0)
                            for q in T.unroll(4):
                                for v in T.vectorized(4):
                                    xv[v] = x_s[(q * NC + s * LANES + tx % LANES) * 4 + v]
                                for m in T.unroll(2):
                                    for j in T.unroll(4):
                                        acc[m * 5 + j % 2 * 2] = acc[m * 5 + j % 2 * 2] + _h_lo(
                                            _pair_f16x2(rw[(m * S + s) * 4 + q], j)) * bf16_half(xv[j // 2], j % 2)
                                        acc[m * 5 + j % 2 * 2 + 1] = acc[m * 5 + j % 2 * 2 + 1] + _h_hi(
                                            _pair_f16x2(rw[(m * S + s) * 4 + q], j)) * bf16_half(xv[j // 2 + 2], j % 2)
                            for m in T.unroll(2):
                                acc[m * 5 + 4] = acc[m * 5 + 4] + ((acc[m * 5] + acc[m * 5 + 1])
                                                                   + (acc[m * 5 + 2] + acc[m * 5 + 3])) * sc[m * S + s]
                        for o in T.unroll(4):
                            acc[4] = acc[4] + T.call_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), acc[4], 8 >> o, 32)
                            acc[9] = acc[9] + T.call_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), acc[9], 8 >> o, 32)
                        if tx % LANES == 0:
                            if rnd:
                                acc[4] = T.Cast("float32", T.Cast(out_dtype, acc[4]))
                                acc[9] = T.Cast("float32", T.Cast(out_dtype, acc[9]))
                            if use_bl:
                                acc[9] = T.float32(BL) * T.tanh(acc[9] * T.float32(1.0 / BL))
                            a[cur[0] // K, cur[0] % K, T.Cast("int32", blk % NTILE) * R + tx // LANES] = T.Cast(
                                out_dtype, T.float32(B) * T.tanh(acc[4] * T.float32(1.0 / B))
                                * T.sigmoid(acc[4]) * acc[9])
                        cur[0] = chain[cur[0] // K, cur[0] % K, 1]

    return moe_mxfp4_gate_up


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def moe_mxfp4_down_kernel(num_experts: int, latent: int, inter: int, top_k: int,
                          x_dtype: str = "bfloat16", out_dtype: str = "bfloat16",
                          rows_per_block: int = 16, rows_per_thread: int = 2,
                          prefetch: bool = False):
    """w2 gather GEMV over the chosen experts (CUDA, ``tirx.is_scheduled``).

    PrimFunc arguments::

        a            [T, k, I]       x_dtype (bf16)
        w2_packed    [E, L, I/2]     uint8
        w2_scale     [E, L, I/32]    uint8
        chain        [T, k, 2]       int32
        expert_ids   [T, k]          int32
        o            [T, k, L]       out_dtype   Σ_i a[t, j, i]·dequant(W2[e, n, i]) (fp32 acc)

    A block covers ``rows_per_block × rows_per_thread`` rows (a half-warp's rows are
    ``rows_per_block`` apart); I must be a multiple of 512.
    """
    E, L, I, K = num_experts, latent, inter, top_k
    R, RT = rows_per_block, rows_per_thread
    S, NC, NT, RB, NTILE, NU, per_thread, RW, NW, _ = _gemv_kernel(
        "d", E, L, I, K, R, RT, 1, x_dtype, out_dtype, None)

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
        w2q = T.decl_buffer((E * L * RW,), "uint32", data=w2p.data)
        w2b = T.decl_buffer((E * L * (I // 32),), "uint8", data=w2s.data)
        aq = T.decl_buffer((nt * (K * I // 2),), "uint32", data=a.data)
        for blk in T.thread_binding(nt * K * NTILE, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                x_s = T.alloc_buffer((I // 2,), "uint32", scope="shared")
                rw = T.alloc_buffer((RT * S * 4,), "uint32", scope="local")
                sc = T.alloc_buffer((RT * S,), "float32", scope="local")
                xv = T.alloc_buffer((4,), "uint32", scope="local")
                acc = T.alloc_buffer((RT * 5,), "float32", scope="local")
                cur = T.alloc_buffer((1,), "int32", scope="local")
                rbase = T.alloc_buffer((1,), "int32", scope="local")
                ent = T.Cast("int32", blk // NTILE)
                if chain[ent // K, ent % K, 0] == 1:
                    rbase[0] = ids[ent // K, ent % K] * L + T.Cast("int32", blk % NTILE) * RB + tx // LANES
                    cur[0] = ent
                    while cur[0] >= 0:
                        if prefetch:
                            for rr in T.unroll(RT):
                                for s in T.unroll(S):
                                    for v in T.vectorized(4):
                                        rw[(rr * S + s) * 4 + v] = w2q[((rbase[0] + rr * R) * NC + s * LANES + tx % LANES) * 4 + v]
                                    sc[rr * S + s] = _scale_f32(w2b[(rbase[0] + rr * R) * NC + s * LANES + tx % LANES])
                        T.tvm_storage_sync("shared")
                        for p in T.unroll(per_thread):
                            if p * NT + tx < NU:
                                for v in T.vectorized(4):
                                    x_s[(((p * NT + tx) % 4) * NC + (p * NT + tx) // 4) * 4 + v] = \
                                        aq[cur[0] * (I // 2) + (p * NT + tx) * 4 + v]
                        T.tvm_storage_sync("shared")
                        for rr in T.unroll(RT):
                            acc[rr * 5 + 4] = T.float32(0)
                        for s in T.unroll(S):
                            for rr in T.unroll(RT):
                                if not prefetch:
                                    for v in T.vectorized(4):
                                        rw[(rr * S + s) * 4 + v] = w2q[((rbase[0] + rr * R) * NC + s * LANES + tx % LANES) * 4 + v]
                                    sc[rr * S + s] = _scale_f32(w2b[(rbase[0] + rr * R) * NC + s * LANES + tx % LANES])
                                for c4 in T.unroll(4):
                                    acc[rr * 5 + c4] = T.float32(0)
                            for q in T.unroll(4):
                                for v in T.vectorized(4):
                                    xv[v] = x_s[(q * NC + s * LANES + tx % LANES) * 4 + v]
                                for rr in T.unroll(RT):
                                    for j in T.unroll(4):
                                        acc[rr * 5 + j % 2 * 2] = acc[rr * 5 + j % 2 * 2] + _h_lo(
                                            _pair_f16x2(rw[(rr * S + s) * 4 + q], j)) * bf16_half(xv[j // 2], j % 2)
                                        acc[rr * 5 + j % 2 * 2 + 1] = acc[rr * 5 + j % 2 * 2 + 1] + _h_hi(
                                            _pair_f16x2(rw[(rr * S + s) * 4 + q], j)) * bf16_half(xv[j // 2 + 2], j % 2)
                            for rr in T.unroll(RT):
                                acc[rr * 5 + 4] = acc[rr * 5 + 4] + ((acc[rr * 5] + acc[rr * 5 + 1])
                                                                     + (acc[rr * 5 + 2] + acc[rr * 5 + 3])) * sc[rr * S + s]
                        for rr in T.unroll(RT):
                            for sh in T.unroll(4):
                                acc[rr * 5 + 4] = acc[rr * 5 + 4] + T.call_extern(
                                    "float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF), acc[rr * 5 + 4], 8 >> sh, 32)
                        if tx % LANES == 0:
                            for rr in T.unroll(RT):
                                o[cur[0] // K, cur[0] % K, T.Cast("int32", blk % NTILE) * RB + rr * R + tx // LANES] = \
                                    T.Cast(out_dtype, acc[rr * 5 + 4])
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
