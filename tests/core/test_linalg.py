"""QR / SVD helpers of netutility_jax._core.linalg against numpy, in float32 where precision matters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from netutility_jax._core import linalg as L

D = 2048  # more rows than _SMALL: the CholeskyQR2 route
assert D > L._SMALL


def _qr(x, **kw):
    (f,) = L.orth_qr_lazy_many([jnp.asarray(x)], **kw)
    return np.asarray(f.q, np.float64), np.asarray(f.r, np.float64)


def _recon_err(x, q, r):
    """max over columns of ||x_j - (Q R)_j|| / ||x_j|| (each column at its own scale)."""
    err = np.linalg.norm(x - q @ r, axis=0)
    return float((err / np.maximum(np.linalg.norm(x, axis=0), 1e-300)).max())


def _orth_err(q):
    """Q^T Q must be the identity on the live (nonzero) columns and zero elsewhere."""
    live = np.linalg.norm(q, axis=0) > 0
    return float(np.abs(q.T @ q - np.diag(live.astype(float))).max())


def test_cholesky_route_columns_of_very_different_norms():
    """Equilibration: column norms spanning 1e-4 .. 1e3 lose nothing (a plain Gram would drop
    the weak columns, whose eigenvalues sit under float32's noise floor)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(D, 32)) * np.logspace(-4, 3, 32)
    x32 = x.astype(np.float32)
    q, r = _qr(x32)
    assert _orth_err(q) < 1e-5
    assert _recon_err(x32.astype(np.float64), q, r) < 1e-5


def test_exact_switches_to_householder_when_a_direction_is_dropped():
    """Tasks sharing their A initialisation: [A0 + 1e-3 d_1, ..., A0 + 1e-3 d_4]. The Gram
    cannot resolve the 1e-3 differences in float32; ``exact=True`` must still reproduce x."""
    rng = np.random.default_rng(1)
    a0 = rng.normal(size=(D, 8))
    x = np.concatenate([a0 + 1e-3 * rng.normal(size=(D, 8)) for _ in range(4)], 1)
    x32 = x.astype(np.float32)
    x64 = x32.astype(np.float64)
    q, r = _qr(x32, exact=True)
    assert _orth_err(q) < 1e-5
    assert _recon_err(x64, q, r) < 1e-5
    # the Gram route alone drops those directions: the switch is what makes the difference
    qc, rc = _qr(x32)
    assert _recon_err(x64, qc, rc) > 1e-4


def test_exact_keeps_zero_columns_zero_and_duplicates():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(D, 12)).astype(np.float32)
    x[:, 3] = 0  # padding / a task lacking the module
    x[:, 7] = x[:, 1]  # exactly dependent (a frozen, shared A)
    q, r = _qr(x, exact=True)
    assert _recon_err(x.astype(np.float64), q, r) < 1e-5
    np.testing.assert_allclose(q.T @ q, np.eye(12), atol=1e-5)  # Householder: full basis


def test_rows_form_equals_columns_form():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(D, 16)).astype(np.float32) * np.logspace(-2, 1, 16, dtype=np.float32)
    (fc,) = L.orth_qr_lazy_many([jnp.asarray(x)])
    (fr,) = L.orth_qr_lazy_many([jnp.asarray(x.T)], rows=[True])
    c = jnp.asarray(rng.normal(size=(16, 5)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(fc.q_times(c)), np.asarray(fr.times_qt(c.T)).T, rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(fc.r), np.asarray(fr.r), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [100, 2 * L._SMALL])
def test_small_and_large_routes_agree(rows):
    """x = Q R with Q^T Q = I on both routes (float64: both to working precision)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, rows, 20)) * np.logspace(-3, 2, 20)
    with jax.enable_x64(True):
        (f,) = L.orth_qr_lazy_many([jnp.asarray(x)], exact=True)
        q, r = np.asarray(f.q), np.asarray(f.r)
    np.testing.assert_allclose(q @ r, x, atol=1e-10 * np.abs(x).max())
    for qi in q:
        np.testing.assert_allclose(qi.T @ qi, np.eye(20), atol=1e-10)


def test_householder_pads_when_fewer_rows_than_columns():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 10))
    with jax.enable_x64(True):
        (f,) = L.orth_qr_lazy_many([jnp.asarray(x)])
        q, r = np.asarray(f.q), np.asarray(f.r)
    assert q.shape == (6, 10) and r.shape == (10, 10)
    np.testing.assert_allclose(q @ r, x, atol=1e-12)


def test_svd_many_mixed_shapes_match_numpy():
    rng = np.random.default_rng(6)
    mats = [rng.normal(size=(2, 7, 5)), rng.normal(size=(3, 4, 9)), rng.normal(size=(6, 6))]
    with jax.enable_x64(True):
        out = L.svd_many([jnp.asarray(m) for m in mats])
    for m, (u, s, vt) in zip(mats, out, strict=True):
        c = min(m.shape[-2:])
        assert u.shape == (*m.shape[:-1], c) and vt.shape == (*m.shape[:-2], c, m.shape[-1])
        np.testing.assert_allclose(np.asarray(s), np.linalg.svd(m, compute_uv=False), atol=1e-12)
        rec = np.asarray(u) * np.asarray(s)[..., None, :] @ np.asarray(vt)
        np.testing.assert_allclose(rec, m, atol=1e-12)


def test_cholesky_pass_falls_back_to_identity_when_not_positive_definite():
    g = jnp.asarray(np.array([[[1.0, 2.0], [2.0, 1.0]], [[1.0, 0.1], [0.1, 1.0]]], np.float32))
    ((m, r),) = L._chol_pass_many([g])
    np.testing.assert_array_equal(np.asarray(m[0]), np.eye(2))
    np.testing.assert_array_equal(np.asarray(r[0]), np.eye(2))
    np.testing.assert_allclose(np.asarray(r[1]).T @ np.asarray(r[1]), np.asarray(g[1]), atol=1e-6)


# Exact power-of-two scaling (the scale safety of scoring rests on it)


def test_pow2_is_exact_over_the_normal_range():
    k = np.arange(-126, 128)
    np.testing.assert_array_equal(np.asarray(L.pow2(jnp.asarray(k), jnp.float32)), np.ldexp(1.0, k))
    with jax.enable_x64(True):
        k = np.arange(-1022, 1024)
        got = np.asarray(L.pow2(jnp.asarray(k), jnp.float64))
        np.testing.assert_array_equal(got, np.ldexp(1.0, k))


@pytest.mark.parametrize("k", [-380, -300, -200, -149, -126, -1, 0, 1, 127, 200, 300, 380])
def test_mul_pow2_matches_numpy_ldexp(k):
    """x * 2**k exactly where the result is a normal float32 (2**k itself need not be), inf or 0
    beyond: what float64 gives, rounded to float32."""
    rng = np.random.default_rng(abs(k))
    # normal float32 inputs (XLA:CPU reads subnormal inputs as 0)
    x = (rng.uniform(1, 10, size=200) * 10.0 ** rng.uniform(-37, 37, size=200)).astype(np.float32)
    x[::2] *= -1
    got = np.asarray(L.mul_pow2(jnp.asarray(x), jnp.asarray(k)), np.float64)
    with np.errstate(over="ignore"):
        want = np.ldexp(x.astype(np.float64), k).astype(np.float32).astype(np.float64)
    normal = np.abs(want) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(got[normal], want[normal])
    assert np.all(np.abs(got[~normal]) <= np.finfo(np.float32).tiny)  # flushed, as XLA:CPU does


def test_pow2_normalise_is_exact_and_counts_nonfinite():
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, size=(4, 5, 3)) * np.asarray([1e-30, 1.0, 1e30, 3.3e38])[:, None, None]
    x = x.astype(np.float32)
    x[3, 0, 0] = np.finfo(np.float32).max
    x[1, 2, 2] = np.nan
    x[2, 0, 1] = -np.inf
    y, e, n_bad = (np.asarray(v) for v in L.pow2_normalise(jnp.asarray(x), (-2, -1)))
    np.testing.assert_array_equal(n_bad, [0, 1, 1, 0])
    ok = np.isfinite(x)
    assert np.all(y[~ok] == 0)
    top = np.abs(y).max((-2, -1))
    assert np.all((top >= 0.5) & (top < 1)), top
    np.testing.assert_array_equal(np.ldexp(y.astype(np.float64), e[:, None, None])[ok], x[ok])
    z, ez, nz = L.pow2_normalise(jnp.zeros((2, 3), jnp.float32), (-1,))
    assert np.all(np.asarray(z) == 0) and np.all(np.asarray(ez) == 0) and not np.asarray(nz).any()
