"""Inline-PTX device functions for Hopper warpgroup MMA (``wgmma``, sm_90a only), called from
TIR through ``cuda_func_call``, with the shared-memory layout their descriptors assume.

- :func:`wgmma_bf16_rs` — ``wgmma.mma_async.sync.aligned.m64n{N}k16.f32.bf16.bf16`` with A
  from registers and B from shared memory (PTX ISA 9.7.15 "Asynchronous Warpgroup Level Matrix
  Multiply-Accumulate"). A: each warp ``w`` of the warpgroup holds rows ``16w .. 16w+15`` in
  the ``mma.m16n8k16`` A fragment (thread ``(g, q)`` = ``(lane/4, lane%4)``: a0 row g k 2q..2q+1,
  a1 row g+8, a2 row g k 2q+8..2q+9, a3 row g+8). D (fp32, accumulated in place): ``d[4j +
  c]`` = row ``16w + g + 8·(c // 2)``, column ``8j + 2q + c % 2``. B: ``N`` rows (the columns of
  D) of 64 bf16 each, K-major, 128 bytes per row with the 128-byte swizzle — the 16-byte chunk
  ``c`` of row ``r`` at byte ``128·r + 16·(c XOR r % 8)`` of a 1024-byte-aligned tile
  (:func:`swizzle128_word`); the k16 slice ``s`` (0..3) starts ``32·s`` bytes into the tile.
  Descriptor (PTX "Matrix Descriptor Format", :func:`sw128_desc`): start address >> 4,
  leading byte offset 1 (unused with swizzling), stride byte offset 1024 >> 4 (8 rows),
  layout type 1 (128B swizzle).
- :func:`wgmma_fence`, :func:`wgmma_commit`, :func:`wgmma_wait` — ordering of register
  operands before the MMAs, and their completion.
- :func:`fence_proxy_async` — makes ``cp.async`` writes to shared memory visible to ``wgmma``
  (which reads through the async proxy); issued after the copies' wait, before the barrier.
- :func:`smem_address` — the 32-bit shared-window address of a shared buffer element (to
  align a tile at run time).
"""

from __future__ import annotations

from tvm.backend.cuda.op import cuda_func_call

# one source string per device function (the codegen emits each function's source once)
_SRC = {
    "k3_wgmma_fence": '__forceinline__ __device__ void k3_wgmma_fence() '
                      '{ asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory"); }\n',
    "k3_wgmma_commit": '__forceinline__ __device__ void k3_wgmma_commit() '
                       '{ asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory"); }\n',
    **{f"k3_wgmma_wait{n}": f'__forceinline__ __device__ void k3_wgmma_wait{n}() '
       f'{{ asm volatile("wgmma.wait_group.sync.aligned {n};\\n" ::: "memory"); }}\n' for n in range(4)},
    "k3_fence_proxy_async": '__forceinline__ __device__ void k3_fence_proxy_async() '
                            '{ asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory"); }\n',
    "k3_smem_address": '__forceinline__ __device__ unsigned k3_smem_address(const void* p) '
                       '{ return (unsigned)__cvta_generic_to_shared(p); }\n',
}


def _wgmma_src(n: int) -> str:
    nd = n // 2  # fp32 accumulators per thread (64 rows x n columns over 128 threads)
    dregs = ", ".join(f"%{i}" for i in range(nd))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    return (
        f"__forceinline__ __device__ void k3_wgmma_m64n{n}k16_bf16_rs(float* d, unsigned a0, unsigned a1,\n"
        f"    unsigned a2, unsigned a3, unsigned long long desc, int accumulate) {{\n"
        f"  asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 5}, 0;\\n\"\n"
        f"      \"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 \"\n"
        f"      \"{{{dregs}}}, {{%{nd}, %{nd + 1}, %{nd + 2}, %{nd + 3}}}, %{nd + 4}, p, 1, 1, 0;\\n}}\\n\"\n"
        f"      : {outs}\n"
        f"      : \"r\"(a0), \"r\"(a1), \"r\"(a2), \"r\"(a3), \"l\"(desc), \"r\"(accumulate));\n"
        f"}}\n")


def wgmma_bf16_rs(n: int, d, a0, a1, a2, a3, desc, accumulate=1):
    """``d[0 : n/2] (+)= A · B`` for the warpgroup (module doc): ``d`` the address of the
    thread's fp32 accumulators, ``a0..a3`` its A fragment words (bf16x2), ``desc`` the uint64
    descriptor of the B tile's k16 slice (:func:`sw128_desc`); ``accumulate`` 0 (an int32
    expression) overwrites ``d`` instead of adding to it (the first product: no instruction
    outside the wgmmas defines the accumulators, which would make ptxas serialize them).
    ``n``: 8..256, a multiple of 8."""
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma N must be a multiple of 8 in 8..256, got {n}")
    return cuda_func_call(f"k3_wgmma_m64n{n}k16_bf16_rs", d, a0, a1, a2, a3, desc, accumulate,
                          source_code=_wgmma_src(n))


def sw128_desc(smem_addr):
    """uint64 matrix descriptor (128-byte swizzle, K-major, 8-row groups 1024 bytes apart) of
    the tile at the 32-bit shared-window address ``smem_addr`` (a TIR uint32 expression; the
    tile 1024-byte aligned, as the base-offset field is 0; a k16 slice inside it, 32 bytes
    on, keeps that base): the start address sits in bits 0-13 as address / 16, so a tile or k16
    slice ``b`` bytes further is the descriptor plus ``b / 16`` (shared memory < 256 KiB)."""
    from tvm.script import tirx as T

    return (T.Cast("uint64", (smem_addr & T.uint32(0x3FFFF)) >> T.uint32(4))
            | T.uint64(DESC_SW128_BITS))


# leading byte offset 1 (unused with swizzling), stride byte offset 1024 / 16, layout 128B swizzle
DESC_SW128_BITS = (1 << 16) | (64 << 32) | (1 << 62)


def wgmma_fence():
    return cuda_func_call("k3_wgmma_fence", source_code=_SRC["k3_wgmma_fence"])


def wgmma_commit():
    return cuda_func_call("k3_wgmma_commit", source_code=_SRC["k3_wgmma_commit"])


def wgmma_wait(n: int):
    """Until at most ``n`` (0..3) committed groups of this warpgroup's wgmmas are pending.

    Raises:
        ValueError: ``n`` outside 0..3.
    """
    if n not in range(4):
        raise ValueError(f"wgmma wait_group takes 0..3 pending groups here, got {n}")
    return cuda_func_call(f"k3_wgmma_wait{n}", source_code=_SRC[f"k3_wgmma_wait{n}"])


def fence_proxy_async():
    return cuda_func_call("k3_fence_proxy_async", source_code=_SRC["k3_fence_proxy_async"])


def smem_address(p):
    return cuda_func_call("k3_smem_address", p, source_code=_SRC["k3_smem_address"], return_type="uint32")


def swizzle128_word(row, chunk):
    """uint32 word offset, within a 1024-byte-aligned tile of 128-byte rows, of 16-byte chunk
    ``chunk`` (0..7) of row ``row`` under the 128-byte swizzle (Python ints or TIR exprs)."""
    return row * 32 + (chunk ^ (row % 8)) * 4
