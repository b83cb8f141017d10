"""Apple GPUs (M1 and later) through Metal; host code for arm64 macOS."""

from .base import Features, TargetSpec

TARGET = TargetSpec(
    name="metal",
    description="Apple silicon GPU (Metal)",
    target={"kind": "metal"},
    host={"kind": "llvm", "mtriple": "arm64-apple-macos"},
    device="metal",
    features=Features(
        bf16=True,  # Metal 3.1 (M2 and later, macOS 14); M1 lacks bf16 arithmetic
        fp8=False,
        fp4_block_scaled_mma=False,
        max_shared_memory_per_block=32768,  # threadgroup memory
        warp_size=32,  # SIMD-group width (TVM's metal target defaults thread_warp_size to 16)
    ),
    schedule_set="dlight-gpu",
    verified="compiles only",
    notes="k3-nano compiles here (Metal shading language + arm64 macOS host objects); off a Mac "
    "`k3 compile --target metal -o NAME.tar` writes the objects, which link on a Mac. dlight's "
    "Matmul rule is left out on Metal (its simdgroup tensorization segfaults in TVM 0.27).",
)
