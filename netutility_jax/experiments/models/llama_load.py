"""Filling a Llama-family decoder from a checkpoint: Hugging Face tensors in, a :class:`Llama` out.

:func:`build` sets every base weight of an abstract model from ``{Hugging Face name: loader}``
(torch layout ``(out, in)``, transposed here), naming any tensor that is missing, of the wrong
shape or left over. :func:`read_folder` reads a Hugging Face folder's ``config.json`` and
``*.safetensors`` (sharded or not; pickles are refused, never unpickled); the GGUF side is
:mod:`netutility_jax.experiments.models.gguf_io`. The public loaders are
:func:`netutility_jax.experiments.models.llama.from_pretrained` and ``from_gguf``.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError, MissingFileError
from . import sharding
from .llama_config import ARCHITECTURES, LlamaConfig
from .llama_model import (
    BASE_WEIGHTS,
    Llama,
    ModelOptions,
    abstract_model,
    add_lora,
    check_dtype,
    check_filled,
    variable_at,
)
from .llama_tokenizer import read_json

__all__ = [
    "Tensors",
    "build",
    "check_folder",
    "check_options",
    "placement",
    "read_folder",
    "safetensors_tensors",
]

Tensors = Mapping[str, Callable[[], np.ndarray]]
"""A checkpoint's tensors: Hugging Face name -> loader of the array (torch layout)."""
_LEAF = {"kernel": ("weight", True), "bias": ("bias", False), "scale": ("weight", False)}
_LEAF["embedding"] = ("weight", False)
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _hf_key(path: Sequence[Any]) -> tuple[str, bool]:
    """(Hugging Face parameter name, transpose?) of a base variable's state path."""
    leaf, transpose = _LEAF[str(path[-1])]
    return ".".join(map(str, path[:-1])) + "." + leaf, transpose


def _fill(
    fn: str,
    model: Llama,
    tensors: Tensors,
    where: str,
    label: Callable[[str], str] = repr,
    place: Callable[[Sequence[Any], np.ndarray], Any] | None = None,
) -> None:
    """Set every base weight of an abstract model from ``tensors`` (HF names, torch layout);
    ``place(path, host_array)`` puts each on the devices (``sharding.placer``; None: the
    default device)."""
    used = set()
    for path, var in nnx.to_flat_state(nnx.state(model, BASE_WEIGHTS)):
        name, transpose = _hf_key(path)
        if name not in tensors:
            raise InputError(
                f"{fn}: {where} has no tensor {label(name)} (for {'/'.join(map(str, path))}); "
                "the checkpoint does not match its config (layers, biases, tied head?)."
            )
        loader = tensors[name]
        arr = loader()
        _check_finite(fn, arr, label(name), getattr(loader, "source", where))
        want = tuple(var.get_value().shape)
        want = want[::-1] if transpose else want  # in the checkpoint's (out, in) layout
        if tuple(arr.shape) != want:
            raise InputError(
                f"{fn}: tensor {label(name)} in {where} has shape {tuple(arr.shape)} but the "
                f"config needs {want} for {'/'.join(map(str, path))}; the config does not match "
                "the weights."
            )
        arr = arr.T if transpose else arr
        if place is None:
            value = jnp.asarray(arr, dtype=model.param_dtype)
        else:  # converted on the host: each device receives only its own share
            value = place(path, np.asarray(arr).astype(model.param_dtype))
        variable_at(model, path).set_value(value)
        used.add(name)
    unused = sorted(k for k in tensors if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if "lm_head.weight" in unused and model.config.tie_word_embeddings:
        emb = np.asarray(model.model.embed_tokens.embedding.get_value(), np.float32)
        if not np.array_equal(np.asarray(tensors["lm_head.weight"](), np.float32), emb):
            raise InputError(
                f"{fn}: the config ties the LM head to the embedding (tie_word_embeddings) but "
                f"{where} has an 'lm_head.weight' that differs from it; fix the config."
            )
        unused.remove("lm_head.weight")
    if unused:
        raise InputError(
            f"{fn}: {where} has weights this port does not use: {unused[:5]}"
            f"{' ...' if len(unused) > 5 else ''}; is it a {sorted(ARCHITECTURES.values())}?"
        )


def _check_finite(fn: str, arr: Any, label: str, source: str) -> None:
    """A checkpoint tensor's values are finite (a NaN or inf weight would load silently and
    poison every logit): two reductions, and a count only when one is not finite."""
    if not (hasattr(arr, "dtype") and jnp.issubdtype(arr.dtype, jnp.inexact)) or not arr.size:
        return
    a = np.asarray(arr)
    if np.isfinite(np.max(a)) and np.isfinite(np.min(a)):
        return
    n = int(np.count_nonzero(~np.isfinite(a)))
    raise InputError(
        f"{fn}: tensor {label} of {source} has {n} non-finite "
        f"{'entry' if n == 1 else 'entries'} (NaN or inf) of {a.size}; the checkpoint is damaged: "
        "download or convert it again."
    )


def build(
    fn: str,
    cfg: LlamaConfig,
    tensors: Tensors,
    where: str,
    options: ModelOptions,
    label: Callable[[str], str] = repr,
    *,
    mesh: Any = None,
    min_bytes: int | None = None,
) -> Llama:
    """A :class:`Llama` of ``cfg`` with its base weights from ``tensors`` and, with
    ``options.lora``, fresh adapters (:func:`add_lora`).

    With ``mesh``, each weight is placed on the mesh as it is read (``sharding.placer``: read
    to the host, converted to ``param_dtype`` there, and each device sent only its share), so no
    device ever holds the whole model; the adapters and the rest of the state are placed after
    (``sharding.shard_model``, the same rule).

    Args:
      fn: the public call, for messages.
      cfg: the model's config.
      tensors: Hugging Face name -> loader of the array in the torch layout.
      where: the checkpoint, for messages (``"the GGUF file"``).
      options: adapters, dtypes and ``rngs`` (needed only with ``lora``).
      label: how a tensor is named in messages.
      mesh: None (the default device), or a one-axis mesh (``sharding.model_mesh``).
      min_bytes: with ``mesh``: parameters smaller than this are replicated (None:
        ``sharding.MIN_BYTES``).

    Raises:
      InputError: ``lora`` without ``rngs``; a missing, misshapen or unused tensor; a mesh of
        several axes or of other processes' devices, a negative ``min_bytes``.
      InputTypeError: a dtype other than float32, bfloat16, float16; a ``mesh`` that is not a
        ``jax.sharding.Mesh``, a ``min_bytes`` that is not an int.
    """
    lora, dtype, param_dtype, rngs = check_options(fn, options)
    place, min_bytes = placement(fn, mesh, min_bytes)
    model = abstract_model(cfg, None, dtype, param_dtype)
    _fill(fn, model, tensors, where, label, place)
    check_filled(fn, model)
    model = model if lora is None else add_lora(model, lora, rngs=rngs)
    if mesh is not None:
        sharding.shard_model(model, mesh, min_bytes=min_bytes)
    return model


def placement(
    fn: str, mesh: Any, min_bytes: int | None
) -> tuple[Callable[[Sequence[Any], np.ndarray], Any] | None, int]:
    """A loader's ``mesh`` and ``min_bytes`` checked before any tensor is read: ``(place,
    min_bytes)``, ``place`` None without a mesh (``sharding.placer``).

    Raises:
      InputError, InputTypeError: as ``sharding.placer``.
    """
    min_bytes = sharding.MIN_BYTES if min_bytes is None else min_bytes
    if mesh is None:
        return None, min_bytes
    return sharding.placer(mesh, min_bytes=min_bytes, fn=fn), min_bytes


def check_options(fn: str, options: Any) -> tuple[Any, np.dtype, np.dtype, Any]:
    """A loader's ``ModelOptions`` (the decoder's or CLIP's), its dtypes checked
    (:func:`check_dtype`): ``(lora, dtype, param_dtype, rngs)``.

    Raises:
      InputError: ``lora`` without ``rngs``.
      InputTypeError: a dtype other than float32, bfloat16, float16.
    """
    lora, dtype, param_dtype, rngs = options
    if lora is not None and rngs is None:
        raise InputError(
            f"{fn}: lora={lora} needs rngs to draw the LoRA A factors, e.g. rngs=nnx.Rngs(0)."
        )
    return lora, check_dtype(fn, "dtype", dtype), check_dtype(fn, "param_dtype", param_dtype), rngs


def check_folder(d: pathlib.Path, fn: str, what: str) -> None:
    """A model folder ``d`` with a ``config.json``; ``what`` is the folder to pass, for the
    message (``"a Hugging Face model folder (config.json, ...)"``).

    Raises:
      MissingFileError: no folder or no ``config.json``.
    """
    if not d.is_dir():
        raise MissingFileError(
            f"{fn}: {'a file, not a folder' if d.exists() else 'no such folder'}; pass {what}."
        )
    if not (d / "config.json").is_file():
        raise MissingFileError(f"{fn}: no config.json in the folder.")


def read_folder(d: pathlib.Path, fn: str) -> tuple[LlamaConfig, Tensors]:
    """The config (``config.json``) and tensors (``*.safetensors``) of a Hugging Face folder.

    Raises:
      MissingFileError: no folder, ``config.json``, weights or shard.
      InputError: another architecture, a pickle-only folder, a bad file (a field of the wrong
        type in ``config.json``, an index that is not ``{"weight_map": {...}}``); a shard whose
        path or symlink leaves the folder (:func:`_roots`: the Hugging Face cache's blobs are
        inside).
    """
    check_folder(d, fn, "a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    cfg = LlamaConfig.from_hf(_read_json(d / "config.json", fn), source=str(d / "config.json"))
    return cfg, safetensors_tensors(d, fn)


def safetensors_tensors(d: pathlib.Path, fn: str) -> Tensors:
    """Every tensor of the folder's safetensors files (sharded or not): name -> loader."""
    from safetensors import SafetensorError, safe_open

    index = d / "model.safetensors.index.json"
    roots = _roots(d)
    if index.is_file():
        files = _index_shards(d, index, roots, fn)
    else:
        files = sorted(p for p in d.glob("*.safetensors") if p.name != "adapter_model.safetensors")
        for f in files:
            _check_inside(fn, f, roots, f"the shard {f.name!r}")
    if not files:
        pickles = sorted(p.name for p in d.iterdir() if p.suffix in _PICKLES)
        if pickles:
            raise InputError(
                f"{fn}: the folder holds pickle checkpoints only ({pickles[:3]}); they are never "
                "unpickled here (loading a pickle runs arbitrary code). Convert them to "
                "safetensors where you trust them, e.g. transformers' "
                "model.save_pretrained(folder, safe_serialization=True)."
            )
        raise MissingFileError(f"{fn}: no *.safetensors weights in the folder.")
    out: dict[str, Callable[[], np.ndarray]] = {}
    for f in files:
        try:
            handle = safe_open(str(f), framework="numpy")
            keys = list(handle.keys())
        except (SafetensorError, OSError) as e:
            raise InputError(f"{fn}: {f.name} is not a readable safetensors file ({e}).") from None
        for k in keys:
            if k in out:
                raise InputError(f"{fn}: tensor {k!r} appears in two shards (second: {f.name}).")
            out[k] = _getter(handle, k, f.name, fn)
    return out


def _getter(handle: Any, key: str, file: str, fn: str) -> Callable[[], np.ndarray]:
    from safetensors import SafetensorError

    def get() -> np.ndarray:
        try:
            return handle.get_tensor(key)
        except (SafetensorError, TypeError, ValueError) as e:
            raise InputError(f"{fn}: tensor {key!r} of {file} could not be read ({e}).") from None

    get.source = file  # type: ignore[attr-defined]  # for messages (:func:`_fill`)
    return get


def _read_json(path: pathlib.Path, fn: str) -> Any:
    """:func:`read_json`, with a file that is not UTF-8 text an :class:`InputError` too."""
    try:
        return read_json(path, fn)
    except UnicodeDecodeError as e:
        raise InputError(f"{fn}: {path.name} is not UTF-8 text ({e}); expected JSON.") from None


def _roots(d: pathlib.Path) -> tuple[pathlib.Path, ...]:
    """The folders a model folder's shards may be in: the folder itself and, for a snapshot of
    the Hugging Face cache (``models--org--name/snapshots/<rev>``, whose files are symlinks to
    ``../../blobs/<hash>``), its repository's ``blobs`` folder."""
    real = d.resolve()
    roots = [real]
    blobs = real.parent.parent / "blobs"
    if real.parent.name == "snapshots" and blobs.is_dir():
        roots.append(blobs.resolve())
    return tuple(roots)


def _check_inside(fn: str, path: pathlib.Path, roots: Sequence[pathlib.Path], what: str) -> None:
    """``path``, with every symlink followed, is inside one of ``roots`` (:func:`_roots`)."""
    real = path.resolve()
    if not any(real.is_relative_to(r) for r in roots):
        how = "is a symlink to" if path.is_symlink() else "resolves to"
        raise InputError(
            f"{fn}: {what} {how} {str(real)!r}, which leaves the model folder; shards must be "
            "files inside the folder (copy them in rather than linking to them)."
        )


def _leaves(rel: str) -> bool:
    """A path named in a file that leaves the folder it is taken in: absolute, or ``..`` first
    once normalised (``a/../../b``)."""
    return pathlib.PurePath(rel).is_absolute() or (
        pathlib.PurePath(os.path.normpath(rel)).parts[:1] == ("..",)
    )


def _index_shards(
    d: pathlib.Path, index: pathlib.Path, roots: Sequence[pathlib.Path], fn: str
) -> list[pathlib.Path]:
    """The shards ``model.safetensors.index.json`` lists: file names inside the folder (no
    absolute path, no ``..`` out of it, no symlink out of it), each present."""
    content = _read_json(index, fn)
    weight_map = content.get("weight_map") if isinstance(content, Mapping) else None
    if not isinstance(weight_map, Mapping):
        raise InputError(
            f"{fn}: model.safetensors.index.json has no 'weight_map' dict; expected "
            '{"weight_map": {"tensor name": "shard file name", ...}}.'
        )
    files = set()
    for name, v in weight_map.items():
        if not isinstance(v, str) or not v:
            raise InputError(
                f"{fn}: model.safetensors.index.json maps {name!r} to {v!r}; expected the file "
                "name of a shard in the folder (a string)."
            )
        if _leaves(v):
            raise InputError(
                f"{fn}: model.safetensors.index.json lists the shard {v!r}, which leaves the "
                "model folder (an absolute path or '..'); shards must be files inside the folder."
            )
        files.add(v)
    out = []
    for v in sorted(files):
        f = d / v
        _check_inside(fn, f, roots, f"the shard {v!r} (in model.safetensors.index.json)")
        if not f.is_file():
            raise MissingFileError(
                f"{fn}: model.safetensors.index.json lists the shard {v!r}, which is not in the "
                "folder; download every shard."
            )
        out.append(f)
    return out
