"""What every part of the ``netutility`` command shares: its name, its usage error, its one-line
messages, and the check for the optional packages it needs."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from ..errors import FileAccessError, MissingFileError, NetUtilityError

__all__ = ["PROG", "UsageError", "check_extras", "flag", "reading", "say", "shown"]

PROG = "netutility"


class UsageError(NetUtilityError):
    """Bad input from the command line: printed as one line, exit code 2."""


def shown(text: str) -> str:
    """``repr(text)``, cut to a readable length (argparse prints it inside one line)."""
    return repr(text) if len(text) <= 60 else repr(text[:60]) + f"... ({len(text)} characters)"


def flag(field: str) -> str:
    """The flag of a setting (a :class:`nu.MergeConfig` field): ``chunk_mb`` -> ``--chunk-mb``."""
    return "--" + field.replace("_", "-")


@contextlib.contextmanager
def reading(what: str, *, missing: str, folder: str, named: str | None = None) -> Iterator[None]:
    """The OS's refusals to read the file the user gave (``what``: how it is named) as one line
    each: no such file (``missing``: what to give instead; ``named``: how to name it there,
    default ``what``), a folder (``folder``: what to give instead), no permission, any other."""
    try:
        yield
    except (FileNotFoundError, NotADirectoryError):
        raise MissingFileError(f"{named or what}: no such file; {missing}") from None
    except IsADirectoryError:
        raise UsageError(f"{what}: is a folder; {folder}") from None
    except PermissionError:
        raise FileAccessError(f"{what}: cannot be read (permission denied).") from None
    except OSError as e:
        raise FileAccessError(f"{what}: cannot be read ({e.strerror or e}).") from None


def say(command: str, kind: str, text: str) -> None:
    """One line on stderr: ``netutility COMMAND: KIND: TEXT``."""
    print(f"{PROG} {command}: {kind}: {text}", file=sys.stderr)


def check_extras(need_plots: bool) -> None:
    """Missing optional packages are the user's to install: say so before any work."""
    import importlib.util

    if importlib.util.find_spec("safetensors") is None:
        raise UsageError(
            "reading and writing PEFT adapters needs safetensors: pip install 'netutility-jax[peft]'"
        )
    if need_plots and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "the plots need matplotlib: pip install 'netutility-jax[plots]', or pass --no-plots"
        )
