"""K3Config against the real K3 config.json, k3-nano's README and spec §1."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from k3_compile.config import ConfigError, K3Config
from k3_compile.tensors import active_parameters, parameter_counts

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "models" / "k3-nano"
REAL = Path("/work/shared/reference-configs/kimi-k3.config.json")
if not REAL.is_file():  # the shared tree sits beside the checkout
    REAL = ROOT.parent / "shared" / "reference-configs" / "kimi-k3.config.json"

real_only = pytest.mark.skipif(not REAL.is_file(), reason="reference K3 config not available")


def real_raw() -> dict:
    return json.loads(REAL.read_text())


def nano_raw() -> dict:
    return json.loads((NANO / "config.json").read_text())


# ----------------------------------------------------------------------------- real K3
@real_only
def test_real_k3_layers():
    c = K3Config.from_file(REAL)
    assert c.model_type == "kimi_k3" and c.tensor_prefix == "language_model."
    assert c.num_hidden_layers == 93 and c.hidden_size == 7168 and c.vocab_size == 163840
    # spec §1: KDA at 0-based {0,1,2, 4,5,6, ..., 88,89,90}, MLA at {3, 7, ..., 87, 91, 92}
    kda = [i for i in range(91) if i % 4 != 3]
    mla = [i for i in range(88) if i % 4 == 3] + [91, 92]
    assert list(c.kda_layer_ids) == kda and len(kda) == 69
    assert list(c.mla_layer_ids) == mla and len(mla) == 24
    assert c.layer_kinds[:5] == ("kda", "kda", "kda", "mla", "kda")
    assert c.layer_kinds[-3:] == ("kda", "mla", "mla")
    assert c.num_attn_res_blocks == 8
    assert c.dense_layer_ids == (0,) and c.moe_layer_ids == tuple(range(1, 93))
    assert c.kda_dim == 12288 and c.qk_head_dim == 192 and c.mla_cache_dim == 576
    assert c.latent_size == 3584 and c.shared_expert_intermediate_size == 6144
    assert c.quantization.experts_mxfp4 and c.quantization.group_size == 32
    assert c.gate_lower_bound == -5.0 and c.mla_layernorm_eps == 1e-6


@real_only
def test_real_k3_parameter_count():
    c = K3Config.from_file(REAL)
    total = parameter_counts(c)["total"]
    assert abs(total - 2.78e12) / 2.78e12 < 0.01  # spec §1 / model card: 2.78T
    assert abs(active_parameters(c) - 104e9) / 104e9 < 0.005  # model card: 104B active


@real_only
def test_kimi_linear_layout_parses_to_same_config(tmp_path):
    raw = real_raw()
    flat = copy.deepcopy(raw["text_config"])  # same fields at top level, model_type kimi_linear
    p = tmp_path / "config.json"
    p.write_text(json.dumps(flat))
    k3 = K3Config.from_file(REAL).to_dict()
    kl = K3Config.from_file(p)
    assert kl.model_type == "kimi_linear" and kl.tensor_prefix == ""
    d = kl.to_dict()
    for x in (k3, d):
        x.pop("model_type")
        x.pop("source")
    assert d == k3


# ----------------------------------------------------------------------------- k3-nano
def test_k3_nano_values():
    c = K3Config.from_file(NANO)  # a directory works
    assert c.source.endswith("k3-nano/config.json")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.max_position_embeddings) == (8192, 256, 8, 8192)
    assert c.kda_layer_ids == (0, 1, 2, 4, 5, 6) and c.mla_layer_ids == (3, 7)
    assert (c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size) == (2, 128, 4)
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (4, 128, 64)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (64, 32, 64)
    assert (c.num_experts, c.num_experts_per_token, c.moe_intermediate_size) == (32, 4, 256)
    assert (c.routed_expert_hidden_size, c.num_shared_experts, c.intermediate_size) == (128, 1, 768)
    assert c.attn_res_block_size == 2 and c.num_attn_res_blocks == 4
    assert c.dense_layer_ids == (0,) and len(c.moe_layer_ids) == 7
    assert (c.bos_token_id, c.eos_token_ids, c.pad_token_id) == (8184, (8185,), 8191)
    assert c.quantization.format == "mxfp4-pack-quantized"
    assert "re:.*lm_head.*" in c.quantization.ignore
    assert round(parameter_counts(c)["total"] / 1e6, 2) == 31.63  # README: 31.6M parameters


def test_absent_feature_fields_follow_modeling_code():
    raw = nano_raw()
    for k in ("routed_expert_hidden_size", "latent_moe_use_norm", "num_shared_experts",
              "first_k_dense_replace", "mla_use_output_gate"):
        del raw["text_config"][k]
    c = K3Config.from_dict(raw)
    assert c.routed_expert_hidden_size is None and c.latent_size == 256
    assert not c.latent_moe_use_norm and not c.mla_use_output_gate
    assert c.num_shared_experts == 0 and c.dense_layer_ids == ()


# ----------------------------------------------------------------------------- bad configs
def _bad(raw: dict, match: str):
    with pytest.raises(ConfigError, match=match):
        K3Config.from_dict(raw, source="bad/config.json")


def test_unknown_model_type():
    raw = nano_raw()
    raw["model_type"] = "deepseek_v3"
    _bad(raw, r"bad/config\.json: model_type 'deepseek_v3' is not supported; expected one of \['kimi_k3', 'kimi_linear'\]")


def test_k3_without_text_config():
    raw = nano_raw()
    del raw["text_config"]
    _bad(raw, r"model_type 'kimi_k3' needs a 'text_config' object")


def test_missing_required_field():
    raw = nano_raw()
    del raw["text_config"]["hidden_size"]
    _bad(raw, r"bad/config\.json: missing required field 'text_config\.hidden_size'")
    raw = nano_raw()
    del raw["text_config"]["linear_attn_config"]["num_heads"]
    _bad(raw, r"missing required field 'text_config\.linear_attn_config\.num_heads'")


def test_layer_in_both_lists():
    raw = nano_raw()
    raw["text_config"]["linear_attn_config"]["kda_layers"].append(4)
    _bad(raw, r"layers \[4\] are in both 'text_config\.linear_attn_config\.kda_layers' and "
              r"'text_config\.linear_attn_config\.full_attn_layers'")


def test_layer_in_neither_list():
    raw = nano_raw()
    raw["text_config"]["linear_attn_config"]["kda_layers"].remove(6)
    _bad(raw, r"layers \[6\] \(1-based\) are in neither 'text_config\.linear_attn_config\.kda_layers' nor")


def test_zero_based_or_out_of_range_layer():
    raw = nano_raw()
    lac = raw["text_config"]["linear_attn_config"]
    lac["kda_layers"] = [0, 1, 2, 4, 5, 6]  # written 0-based by mistake
    lac["full_attn_layers"] = [3, 7]
    _bad(raw, r"field 'text_config\.linear_attn_config\.kda_layers' has layers \[0\] outside 1\.\.8 "
              r"\(the lists are 1-based\)")
    raw = nano_raw()
    raw["text_config"]["linear_attn_config"]["full_attn_layers"] = [4, 8, 9]
    _bad(raw, r"'text_config\.linear_attn_config\.full_attn_layers' has layers \[9\] outside 1\.\.8")


def test_top_k_more_than_experts():
    raw = nano_raw()
    raw["text_config"]["num_experts_per_token"] = 33
    _bad(raw, r"field 'text_config\.num_experts_per_token' = 33 must be in 1\.\.num_experts \(32\)")


def test_qk_head_dim_not_sum():
    raw = nano_raw()
    raw["text_config"]["qk_head_dim"] = 64
    _bad(raw, r"field 'text_config\.qk_head_dim' = 64 != qk_nope_head_dim \+ qk_rope_head_dim \(64 \+ 32\)")


def test_unsupported_quantization():
    raw = nano_raw()
    raw["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"
    _bad(raw, r"field 'text_config\.quantization_config': quantization 'compressed-tensors'/"
              r"'nvfp4-pack-quantized' is not supported")
    raw = nano_raw()
    raw["text_config"]["quantization_config"] = {"quant_method": "fp8", "format": "mxfp4-pack-quantized"}
    _bad(raw, r"quantization 'fp8'/'mxfp4-pack-quantized' is not supported")
    raw = nano_raw()
    raw["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    _bad(raw, r"'text_config\.quantization_config\.config_groups\.group_0\.weights\.group_size' = 16; MXFP4 needs 32")
    raw = nano_raw()
    raw["text_config"]["quantization_config"]["config_groups"]["group_0"] = None
    _bad(raw, r"'text_config\.quantization_config\.config_groups\.group_0' must be an object")


def test_wrong_field_type():
    raw = nano_raw()
    raw["text_config"]["hidden_size"] = "256"
    _bad(raw, r"field 'text_config\.hidden_size' = '256' has the wrong type; expected int")
    raw = nano_raw()
    raw["text_config"]["moe_renormalize"] = 1
    _bad(raw, r"field 'text_config\.moe_renormalize' = 1 has the wrong type; expected bool")
    raw = nano_raw()
    raw["text_config"]["linear_attn_config"] = [1, 2]
    _bad(raw, r"field 'text_config\.linear_attn_config' = \[1, 2\] has the wrong type; expected an object")
    raw = nano_raw()
    raw["text_config"]["linear_attn_config"]["kda_layers"] = "1,2,3"
    _bad(raw, r"field 'text_config\.linear_attn_config\.kda_layers' must be a list of 1-based layer numbers")


def test_invalid_json_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"model_type": "kimi_k3",')
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON \("):
        K3Config.from_file(p)
    with pytest.raises(ConfigError, match=r"no such config file"):
        K3Config.from_file(tmp_path / "nope")
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"expected a JSON object at top level"):
        K3Config.from_file(p)
