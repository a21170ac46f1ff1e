"""``python -m netutility_jax.experiments.regime_seeds``: the regime study's seeds pooled across
runs (issue 44 item 3: seeds 3-9 of the centre and per-task cells beside the committed 0-2).

Each ``study.json`` given (``netutility demo --study regime [--cells ...] --seeds ...``) holds
per seed, per cell and budget, the normalized accuracy of uniform, Net Utility and the
data-aware merge and Net Utility's deltas to uniform and to energy; from them this computes,
per seed, energy - uniform, Net Utility - uniform, Net Utility - energy, data-aware - uniform
and data-aware - energy, then over seeds the mean with its t interval, per cell and for the
grid (the mean over the cells every seed has, per seed). Nothing is re-run; the sources'
commits, commands and CPU time are recorded. Writes ``results.json`` and ``results.md``.
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

from .. import _io, _provenance
from .harness import stats as st

__all__ = ["COMPARISONS", "PROG", "main", "markdown", "per_seed", "pool"]

PROG = "python -m netutility_jax.experiments.regime_seeds"
CELLS = ("centre", "init=per_task")
BUDGETS = ("16", "32")
COMPARISONS = (
    "energy - uniform",
    "net_utility - uniform",
    "net_utility - energy",
    "data - uniform",
    "data - energy",
)


def per_seed(study: Mapping[str, Any], cells: Sequence[str] = CELLS) -> dict[str, Any]:
    """``{cell: {budget: {seed: {comparison: value}}}}`` of one ``study.json``."""
    out: dict[str, Any] = {}
    for c in study["cells"]:
        if c["cell"] not in cells:
            continue
        for b in BUDGETS:
            a = c["allocation"].get(b)
            if a is None:
                continue
            for i, seed in enumerate(c["seeds"]):
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
                out.setdefault(c["cell"], {}).setdefault(b, {})[int(seed)] = vals
    return out


def pool(sources: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The pooled results of ``(path, study.json)`` pairs; a seed in two sources is an error."""
    table: dict[str, Any] = {}
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
    summary: dict[str, Any] = {}
    for cell, per_b in table.items():
        for b, per_s in per_b.items():
            for comp in COMPARISONS:
                vals = {s: v[comp] for s, v in sorted(per_s.items()) if comp in v}
                summary.setdefault(cell, {}).setdefault(b, {})[comp] = _iv(vals)
    grid: dict[str, Any] = {}
    for b in BUDGETS:
        for comp in COMPARISONS:
            by_seed = {}
            for s in sorted(seen):
                xs = [table[c][b][s][comp] for c in CELLS if s in table.get(c, {}).get(b, {})]
                if len(xs) == len(CELLS) and all(x is not None for x in xs):
                    by_seed[s] = float(np.mean(xs))
            grid.setdefault(b, {})[comp] = _iv(by_seed)
    return {"sources": meta, "per_seed": table, "cells": summary, "grid": grid}


def _iv(vals: Mapping[int, float]) -> dict[str, Any]:
    iv = st.seed_interval(list(vals.values())) if vals else None
    return {
        "per_seed": {str(s): float(v) for s, v in vals.items()},
        "n": len(vals),
        "estimate": None if iv is None else iv.estimate,
        "seed_ci95": None if iv is None else [iv.low, iv.high],
        "positive_seeds": sum(v > 0 for v in vals.values()),
    }


def _f(x: Any, nd: int = 2) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:+.{nd}f}"


def markdown(res: Mapping[str, Any]) -> str:
    lines = [
        "# Regime study: the centre and per-task cells pooled over seeds",
        "",
        f"Written by `{res['command']}` (commit {(res['commit'] or {}).get('head')}) from the "
        "study.json files below; nothing re-run. Normalized accuracy (TA, full space), mean over "
        "seeds with the t interval over seeds (95%); the grid row is the mean of the two cells "
        "per seed. The seed interval holds the adapters' (training) noise, not the test texts' "
        "(the same texts for every seed): it is the interval the headline reads. Multiplicity: "
        f"{len(COMPARISONS)} comparisons x {len(BUDGETS)} budgets x 3 rows are shown; only the "
        "registered question (energy - uniform at R = 16, grid) is read as a test.",
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
    for b in BUDGETS:
        lines += [
            "",
            f"## R = {b}",
            "",
            "| comparison | " + " | ".join(CELLS) + " | grid (mean of the cells) |",
            "|---|---|---|---|",
        ]
        for comp in COMPARISONS:
            cells = []
            for iv in [
                *(res["cells"].get(c, {}).get(b, {}).get(comp) for c in CELLS),
                res["grid"][b][comp],
            ]:
                if not iv or not iv["n"]:
                    cells.append("n/a")
                    continue
                ci = iv["seed_ci95"]
                cells.append(
                    f"{_f(iv['estimate'])} [{_f(ci[0])}, {_f(ci[1])}] "
                    f"({iv['positive_seeds']}/{iv['n']} seeds > 0)"
                )
            lines.append(f"| {comp} | " + " | ".join(cells) + " |")
    lines += ["", "## Per seed", ""]
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
    return "\n".join(lines)


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
    res = {
        "command": shlex.join(["python", "-m", "netutility_jax.experiments.regime_seeds", *argv]),
        "commit": _provenance.commit(),
        "versions": _provenance.versions(),
        **res,
    }
    res = _io.to_jsonable(res)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with _io.atomic_file(out / "results.json", "w") as f:
        f.write(json.dumps(res, indent=1, allow_nan=False) + "\n")
    with _io.atomic_file(out / "results.md", "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
