"""MoE kernels (schedules/moe_generic.py) and the LatentMoE block (relax_modules/moe.py).

Oracles: compressed-tensors' own ``unpack_fp4_from_uint8`` / ``decompress_mx_scale`` /
``pack_fp4_to_uint8`` for MXFP4, the NumPy references beside the kernels, a torch reference
of spec §3 written here, mlx-lm 0.32.2 ``_group_expert_select`` / ``KimiK3SparseMoE``, and one
real k3-nano MoE layer. Everything compiles for CPU (llvm), once per configuration.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.compressors.nvfp4.helpers import (
    kE2M1ToFloat,
    pack_fp4_to_uint8,
    unpack_fp4_from_uint8,
)
from tvm.relax.frontend import nn

from k3_compile.config import K3Config, QuantConfig
from relax_modules.moe import LatentMoE
from schedules import moe_generic as mg

TARGET = tvm.target.Target({"kind": "llvm"})
NANO = Path(__file__).resolve().parents[1] / "models" / "k3-nano"

E, TOPK, HIDDEN, LATENT, INTER = 9, 3, 64, 32, 64
TOKEN_COUNTS = (1, 5, 37)


# --------------------------------------------------------------------------- local helpers
def _compile_prim(func, name):
    return tvm.compile(func.with_attr("global_symbol", name), target=TARGET)[name]


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a))


def _bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def ct_dequant(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors' own unpack × E8M0 scale: ``[E, N, K/2], [E, N, K/32] -> [E, N, K]`` fp32."""
    *lead, n, k2 = packed.shape
    p = torch.from_numpy(packed.reshape(-1, k2))
    vals = unpack_fp4_from_uint8(p, p.shape[0], k2 * 2, dtype=torch.float32)
    sc = decompress_mx_scale(torch.from_numpy(scale.reshape(-1, scale.shape[-1]))).float()
    w = vals * sc.repeat_interleave(32, dim=-1)
    return w.numpy().reshape(*lead, n, k2 * 2)


def random_mxfp4(rng, shape, scale_lo=118, scale_hi=124):
    """Random MXFP4 ``[E, N, K]`` weights packed by compressed-tensors' ``pack_fp4_to_uint8``:
    returns ``(packed [E, N, K/2], scale [E, N, K/32])`` uint8."""
    e, n, k = shape
    vals = kE2M1ToFloat[torch.from_numpy(rng.integers(0, 8, (e * n, k)))]
    vals = vals * torch.from_numpy(np.where(rng.random((e * n, k)) < 0.5, -1.0, 1.0).astype(np.float32))
    packed = pack_fp4_to_uint8(vals).numpy().reshape(e, n, k // 2)
    scale = rng.integers(scale_lo, scale_hi, (e, n, k // 32), dtype=np.uint8)
    return packed, scale


def expert_ids_0_1_many(rng, n_tokens):
    """``[T, TOPK]`` int32 distinct per token; expert 0 gets no token, expert 1 exactly one
    (when T > 1), the rest many."""
    ids = np.stack([rng.choice(np.arange(2, E), TOPK, replace=False) for _ in range(n_tokens)])
    if n_tokens > 1:
        ids[n_tokens // 2, -1] = 1
    return ids.astype(np.int32)


def make_config(mxfp4=True, rsf=2.5, **kw):
    return K3Config(
        hidden_size=HIDDEN, num_experts=E, num_experts_per_token=TOPK, moe_intermediate_size=INTER,
        routed_expert_hidden_size=LATENT, num_shared_experts=1, routed_scaling_factor=rsf,
        quantization=QuantConfig(format="mxfp4-pack-quantized" if mxfp4 else None), **kw,
    )


def compile_moe(cfg, dtype):
    mod, params = LatentMoE(cfg, dtype).export_tvm(
        spec={"forward": {"x": nn.spec.Tensor(["num_tokens", cfg.hidden_size], dtype)}}
    )
    ex = tvm.compile(mod, target=TARGET)
    return tvm.relax.VirtualMachine(ex, tvm.cpu()), [n for n, _ in params]


def np_dtype(dtype):
    return np.float32 if dtype == "float32" else ml_dtypes.bfloat16


def torch_dtype(dtype):
    return torch.float32 if dtype == "float32" else torch.bfloat16


def random_params(rng, cfg, dtype, mxfp4=True):
    """Checkpoint-named parameters (numpy, model dtype / fp32 bias / uint8 experts)."""
    H, L, I, S = cfg.hidden_size, cfg.latent_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    nd = np_dtype(dtype)

    def w(*shape, s=None):
        s = s if s is not None else shape[-1] ** -0.5
        return (rng.standard_normal(shape) * s).astype(np.float32).astype(nd)

    p = {
        "gate.weight": w(E, H, s=0.5),
        "gate.e_score_correction_bias": (rng.standard_normal(E) * 0.05).astype(np.float32),
        "routed_expert_down_proj.weight": w(L, H),
        "routed_expert_up_proj.weight": w(H, L),
        "routed_expert_norm.weight": (1.0 + 0.1 * rng.standard_normal(L)).astype(np.float32).astype(nd),
        "shared_experts.gate_proj.weight": w(S, H),
        "shared_experts.up_proj.weight": w(S, H),
        "shared_experts.down_proj.weight": w(H, S),
    }
    for name, shape in (("w1", (E, I, L)), ("w3", (E, I, L)), ("w2", (E, L, I))):
        if mxfp4:
            # scale ~ 2^-5..2^-3: weights of order 1/sqrt(in)
            p[f"experts.{name}.weight_packed"], p[f"experts.{name}.weight_scale"] = random_mxfp4(
                rng, shape, 121, 125)
        else:
            p[f"experts.{name}.weight"] = w(*shape)
    return p


def dense_experts(p):
    """``{"w1": [E, N, K] fp32, ...}`` via compressed-tensors (or the dense weights)."""
    out = {}
    for name in ("w1", "w2", "w3"):
        if f"experts.{name}.weight_packed" in p:
            out[name] = ct_dequant(p[f"experts.{name}.weight_packed"], p[f"experts.{name}.weight_scale"])
        else:
            out[name] = np.asarray(p[f"experts.{name}.weight"], np.float32)
    return out


def torch_moe_reference(p, x, cfg, dtype):
    """Spec §3 MoE block in torch, with the dtype flow of relax_modules/moe.py (mlx-lm casts).

    Returns ``(out [T, hidden] fp32, ids [T, k], weights [T, k] fp32)``.
    """
    td = torch_dtype(dtype)
    P = {k: torch.from_numpy(np.asarray(v, np.float32)).to(td) for k, v in p.items() if "experts.w" not in k}
    P["gate.e_score_correction_bias"] = torch.from_numpy(p["gate.e_score_correction_bias"])
    W = {k: torch.from_numpy(v) for k, v in dense_experts(p).items()}
    xt = torch.from_numpy(np.asarray(x, np.float32)).to(td)
    beta, beta_lin, eps = cfg.activation_situ_beta, cfg.activation_situ_linear_beta, cfg.rms_norm_eps

    def lin(v, w):
        return (v.float() @ w.float().T).to(td)

    def situ(g, u):
        g, u = g.float(), u.float()
        return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * beta_lin * torch.tanh(u / beta_lin)).to(td)

    def rms(v, w):
        v32 = v.float()
        return w * (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps)).to(td)

    logits = xt.float() @ P["gate.weight"].float().T
    s = torch.sigmoid(logits)
    ids = torch.topk(s + P["gate.e_score_correction_bias"], cfg.num_experts_per_token, dim=-1).indices
    wts = s.gather(-1, ids)
    if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    wts = (wts * cfg.routed_scaling_factor).to(td).float()
    z = lin(xt, P["routed_expert_down_proj.weight"])
    y = torch.zeros(xt.shape[0], z.shape[1], dtype=torch.float32)
    for t in range(xt.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            a = situ(lin(z[t], W["w1"][e]), lin(z[t], W["w3"][e]))
            y[t] += wts[t, j] * lin(a, W["w2"][e]).float()
    y = rms(y.to(td), P["routed_expert_norm.weight"])
    y = lin(y, P["routed_expert_up_proj.weight"])
    sh = lin(situ(lin(xt, P["shared_experts.gate_proj.weight"]), lin(xt, P["shared_experts.up_proj.weight"])),
             P["shared_experts.down_proj.weight"])
    return (y + sh).float().numpy(), ids.numpy(), wts.numpy()


def run_moe(vm, names, p, x, dtype):
    args = [_t(p[n]) for n in names]
    return np.asarray(vm["forward"](_t(np.asarray(x).astype(np_dtype(dtype))), *args).numpy(), np.float32)


# --------------------------------------------------------------------------- dequant
@pytest.fixture(scope="module")
def dequant_fn():
    return _compile_prim(mg.mxfp4_dequant_kernel(255, 512, 1), "deq")


def test_dequant_bit_exact_vs_compressed_tensors(dequant_fn):
    # every packed byte value in every row, every finite scale byte 0..254 (one per row/group)
    n, k = 255, 512
    packed = np.tile(np.arange(256, dtype=np.uint8), (n, 1))[None]  # [1, 255, 256]
    scale = ((np.arange(n)[:, None] + 17 * np.arange(k // 32)[None]) % 255).astype(np.uint8)[None]
    out = tvm.runtime.tensor(np.zeros((1, n, k), np.float32))
    dequant_fn(_t(packed), _t(scale), out)
    got = out.numpy()
    assert np.array_equal(_bits(got), _bits(ct_dequant(packed, scale)))
    assert np.array_equal(_bits(got), _bits(mg.mxfp4_dequant_reference(packed, scale)))


def test_dequant_scale_255_is_nan(dequant_fn):
    packed = np.full((1, 255, 256), 0x22, np.uint8)
    scale = np.full((1, 255, 16), 255, np.uint8)
    out = tvm.runtime.tensor(np.zeros((1, 255, 512), np.float32))
    dequant_fn(_t(packed), _t(scale), out)
    assert np.isnan(out.numpy()).all()


# --------------------------------------------------------------------------- gather GEMV
@pytest.fixture(scope="module")
def gemv_fns():
    return {
        "up": _compile_prim(mg.mxfp4_gather_gemv_kernel(INTER, LATENT, E, TOPK, False), "g_up"),
        "down": _compile_prim(mg.mxfp4_gather_gemv_kernel(LATENT, INTER, E, TOPK, True), "g_down"),
        "up_bf16": _compile_prim(
            mg.mxfp4_gather_gemv_kernel(INTER, LATENT, E, TOPK, False, "bfloat16", "bfloat16"), "g_up_bf"),
        "dense_down": _compile_prim(mg.gather_gemv_kernel(LATENT, INTER, E, TOPK, True), "d_down"),
        "dense_up_bf16": _compile_prim(
            mg.gather_gemv_kernel(INTER, LATENT, E, TOPK, False, "bfloat16", "bfloat16", "float32"), "d_up_bf"),
    }


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
def test_mxfp4_gather_gemv(gemv_fns, n_tokens):
    rng = np.random.default_rng(n_tokens)
    ids = expert_ids_0_1_many(rng, n_tokens)
    counts = np.bincount(ids.ravel(), minlength=E)
    assert counts[0] == 0 and (n_tokens == 1 or counts[1] == 1)
    # w1/w3 shape: z [T, L] shared by the k choices
    pk, sc = random_mxfp4(rng, (E, INTER, LATENT))
    z = rng.standard_normal((n_tokens, LATENT)).astype(np.float32)
    y = tvm.runtime.tensor(np.zeros((n_tokens, TOPK, INTER), np.float32))
    gemv_fns["up"](_t(z), _t(pk), _t(sc), _t(ids), y)
    ref = mg.gather_gemv_reference(z, ct_dequant(pk, sc), ids)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # w2 shape: activation [T, k, I] per choice
    pk2, sc2 = random_mxfp4(rng, (E, LATENT, INTER))
    a = rng.standard_normal((n_tokens, TOPK, INTER)).astype(np.float32)
    y2 = tvm.runtime.tensor(np.zeros((n_tokens, TOPK, LATENT), np.float32))
    gemv_fns["down"](_t(a), _t(pk2), _t(sc2), _t(ids), y2)
    ref2 = mg.gather_gemv_reference(a, ct_dequant(pk2, sc2), ids)
    np.testing.assert_allclose(y2.numpy(), ref2, rtol=1e-5, atol=1e-5 * np.abs(ref2).max())
    # bf16 in/out: fp32 accumulation then one rounding -> within 1 bf16 ulp of the exact result
    zb = z.astype(ml_dtypes.bfloat16)
    yb = tvm.runtime.tensor(np.zeros((n_tokens, TOPK, INTER), ml_dtypes.bfloat16))
    gemv_fns["up_bf16"](_t(zb), _t(pk), _t(sc), _t(ids), yb)
    refb = mg.gather_gemv_reference(zb.astype(np.float32), ct_dequant(pk, sc), ids)
    np.testing.assert_allclose(yb.numpy().astype(np.float32), refb, rtol=2 ** -8, atol=1e-4 * np.abs(refb).max())


@pytest.mark.parametrize("n_tokens", (1, 37))
def test_dense_gather_gemv(gemv_fns, n_tokens):
    rng = np.random.default_rng(100 + n_tokens)
    ids = expert_ids_0_1_many(rng, n_tokens)
    w = rng.standard_normal((E, LATENT, INTER)).astype(np.float32)
    a = rng.standard_normal((n_tokens, TOPK, INTER)).astype(np.float32)
    y = tvm.runtime.tensor(np.zeros((n_tokens, TOPK, LATENT), np.float32))
    gemv_fns["dense_down"](_t(a), _t(w), _t(ids), y)
    ref = mg.gather_gemv_reference(a, w, ids)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    wb = rng.standard_normal((E, INTER, LATENT)).astype(ml_dtypes.bfloat16)
    zb = rng.standard_normal((n_tokens, LATENT)).astype(ml_dtypes.bfloat16)
    y = tvm.runtime.tensor(np.zeros((n_tokens, TOPK, INTER), np.float32))
    gemv_fns["dense_up_bf16"](_t(zb), _t(wb), _t(ids), y)
    ref = mg.gather_gemv_reference(zb.astype(np.float32), wb.astype(np.float32), ids)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


# --------------------------------------------------------------------------- routing
@pytest.fixture(scope="module")
def route_fn():
    return _compile_prim(mg.moe_route_kernel(E, TOPK, 2.5, True), "route")


def _route(fn, logits, bias):
    n = logits.shape[0]
    ids = tvm.runtime.tensor(np.zeros((n, TOPK), np.int32))
    w = tvm.runtime.tensor(np.zeros((n, TOPK), np.float32))
    fn(_t(logits), _t(bias), ids, w)
    return ids.numpy(), w.numpy()


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
def test_route_vs_references(route_fn, n_tokens):
    rng = np.random.default_rng(7 + n_tokens)
    logits = (rng.standard_normal((n_tokens, E)) * 2).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.3).astype(np.float32)
    ids, w = _route(route_fn, logits, bias)
    rids, rw = mg.moe_route_reference(logits, bias, TOPK, 2.5, True)
    assert np.array_equal(ids, rids)  # same order: descending biased score
    np.testing.assert_allclose(w, rw, rtol=1e-6, atol=1e-7)
    # mlx-lm's own router (fp32 input; argpartition order is unspecified: compare per-token sets)
    import mlx.core as mx
    from mlx_lm.models.kimi_k3 import _group_expert_select

    minds, mw = _group_expert_select(mx.array(logits), mx.array(bias), TOPK, 1, 1, 2.5, True)
    minds, mw = np.array(minds), np.array(mw)
    for t in range(n_tokens):
        assert set(ids[t]) == set(minds[t].tolist())
        order = np.argsort(minds[t])
        np.testing.assert_allclose(w[t][np.argsort(ids[t])], mw[t][order], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(w.sum(-1), 2.5, rtol=1e-6)


def test_route_ties_lowest_index_wins(route_fn):
    logits = np.zeros((2, E), np.float32)
    logits[1, [2, 5, 7, 8]] = 1.0  # 4-way tie for 3 places
    ids, w = _route(route_fn, logits, np.zeros(E, np.float32))
    assert ids[0].tolist() == [0, 1, 2]
    assert ids[1].tolist() == [2, 5, 7]
    np.testing.assert_allclose(w, 2.5 / 3, rtol=1e-6)


def test_route_no_renormalize():
    fn = _compile_prim(mg.moe_route_kernel(E, TOPK, 1.5, False), "route_nr")
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, E)).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.3).astype(np.float32)
    ids, w = _route(fn, logits, bias)
    rids, rw = mg.moe_route_reference(logits, bias, TOPK, 1.5, False)
    assert np.array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, rtol=1e-6)


# --------------------------------------------------------------------------- whole block
@pytest.fixture(scope="module")
def moe_fp32():
    cfg = make_config()
    return cfg, *compile_moe(cfg, "float32")


@pytest.fixture(scope="module")
def moe_bf16():
    cfg = make_config()
    return cfg, *compile_moe(cfg, "bfloat16")


def _rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
def test_block_fp32_vs_torch(moe_fp32, n_tokens):
    cfg, vm, names = moe_fp32
    rng = np.random.default_rng(11 + n_tokens)
    p = random_params(rng, cfg, "float32")
    x = rng.standard_normal((n_tokens, HIDDEN)).astype(np.float32)
    got = run_moe(vm, names, p, x, "float32")
    ref, _, _ = torch_moe_reference(p, x, cfg, "float32")
    assert got.shape == (n_tokens, HIDDEN)
    assert _rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("n_tokens", TOKEN_COUNTS)
def test_block_bf16_vs_torch(moe_bf16, n_tokens):
    cfg, vm, names = moe_bf16
    rng = np.random.default_rng(21 + n_tokens)
    p = random_params(rng, cfg, "bfloat16")
    x = rng.standard_normal((n_tokens, HIDDEN)).astype(np.float32)
    got = run_moe(vm, names, p, x, "bfloat16")
    ref, _, _ = torch_moe_reference(p, x, cfg, "bfloat16")
    # identical cast points; an fp32 summation-order difference can flip one bf16 rounding
    assert _rel_err(got, ref) < 1e-2  # measured: 0 or 1 bf16 ulp


@pytest.mark.parametrize("mlx_experts", ["dense", "mxfp4"])
def test_block_fp32_vs_mlx(moe_fp32, mlx_experts):
    """mlx-lm's KimiK3SparseMoE with the same weights: experts either dequantized (fp32
    SwitchLinear) or quantized with mlx's own ``mode="mxfp4"`` reading our packed bytes (as
    mlx-lm's ``sanitize`` does: ``weight_packed.view(uint32)``, ``weight_scale`` as scales)."""
    import mlx.core as mx
    import mlx.nn as mnn
    from mlx_lm.models.kimi_k3 import KimiK3SparseMoE

    cfg, vm, names = moe_fp32
    rng = np.random.default_rng(5)
    p = random_params(rng, cfg, "float32")
    x = rng.standard_normal((37, HIDDEN)).astype(np.float32)
    args = SimpleNamespace(
        hidden_size=HIDDEN, num_experts=E, routed_expert_hidden_size=LATENT, moe_intermediate_size=INTER,
        activation_situ_beta=cfg.activation_situ_beta, activation_situ_linear_beta=cfg.activation_situ_linear_beta,
        latent_moe_use_norm=True, rms_norm_eps=cfg.rms_norm_eps, num_shared_experts=1,
        intermediate_size=INTER, num_experts_per_token=TOPK, num_expert_group=1, topk_group=1,
        routed_scaling_factor=cfg.routed_scaling_factor, moe_renormalize=True,
    )
    m = KimiK3SparseMoE(args)
    weights = [(k, mx.array(np.asarray(v, np.float32))) for k, v in p.items()
               if "experts.w" not in k and k != "gate.e_score_correction_bias"]
    weights.append(("e_score_correction_bias", mx.array(p["gate.e_score_correction_bias"])))
    pairs = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    if mlx_experts == "dense":
        dense = dense_experts(p)
        weights += [(f"switch_mlp.{dst}.weight", mx.array(dense[src])) for src, dst in pairs]
    else:
        mnn.quantize(m, group_size=32, bits=4, mode="mxfp4",
                     class_predicate=lambda path, mod: "switch_mlp" in path and hasattr(mod, "to_quantized"))
        for src, dst in pairs:
            weights.append((f"switch_mlp.{dst}.weight", mx.array(p[f"experts.{src}.weight_packed"]).view(mx.uint32)))
            weights.append((f"switch_mlp.{dst}.scales", mx.array(p[f"experts.{src}.weight_scale"])))
    m.load_weights(weights, strict=True)
    ref = np.array(m(mx.array(x)))
    got = run_moe(vm, names, p, x, "float32")
    assert _rel_err(got, ref) < 1e-5  # measured ~5e-7


def test_dequant_vs_mlx_mxfp4():
    import mlx.core as mx

    rng = np.random.default_rng(1)
    pk, sc = random_mxfp4(rng, (3, 16, 64), 100, 150)
    d = mx.dequantize(mx.array(pk).view(mx.uint32), mx.array(sc), group_size=32, bits=4, mode="mxfp4")
    d = np.array(d.astype(mx.float32))
    assert np.array_equal(_bits(d), _bits(ct_dequant(pk, sc)))
    assert np.array_equal(_bits(d), _bits(mg.mxfp4_dequant_reference(pk, sc)))


def test_block_dense_experts_fp32():
    cfg = make_config(mxfp4=False)
    vm, names = compile_moe(cfg, "float32")
    assert "experts.w1.weight" in names
    rng = np.random.default_rng(9)
    p = random_params(rng, cfg, "float32", mxfp4=False)
    x = rng.standard_normal((5, HIDDEN)).astype(np.float32)
    got = run_moe(vm, names, p, x, "float32")
    ref, _, _ = torch_moe_reference(p, x, cfg, "float32")
    assert _rel_err(got, ref) < 1e-5


def test_parameter_names(moe_fp32):
    _, _, names = moe_fp32
    assert set(names) == {
        "gate.weight", "gate.e_score_correction_bias", "routed_expert_down_proj.weight",
        "routed_expert_norm.weight", "routed_expert_up_proj.weight",
        "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight",
        *(f"experts.{w}.{s}" for w in ("w1", "w2", "w3") for s in ("weight_packed", "weight_scale")),
    }


# --------------------------------------------------------------------------- k3-nano
@pytest.mark.skipif(not (NANO / "config.json").is_file(), reason="k3-nano not present")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_k3_nano_layer(dtype):
    from safetensors import safe_open

    cfg = K3Config.from_file(NANO)
    layer = cfg.moe_layer_ids[0]
    prefix = f"{cfg.tensor_prefix}model.layers.{layer}.block_sparse_moe."
    index = json.loads((NANO / "model.safetensors.index.json").read_text())["weight_map"]
    keys = [k for k in index if k.startswith(prefix)]
    raw = {}
    for shard in sorted({index[k] for k in keys}):
        with safe_open(str(NANO / shard), framework="pt") as f:
            for k in keys:
                if index[k] == shard:
                    raw[k[len(prefix):]] = f.get_tensor(k)
    p = {}
    for k, v in raw.items():
        if k.startswith("experts."):
            continue
        if v.dtype == torch.bfloat16:
            v = v.float().numpy().astype(np_dtype(dtype))
        else:
            v = v.numpy()
        p[k] = v
    for w in ("w1", "w2", "w3"):
        for s in ("weight_packed", "weight_scale"):
            p[f"experts.{w}.{s}"] = np.stack([raw[f"experts.{e}.{w}.{s}"].numpy() for e in range(cfg.num_experts)])
    vm, names = compile_moe(cfg, dtype)
    assert set(names) == set(p)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, cfg.hidden_size)).astype(np.float32)
    got = run_moe(vm, names, p, x, dtype)
    ref, _, _ = torch_moe_reference(p, x, cfg, dtype)
    assert np.isfinite(got).all()
    assert _rel_err(got, ref) < (1e-5 if dtype == "float32" else 1e-2)
