"""Timing helpers shared by the GPU benchmarks (run on the GPU machine, torch for events).

``time_cuda`` times back-to-back calls between two CUDA events, so the GPU queue stays busy
and the host-side cost of each call hides behind kernel time wherever the kernel is longer.
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


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted), 2 GiB."""
    import torch

    x = torch.empty(2 ** 29, device="cuda")
    y = torch.empty_like(x)
    ms = time_cuda(lambda: y.copy_(x), iters=10, per_sample=2)
    return 2 * x.numel() * 4 / (ms / 1e3)


def git_commit() -> str:
    """HEAD of this checkout, or ``$K3_COMMIT`` (the GPU machine's copy has no .git)."""
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return os.environ.get("K3_COMMIT", "unknown")
