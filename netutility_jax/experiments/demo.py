"""``netutility demo``: train task LoRAs on MiniLM, merge them under rank budgets, compare allocations.

The built-in experiment of netutility-jax, the analogue of the paper's vision suite on 7 real
text classification tasks (:mod:`netutility_jax.experiments.data.tasks`):

1. every task classifies with a **frozen zero-shot head** (the base model's embeddings of its
   label descriptions, like CLIP's text heads), and only its LoRA (rank 16, alpha 16 on q, k,
   v, o of the 6 layers) trains, to convergence with early stopping, for each of 3 training
   seeds (:mod:`train`);
2. the grid (:mod:`grid`) is merged per seed: methods x budgets ``R`` x allocation (uniform,
   the paper's baseline, vs. Net Utility) and the controls (no budget, random allocation with
   Net Utility's per-module counts, zero-shot, weight average), each merge coefficient chosen
   on validation (:mod:`evaluate`, :mod:`runner`);
3. every delta gets a paired bootstrap interval over the test texts and a t interval over
   seeds, and the analyses are repeated per seed (:mod:`stats`, :mod:`report`).

Outputs (``--out``, default ``netutility-demo``): ``results.json``, ``results.md``,
``predictions.npz`` (every merge's per-text test correctness) and PNG figures, each written to a
temporary file and renamed into place; existing results are never overwritten without
``--overwrite``. The output location is checked before any work.

Exit codes: 0 done; 1 results exist (no ``--overwrite``); 2 bad arguments, an unusable output
location or cache folder, a missing or unreadable ``--task`` CSV, missing data or missing model
weights. All of these are checked before any training.

This module runs the command (one grid: :func:`run`); its parts are :mod:`demo_options` (the
flags), :mod:`demo_checks` (every check before any work) and :mod:`demo_studies` (``--study``),
whose public names it re-exports. It imports every built-in suite, which registers them.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..errors import InputError, NetUtilityError, one_line
from .demo_checks import DemoError as DemoError
from .demo_checks import check_cache_dir as check_cache_dir
from .demo_checks import check_data as check_data
from .demo_checks import check_folder as check_folder
from .demo_checks import check_out as check_out
from .demo_checks import check_task_files as check_task_files
from .demo_checks import check_weights as check_weights
from .demo_checks import load_tasks as load_tasks
from .demo_checks import min_bytes as min_bytes
from .demo_checks import model_devices as model_devices
from .demo_checks import suite_flags as suite_flags
from .demo_checks import task_args as task_args
from .demo_options import DEFAULT_OUT as DEFAULT_OUT
from .demo_options import PROG as PROG
from .demo_options import add_arguments as add_arguments
from .demo_options import chosen_seeds, command_of
from .demo_studies import run_planted as run_planted
from .demo_studies import run_study, run_study_planted
from .harness import fitting as ft
from .harness import grid as gr
from .harness import suites
from .suites import encoder as enc  # noqa: F401 (registers the encoder suite, the default)
from .suites import language, language_head, nli, vision  # noqa: F401 (each registers its suite)

__all__ = [
    "DEFAULT_OUT",
    "PROG",
    "DemoError",
    "add_arguments",
    "check_cache_dir",
    "check_data",
    "check_folder",
    "check_out",
    "check_task_files",
    "check_weights",
    "load_tasks",
    "main",
    "model_devices",
    "preset_of",
    "run",
    "run_planted",
    "suite_flags",
    "task_args",
]


def run(args: argparse.Namespace) -> int:
    """Run ``netutility demo`` with parsed arguments; returns the exit code."""
    try:
        return _run(args)
    except NetUtilityError as e:  # DemoError, and the library's errors on bad input
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return e.code if isinstance(e, DemoError) else 2


def preset_of(args: argparse.Namespace) -> gr.Preset:
    """The preset ``--suite``, ``--quick`` and ``--grid`` select (:meth:`suites.SuiteSpec.preset`),
    with ``--init`` applied to its training.

    Raises:
      DemoError: ``--grid`` names a preset of another suite.

    Example:
      >>> import argparse
      >>> p = preset_of(argparse.Namespace(quick=True, init="shared"))
      >>> p.name, p.train.init, p.seeds
      ('quick', 'shared', (0,))
    """
    spec = suites.get(getattr(args, "suite", suites.DEFAULT))
    try:
        preset = spec.preset(getattr(args, "grid", None), quick=args.quick)
    except InputError as e:
        raise DemoError(str(e)) from None
    if getattr(args, "init", None) is not None:  # --init overrides the preset's
        preset = dataclasses.replace(
            preset, train=dataclasses.replace(preset.train, init=args.init)
        )
    return preset


def _run(args: argparse.Namespace) -> int:
    from .harness import report, runner

    if getattr(args, "study", None) == "planted":
        return run_study_planted(args)
    if getattr(args, "study", None) is not None:
        return run_study(args)
    if getattr(args, "cells", None) is not None:
        raise DemoError("--cells selects cells of a study; give --study or drop --cells")
    t0 = time.perf_counter()
    spec = suites.get(getattr(args, "suite", suites.DEFAULT))
    own_data = "data_dir" in spec.flags  # the suite reads its own tasks (suites.SuiteWithData)
    if "adapters" in spec.flags and getattr(args, "init", None) is not None:
        raise DemoError(f"--init: the {spec.name} suite trains nothing (its adapters are given)")
    if own_data:
        for flag, value in (("--task", args.task), ("--tasks", args.tasks)):
            if value:
                raise DemoError(
                    f"{flag}: the {spec.name} suite reads its tasks from its own folders "
                    "(--data-dir, --adapters); drop it"
                )
    preset = preset_of(args)
    # every check before any work: a run's results must not be lost at the end
    out = check_out(args.out, overwrite=args.overwrite)
    seeds_from = _seeds_from(getattr(args, "seeds_from", []), out)
    read = {s for sv in seeds_from for s in sv.seed_ids}
    # by default the preset's seeds not read back (none, when --seeds-from gives them all)
    seeds = chosen_seeds(args, tuple(s for s in preset.seeds if s not in read))
    if args.seed is not None or args.seeds is not None:
        _check_distinct(seeds, seeds_from, "--seed" if args.seed is not None else "--seeds")
    given = suite_flags(args, spec)
    specs = [] if own_data else task_args(args.task, args.tasks, preset.tasks)
    check_task_files(specs)
    check_cache_dir(args.cache_dir)
    check_data(specs)
    check_weights(spec.name, **given)
    if own_data:
        suite = spec.build(**given)
        try:
            task_list, preset = suite.load_tasks(preset)
        except NetUtilityError as e:  # the data's layout, named (MissingFileError, InputError)
            raise DemoError(f"cannot load the {spec.name} suite's data: {e}") from None
    else:
        task_list = load_tasks(specs, preset)
    print(
        f"{PROG}: {spec.name} suite, {preset.name} grid, {len(task_list)} tasks, seeds "
        f"{', '.join(map(str, seeds)) or 'none'} run here"
        + (f" and {', '.join(map(str, sorted(read)))} read back" if read else "")
        + f", cache {args.cache_dir or ft.default_cache_dir()}",
        flush=True,
    )
    if not own_data:
        suite = spec.build(**given)
    run_ = runner.run_experiment(
        task_list,
        preset,
        seeds=seeds,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
        log=lambda s: print(s, flush=True),
        alpha=args.alpha,
        suite=suite,
        seeds_from=seeds_from,
    )
    exp = report.render(run_, suite.report(run_), command=command_of(args))
    try:
        written = report.write_outputs(exp, out, overwrite=args.overwrite)
    except FileExistsError as e:  # appeared while we ran
        raise DemoError(f"{e}; pass --overwrite or choose another --out") from None
    except OSError as e:  # (the disk filled up, or the folder changed while we ran)
        raise DemoError(f"--out {out}: writing the results failed ({e})") from e
    print()
    print(report.console_summary(exp.results))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; results in {out}/ ({len(written)} files)")
    return 0


def _check_distinct(seeds: Sequence[int], loaded: Sequence[Any], own: str) -> None:
    """No seed both run here (given by the flag ``own``) and read by ``--seeds-from``."""
    from .harness import seeds as sds

    try:
        sds.check_distinct(seeds, loaded, own_label=own)
    except InputError as e:
        raise DemoError(str(e)) from None


def _seeds_from(dirs: Sequence[str], out: pathlib.Path) -> list[Any]:
    """``--seeds-from``: each directory's seeds (``seeds.load``), none of them ``--out`` and no
    seed read twice; whether they belong to this experiment is checked by the runner, before
    any training.

    Raises:
      DemoError: a directory that is --out, is missing, or holds no readable run; a seed twice.
    """
    from .harness import seeds as sds

    loaded = []
    for d in dirs:
        check_folder(d, "--seeds-from")
        path = pathlib.Path(d)
        if path.resolve() == out.resolve():
            raise DemoError(
                f"--seeds-from {d} is also --out: its results would be replaced by the report "
                "that reads them; choose another --out"
            )
        try:
            loaded.append(sds.load(path, label="--seeds-from"))
        except InputError as e:
            raise DemoError(str(e)) from None
        _check_distinct([], loaded, "")
    return loaded


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m netutility_jax.experiments.demo [options]``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train task LoRAs on MiniLM against frozen zero-shot heads and compare "
        "uniform vs net-utility rank allocation across merge methods and budgets, with "
        "confidence intervals (the paper's Table 2).",
    )
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = ["demo", *argv]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
