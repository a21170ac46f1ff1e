"""The file-system checks of ``netutility merge``, ``inspect`` and ``convert``, and their staging
folders.

An ``ADAPTER_DIR`` that names nothing on disk but is spelled as a Hugging Face Hub id
(``org/name[@revision]``) is resolved to its snapshot folder in the Hub cache first
(:func:`resolve_adapter`, :func:`nu.hub.resolve`); a local file or folder of that name wins.
Before any adapter is loaded, the ``ADAPTER_DIR`` folders and ``--out`` are checked
(:func:`check_adapter_dir`, :func:`check_out`), the output's size is estimated from the inputs'
safetensors headers (:func:`estimate_out_bytes`, from :func:`nu.peft.weight_shapes`) and held
against the free space (:func:`check_space`). An output is assembled in a staging folder beside
it (:func:`staging_name`) and renamed into place; a command killed while writing leaves one
behind, and the next one into the same parent folder removes those whose process is gone
(:func:`clean_stale_staging`, :func:`clean_staging`). ``netutility convert`` checks its
``OUT_FOLDER`` (:func:`check_convert_out`) and writes it the same way (:func:`write_folder`),
replacing an earlier adapter folder only once the new one is complete.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from .._core import io as _io
from .._core.checks import size_text
from ..errors import FileAccessError, InputError, MissingFileError, NetUtilityError
from ..folders import FACTOR_KEY, STAGING_TAG, staging_name
from .common import PROG, UsageError, say, shown

__all__ = [
    "FACTOR_KEY",
    "OUT_MARGIN",
    "STAGING_TAG",
    "AdapterArg",
    "SizeEstimate",
    "check_adapter_dir",
    "check_convert_out",
    "check_out",
    "check_space",
    "clean_staging",
    "clean_stale_staging",
    "estimate_out_bytes",
    "resolve_adapter",
    "staging_dir",
    "staging_name",
    "stat_of",
    "write_folder",
]


def _user_path(text: str, what: str) -> pathlib.Path:
    if not text.strip():  # (pathlib would read "" as ".")
        raise UsageError(f"{what} is an empty path; give a folder")
    if "\0" in text:
        raise UsageError(f"{what} {shown(text)} contains a NUL character")
    return pathlib.Path(text)


def stat_of(path: pathlib.Path, what: str, *, follow: bool = True) -> os.stat_result | None:
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
        st = stat_of(path, what)
        if st is not None or path == path.parent:
            return path, st  # type: ignore[return-value]  # ("/" and "." exist)
        path = path.parent


def _writable_parent(path: pathlib.Path, what: str) -> pathlib.Path:
    """The nearest existing folder above ``path``, which a new folder at ``path`` is made in:
    refused if it is a file or cannot be written in."""
    anc, st = _nearest_existing(path.parent, what)
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{what}: {anc} is a file, not a folder; choose a path in a folder.")
    # (root passes this check for any folder: root may write anywhere)
    if not os.access(anc, os.W_OK | os.X_OK):
        raise FileAccessError(
            f"{what}: cannot write in {anc} (permission denied); choose a writable folder."
        )
    return anc


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
    from .. import peft

    what = f"adapter folder {text}"
    expected = (
        f"a PEFT adapter folder holding {peft.CONFIG_NAME} and {peft.WEIGHTS_NAME} (as "
        "PeftModel.save_pretrained writes)"
    )
    path = _user_path(text, "ADAPTER_DIR")
    st = stat_of(path, what)
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
        fst = stat_of(f, what)
        if fst is None and name == peft.WEIGHTS_NAME:
            if stat_of(path / peft.PICKLE_NAME, what) is not None:
                continue  # the loader reads it (torch's zip format, nothing in it run)
            if stat_of(path / peft.INDEX_NAME, what) is not None:
                continue  # sharded (netutility merge --keep-shards): the loader checks it
        if fst is None:
            raise MissingFileError(f"{what} has no {name}; expected {expected}")
        if stat.S_ISDIR(fst.st_mode):
            raise MissingFileError(f"{f} is a folder; expected the file {name} of {expected}")
        if not os.access(f, os.R_OK):
            raise FileAccessError(f"{f} cannot be read (permission denied)")
    return path


class AdapterArg(NamedTuple):
    """An ``ADAPTER_DIR`` argument resolved (:func:`resolve_adapter`)."""

    path: str  # the folder to read: as given, or the Hub snapshot's
    hub: Any  # the nu.hub.HubAdapter it came from, or None (a local folder)
    label: str  # what names its task: the path as given, or the Hub id


def resolve_adapter(
    text: str,
    *,
    local: str | None = None,
    what: str | None = None,
    pinned: Mapping[str, Any] | None = None,
) -> AdapterArg:
    """An ``ADAPTER_DIR`` argument as a folder to read.

    ``local`` (default ``text``; a config's path joined to its folder) is used if anything
    exists there: a local folder wins over a Hub id of the same spelling. Otherwise, if
    ``text`` is spelled as a Hugging Face Hub id (``org/name`` or ``org/name@revision``), it is
    resolved through ``huggingface_hub`` (:func:`nu.hub.resolve`: the cache, and the Hub unless
    offline). ``pinned`` (a replayed report's ``{"id", "commit"}``) resolves
    ``id@commit`` where ``local``, the snapshot folder it recorded, is gone. Anything else is
    returned as it is, for :func:`check_adapter_dir` to refuse.

    Raises:
      InputError, MissingFileError: as :func:`nu.hub.resolve` (huggingface_hub missing, the id
        not in the cache while offline...), naming ``what`` (default ``ADAPTER_DIR <text>``).
      UsageError: a ``pinned`` record that is not ``{"id", "commit"}``.
    """
    from .. import hub

    local = text if local is None else local
    what = what or f"ADAPTER_DIR {text}"
    if pinned is not None:
        ok = isinstance(pinned, Mapping) and all(
            isinstance(pinned.get(k), str) for k in ("id", "commit")
        )
        if not ok or hub.parse_id(f"{pinned['id']}@{pinned['commit']}") is None:
            raise UsageError(
                f"{what}: its 'hub' record is {shown(str(pinned))}; expected {{id: org/name, "
                "commit: ...}} as a merge report writes it (or drop it)."
            )
        if not os.path.lexists(local):  # (the recorded snapshot is gone: the id at its commit)
            got = hub.resolve(f"{pinned['id']}@{pinned['commit']}", what=what)
            return AdapterArg(got.path, got, pinned["id"])
        return AdapterArg(local, hub.from_snapshot(local), pinned["id"])
    if os.path.lexists(local):
        return AdapterArg(local, None, local)
    problem = hub.id_problem(text)
    if problem is not None:
        raise InputError(
            f"{what}: not a local folder ({os.path.abspath(local)}), and not a well-formed "
            f"Hugging Face Hub id: {problem}; give org/name or org/name@revision (a branch, tag "
            "or commit), or a local folder."
        )
    if hub.parse_id(text) is None:
        return AdapterArg(local, None, local)
    if local != text:  # (a config's path, joined to its folder: say where it was looked for)
        what = f"{what} ({os.path.abspath(local)})"
    got = hub.resolve(text, what=what)
    return AdapterArg(got.path, got, text)


def check_out(out: str, inputs: Sequence[str]) -> tuple[pathlib.Path, pathlib.Path]:
    """Refuse an ``--out`` that cannot receive the merge, before anything is loaded.

    Returns:
      ``(out as a path, its nearest existing ancestor folder)``.
    """
    path = _user_path(out, "--out")
    if stat_of(path, f"--out {out}", follow=False) is not None:
        raise UsageError(
            f"--out {out}: already exists; choose a new folder (nothing is overwritten)."
        )
    res = _resolve(path, f"--out {out}")
    for inp in inputs:
        ri = _resolve(pathlib.Path(inp), f"adapter folder {inp}")
        if res == ri or ri in res.parents:
            raise UsageError(f"--out {out}: inside input adapter {inp}; write the merge elsewhere.")
    return path, _writable_parent(path, f"--out {out}")


def check_convert_out(text: str, src: str, *, overwrite: bool) -> tuple[pathlib.Path, bool]:
    """Refuse an ``OUT_FOLDER`` that ``netutility convert`` cannot write, before anything is read.

    ``OUT_FOLDER`` may be missing or an empty folder; a folder with files is replaced only with
    ``overwrite``, and only if it is an adapter folder (it holds ``adapter_config.json``: an
    earlier conversion, say), never another folder. It may not be ``src``, inside it, or hold it.

    Returns:
      ``(OUT_FOLDER as a path, whether a folder with files is there to be replaced)``.
    """
    from .. import peft

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
    st = stat_of(path, what, follow=False)
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
    _writable_parent(path, what)
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
                    if stat_of(out, what, follow=False) is None:
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
            m = FACTOR_KEY.search(key)
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
        from .. import peft

        allowed = peft.serving_ranks(serving_ranks, fn=f"{PROG} merge")
        top = next((r for r in allowed if r >= top), top)  # (none fits: refused after merging)
        ranks = dict.fromkeys(ranks, top)
    total = OUT_MARGIN
    for name, (_, d_in, d_out) in modules.items():
        total += ranks[name] * (d_in + d_out) * itemsize + 512  # (+ two tensors' header entries)
    return SizeEstimate(total, len(modules), top)


def check_space(out: str, folder: pathlib.Path, est: SizeEstimate, dtype: str) -> None:
    try:
        free = shutil.disk_usage(folder).free
    except OSError:  # (no statvfs here: nothing to check)
        return
    if est.bytes > free:
        raise UsageError(
            f"--out {out}: not enough free space in {folder}: the merge needs about "
            f"{size_text(est.bytes)} (estimated from the inputs: {est.modules} modules at rank up to "
            f"{est.rank} in {dtype}, plus the report and plots) but {size_text(free)} is free; free "
            "some space or choose another --out."
        )


_STAGING = re.compile(
    rf"\.(?P<name>.+)\.{STAGING_TAG}-(?P<host>[A-Za-z0-9]+)-(?P<pid>[1-9][0-9]*)-[0-9a-f]{{8}}"
)


def staging_dir(out: pathlib.Path) -> pathlib.Path:
    """Create the folder the merge is assembled in, beside ``out`` (:func:`staging_name`)."""
    while True:
        path = staging_name(out)
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path


def clean_stale_staging(folder: pathlib.Path) -> list[pathlib.Path]:
    """Remove the staging folders that killed merges left in ``folder``; return them.

    Only folders (not symlinks) whose name matches the staging pattern exactly, made on this host
    by a process that no longer exists, owned by the current user, are removed. A live process's
    folder is never touched (a reused pid keeps a stale folder, never the reverse).
    """
    return _io.remove_stale(folder, ((_STAGING, True),))


def clean_staging(folder: pathlib.Path, command: str = "merge") -> None:
    """Remove the staging folders killed merges left in ``folder``, saying so on stderr."""
    removed = clean_stale_staging(folder)
    if removed:
        names = ", ".join(p.name for p in removed[:3])
        more = f" and {len(removed) - 3} more" if len(removed) > 3 else ""
        say(
            command,
            "note",
            f"removed {len(removed)} stale staging folder{'s' if len(removed) > 1 else ''} "
            f"left in {folder} by killed merges (their processes are gone): {names}{more}",
        )
