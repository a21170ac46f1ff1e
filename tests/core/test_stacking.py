"""A bucket's factors stacked before its stage (netutility_jax._core.stacking): device factors
stacked on their device give exactly what the host stacking gives, whatever the ragged ranks,
missing modules, padding and dtypes; traced factors and buckets above the cap keep their leaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import make_adapters

from netutility_jax._core import mesh, stacking, tree

# 40 modules x 3 tasks = 120 leaves per field: four groups of 32, the last one padded
SPEC = (
    *((f"layers/{i}/q", 12, 10, (3, None if i % 7 == 2 else 5, 4)) for i in range(40)),
    ("layers/0/o", 10, 12, (2, 2, 2)),
)


def _on_device(x):
    """``x`` with its arrays on the device, dicts in their own order (``jax.device_put`` sorts
    their keys, which changes the buckets' module order)."""
    if isinstance(x, dict):
        return {k: _on_device(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_on_device(v) for v in x]
    return jax.device_put(x) if isinstance(x, np.ndarray) else x


def _buckets(ads):
    return tree.collect(ads, fn="t")[1]


@pytest.mark.parametrize("n_extra", [0, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_device_stack_is_the_host_stack(n_extra, dtype):
    with jax.enable_x64(dtype == np.float64):
        ads = make_adapters(0, 3, SPEC, dtype=np.float64)
        host = _buckets(ads)
        dev = _buckets(_on_device(ads))
        for hb, db in zip(host, dev, strict=True):
            assert hb.names == db.names
            n_pad = len(hb.names) + n_extra
            want = mesh.host_stack(hb, dtype, n_pad)
            got = stacking.device_stack(db, dtype, n_pad)
            assert isinstance(got.a, jax.Array) and got.a.dtype == dtype
            for f, w, g in zip(want._fields, want, got, strict=True):
                assert np.shape(g) == w.shape, f
                np.testing.assert_array_equal(np.asarray(g), w, err_msg=f)


def test_stacked_input_routes():
    ads = make_adapters(1, 3, SPEC)
    bk_host = next(bk for bk in _buckets(ads) if len(bk.names) > 1)
    bk_dev = next(bk for bk in _buckets(_on_device(ads)) if bk.names == bk_host.names)
    assert isinstance(stacking.stacked_input(bk_host, jnp.float32).a, np.ndarray)
    assert isinstance(stacking.stacked_input(bk_dev, jnp.float32).a, jax.Array)
    # above the cap device factors keep their leaves, unless the caller stacks them anyway
    size = stacking.device_stack(bk_dev, jnp.float32, len(bk_dev.names)).a.nbytes
    assert stacking.DEVICE_STACK_BYTES > size
    old = stacking.DEVICE_STACK_BYTES
    try:
        stacking.DEVICE_STACK_BYTES = size // 2
        assert stacking.stacked_input(bk_dev, jnp.float32) is None
        assert stacking.stacked_input(bk_dev, jnp.float32, cap=False) is not None
    finally:
        stacking.DEVICE_STACK_BYTES = old

    # traced factors are the caller's trace's to stack
    seen = []

    @jax.jit
    def inside(ads):
        seen.append(stacking.stacked_input(_buckets(ads)[0], jnp.float32))
        return 0

    inside(_on_device(ads))
    assert seen == [None]


@pytest.mark.parametrize("method", ["ta", "tsv"])
def test_merge_adapters_stacks_each_bucket_once_and_merges_as_numpy_factors_do(method, monkeypatch):
    # scoring and merging read the same stacked copy (stacking.reuse), weighted tasks included,
    # and the merge is the one of the same factors given as numpy arrays
    import netutility_jax as nu

    ads = make_adapters(2, 3, SPEC)
    dev = _on_device(ads)
    joins = []
    join = stacking._join
    monkeypatch.setattr(stacking, "_join", lambda *a, **k: joins.append(1) or join(*a, **k))
    kw = dict(budget=6, method=method, space="core", weights=[1.0, 0.5, 2.0])
    got, _ = nu.merge_adapters(dev, **kw)
    assert len(joins) == len(_buckets(dev))
    want, _ = nu.merge_adapters(ads, **kw)
    for (path, x), (_, y) in zip(
        jax.tree_util.tree_leaves_with_path(got),
        jax.tree_util.tree_leaves_with_path(want),
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6, err_msg=str(path)
        )


def test_stack_limit_is_a_sixteenth_of_a_reported_device_memory_at_least_the_floor():
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    class Leaf:
        def __init__(self, stats):
            self.device = Device(stats)

        def devices(self):
            return {self.device}

    floor = stacking.DEVICE_STACK_BYTES
    assert stacking.stack_limit(Leaf(None)) == floor  # a CPU reports no memory statistics
    assert stacking.stack_limit(Leaf({"bytes_limit": 4 * floor})) == floor
    assert stacking.stack_limit(Leaf({"bytes_limit": 141 << 30})) == (141 << 30) // 16
    assert stacking.stack_limit(jax.numpy.zeros(2)) == floor  # this machine's CPU
