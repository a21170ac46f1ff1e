"""Inside ``jax.jit`` the scores, the masks and the merge stay stacked per bucket: the traced
program grows by a few operations per module (the merged modules' own slices), not by the
score fields, mask slices, restacks and report counts of every module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax._core.tables import StackedMasks

KINDS = {"q": (12, 12), "k": (12, 6), "up": (12, 20)}


def _adapters(layers: int, tasks: int = 3, rank: int = 3, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(tasks):
        ad = {}
        for i in range(layers):
            for kind, (d_in, d_out) in KINDS.items():
                ad[f"layers.{i}.{kind}"] = {
                    "lora_a": jnp.asarray(rng.normal(size=(d_in, rank)), jnp.float32),
                    "lora_b": jnp.asarray(rng.normal(size=(rank, d_out)), jnp.float32),
                    "scale": 2.0,
                }
        out.append(ad)
    return out


@pytest.mark.parametrize("scope", ["global", "local"])
def test_traced_masks_are_stacked_and_equal_the_concrete_ones(scope):
    ads = nu.stack_adapters(_adapters(2))
    want = nu.allocate(nu.score(ads), 2, scope=scope)
    seen = {}

    @jax.jit
    def masks(a):
        got = nu.allocate(nu.score(a), 2, scope=scope)
        seen["type"] = type(got)
        return dict(got)

    got = masks(ads)
    assert seen["type"] is StackedMasks
    assert sorted(got) == sorted(want)  # (jit returns a dict's keys sorted)
    for nm in want:
        np.testing.assert_array_equal(np.asarray(got[nm]), np.asarray(want[nm]), err_msg=nm)


def _report_fields_by_hand(masks: dict) -> dict:
    """kept per module and task, per task, the budget spent per module and the fraction of
    (module, task) kept sets that are not a prefix of the spectrum, in numpy."""
    kept = {nm: m.sum(1) for nm, m in masks.items()}
    sets = nonprefix = 0
    for m in masks.values():
        for row in m:
            k = int(row.sum())
            if k:
                sets += 1
                nonprefix += int(not row[:k].all())
    return {
        "kept": kept,
        "kept_per_task": sum(kept.values()),
        "budget_spent": sum(int(k.sum()) for k in kept.values()) / len(masks),
        "non_prefix_fraction": nonprefix / sets if sets else 0.0,
    }


@pytest.mark.parametrize("allocation", ["net_utility", "uniform"])
def test_the_traced_report_counts_equal_the_masks_counted_by_hand(allocation):
    ads = nu.stack_adapters(_adapters(2))
    run = jax.jit(
        lambda a: nu.merge_adapters(a, budget=3, method="ta", space="core", allocation=allocation)
    )
    _, rep = run(ads)
    masks = {nm: np.asarray(m) for nm, m in rep.masks.items()}
    want = _report_fields_by_hand(masks)
    assert sorted(rep.kept) == sorted(masks)
    for nm in masks:
        np.testing.assert_array_equal(np.asarray(rep.kept[nm]), want["kept"][nm])
    np.testing.assert_array_equal(np.asarray(rep.kept_per_task), want["kept_per_task"])
    assert float(rep.budget_spent) == pytest.approx(want["budget_spent"])
    assert float(rep.non_prefix_fraction) == pytest.approx(want["non_prefix_fraction"])
    # and the concrete merge keeps the same directions
    _, ref = nu.merge_adapters(ads, budget=3, method="ta", space="core", allocation=allocation)
    for nm in masks:
        np.testing.assert_array_equal(masks[nm], np.asarray(ref.masks[nm]), err_msg=nm)


def _eqns(layers: int) -> int:
    ads = nu.stack_adapters(_adapters(layers))
    jaxpr = jax.make_jaxpr(
        lambda a: nu.merge_adapters(a, budget=3, method="ta", space="core")[0]
    )(ads)
    return len(jaxpr.jaxpr.eqns)


def test_the_traced_merge_grows_by_its_outputs_only():
    # 3 modules a layer; each merged module is two slices of its bucket's result (a slice and a
    # squeeze each): 4 equations. Scores, masks and report counts per module (about 40 more
    # per module before) would break the bound.
    per_module = (_eqns(4) - _eqns(2)) / (2 * len(KINDS))
    assert per_module <= 6, per_module
