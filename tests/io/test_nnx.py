"""nnx interop: extract -> merge -> apply against a numpy float64 forward of base + merged update."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import netutility_jax as nu
from netutility_jax import nnx as nu_nnx
from netutility_jax.errors import InputError

# one (d_in, d_out) for all modules: one bucket, one compile of each merge stage
D, H1, R = 12, 10, 4
NAMES = [
    "layers/0/mlp",
    "layers/0/query",
    "layers/0/value",
    "layers/1/mlp",
    "layers/1/query",
    "layers/1/value",
]


def _numpy_init(seed):
    # numpy initializers: flax's jax ones compile once per shape, seconds for a model this size
    rng = np.random.default_rng(seed)

    def init(key, shape, dtype=jnp.float32):
        return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), dtype)

    return {"kernel_init": init, "bias_init": init}


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, seed: int):
        kw = _numpy_init(seed)
        lora_kw = {"a_initializer": kw["kernel_init"], "b_initializer": kw["kernel_init"]}
        self.query = nnx.LoRALinear(D, H1, lora_rank=R, rngs=rngs, **kw, **lora_kw)
        self.value = nnx.LoRALinear(D, H1, lora_rank=R, rngs=rngs, **kw, **lora_kw)
        base = nnx.Linear(D, H1, rngs=rngs, **kw)
        self.mlp = nnx.LoRA(D, R, H1, base_module=base, rngs=rngs, **lora_kw)
        self.out = nnx.Linear(H1, D, rngs=rngs, **kw)

    def __call__(self, x):
        y = jnp.tanh(self.query(x)) + self.value(x) + jnp.tanh(self.mlp(x))
        return x + self.out(y)


class Model(nnx.Module):
    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([Block(rngs, seed + i) for i in range(2)])
        self.head = nnx.Linear(D, 3, rngs=rngs, **_numpy_init(seed + 7))

    def __call__(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _lora_of(model, name):
    layer = model
    for part in name.split("/"):
        layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
    return layer.lora if isinstance(layer, nnx.LoRALinear) else layer


def _randomize(model, seed):
    """A copy of ``model`` with random (trained-looking) LoRA factors in every layer."""
    rng = np.random.default_rng(seed)
    out = nnx.clone(model)
    for name in NAMES:
        lora = _lora_of(out, name)
        a, b = lora.lora_a, lora.lora_b
        a.set_value(jnp.asarray(rng.normal(size=a.shape) / np.sqrt(a.shape[0]), jnp.float32))
        b.set_value(jnp.asarray(rng.normal(size=b.shape) * 0.5, jnp.float32))
    return out


def _np(x):
    return np.asarray(x, np.float64)


def _dense(mod):
    if mod is None:
        return 0.0
    if "delta" in mod:
        return _np(mod["delta"])
    return float(mod.get("scale", 1.0)) * (_np(mod["lora_a"]) @ _np(mod["lora_b"]))


def _reference(model, merged, x):
    """numpy float64 forward of ``model``'s base weights plus the merged dense updates.

    The model's own LoRA factors are ignored: the result must replace them.
    """
    x = _np(x)
    upd = {name: _dense(merged[name]) for name in NAMES}

    def lin(layer, x, name=None):
        w = _np(layer.kernel.get_value()) + (upd[name] if name else 0.0)
        return x @ w + _np(layer.bias.get_value())

    for i, blk in enumerate(model.layers):
        p = f"layers/{i}/"
        y = np.tanh(lin(blk.query, x, p + "query")) + lin(blk.value, x, p + "value")
        y = y + np.tanh(lin(blk.mlp.base_module, x, p + "mlp"))
        x = x + lin(blk.out, y)
    return lin(model.head, x)


def _snapshot(model):
    return [np.array(v) for v in jax.tree.leaves(nnx.state(model))]


def _same(a, b):
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y)
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def setup():
    base = Model(0)
    tasks = [_randomize(base, seed) for seed in (1, 2, 3)]
    adapters = [nu_nnx.extract_adapter(t) for t in tasks]
    x = jnp.asarray(np.random.default_rng(9).normal(size=(5, D)), jnp.float32)
    # the target carries a LoRA branch of its own, which both modes must overwrite
    return {"target": tasks[0], "adapters": adapters, "x": x}


@pytest.fixture(scope="module")
def merged_ta(setup):
    return nu.merge_adapters(setup["adapters"], budget=3, method="ta")


@pytest.fixture(scope="module")
def merged_ties(setup):
    return nu.merge_adapters(setup["adapters"], budget=3, method="ties", space="full")


def test_extract_names_shapes_values(setup):
    target = setup["target"]
    ad = nu_nnx.extract_adapter(target)
    assert list(ad) == NAMES
    for name, mod in ad.items():
        d_in, d_out = D, H1
        assert set(mod) == {"lora_a", "lora_b", "scale"}
        assert isinstance(mod["lora_a"], jax.Array) and isinstance(mod["lora_b"], jax.Array)
        assert mod["lora_a"].shape == (d_in, R) and mod["lora_b"].shape == (R, d_out)
        assert mod["scale"] == 1.0
        lora = _lora_of(target, name)
        np.testing.assert_array_equal(mod["lora_a"], lora.lora_a.get_value())
        np.testing.assert_array_equal(mod["lora_b"], lora.lora_b.get_value())


def test_extract_apply_round_trip_is_bitwise(setup):
    target = setup["target"]
    ad = nu_nnx.extract_adapter(target)
    fresh = Model(5)
    back = nu_nnx.extract_adapter(nu_nnx.apply_adapter(fresh, ad, mode="lora"))
    assert list(back) == list(ad)
    for name in ad:
        for k in ("lora_a", "lora_b"):
            assert back[name][k].dtype == ad[name][k].dtype
            np.testing.assert_array_equal(back[name][k], ad[name][k])


def test_fold_low_rank_matches_numpy(setup, merged_ta):
    merged, rep = merged_ta
    assert all(r is not None for r in rep.ranks.values())
    target, x = setup["target"], setup["x"]
    before = _snapshot(target)
    new = nu_nnx.apply_adapter(target, merged, mode="fold")
    assert _same(before, _snapshot(target)), "apply_adapter mutated its input"
    for name in NAMES:
        assert not np.asarray(_lora_of(new, name).lora_b.get_value()).any()
    np.testing.assert_allclose(new(x), _reference(target, merged, x), rtol=1e-4, atol=1e-4)


def test_lora_mode_matches_numpy_with_merged_ranks(setup, merged_ta):
    merged, rep = merged_ta
    target, x = setup["target"], setup["x"]
    before = _snapshot(target)
    new = nu_nnx.apply_adapter(target, merged, mode="lora")
    assert _same(before, _snapshot(target)), "apply_adapter mutated its input"
    for name in NAMES:
        lora = _lora_of(new, name)
        assert isinstance(lora.lora_a, nnx.LoRAParam) and isinstance(lora.lora_b, nnx.LoRAParam)
        assert lora.lora_a.shape[1] == lora.lora_b.shape[0] == rep.ranks[name]
        assert _lora_of(target, name).lora_a.shape[1] == R
    assert len({rep.ranks[n] for n in NAMES}) > 1, "test wants modules of different merged rank"
    np.testing.assert_allclose(new(x), _reference(target, merged, x), rtol=1e-4, atol=1e-4)
    # the kernels are the target's, untouched
    k_new = _np(new.layers[0].query.kernel.get_value())
    np.testing.assert_array_equal(k_new, _np(target.layers[0].query.kernel.get_value()))


def test_fold_dense_ties_matches_numpy(setup, merged_ties):
    merged, rep = merged_ties
    assert all(r is None for r in rep.ranks.values()), "full-space TIES should be dense"
    target, x = setup["target"], setup["x"]
    new = nu_nnx.apply_adapter(target, merged, mode="fold")
    np.testing.assert_allclose(new(x), _reference(target, merged, x), rtol=1e-4, atol=1e-4)


def test_lora_mode_refuses_dense(setup, merged_ties):
    merged, _ = merged_ties
    msg = (
        "nu.nnx.apply_adapter: merged module 'layers/0/mlp' is dense ({'delta': (12, 10)}, from a "
        "full-space TIES/DARE merge) and has no LoRA factors; use mode='fold' to add it to the "
        "base kernel, or truncate it first with nu.to_lora(module, rank)."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        nu_nnx.apply_adapter(setup["target"], merged, mode="lora")
    # the documented fix works
    fixed = {k: nu.to_lora(v, 4) for k, v in merged.items()}
    new = nu_nnx.apply_adapter(setup["target"], fixed, mode="lora")
    assert _lora_of(new, "layers/0/mlp").lora_a.shape == (D, 4)


def test_names_must_match(setup, merged_ta):
    merged, _ = merged_ta
    missing = {k: v for k, v in merged.items() if k != "layers/1/value"}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "nu.nnx.apply_adapter: merged module names do not match the model: the model's LoRA "
            "layers ['layers/1/value'] have no merged module. Merge adapters extracted from this "
            "model architecture (nu.nnx.extract_adapter);"
        ),
    ):
        nu_nnx.apply_adapter(setup["target"], missing)
    extra = {**merged, "layers/2/query": merged["layers/0/query"]}
    with pytest.raises(
        ValueError, match=re.escape("merged modules ['layers/2/query'] are not LoRA layers")
    ):
        nu_nnx.apply_adapter(setup["target"], extra)


def test_nested_merged_adapter_is_accepted(setup, merged_ta):
    merged, _ = merged_ta
    nested: dict = {}
    for name, mod in merged.items():
        node = nested
        *head, last = name.split("/")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = mod
    a = nu_nnx.apply_adapter(setup["target"], nested, mode="fold")
    b = nu_nnx.apply_adapter(setup["target"], merged, mode="fold")
    np.testing.assert_array_equal(a(setup["x"]), b(setup["x"]))


def test_shape_mismatch_names_module(setup):
    ad = nu_nnx.extract_adapter(setup["target"])
    ad["layers/1/query"] = {"lora_a": jnp.ones((D + 1, 2)), "lora_b": jnp.ones((2, H1))}
    msg = (
        "nu.nnx.apply_adapter: merged module 'layers/1/query' (lora_a (13, 2), lora_b (2, 10)) is "
        "not (d_in, d_out) = (12, 10): the model's layer has (d_in, d_out) = (12, 10) (lora_a "
        "(12, 4), lora_b (4, 10)). Merge adapters extracted from this model "
        "(nu.nnx.extract_adapter)."
    )
    for mode in ("fold", "lora"):
        with pytest.raises(ValueError, match=re.escape(msg)):
            nu_nnx.apply_adapter(setup["target"], ad, mode=mode)
    ad["layers/1/query"] = {"delta": jnp.ones((H1, D))}
    with pytest.raises(ValueError, match=re.escape("'layers/1/query' (delta (10, 12)) is not")):
        nu_nnx.apply_adapter(setup["target"], ad, mode="fold")


def test_none_module_is_no_update(setup, merged_ta):
    merged, _ = merged_ta
    merged = {**merged, "layers/0/value": None}
    x = setup["x"]
    ref = _reference(setup["target"], merged, x)
    for mode in ("fold", "lora"):
        new = nu_nnx.apply_adapter(setup["target"], merged, mode=mode)
        np.testing.assert_allclose(new(x), ref, rtol=1e-4, atol=1e-4)


def test_bad_arguments():
    model = nnx.LoRALinear(4, 3, lora_rank=2, rngs=nnx.Rngs(0), **_numpy_init(0))
    good = nu_nnx.extract_adapter(model)
    with pytest.raises(ValueError, match=re.escape("nu.nnx.apply_adapter: unknown mode 'dense'")):
        nu_nnx.apply_adapter(model, good, mode="dense")
    with pytest.raises(TypeError, match=re.escape("expected a flax.nnx.Module, got int")):
        nu_nnx.extract_adapter(3)
    with pytest.raises(ValueError, match="the dict holds no LoRA layer"):  # a state without LoRA
        nu_nnx.extract_adapter({"w": 1})
    with pytest.raises(ValueError, match=re.escape("Linear has no LoRA layers")):
        nu_nnx.extract_adapter(nnx.Linear(2, 2, rngs=nnx.Rngs(0), **_numpy_init(0)))
    with pytest.raises(TypeError, match=re.escape("merged is a list")):
        nu_nnx.apply_adapter(model, [good])


class ScaledLoRA(nnx.LoRA):
    """A LoRA layer that stores its scale, as a lora_alpha / r subclass would."""

    def __init__(self, *args, scale, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = nnx.Variable(jnp.asarray(scale, jnp.float32))

    def __call__(self, x):
        return self.scale.get_value() * (x @ self.lora_a[...] @ self.lora_b[...])


def test_standalone_lora_and_stored_scale():
    rngs = nnx.Rngs(0)
    init = _numpy_init(0)["kernel_init"]
    kw = {"a_initializer": init, "b_initializer": init, "rngs": rngs}
    model = nnx.Dict(plain=nnx.LoRA(6, 2, 5, **kw), scaled=ScaledLoRA(6, 2, 5, scale=2.5, **kw))
    ad = nu_nnx.extract_adapter(model)
    assert list(ad) == ["plain", "scaled"]
    assert ad["plain"]["scale"] == 1.0 and ad["scaled"]["scale"] == 2.5
    override = nu_nnx.extract_adapter(model, scale={"plain": 0.25})
    assert override["plain"]["scale"] == 0.25 and override["scaled"]["scale"] == 2.5

    rng = np.random.default_rng(0)
    merged = {
        k: {
            "lora_a": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
            "lora_b": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
            "scale": 0.5,
        }
        for k in ("plain", "scaled")
    }
    new = nu_nnx.apply_adapter(model, merged, mode="lora")
    x = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    for k in ("plain", "scaled"):
        np.testing.assert_allclose(new[k](x), _np(x) @ _dense(merged[k]), rtol=1e-5, atol=1e-5)
    assert new["scaled"].scale.get_value() == 2.5  # the layer keeps its own scale

    msg = (
        "nu.nnx.apply_adapter: module 'plain' is an nnx.LoRA without a base kernel (base_module "
        "None); mode='fold' adds the update to a base module's `kernel`."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        nu_nnx.apply_adapter(model, merged, mode="fold")
    with pytest.raises(ValueError, match=re.escape("scale names ['nope'] are not LoRA layers")):
        nu_nnx.extract_adapter(model, scale={"nope": 1.0})
    with pytest.raises(ValueError, match=re.escape("scale of module 'plain' is nan")):
        nu_nnx.extract_adapter(model, scale=float("nan"))


def test_bf16_factors_keep_their_dtype():
    init = _numpy_init(0)["kernel_init"]
    model = nnx.LoRALinear(
        8,
        6,
        lora_rank=R,
        lora_param_dtype=jnp.bfloat16,
        a_initializer=init,
        b_initializer=init,
        rngs=nnx.Rngs(0),
        **_numpy_init(1),
    )
    ad = nu_nnx.extract_adapter(model)
    assert ad["lora"]["lora_a"].dtype == jnp.bfloat16
    merged = {"lora": {"lora_a": jnp.ones((8, 2)), "lora_b": jnp.ones((2, 6)), "scale": 0.5}}
    new = nu_nnx.apply_adapter(model, merged, mode="lora")
    assert new.lora.lora_a.get_value().dtype == jnp.bfloat16
    assert new.lora.lora_b.get_value().dtype == jnp.bfloat16
    assert new.lora.lora_a.shape == (8, 2)
    folded = nu_nnx.apply_adapter(model, merged, mode="fold")
    assert folded.kernel.get_value().dtype == model.kernel.get_value().dtype


@pytest.mark.parametrize("pure", [False, True], ids=["State", "pure_dict"])
def test_extract_from_a_lora_state_names_modules_as_from_the_model(setup, pure):
    target = setup["target"]
    state = nnx.state(target, nnx.LoRAParam)
    got = nu_nnx.extract_adapter(nnx.to_pure_dict(state) if pure else state)
    want = nu_nnx.extract_adapter(target)
    assert list(got) == list(want) == NAMES  # ".../query", not ".../query/lora"
    for name in want:
        assert got[name]["scale"] == 1.0
        for k in ("lora_a", "lora_b"):
            np.testing.assert_array_equal(got[name][k], want[name][k])
    scaled = nu_nnx.extract_adapter(state, scale={NAMES[0]: 0.5})
    assert scaled[NAMES[0]]["scale"] == 0.5 and scaled[NAMES[1]]["scale"] == 1.0


def test_a_merge_of_lora_states_applies_to_the_model(setup):
    states = [nnx.state(_randomize(Model(0), seed), nnx.LoRAParam) for seed in (1, 2, 3)]
    merged, _ = nu.merge_adapters(states, budget=3, method="ta")  # modules at ".../query/lora"
    assert set(merged["layers"][0]["query"]) == {"lora"}
    via_extract, _ = nu.merge_adapters(
        [nu_nnx.extract_adapter(s) for s in states], budget=3, method="ta"
    )
    x = setup["x"]
    for mode in ("fold", "lora"):
        a = nu_nnx.apply_adapter(setup["target"], merged, mode=mode)(x)
        b = nu_nnx.apply_adapter(setup["target"], via_extract, mode=mode)(x)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_state_without_lora_is_refused():
    with pytest.raises(InputError, match="holds no LoRA layer"):
        nu_nnx.extract_adapter(nnx.state(nnx.Linear(4, 4, rngs=nnx.Rngs(0))))
    with pytest.raises(InputError, match="are not LoRA layers of the state"):
        nu_nnx.extract_adapter(nnx.state(Model(0), nnx.LoRAParam), scale={"nope": 2.0})


# --- a Flax user's own objects (issue 46): orbax restores, one naming of modules, messages


class Small(nnx.Module):
    """A Flax user's model: an nnx.LoRALinear, then an nnx.LoRA around an nnx.Linear."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed)
        kw = _numpy_init(seed)
        lora_kw = {"a_initializer": kw["kernel_init"], "b_initializer": kw["kernel_init"]}
        self.fc1 = nnx.LoRALinear(D, H1, lora_rank=R, rngs=rngs, **kw, **lora_kw)
        base = nnx.Linear(H1, D, rngs=rngs, **kw)
        self.fc2 = nnx.LoRA(H1, R, D, base_module=base, rngs=rngs, **lora_kw)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def _small_task(base, seed):
    """A copy of ``base`` with random (trained-looking) factors in both LoRA layers."""
    rng = np.random.default_rng(seed)
    out = nnx.clone(base)
    for lora in (out.fc1.lora, out.fc2):
        for v in (lora.lora_a, lora.lora_b):
            v.set_value(jnp.asarray(rng.normal(size=v.shape) / 2, jnp.float32))
    return out


@pytest.fixture(scope="module")
def small():
    base = Small(0)
    return {"base": base, "tasks": [_small_task(base, seed) for seed in (11, 12, 13)]}


def _assert_same_adapter(got, want):
    assert list(got) == list(want)
    for name in want:
        assert set(got[name]) == set(want[name]) == {"lora_a", "lora_b", "scale"}
        assert got[name]["scale"] == want[name]["scale"]
        for k in ("lora_a", "lora_b"):
            a, b = got[name][k], want[name][k]
            assert isinstance(a, jax.Array) and a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("names", ["layer", "path"])
def test_orbax_restore_with_and_without_target_extracts_bit_for_bit(small, tmp_path, names):
    import orbax.checkpoint as ocp

    model = small["tasks"][0]
    path = tmp_path / "task0"
    # the target as flax's docs build it: the state of an abstract model
    target = nnx.state(nnx.eval_shape(lambda: Small(0)), nnx.LoRAParam)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, nnx.state(model, nnx.LoRAParam))
        ckpt.wait_until_finished()
        with warnings.catch_warnings():
            # (older orbax, e.g. the 0.11.20 floor, warns that a restore without sharding
            # information reads it from the checkpoint: both restores here are such)
            warnings.filterwarnings("ignore", "Sharding info not provided", UserWarning)
            raw = ckpt.restore(path)
            typed = ckpt.restore(path, target)
    # without a target orbax does not know the Variable types: each is {'value': array}
    assert set(raw["fc2"]["lora_a"]) == {"value"}
    assert set(raw["fc1"]["lora"]["lora_b"]) == {"value"}
    assert isinstance(typed["fc2"]["lora_a"], nnx.LoRAParam)
    want = nu_nnx.extract_adapter(model, names=names)
    assert list(want) == (["fc1", "fc2"] if names == "layer" else ["fc1/lora", "fc2"])
    for restored in (raw, typed, nnx.to_pure_dict(typed)):
        _assert_same_adapter(nu_nnx.extract_adapter(restored, names=names), want)
    # and the raw restore goes on through the public API as the model's adapter does
    scale = {"fc1/lora": 0.5, "fc2": 2.0}  # path names are accepted in either naming
    a = nu_nnx.extract_adapter(raw, scale=scale)
    b = nu_nnx.extract_adapter(model, scale=scale)
    assert a["fc1"]["scale"] == b["fc1"]["scale"] == 0.5 and a["fc2"]["scale"] == 2.0


def test_a_restored_state_that_is_not_one_is_refused_naming_the_fix():
    rng = np.random.default_rng(0)
    arr = {"lora_a": rng.normal(size=(4, 2)), "lora_b": rng.normal(size=(2, 3))}
    fix = (
        "restore with a target, checkpointer.restore(path, nnx.state(model, nnx.LoRAParam)), or "
        "pass the model."
    )
    bad = {"fc": {"lora_a": {"val": arr["lora_a"]}, "lora_b": {"value": arr["lora_b"]}}}
    msg = (
        "nu.nnx.extract_adapter: lora_a of module 'fc' is a dict with keys ['val']; expected an "
        "array, an nnx Variable, or {'value': array} (a Variable as orbax's "
        f"StandardCheckpointer.restore(path) gives it back without a target). Or {fix}"
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        nu_nnx.extract_adapter(bad)
    bad = {"fc": {"lora_a": {"value": "abc"}, "lora_b": arr["lora_b"]}}
    msg = (
        "nu.nnx.extract_adapter: lora_a of module 'fc' is an array of dtype <U3; expected a "
        f"floating array (d_in, r). If the state was read from a checkpoint, {fix}"
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        nu_nnx.extract_adapter(bad)
    bad = {"fc": {"lora_a": {"value": np.ones((4, 2, 1))}, "lora_b": arr["lora_b"]}}
    msg = (
        "nu.nnx.extract_adapter: lora_a of module 'fc' has shape (4, 2, 1); expected 2-D (d_in, r)."
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        nu_nnx.extract_adapter(bad)
    bad = {"fc": {"lora_a": arr["lora_a"], "lora_b": {"value": np.ones((3, 3))}}}
    msg = (
        "nu.nnx.extract_adapter: factors of module 'fc' do not chain: lora_a (4, 2) is "
        "(d_in, r=2) but lora_b (3, 3) is (r=3, d_out)."
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        nu_nnx.extract_adapter(bad)
    msg = (
        "nu.nnx.extract_adapter: names='flat'; expected 'layer' (a module named by its layer, "
        "'layers/0/query') or 'path' (by its nnx.LoRA's state path, 'layers/0/query/lora', as "
        "nu.score names an nnx.State's modules)."
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        nu_nnx.extract_adapter(arr, names="flat")


def _flat(merged):
    """A merge's modules by "/"-joined path (nu.merge keeps a State's nesting)."""
    out = {}

    def walk(node, prefix):
        if "lora_a" in node or "delta" in node:
            out[prefix] = node
            return
        for k, v in node.items():
            walk(v, f"{prefix}/{k}" if prefix else str(k))

    walk(merged, "")
    return out


def _assert_same_merge(a, b):
    a, b = _flat(a), _flat(b)
    assert list(a) == list(b)
    for name in a:
        assert set(a[name]) == set(b[name])
        for k in a[name]:
            x, y = np.asarray(a[name][k]), np.asarray(b[name][k])
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)


def test_masks_fit_across_entry_points_by_path_names(small):
    tasks = small["tasks"]
    states = [nnx.state(t, nnx.LoRAParam) for t in tasks]
    by_layer = [nu_nnx.extract_adapter(t) for t in tasks]
    by_path = [nu_nnx.extract_adapter(t, names="path") for t in tasks]
    # the state's own key paths, as nu.score names the modules of an nnx.State passed directly
    masks_state = nu.allocate(nu.score(states), budget=2)
    masks_path = nu.allocate(nu.score(by_path), budget=2)
    masks_layer = nu.allocate(nu.score(by_layer), budget=2)
    assert list(masks_state) == list(masks_path) == ["fc1/lora", "fc2"]
    assert list(masks_layer) == ["fc1", "fc2"]
    layer_of = {"fc1/lora": "fc1", "fc2": "fc2"}
    for name, m in masks_state.items():
        np.testing.assert_array_equal(np.asarray(m), np.asarray(masks_path[name]))
        np.testing.assert_array_equal(np.asarray(m), np.asarray(masks_layer[layer_of[name]]))
    kept = sum(int(np.asarray(m).sum()) for m in masks_state.values())
    assert 0 < kept < sum(np.asarray(m).size for m in masks_state.values())

    # masks from nu.score(states) with the model's adapters, and the model's masks with states
    ref = nu.merge(states, masks_state)
    _assert_same_merge(nu.merge(by_path, masks_state), ref)
    _assert_same_merge(nu.merge(states, masks_path), ref)
    # the layer names are the same modules: the same merge under the other spelling
    via_layer = nu.merge(by_layer, masks_layer)
    _assert_same_merge({layer_of[k]: v for k, v in _flat(ref).items()}, via_layer)
    # apply_adapter reads both spellings: the same model either way
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, D)), jnp.float32)
    for mode in ("fold", "lora"):
        a = nu_nnx.apply_adapter(small["base"], ref, mode=mode)(x)
        b = nu_nnx.apply_adapter(small["base"], via_layer, mode=mode)(x)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_both_spellings_name_one_layer():
    model = _small_task(Small(0), 1)
    with pytest.raises(
        InputError,
        match=re.escape(
            "nu.nnx.extract_adapter: scale names 'fc1' and 'fc1/lora' are the same LoRA layer "
            "(its layer name and its path name); give its scale once."
        ),
    ):
        nu_nnx.extract_adapter(model, scale={"fc1": 1.0, "fc1/lora": 2.0})
    msg = (
        "nu.nnx.extract_adapter: scale names ['fc3'] are not LoRA layers of the model; they are "
        "['fc1', 'fc2'] (or their path names ['fc1/lora', 'fc2'])."
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        nu_nnx.extract_adapter(model, scale={"fc3": 1.0})
    # a model that is one LoRA layer: "lora" by layer, its state path ("" for an nnx.LoRA) by path
    init = _numpy_init(0)["kernel_init"]
    for root, path in (
        (nnx.LoRA(4, 2, 3, a_initializer=init, b_initializer=init, rngs=nnx.Rngs(0)), ""),
        (nnx.LoRALinear(4, 3, lora_rank=2, rngs=nnx.Rngs(0), **_numpy_init(0)), "lora"),
    ):
        state = nnx.state(root, nnx.LoRAParam)
        assert list(nu.score([state], lam=1.0).modules) == [path]
        for src in (root, state):
            assert list(nu_nnx.extract_adapter(src)) == ["lora"]
            assert list(nu_nnx.extract_adapter(src, names="path")) == [path]
        ad = nu_nnx.extract_adapter(root, names="path")
        _assert_same_adapter(nu_nnx.extract_adapter(state, names="path"), ad)
        new = nu_nnx.apply_adapter(root, ad, mode="lora")  # its path name is read as "lora"
        _assert_same_adapter(nu_nnx.extract_adapter(new), nu_nnx.extract_adapter(root))


def test_masks_of_a_state_fit_the_models_default_adapters(small):
    tasks = small["tasks"]
    states = [nnx.state(t, nnx.LoRAParam) for t in tasks]
    by_layer = [nu_nnx.extract_adapter(t) for t in tasks]
    masks_state = nu.allocate(nu.score(states), budget=2)  # "fc1/lora", "fc2"
    masks_layer = nu.allocate(nu.score(by_layer), budget=2)  # "fc1", "fc2"
    _assert_same_merge(nu.merge(by_layer, masks_state), nu.merge(by_layer, masks_layer))
    _assert_same_merge(nu.merge(states, masks_layer), nu.merge(states, masks_state))


def test_fold_on_an_nnx_param_state_names_the_kernel_and_apply_adapter(small):
    tasks, base = small["tasks"], small["base"]
    params = nnx.state(base, nnx.Param)
    merged = nu.merge([nu_nnx.extract_adapter(t) for t in tasks])
    msg = (
        "nu.fold: params at 'fc2' has no 'kernel' entry (its keys: ['base_module', 'lora_a', "
        "'lora_b']); its base kernel is nested at 'fc2/base_module/kernel' (an nnx.LoRA's "
        "base_module). For an nnx model use nu.nnx.apply_adapter(model, merged, mode='fold'), "
        "which folds into that kernel; nu.fold needs each module's base kernel (d_in, d_out) at "
        "the module's path, as the array or {'kernel': array}."
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        nu.fold(params, merged)
    # a merge of the LoRA states names the nnx.LoRALinear's module by its lora child
    by_state = nu.merge([nnx.state(t, nnx.LoRAParam) for t in tasks])
    msg = (
        "nu.fold: params at 'fc1/lora' has no 'kernel' entry (its keys: ['lora_a', 'lora_b']); "
        "'fc1/lora' is an nnx.LoRALinear's lora child (a LoRA state merged directly names it "
        "so) and its base kernel is its parent's, 'fc1/kernel'. Merge "
        "nu.nnx.extract_adapter(state) of each task (modules named by layer), or for an nnx "
        "model use nu.nnx.apply_adapter(model, merged, mode='fold')."
    )
    with pytest.raises(InputError, match=re.escape(msg)):
        nu.fold(params, by_state)
    msg = (
        "nu.fold: params at 'q' has no 'kernel' entry (its keys: ['w']); nu.fold needs each "
        "module's base kernel (d_in, d_out) at the module's path, as the array or "
        "{'kernel': array}. For an nnx model use nu.nnx.apply_adapter(model, merged, "
        "mode='fold')."
    )
    q = {"lora_a": np.ones((4, 1)), "lora_b": np.ones((1, 3))}
    with pytest.raises(InputError, match=re.escape(msg)):
        nu.fold({"q": {"w": np.zeros((4, 3))}}, {"q": q})
    # the fix the first message names: both kernels get W + dK
    for m in (merged, by_state):
        new = nu_nnx.apply_adapter(base, m, mode="fold")
        for got, w, upd in (
            (new.fc1.kernel, base.fc1.kernel, _flat(m)["fc1/lora" if m is by_state else "fc1"]),
            (new.fc2.base_module.kernel, base.fc2.base_module.kernel, _flat(m)["fc2"]),
        ):
            np.testing.assert_allclose(
                _np(got.get_value()), _np(w.get_value()) + _dense(upd), rtol=1e-5, atol=1e-5
            )


def test_score_of_a_dict_of_tasks_says_to_pass_its_values(small):
    ads = [nu_nnx.extract_adapter(t) for t in small["tasks"][:2]]
    msg = (
        "nu.score: expected a sequence of adapters (one per task), got a dict of 2 adapters "
        "('sql', 'math') with the same modules: pass list(d.values()) for one task per value "
        "(or [d] if the dict is one adapter)."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        nu.score({"sql": ads[0], "math": ads[1]})
    msg = (
        "nu.score: expected a sequence of adapters (one per task), got a dict: wrap a single "
        "adapter in a list, [adapter]; for a dict of tasks ({'sql': adapter, ...}) pass "
        "list(d.values())."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        nu.score(ads[0])
