"""The ``netutility`` command's flag groups (which flags each subcommand has, with their help),
and the ``convert`` subcommand's parser (:func:`add_convert_parser`).

The flags' value types are :mod:`.values`'. The flags of the merge methods and spaces are not
listed here: :func:`.options.add_method_options` derives one flag per option of
:mod:`netutility_jax.registry` (its type, range and help).
"""

from __future__ import annotations

import argparse

from ..scoring.utility import INTERFERENCES
from . import values
from .options import add_method_options
from .values import ALPHA_MAX, LAM_MAX, WEIGHT_RANGE, positive_int

__all__ = [
    "add_compile_cache",
    "add_convert_parser",
    "add_loading",
    "add_merge_arguments",
    "add_scoring",
]


# -------------------------------------------------------------------------------- flag groups


def add_merge_arguments(m: argparse.ArgumentParser) -> None:
    """Every argument of ``netutility merge``: its inputs (or ``--config``) and output, its
    budget and plan, then the flag groups."""
    _add_merge_inputs(m)
    _add_merge_budget(m)
    _add_merge_method(m)
    add_scoring(m)
    add_loading(m)
    add_compile_cache(m)
    _add_merge_tuning(m)
    _add_merge_output(m)


def _add_merge_inputs(m: argparse.ArgumentParser) -> None:
    """``merge``: the adapters, ``--config`` (and a replay's ``--allow-changed``), ``--out``."""
    m.add_argument(
        "adapters",
        nargs="*",
        metavar="ADAPTER_DIR",
        help="PEFT adapter folders (adapter_config.json + adapter_model.safetensors), one per "
        "task, all trained on the same base model (or give them in --config). Each task is "
        "named by its folder's name (with parent folders where two names are equal). A name "
        "that is no local file or folder but reads as a Hugging Face Hub id, org/name or "
        "org/name@revision, is fetched through huggingface_hub (its cache; nothing but the "
        "cache with HF_HUB_OFFLINE=1); a local folder of the same name wins.",
    )
    m.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="read the merge from a YAML or JSON file: 'adapters:' a list, each a path or a "
        "mapping {path, weight, name}; the other keys are this command's flags without the "
        "dashes (method, space, budget, allocation, out, chunk-mb or chunk_mb, ...), checked "
        "as the flags are. Relative paths are relative to the file's folder. Flags given on "
        "the command line override the file's keys. A merge's netutility_report.json is such "
        "a file: --config OUT_DIR/netutility_report.json --out NEW replays that merge (the "
        "same adapter files, bit for bit, from the same inputs; an adapter or moments file "
        "whose SHA-256 differs from the report's, or another library version, is refused "
        "unless --allow-changed). YAML needs PyYAML; a file over 16 MiB, nested deeper than "
        "64 levels, with a key given twice or aliases expanding past 100000 values is refused.",
    )
    m.add_argument(
        "--allow-changed",
        action="store_true",
        help="replaying a report (--config OUT_DIR/netutility_report.json): merge even if an "
        "adapter's or input-moments file's SHA-256 differs from the one the report recorded, "
        "or the report was written by another netutility-jax version (each difference is "
        "then a warning); by default such a replay is refused, since it would not be that "
        "merge",
    )
    m.add_argument(
        "--out",
        default=None,
        metavar="OUT_DIR",
        help="output folder (required unless --dry-run); must not exist, and its parent must "
        "be (or be creatable in) a writable folder with room for the result: checked before "
        "anything is loaded",
    )


def _add_merge_budget(m: argparse.ArgumentParser) -> None:
    """``merge``: the budget, ``--dry-run``, the tasks' weights and floor, input moments."""
    m.add_argument(
        "--budget",
        type=positive_int,
        default=None,
        help="R, the average number of kept singular directions per module (the paper uses 16, "
        "32, 64; each task's adapter has rank r, so M*r keeps everything); at most 2**31 - 1. "
        "Required, except with --allocation all (which keeps every direction).",
    )
    m.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and write nothing: read the adapters' headers and factors, score "
        "and allocate as the merge would, and print per task the directions it keeps against "
        "its uniform share, per module the output rank (a table, or a summary for many "
        "modules), the adapter's size and a rough time and memory estimate. --out is optional "
        "(checked if given, never created).",
    )
    m.add_argument(
        "--weights",
        type=values.weights,
        default=None,
        metavar="W1,W2,...",
        help="per-task weights, one per adapter: task i's kept update is multiplied by Wi in "
        "the merge (as PEFT's add_weighted_adapter weights and mergekit's per-model weight "
        "scale each task's delta before combining). Weights do not change the allocation: "
        "the directions are scored and kept as for the unweighted tasks (use --min-share or "
        f"--allocation uniform to change the split between tasks). Each is {WEIGHT_RANGE}; "
        "a negative one subtracts that task (--weights -1,0.5,2 or --weights=-1,0.5,2). "
        "Default: all 1.",
    )
    m.add_argument(
        "--min-share",
        type=values.bounded_float(0, 1, low_open=False, high_open=False, what="a fraction"),
        default=None,
        metavar="F",
        help="net_utility: a per-task floor. Each task first keeps its int(F x share) best "
        "directions (those of positive utility, unless --keep-nonpositive), share being its "
        "uniform share of the budget: budget x modules / tasks, or its candidate directions "
        "if fewer (per module budget / tasks with --scope local); the rest of the budget then "
        "goes by utility as without it. A floor that does not bind changes nothing. Default: "
        "none (0).",
    )
    m.add_argument(
        "--input-moments",
        nargs="+",
        action="extend",
        default=None,
        metavar="FILE",
        help="data-aware scoring (net_utility; docs/input_moments.md): one file per adapter, "
        "in the adapters' order, each holding that task's input second moments E[x x^T] per "
        "module: a .safetensors or .npz (read without pickles) keyed by the module names as "
        "the merge names them (model.layers.0.self_attn.q_proj), each value a (d_in, d_in) "
        "matrix, or the factors nu.moments.save_input_moments writes. 'none' for a task without data "
        "(data-free there). Give the files after the adapters (or repeat the flag). The report "
        "records data_aware and each file's SHA-256. Default: the data-free score.",
    )


def add_scoring(p: argparse.ArgumentParser) -> None:
    """``--alpha`` and ``--lam`` of the scoring (``merge`` and ``inspect``)."""
    p.add_argument(
        "--alpha",
        type=values.auto_or(0, ALPHA_MAX, "the geometry exponent"),
        default="auto",
        help="geometry exponent of the interference: 1 = Gram geometry (singular-value weighted), "
        "0 = row-space geometry, 'auto' = the paper's rule from the task heterogeneity h "
        f"(h > 1: 0, else 1); a number in [0, {ALPHA_MAX:g}]. Default: auto.",
    )
    p.add_argument(
        "--lam",
        type=values.auto_or(0, LAM_MAX, "the interference weight"),
        default="auto",
        help="interference weight lambda in utility = benefit - lambda * interference; 'auto' = "
        "median(benefit) / median(interference) over all candidates (data-free); a number in "
        f"[0, {LAM_MAX:g}]. Default: auto.",
    )
    p.add_argument(
        "--interference",
        choices=INTERFERENCES,
        default="overlap",
        help="the interference term: overlap = the paper's (input-side overlaps with the other "
        "tasks' directions, sign-blind); signed = this project's sign-aware extension (only "
        "conflicting pairs of rank-1 components count, agreeing ones add nothing; "
        "docs/math.md); signed_weaker = the same, each conflict charged to the side with the "
        "smaller share of its task's energy. net_utility only. Default: overlap.",
    )


def add_loading(p: argparse.ArgumentParser) -> None:
    """The loading flags (``merge`` and ``inspect``): targets, base model, non-LoRA tensors."""
    p.add_argument(
        "--strict-targets",
        action="store_true",
        help="refuse adapters whose target modules differ. By default the union of their "
        "modules is used: a task contributes nothing where it has no LoRA module, and the "
        "per-module task coverage is printed (and written to the merge report).",
    )
    p.add_argument(
        "--allow-different-base",
        action="store_true",
        help="merge adapters whose base_model_name_or_path differ (refused by default: LoRA "
        "updates of different base models do not add up). Module shapes must still agree.",
    )
    p.add_argument(
        "--skip-non-lora",
        action="store_true",
        help="skip tensors that are not LoRA factors (modules_to_save copies, trainable tokens) "
        "instead of refusing the adapter; a warning says how many were skipped. The merged "
        "adapter does not carry them.",
    )


def add_compile_cache(p: argparse.ArgumentParser) -> None:
    """``--no-compile-cache`` (``merge``, ``inspect`` and ``demo``)."""
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use JAX's persistent compilation cache (by default compiled kernels are "
        "kept in ~/.cache/netutility-jax/jax, or $NETUTILITY_COMPILE_CACHE ('off' turns it "
        "off), so that a second run with the same shapes skips most compiling)",
    )


def _add_merge_method(m: argparse.ArgumentParser) -> None:
    """``merge``: the method, the space it runs in, and which directions are kept."""
    from .. import registry

    m.add_argument(
        "--method",
        default="ta",
        choices=tuple(registry.METHODS),
        help="merge method: "
        + "; ".join(f"{n} ({s.summary})" for n, s in registry.METHODS.items())
        + ". Default: ta.",
    )
    m.add_argument(
        "--space",
        default="full",
        choices=tuple(registry.SPACES),
        help="space the method runs in: "
        + ", ".join(f"{n} ({s.summary})" for n, s in registry.SPACES.items())
        + ". Default: full.",
    )
    m.add_argument(
        "--allocation",
        default="net_utility",
        choices=registry.ALLOCATIONS,
        help="which directions to keep: net_utility (this method), uniform (each task keeps its "
        "top budget/M directions per module, the baseline), all (every direction: no budget, "
        "--budget may be left out and is ignored). Default: net_utility.",
    )
    m.add_argument(
        "--scope",
        choices=("global", "local"),
        default=None,
        help="net_utility budget scope: global (top budget x modules over the whole model) or "
        "local (top budget per module). Default: the paper's choice, global for ta/tsv/iso, "
        "local for ties/dare.",
    )


def _add_merge_tuning(m: argparse.ArgumentParser) -> None:
    """``merge``: admission of non-positive directions, the coefficient, the seed, and the
    methods' and spaces' own options (from the registry)."""
    m.add_argument(
        "--keep-nonpositive",
        action="store_true",
        help="also admit directions with utility <= 0 (by default they are dropped, so the "
        "budget need not be spent)",
    )
    m.add_argument(
        "--coef",
        type=values.coef,
        default=1.0,
        help="scaling of the merged update, a finite nonzero number (negative: subtracted; one "
        "whose merged update leaves the dtype's range is refused). Default: 1.",
    )
    m.add_argument(
        "--seed",
        type=values.seed,
        default=0,
        help="dare/dare_ties: random seed of the drop masks, in [0, 2**32). Default: 0.",
    )
    add_method_options(m)


def _add_merge_output(m: argparse.ArgumentParser) -> None:
    """``merge``: how the result is written (rank of dense results, dtype, serving ranks), plots
    and progress bars."""
    m.add_argument(
        "--rank",
        type=values.rank,
        default=None,
        help="rank to which dense results (ties/dare in full space) are truncated by SVD when "
        "written as a PEFT adapter; required for those, ignored otherwise",
    )
    m.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="dtype of the written adapter weights. Default: float32.",
    )
    m.add_argument(
        "--serving-ranks",
        type=values.serving_ranks,
        default=None,
        metavar="vllm|R1,R2,...",
        help="write every module at one uniform rank (zero-padded, scale folded in, no "
        "rank_pattern) for serving stacks that accept only some LoRA ranks: 'vllm' (1, 8, 16, "
        "32, 64, 128, 256, 320, 512) or a comma list; the smallest one at least the largest "
        "merged rank is used. Default: each module at its own rank.",
    )
    m.add_argument(
        "--in-memory",
        action="store_true",
        help="load every adapter into memory at once (nu.merge_adapters) instead of streaming "
        "them from disk a chunk of modules at a time (the default)",
    )
    m.add_argument(
        "--chunk-mb",
        type=values.bounded_float(0, 2**20, low_open=True, high_open=False, what="megabytes"),
        default=64.0,  # nu.streaming.CHUNK_BYTES (not imported: parsing does not load jax)
        help="streaming: the factors of all tasks read at once, in MB (a chunk holds whole "
        "modules of one shape; default 64)",
    )
    m.add_argument(
        "--devices",
        type=values.devices,
        default="all",
        help="devices of this process to split each chunk's modules between (a one-axis mesh, "
        "nu.module_mesh): 'all' (default; one device, e.g. a CPU, changes nothing) or a count",
    )
    m.add_argument("--no-plots", action="store_true", help="do not write plots")
    m.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_distributed(m)


def _add_distributed(m: argparse.ArgumentParser) -> None:
    """``merge``: several processes or hosts (``jax.distributed``)."""
    g = m.add_argument_group(
        "several processes or hosts",
        "Run the same command in every process (one per host, or several on one machine); "
        "every process must read the adapters at the same paths.",
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="merge with the processes of a jax.distributed run: each reads and merges its "
        "share of the modules, lambda and the budget are agreed across processes, and process "
        "0 writes OUT_DIR. On SLURM, Open MPI and TPU pods the processes find each other; "
        "elsewhere pass --coordinator, --num-processes and --process-id.",
    )
    g.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=None,
        help="--distributed: process 0's host and a free port on it, the same in every process",
    )
    g.add_argument(
        "--num-processes",
        type=values.count,
        default=None,
        metavar="N",
        help="--distributed: how many processes take part",
    )
    g.add_argument(
        "--process-id",
        type=values.index,
        default=None,
        metavar="I",
        help="--distributed: this process's index, 0 to N-1 (process 0 writes OUT_DIR)",
    )
    g.add_argument(
        "--keep-shards",
        action="store_true",
        help="--distributed: write the adapter as one safetensors shard per process plus "
        "adapter_model.safetensors.index.json, for merges too large for one host, instead of "
        "one adapter_model.safetensors written by process 0. Every process then writes into "
        "OUT_DIR's folder, which all must share. PEFT does not read this layout; netutility "
        "inspect and nu.peft.load_adapter(s) do.",
    )
    g.add_argument(
        "--distributed-timeout",
        type=values.bounded_float(0, 86400, low_open=True, high_open=False, what="seconds"),
        default=None,
        metavar="S",
        help="--distributed: how long a process waits for all the others to join before it "
        "gives up with one line (default: 120 s). A process that dies later ends the others "
        "within --heartbeat-timeout, each with one line naming it.",
    )
    g.add_argument(
        "--heartbeat-timeout",
        type=values.bounded_float(1, 86400, low_open=False, high_open=False, what="seconds"),
        default=None,
        metavar="S",
        help="--distributed: once joined, a process silent for S seconds (killed, out of "
        "memory, a crashed host) is declared dead and every other process stops with one line "
        "naming it (default: 100 s, JAX's; whole seconds, rounded up).",
    )


# -------------------------------------------------------------------------------- subcommands


def add_convert_parser(sub, *, epilog: str | None = None) -> None:
    """``netutility convert SRC_FOLDER OUT_FOLDER [--overwrite]`` (``epilog``: the exit codes)."""
    c = sub.add_parser(
        "convert",
        help="write a PEFT adapter saved as a pickled adapter_model.bin as "
        "adapter_model.safetensors (read without torch; nothing in the pickle is run)",
        description="Read the PEFT adapter in SRC_FOLDER (adapter_config.json and the pickled "
        "adapter_model.bin that save_pretrained(..., safe_serialization=False) writes, in "
        "torch's zip format; or adapter_model.safetensors, or a sharded adapter) and write "
        "OUT_FOLDER with adapter_model.safetensors holding the same tensors (names, shapes, "
        "dtypes and values) and the same adapter_config.json, which PEFT and netutility load. "
        "The pickle is read without torch by a restricted unpickler: only torch's tensor "
        "rebuilders are admitted, and a file naming anything else (os.system, eval ...) is "
        "refused before anything is built. SRC_FOLDER is only read. OUT_FOLDER is assembled "
        "beside it and renamed into place: it appears complete or not at all.",
        epilog=epilog,
    )
    c.add_argument(
        "src",
        metavar="SRC_FOLDER",
        help="the PEFT adapter folder to convert (adapter_config.json + adapter_model.bin)",
    )
    c.add_argument(
        "out",
        metavar="OUT_FOLDER",
        help="output folder; must not exist or be empty, unless --overwrite; not SRC_FOLDER, "
        "nor inside it",
    )
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing OUT_FOLDER that holds an adapter (adapter_config.json), e.g. an "
        "earlier conversion; the old folder is removed only once the new one is complete. A "
        "folder that holds no adapter is never replaced.",
    )
    c.set_defaults(no_compile_cache=True)  # (it compiles nothing: no JAX cache to set up)
