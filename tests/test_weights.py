"""CheckpointReader on k3-nano (real files) and on small synthetic checkpoints written with
safetensors' own writer (the independent source of the file format)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3_compile.config import K3Config
from k3_compile.tensors import expected_tensors
from k3_compile.weights import CheckpointError, CheckpointReader, MissingTensorError

NANO = Path(__file__).resolve().parents[1] / "models" / "k3-nano"
PREFIX = "language_model."


# ----------------------------------------------------------------------------- helpers
def tiny_config_dict(kimi_linear: bool = False, **text_overrides) -> dict:
    """A 3-layer K3 config (KDA, KDA, MLA; layer 0 dense) small enough to write in ms."""
    raw = json.loads((NANO / "config.json").read_text())
    text = raw["text_config"]
    text.update(
        vocab_size=128, hidden_size=64, num_hidden_layers=3, intermediate_size=96,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=4,
        num_experts_per_token=2, moe_intermediate_size=64, routed_expert_hidden_size=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    text["linear_attn_config"].update(kda_layers=[1, 2], full_attn_layers=[3], num_heads=2, head_dim=32)
    text.update(text_overrides)
    if kimi_linear:
        return text
    raw.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    raw["text_config"] = text
    return raw


def tiny_config(**kw) -> K3Config:
    return K3Config.from_dict(tiny_config_dict(**kw), source="tiny/config.json")


def make_tensors(cfg: K3Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors with exactly the names/shapes/dtypes the config implies."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in expected_tensors(cfg):
        if s.dtype == "uint8":
            out[s.name] = rng.integers(0, 256, s.shape, dtype=np.uint8)
        else:
            a = rng.standard_normal(s.shape).astype(np.float32)
            out[s.name] = a if s.dtype == "float32" else a.astype(ml_dtypes.bfloat16)
    return out


def _torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def write_checkpoint(d: Path, tensors: dict[str, np.ndarray], prefix: str = PREFIX,
                     shards: int = 2, index: bool = True, config: dict | None = None) -> Path:
    """Write ``tensors`` as ``shards`` safetensors files (+ index) with safetensors.torch."""
    d.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({prefix + n: _torch(tensors[n]) for n in part}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({prefix + n: fname for n in part})
    if index:
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture
def tiny(tmp_path):
    cfg = tiny_config()
    tensors = make_tensors(cfg)
    return cfg, tensors, tmp_path / "ckpt"


# ----------------------------------------------------------------------------- k3-nano
def test_k3_nano_validates():
    cfg = K3Config.from_file(NANO)
    r = CheckpointReader(NANO, cfg)
    r.validate()
    assert [f.name for f in r.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert r.prefix == PREFIX and r.num_tensors == 1556 and r.foreign_names == []
    assert r.num_tensors == sum(1 for _ in expected_tensors(cfg))


@pytest.mark.parametrize("name", [
    "model.embed_tokens.weight",
    "model.layers.1.self_attn.A_log",
    "model.layers.3.self_attn.kv_b_proj.weight",
    "model.layers.7.block_sparse_moe.experts.31.w2.weight_packed",
    "model.layers.2.block_sparse_moe.gate.e_score_correction_bias",
])
def test_k3_nano_get_matches_safetensors_torch(name):
    r = CheckpointReader(NANO, K3Config.from_file(NANO))
    ours = r.get(name)
    _, _, shard = r.info(name)
    with safe_open(str(shard), "pt") as f:
        ref = f.get_tensor(PREFIX + name)
    assert tuple(ours.shape) == tuple(ref.shape)
    if ref.dtype == torch.bfloat16:
        assert ours.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(np.asarray(ours).view(np.uint16), ref.view(torch.int16).numpy().view(np.uint16))
    else:
        assert str(ours.dtype) == str(ref.dtype).replace("torch.", "")
        np.testing.assert_array_equal(ours, ref.numpy())
    assert r.get(PREFIX + name).shape == ours.shape  # prefixed name accepted too


def test_get_missing_tensor():
    r = CheckpointReader(NANO, K3Config.from_file(NANO))
    with pytest.raises(MissingTensorError, match=r"no tensor 'model\.nope\.weight'") as ei:
        r.get("model.nope.weight")
    assert isinstance(ei.value, KeyError) and isinstance(ei.value, CheckpointError)


# ----------------------------------------------------------------------------- good synthetic
@pytest.mark.parametrize("index,shards", [(True, 2), (False, 2), (False, 1)])
def test_tiny_checkpoint_validates(tiny, index, shards):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors, index=index, shards=shards)
    r = CheckpointReader(d, cfg)
    r.validate()
    assert len(r.files) == shards and r.num_tensors == len(tensors)
    name = "model.layers.2.block_sparse_moe.experts.3.w1.weight_scale"
    got = r.get(name)
    assert type(got) is np.ndarray and not got.flags.writeable  # read-only memory map
    np.testing.assert_array_equal(got, tensors[name])
    np.testing.assert_array_equal(np.asarray(r.get("model.norm.weight")).view(np.uint16),
                                  tensors["model.norm.weight"].view(np.uint16))


def test_kimi_linear_layout_without_prefix(tmp_path):
    cfg = K3Config.from_dict(tiny_config_dict(kimi_linear=True), source="kl/config.json")
    assert cfg.model_type == "kimi_linear" and cfg.tensor_prefix == ""
    d = write_checkpoint(tmp_path / "kl", make_tensors(cfg), prefix="")
    r = CheckpointReader(d, cfg)
    r.validate()
    assert r.prefix == ""


def test_k3_checkpoint_with_vision_tower_ignores_it(tiny):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors)
    save_file({"vision_tower.patch_embed.weight": torch.zeros(4, 4)}, str(d / "vision.safetensors"))
    r = CheckpointReader(d, cfg)  # index present: the extra file is not a shard of the index
    r.validate()
    (d / "model.safetensors.index.json").unlink()
    r = CheckpointReader(d, cfg)
    r.validate()
    assert r.foreign_names == ["vision_tower.patch_embed.weight"]


def test_a_log_zero_padded_accepted_nonzero_tail_rejected(tiny):
    cfg, tensors, d = tiny
    name = "model.layers.1.self_attn.A_log"
    padded = np.zeros(8, np.float32)
    padded[:2] = [0.5, 1.5]
    tensors[name] = padded
    write_checkpoint(d, tensors)
    CheckpointReader(d, cfg).validate()
    padded[5] = 3.0
    write_checkpoint(d, tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.A_log: stored \[8\], padded past "
                                              r"the 2 used entries, but the padding is not zero \(1 nonzero, first at index 5\)"):
        CheckpointReader(d, cfg).validate()


# ----------------------------------------------------------------------------- bad synthetic
def test_missing_tensor(tiny):
    cfg, tensors, d = tiny
    del tensors["model.layers.1.self_attn.f_b_proj.weight"]
    write_checkpoint(d, tensors)
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\).*\n    model\.layers\.1\.self_attn\.f_b_proj\.weight \[64, 32\] bfloat16"):
        CheckpointReader(d, cfg).validate()


def test_unexpected_tensor(tiny):
    cfg, tensors, d = tiny
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
    write_checkpoint(d, tensors)
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\) not implied by the config:\n"
                                              r"    model\.layers\.0\.mlp\.extra\.weight \[3\] float32"):
        CheckpointReader(d, cfg).validate()


def test_wrong_shape_and_dtype(tiny):
    cfg, tensors, d = tiny
    tensors["model.layers.2.self_attn.kv_a_layernorm.weight"] = np.zeros(31, ml_dtypes.bfloat16)
    tensors["model.layers.0.self_attn.dt_bias"] = tensors["model.layers.0.self_attn.dt_bias"].astype(ml_dtypes.bfloat16)
    write_checkpoint(d, tensors)
    with pytest.raises(CheckpointError) as ei:
        CheckpointReader(d, cfg).validate()
    msg = str(ei.value)
    assert "2 tensor(s) with the wrong shape/dtype/contents" in msg
    assert "model.layers.2.self_attn.kv_a_layernorm.weight: expected [32] bfloat16, found [31] bfloat16" in msg
    assert "model.layers.0.self_attn.dt_bias: expected [64] float32, found [64] bfloat16" in msg


def test_all_problems_in_one_error_capped(tiny):
    cfg, tensors, d = tiny
    for e in range(4):  # 4 experts x 3 linears x 2 tensors = 24 missing in layer 1
        for w in ("w1", "w2", "w3"):
            for t in ("weight_packed", "weight_scale"):
                del tensors[f"model.layers.1.block_sparse_moe.experts.{e}.{w}.{t}"]
    tensors["lm_head.bias"] = np.zeros(128, ml_dtypes.bfloat16)
    tensors["model.norm.weight"] = np.zeros(65, ml_dtypes.bfloat16)
    write_checkpoint(d, tensors)
    with pytest.raises(CheckpointError) as ei:
        CheckpointReader(d, cfg).validate()
    msg = str(ei.value)
    assert "24 missing tensor(s)" in msg and "... and 4 more" in msg
    assert "1 unexpected tensor(s)" in msg and "lm_head.bias [128] bfloat16" in msg
    assert "1 tensor(s) with the wrong shape" in msg and "model.norm.weight: expected [64]" in msg
    assert msg.count("\n    model.layers.1.block_sparse_moe.experts.") == 20


def test_config_weights_mismatch(tiny, tmp_path):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors)
    other = K3Config.from_dict(tiny_config_dict(hidden_size=96), source="wrong/config.json")
    with pytest.raises(CheckpointError) as ei:
        CheckpointReader(d, other).validate()
    msg = str(ei.value)
    assert "checkpoint does not match config wrong/config.json" in msg
    assert "model.embed_tokens.weight: expected [128, 96] bfloat16, found [128, 64] bfloat16" in msg
    assert "hint: model.embed_tokens.weight suggests the weights have hidden_size=64 (config says 96)" in msg


def test_truncated_shard_data(tiny):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors, index=False)
    f = d / "model-00002-of-00002.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 10)
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: truncated shard: tensor '.*' "
                                              r"data_offsets end at \d+, beyond the end of the data"):
        CheckpointReader(d, cfg)


def test_truncated_shard_header(tiny):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors, index=False)
    f = d / "model-00001-of-00002.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:100])
    (n,) = struct.unpack("<Q", data[:8])
    with pytest.raises(CheckpointError, match=rf"model-00001-of-00002\.safetensors: truncated shard: header "
                                              rf"length {n} is larger than the file \(100 bytes\)"):
        CheckpointReader(d, cfg)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=r"truncated shard: 2 bytes, shorter than the 8-byte"):
        CheckpointReader(d, cfg)


def test_corrupt_header(tiny):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors, index=False)
    f = d / "model-00001-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"#!@x"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors: corrupt header: not valid JSON"):
        CheckpointReader(d, cfg)


def test_header_sizes_disagree(tiny):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors, index=False)
    f = d / "model-00001-of-00002.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [d_ + 1 for d_ in header[name]["shape"]]
    hb = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + data[8 + n:])
    with pytest.raises(CheckpointError, match=rf"corrupt header: tensor '{name}' .* needs \d+ bytes but "
                                              r"data_offsets \[\d+, \d+\] span \d+"):
        CheckpointReader(d, cfg)


def test_index_names_missing_shard(tiny):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors)
    (d / "model-00002-of-00002.safetensors").rename(d / "renamed.bin")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: names shard file\(s\) that do not "
                                              r"exist: model-00002-of-00002\.safetensors"):
        CheckpointReader(d, cfg)


def test_index_names_tensor_not_in_shard(tiny):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors)
    idx_path = d / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    name = PREFIX + "model.norm.weight"
    idx["weight_map"][name] = ("model-00001-of-00002.safetensors" if idx["weight_map"][name].startswith("model-00002")
                               else "model-00002-of-00002.safetensors")
    idx["weight_map"][PREFIX + "model.ghost.weight"] = "model-00001-of-00002.safetensors"
    idx_path.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"2 tensor\(s\) are not in the shard the index names: "
                                              r"language_model\.model\.norm\.weight \(index: model-0000"):
        CheckpointReader(d, cfg)


def test_index_missing_a_shard_tensor(tiny):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors)
    idx_path = d / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    del idx["weight_map"][PREFIX + "lm_head.weight"]
    idx_path.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) in the shards are missing from the index's "
                                              r"weight_map: language_model\.lm_head\.weight"):
        CheckpointReader(d, cfg)


def test_duplicate_tensor_across_shards(tiny):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors, index=False)
    save_file({PREFIX + "model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}, str(d / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) stored in more than one shard: "
                                              r"language_model\.model\.norm\.weight \(in "):
        CheckpointReader(d, cfg)


def test_no_safetensors_and_missing_dir(tmp_path):
    cfg = tiny_config()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"empty: no \*\.safetensors files"):
        CheckpointReader(tmp_path / "empty", cfg)
    with pytest.raises(CheckpointError, match=r"nowhere: checkpoint directory does not exist"):
        CheckpointReader(tmp_path / "nowhere", cfg)


def test_progress_bar_off_when_not_tty(tiny, capsys):
    cfg, tensors, d = tiny
    write_checkpoint(d, tensors)
    CheckpointReader(d, cfg, progress=True).validate()  # stderr is captured: not a tty
    assert capsys.readouterr().err == ""
