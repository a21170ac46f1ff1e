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

**Correlation** (:func:`pearson`): Pearson ``r`` with a Fisher-z 95% interval and an exact
two-sided permutation p-value (all ``n!`` orders for ``n <= 8``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from ...errors import InputError

__all__ = [
    "Bootstrap",
    "Correlation",
    "Interval",
    "NormalizedDraws",
    "Summary",
    "pearson",
    "seed_interval",
    "summarize",
    "t975",
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
            raise InputError("Bootstrap: task must be a non-empty (N,) vector.")
        self.n_tasks = int(self.task.max()) + 1
        self.rows = [np.flatnonzero(self.task == t) for t in range(self.n_tasks)]
        if any(len(r) == 0 for r in self.rows):
            raise InputError("Bootstrap: every task index 0 .. T-1 needs test texts.")
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
