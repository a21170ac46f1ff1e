"""The ``netutility`` argument parser: one function per subcommand, its errors on one line.

The flags themselves are in :mod:`.args` (the merge methods' flags derived from the registry);
the demo's own options come from the experiment (:mod:`.demo`).
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from ..errors import one_line
from .args import (
    add_compile_cache,
    add_convert_parser,
    add_loading,
    add_merge_arguments,
    add_scoring,
)
from .common import PROG
from .demo import add_demo_parser
from .output import REPORT_NAME
from .values import join_negative_values, positive_int

__all__ = ["EXIT_CODES", "MAX_MESSAGE", "build_parser", "required_merge_arguments"]


MAX_MESSAGE = 2000
"""The one-line error printer cuts messages longer than this many characters."""


EXIT_CODES = (
    "Exit codes: 0 done; 2 bad input (one line on stderr, naming what to fix); 1 a bug in "
    "netutility-jax (its traceback and a request to report it); 130 interrupted."
)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line, as every other refusal of the command:
    ``netutility merge: error: argument --rank: ...; see 'netutility merge --help'`` and exit
    code 2, instead of the usage block (the subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        text = one_line(Exception(message), MAX_MESSAGE)
        self.exit(2, f"{self.prog}: error: {text}; see '{self.prog} --help'\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # a value that starts with "-" but reads as numbers (--weights -1,0.5,2) is the flag's
        # value, not a flag (argparse takes only "-1" or "-0.5" alone as a negative number)
        if args is not None:
            args = join_negative_values(self._actions, list(args))
        return super().parse_known_args(args, namespace)

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
    (MiniLM, optax; about 3 s): :func:`.entry.main` asks for them only when the command is ``demo``.
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
    add_merge_parser(sub)
    add_inspect_parser(sub)
    add_convert_parser(sub, epilog=EXIT_CODES)
    add_demo_parser(sub, demo_options=demo_options)
    return parser


def _package_version() -> str:
    from .. import __version__

    return __version__


def add_merge_parser(sub) -> None:
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


def add_inspect_parser(sub) -> None:
    """``netutility inspect``."""
    i = sub.add_parser(
        "inspect",
        help="print ranks, energies, heterogeneity, lambda and positive-utility counts",
        description="Load PEFT adapters (one per task) and print, per task, its ranks, energy "
        "||dW||_F^2 and number of positive-utility directions; and the heterogeneity h, the "
        "alpha the paper's rule picks and lambda.",
        epilog=EXIT_CODES,
    )
    i.add_argument(
        "adapters",
        nargs="+",
        metavar="ADAPTER_DIR",
        help="PEFT adapter folders, or Hugging Face Hub ids (org/name[@revision]) fetched "
        "through huggingface_hub where no local folder has that name (as for merge)",
    )
    add_scoring(i)
    add_loading(i)
    add_compile_cache(i)
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.add_argument(
        "--diagnose",
        action="store_true",
        help="also print data-free diagnostics of the Net Utility allocation at --budget "
        "(nu.diagnose): the tasks' input-subspace overlap against chance, each task's energy "
        "and kept share against its uniform share, the effect of lambda x1/4 and x4, a "
        "random-rotation control, the difference from energy alone (--lam 0), and a "
        "recommendation (energy alone where the rotation control shows the interference term "
        "sees no cross-task geometry); with --json they go under 'diagnostics'. Needs --budget.",
    )
    i.add_argument(
        "--budget",
        type=positive_int,
        default=None,
        help="R, the average number of kept directions per module that --diagnose allocates "
        "(as merge --budget); only with --diagnose",
    )


def required_merge_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``merge`` without ``--config``: its required arguments, refused as argparse refuses a
    missing one (``ADAPTER_DIR``; ``--out`` unless ``--dry-run``; ``--budget`` unless
    ``--allocation all``). With ``--config`` they may come from the file: checked once it is
    read."""
    if args.config is not None:
        return
    missing = []
    if not args.adapters and args.input_moments:  # (the flag took every name after it)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices["merge"].error(
            f"no adapters: --input-moments took every name after it ({', '.join(args.input_moments)}"
            "); give the adapter folders first, then --input-moments FILE..., one per adapter"
        )
    if not args.adapters:
        missing.append("ADAPTER_DIR (or --config FILE)")
    if args.out is None and not args.dry_run:
        missing.append("--out (unless --dry-run)")
    if args.budget is None and args.allocation != "all":
        missing.append("--budget (unless --allocation all)")
    if missing:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices["merge"].error(f"the following arguments are required: {', '.join(missing)}")
