"""Merge operators (netutility_jax.methods) against dense float64 numpy, one module at a time."""

from __future__ import annotations

import _merge_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from netutility_jax.operators import methods as m


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _tasks(seed=0, m_tasks=3, p=14, q=10, r=3):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(m_tasks, p, r))
    b = rng.normal(size=(m_tasks, q, r))
    return a, b, [a[i] @ b[i].T for i in range(m_tasks)]


RT = 1e-10


def _dense(ab):
    return np.asarray(ab[0]) @ np.asarray(ab[1]).T


def test_ta():
    a, b, xs = _tasks()
    np.testing.assert_allclose(_dense(m.ta(a, b, coef=0.7)), ref.ta(xs, 0.7), atol=1e-12)


def test_iso_c_flat_spectrum():
    a, b, xs = _tasks()
    out = _dense(m.iso_c(jnp.asarray(a), jnp.asarray(b), coef=1.0, rtol=RT))
    np.testing.assert_allclose(out, ref.iso_c(xs), atol=1e-10)
    s = np.linalg.svd(out, compute_uv=False)
    nz = s[s > 1e-8 * s[0]]
    s_ta = np.linalg.svd(sum(xs), compute_uv=False)
    assert len(nz) == 9
    np.testing.assert_allclose(nz, s_ta[:9].mean(), rtol=1e-10)


@pytest.mark.parametrize("isotropize", [False, True])
def test_tsv(isotropize):
    a, b, xs = _tasks(1)
    out = m.tsv(jnp.asarray(a), jnp.asarray(b), coef=1.3, rtol=RT, isotropize=isotropize)
    np.testing.assert_allclose(_dense(out), ref.tsv(xs, 1.3, isotropize), atol=1e-10)
    # direction blocks orthonormal: lora_a = polar(U) diag(s), lora_b = polar(V)
    v = np.asarray(out[1])
    np.testing.assert_allclose(v.T @ v, np.eye(v.shape[1]), atol=1e-10)
    u = np.asarray(out[0])
    uu = u.T @ u
    np.testing.assert_allclose(uu, np.diag(np.diag(uu)), atol=1e-10)


def test_tsv_svd_input_matches_generic():
    a, b, _ = _tasks(2)
    f = m.factored_svd(jnp.asarray(a), jnp.asarray(b), rtol=RT)
    a2 = f.u * f.s[..., None, :]
    x1 = _dense(m.tsv(a2, f.v, coef=1.0, rtol=RT, is_svd=True))
    x2 = _dense(m.tsv(jnp.asarray(a), jnp.asarray(b), coef=1.0, rtol=RT))
    np.testing.assert_allclose(x1, x2, atol=1e-10)


@pytest.mark.parametrize("frac", [pytest.param(0.8, marks=pytest.mark.slow), 0.5])  # 0.8: 14 s
def test_iso_cts(frac):
    a, b, xs = _tasks(3, m_tasks=3, p=30, q=24, r=4)
    out = _dense(m.iso_cts(jnp.asarray(a), jnp.asarray(b), coef=1.0, rtol=RT, common_fraction=frac))
    np.testing.assert_allclose(out, ref.iso_cts(xs, 1.0, frac), atol=1e-9)
    s = np.linalg.svd(out, compute_uv=False)
    nz = s[s > 1e-8 * s[0]]
    np.testing.assert_allclose(nz, nz.mean(), rtol=1e-9)


def test_polar_zero_columns_inert():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 6))
    x[:, [1, 4]] = 0
    p = np.asarray(m.polar(jnp.asarray(x), rtol=RT))
    np.testing.assert_allclose(p[:, [1, 4]], 0, atol=1e-14)
    keep = [0, 2, 3, 5]
    np.testing.assert_allclose(p[:, keep], ref.polar(x[:, keep]), atol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kth_largest_exact(dtype):
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=(3, 1000))).astype(dtype)
    for k in (1, 7, 500, 1000):
        got = np.asarray(m.kth_largest(jnp.asarray(x), k))
        want = -np.sort(-x, axis=-1)[:, k - 1]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(d, marks=pytest.mark.slow) for d in (np.float32, np.float64)],  # 7-13 s each
)
def test_kth_largest_count_exact_on_hard_data(dtype):
    """Ties, zeros, subnormals, 60 decades, lengths not a multiple of the count blocks, one k
    per row: the threshold and the number of entries at or above it, against a sort."""
    rng = np.random.default_rng(1)
    tiny = np.finfo(dtype).smallest_subnormal
    for trial in range(40):
        n = int(rng.integers(1, 300))
        kind = trial % 4
        if kind == 0:
            x = np.abs(rng.normal(size=(3, n)))
        elif kind == 1:
            x = rng.integers(0, 4, size=(3, n)).astype(float)  # mostly ties
        elif kind == 2:
            x = np.abs(rng.normal(size=(3, n))) * 10.0 ** rng.integers(-30, 30, size=(3, n))
        else:
            x = np.where(rng.random((3, n)) < 0.5, tiny * rng.integers(1, 5, (3, n)), 0.0)
        x = x.astype(dtype)
        k = rng.integers(1, n + 1, size=3)
        t, ge = jax.jit(m.kth_largest_count)(jnp.asarray(x), jnp.asarray(k))
        for i in range(3):
            want = np.sort(x[i])[::-1][k[i] - 1]
            assert np.asarray(t)[i] == want, (trial, i)
            assert int(np.asarray(ge)[i]) == int((x[i] >= want).sum()), (trial, i)


def test_trim_exact_count_with_ties():
    x = jnp.asarray(np.array([[[1.0, -1.0], [1.0, 0.5]]]))  # four entries, three tied magnitudes
    t = np.asarray(m.trim_topk(x, 2))
    assert (t != 0).sum() == 2
    np.testing.assert_array_equal(t, [[[1.0, -1.0], [0.0, 0.0]]])
    assert not np.any(np.asarray(m.trim_topk(x, 0)))
    assert int(m.topk_count(0.3, 10)) == 3 and int(m.topk_count(0.3, jnp.asarray(10))) == 3


@pytest.mark.parametrize("density", [0.1, 0.5, 1.0])
def test_ties(density):
    _, _, xs = _tasks(4)
    out = np.asarray(m.ties(jnp.asarray(np.stack(xs)), coef=0.9, k=int(density * xs[0].size)))
    np.testing.assert_allclose(out, ref.ties(xs, 0.9, density), atol=1e-12)


def test_ties_one_task_density_one_is_identity():
    _, _, xs = _tasks(5, m_tasks=1)
    out = np.asarray(m.ties(jnp.asarray(np.stack(xs)), coef=1.0, k=xs[0].size))
    np.testing.assert_allclose(out, xs[0], atol=1e-14)


def test_dare_properties():
    _, _, xs = _tasks(6)
    x = jnp.asarray(np.stack(xs))
    k = jax.random.key(3)
    np.testing.assert_allclose(np.asarray(m.dare(x, k, coef=1.0, p=0.0)), sum(xs), atol=1e-12)
    d1 = np.asarray(m.dare(x, k, coef=1.0, p=0.4))
    np.testing.assert_array_equal(d1, np.asarray(m.dare(x, k, coef=1.0, p=0.4)))
    assert not np.array_equal(d1, np.asarray(m.dare(x, jax.random.key(4), coef=1.0, p=0.4)))
    # survivors are rescaled by 1/(1-p)
    dropped = np.asarray(m.dare_drop(x, k, 0.4))
    nz = dropped != 0
    np.testing.assert_allclose(dropped[nz], np.stack(xs)[nz] / 0.6, rtol=1e-12)
    assert 0.45 < nz.mean() < 0.75


# ------------------------------------------------------------------ TIES's kept count (PEFT's rule)


def _peft_count(n, density):
    """How many entries PEFT's magnitude prune keeps of n distinct nonzero values."""
    torch = pytest.importorskip("torch")  # the PEFT peer (absent from the minimum-versions job)
    pytest.importorskip("peft")
    from peft.utils.merge_utils import magnitude_based_pruning

    x = torch.arange(1, n + 1, dtype=torch.float64)  # distinct magnitudes: no ties
    return int((magnitude_based_pruning(x, density) != 0).sum())


def _densities(n):
    """0.01 .. 0.99, PEFT-style round ones, and adversarial ones: k / n and a few binary64 ulps
    either side of it (where a product rounded before the floor differs from one nudged up)."""
    out = [round(0.01 * i, 2) for i in range(1, 100)] + [0.0, 1.0, 0.1 + 0.2, 2 / 3]
    for k in (1, n // 7, n // 3, (3 * n) // 10, n // 2, n - 1):
        d = k / n
        for _ in range(4):
            d = np.nextafter(d, 0.0)
            out.append(float(d))
        d = k / n
        for _ in range(4):
            d = np.nextafter(d, 1.0)
            out.append(float(d))
    return [d for d in out if 0 <= d <= 1]


SHAPES = [(96, 25), (25, 96), (7, 13), (100, 30), (48, 50), (1, 1), (3, 1000), (640, 77), (10, 10)]


def test_topk_count_matches_peft_over_shapes_and_densities():
    """m.topk_count is PEFT's int(density * numel) with numel an exact integer, for every shape
    and density of the sweep (scalar and vectorised forms alike)."""
    for d_in, d_out in SHAPES:
        n = d_in * d_out
        for d in _densities(n):
            want = _peft_count(n, d) if d > 0 else 0
            vec = m.topk_count(d, np.asarray([n, 2 * n], np.int32))  # vectorised form
            assert m.topk_count(d, n) == want == int(vec[0]), (d_in, d_out, d)
            assert int(vec[1]) == int(d * (2 * n))
    # the case of the issue: the left-to-right float product keeps one entry fewer than PEFT
    assert int(0.3 * 96 * 25) == 719
    assert m.topk_count(0.3, 96 * 25) == _peft_count(96 * 25, 0.3) == 720
    # a float32 density is its exact binary64 value (PEFT computes with a Python float)
    d32 = np.float32(0.3)
    assert m.topk_count(d32, 2400) == _peft_count(2400, float(d32)) == int(float(d32) * 2400)


@pytest.mark.parametrize(
    "dtype",
    [np.float32, pytest.param(np.float64, marks=pytest.mark.slow)],  # 8-10 s each
)
def test_trim_topk_breaks_ties_by_flat_index_in_every_dtype(dtype):
    """Exactly k kept; among equal magnitudes the lower flat index first (stable argsort of -|x|);
    the same entries in float32 and float64, batched with one k per module, eager and jitted."""
    rng = np.random.default_rng(7)
    for trial in range(8):
        n_mod, m_tasks, (p, q) = 3, 2, ((1, 7), (6, 5))[trial % 2]  # two compiled shapes
        x = rng.integers(-3, 4, size=(n_mod, m_tasks, p, q)).astype(dtype)  # mostly ties
        x[x == 0] = -0.0 if trial % 2 else 0.0
        k = rng.integers(0, p * q + 1, size=n_mod)
        got = np.asarray(jax.jit(m.trim_topk)(jnp.asarray(x), jnp.asarray(k, jnp.int32)))
        got_other = np.asarray(
            m.trim_topk(jnp.asarray(x.astype(np.float64 if dtype == np.float32 else np.float32)), k)
        )
        for j in range(n_mod):
            for i in range(m_tasks):
                flat = x[j, i].ravel()
                keep = np.zeros(flat.size, bool)
                keep[np.argsort(-np.abs(flat), kind="stable")[: k[j]]] = True
                want = np.where(keep, flat, 0).reshape(p, q)
                np.testing.assert_array_equal(got[j, i], want, err_msg=f"{trial} {j} {i}")
                np.testing.assert_array_equal(got_other[j, i], want, err_msg=f"{trial} {j} {i}")


# ------------------------------------------------------------------ scale safety


def test_column_norms_and_qr_of_columns_1e30_apart_in_float32():
    """Columns whose sizes differ by 2**200 (a task scaled by 1e30 next to one scaled by 1e-30):
    the norms are not flushed to zero and Q R reproduces every column to float32 accuracy, on
    the Cholesky route too (its Grams of the raw columns would under- and overflow)."""
    from netutility_jax._core import linalg as _linalg

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 600, 6))
    x[..., :2] *= 1e30
    x[..., 4:] *= 1e-30
    norms = np.asarray(m._column_norms(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(norms, np.linalg.norm(x, axis=-2), rtol=1e-5)
    assert x.shape[-2] > _linalg._SMALL  # the Cholesky (Gram) route
    (f,), (e,) = m.qr_equilibrated([jnp.asarray(x, jnp.float32)])
    q = np.asarray(f.q, np.float64)
    r = np.asarray(f.r, np.float64) * 2.0 ** np.asarray(e)[..., None, :]
    np.testing.assert_allclose(
        np.swapaxes(q, -1, -2) @ q, np.broadcast_to(np.eye(6), (2, 6, 6)), atol=1e-5
    )
    rebuilt = q @ r
    col = np.linalg.norm(x, axis=-2, keepdims=True)
    np.testing.assert_allclose(rebuilt / col, x / col, atol=1e-5)
