"""End to end through the command line: `k3 compile` a k3-nano library once (float32, llvm),
then `k3 generate` / `k3 chat` with it; token-exact against the mlx-lm oracle; every bad input
is one line on stderr with exit status 2. Plus the sampler's contracts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k3_compile.cli import main
from k3_compile.runtime.sampler import Sampler, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "models" / "k3-nano"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def lib(work):
    out = work / "lib.so"
    assert main(["compile", str(NANO), "--target", "llvm", "-o", str(out), "--dtype", "float32",
                 "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def converted(work):
    out = work / "nano-conv"
    assert main(["convert-weight", str(NANO), "-o", str(out), "--quiet", "--shard-size", "0.01"]) == 0
    return out


def _generate_json(capsys, model, lib, *extra) -> dict:
    rc = main(["generate", str(model), "--lib", str(lib), "--device", "cpu", "--prompt", PROMPT,
               "--max-tokens", "32", "--temperature", "0", "--json", *extra])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return json.loads(cap.out)


def _error(capsys, argv) -> str:
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 2, (rc, cap.out, cap.err)
    assert cap.err.count("\n") == 1 and "Traceback" not in cap.err, cap.err
    assert cap.err.startswith(f"k3 {argv[0]}: error: ")
    return cap.err


@pytest.fixture(scope="module")
def oracle_tokens():
    from k3_compile.tokenizer import load_tokenizer
    from oracle_mlx import load_mlx, mlx_greedy

    ids = load_tokenizer(NANO).encode(PROMPT)
    return ids, mlx_greedy(load_mlx(NANO, "float32"), ids, 32)


def test_compile_metadata_readable_with_runtime_api(lib):
    import tvm
    import tvm.runtime.vm

    vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(lib)), tvm.runtime.cpu())
    meta = json.loads(str(vm["_metadata"]()))
    from k3_compile.config import K3Config

    cfg = K3Config.from_file(NANO)
    assert meta["config_hash"] == cfg.summary_hash()
    assert meta["target"] == "llvm" and meta["dtype"] == "float32" and meta["quantization"] == "mxfp4"
    assert meta["page_size"] == 16 and meta["context_window"] == 8192
    assert meta["params"][0][0] == "model.embed_tokens.weight"
    assert meta["memory_plan"]["mla_cache_bytes_per_token"] == 2 * 96 * 4
    assert meta["memory_plan"]["kda_state_bytes_per_seq"] == 6 * (2 * 128 * 128 + 3 * 3 * 256) * 4


def test_generate_greedy_matches_mlx(capsys, lib, oracle_tokens):
    ids, ref = oracle_tokens
    d = _generate_json(capsys, NANO, lib)
    assert d["prompt_token_ids"] == ids and ids[0] == 8184  # BOS, as tokenizer_config says
    assert len(d["token_ids"]) == 32
    assert d["token_ids"] == ref
    assert d["prompt_tokens"] == len(ids) and d["finish_reason"] == "length"
    assert d["prefill_tokens_per_s"] > 0 and d["decode_tokens_per_s"] > 0
    assert d["text"].startswith("\n")


def test_converted_dir_gives_same_tokens(capsys, lib, converted, oracle_tokens):
    index = json.loads((converted / "params_index.json").read_text())
    assert len({e["file"] for e in index["params"]}) > 1  # several shards
    d = _generate_json(capsys, converted, lib)
    assert d["token_ids"] == oracle_tokens[1]


def test_generate_text_streams_prompt_and_completion(capsys, lib):
    assert main(["generate", str(NANO), "--lib", str(lib), "--prompt", PROMPT, "--max-tokens", "8"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith(PROMPT + "\n")
    assert "tok/s decode" in cap.err


def test_stop_string_and_eos(capsys, lib):
    d = _generate_json(capsys, NANO, lib, "--stop", "integer")
    assert d["finish_reason"] == "stop" and "integer" not in d["text"]
    assert d["text"].endswith("random ")


def test_library_for_another_config(capsys, tmp_path, lib):
    from oracle_mlx import tiny_config, write_random_checkpoint

    tiny = write_random_checkpoint(tmp_path / "tiny", tiny_config(), seed=1)
    tiny_lib = tmp_path / "tiny.so"
    assert main(["compile", str(tiny), "-o", str(tiny_lib), "--quiet"]) == 0
    capsys.readouterr()
    err = _error(capsys, ["generate", str(NANO), "--lib", str(tiny_lib), "--prompt", "x"])
    from k3_compile.config import K3Config

    assert f"was compiled for config hash {K3Config.from_file(tiny).summary_hash()} / target llvm" in err
    assert f"has config hash {K3Config.from_file(NANO).summary_hash()}" in err


def _fake_library(path: Path, **over) -> Path:
    """A library with only the _metadata function (k3-nano's metadata with ``over`` applied)."""
    import tvm
    from tvm.script import relax as R

    from k3_compile.compile import attach_metadata, build_metadata
    from k3_compile.config import K3Config
    from k3_compile.pipeline import ExportedModel
    from targets import get_target

    cfg = K3Config.from_file(NANO)
    meta = build_metadata(ExportedModel(None, [], cfg, "float32", 16), get_target("llvm"),
                          max_batch_size=1, context_window=64, prefill_chunk=16)
    meta.update(over)
    mod = attach_metadata(tvm.IRModule(), meta)
    del R
    tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"})).export_library(str(path))
    return path


def test_library_for_another_target_or_dtype(capsys, tmp_path, lib):
    cuda_lib = _fake_library(tmp_path / "cuda.so", target="cuda-sm90a", target_device="cuda",
                             nvcc_arch="sm_90a")
    err = _error(capsys, ["generate", str(NANO), "--lib", str(cuda_lib), "--device", "cpu", "--prompt", "x"])
    assert "was compiled for target cuda-sm90a (device kind cuda)" in err
    assert "the device is cpu (target llvm)" in err
    err = _error(capsys, ["generate", str(NANO), "--lib", str(lib), "--dtype", "bfloat16", "--prompt", "x"])
    assert "was compiled for dtype float32, --dtype bfloat16 was asked for" in err
    not_k3 = tmp_path / "notk3.so"
    not_k3.write_bytes(b"not a library")
    err = _error(capsys, ["generate", str(NANO), "--lib", str(not_k3), "--prompt", "x"])
    assert f"library {not_k3}: not a shared library" in err


def test_missing_parameter_shard(capsys, tmp_path, lib, converted):
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    victim = sorted(broken.glob("params-*.safetensors"))[1]
    victim.unlink()
    err = _error(capsys, ["generate", str(broken), "--lib", str(lib), "--prompt", "x"])
    assert f"parameter shard(s) listed in params_index.json are missing: {victim.name}" in err


def test_prompt_longer_than_context_window(capsys, lib):
    err = _error(capsys, ["generate", str(NANO), "--lib", str(lib), "--context-window", "16",
                          "--prompt", "import os\n" * 20])
    assert "the context window is 16 tokens" in err and "--context-window" in err


def test_zero_and_out_of_range_sizes_are_errors(capsys, tmp_path, lib):
    for argv in (["generate", str(NANO), "--lib", str(lib), "--prompt", "x", "--max-tokens", "0"],
                 ["compile", str(NANO), "-o", str(tmp_path / "x.so"), "--context-window", "0"],
                 ["convert-weight", str(NANO), "-o", str(tmp_path / "c"), "--prefill-chunk", "0"]):
        assert "must be >= 1, got 0" in _error(capsys, argv)
    err = _error(capsys, ["generate", str(NANO), "--lib", str(lib), "--prompt", "x",
                          "--context-window", "16000"])
    assert "--context-window 16000 exceeds the model's maximum" in err
    err = _error(capsys, ["compile", str(NANO), "-o", str(tmp_path / "x.so"), "--context-window", "16000"])
    assert "--context-window 16000 exceeds the model's maximum (max_position_embeddings 8192)" in err
    err = _error(capsys, ["generate", str(NANO / "config.json"), "--lib", str(lib), "--prompt", "x"])
    assert "is a file; generate/chat need a model directory" in err


def test_unknown_device(capsys, lib):
    err = _error(capsys, ["generate", str(NANO), "--lib", str(lib), "--device", "tpu:0", "--prompt", "x"])
    assert "unknown device 'tpu:0'; accepted forms: cpu, cuda, cuda:N" in err


def test_other_bad_inputs(capsys, tmp_path, lib):
    err = _error(capsys, ["compile", str(NANO), "--target", "nope", "-o", str(tmp_path / "x.so")])
    assert "unknown target 'nope'" in err
    err = _error(capsys, ["generate", str(tmp_path / "nothing"), "--lib", str(lib), "--prompt", "x"])
    assert "no such config file" in err or "does not exist" in err
    err = _error(capsys, ["generate", str(NANO), "--lib", str(tmp_path / "missing.so"), "--prompt", "x"])
    assert "missing.so does not exist" in err
    err = _error(capsys, ["generate", str(NANO), "--lib", str(lib), "--prompt", "x", "--top-p", "0"])
    assert "top_p must be in (0, 1]" in err
    # an output that cannot be written fails before the build, not after it
    (tmp_path / "a_file").write_text("")
    err = _error(capsys, ["compile", str(NANO), "-o", str(tmp_path / "a_file" / "x.so")])
    assert "cannot create the directory" in err and "a_file" in err
    if Path("/proc/self").exists():
        err = _error(capsys, ["compile", str(NANO), "-o", "/proc/k3-test.so"])
        assert "-o /proc/k3-test.so: cannot write in /proc" in err


def test_targets_that_cannot_link_here(capsys, tmp_path, monkeypatch):
    """Metal objects link only on a Mac (.tar here); ROCm needs a ROCm install."""
    if sys.platform != "darwin":
        err = _error(capsys, ["compile", str(NANO), "--target", "metal", "-o", str(tmp_path / "m.so")])
        assert "links only on a Mac" in err and "NAME.tar" in err
    monkeypatch.delenv("ROCM_PATH", raising=False)
    if not Path("/opt/rocm/lib").exists():
        err = _error(capsys, ["compile", str(NANO), "--target", "rocm-gfx942", "-o", str(tmp_path / "r.so")])
        assert "rocm-gfx942 does not compile on this machine" in err and "ROCM_PATH" in err


def test_cache_compiles_once_and_reuses(capsys, tmp_path, monkeypatch, lib):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    from k3_compile.compile import cache_path
    from k3_compile.config import K3Config

    # seed the cache with the module's library so the test does not compile again
    want = cache_path(K3Config.from_file(NANO), "llvm", "float32")
    want.parent.mkdir(parents=True)
    shutil.copy(lib, want)
    rc = main(["generate", str(NANO), "--device", "cpu", "--prompt", PROMPT, "--max-tokens", "4",
               "--json", "--verbose"])
    cap = capsys.readouterr()
    assert rc == 0 and f"using cached library {want}" in cap.err
    assert json.loads(cap.out)["lib"] == str(want)


def test_chat_over_stdin(lib):
    proc = subprocess.run(
        [sys.executable, "-m", "k3_compile.cli", "chat", str(NANO), "--lib", str(lib), "--device", "cpu",
         "--max-tokens", "8"],
        input="hello\n/stats\n/reset\n/stats\nline one \\\nline two\n/exit\n", capture_output=True,
        text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "[session totals: prefill " in out and "tok/s" in out and "MLA pages" in out
    assert "[conversation reset]" in out
    stats = [ln for ln in out.splitlines() if "[session totals: prefill " in ln]
    assert "conversation 0/" in stats[1]
    # one reply of at most 8 tokens: its first token came from the prefill, or it ended at EOS
    gen, steps = (int(x) for x in re.search(r"(\d+) tokens generated in (\d+) decode steps", stats[0]).groups())
    assert 0 <= gen <= 8 and gen - steps in (0, 1)
    assert re.search(r"\d+/5 KDA state slots \(batch 4 \+ 1 spare", stats[0])
    assert "Traceback" not in proc.stderr
    # end of input without /exit: exit 0, the last prompt's line ended
    proc = subprocess.run(
        [sys.executable, "-m", "k3_compile.cli", "chat", str(NANO), "--lib", str(lib), "--device", "cpu",
         "--max-tokens", "2"], input="hello\n", capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith(">>> \n"), proc.stdout[-40:]


def test_chat_ctrl_c_stops_the_reply_not_the_chat(lib, monkeypatch, capsys):
    """Ctrl-C while a reply streams: the reply stops, the sequence's cache is cleared, the next
    message is answered from the whole conversation; a known command with arguments is not
    sent to the model."""
    import io

    from k3_compile.runtime import model_runner

    real_send, calls = model_runner.ChatSession.send, []

    def send(self, text, params, stream=None):
        calls.append(text)
        if len(calls) == 1:
            stream("partial")
            raise KeyboardInterrupt
        assert self.model.engine.length(self.seq) == 0  # cleared after the interrupt
        return real_send(self, text, params, stream)

    monkeypatch.setattr(model_runner.ChatSession, "send", send)
    monkeypatch.setattr("sys.stdin", io.StringIO("first\n/stats now\nsecond\n/exit\n"))
    rc = main(["chat", str(NANO), "--lib", str(lib), "--device", "cpu", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "[reply stopped; this turn (your message and the reply) is dropped" in out
    assert "[/stats takes no arguments" in out
    assert calls == ["first", "second"]


def test_targets_table(capsys):
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["name", "description", "verified"]
    assert any(ln.startswith("llvm ") and ln.rstrip().endswith("runs here") for ln in out.splitlines())
    assert "cuda-sm90a" in out


# ---------------------------------------------------------------------- sampler
def _logits(seed=0, n=100):
    return np.random.default_rng(seed).normal(0, 2, size=n).astype(np.float32)


def test_sampler_seeded_reproducible():
    x = _logits()
    a = Sampler(SamplingParams(temperature=0.9, seed=7))
    b = Sampler(SamplingParams(temperature=0.9, seed=7))
    sa = [a(x) for _ in range(50)]
    assert sa == [b(x) for _ in range(50)]
    assert len(set(sa)) > 1  # it does sample


def test_sampler_top_k_1_and_tiny_top_p_are_greedy():
    for seed in range(5):
        x = _logits(seed)
        g = int(np.argmax(x))
        assert Sampler(SamplingParams(temperature=0.0))(x) == g
        assert all(Sampler(SamplingParams(temperature=1.5, top_k=1, seed=s))(x) == g for s in range(10))
        assert all(Sampler(SamplingParams(temperature=1.5, top_p=1e-6, seed=s))(x) == g for s in range(10))


def test_sampler_repetition_penalty_moves_greedy():
    x = np.array([1.0, 3.0, 2.9], np.float32)
    assert Sampler(SamplingParams())(x, context=[1]) == 1
    assert Sampler(SamplingParams(repetition_penalty=1.5))(x, context=[1]) == 2
