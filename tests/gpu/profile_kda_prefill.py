"""Profile the tensor-core KDA prefill kernels (schedules/kda_prefill_tc.py; the fused one of
schedules/kda_prefill_fused.py as ``fused``, its split form as ``split_intra`` and
``split_state``, each as the model dispatches them) at K3 shapes.

Here: ``python tests/gpu/profile_kda_prefill.py build dist/kdaprof [H]`` compiles the intra
(``hoist_loads``) and state kernels for ``H`` heads (96) into ``dist/kdaprof/kda_prefill_tc.so``.
GPU machine (runtime-only TVM): ``ncu --kernel-name regex:intra --launch-skip 1 --launch-count 1
--set full python3 tests/gpu/profile_kda_prefill.py run dist/kdaprof [H] [T]`` runs every
kernel twice on one sequence of ``T`` tokens (8192) with random inputs (q, k unit rows, g in
(-5, 0), β in (0, 1)). Timing only: nothing is checked (benchmarks/kda.py checks them).

``phases-build DIR [H]`` / ``phases-run DIR H RESULT.json``: the fused kernel as dispatched,
once whole and once without each part of a chunk's work (``ablate``: phase 1's copies, phase
2, D^{-1}, phase 3's products, phase 4, phase 5's S update, its o; then all of the math), timed
side by side at 8192 tokens and at 4 × 2048: the time a part saves is what it costs on the
chunk's critical path (its results are then wrong).

``split-build DIR [H]`` / ``split-run DIR H RESULT.json``: the split form's intra and state kernels
timed apart (as dispatched and with ``tmat``), and its state kernel at block_v 16 and 64 without
each part.

``overlap-build DIR [H]`` / ``overlap-run DIR H RESULT.json``: the split form in one PrimFunc
(kda_prefill_split_kernel) at one sequence of 8192 tokens, overlapped per lead and not, and a
trace of its blocks (who did how many intra items, when the state blocks started their chunks).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
K = 128


def _export(fs: dict, out: Path, name: str) -> None:
    """``fs`` (symbol → PrimFunc) compiled for cuda-sm90a (device code by nvcc, ptxas register
    usage level 5 as benchmarks/kda.py) into ``out / name``."""
    import tvm

    from k3_compile.device_code import precompiled_cuda
    from schedules.barriers import respect_manual_barriers
    from targets import get_target

    spec = get_target("cuda-sm90a")
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in fs.items()})
    with precompiled_cuda(spec.nvcc_arch, options=("--ptxas-options=--register-usage-level=5",)), \
            respect_manual_barriers():
        lib = tvm.compile(mod, target=spec.tvm_target())
    out.mkdir(parents=True, exist_ok=True)
    lib.export_library(str(out / name))
    print("built", out / name)


def _time_interleaved(calls: dict, rounds: int = 5, reps: int = 5) -> dict:
    """ms per call of each of ``calls`` (name → callable launching GPU work): each called once
    to warm up, then ``rounds`` interleaved rounds of ``reps`` back-to-back calls timed by CUDA
    events; the median round."""
    import statistics

    import torch

    for fn in calls.values():
        fn()
    times = {n: [] for n in calls}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for n, fn in calls.items():
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[n].append(start.elapsed_time(end) / reps)
    return {n: statistics.median(v) for n, v in times.items()}


def _result_header(H: int) -> dict:
    """The machine, date, commit ($K3_COMMIT where set: the GPU machine's .git may be stale),
    head count and gate lower bound of a result JSON."""
    import time

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cuda_timing import git_commit

    return {"machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
            "heads": H, "lower_bound": LOWER_BOUND, "shapes": []}


def _raw_inputs(lens: tuple, H: int) -> dict:
    """Random raw inputs of the kernels with their own L2 norms, gate and β on the GPU: q, k,
    v, f [T, H, K], b [T, H], A_log [H], dt_bias [H·K], cu_seqlens of ``lens``, seq_slots, a zero
    state [1, B, H, K, K] and o [T, H, K] (float32)."""
    import torch

    dev = torch.device("cuda")
    T, B = sum(lens), len(lens)
    x = {n: torch.randn(T, H, K, device=dev) for n in ("q", "k", "v", "f")}
    x["b"] = torch.randn(T, H, device=dev)
    x["A_log"] = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
    x["dt_bias"] = torch.randn(H * K, device=dev) * 0.5
    x["cu"] = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(B)], dtype=torch.int32, device=dev)
    x["slots"] = torch.arange(B, dtype=torch.int32, device=dev)
    x["state"] = torch.zeros(1, B, H, K, K, device=dev)
    x["o"] = torch.empty(T, H, K, device=dev)
    return x


def _split_scratch(T: int, B: int, H: int) -> list:
    """The split form's intra outputs for ``T`` tokens in ``B`` sequences, as torch float32 tensors
    on the GPU in the kernels' argument order: ka, qa, kd [T, H, K], gl [T // 64 + B, H, K], la
    [T, H, 64], dinv [T, H, 16]."""
    import torch

    dev = torch.device("cuda")
    return ([torch.empty(T, H, n, device=dev) for n in (K, K, K)] + [torch.empty(T // 64 + B, H, K, device=dev)]
            + [torch.empty(T, H, n, device=dev) for n in (64, 16)])


def build(out: Path, H: int) -> None:
    from relax_modules.kda import prefill_dispatch
    from schedules.kda_prefill_fused import (
        kda_prefill_fused_kernel,
        kda_prefill_split_intra_kernel,
        kda_prefill_split_state_kernel,
    )
    from schedules.kda_prefill_tc import kda_prefill_intra_tc_kernel, kda_prefill_state_tc_kernel

    bv = 32 if H >= 48 else 16
    fs = {"intra": kda_prefill_intra_tc_kernel(H, K, K, K ** -0.5),
          "state": kda_prefill_state_tc_kernel(H, K, K, block_v=bv, a_batch=8),
          # the fused form as relax_modules/kda.py dispatches it (from 48 heads)
          # (preprocessed inputs: fast_gate only acts on the in-kernel gate)
          "fused": kda_prefill_fused_kernel(H, K, K, K ** -0.5, *prefill_dispatch(max(H, 48))[1:], p2_one=True, ldsm=True,
                                            v_async=True, o_vec=True),
          # the split form (dispatched below 48 heads), preprocessed inputs
          "split_intra": kda_prefill_split_intra_kernel(H, K, K ** -0.5, p2_one=True, tmat=True),
          "split_state": kda_prefill_split_state_kernel(H, K, K, K ** -0.5, o_vec=True, tmat=True, pipe=True,
                                                        v_early=True)}
    _export(fs, out, "kda_prefill_tc.so")


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


# the ablations of ``phases``: (name, phases left out of the fused kernel); "none" is the kernel
# as the model dispatches it (BASE_OPTIONS, as relax_modules/kda.py: the L2 norms, gate and β
# inside). The runs of 2026-12-01 (kda_prefill_phases_h200_2026-12-01.json, ``_b_``) were made
# before v_async and fast_gate were dispatched: their "none" had both off.
ABLATIONS = (("none", ()), ("stage", ("stage",)), ("p2", ("p2",)), ("dinv", ("dinv",)), ("p3", ("p3",)),
             ("p4", ("p4",)), ("s", ("s",)), ("o", ("o",)),
             ("all_mma", ("p2", "dinv", "p3", "p4", "s", "o")),
             # ... and then the rest, part by part, down to the copies and barriers alone
             ("no_gamma", ("p2", "dinv", "p3", "p4", "s", "o", "gamma")),
             ("no_vl", ("p2", "dinv", "p3", "p4", "s", "o", "gamma", "vl")),
             ("no_stores", ("p2", "dinv", "p3", "p4", "s", "o", "gamma", "vl", "scopy", "ost")),
             ("barriers", ("p2", "dinv", "p3", "p4", "s", "o", "gamma", "vl", "scopy", "ost", "stage")),
             ("gamma", ("gamma",)), ("cumsum", ("cumsum",)), ("norms", ("norms",)))
LOWER_BOUND = -5.0
# (kda_prefill_phases_c_h200_2026-12-01.json was measured before o_vec joined the dispatch)
BASE_OPTIONS = {"p2_one": True, "ldsm": True, "v_async": True, "fast_gate": True, "o_vec": True,
                "lower_bound": LOWER_BOUND}
# the same kernel with options changed, timed beside it and its o compared (name, options);
# "pairs": phase 2 in the two paired rounds dispatched before p2_one
OPTION_VARIANTS = (("no_v_async", {"v_async": False}), ("no_fast_gate", {"fast_gate": False}),
                   ("neither", {"v_async": False, "fast_gate": False}),
                   ("pairs", {"p2_one": False, "p2_pairs": True, "p2_wide": True}))


def build_phases(out: Path, H: int) -> None:
    """The fused kernel as dispatched at ``H`` heads, once per entry of ABLATIONS and of
    OPTION_VARIANTS (``kda_prefill_phases.so``, functions ``fused_<name>``)."""
    from relax_modules.kda import prefill_dispatch
    from schedules.kda_prefill_fused import kda_prefill_fused_kernel

    bv, ab = prefill_dispatch(max(H, 48))[1:]
    fs = {f"fused_{name}": kda_prefill_fused_kernel(H, K, K, K ** -0.5, block_v=bv, a_batch=ab, **BASE_OPTIONS,
                                                    ablate=frozenset(abl))
          for name, abl in ABLATIONS}
    fs.update({f"fused_{name}": kda_prefill_fused_kernel(H, K, K, K ** -0.5, block_v=bv, a_batch=ab,
                                                         **{**BASE_OPTIONS, **opts})
               for name, opts in OPTION_VARIANTS})
    _export(fs, out, "kda_prefill_phases.so")


def run_phases(out: Path, H: int, result: Path) -> None:
    """Time each ablation at one sequence of 8192 tokens and at 4 × 2048 (CUDA events, median of
    5 interleaved rounds of 5 calls) → ``result`` (JSON): ms per variant, and per left-out part
    the time it saves (its cost on the critical path)."""
    import json

    import torch
    import tvm

    from k3_compile.device_code import load_cuda_runtime

    load_cuda_runtime()
    lib = tvm.runtime.load_module(str(out / "kda_prefill_phases.so"))
    t = tvm.runtime.from_dlpack
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = _result_header(H)
    for lens in ((8192,), (2048,) * 4):
        B = len(lens)
        x = _raw_inputs(lens, H)
        state, o = x["state"], x["o"]
        args = [t(x[n]) for n in ("q", "k", "v", "f", "b", "A_log", "dt_bias", "cu", "slots", "state")] + [0, t(o)]
        names = [n for n, _ in ABLATIONS] + [n for n, _ in OPTION_VARIANTS]
        ms = _time_interleaved({n: (lambda f=lib[f"fused_{n}"]: f(*args)) for n in names})
        # checks: the option variants' o against the dispatched kernel's (same inputs, zero state)
        o_ref = None
        diff = {}
        for name in ["none"] + [n for n, _ in OPTION_VARIANTS]:
            state.zero_()
            o.fill_(float("nan"))   # a kernel that wrote nothing must not pass
            lib[f"fused_{name}"](*args)
            torch.cuda.synchronize()
            if o_ref is None:
                o_ref = o.clone()
            else:
                diff[name] = (o - o_ref).abs().max().item()
        row = {"lens": list(lens), "ms": ms, "max_abs_diff_vs_none": diff,
               "saved_ms": {n: ms["none"] - v for n, v in ms.items() if n != "none"},
               # one block per (sequence, head) at one block per SM: ⌈B·H / SMs⌉ waves of lens[0] / 64 chunks
               "per_chunk_us": {n: v * 1e3 / (lens[0] // 64) / -(-B * H // sms) for n, v in ms.items()}}
        print(json.dumps(row))
        res["shapes"].append(row)
    result.write_text(json.dumps(res, indent=1))


# the split form at ``split-build`` / ``split-run``: its two kernels as dispatched until 2026-12-01
# (``ofv``), with ``tmat`` (phase 4 as vn = T R), ``pipe`` and ``v_early`` (as dispatched now), and
# the state kernel at a fixed block_v with parts left out
# (wu's "ofvw" / "ofvwp", removed after commit b1c4675: kda_prefill_split_parts_wu_h200_2026-12-01.json)
SPLIT_INTRA = {"ofv": {"p2_one": True, "fast_gate": True}, "ofvt": {"p2_one": True, "fast_gate": True, "tmat": True}}
SPLIT_STATE = {"ofv": {"o_vec": True}, "ofvt": {"o_vec": True, "tmat": True},
               "ofvtp": {"o_vec": True, "tmat": True, "pipe": True},
               "ofvtpv": {"o_vec": True, "tmat": True, "pipe": True, "v_early": True}}   # (as dispatched)
# the intra variant whose outputs each state variant takes (tmat changes what la holds)
STATE_INTRA = {"ofv": "ofv", "ofvt": "ofvt", "ofvtp": "ofvt", "ofvtpv": "ofvt"}
SPLIT_ABLATIONS = (("none", ()), ("stage", ("stage",)), ("vl", ("vl",)), ("p3", ("p3",)), ("p4", ("p4",)),
                   ("s", ("s",)), ("o", ("o",)), ("ost", ("ost",)), ("all_mma", ("p3", "p4", "s", "o")),
                   ("barriers", ("stage", "vl", "p3", "p4", "s", "scopy", "o", "ost")))
SPLIT_ABLATION_BV = (16, 64)   # the run-time block_v at 12 heads for one sequence / four


def build_split(out: Path, H: int) -> None:
    """``kda_prefill_split_parts.so``: ``intra_<v>`` / ``state_<v>`` per SPLIT_INTRA / SPLIT_STATE
    entry (L2 norms, gate and β in the intra kernel) and ``state_bv<BV>_<name>`` per
    SPLIT_ABLATIONS entry (``tmat``)."""
    from schedules.kda_prefill_fused import (
        kda_prefill_fused_kernel,
        kda_prefill_split_intra_kernel,
        kda_prefill_split_state_kernel,
    )

    fs = {}
    for v, o in SPLIT_INTRA.items():
        fs[f"intra_{v}"] = kda_prefill_split_intra_kernel(H, K, K ** -0.5, lower_bound=LOWER_BOUND, **o)
    for v, o in SPLIT_STATE.items():   # (a state variant runs on the outputs of intra_<STATE_INTRA[v]>)
        fs[f"state_{v}"] = kda_prefill_split_state_kernel(H, K, K, K ** -0.5, lower_bound=LOWER_BOUND, **o)
    for bv in SPLIT_ABLATION_BV:
        for name, abl in SPLIT_ABLATIONS:
            fs[f"state_bv{bv}_{name}"] = kda_prefill_fused_kernel(
                H, K, K, K ** -0.5, block_v=bv, a_batch=8, split=True, lower_bound=LOWER_BOUND,
                ablate=frozenset(abl), **SPLIT_STATE["ofvt"])
    _export(fs, out, "kda_prefill_split_parts.so")


def run_split(out: Path, H: int, result: Path) -> None:
    """Each kernel of ``build_split`` timed alone (CUDA events, median of 5 interleaved rounds of 5
    calls) at one sequence of 8192 tokens and at 4 × 2048 → ``result`` (JSON), and the dispatched
    pair's o against the other pairs' (same inputs, zero state)."""
    import json

    import torch
    import tvm

    from k3_compile.device_code import load_cuda_runtime

    load_cuda_runtime()
    lib = tvm.runtime.load_module(str(out / "kda_prefill_split_parts.so"))
    dev = torch.device("cuda")
    t = tvm.runtime.from_dlpack
    C = 64
    res = _result_header(H)
    for lens in ((8192,), (2048,) * 4):
        T, B = sum(lens), len(lens)
        x = _raw_inputs(lens, H)
        q, k, v, f, b, A_log, dt_bias, cu, slots, state, o = (
            x[n] for n in ("q", "k", "v", "f", "b", "A_log", "dt_bias", "cu", "slots", "state", "o"))
        scratch = {v_: [t(x_) for x_ in _split_scratch(T, B, H)] for v_ in SPLIT_INTRA}
        intra_args = {v_: [t(x) for x in (q, k, f, b, A_log, dt_bias, cu)] + scratch[v_] for v_ in SPLIT_INTRA}

        def state_args(v_):
            ka, qa, kd, gl, la, dinv = scratch[v_]
            return [ka, qa, kd, t(v), gl, la, dinv, t(b), t(cu), t(slots), t(state), 0, t(o)]

        calls = {f"intra_{v_}": (lambda v_=v_: lib[f"intra_{v_}"](*intra_args[v_])) for v_ in SPLIT_INTRA}
        calls.update({f"state_{v_}": (lambda v_=v_: lib[f"state_{v_}"](*state_args(STATE_INTRA[v_])))
                      for v_ in SPLIT_STATE})
        calls.update({f"state_bv{bv}_{n}": (lambda n=n, bv=bv: lib[f"state_bv{bv}_{n}"](*state_args("ofvt")))
                      for bv in SPLIT_ABLATION_BV for n, _ in SPLIT_ABLATIONS})
        outs = {}
        for v_ in SPLIT_STATE:   # each pair once on a zero state: the o to compare
            state.zero_()
            o.fill_(float("nan"))
            calls[f"intra_{STATE_INTRA[v_]}"]()
            calls[f"state_{v_}"]()
            torch.cuda.synchronize()
            outs[v_] = o.clone()
        ms = _time_interleaved(calls)
        row = {"lens": list(lens), "ms": ms,
               "pair_ms": {v_: ms[f"intra_{STATE_INTRA[v_]}"] + ms[f"state_{v_}"] for v_ in SPLIT_STATE},
               "max_abs_diff_vs_ofv": {v_: (outs[v_] - outs["ofv"]).abs().max().item() for v_ in SPLIT_STATE if v_ != "ofv"},
               "max_abs_o": outs["ofv"].abs().max().item(),
               "saved_ms": {f"bv{bv}_{n}": ms[f"state_bv{bv}_none"] - ms[f"state_bv{bv}_{n}"]
                            for bv in SPLIT_ABLATION_BV for n, _ in SPLIT_ABLATIONS if n != "none"},
               "per_chunk_us": {f"bv{bv}_{n}": ms[f"state_bv{bv}_{n}"] * 1e3 / (lens[0] // C)
                                for bv in SPLIT_ABLATION_BV for n, _ in SPLIT_ABLATIONS}}
        print(json.dumps(row))
        res["shapes"].append(row)
    result.write_text(json.dumps(res, indent=1))


OVERLAP_BV32_LEADS = (0, 10, 25)
OVERLAP_LEADS = (50,)   # (10, 25, 40: kda_prefill_overlap_trace_a_h200_2026-12-01.json; 40, 50, 60: _b; 40, 50, 100: _c; 45, 50, 55: _d1-3)


def build_overlap(out: Path, H: int) -> None:
    """``kda_prefill_overlap.so``: kda_prefill_split_kernel (L2 norms, gate and β inside) as
    ``split_l<lead>`` per OVERLAP_LEADS, ``split_seq`` without the overlap, and ``trace_l<lead>``
    with the per-block trace."""
    from schedules.kda_prefill_fused import kda_prefill_split_kernel

    fs = {"split_seq": kda_prefill_split_kernel(H, K, K, K ** -0.5, lower_bound=LOWER_BOUND, overlap=False)}
    for lead in OVERLAP_BV32_LEADS:   # the overlapped form at 32 columns: half the state blocks, more workers
        fs[f"split_bv32_l{lead}"] = kda_prefill_split_kernel(H, K, K, K ** -0.5, lower_bound=LOWER_BOUND, lead=lead,
                                                             overlap_block_v=32)
    for lead in OVERLAP_LEADS:
        fs[f"split_l{lead}"] = kda_prefill_split_kernel(H, K, K, K ** -0.5, lower_bound=LOWER_BOUND, lead=lead)
        fs[f"trace_l{lead}"] = kda_prefill_split_kernel(H, K, K, K ** -0.5, lower_bound=LOWER_BOUND, lead=lead,
                                                        trace=True)
    _export(fs, out, "kda_prefill_overlap.so")


def run_overlap(out: Path, H: int, result: Path) -> None:
    """One sequence of 8192 tokens: each kernel of ``build_overlap`` timed (CUDA events, median of
    5 interleaved rounds of 5 calls, the flags zeroed in each call), then one traced call per lead
    summarized per role (state blocks, intra workers): items done, when each stopped claiming
    and ended (µs after the first block's start), distinct SMs → ``result`` (JSON)."""
    import json
    import statistics

    import torch
    import tvm

    from k3_compile.device_code import load_cuda_runtime

    OVERLAP_BLOCK_V = 32   # = schedules.kda_prefill_fused.OVERLAP_BLOCK_V (that module needs the TVM compiler)
    load_cuda_runtime()
    lib = tvm.runtime.load_module(str(out / "kda_prefill_overlap.so"))
    dev = torch.device("cuda")
    t = tvm.runtime.from_dlpack
    C = 64
    res = _result_header(H)
    lens = (8192,)
    T, B = sum(lens), len(lens)
    x = _raw_inputs(lens, H)
    n_items = (T // C + B) * H
    flags = torch.zeros(2 + n_items + 6 * 132, dtype=torch.int32, device=dev)
    scratch = _split_scratch(T, B, H)
    args = ([t(x[n]) for n in ("q", "k", "f", "b", "A_log", "dt_bias", "cu", "slots", "v", "state")] + [t(flags), 0]
            + [t(s_) for s_ in scratch] + [t(x["o"])])
    names = (["split_seq"] + [f"{p}_l{lead}" for lead in OVERLAP_LEADS for p in ("split", "trace")]
             + [f"split_bv32_l{lead}" for lead in OVERLAP_BV32_LEADS])
    ms = _time_interleaved({n: (lambda n=n: (flags.zero_(), lib[n](*args))) for n in names})
    row = {"lens": list(lens), "ms": ms, "trace": {}}
    for lead in OVERLAP_LEADS:
        flags.zero_()
        lib[f"trace_l{lead}"](*args)
        torch.cuda.synchronize()
        tr = flags[2 + n_items:].view(132, 6).cpu().numpy().astype("int64")
        t0 = tr[:, 2].min()
        us = lambda col: ((tr[:, col] - t0) % (1 << 32)) / 1e3   # noqa: E731
        ns = H * K // OVERLAP_BLOCK_V   # state blocks
        summary = {}
        for role, sel in (("state", tr[:, 0] < ns), ("worker", tr[:, 0] >= ns)):
            def stats(a, sel=sel):
                a = a[sel]
                return [round(float(a.min()), 1), round(float(statistics.median(a)), 1), round(float(a.max()), 1)] \
                    if len(a) else None
            summary[role] = {"blocks": int(sel.sum()), "items_min_median_max": stats(tr[:, 1].astype(float)),
                             "stop_claiming_us": stats(us(3)), "end_us": stats(us(4)),
                             "start_us": stats(us(2))}
        summary["distinct_sms"] = int(len(set(tr[:, 5].tolist())))
        summary["items_total"] = int(tr[:, 1].sum())
        row["trace"][f"l{lead}"] = summary
    print(json.dumps(row))
    res["shapes"].append(row)
    result.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    step, out = sys.argv[1], Path(sys.argv[2])
    H = int(sys.argv[3]) if len(sys.argv) > 3 else 96
    if step == "build":
        build(out, H)
    elif step == "phases-build":   # the fused kernel with parts left out (ABLATIONS)
        build_phases(out, H)
    elif step == "phases-run":     # ... timed: phases-run DIR H RESULT.json (H as at phases-build)
        run_phases(out, H, Path(sys.argv[4]))
    elif step == "split-build":    # the split form's kernels alone, and its state kernel's parts
        build_split(out, H)
    elif step == "split-run":      # ... timed: split-run DIR H RESULT.json
        run_split(out, H, Path(sys.argv[4]))
    elif step == "overlap-build":  # the split form in one PrimFunc, overlapped for one sequence
        build_overlap(out, H)
    elif step == "overlap-run":    # ... timed and traced: overlap-run DIR H RESULT.json
        run_overlap(out, H, Path(sys.argv[4]))
    else:
        run(out, H, int(sys.argv[4]) if len(sys.argv) > 4 else 8192)
