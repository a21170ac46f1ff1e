"""Zero-shot heads, packed evaluation of MiniLM with folded merges, and the coefficient search.

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
costs no host work and never recompiles.

**Speed (CPU).** Texts are packed (:func:`minilm.pack`): several texts share a row of
:data:`ROW_LEN` tokens, each attending only to itself, with positions restarting per text, so no
compute goes to padding. Batches have one fixed shape (:data:`ROWS` x :data:`ROW_LEN`), so the
forward compiles once. Measured on the 2-core CPU (see ``benchmarks/demo_eval.py``).

**Normalized accuracy** (paper, "Evaluation"; KnOTS, Core Space): per task,
``100 * accuracy(merged) / accuracy(task's own LoRA)``, averaged over tasks.

**Coefficient search** (:func:`select_coef`): on validation only, over the grid
``{0.1, 0.2, ..., 9.9}`` of the Core Space code's linear search (step 0.1): a ladder of
doublings from a start point brackets the best region, then a hill climb in steps of 0.1 finds a
local optimum on that grid. Test labels are never seen.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError
from . import minilm
from .passes import PassCounter, TaskSet

__all__ = [
    "MAX_TEXTS",
    "ROWS",
    "ROW_LEN",
    "TEMPERATURE",
    "Backbone",
    "Batch",
    "CoefSearch",
    "EvalSet",
    "Evaluator",
    "Head",
    "MergeEval",
    "MergeSearch",
    "Normalized",
    "accuracies",
    "balanced_subset",
    "correct",
    "encode",
    "logits",
    "make_eval_set",
    "module_delta",
    "normalized_accuracy",
    "packed_batches",
    "predict",
    "select_coef",
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
    """One packed forward call: :class:`minilm.Packed` arrays of shape ``(ROWS, ROW_LEN)``."""

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
) -> list[Batch]:
    """Pack texts into rows and cut the rows into fixed-shape batches (empty rows fill the last).

    ``decreasing``: see :func:`minilm.pack`.
    """
    p = minilm.pack(ids, lengths, row_len=row_len, max_texts=row_len // 3, decreasing=decreasing)
    out = []
    for s in range(0, len(p.ids), rows):
        sl = slice(s, s + rows)
        out.append(
            Batch(
                _fill(p.ids[sl], rows, 0),
                _fill(p.segment_ids[sl], rows, 0),
                _fill(p.position_ids[sl], rows, 0),
                _fill(p.text[sl], rows, -1),
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
        batches=tuple(packed_batches(ids, lengths)),
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


def balanced_subset(split: Any, n: int | None) -> Any:
    """The first ``ceil(n / k)`` examples of each of the ``k`` labels, in split order.

    Returns the split itself when ``n`` is None or not smaller than it. The result has the type
    of ``tasks.Split`` (``texts``, ``labels``).
    """
    labels = np.asarray(split.labels)
    if n is None or n >= len(labels):
        return split
    k = max(int(labels.max()) + 1, 1)
    per = max(-(-n // k), 1)
    keep = np.sort(np.concatenate([np.flatnonzero(labels == c)[:per] for c in range(k)]))
    return type(split)(texts=tuple(split.texts[i] for i in keep), labels=labels[keep])


# ------------------------------------------------------------------------------------ backbone


def module_delta(mod: Mapping[str, Any]) -> np.ndarray:
    """A module's dense update in kernel layout, ``scale * lora_a @ lora_b`` or ``delta``."""
    if "delta" in mod:
        return np.asarray(mod["delta"], np.float32)
    a = np.asarray(mod["lora_a"], np.float32)
    b = np.asarray(mod["lora_b"], np.float32)
    return np.float32(mod.get("scale", 1.0)) * (a @ b)


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
        unknown = sorted(set(adapter) - set(self.module_names))
        if unknown:
            raise InputError(
                f"Backbone: adapter modules {unknown[:3]} (of {len(unknown)}) are not LoRA targets "
                f"of the model; expected names like {self.module_names[0]!r}."
            )
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


def accuracies(ok: np.ndarray, es: EvalSet) -> dict[str, float]:
    """Per-task accuracy ``{task: fraction correct}`` from a correctness vector."""
    return {name: float(ok[es.rows(i)].mean()) for i, name in enumerate(es.task_names)}


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
        raise InputError(
            f"normalized_accuracy: merged has tasks {sorted(merged)} but single has "
            f"{sorted(single)}; both need every task."
        )
    per = {}
    for t in single:
        if not single[t] > 0:
            raise InputError(
                f"normalized_accuracy: task {t!r} has single-LoRA accuracy {single[t]!r}; it must "
                "be > 0 to normalize by it."
            )
        per[t] = 100.0 * float(merged[t]) / float(single[t])
    return Normalized(per, float(np.mean(list(per.values()))))


# ---------------------------------------------------------------------------- coefficient search


class CoefSearch(NamedTuple):
    """Result of :func:`select_coef`: the winner and every candidate's validation score."""

    coef: float
    scores: dict[float, float]


def select_coef(
    score: Callable[[float], float],
    *,
    start: float = 1.0,
    step: float = 0.1,
    lo: float = 0.1,
    hi: float = 9.9,
) -> CoefSearch:
    """The best coefficient on the grid ``{lo, lo + step, ..., hi}``, by a bracket and a climb.

    1. **Ladder.** From ``start`` (snapped to the grid), candidates at doublings and halvings are
       scored, moving in the direction that improves, until a candidate is worse than the best
       so far on both sides (or the grid ends).
    2. **Bisection.** The best candidate and its ladder neighbours bracket the optimum; the wider
       side of the bracket is halved (on the grid) until the best candidate's grid neighbours
       have both been scored or lie outside the grid.

    The result is a local optimum on the grid (the resolution of the Core Space code's linear
    search, 0.1 from 0.1 to 9.9) after typically 6 to 10 scores; for a unimodal score it is the
    grid's best. Ties go to the earlier-scored candidate.

    Args:
      score: validation score of a coefficient (higher is better). It must not look at test data.
      start: first candidate (a method's usual coefficient).
      step, lo, hi: the grid.

    Example:
      >>> r = select_coef(lambda c: -(c - 0.7) ** 2, start=1.0)
      >>> r.coef, len(r.scores) <= 8
      (0.7, True)
    """
    if not (0 < lo <= hi and step > 0):
        raise InputError(f"select_coef: need 0 < lo <= hi and step > 0, got {lo}, {hi}, {step}")
    n = round((hi - lo) / step)

    def at(k: int) -> float:
        return round(lo + k * step, 10)

    def snap(c: float) -> int:
        return int(min(max(round((c - lo) / step), 0), n))

    seen: dict[int, float] = {}

    def value(k: int) -> float:
        if k not in seen:
            seen[k] = float(score(at(k)))
        return seen[k]

    def best() -> int:
        return max(seen, key=lambda k: (seen[k], -list(seen).index(k)))

    k0 = snap(start)
    value(k0)
    for factor in (2.0, 0.5):  # ladder: doublings; halvings only if doubling did not help
        k = k0
        while True:
            nk = snap(at(k) * factor)
            if nk == k:
                break
            value(nk)
            if best() != nk:
                break
            k = nk
        if best() != k0:
            break
    # bracket (l, m, r): m the best so far, l and r its ladder neighbours (or the grid's ends);
    # bisect the wider side until l, m, r are adjacent grid points
    m = best()
    lower = [j for j in seen if j < m]
    upper = [j for j in seen if j > m]
    left = max(lower) if lower else 0
    right = min(upper) if upper else n
    while m - left > 1 or right - m > 1:
        x = (left + m) // 2 if m - left >= right - m else (m + right + 1) // 2
        if value(x) > seen[m]:
            left, m, right = (left, x, m) if x < m else (m, x, right)
        else:
            left, right = (x, right) if x < m else (left, x)
    k = best()
    return CoefSearch(at(k), {at(j): v for j, v in sorted(seen.items())})


# ---------------------------------------------------------------------------------- evaluator


class MergeEval(NamedTuple):
    """Evaluation of one merged adapter.

    Attributes:
      coef: the coefficient chosen on validation.
      val_scores: ``{coef: mean normalized validation accuracy}`` of every candidate tried.
      val_normalized: the winner's mean normalized validation accuracy.
      test_correct: ``(N_test,)`` bool, each test text classified right (for the bootstrap).
      test_accuracy: ``{task: accuracy}`` on the test split, with ``coef``.
      test_normalized: normalized test accuracy (per task and mean).
    """

    coef: float
    val_scores: dict[float, float]
    val_normalized: float
    test_correct: np.ndarray
    test_accuracy: dict[str, float]
    test_normalized: Normalized


class MergeSearch:
    """Evaluation of a merge, shared by both suites' evaluators: the coefficient chosen on
    validation (:func:`select_coef`), then one test pass.

    A subclass provides ``val``, ``test``, ``single_val``, ``single_test``, ``correct(es,
    adapter, coef, *, deltas=)`` and ``deltas(adapter)`` (the merge's updates, computed once and
    reused over every coefficient tried).
    """

    def val_score(self, deltas: Any, coef: float) -> float:
        """Mean normalized validation accuracy of the merge whose updates are ``deltas``."""
        acc = accuracies(self.correct(self.val, None, coef, deltas=deltas), self.val)
        return normalized_accuracy(acc, self.single_val).mean

    def choose(
        self, adapter: Mapping[str, Any], *, start: float = 1.0, coef: float | None = None
    ) -> tuple[Any, CoefSearch]:
        """The validation half of :meth:`evaluate`: ``(the merge's updates, the coefficient
        search)``; no test text is looked at (options searched on validation compare these)."""
        dk = self.deltas(adapter)
        if coef is None:
            return dk, select_coef(lambda c: self.val_score(dk, c), start=start)
        return dk, CoefSearch(float(coef), {float(coef): self.val_score(dk, coef)})

    def test_of(self, deltas: Any, search: CoefSearch) -> MergeEval:
        """The test half of :meth:`evaluate`: one test pass at the chosen coefficient."""
        ok = self.correct(self.test, None, search.coef, deltas=deltas)
        test_acc = accuracies(ok, self.test)
        return MergeEval(
            coef=search.coef,
            val_scores=search.scores,
            val_normalized=search.scores[search.coef],
            test_correct=ok,
            test_accuracy=test_acc,
            test_normalized=normalized_accuracy(test_acc, self.single_test),
        )

    def evaluate(
        self, adapter: Mapping[str, Any], *, start: float = 1.0, coef: float | None = None
    ) -> MergeEval:
        """Choose ``coef`` on validation (:func:`select_coef`), then evaluate the test split once.

        ``coef`` given: no search, that coefficient (e.g. the weight average, ``1 / M``).
        """
        return self.test_of(*self.choose(adapter, start=start, coef=coef))


class Evaluator(MergeSearch):
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
        if val.task_names != test.task_names:
            raise InputError(
                f"Evaluator: validation tasks {val.task_names} differ from test tasks "
                f"{test.task_names}."
            )
        if not len(adapters) == len(heads) == len(val.task_names):
            raise InputError(
                f"Evaluator: {len(adapters)} adapters and {len(heads)} heads for "
                f"{len(val.task_names)} tasks; pass one of each per task."
            )
        self.backbone, self.adapters, self.heads = backbone, list(adapters), list(heads)
        self.val, self.test = val, test
        self.task_names = val.task_names
        self.single_val_correct = self._single(val)
        self.single_test_correct = self._single(test)
        self.single_val = accuracies(self.single_val_correct, val)
        self.single_test = accuracies(self.single_test_correct, test)
        self.zero_shot_test_correct = self.correct(test, None)
        self.zero_shot_val = accuracies(self.correct(val, None), val)
        self.zero_shot_test = accuracies(self.zero_shot_test_correct, test)

    def _single(self, es: EvalSet) -> np.ndarray:
        ok = np.zeros(len(es), bool)
        for i in range(len(self.task_names)):
            sub = es.only(i)
            emb = self.backbone.embed(sub, self.adapters[i])
            ok[es.rows(i)] = correct(emb, [self.heads[i]], sub)
        return ok

    def correct(
        self, es: EvalSet, adapter: Mapping[str, Any] | None, coef: float = 1.0, *, deltas=None
    ) -> np.ndarray:
        """``(N,)`` bool correctness on ``es`` of the backbone plus ``coef * adapter``."""
        return correct(self.backbone.embed(es, adapter, coef, deltas=deltas), self.heads, es)

    def deltas(self, adapter: Mapping[str, Any]) -> jax.Array:
        """The dense updates of ``adapter`` (:meth:`Backbone.deltas`)."""
        return self.backbone.deltas(adapter)
