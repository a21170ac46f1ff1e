"""harness/stats.py's two-level bootstrap (seeds and test texts together), the grid headline and
the multiplicity helpers, in float64 against computations written out here (enumeration, closed
forms), and the two-level interval's invariants on a planted example."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from netutility_jax.experiments.harness import stats as st


def test_shared_items_replicates_follow_the_enumerated_distribution():
    """Tiny crossed case: B = 3 text resamples, S = 3 seeds. A replicate is (row r uniform over
    the B rows, seeds j1..j3 uniform with replacement), value mean_k boot[r, j_k]: enumerate all
    3 x 27 equally likely outcomes and compare the replicates' distribution (B tiled to 60000
    rows, so every row is equally likely) with it."""
    base = np.array([[0.0, 1.0, 5.0], [2.0, 3.0, 4.0], [-1.0, 0.5, 2.0]])
    exact = np.array(
        [base[r, list(js)].mean() for r in range(3) for js in itertools.product(range(3), repeat=3)]
    )
    boot = np.tile(base, (20000, 1))
    reps = st.two_level_replicates(base.mean(0), boot, seed=5)
    assert reps.dtype == np.float64 and reps.shape == (60000,)
    assert reps.mean() == pytest.approx(exact.mean(), abs=0.03)
    assert reps.var() == pytest.approx(exact.var(), rel=0.03)
    for v in np.unique(exact):  # the distribution functions agree at every value
        assert np.mean(reps <= v) == pytest.approx(np.mean(exact <= v), abs=0.01)
    assert set(np.round(np.unique(reps), 9)) <= set(np.round(np.unique(exact), 9))


def test_per_seed_items_is_the_nested_distribution():
    """``items="per_seed"``: each drawn seed gets its own text row: value mean_k boot[r_k, j_k]
    with (r_k, j_k) independent and uniform; its variance is Var(boot[r, j]) / S exactly."""
    base = np.array([[0.0, 1.0, 5.0], [2.0, 3.0, 4.0], [-1.0, 0.5, 2.0]])
    boot = np.tile(base, (20000, 1))
    reps = st.two_level_replicates(base.mean(0), boot, seed=2, items="per_seed")
    assert reps.mean() == pytest.approx(base.mean(), abs=0.03)
    assert reps.var() == pytest.approx(base.var() / 3, rel=0.03)


def _planted(rng, seeds=4, n_per=(150, 150), seed_sd=2.0, gain=0.04):
    """Correctness of a and b on shared texts: a is b plus a planted gain per task, plus a
    per-seed random shift of a's accuracy (training noise)."""
    task = np.concatenate([np.full(n, t) for t, n in enumerate(n_per)])
    u = rng.random(len(task))  # the texts' difficulty, shared by every seed
    single = np.ones((seeds, len(task)), bool)
    shift = rng.normal(0, seed_sd / 100, size=(seeds, 1))
    b = np.stack([u < 0.7 + 0.02 * rng.standard_normal() for _ in range(seeds)])
    a = u[None] < 0.7 + gain + shift
    return task, single, a, b


def test_two_level_is_at_least_as_wide_as_each_one_level_interval_on_average():
    rng = np.random.default_rng(0)
    w2 = w_text = w_seed = 0.0
    reps = 12
    for r in range(reps):
        task, single, a, b = _planted(rng)
        bs = st.Bootstrap(task, n_boot=1000, seed=r)
        da, db = bs.normalized(a, single), bs.normalized(b, single)
        d = bs.delta(da, db)
        two = bs.two_level(da, db, seed=r)
        obs = d.per_seed
        # one level, written out here: the seeds alone (percentile bootstrap of the mean)
        pick = np.random.default_rng(100 + r).integers(0, len(obs), size=(4000, len(obs)))
        seed_lo, seed_hi = np.percentile(obs[pick].mean(1), [2.5, 97.5])
        w2 += two.high - two.low
        w_text += d.pooled.high - d.pooled.low
        w_seed += seed_hi - seed_lo
        assert two.estimate == pytest.approx(obs.mean(), rel=1e-12)
    assert w2 >= w_text and w2 >= w_seed, (w2 / reps, w_text / reps, w_seed / reps)


def test_two_level_is_deterministic_with_its_seed():
    rng = np.random.default_rng(3)
    boot = rng.normal(size=(500, 4))
    obs = boot.mean(0)
    assert st.two_level(obs, boot, seed=7) == st.two_level(obs, boot, seed=7)
    assert st.two_level(obs, boot, seed=7) != st.two_level(obs, boot, seed=8)
    one = st.two_level(obs[:1], boot[:, :1])
    assert one.estimate == obs[0] and math.isnan(one.low) and math.isnan(one.high)
    with pytest.raises(ValueError, match=r"\(S,\) and boot \(B, S\)"):
        st.two_level(obs, boot[:, :3])
    with pytest.raises(ValueError, match="items="):
        st.two_level(obs, boot, items="both")


def test_bootstrap_two_level_is_two_level_of_its_paired_deltas():
    rng = np.random.default_rng(1)
    task, single, a, b = _planted(rng, seeds=3)
    bs = st.Bootstrap(task, n_boot=300, seed=4)
    da, db = bs.normalized(a, single), bs.normalized(b, single)
    got = bs.two_level(da, db, seed=9)
    want = st.two_level(da.observed - db.observed, da.boot - db.boot, seed=9)
    assert got == want
    assert bs.two_level(da, seed=9) == st.two_level(da.observed, da.boot, seed=9)


def test_two_level_normal_closed_forms():
    """Every seed the same value c and standard error s: a replicate is c + s z (rho = 1) or
    c + s mean(z_k) (rho = 0), so the interval is c +- 1.96 s, or c +- 1.96 s / sqrt(S)."""
    c, s, n = 0.7, 0.5, 4
    iv1 = st.two_level_normal([c] * n, [s] * n, n_boot=200000, seed=0, rho=1.0)
    iv0 = st.two_level_normal([c] * n, [s] * n, n_boot=200000, seed=0, rho=0.0)
    assert (iv1.low, iv1.high) == pytest.approx((c - 1.959964 * s, c + 1.959964 * s), abs=0.01)
    half = 1.959964 * s / math.sqrt(n)
    assert (iv0.low, iv0.high) == pytest.approx((c - half, c + half), abs=0.01)
    # no text noise: the seeds' percentile bootstrap, within the values' range
    x = [0.1, 0.9, 2.0]
    iv = st.two_level_normal(x, [0.0] * 3, seed=1)
    assert iv.estimate == pytest.approx(1.0) and 0.1 <= iv.low < iv.high <= 2.0
    assert st.se_from_interval(-1.959964, 1.959964) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rho"):
        st.two_level_normal(x, [0.0] * 3, rho=2.0)


def test_grid_headline_is_the_per_seed_mean_over_cells():
    per, iv = st.grid_headline(
        {"centre": {0: 1.0, 1: -1.0, 2: 2.0, 5: 9.0}, "per_task": {0: 0.0, 1: 3.0, 2: 1.0}}
    )
    assert per == {0: 0.5, 1: 1.0, 2: 1.5}
    v = np.array([0.5, 1.0, 1.5])
    half = 4.303 * v.std(ddof=1) / math.sqrt(3)
    assert iv == pytest.approx((1.0, 1.0 - half, 1.0 + half), abs=1e-3)


def test_seed_p_against_the_closed_form_t_distribution_with_two_degrees():
    """With 3 seeds (2 degrees of freedom) the t CDF is 1/2 + t / (2 sqrt(2 + t^2)), so the
    two-sided p is 1 - |t| / sqrt(2 + t^2)."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        v = rng.normal(0.5, 1.0, size=3)
        t = v.mean() / (v.std(ddof=1) / math.sqrt(3))
        assert st.seed_p(v) == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), rel=1e-9)
    assert math.isnan(st.seed_p([1.0]))
    assert st.seed_p([0.0, 0.0]) == 1.0 and st.seed_p([2.0, 2.0]) == 0.0


def test_holm_against_its_definition():
    """p_holm of the hypothesis ranked i (ascending p, 1-based) is max over ranks j <= i of
    min(1, (m - j + 1) p_(j)); Bonferroni's min(1, m p) is never below it."""
    rng = np.random.default_rng(2)
    for _ in range(50):
        m = int(rng.integers(1, 9))
        p = {f"h{k}": float(x) for k, x in enumerate(rng.random(m) ** 3)}
        out = st.holm(p)
        ranked = sorted(p, key=p.get)
        for i, k in enumerate(ranked):
            want = max(min(1.0, (m - j) * p[ranked[j]]) for j in range(i + 1))
            assert out[k]["p_holm"] == pytest.approx(want, rel=1e-12)
            assert out[k]["reject"] == (want < 0.05)
            assert min(1.0, m * p[k]) >= out[k]["p_holm"] - 1e-15
    out = st.holm({"a": 0.001, "b": float("nan")})
    assert out["a"]["p_holm"] == 0.001 and math.isnan(out["b"]["p_holm"])


def test_jsonable_and_write_atomic(tmp_path):
    x = {1: np.float32(0.5), "a": [np.arange(3), float("inf")], "p": tmp_path}
    assert st.jsonable(x) == {"1": 0.5, "a": [[0, 1, 2], None], "p": str(tmp_path)}
    st.write_atomic(tmp_path / "sub" / "f.md", "hello\n")
    st.write_atomic(tmp_path / "sub" / "g.bin", b"\x00\x01")
    assert (tmp_path / "sub" / "f.md").read_text() == "hello\n"
    assert (tmp_path / "sub" / "g.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["f.md", "g.bin"]
    commit, versions = st.provenance()
    assert set(commit) == {"head", "dirty"} and "numpy" in versions
