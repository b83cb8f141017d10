"""Plan of the MoE prefill (schedules/moe_mxfp4_prefill_cuda.py) in plain NumPy: the rows per
GEMM tile, the bound of the tile count, and the reference of the sort kernel. No TVM import
at module level, so that the GPU machine's runtime-only TVM can use it (benchmarks/moe.py)."""

from __future__ import annotations

import numpy as np

BM = 128          # rows (token-expert pairs) per tile
BM_WS = 192       # rows per tile of the warp-specialized wgmma kernels (moe_mxfp4_prefill_wgmma.py)
# the wgmma kernels take their warp-specialized form (and the sort BM_WS-row tiles) from this many
# token-expert pairs per expert on average (H200, K3 shapes: 1.3x faster at 146, even at 110, 11%
# slower at 73; benchmarks/results/moe_prefill_ws_h200_2026-11-30.json)
WS_MIN_PAIRS_PER_EXPERT = 112
# ... and only where both GEMMs reduce over at least this many inputs (8 K steps of 64): a short
# K loop leaves the one block per SM of the warp-specialized form waiting on its pipeline
WS_MIN_WIDTH = 512
# ... and below this many pairs per expert on average (prefill chunks of up to ~1300 tokens at K3:
# a few tokens per expert, the GEMMs weight-bound) their plain form on tiles of BM_SMALL rows,
# whose small token stages leave room for 6 stages (H200, K3 shapes,
# benchmarks/results/moe_prefill_small_tiles_h200_2026-11-30.json: 7.8 / 8.1 / 8.6 ms against 9.7 /
# 9.7 / 9.9 ms at 256 / 512 / 1024 tokens (4.6 / 9.1 / 18.3 pairs per expert), 28% slower at 2048)
SMALL_MAX_PAIRS_PER_EXPERT = 24
BM_SMALL = 32
SMALL_STAGES = 6


def warp_specialized_shapes(latent: int, inter: int) -> bool:
    """Whether the MoE prefill of these widths has the warp-specialized form at all (both
    ``latent`` and ``inter`` at least :data:`WS_MIN_WIDTH`; K3: 3584 and 3072)."""
    return min(latent, inter) >= WS_MIN_WIDTH


def tile_rows(num_pairs: int, num_experts: int, warp_specialized: bool) -> int:
    """Rows per tile of the sort's tile table for ``num_pairs`` pairs. Where the wgmma kernels
    have their three forms (``warp_specialized``: the target has them and
    :func:`warp_specialized_shapes`): :data:`BM_WS` from :data:`WS_MIN_PAIRS_PER_EXPERT` pairs
    per expert, :data:`BM_SMALL` below :data:`SMALL_MAX_PAIRS_PER_EXPERT`, else :data:`BM`."""
    if not warp_specialized:
        return BM
    if num_pairs >= WS_MIN_PAIRS_PER_EXPERT * num_experts:
        return BM_WS
    return BM_SMALL if num_pairs < SMALL_MAX_PAIRS_PER_EXPERT * num_experts else BM


def max_tiles(num_pairs, num_experts: int, bm: int = BM):
    """Upper bound of the tile count for any routing: Σ_e ⌈c_e/BM⌉ ≤ ⌈P/BM⌉ + min(P, E) (only
    experts with pairs have tiles; P = pairs, an int or a PrimExpr). It sizes the tile table
    and so the GEMM grids: a 1-token prefill (P = top_k) launches ⌈P/BM⌉ + P row tiles, not E."""
    if isinstance(num_pairs, int):
        return (num_pairs + bm - 1) // bm + min(num_pairs, num_experts)
    from tvm import tirx

    return (num_pairs + bm - 1) // bm + tirx.min(num_pairs, num_experts)


def moe_prefill_plan_reference(expert_ids: np.ndarray, num_experts: int, bm: int = BM):
    """NumPy reference of :func:`schedules.moe_mxfp4_prefill_cuda.moe_sort_kernel`: ``(counts [E], offsets [E+1], tiles
    [num_tiles, 3], order)`` where ``order`` is the stable sort of the pairs by expert (the
    kernel may order the pairs of one expert differently)."""
    flat = np.asarray(expert_ids, np.int64).reshape(-1)
    counts = np.bincount(flat, minlength=num_experts).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    tiles = [(e, offsets[e] + i * bm, offsets[e + 1])
             for e in range(num_experts) for i in range(-(-int(counts[e]) // bm))]
    order = np.argsort(flat, kind="stable").astype(np.int32)
    return counts, offsets, np.array(tiles, np.int32).reshape(-1, 3), order
