"""Fused one-kernel KDA chunked prefill (schedules/kda_prefill_fused.py): its serial emulation
(same loop nests and index maps, each mma replaced by the dot products it computes for the
lane, every warp-synchronous step its own loop over threads; compiled for llvm) vs the NumPy
reference ``kda_prefill_reference`` (itself checked against fla's naive chunked / recurrent
KDA in tests/test_kda_prefill_cuda.py), on ragged batches with partial chunks, with and without
an initial state; its argument checks; that it compiles to an sm_90a fatbin with the PTX it
relies on; and the model's dispatch of it. The fragment layouts, the TF32 rounding and the
cp.async copies run on the H200 in benchmarks/kda.py (results:
benchmarks/results/kda_prefill_fused_checks_h200_2026-11-30.json, lengths 1 … 8192)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from helpers_tvm import build_sm90a_fatbin, nano_kda_prefill_vs_generic, needs_nvcc
from schedules.kda_prefill_cuda import kda_prefill_reference
from schedules.kda_prefill_fused import (
    kda_prefill_fused_kernel,
    kda_prefill_split_intra_kernel,
    kda_prefill_split_kernel,
    kda_prefill_split_state_kernel,
    split_block_v,
)
from tests.test_config import REAL, real_only
from tests.test_kda_prefill_cuda import _inputs


@functools.cache   # the kernel builders are cached too: one LLVM build per emulated kernel
def _llvm(f):
    """The emulated PrimFunc ``f`` compiled for llvm (its function named ``f``)."""
    import tvm

    return tvm.compile(tvm.IRModule({"f": f.with_attr("global_symbol", "f")}), target="llvm")


def _split_scratch(Tn, B, H, K=128):
    """The split form's scratch in the intra kernel's output order — ka, qa, kd [Tn, H, K], gl
    [Tn // 64 + B, H, K], la [Tn, H, 64], dinv [Tn, H, 16] — NaN-filled (rows nothing writes
    stay NaN)."""
    import tvm

    return tuple(tvm.runtime.tensor(np.full(shape, np.nan, np.float32)) for shape in
                 ((Tn, H, K), (Tn, H, K), (Tn, H, K), (Tn // 64 + B, H, K), (Tn, H, 64), (Tn, H, 16)))


def _check_outputs(o, pool, o_ref, ref_pool, slots):
    """o and the state pool against the reference; the slot of no sequence and the other layer
    untouched."""
    assert not np.isnan(o).any()
    np.testing.assert_allclose(o, o_ref, atol=1e-5)
    np.testing.assert_allclose(pool, ref_pool, atol=1e-5)
    untouched = np.ones(pool.shape[:2], bool)
    untouched[1, slots] = False
    np.testing.assert_array_equal(pool[untouched], ref_pool[untouched])


@pytest.mark.parametrize("block_v,a_batch,lens,initial_state,p2_pairs,opts", [
    (16, 8, [1, 65, 15, 64], True, False, {}),
    (64, 4, [63, 129], False, False, {}),
    (128, 8, [129, 1], True, False, {}),
    (32, 8, [1, 65, 15, 64], True, True, {}),
    # p2_wide: phase 2's rounds as pairs of n-tiles per warp (each A fragment loaded once for two);
    # v_async: phase 3's v rows staged in the vn region, R formed in place
    (32, 8, [1, 65, 15, 64, 130], True, True, {"p2_wide": True, "v_async": True}),
    # p2_one: phase 2 in one round (every row's ka / qa at its own sub-block's reference), at both
    # tilings the model dispatches (at 64 columns the 64 staged ka rows fill the ka / qa region)
    # (o_vec: o stored by column pairs, one bounds test per row half)
    (128, 4, [1, 65, 15, 64, 130], True, False, {"p2_one": True, "v_async": True, "o_vec": True}),
    (64, 8, [63, 129], False, False, {"p2_one": True, "v_async": True}),
    # p3_wg: the S copy in the wgmma's 128-byte swizzled K-major tiles (32 columns of K each),
    # at 128 columns (16 KiB per tile) and at 16 (two 8-row groups); p5_wg: vn in the q region in
    # the same layout (32 rows of the chunk per tile)
    (128, 4, [1, 70], True, False, {"p2_one": True, "v_async": True, "o_vec": True, "p3_wg": True, "p5_wg": True}),
    (16, 8, [70], True, False, {"p3_wg": True, "p5_wg": True}),
])
def test_emulated_fused_kernel_matches_reference(block_v, a_batch, lens, initial_state, p2_pairs, opts):
    import tvm

    H, K = 2, 128
    q, k, v, g, beta, cu, slots, pool = _inputs(lens, H, seed=block_v)
    if not initial_state:
        pool[:] = 0
    ref_pool = pool.copy()
    o_ref = kda_prefill_reference(q, k, v, g, beta, cu, slots, ref_pool, 1, K ** -0.5)
    f = kda_prefill_fused_kernel(H, K, K, K ** -0.5, block_v=block_v, a_batch=a_batch,
                                 p2_pairs=p2_pairs, emulate=True, **opts)
    lib = _llvm(f)
    A = tvm.runtime.tensor
    pt, o = A(pool), A(np.full(v.shape, np.nan, np.float32))
    lib["f"](A(q), A(k), A(v), A(g), A(beta), A(cu), A(slots), pt, 1, o)
    _check_outputs(o.numpy(), pt.numpy(), o_ref, ref_pool, slots)


@pytest.mark.parametrize("block_v,lens,initial_state,preprocess,opts", [
    (16, [1, 65, 15, 64, 130], True, False, {}),
    (64, [63, 129], False, False, {}),
    (32, [1, 70, 64], True, True, {}),
    # the intra kernel's phase 2 by pairs of n-tiles and its gate's σ by a reciprocal
    (16, [65, 15, 64], True, True, {"p2_wide": True, "fast_gate": True}),
    (16, [65, 15, 64], True, True, {"p2_one": True, "fast_gate": True, "o_vec": True}),
    # tmat: T = (I + L)^{-1}'s blocks below the diagonal by the intra kernel, phase 4 as vn = T R,
    # at each of its warp layouts (4, 2 and 1 warps per n-tile of vn at 16, 32 and 64 columns)
    (16, [65, 15, 64], True, True, {"p2_one": True, "fast_gate": True, "o_vec": True, "tmat": True}),
    (32, [1, 70, 64], True, False, {"tmat": True}),
    (64, [63, 129], False, False, {"p2_one": True, "tmat": True}),
    # pipe: the next chunk's staged operands copied into a second set of regions during this one
    (16, [65, 15, 64, 130], True, True, {"p2_one": True, "fast_gate": True, "o_vec": True, "tmat": True,
                                         "pipe": True}),
    (32, [1, 70, 200], True, False, {"tmat": True, "pipe": True}),
    # v_early: the next chunk's v rows copied into the R region at phase 5
    (16, [65, 15, 64, 130], True, True, {"p2_one": True, "fast_gate": True, "o_vec": True, "tmat": True,
                                         "pipe": True, "v_early": True}),
    (32, [1, 70, 200], True, False, {"tmat": True, "pipe": True, "v_early": True}),
])
def test_emulated_split_form_matches_reference(block_v, lens, initial_state, preprocess, opts):
    """The split form: every chunk's Γ-scaled operands, L / Aqk and D^{-1} by the intra kernel
    (with ``preprocess`` also the L2 norms, gate and β), then phases 3-5 per chunk."""
    import tvm

    H, K = 2, 128
    if preprocess:
        raw, pre, cu, slots, pool = _raw_inputs(lens, H, seed=5)
        q, k, v, g, beta = (pre[n].astype(np.float32) for n in ("q", "k", "v", "g", "beta"))
    else:
        q, k, v, g, beta, cu, slots, pool = _inputs(lens, H, seed=block_v + 1)
    if not initial_state:
        pool[:] = 0
    ref_pool = pool.copy()
    o_ref = kda_prefill_reference(q, k, v, g, beta, cu, slots, ref_pool, 1, K ** -0.5)
    lb = -5.0 if preprocess else None
    intra = _llvm(kda_prefill_split_intra_kernel(H, K, K ** -0.5, lower_bound=lb, emulate=True,
                                                 p2_wide=opts.get("p2_wide", False),
                                                 p2_one=opts.get("p2_one", False),
                                                 fast_gate=opts.get("fast_gate", False),
                                                 tmat=opts.get("tmat", False)))
    state = _llvm(kda_prefill_fused_kernel(H, K, K, K ** -0.5, block_v=block_v, a_batch=8, split=True,
                                           lower_bound=lb, o_vec=opts.get("o_vec", False),
                                           tmat=opts.get("tmat", False), pipe=opts.get("pipe", False),
                                           v_early=opts.get("v_early", False), emulate=True))
    A = tvm.runtime.tensor
    B = len(lens)
    ka, qa, kd, gl, la, dinv = _split_scratch(q.shape[0], B, H)
    if preprocess:
        ins = [A(raw[n]) for n in ("q", "k", "f", "b", "A_log", "dt_bias")]
    else:
        ins = [A(q), A(k), A(g), A(beta)]
    intra["f"](*ins, A(cu), ka, qa, kd, gl, la, dinv)
    # the Γ-scaled operands against NumPy (Γ = cumsum of g within each chunk)
    chunks = [(c, min(c + 64, cu[b + 1])) for b in range(B) for c in range(cu[b], cu[b + 1], 64)]
    gam = np.concatenate([np.cumsum(g[a:e].astype(np.float64), axis=0) for a, e in chunks])
    last = np.concatenate([np.repeat(gam[e - 1 - cu[0]:e - cu[0]], e - a, axis=0) for a, e in chunks])
    np.testing.assert_allclose(ka.numpy(), k * np.exp(gam), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(qa.numpy(), K ** -0.5 * q * np.exp(gam), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(kd.numpy(), k * np.exp(last - gam), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gl.numpy()[:len(chunks)], np.exp(gam[[e - 1 for _, e in chunks]]), rtol=1e-4, atol=1e-30)
    assert not np.isnan(la.numpy()).any() and not np.isnan(dinv.numpy()).any()
    if opts.get("tmat"):   # T's blocks below the diagonal = those of NumPy's inverse of I + L
        _check_t_blocks(la.numpy(), chunks, cu[0], k, beta, gam)
    pt, o = A(pool), A(np.full(v.shape, np.nan, np.float32))
    state["f"](ka, qa, kd, A(v), gl, la, dinv, A(raw["b"] if preprocess else beta), A(cu), A(slots), pt, 1, o)
    _check_outputs(o.numpy(), pt.numpy(), o_ref, ref_pool, slots)


def _t_matrix(kk, gg, bb):
    """T = (I + L)^{-1} of one chunk in float64, L[i][j] = β_i (k_i e^{Γ_i − Γ_j}) · k_j for j < i
    (the WY form's strictly lower triangle, spec §3); kk, gg [n, K], bb [n]."""
    n = len(kk)
    L = np.zeros((n, n))
    for i in range(n):
        for j in range(i):
            L[i, j] = bb[i] * np.dot(kk[i] * np.exp(gg[i] - gg[j]), kk[j])
    return np.linalg.inv(np.eye(n) + L)


def _check_t_blocks(la, chunks, t0, k, beta, gam):
    """``tmat``: in each chunk (rows a … e−1), la[i][j] for j // 16 > i // 16 holds T[j][i] of
    the chunk's T (``_t_matrix``, head 0)."""
    for a, e in chunks:
        n = e - a
        Tm = _t_matrix(k[a - t0:e - t0, 0].astype(np.float64), gam[a - t0:e - t0, 0],
                       beta[a - t0:e - t0, 0].astype(np.float64))
        blk = np.arange(n)[None, :] // 16 > np.arange(n)[:, None] // 16   # [i][j]: block of j right of i's
        np.testing.assert_allclose(la[a - t0:e - t0, 0, :n][blk], Tm.T[blk], rtol=2e-3, atol=2e-5)


def test_split_block_v_by_sequences():
    # 12 heads (K3 at tensor parallel 8): one long prompt 16 columns, 2-3 sequences 32, 4+ 64
    assert [split_block_v(b, 12) for b in (1, 2, 3, 4, 9)] == [16, 32, 32, 64, 64]
    assert [split_block_v(b, 2) for b in (1, 11, 12, 23, 24)] == [16, 16, 32, 32, 64]
    # the kernel's host-side thresholds give the same choice, for any head count
    from schedules.kda_prefill_fused import SPLIT_BLOCK_V, _first_n_seq

    for H in (1, 2, 12, 24, 47, 48, 96):
        n_wide, n_mid = (_first_n_seq(bv, H, 128) for bv in SPLIT_BLOCK_V[:2])
        for b in range(1, 40):
            assert split_block_v(b, H) == (64 if b >= n_wide else 32 if b >= n_mid else 16), (H, b)


@pytest.mark.parametrize("lens,early_kq,form", [([70], False, ""), ([5] * 11 + [66], False, ""),
                                                ([3] * 23 + [65], False, ""), ([130, 1, 64, 70], True, ""),
                                                ([70], True, "tmat"), ([5] * 11 + [66], True, "tmat"),
                                                ([3] * 23 + [65], True, "tmat"),
                                                # a sequence of no tokens: its state written back unchanged
                                                ([65, 0, 3], True, "tmat")])
def test_emulated_split_state_kernel_with_runtime_block_v_matches_reference(lens, early_kq, form):
    """kda_prefill_split_state_kernel at 2 heads runs block_v 16, 32, 64 for 1, 12, 24 sequences
    (``split_block_v``); each branch against the reference; with ``early_kq`` (the next chunk's
    e^Γ k, e^Γ q copied during phase 4) and o by column pairs (``o_vec``) as the model
    dispatches it."""
    import tvm

    H, K = 2, 128
    q, k, v, g, beta, cu, slots, pool = _inputs(lens, H, seed=len(lens))
    ref_pool = pool.copy()
    o_ref = kda_prefill_reference(q, k, v, g, beta, cu, slots, ref_pool, 1, K ** -0.5)
    tmat = form == "tmat"
    intra = _llvm(kda_prefill_split_intra_kernel(H, K, K ** -0.5, tmat=tmat, emulate=True))
    # with tmat also pipe and v_early, as dispatched (at block_v 16 and 32; 64 has no room for
    # pipe's second set of regions)
    state = _llvm(kda_prefill_split_state_kernel(H, K, K, K ** -0.5, early_kq=early_kq, o_vec=True, tmat=tmat,
                                                 pipe=tmat, v_early=tmat, emulate=True))
    A = tvm.runtime.tensor
    ka, qa, kd, gl, la, dinv = _split_scratch(q.shape[0], len(lens), H)
    intra["f"](A(q), A(k), A(g), A(beta), A(cu), ka, qa, kd, gl, la, dinv)
    pt, o = A(pool), A(np.full(v.shape, np.nan, np.float32))
    state["f"](ka, qa, kd, A(v), gl, la, dinv, A(beta), A(cu), A(slots), pt, 1, o)
    _check_outputs(o.numpy(), pt.numpy(), o_ref, ref_pool, slots)


@pytest.mark.parametrize("lens,p3_wg", [([70], False), ([200], False), ([130, 1, 64, 70], False),
                                        ([70, 1], True)])
def test_emulated_split_kernel_matches_reference(lens, p3_wg):
    """kda_prefill_split_kernel as the model dispatches it (raw inputs: L2 norms, gate and β in
    the kernel) against the reference: one sequence through the overlapped kernel's code (its
    items, the state loop at 32 columns, every item's flag set, each block's ticket taken once),
    several through the intra kernel and the state kernel of their block_v. Run serially, block 0
    does every item before any state loop: the interleaving itself runs on the GPU only
    (benchmarks/kda.py checks), the wait's contract is tested below. ``p3_wg``: the state kernels'
    S copy in the swizzled layout of the wgmma's B operand."""
    import tvm

    H, K = 2, 128
    raw, pre, cu, slots, pool = _raw_inputs(lens, H, seed=len(lens) + lens[0])
    ref_pool = pool.copy()
    o_ref = kda_prefill_reference(pre["q"], pre["k"], pre["v"], pre["g"], pre["beta"], cu, slots,
                                  ref_pool, 1, K ** -0.5)
    lib = _llvm(kda_prefill_split_kernel(H, K, K, K ** -0.5, lower_bound=-5.0, p3_wg=p3_wg, emulate=True))
    A = tvm.runtime.tensor
    Tn, B = sum(lens), len(lens)
    n_items = ((Tn + 63) // 64 + B) * H
    flags = A(np.zeros(2 + n_items, np.int32))
    pt, o = A(pool), A(np.full(raw["v"].shape, np.nan, np.float32))
    lib["f"](*(A(raw[n]) for n in ("q", "k", "f", "b", "A_log", "dt_bias")), A(cu), A(slots), A(raw["v"]), pt,
             flags, 1, *_split_scratch(Tn, B, H), o)
    _check_outputs(o.numpy(), pt.numpy(), o_ref, ref_pool, slots)
    fl = flags.numpy()
    if B == 1:   # 132 tickets; the items claimed, then one failed claim per block
        assert fl[0] == 132 and fl[1] == n_items + 132 and (fl[2:] == 1).all()
    else:        # the two kernels: no flag touched
        assert not fl.any()
    with pytest.raises(ValueError, match="lead=101"):
        kda_prefill_split_kernel(H, K, K, K ** -0.5, lead=101, emulate=True)
    with pytest.raises(Exception, match="flags needs 2 "):   # a host-side check, before any kernel
        lib["f"](*(A(raw[n]) for n in ("q", "k", "f", "b", "A_log", "dt_bias")), A(cu), A(slots), A(raw["v"]), pt,
                 A(np.zeros(1 + n_items, np.int32)), 1, *_split_scratch(Tn, B, H), o)


def test_emulated_flag_wait_covers_every_chunk_up_to_the_one_needed():
    """The overlapped form's wait (``_flag_macros``' ``wait_upto``, emulated; the CUDA function
    loops over the same chunks): chunks known + 1 … need must all be flagged — a state block's
    first wait covers chunk 0 as well as chunk 1 — and the chunks known to be written are not read."""
    import tvm
    from tvm.script import tirx as T

    from schedules.kda_prefill_fused import _flag_macros

    H = 3
    wait_upto = _flag_macros(True, H)[4]

    @T.prim_func
    def f(flags: T.Buffer((2 + 4 * H,), "int32"), out: T.Buffer((1,), "int32"), known: T.int32, need: T.int32):
        rdy = T.alloc_buffer((1, 1), "int32")
        rdy[0, 0] = known
        wait_upto(flags, rdy, 0, 1, need, 4)   # head 1: chunk i's flag at 2 + 1 + 3i
        out[0] = rdy[0, 0]

    lib = tvm.compile(tvm.IRModule({"f": f}), target="llvm")
    fl = np.zeros(2 + 4 * H, np.int32)
    fl[2 + 1 + H * 1] = 1   # chunk 1 written, chunk 0 not
    out = tvm.runtime.tensor(np.zeros(1, np.int32))
    with pytest.raises(Exception, match="staged before its intra item"):
        lib["f"](tvm.runtime.tensor(fl), out, -1, 1)
    lib["f"](tvm.runtime.tensor(fl), out, 0, 1)   # chunk 0 known written: only chunk 1 read
    assert out.numpy()[0] == 1
    fl[2 + 1] = 1
    lib["f"](tvm.runtime.tensor(fl), out, -1, 1)
    assert out.numpy()[0] == 1
    lib["f"](tvm.runtime.tensor(fl), out, 1, 1)   # nothing to wait for: unchanged
    assert out.numpy()[0] == 1


def _raw_inputs(lens, H, K=128, seed=0):
    """Inputs before the L2 norms, gate and β (spec §3 steps 2-4), and the preprocessed ones."""
    rng = np.random.default_rng(seed)
    Tn, B = sum(lens), len(lens)
    raw = {"q": rng.standard_normal((Tn, H, K)) * 3, "k": rng.standard_normal((Tn, H, K)) * 0.5,
           "v": rng.standard_normal((Tn, H, K)), "f": rng.standard_normal((Tn, H, K)),
           "b": rng.standard_normal((Tn, H)), "A_log": np.log(rng.uniform(1, 16, H)),
           "dt_bias": rng.standard_normal(H * K) * 0.5}
    raw = {n: a.astype(np.float32) for n, a in raw.items()}
    l2 = lambda x: x / np.sqrt((x.astype(np.float64) ** 2).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    z = np.exp(raw["A_log"].astype(np.float64))[None, :, None] * (raw["f"] + raw["dt_bias"].reshape(1, H, K))
    pre = {"q": l2(raw["q"]), "k": l2(raw["k"]), "v": raw["v"], "g": -5.0 / (1 + np.exp(-z)),
           "beta": 1 / (1 + np.exp(-raw["b"].astype(np.float64)))}
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = np.arange(B, dtype=np.int32)[::-1].copy()
    pool = (rng.standard_normal((2, B + 1, H, K, K)) * 0.1).astype(np.float32)
    return raw, pre, cu, slots, pool


@pytest.mark.parametrize("fast_gate", [False, True])
def test_emulated_fused_kernel_with_preprocessing_matches_reference(fast_gate):
    """lower_bound mode: L2 norms of q and k, the gate and β inside the kernel (``fast_gate``:
    the gate's σ by a reciprocal, rows past the end masked by a select after it), with phase 2
    and the v / o copies as the model dispatches them (``p2_one``, ``v_async``, ``o_vec``)."""
    import tvm

    H, K = 2, 128
    raw, pre, cu, slots, pool = _raw_inputs([1, 15, 64, 70], H, seed=5)
    ref_pool = pool.copy()
    o_ref = kda_prefill_reference(pre["q"], pre["k"], pre["v"], pre["g"], pre["beta"], cu, slots,
                                  ref_pool, 1, K ** -0.5)
    f = kda_prefill_fused_kernel(H, K, K, K ** -0.5, block_v=32, lower_bound=-5.0, fast_gate=fast_gate, p2_one=True,
                                 v_async=True, o_vec=True, emulate=True)
    lib = _llvm(f)
    A = tvm.runtime.tensor
    pt, o = A(pool), A(np.full(raw["v"].shape, np.nan, np.float32))
    lib["f"](*(A(raw[n]) for n in ("q", "k", "v", "f", "b", "A_log", "dt_bias")), A(cu), A(slots), pt, 1, o)
    assert not np.isnan(o.numpy()).any()
    np.testing.assert_allclose(o.numpy(), o_ref, atol=1e-5)
    np.testing.assert_allclose(pt.numpy(), ref_pool, atol=1e-5)


def test_ldsm_rows_give_the_tf32_b_fragments():
    """``ldsm_b_row`` (the ``ldsm`` option's ldmatrix.x4 row addresses) replayed lane by lane:
    matrix m of ldmatrix.x4 takes its 8 row addresses from lanes 8m … 8m+7 and gives thread t
    the 32-bit word t % 4 of its row t // 4; the four registers must be the mma's B fragment
    (b0 = B[k0 + tg, n0 + gr], b1 = B[k0 + tg + 4, n0 + gr]) of n-tiles n0 and n0 + 8, for a
    column-major B (PTX ISA: ldmatrix, and the m16n8k8 .tf32 fragment layout)."""
    from schedules.kda_prefill_fused import ldsm_b_row

    rng = np.random.default_rng(0)
    Bm = rng.standard_normal((40, 40))        # B[k, n]
    colmajor = Bm.T.copy()                    # row n holds B[:, n], k contiguous
    for n0, k0 in ((0, 0), (16, 8), (24, 24)):
        rows = [ldsm_b_row(lane, n0, k0) for lane in range(32)]
        for t in range(32):
            got = []
            for m in range(4):
                n, k = rows[8 * m + t // 4]
                got.append(colmajor[n, k + t % 4])
            gr, tg = t // 4, t % 4
            want = [Bm[k0 + tg, n0 + gr], Bm[k0 + tg + 4, n0 + gr],
                    Bm[k0 + tg, n0 + 8 + gr], Bm[k0 + tg + 4, n0 + 8 + gr]]
            assert got == want, (n0, k0, t)
        # each 16-byte row read starts 16-byte aligned when the row stride is a multiple of 4
        assert all(k % 4 == 0 for _, k in rows)


def test_fused_kernel_rejects_unsupported_sizes():
    with pytest.raises(ValueError, match="K = V = 128"):
        kda_prefill_fused_kernel(2, 64, 64, 0.125)
    with pytest.raises(ValueError, match="block_v=48"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, block_v=48)
    with pytest.raises(ValueError, match="a_batch=3"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, a_batch=3)
    with pytest.raises(ValueError, match="lower_bound=-6"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, lower_bound=-6.0)
    with pytest.raises(ValueError, match="p2_wide widens the rounds of p2_pairs"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, p2_wide=True)
    with pytest.raises(ValueError, match="p2_one replaces the rounds"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, p2_one=True, p2_pairs=True)
    with pytest.raises(ValueError, match="p2_one replaces the rounds"):
        kda_prefill_split_intra_kernel(2, 128, 0.1, p2_one=True, p2_wide=True)
    with pytest.raises(ValueError, match=r"ablate=\['p9'\]"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, ablate=frozenset({"p9"}))
    with pytest.raises(ValueError, match="v_async to the fused kernel"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, split=True, v_async=True)
    with pytest.raises(ValueError, match=r"ablate=\['p2'\].*split state kernel"):   # the state kernel has no phase 2
        kda_prefill_fused_kernel(2, 128, 128, 0.1, split=True, ablate=frozenset({"p2"}))
    with pytest.raises(ValueError, match="tmat, pipe and v_early belong to the split form"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, tmat=True)
    with pytest.raises(ValueError, match=r"tmat: block_v ≤ 64"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, split=True, tmat=True, block_v=128)
    with pytest.raises(ValueError, match="v_early: the split state kernel with tmat and pipe"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, split=True, tmat=True, v_early=True)
    with pytest.raises(ValueError, match="pipe: the split state kernel with tmat at block_v ≤ 32"):
        kda_prefill_fused_kernel(2, 128, 128, 0.1, split=True, tmat=True, pipe=True, block_v=64)


@needs_nvcc
def test_fused_kernel_compiles_to_fatbin_for_sm90a(tmp_path):
    out = build_sm90a_fatbin(
        "from schedules.barriers import respect_manual_barriers\n"
        "from schedules.kda_prefill_fused import kda_prefill_fused_kernel\n"
        "f = kda_prefill_fused_kernel(3, 128, 128, 128 ** -0.5, block_v=128, a_batch=4)\n"
        "p = kda_prefill_fused_kernel(3, 128, 128, 128 ** -0.5, block_v=64, lower_bound=-5.0)\n"
        # as the model dispatches it from 96 heads (and 48-95: block_v 64, a_batch 8)
        "d = kda_prefill_fused_kernel(3, 128, 128, 128 ** -0.5, block_v=128, a_batch=4, p2_one=True, ldsm=True,\n"
        "                             v_async=True, fast_gate=True, o_vec=True, lower_bound=-5.0)\n"
        "e = kda_prefill_fused_kernel(3, 128, 128, 128 ** -0.5, block_v=64, a_batch=8, p2_one=True, ldsm=True,\n"
        "                             v_async=True, fast_gate=True, o_vec=True, lower_bound=-5.0)\n"
        "r = kda_prefill_fused_kernel(3, 128, 128, 128 ** -0.5, block_v=16, p2_pairs=True, ldsm=True)\n"
        # phases 3 and 5 on wgmma, as dispatched on sm_90a from 96 heads
        "w = kda_prefill_fused_kernel(3, 128, 128, 128 ** -0.5, block_v=128, a_batch=4, p2_one=True, ldsm=True,\n"
        "                             v_async=True, fast_gate=True, o_vec=True, lower_bound=-5.0, p3_wg=2, p5_wg=True)\n"
        "from schedules.kda_prefill_fused import kda_prefill_split_kernel\n"
        # the split form as dispatched below 48 heads on sm_90a (phase 3 of its state kernels on wgmma)
        "s = kda_prefill_split_kernel(3, 128, 128, 128 ** -0.5, lower_bound=-5.0, p3_wg=2)\n"
        "mod = tvm.IRModule({n: x.with_attr('global_symbol', n) for n, x in\n"
        "                    (('f', f), ('p', p), ('r', r), ('d', d), ('e', e), ('s', s), ('w', w))})", tmp_path,
        contexts="respect_manual_barriers()", keep_src=True)
    assert "fatbin" in out
    src = "".join(p.read_text() for p in (tmp_path / "src").glob("*.cu"))
    # the split form: the overlapped kernel (one sequence), the intra kernel, then one state kernel
    # per block_v (64, 32, 16) behind the host-side branches
    assert all(f"__global__ void __launch_bounds__(256) s_kernel{n}(" in src for n in ("", "_1", "_2", "_3", "_4"))
    # the overlapped kernel's tickets, claims and flags (release / acquire at GPU scope)
    for ptx in ("atomicAdd(", "st.release.gpu.global.b32", "ld.acquire.gpu.global.b32", "__threadfence()"):
        assert ptx in src, ptx
    assert "__shfl_xor_sync" in src   # the warp-shuffle L2 norms
    for ptx in ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32",
                "ex2.approx.ftz.f32", "cp.async.cg.shared.global", "prefetch.global.L2",
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16"):
        assert ptx in src, ptx
    assert src.count("k3_mma_tf32_raw(") > 10
    # fast_gate: σ by rcp.approx (in d, e and s's intra kernels), no division left in those kernels' gates
    assert "rcp.approx.ftz.f32" in src and src.count("k3_rcp(") >= 3 * 64
    assert src.count("__syncwarp()") == 1   # one device function, called between warp steps
    # o_vec: o as 8-byte column pairs, one store per row half and n-tile (d and w: 2 × 16, e: 2 × 8, the
    # three state bodies of s at 64 / 32 / 16 columns and the overlapped one at 32: 2 × (8 + 4 + 2 +
    # 4)), plus the definition
    assert "make_float2" in src and src.count("k3_st2(") == 2 * (16 + 16 + 8 + 8 + 4 + 2 + 4) + 1
    # p3_wg: 16 wgmmas per warpgroup and chunk (4 groups of a_batch 4), the S copy fenced for them
    # (and with p5_wg vn)
    for ptx in ("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32", "fence.proxy.async.shared::cta",
                "wgmma.wait_group.sync.aligned 0", "trap;"):
        assert ptx in src, ptx
    # (phase 3: one call site per warpgroup's branch) p5_wg: 8 for the S update (one code path for
    # both warpgroups), 8 more in warpgroup 1's branch for o; plus the definition
    assert src.count("k3_wgmma_m64n128k8_tf32_rs(") == 2 * 16 + 8 + 8 + 1
    # s: phase 3 of the state kernels at 64 / 32 / 16 columns and of the overlapped one at 32
    for n, kernels in ((64, 1), (32, 2), (16, 1)):
        assert src.count(f"k3_wgmma_m64n{n}k8_tf32_rs(") == kernels * 2 * 16 + 1, n
    # the tiles the descriptors read are 1024-byte aligned: the fused kernels' and the state kernels'
    # own buffer (f, p, r, d, e, w and s's three; the overlapped kernel's merged buffer is checked at
    # run time by the trap)
    assert src.count("__align__(1024) float SM_ptr[]") == 6 + 3
    # pipe (s at 32 and 16 columns): chunk c waits for all but the group of chunk c + 1's copies
    assert "cp.async.wait_group 1" in src


@pytest.mark.parametrize("rows", [16, 32, 64, 128])
def test_swizzled_tf32_tiles_match_the_wgmma_address_rule(rows):
    """The S copy / vn layout of ``p3_wg`` / ``p5_wg`` (``sw128_tf32_word``) against the address
    a K-major TF32 wgmma computes from its descriptor (PTX ISA, matrix descriptor and 128B swizzle):
    for k8 step s the start address base + 16·``sw128_tf32_kstep(s)``, row n of the step's 8 k at
    (n // 8)·1024 (stride byte offset) + (n % 8)·128, element kk at 4·kk, then address bits 4-6
    XOR bits 7-9. Every element of 128 k × ``rows`` rows lands on its own word of the region."""
    from schedules.wgmma_ptx import DESC_SW128_BITS, sw128_tf32_kstep, sw128_tf32_word

    assert (DESC_SW128_BITS >> 32) & 0x3FFF == 1024 // 16 and DESC_SW128_BITS >> 62 == 1
    base = 7 * 1024
    seen = set()
    for s in range(128 // 8):
        for n in range(rows):
            for kk in range(8):
                addr = base + 16 * sw128_tf32_kstep(s, rows) + n // 8 * 1024 + n % 8 * 128 + 4 * kk
                addr ^= (addr >> 7 & 7) << 4
                word = sw128_tf32_word(8 * s + kk, n, rows)
                assert addr == base + 4 * word, (s, n, kk)
                seen.add(word)
    assert seen == set(range(128 * rows))


def test_model_dispatches_prefill_form_by_head_count():
    import dataclasses

    from k3_compile.config import K3Config
    from relax_modules.kda import FUSED_PREFILL_MIN_HEADS, KimiDeltaAttention

    nano = K3Config.from_file("models/k3-nano")   # 2 KDA heads
    for heads, form, tiling, wg in ((2, "split", None, True), (FUSED_PREFILL_MIN_HEADS - 1, "split", None, True),
                                    (FUSED_PREFILL_MIN_HEADS, "fused", (64, 8), False),
                                    (96, "fused", (128, 4), True)):
        cfg = dataclasses.replace(nano, kda_num_heads=heads)
        layer = KimiDeltaAttention(cfg, "bfloat16", gpu=True)
        assert (layer.prefill_form, layer.prefill_tiling) == (form, tiling), heads
        assert layer.prefill_preprocess_in_kernel and not layer.prefill_wgmma
        # Hopper: wgmma in the split form's state kernels and the fused kernel at 128 columns
        assert KimiDeltaAttention(cfg, "bfloat16", gpu=True, wgmma=True).prefill_wgmma == wg, heads
        # the generic fallback (k3 compile --generic-kernels), CPU builds and fp32 builds
        assert KimiDeltaAttention(cfg, "bfloat16", gpu=True, tuned=False).prefill_form == "generic"
        assert KimiDeltaAttention(cfg, "bfloat16", gpu=False).prefill_form == "generic"
        assert KimiDeltaAttention(cfg, "float32", gpu=True).prefill_form == "generic"


@real_only
def test_k3_dispatches_fused_prefill():
    from k3_compile.config import K3Config
    from relax_modules.kda import KimiDeltaAttention

    layer = KimiDeltaAttention(K3Config.from_file(REAL), "bfloat16", gpu=True)
    assert layer.prefill_form == "fused" and layer.prefill_tiling == (128, 4) and not layer.prefill_wgmma
    # Hopper: phases 3 and 5 on wgmma
    assert KimiDeltaAttention(K3Config.from_file(REAL), "bfloat16", gpu=True, wgmma=True).prefill_wgmma


@pytest.mark.parametrize("form,preprocess,wgmma", [("fused", False, False), ("fused", True, False),
                                                  ("fused", True, True), ("split", False, False),
                                                  ("split", True, False), ("split", True, True)])
def test_model_with_fused_or_split_prefill_matches_generic_model(form, preprocess, wgmma):
    """The model's fused and split prefill paths (relax_modules/kda.py: argument order, scratch
    shapes, in-place state; with ``preprocess`` the kernels' own L2 norms, gate and β; with
    ``wgmma`` the swizzled S copy and (fused) vn of ``p3_wg`` / ``p5_wg``) with the
    kernels emulated on the CPU give k3-nano's logits of the generic model
    (``helpers_tvm.nano_kda_prefill_vs_generic``)."""
    import functools

    def configure(layer):
        layer.prefill_form = form
        layer.prefill_tiling = (16, 8) if form == "fused" else None   # split: block_v at run time
        layer.prefill_preprocess_in_kernel = preprocess
        layer.prefill_wgmma = wgmma

    script, outs, refs = nano_kda_prefill_vs_generic(
        {"kda_prefill_fused_kernel": functools.partial(kda_prefill_fused_kernel, emulate=True),
         "kda_prefill_split_kernel": functools.partial(kda_prefill_split_kernel, emulate=True)},
        configure, seed=1)
    kernel = {"fused": "kda_prefill_fused", "split": "kda_prefill_split"}[form]
    assert kernel in script and (kernel + "_pre" in script) == preprocess
    assert "kda_prefill_state_tc" not in script
    for got, want in zip(outs, refs):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
