"""The NLI head formulation's pairs (:mod:`nli_head`): tokenized, bucketed and batched.

A premise-hypothesis pair is encoded jointly (:func:`encode_pairs`: the tokenizer's pair
encoding, as ``tokenizer(premise, hypothesis, truncation=True, max_length=...)``; Qwen3's
tokenizer adds no special tokens, so the two token sequences are concatenated). Evaluation runs
the pairs of every task through batches sorted by length, one shape per length bucket
(:func:`bucket_len`) and rows per batch from ``eval_tokens`` (:class:`NLISet`,
:func:`make_set`); a training step's rows are padded to the bucket of its longest pair
(:func:`train_batch`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError
from ..data import lang_tasks as lt
from ..harness.passes import TaskSet
from .nli_head_model import NUM_CLASSES, HeadSpec, num_classes

__all__ = [
    "Encoded",
    "NLISet",
    "bucket_len",
    "encode_pairs",
    "make_set",
    "train_batch",
]


class Encoded(NamedTuple):
    """Token ids of ``N`` pairs, ragged: pair ``i`` is ``flat[offsets[i]:offsets[i + 1]]``."""

    flat: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int32)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]


@functools.lru_cache(maxsize=8)
def _pair_backend(tokenizer: Any, max_len: int) -> Any:
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(tokenizer.backend.to_str())
    backend.no_padding()
    backend.enable_truncation(max_len, strategy="longest_first")
    return backend


def encode_pairs(
    tokenizer: Any, pairs: Sequence[tuple[str, str] | str], *, max_len: int
) -> Encoded:
    """Token ids of ``(premise, hypothesis)`` pairs, as transformers' fast tokenizer encodes
    ``tokenizer(premises, hypotheses, truncation=True, max_length=max_len)``: the tokenizer's
    pair template (its special tokens, if any), longest-first truncation to ``max_len`` tokens.
    A single text (a ``str`` in place of a pair) is encoded alone, as ``tokenizer(text,
    truncation=True, max_length=max_len)``.

    Raises:
      InputError: a pair that encodes to no token; ``max_len`` below the template's special
        tokens.
    """
    if not len(pairs):
        return Encoded(np.zeros(0, np.int32), np.zeros(1, np.int64))
    try:
        enc = _pair_backend(tokenizer, int(max_len)).encode_batch(
            [x if isinstance(x, str) else tuple(x) for x in pairs], add_special_tokens=True
        )
    except Exception as e:  # tokenizers raises bare exceptions (e.g. max_len below specials)
        raise InputError(
            f"nli_head.encode_pairs: tokenizing failed (max_len={max_len}): {e}"
        ) from e
    ids = [e.ids for e in enc]
    empty = [i for i, x in enumerate(ids) if not x]
    if empty:
        raise InputError(
            f"nli_head.encode_pairs: pair {empty[0]} ({pairs[empty[0]]!r}) encodes to no token; "
            "drop empty pairs from the data."
        )
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int64)
    return Encoded(np.fromiter((t for x in ids for t in x), np.int32, int(offsets[-1])), offsets)


def bucket_len(n: int) -> int:
    """``n`` rounded up to the next of 16, 24, 32, 48, 64, 96, ... (``8 * 2^k`` and ``12 * 2^k``):
    at most two compiled shapes per doubling of the length, at most a third of padding."""
    n = max(int(n), 1)
    k = 16
    while True:
        if n <= k:
            return k
        if n <= k * 3 // 2:
            return k * 3 // 2
        k *= 2


def _rows_for(t: int, eval_tokens: int) -> int:
    r = max(eval_tokens // t, 1)
    return 1 << (r.bit_length() - 1)


def _eval_batches(
    enc: Encoded, order: np.ndarray, *, eval_tokens: int, pad_id: int
) -> list[lt.PromptBatch]:
    """Pairs (``order``: longest first) cut into batches of ``eval_tokens / T`` rows padded to
    ``T = bucket_len`` of their longest (a short last batch gets filler rows): a batch's shape
    depends on ``T`` only, so every set (and every task's part of it) shares the compilations."""
    lengths = enc.lengths
    out, s = [], 0
    while s < len(order):
        t = bucket_len(int(lengths[order[s]]))
        rows = _rows_for(t, eval_tokens)
        sel = order[s : s + rows]
        ids = np.full((rows, t), pad_id, np.int32)
        mask = np.zeros((rows, t), np.int32)
        index = np.full(rows, -1, np.int32)
        for r, i in enumerate(sel):
            x = enc.row(int(i))
            ids[r, : len(x)] = x
            mask[r, : len(x)] = 1
            index[r] = i
        out.append(lt.PromptBatch(ids, mask, index))
        s += len(sel)
    return out


def train_batch(
    enc: Encoded, labels: np.ndarray, chosen: Sequence[int], *, rows: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, mask, labels, valid)`` of one training step: ``rows`` rows right padded to
    :func:`bucket_len` of the longest chosen pair; missing rows are masked fillers."""
    chosen = np.asarray(chosen, np.int64)
    t = bucket_len(int(enc.lengths[chosen].max()))
    ids = np.full((rows, t), pad_id, np.int32)
    mask = np.zeros((rows, t), np.int32)
    lab = np.zeros(rows, np.int32)
    for r, i in enumerate(chosen):
        x = enc.row(int(i))
        ids[r, : len(x)] = x
        mask[r, : len(x)] = 1
        lab[r] = labels[i]
    return ids, mask, lab, np.arange(rows) < len(chosen)


@dataclasses.dataclass(frozen=True, eq=False)
class NLISet(TaskSet):
    """The pairs of one split of several tasks, tokenized and batched once (the attributes the
    runner, report and statistics read from an ``encoder_eval.EvalSet`` are here too).

    Attributes:
      task_names: the tasks, in the order of the ``task`` indices.
      heads: one :class:`HeadSpec` per task.
      task: ``(N,)`` int32 task of each pair (index into ``task_names``).
      head: ``(N,)`` int32 the head that reads each pair (index into the stacked heads the
        evaluator holds: equal to ``task`` except in a set cut out by :meth:`only`).
      labels: ``(N,)`` int32 classes of :data:`nli_data.LABELS`.
      lengths: ``(N,)`` tokens per pair.
      ids: ``(N, max(lengths))`` int32, right padded.
      batches: the forward calls (``lang_tasks.PromptBatch``: ``ids``, ``mask``, ``index``).
      pad_id: the padding id.
      eval_tokens: token slots per batch.
    """

    task_names: tuple[str, ...]
    heads: tuple[HeadSpec, ...]
    task: np.ndarray
    head: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray = dataclasses.field(repr=False)
    batches: tuple[lt.PromptBatch, ...] = dataclasses.field(repr=False)
    pad_id: int = 0
    eval_tokens: int = 16384

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """The distinct batch shapes (one compilation each)."""
        return tuple(sorted({b.ids.shape for b in self.batches}))

    def only(self, task: int | str) -> NLISet:
        """The pairs of one task as a set of its own (its rows keep their ``head``)."""
        i = self.task_index(task)
        r = self.rows(i)
        return _assemble(
            (self.task_names[i],), (self.heads[i],), self.ids[r], self.lengths[r],
            np.zeros(len(r), np.int32), self.head[r], self.labels[r],
            pad_id=self.pad_id, eval_tokens=self.eval_tokens,
        )  # fmt: skip

    def fingerprint(self) -> str:
        """sha256 of the pairs' tokens, tasks, heads, labels and masks."""
        h = hashlib.sha256()
        for x in (self.ids, self.lengths, self.task, self.head, self.labels):
            h.update(np.ascontiguousarray(x).tobytes())
        h.update(json.dumps([self.task_names, [list(x.used) for x in self.heads]]).encode())
        return h.hexdigest()


def _assemble(names, heads, ids, lengths, task, head, labels, *, pad_id, eval_tokens) -> NLISet:
    lengths = np.asarray(lengths, np.int32)
    order = np.argsort(-lengths, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.concatenate([ids[i, :n] for i, n in enumerate(lengths)] or [np.zeros(0, np.int32)])
    enc = Encoded(flat.astype(np.int32), offsets)
    return NLISet(
        task_names=tuple(names),
        heads=tuple(heads),
        task=np.asarray(task, np.int32),
        head=np.asarray(head, np.int32),
        labels=np.asarray(labels, np.int32),
        lengths=lengths,
        ids=np.asarray(ids, np.int32),
        batches=tuple(_eval_batches(enc, order, eval_tokens=eval_tokens, pad_id=pad_id)),
        pad_id=pad_id,
        eval_tokens=eval_tokens,
    )


def make_set(
    tokenizer: Any,
    heads: Sequence[HeadSpec],
    splits: Sequence[Any],
    *,
    max_len: int,
    eval_tokens: int = 16384,
) -> NLISet:
    """Tokenize (:func:`encode_pairs`) and batch the splits of several tasks, one head each.

    Raises:
      InputError: a count mismatch, no pairs at all, a label of a class the task's head masks.
    """
    if len(heads) != len(splits):
        raise InputError(
            f"nli_head.make_set: {len(heads)} heads for {len(splits)} splits; pass one per task."
        )
    encs, task, labels = [], [], []
    c = num_classes(heads) if heads else NUM_CLASSES
    for i, (h, sp) in enumerate(zip(heads, splits, strict=True)):
        lab = np.asarray(sp.labels, np.int64)
        bad = lab[(lab < 0) | (lab >= c)]
        if bad.size or not np.asarray(h.used)[lab].all():
            v = int(bad[0]) if bad.size else int(lab[~np.asarray(h.used)[lab]][0])
            raise InputError(
                f"nli_head.make_set: task {h.task!r} has an example of class {v} but its head "
                f"uses the classes {[c for c, u in enumerate(h.used) if u]} ({h.names})."
            )
        encs.append(encode_pairs(tokenizer, list(sp.texts), max_len=max_len))
        task += [i] * len(sp.labels)
        labels += lab.tolist()
    lengths = np.concatenate([e.lengths for e in encs])
    if not len(lengths):
        raise InputError("nli_head.make_set: the splits hold no pairs.")
    pad = lt.pad_id(tokenizer)
    ids = np.full((len(lengths), int(lengths.max())), pad, np.int32)
    r = 0
    for e in encs:
        for i in range(len(e)):
            x = e.row(i)
            ids[r, : len(x)] = x
            r += 1
    return _assemble(
        [h.task for h in heads], heads, ids, lengths, task, task, labels, pad_id=pad,
        eval_tokens=eval_tokens,
    )  # fmt: skip
