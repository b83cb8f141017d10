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
    notes="Tried with Debian 12's rocm-device-libs 5.2 + lld 14 and ROCM_PATH pointing at "
    "them: the bitcode link passes, then ld.lld 14 rejects the code object of TVM's LLVM 22 "
    "('unknown abi version'); a newer ld.lld (untried) would be needed. The PyPI TVM wheel also "
    "has no ROCm runtime (USE_ROCM off), so such a library could not be loaded by it.",
)
