"""The one LoRA trainer (:mod:`netutility_jax.experiments.harness.trainer`) on a toy suite.

The toy suite: a LoRA ``W0 + s A B`` on a linear map, trained by mean squared error on random
data, validated on data whose best map is part of the way to the training map (so the
validation loss falls, then rises, and early stopping has a best step to find). Peer: the
same training written out here in float64 numpy (the epochs' seeds, the permutation, the
gradient, AdamW with decoupled weight decay, the warmup-cosine schedule, the evaluations and
the patience), which the trainer's float32 run must follow. The cache is checked through
:func:`trainer.train_cached` on the same toy.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest

from netutility_jax.errors import InputError
from netutility_jax.experiments.harness import fitting as ft
from netutility_jax.experiments.harness import trainer as trn

D_IN, D_OUT, RANK, N_TRAIN, N_VAL, ROWS = 6, 4, 2, 24, 16, 4


@dataclasses.dataclass(frozen=True)
class ToyConfig(ft.TrainConfigBase):
    lora_rank: int = RANK
    lora_alpha: float = 4.0
    rows: int = ROWS
    learning_rate: float = 0.05
    weight_decay: float = 0.1
    warmup_fraction: float = 0.1
    max_steps: int = 60
    eval_every: int = 3
    patience: int = 3
    seed: int = 0


class Data(NamedTuple):
    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.x)


class ToyTask(NamedTuple):
    name: str
    labels: tuple[str, ...]
    train: Data
    val: Data


class ToyTrainer(trn.LoraTrainer):
    """The toy suite's part: the loss, the initial factors, the adapter, the batches."""

    where = "ToyTrainer"

    def __init__(self, config: ToyConfig, w0: np.ndarray):
        self.scale = config.lora_alpha / config.lora_rank
        scale = self.scale

        def loss_fn(state, w, x, y):
            w = w + scale * (state["lora_a"] @ state["lora_b"])
            return jnp.mean((x @ w - y) ** 2)

        super().__init__(config, loss_fn, jnp.asarray(w0, jnp.float32))
        self.w0 = np.asarray(w0, np.float64)

    def init(self, name: str) -> dict[str, Any]:
        rng = np.random.default_rng(ft.init_seed(self.config, name))
        a = rng.normal(size=(D_IN, self.config.lora_rank)) / math.sqrt(D_IN)
        b = np.zeros((self.config.lora_rank, D_OUT))
        return {"lora_a": jnp.asarray(a, jnp.float32), "lora_b": jnp.asarray(b, jnp.float32)}

    def adapter(self, state: Any) -> dict[str, dict[str, Any]]:
        return ft.host_adapter({"lin": {**state, "scale": self.scale}})

    def prepare(self, task: ToyTask, head: Any, cfg: ToyConfig, val: Any) -> trn.TaskRun:
        val = task.val if val is None else val
        n = len(task.train)

        def epoch(seed):
            order = np.random.default_rng(seed).permutation(n)
            return [order[i : i + cfg.rows] for i in range(0, n, cfg.rows)]

        def batch(chosen, done):
            x, y = (jnp.asarray(v[chosen], jnp.float32) for v in task.train)
            return trn.Batch((x, y), len(chosen), x.shape)

        def validate(state) -> tuple[float, float]:
            return 0.0, _mse(self.w0, self.scale, state, val)  # best = lowest loss

        return trn.TaskRun(epoch, batch, validate)


def _mse(w0, scale, state, data) -> float:
    a, b = (np.asarray(state[k], np.float64) for k in ("lora_a", "lora_b"))
    return float(np.mean((data.x @ (w0 + scale * a @ b) - data.y) ** 2))


def _toy(name: str = "toy", seed: int = 0) -> tuple[np.ndarray, ToyTask]:
    rng = np.random.default_rng(seed)
    w0 = rng.normal(size=(D_IN, D_OUT))
    delta = rng.normal(size=(D_IN, RANK)) @ rng.normal(size=(RANK, D_OUT))
    x, xv = rng.normal(size=(N_TRAIN, D_IN)), rng.normal(size=(N_VAL, D_IN))
    train = Data(x, x @ (w0 + delta))
    val = Data(xv, xv @ (w0 + 0.3 * delta))  # training overshoots the validation optimum
    return w0, ToyTask(name, ("y",), train, val)


def _schedule(cfg: ToyConfig, t: int) -> float:
    """optax's warmup_cosine_decay_schedule(0, lr, warm, max_steps, 0) at step ``t``."""
    warm = max(round(cfg.warmup_fraction * cfg.max_steps), 1)
    if t < warm:
        return cfg.learning_rate * t / warm
    frac = min(t - warm, cfg.max_steps - warm) / (cfg.max_steps - warm)
    return cfg.learning_rate * 0.5 * (1 + math.cos(math.pi * frac))


def _reference(cfg: ToyConfig, w0, task: ToyTask, init: dict) -> dict[str, Any]:
    """The trainer's run in float64: AdamW (b1 0.9, b2 0.999, eps 1e-8, decoupled decay),
    evaluations every ``eval_every`` steps, the best (lowest validation loss) state, stop after
    ``patience`` evaluations without a better one."""
    s = cfg.lora_alpha / cfg.lora_rank
    p = {k: np.asarray(v, np.float64) for k, v in init.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(v) for k, v in p.items()}
    history, best, best_step, best_p, since, done, ep = [], np.inf, 0, dict(p), 0, 0, 0
    stopped = False
    while done < cfg.max_steps and not stopped:
        seed = np.random.SeedSequence([cfg.seed, zlib.crc32(task.name.encode()), 1, ep])
        order = np.random.default_rng(seed).permutation(len(task.train))
        ep += 1
        for i in range(0, len(order), cfg.rows):
            rows = order[i : i + cfg.rows]
            x, y = task.train.x[rows], task.train.y[rows]
            r = x @ (w0 + s * p["lora_a"] @ p["lora_b"]) - y
            gw = 2.0 * x.T @ r / r.size
            g = {"lora_a": s * gw @ p["lora_b"].T, "lora_b": s * p["lora_a"].T @ gw}
            lr, t = _schedule(cfg, done), done + 1
            for k in p:
                m[k] = 0.9 * m[k] + 0.1 * g[k]
                v[k] = 0.999 * v[k] + 0.001 * g[k] ** 2
                mh, vh = m[k] / (1 - 0.9**t), v[k] / (1 - 0.999**t)
                p[k] = p[k] - lr * (mh / (np.sqrt(vh) + 1e-8) + cfg.weight_decay * p[k])
            done += 1
            if done % cfg.eval_every == 0 or done == cfg.max_steps:
                vloss = _mse(w0, s, p, task.val)
                history.append((done, vloss, _schedule(cfg, done)))
                if vloss < best:
                    best, best_step, best_p, since = vloss, done, dict(p), 0
                else:
                    since += 1
                    stopped = since >= cfg.patience and done < cfg.max_steps
            if stopped or done >= cfg.max_steps:
                break
    return {"history": history, "best_step": best_step, "best": best_p, "steps": done,
            "stopped": stopped, "epochs": ep}  # fmt: skip


def test_fit_follows_float64_adamw_and_stops_at_the_best_step():
    cfg = ToyConfig()
    w0, task = _toy()
    tr = ToyTrainer(cfg, w0)
    got = tr.fit(task, None)
    ref = _reference(cfg, w0, task, tr.init(task.name))
    info = got.info
    # the run stops early, past a best step that is neither the first nor the last evaluation
    assert ref["stopped"] and info["stopped_early"]
    assert ref["history"][0][0] < ref["best_step"] < ref["steps"] < cfg.max_steps
    assert (info["steps"], info["best_step"], info["epochs"]) == (
        ref["steps"], ref["best_step"], ref["epochs"],
    )  # fmt: skip
    assert info["texts_seen"] == ref["steps"] * ROWS
    assert [h["step"] for h in info["history"]] == [h[0] for h in ref["history"]]
    np.testing.assert_allclose(
        [h["val_loss"] for h in info["history"]], [h[1] for h in ref["history"]], rtol=1e-4
    )
    np.testing.assert_allclose(
        [h["lr"] for h in info["history"]], [h[2] for h in ref["history"]], rtol=1e-6
    )
    assert info["best_val_loss"] == min(h["val_loss"] for h in info["history"])
    (mod,) = got.adapter.values()
    assert mod["scale"] == cfg.lora_alpha / cfg.lora_rank
    for k in ("lora_a", "lora_b"):
        assert mod[k].dtype == np.float32
        np.testing.assert_allclose(mod[k], ref["best"][k], rtol=1e-4, atol=1e-5)
    # the trained state is the best one, not the last: the last is further from the val optimum
    assert info["best_val_loss"] < info["history"][-1]["val_loss"]
    assert tr.fits == 1 and math.isfinite(info["train_seconds"])


def test_fit_is_deterministic_and_compiles_once():
    cfg = ToyConfig(max_steps=12, patience=10)
    w0, task = _toy()
    tr = ToyTrainer(cfg, w0)
    a, b = tr.fit(task, None), tr.fit(task, None)
    for k in ("lora_a", "lora_b"):
        np.testing.assert_array_equal(a.adapter["lin"][k], b.adapter["lin"][k])
    assert a.info["history"] == b.info["history"]
    _, step = tr._optimizer(cfg.max_steps, cfg.learning_rate)
    assert step._cache_size() == 1  # one batch shape, one schedule: one compile for both fits
    assert tr.fits == 2


def test_task_config_scales_a_named_tasks_steps_and_learning_rate():
    """A task named by ``step_scale``/``lr_scale`` trains bit for bit as under a config with
    its ``max_steps`` and ``learning_rate`` scaled; the others as under the config alone."""
    base = ToyConfig(max_steps=8, patience=10)
    w0, task = _toy("named")
    _, other = _toy("other")
    scaled = ToyTrainer(
        dataclasses.replace(base, step_scale=(("named", 1.5),), lr_scale=(("named", 0.5),)), w0
    )
    want = dataclasses.replace(base, max_steps=12, learning_rate=0.025)
    for t, cfg in ((task, want), (other, base)):
        got, ref = scaled.fit(t, None), ToyTrainer(cfg, w0).fit(t, None)
        assert got.info["max_steps"] == got.info["steps"] == cfg.max_steps
        for k in ("lora_a", "lora_b"):
            np.testing.assert_array_equal(got.adapter["lin"][k], ref.adapter["lin"][k])


def test_train_cached_trains_once_then_reads_the_cache(tmp_path):
    cfg = ToyConfig(max_steps=9, patience=10)
    w0, task = _toy()
    tr = ToyTrainer(cfg, w0)
    kw = dict(kind=ToyTrainer, cache_dir=tmp_path, key_doc={"toy": 1}, where="toy.train_task")
    key = "ab" * 32
    first = trn.train_cached(task, None, cfg, trainer=tr, key=key, **kw)
    assert not first.info["cache_hit"] and first.info["cache_key"] == key and tr.fits == 1
    assert (ft.cache_path(tmp_path, task, key) / "key.json").exists()

    def boom() -> ToyTrainer:
        raise AssertionError("a cache hit made a trainer")

    for made in (None, boom, tr):
        hit = trn.train_cached(task, None, cfg, trainer=made, key=key, **kw)
        assert hit.info["cache_hit"] and hit.info["history"] == first.info["history"]
        for k in ("lora_a", "lora_b"):
            np.testing.assert_array_equal(hit.adapter["lin"][k], first.adapter["lin"][k])
    assert tr.fits == 1  # never retrained
    with pytest.raises(InputError, match=r"toy.train_task: 'toy' is not in the cache"):
        trn.train_cached(task, None, cfg, trainer=None, key="cd" * 32, **kw)
    other = dataclasses.replace(cfg, seed=1)
    with pytest.raises(InputError, match=r"toy.train_task: the trainer was built for ToyConfig"):
        trn.train_cached(task, None, other, trainer=lambda: tr, key="cd" * 32, **kw)
    made = trn.train_cached(task, None, other, trainer=lambda: ToyTrainer(other, w0), key="ef" * 32,
                            **kw)  # fmt: skip
    assert not made.info["cache_hit"]


def test_fit_refuses_an_empty_train_split():
    w0, task = _toy()
    empty = task._replace(train=Data(np.zeros((0, D_IN)), np.zeros((0, D_OUT))))
    with pytest.raises(InputError, match=r"^ToyTrainer.fit: task 'toy' has an empty train split"):
        ToyTrainer(ToyConfig(), w0).fit(empty, None)
