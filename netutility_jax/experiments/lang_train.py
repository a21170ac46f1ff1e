"""Train one LoRA per task on the decoder, scored through its own LM head; cached; PEFT export.

Per task (:meth:`Trainer.fit`): the base decoder (SmolLM2-135M-Instruct by default) with LoRA
rank 16, alpha 16 on ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` of every layer
(:func:`llama.add_lora`); **only the LoRA factors train**. The loss is the cross-entropy of the
prompt's label among the task's label words: the LM head's logits of the words' first tokens at
the last prompt position (``llama.last_token_logits`` with ``token_ids``), the same restricted
head the evaluation scores with (:mod:`lang_eval`), so training optimises what is measured.

Optimisation, as the encoder experiment (:mod:`train`): AdamW (optax) with a linear warmup over
``warmup_fraction`` of ``max_steps`` and a cosine decay to 0 at ``max_steps``; validation
accuracy every ``eval_every`` steps (the adapter folded into the kernels, :class:`lang_eval.Scorer`);
the best adapter (validation accuracy, then loss) is kept; training stops after ``patience``
evaluations without a better one. The curves are returned in ``info``.

Batches: ``rows`` prompts a step, right padded to a multiple of :data:`lang_tasks.BUCKET`
tokens (one compiled step per bucket). Each epoch is a permutation of the training prompts;
groups of :data:`SORT_GROUPS` consecutive batches are sorted by length within the group (less
padding), and the batches are then shuffled. A last short batch is filled with masked rows.

Deterministic from ``LanguageTrainConfig.seed``: the ``A`` factors are drawn from
``nnx.Rngs(SeedSequence([seed, crc32(task name)]))``, each epoch's order from a PCG64 stream of
``(seed, crc32(task name), 1, epoch)``.

Caching (:func:`train_task`): the trained adapter is stored with ``nu.checkpoint`` (through
:func:`train.store`, atomically) under ``cache_dir/<task>-<key>``; the key hashes the task
(:func:`train.task_fingerprint`), the tokenized training and validation prompts and label
tokens (so the prompt spec and the tokenizer), the :class:`LanguageTrainConfig` with its seed,
the model's weights (:func:`lang_eval.model_fingerprint`) and :data:`CODE_VERSION`.

Export (:func:`export_peft`): a trained adapter is written as a PEFT folder with
``nu.peft.save_adapter`` under the transformers module names (:func:`llama.peft_names`), which
``peft.PeftModel.from_pretrained`` loads on transformers' ``LlamaForCausalLM``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ..errors import InputError
from . import lang_eval as le
from . import lang_tasks as lt
from . import llama
from . import train as tr

#: Bump when a change to this module changes what training produces: invalidates every cache.
CODE_VERSION = 1
#: Batches whose prompts are sorted by length together (less padding, still shuffled).
SORT_GROUPS = 4
_LABEL_PAD = 8
_MASKED_LOGIT = -1e9


@dataclasses.dataclass(frozen=True)
class LanguageTrainConfig:
    """Everything that determines a trained adapter besides the task, its prompts and the model.

    The field names follow :class:`train.TrainConfig` (``rows``, ``row_len``, ...) so that the
    experiment's report reads both.

    Attributes:
      lora_rank, lora_alpha: LoRA ``r`` and alpha (update scaled by ``alpha / r``).
      rows: prompts per step.
      row_len: most tokens a prompt may have (texts are cut to fit; evaluation prompts too).
      learning_rate: AdamW peak learning rate.
      weight_decay: AdamW decoupled weight decay.
      warmup_fraction: fraction of ``max_steps`` with a linear warmup from 0.
      max_steps: the schedule's length (cosine decay to 0 there) and the most steps run.
      eval_every: steps between validation evaluations (and one at the end).
      patience: stop after this many evaluations without a better validation accuracy.
      chat: prompts use the model's chat template (:func:`lang_tasks.format_prompt`).
      seed: data order and initialization.
    """

    lora_rank: int = 16
    lora_alpha: float = 16.0
    rows: int = 16
    row_len: int = 40
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    max_steps: int = 300
    eval_every: int = 25
    patience: int = 4
    chat: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("lora_rank", "rows", "row_len", "max_steps", "eval_every", "patience"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"LanguageTrainConfig: {name}={v!r}; expected an integer >= 1.")

    def schedule(self) -> optax.Schedule:
        """Linear warmup to ``learning_rate``, then cosine decay to 0 at ``max_steps``.

        The step count is cast to float32 (strict dtype promotion refuses optax mixing an
        integer count with float constants).
        """
        warm = max(round(self.warmup_fraction * self.max_steps), 1)
        sched = optax.warmup_cosine_decay_schedule(
            0.0, self.learning_rate, warm, max(self.max_steps, warm + 1), end_value=0.0
        )
        return lambda step: sched(jnp.asarray(step, jnp.float32))


def _task_seed(config: LanguageTrainConfig, name: str, *more: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([config.seed, zlib.crc32(name.encode()), *more])


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

    return {
        name: {
            "lora_a": np.asarray(m["lora_a"], np.float32),
            "lora_b": np.asarray(m["lora_b"], np.float32),
            "scale": float(m["scale"]),
        }
        for name, m in nu.nnx.extract_adapter(model).items()
    }


class Trainer:
    """Trains task LoRAs on one shared base decoder; the jitted step compiles once per bucket.

    Args:
      config: hyperparameters.
      model: the base :class:`llama.Llama` (no adapters).
      tokenizer: its tokenizer.
      scorer: a :class:`lang_eval.Scorer` of ``model`` for validation (default made here).
    """

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
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.scorer = le.Scorer(model) if scorer is None else scorer
        self.lora = llama.LoRAConfig(config.lora_rank, config.lora_alpha)
        lmodel = llama.add_lora(model, self.lora, rngs=nnx.Rngs(0))
        self.graphdef, _, self.base_state = nnx.split(lmodel, nnx.LoRAParam, ...)
        graphdef = self.graphdef
        tx = optax.adamw(config.schedule(), weight_decay=config.weight_decay)
        self._tx = tx

        def loss_fn(lora, base, ids, mask, token_ids, n_labels, labels, valid):
            m = nnx.merge(graphdef, lora, base)
            z = llama.last_token_logits(m, ids, mask, token_ids=token_ids)
            z = jnp.where(jnp.arange(z.shape[-1]) < n_labels, z, _MASKED_LOGIT)
            ce = optax.softmax_cross_entropy_with_integer_labels(z, labels)
            w = valid.astype(ce.dtype)
            return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)

        def step(lora, opt_state, base, ids, mask, token_ids, n_labels, labels, valid):
            loss, grads = jax.value_and_grad(loss_fn)(
                lora, base, ids, mask, token_ids, n_labels, labels, valid
            )
            # optax's bias correction raises floats to the int32 step count: allowed under
            # standard promotion only (the test suite runs with strict promotion)
            with jax.numpy_dtype_promotion("standard"):
                updates, opt_state = tx.update(grads, opt_state, lora)
                lora = optax.apply_updates(lora, updates)
            return lora, opt_state, loss

        self._step = jax.jit(step, donate_argnums=(0, 1))
        self._loss = jax.jit(loss_fn)
        self.fits = 0

    def init(self, name: str) -> Any:
        """Fresh LoRA factors for task ``name`` (``A`` from the task's seed, ``B = 0``)."""
        seed = int(_task_seed(self.config, name).generate_state(1)[0])
        m = llama.add_lora(self.model, self.lora, rngs=nnx.Rngs(seed))
        return jax.tree.map(jnp.array, nnx.state(m, nnx.LoRAParam))  # own buffers: donated

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
        width = max(_LABEL_PAD, -(-k // _LABEL_PAD) * _LABEL_PAD)
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

    def fit(
        self,
        task: Any,
        head: lt.PromptHead,
        *,
        val: lt.PromptSet | None = None,
        progress: Callable[[int, dict], None] | None = None,
    ) -> tr.TrainedTask:
        """Train ``task`` (a ``tasks.Task``) with its prompt ``head``; no caching.

        Args:
          task: the task (its ``train`` split trains, its ``val`` split validates).
          head: its :class:`lang_tasks.PromptHead`.
          val: the validation prompts (default made from ``task.val``).
          progress: ``progress(step, stats)`` after each step.
        """
        cfg = self.config
        if len(task.train) == 0:
            raise InputError(
                f"lang_train.Trainer.fit: task {task.name!r} has an empty train split."
            )
        t0 = time.perf_counter()
        self.fits += 1
        _, ids, lengths = lt.encode_prompts(
            self.tokenizer, head, list(task.train.texts), max_len=cfg.row_len, chat=cfg.chat
        )
        labels = np.asarray(task.train.labels, np.int32)
        if val is None:
            val = lt.make_prompt_set(
                self.tokenizer, [head], [task.val], max_len=cfg.row_len, chat=cfg.chat
            )
        lora = self.init(task.name)
        opt_state = self._tx.init(lora)
        sched = cfg.schedule()

        history: list[dict[str, Any]] = []
        best = (-1.0, np.inf)
        best_step, best_lora = 0, jax.device_get(lora)
        since_best, step, epoch, losses, seen = 0, 0, 0, [], 0
        stopped_early = False
        t_steps, n_timed, tok_timed, slot_timed = 0.0, 0, 0, 0
        shapes: set[tuple[int, int]] = set()
        while step < cfg.max_steps and not stopped_early:
            plan = epoch_batches(lengths, rows=cfg.rows, seed=_task_seed(cfg, task.name, 1, epoch))
            epoch += 1
            for chosen in plan:
                b_ids, b_mask, b_lab, b_valid = self.batch(ids, lengths, labels, chosen)
                ts = time.perf_counter()
                lora, opt_state, loss = self.step(
                    lora, opt_state, head, b_ids, b_mask, b_lab, b_valid
                )
                loss = float(loss)
                if b_ids.shape in shapes:  # a new shape compiles: not timed
                    t_steps += time.perf_counter() - ts
                    n_timed += 1
                    tok_timed += int(lengths[chosen].sum())
                    slot_timed += b_ids.size
                shapes.add(b_ids.shape)
                losses.append(loss)
                seen += len(chosen)
                step += 1
                stats: dict[str, Any] = {"loss": loss}
                if step % cfg.eval_every == 0 or step == cfg.max_steps:
                    acc, vloss = self._val(self.adapter(lora), val)
                    history.append(
                        {
                            "step": step,
                            "train_loss": float(np.mean(losses)),
                            "val_loss": vloss,
                            "val_accuracy": acc,
                            "lr": float(sched(step)),
                        }
                    )
                    losses = []
                    stats["val_accuracy"] = acc
                    if (acc, -vloss) > (best[0], -best[1]):
                        best, best_step, best_lora = (acc, vloss), step, jax.device_get(lora)
                        since_best = 0
                    else:
                        since_best += 1
                        stopped_early = since_best >= cfg.patience and step < cfg.max_steps
                if progress is not None:
                    progress(step, stats)
                if stopped_early or step >= cfg.max_steps:
                    break
        info = {
            "best_step": best_step,
            "best_val_accuracy": best[0],
            "best_val_loss": best[1],
            "steps": step,
            "max_steps": cfg.max_steps,
            "stopped_early": stopped_early,
            "epochs": epoch,
            "texts_seen": seen,
            "history": history,
            "train_seconds": time.perf_counter() - t0,
            "steps_per_second": n_timed / t_steps if t_steps > 0 else float("nan"),
            "tokens_per_second": tok_timed / t_steps if t_steps > 0 else float("nan"),
            "slot_tokens_per_second": slot_timed / t_steps if t_steps > 0 else float("nan"),
            "shapes": sorted(shapes),
        }
        return tr.TrainedTask(task.name, tuple(task.labels), self.adapter(best_lora), info)


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
        "task": tr.task_fingerprint(task),
        "prompts": _prompts_fingerprint(tokenizer, task, head, config),
        "spec": dataclasses.asdict(head.spec),
        "config": dataclasses.asdict(config),
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
) -> tr.TrainedTask:
    """Train ``task`` with ``config``, or load the result from the cache if it is there.

    Args:
      task: a ``tasks.Task``.
      head: its :class:`lang_tasks.PromptHead`.
      config: hyperparameters and seed.
      tokenizer: the model's tokenizer (the prompts' tokens are in the cache key).
      weights: the model's fingerprint (:func:`lang_eval.model_fingerprint`).
      cache_dir: cache directory (default :func:`train.default_cache_dir` ``/ "language"``).
      trainer: a :class:`Trainer` for ``config`` (or a callable making one, called only on a
        cache miss).
      progress: ``progress(step, stats)`` after each training step.

    Returns:
      ``train.TrainedTask``; ``info["cache_hit"]`` says whether it came from the cache.
    """
    cache_dir = (
        tr.default_cache_dir() / "language" if cache_dir is None else pathlib.Path(cache_dir)
    )
    key, what = cache_key(task, head, config, tokenizer=tokenizer, weights=weights)
    path = tr.cache_path(cache_dir, task, key)
    hit = tr.load_cached(path)
    if hit is not None:
        return hit._replace(info={**hit.info, "cache_key": key, "cache_hit": True})
    if trainer is None:
        raise InputError(
            f"lang_train.train_task: {task.name!r} is not in the cache {cache_dir}; pass a "
            "trainer to train it."
        )
    if not isinstance(trainer, Trainer):
        trainer = trainer()
    if trainer.config != config:
        raise InputError(
            f"lang_train.train_task: the trainer was built for {trainer.config} but config is "
            f"{config}; pass a Trainer(config, ...)."
        )
    trained = trainer.fit(task, head, progress=progress)
    trained = trained._replace(info={**trained.info, "cache_key": key})
    tr.store(path, trained, {**what, "task_name": task.name, "key": key})
    return trained._replace(info={**trained.info, "cache_hit": False})


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
) -> list[tr.TrainedTask]:
    """Train (or load from the cache) every task, with a tqdm bar per task.

    One :class:`Trainer` is made on the first cache miss and shared by all tasks. ``log`` gets
    one line per task when it is done.
    """
    from tqdm import tqdm

    made: list[Trainer] = []

    def get_trainer() -> Trainer:
        if not made:
            made.append(Trainer(config, model, tokenizer, scorer=scorer))
        return made[0]

    out = []
    for task, head in zip(tasks, heads, strict=True):
        bar = tqdm(
            total=config.max_steps,
            desc=f"train {task.name} (seed {config.seed})",
            disable=not progress,
            leave=False,
            mininterval=1.0,
            dynamic_ncols=True,
        )

        def tick(step, stats, bar=bar):
            bar.update(1)
            if "val_accuracy" in stats:
                bar.set_postfix(loss=f"{stats['loss']:.3f}", val=f"{stats['val_accuracy']:.3f}")

        with bar:
            t = train_task(
                task,
                head,
                config,
                tokenizer=tokenizer,
                weights=weights,
                cache_dir=cache_dir,
                trainer=get_trainer,
                progress=tick,
            )
        if log is not None:
            i = t.info
            how = (
                "cached"
                if i["cache_hit"]
                else f"trained {i['steps']} steps in {i['train_seconds']:.0f} s "
                f"({i['tokens_per_second']:.0f} tokens/s)"
            )
            log(
                f"{task.name} (seed {config.seed}): {how}; best validation accuracy "
                f"{i['best_val_accuracy']:.3f} at step {i['best_step']}"
            )
        out.append(t)
    return out


# ------------------------------------------------------------------------------------- export


def export_peft(
    adapter: Mapping[str, Any] | tr.TrainedTask,
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

    if isinstance(adapter, tr.TrainedTask):
        adapter = adapter.adapter
    return nu.peft.save_adapter(
        llama.peft_names(adapter), path, **{"task_type": "CAUSAL_LM", **config}
    )
