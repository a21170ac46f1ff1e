"""CLIP (ViT image tower + causal text tower) in Flax nnx, with LoRA on the attention.

transformers' ``CLIPModel`` (Radford et al., 2021): the vision tower is a pre-LN ViT (patch
embedding by a stride-``p`` convolution without bias, a class token, position embeddings,
``pre_layrnorm``, ``num_layers`` blocks of LayerNorm -> self-attention -> residual, LayerNorm ->
MLP (``fc1``, quick-GELU ``x sigmoid(1.702 x)`` or the config's ``hidden_act``, ``fc2``) ->
residual, and ``post_layernorm`` of the class token) followed by ``visual_projection``; the
text tower embeds tokens and positions, runs the same blocks under a causal mask (and the
padding mask), applies ``final_layer_norm`` and reads the state at the end-of-text token
(transformers' rule: ``argmax(input_ids)`` when ``eos_token_id == 2``, old configs such as
openai/clip-vit-base-patch32's; otherwise the first position holding ``eos_token_id``), followed
by ``text_projection``. Logits are ``exp(logit_scale)`` times the cosine similarities. The
forward is the inference one, float32 by default; ``dtype=jnp.bfloat16`` runs the matrix
products in bfloat16 while LayerNorms, softmax and the residual stream stay in float32.

**Loading.** :func:`from_pretrained` reads a Hugging Face ``CLIPModel`` folder: ``config.json``
(validated, :meth:`CLIPConfig.from_hf`), ``model.safetensors`` or the shards of
``model.safetensors.index.json`` (which must lie in the folder), and ``preprocessor_config.json``
when present (:class:`ImageProcessorConfig`); it returns ``Loaded(model, config, image_config)``.
Nothing is downloaded, nothing is unpickled. :func:`preprocess` turns PIL images into the pixel
values ``CLIPImageProcessor`` gives (the same arrays).

**Names.** Module paths mirror the Hugging Face parameter names: the state of
``vision_model.encoder.layers.3.self_attn.q_proj.weight`` is
``vision_model/encoder/layers/3/self_attn/q_proj/kernel`` (its transpose, the flax layout
``(d_in, d_out)``). So the LoRA module ``nu.nnx.extract_adapter`` names
``"vision_model/encoder/layers/3/self_attn/q_proj"`` is PEFT's
``base_model.model.vision_model.encoder.layers.3.self_attn.q_proj`` on ``transformers.CLIPModel``
(and on ``CLIPVisionModel``, whose tower has the same name); :func:`peft_names` and
:func:`nnx_names` convert, ``nu.peft.save_adapter`` / ``nu.peft.load_adapter`` read and write.

**LoRA** (Hu et al., 2021). With ``lora=LoRAConfig(rank, alpha)`` the targeted layers (default
``q_proj, k_proj, v_proj, out_proj`` of every layer of the vision tower, as in KnOTS; ``towers``
adds the text tower, ``targets`` the MLP's ``fc1``/``fc2``) are
:class:`netutility_jax.experiments.models.minilm.LoRALinear`: ``y = x W + b + (alpha / r) (x A) B``,
``A`` ``(d_in, r)`` He-uniform and ``B`` ``(r, d_out)`` zero. A loaded or merged adapter
(``{name: {lora_a, lora_b, scale}}`` or ``{name: {delta}}``, PEFT or nnx names) is applied by
:func:`fold_adapter` (into the base kernels, on any model) or, on a model with LoRA layers of the
same names, by ``nu.nnx.apply_adapter(model, clip.nnx_names(adapter), mode="lora")``.

**Shapes and jit.** The model's methods are not jitted (the caller owns the outer jit: e.g.
``nnx.jit(lambda m, x: m.get_image_features(x))``); :func:`image_features` runs a jitted
forward over a large array in fixed-size batches (one compilation). On GPUs XLA computes float32
matrix products in TF32 by default (about ``1e-3`` from transformers' CPU float32); under
``jax.default_matmul_precision("highest")`` the features match transformers to ``1e-5`` there
too (checked on an H100 and an H200).

**Modules.** This file holds the loader, the names and the adapter operations, and re-exports
the rest: :mod:`~netutility_jax.experiments.models.clip_model` (configs and nnx modules),
:mod:`~netutility_jax.experiments.models.clip_load` (filling a model from a folder) and
:mod:`~netutility_jax.experiments.models.clip_image` (preprocessing).

References:
  Radford et al., "Learning Transferable Visual Models From Natural Language Supervision",
  ICML 2021. Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image
  Recognition at Scale", ICLR 2021. Hu et al., "LoRA: Low-Rank Adaptation of Large Language
  Models", ICLR 2022. Stoica et al., "Model merging with SVD to tie the Knots", ICLR 2025.
"""

from __future__ import annotations

import functools
import pathlib
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from ...errors import InputError, InputTypeError
from . import clip_load, llama_load
from .clip_image import ALPHA_MODES as ALPHA_MODES
from .clip_image import OPENAI_CLIP_MEAN as OPENAI_CLIP_MEAN
from .clip_image import OPENAI_CLIP_STD as OPENAI_CLIP_STD
from .clip_image import ImageProcessorConfig as ImageProcessorConfig
from .clip_image import preprocess as preprocess
from .clip_model import ACTIVATIONS as ACTIVATIONS
from .clip_model import ALL_TARGETS as ALL_TARGETS
from .clip_model import LORA_TARGETS as LORA_TARGETS
from .clip_model import TOWERS as TOWERS
from .clip_model import CLIPConfig as CLIPConfig
from .clip_model import CLIPModel as CLIPModel
from .clip_model import CLIPOutput as CLIPOutput
from .clip_model import CLIPTextConfig as CLIPTextConfig
from .clip_model import CLIPVisionConfig as CLIPVisionConfig
from .clip_model import LoRAConfig as LoRAConfig
from .clip_model import ModelOptions
from .clip_model import add_lora as add_lora
from .clip_model import with_dtype as with_dtype
from .llama_model import rename_modules, variable_at

__all__ = [
    "ACTIVATIONS",
    "ALL_TARGETS",
    "ALPHA_MODES",
    "LORA_TARGETS",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "TOWERS",
    "CLIPConfig",
    "CLIPModel",
    "CLIPOutput",
    "CLIPTextConfig",
    "CLIPVisionConfig",
    "ImageProcessorConfig",
    "LoRAConfig",
    "Loaded",
    "add_lora",
    "fold_adapter",
    "from_pretrained",
    "image_features",
    "nnx_names",
    "peft_names",
    "preprocess",
    "with_dtype",
]


class Loaded(NamedTuple):
    """What :func:`from_pretrained` returns: ``model, config, image_config = ...``."""

    model: CLIPModel
    config: CLIPConfig
    image_config: ImageProcessorConfig


def from_pretrained(
    folder: str | pathlib.Path,
    *,
    lora: LoRAConfig | None = None,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs | None = None,
    mesh: Any = None,
    min_bytes: int | None = None,
) -> Loaded:
    """Load a Hugging Face ``CLIPModel`` folder (e.g. openai/clip-vit-base-patch32 on disk).

    Args:
      folder: the model folder: ``config.json``, ``model.safetensors`` (or sharded, with
        ``model.safetensors.index.json``), optionally ``preprocessor_config.json``.
      lora: add fresh LoRA adapters (:func:`add_lora`).
      dtype: compute dtype (see :class:`CLIPModel`).
      param_dtype: dtype of the stored weights (any stored dtype is converted to it).
      rngs: draws the LoRA ``A`` factors; required with ``lora``.
      mesh: None (the default device), or a one-axis mesh (``sharding.model_mesh``) to split
        the weights over as they are read (``sharding.placer``, the rule of
        ``sharding.shard_model``): no device ever holds the whole model.
      min_bytes: with ``mesh``: weights smaller than this are replicated (None:
        ``sharding.MIN_BYTES``).

    Returns:
      ``Loaded(model, config, image_config)``; ``image_config`` is CLIP's default when the folder
      has no ``preprocessor_config.json``.

    Raises:
      MissingFileError: no folder, ``config.json``, weights or shard.
      InputError: a bad ``config.json`` (the field named) or ``preprocessor_config.json``; a
        shard path leaving the folder; a pickle-only folder; a missing, misshapen or unused
        tensor (named).
      InputTypeError: a dtype other than float32, bfloat16, float16; a ``mesh`` that is not a
        ``jax.sharding.Mesh`` (checked before any read).
    """
    d = pathlib.Path(folder)
    fn = f"clip.from_pretrained({str(d)!r})"
    llama_load.placement(fn, mesh, min_bytes)  # a bad mesh fails before the read
    cfg, tensors = clip_load.read_folder(d, fn)
    image_config = ImageProcessorConfig.from_pretrained(d)
    options = ModelOptions(lora, dtype, param_dtype, rngs)
    model = clip_load.build(
        fn, cfg, tensors, "the safetensors files", options, mesh=mesh, min_bytes=min_bytes
    )
    return Loaded(model, cfg, image_config)


# ----------------------------------------------------------------------------------- names

_NAME = re.compile(
    r"(vision_model|text_model)\.encoder\.layers\.(\d+)\."
    r"(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))"
)


def _check_name(fn: str, name: Any, sep: str) -> None:
    if not isinstance(name, str):
        raise InputTypeError(f"{fn}: module name {name!r} is not a string.")
    other = "/" if sep == "." else "."
    if other in name or not _NAME.fullmatch(name.replace(sep, ".")):
        raise InputError(
            f"{fn}: module name {name!r} is not a CLIP encoder layer's linear layer "
            f"('vision_model{sep}encoder{sep}layers{sep}N{sep}self_attn{sep}q_proj', ... "
            f"'{sep}mlp{sep}fc1')."
        )


def peft_names(adapter: Mapping[str, Any]) -> dict[str, Any]:
    """Rename an adapter from nnx layer paths to PEFT module names.

    ``"vision_model/encoder/layers/3/self_attn/q_proj"`` (``nu.nnx.extract_adapter``) becomes
    ``"vision_model.encoder.layers.3.self_attn.q_proj"``, the name in transformers'
    ``CLIPModel``, which ``nu.peft.save_adapter`` writes and ``PeftModel`` loads.

    Raises:
      InputError: a name that is not an encoder layer's linear layer.

    Example:
      >>> peft_names({"vision_model/encoder/layers/0/self_attn/q_proj": 1})
      {'vision_model.encoder.layers.0.self_attn.q_proj': 1}
    """
    return rename_modules("clip.peft_names", adapter, _check_name, "/")


def nnx_names(adapter: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`peft_names`: PEFT names (``nu.peft.load_adapter``) to nnx paths,
    for ``nu.nnx.apply_adapter(model, nnx_names(adapter))``. A leading ``base_model.model.`` is
    dropped; nnx paths pass through.

    Example:
      >>> nnx_names({"base_model.model.vision_model.encoder.layers.1.mlp.fc1": 1})
      {'vision_model/encoder/layers/1/mlp/fc1': 1}
    """
    out = {}
    for name, mod in adapter.items():
        name = name.removeprefix("base_model.model.") if isinstance(name, str) else name
        sep = "/" if isinstance(name, str) and "/" in name else "."
        _check_name("clip.nnx_names", name, sep)
        out[name.replace(".", "/")] = mod
    return out


# ------------------------------------------------------------------------------- adapters


def fold_adapter(model: CLIPModel, adapter: Mapping[str, Any], *, coef: float = 1.0) -> CLIPModel:
    """A new model whose base kernels are ``W + coef * dK`` for each module of ``adapter``.

    ``adapter`` maps PEFT names (as ``nu.peft.load_adapter`` returns them) or nnx paths to
    low-rank modules ``{lora_a (d_in, r), lora_b (r, d_out), scale}`` or dense ones
    ``{delta (d_in, d_out)}`` (e.g. the output of ``nu.merge``); ``None`` is no update. This
    evaluates an adapter or a merge of any rank on the base model, with or without LoRA layers
    (their own branches are kept). ``model`` is not changed; other arrays are shared.

    Raises:
      InputError: a name that is not an encoder linear layer; a module whose ``(d_in, d_out)``
        differs from its kernel; a non-finite update (see ``nu.fold``).

    Example:
      >>> import numpy as np
      >>> from flax import nnx
      >>> from netutility_jax.experiments.models import clip
      >>> cfg = clip.CLIPConfig(
      ...     clip.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_layers=1,
      ...                           num_heads=2, image_size=8, patch_size=4),
      ...     clip.CLIPTextConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
      ...                         num_layers=1, num_heads=2, max_position_embeddings=8,
      ...                         eos_token_id=49),
      ...     projection_dim=8)
      >>> model = clip.CLIPModel(cfg, rngs=nnx.Rngs(0))
      >>> up = {"vision_model.encoder.layers.0.self_attn.q_proj":
      ...       {"lora_a": np.ones((16, 1)), "lora_b": np.ones((1, 16)), "scale": 0.5}}
      >>> new = clip.fold_adapter(model, up)
      >>> q = lambda m: m.vision_model.encoder.layers[0].self_attn.q_proj.kernel[...]
      >>> bool(np.allclose(q(new) - q(model), 0.5))
      True
    """
    import netutility_jax as nu

    fn = "clip.fold_adapter"
    if not isinstance(model, CLIPModel):
        raise InputTypeError(f"{fn}: model is a {type(model).__name__}; expected a CLIPModel.")
    if not isinstance(adapter, Mapping):
        raise InputTypeError(
            f"{fn}: adapter is a {type(adapter).__name__}; expected a dict of modules."
        )
    mods = {k: v for k, v in nnx_names(adapter).items() if v is not None}
    paths = {name: [int(p) if p.isdigit() else p for p in name.split("/")] for name in mods}
    cfg = model.config
    for name, path in paths.items():
        n_layers = (cfg.vision_config if path[0] == "vision_model" else cfg.text_config).num_layers
        if path[3] >= n_layers:
            raise InputError(
                f"{fn}: module {name!r} names layer {path[3]} but the {path[0]} has {n_layers} "
                "layers; is the adapter for another CLIP?"
            )
    if not mods:
        return nnx.clone(model)
    params = {
        name: {"kernel": variable_at(model, [*p, "kernel"]).get_value()}
        for name, p in paths.items()
    }
    folded = nu.fold(params, mods, coef=coef)
    new = nnx.clone(model)  # new variables; the arrays are shared
    for name, p in paths.items():
        variable_at(new, [*p, "kernel"]).set_value(folded[name]["kernel"])
    return new


# ----------------------------------------------------------------------------- batched forward


@functools.partial(jax.jit, static_argnums=0)
def _image_features(graphdef: Any, state: Any, x: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state).get_image_features(x)


def image_features(
    model: CLIPModel, pixel_values: ArrayLike, *, batch_size: int = 256
) -> np.ndarray:
    """Image embeddings ``(N, P)`` of many images, in jitted batches of ``batch_size``.

    The last batch is padded to ``batch_size`` (one compilation for every ``N``); the result
    is ``model.get_image_features(pixel_values)``, gathered on the host as float32 numpy.

    Args:
      model: a :class:`CLIPModel`.
      pixel_values: ``(N, C, S, S)`` (:func:`preprocess`), numpy or on a device.
      batch_size: images per jitted call.

    Raises:
      InputError: ``batch_size`` not a positive int; see :meth:`CLIPModel.get_image_features`.
    """
    fn = "clip.image_features"
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"{fn}: batch_size={batch_size!r}; expected a positive int.")
    x = (
        pixel_values
        if isinstance(pixel_values, (np.ndarray, jax.Array))
        else np.asarray(pixel_values)
    )
    if x.ndim != 4 or x.shape[0] == 0:
        raise InputError(f"{fn}: pixel_values {tuple(x.shape)}; expected (N, C, S, S) with N >= 1.")
    graphdef, state = nnx.split(model)
    n, b = x.shape[0], min(batch_size, x.shape[0])
    out = []
    for i in range(0, n, b):
        chunk = x[i : i + b]
        k = chunk.shape[0]
        if k < b:
            pad = np.zeros((b - k, *chunk.shape[1:]), chunk.dtype)
            chunk = jnp.concatenate([jnp.asarray(chunk), jnp.asarray(pad)])
        out.append(np.asarray(_image_features(graphdef, state, jnp.asarray(chunk)))[:k])
    return np.concatenate(out)
