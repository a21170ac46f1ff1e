"""The planted-interference study: a known conflict (or agreement) between tasks, and which
allocation finds it (pre-registered in docs/experiments.md before any run; this
project's design, not the paper's).

For declared victim -> carrier pairs, each victim's top-2 singular components (``sigma_k x_k
y_k^T`` of its update ``dK = scale a b``, kernel layout ``(d_in, d_out)``) are appended, in every
module, to the carrier's LoRA factors scaled by ``-gamma`` (conflict: a task-arithmetic merge
with coefficient 1 cancels ``gamma`` of them) or ``+gamma`` (agreement); the null arm is the
unplanted set. Every allocation is then scored on the planted set and merged (TA, full space);
normalised accuracy is against the unplanted single LoRAs (the suite's evaluator of the
unplanted adapters).

Read-outs: (a) the fraction of each plant an allocation keeps (:func:`plant_kept`, exact: the
plant's energy inside the kept singular directions of the carrier's planted update, over its
energy), and of the victims' own top-2 directions; (b) the victims' and the mean normalised
accuracy of every merge, with the paired bootstrap over test texts and the t interval over
seeds (:mod:`stats`); (c) positive-only admission against keep-all in the conflict arm.

The parts: :mod:`plants` (the registered design, the plants and read-out (a)), this module
(one seed run, saved and read back), :mod:`planting_report` (the report of every seed found,
:func:`render` and :func:`write`) and :mod:`planting_markdown` (its ``results.md``).

Part of the harness: imports no model; the suite (the encoder's) is passed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import netutility_jax as nu

from . import stats as st
from .grid import Job
from .jobs import JobCache
from .planting_report import render as render
from .planting_report import write as write
from .plants import ALLOCATIONS as ALLOCATIONS
from .plants import ARMS as ARMS
from .plants import BONFERRONI as BONFERRONI
from .plants import BUDGETS as BUDGETS
from .plants import DATA_WEAKER, all_merges, masks_of
from .plants import PAIRS as PAIRS
from .plants import PRIMARY as PRIMARY
from .plants import PRIMARY_DELTAS as PRIMARY_DELTAS
from .plants import REGISTERED_SEEDS as REGISTERED_SEEDS
from .plants import TOP as TOP
from .plants import Arm as Arm
from .plants import Plant as Plant
from .plants import plant as plant
from .plants import plant_kept as plant_kept
from .plants import readout_a as readout_a
from .plants import top_components as top_components

__all__ = [
    "ALLOCATIONS",
    "ARMS",
    "PAIRS",
    "PRIMARY",
    "TOP",
    "Arm",
    "Plant",
    "load_seeds",
    "merge_label",
    "merges_to_run",
    "parse_merges",
    "plant",
    "plant_kept",
    "render",
    "run_seed",
    "save_seed",
    "top_components",
    "write",
]


def _digest(masks: Mapping[str, Any]) -> str:
    h = hashlib.sha256()
    for n in sorted(masks):
        h.update(n.encode())
        h.update(np.ascontiguousarray(np.asarray(masks[n], bool)).tobytes())
    return h.hexdigest()


def _merge_key(r: int | None) -> str:
    return "full" if r is None else f"R{r}"


# ------------------------------------------------------------------------------ one seed


def run_seed(
    seed: int,
    task_list: Sequence[Any],
    preset: Any,
    suite: Any,
    *,
    cache_dir: str | os.PathLike,
    merges: str | Sequence[tuple[str, str, int | None]] = "primary",
    log: Callable[[str], None] = print,
    progress: bool = False,
    alpha: Any = "auto",
    pairs: Sequence[tuple[str, str]] = PAIRS,
) -> dict[str, Any]:
    """One seed of the study: train (or load) the adapters, plant every arm, read-out (a) for
    every allocation, and evaluate the ``merges`` (``"primary"``: :data:`PRIMARY`; ``"all"``:
    every arm, allocation and budget; ``"none"``: read-out (a) only; or the chosen ``(arm,
    allocation, budget)`` triples of :func:`all_merges`, recorded as such). Returns the seed's
    record (JSON-ready) and its test correctness per merge (``record["correct"]``, popped by the
    caller)."""
    todo = _todo(merges)
    t0, c0 = time.perf_counter(), time.process_time()
    cache = pathlib.Path(cache_dir)
    heads = suite.heads(task_list)
    val, test = suite.eval_sets(task_list, heads, preset.train)
    tcfg = dataclasses.replace(preset.train, seed=seed)
    trained = suite.train_tasks(task_list, heads, tcfg, cache_dir=cache, progress=progress, log=log)
    names = [t.name for t in trained]
    evaluation = _Evaluation(
        seed, suite, trained, heads, val, test, cache,
        base_key={
            "study": "planted",
            "version": 1,
            "adapters": [t.info["cache_key"] for t in trained],
            "eval": suite.eval_key(preset.train),
            "seed": seed,
        },
    )  # fmt: skip
    arms = _read_out(
        seed, [t.adapter for t in trained], names, suite, task_list, alpha=alpha, pairs=pairs,
        log=log,
    )  # fmt: skip
    records, correct = evaluation.run(todo, arms, log)
    single = None
    if records:
        single = np.asarray(evaluation.evaluator().single_test_correct, bool)
    built = evaluation.built
    return {
        "seed": seed,
        "tasks": names,
        "pairs": [list(p) for p in pairs],
        "init": getattr(preset.train, "init", None),
        "training": {
            t.name: {k: t.info.get(k) for k in ("cache_key", "steps", "best_step")} for t in trained
        },
        "single_test": dict(built.single_test) if built is not None else None,
        "lam": arms.lams,
        "diagnostics": arms.diagnostics,
        "readout_a": arms.readouts,
        "records": records,
        "merges": merges if isinstance(merges, str) else [list(m) for m in todo],
        "seconds": {"total": time.perf_counter() - t0, "cpu": time.process_time() - c0},
        "correct": correct,
        "single_correct": single,
        "test_task": np.asarray(test.task),
    }


def _todo(merges: Any) -> tuple[tuple[str, str, int | None], ...]:
    """The merges :func:`run_seed` evaluates, for its ``merges`` argument."""
    named = {"primary": PRIMARY, "all": all_merges(), "none": (), "data_weaker": DATA_WEAKER}
    if isinstance(merges, str):
        if merges not in named:
            raise nu.InputError(
                f"run_seed: merges={merges!r}; expected 'primary', 'all', 'none', 'data_weaker' "
                "or a sequence "
                "of (arm, allocation, budget) triples."
            )
        return named[merges]
    known = set(named["all"])
    todo = tuple(tuple(m) for m in merges)
    unknown = [m for m in todo if m not in known]
    if unknown or not todo:
        raise nu.InputError(
            f"run_seed: merges {unknown or 'empty'} are not merges of the study; choose (arm, "
            f"allocation, budget) triples of all_merges(), e.g. {PRIMARY[0]}."
        )
    return todo


def merge_label(merge: Sequence[Any]) -> str:
    """``"arm/allocation/R16"`` (or ``.../full``) of an ``(arm, allocation, budget)`` triple."""
    arm, alloc, r = merge
    return f"{arm}/{alloc}/{_merge_key(r)}"


def parse_merges(text: str) -> str | tuple[tuple[str, str, int | None], ...]:
    """``"none"``, ``"primary"``, ``"all"``, ``"data_weaker"`` or comma-separated merge labels of
    :func:`merge_label` (``conflict_g1/signed_weaker/R16,agreement_g1/all/full``) as triples.

    Raises:
      InputError: a label that is not a merge of the study (the known arms, allocations and
        budgets named).
    """
    text = text.strip()
    if text in ("none", "primary", "all", "data_weaker"):
        return text
    by_label = {merge_label(m): m for m in all_merges()}
    labels = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in labels if t not in by_label]
    if unknown or not labels:
        raise nu.InputError(
            f"merges {unknown or repr(text)}: expected none, primary, all, data_weaker or "
            "labels "
            "arm/allocation/budget of the study's merges (arms "
            f"{', '.join(a.name for a in ARMS)}; allocations {', '.join(ALLOCATIONS)}; budgets "
            f"{', '.join(f'R{r}' for r in BUDGETS)} for uniform and global ones, full for the "
            f"others), e.g. {merge_label(PRIMARY[0])}"
        )
    return tuple(dict.fromkeys(by_label[t] for t in labels))


def merges_to_run(recorded: Any, asked: Any) -> Any:
    """What a seed already saved with ``recorded`` merges must evaluate for a call asking
    ``asked`` (each a name or triples, as :func:`run_seed` takes them): None when it has them
    all; else everything it had and everything asked (a name when that is the whole of it, the
    triples in :func:`all_merges` order otherwise), so a seed run again keeps what it had
    (cached merges come back from the job cache)."""
    had, want = set(_todo(recorded)), set(_todo(asked))
    if want <= had:
        return None
    both = had | want
    for name in ("none", "primary", "all", "data_weaker"):
        if both == set(_todo(name)):
            return name
    return tuple(m for m in all_merges() if m in both)


@dataclasses.dataclass
class _Arms:
    """Every arm of one seed: its adapters, lambdas, read-out (a) and diagnostics by arm, and
    the masks of each ``(arm, allocation, budget)``."""

    sets: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    lams: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    readouts: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    diagnostics: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    masks: dict[tuple[str, str, int | None], dict[str, np.ndarray]] = dataclasses.field(
        default_factory=dict
    )


def _read_out(
    seed: int,
    base: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    suite: Any,
    task_list: Sequence[Any],
    *,
    alpha: Any,
    pairs: Sequence[tuple[str, str]],
    log: Callable[[str], None],
) -> _Arms:
    """Plant every arm in the trained adapters ``base`` and read it out: each allocation's
    masks and read-out (a), how far apart the allocations choose, and the random-rotation
    control (the suite's input moments computed once, when a data-aware allocation first
    needs them)."""
    held: list[Any] = []

    def moments():
        if not held:
            held.append(suite.input_moments(task_list))
        return held[0]

    arms = _Arms()
    for arm in ARMS:
        ads, plants = plant(base, names, arm, pairs)
        arms.sets[arm.name] = ads
        arms.lams[arm.name], arms.readouts[arm.name] = _allocations(
            ads, names, plants, arm, suite, moments, arms.masks, alpha=alpha, pairs=pairs
        )
        arms.readouts[arm.name]["_changed"] = _changed(arms.masks, arm.name)
        arms.diagnostics[arm.name] = d = _diagnostics(ads, names, alpha)
        log(
            f"planted seed {seed} {arm.name}: lambda {arms.lams[arm.name]['net_utility']:.3g}, "
            f"rotation control changes {100 * d['rotation_changed_fraction']:.1f}% of kept "
            "directions"
        )
    return arms


def _allocations(
    ads: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    plants: Sequence[Any],
    arm: Arm,
    suite: Any,
    moments: Callable[[], Any],
    masks: dict[tuple[str, str, int | None], dict[str, np.ndarray]],
    *,
    alpha: Any,
    pairs: Sequence[tuple[str, str]],
) -> tuple[dict[str, float], dict[str, Any]]:
    """``(lambdas, read-outs)`` of one arm: read-out (a) of every allocation at each budget
    (the data-aware ones only when the suite has input moments); their masks go to ``masks``."""
    memo: dict[Any, Any] = {}
    sc0 = nu.score(ads, alpha=alpha, lam="auto")
    lam0 = float(sc0.lam)
    memo[(None, False, "overlap")] = sc0
    readouts: dict[str, Any] = {}
    for alloc, spec in ALLOCATIONS.items():
        if spec.get("data") and not hasattr(suite, "input_moments"):
            continue
        for r in BUDGETS if spec["kind"] in ("uniform", "global") else (None,):
            m, sc = masks_of(ads, alloc, r, alpha=alpha, lam0=lam0, moments=moments, memo=memo)
            masks[(arm.name, alloc, r)] = m
            kept = int(sum(v.sum() for v in m.values()))
            readouts[f"{alloc}/{_merge_key(r)}"] = {
                "kept": kept,
                "lam": float(sc.lam),
                "pairs": readout_a(ads, names, m, plants, pairs),
            }
    return {"net_utility": lam0, "alpha": float(sc0.alpha)}, readouts


def _changed(masks: Mapping[tuple[str, str, int | None], Any], arm: str) -> dict[str, float]:
    """How far apart the allocations' choices are in ``arm`` at each budget: the symmetric
    difference of two allocations' kept directions over both kept together."""
    changes = {}
    for r in BUDGETS:
        for a, b in (
            ("signed", "net_utility"),
            ("signed", "energy"),
            ("net_utility", "energy"),
        ):
            ma, mb = masks[(arm, a, r)], masks[(arm, b, r)]
            diff = sum(int((ma[n] != mb[n]).sum()) for n in ma)
            both = sum(int(ma[n].sum() + mb[n].sum()) for n in ma)
            changes[f"{a} vs {b}/R{r}"] = diff / both if both else 0.0
    return changes


def _diagnostics(ads: Sequence[Mapping[str, Any]], names: Sequence[str], alpha: Any) -> dict:
    """The manipulation check: the random-rotation control's changed fraction at R = 16."""
    d = nu.diagnose(ads, budget=16, alpha=alpha, names=names)
    return {
        "rotation_changed_fraction": float(d.rotation_changed_fraction),
        "overlap_vs_chance": float(d.overlap_vs_chance),
        "lambda_changes": {f"{k:g}": int(v) for k, v in d.lambda_changes.items()},
    }


@dataclasses.dataclass
class _Evaluation:
    """The accuracy of one seed's merges (TA, full space): each from the job cache
    (``<cache>/planted``), else merged and evaluated by the suite's evaluator, which is built
    when first needed."""

    seed: int
    suite: Any
    trained: list[Any]
    heads: Any
    val: Any
    test: Any
    cache: pathlib.Path
    base_key: dict[str, Any]
    built: Any = None  # the suite's evaluator, once built

    def evaluator(self) -> Any:
        if self.built is None:
            self.built = self.suite.evaluator(
                self.trained, self.heads, self.val, self.test, cache_dir=self.cache
            )
        return self.built

    def run(
        self, todo: Sequence[tuple[str, str, int | None]], arms: _Arms, log: Callable[[str], None]
    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(records, test correctness)`` by label of the merges ``todo`` that were read out."""
        jobs = JobCache(self.cache / "planted")
        records: dict[str, Any] = {}
        correct: dict[str, np.ndarray] = {}
        for arm_name, alloc, r in todo:
            if (arm_name, alloc, r) not in arms.masks:
                continue
            label = f"{arm_name}/{alloc}/{_merge_key(r)}"
            masks = arms.masks[(arm_name, alloc, r)]
            what = {**self.base_key, "arm": arm_name, "masks": _digest(masks)}
            key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
            path = jobs.path(self.seed, Job(label, "ta", "full", ("full",), r, alloc), key)
            hit = jobs.load(path)
            if hit is not None:
                rec, ok = hit
                rec = {**rec, "cache_hit": True}
            else:
                rec, ok = self._merge(arms.sets[arm_name], masks)
                jobs.store(path, rec, ok)
            records[label], correct[label] = rec, np.asarray(ok, bool)
            log(
                f"planted seed {self.seed} {label}: normalized accuracy {rec['normalized']:.1f} "
                f"(coef {rec['coef']:g}{', cached' if rec['cache_hit'] else ''})"
            )
        return records, correct

    def _merge(self, ads: Sequence[Mapping[str, Any]], masks: Mapping[str, Any]):
        """``(record, test correctness)`` of one merge, evaluated (the coefficient searched on
        validation from 0.3)."""
        import jax

        evaluator = self.evaluator()
        ts = time.perf_counter()
        merged = jax.block_until_ready(nu.merge(ads, masks, method="ta", space="full"))
        res = evaluator.evaluate(merged, start=0.3)
        rec = {
            "coef": res.coef,
            "val_normalized": res.val_normalized,
            "test_accuracy": res.test_accuracy,
            "test_normalized": res.test_normalized.per_task,
            "normalized": res.test_normalized.mean,
            "seconds": time.perf_counter() - ts,
            "cache_hit": False,
        }
        return rec, res.test_correct


# ------------------------------------------------------------------------------ seeds on disk


def save_seed(out: pathlib.Path, rec: dict[str, Any], *, command: str) -> None:
    """``seed<N>.json`` (record, command, commit, versions) and ``seed<N>.npz`` (the test
    correctness of every merge, the single LoRAs' and each text's task) under ``out``."""
    rec = dict(rec)
    correct = rec.pop("correct")
    single = rec.pop("single_correct")
    task = rec.pop("test_task")
    commit, versions = st.provenance()
    rec |= {"command": command, "commit": commit, "versions": versions}
    out.mkdir(parents=True, exist_ok=True)
    arrays = {f"c:{k}": v for k, v in correct.items()} | {"task": task}
    if single is not None:
        arrays["single"] = single
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    st.write_atomic(out / f"seed{rec['seed']}.npz", buf.getvalue())
    st.write_atomic(
        out / f"seed{rec['seed']}.json",
        json.dumps(st.jsonable(rec), indent=1, allow_nan=False) + "\n",
    )


def load_seeds(out: pathlib.Path) -> list[tuple[dict[str, Any], dict[str, np.ndarray]]]:
    """Every ``seed<N>.json`` of ``out`` with its arrays, in seed order."""
    found = []
    for p in sorted(out.glob("seed*.json")):
        rec = json.loads(p.read_text())
        with np.load(p.with_suffix(".npz"), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        found.append((rec, arrays))
    return sorted(found, key=lambda x: x[0]["seed"])
