"""`TargetSpec`: one compilation target of k3-compile (TVM target, device, features, status)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass(frozen=True)
class Features:
    """What the hardware offers that kernels and the model export care about."""

    bf16: bool
    fp8: bool
    # MXFP4 / NVFP4 block-scaled matrix instructions (tcgen05.mma kind::mxf4 on sm_100a,
    # mma.sync kind::mxf4 on sm_120a).  False: fp4 weights are dequantized before the MMA.
    fp4_block_scaled_mma: bool
    # Hardware maximum of shared memory one block may use (opt-in bytes), 0 on CPUs.
    max_shared_memory_per_block: int
    # Threads per warp / wavefront / SIMD group; 1 on CPUs.
    warp_size: int
    # Hopper warpgroup MMA (wgmma.mma_async: sm_90a only; Blackwell has tcgen05 instead).
    wgmma: bool = False


@dataclass(frozen=True)
class TargetSpec:
    """A compilation target.

    ``target`` / ``host`` are the JSON dicts that TVM 0.27 takes
    (``tvm.target.Target(target, host=host)``); string targets are no longer accepted.
    ``verified`` is one of "runs here", "runs on the H200", "compiles only",
    "does not compile here: <why>".
    """

    name: str
    description: str
    target: Dict[str, Any]
    host: Optional[Dict[str, Any]]
    device: str  # kind for tvm.runtime.device(): "cpu", "cuda", "metal", "rocm"
    features: Features
    schedule_set: str  # "dlight-gpu" or "cpu"
    verified: str
    # nvcc architecture ("sm_90a") for targets whose device code k3_compile precompiles.
    nvcc_arch: Optional[str] = None
    notes: str = field(default="")

    @property
    def is_gpu(self) -> bool:
        return self.device != "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.target.get("kind") == "cuda"

    def tvm_target(self):
        """The ``tvm.target.Target`` (with its host for GPU targets)."""
        import tvm  # pylint: disable=import-outside-toplevel

        if self.host is None:
            return tvm.target.Target(dict(self.target))
        return tvm.target.Target(dict(self.target), host=dict(self.host))

    def tvm_device(self, index: int = 0):
        """``tvm.runtime.device(kind, index)`` for this target (works in runtime-only TVM)."""
        import tvm  # pylint: disable=import-outside-toplevel

        return tvm.runtime.device(self.device, index)
