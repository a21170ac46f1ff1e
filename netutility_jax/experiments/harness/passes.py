"""What both suites' evaluation shares: packed sets of several tasks' examples, passes over them.

* :class:`TaskSet`: the examples of several tasks, tokenized and packed into forward calls once
  (``encoder_eval.EvalSet`` for the encoder's texts, ``lang_tasks.PromptSet`` for the decoder's
  prompts): its size, the rows of one task, the tokens a pass has to do and does.
* :class:`PassCounter`: a model that runs passes over such sets (``encoder_eval.Backbone``,
  ``lang_eval.Scorer``): it gathers the batches' outputs into one row per example and counts
  the passes, tokens and seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["PassCounter", "TaskSet", "last_batch_rows"]


class TaskSet:
    """Mixin of a packed set: fields ``task_names``, ``task`` ``(N,)`` (task index of each
    example), ``lengths`` ``(N,)`` (its tokens) and ``batches`` (each with ``ids``)."""

    task_names: tuple[str, ...]
    task: np.ndarray
    lengths: np.ndarray
    batches: tuple[Any, ...]

    def __len__(self) -> int:
        return int(self.task.shape[0])

    @property
    def tokens(self) -> int:
        """Real tokens in one pass (the work a pass has to do)."""
        return int(self.lengths.sum())

    @property
    def slot_tokens(self) -> int:
        """Tokens one pass computes, padding and filler rows included (the work a pass does)."""
        return int(sum(b.ids.size for b in self.batches))

    def task_index(self, task: int | str) -> int:
        """The index of ``task`` (a name or an index)."""
        return self.task_names.index(task) if isinstance(task, str) else int(task)

    def rows(self, task: int | str) -> np.ndarray:
        """Indices of the examples of one task."""
        return np.flatnonzero(self.task == self.task_index(task))


def last_batch_rows(n: int, rows: int, least: int) -> int:
    """Rows of a batch holding ``n`` of at most ``rows`` rows when the last batch shrinks: the
    next power of two of ``n``, at least ``least`` and at most ``rows`` (a few more compiled
    shapes, and a small set's pass computes few filler rows)."""
    return min(rows, max(least, 1 << (n - 1).bit_length()))


class PassCounter:
    """Mixin of a model that runs passes over :class:`TaskSet` objects.

    Attributes:
      passes, tokens, slot_tokens, seconds: work done so far (passes, real tokens, tokens
        computed with padding, wall seconds).
    """

    passes: int = 0
    tokens: int = 0
    slot_tokens: int = 0
    seconds: float = 0.0

    def gather(
        self,
        pending: Iterable[tuple[np.ndarray, Any]],
        shape: tuple[int, int],
        work: TaskSet,
        t0: float,
    ) -> np.ndarray:
        """The ``shape`` float32 rows of one pass over ``work`` that began at ``t0``.

        ``pending`` holds each batch's ``(index, outputs)``: row ``j`` of the outputs belongs to
        example ``index[j]`` (``-1``: a filler row). The pass is counted.
        """
        out = np.zeros(shape, np.float32)
        for index, z in pending:
            z = np.asarray(z)
            keep = index >= 0
            out[index[keep]] = z[keep]
        self.passes += 1
        self.tokens += work.tokens
        self.slot_tokens += work.slot_tokens
        self.seconds += time.perf_counter() - t0
        return out

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    def timing(self) -> dict[str, float]:
        """``passes``, ``tokens``, ``slot_tokens``, ``seconds``, ``tokens_per_second``."""
        return {
            "passes": self.passes,
            "tokens": self.tokens,
            "slot_tokens": self.slot_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
        }
