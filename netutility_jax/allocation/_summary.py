"""A selection's summaries over its masks grouped by shape: a few numpy calls per shape rather
than a few per module (a merge report's summaries of 224 modules x 8 tasks took 20 ms of host
Python module by module). The masks are checked host arrays (``_core.checks.check_masks``);
:mod:`.analysis` and the merge report share these."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = [
    "Groups",
    "budget_spent_of",
    "kept_of",
    "kept_per_task_of",
    "masks_by_shape",
    "non_prefix_of",
]

Groups = list[tuple[list[str], np.ndarray]]


def masks_by_shape(masks: Mapping[str, np.ndarray]) -> Groups:
    """Per shape, its module names and their masks stacked ``(n, M, r_max)``."""
    groups: dict[tuple[int, ...], tuple[list[str], list[np.ndarray]]] = {}
    for name, v in masks.items():
        names, arrays = groups.setdefault(v.shape, ([], []))
        names.append(name)
        arrays.append(v)
    return [(names, np.stack(arrays)) for names, arrays in groups.values()]


def budget_spent_of(groups: Groups) -> float:
    """Directions kept per module, on average over the modules."""
    return float(sum(int(g.sum()) for _, g in groups) / sum(len(names) for names, _ in groups))


def kept_per_task_of(groups: Groups) -> np.ndarray:
    """Directions kept per task over every module, ``(M,)`` (one M in every group)."""
    return np.asarray(sum(g.sum((0, 2)) for _, g in groups))


def kept_of(groups: Groups, order: Sequence[str]) -> dict[str, np.ndarray]:
    """Each module's kept directions per task, ``{name: (M,)}`` in ``order``."""
    sums = {nm: row for names, g in groups for nm, row in zip(names, g.sum(-1), strict=True)}
    return {nm: sums[nm] for nm in order}


def non_prefix_of(groups: Groups) -> float:
    """The fraction of non-empty (module, task) kept sets that are not ``{0, ..., n-1}``."""
    sets = others = 0
    for _, g in groups:
        n = g.sum(-1)  # (modules, M): each set's size
        prefix = (g == (np.arange(g.shape[-1]) < n[..., None])).all(-1)
        sets += int((n > 0).sum())
        others += int(((n > 0) & ~prefix).sum())
    return 0.0 if sets == 0 else others / sets
