"""Data-free diagnostics of a Net Utility allocation, to read before merging.

Net Utility trades each direction's benefit (its share of its own task's energy) against its
interference with the other tasks' input geometry (docs/math.md, section 5). The interference
can only inform the choice if the tasks' input subspaces are related. LoRAs trained from
independent initialisations often are not: their input subspaces overlap only at chance, the
interference of direction ``(j, k)`` is then about ``sigma_jk^2 * sum_{i!=j} (sum_n
sigma_in^(2a) / w_i) / d_in`` (a per-task constant times ``sigma^2``), and Net Utility reduces to
down-weighting high-energy tasks. :func:`diagnose` measures this on the adapters themselves,
without data:

1. **Overlap against chance**, per module. With ``V_i`` the ``(d_in, r_i)`` right singular
   vectors of task ``i``'s update (its ``r_i`` candidate directions, as :func:`nu.score` counts
   them), the normalised overlap of two tasks is ``o_ij = ||V_i^T V_j||_F^2 / min(r_i, r_j)``
   (1: one subspace contains the other; 0: orthogonal). For a uniformly random (Haar)
   ``r_j``-dimensional subspace ``E[V_j V_j^T] = (r_j / d_in) I``, so ``E ||V_i^T V_j||_F^2 =
   r_i r_j / d_in`` exactly, for any ``d_in``, and the chance value of ``o_ij`` is ``c_ij =
   max(r_i, r_j) / d_in`` (``r / d_in`` at equal ranks). A module's ``overlap`` is the mean of
   ``o_ij`` over its task pairs ``i < j`` (tasks with candidates there), its ``chance`` the mean of
   ``c_ij``, and ``overlap_vs_chance = overlap / chance``: about 1 for independent random
   subspaces, up to ``d_in / r`` for a shared subspace. The model-wide value is the mean of the
   modules' ratios.
2. **Per task**: its energy ``||dW_i||_F^2`` summed over modules (:func:`nu.task_energies`), its
   share of the total, how many directions Net Utility keeps at the budget
   (:func:`nu.kept_per_task`) and their share of all kept, against its **uniform share**: the
   uniform allocation (``scope="uniform"``) keeps ``U_l`` directions in module ``l``, split
   equally among the ``M'_l`` tasks with candidates there, so task ``i``'s uniform share is
   ``sum_l [i in l] U_l / M'_l / sum_l U_l`` (exactly ``1 / M`` when every task has candidates in
   every module). ``kept_vs_uniform`` is the ratio of the two shares.
3. **Lambda sensitivity**: the number of directions whose kept status changes (the size of the
   symmetric difference of the masks) when the scores are recomputed with ``lam = f * lam0`` for
   ``f = 1/4`` and ``f = 4``, ``lam0`` the lambda of the diagnosed scoring (the median rule with
   ``lam="auto"``).
4. **Random-rotation control**: every task's input side is rotated by an independent Haar
   orthogonal ``Q`` (``lora_a -> Q lora_a``, one ``Q`` per task and module). This keeps every
   task's singular values, hence every benefit and energy, and replaces the cross-task geometry
   by chance. The rotated adapters are scored with the same ``alpha`` and ``lam`` option and
   allocated at the same budget; the control reports how many directions change. Few changes
   mean the interference term is not informing the choice.
5. **Warnings**, in plain English: overlap within a factor 2 of chance together with a rotation
   control that changes fewer than 10% of the kept directions; and each task that keeps less
   than half its uniform share.
6. **Energy alone against Net Utility**: the directions whose kept status differs between this
   allocation and the one by energy alone (``lam = 0``: every candidate ranked by its benefit,
   its share of its task's energy), at the same budget and scope.
7. **A recommendation** (this project's rule, from its own studies, not the paper's): where the
   rotation control changes fewer than 10% of the kept directions (the interference term sees
   no cross-task geometry, item 4), or Net Utility keeps nothing, allocate by **energy alone**
   (``lam=0``, ``--lam 0``): it needs no lambda, and in the regime study (encoder adapters,
   7 tasks, ten seeds; docs/experiments.md) it was as good as Net Utility at R = 16 and 32 and,
   at a budget of about 2 directions per task and module (at most :data:`TIGHT_PER_TASK`),
   beat the uniform split (:data:`EVIDENCE`); at looser budgets no allocation beat the uniform
   split there, and none beat keeping every direction. Where the rotation control changes more,
   the term acts on this set's geometry; the planted study found the sign-blind term helps
   where tasks conflict and costs as much where they agree, so nothing is recommended over
   comparing the options on held-out data.

References:
  Amballa et al., "Not All Ranks Are Equal: Budget-Aware LoRA Merging Across Tasks": Eq.
  net-utility, Hyperparameters (lambda).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._core import io as _io
from .._core import tree as _tree
from .._core.checks import as_integer, brief, check_budget, check_choice, given
from ..allocation.allocate import allocate
from ..allocation.analysis import kept_per_task
from ..errors import InputError, InputTypeError
from ..scoring._run import check_interference, check_options
from ..scoring.utility import score, task_energies
from ._diagnose_advice import EVIDENCE as EVIDENCE
from ._diagnose_advice import OVERLAP_NEAR_CHANCE as OVERLAP_NEAR_CHANCE
from ._diagnose_advice import ROTATION_FEW as ROTATION_FEW
from ._diagnose_advice import TIGHT_PER_TASK as TIGHT_PER_TASK
from ._diagnose_advice import pct as _pct
from ._diagnose_advice import recommendation, warnings_of
from ._diagnose_measures import ModuleOverlap as ModuleOverlap
from ._diagnose_measures import (
    changed,
    energy_scores,
    lambda_changes,
    overlaps,
    rotated,
    uniform_shares,
)

__all__ = [
    "EVIDENCE",
    "LAMBDA_FACTORS",
    "OVERLAP_NEAR_CHANCE",
    "ROTATION_FEW",
    "TIGHT_PER_TASK",
    "Diagnostics",
    "ModuleOverlap",
    "TaskDiagnostics",
    "diagnose",
]

LAMBDA_FACTORS = (0.25, 4.0)
"""The factors of lambda whose effect :func:`diagnose` reports (relative to the scoring's lambda)."""
_FN = "nu.diagnose"
_SCOPES = ("global", "local")


class TaskDiagnostics(NamedTuple):
    """One task's energy and its share of the kept directions (module docstring, item 2).

    Attributes:
      name: the task's label (``names=`` of :func:`diagnose`, or ``"task i"``).
      energy: ``||dW_i||_F^2`` summed over modules.
      energy_share: ``energy / sum of all tasks' energies``.
      kept: directions Net Utility keeps of this task, over all modules.
      kept_share: ``kept / all kept`` (NaN if nothing is kept).
      uniform_share: the task's share under the uniform allocation (``1 / M`` at full coverage).
      kept_vs_uniform: ``kept_share / uniform_share`` (NaN where either is undefined or 0).
    """

    name: str
    energy: float
    energy_share: float
    kept: int
    kept_share: float
    uniform_share: float
    kept_vs_uniform: float


@dataclasses.dataclass(frozen=True)
class Diagnostics:
    """What :func:`diagnose` returns; :meth:`to_dict` for JSON, :meth:`format` for a terminal.

    Attributes:
      budget: R, directions per module on average.
      scope: the allocation scope (``"global"`` or ``"local"``).
      alpha: the geometry exponent used (``"auto"`` resolved).
      lam: the lambda used (``"auto"``: the median rule's value).
      modules: ``{name: ModuleOverlap}`` in the adapters' module order.
      overlap_vs_chance: the mean of the modules' ``overlap_vs_chance`` (NaN if no module has two
        tasks with candidates).
      tasks: one :class:`TaskDiagnostics` per task, in adapter order.
      kept: all directions Net Utility keeps (every task and module).
      lambda_changes: ``{factor: changed}``, directions whose kept status changes with
        ``lam = factor * lam`` (:data:`LAMBDA_FACTORS`).
      rotation_seed: the seed of the random rotations.
      rotation_lam: the lambda of the rotated adapters' scoring.
      rotation_kept: directions kept for the rotated adapters.
      rotation_changed: directions whose kept status differs between the rotated and the original
        allocation (symmetric difference of the masks, counted).
      rotation_changed_fraction: ``rotation_changed / (kept + rotation_kept)``: the fraction of
        kept directions replaced (0 if nothing is kept either way).
      warnings: plain-English warnings (see the module docstring, item 5).
      interference: the interference term scored (``"overlap"``, the paper's, or this
        project's ``"signed"`` / ``"signed_weaker"``; :func:`nu.score`).
      energy_changed: directions whose kept status differs between this allocation and the one
        by energy alone (``lam = 0``) at the same budget and scope (item 6; 0 when ``lam`` is 0).
      recommend_energy: True where the recommendation (item 7) is to allocate by energy alone.
      recommendation: the recommendation in plain English (item 7).
    """

    budget: int
    scope: str
    alpha: float
    lam: float
    modules: dict[str, ModuleOverlap]
    overlap_vs_chance: float
    tasks: tuple[TaskDiagnostics, ...]
    kept: int
    lambda_changes: dict[float, int]
    rotation_seed: int
    rotation_lam: float
    rotation_kept: int
    rotation_changed: int
    rotation_changed_fraction: float
    warnings: tuple[str, ...]
    interference: str = "overlap"
    energy_changed: int = 0
    recommend_energy: bool = False
    recommendation: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (plain lists, numbers, strings; NaN as None; factors as strings)."""
        return _io.to_jsonable(
            {
                "budget": self.budget,
                "scope": self.scope,
                "alpha": self.alpha,
                "lam": self.lam,
                "overlap_vs_chance": self.overlap_vs_chance,
                "modules": {k: m._asdict() for k, m in self.modules.items()},
                "tasks": [t._asdict() for t in self.tasks],
                "kept": self.kept,
                "lambda_changes": {f"{f:g}": n for f, n in self.lambda_changes.items()},
                "rotation": {
                    "seed": self.rotation_seed,
                    "lam": self.rotation_lam,
                    "kept": self.rotation_kept,
                    "changed": self.rotation_changed,
                    "changed_fraction": self.rotation_changed_fraction,
                },
                "warnings": list(self.warnings),
                "interference": self.interference,
                "energy_changed": self.energy_changed,
                "recommendation": {
                    "energy_only": self.recommend_energy,
                    "text": self.recommendation,
                },
            }
        )

    def format(self) -> str:
        """A short text rendering: overlap, a per-task table, lambda and rotation checks,
        warnings."""
        ratios = [m.overlap_vs_chance for m in self.modules.values()]
        ratios = [x for x in ratios if math.isfinite(x)]
        span = f" (modules {min(ratios):.3g}x to {max(ratios):.3g}x)" if ratios else ""
        lines = [
            f"diagnostics at budget {self.budget} ({self.scope}), alpha {self.alpha:g}, "
            f"lambda {self.lam:.4g}",
            f"input-subspace overlap vs chance: {self.overlap_vs_chance:.3g}x{span}; "
            "1 = independent random subspaces",
        ]
        w = max(len("task"), *(len(t.name) for t in self.tasks))
        lines.append(
            f"  {'task':<{w}}  {'energy':>10}  {'energy%':>7}  {'kept':>5}  {'kept%':>6}  "
            f"{'uniform%':>8}  {'vs uniform':>10}"
        )
        for t in self.tasks:
            lines.append(
                f"  {t.name:<{w}}  {t.energy:>10.4g}  {_pct(t.energy_share):>7}  {t.kept:>5}  "
                f"{_pct(t.kept_share):>6}  {_pct(t.uniform_share):>8}  "
                f"{_num(t.kept_vs_uniform):>10}"
            )
        lam = ", ".join(
            f"x{_factor(f)}: {n} change{'' if n == 1 else 's'}"
            for f, n in self.lambda_changes.items()
        )
        lines.append(f"lambda sensitivity ({self.kept} kept): {lam}")
        lines.append(
            f"random-rotation control (seed {self.rotation_seed}): {self.rotation_changed} "
            f"directions change kept status ({_pct(self.rotation_changed_fraction)} of the kept)"
        )
        lines.append(
            f"energy alone (lambda 0) at the same budget: {self.energy_changed} "
            f"direction{'' if self.energy_changed == 1 else 's'} change kept status"
        )
        lines += [f"warning: {w}" for w in self.warnings]
        lines.append(f"recommendation: {self.recommendation}")
        return "\n".join(lines)


def _num(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.2f}"


def _factor(f: float) -> str:
    return f"1/{1 / f:g}" if f < 1 else f"{f:g}"


def _ratio(x: float, y: float) -> float:
    return x / y if y > 0 and math.isfinite(x) and math.isfinite(y) else math.nan


# ------------------------------------------------------------------------------------ checks


def _check_seed(seed: Any) -> int:
    value = as_integer(seed)
    if value is None:
        raise InputTypeError(
            f"{_FN}: rotation_seed={given(seed)}; expected a non-negative integer (the seed of the "
            "random rotations)."
        )
    if value < 0:
        raise InputError(f"{_FN}: rotation_seed={value}; expected a non-negative integer.")
    return value


def _check_names(names: Any, m_tasks: int) -> tuple[str, ...]:
    if names is None:
        return tuple(f"task {i}" for i in range(m_tasks))
    if isinstance(names, (str, bytes, Mapping)) or not isinstance(names, Sequence):
        raise InputTypeError(
            f"{_FN}: names={given(names)}; expected a sequence of {m_tasks} strings (one label "
            "per adapter) or None."
        )
    if len(names) != m_tasks or not all(isinstance(n, str) for n in names):
        raise InputError(
            f"{_FN}: names={brief(list(names))} has {len(names)} entries; expected {m_tasks} "
            "strings, one label per adapter, in adapter order."
        )
    return tuple(names)


# ------------------------------------------------------------------------------ the measures


# ------------------------------------------------------------------------------------ diagnose


def diagnose(
    adapters: Sequence[Any],
    *,
    budget: int,
    alpha: float | str = "auto",
    lam: float | str = "auto",
    scope: str = "global",
    rotation_seed: int = 0,
    names: Sequence[str] | None = None,
    interference: str = "overlap",
    _cli: bool = False,
) -> Diagnostics:
    """Check, without data, whether Net Utility's interference term informs the allocation.

    Scores the adapters (:func:`nu.score`), allocates at ``budget`` (:func:`nu.allocate`), and
    reports (the module docstring gives every definition):

    * per module, the mean normalised input-subspace overlap of its task pairs against its value
      for random subspaces: ``overlap_vs_chance = mean_{i<j} ||V_i^T V_j||_F^2 / min(r_i, r_j)``
      divided by ``mean_{i<j} max(r_i, r_j) / d_in``, and its mean over modules;
    * per task, the energy ``||dW_i||_F^2``, its share, and its share of the kept directions
      against its uniform share (``1 / M`` at full coverage);
    * how many kept directions change with ``lam`` scaled by 1/4 and by 4;
    * how many change when every task's ``lora_a`` is rotated by an independent random
      orthogonal matrix (which keeps each task's spectrum and replaces the cross-task geometry by
      chance);
    * warnings: overlap within 2x of chance and a rotation control that changes under 10% of the
      kept directions ("close to energy down-weighting"), and each task that keeps under half
      its uniform share;
    * how many kept directions differ from the allocation by energy alone (``lam = 0``);
    * a recommendation (this project's rule, not the paper's; module docstring, item 7): energy
      alone (``lam=0``) where the rotation control changes under 10% of the kept directions or
      Net Utility keeps nothing, with what the project's studies measured at this many
      directions per task and module; otherwise none over comparing the options on held-out
      data.

    It scores the adapters four times (as given, with lambda x1/4 and x4, rotated): about four
    times the cost of :func:`nu.score`. Concrete inputs only (not under ``jax.jit``).

    Args:
      adapters: M >= 2 adapters, as in :func:`nu.score`.
      budget: R, a positive integer: directions per module on average (:func:`nu.allocate`).
      alpha: geometry exponent, or ``"auto"`` (the heterogeneity rule), as in :func:`nu.score`.
      lam: interference weight, or ``"auto"`` (the median rule), as in :func:`nu.score`. The
        rotated adapters are scored with the same option.
      scope: ``"global"`` or ``"local"`` (the uniform scope does not use the utilities).
      rotation_seed: non-negative integer seed of the random rotations.
      names: optional labels of the tasks (one string per adapter), used in the report.
      interference: the interference term, as in :func:`nu.score` (``"overlap"``, the paper's;
        ``"signed"`` or ``"signed_weaker"``, this project's); every scoring here uses it.

    Returns:
      :class:`Diagnostics`.

    Raises:
      InputError: (a ``ValueError``) fewer than two adapters, budget <= 0, scope not "global" or
        "local", a negative rotation_seed, names of the wrong length, an unknown interference,
        and whatever
        :func:`nu.score` refuses.
      InputTypeError: (a ``TypeError``) budget or rotation_seed not an integer (as
        :func:`nu.allocate`), names not a sequence of strings, an option of the wrong type.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{f"m{l}": {"lora_a": rng.normal(size=(256, 4)),
      ...                   "lora_b": rng.normal(size=(4, 32))} for l in range(3)}
      ...        for _ in range(3)]
      >>> d = nu.diagnose(ads, budget=4)
      >>> 0.3 < d.overlap_vs_chance < 3  # independent random LoRAs: chance level
      True
      >>> [round(t.uniform_share, 3) for t in d.tasks]
      [0.333, 0.333, 0.333]
    """
    budget = check_budget(_FN, budget)
    check_options(_FN, alpha, lam, None, 1.0)
    check_choice(_FN, "scope", scope, _SCOPES, " (the uniform scope ignores the utilities)")
    seed = _check_seed(rotation_seed)
    interference = check_interference(_FN, interference)
    _check_count(adapters)
    names_, buckets, m_tasks = _tree.collect(adapters, fn=_FN)
    labels = _check_names(names, m_tasks)
    flat = [_tree.flatten_modules(ad, fn=_FN, task=i) for i, ad in enumerate(adapters)]

    scores = score(adapters, alpha=alpha, lam=lam, interference=interference)
    masks = allocate(scores, budget, scope=scope)
    modules = overlaps(flat, names_, scores, _tree.compute_dtype(buckets))
    ratios = [m.overlap_vs_chance for m in modules.values() if math.isfinite(m.overlap_vs_chance)]
    overlap = float(np.mean(ratios)) if ratios else math.nan
    tasks = _task_table(adapters, scores, masks, labels, budget)
    total = sum(t.kept for t in tasks)
    lam_changes = {
        f: lambda_changes(
            adapters, scores, masks, f, budget=budget, scope=scope, interference=interference
        )
        for f in LAMBDA_FACTORS
    }
    energy_changed = changed(masks, allocate(energy_scores(scores), budget, scope=scope))
    rot_scores = score(
        rotated(flat, names_, seed), alpha=float(scores.alpha), lam=lam, interference=interference
    )
    rot_masks = allocate(rot_scores, budget, scope=scope)
    rot_kept = int(sum(int(np.asarray(m).sum()) for m in rot_masks.values()))
    rot_changed = changed(masks, rot_masks)
    frac = rot_changed / (total + rot_kept) if total + rot_kept > 0 else 0.0
    energy_only, advice = recommendation(
        lam=float(scores.lam), changed_fraction=frac, kept=total, energy_changed=energy_changed,
        budget=budget, m_tasks=m_tasks, interference=interference, overlap=overlap, cli=_cli,
    )  # fmt: skip
    return Diagnostics(
        budget=budget,
        scope=scope,
        alpha=float(scores.alpha),
        lam=float(scores.lam),
        modules=modules,
        overlap_vs_chance=overlap,
        tasks=tasks,
        kept=total,
        lambda_changes=lam_changes,
        rotation_seed=seed,
        rotation_lam=float(rot_scores.lam),
        rotation_kept=rot_kept,
        rotation_changed=rot_changed,
        rotation_changed_fraction=float(frac),
        warnings=warnings_of(overlap, frac, rot_changed, total, tasks),
        interference=interference,
        energy_changed=energy_changed,
        recommend_energy=energy_only,
        recommendation=advice,
    )


def _check_count(adapters: Any) -> None:
    """At least two adapters (the diagnostics compare tasks); other forms are left to
    :func:`_tree.collect`'s checks."""
    if isinstance(adapters, Sequence) and not isinstance(adapters, (str, bytes, Mapping)):
        if len(adapters) < 2:
            raise InputError(
                f"{_FN}: adapters has {len(adapters)} adapter{'' if len(adapters) == 1 else 's'}"
                "; expected at least 2 (the diagnostics compare tasks)."
            )


def _task_table(
    adapters: Sequence[Any], scores: Any, masks: Any, labels: Sequence[str], budget: int
) -> tuple[TaskDiagnostics, ...]:
    """Item 2 of the module docstring: each task's energy, kept directions and shares."""
    m_tasks = len(labels)
    energy = np.asarray(task_energies(adapters, _fn=_FN), np.float64)
    e_share = energy / energy.sum() if energy.sum() > 0 else np.full(m_tasks, math.nan)
    kept = np.asarray(kept_per_task(masks), np.int64)
    total = int(kept.sum())
    k_share = kept / total if total > 0 else np.full(m_tasks, math.nan)
    u_share = uniform_shares(allocate(scores, budget, scope="uniform"), scores)
    return tuple(
        TaskDiagnostics(
            labels[i],
            float(energy[i]),
            float(e_share[i]),
            int(kept[i]),
            float(k_share[i]),
            float(u_share[i]),
            _ratio(float(k_share[i]), float(u_share[i])),
        )
        for i in range(m_tasks)
    )
