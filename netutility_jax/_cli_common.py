"""What every part of the ``netutility`` command shares: its name, its usage error, and its
one-line messages.

The command is :mod:`netutility_jax.cli` (its parser and ``main``); its argument types and flags
are in :mod:`netutility_jax._cli_args`, its file-system checks and staging folders in
:mod:`netutility_jax._cli_paths`, and its subcommands in :mod:`netutility_jax._cli_commands`.
"""

from __future__ import annotations

import sys

from .errors import NetUtilityError

# (the underscored helpers are private to the command's modules, which share them)
__all__ = ["PROG", "UsageError", "_say", "_shown"]

PROG = "netutility"


class UsageError(NetUtilityError):
    """Bad input from the command line: printed as one line, exit code 2."""


def _shown(text: str) -> str:
    """``repr(text)``, cut to a readable length (argparse prints it inside one line)."""
    return repr(text) if len(text) <= 60 else repr(text[:60]) + f"... ({len(text)} characters)"


def _say(command: str, kind: str, text: str) -> None:
    """One line on stderr: ``netutility COMMAND: KIND: TEXT``."""
    print(f"{PROG} {command}: {kind}: {text}", file=sys.stderr)
