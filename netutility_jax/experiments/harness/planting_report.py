"""The planted-interference study's report: every seed found, rendered as ``results.json`` and
``results.md`` (:func:`render`, :func:`write`).

Read-out (a) is the mean over seeds of each exact per-seed read-out. Over the seeds that
evaluated merges: (b) each merge's normalised accuracy, the victims' and all tasks', with the
bootstrap interval over test texts and the two-level interval (:mod:`stats`); (c) the deltas
of the registered comparisons (:data:`plants.PRIMARY_DELTAS`, with the Bonferroni t interval of
the registered decision rule) and the secondary ones, Holm's correction within each family, and
the headline (each primary contrast averaged over its cells).

Part of the harness; imports no model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import netutility_jax as nu

from . import planting_markdown as pmd
from . import stats as st
from .plants import (
    ALLOCATIONS,
    ARMS,
    BONFERRONI,
    BUDGETS,
    DATA_WEAKER_DELTAS,
    DATA_WEAKER_LEVEL,
    DATA_WEAKER_SECONDARY,
    HEADLINE,
    PRIMARY_DELTAS,
    REGISTERED_SEEDS,
    TOP,
)

__all__ = ["comparisons", "render", "write"]


def _t_quantile(df: int, level: float) -> float:
    """Student t quantile ``(1 + level) / 2`` with ``df`` degrees of freedom."""
    from scipy import stats as sps

    return float(sps.t.ppf((1 + level) / 2, df))


def _delta(bs: st.Bootstrap, correct_a, correct_b, single, level: float) -> dict[str, Any]:
    da, db = bs.normalized(correct_a, single), bs.normalized(correct_b, single)
    d = bs.delta(da, db)
    two = bs.two_level(da, db, seed=0)
    per = d.per_seed
    out = {
        "per_seed": [float(x) for x in per],
        "estimate": float(per.mean()),
        "text_ci95": [d.pooled.low, d.pooled.high],
        "seed_ci95": [d.seeds.low, d.seeds.high],
        "two_level_ci95": [two.low, two.high],
        "p_seeds": st.seed_p(per),
        # (B, S) resampled deltas, for the headline's mean over cells (popped before saving)
        "_boot": da.boot - db.boot,
    }
    if len(per) >= 2:
        half = _t_quantile(len(per) - 1, level) * float(per.std(ddof=1)) / math.sqrt(len(per))
        out["seed_ci_bonferroni"] = [float(per.mean() - half), float(per.mean() + half)]
    else:
        out["seed_ci_bonferroni"] = [float("nan"), float("nan")]
    return out


def _subset(task: np.ndarray, keep: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    rows = np.isin(task, keep)
    remap = {t: i for i, t in enumerate(keep)}
    return rows, np.array([remap[t] for t in task[rows]], np.int64)


def render(
    seeds: Sequence[tuple[dict[str, Any], dict[str, np.ndarray]]],
    *,
    command: str,
    n_boot: int = 2000,
):
    """``(results, markdown)`` of the seeds found (``planting.load_seeds``); ``n_boot`` text
    resamples (shared by every interval)."""
    if not seeds:
        raise nu.InputError("planted.render: no seed results to render.")
    recs = [r for r, _ in seeds]
    names, pairs, init = _design_of(recs)
    victims = [names.index(v) for v, _ in pairs]
    results = _header(recs, command=command, pairs=pairs, init=init)
    results["readout_a"], results["changed_between_allocations"] = _readout_a(recs)
    # (b), (c): over the seeds that evaluated every merge read
    with_acc = [(r, a) for r, a in seeds if r["records"] and "single" in a]
    acc: dict[str, Any] = {}
    deltas: dict[str, Any] = {}
    if with_acc:
        acc, deltas = _accuracy(with_acc, victims, n_boot)
        acc_seeds = [r["seed"] for r, _ in with_acc]
        results["accuracy_seeds"] = acc_seeds
        results["headline"] = _headline(deltas)
        results["multiplicity"] = _multiplicity(deltas, acc_seeds, init)
        for d in deltas.values():
            for side in ("victims", "mean"):
                d[side].pop("_boot")
    results["accuracy"] = acc
    results["deltas"] = deltas
    results = st.jsonable(results)
    return results, pmd.markdown(results)


def _design_of(recs: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[tuple], str]:
    """``(tasks, pairs, initialisation)`` the seeds share.

    Raises:
      InputError: seeds run with other tasks, pairs or initialisations.
    """
    names = recs[0]["tasks"]
    pairs = [tuple(p) for p in recs[0]["pairs"]]
    if any([tuple(p) for p in r["pairs"]] != pairs or r["tasks"] != names for r in recs):
        raise nu.InputError("planted.render: the seeds were run with different tasks or pairs.")
    # (seeds saved before the init was recorded ran the registered per-task initialisation)
    inits = {r.get("init") or "per_task" for r in recs}
    if len(inits) > 1:
        raise nu.InputError(f"planted.render: the seeds were run with initialisations {inits}.")
    return names, pairs, next(iter(inits))


def _header(
    recs: Sequence[Mapping[str, Any]], *, command: str, pairs: Sequence[tuple], init: str
) -> dict[str, Any]:
    """The results' provenance, design, seeds, CPU and wall time, and each seed's lambdas,
    diagnostics and merges."""
    return {
        "study": "planted",
        "suite": "encoder",
        "command": command,
        **dict(zip(("commit", "versions"), st.provenance(), strict=True)),
        "seed_commits": {str(r["seed"]): r.get("commit") for r in recs},
        "seed_commands": {str(r["seed"]): r.get("command") for r in recs},
        "design": {
            "pairs": [list(p) for p in pairs],
            "top": TOP,
            "arms": [dataclasses.asdict(a) for a in ARMS],
            "allocations": ALLOCATIONS,
            "budgets": list(BUDGETS),
            "merge": "TA, full space; coefficient chosen on validation (start 0.3)",
            "normaliser": "the unplanted single LoRAs",
            "init": init,
        },
        "seeds": [r["seed"] for r in recs],
        "cpu_hours": sum(r["seconds"]["cpu"] for r in recs) / 3600,
        "wall_hours": sum(r["seconds"]["total"] for r in recs) / 3600,
        "per_seed": {
            str(r["seed"]): {
                "lam": r["lam"],
                "diagnostics": r["diagnostics"],
                "merges": r["merges"],
                "seconds": r["seconds"],
            }
            for r in recs
        },
    }


def _readout_a(recs: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(read-out (a), changed between allocations)``: the mean over seeds of each read-out
    (exact per seed), per arm and merge, and each arm's allocation differences per seed. A
    merge that only some seeds have (an allocation added after the others were run) is the
    mean over those, whose numbers it lists under ``seeds``."""
    ra: dict[str, Any] = {}
    changed: dict[str, Any] = {}
    for arm in recs[0]["readout_a"]:
        if "_changed" in recs[0]["readout_a"][arm]:
            changed[arm] = {
                k: [r["readout_a"][arm]["_changed"][k] for r in recs]
                for k in recs[0]["readout_a"][arm]["_changed"]
            }
        merges = dict.fromkeys(m for r in recs for m in r["readout_a"][arm])
        for merge in merges:
            if merge.startswith("_"):
                continue
            have = [r for r in recs if merge in r["readout_a"][arm]]
            vals = {
                pair: {
                    k: [r["readout_a"][arm][merge]["pairs"][pair][k] for r in have]
                    for k in ("plant_kept", "victim_top_kept")
                }
                for pair in have[0]["readout_a"][arm][merge]["pairs"]
            }
            ra.setdefault(arm, {})[merge] = {
                "plant_kept": _mean_pairs(vals, "plant_kept"),
                "victim_top_kept": _mean_pairs(vals, "victim_top_kept"),
                "per_pair": vals,
                "seeds": [r["seed"] for r in have],
            }
    return ra, changed


#: The families of :func:`comparisons`: the registered study's primary comparisons, the
#: follow-up's (the data-aware asymmetric term, registered later) and its secondary ones, and
#: every other comparison (exploratory).
FAMILIES = ("primary", "data_weaker", "data_weaker_secondary", "secondary")


def comparisons() -> list[tuple[str, str, str, str | tuple[str, str], str]]:
    """Every comparison the report may show, the registered ones first: ``(label, arm, a, b,
    family)`` with ``a`` a merge of ``arm`` (``allocation/budget``), ``b`` one of ``arm`` or an
    ``(arm, merge)`` of another arm (the oracle: the unplanted set), and ``family`` one of
    :data:`FAMILIES`."""
    out = [(lab, arm, a, b, "primary") for lab, arm, a, b in PRIMARY_DELTAS]
    out += [(lab, arm, a, b, "data_weaker") for lab, arm, a, b in DATA_WEAKER_DELTAS]
    out += [(lab, arm, a, b, "data_weaker_secondary") for lab, arm, a, b in DATA_WEAKER_SECONDARY]
    for arm in ("conflict_g1", "agreement_g1", "null", "conflict_g0.5", "agreement_g0.5"):
        for r in ("R16", "R32"):
            for a in (
                "uniform", "net_utility", "lam_x4", "net_utility_data", "signed", "signed_weaker",
            ):  # fmt: skip
                out.append(
                    (f"{a} - energy, {arm}, {r}", arm, f"{a}/{r}", f"energy/{r}", "secondary")
                )
            # the asymmetric sign-aware term (ours, after the registration) against the symmetric
            out.append(
                (f"signed_weaker - signed, {arm}, {r}", arm, f"signed_weaker/{r}", f"signed/{r}",
                 "secondary")
            )  # fmt: skip
            if arm != "null":  # the oracle: Net Utility on the unplanted set
                for a in ("energy", "net_utility", "signed", "signed_weaker"):
                    out.append(
                        (
                            f"{a} - oracle, {arm}, {r}",
                            arm,
                            f"{a}/{r}",
                            ("null", f"net_utility/{r}"),
                            "secondary",
                        )
                    )
        for a in (
            "net_utility_pos", "signed_pos", "lam_x4_pos", "net_utility_data_pos",
            "signed_weaker_pos",
        ):  # fmt: skip
            out.append((f"{a} - keep-all, {arm}", arm, f"{a}/full", "all/full", "secondary"))
        out.append(
            (f"signed_weaker_pos - signed_pos, {arm}", arm, "signed_weaker_pos/full",
             "signed_pos/full", "secondary")
        )  # fmt: skip
        if arm != "null":
            out.append(
                (
                    f"keep-all - oracle keep-all, {arm}",
                    arm,
                    "all/full",
                    ("null", "all/full"),
                    "secondary",
                )
            )
    return out


def _accuracy(
    with_acc: Sequence[tuple[Mapping[str, Any], Mapping[str, np.ndarray]]],
    victims: Sequence[int],
    n_boot: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(accuracy, deltas)`` over the seeds ``with_acc`` (each merge they all evaluated): each
    merge's normalised accuracy and each comparison's delta (:func:`comparisons`), the
    victims' and all tasks'; one bootstrap of ``n_boot`` text resamples shared by all."""
    common = set.intersection(*(set(r["records"]) for r, _ in with_acc))
    task = with_acc[0][1]["task"]
    single = np.stack([a["single"] for _, a in with_acc])
    bs_all = st.Bootstrap(task, n_boot=n_boot)
    rows, vt = _subset(task, victims)
    bs_vic = st.Bootstrap(vt, n_boot=n_boot)

    def corr(label):
        return np.stack([a[f"c:{label}"] for _, a in with_acc])

    acc: dict[str, Any] = {}
    for label in sorted(common):
        c = corr(label)
        acc[label] = {
            "mean": _iv(bs_all, bs_all.normalized(c, single)),
            "victims": _iv(bs_vic, bs_vic.normalized(c[:, rows], single[:, rows])),
        }
    deltas: dict[str, Any] = {}
    done: set[tuple[str, str]] = set()
    levels = {"primary": BONFERRONI, "data_weaker": DATA_WEAKER_LEVEL}
    for lab, arm, a, b, family in comparisons():
        la = f"{arm}/{a}"
        lb = f"{b[0]}/{b[1]}" if isinstance(b, tuple) else f"{arm}/{b}"
        if la not in common or lb not in common or (la, lb) in done:
            continue  # (a secondary pairing that is a primary one is shown once)
        done.add((la, lb))
        ca, cb = corr(la), corr(lb)
        level = levels.get(family, 0.95)
        deltas[lab] = {
            "primary": family == "primary",
            "family": family,
            "a": la,
            "b": lb,
            "victims": _delta(bs_vic, ca[:, rows], cb[:, rows], single[:, rows], level),
            "mean": _delta(bs_all, ca, cb, single, level),
        }
    return acc, deltas


def _mean_pairs(vals: Mapping[str, Any], key: str) -> float | None:
    xs = [x for v in vals.values() for x in v[key] if x is not None]
    return float(np.mean(xs)) if xs else None


def _iv(bs: st.Bootstrap, draws: st.NormalizedDraws) -> dict[str, Any]:
    s = bs.interval(draws)
    two = bs.two_level(draws, seed=0)
    return {
        "estimate": s.pooled.estimate,
        "text_ci95": [s.pooled.low, s.pooled.high],
        "seed_ci95": [s.seeds.low, s.seeds.high],
        "two_level_ci95": [two.low, two.high],
        "per_seed": [float(x) for x in s.per_seed],
    }


def _headline(deltas: Mapping[str, Any]) -> dict[str, Any]:
    """Per primary contrast, the mean over its cells per seed, with the t interval over seeds and
    the two-level interval (the cells share the seeds and the test texts, so a replicate averages
    the cells' resampled deltas on the same texts and seeds)."""
    out: dict[str, Any] = {}
    for name, prefix in HEADLINE:
        for scope, arms in (
            ("all four primary cells", ("conflict", "agreement")),
            ("conflict arm (R16, full capacity)", ("conflict",)),
            ("agreement arm (R16, full capacity)", ("agreement",)),
        ):
            cells = [
                lab
                for lab, *_ in PRIMARY_DELTAS
                if lab.startswith(prefix + ",") and lab.split(", ")[1] in arms
            ]
            if not cells or any(c not in deltas for c in cells):
                continue
            row: dict[str, Any] = {"cells": cells}
            for side in ("victims", "mean"):
                per = np.mean([deltas[c][side]["per_seed"] for c in cells], axis=0)
                boot = np.mean([deltas[c][side]["_boot"] for c in cells], axis=0)
                seed_iv = st.seed_interval(per)
                two = st.two_level(per, boot, seed=0)
                row[side] = {
                    "per_seed": [float(x) for x in per],
                    "estimate": seed_iv.estimate,
                    "seed_ci95": [seed_iv.low, seed_iv.high],
                    "two_level_ci95": [two.low, two.high],
                }
            out[f"{name}, {scope}"] = row
    return out


def _not_applied(acc_seeds: Sequence[int], init: str) -> str:
    """Why the registered rule decides nothing here: another initialisation than the registered
    per-task one, or accuracy on other seeds than the five registered ones (counted)."""
    if init != "per_task":
        return f"not applied: {init} initialisation, outside the registration"
    n_reg = len(set(acc_seeds) & set(REGISTERED_SEEDS))
    outside = sorted(set(acc_seeds) - set(REGISTERED_SEEDS))
    return f"not applied: accuracy on {n_reg} of the 5 registered seeds" + (
        f", and on seed{'s' if len(outside) > 1 else ''} {', '.join(map(str, outside))} "
        "outside the registration"
        if outside
        else ""
    )


def _multiplicity(
    deltas: dict[str, Any], acc_seeds: Sequence[int], init: str = "per_task"
) -> dict[str, Any]:
    """Holm within each family: the registered study's primary comparisons (their victims'
    outcome), the follow-up's two primary comparisons (likewise) and its secondary family (its
    secondary comparisons' outcomes and its primary ones' all-tasks outcome), and every other
    delta shown (one family); the registered decisions (each registration's Bonferroni t
    interval over the five registered seeds) where every registered seed has accuracy. Writes
    ``p_holm``/``holm_reject``/``decision`` into the deltas."""
    fams: dict[str, dict[str, Any]] = {f: {} for f in FAMILIES}
    where: dict[tuple[str, str], str] = {}
    for lab, d in deltas.items():
        fam = pmd.family_of(d)
        for side in ("victims", "mean"):
            f = fam
            if side == "mean" and fam in ("primary", "data_weaker"):
                f = "data_weaker_secondary" if fam == "data_weaker" else "secondary"
            fams[f][f"{lab} | {side}"] = d[side]["p_seeds"]
            where[(lab, side)] = f
    holm = {f: st.holm(ps) for f, ps in fams.items()}
    registered = init == "per_task" and sorted(acc_seeds) == list(REGISTERED_SEEDS)
    for lab, d in deltas.items():
        for side in ("victims", "mean"):
            h = holm[where[(lab, side)]][f"{lab} | {side}"]
            d[side]["p_holm"] = h["p_holm"]
            d[side]["holm_reject"] = h["reject"]
        if pmd.family_of(d) in ("primary", "data_weaker"):
            lo, hi = d["victims"]["seed_ci_bonferroni"]
            d["decision"] = (
                ("gain" if lo > 0 else "loss" if hi < 0 else "no difference declared")
                if registered
                else _not_applied(acc_seeds, init)
            )

    def count(f):
        return sum(not math.isnan(float(v)) for v in fams[f].values())

    def kept(f):
        return [k.removesuffix(" | victims") if f in ("primary", "data_weaker") else k
                for k, v in holm[f].items() if v["reject"]]  # fmt: skip

    return {
        "primary_family": count("primary"),
        "primary_holm_survivors": kept("primary"),
        "data_weaker_family": count("data_weaker"),
        "data_weaker_holm_survivors": kept("data_weaker"),
        "data_weaker_secondary_family": count("data_weaker_secondary"),
        "data_weaker_secondary_holm_survivors": kept("data_weaker_secondary"),
        "secondary_family": count("secondary"),
        "secondary_holm_survivors": kept("secondary"),
        "registered_rule_applied": registered,
        "registered_rule": "applied" if registered else _not_applied(acc_seeds, init),
    }


def write(out: pathlib.Path, results: Mapping[str, Any], markdown: str) -> list[str]:
    """``results.json`` and ``results.md`` under ``out`` (atomically; rewritten as seeds come)."""
    out.mkdir(parents=True, exist_ok=True)
    st.write_atomic(out / "results.json", json.dumps(results, indent=1, allow_nan=False) + "\n")
    st.write_atomic(out / "results.md", markdown)
    return [str(out / "results.json"), str(out / "results.md")]
