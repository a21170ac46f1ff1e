"""Saving: a (merged) adapter as a PEFT LoRA checkpoint (:func:`save_adapter`), as validate /
convert / configure / write steps."""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._core import checks as _checks
from .._core.io import atomic_directory, to_jsonable
from .._core.tree import has_update, is_mapping, walk_modules
from ..errors import InputError, InputTypeError, PathExistsError
from ._common import (
    CONFIG_NAME,
    PREFIX,
    WEIGHTS_NAME,
    natural_key,
    safetensors_module,
    save_tensors,
)
from ._config import (
    COMPUTED_FIELDS,
    CONFIG_OVERRIDES,
    carried_config,
    check_targets,
    rank_patterns,
)
from ._convert import SAVE_DTYPES, peft_factors, peft_tensors, saved_dtype
from ._read import load_config

__all__ = [
    "VLLM_RANKS",
    "check_free_dir",
    "check_save_options",
    "check_serving_ranks",
    "config_text",
    "modules_for_save",
    "save_adapter",
    "saved_config",
    "serving_ranks",
    "written_tensors",
]


def save_adapter(
    adapter: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    rank: int | None = None,
    base_config: Any = None,
    dtype: str = "float32",
    serving_ranks: str | Sequence[int] | None = None,
    **config: Any,
) -> dict[str, Any]:
    """Write a (merged) adapter as a PEFT LoRA checkpoint that ``PeftModel.from_pretrained`` loads.

    Each module's update ``dK`` (:func:`nu.module_update`) is written so that PEFT reproduces it
    exactly: ``lora_A.weight = lora_a^T`` ``(r, d_in)``, ``lora_B.weight = (scale * lora_b)^T``
    ``(d_out, r)``, and PEFT's own scale is 1 (``lora_alpha = r`` per module, rsLoRA off). Where
    the saved ``dtype`` cannot hold a factor (its largest entry below the dtype's smallest normal
    number, or beyond its range: a tiny ``coef`` or scale folded into ``lora_B`` in float16), a
    power of two moves from one factor to the other so that both are about the square root of
    the update's size (the product is the same, exactly); an update that no such split fits is
    refused, never written as zeros or inf. Modules
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
      serving_ranks: write every module at one uniform rank for serving stacks that ignore
        ``rank_pattern`` and accept only some LoRA ranks: ``"vllm"`` (:data:`VLLM_RANKS`) or a
        sequence of allowed ranks. The rank written is the smallest allowed one at least the
        largest module rank; each module's factors are zero-padded to it (the update is exactly
        the same), ``lora_alpha = r`` (PEFT's scale 1, the merged scale already in
        ``lora_B``), and no patterns are written. None (default): each module at its own rank.
      **config: overrides of the carried fields (e.g. ``task_type="CAUSAL_LM"``) and
        ``inference_mode``. Without ``target_modules`` from either source, the exact module names
        are written. Carried ``target_modules`` (with ``exclude_modules``,
        ``layers_to_transform``) must make PEFT adapt every module of the adapter (checked with
        PEFT's rule); if they also reach modules the adapter lacks, PEFT creates those with a zero
        ``lora_B`` (no update) and warns about missing keys.

    Returns:
      The config written to ``adapter_config.json``.

    Raises:
      PathExistsError: ``path`` is a file or a non-empty directory (a ``FileExistsError``).
      InputError: ``serving_ranks`` allows no rank as large as the largest module (truncate the
        modules first with :func:`nu.to_lora`, or write dense ones with a smaller ``rank``); a
        module whose update ``dtype`` cannot hold even split between the factors (it over- or
        underflows).
      ValueError: a dense module without ``rank``; a bad rank, dtype or config key; a module name
        that is not a PEFT name; ``target_modules`` that miss a module; bad module shapes or
        non-finite values.
      TypeError: an adapter that is not a dict, a traced or non-floating array.
      OSError: the write failed (a full disk, a file-size limit): its ``errno`` and ``filename``
        say which; nothing is left at ``path``.

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
    safetensors_module()  # (without it: an ImportError saying what to install, before any work)
    check_save_options(rank, dtype, config, fn=fn)
    allowed = check_serving_ranks(serving_ranks, fn=fn)
    out_dir = pathlib.Path(os.fspath(path))
    check_free_dir(out_dir, fn=fn)
    modules = modules_for_save(adapter, fn=fn)
    names = sorted(modules, key=natural_key)
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    factors = {name: peft_factors(name, modules[name], rank, fn=fn) for name in names}
    if allowed is not None:
        factors = _pad_uniform(factors, allowed, fn=fn)
    for name in names:
        a, b = factors[name]
        ranks[name] = int(a.shape[0])
        tensors.update(written_tensors(name, a, b, dtype, fn=fn))
    cfg = saved_config(base_config, config, names, ranks, fn=fn)
    text = config_text(cfg, fn=fn)
    with atomic_directory(out_dir, fn=fn) as tmp:
        save_tensors(tensors, tmp / WEIGHTS_NAME)
        (tmp / CONFIG_NAME).write_text(text, encoding="utf-8")
    return cfg


def _finfo(dtype: str) -> Any:
    """``finfo`` of a ``save_adapter`` dtype name (bfloat16 through ml_dtypes)."""
    import ml_dtypes

    return ml_dtypes.finfo(saved_dtype(dtype))


def _fit_dtype(
    name: str, a: np.ndarray, b: np.ndarray, dtype: str, *, fn: str
) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's factors ``A (r, d_in)``, ``B (d_out, r)`` (float64) made to fit ``dtype``: as they
    are where both largest entries are normal numbers of it (well below its largest), else with
    a power of two moved between them so that both are about ``sqrt(max|A| max|B|)`` (the
    product is exactly the same); refused where even that split over- or underflows."""
    ma, mb = float(np.abs(a).max(initial=0)), float(np.abs(b).max(initial=0))
    if ma == 0 or mb == 0:  # a zero update: zeros, exactly
        return a, b
    fi = _finfo(dtype)
    tiny, big = float(fi.tiny), float(fi.max)
    if tiny <= ma <= big / 2 and tiny <= mb <= big / 2:
        return a, b
    k = round((math.log2(mb) - math.log2(ma)) / 2)
    ea, eb = math.ldexp(ma, k), math.ldexp(mb, -k)
    even = math.sqrt(ma) * math.sqrt(mb)
    sizes = f"lora_A's largest entry is {ma:.3g}, lora_B's {mb:.3g}; {even:.3g} each split evenly"
    if max(ea, eb) > big:
        part = "lora_B" if mb >= ma else "lora_A"
        raise InputError(
            f"{fn}: module {name!r}'s {part} overflows {dtype} (largest entry "
            f"{max(ma, mb):.3g}; {sizes}, beyond {dtype}'s largest number {big:.3g}); save "
            "with dtype='float32' or 'bfloat16', or rescale the merge (coef)."
        )
    if min(ea, eb) < tiny:
        raise InputError(
            f"{fn}: module {name!r}'s update underflows {dtype} ({sizes}, below {dtype}'s "
            f"smallest normal number {tiny:.3g}): written in {dtype} it would be lost (zeros, or "
            "a few bits of subnormal numbers). Save with dtype='float32' (normal from 1.18e-38) "
            "or rescale the merge (coef)."
        )
    return np.ldexp(a, k), np.ldexp(b, -k)


def written_tensors(name: str, a: np.ndarray, b: np.ndarray, dtype: str, *, fn: str) -> dict:
    """Module ``name``'s PEFT factors as the checkpoint's tensors in ``dtype``
    (:func:`_fit_dtype`, then :func:`_convert.peft_tensors`): what every writer writes."""
    a, b = _fit_dtype(name, a, b, dtype, fn=fn)
    return peft_tensors(name, a, b, dtype, fn=fn)


#: The LoRA ranks vLLM serves (its ``max_lora_rank`` choices).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def serving_ranks(spec: Any, *, fn: str) -> tuple[int, ...] | None:
    """The ranks a merged adapter may be padded to for serving (``save_adapter``'s
    ``serving_ranks``): ``"vllm"`` (:data:`VLLM_RANKS`), a sequence of allowed ranks, or None (no
    uniform rank), as a sorted tuple; anything else is an :class:`InputError` starting with
    ``fn``."""
    return check_serving_ranks(spec, fn=fn)


def check_serving_ranks(serving_ranks: Any, *, fn: str) -> tuple[int, ...] | None:
    """``serving_ranks`` as a sorted tuple of allowed ranks (None: no uniform rank)."""
    if serving_ranks is None:
        return None
    if isinstance(serving_ranks, str):
        if serving_ranks != "vllm":
            raise InputError(
                f"{fn}: serving_ranks={serving_ranks!r}; expected 'vllm', a sequence of allowed "
                "ranks such as (8, 16, 32, 64), or None."
            )
        return VLLM_RANKS
    ok = isinstance(serving_ranks, Sequence) and len(serving_ranks) > 0
    ranks = list(serving_ranks) if ok else []
    if not ok or any(
        isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1 for r in ranks
    ):
        raise InputError(
            f"{fn}: serving_ranks={_checks.brief(serving_ranks)}; expected 'vllm' or a non-empty "
            "sequence of positive integers (the ranks the serving stack accepts)."
        )
    return tuple(sorted({int(r) for r in ranks}))


def _pad_uniform(
    factors: Mapping[str, tuple[np.ndarray, np.ndarray]], allowed: tuple[int, ...], *, fn: str
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every module's PEFT factors ``A (r, d_in)``, ``B (d_out, r)`` zero-padded to the smallest
    allowed rank at least the largest ``r``."""
    top_name = max(factors, key=lambda n: factors[n][0].shape[0])
    top = int(factors[top_name][0].shape[0])
    fits = [r for r in allowed if r >= top]
    if not fits:
        raise InputError(
            f"{fn}: module {_checks.short(top_name)!r} has rank {top}, above every allowed "
            f"serving rank {allowed}; truncate the merged modules first (nu.to_lora(module, "
            f"{allowed[-1]})) or allow a larger rank."
        )
    r = fits[0]
    return {
        n: (
            np.pad(a, ((0, r - a.shape[0]), (0, 0))),
            np.pad(b, ((0, 0), (0, r - b.shape[1]))),
        )
        for n, (a, b) in factors.items()
    }


def check_save_options(rank: Any, dtype: Any, config: Mapping[str, Any], *, fn: str) -> None:
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1
    ):
        raise InputError(
            f"{fn}: rank={rank!r}; expected a positive integer (the rank dense modules are "
            "truncated to) or None."
        )
    if dtype not in SAVE_DTYPES:
        raise InputError(f"{fn}: dtype={dtype!r}; expected one of {SAVE_DTYPES}.")
    for k in config:
        if k in COMPUTED_FIELDS:
            raise InputError(
                f"{fn}: {k}= is computed by save_adapter (each module's rank, with lora_alpha = r "
                "so PEFT's scale is 1 and the merged scale is folded into lora_B); drop it."
            )
        if k not in CONFIG_OVERRIDES:
            raise InputError(
                f"{fn}: unknown config field {k}=; accepted: {', '.join(CONFIG_OVERRIDES)}."
            )


def check_free_dir(out_dir: pathlib.Path, *, fn: str) -> None:
    if out_dir.is_dir():
        if any(out_dir.iterdir()):
            raise PathExistsError(
                f"{fn}: {str(out_dir)!r} exists and is not empty; refusing to overwrite an "
                "adapter. Choose a new directory or delete this one first."
            )
    elif out_dir.exists():
        raise PathExistsError(
            f"{fn}: {str(out_dir)!r} is a file; pass a directory path for the adapter."
        )


def modules_for_save(adapter: Any, *, fn: str) -> dict[str, Mapping[str, Any]]:
    """``{PEFT module name: module}``: nested dicts joined with ``"."``, down to the mappings with
    ``lora_a`` / ``lora_b`` / ``delta``; any other leaf, and a name PEFT would not read, is
    refused."""
    if not isinstance(adapter, Mapping):
        raise InputTypeError(
            f"{fn}: adapter is a {type(adapter).__name__}; expected a dict keyed by PEFT module "
            "names (as nu.peft.load_adapter and nu.merge_adapters return)."
        )

    def cycle(path: tuple[str, ...]) -> Exception:
        return InputError(
            f"{fn}: the adapter contains itself at {'.'.join(path)!r} (a cycle of dicts); pass "
            "dicts of modules keyed by PEFT module names."
        )

    out: dict[str, Mapping[str, Any]] = {}
    for path, node in walk_modules(adapter, is_module=has_update, max_depth=None, cycle=cycle):
        name = ".".join(path)
        if not (is_mapping(node) and has_update(node)):
            raise InputError(
                f"{fn}: {name!r} holds a {type(node).__name__}, not a module; expected "
                "{'lora_a', 'lora_b', 'scale'} or {'delta'} dicts keyed by PEFT module names."
            )
        out[name] = node
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


def saved_config(
    base_config: Any,
    config: Mapping[str, Any],
    names: Sequence[str],
    ranks: Mapping[str, int],
    *,
    fn: str,
) -> dict[str, Any]:
    """The ``adapter_config.json`` to write: the carried fields (``base_config``, then the
    ``config`` overrides, ``target_modules`` default the module names), checked to cover every
    module, and the computed ones (per-module ranks, PEFT scale 1), sorted by field."""
    r0, rank_pattern = rank_patterns(ranks)
    cfg: dict[str, Any] = _resolve_base_config(base_config, fn=fn)
    cfg.update({k: to_jsonable(v) for k, v in config.items()})
    if cfg.get("target_modules") is None:
        cfg["target_modules"] = list(names)
    check_targets(cfg, names, fn=fn)
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
    return dict(sorted(cfg.items()))


def _resolve_base_config(base_config: Any, *, fn: str) -> dict[str, Any]:
    if base_config is None:
        return {}
    if isinstance(base_config, (str, os.PathLike)):
        return carried_config(load_config(base_config))
    if hasattr(base_config, "to_dict") and not isinstance(base_config, Mapping):
        base_config = base_config.to_dict()
    if not isinstance(base_config, Mapping):
        raise InputTypeError(
            f"{fn}: base_config is a {type(base_config).__name__}; expected a dict (e.g. "
            "nu.peft.load_config(dir) or load_adapters(...).config), a peft LoraConfig, or an "
            "adapter directory."
        )
    return carried_config(base_config)


def config_text(cfg: Mapping[str, Any], *, fn: str) -> str:
    try:
        return json.dumps(cfg, indent=2) + "\n"
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
