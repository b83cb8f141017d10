"""Generic (schedule-free) TIR kernels for the Gated MLA paged latent cache (spec §3, docs/DESIGN.md).

The cache pool (docs/DESIGN.md, "State lives in three pooled tensors"):

    mla_cache [n_mla_layers, num_pages, page_size, kv_lora_rank + qk_rope_head_dim]  (model dtype)

row ``mla_cache[mla_index, page, offset]`` holds one token's ``[RMSNorm(latent) | k_rope]``.
Token ``t`` of a flat ragged batch lives at

    page   = page_table[token_seq[t], token_pos[t] // page_size]
    offset = token_pos[t] % page_size

Two kernels, each with a readable NumPy reference beside it:

* :func:`mla_append_kernel` / :func:`mla_append_reference` — write this forward's rows (in place).
* :func:`mla_attend_kernel` / :func:`mla_attend_reference` — causal paged attention in the
  absorbed ("latent") form: for token ``t``, head ``h``

      s_j   = (q_lat[t,h]·c_j + q_rope[t,h]·k_rope_j) · scale,   j = 0 … token_pos[t]
      p     = softmax_j(s)                                        (fp32)
      o[t,h] = Σ_j p_j · c_j                                      ([kv_lora_rank], model dtype)

  where ``c_j`` / ``k_rope_j`` are the cached rows of the token's own sequence. The same kernel
  serves prefill (keys of this forward appended first) and decode (one token per sequence).
  ``q_lat = q_nope·W_UK`` and ``v = o·W_UVᵀ`` (the kv_b_proj absorption) happen in Relax
  (``relax_modules/mla.py``).

``mla_index`` (which layer's slice of the pool) is a scalar ``int64`` argument of both kernels,
so one compiled kernel serves every MLA layer.

The kernels are plain loops over (token, head) with fp32 online softmax. With ``gpu=False``
(default) they are serial loops for CPU targets (llvm). With ``gpu=True`` the same loops are
bound to threads (:func:`_bind_gpu`: tokens → ``blockIdx.x``, heads / row elements →
``threadIdx.x``) — a correct, unoptimized GPU fallback (checked to generate CUDA code; not
run on a device by the tests).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import tvm
from tvm.script import tirx as T

__all__ = [
    "mla_append_kernel",
    "mla_append_reference",
    "mla_attend_kernel",
    "mla_attend_reference",
    "cache_location",
]


# --------------------------------------------------------------------------- references
def cache_location(page_table: np.ndarray, token_seq: np.ndarray, token_pos: np.ndarray,
                   page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(page, offset) of every token of the flat batch: ``[T]`` int each."""
    page = page_table[token_seq, token_pos // page_size]
    offset = token_pos % page_size
    return page, offset


def mla_append_reference(mla_cache: np.ndarray, kv: np.ndarray, page_table: np.ndarray,
                         token_seq: np.ndarray, token_pos: np.ndarray, mla_index: int) -> np.ndarray:
    """Return a copy of ``mla_cache`` with ``kv [T, L+R]`` written at each token's slot."""
    out = mla_cache.copy()
    page, offset = cache_location(page_table, token_seq, token_pos, mla_cache.shape[2])
    out[mla_index, page, offset] = kv
    return out


def mla_attend_reference(q_lat: np.ndarray, q_rope: np.ndarray, mla_cache: np.ndarray,
                         page_table: np.ndarray, token_seq: np.ndarray, token_pos: np.ndarray,
                         mla_index: int, scale: float) -> np.ndarray:
    """Latent causal attention, fp32. ``q_lat [T,H,L]``, ``q_rope [T,H,R]`` → ``[T,H,L]`` fp32."""
    n_tok, _, lora = q_lat.shape
    page_size = mla_cache.shape[2]
    out = np.zeros(q_lat.shape, np.float32)
    for t in range(n_tok):
        pos = np.arange(token_pos[t] + 1)                       # keys j ≤ token_pos[t]
        rows = mla_cache[mla_index, page_table[token_seq[t], pos // page_size], pos % page_size]
        rows = rows.astype(np.float32)
        c, k_rope = rows[:, :lora], rows[:, lora:]               # [J, L], [J, R]
        s = (q_lat[t].astype(np.float32) @ c.T + q_rope[t].astype(np.float32) @ k_rope.T) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)                            # [H, J]
        out[t] = p @ c
    return out


# --------------------------------------------------------------------------- kernels
def _bind_gpu(func: tvm.tirx.PrimFunc, block: str) -> tvm.tirx.PrimFunc:
    """Bind the two loops around ``block`` to ``blockIdx.x`` / ``threadIdx.x``."""
    sch = tvm.s_tir.Schedule(func)
    outer, inner = sch.get_loops(sch.get_sblock(block))[:2]
    sch.bind(outer, "blockIdx.x")
    sch.bind(inner, "threadIdx.x")
    return sch.mod["main"]


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def mla_append_kernel(kv_lora_rank: int, qk_rope_head_dim: int, page_size: int,
                      dtype: str, gpu: bool = False) -> tvm.tirx.PrimFunc:
    """In-place append of this forward's cache rows.

    Args (TIR): ``mla_cache [NL, NP, page_size, L+R]`` dtype (in place),
    ``kv [T, L+R]`` dtype, ``page_table [B, MP]`` i32, ``token_seq [T]`` i32,
    ``token_pos [T]`` i32, ``mla_index`` int64.
    """
    D = kv_lora_rank + qk_rope_head_dim
    PS = page_size

    @T.prim_func(s_tir=True)
    def mla_append(var_cache: T.handle, var_kv: T.handle, var_page_table: T.handle,
                   var_token_seq: T.handle, var_token_pos: T.handle, mla_index: T.int64):
        T.func_attr({"tirx.is_scheduled": True, "tir.noalias": True})
        NL, NP, NT, B, MP = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        cache = T.match_buffer(var_cache, (NL, NP, PS, D), dtype)
        kv = T.match_buffer(var_kv, (NT, D), dtype)
        page_table = T.match_buffer(var_page_table, (B, MP), "int32")
        token_seq = T.match_buffer(var_token_seq, (NT,), "int32")
        token_pos = T.match_buffer(var_token_pos, (NT,), "int32")
        for t, d in T.grid(NT, D):
            with T.sblock("append"):
                pos: T.let[T.int32] = token_pos[t]
                page: T.let[T.int32] = page_table[token_seq[t], pos // PS]
                cache[mla_index, page, pos % PS, d] = kv[t, d]

    return _bind_gpu(mla_append, "append") if gpu else mla_append


@functools.cache  # a pure function of its sizes: one PrimFunc per model, not per layer
def mla_attend_kernel(num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, page_size: int,
                      scale: float, dtype: str, gpu: bool = False) -> tvm.tirx.PrimFunc:
    """Paged causal latent attention (see the module docstring for the formula).

    Args (TIR): ``q_lat [T, H, L]`` dtype, ``q_rope [T, H, R]`` dtype,
    ``mla_cache [NL, NP, page_size, L+R]`` dtype, ``page_table [B, MP]`` i32,
    ``token_seq [T]`` i32, ``token_pos [T]`` i32, ``mla_index`` int64; output ``o [T, H, L]`` dtype.
    Scores, softmax and the weighted sum are fp32 (online softmax).
    """
    H, L, R, PS = num_heads, kv_lora_rank, qk_rope_head_dim, page_size
    scale = float(scale)

    @T.prim_func(s_tir=True)
    def mla_attend(var_q_lat: T.handle, var_q_rope: T.handle, var_cache: T.handle,
                   var_page_table: T.handle, var_token_seq: T.handle, var_token_pos: T.handle,
                   mla_index: T.int64, var_out: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tir.noalias": True})
        NL, NP, NT, B, MP = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        q_lat = T.match_buffer(var_q_lat, (NT, H, L), dtype)
        q_rope = T.match_buffer(var_q_rope, (NT, H, R), dtype)
        cache = T.match_buffer(var_cache, (NL, NP, PS, L + R), dtype)
        page_table = T.match_buffer(var_page_table, (B, MP), "int32")
        token_seq = T.match_buffer(var_token_seq, (NT,), "int32")
        token_pos = T.match_buffer(var_token_pos, (NT,), "int32")
        out = T.match_buffer(var_out, (NT, H, L), dtype)
        for t, h in T.grid(NT, H):
            with T.sblock("attend"):
                q = T.sblock_alloc_buffer((L + R,), "float32", scope="local")      # [q_lat | q_rope] of (t, h)
                acc = T.sblock_alloc_buffer((L,), "float32", scope="local")        # Σ_j e^{s_j - m} c_j
                m = T.sblock_alloc_buffer((1,), "float32", scope="local")          # running max
                den = T.sblock_alloc_buffer((1,), "float32", scope="local")        # Σ_j e^{s_j - m}
                s = T.sblock_alloc_buffer((1,), "float32", scope="local")
                rescale = T.sblock_alloc_buffer((1,), "float32", scope="local")
                p = T.sblock_alloc_buffer((1,), "float32", scope="local")
                seq: T.let[T.int32] = token_seq[t]
                for d in T.serial(L):
                    q[d] = T.Cast("float32", q_lat[t, h, d])
                    acc[d] = T.float32(0)
                for d in T.serial(R):
                    q[L + d] = T.Cast("float32", q_rope[t, h, d])
                m[0] = T.float32(-3.0e38)
                den[0] = T.float32(0)
                for j in T.serial(token_pos[t] + 1):
                    page: T.let[T.int32] = page_table[seq, j // PS]
                    off: T.let[T.int32] = j % PS
                    # s_j = (q_lat·c_j + q_rope·k_rope_j) · scale
                    s[0] = T.float32(0)
                    for d in T.serial(L + R):
                        s[0] = s[0] + q[d] * T.Cast("float32", cache[mla_index, page, off, d])
                    s[0] = s[0] * T.float32(scale)
                    # online softmax: rescale the running sums to the new max
                    rescale[0] = T.exp(m[0] - T.max(m[0], s[0]))
                    m[0] = T.max(m[0], s[0])
                    p[0] = T.exp(s[0] - m[0])
                    den[0] = den[0] * rescale[0] + p[0]
                    for d in T.serial(L):
                        acc[d] = acc[d] * rescale[0] + p[0] * T.Cast("float32", cache[mla_index, page, off, d])
                for d in T.serial(L):
                    out[t, h, d] = T.Cast(dtype, acc[d] / den[0])

    return _bind_gpu(mla_attend, "attend") if gpu else mla_attend


def default_scale(qk_nope_head_dim: int, qk_rope_head_dim: int) -> float:
    """MLA softmax scale (qk_nope + qk_rope)^-½ (spec §3; mlx-lm ``q_head_dim**-0.5``)."""
    return 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)
