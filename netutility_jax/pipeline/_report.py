"""What a merge did: :class:`Report`, built the same way by every entry point, and the warning
about merged modules that came out exactly zero (:class:`ZeroUpdateWarning`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .._core import checks as _checks
from .._core import tree as _tree
from .._core.tables import MaskTable, MergedTable
from ..allocation._summary import (
    budget_spent_of,
    kept_of,
    kept_per_task_of,
    masks_by_shape,
    non_prefix_of,
)
from ..allocation.analysis import kept_per_task
from ..errors import InputError
from ..scoring.utility import heterogeneity

if TYPE_CHECKING:
    from ._request import MergeRequest

__all__ = [
    "Report",
    "ZeroUpdateWarning",
    "build_report",
    "h_of",
    "heterogeneity_or_nan",
    "ranks_of",
    "warn_zeroed",
    "zeroed_modules",
    "zeroed_text",
]


class ZeroUpdateWarning(UserWarning):
    """A merge kept components of a module, yet its merged update is exactly zero: TIES whose
    ``density`` keeps no entry (PEFT's ``int(density * n)`` is 0), DARE dropping every entry
    (``p`` near 1), or tasks that cancel. Written, such a module changes nothing.
    :func:`merge_adapters` warns with it and records the modules in :attr:`Report.zeroed`."""


# ------------------------------------------------------------------------ all-zero merges


def zeroed_modules(merged: Mapping[str, Any], kept: Mapping[str, Any]) -> list[str]:
    """The modules of ``merged`` (``{name: module}``) whose update is exactly zero although
    ``kept`` (``{name: bool (M, r_max)}``) keeps components there."""
    out = []
    flags = merged.zeros() if isinstance(merged, MergedTable) else None
    if flags is not None:  # (flagged by the merge on the device: no module is read)
        return [nm for nm, z in flags.items() if z and nm in kept and np.asarray(kept[nm]).any()]
    for name, mod in merged.items():
        if mod is None or name not in kept or not np.asarray(kept[name]).any():
            continue
        if "delta" in mod:
            zero = not np.any(np.asarray(mod["delta"]))
        else:
            a, b = mod["lora_a"], mod["lora_b"]
            zero = a.shape[-1] == 0 or not np.any(np.asarray(a)) or not np.any(np.asarray(b))
        if zero:
            out.append(name)
    return out


def zeroed_text(zeroed: Sequence[str], total: int, method: str, options: Mapping[str, Any]) -> str:
    """What the warning about all-zero merged modules says (without the caller's name)."""
    opts = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return (
        f"the merged update of {_checks.few(zeroed)} ({len(zeroed)} of {total} modules) is "
        f"exactly zero although components were kept there: method {method!r}"
        f"{f' ({opts})' if opts else ''} kept nothing of them (TIES keeps PEFT's "
        "int(density * n) entries per task, DARE drops each entry with probability p). Written, "
        "these modules change nothing; raise the density or lower p."
    )


def warn_zeroed(
    fn: str, zeroed: Sequence[str], total: int, method: str, options: Mapping[str, Any]
) -> None:
    """:class:`ZeroUpdateWarning` naming the all-zero merged modules (none: nothing)."""
    if zeroed:
        warnings.warn(
            ZeroUpdateWarning(f"{fn}: {zeroed_text(zeroed, total, method, options)}"),
            stacklevel=_checks.caller_stacklevel(),
        )


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`merge_adapters` did.

    Attributes:
      lam: interference weight used (None for ``allocation="all"``, which does not score).
      alpha: geometry exponent used (None for ``"all"``).
      budget: the budget R asked for (average directions per module); None if none was given
        (``allocation="all"``).
      budget_spent: average directions kept per module.
      kept: ``{name: (M,) int}`` directions kept per module and task.
      kept_per_task: ``(M,)`` directions kept per task over all modules.
      non_prefix_fraction: fraction of per-(module, task) kept sets that are not a spectral prefix.
      heterogeneity: ``h = Var_i[log ||dW_i||_F^2]`` (paper Eq. h); NaN if a task is all zero.
      ranks: ``{name: int}`` rank of each merged module (None for dense modules).
      method, space, allocation, scope: the settings used.
      masks: ``{name: bool (M, r_max)}`` the kept components (for plots and analyses).
      scores: the :class:`nu.Scores` the allocation used (None for ``allocation="all"``).
      zeroed: the modules whose merged update is exactly zero although components were kept
        there (TIES keeping no entry, DARE dropping all; :class:`ZeroUpdateWarning`).
      weights: the per-task weights the updates were multiplied by (None: none given).
      min_share: the per-task floor of the allocation (None: none).
      data_aware: whether the scores used input second moments (``input_moments`` with data
        for at least one task-module; this project's extension, not the paper's, see
        docs/input_moments.md). False: the paper's data-free score (or no score).
      interference: the scores' interference term, ``"overlap"`` (the paper's), ``"signed"``
        (this project's sign-aware extension) or ``"signed_weaker"`` (its asymmetric form,
        :func:`nu.score`).
    """

    lam: float | None
    alpha: float | None
    budget: int | None
    budget_spent: float
    kept: dict[str, np.ndarray]
    kept_per_task: np.ndarray
    non_prefix_fraction: float
    heterogeneity: float
    ranks: dict[str, int | None]
    method: str
    space: str
    allocation: str
    scope: str | None
    masks: dict[str, Any] | None = None
    scores: Any = None
    zeroed: tuple[str, ...] = ()
    weights: tuple[float, ...] | None = None
    min_share: float | None = None
    data_aware: bool = False
    interference: str = "overlap"


# A pytree, so that a merge inside jax.jit can return it (its numbers are then arrays); the
# settings are static.
jax.tree_util.register_dataclass(
    Report,
    data_fields=[
        "lam", "alpha", "budget_spent", "kept", "kept_per_task", "non_prefix_fraction",
        "heterogeneity", "ranks", "masks", "scores", "weights", "min_share",
    ],
    meta_fields=[
        "budget", "method", "space", "allocation", "scope", "zeroed", "data_aware",
        "interference",
    ],
)  # fmt: skip


def ranks_of(merged: Any) -> dict[str, int | None]:
    """Each merged module's rank (None for dense modules)."""
    if isinstance(merged, MergedTable) and merged.pristine:  # (no module read)
        return merged.ranks()
    return {
        "/".join(path) or "lora": int(node["lora_a"].shape[1]) if "lora_a" in node.keys() else None
        for path, node in _tree.walk_modules(merged, is_module=_tree.has_update, max_depth=None)
        if node is not None
    }


def _summaries(masks: Mapping[str, Any]) -> tuple[float, dict[str, np.ndarray], np.ndarray, float]:
    """``(budget_spent, kept, kept_per_task, non_prefix_fraction)`` of the kept masks: the values,
    dtypes and errors of :func:`nu.budget_spent`, :func:`nu.kept_per_task` and
    :func:`nu.non_prefix_fraction` (checked once, in that order), from the masks grouped by
    shape (``allocation._summary``); ``kept``: each module's count per task."""
    m = _checks.check_masks("nu.budget_spent", masks)
    groups = masks_by_shape(m)
    spent, kept = budget_spent_of(groups), kept_of(groups, list(m))
    if len({v.shape[0] for v in m.values()}) > 1:
        kept_per_task(masks)  # (its error: the masks disagree on M)
    total = kept_per_task_of(groups)
    total = total.astype(jax.dtypes.canonicalize_dtype(total.dtype))
    return spent, kept, total, non_prefix_of(groups)


def _is_table(masks: Any) -> bool:
    return isinstance(masks, MaskTable) and masks.pristine


def heterogeneity_or_nan(adapters: Any) -> float:
    """:func:`nu.heterogeneity` of in-memory adapters, NaN if a task is all zero (the one
    refusal that means "undefined", an :class:`InputError` naming its ``task_index``); any
    other error is raised, never reported as NaN."""
    try:
        return float(heterogeneity(adapters))
    except InputError as err:
        if getattr(err, "task_index", None) is None:
            raise
        return float("nan")


def build_report(
    req: MergeRequest,
    kept_masks: Mapping[str, Any],
    sc: Any,
    *,
    h: float,
    ranks: Mapping[str, int | None],
    zeroed: Sequence[str] = (),
    lam_alpha: tuple[float, float] | None = None,
) -> Report:
    """The :class:`Report` of the merge ``req`` asked for: ``kept_masks`` and the scores ``sc``
    it allocated with (None for ``allocation="all"``), the heterogeneity ``h``, each merged
    module's rank in module order, and the modules that came out zero; ``lam_alpha``: the
    scores' lambda and alpha where the host has them already (read with the masks)."""
    # (nu.allocate's masks are read from their host copies, and kept as they are: placing
    # each module's mask on the device is left to whoever reads one)
    spent, kept, per_task, non_prefix = _summaries(kept_masks)
    return Report(
        lam=None if sc is None else float(sc.lam) if lam_alpha is None else lam_alpha[0],
        alpha=None if sc is None else float(sc.alpha) if lam_alpha is None else lam_alpha[1],
        budget=None if req.budget is None else int(req.budget),
        budget_spent=spent,
        kept=kept,
        kept_per_task=per_task,
        non_prefix_fraction=non_prefix,
        heterogeneity=h,
        ranks=dict(ranks),
        method=req.method,
        space=req.space,
        allocation=req.allocation,
        scope=req.report_scope,
        masks=kept_masks if _is_table(kept_masks) else dict(kept_masks),
        scores=sc,
        zeroed=tuple(zeroed),
        weights=req.weights,
        min_share=req.min_share,
        data_aware=req.data_aware,
        interference=req.interference,
    )


def h_of(k: np.ndarray, t: np.ndarray) -> float:
    """``h = Var_i log ||dW_i||_F^2`` from each task's energy ``t_i 2^k_i`` (the scoring's,
    ``sum_energies``), in float64; NaN if a task is zero everywhere (as
    :func:`heterogeneity_or_nan`)."""
    if (t <= 0).any():
        return float("nan")
    rel = (k - k[0]).astype(np.float64) + np.log2(t)
    return float(np.var(rel * np.log(2.0)))
