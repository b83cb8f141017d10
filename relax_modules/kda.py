"""The KDA (Kimi Delta Attention) layer, spec ``K3-ARCHITECTURE.md`` §3 "KDA layer".

Works on the flat ragged batch of ``docs/DESIGN.md``: ``x [T, hidden]`` with a
:class:`~relax_modules.common.ForwardMeta`; the per-sequence state lives in the pooled tensors
``kda_state [n_kda_layers, max_slots, H, K, V]`` and ``conv_state
[n_kda_layers, max_slots, 3, W-1, H*K]`` (float32), updated in place by the TIR kernels of
``schedules/kda_generic.py`` and returned so the writes stay live.

Parameter names are the checkpoint's under ``self_attn.`` (the parent module names this layer
``self_attn``). Also here: :class:`KDAStateOps`, the slot reset / fork functions the runtime
calls on the pools.
"""

from __future__ import annotations

from tvm import tirx as tir
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from k3_compile.config import K3Config
from relax_modules.common import ForwardMeta
from relax_modules.layers import Linear
from schedules.kda_decode_cuda import (decode_tiling, kda_decode_conv_dispatch, kda_decode_conv_fused_kernel,
                                       kda_decode_fused_kernel)
from schedules.kda_prefill_cuda import C as TC_CHUNK
from schedules.kda_prefill_cuda import max_chunks
from schedules.kda_prefill_fused import (
    PIPE_MAX_BLOCK_V,
    TMAT_MAX_BLOCK_V,
    kda_prefill_fused_kernel,
    kda_prefill_split_intra_kernel,
    kda_prefill_split_kernel,
)
from schedules.kda_prefill_tc import kda_prefill_intra_tc_kernel, kda_prefill_state_tc_kernel
from schedules.kda_generic import (
    kda_chunk_prefill_kernel,
    kda_decode_kernel,
    short_conv_kernel,
    slot_copy_kernel,
    slot_reset_kernel,
)

L2_NORM_EPS = 1e-6  # spec §3 step 2 (fla's l2norm eps)
CONV_Q, CONV_K, CONV_V = 0, 1, 2  # index into conv_state dim 2
# heads from which the fused one-kernel prefill is dispatched (one block per sequence and head
# must fill a good part of the GPU's SMs; 132 on the H200); the split form below
FUSED_PREFILL_MIN_HEADS = 48
PREFILL_FORMS = ("generic", "two_kernel", "fused", "split")


def prefill_dispatch(heads: int) -> tuple[str, int | None, int | None]:
    """(form, block_v, a_batch) of the tensor-core KDA prefill for ``heads`` KDA heads (K = V =
    128; block_v None: chosen at run time), from the H200 runs
    (benchmarks/results/kda_prefill_split_h200_2026-11-30.json):

    - from 48 heads the fused one-kernel form (schedules/kda_prefill_fused.py, ``p2_one``,
      ``ldsm``, ``v_async``, ``fast_gate`` and ``o_vec``; one block per sequence, head and
      block_v columns): 128 columns from 96 heads (K3 with the L2 norms, gate and β inside:
      2.36 ms at 8192 tokens, 1.84 ms at 4 × 2048,
      benchmarks/results/kda_prefill_p2one_final_h200_2026-12-01.json; on Hopper with phases 3
      and 5 on wgmma 2.11 / 1.60 ms, fla's gated call 2.83 / 2.80 ms in the same run,
      kda_prefill_wgmma_fla_h200_2026-12-01.json; wgmma is not measured at 64 columns, so 48-95
      heads keep mma.sync; the split form at best
      3.51 / 3.20 ms without them, kda_prefill_split_h200_2026-11-30.json), 64 below (not
      measured at 48);
    - below 48 heads the split form (all chunks' intra part in parallel, then ~5.5 µs per
      chunk of state pass), its block_v chosen at run time by the number of sequences
      (schedules.kda_prefill_fused.split_block_v): 12 heads, one sequence of 8192 tokens 0.92
      ms at 16 columns (32: 0.99; the fused kernel at best 1.79), four of 2048 0.52 ms at 64
      (32: 0.63, 16: 0.77); as dispatched now (the intra kernel with ``p2_one``,
      ``fast_gate`` and ``tmat``, the state kernel with ``o_vec``, ``tmat``, ``pipe`` and
      ``v_early``), with the preprocessing, 0.77 / 0.49 ms
      (benchmarks/results/kda_prefill_vearly_h200_2026-12-01.json; without the last three 0.89 /
      0.48 ms, kda_prefill_p2one_final_h200_2026-12-01.json); both kernels in one PrimFunc
      (kda_prefill_split_kernel), which for one sequence overlaps them in one kernel: 0.75 ms
      (kda_prefill_overlap_bv32_1_h200_2026-12-01.json); on Hopper with phase 3 of every state
      kernel on wgmma 0.72 / 0.48 ms against 0.75 / 0.51 without
      (kda_prefill_wgmma_d12_h200_2026-12-01.json).

    a_batch 4 at 128 columns keeps ptxas at 255 registers without spills."""
    if heads >= 96:
        return "fused", 128, 4
    if heads >= FUSED_PREFILL_MIN_HEADS:
        return "fused", 64, 8
    return "split", None, None


class ShortConv1d(nn.Module):
    """Holds ``*_conv1d.weight`` ``[H*K, 1, W]`` float32 (depthwise, no bias)."""

    def __init__(self, channels: int, kernel_size: int):
        self.weight = nn.Parameter((channels, 1, kernel_size), "float32")


class HeadRMSNormWeight(nn.Module):
    """Holds ``o_norm.weight`` ``[K]`` float32."""

    def __init__(self, head_dim: int):
        self.weight = nn.Parameter((head_dim,), "float32")


def _i32(v: int) -> tir.IntImm:
    return tir.IntImm("int32", v)


class KimiDeltaAttention(nn.Module):
    """KDA layer (spec §3). H = ``kda_num_heads``, K = V = ``kda_head_dim``, W = conv width.

    Parameters (checkpoint names under ``self_attn.``; Linear weights ``[out, in]``, no bias):
    ``q_proj``, ``k_proj``, ``v_proj`` [H*K, hidden]; ``{q,k,v}_conv1d.weight`` [H*K, 1, W] f32;
    ``f_a_proj`` [K, hidden]; ``f_b_proj`` [H*K, K]; ``b_proj`` [H, hidden];
    ``A_log`` [H] f32; ``dt_bias`` [H*K] f32; ``o_norm.weight`` [K] f32;
    ``g_proj`` [H*K, hidden]; ``o_proj`` [hidden, H*K]. Others in the model dtype.
    """

    def __init__(self, config: K3Config, dtype: str = "float32", gpu: bool = False,
                 tuned: bool = True, wgmma: bool = False):
        self.gpu = gpu  # thread-bound kernel variants (schedules/kda_generic.py)
        # GPU decode: the fused hand-written kernel (schedules/kda_decode_cuda.py) where its
        # tiling fits the head size; ``tuned=False`` keeps the generic kernel (fallback).
        self.decode_tiling = decode_tiling(config.kda_head_dim) if gpu and tuned else None
        self.H = H = config.kda_num_heads
        self.K = K = config.kda_head_dim
        self.W = W = config.short_conv_kernel_size
        # ... and with the short convolutions inside (one block a head, kda_decode_conv_fused_kernel:
        # one launch instead of the generic convolution's six and the decode kernel; 1.65-21x the
        # chain's speed at K3's shapes, benchmarks/results/kda_decode_conv_h200_2026-12-02.json):
        # (k_split, vec, norm_inside), step 6's head norm and gate inside below 48 heads
        self.decode_conv = (kda_decode_conv_dispatch(H, K) if self.decode_tiling is not None and W >= 2
                            else None)
        self.lower_bound = lb = config.gate_lower_bound
        # GPU prefill: the chunked kernels on tensor cores (schedules/kda_prefill_tc.py: TF32
        # products, fp32 state) for bf16 models with K = V = 128 and the lower-bound gate
        # (|g| ≤ 5.5 keeps the in-chunk exponentials of 16-row sub-blocks inside fp32); fp32
        # models keep the exact fp32 generic kernel.
        self.tc_prefill = (gpu and tuned and dtype == "bfloat16" and config.kda_head_dim == 128
                           and lb is not None and -5.5 <= lb < 0)
        # Which prefill kernels (PREFILL_FORMS): "generic" (schedules/kda_generic.py), the
        # tensor-core "two_kernel" form (kda_prefill_tc.py, kept as a baseline), "fused" or
        # "split" (kda_prefill_fused.py) by head count (``prefill_dispatch``), with
        # ``prefill_tiling`` = (block_v, a_batch) (split: None, block_v by the number of
        # sequences at run time); ``prefill_preprocess_in_kernel``: the fused /
        # split kernels do the L2 norms, gate and β themselves (from the raw q, k, gate input and
        # β logits) instead of the graph's ops
        form, bv, ab = prefill_dispatch(H)
        self.prefill_form = form if self.tc_prefill else "generic"
        self.prefill_tiling = None if bv is None else (bv, ab)
        self.prefill_preprocess_in_kernel = True
        # Hopper (``wgmma``: cuda-sm90a): the fused kernel at 128 columns runs phases 3 and 5 on
        # warpgroup MMA (``p3_wg=2``, ``p5_wg``), the split form's state kernels phase 3
        # (``p3_wg=2``; prefill_dispatch's numbers)
        self.prefill_wgmma = wgmma and (self.prefill_form == "split" or (self.prefill_form == "fused" and bv == 128))
        self.eps = config.rms_norm_eps
        self.dtype = dtype
        hidden, HK = config.hidden_size, H * K

        self.q_proj = Linear(hidden, HK, dtype)
        self.k_proj = Linear(hidden, HK, dtype)
        self.v_proj = Linear(hidden, HK, dtype)
        self.q_conv1d = ShortConv1d(HK, W)
        self.k_conv1d = ShortConv1d(HK, W)
        self.v_conv1d = ShortConv1d(HK, W)
        self.f_a_proj = Linear(hidden, K, dtype)
        self.f_b_proj = Linear(K, HK, dtype)
        self.b_proj = Linear(hidden, H, dtype)
        self.A_log = nn.Parameter((H,), "float32")
        self.dt_bias = nn.Parameter((HK,), "float32")
        self.o_norm = HeadRMSNormWeight(K)
        self.g_proj = Linear(hidden, HK, dtype)
        self.o_proj = Linear(HK, hidden, dtype)

    # -- pieces ------------------------------------------------------------------------
    def _short_conv(self, x, conv, which, meta, conv_state, kda_index):
        """Step 1 for one projection: SiLU(causal depthwise conv1d(x)) → [T, H*K] f32."""
        kernel = short_conv_kernel(self.H * self.K, self.W, self.dtype, gpu=self.gpu)
        conv_state, y = op.tensor_ir_inplace_op(
            kernel,
            "kda_short_conv",
            [x, conv.weight, meta.cu_seqlens, meta.token_seq, meta.seq_slots, conv_state,
             _i32(kda_index), _i32(which)],
            [5, -1],
            [nn.Tensor.placeholder(conv_state.shape, "float32"),
             nn.Tensor.placeholder(x.shape, "float32")],
        )
        return y, conv_state

    def _l2_normalize(self, x):
        """x / sqrt(Σ x² + 1e-6) over the last axis (f32)."""
        return x / op.sqrt(op.sum(op.square(x), axis=-1, keepdims=True) + L2_NORM_EPS)

    def _gate_input(self, x):
        """f = f_b(f_a(x)) [T, H, K] f32, the decay gate's input (step 3)."""
        return op.astype(op.reshape(self.f_b_proj(self.f_a_proj(x)), (x.shape[0], self.H, self.K)),
                         "float32")

    def _beta_logits(self, x):
        """b_proj(x) [T, H] f32, β before its sigmoid (step 4)."""
        return op.astype(self.b_proj(x), "float32")

    def _decay_gate(self, f):
        """Step 3: log-space per-channel decay g [T, H, K] f32 from f = f_b(f_a(x)) [T, H, K]."""
        a = op.reshape(op.exp(self.A_log), (1, self.H, 1))
        z = f + op.reshape(self.dt_bias, (1, self.H, self.K))
        if self.lower_bound is not None:
            return op.sigmoid(a * z) * self.lower_bound        # lb·σ(exp(A_log)·(f + dt_bias))
        return op.negative(a * op.softplus(z))                 # −exp(A_log)·softplus(f + dt_bias)

    # -- forward -----------------------------------------------------------------------
    def forward(self, x: nn.Tensor, meta: ForwardMeta, kda_state: nn.Tensor,
                conv_state: nn.Tensor, kda_index: int, decode: bool):
        """x [T, hidden] (model dtype) → (out [T, hidden], kda_state, conv_state).

        ``decode``: every sequence has exactly one token (T == B, token b ↔ sequence b) and the
        recurrent kernel is used; otherwise the chunked prefill kernel.
        """
        H, K = self.H, self.K
        T = x.shape[0]
        if decode and self.decode_conv is not None:
            return self._conv_fused_decode(x, meta, kda_state, conv_state, kda_index)
        # 1. q, k, v = SiLU(causal depthwise conv1d(W x)), conv state = last W-1 inputs
        q, conv_state = self._short_conv(self.q_proj(x), self.q_conv1d, CONV_Q, meta,
                                         conv_state, kda_index)
        k, conv_state = self._short_conv(self.k_proj(x), self.k_conv1d, CONV_K, meta,
                                         conv_state, kda_index)
        v, conv_state = self._short_conv(self.v_proj(x), self.v_conv1d, CONV_V, meta,
                                         conv_state, kda_index)
        q, k, v = (op.reshape(t, (T, H, K)) for t in (q, k, v))
        if decode and self.decode_tiling is not None:
            out, kda_state = self._fused_decode(x, q, k, v, meta, kda_state, kda_index)
            return out, kda_state, conv_state
        if (not decode and self.prefill_form in ("fused", "split") and self.prefill_preprocess_in_kernel
                and self.lower_bound is not None):
            # steps 2-5 in the kernels (L2 norms, gate and β inside)
            kda_state, o = self._tc_prefill_raw(x, q, k, v, meta, kda_state, kda_index)
            return self._output(x, o), kda_state, conv_state
        # 2. q, k L2-normalized per head (eps 1e-6); q scaled by K^-1/2 (inside the kernel)
        q, k = self._l2_normalize(q), self._l2_normalize(k)
        # 3. decay gate in log space, per channel
        g = self._decay_gate(self._gate_input(x))
        # 4. β = σ(b_proj x) per head
        beta = op.sigmoid(self._beta_logits(x))
        # 5. the delta-rule recurrence on S = kda_state[kda_index, slot] (in place)
        scale = K ** -0.5
        o_ty = nn.Tensor.placeholder((T, H, K), "float32")
        s_ty = nn.Tensor.placeholder(kda_state.shape, "float32")
        if decode:
            kda_state, o = op.tensor_ir_inplace_op(
                kda_decode_kernel(H, K, K, scale, gpu=self.gpu), "kda_decode",
                [q, k, v, g, beta, meta.seq_slots, kda_state, _i32(kda_index)],
                [6, -1], [s_ty, o_ty])
        elif self.prefill_form == "fused":
            kda_state, o = self._fused_prefill([q, k, v, g, beta], meta, kda_state, kda_index, None)
        elif self.prefill_form == "split":
            kda_state, o = self._split_prefill([q, k, g, beta], v, beta, meta, kda_state, kda_index, None)
        elif self.prefill_form == "two_kernel":
            kda_state, o = self._tc_prefill(q, k, v, g, beta, meta, kda_state, kda_index, scale)
        else:
            kda_state, o = op.tensor_ir_inplace_op(
                kda_chunk_prefill_kernel(H, K, K, scale, gpu=self.gpu), "kda_chunk_prefill",
                [q, k, v, g, beta, meta.cu_seqlens, meta.seq_slots, kda_state,
                 _i32(kda_index)],
                [7, -1], [s_ty, o_ty])
        return self._output(x, o), kda_state, conv_state

    def _tc_prefill_raw(self, x, q, k, v, meta, kda_state, kda_index):
        """Steps 2-5 in the fused or split kernels from the raw q, k [T, H, K] (after the short
        conv), v, the gate input f_b(f_a(x)) and the β logits b_proj(x). Returns
        ``(kda_state, o [T, H, K] f32)``."""
        f, b = self._gate_input(x), self._beta_logits(x)
        if self.prefill_form == "split":
            return self._split_prefill([q, k, f, b, self.A_log, self.dt_bias], v, b, meta, kda_state,
                                       kda_index, self.lower_bound)
        return self._fused_prefill([q, k, v, f, b, self.A_log, self.dt_bias], meta, kda_state, kda_index,
                                   self.lower_bound)

    def _fused_prefill(self, ins, meta, kda_state, kda_index, lower_bound):
        """Step 5 (with ``lower_bound`` also 2-4) in the fused kernel (``p2_one``, ``ldsm``,
        ``v_async``, ``fast_gate``, ``o_vec``; ``prefill_tiling``; with ``prefill_wgmma`` phases 3
        and 5 on wgmma): ``ins`` = q, k, v, g, β — or the raw q, k, v, f, b, A_log, dt_bias;
        the state in place. Returns ``(kda_state, o [T, H, K] f32)``."""
        T, H, K = ins[0].shape[0], self.H, self.K
        bv, ab = self.prefill_tiling
        return op.tensor_ir_inplace_op(
            kda_prefill_fused_kernel(H, K, K, K ** -0.5, block_v=bv, a_batch=ab, p2_one=True, ldsm=True,
                                     v_async=True, fast_gate=True, o_vec=True, lower_bound=lower_bound,
                                     p3_wg=2 if self.prefill_wgmma else False, p5_wg=self.prefill_wgmma),
            "kda_prefill_fused" + ("_pre" if lower_bound is not None else ""),
            ins + [meta.cu_seqlens, meta.seq_slots, kda_state, _i32(kda_index)],
            [len(ins) + 2, -1], [nn.Tensor.placeholder(kda_state.shape, "float32"),
                                 nn.Tensor.placeholder((T, H, K), "float32")])

    def _split_prefill(self, intra_in, v, beta, meta, kda_state, kda_index, lower_bound):
        """Step 5 (with ``lower_bound`` also 2-4) in the split form: the intra kernel over all
        chunks (``intra_in``: q, k, g, β — or the raw q, k, f, b, A_log, dt_bias; ``p2_one``,
        ``fast_gate``, ``tmat``), then phases 3-5 per chunk with the state in place (``beta``: β,
        or its logits b; ``o_vec``, ``tmat``, ``pipe``, ``v_early``); with block_v at run time (no
        ``prefill_tiling``) both in one PrimFunc (``_split_prefill_dispatched``). Returns
        ``(kda_state, o [T, H, K] f32)``."""
        T, H, K = v.shape[0], self.H, self.K
        B = meta.seq_slots.shape[0]
        f32 = "float32"
        if self.prefill_tiling is None:
            return self._split_prefill_dispatched(intra_in, v, meta, kda_state, kda_index, lower_bound)
        # a fixed tiling: two calls; tmat in both kernels or in neither (it changes what la holds),
        # where the state kernel's shared memory has room for it (and for pipe's second set of regions)
        bv, ab = self.prefill_tiling
        tmat = bv <= TMAT_MAX_BLOCK_V
        pipe = bv <= PIPE_MAX_BLOCK_V
        intra = kda_prefill_split_intra_kernel(H, K, K ** -0.5, lower_bound=lower_bound, p2_one=True,
                                               fast_gate=True, tmat=tmat)
        # e^Γ k, scale e^Γ q, e^{Γ_last−Γ} k, e^{Γ_last} per chunk, Aqk / Tᵀ and D^{-1} rows; ka
        # is written in place into an uninitialized buffer (a call_tir_inplace needs one in-place
        # output; the kernel writes every row of a sequence token)
        outs = [nn.Tensor.placeholder(shape, f32) for shape in
                ((T, H, K), (T, H, K), (T, H, K), (max_chunks(T, B), H, K), (T, H, TC_CHUNK), (T, H, 16))]
        ka, qa, kd, gl, la, dinv = op.tensor_ir_inplace_op(
            intra, "kda_prefill_split_intra" + ("_pre" if lower_bound is not None else ""),
            intra_in + [meta.cu_seqlens, op.empty((T, H, K), f32)], [len(intra_in) + 1] + [-1] * 5, outs)
        state = kda_prefill_fused_kernel(H, K, K, K ** -0.5, block_v=bv, a_batch=ab, split=True,
                                         lower_bound=lower_bound, o_vec=True, tmat=tmat, pipe=pipe, v_early=pipe)
        return op.tensor_ir_inplace_op(
            state, "kda_prefill_split_state" + ("_pre" if lower_bound is not None else ""),
            [ka, qa, kd, v, gl, la, dinv, beta, meta.cu_seqlens, meta.seq_slots, kda_state, _i32(kda_index)],
            [10, -1], [nn.Tensor.placeholder(kda_state.shape, f32), nn.Tensor.placeholder((T, H, K), f32)])

    def _split_prefill_dispatched(self, intra_in, v, meta, kda_state, kda_index, lower_bound):
        """The split form with block_v at run time, in one PrimFunc (kda_prefill_split_kernel):
        the intra kernel then the state kernel, or for one sequence both overlapped in one
        kernel (its item counters and flags: a zeroed int32 tensor). Returns ``(kda_state, o [T,
        H, K] f32)``."""
        T, H, K = v.shape[0], self.H, self.K
        B = meta.seq_slots.shape[0]
        f32 = "float32"
        flags = op.zeros((2 + max_chunks(T, B) * H,), "int32")
        n_in = len(intra_in)
        # out: the state and flags in place; the intra kernel's scratch (ka, qa, kd, gl, la, dinv), o
        outs = ([nn.Tensor.placeholder(kda_state.shape, f32), nn.Tensor.placeholder(flags.shape, "int32")]
                + [nn.Tensor.placeholder(shape, f32) for shape in
                   ((T, H, K), (T, H, K), (T, H, K), (max_chunks(T, B), H, K), (T, H, TC_CHUNK), (T, H, 16),
                    (T, H, K))])
        res = op.tensor_ir_inplace_op(
            kda_prefill_split_kernel(H, K, K, K ** -0.5, lower_bound=lower_bound,
                                     p3_wg=2 if self.prefill_wgmma else False),
            "kda_prefill_split" + ("_pre" if lower_bound is not None else ""),
            intra_in + [meta.cu_seqlens, meta.seq_slots, v, kda_state, flags, _i32(kda_index)],
            [n_in + 3, n_in + 4] + [-1] * 7, outs)
        return res[0], res[-1]

    def _tc_prefill(self, q, k, v, g, beta, meta, kda_state, kda_index, scale):
        """Step 5 on tensor cores: the intra-chunk kernel (w, u, qg, kg, Aqk per chunk row,
        the chunk decays ge), then the inter-chunk pass (state in place, o). Returns
        ``(kda_state, o [T, H, K] f32)``."""
        T, H, K = q.shape[0], self.H, self.K
        B = meta.seq_slots.shape[0]
        nc = (T + TC_CHUNK - 1) // TC_CHUNK + B  # schedules.kda_prefill_cuda.max_chunks
        f32 = "float32"
        outs = [nn.Tensor.placeholder(shape, f32) for shape in
                ((T, H, K), (T, H, K), (T, H, K), (T, H, K), (T, H, TC_CHUNK), (nc, H, K))]
        # w is written in place into an uninitialized buffer (the kernel writes every row; a
        # call_tir_inplace needs one in-place output), the others are fresh outputs
        w, u, qg, kg, aqk, ge = op.tensor_ir_inplace_op(
            kda_prefill_intra_tc_kernel(H, K, K, scale), "kda_prefill_intra_tc",
            [k, q, v, g, beta, meta.cu_seqlens, op.empty((T, H, K), f32)], [6] + [-1] * 5, outs)
        bv = 32 if H >= 48 else 16  # benchmarks/results/kda_prefill_h200_2026-11-29.json
        return op.tensor_ir_inplace_op(
            kda_prefill_state_tc_kernel(H, K, K, block_v=bv, a_batch=8), "kda_prefill_state_tc",
            [w, u, qg, kg, aqk, ge, meta.cu_seqlens, meta.seq_slots, kda_state, _i32(kda_index)],
            [8, -1], [nn.Tensor.placeholder(kda_state.shape, f32), nn.Tensor.placeholder((T, H, K), f32)])

    def _output(self, x, o):
        """Step 6: o = RMSNorm_{o_norm}(o) · σ(g_proj x) per head (fp32), then o_proj."""
        T, H, K = x.shape[0], self.H, self.K
        o = op.rms_norm(o, self.o_norm.weight, axes=-1, epsilon=self.eps)
        gate = op.sigmoid(op.astype(op.reshape(self.g_proj(x), (T, H, K)), "float32"))
        o = op.astype(op.reshape(o * gate, (T, H * K)), self.dtype)
        return self.o_proj(o)

    def _fused_decode(self, x, q, k, v, meta, kda_state, kda_index):
        """Steps 2–6 with 2–5 in one CUDA kernel (L2 norms, gate, β, recurrence; state in
        place), after the generic short convolution: the decode path where the conv-fused kernel
        does not apply (``decode_conv`` None, e.g. W = 1). Returns ``(out [T, hidden],
        kda_state)``."""
        T, H, K = x.shape[0], self.H, self.K
        f = op.astype(op.reshape(self.f_b_proj(self.f_a_proj(x)), (T, H, K)), "float32")
        b = op.astype(self.b_proj(x), "float32")
        cb, ks, vec = self.decode_tiling
        kernel = kda_decode_fused_kernel(H, K, K, self.lower_bound, cols_per_block=cb, k_split=ks, vec=vec)
        kda_state, o = op.tensor_ir_inplace_op(
            kernel, "kda_decode_fused",
            [q, k, v, f, b, self.A_log, self.dt_bias, meta.seq_slots, kda_state, _i32(kda_index)],
            [8, -1], [nn.Tensor.placeholder(kda_state.shape, "float32"),
                      nn.Tensor.placeholder((T, H, K), "float32")])
        return self._output(x, o), kda_state

    def _conv_fused_decode(self, x, meta, kda_state, conv_state, kda_index):
        """Steps 1–5 in one CUDA kernel (the q, k, v short convolutions and their window
        updates, L2 norms, gate, β, recurrence; both pools in place), with ``norm_inside`` of
        :attr:`decode_conv` also step 6's head norm and gate (RMSNorm · σ(g_proj x)); then
        o_proj. Returns ``(out [T, hidden], kda_state, conv_state)``."""
        T, H, K = x.shape[0], self.H, self.K
        # the projections in the order of the prefill path, so that the sibling-GEMV pass merges
        # them into the same function there and here
        xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        f = op.astype(op.reshape(self.f_b_proj(self.f_a_proj(x)), (T, H, K)), "float32")
        b = op.astype(self.b_proj(x), "float32")
        ks, vec, norm_inside = self.decode_conv
        args = [xq, xk, xv, self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight, f, b,
                self.A_log, self.dt_bias, meta.seq_slots, kda_state, conv_state, _i32(kda_index)]
        if norm_inside:
            args += [self.g_proj(x), self.o_norm.weight]
        kernel = kda_decode_conv_fused_kernel(H, K, self.W, self.lower_bound, self.dtype, k_split=ks, vec=vec,
                                              out_norm_eps=self.eps if norm_inside else None)
        kda_state, conv_state, o = op.tensor_ir_inplace_op(
            kernel, "kda_decode_conv_fused", args,
            [11, 12, -1], [nn.Tensor.placeholder(kda_state.shape, "float32"),
                           nn.Tensor.placeholder(conv_state.shape, "float32"),
                           nn.Tensor.placeholder((T, H, K), self.dtype if norm_inside else "float32")])
        if norm_inside:
            return self.o_proj(op.reshape(o, (T, H * K))), kda_state, conv_state
        return self._output(x, o), kda_state, conv_state


class KDAStateOps(nn.Module):
    """Slot operations on the KDA pools, for the runtime (all layers at once, in place).

    Export with ``export_tvm(spec={"reset_slot": {"kda_state": ..., "conv_state": ...,
    "slot": nn.spec.Int()}, "copy_slot": {..., "src": nn.spec.Int(), "dst": nn.spec.Int()}})``.
    Rollback is done by the runtime from snapshots (not here).
    """

    def __init__(self, config: K3Config, gpu: bool = False):
        self.gpu = gpu
        H, K, W = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        self.kda_inner = (H, K, K)
        self.conv_inner = (3, W - 1, H * K)

    @staticmethod
    def _flat(pool, inner):
        return op.reshape(pool, (pool.shape[0], pool.shape[1], _prod(inner)))

    def reset_slot(self, kda_state: nn.Tensor, conv_state: nn.Tensor, slot: tir.PrimExpr):
        """kda_state[:, slot] = 0; conv_state[:, slot] = 0. Returns both pools."""
        out = []
        for pool, inner in ((kda_state, self.kda_inner), (conv_state, self.conv_inner)):
            flat = self._flat(pool, inner)
            flat = op.tensor_ir_inplace_op(
                slot_reset_kernel(inner, gpu=self.gpu), "kda_slot_reset", [flat, _as_i64(slot)], [0],
                nn.Tensor.placeholder(flat.shape, "float32"))
            out.append(op.reshape(flat, pool.shape))
        return tuple(out)

    def copy_slot(self, kda_state: nn.Tensor, conv_state: nn.Tensor, src: tir.PrimExpr,
                  dst: tir.PrimExpr):
        """pool[:, dst] = pool[:, src] for both pools. Returns both pools."""
        out = []
        for pool, inner in ((kda_state, self.kda_inner), (conv_state, self.conv_inner)):
            flat = self._flat(pool, inner)
            flat = op.tensor_ir_inplace_op(
                slot_copy_kernel(inner, gpu=self.gpu), "kda_slot_copy", [flat, _as_i64(src), _as_i64(dst)],
                [0], nn.Tensor.placeholder(flat.shape, "float32"))
            out.append(op.reshape(flat, pool.shape))
        return tuple(out)


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


def _as_i64(e):
    """A slot index: a Python int or an int64 symbolic var (``nn.spec.Int()``)."""
    return tir.IntImm("int64", e) if isinstance(e, int) else e
