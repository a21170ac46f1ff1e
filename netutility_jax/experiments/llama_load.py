"""Filling a Llama-family decoder from a checkpoint: Hugging Face tensors in, a :class:`Llama` out.

:func:`build` sets every base weight of an abstract model from ``{Hugging Face name: loader}``
(torch layout ``(out, in)``, transposed here), naming any tensor that is missing, of the wrong
shape or left over. :func:`read_folder` reads a Hugging Face folder's ``config.json`` and
``*.safetensors`` (sharded or not; pickles are refused, never unpickled); the GGUF side is
:mod:`netutility_jax.experiments.gguf_io`. The public loaders are
:func:`netutility_jax.experiments.llama.from_pretrained` and ``from_gguf``.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import InputError, MissingFileError
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
    "read_folder",
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
) -> None:
    """Set every base weight of an abstract model from ``tensors`` (HF names, torch layout)."""
    used = set()
    for path, var in nnx.to_flat_state(nnx.state(model, BASE_WEIGHTS)):
        name, transpose = _hf_key(path)
        if name not in tensors:
            raise InputError(
                f"{fn}: {where} has no tensor {label(name)} (for {'/'.join(map(str, path))}); "
                "the checkpoint does not match its config (layers, biases, tied head?)."
            )
        arr = tensors[name]()
        want = tuple(var.get_value().shape)
        want = want[::-1] if transpose else want  # in the checkpoint's (out, in) layout
        if tuple(arr.shape) != want:
            raise InputError(
                f"{fn}: tensor {label(name)} in {where} has shape {tuple(arr.shape)} but the "
                f"config needs {want} for {'/'.join(map(str, path))}; the config does not match "
                "the weights."
            )
        arr = arr.T if transpose else arr
        variable_at(model, path).set_value(jnp.asarray(arr, dtype=model.param_dtype))
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


def build(
    fn: str,
    cfg: LlamaConfig,
    tensors: Tensors,
    where: str,
    options: ModelOptions,
    label: Callable[[str], str] = repr,
) -> Llama:
    """A :class:`Llama` of ``cfg`` with its base weights from ``tensors`` and, with
    ``options.lora``, fresh adapters (:func:`add_lora`).

    Args:
      fn: the public call, for messages.
      cfg: the model's config.
      tensors: Hugging Face name -> loader of the array in the torch layout.
      where: the checkpoint, for messages (``"the GGUF file"``).
      options: adapters, dtypes and ``rngs`` (needed only with ``lora``).
      label: how a tensor is named in messages.

    Raises:
      InputError: ``lora`` without ``rngs``; a missing, misshapen or unused tensor.
      InputTypeError: a dtype other than float32, bfloat16, float16.
    """
    lora, dtype, param_dtype, rngs = options
    if lora is not None and rngs is None:
        raise InputError(
            f"{fn}: lora={lora} needs rngs to draw the LoRA A factors, e.g. rngs=nnx.Rngs(0)."
        )
    dtype, param_dtype = (
        check_dtype(fn, "dtype", dtype),
        check_dtype(fn, "param_dtype", param_dtype),
    )
    model = abstract_model(cfg, None, dtype, param_dtype)
    _fill(fn, model, tensors, where, label)
    check_filled(fn, model)
    return model if lora is None else add_lora(model, lora, rngs=rngs)


def read_folder(d: pathlib.Path, fn: str) -> tuple[LlamaConfig, Tensors]:
    """The config (``config.json``) and tensors (``*.safetensors``) of a Hugging Face folder.

    Raises:
      MissingFileError: no folder, ``config.json``, weights or shard.
      InputError: another architecture, a pickle-only folder, a bad file.
    """
    if not d.is_dir():
        raise MissingFileError(
            f"{fn}: {'a file, not a folder' if d.exists() else 'no such folder'}; pass a "
            "Hugging Face model folder (config.json, *.safetensors, tokenizer.json)."
        )
    if not (d / "config.json").is_file():
        raise MissingFileError(f"{fn}: no config.json in the folder.")
    cfg = LlamaConfig.from_hf(read_json(d / "config.json", fn), source=str(d / "config.json"))
    return cfg, _safetensors(d, fn)


def _safetensors(d: pathlib.Path, fn: str) -> Tensors:
    """Every tensor of the folder's safetensors files (sharded or not): name -> loader."""
    from safetensors import SafetensorError, safe_open

    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, fn).get("weight_map")
        if not isinstance(weight_map, Mapping):
            raise InputError(f"{fn}: model.safetensors.index.json has no 'weight_map' dict.")
        files = sorted({d / str(v) for v in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise MissingFileError(
                    f"{fn}: model.safetensors.index.json lists the shard {f.name!r}, which is not "
                    "in the folder; download every shard."
                )
    else:
        files = sorted(p for p in d.glob("*.safetensors") if p.name != "adapter_model.safetensors")
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

    return get
