"""RMSNorm, SiTU-GLU MLP and Block Attention Residuals vs torch / fla references (spec §3)."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tvm  # noqa: E402
from tvm.relax.frontend import nn  # noqa: E402
from tvm.relax.frontend.nn import op  # noqa: E402

from relax_modules.attn_res import AttnRes, AttnResNorm, AttnResProj, BlockResiduals  # noqa: E402
from relax_modules.layers import RMSNorm, SiTUMLP  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fla.ops.attnres.naive import naive_attnres  # noqa: E402

DEV = tvm.cpu()
HIDDEN, INTER = 64, 96
EPS = 1e-5
BETA, BETA_LIN = 4.0, 25.0
NP_DTYPE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _build(module: nn.Module, spec: dict):
    """Compile ``module.forward`` for llvm; return (call(*inputs) -> outputs, param names/shapes)."""
    mod, params = module.export_tvm(spec={"forward": spec})
    vm = tvm.relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})), DEV)
    return vm["forward"], params


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a), DEV)


def _torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.tensor(a.astype(np.float32)).to(torch.bfloat16)
    return torch.tensor(a)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def _rand_params(params, rng, dtype):
    out = {}
    for name, p in params:
        shape = [int(s) for s in p.shape]
        if name.endswith("norm.weight"):
            w = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith("res_proj.weight"):
            w = rng.standard_normal(shape) * 0.3
        else:
            w = rng.standard_normal(shape) / math.sqrt(shape[-1])
        out[name] = w.astype(NP_DTYPE[dtype])
    return out


# --------------------------------------------------------------------------- RMSNorm + SiTU MLP
class _NormMLP(nn.Module):
    def __init__(self, dtype):
        self.norm = RMSNorm(HIDDEN, EPS, dtype)
        self.mlp = SiTUMLP(HIDDEN, INTER, BETA, BETA_LIN, dtype)

    def forward(self, x):
        return self.norm(x), self.mlp(x)


def torch_rmsnorm(x, w, eps):
    """Spec §3: w * (x32 * rsqrt(mean(x32²) + eps)).to(dtype)."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_situ_mlp(x, wg, wu, wd):
    """Spec §3: down(β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin)), activation in fp32."""
    g, u = (x @ wg.T).float(), (x @ wu.T).float()
    act = BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * BETA_LIN * torch.tanh(u / BETA_LIN)
    return act.to(x.dtype) @ wd.T


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rmsnorm_and_situ_mlp(dtype):
    fn, params = _build(_NormMLP(dtype), {"x": nn.spec.Tensor(["T", HIDDEN], dtype)})
    rng = np.random.default_rng(0)
    w = _rand_params(params, rng, dtype)
    x = (3.0 * rng.standard_normal((37, HIDDEN))).astype(NP_DTYPE[dtype])
    norm, mlp = fn(_t(x), *[_t(w[n]) for n, _ in params])
    tw = {n: _torch(v) for n, v in w.items()}
    want_norm = torch_rmsnorm(_torch(x), tw["norm.weight"], EPS)
    want_mlp = torch_situ_mlp(_torch(x), tw["mlp.gate_proj.weight"], tw["mlp.up_proj.weight"],
                              tw["mlp.down_proj.weight"])
    assert norm.numpy().dtype == NP_DTYPE[dtype]
    # measured: fp32 norm 7e-7, mlp 6e-6 (|ref| ≤ 21); bf16 norm exact, mlp 0.031 (< 1 ulp at 20)
    if dtype == "float32":
        np.testing.assert_allclose(norm.numpy(), _np(want_norm), rtol=1e-6, atol=2e-6)
        np.testing.assert_allclose(mlp.numpy(), _np(want_mlp), rtol=1e-5, atol=2e-5)
    else:  # bf16: within one bf16 ulp (fp32 accumulation order differs from torch)
        np.testing.assert_allclose(norm.numpy().astype(np.float32), _np(want_norm), rtol=4e-3, atol=1e-3)
        np.testing.assert_allclose(mlp.numpy().astype(np.float32), _np(want_mlp), rtol=8e-3, atol=1e-2)


# --------------------------------------------------------------------------- AttnRes mix
N_BLOCKS = 3


class _Mix(nn.Module):
    def __init__(self, dtype):
        self.mlp_res_norm = AttnResNorm(HIDDEN, dtype)
        self.mlp_res_proj = AttnResProj(HIDDEN, dtype)
        self.mlp_res = AttnRes(self.mlp_res_norm, self.mlp_res_proj, EPS)

    def forward(self, b0, b1, b2, partial):
        return self.mlp_res([b0, b1, b2], partial), self.mlp_res([], partial)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attn_res_mix_matches_fla(dtype):
    t = nn.spec.Tensor(["T", HIDDEN], dtype)
    fn, params = _build(_Mix(dtype), {"b0": t, "b1": t, "b2": t, "partial": t})
    assert [n for n, _ in params] == ["mlp_res_norm.weight", "mlp_res_proj.weight"]
    assert [int(s) for s in params[1][1].shape] == [1, HIDDEN]
    rng = np.random.default_rng(1)
    w = _rand_params(params, rng, dtype)
    vs = [(rng.standard_normal((29, HIDDEN)) * s).astype(NP_DTYPE[dtype]) for s in (1.0, 4.0, 0.5, 2.0)]
    mixed, ident = fn(*[_t(v) for v in vs], *[_t(w[n]) for n, _ in params])
    want = naive_attnres(query=_torch(w["mlp_res_proj.weight"]), residuals=[_torch(v) for v in vs],
                         rms_weight=_torch(w["mlp_res_norm.weight"]), rms_eps=EPS)
    # measured: fp32 2.7e-6 (|ref| ≤ 10); bf16 bit-identical to fla
    tol = dict(rtol=1e-6, atol=1e-5) if dtype == "float32" else dict(rtol=4e-3, atol=1e-3)
    np.testing.assert_allclose(mixed.numpy().astype(np.float32), _np(want), **tol)
    np.testing.assert_array_equal(ident.numpy(), vs[-1])   # no blocks: identity


# --------------------------------------------------------------------------- bookkeeping
N_LAYERS, BLOCK = 7, 2


class _ToyLayer(nn.Module):
    """AttnRes layer with the checkpoint's parameter names and toy attn / mlp (tanh ∘ linear)."""

    def __init__(self):
        self.self_attention_res_norm = AttnResNorm(HIDDEN)
        self.self_attention_res_proj = AttnResProj(HIDDEN)
        self.mlp_res_norm = AttnResNorm(HIDDEN)
        self.mlp_res_proj = AttnResProj(HIDDEN)
        self.input_layernorm = RMSNorm(HIDDEN, EPS)
        self.post_attention_layernorm = RMSNorm(HIDDEN, EPS)
        self.attn = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.mlp = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.attn_res = AttnRes(self.self_attention_res_norm, self.self_attention_res_proj, EPS)
        self.mlp_res = AttnRes(self.mlp_res_norm, self.mlp_res_proj, EPS)

    def forward(self, res: BlockResiduals, layer_idx: int):
        h = res.before_attention(layer_idx, BLOCK, self.attn_res)
        res.add(op.tanh(self.attn(self.input_layernorm(h))))
        h = res.mix(self.mlp_res)
        res.add(op.tanh(self.mlp(self.post_attention_layernorm(h))))


class _ToyModel(nn.Module):
    def __init__(self):
        self.layers = nn.ModuleList([_ToyLayer() for _ in range(N_LAYERS)])
        self.output_attn_res_norm = AttnResNorm(HIDDEN)
        self.output_attn_res_proj = AttnResProj(HIDDEN)
        self.output_res = AttnRes(self.output_attn_res_norm, self.output_attn_res_proj, EPS)

    def forward(self, emb):
        res = BlockResiduals(emb)
        for i, layer in enumerate(self.layers):
            layer(res, i)
        return self.output_res.__call__(res.blocks, res.partial), len(res.blocks)


def torch_toy_model(emb, w):
    """Spec §3 steps 1–4 (mlx-lm KimiK3DecoderLayer order), mixing with fla's naive_attnres."""
    W = {k: torch.tensor(v) for k, v in w.items()}

    def mix(blocks, partial, site):
        if not blocks:
            return partial
        return naive_attnres(W[f"{site}_res_proj.weight"], [*blocks, partial],
                             W[f"{site}_res_norm.weight"], rms_eps=EPS)

    blocks, partial = [], torch.tensor(emb)
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        h = mix(blocks, partial, p + "self_attention")
        if i % BLOCK == 0:
            blocks.append(partial)
            partial = None
        a = torch.tanh(torch_rmsnorm(h, W[p + "input_layernorm.weight"], EPS) @ W[p + "attn.weight"].T)
        partial = a if partial is None else partial + a
        h = mix(blocks, partial, p + "mlp")
        partial = partial + torch.tanh(
            torch_rmsnorm(h, W[p + "post_attention_layernorm.weight"], EPS) @ W[p + "mlp.weight"].T)
    return mix(blocks, partial, "output_attn").numpy(), len(blocks)


def test_block_bookkeeping_7_layers_block_2():
    model = _ToyModel()
    # forward returns a Python int too: export only the tensor
    model.forward = lambda emb, _f=model.forward: _f(emb)[0]
    fn, params = _build(model, {"emb": nn.spec.Tensor(["T", HIDDEN], "float32")})
    names = [n for n, _ in params]
    assert "layers.3.self_attention_res_proj.weight" in names
    assert "output_attn_res_norm.weight" in names
    rng = np.random.default_rng(2)
    w = _rand_params(params, rng, "float32")
    emb = rng.standard_normal((11, HIDDEN)).astype(np.float32)
    got = fn(_t(emb), *[_t(w[n]) for n in names]).numpy()
    want, n_blocks = torch_toy_model(emb, w)
    assert n_blocks == math.ceil(N_LAYERS / BLOCK)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)   # measured 2e-6 (|ref| ≤ 2.5)
