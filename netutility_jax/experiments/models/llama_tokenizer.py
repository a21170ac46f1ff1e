"""The tokenizer of a Llama-family decoder, built with ``tokenizers`` from a GGUF or a tokenizer.json.

Two sources give the same :class:`Tokenizer`:

* **GGUF metadata** (:meth:`Tokenizer.from_gguf_metadata`): llama.cpp stores a byte-level BPE
  (``tokenizer.ggml.model == "gpt2"``) as its token strings (``tokenizer.ggml.tokens``, already
  spelled in GPT-2's byte-to-unicode alphabet), its merges (``tokenizer.ggml.merges``, ``"a b"``
  strings, best first), token types (3 = control, 4 = user defined), the special ids and the chat
  template. The tokenizer built here is what transformers' GGUF loader builds
  (``transformers.integrations.gguf.convert_gguf_tokenizer``): a BPE without unknown token, the
  GPT-2 byte-level pre-tokenizer (no prefix space) and decoder, control tokens added as special
  tokens and user-defined ones as plain added tokens, and a BOS/EOS template only when
  ``tokenizer.ggml.add_bos_token``/``add_eos_token`` say so (SmolLM2: no BOS). One difference:
  for ``tokenizer.ggml.pre == "smollm"`` digits are isolated before the byte-level split, as in
  llama.cpp (``LLAMA_VOCAB_PRE_TYPE_SMOLLM``) and SmolLM2's own tokenizer.json; transformers does
  not know this pre-tokenizer name and skips that step. The two agree except where a run of
  two or more spaces precedes a digit (``"a  1"``: ``a ĠĠ 1`` here and in llama.cpp,
  ``a Ġ Ġ 1`` in transformers).
  ``"llama-bpe"``/``"llama3"`` (Llama 3) and ``"qwen2"`` (Qwen2/3) use those models' split
  patterns; other names are refused (load the model's tokenizer.json instead).
* **tokenizer.json** (:meth:`Tokenizer.from_pretrained`): the file of a Hugging Face folder as
  is (its normalizer, pre-tokenizer and BOS template), with the special tokens and chat template
  of ``tokenizer_config.json`` (or ``chat_template.jinja``) and ``config.json``.

Batches (:meth:`Tokenizer.__call__`) are padded on the **right** by default (``padding_side``):
:func:`netutility_jax.experiments.models.llama.last_token_logits` finds the last real token from the
mask and works with either side.
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError, InputTypeError, MissingFileError

__all__ = [
    "Tokenizer",
    "Tokens",
    "bytes_to_unicode",
    "check_texts",
    "read_json",
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


class Tokens(NamedTuple):
    """A tokenized batch: ``ids`` ``(B, T)`` int32 and ``mask`` ``(B, T)`` int32 (1 = token)."""

    ids: np.ndarray
    mask: np.ndarray


def _template_env():
    import jinja2
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: no HTML escaping, unicode kept
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    return _template_env().from_string(source)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the model's special ids, batching and chat template.

    Build it with :meth:`from_gguf_metadata` or :meth:`from_pretrained` (the loaders of
    :mod:`netutility_jax.experiments.models.llama` do).

    Args:
      backend: the ``tokenizers.Tokenizer`` (not modified; batching pads here, in numpy).
      bos_id, eos_id, pad_id, unk_id: special token ids (None if the model has none).
      chat_template: the jinja chat template, or None.
      source: where it was read from (for messages).

    Attributes:
      backend, bos_id, eos_id, pad_id, unk_id, chat_template: as given.

    Example:
      >>> from netutility_jax.experiments.models import llama
      >>> tok = llama.from_gguf().tokenizer
      >>> ids = tok.encode("Hello world")
      >>> tok.decode(ids)
      'Hello world'
      >>> tok.chat([{"role": "user", "content": "Hi"}]).endswith("<|im_start|>assistant\\n")
      True
    """

    def __init__(
        self,
        backend: Any,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        chat_template: str | None = None,
        source: str = "",
    ):
        self.backend = backend
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
        self.chat_template = chat_template
        self.source = source

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"pad_id={self.pad_id}, source={self.source!r})"
        )

    # ----------------------------------------------------------------------------- builders

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, source: str = "") -> Tokenizer:
        """Build the byte-level BPE a GGUF file describes (``tokenizer.ggml.*`` keys).

        Args:
          metadata: the GGUF key/value metadata (``gguf_io.GGUFFile.metadata``).
          source: the file, for messages.

        Raises:
          InputError: a tokenizer model other than ``"gpt2"`` (byte-level BPE), a pre-tokenizer
            name this port does not know, missing tokens or merges, a special id out of range.
        """
        fn = f"Tokenizer.from_gguf_metadata({source!r})"
        pre = _gguf_pre(fn, metadata)
        tokens = list(metadata["tokenizer.ggml.tokens"])
        backend, vocab = _gguf_bpe(fn, metadata, tokens, pre)
        _gguf_added_tokens(backend, metadata, tokens, vocab)
        bos = _gguf_special(fn, metadata, "bos_token_id", len(tokens))
        eos = _gguf_special(fn, metadata, "eos_token_id", len(tokens))
        _gguf_template(backend, metadata, tokens, bos, eos)
        return cls(
            backend,
            bos_id=bos,
            eos_id=eos,
            pad_id=_gguf_special(fn, metadata, "padding_token_id", len(tokens)),
            unk_id=_gguf_special(fn, metadata, "unknown_token_id", len(tokens)),
            chat_template=metadata.get("tokenizer.chat_template"),
            source=source,
        )

    @classmethod
    def from_pretrained(cls, folder: str | pathlib.Path) -> Tokenizer:
        """Load ``tokenizer.json`` of a Hugging Face folder, with its special tokens and template.

        Special tokens come from ``tokenizer_config.json`` (``bos_token``, ``eos_token``,
        ``pad_token``, ``unk_token``: strings or ``{"content": ...}``), else from the ids in
        ``config.json``; the chat template from ``chat_template.jinja`` or
        ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates:
        ``"default"``). Whether a BOS is added is the tokenizer.json post-processor's business
        (Llama 3's adds ``<|begin_of_text|>``; Qwen's adds nothing).

        Raises:
          MissingFileError: no ``tokenizer.json`` in ``folder``.
          InputError: a file that is not valid JSON, or a special token not in the vocabulary.
        """
        from tokenizers import Tokenizer as Backend

        d = pathlib.Path(folder)
        fn = f"Tokenizer.from_pretrained({str(d)!r})"
        path = d / "tokenizer.json"
        if not path.is_file():
            raise MissingFileError(
                f"{fn}: no tokenizer.json in the folder; a Hugging Face model folder holds one "
                "(sentencepiece-only folders with tokenizer.model are not supported)."
            )
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise InputError(f"{fn}: tokenizer.json could not be read: {e}") from None
        tcfg = (
            read_json(d / "tokenizer_config.json", fn)
            if (d / "tokenizer_config.json").is_file()
            else {}
        )
        mcfg = read_json(d / "config.json", fn) if (d / "config.json").is_file() else {}

        def special(name: str) -> int | None:
            tok = tcfg.get(f"{name}_token")
            if isinstance(tok, Mapping):
                tok = tok.get("content")
            if isinstance(tok, str):
                i = backend.token_to_id(tok)
                if i is None:
                    raise InputError(
                        f"{fn}: tokenizer_config.json names {name}_token {tok!r}, which is not in "
                        "the vocabulary of tokenizer.json."
                    )
                return int(i)
            i = mcfg.get(f"{name}_token_id")
            if isinstance(i, list):  # several EOS ids (generation stops at any): the first
                i = i[0] if i else None
            return None if i is None else int(i)

        template = None
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            t = tcfg.get("chat_template")
            if isinstance(t, list):
                named = {x.get("name"): x.get("template") for x in t if isinstance(x, Mapping)}
                t = named.get("default")
            template = t if isinstance(t, str) else None
        return cls(
            backend,
            bos_id=special("bos"),
            eos_id=special("eos"),
            pad_id=special("pad"),
            unk_id=special("unk"),
            chat_template=template,
            source=str(d),
        )

    # ------------------------------------------------------------------------------ encoding

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (in the byte-level spelling: ``"Ġyes"``), or None."""
        i = self.backend.token_to_id(token)
        return None if i is None else int(i)

    def id_to_token(self, i: int) -> str | None:
        """The token string of an id, or None."""
        return self.backend.id_to_token(int(i))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one text (special tokens written in the text, like ``<|im_start|>``, are
        matched whole; ``add_special_tokens`` adds the template's BOS/EOS, if any)."""
        if not isinstance(text, str):
            raise InputTypeError(
                f"Tokenizer.encode: expected a string, got {type(text).__name__}; use "
                "encode_batch or the tokenizer call for several texts."
            )
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of each text, unpadded."""
        check_texts("Tokenizer.encode_batch", texts)
        enc = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in enc]

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        """The text of a sequence of ids."""
        return self.backend.decode(
            [int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens
        )

    def __call__(
        self,
        texts: Sequence[str],
        *,
        max_length: int | None = None,
        pad_to: int | None = None,
        padding_side: str = "right",
        truncation_side: str = "right",
        add_special_tokens: bool = True,
    ) -> Tokens:
        """Tokenize a batch into padded ``(B, T)`` arrays.

        Args:
          texts: ``B`` strings.
          max_length: cut longer texts to this many tokens (from ``truncation_side``).
          pad_to: pad to this length ``T`` (static shapes for ``jit``); default: the longest text.
          padding_side: ``"right"`` (default) or ``"left"``.
          truncation_side: ``"right"`` (keep the start; transformers' default) or ``"left"``
            (keep the end, e.g. a prompt's answer cue).
          add_special_tokens: add the template's BOS/EOS, if the tokenizer has one.

        Returns:
          :class:`Tokens` (numpy int32). Padding ids are ``pad_id`` (else ``eos_id``, else 0);
          the mask, not the id, tells the model to ignore them.

        Raises:
          InputTypeError: ``texts`` is one string or holds non-strings.
          InputError: a bad side, no text, a text longer than ``pad_to`` (without
            ``max_length <= pad_to``).
        """
        fn = "Tokenizer"
        check_texts(fn, texts)
        for name, side in (("padding_side", padding_side), ("truncation_side", truncation_side)):
            if side not in ("left", "right"):
                raise InputError(f"{fn}: {name}={side!r}; expected 'left' or 'right'.")
        if max_length is not None and max_length < 1:
            raise InputError(f"{fn}: max_length={max_length}; expected a positive int or None.")
        seqs = self.encode_batch(texts, add_special_tokens=add_special_tokens)
        if max_length is not None:
            seqs = [
                s[:max_length] if truncation_side == "right" else s[max(len(s) - max_length, 0) :]
                for s in seqs
            ]
        longest = max(len(s) for s in seqs)
        t = longest if pad_to is None else int(pad_to)
        if longest > t:
            i = max(range(len(seqs)), key=lambda j: len(seqs[j]))
            raise InputError(
                f"{fn}: text {i} has {longest} tokens, more than pad_to={t}; raise pad_to or pass "
                f"max_length={t} to cut the texts."
            )
        pad = next((x for x in (self.pad_id, self.eos_id) if x is not None), 0)
        ids = np.full((len(seqs), t), pad, np.int32)
        mask = np.zeros((len(seqs), t), np.int32)
        for i, s in enumerate(seqs):
            if not s:
                continue
            sl = slice(0, len(s)) if padding_side == "right" else slice(t - len(s), t)
            ids[i, sl] = s
            mask[i, sl] = 1
        return Tokens(ids, mask)

    # ---------------------------------------------------------------------------- prompting

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt string of a conversation, rendered by the model's chat template.

        Rendered as transformers' ``apply_chat_template(..., tokenize=False)`` does (jinja2
        sandbox, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a
        ``tojson`` that keeps unicode), with ``bos_token``/``eos_token`` and ``kwargs`` (e.g.
        ``enable_thinking=False`` for Qwen3) in the template's namespace. Tokenize the result
        with ``add_special_tokens=False`` when the template writes the BOS itself.

        Args:
          messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
          add_generation_prompt: end with the assistant turn's header.

        Raises:
          InputError: the tokenizer has no chat template; the template raised an error.
        """
        fn = "Tokenizer.chat"
        if not self.chat_template:
            raise InputError(
                f"{fn}: the tokenizer from {self.source!r} has no chat template; write the prompt "
                "string yourself."
            )
        import jinja2

        tok = {
            "bos_token": "" if self.bos_id is None else self.id_to_token(self.bos_id),
            "eos_token": "" if self.eos_id is None else self.id_to_token(self.eos_id),
        }
        try:
            return _compiled_template(self.chat_template).render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **{**tok, **kwargs},
            )
        except jinja2.exceptions.TemplateError as e:
            raise InputError(f"{fn}: the chat template failed: {e}") from None

    def label_token_ids(self, words: Sequence[str], *, leading_space: bool = True) -> np.ndarray:
        """The first token id of each label word, for scoring answers with the LM head.

        A prompt ending in ``"Answer:"`` is continued by ``" yes"`` (leading space), one ending
        in ``"Answer: "`` or a newline by ``"yes"``: pick the variant that matches the prompt.
        Distinct words must start with distinct tokens, or the head could not tell them apart.

        Args:
          words: ``K`` label words.
          leading_space: tokenize ``" " + word`` (default) rather than ``word``.

        Returns:
          ``(K,)`` int32 ids.

        Raises:
          InputError: an empty word, or two words whose first tokens coincide.
        """
        fn = "Tokenizer.label_token_ids"
        check_texts(fn, words)
        out = []
        for w in words:
            ids = self.encode((" " + w) if leading_space else w, add_special_tokens=False)
            if not w or not ids:
                raise InputError(f"{fn}: label word {w!r} is empty; give non-empty words.")
            out.append(ids[0])
        seen: dict[int, str] = {}
        for w, i in zip(words, out, strict=True):
            if i in seen and seen[i] != w:
                raise InputError(
                    f"{fn}: label words {seen[i]!r} and {w!r} share their first token "
                    f"{self.id_to_token(i)!r} (id {i}) with leading_space={leading_space}; pick "
                    "words that start differently."
                )
            seen[i] = w
        return np.asarray(out, np.int32)


def check_texts(fn: str, texts: Any, what: str = "text") -> None:
    """A tokenizer's input: a non-empty sequence of strings (``what``: a text's name in the
    messages, e.g. ``"sentence"``).

    Raises:
      InputTypeError: a string or non-string items.
      InputError: no texts.
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise InputTypeError(
            f"{fn}: expected a sequence of strings, got {type(texts).__name__}"
            f"{'' if isinstance(texts, str) else ' with non-string items'}; wrap a single {what} "
            "in a list: [text]."
        )
    if len(texts) == 0:
        raise InputError(f"{fn}: no {what}s given; pass at least one.")


def read_json(path: pathlib.Path, fn: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{fn}: {path.name} is not valid JSON ({e}).") from None


# ----------------------------------------------------------------- the GGUF tokenizer's parts


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
