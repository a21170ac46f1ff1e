"""Merges inside jax.jit, jax.grad and jax.vmap (netutility_jax/engine/traced.py).

Every merged update is compared with the projection written out in float64 numpy (each task's
dense update, its SVD, the kept singular directions summed), and with the in-memory merge; the
gradients with their closed forms; retracing is guarded by ``chex.assert_max_traces``.
"""

from __future__ import annotations

import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import InputError, InputTypeError

M = 3


def _adapters(seed=0, scale=2.0):
    """Two layers of q (rank 4, 32 -> 16) and v (ragged ranks 4/3/4, 32 -> 8)."""
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
                    "scale": scale,
                },
                "v": {
                    "lora_a": rng.normal(size=(32, rv)).astype(np.float32),
                    "lora_b": rng.normal(size=(rv, 8)).astype(np.float32),
                },
            }
        out.append(ad)
    return out


NAMES = [("l0", "q"), ("l0", "v"), ("l1", "q"), ("l1", "v")]


def _kept_dense(mod, mask_row):
    """float64: the part of ``s a b`` on the singular directions ``mask_row`` keeps."""
    a = np.asarray(mod["lora_a"], np.float64)
    b = np.asarray(mod["lora_b"], np.float64)
    dk = float(mod.get("scale", 1.0)) * a @ b
    u, s, vt = np.linalg.svd(dk, full_matrices=False)
    keep = np.zeros(s.shape, bool)
    r = a.shape[1]
    keep[:r] = np.asarray(mask_row)[:r]
    return (u[:, keep] * s[keep]) @ vt[keep]


def _reference(ads, masks, coef=1.0, weights=None):
    w = np.ones(M) if weights is None else np.asarray(weights, np.float64)
    out = {}
    for layer, kind in NAMES:
        name = f"{layer}/{kind}"
        out[name] = coef * sum(
            w[i] * _kept_dense(ads[i][layer][kind], np.asarray(masks[name][i])) for i in range(M)
        )
    return out


def _close(got_module, want, tol=1e-4):
    got = np.asarray(nu.module_update(got_module), np.float64)
    assert got.shape == want.shape
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < tol, err


@pytest.mark.parametrize("space", ["full", "core", "knots"])
def test_jitted_ta_is_the_float64_projection_on_the_kept_directions(space):
    ads = _adapters()
    masks = nu.allocate(nu.score(ads), 2)
    out = jax.jit(lambda a, m: nu.merge(a, m, method="ta", space=space, coef=0.7))(ads, masks)
    want = _reference(ads, masks, coef=0.7)
    for layer, kind in NAMES:
        mod = out[layer][kind]
        r_max = 4
        assert mod["lora_a"].shape == (32, M * r_max)  # the padded rank, static
        assert mod["lora_b"].shape[0] == M * r_max
        _close(mod, want[f"{layer}/{kind}"])


def test_jitted_ta_equals_the_in_memory_merge_and_keeps_every_direction_without_masks():
    ads = _adapters(1)
    masks = nu.allocate(nu.score(ads), 3)
    eager = nu.merge(ads, masks, method="ta")
    jitted = jax.jit(lambda a, m: nu.merge(a, m))(ads, masks)
    every = jax.jit(lambda a: nu.merge(a))(ads)
    for layer, kind in NAMES:
        want = np.asarray(nu.module_update(eager[layer][kind]), np.float64)
        _close(jitted[layer][kind], want)
        full = sum(
            float(ad[layer][kind].get("scale", 1.0))
            * np.asarray(ad[layer][kind]["lora_a"], np.float64)
            @ np.asarray(ad[layer][kind]["lora_b"], np.float64)
            for ad in ads
        )
        _close(every[layer][kind], full)


def test_an_extreme_scale_is_merged_exactly():
    ads = _adapters(2, scale=1e20)
    masks = nu.allocate(nu.score(ads), 2)
    out = jax.jit(lambda a, m: nu.merge(a, m, coef=1e-18))(ads, masks)
    want = _reference(ads, masks, coef=1e-18)
    for layer, kind in NAMES:
        _close(out[layer][kind], want[f"{layer}/{kind}"])


def test_gradients_of_coef_and_task_weights_are_their_closed_forms():
    ads = _adapters(3)
    masks = nu.allocate(nu.score(ads), 2)
    rng = np.random.default_rng(7)
    targets = {f"{ly}/{k}": rng.normal(size=(32, 16 if k == "q" else 8)) for ly, k in NAMES}

    def loss(coef, w):
        out = nu.merge([_weighted(ad, w[i]) for i, ad in enumerate(ads)], masks, coef=coef)
        return sum(jnp.sum(nu.module_update(out[ly][k]) * targets[f"{ly}/{k}"]) for ly, k in NAMES)

    w0 = jnp.array([1.0, 0.5, 2.0])
    g_coef, g_w = jax.grad(loss, argnums=(0, 1))(1.5, w0)
    per_task = [
        sum(
            np.sum(
                _kept_dense(ads[i][ly][k], np.asarray(masks[f"{ly}/{k}"][i])) * targets[f"{ly}/{k}"]
            )
            for ly, k in NAMES
        )
        for i in range(M)
    ]
    want_coef = float(np.dot(np.asarray(w0), per_task))
    np.testing.assert_allclose(float(g_coef), want_coef, rtol=1e-4)
    want_w = 1.5 * np.asarray(per_task)  # (float32 sums: to 1e-4 of the largest entry)
    np.testing.assert_allclose(np.asarray(g_w), want_w, rtol=0, atol=1e-4 * np.abs(want_w).max())


def _weighted(ad, w):
    return jax.tree.map(lambda x: x, {
        layer: {
            kind: {**mod, "scale": mod.get("scale", 1.0) * w} for kind, mod in mods.items()
        }
        for layer, mods in ad.items()
    })  # fmt: skip


@pytest.mark.parametrize("allocation", ["net_utility", "uniform", "all"])
def test_merge_adapters_under_jit_gives_the_in_memory_merge_and_report(allocation):
    ads = _adapters(4)
    budget = None if allocation == "all" else 2
    weights = [1.0, 0.5, 2.0]
    run = jax.jit(
        lambda a, w: nu.merge_adapters(a, budget=budget, allocation=allocation, weights=w)
    )
    out, rep = run(ads, jnp.asarray(weights))
    want, wrep = nu.merge_adapters(ads, budget=budget, allocation=allocation, weights=weights)
    for layer, kind in NAMES:
        _close(out[layer][kind], np.asarray(nu.module_update(want[layer][kind]), np.float64))
    for name in wrep.kept:
        np.testing.assert_array_equal(np.asarray(rep.masks[name]), np.asarray(wrep.masks[name]))
        np.testing.assert_array_equal(np.asarray(rep.kept[name]), wrep.kept[name])
    np.testing.assert_array_equal(np.asarray(rep.kept_per_task), wrep.kept_per_task)
    assert float(rep.budget_spent) == pytest.approx(wrep.budget_spent)
    assert float(rep.non_prefix_fraction) == pytest.approx(wrep.non_prefix_fraction)
    assert float(rep.heterogeneity) == pytest.approx(wrep.heterogeneity, rel=1e-5)
    if allocation == "net_utility":
        assert float(rep.lam) == pytest.approx(wrep.lam, rel=1e-5)
    assert (rep.method, rep.allocation, rep.scope) == (wrep.method, wrep.allocation, wrep.scope)
    assert rep.ranks == {"l0/q": 12, "l0/v": 12, "l1/q": 12, "l1/v": 12}


def test_a_second_call_with_the_same_shapes_is_not_traced_again():
    ads = _adapters(5)
    masks = nu.allocate(nu.score(ads), 2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(a, m, c):
        return nu.merge(a, m, coef=c)

    step(ads, masks, 1.0)
    other = jax.tree.map(lambda x: x * 2 if hasattr(x, "shape") else x, ads)
    step(other, masks, 0.5)  # new values, same shapes: no second trace (chex raises if so)
    chex.clear_trace_counter()


def test_vmap_over_coefficients_is_each_merge():
    ads = _adapters(6)
    masks = nu.allocate(nu.score(ads), 2)
    coefs = jnp.array([0.5, 1.0, 2.0])
    outs = jax.vmap(lambda c: nu.merge(ads, masks, coef=c))(coefs)
    want = _reference(ads, masks)
    for i, c in enumerate(np.asarray(coefs)):
        mod = jax.tree.map(lambda x, i=i: x[i], outs["l0"]["q"])
        _close(mod, float(c) * want["l0/q"])


def test_a_task_lacking_a_module_contributes_nothing_there():
    ads = _adapters(8)
    ads[2]["l1"]["v"] = None
    out = jax.jit(lambda a: nu.merge(a))(ads)
    want = sum(
        np.asarray(ad["l1"]["v"]["lora_a"], np.float64) @ np.asarray(ad["l1"]["v"]["lora_b"])
        for ad in ads[:2]
    )
    _close(out["l1"]["v"], want)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "ties"}, r"nu\.merge: method='ties' in full space .*cannot run inside jax\.jit"),
        ({"method": "dare", "p": 0.5, "key": jax.random.key(0)}, r"method='dare' in full space"),
        ({"method": "ta", "isotropize": True}, "isotropize=True cannot run inside"),
        ({"method": "tsv", "isotropize": True}, "isotropize=True cannot run inside"),
    ],
)
def test_what_cannot_be_traced_is_refused_with_the_way_out(kwargs, match):
    ads = _adapters(9)
    with pytest.raises(InputTypeError, match=match):
        jax.jit(lambda a: nu.merge(a, **kwargs))(ads)


def test_merge_adapters_refuses_min_share_and_a_mesh_under_a_trace():
    ads = _adapters(10)
    with pytest.raises(InputTypeError, match=r"min_share cannot run inside jax\.jit"):
        jax.jit(lambda a: nu.merge_adapters(a, budget=2, min_share=0.5))(ads)
    mesh = nu.module_mesh()
    with pytest.raises(InputError, match=r"mesh= stacks the factors on the host"):
        jax.jit(lambda a: nu.merge_adapters(a, budget=2, mesh=mesh))(ads)
    with pytest.raises(InputError, match=r"for 3 tasks"):
        jax.jit(lambda a, w: nu.merge_adapters(a, budget=2, weights=w))(ads, jnp.ones(2))


def test_masks_of_the_wrong_shape_are_refused_under_a_trace():
    ads = _adapters(11)
    masks = nu.allocate(nu.score(ads), 2)
    masks["l0/q"] = masks["l0/q"][:, :3]
    with pytest.raises(InputError, match=r"mask of module 'l0/q' has shape \(3, 3\)"):
        jax.jit(lambda a, m: nu.merge(a, m))(ads, masks)


def test_the_gradient_step_in_the_python_docs_runs():
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md").read_text()
    section = doc.split("## Composing with jit, vmap and grad", 1)[1]
    (code,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    # (a user's default promotion: optax's adam mixes a Python float and an int32 step count)
    with jax.numpy_dtype_promotion("standard"):
        exec(compile(code, "docs/python.md", "exec"), {})  # its own assert checks the loss fell


# ------------------------------------------------------------------ TA as one program, eagerly


def _mk(rng, r, scale=1.0, d_in=8, d_out=6):
    return {
        "lora_a": rng.normal(size=(d_in, r)).astype(np.float32),
        "lora_b": rng.normal(size=(r, d_out)).astype(np.float32),
        "scale": scale,
    }


def test_eager_ta_keeps_rank_zero_modules_and_counts_kept_directions():
    rng = np.random.default_rng(12)
    ads = [{"q": _mk(rng, 2), "z": _mk(rng, 0)} for _ in range(M)]
    out = nu.merge(ads)
    assert out["z"]["lora_a"].shape == (8, 0) and out["z"]["lora_b"].shape == (0, 6)
    assert out["q"]["lora_a"].shape == (8, 2 * M)  # every candidate, one column each
    want = sum(
        ad["q"]["scale"] * ad["q"]["lora_a"].astype(np.float64) @ ad["q"]["lora_b"] for ad in ads
    )
    _close(out["q"], want)
    _, rep = nu.merge_adapters(ads, budget=2)
    assert rep.ranks["z"] == 0 and rep.ranks["q"] == int(np.asarray(rep.kept["q"]).sum())


def test_eager_ta_leaves_what_it_cannot_hold_exactly_to_the_bucket_pipeline():
    rng = np.random.default_rng(13)
    # scale x coef below float32's normal range: the pipeline refuses it, never zeros
    tiny = [{"q": _mk(rng, 2, 1e-30)} for _ in range(M)]
    with pytest.raises(InputError, match=r"nu\.merge: the merged update of module 'q' underflows"):
        nu.merge(tiny, coef=1e-10)
    # a NaN factor: the pipeline's message names the module and the task
    bad = [{"q": _mk(rng, 2)} for _ in range(M)]
    bad[1]["q"]["lora_a"][0, 0] = np.nan
    with pytest.raises(InputError, match=r"module 'q', task 1 .*lora_a has 1 non-finite entry"):
        nu.merge(bad)
    # a coefficient outside float32's normal range is split by the pipeline: exact, not zero
    ads = [{"q": _mk(rng, 2, 1e10)} for _ in range(M)]
    out = nu.merge(ads, coef=1e-39)
    want = 1e-29 * sum(ad["q"]["lora_a"].astype(np.float64) @ ad["q"]["lora_b"] for ad in ads)
    got = np.asarray(out["q"]["lora_a"], np.float64) @ np.asarray(out["q"]["lora_b"], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
