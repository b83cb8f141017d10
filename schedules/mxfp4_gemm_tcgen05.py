"""Block-scaled MXFP4 GEMM on Blackwell tensor cores (``tcgen05.mma ... kind::mxf4``, sm_100a),
written with TVM 0.27's TIRx tile primitives. Compile-verified only: no Blackwell GPU has run it.

Computes ``C[M, N] (bf16) = A[M, K] · B[N, K]^T`` with fp32 accumulation in tensor memory, where
both operands are MXFP4 in the compressed-tensors layout:

* ``a_codes [M, K/2]`` / ``b_codes [N, K/2]`` uint8: E2M1 codes, two per byte, the low nibble
  is the even column (``b`` is the checkpoint's ``weight_packed``);
* ``a_scale [M, K/32]`` / ``b_scale [N, K/32]`` uint8: E8M0 exponents, one per 32 inputs along
  K, value ``2^(s - 127)`` (``b`` is ``weight_scale``);
* ``c [M, N]`` bfloat16.

Static sizes: ``M`` a multiple of ``BM`` = 128, ``N`` of ``BN`` = 128, ``K`` of ``BK`` = 256.

Why MXFP4 activations (``kind::mxf4``), not MXFP8 (``kind::mxf8f6f4``): the ``gemm_async``
tile primitive (``tvm/backend/cuda/tile_primitive/gemm_async/tcgen05.py``) asserts that A and B
have the same MMA dtype (``A_sem == B_sem``), so the mixed E4M3 × E2M1 form of
``kind::mxf8f6f4`` cannot be expressed through it; E2M1 × E2M1 with E8M0 scales maps to
``kind::mxf4`` (``scale_vec::2X``, MMA K = 64, codes packed two per byte in shared memory, which
is exactly the checkpoint's byte layout). Using MXFP8 activations would mean writing the
``tcgen05.mma`` call (and its instruction descriptor) by hand instead of through the primitive.

Kernel (one CTA = 128 threads = 4 warps per 128 × 128 output tile, ``STAGES``-deep ring):

* warp 0 (producer): per K step waits for the stage to be free (``empty`` mbarrier), issues
  two TMA loads (``cp.async.bulk.tensor``, 128-byte swizzle: 128 rows × 128 bytes of codes for
  A and B) onto the stage's ``full`` mbarrier, and the 32 lanes copy the stage's E8M0 bytes
  (128 × 8 for each operand) from global memory into shared memory in the tcgen05 scale-factor
  layout (``sf_smem_layout``: 32 lanes × 16 bytes per 128-row super-block), then
  ``fence.proxy.async`` so that the async proxy (``tcgen05.cp``) sees them, then lane 0 arrives
  on ``full`` with the TMA byte count;
* warp 1, lane 0 (MMA issuer): waits on ``full``, copies the stage's scale factors
  shared → tensor memory (``tcgen05.cp.cta_group::1.32x128b.warpx4``, into per-stage TMEM
  columns in ``sf_tmem_layout``), issues the four block-scaled MMAs of the stage (K = 64 each,
  ``tcgen05.mma.cta_group::1.kind::mxf4.block_scale.scale_vec::2X``, accumulating from the
  second K step on) through ``Tx.gemm_async(..., SFA=, SFB=)``, and ``tcgen05.commit``-s to the
  stage's ``empty`` barrier (which also releases the shared scale bytes and, because each stage
  has its own TMEM scale columns, the TMEM scale slot);
* epilogue (all 4 warps): after the last commit, each warp reads its 32 TMEM lanes
  (``tcgen05.ld``) 32 columns at a time, converts to bf16 and stores its rows of ``C``.

TMEM: 128 accumulator columns + STAGES × (8 + 8) scale columns, allocated as 256.

Build with TVM's TIRx pipeline (``tvm.compile(..., tir_pipeline="tirx")`` or
``tvm.tirx.build(..., pipeline="tirx")``): the tile primitives are lowered by ``LowerTIRx``.
Shared memory is one dynamic pool (139 KiB at 4 stages; the codegen allows one ``shared.dyn``
allocation), so one CTA per SM.

TVM 0.27 details met on the way: ``sf_tmem_layout(..., pipe_depth=)`` spaces the stages 4
tensor-memory columns apart while a stage here spans 8 (``_sf_tmem_stages`` lays them out); a
scale buffer declared inside the K loop made the host/device split fail ("used before
definition"), and the pipeline's CSE off-switch reads ``tir.disable_cse_tir`` while only
``tirx.disable_cse_tir`` is registered; the allocated tensor-memory address must be bound with
``T.let`` before use; the codegen takes one ``shared.dyn`` allocation. Wiring this kernel into
the model would need k3_compile/build.py to lower it with the ``tirx`` pipeline.

Verified here: the NumPy reference (:func:`mxfp4_gemm_reference`) against an independent
dequantization; that the builder rejects bad sizes; that the kernel lowers for the
``cuda-sm100a`` target to CUDA containing ``tcgen05.mma.cta_group::1.kind::mxf4.block_scale``,
``tcgen05.cp`` and TMA, and that nvcc compiles it for sm_100a (tests/test_mxfp4_gemm_tcgen05.py).
Not verified: numerical results and absence of hangs on hardware (no Blackwell GPU); in
particular the scale-factor byte order (``sf_smem_layout`` / ``sf_tmem_layout`` are TVM's,
documented as hardware-checked upstream), the producer warp's generic-store → async-proxy
ordering of the scale bytes, and performance (nothing tuned: one CTA per tile, no persistent
schedule, no 2-CTA MMA, scales not TMA-loaded).
"""

from __future__ import annotations

import functools

import numpy as np
from tvm.backend.cuda.tile_primitive.gemm_async.tcgen05 import sf_smem_layout, sf_tmem_layout
from tvm.backend.cuda.tile_primitive.tma_utils import SwizzleMode, mma_shared_layout
from tvm.script import tirx as T
from tvm.script.tirx import tile as Tx
from tvm.tirx.layout import Iter, S, TCol, TileLayout, TLane
from tvm.tirx.layout import tid_in_wg as axis_tid_in_wg

from schedules.moe_generic import mxfp4_dequant_reference

BM = 128        # output rows (A rows) per CTA = the MMA's M
BN = 128        # output columns (B rows) per CTA = the MMA's N
BK = 256        # inputs per K step (128 bytes of codes per row: one 128-byte swizzle atom)
SF_VEC = 32     # inputs per E8M0 scale
STAGES = 4      # shared-memory ring depth
EPI_COLS = 32   # accumulator columns read from TMEM per epilogue step
TMEM_COLS = 256  # allocated TMEM columns (power of two >= BN + 2 * STAGES * SF_COLS)

def _check_sizes(M: int, N: int, K: int) -> None:
    for name, v, t in (("M", M, BM), ("N", N, BN), ("K", K, BK)):
        if not isinstance(v, (int, np.integer)) or v <= 0 or v % t:
            raise ValueError(f"{name}={v} must be a positive multiple of {t}")


def mxfp4_gemm_reference(a_codes, a_scale, b_codes, b_scale) -> np.ndarray:
    """``A · B^T`` in float64 (both MXFP4, shapes as the module doc; decoded by
    :func:`schedules.moe_generic.mxfp4_dequant_reference`); the kernel rounds it to bf16 after
    fp32 accumulation.

    Raises:
        ValueError: a scale tensor not ``[rows, K/32]`` for its codes ``[rows, K/2]``; A and B
            of different K.
    """
    ops = []
    for codes, scale in ((a_codes, a_scale), (b_codes, b_scale)):
        codes, scale = np.asarray(codes, dtype=np.uint8), np.asarray(scale, dtype=np.uint8)
        rows, half = codes.shape
        if (2 * half) % SF_VEC or scale.shape != (rows, 2 * half // SF_VEC):
            raise ValueError(f"scale shape {scale.shape} does not match codes {codes.shape}")
        ops.append(mxfp4_dequant_reference(codes, scale).astype(np.float64))
    a, b = ops
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"K mismatch: A has {a.shape[1]}, B has {b.shape[1]}")
    return a @ b.T


def _sf_tmem_stages(stages: int, sf_k: int, cols: int) -> TileLayout:
    """TMEM layout of ``stages`` copies of a 128-row scale tile (``sf_tmem_layout``), one every
    ``cols`` 32-bit columns. (``sf_tmem_layout(..., pipe_depth=)`` strides its stages by
    ``rows / 32 * 4`` bytes, 4 columns, which overlaps when one stage spans more than one
    scale column per 32 rows, as here: 8 scales per row span 8 columns.)"""
    base = sf_tmem_layout(BM, SF_K=sf_k, sf_per_mma=2)
    span = int(base.span("TCol"))
    if span > cols * 4:
        raise ValueError(f"scale tile spans {span} bytes of TMEM columns, more than {cols} columns")
    shard = [Iter(stages, cols * 4, TCol), *base.shard]
    return TileLayout.from_iters(shard, list(base.replica), dict(base.offset))


@functools.cache
def mxfp4_gemm_tcgen05_kernel(M: int, N: int, K: int, stages: int = STAGES):
    """PrimFunc ``(a_codes, a_scale, b_codes, b_scale, c)`` for sm_100a (module doc)."""
    _check_sizes(M, N, K)
    if stages < 1 or stages > 4:
        raise ValueError(f"stages must be 1..4, got {stages}")
    NS = stages
    KB = BK // 2                 # code bytes per row per K step
    SFK = BK // SF_VEC           # scales per row per K step (8)
    SF_COLS = 8                  # 32-bit TMEM columns of one stage's scales (128 rows x 8)
    GM, GN, NK = M // BM, N // BN, K // BK
    KG = K // SF_VEC
    TMA_BYTES = (BM + BN) * KB
    SFA_COL0 = BN
    SFB_COL0 = BN + NS * SF_COLS
    assert SFB_COL0 + NS * SF_COLS <= TMEM_COLS
    A_BYTES = NS * BM * KB           # byte offsets in the dynamic shared-memory pool
    SFA_OFF = A_BYTES + NS * BN * KB
    SFB_OFF = SFA_OFF + NS * BM * SFK
    SMEM_BYTES = SFB_OFF + NS * BN * SFK

    code_atom_a = mma_shared_layout("uint8", SwizzleMode.SWIZZLE_128B_ATOM, (BM, KB))
    code_atom_b = mma_shared_layout("uint8", SwizzleMode.SWIZZLE_128B_ATOM, (BN, KB))
    a_layout = code_atom_a.tile_to((NS, BM, KB), (1, BM, KB))
    b_layout = code_atom_b.tile_to((NS, BN, KB), (1, BN, KB))
    sf_smem = sf_smem_layout(BM, SF_K=SFK, sf_per_mma=2, pipe_depth=NS)
    sf_tmem = _sf_tmem_stages(NS, SFK, SF_COLS)

    # fmt: off
    @T.prim_func
    def mxfp4_gemm_tcgen05(a_codes_h: T.handle, a_scale_h: T.handle, b_codes_h: T.handle,
                           b_scale_h: T.handle, c_h: T.handle):
        a_codes = T.match_buffer(a_codes_h, (M, K // 2), "uint8")
        a_scale = T.match_buffer(a_scale_h, (M, KG), "uint8")
        b_codes = T.match_buffer(b_codes_h, (N, K // 2), "uint8")
        b_scale = T.match_buffer(b_scale_h, (N, KG), "uint8")
        c = T.match_buffer(c_h, (M, N), "bfloat16")
        T.device_entry()
        block = T.cta_id([GM * GN])
        warp = T.warp_id([4])
        lane = T.lane_id([32])
        _wg = T.warpgroup_id([1])
        tid = T.thread_id_in_wg([128])
        bm: T.let = block // GN
        bn: T.let = block % GN

        # one dynamic shared-memory pool (the codegen allows one): code stages, then scale stages
        pool = T.alloc_buffer((SMEM_BYTES,), "uint8", scope="shared.dyn", align=1024)
        a_s = T.decl_buffer((NS, BM, KB), "uint8", data=pool.data, byte_offset=0,
                            scope="shared.dyn", layout=a_layout)
        b_s = T.decl_buffer((NS, BN, KB), "uint8", data=pool.data, byte_offset=A_BYTES,
                            scope="shared.dyn", layout=b_layout)
        a_f4 = a_s.view("float4_e2m1fn")
        b_f4 = b_s.view("float4_e2m1fn")
        sfa_s = T.decl_buffer((NS, BM, SFK), "float8_e8m0fnu", data=pool.data, byte_offset=SFA_OFF,
                              scope="shared.dyn", layout=sf_smem)
        sfb_s = T.decl_buffer((NS, BN, SFK), "float8_e8m0fnu", data=pool.data, byte_offset=SFB_OFF,
                              scope="shared.dyn", layout=sf_smem)
        tmem_addr = T.alloc_shared([1], "uint32")
        full = T.alloc_shared([NS], "uint64")
        empty = T.alloc_shared([NS], "uint64")

        if tid == 0:
            for s in T.unroll(NS):
                T.ptx.mbarrier.init.shared.b64(full.ptr_to([s]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(empty.ptr_to([s]), T.uint32(1))
        T.ptx.fence.proxy.async_.shared__cta()
        T.ptx.fence.mbarrier_init.release.cluster()
        T.cuda.cta_sync()
        if warp == 0:
            T.ptx.tcgen05.alloc.cta_group__1.sync.aligned.shared__cta.b32(
                T.address_of(tmem_addr), T.uint32(TMEM_COLS))
        T.ptx.tcgen05.fence__before_thread_sync()
        T.cuda.cta_sync()
        T.ptx.tcgen05.fence__after_thread_sync()
        tbase: T.let = tmem_addr[0]
        acc = T.decl_buffer((BM, BN), "float32", scope="tmem", allocated_addr=tbase,
                            layout=TileLayout(S[(BM, BN) : (1 @ TLane, 1 @ TCol)]))
        sfa_t = T.decl_buffer((NS, BM, SFK), "float8_e8m0fnu", scope="tmem",
                              allocated_addr=tbase + SFA_COL0, layout=sf_tmem)
        sfb_t = T.decl_buffer((NS, BN, SFK), "float8_e8m0fnu", scope="tmem",
                              allocated_addr=tbase + SFB_COL0, layout=sf_tmem)

        if warp == 0:
            # producer: TMA for the codes, the warp's lanes for the scale bytes
            for ko in T.serial(NK):
                st: T.let = ko % NS
                ph: T.let = (ko // NS) % 2
                T.cuda.mbarrier_wait(empty.ptr_to([st]), ph ^ 1)
                if lane == 0:
                    Tx.copy_async(a_s[st, :, :], a_codes[bm * BM:(bm + 1) * BM, ko * KB:(ko + 1) * KB],
                                  dispatch="tma_auto", mbar=full.ptr_to([st]))
                    Tx.copy_async(b_s[st, :, :], b_codes[bn * BN:(bn + 1) * BN, ko * KB:(ko + 1) * KB],
                                  dispatch="tma_auto", mbar=full.ptr_to([st]))
                for i in T.unroll(BM * SFK // 32):
                    r: T.let = (i * 32 + lane) // SFK
                    j: T.let = (i * 32 + lane) % SFK
                    sfa_s[st, r, j] = T.reinterpret("float8_e8m0fnu", a_scale[bm * BM + r, ko * SFK + j])
                    sfb_s[st, r, j] = T.reinterpret("float8_e8m0fnu", b_scale[bn * BN + r, ko * SFK + j])
                T.ptx.fence.proxy.async_.shared__cta()
                T.cuda.warp_sync()
                if lane == 0:
                    T.ptx.mbarrier.arrive.expect_tx.shared.b64(full.ptr_to([st]), T.uint32(TMA_BYTES))

        if warp == 1:
            if lane == 0:
                for ko in T.serial(NK):
                    st: T.let = ko % NS
                    ph: T.let = (ko // NS) % 2
                    T.cuda.mbarrier_wait(full.ptr_to([st]), ph)
                    T.ptx.tcgen05.fence__after_thread_sync()
                    Tx.copy_async(sfa_t[st, :, :], sfa_s[st, :, :], cta_group=1)
                    Tx.copy_async(sfb_t[st, :, :], sfb_s[st, :, :], cta_group=1)
                    Tx.gemm_async(acc[:, :], a_f4[st, :, :], b_f4[st, :, :],
                                  SFA=sfa_t[st, :, :], SFB=sfb_t[st, :, :], accum=ko != 0,
                                  dispatch="tcgen05", cta_group=1)
                    T.ptx.tcgen05.commit.cta_group__1.mbarrier__arrive__one.shared__cluster.b64(
                        empty.ptr_to([st]))
                last_st: T.let = (NK - 1) % NS
                last_ph: T.let = ((NK - 1) // NS) % 2
                T.cuda.mbarrier_wait(empty.ptr_to([last_st]), last_ph)

        # epilogue: warp w owns accumulator rows (TMEM lanes) 32w .. 32w + 31
        T.ptx.tcgen05.fence__before_thread_sync()
        T.cuda.cta_sync()
        T.ptx.tcgen05.fence__after_thread_sync()
        c_reg = T.alloc_local(EPI_COLS, dtype="float32")
        c_view = c_reg.view(BM, EPI_COLS,
                            layout=TileLayout(S[(BM, EPI_COLS) : (1 @ axis_tid_in_wg, 1)]))
        c_out = T.alloc_local(EPI_COLS, dtype="bfloat16")
        for ch in T.unroll(BN // EPI_COLS):
            Tx.wg.copy_async(c_view[:, :], acc[:, ch * EPI_COLS:(ch + 1) * EPI_COLS])
            T.ptx.tcgen05.wait__ld.sync.aligned()
            for j in T.unroll(EPI_COLS):
                c_out[j] = T.cast(c_reg[j], "bfloat16")
            for j in T.unroll(EPI_COLS):
                c[bm * BM + tid, bn * BN + ch * EPI_COLS + j] = c_out[j]
        T.ptx.tcgen05.fence__before_thread_sync()
        T.cuda.cta_sync()
        if warp == 0:
            T.ptx.tcgen05.relinquish_alloc_permit.cta_group__1.sync.aligned()
            T.ptx.tcgen05.dealloc.cta_group__1.sync.aligned.b32(tmem_addr[0], T.uint32(TMEM_COLS))
    # fmt: on
    return mxfp4_gemm_tcgen05
