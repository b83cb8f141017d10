"""Pieces every layer shares: the per-forward batch metadata (docs/DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass

from tvm.relax.frontend import nn


@dataclass
class ForwardMeta:
    """Metadata of one flat ragged batch of ``T`` tokens from ``B`` sequences.

    All tensors are ``int32``. Built by the runtime for every prefill / decode call.

    Attributes:
        cu_seqlens: ``[B+1]`` token offsets of each sequence in the flat batch.
        token_seq: ``[T]`` batch index of each token.
        token_pos: ``[T]`` absolute position of each token in its sequence (0-based).
        seq_slots: ``[B]`` KDA state slot of each sequence.
        page_table: ``[B, max_pages]`` MLA cache page ids of each sequence (-1 unused).
        last_token: ``[B]`` flat index of each sequence's last token.
    """

    cu_seqlens: nn.Tensor
    token_seq: nn.Tensor
    token_pos: nn.Tensor
    seq_slots: nn.Tensor
    page_table: nn.Tensor
    last_token: nn.Tensor
