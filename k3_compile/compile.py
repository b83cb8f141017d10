"""``k3 compile``: export the K3 Relax graph, attach metadata, build for a target, write the library.

The library carries its metadata as an extra Relax function ``_metadata`` (no arguments)
returning a JSON string, so that a runtime-only TVM reads it with
``tvm.runtime.load_module`` + ``tvm.runtime.vm.VirtualMachine(...)["_metadata"]()``
(:func:`read_metadata`). Fields (``METADATA_FORMAT``):

``format``, ``k3_compile_version``, ``config_hash`` (``K3Config.summary_hash``), ``model_type``,
``target`` (a ``targets`` name), ``target_device`` (``cpu``/``cuda``/...), ``nvcc_arch``,
``dtype``, ``quantization`` (``mxfp4``/``bf16``), ``page_size``, ``params`` (``[[name, shape,
dtype], ...]`` in the functions' parameter order), ``max_batch_size``, ``context_window``,
``prefill_chunk``, ``generic_kernels``, ``expert_code_layout`` (``ocp`` or
``e2m1-tc-v1``: the runtime then calls ``repack_expert_codes`` on every routed-expert
``weight_packed`` after uploading it), ``memory_plan`` (``param_bytes``,
``kda_state_bytes_per_seq``, ``mla_cache_bytes_per_token``), ``functions``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .config import K3Config

METADATA_FN = "_metadata"
METADATA_FORMAT = "k3-compile-lib-v2"
# v2 added ``expert_code_layout`` (v1 libraries read the codes as stored: "ocp")
KNOWN_METADATA_FORMATS = ("k3-compile-lib-v1", METADATA_FORMAT)
DEFAULT_MAX_BATCH_SIZE = 4


class CompileError(ValueError):
    """Bad ``k3 compile`` input (unknown target, bad dtype, unwritable output...)."""


def dtype_itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}[dtype]


def default_dtype(target_spec) -> str:
    """float32 on CPUs (LLVM computes bf16 in float32 anyway, and it is exact vs the oracle),
    bfloat16 on GPUs."""
    return "bfloat16" if target_spec.is_gpu else "float32"


def memory_plan(cfg: K3Config, params, dtype: str) -> dict:
    n_kda, n_mla = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)
    h, k, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    pbytes = sum(int(np.prod(s, dtype=np.int64)) * dtype_itemsize(d) for _, s, d in params)
    return {
        "param_bytes": int(pbytes),
        "kda_state_bytes_per_seq": int(n_kda * (h * k * k + 3 * (w - 1) * h * k) * 4),
        "mla_cache_bytes_per_token": int(n_mla * cfg.mla_cache_dim * dtype_itemsize(dtype)),
    }


def resolve_model_config(path: str | Path) -> tuple[K3Config, dict]:
    """The config of a checkpoint dir, a converted dir or a config.json, plus runtime defaults
    (``context_window``, ``prefill_chunk``) from a converted dir's k3-config.json."""
    from .convert import DEFAULT_PREFILL_CHUNK, K3_CONFIG, default_context_window

    p = Path(path)
    cfg = K3Config.from_file(p)
    defaults = {"context_window": default_context_window(cfg), "prefill_chunk": DEFAULT_PREFILL_CHUNK}
    if p.is_dir() and (p / K3_CONFIG).is_file():
        k3 = json.loads((p / K3_CONFIG).read_text())
        for key in defaults:
            if isinstance(k3.get(key), int):
                defaults[key] = k3[key]
    return cfg, defaults


def build_metadata(exported, target_spec, *, max_batch_size: int, context_window: int,
                   prefill_chunk: int, generic_kernels: bool = False) -> dict:
    from .convert import version
    from .pipeline import REPACK_FN

    cfg = exported.cfg
    return {
        "format": METADATA_FORMAT,
        "k3_compile_version": version(),
        "config_hash": cfg.summary_hash(),
        "model_type": cfg.model_type,
        "target": target_spec.name,
        "target_device": target_spec.device,
        "nvcc_arch": target_spec.nvcc_arch,
        "dtype": exported.dtype,
        "quantization": "mxfp4" if cfg.quantization.experts_mxfp4 else "bf16",
        "page_size": exported.page_size,
        "params": [[n, list(s), d] for n, s, d in exported.params],
        "max_batch_size": int(max_batch_size),
        "context_window": int(context_window),
        "prefill_chunk": int(prefill_chunk),
        "generic_kernels": bool(generic_kernels),
        "expert_code_layout": exported.code_layout,
        "memory_plan": memory_plan(cfg, exported.params, exported.dtype),
        "functions": ["embed", "prefill", "prefill_all_logits", "decode", "kda_reset_slot",
                      "kda_copy_slot", "mla_copy_page", METADATA_FN]
                     + ([REPACK_FN] if exported.code_layout != "ocp" else []),
    }


def attach_metadata(mod, metadata: dict):
    """Add ``_metadata() -> str`` (the JSON of ``metadata``) to the Relax module."""
    from tvm import relax
    from tvm.script import relax as R

    fn = relax.Function([], R.str(json.dumps(metadata, sort_keys=True)))
    fn = fn.with_attr("global_symbol", METADATA_FN)
    mod[METADATA_FN] = fn
    return mod


def read_metadata(vm_or_module) -> dict:
    """The metadata of a loaded library: a ``tvm.runtime.vm.VirtualMachine`` or the module
    from ``tvm.runtime.load_module`` (runtime-only TVM is enough).

    Raises:
        CompileError: the library has no ``_metadata`` function (not made by ``k3 compile``).
    """
    import tvm

    from tvm.runtime.vm import VirtualMachine

    vm = vm_or_module
    if not isinstance(vm, VirtualMachine):
        vm = VirtualMachine(vm_or_module, tvm.runtime.cpu())
    try:
        fn = vm[METADATA_FN]
    except Exception:
        fn = None
    if fn is None:
        raise CompileError("the library has no _metadata function; it was not built by `k3 compile`")
    return json.loads(str(fn()))


def peak_memory_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class CompileResult:
    lib: str
    metadata: dict
    seconds: float
    phases: dict
    peak_memory_bytes: int


def _rocm_path() -> str | None:
    """A usable ROCm install (what TVM's ``find_rocm_path`` looks for), or None."""
    for p in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if p and os.path.exists(os.path.join(p, "lib")):
            return p
    return None


def compile_model(model: str | Path, target: str, out: str | Path, *, dtype: str | None = None,
                  max_batch_size: int | None = None, context_window: int | None = None,
                  prefill_chunk: int | None = None, generic_kernels: bool = False,
                  cuda_graph: bool = False,
                  log: Callable[[str], None] | None = None) -> CompileResult:
    """Compile the model (checkpoint dir, converted dir or config.json) for ``target`` into
    the shared library ``out``.

    Raises:
        CompileError, ConfigError, and the build's own errors (e.g. DeviceCodeError).
    """
    from targets import get_target

    from .build import build_module
    from .pipeline import export_model

    t0 = time.time()
    phases: dict[str, float] = {}

    def say(msg: str) -> None:
        if log is not None:
            log(f"[{time.time() - t0:6.1f}s] {msg}")

    try:
        spec = get_target(target)
    except KeyError as e:
        raise CompileError(str(e.args[0])) from None
    dtype = dtype or default_dtype(spec)
    if dtype not in ("float32", "bfloat16"):
        raise CompileError(f"--dtype {dtype!r}: expected bfloat16 or float32")
    cfg, defaults = resolve_model_config(model)
    mbs = int(DEFAULT_MAX_BATCH_SIZE if max_batch_size is None else max_batch_size)
    ctx = int(defaults["context_window"] if context_window is None else context_window)
    chunk = int(defaults["prefill_chunk"] if prefill_chunk is None else prefill_chunk)
    problem = cfg.runtime_size_error(mbs, ctx, chunk)
    if problem:
        raise CompileError(problem)
    out = Path(out)
    if out.is_dir():
        raise CompileError(f"output {out} is a directory; give a library file name (e.g. {out}/model.so)")
    if spec.device == "rocm" and not _rocm_path():
        raise CompileError(f"{spec.name} does not compile on this machine: TVM's AMDGPU code "
                           "generator needs a ROCm install (set ROCM_PATH to one with the device "
                           f"libraries and ld.lld). {spec.notes}")
    _check_writable(out)
    if spec.name == "metal" and sys.platform != "darwin" and out.suffix != ".tar":
        raise CompileError(f"-o {out}: a Metal library's host code is arm64 macOS and links only on a "
                           "Mac; here, write the objects with -o NAME.tar and link them there")

    say(f"exporting the Relax graph (config {cfg.summary_hash()}, dtype {dtype})")
    ts = time.time()
    # the tuned kernels (inline PTX, mma.sync, cp.async, dynamic shared memory) are CUDA-only:
    # Metal and ROCm builds take the generic GPU kernels
    tuned = spec.is_cuda and not generic_kernels
    exported = export_model(cfg, dtype, gpu=spec.is_gpu, tuned=tuned, wgmma=spec.features.wgmma)
    meta = build_metadata(exported, spec, max_batch_size=mbs, context_window=ctx,
                          prefill_chunk=chunk, generic_kernels=not tuned)
    mod = attach_metadata(exported.mod, meta)
    phases["export"] = time.time() - ts
    say(f"building for {spec.name} ({spec.description})")
    ts = time.time()
    ex = build_module(mod, spec, cuda_graph=cuda_graph, hand_kernels=tuned)
    phases["build"] = time.time() - ts
    say(f"writing {out}")
    ts = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}{out.suffix}")
    try:
        ex.export_library(str(tmp))
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    phases["export_library"] = time.time() - ts
    total = time.time() - t0
    say("done")
    return CompileResult(str(out), meta, total, phases, peak_memory_bytes())


def _check_writable(out: Path) -> None:
    """Fail before the build, not after it, when ``out`` cannot be written (its missing parent
    directories are created, as ``mkdir -p``)."""
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CompileError(f"-o {out}: cannot create the directory {parent} ({e.strerror})") from None
    probe = parent / f".{out.name}.probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CompileError(f"-o {out}: cannot write in {parent} ({e.strerror})") from None


def cache_dir() -> Path:
    return Path(os.environ.get("K3_CACHE_DIR") or Path.home() / ".cache" / "k3-compile")


def cache_path(cfg: K3Config, target_name: str, dtype: str) -> Path:
    from .convert import version

    return cache_dir() / f"{cfg.summary_hash()}-{target_name}-{dtype}-{version()}.so"


def _stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
