"""NVIDIA Blackwell datacenter (B200, GB200): CUDA sm_100a (tcgen05, TMEM)."""

from .base import Features, TargetSpec

TARGET = TargetSpec(
    name="cuda-sm100a",
    description="NVIDIA Blackwell B200/GB200 (CUDA sm_100a)",
    target={"kind": "cuda", "arch": "sm_100a"},
    host={"kind": "llvm"},
    device="cuda",
    features=Features(
        bf16=True,
        fp8=True,
        fp4_block_scaled_mma=True,  # tcgen05.mma kind::mxf4 / mxf4nvf4
        max_shared_memory_per_block=232448,  # 227 KiB opt-in
        warp_size=32,
    ),
    schedule_set="dlight-gpu",
    verified="compiles only",
    nvcc_arch="sm_100a",
    notes="Compiled to a sm_100a fatbin here with nvcc 13.0; no Blackwell GPU to run on.",
)
