"""Property/fuzz tests of :func:`registry.register`: declarations drawn at random, mostly wrong.

Every declaration ends in one of two ways: :func:`registry.register` refuses it with the
library's own error (:class:`InputError` / :class:`InputTypeError`, never another exception),
naming the method; or it accepts it, and then everything that reads the registry works with it
without a new kind of error: :func:`registry.resolve_options` in each of its spaces (defaults,
and every option given a valid value) and the command line's parser and flags. An accepted
declaration is always removed again.

Each example is cheap (no merge is computed, nothing is compiled): a small ``max_examples`` and
a per-example ``deadline`` keep the file to a few seconds.
"""

from __future__ import annotations

import dataclasses
import datetime
import math

import hypothesis
import hypothesis.strategies as st
import pytest

from netutility_jax import cli, registry
from netutility_jax.cli.options import option_flag, option_wording
from netutility_jax.errors import InputError, InputTypeError

SETTINGS = {"max_examples": 60, "deadline": datetime.timedelta(seconds=2)}


def _lr_kernel(a, b, *, coef, rtol, is_svd, **options):
    return a, b


def _ew_kernel(x, keys, *, coef, k_top, **options):
    return x.sum(1)


def _narrow_kernel(a, b, *, coef):
    return a, b


# mostly plausible values, with a few wrong ones of every kind mixed in
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.tuples(st.text(max_size=3)),
)
NAMES = st.one_of(
    st.sampled_from(["w", "opt_a", "opt_b", "weight", "density", "p", "coef", "variant", "key"]),
    st.sampled_from(["", "two words", "1st", "class", "opt-x"]),
    ANY,
)
BOUNDS = st.one_of(st.sampled_from([0.0, 1.0, -math.inf, math.inf, 0.5]), ANY)


@st.composite
def good_options(draw, elementwise: bool):
    """0 to 2 well-formed options (for an elementwise method: traced real ones only)."""
    out = []
    for name in draw(st.lists(st.sampled_from(["opt_a", "opt_b"]), max_size=2, unique=True)):
        kind = "real" if elementwise else draw(st.sampled_from(["real", "bool", "choice"]))
        if kind == "real":
            low = draw(st.sampled_from([0.0, -1.0, -math.inf]))
            high = draw(st.sampled_from([1.0, 2.0, math.inf]))
            default = draw(st.sampled_from([registry.REQUIRED, max(low, 0.0)]))
            out.append(registry.Option(name, kind, default, "h", low=low, high=high))
        elif kind == "bool":
            out.append(registry.Option(name, kind, draw(st.booleans()), "h"))
        else:
            out.append(registry.Option(name, kind, "a", "h", choices=("a", "b")))
    return out


@st.composite
def bad_option(draw):
    """An option with one or more wrong fields."""
    kw = {
        "name": draw(st.one_of(st.sampled_from(["opt_c", "w"]), NAMES)),
        "kind": draw(st.one_of(st.sampled_from(["real", "bool", "choice"]), ANY)),
        "default": draw(st.one_of(st.just(registry.REQUIRED), ANY)),
        "help": draw(st.sampled_from(["help", "", 3])),
    }
    if draw(st.booleans()):
        kw["low"], kw["high"] = draw(BOUNDS), draw(BOUNDS)
    if draw(st.booleans()):
        kw["low_open"], kw["high_open"] = draw(st.booleans()), draw(st.one_of(st.booleans(), ANY))
    if draw(st.booleans()):
        kw["choices"] = draw(
            st.one_of(st.lists(st.sampled_from(["a", "b", "c"]), max_size=3).map(tuple), ANY)
        )
    if draw(st.booleans()):
        kw["traced"] = draw(st.one_of(st.booleans(), ANY))
    if draw(st.booleans()):
        kw["flag"] = draw(st.one_of(st.none(), st.sampled_from(["--opt-z", "opt", "--"]), ANY))
    return registry.Option(**kw)


SPACE = st.one_of(st.sampled_from(["full", "core", "knots"]), st.sampled_from(["dense", ""]), ANY)
SPACES = st.lists(st.sampled_from(["full", "core", "knots"]), min_size=1, max_size=3, unique=True)


@st.composite
def specs(draw):
    """A well-formed declaration with 0 to 3 of its fields replaced by wrong ones."""
    elementwise = draw(st.booleans())
    spaces = tuple(draw(SPACES))
    fields = {
        "name": "fz_m",
        "label": "Fz",
        "summary": "fuzzed",
        "kind": "elementwise" if elementwise else "low_rank",
        "kernel": _ew_kernel if elementwise else _lr_kernel,
        "options": tuple(draw(good_options(elementwise))),
        "spaces": spaces,
        "same_spaces": draw(st.sampled_from([tuple((sp,) for sp in spaces), (spaces,), ()])),
        "needs_key": elementwise and draw(st.booleans()),
        "budget_scope": draw(st.sampled_from(["global", "local"])),
    }
    wrong = {
        "name": st.one_of(NAMES, st.sampled_from(["ta", "fz m"])),
        "label": st.sampled_from(["", None, 3]),
        "kind": st.one_of(st.sampled_from(["low_rank", "elementwise", "spectral"]), ANY),
        "kernel": st.sampled_from([_lr_kernel, _ew_kernel, _narrow_kernel, None, "ta"]),
        "options": st.lists(st.one_of(bad_option(), ANY), min_size=1, max_size=2).map(
            lambda xs: (*fields["options"], *xs)
        ),
        "spaces": st.one_of(st.lists(SPACE, max_size=4).map(tuple), ANY),
        "same_spaces": st.one_of(
            st.lists(st.lists(SPACE, max_size=3).map(tuple), max_size=3).map(tuple), ANY
        ),
        "needs_key": st.one_of(st.booleans(), ANY),
        "keeps_top": st.one_of(st.none(), NAMES),
        "model_wide": st.one_of(st.none(), st.tuples(NAMES, ANY), ANY),
        "blocked": st.one_of(st.sampled_from([None, "ties", "dare", "dare_ties"]), ANY),
        "budget_scope": st.one_of(st.sampled_from(["global", "local"]), ANY),
        "renamed": st.one_of(st.dictionaries(NAMES, NAMES, max_size=2), ANY),
        "canonical": st.sampled_from([None, lambda o: ("ta", o), "ta"]),
    }
    for field in draw(st.lists(st.sampled_from(sorted(wrong)), max_size=3, unique=True)):
        fields[field] = draw(wrong[field])
    return registry.MethodSpec(**fields)


def _valid_value(opt: registry.Option):
    if opt.kind == "bool":
        return True
    if opt.kind == "choice":
        return opt.choices[-1]
    lo, hi = opt.low, opt.high
    if math.isfinite(lo) and math.isfinite(hi):
        return (lo + hi) / 2 if lo < hi else lo
    if math.isfinite(lo):
        return lo + 1.0
    if math.isfinite(hi):
        return hi - 1.0
    return 0.0


def _exercise(spec: registry.MethodSpec) -> None:
    """What reads the registry works with an accepted method."""
    for space in spec.spaces:
        res = registry.resolve_options("f", spec.name, space, {
            o.name: _valid_value(o) for o in spec.options if o.required
        })  # fmt: skip
        assert set(res.options) == {
            o.name for o in (*spec.options, *registry.SPACES[space].options)
        }
        everything = {o.name: _valid_value(o) for o in spec.options}
        registry.resolve_options("f", spec.name, space, everything)
    parser = cli.build_parser(demo_options=False)
    args = ["merge", "x", "--out", "o", "--budget", "2", "--method", spec.name]
    for o in spec.options:
        if o.kind == "bool":
            args.append(option_flag(o.name))
        elif o.kind == "choice":
            args.append(f"{option_flag(o.name)}={o.choices[-1]}")
        elif o.required or _cli_in_range(o, _valid_value(o)):
            args.append(
                f"{option_flag(o.name)}={_valid_value(o)!r}"
            )  # "=": a value may start with "-"
    parsed = parser.parse_args(args)
    cli.method_options(parsed)


@pytest.fixture
def clean_registry():
    before = dict(registry.METHODS)
    yield
    for name in set(registry.METHODS) - set(before):
        del registry.METHODS[name]


@hypothesis.settings(**SETTINGS)
@hypothesis.given(spec=specs())
def test_register_refuses_with_its_own_errors_or_accepts_a_usable_method(spec):
    before = dict(registry.METHODS)
    try:
        try:
            registry.register(spec)
        except (InputError, InputTypeError) as e:
            hypothesis.event("refused")
            assert str(e).startswith("registry.register: "), e
            assert spec.name not in registry.METHODS or registry.METHODS[spec.name] is not spec
            return
        hypothesis.event("accepted")
        assert registry.METHODS[spec.name] is spec
        _exercise(spec)
    finally:
        for name in set(registry.METHODS) - set(before):
            del registry.METHODS[name]


@hypothesis.settings(**SETTINGS)
@hypothesis.given(
    kind=st.sampled_from(["real", "bool", "choice"]),
    low=st.floats(-2, 2),
    width=st.floats(0, 2),
    at=st.floats(-3, 3),
    traced=st.booleans(),
)
def test_a_well_formed_option_is_accepted_and_resolved(kind, low, width, at, traced):
    """The valid corner: any well-formed option with a default in its range registers, and
    ``resolve_options`` takes its default and any value in range, and refuses one out of it."""
    high = low + width
    default = {"real": low, "bool": False, "choice": "a"}[kind]
    opt = registry.Option(
        "opt_f", kind, default, "opt_f: fuzzed", low=low, high=high, traced=traced,
        choices=("a", "b") if kind == "choice" else (),
    )  # fmt: skip
    ew = kind == "real" and traced
    kernel = _ew_kernel if ew else _lr_kernel
    spec = registry.MethodSpec(
        "fz_ok", "Fz", "fuzzed", "elementwise" if ew else "low_rank", kernel, (opt,),
        budget_scope="local" if ew else "global",
    )  # fmt: skip
    registry.register(spec)
    try:
        assert registry.resolve_options("f", "fz_ok", "full", {}).options == {"opt_f": default}
        _exercise(spec)
        if kind == "real":
            if low <= at <= high:
                assert registry.resolve_options("f", "fz_ok", "core", {"opt_f": at}).options == {
                    "opt_f": at
                }
            else:
                with pytest.raises(InputError, match=r"opt_f=.*expected a number in"):
                    registry.resolve_options("f", "fz_ok", "core", {"opt_f": at})
    finally:
        del registry.METHODS["fz_ok"]


def _cli_in_range(o, v) -> bool:
    """``v`` in the command line's range of option ``o`` (its own lower bound, if stricter)."""
    low_open = option_wording(o.name).low_open
    return dataclasses.replace(o, low_open=o.low_open if low_open is None else low_open).in_range(v)
