"""Read a K3 / Kimi Linear safetensors checkpoint lazily and validate it against the config.

Spec §1. A checkpoint is a directory of ``*.safetensors`` shards, optionally with
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file). Tensor names
carry the ``language_model.`` prefix (K3) or none (Kimi Linear); the reader detects which.
Only the headers are read up front (8-byte little-endian length + JSON); tensor data is
memory-mapped one tensor at a time, so the 1.45 TB real checkpoint is never loaded whole.

safetensors format (https://github.com/huggingface/safetensors, "Format"): ``u64 N``,
``N`` bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": ...}``,
then the data buffer; offsets are relative to the start of the buffer (byte ``8 + N``).
"""

from __future__ import annotations

import itertools
import json
import struct
import sys
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from .config import K3Config
from .tensors import TensorSpec, expected_tensors, head_tensors, layer_tensors, tail_tensors

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
LIST_CAP = 20  # names listed per problem category in validate()
PROGRESS_MIN_SHARDS = 8

# safetensors dtype -> (numpy dtype, name used in tensors.py / messages)
SAFETENSORS_DTYPES: dict[str, tuple[np.dtype, str]] = {
    "BF16": (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    "F16": (np.dtype(np.float16), "float16"),
    "F32": (np.dtype(np.float32), "float32"),
    "F64": (np.dtype(np.float64), "float64"),
    "U8": (np.dtype(np.uint8), "uint8"),
    "I8": (np.dtype(np.int8), "int8"),
    "U16": (np.dtype(np.uint16), "uint16"),
    "I16": (np.dtype(np.int16), "int16"),
    "U32": (np.dtype(np.uint32), "uint32"),
    "I32": (np.dtype(np.int32), "int32"),
    "U64": (np.dtype(np.uint64), "uint64"),
    "I64": (np.dtype(np.int64), "int64"),
    "BOOL": (np.dtype(np.bool_), "bool"),
    "F8_E4M3": (np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn"),
    "F8_E5M2": (np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2"),
    "F8_E8M0": (np.dtype(ml_dtypes.float8_e8m0fnu), "float8_e8m0fnu"),
}


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, corrupt, or does not match the config.

    The message names the directory or shard file and the tensor(s) concerned.
    """


class MissingTensorError(CheckpointError, KeyError):
    """:meth:`CheckpointReader.get` of a name the checkpoint does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class _Entry:
    """One tensor's header record (no data)."""

    __slots__ = ("shard", "dtype", "shape", "start", "nbytes")

    def __init__(self, shard: int, dtype: str, shape: tuple[int, ...], start: int, nbytes: int):
        self.shard, self.dtype, self.shape, self.start, self.nbytes = shard, dtype, shape, start, nbytes


def _progress(iterable, total: int, desc: str, enable: bool):
    if not enable or not sys.stderr.isatty():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="", leave=False, file=sys.stderr)


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """Parse one shard's header without reading tensor data.

    Returns:
        ``(entries, data_start)``: ``entries`` maps tensor name -> ``{"dtype", "shape",
        "data_offsets"}`` (validated), ``data_start`` the absolute offset of the data buffer.
    Raises:
        CheckpointError: file shorter than its header, header not JSON / not the safetensors
            schema, unknown dtype, byte size not matching shape × dtype, or data offsets
            beyond the end of the file (truncated shard).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated shard: {size} bytes, shorter than the 8-byte "
                                  "safetensors header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated shard: header length {n} is larger than the "
                                  f"file ({size} bytes)")
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: corrupt header: length {n} exceeds the safetensors "
                                  f"limit of {MAX_HEADER_BYTES} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header: expected a JSON object, got "
                              f"{type(header).__name__}")
    header.pop("__metadata__", None)
    data_start = 8 + n
    data_size = size - data_start
    for name, info in header.items():
        if (not isinstance(info, dict) or not isinstance(info.get("dtype"), str)
                or not isinstance(info.get("shape"), list)
                or not isinstance(info.get("data_offsets"), list)
                or len(info["data_offsets"]) != 2
                or not all(isinstance(d, int) and d >= 0 for d in info["shape"] + info["data_offsets"])):
            raise CheckpointError(f"{path}: corrupt header: tensor '{name}' needs 'dtype' (str), "
                                  f"'shape' (list of int) and 'data_offsets' ([begin, end]); got {info!r}")
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {info['dtype']!r}; "
                                  f"expected one of {sorted(SAFETENSORS_DTYPES)}")
        begin, end = info["data_offsets"]
        numel = 1
        for d in info["shape"]:
            numel *= d
        want = numel * SAFETENSORS_DTYPES[info["dtype"]][0].itemsize
        if end - begin != want:
            raise CheckpointError(f"{path}: corrupt header: tensor '{name}' {info['dtype']} "
                                  f"{info['shape']} needs {want} bytes but data_offsets "
                                  f"[{begin}, {end}] span {end - begin}")
        if end > data_size:
            raise CheckpointError(f"{path}: truncated shard: tensor '{name}' data_offsets end at "
                                  f"{end}, beyond the end of the data ({data_size} bytes; file "
                                  f"{size} bytes)")
    return header, data_start


def map_tensor(path: Path, st_dtype: str, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    """Memory-map one tensor of a safetensors file, read-only.

    Args:
        path: the ``.safetensors`` file.
        st_dtype: its safetensors dtype code (``"BF16"``, ``"F32"``, ``"U8"``...; see
            ``SAFETENSORS_DTYPES``).
        offset: absolute byte offset of the data in the file (header end + data offset).
        shape: the tensor's shape.
    Returns:
        a plain ndarray whose base is the mapping (empty tensors: zeros).
    """
    dt = SAFETENSORS_DTYPES[st_dtype][0]
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dt)
    return np.memmap(path, dtype=dt, mode="r", offset=offset, shape=tuple(shape)).view(np.ndarray)


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _capped(title: str, lines: list[str], count: int) -> str:
    more = f"\n    ... and {count - len(lines)} more" if count > len(lines) else ""
    return f"  {count} {title}:\n" + "\n".join(f"    {ln}" for ln in lines) + more


class CheckpointReader:
    """Lazy, memory-mapped reader of a checkpoint directory (spec §1).

    Args:
        path: directory holding ``*.safetensors`` (and optionally ``model.safetensors.index.json``).
        cfg: the parsed config; :meth:`validate` checks the tensors it implies.
        progress: show a tqdm bar (stderr, tty only) while reading headers / validating;
            ``None`` = only with at least 8 shards.

    Attributes:
        path: the directory.
        files: shard paths (sorted; with an index, the shards it names).
        prefix: the detected name prefix, ``"language_model."`` (K3) or ``""`` (Kimi Linear).
        num_tensors: tensors of the text model (names under the prefix).
        foreign_names: names outside the prefix (e.g. K3's ``vision_tower.*``), ignored.

    Raises:
        CheckpointError: directory missing, no shards, unreadable/corrupt/truncated shard,
            index naming a missing shard or a tensor its shard lacks, a shard tensor the
            index does not list, or a tensor present in two shards.
    """

    def __init__(self, path: str | Path, cfg: K3Config, progress: bool | None = None):
        self.path = Path(path)
        self.cfg = cfg
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: checkpoint directory does not exist")
        index_path = self.path / INDEX_FILE
        weight_map: dict[str, str] | None = None
        if index_path.is_file():
            try:
                index = json.loads(index_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index_path}: not valid JSON ({e})") from None
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index_path}: expected an object with a 'weight_map' "
                                      "{tensor name: shard file}")
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise CheckpointError(f"{index_path}: names shard file(s) that do not exist: "
                                      + ", ".join(missing[:LIST_CAP]))
            self.files = [self.path / n for n in names]
        else:
            self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise CheckpointError(f"{self.path}: no *.safetensors files (and no {INDEX_FILE})")
        self._progress = len(self.files) >= PROGRESS_MIN_SHARDS if progress is None else progress
        self._data_start: list[int] = []
        entries: dict[str, _Entry] = {}
        shapes: dict[tuple, tuple] = {}  # interned shape tuples (1.8M entries share ~50 shapes)
        dup: list[str] = []
        for si, f in enumerate(_progress(self.files, len(self.files), "reading headers", self._progress)):
            header, start = read_header(f)
            self._data_start.append(start)
            for name, info in header.items():
                shape = tuple(info["shape"])
                shape = shapes.setdefault(shape, shape)
                begin, end = info["data_offsets"]
                if name in entries:
                    dup.append(f"{name} (in {self.files[entries[name].shard].name} and {f.name})")
                entries[name] = _Entry(si, info["dtype"], shape, start + begin, end - begin)
        if dup:
            raise CheckpointError(f"{self.path}: {len(dup)} tensor(s) stored in more than one shard: "
                                  + "; ".join(dup[:LIST_CAP]))
        if weight_map is not None:
            file_idx = {f.name: i for i, f in enumerate(self.files)}
            wrong = [f"{n} (index: {s})" for n, s in weight_map.items()
                     if n not in entries or entries[n].shard != file_idx[Path(s).name]]
            if wrong:
                raise CheckpointError(
                    f"{index_path}: {len(wrong)} tensor(s) are not in the shard the index names: "
                    + "; ".join(wrong[:LIST_CAP]))
            extra = [n for n in entries if n not in weight_map]
            if extra:
                raise CheckpointError(
                    f"{index_path}: {len(extra)} tensor(s) in the shards are missing from the "
                    "index's weight_map: " + ", ".join(extra[:LIST_CAP]))
        prefix = "language_model."
        if not any(n.startswith(prefix) for n in entries):
            prefix = ""
        self.prefix = prefix
        self._entries: dict[str, _Entry] = {}
        self.foreign_names: list[str] = []
        for n, e in entries.items():
            if n.startswith(prefix):
                self._entries[n[len(prefix):]] = e
            else:
                self.foreign_names.append(n)

    # ------------------------------------------------------------------ access
    @property
    def num_tensors(self) -> int:
        return len(self._entries)

    def names(self) -> Iterator[str]:
        """Names of the text-model tensors, without the prefix, in shard/header order."""
        return iter(self._entries)

    def __contains__(self, name: str) -> bool:
        return self._strip(name) in self._entries

    def _strip(self, name: str) -> str:
        return name[len(self.prefix):] if self.prefix and name.startswith(self.prefix) else name

    def info(self, name: str) -> tuple[str, tuple[int, ...], Path]:
        """``(dtype name, shape, shard path)`` of ``name`` from the header (no data read).

        Raises:
            MissingTensorError: no such tensor.
        """
        e = self._entry(name)
        return SAFETENSORS_DTYPES[e.dtype][1], e.shape, self.files[e.shard]

    def _entry(self, name: str) -> _Entry:
        e = self._entries.get(self._strip(name))
        if e is None:
            raise MissingTensorError(f"{self.path}: no tensor '{self._strip(name)}' "
                                     f"(prefix {self.prefix!r}) in the checkpoint")
        return e

    def get(self, name: str) -> np.ndarray:
        """One tensor, memory-mapped read-only (copy it to modify it).

        Args:
            name: checkpoint name without the prefix (a prefixed name is accepted too).
        Returns:
            array of the stored shape; dtype bf16 -> ``ml_dtypes.bfloat16``, F32 -> float32,
            U8 -> uint8 (see ``SAFETENSORS_DTYPES``). Stored bytes are little-endian (safetensors).
        Raises:
            MissingTensorError: no such tensor.
        """
        e = self._entry(name)
        return map_tensor(self.files[e.shard], e.dtype, e.start, e.shape)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check that every tensor ``expected_tensors(cfg)`` implies is present with the
        expected shape and dtype, and nothing else is (spec §1).

        ``A_log`` may be stored ``[num_heads]`` or zero-padded longer (K3: ``[128]``); the
        padded tail is read and must be zero. Iterates the expected list lazily and reads
        only headers (plus the tiny ``A_log`` tensors).

        Raises:
            CheckpointError: ONE error listing all missing, unexpected and mismatched
                tensors (up to 20 names per category, with counts), with a hint when the
                shapes suggest a config for different weights.
        """
        missing: list[str] = []
        n_missing = 0
        bad: list[str] = []
        n_bad = 0
        matched = 0
        hint = ""
        entries = self._entries
        c = self.cfg
        groups = itertools.chain([head_tensors(c)], (layer_tensors(c, i) for i in range(c.num_hidden_layers)),
                                 [tail_tensors(c)])
        groups = _progress(groups, c.num_hidden_layers + 2, "validating (layers)", self._progress)
        for spec in itertools.chain.from_iterable(groups):
            e = entries.get(spec.name)
            if e is None:
                n_missing += 1
                if len(missing) < LIST_CAP:
                    missing.append(f"{spec.name} {_fmt_shape(spec.shape)} {spec.dtype}")
                continue
            matched += 1
            problem = self._check(spec, e)
            if problem:
                n_bad += 1
                if len(bad) < LIST_CAP:
                    bad.append(f"{spec.name}: {problem}")
                if spec.name == "model.embed_tokens.weight" and len(e.shape) == 2:
                    hint = self._hint(e.shape)
        unexpected: list[str] = []
        n_unexpected = 0
        if matched != len(entries):
            expected_names = {s.name for s in expected_tensors(self.cfg)}
            for n, e in entries.items():
                if n not in expected_names:
                    n_unexpected += 1
                    if len(unexpected) < LIST_CAP:
                        unexpected.append(f"{n} {_fmt_shape(e.shape)} {SAFETENSORS_DTYPES[e.dtype][1]} "
                                          f"({self.files[e.shard].name})")
        if n_missing or n_bad or n_unexpected:
            parts = [f"{self.path}: checkpoint does not match config {self.cfg.source} "
                     f"(tensor prefix {self.prefix!r}):"]
            if n_missing:
                parts.append(_capped("missing tensor(s) (name, expected shape, dtype)", missing, n_missing))
            if n_unexpected:
                parts.append(_capped("unexpected tensor(s) not implied by the config", unexpected, n_unexpected))
            if n_bad:
                parts.append(_capped("tensor(s) with the wrong shape/dtype/contents", bad, n_bad))
            if hint:
                parts.append("  " + hint)
            raise CheckpointError("\n".join(parts))

    def _check(self, spec: TensorSpec, e: _Entry) -> str | None:
        dtype = SAFETENSORS_DTYPES[e.dtype][1]
        if dtype != spec.dtype or not spec.accepts_shape(e.shape):
            exp = _fmt_shape(spec.shape) + ("" if spec.min_leading is None else
                                            f" (dim 0 >= {spec.min_leading}, zero-padded)")
            return f"expected {exp} {spec.dtype}, found {_fmt_shape(e.shape)} {dtype}"
        if spec.min_leading is not None and e.shape[0] > spec.min_leading:
            tail = np.asarray(self.get(spec.name)[spec.min_leading:])
            nz = np.flatnonzero(tail.reshape(-1) != 0)
            if nz.size:
                return (f"stored {_fmt_shape(e.shape)}, padded past the {spec.min_leading} used "
                        f"entries, but the padding is not zero ({nz.size} nonzero, first at "
                        f"index {spec.min_leading + int(nz[0])})")
        return None

    def _hint(self, found: tuple[int, ...]) -> str:
        v, h = found
        msg = []
        if h != self.cfg.hidden_size:
            msg.append(f"hidden_size={h} (config says {self.cfg.hidden_size})")
        if v != self.cfg.vocab_size:
            msg.append(f"vocab_size={v} (config says {self.cfg.vocab_size})")
        return ("hint: model.embed_tokens.weight suggests the weights have " + ", ".join(msg)
                + "; is config.json for these weights?") if msg else ""

    def __repr__(self) -> str:
        return (f"CheckpointReader({str(self.path)!r}, {len(self.files)} shard(s), "
                f"{self.num_tensors} tensors, prefix {self.prefix!r})")


def open_checkpoint(path: str | Path, cfg: K3Config | None = None) -> CheckpointReader:
    """Convenience: parse ``path/config.json`` unless ``cfg`` is given, open and validate.

    Raises:
        ConfigError, CheckpointError: as :meth:`K3Config.from_file` / :class:`CheckpointReader`.
    """
    cfg = cfg or K3Config.from_file(Path(path))
    reader = CheckpointReader(path, cfg)
    reader.validate()
    return reader


__all__ = ["CheckpointError", "MissingTensorError", "CheckpointReader", "read_header",
           "open_checkpoint", "INDEX_FILE"]
