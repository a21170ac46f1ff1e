"""The file-system side of ``netutility merge``, ``inspect`` and ``convert``: the checks before
anything is loaded, and the writing of the output folder.

Before any adapter is loaded, the ``ADAPTER_DIR`` folders and ``--out`` are checked
(:func:`check_adapter_dir`, :func:`_check_out`), the output's size is estimated from the inputs'
safetensors headers (:func:`estimate_out_bytes`) and held against the free space
(:func:`_check_space`). The merge is assembled in a staging folder beside ``--out``
(:func:`staging_name`) and renamed into place (:func:`_write_merge`: the adapter, the report,
the plots); a merge killed while writing leaves one behind, and the next merge into the same
parent folder removes those whose process is gone (:func:`clean_stale_staging`). With
``--distributed --keep-shards`` each process writes its own shard of the adapter
(:func:`write_shard`) and process 0 the index and the config (:func:`write_index`).
``netutility convert`` checks its ``OUT_FOLDER`` (:func:`check_convert_out`) and writes it the
same way, through a staging folder (:func:`write_folder`), replacing an earlier adapter folder
only once the new one is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import secrets
import shutil
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _io
from ._cli_common import PROG, UsageError, _shown
from .errors import FileAccessError, InputError, MissingFileError, NetUtilityError

# (the underscored helpers are private to the command's modules, which share them)
__all__ = [
    "OUT_MARGIN",
    "REPORT_NAME",
    "STAGING_TAG",
    "_FACTOR_KEY",
    "SizeEstimate",
    "_Merged",
    "_check_out",
    "_check_space",
    "_finish_output",
    "_host_tag",
    "_plots",
    "_progress",
    "_stat",
    "_step",
    "_write_error",
    "_write_extras",
    "_write_merge",
    "_write_output",
    "check_adapter_dir",
    "check_convert_out",
    "clean_stale_staging",
    "estimate_out_bytes",
    "model_card",
    "report_dict",
    "shard_name",
    "staging_dir",
    "staging_name",
    "uniform_rank",
    "weight_shapes",
    "write_folder",
    "write_index",
    "write_shard",
]

STAGING_TAG = "netutility-staging"


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
        ``adapter_model.safetensors`` (a folder with the pickled ``adapter_model.bin`` instead,
        or a sharded adapter's index, is left to the loader, which reads and checks it).
      FileAccessError: the folder or one of its files cannot be read.
      UsageError, InputError: an empty path or one the system cannot use (too long, a loop).
    """
    from . import peft
    from .peft._read import INDEX_NAME

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
        if fst is None and name == peft.WEIGHTS_NAME:
            if _stat(path / peft.PICKLE_NAME, what) is not None:
                continue  # the loader reads it (torch's zip format, nothing in it run)
            if _stat(path / INDEX_NAME, what) is not None:
                continue  # sharded (netutility merge --keep-shards): the loader checks it
        if fst is None:
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


def check_convert_out(text: str, src: str, *, overwrite: bool) -> tuple[pathlib.Path, bool]:
    """Refuse an ``OUT_FOLDER`` that ``netutility convert`` cannot write, before anything is read.

    ``OUT_FOLDER`` may be missing or an empty folder; a folder with files is replaced only with
    ``overwrite``, and only if it is an adapter folder (it holds ``adapter_config.json``: an
    earlier conversion, say), never another folder. It may not be ``src``, inside it, or hold it.

    Returns:
      ``(OUT_FOLDER as a path, whether a folder with files is there to be replaced)``.
    """
    from . import peft

    what = f"OUT_FOLDER {text}"
    path = _user_path(text, "OUT_FOLDER")
    res = _resolve(path, what)
    rsrc = _resolve(pathlib.Path(src), f"adapter folder {src}")
    if res == rsrc or rsrc in res.parents or res in rsrc.parents:
        where = (
            "is SRC_FOLDER"
            if res == rsrc
            else "is inside SRC_FOLDER"
            if rsrc in res.parents
            else "holds SRC_FOLDER"
        )
        raise UsageError(
            f"{what}: {where} ({src}); write the conversion elsewhere (SRC_FOLDER is only read)."
        )
    st = _stat(path, what, follow=False)
    replace = False
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise UsageError(
                f"{what}: is a symbolic link; give the folder itself (nothing is written through "
                "a link)."
            )
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{what}: is a file, not a folder; choose a new folder.")
        try:
            entries = sorted(os.listdir(path))
        except OSError as e:
            raise FileAccessError(f"{what}: cannot list it ({e.strerror or e}).") from None
        if entries and not overwrite:
            raise UsageError(
                f"{what}: already exists and is not empty; choose a new folder, or pass "
                "--overwrite to replace it."
            )
        if entries and peft.CONFIG_NAME not in entries:
            shown = ", ".join(entries[:3]) + (
                f" and {len(entries) - 3} more" if len(entries) > 3 else ""
            )
            raise UsageError(
                f"{what}: --overwrite replaces only an adapter folder (one holding "
                f"{peft.CONFIG_NAME}), and this one holds other files ({shown}); choose another "
                "folder."
            )
        replace = bool(entries)
    anc, ast = _nearest_existing(path.parent, what)
    if not stat.S_ISDIR(ast.st_mode):
        raise UsageError(f"{what}: {anc} is a file, not a folder; choose a path in a folder.")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise FileAccessError(
            f"{what}: cannot write in {anc} (permission denied); choose a writable folder."
        )
    return path, replace


def write_folder(
    out: pathlib.Path, what: str, fill: Callable[[pathlib.Path], Any], *, replace: bool,
    command: str,
) -> Any:  # fmt: skip
    """Write the folder ``out`` complete or not at all; returns what ``fill`` returns.

    ``fill(folder)`` fills a staging folder beside ``out`` (:func:`staging_name`, as ``merge``
    assembles ``--out``), which is renamed into place when complete. With ``replace``, the
    folder at ``out`` is first renamed aside and removed only once the new one is in place: a
    failure at any step leaves the old folder as it was, and no half-written one. A failed
    write is the library's :class:`FileAccessError` naming ``what`` (exit code 2).
    """
    fn = f"{PROG} {command}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        done = staging_name(out)  # the complete new folder, before it takes out's place
        try:
            with _io.atomic_directory(done, fn=fn, staging=staging_name(out)) as tmp:
                filled = fill(tmp)
            if replace:
                old = staging_name(out)
                os.rename(out, old)
                try:
                    os.rename(done, out)
                except BaseException:
                    os.rename(old, out)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                try:
                    os.rename(done, out)  # (POSIX: replaces an empty folder, refuses any other)
                except OSError as e:
                    if _stat(out, what, follow=False) is None:
                        raise
                    raise UsageError(
                        f"{what}: appeared while {command} ran; nothing was written."
                    ) from e
        finally:
            if os.path.lexists(done):
                shutil.rmtree(done, ignore_errors=True)
        return filled
    except OSError as e:
        if isinstance(e, NetUtilityError):
            raise
        where = f" at {e.filename}" if getattr(e, "filename", None) else ""
        raise FileAccessError(
            f"{what}: writing failed{where} ({e.strerror or e}); nothing was written. Check the "
            "free space and permissions, or choose another folder."
        ) from e


class SizeEstimate(NamedTuple):
    """An upper estimate of what ``netutility merge`` writes (see :func:`estimate_out_bytes`)."""

    bytes: int
    modules: int
    rank: int


OUT_MARGIN = 16 << 20
"""Bytes added to the adapter's estimated size for the report, the plots and file headers."""


def weight_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the tensors in ``folder/adapter_model.safetensors`` (or in the shards
    its index lists, or in the pickled ``adapter_model.bin``), from the headers only (no tensor
    is read; a bin's pickle says the shapes); None if there is no readable header (the loader
    then says why)."""
    try:
        import safetensors
    except ImportError:
        return None
    from .peft import _read

    fn = "weight_shapes"
    try:
        wf = _read._weights_file(pathlib.Path(folder), fn=fn)
        with _read._open_weights(wf, fn=fn) as fh:
            return {k: tuple(int(n) for n in fh.get_slice(k).get_shape()) for k in fh.keys()}
    except (OSError, ValueError, safetensors.SafetensorError):
        return None


_FACTOR_KEY = re.compile(r"\.lora_([AB])(?:\.[^.]+)?\.weight$")


def estimate_out_bytes(
    shapes: Sequence[Mapping[str, Sequence[int]]],
    *,
    rank: int | None,
    dtype: str,
    serving_ranks: str | Sequence[int] | None = None,
) -> SizeEstimate:
    """Estimate the size of the merged adapter from the input adapters' tensor shapes.

    A merge of LoRA updates of ranks ``r_1..r_M`` has rank at most ``min(sum r_i, d_in,
    d_out)`` per module; a dense result is written at rank ``min(rank, d_in, d_out)`` (its
    truncated SVD has no more directions). The estimate takes the larger of the two per module
    (pass ``rank=None`` where the method's result is low rank: ``--rank`` is then ignored). With
    ``serving_ranks`` (``--serving-ranks``) every module is written at one uniform rank, the
    smallest allowed one at least the largest module's, zero-padded: the estimate counts the
    padding. At the output ``dtype``, plus ``OUT_MARGIN``.

    Example:
      >>> shapes = [{"m.q.lora_A.weight": (4, 100), "m.q.lora_B.weight": (50, 4)}] * 3
      >>> estimate_out_bytes(shapes, rank=None, dtype="float32").bytes - OUT_MARGIN
      7712
      >>> estimate_out_bytes(shapes, rank=None, dtype="float32", serving_ranks="vllm").rank
      16
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
    ranks = {
        name: max(1, min(r_sum, d_in, d_out), min(rank or 0, d_in, d_out))
        for name, (r_sum, d_in, d_out) in modules.items()
    }
    top = max(ranks.values(), default=0)
    if serving_ranks is not None and ranks:
        from .peft import _write

        allowed = _write._serving_ranks(serving_ranks, fn=f"{PROG} merge")
        top = next((r for r in allowed if r >= top), top)  # (none fits: refused after merging)
        ranks = dict.fromkeys(ranks, top)
    total = OUT_MARGIN
    for name, (_, d_in, d_out) in modules.items():
        total += ranks[name] * (d_in + d_out) * itemsize + 512  # (+ two tensors' header entries)
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
    return _io.host_tag()


def staging_name(out: pathlib.Path) -> pathlib.Path:
    """A fresh path beside ``out`` to assemble the merge in:
    ``.<name>.netutility-staging-<host>-<pid>-<8 hex digits>`` (not created)."""
    name = out.name
    while len(os.fsencode(name)) > 100:  # (room for the suffix within 255 bytes)
        name = name[:-1]
    prefix = f".{name}.{STAGING_TAG}-{_host_tag()}-{os.getpid()}-"
    while True:
        path = out.parent / f"{prefix}{secrets.token_hex(4)}"
        if not os.path.lexists(path):
            return path


def staging_dir(out: pathlib.Path) -> pathlib.Path:
    """Create the folder the merge is assembled in, beside ``out`` (:func:`staging_name`)."""
    while True:
        path = staging_name(out)
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path


def _alive(pid: int) -> bool:
    return _io.pid_alive(pid)


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
    """A failed write of ``--out`` as the library's error (exit code 2), naming the file."""
    where = f" at {e.filename}" if getattr(e, "filename", None) else ""
    return FileAccessError(
        f"--out {out}: writing the result failed{where} ({e.strerror or e}); nothing was written. "
        "Check the free space and permissions, or choose another --out."
    )


# ------------------------------------------------------------------------------------ writing

REPORT_NAME = "netutility_report.json"


def _progress(total: int, desc: str, quiet: bool):
    """A progress bar of ``total`` steps on stderr; None if ``quiet`` or tqdm is missing."""
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


def report_dict(
    report: Any,
    *,
    adapters: Sequence[str],
    options: dict[str, Any],
    coverage: Mapping[str, Sequence[int]] | None = None,
    names: Sequence[str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict:
    """A JSON-ready dict of a :class:`nu.Report` (masks and scores left out; NaN -> null;
    ``zeroed``: the modules whose merged update is exactly zero), with the per-module task
    coverage ``{module: [tasks that have it]}`` if given (by name with ``names``, else by
    index). With ``names``: ``tasks``, per task its name, folder, weight, kept directions,
    uniform share of the budget (None with allocation all) and candidates. ``config``: the
    resolved configuration that replays the merge (``netutility merge --config``). Always:
    ``netutility_version`` and ``created_utc`` (ISO 8601, UTC)."""
    import datetime

    from . import __version__
    from .planning import report_shares

    keep = (
        "method", "space", "allocation", "scope", "budget", "budget_spent", "lam", "alpha",
        "heterogeneity", "non_prefix_fraction", "kept_per_task", "kept", "ranks", "zeroed",
        "weights", "min_share",
    )  # fmt: skip
    out = {k: _io.to_jsonable(getattr(report, k, None)) for k in keep}
    label = (lambda i: int(i)) if names is None else (lambda i: names[int(i)])
    if coverage is not None:
        out["coverage"] = {str(n): [label(i) for i in t] for n, t in coverage.items()}
    head: dict[str, Any] = {
        "netutility_version": __version__,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "adapters": list(adapters),
    }
    if names is not None:
        shares = report_shares(report)
        cand = None
        if report.masks is not None:
            from ._min_share import candidates

            counts = candidates(report.scores if report.scores is not None else report.masks)
            cand = np.sum(list(counts.values()), axis=0)
        weights = report.weights or (1.0,) * len(names)
        head["tasks"] = [
            {
                "name": n,
                "path": p,
                "weight": float(weights[i]),
                "kept": int(report.kept_per_task[i]),
                "uniform_share": None if shares is None else float(shares[i]),
                "candidates": None if cand is None else int(cand[i]),
            }
            for i, (n, p) in enumerate(zip(names, adapters, strict=True))
        ]
    out = {**head, "options": _io.to_jsonable(options), **out}
    if config is not None:
        out["config"] = _io.to_jsonable(dict(config))
    return out


def model_card(rep: Mapping[str, Any], base_config: Mapping[str, Any] | None) -> str:
    """The merged adapter's ``README.md``, as PEFT writes one: YAML front matter
    (``library_name: peft``, ``base_model`` if the adapters name one, tags), then what was
    merged (the tasks, their weights and kept directions), how (method, space, allocation,
    budget), and the library's version. ``rep``: :func:`report_dict`'s dict."""
    base = (base_config or {}).get("base_model_name_or_path")
    front = ["---", "library_name: peft"]
    if isinstance(base, str) and base:
        front.append(f"base_model: {json.dumps(base)}")
    front += ["tags:", "- lora", "- merge", "- netutility-jax", "---", ""]
    tasks = rep.get("tasks") or [
        {"name": a, "path": a, "weight": 1.0, "kept": k, "uniform_share": None}
        for a, k in zip(rep["adapters"], rep["kept_per_task"], strict=True)
    ]
    how = f"method `{rep['method']}` in `{rep['space']}` space"
    if rep["allocation"] == "all":
        how += ", every singular direction of every task kept (allocation `all`)"
    else:
        scope = f", {rep['scope']} scope" if rep.get("scope") else ""
        how += (
            f", allocation `{rep['allocation']}`{scope} with a budget of {rep['budget']} "
            f"directions per module on average ({rep['budget_spent']:.2f} spent)"
        )
        if rep.get("min_share"):
            how += f", each task at least {rep['min_share']:g} of its uniform share"
    lines = [
        "# Merged LoRA adapter",
        "",
        f"A merge of {len(tasks)} LoRA adapter{'s' if len(tasks) != 1 else ''}"
        + (f" of `{base}`" if isinstance(base, str) and base else "")
        + f" made with netutility-jax {rep.get('netutility_version', '')}: {how}.",
        "",
        "| task | adapter | weight | kept directions | uniform share |",
        "|---|---|---|---|---|",
    ]
    for t in tasks:
        share = "" if t.get("uniform_share") is None else f"{t['uniform_share']:.1f}"
        lines.append(f"| {t['name']} | `{t['path']}` | {t['weight']:g} | {t['kept']} | {share} |")
    lines += [
        "",
        "Load it with PEFT:",
        "",
        "```python",
        "from peft import PeftModel",
        "",
        'model = PeftModel.from_pretrained(base_model, "path/to/this/folder")',
        "```",
        "",
        f"`{REPORT_NAME}` holds the full report and the configuration: "
        f"`netutility merge --config {REPORT_NAME} --out NEW_DIR` replays the merge.",
        "",
        "### Framework versions",
        "",
        f"- netutility-jax {rep.get('netutility_version', '')}",
        "",
    ]
    return "\n".join(front + lines)


class _Merged(NamedTuple):
    """What the loading and merging steps of ``netutility merge`` made, for the writing step."""

    loaded: Any  # peft.load_adapters' result: the adapters, their base config and coverage
    merged: Any  # the merged adapter
    report: Any  # its nu.Report
    key: Any  # the PRNG key of the method's random choices, or None
    options: dict[str, Any]  # the method and space options from the flags
    processes: int = 1  # how many processes merged (--distributed)


def _write_merge(
    out: pathlib.Path, args: argparse.Namespace, result: _Merged | None, bar,
    fill: Callable[[pathlib.Path], Any] | None = None,
) -> Any:  # fmt: skip
    """The writing step: ``out`` assembled in a staging folder beside it and renamed into place
    (complete or not at all); a failed write is the library's :class:`FileAccessError`. The
    folder is filled by :func:`_write_output` from ``result``, or by ``fill(folder)`` (a merge
    that writes as it goes: :func:`_merge_writing`), whose result is returned."""
    if fill is None:

        def fill(tmp: pathlib.Path) -> None:
            _write_output(tmp, args, result, bar)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_name(out)
    except OSError as e:
        raise _write_error(args.out, e) from e
    try:
        with _io.atomic_directory(out, fn=f"{PROG} merge", staging=staging) as tmp:
            filled = fill(tmp)
            if _stat(out, f"--out {args.out}", follow=False) is not None:
                raise UsageError(f"--out {args.out}: appeared while merging; nothing was written.")
        _step(bar, "done")
        return filled
    except OSError as e:
        if not isinstance(e, NetUtilityError):
            raise _write_error(args.out, e) from e
        raise


def _write_output(tmp: pathlib.Path, args: argparse.Namespace, result: _Merged, bar) -> None:
    """The merge's output folder, assembled in ``tmp``: the PEFT adapter, the JSON report and
    the plots."""
    import netutility_jax as nu

    adapter_dir = tmp / "adapter"
    nu.peft.save_adapter(
        result.merged,
        adapter_dir,
        rank=args.rank,
        base_config=result.loaded.config,
        dtype=args.dtype,
        serving_ranks=args.serving_ranks,
    )
    _finish_output(tmp, args, result, bar)


def _finish_output(tmp: pathlib.Path, args: argparse.Namespace, result: _Merged, bar) -> None:
    """The adapter written in ``tmp / "adapter"`` moved up into ``tmp``, then the extras."""
    adapter_dir = tmp / "adapter"
    for f in adapter_dir.iterdir():
        f.rename(tmp / f.name)
    adapter_dir.rmdir()
    _step(bar, "saved adapter", "writing the report")
    _write_extras(tmp, args, result, bar)


def _write_extras(tmp: pathlib.Path, args: argparse.Namespace, result: _Merged, bar) -> None:
    """The JSON report, the model card (``README.md``) and the plots, in ``tmp``."""
    from . import registry
    from ._cli_config import recorded_config

    run = _run_options(args, result)
    names = _task_names(args)
    resolved = registry.resolve_options(
        f"{PROG} merge", args.method, args.space, dict(result.options)
    ).options
    rep = report_dict(
        result.report, adapters=args.adapters, options=run, coverage=result.loaded.coverage,
        names=names, config=recorded_config(args, resolved) if hasattr(args, "names") else None,
    )  # fmt: skip
    _io.write_json(tmp / REPORT_NAME, rep)
    with _io.atomic_file(tmp / "README.md", "w") as f:
        f.write(model_card(rep, result.loaded.config))
    _step(bar, "wrote report", "plotting")
    if not args.no_plots:
        _plots(tmp / "plots", result.report, len(args.adapters), names=names)
        _step(bar, "plots", "moving into place")


def _task_names(args: argparse.Namespace) -> list[str]:
    """The tasks' names (``args.names``, which ``merge`` sets; else from the folders)."""
    from .planning import task_names

    names = getattr(args, "names", None)
    return list(names) if names is not None else task_names(args.adapters)


def _run_options(args: argparse.Namespace, result: _Merged) -> dict[str, Any]:
    """The report's ``options``: the flags the merge ran with."""
    return {
        "command": "merge",
        "budget": args.budget,
        "coef": args.coef,
        "seed": args.seed if result.key is not None else None,
        "rank": args.rank,
        "serving_ranks": args.serving_ranks,
        "positive_only": not args.keep_nonpositive,
        "strict_targets": args.strict_targets,
        "allow_different_base": args.allow_different_base,
        "skip_non_lora": args.skip_non_lora,
        "streamed": hasattr(result.loaded, "read"),
        "chunk_mb": args.chunk_mb,
        "processes": result.processes,
        "keep_shards": getattr(args, "keep_shards", False),
        "weights": None if getattr(args, "weights", None) is None else list(args.weights),
        "min_share": getattr(args, "min_share", None),
        **result.options,
    }


def _plots(
    folder: pathlib.Path, report: Any, m_tasks: int, *, names: Sequence[str] | None = None
) -> None:
    """The merge's plots in ``folder``, the tasks by ``names`` (default ``task 0`` ...)."""
    from . import plots

    folder.mkdir()
    names = [f"task {i}" for i in range(m_tasks)] if names is None else list(names)
    plots.budget_heatmap(report.masks, path=folder / "budget_heatmap.png")
    plots.kept_per_task(report.masks, names, path=folder / "kept_per_task.png")
    if report.scores is not None:
        plots.prefix_retention(report.masks, report.scores, path=folder / "prefix_retention.png")
        plots.utility_distribution(
            report.scores, report.masks, names, path=folder / "utility_distribution.png"
        )


# ------------------------------------------------------------------------------ sharded output


def shard_name(p: int, count: int) -> str:
    """Process ``p``'s shard of ``count`` (Hugging Face's sharded-checkpoint names)."""
    return f"adapter_model-{p + 1:05d}-of-{count:05d}.safetensors"


def uniform_rank(serving_ranks: Any, ranks: Mapping[str, int | None]) -> int | None:
    """``--serving-ranks``' rank for the merged ``ranks`` of every module, as
    :func:`nu.peft.save_adapter` picks it (a rank-0 module is written at rank 1)."""
    from .peft import _write

    allowed = _write._serving_ranks(serving_ranks, fn=f"{PROG} merge") or ()
    top = max(max(1, r or 0) for r in ranks.values())
    fits = [r for r in allowed if r >= top]
    if allowed and not fits:
        raise UsageError(
            f"--serving-ranks: a merged module has rank {top}, above every allowed serving rank "
            f"{allowed}; lower --budget (or --rank) or allow a larger rank."
        )
    return fits[0] if fits else None


def write_shard(
    folder: pathlib.Path, file: str, modules: Mapping[str, Any], args: argparse.Namespace,
    serving: int | None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """``modules`` as PEFT tensors in ``folder/file`` (a temporary file renamed into place),
    converted exactly as :func:`nu.peft.save_adapter` converts them (``--rank``, ``--dtype``,
    zero-padded to ``serving``). Returns ``{"t/<tensor>": bytes, "r/<module>": rank written}``.
    """
    from .peft import _convert, _natural, _write
    from .peft._common import _save_file

    fn = f"{PROG} merge"
    tensors, out = {}, {}
    for name in sorted(modules, key=_natural):
        a, b = _convert._peft_factors(name, modules[name], args.rank, fn=fn)
        if serving is not None:  # (zero directions: the same update)
            pad = serving - len(a)
            a, b = np.pad(a, ((0, pad), (0, 0))), np.pad(b, ((0, 0), (0, pad)))
        out[f"r/{name}"] = np.asarray(len(a), np.int64)
        for key, y in _write._written_tensors(name, a, b, args.dtype, fn=fn).items():
            tensors[key] = y
            out[f"t/{key}"] = np.asarray(y.nbytes, np.int64)
    tmp = folder / f".{file}.tmp"
    try:
        _save_file(tensors, tmp)
        os.replace(tmp, folder / file)
    except OSError as e:
        raise FileAccessError(
            f"--out {args.out}: cannot write the shard {file} in {folder} ({e.strerror or e}); "
            "with --keep-shards every process writes into the output's folder, which they must "
            "all see (a shared filesystem)."
        ) from e
    return out


def write_index(
    folder: pathlib.Path,
    written: Sequence[tuple[str, Mapping[str, Any]]],
    config: Mapping[str, Any],
) -> None:
    """The index ``adapter_model.safetensors.index.json`` (``{"metadata": {"total_size"},
    "weight_map": {tensor: shard}}``) of the shards :func:`write_shard` wrote (``written``:
    ``(file, what it returned)`` per shard), and ``adapter_config.json`` for their ranks
    (:func:`nu.peft.save_adapter`'s config, carrying the source adapters' ``config``)."""
    from .peft import CONFIG_NAME, _natural, _write
    from .peft._read import INDEX_NAME

    files, ranks, total = {}, {}, 0
    for file, got in written:
        for key, v in got.items():
            if key.startswith("t/"):
                files[key[2:]] = file
                total += int(v)
            else:
                ranks[key[2:]] = int(v)
    index = {
        "metadata": {"total_size": total, "format": "pt"},
        "weight_map": dict(sorted(files.items())),
    }
    _io.write_json(folder / INDEX_NAME, index, indent=2)
    cfg = _write._saved_config(config, {}, sorted(ranks, key=_natural), ranks, fn=f"{PROG} merge")
    with _io.atomic_file(folder / CONFIG_NAME, "w") as f:
        f.write(_write._config_text(cfg, fn=f"{PROG} merge"))
