"""The host CPU through LLVM (x86-64 here); the reference and CI target."""

from .base import Features, TargetSpec

TARGET = TargetSpec(
    name="llvm",
    description="Host CPU (LLVM, native triple)",
    target={"kind": "llvm"},
    host=None,
    device="cpu",
    features=Features(
        bf16=True,  # storage + float32 compute (LLVM legalizes bf16 arithmetic)
        fp8=False,  # no native fp8 arithmetic: fp8 tensors are upcast
        fp4_block_scaled_mma=False,
        max_shared_memory_per_block=0,
        warp_size=1,
    ),
    schedule_set="cpu",
    verified="runs here",
)
