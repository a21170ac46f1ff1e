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
import keyword
import math
import numbers
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import numpy as np

from ._core import checks as _checks
from .errors import InputError, InputTypeError
from .operators import methods as _m

__all__ = [
    "ALLOCATIONS",
    "COMMAND_FLAGS",
    "METHODS",
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
            eg = f"e.g. {self.example}" if self.example else ""
            about = ", ".join(x for x in (self.what, eg) if x)
            return f"a number in {self.interval()}{f' ({about})' if about else ''}"
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
        module (TIES: ``("trim_scope", "model")``), or None. Needs ``blocked="ties"``: the
        model-wide selection is TIES's own blocked code, not the kernel.
      blocked: the library's row-blocked implementation of this kernel, run instead of it when
        one module's dense tasks exceed the working memory: ``"ties"`` (TIES's trim by radix
        selection, then its sign election and disjoint mean), ``"dare"`` or ``"dare_ties"``
        (the drop a block of rows at a time, then that method's combination); None (user
        methods): the kernel always sees whole modules. Declare it only for a kernel that
        computes exactly that operator.
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
    blocked: Literal["ties", "dare", "dare_ties"] | None = None
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
    "ties: fraction of entries each task keeps, in (0, 1] (default 0.2, the value PEFT's "
    "model-merging guide uses)",
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


#: Names an option may not take: the keywords of :func:`nu.merge` and :func:`nu.merge_adapters`
#: (an option named ``coef`` would be taken by ``merge`` itself, never reaching the method) and
#: those the kernels are called with. ``tests/test_registry.py`` checks that it covers both
#: signatures.
RESERVED_OPTION_NAMES = (
    "adapters", "masks", "method", "space", "coef", "key", "mesh", "options",
    "budget", "allocation", "scope", "alpha", "lam", "positive_only",
    "a", "b", "x", "rtol", "is_svd", "keys", "k_top", "weights", "min_share", "input_moments",
    "interference",
)  # fmt: skip
COMMAND_FLAGS = (
    "--allocation",
    "--allow-changed",
    "--allow-different-base",
    "--alpha",
    "--budget",
    "--chunk-mb",
    "--coef",
    "--config",
    "--coordinator",
    "--devices",
    "--diagnose",
    "--distributed",
    "--distributed-timeout",
    "--dry-run",
    "--dtype",
    "--heartbeat-timeout",
    "--help",
    "--in-memory",
    "--input-moments",
    "--interference",
    "--json",
    "--keep-nonpositive",
    "--keep-shards",
    "--lam",
    "--method",
    "--min-share",
    "--no-compile-cache",
    "--no-plots",
    "--num-processes",
    "--out",
    "--process-id",
    "--quiet",
    "--rank",
    "--scope",
    "--seed",
    "--serving-ranks",
    "--skip-non-lora",
    "--space",
    "--strict-targets",
    "--weights",
)
"""The flags of ``netutility merge`` and ``inspect`` that are not a method's or space's option:
an option's flag must not be one of them (argparse would refuse the whole parser).
``tests/test_registry.py`` checks this list against the parser."""
KINDS = ("low_rank", "elementwise")
OPTION_KINDS = ("real", "bool", "choice")
BUDGET_SCOPES = ("global", "local")
_NAME_CHARS = "letters, digits and underscores, starting with a letter"


class _Mistakes:
    """The mistakes found in one declaration: ``(message, is_type)`` each, raised together."""

    def __init__(self) -> None:
        self.found: list[tuple[str, bool]] = []

    def add(self, msg: str, *, type_error: bool = False) -> None:
        self.found.append((msg, type_error))

    def value(self, field: str, value: Any, expected: str, *, type_error: bool = False) -> None:
        self.add(f"{field}={_checks.given(value)}; expected {expected}.", type_error=type_error)

    def raise_if_any(self, name: Any) -> None:
        if not self.found:
            return
        who = f"registry.register: method {_checks.brief(name)}"
        msgs = [m for m, _ in self.found]
        text = (
            f"{who}: {msgs[0]}"
            if len(msgs) == 1
            else f"{who} has {len(msgs)} mistakes: "
            + " ".join(f"({i}) {m}" for i, m in enumerate(msgs, 1))
        )
        cls = InputTypeError if all(t for _, t in self.found) else InputError
        raise cls(text)


def _is_name(x: Any) -> bool:
    return isinstance(x, str) and x.isascii() and x[:1].isalpha() and x.replace("_", "a").isalnum()


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool)


def _is_number(x: Any) -> bool:
    """A Python or numpy real number (not a bool, not an array)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _is_real(x: Any) -> bool:
    return _is_number(x) and not math.isnan(x)


def _in_range(opt: Option, v: Any) -> bool:
    try:
        return opt.in_range(float(v))
    except OverflowError:  # an integer beyond float range
        return False


def _check_option(opt: Any, i: int, ms: _Mistakes) -> bool:
    """The mistakes of one :class:`Option` (its own fields); False if it is no Option at all."""
    if not isinstance(opt, Option):
        ms.value(f"options[{i}]", opt, "a registry.Option", type_error=True)
        return False
    if not _is_name(opt.name) or keyword.iskeyword(opt.name):
        ms.value(
            f"options[{i}].name", opt.name, f"a keyword of nu.merge ({_NAME_CHARS})",
            type_error=not isinstance(opt.name, str),
        )  # fmt: skip
        return False
    at = f"option {opt.name!r}: "
    if opt.name in RESERVED_OPTION_NAMES:
        ms.add(
            f"{at}the name is taken by nu.merge, nu.merge_adapters or the kernels; choose "
            f"another (taken: {', '.join(RESERVED_OPTION_NAMES)})."
        )
    if opt.kind not in OPTION_KINDS:
        ms.value(f"{at}kind", opt.kind, f"one of {OPTION_KINDS}")
        return True
    for field in ("help", "what", "example", "choice_help"):
        if not isinstance(getattr(opt, field), str):
            ms.value(f"{at}{field}", getattr(opt, field), "a string", type_error=True)
    if isinstance(opt.help, str) and not opt.help.strip():
        ms.value(f"{at}help", opt.help, "one line for the command line's help")
    for field in ("low_open", "high_open", "traced"):
        if not _is_bool(getattr(opt, field)):
            ms.value(f"{at}{field}", getattr(opt, field), "True or False", type_error=True)
    if opt.cli_low_open is not None and not _is_bool(opt.cli_low_open):
        ms.value(f"{at}cli_low_open", opt.cli_low_open, "None, True or False", type_error=True)
    if opt.cli_what is not None and not isinstance(opt.cli_what, str):
        ms.value(f"{at}cli_what", opt.cli_what, "None or a string", type_error=True)
    if opt.flag is not None and not (
        isinstance(opt.flag, str)
        and opt.flag.startswith("--")
        and _is_name(opt.flag[2:].replace("-", "_"))
    ):
        ms.value(f"{at}flag", opt.flag, "None or a flag such as '--my-option'")
    if opt.kind != "choice" and opt.choices:
        ms.add(f"{at}choices={_checks.brief(opt.choices)} apply to kind='choice' only.")
    if opt.kind == "real":
        ok = True
        for field in ("low", "high"):
            v = getattr(opt, field)
            if not _is_real(v):
                ms.value(f"{at}{field}", v, "a real number (-inf and inf allowed)")
                ok = False
        if ok and opt.low > opt.high:
            ms.add(f"{at}low={opt.low!r} > high={opt.high!r}; expected low <= high.")
        elif ok and opt.low == opt.high and (opt.low_open or opt.high_open):
            ms.add(f"{at}the interval {opt.interval()} is empty; expected low < high.")
        elif ok and not opt.required:
            d = opt.default
            if not _is_number(d):
                ms.value(f"{at}default", d, opt.expected, type_error=True)
            elif not _in_range(opt, d):
                ms.value(f"{at}default", d, opt.expected)
    elif opt.kind == "bool":
        if not opt.required and not _is_bool(opt.default):
            ms.value(f"{at}default", opt.default, "True or False", type_error=True)
    else:
        c = opt.choices
        if not (
            isinstance(c, tuple) and c and all(isinstance(x, str) for x in c)
            and len(set(c)) == len(c)
        ):  # fmt: skip
            ms.value(f"{at}choices", c, "a non-empty tuple of distinct strings")
        elif not opt.required and opt.default not in c:
            ms.value(
                f"{at}default", opt.default, f"one of {c}",
                type_error=not isinstance(opt.default, str),
            )  # fmt: skip
    return True


def _same_declaration(a: Option, b: Option) -> bool:
    """Options that share a name share one command-line flag: the same kind, range, choices."""
    fields = ("kind", "low", "high", "low_open", "high_open", "choices", "flag")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def _kernel_call(spec: MethodSpec, opts: dict[str, Option]) -> tuple[str, tuple, dict] | None:
    """How the stages call ``spec.kernel`` (its description, positional and keyword arguments),
    or None where it cannot be known (a ``canonical`` may drop options)."""
    if spec.canonical is not None:
        return None
    if spec.kind == "low_rank":
        kw = {"coef": 1.0, "rtol": 0.0, "is_svd": False, **dict.fromkeys(opts)}
        return "kernel(a, b, coef=, rtol=, is_svd=, **options)", (None, None), kw
    traced = [n for n, o in opts.items() if o.kind == "real" and o.traced]
    kw = {"coef": 1.0, "k_top": 0, **dict.fromkeys(traced)}
    return "kernel(x, keys, coef=, k_top=, **traced_options)", (None, None), kw


def _check_kernel(spec: MethodSpec, opts: dict[str, Option], ms: _Mistakes) -> None:
    import inspect

    if not callable(spec.kernel):
        ms.value("kernel", spec.kernel, f"a callable (the {spec.kind} kernel)", type_error=True)
        return
    call = _kernel_call(spec, opts)
    if call is None:
        return
    try:
        sig = inspect.signature(spec.kernel)
    except (TypeError, ValueError):  # a builtin or such: nothing to read
        return
    what, args, kw = call
    try:
        sig.bind(*args, **kw)
    except TypeError as e:
        kind = "low-rank" if spec.kind == "low_rank" else "elementwise"
        ms.add(
            f"kernel: its signature {sig} cannot take the {kind} call "
            f"{what.replace(', **options', '').replace(', **traced_options', '')}"
            f"{' with options ' + ', '.join(map(repr, kw)) if opts else ''} ({e}); see the "
            "module docstring of netutility_jax.registry for the kernels' signatures."
        )


def _check_spaces(spec: MethodSpec, ms: _Mistakes) -> tuple[str, ...]:
    """The declared spaces that exist (the mistakes of ``spaces`` and ``same_spaces`` noted)."""
    known = tuple(SPACES)
    sp = spec.spaces
    if not isinstance(sp, tuple) or not sp:
        ms.value(
            "spaces", sp, f"a non-empty tuple of space names among {known}",
            type_error=not isinstance(sp, tuple),
        )  # fmt: skip
        sp = sp if isinstance(sp, tuple) else ()
    good = []
    for s in sp:
        if not isinstance(s, str) or s not in SPACES:
            ms.add(f"spaces: {_checks.brief(s)} is not a space; expected among {known}.")
        elif s in good:
            ms.add(f"spaces: {s!r} is named twice.")
        else:
            good.append(s)
    groups = spec.same_spaces
    if not isinstance(groups, tuple) or not all(isinstance(g, tuple) and g for g in groups):
        ms.value(
            "same_spaces", groups,
            f"a tuple of non-empty tuples of space names among {known}, e.g. (('full', 'core'), "
            "('knots',))",
        )  # fmt: skip
        return tuple(good)
    seen: set[str] = set()
    for g in groups:
        for s in g:
            if not isinstance(s, str) or s not in SPACES:
                ms.add(f"same_spaces: {_checks.brief(s)} is not a space; expected among {known}.")
            elif s in seen:
                ms.add(f"same_spaces: {s!r} is in two groups; each space is in one group at most.")
            else:
                seen.add(s)
        if len(g) > 1:
            for s in g:
                if isinstance(s, str) and s in SPACES and s not in good:
                    ms.add(
                        f"same_spaces: group {g!r} names {s!r}, which is not among spaces "
                        f"{tuple(good)}; a method can give identical results only in spaces it "
                        "runs in."
                    )
    return tuple(good)


def _check_options(spec: MethodSpec, spaces: tuple[str, ...], ms: _Mistakes) -> dict[str, Option]:
    """The method's well-formed options by name (the mistakes of each and between them noted)."""
    if not isinstance(spec.options, tuple):
        ms.value("options", spec.options, "a tuple of registry.Option", type_error=True)
        return {}
    opts: dict[str, Option] = {}
    for i, opt in enumerate(spec.options):
        if not _check_option(opt, i, ms):
            continue
        if opt.name in opts:
            ms.add(f"options: {opt.name!r} is declared twice.")
            continue
        opts[opt.name] = opt
        at = f"option {opt.name!r}: "
        if opt.cli_flag in COMMAND_FLAGS:
            ms.add(
                f"{at}its command-line flag {opt.cli_flag} is one of netutility merge's own flags; "
                "choose another name."
            )
        shadows = [sp for sp in spaces if any(o.name == opt.name for o in SPACES[sp].options)]
        for sp in shadows:
            ms.add(
                f"{at}space {sp!r} has an option of that name, which the method's would shadow; "
                "choose another name."
            )
        declared = [(f"method {n!r}", o) for n, m in METHODS.items() for o in m.options]
        declared += [(f"space {n!r}", o) for n, sp in SPACES.items() for o in sp.options]
        clash = next(
            (
                (who, o)
                for who, o in declared
                if o.name == opt.name and not _same_declaration(o, opt)
            ),
            None,
        )
        if clash and not shadows:
            who, o = clash
            rng = f" in {o.interval()}" if o.kind == "real" else ""
            ms.add(
                f"{at}{who} declares it as a {o.kind} option{rng}"
                f"{f' with choices {o.choices}' if o.choices else ''}; options that share a name "
                f"share one command-line flag ({o.cli_flag}), so they must have the same kind, "
                "range and choices (or choose another name)."
            )
        if (
            spec.kind == "elementwise"
            and spec.canonical is None
            and not (opt.kind == "real" and opt.traced)
            and opt.name != spec.keeps_top
            and not (isinstance(spec.model_wide, tuple) and spec.model_wide[:1] == (opt.name,))
        ):
            ms.add(
                f"{at}a {opt.kind} option of an elementwise method never reaches its kernel "
                "(elementwise kernels get only real options with traced=True, as data); make it "
                "a traced real option, or use it through keeps_top, model_wide or canonical."
            )
    return opts


def _check_elementwise_fields(spec: MethodSpec, opts: dict[str, Option], ms: _Mistakes) -> None:
    """``needs_key``, ``keeps_top`` and ``model_wide``: only elementwise methods use them."""
    ew = spec.kind == "elementwise"
    if not _is_bool(spec.needs_key):
        ms.value("needs_key", spec.needs_key, "True or False", type_error=True)
    elif spec.needs_key and not ew:
        ms.add(
            "needs_key=True needs kind='elementwise' (low-rank kernels draw no random masks and "
            "get no keys)."
        )
    kt = spec.keeps_top
    if kt is not None:
        opt = opts.get(kt) if isinstance(kt, str) else None
        if not ew:
            ms.add(f"keeps_top={_checks.brief(kt)} needs kind='elementwise' (a count of entries).")
        elif opt is None:
            ms.add(
                f"keeps_top={_checks.brief(kt)} is not an option of the method; expected None or "
                f"one of its real options {tuple(n for n, o in opts.items() if o.kind == 'real')}."
            )
        elif not (opt.kind == "real" and opt.low >= 0 and opt.high <= 1 and not opt.traced):
            ms.add(
                f"keeps_top={kt!r}: the option must be a real fraction in [0, 1] with "
                f"traced=False (the host turns it into counts); it is a {opt.kind} option"
                f"{f' in {opt.interval()}' if opt.kind == 'real' else ''} with "
                f"traced={opt.traced}."
            )
    bl = spec.blocked
    if bl is not None:
        if bl not in ("ties", "dare", "dare_ties"):
            ms.value("blocked", bl, "None, 'ties', 'dare' or 'dare_ties'")
        elif not ew:
            ms.add(f"blocked={bl!r} needs kind='elementwise' (a row-blocked dense operator).")
        elif bl == "ties" and kt is None:
            ms.add("blocked='ties' needs keeps_top (TIES's blocked trim counts kept entries).")
        elif bl != "ties" and not (spec.needs_key and "p" in opts):
            ms.add(
                f"blocked={bl!r} needs needs_key=True and a drop-rate option 'p' (its blocks "
                "draw DARE's mask)."
            )
    mw = spec.model_wide
    if mw is not None:
        if not (isinstance(mw, tuple) and len(mw) == 2 and isinstance(mw[0], str)):
            ms.value("model_wide", mw, "None or (option name, value)")
        elif not ew or kt is None:
            ms.add(
                f"model_wide={_checks.brief(mw)} needs keeps_top (and kind='elementwise'): it "
                "makes keeps_top's count over the whole model."
            )
        elif spec.blocked != "ties":
            ms.add(
                f"model_wide={mw!r} needs blocked='ties': the model-wide count runs TIES's own "
                "blocked selection, not the method's kernel (for another operator, leave "
                "model_wide None: the kernel then counts per module)."
            )
        elif mw[0] not in opts:
            ms.add(f"model_wide={mw!r}: {mw[0]!r} is not an option of the method.")
        else:
            try:
                opts[mw[0]].check("model_wide", mw[1], name=mw[0])
            except (InputError, InputTypeError) as e:
                ms.add(f"model_wide={mw!r}: {str(e).removeprefix('model_wide: ')}")


def _check_spec(spec: Any) -> None:
    """Every mistake in a :class:`MethodSpec`, raised together (see :func:`register`)."""
    if not isinstance(spec, MethodSpec):
        raise InputTypeError(
            f"registry.register: spec={_checks.given(spec)}; expected a registry.MethodSpec."
        )
    ms = _Mistakes()
    if not isinstance(spec.name, str):
        ms.value("name", spec.name, "a string (the method= of nu.merge)", type_error=True)
    elif not _is_name(spec.name):
        ms.value("name", spec.name, f"a name of {_NAME_CHARS}")
    elif spec.name in METHODS:
        raise InputError(f"registry.register: a method named {spec.name!r} exists already.")
    for field in ("label", "summary"):
        v = getattr(spec, field)
        if not (isinstance(v, str) and v.strip()):
            ms.value(field, v, "a non-empty string", type_error=not isinstance(v, str))
    if spec.kind not in KINDS:
        ms.value("kind", spec.kind, f"one of {KINDS}")
    spaces = _check_spaces(spec, ms)
    opts = _check_options(spec, spaces, ms)
    if spec.kind in KINDS:
        _check_kernel(spec, opts, ms)
        _check_elementwise_fields(spec, opts, ms)
    elif not callable(spec.kernel):
        ms.value("kernel", spec.kernel, "a callable (the kernel)", type_error=True)
    if spec.budget_scope not in BUDGET_SCOPES:
        ms.value("budget_scope", spec.budget_scope, f"one of {BUDGET_SCOPES}")
    if spec.canonical is not None and not callable(spec.canonical):
        ms.value("canonical", spec.canonical, "a callable or None", type_error=True)
    _check_renamed(spec, opts, spaces, ms)
    ms.raise_if_any(spec.name)


def _check_renamed(
    spec: MethodSpec, opts: dict[str, Option], spaces: tuple[str, ...], ms: _Mistakes
) -> None:
    if not isinstance(spec.renamed, Mapping):
        ms.value("renamed", spec.renamed, "a mapping {old name: new name}", type_error=True)
        return
    takes = set(opts) | {o.name for s in spaces for o in SPACES[s].options}
    for old, new in spec.renamed.items():
        if not (_is_name(old) and isinstance(new, str)):
            ms.add(
                f"renamed: {_checks.brief(old)} -> {_checks.brief(new)}; expected option names "
                f"({_NAME_CHARS})."
            )
        elif new not in takes:
            ms.add(
                f"renamed: {old!r} -> {new!r} renames to {new!r}, which is not an option of the "
                f"method; its options are {tuple(sorted(takes))}."
            )
        elif old in takes:
            ms.add(f"renamed: {old!r} -> {new!r}: {old!r} is still an option's name.")


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
    _check_spec(spec)
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
