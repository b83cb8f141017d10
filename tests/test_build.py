"""k3_compile.build: the whole k3-nano model compiles for CUDA with precompiled device code.

CPU only (no GPU needed): the CUDA build runs nvcc here; skipped when nvcc is absent. The
CUDA build runs in a subprocess because it loads ``libtvm_runtime_cuda.so`` into the process
(k3_compile.device_code), which changes how later plain CUDA compiles in the same process
behave. Running the result on a GPU: tests/gpu/run_nano_cuda.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from k3_compile.config import K3Config
from k3_compile.device_code import inspect_library, library_has_source_only
from k3_compile.pipeline import export_model

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "models" / "k3-nano"

# The hand-written kernels (relax_modules -> schedules/*) by their Relax name prefix.
HAND_WRITTEN = ("kda_short_conv", "kda_chunk_prefill", "kda_decode", "kda_slot_reset",
                "kda_slot_copy", "mla_append", "mla_attend", "mla_page_copy", "moe_route",
                "moe_mxfp4_gemv", "moe_gemv")


def _prim_funcs(mod):
    import tvm

    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def test_gpu_export_uses_scheduled_kernels():
    """export_model(gpu=True): every hand-written kernel is a thread-bound, scheduled variant;
    the tuned export dispatches the KDA decode kernel with the short convolutions inside
    (no separate convolution on the decode path: ``kda_short_conv`` then serves prefill
    only), ``tuned=False`` (``k3 compile --generic-kernels``) the generic one; gpu=False keeps
    the CPU loop nests."""
    cfg = K3Config.from_file(NANO)
    gpu = _prim_funcs(export_model(cfg, "float32", gpu=True, tuned=False).mod)
    tuned_mod = export_model(cfg, "float32", gpu=True).mod
    tuned = _prim_funcs(tuned_mod)
    assert "kda_short_conv" not in tuned_mod["decode"].script()
    assert "kda_short_conv" in tuned_mod["prefill"].script()
    cpu = _prim_funcs(export_model(cfg, "float32").mod)
    found = [n for n in gpu if n.startswith(HAND_WRITTEN)]
    assert {n.rstrip("0123456789_") for n in found} >= set(HAND_WRITTEN) - {"moe_gemv"}
    assert "kda_decode_conv_fused" in tuned and "kda_decode" not in tuned and "kda_decode_fused" not in tuned
    assert "kda_decode_conv_fused" not in gpu
    found += ["kda_decode_conv_fused"]
    gpu.update(tuned)
    for name in found:
        f = gpu[name]
        assert f.attrs and f.attrs.get("tirx.is_scheduled"), name
        assert "threadIdx.x" in f.script(), name
    for name, f in cpu.items():
        if name.startswith(HAND_WRITTEN):
            assert "thread_binding" not in f.script() and "threadIdx" not in f.script(), name


_BUILD = textwrap.dedent("""
    import sys
    from k3_compile.build import build_module
    from k3_compile.config import K3Config
    from k3_compile.pipeline import export_model
    from targets import get_target
    cfg = K3Config.from_file(sys.argv[1])
    ex = export_model(cfg, "float32", gpu=True)
    build_module(ex.mod, get_target("cuda-sm90a")).export_library(sys.argv[2])
""")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: cannot precompile CUDA")
def test_nano_compiles_for_sm90a_with_fatbin(tmp_path):
    out = tmp_path / "k3nano_sm90a.so"
    r = subprocess.run([sys.executable, "-c", _BUILD, str(NANO), str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    blobs = inspect_library(out)
    assert blobs, "the library holds no CUDA module"
    assert all(b.content == "fatbin" for b in blobs), [(b.fmt, b.content) for b in blobs]
    assert not library_has_source_only(out)


def test_cuda_graph_rewrite_captures_decode_regions():
    """``--cuda-graph``: the CUDA pipeline lifts weight-only regions of decode into captured
    graphs (checked on the Relax side; correctness was checked on the H200, see build.py)."""
    import tvm

    from k3_compile.build import gpu_relax_pipeline
    from targets import get_target

    cfg = K3Config.from_file(NANO)
    mod = export_model(cfg, "bfloat16", gpu=True).mod
    target = get_target("cuda-sm90a").tvm_target()
    names = {gv.name_hint for gv in gpu_relax_pipeline(target, cuda_graph=True)(mod).get_global_vars()}
    assert any(n.startswith("decode_cuda_graph_capture") for n in names)
    plain = {gv.name_hint for gv in gpu_relax_pipeline(target)(mod).get_global_vars()}
    assert not any("cuda_graph" in n for n in plain)


def test_tuned_moe_kernels_dispatched_where_they_fit():
    """CUDA + tuned + MXFP4 + bf16: decode uses the tensor-core MoE GEMVs, prefill the sort +
    grouped GEMMs, where the widths are multiples of 128 (tests/gpu/check_moe_dispatch.py
    and run_nano_cuda.py compare them with the generic path / the CPU build on the H200);
    --generic-kernels, fp32 and a latent width of 96 stay generic; k3-nano (widths 128 / 256)
    gets both."""
    from oracle_mlx import tiny_config

    cfg = K3Config.from_dict(tiny_config(hidden_size=256, routed_expert_hidden_size=512,
                                         moe_intermediate_size=512, num_experts=3,
                                         num_experts_per_token=2))
    decode_k = ("moe_expert_chain", "moe_mxfp4_gate_up", "moe_mxfp4_down")
    prefill_k = ("moe_sort", "moe_grouped_gate_up", "moe_grouped_down")
    tuned = export_model(cfg, "bfloat16", gpu=True).mod
    decode_src = tuned["decode"].script(show_meta=False)
    prefill_src = tuned["prefill"].script(show_meta=False)
    for name in decode_k:
        assert name in decode_src and name not in prefill_src
    assert "k3_mma_bf16" in tuned["moe_mxfp4_gate_up"].script(show_meta=False)  # the tensor-core GEMV
    for name in prefill_k:
        assert name in prefill_src and name not in decode_src
    for mod in (export_model(cfg, "bfloat16", gpu=True, tuned=False).mod,
                export_model(cfg, "float32", gpu=True).mod):
        src = mod["decode"].script(show_meta=False) + mod["prefill"].script(show_meta=False)
        assert not any(name in src for name in decode_k + prefill_k)
    odd_mod = export_model(K3Config.from_dict(tiny_config(
        hidden_size=256, routed_expert_hidden_size=96, moe_intermediate_size=512, num_experts=3,
        num_experts_per_token=2)), "bfloat16", gpu=True).mod  # latent 96: not a multiple of 128
    odd_src = odd_mod["decode"].script(show_meta=False) + odd_mod["prefill"].script(show_meta=False)
    assert not any(name in odd_src for name in decode_k + prefill_k)
    nano = export_model(K3Config.from_file(NANO), "bfloat16", gpu=True).mod
    assert "moe_mxfp4_gate_up" in nano["decode"].script(show_meta=False)
    assert "moe_grouped_gate_up" in nano["prefill"].script(show_meta=False)
    # the combine with the router weights' rounding and routed_expert_norm in one kernel
    for fn in ("decode", "prefill"):
        assert "moe_combine_norm" in nano[fn].script(show_meta=False)
    assert "moe_combine_norm" not in export_model(K3Config.from_file(NANO), "bfloat16", gpu=True,
                                                  tuned=False).mod["decode"].script(show_meta=False)


def test_fused_combine_norm_replaces_the_separate_norm():
    """k3-nano's LatentMoE alone: with the fused kernel (GPU, bf16, tuned) the block has no Relax
    RMSNorm left (routed_expert_norm is its only norm: no rsqrt, no mean) and no separate rounding
    of the router weights; without it (tuned=False) it has both — the norm is applied once either way."""
    from tvm.relax.frontend import nn

    from relax_modules.moe import LatentMoE

    cfg = K3Config.from_file(NANO)

    class Block(nn.Module):
        def __init__(self, tuned):
            self.moe = LatentMoE(cfg, "bfloat16", gpu=True, tuned=tuned)

        def forward(self, x):
            return self.moe(x, True)

    def script(tuned):
        mod, _ = Block(tuned).export_tvm({"forward": {"x": nn.spec.Tensor(["n", cfg.hidden_size], "bfloat16")}})
        return mod["forward"].script(show_meta=False)

    fused, plain = script(True), script(False)
    assert "moe_combine_norm" in fused and "R.rsqrt" not in fused and "R.mean" not in fused
    assert fused.count('R.astype') < plain.count('R.astype')
    assert "moe_combine_norm" not in plain and plain.count("R.rsqrt") == 1 and plain.count("R.mean") == 1


def test_gpu_pipeline_dense_matmuls_read_weights_as_stored_and_branch_on_tokens():
    """The GPU pipeline's dense projections (k3_compile.build): ``x @ Wᵀ`` is one NT_matmul on
    the stored ``W [out, in]`` (no transpose kernel: before, each call of the K3 MoE layer
    materialized the transposes of 380 MB of weights, 3.9 ms at one token on the H200,
    benchmarks/results/moe_layer_*), the router multiplies the bf16 weight without an fp32
    copy, and every dense matmul with a symbolic token count branches on it at the
    LOW_BATCH limits (GEMV schedules below, a tiled one above)."""
    import re

    import tvm

    from k3_compile.build import LOW_BATCH, SPLITK_FROM, TENSOR_CORE_FROM, WGMMA_FROM, gpu_relax_pipeline
    from schedules import dense_gemv as dg
    from schedules import dense_prefill_wgmma as dpw
    from targets import get_target

    cfg = K3Config.from_file(NANO)
    mod = export_model(cfg, "bfloat16", gpu=True).mod
    spec = get_target("cuda-sm90a")
    target = spec.tvm_target()
    assert spec.features.wgmma
    out = _prim_funcs(gpu_relax_pipeline(target, wgmma=True)(mod))
    # transposes left: activations' (MLA heads), whose shapes have the token count; none of a weight
    static = [n for n, f in out.items() if "transpose" in n and not any(
        isinstance(d, tvm.tirx.Var) for p in f.params for d in p.ty.shape)]
    assert not static, static
    # projections by a weight parameter [out, in] (q/kv/o, KDA, shared experts, router, lm_head
    # ...; not MLA's per-head absorbed products, batched over heads)
    dense = {n: f.script() for n, f in out.items() if "NT_matmul" in n and not n.startswith("sibling_gemv")
             and any(p.name.endswith("weight") and len(p.ty.shape) == 2 for p in f.params)}
    assert len(dense) >= 10, sorted(out)
    # sibling projections of one activation merged (k3_compile/sibling_gemvs.py): a KDA layer's
    # q, k, v, f_a, g; the MoE block's router, latent down and shared up projections; MLA's
    # q_a and kv_a. Each merged function branches once on n <= MAX_TOKENS (one launch for all)
    merged = {n: f for n, f in out.items() if n.startswith("sibling_gemv")}
    sizes = sorted(sum(1 for p in f.params if p.name.endswith("weight")) for f in merged.values())
    assert sizes == [2, 3, 5], sorted(merged)
    for n, f in merged.items():
        src = f.script()
        found = [int(v) for v in re.findall(r"tvm_thread_invariant\(\w+ <= T\.int64\((\d+)\)\)", src)]
        assert found == [dg.MAX_TOKENS] and '"__shfl_xor_sync"' in src, (n, found)
    limits = [lim for lim, _ in LOW_BATCH]
    # the bf16 projections the tensor-core kernel fits: LowBatchGEMV below TENSOR_CORE_FROM
    # tokens, the kernel (mma.sync, the fused epilogue inside) for every larger count
    tc_limits = [lim for lim in limits if lim < TENSOR_CORE_FROM]
    n_tc = n_wg = n_gemv = 0
    for name, src in dense.items():
        found = [int(v) for v in re.findall(r"tvm_thread_invariant\(\w+ <= T\.int64\((\d+)\)\)", src)]
        tc = "k3_mma_bf16" in src
        n_tc += tc
        f = out[name]
        w = next(p for p in f.params if p.name.endswith("weight") and len(p.ty.shape) == 2)
        rows, width = (int(d) for d in w.ty.shape)
        # 1-2 tokens: the hand GEMV (its warp shuffles) where it fits, else dlight's LowBatchGEMV
        gemv = '"__shfl_xor_sync"' in src
        n_gemv += gemv
        assert gemv == (tc and dg.fits(rows, width)), (name, rows, width)
        assert found == ([dg.MAX_TOKENS] if gemv else tc_limits if tc else limits), (name, found)
        # Hopper: the projections the wgmma kernels fit (rows a multiple of 128) take the split-K
        # one from SPLITK_FROM tokens and the prefill one from WGMMA_FROM (branches before the
        # decode kernel's n >= 1), the others neither
        wg = "k3_wgmma_m64n" in src
        n_wg += wg
        assert wg == (tc and dpw.fits(rows, width)), (name, rows, width)
        lower = [int(v) for v in re.findall(r"tvm_thread_invariant\(\w+ >= T\.int64\((\d+)\)\)", src)]
        assert lower == ([WGMMA_FROM, SPLITK_FROM, 1] if wg else [1] if tc else []), (name, lower)
        # the split-K kernel: its 128-row wgmma and its fp32 workspace of partial sums, which TVM
        # allocates at the function's entry for every call: sized for n tokens only in the
        # split-K range, else for one (a workspace of n tokens at prefill sizes was ~1 GB at K3)
        assert ("k3_wgmma_m64n128k16_bf16_ss" in src) == wg, name
        ws = [ln.strip() for ln in src.splitlines() if ln.strip().startswith("ws = T.alloc_buffer(")]
        assert len(ws) == int(wg), (name, ws)
        if wg:
            assert re.search(rf"T\.if_then_else\((\w+) >= T\.int64\({SPLITK_FROM}\) and \1 <= "
                             rf"T\.int64\({WGMMA_FROM - 1}\), \1, T\.int64\(1\)\)", ws[0]), ws
        if wg:  # the 256-row tile where the rows allow it
            assert f"k3_wgmma_m64n{dpw.tile_rows(rows)}k16_bf16_ss" in src, name
    # k3-nano: all but b_proj (2 rows, not a multiple of 16) fit the kernel
    assert n_tc >= len(dense) - 2, (n_tc, sorted(dense))
    # and all but b_proj, the 32-row and the 96-row projections fit the prefill kernel
    assert n_wg >= len(dense) - 4, (n_wg, sorted(dense))
    assert n_gemv >= 1, sorted(dense)
    # the router weight is read by the router's matmul only (no fp32 copy made per call)
    readers = {n for n, f in out.items() for p in f.params
               if p.name.endswith("block_sparse_moe.gate.weight")}
    assert readers and all(n in dense or n in merged for n in readers), readers


def test_generic_kernels_build_keeps_dlight_for_dense_projections():
    """``k3 compile --generic-kernels`` (build_module(hand_kernels=False)) gives the dense
    projections dlight's schedules alone: no hand-written tensor-core kernel in them; the
    default build splices the GEMV, decode, split-K and prefill kernels (cuda-sm90a)."""
    import tvm
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op

    from k3_compile.build import gpu_relax_pipeline
    from targets import get_target

    class Proj(nn.Module):
        def __init__(self):
            self.w = nn.Parameter((256, 256), "bfloat16")

        def forward(self, x):
            return op.astype(op.matmul(x, op.permute_dims(self.w, [1, 0]), out_dtype="float32"), "bfloat16")

    mod, _ = Proj().export_tvm(spec={"forward": {"x": nn.spec.Tensor(["n", 256], "bfloat16")}})
    target = get_target("cuda-sm90a").tvm_target()

    def dense_src(**kw):
        out = gpu_relax_pipeline(target, wgmma=True, **kw)(mod)
        return "\n".join(f.script() for gv, f in out.functions_items()
                         if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint)

    hand = dense_src()
    assert all(k in hand for k in ("k3_mma_bf16", "k3_wgmma_m64n128k16_bf16_ss", "k3_wgmma_m64n256k16_bf16_ss",
                                   "__shfl_xor_sync"))
    generic = dense_src(tensor_cores=False)
    assert 'thread="threadIdx.x"' in generic  # scheduled (by dlight)
    assert "k3_mma_bf16" not in generic and "k3_wgmma" not in generic and "__shfl_xor_sync" not in generic
