"""A merge coefficient far from 1 in the compute dtype: the stages run with its mantissa and the
merged modules are scaled by its power of two afterwards (every method is linear in ``coef``),
refusing a module whose merged update would underflow or overflow the dtype."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._core import checks as _checks
from ..errors import InputError
from ..operators import _plan

__all__ = ["coef_split", "scale_results"]


def coef_split(coef: Any, dtype: Any) -> tuple[Any, int]:
    """``(c, e)`` with ``coef = c 2**e``: ``(coef, 0)`` where the compute ``dtype`` holds
    ``coef`` as a normal number (or it is zero, or traced), else its mantissa in ``[0.5, 1)``
    and exponent. Every method is linear in ``coef``, so the stages run with ``c`` and the
    result is scaled by ``2**e`` afterwards (:func:`scale_results`): ``1e-39`` would be a
    subnormal float32 that XLA flushes to zero, and ``1e308`` an ``inf``."""
    if isinstance(coef, jax.core.Tracer):
        return coef, 0
    v = float(np.asarray(coef, np.float64))
    fi = np.finfo(dtype)
    if v == 0 or float(fi.tiny) <= abs(v) <= float(fi.max):
        return coef, 0
    return math.frexp(v)


def _log2_peak(a: np.ndarray, b: np.ndarray) -> float:
    """``log2 max |a @ b|`` (float64 factors, ``-inf`` for a zero product), in blocks of rows
    of at most 2**24 entries (128 MiB), so that no ``d_in x d_out`` product is held at once."""
    rows = max(1, (1 << 24) // max(1, b.shape[1]))
    peak = 0.0
    for i in range(0, a.shape[0], rows):
        peak = max(peak, float(np.abs(a[i : i + rows] @ b).max(initial=0)))
    return math.log2(peak) if peak > 0 else -math.inf


def _log2_max(x: np.ndarray) -> float:
    m = float(np.abs(x).max(initial=0))
    return math.log2(m) if m > 0 else -math.inf


def scale_results(
    fn: str, results: Mapping[str, Any], exp2: int, dtype: Any, coef: Any
) -> dict[str, Any]:
    """Merged modules (computed with ``coef``'s mantissa) times ``2**exp2``, in ``dtype``.

    A low-rank module's power of two goes to ``lora_a`` where it alone holds it, else it is
    split so that both factors are about the square root of the result (exact: powers of two).
    A module whose merged update (``2**exp2`` times the largest entry of the product, in float64)
    is below ``dtype``'s smallest normal number, or beyond its largest, is refused naming
    ``coef`` and the modules: returned, it would be zeros or ``inf``."""
    fi = np.finfo(dtype)
    lo, hi = float(fi.minexp), math.log2(float(fi.max))
    out: dict[str, Any] = {}
    under: list[tuple[str, float]] = []
    over: list[tuple[str, float]] = []
    for name, mod in results.items():
        if "delta" in mod:
            x = np.asarray(mod["delta"], np.float64)
            lg = _log2_max(x) + exp2
        else:
            a = np.asarray(mod["lora_a"], np.float64)
            b = np.asarray(mod["lora_b"], np.float64)
            lg = _log2_peak(a, b) + exp2
        if lg == -math.inf:  # nothing kept, or zero: zero whatever the coefficient
            out[name] = mod
            continue
        if lg < lo:
            under.append((name, lg))
            continue
        if lg > hi:
            over.append((name, lg))
            continue
        if "delta" in mod:
            out[name] = {"delta": jax.device_put(np.ldexp(x, exp2).astype(dtype))}
            continue
        la, lb = _log2_max(a), _log2_max(b)
        sa = exp2 if lo + fi.nmant <= la + exp2 <= hi - 1 else round((lb - la + exp2) / 2)
        with np.errstate(over="ignore"):  # (a factor beyond the dtype is refused below)
            fa = np.ldexp(a, sa).astype(dtype)
            fb = np.ldexp(b, exp2 - sa).astype(dtype)
        if not (np.all(np.isfinite(fa)) and np.all(np.isfinite(fb))):
            over.append((name, lg))
            continue
        out[name] = {"lora_a": jax.device_put(fa), "lora_b": jax.device_put(fb), "scale": 1.0}
    name = np.dtype(dtype).name
    c = float(np.asarray(coef, np.float64))
    for bad, what, limit in (
        (under, "underflow", f"normal numbers from {float(fi.tiny):.3g}"),
        (over, "overflow", f"at most {float(fi.max):.3g}"),
    ):
        if bad:
            top = max((lg for _, lg in bad), key=abs)
            raise InputError(
                f"{fn}: coef={c!r} makes the merged update of "
                f"{_checks.few([n for n, _ in bad])} {what} {name}: its entries reach about "
                f"2**{top:.0f} (1e{math.log10(2) * top:+.0f}) where {name} holds {limit}, so it "
                f"would be {'zeros' if what == 'underflow' else 'inf'}. Use a coefficient nearer "
                f"1, or {_plan.X64_HINT}."
            )
    return out
