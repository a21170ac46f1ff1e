"""The library's exception types.

Every error that netutility-jax raises on bad input (a shape, a value, a file, an option) is one
of these. They subclass the built-in ``ValueError`` and ``TypeError``, so ``except ValueError``
clauses keep working. The ``netutility`` command maps exactly these (and its own usage errors) to
one line on stderr and exit code 2; any other exception is a bug in the library and surfaces
with its traceback and a request to report it.
"""

from __future__ import annotations

__all__ = [
    "FileAccessError",
    "InputError",
    "InputTypeError",
    "MissingFileError",
    "NetUtilityError",
    "PathExistsError",
    "PeerLostError",
    "one_line",
]


class NetUtilityError(Exception):
    """Base class of the errors netutility-jax raises on bad input."""


class InputError(NetUtilityError, ValueError):
    """A value, shape, option or file content that the library cannot use.

    The message names the function, the module and task involved, the shapes or values given,
    and how to fix it.
    """


class InputTypeError(NetUtilityError, TypeError):
    """An argument of the wrong type (a Python type where another is required, or a dtype)."""


class MissingFileError(NetUtilityError, FileNotFoundError):
    """A file or folder the user named does not exist (or is a folder where a file is expected,
    or the reverse: the message says which)."""


class PathExistsError(NetUtilityError, FileExistsError):
    """A path the library was asked to create exists (``nu.peft.save_adapter``,
    ``nu.checkpoint.save``): bad input, so a :class:`NetUtilityError` (the command line's exit
    code 2), and still a ``FileExistsError`` for ``except`` clauses written for that."""


class FileAccessError(NetUtilityError, PermissionError):
    """A file or folder the user named exists but cannot be read or written (permissions)."""


class PeerLostError(NetUtilityError, RuntimeError):
    """Another process of a distributed run stopped (killed, out of memory, a crashed host)
    while this one exchanged data with it: this process cannot go on either. The command line
    prints it as one line and exits with status 2 at once, without JAX's shutdown barrier (which
    would wait for the lost process)."""


def one_line(e: BaseException, limit: int = 2000) -> str:
    """The message of ``e`` on one line, cut after ``limit`` characters (a last line of defence
    for command-line output: messages name a few items and a count, never every module)."""
    import re

    text = re.sub(r"\s*[\r\n]\s*", " ", str(e).strip()) or type(e).__name__
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text
