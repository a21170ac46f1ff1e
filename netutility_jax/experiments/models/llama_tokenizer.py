"""The tokenizer of a Llama-family decoder, built with ``tokenizers`` from a GGUF or a tokenizer.json.

Two sources give the same :class:`Tokenizer`:

* **GGUF metadata** (:meth:`Tokenizer.from_gguf_metadata`, built by :mod:`gguf_tokenizer`):
  llama.cpp stores a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) as its token strings
  (``tokenizer.ggml.tokens``, already spelled in GPT-2's byte-to-unicode alphabet), its merges
  (``tokenizer.ggml.merges``, ``"a b"`` strings, best first), token types (3 = control, 4 = user
  defined), the special ids and the chat template. The tokenizer built here is what transformers'
  GGUF loader builds (``transformers.integrations.gguf.convert_gguf_tokenizer``): a BPE without
  unknown token, the GPT-2 byte-level pre-tokenizer (no prefix space) and decoder, control tokens
  added as special tokens and user-defined ones as plain added tokens, and a BOS/EOS template only
  when ``tokenizer.ggml.add_bos_token``/``add_eos_token`` say so (SmolLM2: no BOS). One difference:
  for ``tokenizer.ggml.pre == "smollm"`` digits are isolated before the byte-level split, as in
  llama.cpp (``LLAMA_VOCAB_PRE_TYPE_SMOLLM``) and SmolLM2's own tokenizer.json; transformers does
  not know this pre-tokenizer name and skips that step. The two agree except where a run of two or
  more spaces precedes a digit (``"a  1"``: ``a ĠĠ 1`` here and in llama.cpp, ``a Ġ Ġ 1`` in
  transformers). ``"llama-bpe"``/``"llama3"`` (Llama 3) and ``"qwen2"`` (Qwen2/3) use those models'
  split patterns; other names are refused (load the model's tokenizer.json instead).
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
from .gguf_tokenizer import gguf_backend

__all__ = [
    "Tokenizer",
    "Tokens",
    "check_texts",
    "read_json",
]

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
        built = gguf_backend(fn, metadata)
        return cls(
            built.backend,
            bos_id=built.bos_id,
            eos_id=built.eos_id,
            pad_id=built.pad_id,
            unk_id=built.unk_id,
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
