"""From config to runnable model: export the Relax graph, compile it, load parameters.

This is the library API under ``k3 compile`` / ``k3 generate``; tests call it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import K3Config


@dataclass
class ExportedModel:
    """A K3 Relax module and its parameter list.

    Attributes:
        mod: the ``tvm.IRModule`` with the functions of ``relax_modules.model``.
        params: ``[(name, shape, dtype)]`` in the compiled functions' parameter order.
        cfg, dtype, page_size: what it was built from.
        code_layout: layout of the routed experts' ``weight_packed`` parameters, ``"ocp"``
            (as in the checkpoint) or ``schedules.mxfp4_tc_layout.LAYOUT`` (permuted at load
            time by the library's ``repack_expert_codes``).
    """

    mod: object
    params: list[tuple[str, tuple[int, ...], str]]
    cfg: K3Config
    dtype: str
    page_size: int
    code_layout: str = "ocp"


def export_model(cfg: K3Config, dtype: str = "float32", page_size: int = 16,
                 gpu: bool = False, tuned: bool = True, wgmma: bool = False) -> ExportedModel:
    """Build ``K3ForCausalLM`` for ``cfg`` and export it with symbolic batch/sequence sizes.

    ``gpu``: use the thread-bound variants of the hand-written kernels (GPU targets; see
    :func:`k3_compile.build.build_module`); ``tuned``: on GPU, the tuned hand-written kernels
    where they exist (False: the generic ones, ``k3 compile --generic-kernels``); ``wgmma``:
    the tuned kernels may use Hopper's warpgroup MMA (pass the target's ``Features.wgmma``, as
    :func:`k3_compile.compile.compile_model` does)."""
    from relax_modules.model import K3ForCausalLM

    model = K3ForCausalLM(cfg, dtype=dtype, page_size=page_size, gpu=gpu, tuned=tuned, wgmma=wgmma)
    mod, params = model.export()
    plist = [(n, tuple(int(s) for s in p.shape), p.dtype) for n, p in params]
    layout = model.expert_code_layout()
    if layout != "ocp":
        mod = attach_repack(mod)
    return ExportedModel(mod, plist, cfg, dtype, page_size, layout)


REPACK_FN = "repack_expert_codes"


def attach_repack(mod, gpu: bool = True):
    """Add ``repack_expert_codes(codes: uint8 [e, n, kh]) -> codes`` to the Relax module: the
    in-place permutation of a stacked ``weight_packed`` tensor from the checkpoint layout to
    the tc layout (schedules/mxfp4_tc_layout.py), which the runtime calls once per tensor
    after uploading it. ``gpu``: the thread-bound kernel (False: the CPU loop, for tests)."""
    from tvm import relax, tirx as tir

    from schedules.mxfp4_tc_layout import repack_kernel

    bb = relax.BlockBuilder(mod)
    e, n, kh = tir.Var("e", "int64"), tir.Var("n", "int64"), tir.Var("kh", "int64")
    codes = relax.Var("codes", relax.TensorType([e, n, kh], "uint8"))
    with bb.function(REPACK_FN, [codes]):
        gv = bb.add_func(repack_kernel(gpu=gpu), "repack_e2m1_tc")
        out = bb.emit(relax.op.call_tir_inplace(gv, [codes], [0],
                                                relax.TensorType([e, n, kh], "uint8")))
        bb.emit_func_output(out)
    return bb.get()


def compile_llvm(exported: ExportedModel):
    """Compile for the host CPU (TVM ``llvm``); returns a ``tvm.relax.VMExecutable``."""
    import tvm

    return tvm.compile(exported.mod, target=tvm.target.Target({"kind": "llvm"}))


def load_checkpoint_params(model_dir: str | Path, exported: ExportedModel, device,
                           progress: bool = False, vm=None) -> list:
    """Read (and validate) the checkpoint in ``model_dir`` into device tensors, in order.

    ``vm``: the compiled library's VirtualMachine on ``device``; needed when the export reads
    the expert codes in the tc layout (``exported.code_layout != "ocp"``), whose
    ``repack_expert_codes`` then permutes them after upload.

    Raises:
        k3_compile.weights.CheckpointError: the checkpoint does not match the config.
        k3_compile.loader.ParameterError: a tensor cannot become its parameter.
        ValueError: a tc-layout export without ``vm``; an expert scale out of the layout's range.
    """
    from .loader import check_expert_scales, repack_expert_codes, upload_parameters
    from .weights import CheckpointReader

    layout = exported.code_layout
    if layout != "ocp" and vm is None:
        raise ValueError(f"this export reads the expert codes in the {layout} layout: pass vm= (the "
                         f"compiled library's VirtualMachine) so that {REPACK_FN} can permute them")
    reader = CheckpointReader(model_dir, exported.cfg)
    reader.validate()
    out = upload_parameters(reader.get, exported.params, exported.cfg.num_experts, device,
                            lambda name, a: check_expert_scales(name, a, layout), progress)
    return repack_expert_codes(vm, layout, [n for n, _, _ in exported.params], out)
