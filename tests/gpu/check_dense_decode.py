"""The dense bf16 kernels on a CUDA GPU — the decode kernel (schedules/dense_decode_tc.py) and the
Hopper split-K and prefill kernels (schedules/dense_splitk_wgmma.py, dense_prefill_wgmma.py): correctness against torch on odd sizes
and token counts, and their speed against cuBLAS (and the HBM roofline, the bf16 peak) at the
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
ODD_SHAPES_WGMMA = [(384, 192), (768, 320), (128, 64)]   # rows a multiple of 128
CHECK_N = (1, 3, 8, 13, 64, 65, 200)
CHECK_N_WGMMA = (1, 127, 128, 129, 300, 1000)
TIME_N = (1, 8, 64, 2048, 8192)
TIME_N_WGMMA = (64, 256, 512, 1024, 2048, 8192)
CHECK_N_SPLITK = (1, 3, 17, 32, 33, 64, 65, 130, 255)
TIME_N_SPLITK = (16, 24, 32, 48, 64, 128, 192, 256, 384, 512)
ROTATE = 8
# the 1-2 token GEMV (schedules/dense_gemv.py): odd shapes covering each of its layouts
ODD_SHAPES_GEMV = [(8, 256), (40, 1280), (12, 3584), (14, 7168), (3, 16384)]
CHECK_N_GEMV = (1, 2)
TIME_N_GEMV = (1, 2, 3, 4)


# schedule variants timed beside the default: name -> dense_nt_tc_kernel kwargs
VARIANTS = {}
# the prefill kernel's variants: name -> dense_wgmma_kernel kwargs
WGMMA_VARIANTS = {"bn128": {"bn": 128}}
# the split-K decode kernel's variants: name -> (N, K) -> dense_splitk_kernel kwargs
SPLITK_VARIANTS = {}


def _sname(n_rows, k, variant=""):
    return f"dense_splitk_{n_rows}x{k}" + (f"_{variant}" if variant else "")


def _gname(n_rows, k, variant=""):
    return f"dense_gemv_{n_rows}x{k}" + (f"_{variant}" if variant else "")


def _dlight_gemv(n_rows, k, target):
    """dlight's LowBatchGEMV(1) schedule of ``y [n, N] f32 = x [n, K] @ w [N, K]ᵀ`` (bf16 in),
    the schedule the model's projections took at 1-2 tokens before schedules/dense_gemv.py."""
    import tvm
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op
    from tvm.s_tir import dlight as dl

    from k3_compile.build import _dlight

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers_tvm import fused_module  # the compiler's side only (prepare)

    class M(nn.Module):
        def __init__(self):
            self.w = nn.Parameter((n_rows, k), "bfloat16")

        def forward(self, x):
            return op.matmul(x, op.permute_dims(self.w, [1, 0]), out_dtype="float32")

    mod, _ = M().export_tvm(spec={"forward": {"x": nn.spec.Tensor(["n", k], "bfloat16")}})
    (f,) = [f for _, f in fused_module(mod).functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    # the model's argument order: x, w, y
    return _dlight(f, dl.gpu.LowBatchGEMV(1), target)


def _name(n_rows, k, variant=""):
    return f"dense_{n_rows}x{k}" + (f"_{variant}" if variant else "")


def _wname(n_rows, k, variant=""):
    return f"dense_wgmma_{n_rows}x{k}" + (f"_{variant}" if variant else "")


def prepare(out: Path) -> None:
    import tvm

    from k3_compile.device_code import precompiled_cuda
    from schedules.barriers import respect_manual_barriers
    from schedules.dense_decode_tc import dense_nt_tc_kernel
    from schedules import dense_splitk_wgmma as dk
    from schedules.dense_prefill_wgmma import dense_wgmma_kernel, fits
    from targets import get_target

    spec = get_target("cuda-sm90a")
    fs = {_name(r, k): dense_nt_tc_kernel(r, k, "float32").with_attr("global_symbol", _name(r, k))
          for r, k in K3_SHAPES + ODD_SHAPES}
    for v, kw in VARIANTS.items():
        for r, k in K3_SHAPES:
            fs[_name(r, k, v)] = dense_nt_tc_kernel(r, k, "float32", **kw).with_attr(
                "global_symbol", _name(r, k, v))
    for r, k in K3_SHAPES + ODD_SHAPES_WGMMA:
        if fits(r, k):
            fs[_wname(r, k)] = dense_wgmma_kernel(r, k, "float32").with_attr("global_symbol", _wname(r, k))
    for v, kw in WGMMA_VARIANTS.items():
        for r, k in K3_SHAPES:
            if fits(r, k):
                fs[_wname(r, k, v)] = dense_wgmma_kernel(r, k, "float32", **kw).with_attr(
                    "global_symbol", _wname(r, k, v))
    for r, k in K3_SHAPES + ODD_SHAPES_WGMMA:
        if dk.fits(r, k):
            fs[_sname(r, k)] = dk.dense_splitk_kernel(r, k, "float32").with_attr("global_symbol", _sname(r, k))
    for v, kw in SPLITK_VARIANTS.items():
        for r, k in K3_SHAPES:
            if dk.fits(r, k) and (k // 64) % kw(r, k).get("splits", 1) == 0:
                fs[_sname(r, k, v)] = dk.dense_splitk_kernel(r, k, "float32", **kw(r, k)).with_attr(
                    "global_symbol", _sname(r, k, v))
    from schedules import dense_gemv as dg

    for r, k in K3_SHAPES + ODD_SHAPES_GEMV:
        fs[_gname(r, k)] = dg.dense_gemv_kernel(r, k, "float32").with_attr("global_symbol", _gname(r, k))
    for r, k in K3_SHAPES:  # up to 4 tokens
        fs[_gname(r, k, "t4")] = dg.dense_gemv_kernel(r, k, "float32", max_tokens=4).with_attr(
            "global_symbol", _gname(r, k, "t4"))
    for r, k in K3_SHAPES:
        with spec.tvm_target():
            f = _dlight_gemv(r, k, spec.tvm_target())
        if f is not None:
            fs[_gname(r, k, "dlight")] = f.with_attr("global_symbol", _gname(r, k, "dlight"))
    with precompiled_cuda(spec.nvcc_arch), respect_manual_barriers():
        lib = tvm.compile(tvm.IRModule(fs), target=spec.tvm_target())
    out.mkdir(parents=True, exist_ok=True)
    lib.export_library(str(out / "dense.so"))
    print(f"built {out / 'dense.so'}")


def _check(f, r, k, ns, variant, dev, g):
    """Rows of checks of kernel ``f`` (``W [r, k]``) at the token counts ``ns`` against torch
    (outputs NaN-filled before each call)."""
    import torch
    import tvm

    rows = []
    w = torch.randn(r, k, device=dev, generator=g).bfloat16()
    for n in ns:
        x = torch.randn(n, k, device=dev, generator=g).bfloat16()
        y = torch.full((n, r), float("nan"), device=dev)
        f(*(tvm.runtime.from_dlpack(t) for t in (x, w, y)))
        ref = x.float() @ w.float().T
        err = (y - ref).abs().max().item()
        row = {"N": r, "K": k, "n": n, "variant": variant, "max_abs_err": err,
               "max_abs_ref": ref.abs().max().item(),
               "ok": bool(torch.isfinite(y).all() and err <= 1e-3 * max(1.0, ref.abs().max().item()))}
        rows.append(row)
        if not row["ok"]:
            print("CHECK FAILED", row, flush=True)
    return rows


def _time(fv, r, k, n, dev, g, bw, peak):
    """Times (ms) of the kernels ``fv`` (name -> function) and cuBLAS at ``n`` tokens, each
    call on the next of ROTATE weight copies, from CUDA-graph replays."""
    import torch
    import tvm

    from cuda_timing import time_cuda_graph

    ws = [torch.randn(r, k, device=dev, generator=g).bfloat16() for _ in range(ROTATE)]
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
    t_var = {v: time_cuda_graph(make(f)) for v, f in fv.items()}
    t_cublas = time_cuda_graph(cublas)
    roof = r * k * 2 / bw * 1e3
    flop = 2.0 * n * r * k
    row = {"N": r, "K": k, "n": n, "cublas_ms": t_cublas, "roofline_ms": roof, "times_ms": t_var,
           "tflops": {v: flop / t / 1e9 for v, t in t_var.items()},
           "cublas_tflops": flop / t_cublas / 1e9,
           "pct_peak": {v: 100 * flop / t / 1e9 / peak for v, t in t_var.items()},
           "speedup_vs_cublas": {v: t_cublas / t for v, t in t_var.items()},
           "pct_roofline": {v: 100 * roof / t for v, t in t_var.items()}}
    print(json.dumps(row), flush=True)
    return row


def _bf16_peak(dev) -> float:
    """Measured bf16 tensor-core peak (TFLOP/s): torch.matmul 8192³, CUDA-graph replays."""
    import torch

    from cuda_timing import time_cuda_graph

    a = torch.randn(8192, 8192, device=dev).bfloat16()
    b = torch.randn(8192, 8192, device=dev).bfloat16()
    c = torch.empty(8192, 8192, device=dev).bfloat16()

    def mm():
        torch.matmul(a, b, out=c)

    return 2 * 8192 ** 3 / time_cuda_graph(mm) / 1e9


def run(lib_dir: Path, only: str = "all") -> dict:
    import torch
    import tvm

    from cuda_timing import copy_bandwidth
    from k3_compile.device_code import load_cuda_runtime

    load_cuda_runtime()
    lib = tvm.runtime.load_module(str(lib_dir / "dense.so"))
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bw = copy_bandwidth()
    peak = _bf16_peak(dev)
    res = {"copy_bandwidth_GBps": bw / 1e9, "bf16_peak_tflops": peak, "check": [], "timing": [],
           "timing_wgmma": []}

    def has(name):
        try:
            lib[name]
            return True
        except (AttributeError, tvm.error.TVMError):
            return False

    # (name function, shapes, variant, token counts, label, built for every shape): the decode
    # kernel is built for all its shapes, the wgmma ones only where their tiles fit
    suites = [(_gname, K3_SHAPES + ODD_SHAPES_GEMV, "", CHECK_N_GEMV, "gemv", False),
              (_gname, K3_SHAPES, "dlight", CHECK_N_GEMV, "gemv_dlight", False),
              (_gname, K3_SHAPES, "t4", (1, 3, 4), "gemv_t4", False)]
    if only in ("all", "decode"):
        suites += [(_name, K3_SHAPES + ODD_SHAPES, "", CHECK_N, "", True)]
        suites += [(_name, K3_SHAPES, v, CHECK_N, v, True) for v in VARIANTS]
    suites += [(_wname, K3_SHAPES + ODD_SHAPES_WGMMA, "", CHECK_N_WGMMA, "wgmma", False)]
    suites += [(_wname, K3_SHAPES, v, (129, 1000), "wgmma_" + v, False) for v in WGMMA_VARIANTS]
    suites += [(_sname, K3_SHAPES + ODD_SHAPES_WGMMA, "", CHECK_N_SPLITK, "splitk", False)]
    suites += [(_sname, K3_SHAPES, v, (3, 65), "splitk_" + v, False) for v in SPLITK_VARIANTS]
    for name, shapes, v, ns, label, required in suites:
        for r, k in shapes:
            if required or has(name(r, k, v)):
                res["check"] += _check(lib[name(r, k, v)], r, k, ns, label, dev, g)
    res["timing_gemv"] = []
    for r, k in K3_SHAPES:
        if only in ("all", "gemv") and has(_gname(r, k)):
            fv = {"gemv": lib[_gname(r, k)], "tc": lib[_name(r, k)]}
            for v in ("t4", "dlight"):
                if has(_gname(r, k, v)):
                    fv[f"gemv_{v}"] = lib[_gname(r, k, v)]
            for n in TIME_N_GEMV:
                res["timing_gemv"].append(_time(fv, r, k, n, dev, g, bw, peak))
    res["timing_splitk"] = []
    for r, k in K3_SHAPES:
        if only in ("all", "splitk") and has(_sname(r, k)):
            fv = {"tc": lib[_name(r, k)], "wgmma": lib[_wname(r, k)], "splitk": lib[_sname(r, k)]}
            fv.update({"wgmma_" + v: lib[_wname(r, k, v)] for v in WGMMA_VARIANTS if has(_wname(r, k, v))})
            fv.update({"splitk_" + v: lib[_sname(r, k, v)] for v in SPLITK_VARIANTS if has(_sname(r, k, v))})
            for n in TIME_N_SPLITK:
                res["timing_splitk"].append(_time(fv, r, k, n, dev, g, bw, peak))
    for r, k in K3_SHAPES:
        if only in ("splitk", "gemv"):
            continue
        if only in ("all", "decode"):
            fv = {v or "default": lib[_name(r, k, v)] for v in ("", *VARIANTS)}
            for n in TIME_N:
                res["timing"].append(_time(fv, r, k, n, dev, g, bw, peak))
        if has(_wname(r, k)):
            fv = {"tc": lib[_name(r, k)], "wgmma": lib[_wname(r, k)]}
            fv.update({"wgmma_" + v: lib[_wname(r, k, v)] for v in WGMMA_VARIANTS if has(_wname(r, k, v))})
            for n in TIME_N_WGMMA:
                res["timing_wgmma"].append(_time(fv, r, k, n, dev, g, bw, peak))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", choices=["prepare", "run"])
    ap.add_argument("lib_dir", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--only", choices=["all", "decode", "prefill", "splitk", "gemv"], default="all",
                    help="run: time the decode kernel, the prefill kernel, the split-K kernel, the 1-2 token GEMV, or all")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.lib_dir)
        return 0
    import torch

    from cuda_timing import git_commit

    res = run(args.lib_dir, args.only)
    res.update({"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                "commit": git_commit()})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dense_decode_h200.json").write_text(json.dumps(res, indent=1))
    bad = [c for c in res["check"] if not c["ok"]]
    print(f"{len(res['check']) - len(bad)} / {len(res['check'])} checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
