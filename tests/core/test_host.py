"""``_core.host.put_views``: many host views placed in one call, as ``jax.device_put`` places
them (a scoring or merge call's inputs go through it)."""

from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest

host_mod = importlib.import_module("netutility_jax._core.host")


def _same_array(x: jax.Array, y: jax.Array) -> None:
    assert type(x) is type(y)
    assert (x.shape, x.dtype, x.weak_type) == (y.shape, y.dtype, y.weak_type)
    assert x.sharding == y.sharding
    assert x.committed == y.committed
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("committed", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_, np.float64, np.float16])
def test_put_views_gives_what_device_put_gives(committed, dtype):
    h = (np.arange(5 * 3 * 4) % 7 - 2).astype(dtype).reshape(5, 3, 4)
    views = [h[i] for i in range(5)] + [h[:, 1], h[2, :, ::2]]  # contiguous and strided
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0]) if committed else None
    got = host_mod.put_views(views, sharding)
    want = jax.device_put(views, sharding)
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        _same_array(x, y)
        # usable as any array: in a jitted function and with another committed array
        np.testing.assert_array_equal(
            np.asarray(jax.jit(lambda a: a[::-1][::-1])(x)), np.asarray(y)
        )


def test_put_views_of_nothing_and_of_other_leaves():
    assert host_mod.put_views([]) == []
    got = host_mod.put_views([np.float32(2.0), np.ones(3, np.float32)])
    want = jax.device_put([np.float32(2.0), np.ones(3, np.float32)])
    for x, y in zip(got, want, strict=True):
        _same_array(x, y)


@pytest.mark.parametrize("internal", ["missing", "changed"])
def test_put_views_without_the_jaxlib_call_is_device_put(monkeypatch, internal):
    # a jax without batched_device_put (import failed), or whose call differs (it raises): the
    # public jax.device_put, from then on
    def changed(*args, **kwargs):
        raise TypeError("batched_device_put(): incompatible function arguments")

    monkeypatch.setattr(host_mod, "_batched_put", None if internal == "missing" else changed)
    h = np.arange(6, dtype=np.float32).reshape(2, 3)
    for sharding in (None, jax.sharding.SingleDeviceSharding(jax.devices()[0])):
        got = host_mod.put_views([h[0], h[1]], sharding)
        for x, y in zip(got, jax.device_put([h[0], h[1]], sharding), strict=True):
            _same_array(x, y)
    assert host_mod._batched_put is None


def test_put_views_keeps_its_values_after_the_host_array_goes():
    h = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = host_mod.put_views([h[i] for i in range(3)])
    del h
    np.testing.assert_array_equal(np.asarray(got[2]), [8, 9, 10, 11])
