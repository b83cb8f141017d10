"""The 1-2 token dense GEMV (schedules/dense_gemv.py) without a GPU: its layout (every input
of a row read once, by the threads of that row), the kernel's partition of the sums emulated in
NumPy against a plain matmul on odd sizes, its argument checks and its CUDA (all of a group's
weight loads before the first multiply, no spills). GPU numerics: tests/gpu/check_dense_decode.py
(odd sizes, 1 and 2 tokens, against torch) and benchmarks/moe_layer.py (the K3 MoE layer)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers_tvm import needs_nvcc, ptxas_report, sm90a_cuda_source

from schedules import dense_gemv as dg
from schedules.dense_decode_tc import dense_reference


@pytest.mark.parametrize("K", [256, 512, 1280, 3584, 6144, 7168, 16384, 32768 + 256])
def test_layout_reads_each_input_once(K):
    tpr, group, passes = dg.gemv_layout(K)
    assert dg.THREADS % tpr == 0 and tpr % 32 == 0 and group <= dg.MAX_GROUP
    chunks = sorted(c for t in range(tpr) for c in dg.thread_chunks(K, t))
    assert chunks == list(range(K // dg.CHUNK))
    # consecutive threads of a row read consecutive 16-byte chunks (coalesced)
    for p in range(passes):
        for u in range(group):
            row = [dg.chunk_index(p, u, t, tpr, group) for t in range(tpr)]
            assert row == list(range(row[0], row[0] + tpr))


def test_layout_at_k3_shapes():
    """K3's 7168-wide inputs: 128 threads per row, 7 chunks (112 bytes) in flight per thread;
    3584: 64 threads, 7 chunks; 6144: 128 threads, 6 chunks."""
    assert dg.gemv_layout(7168) == (128, 7, 1) and dg.rows_per_block(7168) == 2
    assert dg.gemv_layout(3584) == (64, 7, 1) and dg.rows_per_block(3584) == 4
    assert dg.gemv_layout(6144) == (128, 6, 1)
    assert dg.gemv_layout(32768 + 256) == (32, 3, 43)  # 4128 chunks a row = 32 threads x 3 x 43


@pytest.mark.parametrize("n,N,K", [(1, 8, 256), (2, 40, 1280), (1, 12, 3584), (2, 14, 7168), (2, 3, 16384)])
def test_emulated_sums_equal_the_matmul(n, N, K):
    """The threads' partial sums, added over the row, are x @ wᵀ (dense_reference, fp32)."""
    rng = np.random.default_rng(n * N + K)
    x, w = rng.standard_normal((n, K)), rng.standard_normal((N, K))
    np.testing.assert_allclose(dg.emulate(x, w), dense_reference(x, w), rtol=1e-4, atol=1e-3)


def test_fits_and_errors():
    assert dg.fits(896, 7168) and dg.fits(3584, 7168) and dg.fits(7168, 3584)
    assert not dg.fits(3, 7168)      # 2 rows per block
    assert not dg.fits(64, 192)      # input width not a multiple of 256
    with pytest.raises(ValueError, match="multiple of 256"):
        dg.gemv_layout(320)
    with pytest.raises(ValueError, match="rows a multiple"):
        dg.dense_gemv_kernel(13, 3584)


@needs_nvcc
def test_cuda_loads_a_group_before_multiplying_and_does_not_spill(tmp_path):
    src = sm90a_cuda_source(dg.dense_gemv_kernel(896, 7168, "bfloat16"))
    body = src[src.index('extern "C" __global__'):]
    # the 7 weight chunks of the group (16-byte loads past L1) come before the first token load
    loads = [m.start() for m in re.finditer(r"k3_ld_stream16\(\(&\(wr_ptr\[\d+\]\)\)", body)]
    first_x = body.index("*(uint4*)(xr_ptr + 0) = ")
    assert len(loads) == 7 and max(loads) < first_x, loads
    assert body.count("__shfl_xor_sync") == 5 * dg.MAX_TOKENS
    assert "0 bytes spill stores" in ptxas_report(src, tmp_path)


def _emulate_kernel(x, w, max_tokens=dg.MAX_TOKENS):
    """The kernel's data flow in NumPy through the address helpers its loads, shared-memory
    slots and stores use (weight_word, token_word, partial_slot, final_slot, output_of): each
    thread's fp32 sums over its chunks, each warp's sum left by lane 0 in its slot, each output
    thread adding its row's slots. Words are bf16 pairs (element 2v in the low half)."""
    n, K = x.shape
    N = w.shape[0]
    tpr, G, P = dg.gemv_layout(K)
    R = dg.THREADS // tpr
    xq = x.astype(np.uint16).view(np.uint32).reshape(-1)   # x, w given as raw bf16 bits
    wq = w.astype(np.uint16).view(np.uint32).reshape(-1)

    def bf(words):  # 4 words -> 8 fp32 (low half first)
        lo = (words << 16).view(np.float32)
        hi = (words & 0xFFFF0000).view(np.float32)
        return np.stack([lo, hi], -1).reshape(-1)

    y = np.full((n, N), np.nan, np.float32)
    for blk in range(N // R):
        acc = np.zeros((dg.THREADS, max_tokens), np.float32)
        for tx in range(dg.THREADS):
            for p in range(P):
                for u in range(G):
                    ww = bf(wq[dg.weight_word(blk, tx, p, u, K):][:4])
                    for i in range(min(n, max_tokens)):
                        acc[tx, i] += np.float32(ww @ bf(xq[dg.token_word(i, tx, p, u, K):][:4]))
        red = np.zeros(dg.THREADS // 32 * max_tokens, np.float32)
        for tx in range(0, dg.THREADS, 32):
            for i in range(max_tokens):
                red[dg.partial_slot(tx, i, max_tokens)] = acc[tx:tx + 32, i].sum()
        for tx in range(R * max_tokens):
            i, row = dg.output_of(blk, tx, K, max_tokens)
            if i < n:
                y[i, row] = sum(red[dg.final_slot(tx, wi, K, max_tokens)] for wi in range(tpr // 32))
    return y


@pytest.mark.parametrize("n,N,K", [(1, 8, 256), (2, 16, 1280), (2, 4, 3584), (1, 2, 7168)])
def test_kernel_addresses_compute_the_matmul(n, N, K):
    """The kernel's own address helpers, driven through its data flow (_emulate_kernel), give
    x @ wᵀ on random bf16 inputs of odd sizes; every output written once."""
    import ml_dtypes

    rng = np.random.default_rng(n + N + K)
    x = rng.standard_normal((n, K)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((N, K)).astype(ml_dtypes.bfloat16)
    got = _emulate_kernel(x.view(np.uint16), w.view(np.uint16))
    np.testing.assert_allclose(got, dense_reference(x, w), rtol=1e-4, atol=1e-3)
