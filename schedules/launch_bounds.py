"""Per-kernel minimum resident blocks for hand-written CUDA kernels.

TVM's CUDA code generator writes ``__launch_bounds__(threads)`` on every kernel and has no
way to ask for a minimum number of resident blocks per SM (which makes ptxas cap the
registers at ``65536 / (threads · blocks)``). A kernel asks for one by calling
:func:`min_blocks_per_sm` in its body (an empty inline device function whose name carries
the number); :func:`apply_min_blocks` — run on the generated source before nvcc by
``k3_compile.device_code.precompiled_cuda`` — turns that into ``__launch_bounds__(threads,
blocks)`` on the kernel's declaration and definition. Without precompilation (TVM's NVRTC
path) the marker is a no-op and the kernel keeps its default register budget.
"""

from __future__ import annotations

import re

_MARKER = "k3_min_blocks_"
_KERNEL = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(')


def min_blocks_per_sm(n: int):
    """TIR call (``T.evaluate`` it once in the kernel body) asking for ``n`` resident blocks
    per SM. Raises ValueError for ``n`` outside 1..32."""
    from tvm.backend.cuda.op import cuda_func_call

    if not 1 <= n <= 32:
        raise ValueError(f"min blocks per SM must be in 1..32, got {n}")
    name = f"{_MARKER}{n}"
    return cuda_func_call(name, source_code=f"__forceinline__ __device__ void {name}() {{}}\n")


def apply_min_blocks(src: str) -> str:
    """``src`` with ``__launch_bounds__(t)`` -> ``__launch_bounds__(t, n)`` for every kernel
    whose definition calls ``k3_min_blocks_<n>()`` (declaration and definition alike)."""
    # definitions only (the signature's first "{" comes before any ";"), not declarations
    defs = [m for m in _KERNEL.finditer(src) if src.find("{", m.end()) < src.find(";", m.end())]
    wanted: dict[str, int] = {}
    for i, m in enumerate(defs):
        end = defs[i + 1].start() if i + 1 < len(defs) else len(src)
        found = re.search(rf"\b{_MARKER}(\d+)\(\)", src[m.end():end])
        if found:
            wanted[m.group(2)] = int(found.group(1))
    for name, n in wanted.items():
        src = re.sub(rf'__launch_bounds__\((\d+)\) {name}\(', rf'__launch_bounds__(\1, {n}) {name}(', src)
    return src
