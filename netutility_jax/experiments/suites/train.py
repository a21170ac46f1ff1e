"""Train one LoRA adapter per task on MiniLM against the task's frozen zero-shot head, cached.

Per task (:meth:`Trainer.fit`): the pretrained MiniLM-L6 with ``nnx.LoRA`` rank 16, alpha 16 on
``query``, ``key``, ``value`` and the attention ``output`` of all 6 layers
(:func:`minilm.add_lora`). **Only the LoRA factors train**: the head is the task's frozen
zero-shot head (:func:`encoder_eval.zero_shot_heads`, cosine similarity to the base-model
embeddings of the label descriptions over a fixed temperature), so everything a task learns is
in its adapter, as with the frozen CLIP text heads of the paper's vision suite.

Optimisation: AdamW (optax) with a linear warmup over ``warmup_fraction`` of ``max_steps`` and a
cosine decay to zero at ``max_steps``; cross-entropy; validation accuracy every ``eval_every``
steps; the best adapter (validation accuracy, then validation loss) is kept; training stops early
after ``patience`` evaluations without a better one (paper, Appendix B, scaled down). The curves
(training loss, validation loss and accuracy at every evaluation) are returned in ``info``.

Batches are packed (:func:`minilm.pack`): every step fills ``rows x row_len`` tokens with the next
texts of a shuffled epoch, so a step holds many short texts or a few long ones, its shape never
changes (one compile for every task), and no compute goes to padding. A step always consumes at
least one text and an epoch ends when its texts are used up, so training advances whatever the
size of the split (a split smaller than a step is one step per epoch).

Deterministic from ``TrainConfig.seed``: the ``A`` factors are drawn from
``nnx.Rngs(fitting.init_seed(config, task name))`` (by default from
``SeedSequence([seed, crc32(task name)])``; with ``init="shared"`` the same for every task, as in
the paper's codebase), each epoch's order from a PCG64 stream of
``(seed, crc32(task name), 1, epoch)``; the optimizer, the step, the loop and the cache are
:class:`trainer.LoraTrainer`'s (over :mod:`fitting`); this module supplies the loss and batches.
A task trains with ``fitting.task_config(config, task name)`` (``step_scale`` lengthens it).

Caching (:func:`train_task`): the trained adapter is stored with ``nu.checkpoint`` under
``cache_dir/<task>-<key>``; the key hashes everything that determines the result (the task's
name, labels, label texts and every split, the :class:`TrainConfig` with its seed, the size and
modification time of the pretrained files, :data:`CODE_VERSION`); a task's key is that of
the config it trains with (:func:`fitting.task_config`). A checkpoint is written to a
temporary directory and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ...errors import InputError
from ..harness import fitting as ft
from ..harness.fitting import TrainedTask, default_cache_dir, task_fingerprint
from ..harness.trainer import Batch, LoraTrainer, TaskRun, lora_state, train_cached
from ..models import minilm
from . import encoder_eval as ev

__all__ = [
    "CODE_VERSION",
    "TrainConfig",
    "Trainer",
    "cache_key",
    "epoch_steps",
    "train_task",
    "train_tasks",
    "weights_fingerprint",
]

#: Bump when a change to this module changes what training produces: invalidates every cache.
CODE_VERSION = 2


@dataclasses.dataclass(frozen=True)
class TrainConfig(ft.TrainConfigBase):
    """Everything that determines a trained adapter besides the task data and the model files.

    The fields of :class:`fitting.TrainConfigBase` (LoRA rank and alpha, AdamW and its
    schedule, validation and patience), and:

    Attributes:
      rows, row_len: a step packs texts into ``rows`` rows of ``row_len`` tokens (texts are
        truncated to ``row_len``).
      temperature: of the zero-shot heads' logits.
      seed: data order and initialization.
    """

    rows: int = 8
    row_len: int = ev.ROW_LEN
    learning_rate: float = 2e-3
    warmup_fraction: float = 0.05
    max_steps: int = 600
    temperature: float = ev.TEMPERATURE
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.row_len < 3:
            raise InputError(f"TrainConfig: row_len={self.row_len}; a text needs >= 3 tokens.")


# ------------------------------------------------------------------------------------ caching


def weights_fingerprint(path: str | os.PathLike | None = None) -> dict[str, list[int]]:
    """Size and modification time (ns) of the pretrained files that determine the model."""
    d = minilm.model_dir() if path is None else pathlib.Path(path)
    out = {}
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        st = (d / f).stat()
        out[f] = [int(st.st_size), int(st.st_mtime_ns)]
    return out


def cache_key(task: Any, config: TrainConfig, *, weights: dict | None = None) -> str:
    """Hex digest naming the result of training ``task`` with ``config`` (see the module doc)."""
    what = {
        "code_version": CODE_VERSION,
        "task": task_fingerprint(task),
        "config": ft.config_key_doc(config),
        "weights": weights_fingerprint() if weights is None else weights,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------- training


def epoch_steps(
    lengths: np.ndarray, *, rows: int, row_len: int, seed: np.random.SeedSequence
) -> list[list[int]]:
    """One epoch as steps: the texts in a shuffled order, each step the most that fit.

    A step takes texts in the epoch's order while they fit (first fit, as
    :func:`minilm.pack` with ``decreasing=False``) into ``rows`` rows of ``row_len`` tokens with
    at most ``row_len // 3`` texts a row; the first text that does not fit starts the next step. Every text is in exactly one step and every step has at least one
    (a text is cut to ``row_len``), so an epoch always ends.
    """
    order = np.random.Generator(np.random.PCG64(seed)).permutation(len(lengths))
    lens = np.minimum(np.asarray(lengths), row_len)
    cap = row_len // 3
    steps: list[list[int]] = []
    cur: list[int] = []
    free: list[int] = []
    counts: list[int] = []
    for i in order:
        n = int(lens[i])
        r = next((j for j in range(len(free)) if free[j] >= n and counts[j] < cap), None)
        if r is None and len(free) < rows:
            free.append(row_len)
            counts.append(0)
            r = len(free) - 1
        if r is None:  # the step is full
            steps.append(cur)
            cur, free, counts = [], [row_len], [0]
            r = 0
        free[r] -= n
        counts[r] += 1
        cur.append(int(i))
    if cur:
        steps.append(cur)
    return steps


class Trainer(LoraTrainer):
    """Trains task LoRAs on one shared MiniLM (the encoder suite's part of
    :class:`trainer.LoraTrainer`: its loss, initial state, adapter and packed batches); the
    jitted step compiles once for all tasks (and once more for each other length a task's
    ``step_scale`` gives the schedule).

    Args:
      config: hyperparameters.
      backbone: an :class:`encoder_eval.Backbone` (its base model is the model to adapt, and it
        evaluates validation accuracy; default loads the pretrained one).
    """

    where = "train.Trainer"

    def __init__(self, config: TrainConfig, backbone: ev.Backbone | None = None):
        from flax import nnx

        self.backbone = ev.Backbone() if backbone is None else backbone
        self.graphdef, _, base_state = nnx.split(self._with_lora(config, 0), nnx.LoRAParam, ...)
        graphdef = self.graphdef
        cap = config.row_len // 3
        inv_t = 1.0 / config.temperature

        def loss_fn(lora, base, ids, seg, pos, head, labels, valid, n_labels):
            m = nnx.merge(graphdef, lora, base)
            h = m(ids, seg > 0, segment_ids=seg, position_ids=pos)
            e = minilm.segment_mean_pool(h, seg, cap)  # (R, S, D)
            # an empty slot's embedding is 0: a norm with a finite gradient there
            e = e * jax.lax.rsqrt(jnp.sum(e * e, axis=-1, keepdims=True) + 1e-24)
            z = jnp.einsum("rsd,cd->rsc", e, head) * inv_t
            z = jnp.where(jnp.arange(z.shape[-1]) < n_labels, z, ft.MASKED_LOGIT)
            ce = optax.softmax_cross_entropy_with_integer_labels(z, labels)
            n = jnp.sum(valid.astype(ce.dtype))
            return jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(n, 1.0)

        super().__init__(config, loss_fn, base_state)

    def _with_lora(self, config: TrainConfig, seed: int) -> Any:
        from flax import nnx

        return minilm.add_lora(
            self.backbone.model, rank=config.lora_rank, alpha=config.lora_alpha,
            rngs=nnx.Rngs(seed),
        )  # fmt: skip

    def init(self, name: str) -> Any:
        """Fresh LoRA factors for task ``name`` (``A`` from ``fitting.init_seed``, ``B = 0``)."""
        return lora_state(self._with_lora(self.config, ft.init_seed(self.config, name)))

    def adapter(self, lora: Any) -> dict[str, dict[str, Any]]:
        """The adapter (float32 numpy modules) of LoRA state ``lora``."""
        from flax import nnx

        return ft.host_adapter(minilm.lora_adapter(nnx.merge(self.graphdef, lora, self.base_state)))

    def _val(self, adapter, head: ev.Head, val: ev.EvalSet, n_labels: int) -> tuple[float, float]:
        emb = self.backbone.embed(val, adapter)
        z = ev.logits(emb, head, self.config.temperature)
        z = z - z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        loss = float(-logp[np.arange(len(val)), val.labels].mean())
        return float((np.argmax(z, axis=1) == val.labels).mean()), loss

    def prepare(
        self, task: Any, head: ev.Head, cfg: TrainConfig, val: ev.EvalSet | None
    ) -> TaskRun:
        """Task ``task`` (a ``tasks.Task``) against its frozen zero-shot ``head``: packed steps
        (:func:`epoch_steps`), validation on ``val`` (default ``task.val``)."""
        n_labels = task.num_labels
        ids, lengths = ev.encode(task.train.texts, max_len=cfg.row_len)
        labels = np.asarray(task.train.labels, np.int32)
        val = ev.make_eval_set([task.name], [task.val]) if val is None else val
        hpad = np.zeros((ft.label_width(n_labels), head.vectors.shape[1]), np.float32)
        hpad[:n_labels] = head.vectors
        hpad = jnp.asarray(hpad)
        nl = jnp.asarray(n_labels, jnp.int32)

        def epoch(seed: np.random.SeedSequence) -> list[list[int]]:
            return epoch_steps(lengths, rows=cfg.rows, row_len=cfg.row_len, seed=seed)

        def batch(chosen: Sequence[int], done: int) -> Batch:
            rows = np.asarray(chosen)
            # the same first fit, in the same order, as epoch_steps: one batch of cfg.rows
            (b,) = ev.packed_batches(
                ids[rows], lengths[rows], rows=cfg.rows, row_len=cfg.row_len, decreasing=False
            )
            slot = b.text
            lab = np.where(slot >= 0, labels[rows][np.maximum(slot, 0)], 0).astype(np.int32)
            args = (b.ids, b.segment_ids, b.position_ids, hpad, lab, slot >= 0, nl)
            tokens = int(np.minimum(lengths[rows], cfg.row_len).sum())
            return Batch(args, tokens, b.ids.shape)

        def validate(lora) -> tuple[float, float]:
            return self._val(self.adapter(lora), head, val, n_labels)

        return TaskRun(epoch, batch, validate)


def train_task(
    task: Any,
    head: ev.Head,
    config: TrainConfig,
    *,
    cache_dir: str | os.PathLike | None = None,
    trainer: Trainer | Callable[[], Trainer] | None = None,
    progress: Callable[[int, dict], None] | None = None,
) -> TrainedTask:
    """Train ``task`` with ``config``, or load the result from the cache if it is there.

    Args:
      task: a ``tasks.Task``.
      head: its zero-shot head (a function of the task's label texts and the model, both in the
        cache key).
      config: hyperparameters and seed; the task trains with, and is cached under,
        ``fitting.task_config(config, task.name)``.
      cache_dir: cache directory (default :func:`default_cache_dir`).
      trainer: a :class:`Trainer` for ``config`` (or a callable making one, called only on a cache
        miss); default makes one.
      progress: ``progress(step, stats)`` after each training step.

    Returns:
      :class:`TrainedTask`; ``info["cache_hit"]`` says whether it came from the cache.
    """
    cache_dir = default_cache_dir() if cache_dir is None else pathlib.Path(cache_dir)
    weights = weights_fingerprint()
    own = ft.task_config(config, task.name)
    key = cache_key(task, own, weights=weights)
    key_doc = {
        "code_version": CODE_VERSION,
        "task": task.name,
        "task_fingerprint": task_fingerprint(task),
        "config": ft.config_key_doc(own),
        "weights": weights,
        "key": key,
    }
    made = (lambda: Trainer(config)) if trainer is None else trainer
    return train_cached(
        task, head, config, kind=Trainer, trainer=made, cache_dir=cache_dir, key=key,
        key_doc=key_doc, where="train.train_task", progress=progress,
    )  # fmt: skip


def train_tasks(
    tasks: Sequence[Any],
    heads: Sequence[ev.Head],
    config: TrainConfig,
    *,
    cache_dir: str | os.PathLike | None = None,
    backbone: ev.Backbone | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[TrainedTask]:
    """Train (or load from the cache) every task, with a tqdm bar per task.

    One :class:`Trainer` is made on the first cache miss and shared by all tasks. ``log`` gets
    one line per task when it is done.
    """
    trainer = functools.cache(lambda: Trainer(config, backbone))

    def one(task: Any, head: ev.Head, tick: Callable[[int, dict], None]) -> TrainedTask:
        return train_task(task, head, config, cache_dir=cache_dir, trainer=trainer, progress=tick)

    return ft.train_each(tasks, heads, config, one, progress=progress, log=log)
