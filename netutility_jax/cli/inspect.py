"""``netutility inspect``: per task its ranks, energy and positive-utility directions; the
heterogeneity h, alpha and lambda; with ``--diagnose`` the data-free diagnostics of an
allocation (:func:`nu.diagnose`). A table, or JSON (:func:`inspect_dict`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _io
from ..errors import InputError
from .common import UsageError
from .load import load

__all__ = ["cmd_inspect", "inspect_dict"]


def inspect_dict(adapters: Sequence[Any], paths: Sequence[str], *, alpha, lam) -> dict:
    """What ``netutility inspect`` prints, as a dict."""
    import netutility_jax as nu

    scores = nu.score(adapters, alpha=alpha, lam=lam)
    energies = np.asarray(nu.task_energies(adapters), np.float64)
    try:
        h = float(nu.heterogeneity(adapters))
    except InputError:  # (a task whose update is all zero)
        h = float("nan")
    tasks = []
    for i, path in enumerate(paths):
        ranks = [int(m["lora_a"].shape[1]) for m in adapters[i].values() if m is not None]
        sig = [np.asarray(ms.sigma[i]) for ms in scores.modules.values()]
        util = [np.asarray(ms.utility[i]) for ms in scores.modules.values()]
        cand = int(sum((s > 0).sum() for s in sig))
        pos = int(sum((u > 0).sum() for u in util))
        tasks.append(
            {
                "adapter": path,
                "modules": len(ranks),
                "rank_min": min(ranks) if ranks else 0,
                "rank_max": max(ranks) if ranks else 0,
                "directions": int(sum(ranks)),
                "candidates": cand,
                "positive_utility": pos,
                "energy": float(energies[i]),
            }
        )
    return {
        "tasks": tasks,
        "modules": len(scores.modules),
        "heterogeneity": h,
        "alpha": float(scores.alpha),
        "lam": float(scores.lam),
        "positive_utility": sum(t["positive_utility"] for t in tasks),
        "candidates": sum(t["candidates"] for t in tasks),
    }


def _check_diagnose(args: argparse.Namespace) -> None:
    """``--diagnose`` and ``--budget`` go together (checked before anything is loaded)."""
    diagnose, budget = getattr(args, "diagnose", False), getattr(args, "budget", None)
    if diagnose and budget is None:
        raise UsageError(
            "--diagnose needs --budget N (the average number of kept directions per module to "
            "diagnose the allocation at, e.g. --budget 16)."
        )
    if budget is not None and not diagnose:
        raise UsageError("--budget applies only with --diagnose (inspect allocates nothing).")


def cmd_inspect(args: argparse.Namespace) -> int:
    """``netutility inspect``: the adapters (folders, or Hugging Face Hub ids resolved to their
    snapshots, :func:`.paths.resolve_adapter`) loaded, scored and printed."""
    from ..planning import task_names
    from .paths import resolve_adapter

    _check_diagnose(args)
    given = list(args.adapters)
    resolved = [resolve_adapter(a) for a in given]
    args.names = task_names([r.label for r in resolved])
    loaded = load([r.path for r in resolved], args, "inspect")
    info = inspect_dict(loaded.adapters, given, alpha=args.alpha, lam=args.lam)
    for task, r in zip(info["tasks"], resolved, strict=True):
        if r.hub is not None:
            task["hub"] = {
                "id": r.hub.repo_id, "revision": r.hub.revision, "commit": r.hub.commit,
                "path": r.hub.path,
            }  # fmt: skip
    info["coverage"] = {str(n): [int(i) for i in t] for n, t in loaded.coverage.items()}
    diag = None
    if getattr(args, "diagnose", False):
        from ..diagnostics import diagnose

        diag = diagnose(
            loaded.adapters, budget=args.budget, alpha=args.alpha, lam=args.lam,
            names=given,
        )  # fmt: skip
        info["diagnostics"] = diag.to_dict()
    if args.json:
        print(json.dumps(_io.to_jsonable(info), indent=1))
        return 0
    w = max(len("adapter"), *(len(t["adapter"]) for t in info["tasks"]))
    print(
        f"{'task':>4}  {'adapter':<{w}}  {'modules':>7}  {'ranks':>7}  {'energy':>10}  "
        f"{'positive':>8} / candidates"
    )
    for i, t in enumerate(info["tasks"]):
        rk = (
            str(t["rank_min"])
            if t["rank_min"] == t["rank_max"]
            else f"{t['rank_min']}-{t['rank_max']}"
        )
        print(
            f"{i:>4}  {t['adapter']:<{w}}  {t['modules']:>7}  {rk:>7}  {t['energy']:>10.4g}  "
            f"{t['positive_utility']:>8} / {t['candidates']}"
        )
    print(
        f"heterogeneity h = {info['heterogeneity']:.3f} -> alpha = {info['alpha']:g}; "
        f"lambda = {info['lam']:.4g}; positive-utility directions: {info['positive_utility']} "
        f"of {info['candidates']} candidates in {info['modules']} modules"
    )
    if diag is not None:
        print(diag.format())
    return 0
