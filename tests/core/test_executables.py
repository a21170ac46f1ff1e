"""The kernels' compile options (netutility_jax/_core/executables.py): which jitted function a
kernel runs on the CPU, inside and outside a small merge and another jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from netutility_jax._core import executables as ex

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU compile options")


def _f(x):
    return jnp.sin(x) * 2.0 + jnp.cumsum(x)


def test_a_fast_compile_kernel_runs_its_fast_program_on_the_cpu_with_the_same_result():
    fast = ex.kernel(_f, fast_compile=True)
    plain = ex.kernel(_f)
    x = jnp.linspace(-1.0, 1.0, 7)
    assert fast._jit is fast._fast and plain._jit is plain._default and plain._fast is None
    np.testing.assert_allclose(fast(x), np.sin(np.asarray(x)) * 2 + np.cumsum(x), rtol=1e-6)
    assert fast._fast._cache_size() == 1 and fast._default._cache_size() == 0
    # inside another jit (and grad) it is traced as a plain jit: its options are the caller's
    np.testing.assert_allclose(jax.jit(fast)(x), plain(x), rtol=1e-6)
    g = jax.grad(lambda y: fast(y).sum())(x)
    np.testing.assert_allclose(g, 2 * np.cos(np.asarray(x)) + np.arange(7, 0, -1), rtol=1e-5)
    ex.release()
    assert fast._fast._cache_size() == 0


def test_a_small_kernel_takes_the_fast_program_only_inside_a_small_merge():
    k = ex.kernel(_f, fast_compile="small")
    assert k._jit is k._default
    with ex.small_merge(ex.SMALL_BYTES):
        assert k._jit is k._fast
        with ex.small_merge(ex.SMALL_BYTES + 1):
            assert k._jit is k._default
        assert k._jit is k._fast
    with ex.small_merge(None):
        assert k._jit is k._default
    assert k._jit is k._default


def test_factor_bytes_counts_every_array_leaf_and_a_lazy_sets_nbytes():
    ads = [
        {"m": {"lora_a": np.zeros((4, 2), np.float32), "lora_b": jnp.zeros((2, 3)), "scale": 2.0}},
        {"m": {"lora_a": jax.ShapeDtypeStruct((4, 2), jnp.bfloat16), "lora_b": None}},
    ]
    assert ex.factor_bytes(ads) == 4 * 2 * 4 + 2 * 3 * 4 + 4 * 2 * 2

    class Lazy:
        nbytes = 123

    assert ex.factor_bytes(Lazy()) == 123
