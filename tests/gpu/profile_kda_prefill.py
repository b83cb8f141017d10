"""Profile the tensor-core KDA prefill kernels (schedules/kda_prefill_tc.py; the fused one of
schedules/kda_prefill_fused.py as ``fused``, its split form as ``split_intra`` and
``split_state``, each as the model dispatches them) at K3 shapes.

Here: ``python tests/gpu/profile_kda_prefill.py build dist/kdaprof [H]`` compiles the intra
(``hoist_loads``) and state kernels for ``H`` heads (96) into ``dist/kdaprof/kda_prefill_tc.so``.
GPU machine (runtime-only TVM): ``ncu --kernel-name regex:intra --launch-skip 1 --launch-count 1
--set full python3 tests/gpu/profile_kda_prefill.py run dist/kdaprof [H] [T]`` runs every
kernel twice on one sequence of ``T`` tokens (8192) with random inputs (q, k unit rows, g in
(-5, 0), β in (0, 1)). Timing only: nothing is checked (benchmarks/kda.py checks them).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
K = 128


def build(out: Path, H: int) -> None:
    import tvm

    from k3_compile.device_code import precompiled_cuda
    from relax_modules.kda import prefill_dispatch
    from schedules.barriers import respect_manual_barriers
    from schedules.kda_prefill_fused import (
        kda_prefill_fused_kernel,
        kda_prefill_split_intra_kernel,
        kda_prefill_split_state_kernel,
    )
    from schedules.kda_prefill_tc import kda_prefill_intra_tc_kernel, kda_prefill_state_tc_kernel
    from targets import get_target

    spec = get_target("cuda-sm90a")
    bv = 32 if H >= 48 else 16
    fs = {"intra": kda_prefill_intra_tc_kernel(H, K, K, K ** -0.5),
          "state": kda_prefill_state_tc_kernel(H, K, K, block_v=bv, a_batch=8),
          # the fused form as relax_modules/kda.py dispatches it (from 48 heads)
          "fused": kda_prefill_fused_kernel(H, K, K, K ** -0.5, *prefill_dispatch(max(H, 48))[1:], p2_pairs=True, ldsm=True),
          # the split form (dispatched below 48 heads), preprocessed inputs
          "split_intra": kda_prefill_split_intra_kernel(H, K, K ** -0.5),
          "split_state": kda_prefill_split_state_kernel(H, K, K, K ** -0.5)}
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in fs.items()})
    with precompiled_cuda(spec.nvcc_arch, options=("--ptxas-options=--register-usage-level=5",)), \
            respect_manual_barriers():
        lib = tvm.compile(mod, target=spec.tvm_target())
    out.mkdir(parents=True, exist_ok=True)
    lib.export_library(str(out / "kda_prefill_tc.so"))
    print("built", out / "kda_prefill_tc.so")


def run(out: Path, H: int, T: int) -> None:
    import torch
    import tvm

    from k3_compile.device_code import load_cuda_runtime

    C = 64  # schedules.kda_prefill_cuda.C (that module needs the TVM compiler)

    load_cuda_runtime()
    lib = tvm.runtime.load_module(str(out / "kda_prefill_tc.so"))
    dev = torch.device("cuda")
    f = torch.float32
    q = torch.nn.functional.normalize(torch.randn(T, H, K, device=dev), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, device=dev), dim=-1)
    v = torch.randn(T, H, K, device=dev)
    g = -5 * torch.rand(T, H, K, device=dev)
    beta = torch.rand(T, H, device=dev)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    slots = torch.zeros(1, dtype=torch.int32, device=dev)
    nc = (T + C - 1) // C + 1
    scr = [torch.empty(T, H, K, dtype=f, device=dev) for _ in range(4)] + \
        [torch.empty(T, H, C, dtype=f, device=dev), torch.empty(nc, H, K, dtype=f, device=dev)]
    state = torch.zeros(1, 1, H, K, K, dtype=f, device=dev)
    o = torch.empty(T, H, K, dtype=f, device=dev)
    t = tvm.runtime.from_dlpack
    w, u, qg, kg, aqk, ge = (t(x) for x in scr)
    # split form scratch: e^Γ k, scale e^Γ q, e^{Γ_last−Γ} k, L / Aqk, D^{-1}; e^{Γ_last} per chunk
    ka, qa, kd, la, dinv = (t(torch.empty(T, H, n, dtype=f, device=dev)) for n in (K, K, K, C, 16))
    gl = t(torch.empty(nc, H, K, dtype=f, device=dev))
    for _ in range(2):
        lib["intra"](t(k), t(q), t(v), t(g), t(beta), t(cu), w, u, qg, kg, aqk, ge)
        lib["state"](w, u, qg, kg, aqk, ge, t(cu), t(slots), t(state), 0, t(o))
        lib["fused"](t(q), t(k), t(v), t(g), t(beta), t(cu), t(slots), t(state), 0, t(o))
        lib["split_intra"](t(q), t(k), t(g), t(beta), t(cu), ka, qa, kd, gl, la, dinv)
        lib["split_state"](ka, qa, kd, t(v), gl, la, dinv, t(beta), t(cu), t(slots), t(state), 0, t(o))
    torch.cuda.synchronize()


if __name__ == "__main__":
    step, out = sys.argv[1], Path(sys.argv[2])
    H = int(sys.argv[3]) if len(sys.argv) > 3 else 96
    if step == "build":
        build(out, H)
    else:
        run(out, H, int(sys.argv[4]) if len(sys.argv) > 4 else 8192)
