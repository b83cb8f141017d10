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
- :func:`wgmma_tf32_rs` — the same with TF32 operands (``m64n{N}k8.f32.tf32.tf32``): A in the
  ``mma.m16n8k8`` TF32 fragment per warp, B rows of 32 TF32 values (128 bytes) in the same
  swizzled tile, the k8 slice ``s`` 32·s bytes on.
- :func:`wgmma_fence`, :func:`wgmma_commit`, :func:`wgmma_wait` — ordering of register
  operands before the MMAs, and their completion.
- :func:`fence_proxy_async` — makes ``cp.async`` writes to shared memory visible to ``wgmma``
  (which reads through the async proxy); issued after the copies' wait, before the barrier.
- :func:`smem_address` — the 32-bit shared-window address of a shared buffer element (to
  align a tile at run time).
- :func:`mbar_init`, :func:`mbar_arrive`, :func:`mbar_wait`, :func:`cp_async_mbar_arrive` —
  shared-memory ``mbarrier`` objects (PTX ISA 9.7.13.15) for producer / consumer pipelines: a
  phase completes when its expected arrivals have arrived; ``cp.async.mbarrier.arrive.noinc``
  arrives for the executing thread once all its earlier ``cp.async`` copies have landed (the
  init count includes it); waits spin on ``try_wait.parity`` of the phase.
- :func:`trap_if` — abort the kernel where a layout invariant fails.
- :func:`named_barrier` — ``bar.sync id, threads``: a barrier among some warps of a block.
- :func:`global_address`, :func:`cp_async16_raw` — a 16-byte ``cp.async.cg`` between a 32-bit
  shared-window address and a 64-bit global address held as integers, so that a copy loop
  keeps its addresses in registers and advances them by adds.
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
    "k3_mbar_init": '__forceinline__ __device__ void k3_mbar_init(void* bar, unsigned count) '
                    '{ asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\\n" :: '
                    '"r"((unsigned)__cvta_generic_to_shared(bar)), "r"(count) : "memory"); }\n',
    "k3_mbar_arrive": '__forceinline__ __device__ void k3_mbar_arrive(void* bar) '
                      '{ asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\\n" :: '
                      '"r"((unsigned)__cvta_generic_to_shared(bar)) : "memory"); }\n',
    "k3_cp_async_mbar_arrive": '__forceinline__ __device__ void k3_cp_async_mbar_arrive(void* bar) '
                               '{ asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\\n" :: '
                               '"r"((unsigned)__cvta_generic_to_shared(bar)) : "memory"); }\n',
    "k3_mbar_wait": '__forceinline__ __device__ void k3_mbar_wait(void* bar, unsigned parity) {\n'
                    '  unsigned a = (unsigned)__cvta_generic_to_shared(bar);\n'
                    '  asm volatile("{\\n.reg .pred p;\\nK3_MBAR_WAIT_%=:\\n"\n'
                    '               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\\n"\n'
                    '               "@!p bra K3_MBAR_WAIT_%=;\\n}\\n" :: "r"(a), "r"(parity) : "memory");\n}\n',
    "k3_named_barrier": '__forceinline__ __device__ void k3_named_barrier(unsigned id, unsigned n) '
                        '{ asm volatile("bar.sync %0, %1;\\n" :: "r"(id), "r"(n) : "memory"); }\n',
    "k3_global_address": '__forceinline__ __device__ unsigned long long k3_global_address(const void* p) '
                         '{ return (unsigned long long)__cvta_generic_to_global(p); }\n',
    "k3_cp_async16_raw": '__forceinline__ __device__ void k3_cp_async16_raw(unsigned s, unsigned long long g) '
                         '{ asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" :: "r"(s), "l"(g) : "memory"); }\n',
    "k3_trap_if": '__forceinline__ __device__ void k3_trap_if(int c) { if (c) asm volatile("trap;"); }\n',
    "k3_smem_address": '__forceinline__ __device__ unsigned k3_smem_address(const void* p) '
                       '{ return (unsigned)__cvta_generic_to_shared(p); }\n',
}


def _acc_operands(n: int):
    """(fp32 accumulators per thread, their asm operand list ``%0, ..``, their ``"+f"(d[i])``
    constraints) of a ``wgmma.m64n{n}`` (64 rows x n columns over 128 threads)."""
    nd = n // 2
    return nd, ", ".join(f"%{i}" for i in range(nd)), ", ".join(f'"+f"(d[{i}])' for i in range(nd))


def _rs_src(n: int, name: str, ptx: str, a_type: str, a_in, imms: str) -> str:
    """Source of a register-A wgmma device function ``name`` (``ptx`` the instruction, ``a_type``
    the C type of the four A words, ``a_in(i)`` the asm input of word i, ``imms`` the immediate
    operands after scale-d)."""
    nd, dregs, outs = _acc_operands(n)
    return (
        f"__forceinline__ __device__ void {name}(float* d, {a_type} a0, {a_type} a1,\n"
        f"    {a_type} a2, {a_type} a3, unsigned long long desc, int accumulate) {{\n"
        f"  asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 5}, 0;\\n\"\n"
        f"      \"{ptx} \"\n"
        f"      \"{{{dregs}}}, {{%{nd}, %{nd + 1}, %{nd + 2}, %{nd + 3}}}, %{nd + 4}, p, {imms};\\n}}\\n\"\n"
        f"      : {outs}\n"
        f"      : {', '.join(a_in(i) for i in range(4))}, \"l\"(desc), \"r\"(accumulate));\n"
        f"}}\n")


def _wgmma_src(n: int) -> str:
    return _rs_src(n, f"k3_wgmma_m64n{n}k16_bf16_rs", f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16",
                   "unsigned", lambda i: f'"r"(a{i})', "1, 1, 0")


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


def _wgmma_ss_src(n: int) -> str:
    nd, dregs, outs = _acc_operands(n)
    return (
        f"__forceinline__ __device__ void k3_wgmma_m64n{n}k16_bf16_ss(float* d, unsigned long long da,\n"
        f"    unsigned long long db, int accumulate) {{\n"
        f"  asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 2}, 0;\\n\"\n"
        f"      \"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 \"\n"
        f"      \"{{{dregs}}}, %{nd}, %{nd + 1}, p, 1, 1, 0, 0;\\n}}\\n\"\n"
        f"      : {outs}\n"
        f"      : \"l\"(da), \"l\"(db), \"r\"(accumulate));\n"
        f"}}\n")


def wgmma_bf16_ss(n: int, d, desc_a, desc_b, accumulate=1):
    """``d[0 : n/2] (+)= A · Bᵀ`` for the warpgroup with both operands in shared memory: ``A``
    64 rows × 16 k (``desc_a``), ``B`` ``n`` rows × 16 k (``desc_b``), both K-major tiles of
    128-byte rows with the 128-byte swizzle (:func:`sw128_desc`, the k16 slice 32 bytes on);
    D as in :func:`wgmma_bf16_rs` (``d[4j + c]`` = row ``16w + g + 8·(c // 2)``, column
    ``8j + 2q + c % 2``). ``accumulate`` 0 overwrites ``d``. PTX ISA 9.7.15 (``wgmma.mma_async``
    with two matrix descriptors, no transposes).

    Raises:
        ValueError: ``n`` not a multiple of 8 in 8..256.
    """
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma N must be a multiple of 8 in 8..256, got {n}")
    return cuda_func_call(f"k3_wgmma_m64n{n}k16_bf16_ss", d, desc_a, desc_b, accumulate,
                          source_code=_wgmma_ss_src(n))


def _wgmma_tf32_src(n: int) -> str:
    return _rs_src(n, f"k3_wgmma_m64n{n}k8_tf32_rs", f"wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32",
                   "float", lambda i: f'"r"(__float_as_uint(a{i}))', "1, 1")


def wgmma_tf32_rs(n: int, d, a0, a1, a2, a3, desc, accumulate=1):
    """``d[0 : n/2] (+)= A · B`` for the warpgroup in TF32 (``wgmma.mma_async.sync.aligned.
    m64n{n}k8.f32.tf32.tf32``, PTX ISA 9.7.15): A 64 rows × 8 k from registers, each warp ``w``
    rows ``16w .. 16w+15`` in the ``mma.m16n8k8`` TF32 A fragment (thread ``(g, q)``: a0 row g
    k q, a1 row g+8 k q, a2 row g k q+4, a3 row g+8 k q+4; floats already TF32-rounded); B
    ``n`` rows (the columns of D) × 8 k, K-major, through ``desc`` (:func:`sw128_desc`: 128-byte
    rows of 32 TF32 values with the 128-byte swizzle, the k8 slice ``s`` 32·s bytes into the
    tile); D as in :func:`wgmma_bf16_rs`. ``accumulate`` 0 overwrites ``d``.

    Raises:
        ValueError: ``n`` not a multiple of 8 in 8..256.
    """
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma N must be a multiple of 8 in 8..256, got {n}")
    return cuda_func_call(f"k3_wgmma_m64n{n}k8_tf32_rs", d, a0, a1, a2, a3, desc, accumulate,
                          source_code=_wgmma_tf32_src(n))


def trap_if(cond):
    """Abort the kernel (``trap``: the launch fails with an illegal-instruction error) where the
    int32 TIR expression ``cond`` is nonzero; for layout invariants the host cannot check."""
    return cuda_func_call("k3_trap_if", cond, source_code=_SRC["k3_trap_if"])


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


def words_to_1024(buf):
    """int32 TIR expression: uint32 words from ``buf[0]`` (a shared buffer) to its first
    1024-byte-aligned address (the alignment the 128-byte-swizzle tiles need, :func:`sw128_desc`)."""
    from tvm.script import tirx as T

    return T.Cast("int32", (T.uint32(1024) - smem_address(T.address_of(buf[0])) % T.uint32(1024))
                  % T.uint32(1024) // T.uint32(4))


def sw128_tf32_word(k, n, rows: int):
    """Word (4-byte) offset of element (k, n) of a TF32 wgmma operand stored K-major (k the
    reduction index, n its row: a column of D for B, a row for A) in tiles of 32 k — 128-byte rows
    with the 128-byte swizzle (16-byte chunk c of row n at chunk c XOR n % 8), ``rows`` rows per
    tile, tile k // 32 at word (k // 32)·rows·32 — from a 1024-byte-aligned base: the layout that
    :func:`sw128_desc` plus :func:`sw128_tf32_kstep` read. PTX ISA 9.7.15.5.1 (shared memory
    matrix layouts, 128B swizzling). Ints or TIR expressions."""
    return k // 32 * (rows * 32) + n * 32 + ((k % 32 // 4) ^ (n % 8)) * 4 + k % 4


def sw128_tf32_kstep(s, rows: int):
    """Descriptor units (16 bytes) from the base of :func:`sw128_tf32_word`'s tiles to k8 step
    ``s`` of a TF32 wgmma: tile s // 4 (rows·128 bytes each), 32 bytes per step inside it."""
    return s // 4 * (rows * 8) + s % 4 * 2


def swizzle128_word(row, chunk):
    """uint32 word offset, within a 1024-byte-aligned tile of 128-byte rows, of 16-byte chunk
    ``chunk`` (0..7) of row ``row`` under the 128-byte swizzle (Python ints or TIR exprs)."""
    return row * 32 + (chunk ^ (row % 8)) * 4


def mbar_init(bar, count):
    """Initialise the mbarrier at ``bar`` (address of a shared uint64) for ``count`` arrivals
    per phase (one thread; barrier the block before others use it)."""
    return cuda_func_call("k3_mbar_init", bar, count, source_code=_SRC["k3_mbar_init"])


def mbar_arrive(bar):
    """One arrival of the executing thread on the mbarrier at ``bar``."""
    return cuda_func_call("k3_mbar_arrive", bar, source_code=_SRC["k3_mbar_arrive"])


def cp_async_mbar_arrive(bar):
    """An arrival on ``bar`` once the executing thread's earlier ``cp.async`` copies have
    landed in shared memory (``.noinc``: counted in the init count)."""
    return cuda_func_call("k3_cp_async_mbar_arrive", bar, source_code=_SRC["k3_cp_async_mbar_arrive"])


def mbar_wait(bar, parity):
    """Spin until the phase of parity ``parity`` (0 / 1, a uint32 expression) of the mbarrier
    at ``bar`` has completed."""
    return cuda_func_call("k3_mbar_wait", bar, parity, source_code=_SRC["k3_mbar_wait"])


def named_barrier(barrier_id: int, threads: int):
    """``bar.sync barrier_id, threads``: the first ``threads`` (a multiple of 32) threads that
    reach barrier ``barrier_id`` (1..15; 0 is ``__syncthreads``) wait for each other."""
    if not 1 <= barrier_id <= 15 or threads % 32:
        raise ValueError(f"named barrier id 1..15 and a multiple of 32 threads, got {barrier_id}, {threads}")
    return cuda_func_call("k3_named_barrier", barrier_id, threads, source_code=_SRC["k3_named_barrier"])


def setmaxnreg(op: str, n: int):
    """``setmaxnreg.{op}.sync.aligned.u32 n`` (sm_90a, executed by all threads of a
    warpgroup): the warpgroup's registers per thread raised (``inc``) or lowered (``dec``) to
    ``n`` (24..256, a multiple of 8), so that the producer and consumer warpgroups of a block
    share the register file unevenly. ptxas honours it only with a known register count at
    entry (``__launch_bounds__`` with a minimum of blocks per SM); the block's total after
    the changes must stay within the register file.

    Raises:
        ValueError: ``op`` not inc / dec, ``n`` out of range or not a multiple of 8.
    """
    if op not in ("inc", "dec") or not 24 <= n <= 256 or n % 8:
        raise ValueError(f"setmaxnreg.{op} {n}: inc / dec to a multiple of 8 in 24..256")
    name = f"k3_setmaxnreg_{op}{n}"
    src = (f'__forceinline__ __device__ void {name}() '
           f'{{ asm volatile("setmaxnreg.{op}.sync.aligned.u32 {n};\\n" ::: "memory"); }}\n')
    return cuda_func_call(name, source_code=src)


def global_address(p):
    """uint64 global-window address of a global buffer element ``p`` (``T.address_of``)."""
    return cuda_func_call("k3_global_address", p, source_code=_SRC["k3_global_address"], return_type="uint64")


def cp_async16_raw(smem_addr, gaddr):
    """16-byte ``cp.async.cg`` from global address ``gaddr`` (uint64) to shared address
    ``smem_addr`` (uint32; :func:`smem_address`)."""
    return cuda_func_call("k3_cp_async16_raw", smem_addr, gaddr, source_code=_SRC["k3_cp_async16_raw"])

