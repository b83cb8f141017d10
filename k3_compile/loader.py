"""Map checkpoint tensors onto the Relax model's parameters (docs/DESIGN.md, "Parameters").

The Relax parameter names are the checkpoint names without the ``language_model.`` prefix,
except:

- routed experts are stacked per layer: ``...block_sparse_moe.experts.w1.weight_packed``
  ``[E, out, in/2]`` is ``np.stack`` of ``...experts.{e}.w1.weight_packed`` for e in 0..E-1
  (likewise ``weight_scale`` and, for bf16 experts, ``weight``);
- ``self_attn.A_log`` is trimmed to ``[num_heads]`` (the real checkpoint pads it to 128).

bf16 checkpoint tensors are converted to the parameter's dtype (the model dtype); float32
and uint8 tensors are passed through unchanged.

Libraries whose MoE kernels read the expert codes in the tc layout (metadata
``expert_code_layout``, schedules/mxfp4_tc_layout.py) get them permuted on the device after
upload (:func:`repack_expert_codes`), with their scales checked on the host before
(:func:`check_expert_scales`).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

import numpy as np

# A stacked routed-expert parameter: (experts prefix, w1|w2|w3, weight_packed|weight_scale|weight).
EXPERT_STACKED = re.compile(r"^(.*\.block_sparse_moe\.experts)\.(w[123])\.(weight_packed|weight_scale|weight)$")


class ParameterError(ValueError):
    """A parameter the model needs cannot be produced from the checkpoint."""


def source_names(param_name: str, num_experts: int) -> list[str]:
    """Checkpoint tensor names (no prefix) that make up Relax parameter ``param_name``."""
    m = EXPERT_STACKED.match(param_name)
    if m:
        base, w, kind = m.groups()
        return [f"{base}.{e}.{w}.{kind}" for e in range(num_experts)]
    return [param_name]


def to_param_dtype(arr: np.ndarray, dtype: str, name: str) -> np.ndarray:
    """``arr`` as the parameter dtype ``dtype`` (float tensors via float32; uint8 unchanged).

    Raises:
        ParameterError: a float tensor for a uint8 parameter or the reverse (names ``name``).
    """
    import ml_dtypes

    if str(arr.dtype) == dtype:
        return arr
    if dtype == "uint8" or arr.dtype == np.uint8:
        raise ParameterError(f"tensor {name}: checkpoint dtype {arr.dtype} cannot become {dtype}")
    target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return arr.astype(np.float32).astype(target)


def load_parameters(
    get: Callable[[str], np.ndarray],
    params: Iterable[tuple[str, tuple[int, ...], str]],
    num_experts: int,
    progress: bool = False,
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(param_name, array)`` in the order of ``params``.

    Args:
        get: returns the checkpoint tensor of a name without prefix (e.g.
            :meth:`k3_compile.weights.CheckpointReader.get`); memory-mapped where possible.
        params: ``(name, shape, dtype)`` of every Relax parameter, in the compiled
            function's order (from ``nn.Module.export_tvm``).
        num_experts: experts per MoE layer, for stacking.
        progress: show a tqdm progress bar.

    Raises:
        ParameterError: a produced array's shape differs from the parameter's (names both).
    """
    params = list(params)
    it = params
    if progress:
        from tqdm import tqdm

        it = tqdm(params, desc="loading parameters", unit="tensor")
    for name, shape, dtype in it:
        srcs = source_names(name, num_experts)
        if len(srcs) == 1:
            arr = get(srcs[0])
            if name.endswith("self_attn.A_log") and arr.ndim == 1 and arr.shape[0] > shape[0]:
                arr = arr[: shape[0]]
        else:
            arr = np.stack([np.asarray(get(s)) for s in srcs])
        arr = to_param_dtype(np.asarray(arr), dtype, name)
        if tuple(arr.shape) != tuple(shape):
            raise ParameterError(
                f"parameter {name}: the checkpoint gives shape {tuple(arr.shape)}, the compiled "
                f"model expects {tuple(shape)} (was the library compiled for another config?)"
            )
        yield name, np.ascontiguousarray(arr)


def upload_parameters(get: Callable[[str], np.ndarray], params, num_experts: int, device,
                      check: Callable[[str, np.ndarray], None], progress: bool = False) -> list:
    """:func:`load_parameters`, each host array passed to ``check(name, array)`` (e.g.
    :func:`check_expert_scales`) and then uploaded to ``device``; returns the device tensors in
    the order of ``params``. Raises what ``load_parameters`` and ``check`` raise."""
    import tvm

    out = []
    for name, arr in load_parameters(get, params, num_experts, progress=progress):
        check(name, arr)
        out.append(tvm.runtime.tensor(arr, device))
    return out


def check_expert_scales(name: str, arr: np.ndarray, layout: str) -> None:
    """With the tc layout, a routed-expert ``weight_scale`` must hold E8M0 bytes its kernels
    can scale by (:func:`schedules.mxfp4_tc_layout.check_scales`); other tensors and the
    ``"ocp"`` layout pass.

    Raises:
        ValueError: names the tensor, the byte and its index, and the fix.
    """
    m = EXPERT_STACKED.match(name)
    if layout != "ocp" and m and m.group(3) == "weight_scale":
        from schedules.mxfp4_tc_layout import check_scales

        check_scales(arr, name)


def repack_expert_codes(vm, layout: str, names: list[str], params: list) -> list:
    """With the tc layout, permute every routed-expert ``weight_packed`` device tensor in
    ``params`` (parallel to ``names``) in place with the library's ``repack_expert_codes``
    (k3_compile.pipeline.attach_repack); returns ``params``. ``"ocp"``: unchanged.

    Raises:
        ParameterError: the library has no ``repack_expert_codes``, or it failed on a tensor
            (named, with the first line of the runtime's message).
    """
    if layout == "ocp":
        return params
    from .pipeline import REPACK_FN

    try:
        fn = vm[REPACK_FN]
    except Exception as e:  # noqa: BLE001 - the runtime raises its own error types
        raise ParameterError(f"the library says expert_code_layout {layout!r} but has no {REPACK_FN} "
                             f"function ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                             "recompile it with `k3 compile`") from None
    for i, name in enumerate(names):
        m = EXPERT_STACKED.match(name)
        if m and m.group(3) == "weight_packed":
            try:
                params[i] = fn(params[i])
            except Exception as e:  # noqa: BLE001
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ParameterError(f"parameter {name}: {REPACK_FN} failed ({msg})") from None
    return params
