"""nu.merge / nu.merge_adapters / nu.fold / nu.to_lora against dense float64 references."""

from __future__ import annotations

import _merge_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _merge_cases import CALL, REF_METHODS, SHAPES, SPEC, M
from _merge_cases import adapters as _adapters
from _merge_cases import check as _check
from _merge_cases import kept as _kept
from _merge_cases import masks as _masks
from _merge_cases import peft_prune as _peft_prune
from _merge_cases import qr_route as _qr_route
from _merge_cases import ref_in_space as _ref_in_space

import netutility_jax as nu


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


# the CholeskyQR2 route runs the whole product in the slow tier (tests/core/test_linalg.py checks
# the route itself in the default one)
@pytest.fixture(
    scope="module", params=["householder", pytest.param("cholesky", marks=pytest.mark.slow)]
)
def qr_route(request):
    """The QR route of netutility_jax._core.linalg: Householder (at most _SMALL rows, as every module
    in these small tests) or CholeskyQR2 (larger modules), forced by setting _SMALL to 0
    (_merge_cases.qr_route). Module-scoped: pytest groups the tests by route."""
    with _qr_route(request.param):
        yield request.param


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


# in the slow tier (which CI runs) to keep the default tier near 8 minutes: 11 s
@pytest.mark.slow
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


@pytest.mark.parametrize(
    "space",
    # core 6 s, knots 12 s: in the slow tier, which CI runs
    [
        "full",
        pytest.param("core", marks=pytest.mark.slow),
        pytest.param("knots", marks=pytest.mark.slow),
    ],
)
def test_ties_single_task_density_one_returns_task(space):
    ads = _adapters(4)[:1]
    out = nu.merge(ads, method="ties", space=space, density=1.0, coef=1.0)
    for n in ads[0]:
        np.testing.assert_allclose(ref.dense(out[n]), ref.dense(ads[0][n], SHAPES[n]), atol=1e-9)


@pytest.mark.parametrize(
    "space",
    ["full", pytest.param("core", marks=pytest.mark.slow), "knots"],  # core: 15-30 s
)
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
    with pytest.raises(
        ValueError, match=r"nu.merge: method='foo' \(str\); expected one of \('ta', 'ties'"
    ):
        nu.merge(ads, method="foo")
    with pytest.raises(
        ValueError,
        match=r"nu.merge: space='bar' \(str\); expected one of \('full', 'core', 'knots'\)",
    ):
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
    with pytest.raises(
        ValueError, match=r"nu.merge: density=1.5 \(float\); expected a number in \[0, 1\]"
    ):
        nu.merge(ads, method="ties", density=1.5)
    with pytest.raises(
        ValueError, match=r"nu.merge: p=1.0 \(float\); expected a number in \[0, 1\)"
    ):
        nu.merge(ads, method="dare", p=1.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"nu.merge: p=-0.1 \(float\)"):
        nu.merge(ads, method="dare", p=-0.1, key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"method='dare' draws its drop mask from key=, a jax.random key: pass jax.random.key\(0\)",
    ):
        nu.merge(ads, method="dare", p=0.5)
    with pytest.raises(ValueError, match=r"method='dare_ties' needs p="):
        nu.merge(ads, method="dare_ties", key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"nu.merge: coef=nan \(float\); expected a finite real number"
    ):
        nu.merge(ads, coef=float("nan"))
    with pytest.raises(ValueError, match=r"nu.merge: coef=inf \(float\)"):
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
    with pytest.raises(
        ValueError,
        match=r"nu.merge: variant='x' \(str\); expected one of \('core_space', 'original'\)",
    ):
        nu.merge(ads, space="knots", variant="x")
    with pytest.raises(ValueError, match=r"does not take 'variant'"):
        nu.merge(ads, space="core", variant="original")
    with pytest.raises(
        ValueError, match=r"nu.merge: scope='layer' \(str\); expected one of \('module', 'model'\)"
    ):
        nu.merge(ads, method="ties", scope="layer")
    with pytest.raises(
        ValueError, match=r"nu.merge_adapters: allocation='topk' \(str\); expected one of"
    ):
        nu.merge_adapters(ads, budget=4, allocation="topk")
    with pytest.raises(
        ValueError, match=r"nu.merge_adapters: budget=0 \(int\); expected a positive integer"
    ):
        nu.merge_adapters(ads, budget=0)
    with pytest.raises(ValueError, match=r"nu.to_lora: rank=-1 \(int\); expected an integer >= 0"):
        nu.to_lora({"delta": np.ones((3, 3))}, -1)


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
    out = nu.merge(
        ads, masks, method="ties", space=space, trim_scope="model", density=0.3, coef=0.7
    )
    for n, w, bk in zip(names, want, back, strict=True):
        np.testing.assert_allclose(ref.dense(out[n]), bk(w), atol=1e-9, err_msg=n)
    # and it differs from the per-module top-k (the scopes are not the same operator)
    per_mod = nu.merge(ads, masks, method="ties", space=space, density=0.3, coef=0.7)
    assert any(not np.allclose(ref.dense(out[n]), ref.dense(per_mod[n]), atol=1e-6) for n in names)


@pytest.mark.parametrize("space", ["full", "core", "knots"])
def test_ties_model_scope_one_module_equals_module_scope(space):
    ads = [{"q": ad["layers/0/q"]} for ad in _adapters(3)]
    a = nu.merge(ads, method="ties", space=space, trim_scope="model", density=0.4)
    b = nu.merge(ads, method="ties", space=space, trim_scope="module", density=0.4)
    np.testing.assert_allclose(ref.dense(a["q"]), ref.dense(b["q"]), atol=1e-10)


def test_ties_model_scope_density_edges():
    ads = _adapters(4, True)
    zero = nu.merge(ads, method="ties", trim_scope="model", density=0.0)
    assert all(not np.any(ref.dense(m)) for m in zero.values())
    full = nu.merge(ads, method="ties", trim_scope="model", density=1.0)
    mod = nu.merge(ads, method="ties", trim_scope="module", density=1.0)
    for n in ads[0]:
        np.testing.assert_allclose(ref.dense(full[n]), ref.dense(mod[n]), atol=1e-12)


def test_float32_merge_of_tasks_sharing_their_a_init():
    """Tasks trained from one A initialisation (A_i = A_0 + 1e-3 d_i), float32, modules larger
    than the Householder cut: TA keeps float32 accuracy (the reduction switches to Householder)."""
    from netutility_jax._core import linalg as _linalg

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


# ----------------------------------------------------------------- TIES's kept count = PEFT's


def _sweep(n, extra=()):
    """Densities 0.01 .. 0.99 (every 0.07), 0.3, and binary64 ulps around k / n (adversarial)."""
    out = [round(0.01 + 0.07 * i, 2) for i in range(15)] + [0.3, *extra]
    for k in (n // 3, (3 * n) // 10):
        for step in (-3, -1, 1):
            d = k / n
            for _ in range(abs(step)):
                d = np.nextafter(d, 0.0 if step < 0 else 1.0)
            out.append(float(d))
    return out


@pytest.mark.parametrize(("d_in", "d_out"), [(96, 25), (25, 96), (30, 31)])
def test_ties_full_space_keeps_peft_count(d_in, d_out):
    """One task, full space: TIES is the magnitude prune itself (sign election and mean of one
    task change nothing), so the result must be PEFT's prune of the dense update, entry for entry,
    for every density of the sweep (96 x 25 at 0.3: 720 entries, not 719)."""
    rng = np.random.default_rng(d_in)
    ad = {"m": {"lora_a": rng.normal(size=(d_in, 3)), "lora_b": rng.normal(size=(3, d_out))}}
    x = ref.dense(ad["m"])
    for density in _sweep(d_in * d_out):
        got = ref.dense(nu.merge([ad], method="ties", density=density)["m"])
        want = _peft_prune(x, density)
        assert (got != 0).sum() == (want != 0).sum() == int(density * x.size), density
        np.testing.assert_allclose(got, want, atol=1e-12, err_msg=str(density))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_ties_traced_knots_count_is_peft_count(dtype):
    """KnOTS, one task of rank r: TIES trims the (d_in, r) block, which the result keeps as its
    lora_a; its nonzero count must be PEFT's count for n = d_in r, for every density, when the
    count is made for a traced stage (float32 compute too: a float32 density or product would
    miss the adversarial densities by one). The density reaches the compiled merge as data:
    the 27 densities of the sweep run one program (they compiled one each, 40-100 s)."""
    from jax._src import monitoring

    compiled = []

    def listen(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiled.append(name)

    d_in, r = 96, 25
    rng = np.random.default_rng(1)
    ad = {
        "m": {
            "lora_a": rng.normal(size=(d_in, r)).astype(dtype),
            "lora_b": rng.normal(size=(r, 30)).astype(dtype),
        }
    }
    n = d_in * r
    for i, density in enumerate(_sweep(n, extra=(0.7, 0.9))):
        out = nu.merge([ad], method="ties", space="knots", density=density)["m"]
        assert out["lora_a"].dtype == dtype
        want = int((_peft_prune(np.arange(1.0, n + 1), density) != 0).sum())
        assert int((np.asarray(out["lora_a"]) != 0).sum()) == want, density
        if i == 0:  # compiled (or loaded); the other densities compile nothing
            monitoring.register_event_duration_secs_listener(listen)
    monitoring.unregister_event_duration_listener(listen)
    assert not compiled, f"{len(compiled)} programs compiled after the first density"


def test_ties_model_scope_keeps_peft_count():
    """trim_scope="model", one task: TIES is PEFT's prune of the task's whole model flattened (module
    order, row-major), for n = the sum of the modules' entries (exact)."""
    ads = [{n: ad[n] for n in ("layers/0/q", "mlp/up")} for ad in _adapters(3, True)][:1]
    x = [ref.dense(ads[0][n]) for n in ads[0]]
    flat = np.concatenate([v.ravel() for v in x])
    for density in _sweep(flat.size):
        out = nu.merge(ads, method="ties", trim_scope="model", density=density)
        got = np.concatenate([ref.dense(out[n]).ravel() for n in ads[0]])
        want = _peft_prune(flat, density)
        assert (got != 0).sum() == (want != 0).sum() == int(density * flat.size), density
        np.testing.assert_allclose(got, want, atol=1e-12, err_msg=str(density))


# ----------------------------------------------------------------- KnOTS: float32 against float64


def _to64(ads):
    return [
        {n: None if m is None else {k: np.asarray(v, np.float64) for k, v in m.items()}
         for n, m in ad.items()}
        for ad in ads
    ]  # fmt: skip


@pytest.mark.parametrize(
    "variant",
    [pytest.param("core_space", marks=pytest.mark.slow), "original"],  # 11 s
)
@pytest.mark.parametrize(
    "method",
    ["ties", pytest.param("dare_ties", marks=pytest.mark.slow)],  # 5-6 s per variant
)
def test_knots_float32_matches_float64_away_from_genuine_near_ties(method, variant):
    """Float32 against float64 TIES / DARE-TIES in KnOTS space, on random inputs.

    The selection rule is deterministic on the numbers it is given (methods.trim_topk: ties in
    flat order; disjoint_mean: sum added in task order, zero elects +), but the float32 KnOTS
    coordinates differ from the float64 ones by their rounding (about 1e-5 of the largest entry
    here, from the basis's SVD). Two entries whose magnitudes differ by less than that, one each
    side of a task's k-th largest, may swap places between the precisions, and an entry whose
    sum over tasks is within that of zero may elect the other sign: each such entry then differs
    by up to its own size, a genuine near-tie that no rule can settle the same way in both
    precisions. So the bound is taken in the float64 reference coordinates (numpy SVD), over the
    entries that are not within DELTA (100 times the float32 rounding) of a threshold or of a
    zero sum; those must agree to float32 accuracy, and they must be nearly all entries.
    """
    delta = 1e-3
    spec = (("m", 64, 40, (4, 3, 5)),)
    key = jax.random.key(5)
    kw = {"density": 0.3} if method == "ties" else {"p": 0.4, "key": key}
    worst, ambiguous, total = 0.0, 0, 0
    for seed in range(4):
        ads = ref.make_adapters(seed, 3, spec, dtype=np.float32)
        out32 = nu.merge(ads, method=method, space="knots", variant=variant, **kw)["m"]
        out64 = nu.merge(_to64(ads), method=method, space="knots", variant=variant, **kw)["m"]
        assert np.asarray(out32["lora_a"]).dtype == np.float32
        xs = ref.kept_updates([ad["m"] for ad in _to64(ads)], 64, 40)
        blocks, back = ref.knots_blocks(xs, variant)
        to_coords = back / (back * back).sum(0)  # dK @ to_coords = X (back's columns orthogonal)
        x32 = ref.dense(out32) @ to_coords
        x64 = ref.dense(out64) @ to_coords
        t = np.stack(blocks)  # (M, d_in, k) reference coordinates
        scale = np.abs(t).max(axis=(1, 2), keepdims=True)
        if method == "ties":
            k = int(0.3 * t[0].size)
            mags = np.abs(t).reshape(len(t), -1)
            thr = -np.sort(-mags, axis=1)[:, k - 1].reshape(-1, 1, 1)
            near = (np.abs(np.abs(t) - thr) <= delta * scale).any(0)
            kept = np.abs(t) >= thr
            want = ref.ties(list(t), 1.0, 0.3)
        else:  # the documented drop mask: bernoulli from key folded with the module index
            q = 3 * 5  # M r_max columns of the library's coordinates, live ones first
            keep = np.asarray(
                jax.random.bernoulli(jax.random.fold_in(key, 0), 1 - np.float32(0.4), (3, 64, q))
            )[..., : t.shape[-1]]
            kept = keep
            near = np.zeros(t.shape[1:], bool)
            want = None
        trimmed = np.where(kept, t, 0) / (1 if method == "ties" else 0.6)
        near |= (np.abs(trimmed.sum(0)) <= delta * scale.max()) & (trimmed != 0).any(0)
        if want is None:
            sign = np.where(trimmed.sum(0) >= 0, 1.0, -1.0)
            agree = (trimmed != 0) & (np.sign(trimmed) == sign)
            want = np.where(agree, trimmed, 0).sum(0) / np.maximum(agree.sum(0), 1)
        # the float64 library result is the reference (no near-tie can matter at 1e-13)
        np.testing.assert_allclose(x64 / scale.max(), want / scale.max(), atol=1e-9)
        worst = max(worst, float(np.abs(x32 - x64)[~near].max() / np.abs(x64).max()))
        ambiguous += int(near.sum())
        total += near.size
    assert worst < 2e-4, worst
    assert ambiguous <= 0.02 * total, (ambiguous, total)


# ----------------------------------------------------------------- extreme but finite scales


EXTREME_CASES = [
    ("ta", "knots", {}),
    ("tsv", "full", {}),
    ("tsv", "knots", {}),
    ("iso_c", "core", {}),
    ("ties", "full", {"density": 0.3}),
    ("ties", "core", {"density": 0.3}),
    ("ties", "knots", {"density": 0.3}),
    ("ties", "knots", {"density": 0.3, "trim_scope": "model"}),
    ("dare_ties", "knots", {"p": 0.3}),
]


@pytest.mark.parametrize("big", [1e30, 1e38])
@pytest.mark.parametrize(("method", "space", "opts"), EXTREME_CASES)
def test_float32_merge_with_one_task_scaled_1e30(method, space, opts, big):
    """One task's LoRA scale is 1e30 (or 1e38, near float32's largest): the Grams of its factors
    and its s**2 would overflow float32, and the other tasks are 2**100 (2**126) below it. The
    float32 merge equals the float64 merge of the same inputs, which equals the dense float64
    reference; never zeros or NaN."""
    ads = [dict(ad) for ad in ref.make_adapters(20, M, SPEC, dtype=np.float32)]
    ads[0] = {n: {**m, "scale": big} for n, m in ads[0].items()}
    kw = {**opts, "key": jax.random.key(0)} if method == "dare_ties" else opts
    out32 = nu.merge(ads, method=method, space=space, **kw)
    out64 = nu.merge(_to64(ads), method=method, space=space, **kw)
    for n in ads[0]:
        got, want = ref.dense(out32[n]), ref.dense(out64[n])
        assert np.all(np.isfinite(got)) and np.abs(want).max() > 0.1 * big
        np.testing.assert_allclose(got / big, want / big, atol=2e-5, err_msg=n)
    if method == "ties" and opts.get("trim_scope") != "model":  # and the float64 one is right
        sp = space if space != "knots" else "knots"
        _check(out64, _ref_in_space(sp, lambda xs: ref.ties(xs, 1.0, 0.3), _to64(ads)), ads, None)


def test_merge_beyond_float32_is_refused_not_returned():
    """Updates whose merge is beyond float32 (three tasks at 3e38: the sum is ~1e39) are an
    InputError naming the modules, never an infinite or zero result; scales outside float32's
    normal range are refused before any work."""
    ads = [
        {n: {**m, "scale": 3e38} for n, m in ad.items() if m is not None}
        for ad in ref.make_adapters(21, M, SPEC[:2], dtype=np.float32)
    ]
    with pytest.raises(
        nu.errors.InputError,
        match=r"nu.merge: the merged update of modules 'layers/0/q', 'layers/0/v' overflows "
        r"float32: its entries reach about 2\*\*1\d\d \(1e\+39\) where float32 holds at most "
        r"3.4e\+38\. .*x64",
    ):
        nu.merge(ads, method="ties", space="full", density=0.5)
    # low-rank results are factors: finite factors of a product beyond float32 are returned
    out = nu.merge(ads, method="ta", space="core")
    for n in out:
        assert all(np.all(np.isfinite(np.asarray(out[n][k]))) for k in ("lora_a", "lora_b"))
        np.testing.assert_allclose(
            ref.dense(out[n]) / 1e39,
            sum(ref.dense(ad[n]) for ad in _to64(ads)) / 1e39,
            atol=1e-5,
        )
    tiny = [{n: {**m, "scale": 1e-44} for n, m in ad.items()} for ad in ads]
    with pytest.raises(
        nu.errors.InputError,
        match=r"scale of module 'layers/0/q', task 0, is 1e-44, outside the range of float32 "
        r"\(normal numbers 1.18e-38 to 3.4e\+38\)",
    ):
        nu.merge(tiny, method="ta")
    with pytest.raises(nu.errors.InputError, match=r"is 1e\+39, outside the range of float32"):
        nu.merge([{n: {**m, "scale": 1e39} for n, m in ad.items()} for ad in ads])


# ----------------------------------------------------------------- options: types and ranges

IE, ITE = nu.errors.InputError, nu.errors.InputTypeError
_KEY = jax.random.key(0)

OPTION_ERRORS = [
    # (function, kwargs, error, message): every message names the option, what was given (repr
    # and type) and the allowed values
    ("merge", {"isotropize": "no"}, ITE, r"nu.merge: isotropize='no' \(str\); expected True or False"),
    ("merge", {"isotropize": 1}, ITE, r"isotropize=1 \(int\); expected True or False"),
    ("merge", {"coef": 1 + 2j}, ITE, r"nu.merge: coef=\(1\+2j\) \(complex\); expected a finite real number"),
    ("merge", {"coef": "1"}, ITE, r"coef='1' \(str\); expected a finite real number"),
    ("merge", {"coef": True}, ITE, r"coef=True \(bool\); expected a finite real number"),
    ("merge", {"coef": np.float32("nan")}, IE, r"coef=np.float32\(nan\) \(float32\); expected a finite real number"),
    ("merge", {"coef": -np.inf}, IE, r"coef=-inf \(float\)"),
    ("merge", {"method": None}, ITE, r"nu.merge: method=None \(NoneType\); expected one of \('ta', 'ties', 'dare'"),
    ("merge", {"method": "TA"}, IE, r"method='TA' \(str\); expected one of"),
    ("merge", {"space": 3}, ITE, r"space=3 \(int\); expected one of \('full', 'core', 'knots'\)"),
    ("merge", {"method": "ties", "density": "0.3"}, ITE, r"density='0.3' \(str\); expected a number in \[0, 1\] \(the fraction of entries each task keeps"),
    ("merge", {"method": "ties", "density": float("nan")}, IE, r"density=nan \(float\); expected a number in \[0, 1\]"),
    ("merge", {"method": "ties", "density": -0.1}, IE, r"density=-0.1 \(float\)"),
    ("merge", {"method": "ties", "density": True}, ITE, r"density=True \(bool\)"),
    ("merge", {"method": "ties", "scope": 1}, ITE, r"scope=1 \(int\); expected one of \('module', 'model'\)"),
    ("merge", {"method": "dare", "p": 1.5, "key": _KEY}, IE, r"p=1.5 \(float\); expected a number in \[0, 1\) \(the drop rate"),
    ("merge", {"method": "dare", "key": _KEY}, IE, r"method='dare' needs p= \(a number in \[0, 1\)"),
    ("merge", {"method": "iso_cts", "common_fraction": 2}, IE, r"common_fraction=2 \(int\); expected a number in \[0, 1\]"),
    ("merge", {"space": "knots", "variant": 1}, ITE, r"variant=1 \(int\); expected one of \('core_space', 'original'\)"),
    ("merge", {"method": "dare", "p": 0.5, "key": 0}, ITE, r"key=0 \(int\); method='dare' draws its drop mask from key=, a jax.random key: pass jax.random.key\(0\)"),
    ("merge", {"method": "dare_ties", "p": 0.5, "key": np.zeros(3, np.uint32)}, ITE, r"key=ndarray of dtype uint32 and shape \(3,\); .*pass jax.random.key\(0\)"),
    ("merge", {"method": "dare", "p": 0.5}, IE, r"method='dare' draws its drop mask from key=, .*pass jax.random.key\(0\)"),
    ("merge_adapters", {"lam": -1}, IE, r"nu.merge_adapters: lam=-1 \(int\); expected a finite number >= 0 \(the interference weight\) or 'auto'"),
    ("merge_adapters", {"lam": "max"}, IE, r"lam='max' \(str\); expected a finite number >= 0"),
    ("merge_adapters", {"lam": float("inf")}, IE, r"lam=inf \(float\)"),
    ("merge_adapters", {"alpha": 1j}, ITE, r"alpha=1j \(complex\); expected a finite number >= 0"),
    ("merge_adapters", {"positive_only": "no"}, ITE, r"positive_only='no' \(str\); expected True or False"),
    ("merge_adapters", {"budget": 2.0}, ITE, r"budget=2.0 \(float\); expected a positive integer R"),
    ("merge_adapters", {"budget": True}, ITE, r"budget=True \(bool\); expected a positive integer"),
    ("merge_adapters", {"budget": -3}, IE, r"budget=-3 \(int\); expected a positive integer"),
    ("merge_adapters", {"allocation": None}, ITE, r"allocation=None \(NoneType\); expected one of \('net_utility', 'uniform', 'all'\)"),
    ("merge_adapters", {"scope": "both"}, IE, r"scope='both' \(str\); expected one of \('global', 'local'\) or None"),
    ("merge_adapters", {"coef": float("nan")}, IE, r"nu.merge_adapters: coef=nan \(float\)"),
    ("merge_adapters", {"method": "dare_ties", "p": 0.2, "key": 7}, ITE, r"nu.merge_adapters: key=7 \(int\); .*pass jax.random.key\(0\)"),
]  # fmt: skip


@pytest.mark.parametrize(("fn", "kw", "err", "msg"), OPTION_ERRORS)
def test_option_errors_name_the_option_value_type_and_allowed_values(fn, kw, err, msg):
    ads = _adapters(0)
    if fn == "merge_adapters":
        kw = {"budget": 2, **kw}
    with pytest.raises(err, match=msg):
        getattr(nu, fn)(ads, **kw)


def test_options_of_the_right_kind_are_accepted():
    """numpy scalars, numpy bools and legacy raw keys are real options; results as for the
    Python values."""
    ads = [{"q": ad["layers/0/q"]} for ad in _adapters(0)]
    a = nu.merge(ads, method="ties", density=np.float32(0.5), coef=np.float64(0.5))["q"]
    b = nu.merge(ads, method="ties", density=float(np.float32(0.5)), coef=0.5)["q"]
    np.testing.assert_array_equal(a["delta"], b["delta"])
    a = nu.merge(ads, method="tsv", isotropize=np.bool_(True))
    b = nu.merge(ads, method="tsv", isotropize=True)
    np.testing.assert_array_equal(ref.dense(a["q"]), ref.dense(b["q"]))
    raw = nu.merge(ads, method="dare", p=0.3, key=jax.random.PRNGKey(1))
    assert np.all(np.isfinite(ref.dense(raw["q"])))
    _, rep = nu.merge_adapters(
        ads, budget=np.int64(3), lam=np.float32(0.5), positive_only=np.bool_(False)
    )
    assert rep.budget == 3 and rep.lam == 0.5


def test_long_module_lists_are_cut_in_messages():
    """An error about many modules names the first few and counts the rest."""
    rng = np.random.default_rng(0)
    ads = [
        {f"model.layers.{i}.self_attn.q_proj": {"lora_a": rng.normal(size=(4, 1)), "lora_b": rng.normal(size=(1, 3))}
         for i in range(40)}
        for _ in range(2)
    ]  # fmt: skip
    with pytest.raises(
        IE, match=r"no mask for modules 'model.layers.0.self_attn.q_proj', .* and 37 more"
    ) as e:
        nu.merge(ads, {})
    assert len(str(e.value)) < 400
    big = [{n: {**m, "scale": 3e38} for n, m in ad.items()} for ad in ads]
    with jax.enable_x64(False):
        f32 = [
            {
                n: {k: np.asarray(v, np.float32) if k != "scale" else v for k, v in m.items()}
                for n, m in ad.items()
            }
            for ad in big
        ]
        with pytest.raises(
            IE,
            match=r"the merged update of modules '.*', '.*', '.*' and \d\d more overflows float32",
        ) as e:
            nu.merge(f32 + f32, method="ties", density=1.0)
    assert len(str(e.value)) < 600


# ----------------------------------------------------------------- fold, to_lora: eager checks


def test_fold_to_lora_module_update_refuse_non_finite_and_overflow():
    lo = {"lora_a": np.ones((4, 2)), "lora_b": np.ones((2, 3)), "scale": 2.0}
    params = {"q": {"kernel": np.zeros((4, 3))}}
    with pytest.raises(IE, match=r"nu.fold: coef=nan \(float\); expected a finite real number"):
        nu.fold(params, {"q": lo}, coef=float("nan"))
    with pytest.raises(ITE, match=r"nu.fold: coef=1j \(complex\)"):
        nu.fold(params, {"q": lo}, coef=1j)
    with pytest.raises(ITE, match=r"nu.fold: kernel=3 \(int\); expected a string"):
        nu.fold(params, {"q": lo}, kernel=3)
    bad = {**lo, "lora_b": np.array([[1.0, np.nan, 0], [0, 0, np.inf]])}
    with pytest.raises(
        IE,
        match=r"nu.fold: module 'q': lora_b \(2, 3\) has 2 non-finite entries \(NaN or inf\) of 6",
    ):
        nu.fold(params, {"q": bad})
    with pytest.raises(
        IE, match=r"nu.fold: module 'q': scale=inf \(float\); expected a finite real number"
    ):
        nu.fold(params, {"q": {**lo, "scale": float("inf")}})
    nan_kernel = np.zeros((4, 3))
    nan_kernel[1, 2] = np.nan
    with pytest.raises(
        IE, match=r"nu.fold: module 'q': base kernel \(4, 3\) has 1 non-finite entry"
    ):
        nu.fold({"q": {"kernel": nan_kernel}}, {"q": lo})
    f16 = {"q": {"kernel": jnp.zeros((4, 3), jnp.float16)}}
    with pytest.raises(
        IE,
        match=r"nu.fold: module 'q': W \+ coef \* dK is not finite in float16 \(\|coef \* dK\| reaches 1e\+05",
    ):
        nu.fold(f16, {"q": {**lo, "scale": 5e4}}, coef=1.0)
    with pytest.raises(
        IE, match=r"nu.to_lora: delta \(3, 3\) has 1 non-finite entry \(NaN or inf\) of 9"
    ):
        nu.to_lora({"delta": np.diag([1.0, np.nan, 2.0])}, 2)
    with pytest.raises(IE, match=r"nu.to_lora: lora_a \(4, 2\) has 8 non-finite entries"):
        nu.to_lora({**lo, "lora_a": np.full((4, 2), np.inf)}, 1)
    with pytest.raises(ITE, match=r"nu.to_lora: rank=1.5 \(float\); expected an integer >= 0"):
        nu.to_lora(lo, 1.5)
    with pytest.raises(ITE, match=r"nu.to_lora: scale='2' \(str\); expected a finite real number"):
        nu.to_lora({**lo, "scale": "2"}, 1)
    with pytest.raises(IE, match=r"nu.module_update: lora_a \(4, 2\) has 1 non-finite entry"):
        nu.module_update({**lo, "lora_a": np.where(np.eye(4, 2, k=1) > 0, np.nan, 1.0)})


def test_module_update_fold_and_to_lora_are_scale_safe():
    """scale 1e38 with factors of 1e-19 (float32): the product is representable though the scale
    times either factor's Gram is not; a scale beyond float32 (1e45) with tiny factors too."""
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(6, 2)), rng.normal(size=(2, 5))
    want = a @ b * 1e38 * 1e-19 * 1e-19
    with jax.enable_x64(False):
        mod = {
            "lora_a": (a * 1e-19).astype(np.float32),
            "lora_b": (b * 1e-19).astype(np.float32),
            "scale": 1e38,
        }
        np.testing.assert_allclose(np.asarray(nu.module_update(mod)), want, rtol=1e-5)
        mod45 = {**mod, "lora_a": (a * 1e-26).astype(np.float32), "scale": 1e45}
        np.testing.assert_allclose(np.asarray(nu.module_update(mod45)), want, rtol=1e-5)
        out = nu.fold({"m": np.zeros((6, 5), np.float32)}, {"m": mod}, coef=0.5)
        np.testing.assert_allclose(np.asarray(out["m"]), 0.5 * want, rtol=1e-5)
        big = np.outer(rng.normal(size=6), rng.normal(size=5)) * 1e37
        low = nu.to_lora({"delta": big.astype(np.float32)}, 1)
        np.testing.assert_allclose(ref.dense(low), big, rtol=1e-5)


@pytest.mark.parametrize(("method", "space"), [("ta", "core"), ("tsv", "full"), ("ties", "knots")])
def test_float32_merge_with_extreme_factors(method, space):
    """Factors of 1e25 and 1e-25 (their product, and every scale, ordinary), modules taller than
    the Householder cut so that the reduction runs on Grams (which 1e25 entries would overflow
    and 1e-25 ones flush to zero in float32): the float32 merge equals the float64 one."""
    from netutility_jax._core import linalg as _linalg

    d_in = _linalg._SMALL + 8
    ads = [
        dict(ad) for ad in ref.make_adapters(22, M, (("m", d_in, 24, (3, 2, 3)),), dtype=np.float32)
    ]
    for i, f in ((0, 1e25), (1, 1e-25)):
        m = ads[i]["m"]
        ads[i] = {"m": {**m, "lora_a": (m["lora_a"] * f).astype(np.float32),
                        "lora_b": (m["lora_b"] / f).astype(np.float32)}}  # fmt: skip
    kw = {"density": 0.3} if method == "ties" else {}
    got = ref.dense(nu.merge(ads, method=method, space=space, **kw)["m"])
    want = ref.dense(nu.merge(_to64(ads), method=method, space=space, **kw)["m"])
    # float32 accuracy (KnOTS coordinates carry about 1e-5 of rounding: see the near-tie test)
    np.testing.assert_allclose(got / np.abs(want).max(), want / np.abs(want).max(), atol=1e-4)
