"""The GPU MoE router (schedules/moe_generic.py ``moe_route_kernel(gpu=True)``: one warp per
token) against an independent NumPy top-k, and the expert chain kernel
(schedules/moe_mxfp4_cuda.py ``moe_expert_chain_kernel``) against NumPy, each timed against its
earlier versions (built from the git history), on the H200.

Here: ``python tests/gpu/check_route.py build dist/route`` (K3: 896 experts top-16 with
routed_scaling_factor 2.5; odd sizes 32/top-4 and 37/top-5 without renormalization). There:
``python3 tests/gpu/check_route.py run dist/route [out.json]``. Scores are rounded to a coarse
grid so that many ties occur: the lowest expert index must win them.
"""

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
CASES = {"route896": (896, 16, 2.5, True), "route32": (32, 4, 1.0, True), "route37": (37, 5, 1.5, False)}
OLD = {  # name -> (commit, schedules module, its kernel)
    "route896_thread": ("d993f4c", "moe_generic", lambda m: m.moe_route_kernel(896, 16, 2.5, True, gpu=True)),
    "route896_warp_v1": ("1b06953", "moe_generic", lambda m: m.moe_route_kernel(896, 16, 2.5, True, gpu=True)),
    "route896_warp_v2": ("91cedf5", "moe_generic", lambda m: m.moe_route_kernel(896, 16, 2.5, True, gpu=True)),
    "chain16_thread": ("1b06953", "moe_mxfp4_cuda", lambda m: m.moe_expert_chain_kernel(16)),
}


def build(out: Path) -> None:
    import importlib.util
    import subprocess

    import tvm

    from k3_compile.device_code import PTXAS_OPTIONS, precompiled_cuda
    from schedules.barriers import respect_manual_barriers
    from schedules import moe_generic as mg
    from targets import get_target

    from schedules import moe_mxfp4_cuda as mc

    fs = {n: mg.moe_route_kernel(e, k, rsf, norm, gpu=True) for n, (e, k, rsf, norm) in CASES.items()}
    fs["chain16"] = mc.moe_expert_chain_kernel(16)
    fs["chain3"] = mc.moe_expert_chain_kernel(3)
    # earlier versions, for the timing comparison: name -> (commit, module, builder)
    for name, (commit, module, make) in OLD.items():
        try:
            src = subprocess.check_output(["git", "show", f"{commit}:schedules/{module}.py"], cwd=ROOT,
                                          text=True, stderr=subprocess.DEVNULL)
        except (subprocess.CalledProcessError, OSError):
            raise SystemExit(f"check_route build: needs the git history (commit {commit}) for {name}")
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{module}_{commit}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"{module}_{commit}", path)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        fs[name] = make(old)
        path.unlink()
    mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in fs.items()})
    target = get_target("cuda-sm90a")
    with precompiled_cuda(target.nvcc_arch, options=PTXAS_OPTIONS), respect_manual_barriers():  # as the model build
        lib = tvm.compile(mod, target=target.tvm_target())
    lib.export_library(str(out / "route.so"))


def reference_with_nan(logits, bias, k, rsf, norm):
    """As :func:`reference` for logits with NaNs: NaN scores are never chosen, and where fewer
    than ``k`` scores are finite the remaining slots take expert 0 (the kernels' documented
    fallback); selection round by round, larger score first, ties to the lower index."""
    s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    sel = (s.astype(np.float32) + bias).astype(np.float64)
    T = logits.shape[0]
    ids = np.zeros((T, k), np.int32)
    for t in range(T):
        live = {e for e in range(logits.shape[1]) if np.isfinite(sel[t, e])}
        for r in range(k):
            if live:
                best = max(sorted(live), key=lambda e: (sel[t, e], -e))
                live.discard(best)
                ids[t, r] = best
    w = np.take_along_axis(s, ids, 1)
    if norm and k > 1:
        w = w / (w.sum(1, keepdims=True) + 1e-20)
    return ids, (w * rsf).astype(np.float32)


def reference(logits, bias, k, rsf, norm):
    """Top-k of sigmoid(logits) + bias, larger first, ties to the lower index (a stable sort
    of the negated scores); weights sigmoid(logit) renormalized (+1e-20) and scaled."""
    s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    sel = s.astype(np.float32) + bias  # fp32 add, as the kernel (ties decided in fp32)
    ids = np.argsort(-sel, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(s, ids, 1)
    if norm and k > 1:
        w = w / (w.sum(1, keepdims=True) + 1e-20)
    return ids.astype(np.int32), (w * rsf).astype(np.float32)


def chain_reference(ids):
    """``chain [T, k, 2]`` of the flattened entries: [.., 0] 1 where the entry is its expert's
    first, [.., 1] the next entry with the same expert or -1 (one backward pass; independent
    of schedules/moe_mxfp4_cuda.py, which this script must not import: runtime-only TVM)."""
    flat = ids.reshape(-1)
    out = np.zeros((flat.size, 2), np.int32)
    nxt = {}
    for i in range(flat.size - 1, -1, -1):
        out[i, 1] = nxt.get(int(flat[i]), -1)
        nxt[int(flat[i])] = i
    seen = set()
    for i, e in enumerate(flat):
        out[i, 0] = int(int(e) not in seen)
        seen.add(int(e))
    return out.reshape(*ids.shape, 2)


def run(out: Path) -> dict:
    import torch
    import tvm

    from cuda_timing import time_cuda_graph
    from k3_compile.device_code import load_cuda_runtime

    load_cuda_runtime()
    lib = tvm.runtime.load_module(str(out / "route.so"))
    rng = np.random.default_rng(0)
    res = {"check": [], "timing": []}
    for name, (E, k, rsf, norm) in CASES.items():
        for T in (1, 7, 300):
            logits = (np.round(rng.standard_normal((T, E)) * 4) / 4).astype(np.float32)  # ties
            bias = (np.round(rng.standard_normal(E) * 4) / 8).astype(np.float32)
            ids = torch.empty(T, k, dtype=torch.int32, device="cuda")
            w = torch.empty(T, k, dtype=torch.float32, device="cuda")
            args = [tvm.runtime.from_dlpack(t) for t in (torch.from_numpy(logits).cuda(),
                                                         torch.from_numpy(bias).cuda(), ids, w)]
            lib[name](*args)
            torch.cuda.synchronize()
            rid, rw = reference(logits, bias, k, rsf, norm)
            row = {"kernel": name, "T": T, "same_ids": bool((ids.cpu().numpy() == rid).all()),
                   "max_w_err": float(np.abs(w.cpu().numpy() - rw).max())}
            res["check"].append(row)
            print(json.dumps(row), flush=True)
    # NaN logits (never chosen; fewer finite scores than top_k: expert 0 fills the rest)
    for name, (E, k, rsf, norm) in CASES.items():
        for frac in (0.3, 0.95):
            logits = (np.round(rng.standard_normal((7, E)) * 4) / 4).astype(np.float32)
            logits[:, 1:][rng.random((7, E - 1)) < frac] = np.nan  # expert 0 stays finite
            bias = (np.round(rng.standard_normal(E) * 4) / 8).astype(np.float32)
            ids = torch.empty(7, k, dtype=torch.int32, device="cuda")
            w = torch.empty(7, k, dtype=torch.float32, device="cuda")
            lib[name](*[tvm.runtime.from_dlpack(t) for t in (torch.from_numpy(logits).cuda(),
                                                             torch.from_numpy(bias).cuda(), ids, w)])
            torch.cuda.synchronize()
            rid, rw = reference_with_nan(logits, bias, k, rsf, norm)
            row = {"kernel": name, "T": 7, "nan_fraction": frac,
                   "same_ids": bool((ids.cpu().numpy() == rid).all()),
                   "max_w_err": float(np.abs(w.cpu().numpy() - rw).max())}
            res["check"].append(row)
            print(json.dumps(row), flush=True)
    for k, name in ((16, "chain16"), (3, "chain3")):
        for T in (1, 7, 64, 300):
            e = 5 if k == 3 else 896
            ids = rng.integers(0, e, (T, k)).astype(np.int32)
            chain = torch.full((T, k, 2), 7, dtype=torch.int32, device="cuda")
            lib[name](tvm.runtime.from_dlpack(torch.from_numpy(ids).cuda()), tvm.runtime.from_dlpack(chain))
            torch.cuda.synchronize()
            row = {"kernel": name, "T": T, "same_chain": bool((chain.cpu().numpy()
                                                               == chain_reference(ids)).all())}
            res["check"].append(row)
            print(json.dumps(row), flush=True)
    for T in (1, 64, 8192):
        logits = torch.randn(T, 896, device="cuda")
        bias = torch.randn(896, device="cuda") * 0.1
        ids = torch.empty(T, 16, dtype=torch.int32, device="cuda")
        w = torch.empty(T, 16, dtype=torch.float32, device="cuda")
        args = [tvm.runtime.from_dlpack(t) for t in (logits, bias, ids, w)]
        row = {"T": T}
        for name in ("route896", "route896_warp_v2", "route896_warp_v1", "route896_thread"):
            row[f"{name}_ms"] = time_cuda_graph(lambda: lib[name](*args))
        row["speedup_vs_warp_v1"] = row["route896_warp_v1_ms"] / row["route896_ms"]
        row["speedup_vs_warp_v2"] = row["route896_warp_v2_ms"] / row["route896_ms"]
        row["speedup"] = row["route896_thread_ms"] / row["route896_ms"]
        if T <= 256:  # the chain kernel serves decode sizes
            lib["route896"](*args)
            cargs = [tvm.runtime.from_dlpack(ids), tvm.runtime.from_dlpack(
                torch.empty(T, 16, 2, dtype=torch.int32, device="cuda"))]
            for name in ("chain16", "chain16_thread"):
                row[f"{name}_ms"] = time_cuda_graph(lambda: lib[name](*cargs))
        res["timing"].append(row)
        print(json.dumps(row), flush=True)
    return res


if __name__ == "__main__":
    step, out = sys.argv[1], Path(sys.argv[2])
    if step == "build":
        build(out)
    else:
        r = run(out)
        import time

        import torch

        from cuda_timing import git_commit

        r.update({"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                  "commit": git_commit()})
        if len(sys.argv) > 3:
            Path(sys.argv[3]).write_text(json.dumps(r, indent=1))
        bad = [c for c in r["check"] if not (c.get("same_chain", True) and c.get("same_ids", True)
                                             and c.get("max_w_err", 0.0) <= 1e-6)]
        for c in bad:
            print(f"FAILED: {c}")
        sys.exit(1 if bad else 0)
