"""The typed Kimi K3 / Kimi Linear configuration.

One :class:`K3Config` is parsed from a checkpoint's ``config.json`` in either layout
(spec §1): K3 (``model_type: kimi_k3``, the text model under ``text_config``) or
Kimi Linear (``model_type: kimi_linear`` at top level). Defaults follow the public
K3 modeling code (mlx-lm ``kimi_k3.TextArgs``); derived values (0-based layer lists,
dense vs MoE layers, AttnRes block count) are properties.

Every problem raises :class:`ConfigError` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_TOP_LEVEL_TYPES = ("kimi_k3", "kimi_linear")
SUPPORTED_QUANT_FORMATS = ("mxfp4-pack-quantized",)
MXFP4_GROUP_SIZE = 32


class ConfigError(ValueError):
    """A config.json that is malformed, contradictory or unsupported.

    The message names the source file (when known) and the offending field.
    """


@dataclass(frozen=True)
class QuantConfig:
    """Weight quantization of the routed experts (spec §2).

    Attributes:
        format: ``"mxfp4-pack-quantized"`` (compressed-tensors) or ``None`` (bf16 experts).
        group_size: elements sharing one E8M0 scale (32 for MXFP4).
        ignore: compressed-tensors ignore patterns (``re:`` prefixed regexes) of modules kept
            in bf16.
    """

    format: str | None = None
    group_size: int = MXFP4_GROUP_SIZE
    ignore: tuple[str, ...] = ()

    @property
    def experts_mxfp4(self) -> bool:
        return self.format == "mxfp4-pack-quantized"


@dataclass(frozen=True)
class K3Config:
    """Every field of the K3 text model that the spec (§1–§3) uses.

    Sizes are element counts; ``*_layers_1based`` are the raw config lists
    (``linear_attn_config.kda_layers`` / ``full_attn_layers``, 1-based).
    """

    # -- model / tokens
    model_type: str = "kimi_k3"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    intermediate_size: int = 33792
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_ids: tuple[int, ...] = (163586,)
    pad_token_id: int | None = 163839
    dtype: str = "bfloat16"
    # -- activation (SiTU-GLU)
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # -- Block Attention Residuals
    attn_res_block_size: int = 12
    # -- Gated MLA
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    mla_layernorm_eps: float = 1e-6
    # -- KDA
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True
    kda_layers_1based: tuple[int, ...] = ()
    full_attn_layers_1based: tuple[int, ...] = ()
    # -- MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    # -- quantization
    quantization: QuantConfig = field(default_factory=QuantConfig)
    # -- where it came from (for messages)
    source: str = "<config>"

    # ------------------------------------------------------------------ derived
    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        """0-based indices of the KDA layers."""
        return tuple(i - 1 for i in self.kda_layers_1based)

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        """0-based indices of the Gated MLA layers."""
        return tuple(i - 1 for i in self.full_attn_layers_1based)

    def layer_kind(self, layer: int) -> str:
        """``"kda"`` or ``"mla"`` for 0-based ``layer``."""
        return "kda" if layer in self.kda_layer_ids else "mla"

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        kda = set(self.kda_layer_ids)
        return tuple("kda" if i in kda else "mla" for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        """True where 0-based ``layer`` has a MoE block (else the dense SiTU MLP)."""
        return (
            self.num_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i))

    @property
    def num_attn_res_blocks(self) -> int:
        """Number of AttnRes blocks: ceil(num_hidden_layers / attn_res_block_size) (spec §3)."""
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    @property
    def kda_dim(self) -> int:
        """H·K: width of the KDA q/k/v projections."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key width per head (nope + rope)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_dim(self) -> int:
        """Per-token MLA cache width: latent + shared k_rope (576 for K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Width the routed experts work in (LatentMoE); hidden_size when not latent."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def tensor_prefix(self) -> str:
        """Checkpoint name prefix: ``language_model.`` for K3, none for Kimi Linear."""
        return "language_model." if self.model_type == "kimi_k3" else ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["quantization"]["ignore"] = list(self.quantization.ignore)
        return d

    def summary_hash(self) -> str:
        """A stable hash of the fields that shape the compiled graph."""
        import hashlib

        d = self.to_dict()
        d.pop("source", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ parsing
    def runtime_size_error(self, max_batch_size: int, context_window: int,
                           prefill_chunk: int) -> str | None:
        """The first problem with the runtime sizes a library is compiled or loaded with (as
        the command-line flags that set them), or None: each must be >= 1 and the context
        window at most ``max_position_embeddings``."""
        for flag, v in (("--max-batch-size", max_batch_size), ("--context-window", context_window),
                        ("--prefill-chunk", prefill_chunk)):
            if v < 1:
                return f"{flag} must be >= 1, got {v}"
        if context_window > self.max_position_embeddings:
            return (f"--context-window {context_window} exceeds the model's maximum "
                    f"(max_position_embeddings {self.max_position_embeddings})")
        return None

    @classmethod
    def from_file(cls, path: str | Path) -> "K3Config":
        """Parse ``config.json`` (or a directory holding one).

        Raises:
            ConfigError: missing file, invalid JSON, or any validation failure.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<config>") -> "K3Config":
        """Parse a config dict in the K3 or Kimi Linear layout and validate it.

        Raises:
            ConfigError: unknown ``model_type``, missing/contradictory fields, unsupported
                quantization format.
        """
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object at top level")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_TOP_LEVEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; expected one of "
                f"{list(SUPPORTED_TOP_LEVEL_TYPES)}"
            )
        if model_type == "kimi_k3":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: model_type 'kimi_k3' needs a 'text_config' object")
            if text.get("model_type", "kimi_linear") != "kimi_linear":
                raise ConfigError(
                    f"{source}: text_config.model_type {text.get('model_type')!r} is not "
                    "supported; expected 'kimi_linear'"
                )
            where = "text_config."
        else:
            text = raw
            where = ""
        return _parse_text(raw, text, model_type, where, source)


_ABSENT_MEANS_OFF: dict[str, Any] = {
    "routed_expert_hidden_size": None,
    "latent_moe_use_norm": False,
    "mla_use_output_gate": False,
    "num_shared_experts": 0,
    "first_k_dense_replace": 0,
}


def _parse_text(raw: dict, text: dict, model_type: str, where: str, source: str) -> K3Config:
    defaults = K3Config()

    def get(name: str, typ: type | tuple = (int,), required: bool = False, obj=None, prefix=None):
        obj = text if obj is None else obj
        prefix = where if prefix is None else prefix
        if name not in obj or obj[name] is None:
            if required:
                raise ConfigError(f"{source}: missing required field '{prefix}{name}'")
            return None
        val = obj[name]
        types = typ if isinstance(typ, tuple) else (typ,)
        if float in types and isinstance(val, int) and not isinstance(val, bool):
            val = float(val)
        if bool not in types and isinstance(val, bool) or not isinstance(val, types):
            raise ConfigError(
                f"{source}: field '{prefix}{name}' = {val!r} has the wrong type; expected "
                + " or ".join(t.__name__ for t in types)
            )
        return val

    kw: dict[str, Any] = {"model_type": model_type, "source": source}
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim"):
        kw[name] = get(name, int, required=True)
    for name in ("intermediate_size", "max_position_embeddings", "num_key_value_heads",
                 "attn_res_block_size", "num_experts", "num_experts_per_token",
                 "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size",
                 "first_k_dense_replace", "moe_layer_freq", "num_expert_group", "topk_group"):
        v = get(name, int)
        if v is not None:
            kw[name] = v
    for name in ("rms_norm_eps", "activation_situ_beta", "activation_situ_linear_beta",
                 "routed_scaling_factor", "mla_layernorm_eps"):
        v = get(name, float)
        if v is not None:
            kw[name] = v
    for name in ("tie_word_embeddings", "mla_use_nope", "mla_use_output_gate",
                 "latent_moe_use_norm", "moe_renormalize", "use_grouped_topk"):
        v = get(name, bool)
        if v is not None:
            kw[name] = v
    for name in ("hidden_act", "moe_router_activation_func", "topk_method", "dtype"):
        v = get(name, str)
        if v is not None:
            kw[name] = v
    if "num_key_value_heads" not in kw:
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    # Feature fields whose absence means "feature off" in the public modeling code
    # (mlx-lm kimi_k3.TextArgs): a config without them is not a LatentMoE / gated / shared-
    # expert / dense-first model, whatever K3's own values are.
    for name, off in _ABSENT_MEANS_OFF.items():
        if name not in kw and text.get(name) is None:
            kw[name] = off

    # Token ids: text_config first, then top level.
    for name in ("bos_token_id", "pad_token_id"):
        v = get(name, int)
        if v is None:
            v = get(name, int, obj=raw, prefix="")
        kw[name] = v
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        kw["eos_token_ids"] = ()
    elif isinstance(eos, int) and not isinstance(eos, bool):
        kw["eos_token_ids"] = (eos,)
    elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        kw["eos_token_ids"] = tuple(eos)
    else:
        raise ConfigError(f"{source}: field '{where}eos_token_id' = {eos!r}: expected int or list of int")

    lac = text.get("linear_attn_config")
    if lac is None:
        raise ConfigError(f"{source}: missing required field '{where}linear_attn_config'")
    if not isinstance(lac, dict):
        raise ConfigError(f"{source}: field '{where}linear_attn_config' = {lac!r} has the wrong type; "
                          "expected an object")
    p = f"{where}linear_attn_config."
    kw["kda_num_heads"] = get("num_heads", int, required=True, obj=lac, prefix=p)
    kw["kda_head_dim"] = get("head_dim", int, required=True, obj=lac, prefix=p)
    v = get("short_conv_kernel_size", int, obj=lac, prefix=p)
    if v is not None:
        kw["short_conv_kernel_size"] = v
    kw["gate_lower_bound"] = get("gate_lower_bound", float, obj=lac, prefix=p)
    v = get("use_full_rank_gate", bool, obj=lac, prefix=p)
    if v is not None:
        kw["use_full_rank_gate"] = v
    for key, dest in (("kda_layers", "kda_layers_1based"), ("full_attn_layers", "full_attn_layers_1based")):
        lst = lac.get(key)
        if not isinstance(lst, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in lst):
            raise ConfigError(f"{source}: field '{p}{key}' must be a list of 1-based layer numbers")
        kw[dest] = tuple(lst)

    # Optional explicit products must agree with their factors.
    qk = get("qk_head_dim", int)
    if qk is not None and qk != kw["qk_nope_head_dim"] + kw["qk_rope_head_dim"]:
        raise ConfigError(
            f"{source}: field '{where}qk_head_dim' = {qk} != qk_nope_head_dim + qk_rope_head_dim "
            f"({kw['qk_nope_head_dim']} + {kw['qk_rope_head_dim']}): head dims do not add up"
        )
    pd = get("projection_dim", int, obj=lac, prefix=p)
    if pd is not None and pd != kw["kda_num_heads"] * kw["kda_head_dim"]:
        raise ConfigError(
            f"{source}: field '{p}projection_dim' = {pd} != num_heads × head_dim "
            f"({kw['kda_num_heads']} × {kw['kda_head_dim']}): head dims do not multiply out"
        )
    if kw.get("use_full_rank_gate") is False:
        raise ConfigError(f"{source}: field '{p}use_full_rank_gate' is false; K3's KDA needs the "
                          "full-rank gate (f_b_proj to num_heads × head_dim)")

    kw["quantization"] = _parse_quant(raw, text, where, source)
    cfg = K3Config(**kw)
    _validate(cfg, where, source)
    return cfg


def _parse_quant(raw: dict, text: dict, where: str, source: str) -> QuantConfig:
    # quantization_config may sit in text_config or at top level (spec §1 / k3-nano README).
    qc = text.get("quantization_config")
    qwhere = f"{where}quantization_config"
    if qc is None:
        qc = raw.get("quantization_config")
        qwhere = "quantization_config"
    if qc is None:
        return QuantConfig()
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: field '{qwhere}' must be an object")
    fmt = qc.get("format")
    method = qc.get("quant_method")
    if method not in (None, "compressed-tensors") or fmt not in SUPPORTED_QUANT_FORMATS:
        raise ConfigError(
            f"{source}: field '{qwhere}': quantization {method!r}/{fmt!r} is not supported; "
            f"expected quant_method 'compressed-tensors' with format one of "
            f"{list(SUPPORTED_QUANT_FORMATS)}"
        )
    group_size = MXFP4_GROUP_SIZE
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise ConfigError(f"{source}: field '{qwhere}.config_groups' must be an object")
    for gname, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights") or {}, dict):
            raise ConfigError(f"{source}: field '{qwhere}.config_groups.{gname}' must be an object "
                              "with a 'weights' object")
        w = group.get("weights") or {}
        gfmt = group.get("format", fmt)
        if gfmt not in SUPPORTED_QUANT_FORMATS:
            raise ConfigError(f"{source}: '{qwhere}.config_groups.{gname}.format' = {gfmt!r} is not supported")
        if w.get("num_bits", 4) != 4 or w.get("type", "float") != "float":
            raise ConfigError(
                f"{source}: '{qwhere}.config_groups.{gname}.weights' must be 4-bit float "
                f"(MXFP4); got num_bits={w.get('num_bits')!r} type={w.get('type')!r}"
            )
        gs = w.get("group_size", MXFP4_GROUP_SIZE)
        if gs != MXFP4_GROUP_SIZE:
            raise ConfigError(
                f"{source}: '{qwhere}.config_groups.{gname}.weights.group_size' = {gs!r}; "
                f"MXFP4 needs {MXFP4_GROUP_SIZE}"
            )
        group_size = gs
    ignore = qc.get("ignore") or []
    return QuantConfig(format=fmt, group_size=group_size, ignore=tuple(ignore))


def _validate(c: K3Config, where: str, source: str) -> None:
    def err(msg: str) -> ConfigError:
        return ConfigError(f"{source}: {msg}")

    p = f"{where}linear_attn_config."
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "kda_num_heads",
                 "kda_head_dim", "attn_res_block_size", "short_conv_kernel_size"):
        if getattr(c, name) <= 0:
            raise err(f"field '{where}{name}' must be positive, got {getattr(c, name)}")
    for name in ("rms_norm_eps", "mla_layernorm_eps"):
        if not getattr(c, name) > 0:
            raise err(f"field '{where}{name}' must be positive, got {getattr(c, name)}")
    if c.num_experts > 0 and c.moe_intermediate_size <= 0:
        raise err(f"field '{where}moe_intermediate_size' must be positive, got {c.moe_intermediate_size}")
    if c.first_k_dense_replace < 0:
        raise err(f"field '{where}first_k_dense_replace' must be >= 0, got {c.first_k_dense_replace}")
    if c.hidden_act != "situ":
        raise err(f"field '{where}hidden_act' = {c.hidden_act!r}; only 'situ' is supported")
    if c.moe_router_activation_func != "sigmoid":
        raise err(f"field '{where}moe_router_activation_func' = {c.moe_router_activation_func!r}; "
                  "only 'sigmoid' is supported")
    if not c.mla_use_nope:
        raise err(f"field '{where}mla_use_nope' is false; only NoPE MLA (K3) is supported")
    n = c.num_hidden_layers
    kda, full = list(c.kda_layers_1based), list(c.full_attn_layers_1based)
    for key, lst in (("kda_layers", kda), ("full_attn_layers", full)):
        bad = [i for i in lst if not 1 <= i <= n]
        if bad:
            raise err(f"field '{p}{key}' has layers {bad} outside 1..{n} (the lists are 1-based)")
        dup = sorted({i for i in lst if lst.count(i) > 1})
        if dup:
            raise err(f"field '{p}{key}' lists layers {dup} more than once")
    both = sorted(set(kda) & set(full))
    if both:
        raise err(f"layers {both} are in both '{p}kda_layers' and '{p}full_attn_layers'")
    neither = sorted(set(range(1, n + 1)) - set(kda) - set(full))
    if neither:
        raise err(f"layers {neither} (1-based) are in neither '{p}kda_layers' nor "
                  f"'{p}full_attn_layers'")
    if c.num_experts > 0:
        if not 1 <= c.num_experts_per_token <= c.num_experts:
            raise err(f"field '{where}num_experts_per_token' = {c.num_experts_per_token} must be in "
                      f"1..num_experts ({c.num_experts})")
        if c.num_expert_group < 1 or c.num_experts % c.num_expert_group:
            raise err(f"field '{where}num_expert_group' = {c.num_expert_group} must divide "
                      f"num_experts ({c.num_experts})")
        if c.num_expert_group != 1 or c.topk_group != 1:
            raise err(f"num_expert_group={c.num_expert_group}, topk_group={c.topk_group}: only "
                      "ungrouped routing (1, 1) as in K3 is supported")
        if c.moe_layer_freq < 1:
            raise err(f"field '{where}moe_layer_freq' must be >= 1")
        if c.quantization.experts_mxfp4:
            for name, dim in (("moe_intermediate_size", c.moe_intermediate_size),
                              ("routed_expert_hidden_size", c.latent_size)):
                if dim % c.quantization.group_size:
                    raise err(f"field '{where}{name}' = {dim} is not a multiple of the MXFP4 "
                              f"group size {c.quantization.group_size}")
    if c.num_key_value_heads != c.num_attention_heads:
        raise err(f"field '{where}num_key_value_heads' = {c.num_key_value_heads} must equal "
                  f"num_attention_heads ({c.num_attention_heads}) for MLA")
    if c.qk_rope_head_dim < 0:
        raise err(f"field '{where}qk_rope_head_dim' must be >= 0")
    for tok in ("bos_token_id", "pad_token_id"):
        v = getattr(c, tok)
        if v is not None and not 0 <= v < c.vocab_size:
            raise err(f"field '{tok}' = {v} is outside the vocabulary (0..{c.vocab_size - 1})")
    for e in c.eos_token_ids:
        if not 0 <= e < c.vocab_size:
            raise err(f"field 'eos_token_id' has {e}, outside the vocabulary (0..{c.vocab_size - 1})")
