"""KDA chunked prefill kernels for CUDA (schedules/kda_prefill_cuda.py): the reference vs fla's
naive chunked / recurrent KDA on odd lengths, the kernels' serial emulation (same loop nest,
compiled for llvm) vs the reference, and that they compile to a fatbin for sm_90a. The kernels
run on the H200 in benchmarks/kda.py (not in CI: no GPU here)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from helpers_tvm import build_sm90a_fatbin, needs_nvcc
from schedules.kda_prefill_cuda import (kda_prefill_intra_kernel, kda_prefill_reference,
                                        kda_prefill_state_kernel, prefill_scratch_shapes)


def _inputs(lens, H, K=128, seed=0):
    rng = np.random.default_rng(seed)
    Tn, B = sum(lens), len(lens)
    l2 = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q = l2(rng.standard_normal((Tn, H, K))).astype(np.float32)
    k = l2(rng.standard_normal((Tn, H, K))).astype(np.float32)
    v = rng.standard_normal((Tn, H, K)).astype(np.float32)
    g = (-5 / (1 + np.exp(-2 * rng.standard_normal((Tn, H, K))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((Tn, H))))).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = np.arange(B, dtype=np.int32)[::-1].copy()
    pool = (rng.standard_normal((2, B + 1, H, K, K)) * 0.1).astype(np.float32)
    return q, k, v, g, beta, cu, slots, pool


def test_reference_matches_fla_naive_chunk():
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

    H, K = 2, 128
    lens = [1, 15, 63, 64, 65, 130]
    q, k, v, g, beta, cu, slots, pool = _inputs(lens, H)
    S0 = pool[1, slots].copy()
    o = kda_prefill_reference(q, k, v, g, beta, cu, slots, pool, 1, K ** -0.5)
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).double()  # noqa: E731
    for b, n in enumerate(lens):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        pad = (-n) % 64  # naive_chunk_kda needs whole chunks: zero k, v, g, β leave S as is
        P = lambda x: torch.nn.functional.pad(t(x[sl]), (0, 0) * (x.ndim - 1) + (0, pad))[None]  # noqa: E731
        oc, Sc = naive_chunk_kda(P(q), P(k), P(v), P(g), P(beta), initial_state=t(S0[b:b + 1]),
                                 output_final_state=True)
        orc, _ = naive_recurrent_kda(t(q[sl])[None], t(k[sl])[None], t(v[sl])[None], t(g[sl])[None],
                                     t(beta[sl])[None], initial_state=t(S0[b:b + 1]))
        np.testing.assert_allclose(o[sl], oc[0, :n].numpy(), atol=2e-5)
        np.testing.assert_allclose(o[sl], orc[0].numpy(), atol=2e-5)
        np.testing.assert_allclose(pool[1, slots[b]], Sc[0].numpy(), atol=2e-5)


@pytest.mark.parametrize("block_v", [16, 32])
def test_emulated_kernels_match_reference(block_v):
    import tvm

    H, K = 2, 128
    lens = [1, 65, 15, 64]
    q, k, v, g, beta, cu, slots, pool = _inputs(lens, H, seed=1)
    ref_pool = pool.copy()
    o_ref = kda_prefill_reference(q, k, v, g, beta, cu, slots, ref_pool, 1, K ** -0.5)
    fi = kda_prefill_intra_kernel(H, K, K, K ** -0.5, emulate=True).with_attr("global_symbol", "intra")
    fs = kda_prefill_state_kernel(H, K, K, block_v, emulate=True).with_attr("global_symbol", "state")
    lib = tvm.compile(tvm.IRModule({"intra": fi, "state": fs}), target="llvm")
    A = tvm.runtime.tensor
    scr = {n: A(np.full(s, np.nan, np.float32)) for n, s in prefill_scratch_shapes(sum(lens), len(lens), H).items()}
    sn = ("w", "u", "qg", "kg", "aqk", "ge")
    lib["intra"](A(k), A(q), A(v), A(g), A(beta), A(cu), *(scr[n] for n in sn))
    pt, o = A(pool), A(np.zeros(v.shape, np.float32))
    lib["state"](*(scr[n] for n in sn), A(cu), A(slots), pt, 1, o)
    np.testing.assert_allclose(o.numpy(), o_ref, atol=1e-5)
    np.testing.assert_allclose(pt.numpy(), ref_pool, atol=1e-5)


@needs_nvcc
def test_kernels_compile_to_fatbin_for_sm90a(tmp_path):
    out = build_sm90a_fatbin(
        "from schedules.kda_prefill_cuda import *\n"
        "from schedules.barriers import respect_manual_barriers\n"
        "fi = kda_prefill_intra_kernel(3, 128, 128, 128 ** -0.5).with_attr('global_symbol', 'i')\n"
        "fs = kda_prefill_state_kernel(3, 128, 128, 32).with_attr('global_symbol', 's')\n"
        "mod = tvm.IRModule({'i': fi, 's': fs})", tmp_path, contexts="respect_manual_barriers()")
    assert "fatbin" in out
