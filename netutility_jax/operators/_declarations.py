"""The checks of a method's declaration that :func:`nu.registry.register` runs: every mistake
in a :class:`MethodSpec` found and raised together, each naming its field, the value given and
the values allowed."""

from __future__ import annotations

import keyword
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._core import checks as _checks
from ..errors import InputError, InputTypeError
from .specs import (
    BUDGET_SCOPES,
    COMMAND_FLAGS,
    KINDS,
    METHODS,
    OPTION_KINDS,
    RESERVED_OPTION_NAMES,
    SPACES,
    MethodSpec,
    Option,
)

__all__ = ["check_spec"]

_NAME_CHARS = "letters, digits and underscores, starting with a letter"


class _Mistakes:
    """The mistakes found in one declaration: ``(message, is_type)`` each, raised together."""

    def __init__(self) -> None:
        self.found: list[tuple[str, bool]] = []

    def add(self, msg: str, *, type_error: bool = False) -> None:
        self.found.append((msg, type_error))

    def value(self, field: str, value: Any, expected: str, *, type_error: bool = False) -> None:
        self.add(f"{field}={_checks.given(value)}; expected {expected}.", type_error=type_error)

    def raise_if_any(self, name: Any) -> None:
        if not self.found:
            return
        who = f"registry.register: method {_checks.brief(name)}"
        msgs = [m for m, _ in self.found]
        text = (
            f"{who}: {msgs[0]}"
            if len(msgs) == 1
            else f"{who} has {len(msgs)} mistakes: "
            + " ".join(f"({i}) {m}" for i, m in enumerate(msgs, 1))
        )
        cls = InputTypeError if all(t for _, t in self.found) else InputError
        raise cls(text)


def _is_name(x: Any) -> bool:
    return isinstance(x, str) and x.isascii() and x[:1].isalpha() and x.replace("_", "a").isalnum()


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool)


def _is_number(x: Any) -> bool:
    """A Python or numpy real number (not a bool, not an array)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _is_real(x: Any) -> bool:
    return _is_number(x) and not math.isnan(x)


def _in_range(opt: Option, v: Any) -> bool:
    try:
        return opt.in_range(float(v))
    except OverflowError:  # an integer beyond float range
        return False


def _check_option(opt: Any, i: int, ms: _Mistakes) -> bool:
    """The mistakes of one :class:`Option` (its own fields); False if it is no Option at all."""
    if not isinstance(opt, Option):
        ms.value(f"options[{i}]", opt, "a registry.Option", type_error=True)
        return False
    if not _is_name(opt.name) or keyword.iskeyword(opt.name):
        ms.value(
            f"options[{i}].name", opt.name, f"a keyword of nu.merge ({_NAME_CHARS})",
            type_error=not isinstance(opt.name, str),
        )  # fmt: skip
        return False
    at = f"option {opt.name!r}: "
    if opt.name in RESERVED_OPTION_NAMES:
        ms.add(
            f"{at}the name is taken by nu.merge, nu.merge_adapters or the kernels; choose "
            f"another (taken: {', '.join(RESERVED_OPTION_NAMES)})."
        )
    if opt.kind not in OPTION_KINDS:
        ms.value(f"{at}kind", opt.kind, f"one of {OPTION_KINDS}")
        return True
    for field in ("help", "what", "example", "choice_help"):
        if not isinstance(getattr(opt, field), str):
            ms.value(f"{at}{field}", getattr(opt, field), "a string", type_error=True)
    if isinstance(opt.help, str) and not opt.help.strip():
        ms.value(f"{at}help", opt.help, "one line for the command line's help")
    for field in ("low_open", "high_open", "traced"):
        if not _is_bool(getattr(opt, field)):
            ms.value(f"{at}{field}", getattr(opt, field), "True or False", type_error=True)
    if opt.cli_low_open is not None and not _is_bool(opt.cli_low_open):
        ms.value(f"{at}cli_low_open", opt.cli_low_open, "None, True or False", type_error=True)
    if opt.cli_what is not None and not isinstance(opt.cli_what, str):
        ms.value(f"{at}cli_what", opt.cli_what, "None or a string", type_error=True)
    if opt.flag is not None and not (
        isinstance(opt.flag, str)
        and opt.flag.startswith("--")
        and _is_name(opt.flag[2:].replace("-", "_"))
    ):
        ms.value(f"{at}flag", opt.flag, "None or a flag such as '--my-option'")
    if opt.kind != "choice" and opt.choices:
        ms.add(f"{at}choices={_checks.brief(opt.choices)} apply to kind='choice' only.")
    if opt.kind == "real":
        ok = True
        for field in ("low", "high"):
            v = getattr(opt, field)
            if not _is_real(v):
                ms.value(f"{at}{field}", v, "a real number (-inf and inf allowed)")
                ok = False
        if ok and opt.low > opt.high:
            ms.add(f"{at}low={opt.low!r} > high={opt.high!r}; expected low <= high.")
        elif ok and opt.low == opt.high and (opt.low_open or opt.high_open):
            ms.add(f"{at}the interval {opt.interval()} is empty; expected low < high.")
        elif ok and not opt.required:
            d = opt.default
            if not _is_number(d):
                ms.value(f"{at}default", d, opt.expected, type_error=True)
            elif not _in_range(opt, d):
                ms.value(f"{at}default", d, opt.expected)
    elif opt.kind == "bool":
        if not opt.required and not _is_bool(opt.default):
            ms.value(f"{at}default", opt.default, "True or False", type_error=True)
    else:
        c = opt.choices
        if not (
            isinstance(c, tuple) and c and all(isinstance(x, str) for x in c)
            and len(set(c)) == len(c)
        ):  # fmt: skip
            ms.value(f"{at}choices", c, "a non-empty tuple of distinct strings")
        elif not opt.required and opt.default not in c:
            ms.value(
                f"{at}default", opt.default, f"one of {c}",
                type_error=not isinstance(opt.default, str),
            )  # fmt: skip
    return True


def _same_declaration(a: Option, b: Option) -> bool:
    """Options that share a name share one command-line flag: the same kind, range, choices."""
    fields = ("kind", "low", "high", "low_open", "high_open", "choices", "flag")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def _kernel_call(spec: MethodSpec, opts: dict[str, Option]) -> tuple[str, tuple, dict] | None:
    """How the stages call ``spec.kernel`` (its description, positional and keyword arguments),
    or None where it cannot be known (a ``canonical`` may drop options)."""
    if spec.canonical is not None:
        return None
    if spec.kind == "low_rank":
        kw = {"coef": 1.0, "rtol": 0.0, "is_svd": False, **dict.fromkeys(opts)}
        return "kernel(a, b, coef=, rtol=, is_svd=, **options)", (None, None), kw
    traced = [n for n, o in opts.items() if o.kind == "real" and o.traced]
    kw = {"coef": 1.0, "k_top": 0, **dict.fromkeys(traced)}
    return "kernel(x, keys, coef=, k_top=, **traced_options)", (None, None), kw


def _check_kernel(spec: MethodSpec, opts: dict[str, Option], ms: _Mistakes) -> None:
    import inspect

    if not callable(spec.kernel):
        ms.value("kernel", spec.kernel, f"a callable (the {spec.kind} kernel)", type_error=True)
        return
    call = _kernel_call(spec, opts)
    if call is None:
        return
    try:
        sig = inspect.signature(spec.kernel)
    except (TypeError, ValueError):  # a builtin or such: nothing to read
        return
    what, args, kw = call
    try:
        sig.bind(*args, **kw)
    except TypeError as e:
        kind = "low-rank" if spec.kind == "low_rank" else "elementwise"
        ms.add(
            f"kernel: its signature {sig} cannot take the {kind} call "
            f"{what.replace(', **options', '').replace(', **traced_options', '')}"
            f"{' with options ' + ', '.join(map(repr, kw)) if opts else ''} ({e}); see the "
            "module docstring of netutility_jax.registry for the kernels' signatures."
        )


def _check_spaces(spec: MethodSpec, ms: _Mistakes) -> tuple[str, ...]:
    """The declared spaces that exist (the mistakes of ``spaces`` and ``same_spaces`` noted)."""
    known = tuple(SPACES)
    sp = spec.spaces
    if not isinstance(sp, tuple) or not sp:
        ms.value(
            "spaces", sp, f"a non-empty tuple of space names among {known}",
            type_error=not isinstance(sp, tuple),
        )  # fmt: skip
        sp = sp if isinstance(sp, tuple) else ()
    good = []
    for s in sp:
        if not isinstance(s, str) or s not in SPACES:
            ms.add(f"spaces: {_checks.brief(s)} is not a space; expected among {known}.")
        elif s in good:
            ms.add(f"spaces: {s!r} is named twice.")
        else:
            good.append(s)
    groups = spec.same_spaces
    if not isinstance(groups, tuple) or not all(isinstance(g, tuple) and g for g in groups):
        ms.value(
            "same_spaces", groups,
            f"a tuple of non-empty tuples of space names among {known}, e.g. (('full', 'core'), "
            "('knots',))",
        )  # fmt: skip
        return tuple(good)
    seen: set[str] = set()
    for g in groups:
        for s in g:
            if not isinstance(s, str) or s not in SPACES:
                ms.add(f"same_spaces: {_checks.brief(s)} is not a space; expected among {known}.")
            elif s in seen:
                ms.add(f"same_spaces: {s!r} is in two groups; each space is in one group at most.")
            else:
                seen.add(s)
        if len(g) > 1:
            for s in g:
                if isinstance(s, str) and s in SPACES and s not in good:
                    ms.add(
                        f"same_spaces: group {g!r} names {s!r}, which is not among spaces "
                        f"{tuple(good)}; a method can give identical results only in spaces it "
                        "runs in."
                    )
    return tuple(good)


def _check_options(spec: MethodSpec, spaces: tuple[str, ...], ms: _Mistakes) -> dict[str, Option]:
    """The method's well-formed options by name (the mistakes of each and between them noted)."""
    if not isinstance(spec.options, tuple):
        ms.value("options", spec.options, "a tuple of registry.Option", type_error=True)
        return {}
    opts: dict[str, Option] = {}
    for i, opt in enumerate(spec.options):
        if not _check_option(opt, i, ms):
            continue
        if opt.name in opts:
            ms.add(f"options: {opt.name!r} is declared twice.")
            continue
        opts[opt.name] = opt
        at = f"option {opt.name!r}: "
        flag = _flag(opt)
        if flag in COMMAND_FLAGS:
            ms.add(
                f"{at}its command-line flag {flag} is one of netutility merge's own flags; "
                "choose another name."
            )
        shadows = [sp for sp in spaces if any(o.name == opt.name for o in SPACES[sp].options)]
        for sp in shadows:
            ms.add(
                f"{at}space {sp!r} has an option of that name, which the method's would shadow; "
                "choose another name."
            )
        declared = [(f"method {n!r}", o) for n, m in METHODS.items() for o in m.options]
        declared += [(f"space {n!r}", o) for n, sp in SPACES.items() for o in sp.options]
        clash = next(
            (
                (who, o)
                for who, o in declared
                if o.name == opt.name and not _same_declaration(o, opt)
            ),
            None,
        )
        if clash and not shadows:
            who, o = clash
            rng = f" in {o.interval()}" if o.kind == "real" else ""
            ms.add(
                f"{at}{who} declares it as a {o.kind} option{rng}"
                f"{f' with choices {o.choices}' if o.choices else ''}; options that share a name "
                f"share one command-line flag ({_flag(o)}), so they must have the same kind, "
                "range and choices (or choose another name)."
            )
        if (
            spec.kind == "elementwise"
            and spec.canonical is None
            and not (opt.kind == "real" and opt.traced)
            and opt.name != spec.keeps_top
            and not (isinstance(spec.model_wide, tuple) and spec.model_wide[:1] == (opt.name,))
        ):
            ms.add(
                f"{at}a {opt.kind} option of an elementwise method never reaches its kernel "
                "(elementwise kernels get only real options with traced=True, as data); make it "
                "a traced real option, or use it through keeps_top, model_wide or canonical."
            )
    return opts


def _check_elementwise_fields(spec: MethodSpec, opts: dict[str, Option], ms: _Mistakes) -> None:
    """``needs_key``, ``keeps_top`` and ``model_wide``: only elementwise methods use them."""
    ew = spec.kind == "elementwise"
    if not _is_bool(spec.needs_key):
        ms.value("needs_key", spec.needs_key, "True or False", type_error=True)
    elif spec.needs_key and not ew:
        ms.add(
            "needs_key=True needs kind='elementwise' (low-rank kernels draw no random masks and "
            "get no keys)."
        )
    kt = spec.keeps_top
    if kt is not None:
        opt = opts.get(kt) if isinstance(kt, str) else None
        if not ew:
            ms.add(f"keeps_top={_checks.brief(kt)} needs kind='elementwise' (a count of entries).")
        elif opt is None:
            ms.add(
                f"keeps_top={_checks.brief(kt)} is not an option of the method; expected None or "
                f"one of its real options {tuple(n for n, o in opts.items() if o.kind == 'real')}."
            )
        elif not (opt.kind == "real" and opt.low >= 0 and opt.high <= 1 and not opt.traced):
            ms.add(
                f"keeps_top={kt!r}: the option must be a real fraction in [0, 1] with "
                f"traced=False (the host turns it into counts); it is a {opt.kind} option"
                f"{f' in {opt.interval()}' if opt.kind == 'real' else ''} with "
                f"traced={opt.traced}."
            )
    bl = spec.blocked
    if bl is not None:
        if bl not in ("ties", "dare", "dare_ties"):
            ms.value("blocked", bl, "None, 'ties', 'dare' or 'dare_ties'")
        elif not ew:
            ms.add(f"blocked={bl!r} needs kind='elementwise' (a row-blocked dense operator).")
        elif bl == "ties" and kt is None:
            ms.add("blocked='ties' needs keeps_top (TIES's blocked trim counts kept entries).")
        elif bl != "ties" and not (spec.needs_key and "p" in opts):
            ms.add(
                f"blocked={bl!r} needs needs_key=True and a drop-rate option 'p' (its blocks "
                "draw DARE's mask)."
            )
    mw = spec.model_wide
    if mw is not None:
        if not (isinstance(mw, tuple) and len(mw) == 2 and isinstance(mw[0], str)):
            ms.value("model_wide", mw, "None or (option name, value)")
        elif not ew or kt is None:
            ms.add(
                f"model_wide={_checks.brief(mw)} needs keeps_top (and kind='elementwise'): it "
                "makes keeps_top's count over the whole model."
            )
        elif spec.blocked != "ties":
            ms.add(
                f"model_wide={mw!r} needs blocked='ties': the model-wide count runs TIES's own "
                "blocked selection, not the method's kernel (for another operator, leave "
                "model_wide None: the kernel then counts per module)."
            )
        elif mw[0] not in opts:
            ms.add(f"model_wide={mw!r}: {mw[0]!r} is not an option of the method.")
        else:
            try:
                opts[mw[0]].check("model_wide", mw[1], name=mw[0])
            except (InputError, InputTypeError) as e:
                ms.add(f"model_wide={mw!r}: {str(e).removeprefix('model_wide: ')}")


def check_spec(spec: Any) -> None:
    """Every mistake in a :class:`MethodSpec`, raised together (see :func:`register`)."""
    if not isinstance(spec, MethodSpec):
        raise InputTypeError(
            f"registry.register: spec={_checks.given(spec)}; expected a registry.MethodSpec."
        )
    ms = _Mistakes()
    if not isinstance(spec.name, str):
        ms.value("name", spec.name, "a string (the method= of nu.merge)", type_error=True)
    elif not _is_name(spec.name):
        ms.value("name", spec.name, f"a name of {_NAME_CHARS}")
    elif spec.name in METHODS:
        raise InputError(f"registry.register: a method named {spec.name!r} exists already.")
    for field in ("label", "summary"):
        v = getattr(spec, field)
        if not (isinstance(v, str) and v.strip()):
            ms.value(field, v, "a non-empty string", type_error=not isinstance(v, str))
    if spec.kind not in KINDS:
        ms.value("kind", spec.kind, f"one of {KINDS}")
    spaces = _check_spaces(spec, ms)
    opts = _check_options(spec, spaces, ms)
    if spec.kind in KINDS:
        _check_kernel(spec, opts, ms)
        _check_elementwise_fields(spec, opts, ms)
    elif not callable(spec.kernel):
        ms.value("kernel", spec.kernel, "a callable (the kernel)", type_error=True)
    if spec.budget_scope not in BUDGET_SCOPES:
        ms.value("budget_scope", spec.budget_scope, f"one of {BUDGET_SCOPES}")
    if spec.canonical is not None and not callable(spec.canonical):
        ms.value("canonical", spec.canonical, "a callable or None", type_error=True)
    _check_renamed(spec, opts, spaces, ms)
    ms.raise_if_any(spec.name)


def _check_renamed(
    spec: MethodSpec, opts: dict[str, Option], spaces: tuple[str, ...], ms: _Mistakes
) -> None:
    if not isinstance(spec.renamed, Mapping):
        ms.value("renamed", spec.renamed, "a mapping {old name: new name}", type_error=True)
        return
    takes = set(opts) | {o.name for s in spaces for o in SPACES[s].options}
    for old, new in spec.renamed.items():
        if not (_is_name(old) and isinstance(new, str)):
            ms.add(
                f"renamed: {_checks.brief(old)} -> {_checks.brief(new)}; expected option names "
                f"({_NAME_CHARS})."
            )
        elif new not in takes:
            ms.add(
                f"renamed: {old!r} -> {new!r} renames to {new!r}, which is not an option of the "
                f"method; its options are {tuple(sorted(takes))}."
            )
        elif old in takes:
            ms.add(f"renamed: {old!r} -> {new!r}: {old!r} is still an option's name.")


def _flag(opt: Any) -> str:
    """An option's command-line flag: ``--`` and its name (the deprecated ``Option(flag=)``
    where a caller still gives one), read without :attr:`Option.cli_flag`'s property."""
    return opt.flag or "--" + opt.name.replace("_", "-")
