"""The MXFP4 CUDA MoE decode kernels (schedules/moe_mxfp4_cuda.py): the reference vs
moe_generic's reference / compressed-tensors dequant, the chain reference, the dequant bit
trick, and that the kernels compile to a fatbin for sm_90a. The kernels run on the H200 in
benchmarks/moe.py (not in CI: no GPU here)."""

from __future__ import annotations


import numpy as np
import pytest

from helpers_tvm import build_sm90a_fatbin, needs_nvcc
from schedules import moe_generic as mg
from schedules import moe_mxfp4_cuda as mc


def _weights(rng, E, n, k):
    return (rng.integers(0, 256, (E, n, k // 2), dtype=np.uint8),
            rng.integers(120, 128, (E, n, k // 32), dtype=np.uint8))


def test_reference_matches_generic_and_compressed_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    E, L, I, k, T = 5, 96, 64, 3, 7  # odd sizes
    w1, w3, w2 = _weights(rng, E, I, L), _weights(rng, E, I, L), _weights(rng, E, L, I)
    z = rng.standard_normal((T, L)).astype(np.float32)
    ids = rng.integers(0, E, (T, k)).astype(np.int32)
    a, o = mc.moe_experts_reference(z, *w1, *w3, *w2, ids, 4.0, 25.0)
    # independent path: compressed-tensors' unpacker where present, else moe_generic
    try:
        from compressed_tensors.compressors.quantized_compressors.fp4_quantized import unpack_fp4_from_uint8

        def deq(p, s):
            v = unpack_fp4_from_uint8(torch.from_numpy(p.reshape(-1, p.shape[-1])), p.shape[0] * p.shape[1],
                                      p.shape[2] * 2, dtype=torch.float32).numpy().reshape(*p.shape[:2], -1)
            return v * np.repeat(mg.e8m0_reference(s), 32, -1)
    except ImportError:
        deq = mg.mxfp4_dequant_reference
    W1, W3, W2 = deq(*w1), deq(*w3), deq(*w2)
    np.testing.assert_array_equal(W1, mg.mxfp4_dequant_reference(*w1))
    g = np.einsum("ti,tjni->tjn", z.astype(np.float64), W1[ids].astype(np.float64))
    u = np.einsum("ti,tjni->tjn", z.astype(np.float64), W3[ids].astype(np.float64))
    a_ref = mg.situ_reference(g.astype(np.float32), u.astype(np.float32), 4.0, 25.0)
    o_ref = np.einsum("tji,tjni->tjn", a_ref.astype(np.float64), W2[ids].astype(np.float64))
    np.testing.assert_allclose(a, a_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)


def test_chain_reference():
    ids = np.array([[3, 1], [1, 4], [3, 3]], np.int32)
    c = mc.expert_chain_reference(ids)
    np.testing.assert_array_equal(c[..., 0], [[1, 1], [0, 1], [0, 0]])
    np.testing.assert_array_equal(c[..., 1], [[4, 2], [-1, -1], [5, -1]])


def test_code_bit_trick_matches_e2m1_table():
    for w in (0x76543210, 0xFEDCBA98):
        for j in range(8):
            t = (w << (28 - 4 * j)) & 0xFFFFFFFF
            bits = ((t >> 16) & 0x8000) | ((t >> 19) & 0x0E00)
            f = np.array([bits], np.uint16).view(np.float16).astype(np.float32)[0] * 2 ** 14
            assert f == mg.e2m1_reference(np.array([(w >> (4 * j)) & 15], np.uint8))[0]


def test_pair_dequant_trick_matches_e2m1_table():
    """``_pair_f16x2``: nibbles j and j+4 of a word as an fp16x2 of v·2^-14."""
    for w in (0x76543210, 0xFEDCBA98, 0x9ABC1357):
        for j in range(4):
            t = w >> (4 * j)
            h = (((t << 9) & 0x0E000E00) | ((t << 12) & 0x80008000)) & 0xFFFFFFFF
            lo, hi = np.array([h & 0xFFFF, h >> 16], np.uint16).view(np.float16).astype(np.float32) * 2 ** 14
            codes = np.array([(w >> (4 * j)) & 15, (w >> (4 * j + 16)) & 15], np.uint8)
            np.testing.assert_array_equal([lo, hi], mg.e2m1_reference(codes))


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="multiple of 512"):
        mc.moe_mxfp4_gate_up_kernel(4, 100 * 32, 64, 2, 4.0, 25.0)


@needs_nvcc
def test_kernels_compile_to_fatbin_for_sm90a(tmp_path):
    out = build_sm90a_fatbin(
        "from schedules import moe_mxfp4_cuda as mc\n"
        "from schedules.barriers import respect_manual_barriers\n"
        "fs = {'c': mc.moe_expert_chain_kernel(3), 'gu': mc.moe_mxfp4_gate_up_kernel(5, 1024, 96, 3, 4.0, 25.0),\n"
        "      'd': mc.moe_mxfp4_down_kernel(5, 1024, 512, 3)}\n"
        "mod = tvm.IRModule({k: f.with_attr('global_symbol', k) for k, f in fs.items()})", tmp_path,
        contexts="respect_manual_barriers()")  # as the model build
    assert "fatbin" in out
