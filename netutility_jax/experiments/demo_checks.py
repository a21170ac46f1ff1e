"""``netutility demo``'s checks, made before any work (a run's results must not be lost at its
end): the tasks (:func:`task_args`, their CSV files, the Debian data), the folders it reads and
writes (``--cache-dir``, ``--out``, ``--model-dir``, ``--data-dir``, ``--adapters``), the model
weights, and the suite's own flags (:func:`suite_flags`, with :func:`model_devices` and
:func:`min_bytes`). Each refusal is a :class:`DemoError`: one line, with its exit code.

The command is :mod:`netutility_jax.experiments.demo`, which re-exports these names.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import stat
from collections.abc import Sequence
from typing import Any

from ..errors import InputError, NetUtilityError
from .data import tasks as tk
from .harness import fitting as ft
from .harness import grid as gr
from .harness import suites
from .suites import encoder as enc

__all__ = [
    "FLAG_NAMES",
    "DemoError",
    "check_cache_dir",
    "check_data",
    "check_folder",
    "check_out",
    "check_task_files",
    "check_weights",
    "load_tasks",
    "min_bytes",
    "model_devices",
    "suite_flags",
    "task_args",
    "writable_place",
]


class DemoError(NetUtilityError):
    """A problem the user can fix; printed as one line, exit code ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# -------------------------------------------------------------------------------------- tasks


def task_args(
    custom: Sequence[str] = (),
    selection: str | None = None,
    default: Sequence[str] = enc.DEFAULT_TASKS,
) -> list[str]:
    """Task arguments for ``tasks.load_tasks``: the default tasks plus ``--task`` ones, or
    ``--tasks``.

    Raises:
      DemoError: a bad ``--task`` spec, an unknown name in ``--tasks``, fewer than 2 tasks.

    Example:
      >>> task_args(["mine=data.csv"], "word_pos,mine")
      ['word_pos', 'mine=data.csv']
      >>> task_args([], None, ["word_pos", "word_sentiment"])
      ['word_pos', 'word_sentiment']
    """
    customs: dict[str, str] = {}
    for arg in custom:
        try:
            name, path = tk.parse_task_arg(arg)
        except tk.TaskDataError as e:
            raise DemoError(f"--task: {e}") from None
        if name in customs:
            raise DemoError(f"--task: task name {name!r} is given twice")
        customs[name] = f"{name}={path}"
    if selection is None:
        out = [*default, *customs.values()]
    else:
        names = [n.strip() for n in selection.split(",") if n.strip()]
        out = []
        for n in names:
            if n in customs:
                out.append(customs[n])
            elif n in tk.BUILTIN_TASKS:
                out.append(n)
            else:
                known = ", ".join([*tk.BUILTIN_TASKS, *customs])
                raise DemoError(f"--tasks: unknown task {n!r}; known tasks: {known}")
        if len(set(names)) != len(names):
            raise DemoError(f"--tasks: a task is listed twice in {selection!r}")
    if len(out) < 2:
        raise DemoError(f"merging needs at least 2 tasks, got {len(out)}: {out}")
    return out


def _stat(path: str | os.PathLike, missing: str, cannot: str) -> os.stat_result:
    """``os.stat(path)``, or a ``DemoError``: ``missing`` when nothing is there, ``cannot`` with
    the reason when it cannot be looked at."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise DemoError(missing) from None
    except OSError as e:  # (permission denied on a folder above it, a name too long)
        raise DemoError(f"{cannot} ({e.strerror or e})") from None


def check_task_files(args: Sequence[str]) -> None:
    """Refuse, before any work, a ``--task NAME=PATH.csv`` whose file cannot be read.

    Raises:
      DemoError: naming the task and path: nothing there, a folder where the CSV is expected, or
        a file that cannot be read (permission).
    """
    for arg in args:
        if "=" not in arg:
            continue
        name, path = tk.parse_task_arg(arg)
        where, expected = f"--task {name}={path}", "expected a CSV file with columns text,label"
        st = _stat(
            path, f"{where}: {path} does not exist; {expected}", f"{where}: cannot use {path}"
        )
        if stat.S_ISDIR(st.st_mode):
            raise DemoError(f"{where}: {path} is a folder; {expected}")
        if not os.access(path, os.R_OK):
            raise DemoError(f"{where}: {path} cannot be read (permission denied)")


def writable_place(path: pathlib.Path, flag: str) -> None:
    """Refuse ``path`` unless it is, or can be created as, a folder this process can write."""
    if "\0" in str(path):
        raise DemoError(f"{flag} {str(path)!r} contains a NUL character")
    parent = path
    try:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        is_dir = parent.is_dir()
    except OSError as e:  # (a folder above it cannot be searched)
        raise DemoError(f"{flag} {path}: cannot use it ({e.strerror or e})") from None
    if not is_dir and parent == path:
        raise DemoError(f"{flag} {path} exists and is not a directory; choose a directory")
    if not is_dir:
        raise DemoError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DemoError(f"{flag} {path}: cannot write in {parent} (permission denied)")


def check_cache_dir(cache_dir: str | os.PathLike | None) -> pathlib.Path:
    """Refuse, before any training, a cache folder the adapters could not be written to.

    Returns:
      The cache folder (``--cache-dir``, else :func:`fitting.default_cache_dir`).

    Raises:
      DemoError: an empty path, a file, a path under a file, or a folder this process cannot
        write.
    """
    if cache_dir is not None and not str(cache_dir).strip():
        raise DemoError("--cache-dir is empty; give a directory for the adapter cache")
    path = pathlib.Path(cache_dir) if cache_dir is not None else ft.default_cache_dir()
    flag = "--cache-dir" if cache_dir is not None else f"the cache directory (${ft.CACHE_ENV})"
    writable_place(path, flag)
    return path


def check_data(args: Sequence[str]) -> None:
    """Raise :class:`DemoError` (one line, with the apt command) if built-in data is missing."""
    missing = [a for a in args if "=" not in a and not tk.data_available(a)]
    if missing:
        raise DemoError(
            f"the Debian data of built-in task(s) {', '.join(missing)} is not installed; install "
            f"it with: {tk.APT_INSTALL_COMMAND}  (or choose other tasks with --tasks)"
        )


def check_weights(suite: str = "encoder", **given: Any) -> None:
    """Raise :class:`DemoError` (one line, with the install command) if the weights or readers
    suite ``suite`` needs are missing (its :attr:`suites.SuiteSpec.requires`, called with the
    flags ``given``: :func:`suite_flags`)."""
    try:
        suites.get(suite).requires(**given)
    except (suites.SuiteUnavailable, InputError) as e:
        raise DemoError(str(e)) from None


def check_folder(path: str, flag: str, *, shown: str | None = None) -> str:
    """Refuse, before any work, a folder flag (``--model-dir``, ``--data-dir``, an
    ``--adapters`` folder) naming no readable folder; returns ``path``.

    ``shown``: how the value is printed (default ``path``; ``dtd=/a/dtd`` for ``--adapters``).

    Raises:
      DemoError: one line naming ``flag``: empty, missing, a file, unreadable.
    """
    where = f"{flag} {shown if shown is not None else path}"
    if not str(path).strip():
        raise DemoError(f"{flag} is empty; give a folder")
    p = pathlib.Path(path)
    st = _stat(p, f"{where}: no such folder", f"{where}: cannot use it")
    if not stat.S_ISDIR(st.st_mode):
        raise DemoError(f"{where}: a file, not a folder; give a folder")
    if not os.access(p, os.R_OK | os.X_OK):
        raise DemoError(f"{where}: cannot be read (permission denied)")
    return str(path)


#: The suites' own flags: ``argparse`` destination -> flag (:func:`suite_flags`).
FLAG_NAMES = {
    "model_dir": "--model-dir",
    "data_dir": "--data-dir",
    "adapters": "--adapters",
    "model_devices": "--model-devices",
    "min_bytes": "--min-bytes",
}

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6,
          "gb": 10**9}  # fmt: skip


def min_bytes(text: str) -> int:
    """``--min-bytes N`` as a number of bytes: a whole number in ASCII digits with an optional
    unit (B, KiB, MiB, GiB, kB, MB, GB; case ignored), at least 0.

    Raises:
      DemoError: one line naming the flag.

    Example:
      >>> min_bytes("1MiB"), min_bytes("64 KiB"), min_bytes("0")
      (1048576, 65536, 0)
    """
    value = str(text).strip()
    m = re.fullmatch(r"([0-9]+)[ \t]*([a-zA-Z]*)", value)  # ASCII only: "１２" is not 12
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise DemoError(
            f"--min-bytes {text!r}: expected a whole number of bytes, optionally with a unit "
            "(B, KiB, MiB, GiB, kB, MB, GB), e.g. 1MiB"
        )
    return int(m.group(1)) * _UNITS[unit]


def model_devices(text: str) -> int:
    """``--model-devices {all,N}`` as a number of this process' devices: ``all`` (every local
    device) or ``N`` from 1 to the number present.

    Raises:
      DemoError: one line naming the flag: not ``all`` nor a whole number, below 1, or more
        devices than this machine has.
    """
    import jax

    devs = jax.local_devices()
    have = f"this machine has {len(devs)} {devs[0].platform} device{'s' * (len(devs) > 1)}"
    value = str(text).strip()
    if value.lower() == "all":
        return len(devs)
    try:
        n = int(value)
    except ValueError:
        raise DemoError(
            f"--model-devices {text!r}: expected all or a whole number of devices "
            f"(1 to {len(devs)}; {have})"
        ) from None
    if n < 1:
        raise DemoError(f"--model-devices {n}: expected at least 1 device (or all; {have})")
    if n > len(devs):
        raise DemoError(f"--model-devices {n}: {have}; give 1 to {len(devs)}, or all")
    return n


def suite_flags(args: argparse.Namespace, spec: suites.SuiteSpec) -> dict[str, Any]:
    """The flags given (``--model-dir``, ``--data-dir``, ``--adapters``, ``--model-devices``,
    ``--min-bytes``) as keywords of ``spec.build`` / ``spec.requires`` (:data:`suites.FLAGS`),
    every folder checked, ``--model-devices`` resolved to a number of devices
    (:func:`model_devices`) and ``--min-bytes`` to bytes (:func:`min_bytes`).

    Raises:
      DemoError: a flag the suite does not accept (:attr:`suites.SuiteSpec.flags`), a bad
        ``--adapters`` list, a folder that is not there (:func:`check_folder`), a bad
        ``--model-devices`` or ``--min-bytes``, or ``--min-bytes`` without ``--model-devices``.
    """
    given: dict[str, Any] = {}
    for key, flag in FLAG_NAMES.items():
        value = getattr(args, key, None)
        if value is None:
            continue
        if key not in spec.flags:
            accepts = ", ".join(FLAG_NAMES[f] for f in spec.flags) or "none of them"
            raise DemoError(
                f"{flag} is not used by the {spec.name} suite (it accepts {accepts}); drop it"
            )
        if key == "adapters":
            try:
                items = suites.parse_adapters(value)
            except InputError as e:
                raise DemoError(str(e)) from None
            for a in items:
                check_folder(a.path, flag, shown=f"{a.name}={a.path}" if a.name else None)
            given[key] = items
        elif key == "model_devices":
            given[key] = model_devices(value)
        elif key == "min_bytes":
            given[key] = min_bytes(value)
        else:
            given[key] = check_folder(value, flag)
    if "min_bytes" in given and "model_devices" not in given:
        raise DemoError(
            "--min-bytes sets which weights a split model replicates; it needs --model-devices "
            "(give both, or drop --min-bytes)"
        )
    return given


def load_tasks(args: Sequence[str], preset: gr.Preset) -> list[Any]:
    """The tasks, split with the fixed split seed and the preset's sizes."""
    from .harness import runner

    try:
        return tk.load_tasks(
            args,
            seed=runner.SPLIT_SEED,
            max_train=preset.max_train,
            n_val=preset.n_val,
            n_test=preset.n_test,
        )
    except tk.TaskDataMissingError as e:
        raise DemoError(
            f"the Debian data of built-in task {e.task!r} is not installed; install it with: "
            f"{tk.APT_INSTALL_COMMAND}"
        ) from None
    except (tk.TaskDataError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise DemoError(f"cannot load the tasks: {msg}") from None


def check_out(out: str | os.PathLike, *, overwrite: bool) -> pathlib.Path:
    """Refuse, before any work, an output location that cannot receive the results.

    Returns:
      ``out`` as a path.

    Raises:
      DemoError: code 1 if result files exist and ``overwrite`` is False; code 2 if ``out`` is
        not a directory, its nearest existing ancestor is not a writable directory, or ``out``
        is empty.
    """
    from .harness import report

    if not str(out).strip():  # (pathlib would read "" as ".")
        raise DemoError("--out is empty; give a directory for the results")
    out = pathlib.Path(out)
    writable_place(out, "--out")
    try:
        existing = report.existing_results(out) if out.is_dir() else []
    except OSError as e:  # (a folder that cannot be searched)
        raise DemoError(f"--out {out}: cannot use it ({e.strerror or e})") from None
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} other result file(s))" if len(existing) > 1 else ""
        raise DemoError(
            f"{existing[0]} already exists{more}; pass --overwrite to replace the results or "
            "choose another --out",
        )
    return out
