"""The mlx-lm ``kimi_k3`` oracle (spec: independent implementations) and tiny random checkpoints.

mlx-lm 0.32.2 reads a K3 checkpoint directory natively (compressed-tensors MXFP4 experts
included). These helpers run it on the CPU in float32 (all bf16 parameters upcast) or as
loaded (bf16), for all-position logits and greedy decoding through its own KV/SSM cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def load_mlx(model_dir: str | Path, dtype: str = "float32"):
    """Load ``model_dir`` with mlx-lm; ``dtype="float32"`` upcasts every bf16 parameter."""
    import mlx.core as mx
    import mlx.utils
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    if dtype == "float32":
        params = mlx.utils.tree_map(
            lambda p: p.astype(mx.float32) if p.dtype == mx.bfloat16 else p, model.parameters()
        )
        model.update(params)
        mx.eval(model.parameters())
    return model


def mlx_logits(model, ids) -> np.ndarray:
    """All-position logits ``[T, vocab]`` float32 of one sequence, full forward (no cache)."""
    import mlx.core as mx

    out = model(mx.array([list(ids)]))
    return np.array(out[0].astype(mx.float32))


def mlx_greedy(model, ids, n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, using mlx-lm's incremental cache path."""
    import mlx.core as mx

    cache = model.make_cache()
    logits = model(mx.array([list(ids)]), cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


def tiny_config(**over) -> dict:
    """A small random K3 config (K3 layout: text_config + top-level quantization_config)."""
    text = {
        "model_type": "kimi_linear",
        "vocab_size": 97,
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "linear_attn_config": {
            "full_attn_layers": [3, 5],
            "kda_layers": [1, 2, 4],
            "head_dim": 32,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_attention_heads": 3,
        "num_key_value_heads": 3,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 7,
        "num_experts_per_token": 3,
        "moe_intermediate_size": 64,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "intermediate_size": 96,
        "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    text.update(over)
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                      "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                  "strategy": "group", "symmetric": True}}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*"],
    }
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "text_config": text, "quantization_config": quant}


def write_random_checkpoint(out_dir: str | Path, raw_config: dict, seed: int = 0,
                            scale: float = 0.08) -> Path:
    """Write ``config.json`` + one safetensors shard of random weights in the K3 format.

    bf16 tensors ~ N(0, scale) (norm weights ~ 1 + N(0, 0.1)); MXFP4 experts as random
    E2M1 codes with E8M0 scales near 2^-4; A_log, dt_bias, conv weights float32.
    """
    import ml_dtypes
    from safetensors.numpy import save_file

    from k3_compile.config import K3Config
    from k3_compile.tensors import expected_tensors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw_config, indent=1))
    cfg = K3Config.from_dict(raw_config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for spec in expected_tensors(cfg):
        name = spec.name
        if spec.dtype == "uint8":
            if name.endswith("weight_packed"):
                arr = rng.integers(0, 256, size=spec.shape, dtype=np.uint8)
            else:
                arr = rng.integers(121, 125, size=spec.shape, dtype=np.uint8)
        elif name.endswith("A_log"):
            arr = np.log(rng.uniform(1.0, 16.0, size=spec.shape)).astype(np.float32)
        elif name.endswith("dt_bias"):
            arr = rng.normal(0, 0.5, size=spec.shape).astype(np.float32)
        elif name.endswith("e_score_correction_bias"):
            arr = rng.normal(0, 0.05, size=spec.shape).astype(np.float32)
        elif "norm" in name.rsplit(".", 2)[-2] or name.endswith("o_norm.weight"):
            arr = (1.0 + rng.normal(0, 0.1, size=spec.shape)).astype(np.float32)
        elif "conv1d" in name:
            arr = rng.normal(0, 0.3, size=spec.shape).astype(np.float32)
        elif name.endswith("res_proj.weight"):
            arr = rng.normal(0, 0.5, size=spec.shape).astype(np.float32)
        else:
            arr = rng.normal(0, scale, size=spec.shape).astype(np.float32)
        if spec.dtype == "bfloat16":
            arr = arr.astype(ml_dtypes.bfloat16)
        tensors[cfg.tensor_prefix + name] = np.ascontiguousarray(arr)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
