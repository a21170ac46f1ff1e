"""``netutility merge``'s settings: its flags, or a ``--config FILE`` (a merge described in a
YAML or JSON file, or a merge's report to replay) with the flags given over it, made into the
one :class:`nu.MergeConfig` that the merge receives (:func:`resolve`).

A config is a mapping. ``adapters`` is a list, each item a path or a mapping ``{path, weight,
name}`` (``weight``: the task's weight, as ``--weights``; ``name``: its name in the plan, the
terminal, the report and the plots). Every other key is one of the merge's flags without its
dashes, ``-`` or ``_`` alike (``method``, ``budget``, ``chunk-mb`` or ``chunk_mb``,
``density``, ``knots-variant`` ...), and its value is checked exactly as the flag's text is (a
flag that takes no value takes ``true`` or ``false``; ``serving-ranks`` and ``weights`` take a
list or a comma string; a ``null`` value is the flag's default). Unknown keys are refused,
naming the key. Relative paths (adapters, ``out``, ``input-moments``) are relative to the
file's folder. Adapters are given in one place, the file or the command line.

Precedence, setting by setting: a flag given on the command line, else the file's key, else the
flag's default. The settings so layered are checked in the flags' terms (naming the file and
the key where the file gave the value), then read by :meth:`nu.MergeConfig.from_dict`, as any
config's settings are: that config is what :func:`nu.merge_folders` receives.

A merge report (``netutility_report.json``, a file with ``netutility_version``) is a config too:
its ``config`` key holds the resolved configuration of that merge (absolute paths, every setting
but ``out``, each adapter's digest: ``nu.MergeConfig.to_dict`` beside the adapters), which
:func:`nu.merge_folders` writes; the rest of the report is ignored. Replaying it with a new
``--out`` gives the same adapter files bit for bit from the same inputs; a replay whose
adapters or moments files differ from the digests recorded, or that runs under another library
version, is refused unless ``--allow-changed`` (:func:`.digests.check_replay`).

The file is read by :func:`.configfile.read_config`, a bounded, strict reader of JSON and YAML;
this module gives its keys and values their meaning (:func:`read_file`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import NetUtilityError
from ..folders import MergeConfig, clear_digests
from .args import add_merge_arguments
from .common import UsageError, shown
from .configfile import read_config
from .digests import NO_MOMENTS, check_replay, pin_moments, take_digests
from .job import settings_from
from .options import option_flag, options_of
from .values import WEIGHT_RANGE, join_negative_values, weight_ok

__all__ = [
    "CONFIG_KEYS",
    "ConfigFile",
    "given_flags",
    "read_file",
    "resolve",
]

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


_HEX64 = re.compile(r"[0-9a-f]{64}")


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


# ---------------------------------------------------------------------------- a config file


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """A ``--config`` file read (:func:`read_file`): its settings, each checked as its flag
    checks its text, and what it says of the run (adapters, ``out``, a report's records)."""

    path: str
    settings: dict[str, Any]
    """Each setting the file gives (not ``null``), by the flag's ``dest``, parsed as the flag
    parses its text; ``input_moments`` a list of paths (None: a task without data)."""
    keys: dict[str, str]
    """The key the file spells each of :attr:`settings` with (``chunk-mb``, ``knots_variant``)."""
    adapters: list[str] | None = None
    """The adapters' paths (relative ones joined to the file's folder), or None."""
    refs: list[tuple[str, Any]] | None = None
    """Per adapter, its path as written (which may be a Hub id) and a report's ``hub`` record."""
    digests: list[str | None] | None = None
    """Per adapter, the SHA-256 a report recorded (None: not recorded)."""
    weights: list[float | None] | None = None
    names: list[str | None] | None = None
    moments_digests: list[str | None] | None = None
    """Per ``input-moments`` file, the SHA-256 a report recorded."""
    out: str | None = None
    version: str | None = None
    """The library version that wrote it, for a merge report; None for a plain config."""

    @property
    def what(self) -> str:
        return f"--config {self.path}"


def read_file(path: str) -> ConfigFile:
    """The config file at ``path`` read (:func:`.configfile.read_config`) and given its meaning:
    every key one of :data:`CONFIG_KEYS` or ``adapters`` (a run-only flag, an unknown key, and
    one setting given twice are refused, naming the key), every value checked as its flag
    checks its text, relative paths joined to the file's folder."""
    what = f"--config {path}"
    data, version = read_config(path)
    folder = pathlib.Path(os.path.abspath(path)).parent
    actions = _merge_actions()
    dests = _dests(what, data)
    settings: dict[str, Any] = {}
    moments_digests = None
    for key, dest in dests.items():
        value = data[key]
        if value is None:  # (the flag's default)
            continue
        if dest == "input_moments":
            settings[dest], moments_digests = _moments_list(what, key, value, folder)
        else:
            settings[dest] = _value(what, key, actions[dest], value)
    out = settings.pop("out", None)
    file = ConfigFile(
        path, settings, {d: k for k, d in dests.items() if d in settings}, version=version,
        moments_digests=moments_digests,
        out=None if out is None else str(folder / os.path.expanduser(out)),
    )  # fmt: skip
    if "adapters" not in data:
        return file
    paths, weights, names, refs, digests = _adapters(what, data["adapters"], folder)
    if any(w is not None for w in weights) and "weights" in dests.values():
        raise UsageError(
            f"{what}: weights are given both per adapter and as 'weights'; give them in one place."
        )
    return dataclasses.replace(
        file, adapters=paths, refs=refs, digests=digests, weights=weights, names=names
    )


def _dests(what: str, data: Mapping[str, Any]) -> dict[str, str]:
    """Each key of the file but ``adapters`` with the flag's ``dest`` it names; a run-only
    flag, an unknown key and a setting given twice (``chunk-mb`` and ``chunk_mb``) refused."""
    dests: dict[str, str] = {}
    for key in data:
        dest = _dest_of(key)
        if dest == "adapters":
            continue
        if dest in _RUN_ONLY:
            raise UsageError(
                f"{what}: key {key!r} cannot be in a config ({_RUN_ONLY[dest]}); give "
                f"{_flag(dest, _merge_actions().get(dest))} on the command line."
            )
        if dest not in CONFIG_KEYS:
            raise UsageError(
                f"{what}: unknown key {shown(str(key))}; a config has 'adapters' and the merge's "
                f"flags without dashes: {', '.join(_spelling(k) for k in CONFIG_KEYS)}."
            )
        if dest in dests.values():
            raise UsageError(f"{what}: {_spelling(dest)!r} is given twice (as {key!r} too).")
        dests[str(key)] = dest
    return dests


# ------------------------------------------------------------------- flags -> configuration


def resolve(args: argparse.Namespace) -> MergeConfig:
    """The merge's configuration from its flags and ``--config``, checked before anything is
    read: each setting the flag given on the command line, else the file's key, else the flag's
    default (:func:`_layered`); adapters and ``--out`` present, ``--budget`` where the
    allocation needs it, ``--weights`` one per adapter, ``--min-share`` with net_utility, the
    method's options those it takes, input moments files pinned by their SHA-256, a replay's
    inputs those its report recorded. Returns the one :class:`nu.MergeConfig` the merge
    receives (:meth:`nu.MergeConfig.from_dict` of the settings, with the tasks' names), which
    ``args.settings`` keeps; ``args.adapters``, ``args.names`` and ``args.out`` are completed
    (the run's, not settings: :class:`.job.MergeJob`)."""
    from ..pipeline.planning import task_names

    clear_digests()  # (each run hashes each file once, afresh)
    file = read_file(args.config) if getattr(args, "config", None) is not None else None
    given = given_flags(_after(args)) if file is not None else set()
    if file is not None and file.adapters is not None and "adapters" in given:
        raise UsageError(
            f"{file.what}: adapters are given both in the config and on the command line; give "
            "them in one place."
        )
    values, origin = _layered(args, file, given)
    adapters = args.adapters if file is None or file.adapters is None else file.adapters
    out = args.out if file is None or file.out is None or "out" in given else file.out
    _check(values, adapters, out, dry_run=args.dry_run)
    if values["allocation"] == "all":
        values["budget"] = None  # (every direction is kept: a budget means nothing, and is ignored)
    adapters, labels = _resolve_adapters(adapters, file)
    allow_changed = getattr(args, "allow_changed", False)
    values["input_moments"] = pin_moments(
        values["input_moments"], file.moments_digests if "input_moments" in origin else None,
        allocation=values["allocation"], adapters=len(adapters), allow_changed=allow_changed,
    )  # fmt: skip
    names = _names(task_names(labels), file)
    taken = {}
    if file is not None:
        recorded = file.digests if file.adapters is not None else None
        taken = check_replay(
            file.what, adapters, names, recorded, file.version, allow_changed=allow_changed
        )
    args.settings = _config(values, origin, names, file)
    args.adapters, args.names, args.out = adapters, names, out
    if not args.dry_run:  # (what the report's digests are checked against once it is written)
        take_digests(adapters, names, taken)
    return args.settings


_SETTINGS = tuple(d for d in CONFIG_KEYS if d != "out")
"""The flags that are settings of the merge (:class:`nu.MergeConfig`'s fields and the method's
and space's options), by ``dest``."""


def _layered(
    args: argparse.Namespace, file: ConfigFile | None, given: set[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Every setting's value by ``dest``: the flag given on the command line (``given``), else
    the file's, else the flag's default (``args`` holds the flags as parsed, defaults
    included); and for those the file gave, the key it gave them with (``adapters`` for the
    weights of its adapters)."""
    values = {d: getattr(args, d, None) for d in _SETTINGS}
    origin: dict[str, str] = {}
    if file is None:
        return values, origin
    for dest, value in file.settings.items():
        if dest not in given:
            values[dest], origin[dest] = value, file.keys[dest]
    if file.weights is not None and any(w is not None for w in file.weights):
        if "weights" not in given:
            values["weights"] = tuple(1.0 if w is None else w for w in file.weights)
            origin["weights"] = "adapters"
    return values, origin


def _check(values: Mapping[str, Any], adapters: Sequence[str], out: str | None, *, dry_run: bool):
    """What goes together, in the flags' terms, before anything is read."""
    if not adapters:
        raise UsageError(
            "no adapters: give the adapter folders (ADAPTER_DIR ...) or a --config with "
            "'adapters:'."
        )
    if out is None and not dry_run:
        raise UsageError("--out OUT_DIR is required (or 'out:' in --config), unless --dry-run.")
    allocation, weights = values["allocation"], values["weights"]
    if values["budget"] is None and allocation != "all":
        raise UsageError(
            f"--budget is required with --allocation {allocation} (the average number of "
            "kept directions per module, e.g. --budget 16); only --allocation all needs none."
        )
    if weights is not None and len(weights) != len(adapters):
        raise UsageError(
            f"--weights has {len(weights)} values for {len(adapters)} adapters; give one per "
            "adapter, in order."
        )
    if values["min_share"] is not None and allocation != "net_utility":
        raise UsageError(
            f"--min-share applies to --allocation net_utility (which moves the budget between "
            f"tasks), not {allocation}; drop it."
        )


def _names(derived: list[str], file: ConfigFile | None) -> list[str]:
    """The tasks' names: the file's (a distinct name each), the folders' elsewhere."""
    if file is None or file.names is None:
        return derived
    names = [n if n is not None else d for n, d in zip(file.names, derived, strict=True)]
    if len(set(names)) != len(names):
        raise UsageError(
            f"{file.what}: two adapters have the same name; give each a distinct 'name'."
        )
    return names


def _config(
    values: dict[str, Any], origin: Mapping[str, str], names: list[str], file: ConfigFile | None
) -> MergeConfig:
    """The one :class:`nu.MergeConfig`: the method's options checked in the flags' terms (an
    option the file gave named by its key), then :func:`.job.settings_from`
    (:meth:`nu.MergeConfig.from_dict`); a setting it refuses is named with the file."""

    def named(name: str) -> str:
        if file is None or name not in origin:
            return option_flag(name)
        return f"{file.what}: key {origin[name]!r} ({option_flag(name)})"

    options = options_of(values, named=named)
    try:
        return settings_from(values, names=names, options=options)
    except NetUtilityError as e:
        if file is None:
            raise
        key = next(
            (k for d, k in origin.items() if f"{d}=" in str(e) or f"[{d!r}]" in str(e)), None
        )
        raise UsageError(f"{file.what}: {f'key {key!r}: ' if key else ''}{e}") from e


def _resolve_adapters(
    adapters: Sequence[str], file: ConfigFile | None
) -> tuple[list[str], list[str]]:
    """The adapters as folders to read: Hugging Face Hub ids resolved to their snapshot folders
    in the Hub cache (:func:`.paths.resolve_adapter`; a local folder of the same name wins);
    and what names each task (the path, or the Hub id)."""
    from .paths import resolve_adapter

    if file is None or file.refs is None:  # (from the command line: the path is the text)
        refs = [(p, None) for p in adapters]
        where = ["ADAPTER_DIR"] * len(refs)
    else:
        refs = file.refs
        where = [f"{file.what}: adapters[{i}]" for i in range(len(refs))]
    resolved = [
        resolve_adapter(text, local=path, what=f"{w} {text}", pinned=pinned)
        for path, (text, pinned), w in zip(adapters, refs, where, strict=True)
    ]
    return [r.path for r in resolved], [r.label for r in resolved]


def _after(args: argparse.Namespace) -> list[str]:
    """The command line's arguments after ``merge`` (``args.argv``, as :func:`cli.main` keeps
    it), or none."""
    argv = list(getattr(args, "argv", None) or [])
    return argv[argv.index("merge") + 1 :] if "merge" in argv else argv
