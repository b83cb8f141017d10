"""The MoE combine kernel (schedules/moe_combine.py): its CPU variant against the NumPy
reference and an independent torch float64 combine on odd sizes, and its GPU variant's CUDA
(16-byte loads and stores). GPU numerics: benchmarks/moe_layer.py (the K3 MoE layer against a
torch reference from the spec)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from schedules import moe_combine as mc


@pytest.mark.parametrize("n,k,width", [(1, 16, 24), (3, 3, 40), (13, 5, 8), (7, 16, 136)])
def test_cpu_variant_matches_references(n, k, width):
    import torch
    import tvm

    from helpers_tvm import compile_prim, nd

    rng = np.random.default_rng(n * 100 + k)
    o = (rng.standard_normal((n, k, width)) * 3).astype(ml_dtypes.bfloat16)
    w = rng.random((n, k)).astype(np.float32)
    f = compile_prim(mc.moe_combine_kernel(k, width, gpu=False))
    y = tvm.runtime.empty((n, width), "bfloat16", tvm.cpu())
    f(nd(o), nd(w), y)
    got = y.numpy().astype(np.float32)
    ref = mc.moe_combine_reference(o, w)
    # the kernel rounds its fp32 sums to bf16 (round to nearest even)
    np.testing.assert_array_equal(got, ref.astype(ml_dtypes.bfloat16).astype(np.float32))
    ind = (torch.from_numpy(o.astype(np.float32)).double() * torch.from_numpy(w).double()[..., None]).sum(1)
    np.testing.assert_allclose(got, ind.numpy(), rtol=2 ** -7, atol=1e-6)


def test_width_must_be_a_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        mc.moe_combine_kernel(16, 100)


def test_gpu_variant_reads_and_writes_16_bytes():
    import tvm

    from targets import get_target

    lib = tvm.tirx.build(tvm.IRModule({"c": mc.moe_combine_kernel(16, 3584).with_attr("global_symbol", "c")}),
                         target=get_target("cuda-sm90a").tvm_target())
    src = lib.imports[0].inspect_source()
    kernel = src[src.index('extern "C" __global__'):]
    assert kernel.count("*(uint4*)") >= 17, kernel[:3000]  # 16 rows read, one row of outputs written


@pytest.mark.parametrize("n,k,width", [(1, 16, 24), (5, 3, 136), (2, 4, 128)])
def test_cpu_combine_norm_matches_references(n, k, width):
    """The combine with the router weights' bf16 rounding and routed_expert_norm fused in,
    against the NumPy form of the model's dtype flow and an independent torch float64 RMSNorm."""
    import torch
    import tvm

    from helpers_tvm import compile_prim, nd

    rng = np.random.default_rng(n * 1000 + width)
    o = (rng.standard_normal((n, k, width)) * 3).astype(ml_dtypes.bfloat16)
    w = rng.random((n, k)).astype(np.float32)
    nw = (1 + 0.5 * rng.standard_normal(width)).astype(ml_dtypes.bfloat16)
    f = compile_prim(mc.moe_combine_kernel(k, width, gpu=False, round_w=True, norm_eps=1e-5))
    y = tvm.runtime.empty((n, width), "bfloat16", tvm.cpu())
    f(nd(o), nd(w), nd(nw), y)
    got = y.numpy().astype(np.float32)
    ref = mc.moe_combine_norm_reference(o, w, nw, 1e-5)
    # the same operations in the same dtypes; the sum of squares may round differently (order)
    # and flip a bf16 rounding of the normalized value: at most one bf16 step apart
    np.testing.assert_allclose(got, ref, rtol=2 ** -7, atol=0)
    assert (got == ref).mean() > 0.99
    wr = torch.from_numpy(w.astype(ml_dtypes.bfloat16).astype(np.float32)).double()
    comb = (torch.from_numpy(o.astype(np.float32)).double() * wr[..., None]).sum(1)
    ind = comb * torch.rsqrt((comb * comb).mean(-1, keepdim=True) + 1e-5) * torch.from_numpy(nw.astype(np.float32)).double()
    np.testing.assert_allclose(got, ind.numpy(), rtol=2 ** -6, atol=1e-2)


def test_round_w_rounds_the_router_weights():
    import tvm

    from helpers_tvm import compile_prim, nd

    o = np.ones((1, 2, 8), ml_dtypes.bfloat16)
    w = np.array([[1 + 2 ** -10, 1 + 2 ** -10]], np.float32)   # not a bf16 value: rounds to 1
    y = tvm.runtime.empty((1, 8), "bfloat16", tvm.cpu())
    compile_prim(mc.moe_combine_kernel(2, 8, gpu=False, round_w=True))(nd(o), nd(w), y)
    np.testing.assert_array_equal(y.numpy().astype(np.float32), np.full((1, 8), 2.0, np.float32))
    compile_prim(mc.moe_combine_kernel(2, 8, gpu=False))(nd(o), nd(w), y)
    assert y.numpy().astype(np.float32)[0, 0] == np.float32(2 + 2 ** -9).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_gpu_combine_norm_builds_one_block_per_row():
    import tvm

    from targets import get_target

    for width in (3584, 128):   # K3's latent (448 threads) and k3-nano's (16 threads in one warp)
        f = mc.moe_combine_kernel(16, width, round_w=True, norm_eps=1e-5)
        lib = tvm.tirx.build(tvm.IRModule({"c": f.with_attr("global_symbol", "c")}),
                             target=get_target("cuda-sm90a").tvm_target())
        src = lib.imports[0].inspect_source()
        assert "__shfl_xor_sync" in src and "__syncthreads" in src
        assert f"__launch_bounds__({-(-width // 8 // 32) * 32})" in src, src[:2000]
    with pytest.raises(ValueError, match="over 1024"):
        mc.moe_combine_kernel(16, 8 * 1025, norm_eps=1e-5)   # 1025 threads per row


def test_bf16_round_keeps_nan_and_inf():
    """The integer rounding of the combine kernel on the bit patterns that matter: the GPU's
    canonical NaN 0x7FFFFFFF (which a plain add-and-mask turns into -0), x86's 0xFFC00000, ±inf,
    the largest finite fp32 (rounds to inf), a tie to even and an ordinary value."""
    import tvm
    from tvm.script import tirx as T

    from helpers_tvm import compile_prim, nd

    @T.prim_func(private=True)
    def f(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
        T.func_attr({"tirx.noalias": True})
        for i in range(8):
            b[i] = mc.bf16_round(a[i])

    bits = np.array([0x7FFFFFFF, 0xFFC00000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000,
                     0x3FA0ABCD], np.uint32)
    out = tvm.runtime.tensor(np.zeros(8, np.float32))
    compile_prim(f)(nd(bits.view(np.float32)), out)
    got = out.numpy()
    assert np.isnan(got[:2]).all()
    np.testing.assert_array_equal(got[2:5], [np.inf, -np.inf, np.inf])
    # ties to even: 1 + 2^-8 -> 1, 1 + 3·2^-8 -> 1 + 2^-6; ordinary: as ml_dtypes rounds
    np.testing.assert_array_equal(got[5:], bits[5:].view(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32))
    assert got[5] == 1.0


def test_cpu_combine_norm_propagates_nan_and_inf():
    """Non-finite combines give what the Relax norm gives (the NumPy form of it): a NaN row all
    NaN, a row holding an inf NaN there and 0 elsewhere (rsqrt(inf) = 0), never a silent finite
    value where the inf was; the other rows are unaffected."""
    import tvm

    from helpers_tvm import compile_prim, nd

    o = np.ones((3, 2, 16), ml_dtypes.bfloat16)
    o[0, 0, 3] = np.inf
    o[1, 1, 5] = np.nan
    w = np.full((3, 2), 0.5, np.float32)
    y = tvm.runtime.empty((3, 16), "bfloat16", tvm.cpu())
    compile_prim(mc.moe_combine_kernel(2, 16, gpu=False, round_w=True, norm_eps=1e-5))(
        nd(o), nd(w), nd(np.ones(16, ml_dtypes.bfloat16)), y)
    got = y.numpy().astype(np.float32)
    with np.errstate(invalid="ignore"):
        ref = mc.moe_combine_norm_reference(o, w, np.ones(16, ml_dtypes.bfloat16), 1e-5)
    np.testing.assert_array_equal(got, ref)   # (NaN where NaN)
    assert np.isnan(got[1]).all() and np.isnan(got[0, 3]) and (got[0, np.arange(16) != 3] == 0).all()
    np.testing.assert_allclose(got[2], 1.0, rtol=2 ** -7)
