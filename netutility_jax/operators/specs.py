"""The declarations of merge methods and spaces (:class:`Option`, :class:`MethodSpec`,
:class:`SpaceSpec`), the names they may not take, and the tables :mod:`netutility_jax.registry`
fills and serves (``nu.registry`` is their public home)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

from .._core import checks as _checks

__all__ = [
    "BUDGET_SCOPES",
    "COMMAND_FLAGS",
    "KINDS",
    "KNOTS_VARIANT",
    "METHODS",
    "OPTION_KINDS",
    "REQUIRED",
    "RESERVED_OPTION_NAMES",
    "SPACES",
    "MethodSpec",
    "Option",
    "SpaceSpec",
]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of an option that has none (the user must give it).
REQUIRED: Any = _Required()

#: :class:`Option`'s deprecated fields: the command line's wording, which the command line owns.
_CLI_FIELDS = ("flag", "cli_low_open", "cli_what")


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
      flag, cli_low_open, cli_what: deprecated (they keep working for one release, with a
        :class:`DeprecationWarning` when given): how the command line words the option is the
        command line's, ``netutility_jax.cli.options.OPTION_WORDING`` (its flag, a stricter
        lower bound, other words for ``what``).
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

    def __post_init__(self) -> None:
        given = [f"{f}=" for f in _CLI_FIELDS if getattr(self, f) is not None]
        if given:
            warnings.warn(
                f"registry.Option({self.name!r}): {', '.join(given)} "
                f"{'is' if len(given) == 1 else 'are'} deprecated (kept for one release): the "
                "command line's wording of an option is the command line's, "
                f"netutility_jax.cli.options.OPTION_WORDING[(method, {self.name!r})] = "
                "OptionWording(flag=..., low_open=..., what=...).",
                DeprecationWarning,
                stacklevel=3,  # (the caller of the dataclass's __init__)
            )

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def cli_flag(self) -> str:
        """Deprecated (kept for one release): the flag the deprecated ``flag`` field declares,
        else ``--name``. The command line's flag of an option is
        ``netutility_jax.cli.options.option_flag(name)`` (``--knots-variant`` for KnOTS'
        ``variant``)."""
        _deprecated_cli(f"Option({self.name!r}).cli_flag", "option_flag(name)")
        return self.flag or "--" + self.name.replace("_", "-")

    def interval(self, *, cli: bool = False) -> str:
        """``[0, 1)`` and such (``cli``, deprecated: with the deprecated ``cli_low_open``, if
        given)."""
        if cli:
            _deprecated_cli(f"Option({self.name!r}).interval(cli=True)", "option_wording(name)")
        low_open = self.cli_low_open if cli and self.cli_low_open is not None else self.low_open
        return (
            f"{'(' if low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        )

    def in_range(self, v: float, *, cli: bool = False) -> bool:
        """Whether ``v`` is in :meth:`interval` (``cli``: deprecated, as there)."""
        if cli:
            _deprecated_cli(f"Option({self.name!r}).in_range(cli=True)", "option_wording(name)")
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


KNOTS_VARIANT = Option(
    "variant",
    "choice",
    "core_space",
    "knots space: core_space (unscaled blocks, default) or original (scaled blocks)",
    choices=("core_space", "original"),
    choice_help=" ('core_space': unscaled blocks V_i, default; 'original': scaled blocks S V_i)",
)

#: Every merge method, in the order the command line and messages list them.
METHODS: dict[str, MethodSpec] = {}
#: Every space.
SPACES: dict[str, SpaceSpec] = {
    "full": SpaceSpec("full", "Full", "the dense d_in x d_out update space"),
    "core": SpaceSpec("core", "Core", "Core Space (Panariello et al. 2025)"),
    "knots": SpaceSpec("knots", "KnOTS", "KnOTS (Stoica et al. 2024)", (KNOTS_VARIANT,)),
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


def _deprecated_cli(what: str, instead: str) -> None:
    """The DeprecationWarning of a command-line reading of an :class:`Option` (kept for one
    release), pointing at the caller."""
    warnings.warn(
        f"registry.{what} is deprecated (kept for one release): the command line's wording of an "
        f"option is the command line's, netutility_jax.cli.options.{instead}.",
        DeprecationWarning,
        stacklevel=3,
    )
