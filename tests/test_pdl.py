"""The pass that lets the kernel ahead of a programmatic-dependent-launch kernel trigger it at
entry (k3_compile/pdl.py), on small Relax modules; on the k3-nano build see
tests/test_build.py (b_proj's GEMV, the KDA decode kernel's predecessor, is the only one)."""

from __future__ import annotations

from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from k3_compile.pdl import PDL_LAUNCH_TAG, launches_pdl, pdl_predecessors, trigger_dependents_early

TRIGGER = 'T.ptx.griddepcontrol("launch_dependents"'


@I.ir_module
class Chain:
    @T.prim_func(private=True)
    def first(x: T.Buffer((16,), "float32"), y: T.Buffer((16,), "float32")):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        for b in T.thread_binding(1, thread="blockIdx.x"):
            for t in T.thread_binding(16, thread="threadIdx.x"):
                y[t] = x[t] + T.float32(1)

    @T.prim_func(private=True)
    def ahead(x: T.Buffer((16,), "float32"), y: T.Buffer((16,), "float32")):
        # two kernels behind a branch, as the low-batch schedules branch on the token count
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
        if x[0] > T.float32(0):
            for b in T.thread_binding(1, thread="blockIdx.x"):
                for t in T.thread_binding(16, thread="threadIdx.x"):
                    y[t] = x[t] * T.float32(2)
        else:
            for b in T.thread_binding(2, thread="blockIdx.x"):
                for t in T.thread_binding(8, thread="threadIdx.x"):
                    y[b * 8 + t] = x[b * 8 + t] * T.float32(3)

    @T.prim_func(private=True)
    def dependent(x: T.Buffer((16,), "float32"), y: T.Buffer((16,), "float32")):
        T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True,
                     "tirx.kernel_launch_params": ["tirx.use_programtic_dependent_launch"]})
        for b in T.thread_binding(1, thread="blockIdx.x"):
            for t in T.thread_binding(16, thread="threadIdx.x"):
                T.ptx.griddepcontrol.wait()
                y[t] = x[t] - T.float32(1)

    @R.function
    def main(x: R.Tensor((16,), "float32")):
        cls = Chain
        with R.dataflow():
            a = R.call_tir(cls.first, (x,), out_ty=R.Tensor((16,), "float32"))
            b = R.call_tir(cls.ahead, (a,), out_ty=R.Tensor((16,), "float32"))
            c = R.reshape(b, (16,))
            d = R.call_tir(cls.dependent, (c,), out_ty=R.Tensor((16,), "float32"))
            R.output(d)
        return d

    @R.function
    def extern_between(x: R.Tensor((16,), "float32")):
        # a call the pass does not own (here an extern) launched between: nothing is marked
        cls = Chain
        with R.dataflow():
            a = R.call_tir(cls.first, (x,), out_ty=R.Tensor((16,), "float32"))
            b = R.call_dps_packed("k3_test_extern", (a,), out_ty=R.Tensor((16,), "float32"))
            d = R.call_tir(cls.dependent, (b,), out_ty=R.Tensor((16,), "float32"))
            R.output(d)
        return d


def test_finds_the_kernel_right_before_a_pdl_kernel_only():
    assert launches_pdl(Chain["dependent"]) and not launches_pdl(Chain["ahead"])
    assert PDL_LAUNCH_TAG == "tirx.use_programtic_dependent_launch"   # TVM 0.27's spelling
    # `ahead` (main: a reshape, a view, between); `first` is two calls back in main and its
    # successor in extern_between is an extern call
    assert [gv.name_hint for gv in pdl_predecessors(Chain)] == ["ahead"]


def test_the_trigger_goes_inside_the_thread_bindings_of_each_kernel():
    out = trigger_dependents_early()(Chain)
    src = out["ahead"].script()
    assert src.count(TRIGGER) == 2, src                # both branches' kernels
    for name in ("first", "dependent"):
        assert TRIGGER not in out[name].script(), name
    # inside the innermost thread binding, before the kernel's work (not in host code)
    lines = [ln.strip() for ln in src.splitlines()]
    at = [i for i, ln in enumerate(lines) if ln.startswith(TRIGGER)]
    assert all(lines[i - 1].startswith("for t in T.thread_binding") for i in at), lines
    assert TRIGGER not in Chain["ahead"].script()      # the input module is not modified


def test_a_module_without_pdl_kernels_is_returned_as_is():
    plain = Chain.clone()
    plain["dependent"] = Chain["first"]                # no PrimFunc launches with PDL now
    assert pdl_predecessors(plain) == []
    assert trigger_dependents_early()(plain).same_as(plain)
    assert launches_pdl(Chain["dependent"])             # the clone was changed, not Chain
