"""Compiler pass: the kernel ahead of a programmatic-dependent-launch kernel lets it start early.

Programmatic dependent launch (PDL, CUDA sm_90+) lets a kernel launched with
``cudaLaunchAttributeProgrammaticStreamSerialization`` (TVM's launch tag
:data:`PDL_LAUNCH_TAG` in a PrimFunc's ``tirx.kernel_launch_params``) start before the kernel
ahead of it in the stream has finished: it starts once every block of that kernel has executed
``griddepcontrol.launch_dependents`` or exited, and it waits for that kernel's writes with
``griddepcontrol.wait``. The KDA decode kernel (schedules/kda_decode_cuda.py, ``pdl=True``) loads
its state before its wait. Behind a kernel that does not trigger, the trigger is its blocks' exit
and the state loads overlap only the launch: on the H200 that was 1–4% slower than no PDL at
all at batch ≥ 16 (0.5 µs slower at batch 1). Behind one that triggers at its entry the loads overlap the whole kernel ahead: 12 heads
at batch 16 / 64 took 7.2 / 26.9–27.1 µs instead of 8.0–8.1 / 28.8–29.0 without PDL, 96 heads
50.8–50.9 / 199.6–199.8 instead of 52.6–52.7 / 201.2 (benchmarks/results/
kda_decode_pdl_trigger_h200_2026-12-02.json, ``_b_``; the predecessor a b_proj-like TVM kernel).

This pass (:func:`trigger_dependents_early`) finds, in every Relax function, each ``call_tir`` /
``call_tir_inplace`` of a PDL PrimFunc and the kernel launched right before it (the previous
binding that calls a PrimFunc, with nothing but reshapes and tuple accesses between) and puts
``griddepcontrol.launch_dependents`` at the entry of that PrimFunc's kernels. It runs after the
GPU schedules (the statement goes inside the thread bindings) and after
``RewriteDataflowReshape`` (reshapes are then views, not kernels).

Why this is safe: a kernel that triggers early only lets PDL-launched kernels start early (a
plain launch still waits for it to finish), and the only PDL kernel here reads, before its wait,
nothing but the sequence slots and the KDA state, which no kernel of a decode step writes. The
predecessor itself is launched plainly, so every kernel before it has finished when it (and so
its dependent) starts.
"""

from __future__ import annotations

PDL_LAUNCH_TAG = "tirx.use_programtic_dependent_launch"
_CALLS = ("relax.call_tir", "relax.call_tir_inplace")
_NO_KERNEL = ("relax.reshape",)   # bindings that launch nothing (views) between two kernels


def launches_pdl(func) -> bool:
    """Whether the PrimFunc ``func`` carries :data:`PDL_LAUNCH_TAG` (False for anything else)."""
    from tvm import tirx

    if not isinstance(func, tirx.PrimFunc) or func.attrs is None:
        return False
    params = func.attrs.get("tirx.kernel_launch_params")
    return params is not None and PDL_LAUNCH_TAG in [str(p) for p in params]


def pdl_predecessors(mod) -> list:
    """The ``GlobalVar``s of the PrimFuncs launched right before a PDL PrimFunc in some Relax
    function of ``mod`` (each once, in order of first appearance)."""
    from tvm import relax

    found = []
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        for blk in func.body.blocks:
            prev = None
            for b in blk.bindings:
                v = b.value
                if not isinstance(v, relax.Call):
                    continue                       # tuple accesses, constants
                name = getattr(v.op, "name", "")
                if name in _CALLS and isinstance(v.args[0], relax.GlobalVar):
                    if launches_pdl(mod[v.args[0]]) and prev is not None and prev not in found:
                        found.append(prev)
                    prev = v.args[0]
                elif name not in _NO_KERNEL:
                    prev = None                    # an extern call, a builtin: not ours to mark
    return found


def with_trigger(func):
    """``func`` (a scheduled PrimFunc) with ``griddepcontrol.launch_dependents`` as the first
    statement inside the thread bindings of each of its kernels. Returns ``(new_func,
    kernels)``; ``kernels`` 0 means no thread-bound loop nest was found and ``func`` is
    returned unchanged."""
    from tvm import s_tir, tirx
    from tvm.script import tirx as T

    count = [0]

    def bound(s):
        return isinstance(s, tirx.For) and s.kind == tirx.ForKind.THREAD_BINDING

    def visit(s):
        if bound(s):
            if bound(s.body):
                body = visit(s.body)
            else:
                count[0] += 1
                body = tirx.SeqStmt([tirx.Evaluate(T.ptx.griddepcontrol.launch_dependents()), s.body])
            return tirx.For(s.loop_var, s.min, s.extent, s.kind, body, s.thread_binding, s.annotations)
        if isinstance(s, tirx.SeqStmt):
            return tirx.SeqStmt([visit(x) for x in s.seq])
        if isinstance(s, tirx.IfThenElse):   # the low-batch branches on the token count
            return tirx.IfThenElse(s.condition, visit(s.then_case),
                                   visit(s.else_case) if s.else_case is not None else None)
        if isinstance(s, tirx.AttrStmt):
            return tirx.AttrStmt(s.node, s.attr_key, s.value, visit(s.body))
        if isinstance(s, tirx.LetStmt):
            return tirx.LetStmt(s.var, s.value, visit(s.body))
        if isinstance(s, s_tir.SBlockRealize):
            blk = s.block
            new = s_tir.SBlock(blk.iter_vars, blk.reads, blk.writes, blk.name_hint, visit(blk.body), blk.init,
                               blk.alloc_buffers, blk.match_buffers, blk.annotations)
            return s_tir.SBlockRealize(s.iter_values, s.predicate, new)
        return s

    body = visit(func.body)
    return (func.with_body(body), count[0]) if count[0] else (func, 0)


def trigger_dependents_early():
    """The Relax module pass (see the module docstring): the PrimFuncs of
    :func:`pdl_predecessors` rewritten by :func:`with_trigger`. A predecessor without a
    thread-bound loop nest (none in k3-compile's builds) is left as it is."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="K3TriggerDependentsEarly")
    def _pass(mod, _ctx):
        preds = pdl_predecessors(mod)
        if not preds:
            return mod
        mod = mod.clone()
        for gv in preds:
            new, kernels = with_trigger(mod[gv])
            if kernels:
                mod[gv] = new
        return mod

    return _pass
