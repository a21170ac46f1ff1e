"""nu.score(..., input_moments=...) (the data-aware geometry) and nu.input_moments.

The reference below is written from the objective, not from the library's closed form: per task
``G_i = M_i S_i M_i`` with ``M_i = V_i diag(s_i^a) V_i^T`` formed densely (``d_in x d_in``), and
every benefit and interference is a ratio of weighted energies ``||X||_G^2 = tr(X^T G X)`` (kernel
layout) of the dense rank-one components, in float64 numpy.
"""

from __future__ import annotations

import doctest
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import InputError, InputTypeError
from netutility_jax.scoring.moments import InputMoments, input_moments, input_moments_dense

# module: (d_in, d_out, ranks per task; 0 = the task lacks it), samples per task
SHAPES = {
    "enc/q": (12, 9, (3, 4, 2), 30),  # n > 2 d_in: a 12 x 12 factor of S
    "enc/v": (20, 7, (5, 0, 3), 8),  # n < d_in: S is rank 8, never formed; task 1 lacks it
}


def _spectrum_module(rng, d_in, d_out, r, dtype):
    """A module with a well-spread spectrum (every direction a candidate at the default rtol)."""
    qa, _ = np.linalg.qr(rng.normal(size=(d_in, r)))
    qb, _ = np.linalg.qr(rng.normal(size=(d_out, r)))
    s = np.geomspace(2.0, 0.4, r) * rng.uniform(0.95, 1.05, r)  # well separated
    mix = rng.normal(size=(r, r)) + 3 * np.eye(r)
    a = qa * s @ mix
    b = np.linalg.solve(mix, qb.T)
    return {"lora_a": a.astype(dtype), "lora_b": b.astype(dtype), "scale": 1.5}


def _problem(seed=0, dtype=np.float64, m_tasks=3):
    rng = np.random.default_rng(seed)
    ads = [{} for _ in range(m_tasks)]
    acts = [{} for _ in range(m_tasks)]
    for name, (d_in, d_out, ranks, n) in SHAPES.items():
        # tasks' inputs: anisotropic, each with its own dominant directions
        for i in range(m_tasks):
            r = ranks[i % len(ranks)]
            ads[i][name] = None if r == 0 else _spectrum_module(rng, d_in, d_out, r, dtype)
            mix = rng.normal(size=(d_in, d_in)) * rng.uniform(0.1, 2.0, d_in)
            acts[i][name] = (rng.normal(size=(n, d_in)) @ mix.T).astype(dtype)
    return ads, acts


def _dense(mod):
    return (
        float(mod.get("scale", 1.0))
        * np.asarray(mod["lora_a"], np.float64)
        @ np.asarray(mod["lora_b"], np.float64)
    )


def _energy(x, g):
    """``||X||_G^2 = tr(X^T G X)`` of an update in kernel layout ``(d_in, d_out)``."""
    return float(np.trace(x.T @ g @ x))


def _reference(ads, seconds, alpha, lam="auto"):
    """float64 data-aware scores from the objective. ``seconds[i][name]``: S (d_in, d_in) or None
    (the data-free geometry, S = I)."""
    m_tasks = len(ads)
    out = {}
    for name, (d_in, _, _, _) in SHAPES.items():
        comps, geoms, totals = [], [], []
        for i in range(m_tasks):
            mod = ads[i][name]
            if mod is None:
                comps.append([])
                geoms.append(None)
                totals.append(None)
                continue
            dk = _dense(mod)
            u, s, vt = np.linalg.svd(dk, full_matrices=False)
            r = mod["lora_a"].shape[1]
            u, s, vt = u[:, :r], s[:r], vt[:r]
            comps.append([(s[k], s[k] * np.outer(u[:, k], vt[k])) for k in range(r)])
            m_i = u @ np.diag(s**alpha) @ u.T  # V_i Sigma^a V_i^T (in_dirs are the columns of u)
            s_i = seconds[i].get(name) if seconds[i] is not None else None
            s_i = np.eye(d_in) if s_i is None else s_i
            g = m_i @ s_i @ m_i
            geoms.append(g)
            totals.append(_energy(dk, g))
        r_max = max(len(c) for c in comps)
        sigma = np.zeros((m_tasks, r_max))
        ben = np.zeros((m_tasks, r_max))
        inter = np.zeros((m_tasks, r_max))
        cand = np.zeros((m_tasks, r_max), bool)
        for j in range(m_tasks):
            for k, (s, d) in enumerate(comps[j]):
                sigma[j, k], cand[j, k] = s, True
                ben[j, k] = _energy(d, geoms[j]) / totals[j]
                inter[j, k] = sum(
                    _energy(d, geoms[i]) / totals[i]
                    for i in range(m_tasks)
                    if i != j and geoms[i] is not None
                )
        out[name] = (sigma, ben, inter, cand)
    if lam == "auto":
        b = np.concatenate([o[1][o[3]] for o in out.values()])
        c = np.concatenate([o[2][o[3]] for o in out.values()])
        lam = float(np.median(b) / np.median(c))
    util = {k: np.where(o[3], o[1] - lam * o[2], -np.inf) for k, o in out.items()}
    return out, util, lam


def _seconds(acts):
    return [
        None
        if a is None
        else {
            k: None
            if x is None
            else x.reshape(-1, x.shape[-1]).T
            @ x.reshape(-1, x.shape[-1])
            / x.reshape(-1, x.shape[-1]).shape[0]
            for k, x in a.items()
        }
        for a in acts
    ]


def _check(sc, ref, tol):
    out, util, lam = ref
    assert abs(float(sc.lam) - lam) <= tol * abs(lam)
    for name, (sigma, ben, inter, cand) in out.items():
        ms = sc.modules[name]
        np.testing.assert_array_equal(np.asarray(ms.utility) > -np.inf, cand, err_msg=name)
        for got, want, what in ((ms.sigma, sigma, "sigma"), (ms.benefit, ben, "benefit")):
            np.testing.assert_allclose(
                got, want, atol=tol * np.abs(want).max(), err_msg=name + what
            )
        np.testing.assert_allclose(
            ms.interference, inter, atol=tol * np.abs(inter).max(), err_msg=f"{name} interference"
        )
        u = np.where(cand, np.asarray(ms.utility), 0)
        np.testing.assert_allclose(
            u, np.where(cand, util[name], 0), atol=tol * np.abs(util[name][cand]).max()
        )


# ------------------------------------------------------------------------------------------------
# Against the float64 reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1.0, 0.0, 0.5])
def test_data_aware_score_matches_float64_reference(alpha):
    with jax.enable_x64(True):
        ads, acts = _problem(0)
        mom = [input_moments(a) for a in acts]
        sc = nu.score(ads, alpha=alpha, input_moments=mom)
        assert sc.lam.dtype == jnp.float64
        _check(sc, _reference(ads, _seconds(acts), alpha), 1e-8)


def test_float32_data_aware_score_matches_reference():
    ads, acts = _problem(1, np.float32)
    sc = nu.score(ads, input_moments=[input_moments(a) for a in acts])
    assert sc.lam.dtype == jnp.float32
    _check(sc, _reference(ads, _seconds(acts), 1.0), 2e-4)


def test_mixed_tasks_and_modules_without_data_use_the_data_free_geometry():
    """None for a whole task, and None for one module of another: S = I there."""
    with jax.enable_x64(True):
        ads, acts = _problem(2)
        acts[0] = None
        acts[2] = {**acts[2], "enc/v": None}
        mom = [None if a is None else input_moments(a) for a in acts]
        sc = nu.score(ads, alpha=1.0, lam=0.7, input_moments=mom)
        _check(sc, _reference(ads, _seconds(acts), 1.0, lam=0.7), 1e-8)


def test_dense_second_moments_give_the_sample_result():
    with jax.enable_x64(True):
        ads, acts = _problem(3)
        sec = _seconds(acts)
        a = nu.score(ads, input_moments=[input_moments(x) for x in acts])
        b = nu.score(ads, input_moments=[input_moments_dense(s) for s in sec])
        for name in SHAPES:
            for x, y in zip(a.modules[name], b.modules[name], strict=True):
                np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# Reduction to the data-free score, invariances
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1.0, 0.0])
def test_isotropic_moments_reduce_to_the_data_free_score(alpha):
    """S = c I (any c > 0) for every task: the paper's data-free score. (One module, with a task
    that lacks it, to keep the two compilations small.)"""
    with jax.enable_x64(True):
        ads, _ = _problem(4)
        ads = [{"enc/v": ad["enc/v"]} for ad in ads]
        free = nu.score(ads, alpha=alpha)
        iso = [
            {"enc/v": InputMoments(jnp.asarray(np.sqrt(c) * np.eye(20)))}
            if ad["enc/v"] is not None
            else {}
            for c, ad in zip((1.0, 3.7, 0.02), ads, strict=True)
        ]
        aware = nu.score(ads, alpha=alpha, input_moments=iso)
        assert abs(float(aware.lam) - float(free.lam)) <= 1e-10 * float(free.lam)
        for name in ["enc/v"]:
            for x, y in zip(aware.modules[name], free.modules[name], strict=True):
                np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-13)


def test_all_none_is_the_data_free_score_bit_for_bit():
    ads, _ = _problem(5, np.float32)
    free = nu.score(ads)
    none = nu.score(ads, input_moments=[None, {k: None for k in SHAPES}, None])
    assert float(none.lam) == float(free.lam)
    for name in SHAPES:
        for x, y in zip(none.modules[name], free.modules[name], strict=True):
            np.testing.assert_array_equal(x, y)


def test_scale_of_each_task_moments_cancels_and_outside_support_is_ignored():
    """Scaling S_i by c_i (per task) changes nothing (it cancels against the task's own energy,
    as the paper's kappa_i); nor does input energy orthogonal to task i's input directions
    (G_i = M_i S_i M_i only sees S_i on task i's row space). A bug mixing tasks' normalisers, or
    using S_i unfiltered, breaks both."""
    with jax.enable_x64(True):
        ads, acts = _problem(6)
        base = nu.score(ads, input_moments=[input_moments(a) for a in acts])
        scaled = [
            {k: x * c for k, x in a.items()} for a, c in zip(acts, (10.0, 1e-3, 4.0), strict=True)
        ]
        sc = nu.score(ads, input_moments=[input_moments(a) for a in scaled])
        rng = np.random.default_rng(1)
        extra = []
        for i, a in enumerate(acts):
            e = {}
            for k, x in a.items():
                if ads[i][k] is None:
                    e[k] = x
                    continue
                u = np.linalg.svd(_dense(ads[i][k]), full_matrices=True)[0]
                perp = u[:, ads[i][k]["lora_a"].shape[1] :]  # orthogonal to task i's in_dirs
                if perp.shape[1] == 0:
                    e[k] = x
                    continue
                # large inputs orthogonal to task i's in_dirs, added to its samples (same n)
                e[k] = x + rng.normal(size=(len(x), perp.shape[1])) @ perp.T * 30.0
            extra.append(e)
        out = nu.score(ads, input_moments=[input_moments(a) for a in extra])
        for name in SHAPES:
            for x, y, z in zip(
                base.modules[name], sc.modules[name], out.modules[name], strict=True
            ):
                np.testing.assert_allclose(y, x, rtol=1e-9, atol=1e-12)
                np.testing.assert_allclose(z, x, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("size", [1e-25, 1e25])
def test_activations_of_any_size_give_the_same_scores(size):
    """float32 activations near the ends of the range: ||F||_F^2 overflows (1e25) or underflows
    (1e-25) in float32, so the kernel normalises F first; the scores do not change."""
    ads, acts = _problem(13, np.float32)
    base = nu.score(ads, input_moments=[input_moments(a) for a in acts])
    big = [
        {k: (x.astype(np.float64) * size).astype(np.float32) for k, x in a.items()} for a in acts
    ]
    sc = nu.score(ads, input_moments=[input_moments(a) for a in big])
    for name in SHAPES:
        for x, y in zip(base.modules[name], sc.modules[name], strict=True):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)


def test_inputs_on_another_tasks_direction_raise_its_interference():
    """The point of the data: two tasks with the same update geometry, but task 1's inputs live
    on task 0's first direction. Only the interference of that direction with task 1 grows."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(7)
        d = 16
        q, _ = np.linalg.qr(rng.normal(size=(d, 6)))
        mods = [
            {"lora_a": q[:, :3] * [3.0, 2.0, 1.0], "lora_b": np.eye(3, 5)},
            {
                "lora_a": (q[:, :3] + q[:, 3:6]) / np.sqrt(2) * [3.0, 2.0, 1.0],
                "lora_b": np.eye(3, 5),
            },
        ]
        ads = [{"m": m} for m in mods]
        iso = nu.score(ads, lam=1.0)
        x1 = rng.normal(size=(64, d)) * 0.01 + np.outer(rng.normal(size=64), q[:, 0])
        aware = nu.score(ads, lam=1.0, input_moments=[None, input_moments({"m": x1})])
        i_iso, i_aw = (
            np.asarray(iso.modules["m"].interference[0]),
            np.asarray(aware.modules["m"].interference[0]),
        )
        # task 0's first direction, where task 1's inputs are, interferes more (closed form:
        # s^2 (3/2)^2 / (81/2) = 0.5 against 9 * 81/2 / 98 data-free), its others almost not
        assert i_aw[0] == pytest.approx(0.5, rel=1e-3) and i_iso[0] == pytest.approx(40.5 / 98)
        assert (i_aw[1:] < 1e-3 * i_iso[1:]).all()


def test_lam_auto_is_the_median_ratio_of_the_data_aware_terms():
    ads, acts = _problem(8, np.float32)
    sc = nu.score(ads, input_moments=[input_moments(a) for a in acts])
    ms = list(sc.modules.values())
    cand = np.concatenate([np.asarray(m.utility).ravel() > -np.inf for m in ms])
    b = np.concatenate([np.asarray(m.benefit, np.float64).ravel() for m in ms])[cand]
    c = np.concatenate([np.asarray(m.interference, np.float64).ravel() for m in ms])[cand]
    assert float(sc.lam) == pytest.approx(np.median(b) / np.median(c), rel=1e-5)
    for m in ms:
        u = np.where(np.asarray(m.utility) > -np.inf, np.asarray(m.utility), 0)
        want = np.where(
            u != 0, np.asarray(m.benefit) - float(sc.lam) * np.asarray(m.interference), 0
        )
        np.testing.assert_allclose(u, want, rtol=1e-6, atol=1e-7)


def test_permuting_tasks_permutes_data_aware_scores():
    ads, acts = _problem(9, np.float32)
    mom = [input_moments(a) for a in acts]
    perm = [2, 1, 0]  # (task 1, which lacks a module, stays: the compiled shapes are shared)
    a = nu.score(ads, input_moments=mom)
    b = nu.score([ads[p] for p in perm], input_moments=[mom[p] for p in perm])
    assert float(b.lam) == pytest.approx(float(a.lam), rel=1e-5)
    for name in SHAPES:
        for x, y in zip(a.modules[name], b.modules[name], strict=True):
            np.testing.assert_allclose(np.asarray(x)[perm], y, rtol=1e-4, atol=1e-6)


def test_second_call_does_not_recompile():
    ads, acts = _problem(10, np.float32)
    nu.score(ads, input_moments=[input_moments(a) for a in acts])
    ads, acts = _problem(11, np.float32)  # new values, same shapes
    with jax.log_compiles(True):
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger = logging.getLogger("jax")
        logger.addHandler(handler)
        try:
            nu.score(ads, input_moments=[input_moments(a) for a in acts])
        finally:
            logger.removeHandler(handler)
    assert not [r for r in records if "_score_impl" in r.getMessage()]


def test_under_jit_gives_the_eager_scores():
    rng = np.random.default_rng(3)
    ads = [{"m": _spectrum_module(rng, 8, 5, 3, np.float32)} for _ in range(2)]
    mom = [input_moments({"m": rng.normal(size=(6, 8)).astype(np.float32)}) for _ in range(2)]

    @jax.jit
    def f(ads, mom):
        return nu.score(ads, lam=0.5, input_moments=mom)

    sj = f(ads, mom)
    se = nu.score(ads, lam=0.5, input_moments=mom)
    np.testing.assert_allclose(sj.modules["m"].utility, se.modules["m"].utility, rtol=1e-5)


def test_mesh_gives_the_one_device_scores():
    ads, acts = _problem(11, np.float32)
    mom = [input_moments(a) for a in acts]
    a = nu.score(ads, input_moments=mom)
    b = nu.score(ads, input_moments=mom, mesh=nu.module_mesh())
    for name in SHAPES:
        for x, y in zip(a.modules[name], b.modules[name], strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# nu.input_moments
# ------------------------------------------------------------------------------------------------


def test_input_moments_flattens_batches_and_lists_and_compresses():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 7, 5)).astype(np.float32)  # batch x tokens x d_in
    y = rng.normal(size=(4, 5)).astype(np.float32)
    m = input_moments({"blk": {"q": (x, y), "v": x[:1, :2]}, "skip": None})
    rows = np.concatenate([x.reshape(-1, 5), y]).astype(np.float64)
    assert m["skip"] is None
    assert m["blk/q"].factor.shape == (5, 5) and m["blk/q"].factor.dtype == jnp.float32
    np.testing.assert_allclose(m["blk/q"].second_moment(), rows.T @ rows / 25, rtol=1e-5)
    assert m["blk/v"].factor.shape == (2, 5)  # n = 2 < d_in: the samples themselves


def test_input_moments_dense_checks_and_factors():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 6))
    s = x.T @ x / 3  # rank 3
    f = input_moments_dense({"m": s})["m"].factor
    assert f.shape == (3, 6)
    np.testing.assert_allclose(np.asarray(f).T @ np.asarray(f), s, atol=1e-6)
    bad = s.copy()
    bad[0, 1] += 1.0
    with pytest.raises(
        InputError, match=r"nu\.input_moments_dense: .*'m' \(6 x 6\) is not symmetric"
    ):
        input_moments_dense({"m": bad})
    with pytest.raises(
        InputError, match=r"'m' \(6 x 6\) is not positive semidefinite \(smallest eigenvalue -1"
    ):
        input_moments_dense({"m": s - np.eye(6)})
    with pytest.raises(InputError, match=r"shape \(6, 3\); expected a square"):
        input_moments_dense({"m": x.T})
    with pytest.raises(InputError, match=r"has 1 non-finite entries"):
        input_moments_dense({"m": np.where(np.eye(6, dtype=bool) & (np.arange(6) == 2), np.nan, s)})


@pytest.mark.parametrize(
    "acts, exc, msg",
    [
        (
            {"q": np.full((4, 3), np.nan, np.float32)},
            InputError,
            r"'q' \(4 samples x 3\) have 12 non-finite",
        ),
        ({"q": np.zeros((4, 3), np.float32)}, InputError, r"'q' \(4 samples x 3\) are all zero"),
        ({"q": np.zeros((0, 3), np.float32)}, InputError, r"'q' are empty"),
        ({"q": np.ones((4, 3), np.int32)}, InputTypeError, r"dtype int32; expected a floating"),
        ({"q": [np.ones((4, 3)), np.ones((2, 5))]}, InputError, r"shapes \(4, 3\), \(2, 5\)"),
        ([np.ones((4, 3))], InputTypeError, r"expected a mapping"),
    ],
)
def test_input_moments_refuses_bad_activations(acts, exc, msg):
    with pytest.raises(exc, match=r"nu\.input_moments: .*" + msg):
        input_moments(acts)


# ------------------------------------------------------------------------------------------------
# nu.score's checks of input_moments
# ------------------------------------------------------------------------------------------------


def _small():
    ads, acts = _problem(12, np.float32)
    return ads, [input_moments(a) for a in acts]


def test_wrong_task_count_is_refused():
    ads, mom = _small()
    with pytest.raises(
        InputError, match=r"nu\.score: input_moments has 2 entries for M = 3 adapters"
    ):
        nu.score(ads, input_moments=mom[:2])
    with pytest.raises(InputTypeError, match=r"input_moments is a dict; expected a list with one"):
        nu.score(ads, input_moments=mom[0])


def test_wrong_d_in_is_refused_naming_module_task_and_shapes():
    ads, mom = _small()
    mom[1] = {**mom[1], "enc/q": mom[1]["enc/v"]}
    with pytest.raises(
        InputError,
        match=r"nu\.score: input_moments\[1\]\['enc/q'\] has a factor of shape \(8, 20\) "
        r"\(S = factor\^T factor\), but module 'enc/q' of task 1 has d_in = 12 \(lora_a \(12, 4\)\)",
    ):
        nu.score(ads, input_moments=mom)


def test_nan_and_zero_moments_are_refused():
    ads, mom = _small()
    f = np.array(mom[2]["enc/v"].factor)
    f[0, 0] = np.nan
    bad = [mom[0], mom[1], {**mom[2], "enc/v": InputMoments(f)}]
    with pytest.raises(
        InputError, match=r"input_moments\[2\]\['enc/v'\] \(factor \(8, 20\)\) has 1 non-finite"
    ):
        nu.score(ads, input_moments=bad)
    zero = [{**mom[0], "enc/v": InputMoments(np.zeros((8, 20), np.float32))}, mom[1], mom[2]]
    with pytest.raises(
        InputError, match=r"input_moments\[0\]\['enc/v'\] \(factor \(8, 20\)\) is zero"
    ):
        nu.score(ads, input_moments=zero)


def test_missing_unknown_and_raw_entries_are_refused():
    ads, mom = _small()
    partial = {k: v for k, v in mom[0].items() if k != "enc/v"}
    with pytest.raises(
        InputError, match=r"input_moments\[0\] lacks module 'enc/v' that task 0 has. Mixing data"
    ):
        nu.score(ads, input_moments=[partial, mom[1], mom[2]])
    with pytest.raises(
        InputError, match=r"input_moments\[1\] names module 'enc/k' that the adapters lack"
    ):
        nu.score(ads, input_moments=[mom[0], {**mom[1], "enc/k": None}, mom[2]])
    raw = {**mom[0], "enc/q": np.ones((4, 12), np.float32)}
    with pytest.raises(
        InputTypeError,
        match=r"input_moments\[0\]\['enc/q'\] is <ndarray of shape \(4, 12\).*ambiguous",
    ):
        nu.score(ads, input_moments=[raw, mom[1], mom[2]])
    # a task that lacks a module needs no entry there
    lacks = {k: v for k, v in mom[1].items() if k != "enc/v"}
    nu.score(ads, input_moments=[mom[0], lacks, mom[2]])


def test_inputs_orthogonal_to_the_update_are_refused():
    """A factor from another layer of the same width, orthogonal to task 0's input directions:
    task 0's update does nothing on those inputs (0 / 0 energy share)."""
    ads, mom = _small()
    a = np.asarray(ads[0]["enc/q"]["lora_a"], np.float64)
    perp = np.linalg.svd(a, full_matrices=True)[0][:, a.shape[1] :]
    rows = np.zeros((12, 12), np.float32)  # padded to the samples' 12 rows: the same compile
    rows[: perp.shape[1]] = perp.T
    blind = {**mom[0], "enc/q": InputMoments(rows)}
    with pytest.raises(
        InputError,
        match=r"nu\.score: module 'enc/q', task 0: the update \(lora_a \(12, 3\), lora_b \(3, 9\)\) "
        r"is zero on every input of input_moments\[0\]",
    ):
        nu.score(ads, input_moments=[blind, mom[1], mom[2]])


def test_flax_nnx_capture_recipe_of_the_docs():
    """docs/input_moments.md's recipe: a LoRALinear that sows its input, nnx.capture per batch."""
    from flax import nnx

    class Recording(nnx.LoRALinear):
        def __call__(self, x):
            self.sow(nnx.Intermediate, "inputs", x)
            return super().__call__(x)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.q = Recording(6, 4, lora_rank=2, rngs=rngs)
            self.o = Recording(4, 3, lora_rank=2, rngs=rngs)

        def __call__(self, x):
            return self.o(jax.nn.relu(self.q(x)))

    model = Model(nnx.Rngs(0))
    forward = nnx.capture(model, nnx.Intermediate)
    xs = [np.random.default_rng(k).normal(size=(5, 6)).astype(np.float32) for k in range(3)]
    states = [forward(x)[1] for x in xs]
    mom = input_moments(states, sown="inputs")
    assert set(mom) == set(nu.nnx.extract_adapter(model)) == {"q", "o"}
    x = np.concatenate(xs).astype(np.float64)
    np.testing.assert_allclose(mom["q"].second_moment(), x.T @ x / 15, rtol=1e-5, atol=1e-6)
    assert mom["o"].factor.shape == (4, 4)


def test_docstring_example_runs():
    mod = importlib.import_module("netutility_jax.moments")
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0
