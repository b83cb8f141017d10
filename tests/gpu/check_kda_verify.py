"""The fused KDA verify kernel (schedules/kda_decode_cuda.py ``kda_verify_fused_kernel``: a few
tokens per sequence for speculative verification, the intermediate states kept for rollback)
against fla's naive recurrence, and timed against the same tokens as separate decode steps,
on the H200.

Here (with nvcc): ``python tests/gpu/check_kda_verify.py build dist/kdaverify``. There
(runtime-only TVM, torch, fla): ``python3 tests/gpu/check_kda_verify.py run dist/kdaverify
out.json``.

Checks (odd batches, scattered pool slots in a two-layer pool written at layer 1, both gate
forms, five tilings, the model's among them and one with more threads than K; outputs
NaN-filled beforehand): every token's output, the final state in the pool, each kept state
against ``naive_recurrent_kda`` over that prefix of the tokens, and that the other layer and
the unused slots are untouched. Timing (K3 head_dim 128; 96 and 12 heads; CUDA-graph replays,
each call on its own copy of the state pool and of ``states`` so the state comes from HBM):
one verify call against ``tokens`` times one cold decode step (in a model the other layers'
traffic evicts a layer's state between steps), and against the roofline of its bytes (one
state read, ``tokens`` state writes) at the measured copy bandwidth.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

K = V = 128
LB = -5.0
# (heads, tokens, batch, gate, tiling (cols_per_block, k_split, vec))
CHECKS = [(12, 2, 3, LB, (64, 4, 2)), (12, 4, 5, None, (64, 4, 2)), (96, 7, 3, LB, (64, 4, 2)),
          (12, 3, 4, LB, (32, 4, 1)), (12, 4, 5, None, (64, 2, 1)), (12, 3, 3, LB, (64, 8, 4)),
          (12, 2, 3, None, (64, 8, 2))]   # 256 threads for K = 128 rows: half the block stages
TIMINGS = [(96, 4, 16), (96, 4, 64), (12, 4, 16), (12, 4, 64), (96, 2, 16)]  # (heads, tokens, batch)
TILING = (64, 4, 2)   # as the model's decode (schedules.kda_decode_cuda.decode_tiling(128))


def _name(kind: str, h: int, tv: int, lb, tiling=TILING) -> str:
    return f"{kind}_h{h}_t{tv}_{'lb' if lb is not None else 'sp'}_c{tiling[0]}k{tiling[1]}v{tiling[2]}"


def build(out: Path) -> None:
    """Every verify kernel of CHECKS and TIMINGS and the decode kernels they are timed
    against, one library each."""
    import tvm

    from k3_compile.device_code import precompiled_cuda
    from schedules.kda_decode_cuda import kda_decode_fused_kernel, kda_verify_fused_kernel
    from targets import get_target

    spec = get_target("cuda-sm90a")
    out.mkdir(parents=True, exist_ok=True)
    fs = {_name("verify", h, tv, lb, t): kda_verify_fused_kernel(h, K, V, lb, tv, *t) for h, tv, _, lb, t in CHECKS}
    fs.update({_name("verify", h, tv, LB): kda_verify_fused_kernel(h, K, V, LB, tv, *TILING) for h, tv, _ in TIMINGS})
    fs.update({_name("decode", h, 1, LB): kda_decode_fused_kernel(h, K, V, LB, *TILING) for h, _, _ in TIMINGS})
    for name, f in fs.items():
        with precompiled_cuda(spec.nvcc_arch):
            lib = tvm.compile(tvm.IRModule({"k": f.with_attr("global_symbol", "k")}), target=spec.tvm_target())
        lib.export_library(str(out / f"{name}.so"))
        print(f"built {out / name}.so")


def run(lib_dir: Path, out_json: Path) -> int:
    import torch
    import tvm
    from fla.ops.kda.naive import naive_recurrent_kda

    from cuda_timing import copies_for, copy_bandwidth, git_commit, rotate, time_cuda_graph
    from k3_compile.device_code import load_cuda_runtime

    load_cuda_runtime()
    dev = torch.device("cuda")
    tv_ = tvm.runtime.from_dlpack
    load = lambda name: tvm.runtime.load_module(str(lib_dir / f"{name}.so"))["k"]  # noqa: E731
    torch.manual_seed(0)
    res = {"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
           "tiling": TILING, "check": [], "timing": []}
    bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = bw / 1e9

    def inputs(H, TV, B):
        x = {n: torch.randn(B, TV, H, K, device=dev) for n in ("q", "k", "f")}
        x["v"] = torch.randn(B, TV, H, V, device=dev)
        x["b"] = torch.randn(B, TV, H, device=dev)
        x["A_log"] = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
        x["dt_bias"] = torch.randn(H * K, device=dev) * 0.5
        x["slots"] = torch.randperm(B + 2, device=dev, dtype=torch.int32)[:B]   # scattered slots
        x["S0"] = torch.randn(B, H, K, V, device=dev) * 0.1
        pool = torch.zeros(2, B + 2, H, K, V, device=dev)   # two layers: the kernel writes layer 1
        pool[1, x["slots"].long()] = x["S0"]
        pool[0] = 7.0
        x["pool"] = pool
        return x

    bad = []
    for H, TV, B, lb, tiling in CHECKS:
        x = inputs(H, TV, B)
        o = torch.full((B, TV, H, V), float("nan"), device=dev)
        states = torch.full((B, TV - 1, H, K, V), float("nan"), device=dev)
        load(_name("verify", H, TV, lb, tiling))(*(tv_(x[n]) for n in ("q", "k", "v", "f", "b", "A_log", "dt_bias",
                                                                    "slots", "pool")), 1, tv_(o), tv_(states))
        torch.cuda.synchronize()
        z = torch.exp(x["A_log"])[None, None, :, None] * (x["f"] + x["dt_bias"].view(1, 1, H, K))
        g = lb * torch.sigmoid(z) if lb is not None else \
            -torch.exp(x["A_log"])[None, None, :, None] * torch.nn.functional.softplus(x["f"] + x["dt_bias"].view(1, 1, H, K))
        l2 = lambda a: a / torch.sqrt((a * a).sum(-1, keepdim=True) + 1e-6)  # noqa: E731

        def naive(n):
            return naive_recurrent_kda(l2(x["q"][:, :n]), l2(x["k"][:, :n]), x["v"][:, :n], g[:, :n],
                                       torch.sigmoid(x["b"][:, :n]), initial_state=x["S0"], output_final_state=True)

        o_ref, S_ref = naive(TV)
        # NaN-propagating maxima: torch's max of a tensor with NaN is NaN, and NaN < tol is false
        row = {"heads": H, "tokens": TV, "batch": B, "gate": "lower_bound" if lb is not None else "softplus",
               "tiling": tiling, "max_err_o": (o - o_ref).abs().max().item(),
               "max_err_final_state": (x["pool"][1, x["slots"].long()] - S_ref).abs().max().item(),
               "max_err_kept_states": torch.stack([(states[:, n - 1] - naive(n)[1]).abs().max()
                                                   for n in range(1, TV)]).max().item(),
               "untouched": bool((x["pool"][1, [i for i in range(B + 2) if i not in x["slots"].tolist()]] == 0).all()
                                 and (x["pool"][0] == 7.0).all())}
        row["ok"] = (row["max_err_o"] < 1e-4 and row["max_err_final_state"] < 1e-4 and row["max_err_kept_states"] < 1e-4
                     and row["untouched"])
        res["check"].append(row)
        print(json.dumps(row), flush=True)
        if not row["ok"]:
            bad.append(row)

    for H, TV, B in TIMINGS:
        x = inputs(H, TV, B)
        verify, decode = load(_name("verify", H, TV, LB)), load(_name("decode", H, 1, LB))
        o = torch.empty(B, TV, H, V, device=dev)
        o1 = torch.empty(B, H, V, device=dev)
        state = B * H * K * V * 4
        # every call on its own pool and kept-states buffer (no copy reused before 512 MiB of
        # other copies have passed: the state is read from HBM, as in a model step)
        nrot = copies_for(state * (TV + 1))
        pools = [x["pool"]] + [x["pool"].clone() for _ in range(nrot - 1)]
        kept = [torch.empty(B, TV - 1, H, K, V, device=dev) for _ in range(nrot)]
        common = [tv_(x[n]) for n in ("A_log", "dt_bias", "slots")]
        vargs = [tv_(x[n]) for n in ("q", "k", "v", "f", "b")]
        dargs = [tv_(x[n][:, 0].contiguous()) for n in ("q", "k", "v", "f", "b")]
        verify_calls = [lambda p=tv_(p), st=tv_(st): verify(*vargs, *common, p, 1, tv_(o), st)
                        for p, st in zip(pools, kept)]
        decode_calls = [lambda p=tv_(p): decode(*dargs, *common, p, 1, tv_(o1)) for p in pools]
        t_verify = time_cuda_graph(rotate(verify_calls))
        t_decode = TV * time_cuda_graph(rotate(decode_calls))
        roof_ms = (1 + TV) * state / bw * 1e3           # one read, TV writes (TV - 1 kept + the pool)
        roof_dec = 2 * TV * state / bw * 1e3            # a read and a write per decode step
        row = {"heads": H, "tokens": TV, "batch": B, "verify_graph_ms": t_verify,
               "decode_steps_graph_ms": t_decode, "decode_steps": f"{TV} x one cold decode step", "speedup_vs_decode_steps": t_decode / t_verify,
               "verify_roofline_ms": roof_ms, "verify_pct_roofline": 100 * roof_ms / t_verify,
               "decode_steps_pct_roofline": 100 * roof_dec / t_decode, "state_copies_rotated": nrot}
        res["timing"].append(row)
        print(json.dumps(row), flush=True)
        del pools, kept

    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(res, indent=1))
    for r in bad:
        print(f"FAILED: {r}")
    return 1 if bad else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "build":
        build(Path(argv[1]))
        return 0
    if len(argv) >= 3 and argv[0] == "run":
        return run(Path(argv[1]), Path(argv[2]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
