"""The encoder suite's evaluation: MiniLM packed, with folded merges, and its zero-shot heads.

**Heads.** Every task classifies with a frozen zero-shot head, the analogue of CLIP's text
heads: the L2-normalised base-model embeddings of one short description per label
(``Task.label_texts``, e.g. ``"a positive word"``). A text's logits are the cosine similarities
of its normalised embedding with those vectors, divided by a fixed temperature
(:data:`TEMPERATURE`); its prediction is the nearest description. The heads never train, so
every bit of task knowledge lives in the LoRA, and a merge that loses a task's directions loses
the task (the zero-shot model is the floor).

**Evaluation.** A merged adapter is evaluated as it would be served: folded into the base
kernels, ``W + coef * dK``. Each module's dense ``dK`` is formed once per merge
(:meth:`Backbone.deltas`); the fold happens inside the jitted forward, so a new coefficient
costs no host work and never recompiles. :class:`Evaluator` is the harness's
:class:`evaluate.MergeSearch` (the coefficient chosen on validation, then one test pass) over
this model.

**Speed (CPU).** Texts are packed (:func:`minilm.pack`): several texts share a row of
:data:`ROW_LEN` tokens, each attending only to itself, with positions restarting per text, so no
compute goes to padding. Batches have :data:`ROWS` x :data:`ROW_LEN` tokens, but for an
evaluation set's last, which has a power of two of rows (8 to 64): the forward compiles for at
most four shapes, and a small set computes few filler rows. Measured on the 2-core CPU (see
``benchmarks/demo_eval.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...errors import InputError
from ..harness.evaluate import BackboneSearch, check_modules, module_delta
from ..harness.passes import PassCounter, TaskSet, last_batch_rows
from ..models import minilm

__all__ = [
    "MAX_TEXTS",
    "ROWS",
    "ROW_LEN",
    "TEMPERATURE",
    "Backbone",
    "Batch",
    "EvalSet",
    "Evaluator",
    "Head",
    "correct",
    "encode",
    "logits",
    "make_eval_set",
    "packed_batches",
    "predict",
    "zero_shot_heads",
]

#: Tokens per packed row, and the truncation length of every text ([CLS] and [SEP] included).
ROW_LEN = 32
#: Most texts per row (each has at least [CLS], one token and [SEP]).
MAX_TEXTS = ROW_LEN // 3
#: Rows per forward call: 2048 tokens, the size at which this CPU's matmuls run fastest.
ROWS = 64
#: Temperature of the zero-shot heads' logits (cosine similarity / temperature).
TEMPERATURE = 0.05


def encode(texts: Sequence[str], *, max_len: int = ROW_LEN) -> tuple[np.ndarray, np.ndarray]:
    """Token ids ``(N, T)`` (``T`` the longest text, at most ``max_len``) and lengths ``(N,)``."""
    tok = minilm.tokenize(list(texts), max_length=max_len, pad_to_max_length=False)
    return tok.ids, tok.mask.sum(axis=1).astype(np.int32)


class Batch(NamedTuple):
    """One packed forward call: :class:`minilm.Packed` arrays of shape ``(rows, ROW_LEN)``."""

    ids: np.ndarray
    segment_ids: np.ndarray
    position_ids: np.ndarray
    text: np.ndarray


def packed_batches(
    ids: np.ndarray,
    lengths: np.ndarray,
    *,
    rows: int = ROWS,
    row_len: int = ROW_LEN,
    decreasing: bool = True,
    shrink_last: bool = False,
) -> list[Batch]:
    """Pack texts into rows and cut the rows into batches of ``rows`` rows (empty rows fill the
    last up to ``rows``, or with ``shrink_last`` up to the next power of two, at least 8: at
    most three more compiled shapes, and a small set's pass computes 8 rows, not 64).

    ``decreasing``: see :func:`minilm.pack`.
    """
    p = minilm.pack(ids, lengths, row_len=row_len, max_texts=row_len // 3, decreasing=decreasing)
    out = []
    for s in range(0, len(p.ids), rows):
        sl = slice(s, s + rows)
        n_rows = last_batch_rows(len(p.ids[sl]), rows, 8) if shrink_last else rows
        out.append(
            Batch(
                _fill(p.ids[sl], n_rows, 0),
                _fill(p.segment_ids[sl], n_rows, 0),
                _fill(p.position_ids[sl], n_rows, 0),
                _fill(p.text[sl], n_rows, -1),
            )
        )
    return out


def _fill(x: np.ndarray, rows: int, value: int) -> np.ndarray:
    """``x`` with rows of ``value`` appended up to ``rows`` rows."""
    pad = rows - len(x)
    return np.concatenate([x, np.full((pad, *x.shape[1:]), value, x.dtype)]) if pad else x


@dataclasses.dataclass(frozen=True, eq=False)
class EvalSet(TaskSet):
    """Texts of one or more tasks, tokenized and packed once (``__len__``, ``tokens``,
    ``slot_tokens``, ``rows``: :class:`passes.TaskSet`).

    Attributes:
      task_names: the tasks, in the order of the ``task`` indices.
      task: ``(N,)`` int32 task index of each text.
      labels: ``(N,)`` int32 label ids.
      lengths: ``(N,)`` tokens per text (after truncation to ``ROW_LEN``).
      batches: the packed forward calls (``text`` indexes into these N texts).
    """

    task_names: tuple[str, ...]
    task: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    batches: tuple[Batch, ...]
    ids: np.ndarray = dataclasses.field(repr=False)

    def only(self, task: int | str) -> EvalSet:
        """The texts of one task as an EvalSet of its own (the task keeps its name)."""
        i = self.task_index(task)
        r = self.rows(i)
        return _build(
            (self.task_names[i],), self.ids[r], self.lengths[r], np.zeros(len(r)), self.labels[r]
        )


def _build(names, ids, lengths, task, labels) -> EvalSet:
    ids = np.asarray(ids, np.int32)
    lengths = np.minimum(np.asarray(lengths, np.int32), ROW_LEN)
    return EvalSet(
        task_names=tuple(names),
        task=np.asarray(task, np.int32),
        labels=np.asarray(labels, np.int32),
        lengths=lengths,
        batches=tuple(packed_batches(ids, lengths, shrink_last=True)),
        ids=ids,
    )


def make_eval_set(task_names: Sequence[str], splits: Sequence[Any]) -> EvalSet:
    """Tokenize (at most :data:`ROW_LEN` tokens) and pack the splits of several tasks.

    Args:
      task_names: one name per split.
      splits: objects with ``texts`` and ``labels`` (``tasks.Split``), one per task.
    """
    if len(task_names) != len(splits):
        raise InputError(
            f"make_eval_set: {len(task_names)} task names for {len(splits)} splits; pass one "
            "name per split."
        )
    texts, task, labels = [], [], []
    for i, sp in enumerate(splits):
        texts += list(sp.texts)
        task += [i] * len(sp.texts)
        labels += list(np.asarray(sp.labels).tolist())
    if not texts:
        raise InputError("make_eval_set: the splits hold no texts.")
    ids, lengths = encode(texts)
    return _build(task_names, ids, lengths, task, labels)


# ------------------------------------------------------------------------------------ backbone


class Backbone(PassCounter):
    """The frozen base MiniLM, evaluated packed with a merged adapter folded into its kernels.

    ``embed(es, adapter, coef)`` returns the normalised sentence embedding of every text of
    ``es`` under ``W + coef * dK`` in every adapted kernel. One jitted forward serves every
    adapter and coefficient (the deltas and ``coef`` are arguments).

    Args:
      model: a :class:`minilm.MiniLM` without adapters (default :func:`minilm.load`).
    """

    def __init__(self, model: minilm.MiniLM | None = None):
        from flax import nnx

        self.model = minilm.load() if model is None else model
        if self.model.lora_rank is not None:
            raise InputError(
                "Backbone: the model has LoRA adapters; pass the base model (minilm.load()), "
                "adapters are folded into its kernels."
            )
        cfg = self.model.config
        self.targets = tuple(
            (i, name) for i in range(cfg.num_layers) for name in minilm.LORA_TARGETS
        )
        self.module_names = tuple(f"layers/{i}/attention/{n}" for i, n in self.targets)
        self.graphdef, self.state = nnx.split(self.model)
        graphdef, targets = self.graphdef, self.targets
        d = cfg.hidden_size
        self._zero = jnp.zeros((len(targets), d, d), jnp.float32)

        def pool(state, deltas, coef, ids, seg, pos):
            m = nnx.merge(graphdef, state)
            for k, (i, name) in enumerate(targets):
                lin = getattr(m.layers[i].attention, name)
                lin.kernel.set_value(lin.kernel.get_value() + coef * deltas[k])
            h = m(ids, seg > 0, segment_ids=seg, position_ids=pos)
            e = minilm.segment_mean_pool(h, seg, MAX_TEXTS)
            return e * jax.lax.rsqrt(jnp.sum(e * e, axis=-1, keepdims=True) + 1e-24)

        self._pool = jax.jit(pool)

    def deltas(self, adapter: Mapping[str, Any] | None) -> jax.Array:
        """``(modules, d, d)`` dense updates of ``adapter`` in :attr:`module_names` order.

        A module the adapter lacks (or None) adds nothing. Names not in the model are an error.
        """
        if adapter is None:
            return self._zero
        check_modules(
            "Backbone", adapter, self.module_names, noun="adapter modules",
            what="LoRA targets of the model",
        )  # fmt: skip
        out = np.zeros(self._zero.shape, np.float32)
        for k, name in enumerate(self.module_names):
            mod = adapter.get(name)
            if mod is not None:
                out[k] = module_delta(mod)
        return jnp.asarray(out)

    def embed(
        self,
        es: EvalSet,
        adapter: Mapping[str, Any] | None = None,
        coef: float = 1.0,
        *,
        deltas: jax.Array | None = None,
    ) -> np.ndarray:
        """Normalised embeddings ``(N, D)`` of ``es`` under the base model plus ``coef * adapter``.

        Pass ``deltas`` (from :meth:`deltas`) instead of ``adapter`` to reuse one merge's dense
        updates over several coefficients.
        """
        t0 = time.perf_counter()
        dk = self.deltas(adapter) if deltas is None else deltas
        c = jnp.asarray(coef, jnp.float32)
        pending = [
            (b.text, self._pool(self.state, dk, c, b.ids, b.segment_ids, b.position_ids))
            for b in es.batches
        ]
        return self.gather(pending, (len(es), self.model.config.hidden_size), es, t0)


# --------------------------------------------------------------------------------------- heads


class Head(NamedTuple):
    """A frozen zero-shot head: ``vectors (C, D)`` unit rows, one per label."""

    vectors: np.ndarray


def zero_shot_heads(backbone: Backbone, tasks: Sequence[Any]) -> list[Head]:
    """One head per task from the base model's embeddings of its ``label_texts``."""
    names, splits = [], []
    for t in tasks:
        names.append(t.name)
        splits.append(_Texts(tuple(t.label_texts), np.arange(len(t.label_texts))))
    es = make_eval_set(names, splits)
    emb = backbone.embed(es)
    heads = [Head(emb[es.rows(i)].copy()) for i in range(len(tasks))]
    for t, head in zip(tasks, heads, strict=True):
        _check_distinct(t, head)
    return heads


# two labels whose head vectors are this close (cosine) cannot be told apart by the head
_SAME_HEAD = 1.0 - 1e-6


def _check_distinct(task: Any, head: Head) -> None:
    """Refuse a task two of whose labels get the same zero-shot head vector: every text of one
    would be classified as the other, so the task trains and scores at chance whatever the
    merge does (and a normalized accuracy over such a model means nothing)."""
    v = np.asarray(head.vectors, np.float64)
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-30)
    sim = v @ v.T
    for i in range(len(v)):
        for j in range(i + 1, len(v)):
            if sim[i, j] >= _SAME_HEAD:
                labels, texts = list(task.labels), list(task.label_texts)
                raise InputError(
                    f"task {task.name!r}: the labels {labels[i]!r} and {labels[j]!r} get the same "
                    f"zero-shot head from the base model (cosine {sim[i, j]:.6f} between the "
                    f"embeddings of {texts[i]!r} and {texts[j]!r}): its tokenizer reads them as "
                    "the same tokens (characters outside its vocabulary, such as emoji, become "
                    "[UNK]; case is lowered), so the task could only be learned at chance. Give "
                    "the labels distinct words."
                )


class _Texts(NamedTuple):
    texts: tuple[str, ...]
    labels: np.ndarray


def logits(emb: np.ndarray, head: Head, temperature: float = TEMPERATURE) -> np.ndarray:
    """Cosine similarities of unit embeddings with the head's vectors, over the temperature."""
    return (np.asarray(emb, np.float32) @ np.asarray(head.vectors, np.float32).T) / temperature


def predict(emb: np.ndarray, heads: Sequence[Head], es: EvalSet) -> np.ndarray:
    """Predicted label of every text of ``es`` by the head of its own task, ``(N,)`` int32."""
    if len(heads) != len(es.task_names):
        raise InputError(
            f"predict: {len(heads)} heads for {len(es.task_names)} tasks; pass one head per task, "
            "in the EvalSet's task order."
        )
    pred = np.zeros(len(es), np.int32)
    for i, head in enumerate(heads):
        r = es.rows(i)
        if len(r):
            pred[r] = np.argmax(logits(emb[r], head), axis=-1)
    return pred


def correct(emb: np.ndarray, heads: Sequence[Head], es: EvalSet) -> np.ndarray:
    """``(N,)`` bool: whether each text is classified right by its own task's head."""
    return predict(emb, heads, es) == es.labels


# ---------------------------------------------------------------------------------- evaluator


class Evaluator(BackboneSearch):
    """Accuracies of single task LoRAs, of the zero-shot model and of merges, on val and test.

    Args:
      backbone: a :class:`Backbone`.
      adapters: one LoRA adapter per task, in ``val.task_names`` order.
      heads: one zero-shot :class:`Head` per task, same order.
      val: validation texts (coefficient search); test: test texts (reported once per merge).

    On construction: the single-LoRA correctness (each task's own adapter folded in, on that
    task's texts only) on val and test, whose accuracies are the normalizers, and the zero-shot
    (base model) correctness on test.
    """

    def __init__(
        self,
        backbone: Backbone,
        adapters: Sequence[Mapping[str, Any]],
        heads: Sequence[Head],
        val: EvalSet,
        test: EvalSet,
    ):
        self._hold(backbone, adapters, heads, val, test, who="Evaluator", unit="task")
        sv, st = self._single(val), self._single(test)
        zt = self.correct(test, None)
        self._hold_baselines(sv, st, self.correct(val, None), zt)

    _predictions = staticmethod(predict)
