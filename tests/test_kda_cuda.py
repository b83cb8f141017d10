"""The fused CUDA KDA decode kernel (schedules/kda_decode_cuda.py): its reference vs fla, and
that it compiles for sm_90a. The kernel itself runs on the H200 in benchmarks/kda.py, which
compares it with fla's naive recurrence and fused_recurrent_kda (not in CI: no GPU here)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from helpers_tvm import build_sm90a_fatbin, needs_nvcc
from schedules.kda_decode_cuda import kda_decode_fused_kernel, kda_decode_fused_reference


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_reference_matches_fla_naive_recurrence(lower_bound):
    from fla.ops.kda.naive import naive_recurrent_kda

    rng = np.random.default_rng(0)
    B, H, K = 3, 5, 32  # odd batch and heads
    q, k, f = (rng.standard_normal((B, H, K)).astype(np.float32) for _ in range(3))
    v = rng.standard_normal((B, H, K)).astype(np.float32)
    b = rng.standard_normal((B, H)).astype(np.float32)
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    dt_bias = (rng.standard_normal(H * K) * 0.5).astype(np.float32)
    slots = np.array([4, 0, 2], np.int32)
    pool = (rng.standard_normal((2, 5, H, K, K)) * 0.1).astype(np.float32)
    S0 = pool[1, slots].copy()
    o = kda_decode_fused_reference(q, k, v, f, b, A_log, dt_bias, slots, pool, 1, lower_bound)

    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).double()  # noqa: E731
    z = torch.exp(t(A_log))[None, :, None] * (t(f) + t(dt_bias).view(1, H, K))
    g = lower_bound * torch.sigmoid(z) if lower_bound is not None else \
        -torch.exp(t(A_log))[None, :, None] * torch.nn.functional.softplus(t(f) + t(dt_bias).view(1, H, K))
    l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    o_ref, S_ref = naive_recurrent_kda(l2(t(q))[:, None], l2(t(k))[:, None], t(v)[:, None],
                                       g[:, None], torch.sigmoid(t(b))[:, None],
                                       initial_state=t(S0), output_final_state=True)
    np.testing.assert_allclose(o, o_ref[:, 0].numpy(), atol=1e-5)
    np.testing.assert_allclose(pool[1, slots], S_ref.numpy(), atol=1e-5)


def test_kernel_rejects_bad_tiling():
    with pytest.raises(ValueError, match="must be a multiple of cols_per_block"):
        kda_decode_fused_kernel(2, 128, 100, -5.0)
    # 16 threads a block: the norms' warp shuffles need whole warps
    with pytest.raises(ValueError, match="itself a multiple of 32"):
        kda_decode_fused_kernel(2, 128, 128, -5.0, cols_per_block=16, k_split=1)


@needs_nvcc
def test_kernel_compiles_to_fatbin_for_sm90a(tmp_path):
    out = build_sm90a_fatbin(
        "from schedules.kda_decode_cuda import kda_decode_fused_kernel\n"
        "f = kda_decode_fused_kernel(3, 128, 128, -5.0).with_attr('global_symbol', 'k')\n"
        "mod = tvm.IRModule({'k': f})", tmp_path)
    assert "fatbin" in out
