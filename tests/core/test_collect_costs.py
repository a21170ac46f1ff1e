"""``_tree.collect``'s fast paths (one pass over plain dicts, checks decided once per dtype) and
``_buckets.host_scales``'s (Python floats converted in one call) give what the checks one by one
give: the same buckets, the same scales bit for bit, and on bad input the same error."""

from __future__ import annotations

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import FrozenDict

from netutility_jax._core import buckets as _buckets
from netutility_jax._core import tree as _tree
from netutility_jax.errors import InputError, InputTypeError


class _Var:
    """A ``flax.nnx`` Variable's interface: the array behind ``get_value``."""

    def __init__(self, value):
        self.value_ = value

    def get_value(self):
        return self.value_


def _mod(d_in=4, r=2, d_out=3, dtype=np.float32, **extra):
    m = {"lora_a": np.ones((d_in, r), dtype), "lora_b": np.ones((r, d_out), dtype)}
    m.update(extra)
    return m


def _slow(monkeypatch):
    """Turn the fast paths off: every tree takes the full walk and the checks one by one."""
    monkeypatch.setattr(_tree, "_flatten_dicts", lambda adapter: None)
    monkeypatch.setattr(_tree, "_group_fast", lambda names, flat: None)


# ------------------------------------------------------------------------------------------------
# A straightforward reference of collect's result (valid adapters)
# ------------------------------------------------------------------------------------------------


def _ref_flatten(tree, path=()):
    out = {}
    for k in tree.keys():
        v, p = tree[k], (*path, str(k))
        if v is None:
            out["/".join(p)] = None
        elif "lora_a" in v.keys() or "lora_b" in v.keys():
            s = v["scale"] if "scale" in v.keys() else 1.0
            out["/".join(p)] = tuple(_tree.unwrap(x) for x in (v["lora_a"], v["lora_b"], s))
        else:
            out.update(_ref_flatten(v, p))
    return out


def _ref_collect(adapters):
    flat = [_ref_flatten(ad) for ad in adapters]
    names = list(flat[0])
    groups = {}
    for n in names:
        mods = [f[n] for f in flat]
        present = [m for m in mods if m is not None]
        key = (present[0][0].shape[0], present[0][1].shape[1], max(m[0].shape[1] for m in present))
        groups.setdefault(key, []).append((n, mods))
    return names, groups


def _assert_collect_is_reference(adapters):
    names, buckets, m_tasks = _tree.collect(adapters, fn="t")
    want_names, want = _ref_collect(adapters)
    assert names == want_names and m_tasks == len(adapters)
    assert [(bk.d_in, bk.d_out, bk.r_max) for bk in buckets] == list(want)
    for bk, items in zip(buckets, want.values(), strict=True):
        assert bk.names == tuple(n for n, _ in items)
        for row, (_, mods) in zip(bk.modules, items, strict=True):
            for m, w in zip(row, mods, strict=True):
                if w is None:
                    assert m is None
                else:
                    assert isinstance(m, _tree.Module)
                    assert (m.lora_a, m.lora_b) == (w[0], w[1])  # the same objects, not copies
                    assert m.lora_a is w[0] and m.lora_b is w[1]
                    assert m.scale is w[2] or m.scale == w[2]
                    assert m == _tree.Module(w[0], w[1], m.scale)
    return buckets


def _varied(mapping=dict):
    """Two tasks: nesting, flat keys with '/', int keys, ranks and dtypes that differ, scales of
    every kind or none, None modules, key orders that differ between tasks."""
    t0 = mapping(
        {
            "block": mapping(
                {
                    "q": mapping(_mod(r=2, scale=0.5)),
                    "k": mapping(_mod(6, 1, 6, np.float64)),
                    3: mapping(_mod(4, 2, 3, jnp.bfloat16, scale=np.float32(2.0))),
                }
            ),
            "flat/name": mapping(_mod(5, 3, 2, np.float16, scale=2)),
            "gone": None,
            "deep": mapping({"er": mapping({"v": mapping(_mod(scale=jnp.asarray(1.5)))})}),
            "empty": mapping({}),
        }
    )
    t1 = mapping(
        {
            "deep": mapping({"er": mapping({"v": None})}),
            "gone": mapping(
                {"lora_a": _Var(np.ones((4, 4), np.float32)), "lora_b": np.ones((4, 3), np.float32)}
            ),
            "flat/name": mapping(_mod(5, 1, 2, scale=np.float64(0.25))),
            "block": mapping(
                {
                    3: mapping(_mod(4, 4, 3, scale=-1.0)),
                    "k": mapping(_mod(6, 2, 6, scale=np.asarray(3.0))),
                    "q": mapping(_mod(r=5)),
                }
            ),
        }
    )
    return [t0, t1]


@pytest.mark.parametrize("mapping", [dict, collections.OrderedDict, FrozenDict])
def test_collect_matches_a_straightforward_reference(mapping):
    _assert_collect_is_reference(_varied(mapping))


def test_collect_matches_the_reference_on_mixed_mapping_types():
    ads = _varied()
    ads[1]["block"] = FrozenDict(ads[1]["block"])
    ads[0]["deep"] = collections.OrderedDict(ads[0]["deep"])
    _assert_collect_is_reference(ads)


def test_collect_fast_and_checked_paths_agree(monkeypatch):
    ads = _varied()
    names, fast, m = _tree.collect(ads, fn="t")
    assert _tree._flatten_dicts(ads[0]) is not None  # plain dicts take the fast walk
    flat = [_tree.flatten_modules(ad, fn="t", task=i) for i, ad in enumerate(ads)]
    assert _tree._group_fast(names, flat) is not None
    _slow(monkeypatch)
    assert _tree.collect(ads, fn="t") == (names, fast, m)


def test_collect_under_jit_checks_traced_factors_and_scales(monkeypatch):
    ads = [
        {"a": {"q": _mod(scale=0.5)}, "b": _mod(5, 3, 2, np.float16)},
        {"a": {"q": _mod(r=4, scale=2.0)}, "b": None},
    ]
    seen = []

    def f(ads):
        _, buckets, _ = _tree.collect(ads, fn="t")
        seen.append([(bk.names, bk.d_in, bk.d_out, bk.r_max) for bk in buckets])
        return [m.scale for bk in buckets for row in bk.modules for m in row if m is not None]

    jax.make_jaxpr(lambda a: f(a))(ads)  # a new function: traced again
    _slow(monkeypatch)
    jax.make_jaxpr(lambda a: f(a))(ads)  # a new function: traced again
    assert seen[0] == seen[1] == [(("a/q",), 4, 3, 4), (("b",), 5, 2, 3)]


def test_many_modules_take_the_fast_paths():
    """The 70B-like case: plain dicts of float32 factors and float scales, no fallback."""
    ads = [
        {f"l{j}": {p: _mod(scale=1.0) for p in ("q", "k", "v")} for j in range(20)}
        for _ in range(4)
    ]
    flat = [_tree._flatten_dicts(ad) for ad in ads]
    assert all(f is not None for f in flat)
    names = list(flat[0])
    assert _tree._group_fast(names, flat) is not None
    _assert_collect_is_reference(ads)


# ------------------------------------------------------------------------------------------------
# Bad inputs: the same error, in the same order, with and without the fast paths
# ------------------------------------------------------------------------------------------------


def _cycle():
    ads = _varied()
    ads[1]["block"]["again"] = ads[1]
    return ads


def _deep(levels):
    ads = _varied()
    node = ads[0]["empty"]
    for _ in range(levels):
        node = node.setdefault("d", {})
    node["m"] = _mod()
    for ad in ads[1:]:
        ad["empty"] = ads[0]["empty"]
    return ads


def _edit(fn):
    ads = _varied()
    fn(ads)
    return ads


def _set(task, path, key, value):
    def edit(ads):
        node = ads[task]
        for k in path:
            node = node[k]
        if value is _DELETE:
            del node[key]
        else:
            node[key] = value

    return _edit(edit)


_DELETE = object()

_BAD = {
    "nan scale": _set(1, ("block", "q"), "scale", float("nan")),
    "inf scale": _set(0, ("block", "q"), "scale", float("inf")),
    "huge int scale": _set(0, ("block", "q"), "scale", 10**400),
    "str scale": _set(1, ("block", "k"), "scale", "2"),
    "bool scale": _set(1, ("block", "k"), "scale", True),
    "complex scale": _set(1, ("block", "k"), "scale", 1 + 1j),
    "vector scale": _set(0, ("block", "q"), "scale", np.ones(3)),
    "inf array scale": _set(0, ("block", "q"), "scale", jnp.asarray(jnp.inf)),
    "int factor": _set(1, ("block", "q"), "lora_b", np.ones((5, 3), np.int32)),
    "list factor": _set(0, ("block", "q"), "lora_a", [[1.0]]),
    "3-D factor": _set(1, ("block", "q"), "lora_b", np.ones((5, 3, 1), np.float32)),
    "no chain": _set(1, ("block", "q"), "lora_b", np.ones((4, 3), np.float32)),
    "d_in differs": _set(1, ("block", "q"), "lora_a", np.ones((7, 5), np.float32)),
    "missing factor": _set(1, ("block", "q"), "lora_b", _DELETE),
    "stray key": _set(1, ("block", "q"), "kernel", np.ones(2)),
    "stray leaf": _set(0, ("block",), "bias", np.ones(3)),
    "names differ": _set(1, (), "extra", _mod()),
    "None everywhere": _edit(lambda ads: [ad.__setitem__("flat/name", None) for ad in ads]),
    "duplicate name": _set(0, (), "flat", {"name": None}),
    "cycle": _cycle(),
    "64 levels": _deep(62),  # fine: the module sits at depth 64
    "65 levels": _deep(63),
    "module as root": _edit(lambda ads: ads.__setitem__(1, _mod())),
    "two errors, two modules": _edit(
        lambda ads: (
            ads[1]["deep"]["er"].__setitem__("v", _mod(scale=float("nan"))),
            ads[0]["block"]["k"].__setitem__("lora_b", np.ones((9, 6), np.float32)),
        )
    ),
    "two errors, one module": _edit(
        lambda ads: (
            ads[1]["block"]["q"].__setitem__("lora_a", np.ones((4, 1), np.float32)),
            ads[0]["block"]["q"].__setitem__("scale", "x"),
        )
    ),
}


def _outcome(adapters):
    try:
        names, buckets, m = _tree.collect(adapters, fn="nu.t")
    except Exception as e:
        return type(e), str(e)
    return names, buckets, m


@pytest.mark.parametrize("case", list(_BAD))
def test_bad_inputs_raise_what_the_checks_one_by_one_raise(case, monkeypatch):
    ads = _BAD[case]
    fast = _outcome(ads)
    _slow(monkeypatch)
    assert fast == _outcome(ads)


@pytest.mark.parametrize(
    ("case", "err", "match"),
    [
        ("nan scale", InputError, r"scale of module 'block/q', task 1 \(lora_a"),
        ("list factor", InputTypeError, r"lora_a of module 'block/q', task 0, is a list"),
        ("cycle", InputError, r"adapter 1 contains itself at 'block/again'"),
        ("65 levels", InputError, r"adapter 0 is nested more than 64 levels deep"),
        ("duplicate name", InputError, r"adapter 0 has two modules named 'flat/name'"),
        # the first error in module then task order
        ("two errors, two modules", InputError, r"factors of module 'block/k', task 0"),
        ("two errors, one module", InputTypeError, r"scale of module 'block/q', task 0"),
    ],
)
def test_bad_inputs_name_the_first_error(case, err, match):
    with pytest.raises(err, match=r"^nu\.t: .*" + match):
        _tree.collect(_BAD[case], fn="nu.t")


def test_sixty_four_levels_are_fine():
    _assert_collect_is_reference(_BAD["64 levels"])


# ------------------------------------------------------------------------------------------------
# Scales and dtypes
# ------------------------------------------------------------------------------------------------

_FLOATS = [0.0, -0.0, 1.0, 0.1, 1 / 3, 1e-45, 1e-40, 3.4028235e38, 3.4028236e38, 1e300, -1e300]
_FLOATS += [float("inf"), -float("inf"), float("nan"), 2.0**-149, 1 + 2.0**-24, 1 + 2.0**-23]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, jnp.bfloat16, np.float16])
def test_host_scales_of_python_floats_are_the_per_leaf_conversion(dtype):
    s = tuple(tuple(row) for row in np.reshape(_FLOATS[:16], (4, 4)).tolist())
    got = _buckets.host_scales(s, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.array([[np.asarray(x).astype(dtype) for x in row] for row in s], dtype)
    assert got.dtype == want.dtype and got.shape == want.shape == (4, 4)
    assert got.tobytes() == want.tobytes()


def test_host_scales_of_other_scalars_and_of_tracers():
    s = ((1.0, np.float32(2.5), 3), (jnp.asarray(0.5), 0.0, np.asarray(1e300)))
    with np.errstate(over="ignore"):
        want = np.array([[np.asarray(x).astype(np.float32) for x in r] for r in s], np.float32)
    assert _buckets.host_scales(s, np.float32).tobytes() == want.tobytes()
    seen = []
    jax.jit(lambda x: seen.append(_buckets.host_scales(((1.0, x),), np.float32)) or x)(2.0)
    assert seen == [None]


@pytest.mark.parametrize("x64", [False, True])
def test_compute_dtype_is_the_rule_over_every_factor(x64):
    for dtypes in itertools.product([np.float32, jnp.bfloat16, np.float64, np.float16], repeat=2):
        ads = [{"m": _mod(dtype=dtypes[0]), "n": _mod(5, 2, 2, dtypes[1])}, {"m": None, "n": None}]
        every = [d for m in ads[0].values() for d in (m["lora_a"].dtype, m["lora_b"].dtype)]
        with jax.enable_x64(x64):
            _, buckets, _ = _tree.collect(ads, fn="t")
            got = _tree.compute_dtype(buckets)
            assert got == _tree.float_dtype(*every)
        assert (got == np.float64) == (x64 and np.float64 in dtypes)


def test_unwrap_decides_per_type_but_still_unwraps_variables():
    x = np.ones(2)
    assert _tree.unwrap(x) is x and _tree.unwrap(1.0) == 1.0
    assert _tree.unwrap(_Var(x)) is x

    class Spoof:  # claims another class: decided each time, never cached
        __class__ = np.ndarray  # type: ignore[assignment]

        def get_value(self):
            return "v"

    sp = Spoof()
    assert _tree.unwrap(sp) is sp
    assert Spoof not in _tree.PLAIN_TYPES
