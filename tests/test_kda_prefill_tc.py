"""Tensor-core KDA chunked prefill kernels (schedules/kda_prefill_tc.py): their serial emulation
(same loop nests and index maps, each mma replaced by the dot products it computes for the
lane, compiled for llvm) vs the NumPy reference ``kda_prefill_reference`` (itself checked
against fla's naive chunked / recurrent KDA in tests/test_kda_prefill_cuda.py), on ragged
batches with partial chunks; and that they compile to an sm_90a fatbin holding the mma.
The fragment layout and the mma instruction run on the H200 in benchmarks/kda.py."""

from __future__ import annotations


import numpy as np
import pytest

from helpers_tvm import build_sm90a_fatbin, nano_kda_prefill_vs_generic, needs_nvcc
from schedules.kda_prefill_cuda import kda_prefill_reference, prefill_scratch_shapes
from schedules.kda_prefill_tc import kda_prefill_intra_tc_kernel, kda_prefill_state_tc_kernel
from tests.test_kda_prefill_cuda import _inputs

SN = ("w", "u", "qg", "kg", "aqk", "ge")


def _run_emulated(lens, H, block_v, seed, a_batch=8, hoist_loads=False):
    import tvm

    K = 128
    q, k, v, g, beta, cu, slots, pool = _inputs(lens, H, seed=seed)
    ref_pool = pool.copy()
    o_ref = kda_prefill_reference(q, k, v, g, beta, cu, slots, ref_pool, 1, K ** -0.5)
    fi = kda_prefill_intra_tc_kernel(H, K, K, K ** -0.5, hoist_loads, emulate=True).with_attr("global_symbol", "intra")
    fs = kda_prefill_state_tc_kernel(H, K, K, block_v, a_batch, emulate=True).with_attr("global_symbol", "state")
    lib = tvm.compile(tvm.IRModule({"intra": fi, "state": fs}), target="llvm")
    A = tvm.runtime.tensor
    scr = {n: A(np.full(s, np.nan, np.float32)) for n, s in prefill_scratch_shapes(sum(lens), len(lens), H).items()}
    lib["intra"](A(k), A(q), A(v), A(g), A(beta), A(cu), *(scr[n] for n in SN))
    pt, o = A(pool), A(np.full(v.shape, np.nan, np.float32))
    lib["state"](*(scr[n] for n in SN), A(cu), A(slots), pt, 1, o)
    return o.numpy(), o_ref, pt.numpy(), ref_pool


@pytest.mark.parametrize("block_v,a_batch,hoist,lens", [(8, 8, False, [1, 65, 15, 64]),
                                                        (16, 16, False, [200, 1]),
                                                        (32, 4, True, [130, 7, 64, 1]),
                                                        (64, 4, True, [63, 129])])
def test_emulated_tc_kernels_match_reference(block_v, a_batch, hoist, lens):
    # the last sequence ends in a partial chunk, so hoist_loads' clamped rows are exercised
    o, o_ref, pool, ref_pool = _run_emulated(lens, 2, block_v, seed=block_v, a_batch=a_batch,
                                             hoist_loads=hoist)
    assert not np.isnan(o).any()
    np.testing.assert_allclose(o, o_ref, atol=1e-5)
    np.testing.assert_allclose(pool, ref_pool, atol=1e-5)


def test_state_tc_rejects_unsupported_block_v():
    with pytest.raises(ValueError):
        kda_prefill_state_tc_kernel(2, 128, 128, 12)
    with pytest.raises(ValueError):
        kda_prefill_state_tc_kernel(2, 128, 128, 128)
    with pytest.raises(ValueError):
        kda_prefill_state_tc_kernel(2, 128, 128, 32, a_batch=3)


@needs_nvcc
def test_tc_kernels_compile_to_fatbin_for_sm90a(tmp_path):
    out = build_sm90a_fatbin(
        "from schedules.kda_prefill_tc import *\n"
        "from schedules.barriers import respect_manual_barriers\n"
        "fi = kda_prefill_intra_tc_kernel(3, 128, 128, 128 ** -0.5).with_attr('global_symbol', 'i')\n"
        "fh = kda_prefill_intra_tc_kernel(3, 128, 128, 128 ** -0.5, True).with_attr('global_symbol', 'h')\n"
        "fs = kda_prefill_state_tc_kernel(3, 128, 128, 16).with_attr('global_symbol', 's')\n"
        "mod = tvm.IRModule({'i': fi, 'h': fh, 's': fs})", tmp_path, contexts="respect_manual_barriers()",
        keep_src=True)
    assert "fatbin" in out
    src = "".join(p.read_text() for p in (tmp_path / "src").glob("*.cu"))
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in src
    assert src.count("k3_mma_tf32(") > 10
    assert "prefetch.global.L2" in src


def test_model_with_tc_prefill_matches_generic_model():
    """The model's tensor-core prefill path (relax_modules/kda.py ``_tc_prefill``: argument
    order, scratch shapes, in-place state) with the kernels emulated on the CPU gives k3-nano's
    logits of the generic model (``helpers_tvm.nano_kda_prefill_vs_generic``)."""
    import functools

    def configure(layer):
        layer.prefill_form = "two_kernel"

    script, outs, refs = nano_kda_prefill_vs_generic(
        {"kda_prefill_intra_tc_kernel": functools.partial(kda_prefill_intra_tc_kernel, emulate=True),
         "kda_prefill_state_tc_kernel": functools.partial(kda_prefill_state_tc_kernel, emulate=True)}, configure)
    assert "kda_prefill_state_tc" in script
    for got, want in zip(outs, refs):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
