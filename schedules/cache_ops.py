"""Copy kernels on pooled cache tensors (MLA pages), with their numpy reference.

A pool is viewed as ``[L, N, R]``: L layers, N slots or pages, R elements each.
"""

from __future__ import annotations

import numpy as np
from tvm.script import tirx as T


def page_copy_kernel(row: int, dtype: str, gpu: bool = False):
    """``pool[:, dst] = pool[:, src]`` for every layer of a pool ``[L, N, row]`` (in place).

    PrimFunc arguments: ``pool`` (arg 0, updated in place), ``src`` int64, ``dst`` int64.
    Used to fork a sequence's MLA cache pages. ``gpu=True``: a thread-bound variant
    (blockIdx.y over layers, blockIdx.x/threadIdx.x over the row).
    """
    if gpu:
        return _page_copy_gpu(row, dtype)

    @T.prim_func(private=True)
    def page_copy(pool_h: T.handle, src: T.int64, dst: T.int64):
        T.func_attr({"tir.noalias": True})
        n_layer, n_page = T.int64(), T.int64()
        pool = T.match_buffer(pool_h, (n_layer, n_page, row), dtype)
        for l in range(n_layer):
            for r in T.parallel(row):
                pool[l, dst, r] = pool[l, src, r]

    return page_copy


def _page_copy_gpu(row: int, dtype: str):
    TX = min(256, row)
    NB = (row + TX - 1) // TX

    @T.prim_func(private=True)
    def page_copy_gpu(pool_h: T.handle, src: T.int64, dst: T.int64):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        n_layer, n_page = T.int64(), T.int64()
        pool = T.match_buffer(pool_h, (n_layer, n_page, row), dtype)
        for l in T.thread_binding(n_layer, thread="blockIdx.y"):
            for bx in T.thread_binding(NB, thread="blockIdx.x"):
                for tx in T.thread_binding(TX, thread="threadIdx.x"):
                    if bx * TX + tx < row:
                        pool[l, dst, bx * TX + tx] = pool[l, src, bx * TX + tx]

    return page_copy_gpu


def page_copy_reference(pool: np.ndarray, src: int, dst: int) -> None:
    """``pool[:, dst] = pool[:, src]`` in place (numpy)."""
    pool[:, dst] = pool[:, src]
