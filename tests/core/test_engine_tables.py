"""nu.score's and nu.allocate's per-module results kept stacked (netutility_jax/engine/tables.py):
the fast allocation over the stacked fields gives the masks of the per-module path, ties included,
and the tables behave as the dicts they stand for."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax._core.tables import MaskTable, ScoreTable


def _adapters(seed=0, tie=False):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(3):
        ad = {}
        for layer in range(3):
            for kind, (d_in, d_out, r) in {
                "q": (24, 16, 4),
                "v": (24, 8, 3),
                "o": (16, 24, 4),
            }.items():
                ad[f"l{layer}.{kind}"] = {
                    "lora_a": rng.normal(size=(d_in, r)).astype(np.float32),
                    "lora_b": rng.normal(size=(r, d_out)).astype(np.float32),
                    "scale": 1.0 + i,
                }
        out.append(ad)
    if tie:  # two modules equal in every task: their utilities tie exactly
        for ad in out:
            ad["l2.q"] = {k: (np.array(v) if k != "scale" else v) for k, v in ad["l0.q"].items()}
    return out


@pytest.mark.parametrize("tie", [False, True], ids=["plain", "exact-ties"])
@pytest.mark.parametrize("scope", ["global", "local", "uniform"])
@pytest.mark.parametrize("positive_only", [True, False])
def test_the_stacked_allocation_is_the_per_module_one(tie, scope, positive_only):
    sc = nu.score(_adapters(1, tie))
    assert isinstance(sc.modules, ScoreTable)
    per_module = nu.Scores(dict(sc.modules), sc.lam, sc.alpha)  # a plain dict: the other path
    for budget in (1, 2, 5):
        fast = nu.allocate(sc, budget, scope=scope, positive_only=positive_only)
        slow = nu.allocate(per_module, budget, scope=scope, positive_only=positive_only)
        assert isinstance(fast, MaskTable) and list(fast) == list(slow)
        for name in slow:
            np.testing.assert_array_equal(np.asarray(fast[name]), np.asarray(slow[name]))


def test_tables_behave_as_the_dicts_they_stand_for():
    sc = nu.score(_adapters(2))
    masks = nu.allocate(sc, 2)
    plain = dict(masks)
    assert masks == plain and len(masks) == len(plain) and "l0.q" in masks
    assert len(jax.tree.leaves(masks)) == len(plain)
    mapped = jax.tree.map(lambda m: ~m, masks)  # a pytree: unflattens as a plain dict
    assert type(mapped) is dict
    np.testing.assert_array_equal(np.asarray(mapped["l0.q"]), ~np.asarray(plain["l0.q"]))
    masks["l0.q"] = np.zeros_like(np.asarray(plain["l0.q"]))  # mutable, like the dict it was
    assert not masks.pristine and not np.asarray(masks["l0.q"]).any()
    assert int(nu.kept_per_module(masks)["l0.q"]) == 0  # read as changed, not from the old copy
    del masks["l1.v"]
    assert "l1.v" not in masks and len(masks) == len(plain) - 1
    changed = dict(sc.modules)
    changed["l0.q"] = sc.modules["l2.q"]  # another module's scores (same shape)
    sc.modules["l0.q"] = sc.modules["l2.q"]
    assert not sc.modules.pristine  # read entry by entry now, as any dict
    got = nu.allocate(nu.Scores(sc.modules, sc.lam, sc.alpha), 2)
    want = nu.allocate(nu.Scores(changed, sc.lam, sc.alpha), 2)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
