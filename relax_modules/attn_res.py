"""Block Attention Residuals (spec §3 "Block Attention Residuals"; arXiv 2603.15031).

Formula (spec §3; checked against mlx-lm ``_attn_res_combine`` and fla
``fla/ops/attnres/naive.py::naive_attnres``; all scoring in fp32):

    candidates v = [blocks…, partial]                      each [T, hidden], model dtype
    score_i = Σ_d (v_i · rsqrt(mean(v_i²) + eps)) ⊙ w ⊙ p  → [T]    (w = *_res_norm.weight,
                                                                      p = *_res_proj.weight[0])
    prob    = softmax_i(score)                             over the candidates, fp32
    h       = Σ_i prob_i · v_i                             of the **raw** v_i, fp32 → model dtype

eps is ``rms_norm_eps`` (mlx-lm passes ``args.rms_norm_eps``). With no blocks the result is
``partial`` itself (a softmax over one candidate).

Parameter naming: the *parent* module owns the two parameters (so they get the checkpoint
names ``self_attention_res_norm.weight`` [hidden], ``self_attention_res_proj.weight`` [1, hidden],
``mlp_res_*``, ``output_attn_res_*``): declare them with :class:`AttnResNorm` /
:class:`AttnResProj` (or any module with a ``weight``), and bind them with :class:`AttnRes`, a
plain Python object (not an ``nn.Module``) that adds no parameter names.

Per-layer bookkeeping (spec §3 steps 1–4) is :class:`BlockResiduals`, a trace-time Python
object carrying the list of block snapshots and the running partial sum:

    res = BlockResiduals(embeddings)                 # P = embeddings, no blocks
    for ℓ, layer in enumerate(layers):
        h = res.before_attention(ℓ, B, layer.attn_res)    # 1. mix; 2. ℓ mod B == 0: close block
        res.add(attn(input_layernorm(h)))                 # 3. P = P + a  (or a)
        h = res.mix(layer.mlp_res)                        # 4. mix
        res.add(mlp(post_attention_layernorm(h)))         #    P = P + m
    h = res.mix(output_attn_res)                          # then model.norm, lm_head
"""

from __future__ import annotations

from typing import Sequence

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from .layers import mean_last, rsqrt

__all__ = ["AttnResNorm", "AttnResProj", "AttnRes", "attn_res_mix", "BlockResiduals"]


class AttnResNorm(nn.Module):
    """Holds ``*_res_norm.weight [hidden]`` (model dtype). Not applied on its own."""

    def __init__(self, hidden_size: int, dtype: str = "float32"):
        self.weight = nn.Parameter((hidden_size,), dtype=dtype)


class AttnResProj(nn.Module):
    """Holds ``*_res_proj.weight [1, hidden]`` (model dtype): the pseudo-query row."""

    def __init__(self, hidden_size: int, dtype: str = "float32"):
        self.weight = nn.Parameter((1, hidden_size), dtype=dtype)


def attn_res_mix(blocks: Sequence[Tensor], partial: Tensor, norm_weight: Tensor,
                 proj_weight: Tensor, eps: float) -> Tensor:
    """``AttnRes_{w,p}(blocks, partial)`` → ``h [T, hidden]`` in ``partial``'s dtype.

    ``blocks``: list of ``[T, hidden]``; ``partial``: ``[T, hidden]``; ``norm_weight [hidden]``;
    ``proj_weight [1, hidden]``.
    """
    if not blocks:
        return partial
    hidden = partial.shape[-1]
    # w ⊙ p, fp32 (mlx-lm: w_eff = norm.weight.astype(f32) * proj.weight.reshape(-1))
    w_eff = op.astype(norm_weight, "float32") * op.astype(op.reshape(proj_weight, [hidden]), "float32")
    candidates = [op.astype(v, "float32") for v in (*blocks, partial)]
    # score_i = Σ (v_i · rsqrt(mean(v_i²) + eps)) ⊙ w ⊙ p        → [T, 1] each
    scores = [op.sum(v * rsqrt(mean_last(v * v) + eps) * w_eff, axis=-1, keepdims=True)
              for v in candidates]
    prob = op.softmax(op.concat(scores, dim=-1), axis=-1)                    # [T, n] fp32
    probs = op.split(prob, len(candidates), axis=-1)                         # n × [T, 1]
    h = candidates[0] * probs[0]
    for v, p_i in zip(candidates[1:], probs[1:]):
        h = h + v * p_i                                                      # raw v_i, fp32
    return op.astype(h, partial.dtype)


class AttnRes:
    """One AttnRes site bound to its parent-named parameters (no parameters of its own).

    ``AttnRes(self.self_attention_res_norm, self.self_attention_res_proj, eps)(blocks, partial)``
    """

    def __init__(self, norm: nn.Module, proj: nn.Module, eps: float):
        self.norm = norm
        self.proj = proj
        self.eps = eps

    def __call__(self, blocks: Sequence[Tensor], partial: Tensor) -> Tensor:
        return attn_res_mix(blocks, partial, self.norm.weight, self.proj.weight, self.eps)


class BlockResiduals:
    """Trace-time bookkeeping of Block AttnRes (spec §3 steps 1–4).

    Attributes:
        blocks: completed block snapshots, each ``[T, hidden]`` model dtype.
        partial: running partial sum ``P`` (``None`` right after a block is closed).
    """

    def __init__(self, embeddings: Tensor):
        self.blocks: list[Tensor] = []
        self.partial: Tensor | None = embeddings      # the embeddings enter as P at layer 0

    def mix(self, site: AttnRes) -> Tensor:
        """``h = AttnRes(blocks, P)`` (identity with no blocks)."""
        assert self.partial is not None, "mix() with an empty partial sum"
        return site(self.blocks, self.partial)

    def before_attention(self, layer_idx: int, block_size: int, site: AttnRes) -> Tensor:
        """Steps 1–2: ``h = AttnRes_attn(blocks, P)``; if ℓ mod B == 0 append P, P = empty."""
        h = self.mix(site)
        if layer_idx % block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None
        return h

    def add(self, x: Tensor) -> None:
        """``P = P + x`` (or ``x`` if P is empty) — steps 3 and 4."""
        self.partial = x if self.partial is None else self.partial + x
