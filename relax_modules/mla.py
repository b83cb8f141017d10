"""Gated MLA layer (spec §3 "Gated MLA layer"; DeepSeek-V3 style, NoPE: no rotary at all).

Spec §3, with H heads, nope = qk_nope_head_dim, rope = qk_rope_head_dim, L = kv_lora_rank,
v = v_head_dim (K3: 96, 128, 64, 512, 128):

    q            = q_b(RMSNorm_{q_a_layernorm}(q_a x))           [T, H, nope+rope] → nope | rope
    c            = kv_a_proj_with_mqa x                          [T, L+rope]       → latent | k_rope
    latent       = RMSNorm_{kv_a_layernorm}(latent)              (eps mla_layernorm_eps, 1e-6)
    k_nope | v_j = kv_b(latent_j) per head                       kv_b.weight [H·(nope+v), L]
    attn         = softmax_j((q_nope·k_nope_j + q_rope·k_rope_j) · (nope+rope)^-½) · v_j,  j ≤ pos
    out          = o_proj(attn · σ(g_proj x))                    x = the layer's attention input

Absorbed form computed here (weight absorption of ``kv_b``, as mlx-lm's decode path):
with ``W_UK[h] = kv_b.weight.reshape(H, nope+v, L)[h, :nope]`` and ``W_UV[h] = …[h, nope:]``,

    q_lat[t,h] = q_nope[t,h] · W_UK[h]                                 [L]
    o_lat[t,h] = Σ_j softmax_j((q_lat·c_j + q_rope·k_rope_j)·scale) c_j  (TIR kernel, fp32)
    attn[t,h]  = W_UV[h] · o_lat[t,h]                                  [v]

The cache row of a token is ``[RMSNorm(latent) | k_rope]`` (``mla_cache`` layout in
docs/DESIGN.md); this forward's rows are appended in place before attending, so prefill and
decode are the same code. ``x`` is ``input_layernorm(h)`` (mlx-lm ``KimiK3DecoderLayer``:
``self_attn(self.input_layernorm(h))`` and the gate is ``g_proj(x)`` of that same input).
"""

from __future__ import annotations

import math

import tvm
import tvm.tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from k3_compile.config import K3Config
from schedules.mla_generic import mla_append_kernel, mla_attend_kernel

from .common import ForwardMeta
from .layers import Linear, RMSNorm, matmul_fp32acc

__all__ = ["GatedMLA"]


class GatedMLA(nn.Module):
    """``self_attn`` of an MLA layer.

    Parameters (checkpoint names under ``model.layers.{i}.self_attn.``): ``q_a_proj``
    [q_lora, hidden], ``q_a_layernorm`` [q_lora], ``q_b_proj`` [H·(nope+rope), q_lora],
    ``kv_a_proj_with_mqa`` [L+rope, hidden], ``kv_a_layernorm`` [L], ``kv_b_proj``
    [H·(nope+v), L], ``g_proj`` [H·v, hidden], ``o_proj`` [hidden, H·v]; all model dtype.
    """

    def __init__(self, config: K3Config, page_size: int, dtype: str = "float32", gpu: bool = False):
        c = config
        self.num_heads = c.num_attention_heads
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.page_size = page_size
        self.dtype = dtype
        self.gpu = gpu                      # thread-bound kernel variants (schedules/mla_generic.py)
        self.scale = 1.0 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)   # (128+64)^-½
        H, hidden = c.num_attention_heads, c.hidden_size
        self.q_a_proj = Linear(hidden, c.q_lora_rank, dtype)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.mla_layernorm_eps, dtype)
        self.q_b_proj = Linear(c.q_lora_rank, H * c.qk_head_dim, dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, c.mla_cache_dim, dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.mla_layernorm_eps, dtype)
        self.kv_b_proj = Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), dtype)
        self.g_proj = Linear(hidden, H * c.v_head_dim, dtype)
        self.o_proj = Linear(H * c.v_head_dim, hidden, dtype)

    def forward(self, x: Tensor, meta: ForwardMeta, mla_cache: Tensor, mla_index: int):
        """``x [T, hidden]`` (after input_layernorm), ``mla_cache [NL, NP, PS, L+rope]`` →
        ``(out [T, hidden], mla_cache)``; the returned cache carries this forward's rows."""
        H, nope, rope, L, dv = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                self.kv_lora_rank, self.v_head_dim)
        n_tok = x.shape[0]
        index = tvm.tirx.IntImm("int64", mla_index)

        # q = q_b(RMSNorm(q_a x)) split per head into nope | rope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = op.split(op.reshape(q, [n_tok, H, nope + rope]), [nope], axis=2)

        # c = kv_a_proj_with_mqa x split into latent | k_rope; the cache row is [RMSNorm(latent) | k_rope]
        latent, k_rope = op.split(self.kv_a_proj_with_mqa(x), [L], axis=1)
        kv_row = op.concat([self.kv_a_layernorm(latent), k_rope], dim=1)     # [T, L+rope]
        mla_cache = op.tensor_ir_inplace_op(
            mla_append_kernel(L, rope, self.page_size, self.dtype, self.gpu), "mla_append",
            [mla_cache, kv_row, meta.page_table, meta.token_seq, meta.token_pos, index],
            inplace_indices=0,
            out=Tensor.placeholder(mla_cache.shape, mla_cache.dtype))

        # kv_b absorption: W_UK [H, nope, L], W_UV [H, v, L]
        w_uk, w_uv = op.split(op.reshape(self.kv_b_proj.weight, [H, nope + dv, L]), [nope], axis=1)
        q_lat = matmul_fp32acc(op.permute_dims(q_nope, [1, 0, 2]), w_uk)          # [H, T, L]
        q_lat = op.permute_dims(q_lat, [1, 0, 2])                            # [T, H, L]

        # latent causal attention over the paged cache (fp32 softmax)
        o_lat = op.tensor_ir_op(
            mla_attend_kernel(H, L, rope, self.page_size, self.scale, self.dtype, self.gpu), "mla_attend",
            [q_lat, q_rope, mla_cache, meta.page_table, meta.token_seq, meta.token_pos, index],
            out=Tensor.placeholder([n_tok, H, L], self.dtype))

        # attn[t,h] = W_UV[h] · o_lat[t,h]
        attn = matmul_fp32acc(op.permute_dims(o_lat, [1, 0, 2]), op.permute_dims(w_uv, [0, 2, 1]))
        attn = op.reshape(op.permute_dims(attn, [1, 0, 2]), [n_tok, H * dv])  # [T, H·v]

        # output gate attn · σ(g_proj x), then o_proj
        return self.o_proj(attn * op.sigmoid(self.g_proj(x))), mla_cache
