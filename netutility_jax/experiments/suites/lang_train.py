"""Train one LoRA per task on the decoder, scored through its own LM head; cached; PEFT export.

Per task (:meth:`Trainer.fit`): the base decoder (SmolLM2-135M-Instruct by default) with LoRA
rank 16, alpha 16 on ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` of every layer
(:func:`llama.add_lora`); **only the LoRA factors train**. The loss is the cross-entropy of the
prompt's label among the task's label words: the LM head's logits of the words' first tokens at
the last prompt position (``llama.last_token_logits`` with ``token_ids``), the same restricted
head the evaluation scores with (:mod:`lang_eval`), so training optimises what is measured.

Optimisation, as the encoder experiment (:mod:`train`; both are a :class:`trainer.LoraTrainer`
with their own loss and batches): AdamW (optax) with a linear warmup over ``warmup_fraction`` of
``max_steps`` and a cosine decay to 0 at ``max_steps``; validation accuracy every
``eval_every`` steps (the adapter folded into the kernels, :class:`lang_eval.Scorer`); the best
adapter (validation accuracy, then loss) is kept; training stops after ``patience`` evaluations
without a better one. The curves are returned in ``info``.

Batches: ``rows`` prompts a step, right padded to a multiple of :data:`lang_tasks.BUCKET`
tokens (one compiled step per bucket). Each epoch is a permutation of the training prompts;
groups of :data:`SORT_GROUPS` consecutive batches are sorted by length within the group (less
padding), and the batches are then shuffled. A last short batch is filled with masked rows.

Deterministic from ``LanguageTrainConfig.seed``: the ``A`` factors are drawn from
``nnx.Rngs(fitting.init_seed(config, task name))`` (by default from
``SeedSequence([seed, crc32(task name)])``; with ``init="shared"`` the same for every task, as in
the paper's codebase), each epoch's order from a PCG64 stream of
``(seed, crc32(task name), 1, epoch)``. A task trains with ``fitting.task_config(config, task
name)`` (``step_scale`` lengthens it).

Caching (:func:`train_task`): the trained adapter is stored with ``nu.checkpoint`` (through
:func:`fitting.store`, atomically) under ``cache_dir/<task>-<key>``; the key hashes the task
(:func:`fitting.task_fingerprint`), the tokenized training and validation prompts and label
tokens (so the prompt spec and the tokenizer), the :class:`LanguageTrainConfig` with its seed,
the model's weights (:func:`lang_eval.model_fingerprint`) and :data:`CODE_VERSION`; a task's
key is that of the config it trains with (:func:`fitting.task_config`).

Export (:func:`export_peft`): a trained adapter is written as a PEFT folder with
``nu.peft.save_adapter`` under the transformers module names (:func:`llama.peft_names`), which
``peft.PeftModel.from_pretrained`` loads on transformers' ``LlamaForCausalLM``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ...errors import InputError
from ..data import lang_tasks as lt
from ..harness import fitting as ft
from ..harness.trainer import Batch, LoraTrainer, TaskRun, lora_state, train_cached
from ..models import llama
from . import lang_eval as le

__all__ = [
    "CODE_VERSION",
    "SORT_GROUPS",
    "LanguageTrainConfig",
    "Trainer",
    "cache_key",
    "epoch_batches",
    "export_peft",
    "lora_adapter",
    "train_task",
    "train_tasks",
]

#: Bump when a change to this module changes what training produces: invalidates every cache.
CODE_VERSION = 1
#: Batches whose prompts are sorted by length together (less padding, still shuffled).
SORT_GROUPS = 4


@dataclasses.dataclass(frozen=True)
class LanguageTrainConfig(ft.TrainConfigBase):
    """Everything that determines a trained adapter besides the task, its prompts and the model.

    The fields of :class:`fitting.TrainConfigBase` (LoRA rank and alpha, AdamW and its
    schedule, validation and patience; the names of :class:`train.TrainConfig`, so that the
    experiment's report reads both), and:

    Attributes:
      rows: prompts per step.
      row_len: most tokens a prompt may have (texts are cut to fit; evaluation prompts too).
      chat: prompts use the model's chat template (:func:`lang_tasks.format_prompt`).
      seed: data order and initialization.
    """

    rows: int = 16
    row_len: int = 40
    learning_rate: float = 1e-3
    warmup_fraction: float = 0.1
    max_steps: int = 300
    chat: bool = False
    seed: int = 0


def epoch_batches(
    lengths: np.ndarray, *, rows: int, seed: np.random.SeedSequence
) -> list[np.ndarray]:
    """One epoch as batches of prompt indices (see the module docstring).

    Every prompt is in exactly one batch; every batch has ``rows`` prompts but the last (fewer).
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    order = rng.permutation(len(lengths))
    out: list[np.ndarray] = []
    group = rows * SORT_GROUPS
    for s in range(0, len(order), group):
        g = order[s : s + group]
        g = g[np.argsort(-np.asarray(lengths)[g], kind="stable")]
        out += [g[k : k + rows] for k in range(0, len(g), rows)]
    perm = rng.permutation(len(out))
    return [out[i] for i in perm]


def lora_adapter(model: llama.Llama) -> dict[str, dict[str, Any]]:
    """The model's LoRA factors as float32 numpy modules, ``nu.nnx.extract_adapter`` names."""
    import netutility_jax as nu

    return ft.host_adapter(nu.nnx.extract_adapter(model))


class Trainer(LoraTrainer):
    """Trains task LoRAs on one shared base decoder (the language suite's part of
    :class:`trainer.LoraTrainer`: its loss, initial state, adapter and padded batches); the
    jitted step compiles once per bucket (and per schedule length, when ``step_scale`` gives a
    task another).

    Args:
      config: hyperparameters.
      model: the base :class:`llama.Llama` (no adapters).
      tokenizer: its tokenizer.
      scorer: a :class:`lang_eval.Scorer` of ``model`` for validation (default made here).
    """

    where = "lang_train.Trainer"
    report_slots = True

    def __init__(
        self,
        config: LanguageTrainConfig,
        model: llama.Llama,
        tokenizer: Any,
        *,
        scorer: le.Scorer | None = None,
    ):
        if model.lora is not None:
            raise InputError(
                "lang_train.Trainer: the model has LoRA adapters; pass the base model, the trainer "
                "adds fresh ones per task."
            )
        self.model, self.tokenizer = model, tokenizer
        self.scorer = le.Scorer(model) if scorer is None else scorer
        self.lora = llama.LoRAConfig(config.lora_rank, config.lora_alpha)
        lmodel = llama.add_lora(model, self.lora, rngs=nnx.Rngs(0))
        self.graphdef, _, base_state = nnx.split(lmodel, nnx.LoRAParam, ...)
        graphdef = self.graphdef

        def loss_fn(lora, base, ids, mask, token_ids, n_labels, labels, valid):
            m = nnx.merge(graphdef, lora, base)
            z = llama.last_token_logits(m, ids, mask, token_ids=token_ids)
            z = jnp.where(jnp.arange(z.shape[-1]) < n_labels, z, ft.MASKED_LOGIT)
            ce = optax.softmax_cross_entropy_with_integer_labels(z, labels)
            w = valid.astype(ce.dtype)
            return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)

        super().__init__(config, loss_fn, base_state)
        self._tx, self._step = self._optimizer(config.max_steps)
        self._loss = jax.jit(loss_fn)

    def init(self, name: str) -> Any:
        """Fresh LoRA factors for task ``name`` (``A`` from ``fitting.init_seed``, ``B = 0``)."""
        return lora_state(
            llama.add_lora(self.model, self.lora, rngs=nnx.Rngs(ft.init_seed(self.config, name)))
        )

    def adapter(self, lora: Any) -> dict[str, dict[str, Any]]:
        """The adapter (float32 numpy modules) of LoRA state ``lora``."""
        return lora_adapter(nnx.merge(self.graphdef, lora, self.base_state))

    def batch(
        self, ids: np.ndarray, lengths: np.ndarray, labels: np.ndarray, chosen: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, mask, labels, valid)`` of one step: ``rows`` rows padded to a bucket."""
        rows = self.config.rows
        (b,) = lt.batches(
            ids, lengths, np.asarray(chosen), rows=rows, pad_id=lt.pad_id(self.tokenizer)
        )
        valid = b.index >= 0
        lab = np.where(valid, labels[np.maximum(b.index, 0)], 0).astype(np.int32)
        return b.ids, b.mask, lab, valid

    def token_ids(self, head: lt.PromptHead) -> tuple[jax.Array, jax.Array]:
        """The head's label tokens padded to a fixed width, and their number."""
        k = len(head.token_ids)
        width = ft.label_width(k)
        pad = np.zeros(width, np.int32)
        pad[:k] = head.token_ids
        return jnp.asarray(pad), jnp.asarray(k, jnp.int32)

    def step(self, lora, opt_state, head: lt.PromptHead, ids, mask, labels, valid):
        """One optimizer step on a batch; returns ``(lora, opt_state, loss)`` (inputs donated)."""
        tok, k = self.token_ids(head)
        return self._step(lora, opt_state, self.base_state, ids, mask, tok, k, labels, valid)

    def loss(self, lora, head: lt.PromptHead, ids, mask, labels, valid) -> float:
        """The training loss of a batch (no update)."""
        tok, k = self.token_ids(head)
        return float(self._loss(lora, self.base_state, ids, mask, tok, k, labels, valid))

    def _val(self, adapter, val: lt.PromptSet) -> tuple[float, float]:
        z = self.scorer.logits(val, adapter)
        acc = float((val.predict(z) == val.labels).mean())
        return acc, float(-val.log_probs(z).mean())

    def prepare(
        self, task: Any, head: lt.PromptHead, cfg: LanguageTrainConfig, val: lt.PromptSet | None
    ) -> TaskRun:
        """Task ``task`` (a ``tasks.Task``) with its prompt ``head``: batches of ``rows``
        prompts (:func:`epoch_batches`), validation on ``val`` (default made from
        ``task.val``)."""
        _, ids, lengths = lt.encode_prompts(
            self.tokenizer, head, list(task.train.texts), max_len=cfg.row_len, chat=cfg.chat
        )
        labels = np.asarray(task.train.labels, np.int32)
        if val is None:
            val = lt.make_prompt_set(
                self.tokenizer, [head], [task.val], max_len=cfg.row_len, chat=cfg.chat
            )
        tok, k = self.token_ids(head)

        def epoch(seed: np.random.SeedSequence) -> list[np.ndarray]:
            return epoch_batches(lengths, rows=cfg.rows, seed=seed)

        def batch(chosen: np.ndarray, done: int) -> Batch:
            b_ids, b_mask, b_lab, b_valid = self.batch(ids, lengths, labels, chosen)
            args = (b_ids, b_mask, tok, k, b_lab, b_valid)
            return Batch(args, int(lengths[chosen].sum()), b_ids.shape, b_ids.size)

        def validate(lora) -> tuple[float, float]:
            return self._val(self.adapter(lora), val)

        return TaskRun(epoch, batch, validate)


# ------------------------------------------------------------------------------------ caching


def _prompts_fingerprint(
    tokenizer: Any, task: Any, head: lt.PromptHead, config: LanguageTrainConfig
) -> str:
    h = hashlib.sha256(np.asarray(head.token_ids, np.int32).tobytes())
    for split in (task.train, task.val):
        _, ids, lengths = lt.encode_prompts(
            tokenizer, head, list(split.texts), max_len=config.row_len, chat=config.chat
        )
        h.update(np.ascontiguousarray(ids).tobytes())
        h.update(np.ascontiguousarray(lengths).tobytes())
    return h.hexdigest()


def cache_key(
    task: Any, head: lt.PromptHead, config: LanguageTrainConfig, *, tokenizer: Any, weights: str
) -> tuple[str, dict[str, Any]]:
    """``(hex key, the document hashed)`` naming the result of training ``task`` (module doc)."""
    what = {
        "code_version": CODE_VERSION,
        "suite": "language",
        "task": ft.task_fingerprint(task),
        "prompts": _prompts_fingerprint(tokenizer, task, head, config),
        "spec": dataclasses.asdict(head.spec),
        "config": ft.config_key_doc(config),
        "weights": weights,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest(), what


def train_task(
    task: Any,
    head: lt.PromptHead,
    config: LanguageTrainConfig,
    *,
    tokenizer: Any,
    weights: str,
    cache_dir: str | os.PathLike | None = None,
    trainer: Trainer | Callable[[], Trainer] | None = None,
    progress: Callable[[int, dict], None] | None = None,
) -> ft.TrainedTask:
    """Train ``task`` with ``config``, or load the result from the cache if it is there.

    Args:
      task: a ``tasks.Task``.
      head: its :class:`lang_tasks.PromptHead`.
      config: hyperparameters and seed; the task trains with, and is cached under,
        ``fitting.task_config(config, task.name)``.
      tokenizer: the model's tokenizer (the prompts' tokens are in the cache key).
      weights: the model's fingerprint (:func:`lang_eval.model_fingerprint`).
      cache_dir: cache directory (default :func:`fitting.default_cache_dir` ``/ "language"``).
      trainer: a :class:`Trainer` for ``config`` (or a callable making one, called only on a
        cache miss).
      progress: ``progress(step, stats)`` after each training step.

    Returns:
      ``fitting.TrainedTask``; ``info["cache_hit"]`` says whether it came from the cache.
    """
    cache_dir = (
        ft.default_cache_dir() / "language" if cache_dir is None else pathlib.Path(cache_dir)
    )
    own = ft.task_config(config, task.name)
    key, what = cache_key(task, head, own, tokenizer=tokenizer, weights=weights)
    doc = {**what, "task_name": task.name, "key": key}
    return train_cached(
        task, head, config, kind=Trainer, trainer=trainer, cache_dir=cache_dir, key=key,
        key_doc=doc, where="lang_train.train_task", progress=progress,
    )  # fmt: skip


def train_tasks(
    tasks: Sequence[Any],
    heads: Sequence[lt.PromptHead],
    config: LanguageTrainConfig,
    *,
    model: llama.Llama,
    tokenizer: Any,
    weights: str,
    scorer: le.Scorer | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[ft.TrainedTask]:
    """Train (or load from the cache) every task, with a tqdm bar per task.

    One :class:`Trainer` is made on the first cache miss and shared by all tasks. ``log`` gets
    one line per task when it is done.
    """
    trainer = functools.cache(lambda: Trainer(config, model, tokenizer, scorer=scorer))

    def one(task: Any, head: lt.PromptHead, tick: Callable[[int, dict], None]) -> ft.TrainedTask:
        return train_task(
            task, head, config, tokenizer=tokenizer, weights=weights, cache_dir=cache_dir,
            trainer=trainer, progress=tick,
        )  # fmt: skip

    return ft.train_each(tasks, heads, config, one, progress=progress, log=log)


# ------------------------------------------------------------------------------------- export


def export_peft(
    adapter: Mapping[str, Any] | ft.TrainedTask,
    path: str | os.PathLike,
    **config: Any,
) -> dict[str, Any]:
    """Write a trained (or merged) adapter as a PEFT LoRA folder for transformers' Llama.

    Module names become transformers' (:func:`llama.peft_names`) and the folder is written by
    ``nu.peft.save_adapter`` (``task_type="CAUSAL_LM"`` unless ``config`` says otherwise), so
    ``peft.PeftModel.from_pretrained(LlamaForCausalLM..., path)`` reproduces the update.

    Returns:
      The config written to ``adapter_config.json``.
    """
    import netutility_jax as nu

    if isinstance(adapter, ft.TrainedTask):
        adapter = adapter.adapter
    return nu.peft.save_adapter(
        llama.peft_names(adapter), path, **{"task_type": "CAUSAL_LM", **config}
    )
