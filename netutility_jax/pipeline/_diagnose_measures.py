"""The measures of :func:`nu.diagnose` (:mod:`netutility_jax.pipeline.diagnostics`, whose
module docstring defines them): the input-subspace overlap of each module's tasks against chance
(item 1), the uniform shares (item 2), the lambda sensitivity (item 3), the random-rotation
control (item 4) and the scores of energy alone (item 6)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._core import tree as _tree
from ..allocation.allocate import allocate
from ..allocation.analysis import kept_per_module
from ..scoring.decompose import lora_svd
from ..scoring.utility import Scores, score

__all__ = [
    "ModuleOverlap",
    "changed",
    "energy_scores",
    "haar_frame",
    "in_dirs",
    "lambda_changes",
    "overlaps",
    "rotated",
    "uniform_shares",
]


class ModuleOverlap(NamedTuple):
    """Input-subspace overlap of one module's tasks (see the module docstring, item 1).

    Attributes:
      overlap: mean over task pairs ``i < j`` of ``||V_i^T V_j||_F^2 / min(r_i, r_j)``.
      chance: mean over the same pairs of ``max(r_i, r_j) / d_in``, the expectation of the
        overlap for a uniformly random subspace.
      overlap_vs_chance: ``overlap / chance``; NaN with fewer than two tasks with candidates.
      tasks: how many tasks have candidate directions in the module.
    """

    overlap: float
    chance: float
    overlap_vs_chance: float
    tasks: int


def in_dirs(
    flat: Sequence[Mapping[str, _tree.Module | None]], names: Sequence[str], dtype: Any
) -> dict[tuple[str, int], np.ndarray]:
    """``{(module, task): in_dirs (d_in, k)}`` float64, descending, from :func:`nu.lora_svd`,
    one batched call per factor shape."""
    groups: dict[tuple, list[tuple[str, int, _tree.Module]]] = {}
    for name in names:
        for i, f in enumerate(flat):
            m = f[name]
            if m is not None and m.rank > 0:
                key = (tuple(m.lora_a.shape), tuple(m.lora_b.shape))
                groups.setdefault(key, []).append((name, i, m))
    out = {}
    for items in groups.values():
        a = np.stack([np.asarray(m.lora_a).astype(dtype) for _, _, m in items])
        b = np.stack([np.asarray(m.lora_b).astype(dtype) for _, _, m in items])
        s = np.asarray([np.asarray(m.scale, np.float64) for _, _, m in items]).astype(dtype)
        dirs = np.asarray(lora_svd(a, b, s).in_dirs, np.float64)
        out.update(((name, i), dirs[n]) for n, (name, i, _) in enumerate(items))
    return out


def overlaps(
    flat: Sequence[Mapping[str, _tree.Module | None]],
    names: Sequence[str],
    scores: Scores,
    dtype: Any,
) -> dict[str, ModuleOverlap]:
    """Item 1 of the module docstring, per module."""
    dirs = in_dirs(flat, names, dtype)
    out = {}
    for name in names:
        ranks = np.asarray(scores.modules[name].sigma > 0).sum(1)
        live = [i for i, r in enumerate(ranks) if r > 0]
        d_in = next(f[name].d_in for f in flat if f[name] is not None)
        vs = {i: dirs[name, i][:, : int(ranks[i])] for i in live}
        ov, ch = [], []
        for p, i in enumerate(live):
            for j in live[p + 1 :]:
                ri, rj = int(ranks[i]), int(ranks[j])
                ov.append(float(np.sum((vs[i].T @ vs[j]) ** 2)) / min(ri, rj))
                ch.append(max(ri, rj) / d_in)
        if ov:
            o, c = float(np.mean(ov)), float(np.mean(ch))
            out[name] = ModuleOverlap(o, c, o / c, len(live))
        else:
            out[name] = ModuleOverlap(math.nan, math.nan, math.nan, len(live))
    return out


def changed(masks: Mapping[str, Any], other: Mapping[str, Any]) -> int:
    """Directions kept in exactly one of two allocations of the same modules."""
    return int(sum((np.asarray(masks[k]) ^ np.asarray(other[k])).sum() for k in masks))


def lambda_changes(
    adapters: Sequence[Any],
    scores: Scores,
    masks: Mapping[str, Any],
    factor: float,
    *,
    budget: int,
    scope: str,
    interference: str = "overlap",
) -> int:
    """Item 3: directions whose kept status changes when ``adapters`` are scored with
    ``lam = factor * scores.lam`` (same alpha and interference) and allocated as ``masks``
    were."""
    lam = factor * float(scores.lam)
    other = score(adapters, alpha=float(scores.alpha), lam=lam, interference=interference)
    return changed(masks, allocate(other, budget, scope=scope))


def haar_frame(rng: np.random.Generator, d: int, k: int) -> np.ndarray:
    """A ``(d, k)`` orthonormal frame uniform on the Stiefel manifold (QR of a Gaussian, with
    the signs that make ``R``'s diagonal positive)."""
    q, r = np.linalg.qr(rng.standard_normal((d, k)))
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def rotated(
    flat: Sequence[Mapping[str, _tree.Module | None]], names: Sequence[str], seed: int
) -> list[dict[str, Any]]:
    """Item 4: the adapters with every task's ``lora_a`` replaced by ``Q lora_a``, ``Q`` a Haar
    random ``d_in x d_in`` orthogonal matrix per task and module.

    ``Q`` is never formed: with the thin QR ``lora_a = Q_a R_a`` (``Q_a`` ``(d_in, k)``,
    ``k = min(d_in, r)``), ``Q lora_a = (Q Q_a) R_a``, and for Haar ``Q`` the frame ``Q Q_a`` is
    uniform on the Stiefel manifold; so ``lora_a -> F R_a`` with ``F`` a uniform frame
    (:func:`haar_frame`) has exactly the law of a Haar rotation, at ``O(d_in r^2)`` instead of
    ``O(d_in^3)``, and equals ``Q lora_a`` for the orthogonal ``Q`` that maps ``Q_a`` to ``F``.
    """
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = [{} for _ in flat]
    for name in names:
        for i, f in enumerate(flat):
            m = f[name]
            if m is None:
                out[i][name] = None
                continue
            a = np.asarray(m.lora_a)
            if m.rank > 0 and m.d_in > 0:
                qa, ra = np.linalg.qr(a.astype(np.float64))
                a = (haar_frame(rng, m.d_in, qa.shape[1]) @ ra).astype(a.dtype)
            out[i][name] = {"lora_a": a, "lora_b": m.lora_b, "scale": m.scale}
    return out


def uniform_shares(uniform: Mapping[str, Any], scores: Scores) -> np.ndarray:
    """Item 2: per task, ``sum_l [i in l] U_l / M'_l / sum_l U_l`` (see the module docstring)."""
    counts = kept_per_module(uniform)
    m_tasks = next(iter(scores.modules.values())).sigma.shape[0]
    share = np.zeros(m_tasks)
    for name, u in counts.items():
        live = np.asarray(scores.modules[name].sigma > 0).any(1)
        if live.any():
            share += live * (u / live.sum())
    total = sum(counts.values())
    return share / total if total > 0 else np.full(m_tasks, math.nan)


def energy_scores(scores: Scores) -> Scores:
    """Item 6: the scores with every candidate's utility replaced by its benefit (``lam = 0``:
    energy alone; non-candidates stay ``-inf``), so no second scoring is needed."""
    modules = {}
    for k, ms in scores.modules.items():
        utility, benefit = np.asarray(ms.utility), np.asarray(ms.benefit)
        modules[k] = ms._replace(utility=np.where(np.isfinite(utility), benefit, -np.inf))
    return scores._replace(modules=modules, lam=np.zeros_like(np.asarray(scores.lam)))
