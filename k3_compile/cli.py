"""The ``k3`` command line: a thin layer over the library API.

Subcommands: ``inspect`` (this module); later issues add convert-weight, compile, chat,
serve, tune, bench. Errors from the library (config, checkpoint, tokenizer) are printed
as one line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ConfigError, K3Config


class UserError(Exception):
    """Raised for bad user input; the CLI prints its message and exits with status 2."""


def _fmt_count(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _runs(ids) -> str:
    """Compact ``0-2,4-6`` form of a sorted id list."""
    ids = list(ids)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out) or "-"


def cmd_inspect(args: argparse.Namespace) -> int:
    from .tensors import active_parameters, bytes_by_dtype, parameter_counts

    path = Path(args.model)
    cfg = K3Config.from_file(path)
    ckpt = None
    if path.is_dir() and any(path.glob("*.safetensors")):
        from .weights import CheckpointReader

        ckpt = CheckpointReader(path, cfg)
        ckpt.validate()

    p = print
    p(f"config:         {cfg.source}")
    p(f"model_type:     {cfg.model_type}  (tensor prefix {cfg.tensor_prefix!r})")
    p(f"hidden_size:    {cfg.hidden_size}   vocab: {cfg.vocab_size}   context: {cfg.max_position_embeddings}")
    p(f"layers:         {cfg.num_hidden_layers}  = {len(cfg.kda_layer_ids)} KDA + {len(cfg.mla_layer_ids)} MLA"
      f"  ({len(cfg.dense_layer_ids)} dense MLP, {len(cfg.moe_layer_ids)} MoE)")
    p(f"  KDA (0-based):  {_runs(cfg.kda_layer_ids)}")
    p(f"  MLA (0-based):  {_runs(cfg.mla_layer_ids)}")
    p("  kinds:          " + " ".join(
        f"{k.upper()}{'' if cfg.is_moe_layer(i) else '+dense'}" for i, k in enumerate(cfg.layer_kinds)))
    p(f"KDA:            {cfg.kda_num_heads} heads x {cfg.kda_head_dim}, conv {cfg.short_conv_kernel_size}, "
      f"gate lower bound {cfg.gate_lower_bound}")
    p(f"MLA:            {cfg.num_attention_heads} heads, q_lora {cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}, "
      f"qk {cfg.qk_nope_head_dim}+{cfg.qk_rope_head_dim} (NoPE), v {cfg.v_head_dim}, "
      f"cache {cfg.mla_cache_dim}/token")
    p(f"MoE:            {cfg.num_experts} experts, top-{cfg.num_experts_per_token}, latent {cfg.latent_size}, "
      f"expert width {cfg.moe_intermediate_size}, {cfg.num_shared_experts} shared")
    p(f"AttnRes:        block size {cfg.attn_res_block_size} -> {cfg.num_attn_res_blocks} blocks")
    q = cfg.quantization
    p(f"quantization:   {q.format or 'none (bf16)'}" + (f", group size {q.group_size}" if q.format else ""))
    counts = parameter_counts(cfg)
    p("parameters by component:")
    for comp, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if comp != "total":
            p(f"  {comp:16s} {_fmt_count(n):>10s}  ({n:,})")
    p(f"  {'total':16s} {_fmt_count(counts['total']):>10s}  ({counts['total']:,})")
    p(f"  {'active/token':16s} {_fmt_count(active_parameters(cfg)):>10s}")
    p("checkpoint bytes by dtype (implied by the config):")
    for dt, n in sorted(bytes_by_dtype(cfg).items()):
        p(f"  {dt:10s} {_fmt_bytes(n):>12s}")
    if ckpt is not None:
        p(f"checkpoint:     {len(ckpt.files)} shard(s), {ckpt.num_tensors} tensors, all present with the "
          "expected shapes and dtypes")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="k3", description="Kimi K3 compiled with Apache TVM.")
    sub = ap.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("inspect", help="print the parsed config, layer kinds, parameter counts")
    sp.add_argument("model", help="a checkpoint directory or a config.json")
    sp.set_defaults(func=cmd_inspect)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, UserError, FileNotFoundError) as e:
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # library errors with a clear message
        from .weights import CheckpointError

        if isinstance(e, CheckpointError):
            print(f"k3 {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
