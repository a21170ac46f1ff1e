"""The operators' merge stages seen from inside: the low-rank paths never form a dense update,
stages compile once per shape, TIES a block of rows at a time (bit for bit the whole-module
kernel; through nu.merge, the dense references of tests/_merge_reference.py), the radix
threshold's exact counts with ties, and TIES's per-shape count table against PEFT's own prune.
"""

from __future__ import annotations

import functools

import _merge_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _merge_cases import REF_METHODS, M
from _merge_cases import adapters as _adapters
from _merge_cases import check as _check
from _merge_cases import masks as _masks
from _merge_cases import peft_prune as _peft_prune
from _merge_cases import ref_in_space as _ref_in_space

import netutility_jax as nu
from netutility_jax import registry
from netutility_jax.operators import _plan, _rows, _select, _stages, _ties_model


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


_SLOW = pytest.mark.slow  # 3-10 s each; the default tier keeps DARE in full and KnOTS space


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


@pytest.mark.parametrize(
    ("method", "space"),
    [
        (method, space)
        for method in ("ta", "tsv", "iso_c", "iso_cts", "ties", "dare")
        for space in ("full", "core", "knots")
        # (elementwise methods in full space are dense by definition: not a low-rank path)
        if not (space == "full" and method in ("ties", "dare"))
    ],
)
def test_low_rank_paths_never_form_dense_update(space, method):
    d_in, d_out, r = 37, 53, 3
    ads = ref.make_adapters(0, 4, (("m", d_in, d_out, (3, 3, 3, 3)),))
    _names, buckets, m_tasks = nu._core.tree.collect(ads, fn="t")
    bk = buckets[0]
    res = registry.resolve_options("t", method, space, {"p": 0.2} if method == "dare" else {})
    cfg = _plan.bucket_config(res, buckets[0], m_tasks, jnp.float64, chunk=1)
    nums = {k: jnp.asarray(v, jnp.float64) for k, v in _plan.numeric_options(res).items()}
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(1))
    jaxpr = jax.make_jaxpr(functools.partial(_stages.bucket_merge, cfg=cfg))(
        nu._core.buckets.bucket_arrays(bk),
        jnp.ones((1, m_tasks, r), bool),
        jnp.asarray(1.0),
        keys,
        nums,
        _stages.count_input(cfg, res.kernel_options, m_tasks),
    )
    shapes = list(_all_shapes(jaxpr.jaxpr))
    assert shapes, "empty jaxpr"
    dense = [s for s in shapes if d_in in s and d_out in s]
    assert not dense, dense


def test_second_call_does_not_recompile():
    ads = _adapters(13)
    stages = [
        _stages.stage_reduce,
        _stages.stage_coords,
        _stages.stage_low_rank,
        _stages.stage_decode,
        _stages.stage_elementwise,
    ]
    nu.merge(ads, method="tsv", space="knots")
    nu.merge(ads, method="ties", space="core", density=0.2)
    before = [f._cache_size() for f in stages]
    nu.merge(_adapters(14), method="tsv", space="knots", coef=2.0)
    nu.merge(_adapters(14), method="ties", space="core", density=0.7, coef=0.5)
    assert [f._cache_size() for f in stages] == before


@pytest.mark.parametrize("rows", [1, 3, 5, 11])
def test_ties_rows_is_whole_module_ties_with_ties_and_zeros(rows):
    """Integer factors: every product exact and many equal magnitudes, so the row-blocked TIES
    (thresholds from radix passes over blocks, ties carried across blocks in flat order) must
    equal the whole-module kernel bit for bit, at counts inside runs of ties, past the nonzero
    entries (a zero threshold) and at zero."""
    rng = np.random.default_rng(rows)
    m, p, q, r = 3, 11, 7, 2
    a = rng.integers(-2, 3, size=(1, m, p, r)).astype(np.float64)
    a[:, :, 4] = 0  # a zero row: zero entries in every task
    b = rng.integers(-2, 3, size=(1, m, q, r)).astype(np.float64)
    x = jnp.asarray(a @ np.swapaxes(b, -1, -2))
    coef = jnp.asarray(0.7)
    for k in (0, 1, 9, 30, 60, 70, p * q):
        want = nu.methods.ties(x, coef=coef, k=jnp.asarray([k], jnp.int32))
        got = _stages.ties_rows(
            jnp.asarray(a), jnp.asarray(b), jnp.asarray([k], jnp.int32), coef, rows=rows
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"k={k}")


def _spy_rows(monkeypatch, budget_rows, cols=15):
    """Blocks of ``budget_rows`` rows for SPEC's KnOTS / core coordinates (float64, M r_max =
    15 columns; full space: ``cols=12``, d_out), and a count of the modules merged by blocks."""
    monkeypatch.setattr(_plan, "DENSE_BYTES", budget_rows * 8 * M * cols * 8)
    calls = []
    real = _rows.row_blocks  # (where the row-block merges call it)

    def spy(a, b, rows):
        calls.append(rows)
        return real(a, b, rows)

    monkeypatch.setattr(_rows, "row_blocks", spy)
    return calls


@pytest.mark.parametrize("space", ["full", "core", "knots", "knots_original"])
def test_ties_row_blocks_match_dense_reference(space, monkeypatch):
    """Modules whose dense tasks exceed the working-memory budget are merged 4 rows at a time
    (18 and 15 rows: ragged last blocks); same reference as the whole-module merge."""
    ads = _adapters()
    masks = _masks(ads, 7)
    kw = {"variant": "original"} if space == "knots_original" else {}
    sp = space.split("_")[0]
    calls = _spy_rows(monkeypatch, 4, 12 if sp == "full" else 15)
    out = nu.merge(ads, masks, method="ties", space=sp, coef=0.8, density=0.3, **kw)
    assert calls and set(calls) == {4}
    _check(out, _ref_in_space(space, REF_METHODS["ties"], ads), ads, masks)


@pytest.mark.parametrize(
    "method, space",
    [
        ("dare", "full"),
        pytest.param("dare_ties", "full", marks=_SLOW),
        pytest.param("dare", "core", marks=_SLOW),
        pytest.param("dare_ties", "core", marks=_SLOW),
        ("dare", "knots"),
        pytest.param("dare_ties", "knots", marks=_SLOW),
        pytest.param("dare", "knots_original", marks=_SLOW),
        pytest.param("dare_ties", "knots_original", marks=_SLOW),
    ],
)
def test_dare_row_blocks_draw_the_whole_modules_masks(method, space, monkeypatch):
    """DARE and DARE-TIES on modules larger than the working-memory budget, 4 rows at a time
    (ragged last blocks): each block draws its rows of the whole module's mask, so the merge is
    the whole-module one (a single entry kept by one and dropped by the other would differ by
    about its size, far above the tolerance), with a typed key and, in KnOTS space, a raw one."""
    ads = _adapters(2, True)
    masks = _masks(ads, 7)
    kw = {"variant": "original"} if space == "knots_original" else {}
    kw.update(method=method, space=space.split("_")[0], coef=0.8, p=0.4)
    keys = [jax.random.key(5)] + ([jax.random.PRNGKey(9)] if space.startswith("knots") else [])
    for key in keys:
        whole = nu.merge(ads, masks, key=key, **kw)
        calls = _spy_rows(monkeypatch, 4, 12 if space == "full" else 15)
        blocked = nu.merge(ads, masks, key=key, **kw)
        monkeypatch.undo()
        # full space: 4 rows of d_out = 12, and 2 of mlp/up's 22
        assert calls and set(calls) == ({4, 2} if space == "full" else {4})
        for n in ads[0]:
            d = ref.dense(whole[n])
            np.testing.assert_allclose(
                ref.dense(blocked[n]), d, rtol=0, atol=1e-12 * np.abs(d).max(), err_msg=n
            )


def test_dare_with_an_rbg_key_keeps_whole_modules(monkeypatch):
    """A key whose masks cannot be drawn by rows (rbg) keeps whole modules under a budget that
    blocks a threefry key's merge, one module per chunk whatever the budget (rbg's bits for a
    module depend on the batch it is drawn in): the same merge at any budget."""
    ads = _adapters(2)
    kw = {"method": "dare", "space": "knots", "p": 0.4, "key": jax.random.key(1, impl="rbg")}
    whole = nu.merge(ads, **kw)
    calls = _spy_rows(monkeypatch, 4)
    small_budget = nu.merge(ads, **kw)
    assert not calls
    for n in ads[0]:
        np.testing.assert_array_equal(ref.dense(small_budget[n]), ref.dense(whole[n]))


@pytest.mark.parametrize("space", ["full", "core", "knots"])
def test_ties_model_scope_row_blocks_equal_whole_modules(space, monkeypatch):
    """Model-wide TIES streams a large module as units of rows, in flat order: the same merge."""
    ads = _adapters(2, True)
    masks = _masks(ads, 11)
    kw = {"method": "ties", "space": space, "trim_scope": "model", "density": 0.3, "coef": 0.7}
    whole = nu.merge(ads, masks, **kw)
    calls = _spy_rows(monkeypatch, 3)
    blocked = nu.merge(ads, masks, **kw)
    assert calls
    for n in ads[0]:
        d = ref.dense(whole[n])
        np.testing.assert_allclose(
            ref.dense(blocked[n]), d, atol=1e-12 * np.abs(d).max(), err_msg=n
        )


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
        t, room, at = _select.radix_threshold(units, 2, k, np.dtype(dtype))
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
                xm, used = _ties_model.ties_apply(
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


def test_count_table_is_peft_count_for_every_live_shape():
    """The traced per-module path looks its count up in a host-made table indexed by the live
    rows and columns of the coordinates (core: both bases; KnOTS: d_in rows): every entry is
    PEFT's count for n = rows * cols; and _stage_split reads the right entry per module."""
    from netutility_jax.operators import spaces as sp

    for density in (0.3, 0.7, float(np.nextafter(0.3, 0.0)), 1 / 3):
        for has_left in (True, False):
            p, q = (20, 24) if has_left else (96, 25)
            table = np.asarray(_select.count_table_np(density, p, q, has_left))
            rows = range(p + 1) if has_left else [p]
            for i, nr in enumerate(rows):
                for nc in range(q + 1):
                    n = nr * nc
                    want = int((_peft_prune(np.arange(1.0, n + 1), density) != 0).sum()) if n else 0
                    assert table[i, nc] == want, (density, nr, nc)
    # modules with 20, 7 and 0 live columns on the left and 24, 13, 5 on the right
    n_mod, p, q = 3, 20, 24
    left = np.zeros((n_mod, 30, p))
    right = np.zeros((n_mod, 40, q))
    for j, (nl, nr) in enumerate(((20, 24), (7, 13), (0, 5))):
        left[j, :nl, :nl] = np.eye(nl)
        right[j, :nr, :nr] = np.eye(nr)
    c = sp.Coords(
        jnp.zeros((n_mod, 1, p, 2)), jnp.zeros((n_mod, 1, q, 2)), jnp.asarray(left),
        jnp.asarray(right), None,
    )  # fmt: skip
    (chunk,) = _stages.stage_split(
        c, jnp.zeros((n_mod,), jnp.uint32), _select.count_table_np(0.3, p, q, True), chunk=n_mod
    )
    assert np.asarray(chunk[3]).tolist() == [int(0.3 * 480), int(0.3 * 91), 0]


# ----------------------------------------------------------------- buckets merged piece by piece


def test_split_bucket_sizes_divide_and_fit():
    _names, buckets, _m_tasks = nu._core.tree.collect(_adapters(0, True), fn="t")
    for bk in buckets:
        n = len(bk.names)
        per = M * bk.r_max * (bk.d_in + bk.d_out) * 8
        for cap in (1, per, 2 * per, 10**9):
            pieces = nu._core.buckets.split_bucket(bk, cap, 8)
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
        ("ties", "core", {"density": 0.3, "trim_scope": "model"}),
        ("dare", "core", {"p": 0.3}),
    ],
)
def test_pieces_give_the_same_merge(monkeypatch, method, space, opts):
    """Per-bucket kernels are free of global state: one module per piece changes nothing."""
    ads = _adapters(2)
    masks = _masks(ads, 4)
    key = jax.random.key(3)
    whole = nu.merge(ads, masks, method=method, space=space, key=key, **opts)
    monkeypatch.setattr(_plan, "PIECE_BYTES", 1)
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
    monkeypatch.setattr(_plan, "chunk_size", lambda *a, **k: calls.append(a) or 1)
    chunked = nu.merge(ads, masks, method=method, space=space, key=key, **opts)
    assert calls
    for n in ads[0]:
        np.testing.assert_allclose(ref.dense(chunked[n]), ref.dense(whole[n]), atol=1e-10)


@pytest.mark.parametrize("chunks", [2, 6])
def test_a_program_holds_one_copy_of_the_method_whatever_its_chunks(monkeypatch, chunks):
    """In the one compiled program of an in-memory merge, a bucket cut into more than
    ``_stages.UNROLL_CHUNKS`` chunks goes through one ``lax.map``: the method's code is traced
    (and compiled) once per bucket, not once per chunk (a 59-module bucket made 59 copies of
    TIES's selection, 46 s of compiling); up to that many chunks, one after another."""
    spec = tuple((f"layers/{i}/q", 18, 12, (4, 3, 5)) for i in range(chunks))
    ads = ref.make_adapters(5, M, spec)
    rng = np.random.default_rng(5)
    masks = {name: rng.random((M, 5)) < 0.65 for name, *_ in spec}
    plan = _plan.plan_merge(
        "t", ads, masks, method="ties", space="knots", coef=1.0, key=None,
        options={"density": 0.3},
    )  # fmt: skip
    assert [len(j.bucket.names) for j in plan.jobs] == [chunks]  # one bucket, one piece
    whole = nu.merge(ads, masks, method="ties", space="knots", density=0.3)
    monkeypatch.setattr(_plan, "chunk_size", lambda *a, **k: 1)
    traced = []
    stage = _stages.stage_elementwise

    def spy(a, *args, **kw):
        traced.append(a.shape[0])
        return stage(a, *args, **kw)

    monkeypatch.setattr(_stages, "stage_elementwise", spy)
    jax.clear_caches()
    chunked = nu.merge(ads, masks, method="ties", space="knots", density=0.3)
    mapped = chunks > _stages.UNROLL_CHUNKS
    assert traced == ([1] if mapped else [1] * chunks)
    for n in ads[0]:
        np.testing.assert_allclose(ref.dense(chunked[n]), ref.dense(whole[n]), atol=1e-10)


def test_chunks_are_as_few_as_the_budget_allows_and_as_equal_as_they_can_be():
    """``_plan.chunk_size``: the fewest chunks within the dense budget, each of the smallest size
    that gives that many (a divisor of the module count where one does); a prime count is no
    longer one module per chunk."""
    per = 8 * 3 * 10 * 10 * 4  # one module's dense tasks and temporaries
    for fit in range(1, 9):
        for n in range(1, 40):
            c = _plan.chunk_size(3, 10, 10, 4, n, budget_bytes=per * fit)
            k = -(-n // min(fit, n))
            assert c <= fit and -(-n // c) == k and c == -(-n // k), (fit, n, c)
    assert _plan.chunk_size(3, 10, 10, 4, 59, budget_bytes=per * 25) == 20
    assert _plan.chunk_size(3, 10, 10, 4, budget_bytes=per * 25) == 25
