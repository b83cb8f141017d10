"""Shared helpers for tests that compile Relax / TIR on the CPU (llvm target).

- :func:`compile_vm` — ``export_tvm`` output → a ``relax.VirtualMachine`` on ``tvm.cpu()``.
- :func:`compile_prim` — one PrimFunc → a callable packed function.
- :func:`param_args` — the trailing parameter arguments, in ``params`` order, from a dict.
- :func:`ragged_meta` — the int32 ForwardMeta arrays (docs/DESIGN.md) for sequence lengths.
- :func:`nd` — numpy → ``tvm.runtime.Tensor`` on the CPU.
- :func:`sm90a_cuda_source` / :func:`ptxas_report` — one hand-written PrimFunc's CUDA for
  cuda-sm90a, and what ptxas says of it (registers, spills).
- :func:`build_sm90a_fatbin` / :data:`needs_nvcc` — build kernels for cuda-sm90a in a
  subprocess (device code precompiled by nvcc) and report what the library holds.
- :func:`nano_kda_prefill_vs_generic` — k3-nano's logits with a KDA prefill path under test
  (kernels replaced by emulated stand-ins) and with the generic kernels.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

LLVM = tvm.target.Target({"kind": "llvm"})


def nd(a) -> tvm.runtime.Tensor:
    """numpy array → tvm tensor on the CPU (bfloat16 numpy arrays via ml_dtypes work too)."""
    return tvm.runtime.tensor(np.ascontiguousarray(a), device=tvm.cpu())


def compile_vm(mod: tvm.IRModule) -> relax.VirtualMachine:
    """Compile an exported Relax module for llvm and load it in a CPU VirtualMachine."""
    ex = tvm.compile(mod, target=LLVM)
    return relax.VirtualMachine(ex, tvm.cpu())


def compile_prim(func, name: str = "main"):
    """Compile one PrimFunc for llvm; returns the packed function."""
    return tvm.compile(func.with_attr("global_symbol", name), target=LLVM)[name]


def param_args(params, values: dict) -> list:
    """Parameter tensors in the order of ``export_tvm``'s ``params`` list.

    ``values`` maps parameter name → numpy array (cast to the parameter's dtype here).
    Raises KeyError naming any missing parameter.
    """
    out = []
    for name, p in params:
        if name not in values:
            raise KeyError(f"no value for parameter {name!r}")
        a = np.asarray(values[name])
        if str(a.dtype) != p.dtype:
            if p.dtype == "bfloat16":
                import ml_dtypes

                a = a.astype(ml_dtypes.bfloat16)
            else:
                a = a.astype(p.dtype)
        if tuple(a.shape) != tuple(int(s) for s in p.shape):
            raise ValueError(f"parameter {name!r}: shape {a.shape} != {tuple(p.shape)}")
        out.append(nd(a))
    return out


def ragged_meta(lens, slots=None, start_pos=None, max_pages: int = 1) -> dict:
    """ForwardMeta arrays (all int32) for a flat batch of sequences with lengths ``lens``.

    ``slots`` defaults to ``range(B)``; ``start_pos[b]`` is the number of tokens of sequence
    ``b`` seen in earlier forwards (default 0). ``page_table`` is all -1 (unused here).
    """
    lens = [int(n) for n in lens]
    B = len(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype("int32")
    start_pos = [0] * B if start_pos is None else list(start_pos)
    return {
        "cu_seqlens": cu,
        "token_seq": np.repeat(np.arange(B), lens).astype("int32"),
        "token_pos": np.concatenate(
            [np.arange(n) + p for n, p in zip(lens, start_pos)] or [np.zeros(0)]).astype("int32"),
        "seq_slots": np.asarray(range(B) if slots is None else slots, dtype="int32"),
        "page_table": np.full((B, max_pages), -1, dtype="int32"),
        "last_token": (cu[1:] - 1).astype("int32"),
    }


META_FIELDS = ("cu_seqlens", "token_seq", "token_pos", "seq_slots", "page_table", "last_token")


def meta_spec() -> dict:
    """``nn.spec`` entries for the ForwardMeta tensors (symbolic T, B, B+1 as "B1", pages)."""
    from tvm.relax.frontend import nn

    return {
        "cu_seqlens": nn.spec.Tensor(["B1"], "int32"),
        "token_seq": nn.spec.Tensor(["T"], "int32"),
        "token_pos": nn.spec.Tensor(["T"], "int32"),
        "seq_slots": nn.spec.Tensor(["B"], "int32"),
        "page_table": nn.spec.Tensor(["B", "P"], "int32"),
        "last_token": nn.spec.Tensor(["B"], "int32"),
    }


def fused_module(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` through the GPU pipeline's fusion steps (k3_compile/build.py):
    FuseTransposeMatmul, LegalizeOps, AnnotateTIROpPattern, FuseOps, FuseTIR, then dead-code
    elimination — the fused PrimFuncs the dense kernels are spliced into."""
    seq = [relax.transform.FuseTransposeMatmul(), relax.transform.LegalizeOps(),
           relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(), relax.transform.FuseTIR(),
           relax.transform.DeadCodeElimination()]
    return tvm.transform.Sequential(seq)(mod)


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def sm90a_cuda_source(func, name: str = "dense") -> str:
    """The CUDA source TVM generates for the hand-scheduled PrimFunc ``func`` on cuda-sm90a
    (compiled with the kernels' own barriers, as k3_compile.build does)."""
    from schedules.barriers import respect_manual_barriers
    from targets import get_target

    with respect_manual_barriers():
        lib = tvm.tirx.build(tvm.IRModule({name: func.with_attr("global_symbol", name)}),
                             target=get_target("cuda-sm90a").tvm_target())
    return lib.imports[0].inspect_source()


def ptxas_report(src: str, tmp_path: Path) -> str:
    """ptxas's verbose report (stderr) of compiling CUDA ``src`` for sm_90a with nvcc; fails
    the test where nvcc fails."""
    cu = tmp_path / "kernel.cu"
    cu.write_text(src)
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-Xptxas", "-v", "-o", str(tmp_path / "kernel.cubin"),
                        str(cu)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stderr


def build_sm90a_fatbin(setup: str, tmp_path: Path, contexts: str = "", keep_src: bool = False) -> str:
    """Build for cuda-sm90a, in a subprocess (loading libtvm_runtime_cuda is process-wide), the
    ``IRModule`` that the Python code ``setup`` assigns to ``mod``, inside
    ``k3_compile.device_code.precompiled_cuda('sm_90a')`` plus ``contexts`` (e.g.
    ``"respect_manual_barriers()"``, which ``setup`` imports). Returns the printed list of what the
    exported library's CUDA modules hold (``['fatbin']`` when nvcc compiled them); with
    ``keep_src`` the CUDA sources are kept under ``tmp_path / "src"``.

    Raises subprocess.CalledProcessError (with the child's stderr) if the build fails."""
    keep = f", keep_dir='{tmp_path}/src'" if keep_src else ""
    ctx = f", {contexts}" if contexts else ""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"  # test modules
        "import tvm\n"
        "from k3_compile.device_code import precompiled_cuda, inspect_library\n"
        "from targets import get_target\n"
        f"{setup}\n"
        f"with precompiled_cuda('sm_90a'{keep}){ctx}:\n"
        "    lib = tvm.compile(mod, target=get_target('cuda-sm90a').tvm_target())\n"
        f"lib.export_library('{tmp_path}/k.so')\n"
        f"print([b.content for b in inspect_library('{tmp_path}/k.so')])\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def nano_kda_prefill_vs_generic(patched: dict, configure, seed: int = 0):
    """k3-nano (float32, llvm) with the KDA layers' prefill kernels replaced — ``patched`` maps
    names in ``relax_modules.kda`` to stand-ins (emulated CUDA kernels), ``configure(layer)``
    switches each KDA layer to the path under test — against the generic model: two ragged
    sequences of 3 and 1 chunks prefilled together, then one continued from its state.

    Returns ``(script, outs, refs)``: the patched model's TVMScript (to check which kernels it
    calls) and both models' all-token logits of the two prefill calls."""
    import relax_modules.kda as kda_mod
    from k3_compile.config import K3Config
    from k3_compile.pipeline import ExportedModel, compile_llvm, export_model, load_checkpoint_params
    from k3_compile.runtime.engine import Engine
    from relax_modules.model import K3ForCausalLM

    nano = str(Path(__file__).resolve().parents[1] / "models" / "k3-nano")
    cfg = K3Config.from_file(nano)

    def engine(exported):
        vm = relax.VirtualMachine(compile_llvm(exported), tvm.cpu())
        params = load_checkpoint_params(nano, exported, tvm.cpu())
        return Engine(vm, params, cfg, tvm.cpu(), "float32", max_slots=4, num_pages=64,
                      page_size=exported.page_size)

    ref = engine(export_model(cfg, "float32"))
    saved = {n: getattr(kda_mod, n) for n in patched}
    try:
        for n, f in patched.items():
            setattr(kda_mod, n, f)
        model = K3ForCausalLM(cfg, "float32")
        layers = [m.self_attn for m in model.model.layers if isinstance(m.self_attn, kda_mod.KimiDeltaAttention)]
        assert layers
        for layer in layers:
            configure(layer)
        mod, params = model.export()
        test = engine(ExportedModel(mod, [(n, tuple(int(s) for s in p.shape), p.dtype) for n, p in params],
                                    cfg, "float32", model.page_size))
    finally:
        for n, f in saved.items():
            setattr(kda_mod, n, f)
    rng = np.random.default_rng(seed)
    a, b, c = ([int(t) for t in rng.integers(3, 1000, size=n)] for n in (150, 40, 30))
    out = []
    for eng_ in (test, ref):
        s1, s2 = eng_.add_sequence(), eng_.add_sequence()
        out.append([eng_.prefill([s1, s2], [a, b], all_logits=True), eng_.prefill([s1], [c], all_logits=True)])
    return mod.script(), out[0], out[1]
