"""Statistics of the experiment: paired bootstrap over test examples, seeds, correlations.

Every merge of the grid is evaluated on the same test texts, once per training seed; what is
kept is, per configuration and seed, the ``(N,)`` vector saying which test texts it classifies
right (``evaluate.MergeEval.test_correct``), and the same vector for each task's own LoRA (the
normalizer) and the zero-shot model.

**Normalized accuracy** of a configuration in seed ``s``: ``NA_s = mean_t 100 * acc_t(merged) /
acc_t(own LoRA)``, ``t`` over tasks.

**Paired bootstrap** (:class:`Bootstrap`): a resample draws, within every task, as many test
texts as the task has, with replacement (stratified multinomial weights). One set of ``B``
resamples is shared by every configuration and every seed (they are evaluated on the same
texts), and the normalizer is recomputed on each resample, so a difference between two
configurations is paired example by example and its interval includes the normalizer's own
sampling noise. Percentile intervals.

**Seeds.** The estimate of a delta is its mean over seeds. Two intervals go with it:

* the bootstrap interval of that mean: the uncertainty from the finite test set, for these
  trained adapters (what ">= 1000 test examples per task" buys);
* the seed interval: ``mean +- t_{0.975, S-1} * sd / sqrt(S)`` over the ``S`` per-seed deltas,
  which also covers training noise (with 3 seeds, ``t = 4.30``: wide).

**Two levels** (:func:`two_level`, :meth:`Bootstrap.two_level`): neither
interval above holds both noise sources. The two-level bootstrap resamples the seeds (``S`` of
them, with replacement) and the test texts together: replicate ``b`` draws one stratified text
resample (the shared ``weights[b]``) and ``S`` seeds, and its value is the mean over the drawn
seeds of the delta on the resampled texts. The texts are the same for every seed (a crossed
design), so one text resample is applied to every drawn seed (``items="shared"``, the default:
the text noise does not average out over seeds); ``items="per_seed"`` draws an independent text
resample for each drawn seed (a nested design; narrower). Where only each seed's estimate and
its text-bootstrap interval were saved (no per-text correctness), :func:`two_level_normal`
draws the text noise of each drawn seed as a normal with that seed's standard error
(``(high - low) / 3.92``), one draw shared by every seed of a replicate (``rho = 1``:
perfectly correlated text noise, the wider choice; ``rho = 0``: independent).

**Multiplicity** (:func:`holm`, :func:`seed_p`): where many deltas are read, the two-sided
p-value of each delta's one-sample t test over seeds, and which survive a Holm (step-down
Bonferroni) correction at family-wise 5%.

**Correlation** (:func:`pearson`): Pearson ``r`` with a Fisher-z 95% interval and an exact
two-sided permutation p-value (all ``n!`` orders for ``n <= 8``).
"""

from __future__ import annotations

import itertools
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

import netutility_jax as nu

__all__ = [
    "Bootstrap",
    "Correlation",
    "Interval",
    "NormalizedDraws",
    "Summary",
    "grid_headline",
    "holm",
    "jsonable",
    "pearson",
    "provenance",
    "se_from_interval",
    "seed_interval",
    "seed_p",
    "summarize",
    "t975",
    "two_level",
    "two_level_normal",
    "two_level_replicates",
    "write_atomic",
]

#: Two-sided 97.5% Student t quantiles for 1..30 degrees of freedom (then the normal's 1.96).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (1.96 beyond 30)."""
    if df < 1:
        return float("nan")
    return _T975[df - 1] if df <= len(_T975) else 1.959964


class Interval(NamedTuple):
    """An estimate and its 95% interval."""

    estimate: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return bool(self.low > 0 or self.high < 0)


def seed_interval(values: Sequence[float]) -> Interval:
    """Mean over seeds with the t interval ``mean +- t * sd / sqrt(S)`` (NaN bounds if S < 2).

    Example:
      >>> iv = seed_interval([1.0, 2.0, 3.0])
      >>> round(iv.estimate, 3), round(iv.low, 3), round(iv.high, 3)
      (2.0, -0.484, 4.484)
    """
    v = np.asarray(values, np.float64)
    m = float(v.mean())
    if len(v) < 2:
        return Interval(m, float("nan"), float("nan"))
    half = t975(len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
    return Interval(m, m - half, m + half)


class Bootstrap:
    """Shared stratified resamples of one test set, and normalized accuracy under them.

    Args:
      task: ``(N,)`` int task index of each test text (``0 .. T-1``).
      n_boot: number of resamples ``B``.
      seed: of the resampling.

    Example:
      >>> task = np.array([0] * 50 + [1] * 50)
      >>> single = np.ones((1, 100), bool)
      >>> a = np.tile(np.arange(100) % 2 == 0, (1, 1))       # 50% right in each task
      >>> b = np.tile(np.arange(100) % 4 == 0, (1, 1))       # 25% right
      >>> bs = Bootstrap(task, n_boot=500)
      >>> d = bs.delta(bs.normalized(a, single), bs.normalized(b, single))
      >>> round(d.pooled.estimate, 1), d.pooled.low > 15, d.pooled.high < 35
      (25.0, True, True)
    """

    def __init__(self, task: np.ndarray, *, n_boot: int = 2000, seed: int = 0):
        self.task = np.asarray(task, np.int64)
        if self.task.ndim != 1 or len(self.task) == 0:
            raise nu.InputError("Bootstrap: task must be a non-empty (N,) vector.")
        self.n_tasks = int(self.task.max()) + 1
        self.rows = [np.flatnonzero(self.task == t) for t in range(self.n_tasks)]
        if any(len(r) == 0 for r in self.rows):
            raise nu.InputError("Bootstrap: every task index 0 .. T-1 needs test texts.")
        rng = np.random.Generator(np.random.PCG64(seed))
        # (B, n_t) multinomial counts per task: how often each text is drawn
        self.weights = [
            rng.multinomial(len(r), np.full(len(r), 1.0 / len(r)), size=n_boot).astype(np.float64)
            for r in self.rows
        ]
        self.n_boot = n_boot

    def accuracies(self, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-task accuracies of ``correct`` ``(S, N)``: observed ``(S, T)``, resampled ``(B, S, T)``."""
        c = np.atleast_2d(np.asarray(correct, np.float64))
        obs = np.stack([c[:, r].mean(axis=1) for r in self.rows], axis=-1)
        boot = np.stack(
            [(w @ c[:, r].T) / len(r) for w, r in zip(self.weights, self.rows, strict=True)],
            axis=-1,
        )
        return obs, boot

    def normalized(self, correct: np.ndarray, single: np.ndarray) -> NormalizedDraws:
        """Normalized accuracy of ``correct`` ``(S, N)`` against the own-LoRA ``single`` ``(S, N)``."""
        obs_c, boot_c = self.accuracies(correct)
        obs_s, boot_s = self.accuracies(single)
        with np.errstate(divide="ignore", invalid="ignore"):
            per_obs = 100.0 * obs_c / obs_s
        # a resample in which a task's own LoRA gets nothing right (tiny test sets) has no
        # normalized accuracy: NaN, which the percentiles skip (an inf would give inf - inf)
        pos = boot_s > 0
        per_boot = np.where(pos, 100.0 * boot_c / np.where(pos, boot_s, 1.0), np.nan)
        return NormalizedDraws(per_obs.mean(-1), per_boot.mean(-1), per_obs)

    def interval(self, draws: NormalizedDraws) -> Summary:
        """Summary of one configuration's normalized accuracy (see :meth:`delta`)."""
        return _summary(draws.observed, draws.boot)

    def delta(self, a: NormalizedDraws, b: NormalizedDraws) -> Summary:
        """``a - b``, paired over the shared resamples and seeds."""
        return _summary(a.observed - b.observed, a.boot - b.boot)

    def two_level(
        self,
        a: NormalizedDraws,
        b: NormalizedDraws | None = None,
        *,
        seed: int = 0,
        items: str = "shared",
    ) -> Interval:
        """The two-level interval of ``a - b`` (or of ``a`` alone): :func:`two_level` of the
        paired per-seed resampled deltas ``(B, S)``, ``B`` = this bootstrap's ``n_boot``."""
        obs = a.observed if b is None else a.observed - b.observed
        boot = a.boot if b is None else a.boot - b.boot
        return two_level(obs, boot, seed=seed, items=items)


class NormalizedDraws(NamedTuple):
    """Normalized accuracy: ``observed`` ``(S,)`` per seed, ``boot`` ``(B, S)``, ``per_task`` ``(S, T)``."""

    observed: np.ndarray
    boot: np.ndarray
    per_task: np.ndarray


class Summary(NamedTuple):
    """A quantity over seeds, with its intervals.

    Attributes:
      per_seed: ``(S,)`` observed values.
      per_seed_ci: ``(S, 2)`` bootstrap 95% intervals, one per seed.
      pooled: mean over seeds with the bootstrap 95% interval of that mean.
      seeds: mean over seeds with the t interval over seeds.
    """

    per_seed: np.ndarray
    per_seed_ci: np.ndarray
    pooled: Interval
    seeds: Interval


def _summary(observed: np.ndarray, boot: np.ndarray) -> Summary:
    observed = np.asarray(observed, np.float64)
    boot = np.asarray(boot, np.float64)
    lo, hi = np.nanpercentile(boot, [2.5, 97.5], axis=0)
    mean_boot = boot.mean(axis=1)
    plo, phi = np.nanpercentile(mean_boot, [2.5, 97.5])
    return Summary(
        per_seed=observed,
        per_seed_ci=np.stack([lo, hi], axis=-1),
        pooled=Interval(float(observed.mean()), float(plo), float(phi)),
        seeds=seed_interval(observed),
    )


def two_level(
    observed: Sequence[float] | np.ndarray,
    boot: np.ndarray,
    *,
    seed: int = 0,
    items: str = "shared",
) -> Interval:
    """Mean over seeds of ``observed`` ``(S,)`` with the 95% percentile interval of the bootstrap
    that resamples seeds and test texts together (the module docstring).

    Args:
      observed: ``(S,)`` the quantity per seed on the test set as it is.
      boot: ``(B, S)`` the quantity per seed on ``B`` text resamples (row ``b``: one resample,
        the same texts for every seed, as :class:`Bootstrap` draws them).
      seed: of the seed resampling (and, with ``items="per_seed"``, of the text rows drawn).
      items: ``"shared"``: replicate ``b`` uses text resample ``b`` for every drawn seed
        (crossed: the seeds were evaluated on the same texts); ``"per_seed"``: each drawn seed
        gets a text resample drawn at random among the ``B`` (nested).

    Replicates whose value is NaN (a resample where an own LoRA got nothing right) are skipped.
    NaN bounds with fewer than two seeds.

    Example:
      >>> boot = np.array([[1.0, 3.0], [2.0, 4.0], [0.0, 2.0]])   # B = 3 resamples, S = 2 seeds
      >>> iv = two_level([1.0, 3.0], boot, seed=0)
      >>> iv.estimate, 0.0 <= iv.low <= iv.high <= 4.0
      (2.0, True)
    """
    obs = np.asarray(observed, np.float64)
    m = float(obs.mean())
    reps = two_level_replicates(obs, boot, seed=seed, items=items)
    if reps is None:
        return Interval(m, float("nan"), float("nan"))
    lo, hi = np.nanpercentile(reps, [2.5, 97.5])
    return Interval(m, float(lo), float(hi))


def two_level_replicates(
    observed: Sequence[float] | np.ndarray,
    boot: np.ndarray,
    *,
    seed: int = 0,
    items: str = "shared",
) -> np.ndarray | None:
    """The ``(B,)`` replicate values :func:`two_level` takes its percentiles of (None with fewer
    than two seeds)."""
    obs = np.asarray(observed, np.float64)
    bt = np.asarray(boot, np.float64)
    if obs.ndim != 1 or bt.ndim != 2 or bt.shape[1] != obs.shape[0]:
        raise nu.InputError(
            f"two_level: observed must be (S,) and boot (B, S); got {obs.shape} and {bt.shape}."
        )
    if items not in ("shared", "per_seed"):
        raise nu.InputError(f"two_level: items={items!r}; expected 'shared' or 'per_seed'.")
    n_b, n_s = bt.shape
    if n_s < 2:
        return None
    rng = np.random.Generator(np.random.PCG64(seed))
    pick = rng.integers(0, n_s, size=(n_b, n_s))  # the seeds of each replicate
    rows = (
        np.repeat(np.arange(n_b)[:, None], n_s, axis=1)
        if items == "shared"
        else rng.integers(0, n_b, size=(n_b, n_s))
    )
    return bt[rows, pick].mean(axis=1)


def se_from_interval(low: float, high: float) -> float:
    """The standard error a 95% interval ``[low, high]`` implies under a normal: width / 3.92."""
    return (float(high) - float(low)) / (2 * 1.959964)


def two_level_normal(
    per_seed: Sequence[float],
    se: Sequence[float],
    *,
    n_boot: int = 20000,
    seed: int = 0,
    rho: float = 1.0,
) -> Interval:
    """The two-level interval where only each seed's estimate and its text standard error are
    saved (no per-text correctness): replicate ``b`` draws ``S`` seeds with replacement and, for
    each drawn seed ``j``, adds ``se_j z_j`` with ``z`` standard normal, correlated ``rho``
    across the seeds of a replicate (``1``: one ``z`` for all, the texts being the same for
    every seed; ``0``: independent); value = the mean. 95% percentile interval; NaN bounds with
    fewer than two seeds.

    Example:
      >>> iv = two_level_normal([0.5, 1.0, 1.5], [0.0, 0.0, 0.0], seed=1)
      >>> iv.estimate, 0.5 <= iv.low < iv.high <= 1.5
      (1.0, True)
    """
    x = np.asarray(per_seed, np.float64)
    s = np.asarray(se, np.float64)
    if x.shape != s.shape or x.ndim != 1:
        raise nu.InputError(f"two_level_normal: per_seed {x.shape} and se {s.shape} differ.")
    if not 0.0 <= rho <= 1.0:
        raise nu.InputError(f"two_level_normal: rho={rho}; expected 0 <= rho <= 1.")
    m = float(x.mean())
    if len(x) < 2:
        return Interval(m, float("nan"), float("nan"))
    rng = np.random.Generator(np.random.PCG64(seed))
    pick = rng.integers(0, len(x), size=(n_boot, len(x)))
    common = rng.standard_normal((n_boot, 1))
    own = rng.standard_normal((n_boot, len(x)))
    z = math.sqrt(rho) * common + math.sqrt(1.0 - rho) * own
    reps = (x[pick] + s[pick] * z).mean(axis=1)
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return Interval(m, float(lo), float(hi))


def grid_headline(per_cell: Mapping[str, Mapping[int, float]]) -> tuple[dict[int, float], Interval]:
    """The grid-level headline: per seed, the mean delta over the cells (only seeds every cell
    has), and the t interval over those seeds (:func:`seed_interval`).

    Example:
      >>> per, iv = grid_headline({"a": {0: 1.0, 1: 2.0, 2: 0.0}, "b": {0: 3.0, 1: 0.0}})
      >>> per, iv.estimate
      ({0: 2.0, 1: 1.0}, 1.5)
    """
    if not per_cell:
        return {}, Interval(float("nan"), float("nan"), float("nan"))
    common = set.intersection(*(set(v) for v in per_cell.values()))
    per = {s: float(np.mean([v[s] for v in per_cell.values()])) for s in sorted(common)}
    if not per:
        return {}, Interval(float("nan"), float("nan"), float("nan"))
    return per, seed_interval(list(per.values()))


def seed_p(values: Sequence[float]) -> float:
    """Two-sided p-value of the one-sample t test of ``mean = 0`` over seeds (NaN if S < 2; 1 if
    every value is 0; 0 if they are equal and non-zero).

    Example:
      >>> round(seed_p([1.0, 2.0, 3.0]), 4)
      0.0742
    """
    from scipy import stats as sps  # a dependency of jax

    v = np.asarray(values, np.float64)
    if len(v) < 2:
        return float("nan")
    sd = float(v.std(ddof=1))
    if sd == 0.0:
        return 1.0 if float(v.mean()) == 0.0 else 0.0
    t = float(v.mean()) / (sd / math.sqrt(len(v)))
    return float(2.0 * sps.t.sf(abs(t), len(v) - 1))


def holm(p: Mapping[str, float], alpha: float = 0.05) -> dict[str, dict[str, Any]]:
    """Holm's step-down correction of the p-values ``p`` (family-wise level ``alpha``):
    ``{name: {"p", "p_holm", "reject"}}``; ``p_holm`` is the adjusted p-value (monotone, at most
    1), ``reject`` whether it is below ``alpha``. NaN p-values are not in the family (``p_holm``
    NaN, not rejected). Bonferroni's adjusted p is ``min(1, m p)``, never below Holm's.

    Example:
      >>> out = holm({"a": 0.01, "b": 0.04, "c": 0.03})
      >>> [(k, round(v["p_holm"], 2), v["reject"]) for k, v in out.items()]
      [('a', 0.03, True), ('b', 0.06, False), ('c', 0.06, False)]
    """
    names = [k for k, v in p.items() if not math.isnan(float(v))]
    m = len(names)
    order = sorted(names, key=lambda k: float(p[k]))
    out: dict[str, dict[str, Any]] = {
        k: {"p": float(v), "p_holm": float("nan"), "reject": False} for k, v in p.items()
    }
    running = 0.0
    for i, k in enumerate(order):
        running = max(running, min(1.0, (m - i) * float(p[k])))
        out[k]["p_holm"] = running
        out[k]["reject"] = bool(running < alpha)
    return out


class Correlation(NamedTuple):
    """Pearson ``r`` over ``n`` points, its Fisher-z 95% interval, the permutation p-value."""

    r: float
    low: float
    high: float
    p: float
    n: int


def pearson(x: Sequence[float], y: Sequence[float]) -> Correlation:
    """Pearson ``r``, Fisher-z 95% interval, two-sided permutation p (exact for n <= 8).

    Example:
      >>> c = pearson([1, 2, 3, 4, 5], [2, 4, 5, 8, 9.5])
      >>> round(c.r, 3), c.low > 0.5, round(c.p, 3)
      (0.99, True, 0.017)
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    n = len(x)
    nan = Correlation(float("nan"), float("nan"), float("nan"), float("nan"), n)
    if len(y) != n or n < 3:
        return nan
    xc, yc = x - x.mean(), y - y.mean()
    den = math.sqrt(float((xc**2).sum() * (yc**2).sum()))
    if den == 0:
        return nan
    r = float((xc * yc).sum() / den)
    if n > 3:
        z, se = math.atanh(max(min(r, 1 - 1e-12), -1 + 1e-12)), 1.0 / math.sqrt(n - 3)
        low, high = math.tanh(z - 1.959964 * se), math.tanh(z + 1.959964 * se)
    else:
        low, high = -1.0, 1.0
    if n <= 8:
        perms = np.array(list(itertools.permutations(range(n))))
    else:
        rng = np.random.default_rng(0)
        perms = np.array([rng.permutation(n) for _ in range(20000)])
    rs = (yc[perms] * xc).sum(1) / den
    # permuted r within 1e-9 of the observed count as ties (rounding, not a larger effect)
    p = float(np.mean(np.abs(rs) >= abs(r) - 1e-9))
    return Correlation(r, low, high, p, n)


def summarize(values: Mapping[str, Sequence[float]]) -> dict[str, Interval]:
    """:func:`seed_interval` of each entry."""
    return {k: seed_interval(v) for k, v in values.items()}


# ------------------------------------------------------------------------------ writing results


def jsonable(x: Any) -> Any:
    """``x`` as plain JSON values (:func:`nu.provenance.to_jsonable`: arrays as lists, numpy
    scalars as Python ones, non-finite floats as None, paths as strings).

    Example:
      >>> jsonable({1: np.float64(0.5), "x": (np.arange(2), float("nan"))})
      {'1': 0.5, 'x': [[0, 1], None]}
    """
    return nu.provenance.to_jsonable(x)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text or bytes) to ``path`` atomically (:func:`nu.provenance.atomic_file`),
    its folder made first if missing."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with nu.provenance.atomic_file(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def provenance() -> tuple[dict[str, Any], dict[str, str]]:
    """``(commit, versions)`` of a result: :func:`nu.provenance.commit` of the library's
    checkout and :func:`nu.provenance.versions`."""
    return nu.provenance.commit(), nu.provenance.versions()
