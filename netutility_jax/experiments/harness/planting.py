"""The planted-interference study: a known conflict (or agreement) between tasks, and which
allocation finds it (issue 44; pre-registered in docs/experiments.md before any run; this
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

Part of the harness: imports no model; the suite (the encoder's) is passed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
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

__all__ = [
    "ALLOCATIONS",
    "ARMS",
    "PAIRS",
    "PRIMARY",
    "TOP",
    "Arm",
    "Plant",
    "plant",
    "plant_kept",
    "render",
    "run_seed",
    "top_components",
]

#: The declared victim -> carrier pairs (docs/experiments.md, pre-registration): each of the
#: first, third and fifth of the encoder's default tasks is a victim, the next task its carrier.
PAIRS = (
    ("austen_novel", "tweet_source"),
    ("word_sentiment", "word_pos"),
    ("wordnet_supersense", "verb_supersense"),
)
#: The victim's components planted in each module.
TOP = 2


@dataclasses.dataclass(frozen=True)
class Arm:
    """A set of adapters: ``sign`` -1 conflict, +1 agreement, 0 the unplanted (null) set."""

    name: str
    sign: int
    gamma: float


ARMS = (
    Arm("null", 0, 0.0),
    Arm("conflict_g1", -1, 1.0),
    Arm("agreement_g1", 1, 1.0),
    Arm("conflict_g0.5", -1, 0.5),
    Arm("agreement_g0.5", 1, 0.5),
)

#: Every allocation of the study: ``name -> (kind, options)``; ``kind`` ``"uniform"``,
#: ``"global"`` (``nu.allocate``'s global top-K, positive-only, at the budget), ``"full"``
#: (positive-only at full capacity) or ``"all"`` (every candidate); options are ``nu.score``'s
#: (``lam_scale`` times the median rule's lambda; ``data``: the input moments).
ALLOCATIONS: dict[str, dict[str, Any]] = {
    "uniform": {"kind": "uniform"},
    "energy": {"kind": "global", "lam_scale": 0.0},
    "net_utility": {"kind": "global"},
    "lam_x4": {"kind": "global", "lam_scale": 4.0},
    "net_utility_data": {"kind": "global", "data": True},
    "signed": {"kind": "global", "interference": "signed"},
    "net_utility_pos": {"kind": "full"},
    "lam_x4_pos": {"kind": "full", "lam_scale": 4.0},
    "net_utility_data_pos": {"kind": "full", "data": True},
    "signed_pos": {"kind": "full", "interference": "signed"},
    "all": {"kind": "all"},
}
BUDGETS = (16, 32)

#: The merges evaluated for accuracy first: what the pre-registered primary comparisons need
#: (gamma 1, conflict and agreement, R = 16 and full capacity: energy, Net Utility, sign-aware,
#: keep-all) and the oracle (Net Utility and keep-all on the unplanted set), as ``(arm,
#: allocation, budget)``; the rest (``--merges all``) after them.
PRIMARY = (
    *(
        (arm, alloc, r)
        for arm in ("conflict_g1", "agreement_g1")
        for alloc, r in (
            ("energy", 16),
            ("net_utility", 16),
            ("signed", 16),
            ("net_utility_pos", None),
            ("signed_pos", None),
            ("all", None),
        )
    ),
    ("null", "net_utility", 16),
    ("null", "all", None),
    # the sign-aware term on the real (unplanted) per-task adapters, against energy
    ("null", "energy", 16),
    ("null", "signed", 16),
)


def _all_merges() -> tuple[tuple[str, str, int | None], ...]:
    out = list(PRIMARY)
    for arm in ARMS:
        for alloc, spec in ALLOCATIONS.items():
            for r in BUDGETS if spec["kind"] in ("uniform", "global") else (None,):
                if (arm.name, alloc, r) not in out:
                    out.append((arm.name, alloc, r))
    return tuple(out)


# ------------------------------------------------------------------------------ the plants


def top_components(mod: Mapping[str, Any], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(sigma (k,), x (d_in, k), y (d_out, k))``: the top ``k`` singular components of
    ``dK = scale a b`` in float64, from the factors (QR of each, an ``r x r`` SVD; no dense
    ``d_in x d_out`` matrix)."""
    a = np.asarray(mod["lora_a"], np.float64)
    b = np.asarray(mod["lora_b"], np.float64)
    qa, ra = np.linalg.qr(a)
    qb, rb = np.linalg.qr(b.T)
    u, s, vt = np.linalg.svd(float(mod.get("scale", 1.0)) * ra @ rb.T)
    return s[:k], qa @ u[:, :k], qb @ vt[:k].T


@dataclasses.dataclass(frozen=True)
class Plant:
    """One victim's plant in one module of its carrier: ``P = sum_k coef_k x_k y_k^T``."""

    pair: int
    module: str
    coef: np.ndarray  # (k,) sign * gamma * sigma_k
    x: np.ndarray  # (d_in, k)
    y: np.ndarray  # (d_out, k)


def plant(
    adapters: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    arm: Arm,
    pairs: Sequence[tuple[str, str]] = PAIRS,
    k: int = TOP,
) -> tuple[list[dict[str, Any]], list[Plant]]:
    """The adapters of ``arm``: each carrier's factors with its victim's top ``k`` components
    appended, scaled by ``arm.sign * arm.gamma`` (new arrays; the inputs are not changed), and
    the plants. The null arm returns the adapters as they are and no plant.

    The appended columns are ``a_k = coef_k x_k / sqrt(|c| scale)``-balanced: ``a_k = sgn *
    sqrt(|coef_k| / |scale|) x_k``, ``b_k = sqrt(|coef_k| / |scale|) y_k`` with ``sgn`` the sign
    of ``coef_k / scale``, so ``scale a_k b_k = coef_k x_k y_k^T`` exactly (up to rounding) with
    the carrier's own scale.
    """
    out = [dict(ad) for ad in adapters]
    if arm.sign == 0:
        return out, []
    index = {n: i for i, n in enumerate(names)}
    missing = [t for pair in pairs for t in pair if t not in index]
    if missing:
        raise nu.InputError(f"plant: the tasks {missing} of the declared pairs are not merged.")
    plants = []
    for p, (victim, carrier) in enumerate(pairs):
        v, c = adapters[index[victim]], out[index[carrier]]
        for name, mod in v.items():
            sig, x, y = top_components(mod, k)
            coef = arm.sign * arm.gamma * sig
            cm = c[name]
            scale = float(cm.get("scale", 1.0))
            mag = np.sqrt(np.abs(coef) / abs(scale))
            sgn = np.sign(coef / scale)
            a_new = x * (sgn * mag)[None, :]
            b_new = (y * mag[None, :]).T
            dtype = np.asarray(cm["lora_a"]).dtype
            c[name] = {
                **cm,
                "lora_a": np.concatenate([np.asarray(cm["lora_a"]), a_new.astype(dtype)], 1),
                "lora_b": np.concatenate([np.asarray(cm["lora_b"]), b_new.astype(dtype)], 0),
            }
            plants.append(Plant(p, name, coef, x, y))
    return out, plants


def plant_kept(carrier_mod: Mapping[str, Any], keep: np.ndarray, p: Plant) -> tuple[float, float]:
    """``(kept, total)`` energy of plant ``p`` under a mask row: with ``X_K``, ``Y_K`` the kept
    singular directions of the carrier's planted update (slots ``keep``, descending sigma, as
    ``nu.score`` numbers them), ``kept = ||X_K^T P Y_K||_F^2`` and ``total = ||P||_F^2``. Every
    direction kept gives ``kept = total`` (the planted update's directions span the plant);
    none gives 0."""
    a = np.asarray(carrier_mod["lora_a"], np.float64)
    b = np.asarray(carrier_mod["lora_b"], np.float64)
    qa, ra = np.linalg.qr(a)
    qb, rb = np.linalg.qr(b.T)
    u, _, vt = np.linalg.svd(float(carrier_mod.get("scale", 1.0)) * ra @ rb.T)
    r = a.shape[1]
    kept = np.flatnonzero(np.asarray(keep, bool)[:r])
    xk, yk = qa @ u[:, kept], qb @ vt[kept].T
    core = (xk.T @ p.x) * p.coef[None, :] @ (p.y.T @ yk)
    gram_x, gram_y = p.x.T @ p.x, p.y.T @ p.y
    total = float(p.coef @ (gram_x * gram_y) @ p.coef)
    return float((core**2).sum()), total


# ------------------------------------------------------------------------------ allocations


def _scores(adapters, alpha, spec, lam0, moments, memo):
    """``nu.score`` of the allocation's options (memoised per options within one arm)."""
    import netutility_jax as nu

    key = (spec.get("lam_scale"), bool(spec.get("data")), spec.get("interference", "overlap"))
    if key not in memo:
        lam = "auto" if spec.get("lam_scale") is None else float(spec["lam_scale"]) * lam0
        kw = {"input_moments": moments()} if spec.get("data") else {}
        memo[key] = nu.score(
            adapters, alpha=alpha, lam=lam, interference=spec.get("interference", "overlap"), **kw
        )
    return memo[key]


def masks_of(adapters, alloc: str, budget: int | None, *, alpha, lam0, moments, memo):
    """``{module: bool (M, r_max)}`` of allocation ``alloc`` (:data:`ALLOCATIONS`) at ``budget``
    (None: full capacity / every candidate), and the scores it used."""
    import netutility_jax as nu

    spec = ALLOCATIONS[alloc]
    sc = _scores(adapters, alpha, spec, lam0, moments, memo)
    kind = spec["kind"]
    if kind == "all":
        return {n: np.isfinite(np.asarray(m.utility)) for n, m in sc.modules.items()}, sc
    if kind == "full":
        m_tasks = len(adapters)
        r_max = max(np.asarray(m["lora_a"]).shape[1] for ad in adapters for m in ad.values())
        budget = m_tasks * r_max  # at or above the candidates: positive-only decides
    masks = nu.allocate(sc, int(budget), scope="uniform" if kind == "uniform" else "global")
    return {n: np.asarray(v) for n, v in masks.items()}, sc


def readout_a(adapters, names, masks, plants, pairs=PAIRS) -> dict[str, Any]:
    """Read-out (a) of one merge: per pair, the fraction of its plant kept (energy-weighted over
    modules) and the fraction of the victim's top-``TOP`` directions kept."""
    index = {n: i for i, n in enumerate(names)}
    out = {}
    for p, (victim, carrier) in enumerate(pairs):
        kept = total = 0.0
        for pl in (q for q in plants if q.pair == p):
            k, t = plant_kept(
                adapters[index[carrier]][pl.module], masks[pl.module][index[carrier]], pl
            )
            kept, total = kept + k, total + t
        vk = [masks[n][index[victim], :TOP] for n in masks]
        out[f"{victim}->{carrier}"] = {
            "plant_kept": kept / total if total > 0 else None,
            "victim_top_kept": float(np.mean(np.concatenate(vk))),
        }
    return out


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
    merges: str = "primary",
    log: Callable[[str], None] = print,
    progress: bool = False,
    alpha: Any = "auto",
    pairs: Sequence[tuple[str, str]] = PAIRS,
) -> dict[str, Any]:
    """One seed of the study: train (or load) the adapters, plant every arm, read-out (a) for
    every allocation, and evaluate the ``merges`` (``"primary"``: :data:`PRIMARY`; ``"all"``:
    every arm, allocation and budget; ``"none"``: read-out (a) only). Returns the seed's record
    (JSON-ready) and its test correctness per merge (``record["correct"]``, popped by the
    caller)."""
    import jax

    import netutility_jax as nu

    if merges not in ("primary", "all", "none"):
        raise nu.InputError(f"run_seed: merges={merges!r}; expected 'primary', 'all' or 'none'.")
    t0, c0 = time.perf_counter(), time.process_time()
    cache = pathlib.Path(cache_dir)
    heads = suite.heads(task_list)
    val, test = suite.eval_sets(task_list, heads, preset.train)
    tcfg = dataclasses.replace(preset.train, seed=seed)
    trained = suite.train_tasks(task_list, heads, tcfg, cache_dir=cache, progress=progress, log=log)
    names = [t.name for t in trained]
    base = [t.adapter for t in trained]
    held: list[Any] = []

    def moments():
        if not held:
            held.append(suite.input_moments(task_list))
        return held[0]

    evaluator = None
    jobs = JobCache(cache / "planted")
    base_key = {
        "study": "planted",
        "version": 1,
        "adapters": [t.info["cache_key"] for t in trained],
        "eval": suite.eval_key(preset.train),
        "seed": seed,
    }
    sets, readouts, diag, lams = {}, {}, {}, {}
    masks_all: dict[tuple[str, str, int | None], dict[str, np.ndarray]] = {}
    for arm in ARMS:
        ads, plants = plant(base, names, arm, pairs)
        sets[arm.name] = ads
        memo: dict[Any, Any] = {}
        sc0 = nu.score(ads, alpha=alpha, lam="auto")
        lam0 = float(sc0.lam)
        memo[(None, False, "overlap")] = sc0
        lams[arm.name] = {"net_utility": lam0, "alpha": float(sc0.alpha)}
        readouts[arm.name] = {}
        for alloc, spec in ALLOCATIONS.items():
            if spec.get("data") and not hasattr(suite, "input_moments"):
                continue
            for r in BUDGETS if spec["kind"] in ("uniform", "global") else (None,):
                m, sc = masks_of(ads, alloc, r, alpha=alpha, lam0=lam0, moments=moments, memo=memo)
                masks_all[(arm.name, alloc, r)] = m
                kept = int(sum(v.sum() for v in m.values()))
                readouts[arm.name][f"{alloc}/{_merge_key(r)}"] = {
                    "kept": kept,
                    "lam": float(sc.lam),
                    "pairs": readout_a(ads, names, m, plants, pairs),
                }
        # how far apart the allocations' choices are (symmetric difference over both kept)
        changes = {}
        for r in BUDGETS:
            for a, b in (
                ("signed", "net_utility"),
                ("signed", "energy"),
                ("net_utility", "energy"),
            ):
                ma, mb = masks_all[(arm.name, a, r)], masks_all[(arm.name, b, r)]
                diff = sum(int((ma[n] != mb[n]).sum()) for n in ma)
                both = sum(int(ma[n].sum() + mb[n].sum()) for n in ma)
                changes[f"{a} vs {b}/R{r}"] = diff / both if both else 0.0
        readouts[arm.name]["_changed"] = changes
        # manipulation check: the random-rotation control's changed fraction at R = 16
        d = nu.diagnose(ads, budget=16, alpha=alpha, names=names)
        diag[arm.name] = {
            "rotation_changed_fraction": float(d.rotation_changed_fraction),
            "overlap_vs_chance": float(d.overlap_vs_chance),
            "lambda_changes": {f"{k:g}": int(v) for k, v in d.lambda_changes.items()},
        }
        log(
            f"planted seed {seed} {arm.name}: lambda {lam0:.3g}, rotation control changes "
            f"{100 * diag[arm.name]['rotation_changed_fraction']:.1f}% of kept directions"
        )
    todo = {"primary": PRIMARY, "all": _all_merges(), "none": ()}[merges]
    records: dict[str, Any] = {}
    correct: dict[str, np.ndarray] = {}
    for arm_name, alloc, r in todo:
        if (arm_name, alloc, r) not in masks_all:
            continue
        label = f"{arm_name}/{alloc}/{_merge_key(r)}"
        masks = masks_all[(arm_name, alloc, r)]
        what = {**base_key, "arm": arm_name, "masks": _digest(masks)}
        key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
        path = jobs.path(seed, Job(label, "ta", "full", ("full",), r, alloc), key)
        hit = jobs.load(path)
        if hit is not None:
            rec, ok = hit
            rec = {**rec, "cache_hit": True}
        else:
            if evaluator is None:
                evaluator = suite.evaluator(trained, heads, val, test, cache_dir=cache)
            ts = time.perf_counter()
            merged = jax.block_until_ready(
                nu.merge(sets[arm_name], masks, method="ta", space="full")
            )
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
            ok = res.test_correct
            jobs.store(path, rec, ok)
        records[label], correct[label] = rec, np.asarray(ok, bool)
        log(
            f"planted seed {seed} {label}: normalized accuracy {rec['normalized']:.1f} "
            f"(coef {rec['coef']:g}{', cached' if rec['cache_hit'] else ''})"
        )
    single = None
    if records:
        if evaluator is None:
            evaluator = suite.evaluator(trained, heads, val, test, cache_dir=cache)
        single = np.asarray(evaluator.single_test_correct, bool)
    return {
        "seed": seed,
        "tasks": names,
        "pairs": [list(p) for p in pairs],
        "init": getattr(preset.train, "init", None),
        "training": {
            t.name: {k: t.info.get(k) for k in ("cache_key", "steps", "best_step")} for t in trained
        },
        "single_test": dict(evaluator.single_test) if evaluator is not None else None,
        "lam": lams,
        "diagnostics": diag,
        "readout_a": readouts,
        "records": records,
        "merges": merges,
        "seconds": {"total": time.perf_counter() - t0, "cpu": time.process_time() - c0},
        "correct": correct,
        "single_correct": single,
        "test_task": np.asarray(test.task),
    }


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


# ------------------------------------------------------------------------------ the report

#: The pre-registered primary comparisons: (label, arm, a, b) on the victims' normalised accuracy.
PRIMARY_DELTAS = tuple(
    (f"{a_lab} - energy, {arm.split('_')[0]}, {where}", arm, f"{a}/{r}", f"{b}/{r}")
    for arm in ("conflict_g1", "agreement_g1")
    for where, r, pairs in (
        ("R16", "R16", (("net_utility", "Net Utility"), ("signed", "sign-aware"))),
        (
            "full capacity",
            "full",
            (("net_utility_pos", "Net Utility"), ("signed_pos", "sign-aware")),
        ),
    )
    for (a, a_lab) in pairs
    for b in ("energy" if r == "R16" else "all",)
)
#: Bonferroni level of the eight primary comparisons (99.375%).
BONFERRONI = 1 - 0.05 / len(PRIMARY_DELTAS)


def _t_quantile(df: int, level: float) -> float:
    """Student t quantile ``(1 + level) / 2`` with ``df`` degrees of freedom."""
    from scipy import stats as sps

    return float(sps.t.ppf((1 + level) / 2, df))


#: The seeds the registered decision rule needs (docs/experiments.md, pre-registration).
REGISTERED_SEEDS = (0, 1, 2, 3, 4)


def _delta(bs: st.Bootstrap, correct_a, correct_b, single, level: float) -> dict[str, Any]:
    da, db = bs.normalized(correct_a, single), bs.normalized(correct_b, single)
    d = bs.delta(da, db)
    two = bs.two_level(da, db, seed=0)
    per = d.per_seed
    out = {
        "per_seed": [float(x) for x in per],
        "estimate": float(per.mean()),
        "text_ci95": [d.pooled.low, d.pooled.high],
        "seed_ci95": [d.seeds.low, d.seeds.high],
        "two_level_ci95": [two.low, two.high],
        "p_seeds": st.seed_p(per),
        # (B, S) resampled deltas, for the headline's mean over cells (popped before saving)
        "_boot": da.boot - db.boot,
    }
    if len(per) >= 2:
        half = _t_quantile(len(per) - 1, level) * float(per.std(ddof=1)) / math.sqrt(len(per))
        out["seed_ci_bonferroni"] = [float(per.mean() - half), float(per.mean() + half)]
    else:
        out["seed_ci_bonferroni"] = [float("nan"), float("nan")]
    return out


def _subset(task: np.ndarray, keep: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    rows = np.isin(task, keep)
    remap = {t: i for i, t in enumerate(keep)}
    return rows, np.array([remap[t] for t in task[rows]], np.int64)


def render(
    seeds: Sequence[tuple[dict[str, Any], dict[str, np.ndarray]]],
    *,
    command: str,
    n_boot: int = 2000,
):
    """``(results, markdown)`` of the seeds found (:func:`load_seeds`); ``n_boot`` text
    resamples (shared by every interval)."""
    if not seeds:
        raise nu.InputError("planted.render: no seed results to render.")
    recs = [r for r, _ in seeds]
    names = recs[0]["tasks"]
    pairs = [tuple(p) for p in recs[0]["pairs"]]
    if any([tuple(p) for p in r["pairs"]] != pairs or r["tasks"] != names for r in recs):
        raise nu.InputError("planted.render: the seeds were run with different tasks or pairs.")
    # (seeds saved before the init was recorded ran the registered per-task initialisation)
    inits = {r.get("init") or "per_task" for r in recs}
    if len(inits) > 1:
        raise nu.InputError(f"planted.render: the seeds were run with initialisations {inits}.")
    victims = [names.index(v) for v, _ in pairs]
    results: dict[str, Any] = {
        "study": "planted",
        "suite": "encoder",
        "command": command,
        **dict(zip(("commit", "versions"), st.provenance(), strict=True)),
        "seed_commits": {str(r["seed"]): r.get("commit") for r in recs},
        "seed_commands": {str(r["seed"]): r.get("command") for r in recs},
        "design": {
            "pairs": [list(p) for p in pairs],
            "top": TOP,
            "arms": [dataclasses.asdict(a) for a in ARMS],
            "allocations": ALLOCATIONS,
            "budgets": list(BUDGETS),
            "merge": "TA, full space; coefficient chosen on validation (start 0.3)",
            "normaliser": "the unplanted single LoRAs",
            "init": next(iter(inits)),
        },
        "seeds": [r["seed"] for r in recs],
        "cpu_hours": sum(r["seconds"]["cpu"] for r in recs) / 3600,
        "wall_hours": sum(r["seconds"]["total"] for r in recs) / 3600,
        "per_seed": {
            str(r["seed"]): {
                "lam": r["lam"],
                "diagnostics": r["diagnostics"],
                "merges": r["merges"],
                "seconds": r["seconds"],
            }
            for r in recs
        },
    }
    # (a): mean over seeds of each readout, exact per seed
    ra: dict[str, Any] = {}
    changed: dict[str, Any] = {}
    for arm in recs[0]["readout_a"]:
        if "_changed" in recs[0]["readout_a"][arm]:
            changed[arm] = {
                k: [r["readout_a"][arm]["_changed"][k] for r in recs]
                for k in recs[0]["readout_a"][arm]["_changed"]
            }
        for merge in recs[0]["readout_a"][arm]:
            if merge.startswith("_"):
                continue
            vals = {
                pair: {
                    k: [r["readout_a"][arm][merge]["pairs"][pair][k] for r in recs]
                    for k in ("plant_kept", "victim_top_kept")
                }
                for pair in recs[0]["readout_a"][arm][merge]["pairs"]
            }
            ra.setdefault(arm, {})[merge] = {
                "plant_kept": _mean_pairs(vals, "plant_kept"),
                "victim_top_kept": _mean_pairs(vals, "victim_top_kept"),
                "per_pair": vals,
            }
    results["readout_a"] = ra
    results["changed_between_allocations"] = changed
    # (b), (c): over the seeds that evaluated every merge read
    with_acc = [(r, a) for r, a in seeds if r["records"] and "single" in a]
    acc: dict[str, Any] = {}
    deltas: dict[str, Any] = {}
    if with_acc:
        common = set.intersection(*(set(r["records"]) for r, _ in with_acc))
        task = with_acc[0][1]["task"]
        single = np.stack([a["single"] for _, a in with_acc])
        bs_all = st.Bootstrap(task, n_boot=n_boot)
        rows, vt = _subset(task, victims)
        bs_vic = st.Bootstrap(vt, n_boot=n_boot)

        def corr(label):
            return np.stack([a[f"c:{label}"] for _, a in with_acc])

        for label in sorted(common):
            c = corr(label)
            acc[label] = {
                "mean": _iv(bs_all, bs_all.normalized(c, single)),
                "victims": _iv(bs_vic, bs_vic.normalized(c[:, rows], single[:, rows])),
            }
        pairs_to_do = [(lab, arm, a, b, True) for lab, arm, a, b in PRIMARY_DELTAS]
        for arm in ("conflict_g1", "agreement_g1", "null", "conflict_g0.5", "agreement_g0.5"):
            for r in ("R16", "R32"):
                for a in ("uniform", "net_utility", "lam_x4", "net_utility_data", "signed"):
                    pairs_to_do.append(
                        (f"{a} - energy, {arm}, {r}", arm, f"{a}/{r}", f"energy/{r}", False)
                    )
                if arm != "null":  # the oracle: Net Utility on the unplanted set
                    for a in ("energy", "net_utility", "signed"):
                        pairs_to_do.append(
                            (
                                f"{a} - oracle, {arm}, {r}",
                                arm,
                                f"{a}/{r}",
                                ("null", f"net_utility/{r}"),
                                False,
                            )
                        )
            for a in ("net_utility_pos", "signed_pos", "lam_x4_pos", "net_utility_data_pos"):
                pairs_to_do.append((f"{a} - keep-all, {arm}", arm, f"{a}/full", "all/full", False))
            if arm != "null":
                pairs_to_do.append(
                    (
                        f"keep-all - oracle keep-all, {arm}",
                        arm,
                        "all/full",
                        ("null", "all/full"),
                        False,
                    )
                )
        done: set[tuple[str, str]] = set()
        for lab, arm, a, b, primary in pairs_to_do:
            la = f"{arm}/{a}"
            lb = f"{b[0]}/{b[1]}" if isinstance(b, tuple) else f"{arm}/{b}"
            if la not in common or lb not in common or (la, lb) in done:
                continue  # (a secondary pairing that is a primary one is shown once)
            done.add((la, lb))
            ca, cb = corr(la), corr(lb)
            level = BONFERRONI if primary else 0.95
            deltas[lab] = {
                "primary": primary,
                "a": la,
                "b": lb,
                "victims": _delta(bs_vic, ca[:, rows], cb[:, rows], single[:, rows], level),
                "mean": _delta(bs_all, ca, cb, single, level),
            }
        acc_seeds = [r["seed"] for r, _ in with_acc]
        results["accuracy_seeds"] = acc_seeds
        results["headline"] = _headline(deltas)
        results["multiplicity"] = _multiplicity(deltas, acc_seeds)
        for d in deltas.values():
            for side in ("victims", "mean"):
                d[side].pop("_boot")
    results["accuracy"] = acc
    results["deltas"] = deltas
    results = st.jsonable(results)
    return results, _markdown(results)


def _mean_pairs(vals: Mapping[str, Any], key: str) -> float | None:
    xs = [x for v in vals.values() for x in v[key] if x is not None]
    return float(np.mean(xs)) if xs else None


def _iv(bs: st.Bootstrap, draws: st.NormalizedDraws) -> dict[str, Any]:
    s = bs.interval(draws)
    two = bs.two_level(draws, seed=0)
    return {
        "estimate": s.pooled.estimate,
        "text_ci95": [s.pooled.low, s.pooled.high],
        "seed_ci95": [s.seeds.low, s.seeds.high],
        "two_level_ci95": [two.low, two.high],
        "per_seed": [float(x) for x in s.per_seed],
    }


#: The grid-level headline: each allocation's primary contrast averaged over the primary cells
#: (conflict and agreement, R = 16 and full capacity), and over each arm's two budgets.
HEADLINE = (
    ("Net Utility - energy", "Net Utility - energy"),
    ("sign-aware - energy", "sign-aware - energy"),
)


def _headline(deltas: Mapping[str, Any]) -> dict[str, Any]:
    """Per primary contrast, the mean over its cells per seed, with the t interval over seeds and
    the two-level interval (the cells share the seeds and the test texts, so a replicate averages
    the cells' resampled deltas on the same texts and seeds)."""
    out: dict[str, Any] = {}
    for name, prefix in HEADLINE:
        for scope, arms in (
            ("all four primary cells", ("conflict", "agreement")),
            ("conflict arm (R16, full capacity)", ("conflict",)),
            ("agreement arm (R16, full capacity)", ("agreement",)),
        ):
            cells = [
                lab
                for lab, *_ in PRIMARY_DELTAS
                if lab.startswith(prefix + ",") and lab.split(", ")[1] in arms
            ]
            if not cells or any(c not in deltas for c in cells):
                continue
            row: dict[str, Any] = {"cells": cells}
            for side in ("victims", "mean"):
                per = np.mean([deltas[c][side]["per_seed"] for c in cells], axis=0)
                boot = np.mean([deltas[c][side]["_boot"] for c in cells], axis=0)
                seed_iv = st.seed_interval(per)
                two = st.two_level(per, boot, seed=0)
                row[side] = {
                    "per_seed": [float(x) for x in per],
                    "estimate": seed_iv.estimate,
                    "seed_ci95": [seed_iv.low, seed_iv.high],
                    "two_level_ci95": [two.low, two.high],
                }
            out[f"{name}, {scope}"] = row
    return out


def _multiplicity(deltas: dict[str, Any], acc_seeds: Sequence[int]) -> dict[str, Any]:
    """Holm over the primary family (the victims' outcome of the registered comparisons) and,
    separately, over every other delta shown (secondary victims' and every all-tasks delta);
    the registered decision (Bonferroni t interval over the five registered seeds) where every
    registered seed has accuracy. Writes ``p_holm``/``holm_reject``/``decision`` into the
    deltas."""
    primary = {lab: d["victims"]["p_seeds"] for lab, d in deltas.items() if d["primary"]}
    secondary = {
        f"{lab} | {side}": d[side]["p_seeds"]
        for lab, d in deltas.items()
        for side in ("victims", "mean")
        if not (d["primary"] and side == "victims")
    }
    hp, hs = st.holm(primary), st.holm(secondary)
    registered = sorted(acc_seeds) == list(REGISTERED_SEEDS)
    for lab, d in deltas.items():
        for side in ("victims", "mean"):
            h = hp[lab] if d["primary"] and side == "victims" else hs[f"{lab} | {side}"]
            d[side]["p_holm"] = h["p_holm"]
            d[side]["holm_reject"] = h["reject"]
        if d["primary"]:
            lo, hi = d["victims"]["seed_ci_bonferroni"]
            d["decision"] = (
                ("gain" if lo > 0 else "loss" if hi < 0 else "no difference declared")
                if registered
                else f"not applied ({len(acc_seeds)} of the 5 registered seeds)"
            )
    return {
        "primary_family": sum(not math.isnan(float(v)) for v in primary.values()),
        "primary_holm_survivors": [k for k, v in hp.items() if v["reject"]],
        "secondary_family": sum(not math.isnan(float(v)) for v in secondary.values()),
        "secondary_holm_survivors": [k for k, v in hs.items() if v["reject"]],
        "registered_rule_applied": registered,
    }


def _f(x: Any, nd: int = 1, sign: bool = False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"


def _p(x: Any) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.3f}" if x >= 0.001 else "<0.001"


def _ci(v: Sequence[Any], sign: bool = True) -> str:
    return f"[{_f(v[0], 1 + sign, sign)}, {_f(v[1], 1 + sign, sign)}]"


def _markdown(res: Mapping[str, Any]) -> str:
    seeds = res["seeds"]
    lines = [
        "# The planted-interference study (this project's design, pre-registered in docs/experiments.md)",
        "",
        f"Written by `{res['command']}` (commit {(res['commit'] or {}).get('head')}); seeds "
        f"{', '.join(map(str, seeds))} (read-out (a)); accuracy on seeds "
        f"{', '.join(map(str, res.get('accuracy_seeds', []))) or 'none'}; "
        f"{res['cpu_hours']:.2f} CPU hours, {res['wall_hours']:.2f} wall hours over the seeds' processes.",
        "",
        f"LoRA initialisation: {res['design']['init']}. Victim -> carrier pairs: "
        + "; ".join(f"{v} -> {c}" for v, c in res["design"]["pairs"])
        + f". The victim's top {res['design']['top']} components of every module are appended to "
        "its carrier scaled by -gamma (conflict) or +gamma (agreement). TA in full space, the "
        "coefficient chosen on validation; normalised against the unplanted single LoRAs.",
        "",
        "## Manipulation check: the random-rotation control at R = 16",
        "",
        "The fraction of Net Utility's kept directions that change when every task's input side "
        "is rotated at random (nu.diagnose), and (in brackets) the input overlap over chance. "
        "Pre-registered: the plant counts as seen if, at gamma = 1, the fraction is at least 3x "
        "the null arm's in the mean over seeds, in both planted arms.",
        "",
        "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|" + "---|" * len(seeds),
    ]
    for arm in res["per_seed"][str(seeds[0])]["diagnostics"]:
        row = []
        for s in seeds:
            d = res["per_seed"][str(s)]["diagnostics"][arm]
            row.append(
                f"{100 * d['rotation_changed_fraction']:.1f}% ({d['overlap_vs_chance']:.2f}x)"
            )
        lines.append(f"| {arm} | " + " | ".join(row) + " |")
    lines += [
        "",
        "## (a) Planted directions kept (exact; mean over pairs and seeds)",
        "",
        "Fraction of each plant's energy inside the kept singular directions of its carrier, and "
        "(in brackets) the fraction of the victims' own top-2 directions kept.",
        "",
    ]
    ra = res["readout_a"]
    merges = list(next(iter(ra.values())).keys())
    lines.append("| merge | " + " | ".join(ra) + " |")
    lines.append("|---|" + "---|" * len(ra))
    for m in merges:
        cells = []
        for arm in ra:
            x = ra[arm].get(m)
            cells.append(
                "n/a" if x is None else f"{_f(x['plant_kept'], 2)} ({_f(x['victim_top_kept'], 2)})"
            )
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    ch = res.get("changed_between_allocations") or {}
    if ch:
        keys = list(next(iter(ch.values())))
        lines += [
            "",
            "## How far apart the allocations choose (exact)",
            "",
            "Directions whose kept status differs between two allocations, over the directions "
            "both keep together (symmetric difference / (kept_a + kept_b)), mean over seeds.",
            "",
            "| arm | " + " | ".join(keys) + " |",
            "|---|" + "---|" * len(keys),
        ]
        for arm, v in ch.items():
            lines.append(
                f"| {arm} | "
                + " | ".join(f"{100 * float(np.mean(v[k])):.1f}%" for k in keys)
                + " |"
            )
    if res["accuracy"]:
        acc_seeds = res.get("accuracy_seeds", [])
        mult = res.get("multiplicity") or {}
        lines += [
            "",
            "## Headline: each primary contrast over the primary cells",
            "",
            "Per seed, the mean of the contrast over its cells (gamma = 1; R16 and full capacity; "
            "the conflict and agreement arms together and each alone), then the mean over the "
            f"{len(acc_seeds)} seeds with the t interval over seeds (95%) and the two-level "
            "bootstrap interval (seeds and test texts resampled together; 95%). Victims' "
            "normalised accuracy, and all tasks'.",
            "",
            "| contrast, cells | victims | per seed | seed 95% | two-level 95% | all tasks | "
            "seed 95% | two-level 95% |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for lab, h in (res.get("headline") or {}).items():
            v, m = h["victims"], h["mean"]
            lines.append(
                f"| {lab} | {_f(v['estimate'], 2, True)} | "
                f"{', '.join(_f(x, 1, True) for x in v['per_seed'])} | {_ci(v['seed_ci95'])} | "
                f"{_ci(v['two_level_ci95'])} | {_f(m['estimate'], 2, True)} | "
                f"{_ci(m['seed_ci95'])} | {_ci(m['two_level_ci95'])} |"
            )
        lines += [
            "",
            "## (b) Normalised accuracy of each merge",
            "",
            "Mean over seeds; the victims' (mean over the victims) and all tasks'; the 95% "
            "bootstrap interval over test texts (adapters fixed) and the two-level interval "
            "(seeds and texts).",
            "",
            "| merge | victims | texts 95% | two-level 95% | all tasks | texts 95% | two-level 95% |",
            "|---|---|---|---|---|---|---|",
        ]
        for lab, v in res["accuracy"].items():
            vi, me = v["victims"], v["mean"]
            lines.append(
                f"| {lab} | {_f(vi['estimate'])} | {_ci(vi['text_ci95'], False)} | "
                f"{_ci(vi.get('two_level_ci95', [None, None]), False)} | {_f(me['estimate'])} | "
                f"{_ci(me['text_ci95'], False)} | "
                f"{_ci(me.get('two_level_ci95', [None, None]), False)} |"
            )
        surv_p = mult.get("primary_holm_survivors", [])
        surv_s = mult.get("secondary_holm_survivors", [])
        lines += [
            "",
            "## Deltas (primary comparisons first)",
            "",
            "Victims' normalised accuracy (and all tasks'), mean over seeds (per seed in the order "
            f"{', '.join(map(str, acc_seeds))}): the paired bootstrap 95% interval over test "
            "texts (adapters fixed), the t interval over seeds (95%; for the primary comparisons "
            f"also at the registered Bonferroni level {100 * BONFERRONI:.3f}%), the two-level "
            "interval (seeds and texts resampled together, 95%), the two-sided p of the t test "
            "over seeds and its Holm-adjusted value within its family. With fewer than two seeds "
            "there is no seed interval; the text interval alone does not include the seed noise "
            "and decides nothing under the pre-registered rule. With three to five seeds the "
            "two-level (percentile) interval has no small-sample correction and is often "
            "narrower than the t interval over seeds: it shows how much the test texts add, "
            "and the registered rule reads the t interval.",
            "",
            f"**Multiplicity.** {mult.get('primary_family', 0)} primary comparisons (the victims' "
            "outcome, registered): the registered decision is the Bonferroni t interval over the "
            "five registered seeds"
            + (
                ""
                if mult.get("registered_rule_applied")
                else f" (not applied: accuracy on {len(acc_seeds)} of the 5 registered seeds)"
            )
            + "; Holm at family-wise 5% over the "
            f"{mult.get('primary_family', 0)} keeps "
            + ("; ".join(surv_p) if surv_p else "none")
            + f". The other {mult.get('secondary_family', 0)} deltas shown (secondary "
            "comparisons, and the all-tasks outcome of every comparison) are one family: Holm "
            f"keeps {len(surv_s)} of them"
            + (f" ({'; '.join(surv_s)})" if surv_s else "")
            + ". Read any other delta as exploratory.",
            "",
            "| comparison | victims | per seed | text 95% | seed 95% | two-level 95% | seed "
            "Bonferroni | p | Holm p | decision | all tasks | all tasks text 95% | all tasks "
            "two-level 95% |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for lab, d in sorted(res["deltas"].items(), key=lambda kv: not kv[1]["primary"]):
            v, m = d["victims"], d["mean"]
            bold = "**" if d["primary"] else ""
            lines.append(
                f"| {bold}{lab}{bold} | {_f(v['estimate'], 2, True)} | "
                f"{', '.join(_f(x, 1, True) for x in v['per_seed'])} | "
                f"{_ci(v['text_ci95'])} | {_ci(v['seed_ci95'])} | "
                f"{_ci(v.get('two_level_ci95', [None, None]))} | "
                f"{_ci(v['seed_ci_bonferroni']) if d['primary'] else ''} | "
                f"{_p(v.get('p_seeds'))} | {_p(v.get('p_holm'))} | {d.get('decision', '')} | "
                f"{_f(m['estimate'], 2, True)} | {_ci(m['text_ci95'])} | "
                f"{_ci(m.get('two_level_ci95', [None, None]))} |"
            )
    else:
        lines += ["", "No merge was evaluated for accuracy (read-out (a) only)."]
    lines.append("")
    return "\n".join(lines)


def write(out: pathlib.Path, results: Mapping[str, Any], markdown: str) -> list[str]:
    """``results.json`` and ``results.md`` under ``out`` (atomically; rewritten as seeds come)."""
    out.mkdir(parents=True, exist_ok=True)
    st.write_atomic(out / "results.json", json.dumps(results, indent=1, allow_nan=False) + "\n")
    st.write_atomic(out / "results.md", markdown)
    return [str(out / "results.json"), str(out / "results.md")]
