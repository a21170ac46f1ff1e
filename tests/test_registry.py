"""The method/space registry: one declaration per method, read by merge, merge_adapters and the CLI.

Checks that the declarations hold (result form per space, options' defaults and ranges), that a
method added with one ``MethodSpec`` runs end to end (against a float64 reference), the TIES
option rename (``scope`` -> ``trim_scope``) with its deprecation, and model-wide TIES through
``merge_adapters`` and the command line.
"""

from __future__ import annotations

import warnings

import _merge_reference as ref
import jax
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import cli, registry
from netutility_jax.errors import InputError, InputTypeError

SPEC = (("a/q", 12, 9, (3, 2, 3)), ("a/v", 12, 9, (2, 3, 3)), ("b/up", 7, 10, (3, 3, 1)))


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _ads(seed=0):
    return ref.make_adapters(seed, 3, SPEC)


def _opts(spec: registry.MethodSpec) -> dict:
    return {o.name: 0.3 for o in spec.options if o.required}


@pytest.mark.parametrize(
    "name",
    # the default suite checks one method of each kind (TIES, 10 s, is in the slow tier);
    # the others, each also checked against float64 in test_merge.py, run with -m slow
    [
        n if n in ("ta", "tsv") else pytest.param(n, marks=pytest.mark.slow)
        for n in registry.METHODS
    ],
)
def test_every_method_returns_the_declared_form_in_every_space(name):
    """The declared result form per space, and ``same_spaces`` (what the experiment relies on to
    run a merge once for several spaces): identical results within each group."""
    spec = registry.METHODS[name]
    ads = _ads()
    key = jax.random.key(0) if spec.needs_key else None
    outs = {s: nu.merge(ads, method=name, space=s, key=key, **_opts(spec)) for s in spec.spaces}
    for space, out in outs.items():
        for n, _, _, _ in SPEC:
            assert ("lora_a" in out[n]) == spec.low_rank_in(space), (name, space, n)
            assert ("delta" in out[n]) != spec.low_rank_in(space)
    for group in spec.same_spaces:
        for s in group[1:]:
            for n, _, _, _ in SPEC:
                np.testing.assert_allclose(
                    ref.dense(outs[s][n]), ref.dense(outs[group[0]][n]), atol=1e-9,
                    err_msg=f"{name} {s} {n}",
                )  # fmt: skip


def test_option_tables_and_checks_come_from_the_declarations():
    from netutility_jax import merging

    for name, spec in registry.METHODS.items():
        assert merging.METHOD_OPTIONS[name] == {
            o.name: (None if o.required else o.default) for o in spec.options
        }
        for opt in spec.options:
            if opt.kind != "real":
                continue
            for bad in (opt.low - 0.5, opt.high + 0.5, float("nan")):
                kw = {**_opts(spec), opt.name: bad}
                with pytest.raises(InputError, match=rf"{opt.name}=.*expected a number in"):
                    registry.resolve_options("f", name, "core", kw)
            with pytest.raises(InputTypeError, match=rf"{opt.name}='x' \(str\)"):
                registry.resolve_options("f", name, "core", {**_opts(spec), opt.name: "x"})
    assert merging.LOW_RANK_METHODS == ("ta", "tsv", "iso_c", "iso_cts")
    assert merging.ELEMENTWISE_METHODS == ("ties", "dare", "dare_ties")


def test_canonical_operator_is_resolved_once():
    res = registry.resolve_options("f", "ta", "full", {"isotropize": True})
    assert res.kernel_method == "iso_c" and res.kernel_options == {}
    assert res.options == {"isotropize": True}


@pytest.fixture
def half_ta():
    """A new method in one declaration: half the TA sum."""

    def kernel(a, b, *, coef, rtol, is_svd, weight):
        ma, mb = nu.methods.ta(a, b, coef=coef)
        return weight * ma, mb

    opt = registry.Option(
        "weight", "real", 0.5, "half_ta: weight", what="the weight", low=0.0, high=1.0
    )
    spec = registry.register(
        registry.MethodSpec("half_ta", "Half-TA", "half the TA sum", "low_rank", kernel, (opt,))
    )
    yield spec
    del registry.METHODS["half_ta"]


def test_a_registered_method_runs_everywhere(half_ta, tmp_path):
    ads = _ads(2)
    masks = nu.allocate(nu.score(ads), 2)
    for space in ("full", "core", "knots"):
        out = nu.merge(ads, masks, method="half_ta", space=space, weight=0.25, coef=2.0)
        for n, d_in, d_out, _ in SPEC:
            want = 0.5 * ref.ta(ref.kept_updates([a[n] for a in ads], d_in, d_out, masks[n]))
            np.testing.assert_allclose(ref.dense(out[n]), want, atol=1e-9)
    _merged, rep = nu.merge_adapters(ads, budget=2, method="half_ta")
    assert rep.method == "half_ta" and rep.scope == "global"
    with pytest.raises(InputError, match=r"a method named 'half_ta' exists already"):
        registry.register(half_ta)
    # the command line offers it, with its option as a flag
    parser = cli.build_parser(demo_options=False)
    args = parser.parse_args(["merge", "x", "--out", "o", "--budget", "2", "--method",
                              "half_ta", "--weight", "0.3"])  # fmt: skip
    assert cli._method_options(args) == {"weight": 0.3}


def test_cli_flags_are_the_registry_options():
    parser = cli.build_parser(demo_options=False)
    sub = next(a for a in parser._actions if a.dest == "command")
    actions = {a.dest: a for a in sub.choices["merge"]._actions}
    assert tuple(actions["method"].choices) == tuple(registry.METHODS)
    assert tuple(actions["space"].choices) == tuple(registry.SPACES) == nu.spaces.SPACES
    for spec in (*registry.METHODS.values(), *registry.SPACES.values()):
        for opt in spec.options:
            a = actions[opt.name]
            assert opt.cli_flag in a.option_strings and a.help == opt.help
            if opt.kind == "choice":
                assert tuple(a.choices) == opt.choices


def test_trim_scope_old_spelling_warns_and_agrees():
    ads = _ads(3)
    new = nu.merge(ads, method="ties", space="core", trim_scope="model", density=0.3)
    with pytest.warns(DeprecationWarning, match=r"scope= is renamed trim_scope=") as rec:
        old = nu.merge(ads, method="ties", space="core", scope="model", density=0.3)
    assert rec[0].filename == __file__  # points at the caller
    for n, _, _, _ in SPEC:
        np.testing.assert_array_equal(ref.dense(old[n]), ref.dense(new[n]))
    with pytest.raises(InputError, match=r"got both scope= and trim_scope="):
        nu.merge(ads, method="ties", scope="model", trim_scope="model")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nu.merge(ads, method="ties", trim_scope="module")  # the new name does not warn


def test_model_wide_ties_through_merge_adapters():
    """The collision is gone: merge_adapters' scope is the budget's, trim_scope is TIES's."""
    ads = _ads(4)
    merged, rep = nu.merge_adapters(
        ads, budget=2, method="ties", space="core", trim_scope="model", density=0.3
    )
    masks = nu.allocate(nu.score(ads), 2, scope="local")
    want = nu.merge(ads, masks, method="ties", space="core", trim_scope="model", density=0.3)
    assert rep.scope == "local"
    for n, _, _, _ in SPEC:
        np.testing.assert_array_equal(ref.dense(merged[n]), ref.dense(want[n]))
    per_module = nu.merge(ads, masks, method="ties", space="core", density=0.3)
    assert any(not np.allclose(ref.dense(per_module[n]), ref.dense(want[n])) for n, _, _, _ in SPEC)
