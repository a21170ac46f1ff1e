"""``python -m netutility_jax.experiments.regime_seeds``: the regime study's seeds pooled across
runs (seeds 3-9 of the centre and per-task cells beside the committed 0-2).

Each ``study.json`` given (``netutility demo --study regime [--cells ...] --seeds ...``) holds
per seed, per cell and budget, the normalized accuracy of uniform, Net Utility and the
data-aware merge and Net Utility's deltas to uniform and to energy; from them this computes,
per seed, energy - uniform, Net Utility - uniform, Net Utility - energy, data-aware - uniform
and data-aware - energy, then over seeds the mean with its t interval, per cell and for the
grid (the mean over the cells every seed has, per seed: the headline). Nothing is re-run; the
sources' commits, commands and CPU time are recorded. Writes ``results.json`` and
``results.md``.

Beside the t interval over seeds, each mean has a two-level interval (seeds and test texts
resampled together, :func:`stats.two_level_normal`). The ``study.json`` files keep no per-text
correctness, only each seed's delta and its bootstrap interval over texts, so the text noise of
a seed is drawn as a normal with the standard error that interval implies, independent across
the seeds of a replicate (:data:`RHO`: the planted study, which saved per-text correctness on
the same suite, measures the correlation of a delta's text-resampled values across seeds at
-0.04 to 0.17), with the fully correlated case (``rho = 1``) reported beside the headline as the
bound; the two cells of the grid row share one draw (the mean of their standard errors).
Energy - uniform and data - energy are differences of saved deltas; their standard error is
bounded by the sum of the parts' (``sd(X - Y) <= sd(X) + sd(Y)``), the wider choice.
Multiplicity: every delta of the tables is one family; each has the p-value of its t test over
seeds and Holm's adjustment over the family.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .harness import stats as st

__all__ = ["COMPARISONS", "PROG", "main", "markdown", "per_seed", "per_seed_se", "pool"]

PROG = "python -m netutility_jax.experiments.regime_seeds"
CELLS = ("centre", "init=per_task")
BUDGETS = ("16", "32")
#: The correlation across seeds of the text noise in the two-level interval (module docstring).
RHO = 0.0
COMPARISONS = (
    "energy - uniform",
    "net_utility - uniform",
    "net_utility - energy",
    "data - uniform",
    "data - energy",
)


def _saved(study: Mapping[str, Any], cells: Sequence[str]):
    """``(cell, budget, i, seed, allocation)`` of every seed of every budget of ``cells`` in one
    ``study.json`` (``allocation``: the budget's saved deltas, ``i``: the seed's index in them)."""
    for c in study["cells"]:
        if c["cell"] not in cells:
            continue
        for b in BUDGETS:
            a = c["allocation"].get(b)
            if a is None:
                continue
            for i, seed in enumerate(c["seeds"]):
                yield c["cell"], b, i, int(seed), a


def per_seed(study: Mapping[str, Any], cells: Sequence[str] = CELLS) -> dict[str, Any]:
    """``{cell: {budget: {seed: {comparison: value}}}}`` of one ``study.json``."""
    out: dict[str, Any] = {}
    for cell, b, i, seed, a in _saved(study, cells):
        nu_u = a["net_utility_minus_uniform"]["per_seed"][i]
        nu_e = a["net_utility_minus_energy"]["per_seed"][i]
        vals = {
            "energy - uniform": nu_u - nu_e,
            "net_utility - uniform": nu_u,
            "net_utility - energy": nu_e,
        }
        if "net_utility_data_minus_uniform" in a:
            d_u = a["net_utility_data_minus_uniform"]["per_seed"][i]
            vals["data - uniform"] = d_u
            vals["data - energy"] = d_u - (nu_u - nu_e)
        out.setdefault(cell, {}).setdefault(b, {})[seed] = vals
    return out


def _se(entry: Mapping[str, Any] | None, i: int) -> float | None:
    """The text standard error of seed ``i`` of a saved delta (from its bootstrap interval)."""
    if entry is None:
        return None
    cis = entry.get("per_seed_bootstrap_ci")
    if not cis or i >= len(cis) or cis[i] is None or None in cis[i]:
        return None
    return st.se_from_interval(*cis[i])


def _sum(*xs: float | None) -> float | None:
    return None if any(x is None for x in xs) else float(sum(xs))  # type: ignore[arg-type]


def per_seed_se(study: Mapping[str, Any], cells: Sequence[str] = CELLS) -> dict[str, Any]:
    """``{cell: {budget: {seed: {comparison: text standard error or None}}}}`` of one
    ``study.json``, from each saved delta's per-seed bootstrap interval (a derived delta: the sum
    of its parts', an upper bound)."""
    out: dict[str, Any] = {}
    for cell, b, i, seed, a in _saved(study, cells):
        nu_u = _se(a.get("net_utility_minus_uniform"), i)
        nu_e = _se(a.get("net_utility_minus_energy"), i)
        vals = {
            "energy - uniform": _sum(nu_u, nu_e),
            "net_utility - uniform": nu_u,
            "net_utility - energy": nu_e,
        }
        if "net_utility_data_minus_uniform" in a:
            d_u = _se(a.get("net_utility_data_minus_uniform"), i)
            d_nu = _se(a.get("net_utility_data_minus_net_utility"), i)
            vals["data - uniform"] = d_u
            vals["data - energy"] = _sum(d_nu, nu_e)
        out.setdefault(cell, {}).setdefault(b, {})[seed] = vals
    return out


def pool(sources: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The pooled results of ``(path, study.json)`` pairs; a seed in two sources is an error."""
    meta, table, ses = _read(sources)
    summary = _cells(table, ses)
    grid = _grid(table, ses)
    return {
        "sources": meta,
        "per_seed": table,
        "per_seed_text_se": ses,
        "cells": summary,
        "grid": grid,
        "multiplicity": _holm(summary, grid),
    }


def _read(
    sources: Sequence[tuple[str, Mapping[str, Any]]],
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """``(sources, values, text standard errors)``: each source's seeds, cells, commit, command
    and CPU hours, and ``{cell: {budget: {seed: {comparison: ...}}}}`` over every source."""
    table: dict[str, Any] = {}
    ses: dict[str, Any] = {}
    seen: dict[int, str] = {}
    meta = []
    for path, study in sources:
        ps = per_seed(study)
        seeds = sorted({s for cell in ps.values() for b in cell.values() for s in b})
        for s in seeds:
            if s in seen:
                raise SystemExit(f"{PROG}: seed {s} is in both {seen[s]} and {path}")
            seen[s] = path
        cpu = sum((c["seconds"].get("total_cpu") or 0.0) for c in study["cells"])
        meta.append(
            {
                "path": path,
                "seeds": seeds,
                "cells": [c["cell"] for c in study["cells"]],
                "commit": study.get("commit"),
                "command": study.get("command"),
                "cpu_hours": cpu / 3600 if cpu else None,
            }
        )
        for cell, per_b in ps.items():
            for b, per_s in per_b.items():
                table.setdefault(cell, {}).setdefault(b, {}).update(per_s)
        for cell, per_b in per_seed_se(study).items():
            for b, per_s in per_b.items():
                ses.setdefault(cell, {}).setdefault(b, {}).update(per_s)
    return meta, table, ses


def _cells(table: Mapping[str, Any], ses: Mapping[str, Any]) -> dict[str, Any]:
    """``{cell: {budget: {comparison: interval}}}`` over the seeds of each cell."""
    summary: dict[str, Any] = {}
    for cell, per_b in table.items():
        for b, per_s in per_b.items():
            for comp in COMPARISONS:
                vals = {s: v[comp] for s, v in sorted(per_s.items()) if comp in v}
                se = {s: ses.get(cell, {}).get(b, {}).get(s, {}).get(comp) for s in vals}
                summary.setdefault(cell, {}).setdefault(b, {})[comp] = _iv(vals, se)
    return summary


def _grid(table: Mapping[str, Any], ses: Mapping[str, Any]) -> dict[str, Any]:
    """``{budget: {comparison: interval}}`` of the grid: per seed, the mean of the cells."""
    grid: dict[str, Any] = {}
    for b in BUDGETS:
        for comp in COMPARISONS:
            per_cell = {
                c: {
                    s: v[comp]
                    for s, v in table.get(c, {}).get(b, {}).items()
                    if v.get(comp) is not None
                }
                for c in CELLS
            }
            by_seed, _ = st.grid_headline(per_cell)
            # the two cells' text noise: perfectly correlated (the same texts), so the mean's
            # standard error is the mean of the cells' (None if a cell's is missing)
            se = {}
            for s in by_seed:
                parts = [ses.get(c, {}).get(b, {}).get(s, {}).get(comp) for c in CELLS]
                se[s] = None if any(p is None for p in parts) else float(np.mean(parts))
            grid.setdefault(b, {})[comp] = _iv(by_seed, se)
    return grid


def _holm(summary: Mapping[str, Any], grid: Mapping[str, Any]) -> dict[str, Any]:
    """Holm's correction over every delta of the tables (one family): each interval's
    ``p_holm`` and ``holm_reject`` are set; returns the family's size and survivors."""

    def rows(b: str, comp: str):
        return [
            *((c, summary.get(c, {}).get(b, {}).get(comp)) for c in CELLS),
            ("grid", grid[b][comp]),
        ]

    family = {
        f"{row} | R{b} | {comp}": iv["p_seeds"]
        for b in BUDGETS
        for comp in COMPARISONS
        for row, iv in rows(b, comp)
        if iv is not None and iv["p_seeds"] is not None
    }
    holm = st.holm(family)
    for b in BUDGETS:
        for comp in COMPARISONS:
            for row, iv in rows(b, comp):
                if iv is not None:
                    h = holm.get(f"{row} | R{b} | {comp}")
                    iv["p_holm"] = None if h is None else h["p_holm"]
                    iv["holm_reject"] = bool(h and h["reject"])
    return {
        "family": len(family),
        "holm_survivors": [k for k, v in holm.items() if v["reject"]],
        "registered": "grid | R16 | energy - uniform",
    }


def _iv(vals: Mapping[int, float], se: Mapping[int, float | None] | None = None) -> dict[str, Any]:
    iv = st.seed_interval(list(vals.values())) if vals else None
    two = None
    if vals and se is not None and all(se.get(s) is not None for s in vals):
        two = st.two_level_normal(list(vals.values()), [se[s] for s in vals], seed=0, rho=RHO)
        bound = st.two_level_normal(list(vals.values()), [se[s] for s in vals], seed=0, rho=1.0)
    p = st.seed_p(list(vals.values())) if len(vals) >= 2 else None
    return {
        "per_seed": {str(s): float(v) for s, v in vals.items()},
        "n": len(vals),
        "estimate": None if iv is None else iv.estimate,
        "seed_ci95": None if iv is None else [iv.low, iv.high],
        "two_level_ci95": None if two is None else [two.low, two.high],
        "two_level_rho1_ci95": None if two is None else [bound.low, bound.high],
        "p_seeds": p,
        "positive_seeds": sum(v > 0 for v in vals.values()),
    }


def _f(x: Any, nd: int = 2) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:+.{nd}f}"


def _ivs(iv: Mapping[str, Any] | None, holm: bool = True) -> str:
    """``estimate [seed interval] {two-level interval} (k/n seeds > 0)``, a dagger where the
    Holm-adjusted p is below 5%."""
    if not iv or not iv["n"]:
        return "n/a"
    ci = iv["seed_ci95"]
    two = iv.get("two_level_ci95") or [None, None]
    mark = " †" if holm and iv.get("holm_reject") else ""
    return (
        f"{_f(iv['estimate'])} [{_f(ci[0])}, {_f(ci[1])}] {{{_f(two[0])}, {_f(two[1])}}} "
        f"({iv['positive_seeds']}/{iv['n']}){mark}"
    )


def markdown(res: Mapping[str, Any]) -> str:
    """``results.md`` of the pooled results (:func:`pool`, with the command and commit)."""
    return "\n".join([*_headline(res), *_tables(res), *_per_seed_lines(res)])


def _headline(res: Mapping[str, Any]) -> list[str]:
    """The title, the headline (the grid's energy - uniform), how to read the entries, the
    multiplicity, and the sources."""
    mult = res.get("multiplicity") or {}
    g16 = res["grid"]["16"]["energy - uniform"]
    seeds16 = sorted(int(s) for s in g16["per_seed"])
    lines = [
        "# Regime study: the centre and per-task cells pooled over seeds",
        "",
        f"Written by `{res['command']}` (commit {(res['commit'] or {}).get('head')}) from the "
        "study.json files below; nothing re-run. Normalized accuracy (TA, full space).",
        "",
        "## Headline (the grid: the mean of the two cells, per seed)",
        "",
        f"Energy - uniform at R = 16, the question asked before seeds 3-9 ran: "
        f"{_ivs(g16, holm=False)} over seeds {', '.join(map(str, seeds16))} (per seed "
        + ", ".join(f"{_f(v)}" for v in g16["per_seed"].values())
        + "); the two-level interval with the text noise fully correlated across seeds (the "
        "bound): "
        + "[{}, {}]".format(*(_f(x) for x in (g16.get("two_level_rho1_ci95") or [None, None])))
        + ". At R = 32: "
        + _ivs(res["grid"]["32"]["energy - uniform"], holm=False)
        + ".",
        "",
        "Each entry: mean over seeds, [the t interval over seeds, 95%], {the two-level interval, "
        "95%: seeds and test texts resampled together}, (seeds with a positive delta / seeds). "
        "The t interval holds the adapters' (training) noise, not the test texts' (the same "
        "texts for every seed); the two-level interval holds both, but the study.json files "
        "keep no per-text correctness: each seed's text noise is a normal with the standard "
        "error its saved bootstrap interval implies, independent across seeds (the planted "
        "study, with per-text correctness on the same suite, measures a correlation of "
        "-0.04 to 0.17), shared by the two cells of the grid, and for energy - uniform and data - "
        "energy (differences of saved deltas) the sum of the parts' standard errors (an upper "
        "bound). With six "
        "to eight seeds a percentile bootstrap over seeds has no small-sample correction, so "
        "it can be narrower than the t interval; read the wider of the two.",
        "",
        f"**Multiplicity.** The tables hold {mult.get('family', 0)} deltas ({len(COMPARISONS)} "
        f"comparisons x {len(BUDGETS)} budgets x {len(CELLS)} cells and the grid), one family: "
        "† marks those whose t-test p over seeds survives Holm's correction at family-wise 5% "
        f"({len(mult.get('holm_survivors', []))}: "
        + ("; ".join(mult.get("holm_survivors", [])) or "none")
        + "). Only the registered question (grid, R = 16, energy - uniform) is read as a test; "
        "every other delta is exploratory.",
        "",
        "| source | seeds | cells | commit | CPU hours | command |",
        "|---|---|---|---|---|---|",
    ]
    for m in res["sources"]:
        cpu = m["cpu_hours"]
        lines.append(
            f"| {m['path']} | {', '.join(map(str, m['seeds']))} | {len(m['cells'])} | "
            f"{((m['commit'] or {}).get('head') or '')[:10]} | "
            f"{'n/a' if cpu is None else f'{cpu:.2f}'} | `{m['command']}` |"
        )
    return lines


def _tables(res: Mapping[str, Any]) -> list[str]:
    """Per budget, every comparison in each cell and the grid."""
    lines: list[str] = []
    for b in BUDGETS:
        lines += [
            "",
            f"## R = {b}",
            "",
            "| comparison | " + " | ".join(CELLS) + " | grid (mean of the cells) |",
            "|---|---|---|---|",
        ]
        for comp in COMPARISONS:
            cells = [
                _ivs(iv)
                for iv in [
                    *(res["cells"].get(c, {}).get(b, {}).get(comp) for c in CELLS),
                    res["grid"][b][comp],
                ]
            ]
            lines.append(f"| {comp} | " + " | ".join(cells) + " |")
    return lines


def _per_seed_lines(res: Mapping[str, Any]) -> list[str]:
    """Energy - uniform seed by seed, per budget and cell."""
    lines = ["", "## Per seed", ""]
    for b in BUDGETS:
        seeds = sorted({int(s) for s in res["grid"][b]["energy - uniform"]["per_seed"]})
        lines += [
            f"R = {b}, energy - uniform: "
            + "; ".join(
                f"{c}: "
                + ", ".join(
                    f"s{s} {_f(res['cells'][c][b]['energy - uniform']['per_seed'].get(str(s)))}"
                    for s in seeds
                )
                for c in CELLS
                if c in res["cells"]
            ),
            "",
        ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="+", metavar="STUDY_JSON")
    p.add_argument("--out", required=True, metavar="DIR")
    args = p.parse_args(argv)
    sources = []
    for path in args.studies:
        try:
            sources.append((path, json.loads(pathlib.Path(path).read_text())))
        except (OSError, ValueError) as e:
            print(f"{PROG}: error: {path}: {e}", file=sys.stderr)
            return 2
    res = pool(sources)
    commit, versions = st.provenance()
    res = {
        "command": shlex.join(["python", "-m", "netutility_jax.experiments.regime_seeds", *argv]),
        "commit": commit,
        "versions": versions,
        **res,
    }
    res = st.jsonable(res)
    out = pathlib.Path(args.out)
    st.write_atomic(out / "results.json", json.dumps(res, indent=1, allow_nan=False) + "\n")
    st.write_atomic(out / "results.md", markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
