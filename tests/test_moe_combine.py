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
