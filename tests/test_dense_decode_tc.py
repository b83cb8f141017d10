"""The dense bf16 decode kernel (schedules/dense_decode_tc.py) without a GPU: its fragment
mapping emulated in NumPy against a plain matmul, its match on the model's fused functions, and
its CUDA (mma count, registers, no spills). GPU numerics: tests/gpu/check_dense_decode.py
(odd sizes, 1..64 tokens, against torch) and benchmarks/moe_layer.py (the K3 MoE layer against
a torch reference) on the H200."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_tvm import fused_module, needs_nvcc, ptxas_report, sm90a_cuda_source

from schedules import dense_decode_tc as ddt


def _emulate(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The kernel's sums as its lanes form them: per K block of KB inputs, lane (g, q) supplies
    for mma step s the words step_word(s, 0 / 1) of its 16 inputs (A rows g / g + 8, B token g),
    which the mma multiplies as k = 2q, 2q + 1 / 2q + 8, 2q + 9; the m16n8k16 product is then
    Σ_k A[row, k] B[k, token] over the 16 k of the step."""
    n, K = x.shape
    N = w.shape[0]
    y = np.zeros((n, N), np.float64)
    for kb in range(K // ddt.KB):
        for s in range(ddt.KB // 16):
            # k (0..15) of this step -> input index within the K block
            k_to_input = {}
            for q in range(4):
                for i in (0, 1):
                    word = ddt.step_word(s, i)
                    for h in (0, 1):
                        k_to_input[2 * q + 8 * i + h] = ddt.lane_input(q, word, h)
            assert sorted(k_to_input) == list(range(16))
            cols = [kb * ddt.KB + k_to_input[k] for k in range(16)]
            y += x[:, cols].astype(np.float64) @ w[:, cols].astype(np.float64).T
    return y


@pytest.mark.parametrize("n,N,K", [(1, 16, 64), (5, 48, 192), (64, 32, 320), (13, 112, 128)])
def test_fragment_mapping_equals_the_matmul(n, N, K):
    """Every input of a K block is used exactly once (the steps' k sets partition it), so the
    emulated sums equal x @ wᵀ (dense_reference) on random inputs of odd sizes."""
    rng = np.random.default_rng(n + N + K)
    x, w = rng.standard_normal((n, K)), rng.standard_normal((N, K))
    np.testing.assert_allclose(_emulate(x, w), ddt.dense_reference(x, w), rtol=1e-5, atol=1e-4)


def test_step_words_cover_each_k_block_once():
    used = sorted(ddt.lane_input(q, ddt.step_word(s, i), h) for s in range(ddt.KB // 16)
                  for i in (0, 1) for q in range(4) for h in (0, 1))
    assert used == list(range(ddt.KB))


def test_kernel_copies_follow_lane_input():
    """The kernel's 16-byte copies (lane_word, used by its cp.async and token loads) hold the
    words that lane_input (the emulated mapping above) assigns to the lane."""
    for q in range(4):
        for c in range(2):
            for v in range(4):
                for h in (0, 1):
                    assert 2 * (ddt.lane_word(q, c) + v) + h == ddt.lane_input(q, 4 * c + v, h)


def test_fits_and_errors():
    assert ddt.fits(3584, 7168) and ddt.fits(896, 7168)
    assert not ddt.fits(2, 256)        # k3-nano's b_proj: 2 rows
    assert not ddt.fits(64, 96)        # input width not a multiple of 64
    with pytest.raises(ValueError, match="multiple of 16"):
        ddt.dense_nt_tc_kernel(40, 128)
    with pytest.raises(ValueError, match="split evenly"):
        ddt.dense_nt_tc_kernel(32, 192, warps=4)


def _fused(body):
    """The fused PrimFuncs of a small Relax module (the GPU pipeline's first steps)."""
    import tvm
    from tvm.relax.frontend import nn

    class M(nn.Module):
        def __init__(self):
            self.w = nn.Parameter((64, 128), "bfloat16")
            self.u = nn.Parameter((2, 128), "bfloat16")

        def forward(self, x, r):
            return body(self, x, r)

    mod, _ = M().export_tvm(spec={"forward": {"x": nn.spec.Tensor(["n", 128], "bfloat16"),
                                              "r": nn.spec.Tensor(["n", 64], "bfloat16")}})
    mod = fused_module(mod)
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def test_match_dense_keeps_the_fused_epilogue():
    """A projection with a fused epilogue (cast, tanh, sigmoid, multiply, residual add) matches,
    and the spliced store applies that epilogue to the mma sums; a 2-row projection does not."""
    from tvm.relax.frontend.nn import op

    def body(m, x, r):
        a = op.astype(op.matmul(x, op.permute_dims(m.w, [1, 0]), out_dtype="float32"), "bfloat16")
        return op.tanh(a) * op.sigmoid(a) + r

    fs = _fused(body)
    (name, f), = fs.items()
    x, w, out, n, _ = ddt.match_dense(f)
    assert [int(d) for d in w.ty.shape] == [64, 128] and str(n) == "n"
    src = str(ddt.splice_body(f))
    assert "k3_mma_bf16" in src and "T.tanh" in src and "T.sigmoid" in src and " + r[" in src, src[-800:]

    def small(m, x, r):
        return op.astype(op.matmul(x, op.permute_dims(m.u, [1, 0]), out_dtype="float32"), "bfloat16")

    (f2,) = _fused(small).values()
    assert ddt.match_dense(f2) is None and ddt.splice_body(f2) is None


@needs_nvcc
def test_cuda_has_the_mmas_and_no_spills(tmp_path):
    src = sm90a_cuda_source(ddt.dense_nt_tc_kernel(3584, 7168, "bfloat16"))
    # 8 n8 tiles x 4 steps per K block in the unrolled tile loop
    assert src.count("k3_mma_bf16((&") == 8 * 4, src.count("k3_mma_bf16((&")
    assert "0 bytes spill stores" in ptxas_report(src, tmp_path)
