"""Timing helpers shared by the GPU benchmarks (run on the GPU machine, torch for events).

``time_cuda`` times back-to-back calls between two CUDA events, so the GPU queue stays busy
and the host-side cost of each call hides behind kernel time wherever the kernel is longer.
``time_cuda_graph`` replays a CUDA graph of calls instead (TVM calls join the capture through
``tvm_ffi.use_torch_stream``), which measures GPU time without the host's launch cost.
``copy_bandwidth`` is the HBM roofline's denominator (device-to-device copy, read + write).
"""

from __future__ import annotations

import os
import subprocess


def time_cuda(fn, iters: int = 30, warmup: int = 5, per_sample: int = 10) -> float:
    """Median milliseconds per ``fn()`` call over ``iters`` samples of ``per_sample`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_sample):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per_sample)
    times.sort()
    return times[len(times) // 2]


def time_cuda_graph(fn, iters: int = 20, per_graph: int = 10) -> float:
    """Median milliseconds per ``fn()`` call over ``iters`` replays of a CUDA graph holding
    ``per_graph`` calls, or a whole cycle of a :func:`rotate` callable if that is longer
    (captured after one warm-up call on a side stream). ``fn`` may call TVM functions and
    torch / Triton kernels; all must be capturable (no host sync)."""
    import torch
    import tvm_ffi

    per_graph = max(per_graph, getattr(fn, "cycle", 1))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with tvm_ffi.use_torch_stream(torch.cuda.stream(s)):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with tvm_ffi.use_torch_stream(torch.cuda.graph(g)):
        for _ in range(per_graph):
            fn()
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per_graph)
    times.sort()
    return times[len(times) // 2]


def rotate(calls: list):
    """A callable that runs ``calls[0]``, ``calls[1]``, ... in turn, one per call: timing the
    same small kernel on one buffer would measure L2 (50 MiB on the H200), not HBM, so
    benchmarks give each call its own copy of the data (see :func:`copies_for`)."""
    state = {"i": 0}

    def call():
        calls[state["i"] % len(calls)]()
        state["i"] += 1

    call.cycle = len(calls)  # time_cuda_graph captures a whole cycle
    return call


def copies_for(nbytes: int, touched: int = 512 * 2 ** 20) -> int:
    """How many copies of an ``nbytes`` buffer to rotate through so that ``touched`` bytes
    (default 512 MiB, ten times the H200's L2) pass between two uses of the same copy."""
    return max(1, -(-touched // max(nbytes, 1)))


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted), 2 GiB."""
    import torch

    x = torch.empty(2 ** 29, device="cuda")
    y = torch.empty_like(x)
    ms = time_cuda(lambda: y.copy_(x), iters=10, per_sample=2)
    return 2 * x.numel() * 4 / (ms / 1e3)


def git_commit() -> str:
    """``$K3_COMMIT`` where set (the GPU machine's copy of the tree may carry a stale .git:
    set it from here), else HEAD of this checkout."""
    if os.environ.get("K3_COMMIT"):
        return os.environ["K3_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return os.environ.get("K3_COMMIT", "unknown")
