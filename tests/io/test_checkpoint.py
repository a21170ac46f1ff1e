"""Orbax checkpoints: bitwise round trips of adapters, Scores and Reports; refusals and errors."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import netutility_jax as nu
from netutility_jax import checkpoint as ckpt

NAMES = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "layers/0/attn/query")


def _adapters(m_tasks=3, seed=0):
    rng = np.random.default_rng(seed)
    dims = {name: (16, 12) for name in NAMES}  # one bucket: one compile per pipeline stage
    return [
        {
            name: {
                "lora_a": jnp.asarray(rng.normal(size=(d_in, 4)), jnp.float32),
                "lora_b": jnp.asarray(rng.normal(size=(4, d_out)), jnp.float32),
                "scale": 2.0,
            }
            for name, (d_in, d_out) in dims.items()
        }
        for _ in range(m_tasks)
    ]


@pytest.fixture(scope="module")
def adapters():
    return _adapters()


@pytest.fixture(scope="module")
def merged(adapters):
    return nu.merge_adapters(adapters, budget=3)


def _assert_same(a, b, where="obj"):
    """Same structure, types, dtypes and bits (the library's lazy per-module tables, mappings
    that are not dicts, stand for the dicts they restore as)."""
    a, b = (dict(x) if isinstance(x, Mapping) and not isinstance(x, dict) else x for x in (a, b))
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, (jax.Array, np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        x, y = np.asarray(a), np.asarray(b)
        assert x.tobytes() == y.tobytes(), f"{where}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), where
    else:
        assert a == b, where


def test_adapter_round_trip_bitwise(tmp_path, adapters):
    rng = np.random.default_rng(1)
    ad = dict(adapters[0])
    ad["bf16.module/x"] = {
        "lora_a": jnp.asarray(rng.normal(size=(8, 3)), jnp.bfloat16),
        "lora_b": jnp.asarray(rng.normal(size=(3, 5)), jnp.bfloat16),
        "scale": jnp.asarray(0.125, jnp.bfloat16),
    }
    ad["numpy.f64"] = {
        "lora_a": rng.normal(size=(8, 2)),
        "lora_b": rng.normal(size=(2, 5)).astype(np.float16),
        "scale": np.float64(1 / 3),
    }
    ad["rank0/merged"] = {"lora_a": jnp.zeros((8, 0)), "lora_b": jnp.zeros((0, 5)), "scale": 1.0}
    ad["dense.delta"] = {"delta": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)}
    ad["nested"] = {"layers": {0: {"q": None}}, "misc": [1, True, "s", (0.1, float("inf"))]}
    path = tmp_path / "adapter"
    ckpt.save(path, ad)
    back = ckpt.restore(path)
    _assert_same(ad, back)
    assert back["bf16.module/x"]["lora_a"].dtype == jnp.bfloat16
    assert isinstance(back["numpy.f64"]["lora_a"], np.ndarray)
    assert back["numpy.f64"]["lora_a"].dtype == np.float64
    assert back["rank0/merged"]["lora_a"].shape == (8, 0)
    assert isinstance(back[NAMES[0]]["lora_a"], jax.Array)


def test_list_of_adapters_and_merge_result(tmp_path, adapters, merged):
    merged, _ = merged
    ckpt.save(tmp_path / "ads", adapters)
    ckpt.save(tmp_path / "merged", merged)
    _assert_same(adapters, ckpt.restore(tmp_path / "ads"))
    back = ckpt.restore(tmp_path / "merged")
    _assert_same(merged, back)
    for name in NAMES:
        np.testing.assert_array_equal(nu.module_update(back[name]), nu.module_update(merged[name]))


def test_scores_round_trip_gives_identical_masks(tmp_path, adapters):
    sc = nu.score(adapters, alpha=0.5)
    ckpt.save(tmp_path / "scores", sc)
    back = ckpt.restore(tmp_path / "scores")
    assert type(back) is nu.Scores
    assert list(back.modules) == list(sc.modules)
    assert all(type(m) is nu.ModuleScores for m in back.modules.values())
    _assert_same(sc, back)
    assert float(back.lam) == float(sc.lam) and float(back.alpha) == 0.5
    for scope in ("global", "local", "uniform"):
        m1, m2 = nu.allocate(sc, 3, scope=scope), nu.allocate(back, 3, scope=scope)
        assert list(m1) == list(m2)
        for name in m1:
            np.testing.assert_array_equal(m1[name], m2[name])


def test_report_round_trip(tmp_path, merged):
    _, rep = merged
    ckpt.save(tmp_path / "report", rep)
    back = ckpt.restore(tmp_path / "report")
    assert type(back) is nu.Report
    _assert_same(rep, back)
    assert back.kept_per_task.dtype == rep.kept_per_task.dtype
    nan_rep = dataclasses.replace(rep, heterogeneity=float("nan"), lam=None, alpha=None)
    ckpt.save(tmp_path / "nan", nan_rep)
    _assert_same(nan_rep, ckpt.restore(tmp_path / "nan"))


def test_refuses_overwrite(tmp_path, adapters):
    path = tmp_path / "adapter"
    ckpt.save(path, adapters[0])
    msg = f"nu.checkpoint.save: {str(path)!r} already exists; checkpoints are never overwritten."
    with pytest.raises(FileExistsError, match=re.escape(msg)):
        ckpt.save(path, adapters[1])
    _assert_same(adapters[0], ckpt.restore(path))  # the first one is intact
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        ckpt.save(tmp_path / "file", adapters[0])


def test_relative_path(tmp_path, monkeypatch, adapters):
    monkeypatch.chdir(tmp_path)
    ckpt.save("rel/ad", adapters[0])
    assert os.path.isdir(tmp_path / "rel" / "ad")
    _assert_same(adapters[0], ckpt.restore("rel/ad"))


def test_restore_errors_name_the_path(tmp_path, adapters):
    missing = tmp_path / "nothing"
    with pytest.raises(
        FileNotFoundError,
        match=re.escape(f"nu.checkpoint.restore: no checkpoint at {str(missing)!r};"),
    ):
        ckpt.restore(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"nu.checkpoint.restore: {str(empty)!r} is not a readable netutility-jax checkpoint"
        ),
    ):
        ckpt.restore(empty)
    broken = tmp_path / "broken"
    ckpt.save(broken, adapters[0])
    shutil.rmtree(broken / "arrays")
    with pytest.raises(ValueError, match=re.escape(f"{str(broken)!r} is not a readable")):
        ckpt.restore(broken)


def test_foreign_orbax_checkpoint(tmp_path):
    path = str(tmp_path / "foreign")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as c:
        c.save(path, ocp.args.Composite(meta=ocp.args.JsonSave({"hello": 1})))
    with pytest.raises(ValueError, match=re.escape("is an orbax checkpoint but not one")):
        ckpt.restore(path)


class Other(NamedTuple):
    x: int


def test_unsupported_leaves(tmp_path):
    with pytest.raises(TypeError, match=re.escape("nu.checkpoint.save: obj['m'][0] is a Other")):
        ckpt.save(tmp_path / "a", {"m": [Other(1)]})
    with pytest.raises(TypeError, match=re.escape("obj['m'] is a object; expected nested dicts")):
        ckpt.save(tmp_path / "b", {"m": object()})
    with pytest.raises(TypeError, match=re.escape("obj has a key (1, 2) of type tuple")):
        ckpt.save(tmp_path / "c", {(1, 2): 1.0})
    with pytest.raises(TypeError, match=re.escape("obj['s'] has dtype <U1")):
        ckpt.save(tmp_path / "d", {"s": np.array(["a"])})
    assert not any(tmp_path.iterdir()), "a refused save must not leave files behind"
