"""Compilation targets of k3-compile: one small module per target, each a `TargetSpec`.

>>> from targets import get_target, list_targets, host_default
>>> get_target("cuda-sm90a").tvm_target()
"""

from __future__ import annotations

import importlib
from typing import Dict, List

from .base import Features, TargetSpec

_MODULES = ("llvm", "cuda_sm90a", "cuda_sm100a", "cuda_sm120a", "metal", "rocm_gfx942")

# Other spellings accepted by get_target (lower-case).
_ALIASES = {
    "cpu": "llvm",
    "host": "llvm",
    "cuda": "cuda-sm90a",
    "sm90a": "cuda-sm90a",
    "sm_90a": "cuda-sm90a",
    "h100": "cuda-sm90a",
    "h200": "cuda-sm90a",
    "sm100a": "cuda-sm100a",
    "sm_100a": "cuda-sm100a",
    "b200": "cuda-sm100a",
    "gb200": "cuda-sm100a",
    "sm120a": "cuda-sm120a",
    "sm_120a": "cuda-sm120a",
    "rtx50": "cuda-sm120a",
    "apple": "metal",
    "rocm": "rocm-gfx942",
    "gfx942": "rocm-gfx942",
    "mi300x": "rocm-gfx942",
}

_REGISTRY: Dict[str, TargetSpec] = {}


def _registry() -> Dict[str, TargetSpec]:
    if not _REGISTRY:
        for mod_name in _MODULES:
            spec = importlib.import_module(f"{__name__}.{mod_name}").TARGET
            _REGISTRY[spec.name] = spec
    return _REGISTRY


def list_targets() -> List[str]:
    """Names of all known targets."""
    return list(_registry())


def get_target(name: str) -> TargetSpec:
    """The `TargetSpec` called `name` (or one of its aliases, e.g. "h200", "cpu")."""
    reg = _registry()
    key = str(name).strip()
    key = _ALIASES.get(key.lower(), key)
    # accept underscores for dashes: "cuda_sm90a"
    if key not in reg:
        key = key.replace("_", "-").lower()
        key = _ALIASES.get(key, key)
    if key not in reg:
        raise KeyError(
            f"unknown target {name!r}; known targets: {', '.join(reg)} "
            f"(aliases: {', '.join(sorted(_ALIASES))})"
        )
    return reg[key]


def host_default() -> TargetSpec:
    """The target of this machine's CPU (LLVM)."""
    return get_target("llvm")


__all__ = ["Features", "TargetSpec", "get_target", "list_targets", "host_default"]
