"""schedules/mxfp4_gemm_tcgen05.py: the NumPy reference, size checks, and that the block-scaled
tcgen05 kernel lowers for cuda-sm100a (and, with nvcc, compiles to a fatbin). No Blackwell GPU
exists here, so nothing runs the kernel."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers_tvm import needs_nvcc
from schedules import mxfp4_gemm_tcgen05 as mg
from schedules.moe_generic import mxfp4_dequant_reference

MMA = "tcgen05.mma.cta_group::1.kind::mxf4.block_scale.scale_vec::2X"
M, N, K = 256, 128, 512  # 2 x 1 CTAs, 2 K steps


def _operands(rng, rows, k):
    codes = rng.integers(0, 256, size=(rows, k // 2), dtype=np.uint8)
    scale = rng.integers(120, 134, size=(rows, k // 32), dtype=np.uint8)
    return codes, scale


def _decode(codes, scale):
    """MXFP4 decoded here from the OCP MX spec's E2M1 table, independently of the project's
    decoder: low nibble = even column, E8M0 value 2^(s - 127) per 32 inputs."""
    table = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
    return table[nib] * np.repeat(np.exp2(scale.astype(np.float64) - 127.0), 32, axis=1)


def test_reference_matches_independent_dequant():
    rng = np.random.default_rng(0)
    a, sa = _operands(rng, 64, 256)
    b, sb = _operands(rng, 48, 256)
    got = mg.mxfp4_gemm_reference(a, sa, b, sb)
    want = _decode(a, sa) @ _decode(b, sb).T
    assert got.shape == (64, 48)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_reference_decodes_nibbles_and_scales_by_hand():
    # byte 0x2F: even column = 0xF (-6), odd column = 0x2 (1.0); scale 128 -> x2, 125 -> x0.25
    codes = np.zeros((1, 32), dtype=np.uint8)
    codes[0, 0] = 0x2F
    codes[0, 16] = 0x07  # column 32 = +6 (second scale group)
    scale = np.array([[128, 125]], dtype=np.uint8)
    w = mxfp4_dequant_reference(codes, scale)
    assert w[0, 0] == -12.0 and w[0, 1] == 2.0 and w[0, 32] == 1.5 and w[0, 33] == 0.0
    assert np.count_nonzero(w) == 3
    assert mg.mxfp4_gemm_reference(codes, scale, codes, scale)[0, 0] == 144.0 + 4.0 + 2.25


def test_reference_rejects_mismatched_operands():
    rng = np.random.default_rng(1)
    a, sa = _operands(rng, 8, 64)
    b, sb = _operands(rng, 8, 128)
    with pytest.raises(ValueError, match="K mismatch"):
        mg.mxfp4_gemm_reference(a, sa, b, sb)
    with pytest.raises(ValueError, match="scale shape"):
        mg.mxfp4_gemm_reference(a, sb, a, sa)


@pytest.mark.parametrize("m,n,k,what", [(100, 128, 256, "M=100"), (128, 64, 256, "N=64"),
                                        (128, 128, 128, "K=128"), (0, 128, 256, "M=0")])
def test_builder_rejects_bad_sizes(m, n, k, what):
    with pytest.raises(ValueError, match=what):
        mg.mxfp4_gemm_tcgen05_kernel(m, n, k)


def test_builder_rejects_bad_stages():
    with pytest.raises(ValueError, match="stages"):
        mg.mxfp4_gemm_tcgen05_kernel(128, 128, 256, stages=0)


def test_scale_stages_do_not_overlap_in_tmem():
    """Each stage's 128 x 8 E8M0 tile spans 8 TMEM columns; the stages sit 8 columns apart
    (TVM's own pipe_depth stride, 4 columns, would overlap them)."""
    lay = mg._sf_tmem_stages(4, 8, 8)
    cols = set()
    for st in range(4):
        mine = {int(lay.apply(st * 128 * 8 + r * 8 + j)["TCol"]) // 4
                for r in range(0, 128, 32) for j in range(8)}
        assert mine == set(range(8 * st, 8 * st + 8))
        assert not (mine & cols)
        cols |= mine
    with pytest.raises(ValueError, match="more than"):
        mg._sf_tmem_stages(4, 8, 4)


def _source():
    import tvm

    from targets import get_target

    f = mg.mxfp4_gemm_tcgen05_kernel(M, N, K)
    lib = tvm.tirx.build(tvm.IRModule({"main": f}), target=get_target("cuda-sm100a").tvm_target(),
                         pipeline="tirx")
    return lib.imports[0].inspect_source()


def test_cuda_source_uses_block_scaled_tcgen05():
    src = _source()
    # 4 MMAs (K = 64 each) per 256-input K step, one call site each in the unrolled stage
    assert len(re.findall(r"tvm_builtin_ptx_tcgen05_mma_block_scale\w*\(tbase", src)) == 4
    assert MMA in src and "kind::mxf8f6f4" not in src
    assert "tcgen05.cp.cta_group::1.32x128b.warpx4" in src     # scales smem -> TMEM
    assert "cp.async.bulk.tensor.2d" in src                      # TMA for the codes
    assert "tcgen05.commit.cta_group::1.mbarrier::arrive::one" in src
    assert "tcgen05.ld.sync.aligned.32x32b.x32.b32" in src       # epilogue
    assert "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32" in src
    assert "extern __shared__" in src                            # one dynamic pool (139 KiB)
    assert "__launch_bounds__(128)" in src


_BUILD = """
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import tvm
from k3_compile.device_code import precompiled_cuda, inspect_library
from schedules.mxfp4_gemm_tcgen05 import mxfp4_gemm_tcgen05_kernel
from targets import get_target
mod = tvm.IRModule({{"main": mxfp4_gemm_tcgen05_kernel({m}, {n}, {k})}})
with precompiled_cuda("sm_100a", keep_dir={keep!r}) as sizes:
    lib = tvm.compile(mod, target=get_target("cuda-sm100a").tvm_target(), tir_pipeline="tirx")
lib.export_library({so!r})
print([b.content for b in inspect_library({so!r})], sizes)
"""


def _nvcc_has_sm100a() -> bool:
    try:
        out = subprocess.run(["nvcc", "--list-gpu-arch"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "compute_100" in out


@needs_nvcc
def test_kernel_compiles_to_sm100a_fatbin(tmp_path):
    """nvcc (ptxas) accepts the kernel for sm_100a, inside the project's precompiled_cuda path
    (run in a subprocess: loading libtvm_runtime_cuda is process-wide)."""
    if not _nvcc_has_sm100a():
        pytest.skip("this nvcc has no sm_100a")
    root = Path(__file__).resolve().parent.parent
    code = _BUILD.format(root=str(root), tests=str(root / "tests"), m=M, n=N, k=K,
                         keep=str(tmp_path / "src"), so=str(tmp_path / "k.so"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "fatbin" in res.stdout
    kept = list((tmp_path / "src").rglob("*.cu"))
    assert kept and any(MMA in p.read_text() for p in kept)
