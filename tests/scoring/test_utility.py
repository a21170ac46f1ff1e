"""nu.score, nu.heterogeneity, nu.task_energies against the dense float64 reference in _reference.py."""

from __future__ import annotations

import importlib
import re
import warnings

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import (
    F64_EPS,
    RICH_SPEC,
    SMALL_SPEC,
    assert_rel_close,
    assert_scores_match,
    default_rtol,
    flat_modules,
    make_adapters,
    paper_objective,
    ref_allocate,
    ref_heterogeneity,
    ref_scores,
    ref_task_energies,
    rich_adapters,
    rich_reference,
)
from jax.experimental import checkify

import netutility_jax as nu
from netutility_jax import InputError, InputTypeError
from netutility_jax._core import stacking as stacking_mod

utility_mod = importlib.import_module("netutility_jax.utility")
kernels_mod = importlib.import_module("netutility_jax.scoring._kernels")
scoring_mod = importlib.import_module("netutility_jax.scoring._run")

RTOL32 = 1e-4  # float32 library vs float64 reference, relative to each quantity's max
ALPHAS = [1.0, 0.0, 0.5]


def _set(adapter, name, value):
    """Return a shallow-copied adapter with the module at ``name`` replaced by ``value``."""
    *parents, leaf = name.split("/")
    out = dict(adapter)
    node = out
    for p in parents:
        node[p] = dict(node[p])
        node = node[p]
    node[leaf] = value
    return out


def _get(adapter, name):
    node = adapter
    for p in name.split("/"):
        node = node[p]
    return node


def _orth_support(rng, d, rows, r):
    """(d, r) factor whose rows outside ``rows`` are exactly 0 (exactly orthogonal supports)."""
    a = np.zeros((d, r), np.float32)
    a[rows] = rng.normal(size=(len(rows), r))
    return a


def _mod(rng, a, d_out):
    return {"lora_a": a, "lora_b": rng.normal(size=(a.shape[1], d_out)).astype(np.float32)}


# ------------------------------------------------------------------------------------------------
# Dense reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", ALPHAS)
def test_score_matches_dense_reference(m_tasks, alpha):
    ads = rich_adapters(m_tasks)
    ref = rich_reference(m_tasks, alpha)
    sc = nu.score(ads, alpha=alpha)
    assert isinstance(sc, nu.Scores)
    for name, (_, _, _, ranks) in zip(sc.modules, RICH_SPEC, strict=True):
        ms = sc.modules[name]
        assert isinstance(ms, nu.ModuleScores)
        r_max = max(abs(r) for r in ranks[:m_tasks] if r is not None)
        for x in ms:
            assert isinstance(x, jax.Array)
            assert x.shape == (m_tasks, r_max)
            assert x.dtype == jnp.float32
    assert_scores_match(sc, ref, RTOL32)
    assert float(sc.alpha) == alpha


def test_reference_data_has_the_edge_cases():
    """The rich data really has ragged ranks, a zero update and a missing module (guards the spec)."""
    ref = rich_reference(4, 1.0)
    n_cand = {k: m.candidate.sum(1).tolist() for k, m in ref.modules.items()}
    assert n_cand["layers/0/attn/query"] == [4, 6, 3, 5]
    assert n_cand["layers/1/mlp/up"] == [5, 3, 4, 5]
    assert n_cand["layers/0/mlp/up"] == [3, 2, 0, 4]  # task 2: lora_b == 0
    assert n_cand["layers/1/attn/query"] == [4, 0, 6, 2]  # task 1: None
    assert all(m.interference[m.candidate].min() > 0 for m in ref.modules.values())
    assert _get(rich_adapters(4)[1], "layers/1/attn/query") is None


@pytest.mark.parametrize("alpha", ALPHAS)
def test_benefit_is_an_energy_share(alpha):
    """Each task's benefits sum to 1 in every module where it has candidates (w_j normalises)."""
    sc = nu.score(rich_adapters(4), alpha=alpha)
    for ms in sc.modules.values():
        has = np.asarray(ms.sigma).max(1) > 0
        np.testing.assert_allclose(np.asarray(ms.benefit).sum(1)[has], 1.0, rtol=1e-5)
        assert np.all(np.asarray(ms.benefit)[~has] == 0)


def test_sigma_descending_and_matches_svd_per_task():
    sc = nu.score(rich_adapters(4))
    flats = [flat_modules(ad) for ad in rich_adapters(4)]
    for name, ms in sc.modules.items():
        sig = np.asarray(ms.sigma)
        assert np.all(np.diff(sig, axis=1) <= 0)
        for j, f in enumerate(flats):
            if f[name] is None:
                assert np.all(sig[j] == 0)
                continue
            dk = float(np.asarray(f[name].get("scale", 1.0))) * (
                np.asarray(f[name]["lora_a"], np.float64)
                @ np.asarray(f[name]["lora_b"], np.float64)
            )
            s = np.linalg.svd(dk, compute_uv=False)[: f[name]["lora_a"].shape[1]]
            s = np.where(s > default_rtol(sig.shape[1]) * s[0], s, 0.0)
            np.testing.assert_allclose(sig[j, : s.size], s, rtol=1e-5, atol=1e-5 * max(s[0], 1e-30))


@pytest.mark.parametrize("alpha", [1.0, 0.0])
@pytest.mark.parametrize("with_scale", [False, True])
def test_score_x64_matches_reference_tightly(alpha, with_scale):
    """float64 factors with x64 enabled: agreement with the float64 reference to ~1e-9."""
    assert not jax.config.x64_enabled
    with jax.enable_x64(True):
        ads = make_adapters(3, 4, dtype=np.float64, with_scale=with_scale)
        sc = nu.score(ads, alpha=alpha)
        for ms in sc.modules.values():
            assert all(x.dtype == jnp.float64 for x in ms)
        assert sc.lam.dtype == jnp.float64
        ref = ref_scores(ads, alpha=alpha, eps=F64_EPS)
        assert_scores_match(sc, ref, 1e-9)
        e = nu.task_energies(ads)
        assert e.dtype == jnp.float64
        assert_rel_close(e, ref_task_energies(ads), 1e-9, what="task_energies")
    assert not jax.config.x64_enabled


def test_float64_numpy_factors_without_x64_give_float32_without_warnings():
    """Plain numpy (float64) factors are the common input; with x64 off they are computed in float32.

    The API promises float32 by default; the library must not emit JAX's "float64 requested but not
    available" UserWarning (an error under this project's filterwarnings = error).
    """
    ads = make_adapters(5, 3, dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sc = nu.score(ads)
        e = nu.task_energies(ads)
    assert sc.modules["layers/0/attn/query"].sigma.dtype == jnp.float32
    assert e.dtype == jnp.float32
    assert_scores_match(sc, ref_scores(ads), RTOL32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_factors_are_upcast(dtype):
    ads32 = make_adapters(7, 4, SMALL_SPEC)
    ads = jax.tree.map(lambda x: jnp.asarray(x, dtype), ads32)
    sc = nu.score(ads, alpha=0.5)
    for ms in sc.modules.values():
        assert all(x.dtype == jnp.float32 for x in ms)
    # the reference sees exactly the low-precision values, in float64
    assert_scores_match(sc, ref_scores(ads, alpha=0.5), RTOL32)


@hypothesis.given(seed=st.integers(0, 2**16), alpha=st.sampled_from(ALPHAS))
def test_utilities_decompose_the_paper_objective(seed, alpha):
    """Prop. A.3 / App. A.4: for any selection z, the dense separable objective of a module equals
    M' - sum z * utility (M' tasks with a nonzero update there). Checks the library's utilities
    against the paper's objective itself, not against a transcription of Eq. net-utility."""
    ads = rich_adapters(4)
    lam = 0.8
    sc = nu.score(ads, alpha=alpha, lam=lam)
    rng = np.random.default_rng(seed)
    flats = [flat_modules(ad) for ad in ads]
    for name, ms in sc.modules.items():
        u = np.asarray(ms.utility, np.float64)
        cand = np.isfinite(u)
        z = cand & (rng.random(u.shape) < 0.5)
        mods = [f[name] for f in flats]
        m_eff = int(cand.any(1).sum())
        expected = m_eff - float(np.sum(u[z]))
        got = paper_objective(mods, z, lam=lam, alpha=alpha)
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-4), name


# ------------------------------------------------------------------------------------------------
# Zero updates, missing modules, M = 1, lambda
# ------------------------------------------------------------------------------------------------


def test_zero_update_and_missing_module_contribute_nothing():
    ads = rich_adapters(4)
    name = "layers/0/mlp/up"  # task 2 has rank-5 factors with lora_b == 0 here
    sc = nu.score(ads, lam=0.7)
    ms = sc.modules[name]
    assert ms.sigma.shape == (4, 5)
    assert np.all(np.asarray(ms.sigma)[2] == 0)
    assert np.all(np.asarray(ms.utility)[2] == -np.inf)
    # zero update == module absent (where r_max drops from 5 to 4: slot 4 is never a candidate)
    ads_none = [_set(ad, name, None) if j == 2 else ad for j, ad in enumerate(ads)]
    sc_none = nu.score(ads_none, lam=0.7)
    for k in sc.modules:
        r = sc_none.modules[k].sigma.shape[1]
        assert np.all(np.asarray(sc.modules[k].utility)[:, r:] == -np.inf)
        for f in ("sigma", "benefit", "interference", "utility"):
            x = np.asarray(getattr(sc.modules[k], f))[:, :r]
            y = np.asarray(getattr(sc_none.modules[k], f))
            np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
            assert_rel_close(y[np.isfinite(x)], x[np.isfinite(x)], 1e-5, what=f"{k}.{f}")
    # the other tasks' scores there are what they are without task 2 at all
    three = [{name: _get(ads[j], name)} for j in (0, 1, 3)]
    sc3 = nu.score(three, lam=0.7)
    for f in ("sigma", "benefit", "interference"):
        assert_rel_close(
            getattr(sc3.modules[name], f), np.asarray(getattr(ms, f))[[0, 1, 3], :4], 1e-5, what=f
        )


def test_single_task_utility_is_benefit():
    ads = make_adapters(15, 1, SMALL_SPEC)
    sc = nu.score(ads)
    assert float(sc.lam) == 0.0
    assert_scores_match(sc, ref_scores(ads), RTOL32)
    for ms in sc.modules.values():
        assert np.all(np.asarray(ms.interference) == 0)
        cand = np.isfinite(np.asarray(ms.utility))
        np.testing.assert_array_equal(np.asarray(ms.utility)[cand], np.asarray(ms.benefit)[cand])


def test_lam_auto_falls_back_to_positive_median_when_median_interference_is_zero():
    rng = np.random.default_rng(11)
    d, d_out = 12, 8
    ads = [
        {"m": _mod(rng, _orth_support(rng, d, [0, 1, 2], 2), d_out)},
        {"m": _mod(rng, _orth_support(rng, d, [2, 3, 4], 2), d_out)},
        # orthogonal to both: its 6 candidates have exactly zero interference (> half of 10)
        {"m": _mod(rng, _orth_support(rng, d, list(range(5, 12)), 6), d_out)},
    ]
    ref = ref_scores(ads, overlap_atol=1e-12)
    inter = ref.modules["m"].interference[ref.modules["m"].candidate]
    assert np.median(inter) == 0 and (inter > 0).sum() == 4
    expected = np.median(ref.modules["m"].benefit[ref.modules["m"].candidate]) / np.median(
        inter[inter > 0]
    )
    assert ref.lam == pytest.approx(expected)
    sc = nu.score(ads)
    assert np.all(np.asarray(sc.modules["m"].interference)[2] == 0)
    assert_scores_match(sc, ref, RTOL32)


def test_lam_auto_is_zero_without_any_interference():
    rng = np.random.default_rng(12)
    ads = [
        {"m": _mod(rng, _orth_support(rng, 12, [0, 1, 2], 2), 8)},
        {"m": _mod(rng, _orth_support(rng, 12, [3, 4, 5, 6], 3), 8)},
    ]
    sc = nu.score(ads)
    assert float(sc.lam) == 0.0
    ms = sc.modules["m"]
    assert np.all(np.asarray(ms.interference) == 0)
    cand = np.isfinite(np.asarray(ms.utility))
    np.testing.assert_array_equal(np.asarray(ms.utility)[cand], np.asarray(ms.benefit)[cand])
    assert_scores_match(sc, ref_scores(ads, overlap_atol=1e-12), RTOL32)


@pytest.mark.parametrize("lam", [0.0, 0.37, 2.5])
def test_float_lam_is_used(lam):
    ads = rich_adapters(4)
    sc = nu.score(ads, alpha=0.5, lam=lam)
    assert float(sc.lam) == pytest.approx(lam)
    assert_scores_match(sc, ref_scores(ads, alpha=0.5, lam=lam), RTOL32)


# ------------------------------------------------------------------------------------------------
# Candidates and rtol
# ------------------------------------------------------------------------------------------------


def _with_spectrum(rng, s, d_in=12, d_out=10):
    """Factors with exactly known singular values ``s`` (orthonormal U, V from QR)."""
    r = len(s)
    u, _ = np.linalg.qr(rng.normal(size=(d_in, r)))
    v, _ = np.linalg.qr(rng.normal(size=(d_out, r)))
    return {"lora_a": (u * np.asarray(s)).astype(np.float32), "lora_b": v.T.astype(np.float32)}


def test_explicit_rtol_cut():
    rng = np.random.default_rng(3)
    ads = [
        {"m": _with_spectrum(rng, [10.0, 4.0, 1.3, 0.7])},
        {"m": _with_spectrum(rng, [3.0, 2.0, 1.0, 0.31])},
    ]
    sc = nu.score(ads, rtol=0.1, lam=1.0)
    cand = np.isfinite(np.asarray(sc.modules["m"].utility))
    np.testing.assert_array_equal(cand, [[True, True, True, False], [True, True, True, True]])
    assert_scores_match(sc, ref_scores(ads, rtol=0.1, lam=1.0), RTOL32)


@pytest.mark.parametrize("r_other", [4, 8])
def test_default_rtol_uses_module_r_max(r_other):
    """Default rtol = sqrt(10 * r_max * eps32): 2.18e-3 at r_max = 4, 3.09e-3 at r_max = 8."""
    rng = np.random.default_rng(4)
    spectrum = [1.0, 0.5, 2.6e-3, 1.2e-3]
    other = _with_spectrum(rng, np.linspace(2.0, 1.0, r_other).tolist())
    ads = [{"m": _with_spectrum(rng, spectrum)}, {"m": other}]
    sc = nu.score(ads)
    cand = np.isfinite(np.asarray(sc.modules["m"].utility))[0]
    expected = np.array(spectrum) > default_rtol(r_other) * spectrum[0]
    assert expected.tolist() == [True, True, r_other == 4, False]
    np.testing.assert_array_equal(cand[:4], expected)
    assert not cand[4:].any()


def test_ranks_exceeding_the_update_width():
    """r > d_in or r > d_out: only min(d_in, d_out) directions can be candidates."""
    spec = (("wide", 4, 12, (6, 3, 6)), ("narrow", 12, 4, (6, 5, 2)), ("square", 5, 5, (8, 8, 2)))
    ads = make_adapters(16, 3, spec)
    sc = nu.score(ads)
    n_cand = {k: np.isfinite(np.asarray(m.utility)).sum(1).tolist() for k, m in sc.modules.items()}
    assert n_cand == {"wide": [4, 3, 4], "narrow": [4, 4, 2], "square": [5, 5, 2]}
    assert_scores_match(sc, ref_scores(ads), RTOL32)


def test_rank_deficient_update_drops_the_zero_direction():
    rng = np.random.default_rng(5)
    a = rng.normal(size=(16, 4)).astype(np.float32)
    a[:, 3] = a[:, 2]
    ads = [
        {"m": {"lora_a": a, "lora_b": rng.normal(size=(4, 12)).astype(np.float32)}},
        {
            "m": {
                "lora_a": rng.normal(size=(16, 4)).astype(np.float32),
                "lora_b": rng.normal(size=(4, 12)).astype(np.float32),
            }
        },
    ]
    sc = nu.score(ads)
    ms = sc.modules["m"]
    np.testing.assert_array_equal(np.isfinite(np.asarray(ms.utility)), [[1, 1, 1, 0], [1, 1, 1, 1]])
    assert float(ms.sigma[0, 3]) == 0.0
    assert_scores_match(sc, ref_scores(ads), RTOL32)


def test_nearly_shared_directions_match_reference():
    """Task 2's lora_a = task 1's + 1e-4 noise: the stacked input factors are ill-conditioned."""
    rng = np.random.default_rng(6)
    a1 = rng.normal(size=(32, 6))
    a2 = a1 + 1e-4 * rng.normal(size=a1.shape)
    ads = [
        {
            "m": {
                "lora_a": a.astype(np.float32),
                "lora_b": rng.normal(size=(6, 24)).astype(np.float32),
            }
        }
        for a in (rng.normal(size=(32, 6)), a1, a2)
    ]
    for alpha in (1.0, 0.0):
        sc = nu.score(ads, alpha=alpha)
        rm = ref_scores(ads, alpha=alpha).modules["m"]
        lib = np.asarray(sc.modules["m"].interference, np.float64)
        # tasks 1 and 2 overlap almost fully: large, and elementwise within 1e-3
        np.testing.assert_allclose(lib[1:], rm.interference[1:], rtol=1e-3)
        assert_rel_close(lib, rm.interference, 1e-3, what="interference")
        assert_rel_close(sc.modules["m"].benefit, rm.benefit, 1e-4, what="benefit")


# ------------------------------------------------------------------------------------------------
# Invariants (hypothesis)
# ------------------------------------------------------------------------------------------------

# Equal ranks across tasks in each module (so a permutation keeps every leaf's shape and nothing
# recompiles), ragged across modules, and a zero update in task 2 of "up".
PERM_SPEC = (("q", 16, 12, (4, 4, 4, 4)), ("up", 10, 20, (3, 3, -3, 3)))


@hypothesis.given(seed=st.integers(0, 2**16), perm=st.permutations(range(4)))
def test_permuting_tasks_permutes_scores(seed, perm):
    ads = make_adapters(seed, 4, PERM_SPEC)
    sc = nu.score(ads, alpha=0.5)
    sp = nu.score([ads[p] for p in perm], alpha=0.5)
    assert float(sp.lam) == pytest.approx(float(sc.lam), rel=1e-5)
    for k in sc.modules:
        for f in ("sigma", "benefit", "interference", "utility"):
            x = np.asarray(getattr(sc.modules[k], f))[list(perm)]
            y = np.asarray(getattr(sp.modules[k], f))
            np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
            fin = np.isfinite(x)
            assert_rel_close(y[fin], x[fin], 1e-5, what=f"{k}.{f}")


def test_permuting_tasks_with_ragged_ranks_and_missing_modules():
    ads = rich_adapters(4)
    perm = [2, 0, 3, 1]
    sc = nu.score(ads)
    sp = nu.score([ads[p] for p in perm])
    for k in sc.modules:
        for f in ("sigma", "benefit", "interference", "utility"):
            x = np.asarray(getattr(sc.modules[k], f))[perm]
            y = np.asarray(getattr(sp.modules[k], f))
            np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
            assert_rel_close(y[np.isfinite(x)], x[np.isfinite(x)], 1e-5, what=f"{k}.{f}")


SCALE_SPEC = (("q", 16, 12, (4, 5)), ("up", 10, 20, (3, 2)))


@hypothesis.given(
    seed=st.integers(0, 2**16),
    task=st.integers(0, 1),
    log_c=st.floats(-2.0, 2.0),
    negative=st.booleans(),
    alpha=st.sampled_from([1.0, 0.0, 0.5]),
)
def test_scaling_one_task(seed, task, log_c, negative, alpha):
    """scale_j -> c * scale_j: benefit unchanged, sigma_j * |c|; with M = 2, interference_j * c^2
    and the other task's * c^-2 (its overlap weights s^(2a)/w scale as c^-2)."""
    c = 10.0**log_c
    ads = make_adapters(seed, 2, SCALE_SPEC)
    scaled = [dict(ad) for ad in ads]
    for k in ("q", "up"):
        m = dict(ads[task][k])
        m["scale"] = np.asarray((-c if negative else c) * m["scale"], np.float32)
        scaled[task][k] = m
    sc = nu.score(ads, alpha=alpha, lam=1.0)
    ss = nu.score(scaled, alpha=alpha, lam=1.0)
    other = 1 - task
    for k in sc.modules:
        a, b = sc.modules[k], ss.modules[k]
        assert_rel_close(b.benefit, a.benefit, 1e-5, what="benefit")
        assert_rel_close(
            np.asarray(b.sigma)[task], c * np.asarray(a.sigma)[task], 1e-5, what="sigma"
        )
        np.testing.assert_array_equal(np.asarray(b.sigma)[other], np.asarray(a.sigma)[other])
        ia, ib = np.asarray(a.interference, np.float64), np.asarray(b.interference, np.float64)
        assert_rel_close(ib[task], c**2 * ia[task], 1e-4, what="interference of the scaled task")
        assert_rel_close(ib[other], ia[other] / c**2, 1e-4, what="interference of the other task")


@hypothesis.given(seed=st.integers(0, 2**16), alpha=st.sampled_from([1.0, 0.0, 0.5]))
def test_reparametrising_factors_leaves_scores_unchanged(seed, alpha):
    """(a Q, Q^-1 b) is the same update: every score is unchanged."""
    rng = np.random.default_rng(seed)
    ads = rich_adapters(3)

    def reparam(mod):
        if mod is None:
            return None
        r = mod["lora_a"].shape[1]
        q1, _ = np.linalg.qr(rng.normal(size=(r, r)))
        q2, _ = np.linalg.qr(rng.normal(size=(r, r)))
        q = q1 @ np.diag(rng.uniform(0.5, 2.0, size=r)) @ q2  # condition number <= 4
        out = dict(mod)
        out["lora_a"] = (np.asarray(mod["lora_a"], np.float64) @ q).astype(np.float32)
        out["lora_b"] = (np.linalg.inv(q) @ np.asarray(mod["lora_b"], np.float64)).astype(
            np.float32
        )
        return out

    new = []
    for ad in ads:
        out = ad
        for name, mod in flat_modules(ad).items():
            out = _set(out, name, reparam(mod))
        new.append(out)
    sc = nu.score(ads, alpha=alpha)
    sr = nu.score(new, alpha=alpha)
    assert float(sr.lam) == pytest.approx(float(sc.lam), rel=1e-4)
    for k in sc.modules:
        for f in ("sigma", "benefit", "interference", "utility"):
            x = np.asarray(getattr(sc.modules[k], f))
            y = np.asarray(getattr(sr.modules[k], f))
            np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
            assert_rel_close(y[np.isfinite(x)], x[np.isfinite(x)], 1e-4, what=f"{k}.{f}")


# ------------------------------------------------------------------------------------------------
# Heterogeneity and energies
# ------------------------------------------------------------------------------------------------


def test_task_energies_match_dense(m_tasks):
    ads = rich_adapters(m_tasks)
    e = nu.task_energies(ads)
    assert e.shape == (m_tasks,)
    assert_rel_close(e, ref_task_energies(ads), 1e-5, what="energies")


def test_heterogeneity_matches_dense(m_tasks):
    ads = rich_adapters(m_tasks)
    h = nu.heterogeneity(ads)
    assert h.shape == ()
    assert float(h) == pytest.approx(ref_heterogeneity(ads), rel=1e-4)
    # population variance, not the sample variance
    logs = np.log(ref_task_energies(ads))
    assert float(h) != pytest.approx(float(np.var(logs, ddof=1)), rel=1e-3)


def test_heterogeneity_closed_form():
    """Scales 1 and e^2: log-energies differ by 4, so the population variance is 4."""
    rng = np.random.default_rng(8)
    a, b = rng.normal(size=(16, 2)).astype(np.float32), rng.normal(size=(2, 8)).astype(np.float32)
    ads = [{"m": {"lora_a": a, "lora_b": b, "scale": np.float32(c)}} for c in (1.0, np.e**2)]
    assert float(nu.heterogeneity(ads)) == pytest.approx(4.0, rel=1e-5)


def test_heterogeneity_single_task_is_zero():
    assert float(nu.heterogeneity([rich_adapters(3)[0]])) == 0.0


def test_heterogeneity_rejects_a_task_zero_everywhere():
    rng = np.random.default_rng(9)
    ok = {
        "p": _mod(rng, rng.normal(size=(8, 2)).astype(np.float32), 4),
        "q": _mod(rng, rng.normal(size=(6, 3)).astype(np.float32), 5),
    }
    zero = {
        "p": {"lora_a": np.ones((8, 2), np.float32), "lora_b": np.zeros((2, 4), np.float32)},
        "q": None,
    }
    with pytest.raises(
        ValueError, match=r"nu\.heterogeneity: task 1 has a zero update in every module"
    ):
        nu.heterogeneity([ok, zero, ok])


@pytest.mark.parametrize("scale1, expected_alpha", [(1.2, 1.0), (np.e**2, 0.0)])
def test_alpha_auto_follows_heterogeneity(scale1, expected_alpha):
    rng = np.random.default_rng(10)
    ads = []
    for c in (1.0, scale1):
        ads.append(
            {
                "m": {
                    **_mod(rng, rng.normal(size=(12, 3)).astype(np.float32), 9),
                    "scale": np.float32(c),
                }
            }
        )
    sc = nu.score(ads, alpha="auto")
    assert float(sc.alpha) == expected_alpha
    assert_scores_match(sc, ref_scores(ads, alpha=expected_alpha), RTOL32)


def test_alpha_auto_under_jit():
    """Under a trace the heterogeneity rule is data (before: a ConcretizationTypeError)."""
    rng = np.random.default_rng(10)
    ads = [
        {"m": {**_mod(rng, rng.normal(size=(12, 3)).astype(np.float32), 9), "scale": c}}
        for c in (np.float32(1.0), np.float32(np.e**2))
    ]
    sc = jax.jit(lambda a: nu.score(a, alpha="auto"))(ads)
    assert float(sc.alpha) == 0.0
    assert_scores_match(sc, ref_scores(ads, alpha=0.0), RTOL32)


# ------------------------------------------------------------------------------------------------
# Bad input handled in nu.score
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", ["lora_a", "lora_b"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_factor_names_module_task_array_and_count(factor, value):
    ads = [dict(ad) for ad in rich_adapters(3)]
    name = "layers/1/mlp/up"
    mod = dict(_get(ads[2], name))
    bad = np.array(mod[factor], copy=True)
    bad[1, 1] = value
    bad[2, 3] = value
    mod[factor] = bad
    ads[2] = _set(ads[2], name, mod)
    msg = (
        r"nu\.score: module 'layers/1/mlp/up', task 2 \(lora_a \(10, 4\), lora_b \(4, 20\)\): "
        + factor
        + r" has 2 non-finite entries \(NaN or Inf\) of "
        + ("40" if factor == "lora_a" else "80")
        + r"\. Fix or retrain that adapter\.$"
    )
    with pytest.raises(InputError, match=msg):
        nu.score(ads)
    for fn in (nu.heterogeneity, nu.task_energies):
        with pytest.raises(InputError, match=rf"{fn.__name__}: module 'layers/1/mlp/up', task 2"):
            fn(ads)


def test_nonfinite_count_names_every_affected_pair():
    """NaN in two modules of two tasks: the first is detailed, the others counted."""
    ads = [dict(ad) for ad in rich_adapters(3)]
    for j, name in ((0, "layers/0/attn/query"), (1, "layers/1/mlp/up")):
        mod = dict(_get(ads[j], name))
        mod["lora_b"] = np.full_like(mod["lora_b"], np.nan)
        ads[j] = _set(ads[j], name, mod)
    with pytest.raises(
        InputError,
        match=r"module 'layers/0/attn/query', task 0 .*lora_b has 48 non-finite entries.* In all, "
        r"2 \(module, task\) pairs have such entries, in modules 'layers/0/attn/query', "
        r"'layers/1/mlp/up'\.",
    ):
        nu.score(ads)


def test_float64_factor_beyond_float32_range_is_named():
    """A float64 entry of 1e50 is finite but not a float32: the message says so (x64 keeps it)."""
    rng = np.random.default_rng(21)
    a = rng.normal(size=(8, 2))
    a[3, 1] = 1e50
    ads = [{"m": {"lora_a": a, "lora_b": rng.normal(size=(2, 5))}}, {"m": _mod(rng, a[:, :1], 5)}]
    ads[1]["m"]["lora_a"] = rng.normal(size=(8, 1)).astype(np.float32)
    with pytest.raises(
        InputError,
        match=r"module 'm', task 0 .*lora_a has 1 entry \(largest \|lora_a\| = 1e\+50\) beyond the "
        r"range of float32\. Enable x64",
    ):
        nu.score(ads)
    with pytest.raises(InputError, match=r"scale = 1e\+50 is beyond the range of float32"):
        nu.score([{"m": {**_mod(rng, a[:, :1] * 0 + 1, 5), "scale": 1e50}}])
    with jax.enable_x64(True):  # float64: representable, and the scores are the reference's
        a[3, 1] = 1e50 / 3
        ads64 = [
            {"m": {"lora_a": a, "lora_b": rng.normal(size=(2, 5))}},
            {"m": {"lora_a": a * 1e-50, "lora_b": rng.normal(size=(2, 5))}},
        ]
        assert_scores_match(nu.score(ads64), ref_scores(ads64, eps=F64_EPS), 1e-9)


def _float64_scores_it(ads):
    """The remedy a float32 refusal suggests: the same adapters in float64 score as the float64
    reference."""
    with jax.enable_x64(True):
        ads64 = jax.tree.map(lambda x: np.asarray(x, np.float64), ads)
        assert_scores_match(nu.score(ads64), ref_scores(ads64, eps=F64_EPS), 1e-9)


def test_tasks_of_very_different_size_are_refused_with_the_reason():
    """Interference scales as (s_j / s_i)^2: 1e25 between tasks is 1e50, beyond float32 (and
    1e-50 the other way, below it: task 0's, named first). Before, the float32 Grams overflowed
    and the scores were silently zero/NaN."""
    rng = np.random.default_rng(13)
    big = {"lora_a": np.full((8, 3), 1e25, np.float32), "lora_b": np.ones((3, 6), np.float32)}
    big["lora_a"][:, 1:] += rng.normal(size=(8, 2)).astype(np.float32) * 1e25
    ads = [{"m": _mod(rng, rng.normal(size=(8, 3)).astype(np.float32), 6)}, {"m": big}]
    ref = ref_scores(ads)  # float64: well defined, but beyond float32
    assert ref.modules["m"].interference.max() > 1e40
    with pytest.raises(
        InputError,
        match=r"nu\.score: module 'm': task 0's interference, which grows as the square of the "
        r"ratio of two tasks' update sizes, is beyond the range of float32 .*largest singular "
        r"value about 1e\+2[67] in task 1 \(scale 1\) and 1e\+[01] in task 0 \(scale 1\)\)\. A "
        r"LoRA scale .*enable x64.* In all, 2 \(module, task\) pairs are affected, in module 'm'\.",
    ):
        nu.score(ads)
    _float64_scores_it(ads)


def test_an_interference_below_float32_is_refused_not_zero():
    """The other side of the previous test, found by the slow fuzz tier: a task 1e20 times
    smaller has interferences of about 1e-40 (task 0's directions seen by task 1), below
    float32's normal numbers. Before, they underflowed to 0: lam='auto' then took the median of
    the positive interferences and came out 1e-38 instead of the reference's 4e39 (itself beyond
    float32), and every utility changed, silently. Now refused; float64 scores it."""
    m1 = {
        "lora_a": np.array([[0.34558418, 0.82161814], [0.33043706, -1.3031572]], np.float32),
        "lora_b": np.array([[0.9053559, 0.44637457], [-0.5369532, 0.5811181]], np.float32),
        "scale": 1e-20,
    }
    other = {
        "lora_a": np.array([[0.3645724], [0.2941325]], np.float32),
        "lora_b": np.array([[0.02842224, 0.546713]], np.float32),
        "scale": 1.0,
    }
    empty = {"lora_a": np.zeros((2, 0), np.float32), "lora_b": np.zeros((0, 2), np.float32)}
    ads = [{"m0": empty, "m1": m1}, {"m0": None, "m1": other}]
    ref = ref_scores(ads)
    i0 = ref.modules["m1"].interference[0][ref.modules["m1"].candidate[0]]
    f32 = np.finfo(np.float32)
    assert 0 < i0.max() < float(f32.tiny) and float(ref.lam) > float(f32.max)
    with pytest.raises(
        InputError,
        match=r"nu\.score: module 'm1': task 0's interference, .* is beyond the range of float32 "
        r"\(normal numbers 1\.2e-38 to 3\.4e\+38\).*1e-20 in task 0 \(scale 1e-20\)",
    ):
        nu.score(ads)
    _float64_scores_it(ads)


def test_lora_alpha_1e30_in_one_task_is_refused_not_zero():
    """The issue's case: one task's scale is 1e30 (lora_alpha 1e30 in its PEFT config)."""
    ads = make_adapters(30, 3, SMALL_SPEC)
    ads[0]["q"] = dict(ads[0]["q"], scale=np.float32(1e30))
    with pytest.raises(InputError, match=r"module 'q': task 0's interference.*\(scale 1e\+30\)"):
        nu.score(ads)
    with pytest.raises(InputError, match=r"nu\.score: module 'q'"):
        nu.score(ads, lam=0.5)


@pytest.mark.parametrize("log_scale", [-30, -20, -10, 0, 10, 20, 30])
@pytest.mark.parametrize("alpha", [1.0, 0.0])
def test_any_common_scale_gives_the_float64_result(log_scale, alpha):
    """Every task and module scaled by 10**k: scores equal the float64 reference for k in
    -30..30 (before: the Grams overflowed beyond ~1e19 and underflowed below ~1e-19)."""
    ads = make_adapters(31, 3)
    for ad in ads:
        for name, mod in flat_modules(ad).items():
            if mod is not None:
                _get(ad, name.rsplit("/", 1)[0])[name.rsplit("/", 1)[1]] = dict(
                    mod, scale=np.asarray(mod["scale"] * 10.0**log_scale, np.float32)
                )
    ref = ref_scores(ads, alpha=alpha)
    assert_scores_match(nu.score(ads, alpha=alpha), ref, RTOL32)


def test_large_factor_entries_give_the_float64_result():
    """Factors with entries ~1e20 (and ~1e-20 on the other side): the normalisation is per
    factor, so a, b and scale may each be extreme as long as the update is representable."""
    ads = make_adapters(32, 3, SMALL_SPEC)
    for j, ad in enumerate(ads):
        m = ad["q"]
        ad["q"] = dict(
            m,
            lora_a=np.asarray(m["lora_a"] * 1e20, np.float32),
            lora_b=np.asarray(m["lora_b"] * 1e-18, np.float32),
            scale=np.asarray(m["scale"] * (10.0 ** (j - 1)), np.float32),
        )
    ref = ref_scores(ads)
    assert_scores_match(nu.score(ads), ref, RTOL32)
    assert_rel_close(nu.task_energies(ads), ref_task_energies(ads), 1e-5, what="energies")
    assert float(nu.heterogeneity(ads)) == pytest.approx(ref_heterogeneity(ads), rel=1e-4)
    # under jit the exact route is chosen at run time (lax.cond), with the same result
    assert_scores_match(jax.jit(lambda a: nu.score(a))(ads), ref, RTOL32)


def test_tiny_update_is_refused_not_zero():
    """An update whose singular values are below float32's normal range (1e-40) would be scored
    as if it were absent: refused, naming the task."""
    ads = make_adapters(33, 2, SMALL_SPEC)
    ads[1]["q"] = dict(ads[1]["q"], scale=np.float32(1e-25))
    ads[1]["q"]["lora_a"] = np.asarray(ads[1]["q"]["lora_a"] * 1e-18, np.float32)
    assert ref_scores(ads).modules["q"].sigma[1].max() < 1e-38
    with pytest.raises(
        InputError, match=r"module 'q', task 1: the update's singular values \(largest about 1e-4"
    ):
        nu.score(ads, lam=1.0)


def test_heterogeneity_of_energies_beyond_float32():
    """Energies of 1e60 and more overflow float32, their logs do not: h is exact, and
    nu.task_energies refuses (instead of returning inf)."""
    ads = make_adapters(34, 3, SMALL_SPEC)
    for j, c in enumerate((1e30, 1e25, 1e-20)):
        ads[j]["q"] = dict(ads[j]["q"], scale=np.float32(c))
    logs = np.log(ref_task_energies(ads))
    assert float(nu.heterogeneity(ads)) == pytest.approx(float(np.var(logs)), rel=1e-5)
    with pytest.raises(InputError, match=r"nu\.task_energies: task 0's energy .* about 1e\+6"):
        nu.task_energies(ads)


# Both geometries from one decomposition (the streamed merge's alpha='auto' pass)


def _run_both(ads, **kw):
    kw = {"lam": "auto", "rtol": None, "checked": False, "mesh": None, **kw}
    return scoring_mod.score_run(
        "nu.score", ads, (0.0, 1.0), kw["lam"], kw["rtol"], kw["checked"], kw["mesh"],
        energy=True, defer=kw.get("defer", False),
    )  # fmt: skip


@pytest.mark.parametrize("lam", ["auto", 0.7])
def test_both_geometries_from_one_decomposition_match_dense(m_tasks, lam):
    """Each alpha's scores, from the one shared decomposition, are the dense float64 reference
    and nu.score's own for that alpha; the energies are the dense ||dW_i||_F^2."""
    ads = rich_adapters(m_tasks)
    run = _run_both(ads, lam=lam)
    for alpha, sc in zip((0.0, 1.0), run.scores, strict=True):
        assert float(sc.alpha) == alpha
        ref = (
            rich_reference(m_tasks, alpha)
            if lam == "auto"
            else ref_scores(ads, alpha=alpha, lam=lam)
        )
        assert_scores_match(sc, ref, RTOL32)
        one = nu.score(ads, alpha=alpha, lam=lam)
        np.testing.assert_allclose(float(sc.lam), float(one.lam), rtol=1e-6)
        for name, ms in sc.modules.items():
            for f, x in ms._asdict().items():
                y = np.asarray(getattr(one.modules[name], f))
                np.testing.assert_allclose(np.asarray(x), y, rtol=1e-5, atol=1e-7, err_msg=f)
    k, t = run.energies
    assert_rel_close(t * np.exp2(k.astype(np.float64)), ref_task_energies(ads), 1e-5, what="e")
    assert run.check == []  # not deferred: checked on the way


def test_kernel_energies_beyond_float32_are_exact_as_mantissa_and_power():
    """Energies of 1e60 and 1e-40 (beyond float32) come out as t 2^k, exact to rounding."""
    ads = make_adapters(34, 3, SMALL_SPEC)
    for j, c in enumerate((1e30, 1.0, 1e-20)):
        ads[j]["q"] = dict(ads[j]["q"], scale=np.float32(c))
    k, t = _run_both(ads, lam=1.0, defer=True).energies
    got = np.log2(t) + k
    np.testing.assert_allclose(got, np.log2(ref_task_energies(ads)), rtol=1e-6)


def test_deferred_range_check_raises_what_score_raises():
    """With defer=True nothing is refused during the pass (whether a result fits the dtype can
    depend on alpha); each alpha's check then raises nu.score's error for that alpha."""
    rng = np.random.default_rng(13)
    big = {"lora_a": np.full((8, 3), 1e25, np.float32), "lora_b": np.ones((3, 6), np.float32)}
    big["lora_a"][:, 1:] += rng.normal(size=(8, 2)).astype(np.float32) * 1e25
    ads = [{"m": _mod(rng, rng.normal(size=(8, 3)).astype(np.float32), 6)}, {"m": big}]
    with pytest.raises(InputError, match="interference"):
        _run_both(ads, lam=0.0)  # not deferred: raised at once
    run = _run_both(ads, lam=0.0, defer=True)
    assert len(run.check) == 2
    for alpha, check in zip((0.0, 1.0), run.check, strict=True):
        with pytest.raises(InputError) as want:
            nu.score(ads, alpha=alpha, lam=0.0)
        with pytest.raises(InputError) as got:
            check.check()
        assert str(got.value) == str(want.value)
    # a clean set: the checks pass
    for c in _run_both(rich_adapters(3), defer=True).check:
        c.check()


# Scale safety, property: random per-task scales 10**U(-30, 30)

_PROP_SPEC = (("q", 12, 9, (3, 4, 2)), ("v", 10, 6, (2, 3, 3)))
_F32 = np.finfo(np.float32)


def _representable(ref):
    """+1: every returned float64 quantity is comfortably a normal float32; -1: one clearly is
    not; 0: borderline (either outcome is right)."""
    tiny, fmax = float(_F32.tiny), float(_F32.max)
    vals = [ref.lam] if ref.lam > 0 else []
    for name, m in ref.modules.items():
        c = m.candidate
        if c.any():
            vals += [float(m.sigma[c].min()), float(m.sigma[c].max())]
            vals += [float(m.interference[c].max()), float(np.abs(ref.utility[name][c]).max())]
    # log10 distance of each value inside the normal range (> 0) or outside it (< 0)
    depth = min(min(np.log10(fmax / v), np.log10(v / tiny)) for v in vals if v > 0)
    if depth < -0.05:
        return -1
    return 1 if depth > 0.05 else 0


def _assert_rows_close(lib, ref_mod, ref_u, lam, rtol):
    """Per (module, task) row: sigma and interference relative to the row's largest value (rows
    of different tasks differ by up to 1e60); utility per entry, relative to |b| + lam I."""
    for field in ("sigma", "interference"):
        x = np.asarray(getattr(lib, field), np.float64)
        y = getattr(ref_mod, field)
        for j in range(y.shape[0]):
            top = np.abs(y[j]).max()
            if top > _F32.tiny * 1e3:  # rows below float32's normal range flush to zero
                assert np.abs(x[j] - y[j]).max() <= rtol * top, (field, j, x[j], y[j])
    u = np.asarray(lib.utility, np.float64)
    c = ref_mod.candidate
    np.testing.assert_array_equal(np.isfinite(u), c)
    tol = rtol * (ref_mod.benefit + lam * ref_mod.interference) + lam * _F32.tiny
    assert np.all(np.abs(u[c] - ref_u[c]) <= tol[c]), (u[c], ref_u[c])


def _decided_global(ref_u, scale, k, positive_only, rtol=1e-3):
    """Is the reference's global top-k (with the > 0 rule) decided by more than rounding?"""
    vals = np.concatenate([u[np.isfinite(u)] for u in ref_u.values()])
    err = np.concatenate(
        [s[np.isfinite(u)] for u, s in zip(ref_u.values(), scale.values(), strict=True)]
    )
    order = np.argsort(-vals, kind="stable")
    v, e = vals[order], err[order] * rtol
    if 0 < k < v.size and v[k - 1] - v[k] <= e[k - 1] + e[k]:
        return False
    if positive_only:
        near = np.abs(v[: k + 1]) <= e[: k + 1]
        return not near.any()
    return True


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(
    seed=st.integers(0, 2**16),
    log_scales=st.one_of(
        st.lists(st.floats(-30, 30), min_size=3, max_size=3),
        st.tuples(st.floats(-30, 30), st.lists(st.floats(-4, 4), min_size=3, max_size=3)).map(
            lambda t: [t[0] + x for x in t[1]]
        ),
    ),
    log_factor=st.one_of(st.just(0.0), st.floats(-20, 20)),
    alpha=st.sampled_from([1.0, 0.0]),
    positive_only=st.booleans(),
)
def test_scale_safety_property(seed, log_scales, log_factor, alpha, positive_only):
    """Per-task scales 10**U(-30, 30) (independent, or around a common random level), and factors
    moved by 10**U(-20, 20) between lora_a and lora_b: the float32 scores equal the float64
    reference (dense numpy SVDs) to float32 rounding whenever every returned quantity is a normal
    float32, and nu.score refuses with InputError when one is not; nu.allocate keeps the
    reference's set wherever the reference's decision exceeds rounding. Where float32 cannot
    hold the result, x64 with float64 factors (the remedy the message names) matches to 1e-8."""
    budget = 2  # a static argument of allocate's kernel: one value, one compile
    ads = make_adapters(seed, 3, _PROP_SPEC)
    c = 10.0**log_factor
    for j, ad in enumerate(ads):
        for name, mod in ad.items():
            ad[name] = dict(
                mod,
                lora_a=np.asarray(mod["lora_a"] * c, np.float32),
                lora_b=np.asarray(mod["lora_b"] / c, np.float32),
                scale=np.asarray(mod["scale"] * 10.0 ** log_scales[j], np.float32),
            )
    ref = ref_scores(ads, alpha=alpha)
    verdict = _representable(ref)
    try:
        sc = nu.score(ads, alpha=alpha)
    except InputError as e:
        assert verdict <= 0, "refused a representable input"
        assert re.match(r"nu\.score: .*(beyond|outside) the range of float32", str(e)), str(e)
    else:
        assert verdict >= 0, "returned a result that float32 cannot hold"
        assert float(sc.lam) == pytest.approx(ref.lam, rel=1e-4)
        for name in ref.modules:
            _assert_rows_close(
                sc.modules[name], ref.modules[name], ref.utility[name], ref.lam, 1e-4
            )
        masks = {
            k: np.asarray(v)
            for k, v in nu.allocate(sc, budget, positive_only=positive_only).items()
        }
        terms = {k: m.benefit + ref.lam * m.interference for k, m in ref.modules.items()}
        if _decided_global(ref.utility, terms, budget * len(ref.modules), positive_only):
            expect = ref_allocate(
                ref.utility,
                {k: m.sigma for k, m in ref.modules.items()},
                budget,
                scope="global",
                positive_only=positive_only,
            )
            for k in expect:
                np.testing.assert_array_equal(masks[k], expect[k], err_msg=k)
    if verdict > 0:
        return
    with jax.enable_x64(True):  # the remedy the refusal suggests: float64 holds every case
        ads64 = jax.tree.map(lambda x: np.asarray(x, np.float64), ads)
        ref64 = ref_scores(ads64, alpha=alpha, eps=F64_EPS)
        sc64 = nu.score(ads64, alpha=alpha)
        assert float(sc64.lam) == pytest.approx(ref64.lam, rel=1e-8)
        for name in ref64.modules:
            _assert_rows_close(
                sc64.modules[name], ref64.modules[name], ref64.utility[name], ref64.lam, 1e-8
            )


# Degenerate shapes


def _rank0(d_in=6, d_out=4):
    return {"lora_a": np.zeros((d_in, 0), np.float32), "lora_b": np.zeros((0, d_out), np.float32)}


def test_all_rank_zero_adapters():
    """Rank-0 factors are a zero update: no candidates. lam='auto' is then undefined (clear
    error, before: ZeroDivisionError); a given lam gives -inf utilities, nothing is kept."""
    ads = [{"q": _rank0(), "v": _rank0(5, 3)} for _ in range(3)]
    with pytest.raises(
        InputError, match=r"nu\.score: no candidate directions.*lam='auto'.*undefined.*lam="
    ):
        nu.score(ads)
    sc = nu.score(ads, lam=0.5)
    assert float(sc.lam) == 0.5
    for ms in sc.modules.values():
        assert ms.utility.shape == (3, 0) and ms.sigma.shape == (3, 0)
    for scope in ("global", "local", "uniform"):
        masks = nu.allocate(sc, 2, scope=scope)
        assert all(m.shape == (3, 0) for m in masks.values())
    with pytest.raises(InputError, match=r"nu\.heterogeneity: task 0 has a zero update"):
        nu.heterogeneity(ads)
    np.testing.assert_array_equal(np.asarray(nu.task_energies(ads)), np.zeros(3))


def test_rank_zero_task_next_to_real_ones():
    """A task with rank 0 in one module is like a zero update there; a module of rank 0 in every
    task sits next to scored modules."""
    ads = make_adapters(35, 3, SMALL_SPEC)
    ads[1]["q"] = _rank0(12, 9)
    for ad in ads:
        ad["dead"] = _rank0()
        # d_in = 0: an empty update whatever the rank
        ad["no_inputs"] = {
            "lora_a": np.zeros((0, 2), np.float32),
            "lora_b": np.ones((2, 3), np.float32),
        }
    sc = nu.score(ads)
    assert np.all(np.asarray(sc.modules["no_inputs"].utility) == -np.inf)
    assert sc.modules["no_inputs"].utility.shape == (3, 2)
    ref = ref_scores([{"q": ad["q"]} for ad in ads])
    assert np.all(np.asarray(sc.modules["q"].utility)[1] == -np.inf)
    assert_scores_match(nu.Scores({"q": sc.modules["q"]}, sc.lam, sc.alpha), ref, RTOL32)
    assert sc.modules["dead"].utility.shape == (3, 0)
    masks = nu.allocate(sc, 2, scope="local", positive_only=False)
    assert int(np.asarray(masks["q"]).sum()) == 2 and masks["dead"].shape == (3, 0)


def test_no_candidates_with_lam_given_keeps_nothing():
    zero = {"lora_a": np.ones((8, 3), np.float32), "lora_b": np.zeros((3, 6), np.float32)}
    ads = [{"m": zero, "n": zero}, {"m": zero, "n": None}]
    with pytest.raises(InputError, match=r"nu\.score: no candidate directions"):
        nu.score(ads)
    sc = nu.score(ads, lam=0.5)
    for ms in sc.modules.values():
        assert np.all(np.asarray(ms.utility) == -np.inf) and np.all(np.asarray(ms.sigma) == 0)
    for scope in ("global", "local", "uniform"):
        for pos in (True, False):
            assert not any(
                np.asarray(m).any()
                for m in nu.allocate(sc, 3, scope=scope, positive_only=pos).values()
            )


# Options: types and values


@pytest.mark.parametrize("alpha", [-0.5, -1e-9, np.nan, np.inf, -np.inf])
def test_bad_alpha_value(alpha):
    with pytest.raises(
        InputError, match=r"nu\.score: alpha=.*; expected a finite number >= 0 .* or 'auto'\.$"
    ):
        nu.score(rich_adapters(3), alpha=alpha)


@pytest.mark.parametrize(
    "alpha, shown",
    [
        (True, r"True \(bool\)"),
        (1j, r"1j \(complex\)"),
        (None, r"None \(NoneType\)"),
        ([1.0], r"\[1\.0\] \(list\)"),
        (np.ones(2), r"<ndarray of shape \(2,\), dtype float64> \(ndarray\)"),
    ],
)
def test_alpha_of_the_wrong_type(alpha, shown):
    with pytest.raises(
        InputTypeError, match=rf"nu\.score: alpha={shown}; expected a finite number"
    ):
        nu.score(rich_adapters(3), alpha=alpha)


def test_unknown_alpha_string():
    with pytest.raises(InputError, match=r"nu\.score: alpha='gram'; expected a finite number >= 0"):
        nu.score(rich_adapters(3), alpha="gram")


@pytest.mark.parametrize("lam", ["median", "AUTO", ""])
def test_unknown_lam_string(lam):
    with pytest.raises(
        InputError,
        match=rf"nu\.score: lam='{lam}'; expected a finite number >= 0 \(the "
        r"interference weight\) or 'auto'\.$",
    ):
        nu.score(rich_adapters(3), lam=lam)


@pytest.mark.parametrize("lam", [np.nan, np.inf, -1, -1e-9, np.float32(-2)])
def test_bad_lam_value(lam):
    """lam < 0 rewards interference: refused, as the CLI does (before: accepted)."""
    with pytest.raises(InputError, match=r"nu\.score: lam=.*; expected a finite number >= 0"):
        nu.score(rich_adapters(3), lam=lam)


@pytest.mark.parametrize("lam", [True, 1 + 0j, None, "0.5 ", [0.5]])
def test_lam_of_the_wrong_type(lam):
    err = InputError if isinstance(lam, str) else InputTypeError
    with pytest.raises(err, match=r"nu\.score: lam="):
        nu.score(rich_adapters(3), lam=lam)


@pytest.mark.parametrize("lam", [0, 2, np.float32(0.25), np.int64(1), np.asarray(0.5)])
def test_lam_of_any_real_type(lam):
    ads = rich_adapters(3)
    assert_scores_match(nu.score(ads, lam=lam), ref_scores(ads, lam=float(lam)), RTOL32)


@pytest.mark.parametrize("rtol", [-0.1, 1.0, 2.0, np.nan])
def test_bad_rtol(rtol):
    with pytest.raises(InputError, match=r"nu\.score: rtol=.*expected 0 <= rtol < 1"):
        nu.score(rich_adapters(3), rtol=rtol)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"rtol": "0.1"}, InputTypeError, r"rtol='0\.1' \(str\); expected None or a number"),
        ({"h_threshold": np.nan}, InputError, r"h_threshold=nan; expected a finite number"),
        ({"h_threshold": "1"}, InputTypeError, r"h_threshold='1' \(str\); expected a finite"),
        ({"checked": "no"}, InputTypeError, r"checked='no' \(str\); expected True or False"),
        ({"checked": 1}, InputTypeError, r"checked=1 \(int\); expected True or False"),
    ],
)
def test_other_options_are_checked(kw, err, match):
    with pytest.raises(err, match=rf"nu\.score: {match}"):
        nu.score(rich_adapters(3), **kw)
    if "checked" in kw:
        for fn in (nu.heterogeneity, nu.task_energies):
            with pytest.raises(err, match=match):
                fn(rich_adapters(3), **kw)


@pytest.mark.parametrize(
    "scale, err, match",
    [
        ("2.0", InputTypeError, r"scale of module 'q', task 1, is '2\.0' \(str\); expected a real"),
        (True, InputTypeError, r"scale of module 'q', task 1, is True \(bool\); expected a real"),
        (2j, InputTypeError, r"scale of module 'q', task 1, is 2j \(complex\); expected a real"),
        (None, InputTypeError, r"scale of module 'q', task 1, is None \(NoneType\)"),
        (np.asarray("2"), InputTypeError, r"scale of module 'q', task 1, is .*dtype <U1"),
    ],
)
def test_scale_of_the_wrong_type_names_module_and_task(scale, err, match):
    ads = make_adapters(36, 2, SMALL_SPEC)
    ads[1]["q"] = dict(ads[1]["q"], scale=scale)
    for fn in (nu.score, nu.heterogeneity, nu.task_energies):
        with pytest.raises(err, match=rf"nu\.{fn.__name__}: {match}"):
            fn(ads)


@pytest.mark.parametrize("scale", [2, np.int32(3), np.float16(0.5), jnp.asarray(1.5)])
def test_scale_of_any_real_type(scale):
    ads = make_adapters(37, 2, SMALL_SPEC)
    ads[1]["q"] = dict(ads[1]["q"], scale=scale)
    assert_scores_match(nu.score(ads), ref_scores(ads), RTOL32)


def _many(n, lora_b, prefix="layer"):
    rng = np.random.default_rng(38)
    a = rng.normal(size=(4, 1)).astype(np.float32)
    return {f"{prefix}{i:04d}": {"lora_a": a, "lora_b": lora_b} for i in range(n)}


@pytest.mark.slow  # 6 s; test_fuzz and test_cli check short messages on smaller sets
def test_messages_stay_short_with_2000_bad_modules():
    """Every one of 2,000 modules is bad: messages show a few names and a count. (Errors found
    by the kernel are checked with 200 modules: compiling 2,000 modules takes half a minute.)"""
    b = np.ones((1, 3), np.float32)
    nan_b = np.full((1, 3), np.nan, np.float32)
    cases = [
        (lambda: nu.score([_many(2000, b), _many(2000, b, "other")]), r"and 1997 more that task"),
        (
            lambda: nu.score([_many(200, b), _many(200, nan_b)]),
            r"In all, 200 \(module, task\) pairs have such entries, in modules 'layer0000', "
            r"'layer0001', 'layer0002' and 197 more\.$",
        ),
        (lambda: nu.heterogeneity([_many(200, nan_b), _many(200, b)]), r"and 197 more\.$"),
    ]
    for call, match in cases:
        with pytest.raises(InputError, match=match) as info:
            call()
        assert len(str(info.value)) < 600, len(str(info.value))
    long_name = "x" * 50_000
    a = np.ones((4, 1), np.float32)
    with pytest.raises(InputTypeError, match=r"module 'xxx.*\.\.\.xxx+', task 0") as info:
        nu.score([{long_name: {"lora_a": a, "lora_b": b, "scale": "1"}}])
    assert len(str(info.value)) < 400
    with pytest.raises(
        InputError,
        match=r"lacks module 'x{40}\.\.\.x{37}' that task 0 has; task 1 has module 'y{40}\.\.\.",
    ) as info:
        nu.score(
            [{long_name: {"lora_a": a, "lora_b": b}}, {"y" * 50_000: {"lora_a": a, "lora_b": b}}]
        )
    assert len(str(info.value)) < 600


# Checks under jit: checkify


_TWO_SPEC = (("q", 12, 9, (3, 4, 2)), ("v", 10, 6, (2, 3, 3)))


def _nan_adapters():
    ads = jax.tree.map(jnp.asarray, make_adapters(39, 3, _TWO_SPEC))
    ads[2]["v"] = dict(ads[2]["v"], lora_a=ads[2]["v"]["lora_a"].at[0, 1].set(jnp.nan))
    return ads


def test_traced_scores_of_nan_input_are_nan_not_plausible():
    """Under jit nothing can raise: the module with the NaN input is NaN, and lam='auto' too;
    the other modules are scored normally."""
    ads = _nan_adapters()
    sc = jax.jit(lambda a: nu.score(a))(ads)
    assert np.isnan(float(sc.lam))
    assert np.all(np.isnan(np.asarray(sc.modules["v"].utility)))
    sc = jax.jit(lambda a: nu.score(a, lam=0.5))(ads)
    assert np.all(np.isnan(np.asarray(sc.modules["v"].utility)))
    ref = ref_scores([{"q": jax.tree.map(np.asarray, ad["q"])} for ad in ads], lam=0.5)
    assert_scores_match(nu.Scores({"q": sc.modules["q"]}, sc.lam, sc.alpha), ref, RTOL32)
    assert np.isnan(float(jax.jit(nu.heterogeneity)(ads)))


def test_checked_score_under_checkify_and_jit():
    ads = _nan_adapters()
    f = checkify.checkify(jax.jit(lambda a: nu.score(a, checked=True)))
    err, _ = f(ads)
    assert re.search(
        r"nu\.score: lora_a of task 2 in module #1 \(its position in the adapters' module "
        r"order\) has 1 non-finite entries",
        err.get(),
    )
    with pytest.raises(checkify.JaxRuntimeError, match=r"nu\.score: lora_a of task 2"):
        err.throw()
    err, _ = f(jax.tree.map(jnp.asarray, make_adapters(39, 3, _TWO_SPEC)))
    assert err.get() is None
    # unrepresentable results are reported too
    big = jax.tree.map(jnp.asarray, make_adapters(40, 3, SMALL_SPEC))
    big[0]["q"] = dict(big[0]["q"], scale=jnp.float32(1e30))
    err, _ = checkify.checkify(jax.jit(lambda a: nu.score(a, checked=True)))(big)
    assert re.search(r"nu\.score: the interference of task 0 in module #0", err.get())
    err, _ = checkify.checkify(jax.jit(lambda a: nu.heterogeneity(a, checked=True)))(ads)
    assert "nu.heterogeneity: a factor or scale has 1 non-finite entries" in err.get()
    # without checked=True the traced call does not check (nothing to functionalize)
    err, _ = checkify.checkify(jax.jit(lambda a: nu.score(a)))(ads)
    assert err.get() is None


# ------------------------------------------------------------------------------------------------
# Compilation and jit
# ------------------------------------------------------------------------------------------------


class _CompileCounter:
    """Counts XLA backend compilations through a jax.monitoring listener."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.n = 0

    def __call__(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.n += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def test_score_does_not_recompile():
    spec = (("x", 7, 5, (2, 3, 2)), ("z", 7, 5, (3, 2, 2)))
    nu.score(make_adapters(0, 3, spec))  # compile (shapes used nowhere else)
    n0 = kernels_mod.score_impl._cache_size()
    with _CompileCounter() as cc:
        sc = nu.score(make_adapters(1, 3, spec))
        jax.block_until_ready(sc)
    assert cc.n == 0
    assert kernels_mod.score_impl._cache_size() == n0
    # float alpha / lam values are traced, not static: one compile for the float-lam variant only
    nu.score(make_adapters(1, 3, spec), alpha=0.3, lam=0.2)
    n1 = kernels_mod.score_impl._cache_size()
    with _CompileCounter() as cc:
        for alpha, lam in [(0.0, 1.5), (0.7, 0.01), (1.0, 3.0)]:
            jax.block_until_ready(nu.score(make_adapters(2, 3, spec), alpha=alpha, lam=lam))
        for alpha in (0.0, 0.25):
            jax.block_until_ready(nu.score(make_adapters(2, 3, spec), alpha=alpha))
    assert cc.n == 0
    assert kernels_mod.score_impl._cache_size() == n1


def test_heterogeneity_does_not_recompile():
    spec = (("x", 7, 5, (2, 3, 2)), ("y", 9, 4, (3, 3, 1)))
    nu.heterogeneity(make_adapters(0, 3, spec))
    with _CompileCounter() as cc:
        jax.block_until_ready(nu.heterogeneity(make_adapters(1, 3, spec)))
    assert cc.n == 0


def test_score_under_outer_jit():
    ads = jax.tree.map(jnp.asarray, rich_adapters(3))
    f = jax.jit(lambda a, al: nu.score(a, alpha=al))
    for alpha in (1.0, 0.5):
        eager = nu.score(ads, alpha=alpha)
        jitted = f(ads, alpha)
        assert_scores_match(jitted, rich_reference(3, alpha), RTOL32)
        for k in eager.modules:
            for fld in ("sigma", "benefit", "interference", "utility"):
                x = np.asarray(getattr(eager.modules[k], fld))
                y = np.asarray(getattr(jitted.modules[k], fld))
                np.testing.assert_array_equal(np.isfinite(x), np.isfinite(y))
                np.testing.assert_allclose(
                    y[np.isfinite(x)], x[np.isfinite(x)], rtol=1e-5, atol=1e-7
                )
    # a traced lam as well
    jl = jax.jit(lambda a, lam: nu.score(a, alpha=0.5, lam=lam))(ads, 0.4)
    assert_scores_match(jl, ref_scores(rich_adapters(3), alpha=0.5, lam=0.4), RTOL32)


# ------------------------------------------------------------------------------------------------
# Strict dtype promotion (see conftest.py)
# ------------------------------------------------------------------------------------------------


def test_strict_promotion_float32():
    ads = make_adapters(14, 4, SMALL_SPEC)
    with jax.numpy_dtype_promotion("strict"):
        sc = nu.score(ads, alpha=0.5)
        sc_l = nu.score(ads, lam=0.3)
        h = nu.heterogeneity(ads)
        for scope in ("global", "local", "uniform"):
            nu.allocate(sc, 3, scope=scope)
    assert_scores_match(sc, ref_scores(ads, alpha=0.5), RTOL32)
    assert float(sc_l.lam) == pytest.approx(0.3)
    assert float(h) == pytest.approx(ref_heterogeneity(ads), rel=1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_strict_promotion_low_precision(dtype):
    ads = jax.tree.map(lambda x: jnp.asarray(x, dtype), make_adapters(14, 4, SMALL_SPEC))
    with jax.numpy_dtype_promotion("strict"):
        sc = nu.score(ads)
        e = nu.task_energies(ads)
    assert sc.modules["q"].sigma.dtype == jnp.float32
    assert e.dtype == jnp.float32


def test_strict_promotion_float64_x64():
    with jax.enable_x64(True):
        ads = make_adapters(14, 4, SMALL_SPEC, dtype=np.float64)
        with jax.numpy_dtype_promotion("strict"):
            sc = nu.score(ads)
            e = nu.task_energies(ads)
            for scope in ("global", "local", "uniform"):
                nu.allocate(sc, 3, scope=scope)
        assert sc.modules["q"].sigma.dtype == jnp.float64
        assert e.dtype == jnp.float64


# ------------------------------------------------------------------ the kernel's Grams from leaves

_buckets_mod = importlib.import_module("netutility_jax._core.buckets")
_grams_mod = importlib.import_module("netutility_jax.scoring._grams")
_tree_mod = importlib.import_module("netutility_jax._core.tree")

# 6 modules (one bucket, ranks differing between tasks, a task lacking one) and a second bucket
LEAF_SPEC = (
    *((f"layers/{i}/q", 40, 24, (3, 5, None if i == 2 else 4)) for i in range(6)),
    ("layers/0/o", 24, 40, (2, 2, 5)),
)


def _leaf_and_stacked_grams(ads, route):
    """Each bucket's kernel Grams from its leaves (as nu.score) and from its stacked factors."""
    _, buckets, _ = _tree_mod.collect(ads, fn="t")
    out = []
    for bk in buckets:
        a, b, s = _buckets_mod.bucket_arrays(bk)
        kw = {"d_in": bk.d_in, "d_out": bk.d_out, "r_max": bk.r_max, "dtype": jnp.float32}

        def leaf(a, b, s, kw=kw):
            scale, _ = _buckets_mod.scales_ranks(a, s, jnp.float32)
            leaves = _buckets_mod.Leaves(a, b, kw["d_in"], kw["d_out"], kw["r_max"], jnp.float32)
            return _grams_mod.grams(leaves, None, scale, route)

        def stacked(a, b, s, kw=kw):
            A, B, S, _ = _buckets_mod.stack_bucket(a, b, s, **kw)
            return _grams_mod.grams(A, B, S, route)

        out.append((jax.jit(leaf)(a, b, s), jax.jit(stacked)(a, b, s)))
    return out


@pytest.mark.parametrize(
    ("route", "group_bytes"), [("raw", None), ("raw", 1), ("normalise", None), ("cond", 1)]
)
def test_leaf_grams_are_the_stacked_grams_bit_for_bit(monkeypatch, route, group_bytes):
    # nu.score reads the leaves a group of modules at a time; the mesh and streamed paths pass
    # the factors stacked: both must give the same bits (their scores are compared exactly)
    if group_bytes is not None:  # one module per group
        monkeypatch.setattr(_grams_mod, "_GROUP_BYTES", group_bytes)
    ads = make_adapters(3, 3, LEAF_SPEC)
    for leaf, stacked in _leaf_and_stacked_grams(ads, route):
        for f, x, y in zip(leaf._fields, leaf, stacked, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f)


def test_leaf_grams_equal_the_float64_products():
    # g' = a'^T a' with a'_i = a_i 2^-e_i, e_i the exponent of max |a_i| (largest entry in [0.5, 1))
    ads = make_adapters(4, 3, LEAF_SPEC)
    _, buckets, _ = _tree_mod.collect(ads, fn="t")
    for bk, (leaf, _) in zip(buckets, _leaf_and_stacked_grams(ads, "raw"), strict=True):
        for n, mods in enumerate(bk.modules):
            a = [np.zeros((bk.d_in, bk.r_max)) for _ in mods]
            for i, m in enumerate(mods):
                if m is not None:
                    x = np.asarray(m.lora_a, np.float64)
                    a[i][:, : x.shape[1]] = x * 2.0 ** -np.frexp(np.abs(x).max())[1]
            x = np.concatenate(a, 1)
            ref = (x.T @ x).reshape(len(mods), bk.r_max, len(mods), bk.r_max)
            got = np.asarray(leaf.g[n], np.float64)
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())


def test_score_kernel_keeps_one_group_of_stacked_factors_in_memory(monkeypatch):
    # a bucket of device factors too large to copy (here: any, the cap set to 0) keeps its
    # leaves, and the Grams come from them a group at a time, chained through data: XLA's
    # temporary memory holds about one group's stacked copy, not the bucket's
    # (smaller buckets are stacked before the program, see
    # test_numpy_factors_are_handed_over_stacked_and_score_the_same_bits)
    monkeypatch.setattr(stacking_mod, "DEVICE_STACK_BYTES", 0)
    spec = tuple((f"layers/{i}/q", 2048, 256, (16, 16, 16, 16)) for i in range(24))
    ads = jax.device_put(make_adapters(0, 4, spec, with_scale=False))
    _, buckets, _ = _tree_mod.collect(ads, fn="t")
    dtype = jnp.float32
    meta = (dtype, tuple((bk.d_in, bk.d_out, bk.r_max) for bk in buckets))
    inputs = scoring_mod.score_inputs("t", buckets, dtype, None)
    rtols = tuple(jnp.asarray(utility_mod.default_rtol(bk.r_max, dtype), dtype) for bk in buckets)
    compiled = kernels_mod.score_impl.lower(
        inputs, jnp.asarray(1.0, dtype), 0.0, rtols, meta=meta, lam_is_auto=True
    ).compile()
    factors = sum(np.asarray(x).nbytes for x in jax.tree.leaves(ads) if np.ndim(x) == 2)
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < factors / 4, (temp, factors)


def test_numpy_factors_are_handed_over_stacked_and_score_the_same_bits(monkeypatch):
    # numpy factors (a PEFT folder's, a streamed chunk's) are stacked on the host, device ones
    # on their device: four arguments per bucket whatever the number of modules, and the same
    # bits as each other and as the leaves a bucket too large to copy keeps
    def n_args(ads):
        _, buckets, _ = _tree_mod.collect(ads, fn="t")
        inputs = scoring_mod.score_inputs("t", buckets, jnp.float32, None)
        return len(jax.tree.leaves(inputs)), len(buckets)

    small, large = make_adapters(5, 3, LEAF_SPEC[:3]), make_adapters(5, 3, LEAF_SPEC)
    (k_small, b_small), (k_large, b_large) = n_args(small), n_args(large)
    assert k_small == 4 * b_small and k_large == 4 * b_large, (k_small, k_large)
    dev = jax.device_put(large)
    assert n_args(dev) == (4 * b_large, b_large)
    sc, sc_dev = nu.score(large), nu.score(dev)
    monkeypatch.setattr(stacking_mod, "DEVICE_STACK_BYTES", 0)
    assert n_args(dev)[0] > 4 * b_large  # above the cap: leaves (read a group at a time)
    sc_leaves = nu.score(dev)
    for other in (sc_dev, sc_leaves):
        for n, ms in sc.modules.items():
            for f, x, y in zip(ms._fields, ms, other.modules[n], strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{n} {f}")
        np.testing.assert_array_equal(np.asarray(sc.lam), np.asarray(other.lam))


def test_one_device_mesh_scores_are_the_plain_scores_bit_for_bit():
    # the mesh path stacks the factors on the host (the streamed merge too); nu.score reads the
    # leaves: the Grams are the same product, so the scores are the same bits
    ads = make_adapters(5, 3, LEAF_SPEC)
    sc, sc_m = nu.score(ads), nu.score(ads, mesh=nu.module_mesh())
    for n, ms in sc.modules.items():
        for f, x, y in zip(ms._fields, ms, sc_m.modules[n], strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{n} {f}")
    np.testing.assert_array_equal(np.asarray(sc.lam), np.asarray(sc_m.lam))
