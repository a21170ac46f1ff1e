"""Each task's uniform share of the budget, and the allocation with a per-task floor.

Net Utility moves the budget freely between tasks, so a task whose directions interfere a lot
(or that targets fewer modules) can keep far less than an equal split would give it. Its
**uniform share** is what an equal split of the budget gives it, capped at what it has:

* scope ``"global"`` (one budget ``K = R L`` over the ``L`` modules):
  ``share_i = min(R L / M, c_i)``, ``c_i`` the task's candidate directions over all modules;
* scope ``"local"`` and the uniform allocation (a budget ``R`` per module):
  ``share_i = sum_m min(R / M, c_im)``, ``c_im`` its candidates in module ``m``.

``min_share=F`` (in ``[0, 1]``) guarantees each task ``f_i = int(F * share_i)`` directions (the
product in binary64, truncated, as PEFT's ``int(density * n)``), or all its admissible ones
(utility > 0 with ``positive_only``, else every candidate) if it has fewer. They are taken first,
from the top of the remaining budget: each task's ``f_i`` highest-utility admissible directions
are kept, then the rest of the budget, ``K - sum_i f_i``, goes to the highest utilities among the
admissible directions not yet kept, as :func:`nu.allocate` would give it. In the local scope the
same is done in each module, with ``R`` and ``share_im = min(R / M, c_im)``. Ties go to the lower
module, task and slot index, as :func:`nu.allocate`'s. ``sum_i f_i <= F K <= K``, so the floors
always fit; where every task already keeps at least its floor, the result is exactly
:func:`nu.allocate`'s (a floor that does not bind changes nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._core.checks import check_budget, given, real_option
from ..errors import InputError
from ..scoring.utility import Scores
from .allocate import allocate

__all__ = ["allocate_min_share", "candidates", "check_min_share", "select", "uniform_shares"]


def check_min_share(fn: str, min_share: Any, allocation: str) -> float | None:
    """``min_share`` as a float in ``[0, 1]``, or None (none given, or 0: no floor)."""
    if min_share is None:
        return None
    v = real_option(
        fn,
        "min_share",
        min_share,
        "a number in [0, 1] (each task keeps at least that fraction of its uniform share)",
        lambda x: 0 <= x <= 1,
        traced=False,
    )
    if v == 0:
        return None
    if allocation != "net_utility":
        raise InputError(
            f"{fn}: min_share={given(min_share)} applies to allocation='net_utility' (the other "
            f"allocations do not move the budget between tasks), not {allocation!r}; drop it."
        )
    return v


def candidates(masks_or_scores: Scores | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``{name: (M,) int}``: each task's candidate directions per module (from a
    :class:`nu.Scores`: utility above ``-inf``; from masks: their True slots)."""
    if isinstance(masks_or_scores, Scores):
        return {
            n: (np.asarray(ms.utility) > -np.inf).sum(1)
            for n, ms in masks_or_scores.modules.items()
        }
    return {n: np.asarray(m, bool).sum(1) for n, m in masks_or_scores.items()}


def uniform_shares(cand: Mapping[str, np.ndarray], budget: int, *, scope: str | None) -> np.ndarray:
    """``(M,)`` float64: each task's uniform share of the budget (the module docstring's
    formulas; ``scope="global"`` one budget over the model, otherwise a budget per module).

    Example:
      >>> cand = {"q": np.array([4, 4, 1]), "k": np.array([4, 0, 1])}
      >>> uniform_shares(cand, 3, scope="global").tolist()  # 3 x 2 / 3 = 2, capped at 2 for task 2
      [2.0, 2.0, 2.0]
      >>> uniform_shares(cand, 3, scope="local").tolist()  # per module min(1, c)
      [2.0, 1.0, 2.0]
    """
    counts = np.stack([np.asarray(c, np.int64) for c in cand.values()])  # (L, M)
    n_mod, m_tasks = counts.shape
    if scope == "global":
        return np.minimum(budget * n_mod / m_tasks, counts.sum(0).astype(np.float64))
    return np.minimum(budget / m_tasks, counts.astype(np.float64)).sum(0)


def _floor_select(
    u: np.ndarray, task: np.ndarray, k: int, floors: np.ndarray, positive_only: bool
) -> np.ndarray:
    """The kept flags of the flat utilities ``u``: each task ``i`` (``task``: each slot's task)
    its ``floors[i]`` best admissible slots, then the best ``k - sum(kept)`` of the others."""
    admissible = u > 0 if positive_only else u > -np.inf
    order = np.argsort(-u, kind="stable")  # best first; equal utilities: the lower index first
    order = order[admissible[order]]
    keep = np.zeros(u.shape, bool)
    for i, f in enumerate(floors):
        if f > 0:
            keep[order[task[order] == i][:f]] = True
    rest = order[~keep[order]][: max(0, k - int(keep.sum()))]
    keep[rest] = True
    return keep


def allocate_min_share(
    scores: Scores,
    budget: int,
    *,
    scope: str = "global",
    positive_only: bool = True,
    min_share: float,
) -> dict[str, jax.Array]:
    """:func:`nu.allocate` (``scope`` ``"global"`` or ``"local"``) with each task guaranteed
    ``int(min_share * share_i)`` directions (see the module docstring).

    Returns:
      ``{name: bool (M, r_max)}``, as :func:`nu.allocate`.
    """
    fn = "nu.merge_adapters"
    budget = check_budget(fn, budget)
    names = list(scores.modules)
    utils = [np.asarray(scores.modules[n].utility, np.float64) for n in names]
    m_tasks = utils[0].shape[0]
    admissible = [(u > 0) if positive_only else (u > -np.inf) for u in utils]
    cand = candidates(scores)
    out: dict[str, np.ndarray] = {}
    if scope == "global":
        share = uniform_shares(cand, budget, scope="global")
        adm = np.sum([a.sum(1) for a in admissible], axis=0)
        floors = np.minimum((min_share * share).astype(np.int64), adm)
        flat = np.concatenate([u.ravel() for u in utils])
        task = np.concatenate([np.repeat(np.arange(m_tasks), u.shape[1]) for u in utils])
        keep = _floor_select(flat, task, budget * len(utils), floors, positive_only)
        off = 0
        for n, u in zip(names, utils, strict=True):
            out[n] = keep[off : off + u.size].reshape(u.shape)
            off += u.size
    else:
        for n, u, a in zip(names, utils, admissible, strict=True):
            share = np.minimum(budget / m_tasks, cand[n].astype(np.float64))
            floors = np.minimum((min_share * share).astype(np.int64), a.sum(1))
            task = np.repeat(np.arange(m_tasks), u.shape[1])
            out[n] = _floor_select(u.ravel(), task, budget, floors, positive_only).reshape(u.shape)
    return {n: jax.device_put(out[n]) for n in names}


def select(
    scores: Scores,
    budget: int,
    *,
    allocation: str,
    scope: str,
    positive_only: bool,
    min_share: float | None,
) -> dict[str, jax.Array]:
    """The masks of ``allocation`` (``"net_utility"`` with ``scope``, or ``"uniform"``), with
    the per-task floor of ``min_share`` if given (:func:`allocate_min_share`)."""
    if allocation == "uniform":
        return allocate(scores, budget, scope="uniform", positive_only=positive_only)
    if min_share:
        return allocate_min_share(
            scores, budget, scope=scope, positive_only=positive_only, min_share=min_share
        )
    return allocate(scores, budget, scope=scope, positive_only=positive_only)
