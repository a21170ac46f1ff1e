"""The encoder suite: MiniLM with frozen zero-shot heads, the built-in ``netutility demo``.

The suite plugs into the harness (``runner``, ``grid``, ``report``, ``study``), which never
imports it: :class:`EncoderSuite` is the model side ``runner.run_experiment`` drives (the
default suite), the presets (:data:`QUICK`, :data:`FULL`, :data:`PAPER`, :data:`MECHANISM`,
:data:`PRESETS`) are its grids, :data:`REGIME` and :data:`REGIME_QUICK` its regime studies
(``netutility demo --study regime``), and :func:`requires` its up-front check
(``suites.get("encoder")``). Its model is :mod:`minilm`, its evaluation :mod:`encoder_eval`,
its training :mod:`train`.

The suite registers itself in the harness's registry (:data:`SPEC`, ``suites.get("encoder")``)
when this module is imported.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..harness import grid as gr
from ..harness import runner, suites
from ..harness import study as sd
from ..harness.report_markdown import SuiteReport
from ..harness.suites import SuiteUnavailable
from ..models import minilm
from . import encoder_eval as ev
from . import train as tr

__all__ = [
    "DEFAULT_TASKS",
    "FULL",
    "MECHANISM",
    "PAPER",
    "PRESETS",
    "QUICK",
    "REGIME",
    "REGIME_QUICK",
    "SPEC",
    "STUDIES",
    "EncoderSuite",
    "requires",
]


# ---------------------------------------------------------------------------------------- suite


class EncoderSuite:
    """The built-in encoder suite: MiniLM with frozen zero-shot heads (the default suite).

    A **suite** is what ``runner.run_experiment`` needs from a model (``suites.Suite``): its
    task heads, its validation and test sets, its training, its evaluator and what determines
    an evaluation (for the job cache key). ``language.LanguageSuite`` is the decoder's.

    Args:
      backbone: the base model (default :class:`encoder_eval.Backbone`, the pretrained MiniLM).
    """

    name = "encoder"

    def __init__(self, backbone: ev.Backbone | None = None):
        self.backbone = ev.Backbone() if backbone is None else backbone

    def heads(self, tasks: Sequence[Any]) -> list[ev.Head]:
        return ev.zero_shot_heads(self.backbone, tasks)

    def eval_sets(self, tasks: Sequence[Any], heads: Any, config: Any) -> tuple[Any, Any]:
        names = [t.name for t in tasks]
        val = ev.make_eval_set(names, [t.val for t in tasks])
        return val, ev.make_eval_set(names, [t.test for t in tasks])

    def train_tasks(self, tasks, heads, config, *, cache_dir, progress, log) -> list[Any]:
        return tr.train_tasks(
            tasks, heads, config, cache_dir=cache_dir, backbone=self.backbone,
            progress=progress, log=log,
        )  # fmt: skip

    def evaluator(self, trained, heads, val, test, *, cache_dir) -> ev.Evaluator:
        return ev.Evaluator(self.backbone, [t.adapter for t in trained], heads, val, test)

    def eval_key(self, config: Any) -> dict[str, Any]:
        return {"row_len": ev.ROW_LEN, "rows": ev.ROWS, "temperature": ev.TEMPERATURE}

    def input_moments(self, tasks: Sequence[Any]) -> list[dict[str, Any]]:
        """Each task's input second moments (:func:`nu.input_moments`) for the data-aware
        control: the input of every LoRA target (``minilm_model.target_inputs``) under the base
        model, no LoRA, over the tokens (padding dropped) of the task's first
        :data:`runner.MOMENT_TEXTS` training texts (unlabelled; never validation or test texts),
        packed as the evaluation packs them. Memoised per task name and texts."""
        import netutility_jax as nu

        from ..models.minilm_model import target_inputs

        memo = self.__dict__.setdefault("_moments", {})
        out = []
        for t in tasks:
            texts = tuple(t.train.texts[: runner.MOMENT_TEXTS])
            mk = (t.name, hashlib.sha256("\n".join(texts).encode()).hexdigest())
            if mk not in memo:
                es = ev.make_eval_set([t.name], [_Unlabelled(texts, np.zeros(len(texts), int))])
                acts: dict[str, list[np.ndarray]] = {n: [] for n in self.backbone.module_names}
                for b in es.batches:
                    keep = np.asarray(b.segment_ids) > 0  # padding and empty rows dropped
                    x = target_inputs(
                        self.backbone.model, b.ids, keep, segment_ids=b.segment_ids,
                        position_ids=b.position_ids,
                    )  # fmt: skip
                    for n in acts:
                        acts[n].append(np.asarray(x[n])[keep])
                memo[mk] = nu.input_moments(acts)
            out.append(memo[mk])
        return out

    def moments_key(self) -> dict[str, Any]:
        return {
            "texts": runner.MOMENT_TEXTS, "split": "train", "model": "base, no LoRA",
            "positions": "tokens, padding dropped", "version": 1,
        }  # fmt: skip

    def timing(self) -> dict[str, Any]:
        return self.backbone.timing()

    def report(self, run: Any) -> SuiteReport:
        """The encoder's report wording (``report.SuiteReport``)."""
        return SuiteReport()


class _Unlabelled(NamedTuple):
    """Texts for :func:`encoder_eval.make_eval_set` whose labels are never read."""

    texts: tuple[str, ...]
    labels: np.ndarray


def requires() -> None:
    """Raise ``suites.SuiteUnavailable`` (with the install command) when the pretrained MiniLM
    weights are not installed."""
    try:
        minilm.model_dir()
    except (ModuleNotFoundError, FileNotFoundError):
        raise SuiteUnavailable(
            f"the pretrained MiniLM weights are not installed; install them with: {minilm.INSTALL}"
        ) from None


# -------------------------------------------------------------------------------------- presets


#: The built-in tasks the full presets run when none are chosen.
DEFAULT_TASKS = (
    "austen_novel",
    "tweet_source",
    "word_sentiment",
    "word_pos",
    "wordnet_supersense",
    "verb_supersense",
    "word_relation",
)
_MAIN = ("ta", "tsv", "ties", "dare")

QUICK = gr.Preset(
    name="quick",
    tasks=("word_sentiment", "word_pos", "verb_supersense"),
    seeds=(0,),
    train=tr.TrainConfig(max_steps=60, eval_every=20, patience=2, learning_rate=3e-3),
    grid=gr.GridConfig(
        rows=(gr.Row("ta", "full"), gr.Row("ties", "full")),
        budgets=(16,),
        no_budget=(("ta", "full"),),
        random=(("ta", "full"),),
        controls=(("ta", "full", "energy"),),
    ),
    max_train=600,
    n_val=90,
    n_test=300,
)
FULL = gr.Preset(
    name="full",
    tasks=DEFAULT_TASKS,
    seeds=(0, 1, 2),
    train=tr.TrainConfig(),
    grid=gr.GridConfig(
        rows=(
            *(gr.Row(m, "full") for m in _MAIN),
            gr.Row("iso_c", "full", budgets=(16,)),
            gr.Row("iso_c_tsv", "full", budgets=(16,)),
        ),
        budgets=(64, 32, 16),
        no_budget=tuple((m, "full") for m in (*_MAIN, "iso_c")),
        random=(("ta", "full"),),
    ),
    max_train=2000,
    n_val=200,
    n_test=1000,
)
PAPER = dataclasses.replace(
    FULL,
    name="paper",
    grid=dataclasses.replace(
        FULL.grid,
        rows=(
            gr.Row("ta", "full"),
            *(gr.Row(m, s) for s in ("full", "core", "knots") for m in ("tsv", "dare", "ties")),
            *(gr.Row(m, s) for s in ("full", "knots") for m in ("iso_c", "iso_c_tsv")),
        ),
        random=(("ta", "full"), ("tsv", "full"), ("ties", "full")),
        search=gr.PAPER_SEARCH,
    ),
)
#: The controls that isolate Net Utility's mechanism (this project's design, not the paper's):
#: energy only (lambda 0), lambda scaled by 1/4, 1/2 and 2, lambda chosen on validation among
#: those, alpha fixed at 0 and at 1, and the random split that keeps each task's top directions,
#: beside TA in full space (TSV's rows without controls), with every task starting from the
#: same LoRA initialisation (the paper's codebase's regime, ``TrainConfig.init="shared"``).
MECHANISM = dataclasses.replace(
    FULL,
    name="mechanism",
    train=dataclasses.replace(FULL.train, init="shared"),
    grid=gr.GridConfig(
        rows=(gr.Row("ta", "full"), gr.Row("tsv", "full")),
        budgets=(64, 32, 16),
        no_budget=(("ta", "full"), ("tsv", "full")),
        random=(("ta", "full"),),
        controls=tuple(
            ("ta", "full", v)
            for v in (
                "energy",
                "lam_x0.25",
                "lam_x0.5",
                "lam_x2",
                "random_split",
                "alpha_0",
                "alpha_1",
                "lam_val",
            )
        ),
    ),
)
#: The encoder's presets by name (``netutility demo --quick`` / ``--grid NAME``).
PRESETS = {p.name: p for p in (QUICK, FULL, PAPER, MECHANISM)}


# -------------------------------------------------------------------------------------- studies

_FULL_CENTRE = dataclasses.replace(
    FULL, name="regime", train=dataclasses.replace(FULL.train, init="shared")
)
#: The full regime study: 7 tasks, 3 seeds, TA at R = 32 and 16 (about 10 CPU hours from an
#: empty cache on 2 cores; the centre shares its adapters with ``--grid mechanism``), with the
#: data-aware control (``net_utility_data``, this project's) at both budgets.
REGIME = sd.Study(
    name="regime",
    centre=_FULL_CENTRE,
    grid=sd.regime_grid((32, 16)),
    cells=sd.regime_cells(DEFAULT_TASKS, ("word_sentiment", "word_pos"), (5, 3)),
)
_QUICK_CENTRE = dataclasses.replace(
    QUICK, name="regime-quick", train=dataclasses.replace(QUICK.train, init="shared")
)
#: Its quick form (what CI runs): the quick preset's 3 tasks and training, 1 seed, R = 16.
#: Without the data-aware control: it adds about 11 s per cell and 25 s once (the moments and
#: the data-aware score's compilation), about 80 s over the 5 cells on a busy 2-core CPU; the
#: slow tier's toy study (tests/experiments/test_study_moments.py) runs it instead.
REGIME_QUICK = sd.Study(
    name="regime",
    centre=_QUICK_CENTRE,
    grid=sd.regime_grid((16,), data=False),
    cells=sd.regime_cells(QUICK.tasks, ("word_sentiment",), (2,)),
)
STUDIES = {"regime": (REGIME, REGIME_QUICK)}

# ---------------------------------------------------------------------------------- declaration

#: The suite, registered (``netutility demo --suite encoder``, the default).
SPEC = suites.register(
    suites.SuiteSpec(
        name="encoder",
        summary="MiniLM with frozen zero-shot heads",
        presets=lambda: PRESETS,
        build=lambda: EncoderSuite(),  # (looked up when called: a test may replace the class)
        requires=requires,
        grids=("full", "paper", "mechanism"),
        cost="full grid about 2 h on a 2-core CPU; paper grid about three times longer",
    ),
    builtin=True,
)
