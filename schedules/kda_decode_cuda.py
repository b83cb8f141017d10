"""Fused KDA decode kernel for CUDA (one token per sequence), with its reference beside it.

One step of spec §3 "KDA layer", steps 2–5, for a batch of sequences, fused into one kernel
that reads and writes each sequence's fp32 state exactly once, in place:

    q̂ = q / ‖q‖ · K^-½,  k̂ = k / ‖k‖                         (L2 norm, eps 1e-6)
    g = lb · σ(exp(A_log[h]) · (f + dt_bias))                  (lower-bound gate, lb < 0)
      | −exp(A_log[h]) · softplus(f + dt_bias)                 (no lower bound)
    β = σ(b)
    S' = diag(exp(g)) S;   S = S' + β k̂ (v − S'ᵀ k̂)ᵀ;   o = Sᵀ q̂

Mapping (why it approaches the HBM roofline): the state of one head is K×V fp32 (64 KiB for
K = V = 128). Column e of S evolves independently of the other columns: the reductions
``S'ᵀ k̂`` and ``Sᵀ q̂`` run over K, i.e. *down* a column. So each column is read once into
registers (coalesced: a warp reads 32 consecutive floats of a row, or 64 as 8-byte pairs with
``vec`` 2, the model's choice), updated, and written once — no second pass over global
memory. A column is split over ``k_split`` threads so that each holds only K/k_split floats
(registers bound occupancy, and occupancy bounds the bytes in flight); their partial dot
products meet in shared memory. A block is (sequence, head, group of ``cols_per_block``
columns); q, k and the decay of the head are staged in shared memory, and the state loads are
issued before the staging barrier so they overlap it.

:func:`kda_decode_conv_fused_kernel` is the step the model dispatches: the same with spec §3
step 1 inside — the short convolutions of q, k and v from their stored windows and the windows'
update, in place — at one block a head (a head's q and k windows must not be rewritten while
another block still needs them), and below 48 heads also step 6's head RMSNorm and sigmoid
gate (:func:`kda_decode_conv_dispatch`). One launch replaces the generic convolution's six and
this kernel: 1.65–21× the chain's speed on the H200
(benchmarks/results/kda_decode_conv_h200_2026-12-02.json, _conv_norm_).

:func:`kda_verify_fused_kernel` is the same step over a few tokens per sequence for
speculative verification: the state is read once and stays in registers from token to token;
the state after each token but the last is written to ``states`` so that a rejected suffix's
KDA state rolls back by one copy instead of a replay (the conv state is the caller's), and the
last one goes to the pool. Measured on the H200 in tests/gpu/check_kda_verify.py
(benchmarks/results/kda_verify_h200_2026-11-30.json; with the model's column pairs
kda_verify_vec_h200_2026-12-02.json and _vec_b_) against the same tokens as decode steps.
Not dispatched yet: the model exports no verify function, and the runtime rolls back by
checkpoint and replay (k3_compile/runtime/engine.py).

Reference: :func:`kda_decode_fused_reference` / :func:`kda_verify_fused_reference` (NumPy),
checked against fla's ``naive_recurrent_kda`` in tests/test_kda_cuda.py.
"""

from __future__ import annotations

import functools

import numpy as np
from tvm.script import tirx as T

# TVM's launch tag for programmatic dependent launch (the runtime then launches the kernel with
# cuLaunchKernelEx and CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
PDL_LAUNCH_TAG = "tirx.use_programtic_dependent_launch"


def _check_tiling(K: int, V: int, cols_per_block: int, k_split: int, vec: int = 1) -> None:
    CB, KS = cols_per_block, k_split
    if vec not in (1, 2, 4) or CB % vec:
        raise ValueError(f"vec={vec} must be 1, 2 or 4 and divide cols_per_block={CB}")
    NT = CB // vec * KS
    if V % CB or K % KS or NT % 32 or (K % NT and NT % K) or NT > 1024:
        raise ValueError(f"V={V} must be a multiple of cols_per_block={CB}, K={K} of k_split={KS}, "
                         f"and the threads of a block (cols_per_block / vec × k_split = {NT}) "
                         f"divide K or be a multiple of it, itself a multiple of 32, at most 1024")


def _geometry(K: int, V: int, CB: int, KS: int, VEC: int):
    """The tiling's derived sizes and index expressions, shared by both kernels and their
    macros (checked by :func:`_check_tiling`): ``TPR`` threads across the block's columns, ``NT``
    threads a block, ``NCB`` column groups a head, ``KR`` rows a thread; ``row(tx, i)`` is the
    thread's i-th row, ``column(blk, tx, j)`` its j-th column. Both are expressions, not names
    assigned in the PrimFunc: such a name is a local variable, and the codegen could then not
    prove the VEC-wide state accesses aligned."""
    _check_tiling(K, V, CB, KS, VEC)
    TPR = CB // VEC
    NCB, KR = V // CB, K // KS

    def row(tx, i):
        return (tx // TPR) * KR + i

    def column(blk, tx, j):
        return blk % NCB * CB + (tx % TPR) * VEC + j

    return TPR, TPR * KS, NCB, KR, row, column


def _block_sum(NT: int, n: int):
    """TVMScript macro ``block_sum(nrm, red, tx)``: each of ``red[0:n]`` (a thread's local
    values) replaced by its sum over the block's ``NT`` threads — across each warp by shuffles,
    then across the warps through ``nrm [NT / 32, ≥ n]`` (shared) after one barrier."""

    @T.macro
    def block_sum(nrm, red, tx):
        for o in T.unroll(5):
            for j in T.unroll(n):
                red[j] = red[j] + T.call_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF),
                                                red[j], 16 >> o, 32)
        if tx % 32 == 0:
            for j in T.unroll(n):
                nrm[tx // 32, j] = red[j]
        T.tvm_storage_sync("shared")
        for j in T.unroll(n):
            red[j] = T.float32(0)
        for w in T.unroll(NT // 32):
            for j in T.unroll(n):
                red[j] = red[j] + nrm[w, j]

    return block_sum


def _step_macros(K: int, V: int, lower_bound: float | None, CB: int, KS: int, VEC: int = 1):
    """The per-token pieces of the fused step shared by the decode and verify kernels, as
    TVMScript macros (``x(r)`` etc. are callables giving the token's inputs). Thread ``tx``
    holds ``VEC`` adjacent columns (``c = tx % (CB / VEC)``: columns ``c·VEC … c·VEC + VEC − 1``
    of the block's ``CB``) of rows ``s·K/KS …`` (``s = tx // (CB / VEC)``); ``col[i·VEC + j]``
    is row offset ``i``, column ``j`` of that slice; ``red[0:2]`` hold the norms,
    ``red[2 + j]`` / ``red[2 + VEC + j]`` column j's u and partial Sᵀq.

    - ``stage(...)``: q, k and the decay e^g of the head → shared memory, this thread's sums
      of squares of q and k into ``red[0:2]``;
    - ``norms(...)``: the sums over the block → ``red[0]`` = K^-½ / ‖q‖, ``red[1]`` = 1 / ‖k‖;
    - ``update(...)``: S' = diag(e^g) S, u = β (v − S'ᵀ k̂), S = S' + k̂ uᵀ on the thread's
      slice ``col``, ``red[2 + VEC + j]`` its partial Sᵀ q; each updated row of the slice
      (row offset ``i``) is also written to ``out_buf[out_index(i, j)]``, ``j < VEC`` (as
      one ``VEC``-wide store);
    - ``output(...)``: the partials of Sᵀ q̂ summed over the ``k_split`` threads →
      ``o_buf[o_index(j)]``.
    """
    TPR, NT, _, KR, row, _ = _geometry(K, V, CB, KS, VEC)
    scale = float(K) ** -0.5
    LB = float(lower_bound) if lower_bound is not None else 0.0
    use_lb = lower_bound is not None
    per_thread = -(-K // NT)    # staging loads per thread
    guard = K % NT != 0         # more threads than K: only the first K stage

    @T.macro
    def stage_row(q_s, k_s, d_s, red, qv, kv, fv, A_log, dt_bias, h, r):
        q_s[r] = qv(r)
        k_s[r] = kv(r)
        red[0] = red[0] + qv(r) * qv(r)
        red[1] = red[1] + kv(r) * kv(r)
        x = fv(r) + dt_bias[h * K + r]
        if use_lb:
            d_s[r] = T.exp(T.float32(LB) * T.sigmoid(T.exp(A_log[h]) * x))
        else:  # −exp(A_log)·softplus(x), softplus(x) = max(x, 0) + log(1 + e^−|x|)
            d_s[r] = T.exp(T.float32(0) - T.exp(A_log[h]) * (
                T.max(x, T.float32(0)) + T.log(T.float32(1) + T.exp(T.float32(0) - T.fabs(x)))))

    @T.macro
    def stage(q_s, k_s, d_s, red, qv, kv, fv, A_log, dt_bias, h, tx):
        red[0] = T.float32(0)
        red[1] = T.float32(0)
        for i in T.unroll(per_thread):
            if guard:
                if tx < K:
                    stage_row(q_s, k_s, d_s, red, qv, kv, fv, A_log, dt_bias, h, tx)
            else:
                stage_row(q_s, k_s, d_s, red, qv, kv, fv, A_log, dt_bias, h, i * NT + tx)

    sum2 = _block_sum(NT, 2)

    @T.macro
    def norms(nrm, red, tx):
        # the sums of squares over the block (across the warp by shuffles, then the warps)
        sum2(nrm, red, tx)
        red[0] = T.float32(scale) / T.sqrt(red[0] + T.float32(1e-6))
        red[1] = T.float32(1) / T.sqrt(red[1] + T.float32(1e-6))

    @T.macro
    def update(col, q_s, k_s, d_s, part, red, beta_logit, v_e, out_buf, out_index, tx):
        # partial S'ᵀ k over this thread's rows, then over the k_split threads
        for j in T.unroll(VEC):
            red[2 + j] = T.float32(0)
        for i in T.unroll(KR):
            for j in T.unroll(VEC):
                col[i * VEC + j] = col[i * VEC + j] * d_s[row(tx, i)]
                red[2 + j] = red[2 + j] + col[i * VEC + j] * k_s[row(tx, i)]
        for j in T.unroll(VEC):
            part[(tx // TPR), (tx % TPR) * VEC + j] = red[2 + j]
        T.tvm_storage_sync("shared")
        for j in T.unroll(VEC):
            red[2 + j] = T.float32(0)
            for jj in T.unroll(KS):
                red[2 + j] = red[2 + j] + part[jj, (tx % TPR) * VEC + j]
            # u = β (v − S'ᵀ k̂), folded with the 1/‖k‖ of k̂ in the update below
            red[2 + j] = T.sigmoid(beta_logit) * (v_e(j) - red[2 + j] * red[1]) * red[1]
            red[2 + VEC + j] = T.float32(0)
        for i in T.unroll(KR):
            for j in T.unroll(VEC):
                col[i * VEC + j] = col[i * VEC + j] + k_s[row(tx, i)] * red[2 + j]
                red[2 + VEC + j] = red[2 + VEC + j] + col[i * VEC + j] * q_s[row(tx, i)]
            if VEC == 1:
                out_buf[out_index(i, 0)] = col[i]
            else:
                for j in T.vectorized(VEC):
                    out_buf[out_index(i, j)] = col[i * VEC + j]
        T.tvm_storage_sync("shared")

    @T.macro
    def output(part, red, o_buf, o_index, tx):
        for j in T.unroll(VEC):
            part[(tx // TPR), (tx % TPR) * VEC + j] = red[2 + VEC + j]
        T.tvm_storage_sync("shared")
        if (tx // TPR) == 0:
            for j in T.unroll(VEC):
                red[2 + VEC + j] = T.float32(0)
                for jj in T.unroll(KS):
                    red[2 + VEC + j] = red[2 + VEC + j] + part[jj, (tx % TPR) * VEC + j]
                o_buf[o_index(j)] = red[2 + VEC + j] * red[0]

    @T.macro
    def load(col, S_buf, s_index):
        # this thread's rows of its columns, VEC-wide loads
        for i in T.unroll(KR):
            if VEC == 1:
                col[i] = S_buf[s_index(i, 0)]
            else:
                for j in T.vectorized(VEC):
                    col[i * VEC + j] = S_buf[s_index(i, j)]

    return stage, norms, update, output, load


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def kda_decode_fused_kernel(H: int, K: int, V: int, lower_bound: float | None,
                            cols_per_block: int = 32, k_split: int = 4, vec: int = 1,
                            min_blocks: int = 0, pdl: bool = False):
    """Build the fused decode PrimFunc (CUDA only: uses thread bindings and shared memory).

    A block is (sequence, head, ``cols_per_block`` columns) with ``cols_per_block / vec ×
    k_split`` threads: thread (c, s) holds rows ``s·K/k_split … (s+1)·K/k_split − 1`` of the
    ``vec`` adjacent columns ``c·vec …`` in registers, each row's ``vec`` floats loaded and
    stored as one access (8 bytes for ``vec`` 2: with 32 or more threads across the columns a
    warp then moves 256 contiguous bytes per instruction); the two dot products down a column
    (S'ᵀk̂, Sᵀq̂) are reduced over the ``k_split`` threads through shared memory. Splitting K
    keeps registers per thread low (vec·K/k_split floats of state), so more warps — and more
    loads in flight — fit per SM.
    ``min_blocks`` > 0 asks ptxas for that many blocks per SM (``__launch_bounds__``).
    :func:`decode_tiling` gives the model's choice and the measurements behind it.

    ``pdl`` (measured, not dispatched): programmatic dependent launch (CUDA
    ``cudaLaunchAttributeProgrammaticStreamSerialization``, TVM's launch tag
    :data:`PDL_LAUNCH_TAG`): the kernel may start once the kernel ahead of it in the stream has
    triggered (``griddepcontrol.launch_dependents``, else at its blocks' exit). Each thread
    loads its pool slot and its slice of the state first, then waits (``griddepcontrol.wait``)
    for the kernel ahead before it reads q, k, v, f and b — through L2 (``__ldcg``: on the
    kernel's ``__restrict__`` pointers nvcc emits ``ld.global.nc``, whose data must not change
    while the kernel runs; such a build read f before the kernel ahead had written it) — and
    before it writes anything. It never triggers its own dependents early. On the H200 behind
    a predecessor that triggers at entry (``benchmarks/kda.py`` ``stream`` rows,
    benchmarks/results/kda_decode_pdl_final_h200_2026-12-02.json): 7.3 instead of 7.9 µs at 12
    heads and batch 16 behind a b_proj-like GEMV, within ±1% elsewhere, and no gain behind
    K3's real predecessor (a cast); timed back to back 4% faster at 12 heads and batch 16 and
    0.2–1.2% slower at batch 64. So the model does not use it.

    PrimFunc arguments (in order)::

        q, k      [B, H, K]        float32   after the short conv (not yet L2-normalized)
        v         [B, H, V]        float32
        f         [B, H, K]        float32   f_b(f_a(x)), the raw gate
        b         [B, H]           float32   b_proj(x), the raw beta logit
        A_log     [H]              float32
        dt_bias   [H*K]            float32
        seq_slots [B]              int32
        kda_state [L, S, H, K, V]  float32   updated in place (argument index 8)
        layer     int32
        o         [B, H, V]        float32   output

    Raises:
        ValueError: ``vec`` not 1, 2 or 4 or not dividing ``cols_per_block``; ``V`` not a
            multiple of ``cols_per_block`` or ``K`` of ``k_split``; the threads of a block
            (``cols_per_block / vec × k_split``) not a multiple of 32 (the norms are reduced
            with warp shuffles), or neither dividing ``K`` nor a multiple of it (the staging of
            q, k and the gate), or over 1024 (CUDA's limit).
    """
    CB, KS, VEC = cols_per_block, k_split, vec
    _, NT, NCB, KR, row, column = _geometry(K, V, CB, KS, VEC)
    stage, norms, update, output, load = _step_macros(K, V, lower_bound, CB, KS, VEC)
    attrs = {"tir.noalias": True, "tirx.is_scheduled": True}
    if pdl:
        attrs["tirx.kernel_launch_params"] = [PDL_LAUNCH_TAG]

    def coherent(load):
        """With PDL, a load of an input the kernel ahead writes (q, k, v, f, b) as ``__ldcg``
        (``ld.global.cg``, through L2). On the kernel's ``__restrict__`` pointers nvcc would
        emit ``ld.global.nc``, whose data must not change while the kernel runs, which the
        kernel ahead may still be doing until the wait: on the H200 such a kernel read f
        before the kernel ahead of it had written it (tests/test_kda_cuda.py checks the PTX)."""
        if not pdl:
            return load
        return T.call_extern("float32", "__ldcg", T.address_of(load))

    @T.macro
    def block(q, k, v, f, bb, A_log, dt_bias, slots, S, layer, o, blk, tx):
        q_s = T.alloc_buffer((K,), "float32", scope="shared")
        k_s = T.alloc_buffer((K,), "float32", scope="shared")
        d_s = T.alloc_buffer((K,), "float32", scope="shared")
        part = T.alloc_buffer((KS, CB), "float32", scope="shared")
        nrm = T.alloc_buffer((NT // 32, 2), "float32", scope="shared")  # per-warp ‖q‖², ‖k‖²
        col = T.alloc_buffer((KR * VEC,), "float32", scope="local")
        red = T.alloc_buffer((2 + 2 * VEC,), "float32", scope="local")
        bi = blk // (H * NCB)
        h = blk % (H * NCB) // NCB
        slot = slots[bi]
        # this thread's slice of the state, loaded once: with PDL first (the slot and the state
        # depend on no kernel of this step), then wait for the kernel ahead's writes (q, k, v,
        # f, b); else after the staging, so that the loads overlap the norms' barrier
        if pdl:
            load(col, S, lambda i, j: (layer, slot, h, row(tx, i), column(blk, tx, j)))
            T.ptx.griddepcontrol.wait()
        stage(q_s, k_s, d_s, red, lambda r: coherent(q[bi, h, r]), lambda r: coherent(k[bi, h, r]),
              lambda r: coherent(f[bi, h, r]), A_log, dt_bias, h, tx)
        if not pdl:
            load(col, S, lambda i, j: (layer, slot, h, row(tx, i), column(blk, tx, j)))
        norms(nrm, red, tx)
        update(col, q_s, k_s, d_s, part, red, coherent(bb[bi, h]), lambda j: coherent(v[bi, h, column(blk, tx, j)]),
               S, lambda i, j: (layer, slot, h, row(tx, i), column(blk, tx, j)), tx)
        output(part, red, o, lambda j: (bi, h, column(blk, tx, j)), tx)

    @T.prim_func(private=True)
    def kda_decode_fused(q_h: T.handle, k_h: T.handle, v_h: T.handle, f_h: T.handle,
                         b_h: T.handle, alog_h: T.handle, dtb_h: T.handle, slots_h: T.handle,
                         state_h: T.handle, layer: T.int32, o_h: T.handle):
        T.func_attr(attrs)
        n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (n_seq, H, K), "float32")
        k = T.match_buffer(k_h, (n_seq, H, K), "float32")
        v = T.match_buffer(v_h, (n_seq, H, V), "float32")
        f = T.match_buffer(f_h, (n_seq, H, K), "float32")
        bb = T.match_buffer(b_h, (n_seq, H), "float32")
        A_log = T.match_buffer(alog_h, (H,), "float32")
        dt_bias = T.match_buffer(dtb_h, (H * K,), "float32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
        o = T.match_buffer(o_h, (n_seq, H, V), "float32")
        for blk in T.thread_binding(n_seq * (H * NCB), thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                if min_blocks > 0:
                    with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", min_blocks):
                        block(q, k, v, f, bb, A_log, dt_bias, slots, S, layer, o, blk, tx)
                else:
                    block(q, k, v, f, bb, A_log, dt_bias, slots, S, layer, o, blk, tx)

    return kda_decode_fused


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def kda_decode_conv_fused_kernel(H: int, K: int, W: int, lower_bound: float | None, in_dtype: str,
                                 k_split: int = 4, vec: int = 2, out_norm_eps: float | None = None,
                                 min_blocks: int = 0):
    """The fused decode step with spec §3 step 1 inside: the short convolutions of q, k and v
    and their conv-window updates, then :func:`kda_decode_fused_kernel`'s step 2–5 (V = K).

    A block is one (sequence, head) — all ``K`` columns (``cols_per_block = K``), ``K / vec ×
    k_split`` threads — so that it alone reads and rewrites the head's q, k and v conv windows:
    with the head's columns split over blocks, each block would need every q and k channel's
    old window, and one block's new window could overwrite it before another had read it.
    Each thread first issues the loads of its slice of the state (they overlap the
    convolutions), then the ``3 K`` channels (q, k, v of the head) are spread over the
    threads: channel c of projection p computes ``y = SiLU(Σ_w w_p[c, 0, w] · [window, x][w])``
    from its ``W − 1`` stored inputs and this token's ``x_p`` into shared memory, and writes the
    window shifted by one with ``x_p`` last; the step then runs as in the kernel without the
    convolutions, q, k and v read from shared memory. One launch replaces the convolution's
    (two kernels per projection in the generic path) and the decode kernel; y never goes
    through HBM.

    ``out_norm_eps`` (step 6's head norm and gate, inside): the block also holds its head's
    whole o, so it applies the per-head output RMSNorm and the sigmoid gate itself, ``o ←
    o / sqrt(mean(o²) + eps) · o_norm.weight · σ(g)`` with ``g = g_proj(x)``, and writes o in
    ``in_dtype`` (the model's), ready for o_proj; two more arguments before o.
    ``min_blocks`` > 0 asks ptxas for that many blocks per SM (``__launch_bounds__``).

    PrimFunc arguments (in order)::

        xq, xk, xv    [B, H*K]               in_dtype  q_proj(x), k_proj(x), v_proj(x)
        wq, wk, wv    [H*K, 1, W]            float32   {q,k,v}_conv1d.weight
        f             [B, H, K]              float32   f_b(f_a(x))
        b             [B, H]                 float32   b_proj(x)
        A_log         [H]                    float32
        dt_bias       [H*K]                  float32
        seq_slots     [B]                    int32
        kda_state     [L, S, H, K, K]        float32   in place (argument index 11)
        conv_state    [L, S, 3, W-1, H*K]    float32   in place (argument index 12)
        layer         int32
        g             [B, H*K]               in_dtype  g_proj(x)          (with out_norm_eps)
        o_norm_w      [K]                    float32   o_norm.weight      (with out_norm_eps)
        o             [B, H, K]              float32   output (in_dtype with out_norm_eps)

    Raises:
        ValueError: ``W < 2``, or a tiling :func:`kda_decode_fused_kernel` rejects for
            ``cols_per_block = K``.
    """
    if W < 2:
        raise ValueError(f"short_conv_kernel_size W={W}: the conv window needs W >= 2")
    V, CB, KS, VEC = K, K, k_split, vec
    _, NT, NCB, KR, row, column = _geometry(K, V, CB, KS, VEC)
    stage, norms, update, output, load = _step_macros(K, V, lower_bound, CB, KS, VEC)
    Wm1 = W - 1
    per_thread = -(-3 * K // NT)   # channels a thread convolves (q, k, v of the head: 3K)
    norm = out_norm_eps is not None
    o_dtype = in_dtype if norm else "float32"
    per_col = -(-K // NT)          # columns of o a thread normalizes
    sum1 = _block_sum(NT, 1)

    @T.macro
    def conv(y_s, x, w, cs, bi, slot, h, layer, which, r):
        # channel r of projection ``which``: the output from the old window, then the window
        # shifted by one with this token's input last (read into registers first: no thread
        # reads another's channel)
        win = T.alloc_buffer((Wm1,), "float32", scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        xt = T.Cast("float32", x[bi, h * K + r])
        for i in T.unroll(Wm1):
            win[i] = cs[layer, slot, which, i, h * K + r]
        acc[0] = w[h * K + r, 0, Wm1] * xt
        for i in T.unroll(Wm1):
            acc[0] = acc[0] + w[h * K + r, 0, i] * win[i]
        y_s[which, r] = acc[0] / (T.float32(1) + T.exp(T.float32(0) - acc[0]))
        for i in T.unroll(Wm1 - 1):
            cs[layer, slot, which, i, h * K + r] = win[i + 1]
        cs[layer, slot, which, Wm1 - 1, h * K + r] = xt

    @T.macro
    def head_norm(o_s, g_l, w_l, nrm, red, o, bi, h, tx):
        # step 6 on the block's head: Σ o² over the K columns (threads past K add 0), then each
        # column scaled by 1/rms, o_norm.weight and σ(g), written in the model dtype
        red[0] = T.float32(0)
        for i in T.unroll(per_col):
            if i * NT + tx < K:
                red[0] = red[0] + o_s[i * NT + tx] * o_s[i * NT + tx]
        sum1(nrm, red, tx)
        red[0] = T.float32(1) / T.sqrt(red[0] / T.float32(K) + T.float32(out_norm_eps if norm else 0.0))
        for i in T.unroll(per_col):
            if i * NT + tx < K:
                o[bi, h, i * NT + tx] = T.Cast(o_dtype, o_s[i * NT + tx] * red[0] * w_l[i]
                                               * T.sigmoid(T.Cast("float32", g_l[i])))

    @T.macro
    def step(xq, xk, xv, wq, wk, wv, f, bb, A_log, dt_bias, slots, S, cs, layer, o, g, onw, blk, tx):
        y_s = T.alloc_buffer((3, K), "float32", scope="shared")
        q_s = T.alloc_buffer((K,), "float32", scope="shared")
        k_s = T.alloc_buffer((K,), "float32", scope="shared")
        d_s = T.alloc_buffer((K,), "float32", scope="shared")
        part = T.alloc_buffer((KS, CB), "float32", scope="shared")
        nrm = T.alloc_buffer((NT // 32, 2), "float32", scope="shared")
        o_s = T.alloc_buffer((K,), "float32", scope="shared")
        col = T.alloc_buffer((KR * VEC,), "float32", scope="local")
        red = T.alloc_buffer((2 + 2 * VEC,), "float32", scope="local")
        g_l = T.alloc_buffer((per_col,), in_dtype, scope="local")
        w_l = T.alloc_buffer((per_col,), "float32", scope="local")
        bi = blk // H
        h = blk % H
        slot = slots[bi]
        load(col, S, lambda i, j: (layer, slot, h, row(tx, i), column(blk, tx, j)))
        if norm:  # step 6's operands, loaded now and used last
            for i in T.unroll(per_col):
                if i * NT + tx < K:
                    g_l[i] = g[bi, h * K + i * NT + tx]
                    w_l[i] = onw[i * NT + tx]
        for i in T.unroll(per_thread):
            if i * NT + tx < 3 * K:
                if (i * NT + tx) // K == 0:
                    conv(y_s, xq, wq, cs, bi, slot, h, layer, 0, (i * NT + tx) % K)
                elif (i * NT + tx) // K == 1:
                    conv(y_s, xk, wk, cs, bi, slot, h, layer, 1, (i * NT + tx) % K)
                else:
                    conv(y_s, xv, wv, cs, bi, slot, h, layer, 2, (i * NT + tx) % K)
        T.tvm_storage_sync("shared")
        stage(q_s, k_s, d_s, red, lambda r: y_s[0, r], lambda r: y_s[1, r],
              lambda r: f[bi, h, r], A_log, dt_bias, h, tx)
        norms(nrm, red, tx)
        update(col, q_s, k_s, d_s, part, red, bb[bi, h], lambda j: y_s[2, column(blk, tx, j)],
               S, lambda i, j: (layer, slot, h, row(tx, i), column(blk, tx, j)), tx)
        if norm:
            output(part, red, o_s, lambda j: column(blk, tx, j), tx)
            T.tvm_storage_sync("shared")
            head_norm(o_s, g_l, w_l, nrm, red, o, bi, h, tx)
        else:
            output(part, red, o, lambda j: (bi, h, column(blk, tx, j)), tx)

    @T.macro
    def bounded_step(xq, xk, xv, wq, wk, wv, f, bb, A_log, dt_bias, slots, S, cs, layer, o, g, onw, blk, tx):
        if min_blocks > 0:
            with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", min_blocks):
                step(xq, xk, xv, wq, wk, wv, f, bb, A_log, dt_bias, slots, S, cs, layer, o, g, onw, blk, tx)
        else:
            step(xq, xk, xv, wq, wk, wv, f, bb, A_log, dt_bias, slots, S, cs, layer, o, g, onw, blk, tx)

    def buffers(n_seq, n_layer, n_slot, handles):
        """The PrimFunc's buffers from its handles (shapes and dtypes as in the docstring)."""
        (xq_h, xk_h, xv_h, wq_h, wk_h, wv_h, f_h, b_h, alog_h, dtb_h, slots_h, state_h, conv_h) = handles
        return (T.match_buffer(xq_h, (n_seq, H * K), in_dtype), T.match_buffer(xk_h, (n_seq, H * K), in_dtype),
                T.match_buffer(xv_h, (n_seq, H * K), in_dtype), T.match_buffer(wq_h, (H * K, 1, W), "float32"),
                T.match_buffer(wk_h, (H * K, 1, W), "float32"), T.match_buffer(wv_h, (H * K, 1, W), "float32"),
                T.match_buffer(f_h, (n_seq, H, K), "float32"), T.match_buffer(b_h, (n_seq, H), "float32"),
                T.match_buffer(alog_h, (H,), "float32"), T.match_buffer(dtb_h, (H * K,), "float32"),
                T.match_buffer(slots_h, (n_seq,), "int32"),
                T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32"),
                T.match_buffer(conv_h, (n_layer, n_slot, 3, Wm1, H * K), "float32"))

    if norm:  # (a PrimFunc is parsed where it is defined: only the one returned)
        @T.prim_func(private=True)
        def kda_decode_conv_fused_norm(xq_h: T.handle, xk_h: T.handle, xv_h: T.handle, wq_h: T.handle,
                                       wk_h: T.handle, wv_h: T.handle, f_h: T.handle, b_h: T.handle,
                                       alog_h: T.handle, dtb_h: T.handle, slots_h: T.handle,
                                       state_h: T.handle, conv_h: T.handle, layer: T.int32, g_h: T.handle,
                                       onw_h: T.handle, o_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64()
            xq, xk, xv, wq, wk, wv, f, bb, A_log, dt_bias, slots, S, cs = buffers(
                n_seq, n_layer, n_slot, (xq_h, xk_h, xv_h, wq_h, wk_h, wv_h, f_h, b_h, alog_h, dtb_h, slots_h,
                                         state_h, conv_h))
            g = T.match_buffer(g_h, (n_seq, H * K), in_dtype)
            onw = T.match_buffer(onw_h, (K,), "float32")
            o = T.match_buffer(o_h, (n_seq, H, V), o_dtype)
            for blk in T.thread_binding(n_seq * H, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    bounded_step(xq, xk, xv, wq, wk, wv, f, bb, A_log, dt_bias, slots, S, cs, layer, o, g, onw, blk, tx)

        return kda_decode_conv_fused_norm

    @T.prim_func(private=True)
    def kda_decode_conv_fused(xq_h: T.handle, xk_h: T.handle, xv_h: T.handle, wq_h: T.handle,
                              wk_h: T.handle, wv_h: T.handle, f_h: T.handle, b_h: T.handle,
                              alog_h: T.handle, dtb_h: T.handle, slots_h: T.handle,
                              state_h: T.handle, conv_h: T.handle, layer: T.int32, o_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64()
        xq, xk, xv, wq, wk, wv, f, bb, A_log, dt_bias, slots, S, cs = buffers(
            n_seq, n_layer, n_slot, (xq_h, xk_h, xv_h, wq_h, wk_h, wv_h, f_h, b_h, alog_h, dtb_h, slots_h,
                                     state_h, conv_h))
        o = T.match_buffer(o_h, (n_seq, H, V), "float32")
        for blk in T.thread_binding(n_seq * H, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                bounded_step(xq, xk, xv, wq, wk, wv, f, bb, A_log, dt_bias, slots, S, cs, layer, o, None, None, blk,
                             tx)

    return kda_decode_conv_fused


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def kda_verify_fused_kernel(H: int, K: int, V: int, lower_bound: float | None, tokens: int,
                            cols_per_block: int | None = None, k_split: int | None = None,
                            vec: int | None = None):
    """Build the fused multi-token step for speculative verification (CUDA only): ``tokens``
    consecutive tokens of each sequence through the decode step of
    :func:`kda_decode_fused_kernel`, the state read once and kept in registers between tokens,
    keeping the intermediate states needed to roll back.

    Rollback: the first token of a verify step is the last committed one (EAGLE-style
    draft/verify), so a step accepts ``a`` tokens with ``1 <= a <= tokens``; the KDA state of
    batch row ``i`` is then ``states[i, a-1]`` for ``a < tokens`` (copy it into the sequence's
    slot) and the pool slot as written for ``a = tokens``. The state before the step is not
    kept (``a = 0`` cannot be undone), and the short convolution's ``conv_state`` is the caller's
    to keep. The kept states cost ``tokens - 1`` states per KDA layer and sequence (3 × 6 MiB
    at 96 heads and 4 tokens). Mapping as the decode kernel's; ``cols_per_block`` /
    ``k_split`` / ``vec`` default to :func:`decode_tiling` (the model's) when none is given;
    with ``cols_per_block`` and ``k_split`` given, ``vec`` defaults to 1. The state bytes moved are one
    read and ``tokens`` writes (``tokens - 1`` of them to ``states``).

    PrimFunc arguments (in order)::

        q, k      [B, T, H, K]        float32   (T = ``tokens``)
        v         [B, T, H, V]        float32
        f         [B, T, H, K]        float32
        b         [B, T, H]           float32
        A_log     [H]                 float32
        dt_bias   [H*K]               float32
        seq_slots [B]                 int32
        kda_state [L, S, H, K, V]     float32   in place: the state after all T tokens
        layer     int32
        o         [B, T, H, V]        float32   output of every token
        states    [B, T-1, H, K, V]   float32   the state after token t, for t < T - 1

    Reference: :func:`kda_verify_fused_reference` (the decode reference token by token).

    Raises:
        ValueError: ``tokens < 2`` (one token is :func:`kda_decode_fused_kernel`), a tiling
            the decode kernel rejects (or none fits ``K`` when not given), or
            ``cols_per_block`` / ``k_split`` not given together (``vec`` without both
            included).
    """
    if tokens < 2:
        raise ValueError(f"tokens must be at least 2 (one token is the decode kernel), got {tokens}")
    if cols_per_block is None or k_split is None:
        if cols_per_block is not None or k_split is not None or vec is not None:
            raise ValueError("give cols_per_block and k_split (and optionally vec) together, or none "
                             "of them for the model's tiling")
        tiling = decode_tiling(K)
        if tiling is None:
            raise ValueError(f"no decode tiling fits head_dim {K}")
        cols_per_block, k_split, vec = tiling
    vec = 1 if vec is None else vec
    CB, KS, VEC, TV = cols_per_block, k_split, vec, tokens
    _, NT, NCB, KR, row, column = _geometry(K, V, CB, KS, VEC)
    stage, norms, update, output, load = _step_macros(K, V, lower_bound, CB, KS, VEC)

    @T.prim_func(private=True)
    def kda_verify_fused(q_h: T.handle, k_h: T.handle, v_h: T.handle, f_h: T.handle,
                         b_h: T.handle, alog_h: T.handle, dtb_h: T.handle, slots_h: T.handle,
                         state_h: T.handle, layer: T.int32, o_h: T.handle, states_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (n_seq, TV, H, K), "float32")
        k = T.match_buffer(k_h, (n_seq, TV, H, K), "float32")
        v = T.match_buffer(v_h, (n_seq, TV, H, V), "float32")
        f = T.match_buffer(f_h, (n_seq, TV, H, K), "float32")
        bb = T.match_buffer(b_h, (n_seq, TV, H), "float32")
        A_log = T.match_buffer(alog_h, (H,), "float32")
        dt_bias = T.match_buffer(dtb_h, (H * K,), "float32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
        o = T.match_buffer(o_h, (n_seq, TV, H, V), "float32")
        states = T.match_buffer(states_h, (n_seq, TV - 1, H, K, V), "float32")
        for blk in T.thread_binding(n_seq * (H * NCB), thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                q_s = T.alloc_buffer((K,), "float32", scope="shared")
                k_s = T.alloc_buffer((K,), "float32", scope="shared")
                d_s = T.alloc_buffer((K,), "float32", scope="shared")
                part = T.alloc_buffer((KS, CB), "float32", scope="shared")
                nrm = T.alloc_buffer((NT // 32, 2), "float32", scope="shared")
                col = T.alloc_buffer((KR * VEC,), "float32", scope="local")
                red = T.alloc_buffer((2 + 2 * VEC,), "float32", scope="local")
                bi = blk // (H * NCB)
                h = blk % (H * NCB) // NCB
                slot = slots[bi]
                # the state once, then the tokens in order with the state in registers; shared
                # buffers are reused per token: q_s / k_s / d_s / nrm are last read before the
                # previous token's update / output barriers, part before this token's norms
                # barrier
                load(col, S, lambda i, j: (layer, slot, h, row(tx, i), column(blk, tx, j)))
                for t in range(TV):
                    stage(q_s, k_s, d_s, red, lambda r: q[bi, t, h, r], lambda r: k[bi, t, h, r],
                          lambda r: f[bi, t, h, r], A_log, dt_bias, h, tx)
                    norms(nrm, red, tx)
                    if t < TV - 1:
                        update(col, q_s, k_s, d_s, part, red, bb[bi, t, h],
                               lambda j: v[bi, t, h, column(blk, tx, j)], states,
                               lambda i, j: (bi, t, h, row(tx, i), column(blk, tx, j)), tx)
                    else:
                        update(col, q_s, k_s, d_s, part, red, bb[bi, t, h],
                               lambda j: v[bi, t, h, column(blk, tx, j)], S,
                               lambda i, j: (layer, slot, h, row(tx, i), column(blk, tx, j)), tx)
                    output(part, red, o, lambda j: (bi, t, h, column(blk, tx, j)), tx)

    return kda_verify_fused


def kda_verify_fused_reference(q, k, v, f, b, A_log, dt_bias, seq_slots, kda_state, layer,
                               lower_bound):
    """NumPy reference of :func:`kda_verify_fused_kernel`: :func:`kda_decode_fused_reference`
    token by token; updates ``kda_state`` and returns ``(o [B, T, H, V], states [B, T-1, H, K,
    V])`` float32 (the state after each token but the last).

    Raises:
        ValueError: fewer than 2 tokens (before touching ``kda_state``).
    """
    B, TV = q.shape[:2]
    if TV < 2:
        raise ValueError(f"verify takes at least 2 tokens per sequence, got {TV}")
    o, states = [], []
    for t in range(TV):
        o.append(kda_decode_fused_reference(q[:, t], k[:, t], v[:, t], f[:, t], b[:, t], A_log, dt_bias,
                                            seq_slots, kda_state, layer, lower_bound))
        if t < TV - 1:
            states.append(kda_state[layer, seq_slots].copy())
    return np.stack(o, 1), np.stack(states, 1).astype(np.float32)


# from this many KDA heads the model's conv-fused decode leaves step 6's head norm and gate to
# the separate kernel (kda_decode_conv_dispatch)
NORM_INSIDE_BELOW_HEADS = 48


def kda_decode_conv_dispatch(num_heads: int, head_dim: int) -> tuple[int, int, bool] | None:
    """The model's choice for the conv-fused decode: ``(k_split, vec, norm_inside)``, or None
    where no tiling fits ``head_dim`` (:func:`decode_conv_tiling`).

    ``norm_inside`` (step 6's head norm and gate in the kernel, ``out_norm_eps``) below
    :data:`NORM_INSIDE_BELOW_HEADS` heads, with (4, 2): on the H200 at 12 heads 5.0 / 10.7 / 35.0
    µs at batch 1 / 16 / 64 against 7.6 / 13.7 / 37.3 for the kernel without it followed by the
    two kernels the GPU pipeline makes of those ops (the norm's, in f32, and the cast to bf16);
    at 96 heads that chain is faster from batch 16 (63.8 / 228.5 against 64.7–76.8 /
    230.3–294.0 µs for every tiling tried: the kernel's tail grows by two barriers and a block
    reduction), so there (8, 2) without it
    (benchmarks/results/kda_decode_conv_norm_cast_h200_2026-12-02.json)."""
    tiling = decode_conv_tiling(head_dim)
    if tiling is None:
        return None
    if num_heads < NORM_INSIDE_BELOW_HEADS:
        try:
            _check_tiling(head_dim, head_dim, head_dim, 4, 2)
            return 4, 2, True
        except ValueError:
            pass
    return (*tiling, False)


def decode_conv_tiling(head_dim: int) -> tuple[int, int] | None:
    """The (k_split, vec) of :func:`kda_decode_conv_fused_kernel` the model uses for
    ``head_dim`` (one block a head: ``head_dim / vec × k_split`` threads), or None if none of
    its candidates fits. (8, 2) — at head_dim 128, 512 threads of 16 rows × 2 columns — was the fastest of (4, 2),
    (8, 4), (8, 2) at K3's shapes on the H200 but for 12 heads at batch 16, where (4, 2) was
    0.4% faster (benchmarks/results/kda_decode_conv_h200_2026-12-02.json)."""
    for ks, vec in ((8, 2), (4, 2), (4, 1), (2, 1), (1, 1)):
        try:
            _check_tiling(head_dim, head_dim, head_dim, ks, vec)
        except ValueError:
            continue
        return ks, vec
    return None


def decode_tiling(head_dim: int) -> tuple[int, int, int] | None:
    """The (cols_per_block, k_split, vec) the model uses for ``head_dim``, or None if none of
    its four candidates fits (``head_dim`` a multiple of the columns and of the threads).

    (64, 4, 2) — 64 columns a block, 4 row splits, 2 adjacent columns per thread loaded and
    stored as one 8-byte access — was fastest at K3's shapes on the H200 with 96 heads at batch
    16 and 64 and with 12 heads at batch 64 (benchmarks/results/kda_decode_vec_h200_2026-12-02.json
    and the runs beside it, GPU time with the state cold in HBM: 89–90% / 94% of the HBM roofline
    for 96 heads, 82–84% for 12 heads at batch 64, where (64, 2, 1) reached 86–87% / 91–92% /
    79–80%); with 12 heads at batch 16, (32, 4, 1) is up to 3% faster, within the run-to-run spread.
    """
    for cb, ks, vec in ((64, 4, 2), (64, 2, 1), (32, 4, 1), (32, 1, 1)):
        if head_dim % cb == 0 and head_dim % (cb // vec * ks) == 0:
            return cb, ks, vec
    return None


def kda_decode_conv_fused_reference(xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias, seq_slots,
                                    kda_state, conv_state, layer, lower_bound, g=None, o_norm_w=None,
                                    out_norm_eps=None):
    """NumPy reference of :func:`kda_decode_conv_fused_kernel`: the generic short convolution's
    reference (:func:`schedules.kda_generic.short_conv_reference`, one token per sequence) for
    q, k and v, then :func:`kda_decode_fused_reference`, then with ``out_norm_eps`` step 6's
    head norm and gate ``o / sqrt(mean(o²) + eps) · o_norm_w · σ(g)``. Updates ``kda_state``
    and ``conv_state`` in place; shapes as in the kernel; returns ``o [B, H, K]`` float32."""
    from schedules.kda_generic import short_conv_reference

    B, H = np.asarray(b).shape
    K = np.asarray(xq).shape[1] // H
    cu_seqlens = np.arange(B + 1, dtype=np.int32)
    ys = []
    for which, (x, w) in enumerate(((xq, wq), (xk, wk), (xv, wv))):
        y, new_state = short_conv_reference(x, w, cu_seqlens, seq_slots, conv_state, layer, which)
        conv_state[...] = new_state
        ys.append(y.reshape(B, H, K))
    o = kda_decode_fused_reference(*ys, f, b, A_log, dt_bias, seq_slots, kda_state, layer, lower_bound)
    if out_norm_eps is None:
        return o
    o = o.astype(np.float64)
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + out_norm_eps) * np.asarray(o_norm_w, np.float64)
    gate = 1 / (1 + np.exp(-np.asarray(g, np.float64).reshape(B, H, K)))
    return (o * gate).astype(np.float32)


def kda_decode_fused_reference(q, k, v, f, b, A_log, dt_bias, seq_slots, kda_state, layer,
                               lower_bound):
    """NumPy float64 reference of :func:`kda_decode_fused_kernel`; updates ``kda_state``.

    Shapes as in the kernel; returns ``o [B, H, V]`` float32.
    """
    B, H, K = q.shape
    o = np.zeros(v.shape, np.float32)
    for bi in range(B):
        for h in range(H):
            S = kda_state[layer, seq_slots[bi], h].astype(np.float64)
            qh = q[bi, h].astype(np.float64)
            kh = k[bi, h].astype(np.float64)
            qh = qh / np.sqrt((qh * qh).sum() + 1e-6) * K ** -0.5
            kh = kh / np.sqrt((kh * kh).sum() + 1e-6)
            z = f[bi, h].astype(np.float64) + dt_bias[h * K:(h + 1) * K]
            a = np.exp(float(A_log[h]))
            if lower_bound is not None:
                g = lower_bound / (1 + np.exp(-a * z))
            else:
                g = -a * np.log1p(np.exp(z))
            beta = 1 / (1 + np.exp(-float(b[bi, h])))
            S = np.exp(g)[:, None] * S
            u = beta * (v[bi, h] - S.T @ kh)
            S = S + np.outer(kh, u)
            o[bi, h] = S.T @ qh
            kda_state[layer, seq_slots[bi], h] = S
    return o
