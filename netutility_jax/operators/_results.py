"""Checks of merged results, and the merged adapter's tree.

The stages count the inputs' non-finite entries and report each merged module's range
(:func:`_stages.range_status`); these turn them into :class:`InputError` naming the modules, once
every bucket is dispatched (eagerly; under a trace nothing is checked).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._core import checks as _checks
from .._core import tree as _tree
from ..errors import InputError
from ._plan import X64_HINT
from ._stages import RANGE_KERNEL_NAN

__all__ = ["raise_nonfinite", "raise_range", "rebuild"]


def raise_nonfinite(fn: str, buckets, bads, dtype) -> None:
    """The inputs' non-finite counts (from the stages) as :class:`InputError` (eager only)."""
    if any(isinstance(b, jax.core.Tracer) for b in bads):
        return
    _tree.raise_nonfinite(fn, buckets, [np.asarray(b) for b in bads], dtype=dtype)


def _range_message(fn: str, bad, what: str, limit: str, name: str) -> str:
    sizes = [lg for _, lg in bad if np.isfinite(lg)]
    if sizes:  # the inputs are finite (checked), so a result is beyond the range, not NaN
        top = max(sizes, key=abs)
        size = f"its entries reach about 2**{top:.0f} (1e{np.log10(2) * top:+.0f})"
    else:  # beyond the range on the way: only an extreme coef can do that
        size = "its values leave the range on the way (check coef)"
    return (
        f"{fn}: the merged update of {_checks.few([n for n, _ in bad])} {what} {name}: "
        f"{size} where {name} holds {limit}. The tasks' scales (lora_alpha / r) or factors "
        f"are too extreme for {name}: {X64_HINT}."
    )


def raise_range(fn: str, checks, dtype, *, method: str | None = None, space: str = "") -> None:
    """Merged modules whose method's kernel returned NaN for finite inputs (naming ``method``,
    the kernel that ran, and ``space``), then modules that over- or underflow the compute dtype
    (:func:`_stages.range_status`)."""
    over: list[tuple[str, float]] = []
    under: list[tuple[str, float]] = []
    nan: list[str] = []
    for names, (code, log2) in checks:
        if isinstance(code, jax.core.Tracer):
            return
        for nm, c, lg in zip(names, np.asarray(code), np.asarray(log2), strict=True):
            if c == RANGE_KERNEL_NAN:
                nan.append(nm)
            elif c:
                (over if c == 1 else under).append((nm, float(lg)))
    if nan:
        who = f"method {method!r}" if method is not None else "the method's kernel"
        raise InputError(
            f"{fn}: {who} returned NaN for {_checks.few(nan)} ({len(nan)} module"
            f"{'s' if len(nan) > 1 else ''}{f', space {space!r}' if space else ''}) whose inputs "
            "are finite. A method's kernel must return finite values for finite inputs: fix the "
            f"kernel declared for {method!r} (netutility_jax.registry.MethodSpec.kernel)."
        )
    name = np.dtype(dtype).name
    fi = np.finfo(dtype)
    for bad, what, limit in (
        (over, "overflows", f"at most {fi.max:.3g}"),
        (under, "underflows", f"normal numbers from {fi.tiny:.3g}"),
    ):
        if bad:
            raise InputError(_range_message(fn, bad, what, limit, name))


def rebuild(adapter: Any, results: Mapping[str, Any]) -> Any:
    """The first adapter's tree with each module (or None placeholder) replaced by its result."""
    return _tree.map_modules(
        adapter, lambda path, _: results["/".join(path) or "lora"], max_depth=None
    )
