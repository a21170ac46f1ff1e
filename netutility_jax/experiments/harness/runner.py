"""Run an experiment: train per seed, merge the grid, evaluate, keep every prediction.

For each training seed (:func:`run_experiment`), through the suite (``suites.Suite``; the
default is the encoder's, ``encoder.EncoderSuite``):

1. every task's LoRA is trained against its head, or loaded from the cache
   (``suite.train_tasks``; the encoder's: :func:`train.train_tasks`);
2. the single-LoRA and zero-shot accuracies are measured on validation and test
   (``suite.evaluator``; the encoder's: ``encoder_eval.Evaluator``);
3. every job of the grid (:func:`grid.grid_jobs`) is merged with ``nu.merge_adapters`` (or
   ``nu.merge`` with the random control's masks), its coefficient chosen on validation, and its
   test correctness kept, text by text, for the paired bootstrap (:mod:`stats`); one job's
   merge, evaluation and cache are :mod:`jobs`'.

A job's result is cached on disk (``<cache>/merges/``), keyed by everything that determines it
(the trained adapters' cache keys, the job, the evaluation settings and texts, this module's
:data:`CODE_VERSION`), so an interrupted run resumes where it stopped and a second run only
renders. The data splits are the same for every seed (split seed 0): seeds differ in training
(initialisation and data order) and DARE's mask, and every merge is evaluated on the same texts.

Part of the harness: no model or suite is imported here. A run without a suite runs the one
registered as :data:`DEFAULT_SUITE` (``suites.get("encoder")``, registered when
:mod:`netutility_jax.experiments.suites.encoder` is imported).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...errors import InputError
from . import fitting as ft
from . import grid as gr
from . import records, suites
from . import seeds as sds
from .allocations import random_allocation as random_allocation
from .allocations import random_split_allocation as random_split_allocation
from .jobs import JobCache as JobCache
from .jobs import SeedJobs
from .passes import TaskSet
from .seeds import SeedResult as SeedResult

__all__ = [
    "CODE_VERSION",
    "DEFAULT_SUITE",
    "MOMENT_TEXTS",
    "SPLIT_SEED",
    "JobCache",
    "Run",
    "SeedResult",
    "random_allocation",
    "random_split_allocation",
    "run_experiment",
]

#: Bump when a change here or in evaluate.py changes what a job produces: invalidates job caches.
CODE_VERSION = 1
#: Seed of the data splits, the same for every training seed.
SPLIT_SEED = 0
#: Training texts per task whose LoRA-target inputs (under the base model) estimate the task's
#: input second moments for the data-aware control (``grid.VARIANTS["net_utility_data"]``).
MOMENT_TEXTS = 256
#: The suite :func:`run_experiment` runs when none is given (``encoder.EncoderSuite``); it caches
#: at the top of the cache directory, every other suite under ``<cache>/<suite.name>``.
DEFAULT_SUITE = "encoder"


def _fingerprint(es: TaskSet) -> str:
    h = hashlib.sha256()
    for x in (es.ids, es.lengths, es.task, es.labels):
        h.update(np.ascontiguousarray(x).tobytes())
    h.update(json.dumps(es.task_names).encode())
    return h.hexdigest()


@dataclasses.dataclass
class Run:
    """The raw outcome of :func:`run_experiment`."""

    preset: gr.Preset
    tasks: list[Any]
    jobs: list[gr.Job]
    seeds: list[SeedResult]
    val: TaskSet
    test: TaskSet
    heads: list[Any]
    alpha_arg: Any
    seconds: dict[str, float]
    backbone: dict[str, float]
    suite: str = DEFAULT_SUITE
    commit: dict[str, Any] | None = None
    eval_key: dict[str, Any] | None = None  # the suite's eval_key: what determines evaluation
    #: where the seeds read from earlier runs came from (``seeds.SavedSeeds.provenance``)
    seeds_from: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: hashes of the validation and test sets (token ids, lengths, tasks, labels): ``{"val",
    #: "test"}``, part of every job's cache key
    fingerprint: dict[str, str] | None = None


def _in_notebook() -> bool:
    """Running in a Jupyter kernel (a notebook or Colab), not a terminal."""
    import sys

    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell is not None and hasattr(shell, "get_ipython") else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def _bars_enabled(progress: bool) -> bool:
    """Whether to draw progress bars: in a notebook only with ipywidgets (tqdm's widget bar);
    a text bar there would print a new line at every update, so the runner logs one line per
    job instead."""
    if not progress or not _in_notebook():
        return progress
    import importlib.util

    return importlib.util.find_spec("ipywidgets") is not None


def _progress_bar(total: int, desc: str, enabled: bool):
    if enabled and _in_notebook():
        from tqdm.notebook import tqdm as notebook_tqdm

        return notebook_tqdm(total=total, desc=desc)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, mininterval=1.0, dynamic_ncols=True)


def run_experiment(
    task_list: Sequence[Any],
    preset: gr.Preset,
    *,
    seeds: Sequence[int] | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    alpha: float | str = "auto",
    suite: Any = None,
    seeds_from: Sequence[Any] = (),
) -> Run:
    """Train (or load) the task LoRAs for every seed, run the grid, keep every prediction.

    Args:
      task_list: ``tasks.Task`` objects (at least 2), split with :data:`SPLIT_SEED`.
      preset: a :class:`grid.Preset`: the suite's (``encoder.QUICK``, ``encoder.FULL``,
        ``encoder.PAPER``, ...) or your own.
      seeds: training seeds (default the preset's, less those read from ``seeds_from``).
      cache_dir: trained-adapter and job cache (default :func:`fitting.default_cache_dir`); the
        jobs go to its ``merges/`` folder.
      progress: show tqdm bars.
      log: where one-line status messages go.
      alpha: scoring geometry: ``"auto"`` (the paper's heterogeneity rule), ``1.0`` (Gram) or
        ``0.0`` (row space).
      suite: the model, heads, training and evaluation (a :class:`suites.Suite`; default the
        registered :data:`DEFAULT_SUITE`'s, ``suites.get("encoder").build()``); a suite other
        than it caches under ``<cache_dir>/<suite.name>``.
      seeds_from: seeds of earlier runs of the same experiment (:class:`seeds.SavedSeeds`,
        ``seeds.load(directory)``), reported with this run's own: each is checked against this
        run (suite, preset, grid, training, tasks, alpha, test and validation texts, evaluation
        settings, every job of the grid) before anything trains, and no seed may be given
        twice. The run's ``seeds`` are then sorted by seed. Every seed may come from here
        (``seeds=[]``, or the preset's seeds all read); the figures drawn from one seed's masks
        then are not drawn (a rendered run keeps no masks).

    Raises:
      InputError: a seed given twice, no seed at all, or seeds from another experiment
        (:meth:`seeds.SavedSeeds.check`).
    """
    import jax

    import netutility_jax as nu

    t_start, c_start = time.perf_counter(), time.process_time()
    progress = _bars_enabled(progress)
    # the code that runs is the checkout's now, not at the end of a run of hours
    commit = records.commit()
    seeds_from = list(seeds_from)
    seeds = _seeds_to_run(preset, seeds, seeds_from)
    cache, suite = _cache_and_suite(cache_dir, suite)
    jobs_cache = JobCache(cache / "merges")
    m_tasks = len(task_list)
    heads = suite.heads(task_list)
    val, test = suite.eval_sets(task_list, heads, preset.train)
    fingerprint = {"val": _fingerprint(val), "test": _fingerprint(test)}
    jobs = gr.grid_jobs(preset.grid, full_capacity=m_tasks * preset.train.lora_rank)
    moments = _moments_of(suite, task_list, jobs)
    if seeds_from:  # every check before any training
        expected = _expected(
            Run(preset=preset, tasks=list(task_list), jobs=jobs, seeds=[], val=val, test=test,
                heads=heads, alpha_arg=alpha, seconds={}, backbone={}, suite=suite.name,
                eval_key=suite.eval_key(preset.train), fingerprint=fingerprint),
            suite,
        )  # fmt: skip
        for sv in seeds_from:
            sv.check(expected, test, len(val))
    results: list[SeedResult] = []
    bar = _progress_bar(len(jobs) * len(seeds), "merge grid", progress)
    with bar:
        for seed in seeds:
            results.append(
                _run_seed(
                    seed, task_list, heads, preset, jobs, val, test, fingerprint,
                    cache=cache, jobs_cache=jobs_cache, suite=suite, alpha=alpha,
                    progress=progress, log=log, bar=bar, moments=moments,
                )
            )  # fmt: skip
    computed = list(results)
    if seeds_from:  # in seed order (seeds run here keep the order given)
        results = sorted(
            [*results, *(s for sv in seeds_from for s in sv.seeds)], key=lambda s: s.seed
        )
    return Run(
        preset=preset,
        tasks=list(task_list),
        jobs=jobs,
        seeds=results,
        val=val,
        test=test,
        heads=heads,
        alpha_arg=alpha,
        seconds=_seconds(t_start, c_start, computed),
        backbone={**suite.timing(), "jax": jax.__version__, "nu": nu.__version__},
        suite=suite.name,
        commit=commit,
        eval_key=suite.eval_key(preset.train),
        seeds_from=[sv.provenance() for sv in seeds_from],
        fingerprint=fingerprint,
    )


def _seeds_to_run(
    preset: gr.Preset, seeds: Sequence[int] | None, seeds_from: Sequence[Any]
) -> list[int]:
    """The seeds this run trains: ``seeds``, by default the preset's that were not read back
    (none, when every one was).

    Raises:
      InputError: a seed given twice (run and read, or read from two directories), or no seed
        at all.
    """
    read = {s for sv in seeds_from for s in sv.seed_ids}
    seeds = [s for s in preset.seeds if s not in read] if seeds is None else list(seeds)
    if seeds_from:  # (also no seed read from two directories)
        sds.check_distinct(seeds, seeds_from)
    elif not seeds:
        raise InputError("run_experiment: no seeds to run (seeds=[]) and none read (seeds_from)")
    return seeds


def _cache_and_suite(cache_dir: str | os.PathLike | None, suite: Any) -> tuple[pathlib.Path, Any]:
    """The cache folder and the suite of a run: the default suite (:data:`DEFAULT_SUITE`) when
    none is given, which caches at the top of the cache folder; any other under its name."""
    cache = pathlib.Path(cache_dir) if cache_dir is not None else ft.default_cache_dir()
    if suite is None:
        suite = suites.get(DEFAULT_SUITE).build()
    if suite.name != DEFAULT_SUITE:
        cache = cache / suite.name
    return cache, suite


def _seconds(t_start: float, c_start: float, computed: Sequence[SeedResult]) -> dict[str, float]:
    """``Run.seconds``: the run's wall and CPU time since ``t_start`` / ``c_start``, and the
    training and grid phases of the seeds it ``computed`` (not those read back)."""
    return {
        "total": time.perf_counter() - t_start,
        "training": sum(r.seconds["training"] for r in computed),
        "grid": sum(r.seconds["grid"] for r in computed),
        "total_cpu": time.process_time() - c_start,
        "training_cpu": sum(r.seconds["training_cpu"] for r in computed),
        "grid_cpu": sum(r.seconds["grid_cpu"] for r in computed),
    }


def _expected(run: Run, suite: Any) -> dict[str, Any]:
    """What ``run`` will record that seeds read from another run must share
    (:meth:`seeds.SavedSeeds.check`): the fields ``report_tables.collect`` writes, with the
    suite report's own fields over them as there (the vision suite's ``train_config``)."""
    from . import report_tables as rt

    wording = suite.report(run)
    base = {
        "suite": run.suite,
        "preset": run.preset.name,
        "grid": dataclasses.asdict(run.preset.grid),
        "train_config": rt.train_config(run),
        "tasks": rt.task_info(run),
        "alpha_arg": run.alpha_arg,
        "evaluation": rt.evaluation(run, wording),
        "texts": run.fingerprint,
        "eval_key": rt.eval_key_digest(run),
        "train_data": rt.train_data_digest(run),
    }
    fields = wording.fields(run)
    return {**{k: fields.get(k, v) for k, v in base.items()}, "jobs": [j.key for j in run.jobs]}


def _moments_of(suite: Any, task_list: Sequence[Any], jobs: Sequence[gr.Job]):
    """``(key, thunk)`` of the tasks' input moments when a job of the grid is data-aware (the
    thunk computes them once, when the first such job is not cached), else None."""
    if not any(gr.VARIANTS[j.allocation].data for j in jobs if j.allocation in gr.VARIANTS):
        return None
    if not hasattr(suite, "input_moments"):
        raise InputError(
            f"run_experiment: the grid has the data-aware control (net_utility_data), but the "
            f"{suite.name!r} suite cannot estimate input moments (suites.SuiteWithMoments); "
            "drop the control from the grid."
        )
    held: list[Any] = []

    def thunk() -> Any:
        if not held:
            held.append(suite.input_moments(task_list))
        return held[0]

    return suite.moments_key(), thunk


def _run_seed(
    seed, task_list, heads, preset, jobs, val, test, fingerprint, *,
    cache, jobs_cache, suite, alpha, progress, log, bar, moments=None,
) -> SeedResult:  # fmt: skip
    import jax

    import netutility_jax as nu

    tcfg = dataclasses.replace(preset.train, seed=seed)
    # wall and CPU time (this process, every thread: what a run costs in CPU hours) per phase
    t0, c0 = time.perf_counter(), time.process_time()
    trained = suite.train_tasks(task_list, heads, tcfg, cache_dir=cache, progress=progress, log=log)
    train_wall, train_cpu = time.perf_counter() - t0, time.process_time() - c0
    adapters = [t.adapter for t in trained]
    t0, c0 = time.perf_counter(), time.process_time()
    evaluator = suite.evaluator(trained, heads, val, test, cache_dir=cache)
    single_wall, single_cpu = time.perf_counter() - t0, time.process_time() - c0
    names = evaluator.task_names
    log(
        f"seed {seed}: test accuracy zero-shot -> single LoRA: "
        + ", ".join(
            f"{n} {evaluator.zero_shot_test[n]:.3f} -> {evaluator.single_test[n]:.3f}"
            for n in names
        )
    )
    scores = jax.block_until_ready(nu.score(adapters, alpha=alpha, lam="auto"))
    masks = jax.block_until_ready(nu.allocate(scores, max(preset.grid.budgets)))
    base_key = {
        "code_version": CODE_VERSION,
        "adapters": [t.info["cache_key"] for t in trained],
        "alpha": alpha,
        "eval": {**suite.eval_key(preset.train), **fingerprint},
    }
    runs = SeedJobs(
        seed, adapters, scores, evaluator, suite, alpha, jobs_cache, base_key, moments=moments,
        grid=preset.grid,
    )  # fmt: skip
    t0, c0 = time.perf_counter(), time.process_time()
    records, correct = _run_jobs(runs, jobs, bar=bar, progress=progress, log=log)
    grid_wall, grid_cpu = time.perf_counter() - t0, time.process_time() - c0
    _choose_on_validation(preset.grid, records, correct)
    mnu = _mean_net_utility(scores)
    return SeedResult(
        seed=seed,
        training={t.name: dict(t.info) for t in trained},
        single_val=evaluator.single_val,
        single_test=evaluator.single_test,
        zero_shot_val=evaluator.zero_shot_val,
        zero_shot_test=evaluator.zero_shot_test,
        single_correct=evaluator.single_test_correct,
        zero_shot_correct=evaluator.zero_shot_test_correct,
        records=records,
        correct=correct,
        scoring={
            "lam": float(scores.lam),
            "alpha": float(scores.alpha),
            "heterogeneity": float(nu.heterogeneity(adapters)),
            "mean_net_utility": {n: float(mnu[i]) for i, n in enumerate(names)},
        },
        kept_per_module=nu.kept_per_module(masks),
        retention=[float(x) for x in np.asarray(nu.retention_by_rank(masks, scores))],
        masks=masks,
        scores=scores,
        seconds={
            "training": train_wall,
            "single_eval": single_wall,
            "grid": grid_wall,
            "training_cpu": train_cpu,
            "single_eval_cpu": single_cpu,
            "grid_cpu": grid_cpu,
        },
        adapters=adapters,
    )


def _run_jobs(
    runs: SeedJobs, jobs: Sequence[gr.Job], *, bar: Any, progress: bool,
    log: Callable[[str], None],
) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:  # fmt: skip
    """Every job of one seed in order (:meth:`jobs.SeedJobs.run`): ``(records, test
    correctness)`` by job key; one log line per job when there are no progress bars."""
    records: dict[str, dict[str, Any]] = {}
    correct: dict[str, np.ndarray] = {}
    for job in jobs:
        bar.set_postfix_str(f"seed {runs.seed} {job.key}")
        rec, ok = runs.run(job)
        records[job.key], correct[job.key] = rec, ok
        bar.update(1)
        if not progress:
            log(
                f"seed {runs.seed} {job.key}: normalized accuracy {rec['normalized']:.1f} "
                f"(coef {rec['coef']:g}{', cached' if rec['cache_hit'] else ''})"
            )
    return records, correct


def _choose_on_validation(
    grid: gr.GridConfig, records: dict[str, dict[str, Any]], correct: dict[str, np.ndarray]
) -> None:
    """Add the records of the grid's derived controls (``AllocationSpec.choose_from``): per
    budget, the candidate job with the best validation normalized accuracy (the first in
    ``choose_from`` order on a tie), under the control's own key, with ``chosen`` naming it."""
    for method, space, name in grid.controls:
        var = gr.VARIANTS[name]
        if not var.choose_from:
            continue
        canon = gr.METHODS[method].canonical_space(space, grid.spaces)
        for r in grid.budgets:
            keys = [f"{method}/{canon}/R{r}/{v}" for v in var.choose_from]
            if not all(k in records for k in keys):
                continue
            best = max(keys, key=lambda k: (records[k]["val_normalized"], -keys.index(k)))
            key = f"{method}/{canon}/R{r}/{name}"
            records[key] = {
                **records[best], "key": key, "allocation": name,
                "chosen": best.rsplit("/", 1)[1], "derived": True,
            }  # fmt: skip
            correct[key] = correct[best]


def _mean_net_utility(scores: Any) -> np.ndarray:
    """``(M,)`` mean net utility of each task's candidate directions over all modules."""
    u = np.concatenate([np.asarray(m.utility, np.float64) for m in scores.modules.values()], 1)
    fin = np.isfinite(u)
    return np.where(fin, u, 0).sum(1) / np.maximum(fin.sum(1), 1)
