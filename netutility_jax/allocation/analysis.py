"""Summaries of a selection: where the budget went, and whether kept sets are spectral prefixes.

Every function takes the ``{name: bool (M, r_max)}`` masks of :func:`nu.allocate` and checks them
first: a mapping that is not empty, of concrete 2-D bool arrays (a float or int mask is refused,
not read by truthiness). Errors name the function and a few of the offending modules, with a
count: :class:`InputTypeError` for a wrong type, :class:`InputError` for an empty mapping or a
wrong shape.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .._core.checks import check_masks as _np
from .._core.checks import few
from ..errors import InputError, InputTypeError
from ..scoring.utility import Scores
from ._summary import budget_spent_of, masks_by_shape, non_prefix_of

__all__ = [
    "budget_spent",
    "kept_per_module",
    "kept_per_task",
    "non_prefix_fraction",
    "retention_by_rank",
]


def kept_per_module(masks: Mapping[str, jax.Array]) -> dict[str, int]:
    """Directions kept in each module (all tasks): ``{name: int}``."""
    return {k: int(v.sum()) for k, v in _np("nu.kept_per_module", masks).items()}


def kept_per_task(masks: Mapping[str, jax.Array]) -> jax.Array:
    """Directions kept per task over all modules, ``(M,)`` int.

    Raises:
      InputError: masks that disagree on the number of tasks M (and see the module docstring).
    """
    m = _np("nu.kept_per_task", masks)
    tasks = {v.shape[0] for v in m.values()}
    if len(tasks) > 1:
        raise InputError(
            f"nu.kept_per_task: the masks disagree on the number of tasks M ({sorted(tasks)}); "
            "expected the masks of one nu.allocate call."
        )
    return jnp.asarray(sum(v.sum(1) for v in m.values()))


def budget_spent(masks: Mapping[str, jax.Array]) -> float:
    """Average directions kept per module (the paper's "used (avg)"); compare with the budget R."""
    return budget_spent_of(masks_by_shape(_np("nu.budget_spent", masks)))


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
    return non_prefix_of(masks_by_shape(_np("nu.non_prefix_fraction", masks)))


def retention_by_rank(masks: Mapping[str, jax.Array], scores: Scores) -> jax.Array:
    """Fraction of (module, task) sets that keep their k-th direction, per k, ``(r_max,)``.

    Only sets whose k-th slot is a candidate count for k (the paper's prefix figure). A prefix rule
    gives a step; net utility need not.

    Raises:
      InputError: a mask whose module the scores lack, or whose shape differs from its
        utility's (pass the masks and scores of one run; and see the module docstring).
      InputTypeError: scores not a nu.Scores.
    """
    fn = "nu.retention_by_rank"
    m = _np(fn, masks)
    if not isinstance(scores, Scores):
        raise InputTypeError(
            f"{fn}: scores is a {type(scores).__name__}; expected the nu.Scores returned by "
            "nu.score."
        )
    missing = [k for k in m if k not in scores.modules]
    if missing:
        raise InputError(
            f"{fn}: scores have no entry for {few(missing)} of the masks; pass the masks "
            "and scores of one nu.score / nu.allocate run."
        )
    wrong = [
        k for k, v in m.items() if tuple(np.shape(scores.modules[k].utility)) != tuple(v.shape)
    ]
    if wrong:
        k = wrong[0]
        raise InputError(
            f"{fn}: masks and scores differ in shape for {few(wrong)} (first: mask "
            f"{tuple(m[k].shape)}, utility {tuple(np.shape(scores.modules[k].utility))}); pass "
            "the masks and scores of one nu.score / nu.allocate run."
        )
    r = max(v.shape[1] for v in m.values())
    kept = np.zeros(r)
    total = np.zeros(r)
    for name, v in m.items():
        cand = np.isfinite(np.asarray(scores.modules[name].utility))
        kept[: v.shape[1]] += (v & cand).sum(0)
        total[: v.shape[1]] += cand.sum(0)
    return jnp.asarray(np.where(total > 0, kept / np.maximum(total, 1), np.nan))
