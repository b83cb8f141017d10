"""The sibling-projection pass (k3_compile/sibling_gemvs.py) without a GPU: which projections
it groups (same activation, all arguments defined before the first, no reader of a sibling's
output, shapes the GEMV fits), how it rewrites the Relax function (one call returning a tuple at
the first sibling's place, the siblings' variables bound to its fields) and the merged
PrimFunc (inputs then outputs, one branch on n <= MAX_TOKENS with one launch whose grid is the
projections' blocks, the projections' own scheduled bodies above). GPU numerics: the K3 MoE
layer at 1 and 2 tokens (benchmarks/moe_layer.py) and k3-nano (tests/gpu/run_nano_cuda.py)
on the H200."""

from __future__ import annotations

import functools
import re

import pytest

tvm = pytest.importorskip("tvm")
from helpers_tvm import fused_module  # noqa: E402 - after the importorskip


def _fused():
    """A Relax module after FuseTIR: ``x [n, 256]`` times four weights — ``a`` (cast),
    ``b`` (tanh epilogue), ``c`` (its epilogue multiplies by ``a``: reads a sibling's output),
    ``d`` (48 rows) — and ``e`` on another activation."""
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op

    class M(nn.Module):
        def __init__(self):
            self.wa = nn.Parameter((64, 256), "bfloat16")
            self.wb = nn.Parameter((128, 256), "bfloat16")
            self.wc = nn.Parameter((64, 256), "bfloat16")
            self.wd = nn.Parameter((48, 256), "bfloat16")
            self.we = nn.Parameter((64, 256), "bfloat16")

        def forward(self, x, z):
            def mm(t, w):
                return op.matmul(t, op.permute_dims(w, [1, 0]), out_dtype="float32")

            a = op.astype(mm(x, self.wa), "bfloat16")
            b = op.tanh(op.astype(mm(x, self.wb), "bfloat16"))
            c = op.astype(mm(x, self.wc), "bfloat16") * a
            d = op.astype(mm(x, self.wd), "bfloat16")
            e = op.astype(mm(z, self.we), "bfloat16")
            return a, b, c, d, e

    mod, _ = M().export_tvm(spec={"forward": {"x": nn.spec.Tensor(["n", 256], "bfloat16"),
                                              "z": nn.spec.Tensor(["n", 256], "bfloat16")}})
    return fused_module(mod)


def _weights_of(binding):
    return [str(a) for a in binding.value.args[1].fields if str(a).startswith("w")]


def test_groups_take_siblings_of_one_activation_only():
    from k3_compile.sibling_gemvs import sibling_groups
    from schedules import dense_decode_tc as ddt
    from schedules import dense_gemv as dg

    mod = _fused()

    def fits(f):
        m = ddt.match_dense(f)
        return m is not None and dg.fits(*(int(d) for d in m[1].ty.shape))

    (group,) = sibling_groups(mod["forward"], mod, lambda gv: fits(mod[gv]))
    # a, b and d (48 rows: 8 rows per block at 256 inputs); not c (reads a), not e (other input)
    assert [w for b in group for w in _weights_of(b)] == ["wa", "wb", "wd"]


def _merged(mod):
    """``mod`` after the pass alone (cuda-sm90a's scheduling for the projections)."""
    from k3_compile.build import specialize_one
    from k3_compile.sibling_gemvs import fuse_sibling_gemvs
    from targets import get_target

    target = get_target("cuda-sm90a").tvm_target()
    with target:
        return fuse_sibling_gemvs(functools.partial(specialize_one, target=target))(mod)


def test_pass_replaces_the_siblings_by_one_call():
    """One call of the merged PrimFunc at the first sibling's place, with (x, w) of each
    sibling in turn; the siblings' variables bound to its tuple fields in order, so every later
    use (c's epilogue reads a) reads the same projection as before; c and e stay apart."""
    from tvm import relax

    out = _merged(_fused())
    (blk,) = [b for b in out["forward"].body.blocks if isinstance(b, relax.DataflowBlock)]
    calls = [b for b in blk.bindings if isinstance(b.value, relax.Call)]
    callees = [str(b.value.args[0].name_hint) for b in calls]
    assert callees[0].startswith("sibling_gemv") and sum(c.startswith("sibling_gemv") for c in callees) == 1
    assert len(calls) == 3, callees  # the merged call, c, e
    args = [str(a) for a in calls[0].value.args[1].fields]
    assert args == ["x", "wa", "x", "wb", "x", "wd"], args
    fields = [(str(b.var), b.value.index) for b in blk.bindings if isinstance(b.value, relax.TupleGetItem)]
    assert [i for _, i in fields] == [0, 1, 2]
    # c's epilogue reads field 0 (a), e reads z
    c_args = [str(a) for a in calls[1].value.args[1].fields]
    assert c_args == ["x", "wc", fields[0][0]] and str(calls[2].value.args[1].fields[0]) == "z"


def test_merged_prim_func_is_one_launch_at_two_tokens():
    """Inputs of each projection in turn, then the outputs; one branch on n <= MAX_TOKENS,
    whose single launch covers 64 / 8 + 128 / 8 + 48 / 8 = 30 blocks (8 rows per block at
    256 inputs) with one group of weight loads per projection and b's tanh epilogue; above
    it each projection's own tensor-core kernel (its GEMV branch dropped)."""
    from schedules import dense_gemv as dg

    out = _merged(_fused())
    (f,) = [f for gv, f in out.functions_items() if gv.name_hint.startswith("sibling_gemv")]
    assert [p.name for p in f.params][:6] == ["x", "wa", "x", "wb", "x", "wd"]
    assert [tuple(int(d) for d in p.ty.shape[1:]) for p in f.params[6:]] == [(64,), (128,), (48,)]
    src = f.script()
    assert [int(v) for v in re.findall(r"tvm_thread_invariant\(\w+ <= T\.int64\((\d+)\)\)", src)] \
        == [dg.MAX_TOKENS]
    assert len(re.findall(r'thread_binding\(30, thread="blockIdx\.x"\)', src)) == 1
    assert src.count('T.cuda.func_call("k3_ld_stream16"') == 3
    assert src.count("T.tanh") == 2           # the GEMV's store and the tensor-core kernel's
    assert src.count('"__shfl_xor_sync"') == 3  # one GEMV per projection, no per-projection copies


def test_pipeline_compiles_the_merged_function_scheduled():
    from k3_compile.build import gpu_relax_pipeline, unscheduled_gpu_functions
    from targets import get_target

    out = gpu_relax_pipeline(get_target("cuda-sm90a").tvm_target(), wgmma=True)(_fused())
    merged = [f for gv, f in out.functions_items() if gv.name_hint.startswith("sibling_gemv")]
    assert len(merged) == 1 and merged[0].attrs["tirx.is_scheduled"]
    assert unscheduled_gpu_functions(out) == ["shape_func"]  # the VM's host shape function
    # --generic-kernels: no merging (dlight's schedules alone)
    generic = gpu_relax_pipeline(get_target("cuda-sm90a").tvm_target(), tensor_cores=False)(_fused())
    assert not any(gv.name_hint.startswith("sibling_gemv") for gv, _ in generic.functions_items())


def test_groups_of_equal_size_get_their_own_merged_functions():
    """Two pairs of siblings on two activations, with different epilogues and widths: each pair
    calls its own merged PrimFunc (keyed by its callees), with its own epilogue and shapes."""
    from tvm import relax
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op

    class M(nn.Module):
        def __init__(self):
            self.wa = nn.Parameter((64, 256), "bfloat16")
            self.wb = nn.Parameter((64, 256), "bfloat16")
            self.wc = nn.Parameter((64, 512), "bfloat16")
            self.wd = nn.Parameter((128, 512), "bfloat16")

        def forward(self, x, z):
            def mm(t, w):
                return op.astype(op.matmul(t, op.permute_dims(w, [1, 0]), out_dtype="float32"), "bfloat16")

            return mm(x, self.wa), mm(x, self.wb), op.tanh(mm(z, self.wc)), op.tanh(mm(z, self.wd))

    mod, _ = M().export_tvm(spec={"forward": {"x": nn.spec.Tensor(["n", 256], "bfloat16"),
                                              "z": nn.spec.Tensor(["n", 512], "bfloat16")}})
    out = _merged(fused_module(mod))
    merged = {gv.name_hint: f for gv, f in out.functions_items() if gv.name_hint.startswith("sibling_gemv")}
    assert len(merged) == 2, sorted(merged)
    (blk,) = [b for b in out["forward"].body.blocks if isinstance(b, relax.DataflowBlock)]
    calls = {str(b.value.args[1].fields[1]): b.value.args[0].name_hint for b in blk.bindings
             if isinstance(b.value, relax.Call) and b.value.args[0].name_hint.startswith("sibling_gemv")}
    assert set(calls) == {"wa", "wc"} and calls["wa"] != calls["wc"], calls
    with_tanh = merged[calls["wc"]].script()
    assert with_tanh.count("T.tanh") >= 2 and "T.tanh" not in merged[calls["wa"]].script()
    assert [tuple(int(d) for d in p.ty.shape) for p in merged[calls["wc"]].params if p.name in ("wc", "wd")] \
        == [(64, 512), (128, 512)]
