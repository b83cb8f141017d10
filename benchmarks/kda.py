"""KDA kernel benchmark: k3-compile's TensorIR kernels vs fla-core 0.6.0's Triton kernels.

Two steps, because the GPU machine has no TVM compiler:

1. Here (with nvcc): ``python benchmarks/kda.py build dist/kda`` compiles the kernels for
   ``cuda-sm90a`` into ``dist/kda/*.so`` (device code precompiled to a fatbin).
2. On the H200 (runtime-only TVM, fla-core wheel carried):
   ``python benchmarks/kda.py run dist/kda --out $OUT`` checks every kernel against fla's
   naive reference and times it against ``fused_recurrent_kda`` (decode) in the same process,
   at K3 shapes (head_dim 128; 96 heads, and 12 heads = the tensor-parallel-8 share), with the
   same gate settings (lower bound −5; gate, L2 norms and β sigmoid inside the kernel).

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

from cuda_timing import copy_bandwidth, git_commit, time_cuda

HEADS = (96, 12)
DECODE_BATCHES = (1, 16, 64)
K = V = 128
LOWER_BOUND = -5.0
# (cols_per_block, k_split) tilings of the decode kernel compiled and timed; the JSON keeps
# every variant and the best one per shape.
DECODE_TILINGS = ((32, 4), (64, 2), (16, 8), (32, 2), (128, 1))


def build(out_dir: Path) -> None:
    """Compile the decode kernel for each head count into ``out_dir`` (run where nvcc is)."""
    import tvm

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from k3_compile.device_code import precompiled_cuda
    from schedules.kda_decode_cuda import kda_decode_fused_kernel
    from targets import get_target

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = get_target("cuda-sm90a")
    for h in HEADS:
        for cb, ks in DECODE_TILINGS:
            f = kda_decode_fused_kernel(h, K, V, LOWER_BOUND, cols_per_block=cb, k_split=ks)
            f = f.with_attr("global_symbol", "kda_decode_fused")
            with precompiled_cuda(spec.nvcc_arch):
                lib = tvm.compile(tvm.IRModule({"kda_decode_fused": f}), target=spec.tvm_target())
            path = out_dir / f"kda_decode_h{h}_cb{cb}_ks{ks}.so"
            lib.export_library(str(path))
            print(f"built {path}")
    build_prefill(out_dir)


PREFILL_BV = (16, 32)
PREFILL_SHAPES = ((8192,), (2048, 2048, 2048, 2048))


def build_prefill(out_dir: Path) -> None:
    """Compile the two prefill kernels (intra-chunk, state pass) per head count and block_v."""
    import tvm

    from k3_compile.device_code import precompiled_cuda
    from schedules.kda_prefill_cuda import (kda_prefill_intra_kernel, kda_prefill_state_kernel,
                                            manual_barriers)
    from targets import get_target

    spec = get_target("cuda-sm90a")
    for h in HEADS:
        for bv in PREFILL_BV:
            fi = kda_prefill_intra_kernel(h, K, V, K ** -0.5).with_attr("global_symbol", "kda_prefill_intra")
            fs = kda_prefill_state_kernel(h, K, V, bv).with_attr("global_symbol", "kda_prefill_state")
            with precompiled_cuda(spec.nvcc_arch), manual_barriers():
                lib = tvm.compile(tvm.IRModule({"kda_prefill_intra": fi, "kda_prefill_state": fs}),
                                  target=spec.tvm_target())
            path = out_dir / f"kda_prefill_h{h}_bv{bv}.so"
            lib.export_library(str(path))
            print(f"built {path}")


def run(lib_dir: Path, out: Path) -> dict:
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
        variants = {(cb, ks): tvm.runtime.load_module(
            str(lib_dir / f"kda_decode_h{H}_cb{cb}_ks{ks}.so"))["kda_decode_fused"]
            for cb, ks in DECODE_TILINGS}
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
            # time every tiling from the same initial pool, keep the fastest
            pool0 = pool.clone()
            tilings = {}
            for (cb, ks), fn in variants.items():
                tilings[f"cb{cb}_ks{ks}"] = time_cuda(lambda: fn(*args, 0, o_t))
            best = min(tilings, key=tilings.get)
            cb, ks = (int(x[2:]) for x in best.split("_"))
            fn = variants[(cb, ks)]
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
            ours_ms = tilings[best]
            fla_ms = time_cuda(run_fla)
            state_bytes = 2 * B * H * K * V * 4
            roof_ms = state_bytes / bw * 1e3
            row = {"heads": H, "batch": B, "ours_ms": ours_ms, "fla_ms": fla_ms,
                   "roofline_ms": roof_ms, "ours_pct_roofline": 100 * roof_ms / ours_ms,
                   "fla_pct_roofline": 100 * roof_ms / fla_ms, "speedup_vs_fla": fla_ms / ours_ms,
                   "max_err_o_vs_naive": err_o, "max_err_state_vs_naive": err_s,
                   "fla_max_err_o_vs_naive": err_fla, "best_tiling": best,
                   "tilings_ms": tilings}
            results["decode"].append(row)
            print(json.dumps(row))
    results["prefill"] = run_prefill(lib_dir)
    return results


def run_prefill(lib_dir: Path) -> list:
    """Prefill: correctness vs fla's naive recurrence, timing vs fla ``chunk_kda``.

    Our kernels take preprocessed inputs (q, k L2-normalized, g = −5·σ(…), β = σ(b)). fla is
    timed twice: on the same preprocessed inputs (``fla_ms``, the like-for-like comparison) and
    with gate, L2 norms and β sigmoid inside its kernels from raw inputs (``fla_fused_ms``).
    Ours = intra kernel + state kernel (scratch tensors preallocated)."""
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
    rows = []
    l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    for H in HEADS:
        libs = {bv: tvm.runtime.load_module(str(lib_dir / f"kda_prefill_h{H}_bv{bv}.so"))
                for bv in PREFILL_BV}
        A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
        dt_bias = torch.randn(H * K, device=dev) * 0.5

        def inputs(lens):
            Tn = sum(lens)
            raw = {n: torch.randn(Tn, H, K, device=dev) for n in ("q", "k", "v", "f")}
            raw["b"] = torch.randn(Tn, H, device=dev)
            g = LOWER_BOUND * torch.sigmoid(torch.exp(A_log)[None, :, None] * (raw["f"] + dt_bias.view(1, H, K)))
            pre = {"q": l2(raw["q"]).contiguous(), "k": l2(raw["k"]).contiguous(), "v": raw["v"],
                   "g": g.contiguous(), "beta": torch.sigmoid(raw["b"]).contiguous()}
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
            return raw, pre, cu

        def ours(bv, pre, cu, pool, slots, o, scr):
            fi, fs = libs[bv]["kda_prefill_intra"], libs[bv]["kda_prefill_state"]
            A = tvm.runtime.from_dlpack
            a_i = [A(pre[n]) for n in ("k", "q", "v", "g", "beta")] + [A(cu)] + [A(scr[n]) for n in ("w", "u", "qg", "kg", "aqk", "ge")]
            a_s = [A(scr[n]) for n in ("w", "u", "qg", "kg", "aqk", "ge")] + [A(cu), A(slots), A(pool)]
            o_t = A(o)
            return lambda: (fi(*a_i), fs(*a_s, 0, o_t))

        def scratch(Tn, B):
            return {n: torch.empty(s, device=dev) for n, s in prefill_scratch_shapes(Tn, B, H).items()}

        # correctness
        for lens, init in (((1,), True), ((15,), False), ((63,), True), ((64,), True), ((65,), False),
                           ((1000,), True), ((1, 15, 64, 65, 200), True), ((130, 7, 64), False)):
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
            for bv in PREFILL_BV:
                pool = torch.zeros(1, B + 2, H, K, V, device=dev)
                pool[0, slots.long()] = S0
                o = torch.full((Tn, H, V), float("nan"), device=dev)
                ours(bv, pre, cu, pool, slots, o, scratch(Tn, B))()
                torch.cuda.synchronize()
                row = {"kind": "check", "heads": H, "lens": list(lens), "initial_state": init, "block_v": bv,
                       "max_err_o": (o - o_ref).abs().max().item(),
                       "max_err_state": (pool[0, slots.long()] - S_ref).abs().max().item(),
                       "max_abs_o": o_ref.abs().max().item()}
                rows.append(row)
                print(json.dumps(row))
        # timing
        for lens in PREFILL_SHAPES:
            raw, pre, cu = inputs(lens)
            B, Tn = len(lens), sum(lens)
            slots = torch.arange(B, device=dev, dtype=torch.int32)
            pool = torch.randn(1, B, H, K, V, device=dev) * 0.1
            o = torch.empty(Tn, H, V, device=dev)
            scr = scratch(Tn, B)
            per_bv = {f"bv{bv}": time_cuda(ours(bv, pre, cu, pool, slots, o, scr), iters=10, per_sample=3)
                      for bv in PREFILL_BV}
            best = min(per_bv, key=per_bv.get)
            cu64 = cu.long()
            S0 = pool[0].clone()
            with torch.inference_mode():
                def fla_pre():
                    return chunk_kda(pre["q"][None], pre["k"][None], pre["v"][None], pre["g"][None],
                                     pre["beta"][None], initial_state=S0, output_final_state=True,
                                     cu_seqlens=cu64)

                def fla_fused():
                    return chunk_kda(raw["q"][None], raw["k"][None], raw["v"][None], raw["f"][None],
                                     raw["b"][None], initial_state=S0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True, safe_gate=True,
                                     lower_bound=LOWER_BOUND, A_log=A_log, dt_bias=dt_bias,
                                     cu_seqlens=cu64)
                fla_ms = time_cuda(fla_pre, iters=10, per_sample=3)
                try:
                    fla_fused_ms = time_cuda(fla_fused, iters=10, per_sample=3)
                except Exception as e:  # noqa: BLE001
                    fla_fused_ms = None
                    print("fla fused failed:", e)
            row = {"kind": "time", "heads": H, "lens": list(lens), "ours_ms": per_bv[best],
                   "best_block_v": best, "block_v_ms": per_bv, "fla_ms": fla_ms,
                   "fla_fused_ms": fla_fused_ms, "speedup_vs_fla": fla_ms / per_bv[best]}
            rows.append(row)
            print(json.dumps(row))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out_dir", type=Path)
    r = sub.add_parser("run")
    r.add_argument("lib_dir", type=Path)
    r.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.out_dir)
        return 0
    import torch

    res = run(args.lib_dir, args.out)
    res.update({"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                "commit": git_commit(), "fla": "fla-core 0.6.0", "head_dim": K,
                "lower_bound": LOWER_BOUND})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kda_decode_h200.json").write_text(json.dumps(res, indent=1))
    _plot(res, args.out / "kda_decode_h200.png")
    return 0


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
