"""``allocation._summary``: a selection's summaries over masks grouped by shape, against the
per-module definitions written out here (each (module, task) set one at a time)."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

import netutility_jax as nu
from netutility_jax.allocation import _summary


def _masks(seed: int, shapes: list[tuple[int, int]], p: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, (m, r) in enumerate(shapes):
        v = rng.random((m, r)) < p
        if i % 3 == 0:  # prefixes too, some of them empty
            n = rng.integers(0, r + 1, size=m)
            v = np.arange(r) < n[:, None]
        out[f"layers.{i}.mod"] = v
    return out


def _is_prefix(row: np.ndarray) -> bool:
    n = int(row.sum())
    return bool(row[:n].all())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    ranks=st.lists(st.integers(0, 6), min_size=1, max_size=12),
    p=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
)
def test_the_grouped_summaries_are_the_per_module_ones(seed, ranks, p):
    m_tasks = 3
    masks = _masks(seed, [(m_tasks, r) for r in ranks], p)
    groups = _summary.masks_by_shape(masks)
    # every module once, in a group of its shape, its rows as given
    assert sorted(n for names, _ in groups for n in names) == sorted(masks)
    for names, g in groups:
        for name, v in zip(names, g, strict=True):
            np.testing.assert_array_equal(v, masks[name])
    rows = [row for v in masks.values() for row in v if row.any()]
    want_np = float(np.mean([not _is_prefix(r) for r in rows])) if rows else 0.0
    assert _summary.non_prefix_of(groups) == want_np
    assert _summary.budget_spent_of(groups) == sum(int(v.sum()) for v in masks.values()) / len(
        masks
    )
    kept = _summary.kept_of(groups, list(masks))
    assert list(kept) == list(masks)
    for name, v in masks.items():
        np.testing.assert_array_equal(kept[name], v.sum(1))
    np.testing.assert_array_equal(
        _summary.kept_per_task_of(groups), sum(v.sum(1) for v in masks.values())
    )
    # the public summaries give the same numbers
    assert nu.non_prefix_fraction(masks) == want_np
    assert nu.budget_spent(masks) == _summary.budget_spent_of(groups)


def test_the_documented_example_and_a_set_kept_out_of_order():
    masks = {
        "q": np.array([[1, 1, 0], [0, 1, 0], [0, 0, 0]], bool),
        "k": np.array([[1, 0], [1, 1], [0, 1]], bool),  # another shape: prefix, prefix, not
    }
    groups = _summary.masks_by_shape(masks)
    assert len(groups) == 2
    assert _summary.non_prefix_of(groups) == 2 / 5
    np.testing.assert_array_equal(_summary.kept_per_task_of(groups), [3, 3, 1])
