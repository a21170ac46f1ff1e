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
opened.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .errors import InputError, InputTypeError

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
# Pattern keys (rank_pattern / alpha_pattern)
# ---------------------------------------------------------------------------------------------


def pattern_key(pattern_keys: Iterable[str], name: str) -> str | None:
    """The ``rank_pattern`` / ``alpha_pattern`` key PEFT applies to module ``name``, or None.

    PEFT's rule (``peft.utils.other.get_pattern_key``): each key is a regular expression, and the
    first key in dict order for which ``re.match(rf"(.*\\.)?({key})$", name)`` succeeds wins, so a
    key matches the whole name or a suffix of it that starts after a dot (``"q_proj"`` matches
    every ``....q_proj``; ``"layers.1.self_attn.q_proj"`` one module; unescaped dots match any
    character; a leading ``^`` forces the whole name: ``"^model.layers.0.q_proj"`` matches only
    that module, not ``"x.model.layers.0.q_proj"``).

    Args:
      pattern_keys: the keys of ``rank_pattern`` or ``alpha_pattern``, in the config's order.
      name: module name without the ``base_model.model.`` prefix.

    Returns:
      The first matching key, or None.

    Raises:
      ValueError: a key that is not a valid regular expression.

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
    return _match_key(pattern_keys, name, fn="nu.peft.pattern_key")


def _match_key(pattern_keys: Iterable[str], name: str, *, fn: str) -> str | None:
    for key in pattern_keys:
        try:
            hit = re.match(rf"(.*\.)?({key})$", name)
        except re.error as e:
            raise InputError(
                f"{fn}: pattern key {key!r} is not a valid regular expression ({e}); PEFT matches "
                "rank_pattern / alpha_pattern keys as regexes: escape special characters."
            ) from e
        if hit:
            return key
    return None


def _pattern_value(pattern: Mapping[str, Any], name: str, default: Any, *, fn: str) -> Any:
    key = _match_key(pattern.keys(), name, fn=fn)
    # PEFT falls back to looking the name itself up; a name always matches itself as a regex
    # unless it holds regex syntax, which module names do not, but stay faithful.
    return pattern.get(name if key is None else key, default)


def _natural(name: str) -> list[Any]:
    # "layers.2" before "layers.10"
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _directory(path: Any, *, fn: str) -> pathlib.Path:
    p = pathlib.Path(os.fspath(path))
    if not p.exists():
        raise FileNotFoundError(
            f"{fn}: no such directory {str(p)!r}. Pass the local directory PEFT's save_pretrained "
            f"wrote (it holds {CONFIG_NAME} and {WEIGHTS_NAME}); for a Hugging Face Hub id, "
            "download it first with huggingface_hub.snapshot_download(repo_id)."
        )
    if not p.is_dir():
        raise InputError(
            f"{fn}: {str(p)!r} is a file; pass the adapter directory that holds {CONFIG_NAME} and "
            f"{WEIGHTS_NAME} (here: {str(p.parent)!r})."
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
      FileNotFoundError: no such directory, or no ``adapter_config.json`` in it.
      ValueError: ``path`` is a file; the file is not valid JSON or not a JSON object.

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
    if not f.is_file():
        raise FileNotFoundError(
            f"{fn}: {str(f)!r} does not exist; a PEFT adapter directory holds {CONFIG_NAME} next "
            f"to {WEIGHTS_NAME} (PeftModel.save_pretrained writes both)."
        )
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(
            f"{fn}: {str(f)!r} is not valid JSON ({e}); the file is corrupt or truncated: "
            "re-save the adapter with PEFT's save_pretrained."
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
            f"{where} has peft_type={peft_type!r}; only LoRA adapters (peft_type 'LORA') can be "
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
            f"{where} sets target_parameters={cfg['target_parameters']!r}: LoRA on raw parameters "
            "(e.g. MoE experts) has a different layout and is not supported; only LoRA on "
            "Linear / Conv1D modules (target_modules) is."
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
            f"{where} has init_lora_weights={cfg['init_lora_weights']!r}: this initialisation "
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
            f"{fn}: {str(f)!r} is not a readable safetensors file ({e}); it is corrupt or "
            "truncated (an interrupted download or copy): download or save it again."
        ) from e


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

    Args:
      path: the adapter directory (what ``PeftModel.save_pretrained`` wrote).
      strict: if True, refuse tensors that are not LoRA factors (``modules_to_save`` copies,
        trainable tokens, trained biases); if False, skip them (the merge then lacks them).

    Returns:
      ``{name: {"lora_a": (d_in, r), "lora_b": (r, d_out), "scale": float}}`` with names like
      ``"model.layers.0.self_attn.q_proj"`` (no ``base_model.model.`` prefix), in natural order;
      arrays are ``jax.Array`` (float32, or float64 if stored so and x64 is on).

    Raises:
      FileNotFoundError: missing directory or files.
      ValueError: only a pickled ``adapter_model.bin``; corrupt JSON or safetensors; a DoRA,
        lora_bias, QA-LoRA, aLoRA, target_parameters or unconverted PiSSA/OLoRA/CorDA/LoRA-GA
        adapter; LoRA on embeddings or convolutions; several adapter names in one file; a lora_A
        without its lora_B (or the reverse); factor shapes that disagree with each other or with
        ``r``; non-LoRA tensors with ``strict=True``.
      TypeError: non-floating factors.

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
    d = _directory(path, fn=fn)
    wf = d / WEIGHTS_NAME
    if not wf.is_file():
        if (d / PICKLE_NAME).is_file():
            raise InputError(
                f"{fn}: {str(d)!r} holds only the pickled {PICKLE_NAME}, which is never unpickled "
                "here (loading a pickle can run arbitrary code). Convert it once with PEFT: "
                "PeftModel.from_pretrained(base_model, dir).save_pretrained(out, "
                f"safe_serialization=True), which writes {WEIGHTS_NAME}."
            )
        raise FileNotFoundError(
            f"{fn}: {str(wf)!r} does not exist; a PEFT LoRA adapter directory holds {WEIGHTS_NAME} "
            f"and {CONFIG_NAME} (PeftModel.save_pretrained writes both)."
        )
    cfg = load_config(d)
    cf = d / CONFIG_NAME
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
                f"{fn}: {str(wf)!r} is not a readable safetensors file ({e}); it is corrupt or "
                "truncated: download or save it again."
            ) from e
        for k in keys:
            module, kind, adapter_name, param = _split_key(k)
            if kind is None:
                if strict:
                    raise InputError(
                        f"{fn}: {str(wf)!r} holds {k!r} {shapes[k]}, which is not a LoRA factor "
                        "(a modules_to_save copy, trainable tokens or a trained bias). A merge "
                        "of LoRA updates cannot carry it; pass strict=False to skip such "
                        "tensors."
                    )
                continue
            if kind == "lora_magnitude_vector":
                raise InputError(
                    f"{fn}: {str(wf)!r} holds the DoRA magnitude {k!r}: DoRA adapters are not "
                    "scale * B A updates and cannot be merged as LoRA."
                )
            if kind in ("lora_embedding_A", "lora_embedding_B"):
                raise InputError(
                    f"{fn}: {str(wf)!r} holds {k!r}: LoRA on an embedding layer ({module!r}) is "
                    "not supported; train the adapter without embedding layers in "
                    "target_modules."
                )
            if kind not in ("lora_A", "lora_B"):
                raise InputError(
                    f"{fn}: {str(wf)!r} holds {k!r} ({kind}), which is not part of a LoRA "
                    "adapter (lora_A / lora_B); was it saved by another PEFT method?"
                )
            if param == "bias":
                raise InputError(
                    f"{fn}: {str(wf)!r} holds the bias {k!r}: an adapter trained with "
                    "lora_bias=true is not a pure scale * B A update and cannot be merged as LoRA."
                )
            if adapter_name is not None:
                adapter_names.add(adapter_name)
            slot = factors.setdefault(module, {})
            if kind in slot:
                raise InputError(
                    f"{fn}: {str(wf)!r} holds two {kind} tensors for module {module!r} "
                    f"({slot[kind]!r} and {k!r}); keep one adapter per directory."
                )
            slot[kind] = k
        if len(adapter_names) > 1:
            raise InputError(
                f"{fn}: {str(wf)!r} holds several adapters ({sorted(adapter_names)}); save each "
                "with PEFT's save_pretrained(..., selected_adapters=[name]) and load them one by "
                "one."
            )
        if not factors:
            raise InputError(
                f"{fn}: {str(wf)!r} holds no LoRA factors (no '...lora_A.weight' / "
                "'...lora_B.weight' keys); it is not a LoRA adapter."
            )

        out: dict[str, dict[str, Any]] = {}
        for module in sorted(factors, key=_natural):
            slot = factors[module]
            for have, need in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
                if have in slot and need not in slot:
                    raise InputError(
                        f"{fn}: {str(wf)!r} has {slot[have]!r} {shapes[slot[have]]} but no "
                        f"{need} for module {module!r}; the file is incomplete: save the adapter "
                        "again."
                    )
            ka, kb = slot["lora_A"], slot["lora_B"]
            sa, sb = shapes[ka], shapes[kb]
            if len(sa) != 2 or len(sb) != 2:
                raise InputError(
                    f"{fn}: module {module!r} in {str(wf)!r} has lora_A {sa} and lora_B {sb}; "
                    "only 2-D factors (LoRA on Linear / Conv1D) are supported, not LoRA on "
                    "convolutions."
                )
            r = _pattern_value(rank_pattern, module, r_default, fn=fn)
            alpha = _pattern_value(alpha_pattern, module, alpha_default, fn=fn)
            if sa[0] != sb[1]:
                raise InputError(
                    f"{fn}: module {module!r} in {str(wf)!r} has lora_A {sa} = (r, d_in) but "
                    f"lora_B {sb} = (d_out, r) with a different r; the file is corrupt: save the "
                    "adapter again."
                )
            if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r <= 0:
                raise InputError(
                    f"{fn}: {str(cf)!r} gives module {module!r} r={r!r}; expected a positive "
                    "integer."
                )
            if sa[0] != r:
                raise InputError(
                    f"{fn}: module {module!r} has lora_A {sa} and lora_B {sb} (rank {sa[0]}) in "
                    f"{str(wf)!r}, but {str(cf)!r} gives it r={r} (r / rank_pattern); the config "
                    "does not belong to these weights: keep each adapter's config with its "
                    "weights."
                )
            if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
                raise InputError(
                    f"{fn}: {str(cf)!r} gives module {module!r} lora_alpha={alpha!r}; expected a "
                    "number."
                )
            scale = float(alpha) / (math.sqrt(r) if rslora else float(r))
            a = fh.get_tensor(ka)
            b = fh.get_tensor(kb)
            for k, x in ((ka, a), (kb, b)):
                if not jnp.issubdtype(x.dtype, jnp.floating):
                    raise InputTypeError(
                        f"{fn}: {k!r} in {str(wf)!r} has dtype {x.dtype}; LoRA factors are "
                        "floating point (float32, bf16, fp16)."
                    )
            out[module] = {"lora_a": _upcast(a), "lora_b": _upcast(b), "scale": scale}
    return out


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
        :func:`nu.merge_adapters`.
      config: the base-model fields of the first adapter's config (``base_model_name_or_path``,
        ``task_type``, ``target_modules``, ...; see ``CARRIED_FIELDS``), for
        :func:`save_adapter`'s ``base_config``.
    """

    adapters: list[dict[str, dict[str, Any]]]
    config: dict[str, Any]


def check_compatible(
    adapters: Sequence[Mapping[str, Any]], *, labels: Sequence[str] | None = None
) -> None:
    """Check that adapters share module names and update shapes (the same base model).

    Ranks may differ between adapters; names and ``(d_in, d_out)`` may not.

    Args:
      adapters: flat adapters as from :func:`load_adapter`.
      labels: how to name each adapter in messages (e.g. its path); default ``"adapter i"``.

    Raises:
      ValueError: naming the first module that one adapter lacks, or the first module whose
        ``(d_in, d_out)`` differs, with both shapes.

    Example:
      >>> import numpy as np
      >>> from netutility_jax import peft
      >>> a = {"q": {"lora_a": np.ones((8, 2)), "lora_b": np.ones((2, 4))}}
      >>> b = {"q": {"lora_a": np.ones((8, 3)), "lora_b": np.ones((3, 4))}}
      >>> peft.check_compatible([a, b])  # different ranks are fine
    """
    fn = "nu.peft.check_compatible"
    if labels is None:
        labels = [f"adapter {i}" for i in range(len(adapters))]
    if len(labels) != len(adapters):
        raise InputError(f"{fn}: {len(labels)} labels for {len(adapters)} adapters.")
    if not adapters:
        raise InputError(f"{fn}: no adapters given.")
    ref, ref_label = adapters[0], labels[0]
    for ad, label in zip(adapters[1:], labels[1:], strict=True):
        for x, y, lx, ly in ((ref, ad, ref_label, label), (ad, ref, label, ref_label)):
            missing = [n for n in x if n not in y]
            if missing:
                raise InputError(
                    f"{fn}: module {missing[0]!r} is in {lx} but not in {ly} "
                    f"({len(missing)} such module{'s' if len(missing) > 1 else ''}); the adapters "
                    "must target the same modules of the same base model (same target_modules)."
                )
        for name in ref:
            s0, s1 = _update_shape(ref[name]), _update_shape(ad[name])
            if s0 != s1:
                raise InputError(
                    f"{fn}: module {name!r} has update shape (d_in, d_out) = {s0} in {ref_label} "
                    f"but {s1} in {label}; the adapters were trained on different base models "
                    "and cannot be merged."
                )


def _update_shape(mod: Mapping[str, Any]) -> tuple[int, int]:
    if "delta" in mod:
        return tuple(int(n) for n in mod["delta"].shape)  # type: ignore[return-value]
    return int(mod["lora_a"].shape[0]), int(mod["lora_b"].shape[1])


def load_adapters(paths: Sequence[str | os.PathLike], *, strict: bool = True) -> LoadedAdapters:
    """Load several PEFT adapters for one merge and check they fit the same base model.

    Args:
      paths: adapter directories, one per task.
      strict: as for :func:`load_adapter`.

    Returns:
      :class:`LoadedAdapters` ``(adapters, config)``; ``config`` holds the base-model fields of
      the first adapter's config (the others may differ only in training settings such as ``r``).

    Raises:
      ValueError: no paths; adapters with different module names or update shapes (naming the
        first mismatching module, both shapes and both paths); everything :func:`load_adapter`
        raises.
      FileNotFoundError: as for :func:`load_adapter`.
    """
    fn = "nu.peft.load_adapters"
    if isinstance(paths, (str, os.PathLike)) or len(paths) == 0:
        raise InputError(
            f"{fn}: expected a non-empty list of adapter directories, got {paths!r}; for one "
            "adapter use nu.peft.load_adapter(path)."
        )
    adapters = [load_adapter(p, strict=strict) for p in paths]
    check_compatible(adapters, labels=[repr(os.fspath(p)) for p in paths])
    return LoadedAdapters(adapters, _carried(load_config(paths[0])))


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


def _targeted(cfg: Mapping[str, Any], name: str) -> bool:
    """Whether PEFT would put a LoRA layer on module ``name`` under this config.

    PEFT's rule (``check_target_module_exists``): ``exclude_modules`` wins; a string
    ``target_modules`` is a regex that must match the whole name; a list matches the name itself
    or a suffix after a dot, and then ``layers_to_transform`` (with ``layers_pattern``) restricts
    the layer index.
    """
    exclude = cfg.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, name):
                return False
        elif name in exclude or any(name.endswith("." + e) for e in exclude):
            return False
    target = cfg.get("target_modules")
    if target is None:
        return False
    if isinstance(target, str):
        return target == "all-linear" or re.fullmatch(target, name) is not None
    if name in target:
        return True
    if not any(name.endswith("." + t) for t in target):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    patterns = cfg.get("layers_pattern")
    if not patterns:
        hit = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        hit = None
        for pat in [patterns] if isinstance(patterns, str) else patterns:
            hit = re.match(rf"(?:^|.*?\.){pat}\.(?P<idx>\d+)\.", name)
            if hit:
                break
    if hit is None:
        return False
    idx = int(hit.group("idx"))
    return idx == layers if isinstance(layers, int) else idx in layers


def _check_targets(cfg: Mapping[str, Any], names: Iterable[str], *, fn: str) -> None:
    for n in names:
        try:
            ok = _targeted(cfg, n)
        except re.error as e:
            raise InputError(
                f"{fn}: target_modules / exclude_modules is not a valid regex ({e})."
            ) from e
        if not ok:
            shown = {
                k: cfg[k]
                for k in (
                    "target_modules",
                    "exclude_modules",
                    "layers_to_transform",
                    "layers_pattern",
                )
                if cfg.get(k) is not None
            }
            raise InputError(
                f"{fn}: with {shown} PEFT would not adapt module {n!r}, so its weights would not "
                "be loaded. Leave target_modules out (the exact module names are then written) or "
                "make these fields cover every module of the adapter."
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
        raise InputError(f"{fn}: the config is not JSON-serialisable ({e}): {cfg!r}.") from e

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        st.numpy.save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; save_pretrained's dirs are not
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
