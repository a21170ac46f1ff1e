"""The pieces of every suite's training: the configs, the loop, the adapter cache, the bars.

The suites that train (:mod:`train` for MiniLM, :mod:`lang_train` for the decoder,
:mod:`nli_head` for NLI with its head) train one LoRA per task the same way, through one
trainer (:class:`trainer.LoraTrainer`, which composes these pieces), and differ only in their
model, batches and loss:

* :class:`TrainConfigBase`: the integer checks and the learning-rate schedule of their configs
  (AdamW with a linear warmup over ``warmup_fraction`` of ``max_steps``, cosine decay to 0 at
  ``max_steps``);
* :func:`optimizers`: ``optax.adamw`` with that schedule and the jitted step;
* :func:`fit_early_stopping`: epochs of steps, validation every ``eval_every`` steps, the best
  adapter kept (validation accuracy, then loss), early stopping after ``patience`` evaluations
  without a better one, the curves; :class:`StepClock` times the steps that did not compile;
* the adapter cache: :func:`cached_or_trained` loads a :class:`TrainedTask` from
  ``cache_dir/<task>-<key>`` (:func:`cache_path`, :func:`load_cached`) or trains and stores it
  (:func:`store`: ``nu.checkpoint`` in a staging folder renamed into place, with the document
  the key hashes as ``key.json``);
* :func:`train_each`: every task with its progress bar and a log line.

Randomness is per task (:func:`task_seed`: ``SeedSequence([seed, crc32(task name), ...])``),
except the LoRA's initial state under ``init="shared"`` (:func:`init_seed`). A task trains with
:func:`task_config` (its ``step_scale``); :func:`config_key_doc` is the config as cache keys
hash it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import numbers
import os
import pathlib
import shutil
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ...errors import InputError
from . import records

__all__ = [
    "CACHE_ENV",
    "DEFAULT_CACHE_DIR",
    "MASKED_LOGIT",
    "FitOutcome",
    "StepClock",
    "TrainConfigBase",
    "TrainedTask",
    "cache_path",
    "cached_or_trained",
    "config_key_doc",
    "default_cache_dir",
    "export_cached",
    "fit_early_stopping",
    "host_adapter",
    "init_seed",
    "label_width",
    "load_cached",
    "optimizers",
    "store",
    "task_config",
    "task_fingerprint",
    "task_seed",
    "train_each",
]

CACHE_ENV = "NETUTILITY_CACHE"
DEFAULT_CACHE_DIR = pathlib.Path("~/.cache/netutility-jax/demo")
#: The logit of a padded label slot (so that the softmax gives it nothing).
MASKED_LOGIT = -1e9
_LABEL_PAD = 8
_INIT_MODES = ("per_task", "shared")
#: Fields added after adapters were cached: left out of a cache key at their defaults, so a
#: config that does not use them keeps the key (and the hours of training) it had before.
_ADDED_FIELDS = ("init", "step_scale", "lr_scale")


def label_width(n: int) -> int:
    """The padded number of label slots for ``n`` labels: a multiple of 8 (one compiled
    training step for every task of up to that many labels)."""
    return max(_LABEL_PAD, -(-n // _LABEL_PAD) * _LABEL_PAD)


@dataclasses.dataclass(frozen=True)
class TrainConfigBase:
    """The settings both suites' training configs have (``train.TrainConfig``,
    ``lang_train.LanguageTrainConfig``), their checks and their learning-rate schedule.

    A suite's config redeclares the defaults it changes and adds its own fields (then ``seed``,
    last).

    Attributes:
      lora_rank, lora_alpha: LoRA ``r`` and alpha (update scaled by ``alpha / r``).
      rows, row_len: a step's rows, and the most tokens a text may have (longer ones are cut;
        the suite's config says how texts fill the rows).
      learning_rate: AdamW peak learning rate.
      weight_decay: AdamW decoupled weight decay.
      warmup_fraction: fraction of ``max_steps`` with a linear warmup from 0.
      max_steps: the schedule's length (cosine decay to 0 there) and the most steps run.
      eval_every: steps between validation evaluations (and one at the end).
      patience: stop after this many evaluations without a better validation accuracy.
      init: where the LoRA's initial state (the random ``A``) comes from (:func:`init_seed`):
        ``"per_task"`` (this project's earlier default), a seed of ``seed`` and the task's name,
        so tasks' ``A`` differ and their input subspaces overlap only by chance; or
        ``"shared"``, the paper's codebase's regime (it seeds once before building the LoRA),
        a seed of ``seed`` alone, so every task starts from the same ``A``. The data order is
        per task either way.
      step_scale: ``((task name, multiplier), ...)``: a named task trains ``multiplier`` times
        ``max_steps`` (:func:`task_config`), to make tasks differ on purpose; the others train
        ``max_steps``. Stored as ``(str, float)`` pairs sorted by name.
      lr_scale: ``((task name, multiplier), ...)``: a named task trains with ``multiplier``
        times ``learning_rate``; with ``step_scale``, the way to make some tasks' updates
        larger than others' (task heterogeneity ``h``) on purpose. Stored as ``step_scale``.
    """

    lora_rank: int = 16
    lora_alpha: float = 16.0
    rows: int = 8
    row_len: int = 32
    learning_rate: float = 2e-3
    weight_decay: float = 0.01
    warmup_fraction: float = 0.05
    max_steps: int = 600
    eval_every: int = 25
    patience: int = 4
    init: str = "per_task"
    step_scale: tuple[tuple[str, float], ...] = ()
    lr_scale: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        cls = type(self).__name__
        for name in ("lora_rank", "rows", "row_len", "max_steps", "eval_every", "patience"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"{cls}: {name}={v!r}; expected an integer >= 1.")
        if self.init not in _INIT_MODES:
            raise InputError(f"{cls}: init={self.init!r}; expected one of {_INIT_MODES}.")
        # one spelling per meaning (lists, ints, order): equal configs compare and hash equal
        object.__setattr__(self, "step_scale", _checked_step_scale(cls, self.step_scale))
        object.__setattr__(
            self, "lr_scale", _checked_step_scale(cls, self.lr_scale, field="lr_scale")
        )

    def schedule(self) -> optax.Schedule:
        """Linear warmup to ``learning_rate``, then cosine decay to 0 at ``max_steps``.

        The step count is cast to float32 first (optax mixes it with float constants, which
        strict dtype promotion refuses for an integer count).
        """
        warm = max(round(self.warmup_fraction * self.max_steps), 1)
        sched = optax.warmup_cosine_decay_schedule(
            0.0, self.learning_rate, warm, max(self.max_steps, warm + 1), end_value=0.0
        )
        return lambda step: sched(jnp.asarray(step, jnp.float32))


def _checked_step_scale(
    cls: str, value: Any, *, field: str = "step_scale"
) -> tuple[tuple[str, float], ...]:
    """``value`` as ``(name, float multiplier)`` pairs sorted by name; InputError if it is not
    pairs of distinct string names and finite multipliers > 0."""
    bad = InputError(
        f"{cls}: {field}={value!r}; expected (task name, multiplier) pairs with distinct "
        "string names and finite multipliers > 0."
    )
    try:
        pairs = [(n, m) for n, m in value]
    except (TypeError, ValueError):
        raise bad from None
    names = [n for n, _ in pairs]
    if not all(isinstance(n, str) for n in names) or len(set(names)) < len(names):
        raise bad
    for _, m in pairs:
        if isinstance(m, bool) or not isinstance(m, numbers.Real) or not 0 < m < math.inf:
            raise bad
    return tuple(sorted((n, float(m)) for n, m in pairs))


def optimizers(
    config: TrainConfigBase, loss_fn: Callable[..., jax.Array]
) -> Callable[[int], tuple[optax.GradientTransformation, Callable]]:
    """Both suites' optimizer and training step, one per schedule length and learning rate.

    Returns ``build(max_steps, learning_rate=None) -> (tx, step)``, cached per pair (a task's
    ``step_scale`` changes its schedule's length, its ``lr_scale`` its learning rate; None:
    ``config``'s): ``tx`` is ``optax.adamw`` with ``config``'s
    schedule (:meth:`TrainConfigBase.schedule`) and decoupled weight decay, and ``step(lora,
    opt_state, *batch) -> (lora, opt_state, loss)`` one AdamW step on ``loss_fn(lora, *batch)``,
    jitted, with the LoRA and the optimizer state donated.
    """

    def build(
        max_steps: int, learning_rate: float | None = None
    ) -> tuple[optax.GradientTransformation, Callable]:
        lr = config.learning_rate if learning_rate is None else float(learning_rate)
        return _build(max_steps, lr)

    @functools.cache
    def _build(
        max_steps: int, learning_rate: float
    ) -> tuple[optax.GradientTransformation, Callable]:
        cfg = dataclasses.replace(config, max_steps=max_steps, learning_rate=learning_rate)
        tx = optax.adamw(cfg.schedule(), weight_decay=cfg.weight_decay)

        def step(lora, opt_state, *batch):
            loss, grads = jax.value_and_grad(loss_fn)(lora, *batch)
            # optax's bias correction and schedule raise floats to an int32 step count: allowed
            # under standard promotion only (the test suite runs with strict promotion)
            with jax.numpy_dtype_promotion("standard"):
                updates, opt_state = tx.update(grads, opt_state, lora)
                lora = optax.apply_updates(lora, updates)
            return lora, opt_state, loss

        return tx, jax.jit(step, donate_argnums=(0, 1))

    return build


class TrainedTask(NamedTuple):
    """A trained task: its LoRA adapter and what happened.

    Attributes:
      name: task name.
      labels: label names.
      adapter: ``{module: {"lora_a" (d_in, r), "lora_b" (r, d_out), "scale"}}`` (float32 numpy),
        module names ``layers/{i}/attention/{query,key,value,output}``.
      info: ``best_step``, ``best_val_accuracy``, ``best_val_loss``, ``steps``,
        ``stopped_early``, ``epochs``, ``texts_seen``, ``history``
        (``[{"step", "train_loss", "val_loss", "val_accuracy", "lr"}]``), ``train_seconds``,
        ``steps_per_second`` and ``tokens_per_second`` (compiling steps left out),
        ``cache_key``, ``cache_hit``.
    """

    name: str
    labels: tuple[str, ...]
    adapter: dict[str, dict[str, Any]]
    info: dict[str, Any]


def default_cache_dir() -> pathlib.Path:
    """``$NETUTILITY_CACHE`` if set, else ``~/.cache/netutility-jax/demo``."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env).expanduser() if env else DEFAULT_CACHE_DIR.expanduser()


def task_fingerprint(task: Any) -> str:
    """sha256 of a task's name, labels, label texts, and the texts and labels of every split."""
    h = hashlib.sha256()
    h.update(json.dumps([task.name, list(task.labels), list(task.label_texts)]).encode())
    for split in (task.train, task.val, task.test):
        h.update(json.dumps(list(split.texts), ensure_ascii=False).encode())
        h.update(np.asarray(split.labels, np.int64).tobytes())
    return h.hexdigest()


def _to_checkpoint(t: TrainedTask) -> dict[str, Any]:
    return {
        "name": t.name,
        "labels": list(t.labels),
        "adapter": t.adapter,
        "info": {k: v for k, v in t.info.items() if k != "cache_hit"},
    }


def host_adapter(modules: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{name: {"lora_a", "lora_b", "scale"}}`` with float32 numpy factors and a float scale
    (a trained adapter as it is stored, whatever arrays it came as)."""
    return {
        name: {
            "lora_a": np.asarray(m["lora_a"], np.float32),
            "lora_b": np.asarray(m["lora_b"], np.float32),
            "scale": float(m["scale"]),
        }
        for name, m in modules.items()
    }


def _from_checkpoint(obj: dict[str, Any]) -> TrainedTask:
    adapter = host_adapter(obj["adapter"])
    return TrainedTask(obj["name"], tuple(obj["labels"]), adapter, dict(obj["info"]))


def cache_path(cache_dir: str | os.PathLike, task: Any, key: str) -> pathlib.Path:
    return pathlib.Path(cache_dir) / f"{task.name}-{key[:20]}"


def load_cached(path: pathlib.Path) -> TrainedTask | None:
    """The trained task stored at ``path``, or None if there is none (or it is unreadable)."""
    from ... import checkpoint

    ckpt = path / "checkpoint"
    if not ckpt.exists():
        return None
    try:
        return _from_checkpoint(checkpoint.restore(ckpt))
    except (ValueError, KeyError, TypeError):
        return None


def export_cached(
    fn: str,
    run: Any,
    out: str | os.PathLike,
    cache_dir: pathlib.Path,
    load: Callable[[pathlib.Path], Any],
    write: Callable[[Any, pathlib.Path], None],
) -> list[pathlib.Path]:
    """Write every trained task of a run (``runner.Run``: its seeds' ``training`` cache keys) to
    ``<out>/seed<S>/<task>`` with ``write(trained, path)``, each read back by ``load`` from its
    entry under ``cache_dir`` (the suite's cache, as the run used it); the suites'
    ``export_adapters``.

    Raises:
      InputError: an entry is no longer in the cache (``fn``, the public call, names it).
    """
    written = []
    for s in run.seeds:
        for task in run.tasks:
            key = s.training[task.name]["cache_key"]
            trained = load(cache_path(cache_dir, task, key))
            if trained is None:
                raise InputError(
                    f"{fn}: the adapter of {task.name!r} (seed {s.seed}) is not in the cache "
                    f"{cache_dir}; pass the cache_dir the run used."
                )
            path = pathlib.Path(out) / f"seed{s.seed}" / task.name
            write(trained, path)
            written.append(path)
    return written


def store(path: pathlib.Path, trained: TrainedTask, key_doc: dict[str, Any]) -> None:
    """Write ``trained`` to ``path`` atomically: a staging folder renamed into place. An old
    (unreadable: a readable one is never retrained) entry there is replaced; if another process
    stores the same key meanwhile, its entry is kept (it is as good)."""
    from ... import checkpoint

    with records.atomic_directory(path, fn="train.store", on_exists="keep") as tmp:
        checkpoint.save(tmp / "checkpoint", _to_checkpoint(trained))
        records.write_json(tmp / "key.json", key_doc, sort_keys=True)
        if path.exists():
            shutil.rmtree(path)


def task_seed(config: Any, name: str, *more: int) -> np.random.SeedSequence:
    """The entropy of task ``name``'s randomness under ``config.seed`` (``more``: a stream)."""
    return np.random.SeedSequence([config.seed, zlib.crc32(name.encode()), *more])


def init_seed(config: Any, name: str) -> int:
    """The seed of task ``name``'s initial LoRA state (``nnx.Rngs(init_seed(...))``).

    Both suites' trainers draw their ``A`` factors from it, so they cannot diverge.

    Args:
      config: a :class:`TrainConfigBase`; ``config.init`` picks the regime: ``"per_task"``
        (this project's earlier default) mixes in the task's name (:func:`task_seed`), so
        every task starts from its own ``A``; ``"shared"`` (the paper's codebase, which seeds
        once before building the LoRA) depends on ``config.seed`` only, so every task starts
        from the same ``A``.
      name: the task's name.
    """
    if config.init == "shared":
        return int(np.random.SeedSequence([config.seed]).generate_state(1)[0])
    return int(task_seed(config, name).generate_state(1)[0])


def task_config(config: TrainConfigBase, name: str) -> TrainConfigBase:
    """The config task ``name`` trains with: ``max_steps`` times its ``step_scale`` multiplier
    (rounded, at least 1), ``learning_rate`` times its ``lr_scale`` multiplier, and both
    cleared.

    Clearing them makes a task's cache key depend on its own settings only: a task that
    neither names trains, and is cached, exactly as under a config without them (``config``
    itself when there are none).
    """
    if not config.step_scale and not config.lr_scale:
        return config
    steps = max(1, round(config.max_steps * dict(config.step_scale).get(name, 1.0)))
    lr = config.learning_rate * dict(config.lr_scale).get(name, 1.0)
    return dataclasses.replace(
        config, max_steps=steps, learning_rate=lr, step_scale=(), lr_scale=()
    )


def config_key_doc(config: TrainConfigBase) -> dict[str, Any]:
    """``dataclasses.asdict(config)`` as cache keys hash it: without the fields added after
    adapters were cached (``init``, ``step_scale``) where they have their defaults, so such a
    config keeps its old key; any other value of them is in the document, so it changes the
    key."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfigBase)}
    return {
        k: v
        for k, v in dataclasses.asdict(config).items()
        if not (k in _ADDED_FIELDS and v == defaults[k])
    }


class FitOutcome(NamedTuple):
    """What :func:`fit_early_stopping` returns.

    Attributes:
      best_lora: the LoRA state (on the host) with the best validation accuracy (then loss).
      info: ``best_step``, ``best_val_accuracy``, ``best_val_loss``, ``steps``, ``max_steps``,
        ``stopped_early``, ``epochs``, ``texts_seen``, ``history`` (``[{"step",
        "train_loss", "val_loss", "val_accuracy", "lr"}]``).
    """

    best_lora: Any
    info: dict[str, Any]


def fit_early_stopping(
    config: TrainConfigBase,
    lora: Any,
    opt_state: Any,
    *,
    plan: Callable[[int], Iterable[Sequence[int]]],
    step: Callable[[Any, Any, Sequence[int], int], tuple[Any, Any, float]],
    validate: Callable[[Any], tuple[float, float]],
    progress: Callable[[int, dict], None] | None = None,
) -> FitOutcome:
    """The training loop of both suites: epochs of steps, validation every ``eval_every`` steps
    (and at ``max_steps``), the best state kept, early stopping after ``patience`` evaluations
    without a better one (see the module docstring).

    Args:
      config: ``max_steps``, ``eval_every``, ``patience`` and ``schedule()`` (the learning rate
        recorded with each evaluation).
      lora, opt_state: the initial LoRA and optimizer states (donated to ``step``).
      plan: ``plan(epoch)`` -> the steps of epoch ``epoch`` (0, 1, ...), each the indices of
        its training texts.
      step: ``step(lora, opt_state, chosen, done)`` -> ``(lora, opt_state, loss)``: one
        optimizer step on the texts ``chosen``; ``done`` steps ran before it.
      validate: ``validate(lora)`` -> ``(accuracy, loss)`` on the validation split.
      progress: ``progress(step, stats)`` after each step (``stats``: ``loss``, and
        ``val_accuracy`` after an evaluation).
    """
    sched = config.schedule()
    history: list[dict[str, Any]] = []
    best = (-1.0, np.inf)
    best_step, best_lora = 0, jax.device_get(lora)
    since_best, done, epoch, losses, seen = 0, 0, 0, [], 0
    stopped_early = False
    while done < config.max_steps and not stopped_early:
        chosen_steps = plan(epoch)
        epoch += 1
        for chosen in chosen_steps:
            lora, opt_state, loss = step(lora, opt_state, chosen, done)
            losses.append(loss)
            seen += len(chosen)
            done += 1
            stats: dict[str, Any] = {"loss": loss}
            if done % config.eval_every == 0 or done == config.max_steps:
                acc, vloss = validate(lora)
                history.append(
                    {
                        "step": done,
                        "train_loss": float(np.mean(losses)),
                        "val_loss": vloss,
                        "val_accuracy": acc,
                        "lr": float(sched(done)),
                    }
                )
                losses = []
                stats["val_accuracy"] = acc
                if (acc, -vloss) > (best[0], -best[1]):
                    best, best_step, best_lora = (acc, vloss), done, jax.device_get(lora)
                    since_best = 0
                else:
                    since_best += 1
                    stopped_early = since_best >= config.patience and done < config.max_steps
            if progress is not None:
                progress(done, stats)
            if stopped_early or done >= config.max_steps:
                break
    info = {
        "best_step": best_step,
        "best_val_accuracy": best[0],
        "best_val_loss": best[1],
        "steps": done,
        "max_steps": config.max_steps,
        "stopped_early": stopped_early,
        "epochs": epoch,
        "texts_seen": seen,
        "history": history,
    }
    return FitOutcome(best_lora, info)


class StepClock:
    """Wall time and work of the training steps that did not compile (for the rates in
    ``TrainedTask.info``)."""

    def __init__(self) -> None:
        self.seconds, self.steps, self.tokens, self.slot_tokens = 0.0, 0, 0, 0

    def add(self, seconds: float, tokens: int, slot_tokens: int = 0) -> None:
        """Count one step of ``seconds`` on ``tokens`` real tokens (``slot_tokens`` with
        padding)."""
        self.seconds += seconds
        self.steps += 1
        self.tokens += tokens
        self.slot_tokens += slot_tokens

    def rates(self, *, slots: bool = False) -> dict[str, float]:
        """``steps_per_second``, ``tokens_per_second`` (and ``slot_tokens_per_second`` if
        ``slots``); NaN when no step was timed."""
        counts = {"steps": self.steps, "tokens": self.tokens}
        if slots:
            counts["slot_tokens"] = self.slot_tokens
        t = self.seconds
        return {f"{k}_per_second": n / t if t > 0 else float("nan") for k, n in counts.items()}


def cached_or_trained(
    path: pathlib.Path, key: str, key_doc: dict[str, Any], fit: Callable[[], TrainedTask]
) -> TrainedTask:
    """The trained task cached at ``path``, else ``fit()`` stored there (:func:`store`).

    ``info`` gets ``cache_key`` (``key``) and ``cache_hit``; ``key_doc`` (what ``key`` hashes)
    is stored beside the checkpoint as ``key.json``.
    """
    hit = load_cached(path)
    if hit is not None:
        return hit._replace(info={**hit.info, "cache_key": key, "cache_hit": True})
    trained = fit()
    trained = trained._replace(info={**trained.info, "cache_key": key})
    store(path, trained, key_doc)
    return trained._replace(info={**trained.info, "cache_hit": False})


def train_each(
    tasks: Sequence[Any],
    heads: Sequence[Any],
    config: TrainConfigBase,
    train_one: Callable[[Any, Any, Callable[[int, dict], None]], TrainedTask],
    *,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    total: Callable[[Any], int] | None = None,
) -> list[Any]:
    """``train_one(task, head, tick)`` for every task, with a tqdm bar per task that ``tick``
    advances; ``log`` gets one line per task when it is done. ``total(task)``: the bar's length
    (default ``task_config(config, task.name).max_steps``)."""
    from tqdm import tqdm

    out = []
    for task, head in zip(tasks, heads, strict=True):
        bar = tqdm(
            total=task_config(config, task.name).max_steps if total is None else total(task),
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
            t = train_one(task, head, tick)
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
