"""One job of the grid: merged, evaluated, and cached on disk.

:class:`SeedJobs` runs the jobs of one training seed (:func:`runner.run_experiment` makes one
per seed): a job's record and test correctness come from the :class:`JobCache` when its key
(:meth:`SeedJobs.job_key`: a hash of everything that determines the result) is there, else the
job is merged (:func:`merge_job`: ``nu.merge_adapters`` with the allocation variant's options,
or ``nu.merge`` with a control's masks), its coefficient (and a searched method option) chosen
on validation by the suite's evaluator, evaluated once on test, and cached.

Part of the harness: no model or suite is imported here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ... import registry
from ...errors import InputError
from . import evaluate as ev
from . import grid as gr
from . import records

__all__ = ["JobCache", "SeedJobs", "masks_summary", "merge_job"]


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


def masks_summary(masks: dict[str, Any]) -> dict[str, Any]:
    """A control's masks as its record reports them: budget spent, non-prefix fraction and the
    directions kept per task."""
    import netutility_jax as nu

    return {
        "budget_spent": nu.budget_spent(masks),
        "non_prefix_fraction": nu.non_prefix_fraction(masks),
        "kept_per_task": [int(x) for x in np.asarray(nu.kept_per_task(masks))],
    }


def merge_job(
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
        fields = {"scope": scope, **masks_summary(masks)}
    else:  # the weight average
        merged = nu.merge(adapters, None, method="ta", space="full")
        fields = {}
    # one merge's LAPACK work at a time (jaxlib CPU can deadlock on concurrent batched LAPACK)
    return jax.block_until_ready(merged), fields


@dataclasses.dataclass
class SeedJobs:
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
    moments: Any = None  # (key, thunk) of the tasks' input moments (runner's _moments_of)
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
        return merge_job(
            self.adapters,
            job,
            seed=self.seed,
            alpha=self.alpha,
            scores=self.scores,
            moments=None if self.moments is None else self.moments[1],
            options=options,
        )
