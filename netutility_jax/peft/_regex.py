"""PEFT's rules for the regular expressions an adapter config may hold, at bounded cost.

``rank_pattern`` / ``alpha_pattern`` keys and a string ``target_modules`` / ``exclude_modules`` /
``layers_pattern`` are regular expressions read from a file. Plain name patterns are matched here
directly (exactly as ``re`` would); any other is run by Python's ``re`` in a short-lived helper
process under a time limit (:class:`Regexes`), so a hostile pattern is an error, never a hang.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ..errors import InputError, InputTypeError
from ._common import clip_repr

__all__ = ["Regexes", "pattern_key", "plain_full_match", "plain_pattern", "plain_suffix_match"]


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


def plain_pattern(pattern: str) -> tuple[bool, tuple[str | None, ...]] | None:
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


def plain_suffix_match(g: tuple[bool, tuple[str | None, ...]], name: str) -> bool:
    """``re.match(rf"(.*\\.)?({key})$", name)`` for a plain ``key`` (:func:`plain_pattern`),
    exactly.

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


def plain_full_match(g: tuple[bool, tuple[str | None, ...]], name: str) -> bool:
    """``re.fullmatch(pattern, name)`` for a plain pattern (:func:`plain_pattern`), exactly."""
    return len(name) == len(g[1]) and _chars_match(g[1], name)


class Regexes:
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
        globs = [plain_pattern(k) for k in keys]
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
                if plain_suffix_match(g, name):
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
        g = plain_pattern(pattern)
        if g is not None:
            return [plain_full_match(g, n) for n in names]
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
        if getattr(sys, "frozen", False) or not sys.executable:
            raise InputError(
                f"{self.fn}: {self.where}{label} {clip_repr(shown[0])} is a regular expression, "
                "and this Python cannot start the helper process that evaluates regexes from files "
                "under a time limit; write plain module names or suffixes instead."
            )
        budget = _REGEX_STARTUP + _REGEX_PER_EVAL * len(names) * len(patterns)
        last, overall, status = _spawn(patterns, mode, names, budget)
        if last is not None and last[0] == "ok":
            return last[1]
        raise self._error(label, shown, names, last, overall, status, budget)

    def _error(
        self,
        label: str,
        shown: Sequence[str],
        names: Sequence[str],
        last: list[Any] | None,
        overall: bool,
        status: int | None,
        budget: float,
    ) -> InputError:
        """The error the helper's last report ``last`` describes."""
        fn, where = self.fn, self.where
        if last is None:
            return InputError(
                f"{fn}: the helper process that evaluates the regular expression {label} "
                f"{clip_repr(shown[0])} of {where.rstrip(': ') or 'the config'} did not start "
                f"within {budget:.0f} s (exit status {status}); the machine is overloaded: try "
                "again."
            )
        j, name = last[2], names[last[1]]
        key, mod = clip_repr(shown[j]), clip_repr(name)
        if last[0] == "invalid":
            return InputError(
                f"{fn}: {where}{label} {key} is not a valid regular expression ({last[3]}; "
                f"matched against module {mod}); PEFT matches these as Python regexes: escape "
                "special characters, or write the module name or a suffix of it."
            )
        if last[0] == "timeout" or overall:
            within = f"{_REGEX_TIMEOUT} s" if last[0] == "timeout" else f"{budget:.0f} s in total"
            return InputError(
                f"{fn}: {where}{label} {key} did not finish matching module {mod} within "
                f"{within}: the regex backtracks catastrophically (nested or overlapping "
                "repetition such as '(a+)+' or '(\\w|.)+'), and PEFT, which applies it with "
                "Python's re, would hang on it too. Rewrite it without nested repetition, or list "
                "the module names or their suffixes."
            )
        return InputError(
            f"{fn}: {where}{label} {key} could not be evaluated on module {mod} "
            f"({last[3] if last[0] == 'failed' else 'the helper process stopped'}); rewrite it as "
            "a simpler regex or list the module names."
        )


def _spawn(
    patterns: Sequence[str], mode: str, names: Sequence[str], budget: float
) -> tuple[list[Any] | None, bool, int | None]:
    """Run :data:`_MATCHER` on ``names``: ``(its last report, whether the overall budget ran out,
    its exit status)``; the report is None if the process printed nothing."""
    payload = json.dumps(
        {
            "limit": _REGEX_TIMEOUT,
            "patterns": [list(patterns)],
            "queries": [[mode, 0, n] for n in names],
        }
    ).encode("ascii")
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
    for line in reversed(out.decode("ascii", "replace").splitlines()):
        try:  # the last line is cut short when the process was killed while writing it
            return json.loads(line), overall, proc.returncode
        except json.JSONDecodeError:
            continue
    return None, overall, proc.returncode


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
                f"{fn}: {label} is a {type(x).__name__} ({clip_repr(x)}); expected str."
            )
    j = Regexes(fn).first_keys("pattern key", keys, [name])[0]
    return None if j < 0 else keys[j]
