"""Compile an exported K3 Relax module for a target (the Relax + TIR pipeline).

``build_module(mod, target_spec)`` returns a ``tvm.relax.VMExecutable`` ready for
``export_library``. CPU targets use TVM's default pipeline; CUDA targets additionally get
GPU schedules (hand-written kernels' GPU variants, dlight defaults for the rest) and have
their device code precompiled to a fatbin (k3_compile.device_code), so loading the library
needs neither nvcc nor the TVM compiler.

GPU pipeline (:func:`gpu_relax_pipeline`, the pieces of ``tvm.relax.backend.cuda.pipeline``
written out so that the schedule step is ours):

1. library dispatch (sampling, sort/scan);
2. ``LegalizeOps`` → ``AnnotateTIROpPattern`` → ``FoldConstant`` → ``FuseOps`` → ``FuseTIR``;
3. dlight ``ApplyDefaultSchedule(Matmul, GEMV, Reduction, GeneralReduction, Fallback)`` on
   every PrimFunc that is not already scheduled: the hand-written kernels' GPU variants
   (``export_model(..., gpu=True)``) carry ``tirx.is_scheduled`` and are left alone;
4. dataflow lowering and finalization (memory planning, VM shape lowering).

The module must have been exported with ``gpu=True`` (:func:`k3_compile.pipeline.export_model`)
for a GPU target: the CPU variants of the hand-written kernels have no thread bindings and
fail TVM's memory verification on a GPU.
"""

from __future__ import annotations

from targets.base import TargetSpec


_OPAQUE = 8  # relax OpPatternKind::kOpaque


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


def gpu_relax_pipeline(target, cuda_graph: bool = False):
    """The Relax pipeline for GPU targets (see the module docstring).

    ``cuda_graph``: on CUDA, ``RewriteCUDAGraph`` lifts the regions of each function whose
    inputs are only the weights and static allocations into graphs captured on first run and
    replayed after (per distinct symbolic shape), cutting kernel-launch overhead in decode.
    The batch inputs and the state pools are function inputs, so regions that read them are
    not captured (their addresses change between calls). Off by default: on the H200 k3-nano
    gave the same tokens with and without it and no decode speed-up (242 vs 243 tokens/s at
    batch 1), since the host side of each step and the uncaptured regions dominate."""
    import tvm
    from tvm import relax
    from tvm.s_tir import dlight as dl

    rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
             dl.gpu.Fallback()]
    if target.kind.name == "metal":
        # dlight's Matmul rule tensorizes with simdgroup intrinsics on Metal, and that
        # segfaults inside s_tir Tensorize in TVM 0.27 (seen on k3-nano); GEMV/Fallback cover it.
        rules = rules[1:]

    @tvm.transform.module_pass(opt_level=0, name="K3GPUPipeline")
    def _pipeline(mod, _ctx):
        passes = [
            relax.backend.DispatchSampling(),
            relax.backend.DispatchSortScan(),
            relax.transform.LegalizeOps(),
            relax.transform.AnnotateTIROpPattern(),
            _mark_scheduled_opaque(),
            relax.transform.FoldConstant(),
            relax.transform.FuseOps(),
            relax.transform.FuseTIR(),
            relax.transform.DeadCodeElimination(),
            dl.ApplyDefaultSchedule(*rules),
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


def build_module(mod, target_spec: TargetSpec, *, keep_dir=None, cuda_graph: bool = False):
    """Compile ``mod`` (from :func:`k3_compile.pipeline.export_model`) for ``target_spec``.

    Args:
        mod: the Relax ``IRModule`` (exported with ``gpu=True`` for GPU targets).
        target_spec: a :class:`targets.base.TargetSpec`.
        keep_dir: CUDA targets: keep the generated ``.cu`` sources and fatbins there.
        cuda_graph: CUDA targets: capture launch sequences as CUDA graphs
            (see :func:`gpu_relax_pipeline`).

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
            return tvm.compile(mod, target=target, relax_pipeline=gpu_relax_pipeline(target))
        from .device_code import build_cuda

        return build_cuda(mod, target_spec, keep_dir=keep_dir,
                          relax_pipeline=gpu_relax_pipeline(target, cuda_graph=cuda_graph))
