"""Row copy / reset kernels on pooled state tensors, with their numpy references.

A pool is viewed as ``[L, N, R]``: L layers, N slots (KDA state, conv windows) or pages (MLA
cache), R elements each. The runtime forks a sequence by copying its slot / pages and starts
one from a zeroed slot; both act on every layer at once, in place (argument 0).
"""

from __future__ import annotations

import functools

import numpy as np
from tvm.script import tirx as T

_GPU_THREADS = 256


def pool_copy_kernel(row: int, dtype: str, gpu: bool = False):
    """``pool[:, dst] = pool[:, src]`` for every layer of a pool ``[L, N, row]`` (in place).

    PrimFunc arguments: ``pool`` (arg 0, updated in place), ``src`` int64, ``dst`` int64.
    ``gpu``: blockIdx.y over layers, (blockIdx.x, threadIdx.x) over the row.
    Reference: :func:`pool_copy_reference`.
    """
    if gpu:
        TX = min(_GPU_THREADS, row)
        NB = (row + TX - 1) // TX

        @T.prim_func(private=True)
        def pool_copy_gpu(pool_h: T.handle, src: T.int64, dst: T.int64):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n_layer, n_row = T.int64(), T.int64()
            pool = T.match_buffer(pool_h, (n_layer, n_row, row), dtype)
            for l in T.thread_binding(n_layer, thread="blockIdx.y"):
                for bx in T.thread_binding(NB, thread="blockIdx.x"):
                    for tx in T.thread_binding(TX, thread="threadIdx.x"):
                        if bx * TX + tx < row:
                            pool[l, dst, bx * TX + tx] = pool[l, src, bx * TX + tx]

        return pool_copy_gpu

    @T.prim_func(private=True)
    def pool_copy(pool_h: T.handle, src: T.int64, dst: T.int64):
        T.func_attr({"tir.noalias": True})
        n_layer, n_row = T.int64(), T.int64()
        pool = T.match_buffer(pool_h, (n_layer, n_row, row), dtype)
        for l in range(n_layer):
            for r in T.parallel(row):
                pool[l, dst, r] = pool[l, src, r]

    return pool_copy


def pool_reset_kernel(row: int, dtype: str, gpu: bool = False):
    """``pool[:, slot] = 0`` for every layer of a pool ``[L, N, row]`` (in place).

    PrimFunc arguments: ``pool`` (arg 0, updated in place), ``slot`` int64.
    Reference: :func:`pool_reset_reference`.
    """
    if gpu:
        TX = min(_GPU_THREADS, row)
        NB = (row + TX - 1) // TX

        @T.prim_func(private=True)
        def pool_reset_gpu(pool_h: T.handle, slot: T.int64):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n_layer, n_row = T.int64(), T.int64()
            pool = T.match_buffer(pool_h, (n_layer, n_row, row), dtype)
            for l in T.thread_binding(n_layer, thread="blockIdx.y"):
                for bx in T.thread_binding(NB, thread="blockIdx.x"):
                    for tx in T.thread_binding(TX, thread="threadIdx.x"):
                        if bx * TX + tx < row:
                            pool[l, slot, bx * TX + tx] = T.Cast(dtype, 0)

        return pool_reset_gpu

    @T.prim_func(private=True)
    def pool_reset(pool_h: T.handle, slot: T.int64):
        T.func_attr({"tir.noalias": True})
        n_layer, n_row = T.int64(), T.int64()
        pool = T.match_buffer(pool_h, (n_layer, n_row, row), dtype)
        for l in range(n_layer):
            for r in T.parallel(row):
                pool[l, slot, r] = T.Cast(dtype, 0)

    return pool_reset


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def page_copy_kernel(row: int, dtype: str, gpu: bool = False):
    """Fork MLA cache pages: :func:`pool_copy_kernel` on ``mla_cache`` viewed as
    ``[layers, pages, page_size × cache_dim]``."""
    return pool_copy_kernel(row, dtype, gpu)


def pool_copy_reference(pool: np.ndarray, src: int, dst: int) -> None:
    """``pool[:, dst] = pool[:, src]`` in place (numpy)."""
    pool[:, dst] = pool[:, src]


def pool_reset_reference(pool: np.ndarray, slot: int) -> None:
    """``pool[:, slot] = 0`` in place (numpy)."""
    pool[:, slot] = 0


page_copy_reference = pool_copy_reference
