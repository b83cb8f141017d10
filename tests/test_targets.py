"""Targets resolve, compile, and (CUDA) store precompiled device code. CPU only, fast."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from targets import TargetSpec, get_target, host_default, list_targets

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"llvm", "cuda-sm90a", "cuda-sm100a", "cuda-sm120a", "metal", "rocm-gfx942"}
VERIFIED_PREFIXES = ("runs here", "runs on the H200", "compiles only", "does not compile here: ")


def test_every_target_resolves():
    assert set(list_targets()) == EXPECTED
    for name in list_targets():
        spec = get_target(name)
        assert isinstance(spec, TargetSpec) and spec.name == name
        assert spec.verified.startswith(VERIFIED_PREFIXES), spec.verified
        assert spec.schedule_set in ("dlight-gpu", "cpu")
        assert spec.features.warp_size >= 1
        if spec.is_cuda:
            assert spec.nvcc_arch == spec.target["arch"]
        if name != "rocm-gfx942":  # the rocm target kind probes for a ROCm install; fine
            t = spec.tvm_target()
            assert t.kind.name == spec.target["kind"]
            if spec.host is not None:
                assert t.host is not None


def test_aliases_and_host_default():
    assert get_target("h200").name == "cuda-sm90a"
    assert get_target("cuda_sm100a").name == "cuda-sm100a"
    assert get_target("CPU").name == "llvm"
    assert host_default().name == "llvm" and host_default().device == "cpu"


def test_unknown_target_lists_known_ones():
    with pytest.raises(KeyError) as err:
        get_target("tpu-v5")
    msg = str(err.value)
    assert "tpu-v5" in msg
    for name in EXPECTED:
        assert name in msg


def _trivial_relax_module():
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor(("n", 16), "float32"), y: R.Tensor((16,), "float32")):
            with R.dataflow():
                z = R.add(x, y)
                w = R.multiply(z, R.const(2.0, "float32"))
                R.output(w)
            return w

    return Module


def test_llvm_compiles_and_runs(tmp_path):
    import tvm
    from tvm.runtime import vm as rvm

    spec = get_target("llvm")
    ex = tvm.compile(_trivial_relax_module(), target=spec.tvm_target())
    path = tmp_path / "trivial_llvm.so"
    ex.export_library(str(path))
    dev = spec.tvm_device()
    vm = rvm.VirtualMachine(tvm.runtime.load_module(str(path)), dev)
    x = np.arange(3 * 16, dtype="float32").reshape(3, 16)
    y = np.ones(16, dtype="float32")
    out = vm["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(y, dev)).numpy()
    np.testing.assert_allclose(out, (x + y) * 2.0)


def test_metal_generates_code():
    import tvm

    spec = get_target("metal")
    ex = tvm.compile(_trivial_relax_module(), target=spec.tvm_target())
    found = []

    def walk(mod):
        for m in mod.imports:
            found.append(m)
            walk(m)

    walk(ex.mod)
    metal = [m for m in found if m.kind == "metal"]
    assert metal, [m.kind for m in found]
    assert "kernel void" in metal[0].inspect_source("")


# The CUDA builds run in a subprocess: build_cuda loads libtvm_runtime_cuda.so (and, without
# a driver, a stub libcuda.so.1) into its process for good, which changes how any later
# plain tvm.compile for CUDA behaves in that process.
_CUDA_SCRIPT = r"""
import json, sys
sys.path.insert(0, {root!r})
import tvm
from k3_compile import device_code
from targets import get_target
from tests.test_targets import _trivial_relax_module
res = {{}}
for name in {names!r}:
    path = {tmp!r} + "/" + name + ".so"
    device_code.build_cuda(_trivial_relax_module(), get_target(name)).export_library(path)
    res[name] = [[b.fmt, b.content] for b in device_code.inspect_library(path)] + \
        [device_code.library_has_source_only(path)]
print("RESULT " + json.dumps(res))
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: cannot precompile CUDA")
def test_cuda_targets_store_fatbin(tmp_path):
    names = ["cuda-sm90a", "cuda-sm100a", "cuda-sm120a"]
    code = _CUDA_SCRIPT.format(root=str(ROOT), names=names, tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    for name in names:
        *blobs, source_only = res[name]
        assert blobs, f"{name}: no CUDA module in the library"
        assert all(content == "fatbin" for _, content in blobs), (name, blobs)
        assert source_only is False


def test_inspector_sees_cuda_source(tmp_path):
    # Without build_cuda, TVM here (no CUDA driver) stores CUDA C++ source.
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import tvm\n"
        "from targets import get_target\n"
        "from tests.test_targets import _trivial_relax_module\n"
        "from k3_compile import device_code\n"
        "if device_code._cuda_module_factory_registered():\n"
        "    print('SKIP: libtvm_runtime_cuda.so is loaded (driver present): TVM compiles at build time'); sys.exit(0)\n"
        "tvm.compile(_trivial_relax_module(), target=get_target('cuda-sm90a').tvm_target())"
        ".export_library(%r)\n"
        "print('SOURCE_ONLY', device_code.library_has_source_only(%r))\n"
    ) % (str(ROOT), str(tmp_path / "src.so"), str(tmp_path / "src.so"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "SKIP:" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert "SOURCE_ONLY True" in proc.stdout, proc.stdout


def test_metal_compiles_k3_nano_in_default_dtype(tmp_path):
    """A Metal library of k3-nano (bf16, the GPU default) compiles to objects: the tuned kernels
    are CUDA-only (inline PTX, dynamic shared memory), so Metal takes the generic GPU kernels
    and reads the expert codes as stored."""
    import tarfile

    from k3_compile.compile import compile_model

    out = tmp_path / "nano-metal.tar"
    compile_model(ROOT / "models" / "k3-nano", "metal", out)
    names = tarfile.open(out).getnames()
    assert any(n.endswith(".o") for n in names), names
