"""Train one LoRA adapter and a linear head per task on MiniLM, cached on disk.

Per task (:meth:`Trainer.fit`): the pretrained MiniLM-L6 with ``nnx.LoRA`` rank 16, alpha 16 on
``query``, ``key``, ``value`` and the attention ``output`` of all 6 layers
(:func:`minilm.add_lora`), and a linear head on the mean-pooled last hidden states. Only the LoRA
factors and the head train (the gradient is taken with respect to the ``nnx.LoRAParam`` state and
the head; the frozen base, ``nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))``, is a constant input).
AdamW with a linear warmup (``warmup_fraction`` of the steps) and a linear decay to zero;
cross-entropy; validation accuracy every ``eval_every`` steps, the best LoRA + head kept, early
stopping after ``patience`` evaluations without improvement (paper, Appendix B, scaled down).

Deterministic from ``TrainConfig.seed``: the LoRA ``A`` factors and the head are drawn from
``nnx.Rngs(SeedSequence([seed, crc32(task name)]))``, and each epoch's data order from a PCG64
stream of ``(seed, crc32(task name), epoch)``.

Speed (2-core CPU): a batch is padded only to its own longest text, rounded up to 8 tokens (to 16
above 16 tokens: at most 5 shapes up to 64), texts are truncated to ``max_len``; batches are formed
from chunks of 8 batches' worth of shuffled texts sorted by length (less padding, still random);
one jitted step per padded length, shared by every task (heads are padded to a multiple of 8
labels, the surplus logits masked), with the parameters and the optimizer state donated.

Caching (:func:`train_task`): the trained adapter and head are stored with ``nu.checkpoint``
under ``cache_dir/<task>-<key>``; the key hashes everything that determines the result (the task's
name, labels and the texts and labels of every split, the :class:`TrainConfig` with its seed, the
size and modification time of the pretrained files, :data:`CODE_VERSION`). A checkpoint is written
to a temporary directory and renamed into place, so a reader never sees half of one.

A linear probe (ridge classifier on the frozen base embedding, its ridge chosen on validation) is
fitted alongside: it measures what the base model already knows of a task (the paper's "relative
accuracy" is adapter accuracy minus base accuracy).
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

from . import evaluate as ev
from . import minilm

#: Bump when a change to this module changes what training produces: invalidates every cache.
CODE_VERSION = 1
CACHE_ENV = "NETUTILITY_CACHE"
DEFAULT_CACHE_DIR = pathlib.Path("~/.cache/netutility-jax/demo")
_LABEL_PAD = 8
_MASKED_LOGIT = -1e9


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a trained adapter besides the task data and the model files.

    Attributes:
      lora_rank, lora_alpha: LoRA ``r`` and alpha (update scaled by ``alpha / r``).
      max_len: truncation length in tokens.
      batch_size: texts per step.
      learning_rate: AdamW peak learning rate (LoRA factors and head).
      weight_decay: AdamW decoupled weight decay.
      warmup_fraction: fraction of the steps with a linear warmup from 0.
      epochs: passes over the training split (the schedule's length), unless ``max_steps`` is
        smaller.
      max_steps: cap on the number of steps (None: ``epochs`` decide).
      eval_every: steps between validation evaluations (and one at the end).
      patience: stop after this many evaluations without a better validation accuracy.
      probe_examples: training texts the linear probe on the base embedding is fitted on.
      val_examples: validation texts for early stopping (a balanced subset; None: all).
      seed: data order and initialization.
    """

    lora_rank: int = 16
    lora_alpha: float = 16.0
    max_len: int = 64
    batch_size: int = 32
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    warmup_fraction: float = 0.06
    epochs: float = 2.0
    max_steps: int | None = None
    eval_every: int = 30
    patience: int = 3
    probe_examples: int = 500
    val_examples: int | None = None
    seed: int = 0

    def steps(self, n_train: int) -> int:
        """Number of optimizer steps for a training split of ``n_train`` texts."""
        per_epoch = max(n_train // self.batch_size, 1)
        total = max(round(self.epochs * per_epoch), 1)
        return total if self.max_steps is None else min(total, self.max_steps)


class TrainedTask(NamedTuple):
    """A trained task: its LoRA adapter, its head, and what happened.

    Attributes:
      name: task name.
      labels: label names (head output ``i`` is ``labels[i]``).
      adapter: ``{module: {"lora_a" (d_in, r), "lora_b" (r, d_out), "scale"}}`` (float32 numpy),
        module names ``layers/{i}/attention/{query,key,value,output}``.
      head: :class:`evaluate.Head` on the mean-pooled embedding of the adapted model.
      probe: :class:`evaluate.Head`, the linear probe on the base model's mean-pooled embedding.
      info: ``best_step``, ``best_val_accuracy``, ``steps``, ``stopped_early``, ``history``
        (``[{"step", "loss", "val_accuracy"}]``), ``train_seconds``, ``steps_per_second``,
        ``probe_val_accuracy``, ``probe_seconds``, ``cache_key``, ``cache_hit``. Steps that
        compile (a new padded length) are left out of ``steps_per_second``.
    """

    name: str
    labels: tuple[str, ...]
    adapter: dict[str, dict[str, Any]]
    head: ev.Head
    probe: ev.Head
    info: dict[str, Any]


# ------------------------------------------------------------------------------------ caching


def default_cache_dir() -> pathlib.Path:
    """``$NETUTILITY_CACHE`` if set, else ``~/.cache/netutility-jax/demo``."""
    env = os.environ.get(CACHE_ENV)
    return pathlib.Path(env).expanduser() if env else DEFAULT_CACHE_DIR.expanduser()


def task_fingerprint(task: Any) -> str:
    """sha256 of a task's name, labels, and the texts and labels of every split."""
    h = hashlib.sha256()
    h.update(json.dumps([task.name, list(task.labels)]).encode())
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
        "head": {"kernel": t.head.kernel, "bias": t.head.bias},
        "probe": {"kernel": t.probe.kernel, "bias": t.probe.bias},
        "info": {k: v for k, v in t.info.items() if k != "cache_hit"},
    }


def _from_checkpoint(obj: dict[str, Any]) -> TrainedTask:
    def arr(x):
        return np.asarray(x, np.float32)

    adapter = {
        name: {"lora_a": arr(m["lora_a"]), "lora_b": arr(m["lora_b"]), "scale": float(m["scale"])}
        for name, m in obj["adapter"].items()
    }
    return TrainedTask(
        name=obj["name"],
        labels=tuple(obj["labels"]),
        adapter=adapter,
        head=ev.Head(arr(obj["head"]["kernel"]), arr(obj["head"]["bias"])),
        probe=ev.Head(arr(obj["probe"]["kernel"]), arr(obj["probe"]["bias"])),
        info=dict(obj["info"]),
    )


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


def epoch_batches(
    lengths: np.ndarray, *, batch_size: int, seed: np.random.SeedSequence
) -> list[np.ndarray]:
    """One epoch's batches of row indices: shuffled, then sorted by length within chunks.

    The rows are permuted, cut into chunks of ``8 * batch_size``, each chunk sorted by length and
    cut into batches (a short last batch is dropped), and the batches shuffled.
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    perm = rng.permutation(len(lengths))
    chunk = 8 * batch_size
    batches = []
    for s in range(0, len(perm), chunk):
        part = perm[s : s + chunk]
        part = part[np.argsort(lengths[part], kind="stable")]
        batches += [
            part[i : i + batch_size] for i in range(0, len(part) - batch_size + 1, batch_size)
        ]
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def learning_rate(step: int, total: int, config: TrainConfig) -> float:
    """Linear warmup over ``warmup_fraction * total`` steps to the peak, then linear decay to 0."""
    warm = max(round(config.warmup_fraction * total), 1)
    sched = optax.join_schedules(
        [
            optax.linear_schedule(0.0, config.learning_rate, warm),
            optax.linear_schedule(config.learning_rate, 0.0, max(total - warm, 1)),
        ],
        [warm],
    )
    return float(sched(step + 1))


def _pad_labels(n: int) -> int:
    return max(_LABEL_PAD, -(-n // _LABEL_PAD) * _LABEL_PAD)


def fit_probe(
    train_emb: np.ndarray,
    train_labels: np.ndarray,
    val_emb: np.ndarray,
    val_labels: np.ndarray,
    n_labels: int,
) -> tuple[ev.Head, float]:
    """Ridge classifier (one-hot least squares) with its ridge chosen on validation accuracy."""
    x = np.concatenate([train_emb, np.ones((len(train_emb), 1))], axis=1).astype(np.float64)
    y = np.eye(n_labels)[train_labels]
    gram = x.T @ x
    scale = np.trace(gram) / gram.shape[0]
    fits = []
    for ridge in (1e-3, 1e-2, 1e-1, 1.0):
        reg = ridge * scale * np.eye(gram.shape[0])
        reg[-1, -1] = 0.0  # no penalty on the bias
        w = np.linalg.solve(gram + reg, x.T @ y)
        head = ev.Head(w[:-1].astype(np.float32), w[-1].astype(np.float32))
        acc = float((np.argmax(ev.logits(val_emb, head), -1) == val_labels).mean())
        fits.append((acc, head))
    acc, head = max(fits, key=lambda f: f[0])  # ties: the first, smallest ridge
    return head, acc


class Trainer:
    """Trains task LoRAs on one shared MiniLM; the jitted steps compile once for all tasks.

    Args:
      config: hyperparameters.
      backbone: an :class:`evaluate.Backbone` (its base model is the model to adapt; default
        loads the pretrained one).
    """

    def __init__(self, config: TrainConfig, backbone: ev.Backbone | None = None):
        from flax import nnx

        self.config = config
        self.backbone = ev.Backbone() if backbone is None else backbone
        model = minilm.add_lora(
            self.backbone.model,
            rank=config.lora_rank,
            alpha=config.lora_alpha,
            rngs=nnx.Rngs(0),
        )
        self.graphdef, _, self.base_state = nnx.split(model, nnx.LoRAParam, ...)
        graphdef = self.graphdef
        tx = optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(config.weight_decay))
        self._tx = tx

        def forward(params, base, ids, mask):
            m = nnx.merge(graphdef, params["lora"], base)
            pooled = minilm.mean_pool(m(ids, mask), mask)
            return pooled @ params["head"]["kernel"] + params["head"]["bias"]

        def loss_fn(params, base, ids, mask, labels, n_labels):
            z = forward(params, base, ids, mask)
            z = jnp.where(jnp.arange(z.shape[-1]) < n_labels, z, _MASKED_LOGIT)
            return optax.softmax_cross_entropy_with_integer_labels(z, labels).mean()

        def step(params, opt_state, base, ids, mask, labels, n_labels, lr):
            loss, grads = jax.value_and_grad(loss_fn)(params, base, ids, mask, labels, n_labels)
            # optax's bias correction raises a float to an int32 step count: allowed under
            # standard promotion only (the test suite runs with strict promotion)
            with jax.numpy_dtype_promotion("standard"):
                updates, opt_state = tx.update(grads, opt_state, params)
            params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
            return params, opt_state, loss

        def pool(lora, base, ids, mask):
            m = nnx.merge(graphdef, lora, base)
            return minilm.mean_pool(m(ids, mask), mask)

        self._step = jax.jit(step, donate_argnums=(0, 1))
        self._compiled: set[int] = set()  # padded lengths the step has compiled for
        self._pool = jax.jit(pool)
        self.fits = 0

    def _init(self, name: str, n_labels: int) -> dict[str, Any]:
        from flax import nnx

        seed = int(_task_seed(self.config, name).generate_state(1)[0])
        rngs = nnx.Rngs(seed)
        model = minilm.add_lora(
            self.backbone.model, rank=self.config.lora_rank, alpha=self.config.lora_alpha, rngs=rngs
        )
        lora = nnx.state(model, nnx.LoRAParam)
        d = self.backbone.model.config.hidden_size
        kernel = 0.02 * jax.random.normal(rngs.params(), (d, _pad_labels(n_labels)), jnp.float32)
        head = {"kernel": kernel, "bias": jnp.zeros((_pad_labels(n_labels),), jnp.float32)}
        # own buffers: the step donates them
        return jax.tree.map(jnp.array, {"lora": lora, "head": head})

    def fit(self, task: Any, *, progress: Callable[[int, dict], None] | None = None) -> TrainedTask:
        """Train ``task`` (a ``tasks.Task``); no caching. ``progress(step, stats)`` after each step."""
        from flax import nnx

        cfg = self.config
        t0 = time.perf_counter()
        self.fits += 1
        n_labels = task.num_labels
        ids, lengths = ev.encode(task.train.texts, max_len=cfg.max_len)
        labels = np.asarray(task.train.labels, np.int32)
        val = ev.make_eval_set(
            [task.name], [ev.balanced_subset(task.val, cfg.val_examples)], max_len=cfg.max_len
        )
        total = cfg.steps(len(labels))
        params = self._init(task.name, n_labels)
        opt_state = self._tx.init(params)
        nl = jnp.asarray(n_labels, jnp.int32)

        def val_accuracy(p) -> float:
            emb = ev.embed(lambda i, m: self._pool(p["lora"], self.base_state, i, m), val)
            head = ev.Head(
                np.asarray(p["head"]["kernel"])[:, :n_labels],
                np.asarray(p["head"]["bias"])[:n_labels],
            )
            return ev.accuracies(emb, [head], val)[task.name]

        history: list[dict[str, Any]] = []
        best_acc, best_step, best = -1.0, 0, jax.device_get(params)
        since_best, step, epoch, losses = 0, 0, 0, []
        stopped_early = False
        t_steps, n_timed = 0.0, 0
        while step < total and not stopped_early:
            batches = epoch_batches(
                lengths, batch_size=cfg.batch_size, seed=_task_seed(cfg, task.name, 1, epoch)
            )
            epoch += 1
            for rows in batches:
                if step >= total:
                    break
                length = ev.bucket_length(
                    int(lengths[rows].max()), max_len=cfg.max_len, coarse_from=16
                )
                b_ids = np.zeros((len(rows), length), np.int32)
                width = min(length, ids.shape[1])
                b_ids[:, :width] = ids[rows, :width]
                b_mask = (np.arange(length)[None] < lengths[rows][:, None]).astype(np.int32)
                lr = jnp.asarray(learning_rate(step, total, cfg), jnp.float32)
                ts = time.perf_counter()
                params, opt_state, loss = self._step(
                    params, opt_state, self.base_state, b_ids, b_mask, labels[rows], nl, lr
                )
                loss = float(loss)
                if length in self._compiled:  # steps/s without compiles
                    t_steps += time.perf_counter() - ts
                    n_timed += 1
                self._compiled.add(length)
                losses.append(loss)
                step += 1
                stats = {"loss": loss}
                if step % cfg.eval_every == 0 or step == total:
                    acc = val_accuracy(params)
                    history.append(
                        {"step": step, "loss": float(np.mean(losses)), "val_accuracy": acc}
                    )
                    losses = []
                    stats["val_accuracy"] = acc
                    if acc > best_acc:
                        best_acc, best_step, best = acc, step, jax.device_get(params)
                        since_best = 0
                    else:
                        since_best += 1
                        if since_best >= cfg.patience:
                            stopped_early = step < total
                if progress is not None:
                    progress(step, stats)
                if stopped_early:
                    break
        train_seconds = time.perf_counter() - t0
        model = nnx.merge(self.graphdef, best["lora"], self.base_state)
        adapter = {
            name: {
                "lora_a": np.asarray(m["lora_a"], np.float32),
                "lora_b": np.asarray(m["lora_b"], np.float32),
                "scale": float(m["scale"]),
            }
            for name, m in minilm.lora_adapter(model).items()
        }
        head = ev.Head(
            np.asarray(best["head"]["kernel"], np.float32)[:, :n_labels],
            np.asarray(best["head"]["bias"], np.float32)[:n_labels],
        )
        probe, probe_acc = self._probe(task)
        info = {
            "best_step": best_step,
            "best_val_accuracy": best_acc,
            "steps": step,
            "planned_steps": total,
            "stopped_early": stopped_early,
            "history": history,
            "train_seconds": train_seconds,
            "steps_per_second": n_timed / t_steps if t_steps > 0 else float("nan"),
            "probe_val_accuracy": probe_acc,
            "probe_seconds": time.perf_counter() - t0 - train_seconds,
        }
        return TrainedTask(task.name, tuple(task.labels), adapter, head, probe, info)

    def _probe(self, task: Any) -> tuple[ev.Head, float]:
        cfg = self.config
        train = ev.balanced_subset(task.train, cfg.probe_examples)
        val = ev.balanced_subset(task.val, cfg.val_examples)
        es = ev.make_eval_set([task.name, task.name + ":val"], [train, val], max_len=cfg.max_len)
        emb = self.backbone.embed(es)
        tr, va = es.rows(0), es.rows(1)
        return fit_probe(emb[tr], es.labels[tr], emb[va], es.labels[va], task.num_labels)


def train_task(
    task: Any,
    config: TrainConfig,
    *,
    cache_dir: str | os.PathLike | None = None,
    trainer: Trainer | Callable[[], Trainer] | None = None,
    progress: Callable[[int, dict], None] | None = None,
) -> TrainedTask:
    """Train ``task`` with ``config``, or load the result from the cache if it is there.

    Args:
      task: a ``tasks.Task``.
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
        raise ValueError(
            f"train_task: the trainer was built for {trainer.config} but config is {config}; pass "
            "a Trainer(config)."
        )
    trained = trainer.fit(task, progress=progress)
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
    for task in tasks:
        bar = tqdm(
            total=config.steps(len(task.train)),
            desc=f"train {task.name}",
            disable=not progress,
            leave=True,
            mininterval=1.0,
            dynamic_ncols=True,
        )

        def tick(step, stats, bar=bar):
            bar.update(1)
            if "val_accuracy" in stats:
                bar.set_postfix(loss=f"{stats['loss']:.3f}", val=f"{stats['val_accuracy']:.3f}")

        with bar:
            t = train_task(task, config, cache_dir=cache_dir, trainer=get_trainer, progress=tick)
            if t.info["cache_hit"]:
                bar.set_postfix_str("cached")
            else:
                bar.set_postfix(
                    best_val=f"{t.info['best_val_accuracy']:.3f}",
                    steps=t.info["steps"],
                    it_s=f"{t.info['steps_per_second']:.2f}",
                )
        if log is not None:
            i = t.info
            how = (
                "cached"
                if i["cache_hit"]
                else f"trained {i['steps']} steps in {i['train_seconds']:.0f} s "
                f"({i['steps_per_second']:.2f} steps/s)"
            )
            log(
                f"{task.name}: {how}; best validation accuracy {i['best_val_accuracy']:.3f} "
                f"at step {i['best_step']}"
            )
        out.append(t)
    return out
