"""PEFT's LoRA tensors <-> this library's modules.

PEFT stores module ``<module>``'s factors as ``lora_A.weight`` ``(r, d_in)`` and ``lora_B.weight``
``(d_out, r)`` and adds ``scale * B A`` to the base weight, ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA). Here a module is ``{"lora_a": A^T (d_in, r),
"lora_b": B^T (r, d_out), "scale"}``: the same update in kernel layout, ``dK = scale * lora_a @
lora_b``. Loading checks the factors against each other and the config and computes the scale;
saving folds the scale into ``lora_B`` (PEFT's own scale is then 1) and truncates dense modules.
"""

from __future__ import annotations

import math
import numbers
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError, InputTypeError
from ._common import PREFIX, clip_repr
from ._config import ModuleSetting

__all__ = [
    "SAVE_DTYPES",
    "check_factor_shapes",
    "module_from_peft",
    "peft_factors",
    "peft_scale",
    "peft_tensors",
    "saved_dtype",
    "truncate_dense",
]

SAVE_DTYPES = ("float32", "bfloat16", "float16")


# ---------------------------------------------------------------------------------------------
# PEFT -> module
# ---------------------------------------------------------------------------------------------


def check_factor_shapes(
    module: str,
    keys: tuple[str, str],
    sa: tuple[int, ...],
    sb: tuple[int, ...],
    wf: pathlib.Path,
    *,
    fn: str,
) -> None:
    """``lora_A`` ``sa`` = ``(r, d_in)`` and ``lora_B`` ``sb`` = ``(d_out, r)``, with ``r >= 1``."""
    if len(sa) != 2 or len(sb) != 2:
        raise InputError(
            f"{fn}: module {clip_repr(module)} in {str(wf)!r} has lora_A {sa} and lora_B {sb}; "
            "only 2-D factors (LoRA on Linear / Conv1D) are supported, not LoRA on "
            "convolutions."
        )
    if sa[0] != sb[1]:
        raise InputError(
            f"{fn}: module {clip_repr(module)} in {str(wf)!r} has lora_A {sa} = (r, d_in) but "
            f"lora_B {sb} = (d_out, r) with a different r; the file is corrupt: save the "
            "adapter again."
        )
    if sa[0] == 0:
        ka, kb = keys
        raise InputError(
            f"{fn}: {str(wf)!r} holds rank-0 factors for module {clip_repr(module)} "
            f"({clip_repr(ka)} {sa}, {clip_repr(kb)} {sb}); PEFT adapters have r >= 1 and never "
            "save rank 0, so the file was not written by PEFT or is corrupt: save the "
            "adapter again."
        )


def peft_scale(
    module: str,
    sa: tuple[int, ...],
    sb: tuple[int, ...],
    setting: ModuleSetting,
    *,
    wf: pathlib.Path,
    where: str,
    fn: str,
) -> float:
    """PEFT's scale ``lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``) for a module whose
    ``lora_A`` has shape ``sa``, after checking the config's ``r`` and ``lora_alpha`` for it."""
    r, alpha = setting.r, setting.alpha
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r <= 0:
        raise InputError(
            f"{fn}: {where} gives module {clip_repr(module)} r={clip_repr(r)} ({setting.r_src}); "
            "expected a positive integer (the rank of lora_A / lora_B)."
        )
    if sa[0] != r:
        raise InputError(
            f"{fn}: module {clip_repr(module)} has lora_A {sa} and lora_B {sb} (rank {sa[0]}) "
            f"in {str(wf)!r}, but {where} gives it r={clip_repr(r)} (r / rank_pattern); the "
            "config does not belong to these weights: keep each adapter's config with its "
            "weights."
        )
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise InputError(
            f"{fn}: {where} gives module {clip_repr(module)} lora_alpha={clip_repr(alpha)} "
            f"({setting.alpha_src}); expected a number."
        )
    try:
        alpha_f = float(alpha)
    except OverflowError:
        alpha_f = math.inf
    if not math.isfinite(alpha_f):
        raise InputError(
            f"{fn}: {where} gives module {clip_repr(module)} lora_alpha={clip_repr(alpha)} "
            f"({setting.alpha_src}); expected a finite number (the scale is lora_alpha / r)."
        )
    return alpha_f / (math.sqrt(r) if setting.rslora else float(r))


def module_from_peft(
    a: Any,
    b: Any,
    scale: float,
    keys: tuple[str, str],
    wf: pathlib.Path,
    *,
    fn: str,
    host: bool = False,
) -> dict[str, Any]:
    """``{"lora_a": A^T, "lora_b": B^T, "scale"}`` from PEFT's ``A`` (r, d_in), ``B`` (d_out, r)
    (stored under ``keys``), upcast to float32 (float64 stays); ``host``: numpy views, not
    device arrays (for callers that stack them on the host)."""
    for k, x in zip(keys, (a, b), strict=True):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise InputTypeError(
                f"{fn}: {clip_repr(k)} in {str(wf)!r} has dtype {x.dtype}; LoRA factors are "
                "floating point (float32, bf16, fp16)."
            )
    return {"lora_a": _upcast(a, host), "lora_b": _upcast(b, host), "scale": scale}


def _upcast(x: Any, host: bool = False) -> Any:
    # transpose and upcast on the host, placed as is: eager jnp ops (jnp.asarray of a numpy
    # array included) compile an identity program once per factor shape
    arr = np.asarray(x)
    if arr.dtype != np.float64:
        arr = arr.astype(np.float32, copy=False)
    return arr.T if host else jax.device_put(np.ascontiguousarray(arr.T))


# ---------------------------------------------------------------------------------------------
# module -> PEFT
# ---------------------------------------------------------------------------------------------


def _host(x: Any, label: str, name: str, *, fn: str) -> np.ndarray:
    if isinstance(x, jax.core.Tracer):
        raise InputTypeError(
            f"{fn}: {label} of module {name!r} is traced; call save_adapter outside jit."
        )
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name not in ("bfloat16",):
        raise InputTypeError(
            f"{fn}: {label} of module {name!r} has dtype {arr.dtype}; expected floating point."
        )
    if arr.ndim != 2:
        raise InputError(f"{fn}: {label} of module {name!r} has shape {arr.shape}; expected 2-D.")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise InputError(
            f"{fn}: {label} of module {name!r} {arr.shape} has non-finite entries; PEFT would "
            "load NaN/inf weights."
        )
    return arr


def peft_factors(
    name: str, mod: Mapping[str, Any], rank: int | None, *, fn: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(A (r, d_in), B (d_out, r))`` in float64 with ``B A = dK^T`` exactly (PEFT scale 1)."""
    if "delta" in mod:
        delta = _host(mod["delta"], "delta", name, fn=fn)
        if rank is None:
            raise InputError(
                f"{fn}: module {name!r} is dense ({{'delta': {delta.shape}}}, e.g. from TIES or "
                "DARE in full space) and PEFT stores only low-rank factors. Pass rank=k to "
                "truncate dense modules by SVD (the best rank-k approximation), or truncate "
                "yourself with nu.to_lora(module, k)."
            )
        u, s, vt = np.linalg.svd(delta, full_matrices=False)
        k = min(rank, s.shape[0])
        root = np.sqrt(s[:k])
        # balanced split: both factors carry sqrt(s), like a trained LoRA
        return (u[:, :k] * root).T, (root[:, None] * vt[:k]).T
    if "lora_a" not in mod or "lora_b" not in mod:
        raise InputError(
            f"{fn}: module {name!r} has keys {sorted(mod.keys())}; a LoRA module needs both "
            "'lora_a' (d_in, r) and 'lora_b' (r, d_out)."
        )
    a = _host(mod["lora_a"], "lora_a", name, fn=fn)
    b = _host(mod["lora_b"], "lora_b", name, fn=fn)
    if a.shape[1] != b.shape[0]:
        raise InputError(
            f"{fn}: factors of module {name!r} do not chain: lora_a {a.shape} is (d_in, r) but "
            f"lora_b {b.shape} is (r, d_out)."
        )
    scale = np.asarray(mod.get("scale", 1.0), np.float64)
    if scale.shape != () or not np.isfinite(scale):
        raise InputError(f"{fn}: scale of module {name!r} is {scale!r}; expected a finite scalar.")
    if a.shape[1] == 0:
        # nothing kept here: PEFT needs r >= 1, so write one zero direction (update exactly 0)
        return np.zeros((1, a.shape[0])), np.zeros((b.shape[1], 1))
    return a.T, (float(scale) * b).T


def truncate_dense(
    modules: Mapping[str, Any], rank: int, *, fn: str = "nu.peft.truncate_dense"
) -> dict[str, Any]:
    """``modules`` with each dense module ``{"delta": (d_in, d_out)}`` (TIES or DARE in full
    space) as the rank-``rank`` LoRA module :func:`save_adapter` writes for it with ``rank=``:
    its best rank-``rank`` approximation by SVD, both factors carrying the square roots of the
    singular values (float64, scale 1); LoRA modules pass unchanged.

    Example:
      >>> import numpy as np
      >>> d = np.outer([1.0, 2.0], [3.0, 0.0, 4.0])  # rank 1
      >>> m = truncate_dense({"w": {"delta": d}}, 1)["w"]
      >>> m["lora_a"].shape, m["lora_b"].shape, bool(np.allclose(m["lora_a"] @ m["lora_b"], d))
      ((2, 1), (1, 3), True)
    """
    out = {}
    for name, mod in modules.items():
        if mod is not None and "delta" in mod:
            a, b = peft_factors(name, mod, rank, fn=fn)
            mod = {"lora_a": a.T, "lora_b": b.T, "scale": 1.0}
        out[name] = mod
    return out


def saved_dtype(dtype: str) -> Any:
    """The numpy dtype of a ``save_adapter`` dtype name (bfloat16: ml_dtypes', via jnp)."""
    np_dtype = {"float32": np.float32, "float16": np.float16}.get(dtype)
    return jnp.bfloat16 if np_dtype is None else np_dtype


def peft_tensors(name: str, a: np.ndarray, b: np.ndarray, dtype: str, *, fn: str) -> dict:
    """Module ``name``'s PEFT factors ``(A (r, d_in), B (d_out, r))`` as the checkpoint's tensors
    ``{"base_model.model.<name>.lora_A.weight": A, ...}`` in the saved ``dtype``."""
    return {
        f"{PREFIX}{name}.{part}.weight": _to_peft(x, dtype, name, part, fn=fn)
        for part, x in (("lora_A", a), ("lora_B", b))
    }


def _to_peft(x: np.ndarray, dtype: str, name: str, part: str, *, fn: str) -> np.ndarray:
    """``x`` cast to the saved ``dtype`` (a name from ``SAVE_DTYPES``), contiguous; an entry
    that overflows it is refused."""
    with np.errstate(over="ignore"):  # overflow is reported below, with the module
        y = np.ascontiguousarray(x.astype(saved_dtype(dtype)))
    if not np.all(np.isfinite(y.astype(np.float32))):
        raise InputError(
            f"{fn}: module {name!r}'s {part} overflows {dtype} (largest entry "
            f"{np.abs(x).max():.3g}); save with dtype='float32' or 'bfloat16'."
        )
    return y
