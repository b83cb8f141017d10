"""Kimi K3 text model as one Relax ``nn.Module`` (spec §3, read top to bottom).

``K3ForCausalLM`` exports these functions (docs/DESIGN.md; every function also takes the
parameters as trailing arguments, in ``export_tvm``'s order):

| function | arguments | returns |
|---|---|---|
| ``embed`` | ``input_ids [T] int32`` | ``[T, hidden]`` |
| ``prefill`` | ``embeds [T, hidden]``, metadata, ``kda_state``, ``conv_state``, ``mla_cache`` | ``(logits [B, vocab] f32, kda_state, conv_state, mla_cache)`` — last token of each sequence |
| ``prefill_all_logits`` | same | ``(logits [T, vocab] f32, ...)`` — every position (scoring) |
| ``decode`` | same, one token per sequence (``T == B``) | ``(logits [B, vocab] f32, ...)`` |
| ``kda_reset_slot`` / ``kda_copy_slot`` | pools, slot ids | the pools |
| ``mla_copy_page`` | ``mla_cache``, ``src``, ``dst`` | ``mla_cache`` |

Metadata (all int32): ``cu_seqlens [B+1]``, ``token_seq [T]``, ``token_pos [T]``,
``seq_slots [B]``, ``page_table [B, P]``, ``last_token [B]``. ``T``, ``B``, ``P``, the number
of state slots ``S`` and of cache pages ``NP`` are symbolic.
"""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from k3_compile.config import K3Config
from schedules.cache_ops import page_copy_kernel

from .attn_res import AttnRes, AttnResNorm, AttnResProj, BlockResiduals
from .common import ForwardMeta
from .kda import KDAStateOps, KimiDeltaAttention
from .layers import Embedding, LMHead, RMSNorm, SiTUMLP, take_rows
from .mla import GatedMLA
from .moe import LatentMoE

DEFAULT_PAGE_SIZE = 16


class K3DecoderLayer(nn.Module):
    """One decoder layer ``model.layers.{i}``: KDA or Gated MLA, dense MLP or LatentMoE,
    wired through Block Attention Residuals (spec §3, steps 1–4)."""

    def __init__(self, cfg: K3Config, layer_idx: int, page_size: int, dtype: str,
                 gpu: bool = False, tuned: bool = True, wgmma: bool = False):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        self.block_size = cfg.attn_res_block_size
        self.kind = cfg.layer_kind(layer_idx)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.self_attention_res_norm = AttnResNorm(h, dtype)
        self.self_attention_res_proj = AttnResProj(h, dtype)
        self.mlp_res_norm = AttnResNorm(h, dtype)
        self.mlp_res_proj = AttnResProj(h, dtype)
        if self.kind == "kda":
            self.self_attn = KimiDeltaAttention(cfg, dtype, gpu, tuned, wgmma)
        else:
            self.self_attn = GatedMLA(cfg, page_size, dtype, gpu)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg, dtype, gpu, tuned, wgmma)
        else:
            self.mlp = SiTUMLP(h, cfg.intermediate_size, cfg.activation_situ_beta,
                               cfg.activation_situ_linear_beta, dtype)
        self.attn_res = AttnRes(self.self_attention_res_norm, self.self_attention_res_proj, eps)
        self.mlp_res = AttnRes(self.mlp_res_norm, self.mlp_res_proj, eps)

    def forward(self, res: BlockResiduals, meta: ForwardMeta, state: dict, state_index: int,
                decode: bool) -> None:
        """Advance ``res`` (blocks + partial sum) through this layer; updates ``state``."""
        # 1–2. h = AttnRes_attn(blocks, P); at a block start P becomes a block.
        h = res.before_attention(self.layer_idx, self.block_size, self.attn_res)
        # 3. a = attn(input_layernorm(h)); P = P + a
        x = self.input_layernorm(h)
        if self.kind == "kda":
            a, state["kda"], state["conv"] = self.self_attn(
                x, meta, state["kda"], state["conv"], state_index, decode)
        else:
            a, state["mla"] = self.self_attn(x, meta, state["mla"], state_index)
        res.add(a)
        # 4. h = AttnRes_mlp(blocks, P); m = mlp(post_attention_layernorm(h)); P = P + m
        h = res.mix(self.mlp_res)
        x = self.post_attention_layernorm(h)
        res.add(self.block_sparse_moe(x, decode) if self.is_moe else self.mlp(x))


class K3Model(nn.Module):
    """``model.``: embeddings, the decoder layers, the AttnRes output mix and the final norm."""

    def __init__(self, cfg: K3Config, page_size: int, dtype: str, gpu: bool = False,
                 tuned: bool = True, wgmma: bool = False):
        h = cfg.hidden_size
        self.embed_tokens = Embedding(cfg.vocab_size, h, dtype)
        self.layers = nn.ModuleList(
            [K3DecoderLayer(cfg, i, page_size, dtype, gpu, tuned, wgmma) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.output_attn_res_norm = AttnResNorm(h, dtype)
        self.output_attn_res_proj = AttnResProj(h, dtype)
        self.output_res = AttnRes(self.output_attn_res_norm, self.output_attn_res_proj,
                                  cfg.rms_norm_eps)
        kda_ids, mla_ids = cfg.kda_layer_ids, cfg.mla_layer_ids
        # Index of each layer into its state pool's dim 0.
        self.state_index = [kda_ids.index(i) if i in kda_ids else mla_ids.index(i)
                            for i in range(cfg.num_hidden_layers)]

    def forward(self, embeds: Tensor, meta: ForwardMeta, state: dict, decode: bool) -> Tensor:
        """``embeds [T, hidden]`` → final-normed hidden states ``[T, hidden]``."""
        res = BlockResiduals(embeds)
        for layer, idx in zip(self.layers, self.state_index):
            layer(res, meta, state, idx, decode)
        return self.norm(res.mix(self.output_res))


class K3ForCausalLM(nn.Module):
    """The whole text model; see the module docstring for the exported functions.

    Args:
        cfg: the model config.
        dtype: activation/weight dtype, ``"float32"`` or ``"bfloat16"`` (the spec's fp32
            tensors stay fp32; routed experts stay MXFP4).
        page_size: MLA cache page size in tokens (a compile-time constant).
        gpu: use the thread-bound (GPU) variants of the hand-written TIR kernels.
        tuned: on GPU, dispatch the tuned hand-written kernels where they exist (KDA decode:
            schedules/kda_decode_cuda.py); False keeps the generic kernels (the fallback).
        wgmma: the tuned kernels may use Hopper's warpgroup MMA (cuda-sm90a only: the MoE
            prefill grouped GEMMs of schedules/moe_mxfp4_prefill_wgmma.py, phases 3 and 5 of the fused
            KDA prefill at 128 columns, phase 3 of the split form's state kernels).
    """

    def __init__(self, cfg: K3Config, dtype: str = "float32", page_size: int = DEFAULT_PAGE_SIZE,
                 gpu: bool = False, tuned: bool = True, wgmma: bool = False):
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        self.cfg, self.dtype, self.page_size, self.gpu = cfg, dtype, page_size, gpu
        self.model = K3Model(cfg, page_size, dtype, gpu, tuned, wgmma)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, dtype)
        self.state_ops = KDAStateOps(cfg, gpu)

    # ------------------------------------------------------------------ model functions
    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def _forward(self, embeds, cu_seqlens, token_seq, token_pos, seq_slots, page_table,
                 last_token, kda_state, conv_state, mla_cache, decode: bool, all_logits: bool):
        meta = ForwardMeta(cu_seqlens, token_seq, token_pos, seq_slots, page_table, last_token)
        state = {"kda": kda_state, "conv": conv_state, "mla": mla_cache}
        hidden = self.model(embeds, meta, state, decode)
        if not all_logits:
            hidden = take_rows(hidden, last_token)
        logits = self.lm_head(hidden)
        return logits, state["kda"], state["conv"], state["mla"]

    def prefill(self, embeds, cu_seqlens, token_seq, token_pos, seq_slots, page_table,
                last_token, kda_state, conv_state, mla_cache):
        return self._forward(embeds, cu_seqlens, token_seq, token_pos, seq_slots, page_table,
                             last_token, kda_state, conv_state, mla_cache, False, False)

    def prefill_all_logits(self, embeds, cu_seqlens, token_seq, token_pos, seq_slots,
                           page_table, last_token, kda_state, conv_state, mla_cache):
        return self._forward(embeds, cu_seqlens, token_seq, token_pos, seq_slots, page_table,
                             last_token, kda_state, conv_state, mla_cache, False, True)

    def decode(self, embeds, cu_seqlens, token_seq, token_pos, seq_slots, page_table,
               last_token, kda_state, conv_state, mla_cache):
        return self._forward(embeds, cu_seqlens, token_seq, token_pos, seq_slots, page_table,
                             last_token, kda_state, conv_state, mla_cache, True, False)

    # ------------------------------------------------------------------ state operations
    def kda_reset_slot(self, kda_state, conv_state, slot):
        return self.state_ops.reset_slot(kda_state, conv_state, slot)

    def kda_copy_slot(self, kda_state, conv_state, src, dst):
        return self.state_ops.copy_slot(kda_state, conv_state, src, dst)

    def mla_copy_page(self, mla_cache, src, dst):
        kernel = page_copy_kernel(self.page_size * self.cfg.mla_cache_dim, self.dtype, gpu=self.gpu)
        flat = op.reshape(mla_cache, (mla_cache.shape[0], mla_cache.shape[1],
                                      self.page_size * self.cfg.mla_cache_dim))
        flat = op.tensor_ir_inplace_op(kernel, "mla_page_copy", [flat, src, dst], [0],
                                       Tensor.placeholder(flat.shape, self.dtype))
        return op.reshape(flat, mla_cache.shape)

    # ------------------------------------------------------------------ export
    def expert_code_layout(self) -> str:
        """Layout the routed experts' ``weight_packed`` parameters are read in: ``"ocp"`` (the
        checkpoint's) or ``schedules.mxfp4_tc_layout.LAYOUT`` (CUDA tensor-core kernels; the
        runtime permutes the codes at load time). One layout for every layer."""
        layouts = {layer.block_sparse_moe.experts.code_layout
                   for layer in self.model.layers if layer.is_moe}
        if len(layouts) > 1:  # every MoE layer has the same sizes
            raise ValueError(f"MoE layers disagree on the expert code layout: {sorted(layouts)}")
        return layouts.pop() if layouts else "ocp"

    def state_shapes(self) -> dict:
        """Symbolic shapes of the three state pools (docs/DESIGN.md)."""
        c = self.cfg
        n_kda, n_mla = max(len(c.kda_layer_ids), 1), max(len(c.mla_layer_ids), 1)
        H, K, W = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
        return {
            "kda_state": ([n_kda, "S", H, K, K], "float32"),
            "conv_state": ([n_kda, "S", 3, W - 1, H * K], "float32"),
            "mla_cache": ([n_mla, "NP", self.page_size, c.mla_cache_dim], self.dtype),
        }

    def get_default_spec(self) -> dict:
        """The ``export_tvm`` spec of every exported function (symbolic T, B, P, S, NP)."""
        c = self.cfg
        i32 = "int32"
        st = {k: nn.spec.Tensor(shape, dt) for k, (shape, dt) in self.state_shapes().items()}
        fwd = {
            "embeds": nn.spec.Tensor(["T", c.hidden_size], self.dtype),
            "cu_seqlens": nn.spec.Tensor(["B1"], i32),
            "token_seq": nn.spec.Tensor(["T"], i32),
            "token_pos": nn.spec.Tensor(["T"], i32),
            "seq_slots": nn.spec.Tensor(["B"], i32),
            "page_table": nn.spec.Tensor(["B", "P"], i32),
            "last_token": nn.spec.Tensor(["B"], i32),
            **st,
        }
        # decode: one token per sequence
        dec = dict(fwd, embeds=nn.spec.Tensor(["B", c.hidden_size], self.dtype),
                   token_seq=nn.spec.Tensor(["B"], i32), token_pos=nn.spec.Tensor(["B"], i32))
        return {
            "embed": {"input_ids": nn.spec.Tensor(["T"], i32)},
            "prefill": fwd,
            "prefill_all_logits": fwd,
            "decode": dec,
            "kda_reset_slot": {"kda_state": st["kda_state"], "conv_state": st["conv_state"],
                               "slot": nn.spec.Int()},
            "kda_copy_slot": {"kda_state": st["kda_state"], "conv_state": st["conv_state"],
                              "src": nn.spec.Int(), "dst": nn.spec.Int()},
            "mla_copy_page": {"mla_cache": st["mla_cache"], "src": nn.spec.Int(),
                              "dst": nn.spec.Int()},
        }

    def export(self):
        """``export_tvm`` with :meth:`get_default_spec`: returns ``(IRModule, params)``."""
        return self.export_tvm(spec=self.get_default_spec())
