"""``netutility demo``'s options: :func:`add_arguments` (the flags, their types and help) and
what is read off them in more than one place (:func:`chosen_seeds`, :func:`command_of`).

The command is :mod:`netutility_jax.experiments.demo`, which re-exports these names; it
imports every built-in suite first, so that ``--suite`` and ``--grid`` list them all.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Sequence

from .data import tasks as tk
from .demo_checks import DemoError
from .harness import fitting as ft
from .harness import suites
from .suites import encoder as enc

__all__ = ["DEFAULT_OUT", "PROG", "add_arguments", "chosen_seeds", "command_of"]

PROG = "netutility demo"
DEFAULT_OUT = "netutility-demo"


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
    _add_what_runs(parser)
    _add_seeds(parser)
    _add_tasks_and_output(parser)
    _add_model_inputs(parser)
    _add_run_options(parser)


def _add_what_runs(parser: argparse.ArgumentParser) -> None:
    """``--quick``, ``--suite``, ``--grid``, ``--study``, ``--cells`` and ``--init``."""
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


def _add_seeds(parser: argparse.ArgumentParser) -> None:
    """``--seeds``, ``--seed``, ``--seeds-from`` and ``--alpha``."""
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


def _add_tasks_and_output(parser: argparse.ArgumentParser) -> None:
    """``--out``, ``--task`` and ``--tasks``."""
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


def _add_model_inputs(parser: argparse.ArgumentParser) -> None:
    """The flags of suites that read a model, data or adapters of their own: ``--model-dir``,
    ``--data-dir``, ``--adapters``, ``--model-devices`` and ``--min-bytes``."""
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


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir``, ``--overwrite`` and ``--no-progress``."""
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


def chosen_seeds(args: argparse.Namespace, default: Sequence[int]) -> tuple[int, ...]:
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


def command_of(args: argparse.Namespace) -> str:
    """The command line a result records: ``netutility demo ...`` as given (``args.argv``, set
    by :func:`demo.main` and by the ``netutility`` command; else this process's arguments)."""
    argv = getattr(args, "argv", None)  # set by main() and by the netutility command
    return shlex.join(["netutility", *(argv if argv is not None else ["demo", *sys.argv[2:]])])
