"""The Hopper wgmma MoE prefill kernels (schedules/moe_mxfp4_prefill_wgmma.py), on the CPU:
the k order they rely on, emulated lane by lane against a plain matmul; the permutation of
the activations against the reshape-transpose the model applies; the 128-byte swizzle against
the hardware rule; size checks; that they compile (CUDA source always, fatbin where nvcc
exists) and that a cuda-sm90a bf16 export dispatches them. They run on the H200 in
benchmarks/moe.py (outputs equal to the mma.sync kernels') and tests/gpu/check_moe_dispatch.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

from helpers_tvm import build_sm90a_fatbin, needs_nvcc
from schedules import moe_mxfp4_prefill_cuda as mp
from schedules import moe_mxfp4_prefill_wgmma as mw
from schedules import wgmma_ptx


def _wgmma_m64nk16(a_regs, b_tile: np.ndarray) -> np.ndarray:
    """What one ``wgmma.m64nNk16`` with A from registers computes (PTX ISA, "Register
    fragment of matrix A for wgmma .m64nNk16": warp w holds rows 16w..16w+15 as the
    mma.m16n8k16 A fragment — a0 row g k 2q..2q+1, a1 row g+8, a2 row g k 2q+8.., a3 row
    g+8); ``a_regs(w, g, q) -> (a0, a1, a2, a3)`` (pairs of values); ``b_tile [N, 16]``: the
    slice's B rows in shared memory, k contiguous (K-major). Returns the 64 × N product."""
    A = np.zeros((64, 16))
    for w in range(4):
        for lane in range(32):
            g, q = lane // 4, lane % 4
            a0, a1, a2, a3 = a_regs(w, g, q)
            r = 16 * w + g
            A[r, 2 * q:2 * q + 2], A[r + 8, 2 * q:2 * q + 2] = a0, a1
            A[r, 2 * q + 8:2 * q + 10], A[r + 8, 2 * q + 8:2 * q + 10] = a2, a3
    return A @ b_tile.T


def test_wgmma_k_order_computes_the_matmul():
    """A K step of 64 inputs as the kernel runs it: thread (g, q) of warp w dequantizes inputs
    8q..8q+7 of each 32 of its rows 16w+g, 16w+g+8 (``aw``, the kernel's ``bf``) and passes the
    words ``MMA_A_REGS[m]`` to the wgmma of k16 slice 2hk + m, whose B is the tokens' row in
    the permuted k order at inputs 16(2hk + m) ..; the four slices must give W @ X^T."""
    rng = np.random.default_rng(3)
    W = rng.standard_normal((64, 64))          # weight rows × the step's inputs
    X = rng.standard_normal((40, 64))          # tokens × inputs (N = 40)
    Xp = mw.permute_inputs_reference(X)        # what the kernel's shared memory holds (unswizzled)
    D = np.zeros((64, 40))
    for hk in range(2):
        for m in range(2):
            def regs(w, g, q, hk=hk, m=m):
                aw = ([W[16 * w + g, 32 * hk + 8 * q + 2 * i: 32 * hk + 8 * q + 2 * i + 2] for i in range(4)]
                      + [W[16 * w + g + 8, 32 * hk + 8 * q + 2 * i: 32 * hk + 8 * q + 2 * i + 2] for i in range(4)])
                return tuple(aw[r] for r in mp.MMA_A_REGS[m])

            s = 2 * hk + m
            D += _wgmma_m64nk16(regs, Xp[:, 16 * s:16 * s + 16])
    np.testing.assert_allclose(D, W @ X.T, rtol=1e-12, atol=1e-12)


def test_permutation_is_the_models_reshape_transpose():
    """relax_modules/moe.py permutes z by reshape [n, L/32, 4, 4, 2] -> transpose of the two
    4-axes -> reshape; the kernels' ``permuted_position`` (an involution) must say the same."""
    x = np.arange(3 * 128).reshape(3, 128)
    by_reshape = x.reshape(3, 4, 4, 4, 2).transpose(0, 1, 3, 2, 4).reshape(3, 128)
    np.testing.assert_array_equal(mw.permute_inputs_reference(x), by_reshape)
    i = np.arange(256)
    np.testing.assert_array_equal(mw.permuted_position(mw.permuted_position(i)), i)
    assert sorted(mw.permuted_position(i).tolist()) == i.tolist()
    assert mw.permuted_position(8) == 2 and mw.permuted_position(2) == 8  # pair 4 <-> slot 1


def test_swizzle128_is_the_hardware_rule():
    """128-byte swizzle (the descriptor's layout type 1): byte address bits 4-6 XOR bits 7-9
    of a 1024-byte-aligned tile; a bijection onto the tile."""
    seen = set()
    for r in range(128):
        for c in range(8):
            byte = 4 * wgmma_ptx.swizzle128_word(r, c)
            assert byte == (r * 128 + c * 16) ^ ((r * 128 >> 7) % 8 << 4)
            seen.add(byte)
    assert seen == {16 * i for i in range(1024)}


def test_descriptor_reads_what_the_copies_wrote():
    """The descriptor's fields (PTX "Matrix Descriptor Format": start address >> 4 in bits
    0-13, leading byte offset >> 4 in 16-29, stride byte offset >> 4 in 32-45, layout type in
    62-63, 1 = 128-byte swizzle), and the hardware's read of k16 slice ``s`` of a stage — the
    kernel adds ``stage · TOK_WORDS/4 + 2s`` descriptor units — through the swizzle: it must
    find, for every token row, the inputs 16s .. 16s+15 that ``issue`` copied there (chunk c of
    row r at ``swizzle128_word(r, c)``)."""
    bits = wgmma_ptx.DESC_SW128_BITS
    assert bits & 0x3FFF == 0                       # start address: added per tile
    assert (bits >> 16) & 0x3FFF == 1               # leading byte offset (unused when swizzled)
    assert (bits >> 32) & 0x3FFF == 1024 >> 4       # 8 rows of 128 bytes between core-matrix groups
    assert bits >> 62 == 1 and (bits >> 49) & 7 == 0  # 128-byte swizzle, base offset 0
    rng = np.random.default_rng(5)
    rows = mw.BM
    x = rng.integers(0, 2 ** 16, (rows, 64)).astype(np.uint16)   # one K step of bf16 tokens
    stage, base = 2, 4096                                         # a 1024-aligned tile base (bytes)
    smem = np.zeros(base + (stage + 1) * mw.TOK_WORDS * 4, np.uint8)
    tile = base + stage * mw.TOK_WORDS * 4
    for r in range(rows):                                         # issue(): 16-byte chunks
        for c in range(8):
            off = tile + 4 * wgmma_ptx.swizzle128_word(r, c)
            smem[off:off + 16] = x[r, 8 * c:8 * c + 8].view(np.uint8)
    for s in range(4):
        start = (base >> 4) + stage * (mw.TOK_WORDS // 4) + 2 * s  # descriptor start, 16-byte units
        for r in range(rows):
            got = []
            for b in range(0, 32, 2):                             # the slice's 16 bf16 of row r
                addr = start * 16 + r * 128 + b                   # unswizzled address
                addr ^= ((addr >> 7) & 7) << 4                    # the 128-byte swizzle
                got.append(smem[addr:addr + 2].view(np.uint16)[0])
            np.testing.assert_array_equal(got, x[r, 16 * s:16 * s + 16])


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="multiple of 128"):
        mw.moe_grouped_gate_up_wgmma_kernel(4, 192, 128, 2, 4.0, None)
    with pytest.raises(ValueError, match="stages must be at least 3"):
        mw.moe_grouped_down_wgmma_kernel(4, 256, 256, 2, stages=2)
    with pytest.raises(ValueError, match="multiple of 128"):
        mw.moe_grouped_down_wgmma_kernel(4, 192, 256, 2)  # L: 128 output columns per block
    with pytest.raises(ValueError, match="N must be"):
        wgmma_ptx.wgmma_bf16_rs(100, 0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="0..3"):
        wgmma_ptx.wgmma_wait(4)
    with pytest.raises(ValueError, match="multiple of 32"):
        mw.permute_inputs_reference(np.zeros((2, 48)))
    with pytest.raises(ValueError, match="staged epilogue is gate_up's"):
        mw._grouped_wgmma("down", 4, 256, 256, 2, staged=True)


def test_staged_gate_up_epilogue_stores_whole_rows():
    """``staged`` (gate_up): the outputs leave through shared memory in 16-byte stores."""
    import tvm

    from schedules.barriers import respect_manual_barriers
    from targets import get_target

    f = mw.moe_grouped_gate_up_wgmma_kernel(5, 256, 128, 3, 4.0, 25.0, staged=True)
    with respect_manual_barriers():
        lib = tvm.tirx.build(tvm.IRModule({"gu": f.with_attr("global_symbol", "gu")}),
                             target=get_target("cuda-sm90a").tvm_target())
    src = lib.imports[0].inspect_source()
    assert "*(uint4*)(yq_ptr" in src


def _module():
    import tvm

    fs = {"gu": mw.moe_grouped_gate_up_wgmma_kernel(5, 256, 128, 3, 4.0, 25.0),
          "d": mw.moe_grouped_down_wgmma_kernel(5, 256, 128, 3, stages=3)}
    return tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in fs.items()})


def test_cuda_source_has_the_three_wgmma_widths():
    import tvm

    from schedules.barriers import respect_manual_barriers
    from targets import get_target

    with respect_manual_barriers():
        lib = tvm.tirx.build(_module(), target=get_target("cuda-sm90a").tvm_target())
    src = lib.imports[0].inspect_source()
    assert {int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", src)} == {32, 64, 128}
    assert "__launch_bounds__(256, 2)" in src and "fence.proxy.async.shared::cta" in src


@needs_nvcc
def test_kernels_compile_to_fatbin_for_sm90a(tmp_path):
    out = build_sm90a_fatbin(
        "from tests.test_moe_prefill_wgmma import _module\n"
        "from schedules.barriers import respect_manual_barriers\n"
        "mod = _module()", tmp_path, contexts="respect_manual_barriers()")
    assert "fatbin" in out


def test_only_hopper_builds_use_wgmma():
    """The target's ``Features.wgmma`` decides (k3_compile/compile.py passes it to the export):
    sm_90a only — Blackwell has no wgmma."""
    from k3_compile.config import K3Config
    from k3_compile.pipeline import export_model
    from targets import get_target

    assert get_target("cuda-sm90a").features.wgmma
    assert not any(get_target(t).features.wgmma for t in ("cuda-sm100a", "cuda-sm120a", "llvm"))
    from oracle_mlx import tiny_config

    cfg = K3Config.from_dict(tiny_config(routed_expert_hidden_size=128, moe_intermediate_size=128))
    on = export_model(cfg, "bfloat16", gpu=True, tuned=True, wgmma=True).mod.script()
    off = export_model(cfg, "bfloat16", gpu=True, tuned=True, wgmma=False).mod.script()
    assert "k3_wgmma_m64n128k16" in on and "k3_wgmma_m64n128k16" not in off


# ----------------------------------------------------------------------------- warp-specialized form
def _ws_module(warp_specialized="auto"):
    import tvm

    fs = {"gu": mw.moe_grouped_gate_up_wgmma_kernel(5, 512, 512, 3, 4.0, 25.0, warp_specialized=warp_specialized),
          "d": mw.moe_grouped_down_wgmma_kernel(5, 512, 512, 3, warp_specialized=warp_specialized)}
    return tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in fs.items()})


def _cuda_source(mod) -> str:
    import tvm

    from schedules.barriers import respect_manual_barriers
    from targets import get_target

    with respect_manual_barriers():
        lib = tvm.tirx.build(mod, target=get_target("cuda-sm90a").tvm_target())
    return lib.imports[0].inspect_source()


def test_auto_builds_both_forms_behind_a_host_branch():
    """"auto": each PrimFunc holds the plain kernel (256 threads, two blocks per SM) and the
    warp-specialized one (two consumer warpgroups + a producer warpgroup, one block per SM,
    registers split by setmaxnreg, stages handed over through mbarriers, the consumers' own
    barrier for the epilogue), picked on the host by the pair count."""
    src = _cuda_source(_ws_module())
    assert "__launch_bounds__(256, 2) gu_kernel" in src or "__launch_bounds__(256, 2) gu_kernel_1" in src
    assert src.count("__launch_bounds__(384, 1)") == 4  # declaration + definition, gate_up and down
    for ptx in ("setmaxnreg.dec.sync.aligned.u32 56", "setmaxnreg.inc.sync.aligned.u32 224",
                "mbarrier.try_wait.parity.shared::cta.b64", "cp.async.mbarrier.arrive.noinc.shared::cta.b64",
                "mbarrier.arrive.shared::cta.b64", "bar.sync %0, %1"):
        assert ptx in src, ptx
    # tokens 128.. of a 192-row tile: a second wgmma of N 32 or 64 into accumulators 64..95
    second = set(re.findall(r"k3_wgmma_m64n(\d+)k16_bf16_rs\(\(&\(acc_ptr\[64\]\)\)", src))
    assert second == {"32", "64"}, second
    plain_only = _cuda_source(_ws_module(False))
    assert "setmaxnreg" not in plain_only and "__launch_bounds__(384" not in plain_only
    assert "acc_ptr[64]))" not in plain_only
    # the mbarriers (uint64) at even word offsets of the merged shared memory (64-byte aligned)
    offsets = [int(x) for x in re.findall(r"k3_mbar_init\(\(&\(\(\(uint\*\)buf_dyn_shmem_ptr\)\[\(\(i \* 2\) \+ (\d+)\)\]", src)]
    assert offsets and all(x % 2 == 0 for x in offsets), offsets


@needs_nvcc
def test_warp_specialized_kernels_fit_their_registers(tmp_path):
    """ptxas: the warp-specialized kernels (forced) without spills and with the wgmmas
    pipelined (no "wgmma ... serialized" note, C7511 / C7512 and the like; no C7508 'setmaxnreg
    ignored'): 168 registers at entry, 224 per consumer thread after setmaxnreg."""
    import subprocess

    (tmp_path / "ws.cu").write_text(_cuda_source(_ws_module(True)))
    out = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-Xptxas", "-v", "-o", str(tmp_path / "ws.cubin"),
                          str(tmp_path / "ws.cu")], capture_output=True, text=True, check=True).stderr
    assert "serialized" not in out and "C7508" not in out, out
    spills = re.findall(r"(\d+) bytes spill stores", out)
    assert spills and all(int(n) == 0 for n in spills), out


@needs_nvcc
def test_auto_kernels_compile_to_fatbin_for_sm90a(tmp_path):
    out = build_sm90a_fatbin(
        "from tests.test_moe_prefill_wgmma import _ws_module\n"
        "from schedules.barriers import respect_manual_barriers\n"
        "mod = _ws_module()", tmp_path, contexts="respect_manual_barriers()")
    assert "fatbin" in out


def _branches(script: str):
    """(top_k, pair threshold, then-block, else-block) of the host-side branch a wgmma PrimFunc
    wrapper opens with (``if nt * k >= threshold:``), or None."""
    lines = script.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)if nt \* T\.int64\((\d+)\) >= T\.int64\((\d+)\):$", line)
        if m:
            ind = m.group(1)
            j = next(k for k in range(i + 1, len(lines)) if lines[k] == f"{ind}else:")
            end = next((k for k in range(j + 1, len(lines)) if lines[k].strip() and
                        len(lines[k]) - len(lines[k].lstrip()) <= len(ind)), len(lines))
            return int(m.group(2)), int(m.group(3)), "\n".join(lines[i + 1:j]), "\n".join(lines[j + 1:end])
    return None


def _sort_rows(script: str):
    """(top_k, pair threshold, large rows, rows) of a sort PrimFunc with run-time tile rows, or None."""
    m = re.search(r"if_then_else\(nt \* T\.int64\((\d+)\) >= T\.int64\((\d+)\), (\d+), (\d+)\)", script)
    return tuple(int(g) for g in m.groups()) if m else None


def test_dispatch_threshold_is_shared_by_sort_and_gemms():
    """The GEMMs' host branch (pairs >= ws_min_pairs(E): the warp-specialized body, the one with
    setmaxnreg; else the plain one) and the sort's run-time tile rows (192 from the same count,
    else 128) agree, and ``moe_plan.tile_rows`` (the NumPy side) switches at the same count,
    only for widths that have the form."""
    from schedules import moe_plan

    E, k = 5, 3
    edge = mw.ws_min_pairs(E)
    for f in (mw.moe_grouped_gate_up_wgmma_kernel(E, 512, 512, k, 4.0, 25.0), mw.moe_grouped_down_wgmma_kernel(E, 512, 512, k)):
        kk, thr, then, other = _branches(f.script())
        assert (kk, thr) == (k, edge)
        assert "k3_setmaxnreg" in then and "k3_setmaxnreg" not in other
    sort = mp.moe_sort_kernel(E, k, bm_large=mw.TM_WS, large_from_pairs=edge)
    assert _sort_rows(sort.script()) == (k, edge, 192, 128)
    assert _sort_rows(mp.moe_sort_kernel(E, k).script()) is None
    assert moe_plan.tile_rows(edge - 1, E, True) == moe_plan.BM == 128
    assert moe_plan.tile_rows(edge, E, True) == moe_plan.BM_WS == mw.TM_WS == 192
    assert moe_plan.tile_rows(edge, E, False) == 128
    assert moe_plan.warp_specialized_shapes(3584, 3072) and not moe_plan.warp_specialized_shapes(128, 256)
    # K3 at 8192 tokens x top-16 (146 pairs per expert) takes the form, 4096 (73) does not
    assert moe_plan.tile_rows(8192 * 16, 896, True) == 192 and moe_plan.tile_rows(4096 * 16, 896, True) == 128
    # Σ⌈c/192⌉ ≤ Σ⌈c/128⌉: the tile table sized for 128-row tiles holds the 192-row ones
    rng = np.random.default_rng(0)
    for T in (1, 37, 300, 5000):
        ids = rng.integers(0, E, (T, k))
        assert len(mp.moe_prefill_plan_reference(ids, E, 192)[2]) <= mp.max_tiles(T * k, E)


def _small_branch(script: str):
    """(top_k, pair threshold, then-block, else-block) of the small-tile branch nested in the
    else-block of a wgmma PrimFunc's host branch (``if nt * k < threshold:``), or None."""
    branches = _branches(script)
    if branches is None:
        return None
    lines = branches[3].splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)if nt \* T\.int64\((\d+)\) < T\.int64\((\d+)\):$", line)
        if m:
            ind = m.group(1)
            j = next(k for k in range(i + 1, len(lines)) if lines[k] == f"{ind}else:")
            return int(m.group(2)), int(m.group(3)), "\n".join(lines[i + 1:j]), "\n".join(lines[j + 1:])
    return None


def test_small_tile_form_below_the_small_pair_count():
    """Below small_max_pairs(E) pairs the "auto" GEMMs take their small-tile body (32-row tiles:
    only wgmmas of N 32; 6 stages: cp.async waits of 3 pending groups) and the sort makes
    32-row tiles from the same count; moe_plan.tile_rows agrees; the plain body keeps 4 stages
    and its three wgmma widths. The model sizes its tile table for 32-row tiles."""
    from schedules import moe_plan

    E, k = 5, 3
    small = mw.small_max_pairs(E)
    assert small == moe_plan.SMALL_MAX_PAIRS_PER_EXPERT * E < mw.ws_min_pairs(E)
    for f in (mw.moe_grouped_gate_up_wgmma_kernel(E, 512, 512, k, 4.0, 25.0), mw.moe_grouped_down_wgmma_kernel(E, 512, 512, k)):
        kk, thr, then, other = _small_branch(f.script())
        assert (kk, thr) == (k, small)
        assert set(re.findall(r"k3_wgmma_m64n(\d+)k16", then)) == {"32"}
        assert "k3_cp_async_wait3" in then and "k3_cp_async_wait1" not in then
        assert set(re.findall(r"k3_wgmma_m64n(\d+)k16", other)) == {"32", "64", "128"}
        assert "k3_cp_async_wait1" in other and "k3_cp_async_wait3" not in other
    sort = mw.moe_sort_wgmma_kernel(E, 512, 512, k).script()
    assert re.search(rf"if nt \* T\.int64\({k}\) < T\.int64\({small}\):\n\s*tr = 32\n", sort), sort[:2000]
    assert moe_plan.tile_rows(small - 1, E, True) == moe_plan.BM_SMALL == 32
    assert moe_plan.tile_rows(small, E, True) == 128 and moe_plan.tile_rows(small - 1, E, False) == 128
    # K3: a 512-token chunk (9 pairs per expert) takes the small tiles, 2048 tokens (37) not
    assert moe_plan.tile_rows(512 * 16, 896, True) == 32 and moe_plan.tile_rows(2048 * 16, 896, True) == 128
    # the narrow widths (k3-nano) keep one form: no small branch
    assert _small_branch(mw.moe_grouped_down_wgmma_kernel(E, 128, 256, k).script()) is None
    rng = np.random.default_rng(1)
    for T in (1, 7, 40):
        ids = rng.integers(0, E, (T, k))
        assert len(mp.moe_prefill_plan_reference(ids, E, 32)[2]) <= mp.max_tiles(T * k, E, 32)


def test_model_export_dispatches_the_warp_specialized_form():
    """A cuda-sm90a bf16 export with MoE widths of 512: the sort's tile rows and both GEMMs'
    branch on the same pair count (ws_min_pairs(E)) and only the GEMMs' then-branch is the
    warp-specialized body; with k3-nano-sized widths (128 / 256) neither has the form (a
    192-row tile table read by the plain kernels would leave rows 128..191 uncomputed)."""
    import tvm

    from k3_compile.config import K3Config
    from k3_compile.pipeline import export_model
    from oracle_mlx import tiny_config

    def funcs(cfg):
        mod = export_model(cfg, "bfloat16", gpu=True, tuned=True, wgmma=True).mod
        return {gv.name_hint: f.script() for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}

    wide = K3Config.from_dict(tiny_config(routed_expert_hidden_size=512, moe_intermediate_size=512))
    fw = funcs(wide)
    E, k = wide.num_experts, wide.num_experts_per_token
    edge = mw.ws_min_pairs(E)
    assert _sort_rows(fw["moe_sort"]) == (k, edge, 192, 128)
    assert f"< T.int64({mw.small_max_pairs(E)}):" in fw["moe_sort"]
    for name in ("moe_grouped_gate_up", "moe_grouped_down"):
        kk, thr, then, other = _branches(fw[name])
        assert (kk, thr) == (k, edge) and "k3_setmaxnreg_inc224" in then and "k3_setmaxnreg" not in other
        assert _small_branch(fw[name])[:2] == (k, mw.small_max_pairs(E))
    narrow = K3Config.from_dict(tiny_config(routed_expert_hidden_size=128, moe_intermediate_size=256))
    fn = funcs(narrow)
    assert _sort_rows(fn["moe_sort"]) is None
    assert all(_branches(fn[n]) is None and "k3_setmaxnreg" not in fn[n] for n in ("moe_grouped_gate_up", "moe_grouped_down"))


def test_producer_copies_cover_each_stage_once():
    """The warp-specialized producers' index maps (``ws_token_chunk``, ``ws_code_chunk``, used
    by the kernel): every (token row, 16-byte chunk) of a 192-row stage and every (weight row,
    half) of the 128 weight rows is copied by exactly one (thread, chunk); a warp's token
    copies are whole 128-byte rows, and the swizzled destinations of a stage are all distinct."""
    from schedules.wgmma_ptx import swizzle128_word

    NP = mw.NPW * 32
    tch, cch = mw.TM_WS * 8 // NP, 128 * 2 // NP
    tok = [mw.ws_token_chunk(p, j, NP) for p in range(NP) for j in range(tch)]
    assert sorted(tok) == [(r, c) for r in range(mw.TM_WS) for c in range(8)]
    assert len({swizzle128_word(r, c) for r, c in tok}) == len(tok)
    for p0 in range(0, NP, 32):  # a warp: 4 rows × 8 chunks per j
        for j in range(tch):
            rows = {mw.ws_token_chunk(p, j, NP)[0] for p in range(p0, p0 + 32)}
            assert len(rows) == 4
    code = [mw.ws_code_chunk(p, i, NP) for p in range(NP) for i in range(cch)]
    assert sorted(code) == [(r, h) for r in range(128) for h in range(2)]
    # gate_up: a code chunk i is all W1 rows (i < cch / 2) or all W3 rows
    assert all((mw.ws_code_chunk(p, i, NP)[0] >= 64) == (2 * i >= cch) for p in range(NP) for i in range(cch))
    # setmaxnreg only moves the registers the block got at launch (168 per thread for 384):
    # (64, 224) sums to 65536 > 64512, and that kernel hung on the H200
    nth = NP + mw.NCW * 32
    assert mw.ws_entry_registers(nth) == 168
    assert NP * mw.REGS_WS[0] + mw.NCW * 32 * mw.REGS_WS[1] <= nth * mw.ws_entry_registers(nth)


def test_bad_warp_specialized_arguments_rejected():
    with pytest.raises(ValueError, match="warp_specialized must be"):
        mw.moe_grouped_gate_up_wgmma_kernel(4, 512, 512, 2, 4.0, None, warp_specialized="yes")
    with pytest.raises(ValueError, match="go together"):
        mp.moe_sort_kernel(4, 2, bm_large=192)
    with pytest.raises(ValueError, match="multiple of 8"):
        wgmma_ptx.setmaxnreg("inc", 230)
    with pytest.raises(ValueError, match="named barrier"):
        wgmma_ptx.named_barrier(0, 256)
