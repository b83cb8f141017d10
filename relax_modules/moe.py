"""LatentMoE block of the K3 MoE layers (``block_sparse_moe``; spec §3 "MoE block").

Parameter names below are relative to ``model.layers.{i}.block_sparse_moe.`` and match the
checkpoint, except the routed experts, which the loader stacks (docs/DESIGN.md):

| name | shape | dtype |
|---|---|---|
| ``gate.weight`` | ``[E, hidden]`` | model dtype |
| ``gate.e_score_correction_bias`` | ``[E]`` | float32 |
| ``routed_expert_down_proj.weight`` | ``[L, hidden]`` | model dtype |
| ``routed_expert_norm.weight`` | ``[L]`` (only with ``latent_moe_use_norm``) | model dtype |
| ``routed_expert_up_proj.weight`` | ``[hidden, L]`` | model dtype |
| ``shared_experts.{gate,up}_proj.weight`` / ``down_proj.weight`` | ``[S, hidden]`` / ``[hidden, S]`` | model dtype |
| ``experts.w1`` / ``w3`` ``.weight_packed`` / ``.weight_scale`` | ``[E, I, L/2]`` / ``[E, I, L/32]`` | uint8 |
| ``experts.w2.weight_packed`` / ``.weight_scale`` | ``[E, L, I/2]`` / ``[E, L, I/32]`` | uint8 |
| (bf16 experts) ``experts.w{1,3}.weight`` / ``experts.w2.weight`` | ``[E, I, L]`` / ``[E, L, I]`` | model dtype |

(E = num_experts, L = latent_size, I = moe_intermediate_size,
S = moe_intermediate_size × num_shared_experts.)

Dtype flow (mirrors mlx-lm 0.32.2 ``KimiK3SparseMoE`` / ``SwitchGLU`` / ``_situ`` for the
bf16 path; in fp32 every cast is a no-op):

1. router: ``logits = x @ gate.weightᵀ`` with fp32 products and sums (spec "router in fp32";
   the same values as ``x32 @ gate.weight32ᵀ``: a model-dtype product is exact in fp32; mlx-lm
   instead rounds the gate matmul to bf16 before its fp32 sigmoid), then
   :func:`schedules.moe_generic.moe_route_kernel` (sigmoid, top-k of score + bias, lowest index
   wins ties, renormalize with +1e-20, × routed_scaling_factor); the weights are rounded to
   the model dtype (mlx-lm casts them to the input dtype).
2. ``z = routed_expert_down_proj x`` (model dtype).
3. ``g, u = w1 z, w3 z`` per chosen expert (MXFP4 gather GEMV, fp32 accumulation, rounded to
   the model dtype as mlx's quantized matmul output); ``a = SiTU(g, u)`` in fp32, rounded to
   the model dtype; ``o = w2 a`` (fp32 accumulation, rounded to the model dtype).
4. ``y = Σ_k w_k · o_k`` accumulated in **fp32** (spec; mlx-lm multiplies/sums in bf16),
   rounded to the model dtype; ``y = routed_expert_norm(y)`` (fp32 normalize, cast, × w);
   ``y = routed_expert_up_proj y``. (GPU bf16 builds: step 1's rounding of the weights, the
   combine and the norm in one kernel, :func:`schedules.moe_combine.moe_combine_kernel`.)
5. ``out = y + shared_experts(x)`` in the model dtype.
"""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from relax_modules.layers import Linear, RMSNorm, SiTUMLP, situ_glu
from schedules import moe_combine as mcb
from schedules import moe_generic as mg
from schedules import moe_mxfp4_cuda as mc
from schedules import moe_mxfp4_decode_tc as dt
from schedules import moe_mxfp4_prefill_cuda as mp
from schedules import moe_mxfp4_prefill_wgmma as mw
from schedules import mxfp4_tc_layout as tcl


def _private(func):
    """Drop the PrimFunc's ``global_symbol`` so Relax names it (tensor_ir_op ``name_hint``)."""
    return func.without_attr("global_symbol")


__all__ = ["MoEGate", "MXFP4StackedLinear", "StackedLinear", "RoutedExperts", "LatentMoE"]


class MoEGate(nn.Module):
    """Router parameters ``gate.weight [E, hidden]`` (model dtype) and
    ``gate.e_score_correction_bias [E]`` (fp32); forward gives ``(expert_ids [T, k] int32,
    weights [T, k] fp32)``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 routed_scaling_factor: float, renormalize: bool, dtype: str, gpu: bool = False):
        self.gpu = gpu
        self.num_experts = num_experts
        self.top_k = top_k
        self.routed_scaling_factor = routed_scaling_factor
        self.renormalize = renormalize
        self.weight = nn.Parameter((num_experts, hidden_size), dtype=dtype)
        self.e_score_correction_bias = nn.Parameter((num_experts,), dtype="float32")

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        n = x.shape[0]
        # fp32 products and sums of the model-dtype operands (exact products: a bf16 x bf16
        # product fits fp32), without an fp32 copy of the weight per call
        logits = op.matmul(x, op.permute_dims(self.weight, [1, 0]), out_dtype="float32")
        kernel = mg.moe_route_kernel(self.num_experts, self.top_k, self.routed_scaling_factor,
                                     self.renormalize, gpu=self.gpu)
        ids, w = op.tensor_ir_op(
            _private(kernel), "moe_route", [logits, self.e_score_correction_bias],
            [Tensor.placeholder([n, self.top_k], "int32"),
             Tensor.placeholder([n, self.top_k], "float32")],
        )
        return ids, w


class MXFP4StackedLinear(nn.Module):
    """Stacked MXFP4 experts ``weight_packed [E, N, K/2]``, ``weight_scale [E, N, K/32]``
    (uint8). forward(x ``[T, K]`` or ``[T, k, K]``, ids ``[T, k]`` int32) -> ``[T, k, N]``
    in ``out_dtype`` (fp32 accumulation)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, top_k: int,
                 gpu: bool = False):
        self.gpu = gpu
        self.E, self.K, self.N, self.top_k = num_experts, in_features, out_features, top_k
        self.weight_packed = nn.Parameter((num_experts, out_features, in_features // 2), dtype="uint8")
        self.weight_scale = nn.Parameter((num_experts, out_features, in_features // mg.MXFP4_GROUP),
                                         dtype="uint8")

    def forward(self, x: Tensor, ids: Tensor, out_dtype: str) -> Tensor:
        per_choice = len(x.shape) == 3
        kernel = mg.mxfp4_gather_gemv_kernel(self.N, self.K, self.E, self.top_k, per_choice,
                                             x.dtype, out_dtype, gpu=self.gpu)
        return op.tensor_ir_op(
            _private(kernel), "moe_mxfp4_gemv", [x, self.weight_packed, self.weight_scale, ids],
            Tensor.placeholder([x.shape[0], self.top_k, self.N], out_dtype),
        )


class StackedLinear(nn.Module):
    """Unquantized stacked experts ``weight [E, N, K]`` (model dtype); same forward as
    :class:`MXFP4StackedLinear`."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, top_k: int, dtype: str,
                 gpu: bool = False):
        self.gpu = gpu
        self.E, self.K, self.N, self.top_k = num_experts, in_features, out_features, top_k
        self.weight = nn.Parameter((num_experts, out_features, in_features), dtype=dtype)

    def forward(self, x: Tensor, ids: Tensor, out_dtype: str) -> Tensor:
        per_choice = len(x.shape) == 3
        kernel = mg.gather_gemv_kernel(self.N, self.K, self.E, self.top_k, per_choice,
                                       self.weight.dtype, x.dtype, out_dtype, gpu=self.gpu)
        return op.tensor_ir_op(
            _private(kernel), "moe_gemv", [x, self.weight, ids],
            Tensor.placeholder([x.shape[0], self.top_k, self.N], out_dtype),
        )


class RoutedExperts(nn.Module):
    """``experts.w1`` (gate), ``w3`` (up): L -> I; ``w2`` (down): I -> L. SiTU-GLU experts.

    forward(z ``[T, L]``, ids ``[T, k]``) -> ``[T, k, L]`` in the model dtype.
    """

    def __init__(self, num_experts: int, latent: int, inter: int, top_k: int, mxfp4: bool,
                 beta: float, beta_lin: float, dtype: str, gpu: bool = False, tuned: bool = True,
                 wgmma: bool = False):
        self.dtype = dtype
        self.beta, self.beta_lin = beta, beta_lin
        self.sizes = (num_experts, latent, inter, top_k)
        # CUDA: the tensor-core MXFP4 kernels, decode (schedules/moe_mxfp4_decode_tc.py) and
        # prefill (token permutation + grouped GEMM, schedules/moe_mxfp4_prefill_cuda.py), where
        # the widths fit their tiling (multiples of 128), activations are bf16 and indices fit
        # int32; else the generic kernels. Both or neither: the tensor-core kernels read the
        # codes in the tc layout (schedules/mxfp4_tc_layout.py), which the runtime produces at
        # load time (``code_layout``), the generic ones the checkpoint layout.
        self.tuned = (gpu and tuned and mxfp4 and dtype == "bfloat16"
                      and latent % dt.KB == 0 and inter % dt.KB == 0
                      and num_experts * inter * latent // 8 < 2 ** 31
                      and num_experts <= mp.PLAN_THREADS)
        self.code_layout = tcl.LAYOUT if self.tuned else "ocp"
        # Hopper: the prefill grouped GEMMs on warpgroup MMA (schedules/moe_mxfp4_prefill_wgmma.py)
        self.wgmma = self.tuned and wgmma
        if mxfp4:
            self.w1 = MXFP4StackedLinear(num_experts, latent, inter, top_k, gpu)
            self.w3 = MXFP4StackedLinear(num_experts, latent, inter, top_k, gpu)
            self.w2 = MXFP4StackedLinear(num_experts, inter, latent, top_k, gpu)
        else:
            self.w1 = StackedLinear(num_experts, latent, inter, top_k, dtype, gpu)
            self.w3 = StackedLinear(num_experts, latent, inter, top_k, dtype, gpu)
            self.w2 = StackedLinear(num_experts, inter, latent, top_k, dtype, gpu)

    def forward(self, z: Tensor, ids: Tensor, decode: bool = False) -> Tensor:
        if self.tuned:
            return self._decode_tuned(z, ids) if decode else self._prefill_tuned(z, ids)
        g = self.w1(z, ids, self.dtype)
        u = self.w3(z, ids, self.dtype)
        a = situ_glu(g, u, self.beta, self.beta_lin)  # fp32 inside, model dtype out
        return self.w2(a, ids, self.dtype)

    def _prefill_tuned(self, z: Tensor, ids: Tensor) -> Tensor:
        """Prefill (many tokens): pairs sorted into expert order with a tile table (one
        kernel), then the grouped MXFP4 GEMMs (W1/W3 + SiTU into expert order, W2 back
        into pair order) on tensor cores (``mma.sync``; on Hopper ``wgmma``, warp-specialized
        from ``mw.ws_min_pairs(E)`` pairs); only experts that received tokens are read."""
        E, L, I, k = self.sizes
        n = z.shape[0]
        pairs = n * k
        if self.wgmma:
            gu_kernel = mw.moe_grouped_gate_up_wgmma_kernel(E, L, I, k, self.beta, self.beta_lin)
            down_kernel = mw.moe_grouped_down_wgmma_kernel(E, L, I, k)
            # the wgmma kernels read the inputs of each 32 in their permuted order (a 4 x 4
            # transpose of the input pairs, mw.permuted_position) and write a_sorted so
            z = op.reshape(op.permute_dims(op.reshape(z, [n, L // 32, 4, 4, 2]), [0, 1, 3, 2, 4]), [n, L])
        else:
            gu_kernel = mp.moe_grouped_gate_up_kernel(E, L, I, k, self.beta, self.beta_lin)
            down_kernel = mp.moe_grouped_down_kernel(E, L, I, k)
        # wgmma: the GEMMs run warp-specialized on 192-row tiles from ws_min_pairs(E) pairs (where
        # the widths allow); the sort's tile table branches on the same count
        sort = mw.moe_sort_wgmma_kernel(E, L, I, k) if self.wgmma else mp.moe_sort_kernel(E, k)
        sorted_pair, tiles, num_tiles, _ = _fill(
            sort, "moe_sort", [ids],
            [([pairs], "int32"), ([mp.max_tiles(pairs, E, mw.BM_SMALL if self.wgmma else mp.BM), 3], "int32"),
             ([1], "int32"), ([E], "int32")])
        a = _fill(gu_kernel, "moe_grouped_gate_up",
                  [z, self.w1.weight_packed, self.w1.weight_scale, self.w3.weight_packed,
                   self.w3.weight_scale, sorted_pair, tiles, num_tiles], [([pairs, I], self.dtype)])
        w2p, w2s = self.w2.weight_packed, self.w2.weight_scale
        return _fill(down_kernel, "moe_grouped_down",
                     [a, w2p, w2s, w2p, w2s, sorted_pair, tiles, num_tiles], [([n, k, L], self.dtype)])

    def _decode_tuned(self, z: Tensor, ids: Tensor) -> Tensor:
        """Decode (a few tokens): chain tokens by expert, fused w1/w3 + SiTU, then w2 on
        tensor cores, each distinct expert's weights streamed once
        (schedules/moe_mxfp4_decode_tc.py)."""
        E, L, I, k = self.sizes
        n = z.shape[0]
        chain = _fill(mc.moe_expert_chain_kernel(k), "moe_expert_chain", [ids], [([n, k, 2], "int32")])
        a = _fill(dt.moe_mxfp4_gate_up_tc_kernel(E, L, I, k, self.beta, self.beta_lin,
                                                 warps=dt.split_k_warps(L)),
                  "moe_mxfp4_gate_up",
                  [z, self.w1.weight_packed, self.w1.weight_scale, self.w3.weight_packed,
                   self.w3.weight_scale, chain, ids], [([n, k, I], self.dtype)])
        return _fill(dt.moe_mxfp4_down_tc_kernel(E, L, I, k, warps=dt.split_k_warps(I)), "moe_mxfp4_down",
                     [a, self.w2.weight_packed, self.w2.weight_scale, chain, ids], [([n, k, L], self.dtype)])


def _fill(kernel, name: str, args: list, outs: list):
    """Call a hand-scheduled kernel that writes ``outs`` ((shape, dtype) pairs) into fresh
    buffers passed after ``args``; returns the output tensor (or the list of them).

    The kernels have no TIR blocks, which Relax's reshape analysis (``RewriteDataflowReshape``)
    cannot read under ``call_tir``; as in-place calls on fresh buffers it leaves them alone.
    The buffers are uninitialized (``op.empty``: zero-filling them took 1.7 ms of the K3 MoE
    layer's 30 ms prefill of 8192 tokens on the H200, moe_layer_h200), so a kernel must write
    every element that is later read — never accumulate into them."""
    bufs = [op.empty(shape, dtype) for shape, dtype in outs]
    sinfo = [Tensor.placeholder(shape, dtype) for shape, dtype in outs]
    return op.tensor_ir_inplace_op(kernel, name, [*args, *bufs],
                                   list(range(len(args), len(args) + len(bufs))),
                                   sinfo[0] if len(sinfo) == 1 else sinfo)


class LatentMoE(nn.Module):
    """K3 ``block_sparse_moe`` (spec §3 MoE block; see the module docstring for the dtype flow).

    forward(x ``[T, hidden]`` model dtype, T symbolic) -> ``[T, hidden]`` model dtype.
    Built from a :class:`k3_compile.config.K3Config`.
    """

    def __init__(self, config, dtype: str = "float32", gpu: bool = False, tuned: bool = True,
                 wgmma: bool = False):
        c = config
        self.dtype = dtype
        self.hidden = c.hidden_size
        self.latent = c.routed_expert_hidden_size is not None
        L = c.latent_size
        self.gate = MoEGate(c.hidden_size, c.num_experts, c.num_experts_per_token,
                            c.routed_scaling_factor, c.moe_renormalize, dtype, gpu)
        if self.latent:
            self.routed_expert_down_proj = Linear(c.hidden_size, L, dtype)
            self.routed_expert_up_proj = Linear(L, c.hidden_size, dtype)
            self.routed_expert_norm = (RMSNorm(L, c.rms_norm_eps, dtype)
                                       if c.latent_moe_use_norm else None)
        else:
            self.routed_expert_norm = None
        # GPU bf16 builds: the combine (step 4) as schedules/moe_combine.py's kernel, with the
        # router weights' bf16 rounding and (latent) routed_expert_norm in the same launch
        width = L if self.latent else c.hidden_size
        fuse_norm = self.routed_expert_norm is not None and width // mcb.VEC <= 1024
        self.combine_kernel = (mcb.moe_combine_kernel(c.num_experts_per_token, width, round_w=True,
                                                      norm_eps=c.rms_norm_eps if fuse_norm else None)
                               if gpu and tuned and dtype == "bfloat16" and width % mcb.VEC == 0 else None)
        self.combine_norm = self.combine_kernel is not None and fuse_norm
        self.experts = RoutedExperts(
            c.num_experts, L, c.moe_intermediate_size, c.num_experts_per_token,
            c.quantization.experts_mxfp4, c.activation_situ_beta, c.activation_situ_linear_beta,
            dtype, gpu, tuned, wgmma,
        )
        self.shared_experts = (
            SiTUMLP(c.hidden_size, c.shared_expert_intermediate_size,
                    c.activation_situ_beta, c.activation_situ_linear_beta, dtype)
            if c.num_shared_experts else None
        )

    def forward(self, x: Tensor, decode: bool = False) -> Tensor:
        """``decode``: one token per sequence (T == B), which lets CUDA builds use the tuned
        decode kernels for the routed experts."""
        ids, w = self.gate(x)
        if self.dtype != "float32" and self.combine_kernel is None:   # (the kernel rounds them itself)
            w = op.astype(op.astype(w, self.dtype), "float32")  # mlx: weights.astype(in_type)
        z = self.routed_expert_down_proj(x) if self.latent else x
        o = self.experts(z, ids, decode)  # [T, k, L]
        if self.combine_norm:   # combine + routed_expert_norm in one kernel
            y = _fill(self.combine_kernel, "moe_combine_norm", [o, w, self.routed_expert_norm.weight],
                      [([x.shape[0], o.shape[2]], self.dtype)])
        elif self.combine_kernel is not None:
            y = _fill(self.combine_kernel, "moe_combine", [o, w], [([x.shape[0], o.shape[2]], self.dtype)])
        else:
            y = op.sum(op.astype(o, "float32") * op.unsqueeze(w, -1), axis=1)  # fp32 accumulation
            y = op.astype(y, self.dtype)
        if self.routed_expert_norm is not None and not self.combine_norm:
            y = self.routed_expert_norm(y)
        if self.latent:
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
