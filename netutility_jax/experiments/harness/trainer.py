"""The one LoRA trainer: a suite supplies its loss, initial state, adapter and batches.

Every suite that trains (the encoder, :mod:`train`; the decoder, :mod:`lang_train`; NLI with its
head, :mod:`nli_head`) trains one LoRA per task the same way, and differs only in its model, its
batches and its loss. :class:`LoraTrainer` is that way, once:

* the optimizer and the jitted step (:func:`fitting.optimizers`: ``optax.adamw`` with the
  config's schedule, one step per schedule length and learning rate, the trainable state and the
  optimizer state donated);
* a task's config (:func:`fitting.task_config`: its ``step_scale`` and ``lr_scale``), the
  epochs' seeds (:func:`fitting.task_seed` ``(seed, task, 1, epoch)``), the loop with validation
  and early stopping (:func:`fitting.fit_early_stopping`), and the timing of the steps that did
  not compile (:class:`fitting.StepClock`; a step whose batch shape is new compiles);
* the cache (:func:`train_cached`, over :func:`fitting.cached_or_trained`): a trained task is
  loaded from ``cache_dir/<task>-<key>``, or trained by the trainer given (or made) and stored.

A suite's trainer subclasses :class:`LoraTrainer`: it builds its model's frozen state and its
loss ``loss_fn(state, base_state, *batch.args) -> scalar`` and passes both to
``LoraTrainer.__init__``, and defines :meth:`~LoraTrainer.init` (a task's initial trainable
state), :meth:`~LoraTrainer.adapter` (the trained state as an adapter) and
:meth:`~LoraTrainer.prepare` (a task's :class:`TaskRun`: its epochs, its steps' batches and its
validation). ``tests/experiments/test_trainer.py`` trains a toy suite (a LoRA on a linear map) this way
against an AdamW loop written out in float64.

**A sharded base model.** When the base model's weights lie on a mesh of several devices
(``sharding.shard_model``, e.g. a suite built with ``mesh=``), every fresh trainable state and
its optimizer state are placed on the same mesh before the first step (:meth:`LoraTrainer.place`),
so that the jitted step runs as one SPMD program over the mesh: by the ``place`` given to the
trainer (e.g. ``lambda t: sharding.shard_state(t, mesh)[0]``: the model's rule, the moments
beside their factors), or else replicated over the base state's mesh (what ``shard_state`` does
with every array under its ``min_bytes``, 1 MiB: the LoRA factors and heads of ordinary sizes).
The harness imports no model code, so the rule is an argument. The step's outputs come back in
the shardings XLA chose, so its second call may compile once more (then no more); the updates
are those of one device up to float32 rounding (``tests/experiments/test_sharding.py``).
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ...errors import InputError
from . import fitting as ft

__all__ = ["Batch", "LoraTrainer", "TaskRun", "base_mesh", "lora_state", "train_cached"]


class Batch(NamedTuple):
    """One training step's inputs, as a suite's :attr:`TaskRun.batch` makes them.

    Attributes:
      args: the loss's arguments after the trainable and the frozen state
        (``loss_fn(state, base_state, *args)``).
      tokens: the real tokens the step trains on (for ``tokens_per_second``).
      shape: the shape the step compiles for; the first step of a shape is not timed.
      slots: the token slots with padding (for ``slot_tokens_per_second``; 0 if the suite does
        not report it).
    """

    args: tuple[Any, ...]
    tokens: int
    shape: Hashable
    slots: int = 0


class TaskRun(NamedTuple):
    """What a suite prepares to train one task (:meth:`LoraTrainer.prepare`).

    Attributes:
      epoch: ``epoch(seed)`` -> one epoch's steps, each the indices of its training examples;
        ``seed`` is the epoch's ``np.random.SeedSequence`` (:func:`fitting.task_seed`).
      batch: ``batch(chosen, done)`` -> the :class:`Batch` of the step on examples ``chosen``
        after ``done`` steps.
      validate: ``validate(state)`` -> ``(accuracy, loss)`` on the validation split.
    """

    epoch: Callable[[np.random.SeedSequence], Iterable[Sequence[int]]]
    batch: Callable[[Sequence[int], int], Batch]
    validate: Callable[[Any], tuple[float, float]]


def base_mesh(state: Any) -> Any:
    """The mesh of several devices ``state``'s arrays lie on (the first found:
    ``sharding.shard_model`` puts a whole model on one), or None."""
    from jax.sharding import NamedSharding

    for x in jax.tree.leaves(state):
        on = getattr(x, "sharding", None)
        if isinstance(on, NamedSharding) and on.mesh.size > 1:
            return on.mesh
    return None


def lora_state(model: Any) -> Any:
    """The ``nnx.LoRAParam`` state of ``model`` in buffers of its own (the step donates them)."""
    from flax import nnx

    return jax.tree.map(jnp.array, nnx.state(model, nnx.LoRAParam))


class LoraTrainer:
    """Trains one LoRA (and whatever else the suite's state holds) per task; see the module
    docstring for what a suite's subclass supplies.

    Args:
      config: the hyperparameters (a :class:`fitting.TrainConfigBase`).
      loss_fn: ``loss_fn(state, base_state, *batch.args)`` -> the scalar training loss;
        differentiated in ``state``.
      base_state: the frozen state every step reads (the base model's weights).
      place: ``place(tree) -> tree`` puts a fresh trainable state and its optimizer state on
        the devices (module docstring); None: replicated over the base state's mesh when it
        lies on several devices, else left where it is.

    Attributes:
      config, base_state: as given.
      placer: ``place`` as given (a suite may set it after construction).
      mesh: the mesh the base state lies on (its first array split or replicated over several
        devices), or None (one device).
      fits: how many tasks :meth:`fit` has trained.
    """

    #: The trainer's name in error messages (``"lang_train.Trainer"``).
    where: ClassVar[str] = "LoraTrainer"
    #: Whether ``info`` reports ``slot_tokens_per_second`` and the batch ``shapes``.
    report_slots: ClassVar[bool] = False

    def __init__(
        self,
        config: ft.TrainConfigBase,
        loss_fn: Callable[..., jax.Array],
        base_state,
        *,
        place: Callable[[Any], Any] | None = None,
    ):
        self.config = config
        self.base_state = base_state
        self.placer = place
        self.mesh = base_mesh(base_state)
        self._optimizer = ft.optimizers(config, loss_fn)
        self.fits = 0

    def place(self, tree: Any) -> Any:
        """``tree`` (a fresh trainable state, or its optimizer state) on the devices the steps
        run on: ``placer(tree)`` if set; else, with the base state on a :attr:`mesh`, each array
        not on that mesh replicated over it (an array already on it stays as it is); else
        ``tree`` unchanged."""
        if self.placer is not None:
            return self.placer(tree)
        if self.mesh is None:
            return tree
        from jax.sharding import NamedSharding, PartitionSpec

        mesh, everywhere = self.mesh, NamedSharding(self.mesh, PartitionSpec())

        def put(x: Any) -> Any:
            if not isinstance(x, (jax.Array, np.ndarray)):
                return x
            on = getattr(x, "sharding", None)
            if isinstance(on, NamedSharding) and on.mesh == mesh:
                return x
            return jax.device_put(x, everywhere)

        return jax.tree.map(put, tree)

    # ------------------------------------------------------------------ what a suite supplies

    def init(self, name: str) -> Any:
        """The initial trainable state of task ``name`` (fresh buffers: they are donated)."""
        raise NotImplementedError

    def adapter(self, state: Any) -> dict[str, dict[str, Any]]:
        """The adapter (``fitting.host_adapter`` modules) of a trainable state."""
        raise NotImplementedError

    def prepare(self, task: Any, head: Any, config: ft.TrainConfigBase, val: Any) -> TaskRun:
        """Task ``task``'s epochs, batches and validation under ``config`` (its task config);
        ``val``: the validation set given to :meth:`fit`, or None (made from ``task.val``)."""
        raise NotImplementedError

    # --------------------------------------------------------------- what may be refined

    def task_config(self, task: Any) -> ft.TrainConfigBase:
        """The config task ``task`` trains with (:func:`fitting.task_config`)."""
        return ft.task_config(self.config, task.name)

    def trained(self, task: Any, best: Any, info: dict[str, Any]) -> ft.TrainedTask:
        """The :class:`fitting.TrainedTask` of the best state ``best``."""
        return ft.TrainedTask(task.name, tuple(task.labels), self.adapter(best), info)

    # ------------------------------------------------------------------------------ training

    def fit(
        self,
        task: Any,
        head: Any,
        *,
        val: Any = None,
        progress: Callable[[int, dict], None] | None = None,
    ) -> ft.TrainedTask:
        """Train ``task`` (its ``train`` split; its ``val`` split, or ``val``, validates) with
        its ``head``; no caching.

        It trains with :meth:`task_config` (the task's ``step_scale`` and ``lr_scale``).
        ``progress(step, stats)`` is called after each step.

        Raises:
          InputError: the task's train split is empty.
        """
        cfg = self.task_config(task)
        if len(task.train) == 0:
            raise InputError(f"{self.where}.fit: task {task.name!r} has an empty train split.")
        t0 = time.perf_counter()
        self.fits += 1
        run = self.prepare(task, head, cfg, val)
        tx, jstep = self._optimizer(cfg.max_steps, cfg.learning_rate)
        clock = ft.StepClock()
        shapes: set[Hashable] = set()

        def plan(epoch: int) -> Iterable[Sequence[int]]:
            return run.epoch(ft.task_seed(cfg, task.name, 1, epoch))

        def step(state, opt_state, chosen, done):
            b = run.batch(chosen, done)
            ts = time.perf_counter()
            state, opt_state, loss = jstep(state, opt_state, self.base_state, *b.args)
            loss = float(loss)
            if b.shape in shapes:  # a new shape compiles: not timed
                clock.add(time.perf_counter() - ts, b.tokens, b.slots)
            shapes.add(b.shape)
            return state, opt_state, loss

        state = self.place(self.init(task.name))
        fit = ft.fit_early_stopping(
            cfg, state, self.place(tx.init(state)), plan=plan, step=step,
            validate=run.validate, progress=progress,
        )  # fmt: skip
        info = {
            **fit.info,
            "train_seconds": time.perf_counter() - t0,
            **clock.rates(slots=self.report_slots),
        }
        if self.report_slots:
            info["shapes"] = sorted(shapes)
        return self.trained(task, fit.best_lora, info)


def train_cached(
    task: Any,
    head: Any,
    config: ft.TrainConfigBase,
    *,
    kind: type[LoraTrainer],
    trainer: LoraTrainer | Callable[[], LoraTrainer] | None,
    cache_dir: str | os.PathLike,
    key: str,
    key_doc: dict[str, Any],
    where: str,
    progress: Callable[[int, dict], None] | None = None,
) -> ft.TrainedTask:
    """Task ``task`` from ``cache_dir/<task>-<key>``, else trained there
    (:func:`fitting.cached_or_trained`).

    Args:
      task, head: the task and its head (as the trainer's :meth:`LoraTrainer.fit` takes them).
      config: the suite's config; the task trains with, and ``key`` names,
        ``fitting.task_config(config, task.name)``.
      kind: the suite's trainer class.
      trainer: a ``kind`` for ``config``, or a callable making one (called only on a cache
        miss), or None (a miss is an error).
      cache_dir: the cache folder.
      key, key_doc: the cache key and the document it hashes (stored as ``key.json``).
      where: the caller's name for error messages (``"lang_train.train_task"``).
      progress: ``progress(step, stats)`` after each training step.

    Raises:
      InputError: a miss without a trainer, or a trainer built for another config.
    """
    own = ft.task_config(config, task.name)

    def fit() -> ft.TrainedTask:
        if trainer is None:
            raise InputError(
                f"{where}: {task.name!r} is not in the cache {cache_dir}; pass a trainer to "
                "train it."
            )
        made = trainer if isinstance(trainer, kind) else trainer()
        if ft.task_config(made.config, task.name) != own:
            raise InputError(
                f"{where}: the trainer was built for {made.config} but config is {config}; "
                "pass a Trainer(config, ...)."
            )
        return made.fit(task, head, progress=progress)

    path = ft.cache_path(pathlib.Path(cache_dir), task, key)
    return ft.cached_or_trained(path, key, key_doc, fit)
