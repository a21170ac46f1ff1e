"""Reading a merge's inputs from disk: the adapter folders (into memory, or opened for
streaming), ``strict_targets``, the notes about what was read (:func:`coverage_summary`,
:func:`skipped_summary`) and the input moments files (:func:`read_moments`)."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import FileAccessError, InputError, MissingFileError, NetUtilityError
from ._config import MomentsFile
from ._digests import file_identity, seen_digest

__all__ = [
    "FACTOR_KEY",
    "coverage_summary",
    "read_adapters",
    "read_moments",
    "say_notes",
    "skipped_summary",
]

FACTOR_KEY = re.compile(r"\.lora_([AB])(?:\.[^.]+)?\.weight$")
"""A LoRA factor's tensor name in a PEFT safetensors file (``...lora_A.weight``)."""


def _dashed(field: str) -> str:
    return "--" + field.replace("_", "-")


def read_adapters(
    paths: Sequence[str], settings: Any, names: Sequence[str], *, streamed: bool,
    spell: Callable[[str], str] = str,
):  # fmt: skip
    """The adapters read into memory (:func:`nu.peft.load_adapters`) or opened for streaming
    (:func:`nu.peft.open_adapters`) with the loading settings (``skip_non_lora``,
    ``allow_different_base``, ``strict_targets`` of ``settings``), files that change under us
    as the library's errors."""
    from .. import peft

    reader = peft.open_adapters if streamed else peft.load_adapters
    try:
        loaded = reader(
            list(paths),
            strict=not settings.skip_non_lora,
            strict_targets=False,
            allow_different_base=settings.allow_different_base,
        )
    except NetUtilityError:
        raise
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:  # changed under us
        raise MissingFileError(f"cannot read the adapters: {e}") from e
    except PermissionError as e:
        raise FileAccessError(f"cannot read the adapters: {e}") from e
    if settings.strict_targets:
        _check_strict_targets(loaded.coverage, names, spell)
    return loaded


def present(loaded: Any, m_tasks: int) -> list[dict[str, Any]]:
    """Per task, its modules (None where it lacks one), in memory or opened for streaming."""
    if hasattr(loaded, "adapters"):
        return loaded.adapters
    return [
        {n: (i in tasks or None) for n, tasks in loaded.coverage.items()} for i in range(m_tasks)
    ]


def say_notes(paths, settings, names, loaded, say, *, verb="merged", spell=str) -> None:
    """The ``skip_non_lora`` warning and the coverage notes, naming the tasks."""
    if settings.skip_non_lora:
        line = skipped_summary(paths, present(loaded, len(paths)), names=names, spell=spell)
        if line:
            say("warning", line)
    for line in coverage_summary(loaded.coverage, len(paths), labels=names, verb=verb, spell=spell):
        say("note", line)


def _check_strict_targets(
    coverage: Mapping[str, Sequence[int]], names: Sequence[str], spell
) -> None:
    """``strict_targets``: refuse adapters that do not all have every module."""
    from .._core.checks import few

    flag = spell("strict_targets")
    for i, name in enumerate(names):
        lacking = [n for n, tasks in coverage.items() if i not in tasks]
        if lacking:
            has = next(names[j] for j in coverage[lacking[0]])
            raise InputError(
                f"{flag}: the adapters target different modules: {few(lacking)} "
                f"{'is' if len(lacking) == 1 else 'are'} in {has} but not in {name}. Drop "
                f"{flag} to merge the union of their modules (a task contributes "
                "nothing where it has no LoRA module)."
            )


def skipped_summary(
    paths: Sequence[str],
    adapters: Sequence[Mapping[str, Any]],
    *,
    names: Sequence[str] | None = None,
    spell: Callable[[str], str] = _dashed,
) -> str:
    """The ``skip_non_lora`` warning: how many tensors each adapter had beyond its LoRA
    factors (every loaded module is one lora_A and one lora_B); "" if none. Tasks are named by
    ``names`` (default ``task i (path)``)."""
    from ..peft import weight_shapes

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
        f"{spell('skip_non_lora')} skipped {total} non-LoRA tensor{'s' if total > 1 else ''} "
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
    spell: Callable[[str], str] = _dashed,
) -> list[str]:
    """Short lines saying which tasks lack which modules; ``[]`` if every task has every module.

    At most ``max_lines`` lines and ``shown`` module names per task, whatever the model size.
    Tasks are named by ``labels`` (their names; default ``task 0``, ``task 1`` ...);
    ``spell``: how the setting that refuses such adapters is named (``--strict-targets``).

    Example:
      >>> coverage_summary({"q": (0, 1), "k": (0,), "v": (0,)}, 2, spell=str)
      ['the adapters target different modules: merged over the union of 3 modules, a task \
contributing nothing where it has no LoRA module (strict_targets refuses this)', 'task 1 lacks \
2 of 3 modules: k, v']
    """
    labels = [f"task {i}" for i in range(m_tasks)] if labels is None else list(labels)
    lacking = [[n for n, have in coverage.items() if i not in have] for i in range(m_tasks)]
    tasks = [i for i in range(m_tasks) if lacking[i]]
    if not tasks:
        return []
    lines = [
        f"the adapters target different modules: {verb} over the union of {len(coverage)} "
        "modules, a task contributing nothing where it has no LoRA module "
        f"({spell('strict_targets')} refuses this)"
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


def _read_bytes(path: str, what: str, *, checked: bool) -> tuple[bytes, str | None]:
    """The bytes of the file at ``path`` and the SHA-256 taken of it this run if the file kept
    the identity it had then while it was read (:func:`seen_digest`: it is not hashed twice),
    or None: the caller hashes the bytes. ``checked``: the caller saw the file before."""
    try:
        with open(path, "rb") as f:
            before = file_identity(os.fstat(f.fileno()))
            data = f.read()
            same = before == file_identity(os.fstat(f.fileno()))
            return data, (seen_digest(path, before) if same else None)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        if checked:
            raise MissingFileError(f"{what}: disappeared after it was checked.") from None
        raise MissingFileError(
            f"{what}: no such file; give one moments file per adapter, in order "
            "(nu.moments.save_input_moments writes them; None for a task without data)."
        ) from None
    except OSError as e:
        raise FileAccessError(f"{what}: cannot be read ({e.strerror or e}).") from None


def read_moments(
    files: Sequence[str | MomentsFile | None] | None, adapters: Any, names: Sequence[str],
    *, spell: Callable[[str], str] = str,
) -> tuple[list[Any] | None, list[MomentsFile | None] | None]:  # fmt: skip
    """``input_moments`` as the merge's ``input_moments=`` (None without them) and each file
    as read (its SHA-256, which the report records): each file read once (a
    :class:`MomentsFile`'s bytes must have its digest), parsed
    (:func:`nu.moments.load_input_moments`: second moments checked finite, symmetric, PSD) and
    checked against its adapter (``adapters``: in memory, or an ``AdapterSet``): every module
    the task has named (data or data-free), no module it lacks, each ``d_in`` the module's.
    Every refusal is one line naming the setting, the file, the module and the shapes."""
    from .._core.checks import few
    from ..scoring.moments import load_input_moments

    if files is None:
        return None, None
    if len(files) != len(names):
        raise InputError(
            f"{spell('input_moments')} has {len(files)} entries for {len(names)} adapters; give "
            "one per adapter, in the adapters' order (None for a task without data)."
        )
    modules = _task_modules(adapters, len(files))
    out: list[Any] = []
    pinned: list[MomentsFile | None] = []
    for i, entry in enumerate(files):
        if entry is None:
            out.append(None)
            pinned.append(None)
            continue
        path = entry.path if isinstance(entry, MomentsFile) else entry
        what = f"{spell('input_moments')} {path}"
        name = names[i]
        data, sha = _read_bytes(path, what, checked=isinstance(entry, MomentsFile))
        sha = sha or hashlib.sha256(data).hexdigest()
        if isinstance(entry, MomentsFile) and sha != entry.sha256:
            raise InputError(f"{what}: changed while the merge ran; run it again.")
        moments = load_input_moments(path, data=data, what=what)
        have = modules[i]
        foreign = [n for n in moments if n not in have]
        if foreign:
            where = [names[j] for j, m in enumerate(modules) if foreign[0] in m]
            hint = (
                f"it is a module of {', '.join(where)}: are the files in the adapters' order?"
                if where
                else f"the keys must be the module names as the merge names them, e.g. "
                f"{next(iter(have), '?')!r}"
            )
            raise InputError(
                f"{what}: names module {foreign[0]!r}, which adapter {name} (task {i + 1}) does "
                f"not have{f' ({len(foreign)} such names)' if len(foreign) > 1 else ''}; {hint}."
            )
        missing = [n for n in have if n not in moments]
        if missing:
            raise InputError(
                f"{what}: has no entry for {few(missing)} of adapter {name} (task {i + 1}; "
                f"{len(missing)} of its {len(have)} modules); write every module, the ones "
                "without data as data-free (None in nu.moments.save_input_moments)."
            )
        for n, m in moments.items():
            if m is not None and m.d_in != have[n]:
                raise InputError(
                    f"{what}: module {n!r} has inputs of width {m.d_in} (factor "
                    f"{tuple(m.factor.shape)}, S = factor^T factor), but adapter {name}'s module "
                    f"{n!r} has d_in = {have[n]}; expected ({have[n]}, {have[n]}) second "
                    "moments: these are another layer's."
                )
        out.append(moments)
        pinned.append(MomentsFile(path, sha))
    return out, pinned
