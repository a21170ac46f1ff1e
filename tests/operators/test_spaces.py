"""Core Space and KnOTS transforms from factors (netutility_jax.spaces) against dense float64."""

from __future__ import annotations

import functools

import _merge_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from netutility_jax.operators import spaces as sp

RT = 1e-10


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _bucket(seed=0, n=2, m_tasks=3, d_in=20, d_out=14, r=4, ranks=None, mask_p=None):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, m_tasks, d_in, r))
    b = rng.normal(size=(n, m_tasks, r, d_out))
    scale = rng.uniform(0.5, 2, size=(n, m_tasks))
    rank = np.full((n, m_tasks), r) if ranks is None else np.asarray(ranks)
    slot = np.arange(r) < rank[..., None]
    a = a * slot[:, :, None, :]
    b = b * slot[..., None]
    mask = (
        np.ones((n, m_tasks, r), bool) if mask_p is None else rng.random((n, m_tasks, r)) < mask_p
    )
    k = sp.kept_components(
        jnp.asarray(a),
        jnp.asarray(b),
        jnp.asarray(scale),
        jnp.asarray(rank),
        jnp.asarray(mask),
        cand_rtol=1e-8,
    )
    mods = [
        [
            {
                "lora_a": a[j, i, :, : rank[j, i]],
                "lora_b": b[j, i, : rank[j, i]],
                "scale": scale[j, i],
            }
            for i in range(m_tasks)
        ]
        for j in range(n)
    ]
    xs = [ref.kept_updates(mods[j], d_in, d_out, mask[j]) for j in range(n)]
    return a, b, k, mods, xs


def _back(c, x, j):
    """Map task coordinates x (p, q) of module j back to (d_in, d_out) densely (test only)."""
    left = np.eye(x.shape[0]) if c.left is None else np.asarray(c.left[j])
    right = np.eye(x.shape[1]) if c.right is None else np.asarray(c.right[j])
    if c.right_scale is not None:
        right = right * np.asarray(c.right_scale[j])
    return left @ x @ right.T


@pytest.mark.parametrize(
    ("mask_p", "space"),
    [
        # the unmasked full and core cases take 9-10 s each; their masked forms stay here
        pytest.param(None, "full", marks=pytest.mark.slow),
        pytest.param(None, "core", marks=pytest.mark.slow),
        (None, "knots"),
        (None, "knots_original"),
        *((0.6, s) for s in ("full", "core", "knots", "knots_original")),
    ],
)
def test_transform_lossless(space, mask_p):
    """Map each task to the space and straight back: every kept update is reproduced."""
    a, b, k, _, xs = _bucket(1, ranks=[[4, 2, 3], [1, 4, 4]], mask_p=mask_p)
    if space == "full":
        c = sp.full_coords(k)
    elif space == "core":
        c = sp.core_coords(k, jnp.asarray(a), jnp.asarray(b), rtol=RT)
    else:
        c = sp.knots_coords(
            k, rtol=RT, variant="original" if space == "knots_original" else "core_space"
        )
    x = np.asarray(sp.dense_tasks(c))
    for j in range(2):
        for i in range(3):
            np.testing.assert_allclose(_back(c, x[j, i], j), xs[j][i], atol=1e-10)


def test_core_bases_match_reference():
    a, b, k, mods, xs = _bucket(2, mask_p=0.7)
    c = sp.core_coords(k, jnp.asarray(a), jnp.asarray(b), rtol=RT)
    for j in range(2):
        left, right = ref.core_bases(mods[j], xs[j], 20, 14)
        lj = np.asarray(c.left[j])
        lj = lj[:, np.linalg.norm(lj, axis=0) > 0.5]
        rj = np.asarray(c.right[j])
        rj = rj[:, np.linalg.norm(rj, axis=0) > 0.5]
        # same basis vectors up to sign, same order (descending singular values)
        np.testing.assert_allclose(np.abs(lj.T @ left), np.eye(left.shape[1]), atol=1e-8)
        np.testing.assert_allclose(np.abs(rj.T @ right), np.eye(right.shape[1]), atol=1e-8)
        # core matrices are (D, D) with D <= M r and equal the reference's up to basis signs
        sl, sr = np.sign(np.sum(lj * left, 0)), np.sign(np.sum(rj * right, 0))
        core = np.asarray(sp.dense_tasks(c))[j]
        keep_l = np.linalg.norm(np.asarray(c.left[j]), axis=0) > 0.5
        keep_r = np.linalg.norm(np.asarray(c.right[j]), axis=0) > 0.5
        for i in range(3):
            want = (left * sl).T @ xs[j][i] @ (right * sr)
            np.testing.assert_allclose(core[i][np.ix_(keep_l, keep_r)], want, atol=1e-10)


@pytest.mark.parametrize("variant", ["core_space", "original"])
def test_knots_blocks_match_reference(variant):
    _, _, k, _, xs = _bucket(3, mask_p=0.8)
    c = sp.knots_coords(k, rtol=RT, variant=variant)
    x = np.asarray(sp.dense_tasks(c))
    for j in range(2):
        blocks, back = ref.knots_blocks(xs[j], variant)
        u = np.asarray(c.right[j])
        live = np.linalg.norm(u, axis=0) > 0.5
        u = u[:, live]
        ref_u = back / np.linalg.norm(back, axis=0)
        sign = np.sign(np.sum(u * ref_u, 0))
        np.testing.assert_allclose(np.abs(u.T @ ref_u), np.eye(u.shape[1]), atol=1e-8)
        for i in range(3):
            np.testing.assert_allclose(x[j, i][:, live] * sign, blocks[i], atol=1e-9)


def test_no_candidates_is_zero():
    a, b, k, _, _ = _bucket(4, ranks=[[0, 0, 0], [2, 0, 0]])
    c = sp.core_coords(k, jnp.asarray(a), jnp.asarray(b), rtol=RT)
    assert np.all(np.isfinite(np.asarray(c.a))) and not np.any(np.asarray(c.a)[0])
    c = sp.knots_coords(k, rtol=RT)
    assert np.all(np.isfinite(np.asarray(c.b))) and not np.any(np.asarray(c.b)[0])


# ------------------------------------------------------------------ scale safety


def test_normalise_tasks_is_exact_and_counts_non_finite():
    """scale_i a_i b_i = mant_i 2**exp_i a_i' b_i' exactly, largest |a_i'|, |b_i'| in [0.5, 1),
    mant 0 for a task whose update is zero, non-finite entries counted per array."""
    rng = np.random.default_rng(0)
    n, m_tasks, d_in, r, d_out = 2, 4, 7, 3, 5
    a = rng.normal(size=(n, m_tasks, d_in, r)) * np.array([1e30, 1, 1e-30, 1])[:, None, None]
    b = rng.normal(size=(n, m_tasks, r, d_out))
    b[1, 3] = 0  # a zero factor: a zero update, whatever its scale
    scale = np.array([[2.0, -3e20, 1e-20, 0.0], [0.5, 1.0, 7.0, 1e30]])
    an, bn, ts, bad = sp.normalise_tasks(
        jnp.asarray(a), jnp.asarray(b), jnp.asarray(scale), a_axes=(2, 3), b_axes=(2, 3)
    )
    an, bn = np.asarray(an), np.asarray(bn)
    mant, exp = np.asarray(ts.mant), np.asarray(ts.exp)
    assert not np.asarray(bad).any()
    for j in range(n):
        for i in range(m_tasks):
            want = scale[j, i] * a[j, i] @ b[j, i]
            got = np.ldexp(mant[j, i] * (an[j, i] @ bn[j, i]), exp[j, i])
            np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
            if want.any():
                assert 0.5 <= np.abs(an[j, i]).max() < 1 and 0.5 <= np.abs(bn[j, i]).max() < 1
            else:
                assert mant[j, i] == 0
    a[0, 1, 2, 0] = np.nan
    b[1, 2, 0, :2] = np.inf
    scale[0, 3] = np.inf
    *_, bad = sp.normalise_tasks(
        jnp.asarray(a), jnp.asarray(b), jnp.asarray(scale), a_axes=(2, 3), b_axes=(2, 3)
    )
    want = np.zeros((n, m_tasks, 3), int)
    want[0, 1, 0], want[1, 2, 1], want[0, 3, 2] = 1, 2, 1
    np.testing.assert_array_equal(np.asarray(bad), want)


def test_kept_components_scale_exp_is_exact():
    """Singular values times 2**scale_exp, directions unchanged (a power of two rounds nothing)."""
    a, b, *_ = _bucket(5)
    scale = jnp.asarray(np.random.default_rng(1).uniform(0.5, 2, size=(2, 3)))
    e = np.array([[0, -40, 300], [-1000, 5, 0]], np.int32)
    args = (jnp.asarray(a), jnp.asarray(b), scale, jnp.full((2, 3), 4), jnp.ones((2, 3, 4), bool))
    k0 = sp.kept_components(*args, cand_rtol=1e-8)
    k1 = sp.kept_components(*args, cand_rtol=1e-8, scale_exp=jnp.asarray(e))
    np.testing.assert_array_equal(np.asarray(k1.s), np.ldexp(np.asarray(k0.s), e[..., None]))
    np.testing.assert_array_equal(np.asarray(k1.in_dirs), np.asarray(k0.in_dirs))


@pytest.mark.parametrize("space", ["core", "knots"])
def test_float32_coords_of_tasks_2e160_apart(space):
    """Float32, task 0 scaled by 2**100 and task 2 by 2**-60 (in units of the module, as
    nu.merge runs them; spaces.module_unit keeps tasks down to 2**-190 of the strongest): every
    task's coordinates match float64 ones relative to that task's own size, so a weak task is
    neither flushed to zero nor swamped by the strong one's rounding."""
    rng = np.random.default_rng(2)
    m_tasks, d_in, d_out, r = 3, 20, 14, 4
    a = rng.normal(size=(1, m_tasks, d_in, r))
    b = rng.normal(size=(1, m_tasks, r, d_out))
    scale = np.array([[2.0**100, 1.0, 2.0**-60]])

    @functools.partial(jax.jit, static_argnums=0)
    def coords_jit(dtype):
        return coords(dtype)

    def coords(dtype):
        an, bn, ts, _ = sp.normalise_tasks(
            jnp.asarray(a, dtype), jnp.asarray(b, dtype), jnp.asarray(scale, dtype),
            a_axes=(2, 3), b_axes=(2, 3),
        )  # fmt: skip
        unit = sp.module_unit(ts)
        k = sp.kept_components(
            an, bn, ts.mant, jnp.full((1, m_tasks), r), jnp.ones((1, m_tasks, r), bool),
            cand_rtol=1e-4, scale_exp=ts.exp - unit[:, None],
        )  # fmt: skip
        rtol = 100 * float(np.finfo(dtype).eps)
        if space == "core":
            c = sp.core_coords(k, an, bn, rtol=rtol, a_exp=ts.a_exp, b_exp=ts.b_exp)
        else:
            c = sp.knots_coords(k, rtol=rtol, block_exp=sp.HEADROOM)
        return sp.dense_tasks(c)[0]

    x32, x64 = (np.asarray(coords_jit(dt), np.float64) for dt in (jnp.float32, jnp.float64))
    for i in range(m_tasks):
        size = np.abs(x64[i]).max()
        assert size > 0 and np.isfinite(x32[i]).all()
        # bases agree up to column signs: compare magnitudes entry by entry, relative to the task
        np.testing.assert_allclose(np.abs(x32[i]) / size, np.abs(x64[i]) / size, atol=1e-4)
