"""The tuned kernels the model dispatches on CUDA — MoE (decode GEMVs, prefill grouped GEMM)
and KDA (fused decode, tensor-core chunked prefill) — against the generic path.

``prepare OUT`` (here): writes a random K3-format checkpoint whose latent and expert widths
fit the tuned kernels (512: multiples of 128, and 4 warps split its K; KDA head_dim 128), with the routed experts made to dominate each MoE layer's
output (no routed_expert_norm, whose RMS normalization would hide a wrong scale, and
``routed_expert_up_proj`` ×20), and compiles it for cuda-sm90a in bf16 twice: with the tuned
kernels and with ``--generic-kernels``. ``run OUT`` (H200, runtime-only TVM): prefill 150
tokens (three KDA chunks) then 16 decode steps, a second sequence's prefill of 170 tokens
(the MoE prefill's warp-specialized wgmma form) and a third's of 30 (its small-tile form) with each library (the tuned one fed the generic one's greedy
tokens); reports the largest prefill-logit difference and each decode step's; exits 1 if a
logit differs by more than ``TOLERANCE`` (10%) of the largest. Seen on the H200 (2026-11-29) with the
tensor-core decode GEMVs: prefill logits equal, decode logits within 0.029 of 2.6 at every
step (benchmarks/results/moe_decode_tc_h200_2026-11-29.json, ``dispatch_check``); the greedy
tokens of an untied run differed at step 15 by a near-tie, hence the teacher forcing. Again
on 2026-11-30 with the tc code layout (codes permuted by load_model): prefill logits equal,
decode within 0.029 (benchmarks/results/moe_dispatch_check_h200_2026-11-30.json).
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def prepare(out: Path) -> None:
    from k3_compile.compile import compile_model
    from oracle_mlx import tiny_config, write_random_checkpoint

    # head_dim 128: the tuned library also dispatches the KDA kernels (fused decode, tensor-core
    # prefill), which need K = V = 128
    lac = {**tiny_config()["text_config"]["linear_attn_config"], "kda_layers": [1, 2],
           "full_attn_layers": [3], "head_dim": 128}
    raw = tiny_config(hidden_size=256, num_hidden_layers=3, linear_attn_config=lac,
                      routed_expert_hidden_size=512, moe_intermediate_size=512,
                      num_experts=3, num_experts_per_token=2)
    raw["text_config"]["latent_moe_use_norm"] = False
    write_random_checkpoint(out / "ckpt", raw, seed=5, scale=0.05)
    _amplify_routed_experts(out / "ckpt")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # load_model wants a tokenizer
        shutil.copy(ROOT / "models" / "k3-nano" / f, out / "ckpt" / f)
    for name, generic in (("tuned", False), ("generic", True)):
        compile_model(out / "ckpt", "cuda-sm90a", out / f"{name}.so", dtype="bfloat16",
                      generic_kernels=generic)


def _amplify_routed_experts(ckpt: Path, factor: float = 20.0) -> None:
    """Scale every ``routed_expert_up_proj.weight`` of the checkpoint by ``factor`` in place,
    so that the routed experts' output dominates the residual stream."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    for shard in ckpt.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for name, arr in tensors.items():
            if name.endswith("routed_expert_up_proj.weight"):
                tensors[name] = (arr.astype(np.float32) * factor).astype(ml_dtypes.bfloat16)
        save_file(tensors, str(shard))


def run(out: Path) -> dict:
    """Prefill 150 tokens, then 16 decode steps with each library. The generic library picks
    the tokens greedily; the tuned one is fed the same tokens (teacher forcing), so a near-tie
    that one library breaks the other way cannot make the later steps incomparable."""
    from k3_compile.runtime.model_runner import load_model

    # 150 tokens: three KDA chunks of 64, so the prefill's inter-chunk state pass runs; a second
    # sequence of 170 tokens: 340 pairs over 3 experts reach the wgmma kernels' warp-specialized
    # form (schedules/moe_plan.py WS_MIN_PAIRS_PER_EXPERT · 3 = 336), 150 (300 pairs) do not.
    # (A 200-token input, rng seed 1, differs by 155% of the largest logit with the tuned library
    # of before this form as well (2026-11-30): not the MoE kernels, which equal the mma.sync
    # ones bit for bit. On the CPU in fp32 the model with the KDA split prefill kernels emulated
    # gives the generic model's logits at that input (difference <= 2e-5), while the generic
    # bf16 GPU library's largest logit there is 1.77 against 2.55 in fp32: a bf16 effect in a
    # model whose routed experts are amplified x20, as far as the emulation shows.)
    from schedules.moe_mxfp4_prefill_wgmma import small_max_pairs, ws_min_pairs

    ids = [int(t) for t in np.random.default_rng(0).integers(3, 97, size=150)]
    n_ws = ws_min_pairs(3) // 2 + 2   # 170 tokens at 112 pairs per expert: past the threshold
    assert 150 * 2 < ws_min_pairs(3) <= n_ws * 2
    ids_ws = [int(t) for t in np.random.default_rng(2).integers(3, 97, size=n_ws)]
    # a third sequence of 30 tokens: 60 pairs, below small_max_pairs(3) = 72: the small-tile form
    n_small = small_max_pairs(3) // 2 - 6
    assert 0 < n_small * 2 < small_max_pairs(3)
    ids_small = [int(t) for t in np.random.default_rng(3).integers(3, 97, size=n_small)]
    res, forced = {}, None
    for name in ("generic", "tuned"):
        m = load_model(out / "ckpt", lib=out / f"{name}.so", device="cuda:0")
        eng = m.engine
        s = eng.add_sequence()
        logits = eng.prefill([s], [ids])
        first = np.array(logits[0])
        toks, rows = [], []
        for i in range(16):
            t = int(np.argmax(logits[0])) if forced is None else forced[i]
            toks.append(t)
            logits = eng.decode([s], [t])
            rows.append(np.array(logits[0]))
        s_ws = eng.add_sequence()
        first_ws = np.array(eng.prefill([s_ws], [ids_ws])[0])
        s_small = eng.add_sequence()
        first_small = np.array(eng.prefill([s_small], [ids_small])[0])
        res[name] = (toks, np.stack(rows), first, first_ws, first_small)
        forced = toks
    step_diff = np.abs(res["tuned"][1] - res["generic"][1]).max(axis=1)
    report = {"tokens": res["generic"][0],
              "step_max_logit_diff": [round(float(d), 5) for d in step_diff],
              "argmax_agree": [bool(a) for a in
                               res["tuned"][1].argmax(1) == res["generic"][1].argmax(1)],
              "max_decode_logit_diff": float(step_diff.max()),
              "max_prefill_logit_diff": float(np.abs(res["tuned"][2] - res["generic"][2]).max()),
              "max_abs_prefill_logit": float(np.abs(res["generic"][2]).max()),
              "max_prefill_ws_logit_diff": float(np.abs(res["tuned"][3] - res["generic"][3]).max()),
              "max_abs_prefill_ws_logit": float(np.abs(res["generic"][3]).max()),
              "max_prefill_small_logit_diff": float(np.abs(res["tuned"][4] - res["generic"][4]).max()),
              "max_abs_prefill_small_logit": float(np.abs(res["generic"][4]).max()),
              "max_abs_logit": float(np.abs(res["generic"][1]).max())}
    print(json.dumps(report))
    return report


# Allowed difference, as a fraction of the largest |logit|. The tuned KDA prefill multiplies
# in TF32 (like fla's chunk_kda; its o error vs the naive recurrence is below chunk_kda's), and
# this random model with its routed experts amplified ×20 magnifies such differences: 6% at
# prefill on the H200 (2026-11-30), where the MoE kernels alone gave 0% (prefill) and 1.1%
# (decode). A wrong index map or operand gives differences of the order of the logits.
TOLERANCE = 0.10


def ok(report: dict) -> bool:
    """Every prefill and decode logit within TOLERANCE of the largest |logit| (the greedy
    tokens are reported, not required to agree: near-ties flip)."""
    return (report["max_prefill_logit_diff"] <= TOLERANCE * report["max_abs_prefill_logit"]
            and report["max_prefill_ws_logit_diff"] <= TOLERANCE * report["max_abs_prefill_ws_logit"]
            and report["max_prefill_small_logit_diff"] <= TOLERANCE * report["max_abs_prefill_small_logit"]
            and report["max_decode_logit_diff"] <= TOLERANCE * report["max_abs_logit"])


if __name__ == "__main__":
    step, out = sys.argv[1], Path(sys.argv[2])
    if step == "prepare":
        prepare(out)
    else:
        sys.exit(0 if ok(run(out)) else 1)
