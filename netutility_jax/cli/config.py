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
runs under another library version, is refused unless ``--allow-changed`` (:func:`_check_replay`).

The file is read by a bounded, strict loader (:func:`_read`): at most :data:`MAX_CONFIG_BYTES`,
read in blocks (``/dev/zero`` is refused at its first NUL byte); YAML by PyYAML's ``SafeLoader``
with limits (:func:`_yaml_loader`: values counted as aliases expand, :data:`MAX_NODES`; nesting,
:data:`MAX_DEPTH`; integers, :data:`MAX_DIGITS`; a key given twice refused with its line), JSON
with the same limits (:func:`_json_load`). Every refusal is one line naming the file.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

from ..folders import adapter_digest, clear_digests, file_digest
from .args import WEIGHT_RANGE, add_merge_arguments, join_negative_values, weight_ok
from .common import UsageError, shown

__all__ = ["CONFIG_KEYS", "apply_config", "given_flags", "resolve", "taken_digests"]

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


# ------------------------------------------------------------------------------ reading a file

MAX_CONFIG_BYTES = 16 * 2**20
"""Largest config (or report) file read: a merge's report of a large model is well under it;
a bigger file (``/dev/zero``, a stream) is refused before it is read whole."""
MAX_NODES = 100_000
"""Most values (scalars, lists, mappings) a config may hold once YAML's aliases are expanded:
a "billion laughs" file, a few lines of anchors that expand to billions of values, is refused
while it is read."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings in a config (a config needs 4 levels)."""
MAX_DIGITS = 40
"""Most digits of an integer in a config (Python refuses more than 4300 when it converts one)."""


def _where(text: str, pos: int) -> str:
    return f"line {text.count(chr(10), 0, pos) + 1}"


def _read_text(path: str, what: str) -> str:
    """The file's text, read in blocks and refused at once when it is larger than
    :data:`MAX_CONFIG_BYTES`, holds a NUL byte (a binary file, ``/dev/zero``) or is not UTF-8."""
    shown_path = path if os.path.isabs(path) else f"{path} ({os.path.abspath(path)})"
    try:
        with open(path, "rb") as f:
            blocks, size = [], 0
            while block := f.read(1 << 16):
                if b"\0" in block:
                    raise UsageError(
                        f"{what}: holds a NUL byte (at byte {size + block.index(0)}): not a text "
                        "file; give a YAML or JSON merge config."
                    )
                size += len(block)
                if size > MAX_CONFIG_BYTES:
                    raise UsageError(
                        f"{what}: larger than {MAX_CONFIG_BYTES // 2**20} MiB; a merge config "
                        "(or report) is far smaller: is it the right file?"
                    )
                blocks.append(block)
    except FileNotFoundError:
        raise UsageError(
            f"--config {shown_path}: no such file; give a YAML or JSON merge config."
        ) from None
    except IsADirectoryError:
        raise UsageError(f"{what}: is a folder; give a YAML or JSON merge config file.") from None
    except PermissionError:
        raise UsageError(f"{what}: cannot be read (permission denied).") from None
    except OSError as e:
        raise UsageError(f"{what}: cannot be read ({e.strerror or e}).") from None
    try:
        return b"".join(blocks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{what}: not UTF-8 text (byte {e.start}); give a YAML or JSON merge config."
        ) from None


def _digits(text: str) -> int:
    """How many digits an integer literal has (sign, ``_`` and a base prefix left out)."""
    t = text.strip().lstrip("+-").replace("_", "").lower()
    if t[:2] in ("0x", "0o", "0b"):
        t = t[2:]
    return len(t)


def _too_many_digits(what: str, where: str, n: int) -> UsageError:
    return UsageError(
        f"{what}: {where}: an integer of {n} digits; a config's numbers have at most "
        f"{MAX_DIGITS} digits."
    )


def _json_load(text: str, what: str) -> Any:
    """JSON read strictly: duplicate keys, nesting deeper than :data:`MAX_DEPTH` and integers
    of more than :data:`MAX_DIGITS` digits refused, each naming its line."""
    import json.decoder
    import json.scanner

    depth = [0]

    def deeper(parse):
        def wrapped(s_and_end, *rest):
            s, end = s_and_end
            depth[0] += 1
            try:
                if depth[0] > MAX_DEPTH:
                    raise UsageError(
                        f"{what}: {_where(s, end)}: nested deeper than {MAX_DEPTH} levels; a "
                        "config is a mapping of lists and mappings a few levels deep."
                    )
                return parse(s_and_end, *rest)
            finally:
                depth[0] -= 1

        return wrapped

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise _Duplicate(k)
            out[k] = v
        return out

    def parse_object(s_and_end, *rest):
        s, end = s_and_end
        try:
            return json.decoder.JSONObject(s_and_end, *rest)
        except _Duplicate as d:
            pos = _second_key(s, end - 1, d.key)
            raise UsageError(
                f"{what}: {_where(s, pos)}: key {d.key!r} is given twice in one mapping; give "
                "each key once (the second would silently win)."
            ) from None

    def parse_int(digits: str) -> int:
        if _digits(digits) > MAX_DIGITS:
            raise _too_many_digits(what, _where(text, max(0, text.find(digits))), _digits(digits))
        return int(digits)

    decoder = json.JSONDecoder(object_pairs_hook=pairs, parse_int=parse_int)
    decoder.parse_object = deeper(parse_object)
    decoder.parse_array = deeper(decoder.parse_array)
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # (the C one ignores the hooks)
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{what}: not valid JSON ({e}).") from None
    except RecursionError:  # (a stack smaller than MAX_DEPTH levels need: should not happen)
        raise UsageError(f"{what}: nested too deep to read.") from None


class _Duplicate(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _second_key(s: str, start: int, key: str) -> int:
    """Where the JSON object at ``s[start]`` gives ``key`` the second time (its own keys only,
    not those of the objects inside it)."""
    from json.decoder import scanstring

    seen, depth, i = 0, 0, start
    while i < len(s):
        c = s[i]
        if c == '"':
            value, j = scanstring(s, i + 1)
            if depth == 1 and s[j:].lstrip().startswith(":"):
                if value == key:
                    seen += 1
                    if seen == 2:
                        return i
            i = j
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                break
        i += 1
    return start


def _yaml_load(text: str, what: str, yaml: Any) -> Any:
    """YAML read by :func:`_yaml_loader`'s bounded, strict loader (plain data only, nothing
    constructed from tags)."""
    loader = _yaml_loader(yaml)(text)
    loader.what = what
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise UsageError(f"{what}: not valid YAML ({' '.join(str(e).split())}).") from None
    except RecursionError:  # (a stack smaller than MAX_DEPTH levels need: should not happen)
        raise UsageError(f"{what}: nested too deep to read.") from None
    finally:
        loader.dispose()


@functools.cache
def _yaml_loader(yaml: Any) -> type:
    """PyYAML's ``SafeLoader`` with limits: every value counted as its aliases expand
    (:data:`MAX_NODES`, so an anchor bomb stops while it is read), nesting
    (:data:`MAX_DEPTH`, aliases included), integers (:data:`MAX_DIGITS`), recursive aliases
    refused, and a key given twice in one mapping refused naming it and its line."""

    class Loader(yaml.SafeLoader):
        what = "--config"

        def __init__(self, stream: str):
            super().__init__(stream)
            self._count = 0
            self._depth = 0
            self._open: set[str] = set()  # anchors of the collections being read
            self._sizes: dict[int, tuple[int, int]] = {}  # id(node): (values, levels)

        def _add(self, n: int, mark: Any) -> None:
            self._count += n
            if self._count > MAX_NODES:
                raise UsageError(
                    f"{self.what}: line {mark.line + 1}: more than {MAX_NODES} values once "
                    "YAML's aliases are expanded (an alias bomb?); a config is far smaller."
                )

        def _size(self, node: Any) -> tuple[int, int]:
            got = self._sizes.get(id(node))
            if got is None:
                if isinstance(node, yaml.SequenceNode):
                    kids = [self._size(v) for v in node.value]
                elif isinstance(node, yaml.MappingNode):
                    kids = [self._size(x) for kv in node.value for x in kv]
                else:
                    kids = []
                got = (1 + sum(k[0] for k in kids), 1 + max((k[1] for k in kids), default=0))
                self._sizes[id(node)] = got
            return got

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                node = self.anchors.get(event.anchor)
                if event.anchor in self._open:
                    raise UsageError(
                        f"{self.what}: line {event.start_mark.line + 1}: the alias "
                        f"*{event.anchor} refers to a list or mapping that holds it (a "
                        "recursive value); a config holds plain values."
                    )
                if node is not None:
                    count, levels = self._size(node)
                    if self._depth + levels > MAX_DEPTH:
                        raise self._too_deep(event.start_mark)
                    self._add(count, event.start_mark)
                return super().compose_node(parent, index)
            self._add(1, self.peek_event().start_mark)
            return super().compose_node(parent, index)

        def _too_deep(self, mark: Any) -> UsageError:
            return UsageError(
                f"{self.what}: line {mark.line + 1}: nested deeper than {MAX_DEPTH} levels; a "
                "config is a mapping of lists and mappings a few levels deep."
            )

        def _collection(self, compose: Any, anchor: Any) -> Any:
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise self._too_deep(self.peek_event().start_mark)
            if anchor is not None:
                self._open.add(anchor)
            try:
                return compose(anchor)
            finally:
                self._depth -= 1
                self._open.discard(anchor)

        def compose_sequence_node(self, anchor: Any) -> Any:
            return self._collection(super().compose_sequence_node, anchor)

        def compose_mapping_node(self, anchor: Any) -> Any:
            return self._collection(super().compose_mapping_node, anchor)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: set[Any] = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # (<<: an anchored mapping's keys, which the mapping's own override)
                    key = self.construct_object(key_node, deep=True)
                    try:
                        if key in seen:
                            raise UsageError(
                                f"{self.what}: line {key_node.start_mark.line + 1}: key {key!r} "
                                "is given twice in one mapping; give each key once (the second "
                                "would silently win)."
                            )
                        seen.add(key)
                    except TypeError:  # (an unhashable key: the constructor refuses it)
                        pass
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_int(self, node: Any) -> int:
            n = _digits(self.construct_scalar(node))
            if n > MAX_DIGITS:
                raise _too_many_digits(self.what, f"line {node.start_mark.line + 1}", n)
            return super().construct_yaml_int(node)

    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
    return Loader


def _read(path: str) -> tuple[dict[str, Any], str | None]:
    """The config file's mapping (a report's ``config``) and, for a merge report, the library
    version that wrote it (None for a plain config). Read by a bounded, strict loader
    (:func:`_read_text`, :func:`_json_load`, :func:`_yaml_loader`)."""
    what = f"--config {path}"
    text = _read_text(path, what)
    if path.lower().endswith(".json"):
        data = _json_load(text, what)
    else:
        try:
            import yaml
        except ImportError:
            if text.lstrip()[:1] not in ("{", "["):
                raise UsageError(
                    f"{what}: reading YAML needs PyYAML (pip install pyyaml); or write the "
                    "config as JSON."
                ) from None
            data = _json_load(text, what)
        else:
            data = _yaml_load(text, what, yaml)
    version = None
    if isinstance(data, Mapping) and "netutility_version" in data:  # a netutility_report.json
        version = data["netutility_version"]
        if not isinstance(data.get("config"), Mapping):
            raise UsageError(
                f"{what}: a merge report (netutility_version {shown(str(version))}) without a "
                "'config' mapping, so it cannot be replayed (reports record the configuration "
                "under 'config'); give the merge's flags, or a config file."
            )
        data = data["config"]  # (the rest of the report describes the merge's result)
        version = str(version)
    elif isinstance(data, Mapping) and "config" in data:
        own = sorted(str(k) for k in data if k != "config")
        raise UsageError(
            f"{what}: has a 'config' key, which only a merge report has (beside its "
            "netutility_version), and this file is no report"
            + (f": its own keys ({', '.join(own[:4])}{', ...' if len(own) > 4 else ''}) would "
               "be ignored" if own else "")
            + "; write the merge's settings at the top level, without 'config'."
        )  # fmt: skip
    if not isinstance(data, Mapping):
        raise UsageError(
            f"{what}: holds a {type(data).__name__}; expected a mapping with 'adapters:' and the "
            "merge's flags as keys (method, budget, out, ...)."
        )
    return dict(data), version


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
    data, args.report_version = _read(args.config)
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


_HEX64 = re.compile(r"[0-9a-f]{64}")

_DIGESTS: dict[str, str] = {}
"""Each adapter folder's digest as :func:`resolve` took it before the merge read the folder (by
absolute path; this process's latest merge): :func:`nu.merge_folders` takes it again once the
merge is done and refuses a folder that changed in between, so that the report's digest is of
the files the merge read (without reading them again where their identities show no change:
:func:`nu.folders.adapter_digest`)."""


def taken_digests(paths: list[str] | tuple[str, ...]) -> list[str | None]:
    """The digests :func:`resolve` took of the adapter folders ``paths`` (None where it could
    not: the merge's own checks refuse such a folder)."""
    return [_DIGESTS.get(os.path.abspath(p)) for p in paths]


def _check_replay(args: argparse.Namespace) -> dict[str, str]:
    """A replayed report's inputs as it recorded them: the library version that wrote it, and
    each adapter's digest (:func:`adapter_digest`; the input moments' are checked by
    :func:`_check_moments`). A difference is refused naming it, or, with ``--allow-changed``,
    said as a warning. Returns the digests it took, by absolute path."""
    from .. import __version__
    from .common import say

    what = f"--config {args.config}"
    changes, taken = [], {}
    version = getattr(args, "report_version", None)
    if version is not None and version != __version__:
        changes.append(
            f"the report was written by netutility-jax {version}, this is {__version__} (the "
            "merge may differ)"
        )
    recorded = getattr(args, "adapter_digests", None) or [None] * len(args.adapters)
    for i, (path, want) in enumerate(zip(args.adapters, recorded, strict=True)):
        if want is None or not os.path.isdir(path):  # (a folder that is gone: the merge's
            continue  # own checks refuse it, as they do without a report)
        sha = taken[os.path.abspath(path)] = adapter_digest(path, f"{what}: adapters[{i}]")
        if sha != want:
            changes.append(
                f"adapters[{i}] ({args.names[i] if args.names else path}) at {path} has changed "
                f"since that merge (SHA-256 of its files {sha[:16]}..., recorded {want[:16]}...)"
            )
    if not changes:
        return taken
    if not getattr(args, "allow_changed", False):
        raise UsageError(
            f"{what}: {'; '.join(changes)}; the replay would not be that merge. Pass "
            "--allow-changed to merge the inputs as they are now."
        )
    for line in changes:
        say("merge", "warning", f"{what}: {line} (--allow-changed: merging them as they are)")
    return taken


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
    taken = _check_replay(args) if getattr(args, "config", None) is not None else {}
    if not args.dry_run:  # (what the report's digests are checked against once it is written)
        from ..errors import NetUtilityError

        for i, path in enumerate(args.adapters):
            key = os.path.abspath(path)
            _DIGESTS.pop(key, None)
            try:
                _DIGESTS[key] = taken.get(key) or adapter_digest(path, f"adapter {args.names[i]}")
            except NetUtilityError:  # (not a readable folder: the merge's own checks say so, in
                pass  # every process of a distributed run alike)


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
    """The SHA-256 of the file at ``path`` (:func:`nu.folders.file_digest`), its errors in the
    flag's terms."""
    from ..errors import FileAccessError, MissingFileError

    try:
        return file_digest(path)
    except (FileNotFoundError, NotADirectoryError):
        raise MissingFileError(
            f"{what}: no such file; give one moments file per adapter, in order "
            f"(nu.moments.save_input_moments writes them; '{NO_MOMENTS}' for a task without data)."
        ) from None
    except IsADirectoryError:
        raise UsageError(f"{what}: is a folder; expected a .safetensors or .npz file.") from None
    except PermissionError:
        raise FileAccessError(f"{what}: cannot be read (permission denied).") from None
    except OSError as e:
        raise FileAccessError(f"{what}: cannot be read ({e.strerror or e}).") from None


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
                "(docs/input_moments.md; nu.moments.save_input_moments writes one)."
            )
        sha = _digest(f, what)
        if want is not None and want != sha:
            change = (
                f"{what}: its SHA-256 is {sha[:16]}..., not {want[:16]}... as the config "
                "records: the file changed since that merge"
            )
            if not getattr(args, "allow_changed", False):
                raise UsageError(
                    f"{change}; give the recorded file, drop its 'sha256', or pass "
                    "--allow-changed to merge it as it is now."
                )
            from .common import say

            say("merge", "warning", f"{change} (--allow-changed: merging it as it is)")
        digests.append(MomentsFile(f, sha))
    args.input_moments = digests


def _after(args: argparse.Namespace) -> list[str]:
    """The command line's arguments after ``merge`` (``args.argv``, as :func:`cli.main` keeps
    it), or none."""
    argv = list(getattr(args, "argv", None) or [])
    return argv[argv.index("merge") + 1 :] if "merge" in argv else argv
