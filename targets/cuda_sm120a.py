"""NVIDIA Blackwell consumer (RTX 50 series): CUDA sm_120a."""

from .base import Features, TargetSpec

TARGET = TargetSpec(
    name="cuda-sm120a",
    description="NVIDIA RTX 50 series (CUDA sm_120a)",
    target={"kind": "cuda", "arch": "sm_120a"},
    host={"kind": "llvm"},
    device="cuda",
    features=Features(
        bf16=True,
        fp8=True,
        fp4_block_scaled_mma=True,  # mma.sync kind::mxf4 (no tcgen05 / TMEM on sm_120)
        max_shared_memory_per_block=101376,  # 99 KiB opt-in
        warp_size=32,
    ),
    schedule_set="dlight-gpu",
    verified="compiles only",
    nvcc_arch="sm_120a",
    notes="Compiled to a sm_120a fatbin here with nvcc 13.0; no RTX 50 GPU to run on.",
)
