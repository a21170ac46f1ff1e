"""The planted-interference study's report as markdown (``results.md``), from the results dict
:func:`planting_report.render` computes: the manipulation check, read-out (a), how far apart
the allocations choose, and, where merges were evaluated, the headline, each merge's
normalised accuracy and the deltas with their multiplicity.

Part of the harness; imports no model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .plants import BONFERRONI, DATA_WEAKER_LEVEL

__all__ = ["family_of", "markdown"]


def _f(x: Any, nd: int = 1, sign: bool = False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"


def _p(x: Any) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.3f}" if x >= 0.001 else "<0.001"


def _ci(v: Sequence[Any], sign: bool = True) -> str:
    return f"[{_f(v[0], 1 + sign, sign)}, {_f(v[1], 1 + sign, sign)}]"


def markdown(res: Mapping[str, Any]) -> str:
    """``results.md`` of the study's results (``planting_report.render``)."""
    lines = [*_manipulation_check(res), *_readout_a(res), *_changed(res)]
    if res["accuracy"]:
        lines += [*(_headline(res) if res.get("headline") else []), *_accuracy(res)]
        lines += _deltas(res)
    else:
        lines += ["", "No merge was evaluated for accuracy (read-out (a) only)."]
    lines.append("")
    return "\n".join(lines)


def _manipulation_check(res: Mapping[str, Any]) -> list[str]:
    """The title, where the results came from, the design, and the manipulation check (the
    random-rotation control per arm and seed)."""
    seeds = res["seeds"]
    lines = [
        "# The planted-interference study (this project's design, pre-registered in docs/experiments.md)",
        "",
        f"Written by `{res['command']}` (commit {(res['commit'] or {}).get('head')}); seeds "
        f"{', '.join(map(str, seeds))} (read-out (a)); accuracy on seeds "
        f"{', '.join(map(str, res.get('accuracy_seeds', []))) or 'none'}; "
        f"{res['cpu_hours']:.2f} CPU hours, {res['wall_hours']:.2f} wall hours over the seeds' processes.",
        "",
        f"LoRA initialisation: {res['design']['init']}. Victim -> carrier pairs: "
        + "; ".join(f"{v} -> {c}" for v, c in res["design"]["pairs"])
        + f". The victim's top {res['design']['top']} components of every module are appended to "
        "its carrier scaled by -gamma (conflict) or +gamma (agreement). TA in full space, the "
        "coefficient chosen on validation; normalised against the unplanted single LoRAs.",
        "",
        "## Manipulation check: the random-rotation control at R = 16",
        "",
        "The fraction of Net Utility's kept directions that change when every task's input side "
        "is rotated at random (nu.diagnose), and (in brackets) the input overlap over chance. "
        "Pre-registered: the plant counts as seen if, at gamma = 1, the fraction is at least 3x "
        "the null arm's in the mean over seeds, in both planted arms.",
        "",
        "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|" + "---|" * len(seeds),
    ]
    for arm in res["per_seed"][str(seeds[0])]["diagnostics"]:
        row = []
        for s in seeds:
            d = res["per_seed"][str(s)]["diagnostics"][arm]
            row.append(
                f"{100 * d['rotation_changed_fraction']:.1f}% ({d['overlap_vs_chance']:.2f}x)"
            )
        lines.append(f"| {arm} | " + " | ".join(row) + " |")
    return lines


def _readout_a(res: Mapping[str, Any]) -> list[str]:
    """Read-out (a): the planted directions each merge keeps, per arm."""
    lines = [
        "",
        "## (a) Planted directions kept (exact; mean over pairs and seeds)",
        "",
        "Fraction of each plant's energy inside the kept singular directions of its carrier, and "
        "(in brackets) the fraction of the victims' own top-2 directions kept.",
        "",
    ]
    ra = res["readout_a"]
    merges = list(dict.fromkeys(m for arm in ra.values() for m in arm))
    every = {s for arm in ra.values() for x in arm.values() for s in x.get("seeds", ())}
    lines.append("| merge | " + " | ".join(ra) + " |")
    lines.append("|---|" + "---|" * len(ra))
    for m in merges:
        cells = []
        seeds: set = set()
        for arm in ra:
            x = ra[arm].get(m)
            seeds |= set(x.get("seeds", ())) if x is not None else set()
            cells.append(
                "n/a" if x is None else f"{_f(x['plant_kept'], 2)} ({_f(x['victim_top_kept'], 2)})"
            )
        only = f" (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, sorted(seeds)))} only)"
        lines.append(f"| {m}{only if seeds < every else ''} | " + " | ".join(cells) + " |")
    return lines


def _changed(res: Mapping[str, Any]) -> list[str]:
    """How far apart the allocations choose (none when the results do not have it)."""
    ch = res.get("changed_between_allocations") or {}
    if not ch:
        return []
    keys = list(next(iter(ch.values())))
    lines = [
        "",
        "## How far apart the allocations choose (exact)",
        "",
        "Directions whose kept status differs between two allocations, over the directions "
        "both keep together (symmetric difference / (kept_a + kept_b)), mean over seeds.",
        "",
        "| arm | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for arm, v in ch.items():
        lines.append(
            f"| {arm} | " + " | ".join(f"{100 * float(np.mean(v[k])):.1f}%" for k in keys) + " |"
        )
    return lines


def _headline(res: Mapping[str, Any]) -> list[str]:
    """Each primary contrast over the primary cells, per seed and over seeds."""
    acc_seeds = res.get("accuracy_seeds", [])
    lines = [
        "",
        "## Headline: each primary contrast over the primary cells",
        "",
        "Per seed, the mean of the contrast over its cells (gamma = 1; R16 and full capacity; "
        "the conflict and agreement arms together and each alone), then the mean over the "
        f"{len(acc_seeds)} seeds with the t interval over seeds (95%) and the two-level "
        "bootstrap interval (seeds and test texts resampled together; 95%). Victims' "
        "normalised accuracy, and all tasks'.",
        "",
        "| contrast, cells | victims | per seed | seed 95% | two-level 95% | all tasks | "
        "seed 95% | two-level 95% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lab, h in (res.get("headline") or {}).items():
        v, m = h["victims"], h["mean"]
        lines.append(
            f"| {lab} | {_f(v['estimate'], 2, True)} | "
            f"{', '.join(_f(x, 1, True) for x in v['per_seed'])} | {_ci(v['seed_ci95'])} | "
            f"{_ci(v['two_level_ci95'])} | {_f(m['estimate'], 2, True)} | "
            f"{_ci(m['seed_ci95'])} | {_ci(m['two_level_ci95'])} |"
        )
    return lines


def _accuracy(res: Mapping[str, Any]) -> list[str]:
    """Read-out (b): each merge's normalised accuracy, the victims' and all tasks'."""
    lines = [
        "",
        "## (b) Normalised accuracy of each merge",
        "",
        "Mean over seeds; the victims' (mean over the victims) and all tasks'; the 95% "
        "bootstrap interval over test texts (adapters fixed) and the two-level interval "
        "(seeds and texts).",
        "",
        "| merge | victims | texts 95% | two-level 95% | all tasks | texts 95% | two-level 95% |",
        "|---|---|---|---|---|---|---|",
    ]
    for lab, v in res["accuracy"].items():
        vi, me = v["victims"], v["mean"]
        lines.append(
            f"| {lab} | {_f(vi['estimate'])} | {_ci(vi['text_ci95'], False)} | "
            f"{_ci(vi.get('two_level_ci95', [None, None]), False)} | {_f(me['estimate'])} | "
            f"{_ci(me['text_ci95'], False)} | "
            f"{_ci(me.get('two_level_ci95', [None, None]), False)} |"
        )
    return lines


_ORDER = ("primary", "data_weaker", "data_weaker_secondary", "secondary")


def family_of(d: Mapping[str, Any]) -> str:
    """A delta's family (:data:`planting_report.FAMILIES`); a delta rendered before the families
    were recorded is the study's primary comparison or a secondary one."""
    return d.get("family", "primary" if d["primary"] else "secondary")


def _survivors(names: Sequence[str]) -> str:
    return "; ".join(names) if names else "none"


def _multiplicity(res: Mapping[str, Any]) -> str:
    """The multiplicity paragraph: each family shown, its size, its decision rule and what
    Holm keeps."""
    mult = res.get("multiplicity") or {}
    rule = (
        "" if mult.get("registered_rule_applied")
        else f" ({mult.get('registered_rule', 'not applied')})"
    )  # fmt: skip
    parts = []
    if mult.get("primary_family"):
        parts.append(
            f"{mult['primary_family']} primary comparisons (the victims' outcome, registered): "
            f"the registered decision is the Bonferroni t interval over the five registered "
            f"seeds{rule}; Holm at family-wise 5% over the {mult['primary_family']} keeps "
            f"{_survivors(mult.get('primary_holm_survivors', []))}."
        )
    if mult.get("data_weaker_family"):
        parts.append(
            f"The follow-up registered for the asymmetric term with the data-aware shares: "
            f"{mult['data_weaker_family']} primary comparisons (the victims' outcome), decided "
            f"by the t interval over the five registered seeds at "
            f"{100 * DATA_WEAKER_LEVEL:.1f}% (Bonferroni over its two){rule}; Holm over them "
            f"keeps {_survivors(mult.get('data_weaker_holm_survivors', []))}. Its secondary "
            f"family ({mult.get('data_weaker_secondary_family', 0)} deltas: its secondary "
            "comparisons, both outcomes, and its primary ones' all-tasks outcome): Holm keeps "
            f"{_survivors(mult.get('data_weaker_secondary_holm_survivors', []))}."
        )
    surv_s = mult.get("secondary_holm_survivors", [])
    parts.append(
        f"The other {mult.get('secondary_family', 0)} deltas shown (comparisons outside the "
        "registrations, and the all-tasks outcome of the registered study's) are one family: "
        f"Holm keeps {len(surv_s)} of them"
        + (f" ({'; '.join(surv_s)})" if surv_s else "")
        + ". Read any other delta as exploratory."
    )
    return "**Multiplicity.** " + " ".join(parts)


def _deltas(res: Mapping[str, Any]) -> list[str]:
    """The deltas, registered comparisons first, with their intervals, p-values, Holm's
    correction and the registered decisions."""
    acc_seeds = res.get("accuracy_seeds", [])
    lines = [
        "",
        "## Deltas (registered comparisons first)",
        "",
        "Victims' normalised accuracy (and all tasks'), mean over seeds (per seed in the order "
        f"{', '.join(map(str, acc_seeds))}): the paired bootstrap 95% interval over test "
        "texts (adapters fixed), the t interval over seeds (95%; for a registration's primary "
        f"comparisons also at its Bonferroni level: {100 * BONFERRONI:.3f}% for the study's "
        f"eight, {100 * DATA_WEAKER_LEVEL:.1f}% for the follow-up's two), the two-level "
        "interval (seeds and texts resampled together, 95%), the two-sided p of the t test "
        "over seeds and its Holm-adjusted value within its family. With fewer than two seeds "
        "there is no seed interval; the text interval alone does not include the seed noise "
        "and decides nothing under the pre-registered rule. With three to five seeds the "
        "two-level (percentile) interval has no small-sample correction and is often "
        "narrower than the t interval over seeds: it shows how much the test texts add, "
        "and the registered rule reads the t interval.",
        "",
        _multiplicity(res),
        "",
        "| comparison | victims | per seed | text 95% | seed 95% | two-level 95% | seed "
        "Bonferroni | p | Holm p | decision | all tasks | all tasks text 95% | all tasks "
        "two-level 95% |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lab, d in sorted(res["deltas"].items(), key=lambda kv: _ORDER.index(family_of(kv[1]))):
        v, m = d["victims"], d["mean"]
        registered = family_of(d) in ("primary", "data_weaker")
        bold = "**" if registered else ""
        lines.append(
            f"| {bold}{lab}{bold} | {_f(v['estimate'], 2, True)} | "
            f"{', '.join(_f(x, 1, True) for x in v['per_seed'])} | "
            f"{_ci(v['text_ci95'])} | {_ci(v['seed_ci95'])} | "
            f"{_ci(v.get('two_level_ci95', [None, None]))} | "
            f"{_ci(v['seed_ci_bonferroni']) if registered else ''} | "
            f"{_p(v.get('p_seeds'))} | {_p(v.get('p_holm'))} | {d.get('decision', '')} | "
            f"{_f(m['estimate'], 2, True)} | {_ci(m['text_ci95'])} | "
            f"{_ci(m.get('two_level_ci95', [None, None]))} |"
        )
    return lines
