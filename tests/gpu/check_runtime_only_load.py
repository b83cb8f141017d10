"""Precompiled CUDA library: build here, load and run with a runtime-only TVM and no nvcc.

Build (compile machine, full TVM + nvcc; writes dist/runtime_only_check/):
    python3 tests/gpu/check_runtime_only_load.py --build
Run (GPU machine, runtime-only TVM, carry [".tvm-rt", "dist"]):
    source .tvm-rt/env.sh && python3 tests/gpu/check_runtime_only_load.py

The model: y = x @ w + b with a symbolic batch n, float32, run for n = 1, 7 and 300 and
compared with NumPy. The run refuses to start if nvcc is reachable (it is removed from
PATH first) or if a CUDA compile callback is registered, so the library can only work
if its device code was compiled when it was built.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT_DIR = ROOT / "dist" / "runtime_only_check"
LIB = OUT_DIR / "matmul_add_sm90a.so"
# Negative control: the same module as TVM stores it by default here (CUDA source).
SRC_LIB = OUT_DIR / "matmul_add_sm90a_source.so"
K, N = 256, 512


def build() -> None:
    import tvm
    from tvm.script import ir as I
    from tvm.script import relax as R

    from k3_compile import device_code
    from targets import get_target

    @I.ir_module
    class Module:
        @R.function
        def main(
            x: R.Tensor(("n", K), "float32"),
            w: R.Tensor((K, N), "float32"),
            b: R.Tensor((N,), "float32"),
        ) -> R.Tensor(("n", N), "float32"):
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.add(y, b)
                R.output(z)
            return z

    spec = get_target("cuda-sm90a")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    # Plain tvm.compile first (before build_cuda loads the CUDA runtime into this process).
    tvm.compile(Module, target=spec.tvm_target()).export_library(str(SRC_LIB))
    print(device_code.describe_library(SRC_LIB))
    if not device_code.library_has_source_only(SRC_LIB):
        SRC_LIB.unlink()  # TVM compiled at build time here (a CUDA driver is present)
    ex = device_code.build_cuda(Module, spec)
    ex.export_library(str(LIB))
    print(device_code.describe_library(LIB))
    assert not device_code.library_has_source_only(LIB), "library still holds CUDA source"
    print("built", LIB, LIB.stat().st_size, "bytes")


def run() -> None:
    # No CUDA compiler reachable: drop every PATH entry holding nvcc.
    os.environ["PATH"] = os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep)
        if p and not os.path.exists(os.path.join(p, "nvcc"))
    )
    assert shutil.which("nvcc") is None, "nvcc still on PATH"

    import numpy as np
    import tvm
    import tvm_ffi
    import tvm.runtime.vm  # noqa: F401  (not imported by `import tvm`)

    from k3_compile import device_code

    compiler_present = os.path.exists(os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_compiler.so"))
    print("tvm", tvm.__version__, "| compiler library present:", compiler_present)
    print("library:", device_code.describe_library(LIB))
    lib_path = device_code.load_cuda_runtime()
    print("loaded", lib_path)
    cb = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    print("tvm_callback_cuda_compile registered:", cb is not None)
    # Whatever registered it, replace it by one that fails: loading must not compile.
    def _no_compile(code):
        raise RuntimeError("CUDA compile requested at load time")

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _no_compile, override=True)
    print("tvm_callback_cuda_compile replaced by a function that raises")

    dev = tvm.runtime.device("cuda", 0)
    print("device:", dev, "exists:", dev.exist, "compute:", dev.compute_version)
    lib = tvm.runtime.load_module(str(LIB))
    vm = tvm.runtime.vm.VirtualMachine(lib, dev)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N), dtype=np.float32)
    b = rng.standard_normal((N,), dtype=np.float32)
    w_d, b_d = tvm.runtime.tensor(w, dev), tvm.runtime.tensor(b, dev)
    worst = 0.0
    for n in (1, 7, 300):
        x = rng.standard_normal((n, K), dtype=np.float32)
        out = vm["main"](tvm.runtime.tensor(x, dev), w_d, b_d).numpy()
        ref = x @ w + b
        err = float(np.max(np.abs(out - ref)))
        worst = max(worst, err)
        print(f"n={n}: shape {out.shape}, max abs err {err:.3e}")
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)
    print(f"RUNTIME-ONLY LOAD OK (worst max abs err {worst:.3e})")
    if SRC_LIB.exists():
        print("control:", device_code.describe_library(SRC_LIB))
        try:
            tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(SRC_LIB)), dev)
            print("control: the CUDA-source library loaded too (unexpected)")
        except Exception as err:  # pylint: disable=broad-except
            print("control: the CUDA-source library fails to load as expected:",
                  str(err).strip().splitlines()[-1][:200])


if __name__ == "__main__":
    if "--build" in sys.argv[1:]:
        build()
    else:
        run()
