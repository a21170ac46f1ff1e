"""A merge's input files pinned by their SHA-256 before anything is read: the adapter folders'
digests (:func:`take_digests`, which :func:`nu.merge_folders` checks again once the merge is
done), the input moments files (:func:`pin_moments`), and a replayed report's recorded digests
and version checked against them (:func:`check_replay`; ``--allow-changed`` makes each
difference a warning)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..folders import MomentsFile, adapter_digest, file_digest
from .common import UsageError, reading, say

__all__ = ["NO_MOMENTS", "check_replay", "pin_moments", "take_digests", "taken_digests"]

NO_MOMENTS = "none"
"""The ``--input-moments`` argument that stands for a task without data (the data-free
geometry for it); a file of that name is given as ``./none``."""

_MOMENTS_SUFFIXES = (".safetensors", ".npz")

_DIGESTS: dict[str, str] = {}
"""Each adapter folder's digest as :func:`take_digests` took it before the merge read the folder
(by absolute path; this process's latest merge): :func:`nu.merge_folders` takes it again once
the merge is done and refuses a folder that changed in between, so that the report's digest is
of the files the merge read (without reading them again where their identities show no change:
:func:`nu.folders.adapter_digest`)."""


def taken_digests(paths: Sequence[str]) -> list[str | None]:
    """The digests :func:`take_digests` took of the adapter folders ``paths`` (None where it
    could not: the merge's own checks refuse such a folder)."""
    return [_DIGESTS.get(os.path.abspath(p)) for p in paths]


def take_digests(adapters: Sequence[str], names: Sequence[str], taken: dict[str, str]) -> None:
    """Each adapter folder's digest, kept for :func:`taken_digests` (``taken``: those a replay's
    check took already, by absolute path)."""
    from ..errors import NetUtilityError

    for path, name in zip(adapters, names, strict=True):
        key = os.path.abspath(path)
        _DIGESTS.pop(key, None)
        try:
            _DIGESTS[key] = taken.get(key) or adapter_digest(path, f"adapter {name}")
        except NetUtilityError:  # (not a readable folder: the merge's own checks say so, in
            pass  # every process of a distributed run alike)


def check_replay(
    what: str,
    adapters: Sequence[str],
    names: Sequence[str] | None,
    recorded: Sequence[str | None] | None,
    version: str | None,
    *,
    allow_changed: bool,
) -> dict[str, str]:
    """A replayed report's inputs as it recorded them (``what``: the ``--config`` it came
    from): the library version that wrote it, and each adapter's digest
    (:func:`adapter_digest`; the input moments' are checked by :func:`pin_moments`). A
    difference is refused naming it, or, with ``allow_changed``, said as a warning. Returns the
    digests it took, by absolute path."""
    from .. import __version__

    changes, taken = [], {}
    if version is not None and version != __version__:
        changes.append(
            f"the report was written by netutility-jax {version}, this is {__version__} (the "
            "merge may differ)"
        )
    for i, (path, want) in enumerate(
        zip(adapters, recorded or [None] * len(adapters), strict=True)
    ):
        if want is None or not os.path.isdir(path):  # (a folder that is gone: the merge's
            continue  # own checks refuse it, as they do without a report)
        sha = taken[os.path.abspath(path)] = adapter_digest(path, f"{what}: adapters[{i}]")
        if sha != want:
            changes.append(
                f"adapters[{i}] ({names[i] if names else path}) at {path} has changed "
                f"since that merge (SHA-256 of its files {sha[:16]}..., recorded {want[:16]}...)"
            )
    if not changes:
        return taken
    if not allow_changed:
        raise UsageError(
            f"{what}: {'; '.join(changes)}; the replay would not be that merge. Pass "
            "--allow-changed to merge the inputs as they are now."
        )
    for line in changes:
        say("merge", "warning", f"{what}: {line} (--allow-changed: merging them as they are)")
    return taken


def _digest(path: str, what: str) -> str:
    """The SHA-256 of the file at ``path`` (:func:`nu.folders.file_digest`), its errors in the
    flag's terms."""
    with reading(
        what,
        missing="give one moments file per adapter, in order (nu.moments.save_input_moments "
        f"writes them; '{NO_MOMENTS}' for a task without data).",
        folder="expected a .safetensors or .npz file.",
    ):
        return file_digest(path)


def pin_moments(
    files: Sequence[str | None] | None,
    recorded: Sequence[str | None] | None,
    *,
    allocation: str,
    adapters: int,
    allow_changed: bool,
) -> list[MomentsFile | None] | None:
    """``--input-moments``: one file per adapter (or ``none``), with net_utility, each a
    readable ``.safetensors`` or ``.npz`` whose SHA-256 the merge's reading must match (and a
    replayed report's ``recorded`` one, if any): a :class:`MomentsFile` (or None) per adapter.
    The files' contents are checked against the adapters once those are open
    (:func:`nu.folders.read_moments`)."""
    if files is None:
        return None
    files = [None if f is None or f == NO_MOMENTS else f for f in files]
    if allocation != "net_utility":
        raise UsageError(
            f"--input-moments applies to --allocation net_utility (the scores use them); "
            f"--allocation {allocation} scores nothing. Drop one of them."
        )
    if len(files) != adapters:
        raise UsageError(
            f"--input-moments has {len(files)} file{'s' if len(files) != 1 else ''} for "
            f"{adapters} adapters; give one per adapter, in the adapters' order "
            f"('{NO_MOMENTS}' for a task without data)."
        )
    if all(f is None for f in files):
        raise UsageError(
            f"--input-moments: every entry is '{NO_MOMENTS}'; drop the flag for the data-free merge."
        )
    return [
        None if f is None else _pin(f, want, allow_changed)
        for f, want in zip(files, recorded or [None] * len(files), strict=True)
    ]


def _pin(path: str, want: str | None, allow_changed: bool) -> MomentsFile:
    """One moments file with its SHA-256, checked against a replay's ``want``."""
    what = f"--input-moments {path}"
    if not path.lower().endswith(_MOMENTS_SUFFIXES):
        raise UsageError(
            f"{what}: expected a .safetensors or .npz file of input second moments "
            "(docs/input_moments.md; nu.moments.save_input_moments writes one)."
        )
    sha = _digest(path, what)
    if want is not None and want != sha:
        change = (
            f"{what}: its SHA-256 is {sha[:16]}..., not {want[:16]}... as the config "
            "records: the file changed since that merge"
        )
        if not allow_changed:
            raise UsageError(
                f"{change}; give the recorded file, drop its 'sha256', or pass "
                "--allow-changed to merge it as it is now."
            )
        say("merge", "warning", f"{change} (--allow-changed: merging it as it is)")
    return MomentsFile(path, sha)
