"""The NLI head formulation's evaluation (:mod:`nli_head`): the scorer and the evaluator.

A merged adapter is folded into the base kernels once per coefficient (``lang_eval.Scorer``'s
fold: no LoRA branch runs), the pairs of every task go through jitted batches sorted by length
(:class:`nli_head_data.NLISet`), and **each task is read by its own trained head** (the heads are
stacked; each row picks its task's). The single-LoRA accuracies (each task's adapter and head)
are the normalizers; the "zero-shot" floor is the base model with each task's trained head and
no LoRA.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError
from ..harness import evaluate as ev
from ..harness.passes import PassCounter
from ..models import llama
from . import lang_eval as le
from .nli_head_data import NLISet
from .nli_head_model import CODE_VERSION, class_logits, num_classes, pool_last, used_mask

__all__ = [
    "Evaluator",
    "Scorer",
]


class Scorer(PassCounter):
    """The frozen base decoder with a classification head per task; merges folded into the
    kernels (``lang_eval.Scorer``'s fold), pairs pooled at their last token, each row read by its
    own task's head.

    Args:
      model: a :class:`llama.Llama` without adapters.

    Attributes:
      model, module_names: the model and the adapter module names it takes.
      passes, tokens, slot_tokens, seconds: work done so far.
    """

    def __init__(self, model: llama.Llama):
        self.folder = le.Scorer(model)
        self.model = model
        self.module_names = self.folder.module_names
        graphdef = self.folder.graphdef

        def pool(kernels, rest, ids, mask):
            m = nnx.merge(graphdef, kernels, rest)
            return pool_last(m.hidden_states(ids, mask), mask)

        self._pool = jax.jit(pool)
        self._classify = jax.jit(class_logits)

    def deltas(self, adapter: Mapping[str, Any] | None) -> Any:
        """The dense updates of ``adapter`` shaped like the adapted kernels
        (``lang_eval.Scorer.deltas``)."""
        return self.folder.deltas(adapter)

    def logits(
        self,
        ds: NLISet,
        scores: Any,
        used: Any,
        adapter: Mapping[str, Any] | None = None,
        coef: float = 1.0,
        *,
        deltas: Any = None,
    ) -> np.ndarray:
        """``(N, C)`` float32 masked logits of every pair of ``ds`` under the base model plus
        ``coef * adapter`` (or ``coef * deltas``), each read by its head.

        Args:
          ds: the pairs.
          scores: ``(T, D, C)`` the stacked heads (``ds.head`` indexes them).
          used: ``(T, C)`` bool, the classes each head uses.
          adapter, coef, deltas: the update folded into the kernels (None: the base model).
        """
        t0 = time.perf_counter()
        if deltas is None and adapter is None:
            kernels = self.folder.kernels
        else:
            kernels = self.folder.fold(self.deltas(adapter) if deltas is None else deltas, coef)
        scores = jnp.asarray(scores, jnp.float32)
        used = jnp.asarray(used, bool)
        pending = []
        for b in ds.batches:
            pooled = self._pool(kernels, self.folder.rest, b.ids, b.mask)
            head = jnp.asarray(np.where(b.index >= 0, ds.head[np.maximum(b.index, 0)], 0))
            pending.append((b.index, self._classify(pooled, scores, head, used)))
        return self.gather(pending, (len(ds), int(scores.shape[-1])), ds, t0)

    def correct(
        self, ds: NLISet, scores, used, adapter=None, coef: float = 1.0, **kw
    ) -> np.ndarray:
        """``(N,)`` bool: each pair classified right (argmax of its masked logits)."""
        return np.argmax(self.logits(ds, scores, used, adapter, coef, **kw), axis=1) == ds.labels


# --------------------------------------------------------------------------------- evaluator


class Evaluator(ev.MergeSearch):
    """Single-LoRA, zero-shot (trained heads, no LoRA) and merged accuracies on val and test,
    with the interface of ``encoder_eval.Evaluator`` (the coefficient search is
    ``evaluate.MergeSearch``); each task is always read by its own trained head.

    Args:
      scorer: a :class:`Scorer`.
      adapters: one LoRA adapter per task, in ``val.task_names`` order.
      scores: one head ``(D, C)`` per task, same order.
      val, test: :class:`NLISet` of the same tasks.
      cache_dir: where single and zero-shot correctness are cached (None: not cached).
      adapter_keys: one training cache key per task (needed to cache).
      weights: the model's fingerprint (default computed when caching).
    """

    def __init__(
        self,
        scorer: Scorer,
        adapters: Sequence[Mapping[str, Any]],
        scores: Sequence[Any],
        val: NLISet,
        test: NLISet,
        *,
        cache_dir: str | os.PathLike | None = None,
        adapter_keys: Sequence[str] | None = None,
        weights: str | None = None,
    ):
        if val.task_names != test.task_names:
            raise InputError(
                f"nli_head.Evaluator: validation tasks {val.task_names} differ from test tasks "
                f"{test.task_names}."
            )
        n = len(val.task_names)
        if not len(adapters) == len(scores) == n:
            raise InputError(
                f"nli_head.Evaluator: {len(adapters)} adapters and {len(scores)} heads for {n} "
                "tasks; pass one of each per task, in the sets' task order."
            )
        if adapter_keys is not None and len(adapter_keys) != n:
            raise InputError(f"nli_head.Evaluator: {len(adapter_keys)} adapter keys for {n} tasks.")
        c = num_classes(val.heads)
        shapes = sorted({np.shape(s) for s in scores})
        if shapes != [(scorer.model.config.hidden_size, c)]:
            raise InputError(
                f"nli_head.Evaluator: heads of shape {', '.join(map(str, shapes))}; expected "
                f"({scorer.model.config.hidden_size}, {c}) (hidden size x classes)."
            )
        stacked = np.stack([np.asarray(s, np.float32) for s in scores])
        self.scorer, self.adapters = scorer, list(adapters)
        self.scores = jnp.asarray(stacked)
        self.used = jnp.asarray(used_mask(val.heads))
        self.val, self.test, self.task_names = val, test, val.task_names
        if cache_dir is not None and weights is None:
            weights = le.model_fingerprint(scorer.model)
        self._cache, self._keys, self._weights = cache_dir, adapter_keys, weights
        self.single_val_correct = self._per_task(val, "single")
        self.single_test_correct = self._per_task(test, "single")
        self.single_val = ev.accuracies(self.single_val_correct, val)
        self.single_test = ev.accuracies(self.single_test_correct, test)
        zs_val = self._per_task(val, "zero_shot_head")
        self.zero_shot_test_correct = self._per_task(test, "zero_shot_head")
        self.zero_shot_val = ev.accuracies(zs_val, val)
        self.zero_shot_test = ev.accuracies(self.zero_shot_test_correct, test)

    def _per_task(self, ds: NLISet, kind: str) -> np.ndarray:
        ok = np.zeros(len(ds), bool)
        for i in range(len(self.task_names)):
            sub = ds.only(i)
            adapter = self.adapters[i] if kind == "single" else None

            def compute(sub=sub, adapter=adapter) -> np.ndarray:
                return self.scorer.correct(sub, self.scores, self.used, adapter)

            if self._keys is None or self._cache is None:
                ok[ds.rows(i)] = compute()
                continue
            what = {
                "kind": kind,
                "suite": "nli",
                "nli_code_version": CODE_VERSION,
                "adapter": self._keys[i],
                "weights": self._weights,
                "pairs": sub.fingerprint(),
            }
            ok[ds.rows(i)] = le.cached_correct(self._cache, what, compute)[0]
        return ok

    def correct(self, ds: NLISet, adapter=None, coef: float = 1.0, *, deltas=None) -> np.ndarray:
        """``(N,)`` bool correctness on ``ds`` of the base model plus ``coef * adapter``."""
        return self.scorer.correct(ds, self.scores, self.used, adapter, coef, deltas=deltas)

    def deltas(self, adapter: Mapping[str, Any]) -> Any:
        """The merge's updates as the scorer folds them."""
        return self.scorer.deltas(adapter)
