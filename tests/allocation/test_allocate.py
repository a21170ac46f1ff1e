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
    FIVE_MODULES,
    make_adapters,
    np_masks,
    ref_allocate,
    ref_scores,
    rich_adapters,
    rich_reference,
    selection_margin,
)

import netutility_jax as nu
from netutility_jax import InputError, InputTypeError

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


@pytest.mark.parametrize("budget", [0, -2, np.int64(-1)])
def test_budget_not_positive(budget):
    with pytest.raises(
        InputError, match=rf"nu\.allocate: budget={int(budget)}; expected a positive integer"
    ):
        nu.allocate(_scores(HAND_U, HAND_S), budget)


@pytest.mark.parametrize(
    "budget, shown",
    [
        (2.0, r"2\.0 \(float\)"),
        (np.float32(3), r".*3\.0\)? \(float32\)"),
        (True, r"True \(bool\)"),
        (False, r"False \(bool\)"),
        (np.bool_(True), r"np\.True_ \(bool\)"),
        ("3", r"'3' \(str\)"),
        (None, r"None \(NoneType\)"),
        (3 + 0j, r"\(3\+0j\) \(complex\)"),
    ],
)
def test_budget_of_the_wrong_type(budget, shown):
    with pytest.raises(
        InputTypeError,
        match=rf"nu\.allocate: budget={shown}; expected a positive integer R \(a Python or numpy "
        r"int\)",
    ):
        nu.allocate(_scores(HAND_U, HAND_S), budget)


def test_numpy_integer_budget_is_accepted():
    sc = _scores(HAND_U, HAND_S)
    _assert_masks_equal(nu.allocate(sc, np.int64(2)), np_masks(nu.allocate(sc, 2)))
    _assert_masks_equal(nu.allocate(sc, np.uint8(2)), np_masks(nu.allocate(sc, 2)))


@pytest.mark.parametrize("budget", [2**31, 2**40, 2**63 - 1, np.int64(2**62)])
@pytest.mark.parametrize("positive_only", [True, False])
@pytest.mark.parametrize("scope", SCOPES)
def test_budget_beyond_int32_keeps_every_candidate(budget, positive_only, scope):
    """Before: OverflowError with scope="uniform". A budget above the candidates keeps them all
    (the positive ones with positive_only), in every scope."""
    sc = nu.score(rich_adapters(4))
    u, s = _lib_arrays(sc)
    masks = nu.allocate(sc, budget, scope=scope, positive_only=positive_only)
    expect = ref_allocate(u, s, int(budget), scope=scope, positive_only=positive_only)
    _assert_masks_equal(masks, expect)
    if not positive_only or scope == "uniform":
        for k, m in np_masks(masks).items():
            np.testing.assert_array_equal(m, np.isfinite(u[k]))


@pytest.mark.parametrize("value", ["no", "False", 1, 0, None, np.asarray([True]), 1.0])
def test_positive_only_must_be_a_bool(value):
    """Before: taken by truthiness (positive_only="no" behaved as True)."""
    with pytest.raises(
        InputTypeError,
        match=rf"nu\.allocate: positive_only=.* \({type(value).__name__}\); expected True or False",
    ):
        nu.allocate(_scores(HAND_U, HAND_S), 2, positive_only=value)


def test_numpy_bool_positive_only_is_accepted():
    sc = _scores(HAND_U, HAND_S)
    for v in (True, False):
        _assert_masks_equal(
            nu.allocate(sc, 3, positive_only=np.bool_(v)),
            np_masks(nu.allocate(sc, 3, positive_only=v)),
        )


@pytest.mark.parametrize("scope", ["layer", "Global", ""])
def test_unknown_scope(scope):
    with pytest.raises(
        InputError, match=rf"nu\.allocate: unknown scope '{scope}'; expected one of \("
    ):
        nu.allocate(_scores(HAND_U, HAND_S), 2, scope=scope)


@pytest.mark.parametrize("scope", [None, 1, ["global"], b"global"])
def test_scope_of_the_wrong_type(scope):
    with pytest.raises(
        InputTypeError,
        match=rf"nu\.allocate: scope=.* \({type(scope).__name__}\); expected one of \('global'",
    ):
        nu.allocate(_scores(HAND_U, HAND_S), 2, scope=scope)


def test_allocate_needs_scores():
    with pytest.raises(
        TypeError, match=r"nu\.allocate: expected the nu\.Scores returned by nu\.score"
    ):
        nu.allocate({"A": HAND_U["A"]}, 2)


@pytest.mark.parametrize("log_c", [-30, -20, 20, 30])
def test_uniform_share_is_scale_free(log_c):
    """The uniform rule's energy share s^2 / sum(s^2) is computed from s / s_max: sigmas of 1e30
    (sigma^2 overflows float32) or 1e-30 (underflows) select as the unscaled ones. Before, every
    share was NaN or 0 and nothing or the wrong set was kept."""
    c = 10.0**log_c
    scaled = {k: v * c for k, v in UNI_S.items()}
    for budget in (2, 5, 7):
        masks = nu.allocate(_scores(UNI_U, scaled), budget, scope="uniform")
        _assert_masks_equal(
            masks, ref_allocate(UNI_U, UNI_S, budget, scope="uniform", positive_only=True)
        )


@pytest.mark.parametrize("scope", SCOPES)
def test_scores_of_scale_1e30_adapters_select_as_the_reference(scope):
    """End to end: every task's scale 1e30 (sigma ~1e31): the selection is the float64
    reference's, including the uniform baseline (which reads sigma)."""
    ads = make_adapters(41, 3, (("q", 12, 9, (3, 4, 2)), ("v", 10, 6, (2, 3, 3))))
    for ad in ads:
        for k, m in ad.items():
            ad[k] = dict(m, scale=np.asarray(m["scale"] * 1e30, np.float32))
    sc = nu.score(ads)
    ref = ref_scores(ads)
    sig = {k: m.sigma for k, m in ref.modules.items()}
    for budget in (1, 2, 4):
        assert selection_margin(ref.utility, sig, budget, scope=scope, positive_only=True) > MARGIN
        _assert_masks_equal(
            nu.allocate(sc, budget, scope=scope),
            ref_allocate(ref.utility, sig, budget, scope=scope, positive_only=True),
            f"budget {budget}",
        )


@pytest.mark.parametrize(
    "field, value", [("utility", np.nan), ("utility", np.inf), ("sigma", np.nan), ("sigma", -1.0)]
)
def test_scores_holding_nan_are_refused(field, value):
    """nu.score never returns these on concrete inputs; a traced score of NaN input does."""
    u = {k: v.copy() for k, v in HAND_U.items()}
    s = {k: v.copy() for k, v in HAND_S.items()}
    (u if field == "utility" else s)["B"][1, 1] = value
    with pytest.raises(
        InputError,
        match=r"nu\.allocate: scores of module 'B' hold NaN or \+inf utilities, or NaN, infinite "
        r"or negative sigmas \(1 such entries in 'B'\)",
    ):
        nu.allocate(_scores(u, s), 2)


def test_scores_of_the_wrong_shape_are_refused_briefly():
    """2,000 modules whose sigma and utility disagree: one short message, a few names."""
    z = jnp.zeros((2, 3))
    bad = {f"m{i}": nu.ModuleScores(z, z, z, jnp.zeros((2, 2))) for i in range(2000)}
    sc = nu.Scores(bad, jnp.asarray(1.0), jnp.asarray(1.0))
    with pytest.raises(
        InputError,
        match=r"nu\.allocate: scores of modules 'm0', 'm1', 'm2' and 1997 more: utility \(2, 2\) "
        r"and sigma \(2, 3\) \(first one\) must be equal and 2-D",
    ) as info:
        nu.allocate(sc, 2)
    assert len(str(info.value)) < 400
    ragged = {
        "a": nu.ModuleScores(*(jnp.zeros((2, 3)),) * 4),
        "b": nu.ModuleScores(*(jnp.zeros((3, 3)),) * 4),
    }
    with pytest.raises(InputError, match=r"disagree on the number of tasks M \(\[2, 3\]\)"):
        nu.allocate(nu.Scores(ragged, jnp.asarray(1.0), jnp.asarray(1.0)), 2)
    with pytest.raises(InputTypeError, match=r"scores of module 'a' lack floating 'utility'"):
        nu.allocate(nu.Scores({"a": nu.ModuleScores(*(None,) * 4)}, 1.0, 1.0), 2)
    with pytest.raises(InputError, match=r"nu\.allocate: scores\.modules is empty"):
        nu.allocate(nu.Scores({}, 1.0, 1.0), 2)


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


# ------------------------------------------------------------- the masks' placement and bad entries


@pytest.mark.parametrize("scope", ["global", "local", "uniform"])
def test_masks_are_uncommitted_bools_of_each_module(scope):
    ads = make_adapters(4, 3, FIVE_MODULES)
    sc = nu.score(ads)
    masks = nu.allocate(sc, 2, scope=scope)
    jitted = jax.jit(lambda s: nu.allocate(s, 2, scope=scope))(sc)
    assert list(masks) == list(sc.modules)
    for name, m in masks.items():
        assert isinstance(m, jax.Array) and not m.committed
        assert m.dtype == jnp.bool_ and m.shape == sc.modules[name].utility.shape
        np.testing.assert_array_equal(np.asarray(m), np.asarray(jitted[name]), err_msg=name)
    if scope == "global":  # the top L R utilities over everything, positive ones only
        u = np.concatenate([np.asarray(ms.utility).ravel() for ms in sc.modules.values()])
        kept = np.concatenate([np.asarray(m).ravel() for m in masks.values()])
        k = min(2 * len(masks), int((u > 0).sum()))
        np.testing.assert_array_equal(np.sort(u[kept]), np.sort(u)[::-1][:k][::-1])


def test_allocate_counts_bad_entries_per_module_only_when_there_are_some():
    ads = make_adapters(5, 3, FIVE_MODULES)
    sc = nu.score(ads)
    mods = dict(sc.modules)
    u = np.array(mods["l1.q"].utility)
    u[0, 0], u[1, 0] = np.nan, np.inf
    s = np.array(mods["l2.o"].sigma)
    s[2, 1] = -1.0
    mods["l1.q"] = mods["l1.q"]._replace(utility=jnp.asarray(u))
    mods["l2.o"] = mods["l2.o"]._replace(sigma=jnp.asarray(s))
    bad = sc._replace(modules=mods)
    with pytest.raises(
        InputError, match=r"modules 'l1.q', 'l2.o' hold NaN .*\(2 such entries in 'l1.q'\)"
    ):
        nu.allocate(bad, 2)
    counts = allocate_mod._bad_counts(
        [ms.utility for ms in mods.values()], [ms.sigma for ms in mods.values()]
    )
    np.testing.assert_array_equal(counts, [0, 0, 2, 0, 1])
