"""What :func:`nu.diagnose` concludes (:mod:`netutility_jax.pipeline.diagnostics`, items 5 and
7 of its module docstring): the warnings, and the recommendation with the figures it quotes
(this project's rule, from its own studies, not the paper's)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "EVIDENCE",
    "OVERLAP_NEAR_CHANCE",
    "ROTATION_FEW",
    "TIGHT_PER_TASK",
    "fmt_evidence",
    "pct",
    "recommendation",
    "spelt",
    "warnings_of",
]

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


def pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.0f}%"


def warnings_of(
    overlap: float,
    changed_fraction: float,
    changed: int,
    kept: int,
    tasks: Sequence[Any],
) -> tuple[str, ...]:
    out = []
    near = math.isfinite(overlap) and 1 / OVERLAP_NEAR_CHANCE <= overlap <= OVERLAP_NEAR_CHANCE
    if near and changed_fraction < ROTATION_FEW:
        out.append(
            "Net Utility's choice here is close to energy down-weighting: the tasks' input "
            f"subspaces overlap {overlap:.2g}x what independent random subspaces would "
            f"(1x), and rotating every task's input side at random changes only {changed} "
            f"kept directions ({pct(changed_fraction)} of {kept}), so the interference term "
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
                f"{label} keeps {t.kept} of the {kept} kept directions ({pct(t.kept_share)}), "
                f"less than half its uniform share ({pct(t.uniform_share)}); it has "
                f"{pct(t.energy_share)} of the total energy, and {why}."
            )
    return tuple(out)


def spelt(option: str, value: str, cli: bool) -> str:
    """An option as the caller wrote it: ``--option value`` on the command line, else
    ``option=value`` (strings quoted)."""
    if cli:
        return f"--{option} {value}"
    return f'{option}="{value}"' if not value[:1].isdigit() else f"{option}={value}"


def fmt_evidence(key: str) -> str:
    mean, lo, hi = EVIDENCE[key]
    return f"{mean:+.2f} points (95% interval {lo:+.2f} to {hi:+.2f})"


def recommendation(
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
    energy = spelt("lam", "0", cli)
    keep_all = spelt("allocation", "all", cli)
    per = budget / m_tasks
    study = "this project's regime study (encoder adapters, 7 tasks, ten seeds)"

    def budget_text(ref: str) -> str:
        if per <= TIGHT_PER_TASK:
            return (
                f"At this budget (about {per:.1f} directions per task and module) allocate "
                f"globally: in {ref}, at 2.3 directions per task and module, energy alone beat "
                f"the uniform split by {fmt_evidence('energy_vs_uniform_r16')}."
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
                f"changes {pct(changed_fraction)} of the kept directions), so Net Utility's "
                f"choice is energy down-weighting; it differs from energy alone in "
                f"{energy_changed} of {kept} kept directions"
            )
        )
        return True, (
            f"allocate by energy alone ({energy}): {why}. Energy alone needs no lambda, and in "
            f"{study} Net Utility minus energy alone at R = 16 was "
            f"{fmt_evidence('net_utility_vs_energy_r16')}. {budget_text('that study')}"
        )
    other = (
        ("the sign-aware term", "signed")
        if interference == "overlap"
        else ("the paper's term", "overlap")
    )
    others = [f"energy alone ({energy})", f"{other[0]} ({spelt('interference', other[1], cli)})"]
    near = math.isfinite(overlap) and 1 / OVERLAP_NEAR_CHANCE <= overlap <= OVERLAP_NEAR_CHANCE
    caveat = (
        f"; the input overlap is {overlap:.2g}x chance, so this may follow the noise of flat "
        "spectra rather than structure the tasks share"
        if near
        else ""
    )
    return False, (
        f"none: the interference term acts on this set's geometry (the rotation control changes "
        f"{pct(changed_fraction)} of the kept directions{caveat}). This project's planted study found "
        "the paper's sign-blind term helps where tasks conflict and costs as much where they "
        f"agree: compare this allocation with {' and '.join(others)} on held-out data."
    )
