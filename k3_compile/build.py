"""Compile an exported K3 Relax module for a target (the Relax + TIR pipeline).

``build_module(mod, target_spec)`` returns a ``tvm.relax.VMExecutable`` ready for
``export_library``. CPU targets use TVM's default pipeline; CUDA targets additionally get
GPU schedules (hand-written kernels' GPU variants, dlight defaults for the rest) and have
their device code precompiled to a fatbin (k3_compile.device_code), so loading the library
needs neither nvcc nor the TVM compiler.

GPU pipeline (:func:`gpu_relax_pipeline`, the pieces of ``tvm.relax.backend.cuda.pipeline``
written out so that the schedule step is ours):

1. library dispatch (sampling, sort/scan);
2. ``FuseTransposeMatmul`` (``x @ Wᵀ`` as one ``NT_matmul`` on the stored weight) →
   ``LegalizeOps`` → ``AnnotateTIROpPattern`` → ``FoldConstant`` → ``FuseOps`` → ``FuseTIR``;
3. on CUDA, :func:`k3_compile.sibling_gemvs.fuse_sibling_gemvs` (the projections of one
   activation — a KDA layer's q/k/v/f_a/g, MLA's q_a/kv_a, the MoE router, latent down and
   shared up projections — merged into one function: one GEMV launch for all at 1-2 tokens);
4. :func:`low_batch_specialize` (dense matmuls branch on the token count: at 1-2 tokens
   schedules/dense_gemv.py's GEMV on CUDA for the bf16 projections it fits, else dlight's
   LowBatchGEMV; then on CUDA the tensor-core kernel of schedules/dense_decode_tc.py for
   the bf16 projections it fits — on sm_90a the split-K and prefill ``wgmma`` kernels of
   schedules/dense_splitk_wgmma.py and dense_prefill_wgmma.py from 17 and 256 tokens —, else
   dlight's tiled one), then dlight
   ``ApplyDefaultSchedule(Matmul, GEMV, Reduction, GeneralReduction, Fallback)`` on
   every PrimFunc that is not already scheduled: the hand-written kernels' GPU variants
   (``export_model(..., gpu=True)``) carry ``tirx.is_scheduled`` and are left alone;
5. dataflow lowering and finalization (memory planning, VM shape lowering).

The module must have been exported with ``gpu=True`` (:func:`k3_compile.pipeline.export_model`)
for a GPU target: the CPU variants of the hand-written kernels have no thread bindings and
fail TVM's memory verification on a GPU.
"""

from __future__ import annotations

from targets.base import TargetSpec


_OPAQUE = 8  # relax OpPatternKind::kOpaque

# Low-batch specialization of the dense matmuls (:func:`low_batch_specialize`): for a row count
# up to ``limit``, dlight's LowBatchGEMV schedule with the rows padded to ``bucket``; above the
# last limit, dlight's Matmul schedule. Measured on the H200 with benchmarks/moe_layer.py (the
# MoE layer's dense projections, moe_layer_lowbatch_h200_2026-11-30.json): bucket 1 at one
# token is 7% faster than bucket 2; bucket 4 up to 8 tokens beats 8; above 8 tokens the
# LowBatchGEMV schedules (CUDA cores) are slower than the Matmul one (buckets 16 / 32 / 64 at
# 64 tokens: 1.8x / 3.9x / 6.2x its time).
LOW_BATCH = ((1, 1), (2, 2), (8, 4))
# On CUDA, the bf16 projections that schedules/dense_decode_tc.py fits take its tensor-core kernel
# from this many tokens on; LowBatchGEMV keeps 1 and 2 tokens, where the two are even
# (dense_decode_h200_2026-11-30.json: 26.1 vs ~24.6 us for 6144 x 7168 at one token); at 8 / 64
# tokens the kernel takes 26 / 58 us there, dlight 118 / ~620, and at prefill sizes dlight's
# Matmul runs bf16 on CUDA cores (18 TFLOP/s, moe_layer_h200_2026-11-30.json).
TENSOR_CORE_FROM = 3
# On targets with Hopper's wgmma, the projections with rows a multiple of 128 take the split-K
# kernel (schedules/dense_splitk_wgmma.py) from SPLITK_FROM tokens and the prefill kernel
# (schedules/dense_prefill_wgmma.py) from WGMMA_FROM tokens. Measured on the H200 at the K3 MoE
# layer's shapes (dense_splitk_h200_2026-11-30.json): at 16 tokens the decode kernel is faster on
# 4 of 5 shapes, from 24 the split-K one (at 64 tokens 12-34 us against 32-96); at 192 tokens
# split-K and the prefill kernel are even (242 vs 272 us over four shapes), at 256 the prefill
# kernel is faster (268 vs 276; at 8192 tokens 0.78-0.94x cuBLAS's time).
SPLITK_FROM = 17
WGMMA_FROM = 256
# Static shared memory per block of the kernels dlight schedules (no opt-in): given to the
# dlight rules, which otherwise warn for every function and assume the same.
DLIGHT_SMEM = 48 * 1024


def _mark_scheduled_opaque():
    """Give every already-scheduled PrimFunc the op pattern "opaque", so that ``FuseOps``
    keeps the hand-written GPU kernels as they are (fusing them into a neighbour would
    merge thread-bound code into an unscheduled function)."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="K3MarkScheduledOpaque")
    def _pass(mod, _ctx):
        updates = {}
        for gv, f in mod.functions_items():
            if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and f.attrs.get("tirx.is_scheduled"):
                updates[gv] = f.with_attr("op_pattern", _OPAQUE)
        for gv, f in updates.items():
            mod[gv] = f
        return mod

    return _pass


def _dlight(func, rule, target):
    """``func`` scheduled by the dlight ``rule`` for ``target``, or None where it does not apply."""
    import tvm
    from tvm.s_tir import dlight as dl

    try:
        with target:
            out = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({"main": func}))["main"]
    except Exception:  # noqa: BLE001 - dlight rules assert on shapes they do not handle
        return None
    return out if out.attrs and out.attrs.get("tirx.is_scheduled") else None


def low_batch_specialize(target, ranges=LOW_BATCH, tensor_cores: bool = True, wgmma: bool = False):
    """Pass: give each unscheduled PrimFunc with one symbolic size (the token count ``n`` of a
    dense matmul, e.g. ``NT_matmul [n, K] x [N, K]``) a body that branches on ``n``.

    Branches, in order: on CUDA targets (``tensor_cores``) the GEMV of
    :mod:`schedules.dense_gemv` for ``n <= MAX_TOKENS`` (2) where it fits (it replaces the
    ranges up to there: 6.1 vs 14.5 µs for the K3 router at one token,
    dense_gemv_h200_2026-11-30.json); dlight's LowBatchGEMV schedule (rows padded to the bucket) for
    ``n <= limit`` of each ``(limit, bucket)`` of ``ranges``; on CUDA targets (``tensor_cores``)
    where the function is a bf16 projection that :func:`schedules.dense_decode_tc.match_dense`
    accepts, the ranges up to :data:`TENSOR_CORE_FROM` - 1 tokens and then the hand-written
    tensor-core kernel for every larger ``n``, with the function's fused epilogue; elsewhere
    dlight's Matmul schedule above the last range. With ``wgmma`` (Hopper), the projections
    with rows a multiple of 128 take :mod:`schedules.dense_splitk_wgmma` from
    :data:`SPLITK_FROM` tokens and :mod:`schedules.dense_prefill_wgmma` from
    :data:`WGMMA_FROM` on. One tiled schedule for every ``n`` reads the
    weights with a few dozen blocks at decode sizes (the MoE layer's dense projections took tens
    of times their HBM time, benchmarks/moe_layer.py); a GEMV schedule for every ``n`` re-reads them per
    bucket at prefill sizes. Every branch computes the whole function, so the branch only
    decides speed. Functions where a dlight schedule does not apply are left to
    :func:`gpu_relax_pipeline`'s default rules. (The LowBatchGEMV / Matmul branching is MLC-LLM's
    low-batch specialization, written here for TVM 0.27.)

    Args:
        target: the ``tvm.target.Target`` the dlight rules schedule for.
        ranges: ``(limit, bucket)`` pairs with increasing limits.
        tensor_cores: use the tensor-core kernel where it applies (CUDA only).
        wgmma: the target has Hopper's warpgroup MMA (sm_90a; CUDA with ``tensor_cores`` only).

    Raises:
        ValueError: ``ranges`` whose limits do not increase.
    """
    import tvm
    from tvm import tirx

    limits = [lim for lim, _ in ranges]
    if limits != sorted(set(limits)):
        raise ValueError(f"low-batch limits must increase, got {limits}")

    @tvm.transform.module_pass(opt_level=0, name="K3LowBatchSpecialize")
    def _pass(mod, _ctx):
        updates = {}
        for gv, f in mod.functions_items():
            if not isinstance(f, tirx.PrimFunc) or (f.attrs and f.attrs.get("tirx.is_scheduled")):
                continue
            out = specialize_one(f, target, ranges, tensor_cores, wgmma)
            if out is not None:
                updates[gv] = out
        for gv, f in updates.items():
            mod[gv] = f
        return mod

    return _pass


def specialize_one(f, target, ranges=LOW_BATCH, tensor_cores: bool = True, wgmma: bool = False,
                   gemv_elsewhere: bool = False):
    """:func:`low_batch_specialize` for one unscheduled PrimFunc ``f``: the scheduled PrimFunc
    (its body branching on the token count), or None where ``f`` is not a matmul with one
    symbolic size that a branch applies to (left to the default rules). ``gemv_elsewhere``:
    the caller runs ``n <= dense_gemv.MAX_TOKENS`` itself (k3_compile/sibling_gemvs.py's
    merged launch), so the body has no branch for those counts where the GEMV fits."""
    import functools

    from tvm import s_tir, tirx
    from tvm.s_tir import dlight as dl

    from schedules import dense_decode_tc as ddt
    from schedules import dense_gemv as dg
    from schedules import dense_prefill_wgmma as dpw
    from schedules import dense_splitk_wgmma as dsk

    use_tc = tensor_cores and target.kind.name == "cuda"
    dims = [d for p in f.params if hasattr(p.ty, "shape") for d in p.ty.shape]
    sizes = {d for d in dims if isinstance(d, tirx.Var)}
    # one symbolic size, used as is (a shape like ``n * 4`` is left to the default rules)
    if len(sizes) != 1 or not all(isinstance(d, (tirx.Var, tirx.IntImm)) for d in dims):
        return None
    (n,) = sizes
    tc = ddt.splice_body(f) if use_tc else None
    wg = (ddt.splice_body(f, dpw.dense_wgmma_macro, dpw.fits)
          if tc is not None and wgmma else None)
    # its workspace sized for the token counts it runs at (else for one token)
    sk = (ddt.splice_body(f, functools.partial(dsk.dense_splitk_macro,
                                               token_range=(SPLITK_FROM, WGMMA_FROM - 1)), dsk.fits)
          if tc is not None and wgmma else None)
    gemv = ddt.splice_body(f, dg.dense_gemv_macro, dg.fits) if tc is not None else None
    tiled = _dlight(f, dl.gpu.Matmul(), target) if tc is None else None
    if tc is None and tiled is None:
        return None
    rs = [(lim, b) for lim, b in ranges if lim < TENSOR_CORE_FROM] if tc is not None else ranges
    if gemv is not None:  # the hand GEMV replaces dlight's up to its token count
        rs = [(lim, b) for lim, b in rs if lim > dg.MAX_TOKENS]
        if gemv_elsewhere:
            gemv = None
    lows = [_dlight(f, dl.gpu.LowBatchGEMV(bucket), target) for _, bucket in rs]
    if any(low is None for low in lows):
        if tc is None:
            return None
        rs, lows = [], []  # the tensor-core kernel alone
    # the tensor-core kernel covers every token count from 1 (tiles of 64 tokens over
    # blockIdx.y); 0 tokens have nothing to compute (and would launch an empty grid)
    body = (tirx.IfThenElse(tirx.op.tvm_thread_invariant(n >= 1), tc, None)
            if tc is not None else tiled.body)
    if sk is not None:
        body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(n >= SPLITK_FROM), sk, body)
    if wg is not None:
        body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(n >= WGMMA_FROM), wg, body)
    for (limit, _), low in reversed(list(zip(rs, lows))):
        body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(n <= limit), low.body, body)
    if gemv is not None:
        body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(n <= dg.MAX_TOKENS), gemv, body)
    body = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    return (f.with_body(body).with_attr("tirx.is_scheduled", True)
            .with_attr("tirx.HoistIfThenElseExprWithBlock", 1))


def _schedule_target(target):
    """``target`` with ``max_shared_memory_per_block`` = :data:`DLIGHT_SMEM` where it has none
    (the dlight rules read it; the hand-written kernels size their own shared memory)."""
    import tvm

    if target.attrs.get("max_shared_memory_per_block") is not None:
        return target
    attrs = dict(target.export())
    host = attrs.pop("host", None)
    attrs["max_shared_memory_per_block"] = DLIGHT_SMEM
    return tvm.target.Target(attrs, host=host) if host else tvm.target.Target(attrs)


def _in_target(target, passes):
    """A pass running ``passes`` inside ``with target``."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="K3ScheduleGPU")
    def _pass(mod, _ctx):
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pass


def gpu_relax_pipeline(target, cuda_graph: bool = False, low_batch=LOW_BATCH, wgmma: bool = False,
                       tensor_cores: bool = True):
    """The Relax pipeline for GPU targets (see the module docstring).

    ``low_batch``: the ``(limit, bucket)`` pairs of :func:`low_batch_specialize` (empty: one
    dlight schedule per function; ignored on Metal, where its tiled branch would crash).

    ``wgmma``: the target has Hopper's warpgroup MMA (:func:`low_batch_specialize`).
    ``tensor_cores``: the dense projections may take the hand-written kernels
    (:func:`low_batch_specialize`; False: dlight's schedules alone, ``k3 compile --generic-kernels``).

    ``cuda_graph``: on CUDA, ``RewriteCUDAGraph`` lifts the regions of each function whose
    inputs are only the weights and static allocations into graphs captured on first run and
    replayed after (per distinct symbolic shape), cutting kernel-launch overhead in decode.
    The batch inputs and the state pools are function inputs, so regions that read them are
    not captured (their addresses change between calls). Off by default: on the H200 k3-nano
    gave the same tokens with and without it and no decode speed-up (242 vs 243 tokens/s at
    batch 1), since the host side of each step and the uncaptured regions dominate."""
    import functools

    import tvm
    from tvm import relax
    from tvm.s_tir import dlight as dl

    from .sibling_gemvs import fuse_sibling_gemvs

    rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
             dl.gpu.Fallback()]
    if target.kind.name == "metal":
        # dlight's Matmul rule tensorizes with simdgroup intrinsics on Metal, and that
        # segfaults inside s_tir Tensorize in TVM 0.27 (seen on k3-nano); GEMV/Fallback cover it.
        # The low-batch specialization's tiled branch is that rule: off on Metal too.
        rules = rules[1:]
        low_batch = ()

    sched = _schedule_target(target)

    @tvm.transform.module_pass(opt_level=0, name="K3GPUPipeline")
    def _pipeline(mod, _ctx):
        passes = [
            relax.backend.DispatchSampling(),
            relax.backend.DispatchSortScan(),
            # x @ permute_dims(W) -> one NT_matmul reading W [out, in] as stored (else the
            # transpose of every weight is materialized per call)
            relax.transform.FuseTransposeMatmul(),
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            _mark_scheduled_opaque(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            relax.transform.DeadCodeElimination(),
            # 1-2 tokens: sibling projections of one activation as one GEMV launch
            *([_in_target(sched, [fuse_sibling_gemvs(functools.partial(
                specialize_one, target=sched, ranges=low_batch, tensor_cores=True,
                wgmma=wgmma))]), relax.transform.DeadCodeElimination()]
              if low_batch and tensor_cores and target.kind.name == "cuda" else []),
            _in_target(sched, [*([low_batch_specialize(sched, low_batch, tensor_cores=tensor_cores,
                                                                          wgmma=wgmma and tensor_cores)] if low_batch else []),
                               dl.ApplyDefaultSchedule(*rules)]),
            relax.transform.RewriteDataflowReshape(),
            relax.transform.ToNonDataflow(),
            relax.transform.RemovePurityChecking(),
            relax.transform.CallTIRRewrite(),
            relax.transform.StaticPlanBlockMemory(),
            *([relax.transform.RewriteCUDAGraph()] if cuda_graph else []),
            relax.transform.LowerAllocTensor(),
            relax.transform.KillAfterLastUse(),
            relax.transform.LowerRuntimeBuiltin(),
            relax.transform.ComputePrimValue(),
            relax.transform.VMShapeLower(),
            relax.transform.AttachGlobalSymbol(),
        ]
        config = {"relax.backend.use_cuda_graph": True} if cuda_graph else {}
        with target, tvm.transform.PassContext(opt_level=3, config=config):
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def unscheduled_gpu_functions(mod) -> list[str]:
    """Names of PrimFuncs of ``mod`` without ``tirx.is_scheduled`` (for diagnostics)."""
    import tvm

    out = []
    for gv, f in mod.functions_items():
        if isinstance(f, tvm.tirx.PrimFunc) and not (f.attrs and f.attrs.get("tirx.is_scheduled")):
            out.append(gv.name_hint)
    return out


def build_module(mod, target_spec: TargetSpec, *, keep_dir=None, cuda_graph: bool = False,
                 low_batch=LOW_BATCH, hand_kernels: bool = True):
    """Compile ``mod`` (from :func:`k3_compile.pipeline.export_model`) for ``target_spec``.

    Args:
        mod: the Relax ``IRModule`` (exported with ``gpu=True`` for GPU targets).
        target_spec: a :class:`targets.base.TargetSpec`.
        keep_dir: CUDA targets: keep the generated ``.cu`` sources and fatbins there.
        cuda_graph: CUDA targets: capture launch sequences as CUDA graphs
            (see :func:`gpu_relax_pipeline`).
        hand_kernels: CUDA targets: the dense projections take the hand-written tensor-core
            kernels (False with ``k3 compile --generic-kernels``: dlight's schedules).
        low_batch: GPU targets: ``(limit, bucket)`` pairs of :func:`low_batch_specialize`
            (empty: one dlight schedule per matmul).

    Raises:
        k3_compile.device_code.DeviceCodeError: nvcc missing or failing for a CUDA target.
    """
    import tvm

    from schedules.barriers import respect_manual_barriers

    if not target_spec.is_gpu:
        return tvm.compile(mod, target=target_spec.tvm_target())
    target = target_spec.tvm_target()
    with respect_manual_barriers():  # hand-pipelined kernels place their own barriers
        if not target_spec.is_cuda:  # Metal, ROCm: TVM's own code generator, same Relax pipeline
            return tvm.compile(mod, target=target,
                               relax_pipeline=gpu_relax_pipeline(target, low_batch=low_batch))
        from .device_code import build_cuda

        return build_cuda(mod, target_spec, keep_dir=keep_dir,
                          relax_pipeline=gpu_relax_pipeline(target, cuda_graph=cuda_graph,
                                                            low_batch=low_batch,
                                                            wgmma=target_spec.features.wgmma,
                                                            tensor_cores=hand_kernels))
