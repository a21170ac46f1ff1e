"""What an ``adapter_config.json`` means: the fields that are carried over or computed, the
configs that are refused, each module's ``r`` and ``lora_alpha`` under ``rank_pattern`` /
``alpha_pattern``, and which modules PEFT adapts under ``target_modules`` and the fields that
restrict it. Reading the file is :mod:`._read`'s job; regexes are evaluated by :mod:`._regex`.
"""

from __future__ import annotations

import numbers
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from .._core.checks import few
from .._core.io import to_jsonable
from ..errors import InputError
from ._common import CONFIG_NAME as CONFIG_FILE
from ._common import clip_repr, natural_key
from ._regex import Regexes

__all__ = [
    "CARRIED_FIELDS",
    "COMPUTED_FIELDS",
    "CONFIG_OVERRIDES",
    "ModuleSetting",
    "carried_config",
    "check_lora_config",
    "check_placement",
    "check_same_base",
    "check_targets",
    "is_targeted",
    "module_settings",
    "rank_patterns",
    "union_config",
    "untargeted",
]

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
CONFIG_OVERRIDES = (*CARRIED_FIELDS, "inference_mode")
# Fields save_adapter computes itself (a user value would break the saved update).
COMPUTED_FIELDS = (
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
# target_modules and the fields that restrict it (PEFT's check_target_module_exists)
_TARGET_FIELDS = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
# Initialisations that rewrite the base weights while training: unless PEFT converted the adapter
# on save, its update is relative to the rewritten weights, not to the base model.
_MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga")
# Settings whose update is not scale * B A on the base weights ({v}: the field's value).
_REFUSED = (
    (
        "use_dora",
        "has use_dora=true: a DoRA adapter rescales the weight columns by a learned magnitude, so "
        "its update is not scale * B A and cannot be merged as LoRA. Use a plain LoRA adapter, or "
        "load it with PEFT and merge_and_unload() it into the base weights.",
    ),
    (
        "lora_bias",
        "has lora_bias=true: its lora_B layers carry a bias, which a LoRA update scale * B A "
        "cannot hold. Use an adapter trained with lora_bias=false.",
    ),
    (
        "target_parameters",
        "sets target_parameters={v}: LoRA on raw parameters (e.g. MoE experts) has a different "
        "layout and is not supported; only LoRA on Linear / Conv1D modules (target_modules) is.",
    ),
    (
        "use_qalora",
        "has use_qalora=true: QA-LoRA's lora_A acts on pooled input groups, so its update is not "
        "scale * B A on the full input. Use a plain LoRA adapter.",
    ),
    (
        "alora_invocation_tokens",
        "is an activated LoRA (alora_invocation_tokens set): its update applies only after the "
        "invocation tokens, which a merged weight update cannot express.",
    ),
)


# ---------------------------------------------------------------------------------------------
# Loading: which configs are LoRA, and each module's r and lora_alpha
# ---------------------------------------------------------------------------------------------


def check_lora_config(cfg: Mapping[str, Any], f: pathlib.Path, *, fn: str) -> None:
    """Refuse configs whose update is not ``scale * B A`` on the base weights."""
    where = f"{fn}: {str(f)!r}"
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise InputError(
            f"{where} has peft_type={clip_repr(peft_type)}; only LoRA adapters (peft_type 'LORA') "
            "can be loaded."
        )
    for field, why in _REFUSED:
        if cfg.get(field):
            raise InputError(f"{where} {why.format(v=clip_repr(cfg[field]))}")
    init = str(cfg.get("init_lora_weights", True)).lower()
    if any(init.startswith(p) for p in _MUTATING_INITS):
        raise InputError(
            f"{where} has init_lora_weights={clip_repr(cfg['init_lora_weights'])}: this "
            "initialisation rewrites the base weights, so the saved update is relative to the "
            "rewritten weights. "
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
            f"{where}: use_rslora is {clip_repr(rslora)}; expected true or false (it decides the "
            "scale lora_alpha / r or lora_alpha / sqrt(r))."
        )


class ModuleSetting(NamedTuple):
    """A module's ``r`` and ``lora_alpha`` as the config gives them (not yet checked), where each
    came from (``"r"``, ``"rank_pattern['q_proj']"`` ...), and whether rsLoRA scales it."""

    r: Any
    r_src: str
    alpha: Any
    alpha_src: str
    rslora: bool


def module_settings(
    cfg: Mapping[str, Any], modules: Sequence[str], *, where: str, fn: str
) -> list[ModuleSetting]:
    """Each module's :class:`ModuleSetting`, as PEFT resolves ``rank_pattern`` / ``alpha_pattern``
    (:func:`pattern_key`'s rule); ``where`` names the config file in messages."""
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    rx = Regexes(fn, f"{where}: ")
    r_hits = rx.first_keys("rank_pattern key", list(rank_pattern), modules)
    a_hits = rx.first_keys("alpha_pattern key", list(alpha_pattern), modules)
    r_default = cfg.get("r", _DEFAULT_R)
    alpha_default = cfg.get("lora_alpha", _DEFAULT_ALPHA)
    rslora = bool(cfg.get("use_rslora", False))
    return [
        ModuleSetting(
            *_config_value(rank_pattern, r_hit, module, r_default, "r", "rank_pattern"),
            *_config_value(
                alpha_pattern, a_hit, module, alpha_default, "lora_alpha", "alpha_pattern"
            ),
            rslora,
        )
        for module, r_hit, a_hit in zip(modules, r_hits, a_hits, strict=True)
    ]


def _config_value(
    pattern: Mapping[str, Any], hit: int, module: str, default: Any, field: str, pfield: str
) -> tuple[Any, str]:
    """A module's value of ``r`` / ``lora_alpha`` and where it came from, as PEFT resolves it."""
    if hit >= 0:
        key = list(pattern)[hit]
        return pattern[key], f"{pfield}[{clip_repr(key)}]"
    # PEFT falls back to looking the name itself up; a name always matches itself as a regex
    # unless it holds regex syntax, which module names do not, but stay faithful.
    if module in pattern:
        return pattern[module], f"{pfield}[{clip_repr(module)}]"
    return default, field


# ---------------------------------------------------------------------------------------------
# Carried fields: base model and target modules, across adapters
# ---------------------------------------------------------------------------------------------


def carried_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: to_jsonable(cfg[k]) for k in CARRIED_FIELDS if k in cfg and cfg[k] is not None}


def check_same_base(configs: Sequence[Mapping[str, Any]], labels: Sequence[str], *, fn: str):
    known = [
        (c.get("base_model_name_or_path"), lab) for c, lab in zip(configs, labels, strict=True)
    ]
    known = [(b, lab) for b, lab in known if b is not None and b != ""]
    for b, lab in known[1:]:
        b0, lab0 = known[0]
        if b != b0:
            raise InputError(
                f"{fn}: the adapters were trained on different base models: {lab0} on "
                f"{clip_repr(b0)} but {lab} on {clip_repr(b)} (base_model_name_or_path); a merge "
                "of updates to different weights is meaningless. If both name the same model (a "
                "Hub id and a local copy), pass allow_different_base=True (CLI: "
                "--allow-different-base)."
            )


# target_modules and the fields that restrict it (PEFT's check_target_module_exists)

# Fields that build the model's layers themselves: the same module name means other weights
# under another value, so every adapter of a merge must have the same one.
_LAYOUT_FIELDS = ("layer_replication",)


def check_placement(
    configs: Sequence[Mapping[str, Any]],
    labels: Sequence[str],
    modules: Sequence[Sequence[str]],
    *,
    files: Sequence[str],
    fn: str,
) -> None:
    """Refuse adapters whose configs place their weights differently, or elsewhere than the
    weights they hold; every adapter is checked, not only the first (whose config the merged
    adapter carries).

    * ``layer_replication`` (:data:`_LAYOUT_FIELDS`) must be the same in every config (a missing
      one is none): it rebuilds the model's layers, so a module name stands for other weights
      under another value.
    * Each config's own target fields (``target_modules``, ``exclude_modules``,
      ``layers_to_transform``, ``layers_pattern``) must make PEFT adapt every module its weights
      hold (``modules[i]``): PEFT would load the others nowhere, and the merged adapter's config
      would put them where the task never had them. A config without ``target_modules`` (PEFT
      then picks the model type's defaults) is not checked. ``files``: each config file's path,
      which prefixes a regex's messages.
    """
    for field in _LAYOUT_FIELDS:
        values = [to_jsonable(c.get(field)) for c in configs]
        for v, lab in zip(values[1:], labels[1:], strict=True):
            if v != values[0]:
                raise InputError(
                    f"{fn}: the adapters place their weights differently: {labels[0]} has "
                    f"{field}={clip_repr(values[0])} but {lab} has {field}={clip_repr(v)} (in "
                    f"{CONFIG_FILE}; null: none). {field} builds the model's layers from the base "
                    "model's, so the same module name stands for different weights; merge "
                    f"adapters trained with the same {field}."
                )
    for cfg, lab, names, f in zip(configs, labels, modules, files, strict=True):
        if cfg.get("target_modules") is None:
            continue
        rx = Regexes(fn, f"{f!r}: ")
        missed = untargeted(cfg, names, rx, fn=fn)
        if not missed:
            continue
        blame = "target_modules"
        for fields in (("layers_to_transform", "layers_pattern"), ("exclude_modules",)):
            if any(cfg.get(f) is not None for f in fields):
                rest = {k: v for k, v in cfg.items() if k not in fields}
                if len(untargeted(rest, missed, rx, fn=fn)) < len(missed):
                    blame = fields[0]
                    break
        shown = ", ".join(f"{k}={clip_repr(cfg[k], 80)}" for k in _TARGET_FIELDS if cfg.get(k))
        what = (
            f"all {len(names)} modules its weights hold"
            if len(missed) == len(names)
            else f"{few(missed)} ({len(missed)} of the {len(names)} modules its weights hold)"
        )
        raise InputError(
            f"{fn}: the {CONFIG_FILE} of {lab} ({shown}) leaves out {what}: PEFT would not "
            f"adapt them, so it would load those weights nowhere. The config does not belong to "
            f"these weights, or its {blame} was edited: fix {blame} in {lab}."
        )


def union_config(
    configs: Sequence[Mapping[str, Any]], names: Sequence[str], *, where: str, fn: str
) -> dict[str, Any]:
    """The first config's carried fields, with target fields that cover all of ``names``."""
    carried = carried_config(configs[0])
    rx = Regexes(fn, where)
    if not untargeted(carried, names, rx, fn=fn):
        return carried
    out = {k: v for k, v in carried.items() if k not in _TARGET_FIELDS}
    lists = [to_jsonable(c.get("target_modules")) for c in configs]
    plain = all(
        isinstance(t, list) and all(isinstance(x, str) for x in t) for t in lists
    ) and not any(c.get(k) for c in configs for k in _TARGET_FIELDS[1:])
    if plain:
        union = {**out, "target_modules": sorted({x for t in lists for x in t})}
        if not untargeted(union, names, rx, fn=fn):
            return union
    return out


# ---------------------------------------------------------------------------------------------
# Target modules: which modules PEFT puts a LoRA layer on
# ---------------------------------------------------------------------------------------------


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
                f"{fn}: {where}{field} is {clip_repr(v)}; expected {want} (as PEFT's LoraConfig)."
            )


def untargeted(cfg: Mapping[str, Any], names: Sequence[str], rx: Regexes, *, fn: str) -> list[str]:
    """The modules among ``names`` that PEFT would not put a LoRA layer on under this config.

    PEFT's rule (``check_target_module_exists``): ``exclude_modules`` wins; a string
    ``target_modules`` is a regex that must match the whole name; a list matches the name itself
    or a suffix after a dot, and then ``layers_to_transform`` (with ``layers_pattern``) restricts
    the layer index. Each regex is evaluated (boundedly, see :class:`Regexes`) only on the names
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
    return sorted(out, key=natural_key)


def is_targeted(cfg: Mapping[str, Any], name: str) -> bool:
    """Whether PEFT would put a LoRA layer on module ``name`` under this config."""
    return not untargeted(cfg, [name], Regexes("nu.peft"), fn="nu.peft")


def check_targets(cfg: Mapping[str, Any], names: Iterable[str], *, fn: str) -> None:
    missed = untargeted(cfg, list(names), Regexes(fn), fn=fn)
    if missed:
        shown = []
        for k in _TARGET_FIELDS:
            v = cfg.get(k)
            if v is None:
                continue
            if isinstance(v, (list, tuple)) and len(v) > 3:
                shown.append(f"{k}=[{few([str(x) for x in v])}]")
            else:
                shown.append(f"{k}={clip_repr(v)}")
        raise InputError(
            f"{fn}: with {', '.join(shown) or 'no target_modules'} PEFT would not adapt "
            f"{few(missed)}, so {'its' if len(missed) == 1 else 'their'} weights would not be "
            "loaded. Leave target_modules out (the exact module names are then written) or make "
            "these fields cover every module of the adapter."
        )


# ---------------------------------------------------------------------------------------------
# Saving: per-module ranks as patterns
# ---------------------------------------------------------------------------------------------


def rank_patterns(ranks: Mapping[str, int]) -> tuple[int, dict[str, int]]:
    """Default ``r`` (the most common rank) and a ``rank_pattern`` for the other modules.

    Keys are ``"^" + re.escape(name)``, the form PEFT documents for an exact match: under its rule
    ``(.*\\.)?(key)$`` the anchor forces the optional prefix to be empty, so a key matches its own
    module only, whatever the key order (PEFT sorts the keys when it re-saves a config).
    """
    counts: dict[int, int] = {}
    for r in ranks.values():
        counts[r] = counts.get(r, 0) + 1
    r0 = min(counts, key=lambda r: (-counts[r], r))
    listed = sorted((n for n, r in ranks.items() if r != r0), key=natural_key)
    return r0, {"^" + re.escape(n): ranks[n] for n in listed}
