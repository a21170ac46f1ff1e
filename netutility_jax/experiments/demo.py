"""``netutility demo``: train task LoRAs on MiniLM, merge them under rank budgets, compare allocations.

The built-in experiment of netutility-jax, the analogue of the paper's vision suite on 7 real
text classification tasks (:mod:`netutility_jax.experiments.data.tasks`):

1. every task classifies with a **frozen zero-shot head** (the base model's embeddings of its
   label descriptions, like CLIP's text heads), and only its LoRA (rank 16, alpha 16 on q, k,
   v, o of the 6 layers) trains, to convergence with early stopping, for each of 3 training
   seeds (:mod:`train`);
2. the grid (:mod:`grid`) is merged per seed: methods x budgets ``R`` x allocation (uniform,
   the paper's baseline, vs. Net Utility) and the controls (no budget, random allocation with
   Net Utility's per-module counts, zero-shot, weight average), each merge coefficient chosen
   on validation (:mod:`evaluate`, :mod:`runner`);
3. every delta gets a paired bootstrap interval over the test texts and a t interval over
   seeds, and the analyses are repeated per seed (:mod:`stats`, :mod:`report`).

Outputs (``--out``, default ``netutility-demo``): ``results.json``, ``results.md``,
``predictions.npz`` (every merge's per-text test correctness) and PNG figures, each written to a
temporary file and renamed into place; existing results are never overwritten without
``--overwrite``. The output location is checked before any work.

Exit codes: 0 done; 1 results exist (no ``--overwrite``); 2 bad arguments, an unusable output
location or cache folder, a missing or unreadable ``--task`` CSV, missing data or missing model
weights. All of these are checked before any training.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import re
import shlex
import stat
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..errors import InputError, NetUtilityError, one_line
from .data import tasks as tk
from .harness import fitting as ft
from .harness import grid as gr
from .harness import records, suites
from .suites import encoder as enc
from .suites import language, language_head, nli, vision  # noqa: F401 (each registers its suite)

__all__ = [
    "DEFAULT_OUT",
    "PROG",
    "DemoError",
    "add_arguments",
    "check_cache_dir",
    "check_data",
    "check_folder",
    "check_out",
    "check_task_files",
    "check_weights",
    "load_tasks",
    "main",
    "model_devices",
    "preset_of",
    "run",
    "run_planted",
    "suite_flags",
    "task_args",
]

PROG = "netutility demo"
DEFAULT_OUT = "netutility-demo"

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


def _writable_place(path: pathlib.Path, flag: str) -> None:
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
    _writable_place(path, flag)
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


_FLAG_NAMES = {
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
    for key, flag in _FLAG_NAMES.items():
        value = getattr(args, key, None)
        if value is None:
            continue
        if key not in spec.flags:
            accepts = ", ".join(_FLAG_NAMES[f] for f in spec.flags) or "none of them"
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
    _writable_place(out, "--out")
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


# ----------------------------------------------------------------------------------------- CLI


def _names(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not seeds or any(s < 0 or s >= 2**32 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct integers in [0, 2**32), got {text!r}")
    return seeds


def _alpha(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 or 'auto', got {text!r}")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``netutility demo`` options to ``parser``."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 short tasks, 1 seed, short training, TA and TIES at R=16 with the controls: a "
        "few minutes on a 2-core CPU (what CI runs)",
    )
    # the registered suites (the built-in ones registered by importing them, above), the default
    # first
    names = tuple(sorted(suites.SUITES, key=lambda n: n != suites.DEFAULT))
    parser.add_argument(
        "--suite",
        choices=names,
        default=names[0],
        help="the model the task LoRAs are trained on: "
        + "; ".join(
            f"{s.name}{' (default)' if s.name == names[0] else ''}: {s.summary}"
            + (f" ({s.cost})" if s.cost else "")
            for s in map(suites.get, names)
        ),
    )
    grids = tuple(dict.fromkeys(g for s in suites.SUITES.values() for g in s.grids))
    parser.add_argument(
        "--grid",
        choices=grids,
        default=None,
        help="the suite's preset (default: its first): "
        + "; ".join(f"{s.name}: {', '.join(s.grids)}" for s in suites.SUITES.values())
        + ". The encoder's full grid is TA, TSV, TIES, DARE in full space at R=64/32/16, Iso-C "
        "at R=16, and the controls; paper adds Core and KnOTS space for TSV, TIES, DARE, Iso-C "
        "(about three times longer); mechanism: TA and TSV with the controls that isolate Net "
        "Utility's mechanism (energy only, lambda x 1/4, 1/2, 2 and chosen on validation, alpha 0 "
        "and 1, a random split keeping each task's top directions), from one shared LoRA initialisation",
    )
    parser.add_argument(
        "--study",
        choices=("regime", "planted"),
        default=None,
        help="run a study instead of one grid: regime moves one factor of the training regime "
        "at a time (initialisation, heterogeneity, number of tasks, rank) around a shared-init "
        "centre and relates Net Utility minus uniform to data-free indices (encoder suite; "
        "writes study.json, study.md, study.png; --quick: its CI form, a few minutes); planted "
        "plants known conflicts and agreements between tasks and reads which allocation finds "
        "them (the pre-registered primary merges; python -m "
        "netutility_jax.experiments.planted has the other options)",
    )
    parser.add_argument(
        "--cells",
        type=_names,
        default=None,
        metavar="centre,init=per_task",
        help="with --study: run only these cells (comma-separated, in the study's order; "
        "default all), e.g. the seeds of the centre and per-task cells alone",
    )
    parser.add_argument(
        "--init",
        choices=("per_task", "shared"),
        default=None,
        help="the LoRA initialisation: shared (every task starts from the same A, as the "
        "paper's codebase trains) or per_task (each task draws its own A); default: the "
        "preset's (per_task, except --grid mechanism)",
    )
    parser.add_argument(
        "--seeds",
        type=_seeds,
        default=None,
        metavar="0,1,2",
        help="training seeds (default 0,1,2; --quick: 0)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="one training seed (the same as --seeds N)"
    )
    parser.add_argument(
        "--seeds-from",
        action="append",
        default=[],
        metavar="DIR",
        help="report the seeds of an earlier run of the same suite, grid and tasks (a --out "
        "directory: its results.json and predictions.npz) with this run's --seeds, e.g. seeds "
        "run on another machine; checked to be the same experiment before any training; no "
        "seed twice (repeatable). Without --seeds, the preset's seeds not read back run here "
        "(none, when every one is)",
    )
    parser.add_argument(
        "--alpha",
        type=_alpha,
        default="auto",
        help="scoring geometry: auto (the paper's heterogeneity rule, default), 1 (Gram) or 0 "
        "(row space)",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"directory for the results (default: ./{DEFAULT_OUT})",
    )
    parser.add_argument(
        "--task",
        action="append",
        default=[],
        metavar="NAME=PATH.csv",
        help="add a task of your own from a CSV with columns text,label; its label names become "
        "its zero-shot head (repeatable)",
    )
    parser.add_argument(
        "--tasks",
        default=None,
        metavar="A,B,C",
        help="run only these tasks (built-in names and --task names); default: "
        f"{', '.join(enc.DEFAULT_TASKS)} plus every --task (also built in: "
        f"{', '.join(t for t in tk.BUILTIN_TASKS if t not in enc.DEFAULT_TASKS)})",
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="the model folder of a suite that reads one (vision: a Hugging Face CLIPModel "
        "folder with config.json, model.safetensors, tokenizer.json)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="the datasets of a suite that reads its own (vision: DIR/<dataset>/<split>/<class>/"
        "*.jpg or DIR/<dataset>/<split>-*.parquet)",
    )
    parser.add_argument(
        "--adapters",
        default=None,
        metavar="DIR[,DIR...]",
        help="the task LoRAs of a suite that merges given adapters (PEFT folders): NAME=DIR "
        "pairs, or folders matched by name (..._dtd) or else by order "
        "(vision: dtd, eurosat, gtsrb, mnist, resisc45, sun397, svhn)",
    )
    parser.add_argument(
        "--model-devices",
        default=None,
        metavar="{all,N}",
        help="split the model's weights over all local devices or the first N (a model that "
        "does not fit one accelerator; suites that load a model folder: vision, nli); the run "
        "records the mesh size in results.json (placement); default: one device",
    )
    parser.add_argument(
        "--min-bytes",
        default=None,
        metavar="N",
        help="with --model-devices: weights smaller than N bytes (units B, KiB, MiB, GiB, kB, "
        "MB, GB) are copied to every device instead of split (default 1MiB; 0 splits every "
        "weight a mesh axis divides)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help=f"adapter and merge cache (default: ${ft.CACHE_ENV} or {ft.DEFAULT_CACHE_DIR})",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing result files in --out"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def run(args: argparse.Namespace) -> int:
    """Run ``netutility demo`` with parsed arguments; returns the exit code."""
    try:
        return _run(args)
    except NetUtilityError as e:  # DemoError, and the library's errors on bad input
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return e.code if isinstance(e, DemoError) else 2


def preset_of(args: argparse.Namespace) -> gr.Preset:
    """The preset ``--suite``, ``--quick`` and ``--grid`` select (:meth:`suites.SuiteSpec.preset`),
    with ``--init`` applied to its training.

    Raises:
      DemoError: ``--grid`` names a preset of another suite.
    """
    spec = suites.get(getattr(args, "suite", suites.DEFAULT))
    try:
        preset = spec.preset(getattr(args, "grid", None), quick=args.quick)
    except InputError as e:
        raise DemoError(str(e)) from None
    if getattr(args, "init", None) is not None:  # --init overrides the preset's
        preset = dataclasses.replace(
            preset, train=dataclasses.replace(preset.train, init=args.init)
        )
    return preset


def _chosen_seeds(args: argparse.Namespace, default: Sequence[int]) -> tuple[int, ...]:
    """The training seeds ``--seed`` or ``--seeds`` give, else ``default`` (the preset's).

    Raises:
      DemoError: both given, or a ``--seed`` outside ``[0, 2**32)``.
    """
    if args.seed is not None and args.seeds is not None:
        raise DemoError("give --seed or --seeds, not both")
    if args.seed is not None:
        if not 0 <= args.seed < 2**32:
            raise DemoError(f"--seed must be in [0, 2**32), got {args.seed}")
        return (args.seed,)
    return args.seeds or default


def _run(args: argparse.Namespace) -> int:
    from .harness import report, runner

    if getattr(args, "study", None) == "planted":
        return _run_planted(args)
    if getattr(args, "study", None) is not None:
        return _run_study(args)
    if getattr(args, "cells", None) is not None:
        raise DemoError("--cells selects cells of a study; give --study or drop --cells")
    t0 = time.perf_counter()
    spec = suites.get(getattr(args, "suite", suites.DEFAULT))
    own_data = "data_dir" in spec.flags  # the suite reads its own tasks (suites.SuiteWithData)
    if "adapters" in spec.flags and getattr(args, "init", None) is not None:
        raise DemoError(f"--init: the {spec.name} suite trains nothing (its adapters are given)")
    if own_data:
        for flag, value in (("--task", args.task), ("--tasks", args.tasks)):
            if value:
                raise DemoError(
                    f"{flag}: the {spec.name} suite reads its tasks from its own folders "
                    "(--data-dir, --adapters); drop it"
                )
    preset = preset_of(args)
    # every check before any work: a run's results must not be lost at the end
    out = check_out(args.out, overwrite=args.overwrite)
    seeds_from = _seeds_from(getattr(args, "seeds_from", []), out)
    read = {s for sv in seeds_from for s in sv.seed_ids}
    # by default the preset's seeds not read back (none, when --seeds-from gives them all)
    seeds = _chosen_seeds(args, tuple(s for s in preset.seeds if s not in read))
    if args.seed is not None or args.seeds is not None:
        _check_distinct(seeds, seeds_from, "--seed" if args.seed is not None else "--seeds")
    given = suite_flags(args, spec)
    specs = [] if own_data else task_args(args.task, args.tasks, preset.tasks)
    check_task_files(specs)
    check_cache_dir(args.cache_dir)
    check_data(specs)
    check_weights(spec.name, **given)
    if own_data:
        suite = spec.build(**given)
        try:
            task_list, preset = suite.load_tasks(preset)
        except NetUtilityError as e:  # the data's layout, named (MissingFileError, InputError)
            raise DemoError(f"cannot load the {spec.name} suite's data: {e}") from None
    else:
        task_list = load_tasks(specs, preset)
    print(
        f"{PROG}: {spec.name} suite, {preset.name} grid, {len(task_list)} tasks, seeds "
        f"{', '.join(map(str, seeds)) or 'none'} run here"
        + (f" and {', '.join(map(str, sorted(read)))} read back" if read else "")
        + f", cache {args.cache_dir or ft.default_cache_dir()}",
        flush=True,
    )
    if not own_data:
        suite = spec.build(**given)
    run_ = runner.run_experiment(
        task_list,
        preset,
        seeds=seeds,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
        log=lambda s: print(s, flush=True),
        alpha=args.alpha,
        suite=suite,
        seeds_from=seeds_from,
    )
    argv = getattr(args, "argv", None)  # set by main() and by the netutility command
    command = shlex.join(["netutility", *(argv if argv is not None else ["demo", *sys.argv[2:]])])
    exp = report.render(run_, suite.report(run_), command=command)
    try:
        written = report.write_outputs(exp, out, overwrite=args.overwrite)
    except FileExistsError as e:  # appeared while we ran
        raise DemoError(f"{e}; pass --overwrite or choose another --out") from None
    except OSError as e:  # (the disk filled up, or the folder changed while we ran)
        raise DemoError(f"--out {out}: writing the results failed ({e})") from e
    print()
    print(report.console_summary(exp.results))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; results in {out}/ ({len(written)} files)")
    return 0


def _check_distinct(seeds: Sequence[int], loaded: Sequence[Any], own: str) -> None:
    """No seed both run here (given by the flag ``own``) and read by ``--seeds-from``."""
    from .harness import seeds as sds

    try:
        sds.check_distinct(seeds, loaded, own_label=own)
    except InputError as e:
        raise DemoError(str(e)) from None


def _seeds_from(dirs: Sequence[str], out: pathlib.Path) -> list[Any]:
    """``--seeds-from``: each directory's seeds (``seeds.load``), none of them ``--out`` and no
    seed read twice; whether they belong to this experiment is checked by the runner, before
    any training.

    Raises:
      DemoError: a directory that is --out, is missing, or holds no readable run; a seed twice.
    """
    from .harness import seeds as sds

    loaded = []
    for d in dirs:
        check_folder(d, "--seeds-from")
        path = pathlib.Path(d)
        if path.resolve() == out.resolve():
            raise DemoError(
                f"--seeds-from {d} is also --out: its results would be replaced by the report "
                "that reads them; choose another --out"
            )
        try:
            loaded.append(sds.load(path, label="--seeds-from"))
        except InputError as e:
            raise DemoError(str(e)) from None
        _check_distinct([], loaded, "")
    return loaded


def _command(args: argparse.Namespace) -> str:
    argv = getattr(args, "argv", None)  # set by main() and by the netutility command
    return shlex.join(["netutility", *(argv if argv is not None else ["demo", *sys.argv[2:]])])


def _run_planted(args: argparse.Namespace) -> int:
    """``netutility demo --study planted``: :mod:`netutility_jax.experiments.planted` with the
    primary merges, the seeds of ``--seed``/``--seeds`` (default 0-4), ``--out``, ``--cache-dir``."""
    for flag, given in (
        ("--grid", args.grid), ("--init", args.init), ("--tasks", args.tasks),
        ("--task", args.task), ("--cells", getattr(args, "cells", None)),
        ("--seeds-from", getattr(args, "seeds_from", None)),
    ):  # fmt: skip
        if given:
            raise DemoError(f"--study planted sets its own {flag[2:]}; drop {flag}")
    if getattr(args, "suite", "encoder") != "encoder":
        raise DemoError("--study planted runs on the encoder suite; drop --suite")
    seeds = _chosen_seeds(args, (0, 1, 2, 3, 4))
    ns = argparse.Namespace(
        seeds=seeds, out=str(args.out), cache_dir=args.cache_dir, merges="primary",
        quick=args.quick, render=False, init="per_task",
    )  # fmt: skip
    return run_planted(ns, _command(args))


def run_planted(args: argparse.Namespace, command: str, *, prog: str = PROG) -> int:
    """The planted-interference study (:mod:`netutility_jax.experiments.harness.planting`) for
    parsed options ``seeds``, ``out``, ``cache_dir``, ``merges``, ``quick`` and ``render`` (only
    re-render ``out``): each seed run, saved and the report re-rendered from every seed in
    ``out``; a seed already there with at least ``merges`` is not run again. ``command`` is
    recorded in every seed and the report."""
    import json

    from .harness import planting as pl

    order = {"none": 0, "primary": 1, "all": 2}

    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out} is a file; give a directory")
    if not args.render:
        preset = enc.QUICK if args.quick else enc.FULL
        # the per-task initialisation (the default preset's; the regime study's per-task cell),
        # or the shared one (the regime study's centre)
        init = getattr(args, "init", None) or "per_task"
        preset = dataclasses.replace(preset, train=dataclasses.replace(preset.train, init=init))
        pairs = (("word_sentiment", "word_pos"),) if args.quick else pl.PAIRS
        cache = check_cache_dir(args.cache_dir)
        specs = task_args([], None, preset.tasks)
        check_data(specs)
        check_weights("encoder")
        task_list = load_tasks(specs, preset)
        suite = enc.EncoderSuite()
        for seed in args.seeds:
            done = out / f"seed{seed}.json"
            if done.exists():
                had = json.loads(done.read_text()).get("merges", "none")
                if order[had] >= order[args.merges]:
                    print(
                        f"{prog}: seed {seed} is in {out} (merges {had}); not run again", flush=True
                    )
                    continue
            rec = pl.run_seed(
                seed, task_list, preset, suite, cache_dir=cache, merges=args.merges,
                log=lambda s: print(s, flush=True), pairs=pairs,
            )  # fmt: skip
            pl.save_seed(out, rec, command=command)
            _render_planted(out, command, prog)
    else:
        _render_planted(out, command, prog)
    return 0


def _render_planted(out: pathlib.Path, command: str, prog: str) -> None:
    from .harness import planting as pl

    seeds = pl.load_seeds(out)
    results, markdown = pl.render(seeds, command=command)
    written = pl.write(out, results, markdown)
    print(f"{prog}: {len(seeds)} seed(s) rendered: {', '.join(written)}", flush=True)


def _run_study(args: argparse.Namespace) -> int:
    """``netutility demo --study NAME``: every cell of the study, then study.json/md/png."""
    from .harness import study as sd

    t0 = time.perf_counter()
    if getattr(args, "suite", "encoder") != "encoder":
        raise DemoError(f"--study {args.study} runs on the encoder suite; drop --suite")
    if getattr(args, "seeds_from", None):
        raise DemoError(f"--seeds-from: --study {args.study} reads no earlier seeds; drop it")
    for flag, given in (
        ("--grid", args.grid), ("--init", args.init), ("--tasks", args.tasks),
        ("--task", args.task),
    ):  # fmt: skip
        if given:
            raise DemoError(f"--study {args.study} sets its own {flag[2:]} per cell; drop {flag}")
    for key, flag in _FLAG_NAMES.items():
        if getattr(args, key, None) is not None:
            raise DemoError(
                f"--study {args.study} runs on the encoder suite, which takes no {flag}"
            )
    full, quick = enc.STUDIES[args.study]
    study = quick if args.quick else full
    cell_names = getattr(args, "cells", None)
    if cell_names is not None:
        known = [c.name for c in study.cells]
        unknown = [c for c in cell_names if c not in known]
        if unknown:
            raise DemoError(f"--cells: unknown cells {unknown}; the {study.name} study has {known}")
    seeds = _chosen_seeds(args, study.centre.seeds)
    out = pathlib.Path(args.out) if str(args.out).strip() else None
    if out is None:
        raise DemoError("--out is empty; give a directory for the results")
    _writable_place(out, "--out")
    found = sd.existing(out) if out.is_dir() else []
    if found and not args.overwrite:
        raise DemoError(
            f"{found[0]} already exists; pass --overwrite to replace the results or choose "
            "another --out"
        )
    specs = task_args([], None, study.centre.tasks)
    check_cache_dir(args.cache_dir)
    check_data(specs)
    check_weights("encoder")
    task_list = load_tasks(specs, study.centre)
    print(
        f"{PROG}: {study.name} study ({'quick' if args.quick else 'full'}), "
        f"{len(cell_names or study.cells)} cells, {len(task_list)} tasks, seeds "
        f"{', '.join(map(str, seeds))}, cache {args.cache_dir or ft.default_cache_dir()}",
        flush=True,
    )
    commit = records.commit()
    cells = sd.run_study(
        study, task_list, seeds=seeds, cache_dir=args.cache_dir,
        progress=not args.no_progress, log=lambda s: print(s, flush=True), alpha=args.alpha,
        cells=cell_names,
    )  # fmt: skip
    results, markdown, figure = sd.render(study, cells, command=_command(args), commit=commit)
    try:
        written = sd.write_outputs(results, markdown, figure, out, overwrite=args.overwrite)
    except FileExistsError as e:
        raise DemoError(f"{e}; pass --overwrite or choose another --out") from None
    except OSError as e:
        raise DemoError(f"--out {out}: writing the results failed ({e})") from e
    print()
    print(markdown.split("\n## Per task")[0])
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; results in {out}/ ({len(written)} files)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m netutility_jax.experiments.demo [options]``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train task LoRAs on MiniLM against frozen zero-shot heads and compare "
        "uniform vs net-utility rank allocation across merge methods and budgets, with "
        "confidence intervals (the paper's Table 2).",
    )
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = ["demo", *argv]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
