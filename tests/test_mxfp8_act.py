"""MXFP8 activations for the MoE decode GEMVs (schedules/mxfp8_act.py and the ``act="mxfp8"``
kernels of schedules/moe_mxfp4_decode_tc.py), on the CPU: the quantizer reference against
torch's own E4M3 conversion and hand-worked OCP MX cases, the fp8 code layout and its
table-free E4M3 recipe against the E2M1 table, the in-place repack kernel (llvm) against the
layout's definition, and the kernel's fragment mapping (m16n8k32 E4M3 mmas, one per scale
group, scaled into fp32) against a plain matmul. The kernels run on the H200 in
benchmarks/moe.py (not in CI: no GPU here); tests/test_moe_prefill_cuda.py compiles them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm

from schedules import mxfp8_act as A8


def _e4m3(b: np.ndarray) -> np.ndarray:
    return np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def test_quantize_hand_worked_group():
    """amax 1.0: shared exponent floor(log2 1) - 8 = -8 (byte 119); 1.0 -> 256 = E4M3 0x78,
    0.3 -> 76.8 -> 80 (0x6A, the E4M3 grid is 8 apart in [64, 128)), -2^-9 -> -2^-1 (0xB0)."""
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2] = 1.0, 0.3, -2.0 ** -9
    codes, scales = A8.quantize_reference(x)
    assert scales.tolist() == [119]
    assert codes[:3].tolist() == [0x78, 0x6A, 0xB0]
    assert (codes[3:] == 0).all()


def test_quantize_matches_torch_e4m3():
    """Odd rows (5 x 96) of wide-ranging values: the codes equal torch's float8_e4m3fn of
    ``x / 2^(s-127)`` (after the ±448 saturation OCP asks for), with ``s`` from each group's
    amax computed here by frexp; every group's amax lands in [256, 512) before saturation."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 96)) * np.exp2(rng.integers(-20, 20, (5, 96)))).astype(np.float32)
    x[2, 32:64] = 0.0  # an all-zero group: byte 1, codes 0
    codes, scales = A8.quantize_reference(x)
    g = x.reshape(5, 3, 32).astype(np.float64)
    amax = np.abs(g).max(-1)
    exp = np.frexp(amax)[1] - 1                    # floor(log2 amax)
    want_s = np.where(amax > 0, exp - 8 + 127, 1)
    np.testing.assert_array_equal(scales, want_s.astype(np.uint8))
    scaled = torch.from_numpy((g / np.exp2(want_s - 127.0)[..., None]).clip(-448, 448).astype(np.float32))
    want = scaled.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(5, 96)
    np.testing.assert_array_equal(codes, want)
    nz = amax > 0
    assert ((np.abs(g / np.exp2(want_s - 127.0)[..., None]).max(-1)[nz] >= 256)
            & (np.abs(g / np.exp2(want_s - 127.0)[..., None]).max(-1)[nz] < 512)).all()
    # and back: within half an E4M3 step at the group's top binade (2^(exp-4)), except the
    # saturated elements (scaled magnitude over 448), which come back as ±448 · 2^(s-127)
    back = A8.dequantize_reference(codes, scales).reshape(5, 3, 32)
    sat = np.abs(g) > 448 * np.exp2(want_s - 127.0)[..., None]
    assert sat.any()  # the test data reaches the saturation case
    assert (np.abs(back - g)[~sat] <= np.broadcast_to(np.exp2(exp - 4.0)[..., None], g.shape)[~sat]).all()
    np.testing.assert_array_equal(back[sat], np.sign(g[sat]) * 448 * np.broadcast_to(
        np.exp2(want_s - 127.0)[..., None], g.shape)[sat])


def test_quantize_exponent_clamps():
    """Both ends of the shared-exponent clamp: a group with fp32-subnormal amax (2^-130) gets
    byte 1 (scale 2^-126), its element 2^-4 there (E4M3 0x18: exponent field 3), exact; amax
    2^127 gets byte 254 - 8 = 246 with its top element at 256 (0x78)."""
    x = np.zeros((2, 32), np.float32)
    x[0, 0] = np.float32(2.0 ** -130)
    x[1, 0] = np.float32(2.0 ** 127)
    codes, scales = A8.quantize_reference(x)
    assert scales.tolist() == [[1], [246]]
    assert codes[0, 0] == 0x18 and (codes[0, 1:] == 0).all() and codes[1, 0] == 0x78
    np.testing.assert_array_equal(A8.dequantize_reference(codes, scales), x)


def test_quantize_rejects_ragged_rows():
    with pytest.raises(ValueError, match="multiple of 32"):
        A8.quantize_reference(np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        A8.quantize_kernel(40)
    with pytest.raises(ValueError, match="need scales"):
        A8.dequantize_reference(np.zeros((2, 64), np.uint8), np.zeros((2, 3), np.uint8))


def _codes(row_bytes: np.ndarray) -> np.ndarray:
    """E2M1 codes of checkpoint-layout bytes ``[..., K/2]`` in input order ``[..., K]``."""
    return np.stack([row_bytes & 15, row_bytes >> 4], -1).reshape(*row_bytes.shape[:-1], -1)


def test_layout_recipe_gives_e2m1_values_times_2_pow_minus_6():
    """Every code of a random row (K = 256): lane q's word G of K block kb, through the
    device recipe (e4m3_lo / e4m3_hi), read as E4M3 (ml_dtypes), times 2^6, is the E2M1 value
    (OCP table) of input ``128kb + 32G + 8q + j`` (lo) and ``+ 4 + j`` (hi)."""
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 128), dtype=np.uint8)
    codes = _codes(packed)
    words = A8.repack_reference(packed).view("<u4").reshape(3, 2, 4, 4)   # [row, kb, q, G]
    lo, hi = A8.e4m3_words_reference(words)
    for r in range(3):
        for kb in range(2):
            for q in range(4):
                for G in range(4):
                    base = 128 * kb + 32 * G + 8 * q
                    got_lo = _e4m3(np.array([lo[r, kb, q, G]], np.uint32).view(np.uint8)) * 64
                    got_hi = _e4m3(np.array([hi[r, kb, q, G]], np.uint32).view(np.uint8)) * 64
                    np.testing.assert_array_equal(got_lo, A8.E2M1_VALUES[codes[r, base:base + 4]])
                    np.testing.assert_array_equal(got_hi, A8.E2M1_VALUES[codes[r, base + 4:base + 8]])


def test_repack_rejects_widths_off_the_k_block():
    with pytest.raises(ValueError, match="multiple of 64"):
        A8.repack_reference(np.zeros((2, 96), np.uint8))


def test_repack_kernel_equals_the_layout_definition():
    """The in-place TIR kernel (llvm) on odd sizes (3 experts x 5 rows x K = 256) equals
    :func:`repack_reference`."""
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (3, 5, 128), dtype=np.uint8)
    lib = tvm.compile(tvm.IRModule({"repack": A8.repack_kernel().with_attr("global_symbol", "repack")}),
                      target="llvm")
    t = tvm.runtime.tensor(packed.copy())
    lib["repack"](t)
    np.testing.assert_array_equal(t.numpy(), A8.repack_reference(packed))


def test_repack_kernel_rejects_rows_off_the_k_block():
    """kh = 96 bytes (K = 192): the kernel's 64-byte blocks would straddle rows; the call fails
    naming weight_packed instead."""
    lib = tvm.compile(tvm.IRModule({"repack": A8.repack_kernel().with_attr("global_symbol", "repack")}),
                      target="llvm")
    with pytest.raises(Exception, match="weight_packed: the last dimension must be a multiple of 64"):
        lib["repack"](tvm.runtime.tensor(np.zeros((1, 2, 96), np.uint8)))


def _mma_m16n8k32(regs) -> np.ndarray:
    """What one E4M3 ``mma.m16n8k32`` computes from lane registers ``regs(g, q) -> (a0, a1,
    a2, a3, b0, b1)`` (4 values each), laid out as the PTX ISA's fragments ("Matrix fragments
    for mma.m16n8k32", 8-bit types): a0 row g k 4q..4q+3, a1 row g+8, a2 row g k 16+4q..,
    a3 row g+8; b0 column g k 4q.., b1 k 16+4q..; returns the 16 x 8 product."""
    LA, LB = np.zeros((16, 32)), np.zeros((32, 8))
    for lane in range(32):
        g, q = lane // 4, lane % 4
        a0, a1, a2, a3, b0, b1 = regs(g, q)
        LA[g, 4 * q:4 * q + 4], LA[g + 8, 4 * q:4 * q + 4] = a0, a1
        LA[g, 16 + 4 * q:20 + 4 * q], LA[g + 8, 16 + 4 * q:20 + 4 * q] = a2, a3
        LB[4 * q:4 * q + 4, g], LB[16 + 4 * q:20 + 4 * q, g] = b0, b1
    return LA @ LB


def test_fp8_fragments_compute_the_gemv():
    """The kernel's K block (128 inputs) for 16 weight rows x 8 columns, lane by lane, with the
    kernel's own maps (schedules/moe_mxfp4_decode_tc.py ``fp8_a_source``, ``fp8_x_word``,
    ``fp8_scale_of``): thread (g, q) holds, per scale group G, the fp8-layout word G of its 16
    bytes for rows g and g+8 and the activation words of column g; one mma per group (the
    PTX fragment layout, :func:`_mma_m16n8k32`), each output c_i times the weight scale and
    activation scale ``fp8_scale_of(i)`` names — must equal dequant(W) @ dequant(X) (OCP E2M1 /
    E8M0 and MXFP8 values, with the scale factors' 2^6 for the E4M3 placement)."""
    from schedules import moe_mxfp4_decode_tc as dt

    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, (16, 64), dtype=np.uint8)
    wscale = rng.integers(118, 129, (16, 4)).astype(np.uint8)
    Wv = A8.E2M1_VALUES[_codes(packed)] * np.repeat(np.exp2(wscale.astype(np.float64) - 127), 32, -1)
    xq, xs = A8.quantize_reference(rng.standard_normal((8, 128)).astype(np.float32))
    Xv = A8.dequantize_reference(xq, xs).astype(np.float64)
    words = A8.repack_reference(packed).view("<u4").reshape(16, 4, 4)       # [row, q, G]
    lo, hi = A8.e4m3_words_reference(words)
    xw = xq.view("<u4").reshape(8, 32)                                        # [col, word]

    def bytes4(w):
        return _e4m3(np.array([w], np.uint32).view(np.uint8))

    acc = np.zeros((16, 8))
    for G in range(4):
        def regs(g, q, G=G):
            a = []
            for i in range(4):
                h, half = dt.fp8_a_source(i)
                a.append(bytes4((lo, hi)[half][g + 8 * h, q, G]))
            return (*a, *(bytes4(xw[g, dt.fp8_x_word(G, q, j)]) for j in range(2)))

        c = _mma_m16n8k32(regs)
        for lane in range(32):
            g, q = lane // 4, lane % 4
            for i in range(4):   # c_i sits at row g + 8(i // 2), column 2q + i % 2 (PTX)
                row, col = g + 8 * (i // 2), 2 * q + i % 2
                h, cc = dt.fp8_scale_of(i)
                wf = np.exp2(float(wscale[g + 8 * h, G]) - 127 + 6)
                af = np.exp2(float(xs[2 * q + cc, G]) - 127)
                acc[row, col] += c[row, col] * wf * af
    np.testing.assert_allclose(acc, Wv @ Xv.T, rtol=1e-12, atol=1e-12)


def test_tir_recipes_on_llvm():
    """The TIR expressions the kernel uses, compiled for llvm on random words: e4m3_lo /
    e4m3_hi equal the numpy recipe (itself checked against the E2M1 table above), and
    scale_factor gives 2^(byte - 127) of each byte of activation words, 2^(byte - 121) of
    weight words plus WEIGHT_BIAS4 (bytes up to MAX_WEIGHT_SCALE_BYTE)."""
    from tvm.script import tirx as T

    @T.prim_func(private=True)
    def recipes(w_h: T.handle, lo_h: T.handle, hi_h: T.handle, af_h: T.handle, wf_h: T.handle):
        n = T.int64()
        w = T.match_buffer(w_h, (n,), "uint32")
        lo = T.match_buffer(lo_h, (n,), "uint32")
        hi = T.match_buffer(hi_h, (n,), "uint32")
        af = T.match_buffer(af_h, (n, 4), "float32")
        wf = T.match_buffer(wf_h, (n, 4), "float32")
        for i in range(n):
            lo[i] = A8.e4m3_lo(w[i])
            hi[i] = A8.e4m3_hi(w[i])
            for g in T.unroll(4):
                af[i, g] = A8.scale_factor(w[i], g)
                wf[i, g] = A8.scale_factor(w[i] + T.uint32(A8.WEIGHT_BIAS4), g)

    rng = np.random.default_rng(5)
    n = 37
    w = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    ws = rng.integers(1, A8.MAX_WEIGHT_SCALE_BYTE + 1, (n, 4)).astype(np.uint8).view("<u4").reshape(n)
    lib = tvm.compile(tvm.IRModule({"r": recipes.with_attr("global_symbol", "r")}), target="llvm")
    out = [tvm.runtime.tensor(np.zeros(n, np.uint32)), tvm.runtime.tensor(np.zeros(n, np.uint32)),
           tvm.runtime.tensor(np.zeros((n, 4), np.float32)), tvm.runtime.tensor(np.zeros((n, 4), np.float32))]
    lib["r"](tvm.runtime.tensor(w), *out)
    want_lo, want_hi = A8.e4m3_words_reference(w)
    np.testing.assert_array_equal(out[0].numpy(), want_lo)
    np.testing.assert_array_equal(out[1].numpy(), want_hi)
    act_bytes = ws.view(np.uint8).reshape(n, 4).astype(np.float64)
    lib["r"](tvm.runtime.tensor(ws), *out)
    np.testing.assert_array_equal(out[2].numpy(), np.exp2(act_bytes - 127).astype(np.float32))
    np.testing.assert_array_equal(out[3].numpy(), np.exp2(act_bytes - 121).astype(np.float32))


def test_weight_scale_check_names_the_tensor():
    A8.check_weight_scales(np.array([[0, 127, A8.MAX_WEIGHT_SCALE_BYTE]], np.uint8), "ok")
    with pytest.raises(ValueError, match=r"tensor w1.weight_scale: E8M0 scale byte 255 at \[0, 1\]"):
        A8.check_weight_scales(np.array([[3, 255]], np.uint8), "w1.weight_scale")
