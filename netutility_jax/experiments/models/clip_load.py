"""Filling CLIP from a Hugging Face folder: ``config.json`` and safetensors in, a model out.

:func:`read_folder` reads and validates ``config.json`` (:meth:`CLIPConfig.from_hf`) and opens
the weights (``model.safetensors``, or the shards a ``model.safetensors.index.json`` lists, each
of which must lie in the folder); :func:`build` sets every base weight of an abstract
:class:`CLIPModel` from them (torch layouts converted), naming any tensor that is missing, of the
wrong shape or left over. Pickles are refused, never unpickled. The public loader is
:func:`netutility_jax.experiments.models.clip.from_pretrained`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError
from . import sharding
from .clip_model import CLIPConfig, CLIPModel, ModelOptions, abstract_model, add_lora
from .llama_load import Tensors, check_folder, check_options, placement, safetensors_tensors
from .llama_model import BASE_WEIGHTS, check_filled, variable_at
from .llama_tokenizer import read_json

__all__ = ["Tensors", "build", "hf_name", "read_folder"]

_LEAF = {"kernel": "weight", "bias": "bias", "scale": "weight", "embedding": "weight"}


def hf_name(path: Sequence[Any]) -> str:
    """The Hugging Face parameter name of a base variable's state path.

    ``vision_model/encoder/layers/0/self_attn/q_proj/kernel`` is
    ``vision_model.encoder.layers.0.self_attn.q_proj.weight``; norms' ``scale`` and embeddings'
    ``embedding`` are ``weight``; ``class_embedding`` and ``logit_scale`` keep their names.

    Example:
      >>> hf_name(("text_model", "final_layer_norm", "scale"))
      'text_model.final_layer_norm.weight'
    """
    parts = [str(p) for p in path]
    if parts[-1] in _LEAF:
        parts[-1] = _LEAF[parts[-1]]
    return ".".join(parts)


def _to_flax(arr: np.ndarray, leaf: str) -> np.ndarray:
    """A torch-layout tensor in the flax layout: linear ``(out, in) -> (in, out)``, convolution
    ``(out, in, kh, kw) -> (kh, kw, in, out)``."""
    if leaf == "kernel" and arr.ndim == 2:
        return arr.T
    if leaf == "kernel" and arr.ndim == 4:
        return arr.transpose(2, 3, 1, 0)
    return arr


def _torch_shape(shape: tuple[int, ...], leaf: str) -> tuple[int, ...]:
    if leaf == "kernel" and len(shape) == 2:
        return shape[::-1]
    if leaf == "kernel" and len(shape) == 4:
        return (shape[3], shape[2], shape[0], shape[1])
    return shape


def build(
    fn: str,
    cfg: CLIPConfig,
    tensors: Tensors,
    where: str,
    options: ModelOptions,
    *,
    mesh: Any = None,
    min_bytes: int | None = None,
) -> CLIPModel:
    """A :class:`CLIPModel` of ``cfg`` with its base weights from ``tensors`` and, with
    ``options.lora``, fresh adapters (:func:`add_lora`).

    With ``mesh``, each weight is placed on the mesh as it is read (``sharding.placer``, as
    ``llama_load.build``): no device ever holds the whole model.

    Args:
      fn: the public call, for messages.
      cfg: the model's config.
      tensors: Hugging Face name -> loader of the array in the torch layout.
      where: the checkpoint, for messages.
      options: adapters, dtypes and ``rngs`` (needed only with ``lora``).
      mesh: None (the default device), or a one-axis mesh (``sharding.model_mesh``).
      min_bytes: with ``mesh``: parameters smaller than this are replicated (None:
        ``sharding.MIN_BYTES``).

    Raises:
      InputError: ``lora`` without ``rngs``; a missing, misshapen or unused tensor (named); a
        mesh of several axes or of other processes' devices, a negative ``min_bytes``.
      InputTypeError: a dtype other than float32, bfloat16, float16; a ``mesh`` that is not a
        ``jax.sharding.Mesh``, a ``min_bytes`` that is not an int.
    """
    lora, dtype, param_dtype, rngs = check_options(fn, options)
    place, min_bytes = placement(fn, mesh, min_bytes)
    model = abstract_model(cfg, None, dtype, param_dtype)
    used = set()
    for path, var in nnx.to_flat_state(nnx.state(model, BASE_WEIGHTS)):
        name, leaf = hf_name(path), str(path[-1])
        where_in = "/".join(map(str, path))
        if name not in tensors:
            raise InputError(
                f"{fn}: {where} has no tensor {name!r} (for {where_in}); the checkpoint does not "
                "match its config.json (layers, sizes) or is not a transformers CLIPModel."
            )
        arr = np.asarray(tensors[name]())
        want = tuple(var.get_value().shape)
        if tuple(arr.shape) != _torch_shape(want, leaf):
            raise InputError(
                f"{fn}: tensor {name!r} in {where} has shape {tuple(arr.shape)} but config.json "
                f"needs {_torch_shape(want, leaf)} for {where_in}; the config does not match the "
                "weights."
            )
        value = _to_flax(arr, leaf)
        if place is None:
            value = jnp.asarray(value, dtype=param_dtype)
        else:  # converted on the host: each device receives only its own share
            value = place(path, np.ascontiguousarray(value).astype(param_dtype))
        variable_at(model, path).set_value(value)
        used.add(name)
    # position_ids are buffers older transformers saved with the weights.
    unused = sorted(k for k in tensors if k not in used and not k.endswith(".position_ids"))
    if unused:
        raise InputError(
            f"{fn}: {where} has weights this port does not use: {unused[:5]}"
            f"{' ...' if len(unused) > 5 else ''}; is it a transformers CLIPModel checkpoint?"
        )
    check_filled(fn, model)
    model = model if lora is None else add_lora(model, lora, rngs=rngs)
    if mesh is not None:
        sharding.shard_model(model, mesh, min_bytes=min_bytes)
    return model


def read_folder(d: pathlib.Path, fn: str) -> tuple[CLIPConfig, Tensors]:
    """The config (``config.json``) and tensors (``*.safetensors``) of a Hugging Face folder.

    A ``model.safetensors.index.json`` must list shards inside the folder (plain relative
    names: no absolute path, no ``..``, no link leading out).

    Raises:
      MissingFileError: no folder, ``config.json``, weights or shard.
      InputError: a bad config (the field named), a shard path leaving the folder, a
        pickle-only folder, an unreadable file.
    """
    check_folder(d, fn, "a Hugging Face CLIPModel folder (config.json, model.safetensors)")
    cfg = CLIPConfig.from_hf(read_json(d / "config.json", fn), source=str(d / "config.json"))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        _check_index(fn, d, read_json(index, fn))
    return cfg, safetensors_tensors(d, fn)


def _check_index(fn: str, d: pathlib.Path, index: Any) -> None:
    """Refuse an index whose shard paths leave the folder ``d``."""
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if not isinstance(weight_map, Mapping):
        raise InputError(f"{fn}: model.safetensors.index.json has no 'weight_map' dict.")
    root = d.resolve()
    for shard in sorted({str(v) for v in weight_map.values()}):
        p = pathlib.Path(shard)
        inside = not p.is_absolute() and ".." not in p.parts
        if inside:
            inside = (d / p).resolve().is_relative_to(root)
        if not inside:
            raise InputError(
                f"{fn}: model.safetensors.index.json lists the shard {shard!r}, which is not in "
                "the folder; shards must be files of the model folder (plain relative names)."
            )
