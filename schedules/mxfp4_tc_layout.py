"""The "tc" layout of MXFP4 expert codes: each 32-bit word of ``weight_packed`` (8 E2M1 codes)
with its bits permuted at load time so that the tensor-core kernels turn it into four bf16x2
mma words with 9 integer instructions and 4 multiplies (1.6 per code) instead of the ~2.5 per
code of the ``prmt`` table look-ups on the checkpoint layout.

Why it works (bf16: sign bit 15, exponent bits 14-7, mantissa bits 6-0; E2M1 code
``s e1 e0 m``, OCP MX spec v1.0 §5.3.3, spec §2): with the magnitude bits ``e1 e0 m`` at bf16
bits 8-6 and the sign at bit 15, the bf16 is the E2M1 value times 2^-126 — exactly, for the
normal codes (exponent ``e``: ``2^(e-127)(1 + m/2)`` against ``2^(e-1)(1 + m/2)``) and for the
subnormal ones alike (``e = 0``: the bf16 subnormal ``m·2^-127`` against ``m·0.5``). So one
``bf16x2`` multiply by ``2^126 · 2^(s-127) = 2^(s-1)`` (:func:`factor_bf16`) applies the
E8M0 scale and the 2^126 together, exactly (a code has two significant bits).

The mma word of inputs ``2i, 2i+1`` (:func:`mma_words_reference`) has its 8 significant bits
at :data:`T_MASK` = bits {6, 7, 8, 15} (input 2i) and {22, 23, 24, 31} (input 2i+1). The
stored word ``w`` is arranged so that (rotr = rotate right, one ``shf.r.wrap``)::

    word 0 = w          & T_MASK
    word 1 = rotr(w, 4)  & T_MASK
    word 2 = rotr(w, 10) & T_MASK
    word 3 = rotr(w, 6)  & MASK_A  |  rotr(w, 14) & MASK_B      (MASK_A | MASK_B = T_MASK)

(:data:`PIECES`). No arrangement makes all four words single rotations of ``w`` (no four
rotations of the 8-bit pattern tile 32 bits; brute force over rotations and shifts, and over
XOR combinations of up to three of them), and this one costs 9 integer instructions, the
fewest found.

Scale range: ``2^(s-1)`` is a finite bf16 for E8M0 bytes ``s <= 128`` (scales up to 2) and
``s = 255`` (NaN, kept NaN). Bytes 129..254 (scales 4 .. 2^127, weights of magnitude over 8)
cannot be expressed; :func:`check_scales` rejects them at load time, naming the tensor (such
a checkpoint needs ``k3 compile --generic-kernels``). Trained LLM weights stay far below.

Contents: the layout (:data:`PIECES`), :func:`repack_reference` (numpy, per mma word, the
readable definition), :func:`decode_reference` (numpy emulation of the device recipe),
:func:`repack_kernel` (the TIR kernel the compiled library runs in place on each uploaded
``weight_packed``, as masked rotations grouped by rotation), :func:`factor_bf16`,
:func:`check_scales`. tests/test_mxfp4_tc_layout.py checks all against the E2M1/E8M0 tables.
"""

from __future__ import annotations

import functools

import numpy as np

# numpy only at import: the runtime (runtime-only TVM) and benchmarks/moe.py on the GPU machine
# use the references and check_scales; the TIR builders import TVMScript when called.

LAYOUT = "e2m1-tc-v1"
"""Name of the layout in the library metadata (``expert_code_layout``); the checkpoint layout
is ``"ocp"``."""

T_MASK = 0x81C081C0
"""Bits of a bf16x2 word that an E2M1 code pair occupies: signs 15/31, magnitudes 8-6/24-22."""
MASK_A = 0x01000100
MASK_B = T_MASK & ~MASK_A

PIECES = ((0, T_MASK, 0), (1, T_MASK, 4), (2, T_MASK, 10), (3, MASK_A, 6), (3, MASK_B, 14))
"""``(mma word i, mask, rotation r)``: ``word_i |= rotr(stored, r) & mask``; the pieces' stored
bits (``rotl(mask, r)``) partition the 32 bits."""

MAX_SCALE_BYTE = 128
"""Largest finite E8M0 byte the layout's ``2^(s-1)`` factor can express (255, NaN, also passes)."""
FACTOR_NAN = 0x7FC0


def _rotl(x, r: int):
    r %= 32
    x = np.asarray(x, np.uint32)
    return x if r == 0 else ((x << np.uint32(r)) | (x >> np.uint32(32 - r))).astype(np.uint32)


def _rotr(x, r: int):
    return _rotl(x, 32 - r % 32)


def _check_pieces():
    seen = 0
    for _, mask, r in PIECES:
        stored = int(_rotl(np.uint32(mask), r))
        assert not seen & stored, "PIECES overlap"
        seen |= stored
    assert seen == 0xFFFFFFFF, "PIECES do not cover the word"


_check_pieces()


def mma_words_reference(words: np.ndarray) -> np.ndarray:
    """The four bf16x2 mma words of checkpoint words (before the scale multiply).

    Args:
        words: uint32 ``[...]``, 8 E2M1 codes each (nibble i = input i; compressed-tensors order).
    Returns:
        uint32 ``[..., 4]``: word i holds input 2i in its low bf16 (sign at bit 15, ``e1 e0 m``
        at bits 8-6) and input 2i+1 in its high bf16, i.e. E2M1 value × 2^-126 each.
    """
    w = np.asarray(words, np.uint32)
    out = []
    for i in range(4):
        word = np.zeros_like(w)
        for h in range(2):
            code = (w >> np.uint32(4 * (2 * i + h))) & np.uint32(15)
            word |= ((code & np.uint32(7)) << np.uint32(6 + 16 * h)) | ((code >> np.uint32(3)) << np.uint32(15 + 16 * h))
        out.append(word)
    return np.stack(out, axis=-1)


def repack_reference(packed: np.ndarray) -> np.ndarray:
    """Checkpoint-layout codes -> tc layout (numpy; the definition of the layout).

    Args:
        packed: uint8 ``[..., K/2]`` (``weight_packed``), ``K/2`` a multiple of 4.
    Returns:
        uint8 array of the same shape: each 4-byte word ``sum over PIECES of
        rotl(mma_word_i & mask, r)``.
    Raises:
        ValueError: not uint8, or the last dimension not a multiple of 4 bytes.
    """
    packed = np.ascontiguousarray(packed)
    if packed.dtype != np.uint8 or packed.shape[-1] % 4:
        raise ValueError(f"weight_packed: expected uint8 with a last dimension that is a multiple of 4, "
                         f"got {packed.dtype} {packed.shape}")
    words = packed.view("<u4")
    mma = mma_words_reference(words)
    out = np.zeros_like(words)
    for i, mask, r in PIECES:
        out |= _rotl(mma[..., i] & np.uint32(mask), r)
    return out.view(np.uint8).reshape(packed.shape)


def decode_reference(stored: np.ndarray) -> np.ndarray:
    """Emulation of the device recipe (``mxfp4_ptx.dequant8``, before the multiply): tc-layout
    words uint32 ``[...]`` -> their four bf16x2 mma words ``[..., 4]``."""
    w = np.asarray(stored, np.uint32)
    out = [np.zeros_like(w) for _ in range(4)]
    for i, mask, r in PIECES:
        out[i] |= _rotr(w, r) & np.uint32(mask)
    return np.stack(out, axis=-1)


def moves() -> dict[int, int]:
    """The layout as a bit permutation: ``{left rotation: mask of checkpoint-word bits moved
    by it}`` (derived from :func:`repack_reference`, one probe per bit)."""
    out: dict[int, int] = {}
    for b in range(32):
        probe = np.array([1 << b], np.uint32).view(np.uint8)
        dst = int(repack_reference(probe).view("<u4")[0])
        assert dst and dst & (dst - 1) == 0, "the layout is not a bit permutation"
        r = (dst.bit_length() - 1 - b) % 32
        out[r] = out.get(r, 0) | (1 << b)
    return dict(sorted(out.items()))


def inplace_words_kernel(words_per_item: int, body, gpu: bool):
    """An in-place TIR kernel over the uint32 words of a ``weight_packed`` tensor (uint8 ``[e,
    n, kh]``, any sizes with ``4 · words_per_item`` dividing ``kh``), split into items of
    ``words_per_item`` consecutive words: ``body(words, item)`` (a TVMScript macro) rewrites
    item ``item`` of the flat word buffer ``words``. ``gpu``: one item per thread, 256 threads
    per block (``tirx.is_scheduled``); else a serial loop. A ``kh`` that is not a multiple of
    ``4 · words_per_item`` fails the call with an error naming ``weight_packed``. The repack kernels of this layout and
    of the fp8 layout (schedules/mxfp8_act.py) are built with it."""
    from tvm.script import tirx as T

    W = words_per_item
    MSG = f"weight_packed: the last dimension must be a multiple of {4 * W} bytes for the code repack"
    if gpu:
        @T.prim_func(private=True)
        def repack_words(codes_h: T.handle):
            T.func_attr({"tir.noalias": True, "tirx.is_scheduled": True})
            e, n, kh = T.int64(), T.int64(), T.int64()
            codes = T.match_buffer(codes_h, (e, n, kh), "uint8")
            assert kh % T.int64(4 * W) == T.int64(0), MSG
            words = T.decl_buffer((e * n * kh // 4,), "uint32", data=codes.data)
            for b in T.thread_binding((e * n * kh // (4 * W) + 255) // 256, thread="blockIdx.x"):
                for t in T.thread_binding(256, thread="threadIdx.x"):
                    if b * 256 + t < e * n * kh // (4 * W):
                        body(words, b * 256 + t)
    else:
        @T.prim_func(private=True)
        def repack_words(codes_h: T.handle):
            T.func_attr({"tir.noalias": True})
            e, n, kh = T.int64(), T.int64(), T.int64()
            codes = T.match_buffer(codes_h, (e, n, kh), "uint8")
            assert kh % T.int64(4 * W) == T.int64(0), MSG
            words = T.decl_buffer((e * n * kh // 4,), "uint32", data=codes.data)
            for i in range(e * n * kh // (4 * W)):
                body(words, i)
    return repack_words


@functools.cache
def repack_kernel(gpu: bool = False):
    """In-place TIR kernel: ``weight_packed`` uint8 ``[e, n, kh]`` (any sizes, ``kh`` a multiple
    of 4) from the checkpoint layout to the tc layout, word by word, as ``OR over r of
    rotl(w & mask_r, r)`` (:func:`moves`). ``gpu``: 256 threads per block, one word each."""
    from tvm.script import tirx as T

    groups = list(moves().items())

    def permute(w):
        acc = None
        for r, m in groups:
            x = w & T.uint32(m)
            if r:
                x = (x << T.uint32(r)) | (x >> T.uint32(32 - r))
            acc = x if acc is None else acc | x
        return acc

    @T.macro
    def one_word(words, i):
        words[i] = permute(words[i])

    return inplace_words_kernel(1, one_word, gpu)


def factor_bf16(s):
    """uint32 holding the bf16 bits of ``2^(s-1)`` for the E8M0 byte ``s`` (uint32 expression,
    0..128 or 255): ``(s + 126) << 7``; 255 -> NaN (0x7FC0). Bytes 129..254 give garbage:
    :func:`check_scales` keeps them out."""
    from tvm.script import tirx as T

    return T.Select(s == T.uint32(255), T.uint32(FACTOR_NAN), (s + T.uint32(126)) << T.uint32(7))


def factor_reference(s: np.ndarray) -> np.ndarray:
    """numpy twin of :func:`factor_bf16` (uint8 -> uint16 bf16 bits)."""
    s = np.asarray(s, np.uint32)
    return np.where(s == 255, FACTOR_NAN, (s + 126) << 7).astype(np.uint16)


def check_scales(scale: np.ndarray, name: str) -> None:
    """Raise if a ``weight_scale`` tensor holds an E8M0 byte the tc layout cannot scale by.

    Args:
        scale: uint8 E8M0 bytes (any shape); name: the tensor's name for the message.
    Raises:
        ValueError: a byte in 129..254 (scale 4 or more), with its index and the fix.
    """
    s = np.asarray(scale)
    raise_first_bad(s, (s > MAX_SCALE_BYTE) & (s != 255), name,
                    f"the tensor-core MXFP4 kernels take bytes up to {MAX_SCALE_BYTE} (scale 2) or 255; "
                    "compile the library with `k3 compile --generic-kernels` for this checkpoint")


def raise_first_bad(scale: np.ndarray, bad: np.ndarray, name: str, rule: str) -> None:
    """Raise ``ValueError`` naming tensor ``name``, the first E8M0 byte of ``scale`` where
    ``bad`` holds, its index and scale, and ``rule`` (what the kernels take and the fix); return
    if ``bad`` holds nowhere."""
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"tensor {name}: E8M0 scale byte {int(scale[idx])} at {list(idx)} "
                         f"(scale 2^{int(scale[idx]) - 127}); {rule}")
