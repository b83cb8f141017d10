"""k3-nano on a CUDA GPU with the runtime-only TVM: correctness against the CPU build, speed.

Two steps, on two machines:

``python tests/gpu/run_nano_cuda.py prepare [--out dist/nano]`` (here: TVM compiler, no GPU)
    compiles k3-nano for ``cuda-sm90a`` in fp32 and bf16 (``k3_compile.build.build_module``,
    device code precompiled to a fatbin), writes the parameter lists, pre-tokenizes the four
    prompts of tests/test_model.py, and runs the CPU (llvm) engine for the references:
    all-position fp32 logits, 32 greedy tokens (fp32 and bf16). Also a library of the
    hand-written GPU kernels alone, with inputs and the CPU variants' outputs, so a failure
    can be traced to one kernel.

``python tests/gpu/run_nano_cuda.py run [--out dist/nano] [--json $OUT/nano_cuda.json]`` (GPU)
    needs only the runtime-only TVM (``source .tvm-rt/env.sh``), numpy and ml_dtypes:
    no ``tvm.relax`` import (checked), no tokenizer, no nvcc. Loads
    ``libtvm_runtime_cuda.so`` (k3_compile.device_code.load_cuda_runtime), the libraries and
    the checkpoint (k3_compile.weights parses safetensors with numpy), runs the kernel checks,
    then prefill + 32 greedy decode tokens per prompt through k3_compile.runtime.engine.Engine,
    compares (fp32: all-position logits within 1e-3 of the CPU build, greedy tokens
    identical; bf16: tokens reported), measures prefill / decode tokens/s at batch 1 and 8
    and GPU memory, and writes a JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

NANO = ROOT / "models" / "k3-nano"
TARGET = "cuda-sm90a"
DTYPES = ("float32", "bfloat16")
N_GREEDY = 32
LOGIT_ATOL = 1e-3
# a bf16 greedy mismatch counts as a near-tie when the CPU token's logit is this fraction of the
# largest logit's magnitude or less below the GPU's argmax (seen: 0.33 of 9.6, 3.4%, prompt 0 step 3)
NEAR_TIE = 0.05
PROMPTS = [  # tests/test_model.py PROMPTS
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\nclass Path:\n",
    ".. function:: open(file, mode='r')\n\n   Open *file* and return a",
    "The :mod:`json` module provides",
]
# a prompt of at least k3_compile.build.WGMMA_FROM (256) tokens: its prefill runs the dense
# projections on the prefill kernel (schedules/dense_prefill_wgmma.py, bf16 build)
LONG_PROMPT = """import json
from pathlib import Path


class Config:
    \"\"\"Settings read from a JSON file, with defaults for the missing keys.\"\"\"

    defaults = {"name": "model", "layers": 4, "hidden": 256, "dropout": 0.1}

    def __init__(self, path):
        self.path = Path(path)
        with open(self.path) as f:
            data = json.load(f)
        for key, value in self.defaults.items():
            setattr(self, key, data.get(key, value))

    def to_dict(self):
        return {key: getattr(self, key) for key in self.defaults}

    def save(self, path=None):
        target = Path(path) if path is not None else self.path
        target.write_text(json.dumps(self.to_dict(), indent=2))
        return target


def load_all(directory):
    \"\"\"Return a list of every config in ``directory``.\"\"\"
    configs = []
    for p in sorted(Path(directory).glob("*.json")):
        configs.append(Config(p))
    return configs
"""
LONG_STRIDE = 8
ENGINE_KW = dict(max_slots=20, num_pages=640, page_size=16)


def _lib_name(dtype: str) -> str:
    return f"k3nano_{'f32' if dtype == 'float32' else 'bf16'}_sm90a.so"


# ------------------------------------------------------------------------------ kernels
def _kernel_cases():
    """(name, builder(gpu) -> PrimFunc, inputs list, index of outputs to compare, atol).

    Inputs are numpy arrays or python ints (scalars); every array argument after the
    inputs the kernel writes is compared."""
    from schedules import cache_ops as co
    from schedules import kda_generic as kg
    from schedules import moe_generic as mg

    rng = np.random.default_rng(0)
    H, K, W, D = 2, 64, 4, 256  # small, so the saved inputs stay small (the model has K=128)
    lens = [5, 1, 70, 3]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1])
    tseq = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
    slots = np.array([3, 0, 2, 1], np.int32)
    f32 = np.float32

    def unit(x):
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(f32)

    conv_state = rng.standard_normal((2, 4, 3, W - 1, D)).astype(f32)
    kda_state = (0.1 * rng.standard_normal((2, 4, H, K, K))).astype(f32)
    pool = rng.standard_normal((2, 5, 3 * 8 * 9)).astype(f32)
    q, k = unit(rng.standard_normal((T, H, K))), unit(rng.standard_normal((T, H, K)))
    v = rng.standard_normal((T, H, K)).astype(f32)
    g = (-0.1 * rng.random((T, H, K))).astype(f32)
    beta = rng.random((T, H)).astype(f32)
    B = len(lens)
    E, TOPK, N, KIN = 8, 4, 256, 128
    cases = [
        ("short_conv", lambda gpu: kg.short_conv_kernel(D, W, "float32", gpu=gpu),
         [rng.standard_normal((T, D)).astype(f32), rng.standard_normal((D, 1, W)).astype(f32),
          cu, tseq, slots, conv_state, 1, 2, np.zeros((T, D), f32)], [5, 8], 1e-5),
        ("kda_prefill", lambda gpu: kg.kda_chunk_prefill_kernel(H, K, K, K ** -0.5, gpu=gpu),
         [q, k, v, g, beta, cu, slots, kda_state, 1, np.zeros((T, H, K), f32)], [7, 9], 1e-4),
        ("kda_decode", lambda gpu: kg.kda_decode_kernel(H, K, K, K ** -0.5, gpu=gpu),
         [q[:B], k[:B], v[:B], g[:B], beta[:B], slots, kda_state, 1,
          np.zeros((B, H, K), f32)], [6, 8], 1e-5),
        ("slot_reset", lambda gpu: kg.slot_reset_kernel((3, 8, 9), gpu=gpu), [pool, 2], [0], 0.0),
        ("slot_copy", lambda gpu: kg.slot_copy_kernel((3, 8, 9), gpu=gpu), [pool, 2, 4], [0], 0.0),
        ("page_copy", lambda gpu: co.page_copy_kernel(3 * 8 * 9, "float32", gpu=gpu),
         [pool, 1, 3], [0], 0.0),
        ("moe_route", lambda gpu: mg.moe_route_kernel(E, TOPK, 2.5, True, gpu=gpu),
         [rng.standard_normal((T, E)).astype(f32), (0.1 * rng.standard_normal(E)).astype(f32),
          np.zeros((T, TOPK), np.int32), np.zeros((T, TOPK), f32)], [2, 3], 1e-6),
        ("mxfp4_gemv", lambda gpu: mg.mxfp4_gather_gemv_kernel(N, KIN, E, TOPK, False, gpu=gpu),
         [rng.standard_normal((T, KIN)).astype(f32),
          rng.integers(0, 256, (E, N, KIN // 2), dtype=np.uint8),
          rng.integers(120, 130, (E, N, KIN // 32), dtype=np.uint8),
          rng.integers(0, E, (T, TOPK), dtype=np.int32), np.zeros((T, TOPK, N), f32)], [4], 1e-3),
        ("mxfp4_gemv_w2", lambda gpu: mg.mxfp4_gather_gemv_kernel(KIN, N, E, TOPK, True, gpu=gpu),
         [rng.standard_normal((T, TOPK, N)).astype(f32),
          rng.integers(0, 256, (E, KIN, N // 2), dtype=np.uint8),
          rng.integers(120, 130, (E, KIN, N // 32), dtype=np.uint8),
          rng.integers(0, E, (T, TOPK), dtype=np.int32), np.zeros((T, TOPK, KIN), f32)], [4], 1e-3),
        ("dense_gemv", lambda gpu: mg.gather_gemv_kernel(N, KIN, E, TOPK, False, gpu=gpu),
         [rng.standard_normal((T, KIN)).astype(f32), rng.standard_normal((E, N, KIN)).astype(f32),
          rng.integers(0, E, (T, TOPK), dtype=np.int32), np.zeros((T, TOPK, N), f32)], [3], 1e-3),
    ]
    return cases


def _call_kernel(f, args, dev):
    import tvm

    tv = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) if isinstance(a, np.ndarray) else a
          for a in args]
    f(*tv)
    return [t.numpy() if isinstance(a, np.ndarray) else None for a, t in zip(args, tv)]


def prepare_kernels(out: Path) -> None:
    import tvm

    from k3_compile.device_code import build_cuda
    from targets import get_target

    cases = _kernel_cases()
    gpu_funcs, cpu_funcs = {}, {}
    for name, build, *_ in cases:
        gpu_funcs[name] = build(True).with_attr("global_symbol", name)
        cpu_funcs[name] = build(False).with_attr("global_symbol", name)
    lib = build_cuda(tvm.IRModule(gpu_funcs), get_target(TARGET))
    lib.export_library(str(out / "kernels_sm90a.so"))
    cpu = tvm.compile(tvm.IRModule(cpu_funcs), target=tvm.target.Target({"kind": "llvm"}))
    data = {}
    for name, _, args, outs, _atol in cases:
        res = _call_kernel(cpu[name], args, tvm.cpu())
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                data[f"{name}/in{i}"] = a
        for i in outs:
            data[f"{name}/ref{i}"] = res[i]
    np.savez_compressed(out / "kernels_ref.npz", **data)


def _bf16_ok(r: dict) -> bool:
    """The bf16 build's verdict: the top-1 token of every checked prefill position as the fp32
    CPU build's, and the 32 greedy tokens of each prompt (1-token decode steps: the GEMV and the
    merged sibling projections) as the bf16 CPU build's, or a first mismatch that is a near-tie
    — the CPU's token within :data:`NEAR_TIE` of the largest logit's magnitude below this run's
    argmax, teacher-forced up to there (bf16 sums in another order flip such ties)."""
    if "error" in r:
        return False
    top1 = all(c["top1_agree"] == 1.0 for c in r.get("logits_vs_cpu_f32", [{"top1_agree": 0.0}]))
    ties = all(m is None or m["gap"] <= NEAR_TIE * m["max_abs_logit"]
               for m in r.get("greedy_mismatch_margin", [{"gap": 1.0, "max_abs_logit": 0.0}]))
    return bool(top1 and ties and r.get("greedy_match_cpu"))


def _margin(eng, prompt, want, j):
    """Logit gap at greedy step ``j`` between this engine's argmax and the reference token
    ``want[j]``, feeding ``want[:j]`` after ``prompt``."""
    s = eng.add_sequence()
    try:
        logits = eng.prefill([s], [list(prompt)])
        for t in want[:j]:
            logits = eng.decode([s], [int(t)])
        row = np.asarray(logits[0], np.float64)
        return {"argmax": int(row.argmax()), "cpu_token": int(want[j]),
                "gap": float(row.max() - row[int(want[j])]), "max_abs_logit": float(np.abs(row).max())}
    finally:
        eng.remove_sequence(s)


# ------------------------------------------------------------------------------ prepare
def prepare(out: Path) -> None:
    import tvm
    from tvm import relax

    from k3_compile.build import build_module
    from k3_compile.config import K3Config
    from k3_compile.device_code import describe_library
    from k3_compile.pipeline import compile_llvm, export_model, load_checkpoint_params
    from k3_compile.runtime.engine import Engine
    from k3_compile.tokenizer import load_tokenizer
    from targets import get_target

    out.mkdir(parents=True, exist_ok=True)
    cfg = K3Config.from_file(NANO)
    tok = load_tokenizer(NANO)
    ids = [tok.encode(p) for p in PROMPTS]
    ref = {"n_prompts": np.int64(len(ids))}
    meta = {"target": TARGET, "prompts": PROMPTS, "params": {}}
    for dtype in DTYPES:
        t0 = time.time()
        # the kernels `k3 compile --target TARGET` dispatches (on sm_90a: the wgmma MoE prefill)
        ex_gpu = export_model(cfg, dtype, gpu=True, wgmma=get_target(TARGET).features.wgmma)
        lib = build_module(ex_gpu.mod, get_target(TARGET))
        lib.export_library(str(out / _lib_name(dtype)))
        print(describe_library(out / _lib_name(dtype)), f"({time.time() - t0:.1f} s)", flush=True)
        meta["params"][dtype] = [[n, list(s), d] for n, s, d in ex_gpu.params]
        meta.setdefault("code_layout", {})[dtype] = ex_gpu.code_layout
        # CPU references
        ex = export_model(cfg, dtype)
        vm = relax.VirtualMachine(compile_llvm(ex), tvm.cpu())
        params = load_checkpoint_params(NANO, ex, tvm.cpu())
        eng = Engine(vm, params, cfg, tvm.cpu(), dtype, max_slots=6, num_pages=128,
                     page_size=ex.page_size)
        tag = "f32" if dtype == "float32" else "bf16"
        for i, p in enumerate(ids):
            if dtype == "float32":
                s = eng.add_sequence()
                ref[f"logits{i}"] = eng.prefill([s], [p], all_logits=True)
                eng.remove_sequence(s)
            ref[f"greedy_{tag}_{i}"] = np.array(eng.greedy(p, N_GREEDY), np.int32)
        if dtype == "float32":
            s = eng.add_sequence()
            # every LONG_STRIDE-th position (keeps the carried reference small)
            ref["logits_long"] = eng.prefill([s], [tok.encode(LONG_PROMPT)], all_logits=True)[::LONG_STRIDE]
            eng.remove_sequence(s)
    for i, p in enumerate(ids):
        ref[f"ids{i}"] = np.array(p, np.int32)
    long_ids = tok.encode(LONG_PROMPT)
    from k3_compile.build import WGMMA_FROM

    if len(long_ids) < WGMMA_FROM:
        raise RuntimeError(f"LONG_PROMPT has {len(long_ids)} tokens; the prefill kernel needs {WGMMA_FROM}")
    ref["ids_long"] = np.array(long_ids, np.int32)
    np.savez_compressed(out / "reference.npz", **ref)
    (out / "meta.json").write_text(json.dumps(meta))
    prepare_kernels(out)
    print("prepared", out, sorted(x.name for x in out.iterdir()))


# ------------------------------------------------------------------------------ run
def _gpu_memory():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=30)
        name, used, total = [x.strip() for x in r.stdout.strip().splitlines()[0].split(",")]
        return {"gpu": name, "memory_used_mib": int(used), "memory_total_mib": int(total)}
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}


def run_kernels(out: Path, dev) -> dict:
    import tvm

    if not (out / "kernels_sm90a.so").exists():
        return {}  # not carried: per-kernel checks off (the model checks below still run)
    lib = tvm.runtime.load_module(str(out / "kernels_sm90a.so"))
    data = np.load(out / "kernels_ref.npz")
    cases = {}
    rng_args = {}
    for key in data.files:
        name, what = key.split("/")
        rng_args.setdefault(name, {})[what] = data[key]
    # scalar arguments and argument counts, as in _kernel_cases (kept in step by hand)
    scalars = {"short_conv": {6: 1, 7: 2}, "kda_prefill": {8: 1}, "kda_decode": {7: 1},
               "slot_reset": {1: 2}, "slot_copy": {1: 2, 2: 4}, "page_copy": {1: 1, 2: 3}}
    atol = {"short_conv": 1e-5, "kda_prefill": 1e-4, "kda_decode": 1e-5, "moe_route": 1e-6,
            "mxfp4_gemv": 1e-3, "mxfp4_gemv_w2": 1e-3, "dense_gemv": 1e-3}
    for name, d in rng_args.items():
        n_args = max([int(k[2:]) for k in d if k.startswith("in")] + list(scalars.get(name, {})))
        args = []
        for i in range(n_args + 1):
            args.append(d[f"in{i}"] if f"in{i}" in d else scalars[name][i])
        try:
            res = _call_kernel(lib[name], args, dev)
            errs = {}
            ok = True
            for k, refv in d.items():
                if not k.startswith("ref"):
                    continue
                i = int(k[3:])
                got = res[i]
                if got.dtype.kind in "iu":
                    err = float(np.abs(got.astype(np.int64) - refv.astype(np.int64)).max())
                    ok &= err == 0
                else:
                    err = float(np.abs(got - refv).max())
                    ok &= err <= atol.get(name, 0.0)
                errs[f"arg{i}"] = err
            cases[name] = {"ok": bool(ok), "max_abs_err": errs}
        except Exception as e:  # noqa: BLE001
            cases[name] = {"ok": False, "error": repr(e)[:500]}
        print("kernel", name, cases[name], flush=True)
    return cases


def _bench(eng, vocab: int, batch: int, prompt_len: int, n_decode: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)]
    seqs = [eng.add_sequence() for _ in range(batch)]
    from k3_compile.runtime.engine import EngineStats

    eng.stats = EngineStats()
    logits = eng.prefill(seqs, prompts)
    toks = [int(t) for t in np.argmax(logits, -1)]
    for _ in range(n_decode):
        logits = eng.decode(seqs, toks)
        toks = [int(t) for t in np.argmax(logits, -1)]
    st = eng.stats
    for s in seqs:
        eng.remove_sequence(s)
    return {"batch": batch, "prompt_len": prompt_len, "decode_steps": n_decode,
            "prefill_tokens_per_s": round(st.prefill_tokens_per_s, 1),
            "prefill_seconds": round(st.prefill_seconds, 4),
            "decode_tokens_per_s": round(st.decode_tokens_per_s, 1),
            "decode_ms_per_step": round(1000 * st.decode_seconds / n_decode, 3)}


def run(out: Path, json_path: Path | None, dtypes=DTYPES) -> dict:
    import tvm
    from tvm.runtime.vm import VirtualMachine

    from k3_compile.config import K3Config
    from k3_compile.device_code import load_cuda_runtime
    from k3_compile.loader import check_expert_scales, repack_expert_codes, upload_parameters
    from k3_compile.runtime.engine import Engine
    from k3_compile.weights import CheckpointReader

    report: dict = {"machine": platform.node(), "python": sys.version.split()[0],
                    "tvm": getattr(tvm, "__version__", "?"), "date": time.strftime("%Y-%m-%d"),
                    # the device copy has no .git: the commit is passed in K3_COMMIT
                    "commit": os.environ.get("K3_COMMIT", "unknown")}
    report["cuda_runtime_lib"] = str(load_cuda_runtime())
    dev = tvm.runtime.device("cuda", 0)
    try:
        report["device_name"] = dev.device_name if dev.exist else None
    except Exception as e:  # noqa: BLE001
        report["device_name"] = repr(e)
    report["gpu_memory_before"] = _gpu_memory()
    report["kernels"] = run_kernels(out, dev)

    meta = json.loads((out / "meta.json").read_text())
    ref = np.load(out / "reference.npz")
    n = int(ref["n_prompts"])
    ids = [ref[f"ids{i}"].tolist() for i in range(n)]
    cfg = K3Config.from_file(NANO)
    reader = CheckpointReader(NANO, cfg)
    reader.validate()
    for dtype in dtypes:
        tag = "f32" if dtype == "float32" else "bf16"
        r: dict = {}
        t0 = time.perf_counter()
        lib = tvm.runtime.load_module(str(out / _lib_name(dtype)))
        vm = VirtualMachine(lib, dev)
        plist = [(nm, tuple(s), d) for nm, s, d in meta["params"][dtype]]
        layout = meta.get("code_layout", {}).get(dtype, "ocp")
        params = upload_parameters(reader.get, plist, cfg.num_experts, dev,
                                   lambda nm, a: check_expert_scales(nm, a, layout))
        params = repack_expert_codes(vm, layout, [nm for nm, _, _ in plist], params)
        r["load_seconds"] = round(time.perf_counter() - t0, 2)
        eng = Engine(vm, params, cfg, dev, dtype, **ENGINE_KW)
        try:
            if dtype == "float32":
                errs = []
                for i, p in enumerate(ids):
                    s = eng.add_sequence()
                    got = eng.prefill([s], [p], all_logits=True)
                    eng.remove_sequence(s)
                    errs.append(float(np.abs(got - ref[f"logits{i}"]).max()))
                r["all_position_logits_max_abs_err"] = errs
                r["logits_ok"] = bool(max(errs) <= LOGIT_ATOL)
            # every build against the fp32 CPU logits, the short prompts and the long one (bf16:
            # the long prompt's prefill runs the wgmma kernel, the short ones' the decode one)
            if "ids_long" in ref:
                dev_err = []
                for p, want_l, step in [(q, ref[f"logits{i}"], 1) for i, q in enumerate(ids)] + [
                        (ref["ids_long"].tolist(), ref["logits_long"], LONG_STRIDE)]:
                    s = eng.add_sequence()
                    got = eng.prefill([s], [p], all_logits=True)[::step]
                    eng.remove_sequence(s)
                    dev_err.append({"tokens": len(p), "max_abs_err": float(np.abs(got - want_l).max()),
                                    "top1_agree": float(np.mean(got.argmax(-1) == want_l.argmax(-1)))})
                r["logits_vs_cpu_f32"] = dev_err
            greedy = [eng.greedy(p, N_GREEDY) for p in ids]
            want = [ref[f"greedy_{tag}_{i}"].tolist() for i in range(n)]
            r["greedy_tokens"] = greedy
            r["greedy_match_cpu"] = [g == w for g, w in zip(greedy, want)]
            r["greedy_first_mismatch"] = [
                next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
                for g, w in zip(greedy, want)]
            # at a mismatch: this run's logit of its own token minus that of the CPU's token,
            # teacher-forced on the CPU's tokens up to there (a near-tie gives a small margin)
            r["greedy_mismatch_margin"] = [
                None if j is None else _margin(eng, p, w, j)
                for p, w, j in zip(ids, want, r["greedy_first_mismatch"])]
            r["bench"] = []
            _bench(eng, cfg.vocab_size, 1, 64, 8, 99)  # warm-up
            for batch, plen, ndec in ((1, 512, 64), (8, 512, 64), (1, 16, 128), (8, 16, 128)):
                b = _bench(eng, cfg.vocab_size, batch, plen, ndec, batch * 1000 + plen)
                print(dtype, b, flush=True)
                r["bench"].append(b)
            r["gpu_memory_loaded"] = _gpu_memory()
        except Exception as e:  # noqa: BLE001
            import traceback

            r["error"] = traceback.format_exc()[-3000:]
            print(r["error"], flush=True)
        report[dtype] = r
        print(dtype, {k: v for k, v in r.items() if k not in ("greedy_tokens", "bench")}, flush=True)
        del eng, params, vm, lib
    report["tvm_relax_imported"] = "tvm.relax" in sys.modules
    # fp32: logits and greedy tokens as the CPU build; bf16: see _bf16_ok
    f32_ok = ("float32" not in dtypes or (report["float32"].get("logits_ok")
                                           and all(report["float32"].get("greedy_match_cpu", [False]))))
    bf16_ok = ("bfloat16" not in dtypes or _bf16_ok(report["bfloat16"]))
    report["ok"] = bool(all(c.get("ok") for c in report["kernels"].values()) and f32_ok and bf16_ok
                        and not report["tvm_relax_imported"])
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1))
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["prepare", "run"])
    ap.add_argument("--out", default=str(ROOT / "dist" / "nano"))
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "nano_cuda.json"))
    ap.add_argument("--dtypes", default=",".join(DTYPES),
                    help="run: the builds to run, comma-separated (default: both; carry only their libraries)")
    a = ap.parse_args()
    if a.step == "prepare":
        prepare(Path(a.out))
        return 0
    dtypes = tuple(d for d in a.dtypes.split(",") if d)
    if not dtypes or any(d not in DTYPES for d in dtypes):
        ap.error(f"--dtypes: a comma-separated subset of {','.join(DTYPES)}, got {a.dtypes!r}")
    rep = run(Path(a.out), Path(a.json), dtypes)
    print("OK" if rep["ok"] else "FAILED", flush=True)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
