"""The merge methods' and spaces' options as ``netutility merge`` flags: one flag per option of
:mod:`netutility_jax.registry` (its type, range and help; :func:`add_method_options`), and the
parsed flags turned back into the options of :func:`netutility_jax.merge_adapters`
(:func:`method_options`)."""

from __future__ import annotations

import argparse
from typing import Any

from .common import UsageError
from .values import bounded_float

__all__ = ["CLI_DEFAULTS", "add_method_options", "method_options", "option_names"]


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


CLI_DEFAULTS: dict[str, float] = {"p": 0.8}
"""The command line's defaults for options the registry requires from Python callers:
DARE's drop rate ``p`` is 0.8, PEFT's model-merging guide's ``density=0.2`` for
``dare_ties`` (DARE keeps 20% of the entries). TIES's ``density`` default, 0.2, is the
registry's (the same guide's value)."""


def add_method_options(m: argparse.ArgumentParser) -> None:
    """One flag per method / space option of the registry (its type, range and help)."""
    for opt in _options_by_flag().values():
        dest = opt.name
        help_text = opt.help
        if opt.required and opt.name in CLI_DEFAULTS:
            help_text += (
                f". Default: {CLI_DEFAULTS[opt.name]:g} (PEFT's model-merging guide keeps "
                f"density {1 - CLI_DEFAULTS[opt.name]:g} with DARE)"
            )
        if opt.kind == "bool":
            m.add_argument(opt.cli_flag, dest=dest, action="store_true", help=help_text)
        elif opt.kind == "choice":
            m.add_argument(
                opt.cli_flag, dest=dest, choices=opt.choices, default=None, help=help_text
            )
        else:
            low_open = opt.low_open if opt.cli_low_open is None else opt.cli_low_open
            parse = bounded_float(
                opt.low, opt.high, low_open=low_open, high_open=opt.high_open,
                what=opt.cli_what or opt.what,
            )  # fmt: skip
            m.add_argument(opt.cli_flag, dest=dest, type=parse, default=None, help=help_text)


def method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``**options`` of :func:`nu.merge_adapters` from the flags, refusing (before any
    loading) a flag the method and space do not take, and a missing required one."""
    from .. import registry

    everything = _options_by_flag()
    options: dict[str, Any] = {}
    for name in everything:
        value = getattr(args, name, None)
        if value is not None and value is not False:
            options[name] = value
    spec = registry.METHODS[args.method]
    takes = {o.name: o for o in (*spec.options, *registry.SPACES[args.space].options)}
    for name in options:
        if name not in takes:
            flags = [o.cli_flag for o in takes.values()]
            raise UsageError(
                f"{everything[name].cli_flag} does not apply to method {args.method} in "
                f"{args.space} space; it takes "
                f"{', '.join(flags) if flags else 'none of the method options'}."
            )
    for name, opt in takes.items():
        if opt.required and name not in options and name in CLI_DEFAULTS:
            options[name] = CLI_DEFAULTS[name]
        elif opt.required and name not in options:
            raise UsageError(
                f"method {args.method} needs {opt.cli_flag} ({opt.what} in "
                f"{opt.interval(cli=True)}, e.g. {opt.cli_flag} {opt.example})."
            )
    return options
