"""AMD Instinct MI300X (CDNA3, gfx942) through ROCm."""

from .base import Features, TargetSpec

TARGET = TargetSpec(
    name="rocm-gfx942",
    description="AMD Instinct MI300X (ROCm gfx942)",
    target={"kind": "rocm", "mcpu": "gfx942"},
    host={"kind": "llvm"},
    device="rocm",
    features=Features(
        bf16=True,
        fp8=True,  # e4m3fnuz / e5m2fnuz MFMA
        fp4_block_scaled_mma=False,  # block-scaled fp4 MFMA arrives with gfx950 (MI355X)
        max_shared_memory_per_block=65536,  # LDS per workgroup
        warp_size=64,  # wavefront
    ),
    schedule_set="dlight-gpu",
    verified="does not compile here: Cannot find ROCm path",
    notes="The PyPI TVM wheel is built without the ROCm runtime (USE_ROCM off): even with "
    "device libs present, a library can be built but not loaded by this TVM.",
)
