"""The vision suite's zero-shot heads (:mod:`vision`): CLIP's tokenizer and its text tower.

CLIP's zero-shot classifier from the base text tower, as KnOTS' ``generate_clip_heads.py`` builds
it (:func:`zero_shot_heads`): per class, the text embeddings of its prompts (one per template of
:mod:`vision_data`) are L2-normalized, averaged, normalized again and multiplied by
``exp(logit_scale)``. Prompts are tokenized with the model folder's ``tokenizer.json`` (the
``tokenizers`` library; no vocabulary is downloaded: :func:`load_tokenizer`, :func:`tokenize`).
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ...errors import InputError, MissingFileError

__all__ = [
    "ClipTokenizer",
    "ZeroShotHead",
    "load_tokenizer",
    "text_features",
    "tokenize",
    "zero_shot_heads",
]

_TEXT_BATCH = 256


class ClipTokenizer(NamedTuple):
    """A model folder's ``tokenizer.json`` (``tokenizers.Tokenizer``), its end-of-text id and
    the text tower's longest input."""

    tokenizer: Any
    eos_id: int
    max_len: int


def load_tokenizer(model_dir: str | os.PathLike, config: Any) -> ClipTokenizer:
    """The tokenizer of a CLIP folder (``tokenizer.json``), checked against its ``config``.

    Raises:
      MissingFileError: no ``tokenizer.json``.
      InputError: no ``<|endoftext|>`` token, or one whose id the text tower does not pool at.
    """
    from tokenizers import Tokenizer

    f = pathlib.Path(model_dir) / "tokenizer.json"
    if not f.is_file():
        raise MissingFileError(
            f"--model-dir {model_dir}: no tokenizer.json; write it with "
            "transformers.CLIPTokenizerFast.from_pretrained(DIR).save_pretrained(DIR)"
        )
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # the tokenizers library's own error type
        raise InputError(f"--model-dir {model_dir}: cannot read tokenizer.json ({e})") from None
    tc = config.text_config
    eos = tok.token_to_id("<|endoftext|>")
    if eos is None:
        raise InputError(
            f"--model-dir {model_dir}: tokenizer.json has no <|endoftext|> token; is it CLIP's?"
        )
    if not tc.legacy_eos and eos != tc.eos_token_id:
        raise InputError(
            f"--model-dir {model_dir}: tokenizer.json's <|endoftext|> is id {eos} but config.json "
            f"pools at eos_token_id {tc.eos_token_id}; the tokenizer is not this model's"
        )
    if eos >= tc.vocab_size:
        raise InputError(
            f"--model-dir {model_dir}: tokenizer.json's ids reach {eos}, beyond the model's "
            f"vocabulary of {tc.vocab_size}; the tokenizer is not this model's"
        )
    return ClipTokenizer(tok, int(eos), int(tc.max_position_embeddings))


def tokenize(tok: ClipTokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` ``(N, T)`` int32 of ``texts``: CLIP's ``<|startoftext|> ... <|endoftext|>``
    (the tokenizer's post-processor), cut to the model's positions keeping the end-of-text
    token, padded with the end-of-text id to the longest text (mask 0 there).

    Raises:
      InputError: a text whose encoding does not end with the end-of-text token.
    """
    rows = []
    for text, enc in zip(texts, tok.tokenizer.encode_batch(list(texts)), strict=True):
        ids = list(enc.ids)
        if not ids or ids[-1] != tok.eos_id:
            raise InputError(
                f"tokenize: {text!r} does not end with <|endoftext|> (id {tok.eos_id}) after "
                "tokenizing; tokenizer.json lacks CLIP's post-processor"
            )
        if len(ids) > tok.max_len:
            ids = [*ids[: tok.max_len - 1], tok.eos_id]
        rows.append(ids)
    t = max(len(r) for r in rows)
    ids = np.full((len(rows), t), tok.eos_id, np.int32)
    mask = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


class ZeroShotHead(NamedTuple):
    """A dataset's zero-shot classifier: ``vectors (C, P)`` float32, each row
    ``exp(logit_scale) * unit(mean_t unit(text(template_t(class))))``; ``task`` its dataset."""

    vectors: np.ndarray
    task: str


@functools.partial(jax.jit, static_argnums=0)
def _text_features(graphdef: Any, state: Any, ids: Any, mask: Any) -> Any:
    from flax import nnx

    return nnx.merge(graphdef, state).get_text_features(ids, mask)


def text_features(model: Any, tok: ClipTokenizer, texts: Sequence[str]) -> np.ndarray:
    """``(N, P)`` float32 text embeddings (projected, not normalized) of ``texts``, in jitted
    batches of one shape."""
    from flax import nnx

    ids, mask = tokenize(tok, texts)
    graphdef, state = nnx.split(model)
    n, b = len(ids), min(_TEXT_BATCH, len(ids))
    out = []
    for s in range(0, n, b):
        i, m = ids[s : s + b], mask[s : s + b]
        k = len(i)
        if k < b:  # filler rows: copies of the first (a valid end-of-text position)
            i = np.concatenate([i, np.repeat(i[:1], b - k, 0)])
            m = np.concatenate([m, np.repeat(m[:1], b - k, 0)])
        out.append(np.asarray(_text_features(graphdef, state, i, m))[:k])
    return np.concatenate(out).astype(np.float32)


def zero_shot_heads(model: Any, tok: ClipTokenizer, tasks: Sequence[Any]) -> list[ZeroShotHead]:
    """One :class:`ZeroShotHead` per task from the base text tower (KnOTS'
    ``build_classification_head``; CLIP's zero-shot classifier).

    Args:
      model: a ``clip.CLIPModel`` (its text tower and logit scale are used).
      tok: :func:`load_tokenizer`'s.
      tasks: objects with ``name`` and ``prompts()`` (``vision_tasks.VisionTask``): per class,
        one prompt per template.
    """
    prompts = [t.prompts() for t in tasks]
    flat = [p for per in prompts for cls in per for p in cls]
    feats = text_features(model, tok, flat)
    scale = np.float32(np.exp(np.float32(np.asarray(model.logit_scale[...]))))
    heads, at = [], 0
    for t, per in zip(tasks, prompts, strict=True):
        vecs = []
        for cls in per:
            e = feats[at : at + len(cls)]
            at += len(cls)
            e = e / np.linalg.norm(e, axis=-1, keepdims=True)
            m = e.mean(axis=0)
            vecs.append(m / np.linalg.norm(m))
        heads.append(ZeroShotHead((scale * np.stack(vecs)).astype(np.float32), t.name))
    return heads
