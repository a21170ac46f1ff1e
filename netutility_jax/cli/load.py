"""Loading the adapters for ``netutility merge`` and ``inspect``: the path checks, the loaders'
file errors as the library's, ``--strict-targets``, and the notes about what was loaded
(:func:`skipped_summary`, :func:`coverage_summary`).

:func:`load` reads every adapter into memory (:func:`nu.peft.load_adapters`);
:func:`open_streamed` opens them for a streamed merge (:func:`nu.peft.open_adapters`: configs
and headers checked, no tensor read). Tasks are named by their folders
(:func:`nu.planning.task_names`) or by ``--config``'s names. :func:`load_moments` reads
``--input-moments`` and checks each file against its adapter's modules.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import FileAccessError, MissingFileError, NetUtilityError
from ..peft import weight_shapes
from .common import UsageError, say
from .job import MergeJob
from .paths import FACTOR_KEY, check_adapter_dir

__all__ = ["coverage_summary", "load", "load_moments", "open_streamed", "skipped_summary"]


def _read_adapters(reader, paths: Sequence[str], args: argparse.Namespace | MergeJob):
    """``reader(paths, **loading flags)`` (``peft.load_adapters`` or ``peft.open_adapters``)
    after the path checks, with files that change under us mapped to the library's errors.
    ``--strict-targets`` is checked here, in the command line's terms."""
    for p in paths:
        check_adapter_dir(p)
    try:
        loaded = reader(
            list(paths),
            strict=not args.skip_non_lora,
            strict_targets=False,
            allow_different_base=args.allow_different_base,
        )
    except NetUtilityError:
        raise
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:  # changed under us
        raise MissingFileError(f"cannot read the adapters: {e}") from e
    except PermissionError as e:
        raise FileAccessError(f"cannot read the adapters: {e}") from e
    if args.strict_targets:
        _check_strict_targets(loaded.coverage, _names(args, paths))
    return loaded


def _names(args: argparse.Namespace | MergeJob, paths: Sequence[str]) -> list[str]:
    """The tasks' names (``args.names``, a merge job's; else from the folders)."""
    from ..pipeline.planning import task_names

    names = getattr(args, "names", None)
    return list(names) if names is not None else task_names(paths)


def _check_strict_targets(coverage: Mapping[str, Sequence[int]], names: Sequence[str]) -> None:
    """``--strict-targets``: refuse adapters that do not all have every module."""
    from .._core.checks import few

    for i, name in enumerate(names):
        lacking = [n for n, tasks in coverage.items() if i not in tasks]
        if lacking:
            has = next(names[j] for j in coverage[lacking[0]])
            raise UsageError(
                f"--strict-targets: the adapters target different modules: {few(lacking)} "
                f"{'is' if len(lacking) == 1 else 'are'} in {has} but not in {name}. Drop "
                "--strict-targets to merge the union of their modules (a task contributes "
                "nothing where it has no LoRA module)."
            )


def _notes(command: str, paths: Sequence[str], args, coverage, present) -> None:
    """The --skip-non-lora warning and the coverage notes (``present``: per task, its modules
    with None where it lacks one), naming the tasks."""
    names = _names(args, paths)
    if args.skip_non_lora:
        line = skipped_summary(paths, present, names=names)
        if line:
            say(command, "warning", line)
    verb = "merged" if command == "merge" else "scored"
    for line in coverage_summary(coverage, len(paths), labels=names, verb=verb):
        say(command, "note", line)


def load(paths: Sequence[str], args: argparse.Namespace | MergeJob, command: str):
    """Check and load the adapters with the loading flags; say what the terminal should know."""
    from .. import peft

    loaded = _read_adapters(peft.load_adapters, paths, args)
    _notes(command, paths, args, loaded.coverage, loaded.adapters)
    return loaded


def open_streamed(paths: Sequence[str], args: argparse.Namespace | MergeJob, *, notes: bool = True):
    """The adapters opened for streaming (:func:`nu.peft.open_adapters`: configs and headers
    checked, nothing read yet), with the same notes as :func:`load` (if ``notes``)."""
    from .. import peft

    source = _read_adapters(peft.open_adapters, paths, args)
    present = [
        {n: (i in tasks or None) for n, tasks in source.coverage.items()} for i in range(len(paths))
    ]
    if notes:
        _notes("merge", paths, args, source.coverage, present)
    return source


def _task_modules(adapters: Any, m_tasks: int) -> list[dict[str, int]]:
    """Per task, ``{module: d_in}`` of the modules it has: from adapters in memory (a list of
    ``{name: module or None}``) or opened for streaming (an ``AdapterSet``)."""
    if hasattr(adapters, "shapes") and hasattr(adapters, "coverage"):
        cov = adapters.coverage
        return [
            {n: int(adapters.shapes[n][0]) for n in adapters.names if i in cov[n]}
            for i in range(m_tasks)
        ]
    return [
        {n: int(mod["lora_a"].shape[0]) for n, mod in ad.items() if mod is not None}
        for ad in adapters
    ]


def _read_bytes(path: str, what: str) -> tuple[bytes, str | None]:
    """The bytes of the file at ``path`` and the SHA-256 :func:`.config.resolve` took of it this
    run if the file kept the identity it had then while it was read (:func:`.config.seen_digest`:
    it is not hashed twice), or None: the caller hashes the bytes."""
    from .config import file_identity, seen_digest

    try:
        with open(path, "rb") as f:
            before = file_identity(os.fstat(f.fileno()))
            data = f.read()
            same = before == file_identity(os.fstat(f.fileno()))
            return data, (seen_digest(path, before) if same else None)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise MissingFileError(f"{what}: disappeared after it was checked.") from None
    except OSError as e:
        raise FileAccessError(f"{what}: cannot be read ({e.strerror or e}).") from None


def load_moments(job: MergeJob, adapters: Any) -> list[Any] | None:
    """``--input-moments`` as ``input_moments=`` of the merge (None without the flag): each
    file read once (its bytes must be those :func:`.config.resolve` digested), parsed
    (:func:`nu.moments.load_input_moments`: second moments checked finite, symmetric, PSD) and
    checked against its adapter (``adapters``: in memory, or an ``AdapterSet``): every module
    the task has named (data or data-free), no module it lacks, each ``d_in`` the module's.
    Every refusal is one line naming the flag, the file, the module and the shapes."""
    import hashlib

    from .._core.checks import few
    from ..scoring.moments import load_input_moments

    if job.input_moments is None:
        return None
    files = job.input_moments
    modules = _task_modules(adapters, len(files))
    out: list[Any] = []
    for i, entry in enumerate(files):
        if entry is None:
            out.append(None)
            continue
        what = f"--input-moments {entry.path}"
        name = job.names[i]
        data, sha = _read_bytes(entry.path, what)
        if (sha or hashlib.sha256(data).hexdigest()) != entry.sha256:
            raise UsageError(f"{what}: changed while the merge ran; run it again.")
        moments = load_input_moments(entry.path, data=data, what=what)
        have = modules[i]
        foreign = [n for n in moments if n not in have]
        if foreign:
            where = [job.names[j] for j, m in enumerate(modules) if foreign[0] in m]
            hint = (
                f"it is a module of {', '.join(where)}: are the files in the adapters' order?"
                if where
                else f"the keys must be the module names as the merge names them, e.g. "
                f"{next(iter(have), '?')!r}"
            )
            raise UsageError(
                f"{what}: names module {foreign[0]!r}, which adapter {name} (task {i + 1}) does "
                f"not have{f' ({len(foreign)} such names)' if len(foreign) > 1 else ''}; {hint}."
            )
        missing = [n for n in have if n not in moments]
        if missing:
            raise UsageError(
                f"{what}: has no entry for {few(missing)} of adapter {name} (task {i + 1}; "
                f"{len(missing)} of its {len(have)} modules); write every module, the ones "
                "without data as data-free (None in nu.moments.save_input_moments)."
            )
        for n, m in moments.items():
            if m is not None and m.d_in != have[n]:
                raise UsageError(
                    f"{what}: module {n!r} has inputs of width {m.d_in} (factor "
                    f"{tuple(m.factor.shape)}, S = factor^T factor), but adapter {name}'s module "
                    f"{n!r} has d_in = {have[n]}; expected ({have[n]}, {have[n]}) second "
                    "moments: these are another layer's."
                )
        out.append(moments)
    return out


def skipped_summary(
    paths: Sequence[str],
    adapters: Sequence[Mapping[str, Any]],
    *,
    names: Sequence[str] | None = None,
) -> str:
    """The ``--skip-non-lora`` warning: how many tensors each adapter had beyond its LoRA
    factors (every loaded module is one lora_A and one lora_B); "" if none. Tasks are named by
    ``names`` (default ``task i (path)``)."""
    parts, total = [], 0
    for i, (path, ad) in enumerate(zip(paths, adapters, strict=True)):
        shapes = weight_shapes(path) or {}
        n = len(shapes) - 2 * sum(1 for m in ad.values() if m is not None)
        if n > 0:
            total += n
            example = next((k for k in shapes if FACTOR_KEY.search(k) is None), None)
            label = f"task {i} ({path})" if names is None else names[i]
            parts.append(f"{label}: {n}" + (f", e.g. {example!r}" if example else ""))
    if not total:
        return ""
    return (
        f"--skip-non-lora skipped {total} non-LoRA tensor{'s' if total > 1 else ''} "
        f"({'; '.join(parts)}); the merged adapter does not carry them."
    )


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
    labels = [f"task {i}" for i in range(m_tasks)] if labels is None else list(labels)
    lacking = [[n for n, have in coverage.items() if i not in have] for i in range(m_tasks)]
    tasks = [i for i in range(m_tasks) if lacking[i]]
    if not tasks:
        return []
    lines = [
        f"the adapters target different modules: {verb} over the union of {len(coverage)} "
        "modules, a task contributing nothing where it has no LoRA module (--strict-targets "
        "refuses this)"
    ]
    for i in tasks[:max_lines]:
        miss = lacking[i]
        label = labels[i]
        more = f" and {len(miss) - shown} more" if len(miss) > shown else ""
        lines.append(
            f"{label} lacks {len(miss)} of {len(coverage)} modules: {', '.join(miss[:shown])}{more}"
        )
    if len(tasks) > max_lines:
        lines.append(f"... and {len(tasks) - max_lines} more tasks lacking modules")
    return lines
