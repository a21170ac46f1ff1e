"""DARE's drop mask a block of rows at a time, drawing exactly what one whole mask draws.

DARE keeps each entry of a module's dense task coordinates ``x (M, P, Q)`` with
``jax.random.bernoulli(key, 1 - p, (M, P, Q))`` (:func:`netutility_jax.methods.dare_drop`). A
KnOTS module of a large model is too big to hold whole (a Llama-3-70B ``down_proj`` with 20 tasks:
``20 x 28672 x 320`` float32, 734 MB), so :func:`_stages.dare_rows` merges it a block of rows at a
time and needs the mask's rows ``row0 : row0 + rows`` alone, without drawing the rest.

JAX's default PRNG (``threefry2x32`` with ``jax_threefry_partitionable``, on by default since JAX
0.5) draws entry ``(m, i, j)`` of a ``(M, P, Q)`` array from its flat index alone: a 64-bit counter
``m P Q + i Q + j``, as two uint32 words, through the threefry-2x32 block cipher keyed by the key's
two words; the two output words are xor-ed into the entry's 32 random bits, whose top 23 become a
uniform float32 in ``[0, 1)``. :func:`bernoulli_rows` computes those counters for a block of rows
and runs the same cipher (``jax.extend.random.threefry2x32_p``), so a module merged by blocks
draws the very mask of the module merged whole (``tests/test_rng.py`` checks this against
``jax.random.bernoulli`` bit for bit). :func:`blockable` says when that holds; other keys (an
``rbg`` key, the flag turned off) keep whole modules.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

__all__ = ["bernoulli_rows", "blockable"]


def _impl_name(key: Any) -> str:
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key))
    return str(jax.config.jax_default_prng_impl)  # a raw uint32 key: the default implementation


def blockable(key: Any) -> bool:
    """Whether :func:`bernoulli_rows` draws ``key``'s masks: a threefry-2x32 key (typed, or raw
    under the default implementation) with ``jax_threefry_partitionable`` on."""
    return (
        key is not None
        and _impl_name(key) == "threefry2x32"
        and bool(jax.config.jax_threefry_partitionable)
    )


def bernoulli_rows(key: jax.Array, prob: jax.Array, shape: tuple[int, int, int], row0, rows: int):
    """``jax.random.bernoulli(key, prob, shape)[:, row0 : row0 + rows]`` for ``shape = (M, P, Q)``
    (``prob`` float32), without drawing the other rows: ``(M, rows, Q)`` bool. ``row0`` may be
    traced; rows past ``P`` (padding) get the counters that follow, the next task's rows: callers
    only use them on zero entries. ``key`` is one threefry key (:func:`blockable`), typed or raw.
    """
    m, p, q = shape
    if p * q >= 2**31 or (p + rows) * q >= 2**32:
        raise ValueError(f"bernoulli_rows: ({p} + {rows}) x {q} entries exceed a uint32 counter")
    kd = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    kd = jnp.asarray(kd, jnp.uint32).reshape(2)
    # within a task: (row0 + i) Q + j < (P + rows) Q < 2**32, one uint32 word
    row = jnp.asarray(row0, jnp.uint32) + jax.lax.broadcasted_iota(jnp.uint32, (rows, q), 0)
    within = row * jnp.uint32(q) + jax.lax.broadcasted_iota(jnp.uint32, (rows, q), 1)
    # task m starts at m P Q, a 64-bit number: add with the carry into the high word
    start = np.arange(m, dtype=np.uint64).reshape(m, 1, 1) * np.uint64(p * q)
    hi0, lo0 = (
        (start >> np.uint64(32)).astype(np.uint32),
        (start & np.uint64(0xFFFFFFFF)).astype(np.uint32),
    )
    lo = jnp.asarray(lo0) + within[None]
    hi = jnp.asarray(hi0) + (lo < within[None]).astype(jnp.uint32)
    b1, b2 = threefry2x32_p.bind(kd[0], kd[1], hi, lo)
    bits = b1 ^ b2
    # jax.random.uniform's float32 from 32 bits, then bernoulli's ``uniform < prob``
    one = np.array(1.0, np.float32).view(np.uint32)
    floats = jax.lax.bitcast_convert_type((bits >> 9) | one, jnp.float32) - jnp.float32(1.0)
    return jnp.maximum(jnp.float32(0.0), floats) < jnp.asarray(prob, jnp.float32)
