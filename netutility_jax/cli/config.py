"""``netutility merge --config FILE``: a merge described in a YAML or JSON file, and the
configuration a merge records in its report so that it can be replayed.

A config is a mapping. ``adapters`` is a list, each item a path or a mapping ``{path, weight,
name}`` (``weight``: the task's weight, as ``--weights``; ``name``: its name in the plan, the
terminal, the report and the plots). Every other key is one of the merge's flags without its
dashes, ``-`` or ``_`` alike (``method``, ``budget``, ``chunk-mb`` or ``chunk_mb``,
``density``, ``knots-variant`` ...), and its value is checked exactly as the flag's text is (a
flag that takes no value takes ``true`` or ``false``; ``serving-ranks`` and ``weights`` take a
list or a comma string; a ``null`` value is the flag's default). Unknown keys are refused, naming the key. Relative paths
(adapters, ``out``) are relative to the file's folder. Flags given on the command line override
the file; adapters are given in one place, the file or the command line.

A merge report (``netutility_report.json``) is a config too: its ``config`` key holds the
resolved configuration of that merge (absolute paths, every setting but ``out``), which
:func:`recorded_config` writes; the rest of the report is ignored. Replaying it with a new
``--out`` gives the same adapter files bit for bit from the same inputs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from .args import add_merge_arguments
from .common import UsageError, shown

__all__ = ["CONFIG_KEYS", "apply_config", "given_flags", "recorded_config", "resolve"]

# the flags that are about this run, not the merge: given on the command line only, not recorded
_RUN_ONLY = {
    "config": "it names the config",
    "dry_run": "it is about this run",
    "quiet": "it is about this run",
    "no_compile_cache": "it is about this run",
    "distributed": "it is about how this run is split between processes",
    "coordinator": "it is about how this run is split between processes",
    "num_processes": "it is about how this run is split between processes",
    "process_id": "it is about how this run is split between processes",
    "keep_shards": "it is about how this run is split between processes",
}


@functools.cache
def _merge_actions() -> dict[str, argparse.Action]:
    """The ``merge`` arguments by their ``dest``."""
    p = argparse.ArgumentParser(add_help=False)
    add_merge_arguments(p)
    return {a.dest: a for a in p._actions}


def _config_keys() -> tuple[str, ...]:
    """The keys a config may hold besides ``adapters`` (the merge flags' dests)."""
    return tuple(d for d in _merge_actions() if d not in _RUN_ONLY and d != "adapters")


CONFIG_KEYS = _config_keys()
"""The keys of a config besides ``adapters``, as the flags' ``dest`` (``chunk_mb``)."""


def _spelling(dest: str) -> str:
    """How a config (and the report) spells ``dest``: its flag without the dashes
    (``chunk-mb``, ``knots-variant``)."""
    action = _merge_actions().get(dest)
    return _flag(dest, action)[2:]


def _dest_of(key: Any) -> str | None:
    """The ``dest`` a config key names (a flag without dashes, ``-`` or ``_``, or the dest);
    None if none."""
    norm = str(key).replace("-", "_")
    for dest, action in _merge_actions().items():
        names = {dest, *(o.lstrip("-").replace("-", "_") for o in action.option_strings)}
        if norm in names:
            return dest
    return None


def given_flags(argv: list[str]) -> set[str]:
    """The ``dest`` of every ``merge`` argument present in ``argv`` (the arguments after
    ``merge``), however spelled (abbreviations too): argparse itself, with every default
    suppressed, so that only what the command line gave is set."""
    p = argparse.ArgumentParser(add_help=False)
    add_merge_arguments(p)
    for a in p._actions:
        a.default = argparse.SUPPRESS
    ns, _ = p.parse_known_args(argv)
    given = set(vars(ns))
    if not getattr(ns, "adapters", None):
        given.discard("adapters")
    return given


def _read(path: str) -> dict[str, Any]:
    """The config file's mapping (a report's ``config``)."""
    what = f"--config {path}"
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{what}: no such file; give a YAML or JSON merge config.") from None
    except IsADirectoryError:
        raise UsageError(f"{what}: is a folder; give a YAML or JSON merge config file.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{what}: cannot be read ({e}).") from None
    if path.lower().endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"{what}: not valid JSON ({e}).") from None
    else:
        try:
            import yaml
        except ImportError:
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                raise UsageError(
                    f"{what}: reading YAML needs PyYAML (pip install pyyaml); or write the "
                    "config as JSON."
                ) from None
        else:
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise UsageError(f"{what}: not valid YAML ({' '.join(str(e).split())}).") from None
    if isinstance(data, Mapping) and isinstance(data.get("config"), Mapping):
        data = data["config"]  # a netutility_report.json: its recorded configuration
    if not isinstance(data, Mapping):
        raise UsageError(
            f"{what}: holds a {type(data).__name__}; expected a mapping with 'adapters:' and the "
            "merge's flags as keys (method, budget, out, ...)."
        )
    return dict(data)


def _flag(dest: str, action: argparse.Action | None = None) -> str:
    if action is not None and action.option_strings:
        return action.option_strings[0]
    return "--" + dest.replace("_", "-")


def _value(what: str, key: str, action: argparse.Action, value: Any) -> Any:
    """A config value as the flag would parse it (its type, choices, or a bool for a switch)."""
    flag = _flag(action.dest, action)
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise UsageError(
                f"{what}: key {key!r}: expected true or false (the flag {flag}), got "
                f"{shown(str(value))}."
            )
        return value
    if isinstance(value, (list, tuple)) and action.dest in ("serving_ranks", "weights"):
        value = ",".join(str(v) for v in value)
    if isinstance(value, bool) or isinstance(value, (list, tuple, Mapping)):
        raise UsageError(
            f"{what}: key {key!r}: expected a value as {flag} takes, got "
            f"{type(value).__name__} {shown(str(value))}."
        )
    text = str(value)
    if action.type is not None:
        try:
            parsed = action.type(text)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"{what}: key {key!r} ({flag}): {e}.") from None
    else:
        parsed = text
    if action.choices is not None and parsed not in action.choices:
        raise UsageError(
            f"{what}: key {key!r} ({flag}): {shown(text)} is not one of "
            f"{', '.join(map(str, action.choices))}."
        )
    return parsed


def _adapters(what: str, items: Any, folder: pathlib.Path) -> tuple[list[str], list, list, list]:
    """``(paths, weights or None each, names or None each, (text, hub record or None) each)``
    of the config's ``adapters`` (``text``: the path as written, which may be a Hub id)."""
    if isinstance(items, (str, Mapping)) or not isinstance(items, list) or not items:
        raise UsageError(
            f"{what}: 'adapters' must be a non-empty list, each a path or a mapping {{path, "
            "weight, name}}."
        )
    paths, weights, names, refs = [], [], [], []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"path": item}
        if not isinstance(item, Mapping):
            raise UsageError(
                f"{what}: adapters[{i}] is a {type(item).__name__}; expected a path or a "
                "mapping {path, weight, name}."
            )
        extra = sorted(set(item) - {"path", "weight", "name", "hub"})
        if extra:
            raise UsageError(
                f"{what}: adapters[{i}] has the unknown key {extra[0]!r}; an adapter is a "
                "mapping with 'path' and optionally 'weight' and 'name' ('hub' as a report "
                "records it)."
            )
        path = item.get("path")
        if not isinstance(path, str) or not path.strip():
            raise UsageError(
                f"{what}: adapters[{i}] needs 'path', the adapter's folder (or a Hugging Face "
                "Hub id org/name[@revision])."
            )
        paths.append(str(folder / os.path.expanduser(path)))
        refs.append((path, item.get("hub")))
        w = item.get("weight")
        if w is not None and (
            isinstance(w, bool) or not isinstance(w, (int, float)) or w == 0 or w != w
            or w in (float("inf"), float("-inf"))
        ):  # fmt: skip
            raise UsageError(
                f"{what}: adapters[{i}] 'weight' is {shown(str(w))}; expected a finite nonzero "
                "number (the task's update is multiplied by it)."
            )
        weights.append(None if w is None else float(w))
        n = item.get("name")
        if n is not None and (not isinstance(n, str) or not n.strip()):
            raise UsageError(f"{what}: adapters[{i}] 'name' must be a non-empty string.")
        names.append(n)
    return paths, weights, names, refs


def _moments_list(what: str, key: str, value: Any, folder: pathlib.Path) -> tuple[list, list]:
    """``(files or None each, recorded SHA-256 or None each)`` of a config's ``input-moments``:
    a list, each item a file (relative to the config's folder), ``null`` (that task
    data-free), or a report's ``{path, sha256}``."""
    if not isinstance(value, list) or not value:
        raise UsageError(
            f"{what}: key {key!r} (--input-moments): expected a list of files, one per adapter "
            f"(null for a task without data), got {type(value).__name__} {shown(str(value))}."
        )
    files, digests = [], []
    for i, item in enumerate(value):
        sha = None
        if isinstance(item, Mapping):
            if set(item) - {"path", "sha256"} or not isinstance(item.get("path"), str):
                raise UsageError(
                    f"{what}: {key}[{i}] is {shown(str(dict(item)))}; expected a file, null, "
                    "or {path, sha256} as a report records it."
                )
            sha = item.get("sha256")
            if sha is not None and not isinstance(sha, str):
                raise UsageError(f"{what}: {key}[{i}] 'sha256' must be a hex string.")
            item = item["path"]
        if item is None or item == NO_MOMENTS:
            files.append(None)
        elif isinstance(item, str) and item.strip():
            files.append(str(folder / os.path.expanduser(item)))
        else:
            raise UsageError(
                f"{what}: {key}[{i}] is {shown(str(item))}; expected a moments file (.safetensors "
                "or .npz) or null."
            )
        digests.append(sha)
    return files, digests


def apply_config(args: argparse.Namespace, given: set[str]) -> None:
    """Set ``args`` from ``args.config`` where the command line did not give the flag
    (``given``: the flags it gave, :func:`given_flags`)."""
    what = f"--config {args.config}"
    data = _read(args.config)
    folder = pathlib.Path(os.path.abspath(args.config)).parent
    actions = _merge_actions()
    dests = {}
    for key in data:
        dest = _dest_of(key)
        if dest == "adapters":
            continue
        if dest in _RUN_ONLY:
            raise UsageError(
                f"{what}: key {key!r} cannot be in a config ({_RUN_ONLY[dest]}); give "
                f"{_flag(dest, actions.get(dest))} on the command line."
            )
        if dest not in CONFIG_KEYS:
            raise UsageError(
                f"{what}: unknown key {key!r}; a config has 'adapters' and the merge's flags "
                f"without dashes: {', '.join(_spelling(k) for k in CONFIG_KEYS)}."
            )
        if dest in dests.values():
            raise UsageError(f"{what}: {_spelling(dest)!r} is given twice (as {key!r} too).")
        dests[key] = dest
    if "adapters" in data and "adapters" in given:
        raise UsageError(
            f"{what}: adapters are given both in the config and on the command line; give them "
            "in one place."
        )
    if "adapters" in data:
        paths, weights, names, refs = _adapters(what, data["adapters"], folder)
        args.adapters = paths
        args.adapter_refs = refs
        if any(w is not None for w in weights):
            if "weights" in data:
                raise UsageError(
                    f"{what}: weights are given both per adapter and as 'weights'; give them in "
                    "one place."
                )
            if "weights" not in given:
                args.weights = tuple(1.0 if w is None else w for w in weights)
        if any(n is not None for n in names):
            args.names = names
    for key, value in data.items():
        dest = dests.get(key, "adapters")
        if dest == "adapters" or dest in given or value is None:
            continue
        if dest == "input_moments":
            args.input_moments, args.input_moments_recorded = _moments_list(
                what, str(key), value, folder
            )
            continue
        parsed = _value(what, str(key), actions[dest], value)
        if dest == "out":
            parsed = str(folder / os.path.expanduser(parsed))
        setattr(args, dest, parsed)


def resolve(args: argparse.Namespace) -> None:
    """The merge's arguments completed and checked before anything is read: ``--config``
    applied, adapters and ``--out`` present, ``--budget`` where the allocation needs it,
    ``--weights`` one per adapter, ``--min-share`` with net_utility; ``args.names`` the tasks'
    names (the config's, else :func:`nu.planning.task_names` of the folders)."""
    from ..planning import task_names

    args.names = getattr(args, "names", None)
    if getattr(args, "config", None) is not None:
        apply_config(args, given_flags(_after(args)))
    if not args.adapters:
        raise UsageError(
            "no adapters: give the adapter folders (ADAPTER_DIR ...) or a --config with "
            "'adapters:'."
        )
    if args.out is None and not args.dry_run:
        raise UsageError("--out OUT_DIR is required (or 'out:' in --config), unless --dry-run.")
    if args.budget is None and args.allocation != "all":
        raise UsageError(
            f"--budget is required with --allocation {args.allocation} (the average number of "
            "kept directions per module, e.g. --budget 16); only --allocation all needs none."
        )
    if args.allocation == "all":
        args.budget = None  # (every direction is kept: a budget means nothing, and is ignored)
    if args.weights is not None and len(args.weights) != len(args.adapters):
        raise UsageError(
            f"--weights has {len(args.weights)} values for {len(args.adapters)} adapters; give "
            "one per adapter, in order."
        )
    if args.min_share is not None and args.allocation != "net_utility":
        raise UsageError(
            f"--min-share applies to --allocation net_utility (which moves the budget between "
            f"tasks), not {args.allocation}; drop it."
        )
    labels = _resolve_adapters(args)
    _check_moments(args)
    derived = task_names(labels)
    if args.names is None:
        args.names = derived
    else:
        args.names = [n if n is not None else d for n, d in zip(args.names, derived, strict=True)]
        if len(set(args.names)) != len(args.names):
            raise UsageError(
                f"--config {args.config}: two adapters have the same name; give each a distinct "
                "'name'."
            )


def _resolve_adapters(args: argparse.Namespace) -> list[str]:
    """``args.adapters`` as folders to read: Hugging Face Hub ids resolved to their snapshot
    folders in the Hub cache (:func:`.paths.resolve_adapter`; a local folder of the same name
    wins). Returns what names each task (the path, or the Hub id)."""
    from .paths import resolve_adapter

    refs = getattr(args, "adapter_refs", None)
    if refs is None:  # (from the command line: the path is the text)
        refs = [(p, None) for p in args.adapters]
        where = ["ADAPTER_DIR"] * len(refs)
    else:
        where = [f"--config {args.config}: adapters[{i}]" for i in range(len(refs))]
    resolved = [
        resolve_adapter(text, local=path, what=f"{w} {text}", pinned=pinned)
        for path, (text, pinned), w in zip(args.adapters, refs, where, strict=True)
    ]
    args.adapters = [r.path for r in resolved]
    return [r.label for r in resolved]


NO_MOMENTS = "none"
"""The ``--input-moments`` argument that stands for a task without data (the data-free
geometry for it); a file of that name is given as ``./none``."""

_MOMENTS_SUFFIXES = (".safetensors", ".npz")


def _digest(path: str, what: str) -> str:
    """The SHA-256 of the file at ``path`` (read in blocks), its errors in the flag's terms."""
    import hashlib

    from ..errors import FileAccessError, MissingFileError

    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    except (FileNotFoundError, NotADirectoryError):
        raise MissingFileError(
            f"{what}: no such file; give one moments file per adapter, in order "
            f"(nu.save_input_moments writes them; '{NO_MOMENTS}' for a task without data)."
        ) from None
    except IsADirectoryError:
        raise UsageError(f"{what}: is a folder; expected a .safetensors or .npz file.") from None
    except PermissionError:
        raise FileAccessError(f"{what}: cannot be read (permission denied).") from None
    except OSError as e:
        raise FileAccessError(f"{what}: cannot be read ({e.strerror or e}).") from None
    return h.hexdigest()


def _check_moments(args: argparse.Namespace) -> None:
    """``--input-moments``: one file per adapter (or ``none``), with net_utility, each a
    readable ``.safetensors`` or ``.npz`` whose SHA-256 the
    merge's reading must match (and a replayed report's recorded one, if any):
    ``args.input_moments`` becomes a :class:`.job.MomentsFile` (or None) per adapter. The files'
    contents are checked against the adapters once those are open (:func:`.load.load_moments`)."""
    from .job import MomentsFile

    files = getattr(args, "input_moments", None)
    if files is None:
        return
    files = [None if f is None or f == NO_MOMENTS else f for f in files]
    if args.allocation != "net_utility":
        raise UsageError(
            f"--input-moments applies to --allocation net_utility (the scores use them); "
            f"--allocation {args.allocation} scores nothing. Drop one of them."
        )
    if len(files) != len(args.adapters):
        raise UsageError(
            f"--input-moments has {len(files)} file{'s' if len(files) != 1 else ''} for "
            f"{len(args.adapters)} adapters; give one per adapter, in the adapters' order "
            f"('{NO_MOMENTS}' for a task without data)."
        )
    if all(f is None for f in files):
        raise UsageError(
            f"--input-moments: every entry is '{NO_MOMENTS}'; drop the flag for the data-free merge."
        )
    recorded = getattr(args, "input_moments_recorded", None) or [None] * len(files)
    digests = []
    for f, want in zip(files, recorded, strict=True):
        if f is None:
            digests.append(None)
            continue
        what = f"--input-moments {f}"
        if not f.lower().endswith(_MOMENTS_SUFFIXES):
            raise UsageError(
                f"{what}: expected a .safetensors or .npz file of input second moments "
                "(docs/input_moments.md; nu.save_input_moments writes one)."
            )
        sha = _digest(f, what)
        if want is not None and want != sha:
            raise UsageError(
                f"{what}: its SHA-256 is {sha[:16]}..., not {want[:16]}... as the config "
                "records: the file changed since that merge; give the recorded file or drop "
                "its 'sha256'."
            )
        digests.append(MomentsFile(f, sha))
    args.input_moments = digests


def _after(args: argparse.Namespace) -> list[str]:
    """The command line's arguments after ``merge`` (``args.argv``, as :func:`cli.main` keeps
    it), or none."""
    argv = list(getattr(args, "argv", None) or [])
    return argv[argv.index("merge") + 1 :] if "merge" in argv else argv


def recorded_config(args: argparse.Namespace, options: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved configuration of this merge, for the report: every setting (the merge's
    flags, spelled as the flags without dashes; ``options``: the method's and space's options
    with their defaults) and the adapters with absolute paths, weights and names, so that
    ``--config`` of it with a new ``--out`` replays the merge (``out`` is not recorded: the
    output folder of a replay is new). An adapter read from a snapshot folder of the Hugging
    Face Hub cache also records its Hub id and commit (``hub``); ``input-moments`` records each
    file's absolute path and SHA-256 (None for a task without data)."""
    from .. import hub

    weights = args.weights or (1.0,) * len(args.adapters)
    adapters = []
    for p, w, n in zip(args.adapters, weights, args.names, strict=True):
        item: dict[str, Any] = {"path": os.path.abspath(p), "weight": float(w), "name": n}
        snapshot = hub.from_snapshot(item["path"])
        if snapshot is not None:  # (a replay reads the folder, or id@commit if it is gone)
            item["hub"] = {"id": snapshot.repo_id, "commit": snapshot.commit}
        adapters.append(item)
    out: dict[str, Any] = {"adapters": adapters}
    for dest in CONFIG_KEYS:
        if dest in ("weights", "out"):  # (the weights are the adapters'; a replay needs --out)
            continue
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest == "input_moments":
            value = [
                None if f is None else {"path": os.path.abspath(f.path), "sha256": f.sha256}
                for f in value
            ]
        if isinstance(value, tuple):
            value = list(value)
        out[_spelling(dest)] = value
    for name, value in options.items():
        out[_spelling(name)] = value
    return out
