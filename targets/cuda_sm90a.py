"""NVIDIA Hopper (H100, H200): CUDA sm_90a (wgmma, TMA, setmaxnreg)."""

from .base import Features, TargetSpec

TARGET = TargetSpec(
    name="cuda-sm90a",
    description="NVIDIA Hopper H100/H200 (CUDA sm_90a)",
    target={"kind": "cuda", "arch": "sm_90a"},
    host={"kind": "llvm"},
    device="cuda",
    features=Features(
        bf16=True,
        fp8=True,  # e4m3 / e5m2 wgmma
        fp4_block_scaled_mma=False,  # Hopper has no fp4 MMA: dequantize MXFP4 to bf16
        max_shared_memory_per_block=232448,  # 227 KiB opt-in
        warp_size=32,
        wgmma=True,
    ),
    schedule_set="dlight-gpu",
    verified="runs on the H200",
    nvcc_arch="sm_90a",
    notes="Device code precompiled to a fatbin at compile time (k3_compile.device_code); "
    "a Relax matmul+add library ran on an H200 with runtime-only TVM and no nvcc.",
)
