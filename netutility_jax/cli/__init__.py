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

The command is a package, one module per concern, over one library call: ``merge`` turns its
flags (a ``--config`` file's settings under them) into one :class:`nu.MergeConfig` and calls
:func:`nu.merge_folders`, which reads, merges and writes the output folder. :mod:`.common` (its
name, :class:`UsageError`, one-line messages, the flags' spelling), :mod:`.values` (the flags'
value types), :mod:`.args` (the flag groups), :mod:`.options` (the registry's method and space
options as flags, in the command line's wording), :mod:`.configfile` (the bounded, strict
reader of a ``--config`` file), :mod:`.config` (flags and ``--config`` -> the one
:class:`nu.MergeConfig`), :mod:`.digests` (the inputs' digests, a replayed report's checks),
:mod:`.job` (:class:`~.job.MergeJob`: ``merge``'s settings as one :class:`nu.MergeConfig` and
the arguments about the run), :mod:`.paths` (input and output checks, the size estimate,
staging folders), :mod:`.load` (loading for ``inspect`` and ``--dry-run``, the notes about it),
:mod:`.output` (the progress bar), one module per subcommand (:mod:`.merge`, :mod:`.distributed`
for ``merge --distributed``, :mod:`.inspect`, :mod:`.convert`, :mod:`.demo`), :mod:`.parser`
(the parser, one function per subcommand) and :mod:`.entry` (:func:`main`, the compilation
cache). This module re-exports the command's public names; ``python -m netutility_jax.cli``
runs :func:`main` (:mod:`.__main__`).

``netutility merge --distributed`` splits the streamed merge between the processes of a
``jax.distributed`` run (see :mod:`netutility_jax.streaming` and :mod:`netutility_jax.pipeline._exchange`).
"""

from __future__ import annotations

from ..peft import weight_shapes as weight_shapes
from .common import PROG as PROG
from .common import UsageError as UsageError
from .convert import cmd_convert as cmd_convert
from .demo import cmd_demo as cmd_demo
from .entry import default_compile_cache as default_compile_cache
from .entry import enable_compile_cache as enable_compile_cache
from .entry import main as main
from .entry import run as run
from .inspect import cmd_inspect as cmd_inspect
from .inspect import inspect_dict as inspect_dict
from .load import coverage_summary as coverage_summary
from .load import skipped_summary as skipped_summary
from .merge import cmd_merge as cmd_merge
from .options import method_options as method_options
from .output import REPORT_NAME as REPORT_NAME
from .output import report_dict as report_dict
from .parser import EXIT_CODES as EXIT_CODES
from .parser import MAX_MESSAGE as MAX_MESSAGE
from .parser import build_parser as build_parser
from .paths import OUT_MARGIN as OUT_MARGIN
from .paths import STAGING_TAG as STAGING_TAG
from .paths import SizeEstimate as SizeEstimate
from .paths import check_adapter_dir as check_adapter_dir
from .paths import clean_stale_staging as clean_stale_staging
from .paths import estimate_out_bytes as estimate_out_bytes
from .paths import staging_dir as staging_dir
from .paths import staging_name as staging_name
from .values import MAX_BUDGET as MAX_BUDGET
from .values import SEED_BOUND as SEED_BOUND
from .values import float_or_auto as float_or_auto

__all__ = [
    "EXIT_CODES",
    "MAX_BUDGET",
    "MAX_MESSAGE",
    "OUT_MARGIN",
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
    "method_options",
    "report_dict",
    "run",
    "skipped_summary",
    "staging_dir",
    "staging_name",
    "weight_shapes",
]

# (doctest.testmod(cli), as tests/test_docs.py runs it, finds only this module's own functions:
# the examples of the functions it re-exports are listed here so that it still runs them)
__test__ = {"coverage_summary": coverage_summary, "estimate_out_bytes": estimate_out_bytes}
