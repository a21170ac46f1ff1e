"""The per-module fixed costs of nu.score (benchmarks/scoring.py, case many-small).

Each shortcut is checked against what it replaces: the integer-sort medians of lam="auto"
against the sorted values written out in numpy, the per-module outputs against their buckets'
values and placement, and the flags read in one transfer against the errors they stand for
(``_core.host.put_views`` is checked in tests/core/test_host.py, the masks' placement in
tests/allocation/test_allocate.py).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import FIVE_MODULES, make_adapters

import netutility_jax as nu
from netutility_jax import InputError

utility_mod = importlib.import_module("netutility_jax.utility")
kernels_mod = importlib.import_module("netutility_jax.scoring._kernels")
median_mod = importlib.import_module("netutility_jax.scoring._median")
scoring_mod = importlib.import_module("netutility_jax.scoring._run")

SPEC = FIVE_MODULES


# ------------------------------------------------------------------------------------------------
# lam="auto" from integer sorts
# ------------------------------------------------------------------------------------------------


def _np_median(values: np.ndarray) -> np.float32 | float:
    """nanmedian written out: the midpoint (low + high) * 0.5 of the sorted values."""
    v = np.sort(values)
    if v.size == 0:
        return np.nan
    lo, hi = v[(v.size - 1) // 2], v[v.size // 2]
    return (lo + hi) * v.dtype.type(0.5)


def _np_lam(benefit, interference, candidate):
    ok_b = candidate & ~np.isnan(benefit)
    ok_i = candidate & ~np.isnan(interference)
    mb = _np_median(benefit[ok_b])
    mi = _np_median(interference[ok_i])
    mi_pos = _np_median(interference[ok_i & (interference > 0)])
    denom = mi if mi > 0 else mi_pos
    return mb / denom if np.isfinite(denom) and denom > 0 else 0.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(12))
def test_lam_auto_is_the_median_ratio_bit_for_bit(dtype, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    benefit = (rng.random(n) * 10.0 ** rng.integers(-30, 30)).astype(dtype)
    zero = rng.random(n) < rng.choice([0.0, 0.3, 0.7, 1.0])  # a zero-interference majority too
    interference = np.where(zero, 0.0, rng.random(n) ** 3).astype(dtype)
    candidate = rng.random(n) < rng.choice([0.0, 0.5, 0.9, 1.0])
    if seed % 3 == 0:  # NaN (traced calls' NaN inputs), -0 and inf are left to the medians
        benefit[rng.integers(0, n)] = np.nan
        interference[rng.integers(0, n)] = np.nan
        interference[rng.integers(0, n)] = -0.0
        benefit[rng.integers(0, n)] = np.inf
    want = _np_lam(benefit, interference, candidate)
    with jax.enable_x64(dtype == np.float64):
        got = utility_mod.lam_auto(jnp.asarray(benefit), jnp.asarray(interference), candidate)
        jitted = jax.jit(utility_mod.lam_auto)(benefit, interference, candidate)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want, dtype))
        np.testing.assert_array_equal(np.asarray(jitted), np.asarray(got))


def test_lam_auto_medians_of_runs_are_nanmedians():
    # the medians themselves, including an empty run (NaN) and ties at zero
    x = np.asarray([0.0, 3.0, 0.0, np.nan, 1.0, 2.0, -0.0, 5.0], np.float32)
    cand = np.asarray([1, 1, 1, 1, 1, 0, 1, 1], bool)
    med, med_pos = median_mod._median_runs(jnp.asarray(x), jnp.asarray(cand), positive=True)
    np.testing.assert_array_equal(np.asarray(med), _np_median(x[cand & ~np.isnan(x)]))
    np.testing.assert_array_equal(
        np.asarray(med_pos), _np_median(np.asarray([3, 1, 5], np.float32))
    )
    (none,) = median_mod._median_runs(jnp.asarray(x), jnp.zeros(8, bool), positive=False)
    assert np.isnan(np.asarray(none))


# ------------------------------------------------------------------------------------------------
# per-module outputs and flags
# ------------------------------------------------------------------------------------------------


def test_module_scores_are_their_buckets_rows_placed_as_before():
    ads = make_adapters(3, 2, SPEC[:2])  # (two buckets, small: the jitted call compiles quickly)
    sc = nu.score(ads)
    _, buckets, _ = importlib.import_module("netutility_jax._core.tree").collect(ads, fn="t")
    assert list(sc.modules) == [name for name, *_ in SPEC[:2]]
    # each module's four fields: committed float32 (M, r_max) arrays on the default device, and
    # the same values as a jitted call (whose outputs are sliced inside the graph)
    jitted = jax.jit(lambda a: nu.score(a))(ads)
    for bk in buckets:
        for name in bk.names:
            ms, mj = sc.modules[name], jitted.modules[name]
            for f, x, y in zip(ms._fields, ms, mj, strict=True):
                assert isinstance(x, jax.Array) and x.committed, f
                assert x.shape == (2, bk.r_max) and x.dtype == jnp.float32, f
                assert x.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0]), f
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{name} {f}")


def test_status_flags_stand_for_the_checks():
    # the kernel's flags (one transfer) say what the detailed checks would find: nothing here
    ads = make_adapters(6, 3, SPEC)
    run = scoring_mod.score_run("t", ads, (1.0, 0.0), "auto", None, False, None, defer=True)
    assert all(not c.flagged for c in run.check)
    joined = scoring_mod.Deferred.join(run.check)
    assert not joined.flagged
    joined.check()  # nothing to raise
    # a deferred check that was flagged still reads the details and raises them
    big = [
        {n: {**m, "scale": 1e25 if t == 0 else 1.0} for n, m in ad.items()}
        for t, ad in enumerate(ads)
    ]
    run = scoring_mod.score_run("t", big, (1.0,), "auto", None, False, None, defer=True)
    assert run.check[0].flagged
    with pytest.raises(InputError, match="beyond the range of float32"):
        run.check[0].check()
