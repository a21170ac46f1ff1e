"""Loading the adapters for ``netutility inspect`` and ``merge --dry-run``: the path checks,
the library's reading (:func:`nu.folders.read_adapters`, its refusals in the flags' terms:
``--strict-targets``), and the notes about what was loaded (:func:`skipped_summary`,
:func:`coverage_summary`). A merge reads its adapters in :func:`nu.merge_folders`.

:func:`load` reads every adapter into memory (:func:`nu.peft.load_adapters`);
:func:`open_streamed` opens them for a streamed merge (:func:`nu.peft.open_adapters`: configs
and headers checked, no tensor read). Tasks are named by their folders
(:func:`nu.planning.task_names`) or by ``--config``'s names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .. import folders
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


def skipped_summary(
    paths: Sequence[str],
    adapters: Sequence[Mapping[str, Any]],
    *,
    names: Sequence[str] | None = None,
) -> str:
    """The ``--skip-non-lora`` warning: how many tensors each adapter had beyond its LoRA
    factors (every loaded module is one lora_A and one lora_B); "" if none. Tasks are named by
    ``names`` (default ``task i (path)``)."""
    return folders.skipped_summary(paths, adapters, names=names, spell=flag)


def coverage_summary(
    coverage: Mapping[str, Sequence[int]],
    m_tasks: int,
    *,
    labels: Sequence[str] | None = None,
    shown: int = 3,
    max_lines: int = 10,
    verb: str = "merged",
) -> list[str]:
    """Short lines saying which tasks lack which modules; ``[]`` if every task has every module.

    At most ``max_lines`` lines and ``shown`` module names per task, whatever the model size.
    Tasks are named by ``labels`` (their names; default ``task 0``, ``task 1`` ...).

    Example:
      >>> coverage_summary({"q": (0, 1), "k": (0,), "v": (0,)}, 2)
      ['the adapters target different modules: merged over the union of 3 modules, a task \
contributing nothing where it has no LoRA module (--strict-targets refuses this)', 'task 1 lacks \
2 of 3 modules: k, v']
    """
    return folders.coverage_summary(
        coverage, m_tasks, labels=labels, shown=shown, max_lines=max_lines, verb=verb, spell=flag
    )
