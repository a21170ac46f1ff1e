"""Merge methods and spaces as declarations: the one table everything else reads.

Each merge method is one :class:`MethodSpec`: its name and label, its options (:class:`Option`:
type, default, range, help, command-line flag), the spaces it runs in, whether its result stays
low rank there, the spaces in which it gives identical results, and its kernel. Each space is one
:class:`SpaceSpec` with its options. :func:`nu.merge` validates and resolves options through
:func:`resolve_options`; ``netutility merge`` builds its flags and help from :data:`METHODS` and
:data:`SPACES`; the built-in experiment takes labels and identical spaces from here.

Adding a method is one :class:`MethodSpec` (here, or :func:`register` from user code) plus its
kernel: a low-rank kernel maps factored tasks ``a (..., M, p, r)``, ``b (..., M, q, r)`` to merged
factors ``(a (..., p, k), b (..., q, k))``; an elementwise kernel maps dense tasks
``x (n, M, p, q)`` (a batch of modules) with per-module keys and kept counts to ``(n, p, q)``.
Kernels are pure and traced inside the pipeline's jitted stages (:mod:`netutility_jax._stages`).

Option values are checked on the host, before anything is computed: real options that only
reach a kernel as data (``traced=True``: DARE's ``p``, Iso-CTS's ``common_fraction``) may be
traced and do not recompile when they change; the others are static configuration.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax

from . import _checks
from . import methods as _m
from .errors import InputError

__all__ = [
    "ALLOCATIONS",
    "METHODS",
    "REQUIRED",
    "SPACES",
    "MethodSpec",
    "Option",
    "Resolved",
    "SpaceSpec",
    "elementwise_methods",
    "low_rank_methods",
    "method_spec",
    "register",
    "resolve_options",
]

#: :func:`nu.merge_adapters`'s allocations.
ALLOCATIONS = ("net_utility", "uniform", "all")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of an option that has none (the user must give it).
REQUIRED: Any = _Required()


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a method or space.

    Attributes:
      name: keyword of :func:`nu.merge` (``**options``).
      kind: ``"real"`` (a finite real number in a range), ``"bool"`` or ``"choice"`` (a string).
      default: value when not given (:data:`REQUIRED`: must be given).
      help: one line for the command line's help.
      what: what the value is, for messages (``"the drop rate"``).
      low, high, low_open, high_open: the range of a real option.
      example: a typical value, for messages.
      choices, choice_help: the values of a choice option, and what each means.
      traced: a real option that reaches a kernel only as data (may be traced, a new value does
        not recompile); False for one the host uses (TIES's ``density`` sets kept counts).
      flag: the command-line flag (default ``--name`` with dashes).
      cli_low_open: the command line's own lower bound, if stricter (a density of 0 keeps
        nothing, which no one asks for from a shell).
      cli_what: the command line's wording of ``what``, if different.
    """

    name: str
    kind: Literal["real", "bool", "choice"]
    default: Any
    help: str
    what: str = ""
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    example: str = ""
    choices: tuple[str, ...] = ()
    choice_help: str = ""
    traced: bool = True
    flag: str | None = None
    cli_low_open: bool | None = None
    cli_what: str | None = None

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def interval(self, *, cli: bool = False) -> str:
        """``[0, 1)`` and such."""
        low_open = self.cli_low_open if cli and self.cli_low_open is not None else self.low_open
        return (
            f"{'(' if low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        )

    def in_range(self, v: float, *, cli: bool = False) -> bool:
        low_open = self.cli_low_open if cli and self.cli_low_open is not None else self.low_open
        return (
            math.isfinite(v)
            and (v > self.low if low_open else v >= self.low)
            and (v < self.high if self.high_open else v <= self.high)
        )

    @property
    def expected(self) -> str:
        """What a valid value is, for messages."""
        if self.kind == "real":
            eg = f", e.g. {self.example}" if self.example else ""
            return f"a number in {self.interval()} ({self.what}{eg})"
        if self.kind == "bool":
            return "True or False"
        return f"one of {self.choices}"

    def check(self, fn: str, value: Any, *, name: str | None = None) -> Any:
        """``value`` checked for type and range (named ``name``, default the option's own name),
        returned normalised (floats as floats, bools as bools)."""
        name = name or self.name
        if self.kind == "real":
            return _checks.real_option(
                fn, name, value, self.expected, self.in_range, traced=self.traced
            )
        if self.kind == "bool":
            return _checks.check_bool(fn, name, value)
        return _checks.check_choice(fn, name, value, self.choices, self.choice_help)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One merge method.

    Attributes:
      name: the ``method=`` string.
      label: the name in tables and plots.
      summary: one line for the command line's help.
      kind: ``"low_rank"`` (spectral: runs on factored tasks, its result is low rank in every
        space) or ``"elementwise"`` (entry access to each task's dense coordinates: dense in full
        space, low rank in Core and KnOTS space, whose coordinates map back through bases).
      kernel: the method (see the module docstring for the two signatures).
      options: the method's options.
      spaces: the spaces it runs in.
      same_spaces: groups of spaces in which it gives identical results (documented in
        :func:`nu.merge`), so an experiment can run one and report it for the others.
      needs_key: draws random masks from ``key=``.
      keeps_top: the option that sets a per-task count of kept entries (TIES's ``density``:
        PEFT's ``int(density * n)``, made on the host), or None.
      model_wide: ``(option, value)`` that makes the count global over the model instead of per
        module (TIES: ``("trim_scope", "model")``), or None.
      budget_scope: :func:`nu.merge_adapters`' default budget scope for this method (the paper's:
        global for spectral methods, local for elementwise ones).
      renamed: old option names still accepted with a :class:`DeprecationWarning` (old -> new).
      canonical: maps ``(method, options)`` to the operator it is (TA with ``isotropize`` is
        Iso-C), so equal operators share one compiled kernel; None: itself.
    """

    name: str
    label: str
    summary: str
    kind: Literal["low_rank", "elementwise"]
    kernel: Callable[..., Any]
    options: tuple[Option, ...] = ()
    spaces: tuple[str, ...] = ("full", "core", "knots")
    same_spaces: tuple[tuple[str, ...], ...] = (("full",), ("core",), ("knots",))
    needs_key: bool = False
    keeps_top: str | None = None
    model_wide: tuple[str, Any] | None = None
    budget_scope: Literal["global", "local"] = "global"
    renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    canonical: Callable[[dict], tuple[str, dict]] | None = None

    def low_rank_in(self, space: str) -> bool:
        """Whether :func:`nu.merge` returns low-rank modules in ``space`` (else ``{"delta"}``)."""
        return self.kind == "low_rank" or space != "full"

    def option(self, name: str) -> Option:
        return next(o for o in self.options if o.name == name)


@dataclasses.dataclass(frozen=True)
class SpaceSpec:
    """One space the kept components are merged in (:mod:`netutility_jax.spaces`)."""

    name: str
    label: str
    summary: str
    options: tuple[Option, ...] = ()


# ------------------------------------------------------------------------------------ kernels


def _ta(a, b, *, coef, rtol, is_svd, isotropize=False):
    if isotropize:
        return _m.iso_c(a, b, coef=coef, rtol=rtol)
    return _m.ta(a, b, coef=coef)


def _tsv(a, b, *, coef, rtol, is_svd, isotropize=False):
    return _m.tsv(a, b, coef=coef, rtol=rtol, is_svd=is_svd, isotropize=isotropize)


def _iso_c(a, b, *, coef, rtol, is_svd):
    return _m.iso_c(a, b, coef=coef, rtol=rtol)


def _iso_cts(a, b, *, coef, rtol, is_svd, common_fraction):
    return _m.iso_cts(a, b, coef=coef, rtol=rtol, common_fraction=common_fraction)


def _ties(x, keys, *, coef, k_top, **_):
    """Batched natively (not vmapped), so TIES can skip its tie-breaking pass at run time."""
    return _m.ties(x, coef=coef, k=k_top)


def _per_module(fn):
    def kernel(x, keys, *, coef, k_top, p):  # one key per module
        return jax.vmap(lambda xx, kk: fn(xx, kk, coef=coef, p=p))(x, keys)

    return kernel


def _ta_canonical(opts: dict) -> tuple[str, dict]:
    if opts.get("isotropize"):  # the same operator: share one compiled kernel
        return "iso_c", {k: v for k, v in opts.items() if k != "isotropize"}
    return "ta", opts


# ------------------------------------------------------------------------------------ options

_ISOTROPIZE = Option(
    "isotropize",
    "bool",
    False,
    "ta/tsv: flatten the merged spectrum (ta + this = iso_c; tsv + this = Iso-C + TSV)",
)
_DENSITY = Option(
    "density",
    "real",
    0.2,
    "ties: fraction of entries each task keeps, in (0, 1] (default 0.2)",
    what="the fraction of entries each task keeps",
    low=0.0,
    high=1.0,
    example="0.2",
    traced=False,
    cli_low_open=True,
    cli_what="the kept fraction",
)
_TRIM_SCOPE = Option(
    "trim_scope",
    "choice",
    "module",
    "ties: where each task's top-density entries are counted: module (per module, default) or "
    "model (over the whole model, as the original TIES and KnOTS)",
    choices=("module", "model"),
    choice_help=" ('module': per-module top-k, default; 'model': top-k over the whole model, as "
    "the original KnOTS)",
)
_P = Option(
    "p",
    "real",
    REQUIRED,
    "dare/dare_ties: drop rate in [0, 1)",
    what="the drop rate",
    low=0.0,
    high=1.0,
    high_open=True,
    example="0.5",
)
_COMMON_FRACTION = Option(
    "common_fraction",
    "real",
    0.8,
    "iso_cts: the common share of the TA sum's rank, in [0, 1] (default 0.8)",
    what="the common share of the TA sum's rank",
    low=0.0,
    high=1.0,
    example="0.8",
)
_VARIANT = Option(
    "variant",
    "choice",
    "core_space",
    "knots space: core_space (unscaled blocks, default) or original (scaled blocks)",
    choices=("core_space", "original"),
    choice_help=" ('core_space': unscaled blocks V_i, default; 'original': scaled blocks S V_i)",
    flag="--knots-variant",
)

_ALL = ("full", "core", "knots")
_FULL_CORE = (("full", "core"), ("knots",))

#: Every merge method, in the order the command line and messages list them.
METHODS: dict[str, MethodSpec] = {}
#: Every space.
SPACES: dict[str, SpaceSpec] = {
    "full": SpaceSpec("full", "Full", "the dense d_in x d_out update space"),
    "core": SpaceSpec("core", "Core", "Core Space (Panariello et al. 2025)"),
    "knots": SpaceSpec("knots", "KnOTS", "KnOTS (Stoica et al. 2024)", (_VARIANT,)),
}


def register(spec: MethodSpec) -> MethodSpec:
    """Add a merge method (a name already taken is an :class:`InputError`)."""
    if spec.name in METHODS:
        raise InputError(f"registry.register: a method named {spec.name!r} exists already.")
    bad = [s for s in spec.spaces if s not in SPACES]
    if bad:
        raise InputError(
            f"registry.register: method {spec.name!r} names unknown spaces {bad}; the spaces "
            f"are {tuple(SPACES)}."
        )
    METHODS[spec.name] = spec
    return spec


for _spec in (
    MethodSpec(
        "ta", "TA", "task arithmetic: coef * sum of the kept updates", "low_rank", _ta,
        (_ISOTROPIZE,), same_spaces=(_ALL,), canonical=_ta_canonical,
    ),
    MethodSpec(
        "ties", "TIES", "trim to the top density entries per task, elect signs, disjoint mean",
        "elementwise", _ties, (_DENSITY, _TRIM_SCOPE), keeps_top="density",
        model_wide=("trim_scope", "model"), budget_scope="local",
        renamed={"scope": "trim_scope"},
    ),
    MethodSpec(
        "dare", "DARE", "drop entries with probability p, rescale by 1/(1-p), sum",
        "elementwise", _per_module(_m.dare), (_P,), needs_key=True, budget_scope="local",
    ),
    MethodSpec(
        "dare_ties", "DARE-TIES", "DARE's drop, then TIES's sign election and disjoint mean",
        "elementwise", _per_module(_m.dare_ties), (_P,), needs_key=True, budget_scope="local",
    ),
    MethodSpec(
        "tsv", "TSV", "TSV-Merge: every task's singular triplets, each side orthogonalised",
        "low_rank", _tsv, (_ISOTROPIZE,), same_spaces=_FULL_CORE,
    ),
    MethodSpec(
        "iso_c", "Iso-C", "the TA sum with its singular values replaced by their mean",
        "low_rank", _iso_c, same_spaces=_FULL_CORE,
    ),
    MethodSpec(
        "iso_cts", "Iso-CTS", "Iso-C with a common and task-specific subspaces",
        "low_rank", _iso_cts, (_COMMON_FRACTION,), same_spaces=_FULL_CORE,
    ),
):  # fmt: skip
    register(_spec)


def method_spec(fn: str, method: Any) -> MethodSpec:
    """The spec of ``method``, or an error listing the methods."""
    return METHODS[_checks.check_choice(fn, "method", method, tuple(METHODS))]


def low_rank_methods() -> tuple[str, ...]:
    return tuple(n for n, s in METHODS.items() if s.kind == "low_rank")


def elementwise_methods() -> tuple[str, ...]:
    return tuple(n for n, s in METHODS.items() if s.kind == "elementwise")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A method in a space with every option checked and defaulted.

    Attributes:
      spec: the method as asked for.
      space: the space.
      options: ``{name: value}`` method and space options (defaults filled in).
      kernel_method: the operator that runs (``spec.canonical``; TA + isotropize is Iso-C).
      kernel_options: the options of ``kernel_method``.
    """

    spec: MethodSpec
    space: str
    options: dict[str, Any]
    kernel_method: str
    kernel_options: dict[str, Any]

    @property
    def model_wide(self) -> bool:
        mw = self.spec.model_wide
        return mw is not None and self.options.get(mw[0]) == mw[1]


def _takes(spec: MethodSpec, space: str) -> dict[str, Option]:
    return {o.name: o for o in (*spec.options, *SPACES[space].options)}


def _renamed(fn: str, spec: MethodSpec, options: dict[str, Any], takes: dict) -> dict[str, Any]:
    """Old option names mapped to the new ones, checked, with a DeprecationWarning."""
    for old, new in spec.renamed.items():
        if old not in options:
            continue
        if new in options:
            raise InputError(
                f"{fn}: method={spec.name!r} got both {old}= and {new}=; {old}= is the old "
                f"name of {new}=: pass only {new}=."
            )
        value = takes[new].check(fn, options.pop(old), name=old)
        warnings.warn(
            f"{fn}: method={spec.name!r} option {old}= is renamed {new}= ({old}= keeps working "
            f"for one release); pass {new}={value!r}.",
            DeprecationWarning,
            stacklevel=5,
        )
        options[new] = value
    return options


def resolve_options(fn: str, method: Any, space: Any, options: Mapping[str, Any]) -> Resolved:
    """Every option of ``method`` in ``space`` checked for type and range, defaults filled in.

    Raises:
      InputError: an unknown method, space or option; a missing required option; a value out
        of range.
      InputTypeError: a value of the wrong type.

    Example:
      >>> from netutility_jax import registry
      >>> res = registry.resolve_options("f", "ties", "knots", {"density": 0.3})
      >>> res.options
      {'density': 0.3, 'trim_scope': 'module', 'variant': 'core_space'}
      >>> registry.resolve_options("f", "ta", "full", {"isotropize": True}).kernel_method
      'iso_c'
    """
    spec = method_spec(fn, method)
    _checks.check_choice(fn, "space", space, tuple(SPACES))
    takes = _takes(spec, space)
    options = _renamed(fn, spec, dict(options), takes)
    extra = sorted(set(options) - set(takes), key=str)
    if extra:
        which = ", ".join(repr(k) for k in takes) or "no options"
        raise InputError(
            f"{fn}: method={method!r} in space={space!r} does not take "
            f"{', '.join(_checks.brief(k) for k in extra[:4])}{' ...' if len(extra) > 4 else ''}"
            f"; it takes {which}."
        )
    opts = {}
    for name, opt in takes.items():
        if name not in options and opt.required:
            raise InputError(f"{fn}: method={method!r} needs {name}= ({opt.expected}).")
        opts[name] = opt.check(fn, options[name]) if name in options else opt.default
    mopts = {k: v for k, v in opts.items() if k in {o.name for o in spec.options}}
    kmethod, kopts = spec.canonical(mopts) if spec.canonical else (spec.name, mopts)
    return Resolved(spec, space, opts, kmethod, kopts)
