"""``netutility inspect``: per task its ranks, energy and positive-utility directions; the
heterogeneity h, alpha and lambda; with ``--diagnose`` the data-free diagnostics of an
allocation (:func:`nu.diagnose`). A table, or JSON (:func:`inspect_dict`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core import io as _io
from ..errors import InputError
from .common import UsageError
from .load import load

__all__ = ["cmd_inspect", "inspect_dict"]


def _heterogeneity(adapters: Sequence[Any], paths: Sequence[str]) -> tuple[float, list[int]]:
    """``(h, zero)``: the heterogeneity of the tasks and the indices of those whose update is
    zero in every module (no energy, so no log-energy: ``h`` is NaN then)."""
    import netutility_jax as nu

    from ..scoring._run import log_energies

    _, t, _ = log_energies(adapters, "netutility inspect", False)
    zero = [int(i) for i in np.flatnonzero(np.asarray(t) <= 0)]
    return (float("nan") if zero else float(nu.heterogeneity(adapters))), zero


def _named(paths: Sequence[str], zero: Sequence[int]) -> str:
    """The all-zero adapters, named (a few, then a count)."""
    names = ", ".join(repr(str(paths[i])) for i in zero[:3])
    more = f" and {len(zero) - 3} more" if len(zero) > 3 else ""
    s = "s" if len(zero) > 1 else ""
    return f"adapter{s} {names}{more} (task{s} {', '.join(map(str, zero[:3]))}{more})"


def _alpha_terms(cli: bool) -> tuple[str, str]:
    """How the auto rule and the explicit choice are spelt: as flags or as arguments."""
    return ("--alpha auto", "--alpha 0 or 1") if cli else ('alpha="auto"', "alpha=0 or alpha=1")


def heterogeneity_note(paths: Sequence[str], zero: Sequence[int], *, cli: bool = False) -> str:
    """Why ``h`` is undefined and what the ``alpha="auto"`` rule does with such a set."""
    one = len(zero) == 1
    auto, explicit = _alpha_terms(cli)
    return (
        f"h is undefined: {_named(paths, zero)} {'has' if one else 'have'} a zero update in "
        f"every module (no energy, ||dW||_F^2 = 0, so log ||dW||_F^2 is undefined); "
        f"{auto} needs h and refuses this set: give {explicit} explicitly, "
        f"or drop {'that adapter' if one else 'those adapters'} (an all-zero adapter "
        "contributes no directions to a merge)."
    )


def inspect_dict(
    adapters: Sequence[Any],
    paths: Sequence[str],
    *,
    alpha,
    lam,
    interference: str = "overlap",
    _cli: bool = False,
) -> dict:
    """What ``netutility inspect`` prints, as a dict. ``heterogeneity`` is NaN (``null`` in
    JSON) where a task's update is zero in every module, and ``heterogeneity_note`` says why
    (absent otherwise); ``alpha="auto"`` is then refused (an :class:`InputError` naming the
    adapters), since its rule needs ``h``."""
    import netutility_jax as nu

    if len(paths) != len(adapters):
        raise InputError(
            f"nu.cli.inspect_dict: {len(adapters)} adapters but {len(paths)} paths; give one "
            "path (the adapter's name in the table) per adapter."
        )
    h, zero = _heterogeneity(adapters, paths)
    note = heterogeneity_note(paths, zero, cli=_cli) if zero else None
    if zero and isinstance(alpha, str) and alpha == "auto":
        auto, explicit = _alpha_terms(_cli)
        raise InputError(
            f"{auto}: the heterogeneity h its rule needs is undefined: "
            f"{_named(paths, zero)} {'has' if len(zero) == 1 else 'have'} a zero update in "
            f"every module (no energy). Give {explicit} explicitly to inspect this "
            f"set, or drop {'that adapter' if len(zero) == 1 else 'those adapters'}."
        )
    scores = nu.score(adapters, alpha=alpha, lam=lam, interference=interference)
    energies = np.asarray(nu.task_energies(adapters), np.float64)
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
        **({"heterogeneity_note": note} if note is not None else {}),
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
    from ..pipeline.planning import task_names
    from .paths import resolve_adapter

    _check_diagnose(args)
    given = list(args.adapters)
    resolved = [resolve_adapter(a) for a in given]
    args.names = task_names([r.label for r in resolved])
    loaded = load([r.path for r in resolved], args, "inspect")
    info = inspect_dict(
        loaded.adapters, given, alpha=args.alpha, lam=args.lam,
        interference=args.interference, _cli=True,
    )  # fmt: skip
    for task, r in zip(info["tasks"], resolved, strict=True):
        if r.hub is not None:
            task["hub"] = {
                "id": r.hub.repo_id, "revision": r.hub.revision, "commit": r.hub.commit,
                "path": r.hub.path,
            }  # fmt: skip
    info["coverage"] = {str(n): [int(i) for i in t] for n, t in loaded.coverage.items()}
    diag = None
    if getattr(args, "diagnose", False):
        from ..pipeline.diagnostics import diagnose

        diag = diagnose(
            loaded.adapters, budget=args.budget, alpha=args.alpha, lam=args.lam,
            names=given, interference=args.interference, _cli=True,
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
    note = info.get("heterogeneity_note")
    h_text = "undefined (see the note)" if note is not None else f"{info['heterogeneity']:.3f}"
    print(
        f"heterogeneity h = {h_text} -> alpha = {info['alpha']:g}; "
        f"lambda = {info['lam']:.4g}; positive-utility directions: {info['positive_utility']} "
        f"of {info['candidates']} candidates in {info['modules']} modules"
    )
    if note is not None:
        print(f"note: {note}")
    if diag is not None:
        print(diag.format())
    return 0
