"""nu.lora_svd: thin SVD of scale * lora_a @ lora_b from the factors, against numpy."""

from __future__ import annotations

import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import netutility_jax as nu
from netutility_jax import InputError, InputTypeError


def _factors(rng, batch, d_in, r, d_out, dtype=np.float32):
    a = rng.normal(size=(*batch, d_in, r)).astype(dtype)
    b = rng.normal(size=(*batch, r, d_out)).astype(dtype)
    return a, b


def _reconstruct(u):
    in_dirs = np.asarray(u.in_dirs, np.float64)
    out_dirs = np.asarray(u.out_dirs, np.float64)
    s = np.asarray(u.s, np.float64)
    return (in_dirs * s[..., None, :]) @ np.swapaxes(out_dirs, -1, -2)


def _check_svd(u, a, b, scale, *, rtol):
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    dk = np.asarray(scale, np.float64)[..., None, None] * (a64 @ b64)
    k = min(a.shape[-1], a.shape[-2], b.shape[-1])
    batch = a.shape[:-2]
    assert u.in_dirs.shape == (*batch, a.shape[-2], k)
    assert u.s.shape == (*batch, k)
    assert u.out_dirs.shape == (*batch, b.shape[-1], k)
    s = np.asarray(u.s, np.float64)
    s_ref = np.linalg.svd(dk, compute_uv=False)[..., :k]
    smax = float(np.max(s_ref))
    # reconstruction, relative to the update's scale
    np.testing.assert_allclose(_reconstruct(u), dk, rtol=0, atol=rtol * smax)
    # singular values: descending, non-negative, equal to numpy's
    assert np.all(np.diff(s, axis=-1) <= 0)
    assert np.all(s >= 0)
    np.testing.assert_allclose(s, s_ref, rtol=0, atol=rtol * smax)
    # orthonormal directions (the span of the nonzero part at least)
    eye = np.eye(k)
    for d in (u.in_dirs, u.out_dirs):
        d = np.asarray(d, np.float64)
        np.testing.assert_allclose(
            np.swapaxes(d, -1, -2) @ d, np.broadcast_to(eye, (*batch, k, k)), atol=10 * rtol
        )


@pytest.mark.parametrize("d_in, r, d_out", [(32, 4, 16), (16, 6, 24), (8, 8, 8)])
@pytest.mark.parametrize("scale", [1.0, 0.25, -3.0])
def test_lora_svd_matches_numpy(d_in, r, d_out, scale):
    rng = np.random.default_rng(d_in + r + d_out)
    a, b = _factors(rng, (), d_in, r, d_out)
    u = nu.lora_svd(a, b, scale)
    assert isinstance(u, nu.LoraSVD)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in u)
    _check_svd(u, a, b, scale, rtol=1e-5)


def test_lora_svd_default_scale_is_one():
    rng = np.random.default_rng(1)
    a, b = _factors(rng, (), 12, 3, 7)
    _check_svd(nu.lora_svd(a, b), a, b, 1.0, rtol=1e-5)


def test_lora_svd_batched():
    rng = np.random.default_rng(2)
    a, b = _factors(rng, (2, 3), 20, 5, 11)
    scale = rng.uniform(0.5, 2.0, size=(2, 3)).astype(np.float32)
    u = nu.lora_svd(a, b, scale)
    _check_svd(u, a, b, scale, rtol=1e-5)
    # each batch element is the unbatched decomposition of its own factors
    for i in range(2):
        for j in range(3):
            uij = nu.lora_svd(a[i, j], b[i, j], scale[i, j])
            np.testing.assert_allclose(np.asarray(u.s[i, j]), np.asarray(uij.s), rtol=1e-5)
    # a scalar scale broadcasts over the batch
    _check_svd(nu.lora_svd(a, b, 0.5), a, b, np.full((2, 3), 0.5), rtol=1e-5)


def test_lora_svd_rank_exceeds_width():
    """r > d_in: k = min(r, d_in, d_out) directions, still an exact factorisation."""
    rng = np.random.default_rng(3)
    a, b = _factors(rng, (), 4, 6, 9)
    _check_svd(nu.lora_svd(a, b, 2.0), a, b, 2.0, rtol=1e-5)


def test_lora_svd_rank_deficient():
    rng = np.random.default_rng(4)
    a, b = _factors(rng, (), 16, 4, 10)
    a[:, 3] = a[:, 1]
    u = nu.lora_svd(a, b)
    _check_svd(u, a, b, 1.0, rtol=1e-5)
    assert float(u.s[3]) <= 1e-5 * float(u.s[0])


def test_lora_svd_zero_update():
    a = np.ones((8, 3), np.float32)
    u = nu.lora_svd(a, np.zeros((3, 5), np.float32))
    np.testing.assert_array_equal(np.asarray(u.s), 0.0)
    assert np.all(np.isfinite(np.asarray(u.in_dirs))) and np.all(
        np.isfinite(np.asarray(u.out_dirs))
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_lora_svd_low_precision_is_upcast(dtype):
    rng = np.random.default_rng(5)
    a32, b32 = _factors(rng, (), 24, 4, 12)
    a, b = jnp.asarray(a32, dtype), jnp.asarray(b32, dtype)
    u = nu.lora_svd(a, b, 0.5)
    assert all(x.dtype == jnp.float32 for x in u)
    # exact for the low-precision values themselves (computed in float32)
    _check_svd(u, np.asarray(a, np.float32), np.asarray(b, np.float32), 0.5, rtol=1e-5)


def test_lora_svd_x64():
    rng = np.random.default_rng(6)
    a, b = _factors(rng, (3,), 40, 6, 30, dtype=np.float64)
    with jax.enable_x64(True):
        u = nu.lora_svd(a, b, 0.3)
        assert all(x.dtype == jnp.float64 for x in u)
        _check_svd(u, a, b, np.full(3, 0.3), rtol=1e-12)
    assert not jax.config.x64_enabled


def test_lora_svd_under_jit():
    rng = np.random.default_rng(7)
    a, b = _factors(rng, (2,), 16, 3, 9)
    u = jax.jit(lambda x, y, c: nu.lora_svd(x, y, c))(a, b, 1.5)
    _check_svd(u, a, b, np.full(2, 1.5), rtol=1e-5)


@hypothesis.given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(10, 2, 6), (6, 5, 12), (12, 4, 3)]),
    log_scale=st.floats(-2, 2),
)
def test_lora_svd_reconstruction_property(seed, shape, log_scale):
    rng = np.random.default_rng(seed)
    d_in, r, d_out = shape
    a, b = _factors(rng, (), d_in, r, d_out)
    scale = float(10.0**log_scale)
    _check_svd(nu.lora_svd(a, b, scale), a, b, scale, rtol=2e-5)


def test_lora_svd_errors():
    with pytest.raises(ValueError, match=r"lora_a \(8, 3\) and lora_b \(2, 6\) do not chain"):
        nu.lora_svd(np.ones((8, 3), np.float32), np.ones((2, 6), np.float32))
    with pytest.raises(ValueError, match=r"do not chain"):
        nu.lora_svd(np.ones((2, 8, 3), np.float32), np.ones((3, 3, 6), np.float32))
    with pytest.raises(ValueError, match=r"do not chain"):
        nu.lora_svd(np.ones((8,), np.float32), np.ones((8, 6), np.float32))
    with pytest.raises(
        InputTypeError, match=r"nu.lora_svd: lora_a has dtype int32; expected a floating dtype"
    ):
        nu.lora_svd(np.ones((8, 3), np.int32), np.ones((3, 6), np.float32))
    with pytest.raises(InputTypeError, match=r"lora_b is \[\[1\], \[1, 2\]\] \(list\), not an"):
        nu.lora_svd(np.ones((8, 3), np.float32), [[1], [1, 2]])


# Scale safety


@pytest.mark.parametrize(
    "ca, cb, scale",
    [(1e25, 1e25, 1e-20), (1e-25, 1e-25, 1e20), (1e-20, 1e-20, 1e30), (1e20, 1e20, 1e-10)],
)
def test_lora_svd_extreme_scales_match_numpy(ca, cb, scale):
    """Factors and scale each extreme, the update itself representable (singular values 1e30 ..
    1e-10): the result is numpy's float64 SVD to float32 rounding. Before, the core
    ``R_a R_b^T`` overflowed (1e50: inf/NaN) or underflowed (1e-50: zeros) before the scale
    brought it back."""
    rng = np.random.default_rng(30)
    a, b = _factors(rng, (2,), 16, 3, 9, np.float64)
    a32, b32 = (a * ca).astype(np.float32), (b * cb).astype(np.float32)
    u = nu.lora_svd(a32, b32, scale)
    _check_svd(u, a32, b32, np.full(2, scale), rtol=2e-5)


def test_lora_svd_mixed_batch_scales():
    """Each batch element is normalised on its own: extreme factors of opposite directions side by
    side with ordinary ones."""
    rng = np.random.default_rng(31)
    a, b = _factors(rng, (3,), 12, 4, 7)
    a[0] *= np.float32(1e25)
    b[0] *= np.float32(1e25)
    a[2] *= np.float32(1e-25)
    b[2] *= np.float32(1e-25)
    scale = np.asarray([1e-20, 1.0, 1e20], np.float32)
    u = nu.lora_svd(a, b, scale)
    for i in range(3):
        ui = nu.LoraSVD(u.in_dirs[i], u.s[i], u.out_dirs[i])
        _check_svd(ui, a[i], b[i], scale[i], rtol=2e-5)


def test_lora_svd_beyond_the_dtype_is_refused():
    rng = np.random.default_rng(32)
    a, b = _factors(rng, (2,), 8, 2, 5)
    with pytest.raises(
        InputError,
        match=r"nu\.lora_svd: the largest singular value of scale \* lora_a @ lora_b at batch "
        r"index \(1,\) is outside the range of float32",
    ):
        nu.lora_svd(
            a * np.float32(1e20), b * np.float32(1e20), np.asarray([1e-30, 1.0], np.float32)
        )
    with pytest.raises(InputError, match=r"outside the range of float32"):
        nu.lora_svd(a * np.float32(1e-10), b * np.float32(1e-10), np.float32(1e-25))
    with jax.enable_x64(True):  # float64 holds 1e40
        a64, b64 = a.astype(np.float64) * 1e20, b.astype(np.float64) * 1e20
        _check_svd(nu.lora_svd(a64, b64, 1.0), a64, b64, np.ones(2), rtol=1e-12)


# Finiteness


@pytest.mark.parametrize("which", ["lora_a", "lora_b", "scale"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_lora_svd_nonfinite_input_names_array_count_and_batch(which, value):
    rng = np.random.default_rng(33)
    a, b = _factors(rng, (2, 3), 8, 2, 5)
    scale = np.ones((2, 3), np.float32)
    x = {"lora_a": a, "lora_b": b, "scale": scale}[which]
    x[1, 2, ...] = value  # every entry of batch element (1, 2)
    n = x[1, 2].size
    shape = re.escape(str(x.shape))
    with pytest.raises(
        InputError,
        match=rf"nu\.lora_svd: {which} {shape} has {n} non-finite entr(y|ies) \(NaN or Inf\) "
        r"at batch index \(1, 2\),",
    ):
        nu.lora_svd(a, b, scale)


def test_lora_svd_float64_entry_beyond_float32():
    a = np.ones((6, 2))
    a[0, 0] = 1e50
    with pytest.raises(InputError, match=r"lora_a \(6, 2\) has 1 non-finite entry .* float32"):
        nu.lora_svd(a, np.ones((2, 4)))


@pytest.mark.parametrize(
    "scale, err, match",
    [
        ("2.0", InputTypeError, r"scale='2\.0' \(str\); expected a real number"),
        (1j, InputTypeError, r"scale=1j \(complex\)"),
        (True, InputTypeError, r"scale=True \(bool\)"),
        (
            np.ones(3),
            InputError,
            r"scale of shape \(3,\) does not broadcast to the batch axes \(2,\)",
        ),
    ],
)
def test_lora_svd_bad_scale(scale, err, match):
    rng = np.random.default_rng(34)
    a, b = _factors(rng, (2,), 8, 2, 5)
    with pytest.raises(err, match=rf"nu\.lora_svd: {match}"):
        nu.lora_svd(a, b, scale)
    with pytest.raises(InputTypeError, match=r"checked='yes' \(str\); expected True or False"):
        nu.lora_svd(a, b, checked="yes")


def test_lora_svd_under_jit_nan_and_checkify():
    """Under jit: a NaN input gives NaN for that batch element (the others are exact); with
    checked=True under checkify.checkify the condition is reported."""
    rng = np.random.default_rng(35)
    a, b = _factors(rng, (2,), 8, 2, 5)
    a[1, 0, 0] = np.nan
    u = jax.jit(lambda x, y: nu.lora_svd(x, y))(a, b)
    assert np.isnan(np.asarray(u.s[1])).all() and np.isnan(np.asarray(u.in_dirs[1])).all()
    _check_svd(nu.LoraSVD(u.in_dirs[0], u.s[0], u.out_dirs[0]), a[0], b[0], 1.0, rtol=1e-5)
    f = checkify.checkify(jax.jit(lambda x, y: nu.lora_svd(x, y, checked=True)))
    err, _ = f(a, b)
    assert err.get().startswith("nu.lora_svd: lora_a has 1 non-finite entries (NaN or Inf).")
    err, _ = f(a[:1], b[:1])
    assert err.get() is None


def test_strict_promotion_float32():
    rng = np.random.default_rng(8)
    a, b = _factors(rng, (), 12, 3, 7)
    with jax.numpy_dtype_promotion("strict"):
        u = nu.lora_svd(a, b, 0.5)
    _check_svd(u, a, b, 0.5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_strict_promotion_low_precision(dtype):
    rng = np.random.default_rng(9)
    a, b = (jnp.asarray(x, dtype) for x in _factors(rng, (), 12, 3, 7))
    with jax.numpy_dtype_promotion("strict"):
        u = nu.lora_svd(a, b, 0.5)
    assert u.s.dtype == jnp.float32
