"""Merge methods and spaces as declarations: the one table everything else reads.

Each merge method is one :class:`MethodSpec`: its name and label, its options (:class:`Option`:
type, default, range, help), the spaces it runs in, whether its result stays low rank there, the
spaces in which it gives identical results, and its kernel. Each space is one :class:`SpaceSpec`
with its options. :func:`nu.merge` validates and resolves options through
:func:`resolve_options`; ``netutility merge`` builds its flags and help from :data:`METHODS` and
:data:`SPACES` (in its own wording where it differs: ``netutility_jax.cli.options``); the
built-in experiment takes labels and identical spaces from here.

Adding a method is one :class:`MethodSpec` (here, or :func:`register` from user code) plus its
kernel: a low-rank kernel maps factored tasks ``a (..., M, p, r)``, ``b (..., M, q, r)`` to merged
factors ``(a (..., p, k), b (..., q, k))``; an elementwise kernel maps dense tasks
``x (n, M, p, q)`` (a batch of modules) with per-module keys and kept counts to ``(n, p, q)``.
Kernels are pure and traced inside the pipeline's jitted stages (:mod:`netutility_jax.operators._stages`).
:func:`register` checks the whole declaration before it is added (one message per mistake,
naming the field and the values allowed); the stages check every kernel's output against these
signatures while tracing (shapes, dtype: an error naming the method) and its finiteness per
module from one reduction (a NaN is an error naming the method, an inf a range error).

Option values are checked on the host, before anything is computed: real options that only
reach a kernel as data (``traced=True``: DARE's ``p``, Iso-CTS's ``common_fraction``) may be
traced and do not recompile when they change; the others are static configuration.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import jax

from ._core import checks as _checks
from .errors import InputError
from .operators import methods as _m
from .operators._declarations import check_spec
from .operators.specs import (
    BUDGET_SCOPES,
    COMMAND_FLAGS,
    KINDS,
    METHODS,
    OPTION_KINDS,
    REQUIRED,
    RESERVED_OPTION_NAMES,
    SPACES,
    MethodSpec,
    Option,
    SpaceSpec,
)

__all__ = [
    "ALLOCATIONS",
    "BUDGET_SCOPES",
    "COMMAND_FLAGS",
    "KINDS",
    "METHODS",
    "OPTION_KINDS",
    "REQUIRED",
    "RESERVED_OPTION_NAMES",
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

# the declarations' public home is this module (their reprs, pickles and docs say so)
for _cls in (MethodSpec, Option, SpaceSpec):
    _cls.__module__ = __name__

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
    "ties: fraction of entries each task keeps, in (0, 1] (default 0.2, the value PEFT's "
    "model-merging guide uses)",
    what="the fraction of entries each task keeps",
    low=0.0,
    high=1.0,
    example="0.2",
    traced=False,
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

_ALL = ("full", "core", "knots")
_FULL_CORE = (("full", "core"), ("knots",))


def register(spec: MethodSpec) -> MethodSpec:
    """Add a merge method, after checking its whole declaration.

    Every field is checked when the method is registered, so that a mistake is not met later
    inside a jitted stage (or never): the name, kind, kernel (callable, and its signature takes
    the stages' call), each option (kind, default in its range or among its choices, a range with
    ``low <= high``, a name that ``nu.merge`` does not take itself, such as ``coef``), the spaces
    and ``same_spaces`` (known spaces, disjoint groups), ``needs_key``, ``keeps_top`` and
    ``model_wide`` (elementwise methods only), the budget scope, ``renamed`` and ``canonical``.

    Raises:
      InputError: a name already taken; any mistake in the declaration (all of them, each
        naming its field, the value given and the values allowed).
      InputTypeError: when every mistake is a value of the wrong type.

    Example:
      >>> from netutility_jax import registry
      >>> registry.register(registry.MethodSpec("m", "M", "m", "spectral", print))
      Traceback (most recent call last):
      ...
      netutility_jax.errors.InputError: registry.register: method 'm': kind='spectral' (str); expected one of ('low_rank', 'elementwise').
    """
    check_spec(spec)
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
        model_wide=("trim_scope", "model"), blocked="ties", budget_scope="local",
        renamed={"scope": "trim_scope"},
    ),
    MethodSpec(
        "dare", "DARE", "drop entries with probability p, rescale by 1/(1-p), sum",
        "elementwise", _per_module(_m.dare), (_P,), needs_key=True, blocked="dare",
        budget_scope="local",
    ),
    MethodSpec(
        "dare_ties", "DARE-TIES", "DARE's drop, then TIES's sign election and disjoint mean",
        "elementwise", _per_module(_m.dare_ties), (_P,), needs_key=True, blocked="dare_ties",
        budget_scope="local",
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
            stacklevel=_checks.caller_stacklevel(),
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
