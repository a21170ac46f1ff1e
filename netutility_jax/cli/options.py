"""The merge methods' and spaces' options as ``netutility merge`` flags: one flag per option of
:mod:`netutility_jax.registry` (its type, range and help; :func:`add_method_options`), and the
flags' values turned back into the options of :func:`netutility_jax.merge_adapters`
(:func:`method_options`, :func:`options_of`).

How the command line words an option is the command line's own: the registry declares the
option (its name, kind, range, help), and :data:`OPTION_WORDING` says where the flag differs
(:class:`OptionWording`: another flag, a stricter lower bound, other words for what it is).
An option's flag is otherwise ``--`` and its config key (:func:`nu.folders.option_key`:
``--density``, ``--knots-variant``), which a ``--config`` file and a report spell without
the dashes. A method registered with the deprecated ``registry.Option(flag=...,
cli_low_open=..., cli_what=...)`` still gets that wording (for one release).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..folders import option_key
from .common import UsageError
from .values import bounded_float

__all__ = [
    "CLI_DEFAULTS",
    "OPTION_WORDING",
    "OptionWording",
    "add_method_options",
    "method_options",
    "option_flag",
    "option_names",
    "option_wording",
    "options_of",
]


@dataclasses.dataclass(frozen=True)
class OptionWording:
    """How the command line words one option of a method or space, where it differs from the
    registry's declaration (None: as declared).

    Attributes:
      flag: the flag (default ``--`` and the option's config key, :func:`nu.folders.option_key`).
      low_open: the command line's own lower bound, if stricter (a density of 0 keeps nothing,
        which no one asks for from a shell).
      what: how the command line's messages say what the value is, if not the option's
        ``what``.
    """

    flag: str | None = None
    low_open: bool | None = None
    what: str | None = None


OPTION_WORDING: dict[tuple[str, str], OptionWording] = {
    ("ties", "density"): OptionWording(low_open=True, what="the kept fraction"),
}
"""The command line's wording of the options, by ``(method or space, option name)``: a user's
method adds its own here (``OPTION_WORDING[("my_method", "my_option")] = OptionWording(
flag="--my-flag")``). Options that share a name share one flag: the first entry of a method or
space that declares the option (in the registry's order) is its wording."""


def _options_by_flag() -> dict[str, Any]:
    """Every method and space option of the registry, once each, by name."""
    from .. import registry

    out: dict[str, Any] = {}
    for spec in (*registry.METHODS.values(), *registry.SPACES.values()):
        for opt in spec.options:
            out.setdefault(opt.name, opt)
    return out


def option_names() -> tuple[str, ...]:
    """The names (and ``dest``) of the registry's method and space options' flags."""
    return tuple(_options_by_flag())


def option_wording(name: str) -> OptionWording:
    """The command line's wording of the registry's option ``name``, every field given: its
    :data:`OPTION_WORDING` entry, else what the deprecated fields of its declaration say
    (``flag``, ``cli_low_open``, ``cli_what``), else the declaration's own."""
    from .. import registry

    opt = _options_by_flag()[name]
    owners = [
        spec.name
        for spec in (*registry.METHODS.values(), *registry.SPACES.values())
        if any(o.name == name for o in spec.options)
    ]
    entry = next(
        (OPTION_WORDING[(o, name)] for o in owners if (o, name) in OPTION_WORDING), OptionWording()
    )
    low_open = next(v for v in (entry.low_open, opt.cli_low_open, opt.low_open) if v is not None)
    return OptionWording(
        flag=entry.flag or "--" + option_key(name),
        low_open=low_open,
        what=entry.what or opt.cli_what or opt.what,
    )


def option_flag(name: str) -> str:
    """The flag of the registry's option ``name`` (``--density``, ``--knots-variant``)."""
    return option_wording(name).flag  # type: ignore[return-value]


CLI_DEFAULTS: dict[str, float] = {"p": 0.8}
"""The command line's defaults for options the registry requires from Python callers:
DARE's drop rate ``p`` is 0.8, PEFT's model-merging guide's ``density=0.2`` for
``dare_ties`` (DARE keeps 20% of the entries). TIES's ``density`` default, 0.2, is the
registry's (the same guide's value)."""


def add_method_options(m: argparse.ArgumentParser) -> None:
    """One flag per method / space option of the registry (its type, range and help, in the
    command line's wording: :func:`option_wording`)."""
    for opt in _options_by_flag().values():
        dest = opt.name
        words = option_wording(opt.name)
        help_text = opt.help
        if opt.required and opt.name in CLI_DEFAULTS:
            help_text += (
                f". Default: {CLI_DEFAULTS[opt.name]:g} (PEFT's model-merging guide keeps "
                f"density {1 - CLI_DEFAULTS[opt.name]:g} with DARE)"
            )
        if opt.kind == "bool":
            m.add_argument(words.flag, dest=dest, action="store_true", help=help_text)
        elif opt.kind == "choice":
            m.add_argument(words.flag, dest=dest, choices=opt.choices, default=None, help=help_text)
        else:
            parse = bounded_float(
                opt.low, opt.high, low_open=bool(words.low_open), high_open=opt.high_open,
                what=words.what or "",
            )  # fmt: skip
            m.add_argument(words.flag, dest=dest, type=parse, default=None, help=help_text)


def method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``**options`` of :func:`nu.merge_adapters` from the flags, refusing (before any
    loading) a flag the method and space do not take, and a missing required one."""
    return options_of(vars(args))


def options_of(
    values: Mapping[str, Any], *, named: Callable[[str], str] = option_flag
) -> dict[str, Any]:
    """The ``**options`` of :func:`nu.merge_adapters` from the options' values (``values``: by
    name, with the ``method`` and ``space``; None or False: not given), refusing an option the
    method and space do not take (``named``: how the message names it; default its flag) and a
    missing required one. The command line's defaults (:data:`CLI_DEFAULTS`) fill in the
    rest."""
    from .. import registry

    method, space = values["method"], values["space"]
    options: dict[str, Any] = {}
    for name in _options_by_flag():
        value = values.get(name)
        if value is not None and value is not False:
            options[name] = value
    spec = registry.METHODS[method]
    takes = {o.name: o for o in (*spec.options, *registry.SPACES[space].options)}
    for name in options:
        if name not in takes:
            flags = [option_flag(o) for o in takes]
            raise UsageError(
                f"{named(name)} does not apply to method {method} in {space} space; it takes "
                f"{', '.join(flags) if flags else 'none of the method options'}."
            )
    for name, opt in takes.items():
        if opt.required and name not in options and name in CLI_DEFAULTS:
            options[name] = CLI_DEFAULTS[name]
        elif opt.required and name not in options:
            words = option_wording(name)
            interval = (
                f"{'(' if words.low_open else '['}{opt.low:g}, {opt.high:g}"
                f"{')' if opt.high_open else ']'}"
            )
            raise UsageError(
                f"method {method} needs {words.flag} ({opt.what} in {interval}, e.g. "
                f"{words.flag} {opt.example})."
            )
    return options
