"""The vision suite: given CLIP LoRAs merged under rank budgets, the paper's Table 1 setting.

The paper (Experimental details; KnOTS' setup) merges the KnOTS rank-16 LoRAs of CLIP ViT-B/32
(``openai/clip-vit-base-patch32``; r=16, lora_alpha=16 on ``q_proj, k_proj, v_proj, out_proj``
of the vision tower) for DTD, EuroSAT, GTSRB, MNIST, RESISC45, SUN397 and SVHN. This suite runs
that setting with the experiment harness (``runner.run_experiment``, :mod:`grid`, :mod:`stats`,
:mod:`report`), from files on disk::

    netutility demo --suite vision --model-dir CLIP --data-dir DATA \\
        --adapters dtd=A/dtd,eurosat=A/eurosat,...   # --grid paper (default) or --quick

1. **Adapters** (``--adapters``, :meth:`VisionSuite.train_tasks`; :mod:`vision_adapters`): one
   PEFT LoRA folder per dataset (``adapter_config.json`` and ``adapter_model.safetensors`` or the
   pickled ``adapter_model.bin``, read without torch by ``nu.peft.load_adapter``), named
   ``NAME=DIR`` or matched by folder name (``..._dtd``) or else by order
   (:data:`vision_data.ORDER`). Module names are mapped to the vision tower
   (:func:`vision_adapters.vision_names`): PEFT on ``CLIPModel`` or ``CLIPVisionModel``
   (``vision_model.encoder.layers.N...``) and PEFT on the tower itself, as KnOTS trains
   (``encoder.layers.N...``). Nothing trains: the adapters are what is merged.
2. **Heads** (:func:`vision_heads.zero_shot_heads`): CLIP's zero-shot classifier from the base
   text tower, as KnOTS' ``generate_clip_heads.py`` builds it: per class, the text embeddings of
   its prompts (one per template of :mod:`vision_data`) are L2-normalized, averaged, normalized
   again and multiplied by ``exp(logit_scale)``. Prompts are tokenized with the model folder's
   ``tokenizer.json`` (the ``tokenizers`` library; no vocabulary is downloaded).
3. **Evaluation** (:class:`vision_eval.VisionEvaluator`): a merge is folded into the vision
   tower's kernels, ``W + coef * dK`` (the fold of ``clip.fold_adapter``, done inside one jitted
   forward so a new coefficient never recompiles), each image embedded and normalized, and
   classified by its dataset's head (argmax). Accuracy per dataset; normalized accuracy = merged
   / the dataset's own adapter x 100 (the paper's metric); the coefficient chosen on validation
   by ``evaluate.MergeSearch`` (the grid 0.1 ... 9.9, as for every suite); test evaluated once.
4. **Data** (:mod:`vision_data`, :mod:`vision_tasks`): image folders or parquet files;
   validation as KnOTS (20% of test, or the dataset's own validation split); the preset's
   ``n_val``/``n_test`` limit sizes (the paper preset keeps every image).

What the model folder (``--model-dir``) must hold: ``config.json`` and ``model.safetensors``
(or sharded safetensors with their index; pickles are refused), ``tokenizer.json`` (the Hugging
Face repository has it; if yours lacks it, write it once with
``transformers.CLIPTokenizerFast.from_pretrained(DIR).save_pretrained(DIR)``) and optionally
``preprocessor_config.json`` (CLIP's 224 bicubic + center crop otherwise).

Presets: :data:`PAPER` (Table 1: TA, TSV, TIES, DARE in full, Core and KnOTS space at R = 64,
32, 16; Iso-C and Iso-C + TSV at R = 16; uniform vs Net Utility; the controls; every test image)
and :data:`QUICK` (TA and TIES at R = 16 on 50 validation and 100 test images per dataset).
The report's wording is :mod:`vision_report`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError, NetUtilityError
from ..data import vision_data as vd
from ..data import vision_tasks as vt
from ..harness import grid as gr
from ..harness import suites
from .vision_adapters import check_folders, load_adapter, match_adapters
from .vision_eval import ImageSet, VisionBackbone, VisionEvaluator, make_image_set
from .vision_heads import ZeroShotHead, load_tokenizer, zero_shot_heads
from .vision_report import VisionReport

__all__ = [
    "CODE_VERSION",
    "PAPER",
    "PRESETS",
    "QUICK",
    "SPEC",
    "SUITE",
    "VisionConfig",
    "VisionSuite",
    "VisionTasks",
    "build",
    "requires",
]

#: Bump when a change here changes what a merge job produces: invalidates the job caches.
CODE_VERSION = 1
SUITE = "vision"


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


# ----------------------------------------------------------------------------------- suite


class VisionTasks(NamedTuple):
    """What :meth:`VisionSuite.load_tasks` returns: the datasets and the preset with the given
    adapters' rank and alpha (``suites.SuiteWithData``)."""

    tasks: list[vt.VisionTask]
    preset: gr.Preset


def requires(**given: Any) -> None:
    """:func:`vision_adapters.check_folders` as the suite's ``SuiteSpec.requires``: a missing flag, file or
    reader is a ``suites.SuiteUnavailable`` (one line naming the flag)."""
    try:
        check_folders(**given)
    except NetUtilityError as e:
        raise suites.SuiteUnavailable(str(e)) from None


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
        """The datasets of the adapters, split (``vision_tasks.load_task``), and ``preset`` with
        the adapters' rank and alpha.

        Returns:
          :class:`VisionTasks`.
        """
        from ..harness import runner

        cfg = preset.train
        tasks = [
            vt.load_task(
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
        once (:func:`vision_adapters.load_adapter`)."""
        if name not in self._loaded:
            n_layers = self.config.vision_config.num_layers
            self._loaded[name] = load_adapter(name, self.adapter_dirs[name], n_layers)
        return self._loaded[name]

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
