"""Train one LoRA adapter per task on MiniLM against the task's frozen zero-shot head, cached.

Per task (:meth:`Trainer.fit`): the pretrained MiniLM-L6 with ``nnx.LoRA`` rank 16, alpha 16 on
``query``, ``key``, ``value`` and the attention ``output`` of all 6 layers
(:func:`minilm.add_lora`). **Only the LoRA factors train**: the head is the task's frozen
zero-shot head (:func:`evaluate.zero_shot_heads`, cosine similarity to the base-model
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
``nnx.Rngs(SeedSequence([seed, crc32(task name)]))``, each epoch's order from a PCG64 stream of
``(seed, crc32(task name), epoch)``.

Caching (:func:`train_task`): the trained adapter is stored with ``nu.checkpoint`` under
``cache_dir/<task>-<key>``; the key hashes everything that determines the result (the task's
name, labels, label texts and every split, the :class:`TrainConfig` with its seed, the size and
modification time of the pretrained files, :data:`CODE_VERSION`). A checkpoint is written to a
temporary directory and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..errors import InputError
from . import evaluate as ev
from . import minilm

#: Bump when a change to this module changes what training produces: invalidates every cache.
CODE_VERSION = 2
CACHE_ENV = "NETUTILITY_CACHE"
DEFAULT_CACHE_DIR = pathlib.Path("~/.cache/netutility-jax/demo")
_LABEL_PAD = 8
_MASKED_LOGIT = -1e9


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a trained adapter besides the task data and the model files.

    Attributes:
      lora_rank, lora_alpha: LoRA ``r`` and alpha (update scaled by ``alpha / r``).
      rows, row_len: a step packs texts into ``rows`` rows of ``row_len`` tokens (texts are
        truncated to ``row_len``).
      learning_rate: AdamW peak learning rate.
      weight_decay: AdamW decoupled weight decay.
      warmup_fraction: fraction of ``max_steps`` with a linear warmup from 0.
      max_steps: the schedule's length (cosine decay to 0 there) and the most steps run.
      eval_every: steps between validation evaluations (and one at the end).
      patience: stop after this many evaluations without a better validation accuracy.
      temperature: of the zero-shot heads' logits.
      seed: data order and initialization.
    """

    lora_rank: int = 16
    lora_alpha: float = 16.0
    rows: int = 8
    row_len: int = ev.ROW_LEN
    learning_rate: float = 2e-3
    weight_decay: float = 0.01
    warmup_fraction: float = 0.05
    max_steps: int = 600
    eval_every: int = 25
    patience: int = 4
    temperature: float = ev.TEMPERATURE
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("lora_rank", "rows", "row_len", "max_steps", "eval_every", "patience"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"TrainConfig: {name}={v!r}; expected an integer >= 1.")
        if self.row_len < 3:
            raise InputError(f"TrainConfig: row_len={self.row_len}; a text needs >= 3 tokens.")

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


# ------------------------------------------------------------------------------------ caching


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
        "config": dataclasses.asdict(config),
        "weights": weights_fingerprint() if weights is None else weights,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _to_checkpoint(t: TrainedTask) -> dict[str, Any]:
    return {
        "name": t.name,
        "labels": list(t.labels),
        "adapter": t.adapter,
        "info": {k: v for k, v in t.info.items() if k != "cache_hit"},
    }


def _from_checkpoint(obj: dict[str, Any]) -> TrainedTask:
    adapter = {
        name: {
            "lora_a": np.asarray(m["lora_a"], np.float32),
            "lora_b": np.asarray(m["lora_b"], np.float32),
            "scale": float(m["scale"]),
        }
        for name, m in obj["adapter"].items()
    }
    return TrainedTask(obj["name"], tuple(obj["labels"]), adapter, dict(obj["info"]))


def cache_path(cache_dir: str | os.PathLike, task: Any, key: str) -> pathlib.Path:
    return pathlib.Path(cache_dir) / f"{task.name}-{key[:20]}"


def load_cached(path: pathlib.Path) -> TrainedTask | None:
    """The trained task stored at ``path``, or None if there is none (or it is unreadable)."""
    from .. import checkpoint

    ckpt = path / "checkpoint"
    if not ckpt.exists():
        return None
    try:
        return _from_checkpoint(checkpoint.restore(ckpt))
    except (ValueError, KeyError, TypeError):
        return None


def store(path: pathlib.Path, trained: TrainedTask, key_doc: dict[str, Any]) -> None:
    """Write ``trained`` to ``path`` atomically: a temporary directory renamed into place."""
    from .. import checkpoint

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        checkpoint.save(tmp / "checkpoint", _to_checkpoint(trained))
        (tmp / "key.json").write_text(json.dumps(key_doc, indent=1, sort_keys=True) + "\n")
        if path.exists():  # an unreadable old entry (a readable one is never retrained)
            shutil.rmtree(path)
        try:
            os.rename(tmp, path)
        except OSError:  # another process stored the same key first: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------------- training


def _task_seed(config: TrainConfig, name: str, *more: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([config.seed, zlib.crc32(name.encode()), *more])


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


def _pad_labels(n: int) -> int:
    return max(_LABEL_PAD, -(-n // _LABEL_PAD) * _LABEL_PAD)


class Trainer:
    """Trains task LoRAs on one shared MiniLM; the jitted step compiles once for all tasks.

    Args:
      config: hyperparameters.
      backbone: an :class:`evaluate.Backbone` (its base model is the model to adapt, and it
        evaluates validation accuracy; default loads the pretrained one).
    """

    def __init__(self, config: TrainConfig, backbone: ev.Backbone | None = None):
        from flax import nnx

        self.config = config
        self.backbone = ev.Backbone() if backbone is None else backbone
        model = minilm.add_lora(
            self.backbone.model, rank=config.lora_rank, alpha=config.lora_alpha, rngs=nnx.Rngs(0)
        )
        self.graphdef, _, self.base_state = nnx.split(model, nnx.LoRAParam, ...)
        graphdef = self.graphdef
        cap = config.row_len // 3
        tx = optax.chain(
            optax.scale_by_adam(),
            optax.add_decayed_weights(config.weight_decay),
            optax.scale_by_schedule(lambda step: -config.schedule()(step)),
        )
        self._tx = tx
        inv_t = 1.0 / config.temperature

        def loss_fn(lora, base, ids, seg, pos, head, labels, valid, n_labels):
            m = nnx.merge(graphdef, lora, base)
            h = m(ids, seg > 0, segment_ids=seg, position_ids=pos)
            e = minilm.segment_mean_pool(h, seg, cap)  # (R, S, D)
            # an empty slot's embedding is 0: a norm with a finite gradient there
            e = e * jax.lax.rsqrt(jnp.sum(e * e, axis=-1, keepdims=True) + 1e-24)
            z = jnp.einsum("rsd,cd->rsc", e, head) * inv_t
            z = jnp.where(jnp.arange(z.shape[-1]) < n_labels, z, _MASKED_LOGIT)
            ce = optax.softmax_cross_entropy_with_integer_labels(z, labels)
            n = jnp.sum(valid.astype(ce.dtype))
            return jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(n, 1.0)

        def step(lora, opt_state, base, ids, seg, pos, head, labels, valid, n_labels):
            loss, grads = jax.value_and_grad(loss_fn)(
                lora, base, ids, seg, pos, head, labels, valid, n_labels
            )
            # optax's bias correction and schedule raise floats to an int32 step count: allowed
            # under standard promotion only (the test suite runs with strict promotion)
            with jax.numpy_dtype_promotion("standard"):
                updates, opt_state = tx.update(grads, opt_state, lora)
                lora = optax.apply_updates(lora, updates)
            return lora, opt_state, loss

        self._step = jax.jit(step, donate_argnums=(0, 1))
        self.fits = 0

    def _init(self, name: str) -> Any:
        from flax import nnx

        seed = int(_task_seed(self.config, name).generate_state(1)[0])
        model = minilm.add_lora(
            self.backbone.model,
            rank=self.config.lora_rank,
            alpha=self.config.lora_alpha,
            rngs=nnx.Rngs(seed),
        )
        return jax.tree.map(jnp.array, nnx.state(model, nnx.LoRAParam))  # own buffers: donated

    def _adapter(self, lora: Any) -> dict[str, dict[str, Any]]:
        from flax import nnx

        model = nnx.merge(self.graphdef, lora, self.base_state)
        return {
            name: {
                "lora_a": np.asarray(m["lora_a"], np.float32),
                "lora_b": np.asarray(m["lora_b"], np.float32),
                "scale": float(m["scale"]),
            }
            for name, m in minilm.lora_adapter(model).items()
        }

    def _val(self, adapter, head: ev.Head, val: ev.EvalSet, n_labels: int) -> tuple[float, float]:
        emb = self.backbone.embed(val, adapter)
        z = ev.logits(emb, head, self.config.temperature)
        z = z - z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        loss = float(-logp[np.arange(len(val)), val.labels].mean())
        return float((np.argmax(z, axis=1) == val.labels).mean()), loss

    def fit(
        self,
        task: Any,
        head: ev.Head,
        *,
        progress: Callable[[int, dict], None] | None = None,
    ) -> TrainedTask:
        """Train ``task`` (a ``tasks.Task``) against its frozen ``head``; no caching.

        ``progress(step, stats)`` is called after each step.
        """
        cfg = self.config
        if len(task.train) == 0:
            raise InputError(f"Trainer.fit: task {task.name!r} has an empty train split.")
        t0 = time.perf_counter()
        self.fits += 1
        n_labels = task.num_labels
        ids, lengths = ev.encode(task.train.texts, max_len=cfg.row_len)
        labels = np.asarray(task.train.labels, np.int32)
        val = ev.make_eval_set([task.name], [task.val])
        hpad = np.zeros((_pad_labels(n_labels), head.vectors.shape[1]), np.float32)
        hpad[:n_labels] = head.vectors
        hpad = jnp.asarray(hpad)
        lora = self._init(task.name)
        opt_state = self._tx.init(lora)
        nl = jnp.asarray(n_labels, jnp.int32)
        sched = cfg.schedule()

        history: list[dict[str, Any]] = []
        best = (-1.0, np.inf)
        best_step, best_lora = 0, jax.device_get(lora)
        since_best, step, epoch, losses, seen = 0, 0, 0, [], 0
        stopped_early = False
        t_steps, n_timed, tok_timed = 0.0, 0, 0
        while step < cfg.max_steps and not stopped_early:
            steps = epoch_steps(
                lengths,
                rows=cfg.rows,
                row_len=cfg.row_len,
                seed=_task_seed(cfg, task.name, 1, epoch),
            )
            epoch += 1
            for chosen in steps:
                rows = np.asarray(chosen)
                # the same first fit, in the same order, as epoch_steps: one batch of cfg.rows
                (b,) = ev.packed_batches(
                    ids[rows], lengths[rows], rows=cfg.rows, row_len=cfg.row_len, decreasing=False
                )
                slot = b.text
                lab = np.where(slot >= 0, labels[rows][np.maximum(slot, 0)], 0).astype(np.int32)
                ts = time.perf_counter()
                lora, opt_state, loss = self._step(
                    lora,
                    opt_state,
                    self.base_state,
                    b.ids,
                    b.segment_ids,
                    b.position_ids,
                    hpad,
                    lab,
                    slot >= 0,
                    nl,
                )
                loss = float(loss)
                if step > 0:  # the first step compiles
                    t_steps += time.perf_counter() - ts
                    n_timed += 1
                    tok_timed += int(np.minimum(lengths[rows], cfg.row_len).sum())
                losses.append(loss)
                seen += len(rows)
                step += 1
                stats: dict[str, Any] = {"loss": loss}
                if step % cfg.eval_every == 0 or step == cfg.max_steps:
                    acc, vloss = self._val(self._adapter(lora), head, val, n_labels)
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
        }
        return TrainedTask(task.name, tuple(task.labels), self._adapter(best_lora), info)


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
      config: hyperparameters and seed.
      cache_dir: cache directory (default :func:`default_cache_dir`).
      trainer: a :class:`Trainer` for ``config`` (or a callable making one, called only on a cache
        miss); default makes one.
      progress: ``progress(step, stats)`` after each training step.

    Returns:
      :class:`TrainedTask`; ``info["cache_hit"]`` says whether it came from the cache.
    """
    cache_dir = default_cache_dir() if cache_dir is None else pathlib.Path(cache_dir)
    weights = weights_fingerprint()
    key = cache_key(task, config, weights=weights)
    path = cache_path(cache_dir, task, key)
    hit = load_cached(path)
    if hit is not None:
        return hit._replace(info={**hit.info, "cache_key": key, "cache_hit": True})
    if trainer is None:
        trainer = Trainer(config)
    elif not isinstance(trainer, Trainer):
        trainer = trainer()
    if trainer.config != config:
        raise InputError(
            f"train_task: the trainer was built for {trainer.config} but config is {config}; pass "
            "a Trainer(config)."
        )
    trained = trainer.fit(task, head, progress=progress)
    trained = trained._replace(info={**trained.info, "cache_key": key})
    key_doc = {
        "code_version": CODE_VERSION,
        "task": task.name,
        "task_fingerprint": task_fingerprint(task),
        "config": dataclasses.asdict(config),
        "weights": weights,
        "key": key,
    }
    store(path, trained, key_doc)
    return trained._replace(info={**trained.info, "cache_hit": False})


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
    from tqdm import tqdm

    made: list[Trainer] = []

    def get_trainer() -> Trainer:
        if not made:
            made.append(Trainer(config, backbone))
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
                task, head, config, cache_dir=cache_dir, trainer=get_trainer, progress=tick
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
