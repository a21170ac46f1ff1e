"""The vision suite: given CLIP LoRAs merged under rank budgets, the paper's Table 1 setting.

The paper (Experimental details; KnOTS' setup) merges the KnOTS rank-16 LoRAs of CLIP ViT-B/32
(``openai/clip-vit-base-patch32``; r=16, lora_alpha=16 on ``q_proj, k_proj, v_proj, out_proj``
of the vision tower) for DTD, EuroSAT, GTSRB, MNIST, RESISC45, SUN397 and SVHN. This suite runs
that setting with the experiment harness (``runner.run_experiment``, :mod:`grid`, :mod:`stats`,
:mod:`report`), from files on disk::

    netutility demo --suite vision --model-dir CLIP --data-dir DATA \\
        --adapters dtd=A/dtd,eurosat=A/eurosat,...   # --grid paper (default) or --quick

1. **Adapters** (``--adapters``, :meth:`VisionSuite.train_tasks`): one PEFT LoRA folder per
   dataset (``adapter_config.json`` and ``adapter_model.safetensors`` or the pickled
   ``adapter_model.bin``, read without torch by ``nu.peft.load_adapter``), named ``NAME=DIR`` or
   matched by folder name (``..._dtd``) or else by order (:data:`vision_data.ORDER`). Module
   names are mapped to the vision tower (:func:`vision_names`): PEFT on ``CLIPModel`` or
   ``CLIPVisionModel`` (``vision_model.encoder.layers.N...``) and PEFT on the tower itself, as
   KnOTS trains (``encoder.layers.N...``). Nothing trains: the adapters are what is merged.
2. **Heads** (:func:`zero_shot_heads`): CLIP's zero-shot classifier from the base text tower,
   as KnOTS' ``generate_clip_heads.py`` builds it: per class, the text embeddings of its prompts
   (one per template of :mod:`vision_data`) are L2-normalized, averaged, normalized again and
   multiplied by ``exp(logit_scale)``. Prompts are tokenized with the model folder's
   ``tokenizer.json`` (the ``tokenizers`` library; no vocabulary is downloaded).
3. **Evaluation** (:class:`VisionEvaluator`): a merge is folded into the vision tower's kernels,
   ``W + coef * dK`` (the fold of ``clip.fold_adapter``, done inside one jitted forward so a new
   coefficient never recompiles), each image embedded and normalized, and classified by its
   dataset's head (argmax). Accuracy per dataset; normalized accuracy = merged / the dataset's
   own adapter x 100 (the paper's metric); the coefficient chosen on validation by
   ``evaluate.MergeSearch`` (the grid 0.1 ... 9.9, as for every suite); test evaluated once.
4. **Data** (:mod:`vision_data`): image folders or parquet files; validation as KnOTS (20% of
   test, or the dataset's own validation split); the preset's ``n_val``/``n_test`` limit sizes
   (the paper preset keeps every image).

What the model folder (``--model-dir``) must hold: ``config.json`` and ``model.safetensors``
(or sharded safetensors with their index; pickles are refused), ``tokenizer.json`` (the Hugging
Face repository has it; if yours lacks it, write it once with
``transformers.CLIPTokenizerFast.from_pretrained(DIR).save_pretrained(DIR)``) and optionally
``preprocessor_config.json`` (CLIP's 224 bicubic + center crop otherwise).

Presets: :data:`PAPER` (Table 1: TA, TSV, TIES, DARE in full, Core and KnOTS space at R = 64,
32, 16; Iso-C and Iso-C + TSV at R = 16; uniform vs Net Utility; the controls; every test image)
and :data:`QUICK` (TA and TIES at R = 16 on 50 validation and 100 test images per dataset).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ...errors import InputError, MissingFileError, NetUtilityError
from ..data import vision_data as vd
from ..harness import evaluate as ev
from ..harness import grid as gr
from ..harness import suites
from ..harness.passes import PassCounter, TaskSet
from ..harness.report_markdown import SuiteReport
from ..harness.suites import require_modules

__all__ = [
    "CODE_VERSION",
    "PAPER",
    "PRESETS",
    "QUICK",
    "SPEC",
    "SUITE",
    "ClipTokenizer",
    "ImageSet",
    "VisionBackbone",
    "VisionConfig",
    "VisionEvaluator",
    "VisionReport",
    "VisionSuite",
    "VisionTasks",
    "ZeroShotHead",
    "build",
    "check_folders",
    "load_tokenizer",
    "make_image_set",
    "match_adapters",
    "requires",
    "tokenize",
    "vision_names",
    "zero_shot_heads",
]

#: Bump when a change here changes what a merge job produces: invalidates the job caches.
CODE_VERSION = 1
SUITE = "vision"
_TEXT_BATCH = 256


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision suite's settings (a preset's ``train``; nothing trains).

    Attributes:
      lora_rank, lora_alpha: the adapters' ``r`` and ``lora_alpha`` (the loaded adapters' own
        replace them when the tasks are loaded: :meth:`VisionSuite.load_tasks`); ``M r`` is the
        full-capacity budget.
      batch_size: images per jitted forward call (one compiled shape).
      holdout: where validation comes from when a dataset has no validation split:
        ``"test"`` (KnOTS: 20% of test) or ``"train"`` (task-vectors: 10% of train).
      seed: the harness's training seed (here: DARE's mask and the random controls).
    """

    lora_rank: int = 16
    lora_alpha: float = 16.0
    batch_size: int = 256
    holdout: str = "test"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("lora_rank", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"VisionConfig: {name}={v!r}; expected an integer >= 1.")
        if self.holdout not in ("test", "train"):
            raise InputError(f"VisionConfig: holdout={self.holdout!r}; expected 'test' or 'train'.")


_SPACES = ("full", "core", "knots")
#: The paper's Table 1 (and its Iso-C table): TA; TSV, DARE, TIES in full, Core and KnOTS space
#: at R = 64, 32, 16; Iso-C and Iso-C + TSV in full space at R = 16; uniform vs Net Utility, with
#: the controls (no budget, random allocation, full capacity M r, the weight average), on every
#: validation and test image, one seed (the adapters are given; the seed moves only DARE's mask
#: and the random draws).
PAPER = gr.Preset(
    name="paper",
    tasks=vd.ORDER,
    seeds=(0,),
    train=VisionConfig(),
    grid=gr.GridConfig(
        rows=(
            gr.Row("ta", "full"),
            *(gr.Row(m, s) for s in _SPACES for m in ("tsv", "dare", "ties")),
            gr.Row("iso_c", "full", budgets=(16,)),
            gr.Row("iso_c_tsv", "full", budgets=(16,)),
        ),
        budgets=(64, 32, 16),
        no_budget=(("ta", "full"), ("tsv", "full"), ("ties", "full")),
        random=(("ta", "full"),),
    ),
    max_train=0,
    n_val=None,  # type: ignore[arg-type]  # every image, as the paper
    n_test=None,  # type: ignore[arg-type]
)
#: A smoke test of the whole path: TA and TIES at R = 16 with the controls, 50 validation and
#: 100 test images per dataset (minutes on a GPU for ViT-B/32 and 7 datasets).
QUICK = gr.Preset(
    name="quick",
    tasks=vd.ORDER,
    seeds=(0,),
    train=VisionConfig(batch_size=64),
    grid=gr.GridConfig(
        rows=(gr.Row("ta", "full"), gr.Row("ties", "full")),
        budgets=(16,),
        no_budget=(("ta", "full"),),
    ),
    max_train=0,
    n_val=50,
    n_test=100,
)
PRESETS = {p.name: p for p in (QUICK, PAPER)}


# ------------------------------------------------------------------------------- tokenizer


class VisionTasks(NamedTuple):
    """What :meth:`VisionSuite.load_tasks` returns: the datasets and the preset with the given
    adapters' rank and alpha (``suites.SuiteWithData``)."""

    tasks: list[vd.VisionTask]
    preset: gr.Preset


class ClipTokenizer(NamedTuple):
    """A model folder's ``tokenizer.json`` (``tokenizers.Tokenizer``), its end-of-text id and
    the text tower's longest input."""

    tokenizer: Any
    eos_id: int
    max_len: int


def load_tokenizer(model_dir: str | os.PathLike, config: Any) -> ClipTokenizer:
    """The tokenizer of a CLIP folder (``tokenizer.json``), checked against its ``config``.

    Raises:
      MissingFileError: no ``tokenizer.json``.
      InputError: no ``<|endoftext|>`` token, or one whose id the text tower does not pool at.
    """
    from tokenizers import Tokenizer

    f = pathlib.Path(model_dir) / "tokenizer.json"
    if not f.is_file():
        raise MissingFileError(
            f"--model-dir {model_dir}: no tokenizer.json; write it with "
            "transformers.CLIPTokenizerFast.from_pretrained(DIR).save_pretrained(DIR)"
        )
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # the tokenizers library's own error type
        raise InputError(f"--model-dir {model_dir}: cannot read tokenizer.json ({e})") from None
    tc = config.text_config
    eos = tok.token_to_id("<|endoftext|>")
    if eos is None:
        raise InputError(
            f"--model-dir {model_dir}: tokenizer.json has no <|endoftext|> token; is it CLIP's?"
        )
    if not tc.legacy_eos and eos != tc.eos_token_id:
        raise InputError(
            f"--model-dir {model_dir}: tokenizer.json's <|endoftext|> is id {eos} but config.json "
            f"pools at eos_token_id {tc.eos_token_id}; the tokenizer is not this model's"
        )
    if eos >= tc.vocab_size:
        raise InputError(
            f"--model-dir {model_dir}: tokenizer.json's ids reach {eos}, beyond the model's "
            f"vocabulary of {tc.vocab_size}; the tokenizer is not this model's"
        )
    return ClipTokenizer(tok, int(eos), int(tc.max_position_embeddings))


def tokenize(tok: ClipTokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` ``(N, T)`` int32 of ``texts``: CLIP's ``<|startoftext|> ... <|endoftext|>``
    (the tokenizer's post-processor), cut to the model's positions keeping the end-of-text
    token, padded with the end-of-text id to the longest text (mask 0 there).

    Raises:
      InputError: a text whose encoding does not end with the end-of-text token.
    """
    rows = []
    for text, enc in zip(texts, tok.tokenizer.encode_batch(list(texts)), strict=True):
        ids = list(enc.ids)
        if not ids or ids[-1] != tok.eos_id:
            raise InputError(
                f"tokenize: {text!r} does not end with <|endoftext|> (id {tok.eos_id}) after "
                "tokenizing; tokenizer.json lacks CLIP's post-processor"
            )
        if len(ids) > tok.max_len:
            ids = [*ids[: tok.max_len - 1], tok.eos_id]
        rows.append(ids)
    t = max(len(r) for r in rows)
    ids = np.full((len(rows), t), tok.eos_id, np.int32)
    mask = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


# ----------------------------------------------------------------------------------- heads


class ZeroShotHead(NamedTuple):
    """A dataset's zero-shot classifier: ``vectors (C, P)`` float32, each row
    ``exp(logit_scale) * unit(mean_t unit(text(template_t(class))))``; ``task`` its dataset."""

    vectors: np.ndarray
    task: str


@functools.partial(jax.jit, static_argnums=0)
def _text_features(graphdef: Any, state: Any, ids: Any, mask: Any) -> Any:
    from flax import nnx

    return nnx.merge(graphdef, state).get_text_features(ids, mask)


def text_features(model: Any, tok: ClipTokenizer, texts: Sequence[str]) -> np.ndarray:
    """``(N, P)`` float32 text embeddings (projected, not normalized) of ``texts``, in jitted
    batches of one shape."""
    from flax import nnx

    ids, mask = tokenize(tok, texts)
    graphdef, state = nnx.split(model)
    n, b = len(ids), min(_TEXT_BATCH, len(ids))
    out = []
    for s in range(0, n, b):
        i, m = ids[s : s + b], mask[s : s + b]
        k = len(i)
        if k < b:  # filler rows: copies of the first (a valid end-of-text position)
            i = np.concatenate([i, np.repeat(i[:1], b - k, 0)])
            m = np.concatenate([m, np.repeat(m[:1], b - k, 0)])
        out.append(np.asarray(_text_features(graphdef, state, i, m))[:k])
    return np.concatenate(out).astype(np.float32)


def zero_shot_heads(model: Any, tok: ClipTokenizer, tasks: Sequence[Any]) -> list[ZeroShotHead]:
    """One :class:`ZeroShotHead` per task from the base text tower (KnOTS'
    ``build_classification_head``; CLIP's zero-shot classifier).

    Args:
      model: a ``clip.CLIPModel`` (its text tower and logit scale are used).
      tok: :func:`load_tokenizer`'s.
      tasks: objects with ``name`` and ``prompts()`` (``vision_data.VisionTask``): per class,
        one prompt per template.
    """
    prompts = [t.prompts() for t in tasks]
    flat = [p for per in prompts for cls in per for p in cls]
    feats = text_features(model, tok, flat)
    scale = np.float32(np.exp(np.float32(np.asarray(model.logit_scale[...]))))
    heads, at = [], 0
    for t, per in zip(tasks, prompts, strict=True):
        vecs = []
        for cls in per:
            e = feats[at : at + len(cls)]
            at += len(cls)
            e = e / np.linalg.norm(e, axis=-1, keepdims=True)
            m = e.mean(axis=0)
            vecs.append(m / np.linalg.norm(m))
        heads.append(ZeroShotHead((scale * np.stack(vecs)).astype(np.float32), t.name))
    return heads


# ---------------------------------------------------------------------------------- images


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSet(TaskSet):
    """The images of several datasets, preprocessed once (``__len__``, ``rows``: ``TaskSet``).

    Attributes:
      task_names: the datasets, in the order of the ``task`` indices.
      task: ``(N,)`` int32 dataset index of each image.
      labels: ``(N,)`` int32 class ids.
      lengths: ``(N,)`` tokens the vision tower runs per image (patches + class token).
      pixels: ``(N, 3, H, W)`` uint8, CLIP's preprocessing up to the crop
        (``vision_data.load_images``).
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
        pixels.append(vd.load_images(sp, image_config))
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


# ------------------------------------------------------------------------------- evaluator


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


# -------------------------------------------------------------------------------- adapters

_VISION = re.compile(
    r"(?:^|\.)(?:vision_model\.)?(encoder\.layers\.\d+\."
    r"(?:self_attn\.(?:q_proj|k_proj|v_proj|out_proj)|mlp\.(?:fc1|fc2)))$"
)


def vision_names(adapter: Mapping[str, Any], *, where: str = "adapter") -> dict[str, Any]:
    """An adapter's modules renamed to CLIP's vision tower (``vision_model.encoder.layers.N.
    self_attn.q_proj``): PEFT on ``CLIPModel`` / ``CLIPVisionModel`` keeps its names, PEFT on the
    tower itself (KnOTS: ``get_peft_model(model.vision_model, ...)``, names
    ``encoder.layers.N...``) gains the ``vision_model.`` prefix.

    Raises:
      InputError: a text-tower module (the heads are the base text tower's), a name that is not
        a linear layer of the vision tower's encoder, two names for one module.

    Example:
      >>> list(vision_names({"encoder.layers.0.self_attn.q_proj": 1}))
      ['vision_model.encoder.layers.0.self_attn.q_proj']
    """
    out: dict[str, Any] = {}
    for name, mod in adapter.items():
        if "text_model" in name:
            raise InputError(
                f"{where}: module {name!r} is in CLIP's text tower; the vision suite folds "
                "adapters into the vision tower only (its heads are the base text tower's)."
            )
        m = _VISION.search(name)
        if m is None:
            raise InputError(
                f"{where}: module {name!r} is not a linear layer of CLIP's vision encoder "
                "(expected names like 'vision_model.encoder.layers.0.self_attn.q_proj' or, PEFT "
                "on the tower itself, 'encoder.layers.0.self_attn.q_proj')."
            )
        new = "vision_model." + m.group(1)
        if new in out:
            raise InputError(f"{where}: two modules map to {new!r}.")
        out[new] = mod
    return out


def match_adapters(args: Sequence[Any]) -> dict[str, pathlib.Path]:
    """``{dataset: folder}`` from ``--adapters`` items (``suites.AdapterArg``: ``name`` or None,
    ``path``): a named item is that dataset's; a bare folder is the dataset its name ends with
    (``KnOTS-ViT-B-32_lora_R16_dtd`` -> ``dtd``), else the next unmatched dataset of
    :data:`vision_data.ORDER` in order.

    Raises:
      InputError: a dataset given twice, more bare folders than datasets left, fewer than 2.
    """
    out: dict[str, pathlib.Path] = {}
    bare = []

    def add(name: str, path: Any) -> None:
        if name in out:
            raise InputError(f"--adapters: dataset {name!r} is given twice ({out[name]}, {path})")
        out[name] = pathlib.Path(path)

    for a in args:
        if a.name is not None:
            add(a.name, a.path)
            continue
        base = pathlib.Path(a.path).name.lower()
        hit = next((d for d in vd.ORDER if base == d or re.search(rf"[_\-.]{d}$", base)), None)
        if hit is not None:
            add(hit, a.path)
        else:
            bare.append(a.path)
    free = [d for d in vd.ORDER if d not in out]
    if len(bare) > len(free):
        raise InputError(
            f"--adapters: {len(bare)} folder(s) without a dataset name and only {len(free)} "
            "dataset(s) left; name them: --adapters dtd=DIR,eurosat=DIR,..."
        )
    for d, path in zip(free, bare, strict=False):
        add(d, path)
    if len(out) < 2:
        raise InputError(f"--adapters: merging needs at least 2 adapters, got {len(out)}")
    return out


def _digest(paths: Sequence[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _adapter_files(d: pathlib.Path) -> list[pathlib.Path]:
    from ... import peft

    files = [d / peft.CONFIG_NAME]
    for name in (peft.WEIGHTS_NAME, peft.PICKLE_NAME):
        if (d / name).is_file():
            return [*files, d / name]
    return files


def check_folders(
    model_dir: Any = None,
    data_dir: Any = None,
    adapters: Sequence[Any] | None = None,
    model_devices: int | None = None,
    min_bytes: int | None = None,
) -> None:
    """The up-front checks of ``netutility demo --suite vision`` (before any work): every flag
    given, the model folder's files, each adapter folder's files, each dataset's folder with a
    test split, and the readers the files need (``model_devices`` and ``min_bytes``, checked by
    ``netutility demo``, are not looked at).

    Raises:
      InputError: a missing flag, file or reader (one line, naming the flag; the suite's spec
        turns it into ``suites.SuiteUnavailable``).
    """
    missing = [
        f for f, v in (("--model-dir", model_dir), ("--data-dir", data_dir), ("--adapters", adapters))
        if not v
    ]  # fmt: skip
    if missing:
        raise InputError(
            f"the vision suite needs {', '.join(missing)}: --model-dir CLIP_FOLDER (config.json, "
            "model.safetensors, tokenizer.json), --data-dir DATA (DATA/<dataset>/test/...) and "
            "--adapters NAME=DIR,... (PEFT LoRA folders)"
        )
    require_modules(
        [("tokenizers", "tokenizers"), ("PIL", "pillow"), ("safetensors", "safetensors")],
        lambda _, what: InputError(f"the vision suite needs {what}: pip install {what}"),
    )
    m = pathlib.Path(model_dir)
    for f in ("config.json", "tokenizer.json"):
        if not (m / f).is_file():
            raise InputError(f"--model-dir {m}: no {f} (a Hugging Face CLIPModel folder)")
    if not ((m / "model.safetensors").is_file() or (m / "model.safetensors.index.json").is_file()):
        extra = " (pytorch_model.bin is not read)" if (m / "pytorch_model.bin").exists() else ""
        raise InputError(f"--model-dir {m}: no model.safetensors{extra}")
    matched = match_adapters(adapters)
    from ... import peft

    for name, d in matched.items():
        if not (d / peft.CONFIG_NAME).is_file():
            raise InputError(f"--adapters {name}={d}: no {peft.CONFIG_NAME} (a PEFT folder)")
        if len(_adapter_files(d)) < 2:
            raise InputError(f"--adapters {name}={d}: no {peft.WEIGHTS_NAME} or {peft.PICKLE_NAME}")
        try:
            ds = vd.dataset_dir(data_dir, name)
        except MissingFileError as e:
            raise InputError(str(e)) from None
        found = vd.find_split(ds, "test")
        if found is None:
            raise InputError(
                f"--data-dir: {ds} has no test split ({ds}/test/<class>/*.jpg or "
                f"{ds}/test-*.parquet)"
            )
        if any(
            f is not None and f.kind == "parquet"
            for f in (found, vd.find_split(ds, "val"), vd.find_split(ds, "train"))
        ):
            try:
                vd.parquet_reader()
            except vd.VisionDataError:
                raise InputError(
                    f"--data-dir: {ds} holds parquet files; reading them needs pyarrow: pip "
                    "install pyarrow"
                ) from None



def requires(**given: Any) -> None:
    """:func:`check_folders` as the suite's ``SuiteSpec.requires``: a missing flag, file or
    reader is a ``suites.SuiteUnavailable`` (one line naming the flag)."""
    try:
        check_folders(**given)
    except NetUtilityError as e:
        raise suites.SuiteUnavailable(str(e)) from None


# ----------------------------------------------------------------------------------- suite


def _fingerprint_files(d: pathlib.Path) -> dict[str, list[int]]:
    out = {}
    for f in sorted(d.iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors") or f.name == "tokenizer.json"):
            st = f.stat()
            out[f.name] = [int(st.st_size), int(st.st_mtime_ns)]
    return out


def build(
    *,
    model_dir: str | os.PathLike,
    data_dir: str | os.PathLike,
    adapters: Sequence[Any] | Mapping[str, Any],
    model_devices: int | None = None,
    min_bytes: int | None = None,
) -> VisionSuite:
    """The suite for ``--model-dir``, ``--data-dir``, ``--adapters``, ``--model-devices`` and
    ``--min-bytes`` (``SuiteSpec.build``): loads CLIP, split over the first ``model_devices``
    local devices (``sharding.model_mesh``) when given, weights under ``min_bytes``
    replicated."""
    from ..models import sharding

    mesh = None if model_devices is None else sharding.model_mesh(model_devices)
    return VisionSuite(model_dir, data_dir, adapters, mesh=mesh, min_bytes=min_bytes)


class VisionSuite:
    """CLIP, its zero-shot heads and the given adapters: the suite interface
    ``runner.run_experiment`` drives (see ``suites.Suite``), plus :meth:`load_tasks` (a suite
    that reads its own data).

    Args:
      model_dir: a Hugging Face ``CLIPModel`` folder (module doc).
      data_dir: the datasets (:mod:`vision_data`).
      adapters: ``--adapters`` items (``suites.AdapterArg``) or ``{dataset: folder}``.
      mesh: None (one device), or a one-axis mesh (``sharding.model_mesh``; ``netutility demo
        --model-devices``) to split CLIP's weights over: each weight is placed as it is read
        (``clip.from_pretrained(mesh=...)``: no device holds the whole model), before the heads
        and the backbone are built. Results match one device's up to float32 rounding; the run
        records the mesh (``results.json``'s ``placement``).
      min_bytes: with ``mesh``: parameters smaller than this are replicated (None:
        ``sharding.MIN_BYTES``).

    Attributes:
      mesh: as given.
      placement: where ``shard_model`` put the model (a ``sharding.ShardSummary``), or None.
    """

    name = SUITE

    def __init__(
        self, model_dir: str | os.PathLike, data_dir: str | os.PathLike,
        adapters: Sequence[Any] | Mapping[str, Any], *, mesh: Any = None,
        min_bytes: int | None = None,
    ):  # fmt: skip
        from ..models import clip, sharding

        min_bytes = sharding.MIN_BYTES if min_bytes is None else min_bytes
        if mesh is not None:  # checked before the load
            sharding.placer(mesh, min_bytes=min_bytes, fn="VisionSuite")
        self.model_dir, self.data_dir = pathlib.Path(model_dir), pathlib.Path(data_dir)
        self.adapter_dirs = (
            {k: pathlib.Path(v) for k, v in adapters.items()}
            if isinstance(adapters, Mapping)
            else match_adapters(adapters)
        )
        self.model, self.config, self.image_config = clip.from_pretrained(
            self.model_dir, mesh=mesh, min_bytes=min_bytes
        )
        self.mesh, self.placement, self.min_bytes = mesh, None, min_bytes
        if mesh is not None:  # (already in place: this only summarises where)
            self.model, self.placement = sharding.shard_model(self.model, mesh, min_bytes=min_bytes)
        self.tokenizer = load_tokenizer(self.model_dir, self.config)
        self._loaded: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        self._backbone: VisionBackbone | None = None
        self._memo: dict = {}
        self._heads_digest = ""
        self._weights = _fingerprint_files(self.model_dir)
        vc = self.config.vision_config
        self.tokens = vc.num_positions

    @property
    def model_devices(self) -> int:
        """The devices the model's weights are split over (1 without a mesh)."""
        return 1 if self.mesh is None else int(self.mesh.size)

    @property
    def description(self) -> str:
        vc = self.config.vision_config
        split = f", on a {self.model_devices}-device mesh" * (self.model_devices > 1)
        return (
            f"CLIP ViT (patch {vc.patch_size}, {vc.num_layers} layers, width {vc.hidden_size}, "
            f"{vc.image_size} px) from {self.model_dir.name}{split}"
        )

    # -- data and adapters ---------------------------------------------------------------------

    def load_tasks(self, preset: gr.Preset) -> Any:
        """The datasets of the adapters, split (``vision_data.load_task``), and ``preset`` with
        the adapters' rank and alpha.

        Returns:
          :class:`VisionTasks`.
        """
        from ..harness import runner

        cfg = preset.train
        tasks = [
            vd.load_task(
                self.data_dir,
                name,
                n_val=preset.n_val,
                n_test=preset.n_test,
                holdout_from=cfg.holdout,
                seed=runner.SPLIT_SEED,
            )
            for name in self.adapter_dirs
        ]
        infos = [self._adapter(name)[1] for name in self.adapter_dirs]
        rank = max(i["r"] for i in infos)
        alphas = {i["lora_alpha"] for i in infos}
        alpha = alphas.pop() if len(alphas) == 1 else cfg.lora_alpha
        train = dataclasses.replace(cfg, lora_rank=rank, lora_alpha=float(alpha))
        return VisionTasks(tasks, dataclasses.replace(preset, train=train))

    def _adapter(self, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Dataset ``name``'s adapter (vision-tower names, float32 numpy) and its info; loaded
        once."""
        if name in self._loaded:
            return self._loaded[name]
        import netutility_jax as nu

        d = self.adapter_dirs[name]
        where = f"--adapters {name}={d}"
        t0 = time.perf_counter()
        raw = nu.peft.load_adapter(d)
        adapter = vision_names(raw, where=where)
        from ..models import clip

        for n, p in zip(adapter, clip.nnx_names(adapter), strict=True):
            parts = [int(x) if x.isdigit() else x for x in p.split("/")]
            if parts[3] >= self.config.vision_config.num_layers:
                raise InputError(
                    f"{where}: module {n!r} names layer {parts[3]} but the model's vision tower "
                    f"has {self.config.vision_config.num_layers}; is the adapter for another CLIP?"
                )
        adapter = {
            n: {
                "lora_a": np.asarray(m["lora_a"], np.float32),
                "lora_b": np.asarray(m["lora_b"], np.float32),
                "scale": float(m["scale"]),
            }
            for n, m in adapter.items()
        }
        cfg = nu.peft.load_config(d)
        ranks = {int(m["lora_a"].shape[1]) for m in adapter.values()}
        files = _adapter_files(d)
        info = {
            "cache_key": _digest(files),
            "source": str(d),
            "files": [f.name for f in files],
            "modules": len(adapter),
            "r": max(ranks),
            "lora_alpha": float(cfg.get("lora_alpha", max(ranks))),
            "loaded": True,
            "steps": 0,
            "best_step": 0,
            "best_val_accuracy": float("nan"),
            "stopped_early": False,
            "train_seconds": time.perf_counter() - t0,
            "tokens_per_second": float("nan"),
            "history": [],
            "cache_hit": False,
        }
        self._loaded[name] = (adapter, info)
        return adapter, info

    # -- the suite interface -------------------------------------------------------------------

    def heads(self, tasks: Sequence[Any]) -> list[ZeroShotHead]:
        """One zero-shot head per dataset (:func:`zero_shot_heads`)."""
        heads = zero_shot_heads(self.model, self.tokenizer, tasks)
        h = hashlib.sha256()
        for hd in heads:
            h.update(hd.task.encode())
            h.update(np.ascontiguousarray(hd.vectors).tobytes())
        self._heads_digest = h.hexdigest()
        return heads

    def eval_sets(self, tasks: Sequence[Any], heads: Any, config: Any) -> tuple[ImageSet, ImageSet]:
        """The validation and test images of every dataset, preprocessed once."""
        names = [t.name for t in tasks]
        kw = {"tokens": self.tokens, "batch_size": config.batch_size}
        val = make_image_set(names, [t.val for t in tasks], self.image_config, **kw)
        test = make_image_set(names, [t.test for t in tasks], self.image_config, **kw)
        return val, test

    def train_tasks(self, tasks, heads, config, *, cache_dir, progress, log) -> list[Any]:
        """The given adapters (nothing trains), one per dataset, as ``fitting.TrainedTask``."""
        from ..harness.fitting import TrainedTask

        out = []
        for t in tasks:
            if t.name not in self.adapter_dirs:
                raise InputError(
                    f"VisionSuite: no adapter for dataset {t.name!r}; --adapters gives "
                    f"{', '.join(self.adapter_dirs)}."
                )
            adapter, info = self._adapter(t.name)
            out.append(TrainedTask(t.name, tuple(t.labels), adapter, dict(info)))
        if log is not None and not self._memo:
            log(
                "vision: adapters "
                + ", ".join(f"{t.name} <- {self.adapter_dirs[t.name]}" for t in tasks)
            )
        return out

    def evaluator(self, trained, heads, val, test, *, cache_dir) -> VisionEvaluator:
        """Single-adapter and zero-shot accuracies (once per run) and the merge evaluator."""
        names = sorted({n for t in trained for n in t.adapter})
        if self._backbone is None or self._backbone.names != tuple(names):
            self._backbone = VisionBackbone(self.model, self.image_config, names)
        return VisionEvaluator(
            self._backbone, [t.adapter for t in trained], heads, val, test, memo=self._memo,
            keys=[t.info["cache_key"] for t in trained],
        )  # fmt: skip

    def eval_key(self, config: Any) -> dict[str, Any]:
        """What determines a merge's evaluation besides the images (part of every job key)."""
        from ..models import sharding

        return {
            "suite": self.name,
            "code_version": CODE_VERSION,
            "weights": self._weights,
            "image_config": dataclasses.asdict(self.image_config),
            "heads": self._heads_digest,
            # a split model sums in another order (float32 rounding): its own key
            **sharding.split_key(self.model_devices, self.min_bytes),
        }

    def timing(self) -> dict[str, Any]:
        """The vision tower's passes (images as tokens: patches + class token each)."""
        if self._backbone is None:
            return {"passes": 0, "tokens": 0, "slot_tokens": 0, "seconds": 0.0,
                    "tokens_per_second": float("nan")}  # fmt: skip
        return self._backbone.timing()

    def report(self, run: Any) -> VisionReport:
        """The vision suite's report wording (:class:`VisionReport`)."""
        return VisionReport(self, run)


# ---------------------------------------------------------------------------------- report


class VisionReport(SuiteReport):
    """The report's wording and fields for the vision suite: CLIP, its zero-shot heads, images,
    and adapters that are given rather than trained."""

    unit = "images"
    zero_shot_model = "base CLIP with the zero-shot heads"
    trained = False

    def __init__(self, suite: VisionSuite, run: Any):
        from ..models import sharding

        self.description = suite.description
        self.layers = f"the {suite.config.vision_config.num_layers} layers of the vision tower"
        self.tasks = list(run.tasks)
        self.adapters = {n: str(p) for n, p in suite.adapter_dirs.items()}
        self.train = dataclasses.asdict(run.preset.train)
        self.placement = sharding.placement_record(
            getattr(suite, "placement", None), getattr(suite, "min_bytes", None)
        )

    def evaluation(self, run: Any, common: dict[str, Any]) -> dict[str, Any]:
        return {
            **common,
            "model": self.description,
            "batch_size": run.preset.train.batch_size,
            "heads": "CLIP zero-shot: exp(logit_scale) * unit(mean over templates of unit text "
            "embeddings) per class (KnOTS' heads)",
            "validation": {t.name: t.holdout for t in self.tasks},
        }

    def fields(self, run: Any) -> dict[str, Any]:
        own = {k: v for k, v in self.train.items() if k != "seed"}  # nothing trains here
        return {
            "train_config": {**own, "trained": False},
            "adapters": self.adapters,
            "placement": self.placement,
        }

    def title(self, results: Mapping[str, Any]) -> str:
        return f"# netutility demo --suite vision ({results['preset']})"

    def model(self, results: Mapping[str, Any]) -> str:
        return (
            f"Vision suite: {self.description}, each dataset classified by CLIP's zero-shot head "
            "from the base text tower (KnOTS' heads); the task LoRAs are given (PEFT folders), "
            "not trained"
        )

    def heads(self, results: Mapping[str, Any]) -> str:
        parts = [
            f"{t.name}: {len(t.templates)} template(s), e.g. {t.label_texts[0]!r}"
            for t in self.tasks
        ]
        return "Zero-shot heads (CLIP prompts per class): " + "; ".join(parts) + "."

    def step(self, train_config: Mapping[str, Any]) -> str:
        return "the adapters were loaded from PEFT folders, not trained here (no steps)"

    def training(self, results: Mapping[str, Any]) -> list[str]:
        """The adapters section (for a harness that asks a suite for its training section)."""
        lines = ["", "## Adapters (given, not trained)", "", "| Task | folder | r | alpha |",
                 "|---|---|---:|---:|"]  # fmt: skip
        first = next(iter(results["training"].values()))
        for name, i in first.items():
            lines.append(f"| {name} | {i['source']} | {i['r']} | {i['lora_alpha']:g} |")
        return lines


# ---------------------------------------------------------------------------------- declaration

#: The suite, registered (``netutility demo --suite vision``).
SPEC = suites.register(
    suites.SuiteSpec(
        name="vision",
        summary="CLIP (--model-dir, e.g. openai/clip-vit-base-patch32) with zero-shot heads from "
        "its text tower, merging given PEFT LoRAs (--adapters, e.g. KnOTS' rank-16 ones) "
        "evaluated on image datasets (--data-dir): the paper's Table 1",
        presets=lambda: PRESETS,
        build=build,
        requires=requires,
        grids=("paper",),
        cost="paper grid: 66 merges, each about 9 passes over the validation images and one "
        "over the test images, about 90k images of the 7 datasets in all: roughly 1-2 h on one "
        "H100 (an estimate; not measured), far too long for a CPU; --quick: minutes on a GPU",
        flags=suites.FLAGS,
    ),
    builtin=True,
)
