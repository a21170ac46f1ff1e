"""What every suite's evaluation shares: normalized accuracy and the coefficient search.

**Normalized accuracy** (paper, "Evaluation"; KnOTS, Core Space): per task,
``100 * accuracy(merged) / accuracy(task's own LoRA)``, averaged over tasks.

**Coefficient search** (:func:`select_coef`): on validation only, over the grid
``{0.1, 0.2, ..., 9.9}`` of the Core Space code's linear search (step 0.1): a ladder of
doublings from a start point brackets the best region, then a hill climb in steps of 0.1 finds a
local optimum on that grid. Test labels are never seen.

**Evaluation of a merge** (:class:`MergeSearch`): the coefficient chosen on validation, then one
test pass; each suite's evaluator subclasses it (``encoder_eval.Evaluator`` for the encoder,
``lang_eval``, ``vision``, ``nli_head`` for the others), the encoder's and the vision suite's
through :class:`BackboneSearch` (a backbone that embeds, a head per task that reads).

Part of the harness: no model or suite is imported here. The encoder's evaluation (MiniLM, its
zero-shot heads, ``Backbone``, ``Evaluator``, ``EvalSet``, ...) is the encoder suite's,
:mod:`netutility_jax.experiments.suites.encoder_eval`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError
from .passes import TaskSet

__all__ = [
    "BackboneSearch",
    "CoefSearch",
    "MergeEval",
    "MergeSearch",
    "Normalized",
    "accuracies",
    "balanced_subset",
    "check_modules",
    "module_delta",
    "normalized_accuracy",
    "select_coef",
]


def check_modules(
    who: str, adapter: Mapping[str, Any], names: Sequence[str], *, noun: str, what: str
) -> None:
    """Refuse an adapter with modules not in ``names`` (a backbone's adapted modules): the
    message names ``who``, the first three (``noun``, e.g. ``"adapter modules"``) and ``what``
    the known ones are.

    Raises:
      InputError: a module not in ``names``.
    """
    unknown = sorted(set(adapter) - set(names))
    if unknown:
        raise InputError(
            f"{who}: {noun} {unknown[:3]} (of {len(unknown)}) are not {what}; expected names "
            f"like {names[0]!r}."
        )


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


def module_delta(mod: Mapping[str, Any]) -> np.ndarray:
    """A module's dense update in kernel layout, ``scale * lora_a @ lora_b`` or ``delta``."""
    if "delta" in mod:
        return np.asarray(mod["delta"], np.float32)
    a = np.asarray(mod["lora_a"], np.float32)
    b = np.asarray(mod["lora_b"], np.float32)
    return np.float32(mod.get("scale", 1.0)) * (a @ b)


# ------------------------------------------------------------------------------------ accuracy


def accuracies(ok: np.ndarray, es: TaskSet) -> dict[str, float]:
    """Per-task accuracy ``{task: fraction correct}`` from a correctness vector over the
    examples of ``es`` (a ``passes.TaskSet``: ``encoder_eval.EvalSet``, a prompt set, ...)."""
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


class BackboneSearch(MergeSearch):
    """A :class:`MergeSearch` whose backbone embeds an evaluation set under an adapter and whose
    heads, one per task, read the embeddings: the encoder's and the vision suite's evaluators.

    A subclass provides ``_predictions(emb, heads, es)``, the ``(N,)`` predicted labels of the
    embeddings ``emb`` of ``es`` (each row by its own task's head), and calls :meth:`_hold` then
    :meth:`_hold_baselines` on construction.
    """

    def _hold(
        self, backbone: Any, adapters: Sequence[Any], heads: Sequence[Any], val: Any, test: Any,
        *, who: str, unit: str,
    ) -> None:  # fmt: skip
        """Check and keep the evaluator's arguments: one adapter and one head per task of
        ``val``, the same tasks in ``test`` (``who`` and ``unit``, ``"task"``, name them in
        messages)."""
        if val.task_names != test.task_names:
            raise InputError(
                f"{who}: validation {unit}s {val.task_names} differ from test {unit}s "
                f"{test.task_names}."
            )
        if not len(adapters) == len(heads) == len(val.task_names):
            raise InputError(
                f"{who}: {len(adapters)} adapters and {len(heads)} heads for "
                f"{len(val.task_names)} {unit}s; pass one of each per {unit}."
            )
        self.backbone, self.adapters, self.heads = backbone, list(adapters), list(heads)
        self.val, self.test = val, test
        self.task_names = val.task_names

    def _hold_baselines(self, sv: Any, st: Any, zv: Any, zt: Any) -> None:
        """Keep the single-adapter correctness on val and test (``sv``, ``st``: the
        normalizers) and the zero-shot one (``zv``, ``zt``), and their accuracies."""
        self.single_val_correct, self.single_test_correct = sv, st
        self.single_val = accuracies(sv, self.val)
        self.single_test = accuracies(st, self.test)
        self.zero_shot_test_correct = zt
        self.zero_shot_val = accuracies(zv, self.val)
        self.zero_shot_test = accuracies(zt, self.test)

    def _single(self, es: Any) -> np.ndarray:
        """Each task's own adapter folded in, on that task's rows only."""
        ok = np.zeros(len(es), bool)
        for i in range(len(self.task_names)):
            sub = es.only(i)
            emb = self.backbone.embed(sub, self.adapters[i])
            ok[es.rows(i)] = self._predictions(emb, [self.heads[i]], sub) == sub.labels
        return ok

    def correct(
        self, es: Any, adapter: Mapping[str, Any] | None, coef: float = 1.0, *, deltas=None
    ) -> np.ndarray:
        """``(N,)`` bool: each row of ``es`` classified right by its own task's head under the
        backbone plus ``coef * adapter`` (or its dense updates ``deltas``)."""
        emb = self.backbone.embed(es, adapter, coef, deltas=deltas)
        return self._predictions(emb, self.heads, es) == es.labels

    def deltas(self, adapter: Mapping[str, Any]) -> Any:
        """The dense updates of ``adapter`` (the backbone's ``deltas``)."""
        return self.backbone.deltas(adapter)
