"""nu.stack_adapters (netutility_jax/engine/stacked.py): adapters stacked once per bucket give
what the adapters themselves give, through a handful of argument buffers."""

from __future__ import annotations

import collections

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import InputError

M = 3


def _adapters(seed=0, host=True):
    """Two layers of q (32 -> 16, rank 4) and v (32 -> 8, ragged ranks), task 2 lacks l1/v."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(M):
        ad = {}
        for layer in range(2):
            rv = 3 if i == 1 else 4
            ad[f"l{layer}"] = {
                "q": {
                    "lora_a": rng.normal(size=(32, 4)).astype(np.float32),
                    "lora_b": rng.normal(size=(4, 16)).astype(np.float32),
                    "scale": 1.5 + i,
                },
                "v": {
                    "lora_a": rng.normal(size=(32, rv)).astype(np.float32),
                    "lora_b": rng.normal(size=(rv, 8)).astype(np.float32),
                },
            }
        out.append(ad)
    out[2]["l1"]["v"] = None
    return out if host else jax.device_put(out)


NAMES = ["l0/q", "l0/v", "l1/q", "l1/v"]


def _dense(mod):
    if mod is None:
        return 0.0
    return (
        float(mod.get("scale", 1.0))
        * np.asarray(mod["lora_a"], np.float64)
        @ np.asarray(mod["lora_b"], np.float64)
    )


@pytest.mark.parametrize("host", [True, False], ids=["numpy", "device"])
def test_the_stacked_arrays_are_the_zero_padded_factors(host):
    ads = _adapters(host=host)
    st = nu.stack_adapters(ads)
    assert st.names == tuple(NAMES) and len(st) == M
    assert len(jax.tree.leaves(st)) == 4 * len(st.buckets)  # a, b, scale, rank per bucket
    for bk in st.buckets:
        a, b, s, r = (np.asarray(x) for x in bk.stacked)
        assert a.shape == (len(bk.names), M, bk.d_in, bk.r_max)
        for n, name in enumerate(bk.names):
            layer, kind = name.split("/")
            for i in range(M):
                mod = ads[i][layer][kind]
                if mod is None:
                    assert r[n, i] == 0 and not a[n, i].any() and not b[n, i].any()
                    continue
                k = np.asarray(mod["lora_a"]).shape[1]
                assert r[n, i] == k and s[n, i] == np.float32(mod.get("scale", 1.0))
                np.testing.assert_array_equal(a[n, i, :, :k], np.asarray(mod["lora_a"]))
                np.testing.assert_array_equal(b[n, i, :k], np.asarray(mod["lora_b"]))
                assert not a[n, i, :, k:].any() and not b[n, i, k:].any()
    # the per-module views give the dense updates back
    for i, ad in enumerate(st.unstack()):
        for name in NAMES:
            layer, kind = name.split("/")
            want = _dense(ads[i][layer][kind])
            got = _dense(ad[name])
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_scores_masks_and_h_are_those_of_the_adapters():
    ads = _adapters(1)
    st = nu.stack_adapters(ads)
    for kw in ({}, {"alpha": 0.0}, {"alpha": "auto", "lam": 0.5}):
        s1, s2 = nu.score(ads, **kw), nu.score(st, **kw)
        assert float(s2.lam) == pytest.approx(float(s1.lam), rel=1e-6)
        for name in NAMES:
            for f in ("sigma", "benefit", "interference", "utility"):
                np.testing.assert_allclose(
                    np.asarray(getattr(s2.modules[name], f)),
                    np.asarray(getattr(s1.modules[name], f)),
                    rtol=2e-5, atol=1e-6,
                )  # fmt: skip
        for scope in ("global", "local", "uniform"):
            m1, m2 = nu.allocate(s1, 2, scope=scope), nu.allocate(s2, 2, scope=scope)
            for name in NAMES:
                np.testing.assert_array_equal(np.asarray(m2[name]), np.asarray(m1[name]))
    assert float(nu.heterogeneity(st)) == pytest.approx(float(nu.heterogeneity(ads)), rel=1e-6)
    np.testing.assert_allclose(nu.task_energies(st), nu.task_energies(ads), rtol=1e-6)


@pytest.mark.parametrize(("method", "space"), [("ta", "core"), ("ties", "knots"), ("tsv", "full")])
def test_merges_of_the_stacked_set_are_the_adapters_merges(method, space):
    ads = _adapters(2)
    st = nu.stack_adapters(ads)
    w = [1.0, 0.5, 2.0]
    o1, r1 = nu.merge_adapters(ads, budget=2, method=method, space=space, weights=w)
    o2, r2 = nu.merge_adapters(st, budget=2, method=method, space=space, weights=w)
    assert list(o2) == NAMES  # a flat mapping: the stacked set keeps no tree
    # the merged factors stay stacked: two arrays per bucket (q and v), not two per module
    assert len(jax.tree.leaves(o2)) == 4
    for name in NAMES:
        layer, kind = name.split("/")
        want = np.asarray(nu.module_update(o1[layer][kind]), np.float64)
        got = np.asarray(nu.module_update(o2[name]), np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        np.testing.assert_array_equal(r2.kept[name], r1.kept[name])
    assert r2.ranks == r1.ranks and r2.heterogeneity == pytest.approx(r1.heterogeneity)


@pytest.mark.parametrize("allocation", ["net_utility", "all"])
def test_a_stacked_ta_merge_keeps_its_factors_stacked_and_trims_each_module_on_read(
    allocation, tmp_path
):
    ads = _adapters(6, host=False)
    st = nu.stack_adapters(ads)
    budget = None if allocation == "all" else 2
    want, r1 = nu.merge_adapters(ads, budget=budget, allocation=allocation, space="core")
    got, r2 = nu.merge_adapters(st, budget=budget, allocation=allocation, space="core")
    # two stacked leaves per bucket (q and v), not two per module: nothing was sliced or placed
    leaves = jax.tree.leaves(got)
    assert len(leaves) == 4 and {x.shape[0] for x in leaves} == {2}
    assert r2.ranks == r1.ranks and r2.zeroed == r1.zeroed
    assert r2.kept_per_task.tolist() == r1.kept_per_task.tolist()
    for name in NAMES:
        layer, kind = name.split("/")
        mod = got[name]
        # a module's rank is its number of kept directions, as for the list of trees
        assert mod["lora_a"].shape == (32, r1.ranks[name])
        assert mod["lora_b"].shape == (r1.ranks[name], 16 if kind == "q" else 8)
        w = _dense(want[layer][kind])
        np.testing.assert_allclose(_dense(mod), w, rtol=0, atol=1e-5 * np.abs(w).max())
    # the stacked result goes through a transformation as its blocks, and comes back whole
    twice = jax.jit(lambda t: jax.tree.map(lambda x: 2 * x, t))(got)
    for name in NAMES:
        np.testing.assert_allclose(_dense(twice[name]), 4 * _dense(got[name]), rtol=1e-6, atol=1e-6)
    # checkpointed as a dict is: each module at its own rank
    nu.checkpoint.save(tmp_path / "ckpt", got)
    back = nu.checkpoint.restore(tmp_path / "ckpt")
    for name in NAMES:
        assert np.asarray(back[name]["lora_a"]).shape[1] == r1.ranks[name]
        np.testing.assert_allclose(_dense(back[name]), _dense(got[name]), rtol=0, atol=0)


def test_a_jitted_allocation_returns_its_masks_stacked_and_merges_with_them():
    ads = _adapters(7, host=False)
    st = nu.stack_adapters(ads)

    @jax.jit
    def allocate(s):
        return nu.allocate(nu.score(s), 2)

    masks = allocate(st)
    want = nu.allocate(nu.score(ads), 2)
    # one block of (n, M, r_max) masks per bucket, not one output per module
    assert len(jax.tree.leaves(masks)) == 2
    for name in NAMES:
        np.testing.assert_array_equal(np.asarray(masks[name]), np.asarray(want[name]))
    for method in ("ta", "tsv"):
        got = nu.merge(st, masks, method=method, space="core")
        ref = nu.merge(ads, want, method=method, space="core")
        for name in NAMES:
            layer, kind = name.split("/")
            w = _dense(ref[layer][kind])
            np.testing.assert_allclose(_dense(got[name]), w, rtol=0, atol=1e-5 * np.abs(w).max())


def test_the_stacked_set_passes_through_jit_without_retracing():
    ads = _adapters(3)
    st = nu.stack_adapters(ads)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def run(s, w):
        merged, rep = nu.merge_adapters(s, budget=2, weights=w)
        return merged, rep.kept_per_task

    out, kept = run(st, jnp.ones(M))
    other = nu.stack_adapters(_adapters(4))  # new values, same shapes: no second trace
    run(other, jnp.ones(M))
    chex.clear_trace_counter()
    want, rep = nu.merge_adapters(ads, budget=2)
    np.testing.assert_array_equal(np.asarray(kept), rep.kept_per_task)
    for name in NAMES:
        layer, kind = name.split("/")
        w = np.asarray(nu.module_update(want[layer][kind]), np.float64)
        got = np.asarray(nu.module_update(out[name]), np.float64)
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-4 * np.abs(w).max())


def test_the_plan_and_diagnostics_of_a_stacked_set_are_the_adapters():
    ads = _adapters(5)
    st = nu.stack_adapters(ads)
    for kw in ({}, {"allocation": "all"}, {"allocation": "uniform"}):
        p1, p2 = nu.plan(ads, budget=2, **kw), nu.plan(st, budget=2, **kw)
        np.testing.assert_array_equal(p2.kept_per_task, p1.kept_per_task)
    d1, d2 = nu.diagnose(ads, budget=2), nu.diagnose(st, budget=2)
    assert d2.overlap_vs_chance == pytest.approx(d1.overlap_vs_chance, rel=1e-5)
    assert d2.lam == pytest.approx(d1.lam, rel=1e-6)
    assert nu.stack_adapters(st) is st
    assert [list(ad) for ad in st] == [NAMES] * M  # a sequence of flat adapters too
    with pytest.raises(InputError, match=r"nu\.score: mesh= shards the adapters' leaves"):
        nu.score(st, mesh=nu.module_mesh())


@pytest.mark.parametrize("allocation", ["net_utility", "all"])
def test_a_list_of_device_factors_can_be_sliced_on_the_device(monkeypatch, allocation):
    """The accelerators' route of a TA merge of device factors (forced here on the CPU): the
    merged modules are sliced on the device at their ranks, nothing is placed again, and every
    factor equals the host route's bit for bit."""
    from netutility_jax.operators import ta

    ads = _adapters(8, host=False)
    budget = None if allocation == "all" else 2
    want, r1 = nu.merge_adapters(ads, budget=budget, allocation=allocation, space="core")
    monkeypatch.setattr(ta, "DEVICE_SLICES", True)
    monkeypatch.setattr(ta, "put_views", lambda *a, **k: pytest.fail("placed again"))
    got, r2 = nu.merge_adapters(ads, budget=budget, allocation=allocation, space="core")
    assert r2.ranks == r1.ranks and r2.zeroed == r1.zeroed
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert isinstance(x, jax.Array) == isinstance(y, jax.Array)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # numpy factors (a streamed chunk's) keep the host route, which places its results
    placed = []
    monkeypatch.setattr(
        ta, "put_views", lambda views: placed.append(len(views)) or [jnp.asarray(v) for v in views]
    )
    nu.merge_adapters(_adapters(8), budget=budget, allocation=allocation, space="core")
    assert placed


@pytest.mark.parametrize(
    ("method", "opts"), [("ties", {"density": 1e-300}), ("dare", {"p": 0.999999})]
)
def test_stacked_merges_flag_modules_merged_to_zero_as_the_list_does(method, opts):
    ads = _adapters(9, host=False)
    st = nu.stack_adapters(ads)
    key = jax.random.key(0)
    with pytest.warns(UserWarning, match="exactly zero"):
        _, want = nu.merge_adapters(ads, budget=2, method=method, space="core", key=key, **opts)
    with pytest.warns(UserWarning, match="exactly zero"):
        got, rep = nu.merge_adapters(st, budget=2, method=method, space="core", key=key, **opts)
    assert rep.zeroed == want.zeroed and rep.zeroed  # the flags agree with the modules read
    for name in rep.zeroed:
        assert not np.any(_dense(got[name]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_a_stacked_set_merges_in_the_dtype_its_adapters_merge_in(dtype):
    # the compute dtype of a stacked set is read from its stacked factors, not its modules
    with jax.enable_x64(dtype == "float64"):
        ads = jax.tree.map(
            lambda x: np.asarray(x, dtype) if isinstance(x, np.ndarray) else x, _adapters()
        )
        want, want_rep = nu.merge_adapters(ads, budget=4, method="ta", space="core")
        got, got_rep = nu.merge_adapters(
            nu.stack_adapters(ads), budget=4, method="ta", space="core"
        )
        expected = np.float64 if dtype == "float64" else np.float32
        for layer in ("l0", "l1"):
            for kind in ("q", "v"):
                w = nu.module_update(want[layer][kind])
                g = nu.module_update(got[f"{layer}/{kind}"])
                assert w.dtype == g.dtype == expected, (w.dtype, g.dtype)
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
        assert got_rep.kept_per_task.tolist() == want_rep.kept_per_task.tolist()
        assert got_rep.budget_spent == want_rep.budget_spent


# ------------------------------------------------------------------------------------------------
# Facts of a bucket computed once (a nu.stack_adapters set keeps its buckets across calls)
# ------------------------------------------------------------------------------------------------


def test_a_stacked_sets_dtypes_and_scales_are_walked_once_and_a_reweighted_set_walks_its_own(
    monkeypatch,
):
    """The compute dtype and the scales' range check read every (module, task) once per bucket;
    a set with other scales (``with_weights``: new buckets) is checked on its own scales, so a
    weight that takes a scale beyond float32 is refused after the unweighted set passed."""
    from netutility_jax._core import tree as _tree
    from netutility_jax.operators import _plan

    rng = np.random.default_rng(0)
    ads = [
        {f"l{i}": {"lora_a": rng.normal(size=(8, 2)).astype(np.float32),
                   "lora_b": rng.normal(size=(2, 6)).astype(np.float32), "scale": 1.0 + t}
         for i in range(3)}
        for t in range(2)
    ]  # fmt: skip
    st = nu.stack_adapters(ads)
    walks = collections.Counter()
    for owner, name in ((_tree, "_dtypes"), (_plan, "_abs_scales")):
        real = getattr(owner, name)

        def counted(bk, real=real, name=name):
            walks[name] += 1
            return real(bk)

        monkeypatch.setattr(owner, name, counted)
    names, buckets, _ = _tree.collect(st, fn="t")
    fi = np.finfo(np.float32)
    for _ in range(3):
        assert _tree.compute_dtype(buckets) == np.float32
        _plan.check_scale_range("t", buckets, np.float32)
    assert walks == {"_dtypes": len(buckets), "_abs_scales": len(buckets)}
    with pytest.raises(InputError, match=r"scale of module 'l\d', task 1"):
        _plan.check_scale_range("t", _tree.collect(st.with_weights([1.0, 2e38]), fn="t")[1],
                                np.float32)  # fmt: skip
    assert float(fi.max) < 2.0 * 2e38  # (the weighted scale, 2 x 2e38, is beyond float32)
    assert names == list(st.names)
