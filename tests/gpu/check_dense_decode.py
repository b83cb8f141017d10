"""The dense bf16 decode kernel (schedules/dense_decode_tc.py) on a CUDA GPU: correctness against
torch on odd sizes and token counts, and its speed against cuBLAS and the HBM roofline at the
K3 MoE layer's dense shapes.

``python tests/gpu/check_dense_decode.py prepare dist/dense`` (here, with nvcc) compiles the
standalone kernels; ``python3 tests/gpu/check_dense_decode.py run dist/dense --out $OUT`` (GPU,
runtime-only TVM + torch) checks and times them and writes ``dense_decode_h200.json``.
Timing: CUDA-graph replays, each call on its own copy of the weights (ROTATE copies, so L2 holds
none of them), cuBLAS = ``torch.nn.functional.linear`` in bf16 timed the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# (N rows, K inputs): the K3 MoE layer's dense projections, then odd sizes
K3_SHAPES = [(3584, 7168), (7168, 3584), (6144, 7168), (7168, 6144), (896, 7168)]
ODD_SHAPES = [(48, 192), (16, 64), (112, 320)]
CHECK_N = (1, 3, 8, 13, 64, 65, 200)
TIME_N = (1, 8, 64, 2048, 8192)
ROTATE = 8


# schedule variants timed beside the default: name -> dense_nt_tc_kernel kwargs
VARIANTS = {}


def _name(n_rows, k, variant=""):
    return f"dense_{n_rows}x{k}" + (f"_{variant}" if variant else "")


def prepare(out: Path) -> None:
    import tvm

    from k3_compile.device_code import precompiled_cuda
    from schedules.barriers import respect_manual_barriers
    from schedules.dense_decode_tc import dense_nt_tc_kernel
    from targets import get_target

    spec = get_target("cuda-sm90a")
    fs = {_name(r, k): dense_nt_tc_kernel(r, k, "float32").with_attr("global_symbol", _name(r, k))
          for r, k in K3_SHAPES + ODD_SHAPES}
    for v, kw in VARIANTS.items():
        for r, k in K3_SHAPES:
            fs[_name(r, k, v)] = dense_nt_tc_kernel(r, k, "float32", **kw).with_attr(
                "global_symbol", _name(r, k, v))
    with precompiled_cuda(spec.nvcc_arch), respect_manual_barriers():
        lib = tvm.compile(tvm.IRModule(fs), target=spec.tvm_target())
    out.mkdir(parents=True, exist_ok=True)
    lib.export_library(str(out / "dense.so"))
    print(f"built {out / 'dense.so'}")


def run(lib_dir: Path) -> dict:
    import torch
    import tvm

    from cuda_timing import copy_bandwidth, time_cuda_graph
    from k3_compile.device_code import load_cuda_runtime

    load_cuda_runtime()
    lib = tvm.runtime.load_module(str(lib_dir / "dense.so"))
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bw = copy_bandwidth()
    res = {"copy_bandwidth_GBps": bw / 1e9, "check": [], "timing": []}
    checks = [(r, k, "") for r, k in K3_SHAPES + ODD_SHAPES]
    checks += [(r, k, v) for v in VARIANTS for r, k in K3_SHAPES]
    for r, k, v in checks:
        f = lib[_name(r, k, v)]
        w = torch.randn(r, k, device=dev, generator=g).bfloat16()
        for n in CHECK_N:
            x = torch.randn(n, k, device=dev, generator=g).bfloat16()
            y = torch.full((n, r), float("nan"), device=dev)
            f(*(tvm.runtime.from_dlpack(t) for t in (x, w, y)))
            ref = x.float() @ w.float().T
            err = (y - ref).abs().max().item()
            row = {"N": r, "K": k, "n": n, "variant": v, "max_abs_err": err, "max_abs_ref": ref.abs().max().item(),
                   "ok": bool(torch.isfinite(y).all() and err <= 1e-3 * max(1.0, ref.abs().max().item()))}
            res["check"].append(row)
            if not row["ok"]:
                print("CHECK FAILED", row, flush=True)
    for r, k in K3_SHAPES:
        fv = {v: lib[_name(r, k, v)] for v in ("", *VARIANTS)}
        ws = [torch.randn(r, k, device=dev, generator=g).bfloat16() for _ in range(ROTATE)]
        for n in TIME_N:
            x = torch.randn(n, k, device=dev, generator=g).bfloat16()
            y = torch.empty(n, r, device=dev)
            yb = torch.empty(n, r, device=dev, dtype=torch.bfloat16)
            targs = [[tvm.runtime.from_dlpack(t) for t in (x, wi, y)] for wi in ws]

            def make(f):
                def ours(state={"i": 0}):  # noqa: B006 - rotation counter
                    f(*targs[state["i"] % ROTATE])
                    state["i"] += 1
                ours.cycle = ROTATE
                return ours

            def cublas(state={"i": 0}):  # noqa: B006
                torch.nn.functional.linear(x, ws[state["i"] % ROTATE], out=yb)
                state["i"] += 1

            cublas.cycle = ROTATE
            t_var = {v or "default": time_cuda_graph(make(f)) for v, f in fv.items()}
            t_ours, t_cublas = t_var["default"], time_cuda_graph(cublas)
            roof = r * k * 2 / bw * 1e3
            row = {"N": r, "K": k, "n": n, "ours_ms": t_ours, "cublas_ms": t_cublas,
                   "roofline_ms": roof, "ours_pct_roofline": 100 * roof / t_ours,
                   "cublas_pct_roofline": 100 * roof / t_cublas, "speedup_vs_cublas": t_cublas / t_ours,
                   "variants_ms": t_var}
            res["timing"].append(row)
            print(json.dumps(row), flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", choices=["prepare", "run"])
    ap.add_argument("lib_dir", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.lib_dir)
        return 0
    import torch

    from cuda_timing import git_commit

    res = run(args.lib_dir)
    res.update({"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                "commit": git_commit()})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dense_decode_h200.json").write_text(json.dumps(res, indent=1))
    bad = [c for c in res["check"] if not c["ok"]]
    print(f"{len(res['check']) - len(bad)} / {len(res['check'])} checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
