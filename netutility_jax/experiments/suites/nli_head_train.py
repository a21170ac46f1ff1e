"""The NLI head formulation's training (:mod:`nli_head`): a task's LoRA and head, cached.

**Training** (:class:`Trainer`; defaults :class:`NLITrainConfig` are Appendix B's table):
LoRA ``r = 16``, ``alpha = 16`` on ``q_proj, k_proj, v_proj, o_proj`` of every layer with
dropout 0.1 on the LoRA branch's input (``nli_head_model.DropoutLoRALinear``), the head trained
with it (PEFT's ``modules_to_save``), the base frozen; AdamW at ``3e-5``, linear schedule with
6% warmup, batch 1, at most 10 epochs, validation accuracy every 4,000 steps, the best
checkpoint kept, early stopping after 3 evaluations without improvement
(:class:`trainer.LoraTrainer`); what the paper leaves unsaid follows transformers' ``Trainer``
defaults (see :mod:`nli_head`). A trained task (:class:`HeadedTask`) is cached on disk under a
key of everything that determines it (:func:`cache_key`, :func:`train_task`,
:func:`train_tasks`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ...errors import InputError, InputTypeError
from ..data import lang_tasks as lt
from ..harness import fitting as ft
from ..harness.trainer import Batch, LoraTrainer, TaskRun, lora_state, train_cached
from ..models import llama
from . import lang_train as ltr
from .nli_head_data import NLISet, encode_pairs, make_set, train_batch
from .nli_head_eval import Scorer
from .nli_head_model import (
    CODE_VERSION,
    NUM_CLASSES,
    DropoutKey,
    HeadSpec,
    class_logits,
    clip_gradient,
    masked_loss,
    num_classes,
    pool_last,
    with_lora_dropout,
)

__all__ = [
    "NO_STEP_CAP",
    "HeadedTask",
    "NLITrainConfig",
    "Trainer",
    "cache_key",
    "load_cached",
    "train_task",
    "train_tasks",
]

#: ``max_steps`` meaning "no cap but ``max_epochs``".
NO_STEP_CAP = 2**31 - 1
_SCORE_STD = 0.02  # transformers' initializer_range, the init of a fresh ``score`` head


# ------------------------------------------------------------------------------------ config


@dataclasses.dataclass(frozen=True)
class NLITrainConfig(ft.TrainConfigBase):
    """The training of one task's LoRA and head; the defaults are the paper's (App. B).

    The fields of :class:`fitting.TrainConfigBase` (LoRA, AdamW, validation and patience), with
    the paper's values, and:

    Attributes:
      lora_dropout: dropout on the LoRA branch's input (PEFT's ``lora_dropout``).
      rows: pairs per step (the paper's batch size, 1).
      row_len: most tokens of a pair (the paper's maximum sequence length, 2,000; longer pairs
        are cut longest-first, as transformers' ``truncation=True``).
      max_steps: a cap on the steps (:data:`NO_STEP_CAP`: none but ``max_epochs``).
      max_epochs: at most this many passes over the training pairs; the schedule's length is
        ``min(max_steps, max_epochs * ceil(n_train / rows))`` (:meth:`steps_for`).
      max_grad_norm: clip the gradient (LoRA and head together) to this global norm
        (transformers' ``Trainer`` default 1.0; 0: off).
      eval_tokens: token slots per evaluation batch (rows are ``eval_tokens / T`` rounded down to
        a power of two for a bucket of ``T`` tokens).
      seed: data order, dropout masks and initialization.
    """

    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_dropout: float = 0.1
    rows: int = 1
    row_len: int = 2000
    learning_rate: float = 3e-5
    weight_decay: float = 0.0
    warmup_fraction: float = 0.06
    max_steps: int = NO_STEP_CAP
    max_epochs: int = 10
    eval_every: int = 4000
    patience: int = 3
    init: str = "shared"
    max_grad_norm: float = 1.0
    eval_tokens: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        if not (isinstance(self.lora_dropout, (int, float)) and 0 <= self.lora_dropout < 1):
            raise InputError(f"{cls}: lora_dropout={self.lora_dropout!r}; expected 0 <= p < 1.")
        for name in ("max_epochs", "eval_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{cls}: {name}={v!r}; expected an integer >= 1.")
        if not (isinstance(self.max_grad_norm, (int, float)) and self.max_grad_norm >= 0):
            raise InputError(
                f"{cls}: max_grad_norm={self.max_grad_norm!r}; expected a number >= 0 (0: off)."
            )

    def schedule(self) -> optax.Schedule:
        """transformers' linear schedule: from 0 up to ``learning_rate`` over
        ``ceil(warmup_fraction * max_steps)`` steps, then linearly down to 0 at ``max_steps``."""
        warm = max(math.ceil(self.warmup_fraction * self.max_steps), 1)
        decay = max(self.max_steps - warm, 1)
        sched = optax.join_schedules(
            [
                optax.linear_schedule(0.0, self.learning_rate, warm),
                optax.linear_schedule(self.learning_rate, 0.0, decay),
            ],
            [warm],
        )
        return lambda step: sched(jnp.asarray(step, jnp.float32))

    def steps_for(self, n_train: int) -> int:
        """The schedule's length for ``n_train`` training pairs."""
        per_epoch = -(-int(n_train) // self.rows)
        return max(1, min(self.max_steps, self.max_epochs * per_epoch))


class HeadedTask(NamedTuple):
    """A trained task: its LoRA adapter, its head and what happened (``fitting.TrainedTask``
    with ``score``; the runner reads ``name``, ``adapter`` and ``info``).

    Attributes:
      name, labels, adapter, info: as ``fitting.TrainedTask`` (adapter module names
        ``model/layers/{i}/self_attn/{q,k,v,o}_proj``).
      score: ``(D, C)`` float32, the trained head (``score.weight`` transposed).
    """

    name: str
    labels: tuple[str, ...]
    adapter: dict[str, dict[str, Any]]
    info: dict[str, Any]
    score: np.ndarray


_SCORE_INFO = "score_head"  # the head rides in the cached TrainedTask's info under this key


def _headed(t: ft.TrainedTask) -> HeadedTask:
    info = dict(t.info)
    score = np.asarray(info.pop(_SCORE_INFO), np.float32)
    return HeadedTask(t.name, tuple(t.labels), t.adapter, info, score)


class Trainer(LoraTrainer):
    """Trains task LoRAs and heads on one shared base decoder (see the module docstring; the NLI
    suite's part of :class:`trainer.LoraTrainer`: its loss with dropout and clipping, a state
    of LoRA and head, its batches); the jitted step compiles once per length bucket and
    schedule.

    Args:
      config: hyperparameters (:class:`NLITrainConfig`).
      model: the base :class:`llama.Llama` (no adapters).
      tokenizer: its tokenizer.
      scorer: a :class:`Scorer` of ``model`` for validation (default made here).
      num_classes: the classes of the label space the heads read (:data:`NUM_CLASSES`, the NLI
        suite's three, by default).
      place: puts a fresh LoRA-and-head state and its optimizer state on the devices
        (``trainer.LoraTrainer``'s ``place``: e.g. ``sharding.shard_state`` on the model's mesh);
        None: replicated over the base model's mesh when it is split, else left as it is.
    """

    where = "nli_head.Trainer"
    report_slots = True

    def __init__(
        self,
        config: NLITrainConfig,
        model: llama.Llama,
        tokenizer: Any,
        *,
        scorer: Scorer | None = None,
        num_classes: int = NUM_CLASSES,
        place: Callable[[Any], Any] | None = None,
    ):
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise InputError(
                f"nli_head.Trainer: num_classes={num_classes!r}; expected an integer >= 2."
            )
        self.num_classes = num_classes
        if not isinstance(config, NLITrainConfig):
            raise InputTypeError(
                f"nli_head.Trainer: config is a {type(config).__name__}; expected NLITrainConfig."
            )
        if model.lora is not None:
            raise InputError(
                "nli_head.Trainer: the model has LoRA adapters; pass the base model, the trainer "
                "adds fresh ones per task."
            )
        self.model, self.tokenizer = model, tokenizer
        self.scorer = Scorer(model) if scorer is None else scorer
        self.lora = llama.LoRAConfig(config.lora_rank, config.lora_alpha)
        lmodel = with_lora_dropout(
            llama.add_lora(model, self.lora, rngs=nnx.Rngs(0)), config.lora_dropout
        )
        self.graphdef, _, self._keys, base_state = nnx.split(lmodel, nnx.LoRAParam, DropoutKey, ...)
        graphdef = self.graphdef
        flat_keys = list(nnx.to_flat_state(self._keys))
        max_norm = float(config.max_grad_norm)

        def fresh_keys(key):
            ks = jax.random.split(key, max(len(flat_keys), 1))
            return nnx.from_flat_state(
                [(p, v.replace(ks[i])) for i, (p, v) in enumerate(flat_keys)]
            )

        def loss_fn(params, base, key, ids, mask, labels, valid, used):
            if max_norm > 0:
                params = clip_gradient(params, max_norm)
            m = nnx.merge(graphdef, params["lora"], fresh_keys(key), base)
            pooled = pool_last(m.hidden_states(ids, mask), mask)
            head = jnp.zeros(ids.shape[0], jnp.int32)
            z = class_logits(pooled, params["score"][None], head, used[None])
            return masked_loss(z, labels, valid)

        super().__init__(config, loss_fn, base_state, place=place)
        self._loss = jax.jit(loss_fn)

    def init(self, name: str) -> dict[str, Any]:
        """Fresh parameters of task ``name``: LoRA ``A`` from ``fitting.init_seed``, ``B = 0``, and
        a head drawn as transformers initialises ``score`` (normal, std 0.02, from the same
        seed)."""
        seed = ft.init_seed(self.config, name)
        lora = lora_state(llama.add_lora(self.model, self.lora, rngs=nnx.Rngs(seed)))
        rng = np.random.default_rng([seed, 2])
        score = rng.normal(0.0, _SCORE_STD, (self.model.config.hidden_size, self.num_classes))
        return {"lora": lora, "score": jnp.asarray(score, jnp.float32)}

    def adapter(self, lora: Any) -> dict[str, dict[str, Any]]:
        """The adapter (float32 numpy modules, ``nu.nnx.extract_adapter`` names) of a LoRA
        state."""
        return ltr.lora_adapter(nnx.merge(self.graphdef, lora, self._keys, self.base_state))

    def step_key(self, name: str, step: int) -> jax.Array:
        """The dropout key of step ``step`` of task ``name`` (a stream of ``fitting.task_seed``)."""
        return jnp.asarray(ft.task_seed(self.config, name, 3, step).generate_state(2, np.uint32))

    def loss(self, params, head: HeadSpec, ids, mask, labels, valid, *, key=None) -> float:
        """The training loss of a batch (no update; dropout drawn from ``key``, default step 0's
        key of the head's task)."""
        key = self.step_key(head.task, 0) if key is None else key
        used = jnp.asarray(head.used)
        return float(self._loss(params, self.base_state, key, ids, mask, labels, valid, used))

    def task_config(self, task: Any) -> NLITrainConfig:
        """The task's config (``fitting.task_config``) with the schedule's length for its
        training pairs (:meth:`NLITrainConfig.steps_for`)."""
        cfg = ft.task_config(self.config, task.name)
        return dataclasses.replace(cfg, max_steps=cfg.steps_for(len(task.train)))

    def prepare(
        self, task: Any, head: HeadSpec, cfg: NLITrainConfig, val: NLISet | None
    ) -> TaskRun:
        """Task ``task`` with its ``head``: batches of ``rows`` pairs
        (``lang_train.epoch_batches``), a fresh dropout key a step, validation on ``val``
        (default made from ``task.val``).

        Raises:
          InputError: a training example of a class the head masks.
        """
        labels = np.asarray(task.train.labels, np.int32)
        if len(head.used) != self.num_classes:
            raise InputError(
                f"nli_head.Trainer.fit: task {task.name!r}'s head reads {len(head.used)} classes; "
                f"the trainer's heads have {self.num_classes} (Trainer(num_classes=...))."
            )
        if not np.asarray(head.used)[labels].all():
            raise InputError(
                f"nli_head.Trainer.fit: task {task.name!r} has training examples of a class its "
                f"head masks ({head.names})."
            )
        enc = encode_pairs(self.tokenizer, list(task.train.texts), max_len=cfg.row_len)
        if val is None:
            val = make_set(
                self.tokenizer, [head], [task.val], max_len=cfg.row_len,
                eval_tokens=cfg.eval_tokens,
            )  # fmt: skip
        used = jnp.asarray(head.used)
        lengths, pad = enc.lengths, lt.pad_id(self.tokenizer)

        def epoch(seed: np.random.SeedSequence) -> list[np.ndarray]:
            return ltr.epoch_batches(lengths, rows=cfg.rows, seed=seed)

        def batch(chosen: np.ndarray, done: int) -> Batch:
            ids, mask, lab, valid = train_batch(enc, labels, chosen, rows=cfg.rows, pad_id=pad)
            args = (self.step_key(task.name, done), ids, mask, lab, valid, used)
            return Batch(args, int(lengths[chosen].sum()), ids.shape, ids.size)

        def validate(params) -> tuple[float, float]:
            score = np.asarray(params["score"], np.float32)[None]
            z = self.scorer.logits(val, score, used[None], self.adapter(params["lora"]))
            acc = float((np.argmax(z, axis=1) == val.labels).mean())
            return acc, float(-_log_probs(z, val.labels).mean())

        return TaskRun(epoch, batch, validate)

    def trained(self, task: Any, best: Any, info: dict[str, Any]) -> ft.TrainedTask:
        """The trained task, its head in ``info`` under ``"score_head"`` (:func:`train_task`
        turns it into a :class:`HeadedTask`)."""
        info = {**info, _SCORE_INFO: np.asarray(best["score"], np.float32)}
        return ft.TrainedTask(task.name, tuple(task.labels), self.adapter(best["lora"]), info)



def _log_probs(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return lp[np.arange(len(labels)), labels]


# ------------------------------------------------------------------------------------ caching


def _pairs_fingerprint(tokenizer: Any, task: Any, config: NLITrainConfig) -> str:
    h = hashlib.sha256()
    for split in (task.train, task.val):
        enc = encode_pairs(tokenizer, list(split.texts), max_len=config.row_len)
        h.update(np.ascontiguousarray(enc.flat).tobytes())
        h.update(np.ascontiguousarray(enc.offsets).tobytes())
    return h.hexdigest()


def cache_key(
    task: Any,
    head: HeadSpec,
    config: NLITrainConfig,
    *,
    tokenizer: Any,
    weights: str,
    dtype: str,
    suite: str = "nli",
) -> tuple[str, dict[str, Any]]:
    """``(hex key, the document hashed)`` naming the result of training ``task``: the suite, the
    task's data, its tokenized train and validation pairs, its head, the config (with its seed),
    the model's weights and compute dtype, and :data:`CODE_VERSION`."""
    what = {
        "code_version": CODE_VERSION,
        "suite": suite,
        "task": ft.task_fingerprint(task),
        "pairs": _pairs_fingerprint(tokenizer, task, config),
        "head": {"used": list(head.used), "names": list(head.names)},
        "config": ft.config_key_doc(config),
        "weights": weights,
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest(), what


def load_cached(path: pathlib.Path) -> HeadedTask | None:
    """The trained task stored at ``path`` (``fitting.cache_path``), or None."""
    t = ft.load_cached(pathlib.Path(path))
    if t is None or _SCORE_INFO not in t.info:
        return None
    return _headed(t)


def train_task(
    task: Any,
    head: HeadSpec,
    config: NLITrainConfig,
    *,
    tokenizer: Any,
    weights: str,
    dtype: str,
    cache_dir: str | os.PathLike,
    trainer: Trainer | Callable[[], Trainer] | None = None,
    progress: Callable[[int, dict], None] | None = None,
    suite: str = "nli",
) -> HeadedTask:
    """Train ``task`` with ``config`` (as ``fitting.task_config`` gives it), or load it from
    ``cache_dir/<task>-<key>`` (``suite`` names the suite in the key).

    Returns:
      :class:`HeadedTask`; ``info["cache_hit"]`` says whether it came from the cache.
    """
    own = ft.task_config(config, task.name)
    key, what = cache_key(
        task, head, own, tokenizer=tokenizer, weights=weights, dtype=dtype, suite=suite
    )
    doc = {**what, "task_name": task.name, "key": key}
    got = train_cached(
        task, head, config, kind=Trainer, trainer=trainer, cache_dir=cache_dir, key=key,
        key_doc=doc, where="nli_head.train_task", progress=progress,
    )  # fmt: skip
    if _SCORE_INFO not in got.info:
        raise InputError(
            f"nli_head.train_task: the cache entry {ft.cache_path(cache_dir, task, key)} holds "
            "no head; delete it to retrain."
        )
    return _headed(got)


def train_tasks(
    tasks: Sequence[Any],
    heads: Sequence[HeadSpec],
    config: NLITrainConfig,
    *,
    model: llama.Llama,
    tokenizer: Any,
    weights: str,
    cache_dir: str | os.PathLike,
    scorer: Scorer | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    suite: str = "nli",
    place: Callable[[Any], Any] | None = None,
) -> list[HeadedTask]:
    """Train (or load) every task, a tqdm bar each; one :class:`Trainer` (its heads as wide as
    ``heads``' label space, its states put on the devices by ``place``) made on the first cache
    miss and shared; ``log`` gets a line per task; ``suite`` names the suite in the cache
    keys."""
    c = num_classes(heads) if heads else NUM_CLASSES
    trainer = functools.cache(
        lambda: Trainer(config, model, tokenizer, scorer=scorer, num_classes=c, place=place)
    )
    dtype = np.dtype(model.dtype).name

    def one(task: Any, head: HeadSpec, tick: Callable[[int, dict], None]) -> HeadedTask:
        return train_task(
            task, head, config, tokenizer=tokenizer, weights=weights, dtype=dtype,
            cache_dir=cache_dir, trainer=trainer, progress=tick, suite=suite,
        )  # fmt: skip

    def total(task: Any) -> int:
        return ft.task_config(config, task.name).steps_for(len(task.train))

    return ft.train_each(tasks, heads, config, one, progress=progress, log=log, total=total)
