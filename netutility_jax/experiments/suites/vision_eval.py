"""The vision suite's evaluation (:mod:`vision`): images, the vision tower with a merge folded in,
and the evaluator.

A merge is folded into the vision tower's kernels, ``W + coef * dK`` (the fold of
``clip.fold_adapter``, done inside one jitted forward so a new coefficient never recompiles:
:class:`VisionBackbone`), each image embedded and normalized, and classified by its dataset's
head (argmax). Accuracy per dataset; normalized accuracy = merged / the dataset's own adapter x
100 (the paper's metric); the coefficient chosen on validation by ``evaluate.MergeSearch`` (the
grid 0.1 ... 9.9, as for every suite); test evaluated once (:class:`VisionEvaluator`). The
images of every dataset are decoded and preprocessed once (:class:`ImageSet`,
:func:`make_image_set`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import InputError
from ..data import vision_data as vd
from ..data import vision_images
from ..harness import evaluate as ev
from ..harness.passes import PassCounter, TaskSet
from .vision_heads import ZeroShotHead

__all__ = [
    "ImageSet",
    "VisionBackbone",
    "VisionEvaluator",
    "make_image_set",
]


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSet(TaskSet):
    """The images of several datasets, preprocessed once (``__len__``, ``rows``: ``TaskSet``).

    Attributes:
      task_names: the datasets, in the order of the ``task`` indices.
      task: ``(N,)`` int32 dataset index of each image.
      labels: ``(N,)`` int32 class ids.
      lengths: ``(N,)`` tokens the vision tower runs per image (patches + class token).
      pixels: ``(N, 3, H, W)`` uint8, CLIP's preprocessing up to the crop
        (``vision_images.load_images``).
      ids: ``(N, 16)`` uint8 digest of each image's pixels (what the job cache keys on).
      batch_size: images per forward call.
    """

    task_names: tuple[str, ...]
    task: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    pixels: np.ndarray = dataclasses.field(repr=False)
    ids: np.ndarray = dataclasses.field(repr=False)
    batch_size: int = 256

    @property
    def batches(self) -> tuple[Any, ...]:  # TaskSet's interface: the forward calls' sizes
        return ()

    @property
    def slot_tokens(self) -> int:
        """Tokens one pass computes, the filler images of the last batch included."""
        n = len(self)
        per = int(self.lengths[0]) if n else 0
        return -(-n // self.batch_size) * self.batch_size * per

    def only(self, task: int | str) -> ImageSet:
        """The images of one dataset as a set of its own."""
        i = self.task_index(task)
        r = self.rows(i)
        return ImageSet(
            (self.task_names[i],), np.zeros(len(r), np.int32), self.labels[r], self.lengths[r],
            self.pixels[r], self.ids[r], self.batch_size,
        )  # fmt: skip


def make_image_set(
    names: Sequence[str], splits: Sequence[vd.Split], image_config: Any, *, tokens: int,
    batch_size: int,
) -> ImageSet:  # fmt: skip
    """Decode and preprocess the splits of several datasets into one :class:`ImageSet`."""
    pixels, task, labels = [], [], []
    for i, sp in enumerate(splits):
        pixels.append(vision_images.load_images(sp, image_config))
        task.append(np.full(len(sp), i, np.int32))
        labels.append(np.asarray(sp.labels, np.int32))
    px = np.concatenate(pixels)
    ids = np.stack(
        [np.frombuffer(hashlib.blake2b(p.tobytes(), digest_size=16).digest(), np.uint8) for p in px]
    )
    return ImageSet(
        tuple(names), np.concatenate(task), np.concatenate(labels),
        np.full(len(px), tokens, np.int32), px, ids, batch_size,
    )  # fmt: skip


def _lut(cfg: Any) -> np.ndarray:
    """``(3, 256)`` float32: the pixel value of each uint8 level per channel, computed as
    ``clip.preprocess`` computes it (float64 rescale, float32 normalize), so gathering from it
    gives ``clip.preprocess``'s arrays exactly."""
    x = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 256))
    y: np.ndarray = x.astype(np.float32)
    if cfg.do_rescale:
        y = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, np.float32)[:, None]
        std = np.asarray(cfg.image_std, np.float32)[:, None]
        y = (y - mean) / std
    return np.ascontiguousarray(y, np.float32)


class VisionBackbone(PassCounter):
    """CLIP's vision tower with a merge folded in, embedding images in jitted batches.

    ``embed(images, adapter, coef)`` returns the L2-normalized image embedding of every image
    under ``W + coef * dK`` in each adapted kernel; one compiled forward serves every adapter
    and coefficient (the dense updates and ``coef`` are arguments).

    Args:
      model: the base ``clip.CLIPModel``.
      image_config: its ``clip.ImageProcessorConfig`` (rescale and normalize run here).
      names: the vision modules a merge may update (PEFT names, ``vision_model.encoder.
        layers.N.self_attn.q_proj``).
    """

    def __init__(self, model: Any, image_config: Any, names: Sequence[str]):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from ..models import clip
        from ..models.llama_model import variable_at

        self.names = tuple(names)
        paths = [
            [int(p) if p.isdigit() else p for p in n.split("/")]
            for n in clip.nnx_names({n: 0 for n in self.names})
        ]
        graphdef, self.state = nnx.split(model)
        self.shapes = {
            n: tuple(variable_at(model, [*p, "kernel"]).get_value().shape)
            for n, p in zip(self.names, paths, strict=True)
        }
        self.dim = int(model.config.projection_dim)
        lut = jnp.asarray(_lut(image_config))
        channel = jnp.arange(3)[:, None, None]

        def features(state, deltas, coef, pixels):
            m = nnx.merge(graphdef, state)
            for n, p in zip(self.names, paths, strict=True):
                v = variable_at(m, [*p, "kernel"])
                v.set_value(v.get_value() + coef * deltas[n])
            x = lut[channel, pixels.astype(jnp.int32)]
            f = m.get_image_features(x)
            return f * jax.lax.rsqrt(jnp.sum(f * f, axis=-1, keepdims=True))

        self._features = jax.jit(features)
        self._zero = {n: jnp.zeros(s, jnp.float32) for n, s in self.shapes.items()}

    def deltas(self, adapter: Mapping[str, Any] | None) -> dict[str, Any]:
        """The dense update of every module of :attr:`names` (zero where ``adapter`` has none).

        Raises:
          InputError: a module the backbone does not adapt, or of the wrong shape.
        """
        import jax.numpy as jnp

        if adapter is None:
            return self._zero
        ev.check_modules(
            "VisionBackbone", adapter, self.names, noun="modules",
            what="among the adapted vision modules",
        )  # fmt: skip
        out = dict(self._zero)
        for n, mod in adapter.items():
            if mod is None:
                continue
            d = ev.module_delta(mod)
            if d.shape != self.shapes[n]:
                raise InputError(
                    f"VisionBackbone: module {n!r} has an update of shape {d.shape} but its "
                    f"kernel is {self.shapes[n]}."
                )
            out[n] = jnp.asarray(d)
        return out

    def embed(
        self, images: ImageSet, adapter: Mapping[str, Any] | None = None, coef: float = 1.0, *,
        deltas: Any = None,
    ) -> np.ndarray:  # fmt: skip
        """Normalized embeddings ``(N, P)`` of ``images`` under the base model plus
        ``coef * adapter`` (or the ``deltas`` of :meth:`deltas`)."""
        import jax.numpy as jnp

        t0 = time.perf_counter()
        dk = self.deltas(adapter) if deltas is None else deltas
        c = jnp.asarray(coef, jnp.float32)
        b, n = images.batch_size, len(images)
        pending = []
        for s in range(0, n, b):
            px = images.pixels[s : s + b]
            k = len(px)
            index = np.arange(s, s + k)
            if k < b:
                px = np.concatenate([px, np.zeros((b - k, *px.shape[1:]), np.uint8)])
                index = np.concatenate([index, np.full(b - k, -1)])
            pending.append((index, self._features(self.state, dk, c, px)))
        return self.gather(pending, (n, self.dim), images, t0)


def _predict(emb: np.ndarray, heads: Sequence[ZeroShotHead], es: ImageSet) -> np.ndarray:
    pred = np.zeros(len(es), np.int32)
    for i, head in enumerate(heads):
        r = es.rows(i)
        if len(r):
            pred[r] = np.argmax(emb[r] @ head.vectors.T, axis=-1)
    return pred


class VisionEvaluator(ev.BackboneSearch):
    """Accuracies of each dataset's own adapter, of the zero-shot model and of merges.

    Args:
      backbone: a :class:`VisionBackbone`.
      adapters: one adapter per dataset, in ``val.task_names`` order.
      heads: one :class:`ZeroShotHead` per dataset, same order.
      val, test: :class:`ImageSet` objects (validation: coefficient search; test: once).
      memo: a dict shared across seeds: the single-adapter and zero-shot correctness, computed
        once per run (the adapters do not change with the seed).
      keys: the adapters' cache keys (the memo's key).
    """

    def __init__(
        self, backbone: VisionBackbone, adapters: Sequence[Mapping[str, Any]],
        heads: Sequence[ZeroShotHead], val: ImageSet, test: ImageSet, *,
        memo: dict | None = None, keys: Sequence[str] = (),
    ):  # fmt: skip
        self._hold(backbone, adapters, heads, val, test, who="VisionEvaluator", unit="dataset")
        key = (tuple(keys), id(val), id(test))
        memo = {} if memo is None else memo
        if key not in memo or not keys:
            memo[key] = (
                self._single(val), self._single(test), self.correct(val, None),
                self.correct(test, None),
            )  # fmt: skip
        self._hold_baselines(*memo[key])

    _predictions = staticmethod(_predict)
