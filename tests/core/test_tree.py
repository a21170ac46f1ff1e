"""Adapter pytrees: module names, nu.extract_lora, and validation of the adapters (clear errors)."""

from __future__ import annotations

import importlib
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import SMALL_SPEC, assert_scores_match, make_adapters, ref_scores

import netutility_jax as nu


def _mod(rng, d_in=8, r=3, d_out=6, **extra):
    m = {
        "lora_a": rng.normal(size=(d_in, r)).astype(np.float32),
        "lora_b": rng.normal(size=(r, d_out)).astype(np.float32),
    }
    m.update(extra)
    return m


# ------------------------------------------------------------------------------------------------
# Names and extraction
# ------------------------------------------------------------------------------------------------


def test_module_names_are_slash_joined_paths_in_adapter_order():
    rng = np.random.default_rng(0)
    ads = [
        {
            "layers": {"1": {"attn": {"query": _mod(rng)}}, "0": {"mlp": _mod(rng, 5, 2, 4)}},
            "head": _mod(rng),
        }
        for _ in range(2)
    ]
    sc = nu.score(ads)
    assert list(sc.modules) == ["layers/1/attn/query", "layers/0/mlp", "head"]
    assert_scores_match(sc, ref_scores(ads), 1e-4)


def test_flat_peft_names_are_kept():
    rng = np.random.default_rng(1)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    ads = [{n: _mod(rng) for n in names} for _ in range(2)]
    assert list(nu.score(ads).modules) == names


def test_module_order_follows_task_0_when_tasks_order_keys_differently():
    rng = np.random.default_rng(2)
    m = {k: [_mod(rng), _mod(rng)] for k in ("p", "q")}
    ads = [{"p": m["p"][0], "q": m["q"][0]}, {"q": m["q"][1], "p": m["p"][1]}]
    sc = nu.score(ads)
    assert list(sc.modules) == ["p", "q"]
    assert_scores_match(sc, ref_scores([ads[0], {"p": m["p"][1], "q": m["q"][1]}]), 1e-4)


def test_extract_lora_keeps_only_lora_modules():
    rng = np.random.default_rng(3)
    tree = {
        "embed": {"embedding": np.ones((10, 8), np.float32)},
        "layers": {
            "0": {
                "query": {
                    "kernel": np.ones((8, 6), np.float32),
                    "bias": np.zeros(6, np.float32),
                    **_mod(rng, scale=np.float32(0.5)),
                },
                "norm": {"scale": np.ones(8, np.float32)},  # a "scale" that is not a LoRA scale
            },
            "1": {"query": {"kernel": np.ones((8, 6), np.float32), **_mod(rng)}},
        },
    }
    ex = nu.extract_lora(tree)
    assert list(ex) == ["layers/0/query", "layers/1/query"]
    q0 = tree["layers"]["0"]["query"]
    assert set(ex["layers/0/query"]) == {"lora_a", "lora_b", "scale"}
    assert set(ex["layers/1/query"]) == {"lora_a", "lora_b"}
    np.testing.assert_array_equal(ex["layers/0/query"]["lora_a"], q0["lora_a"])
    np.testing.assert_array_equal(ex["layers/0/query"]["lora_b"], q0["lora_b"])
    assert float(ex["layers/0/query"]["scale"]) == 0.5
    # the full tree is rejected by score, the extracted one is accepted
    with pytest.raises(ValueError, match=r"nu\.extract_lora"):
        nu.score([tree, tree])
    assert list(nu.score([ex, ex]).modules) == list(ex)


def _nnx_model(seed):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.q = nnx.LoRALinear(8, 5, lora_rank=3, rngs=rngs)
            self.v = nnx.LoRALinear(8, 5, lora_rank=2, rngs=rngs)

    model = Model(nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for layer in (model.q, model.v):  # lora_b is zero at initialisation: "train" it
        shape = layer.lora.lora_b[...].shape
        layer.lora.lora_b[...] = jnp.asarray(rng.normal(size=shape), jnp.float32)
    return model


def test_extract_lora_from_flax_nnx_state():
    """nnx.LoRALinear parameters (Variables) are unwrapped, names are the module paths."""
    from flax import nnx

    models = [_nnx_model(s) for s in (0, 1)]
    ex = [nu.extract_lora(nnx.state(m)) for m in models]
    assert list(ex[0]) == ["q/lora", "v/lora"]
    for m, e in zip(models, ex, strict=True):
        for name, layer in (("q/lora", m.q.lora), ("v/lora", m.v.lora)):
            assert isinstance(e[name]["lora_a"], jax.Array)
            np.testing.assert_array_equal(
                np.asarray(e[name]["lora_a"]), np.asarray(layer.lora_a[...])
            )
            np.testing.assert_array_equal(
                np.asarray(e[name]["lora_b"]), np.asarray(layer.lora_b[...])
            )
    assert_scores_match(nu.score(ex), ref_scores(ex), 1e-4)
    # an nnx.State holding only the LoRA parameters is an adapter as it is
    st = [nnx.state(m, nnx.LoRAParam) for m in models]
    sc = nu.score(st)
    assert list(sc.modules) == ["q/lora", "v/lora"]
    assert_scores_match(sc, ref_scores(ex), 1e-4)


def test_missing_module_as_none():
    ads = make_adapters(0, 3, (*SMALL_SPEC, ("k", 12, 9, (None, 2, 3))))
    assert ads[0]["k"] is None
    sc = nu.score(ads)
    assert np.all(np.asarray(sc.modules["k"].utility)[0] == -np.inf)
    assert_scores_match(sc, ref_scores(ads), 1e-4)


def test_score_does_not_mutate_inputs():
    ads = make_adapters(1, 3, SMALL_SPEC)
    before = jax.tree.map(np.copy, ads)
    nu.score(ads)
    jax.tree.map(np.testing.assert_array_equal, ads, before)


# ------------------------------------------------------------------------------------------------
# Validation: every error names the module, the task and the shapes
# ------------------------------------------------------------------------------------------------


def test_empty_adapter_list():
    with pytest.raises(ValueError, match=r"nu\.score: the adapter list is empty"):
        nu.score([])


def test_single_adapter_not_in_a_list():
    with pytest.raises(TypeError, match=r"nu\.score: expected a sequence of adapters.*\[adapter\]"):
        nu.score({"q": _mod(np.random.default_rng(0))})


def test_module_names_differ():
    rng = np.random.default_rng(4)
    ads = [{"a": _mod(rng), "b": _mod(rng)}, {"a": _mod(rng), "c": _mod(rng)}]
    with pytest.raises(
        ValueError,
        match=r"module names differ between adapters: task 1 lacks module 'b' that task 0 has; "
        r"task 1 has module 'c' that task 0 lacks.*put None",
    ):
        nu.score(ads)
    with pytest.raises(ValueError, match=r"task 2 lacks module 'b' that task 0 has\."):
        nu.score(
            [{"a": _mod(rng), "b": _mod(rng)}, {"a": _mod(rng), "b": _mod(rng)}, {"a": _mod(rng)}]
        )
    with pytest.raises(ValueError, match=r"task 1 has module 'z' that task 0 lacks\."):
        nu.score([{"a": _mod(rng)}, {"a": _mod(rng), "z": _mod(rng)}])


def test_factors_do_not_chain():
    rng = np.random.default_rng(5)
    bad = {"lora_a": np.ones((8, 3), np.float32), "lora_b": np.ones((2, 6), np.float32)}
    with pytest.raises(
        ValueError,
        match=r"nu\.score: factors of module 'm', task 1, do not chain: lora_a \(8, 3\) .* "
        r"lora_b \(2, 6\).*transpose",
    ):
        nu.score([{"m": _mod(rng)}, {"m": bad}])
    # PEFT layout (lora_A (r, d_in), lora_B (d_out, r)) is caught as well
    peft = {"lora_a": np.ones((3, 8), np.float32), "lora_b": np.ones((6, 3), np.float32)}
    with pytest.raises(ValueError, match=r"module 'm', task 0, do not chain: lora_a \(3, 8\)"):
        nu.score([{"m": peft}, {"m": _mod(rng)}])


@pytest.mark.parametrize("d_in, d_out", [(9, 6), (8, 7)])
def test_update_shape_differs_across_tasks(d_in, d_out):
    rng = np.random.default_rng(6)
    ads = [{"m": _mod(rng)}, {"m": _mod(rng)}, {"m": _mod(rng, d_in, 3, d_out)}]
    with pytest.raises(
        ValueError,
        match=rf"module 'm' has update shape \(d_in, d_out\) = \(8, 6\) in task 0 "
        rf"\(lora_a \(8, 3\), lora_b \(3, 6\)\) but \({d_in}, {d_out}\) in task 2 "
        rf"\(lora_a \({d_in}, 3\), lora_b \(3, {d_out}\)\)",
    ):
        nu.score(ads)


def test_update_shape_differs_with_a_missing_task():
    """The first task that has the module is the reference, not task 0."""
    rng = np.random.default_rng(7)
    ads = [{"m": None}, {"m": _mod(rng)}, {"m": _mod(rng, 8, 2, 5)}]
    with pytest.raises(ValueError, match=r"\(8, 6\) in task 1 .* but \(8, 5\) in task 2"):
        nu.score(ads)


def test_ranks_may_differ_across_tasks():
    rng = np.random.default_rng(8)
    ads = [{"m": _mod(rng, 8, 1, 6)}, {"m": _mod(rng, 8, 5, 6)}]
    sc = nu.score(ads)
    assert sc.modules["m"].sigma.shape == (2, 5)
    assert_scores_match(sc, ref_scores(ads), 1e-4)


@pytest.mark.parametrize("factor", ["lora_a", "lora_b"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_])
def test_non_floating_factors(factor, dtype):
    rng = np.random.default_rng(9)
    bad = _mod(rng)
    bad[factor] = np.ones(bad[factor].shape, dtype)
    with pytest.raises(
        TypeError,
        match=rf"nu\.score: {factor} of module 'm', task 1, has dtype .*expected a floating dtype",
    ):
        nu.score([{"m": _mod(rng)}, {"m": bad}])


def test_non_array_factor():
    rng = np.random.default_rng(10)
    bad = _mod(rng)
    bad["lora_a"] = [[1.0, 2.0]]
    with pytest.raises(
        TypeError, match=r"lora_a of module 'm', task 0, is a list; expected an array"
    ):
        nu.score([{"m": bad}])


def test_factor_not_2d():
    rng = np.random.default_rng(11)
    bad = _mod(rng)
    bad["lora_b"] = np.ones((2, 3, 6), np.float32)
    with pytest.raises(
        ValueError, match=r"lora_b of module 'm', task 1, has shape \(2, 3, 6\); expected 2-D"
    ):
        nu.score([{"m": _mod(rng)}, {"m": bad}])


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nonfinite_scale(value):
    rng = np.random.default_rng(12)
    ads = [{"m": _mod(rng, scale=np.float32(1.0))}, {"m": _mod(rng, scale=np.float32(value))}]
    with pytest.raises(
        ValueError,
        match=r"nu\.score: scale of module 'm', task 1 \(lora_a \(8, 3\), lora_b \(3, 6\)\), is .*expected a finite",
    ):
        nu.score(ads)
    with pytest.raises(ValueError, match=r"nu\.task_energies: scale of module 'm', task 1"):
        nu.task_energies(ads)


def test_non_scalar_scale():
    rng = np.random.default_rng(13)
    ads = [{"m": _mod(rng, scale=np.ones(3, np.float32))}]
    with pytest.raises(
        ValueError, match=r"scale of module 'm', task 0, has shape \(3,\); expected a scalar"
    ):
        nu.score(ads)


def test_stray_key_in_a_module():
    rng = np.random.default_rng(14)
    ads = [{"m": _mod(rng)}, {"m": _mod(rng, kernel=np.ones((8, 6), np.float32))}]
    with pytest.raises(
        ValueError, match=r"module 'm' of task 1 has keys \['kernel'\] besides.*nu\.extract_lora"
    ):
        nu.score(ads)


def test_stray_leaf_in_the_tree():
    rng = np.random.default_rng(15)
    ads = [{"m": _mod(rng)}, {"m": _mod(rng), "block": {"bias": np.ones(6, np.float32)}}]
    with pytest.raises(
        ValueError,
        match=r"adapter 1 has a leaf at 'block/bias' \(ndarray\) that is not part of a LoRA module.*"
        r"nu\.extract_lora",
    ):
        nu.score(ads)


def test_duplicate_module_names_are_rejected():
    """{"a/b": m1, "a": {"b": m2}} gives two modules the name "a/b": neither may be dropped."""
    rng = np.random.default_rng(19)
    ads = [{"a/b": _mod(rng), "a": {"b": _mod(rng)}} for _ in range(2)]
    with pytest.raises(ValueError, match=r"'a/b'"):
        nu.score(ads)


def test_module_missing_a_factor():
    rng = np.random.default_rng(16)
    m = _mod(rng)
    del m["lora_b"]
    with pytest.raises(ValueError, match=r"module 'm' of task 0 has no 'lora_b'"):
        nu.score([{"m": m}])


def test_module_none_in_every_task():
    rng = np.random.default_rng(17)
    ads = [{"a": _mod(rng), "gone": None}, {"a": _mod(rng), "gone": None}]
    with pytest.raises(ValueError, match=r"nu\.score: module 'gone' is None in every task"):
        nu.score(ads)


def test_adapter_without_modules():
    with pytest.raises(ValueError, match=r"adapter 0 has no LoRA modules"):
        nu.score([{}, {}])


def test_validation_runs_in_task_energies_and_heterogeneity():
    """Errors name the public function that was called."""
    rng = np.random.default_rng(18)
    ads = [{"a": _mod(rng)}, {"b": _mod(rng)}]
    with pytest.raises(ValueError, match=r"nu\.task_energies: module names differ"):
        nu.task_energies(ads)
    with pytest.raises(ValueError, match=r"nu\.heterogeneity: module names differ"):
        nu.heterogeneity(ads)


def test_cyclic_and_too_deep_adapters_are_refused():
    a = np.ones((4, 1), np.float32)
    cyc: dict = {"m": {"lora_a": a, "lora_b": np.ones((1, 3), np.float32)}}
    cyc["again"] = cyc
    with pytest.raises(nu.InputError, match=r"nu\.score: adapter 0 contains itself at 'again'"):
        nu.score([cyc])
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["k"] = {}
        node = node["k"]
    with pytest.raises(nu.InputError, match=r"adapter 0 is nested more than 64 levels deep"):
        nu.score([deep])


@pytest.mark.parametrize(
    "scale, err, match",
    [
        ("2.0", nu.InputTypeError, r"is '2\.0' \(str\); expected a real number"),
        (b"2", nu.InputTypeError, r"is b'2' \(bytes\)"),
        (np.bool_(True), nu.InputTypeError, r"is np\.True_ \(bool, dtype bool\)"),
        (np.complex64(1), nu.InputTypeError, r"\(complex64, dtype complex64\)"),
        ({"v": 1.0}, nu.InputTypeError, r"is \{'v': 1\.0\} \(dict\)"),
        (np.float32(np.nan), nu.InputError, r"\(lora_a \(8, 3\), lora_b \(3, 6\)\), is nan"),
        (np.zeros((1, 1), np.float32), nu.InputError, r"has shape \(1, 1\); expected a scalar"),
    ],
)
def test_scale_must_be_a_finite_real_scalar(scale, err, match):
    """Collected adapters (score, heterogeneity, and the merge side) refuse a scale that is not a
    real number with an error naming module and task; before, a string gave a raw TypeError."""
    rng = np.random.default_rng(20)
    ads = [{"m": _mod(rng)}, {"m": _mod(rng, scale=scale)}]
    with pytest.raises(err, match=r"nu\.score: scale of module 'm', task 1.*" + match):
        nu.score(ads)


def test_message_helpers_stay_short():
    t = importlib.import_module("netutility_jax._core.tree")
    assert t._few(["a"]) == "module 'a'"
    assert t._few([f"m{i}" for i in range(2000)]) == "modules 'm0', 'm1', 'm2' and 1997 more"
    assert len(t._few(["x" * 10**6] * 5)) < 400
    assert t.short("y" * 1000) == "y" * 40 + "..." + "y" * 37
    assert t.brief("z" * 10**6).startswith("'zzz") and len(t.brief("z" * 10**6)) < 80
    assert t.brief(np.zeros((3, 4))) == "<ndarray of shape (3, 4), dtype float64>"
    assert len(t.brief(list(range(10**5)))) < 80


@pytest.mark.parametrize(
    "x, ok",
    [
        (1, True),
        (2.5, True),
        (np.float32(1), True),
        (np.int8(3), True),
        (np.asarray(2.0), True),
        (jnp.asarray(1.5), True),
        (True, False),
        (np.bool_(False), False),
        (1j, False),
        ("1", False),
        (None, False),
        (np.ones(2), False),
        (np.asarray("a"), False),
    ],
)
def test_is_real_scalar(x, ok):
    t = importlib.import_module("netutility_jax._core.tree")
    assert t.is_real_scalar(x) is ok


class _RecycledViews:
    """A mapping that hands out a view object per lookup, as flax.nnx.State does, and recycles
    the views the walker let go of (a finalizer resurrects each into a pool, once): a later
    lookup returns the same object, so the same id, as CPython's allocator may at random."""

    pool: ClassVar[list[_RecycledViews]] = []
    reused: ClassVar[int] = 0

    def __init__(self, d):
        self.d = d

    @classmethod
    def of(cls, d):
        if cls.pool:
            cls.reused += 1
            view = cls.pool.pop()
        else:
            view = cls.__new__(cls)
        view.d = d
        return view

    def __del__(self):
        _RecycledViews.pool.append(self)

    def keys(self):
        return self.d.keys()

    def __getitem__(self, key):
        value = self.d[key]
        return _RecycledViews.of(value) if isinstance(value, dict) else value


def test_walker_cycle_check_is_not_fooled_by_reused_ids():
    rng = np.random.default_rng(0)
    raw = {
        f"l{i}": {
            "attn": {
                name: {
                    "lora": {"lora_a": rng.normal(size=(4, 2)), "lora_b": rng.normal(size=(2, 3))}
                }
                for name in ("q", "k", "v")
            }
        }
        for i in range(6)
    }
    want = [(f"l{i}", "attn", n, "lora") for i in range(6) for n in ("q", "k", "v")]
    _RecycledViews.pool.clear()
    _RecycledViews.reused = 0
    assert [p for p, _ in nu._core.tree.walk_modules(_RecycledViews.of(raw))] == want
    assert _RecycledViews.reused > 0  # the walk did meet recycled objects (reused ids)
    assert set(nu.extract_lora(_RecycledViews.of(raw))) == {"/".join(p) for p in want}
    looped = {"a": {}}
    looped["a"]["b"] = looped  # a real cycle is still refused
    with pytest.raises(nu.InputError, match="contains itself"):
        list(nu._core.tree.walk_modules(looped))
