"""MXFP4 against compressed-tensors' own functions (the independent source) and k3-nano."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import (
    kE2M1ToFloat,
    pack_fp4_to_uint8,
    unpack_fp4_from_uint8,
)
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
from safetensors import safe_open

from k3_compile import mxfp4

NANO = Path(__file__).resolve().parents[1] / "models" / "k3-nano"


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 bit patterns (distinguishes -0.0 from 0.0, compares NaN payload-free)."""
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def test_code_table_matches_compressed_tensors():
    ct = kE2M1ToFloat.numpy()
    np.testing.assert_array_equal(mxfp4.E2M1_VALUES[:8], ct)
    np.testing.assert_array_equal(mxfp4.E2M1_VALUES[8:], -ct)
    assert np.signbit(mxfp4.E2M1_VALUES[8])  # code 8 is -0.0


def test_unpack_all_bytes_matches_compressed_tensors():
    # every byte value -> both nibbles, all 16 codes in each position
    packed = np.arange(256, dtype=np.uint8).reshape(8, 32)
    ours = mxfp4.E2M1_VALUES[mxfp4.unpack_codes(packed)]
    theirs = unpack_fp4_from_uint8(torch.from_numpy(packed), 8, 64, torch.float32).numpy()
    np.testing.assert_array_equal(_bits(ours), _bits(theirs))
    # low nibble = even column
    assert mxfp4.unpack_codes(np.array([[0x7A]], np.uint8)).tolist() == [[0xA, 0x7]]


def test_pack_matches_compressed_tensors_random():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(37, 128), dtype=np.uint8)
    codes[0, :16] = np.arange(16)  # all codes in even columns
    codes[1, 1:33:2] = np.arange(16)  # all codes in odd columns
    values = torch.from_numpy(mxfp4.E2M1_VALUES[codes])
    theirs = pack_fp4_to_uint8(values).numpy()
    np.testing.assert_array_equal(mxfp4.pack_codes(codes), theirs)
    np.testing.assert_array_equal(mxfp4.unpack_codes(theirs), codes)


@pytest.mark.parametrize("scales", [[0, 1, 127, 254], [2, 100, 126, 200], [120, 121, 122, 253]])
def test_dequantize_matches_compressed_tensors(scales):
    rng = np.random.default_rng(sum(scales))
    packed = rng.integers(0, 256, size=(16, 64), dtype=np.uint8)  # in = 128: 4 blocks per row
    packed[0] = np.arange(64)
    packed[1] = np.arange(192, 256)
    scale = np.tile(np.array(scales, np.uint8), (16, 1))
    ours = mxfp4.dequantize(packed, scale)
    vals = unpack_fp4_from_uint8(torch.from_numpy(packed), 16, 128, torch.float32)
    s = decompress_mx_scale(torch.from_numpy(scale)).to(torch.float32)
    theirs = (vals.reshape(16, 4, 32) * s[..., None]).reshape(16, 128).numpy()
    assert ours.dtype == np.float32 and ours.shape == (16, 128)
    np.testing.assert_array_equal(_bits(ours), _bits(theirs))
    # spot values: scale 0 -> 2**-127, scale 254 -> 2**127
    if scales[0] == 0:
        assert ours[0, 2] == np.float32(0.5 * 2.0**-127)  # packed[0, 1] = 0x01: col 2 code 1
        assert ours[0, 96 + 1] == np.float32(1.5 * 2.0**127)  # packed[0, 48] = 0x30: col 97 code 3


def test_nan_scale_gives_nan_block_only():
    packed = np.full((2, 32), 0x21, np.uint8)  # codes 1 (0.5), 2 (1.0)
    scale = np.array([[127, 255], [255, 128]], np.uint8)
    w = mxfp4.dequantize(packed, scale)
    assert np.isnan(w[0, 32:]).all() and np.isnan(w[1, :32]).all()
    np.testing.assert_array_equal(w[0, :4], [0.5, 1.0, 0.5, 1.0])
    np.testing.assert_array_equal(w[1, 32:36], [1.0, 2.0, 1.0, 2.0])
    wb = mxfp4.dequantize(packed, scale, dtype=ml_dtypes.bfloat16)
    assert wb.dtype == ml_dtypes.bfloat16 and np.isnan(wb[0, 32:].astype(np.float32)).all()


def test_scale_rule_matches_generate_mx_scales():
    rng = np.random.default_rng(1)
    amax = (rng.uniform(1.0, 2.0, 4000) * np.exp2(rng.integers(-100, 100, 4000))).astype(np.float32)
    # mantissas exactly at and next to the round-up threshold 1.75
    edge = np.array([1.75, np.nextafter(np.float32(1.75), 0), 1.0, np.nextafter(np.float32(2), 0)], np.float32)
    amax = np.concatenate([amax, edge, edge * 1024, edge / 1024])
    theirs = generate_mx_scales(torch.from_numpy(amax)).numpy()
    np.testing.assert_array_equal(mxfp4.shared_exponent(amax), theirs.astype(np.uint8))
    bf = amax.astype(ml_dtypes.bfloat16)
    theirs_bf = generate_mx_scales(torch.from_numpy(bf.astype(np.float32)).to(torch.bfloat16))
    np.testing.assert_array_equal(mxfp4.shared_exponent(bf), theirs_bf.float().numpy().astype(np.uint8))
    assert mxfp4.shared_exponent(np.float32(0.0)) == 0  # documented choice for all-zero blocks


def _ct_quantize(w: np.ndarray):
    """compressed-tensors' MXFP4 path: generate_mx_scales -> cast_to_fp4 -> pack_fp4_to_uint8."""
    t = torch.from_numpy(w)
    blocks = t.reshape(t.shape[0], -1, 32)
    s = generate_mx_scales(blocks.abs().amax(-1)).to(torch.uint8)
    q = cast_to_fp4(torch.clamp(blocks / decompress_mx_scale(s).float()[..., None], -6, 6))
    return pack_fp4_to_uint8(q.reshape(t.shape)).numpy(), s.numpy()


def test_quantize_matches_compressed_tensors_random():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((48, 256)).astype(np.float32)
    w *= np.exp2(rng.integers(-20, 20, (48, 8))).repeat(32, axis=1).astype(np.float32)
    # exact ties of the E2M1 grid (RNE must pick the even code)
    w[0, :32] = np.tile(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.0]), 4)
    w[1, :32] = -w[0, :32]
    p, s = mxfp4.quantize(w)
    p_ct, s_ct = _ct_quantize(w)
    np.testing.assert_array_equal(s, s_ct)
    c, c_ct = mxfp4.unpack_codes(p), mxfp4.unpack_codes(p_ct)
    # compressed-tensors keeps the sign of values that underflow to zero (code 8, -0);
    # we store +0 (code 0) as k3-nano's exporter did. Everything else is identical.
    neg_zero = c_ct == 8
    np.testing.assert_array_equal(c[~neg_zero], c_ct[~neg_zero])
    assert (c[neg_zero] == 0).all()
    assert c[0, :8].tolist() == [0, 2, 2, 4, 4, 6, 6, 6]  # 0.25->0, 0.75->1, 1.25->1, ...


def test_quantize_ocp_rule_saturates():
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = 1.875  # mantissa >= 1.75
    p, s = mxfp4.quantize(w, rule="ocp")
    assert s[0, 0] == 127 - 2  # floor(log2 1.875) - 2
    assert mxfp4.dequantize(p, s)[0, 0] == 1.5  # 7.5 saturates to 6 * 2**-2
    p, s = mxfp4.quantize(w)
    assert s[0, 0] == 127 - 1 and mxfp4.dequantize(p, s)[0, 0] == 2.0


def test_quantize_keeps_negative_zero_and_zero_blocks():
    w = np.zeros((1, 64), np.float32)
    w[0, 1] = -0.0
    w[0, 32] = -1e-3
    w[0, 33] = 1.0
    p, s = mxfp4.quantize(w)
    codes = mxfp4.unpack_codes(p)
    assert codes[0, 1] == 8 and codes[0, 0] == 0 and codes[0, 32] == 0
    assert s.tolist() == [[0, 125]]


def test_roundtrip_k3_nano_experts():
    idx = json.loads((NANO / "model.safetensors.index.json").read_text())["weight_map"]
    names = sorted(n for n in idx if n.endswith("weight_packed"))
    assert len(names) == 7 * 32 * 3
    seen_codes = np.zeros(16, bool)
    handles = {f: safe_open(str(NANO / f), "numpy") for f in set(idx.values())}
    for n in names:
        p = handles[idx[n]].get_tensor(n)
        sname = n.replace("weight_packed", "weight_scale")
        sc = handles[idx[sname]].get_tensor(sname)
        seen_codes[mxfp4.unpack_codes(p).ravel()] = True
        p2, s2 = mxfp4.quantize(mxfp4.dequantize(p, sc))
        np.testing.assert_array_equal(s2, sc, err_msg=sname)
        np.testing.assert_array_equal(p2, p, err_msg=n)
    assert seen_codes.sum() == 15  # k3-nano never stores -0 (code 8)


def test_stacked_experts_and_kernel_layout():
    rng = np.random.default_rng(3)
    p = rng.integers(0, 256, (3, 8, 32), dtype=np.uint8)
    s = rng.integers(110, 130, (3, 8, 2), dtype=np.uint8)
    w = mxfp4.dequantize(p, s)
    assert w.shape == (3, 8, 64)
    np.testing.assert_array_equal(w[1], mxfp4.dequantize(p[1], s[1]))
    kp, ks = mxfp4.to_kernel_layout(p[:, ::2], s[:, ::2])  # non-contiguous views
    assert kp.flags.c_contiguous and ks.flags.c_contiguous
    np.testing.assert_array_equal(kp, p[:, ::2])
    np.testing.assert_array_equal(ks, s[:, ::2])


def test_errors():
    with pytest.raises(ValueError, match="weight_packed: expected dtype uint8, got int8"):
        mxfp4.dequantize(np.zeros((2, 16), np.int8), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match="weight_scale: expected dtype uint8, got float32"):
        mxfp4.dequantize(np.zeros((2, 16), np.uint8), np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="in = 48 columns, which is not a multiple of the MXFP4 group size 32"):
        mxfp4.dequantize(np.zeros((2, 24), np.uint8), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match=r"weight_scale: expected shape \(2, 2\).*got \(2, 1\)"):
        mxfp4.to_kernel_layout(np.zeros((2, 32), np.uint8), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match=r"w: expected shape \[..., in\] with in a multiple of 32, got \(2, 40\)"):
        mxfp4.quantize(np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="w: expected a float array, got dtype int32"):
        mxfp4.quantize(np.zeros((2, 32), np.int32))
    w = np.zeros((1, 32), np.float32)
    w[0, 3] = np.nan
    with pytest.raises(ValueError, match="w: contains NaN or inf"):
        mxfp4.quantize(w)
    with pytest.raises(ValueError, match="rule: expected 'compressed-tensors' or 'ocp'"):
        mxfp4.quantize(np.zeros((1, 32), np.float32), rule="floor")
    with pytest.raises(ValueError, match="E2M1 codes are 4-bit"):
        mxfp4.pack_codes(np.full((1, 2), 16, np.uint8))
