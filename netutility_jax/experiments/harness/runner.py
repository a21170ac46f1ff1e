"""Run an experiment: train per seed, merge the grid, evaluate, keep every prediction.

For each training seed (:func:`run_experiment`), through the suite (``suites.Suite``; the
default is the encoder's, ``encoder.EncoderSuite``):

1. every task's LoRA is trained against its head, or loaded from the cache
   (``suite.train_tasks``; the encoder's: :func:`train.train_tasks`);
2. the single-LoRA and zero-shot accuracies are measured on validation and test
   (``suite.evaluator``; the encoder's: ``encoder_eval.Evaluator``);
3. every job of the grid (:func:`grid.grid_jobs`) is merged with ``nu.merge_adapters`` (or
   ``nu.merge`` with the random control's masks), its coefficient chosen on validation, and its
   test correctness kept, text by text, for the paired bootstrap (:mod:`stats`).

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ... import registry
from ...errors import InputError
from . import evaluate as ev
from . import fitting as ft
from . import grid as gr
from . import records, suites
from . import seeds as sds
from .allocations import random_allocation as random_allocation
from .allocations import random_split_allocation as random_split_allocation
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


class JobCache:
    """Finished jobs on disk: ``<dir>/<seed>-<job>-<key>.npz`` holding the test correctness and
    the record (JSON), written to a temporary file and renamed into place."""

    def __init__(self, directory: str | os.PathLike | None):
        self.dir = None if directory is None else pathlib.Path(directory)

    def path(self, seed: int, job: gr.Job, key: str) -> pathlib.Path | None:
        if self.dir is None:
            return None
        return self.dir / f"s{seed}-{job.key.replace('/', '_')}-{key[:16]}.npz"

    def load(self, path: pathlib.Path | None) -> tuple[dict[str, Any], np.ndarray] | None:
        if path is None or not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                record = json.loads(bytes(z["record"]).decode())
                correct = np.unpackbits(z["correct"])[: int(z["n"])].astype(bool)
        except (OSError, ValueError, KeyError):
            return None
        return record, correct

    def store(self, path: pathlib.Path | None, record: dict[str, Any], correct: np.ndarray) -> None:
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with records.atomic_file(path, "wb") as f:
            np.savez(
                f,
                record=np.frombuffer(json.dumps(records.to_jsonable(record)).encode(), np.uint8),
                correct=np.packbits(np.asarray(correct, bool)),
                n=np.asarray(len(correct)),
            )


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


def _summary_of_masks(masks: dict[str, Any]) -> dict[str, Any]:
    import netutility_jax as nu

    return {
        "budget_spent": nu.budget_spent(masks),
        "non_prefix_fraction": nu.non_prefix_fraction(masks),
        "kept_per_task": [int(x) for x in np.asarray(nu.kept_per_task(masks))],
    }


def _merge(
    adapters, job: gr.Job, *, seed: int, alpha: Any, scores: Any, moments: Any = None,
    options: Mapping[str, Any] | None = None,
):  # fmt: skip
    """``(merged adapter, record fields)`` of one job (coefficient 1). ``moments``: a callable
    returning the tasks' input moments, called by a data-aware job only; ``options``: method
    options that replace the grid method's (an option searched on validation)."""
    import jax

    import netutility_jax as nu

    spec = gr.METHODS[job.method]
    method = registry.METHODS[spec.method]
    opts = dict(spec.options) | dict(options or {})
    key = jax.random.key(seed) if method.needs_key else None
    m_tasks = len(adapters)
    rank = max(int(np.asarray(m["lora_a"]).shape[1]) for m in adapters[0].values())
    var = gr.VARIANTS.get(job.allocation)
    if var is None:
        raise InputError(f"unknown allocation {job.allocation!r} in job {job.key!r}")
    if var.library is not None:
        budget = job.budget if job.budget is not None else m_tasks * rank
        lam = "auto" if var.lam_scale is None else var.lam_scale * float(scores.lam)
        data = {}
        if var.data:
            if moments is None:
                raise InputError(
                    f"job {job.key!r} scores with the tasks' input moments, but the suite has no "
                    "input_moments(tasks) (suites.SuiteWithMoments); drop the control."
                )
            data["input_moments"] = moments()
        if var.interference != "overlap":  # (every other job's call is as it was)
            data["interference"] = var.interference
        merged, report = nu.merge_adapters(
            adapters,
            budget=budget,
            method=spec.method,
            space=job.space,
            allocation=var.library,
            alpha=alpha if var.alpha is None else var.alpha,
            lam=lam,
            key=key,
            **data,
            **opts,
        )
        fields = {
            "scope": report.scope,
            "lam": report.lam,
            "alpha": report.alpha,
            **({"data_aware": report.data_aware} if var.data else {}),
            "budget_spent": report.budget_spent,
            "non_prefix_fraction": report.non_prefix_fraction,
            "kept_per_task": [int(x) for x in np.asarray(report.kept_per_task)],
        }
    elif var.masks is not None:
        scope = method.budget_scope  # the paper's: local for TIES and DARE, global otherwise
        ref = nu.allocate(scores, job.budget, scope=scope, positive_only=True)
        masks = var.masks(ref, scores, seed=(seed, job.draw, job.budget))
        merged = nu.merge(adapters, masks, method=spec.method, space=job.space, key=key, **opts)
        fields = {"scope": scope, **_summary_of_masks(masks)}
    else:  # the weight average
        merged = nu.merge(adapters, None, method="ta", space="full")
        fields = {}
    # one merge's LAPACK work at a time (jaxlib CPU can deadlock on concurrent batched LAPACK)
    return jax.block_until_ready(merged), fields


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
    read = {s for sv in seeds_from for s in sv.seed_ids}
    # by default the preset's seeds that were not read back (none, when every one was)
    seeds = [s for s in preset.seeds if s not in read] if seeds is None else list(seeds)
    if seeds_from:  # (also no seed read from two directories)
        sds.check_distinct(seeds, seeds_from)
    elif not seeds:
        raise InputError("run_experiment: no seeds to run (seeds=[]) and none read (seeds_from)")
    cache = pathlib.Path(cache_dir) if cache_dir is not None else ft.default_cache_dir()
    if suite is None:
        suite = suites.get(DEFAULT_SUITE).build()
    if suite.name != DEFAULT_SUITE:
        cache = cache / suite.name
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
        seconds={
            "total": time.perf_counter() - t_start,
            "training": sum(r.seconds["training"] for r in computed),
            "grid": sum(r.seconds["grid"] for r in computed),
            "total_cpu": time.process_time() - c_start,
            "training_cpu": sum(r.seconds["training_cpu"] for r in computed),
            "grid_cpu": sum(r.seconds["grid_cpu"] for r in computed),
        },
        backbone={**suite.timing(), "jax": jax.__version__, "nu": nu.__version__},
        suite=suite.name,
        commit=commit,
        eval_key=suite.eval_key(preset.train),
        seeds_from=[sv.provenance() for sv in seeds_from],
        fingerprint=fingerprint,
    )


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


@dataclasses.dataclass
class _SeedJobs:
    """What every job of one seed shares: the adapters, their scores, the evaluator, the caches."""

    seed: int
    adapters: list[Any]
    scores: Any
    evaluator: ev.MergeSearch  # the suite's evaluator
    suite: Any
    alpha: Any
    jobs_cache: JobCache
    base_key: dict[str, Any]
    last_coef: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    moments: Any = None  # (key, thunk) of the tasks' input moments (:func:`_moments_of`)
    grid: gr.GridConfig | None = None  # its ``search``: options chosen on validation

    def run(self, job: gr.Job) -> tuple[dict[str, Any], np.ndarray]:
        """``(record, test correctness)`` of ``job``: from the job cache, else merged and
        evaluated (and cached). Its coefficient search starts from the coefficient chosen last
        for the same method and space."""
        spec = gr.METHODS[job.method]
        start = self.last_coef.get((job.method, job.space), spec.start)
        path = self.jobs_cache.path(self.seed, job, self.job_key(job, start))
        hit = self.jobs_cache.load(path)
        if hit is not None:
            rec, ok = hit
            rec = {**rec, "cache_hit": True}
        else:
            rec, ok = self._compute(job, spec, start)
            self.jobs_cache.store(path, rec, ok)
        rec["spaces"] = list(job.spaces)
        self.last_coef[(job.method, job.space)] = rec["coef"]
        return rec, ok

    def job_key(self, job: gr.Job, start: float) -> str:
        """The job's cache key: a hash of everything that determines its result (the input
        moments' settings for a data-aware job only, so that no other job's key depends on
        them)."""
        spec = gr.METHODS[job.method]
        what = {**self.base_key, "job": dataclasses.asdict(job) | {"spaces": None}}
        what |= {"options": dict(spec.options), "start": start, "seed": self.seed}
        var = gr.VARIANTS.get(job.allocation)
        if var is not None and var.data and self.moments is not None:
            what["moments"] = self.moments[0]
        searched = self.grid.searched(job.method) if self.grid is not None else None
        if searched is not None:  # only then: every other job's key is as it was
            what["search"] = [searched[0], list(searched[1])]
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()

    def _compute(
        self, job: gr.Job, spec: gr.MethodSpec, start: float
    ) -> tuple[dict[str, Any], np.ndarray]:
        ts = time.perf_counter()
        searched = self.grid.searched(job.method) if self.grid is not None else None
        coef = 1.0 / len(self.adapters) if job.allocation == "average" else None
        passes0 = self.suite.timing()["passes"]
        options, option_scores, tm = dict(spec.options), None, 0.0
        if searched is None:
            merged, fields = self._merge(job)
            tm = time.perf_counter() - ts
            res = self.evaluator.evaluate(merged, start=start, coef=coef)
        else:  # the option and the coefficient chosen on validation, then one test pass
            name, candidates = searched
            best, option_scores = None, {}
            for value in candidates:
                tv = time.perf_counter()
                merged, f = self._merge(job, {name: value})
                tm += time.perf_counter() - tv
                dk, search = self.evaluator.choose(merged, start=start, coef=coef)
                option_scores[f"{value:g}"] = search.scores[search.coef]
                # ties go to the earlier candidate, as in the coefficient search
                if best is None or search.scores[search.coef] > best[0]:
                    best = (search.scores[search.coef], value, dk, search, f)
                del merged, dk
            _, value, dk, search, fields = best
            options[name] = value
            res = self.evaluator.test_of(dk, search)
        rec = {
            "key": job.key,
            "seed": self.seed,
            "method": job.method,
            "label": spec.label,
            "space": job.space,
            "spaces": list(job.spaces),
            "budget": job.budget,
            "allocation": job.allocation,
            "draw": job.draw,
            "options": options,
            **(
                {"option_search": {"option": searched[0], "validation": option_scores}}
                if searched is not None
                else {}
            ),
            **fields,
            "coef": res.coef,
            "coef_start": start,
            "val_scores": {f"{c:g}": s for c, s in res.val_scores.items()},
            "val_normalized": res.val_normalized,
            "test_accuracy": res.test_accuracy,
            "test_normalized": res.test_normalized.per_task,
            "normalized": res.test_normalized.mean,
            "merge_seconds": tm,
            "eval_seconds": time.perf_counter() - ts - tm,
            "val_passes": self.suite.timing()["passes"] - passes0 - 1,
            "cache_hit": False,
        }
        return rec, res.test_correct

    def _merge(self, job: gr.Job, options: Mapping[str, Any] | None = None):
        return _merge(
            self.adapters,
            job,
            seed=self.seed,
            alpha=self.alpha,
            scores=self.scores,
            moments=None if self.moments is None else self.moments[1],
            options=options,
        )


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
    runs = _SeedJobs(
        seed, adapters, scores, evaluator, suite, alpha, jobs_cache, base_key, moments=moments,
        grid=preset.grid,
    )  # fmt: skip
    records: dict[str, dict[str, Any]] = {}
    correct: dict[str, np.ndarray] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for job in jobs:
        bar.set_postfix_str(f"seed {seed} {job.key}")
        rec, ok = runs.run(job)
        records[job.key], correct[job.key] = rec, ok
        bar.update(1)
        if not progress:
            log(
                f"seed {seed} {job.key}: normalized accuracy {rec['normalized']:.1f} "
                f"(coef {rec['coef']:g}{', cached' if rec['cache_hit'] else ''})"
            )
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
