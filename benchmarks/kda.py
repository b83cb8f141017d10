"""KDA kernel benchmark: k3-compile's TensorIR kernels vs fla-core 0.6.0's Triton kernels.

Two steps, because the GPU machine has no TVM compiler:

1. Here (with nvcc): ``python benchmarks/kda.py build dist/kda`` compiles the kernels for
   ``cuda-sm90a`` into ``dist/kda/*.so`` (device code precompiled to a fatbin).
2. On the H200 (runtime-only TVM; carry ``.tvm-rt``, ``.whl`` and ``dist/kda``; ``source
   .tvm-rt/env.sh``, then install the fla-core wheel with ``python3 -m pip install --no-deps
   --target /tmp/fla .whl/fla_core-0.6.0-py3-none-any.whl`` and append ``$PWD`` and ``/tmp/fla``
   to ``PYTHONPATH``; fla's other dependency, einops, is on the GPU machine already):
   ``python benchmarks/kda.py run dist/kda --out $OUT`` checks every kernel against fla's
   naive reference and times it against ``fused_recurrent_kda`` (decode) in the same process,
   at K3 shapes (head_dim 128; 96 heads, and 12 heads = the tensor-parallel-8 share), with the
   same gate settings (lower bound −5; gate, L2 norms and β sigmoid inside the kernel); the
   prefill part runs when the prefill libraries are there (``build --only decode`` skips
   them: seconds instead of minutes).

Prefill only (tensor-core kernels of schedules/kda_prefill_tc.py vs fla ``chunk_kda``):
``build --only prefill dist/kda_tc`` here, ``run dist/kda_tc --only prefill [--quick] --out $OUT``
on the GPU (rows also appended to ``$OUT/kda_prefill_rows.jsonl`` as they come, so a run cut
by a time limit still returns what it measured). Fused one-kernel variants
(schedules/kda_prefill_fused.py, ``PREFILL_FUSED``) are built beside the two-kernel ones;
``build --model-tc`` keeps of the two-kernel pair only the tiling the model dispatches,
``run --checks-only`` runs every correctness check and no timing (a check fails above
``PREFILL_TOL_O`` / ``PREFILL_TOL_STATE``: the run then exits with status 1).

Decode roofline: the state bytes a step must move (read + write of B·H·K·V fp32) divided by
the measured device-to-device copy bandwidth (``torch`` copy of 2 GiB).
Results: JSON (machine, date, commit) and a PNG plot under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cuda_timing import copies_for, copy_bandwidth, git_commit, rotate, time_cuda, time_cuda_graph

HEADS = (96, 12)
DECODE_BATCHES = (1, 16, 64)
K = V = 128
LOWER_BOUND = -5.0
# (cols_per_block, k_split, vec, min_blocks) tilings of the decode kernel compiled and timed
# (vec: adjacent columns per thread, loaded and stored as one 8- or 16-byte access; min_blocks:
# blocks per SM asked of ptxas through __launch_bounds__, 0 for none); the JSON keeps every
# variant and the best one per shape. Measured and dropped: a persistent grid with the next
# item's state prefetched into a second register set (3-40% slower at every shape, 2026-11-29);
# 128 columns a block with vec 4 and 8 or 16 row splits, (32, 16, 4) and (32, 8, 2) (slower than
# (64, 4, 2) at every shape with 16 or more sequences, kda_decode_vec_h200_2026-12-02.json); the
# state's loads issued before q, k and the gate are staged (within noise at every shape,
# kda_decode_loadfirst_h200_2026-12-02.json); each row split taking every k_split-th row instead
# of a block of rows, and (128, 4, 2) (1.00-1.11x the time of (64, 4, 2) at batch >= 16,
# kda_decode_interleave_h200_2026-12-02.json).
DECODE_TILINGS = ((32, 4, 1, 0), (64, 2, 1, 0), (16, 8, 1, 0), (32, 2, 1, 0), (128, 1, 1, 0),
                  (64, 8, 4, 0), (64, 4, 2, 0), (32, 4, 2, 0),
                  (64, 4, 2, 5), (64, 4, 2, 6), (64, 8, 2, 0), (64, 8, 2, 3), (128, 8, 2, 2), (128, 8, 2, 0))


# the model's tiling also built with programmatic dependent launch (``pdl``: the state loaded
# before griddepcontrol.wait); both timed standalone and behind predecessor kernels that write
# one of the decode's inputs (the ``stream`` fields: torch.matmul and the TVM stand-ins of
# _predecessor_kernels, plain and triggering their dependents at entry),
# so that the launch gap between two kernels is in the time
DECODE_PDL_TILING = (64, 4, 2, 0)
HIDDEN = 7168
PREDECESSORS = ("b_proj", "cast", "f_b")   # the stand-ins of _predecessor_kernels


def _tiling_name(cb: int, ks: int, vec: int = 1, min_blocks: int = 0, pdl: bool = False) -> str:
    return (f"cb{cb}_ks{ks}" + (f"_v{vec}" if vec > 1 else "") + (f"_mb{min_blocks}" if min_blocks else "")
            + ("_pdl" if pdl else ""))


def _decode_variants():
    """(cols_per_block, k_split, vec, min_blocks, pdl) of every decode library built."""
    return [t + (False,) for t in DECODE_TILINGS] + [DECODE_PDL_TILING + (True,)]


def _predecessor_kernels(H: int) -> dict:
    """Stand-ins, as TVM kernels, for the kernel that the compiled model launches right before
    the KDA decode, each writing one of the decode's inputs: ``b_proj`` (k3-nano's: ``b [n, H] =
    x [n, HIDDEN] · w [H, HIDDEN]ᵀ``, fp32, a block of 256 threads per output), ``cast`` (K3's,
    where b_proj joins the sibling GEMV: f_b_proj's bf16 output cast to the fp32 ``f [n, H·K]``)
    and ``f_b`` (f_b_proj itself, ``f [n, H·K] = f_a [n, K] · w [K, H·K]``, fp32, one output a
    thread). Each plain and triggering its dependents at entry (``griddepcontrol.
    launch_dependents`` as the first statement inside the thread bindings). Returns ``{name:
    PrimFunc}``: ``b_proj``, ``b_proj_trigger``, ``cast``, ``cast_trigger``, ``f_b``,
    ``f_b_trigger``."""
    from tvm.script import tirx as T

    NT, NI = 256, HIDDEN // 256
    NB = H * K // NT     # blocks a token for the cast and f_b

    def build(trigger: bool):
        @T.prim_func(private=True)
        def b_proj(x_h: T.handle, w_h: T.handle, b_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n = T.int64()
            x = T.match_buffer(x_h, (n, HIDDEN), "float32")
            w = T.match_buffer(w_h, (H, HIDDEN), "float32")
            b = T.match_buffer(b_h, (n, H), "float32")
            for blk in T.thread_binding(n * H, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    if trigger:
                        T.ptx.griddepcontrol.launch_dependents()
                    part = T.alloc_buffer((NT // 32,), "float32", scope="shared")
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    acc[0] = T.float32(0)
                    for i in range(NI):
                        acc[0] = acc[0] + x[blk // H, i * NT + tx] * w[blk % H, i * NT + tx]
                    for o in T.unroll(5):
                        acc[0] = acc[0] + T.call_extern("float32", "__shfl_xor_sync", T.uint32(0xFFFFFFFF),
                                                        acc[0], 16 >> o, 32)
                    if tx % 32 == 0:
                        part[tx // 32] = acc[0]
                    T.tvm_storage_sync("shared")
                    if tx == 0:
                        for j in range(1, NT // 32):
                            acc[0] = acc[0] + part[j]
                        b[blk // H, blk % H] = acc[0]

        @T.prim_func(private=True)
        def cast(src_h: T.handle, dst_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n = T.int64()
            src = T.match_buffer(src_h, (n, H * K), "bfloat16")
            dst = T.match_buffer(dst_h, (n, H * K), "float32")
            for blk in T.thread_binding(n * NB, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    if trigger:
                        T.ptx.griddepcontrol.launch_dependents()
                    dst[blk // NB, blk % NB * NT + tx] = T.Cast("float32", src[blk // NB, blk % NB * NT + tx])

        @T.prim_func(private=True)
        def f_b(fa_h: T.handle, w_h: T.handle, dst_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            n = T.int64()
            fa = T.match_buffer(fa_h, (n, K), "float32")
            w = T.match_buffer(w_h, (K, H * K), "float32")
            dst = T.match_buffer(dst_h, (n, H * K), "float32")
            for blk in T.thread_binding(n * NB, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    if trigger:
                        T.ptx.griddepcontrol.launch_dependents()
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    acc[0] = T.float32(0)
                    for r in range(K):
                        acc[0] = acc[0] + fa[blk // NB, r] * w[r, blk % NB * NT + tx]
                    dst[blk // NB, blk % NB * NT + tx] = acc[0]

        return dict(zip(PREDECESSORS, (b_proj, cast, f_b)))

    out = {}
    for trigger in (False, True):
        for name, f in build(trigger).items():
            out[name + ("_trigger" if trigger else "")] = f
    return out


def build(out_dir: Path, prefill: bool = True) -> None:
    """Compile the decode kernel for each head count into ``out_dir`` (run where nvcc is), and
    the prefill kernels unless ``prefill`` is false."""
    import tvm

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from k3_compile.device_code import precompiled_cuda
    from schedules.kda_decode_cuda import kda_decode_fused_kernel
    from targets import get_target

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = get_target("cuda-sm90a")
    for h in HEADS:
        for cb, ks, vec, mb, pdl in _decode_variants():
            f = kda_decode_fused_kernel(h, K, V, LOWER_BOUND, cols_per_block=cb, k_split=ks, vec=vec,
                                        min_blocks=mb, pdl=pdl)
            f = f.with_attr("global_symbol", "kda_decode_fused")
            with precompiled_cuda(spec.nvcc_arch):
                lib = tvm.compile(tvm.IRModule({"kda_decode_fused": f}), target=spec.tvm_target())
            path = out_dir / f"kda_decode_h{h}_{_tiling_name(cb, ks, vec, mb, pdl)}.so"
            lib.export_library(str(path))
            print(f"built {path}")
        for name, f in _predecessor_kernels(h).items():
            with precompiled_cuda(spec.nvcc_arch):
                lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}),
                                  target=spec.tvm_target())
            path = out_dir / f"pred_{name}_h{h}.so"
            lib.export_library(str(path))
            print(f"built {path}")
    if prefill:
        build_prefill(out_dir)


PREFILL_BV = (32,)             # CUDA-core kernels (schedules/kda_prefill_cuda.py), baseline
# tensor-core state pass (schedules/kda_prefill_tc.py): (block_v, a_batch) variants
PREFILL_TC = ((8, 8), (8, 16), (16, 4), (16, 8), (16, 16), (32, 4), (32, 8), (64, 4))
PREFILL_SHAPES = ((8192,), (2048, 2048, 2048, 2048))
# a check passes at these max |ours − naive| (TF32 products; fla chunk_kda measures 1.5e-4 /
# 1.5e-3 on the same checks, kda_prefill_fused_v1_h200_2026-11-30.json); NaN fails
PREFILL_TOL_O, PREFILL_TOL_STATE = 2e-4, 3e-3
# fused one-kernel prefill (schedules/kda_prefill_fused.py): (name, block_v, a_batch, options)
# — plain; with phase 2 in two paired rounds and ldmatrix B loads in phase 3 (p2l, the model's
# dispatch of 2026-11-30); the same with its own L2 norms, gate and β (fusedpre_*: raw inputs,
# compared with fla's gated call). p2_pairs and ldsm alone: kda_prefill_p2_ldsm_h200_2026-11-30.json
PREFILL_FUSED = ([("fused", bv, ab, {}) for bv, ab in ((128, 4), (64, 8), (32, 8), (16, 8))]
                 + [("fused_p2l", bv, ab, {"p2_pairs": True, "ldsm": True}) for bv, ab in ((128, 4), (64, 8))]
                 + [("fusedpre_p2l", bv, ab, {"lower_bound": LOWER_BOUND, "p2_pairs": True, "ldsm": True})
                    for bv, ab in ((128, 4), (64, 8))]
                 # phase 2's rounds as pairs of n-tiles per warp (``p2_wide``)
                 + [("fused_p2w", 128, 4, {"p2_pairs": True, "ldsm": True, "p2_wide": True}),
                    ("fusedpre_p2w", 128, 4, {"lower_bound": LOWER_BOUND, "p2_pairs": True, "ldsm": True,
                                              "p2_wide": True})]
                 # ... with v copied by cp.async into the vn region and the gate's σ by rcp.approx
                 # (``v_async``, ``fast_gate``): as the model dispatched it until 2026-12-01
                 + [("fused_p2wv", 128, 4, {"p2_pairs": True, "ldsm": True, "p2_wide": True, "v_async": True}),
                    ("fusedpre_p2wvf", 128, 4, {"lower_bound": LOWER_BOUND, "p2_pairs": True, "ldsm": True,
                                                "p2_wide": True, "v_async": True, "fast_gate": True})]
                 # ... with phase 2 in one round instead of the pairs' two (``p2_one``)
                 + [("fused_p2ov", 128, 4, {"p2_one": True, "ldsm": True, "v_async": True}),
                    ("fusedpre_p2ovf", 128, 4, {"lower_bound": LOWER_BOUND, "p2_one": True, "ldsm": True,
                                                "v_async": True, "fast_gate": True}),
                    # ... and o stored as 8-byte column pairs (``o_vec``): as the model dispatches it
                    # since 2026-12-01; with the next chunk's q rows copied at phase 4 (early_q, not
                    # kept) in kda_prefill_ovec_h200_2026-12-01.json
                    ("fusedpre_p2ovfv", 128, 4, {"lower_bound": LOWER_BOUND, "p2_one": True, "ldsm": True,
                                                 "v_async": True, "fast_gate": True, "o_vec": True}),
                    # ... with phase 3's products on wgmma (``p3_wg``; a_batch 4 and 8: the k-steps
                    # per group of wgmmas)
                    ("fusedpre_p2ovfvw", 128, 4, {"lower_bound": LOWER_BOUND, "p2_one": True, "v_async": True,
                                                  "fast_gate": True, "o_vec": True, "p3_wg": True}),
                    ("fusedpre_p2ovfvw8", 128, 8, {"lower_bound": LOWER_BOUND, "p2_one": True, "v_async": True,
                                                   "fast_gate": True, "o_vec": True, "p3_wg": True}),
                    # ... with two sets of A fragments (p3_wg=2)
                    ("fusedpre_p2ovfvw2", 128, 4, {"lower_bound": LOWER_BOUND, "p2_one": True, "v_async": True,
                                                   "fast_gate": True, "o_vec": True, "p3_wg": 2}),
                    # ... and phase 5's products on wgmma too (``p5_wg``: vn in the q region)
                    ("fusedpre_p2ovfvw5", 128, 4, {"lower_bound": LOWER_BOUND, "p2_one": True, "v_async": True,
                                                   "fast_gate": True, "o_vec": True, "p3_wg": True, "p5_wg": True}),
                    ("fusedpre_p2ovfvw25", 128, 4, {"lower_bound": LOWER_BOUND, "p2_one": True, "v_async": True,
                                                    "fast_gate": True, "o_vec": True, "p3_wg": 2, "p5_wg": True})])
                 # (o's wgmmas issued before warpgroup 1's S copy stores, with groups of 4 or 8 k-steps:
                 # 4% slower, fusedpre_p2ovfvw252 / _w852 in kda_prefill_wgmma_c_h200_2026-12-01.json,
                 # removed after commit 9333988)
# the split form (schedules/kda_prefill_fused.py: kda_prefill_split_intra_kernel for every
# chunk in parallel, then the fused kernel's phases 3-5 with ``split``): (name, block_v,
# a_batch, options); splitpre_*: L2 norms, gate and β in the intra kernel (raw inputs)
# splitauto*: block_v by the number of sequences at run time (kda_prefill_split_state_kernel, as
# the model dispatches it; block_v None)
PREFILL_SPLIT = ([("split", bv, ab, {}) for bv, ab in ((16, 8), (32, 8), (64, 8), (128, 4))]
                 + [("splitpre", bv, 8, {"lower_bound": LOWER_BOUND}) for bv in (16, 32, 64)]
                 + [("splitauto", None, None, {}), ("splitautopre", None, None, {"lower_bound": LOWER_BOUND}),
                    # ... without early_kq (the next chunk's e^Γ k, e^Γ q copied in its phase 1)
                    ("splitautolate", None, None, {"early_kq": False}),
                    ("splitautoprelate", None, None, {"lower_bound": LOWER_BOUND, "early_kq": False}),
                    # ... with the intra kernel's phase 2 by pairs of n-tiles (p2_wide)
                    ("splitauto_w", None, None, {"p2_wide": True}),
                    ("splitautopre_w", None, None, {"lower_bound": LOWER_BOUND, "p2_wide": True}),
                    # ... and its gate's σ by rcp.approx (fast_gate)
                    ("splitautopre_wf", None, None, {"lower_bound": LOWER_BOUND, "p2_wide": True, "fast_gate": True}),
                    # ... with the intra kernel's phase 2 in one round (p2_one; splitautopre_of as the
                    # model dispatches it)
                    ("splitauto_o", None, None, {"p2_one": True}),
                    ("splitautopre_of", None, None, {"lower_bound": LOWER_BOUND, "p2_one": True, "fast_gate": True}),
                    # ... and the state kernel's o as 8-byte column pairs (o_vec)
                    ("splitautopre_ofv", None, None, {"lower_bound": LOWER_BOUND, "p2_one": True, "fast_gate": True,
                                                      "o_vec": True}),
                    # ... and phase 4 as the one product vn = T R, T = (I + L)^{-1} formed by the
                    # intra kernel (tmat)
                    ("splitauto_ot", None, None, {"p2_one": True, "o_vec": True, "tmat": True}),
                    ("splitautopre_ofvt", None, None, {"lower_bound": LOWER_BOUND, "p2_one": True, "fast_gate": True,
                                                       "o_vec": True, "tmat": True}),
                    # ... and the next chunk's staged operands copied during this one (pipe, block_v ≤ 32)
                    ("splitautopre_ofvtp", None, None, {"lower_bound": LOWER_BOUND, "p2_one": True, "fast_gate": True,
                                                        "o_vec": True, "tmat": True, "pipe": True}),
                    # (wu: W = T β e^Γ k, U = T β v by the intra kernel, measured as splitautopre_ofvw /
                    # _ofvwp in kda_prefill_wu_h200_2026-12-01.json, removed after commit b1c4675)
                    # ... and the next chunk's v rows copied at phase 5 (v_early)
                    ("splitautopre_ofvtpv", None, None, {"lower_bound": LOWER_BOUND, "p2_one": True, "fast_gate": True,
                                                         "o_vec": True, "tmat": True, "pipe": True, "v_early": True}),
                    # (the intra kernel prefetching into L2 the rows of the chunk 11 ahead, its block
                    # one wave later: 0.5% in kda_prefill_l2ahead_nofla_h200_2026-12-01.json, not kept)
                    ]
                 # with tmat and pipe at a fixed block_v of 16 / 32 (one kernel each; 32 is 18% slower at
                 # one sequence of 8192 tokens and 12 heads, kda_prefill_l2ahead_nofla_h200_2026-12-01.json)
                 + [("splitpre_ofvtp", bv, 8, {"lower_bound": LOWER_BOUND, "p2_one": True, "fast_gate": True,
                                               "o_vec": True, "tmat": True, "pipe": True}) for bv in (16, 32)]
                 # the model's split form in one PrimFunc (kda_prefill_split_kernel; the options of
                 # splitautopre_ofvtpv): for one sequence the intra items and the state chunk loop in
                 # one kernel of 132 blocks (``combined``: the state blocks start once ``lead`` % of
                 # the items are claimed; overlap False: the two kernels one after the other)
                 # (leads 10-60 at 16 columns: kda_prefill_overlap_h200_2026-12-01.json, _lead_h200_2026-12-01.json)
                 + [("splitcombpre", None, None, {"lower_bound": LOWER_BOUND, "combined": True})]
                 + [("splitcombpre_seq", None, None, {"lower_bound": LOWER_BOUND, "combined": True, "overlap": False})]
                 # ... with the state kernels' phase 3 on wgmma (p3_wg; 2: two sets of A fragments)
                 + [("splitcombpre_w", None, None, {"lower_bound": LOWER_BOUND, "combined": True, "p3_wg": True}),
                    ("splitcombpre_w2", None, None, {"lower_bound": LOWER_BOUND, "combined": True, "p3_wg": 2})])


# the decode step with the short convolutions inside (kda_decode_conv_fused_kernel, one block a
# head): (k_split, vec); timed against the generic GPU convolution (two kernels a projection)
# followed by the decode kernel at the model's tiling
CONV_W = 4
# (k_split, vec, min_blocks)
CONV_FUSED = ((4, 2, 0), (8, 4, 0), (8, 2, 0), (8, 2, 2), (4, 1, 0))
# ... with step 6's head norm and gate inside (out_norm_eps)
CONV_FUSED_NORM = ((8, 2, 0), (8, 2, 2), (4, 1, 2), (4, 2, 0))


def _conv_name(ks: int, vec: int, mb: int) -> str:
    return f"ks{ks}_v{vec}" + (f"_mb{mb}" if mb else "")


NORM_EPS = 1e-5   # K3's rms_norm_eps


def _output_step_kernel(H: int):
    """The kernel the GPU pipeline (k3_compile.build.gpu_relax_pipeline) makes of step 6's head
    norm and gate as the model writes them (o [n, H, K] f32, o_norm.weight [K], g_proj(x) [n,
    H·K] bf16 → bf16 [n, H·K] for o_proj): ``{"out_norm": the fused rms_norm … sigmoid multiply
    PrimFunc (o, weight, g viewed [n, H, K], out f32), "out_cast": the cast to bf16 after it
    (out viewed [n, H·K], bf16 [n, H·K])}`` — the two kernels the model's decode runs there."""
    import tvm
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op

    from k3_compile.build import gpu_relax_pipeline
    from targets import get_target

    class OutputStep(nn.Module):
        def __init__(self):
            self.w = nn.Parameter((K,), "float32")

        def forward(self, o, g):
            n = o.shape[0]
            o = op.rms_norm(o, self.w, axes=-1, epsilon=NORM_EPS)
            gate = op.sigmoid(op.astype(op.reshape(g, (n, H, K)), "float32"))
            return op.astype(op.reshape(o * gate, (n, H * K)), "bfloat16")

    mod, _ = OutputStep().export_tvm(spec={"forward": {"o": nn.spec.Tensor(("n", H, K), "float32"),
                                                       "g": nn.spec.Tensor(("n", H * K), "bfloat16")}})
    out = gpu_relax_pipeline(get_target("cuda-sm90a").tvm_target(), wgmma=True)(mod)
    funcs = {gv.name_hint: f for gv, f in out.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    (norm,) = [f for n, f in funcs.items() if n.startswith("fused_rms_norm")]
    (cast,) = [f for n, f in funcs.items() if n.startswith("cast")]
    return {"out_norm": norm, "out_cast": cast}


def build_conv(out_dir: Path) -> None:
    """Compile, per head count, the conv-fused decode kernel for each ``CONV_FUSED`` entry
    (``conv_fused_h{H}_ks{ks}_v{vec}.so``) and the unfused chain it replaces
    (``conv_split_h{H}.so``: ``short_conv`` — the generic GPU short convolution, bf16 inputs —
    and ``decode``, the model's decode kernel)."""
    import tvm

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from k3_compile.device_code import precompiled_cuda
    from schedules.kda_decode_cuda import (decode_conv_tiling, decode_tiling, kda_decode_conv_fused_kernel,
                                           kda_decode_fused_kernel)
    from schedules.kda_generic import short_conv_kernel
    from targets import get_target

    spec = get_target("cuda-sm90a")
    out_dir.mkdir(parents=True, exist_ok=True)

    def export(funcs: dict, name: str) -> None:
        mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()})
        with precompiled_cuda(spec.nvcc_arch):
            lib = tvm.compile(mod, target=spec.tvm_target())
        lib.export_library(str(out_dir / name))
        print(f"built {out_dir / name}")

    cb, ks, vec = decode_tiling(K)
    # the model's tiling without the norm inside (run_conv times the separate norm after it;
    # the GPU machine's runtime-only TVM cannot import schedules/ to ask)
    (out_dir / "conv_model_tiling.json").write_text(json.dumps(_conv_name(*decode_conv_tiling(K), 0)))
    for h in HEADS:
        export({"short_conv": short_conv_kernel(h * K, CONV_W, "bfloat16", gpu=True),
                "decode": kda_decode_fused_kernel(h, K, V, LOWER_BOUND, cols_per_block=cb, k_split=ks, vec=vec)},
               f"conv_split_h{h}.so")
        # step 6's head norm and gate: inside the kernel, and as the separate kernel the GPU
        # pipeline makes of the model's ops (KimiDeltaAttention._output up to o_proj)
        for t in CONV_FUSED_NORM:
            export({"decode_conv_norm": kda_decode_conv_fused_kernel(h, K, CONV_W, LOWER_BOUND, "bfloat16",
                                                                     k_split=t[0], vec=t[1], min_blocks=t[2],
                                                                     out_norm_eps=NORM_EPS)},
                   f"conv_fusednorm_h{h}_{_conv_name(*t)}.so")
        export(_output_step_kernel(h), f"conv_outnorm_h{h}.so")
        for t in CONV_FUSED:
            export({"decode_conv": kda_decode_conv_fused_kernel(h, K, CONV_W, LOWER_BOUND, "bfloat16",
                                                                k_split=t[0], vec=t[1], min_blocks=t[2])},
                   f"conv_fused_h{h}_{_conv_name(*t)}.so")


def run_conv(lib_dir: Path) -> list:
    """The decode step from the projections' outputs to o, at K3's shapes (bf16 q/k/v
    projections, W = 4): the conv-fused kernel against the generic short convolution of q, k
    and v (two kernels each) plus the model's decode kernel, both on the same inputs, pools
    and slots; CUDA-graph GPU time, every call on its own copy of the KDA and conv pools
    (``state_copies_rotated``); also the decode kernel alone (``decode_only``, on the
    convolutions' outputs) and the fused step's HBM roofline (state and conv windows read and
    written, the projections read). Checks: o, the KDA state and the conv windows of each
    fused variant against the unfused chain (``max_abs_diff``). Returns one row per (heads,
    batch)."""
    import torch
    import tvm

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from k3_compile.device_code import load_cuda_runtime

    load_cuda_runtime()
    model_name = json.loads((lib_dir / "conv_model_tiling.json").read_text())
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    for H in HEADS:
        split = tvm.runtime.load_module(str(lib_dir / f"conv_split_h{H}.so"))
        conv_fn, dec_fn = split["short_conv"], split["decode"]
        fused = {_conv_name(*t): tvm.runtime.load_module(str(lib_dir / f"conv_fused_h{H}_{_conv_name(*t)}.so"))["decode_conv"]
                 for t in CONV_FUSED}
        normed = {_conv_name(*t): tvm.runtime.load_module(
            str(lib_dir / f"conv_fusednorm_h{H}_{_conv_name(*t)}.so"))["decode_conv_norm"] for t in CONV_FUSED_NORM}
        out_lib = tvm.runtime.load_module(str(lib_dir / f"conv_outnorm_h{H}.so"))
        out_norm, out_cast = out_lib["out_norm"], out_lib["out_cast"]
        D = H * K
        A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
        dt_bias = torch.randn(D, device=dev) * 0.5
        ws = [torch.randn(D, 1, CONV_W, device=dev) * 0.5 for _ in range(3)]
        for B in DECODE_BATCHES:
            xs = [torch.randn(B, D, device=dev).bfloat16() for _ in range(3)]
            f = torch.randn(B, H, K, device=dev)
            b = torch.randn(B, H, device=dev)
            slots = torch.randperm(B, device=dev, dtype=torch.int32)
            cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
            tseq = torch.arange(B, device=dev, dtype=torch.int32)
            pool0 = torch.randn(1, B, H, K, V, device=dev) * 0.1
            conv0 = torch.randn(1, B, 3, CONV_W - 1, D, device=dev)
            ys = [torch.empty(B, D, device=dev) for _ in range(3)]
            o = torch.empty(B, H, V, device=dev)
            nrot = copies_for((pool0.numel() + conv0.numel()) * 4)
            pools = [(pool0.clone(), conv0.clone()) for _ in range(nrot)]
            t = tvm.runtime.from_dlpack
            fixed = [t(x) for x in (f, b, A_log, dt_bias, slots)]
            xs_t, ws_t, ys_t = [t(x) for x in xs], [t(w) for w in ws], [t(y) for y in ys]
            qkv = [t(y.view(B, H, K)) for y in ys]
            o_t, cu_t, tseq_t = t(o), t(cu), t(tseq)

            def unfused(pool, conv):
                for p in range(3):
                    conv_fn(xs_t[p], ws_t[p], cu_t, tseq_t, fixed[4], conv, 0, p, ys_t[p])
                dec_fn(*qkv, *fixed, pool, 0, o_t)

            def fused_call(fn, pool, conv, *tail):
                # tail: the output o (default) or, with the head norm inside, g, o_norm.weight, o
                fn(*xs_t, *ws_t, *fixed, pool, conv, 0, *(tail or (o_t,)))

            pools_t = [(t(p), t(c)) for p, c in pools]
            # HBM roofline of the fused step: the KDA state and the conv windows read and written,
            # q/k/v projection outputs (bf16) read, at the 2 GiB copy's bandwidth
            nbytes = 2 * (pool0.numel() + conv0.numel()) * 4 + 3 * B * D * 2
            row = {"heads": H, "batch": B, "state_copies_rotated": nrot, "launches_unfused": 7,
                   "launches_fused": 1, "copy_bandwidth_GBps": bw / 1e9, "bytes_fused": nbytes,
                   "roofline_fused_ms": nbytes / bw * 1e3}
            row["unfused_graph_ms"] = time_cuda_graph(rotate([lambda pc=pc: unfused(*pc) for pc in pools_t]))
            row["decode_only_graph_ms"] = time_cuda_graph(
                rotate([lambda pc=pc: dec_fn(*qkv, *fixed, pc[0], 0, o_t) for pc in pools_t]))
            for name, fn in fused.items():
                row[f"fused_{name}_graph_ms"] = time_cuda_graph(
                    rotate([lambda pc=pc, fn=fn: fused_call(fn, *pc) for pc in pools_t]))
            # checks: one step from the same pools, fused vs unfused
            ref_pool, ref_conv = pool0.clone(), conv0.clone()
            unfused(t(ref_pool), t(ref_conv))
            torch.cuda.synchronize()
            o_ref = o.clone()
            diffs = {}
            for name, fn in fused.items():
                p_, c_ = pool0.clone(), conv0.clone()
                fused_call(fn, t(p_), t(c_))
                torch.cuda.synchronize()
                diffs[name] = {"o": (o - o_ref).abs().max().item(), "kda_state": (p_ - ref_pool).abs().max().item(),
                               "conv_state": (c_ - ref_conv).abs().max().item()}
            row["max_abs_diff_vs_unfused"] = diffs
            # step 6's head norm and gate inside the kernel, against the model's tiling followed
            # by the two kernels it replaces (the norm's, f32, then the cast to bf16)
            g = torch.randn(B, D, device=dev).bfloat16()
            onw = torch.rand(K, device=dev) + 0.5
            o16, o32 = torch.empty(B, H, V, device=dev, dtype=torch.bfloat16), torch.empty(B, H, V, device=dev)
            o16c = torch.empty(B, D, device=dev, dtype=torch.bfloat16)
            g_t, g3_t, onw_t, o16_t, o32_t = t(g), t(g.view(B, H, K)), t(onw), t(o16), t(o32)
            o32f_t, o16c_t = t(o32.view(B, D)), t(o16c)
            model = fused[model_name]

            def fused_then_out(pool, conv):
                fused_call(model, pool, conv)
                out_norm(o_t, onw_t, g3_t, o32_t)
                out_cast(o32f_t, o16c_t)

            row["fused_then_output_kernel_graph_ms"] = time_cuda_graph(
                rotate([lambda pc=pc: fused_then_out(*pc) for pc in pools_t]))
            p_, c_ = pool0.clone(), conv0.clone()
            fused_then_out(t(p_), t(c_))
            torch.cuda.synchronize()
            row["fused_norm_checks"] = {
                "pipeline_bf16_vs_f32_max_abs_diff": (o16c.float().view(B, H, K) - o32).abs().max().item()}
            for name, fn in normed.items():
                row[f"fused_norm_{name}_graph_ms"] = time_cuda_graph(
                    rotate([lambda pc=pc, fn=fn: fused_call(fn, *pc, g_t, onw_t, o16_t) for pc in pools_t]))
                p2, c2 = pool0.clone(), conv0.clone()
                fused_call(fn, t(p2), t(c2), g_t, onw_t, o16_t)
                torch.cuda.synchronize()
                # bf16 rounding of o: at most 2^-8 of |o| (round to nearest), plus fp32 noise
                excess = ((o16.float() - o32).abs() - o32.abs() * 2 ** -8).max().item()
                row["fused_norm_checks"][name] = {"o_max_abs_diff": (o16.float() - o32).abs().max().item(),
                                                  "o_max_excess_over_bf16_rounding": excess,
                                                  "kda_state": (p2 - p_).abs().max().item(),
                                                  "conv_state": (c2 - c_).abs().max().item()}
            best = min(fused, key=lambda n: row[f"fused_{n}_graph_ms"])
            row["best_fused"] = best
            row["fused_pct_roofline"] = {n: 100 * row["roofline_fused_ms"] / row[f"fused_{n}_graph_ms"] for n in fused}
            row["speedup_fused_vs_unfused"] = row["unfused_graph_ms"] / row[f"fused_{best}_graph_ms"]
            print(json.dumps(row))
            rows.append(row)
            del pools, pools_t
    return rows


def _split_name(name: str, bv: int | None, ab: int | None) -> str:
    """A split variant's name: ``split_bv16_ab8``, or ``splitauto`` (block_v at run time)."""
    return name if bv is None else f"{name}_bv{bv}_ab{ab}"


# the two-kernel pair as the model dispatches it (relax_modules/kda.py): block_v per head count
PREFILL_TC_MODEL = {96: ((32, 8),), 12: ((16, 8),)}
# TVM 0.27 passes ptxas --register-usage-level=10; level 5 as for the MoE kernels
PREFILL_NVCC_OPTIONS = ("--ptxas-options=--register-usage-level=5",)


def build_prefill(out_dir: Path, baseline: bool = True, all_tc: bool = True, only: str | None = None) -> None:
    """Compile the prefill kernels per head count: the CUDA-core pair per block_v
    (``kda_prefill_h{H}_bv{BV}.so``, unless ``baseline`` is false), the tensor-core pair per
    (block_v, a_batch) (``kda_prefill_tc_h{H}_bv{BV}_ab{AB}.so``: ``kda_prefill_intra_tc``, the
    same with ``hoist_loads`` ``kda_prefill_intra_tc_hoist``, ``kda_prefill_state_tc``; every
    variant of ``PREFILL_TC``, or only the model's with ``all_tc`` false), the fused kernel
    per entry of ``PREFILL_FUSED`` (``kda_prefill_{name}_h{H}_bv{BV}_ab{AB}.so``) and the split
    form's pair per entry of ``PREFILL_SPLIT`` (``kda_prefill_split_intra``,
    ``kda_prefill_split_state``). ``only`` (a regular expression): of the fused and split
    libraries only those whose file name it finds, and no two-kernel pair."""
    import re

    import tvm

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from k3_compile.device_code import precompiled_cuda
    from schedules.barriers import respect_manual_barriers
    from schedules.kda_prefill_cuda import kda_prefill_intra_kernel, kda_prefill_state_kernel
    from schedules.kda_prefill_fused import (
        kda_prefill_fused_kernel,
        kda_prefill_split_intra_kernel,
        kda_prefill_split_kernel,
        kda_prefill_split_state_kernel,
    )
    from schedules.kda_prefill_tc import kda_prefill_intra_tc_kernel, kda_prefill_state_tc_kernel
    from targets import get_target

    spec = get_target("cuda-sm90a")
    out_dir.mkdir(parents=True, exist_ok=True)

    def export(funcs: dict, name: str, options=PREFILL_NVCC_OPTIONS) -> None:
        """One library ``out_dir / name`` of ``funcs`` (symbol → PrimFunc), device code by nvcc."""
        if only is not None and not re.search(only, name):
            return
        mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()})
        with precompiled_cuda(spec.nvcc_arch, options=options), respect_manual_barriers():
            lib = tvm.compile(mod, target=spec.tvm_target())
        lib.export_library(str(out_dir / name))
        print(f"built {out_dir / name}")

    for h in HEADS:
        for bv in PREFILL_BV if baseline else ():
            export({"kda_prefill_intra": kda_prefill_intra_kernel(h, K, V, K ** -0.5),
                    "kda_prefill_state": kda_prefill_state_kernel(h, K, V, bv)},
                   f"kda_prefill_h{h}_bv{bv}.so", options=())
        for name, bv, ab, opts in PREFILL_FUSED:
            export({"kda_prefill_fused": kda_prefill_fused_kernel(h, K, V, K ** -0.5, block_v=bv, a_batch=ab, **opts)},
                   f"kda_prefill_{name}_h{h}_bv{bv}_ab{ab}.so")
        for name, bv, ab, opts in PREFILL_SPLIT:
            if opts.get("combined"):
                export({"kda_prefill_split": kda_prefill_split_kernel(
                    h, K, V, K ** -0.5, lower_bound=opts.get("lower_bound"), overlap=opts.get("overlap", True),
                    **{k: opts[k] for k in ("lead", "overlap_block_v", "p3_wg") if k in opts})},
                    f"kda_prefill_{name}_h{h}.so")
                continue
            intra_opts = ("p2_wide", "fast_gate", "p2_one", "tmat")   # the intra kernel's options
            state_opts = ("lower_bound", "early_kq", "o_vec", "tmat", "pipe", "v_early")   # the state kernel's
            st = {k: v for k, v in opts.items() if k in state_opts}
            export({"kda_prefill_split_intra": kda_prefill_split_intra_kernel(
                        h, K, K ** -0.5, lower_bound=opts.get("lower_bound"),
                        **{k: v for k, v in opts.items() if k in intra_opts}),
                    "kda_prefill_split_state": (
                        kda_prefill_split_state_kernel(h, K, V, K ** -0.5, **st) if bv is None else
                        kda_prefill_fused_kernel(h, K, V, K ** -0.5, block_v=bv, a_batch=ab, split=True, **st))},
                   f"kda_prefill_{_split_name(name, bv, ab)}_h{h}.so")
        for bv, ab in (PREFILL_TC if all_tc else PREFILL_TC_MODEL[h]) if only is None else ():
            export({"kda_prefill_intra_tc": kda_prefill_intra_tc_kernel(h, K, V, K ** -0.5),
                    "kda_prefill_intra_tc_hoist": kda_prefill_intra_tc_kernel(h, K, V, K ** -0.5, hoist_loads=True),
                    "kda_prefill_state_tc": kda_prefill_state_tc_kernel(h, K, V, bv, ab)},
                   f"kda_prefill_tc_h{h}_bv{bv}_ab{ab}.so")

def run(lib_dir: Path) -> dict:
    """Decode: every tiling of the fused kernel checked against fla's naive recurrence and
    timed against ``fused_recurrent_kda`` (same inputs, same gate settings), two ways: CUDA
    events over back-to-back calls from Python (``*_ms``: includes the host's launch cost,
    about 7 µs a call, which dominates at small shapes) and replays of a CUDA graph of 10
    calls (``*_graph_ms``: GPU time, as a serving loop that captures decode in a graph sees
    it); the roofline percentages use the graph times. Each timed call updates its own copy
    of the state (``state_copies_rotated``), so the state is read from HBM as in a model step
    and not from L2."""
    import numpy as np
    import torch
    import tvm

    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from fla.ops.kda.naive import naive_recurrent_kda

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from k3_compile.device_code import load_cuda_runtime

    load_cuda_runtime()
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    results = {"copy_bandwidth_GBps": bw / 1e9, "decode": []}
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s")
    torch.manual_seed(0)
    for H in HEADS:
        variants = {_tiling_name(*t): tvm.runtime.load_module(
            str(lib_dir / f"kda_decode_h{H}_{_tiling_name(*t)}.so"))["kda_decode_fused"]
            for t in _decode_variants() if (lib_dir / f"kda_decode_h{H}_{_tiling_name(*t)}.so").exists()}
        tvm_preds = {name: tvm.runtime.load_module(str(lib_dir / f"pred_{name}_h{H}.so"))["main"]
                     for kind in PREDECESSORS for name in (kind, f"{kind}_trigger")
                     if (lib_dir / f"pred_{name}_h{H}.so").exists()}
        A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
        dt_bias = torch.randn(H * K, device=dev) * 0.5
        for B in DECODE_BATCHES:
            q = torch.randn(B, H, K, device=dev)
            k = torch.randn(B, H, K, device=dev)
            v = torch.randn(B, H, V, device=dev)
            f = torch.randn(B, H, K, device=dev)
            b = torch.randn(B, H, device=dev)
            S0 = torch.randn(B, H, K, V, device=dev) * 0.1
            slots = torch.randperm(B, device=dev, dtype=torch.int32)  # scattered pool slots
            pool = torch.zeros(1, B, H, K, V, device=dev)
            pool[0, slots.long()] = S0
            o = torch.empty(B, H, V, device=dev)
            args = [tvm.runtime.from_dlpack(t) for t in (q, k, v, f, b, A_log, dt_bias, slots, pool)]
            o_t = tvm.runtime.from_dlpack(o)
            # time every tiling, keep the fastest; each call on its own copy of the state pool
            # (cuda_timing.copies_for: no copy is reused before 512 MiB have passed, so the
            # state comes from HBM, not L2, as in a model step)
            pool0 = pool.clone()
            nrot = copies_for(pool.numel() * 4)
            rot_args = [args] + [args[:8] + [tvm.runtime.from_dlpack(pool.clone())] for _ in range(nrot - 1)]
            tilings, tilings_graph = {}, {}
            for name, fn in variants.items():
                calls = [lambda a=a, fn=fn: fn(*a, 0, o_t) for a in rot_args]
                tilings[name] = time_cuda(rotate(calls))
                tilings_graph[name] = time_cuda_graph(rotate(calls))
            stream = _behind_predecessor(variants, rot_args, o_t, o, b, f, pool, pool0, args, B, H, tvm_preds) \
                if _tiling_name(*DECODE_PDL_TILING, True) in variants else None
            del rot_args, calls
            # every variant's one step vs the best's (from the same initial pool)
            outs = {}
            for name, fn in variants.items():
                pool.copy_(pool0)
                fn(*args, 0, o_t)
                outs[name] = (o.clone(), pool.clone())
            best = min(tilings_graph, key=tilings_graph.get)
            variant_diff = {n: max((x[0] - outs[best][0]).abs().max().item(),
                                   (x[1] - outs[best][1]).abs().max().item()) for n, x in outs.items()}
            del outs
            fn = variants[best]
            pool.copy_(pool0)
            # correctness: one step vs fla's naive recurrence (gate from the same formula)
            fn(*args, 0, o_t)
            torch.cuda.synchronize()
            g = LOWER_BOUND * torch.sigmoid(torch.exp(A_log)[None, :, None] * (f + dt_bias.view(1, H, K)))
            l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
            o_ref, S_ref = naive_recurrent_kda(
                l2(q)[:, None], l2(k)[:, None],
                v[:, None], g[:, None], torch.sigmoid(b)[:, None], initial_state=S0,
                output_final_state=True)
            err_o = (o - o_ref[:, 0]).abs().max().item()
            err_s = (pool[0, slots.long()] - S_ref).abs().max().item()
            # fla fused_recurrent_kda, same settings, state updated in place through indices
            fla_pool = S0.clone()
            qf, kf, vf, ff = q[:, None], k[:, None], v[:, None], f[:, None]
            bf = b[:, None]

            def run_fla():
                fused_recurrent_kda_fwd(qf, kf, vf, ff, bf, A_log=A_log, dt_bias=dt_bias,
                                        initial_state=fla_pool, inplace_final_state=True,
                                        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)

            run_fla()
            torch.cuda.synchronize()
            o_fla, _ = fused_recurrent_kda_fwd(qf, kf, vf, ff, bf, A_log=A_log, dt_bias=dt_bias,
                                               initial_state=S0.clone(), inplace_final_state=True,
                                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                               use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)
            err_fla = (o_fla[:, 0] - o_ref[:, 0]).abs().max().item()
            ours_ms, ours_g = tilings[best], tilings_graph[best]
            fla_pools = [fla_pool] + [S0.clone() for _ in range(nrot - 1)]

            def fla_call(st):
                return lambda: fused_recurrent_kda_fwd(
                    qf, kf, vf, ff, bf, A_log=A_log, dt_bias=dt_bias, initial_state=st,
                    inplace_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)

            fla_calls = [fla_call(st) for st in fla_pools]
            fla_ms, fla_g = time_cuda(rotate(fla_calls)), time_cuda_graph(rotate(fla_calls))
            del fla_pools, fla_calls
            state_bytes = 2 * B * H * K * V * 4
            roof_ms = state_bytes / bw * 1e3
            if stream:
                for key in [k for k in stream if k.endswith("_marginal_ms")]:
                    stream[key.replace("_marginal_ms", "_marginal_pct_roofline")] = 100 * roof_ms / stream[key]
            # what a device copy of the same bytes reaches, timed the same way (rotated copies,
            # CUDA graph): small states cannot reach the 2 GiB copy's bandwidth either
            srcs = [torch.empty(B * H * K * V, device=dev) for _ in range(nrot)]
            dsts = [torch.empty_like(x) for x in srcs]
            copy_g = time_cuda_graph(rotate([lambda a=a, c=c: c.copy_(a) for a, c in zip(srcs, dsts)]))
            del srcs, dsts
            row = {"heads": H, "batch": B, "state_copies_rotated": nrot, "ours_ms": ours_ms, "fla_ms": fla_ms,
                   "ours_graph_ms": ours_g, "fla_graph_ms": fla_g,
                   "roofline_ms": roof_ms, "ours_pct_roofline": 100 * roof_ms / ours_g,
                   "fla_pct_roofline": 100 * roof_ms / fla_g, "speedup_vs_fla": fla_g / ours_g,
                   "ours_pct_roofline_events": 100 * roof_ms / ours_ms,
                   "same_size_copy_graph_ms": copy_g, "ours_vs_same_size_copy": copy_g / ours_g,
                   "max_err_o_vs_naive": err_o, "max_err_state_vs_naive": err_s,
                   "fla_max_err_o_vs_naive": err_fla, "best_tiling": best,
                   "tilings_ms": tilings, "tilings_graph_ms": tilings_graph, "stream": stream,
                   "variants_max_abs_diff_vs_best": variant_diff}
            results["decode"].append(row)
            print(json.dumps(row))
    results["prefill"] = (run_prefill(lib_dir) if any(lib_dir.glob("kda_prefill_tc_*.so"))
                          or any(lib_dir.glob("kda_prefill_fused_*.so")) else [])
    return results


def _behind_predecessor(variants: dict, rot_args: list, o_t, o, b, f, pool, pool0, args, B: int, H: int,
                        tvm_preds: dict) -> dict:
    """The model's decode tiling with and without programmatic dependent launch, each behind a
    predecessor kernel that writes one of the decode's inputs, as in a model step: CUDA graphs
    of 10 (predecessor, decode) pairs, every decode on its own state copy. Predecessors:
    ``torch.matmul`` writing ``b = x W_b`` (fp32, x [B, HIDDEN], the shape of K3's b_proj; keys
    without a prefix), then each TVM stand-in of :func:`_predecessor_kernels` found in
    ``tvm_preds`` (b_proj writing b, the cast and f_b writing f), plain and triggering at
    entry (keys prefixed by its name). Returns each predecessor's time alone, each pair's, the
    decode's marginal time (pair − predecessor) and, as a check that the decode waited for the
    predecessor's write, max |o − o of the plain decode behind the plain predecessor| after one
    graph replay whose predecessor writes an input that held garbage before (0 when it
    waited): ``pdl_max_abs_diff_o_vs_plain`` behind torch, ``<name>_trigger_max_abs_diff_o_vs_plain``
    with the PDL decode behind the triggering stand-in. The inputs and the pool are restored."""
    import torch
    import tvm
    import tvm_ffi

    plain, pdl = _tiling_name(*DECODE_PDL_TILING), _tiling_name(*DECODE_PDL_TILING, True)
    dev = b.device
    b_true, f_true = b.clone(), f.clone()
    x = torch.randn(B, HIDDEN, device=dev)
    w = torch.randn(HIDDEN, H, device=dev) * HIDDEN ** -0.5
    kernel_args = {"b_proj": (b, (x, w.t().contiguous(), b)),
                   "cast": (f, (f.to(torch.bfloat16).view(B, -1), f.view(B, -1))),
                   "f_b": (f, (torch.randn(B, K, device=dev), torch.randn(K, H * K, device=dev) * K ** -0.5,
                               f.view(B, -1)))}

    def tvm_call(tag, kind):
        kargs = [tvm.runtime.from_dlpack(t) for t in kernel_args[kind][1]]
        return lambda: tvm_preds[tag](*kargs)

    # (key prefix, the predecessor's call, the decode input it writes)
    preds = {"": (lambda: torch.matmul(x, w, out=b), b)}
    kinds = [k for k in PREDECESSORS if k in tvm_preds and f"{k}_trigger" in tvm_preds]
    for kind in kinds:
        for tag in (kind, f"{kind}_trigger"):
            preds[tag] = (tvm_call(tag, kind), kernel_args[kind][0])

    out = {"predecessor": f"torch.matmul fp32 [{B}, {HIDDEN}] x [{HIDDEN}, {H}] -> b"}
    for tag, (call, _) in preds.items():
        pre = f"{tag}_" if tag else ""
        out[f"{pre}predecessor_graph_ms"] = time_cuda_graph(call)
        for name in (plain, pdl):
            fn = variants[name]
            calls = [lambda a=a, fn=fn, call=call: (call(), fn(*a, 0, o_t)) for a in rot_args]
            out[f"{pre}{name}_pair_graph_ms"] = t = time_cuda_graph(rotate(calls))
            out[f"{pre}{name}_marginal_ms"] = t - out[f"{pre}predecessor_graph_ms"]

    def after_garbage(tag, name):
        """o after one replay of a graph of (predecessor ``tag``, decode ``name``), the input the
        predecessor writes set to garbage (1e4) and the pool to its initial state before."""
        call, target = preds[tag]
        g = torch.cuda.CUDAGraph()
        with tvm_ffi.use_torch_stream(torch.cuda.graph(g)):
            call()
            variants[name](*args, 0, o_t)
        pool.copy_(pool0)
        target.fill_(1e4)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        return o.clone()

    out["pdl_max_abs_diff_o_vs_plain"] = (after_garbage("", pdl) - after_garbage("", plain)).abs().max().item()
    for kind in kinds:
        out[f"{kind}_trigger_max_abs_diff_o_vs_plain"] = (
            after_garbage(f"{kind}_trigger", pdl) - after_garbage(kind, plain)).abs().max().item()
    b.copy_(b_true)
    f.copy_(f_true)
    pool.copy_(pool0)
    return out


def run_prefill(lib_dir: Path, log: Path | None = None, fla_checks: bool = True, quick: bool = False,
                checks_only: bool = False, fla_timing: bool = True) -> list:
    """Prefill: correctness vs fla's naive recurrence, timing vs fla ``chunk_kda``.

    Our kernels take preprocessed inputs (q, k L2-normalized, g = −5·σ(…), β = σ(b)); fla
    ``chunk_kda`` is timed on the same preprocessed fp32 inputs (``fla_ms``; Triton's tl.dot
    runs them as TF32, as ours). Ours = intra kernel + state kernel (scratch tensors
    preallocated), every (block_v, a_batch) variant of the state pass with each intra variant
    (``tc_…``: intra as measured on 2026-11-29, ``tch_…``: ``hoist_loads``), plus each kernel
    alone (``tc_intra_ms`` for the best pair, ``intra_ms`` per intra variant, ``tc_state_ms``);
    the CUDA-core pair where its library is present (``fp32_ms``).
    Accuracy: max |o − o_naive| and |S − S_naive| of ours and (``fla_checks``) of fla
    ``chunk_kda`` on the same inputs (naive = fla ``naive_recurrent_kda``, fp32, token by token).
    Work is ordered by importance (our checks, our timings, fla timings, fla accuracy) and each
    row is appended to ``log`` (JSON lines) as soon as it exists. ``checks_only``: every check of
    ours (long ones included), no timing and nothing of fla. ``quick``: two ragged checks,
    no long checks and no fla accuracy (the variants are those the build made). ``fla_timing``
    false: ours only (fla's Triton autotuning takes most of a run).
    """
    import torch
    import tvm

    from fla.ops.kda import chunk_kda
    from fla.ops.kda.naive import naive_recurrent_kda

    def prefill_scratch_shapes(n_tok, n_seq, H):
        # = schedules.kda_prefill_cuda.prefill_scratch_shapes (that module needs the TVM
        # compiler's tvm.script, absent from the runtime-only TVM here); chunk 64
        return {"w": (n_tok, H, K), "u": (n_tok, H, V), "qg": (n_tok, H, K), "kg": (n_tok, H, K),
                "aqk": (n_tok, H, 64), "ge": ((n_tok + 63) // 64 + n_seq, H, K)}

    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row))
        if log is not None:
            with open(log, "a") as f:
                f.write(json.dumps(row) + "\n")

    l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    SN = ("w", "u", "qg", "kg", "aqk", "ge")
    later = []   # (H, fla timing / accuracy closures) run after all of ours
    for H in HEADS:
        fns = {}
        for bv in PREFILL_BV:
            path = lib_dir / f"kda_prefill_h{H}_bv{bv}.so"
            if path.exists():
                m = tvm.runtime.load_module(str(path))
                fns[f"fp32_bv{bv}"] = (m["kda_prefill_intra"], m["kda_prefill_state"])
        for name, bv, ab, opts in PREFILL_FUSED:
            path = lib_dir / f"kda_prefill_{name}_h{H}_bv{bv}_ab{ab}.so"
            if path.exists():   # raw inputs ("pre") for the kernel with its own preprocessing
                fns[f"{name}_bv{bv}_ab{ab}"] = (tvm.runtime.load_module(str(path))["kda_prefill_fused"],
                                                "pre" if "lower_bound" in opts else None)
        for name, bv, ab, opts in PREFILL_SPLIT:
            path = lib_dir / f"kda_prefill_{_split_name(name, bv, ab)}_h{H}.so"
            if path.exists() and opts.get("combined"):
                fns[name] = (tvm.runtime.load_module(str(path))["kda_prefill_split"],
                             ("combined", "lower_bound" in opts))
            elif path.exists():
                m = tvm.runtime.load_module(str(path))
                fns[_split_name(name, bv, ab)] = (m["kda_prefill_split_intra"],
                                                ("split", m["kda_prefill_split_state"], "lower_bound" in opts))
        for bv, ab in PREFILL_TC:
            path = lib_dir / f"kda_prefill_tc_h{H}_bv{bv}_ab{ab}.so"
            if not path.exists():   # the build decides which variants there are
                continue
            m = tvm.runtime.load_module(str(path))
            fns[f"tc_bv{bv}_ab{ab}"] = (m["kda_prefill_intra_tc"], m["kda_prefill_state_tc"])
            fns[f"tch_bv{bv}_ab{ab}"] = (m["kda_prefill_intra_tc_hoist"], m["kda_prefill_state_tc"])
        if not fns:   # (a build with --variants for the other head count only)
            print(f"no prefill library for {H} heads in {lib_dir}: skipped", flush=True)
            continue
        A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
        dt_bias = torch.randn(H * K, device=dev) * 0.5

        def inputs(lens, A_log=A_log, dt_bias=dt_bias, H=H):
            Tn = sum(lens)
            raw = {n: torch.randn(Tn, H, K, device=dev) for n in ("q", "k", "v", "f")}
            raw["b"] = torch.randn(Tn, H, device=dev)
            g = LOWER_BOUND * torch.sigmoid(torch.exp(A_log)[None, :, None] * (raw["f"] + dt_bias.view(1, H, K)))
            pre = {"q": l2(raw["q"]).contiguous(), "k": l2(raw["k"]).contiguous(), "v": raw["v"],
                   "g": g.contiguous(), "beta": torch.sigmoid(raw["b"]).contiguous()}
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
            return raw, pre, cu

        def ours(name, pre, cu, pool, slots, o, scr, part="both", fns=fns, raw=None, A_log=A_log, dt_bias=dt_bias,
                 H=H):
            fi, fs = fns[name]
            A = tvm.runtime.from_dlpack
            if fs is None:   # the fused kernel: q, k, v, g, beta, cu, slots, state, layer, o
                args = [A(pre[n]) for n in ("q", "k", "v", "g", "beta")] + [A(cu), A(slots), A(pool), 0, A(o)]
                return lambda: fi(*args)
            if fs == "pre":   # ... with its own L2 norms, gate and β: raw q, k, v, f, b
                args = ([A(raw[n]) for n in ("q", "k", "v", "f", "b")] + [A(A_log), A(dt_bias)]
                        + [A(cu), A(slots), A(pool), 0, A(o)])
                return lambda: fi(*args)
            if isinstance(fs, tuple):   # the split form: two kernels, or one PrimFunc ("combined")
                raw_in = fs[-1]
                Tn, B = pre["q"].shape[0], cu.shape[0] - 1
                # e^Γ k, scale e^Γ q, e^{Γ_last−Γ} k, L / Aqk (tmat: Aqk / Tᵀ), D^{-1}; e^{Γ_last} per chunk
                ka, qa, kd, la, dinv = (torch.empty(Tn, H, n, device=dev) for n in (K, K, K, 64, 16))
                gl = torch.empty(Tn // 64 + B, H, K, device=dev)
                outs = [A(x) for x in (ka, qa, kd, gl, la, dinv)]
                ins = ([A(raw[n]) for n in ("q", "k", "f", "b")] + [A(A_log), A(dt_bias)] if raw_in else
                       [A(pre[n]) for n in ("q", "k", "g", "beta")])
                if fs[0] == "combined":   # its flags zeroed per call
                    flags = torch.zeros(2 + (Tn // 64 + B + 1) * H, dtype=torch.int32, device=dev)
                    args = ins + [A(cu), A(slots), A(pre["v"]), A(pool), A(flags), 0] + outs + [A(o)]
                    return lambda: (flags.zero_(), fi(*args))
                fs = fs[1]
                a_i = ins + [A(cu)] + outs
                a_s = ([A(x) for x in (ka, qa, kd)] + [A(pre["v"])] + [A(x) for x in (gl, la, dinv)]
                       + [A(raw["b"] if raw_in else pre["beta"]), A(cu), A(slots), A(pool), 0, A(o)])
                if part == "intra":
                    return lambda: fi(*a_i)
                if part == "state":
                    return lambda: fs(*a_s)
                return lambda: (fi(*a_i), fs(*a_s))
            a_i = [A(pre[n]) for n in ("k", "q", "v", "g", "beta")] + [A(cu)] + [A(scr[n]) for n in SN]
            a_s = [A(scr[n]) for n in SN] + [A(cu), A(slots), A(pool)]
            o_t = A(o)
            if part == "intra":
                return lambda: fi(*a_i)
            if part == "state":
                return lambda: fs(*a_s, 0, o_t)
            return lambda: (fi(*a_i), fs(*a_s, 0, o_t))

        def scratch(Tn, B, H=H):
            return {n: torch.empty(s, device=dev) for n, s in prefill_scratch_shapes(Tn, B, H).items()}

        # correctness of ours vs the naive recurrence
        long_case = (8192,) if H == HEADS[-1] else (2048,) * 4

        def check(lens, init, H=H, fns=fns, inputs=inputs, ours=ours, scratch=scratch, long_case=long_case):
            raw, pre, cu = inputs(lens)
            B, Tn = len(lens), sum(lens)
            S0 = torch.randn(B, H, K, V, device=dev) * 0.1 if init else torch.zeros(B, H, K, V, device=dev)
            slots = torch.randperm(B + 2, device=dev, dtype=torch.int32)[:B]
            o_ref, S_ref = [], []
            for i in range(B):
                sl = slice(int(cu[i]), int(cu[i + 1]))
                oi, si = naive_recurrent_kda(pre["q"][None, sl], pre["k"][None, sl], pre["v"][None, sl],
                                             pre["g"][None, sl], pre["beta"][None, sl],
                                             initial_state=S0[i:i + 1], output_final_state=True)
                o_ref.append(oi[0])
                S_ref.append(si[0])
            o_ref, S_ref = torch.cat(o_ref), torch.stack(S_ref)
            row = {"kind": "check", "heads": H, "lens": list(lens), "initial_state": init,
                   "max_abs_o": o_ref.abs().max().item(), "max_abs_state": S_ref.abs().max().item(),
                   "ours": {}}
            for name in fns:
                if name.startswith("fp32") and Tn > 2000:
                    continue
                pool = torch.zeros(1, B + 2, H, K, V, device=dev)
                pool[0, slots.long()] = S0
                o = torch.full((Tn, H, V), float("nan"), device=dev)
                ours(name, pre, cu, pool, slots, o, scratch(Tn, B), raw=raw)()
                torch.cuda.synchronize()
                err_o = (o - o_ref).abs().max().item()
                err_s = (pool[0, slots.long()] - S_ref).abs().max().item()
                row["ours"][name] = {"max_err_o": err_o, "max_err_state": err_s,
                                     "ok": err_o <= PREFILL_TOL_O and err_s <= PREFILL_TOL_STATE}
            emit(row)
            if fla_checks and not quick and not checks_only and lens in (long_case, (63,), (1, 15, 64, 65, 200)):
                def fla_check(pre=pre, S0=S0, cu=cu, o_ref=o_ref, S_ref=S_ref, lens=lens, init=init, H=H):
                    with torch.inference_mode():
                        o_fla, S_fla = chunk_kda(pre["q"][None], pre["k"][None], pre["v"][None], pre["g"][None],
                                                 pre["beta"][None], initial_state=S0.clone(), output_final_state=True,
                                                 cu_seqlens=cu.long())
                    emit({"kind": "fla_check", "heads": H, "lens": list(lens), "initial_state": init,
                          "fla_max_err_o": (o_fla[0] - o_ref).abs().max().item(),
                          "fla_max_err_state": (S_fla - S_ref).abs().max().item()})
                later.append(("check", fla_check))
        checks = (((1,), True), ((15,), False), ((63,), True), ((64,), True), ((65,), False),
                  ((1000,), True), ((1, 15, 64, 65, 200), True), ((130, 7, 64), False))
        for lens, init in checks[6:] if quick else checks:
            check(lens, init)
        if not quick:
            later.append(("long", lambda check=check, long_case=long_case: check(long_case, True)))
        # timing of ours
        for lens in () if checks_only else PREFILL_SHAPES:
            raw, pre, cu = inputs(lens)
            B, Tn = len(lens), sum(lens)
            slots = torch.arange(B, device=dev, dtype=torch.int32)
            pool = torch.randn(1, B, H, K, V, device=dev) * 0.1
            o = torch.empty(Tn, H, V, device=dev)
            scr = scratch(Tn, B)
            tm = lambda f: time_cuda(f, iters=5, warmup=2, per_sample=3)  # noqa: E731
            per = {name: tm(ours(name, pre, cu, pool, slots, o, scr, raw=raw)) for name in fns}
            # the L2 norms, gate and β as separate ops (torch eager: a proxy of the graph's ops)
            torch_pre_ms = tm(lambda raw=raw, A_log=A_log, dt_bias=dt_bias, H=H: (
                l2(raw["q"]), l2(raw["k"]), torch.sigmoid(raw["b"]),
                LOWER_BOUND * torch.sigmoid(torch.exp(A_log)[None, :, None] * (raw["f"] + dt_bias.view(1, H, K)))))
            tc = [n for n in per if n.startswith("tc")]
            fused = [n for n in per if n.startswith("fused_")]
            fused_pre = [n for n in per if n.startswith("fusedpre_")]
            split = [n for n in per if n.startswith("split_")]
            split_pre = [n for n in per if n.startswith("splitpre_")]
            split_auto = {n: per[n] for n in per if n.startswith("splitauto")}
            # ours on preprocessed inputs (the *pre* variants take raw ones)
            # (or, where only *pre* variants were built, the fastest of those)
            plain = [n for n in per if "pre" not in n and not n.startswith("fp32")]
            best = min(plain or [n for n in per if not n.startswith("fp32")] or list(per), key=per.get)
            row = {"kind": "time", "heads": H, "lens": list(lens), "ours_ms": per[best], "best": best,
                   # True: ours_ms takes the raw inputs (no plain variant built), so speedup_vs_fla
                   # (fla on preprocessed inputs) is not like for like
                   "best_takes_raw_inputs": not plain,
                   "variants_ms": per,
                   "fused_ms": min([per[n] for n in fused], default=None),
                   "fused_pre_ms": min([per[n] for n in fused_pre], default=None),
                   "two_kernel_ms": min([per[n] for n in tc], default=None),
                   "split_ms": min([per[n] for n in split], default=None),
                   "split_pre_ms": min([per[n] for n in split_pre], default=None),
                   "torch_preprocess_ms": torch_pre_ms,
                   # block_v at run time, as the model dispatches it (the splitautopre* variants)
                   "split_auto_ms": split_auto.get("splitauto"), "split_auto_pre_ms": split_auto.get("splitautopre"),
                   "fp32_ms": min([per[n] for n in per if n.startswith("fp32")], default=None)}
            if split:
                best_split = min(split, key=per.get)
                row["split_intra_ms"] = tm(ours(best_split, pre, cu, pool, slots, o, scr, "intra"))
                row["split_state_ms"] = tm(ours(best_split, pre, cu, pool, slots, o, scr, "state"))
            if tc:
                best_tc = min(tc, key=per.get)
                row.update({
                    "tc_intra_ms": tm(ours(best_tc, pre, cu, pool, slots, o, scr, "intra")),
                    "intra_ms": {kind: tm(ours(min(ns, key=per.get), pre, cu, pool, slots, o, scr, "intra"))
                                 for kind in ("tc", "tch") if (ns := [n for n in tc if n.startswith(kind + "_")])},
                    "tc_state_ms": {n: tm(ours(n, pre, cu, pool, slots, o, scr, "state"))
                                    for n in tc if n.startswith("tc_")}})
            emit(row)

            def fla_time(pre=pre, raw=raw, S0=pool[0].clone(), cu64=cu.long(), row=row, A_log=A_log,
                         dt_bias=dt_bias):
                with torch.inference_mode():
                    row["fla_ms"] = time_cuda(lambda: chunk_kda(
                        pre["q"][None], pre["k"][None], pre["v"][None], pre["g"][None], pre["beta"][None],
                        initial_state=S0, output_final_state=True, cu_seqlens=cu64), iters=5, warmup=2, per_sample=3)
                    # fla as a model would call it: raw bf16 q, k, v, gate input and β logits,
                    # with the gate (lower bound −5, safe_gate), L2 norms and β sigmoid in kernel
                    bf = {n: raw[n].bfloat16()[None] for n in ("q", "k", "v", "f")}
                    b16 = raw["b"].bfloat16()[None]
                    row["fla_bf16_gated_ms"] = time_cuda(lambda: chunk_kda(
                        bf["q"], bf["k"], bf["v"], bf["f"], b16, initial_state=S0, output_final_state=True,
                        cu_seqlens=cu64, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                        lower_bound=LOWER_BOUND), iters=5, warmup=2, per_sample=3)
                row["speedup_vs_fla"] = row["fla_ms"] / row["ours_ms"]
                row["speedup_vs_fla_bf16_gated"] = row["fla_bf16_gated_ms"] / row["ours_ms"]
                def ratio(fla_key, ours_key):
                    return row[fla_key] / row[ours_key] if row[ours_key] else None

                emit({"kind": "fla_time", "heads": row["heads"], "lens": row["lens"], "best": row["best"],
                      "ours_ms": row["ours_ms"], "fla_ms": row["fla_ms"], "fla_bf16_gated_ms": row["fla_bf16_gated_ms"],
                      "speedup_vs_fla": row["speedup_vs_fla"],
                      "speedup_vs_fla_bf16_gated": row["speedup_vs_fla_bf16_gated"],
                      "fused_speedup_vs_fla": ratio("fla_ms", "fused_ms"),
                      # kernel against kernel, both with L2 norms, gate and β inside
                      "fused_pre_speedup_vs_fla_bf16_gated": ratio("fla_bf16_gated_ms", "fused_pre_ms"),
                      "two_kernel_speedup_vs_fla": ratio("fla_ms", "two_kernel_ms"),
                      "split_speedup_vs_fla": ratio("fla_ms", "split_ms"),
                      "split_speedup_vs_fla_bf16_gated": ratio("fla_bf16_gated_ms", "split_ms"),
                      # kernels against kernel, both with L2 norms, gate and β inside
                      "split_pre_speedup_vs_fla_bf16_gated": ratio("fla_bf16_gated_ms", "split_pre_ms")})
            if fla_timing:
                later.append(("time", fla_time))
    for kind in ("long", "time", "check"):
        for k_, fn in later:
            if k_ == kind:
                fn()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out_dir", type=Path)
    b.add_argument("--only", choices=("all", "prefill", "decode", "conv"), default="all")
    b.add_argument("--model-tc", action="store_true",
                   help="prefill: of the two-kernel pair only the tiling the model dispatches")
    b.add_argument("--variants", metavar="REGEX",
                   help="prefill: only the fused / split libraries whose file name matches (no two-kernel pair)")
    r = sub.add_parser("run")
    r.add_argument("lib_dir", type=Path)
    r.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    r.add_argument("--only", choices=("all", "prefill", "conv"), default="all",
                   help="prefill: skip the decode benchmark; conv: only the conv-fused decode against "
                        "the unfused chain")
    r.add_argument("--quick", action="store_true", help="prefill: two checks, no long check, no fla accuracy")
    r.add_argument("--checks-only", action="store_true", help="prefill: every check of ours, no timing, no fla")
    r.add_argument("--no-fla", action="store_true", help="prefill: time ours only")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        if args.only == "prefill":
            build_prefill(args.out_dir, baseline=False, all_tc=not args.model_tc, only=args.variants)
        elif args.only == "conv":
            build_conv(args.out_dir)
        else:
            build(args.out_dir, prefill=args.only == "all")
        return 0
    import torch

    if args.only == "conv":
        rows = run_conv(args.lib_dir)
        res = {"decode_conv": rows, "machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
               "commit": git_commit(), "head_dim": K, "conv_width": CONV_W, "lower_bound": LOWER_BOUND}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kda_decode_conv_h200.json").write_text(json.dumps(res, indent=1))
        return 0
    if args.only == "prefill":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from k3_compile.device_code import load_cuda_runtime

        load_cuda_runtime()
        args.out.mkdir(parents=True, exist_ok=True)
        res = {"decode": [], "prefill": run_prefill(args.lib_dir, log=args.out / "kda_prefill_rows.jsonl",
                                                    quick=args.quick, checks_only=args.checks_only,
                                                    fla_timing=not args.no_fla)}
        failed = [(r["heads"], r["lens"], n) for r in res["prefill"] if r["kind"] == "check"
                  for n, e in r["ours"].items() if not e["ok"]]
        res["checks_failed"] = failed
        if failed:
            print(f"FAILED prefill checks (heads, lens, kernel): {failed}", file=sys.stderr)
    else:
        res = run(args.lib_dir)
    res.update({"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                "commit": git_commit(), "fla": "fla-core 0.6.0", "head_dim": K,
                "lower_bound": LOWER_BOUND})
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only == "prefill":
        (args.out / "kda_prefill_h200.json").write_text(json.dumps(res, indent=1))
        _plot_prefill(res, args.out / "kda_prefill_h200.png")
        return 1 if res["checks_failed"] else 0
    else:
        (args.out / "kda_decode_h200.json").write_text(json.dumps(res, indent=1))
        _plot(res, args.out / "kda_decode_h200.png")
    return 0


def _plot_prefill(res: dict, path: Path) -> None:
    """Prefill times per shape: the fused kernel, the split form, the two-kernel form, the CUDA-core pair where
    measured, fla on the same fp32 inputs and fla on bf16 with gate / L2 / β in its kernel
    (whichever the rows have); each bar labelled with its time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trows = [r for r in res["prefill"] if r["kind"] == "time"]
    if not trows:
        return
    series = [("fused_ms", "TIR fused (one kernel)"), ("fused_pre_ms", "TIR fused, gate/L2/β in kernel"),
              ("split_ms", "TIR split (all chunks' intra, then the state pass)"),
              ("split_pre_ms", "TIR split, gate/L2/β in kernel"),
              ("two_kernel_ms", "TIR two kernels (intra + state)"),
              ("fp32_ms", "TIR fp32 CUDA cores (before)"), ("fla_ms", "fla chunk_kda, same fp32 inputs"),
              ("fla_bf16_gated_ms", "fla chunk_kda, bf16, gate/L2/β in kernel")]
    series = [(k, label) for k, label in series if any(r.get(k) for r in trows)]
    if not series:   # e.g. a run of variants none of these columns summarize
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = [f"{r['heads']}h " + ("x".join(str(n) for n in sorted(set(r["lens"])))
                               + (f"x{len(r['lens'])}" if len(r["lens"]) > 1 else "")) for r in trows]
    wd = 0.8 / len(series)
    for j, (key, label) in enumerate(series):
        pos = [i + (j - (len(series) - 1) / 2) * wd for i in range(len(trows))]
        vals = [r.get(key) or float("nan") for r in trows]
        ax.bar(pos, vals, wd, label=label)
        for x, y in zip(pos, vals):
            if y == y:
                ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(trows)), xs, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title("KDA chunked prefill, head_dim 128 (ours: fp32 inputs; H200)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(HEADS) + 1, figsize=(5 * (len(HEADS) + 1), 4))
    trows = [r for r in res.get("prefill", []) if r["kind"] == "time"]
    if trows:
        ax = axes[-1]
        xs = [f"{r['heads']}h {'x'.join(str(n) for n in sorted(set(r['lens'])))}"
              + (f"x{len(r['lens'])}" if len(r["lens"]) > 1 else "") for r in trows]
        idx = range(len(xs))
        ax.bar([i - 0.2 for i in idx], [r["ours_ms"] for r in trows], 0.4, label="k3-compile TIR")
        ax.bar([i + 0.2 for i in idx], [r["fla_ms"] for r in trows], 0.4, label="fla chunk_kda")
        ax.set_xticks(list(idx), xs, fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title("KDA prefill (fp32, preprocessed inputs)")
        ax.legend()
    for ax, H in zip(axes, HEADS):
        rows = [r for r in res["decode"] if r["heads"] == H]
        xs = [str(r["batch"]) for r in rows]
        w = 0.38
        idx = range(len(xs))
        ax.bar([i - w / 2 for i in idx], [r["ours_pct_roofline"] for r in rows], w, label="k3-compile TIR")
        ax.bar([i + w / 2 for i in idx], [r["fla_pct_roofline"] for r in rows], w, label="fla fused_recurrent_kda")
        ax.axhline(85, ls="--", c="gray", lw=1)
        ax.set_xticks(list(idx), xs)
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("% of HBM roofline")
        ax.set_title(f"KDA decode, {H} heads x 128")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
