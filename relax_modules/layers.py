"""Small building blocks shared by every layer (spec §3): RMSNorm, SiTU-GLU, the SiTU MLP.

All formulas are from ``../shared/spec/K3-ARCHITECTURE.md`` §3 and were checked against
mlx-lm 0.32.2 ``mlx_lm/models/kimi_k3.py`` (``_situ``, ``KimiK3MLP``; ``nn.RMSNorm`` =
``mx.fast.rms_norm``, which normalizes in fp32, casts to the input dtype, *then* multiplies
by the weight). Every linear has no bias; weights are ``[out, in]``.
"""

from __future__ import annotations

from tvm import relax as rx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

__all__ = [
    "Linear",
    "matmul_fp32acc",
    "rsqrt",
    "mean_last",
    "take_rows",
    "rms_normalize_fp32",
    "RMSNorm",
    "situ_glu",
    "SiTUMLP",
    "Embedding",
    "LMHead",
]


# --------------------------------------------------------------------------- tiny op helpers
def rsqrt(x: Tensor, name: str = "rsqrt") -> Tensor:
    """Elementwise ``1/sqrt(x)`` (Relax ``rsqrt``; nn.op has none)."""
    return op.wrap_nested(rx.op.rsqrt(x._expr), name)


def take_rows(x: Tensor, indices: Tensor, name: str = "take") -> Tensor:
    """``x[indices]`` along axis 0 (``x [N, D]``, ``indices [M]`` int32 → ``[M, D]``).

    Out-of-range indices are clamped (``mode="clip"``) rather than read out of bounds: the
    runtime validates token ids, and this keeps a bad index from ever touching other memory.
    """
    return op.wrap_nested(rx.op.take(x._expr, indices._expr, axis=0, mode="clip"), name)


def mean_last(x: Tensor, name: str = "mean") -> Tensor:
    """Mean over the last axis, keepdims: ``[..., D] -> [..., 1]``."""
    return op.wrap_nested(rx.op.mean(x._expr, axis=[-1], keepdims=True), name)


def rms_normalize_fp32(x: Tensor, eps: float) -> Tensor:
    """``x32 * rsqrt(mean(x32²) + eps)`` in float32 (no weight). ``[..., D]`` any float → fp32."""
    x32 = op.astype(x, "float32")
    return x32 * rsqrt(mean_last(x32 * x32) + eps)


# --------------------------------------------------------------------------- Linear
def matmul_fp32acc(a: Tensor, b: Tensor, name: str = "matmul") -> Tensor:
    """``a @ b`` accumulated in fp32, result in ``a``'s dtype.

    Relax ``matmul`` with ``out_dtype=None`` accumulates in the input dtype: for bfloat16 that
    is a bf16 accumulator (measured: errors up to 0.5 on outputs of magnitude 4 at K=96 on llvm).
    """
    out = op.matmul(a, b, out_dtype="float32")
    return out if a.dtype == "float32" else op.astype(out, a.dtype)


class Linear(nn.Module):
    """Bias-free linear ``y = x Wᵀ`` with ``weight [out, in]`` (the checkpoint layout).

    Same parameter name as ``nn.Linear`` (``weight``), but accumulates in fp32 for every model
    dtype (see :func:`matmul_fp32acc`). ``x [..., in]`` → ``[..., out]``, model dtype.
    """

    def __init__(self, in_features: int, out_features: int, dtype: str = "float32"):
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter((out_features, in_features), dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return matmul_fp32acc(x, op.permute_dims(self.weight, [1, 0]))


# --------------------------------------------------------------------------- RMSNorm
class RMSNorm(nn.Module):
    """``RMSNorm_w(x) = w * (x32 * rsqrt(mean(x32²) + eps)).to(dtype)`` (spec §3).

    Order checked against mlx-lm (``mx.fast.rms_norm``): normalize in fp32, cast to the model
    dtype, multiply by ``w`` in the model dtype.

    Parameters: ``weight [hidden]`` (model dtype). Input ``[..., hidden]`` model dtype, output
    same shape and dtype. eps: ``rms_norm_eps`` (1e-5), MLA ``q_a/kv_a_layernorm`` 1e-6.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: str = "float32"):
        self.hidden_size = hidden_size
        self.eps = eps
        self.dtype = dtype
        self.weight = nn.Parameter((hidden_size,), dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        normed = op.astype(rms_normalize_fp32(x, self.eps), x.dtype)
        return self.weight * normed


# --------------------------------------------------------------------------- SiTU-GLU
def situ_glu(gate: Tensor, up: Tensor, beta: float, beta_lin: float) -> Tensor:
    """SiTU-GLU (spec §3, mlx-lm ``_situ``), computed in fp32, result in ``gate``'s dtype:

    ``act(gate, up) = β·tanh(gate/β)·σ(gate) · β_lin·tanh(up/β_lin)``

    ``gate``/``up``: ``[..., I]``; β = ``activation_situ_beta`` (4.0),
    β_lin = ``activation_situ_linear_beta`` (25.0).
    """
    dtype = gate.dtype
    g = op.astype(gate, "float32")
    u = op.astype(up, "float32")
    a = beta * op.tanh(g * (1.0 / beta)) * op.sigmoid(g)
    lin = beta_lin * op.tanh(u * (1.0 / beta_lin))
    return op.astype(a * lin, dtype)


class SiTUMLP(nn.Module):
    """``down_proj(act(gate_proj x, up_proj x))`` with SiTU-GLU (spec §3).

    Used for the dense layer-0 ``mlp`` and for ``shared_experts`` (width
    ``moe_intermediate_size × num_shared_experts``). Parameters: ``gate_proj.weight``,
    ``up_proj.weight`` ``[intermediate, hidden]``; ``down_proj.weight`` ``[hidden, intermediate]``.
    ``x [T, hidden]`` → ``[T, hidden]``, model dtype.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, beta: float, beta_lin: float,
                 dtype: str = "float32"):
        self.beta = beta
        self.beta_lin = beta_lin
        self.gate_proj = Linear(hidden_size, intermediate_size, dtype)
        self.up_proj = Linear(hidden_size, intermediate_size, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.beta_lin))


# --------------------------------------------------------------------------- embedding / head
class Embedding(nn.Module):
    """``embed_tokens``: ``weight [vocab, hidden]``; ``ids [T] int32`` → ``[T, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: str = "float32"):
        self.weight = nn.Parameter((vocab_size, hidden_size), dtype=dtype)

    def forward(self, ids: Tensor) -> Tensor:
        return take_rows(self.weight, ids)


class LMHead(nn.Module):
    """``lm_head``: ``weight [vocab, hidden]``; ``h [N, hidden]`` → fp32 logits ``[N, vocab]``."""

    def __init__(self, hidden_size: int, vocab_size: int, dtype: str = "float32"):
        self.weight = nn.Parameter((vocab_size, hidden_size), dtype=dtype)

    def forward(self, h: Tensor) -> Tensor:
        return op.matmul(h, op.permute_dims(self.weight, [1, 0]), out_dtype="float32")
