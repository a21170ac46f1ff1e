"""Reading a ``--config`` file (a merge config, or a merge report): a bounded, strict reader of
JSON and YAML that gives plain data or refuses the file with one line naming it.

:func:`read_config` reads at most :data:`MAX_CONFIG_BYTES`, in blocks (``/dev/zero`` is refused
at its first NUL byte); YAML by PyYAML's ``SafeLoader`` with limits (:func:`_yaml_loader`:
values counted as aliases expand, :data:`MAX_NODES`; nesting, :data:`MAX_DEPTH`; integers,
:data:`MAX_DIGITS`; a key given twice refused with its line), JSON with the same limits
(:func:`_json_load`). What the mapping's keys and values mean is :mod:`.config`'s.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from .common import UsageError, reading, shown

__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_DIGITS", "MAX_NODES", "read_config"]

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


def read_config(path: str) -> tuple[dict[str, Any], str | None]:
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
    return _settings_of(data, what)


def _settings_of(data: Any, what: str) -> tuple[dict[str, Any], str | None]:
    """A plain config's mapping as it is; a merge report's recorded ``config`` and version."""
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


def _where(text: str, pos: int) -> str:
    return f"line {text.count(chr(10), 0, pos) + 1}"


def _read_text(path: str, what: str) -> str:
    """The file's text, read in blocks and refused at once when it is larger than
    :data:`MAX_CONFIG_BYTES`, holds a NUL byte (a binary file, ``/dev/zero``) or is not UTF-8."""
    shown_path = path if os.path.isabs(path) else f"{path} ({os.path.abspath(path)})"
    with (
        reading(
            what,
            missing="give a YAML or JSON merge config.",
            folder="give a YAML or JSON merge config file.",
            named=f"--config {shown_path}",
        ),
        open(path, "rb") as f,
    ):
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


def _too_deep(what: str, where: str) -> UsageError:
    return UsageError(
        f"{what}: {where}: nested deeper than {MAX_DEPTH} levels; a config is a mapping of lists "
        "and mappings a few levels deep."
    )


def _twice(what: str, where: str, key: Any) -> UsageError:
    return UsageError(
        f"{what}: {where}: key {key!r} is given twice in one mapping; give each key once (the "
        "second would silently win)."
    )


# ------------------------------------------------------------------------------------- JSON


class _Duplicate(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


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
                    raise _too_deep(what, _where(s, end))
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
            raise _twice(what, _where(s, _second_key(s, end - 1, d.key)), d.key) from None

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


# ------------------------------------------------------------------------------------- YAML


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
    """PyYAML's ``SafeLoader`` with :class:`_Limits`: every value counted as its aliases
    expand (:data:`MAX_NODES`, so an anchor bomb stops while it is read), nesting
    (:data:`MAX_DEPTH`, aliases included), integers (:data:`MAX_DIGITS`), recursive aliases
    refused, and a key given twice in one mapping refused naming it and its line."""
    loader = type("Loader", (_Limits, yaml.SafeLoader), {"_yaml": yaml})
    loader.add_constructor("tag:yaml.org,2002:int", loader.construct_yaml_int)
    return loader


class _Limits:
    """The limits :func:`_yaml_loader` puts on PyYAML's ``SafeLoader`` (a mixin, so that PyYAML
    is imported only when a YAML file is read: ``_yaml`` is the module)."""

    what = "--config"
    _yaml: Any = None

    def __init__(self, stream: str):
        super().__init__(stream)  # type: ignore[call-arg]
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
        """``(values, levels)`` of ``node`` with its aliases expanded (each node once)."""
        got = self._sizes.get(id(node))
        if got is None:
            if isinstance(node, self._yaml.SequenceNode):
                kids = [self._size(v) for v in node.value]
            elif isinstance(node, self._yaml.MappingNode):
                kids = [self._size(x) for kv in node.value for x in kv]
            else:
                kids = []
            got = (1 + sum(k[0] for k in kids), 1 + max((k[1] for k in kids), default=0))
            self._sizes[id(node)] = got
        return got

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(self._yaml.AliasEvent):  # type: ignore[attr-defined]
            event = self.peek_event()  # type: ignore[attr-defined]
            node = self.anchors.get(event.anchor)  # type: ignore[attr-defined]
            if event.anchor in self._open:
                raise UsageError(
                    f"{self.what}: line {event.start_mark.line + 1}: the alias "
                    f"*{event.anchor} refers to a list or mapping that holds it (a "
                    "recursive value); a config holds plain values."
                )
            if node is not None:
                count, levels = self._size(node)
                if self._depth + levels > MAX_DEPTH:
                    raise _too_deep(self.what, f"line {event.start_mark.line + 1}")
                self._add(count, event.start_mark)
            return super().compose_node(parent, index)  # type: ignore[misc]
        self._add(1, self.peek_event().start_mark)  # type: ignore[attr-defined]
        return super().compose_node(parent, index)  # type: ignore[misc]

    def _collection(self, compose: Any, anchor: Any) -> Any:
        self._depth += 1
        if self._depth > MAX_DEPTH:
            mark = self.peek_event().start_mark  # type: ignore[attr-defined]
            raise _too_deep(self.what, f"line {mark.line + 1}")
        if anchor is not None:
            self._open.add(anchor)
        try:
            return compose(anchor)
        finally:
            self._depth -= 1
            self._open.discard(anchor)

    def compose_sequence_node(self, anchor: Any) -> Any:
        return self._collection(super().compose_sequence_node, anchor)  # type: ignore[misc]

    def compose_mapping_node(self, anchor: Any) -> Any:
        return self._collection(super().compose_mapping_node, anchor)  # type: ignore[misc]

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, self._yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # (<<: an anchored mapping's keys, which the mapping's own override)
                key = self.construct_object(key_node, deep=True)  # type: ignore[attr-defined]
                try:
                    if key in seen:
                        raise _twice(self.what, f"line {key_node.start_mark.line + 1}", key)
                    seen.add(key)
                except TypeError:  # (an unhashable key: the constructor refuses it)
                    pass
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]

    def construct_yaml_int(self, node: Any) -> int:
        n = _digits(self.construct_scalar(node))  # type: ignore[attr-defined]
        if n > MAX_DIGITS:
            raise _too_many_digits(self.what, f"line {node.start_mark.line + 1}", n)
        return super().construct_yaml_int(node)  # type: ignore[misc]
