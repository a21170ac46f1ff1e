"""PEFT interop: load LoRA adapters saved by Hugging Face PEFT, save merges PEFT can load.

A PEFT LoRA checkpoint is a directory with ``adapter_config.json`` and
``adapter_model.safetensors``. The weights of module ``<module>`` (its dotted name in the base
``transformers`` model, e.g. ``model.layers.0.self_attn.q_proj``) are

* ``base_model.model.<module>.lora_A.weight``, shape ``(r, d_in)``, and
* ``base_model.model.<module>.lora_B.weight``, shape ``(d_out, r)``,

and PEFT adds ``scale * B A`` (``(d_out, d_in)``, the torch ``Linear`` layout) to the base weight,
with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). The per-module
``r`` and ``lora_alpha`` come from ``rank_pattern`` / ``alpha_pattern`` when a key matches
(:func:`pattern_key`). In this library's kernel layout the same update is
``dK = scale * lora_a @ lora_b`` with ``lora_a = A^T`` ``(d_in, r)`` and ``lora_b = B^T``
``(r, d_out)``.

``fan_in_fan_out`` (GPT-2's ``Conv1D``, whose weight is stored ``(d_in, d_out)``) changes only how
PEFT adds the update to the stored base weight; the LoRA factors are ordinary ``Linear`` layers with
the shapes above either way, so they load and save the same. ``dK`` is then exactly the update of
the ``Conv1D`` weight as stored.

Files are read and written with the ``safetensors`` package (its numpy and flax routes, so bf16
works); torch and PEFT are never imported, and pickled ``adapter_model.bin`` files are never
opened. The regular expressions a config may hold (``rank_pattern`` / ``alpha_pattern`` keys, a
string ``target_modules`` / ``exclude_modules``, ``layers_pattern``) follow PEFT's rules exactly
and never hang: plain name patterns are matched directly, any other is run by Python's ``re`` in
a short-lived helper process with a time limit, and one that does not finish is an error.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._tree import _few
from .errors import FileAccessError, InputError, InputTypeError, MissingFileError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
PREFIX = "base_model.model."

# PEFT's defaults for a LoraConfig that omits them.
_DEFAULT_R = 8
_DEFAULT_ALPHA = 8

# Fields of the source adapters' config that describe the base model and where LoRA sits, rather
# than how the adapter was trained; save_adapter carries them over from ``base_config``.
CARRIED_FIELDS = (
    "base_model_name_or_path",
    "revision",
    "task_type",
    "target_modules",
    "exclude_modules",
    "fan_in_fan_out",
    "layers_to_transform",
    "layers_pattern",
    "layer_replication",
)
# Fields save_adapter accepts as keyword overrides: the carried ones plus inference_mode.
_CONFIG_OVERRIDES = (*CARRIED_FIELDS, "inference_mode")
# Fields save_adapter computes itself (a user value would break the saved update).
_COMPUTED_FIELDS = (
    "peft_type",
    "r",
    "lora_alpha",
    "rank_pattern",
    "alpha_pattern",
    "use_rslora",
    "use_dora",
    "bias",
    "lora_bias",
    "init_lora_weights",
    "modules_to_save",
)
# Initialisations that rewrite the base weights while training: unless PEFT converted the adapter
# on save, its update is relative to the rewritten weights, not to the base model.
_MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga")
_SAVE_DTYPES = ("float32", "bfloat16", "float16")


def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "nu.peft needs the 'safetensors' package (no torch needed): pip install safetensors, "
            "or pip install 'netutility-jax[peft]'."
        ) from e
    return safetensors


# ---------------------------------------------------------------------------------------------
# Regular expressions from adapter configs
# ---------------------------------------------------------------------------------------------

# rank_pattern / alpha_pattern keys and a string target_modules / exclude_modules / layers_pattern
# are regular expressions read from a file. A pattern that backtracks catastrophically (such as
# "(\w|.)+\d") makes Python's re run for hours on an ordinary module name, so PEFT hangs on it. Plain
# name patterns (literal characters, "." wildcards, an optional leading "^": everything PEFT
# users and save_adapter write) are matched here directly, exactly as re would. Any other
# pattern is evaluated by re itself, with the same rule PEFT uses, in a short-lived helper
# process under a time limit, so the semantics are re's exactly and a hostile pattern is an
# InputError within a fraction of a second instead of a hang (or, for engines that expand
# counted repeats while compiling, an exhausted memory).
_REGEX_TIMEOUT = 0.25  # seconds one pattern may take on one module name
_REGEX_STARTUP = 10.0  # seconds the helper process may take to start (a loaded machine)
_REGEX_PER_EVAL = 1e-3  # overall allowance per evaluation (benign ones take microseconds)
_SPECIAL = frozenset(".^$*+?{}[]\\|()")

# The helper process: reads {"limit", "patterns", "queries"} as JSON on stdin; for each query
# (mode, pattern list, name) it finds the first pattern that re.match / re.fullmatch accepts,
# each evaluation under a SIGALRM timer (re checks signals while it backtracks). It prints a
# progress line before each evaluation, so the parent can name the pattern that ran out of time
# even when it has to kill the process (where there is no SIGALRM).
_MATCHER = r"""
import json, re, signal, sys
job = json.loads(sys.stdin.buffer.read())
limit = job["limit"]
timer = hasattr(signal, "setitimer")
if timer:
    def _alarm(signum, frame):
        raise TimeoutError
    signal.signal(signal.SIGALRM, _alarm)
def say(x):
    sys.stdout.write(json.dumps(x) + "\n")
    sys.stdout.flush()
results = []
for q, (mode, plist, name) in enumerate(job["queries"]):
    found = None
    for j, p in enumerate(job["patterns"][plist]):
        say(["at", q, j])
        try:
            if timer:
                signal.setitimer(signal.ITIMER_REAL, limit)
            try:
                m = (re.fullmatch if mode == "full" else re.match)(p, name)
            finally:
                if timer:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except TimeoutError:
            say(["timeout", q, j])
            sys.exit(0)
        except re.error as e:
            say(["invalid", q, j, str(e)])
            sys.exit(0)
        except (MemoryError, RecursionError, OverflowError) as e:
            say(["failed", q, j, type(e).__name__])
            sys.exit(0)
        if m:
            found = [j, m.groupdict().get("idx")]
            break
    results.append(found)
say(["ok", results])
"""


def _clip(x: Any, n: int = 120) -> str:
    """``repr(x)``, cut to about ``n`` characters (values from files can be arbitrarily long)."""
    s = repr(x)
    return s if len(s) <= n else f"{s[: n - 10]}...' ({len(s)} characters)"


def _glob(pattern: str) -> tuple[bool, tuple[str | None, ...]] | None:
    """``(anchored, chars)`` if ``pattern`` is a plain name pattern, else None.

    A plain pattern is an optional leading ``^`` followed by literal characters (escaped
    punctuation such as ``\\.`` included) and unescaped ``.``, which re matches to any character but
    a newline (``None`` in ``chars``).
    """
    anchored = pattern.startswith("^")
    chars: list[str | None] = []
    i = 1 if anchored else 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            e = pattern[i + 1] if i + 1 < len(pattern) else ""
            if not e or (e.isascii() and e.isalnum()) or not e.isprintable():
                return None  # \d, \w, a back-reference ...: a real regex
            chars.append(e)
            i += 2
            continue
        if c == ".":
            chars.append(None)
        elif c in _SPECIAL or not c.isprintable() or c.isspace():
            return None
        else:
            chars.append(c)
        i += 1
    return anchored, tuple(chars)


def _chars_match(chars: tuple[str | None, ...], s: str) -> bool:
    return all(x != "\n" if c is None else x == c for c, x in zip(chars, s, strict=True))


def _glob_suffix(g: tuple[bool, tuple[str | None, ...]], name: str) -> bool:
    """``re.match(rf"(.*\\.)?({key})$", name)`` for a plain ``key`` (:func:`_glob`), exactly.

    The key matches a tail of the name (before an optional final newline, where ``$`` also
    matches); the head before it is empty or ends with a dot and holds no newline (``.*`` does not
    cross one); a leading ``^`` forces the head to be empty.
    """
    anchored, chars = g
    for s in (name, name[:-1]) if name.endswith("\n") else (name,):
        cut = len(s) - len(chars)
        if cut < 0 or not _chars_match(chars, s[cut:]):
            continue
        head = s[:cut]
        if not head or (not anchored and head.endswith(".") and "\n" not in head):
            return True
    return False


def _tails(s: str) -> Iterator[str]:
    """``s`` and its tails after each dot that has no newline before it (``(.*\\.)?`` heads)."""
    yield s
    nl = s.find("\n")
    stop = len(s) if nl < 0 else nl
    p = s.find(".")
    while 0 <= p < stop:
        yield s[p + 1 :]
        p = s.find(".", p + 1)


def _glob_full(g: tuple[bool, tuple[str | None, ...]], name: str) -> bool:
    """``re.fullmatch(pattern, name)`` for a plain pattern (:func:`_glob`), exactly."""
    return len(name) == len(g[1]) and _chars_match(g[1], name)


class _Regexes:
    """PEFT's regex rules on patterns from an untrusted file, at bounded cost.

    ``fn`` and ``where`` (the file, ``"'path': "``) prefix every message. Each method evaluates
    one pattern list on many module names, with PEFT's short-circuit (later patterns are tried only
    where earlier ones fail), and starts at most one helper process.
    """

    def __init__(self, fn: str, where: str = "") -> None:
        self.fn, self.where = fn, where

    def first_keys(self, label: str, keys: Sequence[str], names: Sequence[str]) -> list[int]:
        """Index of the first key PEFT's ``get_pattern_key`` accepts for each name, or -1.

        Literal keys (save_adapter writes one ``^``-anchored key per module) are looked up by the
        name and its tails after each dot, so the cost does not grow with their number.
        """
        keys = list(keys)
        globs = [_glob(k) for k in keys]
        exact: dict[str, int] = {}  # "^literal" -> first index
        tail: dict[str, int] = {}  # "literal" -> first index
        other: list[int] = []  # keys with "." wildcards, and real regexes
        for j, g in enumerate(globs):
            if g is not None and None not in g[1]:
                (exact if g[0] else tail).setdefault("".join(g[1]), j)  # type: ignore[arg-type]
            else:
                other.append(j)
        none = len(keys)
        out: list[int] = []
        pending: list[int] = []
        for i, name in enumerate(names):
            best = none
            for s in (name, name[:-1]) if name.endswith("\n") else (name,):
                best = min(best, exact.get(s, none), *(tail.get(t, none) for t in _tails(s)))
            for j in other:
                if j >= best:
                    break
                g = globs[j]
                if g is None:
                    best = -2  # a real regex must be tried first: the helper decides
                    break
                if _glob_suffix(g, name):
                    best = j
                    break
            if best == -2:
                pending.append(i)
            out.append(-1 if best == none else best)
        if pending:
            wrapped = [rf"(.*\.)?({k})$" for k in keys]
            found = self._run(label, keys, wrapped, "match", [names[i] for i in pending])
            for i, f in zip(pending, found, strict=True):
                out[i] = -1 if f is None else f[0]
        return out

    def fullmatch(self, label: str, pattern: str, names: Sequence[str]) -> list[bool]:
        """``re.fullmatch(pattern, name)`` for each name."""
        g = _glob(pattern)
        if g is not None:
            return [_glob_full(g, n) for n in names]
        found = self._run(label, [pattern], [pattern], "full", list(names))
        return [f is not None for f in found]

    def layer_index(
        self, label: str, patterns: Sequence[str] | None, names: Sequence[str]
    ) -> list[int | None]:
        """The layer index PEFT reads from each name (``check_target_module_exists``), or None."""
        if not patterns:
            shown, wrapped = ["(default)"], [r".*?\.[^.]*\.(?P<idx>\d+)\."]
        else:
            shown = list(patterns)
            wrapped = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in shown]
        found = self._run(label, shown, wrapped, "match", list(names))
        return [None if f is None or f[1] is None else int(f[1]) for f in found]

    def _run(
        self,
        label: str,
        shown: Sequence[str],
        patterns: Sequence[str],
        mode: str,
        names: Sequence[str],
    ) -> list[Any]:
        """Evaluate ``patterns`` in order on each name in the helper process (one per call)."""
        if not names:
            return []
        fn, where = self.fn, self.where
        if getattr(sys, "frozen", False) or not sys.executable:
            raise InputError(
                f"{fn}: {where}{label} {_clip(shown[0])} is a regular expression, and this "
                "Python cannot start the helper process that evaluates regexes from files under a "
                "time limit; write plain module names or suffixes instead."
            )
        payload = json.dumps(
            {
                "limit": _REGEX_TIMEOUT,
                "patterns": [list(patterns)],
                "queries": [[mode, 0, n] for n in names],
            }
        ).encode("ascii")
        budget = _REGEX_STARTUP + _REGEX_PER_EVAL * len(names) * len(patterns)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-W", "ignore", "-c", _MATCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        overall = False
        try:
            try:
                out, _ = proc.communicate(payload, timeout=budget)
            except subprocess.TimeoutExpired:
                overall = True
                proc.kill()
                out, _ = proc.communicate()
        finally:
            if proc.poll() is None:  # interrupted (KeyboardInterrupt, a signal): never leave it
                proc.kill()
                proc.wait()
        last = None
        for line in reversed(out.decode("ascii", "replace").splitlines()):
            try:  # the last line is cut short when the process was killed while writing it
                last = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
        if last is not None and last[0] == "ok":
            return last[1]
        if last is None:
            raise InputError(
                f"{fn}: the helper process that evaluates the regular expression {label} "
                f"{_clip(shown[0])} of {where.rstrip(': ') or 'the config'} did not start within "
                f"{budget:.0f} s (exit status {proc.returncode}); the machine is overloaded: try "
                "again."
            )
        j, name = last[2], names[last[1]]
        key, mod = _clip(shown[j]), _clip(name)
        if last[0] == "invalid":
            raise InputError(
                f"{fn}: {where}{label} {key} is not a valid regular expression ({last[3]}; "
                f"matched against module {mod}); PEFT matches these as Python regexes: escape "
                "special characters, or write the module name or a suffix of it."
            )
        if last[0] == "timeout" or overall:
            within = f"{_REGEX_TIMEOUT} s" if last[0] == "timeout" else f"{budget:.0f} s in total"
            raise InputError(
                f"{fn}: {where}{label} {key} did not finish matching module {mod} within "
                f"{within}: the regex backtracks catastrophically (nested or overlapping "
                "repetition such as '(a+)+' or '(\\w|.)+'), and PEFT, which applies it with "
                "Python's re, would hang on it too. Rewrite it without nested repetition, or list "
                "the module names or their suffixes."
            )
        raise InputError(
            f"{fn}: {where}{label} {key} could not be evaluated on module {mod} "
            f"({last[3] if last[0] == 'failed' else 'the helper process stopped'}); rewrite it as "
            "a simpler regex or list the module names."
        )


def pattern_key(pattern_keys: Iterable[str], name: str) -> str | None:
    """The ``rank_pattern`` / ``alpha_pattern`` key PEFT applies to module ``name``, or None.

    PEFT's rule (``peft.utils.other.get_pattern_key``): each key is a regular expression, and the
    first key in dict order for which ``re.match(rf"(.*\\.)?({key})$", name)`` succeeds wins, so a
    key matches the whole name or a suffix of it that starts after a dot (``"q_proj"`` matches
    every ``....q_proj``; ``"layers.1.self_attn.q_proj"`` one module; unescaped dots match any
    character; a leading ``^`` forces the whole name: ``"^model.layers.0.q_proj"`` matches only
    that module, not ``"x.model.layers.0.q_proj"``).

    Keys are untrusted input (they come from a file), so the cost is bounded: plain keys
    (literal characters, ``.`` wildcards, ``\\.`` escapes, a leading ``^``) are matched directly,
    and any other regex is evaluated by Python's ``re`` in a helper process under a time limit
    (a quarter of a second per key and name).

    Args:
      pattern_keys: the keys of ``rank_pattern`` or ``alpha_pattern``, in the config's order.
      name: module name without the ``base_model.model.`` prefix.

    Returns:
      The first matching key, or None.

    Raises:
      ValueError: (:class:`InputError`) a key reached before a match that is not a valid regular
        expression, or that backtracks catastrophically (does not finish within the time limit).
      TypeError: (:class:`InputTypeError`) a key or the name is not a string.

    Example:
      >>> from netutility_jax import peft
      >>> peft.pattern_key(["k_proj", "layers.1.self_attn.q_proj", "q_proj"],
      ...                  "model.layers.1.self_attn.q_proj")
      'layers.1.self_attn.q_proj'
      >>> peft.pattern_key(["proj"], "model.layers.1.self_attn.q_proj") is None
      True
      >>> peft.pattern_key([r"^a\\.q"], "x.a.q") is None, peft.pattern_key([r"a\\.q"], "x.a.q")
      (True, 'a\\\\.q')
    """
    fn = "nu.peft.pattern_key"
    keys = list(pattern_keys)
    for label, x in [*(("a pattern key", k) for k in keys), ("name", name)]:
        if not isinstance(x, str):
            raise InputTypeError(
                f"{fn}: {label} is a {type(x).__name__} ({_clip(x)}); expected str."
            )
    j = _Regexes(fn).first_keys("pattern key", keys, [name])[0]
    return None if j < 0 else keys[j]


def _natural(name: str) -> list[Any]:
    # "layers.2" before "layers.10"
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _kind(p: pathlib.Path, *, fn: str) -> str:
    """``"missing"``, ``"dir"``, ``"file"`` or ``"other"`` (a pipe, a device ...) for path ``p``."""
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except PermissionError as e:
        raise FileAccessError(
            f"{fn}: cannot look at {str(p)!r} (permission denied): a folder on its path is not "
            "accessible to this user. Fix the permissions (chmod) or run as a user who can read "
            "it."
        ) from e
    except OSError as e:  # a symlink loop, a name too long ...
        raise MissingFileError(f"{fn}: cannot use the path {str(p)!r} ({e.strerror or e}).") from e
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    return "file" if stat.S_ISREG(st.st_mode) else "other"


def _readable_file(f: pathlib.Path, what: str, *, fn: str) -> None:
    """Refuse ``f`` unless it is a regular file this process can read."""
    kind = _kind(f, fn=fn)
    if kind == "missing":
        raise MissingFileError(
            f"{fn}: {str(f)!r} does not exist; a PEFT LoRA adapter directory holds {WEIGHTS_NAME} "
            f"and {CONFIG_NAME} (PeftModel.save_pretrained writes both)."
        )
    if kind == "dir":
        raise MissingFileError(
            f"{fn}: {str(f)!r} is a folder, expected {what} (a file); the adapter directory is "
            "malformed: save the adapter again with PEFT's save_pretrained."
        )
    if kind == "other":
        raise InputError(
            f"{fn}: {str(f)!r} is not a regular file (a pipe, socket or device), expected {what}."
        )
    try:
        with open(f, "rb"):
            pass
    except PermissionError as e:
        raise FileAccessError(
            f"{fn}: {str(f)!r} exists but cannot be read (permission denied); make it readable "
            "(chmod a+r) or run as a user who can read it."
        ) from e


def _directory(path: Any, *, fn: str) -> pathlib.Path:
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(
            f"{fn}: an adapter path is a {type(path).__name__} ({_clip(path)}); expected a str or "
            "os.PathLike naming the adapter directory."
        )
    p = pathlib.Path(os.fspath(path))
    kind = _kind(p, fn=fn)
    if kind == "missing":
        raise MissingFileError(
            f"{fn}: no such directory {str(p)!r}. Pass the local directory PEFT's save_pretrained "
            f"wrote (it holds {CONFIG_NAME} and {WEIGHTS_NAME}); for a Hugging Face Hub id, "
            "download it first with huggingface_hub.snapshot_download(repo_id)."
        )
    if kind != "dir":
        raise MissingFileError(
            f"{fn}: {str(p)!r} is a file, expected an adapter folder containing {CONFIG_NAME} and "
            f"{WEIGHTS_NAME}; pass its folder (here: {str(p.parent)!r})."
        )
    return p


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a PEFT adapter's ``adapter_config.json``.

    Args:
      path: the adapter directory.

    Returns:
      The config as a dict, as written (fields PEFT fills with defaults may be absent). Pass it as
      ``base_config`` to :func:`save_adapter` to carry over the base model, task type and target
      modules.

    Raises:
      FileNotFoundError: (:class:`MissingFileError`) no such directory, no
        ``adapter_config.json`` in it, ``path`` is a file, or ``adapter_config.json`` is a folder.
      PermissionError: (:class:`FileAccessError`) the file exists but cannot be read.
      ValueError: (:class:`InputError`) the file is not valid JSON or not a JSON object.

    Example:
      >>> import json, pathlib, tempfile
      >>> from netutility_jax import peft
      >>> tmp = tempfile.TemporaryDirectory()
      >>> d = pathlib.Path(tmp.name)
      >>> _ = (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
      >>> peft.load_config(d)["r"]
      4
      >>> tmp.cleanup()
    """
    fn = "nu.peft.load_config"
    d = _directory(path, fn=fn)
    f = d / CONFIG_NAME
    _readable_file(f, f"the JSON file {CONFIG_NAME}", fn=fn)
    try:
        with open(f, encoding="utf-8") as fh:
            cfg = json.loads(fh.read())
    except PermissionError as e:
        raise FileAccessError(
            f"{fn}: {str(f)!r} exists but cannot be read (permission denied); make it readable "
            "(chmod a+r) or run as a user who can read it."
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(
            f"{fn}: {str(f)!r} is not valid JSON ({_clip(str(e), 200)}); the file is corrupt or "
            "truncated: re-save the adapter with PEFT's save_pretrained."
        ) from e
    if not isinstance(cfg, dict):
        raise InputError(
            f"{fn}: {str(f)!r} holds a JSON {type(cfg).__name__}, expected an object with the "
            "LoraConfig fields (peft_type, r, lora_alpha, target_modules, ...)."
        )
    return cfg


def _check_lora_config(cfg: Mapping[str, Any], f: pathlib.Path, *, fn: str) -> None:
    """Refuse configs whose update is not ``scale * B A`` on the base weights."""
    where = f"{fn}: {str(f)!r}"
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InputError(
            f"{where} has peft_type={_clip(peft_type)}; only LoRA adapters (peft_type 'LORA') can be "
            "loaded."
        )
    if cfg.get("use_dora"):
        raise InputError(
            f"{where} has use_dora=true: a DoRA adapter rescales the weight columns by a learned "
            "magnitude, so its update is not scale * B A and cannot be merged as LoRA. Use a plain "
            "LoRA adapter, or load it with PEFT and merge_and_unload() it into the base weights."
        )
    if cfg.get("lora_bias"):
        raise InputError(
            f"{where} has lora_bias=true: its lora_B layers carry a bias, which a LoRA update "
            "scale * B A cannot hold. Use an adapter trained with lora_bias=false."
        )
    if cfg.get("target_parameters"):
        raise InputError(
            f"{where} sets target_parameters={_clip(cfg['target_parameters'])}: LoRA on raw "
            "parameters (e.g. MoE experts) has a different layout and is not supported; only LoRA "
            "on Linear / Conv1D modules (target_modules) is."
        )
    if cfg.get("use_qalora"):
        raise InputError(
            f"{where} has use_qalora=true: QA-LoRA's lora_A acts on pooled input groups, so its "
            "update is not scale * B A on the full input. Use a plain LoRA adapter."
        )
    if cfg.get("alora_invocation_tokens"):
        raise InputError(
            f"{where} is an activated LoRA (alora_invocation_tokens set): its update applies only "
            "after the invocation tokens, which a merged weight update cannot express."
        )
    init = str(cfg.get("init_lora_weights", True)).lower()
    if any(init.startswith(p) for p in _MUTATING_INITS):
        raise InputError(
            f"{where} has init_lora_weights={_clip(cfg['init_lora_weights'])}: this initialisation "
            "rewrites the base weights, so the saved update is relative to the rewritten weights. "
            "Re-save it with PEFT: model.save_pretrained(out, "
            "path_initial_model_for_weight_conversion=<dir of the initial adapter>), which "
            "converts it into an ordinary LoRA update of the original base model."
        )
    for field in ("rank_pattern", "alpha_pattern"):
        v = cfg.get(field)
        if v is not None and not isinstance(v, dict):
            raise InputError(
                f"{where}: {field} is a {type(v).__name__}; expected an object mapping module-name "
                "patterns to values."
            )
    rslora = cfg.get("use_rslora", False)
    if rslora is not None and not isinstance(rslora, bool):
        raise InputError(
            f"{where}: use_rslora is {_clip(rslora)}; expected true or false (it decides the scale "
            "lora_alpha / r or lora_alpha / sqrt(r))."
        )


def _split_key(key: str) -> tuple[str, str | None, str | None, str]:
    """``(module, kind, adapter_name, param)``; kind None for a tensor that is not a LoRA part."""
    body = key.removeprefix(PREFIX)
    parts = body.split(".")
    for i, p in enumerate(parts):
        if p.startswith("lora_"):
            rest = parts[i + 1 :]
            param = rest[-1] if rest and rest[-1] in ("weight", "bias") else ""
            names = rest[:-1] if param else rest
            adapter = names[0] if len(names) == 1 else None
            if len(names) > 1:
                return ".".join(parts[:i]), None, None, ""
            return ".".join(parts[:i]), p, adapter, param
    return body, None, None, ""


def _open_weights(f: pathlib.Path, *, fn: str):
    st = _safetensors()
    try:
        return st.safe_open(str(f), framework="flax")
    except st.SafetensorError as e:
        raise InputError(
            f"{fn}: {str(f)!r} is not a readable safetensors file ({_clip(str(e), 200)}); it is "
            "corrupt or truncated (an interrupted download or copy): download or save it again."
        ) from e
    except FileNotFoundError as e:  # safetensors reports any failure to open this way
        _readable_file(f, f"the safetensors file {WEIGHTS_NAME}", fn=fn)
        raise MissingFileError(f"{fn}: could not open {str(f)!r} ({e}).") from e


def _check_bool(value: Any, name: str, *, fn: str) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise InputTypeError(f"{fn}: {name}={_clip(value)}; expected True or False.")


def load_adapter(path: str | os.PathLike, *, strict: bool = True) -> dict[str, dict[str, Any]]:
    """Load a PEFT LoRA adapter as a flat adapter keyed by PEFT module names.

    Reads ``adapter_config.json`` and ``adapter_model.safetensors`` (bf16 / fp16 weights are upcast
    to float32). Module ``<module>``'s update in kernel layout is

    ``dK = scale * lora_a @ lora_b = scale * A^T B^T``, ``scale = lora_alpha / r`` (rsLoRA:
    ``lora_alpha / sqrt(r)``),

    with ``r`` and ``lora_alpha`` per module from ``rank_pattern`` / ``alpha_pattern``
    (:func:`pattern_key`) and the config's ``r`` / ``lora_alpha`` otherwise. Keys with an adapter
    name (``lora_A.default.weight``) are accepted. ``fan_in_fan_out`` needs no special handling:
    the factors have the same shapes either way (module docstring).

    The pattern keys are regular expressions from the file: plain ones are matched directly, any
    other is evaluated with Python's ``re`` (PEFT's rule, exactly) under a time limit, so a key
    that backtracks catastrophically is an error within a fraction of a second, not a hang.

    Args:
      path: the adapter directory (what ``PeftModel.save_pretrained`` wrote).
      strict: if True, refuse tensors that are not LoRA factors (``modules_to_save`` copies,
        trainable tokens, trained biases); if False, skip them (the merge then lacks them). The
        ``netutility`` command's flag for False is ``--skip-non-lora``.

    Returns:
      ``{name: {"lora_a": (d_in, r), "lora_b": (r, d_out), "scale": float}}`` with names like
      ``"model.layers.0.self_attn.q_proj"`` (no ``base_model.model.`` prefix), in natural order;
      arrays are ``jax.Array`` (float32, or float64 if stored so and x64 is on).

    Raises:
      FileNotFoundError: (:class:`MissingFileError`) missing directory or files, a file where the
        directory is expected, or a folder where a file is expected.
      PermissionError: (:class:`FileAccessError`) a file or folder exists but cannot be read.
      ValueError: (:class:`InputError`) only a pickled ``adapter_model.bin``; corrupt JSON or
        safetensors; a DoRA, lora_bias, QA-LoRA, aLoRA, target_parameters or unconverted
        PiSSA/OLoRA/CorDA/LoRA-GA adapter; LoRA on embeddings or convolutions; several adapter
        names in one file; a lora_A without its lora_B (or the reverse); factor shapes that
        disagree with each other or with ``r``; rank-0 factors; ``r`` not a positive integer;
        ``lora_alpha`` not a finite number; ``use_rslora`` not a boolean; a ``rank_pattern`` /
        ``alpha_pattern`` key that is not a valid regex or does not finish matching a module name
        within the time limit; non-LoRA tensors with ``strict=True``.
      TypeError: (:class:`InputTypeError`) non-floating factors; ``strict`` not a bool.

    Example:
      >>> import json, pathlib, tempfile
      >>> import numpy as np, safetensors.numpy
      >>> import netutility_jax as nu
      >>> from netutility_jax import peft
      >>> tmp = tempfile.TemporaryDirectory()
      >>> d = pathlib.Path(tmp.name)
      >>> _ = (d / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
      >>> A, B = np.ones((2, 3), np.float32), np.ones((5, 2), np.float32)  # (r, d_in), (d_out, r)
      >>> safetensors.numpy.save_file(
      ...     {"base_model.model.layer.q.lora_A.weight": A, "base_model.model.layer.q.lora_B.weight": B},
      ...     str(d / "adapter_model.safetensors"))
      >>> ad = peft.load_adapter(d)
      >>> ad["layer.q"]["lora_a"].shape, ad["layer.q"]["scale"]
      ((3, 2), 2.0)
      >>> bool(np.allclose(nu.module_update(ad["layer.q"]), 2.0 * (B @ A).T))
      True
      >>> tmp.cleanup()
    """
    fn = "nu.peft.load_adapter"
    _check_bool(strict, "strict", fn=fn)
    d = _directory(path, fn=fn)
    wf = d / WEIGHTS_NAME
    if _kind(wf, fn=fn) == "missing" and _kind(d / PICKLE_NAME, fn=fn) == "file":
        raise InputError(
            f"{fn}: {str(d)!r} holds only the pickled {PICKLE_NAME}, which is never unpickled "
            "here (loading a pickle can run arbitrary code). Convert it once with PEFT: "
            "PeftModel.from_pretrained(base_model, dir).save_pretrained(out, "
            f"safe_serialization=True), which writes {WEIGHTS_NAME}."
        )
    _readable_file(wf, f"the safetensors file {WEIGHTS_NAME}", fn=fn)
    cfg = load_config(d)
    cf = d / CONFIG_NAME
    where = f"{str(cf)!r}"
    _check_lora_config(cfg, cf, fn=fn)
    r_default = cfg.get("r", _DEFAULT_R)
    alpha_default = cfg.get("lora_alpha", _DEFAULT_ALPHA)
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora", False))

    factors: dict[str, dict[str, str]] = {}
    adapter_names: set[str] = set()
    with _open_weights(wf, fn=fn) as fh:
        shapes: dict[str, tuple[int, ...]] = {}
        try:
            keys = list(fh.keys())
            for k in keys:
                shapes[k] = tuple(fh.get_slice(k).get_shape())
        except _safetensors().SafetensorError as e:
            raise InputError(
                f"{fn}: {str(wf)!r} is not a readable safetensors file ({_clip(str(e), 200)}); it "
                "is corrupt or truncated: download or save it again."
            ) from e
        for k in keys:
            module, kind, adapter_name, param = _split_key(k)
            if kind is None:
                if strict:
                    raise InputError(
                        f"{fn}: {str(wf)!r} holds {_clip(k)} {shapes[k]}, which is not a LoRA "
                        "factor (a modules_to_save copy, trainable tokens or a trained bias). A "
                        "merge of LoRA updates cannot carry it; pass strict=False (CLI: "
                        "--skip-non-lora) to skip such tensors."
                    )
                continue
            if kind == "lora_magnitude_vector":
                raise InputError(
                    f"{fn}: {str(wf)!r} holds the DoRA magnitude {_clip(k)}: DoRA adapters are "
                    "not scale * B A updates and cannot be merged as LoRA."
                )
            if kind in ("lora_embedding_A", "lora_embedding_B"):
                raise InputError(
                    f"{fn}: {str(wf)!r} holds {_clip(k)}: LoRA on an embedding layer "
                    f"({_clip(module)}) is not supported; train the adapter without embedding "
                    "layers in target_modules."
                )
            if kind not in ("lora_A", "lora_B"):
                raise InputError(
                    f"{fn}: {str(wf)!r} holds {_clip(k)} ({_clip(kind)}), which is not part of a "
                    "LoRA adapter (lora_A / lora_B); was it saved by another PEFT method?"
                )
            if param == "bias":
                raise InputError(
                    f"{fn}: {str(wf)!r} holds the bias {_clip(k)}: an adapter trained with "
                    "lora_bias=true is not a pure scale * B A update and cannot be merged as LoRA."
                )
            if adapter_name is not None:
                adapter_names.add(adapter_name)
            slot = factors.setdefault(module, {})
            if kind in slot:
                raise InputError(
                    f"{fn}: {str(wf)!r} holds two {kind} tensors for module {_clip(module)} "
                    f"({_clip(slot[kind])} and {_clip(k)}); keep one adapter per directory."
                )
            slot[kind] = k
        if len(adapter_names) > 1:
            names = sorted(adapter_names)
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise InputError(
                f"{fn}: {str(wf)!r} holds several adapters "
                f"([{', '.join(_clip(n) for n in names[:3])}{more}]); save each with PEFT's "
                "save_pretrained(..., selected_adapters=[name]) and load them one by one."
            )
        if not factors:
            raise InputError(
                f"{fn}: {str(wf)!r} holds no LoRA factors (no '...lora_A.weight' / "
                "'...lora_B.weight' keys); it is not a LoRA adapter."
            )

        modules = sorted(factors, key=_natural)
        rx = _Regexes(fn, f"{where}: ")
        r_hits = rx.first_keys("rank_pattern key", list(rank_pattern), modules)
        a_hits = rx.first_keys("alpha_pattern key", list(alpha_pattern), modules)
        out: dict[str, dict[str, Any]] = {}
        for module, r_hit, a_hit in zip(modules, r_hits, a_hits, strict=True):
            slot = factors[module]
            for have, need in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
                if have in slot and need not in slot:
                    raise InputError(
                        f"{fn}: {str(wf)!r} has {_clip(slot[have])} {shapes[slot[have]]} but no "
                        f"{need} for module {_clip(module)}; the file is incomplete: save the "
                        "adapter again."
                    )
            ka, kb = slot["lora_A"], slot["lora_B"]
            sa, sb = shapes[ka], shapes[kb]
            if len(sa) != 2 or len(sb) != 2:
                raise InputError(
                    f"{fn}: module {_clip(module)} in {str(wf)!r} has lora_A {sa} and lora_B {sb}; "
                    "only 2-D factors (LoRA on Linear / Conv1D) are supported, not LoRA on "
                    "convolutions."
                )
            if sa[0] != sb[1]:
                raise InputError(
                    f"{fn}: module {_clip(module)} in {str(wf)!r} has lora_A {sa} = (r, d_in) but "
                    f"lora_B {sb} = (d_out, r) with a different r; the file is corrupt: save the "
                    "adapter again."
                )
            if sa[0] == 0:
                raise InputError(
                    f"{fn}: {str(wf)!r} holds rank-0 factors for module {_clip(module)} "
                    f"({_clip(ka)} {sa}, {_clip(kb)} {sb}); PEFT adapters have r >= 1 and never "
                    "save rank 0, so the file was not written by PEFT or is corrupt: save the "
                    "adapter again."
                )
            r, r_src = _config_value(rank_pattern, r_hit, module, r_default, "r", "rank_pattern")
            alpha, a_src = _config_value(
                alpha_pattern, a_hit, module, alpha_default, "lora_alpha", "alpha_pattern"
            )
            if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r <= 0:
                raise InputError(
                    f"{fn}: {where} gives module {_clip(module)} r={_clip(r)} ({r_src}); expected "
                    "a positive integer (the rank of lora_A / lora_B)."
                )
            if sa[0] != r:
                raise InputError(
                    f"{fn}: module {_clip(module)} has lora_A {sa} and lora_B {sb} (rank {sa[0]}) "
                    f"in {str(wf)!r}, but {where} gives it r={_clip(r)} (r / rank_pattern); the "
                    "config does not belong to these weights: keep each adapter's config with its "
                    "weights."
                )
            if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
                raise InputError(
                    f"{fn}: {where} gives module {_clip(module)} lora_alpha={_clip(alpha)} "
                    f"({a_src}); expected a number."
                )
            try:
                alpha_f = float(alpha)
            except OverflowError:
                alpha_f = math.inf
            if not math.isfinite(alpha_f):
                raise InputError(
                    f"{fn}: {where} gives module {_clip(module)} lora_alpha={_clip(alpha)} "
                    f"({a_src}); expected a finite number (the scale is lora_alpha / r)."
                )
            scale = alpha_f / (math.sqrt(r) if rslora else float(r))
            a = fh.get_tensor(ka)
            b = fh.get_tensor(kb)
            for k, x in ((ka, a), (kb, b)):
                if not jnp.issubdtype(x.dtype, jnp.floating):
                    raise InputTypeError(
                        f"{fn}: {_clip(k)} in {str(wf)!r} has dtype {x.dtype}; LoRA factors are "
                        "floating point (float32, bf16, fp16)."
                    )
            out[module] = {"lora_a": _upcast(a), "lora_b": _upcast(b), "scale": scale}
    return out


def _config_value(
    pattern: Mapping[str, Any], hit: int, module: str, default: Any, field: str, pfield: str
) -> tuple[Any, str]:
    """A module's value of ``r`` / ``lora_alpha`` and where it came from, as PEFT resolves it."""
    if hit >= 0:
        key = list(pattern)[hit]
        return pattern[key], f"{pfield}[{_clip(key)}]"
    # PEFT falls back to looking the name itself up; a name always matches itself as a regex
    # unless it holds regex syntax, which module names do not, but stay faithful.
    if module in pattern:
        return pattern[module], f"{pfield}[{_clip(module)}]"
    return default, field


def _upcast(x: Any) -> jax.Array:
    # transpose and upcast on the host: eager jnp ops would compile once per factor shape
    arr = np.asarray(x)
    if arr.dtype != np.float64:
        arr = arr.astype(np.float32)
    return jnp.asarray(np.ascontiguousarray(arr.T))


class LoadedAdapters(NamedTuple):
    """What :func:`load_adapters` returns.

    Attributes:
      adapters: one flat adapter per path (as from :func:`load_adapter`), ready for
        :func:`nu.merge_adapters`. Every adapter has every module of the union of the adapters'
        modules, in natural order, with ``None`` where that task lacks the module (it then
        contributes nothing there).
      config: the base-model fields of the first adapter's config (``base_model_name_or_path``,
        ``task_type``, ``target_modules``, ...; see ``CARRIED_FIELDS``), for
        :func:`save_adapter`'s ``base_config``. Its target fields cover every module of the
        union: where the first adapter's do not, ``target_modules`` is the union of the adapters'
        lists (when every adapter lists plain names without ``exclude_modules`` /
        ``layers_to_transform``), or the target fields are left out, so that
        :func:`save_adapter` writes the exact module names.
      coverage: ``{module: (task indices that have it, ...)}`` in the adapters' module order
        (computed from ``adapters``, so the tuple still unpacks as ``adapters, config``).
    """

    adapters: list[dict[str, dict[str, Any] | None]]
    config: dict[str, Any]

    @property
    def coverage(self) -> dict[str, tuple[int, ...]]:
        names = dict.fromkeys(n for ad in self.adapters for n in ad)
        return {
            n: tuple(i for i, ad in enumerate(self.adapters) if ad.get(n) is not None)
            for n in names
        }


def check_compatible(
    adapters: Sequence[Mapping[str, Any]],
    *,
    labels: Sequence[str] | None = None,
    strict_targets: bool = True,
) -> None:
    """Check that adapters fit the same base model: equal update shapes, and the same modules.

    Ranks may differ between adapters; the update shape ``(d_in, d_out)`` of a module may not,
    wherever two adapters both have it. A module whose value is ``None`` counts as absent.

    Args:
      adapters: flat adapters as from :func:`load_adapter` (``None`` values allowed).
      labels: how to name each adapter in messages (e.g. its path); default ``"adapter i"``.
      strict_targets: if True, the adapters must also have the same modules; if False, they may
        target different modules (a merge then takes the union, and a task contributes nothing
        where it lacks a module).

    Raises:
      ValueError: (:class:`InputError`) naming the first modules that one adapter lacks (with
        ``strict_targets=True``), or the first module whose ``(d_in, d_out)`` differs, with both
        shapes and both labels.

    Example:
      >>> import numpy as np
      >>> from netutility_jax import peft
      >>> a = {"q": {"lora_a": np.ones((8, 2)), "lora_b": np.ones((2, 4))}}
      >>> b = {"q": {"lora_a": np.ones((8, 3)), "lora_b": np.ones((3, 4))}}
      >>> peft.check_compatible([a, b])  # different ranks are fine
      >>> c = {"k": {"lora_a": np.ones((8, 3)), "lora_b": np.ones((3, 4))}}
      >>> peft.check_compatible([a, c], strict_targets=False)  # different modules too
    """
    fn = "nu.peft.check_compatible"
    _check_bool(strict_targets, "strict_targets", fn=fn)
    _check_compatible(adapters, labels, strict_targets=strict_targets, fn=fn)


def _check_compatible(
    adapters: Sequence[Mapping[str, Any]],
    labels: Sequence[str] | None,
    *,
    strict_targets: bool,
    fn: str,
) -> None:
    if labels is None:
        labels = [f"adapter {i}" for i in range(len(adapters))]
    if len(labels) != len(adapters):
        raise InputError(f"{fn}: {len(labels)} labels for {len(adapters)} adapters.")
    if not adapters:
        raise InputError(f"{fn}: no adapters given.")
    present = [[n for n, m in ad.items() if m is not None] for ad in adapters]
    if strict_targets:
        ref, ref_label = set(present[0]), labels[0]
        for names, label in zip(present[1:], labels[1:], strict=True):
            have = set(names)
            for xs, x_has, lx, ly in (
                (present[0], have, ref_label, label),
                (names, ref, label, ref_label),
            ):
                missing = sorted((n for n in xs if n not in x_has), key=_natural)
                if missing:
                    verb = "is" if len(missing) == 1 else "are"
                    raise InputError(
                        f"{fn}: {_few(missing)} {verb} in {lx} but not in {ly}: the adapters "
                        "target different modules, which strict_targets=True (CLI: "
                        "--strict-targets) refuses. Pass strict_targets=False to merge the union "
                        "of their modules (a task contributes nothing where it lacks a module)."
                    )
    first: dict[str, tuple[tuple[int, int], str]] = {}
    for ad, names, label in zip(adapters, present, labels, strict=True):
        for name in names:
            shape = _update_shape(ad[name])
            if name not in first:
                first[name] = (shape, label)
                continue
            s0, l0 = first[name]
            if shape != s0:
                raise InputError(
                    f"{fn}: module {_clip(name)} has update shape (d_in, d_out) = {s0} in {l0} "
                    f"but {shape} in {label}; the adapters were trained on different base models "
                    "and cannot be merged."
                )


def _update_shape(mod: Mapping[str, Any]) -> tuple[int, int]:
    if "delta" in mod:
        return tuple(int(n) for n in mod["delta"].shape)  # type: ignore[return-value]
    return int(mod["lora_a"].shape[0]), int(mod["lora_b"].shape[1])


def load_adapters(
    paths: Sequence[str | os.PathLike],
    *,
    strict: bool = True,
    strict_targets: bool = False,
    allow_different_base: bool = False,
) -> LoadedAdapters:
    """Load several PEFT adapters for one merge and check they fit the same base model.

    Adapters of one base model may target different modules (one task on ``q_proj, v_proj``,
    another on every linear layer): the result covers the union of their modules, with ``None``
    where a task lacks one, which :func:`nu.merge_adapters` reads as "this task contributes nothing
    here". Update shapes must agree wherever two adapters have the same module.

    Args:
      paths: adapter directories, one per task.
      strict: as for :func:`load_adapter` (CLI: ``--skip-non-lora`` for False).
      strict_targets: if True, refuse adapters that target different modules instead of merging
        the union (CLI: ``--strict-targets``).
      allow_different_base: if True, accept adapters whose configs name different
        ``base_model_name_or_path`` (e.g. a Hub id and a local copy of the same model; CLI:
        ``--allow-different-base``). A config without a base model (missing, null or empty)
        names an unknown one and is never refused for it.

    Returns:
      :class:`LoadedAdapters` ``(adapters, config)`` with ``.coverage``; ``config`` holds the
      base-model fields of the first adapter's config (the others may differ only in training
      settings such as ``r``, and in their target modules), with target fields that cover the
      union of the modules.

    Raises:
      ValueError: (:class:`InputError`) no paths; different base models (naming both, and both
        paths) without ``allow_different_base``; different update shapes of a module (naming
        it, both shapes and both paths); different modules with ``strict_targets=True``; a
        first config whose target fields are malformed or hold a regex that cannot be evaluated
        in time; everything :func:`load_adapter` raises.
      TypeError: (:class:`InputTypeError`) an option that is not a bool.
      FileNotFoundError, PermissionError: as for :func:`load_adapter`.
    """
    fn = "nu.peft.load_adapters"
    if isinstance(paths, (str, os.PathLike)) or not isinstance(paths, Sequence) or not paths:
        raise InputError(
            f"{fn}: expected a non-empty list of adapter directories, got {_clip(paths)}; for one "
            "adapter use nu.peft.load_adapter(path)."
        )
    for name, v in (
        ("strict", strict),
        ("strict_targets", strict_targets),
        ("allow_different_base", allow_different_base),
    ):
        _check_bool(v, name, fn=fn)
    configs = [load_config(p) for p in paths]  # cheap: refuse different bases before the weights
    labels = [repr(os.fspath(p)) for p in paths]
    if not allow_different_base:
        _check_same_base(configs, labels, fn=fn)
    loaded = [load_adapter(p, strict=strict) for p in paths]
    _check_compatible(loaded, labels, strict_targets=strict_targets, fn=fn)
    names = sorted({n for ad in loaded for n in ad}, key=_natural)
    adapters = [{n: ad.get(n) for n in names} for ad in loaded]
    where = f"{str(pathlib.Path(os.fspath(paths[0])) / CONFIG_NAME)!r}: "
    return LoadedAdapters(adapters, _union_config(configs, names, where=where, fn=fn))


def _check_same_base(configs: Sequence[Mapping[str, Any]], labels: Sequence[str], *, fn: str):
    known = [
        (c.get("base_model_name_or_path"), lab) for c, lab in zip(configs, labels, strict=True)
    ]
    known = [(b, lab) for b, lab in known if b is not None and b != ""]
    for b, lab in known[1:]:
        b0, lab0 = known[0]
        if b != b0:
            raise InputError(
                f"{fn}: the adapters were trained on different base models: {lab0} on "
                f"{_clip(b0)} but {lab} on {_clip(b)} (base_model_name_or_path); a merge of "
                "updates to different weights is meaningless. If both name the same model (a Hub "
                "id and a local copy), pass allow_different_base=True (CLI: "
                "--allow-different-base)."
            )


# target_modules and the fields that restrict it (PEFT's check_target_module_exists)
_TARGET_FIELDS = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")


def _union_config(
    configs: Sequence[Mapping[str, Any]], names: Sequence[str], *, where: str, fn: str
) -> dict[str, Any]:
    """The first config's carried fields, with target fields that cover all of ``names``."""
    carried = _carried(configs[0])
    rx = _Regexes(fn, where)
    if not _untargeted(carried, names, rx, fn=fn):
        return carried
    out = {k: v for k, v in carried.items() if k not in _TARGET_FIELDS}
    lists = [_jsonable(c.get("target_modules")) for c in configs]
    plain = all(
        isinstance(t, list) and all(isinstance(x, str) for x in t) for t in lists
    ) and not any(c.get(k) for c in configs for k in _TARGET_FIELDS[1:])
    if plain:
        union = {**out, "target_modules": sorted({x for t in lists for x in t})}
        if not _untargeted(union, names, rx, fn=fn):
            return union
    return out


def _carried(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _jsonable(cfg[k]) for k in CARRIED_FIELDS if k in cfg and cfg[k] is not None}


def _jsonable(v: Any) -> Any:
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    if hasattr(v, "value") and isinstance(getattr(v, "value", None), str):  # str enums
        return v.value
    return v


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def _modules_for_save(adapter: Any, *, fn: str) -> dict[str, Mapping[str, Any]]:
    if not isinstance(adapter, Mapping):
        raise InputTypeError(
            f"{fn}: adapter is a {type(adapter).__name__}; expected a dict keyed by PEFT module "
            "names (as nu.peft.load_adapter and nu.merge_adapters return)."
        )
    out: dict[str, Mapping[str, Any]] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        name = ".".join(path)
        if isinstance(node, Mapping) and ({"lora_a", "lora_b", "delta"} & set(node.keys())):
            out[name] = node
            return
        if isinstance(node, Mapping):
            for k in node:
                walk(node[k], (*path, str(k)))
            return
        raise InputError(
            f"{fn}: {name!r} holds a {type(node).__name__}, not a module; expected "
            "{'lora_a', 'lora_b', 'scale'} or {'delta'} dicts keyed by PEFT module names."
        )

    walk(adapter, ())
    if not out:
        raise InputError(f"{fn}: the adapter has no modules.")
    for name in out:
        if not name or "/" in name or name.startswith(PREFIX):
            raise InputError(
                f"{fn}: module name {name!r} is not a PEFT module name: expected the dotted path "
                "of a module in the transformers model without the 'base_model.model.' prefix "
                "(e.g. 'model.layers.0.self_attn.q_proj'), as nu.peft.load_adapter returns."
            )
    return out


def _host(x: Any, label: str, name: str, *, fn: str) -> np.ndarray:
    if isinstance(x, jax.core.Tracer):
        raise InputTypeError(
            f"{fn}: {label} of module {name!r} is traced; call save_adapter outside jit."
        )
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name not in ("bfloat16",):
        raise InputTypeError(
            f"{fn}: {label} of module {name!r} has dtype {arr.dtype}; expected floating point."
        )
    if arr.ndim != 2:
        raise InputError(f"{fn}: {label} of module {name!r} has shape {arr.shape}; expected 2-D.")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise InputError(
            f"{fn}: {label} of module {name!r} {arr.shape} has non-finite entries; PEFT would "
            "load NaN/inf weights."
        )
    return arr


def _peft_factors(
    name: str, mod: Mapping[str, Any], rank: int | None, *, fn: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(A (r, d_in), B (d_out, r))`` in float64 with ``B A = dK^T`` exactly (PEFT scale 1)."""
    if "delta" in mod:
        delta = _host(mod["delta"], "delta", name, fn=fn)
        if rank is None:
            raise InputError(
                f"{fn}: module {name!r} is dense ({{'delta': {delta.shape}}}, e.g. from TIES or "
                "DARE in full space) and PEFT stores only low-rank factors. Pass rank=k to "
                "truncate dense modules by SVD (the best rank-k approximation), or truncate "
                "yourself with nu.to_lora(module, k)."
            )
        u, s, vt = np.linalg.svd(delta, full_matrices=False)
        k = min(rank, s.shape[0])
        root = np.sqrt(s[:k])
        # balanced split: both factors carry sqrt(s), like a trained LoRA
        return (u[:, :k] * root).T, (root[:, None] * vt[:k]).T
    if "lora_a" not in mod or "lora_b" not in mod:
        raise InputError(
            f"{fn}: module {name!r} has keys {sorted(mod.keys())}; a LoRA module needs both "
            "'lora_a' (d_in, r) and 'lora_b' (r, d_out)."
        )
    a = _host(mod["lora_a"], "lora_a", name, fn=fn)
    b = _host(mod["lora_b"], "lora_b", name, fn=fn)
    if a.shape[1] != b.shape[0]:
        raise InputError(
            f"{fn}: factors of module {name!r} do not chain: lora_a {a.shape} is (d_in, r) but "
            f"lora_b {b.shape} is (r, d_out)."
        )
    scale = np.asarray(mod.get("scale", 1.0), np.float64)
    if scale.shape != () or not np.isfinite(scale):
        raise InputError(f"{fn}: scale of module {name!r} is {scale!r}; expected a finite scalar.")
    if a.shape[1] == 0:
        # nothing kept here: PEFT needs r >= 1, so write one zero direction (update exactly 0)
        return np.zeros((1, a.shape[0])), np.zeros((b.shape[1], 1))
    return a.T, (float(scale) * b).T


def _rank_patterns(ranks: Mapping[str, int]) -> tuple[int, dict[str, int]]:
    """Default ``r`` (the most common rank) and a ``rank_pattern`` for the other modules.

    Keys are ``"^" + re.escape(name)``, the form PEFT documents for an exact match: under its rule
    ``(.*\\.)?(key)$`` the anchor forces the optional prefix to be empty, so a key matches its own
    module only, whatever the key order (PEFT sorts the keys when it re-saves a config).
    """
    counts: dict[int, int] = {}
    for r in ranks.values():
        counts[r] = counts.get(r, 0) + 1
    r0 = min(counts, key=lambda r: (-counts[r], r))
    listed = sorted((n for n, r in ranks.items() if r != r0), key=_natural)
    return r0, {"^" + re.escape(n): ranks[n] for n in listed}


def _check_target_fields(cfg: Mapping[str, Any], *, fn: str, where: str) -> None:
    """Refuse target fields of the wrong type (PEFT would crash or misread them)."""

    def strs(v: Any) -> bool:
        return isinstance(v, str) or (
            isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)
        )

    def ints(v: Any) -> bool:
        def one(x: Any) -> bool:
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        return one(v) or (isinstance(v, (list, tuple)) and all(one(x) for x in v))

    for field, ok, want in (
        ("target_modules", strs, "a regex string or a list of module names"),
        ("exclude_modules", strs, "a regex string or a list of module names"),
        ("layers_to_transform", ints, "a layer index or a list of them"),
        ("layers_pattern", strs, "a string or a list of strings"),
    ):
        v = cfg.get(field)
        if v is not None and not ok(v):
            raise InputError(
                f"{fn}: {where}{field} is {_clip(v)}; expected {want} (as PEFT's LoraConfig)."
            )


def _untargeted(
    cfg: Mapping[str, Any], names: Sequence[str], rx: _Regexes, *, fn: str
) -> list[str]:
    """The modules among ``names`` that PEFT would not put a LoRA layer on under this config.

    PEFT's rule (``check_target_module_exists``): ``exclude_modules`` wins; a string
    ``target_modules`` is a regex that must match the whole name; a list matches the name itself
    or a suffix after a dot, and then ``layers_to_transform`` (with ``layers_pattern``) restricts
    the layer index. Each regex is evaluated (boundedly, see :class:`_Regexes`) only on the names
    PEFT would evaluate it on.
    """
    _check_target_fields(cfg, fn=fn, where=rx.where)
    names = list(names)
    exclude = cfg.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            hit = rx.fullmatch("exclude_modules pattern", exclude, names)
        else:
            excluded, ends = set(exclude), tuple("." + e for e in exclude)
            hit = [n in excluded or n.endswith(ends) for n in names]
        out = [n for n, h in zip(names, hit, strict=True) if h]
        names = [n for n, h in zip(names, hit, strict=True) if not h]
    else:
        out = []
    target = cfg.get("target_modules")
    if target is None:
        out += names
    elif isinstance(target, str):
        if target != "all-linear":
            hit = rx.fullmatch("target_modules pattern", target, names)
            out += [n for n, h in zip(names, hit, strict=True) if not h]
    else:
        listed = set(target)
        rest = [n for n in names if n not in listed]  # a listed name is adapted, whatever layer
        ends = tuple("." + t for t in target)
        suffix = [n for n in rest if n.endswith(ends)]
        out += [n for n in rest if not n.endswith(ends)]
        layers = cfg.get("layers_to_transform")
        if suffix and layers is not None and not (isinstance(layers, (list, tuple)) and not layers):
            patterns = cfg.get("layers_pattern")
            idx = rx.layer_index(
                "layers_pattern",
                [patterns] if isinstance(patterns, str) and patterns else patterns,
                suffix,
            )
            for n, i in zip(suffix, idx, strict=True):
                if i is None or (
                    i != layers if isinstance(layers, numbers.Integral) else i not in layers
                ):
                    out.append(n)
    return sorted(out, key=_natural)


def _targeted(cfg: Mapping[str, Any], name: str) -> bool:
    """Whether PEFT would put a LoRA layer on module ``name`` under this config."""
    return not _untargeted(cfg, [name], _Regexes("nu.peft"), fn="nu.peft")


def _check_targets(cfg: Mapping[str, Any], names: Iterable[str], *, fn: str) -> None:
    missed = _untargeted(cfg, list(names), _Regexes(fn), fn=fn)
    if missed:
        shown = []
        for k in _TARGET_FIELDS:
            v = cfg.get(k)
            if v is None:
                continue
            if isinstance(v, (list, tuple)) and len(v) > 3:
                shown.append(f"{k}=[{_few([str(x) for x in v])}]")
            else:
                shown.append(f"{k}={_clip(v)}")
        raise InputError(
            f"{fn}: with {', '.join(shown) or 'no target_modules'} PEFT would not adapt "
            f"{_few(missed)}, so {'its' if len(missed) == 1 else 'their'} weights would not be "
            "loaded. Leave target_modules out (the exact module names are then written) or make "
            "these fields cover every module of the adapter."
        )


def _resolve_base_config(base_config: Any, *, fn: str) -> dict[str, Any]:
    if base_config is None:
        return {}
    if isinstance(base_config, (str, os.PathLike)):
        return _carried(load_config(base_config))
    if hasattr(base_config, "to_dict") and not isinstance(base_config, Mapping):
        base_config = base_config.to_dict()
    if not isinstance(base_config, Mapping):
        raise InputTypeError(
            f"{fn}: base_config is a {type(base_config).__name__}; expected a dict (e.g. "
            "nu.peft.load_config(dir) or load_adapters(...).config), a peft LoraConfig, or an "
            "adapter directory."
        )
    return _carried(base_config)


def save_adapter(
    adapter: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    rank: int | None = None,
    base_config: Any = None,
    dtype: str = "float32",
    **config: Any,
) -> dict[str, Any]:
    """Write a (merged) adapter as a PEFT LoRA checkpoint that ``PeftModel.from_pretrained`` loads.

    Each module's update ``dK`` (:func:`nu.module_update`) is written so that PEFT reproduces it
    exactly: ``lora_A.weight = lora_a^T`` ``(r, d_in)``, ``lora_B.weight = (scale * lora_b)^T``
    ``(d_out, r)``, and PEFT's own scale is 1 (``lora_alpha = r`` per module, rsLoRA off). Modules
    keep their own ranks through ``rank_pattern`` / ``alpha_pattern``: the most common rank is the
    config's ``r``, the other modules are listed under the key ``"^" + re.escape(name)``, which
    PEFT's rule (:func:`pattern_key`) matches to exactly that module (the anchored form PEFT
    documents; PEFT >= 0.15 understands it). A module of rank 0 (the merge
    kept nothing there) is written as rank 1 with zero factors: PEFT needs ``r >= 1``, and its
    update is exactly zero. Dense modules ``{"delta"}`` are written as their best rank-``rank``
    approximation (SVD, Eckart-Young) if ``rank`` is given, and refused otherwise.

    The files are written into a temporary directory next to ``path`` and renamed into place, so a
    reader never sees a half-written adapter.

    Args:
      adapter: flat dict keyed by PEFT module names (``"model.layers.0.self_attn.q_proj"``) of
        ``{"lora_a": (d_in, K), "lora_b": (K, d_out), "scale"}`` (any ``K >= 0``) or
        ``{"delta": (d_in, d_out)}`` modules, as :func:`load_adapter` and
        :func:`nu.merge_adapters` return. Nested dicts are joined with ``"."``.
      path: output directory; must not exist or be empty (parents are created).
      rank: rank to which dense modules are truncated. Low-rank modules are always written
        exactly at their own rank (truncate them first with :func:`nu.to_lora` to shrink them).
      base_config: config of the source adapters (a dict such as :func:`load_config` or
        :attr:`LoadedAdapters.config` returns, a ``peft.LoraConfig``, or an adapter directory);
        its base-model fields (``CARRIED_FIELDS``: ``base_model_name_or_path``, ``task_type``,
        ``target_modules``, ``fan_in_fan_out``, ...) are carried over, the training settings
        (``r``, ``lora_alpha``, patterns, ``modules_to_save``) are not.
      dtype: dtype of the saved factors: ``"float32"`` (default), ``"bfloat16"`` or
        ``"float16"``.
      **config: overrides of the carried fields (e.g. ``task_type="CAUSAL_LM"``) and
        ``inference_mode``. Without ``target_modules`` from either source, the exact module names
        are written. Carried ``target_modules`` (with ``exclude_modules``,
        ``layers_to_transform``) must make PEFT adapt every module of the adapter (checked with
        PEFT's rule); if they also reach modules the adapter lacks, PEFT creates those with a zero
        ``lora_B`` (no update) and warns about missing keys.

    Returns:
      The config written to ``adapter_config.json``.

    Raises:
      FileExistsError: ``path`` is a file or a non-empty directory.
      ValueError: a dense module without ``rank``; a bad rank, dtype or config key; a module name
        that is not a PEFT name; ``target_modules`` that miss a module; bad module shapes or
        non-finite values.
      TypeError: an adapter that is not a dict, a traced or non-floating array.

    Example:
      >>> import pathlib, tempfile
      >>> import numpy as np
      >>> import netutility_jax as nu
      >>> from netutility_jax import peft
      >>> rng = np.random.default_rng(0)
      >>> merged = {"model.layers.0.q_proj": {"lora_a": rng.normal(size=(8, 3)),
      ...                                     "lora_b": rng.normal(size=(3, 6)), "scale": 0.5},
      ...           "model.layers.0.v_proj": {"lora_a": np.zeros((8, 0)),
      ...                                     "lora_b": np.zeros((0, 6)), "scale": 1.0}}
      >>> tmp = tempfile.TemporaryDirectory()
      >>> out = pathlib.Path(tmp.name) / "merged"
      >>> cfg = peft.save_adapter(merged, out, base_model_name_or_path="my/base")
      >>> cfg["r"], cfg["rank_pattern"]
      (1, {'^model\\\\.layers\\\\.0\\\\.q_proj': 3})
      >>> back = peft.load_adapter(out)
      >>> bool(np.allclose(nu.module_update(back["model.layers.0.q_proj"]),
      ...                  0.5 * merged["model.layers.0.q_proj"]["lora_a"]
      ...                  @ merged["model.layers.0.q_proj"]["lora_b"], atol=1e-5))
      True
      >>> tmp.cleanup()
    """
    fn = "nu.peft.save_adapter"
    st = _safetensors()
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1
    ):
        raise InputError(
            f"{fn}: rank={rank!r}; expected a positive integer (the rank dense modules are "
            "truncated to) or None."
        )
    if dtype not in _SAVE_DTYPES:
        raise InputError(f"{fn}: dtype={dtype!r}; expected one of {_SAVE_DTYPES}.")
    for k in config:
        if k in _COMPUTED_FIELDS:
            raise InputError(
                f"{fn}: {k}= is computed by save_adapter (each module's rank, with lora_alpha = r "
                "so PEFT's scale is 1 and the merged scale is folded into lora_B); drop it."
            )
        if k not in _CONFIG_OVERRIDES:
            raise InputError(
                f"{fn}: unknown config field {k}=; accepted: {', '.join(_CONFIG_OVERRIDES)}."
            )
    out_dir = pathlib.Path(os.fspath(path))
    _check_free(out_dir, fn=fn)

    modules = _modules_for_save(adapter, fn=fn)
    names = sorted(modules, key=_natural)
    np_dtype = {"float32": np.float32, "float16": np.float16}.get(dtype)
    if np_dtype is None:
        np_dtype = jnp.bfloat16  # ml_dtypes' bfloat16, a numpy dtype
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    for name in names:
        a, b = _peft_factors(name, modules[name], rank, fn=fn)
        ranks[name] = int(a.shape[0])
        for part, x in (("lora_A", a), ("lora_B", b)):
            with np.errstate(over="ignore"):  # overflow is reported below, with the module
                y = np.ascontiguousarray(x.astype(np_dtype))
            if not np.all(np.isfinite(y.astype(np.float32))):
                raise InputError(
                    f"{fn}: module {name!r}'s {part} overflows {dtype} (largest entry "
                    f"{np.abs(x).max():.3g}); save with dtype='float32' or 'bfloat16'."
                )
            tensors[f"{PREFIX}{name}.{part}.weight"] = y

    r0, rank_pattern = _rank_patterns(ranks)
    cfg: dict[str, Any] = _resolve_base_config(base_config, fn=fn)
    cfg.update({k: _jsonable(v) for k, v in config.items()})
    if cfg.get("target_modules") is None:
        cfg["target_modules"] = names
    _check_targets(cfg, names, fn=fn)
    cfg.update(
        {
            "peft_type": "LORA",
            "r": r0,
            "lora_alpha": r0,
            "rank_pattern": rank_pattern,
            "alpha_pattern": dict(rank_pattern),
            "use_rslora": False,
            "use_dora": False,
            "bias": "none",
            "lora_dropout": 0.0,
            "modules_to_save": None,
            "init_lora_weights": True,
        }
    )
    cfg.setdefault("inference_mode", True)
    cfg = dict(sorted(cfg.items()))
    try:
        text = json.dumps(cfg, indent=2) + "\n"
    except TypeError as e:
        bad = []
        for k, v in cfg.items():
            try:
                json.dumps(v)
            except (TypeError, ValueError):
                bad.append(f"{k} ({type(v).__name__})")
        raise InputError(
            f"{fn}: the config is not JSON-serialisable ({e}): field {', '.join(bad[:3])}; pass "
            "plain strings, numbers, lists and dicts."
        ) from e

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        st.numpy.save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(text, encoding="utf-8")
        # mkdtemp makes the folder private and safetensors writes 0600: give both the modes of
        # a plain open(), which the config file just written has (the user's umask decides)
        mode = (tmp / CONFIG_NAME).stat().st_mode & 0o666
        os.chmod(tmp / WEIGHTS_NAME, mode)
        os.chmod(tmp, mode | (mode & 0o444) >> 2)  # x wherever r: a listable folder
        try:
            # POSIX rename replaces an empty directory atomically and fails on a non-empty one
            os.rename(tmp, out_dir)
        except OSError as e:
            raise FileExistsError(
                f"{fn}: could not move the adapter into {str(out_dir)!r} ({e}); something else "
                "wrote there meanwhile. Choose another output directory."
            ) from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return cfg


def _check_free(out_dir: pathlib.Path, *, fn: str) -> None:
    if out_dir.is_dir():
        if any(out_dir.iterdir()):
            raise FileExistsError(
                f"{fn}: {str(out_dir)!r} exists and is not empty; refusing to overwrite an "
                "adapter. Choose a new directory or delete this one first."
            )
    elif out_dir.exists():
        raise FileExistsError(
            f"{fn}: {str(out_dir)!r} is a file; pass a directory path for the adapter."
        )


__all__ = [
    "CARRIED_FIELDS",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "LoadedAdapters",
    "check_compatible",
    "load_adapter",
    "load_adapters",
    "load_config",
    "pattern_key",
    "save_adapter",
]
