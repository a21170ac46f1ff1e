"""The language suite's tasks as prompts: one question per text, answered by a label word.

Every task of :mod:`netutility_jax.experiments.data.tasks` becomes a short plain-text prompt (or the
model's chat template, ``chat=True``) that ends with the answer cue ``"Answer:"``; the answer is
one of the task's **label words** (:class:`PromptSpec`), one per label. A prompt is scored by the
decoder's own LM head at the last position, restricted to the first token of each label word
(``" positive"`` with its leading space), and the prediction is the label whose token has the
largest logit. This formulation is this project's own; the paper trains a classification head
with each LoRA instead (its App. B; the ``language_head`` suite runs that on the same tasks).

A task's **head** (:class:`PromptHead`) is its spec and the label words' first-token ids; the
words of a task must start with distinct tokens (checked, with the clashing words named).

**Cost.** The decoder's work grows with the prompt's tokens, so the prompts are short: the
question names the choices (which helps the zero-shot model) in about 10 tokens, and a task's
text is cut to ``PromptSpec.max_text_tokens`` tokens (and so that the whole prompt fits
``max_len``). The six default tasks (:data:`DEFAULT_TASKS`) have short texts (a word, a pair of
words, a film title, a definition); ``tweet_source``, ``austen_novel`` and ``review_sentiment``
have specs too, with longer texts.

**Batches** (:class:`PromptSet`): prompts of every task are sorted by length, longest first, and
cut into batches of ``rows`` prompts, each padded on the right to its longest prompt rounded up
to a multiple of :data:`BUCKET` tokens. So a pass compiles one shape per bucket (a few), the
padding is at most ``BUCKET - 1`` tokens a prompt, and only the last batch has filler rows (it
is cut to a power of two rows).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError, InputTypeError
from ..harness.passes import TaskSet, last_batch_rows
from . import tasks as tk

__all__ = [
    "BUCKET",
    "CUE",
    "DEFAULT_TASKS",
    "EVAL_ROWS",
    "PROMPTS",
    "PromptBatch",
    "PromptHead",
    "PromptSet",
    "PromptSpec",
    "batches",
    "bucket",
    "encode_prompts",
    "format_prompt",
    "make_head",
    "make_prompt_set",
    "pad_id",
    "prompt_spec",
]

#: Prompts are padded to a multiple of this many tokens (one compiled shape per multiple).
BUCKET = 8
#: Prompts per evaluation batch.
EVAL_ROWS = 32
#: The answer cue every prompt ends with; label words follow it after a space.
CUE = "Answer:"


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """How a task is asked.

    Attributes:
      template: the question, with ``{text}`` (or ``{first}`` and ``{second}`` for a pair task,
        whose texts are two parts joined by ``tasks.PAIR_SEP``); the prompt is the question, a
        newline and :data:`CUE`.
      words: one label word per label of the task, in the task's label order; their first tokens
        (after a space) must differ.
      max_text_tokens: a text is cut to this many tokens (each part of a pair to half).
    """

    template: str
    words: tuple[str, ...]
    max_text_tokens: int = 24

    def __post_init__(self) -> None:
        object.__setattr__(self, "words", tuple(self.words))
        if not isinstance(self.template, str) or not all(isinstance(w, str) for w in self.words):
            raise InputTypeError(
                f"PromptSpec: template must be a string and words strings, got "
                f"{type(self.template).__name__} and {[type(w).__name__ for w in self.words]}."
            )
        if isinstance(self.max_text_tokens, bool) or not (
            isinstance(self.max_text_tokens, int) and self.max_text_tokens >= 2
        ):
            raise InputError(
                f"PromptSpec: max_text_tokens={self.max_text_tokens!r}; expected an int >= 2."
            )
        fields = {"{text}"} if "{text}" in self.template else {"{first}", "{second}"}
        if not all(f in self.template for f in fields) or not self.words:
            raise InputError(
                f"PromptSpec: template {self.template!r} must contain {{text}} (or {{first}} and "
                f"{{second}} for a pair task) and words {self.words!r} must not be empty."
            )

    @property
    def pair(self) -> bool:
        return "{text}" not in self.template


#: The built-in tasks' prompts: terse questions (about 8 tokens besides the text). Listing the
#: choices in the question costs 5 to 15 tokens a prompt and left SmolLM2-135M's zero-shot
#: accuracy at chance all the same (measured on 40 test prompts of three tasks); the chat
#: template (48 tokens a prompt instead of 13) raised it a little on two of three. Label words
#: are the task's labels where those are words with distinct first tokens; WordNet's
#: "artifact"/"location" read better as "object"/"place", its relations as the words a reader
#: would answer with.
PROMPTS: Mapping[str, PromptSpec] = MappingProxyType(
    {
        "word_sentiment": PromptSpec('Sentiment of the word "{text}"?', ("negative", "positive")),
        "word_pos": PromptSpec(
            'Part of speech of "{text}"?', ("adjective", "adverb", "noun", "verb")
        ),
        "word_relation": PromptSpec(
            'Relation of "{first}" to "{second}"?',
            ("opposite", "category", "part", "synonym"),
            max_text_tokens=16,
        ),
        "movie_genre": PromptSpec(
            'Genre of the film "{text}"?',
            ("action", "comedy", "documentary", "drama", "horror"),
        ),
        "verb_supersense": PromptSpec(
            'Verb class of "{text}"?',
            ("change", "communication", "contact", "motion", "possession", "social"),
        ),
        "wordnet_supersense": PromptSpec(
            'Category of "{text}"?', ("animal", "object", "food", "place", "person", "plant")
        ),
        "tweet_source": PromptSpec(
            'Device of the tweet "{text}"?', ("Android", "iPhone"), max_text_tokens=40
        ),
        "austen_novel": PromptSpec(
            'Austen novel of "{text}"?',
            ("Emma", "Mansfield", "Northanger", "Persuasion", "Pride", "Sense"),
            max_text_tokens=40,
        ),
        "review_sentiment": PromptSpec(
            'Rating of the review "{text}"?', ("great", "other"), max_text_tokens=48
        ),
    }
)
#: The suite's default tasks: six with short texts, the pair task among them.
DEFAULT_TASKS = (
    "word_sentiment",
    "word_pos",
    "word_relation",
    "movie_genre",
    "verb_supersense",
    "wordnet_supersense",
)


def prompt_spec(task: Any) -> PromptSpec:
    """The built-in spec of ``task`` (a ``tasks.Task``), or a generic one for a task of your own.

    The generic spec asks ``"Text: {text}\\nLabel: a, b or c?"`` with the label names as words
    (a pair task's ``{text}`` is shown as is).
    """
    if task.name in PROMPTS and tuple(task.labels) == _builtin_labels(task.name):
        return PROMPTS[task.name]
    labels = list(task.labels)
    choices = ", ".join(labels[:-1]) + " or " + labels[-1] if len(labels) > 1 else labels[0]
    template = "Text: {text}\nLabel: " + choices.replace("{", "{{").replace("}", "}}") + "?"
    return PromptSpec(template, tuple(labels))


def _builtin_labels(name: str) -> tuple[str, ...]:
    info = tk.TASK_INFO.get(name)
    return () if info is None else tuple(info.labels)


class PromptHead(NamedTuple):
    """A task's scoring head: its prompt spec and the label words' first-token ids ``(K,)``."""

    task: str
    spec: PromptSpec
    token_ids: np.ndarray


def make_head(task: Any, tokenizer: Any, spec: PromptSpec | None = None) -> PromptHead:
    """The head of ``task``: ``spec`` (default :func:`prompt_spec`) and its label token ids.

    Raises:
      InputError: the spec has another number of words than the task has labels, or two words
        whose first tokens coincide (the LM head could not tell them apart).
    """
    spec = prompt_spec(task) if spec is None else spec
    fn = "lang_tasks.make_head"
    if len(spec.words) != len(task.labels):
        raise InputError(
            f"{fn}: task {task.name!r} has {len(task.labels)} labels {list(task.labels)} but its "
            f"prompt has {len(spec.words)} label words {list(spec.words)}; give one word per label."
        )
    ids = [tokenizer.encode(" " + w, add_special_tokens=False) for w in spec.words]
    seen: dict[int, str] = {}
    for w, i in zip(spec.words, ids, strict=True):
        if not w.strip() or not i:
            raise InputError(f"{fn}: task {task.name!r} has an empty label word {w!r}.")
        if i[0] in seen:
            raise InputError(
                f"{fn}: task {task.name!r}: label words {seen[i[0]]!r} and {w!r} both start with "
                f"the token {tokenizer.id_to_token(i[0])!r} (id {i[0]}); the LM head could not "
                "tell them apart. Choose words that start differently (PromptSpec(words=...))."
            )
        seen[i[0]] = w
    return PromptHead(task.name, spec, np.asarray([i[0] for i in ids], np.int32))


def _cut(tokenizer: Any, text: str, n: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text if len(ids) <= n else tokenizer.decode(ids[:n]).rstrip()


def format_prompt(
    spec: PromptSpec, text: str, tokenizer: Any, *, max_len: int | None = None, chat: bool = False
) -> str:
    """The prompt for one text: the question (text cut to fit) and the answer cue.

    Plain: ``question + "\\n" + CUE``. Chat: the tokenizer's chat template with the question as
    the user's turn, the assistant turn opened and started with :data:`CUE`. Either way the
    label words follow after a space. The text is cut to ``spec.max_text_tokens`` tokens, and
    further so that the prompt has at most ``max_len`` tokens.

    Raises:
      InputError: the prompt without any text is already longer than ``max_len``.
    """

    def render(fill: Mapping[str, str]) -> str:
        q = spec.template.format(**fill)
        if chat:
            return tokenizer.chat([{"role": "user", "content": q}]) + CUE
        return q + "\n" + CUE

    def length(s: str) -> int:
        return len(tokenizer.encode(s, add_special_tokens=True))

    if spec.pair:
        first, _, second = text.partition(tk.PAIR_SEP.strip())
        parts = {"first": first.strip(), "second": second.strip()}
    else:
        parts = {"text": text}
    per = max(spec.max_text_tokens // len(parts), 1)
    if max_len is not None:
        # tokens besides the text: measured with a one-token stand-in (an empty text can merge
        # with the quotes around it)
        bare = length(render({k: "x" for k in parts})) - len(parts)
        per = min(per, (max_len - bare) // len(parts))
    while True:
        if per < 1:
            raise InputError(
                f"format_prompt: the prompt {render({k: '' for k in parts})!r} leaves no room for "
                f"the text within max_len={max_len} tokens; raise max_len or shorten the template."
            )
        out = render({k: _cut(tokenizer, v, per) for k, v in parts.items()})
        # a cut text can tokenize differently inside the prompt (rare): cut one token more
        if max_len is None or length(out) <= max_len:
            return out
        per -= 1


# ------------------------------------------------------------------------------- prompt sets


class PromptBatch(NamedTuple):
    """One forward call: ``ids``/``mask`` ``(rows, T)`` int32 (right padded); ``index`` ``(rows,)``
    the prompt of each row (``-1`` for a filler row)."""

    ids: np.ndarray
    mask: np.ndarray
    index: np.ndarray


def bucket(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`BUCKET`."""
    return max(-(-int(n) // BUCKET) * BUCKET, BUCKET)


def batches(
    ids: np.ndarray,
    lengths: np.ndarray,
    order: np.ndarray,
    *,
    rows: int,
    pad_id: int,
    shrink_last: bool = False,
) -> list[PromptBatch]:
    """Cut prompts (``order``: indices into ``ids``) into consecutive batches of ``rows``.

    Each batch is padded to :func:`bucket` of its longest prompt. A short last batch gets filler
    rows (index ``-1``, an empty mask) up to ``rows``, or with ``shrink_last`` up to the next
    power of two (at least 4): one more compiled shape, less work on fillers.
    """
    out = []
    for s in range(0, len(order), rows):
        sel = np.asarray(order[s : s + rows])
        n_rows = rows
        if shrink_last and len(sel) < rows:
            n_rows = last_batch_rows(len(sel), rows, 4)
        t = bucket(int(lengths[sel].max()))
        b_ids = np.full((n_rows, t), pad_id, np.int32)
        b_mask = np.zeros((n_rows, t), np.int32)
        idx = np.full(n_rows, -1, np.int32)
        for r, i in enumerate(sel):
            n = int(lengths[i])
            b_ids[r, :n] = ids[i, :n]
            b_mask[r, :n] = 1
            idx[r] = i
        out.append(PromptBatch(b_ids, b_mask, idx))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class PromptSet(TaskSet):
    """The prompts of one split of several tasks, tokenized and batched once.

    The attributes :mod:`runner`, :mod:`report` and :mod:`stats` read from an
    ``encoder_eval.EvalSet`` are here too (``task_names``, ``task``, ``labels``, ``lengths``,
    ``ids``, ``tokens``, ``slot_tokens``, ``rows``, ``only``).

    Attributes:
      task_names: the tasks, in the order of the ``task`` indices.
      heads: one :class:`PromptHead` per task.
      task: ``(N,)`` int32 task of each prompt.
      labels: ``(N,)`` int32 label ids.
      lengths: ``(N,)`` prompt tokens.
      ids: ``(N, max(lengths))`` int32 prompt tokens, right padded.
      token_ids: ``(K,)`` int32 the label tokens of every task, concatenated (the columns a pass
        scores); task ``t``'s are ``token_ids[offsets[t]:offsets[t + 1]]``.
      offsets: ``(T + 1,)``.
      batches: the forward calls.
      prompts: the prompt strings.
      pad_id: the padding token.
      rows_per_batch: prompts per batch.
    """

    task_names: tuple[str, ...]
    heads: tuple[PromptHead, ...]
    task: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray = dataclasses.field(repr=False)
    token_ids: np.ndarray = dataclasses.field(repr=False)
    offsets: np.ndarray = dataclasses.field(repr=False)
    batches: tuple[PromptBatch, ...] = dataclasses.field(repr=False)
    prompts: tuple[str, ...] = dataclasses.field(repr=False)
    pad_id: int = 0
    rows_per_batch: int = EVAL_ROWS

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """The distinct batch shapes (one compilation each)."""
        return tuple(sorted({b.ids.shape for b in self.batches}))

    def only(self, task: int | str) -> PromptSet:
        """The prompts of one task as a PromptSet of its own."""
        i = self.task_index(task)
        r = self.rows(i)
        return _assemble(
            (self.heads[i],),
            [self.prompts[j] for j in r],
            self.ids[r],
            self.lengths[r],
            np.zeros(len(r), np.int32),
            self.labels[r],
            rows=self.rows_per_batch,
            pad_id=self.pad_id,
        )

    def predict(self, logits: np.ndarray) -> np.ndarray:
        """``(N,)`` int32 label of each prompt: argmax over its own task's columns of ``logits``
        ``(N, K)`` (the scores of :attr:`token_ids`)."""
        pred = np.zeros(len(self), np.int32)
        for t in range(len(self.task_names)):
            r = self.rows(t)
            cols = logits[r, self.offsets[t] : self.offsets[t + 1]]
            pred[r] = np.argmax(cols, axis=1)
        return pred

    def log_probs(self, logits: np.ndarray) -> np.ndarray:
        """``(N,)`` log-probability of each prompt's true label under the softmax over its
        task's label tokens (float64)."""
        out = np.zeros(len(self), np.float64)
        for t in range(len(self.task_names)):
            r = self.rows(t)
            z = np.asarray(logits[r, self.offsets[t] : self.offsets[t + 1]], np.float64)
            z = z - z.max(axis=1, keepdims=True)
            lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            out[r] = lp[np.arange(len(r)), self.labels[r]]
        return out

    def fingerprint(self) -> str:
        """sha256 of the prompts' tokens, tasks, labels and label tokens."""
        h = hashlib.sha256()
        for x in (self.ids, self.lengths, self.task, self.labels, self.token_ids, self.offsets):
            h.update(np.ascontiguousarray(x).tobytes())
        h.update(json.dumps(self.task_names).encode())
        return h.hexdigest()


def _assemble(heads, prompts, ids, lengths, task, labels, *, rows, pad_id) -> PromptSet:
    lengths = np.asarray(lengths, np.int32)
    order = np.argsort(-lengths, kind="stable")
    token_ids = np.concatenate([h.token_ids for h in heads]).astype(np.int32)
    offsets = np.cumsum([0] + [len(h.token_ids) for h in heads]).astype(np.int32)
    return PromptSet(
        task_names=tuple(h.task for h in heads),
        heads=tuple(heads),
        task=np.asarray(task, np.int32),
        labels=np.asarray(labels, np.int32),
        lengths=lengths,
        ids=np.asarray(ids, np.int32),
        token_ids=token_ids,
        offsets=offsets,
        batches=tuple(batches(ids, lengths, order, rows=rows, pad_id=pad_id, shrink_last=True)),
        prompts=tuple(prompts),
        pad_id=pad_id,
        rows_per_batch=rows,
    )


def pad_id(tokenizer: Any) -> int:
    """The tokenizer's padding id (else its EOS, else 0), as ``Tokenizer.__call__`` pads."""
    return next((x for x in (tokenizer.pad_id, tokenizer.eos_id) if x is not None), 0)


def encode_prompts(
    tokenizer: Any,
    head: PromptHead,
    texts: Sequence[str],
    *,
    max_len: int,
    chat: bool = False,
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Prompt strings, ids ``(N, max_len)`` int32 (right padded) and lengths ``(N,)``."""
    prompts = [format_prompt(head.spec, t, tokenizer, max_len=max_len, chat=chat) for t in texts]
    toks = tokenizer(prompts, pad_to=max_len) if prompts else None
    if toks is None:
        return [], np.zeros((0, max_len), np.int32), np.zeros(0, np.int32)
    return prompts, toks.ids, toks.mask.sum(axis=1).astype(np.int32)


def make_prompt_set(
    tokenizer: Any,
    heads: Sequence[PromptHead],
    splits: Sequence[Any],
    *,
    max_len: int,
    rows: int = EVAL_ROWS,
    chat: bool = False,
) -> PromptSet:
    """Prompt, tokenize and batch the splits of several tasks (one head and split per task).

    Args:
      tokenizer: a ``llama.Tokenizer``.
      heads: :class:`PromptHead` per task (:func:`make_head`).
      splits: ``tasks.Split`` (``texts``, ``labels``) per task.
      max_len: most tokens a prompt may have (texts are cut to fit).
      rows: prompts per batch.
      chat: use the chat template (:func:`format_prompt`).
    """
    if len(heads) != len(splits):
        raise InputError(
            f"make_prompt_set: {len(heads)} heads for {len(splits)} splits; pass one head per "
            "task's split."
        )
    all_prompts, ids, lengths, task, labels = [], [], [], [], []
    for i, (head, sp) in enumerate(zip(heads, splits, strict=True)):
        p, x, n = encode_prompts(tokenizer, head, list(sp.texts), max_len=max_len, chat=chat)
        all_prompts += p
        ids.append(x)
        lengths.append(n)
        task += [i] * len(p)
        labels += np.asarray(sp.labels, np.int64).tolist()
    if not all_prompts:
        raise InputError("make_prompt_set: the splits hold no texts.")
    ids_a = np.concatenate(ids)
    len_a = np.concatenate(lengths)
    t = int(len_a.max())
    return _assemble(
        heads, all_prompts, ids_a[:, :t], len_a, task, labels, rows=rows, pad_id=pad_id(tokenizer)
    )
