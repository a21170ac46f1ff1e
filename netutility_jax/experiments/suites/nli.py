"""The NLI suite: the paper's language setting (Qwen3-4B, six NLI tasks, a classification head).

``netutility demo --suite nli --model-dir QWEN_FOLDER --data-dir DATA`` runs the paper's second
suite as Appendix B describes it, on a Hugging Face ``Qwen3ForCausalLM`` / ``LlamaForCausalLM``
folder (the paper's base is Qwen3-4B-Instruct) and local copies of SNLI, MNLI, SICK, QNLI, RTE
and SciTail (:mod:`nli_data`: layouts, fields, label mapping; :mod:`nli_tasks`: split protocol):

1. every task is a premise-hypothesis pair classified by a linear head over the last token's
   final hidden state, in one three-way label space, a binary task's unused class masked at
   ``-1e10`` (:mod:`nli_head`);
2. each task's LoRA (r 16, alpha 16, dropout 0.1 on q, k, v, o of every layer) trains with its
   head: AdamW 3e-5, linear schedule with 6% warmup, batch 1, up to 10 epochs, validation every
   4,000 steps, early stopping after 3 (Appendix B and its hyperparameter table; cached on disk; exported as PEFT
   folders with the head in ``modules_to_save``, :func:`export_adapters`);
3. the grid of the paper's Table 2 (TA; TSV, DARE, TIES in full, Core and KnOTS space, at
   R = 64, 32, 16, uniform vs Net Utility) and its Iso-C table, Table 3 (Iso-C + TA, Iso-C + TSV at
   R = 16, full space) is merged by ``runner.run_experiment``, each merged model evaluated with
   every task's own head, its coefficient chosen on validation, its test correctness kept for
   the paired bootstrap.

:class:`NLISuite` implements ``suites.Suite``. Presets (built on first use, so that importing
this module stays cheap): :data:`PAPER`, the paper's setting
above on the full data (one seed; days of GPU time: SNLI and MNLI alone are ~940k training pairs
at batch 1), and :data:`QUICK`, the CI form: three tasks (a three-way, a QNLI-like and a
SciTail-like head), about a hundred training pairs each, two epochs at batch 8, TA, TSV and
TIES at R = 16. :func:`nli_toy.write_toy` writes what CI runs it on: a tiny random Qwen3 folder
and synthetic data in the six datasets' formats (``python -m
netutility_jax.experiments.suites.nli --write-toy DIR``, :func:`main`); the report's wording is
:mod:`nli_report`'s.

Registered in the harness's registry by this module (:data:`SPEC`); it takes the command line's
``--model-dir``, ``--data-dir`` and ``--model-devices`` (the decoder split over that many local
devices, :class:`NLISuite`'s ``mesh``).
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ...errors import InputError, MissingFileError
from ..harness import suites
from ..harness.suites import ScoredSuite, require_modules

if TYPE_CHECKING:  # the heavy modules are imported where they are used
    from ..harness import grid as gr
    from . import nli_head as nh

__all__ = [
    "CODE_VERSION",
    "PAPER",
    "PRESETS",
    "QUICK",
    "SPEC",
    "SUITE",
    "TASKS",
    "NLIReport",
    "NLISuite",
    "NLITasks",
    "NLIUnavailable",
    "build",
    "export_adapters",
    "load_tasks",
    "main",
    "presets",
    "requires",
]

#: Bump when a change here changes what a merge job produces: invalidates the job caches.
CODE_VERSION = 1
SUITE = "nli"
#: The paper's six tasks (``nli_data.NAMES``).
TASKS = ("snli", "mnli", "sick", "qnli", "rte", "scitail")
_LAZY = ("QUICK", "PAPER", "PRESETS", "NLIReport")

# Built on first use (module ``__getattr__``), so that importing this module stays cheap:
#: The CI form (three tasks, ~100 pairs each, 2 epochs at batch 8, TA/TSV/TIES at R = 16).
QUICK: gr.Preset
#: The paper's setting: six tasks, full data, App. B's training, Table 2's grid, Table 3's Iso-C.
PAPER: gr.Preset
#: ``{"quick": QUICK, "paper": PAPER}``.
PRESETS: dict[str, gr.Preset]
#: The NLI suite's ``report.SuiteReport`` (:mod:`nli_report`'s, imported on first use).
NLIReport: type


class NLIUnavailable(InputError):
    """The NLI suite's model folder, data folder or readers are missing (the message says what
    to pass or install)."""


# -------------------------------------------------------------------------------------- presets


def presets() -> dict[str, gr.Preset]:
    """``{"quick": QUICK, "paper": PAPER}`` (built on first call)."""
    return dict(_presets())


_CACHE: dict[str, Any] = {}


def _presets() -> dict[str, gr.Preset]:
    if "presets" in _CACHE:
        return _CACHE["presets"]
    from ..data import nli_tasks as nt
    from ..harness import grid as gr
    from . import nli_head as nh

    paper = gr.Preset(
        name="paper",
        tasks=TASKS,
        seeds=(0,),
        train=nh.NLITrainConfig(),  # Appendix B's hyperparameter table
        grid=gr.GridConfig(
            rows=(
                gr.Row("ta", "full"),
                *(gr.Row(m, s) for s in ("full", "core", "knots") for m in ("tsv", "dare", "ties")),
                gr.Row("iso_c", "full", budgets=(16,)),  # the Iso-C table: Iso-C + TA ...
                gr.Row("iso_c_tsv", "full", budgets=(16,)),  # ... and Iso-C + TSV, at R = 16
            ),
            budgets=(64, 32, 16),
            full_capacity=False,
            weight_average=False,
        ),
        max_train=nt.ALL,
        n_val=nt.ALL,
        n_test=nt.ALL,
    )
    quick = gr.Preset(
        name="quick",
        tasks=("snli", "qnli", "scitail"),
        seeds=(0,),
        train=nh.NLITrainConfig(
            rows=8,
            row_len=64,
            learning_rate=2e-3,
            warmup_fraction=0.1,
            max_epochs=2,
            eval_every=6,
            patience=2,
            eval_tokens=1024,
        ),
        grid=gr.GridConfig(
            rows=(gr.Row("ta", "full"), gr.Row("tsv", "full"), gr.Row("ties", "full")),
            budgets=(16,),
            full_capacity=False,
            weight_average=False,
        ),
        max_train=96,
        n_val=24,
        n_test=48,
    )
    _CACHE["presets"] = {"quick": quick, "paper": paper}
    return _CACHE["presets"]


def __getattr__(name: str) -> Any:  # QUICK, PAPER, PRESETS and NLIReport, built on first use
    if name == "NLIReport":
        return _report_class()
    if name in _LAZY:
        p = _presets()
        return dict(p) if name == "PRESETS" else p[name.lower()]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------- suite


class NLITasks(NamedTuple):
    """What :meth:`NLISuite.load_tasks` returns: the tasks and the preset they were loaded with
    (``suites.SuiteWithData``)."""

    tasks: list[Any]
    preset: Any


def _compute_dtype(dtype: Any) -> Any:
    import jax
    import jax.numpy as jnp

    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return dtype


class NLISuite(ScoredSuite):
    """The decoder, its tokenizer and everything ``runner.run_experiment`` needs from the NLI
    suite (``suites.Suite``): :meth:`heads`, :meth:`eval_sets`, :meth:`train_tasks`,
    :meth:`evaluator`, :meth:`eval_key`, :meth:`timing`, :meth:`report`; and
    ``suites.SuiteWithData``'s :meth:`load_tasks`, which reads the tasks from the data folder.

    Args:
      model, tokenizer: the base decoder and its tokenizer (or ``model_dir``).
      model_dir: a Hugging Face ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` folder
        (``llama.from_pretrained``).
      data_dir: the NLI data folder (:mod:`nli_data`), for :meth:`load_tasks`.
      dtype: compute dtype: ``"auto"`` (bfloat16 on an accelerator, float32 on CPU) or a dtype.
      param_dtype: stored base weights (float32; ``jnp.bfloat16`` halves their memory).
      mesh: None (one device), or a one-axis mesh (``sharding.model_mesh``; ``netutility demo
        --model-devices``) to split the decoder's weights over, for a model that does not fit
        one accelerator: with ``model_dir`` each weight is placed as it is read
        (``llama.from_pretrained(mesh=...)``: no device holds the whole model), a ``model``
        given is placed by ``sharding.shard_model``, before the scorer and the trainer see it;
        the trainer places each task's LoRA, head and optimizer state by the same rule
        (``sharding.shard_state``; they are under ``min_bytes``, so replicated, at the paper's
        sizes). Results match one device's up to float32 rounding; the run records the mesh
        (``results.json``'s ``placement``).
      min_bytes: with ``mesh``: parameters smaller than this are replicated (None:
        ``sharding.MIN_BYTES``).

    Attributes:
      mesh, min_bytes: as given (``min_bytes`` resolved).
      placement: where ``shard_model`` put the model (a ``sharding.ShardSummary``), or None.
    """

    name = SUITE

    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        *,
        model_dir: str | os.PathLike | None = None,
        data_dir: str | os.PathLike | None = None,
        dtype: Any = "auto",
        param_dtype: Any = None,
        mesh: Any = None,
        min_bytes: int | None = None,
    ):
        import jax.numpy as jnp

        from ..models import llama, sharding
        from . import nli_head as nh

        if (model is None) != (tokenizer is None):
            raise InputError("NLISuite: pass both model and tokenizer, or neither.")
        min_bytes = sharding.MIN_BYTES if min_bytes is None else min_bytes
        if mesh is not None:  # checked before the (long) load
            sharding.placer(mesh, min_bytes=min_bytes, fn="NLISuite")
        if model is None:
            if model_dir is None:
                raise NLIUnavailable(
                    "NLISuite: pass model and tokenizer, or model_dir (--model-dir): a Hugging "
                    "Face Qwen3 / Llama folder such as Qwen/Qwen3-4B-Instruct-2507."
                )
            model, tokenizer, _ = llama.from_pretrained(
                model_dir,
                dtype=_compute_dtype(dtype),
                param_dtype=jnp.float32 if param_dtype is None else param_dtype,
                mesh=mesh,
                min_bytes=min_bytes,
            )
        elif dtype != "auto":
            model = llama.with_dtype(model, dtype)
        self.mesh, self.placement, self.min_bytes = mesh, None, min_bytes
        if mesh is not None:  # (a folder's weights are in place already: this summarises where)
            model, self.placement = sharding.shard_model(model, mesh, min_bytes=min_bytes)
        self.model, self.tokenizer = model, tokenizer
        self.model_dir = None if model_dir is None else pathlib.Path(model_dir)
        self.data_dir = None if data_dir is None else pathlib.Path(data_dir)
        self.scorer = nh.Scorer(model)
        self._weights: str | None = None

    def fingerprint(self) -> str:
        """The model's fingerprint (``lang_eval.model_fingerprint``)."""
        from . import lang_eval as le

        return le.model_fingerprint(self.model)

    @property
    def dtype(self) -> str:
        import numpy as np

        return np.dtype(self.model.dtype).name

    @property
    def model_devices(self) -> int:
        """The devices the model's weights are split over (1 without a mesh)."""
        return 1 if self.mesh is None else int(self.mesh.size)

    @property
    def description(self) -> str:
        c = self.model.config
        where = f" from {self.model_dir}" if self.model_dir is not None else ""
        split = f", on a {self.model_devices}-device mesh" * (self.model_devices > 1)
        return (
            f"a {c.num_layers}-layer {c.model_type} decoder{where} (hidden {c.hidden_size}, "
            f"{c.num_heads}/{c.num_kv_heads} query/key-value heads, vocabulary {c.vocab_size}, "
            f"{self.dtype} compute{split})"
        )

    def load_tasks(self, preset: Any, names: Sequence[str] | None = None) -> NLITasks:
        """The preset's tasks (or ``names``) from :attr:`data_dir`, with its sizes
        (:func:`load_tasks`), and the preset unchanged (``suites.SuiteWithData``).

        Returns:
          :class:`NLITasks`.
        """
        if self.data_dir is None:
            raise NLIUnavailable("NLISuite.load_tasks: the suite was built without data_dir.")
        names = preset.tasks if names is None else names
        return NLITasks(load_tasks(names, preset, data_dir=self.data_dir), preset)

    def heads(self, tasks: Sequence[Any]) -> list[nh.HeadSpec]:
        """One ``nli_head.HeadSpec`` per task (its classes; a binary task's unused one masked)."""
        from . import nli_head as nh

        return [nh.head_spec(t) for t in tasks]

    def eval_sets(self, tasks: Sequence[Any], heads: Sequence[Any], config: Any) -> tuple[Any, Any]:
        """The validation and test pairs (at most ``config.row_len`` tokens each)."""
        from . import nli_head as nh

        kw = {"max_len": config.row_len, "eval_tokens": config.eval_tokens}
        val = nh.make_set(self.tokenizer, heads, [t.val for t in tasks], **kw)
        return val, nh.make_set(self.tokenizer, heads, [t.test for t in tasks], **kw)

    def train_tasks(
        self,
        tasks: Sequence[Any],
        heads: Sequence[Any],
        config: Any,
        *,
        cache_dir: str | os.PathLike,
        progress: bool = True,
        log: Callable[[str], None] | None = None,
    ) -> list[Any]:
        """Train (or load from ``cache_dir``) every task's LoRA and head
        (``nli_head.train_tasks``)."""
        from ..models import sharding
        from . import nli_head as nh

        mesh, min_bytes = self.mesh, self.min_bytes
        place = None if mesh is None else (
            lambda tree: sharding.shard_state(tree, mesh, min_bytes=min_bytes)[0]
        )  # fmt: skip
        return nh.train_tasks(
            tasks, heads, config, model=self.model, tokenizer=self.tokenizer,
            weights=self.weights, cache_dir=cache_dir, scorer=self.scorer, progress=progress,
            log=log, place=place,
        )  # fmt: skip

    def evaluator(
        self, trained: Sequence[Any], heads: Sequence[Any], val: Any, test: Any, *, cache_dir: Any
    ) -> Any:
        """Single-LoRA and zero-shot accuracies (cached), and the merge evaluator, each task
        read by its own trained head."""
        from . import nli_head as nh

        adapters, scores = [t.adapter for t in trained], [t.score for t in trained]
        kw = self.cache_args(trained, cache_dir)
        return nh.Evaluator(self.scorer, adapters, scores, val, test, **kw)

    def eval_key(self, config: Any) -> dict[str, Any]:
        """The evaluation settings that determine a merge's result (for the job cache key)."""
        from ..models import sharding
        from . import nli_head as nh

        # a split model sums in another order (float32 rounding): its own key; one device's
        # keys are unchanged
        split = sharding.split_key(self.model_devices, self.min_bytes)
        return {
            **self.key_start([nh.CODE_VERSION, CODE_VERSION]),
            "dtype": self.dtype,
            "row_len": config.row_len,
            "eval_tokens": config.eval_tokens,
            "mask_logit": nh.MASK_LOGIT,
            **split,
        }

    def report(self, run: Any) -> Any:
        """The NLI suite's report wording (:data:`NLIReport`, a ``report.SuiteReport``)."""
        from ..models import sharding

        record = sharding.placement_record(self.placement, self.min_bytes)
        return _report_class()(self.description, run, record)


def _report_class() -> type:
    from .nli_report import NLIReport

    return NLIReport


# --------------------------------------------------------------------------- declaration (suites)


def build(
    *,
    model_dir: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
    model_devices: int | None = None,
    min_bytes: int | None = None,
) -> NLISuite:
    """The suite for ``--model-dir`` / ``--data-dir`` / ``--model-devices`` / ``--min-bytes``
    (``SuiteSpec.build``): loads the model, split over the first ``model_devices`` local devices
    (``sharding.model_mesh``) when given, weights under ``min_bytes`` replicated."""
    from ..models import sharding

    mesh = None if model_devices is None else sharding.model_mesh(model_devices)
    return NLISuite(model_dir=model_dir, data_dir=data_dir, mesh=mesh, min_bytes=min_bytes)


def requires(
    *,
    model_dir: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
    model_devices: int | None = None,
    min_bytes: int | None = None,
) -> None:
    """Fail before any work (``SuiteSpec.requires``) without a usable model folder, data folder or
    reader.

    Raises:
      NLIUnavailable: a flag not given, a folder missing its files (named), ``tokenizers`` or
        ``safetensors`` not installed, or parquet data without pyarrow.
    """
    usage = (
        "the nli suite needs --model-dir FOLDER (a Hugging Face Qwen3 or Llama folder with "
        "config.json, *.safetensors and tokenizer.json; the paper's is Qwen3-4B-Instruct) and "
        "--data-dir DATA (one folder per dataset: " + ", ".join(TASKS) + ")"
    )
    if model_dir is None or data_dir is None:
        missing = [
            f for f, v in (("--model-dir", model_dir), ("--data-dir", data_dir)) if v is None
        ]
        raise NLIUnavailable(f"{usage}; {' and '.join(missing)} not given.")
    require_modules(
        [("tokenizers", "tokenizers"), ("safetensors", "safetensors"), ("tqdm", "tqdm")],
        lambda mod, pip: NLIUnavailable(
            f"the nli suite needs {mod}; install it with: pip install {pip}"
        ),
    )
    m = pathlib.Path(model_dir)
    if not m.is_dir():
        raise NLIUnavailable(f"--model-dir {m} is not a folder; {usage}.")
    lacks = [f for f in ("config.json", "tokenizer.json") if not (m / f).is_file()]
    if not any(m.glob("*.safetensors")):
        lacks.append("*.safetensors")
    if lacks:
        raise NLIUnavailable(f"--model-dir {m} has no {', '.join(lacks)}; {usage}.")
    from ..data import nli_data as nd

    d = pathlib.Path(data_dir)
    if not d.is_dir():
        raise NLIUnavailable(f"--data-dir {d} is not a folder; {usage}.")
    present = [n for n in nd.NAMES if (d / n).is_dir()]
    if not present:
        raise NLIUnavailable(f"--data-dir {d} holds none of the folders {', '.join(TASKS)}.")
    try:
        nd.check_data(d, present)
    except (MissingFileError, nd.NLIDataError) as e:
        raise NLIUnavailable(str(e)) from None


def load_tasks(
    names: Sequence[str],
    preset: Any,
    *,
    data_dir: str | os.PathLike | None = None,
    **_: Any,
) -> list[Any]:
    """The NLI tasks ``names`` from ``data_dir`` (``nli_tasks.load_tasks``, split seed
    ``runner.SPLIT_SEED``, the preset's ``max_train``, ``n_val``, ``n_test``; 0: all).

    Raises:
      NLIUnavailable: no ``data_dir``; an unknown task name.
      MissingFileError, nli_data.NLIDataError: a missing or unreadable file (named).
    """
    from ..data import nli_data as nd
    from ..data import nli_tasks as nt

    if data_dir is None:
        raise NLIUnavailable("the nli suite reads its tasks from --data-dir DATA; none given.")
    unknown = [n for n in names if n not in nd.DATASETS]
    if unknown:
        raise NLIUnavailable(
            f"the nli suite has no task {unknown[0]!r}; its tasks are {', '.join(TASKS)}."
        )
    return nt.load_tasks(
        data_dir, list(names), seed=nt.SPLIT_SEED, max_train=preset.max_train,
        n_val=preset.n_val, n_test=preset.n_test,
    )  # fmt: skip


# --------------------------------------------------------------------------------------- export


def export_adapters(
    run_: Any, out: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, **config: Any
) -> list[pathlib.Path]:
    """Write every trained adapter of a run, with its head, as a PEFT folder
    ``<out>/seed<S>/<task>`` (``nli_head.export_peft``), read back from the cache the run used.

    Raises:
      InputError: an adapter is no longer in the cache.
    """
    from . import nli_head as nh

    return nh.export_run("nli.export_adapters", SUITE, run_, out, cache_dir=cache_dir, **config)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m netutility_jax.experiments.suites.nli --write-toy DIR``: write
    :func:`nli_toy.write_toy`'s setup (for ``netutility demo --suite nli --quick --model-dir
    DIR/model --data-dir DIR/data``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m netutility_jax.experiments.suites.nli")
    parser.add_argument("--write-toy", metavar="DIR", required=True, help="folder to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from .nli_toy import write_toy

    model, data = write_toy(args.write_toy, seed=args.seed)
    print(f"--model-dir {model} --data-dir {data}")
    return 0


# ---------------------------------------------------------------------------------- declaration

#: The suite, registered (``netutility demo --suite nli``): its callables import the model
#: code when they run, so that importing this module stays cheap.
SPEC = suites.register(
    suites.SuiteSpec(
        name=SUITE,
        summary="Qwen3 / Llama decoder (--model-dir) with a 3-way classification head per task "
        "on SNLI, MNLI, SICK, QNLI, RTE, SciTail (--data-dir): the paper's language setting",
        presets=presets,
        build=build,
        requires=requires,
        grids=("paper",),
        cost="paper: days on one GPU for Qwen3-4B (full data, batch 1); --quick: a minute on a "
        "tiny model",
        flags=("model_dir", "data_dir", "model_devices", "min_bytes"),
    ),
    builtin=True,
)

if __name__ == "__main__":
    sys.exit(main())
