"""Scoring's error reports: which modules and tasks cannot be represented, and why.

Eager, after the jitted scoring has run (:func:`nu.score`): the kernels count what is not finite
or out of range, and these functions turn the counts into one :class:`InputError` that names the
modules, the tasks and the range, and says what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._core import tree as _tree
from .._core.checks import few, short
from ..errors import InputError

__all__ = [
    "X64_HINT",
    "checkify_score",
    "raise_blind_moments",
    "raise_unrepresentable",
    "range_text",
]

X64_HINT = (
    "enable x64 (jax.config.update('jax_enable_x64', True)) and pass float64 factors, whose "
    "range is far wider"
)


def range_text(dtype: Any) -> str:
    fi = np.finfo(np.dtype(dtype))
    return f"the range of {np.dtype(dtype).name} (normal numbers {fi.tiny:.1e} to {fi.max:.1e})"


def _spread(bk: _tree.Bucket, n: int, l10: np.ndarray) -> str:
    """How much the tasks' updates differ in size in module ``n`` of ``bk``."""
    live = np.flatnonzero(np.isfinite(l10))
    hi = int(live[np.argmax(l10[live])])
    lo = int(live[np.argmin(l10[live])])

    def sc(i: int) -> str:
        return f"{float(np.asarray(bk.modules[n][i].scale, np.float64)):.3g}"

    return (
        f"largest singular value about 1e{l10[hi]:+.0f} in task {hi} (scale {sc(hi)}) and "
        f"1e{l10[lo]:+.0f} in task {lo} (scale {sc(lo)})"
    )


def raise_unrepresentable(
    fn: str,
    buckets: Sequence[_tree.Bucket],
    outs: Sequence[Any],
    lam: Any,
    lam_bad: Any,
    *,
    dtype: Any,
    lam_is_auto: bool,
) -> None:
    """Refuse results that the compute dtype cannot hold (see the module docstring)."""
    hits = []
    for bk, (_, _, ranges, l10) in zip(buckets, outs, strict=True):
        r = np.asarray(ranges)
        if r.any():
            hits.append((bk, r, np.asarray(l10, np.float64)))
    rng = range_text(dtype)
    if hits:
        bk, r, l10 = hits[0]
        n = int(np.flatnonzero(r.any((1, 2)))[0])
        kind = int(np.flatnonzero(r[n].any(0))[0])
        i = int(np.flatnonzero(r[n, :, kind])[0])
        nm = short(bk.names[n])
        if kind == 0:
            head = (
                f"module {nm!r}, task {i}: the update's singular values (largest about "
                f"1e{l10[n, i]:+.0f}) fall outside {rng}. Check that task's scale (lora_alpha / "
                f"r, here {float(np.asarray(bk.modules[n][i].scale, np.float64)):.3g}) and "
                f"factors, or {X64_HINT}."
            )
        else:
            what = (
                f"task {i}'s interference, which grows as the square of the ratio of two tasks' "
                "update sizes,"
                if kind == 1
                else f"lam * interference of task {i} (lam = {float(np.asarray(lam)):.3g})"
            )
            head = (
                f"module {nm!r}: {what} is beyond {rng}: the tasks' updates differ too much in "
                f"size ({_spread(bk, n, l10[n])}). A LoRA scale (lora_alpha / r) this different "
                "between tasks is usually a configuration error: check the scales"
                f"{', or pass a smaller lam' if kind == 2 and not lam_is_auto else ''}, or "
                f"{X64_HINT}."
            )
        pairs = sum(int(r2.any(-1).sum()) for _, r2, _ in hits)
        names = [
            nm2 for bk2, r2, _ in hits for nm2, row in zip(bk2.names, r2, strict=True) if row.any()
        ]
        more = (
            f" In all, {pairs} (module, task) pairs are affected, in {few(names)}."
            if pairs > 1
            else ""
        )
        raise InputError(f"{fn}: {head}{more}")
    if bool(np.asarray(lam_bad)):
        raise InputError(
            f"{fn}: lam='auto' (median benefit / median interference) is "
            f"{float(np.asarray(lam)):.3g}, outside {rng}: the interferences are too large for "
            "the benefits (the tasks' updates differ greatly in size). Check the LoRA scales, pass "
            f"lam= explicitly, or {X64_HINT}."
        )


def checkify_score(
    fn: str, names: Sequence[str], buckets: Sequence[_tree.Bucket], outs: Any, lam_bad: Any
) -> None:
    """Under a trace with ``checked=True``: the eager checks as ``checkify`` checks."""
    from jax.experimental import checkify

    index = {nm: k for k, nm in enumerate(names)}
    # inputs first (checkify reports the first failed check): a NaN input also makes results NaN
    for bk, (_, nonfinite, _, _) in zip(buckets, outs, strict=True):
        pos = jnp.asarray([index[nm] for nm in bk.names], jnp.int32)
        m_tasks = nonfinite.shape[1]
        for k, label in enumerate(_tree.NONFINITE_ARRAYS):
            c = nonfinite[..., k].reshape(-1)
            first = jnp.argmax(c > 0)
            checkify.check(
                ~(c > 0).any(),
                f"{fn}: {label} of task {{task}} in module #{{module}} (its position in the "
                "adapters' module order) has {count} non-finite entries (NaN or Inf).",
                task=first % m_tasks,
                module=pos[first // m_tasks],
                count=c[first],
            )
    for bk, (_, _, ranges, _) in zip(buckets, outs, strict=True):
        pos = jnp.asarray([index[nm] for nm in bk.names], jnp.int32)
        m_tasks = ranges.shape[1]
        for k, what in enumerate(
            ("singular values", "interference", "utility (lam * interference)")
        ):
            c = ranges[..., k].reshape(-1)
            first = jnp.argmax(c)
            checkify.check(
                ~c.any(),
                f"{fn}: the {what} of task {{task}} in module #{{module}} (its position in the "
                "adapters' module order) is beyond the range of the compute dtype; the tasks' "
                "update sizes (LoRA scales) differ too much, or enable x64.",
                task=first % m_tasks,
                module=pos[first // m_tasks],
            )
    checkify.check(
        ~lam_bad,
        f"{fn}: lam='auto' is beyond the range of the compute dtype (the tasks' update sizes "
        "differ too much); pass lam= explicitly.",
    )


def raise_blind_moments(
    fn: str, buckets: Sequence[_tree.Bucket], scores: Sequence[Any], isos: Sequence[Any]
) -> None:
    """Refuse a task-module whose update has candidate directions but no energy on its own
    inputs (``E ||dW x||^2 = 0`` under its ``input_moments``): its benefit (and its share of
    every interference) would be 0 / 0. ``scores`` per bucket: the fields ``(sigma, benefit,
    ...)`` side by side, ``(n, 4, M, r)``; ``isos`` per bucket ``(n, M)`` bool, True where a
    task-module has no data."""
    hits = []
    for bk, sc, iso in zip(buckets, scores, isos, strict=True):
        sc = np.asarray(sc)
        sigma, benefit = sc[:, 0], sc[:, 1]
        n_mod = len(bk.names)
        blind = (
            ~np.asarray(iso)[:n_mod]
            & (sigma[:n_mod] > 0).any(-1)
            & ~(np.abs(benefit[:n_mod]) > 0).any(-1)
        )
        for n, i in zip(*np.nonzero(blind), strict=True):
            hits.append((bk, int(n), int(i)))
    if not hits:
        return
    bk, n, i = hits[0]
    m = bk.modules[n][i]
    more = (
        f" In all, {len(hits)} (module, task) pairs, in {few([h[0].names[h[1]] for h in hits])}."
        if len(hits) > 1
        else ""
    )
    raise InputError(
        f"{fn}: module {short(bk.names[n])!r}, task {i}: the update (lora_a "
        f"{tuple(m.lora_a.shape)}, lora_b {tuple(m.lora_b.shape)}) is zero on every input of "
        f"input_moments[{i}] (E ||dW x||^2 = 0 up to rounding): the inputs are "
        "orthogonal to the update's input directions, so its energy share is 0 / 0. These are "
        "probably another module's (or another task's) activations; check the names, or pass "
        f"None at input_moments[{i}][{short(bk.names[n])!r}] for the data-free geometry."
        f"{more}"
    )
