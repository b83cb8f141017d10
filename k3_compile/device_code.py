"""Precompiled CUDA device code: libraries that load with neither nvcc nor the TVM compiler.

What TVM 0.27 does by default
-----------------------------
The CUDA codegen (``target.build.cuda``) emits CUDA C++ and hands it to a C++ factory that
looks up the global ``ffi.Module.create.cuda`` (registered by ``libtvm_runtime_cuda.so``):

* if that function is registered, a real ``CUDAModuleNode`` is made and CUDA source is
  JIT-compiled *at build time* through the global ``tvm_callback_cuda_compile(code)``
  (``tvm.support.nvcc`` registers one: NVRTC -> cubin, arch from the current target or
  the local GPU); the binary is what ``export_library`` stores;
* otherwise (``libtvm_runtime_cuda.so`` cannot be loaded, e.g. no ``libcuda.so.1`` on a
  build machine without a driver, which is the case here) a ``CUDAFallbackModuleNode``
  keeps the raw CUDA source with format "cuda", and the library compiles it when it is
  *loaded*, which needs ``tvm_callback_cuda_compile`` (the TVM compiler's Python package
  and NVRTC/nvcc) on the machine that runs it.

What this module does
---------------------
``precompiled_cuda(arch)`` (used by ``build_cuda``) makes sure ``ffi.Module.create.cuda``
exists while building (it loads ``libtvm_runtime_cuda.so``; on a machine without a CUDA
driver it first loads a tiny stub ``libcuda.so.1`` that it builds with the C compiler, so
the runtime library's link dependency resolves; nothing in the stub is called while
compiling), and overrides ``tvm_callback_cuda_compile`` with nvcc
``--fatbin -gencode=arch=compute_90a,code=sm_90a`` (``sm_100a``, ``sm_120a``...). The
codegen then stores the fatbin (format tag "cubin", which ``cuModuleLoadData`` accepts for
both) and ``export_library`` serializes it; loading needs only ``libtvm_runtime_cuda.so``.

Side effect: once loaded, ``libtvm_runtime_cuda.so`` stays in the process, so a later *plain*
``tvm.compile`` for CUDA in the same process JIT-compiles at build time with TVM's own callback
(NVRTC; it needs the arch from the target). Build CUDA libraries through ``build_cuda`` /
``precompiled_cuda``, or in a separate process when the default behaviour is wanted.

``inspect_library(path)`` / ``library_has_source_only(path)`` read an exported library's
serialized CUDA modules (without loading it) and tell whether they hold CUDA source, PTX,
a cubin or a fatbin. ``load_cuda_runtime()`` loads ``libtvm_runtime_cuda.so`` globally so
that a runtime-only TVM can load CUDA libraries.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Union

FATBIN_MAGIC = b"\x50\xed\x55\xba"  # 0xBA55ED50, little-endian fatbin header
ELF_MAGIC = b"\x7fELF"

# CUDA driver API functions that libtvm_runtime_cuda.so (apache-tvm 0.27) links against.
_STUB_CU_FUNCS = (
    "cuDeviceGetName",
    "cuFuncSetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuLaunchKernelEx",
    "cuModuleGetFunction",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuTensorMapEncodeTiled",
)
_CUDA_ERROR_STUB_LIBRARY = 34


class DeviceCodeError(RuntimeError):
    """Precompiling or inspecting device code failed."""


# --------------------------------------------------------------------------------------
# Locating and loading libtvm_runtime_cuda.so
# --------------------------------------------------------------------------------------


def _tvm_lib_dirs() -> List[Path]:
    dirs: List[Path] = []
    for env in ("TVM_LIBRARY_PATH",):
        for p in os.environ.get(env, "").split(os.pathsep):
            if p:
                dirs.append(Path(p))
    try:
        import tvm  # pylint: disable=import-outside-toplevel

        dirs.append(Path(tvm.__file__).resolve().parent / "lib")
    except ImportError:
        pass
    # A runtime-only bundle next to the repo (.tvm-rt/tvm/lib), when tvm is not importable.
    dirs.append(Path.cwd() / ".tvm-rt" / "tvm" / "lib")
    return dirs


def find_tvm_runtime_cuda() -> Path:
    """Path of ``libtvm_runtime_cuda.so`` (the wheel keeps it in ``tvm/lib/``)."""
    for d in _tvm_lib_dirs():
        p = d / "libtvm_runtime_cuda.so"
        if p.is_file():
            return p
    raise DeviceCodeError(
        "libtvm_runtime_cuda.so not found in " + ", ".join(str(d) for d in _tvm_lib_dirs())
    )


def _cuda_module_factory_registered() -> bool:
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    return tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is not None


_HELD_LIBS: List[ctypes.CDLL] = []


def load_cuda_runtime(path: Optional[Union[str, Path]] = None) -> Path:
    """Load ``libtvm_runtime_cuda.so`` with RTLD_GLOBAL (registers the CUDA device API and
    the CUDA module loader). Needed before ``tvm.runtime.load_module`` of a CUDA library in
    a runtime-only TVM, which does not load it by itself. Idempotent; returns the path."""
    import tvm  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    lib = Path(path) if path is not None else find_tvm_runtime_cuda()
    if _cuda_module_factory_registered():
        return lib
    _HELD_LIBS.append(ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL))
    return lib


def _stub_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "k3-compile" / "cuda-driver-stub"


def _build_libcuda_stub() -> Path:
    """A ``libcuda.so.1`` whose functions all return CUDA_ERROR_STUB_LIBRARY."""
    out = _stub_dir() / "libcuda.so.1"
    if out.is_file():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise DeviceCodeError(
            "no CUDA driver (libcuda.so.1) here and no C compiler to build a stub for it: "
            "install gcc (nvcc needs it anyway)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    src = "".join(f"int {f}(void) {{ return {_CUDA_ERROR_STUB_LIBRARY}; }}\n" for f in _STUB_CU_FUNCS)
    with tempfile.TemporaryDirectory() as tmp:
        c_file = Path(tmp) / "libcuda_stub.c"
        c_file.write_text(src)
        tmp_out = Path(tmp) / "libcuda.so.1"
        subprocess.run(
            [cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp_out), str(c_file)],
            check=True,
            capture_output=True,
        )
        shutil.move(str(tmp_out), str(out))
    return out


def ensure_cuda_module_factory() -> str:
    """Make ``ffi.Module.create.cuda`` available for building. Returns how:
    "registered" (already), "driver" (loaded against the real libcuda.so.1) or "stub"."""
    import tvm  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    if _cuda_module_factory_registered():
        return "registered"
    how = "driver"
    try:
        _HELD_LIBS.append(ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL))
    except OSError:
        _HELD_LIBS.append(ctypes.CDLL(str(_build_libcuda_stub()), mode=ctypes.RTLD_GLOBAL))
        how = "stub"
    load_cuda_runtime()
    if not _cuda_module_factory_registered():
        raise DeviceCodeError("libtvm_runtime_cuda.so loaded but ffi.Module.create.cuda is missing")
    return how


# --------------------------------------------------------------------------------------
# Compiling at build time
# --------------------------------------------------------------------------------------


def _normalize_arch(arch: str) -> str:
    arch = arch.strip()
    if arch.startswith("sm_"):
        arch = arch[3:]
    elif arch.startswith("sm"):
        arch = arch[2:]
    if not arch or not arch[0].isdigit():
        raise DeviceCodeError(f"bad CUDA arch {arch!r} (want e.g. 'sm_90a')")
    return arch


def nvcc_fatbin(
    code: str,
    arch: str,
    options: Sequence[str] = (),
    embed_ptx: bool = False,
    keep_dir: Optional[Union[str, Path]] = None,
) -> bytes:
    """Compile CUDA source to a fatbin for ``arch`` ("sm_90a") with nvcc, using TVM's own
    nvcc flags (fast math, half/bf16 operators, ptxas options) from tvm.support.nvcc."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.support import nvcc  # pylint: disable=import-outside-toplevel

    if shutil.which("nvcc") is None:
        raise DeviceCodeError("nvcc is not on PATH: it is needed to precompile CUDA device code")
    sm = _normalize_arch(arch)
    # The -gencode form: `-arch=sm_90a` also runs a plain sm_90 pass with nvcc 13.0.
    code_list = f"[sm_{sm},compute_{sm}]" if embed_ptx else f"sm_{sm}"
    gencode = ["-gencode", f"arch=compute_{sm},code={code_list}"]
    path_target = None
    if keep_dir is not None:
        Path(keep_dir).mkdir(parents=True, exist_ok=True)
        idx = len(list(Path(keep_dir).glob("kernels_*.cu")))
        (Path(keep_dir) / f"kernels_{idx}.cu").write_text(code)
        path_target = str(Path(keep_dir) / f"kernels_{idx}.fatbin")
    # compile_cuda reads Target.current() for the compute version: give it ours.
    with tvm.target.Target({"kind": "cuda", "arch": f"sm_{sm}"}):
        data = nvcc.compile_cuda(
            code,
            target_format="fatbin",
            arch=gencode,
            options=list(options) or None,
            path_target=path_target,
            compiler="nvcc",
        )
    data = bytes(data)
    if not data.startswith(FATBIN_MAGIC):
        raise DeviceCodeError("nvcc --fatbin produced no fatbin")
    return data


@contextlib.contextmanager
def precompiled_cuda(
    arch: str,
    options: Sequence[str] = (),
    embed_ptx: bool = False,
    keep_dir: Optional[Union[str, Path]] = None,
) -> Iterator[List[int]]:
    """Within this context, ``tvm.compile`` for a CUDA target stores an nvcc fatbin for
    ``arch`` instead of CUDA source. Yields a list that receives the size of each fatbin
    compiled (one per device module). Restores the previous compile callback on exit."""
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    ensure_cuda_module_factory()
    name = "tvm_callback_cuda_compile"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)
    sizes: List[int] = []

    def _compile(code):  # called by CUDAModuleNode with the CUDA source
        data = nvcc_fatbin(str(code), arch, options=options, embed_ptx=embed_ptx, keep_dir=keep_dir)
        sizes.append(len(data))
        return bytearray(data)

    tvm_ffi.register_global_func(name, _compile, override=True)
    try:
        yield sizes
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)
        else:
            tvm_ffi.remove_global_func(name)


# TVM 0.27's nvcc flags pass ``ptxas --register-usage-level=10``, with which ptxas gave the
# MoE w2 decode kernel 255 registers and spills (3x slower, benchmarks/results/
# moe_decode_ncu_h200_2026-11-29.txt); at level 5 it uses 48, the fused KDA decode kernel
# 67 (70 at level 10). A later option wins, so this is passed after TVM's.
PTXAS_OPTIONS = ("--ptxas-options=--register-usage-level=5",)


def build_cuda(mod, target_spec, *, arch: Optional[str] = None, options: Sequence[str] = PTXAS_OPTIONS,
               embed_ptx: bool = False, keep_dir=None, **compile_kwargs):
    """``tvm.compile(mod, target)`` with the CUDA device code precompiled to a fatbin
    (nvcc ``options``: :data:`PTXAS_OPTIONS` unless given).

    ``target_spec``: a ``targets.TargetSpec`` (its ``nvcc_arch`` is used), a
    ``tvm.target.Target`` or a target dict with ``arch``. Extra keyword arguments go to
    ``tvm.compile`` (``relax_pipeline``, ``tir_pipeline``...). Returns the Executable.
    """
    import tvm  # pylint: disable=import-outside-toplevel

    if hasattr(target_spec, "tvm_target"):
        target = target_spec.tvm_target()
        arch = arch or getattr(target_spec, "nvcc_arch", None)
    elif isinstance(target_spec, dict):
        target = tvm.target.Target(target_spec)
    else:
        target = target_spec
    if arch is None:
        arch = str(target.attrs.get("arch", "")) or None
    if not arch:
        raise DeviceCodeError("build_cuda needs a CUDA arch (target 'arch' or arch=...)")
    with precompiled_cuda(arch, options=options, embed_ptx=embed_ptx, keep_dir=keep_dir):
        return tvm.compile(mod, target=target, **compile_kwargs)


# --------------------------------------------------------------------------------------
# Inspecting an exported library
# --------------------------------------------------------------------------------------


@dataclass
class DeviceBlob:
    """One serialized CUDA module found in a library."""

    fmt: str  # format tag saved by TVM: "cuda", "ptx", "cubin", "fatbin"
    content: str  # what the code really is: "cuda-source", "ptx", "cubin", "fatbin", "unknown"
    size: int  # bytes of the serialized module
    functions: List[str] = field(default_factory=list)


def _classify(payload: bytes) -> str:
    if FATBIN_MAGIC in payload:
        return "fatbin"
    if ELF_MAGIC in payload:
        return "cubin"
    if b".version" in payload and b".target sm_" in payload:
        return "ptx"
    if b"__global__" in payload:
        return "cuda-source"
    return "unknown"


def inspect_library(path: Union[str, Path]) -> List[DeviceBlob]:
    """The CUDA modules serialized in an exported library (``export_library`` output),
    read from the file's bytes without loading it (no GPU, no TVM needed).

    TVM serializes each imported module as ``u64 len, kind`` then ``u64 len, payload``;
    a CUDA payload starts with ``u64 len, fmt``, then the function table and the code.
    """
    data = Path(path).read_bytes()
    blobs: List[DeviceBlob] = []
    key = struct.pack("<Q", 4) + b"cuda"
    start = 0
    while True:
        i = data.find(key, start)
        if i < 0:
            break
        start = i + len(key)
        try:
            (psize,) = struct.unpack_from("<Q", data, start)
            (flen,) = struct.unpack_from("<Q", data, start + 8)
        except struct.error:
            continue
        if not 0 < psize <= len(data) - start - 8 or not 0 < flen <= 16:
            continue
        fmt = data[start + 16 : start + 16 + flen]
        if not fmt.isalpha():
            continue
        payload = data[start + 8 : start + 8 + psize]
        fmt_s = fmt.decode()
        content = "cuda-source" if fmt_s == "cuda" else _classify(payload)
        funcs = []
        pos = start + 16 + flen
        try:
            (nfun,) = struct.unpack_from("<Q", data, pos)
            pos += 8
            if nfun < 100000:
                for _ in range(nfun):
                    (n,) = struct.unpack_from("<Q", data, pos)
                    funcs.append(data[pos + 8 : pos + 8 + n].decode(errors="replace"))
                    break  # the first name is enough to show the table parsed
        except struct.error:
            pass
        blobs.append(DeviceBlob(fmt=fmt_s, content=content, size=psize, functions=funcs))
    return blobs


def library_has_source_only(path: Union[str, Path]) -> bool:
    """True when the library's CUDA device code is stored only as CUDA C++ source (it will
    need a CUDA compiler when loaded). False when every CUDA module holds PTX/cubin/fatbin,
    or when the library has no CUDA module at all."""
    blobs = inspect_library(path)
    return any(b.content == "cuda-source" for b in blobs)


def describe_library(path: Union[str, Path]) -> str:
    """One line per CUDA module: format tag, real content, size."""
    blobs = inspect_library(path)
    if not blobs:
        return f"{path}: no CUDA device module"
    return "\n".join(
        f"{path}: cuda module fmt={b.fmt} content={b.content} bytes={b.size}" for b in blobs
    )


__all__ = [
    "DeviceBlob",
    "DeviceCodeError",
    "build_cuda",
    "describe_library",
    "ensure_cuda_module_factory",
    "find_tvm_runtime_cuda",
    "inspect_library",
    "library_has_source_only",
    "load_cuda_runtime",
    "nvcc_fatbin",
    "precompiled_cuda",
    "PTXAS_OPTIONS",
]
