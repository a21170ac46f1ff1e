"""Summaries of a selection: where the budget went, and whether kept sets are spectral prefixes."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .errors import InputTypeError
from .utility import Scores


def _np(masks: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    if not isinstance(masks, Mapping) or not masks:
        raise InputTypeError("expected the {name: bool (M, r_max)} masks returned by nu.allocate.")
    return {k: np.asarray(v, bool) for k, v in masks.items()}


def kept_per_module(masks: Mapping[str, jax.Array]) -> dict[str, int]:
    """Directions kept in each module (all tasks): ``{name: int}``."""
    return {k: int(v.sum()) for k, v in _np(masks).items()}


def kept_per_task(masks: Mapping[str, jax.Array]) -> jax.Array:
    """Directions kept per task over all modules, ``(M,)`` int."""
    return jnp.asarray(sum(v.sum(1) for v in _np(masks).values()))


def budget_spent(masks: Mapping[str, jax.Array]) -> float:
    """Average directions kept per module (the paper's "used (avg)"); compare with the budget R."""
    m = _np(masks)
    return float(sum(v.sum() for v in m.values()) / len(m))


def _is_prefix(row: np.ndarray) -> bool:
    n = int(row.sum())
    return bool(row[:n].all())


def non_prefix_fraction(masks: Mapping[str, jax.Array]) -> float:
    """Fraction of per-(module, task) kept sets that are not a prefix of that task's spectrum.

    A kept set is a prefix if it is ``{0, ..., n-1}`` in descending-sigma order (paper, "The optimal
    set need not be a prefix"). Empty sets are left out (a task with nothing kept has no set);
    returns 0.0 if every set is empty.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> masks = {"q": np.array([[1, 1, 0], [0, 1, 0], [0, 0, 0]], bool)}
      >>> nu.non_prefix_fraction(masks)  # task 0 keeps a prefix, task 1 does not, task 2 nothing
      0.5
    """
    rows = [row for v in _np(masks).values() for row in v if row.any()]
    if not rows:
        return 0.0
    return float(np.mean([not _is_prefix(r) for r in rows]))


def retention_by_rank(masks: Mapping[str, jax.Array], scores: Scores) -> jax.Array:
    """Fraction of (module, task) sets that keep their k-th direction, per k, ``(r_max,)``.

    Only sets whose k-th slot is a candidate count for k (the paper's prefix figure). A prefix rule
    gives a step; net utility need not.
    """
    m = _np(masks)
    r = max(v.shape[1] for v in m.values())
    kept = np.zeros(r)
    total = np.zeros(r)
    for name, v in m.items():
        cand = np.isfinite(np.asarray(scores.modules[name].utility))
        kept[: v.shape[1]] += (v & cand).sum(0)
        total[: v.shape[1]] += cand.sum(0)
    return jnp.asarray(np.where(total > 0, kept / np.maximum(total, 1), np.nan))
