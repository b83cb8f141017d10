"""`k3 convert-weight`: atomic output, --force, MXFP4 <-> bf16 expert conversion."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from k3_compile import mxfp4
from k3_compile.cli import main
from k3_compile.config import K3Config
from k3_compile.convert import INCOMPLETE_MARKER, ConvertError, convert
from k3_compile.weights import CheckpointReader
from oracle_mlx import tiny_config, write_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "models" / "k3-nano"


def _read(out_dir: Path) -> dict:
    """Every parameter of a converted dir, read with the safetensors package."""
    from safetensors import safe_open

    index = json.loads((out_dir / "params_index.json").read_text())
    arrays = {}
    for f in sorted({e["file"] for e in index["params"]}):
        with safe_open(str(out_dir / f), framework="pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                arrays[k] = t.float().numpy() if str(t.dtype) == "torch.bfloat16" else t.numpy()
    for e in index["params"]:
        assert list(arrays[e["name"]].shape) == e["shape"]
    return arrays


def test_crash_leaves_only_tmp_dir_which_the_loader_refuses(tmp_path):
    out = tmp_path / "conv"
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert(NANO, out, shard_bytes=4 << 20, progress=False, _fail_after=2)
    assert not out.exists()
    tmps = list(tmp_path.glob("conv.tmp-*"))
    assert len(tmps) == 1 and (tmps[0] / INCOMPLETE_MARKER).exists()
    assert not (tmps[0] / "params_index.json").exists()
    from k3_compile.runtime.model_runner import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match="incomplete `k3 convert-weight` output"):
        load_model(tmps[0], lib=tmp_path / "unused.so")


def test_refuses_non_empty_output_without_force(tmp_path, capsys):
    out = tmp_path / "conv"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["convert-weight", str(NANO), "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists and is not empty; pass --force" in err
    assert main(["convert-weight", str(NANO), "-o", str(out), "--quiet", "--force"]) == 0
    assert "converted" in capsys.readouterr().out
    assert not (out / "keep.txt").exists() and (out / "params_index.json").is_file()
    assert not list(tmp_path.glob("conv.*"))  # no tmp / old dirs left behind
    k3 = json.loads((out / "k3-config.json").read_text())
    assert k3["config_hash"] == K3Config.from_file(NANO).summary_hash()  # same model
    assert k3["context_window"] == 8192 and k3["chat_template"]
    assert k3["generation_defaults"]["max_new_tokens"] == 256
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    # `k3 inspect` recognizes the converted dir
    assert main(["inspect", str(out)]) == 0
    assert "converted:      254 parameters in 1 shard(s)" in capsys.readouterr().out


def test_bf16_checkpoint_quantized_to_mxfp4_round_trip(tmp_path):
    raw = tiny_config()
    del raw["quantization_config"]
    src = write_random_checkpoint(tmp_path / "bf16", raw, seed=5)
    cfg_src = K3Config.from_file(src)
    assert not cfg_src.quantization.experts_mxfp4
    out = tmp_path / "mx"
    r = convert(src, out, quantization="mxfp4", progress=False)
    cfg_out = K3Config.from_file(out)
    assert cfg_out.quantization.experts_mxfp4
    assert r["config_hash"] == cfg_out.summary_hash() != cfg_src.summary_hash()
    assert cfg_out.quantization.format == "mxfp4-pack-quantized" and cfg_out.quantization.group_size == 32
    arrays = _read(out)
    reader = CheckpointReader(src, cfg_src)
    layer = cfg_src.moe_layer_ids[0]
    base = f"model.layers.{layer}.block_sparse_moe.experts"
    for w in ("w1", "w2", "w3"):
        src_w = np.stack([np.asarray(reader.get(f"{base}.{e}.{w}.weight")).astype(np.float32)
                          for e in range(cfg_src.num_experts)])
        packed, scale = arrays[f"{base}.{w}.weight_packed"], arrays[f"{base}.{w}.weight_scale"]
        ref_p, ref_s = mxfp4.quantize(src_w)
        np.testing.assert_array_equal(packed, ref_p)
        np.testing.assert_array_equal(scale, ref_s)
        deq = mxfp4.dequantize(packed, scale)
        # MXFP4 keeps the block max within one E2M1 step (relative 1/4 of the block scale)
        blocks = np.abs(src_w).reshape(*src_w.shape[:-1], -1, 32).max(-1, keepdims=True)
        err = np.abs(deq - src_w).reshape(*src_w.shape[:-1], -1, 32)
        assert (err <= blocks / 4 + 1e-7).all()
    # and back to bf16: the dequantized MXFP4 values, exactly (they are bf16-representable)
    back = tmp_path / "back"
    convert(src, back, quantization="bf16", progress=False)
    arrays_b = _read(back)
    np.testing.assert_array_equal(arrays_b[f"{base}.w1.weight"],
                                  np.stack([np.asarray(reader.get(f"{base}.{e}.w1.weight")).astype(np.float32)
                                            for e in range(cfg_src.num_experts)]))


def test_mxfp4_checkpoint_dequantized_to_bf16(tmp_path):
    out = tmp_path / "nano-bf16"
    convert(NANO, out, quantization="bf16", progress=False)
    cfg = K3Config.from_file(out)
    assert not cfg.quantization.experts_mxfp4
    arrays = _read(out)
    reader = CheckpointReader(NANO, K3Config.from_file(NANO))
    base = "model.layers.3.block_sparse_moe.experts"
    got = arrays[f"{base}.w2.weight"]
    ref = np.stack([mxfp4.dequantize(reader.get(f"{base}.{e}.w2.weight_packed"),
                                     reader.get(f"{base}.{e}.w2.weight_scale")) for e in range(32)])
    np.testing.assert_array_equal(got, ref)


def test_refuses_converted_input_and_bad_args(tmp_path):
    out = tmp_path / "c"
    convert(NANO, out, progress=False)
    with pytest.raises(ConvertError, match="already a converted parameter directory"):
        convert(out, tmp_path / "c2", progress=False)
    with pytest.raises(ConvertError, match="--quantization 'int4'"):
        convert(NANO, tmp_path / "c3", quantization="int4", progress=False)


def test_invalid_side_json_named(tmp_path):
    """A broken generation_config.json / tokenizer_config.json is named, not a traceback."""
    for name in ("generation_config.json", "tokenizer_config.json"):
        src = write_random_checkpoint(tmp_path / name, tiny_config(), seed=1)
        (src / name).write_text("{not json")
        with pytest.raises(ConvertError, match=f"{name}: not valid JSON"):
            convert(src, tmp_path / f"out-{name}", progress=False)
