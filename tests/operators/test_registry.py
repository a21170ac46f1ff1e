"""The method/space registry: one declaration per method, read by merge, merge_adapters and the CLI.

Checks that the declarations hold (result form per space, options' defaults and ranges), that a
method added with one ``MethodSpec`` runs end to end (against a float64 reference), the TIES
option rename (``scope`` -> ``trim_scope``) with its deprecation, and model-wide TIES through
``merge_adapters`` and the command line.
"""

from __future__ import annotations

import dataclasses
import warnings

import _merge_reference as ref
import jax
import jax.numpy as jnp
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
    from netutility_jax.pipeline import merging

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
    assert cli.method_options(args) == {"weight": 0.3}


def test_cli_flags_are_the_registry_options():
    parser = cli.build_parser(demo_options=False)
    sub = next(a for a in parser._actions if a.dest == "command")
    actions = {a.dest: a for a in sub.choices["merge"]._actions}
    assert tuple(actions["method"].choices) == tuple(registry.METHODS)
    assert tuple(actions["space"].choices) == tuple(registry.SPACES) == nu.spaces.SPACES
    for spec in (*registry.METHODS.values(), *registry.SPACES.values()):
        for opt in spec.options:
            a = actions[opt.name]
            # the command's flag: "--" and the config key (--knots-variant for KnOTS' variant)
            flag = cli.options.option_flag(opt.name)
            assert a.option_strings == [flag] and flag == "--" + nu.folders.option_key(opt.name)
            # the registry's help, and for an option the command gives a default, that default
            default = cli.options.CLI_DEFAULTS.get(opt.name) if opt.required else None
            assert (
                a.help == opt.help
                if default is None
                else a.help.startswith(f"{opt.help}. Default: {default:g}")
            ), (opt.name, a.help)
            if opt.kind == "choice":
                assert tuple(a.choices) == opt.choices


def test_the_command_line_s_wording_is_the_command_line_s():
    """The registry declares no command-line wording: the command line's own table words TIES'
    density (a stricter lower bound, shorter words), and KnOTS' variant's flag is its config
    key; the flags, their ranges and their messages are what they were."""
    for spec in (*registry.METHODS.values(), *registry.SPACES.values()):
        for opt in spec.options:
            assert (opt.flag, opt.cli_low_open, opt.cli_what) == (None, None, None), opt.name
    assert cli.options.option_flag("variant") == "--knots-variant"
    assert cli.options.option_wording("density") == cli.options.OptionWording(
        "--density", low_open=True, what="the kept fraction"
    )
    assert cli.options.option_wording("p") == cli.options.OptionWording(
        "--p", low_open=False, what="the drop rate"
    )
    parser = cli.build_parser(demo_options=False)
    base = ["merge", "x", "--out", "o", "--budget", "2"]
    args = parser.parse_args([*base, "--method", "ties", "--space", "knots", "--density", "0.5",
                              "--knots-variant", "original"])  # fmt: skip
    assert cli.method_options(args) == {"density": 0.5, "variant": "original"}
    with pytest.raises(SystemExit) as info:
        parser.parse_args([*base, "--density", "0"])  # (0 is the registry's, not the shell's)
    assert info.value.code == 2
    registry.resolve_options("f", "ties", "full", {"density": 0.0})
    with pytest.raises(cli.UsageError, match=r"--knots-variant does not apply to method ta in "
                       r"full space; it takes --isotropize\."):  # fmt: skip
        cli.method_options(parser.parse_args([*base, "--knots-variant", "original"]))


def test_the_deprecated_wording_fields_warn_and_still_word_the_flag(capsys):
    """``registry.Option(..., flag=, cli_low_open=, cli_what=)`` (a user's method declared
    before the wording moved to the command line) warns, pointing at the caller, and the
    command line still takes the flag, its bound and its words; its config key is the flag."""
    with pytest.warns(DeprecationWarning, match=r"flag=, cli_low_open=, cli_what= are "
                      r"deprecated .*OPTION_WORDING") as rec:  # fmt: skip
        opt = registry.Option("toy_share", "real", 0.5, "toy: a share", what="the share",
                              low=0.0, high=1.0, example="0.5", flag="--toy-part",
                              cli_low_open=True, cli_what="the part")  # fmt: skip
    assert rec[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=r"cli_what= is deprecated"):
        registry.Option("toy_x", "real", 0.5, "x", low=0.0, high=1.0, cli_what="x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.Option("toy_y", "real", 0.5, "y", low=0.0, high=1.0)  # (no wording: no warning)
    with pytest.warns(DeprecationWarning, match=r"cli_flag is deprecated"):
        assert opt.cli_flag == "--toy-part"
    with pytest.warns(DeprecationWarning, match=r"interval\(cli=True\) is deprecated"):
        assert opt.interval(cli=True) == "(0, 1]"
    with pytest.warns(DeprecationWarning, match=r"in_range\(cli=True\) is deprecated"):
        assert not opt.in_range(0.0, cli=True) and opt.in_range(0.0)

    def kernel(a, b, *, coef, rtol, is_svd, toy_share):
        return nu.methods.ta(a, b, coef=coef)

    registry.register(registry.MethodSpec("toy_old", "Toy", "toy", "low_rank", kernel, (opt,)))
    try:
        assert cli.options.option_flag("toy_share") == "--toy-part"
        assert nu.folders.option_key("toy_share") == "toy-part"
        parser = cli.build_parser(demo_options=False)
        base = ["merge", "x", "--out", "o", "--budget", "2", "--method", "toy_old"]
        assert cli.method_options(parser.parse_args([*base, "--toy-part", "0.25"])) == {
            "toy_share": 0.25
        }
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--toy-part", "0"])  # cli_low_open: (0, 1]
        assert "expected a finite number in (0, 1] (the part), got '0'" in capsys.readouterr().err
        cfg = nu.MergeConfig(method="toy_old", budget=2, method_options={"toy_share": 0.25})
        assert cfg.to_dict()["toy-part"] == 0.25
        assert nu.MergeConfig.from_dict(cfg.to_dict()) == cfg
        # the command line's own table words it instead, once the user moves the wording there
        cli.options.OPTION_WORDING[("toy_old", "toy_share")] = cli.options.OptionWording(
            flag="--toy-fraction", what="the fraction"
        )
        try:
            words = cli.options.option_wording("toy_share")
            assert (words.flag, words.low_open, words.what) == ("--toy-fraction", True,
                                                                "the fraction")  # fmt: skip
            args = cli.build_parser(demo_options=False).parse_args(
                [*base, "--toy-fraction", "0.75"]
            )
            assert cli.method_options(args) == {"toy_share": 0.75}
        finally:
            del cli.options.OPTION_WORDING[("toy_old", "toy_share")]
    finally:
        del registry.METHODS["toy_old"]


# (~15-25 s of merge compilations; the slow tier runs in CI)
@pytest.mark.slow
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


# ------------------------------------------------------------------ registration is validated


def _lr_kernel(a, b, *, coef, rtol, is_svd, **_):
    return nu.methods.ta(a, b, coef=coef)


def _ew_kernel(x, keys, *, coef, k_top, **_):
    return coef * x.sum(1)


def _spec(**kw) -> registry.MethodSpec:
    fields = {
        "name": "bad_m", "label": "Bad", "summary": "a method under test", "kind": "low_rank",
        "kernel": _lr_kernel,
    }  # fmt: skip
    fields.update(kw)
    return registry.MethodSpec(**fields)


def _opt(name="w", kind="real", default=0.5, **kw) -> registry.Option:
    return registry.Option(name, kind, default, f"{name}: an option", **kw)


@pytest.fixture
def registered():
    """``add(spec)`` registers a throwaway method; every name it registers is removed after."""
    before = dict(registry.METHODS)
    yield registry.register
    for name in set(registry.METHODS) - set(before):
        del registry.METHODS[name]


BAD_SPECS = [
    # (spec fields, error class, the message: the field, the value and what is allowed)
    ({"kind": "spectral"}, InputError,
     r"kind='spectral' \(str\); expected one of \('low_rank', 'elementwise'\)"),
    ({"kernel": None}, InputTypeError, r"kernel=None \(NoneType\); expected a callable"),
    ({"options": (_opt(kind="integer"),)}, InputError,
     r"option 'w': kind='integer' \(str\); expected one of \('real', 'bool', 'choice'\)"),
    ({"options": (_opt(default=2.0, low=0.0, high=1.0),)}, InputError,
     r"option 'w': default=2.0 \(float\); expected a number in \[0, 1\]"),
    ({"options": (_opt(default="x", kind="bool"),)}, InputTypeError,
     r"option 'w': default='x' \(str\); expected True or False"),
    ({"options": (_opt(kind="choice", default="c", choices=("a", "b")),)}, InputError,
     r"option 'w': default='c' \(str\); expected one of \('a', 'b'\)"),
    ({"options": (_opt("coef"),)}, InputError,
     r"option 'coef': the name is taken by nu\.merge, nu\.merge_adapters or the kernels"),
    ({"options": (_opt(default=registry.REQUIRED, low=1.0, high=0.0),)}, InputError,
     r"option 'w': low=1\.0 > high=0\.0; expected low <= high"),
    ({"options": (_opt(), _opt())}, InputError, r"options: 'w' is declared twice"),
    ({"options": (_opt(name="variant", kind="choice", default="a", choices=("a",)),)},
     InputError, r"option 'variant': space 'knots' has an option of that name"),
    ({"options": (_opt(name="p", kind="bool", default=False),)}, InputError,
     r"option 'p': method 'dare' declares it as a real option"),
    ({"options": ("w",)}, InputTypeError, r"options\[0\]='w' \(str\); expected a registry\.Option"),
    ({"spaces": ()}, InputError, r"spaces=\(\) \(tuple\); expected a non-empty tuple of"),
    ({"spaces": "full"}, InputTypeError, r"spaces='full' \(str\); expected a non-empty tuple of"),
    ({"spaces": ("full", "dense")}, InputError,
     r"spaces: 'dense' is not a space; expected among \('full', 'core', 'knots'\)"),
    ({"name": 3}, InputTypeError, r"name=3 \(int\); expected a string"),
    ({"name": "two words"}, InputError, r"name='two words' \(str\); expected a name of letters"),
    ({"same_spaces": (("full", "dense"),)}, InputError,
     r"same_spaces: 'dense' is not a space; expected among \('full', 'core', 'knots'\)"),
    ({"same_spaces": (("full", "core"), ("core",))}, InputError,
     r"same_spaces: 'core' is in two groups"),
    ({"spaces": ("full", "core"), "same_spaces": (("full", "knots"),)}, InputError,
     r"same_spaces: group \('full', 'knots'\) names 'knots', which is not among spaces"),
    ({"budget_scope": "model"}, InputError,
     r"budget_scope='model' \(str\); expected one of \('global', 'local'\)"),
    ({"needs_key": 1}, InputTypeError, r"needs_key=1 \(int\); expected True or False"),
    ({"needs_key": True}, InputError, r"needs_key=True needs kind='elementwise'"),
    ({"keeps_top": "w"}, InputError, r"keeps_top='w' needs kind='elementwise'"),
    ({"kind": "elementwise", "kernel": _ew_kernel, "keeps_top": "density"}, InputError,
     r"keeps_top='density' is not an option of the method"),
    ({"kind": "elementwise", "kernel": _ew_kernel, "model_wide": ("trim", "model")}, InputError,
     r"model_wide=\('trim', 'model'\) needs keeps_top"),
    ({"renamed": {"old": "new"}}, InputError,
     r"renamed: 'old' -> 'new' renames to 'new', which is not an option"),
    ({"canonical": "ta"}, InputTypeError, r"canonical='ta' \(str\); expected a callable or None"),
    ({"kernel": lambda a, b: (a, b)}, InputError,
     r"kernel: its signature \(a, b\) cannot take the low-rank call kernel\(a, b, coef=, rtol=, "
     r"is_svd=\)"),
    ({"kind": "elementwise", "kernel": _ew_kernel,
      "options": (_opt(kind="choice", default="a", choices=("a", "b")),)}, InputError,
     r"option 'w': a choice option of an elementwise method never reaches its kernel"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "cls", "message"),
    BAD_SPECS,
    ids=[f"{i}-{next(iter(f))}" for i, (f, _, _) in enumerate(BAD_SPECS)],
)
def test_register_refuses_a_bad_spec_naming_the_field(registered, fields, cls, message):
    """Every mistake in a declaration is refused when it is registered (not later, inside
    jit, or never), naming the field, the value given and what is allowed."""
    with pytest.raises(cls, match=r"registry\.register: method .*" + message):
        registered(_spec(**fields))
    assert "bad_m" not in registry.METHODS


def test_register_reports_every_mistake_at_once(registered):
    spec = _spec(kind="spectral", spaces=("dense",), budget_scope="model")
    with pytest.raises(InputError, match=r"3 mistakes: .*kind=.*spaces: .*budget_scope=") as e:
        registered(spec)
    assert str(e.value).count("expected") == 3


def test_reserved_option_names_cover_the_merge_keywords():
    """An option named like a keyword of nu.merge / nu.merge_adapters would be swallowed by it
    (``coef``) or clash with the command line's flag of the same name."""
    import inspect

    for fn in (nu.merge, nu.merge_adapters):
        params = inspect.signature(fn).parameters
        named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        assert named <= set(registry.RESERVED_OPTION_NAMES), named - set(
            registry.RESERVED_OPTION_NAMES
        )


def test_command_flags_are_the_parsers_own_and_options_cannot_take_them():
    """An option whose --flag is one of the command's own would make argparse refuse the whole
    parser (every netutility command would fail): register refuses it, naming the flag."""
    import dataclasses

    parser = cli.build_parser(demo_options=False)
    sub = next(a for a in parser._actions if a.dest == "command")
    own = set()
    for command in ("merge", "inspect"):
        for a in sub.choices[command]._actions:
            own |= {s for s in a.option_strings if s.startswith("--")}
    options = {cli.options.option_flag(n) for n in cli.options.option_names()}
    assert set(registry.COMMAND_FLAGS) == own - options
    for name in ("rank", "out", "dry_run"):
        opt = registry.Option(name, "real", 1.0, "x", low=0.0, high=2.0, traced=True)
        spec = dataclasses.replace(registry.METHODS["ta"], name=f"toy_{name}", options=(opt,))
        flag = "--" + name.replace("_", "-")
        with pytest.raises(InputError, match=f"its command-line flag {flag} is one of"):
            registry.register(spec)
        assert f"toy_{name}" not in registry.METHODS
    cli.build_parser(demo_options=False)


def test_register_accepts_the_builtins_again():
    """The built-in declarations pass the checks (they were registered through them)."""
    for name, spec in list(registry.METHODS.items()):
        del registry.METHODS[name]
        try:
            registry.register(spec)
        finally:
            registry.METHODS[name] = spec


# ----------------------------------------------------------- kernels' outputs are checked


def _sq_ads(dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "l": {
                "lora_a": rng.normal(size=(16, 2)).astype(dtype),
                "lora_b": rng.normal(size=(2, 16)).astype(dtype),
            }
        }
        for _ in range(2)
    ]


def _lr_then(f):
    def kernel(a, b, *, coef, rtol, is_svd):
        ma, mb = nu.methods.ta(a, b, coef=coef)
        return f(ma, mb)

    return kernel


def _ew_then(f):
    def kernel(x, keys, *, coef, k_top):
        return f(coef * x.sum(1))

    return kernel


def _spec_of(name, kind, kernel):
    scope = "global" if kind == "low_rank" else "local"
    return registry.MethodSpec(name, name, "a kernel under test", kind, kernel, budget_scope=scope)


@pytest.mark.parametrize("space", ["full", "core", "knots"])
def test_a_kernel_returning_nan_is_an_error_naming_the_method(registered, space):
    """Was: rank-0 modules and no error (the NaN columns count as zero singular values)."""
    registered(_spec_of("nan_lr", "low_rank", _lr_then(lambda a, b: (a * jnp.nan, b))))
    want = (
        r"nu\.merge: method 'nan_lr' returned NaN for module 'l' \(1 module, space "
        rf"'{space}'\) whose inputs are finite"
    )
    with pytest.raises(InputError, match=want):
        nu.merge(_sq_ads(), method="nan_lr", space=space)


@pytest.mark.parametrize("space", ["full", "core", "knots"])
def test_an_elementwise_kernel_returning_nan_is_an_error(registered, space):
    """Was: in full space 'the merged update of module 'l' overflows' (a NaN is not an
    overflow), and in Core / KnOTS space no module named."""
    registered(_spec_of("nan_ew", "elementwise", _ew_then(lambda x: x * jnp.nan)))
    ads = [{**ad, "m": ad["l"]} for ad in _sq_ads()]
    with pytest.raises(
        InputError,
        match=rf"method 'nan_ew' returned NaN for modules 'l', 'm' \(2 modules, space '{space}'\) "
        "whose inputs are finite",
    ):
        nu.merge(ads, method="nan_ew", space=space)


def test_a_kernel_returning_inf_is_an_overflow_not_a_nan(registered):
    """A kernel's inf (no NaN) is reported as the overflow it is, not as the kernel's NaN."""
    registered(
        _spec_of(
            "big_ew",
            "elementwise",
            _ew_then(lambda x: jnp.where(x > 0, jnp.inf, -jnp.inf).astype(x.dtype)),
        )
    )
    with pytest.raises(InputError, match=r"merged update of module 'l' overflows"):
        nu.merge(_sq_ads(np.float32), method="big_ew", space="full")


def test_an_elementwise_kernel_of_the_wrong_shape_is_an_error(registered):
    """Was: a (16, 15) 'delta' for a 16 x 16 layer in full space."""
    registered(_spec_of("cut_ew", "elementwise", _ew_then(lambda x: x[..., :-1])))
    for space in ("full", "core", "knots"):
        with pytest.raises(
            InputError,
            match=r"method 'cut_ew': its elementwise kernel returned shape \(1, \d+, \d+\) for "
            r"tasks x of shape \(1, 2, \d+, \d+\); expected \(1, \d+, \d+\) \(n, p, q\)",
        ):
            nu.merge(_sq_ads(), method="cut_ew", space=space)


def test_a_low_rank_kernel_of_the_wrong_form_is_an_error(registered):
    """Low-rank kernels see reduced coordinates (here p = q = M r = 4), named in the message."""
    registered(_spec_of("cut_lr", "low_rank", _lr_then(lambda a, b: (a[..., :-1, :], b))))
    registered(_spec_of("one_lr", "low_rank", _lr_then(lambda a, b: a)))
    registered(_spec_of("k_lr", "low_rank", _lr_then(lambda a, b: (a, b[..., :-1]))))
    with pytest.raises(
        InputError,
        match=r"nu\.merge: method 'cut_lr': its low-rank kernel returned a \(1, 3, 4\), b "
        r"\(1, 4, 4\); expected a \(1, 4, K\) and b \(1, 4, K\) \(the same K\) for tasks a "
        r"\(1, 2, 4, 2\), b \(1, 2, 4, 2\)",
    ):
        nu.merge(_sq_ads(), method="cut_lr")
    with pytest.raises(
        InputError,
        match=r"method 'one_lr': its low-rank kernel returned an array of shape \(1, 4, 4\); "
        r"expected a pair \(a, b\)",
    ):
        nu.merge(_sq_ads(), method="one_lr")
    with pytest.raises(InputError, match=r"method 'k_lr': .*returned a \(1, 4, 4\), b \(1, 4, 3\)"):
        nu.merge(_sq_ads(), method="k_lr")


def test_a_kernel_of_the_wrong_dtype_is_an_error(registered):
    registered(_spec_of("f32_lr", "low_rank", _lr_then(lambda a, b: (a.astype(jnp.float32), b))))
    registered(_spec_of("f32_ew", "elementwise", _ew_then(lambda x: x.astype(jnp.float32))))
    with pytest.raises(InputTypeError, match=r"method 'f32_lr': its low-rank kernel returned "
                       r"dtypes \(float32, float64\); expected float64 \(its inputs' dtype\)"):  # fmt: skip
        nu.merge(_sq_ads(), method="f32_lr")
    with pytest.raises(InputTypeError, match=r"method 'f32_ew': its elementwise kernel returned "
                       r"dtype float32; expected float64"):  # fmt: skip
        nu.merge(_sq_ads(), method="f32_ew")


# (~15-25 s of merge compilations; the slow tier runs in CI)
@pytest.mark.slow
def test_an_overflowing_coef_in_core_space_is_a_range_error():
    """Was: TIES and DARE in core space with a coef whose merge overflows float32 on the way
    returned rank-0 modules (the kernel's inf counted as no singular value; coef=1e20 here);
    now, as in KnOTS space, the range error naming the module."""
    ads = _sq_ads(np.float32)
    for method, kw in (("ties", {}), ("dare", {"p": 0.5, "key": jax.random.key(0)})):
        with pytest.raises(InputError, match=r"merged update of module 'l' overflows float32"):
            nu.merge(ads, method=method, space="core", coef=1e20, **kw)
    out = nu.merge(ads, method="ties", space="core", coef=1e5)  # large but fine
    assert out["l"]["lora_a"].shape == (16, 4)


# ------------------------------------------- a user kernel is never swapped for a built-in one


def _top_sum(x, keys, *, coef, k_top):
    """Each task's k_top largest-magnitude entries, summed (no sign election: not TIES)."""
    n, m, p, q = x.shape
    flat = x.reshape(n, m, p * q)
    srt = -jnp.sort(-jnp.abs(flat), axis=-1)
    thr = jnp.take_along_axis(srt, jnp.maximum(k_top[:, None, None] - 1, 0), axis=-1)
    kept = jnp.where((jnp.abs(flat) >= thr) & (k_top[:, None, None] > 0), flat, 0)
    return coef * kept.sum(1).reshape(n, p, q)


_FRACTION = registry.Option(
    "density", "real", 0.2, "kept fraction", low=0.0, high=1.0, traced=False
)


@pytest.mark.parametrize("space", ["full", "knots"])
def test_a_user_keeps_top_kernel_runs_itself_when_modules_exceed_the_working_memory(
    registered, monkeypatch, space
):
    """Was: with keeps_top, a module larger than the working memory ran TIES's blocked code
    instead of the user's kernel (a different operator, silently: 3.3 off on this merge)."""
    from netutility_jax.operators import _plan

    registered(
        registry.MethodSpec("top_sum", "TopSum", "top entries summed", "elementwise", _top_sum,
                            (_FRACTION,), keeps_top="density", budget_scope="local")
    )  # fmt: skip
    ads = [
        {"l": {"lora_a": r.normal(size=(16, 2)), "lora_b": r.normal(size=(2, 12))}}
        for r in (np.random.default_rng(s) for s in range(3))
    ]
    # the operator written out in float64: each task's dense update (or KnOTS coordinates: the
    # library's own), top 30% entries by magnitude, summed
    whole = nu.merge(ads, method="top_sum", space=space, density=0.3)
    monkeypatch.setattr(_plan, "DENSE_BYTES", 2048)  # a block of rows would be a few rows
    blocked = nu.merge(ads, method="top_sum", space=space, density=0.3)

    def dense(m):
        m = m["l"]
        return np.asarray(m["delta"]) if "delta" in m else np.asarray(m["lora_a"] @ m["lora_b"])

    np.testing.assert_array_equal(dense(blocked), dense(whole))
    if space == "full":
        tasks = [a["l"]["lora_a"] @ a["l"]["lora_b"] for a in ads]
        k = int(0.3 * tasks[0].size)
        want = sum(np.where(np.abs(t) >= np.sort(np.abs(t).ravel())[-k], t, 0) for t in tasks)
        np.testing.assert_allclose(dense(whole), want, rtol=1e-12, atol=1e-12)


def test_model_wide_needs_the_blocked_ties_operator():
    spec = registry.MethodSpec(
        "top_sum_mw", "TopSum", "x", "elementwise", _top_sum,
        (_FRACTION, registry.Option("scope", "choice", "module", "s", choices=("module", "model"))),
        keeps_top="density", model_wide=("scope", "model"), budget_scope="local",
    )  # fmt: skip
    with pytest.raises(InputError, match=r"model_wide=\('scope', 'model'\) needs blocked='ties'"):
        registry.register(spec)
    with pytest.raises(InputError, match=r"blocked='dare' needs needs_key=True"):
        registry.register(dataclasses.replace(spec, model_wide=None, blocked="dare"))
    with pytest.raises(InputError, match=r"blocked='ties' needs keeps_top"):
        registry.register(
            dataclasses.replace(spec, model_wide=None, keeps_top=None, blocked="ties")
        )
