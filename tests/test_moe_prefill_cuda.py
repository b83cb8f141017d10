"""The MXFP4 MoE tensor-core kernels (schedules/moe_mxfp4_prefill_cuda.py,
moe_mxfp4_decode_tc.py), on the CPU: the fragment mappings the CUDA code relies on, emulated
lane by lane and checked against a plain matmul (the dequant's bit tricks:
tests/test_mxfp4_tc_layout.py), the plan reference against an independent count, and that
the kernels compile (CUDA source always; fatbin where nvcc exists). The kernels run on the H200
in benchmarks/moe.py and tests/gpu/check_moe_dispatch.py (not in CI: no GPU here)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers_tvm import build_sm90a_fatbin, needs_nvcc
from schedules import moe_mxfp4_prefill_cuda as mp
from schedules import mxfp4_tc_layout as tcl
from schedules import mxfp8_act as A8


def _mma_m16n8k16(regs) -> np.ndarray:
    """What one ``mma.m16n8k16`` computes from the registers ``regs(g, q) -> (a0, a1, a2, a3,
    b0, b1)`` of lane ``(g, q)`` (each a pair of values), laid out as the PTX ISA's fragments
    ("Matrix fragments for mma.m16n8k16": a0 row g k 2q.., a1 row g+8, a2 row g k 2q+8..,
    a3 row g+8; b0 column g k 2q.., b1 k 2q+8..): the 16 x 8 product A @ B."""
    LA, LB = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, q = lane // 4, lane % 4
        a0, a1, a2, a3, b0, b1 = regs(g, q)
        LA[g, 2 * q:2 * q + 2], LA[g + 8, 2 * q:2 * q + 2] = a0, a1
        LA[g, 2 * q + 8:2 * q + 10], LA[g + 8, 2 * q + 8:2 * q + 10] = a2, a3
        LB[2 * q:2 * q + 2, g], LB[2 * q + 8:2 * q + 10, g] = b0, b1
    return LA @ LB


def test_decode_tc_fragments_compute_the_gemv():
    """moe_mxfp4_decode_tc's registers: thread (g, q) holds, for weight rows g and g+8, the
    dequantized words of its current code word (word w = inputs 8·c + 2w, +1 of its 32, c =
    step // 2) and 16 activation words of column g (word w = inputs 2w, 2w+1); the kernel
    hands the mma the words ``a_word(s, i)`` / ``b_word(s, j)``; the 8 steps of a K block
    (:func:`_mma_m16n8k16` each) must give W @ X."""
    from schedules import moe_mxfp4_decode_tc as dt

    rng = np.random.default_rng(4)
    W = rng.standard_normal((16, 128))
    X = rng.standard_normal((128, 8))
    C = np.zeros((16, 8))
    for s in range(8):
        def regs(g, q, s=s):
            base = 32 * q + 8 * (s // 2)
            bf = [W[g + 8 * (w // 4), base + 2 * (w % 4): base + 2 * (w % 4) + 2] for w in range(8)]
            xw = [X[32 * q + 2 * w: 32 * q + 2 * w + 2, g] for w in range(16)]
            return (*(bf[dt.a_word(s, i)] for i in range(4)), *(xw[dt.b_word(s, j)] for j in range(2)))

        C += _mma_m16n8k16(regs)
    np.testing.assert_allclose(C, W @ X, rtol=1e-12, atol=1e-12)


def test_permuted_fragments_compute_the_matmul():
    """mma.m16n8k16 fragment layout (PTX ISA, "Matrix fragments for mma.m16n8k16") with the
    kernel's input order: thread (g, q) holds inputs 8q..8q+7 of each 32 for its A rows g, g+8
    (``aw``: the dequantized weight words, the kernel's ``bf``) and its B column g (``bw``: a
    token's 16-byte read, the kernel's ``ar``); the two mmas per 32 inputs take the registers
    ``mp.MMA_A_REGS`` / ``mp.MMA_B_REGS`` that the kernel passes, and must give A @ B."""
    rng = np.random.default_rng(1)
    A = rng.standard_normal((16, 32))
    B = rng.standard_normal((32, 8))
    C = np.zeros((16, 8))
    for step in range(2):
        def regs(g, q, step=step):
            aw = ([A[g, 8 * q + 2 * i: 8 * q + 2 * i + 2] for i in range(4)]
                  + [A[g + 8, 8 * q + 2 * i: 8 * q + 2 * i + 2] for i in range(4)])
            bw = [B[8 * q + 2 * i: 8 * q + 2 * i + 2, g] for i in range(4)]
            return (*(aw[r] for r in mp.MMA_A_REGS[step]), *(bw[r] for r in mp.MMA_B_REGS[step]))

        C += _mma_m16n8k16(regs)
    np.testing.assert_allclose(C, A @ B, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gate_up,warps_m", [(True, 2), (True, 4), (False, 1), (False, 2), (False, 4)])
def test_grouped_gemm_warp_mapping(gate_up, warps_m):
    """The grouped GEMM's mapping of one block, with the kernel's index helpers: warp (wm, wn)
    multiplies the weight rows ``mp.weight_row`` of its m16 tiles (rows g and g+8 of each) by
    its n8 token tiles, thread (g, q) keeps C element c of (tile u, tile t) in register
    ``acc_word`` and stores it to token ``t·8 + 2q + c % 2``, column ``out_column``. Every
    output of the block must be written once, with the dot product of its token and weight
    row (gate_up: the W1 and the W3 row of that column, the pair SiTU takes)."""
    rng = np.random.default_rng(5)
    BN, BM = 128, mp.BM
    WN = 8 // warps_m
    CPW, WM = BN // WN, BM // warps_m
    NU, NT8 = CPW // 16, WM // 8
    W = rng.standard_normal((BN, 32))       # the block's weight rows (gate_up: 64 W1 + 64 W3)
    X = rng.standard_normal((BM, 32))       # the tile's tokens
    out = {}
    for wm in range(warps_m):
        for wn in range(WN):
            regs = {}  # (lane, accumulator register) -> value, as the mmas leave them
            for u in range(NU):
                rows = [mp.weight_row(gate_up, CPW, wn, 2 * u + r // 8, r % 8) for r in range(16)]
                for t in range(NT8):
                    C = W[rows] @ X[wm * WM + t * 8: wm * WM + t * 8 + 8].T   # the m16 x n8 tile
                    for lane in range(32):
                        g, q = divmod(lane, 4)
                        for c in range(4):
                            # the mma writes its 4 results to the 4 registers from acc_word(.., 0)
                            regs[lane, mp.acc_word(NT8, u, t, 0) + c] = C[g + 8 * (c // 2), 2 * q + c % 2]
            for lane in range(32):  # the epilogue
                g, q = divmod(lane, 4)
                for t in range(NT8):
                    for c in range(4):
                        tok = wm * WM + t * 8 + 2 * q + c % 2
                        for u in range(NU // 2 if gate_up else NU):
                            col = mp.out_column(gate_up, CPW, wn, u, c // 2, g)
                            val = regs[lane, mp.acc_word(NT8, u, t, c)]
                            if gate_up:
                                val = (val, regs[lane, mp.acc_word(NT8, u + NU // 2, t, c)])
                            assert (tok, col) not in out
                            out[tok, col] = val
    cols = 64 if gate_up else BN
    assert sorted(out) == [(tk, cl) for tk in range(BM) for cl in range(cols)]
    for (tok, col), v in out.items():
        want = (X[tok] @ W[col], X[tok] @ W[64 + col]) if gate_up else X[tok] @ W[col]
        np.testing.assert_allclose(v, want, rtol=1e-10, atol=1e-12)


def test_plan_reference():
    ids = np.array([[3, 1], [1, 4], [3, 3], [0, 1]], np.int32)
    counts, offsets, tiles, order = mp.moe_prefill_plan_reference(ids, 6, bm=2)
    np.testing.assert_array_equal(counts, [1, 3, 0, 3, 1, 0])
    np.testing.assert_array_equal(offsets, [0, 1, 4, 4, 7, 8, 8])
    # expert 1 has 3 pairs = 2 tiles of 2 rows; expert 2 none
    np.testing.assert_array_equal(tiles, [[0, 0, 1], [1, 1, 4], [1, 3, 4], [3, 4, 7], [3, 6, 7], [4, 7, 8]])
    np.testing.assert_array_equal(ids.reshape(-1)[order], [0, 1, 1, 1, 3, 3, 3, 4])
    assert len(tiles) <= mp.max_tiles(ids.size, 6, 2)


def test_bad_sizes_rejected():
    from schedules import moe_mxfp4_decode_tc as dt

    with pytest.raises(ValueError, match="multiple of 128"):
        dt.moe_mxfp4_gate_up_tc_kernel(4, 100, 64, 2, 4.0, 25.0)
    with pytest.raises(ValueError, match="input width 100 must be a multiple of 128"):
        mp.moe_grouped_gate_up_kernel(4, 100, 128, 2, 4.0, 25.0)
    with pytest.raises(ValueError, match="output width 96 must be a multiple of 128"):
        mp.moe_grouped_down_kernel(4, 96, 256, 2)
    with pytest.raises(ValueError, match="shared memory"):  # the scale table grows with K
        mp.moe_grouped_gate_up_kernel(4, 128 * 1024, 128, 2, 4.0, 25.0)
    with pytest.raises(ValueError, match="stages must be at least 2"):
        dt.moe_mxfp4_down_tc_kernel(4, 256, 128, 2, stages=1)
    with pytest.raises(ValueError, match="l2_prefetch must be 0, 64, 128 or 256"):
        dt.moe_mxfp4_down_tc_kernel(4, 256, 128, 2, l2_prefetch=32)
    with pytest.raises(ValueError, match="3 K blocks of 128 inputs must split evenly over 2 warps"):
        dt.moe_mxfp4_down_tc_kernel(4, 256, 384, 2, warps=2)
    with pytest.raises(ValueError, match="shared memory"):
        dt.moe_mxfp4_gate_up_tc_kernel(4, 512, 256, 2, 4.0, 25.0, stages=6)
    # exactly 48 KiB of stages and partials: the entry buffers tip it over (ptxas: 49220 bytes)
    with pytest.raises(ValueError, match="shared memory"):
        dt.moe_mxfp4_gate_up_tc_kernel(4, 1024, 256, 2, 4.0, 25.0, warps=8, stages=2)
    with pytest.raises(ValueError, match="over the int32 indexing limit"):
        dt.moe_mxfp4_down_tc_kernel(4096, 8192, 8192, 2)
    with pytest.raises(ValueError, match="too few for the mma's 16 rows of W1 and of W3"):
        mp.moe_grouped_gate_up_kernel(4, 256, 128, 2, 4.0, 25.0, warps_m=1)
    with pytest.raises(ValueError, match="at most 1024 experts"):
        mp.moe_sort_kernel(1025, 2)


def test_tile_bound_holds_for_any_routing():
    """``max_tiles`` (sizes the tile table and the GEMM grids) bounds the reference's tile
    count: one token, all pairs on one expert, every pair on its own expert, random."""
    rng = np.random.default_rng(3)
    for E, k, T in ((896, 16, 1), (896, 16, 3), (40, 8, 500), (7, 2, 1000)):
        for ids in (np.zeros((T, k), np.int32) + np.arange(k, dtype=np.int32),
                    rng.integers(0, E, (T, k)).astype(np.int32),
                    (np.arange(T * k, dtype=np.int32) % E).reshape(T, k)):
            _, _, tiles, _ = mp.moe_prefill_plan_reference(ids, E)
            assert len(tiles) <= mp.max_tiles(T * k, E)
    assert mp.max_tiles(16, 896) == 1 + 16  # a 1-token prefill: 17 row tiles, not 897


def _module():
    import tvm

    from schedules import moe_mxfp4_decode_tc as dt

    fs = {"s": mp.moe_sort_kernel(5, 3),
          "s_ws": mp.moe_sort_kernel(5, 3, bm_large=192, large_from_pairs=600),  # run-time tile rows
          "gu": mp.moe_grouped_gate_up_kernel(5, 256, 192, 3, 4.0, 25.0),
          "d": mp.moe_grouped_down_kernel(5, 256, 384, 3),
          "tc_gu": dt.moe_mxfp4_gate_up_tc_kernel(5, 256, 96, 3, 4.0, 25.0, warps=2),
          "tc_gu4": dt.moe_mxfp4_gate_up_tc_kernel(5, 512, 48, 3, 4.0, None, warps=4, stages=2),
          "tc_d": dt.moe_mxfp4_down_tc_kernel(5, 256, 128, 3, warps=1),
          "tc_gu8": dt.moe_mxfp4_gate_up_tc_kernel(5, 256, 96, 3, 4.0, 25.0, warps=2, act="mxfp8"),
          "tc_d8": dt.moe_mxfp4_down_tc_kernel(5, 256, 128, 3, warps=1, act="mxfp8"),
          "q8": A8.quantize_kernel(96),
          "repack": tcl.repack_kernel(gpu=True), "repack8": A8.repack_kernel(gpu=True)}
    return tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in fs.items()})


@needs_nvcc
def test_kernels_compile_to_fatbin_for_sm90a(tmp_path):
    out = build_sm90a_fatbin(
        "from tests.test_moe_prefill_cuda import _module\n"
        "from schedules.barriers import respect_manual_barriers\n"
        "mod = _module()", tmp_path, contexts="respect_manual_barriers()")
    assert "fatbin" in out


@needs_nvcc
def test_decode_weight_copies_carry_the_l2_prefetch_hint(tmp_path):
    """The decode GEMVs' weight copies ask L2 for 128 bytes by default (the next K block of the
    row comes with the even ones: 0-4% less time on the H200), none with ``l2_prefetch=0``."""
    build_sm90a_fatbin(
        "from schedules import moe_mxfp4_decode_tc as dt\n"
        "from schedules.barriers import respect_manual_barriers\n"
        "d = dt.moe_mxfp4_down_tc_kernel(5, 256, 128, 3, warps=1)\n"
        "g = dt.moe_mxfp4_gate_up_tc_kernel(5, 256, 96, 3, 4.0, 25.0, warps=2, l2_prefetch=0)\n"
        "mod = tvm.IRModule({'d': d.with_attr('global_symbol', 'd'), 'g': g.with_attr('global_symbol', 'g')})",
        tmp_path, contexts="respect_manual_barriers()", keep_src=True)
    src = "".join(p.read_text() for p in (tmp_path / "src").glob("*.cu"))
    assert "cp.async.cg.shared.global.L2::128B " in src
    # d's weight copies hinted, g's plain
    assert "k3_cp_async16_l2_128((" in src and "k3_cp_async16((" in src
