"""nu.allocate against the reference allocation written from the API.md definitions."""

from __future__ import annotations

import importlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import (
    np_masks,
    ref_allocate,
    ref_scores,
    rich_adapters,
    rich_reference,
    selection_margin,
)

import netutility_jax as nu

allocate_mod = importlib.import_module("netutility_jax.allocate")

SCOPES = ["global", "local", "uniform"]
BUDGETS = [1, 3, 8, 100]  # 100 > every module's (and the whole adapter's) candidate count
MARGIN = 1e-4  # float32 scores decide like float64 ones when the deciding gap is larger than this


def _lib_arrays(sc):
    u = {k: np.asarray(m.utility, np.float64) for k, m in sc.modules.items()}
    s = {k: np.asarray(m.sigma, np.float64) for k, m in sc.modules.items()}
    return u, s


def _scores(utility: dict, sigma: dict) -> nu.Scores:
    """Hand-built nu.Scores (benefit / interference are not read by allocate)."""
    mods = {
        k: nu.ModuleScores(
            jnp.asarray(sigma[k], jnp.float32),
            jnp.zeros(np.shape(sigma[k]), jnp.float32),
            jnp.zeros(np.shape(sigma[k]), jnp.float32),
            jnp.asarray(utility[k], jnp.float32),
        )
        for k in utility
    }
    return nu.Scores(mods, jnp.asarray(1.0), jnp.asarray(1.0))


def _assert_masks_equal(lib, ref, what=""):
    lib = np_masks(lib)
    assert list(lib) == list(ref), what
    for k in ref:
        assert lib[k].dtype == np.bool_, (what, k, lib[k].dtype)
        np.testing.assert_array_equal(lib[k], ref[k], err_msg=f"{what} {k}")


# ------------------------------------------------------------------------------------------------
# Against the reference, on real scores
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("positive_only", [True, False])
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("alpha", [1.0, 0.0, 0.5])
def test_allocate_matches_reference(m_tasks, alpha, scope, positive_only):
    sc = nu.score(rich_adapters(m_tasks), alpha=alpha)
    ref = rich_reference(m_tasks, alpha)
    ref_sigma = {k: m.sigma for k, m in ref.modules.items()}
    lib_u, lib_s = _lib_arrays(sc)
    n_end_to_end = 0
    for budget in BUDGETS:
        masks = nu.allocate(sc, budget, scope=scope, positive_only=positive_only)
        what = f"budget={budget}"
        for k, m in masks.items():
            assert isinstance(m, jax.Array) and m.shape == sc.modules[k].utility.shape
        # the selection rule, exactly, on the library's own scores
        _assert_masks_equal(
            masks,
            ref_allocate(lib_u, lib_s, budget, scope=scope, positive_only=positive_only),
            what,
        )
        # end to end against the float64 reference, where float32 rounding cannot flip a decision
        if (
            selection_margin(
                ref.utility, ref_sigma, budget, scope=scope, positive_only=positive_only
            )
            > MARGIN
        ):
            n_end_to_end += 1
            _assert_masks_equal(
                masks,
                ref_allocate(
                    ref.utility, ref_sigma, budget, scope=scope, positive_only=positive_only
                ),
                what + " (reference scores)",
            )
    assert n_end_to_end >= 2


@pytest.mark.parametrize("budget", [1, 3, 8, 100])
def test_budget_spent_exactly_without_positive_only(budget):
    sc = nu.score(rich_adapters(4))
    n_cand = {k: int(np.isfinite(np.asarray(m.utility)).sum()) for k, m in sc.modules.items()}
    n_mod = len(n_cand)
    g = np_masks(nu.allocate(sc, budget, scope="global", positive_only=False))
    assert sum(int(m.sum()) for m in g.values()) == min(budget * n_mod, sum(n_cand.values()))
    for scope in ("local", "uniform"):
        masks = np_masks(nu.allocate(sc, budget, scope=scope, positive_only=False))
        for k, m in masks.items():
            assert int(m.sum()) == min(budget, n_cand[k]), (scope, k)
    # uniform ignores positive_only
    _assert_masks_equal(
        nu.allocate(sc, budget, scope="uniform", positive_only=True),
        np_masks(nu.allocate(sc, budget, scope="uniform", positive_only=False)),
    )


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8])
def test_lam_zero_global_selects_top_benefits(budget):
    """With lam = 0 the utility is the benefit: global picks the top L*R normalized energies."""
    ads = rich_adapters(4)
    sc = nu.score(ads, lam=0.0)
    ref = ref_scores(ads, lam=0.0)
    ben = {k: np.where(m.candidate, m.benefit, -np.inf) for k, m in ref.modules.items()}
    flat = np.sort(np.concatenate([b[np.isfinite(b)] for b in ben.values()]))[::-1]
    k = budget * len(ben)
    assert abs(flat[k - 1] - flat[k]) > MARGIN * flat[0]  # no near-tie at the boundary
    expected = {n: b >= flat[k - 1] for n, b in ben.items()}
    _assert_masks_equal(nu.allocate(sc, budget, scope="global"), expected)


# ------------------------------------------------------------------------------------------------
# Hand-built scores with known answers
# ------------------------------------------------------------------------------------------------

NEG = -np.inf
HAND_U = {
    "A": np.array([[5.0, -1.0, NEG], [0.5, 2.0, NEG]]),
    "B": np.array([[3.0, 0.0], [NEG, 1.0]]),
}
HAND_S = {  # sigma: descending per task, 0 on non-candidates (not read by global / local)
    "A": np.array([[4.0, 1.0, 0.0], [3.0, 2.0, 0.0]]),
    "B": np.array([[2.0, 1.0], [0.0, 5.0]]),
}


@pytest.mark.parametrize(
    "budget, positive_only, expected",
    [
        # L = 2 modules: budget R keeps the top 2R
        (1, True, {"A": [[1, 0, 0], [0, 0, 0]], "B": [[1, 0], [0, 0]]}),
        (2, True, {"A": [[1, 0, 0], [0, 1, 0]], "B": [[1, 0], [0, 1]]}),
        (3, True, {"A": [[1, 0, 0], [1, 1, 0]], "B": [[1, 0], [0, 1]]}),  # 0.0 is not > 0
        (3, False, {"A": [[1, 0, 0], [1, 1, 0]], "B": [[1, 1], [0, 1]]}),
        (5, True, {"A": [[1, 0, 0], [1, 1, 0]], "B": [[1, 0], [0, 1]]}),
        (5, False, {"A": [[1, 1, 0], [1, 1, 0]], "B": [[1, 1], [0, 1]]}),  # never a -inf slot
    ],
)
def test_global_hand_built(budget, positive_only, expected):
    masks = nu.allocate(
        _scores(HAND_U, HAND_S), budget, scope="global", positive_only=positive_only
    )
    _assert_masks_equal(masks, {k: np.array(v, bool) for k, v in expected.items()})


@pytest.mark.parametrize(
    "budget, positive_only, expected",
    [
        (1, True, {"A": [[1, 0, 0], [0, 0, 0]], "B": [[1, 0], [0, 0]]}),
        (2, True, {"A": [[1, 0, 0], [0, 1, 0]], "B": [[1, 0], [0, 1]]}),
        (3, True, {"A": [[1, 0, 0], [1, 1, 0]], "B": [[1, 0], [0, 1]]}),
        (3, False, {"A": [[1, 0, 0], [1, 1, 0]], "B": [[1, 1], [0, 1]]}),
        (4, False, {"A": [[1, 1, 0], [1, 1, 0]], "B": [[1, 1], [0, 1]]}),
    ],
)
def test_local_hand_built(budget, positive_only, expected):
    masks = nu.allocate(_scores(HAND_U, HAND_S), budget, scope="local", positive_only=positive_only)
    _assert_masks_equal(masks, {k: np.array(v, bool) for k, v in expected.items()})


# Uniform: task 0 sigma (4, 3, 2, 1), energy shares (16, 9, 4, 1) / 30; task 1 one candidate
# (share 1); task 2 sigma (5, 1), shares (25, 1) / 26. Utilities are all negative: uniform ignores
# them (and positive_only).
UNI_S = {"m": np.array([[4.0, 3.0, 2.0, 1.0], [1.0, 0, 0, 0], [5.0, 1.0, 0, 0]])}
UNI_U = {"m": np.where(UNI_S["m"] > 0, -1.0 - np.arange(12).reshape(3, 4) / 10, NEG)}


@pytest.mark.parametrize(
    "budget, expected",
    [
        # floor(2/3) = 0 each; leftovers by share: task 1 (1.0), then task 2 (25/26)
        (2, [[0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]]),
        # 1 each; leftovers: task 0's 9/30 beats task 2's 1/26, then task 0's 4/30
        (5, [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0]]),
        # 2 each (task 1 has only 1): 5 spent; leftovers 2 -> task 0 (4/30, then 1/30)
        (7, [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]),
        # more than the 7 candidates: all of them
        (9, [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]),
        # 3 // 3 = 1 each, nothing left over: task 0 keeps only its first despite its large shares
        (3, [[1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]]),
    ],
)
@pytest.mark.parametrize("positive_only", [True, False])
def test_uniform_hand_built(budget, expected, positive_only):
    masks = nu.allocate(_scores(UNI_U, UNI_S), budget, scope="uniform", positive_only=positive_only)
    _assert_masks_equal(masks, {"m": np.array(expected, bool)})
    _assert_masks_equal(
        masks, ref_allocate(UNI_U, UNI_S, budget, scope="uniform", positive_only=positive_only)
    )


def test_positive_only_with_nothing_positive_keeps_nothing():
    u = {"A": np.where(HAND_S["A"] > 0, -1.0 - HAND_S["A"], NEG)}
    sc = _scores(u, {"A": HAND_S["A"]})
    for scope in ("global", "local"):
        assert not np.asarray(nu.allocate(sc, 3, scope=scope)["A"]).any()
        assert int(np.asarray(nu.allocate(sc, 3, scope=scope, positive_only=False)["A"]).sum()) == 3


@st.composite
def _random_scores(draw):
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    utility, sigma = {}, {}
    for name, r in (("a", 4), ("b", 6), ("c", 4)):
        n_cand = rng.integers(0, r + 1, size=3)
        n_cand[rng.integers(0, 3)] = max(1, n_cand.max())  # at least one candidate per module
        s = np.zeros((3, r))
        u = np.full((3, r), NEG)
        for j in range(3):
            s[j, : n_cand[j]] = np.sort(rng.uniform(0.1, 5.0, size=n_cand[j]))[::-1]
            u[j, : n_cand[j]] = rng.normal(size=n_cand[j])
        utility[name], sigma[name] = u, s
    return utility, sigma


@hypothesis.given(
    data=_random_scores(),
    budget=st.sampled_from([1, 2, 5, 9]),
    scope=st.sampled_from(SCOPES),
    positive_only=st.booleans(),
)
def test_allocate_matches_reference_on_random_scores(data, budget, scope, positive_only):
    utility, sigma = data
    # the reference reads float32-rounded values, as the library does
    u32 = {k: v.astype(np.float32).astype(np.float64) for k, v in utility.items()}
    s32 = {k: v.astype(np.float32).astype(np.float64) for k, v in sigma.items()}
    masks = nu.allocate(_scores(utility, sigma), budget, scope=scope, positive_only=positive_only)
    _assert_masks_equal(
        masks, ref_allocate(u32, s32, budget, scope=scope, positive_only=positive_only)
    )
    if scope == "uniform":
        for _k, m in np_masks(masks).items():
            for row in m:  # every task keeps a prefix
                assert row[: int(row.sum())].all()


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "budget, match",
    [
        (0, r"nu\.allocate: budget=0; expected a positive integer"),
        (-2, r"nu\.allocate: budget=-2; expected a positive integer"),
        (2.0, r"nu\.allocate: budget=2\.0 \(float\); expected a positive integer R"),
        (np.float32(3), r"nu\.allocate: budget=.*\(float32\); expected a positive integer R"),
        (True, r"nu\.allocate: budget=True \(bool\); expected a positive integer R"),
        (False, r"nu\.allocate: budget=False \(bool\); expected a positive integer R"),
        ("3", r"nu\.allocate: budget='3' \(str\); expected a positive integer R"),
    ],
)
def test_bad_budget(budget, match):
    with pytest.raises(ValueError, match=match):
        nu.allocate(_scores(HAND_U, HAND_S), budget)


def test_numpy_integer_budget_is_accepted():
    sc = _scores(HAND_U, HAND_S)
    _assert_masks_equal(nu.allocate(sc, np.int64(2)), np_masks(nu.allocate(sc, 2)))


@pytest.mark.parametrize("scope", ["layer", "Global", "", None])
def test_unknown_scope(scope):
    with pytest.raises(ValueError, match=r"nu\.allocate: unknown scope .*expected one of"):
        nu.allocate(_scores(HAND_U, HAND_S), 2, scope=scope)


def test_allocate_needs_scores():
    with pytest.raises(
        TypeError, match=r"nu\.allocate: expected the nu\.Scores returned by nu\.score"
    ):
        nu.allocate({"A": HAND_U["A"]}, 2)


# ------------------------------------------------------------------------------------------------
# Compilation and jit
# ------------------------------------------------------------------------------------------------


def test_allocate_does_not_recompile():
    rng = np.random.default_rng(0)

    def random_scores():
        s = {
            "p": np.sort(rng.uniform(0.1, 1, (3, 5)))[:, ::-1],
            "q": np.sort(rng.uniform(0.1, 1, (3, 7)))[:, ::-1],
        }
        u = {k: rng.normal(size=v.shape) for k, v in s.items()}
        return _scores(u, s)

    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    for scope in SCOPES:
        nu.allocate(random_scores(), 4, scope=scope)
    n0 = allocate_mod._allocate_impl._cache_size()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for scope in SCOPES:
            jax.block_until_ready(nu.allocate(random_scores(), 4, scope=scope))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert allocate_mod._allocate_impl._cache_size() == n0


def test_allocate_under_outer_jit():
    ads = jax.tree.map(jnp.asarray, rich_adapters(3))
    eager_sc = nu.score(ads)
    for scope in SCOPES:
        jitted = jax.jit(lambda s, scope=scope: nu.allocate(s, 3, scope=scope))(eager_sc)
        _assert_masks_equal(jitted, np_masks(nu.allocate(eager_sc, 3, scope=scope)), scope)
