"""The ``netutility`` command: merge PEFT adapters under a rank budget, inspect them, run the demo.

``netutility merge ADAPTER_DIR... --budget 16 --out OUT_DIR`` scores every singular direction of
every task's LoRA update by its Net Utility, keeps the best ``budget x modules`` of them, merges
them and writes ``OUT_DIR`` with a PEFT adapter (``adapter_config.json``,
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads, a JSON report
(``netutility_report.json``) and PNG plots (``plots/``). ``OUT_DIR`` is assembled in a temporary
directory beside it and renamed into place at the end: it appears complete or not at all, and an
existing path is never overwritten.

``netutility merge --dry-run`` prints the plan instead (per task the directions it keeps against
its uniform share of the budget, per module the output rank, the output size, a rough time and
memory estimate) and writes nothing. ``netutility merge --config merge.yaml`` reads the adapters
(with per-task weights) and the flags from a YAML or JSON file; flags on the command line
override it, and the report's recorded configuration replays a merge
(``--config OUT_DIR/netutility_report.json --out NEW``). ``OUT_DIR`` also holds a model card
(``README.md``, as PEFT writes one).

``netutility inspect ADAPTER_DIR...`` prints per task ranks and energies, the heterogeneity h, the
lambda the scoring would use, and how many directions have positive Net Utility.

``netutility convert SRC_FOLDER OUT_FOLDER`` writes the adapter in ``SRC_FOLDER`` (typically the
pickled ``adapter_model.bin`` of ``save_pretrained(..., safe_serialization=False)``, read without
torch and without running its pickle) as ``adapter_model.safetensors`` with the same
``adapter_config.json``; ``OUT_FOLDER`` appears complete or not at all (``--overwrite`` replaces
an earlier adapter folder).

``netutility demo`` runs the built-in experiment (see :mod:`netutility_jax.experiments.demo`).

Exit codes: 0 done; 2 bad input (missing, unreadable or corrupt adapters, adapters of different
base models, an unusable or existing output location, too little free space, bad options), with
one line on stderr; 1 a bug in netutility-jax (any other exception), with its traceback and a
request to report it; 130 interrupted. The output location is checked before anything is loaded.

Staging folders are named ``.<OUT_DIR name>.netutility-staging-<host>-<pid>-<random>``; a merge
killed while writing leaves one behind, and the next merge into the same parent folder removes
those whose process (on this host) is gone, saying so on stderr.

The command is split by concern: this module holds its parser (one function per subcommand) and
:func:`main`, and re-exports the names of the modules it is made of: ``_cli_common`` (its name,
:class:`UsageError`, one-line messages), ``_cli_args`` (argument types and flag groups, the
method flags derived from the registry), ``_cli_config`` (``--config`` files and the
configuration a report records), ``_cli_paths`` (input and output checks, the size
estimate, staging folders, and writing the output folder: adapter, model card, report, plots,
or with ``--keep-shards`` each process's shard and the index) and ``_cli_commands`` (the
subcommands, their summaries, the ``--devices`` mesh and the ``--distributed`` steps;
``report_dict`` is re-exported from ``_cli_paths``).

``netutility merge --distributed`` splits the streamed merge between the processes of a
``jax.distributed`` run (see :mod:`netutility_jax.streaming` and :mod:`netutility_jax._exchange`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

# (every name this module had before it was split keeps working as ``cli.X``; the underscored ones
# too, for tests and scripts that reach them)
from ._cli_args import MAX_BUDGET as MAX_BUDGET
from ._cli_args import SEED_BOUND as SEED_BOUND
from ._cli_args import _add_compile_cache as _add_compile_cache
from ._cli_args import _add_convert_parser as _add_convert_parser
from ._cli_args import _add_loading as _add_loading
from ._cli_args import _add_merge_method as _add_merge_method
from ._cli_args import _add_merge_output as _add_merge_output
from ._cli_args import _add_merge_tuning as _add_merge_tuning
from ._cli_args import _add_method_options as _add_method_options
from ._cli_args import _add_scoring as _add_scoring
from ._cli_args import _bounded_float as _bounded_float
from ._cli_args import _coef as _coef
from ._cli_args import _int_in as _int_in
from ._cli_args import _method_options as _method_options
from ._cli_args import _number as _number
from ._cli_args import _options_by_flag as _options_by_flag
from ._cli_args import _positive_int as _positive_int
from ._cli_args import _seed as _seed
from ._cli_args import _serving_ranks as _serving_ranks
from ._cli_args import add_merge_arguments as add_merge_arguments
from ._cli_args import float_or_auto as float_or_auto
from ._cli_commands import REPORT_NAME as REPORT_NAME
from ._cli_commands import _check_extras as _check_extras
from ._cli_commands import _load as _load
from ._cli_commands import _plots as _plots
from ._cli_commands import _progress as _progress
from ._cli_commands import _step as _step
from ._cli_commands import _write_output as _write_output
from ._cli_commands import cmd_convert as cmd_convert
from ._cli_commands import cmd_demo as cmd_demo
from ._cli_commands import cmd_inspect as cmd_inspect
from ._cli_commands import cmd_merge as cmd_merge
from ._cli_commands import coverage_summary as coverage_summary
from ._cli_commands import inspect_dict as inspect_dict
from ._cli_commands import report_dict as report_dict
from ._cli_commands import skipped_summary as skipped_summary
from ._cli_common import PROG as PROG
from ._cli_common import UsageError as UsageError
from ._cli_common import _say as _say
from ._cli_common import _shown as _shown
from ._cli_paths import _FACTOR_KEY as _FACTOR_KEY
from ._cli_paths import _STAGING as _STAGING
from ._cli_paths import OUT_MARGIN as OUT_MARGIN
from ._cli_paths import STAGING_TAG as STAGING_TAG
from ._cli_paths import SizeEstimate as SizeEstimate
from ._cli_paths import _alive as _alive
from ._cli_paths import _check_out as _check_out
from ._cli_paths import _check_space as _check_space
from ._cli_paths import _host_tag as _host_tag
from ._cli_paths import _nearest_existing as _nearest_existing
from ._cli_paths import _resolve as _resolve
from ._cli_paths import _size as _size
from ._cli_paths import _stat as _stat
from ._cli_paths import _user_path as _user_path
from ._cli_paths import _write_error as _write_error
from ._cli_paths import check_adapter_dir as check_adapter_dir
from ._cli_paths import clean_stale_staging as clean_stale_staging
from ._cli_paths import estimate_out_bytes as estimate_out_bytes
from ._cli_paths import staging_dir as staging_dir
from ._cli_paths import staging_name as staging_name
from ._cli_paths import weight_shapes as weight_shapes
from .errors import NetUtilityError, one_line

__all__ = [
    "EXIT_CODES",
    "MAX_BUDGET",
    "MAX_MESSAGE",
    "PROG",
    "REPORT_NAME",
    "SEED_BOUND",
    "STAGING_TAG",
    "SizeEstimate",
    "UsageError",
    "build_parser",
    "check_adapter_dir",
    "clean_stale_staging",
    "cmd_convert",
    "cmd_demo",
    "cmd_inspect",
    "cmd_merge",
    "coverage_summary",
    "default_compile_cache",
    "enable_compile_cache",
    "estimate_out_bytes",
    "float_or_auto",
    "inspect_dict",
    "main",
    "report_dict",
    "skipped_summary",
    "staging_dir",
    "staging_name",
    "weight_shapes",
]

# (doctest.testmod(cli), as tests/test_docs.py runs it, finds only this module's own functions:
# the examples of the functions it re-exports are listed here so that it still runs them)
__test__ = {"coverage_summary": coverage_summary, "estimate_out_bytes": estimate_out_bytes}

MAX_MESSAGE = 2000
"""The one-line error printer cuts messages longer than this many characters."""
EXIT_CODES = (
    "Exit codes: 0 done; 2 bad input (one line on stderr, naming what to fix); 1 a bug in "
    "netutility-jax (its traceback and a request to report it); 130 interrupted."
)


def default_compile_cache() -> pathlib.Path | None:
    """The persistent compilation cache folder: ``$NETUTILITY_COMPILE_CACHE`` (``off``: none),
    else ``$XDG_CACHE_HOME/netutility-jax/jax`` (``~/.cache/netutility-jax/jax``)."""
    env = os.environ.get("NETUTILITY_COMPILE_CACHE")
    if env in ("off", "0"):
        return None
    if env:
        return pathlib.Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "netutility-jax" / "jax"


def enable_compile_cache(folder: pathlib.Path) -> bool:
    """Turn on JAX's persistent compilation cache in ``folder`` (every kernel the command
    compiles). A folder that cannot be created is a note, not an error: the command runs
    without the cache. Returns whether the cache is on."""
    import jax

    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"{folder} is not writable")
    except OSError as e:
        _say("cache", "note", f"compilation cache off ({e}); use --no-compile-cache to silence")
        return False
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return True


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line, as every other refusal of the command:
    ``netutility merge: error: argument --rank: ...; see 'netutility merge --help'`` and exit
    code 2, instead of the usage block (the subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        text = _one_line(Exception(message))
        self.exit(2, f"{self.prog}: error: {text}; see '{self.prog} --help'\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        # unknown flags are the chosen subcommand's error (argparse reports them as the
        # top-level parser's, which does not name the subcommand)
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = next(
                (a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None
            )
            parser = sub.choices.get(getattr(ns, sub.dest, None)) if sub is not None else None
            (parser or self).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


def build_parser(*, demo_options: bool = True) -> argparse.ArgumentParser:
    """The ``netutility`` argument parser (subcommands ``merge``, ``inspect``, ``convert``,
    ``demo``).

    ``demo_options=False`` leaves out the demo's own options, whose module imports the experiment
    (MiniLM, optax; about 3 s): :func:`main` asks for them only when the command is ``demo``.
    """
    parser = _Parser(
        prog=PROG,
        description="Budget-aware merging of LoRA adapters across tasks (Net Utility), in JAX.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_package_version()}",
        help="print the version of netutility-jax and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_merge_parser(sub)
    _add_inspect_parser(sub)
    _add_convert_parser(sub, epilog=EXIT_CODES)
    _add_demo_parser(sub, demo_options=demo_options)
    return parser


def _package_version() -> str:
    from . import __version__

    return __version__


def _add_merge_parser(sub) -> None:
    """``netutility merge``: its inputs, output and budget, then the flag groups."""
    m = sub.add_parser(
        "merge",
        help="merge PEFT LoRA adapters under a rank budget and write a PEFT adapter",
        description="Score every singular direction of every task's LoRA update by its Net "
        "Utility, keep the best under the budget, merge, and write OUT_DIR with a PEFT adapter, "
        f"a model card (README.md), a JSON report ({REPORT_NAME}, with the configuration "
        "that replays the merge: --config OUT_DIR/netutility_report.json --out NEW) and plots. "
        "OUT_DIR must not exist. Adapters of one base model that target different modules are "
        "merged over the union of their modules (see --strict-targets). --dry-run prints the "
        "plan (what each task keeps against its uniform share, the output ranks and size, "
        "a time and memory estimate) and writes nothing. Tasks are named by their folders' "
        "names. A task keeping less than half its uniform share is warned about (see "
        "--min-share).",
        epilog=EXIT_CODES,
    )
    add_merge_arguments(m)


def _add_inspect_parser(sub) -> None:
    """``netutility inspect``."""
    i = sub.add_parser(
        "inspect",
        help="print ranks, energies, heterogeneity, lambda and positive-utility counts",
        description="Load PEFT adapters (one per task) and print, per task, its ranks, energy "
        "||dW||_F^2 and number of positive-utility directions; and the heterogeneity h, the "
        "alpha the paper's rule picks and lambda.",
        epilog=EXIT_CODES,
    )
    i.add_argument("adapters", nargs="+", metavar="ADAPTER_DIR", help="PEFT adapter folders")
    _add_scoring(i)
    _add_loading(i)
    _add_compile_cache(i)
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.add_argument(
        "--diagnose",
        action="store_true",
        help="also print data-free diagnostics of the Net Utility allocation at --budget "
        "(nu.diagnose): the tasks' input-subspace overlap against chance, each task's energy "
        "and kept share against its uniform share, the effect of lambda x1/4 and x4, and a "
        "random-rotation control; with --json they go under 'diagnostics'. Needs --budget.",
    )
    i.add_argument(
        "--budget",
        type=_positive_int,
        default=None,
        help="R, the average number of kept directions per module that --diagnose allocates "
        "(as merge --budget); only with --diagnose",
    )


def _add_demo_parser(sub, *, demo_options: bool) -> None:
    """``netutility demo``; its own options only if ``demo_options`` (they import the demo)."""
    d = sub.add_parser(
        "demo",
        help="run the built-in experiment (MiniLM task LoRAs, merged, evaluated)",
        description="Train task LoRAs on MiniLM-L6 with real data, merge them with every method, "
        "space and budget, uniform against net utility, and report normalized accuracy.",
    )
    if demo_options:
        try:
            from .experiments import demo as _demo
        except ImportError as e:  # the experiment's own dependencies are optional
            d.set_defaults(_demo_error=str(e))
        else:
            _demo.add_arguments(d)


def _one_line(e: BaseException, limit: int = MAX_MESSAGE) -> str:
    """``e`` as one line of at most ``limit`` characters (:func:`errors.one_line`)."""
    return one_line(e, limit)


def _versions() -> str:
    """The versions a bug report needs: ours, JAX's and the other dependencies', Python's."""
    import platform

    from ._provenance import versions

    v = versions()
    parts = [f"{dist} {ver}" for dist, ver in v.items() if dist != "python"]
    parts.append(f"Python {v['python']} on {platform.platform(terse=True)}")
    return ", ".join(parts)


def _required_merge_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``merge`` without ``--config``: its required arguments, refused as argparse refuses a
    missing one (``ADAPTER_DIR``; ``--out`` unless ``--dry-run``; ``--budget`` unless
    ``--allocation all``). With ``--config`` they may come from the file: checked once it is
    read."""
    if args.config is not None:
        return
    missing = []
    if not args.adapters:
        missing.append("ADAPTER_DIR (or --config FILE)")
    if args.out is None and not args.dry_run:
        missing.append("--out (unless --dry-run)")
    if args.budget is None and args.allocation != "all":
        missing.append("--budget (unless --allocation all)")
    if missing:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices["merge"].error(f"the following arguments are required: {', '.join(missing)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``netutility`` console script; returns the exit code.

    0: done. 2: bad input (the library's :class:`~netutility_jax.errors.NetUtilityError`, the
    command's :class:`UsageError`, or an argparse error), printed as one line (an argparse
    error with a pointer to ``--help`` instead of the usage). 1: any other
    exception, a bug in netutility-jax: its traceback and a request to report it. 130:
    interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(demo_options=bool(argv) and argv[0] == "demo")
    args = parser.parse_args(argv)
    args.argv = argv  # recorded by the commands that write a report (the demo's results.json)
    if args.command == "merge":
        _required_merge_arguments(parser, args)
    cmds: dict[str, Callable[[argparse.Namespace], int]] = {
        "merge": cmd_merge,
        "inspect": cmd_inspect,
        "convert": cmd_convert,
        "demo": cmd_demo,
    }
    try:
        cache = default_compile_cache()
        if args.command != "demo" and not args.no_compile_cache and cache is not None:
            enable_compile_cache(cache)
        return cmds[args.command](args)
    except NetUtilityError as e:
        _say(args.command, "error", _one_line(e))
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        command = " ".join(shlex.quote(a) for a in [PROG, *argv])
        _say(
            args.command,
            "internal error",
            "this is a bug in netutility-jax, not a problem with your input; please report it "
            f"with the traceback above, the command line ({_one_line(Exception(command), 500)}) "
            f"and the versions ({_versions()})",
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
