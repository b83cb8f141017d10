"""KDA: TIR kernels (schedules/kda_generic.py) and the Relax layer (relax_modules/kda.py).

Oracles: fla-core 0.6.0 ``naive_recurrent_kda`` / ``naive_chunk_kda`` /
``naive_kda_lowerbound_gate`` / ``naive_kda_gate``; torch ``conv1d`` for the short conv; a torch
transcription of spec §3 "KDA layer" (below) and mlx-lm's ``KimiK3DeltaAttention`` for the
whole layer. CPU, llvm target.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
from tvm.relax.frontend import nn

from k3_compile.config import K3Config
from relax_modules.common import ForwardMeta
from relax_modules.kda import KDAStateOps, KimiDeltaAttention
from schedules import kda_generic as kg
from helpers_tvm import (
    META_FIELDS,
    compile_prim,
    compile_vm,
    meta_spec,
    nd,
    param_args,
    ragged_meta,
)

LENS = [1, 7, 63, 64, 65, 200]
N_LAYERS, LAYER, N_SLOTS = 2, 1, 8  # pools: 2 KDA layers, we use layer 1
LB = -5.0


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _kda_inputs(rng, Tn, H, K, gate):
    """Random KDA inputs (torch float32): q, k L2-normalized; g from fla's gate functions."""
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype("float32"))
    q, k, v = _l2(t(Tn, H, K)), _l2(t(Tn, H, K)), t(Tn, H, K)
    f, A_log, dt_bias = t(Tn, H, K), t(H) * 0.5, t(H * K)
    if gate == "lb":
        g = naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound=LB)
    else:
        g = naive_kda_gate(f, A_log, dt_bias)
    beta = torch.sigmoid(t(Tn, H))
    return q, k, v, g, beta


# =========================================================================== kernels
@pytest.fixture(scope="module")
def kda_kernels():
    """Compiled (prefill, decode) kernels per head_dim (H = 2)."""
    cache = {}

    def get(K):
        if K not in cache:
            cache[K] = (compile_prim(kg.kda_chunk_prefill_kernel(2, K, K, K ** -0.5)),
                        compile_prim(kg.kda_decode_kernel(2, K, K, K ** -0.5)))
        return cache[K]

    return get


def _run_prefill(fn, q, k, v, g, beta, lens, slots, S0):
    meta = ragged_meta(lens, slots)
    Tn, H, V = v.shape
    S = nd(S0)
    o = nd(np.zeros((Tn, H, V), "float32"))
    fn(nd(q.numpy()), nd(k.numpy()), nd(v.numpy()), nd(g.numpy()), nd(beta.numpy()),
       nd(meta["cu_seqlens"]), nd(meta["seq_slots"]), S, LAYER, o)
    return o.numpy(), S.numpy()


def _check_vs_fla(o, S, S0, q, k, v, g, beta, lens, slots, K, atol):
    """Per sequence: tvm vs naive_recurrent_kda and naive_chunk_kda (zero-padded to 64)."""
    scale = K ** -0.5
    cu = np.concatenate([[0], np.cumsum(lens)])
    for b, slot in enumerate(slots):
        sl = slice(cu[b], cu[b + 1])
        args = [x[sl][None] for x in (q, k, v, g, beta)]
        init = torch.from_numpy(S0[LAYER, slot])[None]
        o_rec, S_rec = naive_recurrent_kda(*args, scale=scale, initial_state=init,
                                           output_final_state=True)
        n = lens[b]
        pad = (-n) % 64  # padded tokens: g = 0, β = 0, k = v = 0 leave the state unchanged
        padded = [torch.cat([x, x.new_zeros(1, pad, *x.shape[2:])], 1) for x in args]
        o_chk, S_chk = naive_chunk_kda(*padded, scale=scale, initial_state=init,
                                       output_final_state=True)
        for name, ref_o, ref_S in (("recurrent", o_rec, S_rec), ("chunk", o_chk, S_chk)):
            np.testing.assert_allclose(o[sl], ref_o[0, :n].numpy(), atol=atol, rtol=0,
                                       err_msg=f"o vs {name}, seq {b} (len {n})")
            np.testing.assert_allclose(S[LAYER, slot], ref_S[0].numpy(), atol=atol, rtol=0,
                                       err_msg=f"state vs {name}, seq {b} (len {n})")


@pytest.mark.parametrize("gate", ["lb", "softplus"])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_prefill_ragged_batch(kda_kernels, gate, with_state):
    K, H = 16, 2
    rng = np.random.default_rng(1)
    q, k, v, g, beta = _kda_inputs(rng, sum(LENS), H, K, gate)
    S0 = np.zeros((N_LAYERS, N_SLOTS, H, K, K), "float32")
    if with_state:
        S0 = rng.standard_normal(S0.shape).astype("float32") * 0.5
    slots = [5, 0, 7, 2, 1, 3]
    o, S = _run_prefill(kda_kernels(K)[0], q, k, v, g, beta, LENS, slots, S0)
    _check_vs_fla(o, S, S0, q, k, v, g, beta, LENS, slots, K, atol=2e-5)
    untouched = [s for s in range(N_SLOTS) if s not in slots]
    np.testing.assert_array_equal(S[:, untouched], S0[:, untouched])
    np.testing.assert_array_equal(S[0], S0[0])  # other layer untouched


@pytest.mark.parametrize("n", LENS)
def test_chunk_prefill_single_sequence(kda_kernels, n):
    K, H = 16, 2
    rng = np.random.default_rng(n)
    q, k, v, g, beta = _kda_inputs(rng, n, H, K, "lb")
    S0 = rng.standard_normal((N_LAYERS, N_SLOTS, H, K, K)).astype("float32") * 0.5
    o, S = _run_prefill(kda_kernels(K)[0], q, k, v, g, beta, [n], [4], S0)
    _check_vs_fla(o, S, S0, q, k, v, g, beta, [n], [4], K, atol=2e-5)


def test_chunk_prefill_head_dim_128(kda_kernels):
    K, H, lens, slots = 128, 2, [130, 3], [1, 6]
    rng = np.random.default_rng(7)
    q, k, v, g, beta = _kda_inputs(rng, sum(lens), H, K, "lb")
    S0 = rng.standard_normal((N_LAYERS, N_SLOTS, H, K, K)).astype("float32") * 0.1
    o, S = _run_prefill(kda_kernels(K)[0], q, k, v, g, beta, lens, slots, S0)
    _check_vs_fla(o, S, S0, q, k, v, g, beta, lens, slots, K, atol=5e-5)


@pytest.mark.parametrize("K", [16, 128])
def test_decode_step(kda_kernels, K):
    H, slots = 2, [3, 0, 6]
    B = len(slots)
    rng = np.random.default_rng(K)
    q, k, v, g, beta = _kda_inputs(rng, B, H, K, "lb")
    S0 = rng.standard_normal((N_LAYERS, N_SLOTS, H, K, K)).astype("float32") * 0.5
    S = nd(S0)
    o = nd(np.zeros((B, H, K), "float32"))
    kda_kernels(K)[1](nd(q.numpy()), nd(k.numpy()), nd(v.numpy()), nd(g.numpy()),
                      nd(beta.numpy()), nd(np.array(slots, "int32")), S, LAYER, o)
    _check_vs_fla(o.numpy(), S.numpy(), S0, q, k, v, g, beta, [1] * B, slots, K, atol=2e-5)


# ----------------------------------------------------------------------- short conv
D_CONV, W_CONV = 8, 4


@pytest.fixture(scope="module")
def conv_kernel():
    return compile_prim(kg.short_conv_kernel(D_CONV, W_CONV, "float32"))


def _torch_conv(x_seq, window, weight):
    """SiLU(conv1d(concat(window, x))) with torch, depthwise; returns (y, new window)."""
    xpad = torch.cat([window, x_seq], 0)  # [W-1+L, D]
    y = F.conv1d(xpad.T[None], weight, groups=weight.shape[0])[0].T
    return F.silu(y), xpad[-(weight.shape[-1] - 1):]


def _run_conv(fn, x, weight, lens, slots, state, which):
    meta = ragged_meta(lens, slots)
    st = nd(state)
    y = nd(np.zeros(x.shape, "float32"))
    fn(nd(x), nd(weight), nd(meta["cu_seqlens"]), nd(meta["token_seq"]),
       nd(meta["seq_slots"]), st, LAYER, which, y)
    return y.numpy(), st.numpy()


def test_short_conv_vs_torch(conv_kernel):
    rng = np.random.default_rng(3)
    lens, slots, which = [1, 2, 3, 7, 20], [4, 0, 2, 6, 1], 2
    x = rng.standard_normal((sum(lens), D_CONV)).astype("float32")
    weight = rng.standard_normal((D_CONV, 1, W_CONV)).astype("float32")
    state0 = rng.standard_normal((N_LAYERS, N_SLOTS, 3, W_CONV - 1, D_CONV)).astype("float32")
    y, state = _run_conv(conv_kernel, x, weight, lens, slots, state0, which)
    cu = np.concatenate([[0], np.cumsum(lens)])
    for b, slot in enumerate(slots):
        y_ref, win = _torch_conv(torch.from_numpy(x[cu[b]:cu[b + 1]]),
                                 torch.from_numpy(state0[LAYER, slot, which]),
                                 torch.from_numpy(weight))
        np.testing.assert_allclose(y[cu[b]:cu[b + 1]], y_ref.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(state[LAYER, slot, which], win.numpy())
    # other windows / slots / layers untouched
    mask = np.ones(state.shape, bool)
    mask[LAYER, slots, which] = False
    np.testing.assert_array_equal(state[mask], state0[mask])
    y_np, state_np = kg.short_conv_reference(x, weight, cu, slots, state0, LAYER, which)
    np.testing.assert_allclose(y, y_np, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(state, state_np)


def test_short_conv_continuation(conv_kernel):
    """A sequence fed in pieces 2, 1, 5, 1 (pieces shorter than W-1) == fed at once."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, D_CONV)).astype("float32")
    weight = rng.standard_normal((D_CONV, 1, W_CONV)).astype("float32")
    state0 = np.zeros((N_LAYERS, N_SLOTS, 3, W_CONV - 1, D_CONV), "float32")
    y_all, st_all = _run_conv(conv_kernel, x, weight, [9], [3], state0, 0)
    ys, st, start = [], state0, 0
    for n in (2, 1, 5, 1):
        y, st = _run_conv(conv_kernel, x[start:start + n], weight, [n], [3], st, 0)
        ys.append(y)
        start += n
    np.testing.assert_allclose(np.concatenate(ys), y_all, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(st, st_all)
    y_ref, _ = _torch_conv(torch.from_numpy(x), torch.zeros(W_CONV - 1, D_CONV),
                           torch.from_numpy(weight))
    np.testing.assert_allclose(y_all, y_ref.numpy(), atol=1e-5, rtol=0)


# ====================================================================== whole layer
HIDDEN, H_L, K_L, W_L = 32, 2, 16, 4


def _cfg(lb):
    return K3Config(hidden_size=HIDDEN, kda_num_heads=H_L, kda_head_dim=K_L,
                    short_conv_kernel_size=W_L, gate_lower_bound=lb, rms_norm_eps=1e-5)


class _LayerHarness(nn.Module):
    """Test wrapper: the layer as ``self_attn``, ForwardMeta unpacked into arguments."""

    def __init__(self, cfg, dtype):
        self.self_attn = KimiDeltaAttention(cfg, dtype)

    def _run(self, x, meta_args, kda_state, conv_state, decode):
        return self.self_attn(x, ForwardMeta(*meta_args), kda_state, conv_state, LAYER, decode)

    def prefill(self, x, cu_seqlens, token_seq, token_pos, seq_slots, page_table, last_token,
                kda_state, conv_state):
        meta = (cu_seqlens, token_seq, token_pos, seq_slots, page_table, last_token)
        return self._run(x, meta, kda_state, conv_state, False)

    def decode(self, x, cu_seqlens, token_seq, token_pos, seq_slots, page_table, last_token,
               kda_state, conv_state):
        meta = (cu_seqlens, token_seq, token_pos, seq_slots, page_table, last_token)
        return self._run(x, meta, kda_state, conv_state, True)


def _random_weights(rng, lb):
    HK = H_L * K_L
    r = lambda *s, sc=1.0: (rng.standard_normal(s) * sc).astype("float32")
    p = "self_attn."
    return {
        p + "q_proj.weight": r(HK, HIDDEN, sc=HIDDEN ** -0.5),
        p + "k_proj.weight": r(HK, HIDDEN, sc=HIDDEN ** -0.5),
        p + "v_proj.weight": r(HK, HIDDEN, sc=HIDDEN ** -0.5),
        p + "q_conv1d.weight": r(HK, 1, W_L, sc=0.5),
        p + "k_conv1d.weight": r(HK, 1, W_L, sc=0.5),
        p + "v_conv1d.weight": r(HK, 1, W_L, sc=0.5),
        p + "f_a_proj.weight": r(K_L, HIDDEN, sc=HIDDEN ** -0.5),
        p + "f_b_proj.weight": r(HK, K_L, sc=K_L ** -0.5),
        p + "b_proj.weight": r(H_L, HIDDEN, sc=HIDDEN ** -0.5),
        p + "A_log": np.log(rng.uniform(1, 16, H_L)).astype("float32") - (2.0 if lb else 3.0),
        p + "dt_bias": r(HK, sc=0.5),
        p + "o_norm.weight": 1.0 + r(K_L, sc=0.1),
        p + "g_proj.weight": r(HK, HIDDEN, sc=HIDDEN ** -0.5),
        p + "o_proj.weight": r(HIDDEN, HK, sc=HK ** -0.5),
    }


def torch_kda_layer(wts, x, S, conv, lb, eps=1e-5):
    """Spec §3 "KDA layer" for ONE sequence, in torch float32.

    x [L, hidden]; S [H, K, V] initial state; conv [3, W-1, H*K] windows (q, k, v).
    Returns (out [L, hidden], S, conv).
    """
    w = {k.removeprefix("self_attn."): torch.from_numpy(v) for k, v in wts.items()}
    L, HK = x.shape[0], H_L * K_L
    new_conv = conv.clone()
    qkv = []
    for i, name in enumerate("qkv"):  # 1. SiLU(causal depthwise conv1d(W x))
        xp = x @ w[f"{name}_proj.weight"].T
        y, new_conv[i] = _torch_conv(xp, conv[i], w[f"{name}_conv1d.weight"])
        qkv.append(y.view(L, H_L, K_L))
    q, k, v = qkv
    q, k = _l2(q), _l2(k)  # 2. (the K^-1/2 scale is naive_recurrent_kda's default)
    f = (x @ w["f_a_proj.weight"].T @ w["f_b_proj.weight"].T).view(L, H_L, K_L)  # 3.
    if lb is not None:
        g = naive_kda_lowerbound_gate(f, w["A_log"], w["dt_bias"], lower_bound=lb)
    else:
        g = naive_kda_gate(f, w["A_log"], w["dt_bias"])
    beta = torch.sigmoid(x @ w["b_proj.weight"].T)  # 4.
    o, S = naive_recurrent_kda(q[None], k[None], v[None], g[None], beta[None],  # 5.
                               initial_state=S[None], output_final_state=True)
    o = o[0]
    o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * w["o_norm.weight"]  # 6.
    o = o * torch.sigmoid(x @ w["g_proj.weight"].T).view(L, H_L, K_L)
    return o.reshape(L, HK) @ w["o_proj.weight"].T, S[0], new_conv


@pytest.fixture(scope="module", params=[LB, None], ids=["lb_gate", "softplus_gate"])
def layer_vm(request):
    lb = request.param
    pool = {"kda_state": nn.spec.Tensor([N_LAYERS, "S", H_L, K_L, K_L], "float32"),
            "conv_state": nn.spec.Tensor([N_LAYERS, "S", 3, W_L - 1, H_L * K_L], "float32")}
    spec = {"x": nn.spec.Tensor(["T", HIDDEN], "float32"), **meta_spec(), **pool}
    mod, params = _LayerHarness(_cfg(lb), "float32").export_tvm(
        spec={"prefill": spec, "decode": spec})
    vm = compile_vm(mod)
    wts = _random_weights(np.random.default_rng(11), lb)
    return vm, param_args(params, wts), wts, lb


class _Pools:
    """Host copies of the pools + a call helper running one forward in place."""

    def __init__(self, rng, random_state=True):
        sc = 0.3 if random_state else 0.0
        self.kda = nd((rng.standard_normal((N_LAYERS, N_SLOTS, H_L, K_L, K_L)) * sc)
                      .astype("float32"))
        self.conv = nd((rng.standard_normal((N_LAYERS, N_SLOTS, 3, W_L - 1, H_L * K_L)) * sc)
                       .astype("float32"))

    def run(self, layer_vm, fn, x, lens, slots):
        vm, pargs = layer_vm[:2]
        meta = ragged_meta(lens, slots)
        out, self.kda, self.conv = vm[fn](nd(x), *[nd(meta[f]) for f in META_FIELDS],
                                          self.kda, self.conv, *pargs)
        return out.numpy()


def test_layer_ragged_prefill_vs_torch(layer_vm):
    _, _, wts, lb = layer_vm
    rng = np.random.default_rng(5)
    pools = _Pools(rng)
    kda0, conv0 = pools.kda.numpy().copy(), pools.conv.numpy().copy()
    lens, slots = [5, 70, 1, 2], [2, 0, 7, 4]
    x = rng.standard_normal((sum(lens), HIDDEN)).astype("float32")
    out = pools.run(layer_vm, "prefill", x, lens, slots)
    cu = np.concatenate([[0], np.cumsum(lens)])
    for b, slot in enumerate(slots):
        ref, S, conv = torch_kda_layer(wts, torch.from_numpy(x[cu[b]:cu[b + 1]]),
                                       torch.from_numpy(kda0[LAYER, slot]),
                                       torch.from_numpy(conv0[LAYER, slot]), lb)
        np.testing.assert_allclose(out[cu[b]:cu[b + 1]], ref.numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(pools.kda.numpy()[LAYER, slot], S.numpy(), atol=1e-4,
                                   rtol=0)
        np.testing.assert_allclose(pools.conv.numpy()[LAYER, slot], conv.numpy(), atol=1e-6,
                                   rtol=0)


def test_layer_prefill_then_decode_equals_full_prefill(layer_vm):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((13, HIDDEN)).astype("float32")
    full = _Pools(rng, random_state=False)
    out_full = full.run(layer_vm, "prefill", x, [13], [3])
    inc = _Pools(rng, random_state=False)
    outs = [inc.run(layer_vm, "prefill", x[:9], [9], [3])]
    for t in range(9, 13):
        outs.append(inc.run(layer_vm, "decode", x[t:t + 1], [1], [3]))
    np.testing.assert_allclose(np.concatenate(outs), out_full, atol=2e-5, rtol=0)
    np.testing.assert_allclose(inc.kda.numpy(), full.kda.numpy(), atol=2e-5, rtol=0)
    np.testing.assert_allclose(inc.conv.numpy(), full.conv.numpy(), atol=1e-6, rtol=0)


def test_layer_interleaved_batch_equals_alone(layer_vm):
    """Two sequences prefilled then decoded together (slots 1 and 5) == each run alone."""
    rng = np.random.default_rng(8)
    xa = rng.standard_normal((10 + 3, HIDDEN)).astype("float32")
    xb = rng.standard_normal((6 + 3, HIDDEN)).astype("float32")
    both = _Pools(rng, random_state=False)
    o = both.run(layer_vm, "prefill", np.concatenate([xa[:10], xb[:6]]), [10, 6], [1, 5])
    got_a, got_b = [o[:10]], [o[10:]]
    for s in range(3):
        o = both.run(layer_vm, "decode", np.stack([xa[10 + s], xb[6 + s]]), [1, 1], [1, 5])
        got_a.append(o[:1])
        got_b.append(o[1:])
    for x, n, slot, got in ((xa, 10, 1, got_a), (xb, 6, 5, got_b)):
        alone = _Pools(rng, random_state=False)
        want = [alone.run(layer_vm, "prefill", x[:n], [n], [slot])]
        for s in range(3):
            want.append(alone.run(layer_vm, "decode", x[n + s:n + s + 1], [1], [slot]))
        np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=2e-5,
                                   rtol=0)
        np.testing.assert_allclose(both.kda.numpy()[:, slot], alone.kda.numpy()[:, slot],
                                   atol=2e-5, rtol=0)
        np.testing.assert_array_equal(both.conv.numpy()[:, slot], alone.conv.numpy()[:, slot])


# ===================================================================== state store
def test_state_ops_reset_and_fork():
    import tvm

    cfg = _cfg(LB)
    pool = {"kda_state": nn.spec.Tensor([N_LAYERS, "S", H_L, K_L, K_L], "float32"),
            "conv_state": nn.spec.Tensor([N_LAYERS, "S", 3, W_L - 1, H_L * K_L], "float32")}
    mod, _ = KDAStateOps(cfg).export_tvm(spec={
        "reset_slot": {**pool, "slot": nn.spec.Int()},
        "copy_slot": {**pool, "src": nn.spec.Int(), "dst": nn.spec.Int()}})
    vm = compile_vm(mod)
    rng = np.random.default_rng(9)
    kda0 = rng.standard_normal((N_LAYERS, N_SLOTS, H_L, K_L, K_L)).astype("float32")
    conv0 = rng.standard_normal((N_LAYERS, N_SLOTS, 3, W_L - 1, H_L * K_L)).astype("float32")
    kda, conv = nd(kda0), nd(conv0)
    shape = tvm.runtime.ShapeTuple
    kda, conv = vm["copy_slot"](kda, conv, shape([2]), shape([6]))
    vm["reset_slot"](kda, conv, shape([3]))
    want_kda, want_conv = kda0.copy(), conv0.copy()
    for want in (want_kda, want_conv):
        kg.slot_copy_reference(want, 2, 6)
        kg.slot_reset_reference(want, 3)
    np.testing.assert_array_equal(kda.numpy(), want_kda)
    np.testing.assert_array_equal(conv.numpy(), want_conv)


def test_layer_bfloat16_prefill_and_decode():
    """Model dtype bfloat16 (projections bf16; conv, gate, state, norms f32) vs the f32 torch
    reference on the same bf16-rounded weights and inputs."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    pool = {"kda_state": nn.spec.Tensor([N_LAYERS, "S", H_L, K_L, K_L], "float32"),
            "conv_state": nn.spec.Tensor([N_LAYERS, "S", 3, W_L - 1, H_L * K_L], "float32")}
    spec = {"x": nn.spec.Tensor(["T", HIDDEN], "bfloat16"), **meta_spec(), **pool}
    mod, params = _LayerHarness(_cfg(LB), "bfloat16").export_tvm(
        spec={"prefill": spec, "decode": spec})
    vm = compile_vm(mod)
    wts = _random_weights(np.random.default_rng(12), LB)
    dtypes = dict((n, p.dtype) for n, p in params)
    wts = {n: (w.astype(bf16).astype("float32") if dtypes[n] == "bfloat16" else w)
           for n, w in wts.items()}
    harness = (vm, param_args(params, wts))
    rng = np.random.default_rng(13)
    x = rng.standard_normal((20, HIDDEN)).astype(bf16)
    pools = _Pools(rng, random_state=False)
    out = [pools.run(harness, "prefill", x[:17], [17], [2])]
    for t in range(17, 20):
        out.append(pools.run(harness, "decode", x[t:t + 1], [1], [2]))
    out = np.concatenate(out).astype("float32")
    ref, S, _ = torch_kda_layer(wts, torch.from_numpy(x.astype("float32")),
                                torch.zeros(H_L, K_L, K_L),
                                torch.zeros(3, W_L - 1, H_L * K_L), LB)
    scale = np.abs(ref.numpy()).max()
    np.testing.assert_allclose(out, ref.numpy(), atol=3e-2 * scale, rtol=0)
    np.testing.assert_allclose(pools.kda.numpy()[LAYER, 2], S.numpy(), atol=3e-2, rtol=0)


def _mlx_layer(wts, lb):
    """mlx-lm's ``KimiK3DeltaAttention`` (fused qkv_proj / qkv_conv) with our weights."""
    import types

    import mlx.core as mx
    from mlx_lm.models.kimi_k3 import KimiK3DeltaAttention

    args = types.SimpleNamespace(
        hidden_size=HIDDEN, rms_norm_eps=1e-5,
        linear_attn_config={"num_heads": H_L, "head_dim": K_L, "short_conv_kernel_size": W_L,
                            "gate_lower_bound": lb, "use_full_rank_gate": True})
    m = KimiK3DeltaAttention(args, 0)
    w = {k.removeprefix("self_attn."): mx.array(v) for k, v in wts.items()}
    m.qkv_proj.weight = mx.concatenate([w[f"{n}_proj.weight"] for n in "qkv"])
    # mlx Conv1d weight is [C, W, 1]; the checkpoint's is [C, 1, W]
    m.qkv_conv.conv.weight = mx.concatenate(
        [w[f"{n}_conv1d.weight"] for n in "qkv"]).transpose(0, 2, 1)
    for n in ("f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj"):
        getattr(m, n).weight = w[n + ".weight"]
    m.A_log, m.dt_bias, m.o_norm.weight = w["A_log"], w["dt_bias"], w["o_norm.weight"]
    return m


def test_layer_vs_mlx_lm(layer_vm):
    """The compiled layer (prefill 19 + decode 3) == mlx-lm's K3 KDA layer on the 22 tokens."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    _, _, wts, lb = layer_vm
    rng = np.random.default_rng(14)
    x = rng.standard_normal((22, HIDDEN)).astype("float32")
    want = np.array(_mlx_layer(wts, lb)(mx.array(x[None])))[0]
    pools = _Pools(rng, random_state=False)
    got = [pools.run(layer_vm, "prefill", x[:19], [19], [0])]
    for t in range(19, 22):
        got.append(pools.run(layer_vm, "decode", x[t:t + 1], [1], [0]))
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4, rtol=0)
