"""``netutility demo --study NAME``: the studies the command runs instead of one grid, the
regime studies (:func:`run_study`: every cell, then ``study.json``, ``study.md``,
``study.png``) and the planted-interference study (:func:`run_study_planted` with its
registered defaults; :func:`run_planted`, which ``python -m
netutility_jax.experiments.planted`` runs with all its options).

The command is :mod:`netutility_jax.experiments.demo`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time

from .demo_checks import (
    FLAG_NAMES,
    DemoError,
    check_cache_dir,
    check_data,
    check_weights,
    load_tasks,
    task_args,
    writable_place,
)
from .demo_options import PROG, chosen_seeds, command_of
from .harness import fitting as ft
from .harness import records
from .suites import encoder as enc

__all__ = ["run_planted", "run_study", "run_study_planted"]


def run_study_planted(args: argparse.Namespace) -> int:
    """``netutility demo --study planted``: :mod:`netutility_jax.experiments.planted` with the
    primary merges, the seeds of ``--seed``/``--seeds`` (default 0-4), ``--out``, ``--cache-dir``."""
    for flag, given in (
        ("--grid", args.grid), ("--init", args.init), ("--tasks", args.tasks),
        ("--task", args.task), ("--cells", getattr(args, "cells", None)),
        ("--seeds-from", getattr(args, "seeds_from", None)),
    ):  # fmt: skip
        if given:
            raise DemoError(f"--study planted sets its own {flag[2:]}; drop {flag}")
    if getattr(args, "suite", "encoder") != "encoder":
        raise DemoError("--study planted runs on the encoder suite; drop --suite")
    seeds = chosen_seeds(args, (0, 1, 2, 3, 4))
    ns = argparse.Namespace(
        seeds=seeds, out=str(args.out), cache_dir=args.cache_dir, merges="primary",
        quick=args.quick, render=False, init="per_task",
    )  # fmt: skip
    return run_planted(ns, command_of(args))


def run_planted(args: argparse.Namespace, command: str, *, prog: str = PROG) -> int:
    """The planted-interference study (:mod:`netutility_jax.experiments.harness.planting`) for
    parsed options ``seeds``, ``out``, ``cache_dir``, ``merges``, ``quick`` and ``render`` (only
    re-render ``out``): each seed run, saved and the report re-rendered from every seed in
    ``out``; a seed already there with every merge asked is not run again (one asked more is
    run again for what it had and what is asked). ``command`` is recorded in every seed and
    the report."""
    import json

    from .harness import planting as pl

    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out} is a file; give a directory")
    if not args.render:
        preset = enc.QUICK if args.quick else enc.FULL
        # the per-task initialisation (the default preset's; the regime study's per-task cell),
        # or the shared one (the regime study's centre)
        init = getattr(args, "init", None) or "per_task"
        preset = dataclasses.replace(preset, train=dataclasses.replace(preset.train, init=init))
        pairs = (("word_sentiment", "word_pos"),) if args.quick else pl.PAIRS
        cache = check_cache_dir(args.cache_dir)
        specs = task_args([], None, preset.tasks)
        check_data(specs)
        check_weights("encoder")
        task_list = load_tasks(specs, preset)
        suite = enc.EncoderSuite()
        ran = False
        for seed in args.seeds:
            done = out / f"seed{seed}.json"
            merges = args.merges
            if done.exists():
                had = json.loads(done.read_text()).get("merges", "none")
                merges = pl.merges_to_run(had, args.merges)
                if merges is None:
                    shown = had if isinstance(had, str) else f"{len(had)} chosen"
                    print(
                        f"{prog}: seed {seed} is in {out} (merges {shown}); not run again",
                        flush=True,
                    )
                    continue
            rec = pl.run_seed(
                seed, task_list, preset, suite, cache_dir=cache, merges=merges,
                log=lambda s: print(s, flush=True), pairs=pairs,
            )  # fmt: skip
            pl.save_seed(out, rec, command=command)
            _render_planted(out, command, prog)
            ran = True
        if not ran:  # every seed was there: the report drawn again from them
            _render_planted(out, command, prog)
    else:
        _render_planted(out, command, prog)
    return 0


def _render_planted(out: pathlib.Path, command: str, prog: str) -> None:
    from .harness import planting as pl

    seeds = pl.load_seeds(out)
    results, markdown = pl.render(seeds, command=command)
    written = pl.write(out, results, markdown)
    print(f"{prog}: {len(seeds)} seed(s) rendered: {', '.join(written)}", flush=True)


def run_study(args: argparse.Namespace) -> int:
    """``netutility demo --study NAME``: every cell of the study, then study.json/md/png."""
    from .harness import study as sd

    t0 = time.perf_counter()
    if getattr(args, "suite", "encoder") != "encoder":
        raise DemoError(f"--study {args.study} runs on the encoder suite; drop --suite")
    if getattr(args, "seeds_from", None):
        raise DemoError(f"--seeds-from: --study {args.study} reads no earlier seeds; drop it")
    for flag, given in (
        ("--grid", args.grid), ("--init", args.init), ("--tasks", args.tasks),
        ("--task", args.task),
    ):  # fmt: skip
        if given:
            raise DemoError(f"--study {args.study} sets its own {flag[2:]} per cell; drop {flag}")
    for key, flag in FLAG_NAMES.items():
        if getattr(args, key, None) is not None:
            raise DemoError(
                f"--study {args.study} runs on the encoder suite, which takes no {flag}"
            )
    full, quick = enc.STUDIES[args.study]
    study = quick if args.quick else full
    cell_names = getattr(args, "cells", None)
    if cell_names is not None:
        known = [c.name for c in study.cells]
        unknown = [c for c in cell_names if c not in known]
        if unknown:
            raise DemoError(f"--cells: unknown cells {unknown}; the {study.name} study has {known}")
    seeds = chosen_seeds(args, study.centre.seeds)
    out = pathlib.Path(args.out) if str(args.out).strip() else None
    if out is None:
        raise DemoError("--out is empty; give a directory for the results")
    writable_place(out, "--out")
    found = sd.existing(out) if out.is_dir() else []
    if found and not args.overwrite:
        raise DemoError(
            f"{found[0]} already exists; pass --overwrite to replace the results or choose "
            "another --out"
        )
    specs = task_args([], None, study.centre.tasks)
    check_cache_dir(args.cache_dir)
    check_data(specs)
    check_weights("encoder")
    task_list = load_tasks(specs, study.centre)
    print(
        f"{PROG}: {study.name} study ({'quick' if args.quick else 'full'}), "
        f"{len(cell_names or study.cells)} cells, {len(task_list)} tasks, seeds "
        f"{', '.join(map(str, seeds))}, cache {args.cache_dir or ft.default_cache_dir()}",
        flush=True,
    )
    commit = records.commit()
    cells = sd.run_study(
        study, task_list, seeds=seeds, cache_dir=args.cache_dir,
        progress=not args.no_progress, log=lambda s: print(s, flush=True), alpha=args.alpha,
        cells=cell_names,
    )  # fmt: skip
    results, markdown, figure = sd.render(study, cells, command=command_of(args), commit=commit)
    try:
        written = sd.write_outputs(results, markdown, figure, out, overwrite=args.overwrite)
    except FileExistsError as e:
        raise DemoError(f"{e}; pass --overwrite or choose another --out") from None
    except OSError as e:
        raise DemoError(f"--out {out}: writing the results failed ({e})") from e
    print()
    print(markdown.split("\n## Per task")[0])
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; results in {out}/ ({len(written)} files)")
    return 0
