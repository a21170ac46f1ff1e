"""netutility_jax.experiments.harness.stats: bootstrap, seed intervals, correlations, against numpy."""

from __future__ import annotations

import itertools
import math

import hypothesis
import hypothesis.strategies as hs
import numpy as np
import pytest

from netutility_jax.experiments.harness import stats as st


def _normalized(correct, single, task):
    """Dense numpy normalized accuracy, (S,) per seed."""
    out = []
    for c, s in zip(np.atleast_2d(correct), np.atleast_2d(single), strict=True):
        per = [100 * c[task == t].mean() / s[task == t].mean() for t in range(int(task.max()) + 1)]
        out.append(np.mean(per))
    return np.array(out)


def _data(seed=0, n_per=(300, 200, 400), seeds=3, p=(0.6, 0.7, 0.8)):
    rng = np.random.default_rng(seed)
    task = np.concatenate([np.full(n, t) for t, n in enumerate(n_per)])
    single = rng.random((seeds, len(task))) < 0.9
    a = rng.random((seeds, len(task))) < np.array(p)[task]
    b = rng.random((seeds, len(task))) < np.array(p)[task] - 0.05
    return task, single, a, b


def test_observed_values_equal_numpy():
    task, single, a, b = _data()
    bs = st.Bootstrap(task, n_boot=200)
    da, db = bs.normalized(a, single), bs.normalized(b, single)
    np.testing.assert_allclose(da.observed, _normalized(a, single, task), rtol=1e-12)
    d = bs.delta(da, db)
    np.testing.assert_allclose(
        d.per_seed, _normalized(a, single, task) - _normalized(b, single, task), rtol=1e-12
    )
    assert d.pooled.estimate == pytest.approx(d.per_seed.mean())
    for w, r in zip(bs.weights, bs.rows, strict=True):  # each resample draws n_t texts of task t
        np.testing.assert_array_equal(w.sum(axis=1), len(r))


def test_resampled_value_equals_explicit_resample():
    task, single, a, _ = _data(n_per=(30, 20))
    bs = st.Bootstrap(task, n_boot=5, seed=3)
    d = bs.normalized(a, single)
    for i in range(5):  # rebuild resample i as an index list and compute it densely
        idx = np.concatenate(
            [np.repeat(r, w[i].astype(int)) for w, r in zip(bs.weights, bs.rows, strict=True)]
        )
        np.testing.assert_allclose(
            d.boot[i], _normalized(a[:, idx], single[:, idx], task[idx]), rtol=1e-6
        )


def test_identical_configurations_have_a_zero_delta():
    task, single, a, _ = _data()
    bs = st.Bootstrap(task, n_boot=300)
    d = bs.delta(bs.normalized(a, single), bs.normalized(a, single))
    assert d.pooled == (0.0, 0.0, 0.0)
    assert not d.pooled.excludes_zero()


def test_bootstrap_interval_covers_the_truth():
    """Coverage of the paired 95% interval of a known difference, by simulation."""
    rng = np.random.default_rng(1)
    n = 400
    task = np.repeat([0, 1], n // 2)
    truth = 100 * (0.75 - 0.70) / 0.9  # both tasks: p_a = 0.75, p_b = 0.70, single 0.9
    hits = 0
    reps = 120
    for r in range(reps):
        base = rng.random(n)
        a = base < 0.75  # paired: b is right only where a is, mostly
        b = base < 0.70
        single = np.where(rng.random(n) < 0.9, True, False)
        bs = st.Bootstrap(task, n_boot=400, seed=r)
        d = bs.delta(bs.normalized(a[None], single[None]), bs.normalized(b[None], single[None]))
        lo, hi = d.per_seed_ci[0]
        hits += lo <= truth <= hi
    assert 0.86 <= hits / reps <= 1.0, hits / reps


def test_seed_interval_and_t_quantiles():
    assert st.t975(2) == pytest.approx(4.303, abs=1e-3)
    assert st.t975(1000) == pytest.approx(1.96, abs=1e-3)
    v = np.array([0.3, 1.1, 2.0, 0.7])
    iv = st.seed_interval(v)
    half = 3.182 * v.std(ddof=1) / 2
    assert iv == pytest.approx((v.mean(), v.mean() - half, v.mean() + half))
    one = st.seed_interval([2.5])
    assert one.estimate == 2.5 and math.isnan(one.low) and not one.excludes_zero()


@hypothesis.given(
    hs.lists(hs.floats(-5, 5, allow_nan=False), min_size=4, max_size=7),
    hs.randoms(use_true_random=False),
)
def test_pearson_against_numpy_and_brute_force(xs, rnd):
    x = np.asarray(xs)
    y = x * rnd.uniform(-2, 2) + np.asarray([rnd.uniform(-3, 3) for _ in xs])
    c = st.pearson(x, y)
    if np.std(x) == 0 or np.std(y) == 0:
        assert math.isnan(c.r)
        return
    assert c.r == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-9)
    z, se = math.atanh(max(min(c.r, 1 - 1e-12), -1 + 1e-12)), 1 / math.sqrt(len(x) - 3)
    assert (c.low, c.high) == pytest.approx(
        (math.tanh(z - 1.96 * se), math.tanh(z + 1.96 * se)), abs=1e-3
    )
    rs = [np.corrcoef(x, y[list(p)])[0, 1] for p in itertools.permutations(range(len(x)))]
    assert c.p == pytest.approx(np.mean(np.abs(rs) >= abs(c.r) - 1e-9), abs=1e-9)


def test_bootstrap_rejects_bad_task_vectors():
    with pytest.raises(ValueError, match="non-empty"):
        st.Bootstrap(np.array([], int))
    with pytest.raises(ValueError, match="every task index"):
        st.Bootstrap(np.array([0, 2]))


def test_docstring_examples():
    import doctest

    res = doctest.testmod(st)
    assert res.attempted >= 3 and res.failed == 0


def test_normalized_skips_resamples_where_the_own_lora_gets_nothing_right():
    # 3 texts in task 1, the own LoRA right on one: some resamples draw it 0 times; those have
    # no normalized accuracy (NaN, skipped), never inf (inf - inf warned and broke the delta)
    task = np.array([0] * 20 + [1] * 3)
    single = np.ones((1, 23), bool)
    single[0, 20:22] = False
    merged = single.copy()
    bs = st.Bootstrap(task, n_boot=400, seed=1)
    a = bs.normalized(merged, single)
    assert np.isnan(a.boot).any() and not np.isinf(a.boot).any()
    d = bs.delta(a, bs.normalized(merged, single))
    assert d.pooled.estimate == 0.0 and d.pooled.low == 0.0 and d.pooled.high == 0.0
