"""Generic (every-target, CPU-first) TIR kernels of the KDA layer, each beside its reference.

Spec: ``K3-ARCHITECTURE.md`` §3 "KDA layer". All kernels work on the flat ragged batch of
``docs/DESIGN.md`` (``cu_seqlens`` / ``token_seq`` / ``seq_slots``, all int32) and update the
pooled state tensors **in place** (call them with ``nn.op.tensor_ir_inplace_op``):

- ``kda_state``  ``[n_kda_layers, max_slots, H, K, V]`` float32
- ``conv_state`` ``[n_kda_layers, max_slots, 3, W-1, H*K]`` float32 (q, k, v windows, oldest first)

The layer index is a scalar ``int32`` argument (one PrimFunc serves every layer).

Kernels (builder → PrimFunc; reference beside it, numpy/torch, readable not fast):

================================  ==========================================================
``short_conv_kernel``             causal depthwise conv (width W) + SiLU, in-place conv window
``kda_chunk_prefill_kernel``      chunked (WY / UT transform, chunk 64) KDA over a ragged batch
``kda_decode_kernel``             recurrent KDA step, one token per sequence
``slot_reset_kernel``             zero one slot of a pool (all layers)
``slot_copy_kernel``              copy slot ``src`` to slot ``dst`` of a pool (fork)
================================  ==========================================================

With ``gpu=False`` (default) these are plain loop nests (no thread bindings,
``tirx.is_scheduled`` unset) that compile for ``llvm`` as is. With ``gpu=True`` each builder
returns a thread-bound variant (``tirx.is_scheduled`` set, so dlight leaves it alone): a
straightforward, unoptimized GPU version (correctness first):

- short conv: one block per token, threads over channels; the window update one block per
  sequence (a second kernel launch, so it runs after every output has read the old window);
- prefill and decode: one block per (sequence, head), one thread per column ``e`` of the
  state ``S[:, e]`` (the delta-rule recurrence is independent per column), the column kept in
  a thread-local array, tokens in order (the recurrent form, also for prefill);
- slot reset / copy: a grid over (layer, row).
"""

from __future__ import annotations

import functools

import numpy as np
from tvm.script import tirx as T

from schedules.cache_ops import pool_copy_kernel, pool_reset_kernel

# ----------------------------------------------------------------------------------------
# 1. Causal depthwise short conv + SiLU (spec §3 KDA step 1)
# ----------------------------------------------------------------------------------------


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def short_conv_kernel(D: int, W: int, in_dtype: str, gpu: bool = False):
    """Causal depthwise conv1d of width ``W`` (no bias) then SiLU, over a flat ragged batch.

    PrimFunc arguments (in order)::

        x           [T, D]                    in_dtype   projection output (q, k or v)
        weight      [D, 1, W]                 float32    ``*_conv1d.weight``
        cu_seqlens  [B+1]                     int32
        token_seq   [T]                       int32
        seq_slots   [B]                       int32
        conv_state  [L, S, 3, W-1, D]         float32    in place (argument index 5)
        layer       int32                                index into dim 0 of conv_state
        which       int32                                0 = q, 1 = k, 2 = v window
        y           [T, D]                    float32    output (freshly allocated)

    For token ``p`` (0-based within its sequence in this forward) the conv input window is
    ``[x_{p-W+1} … x_p]``, where inputs before the sequence's first token in this forward come
    from ``conv_state[layer, slot, which]`` (the previous W-1 inputs, oldest first).
    Afterwards the window holds the last W-1 inputs of ``concat(old window, x_seq)`` — for
    sequences shorter than W-1 it shifts and keeps the newest old entries.
    """
    Wm1 = W - 1
    if gpu:
        return _short_conv_gpu(D, W, in_dtype)

    @T.prim_func(private=True)
    def short_conv(
        x_h: T.handle,
        w_h: T.handle,
        cu_h: T.handle,
        tseq_h: T.handle,
        slots_h: T.handle,
        state_h: T.handle,
        layer: T.int32,
        which: T.int32,
        y_h: T.handle,
    ):
        T.func_attr({"tir.noalias": True})
        n_tok, n_cu, n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n_tok, D), in_dtype)
        weight = T.match_buffer(w_h, (D, 1, W), "float32")
        cu = T.match_buffer(cu_h, (n_cu,), "int32")
        tseq = T.match_buffer(tseq_h, (n_tok,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        state = T.match_buffer(state_h, (n_layer, n_slot, 3, Wm1, D), "float32")
        y = T.match_buffer(y_h, (n_tok, D), "float32")
        # Phase 1: outputs (reads the old windows).
        for t in T.parallel(n_tok):
            for d in range(D):
                acc = T.alloc_buffer((1,), "float32", scope="local")
                acc[0] = T.float32(0)
                for w in range(W):
                    # j: input offset relative to the sequence start (negative: from the state)
                    j = T.Cast("int32", t) - cu[tseq[t]] - Wm1 + w
                    if j >= 0:
                        acc[0] = acc[0] + weight[d, 0, w] * T.Cast(
                            "float32", x[cu[tseq[t]] + j, d])
                    else:
                        acc[0] = acc[0] + weight[d, 0, w] * state[
                            layer, slots[tseq[t]], which, Wm1 + j, d]
                y[t, d] = acc[0] / (T.float32(1) + T.exp(-acc[0]))
        # Phase 2: new windows = last W-1 entries of concat(old window, x_seq).
        for b in T.parallel(n_cu - 1):
            for d in range(D):
                win = T.alloc_buffer((Wm1,), "float32", scope="local")
                for i in range(Wm1):
                    c = cu[b + 1] - cu[b] + i  # index into concat(old window, x_seq)
                    if c < Wm1:
                        win[i] = state[layer, slots[b], which, c, d]
                    else:
                        win[i] = T.Cast("float32", x[cu[b] + c - Wm1, d])
                for i in range(Wm1):
                    state[layer, slots[b], which, i, d] = win[i]

    return short_conv


_GPU_THREADS = 256


def _short_conv_gpu(D: int, W: int, in_dtype: str):
    """GPU variant of :func:`short_conv_kernel` (same arguments and semantics)."""
    Wm1 = W - 1
    TX = min(_GPU_THREADS, D)
    ND = (D + TX - 1) // TX

    @T.prim_func(private=True)
    def short_conv_gpu(
        x_h: T.handle,
        w_h: T.handle,
        cu_h: T.handle,
        tseq_h: T.handle,
        slots_h: T.handle,
        state_h: T.handle,
        layer: T.int32,
        which: T.int32,
        y_h: T.handle,
    ):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_cu, n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (n_tok, D), in_dtype)
        weight = T.match_buffer(w_h, (D, 1, W), "float32")
        cu = T.match_buffer(cu_h, (n_cu,), "int32")
        tseq = T.match_buffer(tseq_h, (n_tok,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        state = T.match_buffer(state_h, (n_layer, n_slot, 3, Wm1, D), "float32")
        y = T.match_buffer(y_h, (n_tok, D), "float32")
        # Kernel 1: outputs (reads the old windows).
        for t in T.thread_binding(n_tok, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                for d1 in range(ND):
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    d = d1 * TX + tx
                    if d < D:
                        acc[0] = T.float32(0)
                        for w in range(W):
                            j = T.Cast("int32", t) - cu[tseq[t]] - Wm1 + w
                            if j >= 0:
                                acc[0] = acc[0] + weight[d, 0, w] * T.Cast(
                                    "float32", x[cu[tseq[t]] + j, d])
                            else:
                                acc[0] = acc[0] + weight[d, 0, w] * state[
                                    layer, slots[tseq[t]], which, Wm1 + j, d]
                        y[t, d] = acc[0] / (T.float32(1) + T.exp(-acc[0]))
        # Kernel 2: new windows = last W-1 entries of concat(old window, x_seq).
        for b in T.thread_binding(n_cu - 1, thread="blockIdx.x"):
            for tx in T.thread_binding(TX, thread="threadIdx.x"):
                for d1 in range(ND):
                    win = T.alloc_buffer((Wm1,), "float32", scope="local")
                    d = d1 * TX + tx
                    if d < D:
                        for i in range(Wm1):
                            c = cu[b + 1] - cu[b] + i
                            if c < Wm1:
                                win[i] = state[layer, slots[b], which, c, d]
                            else:
                                win[i] = T.Cast("float32", x[cu[b] + c - Wm1, d])
                        for i in range(Wm1):
                            state[layer, slots[b], which, i, d] = win[i]

    return short_conv_gpu


def short_conv_reference(x, weight, cu_seqlens, seq_slots, conv_state, layer, which):
    """NumPy reference of :func:`short_conv_kernel`; returns ``(y, new conv_state)``.

    Uses the textbook form: per sequence, pad its inputs on the left with the stored window,
    ``y_p = SiLU(Σ_w weight[d, 0, w] · xpad[p + w])``.
    """
    x = np.asarray(x, np.float32)
    weight = np.asarray(weight, np.float32)[:, 0, :]  # [D, W]
    W = weight.shape[1]
    state = np.array(conv_state, np.float32, copy=True)
    y = np.zeros_like(x)
    for b in range(len(cu_seqlens) - 1):
        s0, s1, slot = int(cu_seqlens[b]), int(cu_seqlens[b + 1]), int(seq_slots[b])
        xpad = np.concatenate([state[layer, slot, which], x[s0:s1]], axis=0)  # [W-1+L, D]
        for p in range(s1 - s0):
            z = (xpad[p:p + W] * weight.T).sum(0)
            y[s0 + p] = z / (1.0 + np.exp(-z))
        state[layer, slot, which] = xpad[-(W - 1):]
    return y, state


# ----------------------------------------------------------------------------------------
# 2. KDA chunked prefill (spec §3 KDA step 5, WY / UT transform form)
# ----------------------------------------------------------------------------------------


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def kda_chunk_prefill_kernel(H: int, K: int, V: int, scale: float, chunk: int = 64,
                             gpu: bool = False):
    """KDA over a flat ragged batch, chunked (WY representation, UT transform), fp32.

    PrimFunc arguments (in order)::

        q           [T, H, K]           float32   L2-normalized (scaled here by ``scale``)
        k           [T, H, K]           float32   L2-normalized
        v           [T, H, V]           float32
        g           [T, H, K]           float32   log-space decay per channel (≤ 0)
        beta        [T, H]              float32
        cu_seqlens  [B+1]               int32
        seq_slots   [B]                 int32
        kda_state   [L, S, H, K, V]     float32   in place (argument index 7)
        layer       int32
        o           [T, H, V]           float32   output

    Per sequence and head, the state ``S = kda_state[layer, slot, h]`` is carried over chunks
    of ``chunk`` tokens (the last one may be partial). Within a chunk (n tokens, local
    index i, ``Γ_i = Σ_{j≤i} g_j`` the in-chunk cumulative log decay, all exps are of
    ``Γ_i − Γ_j ≤ 0`` or ``Γ_i ≤ 0``, so nothing overflows)::

        L[i,j]  = β_i Σ_d k_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])      (j < i)
        Tm      = (I + L)^{-1} diag(β)                          (forward substitution)
        w       = Tm (exp(Γ) ⊙ k),   u = Tm v
        vn      = u − w S                                       (the "new values")
        o_i     = scale·(q_i ⊙ exp(Γ_i))ᵀ S + Σ_{j≤i} Aqk[i,j] vn_j,
                  Aqk[i,j] = scale Σ_d q_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])
        S      ← diag(exp(Γ_{n−1})) S + Σ_j (exp(Γ_{n−1} − Γ_j) ⊙ k_j) vn_jᵀ

    This is fla's ``naive_chunk_kda`` (fla/ops/kda/naive.py) for one sequence, with the
    padding of the last chunk replaced by a shorter loop.
    """
    if gpu:
        return _kda_prefill_gpu(H, K, V, scale)
    C = chunk

    @T.prim_func(private=True)
    def kda_chunk_prefill(
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        g_h: T.handle,
        beta_h: T.handle,
        cu_h: T.handle,
        slots_h: T.handle,
        state_h: T.handle,
        layer: T.int32,
        o_h: T.handle,
    ):
        T.func_attr({"tir.noalias": True})
        n_tok, n_cu, n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (n_tok, H, K), "float32")
        k = T.match_buffer(k_h, (n_tok, H, K), "float32")
        v = T.match_buffer(v_h, (n_tok, H, V), "float32")
        g = T.match_buffer(g_h, (n_tok, H, K), "float32")
        beta = T.match_buffer(beta_h, (n_tok, H), "float32")
        cu = T.match_buffer(cu_h, (n_cu,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
        o = T.match_buffer(o_h, (n_tok, H, V), "float32")
        for bh in T.parallel((n_cu - 1) * H):
            gam = T.alloc_buffer((C, K), "float32")   # Γ: in-chunk cumulative log decay
            Lm = T.alloc_buffer((C, C), "float32")    # L, then Aqk
            Tm = T.alloc_buffer((C, C), "float32")    # (I + L)^{-1} diag(β)
            wk = T.alloc_buffer((C, K), "float32")    # w
            vn = T.alloc_buffer((C, V), "float32")    # u, then vn
            acc = T.alloc_buffer((1,), "float32", scope="local")
            b = T.Cast("int32", bh // H)
            h = T.Cast("int32", bh % H)
            slot = slots[b]
            s0 = cu[b]
            n_chunks = (cu[b + 1] - s0 + C - 1) // C
            for c in range(n_chunks):
                c0 = s0 + c * C
                n = T.min(C, cu[b + 1] - c0)
                # Γ_i = Σ_{j≤i} g_j
                for d in range(K):
                    gam[0, d] = g[c0, h, d]
                for i in range(n - 1):
                    for d in range(K):
                        gam[i + 1, d] = gam[i, d] + g[c0 + i + 1, h, d]
                # L[i, j] = β_i k_iᵀ diag(exp(Γ_i − Γ_j)) k_j, j < i
                for i in range(n):
                    for j in range(i):
                        acc[0] = T.float32(0)
                        for d in range(K):
                            acc[0] = acc[0] + k[c0 + i, h, d] * k[c0 + j, h, d] * T.exp(
                                gam[i, d] - gam[j, d])
                        Lm[i, j] = beta[c0 + i, h] * acc[0]
                # M = (I + L)^{-1} by forward substitution (M lower triangular):
                #   M[i, j] = δ_ij − Σ_{j≤m<i} L[i, m] M[m, j];  Tm = M diag(β)
                for i in range(n):
                    for j in range(i + 1):
                        acc[0] = T.if_then_else(i == j, T.float32(1), T.float32(0))
                        for m in range(i - j):
                            acc[0] = acc[0] - Lm[i, j + m] * Tm[j + m, j]
                        Tm[i, j] = acc[0]
                for i in range(n):
                    for j in range(i + 1):
                        Tm[i, j] = Tm[i, j] * beta[c0 + j, h]
                # w = Tm (exp(Γ) ⊙ k),  u = Tm v
                for i in range(n):
                    for d in range(K):
                        acc[0] = T.float32(0)
                        for j in range(i + 1):
                            acc[0] = acc[0] + Tm[i, j] * T.exp(gam[j, d]) * k[c0 + j, h, d]
                        wk[i, d] = acc[0]
                    for e in range(V):
                        acc[0] = T.float32(0)
                        for j in range(i + 1):
                            acc[0] = acc[0] + Tm[i, j] * v[c0 + j, h, e]
                        vn[i, e] = acc[0]
                # vn = u − w S
                for i in range(n):
                    for e in range(V):
                        acc[0] = vn[i, e]
                        for d in range(K):
                            acc[0] = acc[0] - wk[i, d] * S[layer, slot, h, d, e]
                        vn[i, e] = acc[0]
                # Aqk[i, j] = scale q_iᵀ diag(exp(Γ_i − Γ_j)) k_j, j ≤ i  (reuses Lm)
                for i in range(n):
                    for j in range(i + 1):
                        acc[0] = T.float32(0)
                        for d in range(K):
                            acc[0] = acc[0] + q[c0 + i, h, d] * k[c0 + j, h, d] * T.exp(
                                gam[i, d] - gam[j, d])
                        Lm[i, j] = T.float32(scale) * acc[0]
                # o_i = scale (q_i ⊙ exp(Γ_i))ᵀ S + Σ_{j≤i} Aqk[i, j] vn_j
                for i in range(n):
                    for e in range(V):
                        acc[0] = T.float32(0)
                        for d in range(K):
                            acc[0] = acc[0] + q[c0 + i, h, d] * T.exp(gam[i, d]) * S[
                                layer, slot, h, d, e]
                        acc[0] = acc[0] * T.float32(scale)
                        for j in range(i + 1):
                            acc[0] = acc[0] + Lm[i, j] * vn[j, e]
                        o[c0 + i, h, e] = acc[0]
                # S ← diag(exp(Γ_last)) S + Σ_j (exp(Γ_last − Γ_j) ⊙ k_j) vn_jᵀ
                for d in range(K):
                    for e in range(V):
                        acc[0] = S[layer, slot, h, d, e] * T.exp(gam[n - 1, d])
                        for j in range(n):
                            acc[0] = acc[0] + T.exp(gam[n - 1, d] - gam[j, d]) * k[
                                c0 + j, h, d] * vn[j, e]
                        S[layer, slot, h, d, e] = acc[0]

    return kda_chunk_prefill


def _kda_prefill_gpu(H: int, K: int, V: int, scale: float):
    """GPU variant of :func:`kda_chunk_prefill_kernel` (same arguments), recurrent form:
    one block per (sequence, head), one thread per state column ``e`` (kept in registers /
    local memory), tokens in order. Matches :func:`kda_recurrent_reference`."""
    assert V <= 1024, "one thread per state column: V must be <= 1024"

    @T.prim_func(private=True)
    def kda_prefill_gpu(
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        g_h: T.handle,
        beta_h: T.handle,
        cu_h: T.handle,
        slots_h: T.handle,
        state_h: T.handle,
        layer: T.int32,
        o_h: T.handle,
    ):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_cu, n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (n_tok, H, K), "float32")
        k = T.match_buffer(k_h, (n_tok, H, K), "float32")
        v = T.match_buffer(v_h, (n_tok, H, V), "float32")
        g = T.match_buffer(g_h, (n_tok, H, K), "float32")
        beta = T.match_buffer(beta_h, (n_tok, H), "float32")
        cu = T.match_buffer(cu_h, (n_cu,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
        o = T.match_buffer(o_h, (n_tok, H, V), "float32")
        for bh in T.thread_binding((n_cu - 1) * H, thread="blockIdx.x"):
            for e in T.thread_binding(V, thread="threadIdx.x"):
                col = T.alloc_buffer((K,), "float32", scope="local")
                acc = T.alloc_buffer((1,), "float32", scope="local")
                b = bh // H
                h = bh % H
                slot = slots[b]
                for d in range(K):
                    col[d] = S[layer, slot, h, d, e]
                for t in range(cu[b], cu[b + 1]):
                    # S' = diag(exp(g)) S;  δ = β (v_e − S'[:, e]ᵀ k)
                    acc[0] = v[t, h, e]
                    for d in range(K):
                        col[d] = col[d] * T.exp(g[t, h, d])
                        acc[0] = acc[0] - col[d] * k[t, h, d]
                    acc[0] = acc[0] * beta[t, h]
                    for d in range(K):
                        col[d] = col[d] + k[t, h, d] * acc[0]
                    acc[0] = T.float32(0)
                    for d in range(K):
                        acc[0] = acc[0] + col[d] * q[t, h, d]
                    o[t, h, e] = acc[0] * T.float32(scale)
                for d in range(K):
                    S[layer, slot, h, d, e] = col[d]

    return kda_prefill_gpu


def kda_recurrent_reference(q, k, v, g, beta, cu_seqlens, seq_slots, kda_state, layer, scale):
    """NumPy (float64) reference of the KDA recurrence over a ragged batch (spec §3 step 5).

    Shapes as in :func:`kda_chunk_prefill_kernel`. Returns ``(o [T, H, V], new kda_state)``.
    Per token: ``S' = diag(exp(g_t)) S``; ``S = S' + β_t k_t (v_t − S'ᵀ k_t)ᵀ``;
    ``o_t = scale · Sᵀ q_t``.
    """
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    state = np.array(kda_state, np.float64, copy=True)
    o = np.zeros(v.shape, np.float64)
    for b in range(len(cu_seqlens) - 1):
        slot = int(seq_slots[b])
        S = state[layer, slot]  # [H, K, V] (a view)
        for t in range(int(cu_seqlens[b]), int(cu_seqlens[b + 1])):
            S *= np.exp(g[t])[:, :, None]
            kS = np.einsum("hk,hkv->hv", k[t], S)
            S += np.einsum("hk,hv->hkv", beta[t][:, None] * k[t], v[t] - kS)
            o[t] = scale * np.einsum("hk,hkv->hv", q[t], S)
    return o.astype(np.float32), state.astype(np.float32)


# ----------------------------------------------------------------------------------------
# 3. KDA decode (recurrent form, one token per sequence)
# ----------------------------------------------------------------------------------------


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def kda_decode_kernel(H: int, K: int, V: int, scale: float, gpu: bool = False):
    """One recurrent KDA step per sequence; token ``b`` of the batch belongs to sequence ``b``.

    PrimFunc arguments (in order)::

        q, k        [B, H, K]           float32   L2-normalized
        v           [B, H, V]           float32
        g           [B, H, K]           float32
        beta        [B, H]              float32
        seq_slots   [B]                 int32
        kda_state   [L, S, H, K, V]     float32   in place (argument index 6)
        layer       int32
        o           [B, H, V]           float32   output

    ``S' = diag(exp(g)) S``;  ``S = S' + β k (v − S'ᵀ k)ᵀ``;  ``o = scale · Sᵀ q``.
    Reference: :func:`kda_recurrent_reference` with ``cu_seqlens = arange(B+1)``.
    """
    if gpu:
        return _kda_decode_gpu(H, K, V, scale)

    @T.prim_func(private=True)
    def kda_decode(
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        g_h: T.handle,
        beta_h: T.handle,
        slots_h: T.handle,
        state_h: T.handle,
        layer: T.int32,
        o_h: T.handle,
    ):
        T.func_attr({"tir.noalias": True})
        n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (n_seq, H, K), "float32")
        k = T.match_buffer(k_h, (n_seq, H, K), "float32")
        v = T.match_buffer(v_h, (n_seq, H, V), "float32")
        g = T.match_buffer(g_h, (n_seq, H, K), "float32")
        beta = T.match_buffer(beta_h, (n_seq, H), "float32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
        o = T.match_buffer(o_h, (n_seq, H, V), "float32")
        for bh in T.parallel(n_seq * H):
            acc = T.alloc_buffer((1,), "float32", scope="local")
            b = bh // H
            h = bh % H
            slot = slots[b]
            for d in range(K):  # S' = diag(exp(g)) S
                for e in range(V):
                    S[layer, slot, h, d, e] = S[layer, slot, h, d, e] * T.exp(g[b, h, d])
            for e in range(V):  # S[:, e] += β k (v_e − S'[:, e]ᵀ k)
                acc[0] = v[b, h, e]
                for d in range(K):
                    acc[0] = acc[0] - S[layer, slot, h, d, e] * k[b, h, d]
                acc[0] = acc[0] * beta[b, h]
                for d in range(K):
                    S[layer, slot, h, d, e] = S[layer, slot, h, d, e] + k[b, h, d] * acc[0]
            for e in range(V):  # o = scale Sᵀ q
                acc[0] = T.float32(0)
                for d in range(K):
                    acc[0] = acc[0] + S[layer, slot, h, d, e] * q[b, h, d]
                o[b, h, e] = acc[0] * T.float32(scale)

    return kda_decode


def _kda_decode_gpu(H: int, K: int, V: int, scale: float):
    """GPU variant of :func:`kda_decode_kernel` (same arguments): one block per
    (sequence, head), one thread per state column."""
    assert V <= 1024, "one thread per state column: V must be <= 1024"

    @T.prim_func(private=True)
    def kda_decode_gpu(
        q_h: T.handle,
        k_h: T.handle,
        v_h: T.handle,
        g_h: T.handle,
        beta_h: T.handle,
        slots_h: T.handle,
        state_h: T.handle,
        layer: T.int32,
        o_h: T.handle,
    ):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (n_seq, H, K), "float32")
        k = T.match_buffer(k_h, (n_seq, H, K), "float32")
        v = T.match_buffer(v_h, (n_seq, H, V), "float32")
        g = T.match_buffer(g_h, (n_seq, H, K), "float32")
        beta = T.match_buffer(beta_h, (n_seq, H), "float32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
        o = T.match_buffer(o_h, (n_seq, H, V), "float32")
        for bh in T.thread_binding(n_seq * H, thread="blockIdx.x"):
            for e in T.thread_binding(V, thread="threadIdx.x"):
                col = T.alloc_buffer((K,), "float32", scope="local")
                acc = T.alloc_buffer((1,), "float32", scope="local")
                b = bh // H
                h = bh % H
                slot = slots[b]
                acc[0] = v[b, h, e]
                for d in range(K):
                    col[d] = S[layer, slot, h, d, e] * T.exp(g[b, h, d])
                    acc[0] = acc[0] - col[d] * k[b, h, d]
                acc[0] = acc[0] * beta[b, h]
                for d in range(K):
                    col[d] = col[d] + k[b, h, d] * acc[0]
                    S[layer, slot, h, d, e] = col[d]
                acc[0] = T.float32(0)
                for d in range(K):
                    acc[0] = acc[0] + col[d] * q[b, h, d]
                o[b, h, e] = acc[0] * T.float32(scale)

    return kda_decode_gpu


# ----------------------------------------------------------------------------------------
# 4. State-store operations on a pool [L, S, *inner] (reset / fork a slot, all layers)
# ----------------------------------------------------------------------------------------


def _flat(inner: tuple[int, ...]) -> int:
    return int(np.prod(inner)) if inner else 1


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def slot_reset_kernel(inner: tuple[int, ...], gpu: bool = False):
    """Zero slot ``slot`` of a pool ``[L, S, *inner]`` float32 in every layer (in place, arg 0).

    PrimFunc arguments: ``pool [L, S, R]`` (``R = prod(inner)``; pass the pool reshaped),
    ``slot`` int64. A new sequence starts from a reset slot. The kernel is
    :func:`schedules.cache_ops.pool_reset_kernel`; reference :func:`slot_reset_reference`.
    """
    return pool_reset_kernel(_flat(inner), "float32", gpu)


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def slot_copy_kernel(inner: tuple[int, ...], gpu: bool = False):
    """Copy slot ``src`` to slot ``dst`` of a pool ``[L, S, R]`` float32 in every layer (fork).

    PrimFunc arguments: ``pool [L, S, R]`` (in place, arg 0), ``src`` int64, ``dst`` int64.
    The kernel is :func:`schedules.cache_ops.pool_copy_kernel`; reference
    :func:`slot_copy_reference`.
    """
    return pool_copy_kernel(_flat(inner), "float32", gpu)


def slot_reset_reference(pool: np.ndarray, slot: int) -> None:
    """``pool[:, slot] = 0`` in place (numpy)."""
    pool[:, slot] = 0


def slot_copy_reference(pool: np.ndarray, src: int, dst: int) -> None:
    """``pool[:, dst] = pool[:, src]`` in place (numpy)."""
    pool[:, dst] = pool[:, src]
