"""Figures: the plotted data equals the counts computed here; PNGs are atomic and never overwrite."""

from __future__ import annotations

import importlib.util
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import plots

needs_mpl = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed"
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAYERS, TYPES, M = 3, ("q_proj", "v_proj"), 3


@pytest.fixture(scope="module")
def selection():
    rng = np.random.default_rng(0)
    names = [f"model.layers.{layer}.self_attn.{t}" for layer in range(LAYERS) for t in TYPES]
    ads = [
        {
            n: {
                "lora_a": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32),
                "lora_b": jnp.asarray(rng.normal(size=(4, 12)) * (1 + i), jnp.float32),
            }
            for n in names
        }
        for i in range(M)
    ]
    sc = nu.score(ads)
    masks = {k: np.asarray(v) for k, v in nu.allocate(sc, 3).items()}
    return names, sc, masks


def _report(masks):
    kept = {k: v.sum(1) for k, v in masks.items()}
    return nu.Report(
        lam=1.0,
        alpha=1.0,
        budget=3,
        budget_spent=nu.budget_spent(masks),
        kept=kept,
        kept_per_task=np.sum(list(kept.values()), axis=0),
        non_prefix_fraction=nu.non_prefix_fraction(masks),
        heterogeneity=0.0,
        ranks=dict.fromkeys(masks, 1),
        method="ta",
        space="full",
        allocation="net_utility",
        scope="global",
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.3.self_attn.q_proj", (3, "q_proj")),
        ("layers/3/attention/query", (3, "query")),
        ("base_model.model.model.layers.10.mlp.down_proj", (10, "down_proj")),
        ("encoder.layer.7.attention.self.query", (7, "query")),
        ("transformer.h.0.attn.c_attn", (0, "c_attn")),
        ("layers/2/moe/experts/5/w1", (2, "w1")),
        ("blocks/4", (4, "blocks")),
        ("head", (None, "head")),
        ("lm_head.dense", (None, "dense")),
    ],
)
def test_parse_module_name(name, expected):
    assert plots.parse_module_name(name) == expected


def _heat(fig):
    return np.ma.filled(fig.axes[0].images[0].get_array().astype(float), np.nan)


@needs_mpl
def test_budget_heatmap_counts(selection):
    _, _, masks = selection
    expected = np.zeros((LAYERS, len(TYPES)))
    for layer in range(LAYERS):
        for c, t in enumerate(TYPES):
            expected[layer, c] = masks[f"model.layers.{layer}.self_attn.{t}"].sum()
    fig = plots.budget_heatmap(masks)
    assert len(fig.axes) == 2  # heatmap and colorbar
    np.testing.assert_array_equal(_heat(fig), expected)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(TYPES)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2"]
    assert [t.get_text() for t in ax.texts] == [str(int(v)) for v in expected.ravel()]
    # one task only, and a Report instead of masks
    one = plots.budget_heatmap(masks, task=1)
    exp1 = np.array([[masks[f"model.layers.{layer}.self_attn.{t}"][1].sum() for t in TYPES]
                     for layer in range(LAYERS)])  # fmt: skip
    np.testing.assert_array_equal(_heat(one), exp1)
    np.testing.assert_array_equal(_heat(plots.budget_heatmap(_report(masks))), expected)


@needs_mpl
def test_budget_heatmap_slash_names_blank_cells_and_fallbacks():
    mk = lambda n: np.array([[True] * n + [False] * (4 - n), [True, False, False, False]])
    masks = {"layers/0/attention/query": mk(2), "layers/0/mlp": mk(3), "layers/1/mlp": mk(1)}
    data = _heat(plots.budget_heatmap(masks, annotate=False))
    np.testing.assert_array_equal(data, [[3, 4], [np.nan, 2]])
    # a name without a layer index: one row per module
    masks["head"] = mk(4)
    fig = plots.budget_heatmap(masks)
    np.testing.assert_array_equal(_heat(fig), [[3], [4], [2], [5]])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == list(masks)
    # two modules of one layer share a type: columns are the paths after the layer index
    clash = {"layers.0.attn.q": mk(1), "layers.0.cross.q": mk(2), "layers.1.attn.q": mk(3)}
    fig = plots.budget_heatmap(clash)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["attn.q", "cross.q"]
    np.testing.assert_array_equal(_heat(fig), [[2, 3], [4, np.nan]])


def _retention(masks, sc, prefix):
    """numpy retention by rank; with ``prefix`` each set keeps its leading candidates instead."""
    r = max(v.shape[1] for v in masks.values())
    kept, total = np.zeros(r), np.zeros(r)
    for name, v in masks.items():
        cand = np.isfinite(np.asarray(sc.modules[name].utility))
        for j in range(v.shape[0]):
            n = int((v[j] & cand[j]).sum())
            for k in range(v.shape[1]):
                if cand[j, k]:
                    total[k] += 1
                    kept[k] += (k < n) if prefix else v[j, k]
    return kept / total


@needs_mpl
def test_prefix_retention_lines(selection):
    _, sc, masks = selection
    # a non-prefix selection: task 0 keeps its last direction only, everywhere
    odd = {k: v.copy() for k, v in masks.items()}
    for v in odd.values():
        v[0] = [False, False, False, True]
    for m in (masks, odd):
        fig = plots.prefix_retention(m, sc)
        assert len(fig.axes) == 1
        solid, dashed = fig.axes[0].lines
        np.testing.assert_array_equal(solid.get_xdata(), [1, 2, 3, 4])
        np.testing.assert_allclose(solid.get_ydata(), _retention(m, sc, prefix=False))
        np.testing.assert_allclose(solid.get_ydata(), nu.retention_by_rank(m, sc))
        np.testing.assert_allclose(dashed.get_ydata(), _retention(m, sc, prefix=True))
    assert solid.get_ydata()[3] > dashed.get_ydata()[3]
    assert "non-prefix" in fig.axes[0].get_legend().get_texts()[0].get_text()


@needs_mpl
def test_kept_per_task_bars(selection):
    _, _, masks = selection
    fig = plots.kept_per_task(masks, ["a", "b", "c"])
    ax = fig.axes[0]
    assert len(fig.axes) == 1 and len(ax.patches) == M
    expected = sum(v.sum(1) for v in masks.values())
    np.testing.assert_array_equal([p.get_height() for p in ax.patches], expected)
    np.testing.assert_array_equal([p.get_height() for p in ax.patches], nu.kept_per_task(masks))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    fig = plots.kept_per_task(_report(masks))
    assert [p.get_height() for p in fig.axes[0].patches] == list(expected)
    msg = "nu.plots.kept_per_task: 2 task_names for M = 3 tasks; pass one name per task."
    with pytest.raises(ValueError, match=re.escape(msg)):
        plots.kept_per_task(masks, ["a", "b"])


@needs_mpl
def test_utility_distribution_histograms(selection):
    _, sc, masks = selection
    fig = plots.utility_distribution(sc, masks, task_names=["x", "y", "z"], bins=12)
    assert len(fig.axes) == M
    for j, ax in enumerate(fig.axes):
        util = np.stack([np.asarray(sc.modules[n].utility)[j] for n in masks])
        kept = np.stack([masks[n][j] for n in masks])
        cand = np.isfinite(util)
        dropped_bars, kept_bars = ax.containers
        assert len(dropped_bars) == len(kept_bars) == 12
        assert sum(p.get_height() for p in dropped_bars) == (cand & ~kept).sum()
        assert sum(p.get_height() for p in kept_bars) == (cand & kept).sum()
        assert ax.get_title().startswith(["x", "y", "z"][j])
    plain = plots.utility_distribution(sc)
    n_cand = sum(np.isfinite(np.asarray(m.utility)).sum() for m in sc.modules.values())
    assert sum(p.get_height() for ax in plain.axes for p in ax.patches) == n_cand
    assert all(len(ax.containers) == 1 for ax in plain.axes)


@needs_mpl
def test_png_written_atomically_and_never_overwritten(tmp_path, selection):
    _, sc, masks = selection
    calls = {
        "heat.png": lambda p: plots.budget_heatmap(masks, path=p),
        "retention.png": lambda p: plots.prefix_retention(masks, sc, path=p),
        "kept.png": lambda p: plots.kept_per_task(masks, path=p),
        "util.png": lambda p: plots.utility_distribution(sc, masks, path=p),
    }
    for fname, call in calls.items():
        path = tmp_path / fname
        fig = call(path)
        assert fig.__class__.__name__ == "Figure"
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
        fn = {"heat": "budget_heatmap", "retention": "prefix_retention", "kept": "kept_per_task",
              "util": "utility_distribution"}[fname[:-4]]  # fmt: skip
        msg = f"nu.plots.{fn}: {str(path)!r} already exists; figures are never overwritten."
        with pytest.raises(FileExistsError, match=re.escape(msg)):
            call(path)
        assert path.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(calls), "temp files left behind"


def test_input_errors(selection):
    _, sc, masks = selection
    with pytest.raises(TypeError, match=re.escape("nu.plots.budget_heatmap: expected the")):
        plots.budget_heatmap([1, 2])
    with pytest.raises(ValueError, match=re.escape("task=3; expected None or an int in [0, 3)")):
        plots.budget_heatmap(masks, task=3)
    fewer = dict(list(masks.items())[:2])
    with pytest.raises(ValueError, match=re.escape("masks and scores name different modules")):
        plots.prefix_retention(fewer, sc)
    with pytest.raises(ValueError, match=re.escape("nu.plots.utility_distribution: bins=0")):
        plots.utility_distribution(sc, bins=0)


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    msg = "netutility_jax.plots needs matplotlib, an optional dependency: pip install netutility-jax[plots]"
    with pytest.raises(ImportError, match=re.escape(msg)):
        plots.kept_per_task({"q": np.ones((2, 3), bool)})
