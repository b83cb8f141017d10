"""Kernels that place their own ``__syncthreads()``: an opt-out from TVM's shared-memory sync
planner, per function.

TVM 0.27's ``s_tir.transform.ThreadSync(scope)`` plans barriers for ``shared`` / ``shared.dyn``
buffers and gives up with "Cannot insert syncs inside condition" when it wants one inside a
branch — which it does for hand-written pipelines whose hazards it cannot analyse (cp.async
writes through pointers, tiles written and read by different threads through XOR-swizzled
indices, whole-block early exits). Such kernels put ``T.tvm_storage_sync`` between their
phases themselves and carry the function attribute :data:`MANUAL_BARRIERS`.

:func:`respect_manual_barriers` is a context for ``tvm.compile``: while it is active the
``ThreadSync`` passes skip the marked functions and plan every other function as usual (the
dlight-scheduled kernels of a model need them).

What a marked kernel gives up, besides the planner: the ``warp``-scope sync as well (none of
ours uses warp-scope buffers), and protection from ``MergeSharedMemoryAllocations`` (it runs
after ``ThreadSync`` and may place two shared buffers at one address when their accesses do
not overlap in program order; the marked kernels keep every shared buffer live for the whole
kernel, so nothing is reused). The swap of ``s_tir.transform.ThreadSync`` works because TVM
0.27's TIR pipeline looks the pass up when it builds the pass list; it is not thread-safe:
compile one module at a time inside the context.
"""

from __future__ import annotations

import contextlib

MANUAL_BARRIERS = "k3.manual_barriers"


def mark(func):
    """``func`` (a ``tvm.tirx.PrimFunc``) with the :data:`MANUAL_BARRIERS` attribute."""
    return func.with_attr(MANUAL_BARRIERS, True)


def _is_marked(func) -> bool:
    import tvm

    return isinstance(func, tvm.tirx.PrimFunc) and bool(func.attrs and func.attrs.get(MANUAL_BARRIERS))


@contextlib.contextmanager
def respect_manual_barriers():
    """Within this context, ``ThreadSync`` leaves functions marked by :func:`mark` alone."""
    import tvm
    from tvm import s_tir

    orig = s_tir.transform.ThreadSync

    def thread_sync(scope):
        inner = orig(scope)

        @tvm.transform.module_pass(opt_level=0, name=f"ThreadSyncUnlessManual({scope})")
        def planned(mod, _ctx):
            marked = {gv: f for gv, f in mod.functions_items() if _is_marked(f)}
            if not marked:
                return inner(mod)
            rest = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv not in marked},
                                attrs=mod.attrs)
            out = inner(rest)
            for gv, f in marked.items():
                out[gv] = f
            return out

        return planned

    s_tir.transform.ThreadSync = thread_sync
    try:
        yield
    finally:
        s_tir.transform.ThreadSync = orig
