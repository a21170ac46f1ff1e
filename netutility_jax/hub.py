"""PEFT adapters named by Hugging Face Hub ids: ``org/name`` or ``org/name@revision``.

:func:`resolve` turns such an id into a local folder through ``huggingface_hub`` (an optional
dependency): :func:`huggingface_hub.snapshot_download` of the adapter's files only
(:data:`ADAPTER_PATTERNS`), from its cache when the files are there; offline
(``HF_HUB_OFFLINE=1``, or ``local_files_only=True``) nothing else is tried. The folder is a
snapshot of the repository at one commit (``.../models--org--name/snapshots/<commit>``), which
:func:`nu.peft.load_adapter` and :func:`nu.peft.open_adapters` read as any adapter folder;
:class:`HubAdapter` says which id, revision and commit it is.

``netutility merge`` and ``inspect`` resolve an ``ADAPTER_DIR`` argument (and a config's
adapter path) this way when no local file or folder of that name exists: a local folder wins
over a Hub id of the same spelling.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any, NamedTuple

from .errors import InputError, MissingFileError

__all__ = [
    "ADAPTER_PATTERNS",
    "HubAdapter",
    "from_snapshot",
    "id_problem",
    "offline",
    "parse_id",
    "resolve",
]


ADAPTER_PATTERNS = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model-*.safetensors",
    "adapter_model.safetensors.index.json",
    "adapter_model.bin",
)
"""The files of a PEFT adapter repository that :func:`resolve` fetches (``allow_patterns``): the
config and the weights (safetensors, sharded safetensors with their index, or the pickled
``adapter_model.bin``), nothing else (no base model, no tokenizer)."""


class HubAdapter(NamedTuple):
    """A Hub id resolved to a local snapshot folder.

    Attributes:
      path: the snapshot folder holding the adapter's files (in the Hub cache).
      repo_id: ``org/name``.
      revision: the revision asked for (``"main"`` when none was given).
      commit: the commit hash the snapshot is of (its folder's name in the cache).
    """

    path: str
    repo_id: str
    revision: str
    commit: str

    @property
    def ref(self) -> str:
        """``org/name@<commit>``: the id pinned to the commit (resolves to the same files)."""
        return f"{self.repo_id}@{self.commit}"


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_DEFAULT_REVISION = "main"


def parse_id(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision or None)`` if ``text`` is spelled as a Hub model id ``org/name`` or
    ``org/name@revision``, else None (the Hub's rules: two names of letters, digits, ``.``,
    ``_`` and ``-``, neither ``--`` nor ``..``, at most 96 characters).

    Example:
      >>> parse_id("org/name@v1.0"), parse_id("org/name"), parse_id("./adapters/a"), parse_id("a")
      (('org/name', 'v1.0'), ('org/name', None), None, None)
    """
    if not isinstance(text, str):
        return None
    repo, at, rev = text.partition("@")
    if at and (not rev or any(c.isspace() or c == "\0" for c in rev)):
        return None
    parts = repo.split("/")
    if len(parts) != 2 or len(repo) > 96 or "--" in repo or ".." in repo:
        return None
    if not all(_NAME.fullmatch(p) and not p.endswith((".", "-")) for p in parts):
        return None
    return repo, (rev or None)


def id_problem(text: str) -> str | None:
    """Why ``text``, spelled as a Hub id ``org/name@revision`` but for its revision, is not
    one (an empty revision, or one with a space); None for a well-formed id or anything else.

    Example:
      >>> id_problem("org/name@"), id_problem("org/name@v1"), id_problem("./a@b")
      ("the revision after '@' is empty", None, None)
    """
    if not isinstance(text, str) or "@" not in text:
        return None
    repo, _, rev = text.partition("@")
    if parse_id(repo) is None:
        return None
    if not rev:
        return "the revision after '@' is empty"
    if any(c.isspace() or c == "\0" for c in rev):
        return f"the revision after '@' ({rev!r}) holds a space or a NUL character"
    return None


def from_snapshot(path: str | os.PathLike) -> HubAdapter | None:
    """The Hub id and commit of a snapshot folder of the Hub cache
    (``.../models--org--name/snapshots/<commit>``, as :func:`resolve` returns), read from the
    path alone; None for any other folder. (``revision`` is then the commit: which branch or
    tag led there is not in the path.)

    Example:
      >>> from_snapshot("/c/hub/models--org--name/snapshots/" + "ab" * 20).repo_id
      'org/name'
      >>> from_snapshot("/data/adapters/task0") is None
      True
    """
    p = pathlib.PurePath(os.fspath(path))
    if len(p.parts) < 3 or p.parent.name != "snapshots" or not _COMMIT.fullmatch(p.name):
        return None
    repo = p.parent.parent.name
    if not repo.startswith("models--"):
        return None
    repo_id = repo[len("models--") :].replace("--", "/")
    if parse_id(repo_id) is None:
        return None
    return HubAdapter(os.fspath(path), repo_id, p.name, p.name)


def _true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """Whether the Hub is off limits: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set,
    read when called (``huggingface_hub`` reads it once, at its import)."""
    if _true("HF_HUB_OFFLINE") or _true("TRANSFORMERS_OFFLINE"):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _cache_dir(cache_dir: Any) -> str:
    if cache_dir is not None:
        return os.fspath(cache_dir)
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve(
    ref: str,
    *,
    local_files_only: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    what: str | None = None,
) -> HubAdapter:
    """The local snapshot folder of the PEFT adapter at Hub id ``ref`` (``org/name[@revision]``).

    Calls ``huggingface_hub.snapshot_download(repo_id, revision=..., allow_patterns=
    ADAPTER_PATTERNS)``: the files come from the cache when they are there, else from the Hub.
    Offline, only the cache is read.

    Args:
      ref: ``org/name`` or ``org/name@revision`` (a branch, tag or commit hash).
      local_files_only: read only the cache. Default: :func:`offline` (``HF_HUB_OFFLINE``).
      cache_dir: the Hub cache folder. Default: huggingface_hub's (``HF_HUB_CACHE``, or
        ``HF_HOME/hub``, or ``~/.cache/huggingface/hub``).
      what: how messages name ``ref`` (default ``nu.hub.resolve('<ref>')``).

    Returns:
      A :class:`HubAdapter`: its ``path`` holds ``adapter_config.json`` and the weights.

    Raises:
      InputError: ``ref`` is not a Hub id; huggingface_hub is not installed.
      MissingFileError: not in the cache while offline; no such repository or revision (or
        the Hub cannot be reached and the cache lacks it); the repository holds no
        ``adapter_config.json``.
    """
    what = what or f"nu.hub.resolve({ref!r})"
    parsed = parse_id(ref)
    if parsed is None:
        raise InputError(
            f"{what}: not a Hugging Face Hub model id; expected org/name or org/name@revision."
        )
    repo_id, revision = parsed
    try:
        import huggingface_hub
        from huggingface_hub import utils as hf_utils
    except ImportError:
        raise InputError(
            f"{what}: not a local folder, and resolving it as a Hugging Face Hub id needs "
            "huggingface_hub: pip install huggingface_hub (or give the adapter's local folder)."
        ) from None
    local = offline() if local_files_only is None else bool(local_files_only)
    rev = revision or _DEFAULT_REVISION
    at = f" at revision {rev}" if revision else ""
    cache = _cache_dir(cache_dir)

    def err(name: str) -> type[BaseException]:
        return getattr(hf_utils, name, None) or type(f"_Absent{name}", (Exception,), {})

    try:
        path = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=list(ADAPTER_PATTERNS),
            local_files_only=local, cache_dir=cache_dir,
        )  # fmt: skip
    except err("RevisionNotFoundError"):
        raise MissingFileError(
            f"{what}: not a local folder, and the Hugging Face Hub repository {repo_id} has no "
            f"revision {rev}; give a branch, tag or commit it has."
        ) from None
    except (err("RepositoryNotFoundError"), err("GatedRepoError")):
        raise MissingFileError(
            f"{what}: not a local folder, and the Hugging Face Hub has no repository {repo_id} "
            "that this machine may read (a typo, or a private or gated one: log in with "
            "`hf auth login` or set HF_TOKEN)."
        ) from None
    except err("IncompleteSnapshotError") as e:
        raise MissingFileError(
            f"{what}: the cached snapshot of {repo_id}{at} in {cache} is incomplete and the Hub "
            f"cannot be reached ({' '.join(str(e).split())[:300]})."
        ) from None
    except (err("LocalEntryNotFoundError"), err("OfflineModeIsEnabled")):
        why = (
            "and the Hub cannot be reached"
            if not local
            else "with local_files_only=True"
            if local_files_only
            else "while offline (HF_HUB_OFFLINE is set; unset it to download)"
        )
        raise MissingFileError(
            f"{what}: not a local folder, and the Hugging Face Hub id {repo_id}{at} is not in "
            f"the cache ({cache}) {why}; download it first (hf download {repo_id}"
            f"{f' --revision {revision}' if revision else ''}) or give a local folder."
        ) from None
    except (OSError, ValueError, err("HfHubHTTPError")) as e:
        raise MissingFileError(
            f"{what}: not a local folder, and fetching the Hugging Face Hub id {repo_id}{at} "
            f"failed ({type(e).__name__}: {' '.join(str(e).split())[:300]})."
        ) from None
    snap = pathlib.Path(path)
    commit = snap.name if _COMMIT.fullmatch(snap.name) else (revision or "")
    if not (snap / "adapter_config.json").is_file():
        raise MissingFileError(
            f"{what}: the Hugging Face Hub repository {repo_id}{at} (commit {commit or '?'}) "
            "holds no adapter_config.json: not a PEFT adapter (give the repository of the "
            "adapter, not of its base model)."
        )
    return HubAdapter(str(snap), repo_id, rev, commit)
