"""The language suite in the paper's formulation: a classification head trained with each LoRA.

The paper's language setting (Appendix B) does not score label words: every task's LoRA trains
with a **sequence-classification head** (last-token pooling of the final hidden state, a linear
``score`` head without bias) over **one label space shared by all tasks**, a task's unused
classes masked at ``-1e10``, and the merged model is evaluated with **each task's own trained
head**. :mod:`nli` implements that for the paper's six NLI datasets and a Hugging Face Qwen3 /
Llama folder, neither of which is on a machine without network. This suite runs the same code
(:mod:`nli_head`: :class:`nli_head.Trainer`, :class:`nli_head.Evaluator`, the PEFT export with
the head in ``modules_to_save``) on what is here: SmolLM2-135M-Instruct (the language suite's
decoder, from its GGUF) and this project's labelled tasks (:mod:`tasks`, the language suite's
six by default), so that both formulations can be compared on one model and one set of tasks.

What is the paper's and what is ours:

* the paper's: the head and its pooling, the masking value, training the head with the LoRA
  (PEFT's ``modules_to_save``), LoRA r 16, alpha 16, dropout 0.1 on q, k, v, o of every layer,
  AdamW without weight decay, a linear schedule with 6% warmup, gradient clipping at norm 1
  (transformers' default), one shared LoRA initialisation for all tasks (its codebase seeds
  once), each task read by its own head after merging;
* ours: the **label space**. The paper's tasks share three named classes (entailment, neutral,
  contradiction) and a binary task masks the one it lacks. This project's tasks have unrelated
  labels (sentiment, part of speech, WordNet categories, ...), so the shared space here is
  ``C`` numbered slots (:func:`slot_labels`; ``C`` the most labels of any task, 6 for the
  default tasks), task label ``k`` in slot ``k``, the slots past a task's own labels masked.
  Since every task keeps its own head, the slots only fix the head's shape; what the merge
  shares is the LoRA. The inputs are the task's raw texts (a pair task's two parts as a
  pair, as the paper's premise and hypothesis), with no prompt;
* ours: the **training length** (a CPU's): AdamW at ``3e-4`` (the paper: ``3e-5``), 16 texts a
  step (the paper: 1), at most 250 steps (the paper: up to 10 epochs), validation every 25
  steps with a patience of 3 (the paper: every 4,000 steps, patience 3). :data:`FULL` and
  :data:`QUICK` say so in their configs, which every result records. The learning rate was
  chosen on word_sentiment's validation texts (seed 0): ``1e-3`` peaked at step 50 (0.77) and
  stopped early, ``3e-4`` rose to 0.81 at step 250; no test label was read.

The label-word formulation (:mod:`language`: the frozen LM head restricted to the label words)
is this project's own and stays the ``language`` suite. Both suites share the tasks, splits,
grid, statistics and report; only the formulation differs.

``netutility demo --suite language_head [--quick]`` runs it; :func:`run` is the Python entry
point; :func:`export_adapters` writes the trained adapters with their heads as PEFT folders that
``peft.PeftModel.from_pretrained`` loads on ``LlamaForSequenceClassification`` (``num_labels=C``).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ...errors import InputError, InputTypeError
from ..data import nli_data as nd
from ..data import tasks as tk
from ..harness import grid as gr
from ..harness import suites
from ..harness.report_markdown import SuiteReport
from ..harness.suites import ScoredSuite
from ..models import llama
from . import lang_eval as le
from . import language as lg
from . import nli_head as nh

__all__ = [
    "CODE_VERSION",
    "FULL",
    "PRESETS",
    "QUICK",
    "SPEC",
    "SUITE",
    "LanguageHeadReport",
    "LanguageHeadRun",
    "LanguageHeadSuite",
    "export_adapters",
    "run",
    "slot_labels",
    "unified_task",
]

#: Bump when a change here changes what a merge job produces: invalidates the job caches.
CODE_VERSION = 1
SUITE = "language_head"

# Sizing (2-core CPU; the language suite's measurements, the texts shorter here: a word or a
# pair of words, 2 to 10 tokens, padded to 16): a training step of 16 texts (forward, backward,
# dropout on the LoRA branch) about 1 CPU-s; evaluation 64 texts a batch.
#: The CI form: two tasks, 40 steps, TA and TIES at R = 16, 24 validation and 60 test texts
#: a task (minutes on a 2-core CPU; evaluation was half of the run with 40 and 100).
QUICK = gr.Preset(
    name="quick",
    tasks=("word_sentiment", "word_pos"),
    seeds=(0,),
    train=nh.NLITrainConfig(
        rows=8,
        row_len=24,
        learning_rate=2e-3,
        warmup_fraction=0.06,
        max_steps=40,
        max_epochs=10,
        eval_every=10,
        patience=2,
        eval_tokens=1024,
    ),
    grid=gr.GridConfig(
        rows=(gr.Row("ta", "full"), gr.Row("ties", "full")),
        budgets=(16,),
        full_capacity=False,
        weight_average=False,
    ),
    max_train=640,
    n_val=24,
    n_test=60,
)
#: The full run: the language suite's six tasks, seeds and grid, with App. B's head, LoRA,
#: optimizer and shared initialisation, and a CPU's training length (see the module docstring).
FULL = gr.Preset(
    name="full",
    tasks=lg.FULL.tasks,
    seeds=lg.FULL.seeds,
    train=nh.NLITrainConfig(
        rows=16,
        row_len=40,
        learning_rate=3e-4,
        warmup_fraction=0.06,
        max_steps=250,
        max_epochs=10,
        eval_every=25,
        patience=3,
        eval_tokens=1024,
    ),
    grid=lg.FULL.grid,
    max_train=lg.FULL.max_train,
    n_val=lg.FULL.n_val,
    n_test=lg.FULL.n_test,
)
PRESETS = {p.name: p for p in (QUICK, FULL)}


# ------------------------------------------------------------------------------- label space


def slot_labels(num_classes: int) -> tuple[str, ...]:
    """The shared label space of ``num_classes`` numbered slots: ``("slot 0", "slot 1", ...)``."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise InputError(f"slot_labels: num_classes={num_classes!r}; expected an integer >= 2.")
    return tuple(f"slot {k}" for k in range(num_classes))


def _text(task: Any, text: str) -> str | tuple[str, str]:
    if not task.pair:
        return text
    first, sep, second = text.partition(tk.PAIR_SEP)
    if not sep:
        raise InputError(
            f"language_head: task {task.name!r} is a pair task but the text {text!r} has no "
            f"separator {tk.PAIR_SEP!r} between its two parts."
        )
    return first, second


def unified_task(task: Any, num_classes: int) -> tk.Task:
    """``task`` in the shared label space of ``num_classes`` slots: label ``k`` in slot ``k``,
    the slots past its own labels marked ``nli_data.UNUSED`` (masked by its head), its texts
    raw (a pair task's two parts as a ``(first, second)`` pair).

    Raises:
      InputError: the task has more labels than ``num_classes``, or a pair text without its
        separator.
    """
    if not isinstance(task, tk.Task):
        raise InputTypeError(
            f"language_head.unified_task: expected a tasks.Task, got {type(task).__name__}."
        )
    slots = slot_labels(num_classes)
    n = len(task.labels)
    if n > num_classes:
        raise InputError(
            f"language_head.unified_task: task {task.name!r} has {n} labels "
            f"({', '.join(task.labels)}); the label space has {num_classes} slots."
        )

    def split(sp: tk.Split) -> tk.Split:
        return tk.Split(tuple(_text(task, x) for x in sp.texts), sp.labels)

    return tk.Task(
        name=task.name,
        labels=slots,
        train=split(task.train),
        val=split(task.val),
        test=split(task.test),
        source=task.source,
        label_texts=tuple(task.labels) + (nd.UNUSED,) * (num_classes - n),
        pair=task.pair,
    )


# ------------------------------------------------------------------------------------ suite


class LanguageHeadSuite(ScoredSuite):
    """SmolLM2 (or any :class:`llama.Llama`) with a classification head trained per task: the
    ``suites.Suite`` interface (:meth:`heads`, :meth:`eval_sets`, :meth:`train_tasks`,
    :meth:`evaluator`, :meth:`eval_key`, :meth:`timing`, :meth:`report`) over
    :mod:`nli_head`'s trainer and evaluator, on this project's tasks in a shared label space
    (:func:`unified_task`).

    Args:
      model, tokenizer: the base decoder and its tokenizer (default :func:`llama.from_gguf`,
        SmolLM2-135M-Instruct).
      num_classes: the label space's slots (default: the most labels of any task a run gives).
    """

    name = SUITE

    def __init__(
        self,
        model: llama.Llama | None = None,
        tokenizer: Any = None,
        *,
        num_classes: int | None = None,
    ):
        if (model is None) != (tokenizer is None):
            raise InputError("LanguageHeadSuite: pass both model and tokenizer, or neither.")
        if num_classes is not None:
            slot_labels(num_classes)  # checked
        if model is None:
            model, tokenizer, _ = llama.from_gguf()
        self.model, self.tokenizer = model, tokenizer
        self.scorer = nh.Scorer(model)
        self.num_classes = num_classes
        self._weights: str | None = None

    def fingerprint(self) -> str:
        """The model's fingerprint (:func:`lang_eval.model_fingerprint`)."""
        return le.model_fingerprint(self.model)

    @property
    def description(self) -> str:
        c = self.model.config
        return (
            f"a {c.num_layers}-layer {c.model_type} decoder (hidden {c.hidden_size}, "
            f"{c.num_heads}/{c.num_kv_heads} query/key-value heads, vocabulary {c.vocab_size})"
        )

    def classes(self, tasks: Sequence[Any]) -> int:
        """The label space's slots for ``tasks``: ``num_classes``, or their most labels."""
        if self.num_classes is not None:
            return self.num_classes
        return max(2, *(len(t.labels) for t in tasks))

    def unified(self, tasks: Sequence[Any]) -> list[tk.Task]:
        """``tasks`` in the shared label space (:func:`unified_task`)."""
        c = self.classes(tasks)
        return [unified_task(t, c) for t in tasks]

    def heads(self, tasks: Sequence[Any]) -> list[nh.HeadSpec]:
        """One ``nli_head.HeadSpec`` per task: its labels' slots in use, the rest masked."""
        slots = slot_labels(self.classes(tasks))
        return [nh.head_spec(t, slots) for t in self.unified(tasks)]

    def eval_sets(self, tasks: Sequence[Any], heads: Sequence[Any], config: Any) -> tuple[Any, Any]:
        """The validation and test texts (at most ``config.row_len`` tokens each)."""
        kw = {"max_len": config.row_len, "eval_tokens": config.eval_tokens}
        u = self.unified(tasks)
        val = nh.make_set(self.tokenizer, heads, [t.val for t in u], **kw)
        return val, nh.make_set(self.tokenizer, heads, [t.test for t in u], **kw)

    def train_tasks(
        self,
        tasks: Sequence[Any],
        heads: Sequence[Any],
        config: Any,
        *,
        cache_dir: str | os.PathLike,
        progress: bool = True,
        log: Callable[[str], None] | None = None,
    ) -> list[nh.HeadedTask]:
        """Train (or load from ``cache_dir``) every task's LoRA and head
        (``nli_head.train_tasks``)."""
        if not isinstance(config, nh.NLITrainConfig):
            raise InputTypeError(
                f"LanguageHeadSuite.train_tasks: config is a {type(config).__name__}; expected "
                "nli_head.NLITrainConfig (the head formulation's training)."
            )
        return nh.train_tasks(
            self.unified(tasks), heads, config, model=self.model, tokenizer=self.tokenizer,
            weights=self.weights, cache_dir=cache_dir, scorer=self.scorer, progress=progress,
            log=log, suite=SUITE,
        )  # fmt: skip

    def evaluator(
        self, trained: Sequence[Any], heads: Sequence[Any], val: Any, test: Any, *, cache_dir: Any
    ) -> nh.Evaluator:
        """Single-LoRA and zero-shot (trained heads, no LoRA) accuracies, cached, and the merge
        evaluator, each task read by its own trained head."""
        adapters, scores = [t.adapter for t in trained], [t.score for t in trained]
        kw = self.cache_args(trained, cache_dir)
        return nh.Evaluator(self.scorer, adapters, scores, val, test, **kw)

    def eval_key(self, config: Any) -> dict[str, Any]:
        """The evaluation settings that determine a merge's result (for the job cache key)."""
        return {
            **self.key_start([nh.CODE_VERSION, CODE_VERSION]),
            "row_len": config.row_len,
            "eval_tokens": config.eval_tokens,
            "mask_logit": nh.MASK_LOGIT,
        }

    def report(self, run: Any) -> LanguageHeadReport:
        """The report's wording (:class:`LanguageHeadReport`)."""
        return LanguageHeadReport(self.description, run, self.classes(run.tasks))


class LanguageHeadReport(SuiteReport):
    """The report's wording and fields for this suite (``report.SuiteReport`` is the encoder's):
    the decoder, its classification heads and the label space.

    Args:
      description: the model (:attr:`LanguageHeadSuite.description`).
      run: the run (its tasks' labels are described).
      num_classes: the label space's slots (:meth:`LanguageHeadSuite.classes`).
    """

    unit = "texts"
    layers = "every layer"
    zero_shot_model = "base model with each task's trained head"

    def __init__(self, description: str, run: Any, num_classes: int):
        self.description = description
        self.num_classes = num_classes
        self.mapping = "; ".join(
            f"{t.name}: " + ", ".join(f"{k} {lab}" for k, lab in enumerate(t.labels))
            for t in run.tasks
        )

    def schedule(self, train_config: Mapping[str, Any]) -> str:
        """``nli_head.NLITrainConfig.schedule``: transformers' linear schedule."""
        return (
            "linear decay to 0 at the schedule's end (transformers' linear schedule; "
            f"min({train_config['max_steps']} steps, {train_config['max_epochs']} epochs))"
        )

    def evaluation(self, run: Any, common: dict[str, Any]) -> dict[str, Any]:
        tc = run.preset.train
        return {
            **common,
            "model": self.description,
            "max_text_tokens": tc.row_len,
            "eval_tokens": tc.eval_tokens,
            "formulation": "sequence classification (the paper's App. B): last-token pooling of "
            f"the final hidden state, a linear head (no bias) per task over {self.num_classes} "
            "shared slots, a task's unused slots masked; the slots are this project's (task "
            "label k in slot k)",
            "mask_logit": nh.MASK_LOGIT,
        }

    def title(self, results: Mapping[str, Any]) -> str:
        return f"# netutility demo --suite language_head ({results['preset']})"

    def model(self, results: Mapping[str, Any]) -> str:
        tc = results["train_config"]
        return (
            f"Language suite, head formulation: {self.description}; each task's raw text (at "
            f"most {tc['row_len']} tokens; a pair task's two parts as a pair) is classified by "
            "its own linear head over the last token's final hidden state, in a label space of "
            f"{self.num_classes} numbered slots shared by the tasks (task label k in slot k, the "
            "others masked at -1e10), the head trained with the task's LoRA (dropout "
            f"{tc['lora_dropout']:g}); every merged model is read by each task's own head"
        )

    def heads(self, results: Mapping[str, Any]) -> str:
        return f"Heads: trained per task with its LoRA. Slots: {self.mapping}."

    def step(self, train_config: Mapping[str, Any]) -> str:
        return (
            f"a step has {train_config['rows']} text(s) of at most {train_config['row_len']} tokens"
        )


# ------------------------------------------------------------------------------- entry points


class LanguageHeadRun(NamedTuple):
    """What :func:`run` returns: the raw ``runner.Run``, the rendered ``report.Experiment``
    (None if ``render_report=False``) and the files written (empty without ``out``)."""

    run: Any
    experiment: Any
    written: list[str]


def export_adapters(
    run_: Any, out: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, **config: Any
) -> list[pathlib.Path]:
    """Write every trained adapter of a run, with its head, as a PEFT folder
    ``<out>/seed<S>/<task>`` (``nli_head.export_peft``), read back from the cache the run used.

    Raises:
      InputError: an adapter is no longer in the cache.
    """
    return nh.export_run(
        "language_head.export_adapters", SUITE, run_, out, cache_dir=cache_dir, **config
    )


def run(
    preset: str | gr.Preset = "quick",
    *,
    out: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    tasks: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    suite: LanguageHeadSuite | None = None,
    task_list: Sequence[Any] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    alpha: float | str = "auto",
    overwrite: bool = False,
    render_report: bool = True,
) -> LanguageHeadRun:
    """Run the suite end to end: train or load, evaluate, merge the grid, report.

    Args: as ``language.run`` (``suite`` a :class:`LanguageHeadSuite`, default SmolLM2).

    Returns:
      :class:`LanguageHeadRun`.
    """
    from ..harness import report, runner

    p = PRESETS[preset] if isinstance(preset, str) else preset
    if out is not None and not overwrite and report.existing_results(pathlib.Path(out)):
        raise FileExistsError(f"{report.existing_results(pathlib.Path(out))[0]} already exists")
    if task_list is None:
        task_list = tk.load_tasks(
            list(tasks or p.tasks), seed=runner.SPLIT_SEED, max_train=p.max_train,
            n_val=p.n_val, n_test=p.n_test,
        )  # fmt: skip
    if len(task_list) < 2:
        raise InputError(f"language_head.run: merging needs >= 2 tasks, got {len(task_list)}.")
    suite = LanguageHeadSuite() if suite is None else suite
    run_ = runner.run_experiment(
        task_list, p, suite=suite, seeds=seeds, cache_dir=cache_dir, progress=progress, log=log,
        alpha=alpha,
    )  # fmt: skip
    if not render_report:
        return LanguageHeadRun(run_, None, [])
    exp = report.render(
        run_, suite.report(run_),
        command=f"netutility_jax.experiments.suites.language_head.run({p.name!r})",
    )  # fmt: skip
    written = [] if out is None else report.write_outputs(exp, out, overwrite=overwrite)
    return LanguageHeadRun(run_, exp, written)


# ---------------------------------------------------------------------------------- declaration

#: The suite, registered (``netutility demo --suite language_head``).
SPEC = suites.register(
    suites.SuiteSpec(
        name="language_head",
        summary="SmolLM2-135M with a classification head trained with each LoRA (the paper's "
        "App. B formulation: last-token pooling, one label space, unused classes masked) on "
        "this project's tasks",
        presets=lambda: PRESETS,
        build=lambda: LanguageHeadSuite(),  # (looked up when called)
        requires=lg.requires,
        grids=("full",),
        cost="hours on a 2-core CPU; --quick: minutes",
    ),
    builtin=True,
)
