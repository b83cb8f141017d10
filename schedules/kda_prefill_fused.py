"""KDA chunked prefill in one kernel: the intra-chunk products and the state recurrence fused,
on tensor cores (mma.sync m16n8k8 TF32, fp32 accumulate), CUDA.

Spec §3 "KDA layer" step 5 for prefill, in the chunked form of fla's ``naive_chunk_kda``
(chunk C = 64); reference :func:`schedules.kda_prefill_cuda.kda_prefill_reference`. The
two-kernel version (``schedules/kda_prefill_tc.py``) writes w, u, qg, kg and Aqk of every
chunk to fp32 scratch tensors and reads them back in the state pass; this kernel keeps one
block on one (sequence, head, ``block_v`` columns of V) for the whole sequence and does the
intra-chunk work of each chunk right before its state update, so nothing but q, k, v, g, β
is read and nothing but o and the final state is written.

It also never forms ``w = (I+L)^{-1} diag(β) (e^Γ ⊙ k)``: since only ``u − w S`` is used,

    vn = (I + L)^{-1} R,    R = diag(β) (v − (e^Γ ⊙ k) S)

is solved by blocked forward substitution over the four 16-row blocks of the chunk, with the
inverses of the four unit lower-triangular 16×16 diagonal blocks D_I = I + L_II:

    vn_I = D_I^{-1} (R_I − Σ_{J<I} L_IJ vn_J)                        I = 0 … 3

Per chunk (barriers between phases; warp wi, lane = 4·gr + tg):

1. The chunk's raw k, q and g rows → shared memory by 16-byte ``cp.async`` (rows past the
   sequence end zero-filled, so they change nothing), β; the next chunk's rows are prefetched
   into L2. Then Γ = log2(e)·cumsum g in place (one column per thread), so that every
   exponential below is one ``ex2.approx``.
2. For each 16-row sub-block I (reference r = Γ_{16I}, so that every exponential that is
   stored stays in fp32 range with the lower-bound gate): ka = k e^{Γ−r}, qa = scale·q e^{Γ−r}
   staged; warps take n-tiles (8 columns) of ``L = β (ka)(k e^{r−Γ})ᵀ`` (j < i) and ``Aqk =
   (qa)(k e^{r−Γ})ᵀ`` (j ≤ i), the B fragment k e^{r−Γ} computed once in registers for both.
   L and Aqk share one tile: Aqk on and below the diagonal at [i][j], L transposed above it
   at [j][i]. As dispatched (``p2_one``) all 64 rows are staged at once and each warp takes
   3 adjacent n-tiles in one round; the other forms take one or two sub-blocks per round.
3. D_I^{-1} (warps 6-7, one column per thread) while every warp computes its rows of
   ``(e^Γ ⊙ k) S`` (warps 0-3, giving R) or ``Y = scale (e^Γ ⊙ q) S`` (warps 4-7, kept
   in registers); A operands computed from the staged k / q and Γ as they are loaded.
4. vn by the blocked substitution above: warp wi owns the n-tiles wi, wi+8, … of vn, so only
   warp-level syncs separate its steps.
5. o = Y + Aqk vn (warps 4-7, causal k-steps only); S ← diag(e^{Γ_last}) S +
   (e^{Γ_last−Γ} ⊙ k)ᵀ vn (every warp: 16 rows of S in fp32 accumulator registers for the
   whole sequence); a copy of S in shared memory is the B operand of the next chunk's phase 3.

Shared memory: one fp32 buffer with regions at fixed offsets (padded strides keep most
fragment reads free of bank conflicts — the transposed reads of phase 5 and one of the two
L / Aqk patterns are 2-way —, rows 16-byte aligned for ``cp.async``): raw k, raw q and Γ [C,
K+4] each, S [block_v, K+4] (column-major: the B operand; with ``p3_wg`` K-major tiles of 32
columns of K with the 128-byte swizzle, ``s_word``), the L / Aqk tile [C, C+8] ([C, C+4]
at block_v 128), one region used as ka / qa [4·16, K+4] in phase 2 (``p2_pairs``,
``p2_one``; [2·16, K+4] otherwise) and as vn [C, block_v+8]
plus D^{-1} [4·16, 20] afterwards (with ``p5_wg`` R there and vn in the q region, ``vn_word``),
and β [C]: 145,408 bytes at block_v 16, 226,560 at 128 —
one block per SM (ptxas, --register-usage-level=5: 255 registers at block_v 128 with a_batch 4
and no spills; 183 at 64).

Precision: TF32 operands (``cvt.rna``, rounded once where each operand is stored or computed;
the ``mma`` then reads them as they are), fp32 accumulation and fp32 state; ``ex2.approx``
(relative error ≤ 2^-22). On the H200 the errors vs fla's naive recurrence are comparable to
the two-kernel version's and about half fla ``chunk_kda``'s (benchmarks/kda.py checks). Restriction as
there: K = V = 128 and the lower-bound gate with |lb| ≤ 5.5 (in-chunk exponentials of a
16-row block up to e^{82.5}).

The split form (``kda_prefill_split_intra_kernel``, then this kernel with ``split``): what
does not depend on the state — phases 1-2 and D^{-1}, and the Γ-scaled operands e^Γ k,
scale·e^Γ q, e^{Γ_last−Γ} k and e^{Γ_last} (TF32, as this kernel computes them) — for all
chunks of all sequences in parallel (one block per chunk and head), written to token-indexed
fp32 scratch; then per chunk only phases 3-5 on the staged operands: 4 barriers instead of 13
and no exponentials. Both kernels reuse this module's macros, and the split form computes what the fused kernel
does in the same order (on the H200 both have the same errors on every check).

Performance (H200, 2026-11-30, ``benchmarks/results/kda_prefill_split_h200_2026-11-30.json``,
fp32 inputs; fla's gated call on bf16 inputs):

- 96 heads, fused, block_v 128 with ``p2_pairs`` and ``ldsm``: 2.88 ms at 8192 tokens, 2.17
  ms at 4 × 2048; with the L2 norms, gate and β inside (``lower_bound``) 3.02 / 2.31 ms —
  fla ``chunk_kda`` 4.79 / 4.64 ms on the same fp32 inputs, 2.86 / 2.80 ms gated. A block
  needs ~22 µs per chunk at 128 columns (latency: 9 barriers with ``p2_pairs``, the L / Aqk
  rounds, 2 warps per scheduler; ncu: 38% of the instructions are shared-memory loads, 20%
  of the issue slots busy). The split form is slower here (3.51 / 3.20 ms at 128 columns, 3.90
  / 3.38 ms with the run-time block_v of 64: its intra kernel alone takes 1.6 ms for 12288
  chunk-heads at one block per SM).
- 12 heads, split: 0.92 ms at 8192 tokens with block_v 16 (intra 0.21 ms, state pass 0.70
  ms: ~5.5 µs per chunk), 0.99 ms at 32; 0.52 ms at 4 × 2048 with 64 columns, 0.63 at 32;
  with the L2 norms, gate and β in the intra kernel +0.06 ms — fla 1.34 / 1.44 ms on the
  same inputs, gated 1.87 / 1.54 ms in this run (1.01 / 1.00 ms in the previous one: fla's
  gated call varies from run to run at 12 heads). The fused kernel there: at best 1.79 ms
  (16 columns) and 0.54 ms (64). ``kda_prefill_split_state_kernel`` picks block_v at run
  time (``split_block_v``): 0.91 / 0.51 ms, 0.97 / 0.57 ms with the preprocessing
  (``kda_prefill_split_auto_h200_2026-11-30.json``); with ``early_kq`` (the default) 0.90 /
  0.50 and 0.96 / 0.57 ms (``kda_prefill_split_early_h200_2026-11-30.json``).

``p2_pairs`` (3-7% faster, ``kda_prefill_p2_ldsm_h200_2026-11-30.json``), ``ldsm`` (0-2%
more with ``p2_pairs``, ``kda_prefill_split_v1_h200_2026-11-30.json``), ``p2_wide`` (3-4%
more, ``kda_prefill_p2w_h200_2026-12-01.json``), ``v_async`` with ``fast_gate`` (another ~4%
with the preprocessing), then ``p2_one`` in place of the pairs (11%) and ``o_vec`` (5%) are
measured; the model uses ``p2_one``, ``ldsm``, ``v_async``, ``fast_gate`` and ``o_vec``
(``kda_prefill_p2one_final_h200_2026-12-01.json``: 2.36 / 1.84 ms at 96 heads with the
preprocessing, from 2.79 / 2.13 ms with the previous dispatch in the same run), and on sm_90a at
128 columns phases 3 and 5 on warpgroup MMA (``p3_wg=2``, ``p5_wg``: 2.11 / 1.60 ms against 2.35 /
1.82 without them and fla's gated call 2.83 / 2.80 ms in the same run,
``kda_prefill_wgmma_fla_h200_2026-12-01.json``; phase 3 alone 6%, ``kda_prefill_p3wg_h200_2026-12-01.json``).
Per warp, phase 3's ``mma.sync`` form reads every B fragment of S (64 KB) for its 16 rows, eight
times per chunk in all; a warpgroup's wgmma reads it once for 64 rows, and runs asynchronously
(D^{-1} on warps 6-7 overlaps the last group). Phase 5 needs vn as a K-major B operand (TF32
wgmma takes no transposed operand), so with ``p5_wg`` phase 4 writes vn, transposed and swizzled,
into the q region, which nothing reads after phase 3. In the split
form it uses ``p2_one``, ``fast_gate`` and ``tmat`` in the intra kernel and ``o_vec``, ``tmat``,
``pipe`` and ``v_early`` in the state kernel (0.77 / 0.49 ms at 12 heads, from 0.89 / 0.48;
``kda_prefill_vearly_h200_2026-12-01.json``). :func:`kda_prefill_split_kernel` is the split form as the
model calls it, one PrimFunc: for one sequence the intra items and the state chunk loop overlap in
one kernel of 132 blocks (0.749–0.751 ms against 0.772–0.776 for the two kernels,
``kda_prefill_overlap_bv32_{1,2}_h200_2026-12-01.json``), for several the two kernels; on sm_90a
the model passes ``p3_wg=2`` (phase 3 of every state kernel on wgmma: 0.72 / 0.48 ms against
0.75 / 0.51 at 12 heads, ``kda_prefill_wgmma_d12_h200_2026-12-01.json``). Where a chunk's time goes (``ablate``,
``kda_prefill_phases_c_h200_2026-12-01.json``, ``kda_prefill_split_parts_b_h200_2026-12-01.json``):
docs/DESIGN.md.

``emulate=True`` builds the same loop nest with the block / thread loops serial and every
mma replaced by the dot products it computes for the lane (see
``schedules/kda_prefill_tc.py``), for CPU tests; every warp-synchronous step is its own loop
over threads, so the serial run has the GPU's ordering.
"""

from __future__ import annotations

import functools

from tvm.script import tirx as T

from schedules.barriers import mark
from schedules.kda_prefill_cuda import C, SUB, block_thread_loops, kda_prefill_reference  # noqa: F401
from schedules.kda_prefill_tc import mma_tf32_macros
from schedules.wgmma_ptx import sw128_tf32_kstep, sw128_tf32_word

NT = 256                 # threads per block (8 warps)
BLOCK_V = (16, 32, 64, 128)   # supported columns of V per block
# the work ``ablate`` can leave out of the fused kernel (timing diagnostics; the results are then
# wrong): phase 1's copies, its Γ with the norms and gate (or the Γ / gate cumsum or the norms
# alone), phase 2, D^{-1}, phase 3's v loads and
# products, phase 4, phase 5's S update, S copy, o products and o stores
ABLATE_PHASES = frozenset({"stage", "gamma", "cumsum", "norms", "p2", "dinv", "vl", "p3", "p4", "s", "scopy", "o",
                           "ost"})
ABLATE_STATE = frozenset({"stage", "vl", "p3", "p4", "s", "scopy", "o", "ost"})   # ... of the split state kernel
# the widest block_v of the split state kernel whose shared memory (227 KB) holds tmat's vn region,
# and the widest that also holds pipe's second set of staged regions (v_early rides on pipe)
TMAT_MAX_BLOCK_V = 64
PIPE_MAX_BLOCK_V = 32

SYNCWARP_SRC = r"""
__device__ __forceinline__ void k3_syncwarp() { __syncwarp(); }
"""
MMA_RAW_SRC = r"""
__device__ __forceinline__ void k3_mma_tf32_raw(float* d, float a0, float a1, float a2, float a3,
                                                float b0, float b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)),
        "r"(__float_as_uint(a3)), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}
"""
TF32_SRC = r"""
__device__ __forceinline__ float k3_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}
"""
LDSM_SRC = r"""
__device__ __forceinline__ void k3_ldsm_x4(float* d, const float* p) {
  unsigned a = (unsigned)__cvta_generic_to_shared(p), r0, r1, r2, r3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a) : "memory");
  d[0] = __uint_as_float(r0); d[1] = __uint_as_float(r1);
  d[2] = __uint_as_float(r2); d[3] = __uint_as_float(r3);
}
"""
EX2_SRC = r"""
__device__ __forceinline__ float k3_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""
RCP_SRC = r"""
__device__ __forceinline__ float k3_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""
ST2_SRC = r"""
__device__ __forceinline__ void k3_st2(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
"""
WARP_SUM_SRC = r"""
__device__ __forceinline__ float k3_warp_sum(float x) {
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}
"""
LOG2E = 1.4426950408889634
L2_NORM_EPS = 1e-6       # spec §3 step 2 (relax_modules/kda.py, fla's l2norm)


def _macros(emulate: bool):
    """Warp-level m16n8k8 TF32 steps as TVMScript macros (lane = 4·gr + tg):

    ``frag_a(af, ab, A, lane, k0)``: the lane's A fragment of A[0:16, k0:k0+8] into
    ``af[ab:ab+4]`` (A(i, k) a callable giving the element). ``mma(acc, row, off, af, ab, A,
    B, lane, k0, n0)``: acc[row, off+e] (e < 4) += the lane's entries of A[0:16, k0:k0+8] ·
    B[k0:k0+8, n0:n0+8], A from ``af``, B evaluated in place. ``mma_rb(..., bf, bb, ...)``: the
    same with B's fragment already in ``bf[bb], bf[bb+1]``. The mma reads its operands as they
    are (no ``cvt``): callers pass TF32-rounded values (``_tf32``). Emulated, the fragments are
    unused and the four dot products are computed from A and B. ``syncwarp()``, ``prefetch(elem)``
    (``prefetch.global.L2``): no-ops when emulated."""
    from tvm.backend.cuda.op import cuda_func_call

    # fragment loads, the emulated mma and the L2 prefetch as the two-kernel form's
    frag_a, mma_tc, prefetch = mma_tf32_macros(emulate)
    if emulate:
        mma = mma_tc   # the lane's four dot products, from A and B

        @T.macro
        def mma_rb(acc, row, off, af, ab, bf, bb, A, B, lane, k0, n0):
            mma(acc, row, off, af, ab, A, B, lane, k0, n0)

        @T.macro
        def syncwarp():
            T.evaluate(0)
    else:
        @T.macro
        def mma_rb(acc, row, off, af, ab, bf, bb, A, B, lane, k0, n0):
            cuda_func_call("k3_mma_tf32_raw", T.address_of(acc[row, off]), af[ab], af[ab + 1], af[ab + 2], af[ab + 3],
                           bf[bb], bf[bb + 1], source_code=MMA_RAW_SRC)

        @T.macro
        def mma(acc, row, off, af, ab, A, B, lane, k0, n0):
            cuda_func_call("k3_mma_tf32_raw", T.address_of(acc[row, off]), af[ab], af[ab + 1], af[ab + 2], af[ab + 3],
                           B(k0 + lane % 4, n0 + lane // 4), B(k0 + lane % 4 + 4, n0 + lane // 4),
                           source_code=MMA_RAW_SRC)

        @T.macro
        def syncwarp():
            cuda_func_call("k3_syncwarp", source_code=SYNCWARP_SRC)
    return frag_a, mma, mma_rb, syncwarp, prefetch


def ldsm_b_row(lane, n0, k0):
    """The (n, k) of the row address lane ``lane`` gives ``ldmatrix.x4`` (b16) to load the TF32
    B fragments of the n-tiles n0 and n0 + 8 at k-step k0 from a column-major B (n rows, k
    contiguous, rows 16-byte aligned): an 8×8 b16 matrix is an 8×4 fp32 tile, and thread t
    receives 32-bit word t % 4 of row t // 4 of each matrix — so matrices (n0, k0), (n0, k0+4),
    (n0+8, k0), (n0+8, k0+4) give b0, b1 of n-tile n0 and b0, b1 of n-tile n0 + 8 (PTX ISA,
    "Warp-level matrix load instruction: ldmatrix"; tests/test_kda_prefill_fused.py replays
    the distribution lane by lane). Works on ints and TIR expressions."""
    return n0 + lane // 8 // 2 * 8 + lane % 8, k0 + lane // 8 % 2 * 4


def _tf32(emulate: bool):
    """x rounded to TF32 (``cvt.rna.tf32.f32``: 10-bit mantissa, to nearest, ties away), as the
    float the mma reads; the identity when emulated (the CPU tests check the index maps at
    fp32, the GPU run the rounding)."""
    if emulate:
        return lambda x: x
    from tvm.backend.cuda.op import cuda_func_call

    return lambda x: cuda_func_call("k3_tf32", x, source_code=TF32_SRC, return_type="float32")


def _ex2(emulate: bool):
    """2^x: ``ex2.approx.ftz.f32`` on the GPU (relative error ≤ 2^-22, PTX ISA), exp2 emulated."""
    if emulate:
        return T.exp2
    from tvm.backend.cuda.op import cuda_func_call

    return lambda x: cuda_func_call("k3_ex2", x, source_code=EX2_SRC, return_type="float32")


def _rcp(emulate: bool):
    """1/x: ``rcp.approx.ftz.f32`` on the GPU (max error 1 ulp, PTX ISA; 1/inf = 0), a division
    emulated."""
    if emulate:
        return lambda x: T.float32(1) / x
    from tvm.backend.cuda.op import cuda_func_call

    return lambda x: cuda_func_call("k3_rcp", x, source_code=RCP_SRC, return_type="float32")


def _warp_sum(emulate: bool):
    """The sum of x over the warp's 32 lanes, in every lane (``shfl.xor`` butterfly); not
    available emulated (callers take another path there)."""
    if emulate:
        return None
    from tvm.backend.cuda.op import cuda_func_call

    return lambda x: cuda_func_call("k3_warp_sum", x, source_code=WARP_SUM_SRC, return_type="float32")


# one CUDA source per function (TVM adds a function's source once per name it is called by)
FLAG_SRC = {
    "k3_wait_upto": r"""
__device__ __forceinline__ int k3_wait_upto(int* f, int stride, int need, int known, int limit) {
  if (need <= known) return known;
  for (int c = known + 1; c <= need; ++c) {   // every chunk not yet known written, up to need
    int v;
    while (true) {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(f + c * stride) : "memory");
      if (v != 0) break;
      __nanosleep(64);
    }
  }
  int a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    a[i] = 0;
    if (need + 1 + i < limit)
      asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(a[i]) : "l"(f + (need + 1 + i) * stride) : "memory");
  }
  int r = need;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (a[i] == 0) break;
    r = need + 1 + i;
  }
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  return r;
}
""",
    "k3_set_flag": r"""
__device__ __forceinline__ void k3_set_flag(int* p) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(p), "r"(1) : "memory");
}
""",
    "k3_fence": r"""
__device__ __forceinline__ void k3_fence() { __threadfence(); }
""",
    "k3_ticket": r"""
__device__ __forceinline__ int k3_ticket(int* p) { return atomicAdd(p, 1); }
""",
    "k3_claim": r"""
__device__ __forceinline__ int k3_claim(int* ctr, int leave_early, int n_state, int lead, int n_items) {
  if (leave_early) {
    int started, head;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(started) : "l"(ctr) : "memory");
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(head) : "l"(ctr + 1) : "memory");
    if (started > n_state && head >= lead) return -1;
  }
  int it = atomicAdd(ctr + 1, 1);
  return it < n_items ? it : -1;
}
""",
}


@functools.cache
def _flag_macros(emulate: bool, H_: int = 1):
    """``(set_flag, fence, ticket, claim, wait_upto)`` over the int32 ``flags`` of
    ``kda_prefill_split_kernel``'s overlapped form: flags[0] counts the blocks started (their
    tickets), flags[1] the intra items claimed, flags[2 + item] = 1 once item's outputs are
    written. ``ticket(flags, dst)`` → dst[0]; ``claim(flags, dst, i, leave_early, n_state, lead,
    n_items)`` → dst[i]: the next item, or −1 when none is left or (``leave_early``, a state
    block) once more than ``n_state`` blocks have started and ``lead`` items are claimed.
    ``wait_upto(flags, rdy, r, base, need, limit)``: rdy[r, 0] (the last chunk known written, of
    the chunks at flags[2 + base + H·i], i < limit) raised to at least ``need`` — where it is below,
    wait for every chunk from rdy + 1 to ``need`` (acquire), then read the flags of the next 8
    (relaxed, one acquire fence after) so that the following chunks need no wait. GPU: acquire / release at GPU scope, ``atomicAdd`` (FLAG_SRC); emulated (serial
    blocks): plain loads and stores, and ``wait_upto`` asserts that the flag is set."""
    if emulate:
        @T.macro
        def set_flag(flags, i):
            flags[i + 2] = 1

        @T.macro
        def wait_upto(flags, rdy, r, base, need, limit):
            if need > rdy[r, 0]:
                for i in range(need - rdy[r, 0]):
                    assert flags[2 + base + (rdy[r, 0] + 1 + i) * H_] == 1, \
                        "overlap: a chunk was staged before its intra item was written"
                rdy[r, 0] = need

        @T.macro
        def fence():
            T.evaluate(0)

        @T.macro
        def ticket(flags, dst):
            dst[0] = flags[0]
            flags[0] = flags[0] + 1

        @T.macro
        def claim(flags, dst, i, leave_early, n_state, lead, n_items):
            if leave_early and flags[0] > n_state and flags[1] >= lead:
                dst[i] = -1
            else:
                dst[i] = T.Select(flags[1] < n_items, flags[1], -1)
                flags[1] = flags[1] + 1
    else:
        from tvm.backend.cuda.op import cuda_func_call

        @T.macro
        def wait_upto(flags, rdy, r, base, need, limit):
            rdy[r, 0] = cuda_func_call("k3_wait_upto", T.address_of(flags[2 + base]), H_, need, rdy[r, 0], limit,
                                       source_code=FLAG_SRC["k3_wait_upto"], return_type="int32")

        @T.macro
        def set_flag(flags, i):
            cuda_func_call("k3_set_flag", T.address_of(flags[i + 2]), source_code=FLAG_SRC["k3_set_flag"])

        @T.macro
        def fence():
            cuda_func_call("k3_fence", source_code=FLAG_SRC["k3_fence"])

        @T.macro
        def ticket(flags, dst):
            dst[0] = cuda_func_call("k3_ticket", T.address_of(flags[0]), source_code=FLAG_SRC["k3_ticket"],
                                    return_type="int32")

        @T.macro
        def claim(flags, dst, i, leave_early, n_state, lead, n_items):
            dst[i] = cuda_func_call("k3_claim", T.address_of(flags[0]), T.Cast("int32", leave_early), n_state,
                                    lead, n_items, source_code=FLAG_SRC["k3_claim"], return_type="int32")
    return set_flag, fence, ticket, claim, wait_upto


@T.macro
def nan_fill(SM, n):
    """SM[0:n] = NaN: the emulated kernels' shared memory before use, so that a read of what
    nothing wrote shows in the results."""
    for i in range(n):
        SM[i] = T.float32("nan")


def ld(buf, t, end, n_tok, h, d):
    """buf[t, h, d] as an expression, 0 for rows t ≥ end (the row index clamped into the tensor,
    so the load itself is always in bounds)."""
    return T.Select(t < end, buf[T.min(T.Cast("int64", t), n_tok - 1), h, d], T.float32(0))


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def kda_prefill_fused_kernel(H: int, K: int, V: int, scale: float, block_v: int = 64,
                             a_batch: int = 8, lower_bound: float | None = None,
                             p2_pairs: bool = False, ldsm: bool = False, split: bool = False,
                             p2_wide: bool = False, v_async: bool = False, fast_gate: bool = False,
                             p2_one: bool = False, o_vec: bool = False, tmat: bool = False,
                             pipe: bool = False, v_early: bool = False, ablate: frozenset = frozenset(),
                             p3_wg: bool | int = False, p5_wg: bool = False, emulate: bool = False):
    """The fused chunked prefill, one block per (sequence, head, ``block_v`` columns of V).
    PrimFunc arguments::

        q, k        [T, H, K]        float32   L2-normalized (q unscaled)
        v           [T, H, V]        float32
        g           [T, H, K]        float32   log decay, lower-bound gate (−5.5 ≤ g ≤ 0)
        beta        [T, H]           float32
        cu_seqlens  [B+1]            int32     token offsets of the sequences
        seq_slots   [B]              int32     state slot of each sequence
        kda_state   [L, S, H, K, V]  float32   read and written in place (argument index 7)
        layer       int32                      index into kda_state's first axis
        o           [T, H, V]        float32   out

    With ``lower_bound`` (the gate's lb, −5.5 ≤ lb < 0) the kernel also does the preprocessing
    that the arguments above assume done (spec §3 steps 2-4, as fla's ``chunk_kda`` with
    ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``)::

        q, k        [T, H, K]        float32   after the short conv, not yet L2-normalized
        v           [T, H, V]        float32
        f           [T, H, K]        float32   gate input f_b(f_a(x)) (g = lb·σ(e^{A_log}(f + dt_bias)))
        b           [T, H]           float32   β logits (β = σ(b))
        A_log       [H]              float32
        dt_bias     [H·K]            float32
        cu_seqlens, seq_slots, kda_state, layer, o   as above (kda_state: argument index 9)

    q and k are divided by sqrt(Σ x² + 1e-6) per row after staging (L2_NORM_EPS of
    relax_modules/kda.py), the gate computed in place of the staged f before its cumsum, β from
    b; rows past the sequence end get g = 0 and β = 0 as before.

    ``p2_pairs``: phase 2 in two rounds of two sub-blocks each (ka / qa of both staged at once;
    the 6 and 14 column tiles of the rounds spread over the warps) instead of four rounds of
    one: 4 barriers fewer per chunk (H200: 3-7% faster).

    ``ldsm``: phase 3 reads its B fragments (the S copy) by ``ldmatrix.x4``, two n-tiles per
    instruction instead of four 32-bit loads (H200: 0-2% faster with ``p2_pairs``).

    ``split``: the second kernel of the split form: every operand that involves Γ, the L / Aqk
    tile and D^{-1} of each chunk come from :func:`kda_prefill_split_intra_kernel` (computed
    for all chunks in parallel), so a chunk here is phases 3-5 only, on staged operands (4
    barriers instead of 13, no exponentials). Arguments::

        ka, qa, kd  [T, H, K]        float32   e^Γ k, scale·e^Γ q, e^{Γ_last−Γ} k (intra kernel)
        v           [T, H, V]        float32
        gl          [NC, H, K]       float32   e^{Γ_last} per chunk (intra kernel)
        la          [T, H, C]        float32   L / Aqk rows (intra kernel)
        dinv        [T, H, 16]       float32   D^{-1} rows (intra kernel)
        beta, cu_seqlens, seq_slots, kda_state, layer, o   as above (kda_state: argument index 10)

    with ``lower_bound`` set, ``beta`` holds the β logits b (β = σ(b) here).

    ``p2_wide`` (with ``p2_pairs``): each warp of a phase-2 round takes two adjacent n-tiles
    of one sub-block, loading each ka / qa fragment once for both (3 and 7 jobs in the two
    rounds instead of 6 and 14 tiles: ~1300 fewer shared-memory wavefronts per chunk;
    H200: 3-4% faster at 96 heads, ``kda_prefill_p2w_h200_2026-12-01.json``).

    ``p2_one`` (instead of ``p2_pairs`` / ``p2_wide``): phase 2 in one round. The staging
    forms every row's ka = k e^{Γ−r} and scale·q e^{Γ−r} at once, with r = Γ_{16I} of the row's
    own sub-block I (the reference each 16-row block of L / Aqk uses), one ``ex2`` for both: ka
    into the ka / qa region (64 rows fit where the pairs staged 2 × 32), scale·q e^{Γ−r} in fp32
    in place of q (phase 3 then forms scale·q e^Γ from it by e^{Γ_{16I}}). Then the 20 n-tiles
    of the four sub-blocks are 8 jobs of 3 adjacent n-tiles, one per warp and one code path
    (4 of the 24 computed twice or above the diagonal): 2 barriers and one round of 16 k-steps
    per chunk instead of 4 and two rounds (H200: 11% faster at 96 heads than ``p2_pairs`` with
    ``p2_wide``, ``kda_prefill_phases_c_h200_2026-12-01.json``). A first form gave warps 3 or 2
    n-tiles in two code paths: 1.0k more SASS instructions and 30% slower with the
    preprocessing (by its size probably instruction-cache misses, which the two-kernel form's
    ncu profile showed at 11.4k instructions; not profiled here;
    ``kda_prefill_p2one_h200_2026-12-01.json``).

    ``o_vec``: o stored as 8-byte pairs of adjacent columns with one bounds test per row half
    (32 stores per thread instead of 64 tests and stores; emulated: the same loop with two
    scalar stores per pair). H200: 5% faster
    at 96 heads (``kda_prefill_ovec_h200_2026-12-01.json``; copying the next chunk's q rows at
    phase 4 instead, as the split form's ``early_kq``, was 1-2% slower there and is not kept).

    ``v_async``: phase 3's R warps copy their 16 rows of v by 16-byte ``cp.async`` into the vn
    region (free once phase 2 has read its ka / qa there) at the start of phase 3 and form R
    in place after their products, instead of 64 scalar loads per thread from L2 into
    registers.

    ``fast_gate`` (with ``lower_bound``): a branch-free gate in the Γ cumsum. Each row's term
    lb·σ is computed unconditionally (σ by ``rcp.approx``) into a register and then selected
    (0 for rows past the sequence end, whatever their staged f), instead of selecting the
    whole expression: nvcc (with TVM's ``--use_fast_math``) had turned that row test around
    ``lb / (1 + 2^x)`` into a branch per row, which serialized each column's 64 rows. The
    arithmetic of valid rows is the same (``div.approx`` is a reciprocal and a multiply).

    ``tmat`` (with ``split``; the intra kernel built with ``tmat`` too): la holds T = (I + L)^{-1}'s
    blocks below the diagonal, transposed, where Lᵀ was, and phase 4 is vn_I = Σ_{J<I} T_IJ R_J +
    D_I^{-1} R_I as independent accumulations into a region of its own (``vn_product``; 1, 2 or 4
    warps per n-tile as block_v is ≥ 64, 32 or 16, so that every warp works) instead of the 8
    dependent steps of the substitution. H200, 12 heads, 8192 tokens: state kernel 0.69 → 0.63 ms,
    intra kernel 0.200 → 0.212 ms (``kda_prefill_split_parts_b_h200_2026-12-01.json``).

    ``pipe`` (with ``split`` and ``tmat``, block_v ≤ 32): chunk c + 1's e^{Γ_last−Γ} k, Aqk / Tᵀ and
    D^{-1} rows and e^{Γ_last} are copied during chunk c into a second set of regions (chunk c
    reads set c % 2; ``cp.async.wait_group 1``), its β logits loaded into a register and stored
    at phase 4; e^Γ k and scale·e^Γ q come at phase 4 as with ``early_kq`` (implied). The copies
    had cost 2.1 of a chunk's 5.0 µs at 16 columns, waited for right after their issue: state
    kernel 0.63 → 0.57 ms at 12 heads and 8192 tokens. At 64 columns the second set does not
    fit (ValueError).

    ``v_early`` (with ``pipe``): the R warps copy chunk c + 1's v rows into the R region at the
    start of chunk c's phase 5 (phase 4 has read R; with ``tmat`` vn has its own region) and
    form R in place in phase 3, instead of loading v from L2 there: 2.5% at 12 heads and 8192
    tokens (``kda_prefill_vearly_h200_2026-12-01.json``).

    ``p3_wg`` (sm_90a): phase 3's products ((e^Γ k) S and scale (e^Γ q) S, 64 rows × block_v
    columns × 128) as one warpgroup MMA chain per warpgroup (``wgmma.m64n{block_v}k8`` TF32, A
    from registers, B = the S copy in the 128-byte swizzled layout) instead of 16 ``mma.sync``
    k-steps per warp that each read all of S's B fragments from shared memory; D^{-1} runs while
    the last wgmmas are in flight (2: two sets of A fragments, a group's loads beside the wgmmas
    of the group before). Emulated: the swizzled S copy with the ``mma`` products.

    ``p5_wg`` (sm_90a): vn written into the q region (free after phase 3) in the same swizzled
    layout, rows of the chunk as K, and phase 5's S update and o = Y + Aqk vn as wgmma chains on
    it. Emulated: that layout with the ``mma`` products. Both are measured at block_v 128 (the
    model passes them there only); with ``p3_wg`` on the GPU ``ldsm`` has nothing left to do.

    ``ablate`` (a subset of ``ABLATE_PHASES``, or of ``ABLATE_STATE`` with ``split``; a
    diagnostic): leave that work out, so that the time it saves is its cost on the chunk's
    critical path; the results are wrong (``tests/gpu/profile_kda_prefill.py phases`` and
    ``split-run``). The barriers are kept except those of the
    parts "gamma" (1 barrier) and "p2" (4 with ``p2_pairs``, 2 with ``p2_one``), whose costs include them;
    "cumsum" and "norms" only act with ``lower_bound``.

    ``block_v`` (16, 32, 64 or 128): columns of V per block; fewer columns give more blocks
    (more SMs busy when B·H is small) at the cost of repeating phase 2 in every block.
    ``a_batch`` (4 or 8): k-steps whose A fragments are loaded before their mmas in phases 3
    and 5. Raises ValueError for other head sizes or tilings, for ``p3_wg`` outside False / True /
    2, ``p5_wg`` outside False / True, and for either with ``split``.
    """
    if split and (p3_wg or p5_wg):
        raise ValueError("p3_wg / p5_wg: the fused kernel's options here (the split form's state kernels take "
                         "p3_wg through kda_prefill_split_kernel)")
    if split and (p2_pairs or p2_wide or v_async or fast_gate or p2_one):
        raise ValueError("split: p2_pairs, p2_wide, p2_one, fast_gate belong to kda_prefill_split_intra_kernel; "
                         "v_async to the fused kernel")
    if p2_one and (p2_pairs or p2_wide):
        raise ValueError("p2_one replaces the rounds of p2_pairs / p2_wide: set p2_one alone")
    if (tmat or pipe or v_early) and not split:
        raise ValueError("tmat, pipe and v_early belong to the split form: set split (and tmat in its intra "
                         "kernel)")
    if split:
        return _split_state(H, K, V, scale, lower_bound, ((block_v, a_batch),), ldsm, emulate, o_vec=o_vec,
                            tmat=tmat, pipe=pipe, v_early=v_early, ablate=ablate)
    return _build(H, K, V, scale, block_v, a_batch, lower_bound, p2_pairs, ldsm, emulate, "fused",
                  p2_wide=p2_wide, v_async=v_async, fast_gate=fast_gate, p2_one=p2_one, o_vec=o_vec,
                  ablate=ablate, p3_wg=p3_wg, p5_wg=p5_wg)


# the split state kernel's block_v by the number of sequences B (``kda_prefill_split_state_kernel``):
# the widest of these whose B·H·(128 / block_v) blocks reach SPLIT_MIN_BLOCKS (most of the H200's
# 132 SMs at one block per SM), else the last
SPLIT_BLOCK_V = (64, 32, 16)
SPLIT_MIN_BLOCKS = 96


def split_block_v(n_seq: int, H: int, V: int = 128) -> int:
    """The block_v ``kda_prefill_split_state_kernel`` runs for ``n_seq`` sequences of ``H`` heads:
    the first of SPLIT_BLOCK_V with n_seq·H·V/block_v ≥ SPLIT_MIN_BLOCKS, else the last."""
    return next((bv for bv in SPLIT_BLOCK_V if n_seq * H * (V // bv) >= SPLIT_MIN_BLOCKS), SPLIT_BLOCK_V[-1])


def _first_n_seq(block_v: int, H: int, V: int) -> int:
    """The smallest number of sequences for which ``split_block_v`` gives ``block_v`` or wider
    (its choice only narrows as B falls; one sequence already fills the GPU when H is large)."""
    return next(b for b in range(1, SPLIT_MIN_BLOCKS + 1) if split_block_v(b, H, V) >= block_v)


@functools.cache
def kda_prefill_split_state_kernel(H: int, K: int, V: int, scale: float,
                                   lower_bound: float | None = None, early_kq: bool = True,
                                   o_vec: bool = False, tmat: bool = False, pipe: bool = False,
                                   v_early: bool = False, emulate: bool = False):
    """The split form's state kernel with block_v chosen at run time from the number of
    sequences B = len(cu_seqlens) − 1: the first of ``SPLIT_BLOCK_V`` (64, 32, 16) with
    B·H·V/block_v ≥ ``SPLIT_MIN_BLOCKS`` (96), else 16 — one kernel per block_v, picked by a
    host-side branch. H200, 12 heads (benchmarks/results/kda_prefill_split_h200_2026-11-30.json):
    one sequence of 8192 tokens 0.92 ms at 16 columns (32: 0.99), four of 2048 0.52 ms at 64
    (32: 0.63). ``early_kq`` (default): the next chunk's e^Γ k and scale·e^Γ q are copied during
    this chunk's phases 4-5 instead of in its phase 1 — 1.5-3% faster
    (``kda_prefill_split_early_h200_2026-11-30.json``: 0.90 / 0.50 ms at 12 heads, 0.96 / 0.57
    ms with the preprocessing). ``o_vec``: o stored as 8-byte column pairs, ``tmat``: phase 4 as
    vn = T R, ``pipe`` / ``v_early``: the next chunk's operands / v rows copied during this one
    (at block_v 16 and 32; the 64-column kernel runs without), as the fused kernel's options (the
    model dispatches all four: 0.77 / 0.49 ms at 12 heads with the preprocessing,
    ``kda_prefill_vearly_h200_2026-12-01.json``). Arguments as :func:`kda_prefill_fused_kernel` with
    ``split``; ValueError as there."""
    return _split_state(H, K, V, scale, lower_bound, tuple((bv, 8) for bv in SPLIT_BLOCK_V), False, emulate,
                        early_kq, o_vec, tmat, pipe, v_early)


def _split_state(H, K, V, scale, lower_bound, tilings, ldsm, emulate, early_kq=False, o_vec=False, tmat=False,
                 pipe=False, v_early=False, ablate=frozenset()):
    """The split form's state PrimFunc over the bodies of ``tilings`` ((block_v, a_batch), widest
    first): one tiling is launched as is, three (``SPLIT_BLOCK_V``) by a host-side branch on the
    number of sequences."""
    dispatch = _state_dispatch(H, K, V, scale, lower_bound, tilings, ldsm, emulate, early_kq, o_vec, tmat, pipe,
                               v_early, ablate)

    @T.prim_func(private=True)
    def kda_prefill_split_state(ka_h: T.handle, qa_h: T.handle, kd_h: T.handle, v_h: T.handle,
                                gl_h: T.handle, la_h: T.handle, dinv_h: T.handle, beta_h: T.handle,
                                cu_h: T.handle, slots_h: T.handle, state_h: T.handle, layer: T.int32,
                                o_h: T.handle):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        n_tok, n_cu, n_ch, n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        ka = T.match_buffer(ka_h, (n_tok, H, K), "float32")
        qa = T.match_buffer(qa_h, (n_tok, H, K), "float32")
        kd = T.match_buffer(kd_h, (n_tok, H, K), "float32")
        v = T.match_buffer(v_h, (n_tok, H, V), "float32")
        gl = T.match_buffer(gl_h, (n_ch, H, K), "float32")
        la_g = T.match_buffer(la_h, (n_tok, H, C), "float32")
        dinv_g = T.match_buffer(dinv_h, (n_tok, H, SUB), "float32")
        beta = T.match_buffer(beta_h, (n_tok, H), "float32")
        cu = T.match_buffer(cu_h, (n_cu,), "int32")
        slots = T.match_buffer(slots_h, (n_seq,), "int32")
        S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
        o = T.match_buffer(o_h, (n_tok, H, V), "float32")
        dispatch(qa, ka, v, kd, beta, la_g, dinv_g, gl, cu, slots, S, layer, o, n_tok, n_cu)

    return kda_prefill_split_state if emulate else mark(kda_prefill_split_state)


def _state_dispatch(H, K, V, scale, lower_bound, tilings, ldsm, emulate, early_kq, o_vec, tmat, pipe, v_early,
                    ablate, p3_wg=False):
    """The macro ``dispatch(qa, ka, v, kd, beta, la, dinv, gl, cu, slots, S, layer, o, n_tok, n_cu)``
    of :func:`_split_state`: the state kernel of one tiling, or of three by a host-side branch."""
    # pipe and v_early (pipe needs early_kq: the next chunk's e^Γ k, e^Γ q come at phase 4) in the
    # tilings whose shared memory holds the second set of regions; one tiling takes them as asked
    fits = [bv <= PIPE_MAX_BLOCK_V or len(tilings) == 1 for bv, _ in tilings]
    bodies = [_build(H, K, V, scale, bv, ab, lower_bound, False, ldsm, emulate, "state", early_kq or pipe,
                     o_vec=o_vec, tmat=tmat, pipe=pipe and f, v_early=v_early and f, ablate=ablate, p3_wg=p3_wg)
              for (bv, ab), f in zip(tilings, fits)]
    if len(bodies) not in (1, 3):
        raise ValueError(f"one or three tilings, got {tilings}")
    ONE = len(bodies) == 1
    body = bodies[0]
    b_wide, b_mid, b_narrow = (body, body, body) if ONE else bodies
    # the smallest B for which split_block_v picks the widest / the middle tiling
    n_wide, n_mid = (0, 0) if ONE else (_first_n_seq(tilings[0][0], H, V), _first_n_seq(tilings[1][0], H, V))

    @T.macro
    def dispatch(qa, ka, v, kd, beta, la_g, dinv_g, gl, cu, slots, S, layer, o, n_tok, n_cu):
        if ONE:
            body(qa, ka, v, kd, beta, None, None, la_g, dinv_g, gl, cu, slots, S, layer, o, n_tok, n_cu)
        else:
            if n_cu - 1 >= n_wide:
                b_wide(qa, ka, v, kd, beta, None, None, la_g, dinv_g, gl, cu, slots, S, layer, o, n_tok, n_cu)
            elif n_cu - 1 >= n_mid:
                b_mid(qa, ka, v, kd, beta, None, None, la_g, dinv_g, gl, cu, slots, S, layer, o, n_tok, n_cu)
            else:
                b_narrow(qa, ka, v, kd, beta, None, None, la_g, dinv_g, gl, cu, slots, S, layer, o, n_tok, n_cu)

    return dispatch


@functools.cache
def kda_prefill_split_intra_kernel(H: int, K: int, scale: float, lower_bound: float | None = None,
                                   p2_pairs: bool = True, p2_wide: bool = False, fast_gate: bool = False,
                                   p2_one: bool = False, tmat: bool = False, emulate: bool = False):
    """The first kernel of the split form: phases 1-2 and D^{-1} of the fused kernel for every
    chunk of every sequence in parallel, one block per (chunk, head) — the state-independent
    part, so that :func:`kda_prefill_fused_kernel` with ``split`` does only phases 3-5 per chunk
    (for few heads and one long sequence, where the fused kernel's 13 barriers per chunk set
    the time). PrimFunc arguments::

        q, k        [T, H, K]        float32   L2-normalized (q unscaled)
        g           [T, H, K]        float32   log decay, lower-bound gate (−5.5 ≤ g ≤ 0)
        beta        [T, H]           float32
        cu_seqlens  [B+1]            int32     token offsets of the sequences
        ka, qa, kd  [T, H, K]        float32   out: e^Γ k, scale·e^Γ q, e^{Γ_last−Γ} k (TF32),
                                               Γ = cumsum g within the chunk, Γ_last its last row
        gl          [NC, H, K]       float32   out: e^{Γ_last} of chunk ci (ci = Σ_{b'<b} ⌈len_b'/64⌉
                                               + c), NC ≥ kda_prefill_cuda.max_chunks(T, B)
        la          [T, H, C]        float32   out: row i of the chunk's L / Aqk tile (Aqk on and
                                               below the diagonal, Lᵀ above: L[j][i] at [i][j];
                                               reference r = Γ_{16I} per 16-row block, TF32)
        dinv        [T, H, 16]       float32   out: row i of D_I^{-1} = (I + L_II)^{-1}, I = i // 16

    With ``lower_bound`` the inputs are raw as for the fused kernel's (q, k before the L2 norms,
    f and b, then A_log [H] and dt_bias [H·K] before cu_seqlens), and the norms, gate and β are
    computed here (the state kernel then takes the logits b: ``split`` with ``lower_bound``).
    Rows are tokens (row i of chunk c of sequence b is token cu[b] + 64c + i); rows past a
    sequence's end are not written. Grid: (⌈T/64⌉ + B)·H blocks, those past the last chunk
    idle. ``p2_one``: phase 2 in one round as in the fused kernel (``p2_pairs`` and ``p2_wide``
    then unused; ValueError with ``p2_wide``). ``tmat``: T = (I + L)^{-1}'s blocks below the
    diagonal by block forward substitution after D^{-1} (``t_blocks``), stored in la transposed in
    place of Lᵀ above the diagonal blocks (for the state kernel's ``tmat``). Raises ValueError for K ≠ 128 or lb outside [−5.5, 0)."""
    if p2_one and p2_wide:
        raise ValueError("p2_one replaces the rounds of p2_pairs / p2_wide: set p2_one alone")
    return _build(H, K, K, scale, 16, 8, lower_bound, p2_pairs and not p2_one, False, emulate, "intra",
                  p2_wide=p2_wide, fast_gate=fast_gate, p2_one=p2_one, tmat=tmat)


OVERLAP_SMS = 132     # SMs of an H100 / H200 SXM: the overlapped form launches this many blocks
OVERLAP_LEAD = 0      # % of the intra items all blocks claim before the state blocks start theirs
OVERLAP_BLOCK_V = 32  # columns per state block in the overlapped form: H·V/32 state blocks, the rest workers


@functools.cache
def kda_prefill_split_kernel(H: int, K: int, V: int, scale: float, lower_bound: float | None = None,
                             overlap: bool = True, lead: int = OVERLAP_LEAD, trace: bool = False,
                             overlap_block_v: int | None = None, p3_wg: bool | int = False,
                             emulate: bool = False):
    """The split form as the model dispatches it, in one PrimFunc: the intra kernel
    (``p2_one``, ``fast_gate``, ``tmat``), then the state kernel with block_v at run time
    (``o_vec``, ``tmat``, ``pipe``, ``v_early``; :func:`kda_prefill_split_state_kernel`) — or,
    for one sequence (``overlap`` and B = 1, where the state kernel's H·V/block_v blocks leave SMs
    idle), both in one kernel of ``OVERLAP_SMS`` blocks:

    - every block takes a ticket (an ``atomicAdd``); the first H·V/block_v to start are the state
      blocks, the others intra workers;
    - all of them claim intra items (one (chunk, head) each, in chunk order, by an ``atomicAdd``),
      publish each item's outputs (barrier, then thread 0: ``__threadfence``, a release store of
      its flag);
    - a state block stops claiming once an intra worker has started and ``lead`` % of the items
      are claimed, then runs the state kernel's chunk loop, where thread 0 makes sure (acquire
      load; then the flags of the next 8 chunks read at once) that a chunk is written before the
      block's copies of it. The workers go on until no item is left. It cannot deadlock: a state block waits only once a worker, which never
      waits, is running; with no room for a worker the state blocks claim every item first.

    Arguments::

        q, k, g, beta / q, k, f, b, A_log, dt_bias    as kda_prefill_split_intra_kernel
        cu_seqlens  [B+1]                  int32
        seq_slots   [B]                    int32
        v           [T, H, V]              float32
        state       [L, slots, H, K, V]    float32   in place
        flags       [≥ 2 + (⌈T/64⌉ + B)·H] int32     zeros (in place; used when overlapping)
        layer                              int32
        ka, qa, kd, gl, la, dinv           float32   out: the intra kernel's scratch
        o           [T, H, V]              float32   out

    ``overlap_block_v`` (16 or 32; default ``OVERLAP_BLOCK_V``): the overlapped form's columns per
    state block. ``trace`` (profiling, overlapped form): thread 0 of block b also writes flags[2 + n_items +
    6b + j], j = 0 … 5: its ticket, the items it did, %globaltimer_lo (ns) at its start, when it
    stopped claiming and at its end, and its %smid (n_items = (⌈T/64⌉ + B)·H; emulated: times 0).
    ``p3_wg`` (sm_90a): the state kernels' phase 3 on wgmma, as :func:`kda_prefill_fused_kernel`'s
    (in the overlapped kernel too, whose shared tiles are allocated 1024-byte aligned beside the
    tickets).

    Raises ValueError as the two kernels do, and for ``lead`` outside 0-100."""
    if not 0 <= lead <= 100:
        raise ValueError(f"lead={lead}: a percentage of the intra items, 0-100")
    PRE = lower_bound is not None
    intra = _build(H, K, K, scale, 16, 8, lower_bound, False, False, emulate, "intra", fast_gate=True,
                   p2_one=True, tmat=True, parts=True)
    dispatch = _state_dispatch(H, K, V, scale, lower_bound, tuple((bv, 8) for bv in SPLIT_BLOCK_V), False, emulate,
                               True, True, True, True, True, frozenset(), p3_wg)
    bv1 = OVERLAP_BLOCK_V if overlap_block_v is None else overlap_block_v
    if bv1 not in BLOCK_V or bv1 > PIPE_MAX_BLOCK_V:
        raise ValueError(f"overlap_block_v={overlap_block_v}: 16 or 32 (the state kernel with pipe)")
    NS = H * (V // bv1)    # state blocks of one sequence
    OVL = overlap and NS < OVERLAP_SMS and bv1 <= PIPE_MAX_BLOCK_V
    BLK, THR, SH = block_thread_loops(emulate)
    SYNC = not emulate
    set_flag, fence, ticket, claim, _ = _flag_macros(emulate)
    TRACE = trace
    if emulate:
        def clock(name):
            return T.int32(0)
    else:
        from tvm.backend.cuda.op import cuda_func_call

        def clock(name):   # name: globaltimer_lo or smid
            return cuda_func_call(f"k3_{name}", source_code=f"""
__device__ __forceinline__ int k3_{name}() {{
  int t;
  asm volatile("mov.u32 %0, %{name};" : "=r"(t));
  return t;
}}
""", return_type="int32")
    item, intra_body = intra["item"], intra["body"]
    if OVL:
        state = _build(H, K, V, scale, bv1, 8, lower_bound, False, False, emulate, "state", True, o_vec=True,
                       tmat=True, pipe=True, v_early=True, overlap=True, parts=True, p3_wg=p3_wg)
        run = state["run"]
        NSM = max(intra["nsm"], state["nsm"])
    else:
        run, NSM = None, 0

    @T.macro
    def overlapped(q, k, g, beta, A_log, dt_bias, cu, slots, v, S, flags, layer, ka, qa, kd, gl, la_g, dinv_g, o,
                   n_tok, n_cu):
        for blk in BLK(OVERLAP_SMS):
            n_items = T.Cast("int32", ((n_tok + C - 1) // C + n_cu - 1) * H)   # as the intra kernel's grid
            n_lead = n_items * lead // 100
            # 1024-byte aligned beside meta and tk: the wgmma descriptors' swizzled tiles (p3_wg)
            SM = T.alloc_buffer((NSM,), "float32", scope=SH, align=1024)
            meta = T.alloc_buffer((2,), "int32", scope=SH)   # the intra item's chunk start, sequence end
            # ticket, the item being done (−1: none), trace: items done, start; the next item claimed
            tk = T.alloc_buffer((5,), "int32", scope=SH)
            if not SYNC:   # emulated: a read of shared memory that nothing wrote gives NaN
                nan_fill(SM, NSM)
            for tx in THR(NT):
                if tx == 0:
                    if TRACE:
                        tk[2] = 0
                        tk[3] = clock("globaltimer_lo")
                    ticket(flags, tk)
                    claim(flags, tk, 1, tk[0] < NS, NS, n_lead, n_items)
            if SYNC:
                T.tvm_storage_sync("shared")
            while tk[1] >= 0:
                for tx in THR(NT):   # the next item claimed now: the atomic's round trip under this item
                    if tx == 0:
                        claim(flags, tk, 4, tk[0] < NS, NS, n_lead, n_items)
                item(SM, meta, tk[1], q, k, g, beta, A_log, dt_bias, cu, ka, qa, kd, gl, la_g, dinv_g, n_tok, n_cu)
                # the block's writes of the item, then (thread 0, cumulative over what the barrier
                # ordered before it) a GPU-scope fence and the release store of its flag
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    if tx == 0:
                        fence()
                        set_flag(flags, tk[1])
                        if TRACE:
                            tk[2] = tk[2] + 1
                        tk[1] = tk[4]
                if SYNC:
                    T.tvm_storage_sync("shared")
            if TRACE:
                for tx in THR(NT):
                    if tx == 0:
                        flags[2 + n_items + blk * 6] = tk[0]
                        flags[2 + n_items + blk * 6 + 1] = tk[2]
                        flags[2 + n_items + blk * 6 + 2] = tk[3]
                        flags[2 + n_items + blk * 6 + 3] = clock("globaltimer_lo")
                        flags[2 + n_items + blk * 6 + 5] = clock("smid")
            if not SYNC:   # emulated: what the items left in shared memory reads as NaN again
                nan_fill(SM, NSM)
            if tk[0] < NS:
                bl = T.alloc_buffer((1,), "int32", scope="local")   # the state block's index, in a register
                bl[0] = tk[0]
                run(SM, bl[0], qa, ka, v, kd, beta, None, None, la_g, dinv_g, gl, cu, slots, S, layer, o, n_tok,
                    flags)
            if TRACE:
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    if tx == 0:
                        flags[2 + n_items + blk * 6 + 4] = clock("globaltimer_lo")

    @T.macro
    def split(q, k, g, beta, A_log, dt_bias, cu, slots, v, S, flags, layer, ka, qa, kd, gl, la_g, dinv_g, o,
              n_tok, n_cu):
        assert flags.shape[0] >= 2 + ((n_tok + C - 1) // C + n_cu - 1) * H + (6 * OVERLAP_SMS if TRACE else 0), \
            "kda_prefill_split: flags needs 2 + (ceil(T/64) + B) * H int32 entries (zeros; with trace 6 * 132 more)"
        if OVL and n_cu == 2:   # one sequence: the two kernels overlapped
            overlapped(q, k, g, beta, A_log, dt_bias, cu, slots, v, S, flags, layer, ka, qa, kd, gl, la_g,
                       dinv_g, o, n_tok, n_cu)
        else:
            intra_body(q, k, g, beta, A_log, dt_bias, cu, ka, qa, kd, gl, la_g, dinv_g, n_tok, n_cu)
            dispatch(qa, ka, v, kd, beta, la_g, dinv_g, gl, cu, slots, S, layer, o, n_tok, n_cu)

    if PRE:
        @T.prim_func(private=True)
        def kda_prefill_split(q_h: T.handle, k_h: T.handle, f_h: T.handle, b_h: T.handle, alog_h: T.handle,
                              dtb_h: T.handle, cu_h: T.handle, slots_h: T.handle, v_h: T.handle,
                              state_h: T.handle, flags_h: T.handle, layer: T.int32, ka_h: T.handle,
                              qa_h: T.handle, kd_h: T.handle, gl_h: T.handle, la_h: T.handle, dinv_h: T.handle,
                              o_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n_tok, n_cu, n_ch, n_seq, n_layer, n_slot, n_fl = (T.int64(), T.int64(), T.int64(), T.int64(),
                                                               T.int64(), T.int64(), T.int64())
            q = T.match_buffer(q_h, (n_tok, H, K), "float32")
            k = T.match_buffer(k_h, (n_tok, H, K), "float32")
            f = T.match_buffer(f_h, (n_tok, H, K), "float32")
            b = T.match_buffer(b_h, (n_tok, H), "float32")
            A_log = T.match_buffer(alog_h, (H,), "float32")
            dt_bias = T.match_buffer(dtb_h, (H * K,), "float32")
            cu = T.match_buffer(cu_h, (n_cu,), "int32")
            slots = T.match_buffer(slots_h, (n_seq,), "int32")
            v = T.match_buffer(v_h, (n_tok, H, V), "float32")
            S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
            flags = T.match_buffer(flags_h, (n_fl,), "int32")
            ka = T.match_buffer(ka_h, (n_tok, H, K), "float32")
            qa = T.match_buffer(qa_h, (n_tok, H, K), "float32")
            kd = T.match_buffer(kd_h, (n_tok, H, K), "float32")
            gl = T.match_buffer(gl_h, (n_ch, H, K), "float32")
            la_g = T.match_buffer(la_h, (n_tok, H, C), "float32")
            dinv_g = T.match_buffer(dinv_h, (n_tok, H, SUB), "float32")
            o = T.match_buffer(o_h, (n_tok, H, V), "float32")
            split(q, k, f, b, A_log, dt_bias, cu, slots, v, S, flags, layer, ka, qa, kd, gl, la_g, dinv_g, o,
                  n_tok, n_cu)
    else:
        @T.prim_func(private=True)
        def kda_prefill_split(q_h: T.handle, k_h: T.handle, g_h: T.handle, beta_h: T.handle, cu_h: T.handle,
                              slots_h: T.handle, v_h: T.handle, state_h: T.handle, flags_h: T.handle,
                              layer: T.int32, ka_h: T.handle, qa_h: T.handle, kd_h: T.handle, gl_h: T.handle,
                              la_h: T.handle, dinv_h: T.handle, o_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n_tok, n_cu, n_ch, n_seq, n_layer, n_slot, n_fl = (T.int64(), T.int64(), T.int64(), T.int64(),
                                                               T.int64(), T.int64(), T.int64())
            q = T.match_buffer(q_h, (n_tok, H, K), "float32")
            k = T.match_buffer(k_h, (n_tok, H, K), "float32")
            g = T.match_buffer(g_h, (n_tok, H, K), "float32")
            beta = T.match_buffer(beta_h, (n_tok, H), "float32")
            cu = T.match_buffer(cu_h, (n_cu,), "int32")
            slots = T.match_buffer(slots_h, (n_seq,), "int32")
            v = T.match_buffer(v_h, (n_tok, H, V), "float32")
            S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
            flags = T.match_buffer(flags_h, (n_fl,), "int32")
            ka = T.match_buffer(ka_h, (n_tok, H, K), "float32")
            qa = T.match_buffer(qa_h, (n_tok, H, K), "float32")
            kd = T.match_buffer(kd_h, (n_tok, H, K), "float32")
            gl = T.match_buffer(gl_h, (n_ch, H, K), "float32")
            la_g = T.match_buffer(la_h, (n_tok, H, C), "float32")
            dinv_g = T.match_buffer(dinv_h, (n_tok, H, SUB), "float32")
            o = T.match_buffer(o_h, (n_tok, H, V), "float32")
            split(q, k, g, beta, None, None, cu, slots, v, S, flags, layer, ka, qa, kd, gl, la_g, dinv_g, o,
                  n_tok, n_cu)

    return kda_prefill_split if emulate else mark(kda_prefill_split)


def _build(H, K, V, scale, block_v, a_batch, lower_bound, p2_pairs, ldsm, emulate, stage, early_kq=False,
           p2_wide=False, ablate=frozenset(), v_async=False, fast_gate=False, p2_one=False, o_vec=False,
           tmat=False, pipe=False, v_early=False, overlap=False, parts=False, p3_wg=False, p5_wg=False):
    """The kernels of this module (``stage``: "fused", "intra" or "state") over one set of
    shared-memory regions and macros. ``early_kq`` (state): the next chunk's e^Γ k and scale·e^Γ q
    are copied as soon as phase 3 has read this chunk's (start of phase 4), not in phase 1.
    ``tmat`` (split form): the intra kernel also forms T = (I + L)^{-1}'s blocks below the
    diagonal and stores them, transposed, in place of Lᵀ's (``t_blocks``); the state kernel's
    phase 4 is then the one product vn = T R (``vn_product``). ``pipe`` (state kernel with
    ``tmat``, block_v ≤ 32): the intra kernel's e^{Γ_last−Γ} k, L / Aqk (T) rows, D^{-1} rows and
    e^{Γ_last} of chunk c + 1 are copied into a second set of regions during chunk c (chunk c
    reads set c % 2), and its β logits loaded into a register there and stored at phase 4.
    ``v_early`` (state kernel with ``pipe``): the R warps copy chunk c + 1's v rows into the R
    region at the start of chunk c's phase 5 (phase 4 has read R there) and form R in place in
    phase 3, as the fused kernel's ``v_async`` (whose copies are waited for in phase 3).
    ``overlap`` (state kernel with ``pipe``): thread 0 waits for the flags of the chunks it
    stages (``kda_prefill_split_kernel``). ``parts``: instead of a PrimFunc the dict of the
    kernel's macros (``item`` / ``body`` of the intra kernel, ``run`` / ``body`` of the state
    kernel) and its shared-memory floats ``nsm``. ``p3_wg`` (fused, state): the S copy in the 128-byte
    swizzled K-major layout of a wgmma B operand (``s_word``) and, on the GPU, phase 3's products
    as ``wgmma.m64n{block_v}k8`` TF32 (A from registers, B = the S copy through a descriptor; each
    warpgroup's 64 rows at once) instead of per-warp ``mma.sync``; 2: with two sets of A fragments,
    so that a group's fragment loads run beside the group before's wgmmas. ``p5_wg`` (fused):
    vn in the q region (free after phase 3) in the same swizzled K-major layout (``vn_word``: rows of
    the chunk as K), and on the GPU phase 5's products — the S update (both warpgroups, 64 rows of S
    each) and o = Y + Aqk vn (warpgroup 1) — as wgmma chains on it; R and phase 4's intermediate
    stay row-major in the X region."""
    if p3_wg not in (False, True, 1, 2):
        raise ValueError(f"p3_wg: False, True (1) or 2, got {p3_wg!r}")
    if p5_wg not in (False, True):
        raise ValueError(f"p5_wg: False or True, got {p5_wg!r}")
    if p5_wg and stage != "fused":
        raise ValueError("p5_wg belongs to the fused kernel (vn takes the q region after phase 3)")
    P5WG = p5_wg
    if p3_wg and stage == "intra":
        raise ValueError("p3_wg belongs to the fused and split state kernels (their phase 3)")
    P3WG = p3_wg
    EARLY = early_kq and stage == "state"
    if tmat and stage == "fused":
        raise ValueError("tmat belongs to the split form (kda_prefill_split_intra_kernel / _state_kernel)")
    TM_I = tmat and stage == "intra"
    TM_S = tmat and stage == "state"
    if TM_S and block_v > TMAT_MAX_BLOCK_V:
        raise ValueError(f"tmat: block_v ≤ {TMAT_MAX_BLOCK_V} (vn's own region does not fit beside more "
                         f"columns), got {block_v}")
    if pipe and not (TM_S and block_v <= PIPE_MAX_BLOCK_V):
        raise ValueError("pipe: the split state kernel with tmat at block_v ≤ 32 (the second set of staged "
                         "regions does not fit beside 64 columns)")
    PIPE = pipe
    if v_early and not PIPE:
        raise ValueError("v_early: the split state kernel with tmat and pipe (its copies join pipe's groups)")
    V_EARLY = v_early
    if overlap and not PIPE:
        raise ValueError("overlap: the split state kernel with pipe (its waits are placed at pipe's copies)")
    OVL = overlap
    O_VEC = o_vec and stage != "intra"
    if K != 128 or V != 128:
        raise ValueError(f"the fused KDA prefill is written for K = V = 128, got K={K}, V={V}")
    if lower_bound is not None and not -5.5 <= lower_bound < 0:
        raise ValueError(f"lower_bound={lower_bound}: the fused prefill needs −5.5 ≤ lb < 0 (the "
                         "in-chunk exponentials of a 16-row block must stay in fp32 range)")
    if block_v not in BLOCK_V or a_batch not in (4, 8):
        raise ValueError(f"unsupported block_v={block_v} / a_batch={a_batch} "
                         f"(block_v one of {BLOCK_V}, a_batch 4 or 8)")
    if p2_wide and not p2_pairs:
        raise ValueError("p2_wide widens the rounds of p2_pairs: set p2_pairs too")
    P2W = p2_wide
    P2ONE = p2_one and stage != "state"
    ABL = frozenset(ablate)
    VASYNC = v_async and stage == "fused"
    FAST_GATE = fast_gate
    if not ABL <= (ABLATE_PHASES if stage == "fused" else ABLATE_STATE if stage == "state" else frozenset()):
        raise ValueError(f"ablate={sorted(ABL)}: a subset of {sorted(ABLATE_PHASES)} in the fused kernel, of "
                         f"{sorted(ABLATE_STATE)} in the split state kernel")
    BV, AB = block_v, a_batch
    NVB = V // BV
    N8 = BV // 8             # n-tiles of a row block
    NR = N8 * 4              # accumulator registers of a 16 × BV tile per thread
    NW = NT // 32            # warps
    NTW = (N8 + NW - 1) // NW  # vn n-tiles per warp in phase 4
    NSUB = C // SUB
    BLK, THR, SH = block_thread_loops(emulate)
    SYNC = not emulate
    RT = NT if emulate else 1   # rows of the per-thread register buffers
    EM = 1 if emulate else 0    # register row of thread tx: tx·EM
    AFN = 4 if emulate else 4 * AB
    KS = K + 4               # row stride of the raw k / q tiles, Γ, ka / qa (conflict-free A reads)
    SN = K + 4               # column stride of S (column-major)
    # row stride of the L / Aqk tile: C + 8 makes the Aqk reads of phase 5 conflict-free, C + 4
    # the transposed L reads of phase 4 (2-way conflicts on the other); at 128 columns C + 4
    # (as measured)
    LS = C + 8 if BV < 128 else C + 4
    RS = BV + 8              # row stride of vn
    DS = SUB + 4             # row stride of D^{-1}
    # one shared buffer, regions at fixed offsets (floats; 16-byte aligned rows for cp.async)
    O_KR, O_QR, O_G = 0, C * KS, 2 * C * KS
    O_SS = 3 * C * KS
    O_LA = O_SS + (0 if stage == "intra" else BV * SN)
    O_X = O_LA + C * LS                    # ka | qa in phase 2; vn | D^{-1} afterwards
    O_D = O_X + C * RS
    XN = max((4 if p2_pairs or P2ONE else 2) * SUB * KS, C * RS + C * DS)
    O_BT = O_X + XN
    O_GL = O_BT + C          # split state kernel: e^{Γ_last} of the chunk's K columns
    O_RN = O_GL + (K if stage == "state" else 0)   # emulated preprocessing: 1/‖k‖, 1/‖q‖ of the rows
    TS = C + 8               # row stride of T (tmat; conflict-free B reads)
    O_TM = O_D + C * DS      # intra with tmat: T, in the ka / qa region after phase 2 has read it
    if TM_I and O_TM + C * TS > O_X + XN:
        raise ValueError("tmat: T does not fit the ka / qa region")   # a layout error, not an input one
    SPL = stage == "state"
    SIGB = lower_bound is not None                 # β = σ(b) from logits
    PRE = SIGB and not SPL                         # L2 norms and gate in this kernel
    LB = float(lower_bound) if PRE else 0.0
    O_V = O_RN + (2 * C if PRE and emulate else 0)   # the emulated norms go through O_RN
    O_G2 = O_V + (C * RS if TM_S else 0)   # state with tmat: vn = T R (R stays in the X region)
    # pipe: the second set of the state kernel's staged e^{Γ_last−Γ} k, L / Aqk, D^{-1}, e^{Γ_last}
    O_LA2, O_D2, O_GL2 = O_G2 + C * KS, O_G2 + C * KS + C * LS, O_G2 + C * KS + C * LS + C * DS
    NSM = O_GL2 + K if PIPE else O_G2
    if (P3WG and O_SS * 4 % 1024) or (P5WG and O_QR * 4 % 1024):   # a layout error, not an input one
        raise ValueError("p3_wg / p5_wg: the S copy and the q region must start at multiples of 1024 bytes")
    if not emulate and NSM * 4 > 227 * 1024:
        raise ValueError(f"block_v={BV} needs {NSM * 4} bytes of shared memory (> 227 KB)")
    frag_a, mma, mma_rb, syncwarp, prefetch = _macros(emulate)
    wait_upto = _flag_macros(emulate, H)[4]
    ex2 = _ex2(emulate)
    rcp = _rcp(emulate)
    tf32 = _tf32(emulate)
    warp_sum = _warp_sum(emulate)
    if not emulate:
        from tvm.backend.cuda.op import cuda_func_call

        from schedules import mxfp4_ptx as ptx
        from schedules.wgmma_ptx import (fence_proxy_async, smem_address, sw128_desc, trap_if, wgmma_commit,
                                         wgmma_fence, wgmma_tf32_rs, wgmma_wait)
    WG = bool(P3WG) and not emulate   # phase 3 on wgmma
    WG2 = P3WG == 2 and WG             # ... with two sets of A fragments (a group's loads beside the last group's wgmmas)
    WG5 = P5WG and not emulate         # phase 5 on wgmma

    def s_word(d, n):   # the S copy's word of row d (K), column n (V): the B operand of phase 3
        if P3WG:   # K-major tiles of 32 columns of d (128-byte rows, 128-byte swizzle), BV rows each
            return O_SS + sw128_tf32_word(d, n, BV)
        return O_SS + n * SN + d   # column-major, padded rows

    def kr(SM, r, d):   # raw k / q of chunk row r, Γ (log2 units)
        return SM[O_KR + r * KS + d]

    def qr(SM, r, d):
        return SM[O_QR + r * KS + d]

    def gm(SM, r, d):
        return SM[O_G + r * KS + d]

    def alt(base, second, par):   # pipe: region ``base`` of set ``par`` (0 / 1; the int 0: set 0 as is)
        return base if isinstance(par, int) and par == 0 else base + par * (second - base)

    def la(SM, i, j, par=0):
        return SM[alt(O_LA, O_LA2, par) + i * LS + j]

    # the mma operands that involve Γ, as computed here (fused) or as the split form's intra
    # kernel stored them (TF32 already, staged in the k / q / Γ regions)
    def a_k(SM, r0, i, d):   # phase 3: (e^Γ k)[r0 + i, d]
        return SM[O_KR + (r0 + i) * KS + d] if SPL else tf32(kr(SM, r0 + i, d) * ex2(gm(SM, r0 + i, d)))

    def a_q(SM, r0, i, d):   # phase 3: scale (e^Γ q)[r0 + i, d] (r0 a multiple of 16)
        if SPL:
            return SM[O_QR + (r0 + i) * KS + d]
        if P2ONE:   # the q region holds scale·q e^{Γ − Γ_{r0}} (phase 2's staging)
            return tf32(qr(SM, r0 + i, d) * ex2(gm(SM, r0, d)))
        return tf32(T.float32(scale) * qr(SM, r0 + i, d) * ex2(gm(SM, r0 + i, d)))

    def a_kd(SM, r0, i, j, par=0):  # phase 5: (e^{Γ_last − Γ} k)[j, r0 + i]
        return SM[alt(O_G, O_G2, par) + j * KS + r0 + i] if SPL else tf32(kr(SM, j, r0 + i) * ex2(gm(SM, C - 1, r0 + i) - gm(SM, j, r0 + i)))

    def chunk_index(cb, tx, c):   # split: row of gl for chunk c of the block's sequence
        return cb[tx * EM, 0] + c if SPL else 0

    def decay(SM, d, par=0):        # phase 5: e^{Γ_last} of column d
        return SM[alt(O_GL, O_GL2, par) + d] if SPL else ex2(gm(SM, C - 1, d))

    def gamma_term(SM, gs, i, tx, c0, end):   # log2(e)·g of row i, column tx (gamma_cumsum)
        if PRE and FAST_GATE:   # every row's term, unconditionally (gamma_cumsum selects after)
            return T.float32(LB * LOG2E) * rcp(T.float32(1) + ex2(
                T.float32(-LOG2E) * gs[1] * (gm(SM, i, tx) + gs[2])))
        if PRE:
            return T.Select(c0 + i < end, T.float32(LB * LOG2E) / (T.float32(1) + ex2(
                T.float32(-LOG2E) * gs[1] * (gm(SM, i, tx) + gs[2]))), T.float32(0))
        return gm(SM, i, tx) * T.float32(LOG2E)

    def vn_word(j, n):   # vn's word of chunk row j, column n
        if P5WG:   # K-major tiles of 32 rows of the chunk in the q region (128-byte rows and swizzle)
            return O_QR + sw128_tf32_word(j, n, BV)
        return (O_V if TM_S else O_X) + j * RS + n

    def vn(SM, j, n):
        return SM[vn_word(j, n)]

    def rx(SM, j, n):   # R (phase 3) and phase 4's R_I − Σ L_IJ vn_J: row-major in the X region
        return SM[O_X + j * RS + n]

    def stage_row(it, tx):   # the chunk row thread tx stages in step it of a C·K / NT loop
        return it * (NT // K) + tx // K

    def o_row(c0, tx, hf):   # phase 5: the token of row half hf of warp tx // 32 ≥ 4's o tile
        return c0[0] + (tx // 32 - 4) * 16 + tx % 32 // 4 + hf * 8

    def o_col(blk, tx, nt):  # ... and the first of the thread's two columns in n-tile nt
        return blk % NVB * BV + nt * 8 + tx % 4 * 2

    @T.macro
    def gamma_cumsum(SM, tx, c0, end, alog, dt_bias, h):
        """Γ = log2(e)·cumsum g in place, thread tx < K summing column tx. With ``PRE`` the
        staged rows are f and g is the gate lb·σ(e^{A_log}(f + dt_bias)) (spec §3 step 3;
        σ(x) = 1 / (1 + 2^{−x·log2 e}) with ``ex2.approx``), 0 for rows at or past ``end``
        (token c0 + i); ``alog`` / ``dt_bias`` / ``h`` are read only then."""
        gs = T.alloc_buffer((4,), "float32", scope="local")   # running sum, e^{A_log}, dt_bias, term
        if tx < K:
            gs[0] = T.float32(0)
            if PRE:
                gs[1] = T.exp(alog)
                gs[2] = dt_bias[h * K + tx]
            for i in T.unroll(C):
                if PRE and FAST_GATE:   # the term computed first, then selected: a select, not a branch
                    gs[3] = gamma_term(SM, gs, i, tx, c0, end)
                    gs[0] = gs[0] + T.Select(c0 + i < end, gs[3], T.float32(0))
                else:
                    gs[0] = gs[0] + gamma_term(SM, gs, i, tx, c0, end)
                SM[O_G + i * KS + tx] = gs[0]

    @T.macro
    def row_norms(SM, tx, step):
        """The staged k rows (0 … C−1) and q rows (C … 2C−1, the region after k's) divided by
        sqrt(Σ x² + 1e-6) in place (spec §3 step 2), warp 4 + w taking rows 32w … 32w+31, lane l
        columns 4l … 4l+3, the squares summed across the warp by ``shfl.xor``. Emulated (no
        shuffles): step 0 writes each row's inverse norm to SM[O_RN …], step 1 scales."""
        nx = T.alloc_buffer((5,), "float32", scope="local")
        if tx >= NT - 4 * 32:
            if SYNC:
                for rr in T.unroll(2 * C // 4):
                    for u in T.unroll(4):
                        nx[u] = SM[O_KR + ((tx // 32 - (NW - 4)) * (2 * C // 4) + rr) * KS + tx % 32 * 4 + u]
                    nx[4] = T.rsqrt(warp_sum(nx[0] * nx[0] + nx[1] * nx[1] + nx[2] * nx[2] + nx[3] * nx[3])
                                    + T.float32(L2_NORM_EPS))
                    for u in T.unroll(4):
                        SM[O_KR + ((tx // 32 - (NW - 4)) * (2 * C // 4) + rr) * KS + tx % 32 * 4 + u] = nx[u] * nx[4]
            elif step == 0:
                if tx % 32 == 0:
                    for rr in range(2 * C // 4):
                        nx[0] = T.float32(0)
                        for d in range(K):
                            nx[0] = nx[0] + SM[O_KR + ((tx // 32 - (NW - 4)) * (2 * C // 4) + rr) * KS + d] * SM[O_KR + ((tx // 32 - (NW - 4)) * (2 * C // 4) + rr) * KS + d]
                        SM[O_RN + (tx // 32 - (NW - 4)) * (2 * C // 4) + rr] = T.rsqrt(nx[0] + T.float32(L2_NORM_EPS))
            else:
                for rr in range(2 * C // 4):
                    for u in range(4):
                        SM[O_KR + ((tx // 32 - (NW - 4)) * (2 * C // 4) + rr) * KS + tx % 32 * 4 + u] = SM[O_KR + ((tx // 32 - (NW - 4)) * (2 * C // 4) + rr) * KS + tx % 32 * 4 + u] * SM[O_RN + (tx // 32 - (NW - 4)) * (2 * C // 4) + rr]

    @T.macro
    def l_aqk_tile(SM, acc, af, bf, tx, I, nt, KA, QA, n):
        """Columns 8·nt … 8·(nt+n)−1 (``n`` = 1, 2 or 3 n-tiles) of L and Aqk for the rows of
        sub-block I (runtime values), the A operands ka / qa of its 16 rows given by ``KA(i, d)`` /
        ``QA(i, d)`` (TF32); B = k e^{r−Γ} computed once per k-step and n-tile for both products,
        each A fragment loaded once for the n n-tiles. acc[4t …]: L of n-tile nt + t, acc[4n + 4t
        …]: Aqk."""
        for r in T.unroll(8 * n):
            acc[tx * EM, r] = T.float32(0)
        for ks in T.unroll(K // 8):
            for t in T.unroll(n):
                bf[2 * t] = tf32(kr(SM, (nt + t) * 8 + tx % 32 // 4, ks * 8 + tx % 4) * ex2(gm(SM, I * SUB, ks * 8 + tx % 4) - gm(SM, (nt + t) * 8 + tx % 32 // 4, ks * 8 + tx % 4)))
                bf[2 * t + 1] = tf32(kr(SM, (nt + t) * 8 + tx % 32 // 4, ks * 8 + tx % 4 + 4) * ex2(gm(SM, I * SUB, ks * 8 + tx % 4 + 4) - gm(SM, (nt + t) * 8 + tx % 32 // 4, ks * 8 + tx % 4 + 4)))
            frag_a(af, 0, KA, tx % 32, ks * 8)
            for t in T.unroll(n):
                mma_rb(acc, tx * EM, 4 * t, af, 0, bf, 2 * t, KA,
                       lambda d, j: kr(SM, j, d) * ex2(gm(SM, I * SUB, d) - gm(SM, j, d)), tx % 32, ks * 8, (nt + t) * 8)
            frag_a(af, 0, QA, tx % 32, ks * 8)
            for t in T.unroll(n):
                mma_rb(acc, tx * EM, 4 * n + 4 * t, af, 0, bf, 2 * t, QA,
                       lambda d, j: kr(SM, j, d) * ex2(gm(SM, I * SUB, d) - gm(SM, j, d)), tx % 32, ks * 8, (nt + t) * 8)
        # entry e of n-tile nt + t: row I·16 + gr + 8(e//2), column 8·(nt + t) + 2·tg + e%2
        for t in T.unroll(n):
            for e in T.unroll(4):
                if (nt + t) * 8 + tx % 4 * 2 + e % 2 < I * SUB + tx % 32 // 4 + e // 2 * 8:
                    SM[O_LA + ((nt + t) * 8 + tx % 4 * 2 + e % 2) * LS + I * SUB + tx % 32 // 4 + e // 2 * 8] = tf32(SM[O_BT + I * SUB + tx % 32 // 4 + e // 2 * 8] * acc[tx * EM, 4 * t + e])
                    SM[O_LA + (I * SUB + tx % 32 // 4 + e // 2 * 8) * LS + (nt + t) * 8 + tx % 4 * 2 + e % 2] = tf32(acc[tx * EM, 4 * n + 4 * t + e])
                elif (nt + t) * 8 + tx % 4 * 2 + e % 2 == I * SUB + tx % 32 // 4 + e // 2 * 8:
                    SM[O_LA + (I * SUB + tx % 32 // 4 + e // 2 * 8) * LS + (nt + t) * 8 + tx % 4 * 2 + e % 2] = tf32(acc[tx * EM, 4 * n + 4 * t + e])

    @T.macro
    def gemm(acc, row, af, A, B, steps, tiles, lane, last):
        """acc[row, nt·4 + e] += the warp's A[0:16, 0:8·steps] · B[:, 8·nt …] for nt < tiles,
        the A fragments of ``AB`` k-steps loaded before their mmas; k-steps past ``last`` (None:
        none) skipped."""
        for kh in T.unroll((steps + AB - 1) // AB):
            for ks in T.unroll(AB):
                if kh * AB + ks < steps and (last is None or kh * AB + ks <= last):
                    frag_a(af, ks * 4 * (1 - EM), A, lane, (kh * AB + ks) * 8)
            for ks in T.unroll(AB):
                if kh * AB + ks < steps and (last is None or kh * AB + ks <= last):
                    for nt in T.unroll(tiles):
                        mma(acc, row, nt * 4, af, ks * 4 * (1 - EM), A, B, lane, (kh * AB + ks) * 8, nt * 8)

    @T.macro
    def gemm_s(SM, acc, row, af, bq, A, steps, tiles, lane):
        """As ``gemm`` with B = the S copy (B(d, n) = SM[s_word(d, n)]); with
        ``ldsm`` on the GPU its fragments come by ``ldmatrix.x4``, two n-tiles at a time."""
        if ldsm and SYNC:
            for kh in T.unroll(steps // AB):
                for ks in T.unroll(AB):
                    frag_a(af, ks * 4, A, lane, (kh * AB + ks) * 8)
                for ks in T.unroll(AB):
                    for np_ in T.unroll(tiles // 2):
                        cuda_func_call("k3_ldsm_x4", T.address_of(bq[0]), T.address_of(SM[
                            s_word(ldsm_b_row(lane, np_ * 16, (kh * AB + ks) * 8)[1],
                                   ldsm_b_row(lane, np_ * 16, (kh * AB + ks) * 8)[0])]), source_code=LDSM_SRC)
                        mma_rb(acc, row, np_ * 8, af, ks * 4, bq, 0, A, None, lane, (kh * AB + ks) * 8, np_ * 16)
                        mma_rb(acc, row, np_ * 8 + 4, af, ks * 4, bq, 2, A, None, lane, (kh * AB + ks) * 8, np_ * 16 + 8)
        else:
            gemm(acc, row, af, A, lambda d, n: SM[s_word(d, n)], steps, tiles, lane, None)

    def a_aqk(SM, tx, c):   # phase 5's A for o: warp tx // 32 ≥ 4's rows of Aqk, zero above the diagonal
        return lambda i, j: T.Select(j <= (tx // 32 - 4) * 16 + i, la(SM, (tx // 32 - 4) * 16 + i, j, c % 2 if PIPE else 0),
                                     T.float32(0))

    def fset(kh):   # wg_gemm: the first A fragment word of group kh (two sets with p3_wg=2)
        return (kh % 2 * AB if WG2 else 0) * 4

    @T.macro
    def wg_gemm(SM, acc, af, A, lane, base, steps, fresh):
        """``p3_wg`` / ``p5_wg`` on the GPU: acc[0, 0:NR] (+)= the warp's 16 rows of A[:, 0:8·steps]
        · B, B the swizzled K-major tiles at word ``base`` (the S copy, ``s_word``; vn, ``vn_word``),
        as the warpgroup's ``steps`` ``wgmma.m64n{BV}k8`` TF32 in groups of AB k-steps: a group's A
        fragments loaded, its wgmmas issued, and waited for before the next group reuses ``af``;
        the last group is left in flight (the caller waits: ``wgmma_wait(0)``). ``fresh``: the
        first overwrites acc (no other instruction defines it, which would serialize the wgmmas)."""
        wd = T.alloc_buffer((1,), "uint64", scope="local")
        wd[0] = sw128_desc(smem_address(T.address_of(SM[base])))
        for kh in T.unroll(steps // AB):
            for ks in T.unroll(AB):
                frag_a(af, fset(kh) + ks * 4, A, lane, (kh * AB + ks) * 8)
            T.evaluate(wgmma_fence())
            for ks in T.unroll(AB):
                T.evaluate(wgmma_tf32_rs(BV, T.address_of(acc[0, 0]), af[fset(kh) + ks * 4], af[fset(kh) + ks * 4 + 1],
                                         af[fset(kh) + ks * 4 + 2], af[fset(kh) + ks * 4 + 3],
                                         wd[0] + T.Cast("uint64", sw128_tf32_kstep(kh * AB + ks, BV)),
                                         T.Cast("int32", kh * AB + ks > 0) if fresh else T.int32(1)))
            T.evaluate(wgmma_commit())
            if kh < steps // AB - 1:
                if WG2:   # two fragment sets: the group before this one (the other set) done
                    if kh >= 1:
                        T.evaluate(wgmma_wait(1))
                else:
                    T.evaluate(wgmma_wait(0))

    @T.macro
    def o_chain(SM, Y, af, tx, c):
        """``p5_wg`` on the GPU, warpgroup 1: Y += Aqk vn for its 64 rows over every k-step (A zero
        above the diagonal); the last group left in flight."""
        wg_gemm(SM, Y, af, a_aqk(SM, tx, c), tx % 32, O_QR, C // 8, False)

    @T.macro
    def copy_rows(SM, tx, c0, off, stride, src, width, h, n_tok):
        """src[t, h, 0:width] of the chunk's rows t = c0[0] … → SM[off + row·stride …] by 16-byte
        ``cp.async`` (rows at or past c0[1] zero-filled; emulated: plain loads); c0[2] scratch."""
        for it in T.unroll(C * width // 4 // NT):
            c0[2] = T.min(c0[0] + (it * NT + tx) // (width // 4), c0[1] - 1)
            if SYNC:
                ptx.cp_async16(T.address_of(SM[off + (it * NT + tx) // (width // 4) * stride + tx % (width // 4) * 4]),
                               T.address_of(src[c0[2], h, tx % (width // 4) * 4]),
                               c0[0] + (it * NT + tx) // (width // 4) < c0[1])
            else:
                for u in range(4):
                    SM[off + (it * NT + tx) // (width // 4) * stride + tx % (width // 4) * 4 + u] = ld(src, c0[0] + (it * NT + tx) // (width // 4), c0[1], n_tok, h, tx % (width // 4) * 4 + u)

    def beta_value(valid, b):   # β of a staged row: σ(b) with SIGB (b the logit), 0 where not valid
        return T.Select(valid, T.sigmoid(b) if SIGB else b, T.float32(0))

    @T.macro
    def stage_la_dinv_gl(SM, tx, c0, la_g, dinv_g, gl_g, ci, h, n_tok, par):
        """State kernel: the chunk's L / Aqk (tmat: Aqk / Tᵀ) and D^{-1} rows and its e^{Γ_last}
        (chunk ``ci`` of gl) → the regions of set ``par`` (cp.async; the caller commits)."""
        copy_rows(SM, tx, c0, alt(O_LA, O_LA2, par), LS, la_g, C, h, n_tok)
        copy_rows(SM, tx, c0, alt(O_D, O_D2, par), DS, dinv_g, SUB, h, n_tok)
        if tx < K // 4:
            if SYNC:
                ptx.cp_async16(T.address_of(SM[alt(O_GL, O_GL2, par) + tx * 4]), T.address_of(gl_g[ci, h, tx * 4]), True)
            else:
                for u in range(4):
                    SM[alt(O_GL, O_GL2, par) + tx * 4 + u] = gl_g[ci, h, tx * 4 + u]

    @T.macro
    def stage_chunk(SM, tx, c0, q, k, g, beta, la_g, dinv_g, gl_g, ci, h, n_tok, first):
        """Phase 1's copies of the chunk at token c0[0] of a sequence ending at c0[1] (c0[2]: a
        scratch row): raw k, q and g (in the split form's state kernel: e^Γ k, scale e^Γ q and
        e^{Γ_last−Γ} k, and the L / Aqk and D^{-1} rows and e^{Γ_last} of its chunk ``ci``) →
        shared memory by 16-byte ``cp.async`` (rows past the sequence end zero-filled; emulated:
        plain loads), then β. The caller waits for the copies. ``EARLY``: k and q only for the
        ``first`` chunk (the others' were issued in the previous chunk's phase 4)."""
        if EARLY:
            if first:
                copy_rows(SM, tx, c0, O_KR, KS, k, K, h, n_tok)
                copy_rows(SM, tx, c0, O_QR, KS, q, K, h, n_tok)
            copy_rows(SM, tx, c0, O_G, KS, g, K, h, n_tok)
        else:   # k, q, g interleaved row by row
            for it in T.unroll(C * K // 4 // NT):
                # row (it·NT + tx) // (K/4) of the chunk, clamped into the sequence
                c0[2] = T.min(c0[0] + (it * NT + tx) // (K // 4), c0[1] - 1)
                if SYNC:
                    ptx.cp_async16(T.address_of(SM[O_KR + (it * NT + tx) // (K // 4) * KS + tx % (K // 4) * 4]),
                                   T.address_of(k[c0[2], h, tx % (K // 4) * 4]),
                                   c0[0] + (it * NT + tx) // (K // 4) < c0[1])
                    ptx.cp_async16(T.address_of(SM[O_QR + (it * NT + tx) // (K // 4) * KS + tx % (K // 4) * 4]),
                                   T.address_of(q[c0[2], h, tx % (K // 4) * 4]),
                                   c0[0] + (it * NT + tx) // (K // 4) < c0[1])
                    ptx.cp_async16(T.address_of(SM[O_G + (it * NT + tx) // (K // 4) * KS + tx % (K // 4) * 4]),
                                   T.address_of(g[c0[2], h, tx % (K // 4) * 4]),
                                   c0[0] + (it * NT + tx) // (K // 4) < c0[1])
                else:
                    for u in range(4):
                        SM[O_KR + (it * NT + tx) // (K // 4) * KS + tx % (K // 4) * 4 + u] = ld(k, c0[0] + (it * NT + tx) // (K // 4), c0[1], n_tok, h, tx % (K // 4) * 4 + u)
                        SM[O_QR + (it * NT + tx) // (K // 4) * KS + tx % (K // 4) * 4 + u] = ld(q, c0[0] + (it * NT + tx) // (K // 4), c0[1], n_tok, h, tx % (K // 4) * 4 + u)
                        SM[O_G + (it * NT + tx) // (K // 4) * KS + tx % (K // 4) * 4 + u] = ld(g, c0[0] + (it * NT + tx) // (K // 4), c0[1], n_tok, h, tx % (K // 4) * 4 + u)
        if stage == "state":
            stage_la_dinv_gl(SM, tx, c0, la_g, dinv_g, gl_g, ci, h, n_tok, 0)
        if SYNC:
            ptx.commit()
        if tx < C:
            SM[O_BT + tx] = beta_value(c0[0] + tx < c0[1], beta[T.min(c0[0] + tx, c0[1] - 1), h])

    @T.macro
    def copy_v_rows(SM, tx, c0, v, blk):
        """R warp tx // 32 < 4: its 16 rows of v of the chunk at token c0[0] (sequence end c0[1])
        → the R region O_X by 16-byte ``cp.async``, rows past the end zero-filled, committed
        (emulated: the thread's own fragment elements, where it forms R)."""
        if SYNC:
            for it in T.unroll(16 * BV // 4 // 32):
                ptx.cp_async16(
                    T.address_of(SM[O_X + (tx // 32 * 16 + (it * 32 + tx % 32) // (BV // 4)) * RS + (it * 32 + tx % 32) % (BV // 4) * 4]),
                    T.address_of(v[T.min(c0[0] + tx // 32 * 16 + (it * 32 + tx % 32) // (BV // 4), c0[1] - 1), blk // NVB % H, blk % NVB * BV + (it * 32 + tx % 32) % (BV // 4) * 4]),
                    c0[0] + tx // 32 * 16 + (it * 32 + tx % 32) // (BV // 4) < c0[1])
            ptx.commit()
        else:
            for nt in T.unroll(N8):
                for e in T.unroll(4):
                    SM[O_X + (tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8) * RS + nt * 8 + tx % 4 * 2 + e % 2] = ld(v, c0[0] + tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8, c0[1], v.shape[0], blk // NVB % H, blk % NVB * BV + nt * 8 + tx % 4 * 2 + e % 2)

    @T.macro
    def stage_next(SM, tx, c1, kd, beta, la_g, dinv_g, gl_g, ci, h, n_tok, bnext, par):
        """``pipe``: the copies of chunk ``ci`` (token c1[0] of a sequence ending at c1[1]; c1[2]
        scratch) into set ``par``: e^{Γ_last−Γ} k, L / Aqk, D^{-1} rows, e^{Γ_last}; its β logit of
        row tx < C into ``bnext`` (stored at phase 4). The caller commits and waits."""
        copy_rows(SM, tx, c1, alt(O_G, O_G2, par), KS, kd, K, h, n_tok)
        stage_la_dinv_gl(SM, tx, c1, la_g, dinv_g, gl_g, ci, h, n_tok, par)
        if tx < C:
            bnext[tx * EM, 0] = beta[T.min(c1[0] + tx, c1[1] - 1), h]

    @T.macro
    def gamma_and_norms(SM, c0s, end, h, A_log, dt_bias):
        """Phase 1b of the chunk at token c0s of a sequence ending at end (head h)."""
        # phase 1b: Γ = log2(e)·cumsum g in place (threads tx < K: column tx); with PRE
        #           the gate g = lb·σ(e^{A_log}(f + dt_bias)) of each staged f first
        #           (same thread, 0 for rows past the sequence end) ‖ the L2 norms of
        #           the 2C staged k, q rows (warps 4-7, 32 rows each; ``row_norms``)
        if SYNC:
            T.tvm_storage_sync("shared")
        if PRE:
            for tx in THR(NT):
                if "cumsum" not in ABL:
                    gamma_cumsum(SM, tx, c0s, end, A_log[h], dt_bias, h)
                if "norms" not in ABL:
                    row_norms(SM, tx, 0)
            if not SYNC:   # emulated: the norms of every row first, then the scaling
                for tx in THR(NT):
                    row_norms(SM, tx, 1)
        else:
            for tx in THR(NT):
                gamma_cumsum(SM, tx, c0s, end, None, None, h)

    @T.macro
    def phase2(SM):
        """Phase 2: the L / Aqk tile of the staged chunk (barrier first)."""
        if P2ONE:
            # phase 2 in one round: every row's ka = k e^{Γ−r} (TF32) → the ka / qa region and
            # scale·q e^{Γ−r} (fp32) in place of q, r = Γ_{16I} of the row's own sub-block I, then
            # the 20 n-tiles of the four sub-blocks as 8 jobs of three adjacent n-tiles, one per
            # warp and one code path: warps 1 and 2 both do n-tile 5 of sub-block 3, warps 5 and 6
            # n-tiles 1 and 2 of sub-block 1 (the same values stored twice), warp 7's third n-tile
            # lies above the diagonal (not stored; its B values k e^{r−Γ} for rows 16-23 may
            # overflow to inf, which only its own, unstored accumulators see)
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                ev = T.alloc_buffer((1,), "float32", scope="local")
                for it in T.unroll(C * K // NT):
                    ev[0] = ex2(gm(SM, stage_row(it, tx), tx % K) - gm(SM, stage_row(it, tx) // SUB * SUB, tx % K))
                    SM[O_X + stage_row(it, tx) * KS + tx % K] = tf32(kr(SM, stage_row(it, tx), tx % K) * ev[0])
                    SM[O_QR + stage_row(it, tx) * KS + tx % K] = T.float32(scale) * qr(SM, stage_row(it, tx), tx % K) * ev[0]
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                af = T.alloc_buffer((4,), "float32", scope="local")
                bf = T.alloc_buffer((6,), "float32", scope="local")
                ti = T.alloc_buffer((2,), "int32", scope="local")        # sub-block, first n-tile
                acc = T.alloc_buffer((RT, 24), "float32", scope="local")
                # (I, first n-tile) by warp: (3, 0) (3, 3) (3, 5) (2, 0) (2, 3) (1, 0) (1, 1) (0, 0)
                ti[0] = T.Select(tx // 32 < 3, 3, T.Select(tx // 32 < 5, 2, T.Select(tx // 32 < 7, 1, 0)))
                ti[1] = T.Select(tx // 32 == 1 or tx // 32 == 4, 3, T.Select(tx // 32 == 2, 5, T.Select(tx // 32 == 6, 1, 0)))
                l_aqk_tile(SM, acc, af, bf, tx, ti[0], ti[1],
                           lambda i, d: SM[O_X + (ti[0] * SUB + i) * KS + d],
                           lambda i, d: tf32(SM[O_QR + (ti[0] * SUB + i) * KS + d]), 3)
        elif p2_pairs:
            # phase 2, paired: rounds R = 0, 1 of sub-blocks 2R, 2R+1 (reference r =
            # Γ_{16I}); tile t < 8R+6 of a round is (I, nt) = (2R, t) for t < 4R+2, else
            # (2R+1, t − 4R − 2); warp wi takes tiles wi and wi + 8
            for R in range(2):
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    for sb in T.unroll(2):
                        for it in T.unroll(SUB * K // NT):
                            SM[O_X + sb * 2 * SUB * KS + (it * (NT // K) + tx // K) * KS + tx % K] = tf32(kr(SM, (R * 2 + sb) * SUB + it * (NT // K) + tx // K, tx % K) * ex2(gm(SM, (R * 2 + sb) * SUB + it * (NT // K) + tx // K, tx % K) - gm(SM, (R * 2 + sb) * SUB, tx % K)))
                            SM[O_X + sb * 2 * SUB * KS + (SUB + it * (NT // K) + tx // K) * KS + tx % K] = tf32(T.float32(scale) * qr(SM, (R * 2 + sb) * SUB + it * (NT // K) + tx // K, tx % K) * ex2(gm(SM, (R * 2 + sb) * SUB + it * (NT // K) + tx // K, tx % K) - gm(SM, (R * 2 + sb) * SUB, tx % K)))
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    af = T.alloc_buffer((4,), "float32", scope="local")
                    acc = T.alloc_buffer((RT, 16 if P2W else 8), "float32", scope="local")   # L tiles, Aqk tiles
                    bf = T.alloc_buffer((4 if P2W else 2,), "float32", scope="local")
                    ti = T.alloc_buffer((2,), "int32", scope="local")        # sub-block, n-tile
                    if P2W:   # job w < 4R+3: n-tiles 2w', 2w'+1 of (I, w') = (2R, w) for w < 2R+1, else (2R+1, w − 2R − 1)
                        if tx // 32 < R * 4 + 3:
                            ti[0] = T.Select(tx // 32 < R * 2 + 1, R * 2, R * 2 + 1)
                            ti[1] = T.Select(tx // 32 < R * 2 + 1, tx // 32, tx // 32 - R * 2 - 1) * 2
                            l_aqk_tile(SM, acc, af, bf, tx, ti[0], ti[1],
                                       lambda i, d: SM[O_X + (ti[0] - R * 2) * 2 * SUB * KS + i * KS + d],
                                       lambda i, d: SM[O_X + (ti[0] - R * 2) * 2 * SUB * KS + (SUB + i) * KS + d], 2)
                    else:
                        for tt in range(2):
                            if tx // 32 + tt * NW < R * 8 + 6:
                                ti[0] = T.Select(tx // 32 + tt * NW < R * 4 + 2, R * 2, R * 2 + 1)
                                ti[1] = T.Select(tx // 32 + tt * NW < R * 4 + 2, tx // 32 + tt * NW, tx // 32 + tt * NW - R * 4 - 2)
                                l_aqk_tile(SM, acc, af, bf, tx, ti[0], ti[1],
                                           lambda i, d: SM[O_X + (ti[0] - R * 2) * 2 * SUB * KS + i * KS + d],
                                           lambda i, d: SM[O_X + (ti[0] - R * 2) * 2 * SUB * KS + (SUB + i) * KS + d], 1)
        else:
            # phase 2: L and Aqk, one 16-row sub-block I at a time (reference r = Γ_{16I})
            for I in range(NSUB):
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    for it in T.unroll(SUB * K // NT):
                        SM[O_X + (it * (NT // K) + tx // K) * KS + tx % K] = tf32(kr(SM, I * SUB + it * (NT // K) + tx // K, tx % K) * ex2(gm(SM, I * SUB + it * (NT // K) + tx // K, tx % K) - gm(SM, I * SUB, tx % K)))
                        SM[O_X + (SUB + it * (NT // K) + tx // K) * KS + tx % K] = tf32(T.float32(scale) * qr(SM, I * SUB + it * (NT // K) + tx // K, tx % K) * ex2(gm(SM, I * SUB + it * (NT // K) + tx // K, tx % K) - gm(SM, I * SUB, tx % K)))
                if SYNC:
                    T.tvm_storage_sync("shared")
                for tx in THR(NT):
                    af = T.alloc_buffer((4,), "float32", scope="local")
                    acc = T.alloc_buffer((RT, 8), "float32", scope="local")   # L tile, Aqk tile
                    bf = T.alloc_buffer((2,), "float32", scope="local")
                    if tx // 32 <= I * 2 + 1:   # warp wi: columns 8·wi …
                        l_aqk_tile(SM, acc, af, bf, tx, I, tx // 32, lambda i, d: SM[O_X + i * KS + d],
                                   lambda i, d: SM[O_X + (SUB + i) * KS + d], 1)

    @T.macro
    def d_inverse(SM, tx, x):
        """D_I^{-1} = (I + L_II)^{-1} of the four diagonal 16×16 blocks of L (forward
        substitution, threads NT − C …: block I = t // 16, column t % 16) → SM[O_D …], TF32."""
        if tx >= NT - C:
            for i in T.unroll(SUB):
                x[tx * EM, i] = T.Select(i == (tx - (NT - C)) % SUB, T.float32(1), T.float32(0))
            for j in T.unroll(SUB):
                for i in T.unroll(SUB):
                    if i > j:
                        x[tx * EM, i] = x[tx * EM, i] - la(SM, (tx - (NT - C)) // SUB * SUB + j, (tx - (NT - C)) // SUB * SUB + i) * x[tx * EM, j]
            for i in T.unroll(SUB):
                SM[O_D + ((tx - (NT - C)) // SUB * SUB + i) * DS + (tx - (NT - C)) % SUB] = tf32(x[tx * EM, i])

    # tmat's vn = T R: warps per n-tile of vn (1, 2 or 4 as block_v is 64, 32 or 16; tmat stops at
    # TMAT_MAX_BLOCK_V = 64, one n-tile per warp and row block)
    G4 = NW // N8 if N8 < NW else 1

    def vp_tile(tx):      # the warp's n-tile in vn = T R
        return tx // 32 if G4 == 1 else tx // 32 % N8

    def vp_owns(tx, I):   # whether the warp computes row block I of vn = T R (costs 2I + 2 k-steps)
        if G4 == 1:
            return True
        return tx // 32 // N8 == (T.min(I, NSUB - 1 - I) if G4 == 2 else I)

    def tj(tx):           # t_blocks: the column block J of warp tx // 32 < 6 ...
        return tx // 64

    def tcol(tx):         # ... and the first of its 8 columns of T
        return tx // 64 * SUB + tx // 32 % 2 * 8

    def frag_row(tx, e):  # row (in its 16-row tile) of accumulator entry e of lane tx % 32
        return tx % 32 // 4 + e // 2 * 8

    def frag_col(tx, e):  # ... and its column (in its 8-column n-tile)
        return tx % 4 * 2 + e % 2

    @T.macro
    def t_blocks(SM, Pt):
        """``tmat``, intra kernel, after D^{-1}: the blocks of T = (I + L)^{-1} by block forward
        substitution, T_JJ = D_J^{-1} and T_IJ = −D_I^{-1} Σ_{J≤K<I} L_IK T_KJ for I > J (the
        blocked inverse of a unit lower-triangular matrix), column block J = w // 2 and its
        columns 8·(w % 2) … by warp w < 6 (a column of T depends only on the same column of
        the blocks above it) → SM[O_TM + r·TS + c] = T[r][c], TF32. Each warp-synchronous step
        is its own loop over the threads (emulated, the serial run keeps the GPU's order)."""
        for tx in THR(NT):
            if tx // 32 < 6:
                for e in T.unroll(4):
                    SM[O_TM + (tj(tx) * SUB + frag_row(tx, e)) * TS + tcol(tx) + frag_col(tx, e)] = SM[O_D + (tj(tx) * SUB + frag_row(tx, e)) * DS + tx // 32 % 2 * 8 + frag_col(tx, e)]
            syncwarp()
        for I in T.unroll(NSUB):   # (row block 0 has no block left of its diagonal: tj(tx) < I fails)
            for tx in THR(NT):   # P = Σ_{J≤K<I} L_IK T_KJ → the T_IJ tile (scratch)
                af = T.alloc_buffer((4,), "float32", scope="local")
                if tx // 32 < 6 and tj(tx) < I:
                    for e in T.unroll(4):
                        Pt[tx * EM, e] = T.float32(0)
                    for ks in T.unroll(2 * NSUB - 2):
                        if ks < 2 * I and ks >= tj(tx) * 2:
                            frag_a(af, 0, lambda i, j: la(SM, j, I * SUB + i), tx % 32, ks * 8)
                            mma(Pt, tx * EM, 0, af, 0, lambda i, j: la(SM, j, I * SUB + i),
                                lambda j, n: SM[O_TM + j * TS + n], tx % 32, ks * 8, tcol(tx))
                    for e in T.unroll(4):
                        SM[O_TM + (I * SUB + frag_row(tx, e)) * TS + tcol(tx) + frag_col(tx, e)] = tf32(Pt[tx * EM, e])
                syncwarp()
            for tx in THR(NT):   # −D_I^{-1} P (registers)
                af = T.alloc_buffer((4,), "float32", scope="local")
                if tx // 32 < 6 and tj(tx) < I:
                    for e in T.unroll(4):
                        Pt[tx * EM, e] = T.float32(0)
                    for ks in T.unroll(2):
                        frag_a(af, 0, lambda i, j: SM[O_D + (I * SUB + i) * DS + j], tx % 32, ks * 8)
                        mma(Pt, tx * EM, 0, af, 0, lambda i, j: SM[O_D + (I * SUB + i) * DS + j],
                            lambda j, n: SM[O_TM + (I * SUB + j) * TS + n], tx % 32, ks * 8, tcol(tx))
                syncwarp()
            for tx in THR(NT):   # → T_IJ in P's place
                if tx // 32 < 6 and tj(tx) < I:
                    for e in T.unroll(4):
                        SM[O_TM + (I * SUB + frag_row(tx, e)) * TS + tcol(tx) + frag_col(tx, e)] = tf32(T.float32(0) - Pt[tx * EM, e])
                syncwarp()

    @T.macro
    def vn_product(SM, tx, Zt, par):
        """Phase 4 with ``tmat``: vn_I = Σ_{J<I} T_IJ R_J + D_I^{-1} R_I for every row block I
        (T_IJ[i][j] = la[16J + j][16I + i] as the intra kernel stored it, D_I^{-1} from its rows;
        R in the X region, vn → the V region): independent accumulations of 2I + 2 k-steps, the
        warp's n-tiles ``vp_tile`` of its row blocks ``vp_owns``, instead of the 8 dependent steps
        of the substitution."""
        af = T.alloc_buffer((4,), "float32", scope="local")
        for I in T.unroll(NSUB):
            if vp_owns(tx, I):
                for e in T.unroll(4):
                    Zt[tx * EM, I * 4 + e] = T.float32(0)
                for ks in T.unroll(2 * NSUB - 2):
                    if ks < 2 * I:
                        frag_a(af, 0, lambda i, j: la(SM, j, I * SUB + i, par), tx % 32, ks * 8)
                        mma(Zt, tx * EM, I * 4, af, 0, lambda i, j: la(SM, j, I * SUB + i, par),
                            lambda j, n: SM[O_X + j * RS + n], tx % 32, ks * 8, vp_tile(tx) * 8)
                for ks in T.unroll(2):
                    frag_a(af, 0, lambda i, j: SM[alt(O_D, O_D2, par) + (I * SUB + i) * DS + j], tx % 32, ks * 8)
                    mma(Zt, tx * EM, I * 4, af, 0, lambda i, j: SM[alt(O_D, O_D2, par) + (I * SUB + i) * DS + j],
                        lambda j, n: SM[O_X + (I * SUB + j) * RS + n], tx % 32, ks * 8, vp_tile(tx) * 8)
                for e in T.unroll(4):
                    SM[O_V + (I * SUB + frag_row(tx, e)) * RS + vp_tile(tx) * 8 + frag_col(tx, e)] = tf32(Zt[tx * EM, I * 4 + e])

    @T.macro
    def intra_item(SM, meta, blk, q, k, g, beta, A_log, dt_bias, cu, ka_g, qa_g, kd_g, gl_g, la_g, dinv_g, n_tok,
                   n_cu):
        """The intra kernel's work on item ``blk`` = chunk index · H + head (meta: 2 shared int32)."""
        # phase 0: which (sequence, chunk) this block is (thread 0 walks cu_seqlens)
        for tx in THR(NT):
            acc = T.alloc_buffer((1,), "int32", scope="local")   # chunks before sequence bb
            if tx == 0:
                acc[0] = 0
                meta[0] = 0
                meta[1] = 0
                for bb in range(n_cu - 1):
                    if T.Cast("int32", blk // H) >= acc[0] and T.Cast("int32", blk // H) < acc[0] + (cu[bb + 1] - cu[bb] + C - 1) // C:
                        meta[0] = cu[bb] + (T.Cast("int32", blk // H) - acc[0]) * C
                        meta[1] = cu[bb + 1]
                    acc[0] = acc[0] + (cu[bb + 1] - cu[bb] + C - 1) // C
        # phase 1: raw k, q, g, β as in the fused kernel (blocks past the last chunk copy nothing)
        if SYNC:
            T.tvm_storage_sync("shared")
        for tx in THR(NT):
            c0 = T.alloc_buffer((3,), "int32", scope="local")
            c0[0] = meta[0]
            c0[1] = meta[1]
            if c0[0] < c0[1]:
                stage_chunk(SM, tx, c0, q, k, g, beta, None, None, None, 0, blk % H, n_tok, True)
            if SYNC:
                ptx.wait(0)
        gamma_and_norms(SM, meta[0], meta[1], blk % H, A_log, dt_bias)
        phase2(SM)
        if SYNC:
            T.tvm_storage_sync("shared")
        for tx in THR(NT):
            x = T.alloc_buffer((RT, SUB), "float32", scope="local")
            d_inverse(SM, tx, x)
        if TM_I:
            Pt = T.alloc_buffer((RT, 4), "float32", scope="local")
            if SYNC:
                T.tvm_storage_sync("shared")
            t_blocks(SM, Pt)
        # out: the chunk's rows of e^Γ k, scale e^Γ q, e^{Γ_last−Γ} k (TF32, as the fused
        # kernel computes its operands), L / Aqk and D^{-1}; e^{Γ_last} as row blk // H of gl
        if SYNC:
            T.tvm_storage_sync("shared")
        for tx in THR(NT):
            for it in T.unroll(C * K // NT):
                if meta[0] + (it * NT + tx) // K < meta[1]:
                    ka_g[meta[0] + (it * NT + tx) // K, blk % H, tx % K] = tf32(kr(SM, (it * NT + tx) // K, tx % K) * ex2(gm(SM, (it * NT + tx) // K, tx % K)))
                    if P2ONE:
                        qa_g[meta[0] + (it * NT + tx) // K, blk % H, tx % K] = a_q(SM, (it * NT + tx) // K // SUB * SUB, (it * NT + tx) // K % SUB, tx % K)
                    else:
                        qa_g[meta[0] + (it * NT + tx) // K, blk % H, tx % K] = tf32(T.float32(scale) * qr(SM, (it * NT + tx) // K, tx % K) * ex2(gm(SM, (it * NT + tx) // K, tx % K)))
                    kd_g[meta[0] + (it * NT + tx) // K, blk % H, tx % K] = tf32(kr(SM, (it * NT + tx) // K, tx % K) * ex2(gm(SM, C - 1, tx % K) - gm(SM, (it * NT + tx) // K, tx % K)))
            if tx < K:
                if meta[0] < meta[1]:
                    gl_g[blk // H, blk % H, tx] = ex2(gm(SM, C - 1, tx))
            for it in T.unroll(C * C // NT):
                if meta[0] + (it * NT + tx) // C < meta[1]:
                    if TM_I:   # T_IJ (I > J) transposed in place of Lᵀ above the diagonal blocks
                        la_g[meta[0] + (it * NT + tx) // C, blk % H, tx % C] = T.Select(
                            tx % C // SUB > (it * NT + tx) // C // SUB, SM[O_TM + tx % C * TS + (it * NT + tx) // C],
                            la(SM, (it * NT + tx) // C, tx % C))
                    else:
                        la_g[meta[0] + (it * NT + tx) // C, blk % H, tx % C] = la(SM, (it * NT + tx) // C, tx % C)
            for it in T.unroll(C * SUB // NT):
                if meta[0] + (it * NT + tx) // SUB < meta[1]:
                    dinv_g[meta[0] + (it * NT + tx) // SUB, blk % H, tx % SUB] = SM[O_D + (it * NT + tx) // SUB * DS + tx % SUB]

    @T.macro
    def intra_body(q, k, g, beta, A_log, dt_bias, cu, ka_g, qa_g, kd_g, gl_g, la_g, dinv_g, n_tok, n_cu):
        """The split form's first kernel over its buffers: one block per (chunk, head)."""
        for blk in BLK(((n_tok + C - 1) // C + n_cu - 1) * H):
            SM = T.alloc_buffer((NSM,), "float32", scope=SH)
            meta = T.alloc_buffer((2,), "int32", scope=SH)   # chunk start, sequence end (0, 0: none)
            if not SYNC:   # emulated: a read of shared memory that nothing wrote gives NaN
                nan_fill(SM, NSM)
            intra_item(SM, meta, blk, q, k, g, beta, A_log, dt_bias, cu, ka_g, qa_g, kd_g, gl_g, la_g, dinv_g,
                       n_tok, n_cu)

    @T.macro
    def state_run(SM, blk, q, k, v, g, beta, A_log, dt_bias, la_g, dinv_g, gl_g, cu, slots, S, layer, o, n_tok,
                  flags):
        """The fused / state kernel's work for block ``blk`` (sequence blk // (H·NVB), head blk // NVB % H,
        columns blk % NVB); ``overlap``: waits for ``flags`` (2 + item, item = chunk index · H + head) of
        the chunks it stages."""
        Sr = T.alloc_buffer((RT, NR), "float32", scope="local")  # S rows 16·wi …, fp32
        Y = T.alloc_buffer((RT, NR), "float32", scope="local")   # (e^Γ k) S rows / Y, then o
        Z = T.alloc_buffer((RT, 4 * NTW), "float32", scope="local")  # vn tiles between warp steps
        Zt = T.alloc_buffer((RT, 4 * NSUB if TM_S else 4), "float32", scope="local")  # tmat: vn = T R
        cb = T.alloc_buffer((RT, 1), "int32", scope="local")   # split: chunks before the sequence
        bnext = T.alloc_buffer((RT, 1), "float32", scope="local")   # pipe: the next chunk's β logit
        rdy = T.alloc_buffer((RT, 1), "int32", scope="local")   # overlap: chunks known written (thread 0)
        # the state slice → registers and shared memory
        for tx in THR(NT):
            for nt in T.unroll(N8):
                for e in T.unroll(4):
                    Sr[tx * EM, nt * 4 + e] = S[layer, slots[blk // (H * NVB)], blk // NVB % H, tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8, blk % NVB * BV + nt * 8 + tx % 4 * 2 + e % 2]
                    SM[s_word(tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8, nt * 8 + tx % 4 * 2 + e % 2)] = tf32(Sr[tx * EM, nt * 4 + e])
            if WG:   # the S copy (generic-proxy stores) visible to phase 3's wgmma reads
                T.evaluate(fence_proxy_async())
            if WG or WG5:
                if tx == 0:   # the descriptors assume 1024-byte-aligned tiles (O_SS, O_QR: multiples of 1024 bytes)
                    T.evaluate(trap_if(T.Cast("int32", smem_address(T.address_of(SM[0])) % T.uint32(1024)
                                                      != T.uint32(0))))
            rdy[tx * EM, 0] = -1
            if SPL:   # the chunk index of the intra kernel's block = Σ_{b' < b} ⌈len_b' / C⌉ + c
                cb[tx * EM, 0] = 0
                for bb in range(blk // (H * NVB)):
                    cb[tx * EM, 0] = cb[tx * EM, 0] + (cu[bb + 1] - cu[bb] + C - 1) // C
        for c in range((cu[blk // (H * NVB) + 1] - cu[blk // (H * NVB)] + C - 1) // C):
            # phase 1: raw k, q, g of the chunk → shared memory (16-byte cp.async, rows
            #          past the sequence end zero-filled), β; the next chunk's rows into L2
            #          (split state kernel: its staged operands; with pipe only chunk 0's
            #          here, and chunk c + 1's into the other set of regions)
            if OVL:   # those staged here (chunk 0 and, pipe, c + 1) are written: thread 0 waits
                # where it does not know it yet (and then reads ahead which later ones are)
                for tx in THR(NT):
                    if tx == 0:
                        wait_upto(flags, rdy, tx * EM, cb[tx * EM, 0] * H + blk // NVB % H,
                                  T.min(c + 1, (cu[blk // (H * NVB) + 1] - cu[blk // (H * NVB)] + C - 1) // C - 1),
                                  (cu[blk // (H * NVB) + 1] - cu[blk // (H * NVB)] + C - 1) // C)
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                c0 = T.alloc_buffer((3,), "int32", scope="local")  # chunk start, sequence end, row
                c0[0] = cu[blk // (H * NVB)] + c * C
                c0[1] = cu[blk // (H * NVB) + 1]
                if PIPE:   # chunk 0's copies here, then chunk c + 1's into set (c + 1) % 2
                    c1 = T.alloc_buffer((3,), "int32", scope="local")
                    c1[0] = c0[0] + C
                    c1[1] = c0[1]
                    if "stage" not in ABL:
                        if c == 0:
                            stage_chunk(SM, tx, c0, q, k, g, beta, la_g, dinv_g, gl_g, chunk_index(cb, tx, c),
                                        blk // NVB % H, n_tok, True)
                    if V_EARLY and "vl" not in ABL:
                        if c == 0 and tx // 32 < 4:
                            copy_v_rows(SM, tx, c0, v, blk)
                    if "stage" not in ABL:
                        if c1[0] < c1[1]:
                            stage_next(SM, tx, c1, g, beta, la_g, dinv_g, gl_g, chunk_index(cb, tx, c + 1),
                                       blk // NVB % H, n_tok, bnext, (c + 1) % 2)
                    if SYNC:   # (always, even empty: the wait below counts this group)
                        ptx.commit()
                elif "stage" not in ABL:
                    stage_chunk(SM, tx, c0, q, k, g, beta, la_g, dinv_g, gl_g, chunk_index(cb, tx, c),
                                blk // NVB % H, n_tok, c == 0)
                # the next chunk's rows into L2 (pipe: its g and la rows are copied now, so
                # those of the chunk after it)
                if c0[0] + C + tx // 4 < c0[1]:
                    prefetch(q[c0[0] + C + tx // 4, blk // NVB % H, tx % 4 * 32])
                    prefetch(k[c0[0] + C + tx // 4, blk // NVB % H, tx % 4 * 32])
                    if not PIPE:
                        prefetch(g[c0[0] + C + tx // 4, blk // NVB % H, tx % 4 * 32])
                    if tx % 4 * 32 < BV:
                        prefetch(v[c0[0] + C + tx // 4, blk // NVB % H, blk % NVB * BV + tx % 4 * 32])
                    if stage == "state" and not PIPE and tx % 4 < 2:
                        prefetch(la_g[c0[0] + C + tx // 4, blk // NVB % H, tx % 4 * 32])
                if PIPE:
                    if c0[0] + 2 * C + tx // 4 < c0[1]:
                        prefetch(g[c0[0] + 2 * C + tx // 4, blk // NVB % H, tx % 4 * 32])
                        if tx % 4 < 2:
                            prefetch(la_g[c0[0] + 2 * C + tx // 4, blk // NVB % H, tx % 4 * 32])
                if SYNC:   # pipe: all but the group just committed, i.e. chunk c's copies (and those
                    # of early_kq at phase 4 and v_early at phase 5 of the chunk before)
                    ptx.wait(1 if PIPE else 0)
            if stage == "fused":
                if "gamma" not in ABL:
                    gamma_and_norms(SM, cu[blk // (H * NVB)] + c * C, cu[blk // (H * NVB) + 1], blk // NVB % H,
                                    A_log, dt_bias)
                if "p2" not in ABL:
                    phase2(SM)
            # phase 3: D_I^{-1} (warps 6-7: block I = t // 16, column t % 16) ‖ the rows
            #          16·wi … of (e^Γ k) S → R = β (v − ·) (warps 0-3) or of Y = scale
            #          (e^Γ q) S (warps 4-7, kept in registers)
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                c0 = T.alloc_buffer((2,), "int32", scope="local")
                af = T.alloc_buffer((AFN * 2 if WG2 else AFN,), "float32", scope="local")
                x = T.alloc_buffer((RT, SUB), "float32", scope="local")
                vl = T.alloc_buffer((RT, NR), "float32", scope="local")
                bq = T.alloc_buffer((4,), "float32", scope="local")   # ldmatrix.x4 fragments
                c0[0] = cu[blk // (H * NVB)] + c * C
                c0[1] = cu[blk // (H * NVB) + 1]
                if stage == "fused" and not WG:
                    if "dinv" not in ABL:
                        d_inverse(SM, tx, x)
                if not WG or "p3" in ABL:
                    for r in T.unroll(NR):
                        Y[tx * EM, r] = T.float32(0)
                if tx // 32 < 4:
                    if "vl" not in ABL:
                        if VASYNC:   # the warp's 16 rows of v → the vn region (R goes there)
                            copy_v_rows(SM, tx, c0, v, blk)
                        elif not V_EARLY:   # (v_early: copied during the chunk before)
                            for nt in T.unroll(N8):
                                for e in T.unroll(4):
                                    vl[tx * EM, nt * 4 + e] = ld(v, c0[0] + tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8, c0[1], n_tok, blk // NVB % H, blk % NVB * BV + nt * 8 + tx % 4 * 2 + e % 2)
                    if "p3" not in ABL:
                        if WG:
                            wg_gemm(SM, Y, af, lambda i, d: a_k(SM, tx // 32 * 16, i, d), tx % 32, O_SS, K // 8, True)
                            T.evaluate(wgmma_wait(0))
                        else:
                            gemm_s(SM, Y, tx * EM, af, bq, lambda i, d: a_k(SM, tx // 32 * 16, i, d),
                                   K // 8, N8, tx % 32)
                    if VASYNC or V_EARLY:   # R in place of the v rows (v_async: the warp's own copies,
                        # so wait, then a warp sync; v_early: waited for at the chunk's start)
                        if VASYNC:
                            if SYNC:
                                ptx.wait(0)
                            syncwarp()
                        for nt in T.unroll(N8):
                            for e in T.unroll(4):
                                SM[O_X + (tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8) * RS + nt * 8 + tx % 4 * 2 + e % 2] = SM[O_BT + tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8] * (SM[O_X + (tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8) * RS + nt * 8 + tx % 4 * 2 + e % 2] - Y[tx * EM, nt * 4 + e])
                    else:
                        for nt in T.unroll(N8):
                            for e in T.unroll(4):
                                SM[O_X + (tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8) * RS + nt * 8 + tx % 4 * 2 + e % 2] = SM[O_BT + tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8] * (vl[tx * EM, nt * 4 + e] - Y[tx * EM, nt * 4 + e])
                else:
                    if "p3" not in ABL:
                        if WG:
                            wg_gemm(SM, Y, af, lambda i, d: a_q(SM, (tx // 32 - 4) * 16, i, d), tx % 32, O_SS, K // 8, True)
                        else:
                            gemm_s(SM, Y, tx * EM, af, bq, lambda i, d: a_q(SM, (tx // 32 - 4) * 16, i, d),
                                   K // 8, N8, tx % 32)
                    if WG:   # (fused) D^{-1} on warps 6-7 while the last wgmmas run
                        if stage == "fused" and "dinv" not in ABL:
                            d_inverse(SM, tx, x)
                        T.evaluate(wgmma_wait(0))
            # phase 4: vn_I = D_I^{-1} (R_I − Σ_{J<I} L_IJ vn_J), in place of R; warp wi
            #          owns the n-tiles wi, wi + 8, … (warps past them idle); with tmat
            #          vn = T R into its own region (vn_product)
            if SYNC:
                T.tvm_storage_sync("shared")
            if EARLY:   # the next chunk's e^Γ k, scale·e^Γ q (phase 3 has read this one's)
                for tx in THR(NT):
                    cn = T.alloc_buffer((3,), "int32", scope="local")
                    cn[0] = cu[blk // (H * NVB)] + (c + 1) * C
                    cn[1] = cu[blk // (H * NVB) + 1]
                    if cn[0] < cn[1]:
                        copy_rows(SM, tx, cn, O_KR, KS, k, K, blk // NVB % H, n_tok)
                        copy_rows(SM, tx, cn, O_QR, KS, q, K, blk // NVB % H, n_tok)
                        if SYNC:
                            ptx.commit()
            if TM_S:
                for tx in THR(NT):
                    if "p4" not in ABL:
                        vn_product(SM, tx, Zt, c % 2 if PIPE else 0)
                    if PIPE:   # the next chunk's β (phase 3, its only reader, is done)
                        if tx < C and cu[blk // (H * NVB)] + (c + 1) * C < cu[blk // (H * NVB) + 1]:
                            SM[O_BT + tx] = beta_value(cu[blk // (H * NVB)] + (c + 1) * C + tx < cu[blk // (H * NVB) + 1],
                                                       bnext[tx * EM, 0])
            elif "p4" not in ABL:
                # (each L / D^{-1} fragment loaded once for the warp's NTW n-tiles, not once per n-tile)
                for I in T.unroll(NSUB):
                    for tx in THR(NT):
                        af = T.alloc_buffer((4,), "float32", scope="local")
                        for t in T.unroll(NTW):
                            if tx // 32 + t * NW < N8:
                                for e in T.unroll(4):
                                    Z[tx * EM, t * 4 + e] = rx(SM, I * SUB + tx % 32 // 4 + e // 2 * 8, (tx // 32 + t * NW) * 8 + tx % 4 * 2 + e % 2)
                        if tx // 32 < N8:
                            for ks in T.unroll(2 * NSUB - 2):
                                if ks < 2 * I:
                                    frag_a(af, 0, lambda i, j: T.float32(0) - la(SM, j, I * SUB + i), tx % 32, ks * 8)
                                    for t in T.unroll(NTW):
                                        if tx // 32 + t * NW < N8:
                                            mma(Z, tx * EM, t * 4, af, 0, lambda i, j: T.float32(0) - la(SM, j, I * SUB + i),
                                                lambda j, n: vn(SM, j, n), tx % 32, ks * 8, (tx // 32 + t * NW) * 8)
                        for t in T.unroll(NTW):
                            if tx // 32 + t * NW < N8:
                                for e in T.unroll(4):
                                    SM[O_X + (I * SUB + tx % 32 // 4 + e // 2 * 8) * RS + (tx // 32 + t * NW) * 8 + tx % 4 * 2 + e % 2] = tf32(Z[tx * EM, t * 4 + e])
                        syncwarp()
                    for tx in THR(NT):
                        af = T.alloc_buffer((4,), "float32", scope="local")
                        for t in T.unroll(NTW):
                            if tx // 32 + t * NW < N8:
                                for e in T.unroll(4):
                                    Z[tx * EM, t * 4 + e] = T.float32(0)
                        if tx // 32 < N8:
                            for ks in T.unroll(2):
                                frag_a(af, 0, lambda i, j: SM[O_D + (I * SUB + i) * DS + j], tx % 32, ks * 8)
                                for t in T.unroll(NTW):
                                    if tx // 32 + t * NW < N8:
                                        mma(Z, tx * EM, t * 4, af, 0, lambda i, j: SM[O_D + (I * SUB + i) * DS + j],
                                            lambda j, n: rx(SM, I * SUB + j, n), tx % 32, ks * 8, (tx // 32 + t * NW) * 8)
                        syncwarp()
                    for tx in THR(NT):
                        for t in T.unroll(NTW):
                            if tx // 32 + t * NW < N8:
                                for e in T.unroll(4):
                                    SM[vn_word(I * SUB + tx % 32 // 4 + e // 2 * 8, (tx // 32 + t * NW) * 8 + tx % 4 * 2 + e % 2)] = tf32(Z[tx * EM, t * 4 + e])
                        syncwarp()
                if WG5:   # vn (generic-proxy stores) visible to phase 5's wgmma reads
                    for tx in THR(NT):
                        T.evaluate(fence_proxy_async())
            # phase 5: S ← diag(e^{Γ_last}) S + (e^{Γ_last−Γ} k)ᵀ vn (every warp, rows
            #          16·wi …); o = Y + Aqk vn (warps 4-7, k-steps ≤ the diagonal)
            if SYNC:
                T.tvm_storage_sync("shared")
            for tx in THR(NT):
                c0 = T.alloc_buffer((2,), "int32", scope="local")
                af = T.alloc_buffer((AFN * 2 if WG2 else AFN,), "float32", scope="local")
                c0[0] = cu[blk // (H * NVB)] + c * C
                c0[1] = cu[blk // (H * NVB) + 1]
                if V_EARLY and "vl" not in ABL:   # the next chunk's v rows (phase 4 has read R)
                    cn = T.alloc_buffer((2,), "int32", scope="local")
                    cn[0] = c0[0] + C
                    cn[1] = c0[1]
                    if tx // 32 < 4 and cn[0] < cn[1]:
                        copy_v_rows(SM, tx, cn, v, blk)
                for nt in T.unroll(N8):
                    for e in T.unroll(4):
                        Sr[tx * EM, nt * 4 + e] = Sr[tx * EM, nt * 4 + e] * decay(SM, tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8, c % 2 if PIPE else 0)
                if "s" not in ABL:
                    if WG5:   # (wg_gemm's fence orders the decay's scaling of Sr before the wgmmas)
                        wg_gemm(SM, Sr, af, lambda i, j: a_kd(SM, tx // 32 * 16, i, j, c % 2 if PIPE else 0),
                                tx % 32, O_QR, C // 8, False)
                        T.evaluate(wgmma_wait(0))
                    else:
                        gemm(Sr, tx * EM, af,
                             lambda i, j: a_kd(SM, tx // 32 * 16, i, j, c % 2 if PIPE else 0),
                             lambda j, n: vn(SM, j, n), C // 8, N8, tx % 32, None)
                if "scopy" not in ABL:
                    for nt in T.unroll(N8):
                        for e in T.unroll(4):
                            SM[s_word(tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8, nt * 8 + tx % 4 * 2 + e % 2)] = tf32(Sr[tx * EM, nt * 4 + e])
                    if WG:
                        T.evaluate(fence_proxy_async())
                if tx // 32 >= 4:
                    if "o" not in ABL:
                        if WG5:
                            o_chain(SM, Y, af, tx, c)
                            T.evaluate(wgmma_wait(0))
                        else:
                            gemm(Y, tx * EM, af,
                                 a_aqk(SM, tx, c),
                                 lambda j, n: vn(SM, j, n), C // 8, N8, tx % 32, (tx // 32 - 4) * 2 + 1)
                    if "ost" not in ABL:
                        if O_VEC:   # entries e, e + 1 (adjacent columns, 8-byte aligned: the
                            # column is even and o's rows are V floats) as one 8-byte store;
                            # emulated: the same loop with two scalar stores
                            for hf in T.unroll(2):
                                if o_row(c0, tx, hf) < c0[1]:
                                    for nt in T.unroll(N8):
                                        if SYNC:
                                            cuda_func_call("k3_st2", T.address_of(o[o_row(c0, tx, hf), blk // NVB % H, o_col(blk, tx, nt)]),
                                                           Y[tx * EM, nt * 4 + hf * 2], Y[tx * EM, nt * 4 + hf * 2 + 1], source_code=ST2_SRC)
                                        else:
                                            for u in T.unroll(2):
                                                o[o_row(c0, tx, hf), blk // NVB % H, o_col(blk, tx, nt) + u] = Y[tx * EM, nt * 4 + hf * 2 + u]
                        else:
                            for nt in T.unroll(N8):
                                for e in T.unroll(4):
                                    if o_row(c0, tx, e // 2) < c0[1]:
                                        o[o_row(c0, tx, e // 2), blk // NVB % H, o_col(blk, tx, nt) + e % 2] = Y[tx * EM, nt * 4 + e]
        # registers → the pooled state
        for tx in THR(NT):
            for nt in T.unroll(N8):
                for e in T.unroll(4):
                    S[layer, slots[blk // (H * NVB)], blk // NVB % H, tx // 32 * 16 + tx % 32 // 4 + e // 2 * 8, blk % NVB * BV + nt * 8 + tx % 4 * 2 + e % 2] = Sr[tx * EM, nt * 4 + e]

    @T.macro
    def fused_body(q, k, v, g, beta, A_log, dt_bias, la_g, dinv_g, gl_g, cu, slots, S, layer, o, n_tok, n_cu):
        """The kernel over its buffers; ``g`` / ``beta`` are f / b and ``A_log`` / ``dt_bias``
        are read when ``PRE`` (None otherwise)."""
        for blk in BLK((n_cu - 1) * (H * NVB)):
            SM = T.alloc_buffer((NSM,), "float32", scope=SH, align=1024)   # (p3_wg / p5_wg: swizzled tiles)
            if not SYNC:   # emulated: a read of shared memory that nothing wrote gives NaN
                nan_fill(SM, NSM)
            state_run(SM, blk, q, k, v, g, beta, A_log, dt_bias, la_g, dinv_g, gl_g, cu, slots, S, layer, o, n_tok,
                      None)

    if parts:
        return ({"item": intra_item, "body": intra_body, "nsm": NSM} if stage == "intra" else
                {"run": state_run, "body": fused_body, "nsm": NSM})
    if stage == "intra" and PRE:
        @T.prim_func(private=True)
        def kda_prefill_split_intra_pre(q_h: T.handle, k_h: T.handle, f_h: T.handle, b_h: T.handle,
                                        alog_h: T.handle, dtb_h: T.handle, cu_h: T.handle,
                                        ka_h: T.handle, qa_h: T.handle, kd_h: T.handle, gl_h: T.handle,
                                        la_h: T.handle, dinv_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n_tok, n_cu, n_ch = T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (n_tok, H, K), "float32")
            k = T.match_buffer(k_h, (n_tok, H, K), "float32")
            f = T.match_buffer(f_h, (n_tok, H, K), "float32")
            b = T.match_buffer(b_h, (n_tok, H), "float32")
            A_log = T.match_buffer(alog_h, (H,), "float32")
            dt_bias = T.match_buffer(dtb_h, (H * K,), "float32")
            cu = T.match_buffer(cu_h, (n_cu,), "int32")
            ka = T.match_buffer(ka_h, (n_tok, H, K), "float32")
            qa = T.match_buffer(qa_h, (n_tok, H, K), "float32")
            kd = T.match_buffer(kd_h, (n_tok, H, K), "float32")
            gl = T.match_buffer(gl_h, (n_ch, H, K), "float32")
            la_g = T.match_buffer(la_h, (n_tok, H, C), "float32")
            dinv_g = T.match_buffer(dinv_h, (n_tok, H, SUB), "float32")
            intra_body(q, k, f, b, A_log, dt_bias, cu, ka, qa, kd, gl, la_g, dinv_g, n_tok, n_cu)
        fn = kda_prefill_split_intra_pre
    elif stage == "intra":
        @T.prim_func(private=True)
        def kda_prefill_split_intra(q_h: T.handle, k_h: T.handle, g_h: T.handle, beta_h: T.handle,
                                    cu_h: T.handle, ka_h: T.handle, qa_h: T.handle, kd_h: T.handle,
                                    gl_h: T.handle, la_h: T.handle, dinv_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n_tok, n_cu, n_ch = T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (n_tok, H, K), "float32")
            k = T.match_buffer(k_h, (n_tok, H, K), "float32")
            g = T.match_buffer(g_h, (n_tok, H, K), "float32")
            beta = T.match_buffer(beta_h, (n_tok, H), "float32")
            cu = T.match_buffer(cu_h, (n_cu,), "int32")
            ka = T.match_buffer(ka_h, (n_tok, H, K), "float32")
            qa = T.match_buffer(qa_h, (n_tok, H, K), "float32")
            kd = T.match_buffer(kd_h, (n_tok, H, K), "float32")
            gl = T.match_buffer(gl_h, (n_ch, H, K), "float32")
            la_g = T.match_buffer(la_h, (n_tok, H, C), "float32")
            dinv_g = T.match_buffer(dinv_h, (n_tok, H, SUB), "float32")
            intra_body(q, k, g, beta, None, None, cu, ka, qa, kd, gl, la_g, dinv_g, n_tok, n_cu)
        fn = kda_prefill_split_intra
    elif stage == "state":   # the body; _split_state wraps it (one or several block_v)
        return fused_body
    elif PRE:
        @T.prim_func(private=True)
        def kda_prefill_fused(q_h: T.handle, k_h: T.handle, v_h: T.handle, f_h: T.handle,
                              b_h: T.handle, alog_h: T.handle, dtb_h: T.handle, cu_h: T.handle,
                              slots_h: T.handle, state_h: T.handle, layer: T.int32, o_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n_tok, n_cu, n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (n_tok, H, K), "float32")
            k = T.match_buffer(k_h, (n_tok, H, K), "float32")
            v = T.match_buffer(v_h, (n_tok, H, V), "float32")
            f = T.match_buffer(f_h, (n_tok, H, K), "float32")
            b = T.match_buffer(b_h, (n_tok, H), "float32")
            A_log = T.match_buffer(alog_h, (H,), "float32")
            dt_bias = T.match_buffer(dtb_h, (H * K,), "float32")
            cu = T.match_buffer(cu_h, (n_cu,), "int32")
            slots = T.match_buffer(slots_h, (n_seq,), "int32")
            S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
            o = T.match_buffer(o_h, (n_tok, H, V), "float32")
            fused_body(q, k, v, f, b, A_log, dt_bias, None, None, None, cu, slots, S, layer, o, n_tok, n_cu)
        fn = kda_prefill_fused
    else:
        @T.prim_func(private=True)
        def kda_prefill_fused(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle,
                              beta_h: T.handle, cu_h: T.handle, slots_h: T.handle, state_h: T.handle,
                              layer: T.int32, o_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n_tok, n_cu, n_seq, n_layer, n_slot = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (n_tok, H, K), "float32")
            k = T.match_buffer(k_h, (n_tok, H, K), "float32")
            v = T.match_buffer(v_h, (n_tok, H, V), "float32")
            g = T.match_buffer(g_h, (n_tok, H, K), "float32")
            beta = T.match_buffer(beta_h, (n_tok, H), "float32")
            cu = T.match_buffer(cu_h, (n_cu,), "int32")
            slots = T.match_buffer(slots_h, (n_seq,), "int32")
            S = T.match_buffer(state_h, (n_layer, n_slot, H, K, V), "float32")
            o = T.match_buffer(o_h, (n_tok, H, V), "float32")
            fused_body(q, k, v, g, beta, None, None, None, None, None, cu, slots, S, layer, o, n_tok, n_cu)
        fn = kda_prefill_fused

    return fn if emulate else mark(fn)
