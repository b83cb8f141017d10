"""The fused CUDA KDA decode and verify kernels (schedules/kda_decode_cuda.py): their
references vs fla, and that they compile for sm_90a. The decode kernel runs on the H200 in
benchmarks/kda.py (against fla's naive recurrence and fused_recurrent_kda), the verify kernel
in tests/gpu/check_kda_verify.py (not in CI: no GPU here)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from helpers_tvm import build_sm90a_fatbin, needs_nvcc
from schedules.kda_decode_cuda import (decode_tiling, kda_decode_conv_fused_kernel,
                                       kda_decode_conv_fused_reference, kda_decode_fused_kernel,
                                       kda_decode_fused_reference, kda_verify_fused_kernel,
                                       kda_verify_fused_reference)


def _t(x):
    return torch.from_numpy(np.ascontiguousarray(x)).double()


def _fla_step(q, k, v, f, b, A_log, dt_bias, S0, lower_bound):
    """One decode step by fla's naive recurrence (float64), the gate and the L2 norms written
    out in torch: q, k, v, f [B, H, K], b [B, H], the states S0 [B, H, K, V] (NumPy or torch).
    Returns (o [B, H, V], S [B, H, K, V]) as NumPy."""
    from fla.ops.kda.naive import naive_recurrent_kda

    t = lambda x: x.double() if torch.is_tensor(x) else _t(x)  # noqa: E731
    B, H, K = f.shape
    z = torch.exp(t(A_log))[None, :, None] * (t(f) + t(dt_bias).view(1, H, K))
    g = lower_bound * torch.sigmoid(z) if lower_bound is not None else \
        -torch.exp(t(A_log))[None, :, None] * torch.nn.functional.softplus(t(f) + t(dt_bias).view(1, H, K))
    l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    o_ref, S_ref = naive_recurrent_kda(l2(t(q))[:, None], l2(t(k))[:, None], t(v)[:, None],
                                       g[:, None], torch.sigmoid(t(b))[:, None],
                                       initial_state=t(S0), output_final_state=True)
    return o_ref[:, 0].numpy(), S_ref.numpy()


def _step_params(rng, B, H, K):
    """Random gate inputs of a decode step: f [B, H, K], b [B, H], A_log [H] (its exp in
    1..16), dt_bias [H·K], all float32."""
    f = rng.standard_normal((B, H, K)).astype(np.float32)
    b = rng.standard_normal((B, H)).astype(np.float32)
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    dt_bias = (rng.standard_normal(H * K) * 0.5).astype(np.float32)
    return f, b, A_log, dt_bias


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_reference_matches_fla_naive_recurrence(lower_bound):
    rng = np.random.default_rng(0)
    B, H, K = 3, 5, 32  # odd batch and heads
    q, k, v = (rng.standard_normal((B, H, K)).astype(np.float32) for _ in range(3))
    f, b, A_log, dt_bias = _step_params(rng, B, H, K)
    slots = np.array([4, 0, 2], np.int32)
    pool = (rng.standard_normal((2, 5, H, K, K)) * 0.1).astype(np.float32)
    S0 = pool[1, slots].copy()
    o = kda_decode_fused_reference(q, k, v, f, b, A_log, dt_bias, slots, pool, 1, lower_bound)

    o_ref, S_ref = _fla_step(q, k, v, f, b, A_log, dt_bias, S0, lower_bound)
    np.testing.assert_allclose(o, o_ref, atol=1e-5)
    np.testing.assert_allclose(pool[1, slots], S_ref, atol=1e-5)


def test_conv_fused_reference_matches_torch_conv_and_fla():
    """The conv-fused decode step's reference against an independent chain: torch's depthwise
    conv1d over [stored window, x] with SiLU, the window shifted by hand, then fla's naive
    recurrence (odd batch, heads and head_dim; scattered slots; layer 1 of 2)."""
    rng = np.random.default_rng(1)
    B, H, K, W = 3, 3, 24, 4
    xs = [rng.standard_normal((B, H * K)).astype(np.float32) for _ in range(3)]
    ws = [(rng.standard_normal((H * K, 1, W)) * 0.5).astype(np.float32) for _ in range(3)]
    f, b, A_log, dt_bias = _step_params(rng, B, H, K)
    slots = np.array([4, 0, 2], np.int32)
    pool = (rng.standard_normal((2, 5, H, K, K)) * 0.1).astype(np.float32)
    conv = rng.standard_normal((2, 5, 3, W - 1, H * K)).astype(np.float32)
    S0, win0, conv0 = pool[1, slots].copy(), conv[1, slots].copy(), conv.copy()
    o = kda_decode_conv_fused_reference(*xs, *ws, f, b, A_log, dt_bias, slots, pool, conv, 1, -5.0)

    ys = []
    for p in range(3):
        xpad = torch.cat([_t(win0[:, p]), _t(xs[p])[:, None]], dim=1)          # [B, W, H*K]
        z = torch.nn.functional.conv1d(xpad.transpose(1, 2), _t(ws[p]), groups=H * K)[:, :, 0]
        ys.append(torch.nn.functional.silu(z).view(B, H, K))
        np.testing.assert_allclose(conv[1, slots, p], xpad[:, 1:].numpy(), atol=0)
    o_ref, S_ref = _fla_step(*ys, f, b, A_log, dt_bias, S0, -5.0)
    np.testing.assert_allclose(o, o_ref, atol=1e-5)
    np.testing.assert_allclose(pool[1, slots], S_ref, atol=1e-5)
    # other slots and the other layer keep their windows
    np.testing.assert_array_equal(conv[1, [1, 3]], conv0[1, [1, 3]])
    np.testing.assert_array_equal(conv[0], conv0[0])


def test_conv_fused_reference_head_norm_and_gate_match_torch():
    """With ``out_norm_eps`` the reference's o is torch's rms_norm of the plain step's o over
    each head's K values, times o_norm.weight and σ(g) (spec §3 step 6)."""
    rng = np.random.default_rng(2)
    B, H, K, W = 2, 3, 16, 3
    args = ([rng.standard_normal((B, H * K)).astype(np.float32) for _ in range(3)]
            + [(rng.standard_normal((H * K, 1, W)) * 0.5).astype(np.float32) for _ in range(3)]
            + [*_step_params(rng, B, H, K), np.array([1, 0], np.int32)])
    pool = (rng.standard_normal((1, 2, H, K, K)) * 0.1).astype(np.float32)
    conv = rng.standard_normal((1, 2, 3, W - 1, H * K)).astype(np.float32)
    g = rng.standard_normal((B, H * K)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, K).astype(np.float32)
    plain = kda_decode_conv_fused_reference(*args, pool.copy(), conv.copy(), 0, None)
    normed = kda_decode_conv_fused_reference(*args, pool.copy(), conv.copy(), 0, None, g=g, o_norm_w=w,
                                             out_norm_eps=1e-5)
    want = (torch.nn.functional.rms_norm(torch.from_numpy(plain).double(), (K,), torch.from_numpy(w).double(),
                                         eps=1e-5)
            * torch.sigmoid(torch.from_numpy(g).double().view(B, H, K)))
    np.testing.assert_allclose(normed, want.numpy(), rtol=1e-5, atol=1e-6)


def test_conv_fused_kernel_rejects_bad_sizes():
    with pytest.raises(ValueError, match="W >= 2"):
        kda_decode_conv_fused_kernel(2, 128, 1, -5.0, "bfloat16")
    # one block a head: K / vec × k_split threads must be whole warps
    with pytest.raises(ValueError, match="itself a multiple of 32"):
        kda_decode_conv_fused_kernel(2, 64, 4, -5.0, "bfloat16", k_split=1, vec=4)


def test_kernel_rejects_bad_tiling():
    with pytest.raises(ValueError, match="must be a multiple of cols_per_block"):
        kda_decode_fused_kernel(2, 128, 100, -5.0)
    # 16 threads a block: the norms' warp shuffles need whole warps
    with pytest.raises(ValueError, match="itself a multiple of 32"):
        kda_decode_fused_kernel(2, 128, 128, -5.0, cols_per_block=16, k_split=1)
    # 64 columns, one row split: 64 threads with vec 1, 16 with vec 4
    kda_decode_fused_kernel(2, 128, 128, -5.0, cols_per_block=64, k_split=1)
    with pytest.raises(ValueError, match="itself a multiple of 32"):
        kda_decode_fused_kernel(2, 128, 128, -5.0, cols_per_block=64, k_split=1, vec=4)
    with pytest.raises(ValueError, match="vec=3 must be 1, 2 or 4"):
        kda_decode_fused_kernel(2, 128, 128, -5.0, cols_per_block=64, k_split=4, vec=3)
    # 96 rows: 128 threads neither divide them nor are a multiple of them
    with pytest.raises(ValueError, match="divide K or be a multiple of it"):
        kda_decode_fused_kernel(2, 96, 96, -5.0, cols_per_block=32, k_split=4)
    # 128 × 16 = 2048 threads: a multiple of K, past CUDA's 1024 per block
    with pytest.raises(ValueError, match="at most 1024"):
        kda_decode_fused_kernel(2, 128, 128, -5.0, cols_per_block=128, k_split=16)


def test_model_tiling():
    """K3's head_dim 128 takes the 8-byte column pairs; sizes whose rows the threads do not
    divide fall back to one column per thread, as before vec existed."""
    assert decode_tiling(128) == (64, 4, 2)
    assert decode_tiling(64) == (32, 1, 1)
    assert decode_tiling(96) == (32, 1, 1)
    assert decode_tiling(48) is None


def _kernel_source(tmp_path, imports: str, kernel: str) -> str:
    """The CUDA source TVM generates for ``kernel`` (a Python expression building a PrimFunc
    from schedules.kda_decode_cuda's ``imports``), built to an sm_90a fatbin by nvcc."""
    build_sm90a_fatbin(f"from schedules.kda_decode_cuda import {imports}\n"
                       f"f = ({kernel}).with_attr('global_symbol', 'k')\n"
                       "mod = tvm.IRModule({'k': f})", tmp_path, keep_src=True)
    return "".join(p.read_text() for p in (tmp_path / "src").glob("*.cu"))


@needs_nvcc
def test_kernel_compiles_to_fatbin_for_sm90a(tmp_path):
    out = build_sm90a_fatbin(
        "from schedules.kda_decode_cuda import kda_decode_fused_kernel\n"
        "f = kda_decode_fused_kernel(3, 128, 128, -5.0).with_attr('global_symbol', 'k')\n"
        "mod = tvm.IRModule({'k': f})", tmp_path)
    assert "fatbin" in out


@needs_nvcc
def test_model_tiling_moves_the_state_in_8_byte_accesses(tmp_path):
    """With the model's tiling each thread's 32 rows of its column pair are loaded and stored
    as float2 (the codegen falls back to gathering single floats, ``make_float2(S_ptr[...])``,
    where it cannot prove the pair's address aligned, which would lose the 8-byte accesses the
    tiling was chosen for)."""
    src = _kernel_source(tmp_path, "decode_tiling, kda_decode_fused_kernel",
                         "kda_decode_fused_kernel(12, 128, 128, -5.0, *decode_tiling(128))")
    assert src.count("*(float2*)(S_ptr + ") == 2 * 32
    assert "make_float2(S_ptr[" not in src


@needs_nvcc
def test_conv_fused_kernel_compiles_with_8_byte_state_accesses(tmp_path):
    """The conv-fused decode kernel at the model's tiling builds for sm_90a; its 16 rows of a
    column pair per thread are loaded and stored as float2 (as the plain decode kernel's), and
    every channel's conv window is read and written in place in the pool."""
    from schedules.kda_decode_cuda import decode_conv_tiling

    assert decode_conv_tiling(128) == (8, 2)
    src = _kernel_source(tmp_path, "decode_conv_tiling, kda_decode_conv_fused_kernel",
                         "kda_decode_conv_fused_kernel(12, 128, 4, -5.0, 'bfloat16', *decode_conv_tiling(128))")
    assert src.count("*(float2*)(S_ptr + ") == 2 * 16
    assert "make_float2(S_ptr[" not in src
    # three projections × (3 window reads + 3 window writes), each a cs_ptr access
    assert src.count("cs_ptr[") == 3 * 6


@needs_nvcc
def test_conv_fused_kernel_with_head_norm_writes_the_model_dtype(tmp_path):
    """With step 6 inside, o leaves the kernel once, in bf16 (each of the head's 128 columns by
    one thread), after the head's Σ o² is reduced over the block."""
    src = _kernel_source(tmp_path, "kda_decode_conv_dispatch, kda_decode_conv_fused_kernel",
                         "kda_decode_conv_fused_kernel(12, 128, 4, -5.0, 'bfloat16', "
                         "*kda_decode_conv_dispatch(12, 128)[:2], out_norm_eps=1e-5)")
    assert "nv_bfloat16* __restrict__ o_ptr" in src
    assert src.count("o_ptr[") == 1 and "= ((nv_bfloat16)(" in src


def test_model_dispatches_the_conv_fused_decode():
    """A GPU build of the KDA layer takes the conv-fused decode where the fused decode fits;
    ``tuned=False`` (``--generic-kernels``) and CPU builds keep the generic path."""
    from k3_compile.config import K3Config
    from relax_modules.kda import KimiDeltaAttention

    def layer(heads, **kw):
        cfg = K3Config(hidden_size=64, kda_num_heads=heads, kda_head_dim=128, short_conv_kernel_size=4,
                       gate_lower_bound=-5.0, rms_norm_eps=1e-5)
        return KimiDeltaAttention(cfg, kw.pop("dtype", "bfloat16"), **kw)

    # below 48 heads (k3-nano: 2; K3 at tensor parallel 8: 12) the head norm and gate go inside
    assert layer(2, gpu=True).decode_conv == (4, 2, True)
    assert layer(12, gpu=True).decode_conv == (4, 2, True)
    assert layer(96, gpu=True).decode_conv == (8, 2, False)
    assert layer(2, gpu=True, tuned=False).decode_conv is None
    assert layer(2, dtype="float32").decode_conv is None


def test_pdl_option_sets_the_launch_tag():
    """``pdl=True`` carries TVM's launch tag (else the runtime launches the kernel plainly and
    its wait orders nothing); the default does not."""
    from schedules.kda_decode_cuda import PDL_LAUNCH_TAG

    assert PDL_LAUNCH_TAG == "tirx.use_programtic_dependent_launch"   # TVM 0.27's spelling
    f = kda_decode_fused_kernel(12, 128, 128, -5.0, *decode_tiling(128), pdl=True)
    assert list(f.attrs["tirx.kernel_launch_params"]) == [PDL_LAUNCH_TAG]
    assert "tirx.kernel_launch_params" not in kda_decode_fused_kernel(12, 128, 128, -5.0, *decode_tiling(128)).attrs


@needs_nvcc
def test_pdl_kernel_reads_its_inputs_only_after_the_wait(tmp_path):
    """With programmatic dependent launch the kernel may run while the kernel ahead of it is
    still writing q, k, v, f and b: before ``griddepcontrol.wait`` only the pool slot and the
    state may be read and nothing written, in the source and in the PTX nvcc makes of it. After
    the wait those inputs must be read through L2 (``ld.global.cg``), not as ``ld.global.nc``
    (read-only for the kernel's lifetime): the build that let nvcc choose ``.nc`` read f
    before the kernel ahead had written it on the H200
    (benchmarks/results/kda_decode_pdl_race_h200_2026-12-02.json)."""
    import shutil
    import subprocess

    build_sm90a_fatbin(
        "from schedules.kda_decode_cuda import decode_tiling, kda_decode_fused_kernel\n"
        "f = kda_decode_fused_kernel(12, 128, 128, -5.0, *decode_tiling(128), pdl=True)"
        ".with_attr('global_symbol', 'k')\n"
        "mod = tvm.IRModule({'k': f})", tmp_path, keep_src=True)
    cu = next((tmp_path / "src").glob("*.cu"))
    src = cu.read_text()
    body = src[src.index("__global__"):]
    before, after = body.split("tvm_builtin_ptx_griddepcontrol_wait();", 1)
    assert before.count("*(float2*)(S_ptr + ") == 32          # the state's loads ...
    assert after.count("*(float2*)(S_ptr + ") == 32           # ... its stores after the wait
    assert "slots_ptr[" in before
    for name in ("q_ptr[", "k_ptr[", "v_ptr[", "f_ptr[", "bb_ptr[", "o_ptr["):
        assert name not in before and name in after, name
    ptx = tmp_path / "k.ptx"
    subprocess.run([shutil.which("nvcc"), "-ptx", "-arch=sm_90a", "-O3", str(cu), "-o", str(ptx)], check=True,
                   capture_output=True)
    pre, post = ptx.read_text().split("griddepcontrol.wait;", 1)
    assert pre.count("ld.global") == 33 and "st.global" not in pre    # 32 state pairs + the slot
    # after it: q, k, f, v (a column pair) and b through L2; only the weights A_log and dt_bias,
    # which no kernel writes, as .nc
    assert post.count("ld.global.cg") == 11 and post.count("ld.global.nc") == 2, (
        post.count("ld.global.cg"), post.count("ld.global.nc"))


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_verify_reference_matches_fla_naive_recurrence(lower_bound):
    """The verify reference for 5 tokens of 3 sequences: every token's output and the final
    state equal fla's naive recurrence over the 5 tokens, and each kept intermediate state
    equals the naive recurrence's final state over that prefix of the tokens."""
    from fla.ops.kda.naive import naive_recurrent_kda

    rng = np.random.default_rng(1)
    B, TV, H, K = 3, 5, 3, 32
    q, k, f, v = (rng.standard_normal((B, TV, H, K)).astype(np.float32) for _ in range(4))
    b = rng.standard_normal((B, TV, H)).astype(np.float32)
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    dt_bias = (rng.standard_normal(H * K) * 0.5).astype(np.float32)
    slots = np.array([2, 0, 3], np.int32)
    pool = (rng.standard_normal((1, 4, H, K, K)) * 0.1).astype(np.float32)
    S0 = pool[0, slots].copy()
    o, states = kda_verify_fused_reference(q, k, v, f, b, A_log, dt_bias, slots, pool, 0, lower_bound)
    assert o.shape == (B, TV, H, K) and states.shape == (B, TV - 1, H, K, K)

    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).double()  # noqa: E731
    z = torch.exp(t(A_log))[None, None, :, None] * (t(f) + t(dt_bias).view(1, 1, H, K))
    g = lower_bound * torch.sigmoid(z) if lower_bound is not None else \
        -torch.exp(t(A_log))[None, None, :, None] * torch.nn.functional.softplus(t(f) + t(dt_bias).view(1, 1, H, K))
    l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731

    def naive(n):  # the first n tokens
        return naive_recurrent_kda(l2(t(q[:, :n])), l2(t(k[:, :n])), t(v[:, :n]), g[:, :n],
                                   torch.sigmoid(t(b[:, :n])), initial_state=t(S0), output_final_state=True)

    o_ref, S_ref = naive(TV)
    np.testing.assert_allclose(o, o_ref.numpy(), atol=1e-5)
    np.testing.assert_allclose(pool[0, slots], S_ref.numpy(), atol=1e-5)
    for n in range(1, TV):
        np.testing.assert_allclose(states[:, n - 1], naive(n)[1].numpy(), atol=1e-5)


def test_verify_kernel_rejects_one_token_and_bad_tiling():
    with pytest.raises(ValueError, match="tokens must be at least 2"):
        kda_verify_fused_kernel(2, 128, 128, -5.0, 1)
    with pytest.raises(ValueError, match="must be a multiple of cols_per_block"):
        kda_verify_fused_kernel(2, 128, 100, -5.0, 4)
    with pytest.raises(ValueError, match="no decode tiling fits head_dim 48"):
        kda_verify_fused_kernel(2, 48, 48, -5.0, 4)
    with pytest.raises(ValueError, match="together"):   # vec alone would drop the model's tiling
        kda_verify_fused_kernel(2, 128, 128, -5.0, 4, vec=2)
    pool = np.ones((1, 1, 1, 32, 32), np.float32)
    one = np.zeros((1, 1, 1, 32), np.float32)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        kda_verify_fused_reference(one, one, one, one, np.zeros((1, 1, 1), np.float32), np.zeros(1, np.float32),
                                   np.zeros(32, np.float32), np.zeros(1, np.int32), pool, 0, -5.0)
    assert (pool == 1).all()   # untouched


@needs_nvcc
def test_verify_kernel_compiles_to_fatbin_for_sm90a(tmp_path):
    out = build_sm90a_fatbin(
        "from schedules.kda_decode_cuda import kda_verify_fused_kernel\n"
        "f = kda_verify_fused_kernel(3, 128, 128, None, 3).with_attr('global_symbol', 'k')\n"
        "mod = tvm.IRModule({'k': f})", tmp_path)
    assert "fatbin" in out
