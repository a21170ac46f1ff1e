"""The Llama-family decoder's network in Flax nnx: RoPE, the attention, MLP and layer modules, the
causal LM and its operations (dtype, last-token scoring, fresh LoRA adapters).

:mod:`netutility_jax.experiments.models.llama` re-exports every public name here and documents the
model (state paths, LoRA layout, padding, dtypes); its loaders fill an abstract model built here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from ...errors import InputError, InputTypeError
from .llama_config import LlamaConfig, LoRAConfig
from .minilm_model import LORA_A_INIT, LORA_B_INIT, LoRALinear, abstract_of

__all__ = [
    "BASE_WEIGHTS",
    "MLP",
    "Attention",
    "Decoder",
    "DecoderLayer",
    "Llama",
    "ModelOptions",
    "abstract_model",
    "add_lora",
    "apply_rope",
    "check_dtype",
    "check_filled",
    "init_model",
    "last_token_index",
    "last_token_logits",
    "linear",
    "rename_modules",
    "retyped",
    "rope_frequencies",
    "variable_at",
    "with_dtype",
    "with_fresh_lora",
]

_DTYPES = {np.dtype(d).name: np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16)}
_INIT = nnx.initializers.normal(0.02)  # transformers' initializer_range
_F32 = jnp.float32
BASE_WEIGHTS = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
"""The base weights of a model: every ``nnx.Param`` but the LoRA factors."""


class ModelOptions(NamedTuple):
    """What every part of the decoder is built with: :class:`Llama`'s keywords.

    Attributes:
      lora: LoRA adapters on the targeted projections, or None.
      dtype: compute dtype of the matrix products.
      param_dtype: dtype of the stored base weights.
      rngs: draws the weights (None only where nothing is drawn: the loaders without ``lora``).
    """

    lora: LoRAConfig | None
    dtype: Any
    param_dtype: Any
    rngs: nnx.Rngs | None


# --------------------------------------------------------------------------------------- RoPE


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """RoPE inverse frequencies ``(d/2,)`` float32 (Su et al. 2021), with linear/llama3 scaling.

    ``f_i = theta^(-2i/d)``; ``"linear"`` divides by ``factor``; ``"llama3"`` divides the
    low frequencies (wavelength above ``original / low_freq_factor``) by ``factor``, keeps the
    high ones (below ``original / high_freq_factor``) and interpolates in between, as
    transformers' ``_compute_llama3_parameters``. Computed in float64.
    """
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if config.rope_type == "linear":
        inv = inv / config.rope_factor
    elif config.rope_type == "llama3":
        f, old = config.rope_factor, config.rope_original_max_position
        lo, hi = config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout): pairs are ``(x_i, x_{i + d/2})``.

    ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``, the same as transformers'
    ``x * cos + rotate_half(x) * sin`` with ``cos``/``sin`` repeated over both halves.

    Args:
      x: ``(B, T, N, d)``.
      cos, sin: ``(B, T, d/2)`` of the angles ``position * f_i``.

    Returns:
      ``(B, T, N, d)``, the dtype of the inputs.
    """
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


# -------------------------------------------------------------------------------------- model


def linear(d_in: int, d_out: int, name: str, o: Any, *, bias: bool = True) -> nnx.Linear:
    """A linear layer of a model built with the options ``o`` (a ``ModelOptions``: the decoder's or
    a CLIP tower's): a :class:`LoRALinear` when ``name`` is among ``o.lora.targets``."""
    kw = dict(
        use_bias=bias, dtype=o.dtype, param_dtype=o.param_dtype, kernel_init=_INIT, rngs=o.rngs
    )
    if o.lora is not None and name in o.lora.targets:
        return LoRALinear(
            d_in, d_out, lora_rank=o.lora.rank, lora_scale=o.lora.scale, lora_dtype=o.dtype, **kw
        )
    return nnx.Linear(d_in, d_out, **kw)


def _rms_norm(n: int, cfg: LlamaConfig, o: ModelOptions) -> nnx.RMSNorm:
    # Always float32 (transformers' LlamaRMSNorm upcasts too).
    return nnx.RMSNorm(
        n, epsilon=cfg.rms_norm_eps, dtype=_F32, param_dtype=o.param_dtype, rngs=o.rngs
    )


class _Part(nnx.Module):
    """A part of the decoder: the parts share this constructor and build their layers in
    ``_build``."""

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        lora: LoRAConfig | None,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ):
        self._build(cfg, ModelOptions(lora, dtype, param_dtype, rngs))

    def _build(self, cfg: LlamaConfig, o: ModelOptions) -> None:
        raise NotImplementedError


class Attention(_Part):
    """Grouped-query causal self-attention with RoPE (and Qwen3's q/k norm).

    State: ``q_proj``, ``k_proj``, ``v_proj`` ``(D, H d | K d)``, ``o_proj`` ``(H d, D)``
    (``nnx.Linear`` or LoRA layers), ``q_norm``/``k_norm`` ``(d,)`` when ``config.qk_norm``.
    """

    def _build(self, cfg: LlamaConfig, o: ModelOptions) -> None:
        d, dh, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = linear(d, cfg.num_heads * dh, "q_proj", o, bias=bias)
        self.k_proj = linear(d, cfg.num_kv_heads * dh, "k_proj", o, bias=bias)
        self.v_proj = linear(d, cfg.num_kv_heads * dh, "v_proj", o, bias=bias)
        self.o_proj = linear(cfg.num_heads * dh, d, "o_proj", o, bias=bias)
        if cfg.qk_norm:
            self.q_norm = _rms_norm(dh, cfg, o)
            self.k_norm = _rms_norm(dh, cfg, o)
        else:
            self.q_norm = self.k_norm = None
        self.config = cfg
        self.dtype = o.dtype

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, keep: jax.Array) -> jax.Array:
        """``(B, T, D)`` float32 -> ``(B, T, D)`` float32; ``keep`` ``(B, 1, 1, T, T)``."""
        cfg, dt = self.config, self.dtype
        b, t, _ = x.shape
        h, kv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = self.q_proj(x).reshape(b, t, h, dh).astype(_F32)
        k = self.k_proj(x).reshape(b, t, kv, dh).astype(_F32)
        v = self.v_proj(x).reshape(b, t, kv, dh).astype(dt)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # The 1/sqrt(d) goes on q: (B, T, H, d) elements instead of (B, H, T, T).
        q = (apply_rope(q, cos, sin) * (1.0 / math.sqrt(dh))).astype(dt)
        k = apply_rope(k, cos, sin).astype(dt)
        # Query head j*G + g uses key/value head j (transformers' repeat_kv order).
        q = q.reshape(b, t, kv, h // kv, dh)
        s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=_F32)
        s = jnp.where(keep, s, jnp.finfo(_F32).min)
        p = jax.nn.softmax(s, axis=-1).astype(dt)
        o = jnp.einsum("bkgqs,bskd->bqkgd", p, v, preferred_element_type=_F32)
        return self.o_proj(o.reshape(b, t, h * dh).astype(dt)).astype(_F32)


class MLP(_Part):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    def _build(self, cfg: LlamaConfig, o: ModelOptions) -> None:
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = linear(d, f, "gate_proj", o, bias=bias)
        self.up_proj = linear(d, f, "up_proj", o, bias=bias)
        self.down_proj = linear(f, d, "down_proj", o, bias=bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(y).astype(_F32)


class DecoderLayer(_Part):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (pre-norm)."""

    def _build(self, cfg: LlamaConfig, o: ModelOptions) -> None:
        self.input_layernorm = _rms_norm(cfg.hidden_size, cfg, o)
        self.self_attn = Attention(cfg, **o._asdict())
        self.post_attention_layernorm = _rms_norm(cfg.hidden_size, cfg, o)
        self.mlp = MLP(cfg, **o._asdict())

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, keep: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(_Part):
    """Embedding, the layers and the final norm (transformers' ``LlamaModel``, the ``model.``
    prefix of the parameter names)."""

    def _build(self, cfg: LlamaConfig, o: ModelOptions) -> None:
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=_F32,
            param_dtype=o.param_dtype,
            embedding_init=_INIT,
            rngs=o.rngs,
        )
        self.layers = nnx.List([DecoderLayer(cfg, **o._asdict()) for _ in range(cfg.num_layers)])
        self.norm = _rms_norm(cfg.hidden_size, cfg, o)
        self.config = cfg

    def __call__(self, ids: jax.Array, mask: jax.Array | None) -> jax.Array:
        """Final-normed hidden states ``(B, T, D)`` float32."""
        b, t = ids.shape
        if mask is None:
            real = jnp.ones((b, t), bool)
            pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        else:
            real = mask != 0
            pos = jnp.maximum(jnp.cumsum(real.astype(jnp.int32), axis=1) - 1, 0)
        angle = pos[..., None].astype(_F32) * jnp.asarray(rope_frequencies(self.config))
        cos, sin = jnp.cos(angle), jnp.sin(angle)
        causal = jnp.tril(jnp.ones((t, t), bool))
        keep = (causal[None] & real[:, None, :])[:, None, None]  # (B, 1, 1, Tq, Tk)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, keep)
        return self.norm(x)


class Llama(nnx.Module):
    """The causal LM (transformers' ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``).

    Weights are random (normal 0.02, norms 1) unless loaded with :func:`from_gguf` or
    :func:`from_pretrained`.

    Args:
      config: shapes and settings.
      lora: LoRA adapters on the targeted projections of every layer, or None.
      dtype: compute dtype of the matrix products (``jnp.float32`` or ``jnp.bfloat16``);
        norms, RoPE, softmax, the residual stream and the logits stay float32.
      param_dtype: dtype of the stored base weights (bfloat16 halves the memory of big models);
        LoRA factors are always float32.
      rngs: draws the weights.

    State paths (see the module docstring): ``model/embed_tokens/embedding`` ``(V, D)``,
    ``model/layers/{i}/{input_layernorm,post_attention_layernorm}/scale``,
    ``model/layers/{i}/self_attn/{q,k,v,o}_proj/{kernel[,bias][,lora/{lora_a,lora_b}]}``,
    ``model/layers/{i}/self_attn/{q,k}_norm/scale`` (Qwen3),
    ``model/layers/{i}/mlp/{gate,up,down}_proj/kernel``, ``model/norm/scale`` and, untied,
    ``lm_head/kernel`` ``(D, V)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from netutility_jax.experiments.models import llama
      >>> cfg = llama.LlamaConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=4,
      ...                         num_kv_heads=2, intermediate_size=32)
      >>> model = llama.Llama(cfg, rngs=nnx.Rngs(0))
      >>> ids = jnp.array([[3, 7, 9, 0], [5, 2, 0, 0]])
      >>> mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
      >>> nnx.jit(model)(ids, mask).shape
      (2, 4, 50)
      >>> left = jnp.array([[0, 3, 7, 9], [0, 0, 5, 2]])  # the same rows padded on the left
      >>> score = nnx.jit(llama.last_token_logits)
      >>> bool(jnp.allclose(score(model, ids, mask), score(model, left, mask[:, ::-1]), atol=1e-5))
      True
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        lora: LoRAConfig | None = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        dtype, param_dtype = init_model(
            self, ("Llama", "llama"), config, lora, dtype, param_dtype, (LlamaConfig, LoRAConfig)
        )
        self.model = Decoder(config, lora=lora, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Linear(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=_INIT,
                rngs=rngs,
            )

    def hidden_states(self, ids: ArrayLike, mask: ArrayLike | None = None) -> jax.Array:
        """Final-normed hidden states ``(B, T, D)`` float32 (the LM head's input).

        Args:
          ids: ``(B, T)`` integer token ids.
          mask: ``(B, T)``, 1 for real tokens, 0 for padding (left or right); None: no padding.
        """
        ids = jnp.asarray(ids)
        mask = None if mask is None else jnp.asarray(mask)
        _check_batch("Llama", ids, mask)
        return self.model(ids, mask)

    def head(self, hidden: ArrayLike, token_ids: ArrayLike | None = None) -> jax.Array:
        """Logits of hidden states ``(..., D)``: ``(..., V)``, or ``(..., K)`` for ``token_ids``.

        With ``token_ids`` ``(K,)`` only those rows of the head are used (label scoring without
        the ``V``-wide product). Float32 out; the product runs in the compute dtype.
        """
        h = jnp.asarray(hidden).astype(self.dtype)
        if self.lm_head is None:
            w = self.model.embed_tokens.embedding[...]  # (V, D)
            if token_ids is not None:
                w = w[jnp.asarray(token_ids)]
            return jnp.einsum("...d,vd->...v", h, w.astype(self.dtype), preferred_element_type=_F32)
        k = self.lm_head.kernel[...]  # (D, V)
        if token_ids is not None:
            k = k[:, jnp.asarray(token_ids)]
        return jnp.einsum("...d,dv->...v", h, k.astype(self.dtype), preferred_element_type=_F32)

    def __call__(self, ids: ArrayLike, mask: ArrayLike | None = None) -> jax.Array:
        """Next-token logits ``(B, T, V)`` float32 at every position.

        Positions where ``mask`` is 0 are ignored as keys; their own logits are meaningless.
        """
        return self.head(self.hidden_states(ids, mask))


def check_dtype(fn: str, name: str, dtype: Any) -> np.dtype:
    """``dtype`` as a numpy dtype among float32, bfloat16 and float16, or ``InputTypeError``."""
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d is None or d.name not in _DTYPES:
        raise InputTypeError(
            f"{fn}: {name}={dtype!r}; expected one of {sorted(_DTYPES)} (e.g. jnp.bfloat16)."
        )
    return _DTYPES[d.name]


def init_model(
    model: nnx.Module,
    names: tuple[str, str],
    config: Any,
    lora: Any,
    dtype: Any,
    param_dtype: Any,
    types: tuple[type, type],
) -> tuple[np.dtype, np.dtype]:
    """A model constructor's checks and settings (``Llama``'s, ``CLIPModel``'s): ``config`` and
    ``lora`` (or None) of the model's classes ``types``, the two dtypes (:func:`check_dtype`);
    stores the four on ``model`` and returns the checked dtypes.

    Args:
      names: the model's class and its public module, for messages (``("Llama", "llama")``).

    Raises:
      InputTypeError: a wrong config, lora or dtype.
    """
    (fn, module), (config_type, lora_type) = names, types
    if not isinstance(config, config_type):
        raise InputTypeError(
            f"{fn}: config is a {type(config).__name__}; expected a "
            f"{module}.{config_type.__name__}."
        )
    if lora is not None and not isinstance(lora, lora_type):
        raise InputTypeError(
            f"{fn}: lora is a {type(lora).__name__}; expected a {module}.{lora_type.__name__} "
            "or None."
        )
    dtype, param_dtype = (
        check_dtype(fn, "dtype", dtype),
        check_dtype(fn, "param_dtype", param_dtype),
    )
    model.config = config
    model.lora = lora
    model.dtype = dtype
    model.param_dtype = param_dtype
    return dtype, param_dtype


def _check_batch(fn: str, ids: jax.Array, mask: jax.Array | None) -> None:
    if ids.ndim != 2 or (mask is not None and mask.shape != ids.shape):
        raise InputError(
            f"{fn}: ids {tuple(ids.shape)} and mask "
            f"{None if mask is None else tuple(mask.shape)} must both be (B, T); the tokenizer "
            "returns them so."
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise InputTypeError(f"{fn}: ids have dtype {ids.dtype}; expected integer token ids.")


def with_dtype(model: Llama, dtype: Any) -> Llama:
    """The same model (weights and adapters shared, not copied) computing in another dtype.

    E.g. ``llama.with_dtype(model, jnp.bfloat16)`` to time or check bfloat16 matrix products
    against the float32 model without reloading.
    """
    return retyped("llama.with_dtype", model, dtype, abstract_model)


def retyped(fn: str, model: Any, dtype: Any, abstract: Callable[..., Any]) -> Any:
    """The ``with_dtype`` of each model: ``model`` (weights and adapters shared, not copied)
    computing in ``dtype``, its structure rebuilt by ``abstract`` (the model's
    ``abstract_model``)."""
    dtype = check_dtype(fn, "dtype", dtype)
    new = abstract(model.config, model.lora, dtype, model.param_dtype)
    return nnx.merge(nnx.split(new)[0], nnx.state(model))


def last_token_index(mask: ArrayLike) -> jax.Array:
    """Index ``(B,)`` of the last real token of each row (``T - 1`` for a row without any).

    Works for left and right padding: ``T - 1 - argmax(reversed mask != 0)``.
    """
    m = jnp.asarray(mask) != 0
    t = m.shape[-1]
    return (t - 1 - jnp.argmax(m[..., ::-1], axis=-1)).astype(jnp.int32)


def last_token_logits(
    model: Llama, ids: ArrayLike, mask: ArrayLike, *, token_ids: ArrayLike | None = None
) -> jax.Array:
    """Next-token logits after the last real token of each row (prompt scoring).

    Only the last positions go through the head: ``(B, V)``, or ``(B, K)`` with ``token_ids``
    (e.g. :meth:`Tokenizer.label_token_ids`, the paper's scoring restricted to the label words'
    first tokens). Not jitted; e.g. ``nnx.jit(llama.last_token_logits)``.

    Args:
      model: a :class:`Llama`.
      ids: ``(B, T)`` token ids.
      mask: ``(B, T)``, 1 for real tokens (left or right padding).
      token_ids: ``(K,)`` vocabulary ids to score, or None for all ``V``.

    Returns:
      ``(B, V)`` or ``(B, K)`` float32.
    """
    h = model.hidden_states(ids, mask)
    idx = last_token_index(mask)
    last = jnp.take_along_axis(h, idx[:, None, None], axis=1)[:, 0]
    return model.head(last, token_ids)


# ------------------------------------------------------------------ LoRA and state paths


def add_lora(model: Llama, lora: LoRAConfig, *, rngs: nnx.Rngs) -> Llama:
    """A new model with the base weights of ``model`` and fresh LoRA adapters.

    ``A`` ``(d_in, r)`` He-uniform from ``rngs.params()`` (one draw per module, in layer order),
    ``B`` ``(r, d_out)`` zero: the new model computes what ``model`` does. Base arrays are
    shared, not copied; ``model`` is not changed (its own adapters, if any, are dropped).

    Args:
      model: a :class:`Llama`.
      lora: rank, alpha and targets.
      rngs: draws the ``A`` factors.
    """
    return with_fresh_lora(
        ("llama.add_lora", "LoRAConfig"), model, lora, rngs, LoRAConfig, abstract_model
    )


def with_fresh_lora(
    names: tuple[str, str],
    model: Any,
    lora: Any,
    rngs: nnx.Rngs,
    lora_type: type,
    abstract: Callable[..., Any],
) -> Any:
    """The ``add_lora`` of each model: a new model of ``model``'s structure with ``lora``
    (built by ``abstract``, the model's ``abstract_model``), the base weights of ``model``
    (shared) and fresh adapters: ``A`` He-uniform from ``rngs.params()``, one draw per module in
    order, ``B`` zero.

    Args:
      names: the public call and the name of ``lora_type`` in its messages
        (``("llama.add_lora", "LoRAConfig")``).

    Raises:
      InputTypeError: ``lora`` is not a ``lora_type``.
    """
    fn, expected = names
    if not isinstance(lora, lora_type):
        raise InputTypeError(f"{fn}: lora is a {type(lora).__name__}; expected {expected}.")
    new = abstract(model.config, lora, model.dtype, model.param_dtype)
    for p, var in nnx.to_flat_state(nnx.state(model, BASE_WEIGHTS)):
        variable_at(new, p).set_value(var.get_value())
    for _, m in nnx.iter_modules(new):
        if isinstance(m, LoRALinear):
            a, b = m.lora.lora_a, m.lora.lora_b
            a.set_value(LORA_A_INIT(rngs.params(), a.get_value().shape, jnp.float32))
            b.set_value(LORA_B_INIT(rngs.params(), b.get_value().shape, jnp.float32))
    check_filled(fn, new)
    return new


def variable_at(model: nnx.Module, path: Sequence[Any]) -> nnx.Variable:
    """The variable of ``model`` at a state path (as ``nnx.to_flat_state`` gives it)."""
    node: Any = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def rename_modules(
    fn: str, adapter: Mapping[str, Any], check: Callable[[str, Any, str], None], sep: str
) -> dict[str, Any]:
    """``adapter`` with each module name checked (``check(fn, name, sep)``, the model's) and its
    separator ``sep`` turned into the other one: nnx paths (``/``) to PEFT names (``.``) or back.
    """
    other = "." if sep == "/" else "/"
    out = {}
    for name, mod in adapter.items():
        check(fn, name, sep)
        out[name.replace(sep, other)] = mod
    return out


def abstract_model(
    cfg: LlamaConfig, lora: LoRAConfig | None, dtype: Any, param_dtype: Any
) -> Llama:
    """A :class:`Llama` of this structure whose arrays are ``jax.ShapeDtypeStruct`` placeholders.

    Structure only: no random draws for weights that are overwritten anyway.
    """
    return abstract_of(Llama, cfg, lora=lora, dtype=dtype, param_dtype=param_dtype)


def check_filled(fn: str, model: nnx.Module) -> None:
    """Fail if a variable of an :func:`abstract_model` was left a placeholder (a bug here)."""
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if isinstance(var.get_value(), jax.ShapeDtypeStruct):
            raise RuntimeError(f"{fn}: {'/'.join(map(str, path))} was never set (internal error).")
