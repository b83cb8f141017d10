"""Load a compiled K3 library with its parameters and tokenizer; generate text.

``load_model(model_dir, lib=None, device="cpu")`` returns a :class:`LoadedModel` (engine,
tokenizer, library metadata). Only runtime APIs of TVM are used to load and run a library
(``tvm.runtime.load_module``, ``tvm.runtime.vm.VirtualMachine``, ``tvm.runtime.tensor``);
compiling (when ``lib`` is None and the cache has no library yet) needs the full TVM.

``model_dir`` is either a checkpoint directory (HF safetensors, read through
:class:`k3_compile.weights.CheckpointReader` and :func:`k3_compile.loader.load_parameters`)
or a directory written by ``k3 convert-weight`` (``params_index.json``).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import K3Config
from .engine import Engine, EngineError
from .sampler import Sampler, SamplingParams

DEVICE_FORMS = "cpu, cuda, cuda:N (N = GPU index, e.g. cuda:0); gpu / gpu:N mean the same as cuda"
# CUDA compute capability -> target name
_CUDA_ARCH_TARGETS = {"9.0": "cuda-sm90a", "10.0": "cuda-sm100a", "12.0": "cuda-sm120a"}
# Fraction of free device memory the MLA page pool and KDA slots may take.
GPU_MEMORY_FRACTION = 0.85


class ModelLoadError(ValueError):
    """A library / model directory / device combination that cannot be loaded (message says why)."""


def parse_device(device: str) -> tuple[str, int]:
    """``"cpu"`` / ``"cuda"`` / ``"cuda:N"`` (``gpu`` = ``cuda``) -> (kind, index).

    Raises:
        ModelLoadError: any other form, listing the accepted ones.
    """
    s = str(device).strip().lower()
    m = re.fullmatch(r"(cpu|cuda|gpu)(?::(\d+))?", s)
    if not m or (m.group(1) == "cpu" and m.group(2) not in (None, "0")):
        raise ModelLoadError(f"unknown device {device!r}; accepted forms: {DEVICE_FORMS}")
    kind = "cuda" if m.group(1) == "gpu" else m.group(1)
    return kind, int(m.group(2) or 0)


def device_target(kind: str, index: int = 0):
    """The :class:`targets.base.TargetSpec` to compile for the device ``(kind, index)``."""
    from targets import get_target, host_default

    if kind == "cpu":
        return host_default()
    import tvm

    _ensure_cuda_runtime()
    dev = tvm.runtime.device("cuda", index)
    if not dev.exist:
        raise ModelLoadError(f"device cuda:{index} does not exist (no CUDA GPU with that index)")
    cc = str(dev.compute_version)
    if cc not in _CUDA_ARCH_TARGETS:
        raise ModelLoadError(f"cuda:{index} has compute capability {cc}; k3-compile has CUDA targets for "
                             + ", ".join(f"{k} ({v})" for k, v in _CUDA_ARCH_TARGETS.items()))
    return get_target(_CUDA_ARCH_TARGETS[cc])


def _ensure_cuda_runtime() -> None:
    from ..device_code import load_cuda_runtime

    try:
        load_cuda_runtime()
    except Exception as e:  # pragma: no cover - GPU machines only
        if "libcuda" in str(e):
            raise ModelLoadError("no CUDA driver found (libcuda.so.1): this machine has no usable "
                                 "NVIDIA GPU; use --device cpu") from None
        raise ModelLoadError(f"cannot load the TVM CUDA runtime: {e}") from None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS / stop string), "length" (max tokens / context full), "cancelled"
    prefill_seconds: float
    decode_seconds: float
    prefill_tokens: int
    decode_tokens: int
    first_token_seconds: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": len(self.token_ids), "finish_reason": self.finish_reason,
                "prefill_tokens": self.prefill_tokens, "prefill_seconds": round(self.prefill_seconds, 6),
                "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
                "decode_tokens": self.decode_tokens, "decode_seconds": round(self.decode_seconds, 6),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
                "time_to_first_token_s": round(self.first_token_seconds, 6)}


@dataclass
class LoadedModel:
    """A model ready to generate: ``engine``, ``tokenizer``, ``metadata`` of the library."""

    engine: Engine
    tokenizer: object
    metadata: dict
    cfg: K3Config
    model_dir: Path
    lib_path: Path
    device: str
    prefill_chunk: int
    context_window: int
    generation_defaults: dict = field(default_factory=dict)
    load_seconds: float = 0.0
    generated_tokens: int = 0  # tokens returned by generate() so far (decode steps + 1 per request)

    # ------------------------------------------------------------------ generation
    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        """Raw text (BOS as tokenizer_config says) or, with ``chat``, one user turn rendered
        with the chat template (generation prompt added)."""
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": text}])
        return self.tokenizer.encode(text)

    def check_prompt(self, n_new: int, n_cached: int = 0) -> None:
        total = n_new + n_cached
        if total >= self.engine.max_context:
            what = f"{n_new} tokens" + (f" (+ {n_cached} already in the conversation)" if n_cached else "")
            limit = self.engine.max_context
            hint = ("shorten the prompt or raise --context-window"
                    if limit < self.engine.cfg.max_position_embeddings
                    else "shorten the prompt: this is the model's maximum")
            raise ModelLoadError(f"prompt is {what}; the context window is {limit} tokens and "
                                 f"generating needs at least one more ({hint})")

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 stream: Callable[[str], None] | None = None, seq_id: int | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        """Prefill ``prompt_ids`` (in chunks of ``prefill_chunk``), then sample and decode until
        an EOS id (``tokenizer.eos_ids``), a stop string, ``max_tokens`` or the context limit.

        Args:
            stream: called with each new piece of text as soon as it is final (text that could
                still become part of a stop string is held back).
            seq_id: continue this engine sequence (chat); otherwise a fresh sequence is used
                and removed afterwards.
            should_stop: polled before each prefill chunk and each token; True ends the
                generation with finish_reason "cancelled" (a server's client went away).
        Raises:
            ModelLoadError: the prompt does not fit the context window.
        """
        params = params or SamplingParams()
        eng = self.engine
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ModelLoadError("empty prompt: nothing to condition on (give some text)")
        own = seq_id is None
        n_cached = 0 if own else eng.length(seq_id)
        self.check_prompt(len(prompt_ids), n_cached)
        sid = eng.add_sequence() if own else seq_id
        try:
            return self._generate(sid, prompt_ids, params, stream, should_stop or (lambda: False))
        finally:
            if own:
                eng.remove_sequence(sid)

    def prefill(self, sid: int, prompt_ids: list[int], should_stop: Callable[[], bool]):
        """Prefill ``prompt_ids`` on sequence ``sid`` in chunks of ``prefill_chunk``, polling
        ``should_stop`` before each. Returns ``(logits [1, vocab] of the last token, tokens
        prefilled)``; logits None if stopped before the end."""
        logits = None
        for a in range(0, len(prompt_ids), self.prefill_chunk):
            if should_stop():
                return None, a
            logits = self.engine.prefill([sid], [prompt_ids[a:a + self.prefill_chunk]])
        return logits, len(prompt_ids)

    def _generate(self, sid, prompt_ids, params, stream, should_stop) -> GenerationResult:
        eng = self.engine
        t_start = time.perf_counter()
        p0 = eng.stats.prefill_seconds
        logits, done = self.prefill(sid, prompt_ids, should_stop)
        if logits is None:
            return GenerationResult(text="", token_ids=[], prompt_tokens=len(prompt_ids),
                                    finish_reason="cancelled", prefill_seconds=0.0, decode_seconds=0.0,
                                    prefill_tokens=done, decode_tokens=0, first_token_seconds=0.0)
        prefill_s = eng.stats.prefill_seconds - p0
        d0 = eng.stats.decode_seconds
        state = Decoding(self, sid, len(prompt_ids), params, stream, t_start)
        try:
            tok = None
            if should_stop():
                state.cancel()
            else:
                tok = state.step(logits[0])
            while tok is not None:
                if should_stop():
                    state.cancel()
                    break
                logits = eng.decode([sid], [tok])
                tok = state.step(logits[0])
        finally:
            self.generated_tokens += len(state.out)  # also when interrupted (chat Ctrl-C)
        return state.result(prefill_s, eng.stats.decode_seconds - d0)

    def stats(self) -> dict:
        """Session totals: ``prefill_tokens``, ``decode_tokens`` (decode steps: a request's first
        token comes from its prefill, so N generated tokens take N - 1 steps),
        ``generated_tokens``, speeds, and the engine's cache use (``kda_slots`` counts one spare
        slot beyond the batch, for fork and rollback)."""
        s = self.engine.stats
        return {"prefill_tokens": s.prefill_tokens, "prefill_tokens_per_s": round(s.prefill_tokens_per_s, 2),
                "generated_tokens": self.generated_tokens, "decode_tokens": s.decode_tokens, "decode_tokens_per_s": round(s.decode_tokens_per_s, 2),
                **self.engine.cache_usage(), "context_window": self.engine.max_context}


class Decoding:
    """One request's decoding bookkeeping, shared by :meth:`LoadedModel.generate` and the
    server's batch scheduler: sampling, EOS, stop strings (the text is cut before the first
    match; the tail that could still grow into one is held back from ``stream``), the
    ``max_tokens`` and context limits. The caller runs the engine: it passes each logits row
    to :meth:`step` and decodes the token it returns, until :meth:`step` returns None."""

    def __init__(self, model: "LoadedModel", sid: int, prompt_tokens: int, params: SamplingParams,
                 stream: Callable[[str], None] | None, t_start: float):
        self.model, self.sid, self.prompt_tokens, self.params, self.stream = model, sid, prompt_tokens, params, stream
        self.eng = model.engine
        self.sampler = Sampler(params)
        self.eos = set() if params.ignore_eos else set(model.tokenizer.eos_ids)
        self.context = self.eng.tokens(sid)
        self.out: list[int] = []
        self.dec = model.tokenizer.stream_decoder(skip_special=True)
        self.text, self.emitted = "", 0
        self.finish = "length"
        self.cut_by_stop_string = False
        self.n_dec = 0
        self.t_start, self.first_tok = t_start, 0.0

    def step(self, logits_row) -> int | None:
        """Sample from ``logits_row`` (float32 ``[vocab]``); returns the token the caller must
        decode next, or None when the request is finished (EOS, stop string, limits)."""
        p = self.params
        t = self.sampler(logits_row, self.context)
        if not self.out:
            self.first_tok = time.perf_counter() - self.t_start
        if t in self.eos:
            self.finish = "stop"
            return None
        self.out.append(t)
        self.context.append(t)
        self.text += self.dec.feed(t)
        cut = min((i for i in (self.text.find(s) for s in p.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.finish, self.cut_by_stop_string = "stop", True
            return None
        if self.stream is not None:
            ready = len(self.text) - _stop_prefix_tail(self.text, p.stop)
            if ready > self.emitted:
                self.stream(self.text[self.emitted:ready])
                self.emitted = ready
        if len(self.out) >= p.max_tokens or self.eng.length(self.sid) + 1 > self.eng.max_context:
            return None
        self.n_dec += 1
        return t

    def cancel(self) -> None:
        self.finish = "cancelled"

    def result(self, prefill_seconds: float, decode_seconds: float) -> GenerationResult:
        """Flush the decoder and the held-back text; the request's GenerationResult."""
        if not self.cut_by_stop_string:  # a stop string cut the text: what follows it is dropped
            self.text += self.dec.flush()
        if self.stream is not None and len(self.text) > self.emitted:
            self.stream(self.text[self.emitted:])
            self.emitted = len(self.text)
        return GenerationResult(text=self.text, token_ids=self.out, prompt_tokens=self.prompt_tokens,
                                finish_reason=self.finish, prefill_seconds=prefill_seconds,
                                decode_seconds=decode_seconds, prefill_tokens=self.prompt_tokens,
                                decode_tokens=self.n_dec, first_token_seconds=self.first_tok)


def _stop_prefix_tail(text: str, stops) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class ChatSession:
    """A multi-turn chat on one engine sequence. Each turn renders the whole conversation with
    the chat template and prefills only what the cache does not already hold (the cache is
    reset when the rendering does not extend it)."""

    def __init__(self, model: LoadedModel, system: str | None = None):
        self.model = model
        self.system = system
        self.messages: list[dict] = []
        self.seq = model.engine.add_sequence()

    def reset(self) -> None:
        self.messages = []
        self.model.engine.reset(self.seq)

    def send(self, text: str, params: SamplingParams, stream: Callable[[str], None] | None = None
             ) -> GenerationResult:
        eng = self.model.engine
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        msgs = msgs + [{"role": "user", "content": text}]
        ids = self.model.tokenizer.encode_chat(msgs)
        cached = eng.tokens(self.seq)
        if cached and len(ids) > len(cached) and ids[:len(cached)] == cached:
            new = ids[len(cached):]
        else:
            new = ids
            if cached:
                eng.reset(self.seq)
        self.model.check_prompt(len(new), len(ids) - len(new))
        res = self.model.generate(new, params, stream, seq_id=self.seq)
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": res.text}]
        return res

    def close(self) -> None:
        self.model.engine.remove_sequence(self.seq)


# ---------------------------------------------------------------------- loading
def _model_kind(model_dir: Path) -> str:
    from ..convert import INCOMPLETE_MARKER, PARAMS_INDEX

    if model_dir.is_file():
        raise ModelLoadError(f"{model_dir} is a file; generate/chat need a model directory with weights "
                             "(a config.json alone is enough for `k3 inspect` and `k3 compile`)")
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    if (model_dir / INCOMPLETE_MARKER).exists() or re.search(r"\.tmp-\d+$", model_dir.name):
        raise ModelLoadError(f"{model_dir} is an incomplete `k3 convert-weight` output (the conversion "
                             "was interrupted); delete it and convert again")
    if (model_dir / PARAMS_INDEX).is_file():
        return "converted"
    if any(model_dir.glob("*.safetensors")):
        return "checkpoint"
    raise ModelLoadError(f"{model_dir} has neither {PARAMS_INDEX} (a `k3 convert-weight` output) nor "
                         "*.safetensors checkpoint shards")


def _load_converted(model_dir: Path, meta_params: list, device, progress: bool,
                    check: Callable[[str, np.ndarray], None]) -> list:
    import tvm

    from ..convert import PARAMS_INDEX
    from ..loader import to_param_dtype
    from ..weights import SAFETENSORS_DTYPES, CheckpointError, map_tensor, read_header

    try:
        index = json.loads((model_dir / PARAMS_INDEX).read_text())
        entries = index["params"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{model_dir / PARAMS_INDEX}: malformed ({e})") from None
    names = [e["name"] for e in entries]
    want = [p[0] for p in meta_params]
    if names != want:
        missing = [n for n in want if n not in set(names)]
        extra = [n for n in names if n not in set(want)]
        raise ModelLoadError(
            f"{model_dir}: its parameter list does not match the library's ({len(names)} vs {len(want)} "
            f"parameters; missing {missing[:3]}, unexpected {extra[:3]}"
            + ("; same names in another order" if not missing and not extra else "") + ")")
    files = sorted({e["file"] for e in entries})
    gone = [f for f in files if not (model_dir / f).is_file()]
    if gone:
        raise ModelLoadError(f"{model_dir}: parameter shard(s) listed in {PARAMS_INDEX} are missing: "
                             + ", ".join(gone))
    headers = {}
    for f in files:
        try:
            headers[f] = read_header(model_dir / f)
        except CheckpointError as e:
            raise ModelLoadError(str(e)) from None
    it = zip(entries, meta_params)
    if progress:
        from tqdm import tqdm

        it = tqdm(list(it), desc="loading parameters", unit="tensor", file=sys.stderr)
    out = []
    for e, (name, shape, dtype) in it:
        header, start = headers[e["file"]]
        info = header.get(name)
        if info is None:
            raise ModelLoadError(f"{model_dir / e['file']}: has no tensor {name} (named by {PARAMS_INDEX})")
        if list(info["shape"]) != list(shape):
            raise ModelLoadError(f"parameter {name}: {model_dir / e['file']} has shape {info['shape']}, the "
                                 f"library expects {list(shape)}")
        dname = SAFETENSORS_DTYPES[info["dtype"]][1]
        if dname != dtype and (dname == "uint8" or dtype == "uint8"):
            raise ModelLoadError(f"parameter {name}: {model_dir} holds {dname}, the library expects {dtype}")
        arr = map_tensor(model_dir / e["file"], info["dtype"], start + info["data_offsets"][0], shape)
        check(name, arr)
        out.append(tvm.runtime.tensor(np.ascontiguousarray(to_param_dtype(arr, dtype, name)), device))
    return out


def _load_checkpoint(model_dir: Path, cfg: K3Config, meta_params: list, device, progress: bool,
                     check: Callable[[str, np.ndarray], None]) -> list:
    from ..loader import upload_parameters
    from ..weights import CheckpointReader

    reader = CheckpointReader(model_dir, cfg)
    reader.validate()
    return upload_parameters(reader.get, [(n, tuple(s), d) for n, s, d in meta_params], cfg.num_experts,
                             device, check, progress)


def _code_layout(meta: dict, lib: Path) -> str:
    """The library's ``expert_code_layout`` (``ocp`` when absent).

    Raises:
        ModelLoadError: a layout this runtime does not know."""
    from schedules.mxfp4_tc_layout import LAYOUT

    layout = meta.get("expert_code_layout", "ocp")
    if layout not in ("ocp", LAYOUT):
        raise ModelLoadError(f"library {lib}: expert_code_layout {layout!r} is unknown to this runtime "
                             f"(it knows 'ocp' and {LAYOUT!r}); recompile it with this k3-compile")
    return layout


def _scale_check(layout: str) -> Callable[[str, np.ndarray], None]:
    """Per-tensor host check before upload (:func:`k3_compile.loader.check_expert_scales`),
    as a ModelLoadError."""
    from ..loader import check_expert_scales

    def check(name: str, arr: np.ndarray) -> None:
        try:
            check_expert_scales(name, arr, layout)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None

    return check


def _mismatch(lib: Path, meta: dict, what_lib: str, what_here: str) -> ModelLoadError:
    return ModelLoadError(f"library {lib} was compiled for {what_lib}, {what_here}; recompile it with "
                          "`k3 compile` for this model and device (or drop --lib to use the cache)")


def load_model(model_dir: str | Path, lib: str | Path | None = None, device: str = "cpu", *,
               dtype: str | None = None, max_batch_size: int | None = None,
               context_window: int | None = None, prefill_chunk: int | None = None,
               progress: bool = False, log: Callable[[str], None] | None = None,
               verbose: bool = False) -> LoadedModel:
    """Load ``model_dir`` with the compiled library ``lib`` on ``device``.

    Args:
        lib: a library from ``k3 compile``; None compiles for the device's default target into
            the cache (:func:`k3_compile.compile.cache_path`, ``K3_CACHE_DIR`` overrides the
            directory) on first use and reuses it afterwards.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: the library dtype wanted (checked against ``lib``'s; picks the cached library).
        max_batch_size / context_window / prefill_chunk: override the library's defaults;
            on GPU the MLA page pool is also capped by free device memory.
        log: progress messages (compiling into the cache, page-pool capping).
        verbose: also log which library is used and where the parameters come from.
    Raises:
        ModelLoadError with a one-line reason; ConfigError / CheckpointError / TokenizerError.
    """
    t0 = time.time()
    say = log or (lambda _m: None)
    detail = say if verbose else (lambda _m: None)
    model_dir = Path(model_dir)
    kind_dev, index = parse_device(device)
    kind = _model_kind(model_dir)
    cfg = K3Config.from_file(model_dir)
    spec = device_target(kind_dev, index)
    if dtype is not None and dtype not in ("float32", "bfloat16"):
        raise ModelLoadError(f"--dtype {dtype!r}: expected bfloat16 or float32")
    from ..compile import cache_path, compile_model, default_dtype

    if lib is None:
        lib = cache_path(cfg, spec.name, dtype or default_dtype(spec))
        if not lib.is_file():
            say(f"no cached library for config {cfg.summary_hash()} / {spec.name}; compiling {lib}")
            compile_model(model_dir, spec.name, lib, dtype=dtype or default_dtype(spec), log=log)
        else:
            detail(f"using cached library {lib}")
    lib = Path(lib)
    if not lib.is_file():
        raise ModelLoadError(f"library {lib} does not exist (build one with `k3 compile`)")
    with open(lib, "rb") as f:
        head = f.read(262)
    if not (head.startswith((b"\x7fELF", b"MZ", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xca\xfe\xba\xbe"))
            or head[257:262] == b"ustar"):
        raise ModelLoadError(f"library {lib}: not a shared library (ELF, Mach-O, PE) or a library archive; "
                             "give the file `k3 compile` wrote")

    import tvm
    from tvm.runtime.vm import VirtualMachine

    from ..compile import CompileError, read_metadata

    if kind_dev == "cuda":
        _ensure_cuda_runtime()
    try:
        module = tvm.runtime.load_module(str(lib))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else repr(e)
        m = re.search(r"created using \{(\w+)\}", msg)
        if m and m.group(1) != spec.device:
            raise ModelLoadError(f"library {lib} was compiled for a {m.group(1)} target (it holds "
                                 f"{m.group(1)} device code), the device is {device} (target {spec.name}); "
                                 "compile it for this device with `k3 compile` (or drop --lib)") from None
        raise ModelLoadError(f"cannot load library {lib}: {msg}") from None
    try:
        meta = read_metadata(VirtualMachine(module, tvm.runtime.cpu()))
    except CompileError as e:
        raise ModelLoadError(f"library {lib}: {e}") from None
    except Exception as e:
        raise ModelLoadError(f"library {lib}: cannot read its metadata ({str(e).splitlines()[0]})") from None

    from ..compile import KNOWN_METADATA_FORMATS

    if meta.get("format") not in KNOWN_METADATA_FORMATS:
        raise ModelLoadError(f"library {lib}: metadata format {meta.get('format')!r} is unknown to this "
                             f"runtime (it reads {', '.join(KNOWN_METADATA_FORMATS)}); recompile it with "
                             "this k3-compile or update k3-compile")
    here_hash = cfg.summary_hash()
    if meta.get("config_hash") != here_hash:
        raise _mismatch(lib, meta, f"config hash {meta.get('config_hash')} / target {meta.get('target')}",
                        f"model dir {model_dir} has config hash {here_hash}")
    if meta.get("target_device") != spec.device:
        raise _mismatch(lib, meta, f"target {meta.get('target')} (device kind {meta.get('target_device')})",
                        f"the device is {device} (target {spec.name})")
    if spec.is_cuda and meta.get("nvcc_arch") and meta.get("nvcc_arch") != spec.nvcc_arch:
        raise _mismatch(lib, meta, f"target {meta.get('target')} ({meta.get('nvcc_arch')})",
                        f"the device {device} needs {spec.name} ({spec.nvcc_arch})")
    if dtype is not None and meta.get("dtype") != dtype:
        raise _mismatch(lib, meta, f"dtype {meta.get('dtype')}", f"--dtype {dtype} was asked for")

    dev = spec.tvm_device(index)
    vm = VirtualMachine(module, dev) if kind_dev != "cpu" else VirtualMachine(module, tvm.runtime.cpu())
    meta_params = [(n, tuple(s), d) for n, s, d in meta["params"]]
    detail(f"loading parameters from {model_dir} ({kind})")
    layout = _code_layout(meta, lib)
    check = _scale_check(layout)
    if kind == "converted":
        params = _load_converted(model_dir, meta_params, dev, progress, check)
    else:
        params = _load_checkpoint(model_dir, cfg, meta_params, dev, progress, check)
    from ..loader import ParameterError, repack_expert_codes

    try:
        params = repack_expert_codes(vm, layout, [n for n, _, _ in meta_params], params)
    except ParameterError as e:
        raise ModelLoadError(f"library {lib}: {e}") from None

    # ---- sizing
    page = int(meta["page_size"])
    def pick(given, *fallbacks):
        return int(given if given is not None else next(f for f in fallbacks if f))

    mbs = pick(max_batch_size, meta.get("max_batch_size"), 1)
    ctx = pick(context_window, meta.get("context_window"), cfg.max_position_embeddings)
    chunk = pick(prefill_chunk, meta.get("prefill_chunk"), 512)
    problem = cfg.runtime_size_error(mbs, ctx, chunk)
    if problem:
        raise ModelLoadError(problem)
    pages_per_seq = math.ceil(ctx / page)
    num_pages = pages_per_seq * mbs
    slots = mbs + 1  # one spare for fork/checkpoint
    plan = meta.get("memory_plan", {})
    if kind_dev != "cpu":
        free = int(dev.available_global_memory or 0)
        if free:
            budget = free * GPU_MEMORY_FRACTION - slots * plan.get("kda_state_bytes_per_seq", 0)
            per_page = plan.get("mla_cache_bytes_per_token", 0) * page
            if per_page:
                fit = int(budget // per_page)
                if fit < pages_per_seq:
                    raise ModelLoadError(
                        f"{device}: {free / 2**30:.1f} GiB free is not enough for one sequence of "
                        f"{ctx} tokens plus {slots} KDA state slots; lower --context-window")
                if fit < num_pages:
                    say(f"MLA page pool capped by free memory: {fit} of {num_pages} pages")
                    num_pages = fit
    engine = Engine(vm, params, cfg, dev, dtype=meta["dtype"], max_slots=slots, num_pages=num_pages,
                    page_size=page, max_pages_per_seq=pages_per_seq)

    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    gen = {}
    gpath = model_dir / "generation_config.json"
    if gpath.is_file():
        try:
            gen = json.loads(gpath.read_text())
        except json.JSONDecodeError:
            gen = {}
    return LoadedModel(engine=engine, tokenizer=tok, metadata=meta, cfg=cfg, model_dir=model_dir,
                       lib_path=lib, device=device, prefill_chunk=chunk, context_window=engine.max_context,
                       generation_defaults=gen, load_seconds=time.time() - t0)


__all__ = ["ChatSession", "EngineError", "GenerationResult", "LoadedModel", "ModelLoadError",
           "load_model", "parse_device", "device_target"]
