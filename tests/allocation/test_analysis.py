"""Selection summaries on hand-built masks with known answers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _reference import rich_adapters

import netutility_jax as nu
from netutility_jax import InputError, InputTypeError

# M = 3 tasks. A (r_max 5): task 0 keeps a prefix {0, 1}, task 1 the non-prefix {1}, task 2
# nothing. B (r_max 2): prefixes {0} and {0, 1}, and the non-prefix {1}.
MASKS = {
    "A": np.array([[1, 1, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]], bool),
    "B": np.array([[1, 0], [1, 1], [0, 1]], bool),
}
# Candidates (finite utility): A task 0 slots 0-3, task 1 slots 0-2, task 2 slots 0-1, and slot 4
# of nobody; B everything.
_CAND = {
    "A": np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], bool),
    "B": np.ones((3, 2), bool),
}


def _scores():
    mods = {}
    for k, c in _CAND.items():
        z = jnp.zeros(c.shape, jnp.float32)
        u = jnp.asarray(np.where(c, 0.5, -np.inf), jnp.float32)
        mods[k] = nu.ModuleScores(jnp.asarray(c, jnp.float32), z, z, u)
    return nu.Scores(mods, jnp.asarray(1.0), jnp.asarray(1.0))


@pytest.mark.parametrize("as_jax", [False, True])
def test_kept_per_module(as_jax):
    masks = {k: jnp.asarray(v) if as_jax else v for k, v in MASKS.items()}
    assert nu.kept_per_module(masks) == {"A": 3, "B": 4}


def test_kept_per_task():
    kept = nu.kept_per_task(MASKS)
    np.testing.assert_array_equal(np.asarray(kept), [3, 3, 1])
    assert kept.shape == (3,)


def test_budget_spent():
    assert nu.budget_spent(MASKS) == pytest.approx(3.5)  # 7 kept over 2 modules
    assert nu.budget_spent({"A": np.zeros((2, 3), bool)}) == 0.0


def test_non_prefix_fraction_leaves_out_empty_sets():
    # five non-empty sets, two of them non-prefix (an empty set would make it 2 / 6)
    assert nu.non_prefix_fraction(MASKS) == pytest.approx(2 / 5)
    assert nu.non_prefix_fraction({"A": np.zeros((3, 4), bool)}) == 0.0
    prefixes = {"A": np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)}
    assert nu.non_prefix_fraction(prefixes) == 0.0
    gaps = {"A": np.array([[1, 0, 1, 0], [0, 0, 0, 1]], bool)}
    assert nu.non_prefix_fraction(gaps) == 1.0


def test_retention_by_rank():
    ret = np.asarray(nu.retention_by_rank(MASKS, _scores()))
    # candidates per rank: A (3, 3, 2, 1, 0) + B (3, 3); kept among them: A (1, 2, 0, 0, 0) + B (2, 2)
    np.testing.assert_allclose(ret[:4], [3 / 6, 4 / 6, 0.0, 0.0])
    assert np.isnan(ret[4])  # no candidate at rank 4 anywhere
    assert ret.shape == (5,)


def test_retention_ignores_kept_non_candidates():
    masks = {"A": MASKS["A"] | ~_CAND["A"], "B": MASKS["B"]}
    np.testing.assert_array_equal(
        np.asarray(nu.retention_by_rank(masks, _scores())),
        np.asarray(nu.retention_by_rank(MASKS, _scores())),
    )


def test_summaries_of_real_allocations():
    sc = nu.score(rich_adapters(4))
    n_cand = {k: int(np.isfinite(np.asarray(m.utility)).sum()) for k, m in sc.modules.items()}
    g = nu.allocate(sc, 3, scope="global", positive_only=False)
    assert nu.budget_spent(g) == 3.0
    assert int(np.asarray(nu.kept_per_task(g)).sum()) == 3 * len(g)
    u = nu.allocate(sc, 5, scope="uniform")
    assert nu.kept_per_module(u) == {k: min(5, n) for k, n in n_cand.items()}
    assert nu.non_prefix_fraction(u) == 0.0  # the uniform baseline keeps spectral prefixes


FNS = (nu.kept_per_module, nu.kept_per_task, nu.budget_spent, nu.non_prefix_fraction)


def test_masks_must_be_a_non_empty_mapping():
    for fn in FNS:
        with pytest.raises(InputError, match=rf"nu\.{fn.__name__}: masks is empty"):
            fn({})
        with pytest.raises(InputTypeError, match=rf"nu\.{fn.__name__}: masks is a list"):
            fn([MASKS["A"]])
    with pytest.raises(InputError, match=r"nu\.retention_by_rank: masks is empty"):
        nu.retention_by_rank({}, _scores())


@pytest.mark.parametrize(
    "bad", [MASKS["A"].astype(np.float32) * 0.5, MASKS["A"].astype(np.int8), [[True]], "A"]
)
def test_masks_must_be_bool_arrays(bad):
    """0.5 was read as True: a float, int or non-array mask is refused, naming the module."""
    for fn in FNS:
        with pytest.raises(
            InputTypeError,
            match=rf"nu\.{fn.__name__}: the masks of module 'A' are not concrete bool arrays",
        ):
            fn({"A": bad, "B": MASKS["B"]})


def test_masks_must_be_2d_and_agree_on_m():
    with pytest.raises(InputError, match=r"masks of module 'A' are not 2-D \(the first has shape"):
        nu.budget_spent({"A": MASKS["A"][0], "B": MASKS["B"]})
    with pytest.raises(InputError, match=r"disagree on the number of tasks M \(\[2, 3\]\)"):
        nu.kept_per_task({"A": MASKS["A"], "B": MASKS["B"][:2]})


def test_retention_needs_matching_scores():
    with pytest.raises(InputError, match=r"scores have no entry for module 'C' of the masks"):
        nu.retention_by_rank({**MASKS, "C": MASKS["B"]}, _scores())
    with pytest.raises(
        InputError, match=r"differ in shape for module 'B' \(first: mask \(3, 1\), utility \(3, 2\)"
    ):
        nu.retention_by_rank({"A": MASKS["A"], "B": MASKS["B"][:, :1]}, _scores())
    with pytest.raises(InputTypeError, match=r"scores is a dict; expected the nu\.Scores"):
        nu.retention_by_rank(MASKS, {"A": 1})


def test_messages_stay_short_with_2000_bad_masks():
    bad = {f"layer{i}": np.zeros((3, 4), np.float32) for i in range(2000)}
    with pytest.raises(InputTypeError, match=r"'layer0', 'layer1', 'layer2' and 1997 more") as e:
        nu.budget_spent(bad)
    assert len(str(e.value)) < 400
    masks = {f"layer{i}": np.zeros((3, 2), bool) for i in range(2000)}
    with pytest.raises(InputError, match=r"'layer0', 'layer1', 'layer2' and 1997 more") as e:
        nu.retention_by_rank(masks, _scores())
    assert len(str(e.value)) < 400
