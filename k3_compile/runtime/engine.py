"""The runtime engine: sequences, the pooled KDA state and paged MLA cache, prefill/decode.

State layout and per-forward metadata are those of docs/DESIGN.md. The engine owns three
device tensors (``kda_state``, ``conv_state``, ``mla_cache``) that the compiled model
functions update in place, a slot allocator (one KDA state slot per live sequence) and a
page allocator (MLA cache pages of ``page_size`` tokens).

Sequence operations:
- ``add_sequence`` / ``remove_sequence``;
- ``fork``: a new sequence with a copy of the parent's KDA state and MLA pages;
- ``reset``: empty the sequence (zero state, free pages);
- ``checkpoint`` + ``rollback(n)``: KDA state cannot be un-applied, so a checkpoint copies the
  sequence's slot to a spare slot; ``rollback(n)`` restores it and replays the tokens kept
  since then (MLA entries past the new length are simply overwritten later). This is what
  speculative decoding's draft/verify needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..config import K3Config

# Names of the functions a compiled K3 library exports (relax_modules/model.py).
FN_EMBED = "embed"
FN_PREFILL = "prefill"
FN_PREFILL_ALL = "prefill_all_logits"
FN_DECODE = "decode"
FN_COPY_SLOT = "kda_copy_slot"
FN_RESET_SLOT = "kda_reset_slot"
FN_COPY_PAGE = "mla_copy_page"


class EngineError(RuntimeError):
    """A request the engine cannot serve (context full, no free slot, unknown sequence...)."""


@dataclass
class _Seq:
    slot: int
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # every token in the cache, in order
    ckpt_slot: int | None = None
    ckpt_len: int = 0


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Engine:
    """Runs a compiled K3 library on one device.

    Args:
        vm: a ``tvm.runtime.vm.VirtualMachine`` over the compiled library.
        params: the model parameters as device tensors, in the library's parameter order.
        cfg: the model config.
        device: the ``tvm.runtime.Device``.
        dtype: the model activation dtype the library was compiled with.
        max_slots: KDA state slots (live sequences + checkpoints).
        num_pages: MLA cache pages; ``page_size`` tokens each.
        max_pages_per_seq: page-table width; bounds one sequence's length to
            ``max_pages_per_seq * page_size`` tokens.

    Raises:
        EngineError: on requests beyond these limits, named.
    """

    def __init__(self, vm, params, cfg: K3Config, device, dtype: str = "float32",
                 max_slots: int = 8, num_pages: int = 256, page_size: int = 16,
                 max_pages_per_seq: int | None = None):
        import tvm

        self.vm, self.params, self.cfg, self.device = vm, list(params), cfg, device
        self.dtype = dtype
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_pages_per_seq = max_pages_per_seq or num_pages
        self.max_slots = max_slots
        n_kda, n_mla = len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)
        h, k = cfg.kda_num_heads, cfg.kda_head_dim
        w = cfg.short_conv_kernel_size
        # Allocate zeroed state (tvm.runtime.empty is uninitialised).
        self.kda_state = tvm.runtime.tensor(np.zeros((max(n_kda, 1), max_slots, h, k, k), np.float32), device)
        self.conv_state = tvm.runtime.tensor(
            np.zeros((max(n_kda, 1), max_slots, 3, w - 1, h * k), np.float32), device)
        self.mla_cache = tvm.runtime.tensor(
            np.zeros((max(n_mla, 1), num_pages, page_size, cfg.mla_cache_dim),
                     dtype=_np_dtype(dtype)), device)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self.stats = EngineStats()
        self._fns = {}

    # ------------------------------------------------------------------ plumbing
    def _fn(self, name: str):
        if name not in self._fns:
            self._fns[name] = self.vm[name]
        return self._fns[name]

    def _tensor(self, arr: np.ndarray):
        import tvm

        return tvm.runtime.tensor(np.ascontiguousarray(arr), self.device)

    def _take_slot(self) -> int:
        if not self._free_slots:
            raise EngineError(f"no free KDA state slot: all {self.max_slots} are in use "
                              "(raise max_slots / --max-batch-size)")
        return self._free_slots.pop()

    def _seq(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise EngineError(f"unknown sequence id {seq_id}") from None

    def _zero_slot(self, slot: int) -> None:
        self._fn(FN_RESET_SLOT)(self.kda_state, self.conv_state, _shape(slot), *self.params)

    def _copy_slot(self, src: int, dst: int) -> None:
        self._fn(FN_COPY_SLOT)(self.kda_state, self.conv_state, _shape(src), _shape(dst), *self.params)

    # ------------------------------------------------------------------ sequences
    @property
    def max_context(self) -> int:
        return min(self.max_pages_per_seq * self.page_size, self.cfg.max_position_embeddings)

    def add_sequence(self) -> int:
        """A new empty sequence; returns its id."""
        slot = self._take_slot()
        self._zero_slot(slot)
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq(slot=slot)
        return sid

    def remove_sequence(self, seq_id: int) -> None:
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise EngineError(f"unknown sequence id {seq_id}")
        self._free_slots.append(s.slot)
        if s.ckpt_slot is not None:
            self._free_slots.append(s.ckpt_slot)
        self._free_pages.extend(s.pages)

    def reset(self, seq_id: int) -> None:
        """Empty ``seq_id``: zero its KDA state and give its MLA pages back."""
        s = self._seq(seq_id)
        self._zero_slot(s.slot)
        self._free_pages.extend(s.pages)
        s.pages, s.tokens = [], []
        if s.ckpt_slot is not None:
            self._free_slots.append(s.ckpt_slot)
            s.ckpt_slot = None

    def fork(self, seq_id: int) -> int:
        """A new sequence continuing ``seq_id``: copies its KDA state and MLA cache pages."""
        s = self._seq(seq_id)
        child = self.add_sequence()
        c = self._seqs[child]
        self._copy_slot(s.slot, c.slot)
        try:
            self._grow_pages(c, len(s.tokens))
        except EngineError:
            self.remove_sequence(child)
            raise
        for src, dst in zip(s.pages, c.pages):
            self._fn(FN_COPY_PAGE)(self.mla_cache, _shape(src), _shape(dst), *self.params)
        c.tokens = list(s.tokens)
        return child

    def length(self, seq_id: int) -> int:
        return len(self._seq(seq_id).tokens)

    def tokens(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).tokens)

    def checkpoint(self, seq_id: int) -> None:
        """Remember ``seq_id``'s current KDA state so that :meth:`rollback` can return here."""
        s = self._seq(seq_id)
        if s.ckpt_slot is None:
            s.ckpt_slot = self._take_slot()
        self._copy_slot(s.slot, s.ckpt_slot)
        s.ckpt_len = len(s.tokens)

    def rollback(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of ``seq_id`` (restore the checkpoint, replay the rest).

        Raises:
            EngineError: no checkpoint, or ``n`` reaches before it.
        """
        s = self._seq(seq_id)
        if n <= 0:
            return
        target = len(s.tokens) - n
        if s.ckpt_slot is None or target < s.ckpt_len:
            raise EngineError(
                f"sequence {seq_id}: cannot roll back {n} tokens to length {target}: the last "
                f"checkpoint is at length {s.ckpt_len if s.ckpt_slot is not None else 'none'}")
        replay = s.tokens[s.ckpt_len:target]
        self._copy_slot(s.ckpt_slot, s.slot)
        s.tokens = s.tokens[:s.ckpt_len]
        if replay:
            self.prefill([seq_id], [replay])

    # ------------------------------------------------------------------ forward
    def _grow_pages(self, s: _Seq, new_len: int) -> None:
        need = -(-new_len // self.page_size)
        if need > self.max_pages_per_seq:
            raise EngineError(f"sequence length {new_len} exceeds the context window "
                              f"({self.max_context} tokens)")
        while len(s.pages) < need:
            if not self._free_pages:
                raise EngineError(f"MLA cache is full: all {self.num_pages} pages of "
                                  f"{self.page_size} tokens are in use")
            s.pages.append(self._free_pages.pop())

    def _meta(self, seqs: list[_Seq], chunks: list[list[int]]):
        lens = [len(c) for c in chunks]
        cu = np.zeros(len(chunks) + 1, np.int32)
        cu[1:] = np.cumsum(lens)
        token_seq = np.repeat(np.arange(len(chunks), dtype=np.int32), lens)
        token_pos = np.concatenate(
            [np.arange(len(s.tokens), len(s.tokens) + n, dtype=np.int32) for s, n in zip(seqs, lens)])
        width = max(1, max(len(s.pages) for s in seqs))
        table = np.full((len(seqs), width), -1, np.int32)
        for b, s in enumerate(seqs):
            table[b, :len(s.pages)] = s.pages
        slots = np.array([s.slot for s in seqs], np.int32)
        ids = np.concatenate([np.asarray(c, np.int32) for c in chunks])
        return ids, [cu, token_seq, token_pos, slots, table, (cu[1:] - 1).astype(np.int32)]

    def _run(self, fn_name: str, seq_ids: list[int], chunks: list[list[int]]) -> np.ndarray:
        if len(set(seq_ids)) != len(seq_ids):
            raise EngineError(f"a sequence appears twice in one batch: {seq_ids}")
        if len(seq_ids) != len(chunks) or any(len(c) == 0 for c in chunks):
            raise EngineError("every sequence in the batch needs at least one token")
        seqs = [self._seq(i) for i in seq_ids]
        for s, c in zip(seqs, chunks):
            bad = [t for t in c if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise EngineError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.cfg.vocab_size - 1})")
            self._grow_pages(s, len(s.tokens) + len(c))
        ids, meta = self._meta(seqs, chunks)
        embeds = self._fn(FN_EMBED)(self._tensor(ids), *self.params)
        out = self._fn(fn_name)(embeds, *[self._tensor(m) for m in meta],
                                self.kda_state, self.conv_state, self.mla_cache, *self.params)
        logits = out[0].numpy() if hasattr(out, "__getitem__") else out.numpy()
        for s, c in zip(seqs, chunks):
            s.tokens.extend(int(t) for t in c)
        return logits.astype(np.float32)

    def prefill(self, seq_ids: list[int], chunks: list[list[int]], all_logits: bool = False) -> np.ndarray:
        """Append ``chunks[b]`` to sequence ``seq_ids[b]`` (one ragged batch).

        Returns:
            float32 logits: ``[B, vocab]`` of each sequence's last token, or ``[T, vocab]``
            of every token (``all_logits``, in flat batch order).
        """
        t0 = time.perf_counter()
        logits = self._run(FN_PREFILL_ALL if all_logits else FN_PREFILL, seq_ids, chunks)
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prefill_tokens += sum(len(c) for c in chunks)
        return logits

    def decode(self, seq_ids: list[int], tokens: list[int]) -> np.ndarray:
        """One token for each sequence; returns float32 logits ``[B, vocab]``."""
        t0 = time.perf_counter()
        logits = self._run(FN_DECODE, seq_ids, [[t] for t in tokens])
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_tokens += len(tokens)
        return logits

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """``n`` greedy (argmax) tokens after ``ids`` in a fresh sequence, removed afterwards.

        The reference continuation for tests and GPU checks (``k3 generate`` samples through
        :mod:`k3_compile.runtime.model_runner`)."""
        s = self.add_sequence()
        try:
            logits = self.prefill([s], [ids])
            out: list[int] = []
            for _ in range(n):
                out.append(int(np.argmax(logits[0])))
                logits = self.decode([s], [out[-1]])
            return out
        finally:
            self.remove_sequence(s)

    def cache_usage(self) -> dict:
        used_pages = self.num_pages - len(self._free_pages)
        return {"sequences": len(self._seqs), "kda_slots_used": self.max_slots - len(self._free_slots),
                "kda_slots": self.max_slots, "mla_pages_used": used_pages, "mla_pages": self.num_pages,
                "page_size": self.page_size}


def _shape(v: int):
    """A symbolic-int argument (``nn.spec.Int``) is passed as a one-element shape tuple."""
    import tvm

    return tvm.runtime.ShapeTuple([int(v)])


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)
