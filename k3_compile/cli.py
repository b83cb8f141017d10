"""The ``k3`` command line: a thin layer over the library API.

Subcommands: ``inspect``, ``targets``, ``convert-weight``, ``compile``, ``generate``, ``chat``.
Every error is printed as one line on stderr with exit status 2, never as a traceback
(set ``K3_DEBUG=1`` to see the traceback of an unexpected error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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
    converted = None
    if path.is_dir() and (path / "params_index.json").is_file():
        converted = json.loads((path / "params_index.json").read_text())
    elif path.is_dir() and any(path.glob("*.safetensors")):
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
    p(f"  {'active/token':16s} {_fmt_count(active_parameters(cfg)):>10s}  (top-{cfg.num_experts_per_token} "
      "routed experts; embedding table not counted)")
    p("checkpoint bytes by dtype (implied by the config):")
    for dt, n in sorted(bytes_by_dtype(cfg).items()):
        p(f"  {dt:10s} {_fmt_bytes(n):>12s}")
    if ckpt is not None:
        p(f"checkpoint:     {len(ckpt.files)} shard(s), {ckpt.num_tensors} tensors, all present with the "
          "expected shapes and dtypes")
    if ckpt is None and converted is None:
        p("checkpoint:     none (config only: no weights checked)")
    if converted is not None:
        files = {e["file"] for e in converted.get("params", [])}
        p(f"converted:      {len(converted.get('params', []))} parameters in {len(files)} shard(s), "
          f"dtype {converted.get('dtype')}, experts {converted.get('quantization')}")
    return 0


# ---------------------------------------------------------------------- targets
def cmd_targets(args: argparse.Namespace) -> int:
    from targets import get_target, list_targets

    rows = [(t.name, t.description, t.verified) for t in map(get_target, list_targets())]
    w0 = max(len("name"), *(len(r[0]) for r in rows))
    w1 = max(len("description"), *(len(r[1]) for r in rows))
    print(f"{'name':{w0}}  {'description':{w1}}  verified")
    print(f"{'-' * w0}  {'-' * w1}  {'-' * 8}")
    for n, d, v in rows:
        print(f"{n:{w0}}  {d:{w1}}  {v}")
    return 0


# ---------------------------------------------------------------------- convert-weight
def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert

    if args.shard_size <= 0:
        raise UserError(f"--shard-size must be > 0 GB, got {args.shard_size}")
    r = convert(args.model, args.output, quantization=args.quantization, dtype=args.dtype,
                force=args.force, shard_bytes=int(args.shard_size * 1e9),
                context_window=args.context_window, prefill_chunk=args.prefill_chunk,
                progress=not args.quiet)
    print(f"converted {args.model} -> {r['out_dir']}: {r['params']} parameters in {r['shards']} shard(s), "
          f"{_fmt_bytes(r['bytes'])}, dtype {r['dtype']}, experts {r['quantization']}, config hash "
          f"{r['config_hash']} ({r['seconds']:.1f} s)")
    return 0


# ---------------------------------------------------------------------- compile
def cmd_compile(args: argparse.Namespace) -> int:
    from .compile import compile_model

    log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    r = compile_model(args.model, args.target, args.output, dtype=args.dtype,
                      max_batch_size=args.max_batch_size, context_window=args.context_window,
                      prefill_chunk=args.prefill_chunk, generic_kernels=args.generic_kernels,
                      cuda_graph=args.cuda_graph, log=log)
    m = r.metadata
    mp = m["memory_plan"]
    ph = ", ".join(f"{k} {v:.1f} s" for k, v in r.phases.items())
    print(f"compiled {r.lib} for {m['target']} (dtype {m['dtype']}, experts {m['quantization']}, config hash "
          f"{m['config_hash']}) in {r.seconds:.1f} s ({ph}); peak memory {_fmt_bytes(r.peak_memory_bytes)}; "
          f"library {_fmt_bytes(Path(r.lib).stat().st_size)}")
    print(f"memory plan: parameters {_fmt_bytes(mp['param_bytes'])}, KDA state "
          f"{_fmt_bytes(mp['kda_state_bytes_per_seq'])}/sequence, MLA cache "
          f"{_fmt_bytes(mp['mla_cache_bytes_per_token'])}/token; defaults: batch {m['max_batch_size']}, "
          f"context {m['context_window']}, prefill chunk {m['prefill_chunk']}")
    return 0


# ---------------------------------------------------------------------- generate / chat
def _load(args: argparse.Namespace):
    from .runtime.model_runner import load_model

    log = None if getattr(args, "json", False) and not args.verbose else (
        lambda m: print(m, file=sys.stderr, flush=True))
    return load_model(args.model, args.lib, args.device, dtype=args.dtype,
                      max_batch_size=args.max_batch_size, context_window=args.context_window,
                      prefill_chunk=args.prefill_chunk, log=log, verbose=args.verbose)


def _sampling(args: argparse.Namespace, default_max: int):
    """Sampling settings from the flags, defaults from the model's generation_config.json
    (checked before anything is loaded)."""
    from .runtime.sampler import sampling_with_defaults

    gen = {}
    gpath = Path(args.model) / "generation_config.json"
    if gpath.is_file():
        try:
            gen = json.loads(gpath.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{gpath}: not valid JSON ({e})") from None
    try:
        return sampling_with_defaults(
            gen, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            repetition_penalty=args.repetition_penalty, seed=args.seed,
            max_tokens=args.max_tokens if args.max_tokens is not None else default_max,
            stop=args.stop or (), ignore_eos=getattr(args, "ignore_eos", False))
    except ValueError as e:
        raise UserError(str(e)) from None


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = _sampling(args, 256)
    model = _load(args)
    ids = model.encode_prompt(prompt, chat=args.chat)
    model.check_prompt(len(ids))
    if args.json:
        res = model.generate(ids, params)
        d = res.to_dict()
        d.update({"prompt": prompt, "prompt_token_ids": ids, "lib": str(model.lib_path),
                  "device": model.device, "target": model.metadata["target"],
                  "dtype": model.metadata["dtype"]})
        print(json.dumps(d))
        return 0

    def out(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if not args.chat:
        out(prompt)
    res = model.generate(ids, params, stream=out)
    sys.stdout.write("\n")
    print(f"[{res.prompt_tokens} prompt tokens, {res.prefill_tokens_per_s:.1f} tok/s prefill; "
          f"{len(res.token_ids)} generated, {res.decode_tokens_per_s:.1f} tok/s decode; "
          f"finish: {res.finish_reason}]", file=sys.stderr)
    return 0


_CHAT_COMMANDS = ("/reset", "/stats", "/exit", "/quit", "/help")
_CHAT_HELP = ("commands: /reset (new conversation), /stats (speed, cache use), /exit; "
              "end a line with \\ to continue it, or wrap several lines in \"\"\"; "
              "Ctrl-C stops a reply")


def _read_message(prompt: str = ">>> ", more: str = "... ") -> str | None:
    """One user message: a line, lines joined by a trailing backslash, or a \"\"\" block.
    None at end of input."""
    interactive = sys.stdin.isatty()

    def line(p: str) -> str | None:
        if interactive:
            try:
                return input(p)
            except EOFError:
                return None
        sys.stdout.write(p)
        sys.stdout.flush()
        s = sys.stdin.readline()
        if not s:
            return None
        return s.rstrip("\n").rstrip("\r")

    first = line(prompt)
    if first is None:
        return None
    if first.strip().startswith('"""'):
        rest = first.strip()[3:]
        if rest.endswith('"""'):
            return rest[:-3]
        parts = [rest] if rest else []
        while True:
            nxt = line(more)
            if nxt is None:
                break
            if nxt.rstrip().endswith('"""'):
                tail = nxt.rstrip()[:-3]
                if tail:
                    parts.append(tail)
                break
            parts.append(nxt)
        return "\n".join(parts)
    parts = []
    cur = first
    while cur is not None and cur.endswith("\\"):
        parts.append(cur[:-1])
        cur = line(more)
    if cur is not None:
        parts.append(cur)
    return "\n".join(parts)


def cmd_chat(args: argparse.Namespace) -> int:
    from .runtime.model_runner import ChatSession

    args.json = False
    params = _sampling(args, 512)
    model = _load(args)
    session = ChatSession(model, system=args.system)
    print(f"k3 chat: {model.model_dir} on {model.device} ({model.metadata['target']}, "
          f"{model.metadata['dtype']}), context {model.context_window} tokens. {_CHAT_HELP}", flush=True)
    while True:
        msg = _read_message()
        if msg is None:
            print()
            return 0
        cmd = msg.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/reset":
            session.reset()
            print("[conversation reset]", flush=True)
            continue
        if cmd == "/stats":
            s = model.stats()
            print(f"[session totals: prefill {s['prefill_tokens']} tokens, {s['prefill_tokens_per_s']:.1f} tok/s; "
                  f"{s['generated_tokens']} tokens generated in {s['decode_tokens']} decode steps "
                  f"(a reply's first token comes from its prefill), {s['decode_tokens_per_s']:.1f} tok/s; "
                  f"cache: {s['mla_pages_used']}/{s['mla_pages']} MLA pages of {s['page_size']} tokens, "
                  f"{s['kda_slots_used']}/{s['kda_slots']} KDA state slots (batch {s['kda_slots'] - 1} + 1 spare "
                  f"for fork/rollback); conversation "
                  f"{model.engine.length(session.seq)}/{s['context_window']} tokens]", flush=True)
            continue
        if cmd == "/help":
            print(_CHAT_HELP, flush=True)
            continue
        if cmd.startswith("/") and cmd.split()[0] in _CHAT_COMMANDS:
            print(f"[{cmd.split()[0]} takes no arguments; {_CHAT_HELP}]", flush=True)
            continue
        if cmd.startswith("/") and " " not in cmd:
            print(f"[unknown command {cmd}; {_CHAT_HELP}]", flush=True)
            continue
        try:
            session.send(msg, params, stream=lambda p: (sys.stdout.write(p), sys.stdout.flush()))
        except KeyboardInterrupt:
            # Ctrl-C stops this reply, not the chat: the unfinished turn is dropped and the
            # sequence's cache cleared, so the next message re-reads the conversation so far
            model.engine.reset(session.seq)
            print("\n[reply stopped; this turn (your message and the reply) is dropped from the conversation]",
                  flush=True)
            continue
        except Exception as e:  # keep the session alive: one line, then the next message
            from .runtime.model_runner import ModelLoadError

            if not isinstance(e, (ModelLoadError, ValueError, RuntimeError)):
                raise
            print(f"\n[error: {_one_line(e)}]", flush=True)
            continue
        print(flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from .runtime.server import serve

    model = _load(args)
    print(f"k3 serve: {model.model_dir} on {model.device} ({model.metadata['target']}, "
          f"{model.metadata['dtype']}) as {args.served_model_name!r} at http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    serve(model, args.host, args.port, args.served_model_name)
    return 0


# ---------------------------------------------------------------------- parser
def _model_args(sp: argparse.ArgumentParser) -> None:
    """The flags that load a model: directory, library, device, dtype, sizes."""
    sp.add_argument("model", help="a checkpoint directory or a `k3 convert-weight` output")
    sp.add_argument("--lib", help="library from `k3 compile` (default: compile into / reuse the cache, "
                                  "~/.cache/k3-compile or $K3_CACHE_DIR)")
    sp.add_argument("--device", default="cpu", help="cpu, cuda or gpu (GPU 0), or cuda:N (default cpu)")
    sp.add_argument("--dtype", choices=["bfloat16", "float32"],
                    help="library dtype (checked against --lib; default float32 on CPU, bfloat16 on GPU)")
    sp.add_argument("--max-batch-size", type=positive_int)
    sp.add_argument("--context-window", type=positive_int, help="tokens per sequence (default: the library's)")
    sp.add_argument("--prefill-chunk", type=positive_int, help="prefill at most this many tokens per call")
    sp.add_argument("--verbose", action="store_true", help="progress messages on stderr even with --json")


def _runtime_args(sp: argparse.ArgumentParser) -> None:
    """The model flags and the sampling flags (generate, chat)."""
    _model_args(sp)
    sp.add_argument("--max-tokens", type=positive_int,
                    help="tokens to generate at most (default: 256 for generate, 512 per reply for chat)")
    sp.add_argument("--temperature", type=float, help="0 = greedy (default: generation_config.json)")
    sp.add_argument("--top-p", type=float)
    sp.add_argument("--top-k", type=int)
    sp.add_argument("--seed", type=int)
    sp.add_argument("--repetition-penalty", type=float)
    sp.add_argument("--stop", action="append", help="stop string (repeatable)")


class _UsageError(Exception):
    """A command-line usage error (bad flag value, missing argument)."""


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors raised, so ``main`` reports them as one line, exit 2."""

    def error(self, message):
        raise _UsageError(f"{self.prog}: error: {message}")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (0 is not "use the default")."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="k3", description="Kimi K3 compiled with Apache TVM.")
    sub = ap.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("inspect", help="print the parsed config, layer kinds, parameter counts")
    sp.add_argument("model", help="a checkpoint directory or a config.json")
    sp.set_defaults(func=cmd_inspect)

    sp = sub.add_parser("targets", help="list the compile targets and their verified status")
    sp.set_defaults(func=cmd_targets)

    sp = sub.add_parser("convert-weight", help="checkpoint -> the runtime's parameter shards")
    sp.add_argument("model", help="a checkpoint directory (config.json + *.safetensors)")
    sp.add_argument("-o", "--output", required=True, help="output directory")
    sp.add_argument("--quantization", choices=["mxfp4", "bf16"], default="mxfp4",
                    help="routed-expert format of the output (default mxfp4)")
    sp.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="dtype of the non-expert parameters (default bfloat16)")
    sp.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    sp.add_argument("--shard-size", type=float, default=1.0, help="shard size limit in GB (default 1)")
    sp.add_argument("--context-window", type=positive_int)
    sp.add_argument("--prefill-chunk", type=positive_int)
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    sp.set_defaults(func=cmd_convert)

    sp = sub.add_parser("compile", help="compile a model library for a target")
    sp.add_argument("model", help="a checkpoint directory, a converted directory or a config.json")
    sp.add_argument("--target", default="llvm", help="a target name from `k3 targets` (default llvm)")
    sp.add_argument("-o", "--output", required=True, help="library file to write (.so)")
    sp.add_argument("--dtype", choices=["bfloat16", "float32"],
                    help="activation/weight dtype (default float32 on CPU targets, bfloat16 on GPU)")
    sp.add_argument("--max-batch-size", type=positive_int, help="default for the runtime (4)")
    sp.add_argument("--context-window", type=positive_int, help="default for the runtime (min(model, 8192))")
    sp.add_argument("--prefill-chunk", type=positive_int, help="default for the runtime (512)")
    sp.add_argument("--generic-kernels", action="store_true",
                    help="GPU targets: generic kernels instead of the hand-written ones")
    sp.add_argument("--cuda-graph", action="store_true",
                    help="CUDA targets: replay weight-only launch sequences as CUDA graphs")
    sp.add_argument("--quiet", action="store_true", help="no progress messages")
    sp.set_defaults(func=cmd_compile)

    sp = sub.add_parser("generate", help="generate text from a prompt")
    _runtime_args(sp)
    sp.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    sp.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    sp.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, timing)")
    sp.add_argument("--ignore-eos", action="store_true")
    sp.set_defaults(func=cmd_generate)

    sp = sub.add_parser("chat", help="interactive streaming chat")
    _runtime_args(sp)
    sp.add_argument("--system", help="system message")
    sp.set_defaults(func=cmd_chat)

    sp = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _model_args(sp)
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sp.add_argument("--port", type=positive_int, default=8000, help="port (default 8000)")
    sp.add_argument("--served-model-name", default="k3",
                    help="the name clients pass as `model` (default k3)")
    sp.set_defaults(func=cmd_serve)
    return ap


def _one_line(e: BaseException) -> str:
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    msg = " ".join(msg.split()) or type(e).__name__
    return msg


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"k3 {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # every error: one line, exit 2
        if os.environ.get("K3_DEBUG"):
            raise
        print(f"k3 {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
