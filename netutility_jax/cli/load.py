"""Loading the adapters for ``netutility inspect`` and ``merge --dry-run``: the path checks,
the library's reading (:func:`nu.folders.read_adapters`, its refusals in the flags' terms:
``--strict-targets``), and the notes about what was loaded (:func:`skipped_summary`,
:func:`coverage_summary`). A merge reads its adapters in :func:`nu.merge_folders`.

:func:`load` reads every adapter into memory (:func:`nu.peft.load_adapters`);
:func:`open_streamed` opens them for a streamed merge (:func:`nu.peft.open_adapters`: configs
and headers checked, no tensor read). Tasks are named by their folders
(:func:`nu.planning.task_names`) or by ``--config``'s names. :func:`skipped_summary` and
:func:`coverage_summary` are :mod:`nu.folders`', whose messages name the settings by their flags
unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import folders
from ..folders import coverage_summary, skipped_summary
from .common import flag, say
from .paths import check_adapter_dir

__all__ = ["coverage_summary", "load", "open_streamed", "skipped_summary"]


def _names(args: Any, paths: Sequence[str]) -> list[str]:
    """The tasks' names (``args.names``, a merge's; else from the folders)."""
    from ..pipeline.planning import task_names

    names = getattr(args, "names", None)
    return list(names) if names is not None else task_names(paths)


def _read(paths: Sequence[str], args: Any, command: str, *, streamed: bool, notes: bool = True):
    """Check the folders, read them with the loading flags of ``args`` (a namespace or a
    :class:`nu.MergeConfig`) and say what the terminal should know."""
    for p in paths:
        check_adapter_dir(p)
    names = _names(args, paths)
    loaded = folders.read_adapters(paths, args, names, streamed=streamed, spell=flag)
    if notes:
        verb = "merged" if command == "merge" else "scored"
        _notes(paths, args, names, loaded, command, verb)
    return loaded


def _notes(paths, args, names, loaded, command: str, verb: str) -> None:
    """The ``--skip-non-lora`` warning and the coverage notes, naming the tasks."""
    folders.say_notes(
        paths, args, names, loaded, lambda kind, text: say(command, kind, text), verb=verb,
        spell=flag,
    )  # fmt: skip


def load(paths: Sequence[str], args: Any, command: str):
    """Check and load the adapters with the loading flags; say what the terminal should know."""
    return _read(paths, args, command, streamed=False)


def open_streamed(paths: Sequence[str], args: Any, *, notes: bool = True):
    """The adapters opened for streaming (:func:`nu.peft.open_adapters`: configs and headers
    checked, nothing read yet), with the same notes as :func:`load` (if ``notes``)."""
    return _read(paths, args, "merge", streamed=True, notes=notes)
