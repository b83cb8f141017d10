"""``k3 convert-weight``: a checkpoint -> the runtime's parameter shards.

Output directory (``OUT_DIR``):

* ``params-NNNNN-of-MMMMM.safetensors``: the Relax parameters, named and shaped as
  ``export_model(cfg, dtype).params`` (routed experts stacked per layer; MXFP4 experts stay
  packed), in parameter order, at most ``--shard-size`` bytes per shard (a single parameter
  larger than that gets a shard of its own). Written by a streaming safetensors writer: the
  header is computed up front from the parameter list, then each parameter is written piece
  by piece (one expert at a time for stacked experts), so memory stays at one checkpoint
  tensor regardless of model size.
* ``params_index.json``: ``{"format": ..., "dtype", "quantization", "params": [{name, file,
  shape, dtype}, ...]}`` in parameter order.
* ``config.json``: the input config with ``quantization_config`` rewritten to what the
  output holds (so ``K3Config.from_file(OUT_DIR)`` is the converted model's config and its
  ``summary_hash`` is what a library for it must be compiled with).
* ``k3-config.json``: ``K3Config.to_dict``, the raw input config, context window, prefill
  chunk, chat template, generation defaults (from ``generation_config.json``), tokenizer files.
* tokenizer files copied (``tokenizer.json``, ``tiktoken.model``, ``tokenizer_config.json``,
  ``generation_config.json``).

Atomicity: everything is written into ``OUT_DIR.tmp-<pid>`` (holding an ``.incomplete``
marker until the end) and renamed to ``OUT_DIR`` only once complete; a crash leaves just the
tmp directory, which :func:`k3_compile.runtime.model_runner.load_model` refuses.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .config import K3Config

PARAMS_INDEX = "params_index.json"
K3_CONFIG = "k3-config.json"
INCOMPLETE_MARKER = ".incomplete"
INDEX_FORMAT = "k3-compile-params-v1"
DEFAULT_SHARD_BYTES = 1 << 30
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json",
                   "generation_config.json", "special_tokens_map.json")
QUANTIZATIONS = ("mxfp4", "bf16")
DTYPES = ("bfloat16", "float32")
_ST_DTYPE = {"bfloat16": "BF16", "float32": "F32", "uint8": "U8", "float16": "F16"}

MXFP4_QUANT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                    "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


class ConvertError(ValueError):
    """A conversion that cannot be done (bad arguments, existing output, bad checkpoint)."""


def default_context_window(cfg: K3Config) -> int:
    """The runtime's default context window: the model's, capped at 8192 tokens."""
    return int(min(cfg.max_position_embeddings, 8192))


DEFAULT_PREFILL_CHUNK = 512


def output_raw_config(raw: dict, quantization: str) -> dict:
    """``raw`` (a config.json dict) with its quantization_config set to ``quantization``."""
    out = copy.deepcopy(raw)
    text = out.get("text_config") if isinstance(out.get("text_config"), dict) else None
    for d in (out, text):
        if d is not None:
            d.pop("quantization_config", None)
    if quantization == "mxfp4":
        qc = copy.deepcopy(raw.get("quantization_config") or (text or {}).get("quantization_config")
                           or MXFP4_QUANT_CONFIG)
        out["quantization_config"] = qc
        if text is not None:
            text["quantization_config"] = copy.deepcopy(qc)
    return out


def _expert_source(cfg_in: K3Config, cfg_out: K3Config, get: Callable[[str], np.ndarray]):
    """A function ``(param_name, expert_source_names) -> iterator of arrays`` for stacked experts,
    converting between the checkpoint's expert format and the output's."""
    from . import mxfp4
    from .loader import EXPERT_STACKED

    cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def quantized(base_e: str) -> tuple[np.ndarray, np.ndarray]:
        if base_e not in cache:
            cache.clear()
            cache[base_e] = mxfp4.quantize(np.asarray(get(f"{base_e}.weight")))
        return cache[base_e]

    def pieces(name: str, dtype: str) -> Iterator[np.ndarray]:
        base, w, kind = EXPERT_STACKED.match(name).groups()
        for e in range(cfg_out.num_experts):
            base_e = f"{base}.{e}.{w}"
            in_q, out_q = cfg_in.quantization.experts_mxfp4, cfg_out.quantization.experts_mxfp4
            if in_q == out_q:
                arr = np.asarray(get(f"{base_e}.{kind}"))
            elif out_q:  # bf16 checkpoint -> mxfp4
                packed, scale = quantized(base_e)
                arr = packed if kind == "weight_packed" else scale
            else:  # mxfp4 checkpoint -> bf16/f32
                arr = mxfp4.dequantize(get(f"{base_e}.weight_packed"), get(f"{base_e}.weight_scale"))
            yield _cast(arr, dtype, name)

    return pieces


def _cast(arr: np.ndarray, dtype: str, name: str) -> np.ndarray:
    from .loader import to_param_dtype

    return np.ascontiguousarray(to_param_dtype(np.asarray(arr), dtype, name))


def _write_shard(path: Path, entries: list[tuple[str, tuple, str]],
                 produce: Callable[[str, tuple, str], Iterator[np.ndarray]], bar) -> None:
    """Stream one safetensors file: header from ``entries``, then each tensor's pieces."""
    header: dict = {"__metadata__": {"format": "pt", "producer": "k3-compile convert-weight"}}
    off = 0
    sizes = {}
    for name, shape, dtype in entries:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(_np_dtype(dtype)).itemsize
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        sizes[name] = n
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, shape, dtype in entries:
            written = 0
            for piece in produce(name, shape, dtype):
                b = piece.tobytes()
                f.write(b)
                written += len(b)
            if written != sizes[name]:
                raise ConvertError(f"parameter {name}: produced {written} bytes, expected "
                                   f"{sizes[name]} ({dtype} {list(shape)})")
            bar.update(1)


def _optional_json(path: Path) -> dict:
    """The JSON object in ``path``, ``{}`` when the file is absent.

    Raises:
        ConvertError: the file is not valid JSON (naming it)."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path}: not valid JSON ({e})") from None


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def convert(model_dir: str | Path, out_dir: str | Path, *, quantization: str = "mxfp4",
            dtype: str = "bfloat16", force: bool = False, shard_bytes: int = DEFAULT_SHARD_BYTES,
            context_window: int | None = None, prefill_chunk: int | None = None,
            progress: bool = True, _fail_after: int | None = None) -> dict:
    """Convert the checkpoint in ``model_dir`` into ``out_dir`` (see the module docstring).

    Args:
        quantization: routed-expert format of the output, ``"mxfp4"`` or ``"bf16"``.
        dtype: the model dtype of the parameters (``"bfloat16"`` or ``"float32"``).
        force: replace a non-empty ``out_dir``.
        _fail_after: testing hook, raise after writing this many shards (simulated crash).
    Returns:
        a summary dict (params, shards, bytes, seconds, out_dir).
    Raises:
        ConvertError / ConfigError / CheckpointError / ParameterError.
    """
    from .pipeline import export_model
    from .weights import CheckpointReader

    if quantization not in QUANTIZATIONS:
        raise ConvertError(f"--quantization {quantization!r}: expected one of {list(QUANTIZATIONS)}")
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: expected one of {list(DTYPES)}")
    t0 = time.time()
    src = Path(model_dir)
    out = Path(out_dir)
    if (src / PARAMS_INDEX).is_file():
        raise ConvertError(f"{src} is already a converted parameter directory (it has {PARAMS_INDEX}); "
                           "convert the original checkpoint instead")
    cfg_in = K3Config.from_file(src)
    raw = json.loads((src / "config.json").read_text())
    if out.exists() and out.resolve() == src.resolve():
        raise ConvertError(f"output directory {out} is the input checkpoint directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise ConvertError(f"output directory {out} exists and is not empty; pass --force to "
                               "replace it")
    reader = CheckpointReader(src, cfg_in)
    reader.validate()
    raw_out = output_raw_config(raw, quantization)
    cfg_out = K3Config.from_dict(raw_out, source=str(out / "config.json"))
    exported = export_model(cfg_out, dtype)
    params = exported.params

    # shard plan
    shards: list[list[tuple[str, tuple, str]]] = [[]]
    cur = 0
    for name, shape, dt in params:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(_np_dtype(dt)).itemsize
        if shards[-1] and cur + n > shard_bytes:
            shards.append([])
            cur = 0
        shards[-1].append((name, shape, dt))
        cur += n
    nsh = len(shards)
    files = [f"params-{i + 1:05d}-of-{nsh:05d}.safetensors" for i in range(nsh)]

    from .loader import EXPERT_STACKED, load_parameters

    experts = _expert_source(cfg_in, cfg_out, reader.get)

    def produce(name, shape, dt):
        if EXPERT_STACKED.match(name):
            yield from experts(name, dt)
        else:
            for _, arr in load_parameters(reader.get, [(name, shape, dt)], cfg_out.num_experts):
                yield arr

    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / INCOMPLETE_MARKER).write_text(f"k3 convert-weight of {src} in progress (pid {os.getpid()})\n")
    from tqdm import tqdm

    total_bytes = 0
    with tqdm(total=len(params), desc="converting", unit="param", disable=not progress,
              file=sys.stderr) as bar:
        for i, (fname, entries) in enumerate(zip(files, shards)):
            if _fail_after is not None and i >= _fail_after:
                raise RuntimeError(f"simulated crash after {i} shard(s)")
            _write_shard(tmp / fname, entries, produce, bar)
            total_bytes += (tmp / fname).stat().st_size
    index = {"format": INDEX_FORMAT, "dtype": dtype, "quantization": quantization,
             "config_hash": cfg_out.summary_hash(), "page_size": exported.page_size,
             "params": [{"name": n, "file": files[i], "shape": list(s), "dtype": d}
                        for i, entries in enumerate(shards) for n, s, d in entries]}
    (tmp / "config.json").write_text(json.dumps(raw_out, indent=2) + "\n")
    copied = []
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy2(src / f, tmp / f)
            copied.append(f)
    gen = _optional_json(src / "generation_config.json")
    tok_cfg = _optional_json(src / "tokenizer_config.json")
    k3cfg = {
        "k3_compile_version": version(),
        "source": str(src.resolve()),
        "model_config": cfg_out.to_dict(),
        "config_hash": cfg_out.summary_hash(),
        "raw_config": raw,
        "dtype": dtype,
        "quantization": quantization,
        "page_size": exported.page_size,
        "context_window": int(default_context_window(cfg_out) if context_window is None else context_window),
        "prefill_chunk": int(DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk),
        "chat_template": tok_cfg.get("chat_template"),
        "tokenizer_files": copied,
        "generation_defaults": {k: gen[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty",
                                                    "max_new_tokens", "do_sample", "eos_token_id")
                                if k in gen},
    }
    (tmp / K3_CONFIG).write_text(json.dumps(k3cfg, indent=2) + "\n")
    (tmp / PARAMS_INDEX).write_text(json.dumps(index, indent=1) + "\n")
    (tmp / INCOMPLETE_MARKER).unlink()
    if out.exists():
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    return {"out_dir": str(out), "params": len(params), "shards": nsh, "bytes": total_bytes,
            "seconds": time.time() - t0, "config_hash": cfg_out.summary_hash(),
            "quantization": quantization, "dtype": dtype}


def version() -> str:
    try:
        from importlib.metadata import version as _v

        return _v("k3-compile")
    except Exception:  # pragma: no cover - not installed
        return "0.0.0+unknown"
