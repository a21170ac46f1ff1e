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
from ..allocation.analysis import kept_per_module, kept_per_task
from ..errors import InputError, InputTypeError
from ..scoring._run import check_interference, check_options
from ..scoring.decompose import lora_svd
from ..scoring.utility import Scores, score, task_energies

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
OVERLAP_NEAR_CHANCE = 2.0
"""Model-wide overlap within this factor of chance (``1/2 .. 2``) counts as chance level."""
ROTATION_FEW = 0.1
"""A rotation control that changes fewer than this fraction of the kept directions counts as few."""
TIGHT_PER_TASK = 2.5
"""A budget of at most this many directions per task and module counts as tight (the regime
study's evidence: a gain over uniform at 16 / 7 = 2.3, none at 16 / 5 = 3.2 or 32 / 7 = 4.6)."""
EVIDENCE = {
    "energy_vs_uniform_r16": (0.61, 0.12, 1.09),
    "net_utility_vs_energy_r16": (0.08, -0.22, 0.39),
}
"""The figures :func:`diagnose`'s recommendation quotes: ``(mean, low, high)`` in points of
normalised accuracy, the mean over ten seeds of the regime study's centre and per-task cells
(encoder adapters, 7 tasks, R = 16) and its two-level 95% interval (seeds and test texts
resampled together); docs/regime/seeds/results.json, whose grid entries a test compares with
these."""

_FN = "nu.diagnose"
_SCOPES = ("global", "local")


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


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.0f}%"


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


def _in_dirs(
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


def _overlaps(
    flat: Sequence[Mapping[str, _tree.Module | None]],
    names: Sequence[str],
    scores: Scores,
    dtype: Any,
) -> dict[str, ModuleOverlap]:
    """Item 1 of the module docstring, per module."""
    dirs = _in_dirs(flat, names, dtype)
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


def _changed(masks: Mapping[str, Any], other: Mapping[str, Any]) -> int:
    """Directions kept in exactly one of two allocations of the same modules."""
    return int(sum((np.asarray(masks[k]) ^ np.asarray(other[k])).sum() for k in masks))


def _lambda_changes(
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
    return _changed(masks, allocate(other, budget, scope=scope))


def _haar_frame(rng: np.random.Generator, d: int, k: int) -> np.ndarray:
    """A ``(d, k)`` orthonormal frame uniform on the Stiefel manifold (QR of a Gaussian, with
    the signs that make ``R``'s diagonal positive)."""
    q, r = np.linalg.qr(rng.standard_normal((d, k)))
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def _rotated(
    flat: Sequence[Mapping[str, _tree.Module | None]], names: Sequence[str], seed: int
) -> list[dict[str, Any]]:
    """Item 4: the adapters with every task's ``lora_a`` replaced by ``Q lora_a``, ``Q`` a Haar
    random ``d_in x d_in`` orthogonal matrix per task and module.

    ``Q`` is never formed: with the thin QR ``lora_a = Q_a R_a`` (``Q_a`` ``(d_in, k)``,
    ``k = min(d_in, r)``), ``Q lora_a = (Q Q_a) R_a``, and for Haar ``Q`` the frame ``Q Q_a`` is
    uniform on the Stiefel manifold; so ``lora_a -> F R_a`` with ``F`` a uniform frame
    (:func:`_haar_frame`) has exactly the law of a Haar rotation, at ``O(d_in r^2)`` instead of
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
                a = (_haar_frame(rng, m.d_in, qa.shape[1]) @ ra).astype(a.dtype)
            out[i][name] = {"lora_a": a, "lora_b": m.lora_b, "scale": m.scale}
    return out


def _uniform_shares(uniform: Mapping[str, Any], scores: Scores) -> np.ndarray:
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


def _warnings(
    overlap: float,
    changed_fraction: float,
    changed: int,
    kept: int,
    tasks: Sequence[TaskDiagnostics],
) -> tuple[str, ...]:
    out = []
    near = math.isfinite(overlap) and 1 / OVERLAP_NEAR_CHANCE <= overlap <= OVERLAP_NEAR_CHANCE
    if near and changed_fraction < ROTATION_FEW:
        out.append(
            "Net Utility's choice here is close to energy down-weighting: the tasks' input "
            f"subspaces overlap {overlap:.2g}x what independent random subspaces would "
            f"(1x), and rotating every task's input side at random changes only {changed} "
            f"kept directions ({_pct(changed_fraction)} of {kept}), so the interference term "
            "sees no cross-task geometry and mainly penalises high-energy tasks; compare with "
            "the uniform allocation before trusting the ranking."
        )
    if kept == 0:
        out.append(
            "Net Utility keeps no direction at this budget (no positive utility); lower lambda "
            "or use the uniform allocation."
        )
    for i, t in enumerate(tasks):
        if math.isfinite(t.kept_vs_uniform) and t.kept_vs_uniform < 0.5:
            label = t.name if t.name == f"task {i}" else f"task {i} ({t.name})"
            why = (
                "Net Utility's interference term weighs against tasks with large updates"
                if t.energy_share > t.uniform_share
                else "its directions have low net utility against the other tasks at this lambda"
            )
            out.append(
                f"{label} keeps {t.kept} of the {kept} kept directions ({_pct(t.kept_share)}), "
                f"less than half its uniform share ({_pct(t.uniform_share)}); it has "
                f"{_pct(t.energy_share)} of the total energy, and {why}."
            )
    return tuple(out)


def _energy_scores(scores: Scores) -> Scores:
    """Item 6: the scores with every candidate's utility replaced by its benefit (``lam = 0``:
    energy alone; non-candidates stay ``-inf``), so no second scoring is needed."""
    modules = {}
    for k, ms in scores.modules.items():
        utility, benefit = np.asarray(ms.utility), np.asarray(ms.benefit)
        modules[k] = ms._replace(utility=np.where(np.isfinite(utility), benefit, -np.inf))
    return scores._replace(modules=modules, lam=np.zeros_like(np.asarray(scores.lam)))


def _spelt(option: str, value: str, cli: bool) -> str:
    """An option as the caller wrote it: ``--option value`` on the command line, else
    ``option=value`` (strings quoted)."""
    if cli:
        return f"--{option} {value}"
    return f'{option}="{value}"' if not value[:1].isdigit() else f"{option}={value}"


def _fmt_evidence(key: str) -> str:
    mean, lo, hi = EVIDENCE[key]
    return f"{mean:+.2f} points (95% interval {lo:+.2f} to {hi:+.2f})"


def _recommendation(
    *,
    lam: float,
    changed_fraction: float,
    kept: int,
    energy_changed: int,
    budget: int,
    m_tasks: int,
    interference: str,
    overlap: float,
    cli: bool,
) -> tuple[bool, str]:
    """Item 7 of the module docstring: ``(recommend_energy, text)``."""
    energy = _spelt("lam", "0", cli)
    keep_all = _spelt("allocation", "all", cli)
    per = budget / m_tasks
    study = "this project's regime study (encoder adapters, 7 tasks, ten seeds)"

    def budget_text(ref: str) -> str:
        if per <= TIGHT_PER_TASK:
            return (
                f"At this budget (about {per:.1f} directions per task and module) allocate "
                f"globally: in {ref}, at 2.3 directions per task and module, energy alone beat "
                f"the uniform split by {_fmt_evidence('energy_vs_uniform_r16')}."
            )
        return (
            f"At this budget ({per:.1f} directions per task and module) prefer {keep_all} "
            "where the merge's rank allows it: no budget beat keeping every direction in "
            f"{ref}, and at 3.2 to 4.6 directions per task and module no allocation beat the "
            "uniform split."
        )

    if lam == 0:
        return True, f"this allocation is already by energy alone ({energy}). {budget_text(study)}"
    if kept == 0 or changed_fraction < ROTATION_FEW:
        why = (
            "Net Utility keeps no direction at this budget"
            if kept == 0
            else (
                f"the interference term sees no cross-task geometry here (the rotation control "
                f"changes {_pct(changed_fraction)} of the kept directions), so Net Utility's "
                f"choice is energy down-weighting; it differs from energy alone in "
                f"{energy_changed} of {kept} kept directions"
            )
        )
        return True, (
            f"allocate by energy alone ({energy}): {why}. Energy alone needs no lambda, and in "
            f"{study} Net Utility minus energy alone at R = 16 was "
            f"{_fmt_evidence('net_utility_vs_energy_r16')}. {budget_text('that study')}"
        )
    other = (
        ("the sign-aware term", "signed")
        if interference == "overlap"
        else ("the paper's term", "overlap")
    )
    others = [f"energy alone ({energy})", f"{other[0]} ({_spelt('interference', other[1], cli)})"]
    near = math.isfinite(overlap) and 1 / OVERLAP_NEAR_CHANCE <= overlap <= OVERLAP_NEAR_CHANCE
    caveat = (
        f"; the input overlap is {overlap:.2g}x chance, so this may follow the noise of flat "
        "spectra rather than structure the tasks share"
        if near
        else ""
    )
    return False, (
        f"none: the interference term acts on this set's geometry (the rotation control changes "
        f"{_pct(changed_fraction)} of the kept directions{caveat}). This project's planted study found "
        "the paper's sign-blind term helps where tasks conflict and costs as much where they "
        f"agree: compare this allocation with {' and '.join(others)} on held-out data."
    )


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
    if isinstance(adapters, Sequence) and not isinstance(adapters, (str, bytes, Mapping)):
        if len(adapters) < 2:
            raise InputError(
                f"{_FN}: adapters has {len(adapters)} adapter{'' if len(adapters) == 1 else 's'}"
                "; expected at least 2 (the diagnostics compare tasks)."
            )
    names_, buckets, m_tasks = _tree.collect(adapters, fn=_FN)
    labels = _check_names(names, m_tasks)
    flat = [_tree.flatten_modules(ad, fn=_FN, task=i) for i, ad in enumerate(adapters)]
    dtype = _tree.compute_dtype(buckets)

    scores = score(adapters, alpha=alpha, lam=lam, interference=interference)
    masks = allocate(scores, budget, scope=scope)
    uniform = allocate(scores, budget, scope="uniform")
    modules = _overlaps(flat, names_, scores, dtype)
    ratios = [m.overlap_vs_chance for m in modules.values() if math.isfinite(m.overlap_vs_chance)]
    overlap = float(np.mean(ratios)) if ratios else math.nan

    energy = np.asarray(task_energies(adapters, _fn=_FN), np.float64)
    e_share = energy / energy.sum() if energy.sum() > 0 else np.full(m_tasks, math.nan)
    kept = np.asarray(kept_per_task(masks), np.int64)
    total = int(kept.sum())
    k_share = kept / total if total > 0 else np.full(m_tasks, math.nan)
    u_share = _uniform_shares(uniform, scores)
    tasks = tuple(
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

    lam_changes = {
        f: _lambda_changes(
            adapters, scores, masks, f, budget=budget, scope=scope, interference=interference
        )
        for f in LAMBDA_FACTORS
    }
    energy_masks = allocate(_energy_scores(scores), budget, scope=scope)
    energy_changed = _changed(masks, energy_masks)

    rot_scores = score(
        _rotated(flat, names_, seed), alpha=float(scores.alpha), lam=lam, interference=interference
    )
    rot_masks = allocate(rot_scores, budget, scope=scope)
    rot_kept = int(sum(int(np.asarray(m).sum()) for m in rot_masks.values()))
    changed = _changed(masks, rot_masks)
    frac = changed / (total + rot_kept) if total + rot_kept > 0 else 0.0
    energy_only, advice = _recommendation(
        lam=float(scores.lam),
        changed_fraction=frac,
        kept=total,
        energy_changed=energy_changed,
        budget=budget,
        m_tasks=m_tasks,
        interference=interference,
        overlap=overlap,
        cli=_cli,
    )

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
        rotation_changed=changed,
        rotation_changed_fraction=float(frac),
        warnings=_warnings(overlap, frac, changed, total, tasks),
        interference=interference,
        energy_changed=energy_changed,
        recommend_energy=energy_only,
        recommendation=advice,
    )
