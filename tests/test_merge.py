"""nu.merge / nu.merge_adapters / nu.fold / nu.to_lora against dense float64 references."""

from __future__ import annotations

import functools

import _merge_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import merging as merge_mod

# one bucket (keeps compiles few), ragged ranks, a module task 1 lacks; SPEC2 adds a second shape
SPEC = (
    ("layers/0/q", 18, 12, (4, 3, 5)),
    ("layers/0/v", 18, 12, (5, 4, 4)),
    ("layers/1/q", 18, 12, (2, None, 5)),
)
SPEC2 = (*SPEC, ("mlp/up", 10, 22, (3, 5, 2)))
M = 3
SHAPES = {name: (d_in, d_out) for name, d_in, d_out, _ in SPEC2}


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


@functools.lru_cache
def _adapters(seed=0, two_buckets=False):
    return ref.make_adapters(seed, M, SPEC2 if two_buckets else SPEC)


def _masks(ads, seed, p=0.65):
    rng = np.random.default_rng(seed)
    out = {}
    for name, _, _, ranks in SPEC2:
        if name not in ads[0]:
            continue
        r_max = max(r for r in ranks if r is not None)
        out[name] = rng.random((M, r_max)) < p
    return out


def _kept(ads, name, masks):
    d_in, d_out = SHAPES[name]
    return ref.kept_updates(
        [ad[name] for ad in ads], d_in, d_out, None if masks is None else masks[name]
    )


def _check(out, want_fn, ads, masks, atol=1e-9):
    for name in ads[0]:
        got = ref.dense(out[name])
        want = want_fn(name, _kept(ads, name, masks))
        scale = max(np.abs(want).max(), 1.0)
        np.testing.assert_allclose(got / scale, want / scale, atol=atol, err_msg=name)


REF_METHODS = {
    "ta": lambda xs: ref.ta(xs, 0.8),
    "tsv": lambda xs: ref.tsv(xs, 0.8),
    "tsv_iso": lambda xs: ref.tsv(xs, 0.8, isotropize=True),
    "ta_iso": lambda xs: ref.iso_c(xs, 0.8),
    "iso_c": lambda xs: ref.iso_c(xs, 0.8),
    "iso_cts": lambda xs: ref.iso_cts(xs, 0.8),
    "ties": lambda xs: ref.ties(xs, 0.8, 0.3),
}
CALL = {
    "ta": ("ta", {}),
    "tsv": ("tsv", {}),
    "tsv_iso": ("tsv", {"isotropize": True}),
    "ta_iso": ("ta", {"isotropize": True}),
    "iso_c": ("iso_c", {}),
    "iso_cts": ("iso_cts", {}),
    "ties": ("ties", {"density": 0.3}),
}


def _ref_in_space(space, method_fn, ads):
    def want(name, xs):
        mods = [ad[name] for ad in ads]
        d_in, d_out = SHAPES[name]
        if space == "full":
            return method_fn(xs)
        if space == "core":
            return ref.in_core(lambda c: method_fn(c), mods, xs, d_in, d_out)
        variant = "original" if space == "knots_original" else "core_space"
        return ref.in_knots(lambda c: method_fn(c), xs, variant)

    return want


@pytest.fixture(scope="module", params=["householder", "cholesky"])
def qr_route(request):
    """The QR route of netutility_jax._linalg: Householder (at most _SMALL rows, as every module
    in these small tests) or CholeskyQR2 (larger modules), forced by setting _SMALL to 0.
    Module-scoped: pytest groups the tests by route, so caches are cleared once per switch."""
    from netutility_jax import _linalg

    saved = _linalg._SMALL
    if request.param == "cholesky":
        _linalg._SMALL = 0
        jax.clear_caches()  # traces read _SMALL: do not reuse the Householder ones
    yield request.param
    _linalg._SMALL = saved
    jax.clear_caches()


@pytest.mark.parametrize("space", ["full", "core", "knots", "knots_original"])
@pytest.mark.parametrize("name", list(CALL))
def test_method_in_space_matches_dense_reference(space, name, qr_route):
    ads = _adapters()
    masks = _masks(ads, 7) if name != "ta_iso" else None  # non-prefix selections, and all kept
    method, opts = CALL[name]
    kw = dict(opts)
    sp = space
    if space == "knots_original":
        sp, kw["variant"] = "knots", "original"
    out = nu.merge(ads, masks, method=method, space=sp, coef=0.8, **kw)
    _check(out, _ref_in_space(space, REF_METHODS[name], ads), ads, masks)


@pytest.mark.parametrize("name", ["ta", "tsv", "iso_c", "ta_iso", "tsv_iso", "iso_cts"])
def test_equal_across_spaces(name):
    """TA: full = core = KnOTS. TSV/Iso: full = core = KnOTS(original, scaled blocks)."""
    ads = _adapters(1)
    masks = _masks(ads, 3)
    method, opts = CALL[name]
    full = nu.merge(ads, masks, method=method, space="full", **opts)
    others = [
        nu.merge(ads, masks, method=method, space="core", **opts),
        nu.merge(ads, masks, method=method, space="knots", variant="original", **opts),
    ]
    if name == "ta":
        others.append(nu.merge(ads, masks, method=method, space="knots", **opts))
    for o in others:
        for n in ads[0]:
            np.testing.assert_allclose(ref.dense(o[n]), ref.dense(full[n]), atol=1e-9)


def test_results_are_low_rank_with_their_own_rank():
    ads = _adapters(0, True)
    masks = _masks(ads, 5)
    kept = {n: int(np.sum([m.sum() for m in [masks[n]]])) for n in ads[0]}
    for space in ("full", "core", "knots"):
        out = nu.merge(ads, masks, method="ta", space=space)
        for n in ads[0]:
            mod = out[n]
            assert set(mod) == {"lora_a", "lora_b", "scale"}
            k = mod["lora_a"].shape[1]
            assert mod["lora_b"].shape == (k, SHAPES[n][1])
            want = np.linalg.matrix_rank(sum(_kept(ads, n, masks)))
            assert k == want <= kept[n]
    out = nu.merge(ads, method="ties", space="core", density=0.5)
    for n in ads[0]:
        assert out[n]["lora_a"].shape[1] == np.linalg.matrix_rank(ref.dense(out[n]), tol=1e-8)
    out = nu.merge(ads, method="ties", space="full", density=0.5)
    assert set(out["mlp/up"]) == {"delta"} and out["mlp/up"]["delta"].shape == (10, 22)


def test_iso_c_spectrum_equals_mean():
    """Flat in full, core and KnOTS-original space; KnOTS's default (unscaled blocks) maps the flat
    block spectrum back through ``S``, so there only the blocks are flat."""
    ads = _adapters(2)
    for space, kw in (("full", {}), ("core", {}), ("knots", {"variant": "original"})):
        out = nu.merge(ads, method="iso_c", space=space, **kw)
        for n in ads[0]:
            s = np.linalg.svd(ref.dense(out[n]), compute_uv=False)
            nz = s[s > 1e-8 * s[0]]
            np.testing.assert_allclose(nz, nz.mean(), rtol=1e-9)
            if True:  # the mean of the TA sum's nonzero spectrum
                ts = np.linalg.svd(sum(_kept(ads, n, None)), compute_uv=False)
                np.testing.assert_allclose(nz.mean(), ts[ts > 1e-9 * ts[0]].mean(), rtol=1e-9)


def test_tsv_direction_blocks_orthonormal():
    """Orthonormal merged directions, returned as they are (no re-factoring). In KnOTS's default
    variant the merged block maps back through ``S``, so only the original variant qualifies."""
    ads = _adapters(3)
    for space, kw in (("full", {}), ("core", {}), ("knots", {"variant": "original"})):
        out = nu.merge(ads, _masks(ads, 1), method="tsv", space=space, **kw)
        for n in ads[0]:
            a, b = np.asarray(out[n]["lora_a"]), np.asarray(out[n]["lora_b"])
            np.testing.assert_allclose(b @ b.T, np.eye(b.shape[0]), atol=1e-9)
            g = a.T @ a
            np.testing.assert_allclose(g, np.diag(np.diag(g)), atol=1e-9)


@pytest.mark.parametrize("space", ["full", "core", "knots"])
def test_ties_single_task_density_one_returns_task(space):
    ads = _adapters(4)[:1]
    out = nu.merge(ads, method="ties", space=space, density=1.0, coef=1.0)
    for n in ads[0]:
        np.testing.assert_allclose(ref.dense(out[n]), ref.dense(ads[0][n], SHAPES[n]), atol=1e-9)


@pytest.mark.parametrize("space", ["full", "core", "knots"])
def test_dare(space):
    ads = _adapters(5)
    masks = _masks(ads, 2)
    ta = nu.merge(ads, masks, method="ta", space=space, coef=0.5)
    k = jax.random.key(0)
    d0 = nu.merge(ads, masks, method="dare", space=space, key=k, p=0.0, coef=0.5)
    for n in ads[0]:
        np.testing.assert_allclose(ref.dense(d0[n]), ref.dense(ta[n]), atol=1e-9)
    d1 = nu.merge(ads, masks, method="dare", space=space, key=k, p=0.3)
    d2 = nu.merge(ads, masks, method="dare", space=space, key=k, p=0.3)
    d3 = nu.merge(ads, masks, method="dare", space=space, key=jax.random.key(1), p=0.3)
    n = "layers/0/q"
    np.testing.assert_array_equal(ref.dense(d1[n]), ref.dense(d2[n]))
    assert not np.allclose(ref.dense(d1[n]), ref.dense(d3[n]))
    # dare_ties with p = 0 is TIES's sign election on the untrimmed tasks (density 1)
    dt = nu.merge(ads, masks, method="dare_ties", space=space, key=k, p=0.0)
    ti = nu.merge(ads, masks, method="ties", space=space, density=1.0)
    np.testing.assert_allclose(ref.dense(dt[n]), ref.dense(ti[n]), atol=1e-9)


def test_dare_mean_over_keys_approaches_ta():
    ads = [{"m": ad["layers/0/v"]} for ad in _adapters(6)]
    ta = ref.dense(nu.merge(ads, method="ta")["m"])
    draws = [
        ref.dense(nu.merge(ads, method="dare", key=jax.random.key(i), p=0.3)["m"])
        for i in range(200)
    ]
    err1 = np.linalg.norm(draws[0] - ta) / np.linalg.norm(ta)
    err = np.linalg.norm(np.mean(draws, 0) - ta) / np.linalg.norm(ta)
    assert err < 0.1 < err1 and err < err1 / 5


def test_full_budget_lambda0_ta_is_sum_of_all_updates():
    ads = _adapters(7)
    out, rep = nu.merge_adapters(ads, budget=M * 5, method="ta", lam=0.0)
    for n in ads[0]:
        want = sum(ref.dense(ad[n], SHAPES[n]) for ad in ads)
        np.testing.assert_allclose(ref.dense(out[n]), want, atol=1e-9)
    assert rep.lam == 0.0 and rep.scope == "global"
    assert rep.budget_spent == sum(sum(r for r in rk if r) for *_, rk in SPEC) / len(SPEC)
    assert rep.non_prefix_fraction == 0.0


def test_merge_adapters_report_and_scope_defaults():
    ads = _adapters(8, True)
    out, rep = nu.merge_adapters(ads, budget=4, method="tsv", space="core")
    masks = nu.allocate(nu.score(ads), 4, scope="global")
    direct = nu.merge(ads, masks, method="tsv", space="core")
    for n in ads[0]:
        np.testing.assert_allclose(ref.dense(out[n]), ref.dense(direct[n]), atol=1e-10)
        np.testing.assert_array_equal(rep.kept[n], np.asarray(masks[n]).sum(1))
        assert rep.ranks[n] == out[n]["lora_a"].shape[1]
    assert rep.budget_spent == nu.budget_spent(masks) <= 4
    assert rep.non_prefix_fraction == nu.non_prefix_fraction(masks)
    assert rep.kept_per_task.shape == (M,)
    np.testing.assert_allclose(rep.heterogeneity, float(nu.heterogeneity(ads)))
    _, rep = nu.merge_adapters(ads, budget=4, method="ties", density=0.5)
    assert rep.scope == "local" and all(v.sum() <= 4 for v in rep.kept.values())
    _, rep = nu.merge_adapters(ads, budget=4, method="ta", allocation="uniform")
    assert rep.scope is None and all(v.sum() == 4 for v in rep.kept.values())
    assert rep.non_prefix_fraction == 0.0
    _, rep = nu.merge_adapters(ads, budget=4, method="ta", allocation="all")
    assert rep.lam is None and rep.budget_spent == 42 / 4  # every candidate of every task


def test_empty_selection_gives_rank_zero():
    ads = _adapters(9)
    masks = _masks(ads, 0)
    masks["layers/0/v"] = np.zeros_like(masks["layers/0/v"])
    for method, kw in (("ta", {}), ("tsv", {}), ("iso_cts", {}), ("ties", {})):
        for space in ("full", "core", "knots"):
            out = nu.merge(ads, masks, method=method, space=space, **kw)
            mod = out["layers/0/v"]
            if "delta" in mod:
                assert not np.any(np.asarray(mod["delta"]))
            else:
                assert mod["lora_a"].shape == (18, 0) and mod["lora_b"].shape == (0, 12)
            assert all(np.all(np.isfinite(np.asarray(v))) for v in mod.values())
            assert np.all(np.isfinite(ref.dense(out["layers/0/q"])))
    out = nu.merge(ads, {n: np.zeros_like(v) for n, v in masks.items()}, method="iso_c")
    assert all(out[n]["lora_a"].shape[1] == 0 for n in out)


def test_zero_update_and_missing_module():
    ads = [dict(ad) for ad in _adapters(10)]
    z = dict(ads[2]["layers/0/q"])
    z["lora_b"] = np.zeros_like(z["lora_b"])
    ads[2]["layers/0/q"] = z
    out = nu.merge(ads, method="tsv", space="core")
    xs = [ref.dense(ad["layers/0/q"], (18, 12)) for ad in ads]
    np.testing.assert_allclose(ref.dense(out["layers/0/q"]), ref.tsv(xs), atol=1e-9)
    assert out["layers/1/q"]["lora_a"].shape[1] == 7  # task 1 lacks it: ranks 2 + 5


def test_nested_tree_is_rebuilt():
    rng = np.random.default_rng(0)
    ads = [
        {
            "layers": {
                "0": {
                    "attn": {
                        "query": {
                            "lora_a": rng.normal(size=(8, 2)),
                            "lora_b": rng.normal(size=(2, 6)),
                        }
                    }
                }
            }
        }
        for _ in range(2)
    ]
    out = nu.merge(ads, method="iso_c", space="knots")
    assert set(out["layers"]["0"]["attn"]["query"]) == {"lora_a", "lora_b", "scale"}


def test_float32_and_bf16_inputs():
    with jax.enable_x64(False):
        ads = ref.make_adapters(11, M, SPEC, dtype=np.float32)
        ads_bf = [
            {
                n: None if m is None else {**m, "lora_a": jnp.asarray(m["lora_a"], jnp.bfloat16)}
                for n, m in ad.items()
            }
            for ad in ads
        ]
        for a in (ads, ads_bf):
            out = nu.merge(a, method="tsv", space="core")
            assert out["layers/0/q"]["lora_a"].dtype == jnp.float32
        xs = [ref.dense(ad["layers/0/v"]) for ad in ads]
        out = nu.merge(ads, method="tsv", space="knots", variant="original")
        np.testing.assert_allclose(ref.dense(out["layers/0/v"]), ref.tsv(xs), atol=2e-4)


def test_fold_and_to_lora():
    ads = _adapters(12, True)
    rng = np.random.default_rng(1)
    params = {
        n: {"kernel": rng.normal(size=SHAPES[n]), "bias": np.zeros(SHAPES[n][1])} for n in ads[0]
    }
    lo = nu.merge(ads, method="ta", space="core")
    de = nu.merge(ads, method="ties", density=0.4)
    for merged in (lo, de):
        folded = nu.fold(params, merged, coef=0.5)
        for n in ads[0]:
            np.testing.assert_allclose(
                folded[n]["kernel"], params[n]["kernel"] + 0.5 * ref.dense(merged[n]), atol=1e-10
            )
            assert folded[n]["bias"] is params[n]["bias"]
    nested = {"layers": {"0": {"q": np.zeros((18, 12))}}}
    f = nu.fold(nested, {"layers": {"0": {"q": lo["layers/0/q"]}}})
    np.testing.assert_allclose(f["layers"]["0"]["q"], ref.dense(lo["layers/0/q"]), atol=1e-10)
    with pytest.raises(ValueError, match=r"nu.fold: module 'layers/0/q': base kernel has shape"):
        nu.fold({"layers/0/q": np.zeros((12, 18))}, {"layers/0/q": lo["layers/0/q"]})
    # truncated SVD back to LoRA: Eckart-Young
    d = ref.dense(de["layers/0/v"])
    m2 = nu.to_lora(de["layers/0/v"], 3)
    u, s, vt = np.linalg.svd(d)
    np.testing.assert_allclose(ref.dense(m2), (u[:, :3] * s[:3]) @ vt[:3], atol=1e-9)
    m3 = nu.to_lora(lo["layers/0/v"], 2)
    u, s, vt = np.linalg.svd(ref.dense(lo["layers/0/v"]))
    np.testing.assert_allclose(ref.dense(m3), (u[:, :2] * s[:2]) @ vt[:2], atol=1e-9)


# ------------------------------------------------------------------ errors


def test_errors():
    ads = _adapters(0, True)
    masks = _masks(ads, 0)
    with pytest.raises(ValueError, match=r"nu.merge: unknown method 'foo'; expected one of"):
        nu.merge(ads, method="foo")
    with pytest.raises(ValueError, match=r"nu.merge: unknown space 'bar'"):
        nu.merge(ads, space="bar")
    with pytest.raises(
        ValueError,
        match=r"method='ta' in space='full' does not take 'density'; it takes 'isotropize'",
    ):
        nu.merge(ads, method="ta", density=0.3)
    with pytest.raises(
        ValueError, match=r"method='iso_c' in space='full' does not take 'p'; it takes no options"
    ):
        nu.merge(ads, method="iso_c", p=0.3)
    with pytest.raises(ValueError, match=r"nu.merge: density=1.5; expected a number in \[0, 1\]"):
        nu.merge(ads, method="ties", density=1.5)
    with pytest.raises(ValueError, match=r"nu.merge: p=1.0; expected a number in \[0, 1\)"):
        nu.merge(ads, method="dare", p=1.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"nu.merge: p=-0.1"):
        nu.merge(ads, method="dare", p=-0.1, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"method='dare' needs key="):
        nu.merge(ads, method="dare", p=0.5)
    with pytest.raises(ValueError, match=r"method='dare_ties' needs p="):
        nu.merge(ads, method="dare_ties", key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"nu.merge: coef=nan; expected a finite scalar"):
        nu.merge(ads, coef=float("nan"))
    with pytest.raises(ValueError, match=r"nu.merge: coef=inf"):
        nu.merge(ads, coef=np.inf)
    bad = dict(masks)
    del bad["mlp/up"]
    bad["mlp/down"] = masks["mlp/up"]
    with pytest.raises(
        ValueError,
        match=r"mask names do not match .*no mask for module 'mlp/up'; masks for module 'mlp/down'",
    ):
        nu.merge(ads, bad)
    bad = dict(masks)
    bad["mlp/up"] = masks["mlp/up"][:, :2]
    with pytest.raises(
        ValueError,
        match=r"mask of module 'mlp/up' has shape \(3, 2\); expected \(M, r_max\) = \(3, 5\)",
    ):
        nu.merge(ads, bad)
    bad["mlp/up"] = masks["mlp/up"].astype(np.float32)
    with pytest.raises(
        TypeError, match=r"mask of module 'mlp/up' has dtype float32; expected bool"
    ):
        nu.merge(ads, bad)
    with pytest.raises(TypeError, match=r"masks is a list"):
        nu.merge(ads, [masks])
    with pytest.raises(ValueError, match=r"KnOTS variant='x'"):
        nu.merge(ads, space="knots", variant="x")
    with pytest.raises(ValueError, match=r"does not take 'variant'"):
        nu.merge(ads, space="core", variant="original")
    with pytest.raises(ValueError, match=r"TIES scope='layer'"):
        nu.merge(ads, method="ties", scope="layer")
    with pytest.raises(ValueError, match=r"unknown allocation 'topk'"):
        nu.merge_adapters(ads, budget=4, allocation="topk")
    with pytest.raises(ValueError, match=r"budget=0"):
        nu.merge_adapters(ads, budget=0)
    with pytest.raises(ValueError, match=r"nu.to_lora: rank=-1"):
        nu.to_lora({"delta": np.ones((3, 3))}, -1)


# ------------------------------------------------------------------ no dense update, no recompile


def _all_shapes(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for p in eqn.params.values():
            subs = p if isinstance(p, (list, tuple)) else [p]
            for s in subs:
                inner = getattr(s, "jaxpr", None)
                if inner is not None:
                    yield from _all_shapes(getattr(inner, "jaxpr", inner))


@pytest.mark.parametrize("space", ["full", "core", "knots"])
@pytest.mark.parametrize("method", ["ta", "tsv", "iso_c", "iso_cts", "ties", "dare"])
def test_low_rank_paths_never_form_dense_update(space, method):
    if space == "full" and method in ("ties", "dare"):
        pytest.skip("elementwise methods in full space are dense by definition")
    d_in, d_out, r = 37, 53, 3
    ads = ref.make_adapters(0, 4, (("m", d_in, d_out, (3, 3, 3, 3)),))
    _names, buckets, m_tasks = nu._tree.collect(ads, fn="t")
    bk = buckets[0]
    opts = merge_mod._resolve_options("t", method, space, {"p": 0.2} if method == "dare" else {})
    static, nums = merge_mod._split(opts, jnp.float64)
    cfg = (method, space, static, d_in, d_out, r, jnp.float64, 1)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(1))
    jaxpr = jax.make_jaxpr(functools.partial(merge_mod._bucket_merge, cfg=cfg))(
        nu._tree.bucket_arrays(bk), jnp.ones((1, m_tasks, r), bool), jnp.asarray(1.0), keys, nums
    )
    shapes = list(_all_shapes(jaxpr.jaxpr))
    assert shapes, "empty jaxpr"
    dense = [s for s in shapes if d_in in s and d_out in s]
    assert not dense, dense


def test_second_call_does_not_recompile():
    ads = _adapters(13)
    stages = [
        merge_mod._stage_reduce,
        merge_mod._stage_coords,
        merge_mod._stage_low_rank,
        merge_mod._stage_decode,
        merge_mod._stage_elementwise,
    ]
    nu.merge(ads, method="tsv", space="knots")
    nu.merge(ads, method="ties", space="core", density=0.2)
    before = [f._cache_size() for f in stages]
    nu.merge(_adapters(14), method="tsv", space="knots", coef=2.0)
    nu.merge(_adapters(14), method="ties", space="core", density=0.7, coef=0.5)
    assert [f._cache_size() for f in stages] == before


# ----------------------------------------------------------------- TIES over the whole model


@pytest.mark.parametrize("space", ["full", "core"])
def test_ties_model_scope_matches_dense_reference(space):
    """One top-k per task over every module (original TIES / KnOTS), two buckets."""
    ads = _adapters(2, True)
    masks = _masks(ads, 11)
    names = list(ads[0])
    kept = {n: _kept(ads, n, masks) for n in names}
    if space == "full":
        coords = [kept[n] for n in names]
        back = [lambda x: x for _ in names]
    else:
        coords, back = [], []
        for n in names:
            left, right = ref.core_bases([ad[n] for ad in ads], kept[n], *SHAPES[n])
            coords.append([left.T @ x @ right for x in kept[n]])
            back.append(lambda x, left=left, right=right: left @ x @ right.T)
    want = ref.ties_model(coords, coef=0.7, density=0.3)
    out = nu.merge(ads, masks, method="ties", space=space, scope="model", density=0.3, coef=0.7)
    for n, w, bk in zip(names, want, back, strict=True):
        np.testing.assert_allclose(ref.dense(out[n]), bk(w), atol=1e-9, err_msg=n)
    # and it differs from the per-module top-k (the scopes are not the same operator)
    per_mod = nu.merge(ads, masks, method="ties", space=space, density=0.3, coef=0.7)
    assert any(not np.allclose(ref.dense(out[n]), ref.dense(per_mod[n]), atol=1e-6) for n in names)


@pytest.mark.parametrize("space", ["full", "core", "knots"])
def test_ties_model_scope_one_module_equals_module_scope(space):
    ads = [{"q": ad["layers/0/q"]} for ad in _adapters(3)]
    a = nu.merge(ads, method="ties", space=space, scope="model", density=0.4)
    b = nu.merge(ads, method="ties", space=space, scope="module", density=0.4)
    np.testing.assert_allclose(ref.dense(a["q"]), ref.dense(b["q"]), atol=1e-10)


def test_ties_model_scope_density_edges():
    ads = _adapters(4, True)
    zero = nu.merge(ads, method="ties", scope="model", density=0.0)
    assert all(not np.any(ref.dense(m)) for m in zero.values())
    full = nu.merge(ads, method="ties", scope="model", density=1.0)
    mod = nu.merge(ads, method="ties", scope="module", density=1.0)
    for n in ads[0]:
        np.testing.assert_allclose(ref.dense(full[n]), ref.dense(mod[n]), atol=1e-12)


def _disjoint_mean_np(x):
    """TIES sign election and disjoint mean over axis -3, written out (zero sum elects +)."""
    pos = x.sum(-3, keepdims=True) >= 0
    agree = np.where(pos, x > 0, x < 0)
    return np.where(agree, x, 0).sum(-3) / np.maximum(agree.sum(-3), 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_radix_threshold_keeps_exactly_k_with_ties(dtype):
    """Many equal magnitudes across units: exactly k kept per task, ties in flat (unit) order."""
    rng = np.random.default_rng(0)
    units_np = [rng.integers(-3, 4, size=(u, 2, 5, 4)).astype(dtype) for u in (1, 3, 2)]
    flat = [np.concatenate([np.moveaxis(x, 1, 0)[i].ravel() for x in units_np]) for i in range(2)]
    sizes = [x[:, 0].size for x in units_np]
    uint = np.uint32 if dtype == np.float32 else np.uint64
    for k in (0, 1, 7, 23, 60, flat[0].size):
        units = [(lambda x=x: jnp.asarray(x), None) for x in units_np]
        t, room, at = merge_mod._radix_threshold(units, 2, k, np.dtype(dtype))
        want = []
        for i in range(2):
            w = np.zeros(flat[i].size, bool)
            w[np.argsort(-np.abs(flat[i]), kind="stable")[:k]] = True
            want.append(w & (flat[i] != 0))  # zero entries kept or not look the same
            if k:  # entries at the threshold, counted by brute force; they cover the room
                assert int((np.abs(flat[i]).view(uint) == t[i]).sum()) == at[i] >= room[i]
        # trim_at breaks ties in flat order; _ties_apply skips that pass when every tie fits
        flat_ties = bool(np.any(at > room))
        assert flat_ties == (0 < k < flat[0].size)  # integer data: ties at every inner k
        for apply_flat in {flat_ties, True}:
            r1, r2 = room.copy(), room.copy()
            kept, start = [[], []], 0
            for x, size in zip(units_np, sizes, strict=True):
                tr, used = jax.jit(nu.methods.trim_at)(
                    jnp.asarray(x),
                    jnp.asarray(t),
                    jnp.asarray(np.minimum(r1, 2**31 - 1), jnp.int32),
                )
                r1 = r1 - np.asarray(used)
                tr = np.moveaxis(np.asarray(tr), 1, 0)
                for i in range(2):
                    kept[i].append(tr[i].ravel() != 0)
                xm, used = merge_mod._ties_apply(
                    jnp.asarray(x),
                    jnp.asarray(t),
                    jnp.asarray(np.minimum(r2, 2**31 - 1), jnp.int32),
                    jnp.asarray(0.5, dtype),
                    flat_ties=apply_flat,
                )
                r2 = r2 - np.asarray(used)
                mask = np.stack([w[start : start + size].reshape(x[:, 0].shape) for w in want], 1)
                np.testing.assert_allclose(
                    np.asarray(xm), 0.5 * _disjoint_mean_np(np.where(mask, x, 0)), err_msg=f"k={k}"
                )
                start += size
            for i in range(2):
                got = np.concatenate(kept[i])
                np.testing.assert_array_equal(got, want[i], err_msg=f"k={k} task={i}")


# ----------------------------------------------------------------- buckets merged piece by piece


def test_split_bucket_sizes_divide_and_fit():
    _names, buckets, _m_tasks = nu._tree.collect(_adapters(0, True), fn="t")
    for bk in buckets:
        n = len(bk.names)
        per = M * bk.r_max * (bk.d_in + bk.d_out) * 8
        for cap in (1, per, 2 * per, 10**9):
            pieces = nu._tree.split_bucket(bk, cap, 8)
            assert [nm for p in pieces for nm in p.names] == list(bk.names)
            assert len({len(p.names) for p in pieces}) == 1  # one compiled shape
            assert n % len(pieces[0].names) == 0
            assert len(pieces[0].names) * per <= max(cap, per)


@pytest.mark.parametrize(
    ("method", "space", "opts"),
    [
        ("ta", "core", {}),
        ("tsv", "knots", {}),
        ("iso_cts", "full", {}),
        ("ties", "knots", {"density": 0.3}),
        ("ties", "core", {"density": 0.3, "scope": "model"}),
        ("dare", "core", {"p": 0.3}),
    ],
)
def test_pieces_give_the_same_merge(monkeypatch, method, space, opts):
    """Per-bucket kernels are free of global state: one module per piece changes nothing."""
    ads = _adapters(2)
    masks = _masks(ads, 4)
    key = jax.random.key(3)
    whole = nu.merge(ads, masks, method=method, space=space, key=key, **opts)
    monkeypatch.setattr(merge_mod, "_PIECE_BYTES", 1)
    pieces = nu.merge(ads, masks, method=method, space=space, key=key, **opts)
    for n in ads[0]:
        np.testing.assert_allclose(ref.dense(pieces[n]), ref.dense(whole[n]), atol=1e-10)


@pytest.mark.parametrize(
    ("method", "space", "opts"),
    [
        ("ties", "knots", {"density": 0.3}),
        ("ties", "core", {"density": 0.3}),
        ("dare_ties", "knots", {"p": 0.3}),
    ],
)
def test_elementwise_chunks_give_the_same_merge(monkeypatch, method, space, opts):
    """The dense work of a bucket runs a chunk of modules per call: one module per chunk (as for
    large modules) gives the same merge as the whole bucket in one call."""
    ads = _adapters(6)
    masks = _masks(ads, 5)
    key = jax.random.key(4)
    whole = nu.merge(ads, masks, method=method, space=space, key=key, **opts)
    calls = []
    monkeypatch.setattr(merge_mod, "_chunk", lambda *a, **k: calls.append(a) or 1)
    chunked = nu.merge(ads, masks, method=method, space=space, key=key, **opts)
    assert calls
    for n in ads[0]:
        np.testing.assert_allclose(ref.dense(chunked[n]), ref.dense(whole[n]), atol=1e-10)


def test_float32_merge_of_tasks_sharing_their_a_init():
    """Tasks trained from one A initialisation (A_i = A_0 + 1e-3 d_i), float32, modules larger
    than the Householder cut: TA keeps float32 accuracy (the reduction switches to Householder)."""
    from netutility_jax import _linalg

    rng = np.random.default_rng(7)
    d_in, d_out, r = _linalg._SMALL + 88, _linalg._SMALL + 40, 4
    a0 = rng.normal(size=(d_in, r)) / np.sqrt(d_in)
    ads = [
        {
            "m": {
                "lora_a": (a0 + 1e-3 * rng.normal(size=(d_in, r)) / np.sqrt(d_in)).astype(
                    np.float32
                ),
                "lora_b": (0.01 * rng.normal(size=(r, d_out))).astype(np.float32),
            }
        }
        for _ in range(3)
    ]
    want = sum(ad["m"]["lora_a"].astype(np.float64) @ ad["m"]["lora_b"] for ad in ads)
    with jax.enable_x64(False):
        for space in ("full", "core", "knots"):
            out = nu.merge(ads, method="ta", space=space)["m"]
            got = ref.dense(out)
            assert np.asarray(out["lora_a"]).dtype == np.float32
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5, space
