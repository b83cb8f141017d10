"""MoE expert benchmark: the MXFP4 decode GEMVs the model dispatches (tensor cores,
schedules/moe_mxfp4_decode_tc.py) vs the HBM roofline, an eager bf16 torch loop and the
CUDA-core GEMVs (schedules/moe_mxfp4_cuda.py, the baseline), and the prefill grouped GEMMs
(``mma.sync``: schedules/moe_mxfp4_prefill_cuda.py; Hopper ``wgmma``: moe_mxfp4_prefill_wgmma.py,
what cuda-sm90a dispatches) vs the bf16 tensor-core peak and ``torch._grouped_mm``.

Two steps, because the GPU machine has no TVM compiler:

1. Here (with nvcc): ``python benchmarks/moe.py build dist/moe`` compiles the dispatched
   decode kernels (expert chain, fused w1/w3 + SiTU, w2) into ``dist/moe/moe_mxfp4.so``, the
   other decode variants of :data:`DECODE_VARIANTS` into ``dist/moe/<variant>/moe_mxfp4.so``,
   and the prefill kernels (sort, grouped gate_up, grouped down) into ``moe_prefill.so``
   (``mma.sync``), ``moe_prefill_wgmma.so`` and its variants (:data:`WGMMA_VARIANTS`:
   ``moe_prefill_wgmma_<name>.so``) and a small-shape build, for ``cuda-sm90a``.
2. On the H200 (runtime-only TVM): ``python benchmarks/moe.py run dist/moe --out $OUT``
   (``--prefill-only`` / ``--decode-only`` skip the other part).

K3 shapes: E = 896 experts, latent L = 3584, expert width I = 3072, top-16; x and outputs
bf16; all 896 experts resident in MXFP4 (random codes, scales 2^-6..2^-1).
Decode correctness (T = 1, 7, 8, 20; every variant at T = 7 and 20): both outputs vs a torch
reference (dequantize in fp32, fp32 matmuls, bf16 rounding of g/u/a/o as in the model); T = 7
has tokens sharing experts, T = 20 one expert chosen by all (a chain of 3 passes of 8).
Decode timing (T = 1, 8, 64): CUDA events over back-to-back calls of the three kernels
(``ours_ms``) and replays of a CUDA graph of them (``ours_graph_ms``, GPU time without the
host's launch cost); each variant is timed interleaved with the default on the same inputs
(:data:`AB_ROUNDS` rounds, medians: whole runs differ by a few percent); roofline = bytes of the distinct experts touched (packed + scales of w1,
w3, w2) / measured device-to-device copy bandwidth; the torch loop runs per distinct expert
(tokens grouped beforehand, outside the timing) with dequantized bf16 weights resident.
Prefill correctness: the tile table and permutation vs NumPy, both GEMM outputs vs torch fp32
for routings with experts of 0, 1 and 300 tokens, for both kernel families on the same inputs
(their a and o compared with each other; the wgmma ones un-permuted), and at the small shapes of
tests/gpu/check_moe_dispatch.py. Prefill timing (T = 8192, 6144, 4096, 2048, uniform top-16 routing):
the two grouped GEMMs (and the sort on its own) vs ``torch._grouped_mm`` over the same sorted
tokens with bf16 copies of all 896 experts (sorting outside its timing), and vs the bf16
peak measured with an 8192³ ``torch.matmul``; ``ours_*`` are the ``mma.sync`` kernels (other
CUDA targets), ``dispatched_sm90a_*`` what cuda-sm90a runs (the wgmma build: plain, or
warp-specialized from WS_MIN_PAIRS_PER_EXPERT pairs per expert; ``_form`` is that rule's
prediction), and every wgmma variant's
time and largest output difference from the ``mma.sync`` output are under ``variants_*``
(each variant also runs every prefill check). The MXFP8-activation decode build
(``dist/moe/mxfp8/moe_mxfp8.so``, :func:`build_mxfp8`) is checked and timed against the
dispatched bf16-activation path by :func:`run_mxfp8` (results under ``mxfp8``). Results: JSON +
PNG under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from cuda_timing import copy_bandwidth, git_commit, time_cuda, time_cuda_graph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3_compile.device_code import PTXAS_OPTIONS as PTXAS_REGISTER_LEVEL  # noqa: E402

E, L, I, TOPK = 896, 3584, 3072, 16
BETA, BETA_LIN = 4.0, 25.0
CHECK_T = (1, 7, 8, 20)
CHAIN_T = (1, 64, 300)  # 300 tokens: 4800 entries, 5 shared-memory tiles of the chain kernel
TIME_T = (1, 8, 64)
AB_ROUNDS = 5
FUNCS = ("moe_expert_chain", "moe_mxfp4_gate_up", "moe_mxfp4_down")

# decode builds: name -> (kernels, gate_up kwargs, down kwargs); "" (the top-level
# moe_mxfp4.so) is what the model dispatches, "tensor_cores" the tensor-core GEMVs
# (schedules/moe_mxfp4_decode_tc.py), "cuda_cores" the CUDA-core ones (moe_mxfp4_cuda.py).
DECODE_VARIANTS = {"": ("tensor_cores", {}, {}), "cuda_cores": ("cuda_cores", {}, {}),
                   # the defaults: chains=2, unroll=True, l2_prefetch=128; W1/W3 stages 4; W2 pair,
                   # skip_x, stages 3
                   "d_unpaired": ("tensor_cores", {}, {"pair": False, "stages": 4}),
                   "no_skipx": ("tensor_cores", {}, {"skip_x": False}),
                   # the weight copies without the L2 prefetch-size hint (default .L2::128B), and
                   # with 256 bytes (mixed 128 / 256 and 64 measured too:
                   # moe_decode_l2pf_b_h200_2026-12-02.json)
                   "no_l2pf": ("tensor_cores", {"l2_prefetch": 0}, {"l2_prefetch": 0}),
                   "l2pf256": ("tensor_cores", {"l2_prefetch": 256}, {"l2_prefetch": 256})}
# A library folder holding this file reads the codes in the checkpoint layout ("ocp"); the
# others (the tensor-core kernels) in the tc layout (schedules/mxfp4_tc_layout.py), which the
# run makes on the GPU with repack.so (the in-place permutation the model library runs at load).
OCP_MARKER = "codes_layout_ocp"


def worst(a: float, b: float) -> float:
    """The larger of two errors, NaN if either is NaN (Python's ``max(0.0, nan)`` is 0.0, which
    would let a kernel's NaN output pass the checks)."""
    return a if a != a else b if b != b else max(a, b)


def _compile(fs: dict, path: Path, options=PTXAS_REGISTER_LEVEL) -> None:
    """Compile the PrimFuncs ``fs`` (name -> func) for cuda-sm90a with the device code
    precompiled (nvcc ``options``) into the library ``path``."""
    import tvm

    from k3_compile.device_code import precompiled_cuda
    from schedules.barriers import respect_manual_barriers
    from targets import get_target

    spec = get_target("cuda-sm90a")
    mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in fs.items()})
    with precompiled_cuda(spec.nvcc_arch, options=options), respect_manual_barriers():
        lib = tvm.compile(mod, target=spec.tvm_target())
    path.parent.mkdir(parents=True, exist_ok=True)
    lib.export_library(str(path))
    print(f"built {path}")


def build(out_dir: Path, decode: bool = True) -> None:
    """The decode libraries of :data:`DECODE_VARIANTS` (unless ``decode`` is False), the
    repack kernel and the prefill libraries."""
    from schedules import moe_mxfp4_cuda as mc
    from schedules import moe_mxfp4_decode_tc as dt
    from schedules import mxfp4_tc_layout as tcl

    for name, (kind, gu_kw, d_kw) in (DECODE_VARIANTS.items() if decode else ()):
        if kind == "tensor_cores":
            gu = dt.moe_mxfp4_gate_up_tc_kernel(E, L, I, TOPK, BETA, BETA_LIN, **gu_kw)
            down = dt.moe_mxfp4_down_tc_kernel(E, L, I, TOPK, **d_kw)
        else:
            gu = mc.moe_mxfp4_gate_up_kernel(E, L, I, TOPK, BETA, BETA_LIN, **gu_kw)
            down = mc.moe_mxfp4_down_kernel(E, L, I, TOPK, **d_kw)
        d = out_dir / name if name else out_dir
        _compile({"moe_expert_chain": mc.moe_expert_chain_kernel(TOPK), "moe_mxfp4_gate_up": gu,
                  "moe_mxfp4_down": down}, d / "moe_mxfp4.so")
        if kind == "cuda_cores":
            (d / OCP_MARKER).write_text("the kernels here read the checkpoint code layout\n")
    _compile({"repack": tcl.repack_kernel(gpu=True)}, out_dir / "repack.so")
    if decode:
        build_mxfp8(out_dir / MXFP8_DIR)
    build_prefill(out_dir)


MXFP8_DIR = "mxfp8"   # the W4A8 decode build (its own file name: the variant loop skips it)
MXFP8_FUNCS = ("moe_expert_chain", "mxfp8_quantize_z", "moe_mxfp4_gate_up", "mxfp8_quantize_a",
               "moe_mxfp4_down", "repack_fp8")


def build_mxfp8(d: Path, gu_kw: dict | None = None, d_kw: dict | None = None) -> None:
    """The MXFP8-activation decode kernels (``act="mxfp8"`` of schedules/moe_mxfp4_decode_tc.py,
    with the schedule keywords ``gu_kw`` / ``d_kw``; the quantizers and the fp8-layout repack
    of schedules/mxfp8_act.py) into ``d / "moe_mxfp8.so"``."""
    from schedules import moe_mxfp4_cuda as mc
    from schedules import moe_mxfp4_decode_tc as dt
    from schedules import mxfp8_act as A8

    _compile({"moe_expert_chain": mc.moe_expert_chain_kernel(TOPK),
              "mxfp8_quantize_z": A8.quantize_kernel(L),
              "moe_mxfp4_gate_up": dt.moe_mxfp4_gate_up_tc_kernel(E, L, I, TOPK, BETA, BETA_LIN, act="mxfp8",
                                                                  **(gu_kw or {})),
              "mxfp8_quantize_a": A8.quantize_kernel(I),
              "moe_mxfp4_down": dt.moe_mxfp4_down_tc_kernel(E, L, I, TOPK, act="mxfp8", **(d_kw or {})),
              "repack_fp8": A8.repack_kernel(gpu=True)}, d / "moe_mxfp8.so")


PREFILL_FUNCS = ("moe_sort", "moe_grouped_gate_up", "moe_grouped_down")
# mma.sync schedule variants besides the defaults of schedules.moe_mxfp4_prefill_cuda (none now:
# stages 2 / 4 and warps_m 4 were slower, moe_prefill_variants_h200_2026-11-29.json)
PREFILL_VARIANTS = {}
# wgmma variants besides the dispatched build (warp-specialized from WS_MIN_PAIRS_PER_EXPERT pairs
# per expert, schedules/moe_plan.py): name -> (gate_up kwargs, down kwargs). Slower and removed:
# stages 3, short_tiles=False (moe_prefill_wgmma_final_h200_2026-11-30.json), 256 weight rows or
# 256 token rows per block (moe_prefill_r256_ / moe_prefill_t256_h200_2026-11-30.json)
WGMMA_VARIANTS = {"plain": ({"warp_specialized": False}, {"warp_specialized": False}),
                  "ws": ({"warp_specialized": True}, {"warp_specialized": True}),
                  # few tokens per expert (prefill chunks of 256-2048 tokens): 32- or 64-row tiles,
                  # deeper cp.async pipelines (the plain form reads weights at ~1.6 TB/s there)
                  **{f"bm{bm}_s{st}": ({"warp_specialized": False, "bm": bm, "stages": st},
                                       {"warp_specialized": False, "bm": bm, "stages": st})
                     for bm, st in ((32, 6), (32, 10), (64, 8))}}


def _variant_bm(gu_kw: dict, pairs: int) -> int:
    """Token rows per tile (the sort's bm) of a wgmma build with gate_up kwargs ``gu_kw`` at
    ``pairs`` token-expert pairs."""
    from schedules.moe_plan import BM, BM_WS, tile_rows, warp_specialized_shapes

    ws = gu_kw.get("warp_specialized", "auto")
    return tile_rows(pairs, E, warp_specialized_shapes(L, I)) if ws == "auto" else (BM_WS if ws else gu_kw.get("bm", BM))


WGMMA = "wgmma"  # prefill libraries whose name holds this read z and a_sorted in the permuted k order
SMALL = (3, 512, 512, 2)  # E, L, I, top_k of tests/gpu/check_moe_dispatch.py's model


def build_prefill(out_dir: Path) -> None:
    """The prefill pipeline (schedules/moe_mxfp4_prefill_cuda.py) into ``moe_prefill.so``, its
    schedule variants into ``moe_prefill_<variant>.so`` and the :data:`SMALL` shapes into
    ``moe_prefill_small.so``."""
    from schedules import moe_mxfp4_prefill_cuda as mp

    def kernels(e, l_, i_, k, **kw):
        return {"moe_sort": mp.moe_sort_kernel(e, k),
                "moe_grouped_gate_up": mp.moe_grouped_gate_up_kernel(e, l_, i_, k, BETA, BETA_LIN, **kw),
                "moe_grouped_down": mp.moe_grouped_down_kernel(e, l_, i_, k, **kw)}

    from schedules import moe_mxfp4_prefill_wgmma as mw

    def wgmma_kernels(e, l_, i_, k, gu_kw=None, d_kw=None):
        """Hopper wgmma kernels (activations in the permuted k order; the run permutes z), with
        the sort whose tile table they read."""
        gu_kw, d_kw = gu_kw or {}, d_kw or {}
        return {"moe_sort": mw.moe_sort_wgmma_kernel(e, l_, i_, k, gu_kw.get("warp_specialized", "auto"),
                                                     gu_kw.get("bm", 128)),
                "moe_grouped_gate_up": mw.moe_grouped_gate_up_wgmma_kernel(e, l_, i_, k, BETA, BETA_LIN, **gu_kw),
                "moe_grouped_down": mw.moe_grouped_down_wgmma_kernel(e, l_, i_, k, **d_kw)}

    _compile(kernels(E, L, I, TOPK), out_dir / "moe_prefill.so")
    _compile(wgmma_kernels(E, L, I, TOPK), out_dir / f"moe_prefill_{WGMMA}.so")
    for name, (gu_kw, d_kw) in WGMMA_VARIANTS.items():
        _compile(wgmma_kernels(E, L, I, TOPK, gu_kw, d_kw), out_dir / f"moe_prefill_{WGMMA}_{name}.so")
    for name, kw in PREFILL_VARIANTS.items():  # timed in the same run
        _compile(kernels(E, L, I, TOPK, **kw), out_dir / f"moe_prefill_{name}.so")
    _compile(kernels(*SMALL), out_dir / "moe_prefill_small.so")
    for name, ws in (("", "auto"), ("_ws", True)):  # SMALL's widths (512) have the warp-specialized form
        kw = {"warp_specialized": ws}
        _compile(wgmma_kernels(*SMALL, kw, kw), out_dir / f"moe_prefill_small_{WGMMA}{name}.so")


def random_experts(num_experts: int, latent: int, inter: int, device, generator=None) -> dict:
    """Random MXFP4 experts ``{"w1"|"w3"|"w2": (packed uint8 [E, N, K/2], scale uint8
    [E, N, K/32])}``: uniform codes, E8M0 scales 121..126 (2^-6..2^-1)."""
    import torch

    return {n: (torch.randint(0, 256, (num_experts, r, c // 2), dtype=torch.uint8, device=device,
                              generator=generator),
                torch.randint(121, 127, (num_experts, r, c // 32), dtype=torch.uint8, device=device,
                              generator=generator))
            for n, (r, c) in (("w1", (inter, latent)), ("w3", (inter, latent)), ("w2", (latent, inter)))}


def tc_layout(W: dict, repack) -> dict:
    """Copies of the experts ``W`` with the codes permuted into the tc layout on the GPU by
    ``repack`` (repack.so's in-place kernel), as TVM tensors: ``{name: [packed, scale]}``."""
    import tvm

    out = {}
    for n, (p, s) in W.items():
        q = p.clone()
        repack(tvm.runtime.from_dlpack(q))
        out[n] = [tvm.runtime.from_dlpack(q), tvm.runtime.from_dlpack(s)]
    return out


def dequant_mxfp4(packed, scale):
    """torch MXFP4 dequant (OCP layout: low nibble first; spec §2 "MXFP4"): [..., N, K/2]
    uint8 codes + [..., N, K/32] E8M0 bytes -> [..., N, K] fp32."""
    import torch

    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                       device=packed.device)
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).long()
    sc = torch.exp2(scale.float() - 127).repeat_interleave(32, -1)
    return lut[codes] * sc


def situ(g, u, beta: float = BETA, beta_lin: float = BETA_LIN):
    """torch SiTU-GLU (spec §3): ``beta·tanh(g/beta)·sigmoid(g) · beta_lin·tanh(u/beta_lin)``,
    in the inputs' dtype (fp32 here)."""
    import torch

    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))


def run(lib_dir: Path, decode: bool = True, prefill: bool = True) -> dict:
    import torch
    import tvm

    from k3_compile.device_code import load_cuda_runtime

    load_cuda_runtime()

    def load(d):
        lib = tvm.runtime.load_module(str(d / "moe_mxfp4.so"))
        return tuple(lib[n] for n in FUNCS)

    chain_f, gu_f, down_f = load(lib_dir) if decode else (None, None, None)
    repack = tvm.runtime.load_module(str(lib_dir / "repack.so"))["repack"]
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    W = random_experts(E, L, I, dev, g)
    # the checkpoint layout (CUDA-core GEMVs) and the tc layout (tensor-core kernels)
    tw_ocp = {k: [tvm.runtime.from_dlpack(t) for t in v] for k, v in W.items()}
    tw_tc = tc_layout(W, repack)
    torch.cuda.synchronize()
    tw = tw_tc  # the dispatched kernels'
    expert_bytes = sum(p[0].numel() + p[1].numel() for p in W.values()) // E
    results = {"copy_bandwidth_GBps": bw / 1e9, "expert_bytes": expert_bytes, "check": [], "timing": []}

    def make(T, fns=None, tw=tw, like=None):
        """Inputs and outputs for ``T`` tokens (those of ``like``, an earlier ``make``'s
        ``ours``, when given) and the calls of one build (``fns``) on them."""
        c_f, g_f, d_f = fns or (chain_f, gu_f, down_f)
        if like is not None:
            z, ids, chain, a, o = like.tensors
        else:
            z = torch.randn(T, L, device=dev, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:TOPK] for _ in range(T)]).int()
            chain = torch.empty(T, TOPK, 2, dtype=torch.int32, device=dev)
            # NaN-filled: an output the kernels never write fails the checks
            a = torch.full((T, TOPK, I), float("nan"), dtype=torch.bfloat16, device=dev)
            o = torch.full((T, TOPK, L), float("nan"), dtype=torch.bfloat16, device=dev)
        tv = [tvm.runtime.from_dlpack(t) for t in (z, ids, chain, a, o)]

        parts = {"chain": lambda: c_f(tv[1], tv[2]),
                 "gate_up": lambda: g_f(tv[0], *tw["w1"], *tw["w3"], tv[2], tv[1], tv[3]),
                 "down": lambda: d_f(tv[3], *tw["w2"], tv[2], tv[1], tv[4])}

        def ours():
            for f in parts.values():
                f()

        ours.parts = parts
        ours.chain = chain
        ours.tensors = (z, ids, chain, a, o)
        return z, ids, a, o, ours

    def check(T, fns=None, tw=tw):
        z, ids, a, o, ours = make(T, fns, tw)
        if T == 7:  # repeated experts across tokens exercise the chains
            ids[3] = ids[0]
            ids[5, :4] = ids[1, 4:8]
        if T == 20:  # one expert chosen by every token: a chain of 20 entries (3 passes of 8)
            e0, first = ids[0, 0].clone(), ids[:, 0].clone()
            ids[:, 0] = e0
            # where a token already had e0 elsewhere, it gets its old first choice there
            ids[:, 1:] = torch.where(ids[:, 1:] == e0, first[:, None], ids[:, 1:])
        ours()
        torch.cuda.synchronize()
        ea = eo = ma = mo = 0.0
        for t in range(T):
            for j in range(TOPK):
                e = int(ids[t, j])
                w1, w3, w2 = (dequant_mxfp4(W[n][0][e], W[n][1][e]) for n in ("w1", "w3", "w2"))
                gg = (w1 @ z[t].float()).bfloat16().float()
                uu = (w3 @ z[t].float()).bfloat16().float()
                ar = situ(gg, uu).bfloat16()
                orf = (w2 @ ar.float()).bfloat16().float()
                ea = worst(ea, (a[t, j].float() - ar.float()).abs().max().item())
                eo = worst(eo, (o[t, j].float() - orf).abs().max().item())
                ma, mo = max(ma, ar.float().abs().max().item()), max(mo, orf.abs().max().item())
        return {"T": T, "max_abs_err_a": ea, "max_abs_a": ma, "rel_err_a": ea / ma,
                "max_abs_err_o": eo, "max_abs_o": mo, "rel_err_o": eo / mo}

    def check_chain(T):
        """The chain kernel against its definition in torch (first entry of each expert; the
        next entry with the same expert, or -1), at token counts that span several of its
        shared-memory tiles."""
        z, ids, a, o, ours = make(T)
        ids[T // 2:, :] = ids[:T - T // 2, :]  # repeats: chains across the tiles
        ours.parts["chain"]()
        torch.cuda.synchronize()
        flat = ids.reshape(-1).long()
        n = flat.numel()
        eq = flat[:, None] == flat[None, :]
        j = torch.arange(n, device=dev)
        first = ~(eq & (j[None, :] < j[:, None])).any(1)
        nxt = torch.where(eq & (j[None, :] > j[:, None]), j[None, :], n).min(1).values
        nxt = torch.where(nxt == n, -1, nxt)
        got = ours.chain.reshape(n, 2).long()
        return {"T": T, "entries": n, "first_mismatches": int((got[:, 0] != first.long()).sum()),
                "next_mismatches": int((got[:, 1] != nxt).sum())}

    for T in (CHAIN_T if decode else ()):
        row = check_chain(T)
        results.setdefault("chain_check", []).append(row)
        print(json.dumps(row), flush=True)
    for T in (CHECK_T if decode else ()):
        row = check(T)
        results["check"].append(row)
        print(json.dumps(row), flush=True)

    # other schedule variants (subfolders of lib_dir): checks, then timings interleaved with
    # the default's on the same inputs (AB_ROUNDS rounds in rotating order, medians): runs
    # differ by a few percent from one another, a variant and the default in one round do not
    results["variants"] = {}
    variants = {}
    for d in sorted(p for p in lib_dir.iterdir() if decode and (p / "moe_mxfp4.so").exists()):
        fns = load(d)
        tw_d = tw_ocp if (d / OCP_MARKER).exists() else tw_tc
        variants[d.name] = (fns, tw_d)
        results["variants"][d.name] = {"check_T7": check(7, fns, tw_d), "check_T20": check(20, fns, tw_d),
                                       "timing": []}
    for T in (TIME_T if variants else ()):
        z, ids, a, o, base = make(T)
        calls = {"default": base, **{n: make(T, f, t, like=base)[-1] for n, (f, t) in variants.items()}}
        roof = torch.unique(ids).numel() * expert_bytes / bw * 1e3
        samples = {n: [] for n in calls}
        names = list(calls)
        for r in range(AB_ROUNDS):
            for n in names[r % len(names):] + names[:r % len(names)]:
                samples[n].append(time_cuda_graph(calls[n]))
        med = {n: sorted(v)[len(v) // 2] for n, v in samples.items()}
        for n in variants:
            results["variants"][n]["timing"].append({
                "T": T, "ours_graph_ms": med[n], "ours_pct_roofline_graph": 100 * roof / med[n],
                "default_graph_ms": med["default"], "speed_vs_default": med["default"] / med[n],
                "parts_graph_ms": {k: time_cuda_graph(f) for k, f in calls[n].parts.items()}})
        print(f"T={T} graph ms (median of {AB_ROUNDS} interleaved rounds):",
              json.dumps({n: round(v, 5) for n, v in med.items()}), flush=True)
    for n, rows in results["variants"].items():
        print(n, json.dumps(rows), flush=True)

    for d in sorted(lib_dir.glob(MXFP8_DIR + "*")) if decode else ():  # the W4A8 build(s)
        if (d / "moe_mxfp8.so").exists():
            results[d.name] = run_mxfp8(d, W, (chain_f, gu_f, down_f), tw_tc, bw, expert_bytes, g)

    # dequantized bf16 copies of all experts for the torch loop
    Wb = {}
    for n, (p, s) in W.items():
        Wb[n] = torch.empty(E, p.shape[1], p.shape[2] * 2, dtype=torch.bfloat16, device=dev)
        for e0 in range(0, E, 32):
            Wb[n][e0:e0 + 32] = dequant_mxfp4(p[e0:e0 + 32], s[e0:e0 + 32]).bfloat16()
    torch.cuda.synchronize()

    for T in (TIME_T if decode else ()):
        z, ids, a, o, ours = make(T)
        distinct = torch.unique(ids).numel()
        ours_ms = time_cuda(ours, iters=20, warmup=3)
        ours_graph_ms = time_cuda_graph(ours)
        ours()  # the chain the parts read
        torch.cuda.synchronize()
        # each kernel alone (graph replays; inputs as left by a full step), and its share of
        # the roofline: W1/W3 move 2/3 of the expert bytes (w1, w3 vs w2: 2 x L x I each)
        parts_ms = {n: time_cuda_graph(f) for n, f in ours.parts.items()}
        groups = {}
        for t in range(T):
            for j in range(TOPK):
                groups.setdefault(int(ids[t, j]), []).append((t, j))
        gl = [(e, torch.tensor([t for t, _ in v], device=dev), torch.tensor([j for _, j in v], device=dev))
              for e, v in groups.items()]
        out = torch.empty(T, TOPK, L, dtype=torch.bfloat16, device=dev)

        def torch_loop():
            for e, tt, jj in gl:
                x = z[tt]
                gg = x @ Wb["w1"][e].T
                uu = x @ Wb["w3"][e].T
                aa = situ(gg.float(), uu.float()).bfloat16()
                out[tt, jj] = aa @ Wb["w2"][e].T

        torch_ms = time_cuda(torch_loop, iters=5, warmup=1, per_sample=2)
        roof_ms = distinct * expert_bytes / bw * 1e3
        row = {"T": T, "distinct_experts": distinct, "ours_ms": ours_ms, "torch_bf16_loop_ms": torch_ms,
               "roofline_ms": roof_ms, "ours_pct_roofline": 100 * roof_ms / ours_ms,
               "torch_pct_roofline": 100 * roof_ms / torch_ms, "speedup_vs_torch": torch_ms / ours_ms,
               "ours_graph_ms": ours_graph_ms, "ours_pct_roofline_graph": 100 * roof_ms / ours_graph_ms,
               "parts_graph_ms": parts_ms,
               "gate_up_pct_roofline": 100 * roof_ms * 2 / 3 / parts_ms["gate_up"],
               "down_pct_roofline": 100 * roof_ms / 3 / parts_ms["down"]}
        results["timing"].append(row)
        print(json.dumps(row), flush=True)
    if prefill and (lib_dir / "moe_prefill.so").exists():
        results["prefill"] = run_prefill(lib_dir, W, Wb, tw_tc, g, repack)
    elif not decode:
        raise SystemExit(f"--prefill-only: no {lib_dir / 'moe_prefill.so'} (build it with `build`)")
    return results


def _torch_mxfp8(x):
    """torch MXFP8 round trip of ``x [..., K]`` (OCP MX v1.0: shared exponent floor(log2 amax)
    - 8 per 32, biased and clamped to 1..247 as schedules/mxfp8_act.py does; E4M3 nearest-even,
    saturated at ±448) -> ``(codes uint8, scales uint8, fp32 values)``."""
    import torch

    g = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = g.abs().amax(-1)
    s = (((amax.view(torch.int32) >> 23) & 0xFF) - 8).clamp(1, 247)
    scaled = (g * torch.exp2(127.0 - s.float())[..., None]).clamp(-448, 448)
    q = scaled.to(torch.float8_e4m3fn)
    val = (q.float() * torch.exp2(s.float() - 127)[..., None]).reshape(x.shape)
    return q.view(torch.uint8).reshape(x.shape), s.to(torch.uint8), val


def run_mxfp8(d: Path, W: dict, bf16_fns, tw_tc, bw: float, expert_bytes: int, g) -> dict:
    """The W4A8 decode path (chain, z quantizer, MXFP8 gate_up, ``a`` quantizer, MXFP8 down):

    - checks at T = 1, 7, 20 (at 20 one expert is chosen by every token: a chain of 3 passes,
      which exercises the per-pass activation scale rows): the quantizers bit-exact against torch's
      E4M3 (:func:`_torch_mxfp8`); ``a`` and ``o`` against the torch fp32 math on the MXFP8
      values the kernels read (the same rounding points as the bf16 checks); and, as the
      accuracy cost, ``o`` against the bf16-activation reference;
    - timings at :data:`TIME_T` interleaved with the bf16 tensor-core path on the same tokens
      and experts (:data:`AB_ROUNDS` rounds, CUDA-graph medians), and each kernel alone.
    """
    import torch
    import tvm

    lib = tvm.runtime.load_module(str(d / "moe_mxfp8.so"))
    chain_f, qz_f, gu_f, qa_f, dn_f, repack_f = (lib[n] for n in MXFP8_FUNCS)
    dev = torch.device("cuda")
    tw = tc_layout(W, repack_f)   # the fp8 code layout (same helper: an in-place repack of copies)
    torch.cuda.synchronize()
    out = {"check": [], "timing": []}

    def make(T, z=None, ids=None):
        if z is None:
            z = torch.randn(T, L, device=dev, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:TOPK] for _ in range(T)]).int()
        t = {"z": z, "ids": ids, "chain": torch.empty(T, TOPK, 2, dtype=torch.int32, device=dev),
             # filled with what no kernel writes here (E4M3 / E8M0 0xFF is NaN; NaN outputs):
             # an element a kernel misses fails the checks
             "z8": torch.full((T, L), 255, dtype=torch.uint8, device=dev),
             "zs": torch.full((T, L // 32), 255, dtype=torch.uint8, device=dev),
             "a": torch.full((T, TOPK, I), float("nan"), dtype=torch.bfloat16, device=dev),
             "a8": torch.full((T, TOPK, I), 255, dtype=torch.uint8, device=dev),
             "as": torch.full((T, TOPK, I // 32), 255, dtype=torch.uint8, device=dev),
             "o": torch.full((T, TOPK, L), float("nan"), dtype=torch.bfloat16, device=dev)}
        v = {k: tvm.runtime.from_dlpack(x) for k, x in t.items()}
        a2, a82, as2 = (tvm.runtime.from_dlpack(t[k].view(T * TOPK, -1)) for k in ("a", "a8", "as"))
        parts = {"chain": lambda: chain_f(v["ids"], v["chain"]),
                 "quantize_z": lambda: qz_f(v["z"], v["z8"], v["zs"]),
                 "gate_up": lambda: gu_f(v["z8"], v["zs"], *tw["w1"], *tw["w3"], v["chain"], v["ids"], v["a"]),
                 "quantize_a": lambda: qa_f(a2, a82, as2),
                 "down": lambda: dn_f(v["a8"], v["as"], *tw["w2"], v["chain"], v["ids"], v["o"])}

        def step():
            for f in parts.values():
                f()

        step.parts, step.t = parts, t
        return step

    for T in (1, 7, 20):
        step = make(T)
        t = step.t
        if T == 20:  # one expert chosen by every token: a chain of 20 entries (3 passes of 8)
            e0 = t["ids"][0, 0].clone()
            first = t["ids"][:, 0].clone()
            t["ids"][:, 0] = e0
            t["ids"][:, 1:] = torch.where(t["ids"][:, 1:] == e0, first[:, None], t["ids"][:, 1:])
        step()
        torch.cuda.synchronize()
        zq, zs, zv = _torch_mxfp8(t["z"])
        aq, as_, av = _torch_mxfp8(t["a"])
        row = {"T": T, "z_codes_mismatches": int((zq != t["z8"]).sum()) + int((zs != t["zs"]).sum()),
               "a_codes_mismatches": int((aq != t["a8"]).sum()) + int((as_ != t["as"]).sum())}
        ea = eo = ma = mo = e16 = 0.0
        for tt in range(T):
            for j in range(TOPK):
                e = int(t["ids"][tt, j])
                w1, w3, w2 = (dequant_mxfp4(W[n][0][e], W[n][1][e]) for n in ("w1", "w3", "w2"))
                ar = situ((w1 @ zv[tt]).bfloat16().float(), (w3 @ zv[tt]).bfloat16().float()).bfloat16()
                orf = (w2 @ av[tt, j]).bfloat16().float()
                # the bf16-activation reference (what the dispatched W4A16 path computes)
                a16 = situ((w1 @ t["z"][tt].float()).bfloat16().float(),
                           (w3 @ t["z"][tt].float()).bfloat16().float()).bfloat16()
                o16 = (w2 @ a16.float()).bfloat16().float()
                ea = worst(ea, (t["a"][tt, j].float() - ar.float()).abs().max().item())
                eo = worst(eo, (t["o"][tt, j].float() - orf).abs().max().item())
                e16 = worst(e16, (t["o"][tt, j].float() - o16).abs().max().item())
                ma, mo = max(ma, ar.float().abs().max().item()), max(mo, orf.abs().max().item())
        row.update({"max_abs_err_a": ea, "rel_err_a": ea / ma, "max_abs_err_o": eo, "rel_err_o": eo / mo,
                    "rel_diff_o_vs_bf16_activations": e16 / mo})
        out["check"].append(row)
        print(d.name, json.dumps(row), flush=True)

    c_b, g_b, d_b = bf16_fns
    for T in TIME_T:
        step = make(T)
        t = step.t
        vb = {k: tvm.runtime.from_dlpack(t[k]) for k in ("z", "ids", "chain", "a", "o")}

        def bf16_path():
            c_b(vb["ids"], vb["chain"])
            g_b(vb["z"], *tw_tc["w1"], *tw_tc["w3"], vb["chain"], vb["ids"], vb["a"])
            d_b(vb["a"], *tw_tc["w2"], vb["chain"], vb["ids"], vb["o"])

        calls = {"bf16": bf16_path, "mxfp8": step}
        samples = {n: [] for n in calls}
        for r in range(AB_ROUNDS):
            for n in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                samples[n].append(time_cuda_graph(calls[n]))
        med = {n: sorted(v)[len(v) // 2] for n, v in samples.items()}
        roof = torch.unique(t["ids"]).numel() * expert_bytes / bw * 1e3
        step()
        torch.cuda.synchronize()
        parts = {k: time_cuda_graph(f) for k, f in step.parts.items()}
        row = {"T": T, "bf16_graph_ms": med["bf16"], "mxfp8_graph_ms": med["mxfp8"],
               "speed_mxfp8_vs_bf16": med["bf16"] / med["mxfp8"], "roofline_ms": roof,
               "bf16_pct_roofline": 100 * roof / med["bf16"], "mxfp8_pct_roofline": 100 * roof / med["mxfp8"],
               "mxfp8_parts_graph_ms": parts,
               "mxfp8_gate_up_pct_roofline": 100 * roof * 2 / 3 / parts["gate_up"],
               "mxfp8_down_pct_roofline": 100 * roof / 3 / parts["down"]}
        out["timing"].append(row)
        print(d.name, json.dumps(row), flush=True)
    del tw
    torch.cuda.empty_cache()
    return out


def _permute_k(x):
    """x [rows, K] in the wgmma kernels' permuted k order (schedules/moe_mxfp4_prefill_wgmma.py
    permuted_position: in each 32 inputs, the 4x4 matrix of input pairs transposed; an involution)."""
    return x.view(x.shape[0], -1, 4, 4, 2).transpose(2, 3).reshape(x.shape)


def check_small(path: Path, g, repack, permuted: bool = False) -> list:
    """The :data:`SMALL` shapes (the dispatch check's model): every output vs torch fp32
    (``permuted``: a wgmma build, z and a in the permuted k order)."""
    import torch
    import tvm

    from schedules.moe_plan import max_tiles

    lib = tvm.runtime.load_module(str(path))
    f_sort, f_gu, f_down = (lib[n] for n in PREFILL_FUNCS)
    dev = torch.device("cuda")
    e_, l_, i_, k_ = SMALL
    Ws = random_experts(e_, l_, i_, dev, g)
    tw = tc_layout(Ws, repack)
    rows = []
    for T in (40, 1, 200):
        ids = torch.rand(T, e_, device=dev, generator=g).topk(k_, dim=1).indices.int()
        z = torch.randn(T, l_, device=dev, generator=g).to(torch.bfloat16)
        P = T * k_
        b = dict(counts=torch.full((e_,), -7, dtype=torch.int32, device=dev),
                 tiles=torch.zeros(max_tiles(P, e_, 32), 3, dtype=torch.int32, device=dev),
                 num_tiles=torch.zeros(1, dtype=torch.int32, device=dev),
                 sorted=torch.full((P,), -7, dtype=torch.int32, device=dev),
                 a=torch.zeros(P, i_, dtype=torch.bfloat16, device=dev),
                 o=torch.zeros(T, k_, l_, dtype=torch.bfloat16, device=dev))
        t = {n: tvm.runtime.from_dlpack(v) for n, v in b.items()}
        tz, tids = tvm.runtime.from_dlpack(z), tvm.runtime.from_dlpack(ids)
        f_sort(tids, t["sorted"], t["tiles"], t["num_tiles"], t["counts"])
        if permuted:
            tz = tvm.runtime.from_dlpack(_permute_k(z).contiguous())
        f_gu(tz, *tw["w1"], *tw["w3"], t["sorted"], t["tiles"], t["num_tiles"], t["a"])
        f_down(t["a"], *tw["w2"], *tw["w2"], t["sorted"], t["tiles"], t["num_tiles"], t["o"])
        torch.cuda.synchronize()
        w1, w3, w2 = (dequant_mxfp4(*Ws[n]) for n in ("w1", "w3", "w2"))
        x = z.float()
        gg = torch.einsum("tl,tkil->tki", x, w1[ids.long()]).bfloat16().float()
        uu = torch.einsum("tl,tkil->tki", x, w3[ids.long()]).bfloat16().float()
        ar = situ(gg, uu).bfloat16().float()
        orf = torch.einsum("tki,tkli->tkl", ar, w2[ids.long()]).bfloat16().float()
        inv = torch.empty(P, dtype=torch.long, device=dev)
        inv[b["sorted"].long()] = torch.arange(P, device=dev)
        got_a = b["a"][inv].float()
        got_a = (_permute_k(got_a) if permuted else got_a).reshape(T, k_, i_)
        bad = ((b["o"].float() - orf).abs() > 0.02 * orf.abs().max()).nonzero()
        row = {"T": T, "lib": path.stem, "counts": b["counts"].tolist(),
               "num_tiles": int(b["num_tiles"][0]), "tiles": b["tiles"].tolist()[:8],
               "sorted_head": b["sorted"].tolist()[:12],
               "rel_err_a": ((got_a - ar).abs().max() / ar.abs().max()).item(),
               "rel_err_o": ((b["o"].float() - orf).abs().max() / orf.abs().max()).item(),
               "bad_o": bad[:10].tolist(), "n_bad_o": len(bad)}
        rows.append(row)
        print("prefill small", json.dumps(row), flush=True)
    return rows


# (6400, "uniform"): 102400 pairs, 114 per expert — the dispatched wgmma build's warp-specialized branch
PREFILL_CHECK = ((37, "skewed"), (300, "hot"), (1, "uniform"), (6400, "uniform"))
PREFILL_T = (8192, 2048, 1024, 512, 256)  # 512: the runtime's default prefill chunk
PREFILL_ROUNDS = 3  # interleaved timing rounds of every prefill build and torch._grouped_mm


def run_prefill(lib_dir: Path, W, Wb, tw, g, repack) -> dict:
    """Prefill: correctness of the permutation and grouped GEMMs (experts with 0, 1 and many
    tokens), then timing at 8192 / 2048 tokens against torch._grouped_mm (bf16 weights) and
    the measured bf16 tensor-core peak; schedule variants are checked against the default's
    output and timed in the same run."""
    import torch
    import tvm

    from schedules.moe_plan import BM, max_tiles, moe_prefill_plan_reference

    lib = tvm.runtime.load_module(str(lib_dir / "moe_prefill.so"))
    f_sort0, f_gu0, f_down0 = (lib[n] for n in PREFILL_FUNCS)
    wg_path = lib_dir / f"moe_prefill_{WGMMA}.so"
    flavors = {"mma_sync": (None, False, None)}  # name -> (functions, permuted k order, wgmma gate_up kwargs)
    if wg_path.exists():
        wl = tvm.runtime.load_module(str(wg_path))
        flavors[WGMMA] = (tuple(wl[n] for n in PREFILL_FUNCS), True, {})
    for name in WGMMA_VARIANTS:  # every wgmma variant through the same checks
        vp = lib_dir / f"moe_prefill_{WGMMA}_{name}.so"
        if vp.exists():
            vl = tvm.runtime.load_module(str(vp))
            flavors[f"{WGMMA}_{name}"] = (tuple(vl[n] for n in PREFILL_FUNCS), True, WGMMA_VARIANTS[name][0])
    dev = torch.device("cuda")
    res = {"check": [], "timing": []}
    if (lib_dir / "moe_prefill_small.so").exists():
        res["check_small"] = check_small(lib_dir / "moe_prefill_small.so", g, repack)
    for sp in sorted(lib_dir.glob(f"moe_prefill_small_{WGMMA}*.so")):  # the wgmma builds, as dispatched and ws
        res.setdefault("check_small", []).extend(check_small(sp, g, repack, permuted=True))

    def routing(T, kind):
        if kind == "uniform":
            return torch.rand(T, E, device=dev, generator=g).topk(TOPK, dim=1).indices.int()
        ids = torch.rand(T, E, device=dev, generator=g).topk(TOPK, dim=1).indices.int()
        if kind == "skewed":      # few experts: many with 0 tokens, some with > 128
            ids = torch.stack([torch.randperm(40, device=dev, generator=g)[:TOPK] for _ in range(T)]).int()
            ids[0, 0] = 777       # an expert with exactly one token (777 never otherwise)
        if kind == "hot":         # expert 5 in every token's list: 300 rows = 3 tiles
            ids[:, 0] = 5
            ids[:, 1:] = torch.where(ids[:, 1:] == 5, torch.full_like(ids[:, 1:], 6), ids[:, 1:])
            ids[:, 1:] = torch.where(ids[:, 1:] == 6, torch.full_like(ids[:, 1:], 7), ids[:, 1:])
        return ids

    def pipeline(T, ids, z, fns=None, permuted=False):
        f_sort, f_gu, f_down = fns or (f_sort0, f_gu0, f_down0)
        P = T * TOPK
        mt = max_tiles(P, E, 32)  # the bound for the smallest tile rows any variant uses (bm 32)
        bufs = dict(
            counts=torch.empty(E, dtype=torch.int32, device=dev),
            tiles=torch.empty(mt, 3, dtype=torch.int32, device=dev),
            num_tiles=torch.empty(1, dtype=torch.int32, device=dev),
            sorted=torch.empty(P, dtype=torch.int32, device=dev),
            # NaN: an output a kernel leaves unwritten fails the checks
            a=torch.full((P, I), float("nan"), dtype=torch.bfloat16, device=dev),
            o=torch.full((T, TOPK, L), float("nan"), dtype=torch.bfloat16, device=dev),
        )
        tv = {k: tvm.runtime.from_dlpack(v) for k, v in bufs.items()}
        tz, tids = tvm.runtime.from_dlpack(z), tvm.runtime.from_dlpack(ids)

        def route():
            f_sort(tids, tv["sorted"], tv["tiles"], tv["num_tiles"], tv["counts"])

        zp = torch.empty_like(z) if permuted else None
        tzp = tvm.runtime.from_dlpack(zp) if permuted else None

        def gemms():
            if permuted:
                zp.copy_(_permute_k(z))
            f_gu(tzp if permuted else tz, *tw["w1"], *tw["w3"], tv["sorted"], tv["tiles"], tv["num_tiles"], tv["a"])
            f_down(tv["a"], *tw["w2"], *tw["w2"], tv["sorted"], tv["tiles"], tv["num_tiles"], tv["o"])

        return bufs, route, gemms

    inputs = {}
    for (T, kind), (flavor, (fns, permuted, gu_kw)) in itertools.product(PREFILL_CHECK, flavors.items()):
        # the same routing and tokens for both kernel families
        if (T, kind) not in inputs:
            inputs[T, kind] = (routing(T, kind), torch.randn(T, L, device=dev, generator=g).to(torch.bfloat16), {})
        ids, z, outs = inputs[T, kind]
        bufs, route, gemms = pipeline(T, ids, z, fns, permuted)
        route()
        gemms()
        torch.cuda.synchronize()
        bm = BM if gu_kw is None else _variant_bm(gu_kw, T * TOPK)
        counts, _, tiles, order = moe_prefill_plan_reference(ids.cpu().numpy(), E, bm)
        nt = int(bufs["num_tiles"][0])
        plan_ok = (bool((bufs["counts"].cpu().numpy() == counts).all())
                   and nt == len(tiles) and bool((bufs["tiles"][:nt].cpu().numpy() == tiles).all()))
        srt = bufs["sorted"].cpu().numpy()
        flat = ids.cpu().numpy().reshape(-1)
        perm_ok = (sorted(srt.tolist()) == list(range(T * TOPK))
                   and bool((flat[srt] == flat[order]).all()))
        ea = eo = ma = mo = 0.0
        inv = torch.empty(T * TOPK, dtype=torch.long, device=dev)
        inv[bufs["sorted"].long()] = torch.arange(T * TOPK, device=dev)
        for e in torch.unique(ids).tolist():
            tt, jj = (ids == e).nonzero(as_tuple=True)
            w1, w3, w2 = (dequant_mxfp4(W[n][0][e], W[n][1][e]) for n in ("w1", "w3", "w2"))
            x = z[tt].float()
            gg = (x @ w1.T).bfloat16().float()
            uu = (x @ w3.T).bfloat16().float()
            ar = situ(gg, uu).bfloat16().float()
            orf = (ar @ w2.T).bfloat16().float()
            got_a = bufs["a"][inv[tt * TOPK + jj]].float()
            if permuted:  # back to the natural k order (the permutation is an involution)
                got_a = _permute_k(got_a)
            ea = worst(ea, (got_a - ar).abs().max().item())
            eo = worst(eo, (bufs["o"][tt, jj].float() - orf).abs().max().item())
            ma, mo = max(ma, ar.abs().max().item()), max(mo, orf.abs().max().item())
        row = {"T": T, "routing": kind, "kernels": flavor, "plan_ok": plan_ok, "permutation_ok": perm_ok,
               "max_tokens_per_expert": int(counts.max()), "experts_with_one_token": int((counts == 1).sum()),
               "rel_err_a": ea / ma, "rel_err_o": eo / mo, "max_abs_err_o": eo, "max_abs_o": mo}
        # a (per pair, natural k order) and o against the first family's on the same inputs
        a_pairs = bufs["a"][inv].float()
        outs[flavor] = (_permute_k(a_pairs) if permuted else a_pairs, bufs["o"].float().clone())
        first = next(iter(outs))
        if flavor != first:
            row[f"max_abs_diff_a_vs_{first}"] = (outs[flavor][0] - outs[first][0]).abs().max().item()
            row[f"max_abs_diff_o_vs_{first}"] = (outs[flavor][1] - outs[first][1]).abs().max().item()
        res["check"].append(row)
        print("prefill check", json.dumps(row), flush=True)

    # bf16 tensor-core peak (torch.matmul), for the ratio
    xa = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    xb = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = time_cuda(lambda: xa @ xb, iters=10, per_sample=5)
    peak = 2 * 8192 ** 3 / (ms / 1e3) / 1e12
    res["bf16_matmul_peak_tflops"] = peak
    del xa, xb
    print(f"bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = bw / 1e9

    for T in PREFILL_T:
        ids = routing(T, "uniform")
        z = torch.randn(T, L, device=dev, generator=g).to(torch.bfloat16)
        bufs, route, gemms = pipeline(T, ids, z)
        route()
        torch.cuda.synchronize()
        P = T * TOPK
        flop = 2 * P * (2 * I * L + L * I)
        t_route = time_cuda(route, iters=10, per_sample=3)
        t_gemm = time_cuda(gemms, iters=5, per_sample=2, warmup=1)
        t_gu = time_cuda(lambda: f_gu0(tvm.runtime.from_dlpack(z), *tw["w1"], *tw["w3"],
                                      *(tvm.runtime.from_dlpack(bufs[k]) for k in ("sorted", "tiles", "num_tiles", "a"))),
                         iters=5, per_sample=2, warmup=1)
        # HBM time of the weights of every expert hit (codes + E8M0 scales of W1, W3, W2): the
        # bound where experts get few tokens each
        hit = int(torch.unique(ids).numel())
        w_ms = hit * 3 * I * L * (1 / 2 + 1 / 32) / bw * 1e3
        row = {"T": T, "pairs": P, "gflop": flop / 1e9, "experts_hit": hit, "weights_hbm_ms": w_ms,
               "ours_route_ms": t_route, "ours_gemms_ms": t_gemm,
               "ours_gate_up_ms": t_gu, "ours_down_ms": t_gemm - t_gu,
               "ours_tflops": flop / (t_gemm / 1e3) / 1e12}
        row["ours_pct_peak"] = 100 * row["ours_tflops"] / peak
        # every prefill build (variants included), each with its own tile table (its sort's bm may
        # differ; sorted outside the timing), sharing a and o
        runs = {}
        for vp in sorted(p for p in lib_dir.glob("moe_prefill_*.so") if not p.stem.startswith("moe_prefill_small")):
            vl = tvm.runtime.load_module(str(vp))
            tv = {k: tvm.runtime.from_dlpack(bufs[k]) for k in ("a", "o")}
            vb = {k: torch.empty_like(bufs[k]) for k in ("sorted", "tiles", "num_tiles", "counts")}
            tv.update({k: tvm.runtime.from_dlpack(v) for k, v in vb.items()})
            vl["moe_sort"](tvm.runtime.from_dlpack(ids), tv["sorted"], tv["tiles"], tv["num_tiles"], tv["counts"])
            permuted = WGMMA in vp.stem
            zp = torch.empty_like(z)
            tz = tvm.runtime.from_dlpack(zp if permuted else z)

            def v_gemms(v_gu=vl["moe_grouped_gate_up"], v_down=vl["moe_grouped_down"], tv=tv, tz=tz, zp=zp,
                        permuted=permuted):
                if permuted:  # timed with the permutation of z (in the model: a fused reshape)
                    zp.copy_(_permute_k(z))
                v_gu(tz, *tw["w1"], *tw["w3"], tv["sorted"], tv["tiles"], tv["num_tiles"], tv["a"])
                v_down(tv["a"], *tw["w2"], *tw["w2"], tv["sorted"], tv["tiles"], tv["num_tiles"], tv["o"])

            # same inputs, same k order per output: the build must give the mma.sync kernels' output
            # (a and o NaN first, so that an output the build leaves unwritten shows)
            gemms()
            ref_o = bufs["o"].clone()
            bufs["a"].fill_(float("nan"))
            bufs["o"].fill_(float("nan"))
            v_gemms()
            torch.cuda.synchronize()
            row.setdefault("variants_max_abs_diff", {})[vp.stem] = (bufs["o"].float() - ref_o.float()).abs().max().item()
            runs[vp.stem] = v_gemms
        # torch._grouped_mm, bf16 weights, tokens sorted by expert beforehand (not timed)
        try:
            order = torch.argsort(ids.reshape(-1), stable=True)
            cnt = torch.bincount(ids.reshape(-1).long(), minlength=E)
            offs = torch.cumsum(cnt, 0).int()
            xs = z[order // TOPK].contiguous()
            w1t, w3t, w2t = (Wb[n].transpose(1, 2) for n in ("w1", "w3", "w2"))

            def torch_gemms():
                gg = torch._grouped_mm(xs, w1t, offs=offs)
                uu = torch._grouped_mm(xs, w3t, offs=offs)
                aa = situ(gg.float(), uu.float()).bfloat16()
                return torch._grouped_mm(aa, w2t, offs=offs)

            # same math, so the outputs agree up to bf16 rounding
            gemms()
            ref = torch_gemms()
            got = bufs["o"].reshape(P, L)[order]
            row["rel_diff_vs_torch"] = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            runs["torch_grouped_mm"] = torch_gemms
        except Exception as exc:  # noqa: BLE001 - keep our numbers if torch lacks the op
            row["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
        # timed interleaved, PREFILL_ROUNDS rounds, medians: identical kernels timed one after
        # the other differed by up to 5% with their order
        samples = {name: [] for name in runs}
        for _ in range(PREFILL_ROUNDS):
            for name, fn in runs.items():
                samples[name].append(time_cuda(fn, iters=5, per_sample=2, warmup=1))
        med = {name: statistics.median(v) for name, v in samples.items()}
        row["variants_gemms_ms"] = {k: v for k, v in med.items() if k != "torch_grouped_mm"}
        row["variants_gemms_ms_rounds"] = samples
        if "torch_grouped_mm" in med:
            t_torch = med["torch_grouped_mm"]
            row.update({"torch_grouped_mm_ms": t_torch, "torch_tflops": flop / (t_torch / 1e3) / 1e12,
                        "speedup_vs_torch_grouped_mm": t_torch / t_gemm})
        # what cuda-sm90a dispatches (the wgmma build; warp-specialized from WS_MIN_PAIRS_PER_EXPERT)
        t_wg = row.get("variants_gemms_ms", {}).get(f"moe_prefill_{WGMMA}")
        if t_wg:
            row.update({"dispatched_sm90a_ms": t_wg, "dispatched_sm90a_tflops": flop / (t_wg / 1e3) / 1e12,
                        "dispatched_sm90a_pct_peak": 100 * flop / (t_wg / 1e3) / 1e12 / peak,
                        "dispatched_sm90a_form": {BM: "plain", 32: "small_tiles"}.get(_variant_bm({}, P),
                                                                                       "warp_specialized")})
            if "torch_grouped_mm_ms" in row:
                row["dispatched_sm90a_speedup_vs_torch_grouped_mm"] = row["torch_grouped_mm_ms"] / t_wg
        res["timing"].append(row)
        print("prefill timing", json.dumps(row), flush=True)
    return res


def _plot(res: dict, path: Path) -> None:
    """Decode: % of the HBM roofline per token count; prefill: TFLOP/s vs torch._grouped_mm
    and the measured bf16 peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pre = res.get("prefill", {}).get("timing", [])
    panels = [p for p in (("decode", res.get("timing")), ("prefill", pre)) if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    w = 0.38
    for ax, (kind, rows) in zip(axes[0], panels):
        xs = [str(r["T"]) for r in rows]
        idx = list(range(len(xs)))
        if kind == "decode":
            ours, other = [r["ours_pct_roofline"] for r in rows], [r["torch_pct_roofline"] for r in rows]
            ax.set_ylabel("% of HBM roofline (distinct experts, MXFP4 bytes)")
            ax.set_title("K3 MoE experts decode, H200")
            labels = ("k3-compile MXFP4 TIR", "torch bf16 loop")
        else:  # what cuda-sm90a dispatches (the mma.sync kernels where no wgmma build ran)
            ours = [r.get("dispatched_sm90a_tflops", r["ours_tflops"]) for r in rows]
            other = [r.get("torch_tflops", 0.0) for r in rows]
            ax.axhline(res["prefill"]["bf16_matmul_peak_tflops"], color="gray", ls="--",
                       label="bf16 matmul peak (torch)")
            ax.set_ylabel("TFLOP/s (routed experts, 3 GEMMs)")
            ax.set_title("K3 MoE experts prefill, H200")
            labels = ("k3-compile MXFP4 grouped GEMMs (cuda-sm90a dispatch)", "torch._grouped_mm bf16")
        ax.bar([i - w / 2 for i in idx], ours, w, label=labels[0])
        ax.bar([i + w / 2 for i in idx], other, w, label=labels[1])
        ax.set_xticks(idx, xs)
        ax.set_xlabel("tokens (top-16 each)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out_dir", type=Path)
    b.add_argument("--prefill-only", action="store_true", help="skip the decode kernels")
    r = sub.add_parser("run")
    r.add_argument("lib_dir", type=Path)
    r.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    r.add_argument("--prefill-only", action="store_true", help="skip the decode kernels")
    r.add_argument("--decode-only", action="store_true", help="skip the prefill kernels")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.out_dir, decode=not args.prefill_only)
        return 0
    import torch

    res = run(args.lib_dir, decode=not args.prefill_only, prefill=not args.decode_only)
    res.update({"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                "commit": git_commit(), "shapes": {"E": E, "L": L, "I": I, "top_k": TOPK}})
    args.out.mkdir(parents=True, exist_ok=True)
    name = "moe_prefill_h200" if args.prefill_only else "moe_h200"
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))
    try:
        _plot(res, args.out / f"{name}.png")
    except Exception as exc:  # noqa: BLE001 - keep the JSON if matplotlib is missing
        print(f"plot failed: {exc}")
    bad = failures(res)
    for line in bad:
        print(f"FAILED: {line}")
    return 1 if bad else 0


REL_TOL = 0.02  # of the largest |value|: a bf16 rounding step is at most 0.4% of it


def failures(res: dict) -> list[str]:
    """Every correctness check of a ``run`` result that failed, as lines (empty: all passed)."""
    out = []
    decode_rows = [("decode", r) for r in res.get("check", [])]
    decode_rows += [(f"decode variant {n}", v[c]) for n, v in res.get("variants", {}).items()
                    for c in ("check_T7", "check_T20") if c in v]
    for r in res.get("chain_check", []):
        if r["first_mismatches"] or r["next_mismatches"]:
            out.append(f"chain T={r['T']}: {r['first_mismatches']} first / {r['next_mismatches']} next mismatches")
    for r in (r for k, v in res.items() if k.startswith(MXFP8_DIR) for r in v.get("check", [])):
        if r["z_codes_mismatches"] or r["a_codes_mismatches"] or not (r["rel_err_a"] <= REL_TOL
                                                                       and r["rel_err_o"] <= REL_TOL):
            out.append(f"mxfp8 T={r['T']}: {r}")
    for what, r in decode_rows:
        if not (r["rel_err_a"] <= REL_TOL and r["rel_err_o"] <= REL_TOL):
            out.append(f"{what} T={r['T']}: rel_err_a {r['rel_err_a']:.3g}, rel_err_o {r['rel_err_o']:.3g}")
    pre = res.get("prefill", {})
    for r in pre.get("check_small", []):
        if r["n_bad_o"] or not r["rel_err_a"] <= REL_TOL:
            out.append(f"prefill small {r.get('lib', '')} T={r['T']}: {r['n_bad_o']} bad outputs, "
                       f"rel_err_a {r['rel_err_a']:.3g}")
    for r in pre.get("check", []):
        if not (r["plan_ok"] and r["permutation_ok"] and r["rel_err_a"] <= REL_TOL and r["rel_err_o"] <= REL_TOL):
            out.append(f"prefill T={r['T']} {r['routing']}: {r}")
        for k, v in r.items():  # the kernel families agree (their fp32 sums run in the same order)
            if k.startswith("max_abs_diff_") and not v <= REL_TOL * 2 ** 14:
                out.append(f"prefill T={r['T']} {r['routing']} {r['kernels']}: {k} = {v}")
    for r in pre.get("timing", []):
        for n, d in r.get("variants_max_abs_diff", {}).items():
            if not d <= REL_TOL * 2 ** 14:  # outputs reach ~1e4 with these weights
                out.append(f"prefill variant {n} T={r['T']}: differs from the mma.sync output by {d}")
        if "rel_diff_vs_torch" in r and not r["rel_diff_vs_torch"] <= REL_TOL:
            out.append(f"prefill T={r['T']}: rel diff vs torch._grouped_mm {r['rel_diff_vs_torch']:.3g}")
    return out


if __name__ == "__main__":
    sys.exit(main())
