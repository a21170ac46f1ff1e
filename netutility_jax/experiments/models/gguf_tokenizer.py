"""The byte-level BPE a GGUF file describes, built with ``tokenizers`` (``tokenizer.ggml.*`` keys).

:func:`gguf_backend` builds what transformers' GGUF loader builds
(``transformers.integrations.gguf.convert_gguf_tokenizer``) from llama.cpp's metadata: the
token strings (already spelled in GPT-2's byte-to-unicode alphabet, :func:`bytes_to_unicode`),
the merges, the pre-tokenizer named by ``tokenizer.ggml.pre``, control and user-defined tokens,
a BOS/EOS template only where the file asks for one, and the special ids.
:meth:`llama_tokenizer.Tokenizer.from_gguf_metadata` wraps it (its module documents the
choices).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

from ...errors import InputError

__all__ = [
    "GGUFBackend",
    "bytes_to_unicode",
    "gguf_backend",
]

# Split patterns of the byte-level BPEs that are not GPT-2's own (the "pre" of the GGUF file).
# Llama 3 (tiktoken cl100k-style) and Qwen2/Qwen3, as their tokenizer.json files write them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
# GPT-2's own pattern (ByteLevel(use_regex=True)); "smollm" first isolates every digit.
_GPT2_PRES = (None, "default", "gpt2", "smollm")

_CONTROL, _USER_DEFINED = 3, 4


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable unicode characters (Radford et al. 2019).

    Printable Latin-1 bytes map to themselves; the others (control characters, space, ...) to
    ``chr(256 + k)`` in byte order, so the space is ``"Ġ"`` and the newline ``"Ċ"``.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out



class GGUFBackend(NamedTuple):
    """What :func:`gguf_backend` builds: the ``tokenizers.Tokenizer`` and the special token ids
    (None where the file names none)."""

    backend: Any
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None


def gguf_backend(fn: str, metadata: Mapping[str, Any]) -> GGUFBackend:
    """The byte-level BPE a GGUF file's metadata describes, with its special ids (``fn`` names
    the caller in messages).

    Raises:
      InputError: a tokenizer model other than ``"gpt2"`` (byte-level BPE), a pre-tokenizer
        name this port does not know, missing tokens or merges, a special id out of range.
    """
    pre = _gguf_pre(fn, metadata)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    backend, vocab = _gguf_bpe(fn, metadata, tokens, pre)
    _gguf_added_tokens(backend, metadata, tokens, vocab)
    bos = _gguf_special(fn, metadata, "bos_token_id", len(tokens))
    eos = _gguf_special(fn, metadata, "eos_token_id", len(tokens))
    _gguf_template(backend, metadata, tokens, bos, eos)
    return GGUFBackend(
        backend,
        bos,
        eos,
        _gguf_special(fn, metadata, "padding_token_id", len(tokens)),
        _gguf_special(fn, metadata, "unknown_token_id", len(tokens)),
    )


def _gguf_pre(fn: str, metadata: Mapping[str, Any]) -> str | None:
    """The pre-tokenizer name of a byte-level BPE GGUF, or the reason it cannot be built."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InputError(
            f"{fn}: tokenizer.ggml.model is {kind!r}; this port builds byte-level BPE "
            "tokenizers ('gpt2': Llama 3, Qwen, SmolLM) only. For a sentencepiece model load "
            "the Hugging Face folder with its tokenizer.json (llama.from_pretrained)."
        )
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in metadata:
            raise InputError(f"{fn}: the file has no {key!r}; it cannot be tokenized.")
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in _GPT2_PRES and pre not in _PRE_SPLITS:
        raise InputError(
            f"{fn}: tokenizer.ggml.pre is {pre!r}, a pre-tokenizer this port does not know "
            f"(known: {sorted(str(p) for p in (*_GPT2_PRES, *_PRE_SPLITS) if p)}); load the "
            "model's tokenizer.json with llama.from_pretrained instead."
        )
    return pre


def _gguf_bpe(
    fn: str, metadata: Mapping[str, Any], tokens: list[str], pre: str | None
) -> tuple[Any, dict[str, int]]:
    """The BPE backend (byte-level pre-tokenizer and decoder) and its vocabulary."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(t: str) -> str:
        # Byte-level vocabularies are stored in the byte alphabet; respell any that is not.
        return t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    bad = [m for m in merges if len(m) != 2][:3]
    if bad:
        raise InputError(f"{fn}: tokenizer.ggml.merges has entries {bad} that are not 'a b'.")
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _PRE_SPLITS)
    if pre in _PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"), byte_level]
        )
    elif pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _gguf_added_tokens(
    backend: Any, metadata: Mapping[str, Any], tokens: list[str], vocab: Mapping[str, int]
) -> None:
    """Add control tokens as special tokens and user-defined ones as plain added tokens."""
    from tokenizers import AddedToken

    alphabet = set(bytes_to_unicode().values())
    types = list(metadata.get("tokenizer.ggml.token_type") or ())
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _CONTROL and set(t) <= alphabet
    ]
    if control:
        backend.add_special_tokens(control)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _USER_DEFINED and t in vocab
    ]
    if user:
        backend.add_tokens(user)


def _gguf_special(fn: str, metadata: Mapping[str, Any], key: str, n: int) -> int | None:
    """The id ``tokenizer.ggml.{key}`` (None if absent), checked against the ``n`` tokens."""
    v = metadata.get(f"tokenizer.ggml.{key}")
    if v is None:
        return None
    if not 0 <= int(v) < n:
        raise InputError(
            f"{fn}: tokenizer.ggml.{key} = {v} is outside the vocabulary of {n} tokens."
        )
    return int(v)


def _gguf_template(
    backend: Any, metadata: Mapping[str, Any], tokens: list[str], bos: int | None, eos: int | None
) -> None:
    """A BOS/EOS post-processor, only where ``add_bos_token``/``add_eos_token`` ask for one."""
    from tokenizers import processors

    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return
    marks = []
    if add_bos:
        marks.append((tokens[bos], bos))
    if add_eos:
        marks.append((tokens[eos], eos))
    single = " ".join(
        [*([f"{tokens[bos]}:0"] if add_bos else []), "$A:0"]
        + ([f"{tokens[eos]}:0"] if add_eos else [])
    )
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} $B:1", special_tokens=marks
    )
