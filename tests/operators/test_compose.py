"""Every row of docs/python.md's table "Composing with jit, vmap and grad", tried.

Each transformation is applied as the table says, and its result compared with the plain call
(``jit``), with the plain call per batch element (``vmap``), or with a central finite difference
in float64 (``grad``); the rows the table refuses raise the error it names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import InputTypeError
from netutility_jax.operators import _plan, _stages

M = 3


def _adapters(seed=0, layers=2):
    rng = np.random.default_rng(seed)
    return [
        {
            f"l{i}": {
                "lora_a": rng.normal(size=(16, 3)).astype(np.float32),
                "lora_b": rng.normal(size=(3, 8)).astype(np.float32),
                "scale": 1.0 + t,
            }
            for i in range(layers)
        }
        for t in range(M)
    ]


def _scaled(ads, c):
    """The adapters with every scale times ``c`` (traced or not)."""
    return [{k: {**m, "scale": m["scale"] * c} for k, m in ad.items()} for ad in ads]


def _loss(tree):
    return sum(jnp.sum(jnp.asarray(x) ** 2) for x in jax.tree.leaves(tree))


def _check_grad(f, x0, rtol=2e-3):
    """``jax.grad(f)(x0)`` against a central difference of ``f`` (x64 off: float32 math)."""
    g = float(jax.grad(f)(x0))
    h = 1e-2 * abs(x0)
    fd = (float(f(x0 + h)) - float(f(x0 - h))) / (2 * h)
    assert g == pytest.approx(fd, rel=rtol), (g, fd)


def _same(x, y, rtol=2e-5):
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-5)


def test_lora_svd_composes_with_jit_vmap_and_grad():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(4, 16, 3)).astype(np.float32)
    b = rng.normal(size=(4, 3, 8)).astype(np.float32)
    _same(jax.jit(nu.lora_svd)(a, b), nu.lora_svd(a, b))
    _same(jax.vmap(nu.lora_svd)(a, b), nu.lora_svd(a, b))
    _check_grad(lambda c: jnp.sum(nu.lora_svd(a[0], b[0], c).s), 1.5)


def test_score_heterogeneity_and_energies_compose_with_jit_vmap_and_grad():
    ads = _adapters()
    plain = nu.score(ads)
    _same(jax.jit(nu.score)(ads).modules, plain.modules)
    h = jax.jit(nu.heterogeneity)(ads)
    assert float(h) == pytest.approx(float(nu.heterogeneity(ads)), rel=1e-5)
    e = jax.jit(nu.task_energies)(ads)
    np.testing.assert_allclose(np.asarray(e), np.asarray(nu.task_energies(ads)), rtol=1e-5)
    cs = jnp.array([0.5, 2.0])
    lam = jax.vmap(lambda c: nu.score(_scaled(ads, c)).lam)(cs)
    for c, got in zip(np.asarray(cs), np.asarray(lam), strict=True):
        assert float(got) == pytest.approx(float(nu.score(_scaled(ads, float(c))).lam), rel=1e-4)
    # (sigma scales with c; utilities do not: benefit and interference are scale-free)
    _check_grad(lambda c: nu.score(_scaled(ads, c), lam=0.5).modules["l0"].sigma.sum(), 1.5)
    _check_grad(lambda c: jnp.sum(nu.task_energies(_scaled(ads, c))), 1.5)


def test_allocate_composes_with_jit_and_vmap():
    ads = _adapters(2)
    sc = nu.score(ads)
    want = nu.allocate(sc, 2)
    got = jax.jit(lambda s: nu.allocate(s, 2))(sc)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    cs = jnp.array([1.0, 3.0])
    batched = jax.vmap(lambda c: nu.allocate(nu.score(_scaled(ads, c)), 2))(cs)
    for i, c in enumerate(np.asarray(cs)):
        one = nu.allocate(nu.score(_scaled(ads, float(c))), 2)
        for k in one:
            np.testing.assert_array_equal(np.asarray(batched[k][i]), np.asarray(one[k]))


def test_ta_merges_compose_with_jit_vmap_and_grad():
    ads = _adapters(3)
    masks = nu.allocate(nu.score(ads), 2)
    upd = lambda out: {k: nu.module_update(m) for k, m in out.items()}
    want = upd(nu.merge(ads, masks, space="core"))
    _same(upd(jax.jit(lambda a: nu.merge(a, masks, space="core"))(ads)), want, rtol=1e-4)
    cs = jnp.array([0.5, 2.0])
    batched = jax.vmap(lambda c: upd(nu.merge(ads, masks, coef=c)))(cs)
    for i, c in enumerate(np.asarray(cs)):
        scaled = jax.tree.map(lambda x, c=c: c * x, want)
        _same(jax.tree.map(lambda x, i=i: x[i], batched), scaled, 1e-4)
    _check_grad(lambda c: _loss(upd(nu.merge(ads, masks, coef=c))), 1.5)
    w0 = jnp.ones(M)
    full = lambda w: _loss(upd(nu.merge_adapters(ads, budget=2, weights=w)[0]))
    g = jax.grad(full)(w0)
    for i in range(M):
        e = np.zeros(M)
        e[i] = 1e-2
        fd = (float(full(w0 + e)) - float(full(w0 - e))) / 2e-2
        assert float(g[i]) == pytest.approx(fd, rel=2e-3)
    vm = jax.vmap(lambda w: upd(nu.merge_adapters(ads, budget=2, weights=w)[0]))
    ws = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.5, 2.0]])
    out = vm(ws)
    for i in range(2):
        one = upd(nu.merge_adapters(ads, budget=2, weights=list(np.asarray(ws[i])))[0])
        _same(jax.tree.map(lambda x, i=i: x[i], out), one, rtol=1e-4)


_SLOW = pytest.mark.slow  # (the default tier keeps one merge per kind: SVD, TIES, DARE)
_OTHERS = [
    ("tsv", "core", {}),
    pytest.param("iso_c", "full", {}, marks=_SLOW),
    pytest.param("iso_cts", "knots", {}, marks=_SLOW),
    pytest.param("ties", "core", {"density": 0.5}, marks=_SLOW),
    ("ties", "knots", {"density": 0.5}),
    ("dare", "core", {"p": 0.3}),
    pytest.param("dare_ties", "knots", {"p": 0.3}, marks=_SLOW),
]


@pytest.mark.parametrize(("method", "space", "opts"), _OTHERS, ids=lambda x: str(x))
def test_other_merges_compose_with_jit_vmap_and_grad(method, space, opts):
    """The bucket pipeline's stages traced as one program: under ``jit`` the same updates as
    the plain call (``merge`` and ``merge_adapters``); ``vmap`` over ``coef`` the plain call per
    element; ``grad`` to ``coef`` a central finite difference (Core-space TIES and DARE return
    ``basis @ coordinates`` under a trace: no SVD of a rank-deficient matrix on the way)."""
    ads = _adapters(5)
    masks = nu.allocate(nu.score(ads), 2)
    key = jax.random.key(4) if method.startswith("dare") else None
    kw = dict(method=method, space=space, key=key, **opts)
    upd = lambda out: {k: nu.module_update(m) for k, m in out.items()}
    want = upd(nu.merge(ads, masks, **kw))
    _same(upd(jax.jit(lambda a: nu.merge(a, masks, **kw))(ads)), want, rtol=1e-4)
    cs = jnp.array([0.5, 2.0])
    batched = jax.vmap(lambda c: upd(nu.merge(ads, masks, coef=c, **kw)))(cs)
    for i, c in enumerate(np.asarray(cs)):
        one = upd(nu.merge(ads, masks, coef=float(c), **kw))
        _same(jax.tree.map(lambda x, i=i: x[i], batched), one, 1e-4)
    _check_grad(lambda c: _loss(upd(nu.merge(ads, masks, coef=c, **kw))), 1.5)
    w = [1.0, 0.8, 1.2]
    plain = upd(nu.merge_adapters(ads, budget=2, weights=w, **kw)[0])
    jitted = jax.jit(lambda a, w: nu.merge_adapters(a, budget=2, weights=w, **kw)[0])
    _same(upd(jitted(ads, jnp.asarray(w))), plain, rtol=1e-4)


@pytest.mark.slow  # (three transformed merges compiled twice: about 15 s)
def test_mapped_chunks_compose_with_jit_vmap_and_grad(monkeypatch):
    """A bucket whose dense work is cut into more chunks than a program writes out one after
    another (``_stages.UNROLL_CHUNKS``) goes through one ``lax.map``: under ``jit``, ``vmap``
    over ``coef`` and ``grad`` to it, the same as the bucket in one chunk (DARE-TIES in KnOTS:
    each module's key and its top entries)."""
    ads = _adapters(6, layers=_stages.UNROLL_CHUNKS + 2)
    masks = nu.allocate(nu.score(ads), 2)
    kw = dict(method="dare_ties", space="knots", key=jax.random.key(4), p=0.3)
    upd = lambda out: {k: nu.module_update(m) for k, m in out.items()}
    f = lambda c: upd(nu.merge(ads, masks, coef=c, **kw))

    def calls():
        return (
            jax.jit(f)(1.0),
            jax.vmap(f)(jnp.array([0.5, 2.0])),
            jax.grad(lambda c: _loss(f(c)))(1.5),
        )

    whole = calls()
    monkeypatch.setattr(_plan, "chunk_size", lambda *a, **k: 1)
    mapped = []
    run = _stages._mapped_elementwise
    monkeypatch.setattr(
        _stages, "_mapped_elementwise", lambda *a, **k: mapped.append(1) or run(*a, **k)
    )
    jax.clear_caches()
    _same(calls(), whole, rtol=1e-5)
    assert mapped  # (the mapped route was the one traced)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda a: nu.merge(a, method="ties"), "method='ties' in full space .*cannot run inside"),
        (
            lambda a: nu.merge_adapters(
                a, budget=2, method="ties", space="core", trim_scope="model"
            ),
            "trim_scope='model' .*cannot run inside",
        ),
        (lambda a: nu.merge_adapters(a, budget=2, min_share=0.5), "min_share cannot run"),
        (lambda a: nu.merge(a, isotropize=True), "isotropize=True cannot run"),
    ],
)
def test_what_the_table_refuses_is_refused(call, match):
    with pytest.raises(InputTypeError, match=match):
        jax.jit(call)(_adapters(4))
