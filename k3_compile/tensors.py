"""The checkpoint tensor list a :class:`~k3_compile.config.K3Config` implies (spec §1).

This is the single contract between the checkpoint reader, ``k3 inspect`` (parameter
counts), the converter and the Relax model: every name, shape, dtype and the component
it belongs to. Names are given without the checkpoint prefix (``language_model.`` in K3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .config import K3Config

BF16, F32, U8 = "bfloat16", "float32", "uint8"


@dataclass(frozen=True)
class TensorSpec:
    """One expected checkpoint tensor.

    Attributes:
        name: checkpoint name without prefix, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        shape: expected shape.
        dtype: ``"bfloat16"``, ``"float32"`` or ``"uint8"``.
        component: ``embedding``, ``lm_head``, ``norm``, ``attn_res``, ``kda``, ``mla``,
            ``dense_mlp``, ``router``, ``latent_proj``, ``shared_experts``, ``routed_experts``.
        num_params: logical parameters (for MXFP4 ``weight_packed``: 2 per byte; scales: 0).
        min_leading: if set, dim 0 may be any size >= this (``A_log`` is stored zero-padded,
            [128] for K3's 96 heads); only the first ``min_leading`` entries are used.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    component: str
    num_params: int
    min_leading: int | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * {BF16: 2, F32: 4, U8: 1}[self.dtype]

    def accepts_shape(self, shape: tuple[int, ...]) -> bool:
        shape = tuple(shape)
        if shape == self.shape:
            return True
        if self.min_leading is not None and len(shape) == len(self.shape):
            return shape[0] >= self.min_leading and shape[1:] == self.shape[1:]
        return False


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _t(name, shape, dtype, comp, params=None, min_leading=None) -> TensorSpec:
    shape = tuple(shape)
    return TensorSpec(name, shape, dtype, comp, _numel(shape) if params is None else params, min_leading)


def _mlp(prefix: str, hidden: int, inter: int, comp: str) -> Iterator[TensorSpec]:
    yield _t(f"{prefix}.gate_proj.weight", (inter, hidden), BF16, comp)
    yield _t(f"{prefix}.up_proj.weight", (inter, hidden), BF16, comp)
    yield _t(f"{prefix}.down_proj.weight", (hidden, inter), BF16, comp)


def _expert_linear(prefix: str, out_f: int, in_f: int, c: K3Config) -> Iterator[TensorSpec]:
    if c.quantization.experts_mxfp4:
        gs = c.quantization.group_size
        yield _t(f"{prefix}.weight_packed", (out_f, in_f // 2), U8, "routed_experts", out_f * in_f)
        yield _t(f"{prefix}.weight_scale", (out_f, in_f // gs), U8, "routed_experts", 0)
    else:
        yield _t(f"{prefix}.weight", (out_f, in_f), BF16, "routed_experts")


def layer_tensors(c: K3Config, i: int) -> Iterator[TensorSpec]:
    """The tensors of 0-based layer ``i``."""
    h = c.hidden_size
    p = f"model.layers.{i}"
    for n in ("input_layernorm", "post_attention_layernorm"):
        yield _t(f"{p}.{n}.weight", (h,), BF16, "norm")
    for n in ("self_attention_res_norm", "mlp_res_norm"):
        yield _t(f"{p}.{n}.weight", (h,), BF16, "attn_res")
    for n in ("self_attention_res_proj", "mlp_res_proj"):
        yield _t(f"{p}.{n}.weight", (1, h), BF16, "attn_res")
    a = f"{p}.self_attn"
    if c.layer_kind(i) == "kda":
        d, hk, k = c.kda_dim, c.kda_num_heads, c.kda_head_dim
        for n in ("q", "k", "v"):
            yield _t(f"{a}.{n}_proj.weight", (d, h), BF16, "kda")
        for n in ("q", "k", "v"):
            yield _t(f"{a}.{n}_conv1d.weight", (d, 1, c.short_conv_kernel_size), F32, "kda")
        yield _t(f"{a}.f_a_proj.weight", (k, h), BF16, "kda")
        yield _t(f"{a}.f_b_proj.weight", (d, k), BF16, "kda")
        yield _t(f"{a}.b_proj.weight", (hk, h), BF16, "kda")
        yield _t(f"{a}.A_log", (hk,), F32, "kda", hk, min_leading=hk)
        yield _t(f"{a}.dt_bias", (d,), F32, "kda")
        yield _t(f"{a}.o_norm.weight", (c.kda_head_dim,), F32, "kda")
        yield _t(f"{a}.g_proj.weight", (d, h), BF16, "kda")
        yield _t(f"{a}.o_proj.weight", (h, d), BF16, "kda")
    else:
        nh = c.num_attention_heads
        yield _t(f"{a}.q_a_proj.weight", (c.q_lora_rank, h), BF16, "mla")
        yield _t(f"{a}.q_a_layernorm.weight", (c.q_lora_rank,), BF16, "mla")
        yield _t(f"{a}.q_b_proj.weight", (nh * c.qk_head_dim, c.q_lora_rank), BF16, "mla")
        yield _t(f"{a}.kv_a_proj_with_mqa.weight", (c.mla_cache_dim, h), BF16, "mla")
        yield _t(f"{a}.kv_a_layernorm.weight", (c.kv_lora_rank,), BF16, "mla")
        yield _t(f"{a}.kv_b_proj.weight", (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), BF16, "mla")
        yield _t(f"{a}.g_proj.weight", (nh * c.v_head_dim, h), BF16, "mla")
        yield _t(f"{a}.o_proj.weight", (h, nh * c.v_head_dim), BF16, "mla")
    if not c.is_moe_layer(i):
        yield from _mlp(f"{p}.mlp", h, c.intermediate_size, "dense_mlp")
        return
    m = f"{p}.block_sparse_moe"
    lat = c.latent_size
    yield _t(f"{m}.gate.weight", (c.num_experts, h), BF16, "router")
    yield _t(f"{m}.gate.e_score_correction_bias", (c.num_experts,), F32, "router")
    if c.routed_expert_hidden_size:
        yield _t(f"{m}.routed_expert_down_proj.weight", (lat, h), BF16, "latent_proj")
        if c.latent_moe_use_norm:
            yield _t(f"{m}.routed_expert_norm.weight", (lat,), BF16, "latent_proj")
        yield _t(f"{m}.routed_expert_up_proj.weight", (h, lat), BF16, "latent_proj")
    if c.num_shared_experts:
        yield from _mlp(f"{m}.shared_experts", h, c.shared_expert_intermediate_size, "shared_experts")
    for e in range(c.num_experts):
        ep = f"{m}.experts.{e}"
        yield from _expert_linear(f"{ep}.w1", c.moe_intermediate_size, lat, c)
        yield from _expert_linear(f"{ep}.w2", lat, c.moe_intermediate_size, c)
        yield from _expert_linear(f"{ep}.w3", c.moe_intermediate_size, lat, c)


def head_tensors(c: K3Config) -> Iterator[TensorSpec]:
    """The tensors before the layers: the token embedding."""
    yield _t("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), BF16, "embedding")


def tail_tensors(c: K3Config) -> Iterator[TensorSpec]:
    """The tensors after the layers: AttnRes output mix, final norm, lm_head."""
    h = c.hidden_size
    yield _t("model.norm.weight", (h,), BF16, "norm")
    yield _t("model.output_attn_res_norm.weight", (h,), BF16, "attn_res")
    yield _t("model.output_attn_res_proj.weight", (1, h), BF16, "attn_res")
    if not c.tie_word_embeddings:
        yield _t("lm_head.weight", (c.vocab_size, h), BF16, "lm_head")


def expected_tensors(c: K3Config) -> Iterator[TensorSpec]:
    """Every tensor of the text model, in checkpoint order (embeddings, layers, head).

    For the real K3 config this yields 497,052 specs lazily (896 experts × 3 × 2 = 5,376 per
    MoE layer × 92 layers, plus ~2,500 others);
    iterate, do not materialize, where memory matters.
    """
    yield from head_tensors(c)
    for i in range(c.num_hidden_layers):
        yield from layer_tensors(c, i)
    yield from tail_tensors(c)


def _sum_by(c: K3Config, key) -> dict[str, int]:
    """Sum ``key(spec) -> (bucket, amount)`` over all tensors, one layer of each kind walked."""
    out: dict[str, int] = {}

    def add(spec):
        bucket, amount = key(spec)
        out[bucket] = out.get(bucket, 0) + amount

    for s in head_tensors(c):
        add(s)
    for s in tail_tensors(c):
        add(s)
    per_kind: dict[tuple[str, bool], dict[str, int]] = {}
    for i in range(c.num_hidden_layers):
        kind = (c.layer_kind(i), c.is_moe_layer(i))
        if kind not in per_kind:
            per: dict[str, int] = {}
            for s in layer_tensors(c, i):
                bucket, amount = key(s)
                per[bucket] = per.get(bucket, 0) + amount
            per_kind[kind] = per
        for bucket, amount in per_kind[kind].items():
            out[bucket] = out.get(bucket, 0) + amount
    return out


def parameter_counts(c: K3Config) -> dict[str, int]:
    """Logical parameter count per component, plus ``total`` (spec §1: K3 ≈ 2.78T)."""
    counts = _sum_by(c, lambda s: (s.component, s.num_params))
    counts["total"] = sum(counts.values())
    return counts


def bytes_by_dtype(c: K3Config) -> dict[str, int]:
    """Checkpoint bytes per stored dtype (``bfloat16``, ``float32``, ``uint8``)."""
    return _sum_by(c, lambda s: (s.dtype, s.nbytes))


def active_parameters(c: K3Config) -> int:
    """Parameters a token multiplies with: all but the unchosen routed experts and the
    embedding table (a token reads one row of it), the convention of the model card's
    "104B active" (K3 gives 104.19B)."""
    counts = parameter_counts(c)
    routed = counts.get("routed_experts", 0)
    if c.num_experts:
        routed = routed * c.num_experts_per_token // c.num_experts
    return counts["total"] - counts.get("routed_experts", 0) + routed - counts.get("embedding", 0)
