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

A merge report (``netutility_report.json``, a file with ``netutility_version``) is a config too:
its ``config`` key holds the resolved configuration of that merge (absolute paths, every setting
but ``out``, each adapter's digest: ``nu.MergeConfig.to_dict`` beside the adapters), which
:func:`nu.merge_folders` writes; the rest of the report
is ignored. Replaying it with a new ``--out`` gives the same adapter files bit for bit from the
same inputs; a replay whose adapters or moments files differ from the digests recorded, or that
runs under another library version, is refused unless ``--allow-changed``
(:func:`.digests.check_replay`).

The file is read by :func:`.configfile.read_config`, a bounded, strict reader of JSON and YAML;
this module gives its keys and values their meaning.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

from ..folders import clear_digests
from .args import add_merge_arguments
from .common import UsageError, shown
from .configfile import MAX_CONFIG_BYTES, MAX_DEPTH, MAX_DIGITS, MAX_NODES, read_config
from .digests import NO_MOMENTS, check_replay, pin_moments, take_digests, taken_digests
from .values import WEIGHT_RANGE, join_negative_values, weight_ok

__all__ = [
    "CONFIG_KEYS",
    "MAX_CONFIG_BYTES",
    "MAX_DEPTH",
    "MAX_DIGITS",
    "MAX_NODES",
    "apply_config",
    "given_flags",
    "resolve",
    "taken_digests",
]

_read = read_config  # (the reader's old name here, which tests/test_fuzz.py still uses)

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
    "allow_changed": "it is about this run: whether a replay may merge changed inputs",
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
    ns, _ = p.parse_known_args(join_negative_values(p._actions, argv))
    given = set(vars(ns))
    if not getattr(ns, "adapters", None):
        given.discard("adapters")
    return given


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


def _adapters(
    what: str, items: Any, folder: pathlib.Path
) -> tuple[list[str], list, list, list, list]:
    """``(paths, weights or None each, names or None each, (text, hub record or None) each,
    recorded SHA-256 or None each)`` of the config's ``adapters`` (``text``: the path as
    written, which may be a Hub id; ``sha256``: a report's digest of the adapter's files)."""
    if isinstance(items, (str, Mapping)) or not isinstance(items, list) or not items:
        raise UsageError(
            f"{what}: 'adapters' must be a non-empty list, each a path or a mapping {{path, "
            "weight, name}}."
        )
    paths, weights, names, refs, digests = [], [], [], [], []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"path": item}
        if not isinstance(item, Mapping):
            raise UsageError(
                f"{what}: adapters[{i}] is a {type(item).__name__}; expected a path or a "
                "mapping {path, weight, name}."
            )
        extra = sorted(map(str, set(item) - {"path", "weight", "name", "hub", "sha256"}))
        if extra:
            raise UsageError(
                f"{what}: adapters[{i}] has the unknown key {extra[0]!r}; an adapter is a "
                "mapping with 'path' and optionally 'weight' and 'name' ('hub' and 'sha256' as "
                "a report records them)."
            )
        sha = item.get("sha256")
        if sha is not None and not (isinstance(sha, str) and _HEX64.fullmatch(sha)):
            raise UsageError(
                f"{what}: adapters[{i}] 'sha256' is {shown(str(sha))}; expected the 64 hex "
                "digits a merge report records (or drop it)."
            )
        digests.append(sha)
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
            isinstance(w, bool) or not isinstance(w, (int, float)) or not weight_ok(w)
        ):
            raise UsageError(
                f"{what}: adapters[{i}] 'weight' is {shown(str(w))}; expected {WEIGHT_RANGE} "
                "(the task's update is multiplied by it)."
            )
        weights.append(None if w is None else float(w))
        n = item.get("name")
        if n is not None and (not isinstance(n, str) or not n.strip()):
            raise UsageError(f"{what}: adapters[{i}] 'name' must be a non-empty string.")
        names.append(n)
    return paths, weights, names, refs, digests


_HEX64 = re.compile(r"[0-9a-f]{64}")


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
    (``given``: the flags it gave, :func:`given_flags`). A merge report's recorded digests and
    version are kept for :func:`_check_replay` (``args.adapter_digests``,
    ``args.report_version``)."""
    what = f"--config {args.config}"
    data, args.report_version = read_config(args.config)
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
                f"{what}: unknown key {shown(str(key))}; a config has 'adapters' and the merge's "
                f"flags without dashes: {', '.join(_spelling(k) for k in CONFIG_KEYS)}."
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
        paths, weights, names, refs, digests = _adapters(what, data["adapters"], folder)
        args.adapters = paths
        args.adapter_refs = refs
        args.adapter_digests = digests
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
    from ..pipeline.planning import task_names

    args.names = getattr(args, "names", None)
    clear_digests()  # (each run hashes each file once, afresh)
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
    args.input_moments = pin_moments(
        getattr(args, "input_moments", None), getattr(args, "input_moments_recorded", None),
        allocation=args.allocation, adapters=len(args.adapters),
        allow_changed=getattr(args, "allow_changed", False),
    )  # fmt: skip
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
    if getattr(args, "config", None) is None:
        taken = {}
    else:
        taken = check_replay(
            f"--config {args.config}", args.adapters, args.names,
            getattr(args, "adapter_digests", None), getattr(args, "report_version", None),
            allow_changed=getattr(args, "allow_changed", False),
        )  # fmt: skip
    if not args.dry_run:  # (what the report's digests are checked against once it is written)
        take_digests(args.adapters, args.names, taken)


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


def _after(args: argparse.Namespace) -> list[str]:
    """The command line's arguments after ``merge`` (``args.argv``, as :func:`cli.main` keeps
    it), or none."""
    argv = list(getattr(args, "argv", None) or [])
    return argv[argv.index("merge") + 1 :] if "merge" in argv else argv
