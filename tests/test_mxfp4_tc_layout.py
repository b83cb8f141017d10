"""The tc layout of MXFP4 expert codes (schedules/mxfp4_tc_layout.py) and the device code that
reads it (schedules/mxfp4_ptx.py ``dequant8`` / ``factor_bf16x2``), on the CPU: the permutation
kernel (llvm) against the numpy definition, the device recipe emulated instruction by
instruction — with the constants read from the CUDA source — against the E2M1/E8M0 tables,
and the loader's handling of the layout (scale check, device repack)."""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from schedules import moe_generic as mg
from schedules import mxfp4_ptx as ptx
from schedules import mxfp4_tc_layout as tcl

NANO = Path(__file__).resolve().parents[1] / "models" / "k3-nano"


def _bf16(bits) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


def _rotr(x: int, r: int) -> int:
    return ((x >> r) | (x << (32 - r))) & 0xFFFFFFFF if r else x


def _device_recipe(w: int, f2: int) -> list[int]:
    """``k3_e2m1x8_tc`` as written in ``ptx.DEQUANT_SRC`` (rotations and masks parsed from the
    source, so a typo there fails here), then ``mul.rn.bf16x2`` by ``f2`` (bf16 round to
    nearest; exact here)."""
    src = ptx.DEQUANT_SRC
    t0 = int(re.search(r"r\[0\] = w & (0x[0-9a-f]+)u", src).group(1), 16)
    (r1, t1), (r2, t2) = ((int(a), int(b, 16)) for a, b in (
        re.search(rf"r\[{i}\] = __funnelshift_r\(w, w, (\d+)\) & (0x[0-9a-f]+)u;", src).groups() for i in (1, 2)))
    ra, ma, rb, mb = re.search(r"r\[3\] = \(__funnelshift_r\(w, w, (\d+)\) & (0x[0-9a-f]+)u\) \| "
                               r"\(__funnelshift_r\(w, w, (\d+)\) & (0x[0-9a-f]+)u\)", src).groups()
    regs = [w & t0, _rotr(w, r1) & t1, _rotr(w, r2) & t2,
            (_rotr(w, int(ra)) & int(ma, 16)) | (_rotr(w, int(rb)) & int(mb, 16))]
    out = []
    for r in regs:
        prod = (_bf16([r & 0xFFFF, r >> 16]) * _bf16([f2 & 0xFFFF, f2 >> 16])).astype(ml_dtypes.bfloat16)
        u = prod.view(np.uint16)
        out.append(int(u[0]) | (int(u[1]) << 16))
    return out


def _factor2(s: int) -> int:
    """``ptx.factor_bf16x2`` emulated with its constants: byte -> bf16x2 ``2^(s-1)``."""
    d = ptx.FACTOR_NAN2 if s == 255 else ((s + ptx.FACTOR_OFFSET) * ptx.FACTOR_MUL) & 0xFFFFFFFF
    assert (d & 0xFFFF) == int(tcl.factor_reference(np.uint8(s)))  # the TIR twin agrees
    return d


def test_layout_pieces_partition_the_word_and_round_trip():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 7, 20), dtype=np.uint8)  # odd sizes, 5 words per row
    stored = tcl.repack_reference(packed)
    assert stored.shape == packed.shape and not np.array_equal(stored, packed)
    np.testing.assert_array_equal(tcl.decode_reference(stored.view("<u4")),
                                  tcl.mma_words_reference(packed.view("<u4")))
    # a permutation of bits: popcounts are kept word by word
    pc = np.vectorize(lambda x: bin(int(x)).count("1"))
    np.testing.assert_array_equal(pc(stored.view("<u4")), pc(packed.view("<u4")))


def test_mma_words_are_e2m1_times_2_pow_minus_126():
    codes = np.arange(16, dtype=np.uint32)
    for lo in range(16):  # every code pair in every position of a word
        w = np.uint32(0)
        for i in range(8):
            w |= np.uint32((lo if i % 2 == 0 else codes[(lo + i) % 16]) << (4 * i))
        words = tcl.mma_words_reference(np.array([w]))[0]
        vals = _bf16(np.stack([words & 0xFFFF, words >> 16], -1).reshape(-1)) * 2.0 ** 126
        ref = mg.e2m1_reference(np.array([(int(w) >> (4 * i)) & 15 for i in range(8)], np.uint8))
        np.testing.assert_array_equal(vals, ref)


def test_device_recipe_matches_e2m1_and_e8m0_tables():
    rng = np.random.default_rng(1)
    words = [0x76543210, 0xFEDCBA98, 0x11111111, 0x99999999] + \
        [int(x) for x in rng.integers(0, 2 ** 32, 200, dtype=np.uint64)]
    for w in words:
        stored = int(tcl.repack_reference(np.array([w], "<u4").view(np.uint8)).view("<u4")[0])
        codes = np.array([(w >> (4 * i)) & 15 for i in range(8)], np.uint8)
        for s in (0, 1, 2, 100, 121, 127, 128):
            got = _bf16(np.array([[x & 0xFFFF, x >> 16] for x in _device_recipe(stored, _factor2(s))]).reshape(-1))
            ref = mg.e2m1_reference(codes).astype(np.float64) * 2.0 ** (s - 127)
            np.testing.assert_array_equal(got, ref, err_msg=f"w={w:#x} s={s}")
    got = _bf16(np.array([[x & 0xFFFF, x >> 16] for x in _device_recipe(0x0, _factor2(255))]).reshape(-1))
    assert np.isnan(got).all()  # E8M0 255 is NaN, also for code 0


def test_factor_word_matches_e8m0():
    for s in list(range(0, 129)) + [255]:
        d = _factor2(s)
        assert d & 0xFFFF == d >> 16
        if s != 255:
            assert _bf16([d & 0xFFFF])[0] == 2.0 ** (s - 1)


def test_repack_kernel_llvm_equals_reference():
    import tvm

    rng = np.random.default_rng(2)
    lib = tvm.compile(tvm.IRModule({"repack": tcl.repack_kernel(gpu=False).with_attr("global_symbol", "repack")}),
                      target="llvm")
    for shape in ((1, 1, 4), (3, 5, 12), (2, 9, 36)):
        packed = rng.integers(0, 256, shape, dtype=np.uint8)
        t = tvm.runtime.tensor(packed)
        lib["repack"](t)
        np.testing.assert_array_equal(t.numpy(), tcl.repack_reference(packed))


def test_factor_tir_matches_reference_on_llvm():
    """The TIR ``factor_bf16`` (what the prefill kernel evaluates) for every byte, compiled for
    the CPU, against ``factor_reference`` and 2^(s-1)."""
    import tvm
    from tvm.script import tirx as T

    @T.prim_func
    def factors(s_h: T.handle, o_h: T.handle):
        s = T.match_buffer(s_h, (256,), "uint32")
        o = T.match_buffer(o_h, (256,), "uint32")
        for i in range(256):
            o[i] = tcl.factor_bf16(s[i])

    lib = tvm.compile(tvm.IRModule({"factors": factors.with_attr("global_symbol", "factors")}), target="llvm")
    s = np.arange(256, dtype=np.uint32)
    o = tvm.runtime.tensor(np.zeros(256, np.uint32))
    lib["factors"](tvm.runtime.tensor(s), o)
    got = o.numpy()
    ok = np.r_[0:129, 255]
    np.testing.assert_array_equal(got[ok], tcl.factor_reference(s[ok].astype(np.uint8)))
    np.testing.assert_array_equal(_bf16(got[:129].astype(np.uint16)), 2.0 ** (np.arange(129) - 1.0))
    assert np.isnan(_bf16([got[255]]))[0]


def test_repack_as_relax_function_runs_in_place():
    """``k3_compile.pipeline.attach_repack`` (CPU kernel): the library function the runtime calls
    on each uploaded ``weight_packed`` gives the reference layout."""
    import tvm
    from tvm import relax

    from k3_compile.pipeline import REPACK_FN, attach_repack

    mod = attach_repack(tvm.IRModule(), gpu=False)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    packed = np.random.default_rng(3).integers(0, 256, (2, 3, 8), dtype=np.uint8)
    t = tvm.runtime.tensor(packed)
    out = vm[REPACK_FN](t)
    np.testing.assert_array_equal(out.numpy(), tcl.repack_reference(packed))
    np.testing.assert_array_equal(t.numpy(), tcl.repack_reference(packed))  # in place


def test_check_scales_names_the_tensor_and_index():
    ok = np.array([[0, 1, 127, 128, 255]], np.uint8)
    tcl.check_scales(ok, "x")
    bad = ok.copy()
    bad[0, 2] = 129
    with pytest.raises(ValueError, match=r"tensor m\.w1\.weight_scale: E8M0 scale byte 129 at \[0, 2\].*--generic-kernels"):
        tcl.check_scales(bad, "m.w1.weight_scale")


def test_loader_checks_scales_and_repacks_only_expert_codes():
    from k3_compile.loader import check_expert_scales, repack_expert_codes

    name = "model.layers.1.block_sparse_moe.experts.w2.weight_scale"
    bad = np.full((2, 3, 4), 200, np.uint8)
    check_expert_scales(name, bad, "ocp")  # the checkpoint layout takes any scale
    check_expert_scales("model.layers.1.mlp.weight", bad, tcl.LAYOUT)  # not an expert scale
    with pytest.raises(ValueError, match="w2.weight_scale"):
        check_expert_scales(name, bad, tcl.LAYOUT)

    calls = []

    class VM:
        def __getitem__(self, fn):
            return lambda t: calls.append((fn, t)) or ("repacked", t)

    names = ["model.layers.1.block_sparse_moe.experts.w1.weight_packed",
             "model.layers.1.block_sparse_moe.experts.w1.weight_scale", "model.embed_tokens.weight"]
    out = repack_expert_codes(VM(), tcl.LAYOUT, names, ["p", "s", "e"])
    assert out == [("repacked", "p"), "s", "e"] and calls == [("repack_expert_codes", "p")]
    assert repack_expert_codes(VM(), "ocp", names, ["p", "s", "e"]) == ["p", "s", "e"]

    from k3_compile.loader import ParameterError

    class Failing:
        def __getitem__(self, fn):
            def f(t):
                raise RuntimeError("CUDA error: an illegal memory access\nstack...")
            return f

    with pytest.raises(ParameterError, match=r"experts\.w1\.weight_packed: repack_expert_codes failed "
                                             r"\(CUDA error: an illegal memory access\)"):
        repack_expert_codes(Failing(), tcl.LAYOUT, names, ["p", "s", "e"])


def test_export_records_the_layout_per_build():
    """bf16 CUDA builds with the tuned kernels read the tc layout (and carry the repack
    function); CPU, float32 and --generic-kernels builds the checkpoint's."""
    from types import SimpleNamespace

    from k3_compile.compile import build_metadata
    from k3_compile.config import K3Config
    from k3_compile.pipeline import REPACK_FN, export_model, load_checkpoint_params

    cfg = K3Config.from_file(NANO)
    spec = SimpleNamespace(name="cuda-sm90a", device="cuda", nvcc_arch="sm_90a")
    for dtype, gpu, tuned, want in (("bfloat16", True, True, tcl.LAYOUT), ("bfloat16", True, False, "ocp"),
                                    ("float32", True, True, "ocp"), ("bfloat16", False, True, "ocp")):
        ex = export_model(cfg, dtype, gpu=gpu, tuned=tuned)
        assert ex.code_layout == want, (dtype, gpu, tuned)
        names = [g.name_hint for g in ex.mod.get_global_vars()]
        assert (REPACK_FN in names) == (want != "ocp")
        meta = build_metadata(ex, spec, max_batch_size=1, context_window=64, prefill_chunk=16)
        assert meta["expert_code_layout"] == want and (REPACK_FN in meta["functions"]) == (want != "ocp")
    with pytest.raises(ValueError, match="pass vm="):
        load_checkpoint_params(NANO, export_model(cfg, "bfloat16", gpu=True), None)
