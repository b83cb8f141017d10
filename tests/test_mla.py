"""Gated MLA: paged latent kernels vs NumPy, the Relax layer vs a torch reference (spec §3).

The torch reference is the *non-absorbed* form of spec §3 (k_nope and v materialized from
kv_b_proj per head), so agreement also checks the kv_b absorption done in relax_modules/mla.py.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tvm  # noqa: E402
from tvm.relax.frontend import nn  # noqa: E402

from k3_compile.config import K3Config  # noqa: E402
from relax_modules.common import ForwardMeta  # noqa: E402
from relax_modules.mla import GatedMLA  # noqa: E402
from schedules.mla_generic import (  # noqa: E402
    mla_append_kernel,
    mla_append_reference,
    mla_attend_kernel,
    mla_attend_reference,
)

TARGET = {"kind": "llvm"}
DEV = tvm.cpu()
PAGE_SIZE = 16
N_MLA_LAYERS = 2
MLA_INDEX = 1
CFG = K3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
H, L, R = CFG.num_attention_heads, CFG.kv_lora_rank, CFG.qk_rope_head_dim
NOPE, DV = CFG.qk_nope_head_dim, CFG.v_head_dim
SCALE = (NOPE + R) ** -0.5


def _compile(mod):
    return tvm.compile(mod, target=tvm.target.Target(TARGET))


def _t(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a), DEV)


# --------------------------------------------------------------------------- batch helpers
class PagePool:
    """Hands out shuffled (non-contiguous) page ids; keeps each sequence's page list."""

    def __init__(self, num_pages: int, seed: int = 0):
        self.free = list(np.random.default_rng(seed).permutation(num_pages))
        self.pages: dict[int, list[int]] = {}

    def ensure(self, sid: int, length: int):
        pages = self.pages.setdefault(sid, [])
        while len(pages) * PAGE_SIZE < length:
            pages.append(int(self.free.pop()))


def make_meta(chunks, pool: PagePool):
    """chunks: list of (seq_id, start_pos, n_tokens), contiguous per sequence in the flat batch.

    Returns the DESIGN.md metadata arrays (int32) in ForwardMeta order.
    """
    for sid, start, n in chunks:
        pool.ensure(sid, start + n)
    max_pages = max(len(pool.pages[sid]) for sid, _, _ in chunks)
    cu = np.cumsum([0] + [n for _, _, n in chunks]).astype(np.int32)
    token_seq = np.concatenate([np.full(n, b) for b, (_, _, n) in enumerate(chunks)]).astype(np.int32)
    token_pos = np.concatenate([np.arange(s, s + n) for _, s, n in chunks]).astype(np.int32)
    slots = np.arange(len(chunks), dtype=np.int32)
    page_table = np.full((len(chunks), max_pages), -1, np.int32)
    for b, (sid, _, _) in enumerate(chunks):
        page_table[b, : len(pool.pages[sid])] = pool.pages[sid]
    return cu, token_seq, token_pos, slots, page_table, (cu[1:] - 1).astype(np.int32)


# --------------------------------------------------------------------------- kernels
@pytest.fixture(scope="module")
def kernels():
    mod = tvm.IRModule({
        "mla_append": mla_append_kernel(L, R, PAGE_SIZE, "float32"),
        "mla_attend": mla_attend_kernel(H, L, R, PAGE_SIZE, SCALE, "float32"),
    })
    return _compile(mod)


def test_kernels_match_numpy(kernels):
    rng = np.random.default_rng(1)
    pool = PagePool(40, seed=1)
    lens = [1, 7, 63, 64, 65, 200]
    cu, ts, tp, _, pt, _ = make_meta([(i, 0, n) for i, n in enumerate(lens)], pool)
    n_tok = int(cu[-1])
    cache = rng.standard_normal((N_MLA_LAYERS, 40, PAGE_SIZE, L + R)).astype(np.float32)
    kv = rng.standard_normal((n_tok, L + R)).astype(np.float32)
    c = _t(cache)
    kernels["mla_append"](c, _t(kv), _t(pt), _t(ts), _t(tp), MLA_INDEX)
    want_cache = mla_append_reference(cache, kv, pt, ts, tp, MLA_INDEX)
    np.testing.assert_array_equal(c.numpy(), want_cache)

    q_lat = rng.standard_normal((n_tok, H, L)).astype(np.float32)
    q_rope = rng.standard_normal((n_tok, H, R)).astype(np.float32)
    out = _t(np.zeros((n_tok, H, L), np.float32))
    kernels["mla_attend"](_t(q_lat), _t(q_rope), c, _t(pt), _t(ts), _t(tp), MLA_INDEX, out)
    want = mla_attend_reference(q_lat, q_rope, want_cache, pt, ts, tp, MLA_INDEX, SCALE)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=2e-6)


def test_gpu_variant_generates_cuda():
    """The thread-bound variants lower to CUDA source (codegen only; no device needed)."""
    mod = tvm.IRModule({
        "mla_append": mla_append_kernel(512, 64, 64, "bfloat16", gpu=True),
        "mla_attend": mla_attend_kernel(96, 512, 64, 64, SCALE, "bfloat16", gpu=True),
    })
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    src = ex.mod.imports[0].inspect_source()
    assert "mla_attend_kernel" in src and "mla_append_kernel" in src


# --------------------------------------------------------------------------- the layer
class _Wrap(nn.Module):
    def __init__(self, dtype):
        self.self_attn = GatedMLA(CFG, PAGE_SIZE, dtype)

    def forward(self, x, cu_seqlens, token_seq, token_pos, seq_slots, page_table, last_token,
                mla_cache):
        meta = ForwardMeta(cu_seqlens, token_seq, token_pos, seq_slots, page_table, last_token)
        return self.self_attn(x, meta, mla_cache, MLA_INDEX)


def _i32(*shape):
    return nn.spec.Tensor(list(shape), "int32")


NP_DTYPE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# |layer - float64 reference| bounds (outputs are O(1), max ≈ 1.8). Measured on llvm x86:
# fp32 max 7.4e-7; bf16 (weights, activations and cache bf16, fp32 accumulation) max 9.4e-3.
LAYER_TOL = {"float32": dict(rtol=1e-5, atol=5e-6), "bfloat16": dict(rtol=0.0, atol=2.5e-2)}
# prefill→decode and batched-vs-alone: measured bit-identical in both dtypes; allow ~1 ulp.
SAME_TOL = {"float32": dict(rtol=1e-6, atol=1e-7), "bfloat16": dict(rtol=8e-3, atol=1e-3)}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def layer(request):
    dtype = request.param
    spec = {"forward": {
        "x": nn.spec.Tensor(["T", CFG.hidden_size], dtype),
        "cu_seqlens": _i32("B_plus_1"), "token_seq": _i32("T"), "token_pos": _i32("T"),
        "seq_slots": _i32("B"), "page_table": _i32("B", "max_pages"), "last_token": _i32("B"),
        "mla_cache": nn.spec.Tensor([N_MLA_LAYERS, "num_pages", PAGE_SIZE, L + R], dtype),
    }}
    mod, params = _Wrap(dtype).export_tvm(spec=spec)
    vm = tvm.relax.VirtualMachine(_compile(mod), DEV)
    rng = np.random.default_rng(0)
    weights = {}
    for name, p in params:
        shape = [int(s) for s in p.shape]
        if "layernorm" in name:
            w = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / math.sqrt(shape[1])
        weights[name.removeprefix("self_attn.")] = w.astype(NP_DTYPE[dtype])
    args = [_t(weights[name.removeprefix("self_attn.")]) for name, _ in params]

    def run(x, meta, cache):
        out, new_cache = vm["forward"](_t(x.astype(NP_DTYPE[dtype])), *[_t(m) for m in meta],
                                       cache, *args)
        return out.numpy().astype(np.float32), new_cache

    run.dtype = dtype
    run.new_cache = lambda num_pages=48: _t(
        np.zeros((N_MLA_LAYERS, num_pages, PAGE_SIZE, L + R), NP_DTYPE[dtype]))
    weights = {k: v.astype(np.float32) for k, v in weights.items()}   # exact bf16 values
    return run, weights


def torch_reference(x: np.ndarray, w: dict) -> np.ndarray:
    """Spec §3 Gated MLA of ONE whole sequence, non-absorbed, float64. x [n, hidden]."""
    W = {k: torch.tensor(v, dtype=torch.float64) for k, v in w.items()}
    x = torch.tensor(x.astype(np.float32), dtype=torch.float64)
    n = x.shape[0]

    def rms(v, weight, eps):
        return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))

    q = rms(x @ W["q_a_proj.weight"].T, W["q_a_layernorm.weight"], 1e-6) @ W["q_b_proj.weight"].T
    q = q.view(n, H, NOPE + R)
    c = x @ W["kv_a_proj_with_mqa.weight"].T
    latent, k_rope = c[:, :L], c[:, L:]
    kv = (rms(latent, W["kv_a_layernorm.weight"], 1e-6) @ W["kv_b_proj.weight"].T).view(n, H, NOPE + DV)
    k_nope, v = kv[..., :NOPE], kv[..., NOPE:]
    k = torch.cat([k_nope, k_rope[:, None, :].expand(n, H, R)], dim=-1)      # shared k_rope
    s = torch.einsum("qhd,khd->hqk", q, k) * (NOPE + R) ** -0.5
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, H * DV)
    o = o * torch.sigmoid(x @ W["g_proj.weight"].T)
    return (o @ W["o_proj.weight"].T).numpy()


def _xs(lens, seed=2, dtype="float32"):
    """Random inputs, rounded to the model dtype (so the reference sees the same values)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, CFG.hidden_size)).astype(NP_DTYPE[dtype]).astype(np.float32)
            for n in lens]


def test_ragged_prefill_matches_torch(layer):
    run, weights = layer
    lens = [1, 7, 63, 64, 65, 200]
    xs = _xs(lens, dtype=run.dtype)
    pool = PagePool(48, seed=3)
    meta = make_meta([(i, 0, n) for i, n in enumerate(lens)], pool)
    cache = run.new_cache()
    out, cache = run(np.concatenate(xs), meta, cache)
    cu = meta[0]
    for i, x in enumerate(xs):
        want = torch_reference(x, weights)
        np.testing.assert_allclose(out[cu[i]:cu[i + 1]], want, **LAYER_TOL[run.dtype])
    # the other layer's slice of the pool is untouched
    assert not cache.numpy()[1 - MLA_INDEX].any()


def test_prefill_then_decode_equals_whole_prefill(layer):
    run, weights = layer
    lens = [7, 65]
    n_dec = 3
    xs = _xs(lens, seed=4, dtype=run.dtype)
    # whole prefill
    pool = PagePool(48, seed=5)
    whole, _ = run(np.concatenate(xs), make_meta([(i, 0, n) for i, n in enumerate(lens)], pool),
                   run.new_cache())
    cu = np.cumsum([0] + lens)
    # prefill all but the last n_dec tokens, then decode one token per sequence per step
    pool = PagePool(48, seed=6)
    cache = run.new_cache()
    pre = [n - n_dec for n in lens]
    out, cache = run(np.concatenate([x[:p] for x, p in zip(xs, pre)]),
                     make_meta([(i, 0, p) for i, p in enumerate(pre)], pool), cache)
    for step in range(n_dec):
        pos = [p + step for p in pre]
        x_step = np.stack([x[p] for x, p in zip(xs, pos)])
        out, cache = run(x_step, make_meta([(i, p, 1) for i, p in enumerate(pos)], pool), cache)
        for i, p in enumerate(pos):
            np.testing.assert_allclose(out[i], whole[cu[i] + p], **SAME_TOL[run.dtype])
    np.testing.assert_allclose(whole[cu[1]:cu[2]], torch_reference(xs[1], weights),
                               **LAYER_TOL[run.dtype])


def test_two_sequences_together_equal_each_alone(layer):
    run, _ = layer
    xs = _xs([40, 23], seed=7, dtype=run.dtype)
    steps = [(0, 30, 15), (30, 5, 5), (35, 5, 3)]   # (start, n for seq 0, n for seq 1) per forward
    # alone
    alone = []
    for i, x in enumerate(xs):
        pool, cache, outs = PagePool(48, seed=8 + i), run.new_cache(), []
        start = 0
        for s in steps:
            n = s[1 + i]
            o, cache = run(x[start:start + n], make_meta([(0, start, n)], pool), cache)
            outs.append(o)
            start += n
        alone.append(np.concatenate(outs))
    # together (same forward holds both; seq 1 first in the batch to mix the order)
    pool, cache = PagePool(48, seed=10), run.new_cache()
    got = [[], []]
    st = [0, 0]
    for s in steps:
        n0, n1 = s[1], s[2]
        x = np.concatenate([xs[1][st[1]:st[1] + n1], xs[0][st[0]:st[0] + n0]])
        o, cache = run(x, make_meta([(1, st[1], n1), (0, st[0], n0)], pool), cache)
        got[1].append(o[:n1])
        got[0].append(o[n1:])
        st = [st[0] + n0, st[1] + n1]
    for i in range(2):
        np.testing.assert_allclose(np.concatenate(got[i]), alone[i], **SAME_TOL[run.dtype])
