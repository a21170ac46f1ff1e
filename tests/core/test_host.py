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


# host_constant: small values placed once, the same device array given back after


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float16, np.bool_])
def test_host_constant_places_a_small_value_once(monkeypatch, dtype):
    host_mod.forget_constants()  # (an earlier test may have placed these values)
    placed = []
    put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: placed.append(x) or put(x, *a, **k))
    value = np.asarray([3, 0, 1], dtype)[0] if dtype is not np.bool_ else np.bool_(True)
    x = host_mod.host_constant(value, dtype)
    y = host_mod.host_constant(value.item(), dtype)  # the same bits from a Python number
    assert y is x and len(placed) == 1
    _same_array(x, jax.device_put(np.asarray(value, dtype)))
    # another dtype, another value, or a larger array: another placement
    assert host_mod.host_constant(value, np.float64 if dtype is np.float32 else np.float32) is not x
    assert host_mod.host_constant(np.zeros(2, dtype), dtype) is not x
    big = np.arange(host_mod._KEPT_SIZE + 1).astype(dtype)
    assert host_mod.host_constant(big, dtype) is not host_mod.host_constant(big, dtype)


def test_host_constant_tells_apart_values_with_equal_floats():
    # -0.0 == 0.0 and a NaN is not equal to itself: keyed by bits, not by value
    zero, neg = host_mod.host_constant(0.0, np.float32), host_mod.host_constant(-0.0, np.float32)
    assert zero is not neg and np.signbit(np.asarray(neg)) and not np.signbit(np.asarray(zero))
    nan = host_mod.host_constant(float("nan"), np.float32)
    assert nan is host_mod.host_constant(float("nan"), np.float32) and np.isnan(np.asarray(nan))
    # rounding to the dtype first: two doubles with one float32 image give one array
    assert host_mod.host_constant(0.1, np.float32) is host_mod.host_constant(
        float(np.float32(0.1)), np.float32
    )


def test_host_constant_places_again_what_a_caller_deleted():
    x = host_mod.host_constant(0.625, np.float32)
    x.delete()  # (as donating it to a jitted function does on an accelerator)
    y = host_mod.host_constant(0.625, np.float32)
    assert y is not x and not y.is_deleted() and float(y) == 0.625


def test_host_constant_inside_a_trace_keeps_no_tracer():
    value = 0.8125  # (a value no other test places)

    @jax.jit
    def f(a):
        return a * host_mod.host_constant(value, np.float32)

    assert float(f(np.float32(2.0))) == 1.625
    x = host_mod.host_constant(value, np.float32)  # a concrete array, placed now
    assert isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    assert float(x) == value and float(f(np.float32(3.0))) == 2.4375


def test_release_forgets_the_placed_constants():
    from netutility_jax._core import executables

    x = host_mod.host_constant(0.375, np.float32)
    executables.release()
    assert host_mod.host_constant(0.375, np.float32) is not x


def _small_adapters(seed: int, *, modules: int, scale: float) -> list[dict]:
    """Three tasks of ``modules`` modules (6 -> 5, rank 2), float32 numpy factors."""
    rng = np.random.default_rng(seed)
    return [
        {
            f"l{i}": {
                "lora_a": rng.normal(size=(6, 2)).astype(np.float32),
                "lora_b": rng.normal(size=(2, 5)).astype(np.float32),
                "scale": scale,
            }
            for i in range(modules)
        }
        for _ in range(3)
    ]


def test_a_steady_score_and_merge_place_nothing(monkeypatch):
    # the settings (tolerances, alpha, lambda, the merge's coefficient) were placed by the first
    # call; a second call of the same shapes places none of them again
    import netutility_jax as nu

    stacked = jax.block_until_ready(nu.stack_adapters(_small_adapters(0, modules=3, scale=1.5)))

    def run():
        masks = nu.allocate(nu.score(stacked), 3)
        merged = nu.merge_adapters(stacked, budget=3, method="ta", space="core")[0]
        return jax.block_until_ready((jax.tree.leaves(masks), jax.tree.leaves(merged)))

    run()
    placed = []
    put = jax.device_put

    def device_put(x, *a, **k):  # host values only (a device array's copy crosses nothing)
        placed.extend(v for v in jax.tree.leaves(x) if not isinstance(v, jax.Array))
        return put(x, *a, **k)

    monkeypatch.setattr(jax, "device_put", device_put)
    run()
    assert placed == []


def test_host_constant_follows_the_default_device():
    # a value placed on one default device is not handed out under another
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import jax, numpy as np
        from netutility_jax._core.host import host_constant
        d0, d1 = jax.devices()[:2]
        a = host_constant(0.5, np.float32)
        with jax.default_device(d1):
            b = host_constant(0.5, np.float32)
            c = host_constant(0.5, np.float32)
        assert a.devices() == {d0} and b.devices() == {d1} and c is b, (a.devices(), b.devices())
        assert host_constant(0.5, np.float32) is a
        print("ok")
        """
    )
    env = {**__import__("os").environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_value_handed_to_the_caller_is_its_own(monkeypatch):
    # two calls' results never share a buffer: deleting (or donating) one leaves the other whole
    import netutility_jax as nu

    stacked = nu.stack_adapters(_small_adapters(1, modules=2, scale=1.0))
    s1, s2 = nu.score(stacked), nu.score(stacked)
    r1 = nu.merge_adapters(stacked, budget=2, method="ta")[1]
    r2 = nu.merge_adapters(stacked, budget=2, method="ta")[1]
    for one, two in ((s1, s2), (r1.scores, r2.scores)):
        assert one.alpha is not two.alpha
        one.alpha.delete()
        assert float(two.alpha) == 1.0 and not two.alpha.is_deleted()
    mine = host_mod.host_constant(0.4375, np.float32, shared=False)
    assert mine is not host_mod.host_constant(0.4375, np.float32, shared=False)
    mine.delete()
    assert float(host_mod.host_constant(0.4375, np.float32)) == 0.4375
