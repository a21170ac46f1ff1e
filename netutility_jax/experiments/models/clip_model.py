"""CLIP's network in Flax nnx: the two towers, the joint model and fresh LoRA adapters.

The modules mirror transformers' ``CLIPModel`` name for name (``vision_model``,
``text_model``, ``encoder.layers.{i}.self_attn.q_proj``, ``pre_layrnorm`` as spelled there...),
so a state path is a Hugging Face parameter name with ``/`` for ``.``. The configs they are built
from are :mod:`~netutility_jax.experiments.models.clip_config`'s (re-imported here, where
``clip`` and ``clip_load`` import them). :mod:`netutility_jax.experiments.models.clip` re-exports every public name here and documents the model
(loading, LoRA and PEFT names, dtypes); :mod:`~netutility_jax.experiments.models.clip_load` fills an
abstract model built here from a checkpoint.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from ...errors import InputError, InputTypeError
from .clip_config import ACTIVATIONS as ACTIVATIONS
from .clip_config import ALL_TARGETS as ALL_TARGETS
from .clip_config import LORA_TARGETS as LORA_TARGETS
from .clip_config import TOWERS as TOWERS
from .clip_config import CLIPConfig as CLIPConfig
from .clip_config import CLIPTextConfig as CLIPTextConfig
from .clip_config import CLIPVisionConfig as CLIPVisionConfig
from .clip_config import LoRAConfig as LoRAConfig
from .llama_model import init_model, linear, retyped, with_fresh_lora
from .minilm_model import abstract_of

__all__ = [  # (the config names re-imported above are clip_config's)
    "CLIPModel",
    "CLIPOutput",
    "EncoderLayer",
    "ModelOptions",
    "SelfAttention",
    "TextTransformer",
    "VisionTransformer",
    "abstract_model",
    "add_lora",
    "with_dtype",
]

_F32 = jnp.float32
_INIT = nnx.initializers.normal(0.02)  # transformers' initializer_range


# -------------------------------------------------------------------------------------- layers


class ModelOptions(NamedTuple):
    """What every part of a tower is built with.

    Attributes:
      lora: LoRA adapters of this tower, or None.
      dtype: compute dtype of the matrix products.
      param_dtype: dtype of the stored base weights.
      rngs: draws the weights.
    """

    lora: LoRAConfig | None
    dtype: Any
    param_dtype: Any
    rngs: nnx.Rngs


def _layer_norm(d: int, eps: float, o: ModelOptions) -> nnx.LayerNorm:
    # Float32 always; two-pass variance as torch computes it.
    return nnx.LayerNorm(
        d,
        epsilon=eps,
        dtype=_F32,
        param_dtype=o.param_dtype,
        use_fast_variance=False,
        rngs=o.rngs,
    )


def _embed(n: int, d: int, o: ModelOptions) -> nnx.Embed:
    return nnx.Embed(n, d, dtype=_F32, param_dtype=o.param_dtype, embedding_init=_INIT, rngs=o.rngs)


Tower = CLIPVisionConfig | CLIPTextConfig


class SelfAttention(nnx.Module):
    """Multi-head self-attention with biased ``q_proj, k_proj, v_proj, out_proj`` ``(D, D)``.

    ``softmax(q k^T / sqrt(d) + mask) v`` per head (Vaswani et al., 2017); ``keep`` masks keys.
    """

    def __init__(self, cfg: Tower, o: ModelOptions):
        d = cfg.hidden_size
        self.q_proj = linear(d, d, "q_proj", o)
        self.k_proj = linear(d, d, "k_proj", o)
        self.v_proj = linear(d, d, "v_proj", o)
        self.out_proj = linear(d, d, "out_proj", o)
        self.num_heads = cfg.num_heads
        self.dtype = o.dtype

    def __call__(self, x: jax.Array, keep: jax.Array | None) -> jax.Array:
        """``(B, T, D)`` float32 -> ``(B, T, D)`` float32; ``keep`` ``(B, 1, T, T)`` or None."""
        b, t, d = x.shape
        h, dt = self.num_heads, self.dtype
        x = x.astype(dt)
        # The 1/sqrt(d) goes on q: (B, T, D) elements instead of (B, H, T, T).
        q = (self.q_proj(x).astype(_F32) * (d // h) ** -0.5).astype(dt).reshape(b, t, h, d // h)
        k = self.k_proj(x).reshape(b, t, h, d // h)
        v = self.v_proj(x).reshape(b, t, h, d // h)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=_F32)
        if keep is not None:
            s = jnp.where(keep, s, jnp.finfo(_F32).min)
        p = jax.nn.softmax(s, axis=-1).astype(dt)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=_F32)
        return self.out_proj(o.reshape(b, t, d).astype(dt)).astype(_F32)


class MLP(nnx.Module):
    """``fc2(act(fc1(x)))`` with the config's ``hidden_act``."""

    def __init__(self, cfg: Tower, o: ModelOptions):
        self.fc1 = linear(cfg.hidden_size, cfg.intermediate_size, "fc1", o)
        self.fc2 = linear(cfg.intermediate_size, cfg.hidden_size, "fc2", o)
        self.hidden_act = cfg.hidden_act
        self.dtype = o.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = ACTIVATIONS[self.hidden_act](self.fc1(x.astype(self.dtype)).astype(_F32))
        return self.fc2(y.astype(self.dtype)).astype(_F32)


class EncoderLayer(nnx.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))`` (pre-LN; transformers' CLIPEncoderLayer)."""

    def __init__(self, cfg: Tower, o: ModelOptions):
        self.self_attn = SelfAttention(cfg, o)
        self.layer_norm1 = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, o)
        self.mlp = MLP(cfg, o)
        self.layer_norm2 = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, o)

    def __call__(self, x: jax.Array, keep: jax.Array | None) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x), keep)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nnx.Module):
    """The stack of :class:`EncoderLayer` (``encoder.layers.{i}``)."""

    def __init__(self, cfg: Tower, o: ModelOptions):
        self.layers = nnx.List([EncoderLayer(cfg, o) for _ in range(cfg.num_layers)])

    def __call__(self, x: jax.Array, keep: jax.Array | None) -> jax.Array:
        for layer in self.layers:
            x = layer(x, keep)
        return x


class VisionEmbeddings(nnx.Module):
    """Class token + patch embedding (a ``p x p`` stride-``p`` convolution, no bias) + positions."""

    def __init__(self, cfg: CLIPVisionConfig, o: ModelOptions):
        d, p = cfg.hidden_size, cfg.patch_size
        self.class_embedding = nnx.Param(_INIT(o.rngs.params(), (d,), o.param_dtype))
        self.patch_embedding = nnx.Conv(
            cfg.num_channels,
            d,
            (p, p),
            (p, p),
            padding="VALID",
            use_bias=False,
            dtype=o.dtype,
            param_dtype=o.param_dtype,
            kernel_init=_INIT,
            rngs=o.rngs,
        )
        self.position_embedding = _embed(cfg.num_positions, d, o)
        self.dtype = o.dtype

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """``(B, C, S, S)`` -> ``(B, 1 + (S // p)^2, D)`` float32 (patches in row-major order)."""
        b = pixel_values.shape[0]
        x = self.patch_embedding(jnp.transpose(pixel_values, (0, 2, 3, 1)).astype(self.dtype))
        x = x.reshape(b, -1, x.shape[-1]).astype(_F32)
        cls = jnp.broadcast_to(self.class_embedding[...].astype(_F32), (b, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1)
        return x + self.position_embedding.embedding[...].astype(_F32)[None]


class VisionTransformer(nnx.Module):
    """The vision tower (transformers' ``CLIPVisionModel.vision_model``): embeddings,
    ``pre_layrnorm``, the encoder, ``post_layernorm`` of the class token."""

    def __init__(self, cfg: CLIPVisionConfig, o: ModelOptions):
        self.embeddings = VisionEmbeddings(cfg, o)
        self.pre_layrnorm = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, o)
        self.encoder = Encoder(cfg, o)
        self.post_layernorm = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, o)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """The pooled output ``(B, D_v)`` float32: the normed class token."""
        x = self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)), None)
        return self.post_layernorm(x[:, 0])


class TextEmbeddings(nnx.Module):
    """Token + absolute position embeddings."""

    def __init__(self, cfg: CLIPTextConfig, o: ModelOptions):
        self.token_embedding = _embed(cfg.vocab_size, cfg.hidden_size, o)
        self.position_embedding = _embed(cfg.max_position_embeddings, cfg.hidden_size, o)

    def __call__(self, ids: jax.Array) -> jax.Array:
        t = ids.shape[1]
        pos = self.position_embedding.embedding[...][:t].astype(_F32)
        return self.token_embedding(ids).astype(_F32) + pos[None]


class TextTransformer(nnx.Module):
    """The text tower (transformers' ``CLIPTextModel.text_model``): embeddings, the causal
    encoder, ``final_layer_norm`` and end-of-text pooling."""

    def __init__(self, cfg: CLIPTextConfig, o: ModelOptions):
        self.embeddings = TextEmbeddings(cfg, o)
        self.encoder = Encoder(cfg, o)
        self.final_layer_norm = _layer_norm(cfg.hidden_size, cfg.layer_norm_eps, o)
        self.config = cfg

    def __call__(self, ids: jax.Array, mask: jax.Array | None) -> jax.Array:
        """The pooled output ``(B, D_t)`` float32 (the final-normed state at the end-of-text
        position, :attr:`CLIPTextConfig.eos_token_id`)."""
        t = ids.shape[1]
        keep = jnp.tril(jnp.ones((t, t), bool))[None, None]  # (1, 1, Tq, Tk)
        if mask is not None:
            keep = keep & (mask != 0)[:, None, None, :]
        x = self.final_layer_norm(self.encoder(self.embeddings(ids), keep))
        if self.config.legacy_eos:
            at = jnp.argmax(ids, axis=-1)
        else:
            at = jnp.argmax(ids == self.config.eos_token_id, axis=-1)
        return jnp.take_along_axis(x, at[:, None, None], axis=1)[:, 0]


class CLIPOutput(NamedTuple):
    """What :class:`CLIPModel` returns (transformers' ``CLIPOutput`` without the loss).

    Attributes:
      logits_per_image: ``(B_i, B_t)``: ``exp(logit_scale)`` times the cosine similarities.
      logits_per_text: ``(B_t, B_i)``, its transpose.
      image_embeds: ``(B_i, P)``, unit rows.
      text_embeds: ``(B_t, P)``, unit rows.
    """

    logits_per_image: jax.Array
    logits_per_text: jax.Array
    image_embeds: jax.Array
    text_embeds: jax.Array


class CLIPModel(nnx.Module):
    """CLIP (Radford et al., 2021): both towers, their projections and the logit scale.

    Weights are random (normal 0.02, norms 1) unless loaded with :func:`clip.from_pretrained`.

    Args:
      config: shapes and settings.
      lora: LoRA adapters on the targeted layers of the chosen towers, or None.
      dtype: compute dtype of the matrix products (``jnp.float32`` or ``jnp.bfloat16``);
        LayerNorms, softmax, the residual stream, the embeddings and the logits stay float32.
      param_dtype: dtype of the stored base weights; LoRA factors are always float32.
      rngs: draws the weights.

    State paths are the Hugging Face names with ``/``: ``vision_model/embeddings/
    {class_embedding, patch_embedding/kernel (p, p, C, D_v), position_embedding/embedding}``,
    ``vision_model/{pre_layrnorm,post_layernorm}/{scale,bias}``,
    ``{vision,text}_model/encoder/layers/{i}/self_attn/{q,k,v,out}_proj/{kernel,bias[,lora/...]}``,
    ``.../layers/{i}/{layer_norm1,layer_norm2}``, ``.../layers/{i}/mlp/{fc1,fc2}``,
    ``text_model/embeddings/{token,position}_embedding/embedding``,
    ``text_model/final_layer_norm``, ``visual_projection/kernel`` ``(D_v, P)``,
    ``text_projection/kernel`` ``(D_t, P)`` and ``logit_scale`` ``()``.

    Example:
      >>> import jax.numpy as jnp
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
      >>> out = nnx.jit(model)(jnp.array([[3, 7, 49, 0]]), jnp.zeros((2, 3, 8, 8)))
      >>> out.logits_per_image.shape, out.image_embeds.shape
      ((2, 1), (2, 8))
    """

    def __init__(
        self,
        config: CLIPConfig,
        *,
        lora: LoRAConfig | None = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        dtype, param_dtype = init_model(
            self, ("CLIPModel", "clip"), config, lora, dtype, param_dtype, (CLIPConfig, LoRAConfig)
        )

        def options(tower: str) -> ModelOptions:
            on = lora is not None and tower in lora.towers
            return ModelOptions(lora if on else None, dtype, param_dtype, rngs)

        vc, tc, p = config.vision_config, config.text_config, config.projection_dim
        self.text_model = TextTransformer(tc, options("text"))
        self.vision_model = VisionTransformer(vc, options("vision"))
        plain = ModelOptions(None, dtype, param_dtype, rngs)
        self.visual_projection = linear(vc.hidden_size, p, "visual_projection", plain, bias=False)
        self.text_projection = linear(tc.hidden_size, p, "text_projection", plain, bias=False)
        self.logit_scale = nnx.Param(jnp.asarray(2.6592, param_dtype))

    def get_image_features(self, pixel_values: ArrayLike) -> jax.Array:
        """Image embeddings ``(B, P)`` float32 (projected, not normalized), as transformers'
        ``CLIPModel.get_image_features`` (its ``pooler_output`` in transformers 5).

        Args:
          pixel_values: ``(B, C, S, S)`` floats, channels first (:func:`clip.preprocess`).

        Raises:
          InputError: another shape than ``(B, num_channels, image_size, image_size)``.
        """
        x = jnp.asarray(pixel_values)
        vc = self.config.vision_config
        want = (vc.num_channels, vc.image_size, vc.image_size)
        if x.ndim != 4 or tuple(x.shape[1:]) != want:
            raise InputError(
                f"CLIPModel.get_image_features: pixel_values {tuple(x.shape)}; expected "
                f"(B, {', '.join(map(str, want))}) floats, channels first (clip.preprocess gives "
                "them)."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise InputTypeError(
                f"CLIPModel.get_image_features: pixel_values have dtype {x.dtype}; expected "
                "normalized floats (clip.preprocess), not raw pixels."
            )
        pooled = self.vision_model(x)
        return self.visual_projection(pooled.astype(self.dtype)).astype(_F32)

    def get_text_features(
        self, input_ids: ArrayLike, attention_mask: ArrayLike | None = None
    ) -> jax.Array:
        """Text embeddings ``(B, P)`` float32 (projected, not normalized), as transformers'
        ``CLIPModel.get_text_features``.

        Args:
          input_ids: ``(B, T)`` token ids, ``T <= max_position_embeddings``, each row holding
            its end-of-text token (see :attr:`CLIPTextConfig.eos_token_id`).
          attention_mask: ``(B, T)``, 1 for real tokens and 0 for padding; None: no padding.

        Raises:
          InputError: shapes other than ``(B, T)``, ``T`` beyond the model's positions.
          InputTypeError: non-integer ids.
        """
        fn = "CLIPModel.get_text_features"
        ids = jnp.asarray(input_ids)
        mask = None if attention_mask is None else jnp.asarray(attention_mask)
        if ids.ndim != 2 or (mask is not None and mask.shape != ids.shape):
            raise InputError(
                f"{fn}: input_ids {tuple(ids.shape)} and attention_mask "
                f"{None if mask is None else tuple(mask.shape)} must both be (B, T)."
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise InputTypeError(f"{fn}: input_ids have dtype {ids.dtype}; expected integers.")
        t_max = self.config.text_config.max_position_embeddings
        if ids.shape[1] > t_max:
            raise InputError(
                f"{fn}: sequence length {ids.shape[1]} exceeds the model's {t_max} positions; "
                f"tokenize with max_length={t_max}."
            )
        pooled = self.text_model(ids, mask)
        return self.text_projection(pooled.astype(self.dtype)).astype(_F32)

    def __call__(
        self,
        input_ids: ArrayLike,
        pixel_values: ArrayLike,
        attention_mask: ArrayLike | None = None,
    ) -> CLIPOutput:
        """Image-text logits: ``exp(logit_scale) * cos(image_i, text_j)`` (transformers'
        ``CLIPModel.forward`` without the loss).

        Args:
          input_ids: ``(B_t, T)`` token ids.
          pixel_values: ``(B_i, C, S, S)``.
          attention_mask: ``(B_t, T)`` or None.

        Returns:
          :class:`CLIPOutput`.
        """
        img = _unit(self.get_image_features(pixel_values))
        txt = _unit(self.get_text_features(input_ids, attention_mask))
        scale = jnp.exp(self.logit_scale[...].astype(_F32))
        per_text = jnp.einsum("tp,ip->ti", txt, img) * scale
        return CLIPOutput(per_text.T, per_text, img, txt)


def _unit(x: jax.Array) -> jax.Array:
    # transformers' _get_vector_norm: sqrt(sum(x^2)), no epsilon.
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))


# ------------------------------------------------------------------------- operations


def abstract_model(
    cfg: CLIPConfig, lora: LoRAConfig | None, dtype: Any, param_dtype: Any
) -> CLIPModel:
    """A :class:`CLIPModel` of this structure whose arrays are ``jax.ShapeDtypeStruct``
    placeholders (no random draws for weights that are overwritten anyway)."""
    return abstract_of(CLIPModel, cfg, lora=lora, dtype=dtype, param_dtype=param_dtype)


def add_lora(model: CLIPModel, lora: LoRAConfig, *, rngs: nnx.Rngs) -> CLIPModel:
    """A new model with the base weights of ``model`` and fresh LoRA adapters.

    ``A`` ``(d_in, r)`` He-uniform from ``rngs.params()`` (one draw per module, in state-path
    order), ``B`` ``(r, d_out)`` zero: the new model computes what ``model`` does. Base arrays
    are shared, not copied; ``model`` is not changed (its own adapters, if any, are dropped).

    Args:
      model: a :class:`CLIPModel`.
      lora: rank, alpha, targets and towers.
      rngs: draws the ``A`` factors.
    """
    return with_fresh_lora(
        ("clip.add_lora", "clip.LoRAConfig"), model, lora, rngs, LoRAConfig, abstract_model
    )


def with_dtype(model: CLIPModel, dtype: Any) -> CLIPModel:
    """The same model (weights and adapters shared, not copied) computing in another dtype,
    e.g. ``clip.with_dtype(model, jnp.bfloat16)``."""
    return retyped("clip.with_dtype", model, dtype, abstract_model)
