"""DARE's drop mask a block of rows at a time (:mod:`netutility_jax.operators._rng`) against
``jax.random.bernoulli`` on the whole mask, and against threefry-2x32 written out in numpy for
counters past 2**32 (a whole mask that large cannot be drawn in a test)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netutility_jax.operators import _rng

_ROWS = jax.jit(_rng.bernoulli_rows, static_argnums=(2, 4))


def _keys():
    base = jax.random.key(3)
    return {
        "typed": base,
        "raw": jax.random.PRNGKey(7),
        "folded": jax.random.fold_in(base, 123456),
        "vmapped": jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(4))[2],
    }


@pytest.mark.parametrize("kind", ["typed", "raw", "folded", "vmapped"])
@pytest.mark.parametrize("shape", [(3, 11, 7), (1, 5, 4), (4, 33, 17)])
def test_blocks_are_the_rows_of_the_whole_mask(kind, shape):
    key = _keys()[kind]
    for p in (0.0, 0.3, 0.9):
        prob = 1.0 - jnp.asarray(p, jnp.float32)
        whole = np.asarray(jax.random.bernoulli(key, prob, shape))
        for rows in (1, 4, shape[1]):
            for r0 in range(0, shape[1], rows):
                got = np.asarray(_ROWS(key, prob, shape, jnp.int32(r0), rows))
                live = min(rows, shape[1] - r0)
                np.testing.assert_array_equal(got[:, :live], whole[:, r0 : r0 + live])


@pytest.mark.slow  # a compile per drawn shape: ~2 s an example
@settings(max_examples=10, deadline=20_000)
@given(
    m=st.integers(1, 5),
    p=st.integers(1, 40),
    q=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    prob=st.floats(0.0, 1.0),
    data=st.data(),
)
def test_any_block_is_the_whole_masks_rows(m, p, q, seed, prob, data):
    rows = data.draw(st.integers(1, p))
    r0 = data.draw(st.integers(0, p - 1))
    key = jax.random.key(seed)
    prob = jnp.float32(prob)
    whole = np.asarray(jax.random.bernoulli(key, prob, (m, p, q)))
    got = np.asarray(_rng.bernoulli_rows(key, prob, (m, p, q), r0, rows))
    live = min(rows, p - r0)
    np.testing.assert_array_equal(got[:, :live], whole[:, r0 : r0 + live])


# ----------------------------------------------- threefry-2x32 in numpy (Salmon et al. 2011)

_ROT = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1: int, k2: int, x0: np.ndarray, x1: np.ndarray):
    """The Random123 threefry-2x32 block cipher, 20 rounds, as JAX keys it."""
    u = np.uint32
    ks = (u(k1), u(k2), u(k1) ^ u(k2) ^ u(0x1BD11BDA))
    x0, x1 = x0.astype(np.uint32) + ks[0], x1.astype(np.uint32) + ks[1]
    for i in range(5):
        for r in _ROT[i % 2]:
            x0 = x0 + x1
            x1 = (x1 << u(r)) | (x1 >> u(32 - r))
            x1 = x1 ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + u(i + 1)
    return x0, x1


def _bernoulli_np(key, prob: float, shape, r0: int, rows: int) -> np.ndarray:
    """Rows ``r0 : r0 + rows`` of ``bernoulli(key, prob, shape)``: entry ``(t, i, j)`` from its flat
    index as a 64-bit counter, in Python integers."""
    k1, k2 = (int(w) for w in np.asarray(jax.random.key_data(key)))
    m, p, q = shape
    t, i, j = np.meshgrid(np.arange(m), np.arange(r0, r0 + rows), np.arange(q), indexing="ij")
    flat = t.astype(np.uint64) * np.uint64(p * q) + (i * q + j).astype(np.uint64)
    b0, b1 = _threefry2x32(
        k1, k2, (flat >> np.uint64(32)).astype(np.uint32), flat.astype(np.uint32)
    )
    bits = b0 ^ b1
    uniform = (bits >> np.uint32(9)).astype(np.float64) * 2.0**-23
    return uniform < np.float32(prob)


def test_numpy_threefry_is_jax_random_bernoulli():
    """The written-out cipher draws JAX's masks (so it can stand in where JAX cannot draw)."""
    key = jax.random.key(11)
    shape = (3, 9, 13)
    whole = np.asarray(jax.random.bernoulli(key, jnp.float32(0.55), shape))
    np.testing.assert_array_equal(_bernoulli_np(key, 0.55, shape, 0, 9), whole)


@pytest.mark.parametrize("r0", [0, 45_990, 46_339])
def test_counters_past_two_to_the_32_carry_into_the_high_word(r0):
    """Three tasks of 46340 x 46340 entries (just under 2**31 each): task 2's counters run from
    2**32 + 2.1e9, so its entries need the high word and the carry out of the low one."""
    shape = (3, 46_340, 46_340)
    key = jax.random.fold_in(jax.random.key(5), 77)
    got = np.asarray(_ROWS(key, jnp.float32(0.4), shape, jnp.int32(r0), 1))
    np.testing.assert_array_equal(got, _bernoulli_np(key, 0.4, shape, r0, 1))


def test_blockable_keys():
    assert _rng.blockable(jax.random.key(0))
    assert _rng.blockable(jax.random.PRNGKey(0))
    assert not _rng.blockable(jax.random.key(0, impl="rbg"))
    assert not _rng.blockable(jax.random.key(0, impl="unsafe_rbg"))
    assert not _rng.blockable(None)
    with jax.threefry_partitionable(False):
        assert not _rng.blockable(jax.random.key(0))


def test_counters_beyond_a_uint32_are_refused():
    with pytest.raises(ValueError, match="exceed a uint32 counter"):
        _rng.bernoulli_rows(jax.random.key(0), jnp.float32(0.5), (1, 2**16, 2**15), 0, 2**16)
