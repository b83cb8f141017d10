"""The Hopper dense kernels (schedules/dense_prefill_wgmma.py, dense_splitk_wgmma.py) without a GPU: copy,
accumulator and tile mappings cover their tiles exactly once, its errors, its splice into a
fused projection with an epilogue, and its CUDA (wgmma count, no spills). GPU numerics:
tests/gpu/check_dense_decode.py (odd sizes, 1..1000 tokens, against torch) and
benchmarks/moe_layer.py (the K3 MoE layer against a torch reference) on the H200."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers_tvm import fused_module, needs_nvcc, ptxas_report, sm90a_cuda_source

from schedules import dense_decode_tc as ddt
from schedules import dense_prefill_wgmma as dpw
from schedules import dense_splitk_wgmma as dsk
from schedules.wgmma_ptx import swizzle128_word


@pytest.mark.parametrize("bn", [128, 256])
def test_producer_copies_fill_every_slot_of_a_stage_once(bn):
    """The producer warpgroup's copies of one K step: every (row, 16-byte chunk) of the token
    tile (BM rows) and the weight tile (bn rows) once, each into its own swizzled slot, with the
    slot's swizzle the same for all of a thread's copies (row % 8 fixed)."""
    for rows in (dpw.BM, bn):
        seen = set()
        for p in range(dpw.NP):
            for j in range(rows // 16):
                r, c = dpw.copy_chunk(p, j)
                assert r % 8 == (p // 8) % 8
                seen.add((r, c))
        assert seen == {(r, c) for r in range(rows) for c in range(8)}
        words = {swizzle128_word(r, c) for r, c in seen}
        assert words == set(range(0, rows * 32, 4))


@pytest.mark.parametrize("bn", [128, 256])
def test_accumulators_cover_the_tile_once(bn):
    """The consumers' accumulators (two warpgroups of 128 threads, bn / 2 each) hold every
    (token, weight row) of the 128 × bn tile once; warp w's lane (g, q) owns tokens 16w + g,
    16w + g + 8 and rows 2q, 2q + 1 of each n8 column block (the wgmma D fragment)."""
    seen = []
    for tx in range(dpw.NC):
        for a in range(bn // 2):
            t, r = dpw.acc_position(tx % 128, a)
            seen.append((tx // 128 * 64 + t, r))
    assert sorted(seen) == [(t, r) for t in range(dpw.BM) for r in range(bn)]
    # thread 37: warp 1, lane 5 (g 1, q 1); accumulator 6: n8 block 1, c 2 (token + 8, even row)
    assert dpw.acc_position(37, 6) == (16 * 1 + 1 + 8, 8 * 1 + 2 * 1)


@pytest.mark.parametrize("tiles_m,tiles_n,group", [(13, 3, 8), (1, 28, 8), (9, 5, 4), (64, 14, 8), (7, 2, 1)])
def test_tile_order_visits_every_tile_once(tiles_m, tiles_n, group):
    """Blocks 0 .. tiles_m·tiles_n - 1 map to every (token tile, row tile) once, in groups of
    ``group`` token tiles with the token tile fastest (the last group may be short)."""
    got = [dpw.tile_of(b, tiles_m, tiles_n, group) for b in range(tiles_m * tiles_n)]
    assert sorted(got) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]
    if tiles_m > 1 and group > 1:
        assert got[1] == (1, 0)  # token tile fastest
    assert all(m < group for m, _ in got[:group * tiles_n])


def test_fits_and_errors():
    assert dpw.tile_rows(7168) == 256 and dpw.tile_rows(896) == 128 and dpw.tile_rows(96) is None
    assert dpw.fits(3584, 7168) and dpw.fits(384, 192)
    assert not dpw.fits(96, 256) and not dpw.fits(256, 100)
    with pytest.raises(ValueError, match="multiple of 128"):
        dpw.dense_wgmma_macro(200, 128)
    with pytest.raises(ValueError, match="stages"):
        dpw.dense_wgmma_macro(256, 128, stages=1)
    with pytest.raises(ValueError, match="shared memory"):  # 5 stages of 48 KiB
        dpw.dense_wgmma_macro(256, 128, stages=5)
    assert dpw.smem_bytes(256) <= dpw.SMEM_LIMIT


def _fused(body, rows, width):
    """The model pipeline's fused PrimFuncs (FuseTransposeMatmul .. FuseTIR) of ``body(m, x,
    r)`` with a bf16 weight ``m.w [rows, width]``, ``x [n, width]``, ``r [n, rows]``."""
    import tvm
    from tvm.relax.frontend import nn

    class M(nn.Module):
        def __init__(self):
            self.w = nn.Parameter((rows, width), "bfloat16")

        def forward(self, x, r):
            return body(self, x, r)

    mod, _ = M().export_tvm(spec={"forward": {"x": nn.spec.Tensor(["n", width], "bfloat16"),
                                              "r": nn.spec.Tensor(["n", rows], "bfloat16")}})
    mod = fused_module(mod)
    return [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


def test_splice_keeps_the_fused_epilogue_and_rejects_what_does_not_fit():
    """Spliced into a projection with a fused epilogue (tanh, sigmoid, residual add), the
    kernel stores through that epilogue; a 64-row projection (not a multiple of 128) is left to
    the decode kernel."""
    from tvm.relax.frontend.nn import op

    def body(m, x, r):
        a = op.astype(op.matmul(x, op.permute_dims(m.w, [1, 0]), out_dtype="float32"), "bfloat16")
        return op.tanh(a) * op.sigmoid(a) + r

    (f,) = _fused(body, 384, 192)
    src = str(ddt.splice_body(f, dpw.dense_wgmma_macro, dpw.fits))
    assert "k3_wgmma_m64n128k16_bf16_ss" in src and "T.tanh" in src and "T.sigmoid" in src, src[-800:]
    assert " + r[" in src
    (g,) = _fused(body, 64, 192)
    assert ddt.splice_body(g) is not None  # the decode kernel fits it
    assert ddt.splice_body(g, dpw.dense_wgmma_macro, dpw.fits) is None


@needs_nvcc
def test_cuda_has_four_wgmmas_per_k_step_and_no_spills(tmp_path):
    src = sm90a_cuda_source(dpw.dense_wgmma_kernel(3584, 7168, "bfloat16"))
    kernel = src[src.index('extern "C" __global__'):]
    # one k16 slice per wgmma, four per K step of 64 inputs, 256-row tiles
    assert len(re.findall(r"k3_wgmma_m64n256k16_bf16_ss\(\(&", kernel)) == 4
    assert "k3_setmaxnreg_dec40" in kernel and "k3_setmaxnreg_inc232" in kernel
    assert "__launch_bounds__(384, 1)" in kernel
    assert "0 bytes spill stores" in ptxas_report(src, tmp_path)


# ------------------------------------------------------------------ split-K kernel (batched decode)
@pytest.mark.parametrize("rows,width", [(3584, 7168), (7168, 3584), (6144, 7168), (896, 7168), (384, 192), (128, 64)])
def test_splits_divide_k_fill_the_machine_and_keep_the_pipeline_deep(rows, width):
    """choose_splits: a divisor of the K steps, at most TARGET_BLOCKS blocks, at least MIN_STEPS
    steps per split where the width allows, and the largest such divisor."""
    nk = width // 64
    for target in (dsk.TARGET_BLOCKS, dsk.TARGET_BLOCKS // 2):
        s = dsk.choose_splits(rows, width, target)
        assert nk % s == 0
        ok = [d for d in range(1, nk + 1)
              if nk % d == 0 and rows // dsk.BN * d <= target and nk // d >= dsk.MIN_STEPS]
        assert s == (max(ok) if ok else 1)
    assert dsk.choose_splits(3584, 7168) == 8 and dsk.choose_splits(3584, 7168, 132) == 4


def test_splitk_errors():
    with pytest.raises(ValueError, match="multiple of 128"):
        dsk.dense_splitk_macro(96, 128)
    with pytest.raises(ValueError, match="do not divide"):
        dsk.dense_splitk_macro(128, 320, splits=3)
    with pytest.raises(ValueError, match="two blocks per SM"):
        dsk.dense_splitk_macro(128, 256, stages=5)


@needs_nvcc
def test_splitk_cuda_two_kernels_two_blocks_per_sm_no_spills(tmp_path):
    src = sm90a_cuda_source(dsk.dense_splitk_kernel(3584, 7168, "bfloat16"))
    # the split GEMM (two blocks per SM, four k16 wgmmas per K step) and the reduction
    assert "__launch_bounds__(256, 2) dense_kernel(" in src and "dense_kernel_1(" in src
    assert len(re.findall(r"k3_wgmma_m64n128k16_bf16_ss\(\(&", src)) == 4
    assert ptxas_report(src, tmp_path).count("0 bytes spill stores") == 2


# ------------------------------------------------------------------ byte-level emulation
def _descriptor_rows(smem: np.ndarray, start_unit: int, rows: int) -> np.ndarray:
    """``rows`` × 16 bf16 elements that a K-major, 128-byte-swizzle matrix descriptor whose
    start address is ``start_unit`` 16-byte units reads from ``smem`` (a flat array of bf16
    slots), as PTX ISA 9.7.15.5.1 defines it, independently of the kernels' helpers: rows of
    128 bytes, groups of 8 rows 1024 bytes apart (the stride byte offset), and in each 1024-byte
    atom the 16-byte chunk index XOR-ed with address bits 7-9 (the row within the atom)."""
    r = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    addr = start_unit * 16 + (r // 8) * 1024 + (r % 8) * 128 + k * 2
    addr = addr ^ (((addr >> 7) & 7) << 4)
    return smem[addr // 2]


def _emulate_stage(x_rows: np.ndarray, w_rows: np.ndarray, a_rows: int, b_rows: int, stage: int,
                   stages: int) -> np.ndarray:
    """One K step of 64 inputs through the pipeline as the kernels address it: the producer
    threads' copies (``copy_chunk``, ``stage_word``) into a stage of a NaN-filled shared memory,
    then the consumers' descriptors (``stage_desc``) read back through the hardware's rule
    (:func:`_descriptor_rows`); returns the product tokens × weight rows (a_rows × b_rows)."""
    sw = (a_rows + b_rows) * 32
    smem = np.full(stages * sw * 2, np.nan)
    for p in range(dpw.NP):
        for weights, src, nrows in ((False, x_rows, a_rows), (True, w_rows, b_rows)):
            for j in range(nrows // 16):
                r, c = dpw.copy_chunk(p, j)
                word = dpw.stage_word(stage, r, c, a_rows, b_rows, weights)
                smem[word * 2 + np.arange(8)] = src[r, c * 8 + np.arange(8)]
    out = np.zeros((a_rows, b_rows))
    for a_row0 in range(0, a_rows, 64):  # one 64-row wgmma A per warpgroup
        for s in range(4):
            a = _descriptor_rows(smem, dpw.stage_desc(stage, s, a_rows, b_rows, False, a_row0), 64)
            b = _descriptor_rows(smem, dpw.stage_desc(stage, s, a_rows, b_rows, True), b_rows)
            assert not np.isnan(a).any() and not np.isnan(b).any()
            out[a_row0:a_row0 + 64] += a @ b.T
    return out


@pytest.mark.parametrize("a_rows,b_rows,stage", [(128, 256, 0), (128, 256, 3), (128, 128, 2), (64, 128, 1)])
def test_copies_and_descriptors_meet_in_shared_memory(a_rows, b_rows, stage):
    """The producers' copy addresses and the consumers' descriptor offsets (the helpers the
    pipeline macros use) put every token and weight element where the hardware's 128-byte
    swizzle reads it: a K step through emulated shared memory equals x @ wᵀ for the step's 64
    inputs, at any stage (prefill kernel: 128 × 256 and 128 × 128 tiles; split-K: 64 × 128)."""
    rng = np.random.default_rng(stage + a_rows + b_rows)
    x = rng.integers(-4, 5, (a_rows, 64)).astype(np.float64)
    w = rng.integers(-4, 5, (b_rows, 64)).astype(np.float64)
    got = _emulate_stage(x, w, a_rows, b_rows, stage, 4)
    np.testing.assert_array_equal(got, x @ w.T)


def test_swizzle_helper_is_the_descriptor_rule():
    """swizzle128_word (the copies' layout) against the independent address rule of
    _descriptor_rows: chunk c of row r (inputs 8c .. 8c + 7) is what the descriptor of k16
    slice c // 2 reads as that row's k = 8·(c % 2) .. + 7, for all 16 rows of two atoms."""
    from schedules.wgmma_ptx import swizzle128_word

    smem = np.arange(16 * 64, dtype=np.float64)  # each bf16 slot tagged with its index
    for r in range(16):
        for c in range(8):
            got = _descriptor_rows(smem, 2 * (c // 2), 16)[r, c % 2 * 8:c % 2 * 8 + 8]
            np.testing.assert_array_equal(got, swizzle128_word(r, c) * 2 + np.arange(8))
