"""Accuracy of task LoRAs and of their merges on MiniLM, normalized accuracy, coefficient search.

A merged adapter is evaluated as it would be served: folded into the base kernels
(``W + coef * dK``, :func:`minilm.fold_adapter`), no LoRA branch. Every text is embedded once per
merged model (mean-pooled last hidden states of one shared backbone) and each task's own linear
head classifies its own texts: ``argmax(pooled @ kernel + bias)``.

Normalized accuracy (paper, "Evaluation"; KnOTS, Core Space): per task,
``100 * accuracy(merged) / accuracy(task's own LoRA)``, averaged over tasks.

Speed (CPU): texts of all tasks are tokenized once, sorted by length and cut into batches of
``batch_size`` texts, each padded only to its own longest text rounded up to a multiple of 8
(:func:`bucket_length`). A backbone has one jitted forward; it compiles once per padded length
(at most ``max_len / 8`` shapes) and never again for a new adapter or coefficient, since the
folded kernels are arguments, not constants.

The merge coefficient is chosen on the validation split only (:meth:`Evaluator.evaluate`): the
candidates are scored by mean normalized validation accuracy, and the test split is evaluated
once, with the winner. Every merge method here is linear in its coefficient
(``merge(coef=c) == c * merge(coef=1)``), so a configuration is merged once and each candidate is
a fold with another ``coef``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from . import minilm

EVAL_BATCH = 32


def bucket_length(n: int, *, max_len: int, step: int = 8, coarse_from: int | None = None) -> int:
    """Padded length of a batch whose longest text has ``n`` tokens.

    Rounded up to a multiple of ``step`` (to a multiple of ``2 * step`` above ``coarse_from``, if
    given: fewer shapes, fewer compiles) and capped at ``max_len``.

    Example:
      >>> [bucket_length(n, max_len=64) for n in (1, 8, 9, 30, 70)]
      [8, 8, 16, 32, 64]
      >>> [bucket_length(n, max_len=64, coarse_from=16) for n in (9, 17, 33, 49)]
      [16, 32, 48, 64]
    """
    n = max(int(n), 1)
    if coarse_from is not None and n > coarse_from:
        big = 2 * step
        out = coarse_from + -(-(n - coarse_from) // big) * big
    else:
        out = -(-n // step) * step
    return int(min(out, max_len))


def encode(texts: Sequence[str], *, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids ``(N, T)`` (``T`` the longest text, at most ``max_len``) and lengths ``(N,)``."""
    tok = minilm.tokenize(list(texts), max_length=max_len, pad_to_max_length=False)
    return tok.ids, tok.mask.sum(axis=1).astype(np.int32)


class Head(NamedTuple):
    """A linear classification head on the pooled embedding: ``kernel (D, C)``, ``bias (C,)``."""

    kernel: np.ndarray
    bias: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class EvalSet:
    """Texts of one or more tasks, tokenized once and cut into length-sorted batches.

    Attributes:
      task_names: the tasks, in the order of the ``task`` indices.
      ids: ``(N, T)`` int32 token ids (zero-padded).
      lengths: ``(N,)`` tokens per text.
      task: ``(N,)`` int32 index into ``task_names``.
      labels: ``(N,)`` int32 label ids.
      batches: ``(rows, padded_length)`` per batch; rows are sorted by length.
    """

    task_names: tuple[str, ...]
    ids: np.ndarray
    lengths: np.ndarray
    task: np.ndarray
    labels: np.ndarray
    batch_size: int
    max_len: int
    batches: tuple[tuple[np.ndarray, int], ...]

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def padded_tokens(self) -> int:
        """Tokens one pass processes, padding included (the cost of a pass)."""
        return int(sum(self.batch_size * length for _, length in self.batches))

    def rows(self, task: int | str) -> np.ndarray:
        """Indices of the texts of one task."""
        i = self.task_names.index(task) if isinstance(task, str) else int(task)
        return np.flatnonzero(self.task == i)

    def only(self, task: int | str) -> EvalSet:
        """The texts of one task as an EvalSet of its own (the task keeps its name)."""
        i = self.task_names.index(task) if isinstance(task, str) else int(task)
        r = self.rows(i)
        return _build(
            (self.task_names[i],),
            self.ids[r],
            self.lengths[r],
            np.zeros(r.shape, np.int32),
            self.labels[r],
            batch_size=self.batch_size,
            max_len=self.max_len,
        )


def _build(names, ids, lengths, task, labels, *, batch_size, max_len) -> EvalSet:
    order = np.argsort(lengths, kind="stable")
    batches = []
    for s in range(0, len(order), batch_size):
        rows = order[s : s + batch_size]
        batches.append((rows, bucket_length(int(lengths[rows].max()), max_len=max_len)))
    return EvalSet(
        task_names=tuple(names),
        ids=np.asarray(ids, np.int32),
        lengths=np.asarray(lengths, np.int32),
        task=np.asarray(task, np.int32),
        labels=np.asarray(labels, np.int32),
        batch_size=int(batch_size),
        max_len=int(max_len),
        batches=tuple(batches),
    )


def make_eval_set(
    task_names: Sequence[str],
    splits: Sequence[Any],
    *,
    max_len: int,
    batch_size: int = EVAL_BATCH,
) -> EvalSet:
    """Tokenize the splits of several tasks into one length-sorted :class:`EvalSet`.

    Args:
      task_names: one name per split.
      splits: objects with ``texts`` and ``labels`` (``tasks.Split``), one per task.
      max_len: truncation length in tokens (``[CLS]`` and ``[SEP]`` included).
      batch_size: texts per batch.
    """
    if len(task_names) != len(splits):
        raise ValueError(
            f"make_eval_set: {len(task_names)} task names for {len(splits)} splits; pass one "
            "name per split."
        )
    texts, task, labels = [], [], []
    for i, sp in enumerate(splits):
        texts += list(sp.texts)
        task += [i] * len(sp.texts)
        labels += list(np.asarray(sp.labels).tolist())
    if not texts:
        raise ValueError("make_eval_set: the splits hold no texts.")
    ids, lengths = encode(texts, max_len=max_len)
    return _build(task_names, ids, lengths, task, labels, batch_size=batch_size, max_len=max_len)


def balanced_subset(split: Any, n: int | None) -> Any:
    """The first ``n // k`` examples of each of the ``k`` labels, in split order (deterministic).

    Returns the split itself when ``n`` is None or not smaller than it. The result has the type
    of ``tasks.Split`` (``texts``, ``labels``).
    """
    labels = np.asarray(split.labels)
    if n is None or n >= len(labels):
        return split
    k = max(int(labels.max()) + 1, 1)
    per = max(n // k, 1)
    keep = np.sort(np.concatenate([np.flatnonzero(labels == c)[:per] for c in range(k)]))
    return type(split)(texts=tuple(split.texts[i] for i in keep), labels=labels[keep])


def embed(pool: Callable[[np.ndarray, np.ndarray], Any], es: EvalSet) -> np.ndarray:
    """Pooled embeddings ``(N, D)`` of every text of ``es``, in ``es`` order.

    ``pool(ids, mask)`` maps a ``(B, L)`` batch to ``(B, D)``; every batch has ``B =
    es.batch_size`` rows (a short last batch is filled with copies of its last text, whose outputs
    are dropped) and ``L`` a multiple of 8, so a jitted ``pool`` compiles once per length.
    """
    out: np.ndarray | None = None
    pending: list[tuple[np.ndarray, Any]] = []
    for rows, length in es.batches:
        n = len(rows)
        fill = (
            np.concatenate([rows, np.full(es.batch_size - n, rows[-1])])
            if n < es.batch_size
            else rows
        )
        ids = np.zeros((es.batch_size, length), np.int32)
        width = min(length, es.ids.shape[1])
        ids[:, :width] = es.ids[fill, :width]
        mask = (np.arange(length)[None, :] < es.lengths[fill][:, None]).astype(np.int32)
        pending.append((rows, pool(ids, mask)))
    for rows, e in pending:
        e = np.asarray(jax.block_until_ready(e), np.float32)
        if out is None:
            out = np.zeros((len(es), e.shape[-1]), np.float32)
        out[rows] = e[: len(rows)]
    if out is None:
        raise ValueError("embed: the EvalSet has no texts.")
    return out


def logits(emb: np.ndarray, head: Head) -> np.ndarray:
    """``emb @ kernel + bias`` in float32."""
    return np.asarray(emb, np.float32) @ np.asarray(head.kernel, np.float32) + np.asarray(
        head.bias, np.float32
    )


def predict(emb: np.ndarray, heads: Sequence[Head], es: EvalSet) -> np.ndarray:
    """Predicted label of every text of ``es`` by the head of its own task, ``(N,)`` int32."""
    if len(heads) != len(es.task_names):
        raise ValueError(
            f"predict: {len(heads)} heads for {len(es.task_names)} tasks; pass one head per task, "
            "in the EvalSet's task order."
        )
    pred = np.zeros(len(es), np.int32)
    for i, head in enumerate(heads):
        r = es.rows(i)
        if len(r):
            pred[r] = np.argmax(logits(emb[r], head), axis=-1)
    return pred


def accuracies(emb: np.ndarray, heads: Sequence[Head], es: EvalSet) -> dict[str, float]:
    """Accuracy of each task's head on its own texts: ``{task: fraction correct}``."""
    correct = predict(emb, heads, es) == es.labels
    return {name: float(correct[es.rows(i)].mean()) for i, name in enumerate(es.task_names)}


class Normalized(NamedTuple):
    """Normalized accuracy: ``per_task[t] = 100 * merged[t] / single[t]``; ``mean`` over tasks."""

    per_task: dict[str, float]
    mean: float


def normalized_accuracy(merged: Mapping[str, float], single: Mapping[str, float]) -> Normalized:
    """``100 * merged / single`` per task and its mean over tasks (the paper's metric).

    Example:
      >>> n = normalized_accuracy({"a": 0.45, "b": 0.8}, {"a": 0.9, "b": 0.8})
      >>> n.per_task, n.mean
      ({'a': 50.0, 'b': 100.0}, 75.0)
    """
    if set(merged) != set(single):
        raise ValueError(
            f"normalized_accuracy: merged has tasks {sorted(merged)} but single has "
            f"{sorted(single)}; both need every task."
        )
    per = {}
    for t in single:
        if not single[t] > 0:
            raise ValueError(
                f"normalized_accuracy: task {t!r} has single-LoRA accuracy {single[t]!r}; it must "
                "be > 0 to normalize by it."
            )
        per[t] = 100.0 * float(merged[t]) / float(single[t])
    return Normalized(per, float(np.mean(list(per.values()))))


class CoefSearch(NamedTuple):
    """Result of :func:`select_coef`: the winner and every candidate's validation score."""

    coef: float
    scores: dict[float, float]


def _round(c: float) -> float:
    return float(f"{c:.4g}")


def select_coef(
    score: Callable[[float], float],
    coefs: Sequence[float],
    *,
    extend: int = 2,
    refine: int = 0,
) -> CoefSearch:
    """Pick the coefficient with the best score on a geometric grid, widened and refined.

    1. The candidates ``coefs`` are scored.
    2. While the best lies on the grid's edge (at most ``extend`` times), one more candidate is
       scored one grid ratio beyond that edge (``c_max * c_max / c_prev`` or
       ``c_min * c_min / c_next``).
    3. ``refine`` times, the geometric midpoint between the best and its better neighbour is
       scored.

    Ties go to the candidate closest to 1, then to the smaller one. New candidates are rounded to
    4 significant digits.

    Args:
      score: validation score of a coefficient (higher is better). It must not look at test data.
      coefs: initial candidates (positive), e.g. ``(0.25, 0.5, 1.0)``.
      extend: at most this many candidates beyond the grid's edges.
      refine: this many midpoints.

    Example:
      >>> select_coef(lambda c: -(c - 2.0) ** 2, [0.5, 1.0]).coef
      2.0
      >>> r = select_coef(lambda c: -(c - 0.7) ** 2, [0.25, 0.5, 1.0], refine=1)
      >>> r.coef, sorted(r.scores)
      (0.7071, [0.25, 0.5, 0.7071, 1.0])
    """
    grid = sorted({float(c) for c in coefs})
    if not grid or grid[0] <= 0:
        raise ValueError(f"select_coef: coefs={list(coefs)!r}; expected positive candidates.")
    scores = {c: float(score(c)) for c in grid}
    up = grid[-1] / grid[-2] if len(grid) > 1 else 2.0
    down = grid[1] / grid[0] if len(grid) > 1 else 2.0

    def best() -> float:
        return min(scores, key=lambda c: (-scores[c], abs(c - 1.0), c))

    for _ in range(extend):
        b, cs = best(), sorted(scores)
        if b == cs[-1]:
            new = _round(cs[-1] * up)
        elif b == cs[0]:
            new = _round(cs[0] / down)
        else:
            break
        scores[new] = float(score(new))
    for _ in range(refine):
        b, cs = best(), sorted(scores)
        i = cs.index(b)
        nbrs = [cs[j] for j in (i - 1, i + 1) if 0 <= j < len(cs)]
        if not nbrs:
            break
        nb = min(nbrs, key=lambda c: (-scores[c], abs(c - 1.0), c))
        new = _round(float(np.sqrt(b * nb)))
        if new in scores:
            break
        scores[new] = float(score(new))
    return CoefSearch(best(), dict(sorted(scores.items())))


class Backbone:
    """The frozen base MiniLM (no LoRA branch) that merged adapters are folded into.

    ``embed(es, adapter, coef)`` is one jitted pooled forward over ``es`` with
    ``W + coef * dK`` in every adapted kernel; compiles once per padded batch length.

    Args:
      model: a :class:`minilm.MiniLM` without adapters (default :func:`minilm.load`).
    """

    def __init__(self, model: minilm.MiniLM | None = None):
        from flax import nnx

        self.model = minilm.load() if model is None else model
        if self.model.lora_rank is not None:
            raise ValueError(
                "Backbone: the model has LoRA adapters; pass the base model (minilm.load()), "
                "adapters are folded into its kernels."
            )
        self.graphdef, self.state = nnx.split(self.model)
        graphdef = self.graphdef

        def pool(state, ids, mask):
            m = nnx.merge(graphdef, state)
            return minilm.mean_pool(m(ids, mask), mask)

        self._pool = jax.jit(pool)
        self.passes = 0
        self.tokens = 0
        self.seconds = 0.0

    def state_with(self, adapter: Mapping[str, Any] | None, coef: float = 1.0) -> Any:
        """The model state with ``adapter`` folded in (``W + coef * dK``); base state for None."""
        from flax import nnx

        if adapter is None:
            return self.state
        return nnx.state(minilm.fold_adapter(self.model, adapter, coef=coef))

    def embed(
        self, es: EvalSet, adapter: Mapping[str, Any] | None = None, coef: float = 1.0
    ) -> np.ndarray:
        """Pooled embeddings ``(N, D)`` of ``es`` under the base model plus ``coef * adapter``."""
        t0 = time.perf_counter()
        state = self.state_with(adapter, coef)
        out = embed(lambda ids, mask: self._pool(state, ids, mask), es)
        self.passes += 1
        self.tokens += es.padded_tokens
        self.seconds += time.perf_counter() - t0
        return out


class MergeEval(NamedTuple):
    """Evaluation of one merged adapter.

    Attributes:
      coef: the coefficient chosen on validation.
      val_scores: ``{coef: mean normalized validation accuracy}`` of every candidate tried.
      val_normalized: the winner's mean normalized validation accuracy.
      test_accuracy: ``{task: accuracy}`` on the test split, with ``coef``.
      test_normalized: normalized test accuracy (per task and mean).
    """

    coef: float
    val_scores: dict[float, float]
    val_normalized: float
    test_accuracy: dict[str, float]
    test_normalized: Normalized


class Evaluator:
    """Accuracies of single task LoRAs and of merges, on a validation and a test :class:`EvalSet`.

    Args:
      backbone: a :class:`Backbone` (or any object with ``embed(es, adapter=None, coef=1.0)``).
      adapters: one LoRA adapter per task, in ``val.task_names`` order.
      heads: one :class:`Head` per task, same order.
      val: validation texts (coefficient search); test: test texts (reported once per merge).

    The single-LoRA accuracies (the normalizers) are computed on construction: each task's own
    adapter folded in, on that task's texts only.
    """

    def __init__(
        self,
        backbone: Any,
        adapters: Sequence[Mapping[str, Any]],
        heads: Sequence[Head],
        val: EvalSet,
        test: EvalSet,
    ):
        if val.task_names != test.task_names:
            raise ValueError(
                f"Evaluator: validation tasks {val.task_names} differ from test tasks "
                f"{test.task_names}."
            )
        if not len(adapters) == len(heads) == len(val.task_names):
            raise ValueError(
                f"Evaluator: {len(adapters)} adapters and {len(heads)} heads for "
                f"{len(val.task_names)} tasks; pass one of each per task."
            )
        self.backbone, self.adapters, self.heads = backbone, list(adapters), list(heads)
        self.val, self.test = val, test
        self.task_names = val.task_names
        self.single_val = self._single(val)
        self.single_test = self._single(test)

    def _single(self, es: EvalSet) -> dict[str, float]:
        out = {}
        for i, name in enumerate(self.task_names):
            sub = es.only(i)
            emb = self.backbone.embed(sub, self.adapters[i])
            out[name] = accuracies(emb, [self.heads[i]], sub)[name]
        return out

    def accuracy(
        self, es: EvalSet, adapter: Mapping[str, Any] | None, coef: float = 1.0
    ) -> dict[str, float]:
        """Per-task accuracy on ``es`` of the backbone plus ``coef * adapter`` (None: base)."""
        return accuracies(self.backbone.embed(es, adapter, coef), self.heads, es)

    def val_score(self, adapter: Mapping[str, Any], coef: float) -> float:
        """Mean normalized validation accuracy of ``coef * adapter``."""
        acc = self.accuracy(self.val, adapter, coef)
        return normalized_accuracy(acc, self.single_val).mean

    def evaluate(
        self,
        adapter: Mapping[str, Any],
        coefs: Sequence[float],
        *,
        extend: int = 2,
        refine: int = 0,
    ) -> MergeEval:
        """Choose ``coef`` on validation (:func:`select_coef`), then evaluate the test split once."""
        search = select_coef(
            lambda c: self.val_score(adapter, c), coefs, extend=extend, refine=refine
        )
        test_acc = self.accuracy(self.test, adapter, search.coef)
        return MergeEval(
            coef=search.coef,
            val_scores=search.scores,
            val_normalized=search.scores[search.coef],
            test_accuracy=test_acc,
            test_normalized=normalized_accuracy(test_acc, self.single_test),
        )
