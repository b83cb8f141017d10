"""One whole K3 MoE layer at decode, as the compiled model runs it, vs the HBM roofline of
every byte it touches (issue #6's decode measurement).

``benchmarks/moe.py`` times the routed-expert kernels alone. This benchmark compiles the
model's own ``LatentMoE`` block (relax_modules/moe.py: fp32 router, ``routed_expert_down_proj``
7168 -> 3584, the tuned MXFP4 decode kernels, fp32 combine, ``routed_expert_norm``,
``routed_expert_up_proj``, two shared experts at hidden 7168) through the cuda-sm90a pipeline
(k3_compile/build.py: hand-written kernels + dlight schedules for the dense parts) and times it
at 1, 8 and 64 tokens.

Two steps, because the GPU machine has no TVM compiler:

1. Here (with nvcc): ``python benchmarks/moe_layer.py build dist/moe_layer`` (K3 config from
   ``../shared/reference-configs``; ``--config`` to choose) writes ``moe_layer.so`` and
   ``moe_layer.json`` (sizes and parameter list).
2. On the H200: ``python3 benchmarks/moe_layer.py run dist/moe_layer --out $OUT``.

Weights: random, all 896 experts resident in MXFP4 (uniform codes, E8M0 scales 2^-6..2^-1,
permuted into the tc layout by the library's ``repack_expert_codes``); dense weights
N(0, 1/fan_in) in bf16, the routing bias N(0, 0.01²) (it changes the top-k: neighbouring scores
there differ by ~0.005; a larger one concentrates the routing on a few experts), the norm weight
1 + N(0, 0.1²). Two sets of the dense weights alternate between calls, and each call
takes the next of 4 inputs, so no call finds the previous call's weights in L2 (50 MiB).

Check (``CHECK_T``: each branch of the dense projections and its edges; the decode function at
every count, the prefill function from 64 tokens): the layer's output vs a torch reference of spec §3 "MoE block" written here
from the spec (router in fp32, sigmoid, top-k of score + bias, renormalized, × scaling factor;
MXFP4 dequantized in fp32; bf16 rounding where the model rounds), relative to the largest
output.

Timing: CUDA events over back-to-back calls (``layer_ms``: host launch cost included where it
is longer than the GPU work) and a CUDA graph of the calls (``layer_graph_ms``: GPU time).
Roofline = bytes touched / measured device-to-device copy bandwidth; bytes = the dense
weights (router, latent down / up projections, norm, shared experts) + for each distinct
expert its packed codes and scales of w1, w3, w2 (activations, < 0.1% of it, left out; the
distinct experts are counted with the first dense set's router, which half the calls use).
``expert_kernels_us`` is the MXFP4 GEMV kernels' time; the router top-k and expert chain are in
``router_and_chain_us`` and, with the rest, in ``other_kernels_us``.
Prefill (2048, 8192 tokens; timing only, the kernels are checked by benchmarks/moe.py and
tests/gpu/check_moe_dispatch.py): the ``prefill`` function (sort + grouped GEMMs), its kernel
breakdown and cuBLAS on the same dense matmuls.
Per-kernel GPU times come from the torch profiler (CUPTI); the dense part is also timed with
cuBLAS (``torch.nn.functional.linear`` in bf16 on the same weights, CUDA-graph replays) for
comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from cuda_timing import copy_bandwidth, git_commit, rotate, time_cuda, time_cuda_graph
from moe import dequant_mxfp4, situ

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_CONFIG = ROOT.parent / "shared" / "reference-configs" / "kimi-k3.config.json"
TIME_T = (1, 8, 64)
# the prefill path's timing (no check here: benchmarks/moe.py checks its kernels); 512 is the
# runtime's default prefill chunk
PREFILL_T = (512, 2048, 8192)
# the decode path (chain + MXFP4 GEMV kernels) timed at prefill chunk sizes, beside the prefill
# path: which expert kernels a mid-size chunk should take
DECODE_PATH_AT = (256, 512, 1024)
# every branch of the dense projections (GEMV 1-2, decode kernel 3-16, split-K 17-255 with its
# two split counts either side of 32, prefill kernel 256+) with its edges, several token tiles
CHECK_T = (1, 2, 3, 8, 16, 17, 32, 33, 64, 200, 255, 256, 300)
INPUTS = 4       # inputs rotated per T
DENSE_SETS = 2   # dense weight sets alternated
REL_TOL = 0.015  # of the largest |output|: a few bf16 roundings (0.4% each) on the way
PREFIX = "block_sparse_moe."


def build(out_dir: Path, config: Path, low_batch=None) -> None:
    """Export the MoE block of ``config`` (decode path, bf16, tuned CUDA kernels with Hopper
    wgmma) with ``forward(x [n, hidden]) -> [n, hidden]`` and the repack function, compile it
    for cuda-sm90a and write ``moe_layer.so`` + ``moe_layer.json`` into ``out_dir``.
    ``low_batch``: the ``(limit, bucket)`` pairs of the dense matmuls' specialization
    (default: the pipeline's, k3_compile.build.LOW_BATCH)."""
    from tvm.relax.frontend import nn

    from k3_compile.build import build_module
    from k3_compile.config import K3Config
    from k3_compile.pipeline import attach_repack
    from relax_modules.moe import LatentMoE
    from targets import get_target

    cfg = K3Config.from_file(config)

    class MoELayer(nn.Module):
        def __init__(self):
            self.block_sparse_moe = LatentMoE(cfg, "bfloat16", gpu=True, tuned=True, wgmma=True)

        def forward(self, x):
            return self.block_sparse_moe(x, decode=True)

        def prefill(self, x):
            return self.block_sparse_moe(x, decode=False)

    layer = MoELayer()
    if not layer.block_sparse_moe.experts.tuned:
        raise SystemExit(f"{config}: the tuned MXFP4 kernels do not apply to these sizes")
    t0 = time.time()
    mod, params = layer.export_tvm(
        spec={"forward": {"x": nn.spec.Tensor(["n", cfg.hidden_size], "bfloat16")},
              "prefill": {"x": nn.spec.Tensor(["n", cfg.hidden_size], "bfloat16")}})
    mod = attach_repack(mod)
    print(f"exported in {time.time() - t0:.1f} s; compiling for cuda-sm90a", flush=True)
    kw = {} if low_batch is None else {"low_batch": low_batch}
    ex = build_module(mod, get_target("cuda-sm90a"), **kw)
    out_dir.mkdir(parents=True, exist_ok=True)
    ex.export_library(str(out_dir / "moe_layer.so"))
    meta = {
        "config": str(config), "hidden": cfg.hidden_size, "latent": cfg.latent_size,
        "inter": cfg.moe_intermediate_size, "experts": cfg.num_experts,
        "top_k": cfg.num_experts_per_token, "shared": cfg.shared_expert_intermediate_size,
        "eps": cfg.rms_norm_eps, "beta": cfg.activation_situ_beta,
        "beta_lin": cfg.activation_situ_linear_beta, "scaling": cfg.routed_scaling_factor,
        "renormalize": cfg.moe_renormalize, "use_norm": bool(cfg.latent_moe_use_norm),
        "low_batch": low_batch,
        "params": [[n, [int(s) for s in p.shape], p.dtype] for n, p in params],
    }
    (out_dir / "moe_layer.json").write_text(json.dumps(meta, indent=1))
    print(f"built {out_dir / 'moe_layer.so'} in {time.time() - t0:.1f} s")


# ----------------------------------------------------------------------------- reference
def route(x, P, m):
    """Router (spec §3): fp32 logits, sigmoid scores, top-k of score + correction bias;
    weights = the chosen scores renormalized (+1e-20) × scaling factor, rounded to bf16.
    Returns ``ids [T, k]`` int64, ``w [T, k]`` fp32."""
    import torch

    s = torch.sigmoid(x.float() @ P[PREFIX + "gate.weight"].float().T)
    ids = torch.topk(s + P[PREFIX + "gate.e_score_correction_bias"].float(), m["top_k"], dim=-1).indices
    w = s.gather(1, ids)
    if m["renormalize"]:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, (w * m["scaling"]).bfloat16().float()


def reference(x, P, experts_ocp, m):
    """The MoE block in torch (spec §3; bf16 roundings as relax_modules/moe.py documents):
    ``x [T, hidden]`` bf16 -> ``[T, hidden]`` fp32. ``experts_ocp``: expert id ->
    ``{"w1"|"w3"|"w2": (packed, scale)}`` in the checkpoint code layout."""
    import torch

    def lin(a, name):
        return (a.float() @ P[PREFIX + name].float().T).bfloat16()

    ids, w = route(x, P, m)
    z = lin(x, "routed_expert_down_proj.weight")
    y = torch.zeros(x.shape[0], m["latent"], device=x.device)
    for t in range(x.shape[0]):
        for j in range(m["top_k"]):
            ex = experts_ocp[int(ids[t, j])]
            w1, w3, w2 = (dequant_mxfp4(*ex[n]) for n in ("w1", "w3", "w2"))
            g = (w1 @ z[t].float()).bfloat16().float()
            u = (w3 @ z[t].float()).bfloat16().float()
            a = situ(g, u, m["beta"], m["beta_lin"]).bfloat16().float()
            y[t] += w[t, j] * (w2 @ a).bfloat16().float()
    y = y.bfloat16().float()
    if m["use_norm"]:
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + m["eps"])).bfloat16()
        y = (y.float() * P[PREFIX + "routed_expert_norm.weight"].float()).bfloat16()
    y = lin(y, "routed_expert_up_proj.weight")
    sg, su = lin(x, "shared_experts.gate_proj.weight"), lin(x, "shared_experts.up_proj.weight")
    sa = situ(sg.float(), su.float(), m["beta"], m["beta_lin"]).bfloat16()
    return (y.float() + lin(sa, "shared_experts.down_proj.weight").float()).bfloat16().float()


# ----------------------------------------------------------------------------- run
def _random_params(meta, g, dev):
    """Random parameters by name (see the module docstring); returns ``{name: tensor}`` and
    the names of the dense (non-expert) ones."""
    import torch

    P, dense = {}, []
    for name, shape, dtype in meta["params"]:
        if name.endswith("weight_packed"):
            P[name] = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=g)
        elif name.endswith("weight_scale"):
            P[name] = torch.randint(121, 127, shape, dtype=torch.uint8, device=dev, generator=g)
        else:
            dense.append(name)
            P[name] = _dense(name, shape, dtype, g, dev)
    return P, dense


def _dense(name, shape, dtype, g, dev):
    """A random dense parameter ``name`` of ``shape`` / ``dtype`` (see the module docstring)."""
    import torch

    dt = getattr(torch, dtype)
    if name.endswith("e_score_correction_bias"):  # changes the top-k, keeps the routing spread
        return (0.01 * torch.randn(shape, device=dev, generator=g)).to(dt)
    if "norm" in name:
        return (1 + 0.1 * torch.randn(shape, device=dev, generator=g)).to(dt)
    return (torch.randn(shape, device=dev, generator=g) / math.sqrt(shape[-1])).to(dt)


def _cublas_dense(x, S) -> None:
    """The layer's six dense matmuls with cuBLAS (``torch.nn.functional.linear``, bf16) on the
    weights ``S``, for timing only: the router in bf16 and the shared down projection without
    the SiTU before it."""
    import torch

    F = torch.nn.functional
    F.linear(x, S[PREFIX + "gate.weight"])
    zz = F.linear(x, S[PREFIX + "routed_expert_down_proj.weight"])
    F.linear(zz, S[PREFIX + "routed_expert_up_proj.weight"])
    F.linear(x, S[PREFIX + "shared_experts.gate_proj.weight"])
    su = F.linear(x, S[PREFIX + "shared_experts.up_proj.weight"])
    F.linear(su, S[PREFIX + "shared_experts.down_proj.weight"])


def _kernel_times(fn, calls: int) -> dict:
    """GPU microseconds per ``fn()`` call of each kernel name (torch profiler, CUPTI)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0 and e.key:
            out[e.key] = out.get(e.key, 0.0) + t / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def run(lib_dir: Path, decode_only: bool = False) -> dict:
    """Check and time the layer library in ``lib_dir`` (``build``'s output) on the GPU; returns
    the result dict written as JSON (checks, per-T timings, kernel breakdown). ``decode_only``:
    the checks and decode timings only (``prefill`` left empty; no bf16 peak and no
    ``decode_path_at_prefill_sizes``)."""
    import torch
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from k3_compile.device_code import load_cuda_runtime

    load_cuda_runtime()
    meta = json.loads((lib_dir / "moe_layer.json").read_text())
    vm = VirtualMachine(tvm.runtime.load_module(str(lib_dir / "moe_layer.so")), tvm.cuda(0))
    fwd, repack = vm["forward"], vm["repack_expert_codes"]
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    P, dense = _random_params(meta, g, dev)
    sets = [P] + [{**P, **{n: _dense(n, list(P[n].shape), str(P[n].dtype).split(".")[1], g, dev)
                           for n in dense}} for _ in range(DENSE_SETS - 1)]
    names = [n for n, _, _ in meta["params"]]
    dense_bytes = sum(P[n].numel() * P[n].element_size() for n in dense)
    expert_names = {k: (f"{PREFIX}experts.{k}.weight_packed", f"{PREFIX}experts.{k}.weight_scale")
                    for k in ("w1", "w3", "w2")}
    expert_bytes = sum(P[p][0].numel() + P[s][0].numel() for p, s in expert_names.values())
    H = meta["hidden"]
    xs = {T: [torch.randn(T, H, device=dev, generator=g).bfloat16() for _ in range(INPUTS)]
          for T in sorted(set(TIME_T) | set(CHECK_T))}

    # the experts the checks need, in the checkpoint layout, before the codes are repacked
    need = set()
    for T in CHECK_T:
        need |= set(route(xs[T][0], P, meta)[0].flatten().tolist())
    experts_ocp = {e: {k: (P[p][e].clone(), P[s][e].clone()) for k, (p, s) in expert_names.items()}
                   for e in need}
    for p, _ in expert_names.values():
        repack(tvm.runtime.from_dlpack(P[p]))
    torch.cuda.synchronize()
    targs = [[tvm.runtime.from_dlpack(S[n]) for n in names] for S in sets]

    def call(x, j):
        tx = tvm.runtime.from_dlpack(x)
        return lambda: fwd(tx, *targs[j])

    res = {"copy_bandwidth_GBps": bw / 1e9, "dense_bytes": dense_bytes, "expert_bytes": expert_bytes,
           "check": [], "timing": []}
    pre = vm["prefill"]
    for T in CHECK_T:
        x = xs[T][0]
        ref = reference(x, P, experts_ocp, meta)
        # the decode path at every count; the prefill path (sort + grouped GEMMs; at 64-300
        # tokens the small-tile form on Hopper) where a prefill chunk would have that many
        for name, fn in (("forward", fwd), ("prefill", pre)):
            if name == "prefill" and T < 64:
                continue
            out = torch.from_dlpack(fn(tvm.runtime.from_dlpack(x), *targs[0])).float()
            err, mx = (out - ref).abs().max().item(), ref.abs().max().item()
            row = {"T": T, "function": name, "max_abs_err": err, "max_abs_ref": mx, "rel_err": err / mx,
                   "ok": bool(err / mx <= REL_TOL and torch.isfinite(out).all())}
            res["check"].append(row)
            print(json.dumps(row), flush=True)

    for T in TIME_T:
        calls = [call(x, j) for x in xs[T] for j in range(DENSE_SETS)]
        distinct = sum(torch.unique(route(x, P, meta)[0]).numel() for x in xs[T]) / INPUTS
        roof_ms = (dense_bytes + distinct * expert_bytes) / bw * 1e3
        cyc = rotate(calls)
        layer_ms = time_cuda(cyc, iters=20, warmup=3, per_sample=len(calls))
        try:
            graph_ms, graph_err = time_cuda_graph(cyc), None
        except Exception as exc:  # noqa: BLE001 - report, keep the eager timing
            graph_ms, graph_err = None, f"{type(exc).__name__}: {exc}"[:300]
        kernels = _kernel_times(cyc, len(calls))
        expert_us = sum(v for k, v in kernels.items() if "moe_mxfp4" in k)
        router_us = sum(v for k, v in kernels.items() if "moe_route" in k or "moe_expert_chain" in k)
        # cuBLAS on the dense matmuls of the same step (bf16 in, bf16 out)
        lins = [(x, S) for x in xs[T] for S in sets]

        def cublas(state={"i": 0}):  # noqa: B006 - call counter
            x, S = lins[state["i"] % len(lins)]
            state["i"] += 1
            _cublas_dense(x, S)

        cublas.cycle = len(lins)
        try:  # GPU time (eager timing of six small torch calls measures the host)
            cublas_ms = time_cuda_graph(cublas)
        except Exception:  # noqa: BLE001 - fall back to events over eager calls
            cublas_ms = time_cuda(cublas, iters=20, warmup=3, per_sample=len(lins))
        row = {"T": T, "distinct_experts": distinct, "roofline_ms": roof_ms,
               "layer_ms": layer_ms, "pct_roofline": 100 * roof_ms / layer_ms,
               "layer_graph_ms": graph_ms, "graph_error": graph_err,
               "pct_roofline_graph": 100 * roof_ms / graph_ms if graph_ms else None,
               "kernels_us": kernels, "expert_kernels_us": expert_us,
               "router_and_chain_us": router_us,
               "other_kernels_us": sum(kernels.values()) - expert_us,
               "dense_roofline_us": dense_bytes / bw * 1e6, "cublas_dense_us": cublas_ms * 1e3}
        res["timing"].append(row)
        print(json.dumps(row), flush=True)

    # prefill: the grouped MXFP4 GEMMs and the dense projections at many tokens, against the
    # bf16 tensor-core peak measured here (torch.matmul 8192³, CUDA-graph replays)
    res["prefill"] = []
    if decode_only:
        return res
    ma = torch.randn(8192, 8192, device=dev, generator=g).bfloat16()
    mb = torch.randn(8192, 8192, device=dev, generator=g).bfloat16()
    mc_ = torch.empty(8192, 8192, device=dev).bfloat16()
    peak = 2 * 8192 ** 3 / time_cuda_graph(lambda: torch.matmul(ma, mb, out=mc_)) / 1e9
    res["bf16_matmul_peak_tflops"] = peak
    del ma, mb, mc_
    print(f"bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    res["decode_path_at_prefill_sizes"] = []
    for T in DECODE_PATH_AT:
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
        tx = tvm.runtime.from_dlpack(x)
        for name, fn in (("forward", fwd), ("prefill", pre)):
            f = (lambda tx=tx, fn=fn: fn(tx, *targs[0]))
            ms = time_cuda(f, iters=5, warmup=2, per_sample=2)
            kernels = _kernel_times(f, 2)
            row = {"T": T, "function": name, "layer_ms": ms,
                   "expert_us": sum(v for k, v in kernels.items() if "moe_mxfp4" in k or "moe_grouped" in k),
                   "chain_or_sort_us": sum(v for k, v in kernels.items() if "chain" in k or "sort" in k),
                   "kernels_us": kernels}
            res["decode_path_at_prefill_sizes"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels_us"}), flush=True)
    for T in PREFILL_T:
        x = torch.randn(T, H, device=dev, generator=g).bfloat16()
        tx = tvm.runtime.from_dlpack(x)
        f = (lambda tx=tx: pre(tx, *targs[0]))
        ms = time_cuda(f, iters=5, warmup=2, per_sample=2)
        kernels = _kernel_times(f, 2)

        def cublas(x=x):
            _cublas_dense(x, P)

        dense_flop = 2 * T * sum(P[n].numel() for n in dense if P[n].dim() == 2)
        # W1 and W3 (L -> I each) and W2 (I -> L) for each of the T·k token-expert pairs
        expert_flop = 6 * T * meta["top_k"] * meta["latent"] * meta["inter"]
        layer_tflops = (dense_flop + expert_flop) / ms / 1e9
        # HBM roofline of the bytes touched: dense weights and every expert hit (at 512+ tokens
        # nearly all 896), a bound the layer approaches where the grouped GEMMs are weight-bound
        distinct = torch.unique(route(x, P, meta)[0]).numel()
        roof_ms = (dense_bytes + distinct * expert_bytes) / bw * 1e3
        row = {"T": T, "layer_ms": ms, "layer_tflops": layer_tflops,
               "layer_pct_peak": 100 * layer_tflops / peak, "expert_gflop": expert_flop / 1e9,
               "distinct_experts": distinct, "roofline_ms": roof_ms, "pct_roofline": 100 * roof_ms / ms,
               "kernels_us": kernels,
               "grouped_gemm_us": sum(v for k, v in kernels.items() if "moe_grouped" in k),
               "dense_matmul_us": sum(v for k, v in kernels.items() if "NT_matmul" in k),
               "dense_gflop": dense_flop / 1e9, "cublas_dense_ms": time_cuda(cublas, iters=5, warmup=2)}
        res["prefill"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels_us"}), flush=True)
    return res


def _plot(res: dict, path: Path) -> None:
    """Bars per token count: the layer's GPU time split into the routed-expert kernels and the
    rest (dense projections, router, combine, norm), beside the roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["timing"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3 * len(rows), 4))
    for ax, r in zip(axes, rows):
        exp, other = r["expert_kernels_us"] / 1e3, r["other_kernels_us"] / 1e3
        ax.bar([0], [exp], 0.6, color="tab:blue", label="routed-expert kernels (MXFP4)")
        ax.bar([0], [other], 0.6, bottom=[exp], color="tab:orange", label="dense projections, router, rest")
        ax.bar([1], [r["roofline_ms"]], 0.6, color="tab:green", label="HBM roofline")
        ax.text(0, exp + other, f"{r['pct_roofline_graph'] or r['pct_roofline']:.0f}% of roofline",
                ha="center", va="bottom", fontsize=8)
        ax.set_xticks([0, 1], ["layer", "roofline"])
        ax.set_title(f"{r['T']} token{'s' if r['T'] > 1 else ''}")
        ax.set_ylabel("ms per layer (GPU time)")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"K3 MoE layer, decode ({res.get('machine', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out_dir", type=Path)
    b.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    b.add_argument("--low-batch", default=None,
                   help="dense matmul specialization as LIMIT:BUCKET,... ('none': off; "
                        "default: the compile pipeline's)")
    r = sub.add_parser("run")
    r.add_argument("lib_dir", type=Path)
    r.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    r.add_argument("--name", default="moe_layer_decode_h200")
    r.add_argument("--decode-only", action="store_true",
                   help="checks and decode timings only (no prefill section): for A/B runs of two libraries")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        if not args.config.exists():
            raise SystemExit(f"{args.config}: no such config (pass --config)")
        lb = args.low_batch
        if lb is not None:
            try:
                lb = () if lb == "none" else tuple(tuple(int(v) for v in p.split(":")) for p in lb.split(","))
            except ValueError:
                raise SystemExit(f"--low-batch {args.low_batch!r}: expected LIMIT:BUCKET,... or 'none'") from None
            if any(len(p) != 2 for p in lb):
                raise SystemExit(f"--low-batch {args.low_batch!r}: expected LIMIT:BUCKET pairs")
        build(args.out_dir, args.config, lb)
        return 0
    import torch

    res = run(args.lib_dir, args.decode_only)
    res.update({"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                "commit": git_commit()})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    try:
        _plot(res, args.out / f"{args.name}.png")
    except Exception as exc:  # noqa: BLE001 - keep the JSON if matplotlib is missing
        print(f"plot failed: {exc}")
    bad = [r for r in res["check"] if not r["ok"]]
    for r in bad:
        print(f"FAILED: T={r['T']}: output off the reference by {r['rel_err']:.3g} of its largest value")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
