"""Compiler pass: sibling projections of one activation as one GEMV launch at 1-2 tokens.

A decode step multiplies the same activation by several weights side by side: a KDA layer's
q / k / v / f_a / g projections, an MLA layer's q_a / kv_a, the MoE block's router, latent
down projection and shared experts' up projection. At one token each is a weight stream of its
own launch, and each launch pays a start and a tail beside its HBM time (~3 µs per call on the
H200, benchmarks/results/dense_gemv_h200_2026-11-30.json). This pass merges such siblings
into one PrimFunc: at ``n <= MAX_TOKENS`` tokens one launch of
:func:`schedules.dense_gemv.multi_gemv_macro` computes all of them (each with its own fused
epilogue), above it the projections' own scheduled bodies run one after the other, as before.

Siblings (:func:`sibling_groups`): ``call_tir`` bindings of one dataflow block whose callee is a
dense projection (:func:`schedules.dense_decode_tc.match_dense`) that the GEMV fits, with the
same activation variable as first argument and every argument defined before the first of
them (so none reads another's output: e.g. a shared expert's gate, whose epilogue multiplies
by the up projection's output, stays apart). The merged call sits at the first sibling's
place; the siblings' variables are bound to its tuple's fields.

The pass schedules the projections itself (``specialize``: k3_compile.build.specialize_one)
and marks the merged function scheduled, so it must run before the default scheduling.
"""

from __future__ import annotations

from tvm.script import tirx as T  # the parser resolves T in the module's globals


def sibling_groups(func, mod, fits) -> list[list]:
    """The groups (lists of ``relax.VarBinding``, two or more, in program order) of sibling
    projections in the Relax function ``func`` of ``mod``. ``fits(global_var)``: whether the
    callee ``mod[global_var]`` can join (a dense projection the GEMV fits, its activation the
    first parameter and its output the last). Never raises."""
    from tvm import relax

    groups = []
    params = set(func.params)
    for blk in func.body.blocks:
        if not isinstance(blk, relax.DataflowBlock):
            continue
        defined = set(params)
        pending = {}   # activation var -> (the defined set at its first sibling, group)
        for b in blk.bindings:
            v = b.value
            if (isinstance(v, relax.Call) and getattr(v.op, "name", "") == "relax.call_tir"
                    and isinstance(v.args[0], relax.GlobalVar) and isinstance(v.args[1], relax.Tuple)
                    and isinstance(v.ty, relax.TensorType)):
                args = list(v.args[1].fields)
                x = args[0] if args else None
                if isinstance(x, relax.Var) and fits(v.args[0]):
                    if x in pending:
                        before, group = pending[x]
                        if all(not isinstance(a, relax.Var) or a in before for a in args):
                            group.append(b)
                    else:
                        pending[x] = (set(defined), [b])
            defined.add(b.var)
        groups += [g for _, g in pending.values() if len(g) >= 2]
    return groups


def _store_macro(epi):
    """Store macro ``store(y, i, j, acc)`` writing ``epi(acc, i, j)`` (a projection's epilogue)."""
    @T.macro
    def store(y, i, j, a):
        y[i, j] = epi(a, i, j)

    return store


def merged_prim_func(funcs, specialize):
    """One PrimFunc computing the projections ``funcs`` (unscheduled fused PrimFuncs, each
    ``(x, w, other inputs..., out)`` as :func:`schedules.dense_decode_tc.match_dense` reads
    them, with the same input width): parameters the inputs of each in turn, then the outputs
    of each in turn; body ``n <= MAX_TOKENS``: the multi-GEMV launch, else each projection's
    body scheduled by ``specialize(f, gemv_elsewhere=True)`` (without a branch for the
    counts the merged launch covers), or None if one cannot be merged. Never raises."""
    from tvm import s_tir, tirx

    from schedules import dense_decode_tc as ddt
    from schedules import dense_gemv as dg

    copies = [s_tir.renew_defs(f) for f in funcs]   # distinct vars: a callee may repeat
    matches = [ddt.match_dense(f) for f in copies]
    if any(m is None for m in matches):
        return None
    scheduled = [specialize(f, gemv_elsewhere=True) for f in copies]
    if any(s is None for s in scheduled):
        return None
    shapes = [tuple(int(d) for d in m[1].ty.shape) for m in matches]
    K = shapes[0][1]
    if any(k != K or not dg.fits(N, k) for N, k in shapes):
        return None
    outs = [m[2] for m in matches]
    for f, out in zip(copies, outs):  # the output is the last parameter
        if not f.params[-1].same_as(out):
            return None
    x, n = matches[0][0], matches[0][3]
    stores = [_store_macro(m[4]) for m in matches]
    body = dg.multi_gemv_macro([N for N, _ in shapes], K)
    ws, ys = tuple(m[1] for m in matches), tuple(outs)

    @T.prim_func(private=True, check_well_formed=False)
    def spliced():
        body(x, ws, ys, n, tuple(stores))

    rest = [s.body.block.body if isinstance(s.body, s_tir.SBlockRealize) else s.body for s in scheduled]
    stmt = tirx.IfThenElse(tirx.op.tvm_thread_invariant(n <= dg.MAX_TOKENS), spliced.body,
                           tirx.SeqStmt(rest) if len(rest) > 1 else rest[0])
    stmt = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", stmt))
    params = [p for f in copies for p in f.params[:-1]] + [f.params[-1] for f in copies]
    merged = tirx.PrimFunc(params, stmt)
    return (merged.with_attr("tirx.noalias", True).with_attr("tirx.is_scheduled", True)
            .with_attr("tirx.HoistIfThenElseExprWithBlock", 1))


def fuse_sibling_gemvs(specialize):
    """Pass: merge the sibling projections of every Relax function (module doc).
    ``specialize(prim_func, gemv_elsewhere=True)``: the scheduled PrimFunc of one projection
    without a branch for the merged launch's token counts (k3_compile.build.specialize_one with
    the pipeline's settings)."""
    import tvm
    from tvm import relax

    from schedules import dense_decode_tc as ddt
    from schedules import dense_gemv as dg

    def fits(f):
        m = ddt.match_dense(f)
        return (m is not None and f.params[0].same_as(m[0]) and f.params[-1].same_as(m[2])
                and dg.fits(*(int(d) for d in m[1].ty.shape)))

    @tvm.transform.module_pass(opt_level=0, name="K3FuseSiblingGEMVs")
    def _pass(mod, _ctx):
        fit_of = {}      # callee name -> fits (match_dense schedules the function: once each)

        def fits_once(gv):
            if gv.name_hint not in fit_of:
                fit_of[gv.name_hint] = fits(mod[gv])
            return fit_of[gv.name_hint]

        merged_gv = {}   # the callees' names -> GlobalVar of their merged PrimFunc (or None)
        bb = relax.BlockBuilder(mod)
        updates = {}
        for gv, func in list(mod.functions_items()):
            if not isinstance(func, relax.Function):
                continue
            groups = sibling_groups(func, mod, fits_once)
            plan = {}    # first binding's var -> (merged call, the group's vars)
            skip = set()
            for group in groups:
                callees = [b.value.args[0] for b in group]
                key = tuple(c.name_hint for c in callees)  # unique names in the module
                if key not in merged_gv:
                    pf = merged_prim_func([mod[c] for c in callees], specialize)
                    if pf is None:
                        merged_gv[key] = None
                    else:
                        name = "sibling_gemv_" + "_".join(key)[:180]
                        merged_gv[key] = bb.add_func(pf, name)
                if merged_gv[key] is None:
                    continue
                args = [a for b in group for a in b.value.args[1].fields]
                call = relax.call_tir(merged_gv[key], relax.Tuple(args), [b.value.ty for b in group])
                plan[group[0].var] = (call, [b.var for b in group])
                skip.update(b.var for b in group[1:])
            if not plan:
                continue
            blocks = []
            for blk in func.body.blocks:
                if not isinstance(blk, relax.DataflowBlock):
                    blocks.append(blk)
                    continue
                bindings = []
                for b in blk.bindings:
                    if b.var in skip:
                        continue
                    if b.var in plan:
                        call, vars_ = plan[b.var]
                        tup = relax.DataflowVar(f"sib_{b.var.name}", relax.TupleType(
                            [v.ty for v in vars_]))
                        bindings.append(relax.VarBinding(tup, call))
                        bindings += [relax.VarBinding(v, relax.TupleGetItem(tup, i))
                                     for i, v in enumerate(vars_)]
                    else:
                        bindings.append(b)
                blocks.append(relax.DataflowBlock(bindings))
            body = relax.SeqExpr(blocks, func.body.body)
            updates[gv] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
        if not updates:
            return mod
        for gv, func in updates.items():
            bb.update_func(gv, func)
        return relax.transform.Normalize()(bb.get())

    return _pass
