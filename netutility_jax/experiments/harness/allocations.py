"""The mask controls of the grid: allocations that keep Net Utility's count of directions per
module and choose them otherwise (``grid.VARIANTS``' ``random`` and ``random_split``).

Plain numpy over ``nu.allocate`` masks and ``nu.Scores``; a seed fixes every draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import InputError

__all__ = ["random_allocation", "random_split_allocation"]


def random_allocation(
    reference: dict[str, Any], scores: Any, *, seed: Sequence[int]
) -> dict[str, np.ndarray]:
    """Masks keeping as many directions per module as ``reference``, chosen at random.

    In each module, ``reference[name].sum()`` directions are drawn uniformly without
    replacement among the module's candidates (any task, any rank: the slots whose utility is
    finite), so the per-module budget is Net Utility's and only the choice within a module is
    random.

    Args:
      reference: ``{name: bool (M, r_max)}`` (e.g. ``nu.allocate`` masks).
      scores: the ``nu.Scores`` that defines the candidates.
      seed: entropy for ``numpy.random.SeedSequence``.

    Returns:
      ``{name: bool (M, r_max)}``.
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(seed))))
    out = {}
    for name in sorted(reference):
        ref = np.asarray(reference[name], bool)
        cand = np.isfinite(np.asarray(scores.modules[name].utility))
        k = int(ref.sum())
        flat = np.flatnonzero(cand.ravel())
        if k > len(flat):
            raise InputError(
                f"random_allocation: module {name!r} keeps {k} directions but has {len(flat)} "
                "candidates; the reference masks do not come from these scores."
            )
        mask = np.zeros(cand.size, bool)
        mask[rng.choice(flat, size=k, replace=False)] = True
        out[name] = mask.reshape(cand.shape)
    return {name: out[name] for name in reference}


def random_split_allocation(
    reference: dict[str, Any], scores: Any, *, seed: Sequence[int]
) -> dict[str, np.ndarray]:
    """Masks keeping as many directions per module as ``reference``, split among the tasks at
    random, each task keeping its top directions.

    In each module, ``reference[name].sum()`` candidate slots are drawn uniformly without
    replacement (as :func:`random_allocation` does); only how many fell to each task is kept,
    and each task keeps that many of its leading singular directions. Against Net Utility this
    isolates the choice of tasks: both keep top directions of the tasks they favour.

    Args, Returns: as for :func:`random_allocation`.
    """
    drawn = random_allocation(reference, scores, seed=seed)
    out = {}
    for name, mask in drawn.items():
        cand = np.isfinite(np.asarray(scores.modules[name].utility))
        keep = np.zeros_like(mask)
        for i, n in enumerate(mask.sum(1)):
            keep[i, np.flatnonzero(cand[i])[:n]] = True
        out[name] = keep
    return out
