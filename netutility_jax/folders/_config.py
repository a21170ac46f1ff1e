"""The settings of a merge from PEFT folders: :class:`MergeConfig`, one frozen value with one
field per setting, and its plain-data form (:meth:`MergeConfig.to_dict`,
:meth:`MergeConfig.from_dict`), which a merge report records and ``netutility merge --config``
reads."""

from __future__ import annotations

import dataclasses
import math
import os
import types
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .. import registry
from ..errors import InputError, InputTypeError
from ..scoring.utility import INTERFERENCES

__all__ = ["MergeConfig", "MomentsFile", "option_key"]

_FN = "MergeConfig"
_MAX_INT = 2**31 - 1
_SEED_BOUND = 2**32
DTYPES = ("float32", "bfloat16", "float16")


class MomentsFile(NamedTuple):
    """One task's input moments file, pinned to the SHA-256 of its bytes: the merge reads these
    bytes or stops (a merge report records each file so)."""

    path: str
    sha256: str


def _options() -> dict[str, registry.Option]:
    """Every method and space option of the registry, once each, by name."""
    out: dict[str, registry.Option] = {}
    for spec in (*registry.METHODS.values(), *registry.SPACES.values()):
        for opt in spec.options:
            out.setdefault(opt.name, opt)
    return out


_KEYS = {"variant": "knots-variant"}
"""The options a config and a report spell otherwise than by their name: KnOTS' ``variant``,
whose name alone would not say which space it belongs to."""


def option_key(name: str) -> str:
    """How a config (and a report) spells the option ``name``: its name with dashes
    (``density``, ``trim-scope``; ``knots-variant`` for ``variant``), which is also the command
    line's flag without its dashes. An option declared with the deprecated
    ``registry.Option(flag=...)`` is spelled as that flag."""
    flag = getattr(_options().get(name), "flag", None)
    if flag:
        return flag[2:]
    return _KEYS.get(name, name.replace("_", "-"))


def _key(field: str) -> str:
    return field.replace("_", "-")


def _bad_type(field: str, value: Any, expected: str) -> InputTypeError:
    return InputTypeError(
        f"{_FN}: {field}={value!r} is a {type(value).__name__}; expected {expected}."
    )


def _bad(field: str, value: Any, expected: str) -> InputError:
    return InputError(f"{_FN}: {field}={value!r}; expected {expected}.")


def _real(field: str, value: Any, *, low: float, high: float = math.inf, auto: bool = False,
          low_open: bool = False, zero: bool = True) -> float | str:  # fmt: skip
    """A finite real in ``[low, high]`` (``low_open``: ``(low, high]``) as a float, or 'auto'."""
    if auto and value == "auto":
        return "auto"
    what = f"{'auto or ' if auto else ''}a finite number in {'(' if low_open else '['}{low:g}, {high:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad_type(field, value, what)
    v = float(value)
    if (
        not math.isfinite(v)
        or v < low
        or v > high
        or (low_open and v == low)
        or (not zero and v == 0)
    ):
        raise _bad(field, value, what + ("" if zero else ", not 0"))
    return v


def _int(field: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_type(field, value, f"an integer in [{low}, {high}]")
    if not low <= value <= high:
        raise _bad(field, value, f"an integer in [{low}, {high}]")
    return int(value)


def _choice(field: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise _bad(field, value, f"one of {', '.join(map(repr, choices))}")
    return value


def _bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad_type(field, value, "True or False")
    return value


def _seq(field: str, value: Any) -> tuple:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise _bad_type(field, value, "a list or tuple, one item per adapter")
    return tuple(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MergeConfig:
    """How :func:`nu.merge_folders` merges PEFT adapter folders: one field per setting of
    ``netutility merge`` (its flag's name, ``chunk_mb`` for ``--chunk-mb``), checked when made.

    The method's and space's own options (TIES' ``density``, DARE's ``p``, KnOTS'
    ``variant`` ...) are :attr:`method_options`, checked against :mod:`nu.registry`: an option
    the method and space do not take is refused naming it. :meth:`to_dict` gives the settings
    as plain data, spelled as a merge report records them and as ``netutility merge --config``
    reads them (``chunk-mb``, ``density``); :meth:`from_dict` reads that form back.

    Raises:
      InputTypeError: a field of the wrong type (the message names the field).
      InputError: a value out of range, an unknown choice, an option the method does not take.

    Example:
      >>> import netutility_jax as nu
      >>> cfg = nu.MergeConfig(method="ties", budget=16, method_options={"density": 0.3})
      >>> cfg.to_dict()["density"], cfg.chunk_mb
      (0.3, 64.0)
      >>> nu.MergeConfig.from_dict(cfg.to_dict()) == cfg
      True
    """

    method: str = "ta"
    space: str = "full"
    allocation: str = "net_utility"
    budget: int | None = None
    """The average number of kept directions per module; required unless ``allocation="all"``
    (which keeps every direction, and sets it to None)."""
    scope: str | None = None
    alpha: float | str = "auto"
    lam: float | str = "auto"
    interference: str = "overlap"
    keep_nonpositive: bool = False
    """Admit directions of utility <= 0 (``positive_only=False`` of :func:`nu.merge_adapters`)."""
    coef: float = 1.0
    seed: int = 0
    """The PRNG seed of the methods that draw (DARE), in ``[0, 2**32)``."""
    weights: tuple[float, ...] | None = None
    names: tuple[str | None, ...] | None = None
    """The tasks' names in the report and plots (None, or a None item: from the folder)."""
    min_share: float | None = None
    input_moments: tuple[str | MomentsFile | None, ...] | None = None
    """Per adapter, a file of its input second moments (:func:`nu.moments.save_input_moments`;
    a :class:`MomentsFile` pins its SHA-256), or None for that task data-free."""
    method_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rank: int | None = None
    """The rank dense merged updates are written at (truncated SVD); required for them."""
    dtype: str = "float32"
    serving_ranks: str | tuple[int, ...] | None = None
    in_memory: bool = False
    chunk_mb: float = 64.0
    devices: str | int = "all"
    no_plots: bool = False
    strict_targets: bool = False
    allow_different_base: bool = False
    skip_non_lora: bool = False

    def __post_init__(self) -> None:
        for name, value in self._checked().items():
            object.__setattr__(self, name, value)

    def __hash__(self) -> int:
        # (the dataclass's own hash would fail on the read-only mapping of method_options)
        return hash(tuple(
            tuple(sorted(self.method_options.items())) if f.name == "method_options"
            else getattr(self, f.name)
            for f in dataclasses.fields(self)
        ))  # fmt: skip

    def _checked(self) -> dict[str, Any]:
        """Every field checked, in its normal form (floats, tuples, a read-only mapping)."""
        c: dict[str, Any] = {}
        c["method"] = _choice("method", self.method, tuple(registry.METHODS))
        c["space"] = _choice("space", self.space, tuple(registry.SPACES))
        c["allocation"] = _choice("allocation", self.allocation, registry.ALLOCATIONS)
        if self.allocation == "all":
            c["budget"] = None  # (every direction is kept: a budget means nothing)
        elif self.budget is None:
            raise InputError(
                f"{_FN}: budget=None with allocation={self.allocation!r}; give the average "
                "number of kept directions per module (e.g. budget=16), or allocation='all'."
            )
        else:
            c["budget"] = _int("budget", self.budget, 1, _MAX_INT)
        c["scope"] = _choice("scope", self.scope, (None, "global", "local"))
        c["alpha"] = _real("alpha", self.alpha, low=0, high=16, auto=True)
        c["lam"] = _real("lam", self.lam, low=0, high=1e30, auto=True)
        c["interference"] = _choice("interference", self.interference, INTERFERENCES)
        for name in ("keep_nonpositive", "in_memory", "no_plots", "strict_targets",
                     "allow_different_base", "skip_non_lora"):  # fmt: skip
            c[name] = _bool(name, getattr(self, name))
        c["coef"] = _real("coef", self.coef, low=-math.inf, zero=False)
        c["seed"] = _int("seed", self.seed, 0, _SEED_BOUND - 1)
        c["weights"] = None if self.weights is None else tuple(
            _real(f"weights[{i}]", w, low=-1e30, high=1e30, zero=False)
            for i, w in enumerate(_seq("weights", self.weights))
        )  # fmt: skip
        c["names"] = None if self.names is None else self._names()
        c["min_share"] = (
            None if self.min_share is None else _real("min_share", self.min_share, low=0, high=1)
        )
        c["input_moments"] = None if self.input_moments is None else self._moments()
        c["method_options"] = self._method_options()
        c["rank"] = None if self.rank is None else _int("rank", self.rank, 1, _MAX_INT)
        c["dtype"] = _choice("dtype", self.dtype, DTYPES)
        c["serving_ranks"] = self._serving_ranks()
        c["chunk_mb"] = _real("chunk_mb", self.chunk_mb, low=0, high=2**20, low_open=True)
        c["devices"] = (
            "all" if self.devices == "all" else _int("devices", self.devices, 1, _MAX_INT)
        )
        return c

    def _names(self) -> tuple[str | None, ...]:
        names = _seq("names", self.names)
        for i, n in enumerate(names):
            if n is not None and (not isinstance(n, str) or not n.strip()):
                raise _bad(f"names[{i}]", n, "a non-empty string, or None (the folder's name)")
        given = [n for n in names if n is not None]
        if len(set(given)) != len(given):
            raise InputError(f"{_FN}: names={names!r}: two tasks have the same name.")
        return names

    def _moments(self) -> tuple[str | MomentsFile | None, ...]:
        out: list[str | MomentsFile | None] = []
        for i, m in enumerate(_seq("input_moments", self.input_moments)):
            if isinstance(m, MomentsFile) or m is None:
                out.append(m)
            elif isinstance(m, (str, os.PathLike)) and str(m).strip():
                out.append(os.fspath(m))
            else:
                raise _bad_type(f"input_moments[{i}]", m, "a file path, a MomentsFile or None")
        if all(m is None for m in out):
            raise InputError(
                f"{_FN}: input_moments has no file (every entry None); leave it None for the "
                "data-free merge."
            )
        if self.allocation != "net_utility":
            raise InputError(
                f"{_FN}: input_moments applies to allocation='net_utility' (the scores use "
                f"them), not {self.allocation!r}."
            )
        return tuple(out)

    def _serving_ranks(self) -> str | tuple[int, ...] | None:
        v = self.serving_ranks
        if v is None or v == "vllm":
            return v
        ranks = _seq("serving_ranks", v)
        if not ranks:
            raise _bad("serving_ranks", v, "'vllm' or positive ranks")
        return tuple(_int(f"serving_ranks[{i}]", r, 1, _MAX_INT) for i, r in enumerate(ranks))

    def _method_options(self) -> Mapping[str, Any]:
        """:attr:`method_options` checked against the registry: names the method and space
        take, each value of its option's type and range (the registry's own check)."""
        given = self.method_options
        if not isinstance(given, Mapping):
            raise _bad_type("method_options", given, "a mapping of option names to values")
        spec = registry.METHODS[self.method]
        takes = {o.name: o for o in (*spec.options, *registry.SPACES[self.space].options)}
        for name in given:
            if name not in takes:
                which = ", ".join(takes) or "no options"
                raise InputError(
                    f"{_FN}: method_options[{name!r}]: method {self.method!r} in space "
                    f"{self.space!r} does not take {name!r}; it takes {which}."
                )
        registry.resolve_options(f"{_FN}: method_options", self.method, self.space, dict(given))
        return types.MappingProxyType(dict(given))

    @property
    def dense(self) -> bool:
        """Whether the method gives dense merged updates in this space (written as rank-
        :attr:`rank` LoRA modules, which it then needs)."""
        return not registry.METHODS[self.method].low_rank_in(self.space)

    @property
    def chunk_bytes(self) -> int:
        """:attr:`chunk_mb` in bytes: a streamed merge's chunk of factors (all tasks)."""
        return max(1, int(self.chunk_mb * 2**20))

    # ------------------------------------------------------------------ the plain-data form

    def resolved_options(self) -> dict[str, Any]:
        """:attr:`method_options` with the registry's defaults of the others (what the merge
        runs with)."""
        return dict(
            registry.resolve_options(
                _FN, self.method, self.space, dict(self.method_options)
            ).options
        )

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain data (JSON and YAML ready), keyed as a merge report and
        ``netutility merge --config`` spell them: a flag's name without its dashes
        (``chunk-mb``), each method option at the top level (``density``); settings left None
        are left out. :meth:`from_dict` reads it back to an equal config."""
        out: dict[str, Any] = {}
        for f in _ORDER:
            if f == "method_options":
                for name, value in self.method_options.items():
                    out[option_key(name)] = value
                continue
            value = getattr(self, f)
            if value is None:
                continue
            if f == "input_moments":
                value = [
                    m if m is None or isinstance(m, str) else {"path": m.path, "sha256": m.sha256}
                    for m in value
                ]
            out[_key(f)] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MergeConfig:
        """The config :meth:`to_dict` wrote, a merge report's ``config`` (or the report itself),
        or a ``netutility merge --config`` file's settings: keys spelled with ``-`` or ``_``;
        a method option at the top level or in ``method_options``; ``adapters`` (a list of
        paths or ``{path, weight, name}``, as a report records them) gives the tasks' weights
        and names (their paths are :func:`nu.merge_folders`' ``paths``). Unknown keys and
        ``out`` (an argument of :func:`nu.merge_folders`) are refused, naming the key."""
        if not isinstance(data, Mapping):
            raise _bad_type("from_dict(data)", data, "a mapping")
        if "netutility_version" in data and isinstance(data.get("config"), Mapping):
            data = data["config"]  # (a merge report: its recorded configuration)
        fields = {f.name for f in dataclasses.fields(cls)}
        options = _options()
        spelled = {option_key(n).replace("-", "_"): n for n in options}
        kwargs: dict[str, Any] = {}
        opts: dict[str, Any] = {}
        seen: dict[str, str] = {}
        for key, value in data.items():
            if not isinstance(key, str):
                raise _bad_type(f"from_dict: key {key!r}", key, "a string")
            norm = key.replace("-", "_")
            target = norm if norm in fields or norm == "adapters" else spelled.get(norm, norm)
            if target in seen:
                raise InputError(
                    f"{_FN}.from_dict: {key!r} is given twice (as {seen[target]!r} too)."
                )
            seen[target] = key
            if target == "adapters":
                kwargs.update(_adapters(value))
            elif target in options and target not in fields:
                opts[target] = value
            elif target == "method_options":
                if not isinstance(value, Mapping):
                    raise _bad_type("method_options", value, "a mapping of option names to values")
                opts.update(value)
            elif target == "out":
                raise InputError(
                    f"{_FN}.from_dict: key {key!r}: the output folder is an argument of "
                    "nu.merge_folders(paths, out, config), not a setting."
                )
            elif target in fields:
                if value is not None:  # (None: the field's default, as in a --config file)
                    kwargs[target] = _from_plain(target, value)
            else:
                raise InputError(
                    f"{_FN}.from_dict: unknown key {key!r}; a config has "
                    f"{', '.join(sorted({*map(_key, fields - {'method_options'}), *map(option_key, options)}))}"
                    " (and adapters)."
                )
        if "weights" in seen and "_adapter_weights" in kwargs:
            raise InputError(
                f"{_FN}.from_dict: weights are given both per adapter and as 'weights'; give "
                "them in one place."
            )
        if "_adapter_weights" in kwargs:
            kwargs["weights"] = kwargs.pop("_adapter_weights")
        return cls(**kwargs, method_options=opts)


_ORDER = (
    "budget", "min_share", "input_moments", "method", "space", "allocation", "scope", "alpha",
    "lam", "interference", "strict_targets", "allow_different_base", "skip_non_lora",
    "keep_nonpositive", "coef", "seed", "method_options", "rank", "dtype", "serving_ranks",
    "in_memory", "chunk_mb", "devices", "no_plots", "weights", "names",
)  # fmt: skip
""":meth:`MergeConfig.to_dict`'s key order: the command's flags' (as reports were written)."""


def _numbers(field: str, text: str, kind: type) -> tuple:
    """A comma string of numbers (``--weights 1,0.5`` and ``--serving-ranks 8,16`` as a
    ``--config`` file may spell them) as a tuple."""
    try:
        return tuple(kind(p.strip()) for p in text.split(","))
    except ValueError:
        raise _bad(field, text, "a list of numbers (or a comma string of them)") from None


def _from_plain(field: str, value: Any) -> Any:
    """A plain value (lists from JSON or YAML; the comma strings and ``'none'`` moments entries
    that ``--config`` files may hold) as the field takes it."""
    if field == "weights" and isinstance(value, str):
        return _numbers(field, value, float)
    if field == "serving_ranks" and isinstance(value, str) and value != "vllm":
        return _numbers(field, value, int)
    if field in ("weights", "names", "serving_ranks") and isinstance(value, list):
        return tuple(value)
    if field == "input_moments" and isinstance(value, list):
        out = []
        for i, m in enumerate(value):
            if isinstance(m, Mapping):
                if set(m) - {"path", "sha256"} or not isinstance(m.get("path"), str):
                    raise _bad(f"input_moments[{i}]", m, "a path, None or {path, sha256}")
                sha = m.get("sha256")
                out.append(m["path"] if sha is None else MomentsFile(m["path"], sha))
            else:
                out.append(None if m == "none" else m)  # (``none``: that task data-free)
        return tuple(out)
    return value


def _adapters(items: Any) -> dict[str, Any]:
    """The weights (if any is given) and names of a config's ``adapters`` list."""
    if isinstance(items, (str, Mapping)) or not isinstance(items, list) or not items:
        raise _bad_type("adapters", items, "a non-empty list, each a path or {path, weight, name}")
    weights, names = [], []
    for i, item in enumerate(items):
        if isinstance(item, (str, os.PathLike)):
            item = {"path": item}
        if not isinstance(item, Mapping):
            raise _bad_type(f"adapters[{i}]", item, "a path or a mapping {path, weight, name}")
        extra = sorted(map(str, set(item) - {"path", "weight", "name", "hub", "sha256"}))
        if extra:
            raise InputError(f"{_FN}.from_dict: adapters[{i}] has the unknown key {extra[0]!r}.")
        weights.append(item.get("weight"))
        names.append(item.get("name"))
    out: dict[str, Any] = {}
    if any(w is not None for w in weights):
        out["_adapter_weights"] = tuple(1.0 if w is None else w for w in weights)
    if any(n is not None for n in names):
        out["names"] = tuple(names)
    return out
