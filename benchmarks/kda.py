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
import os
import subprocess
import sys
import time
from pathlib import Path

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


def _time_cuda(fn, iters: int = 30, warmup: int = 5, per_sample: int = 10) -> float:
    """Median milliseconds per ``fn()`` call, timed with CUDA events.

    Each sample times ``per_sample`` back-to-back calls (so the GPU queue stays busy and
    host-side call overhead hides behind kernel time where the kernel is longer than it).
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_sample):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per_sample)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    import torch

    n = 2 ** 29  # 2 GiB fp32
    x = torch.empty(n, device="cuda")
    y = torch.empty_like(x)
    ms = _time_cuda(lambda: y.copy_(x), iters=10, per_sample=2)
    return 2 * x.numel() * 4 / (ms / 1e3)


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
                tilings[f"cb{cb}_ks{ks}"] = _time_cuda(lambda: fn(*args, 0, o_t))
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
            fla_ms = _time_cuda(run_fla)
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
    return results


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - the GPU machine's copy may have no .git
        return os.environ.get("K3_COMMIT", "unknown")


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
                "commit": _commit(), "fla": "fla-core 0.6.0", "head_dim": K,
                "lower_bound": LOWER_BOUND})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kda_decode_h200.json").write_text(json.dumps(res, indent=1))
    _plot(res, args.out / "kda_decode_h200.png")
    return 0


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(HEADS), figsize=(5 * len(HEADS), 4))
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
