"""Experiment suites as declarations: what a suite must provide, and the registry of suites.

A **suite** is a model with its task heads, training and evaluation (the encoder suite: MiniLM
with frozen zero-shot heads; the language suite: a Llama-family decoder scoring label words).
:class:`Suite` is the interface ``runner.run_experiment`` drives; :class:`SuiteSpec` declares a
suite to the command line: its presets, how to build it, what it needs installed. ``netutility
demo --suite NAME`` derives its choices, presets, up-front checks and report from the spec, as
``nu.merge`` derives its methods from ``registry.METHODS``; nothing lists suites twice.

A suite of your own::

    from netutility_jax.experiments.harness import suites

    suites.register(suites.SuiteSpec(
        name="mine",
        summary="my model with my heads",
        presets=lambda: {"quick": MY_QUICK, "full": MY_FULL},
        build=MySuite,
        requires=lambda: None,
    ))
    # netutility demo --suite mine --quick

**Flags.** A suite that reads its model, data or adapters from the user's folders declares which
of ``--model-dir``, ``--data-dir`` and ``--adapters`` it accepts (:attr:`SuiteSpec.flags`:
:data:`FLAGS`). ``netutility demo`` refuses any other, checks that every folder given exists
before any work, and calls ``spec.requires(**given)`` and ``spec.build(**given)`` with the flags
given only (``model_dir=``, ``data_dir=``: the folders as strings; ``adapters=``: a tuple of
:class:`AdapterArg`, ``--adapters NAME=DIR,DIR,...`` parsed by :func:`parse_adapters`;
``model_devices=``: ``--model-devices {all,N}`` as the number of local devices to split the
model's weights over, checked against the devices present: a suite that takes it builds
``sharding.model_mesh(model_devices)``; ``min_bytes=``: ``--min-bytes N``, with
``--model-devices`` only, the size under which a weight is replicated instead of split, the
suite's ``min_bytes=``). A suite
that accepts ``data_dir`` reads its own tasks: its suite object also has ``load_tasks(preset) ->
(tasks, preset)`` (:class:`SuiteWithData`), which ``netutility demo`` calls in place of the
built-in text tasks (``--task``, ``--tasks`` are refused for it), and a suite that accepts
``adapters`` trains nothing (``--init`` is refused for it).

Part of the harness: a suite module imports the harness, never the reverse, and the harness
looks a suite up here by name (:func:`get`), never importing one. Each suite registers itself
in one declaration at the end of its module (``encoder.SPEC = suites.register(...)``, as each
merge method is one ``registry.register``); the command (``netutility demo``) imports the
built-in suites' modules (``netutility_jax.experiments.suites.encoder``, ``language``,
``language_head``, ``vision``, ``nli``), which registers them, in that order.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from ...errors import InputError, NetUtilityError

__all__ = [
    "DEFAULT",
    "FLAGS",
    "SUITES",
    "AdapterArg",
    "ScoredSuite",
    "Suite",
    "SuiteSpec",
    "SuiteUnavailable",
    "SuiteWithData",
    "get",
    "parse_adapters",
    "register",
    "require_modules",
    "unregister",
]

#: The flags a suite may accept (``SuiteSpec.flags``), as keyword names of ``build`` and
#: ``requires``; on the command line ``--model-dir``, ``--data-dir``, ``--adapters``,
#: ``--model-devices``.
FLAGS = ("model_dir", "data_dir", "adapters", "model_devices", "min_bytes")

#: The suite ``netutility demo`` and ``runner.run_experiment`` use unless told otherwise.
DEFAULT = "encoder"


class SuiteUnavailable(NetUtilityError):
    """A suite's weights or readers are not installed; the message says how to install them."""


@runtime_checkable
class Suite(Protocol):
    """What ``runner.run_experiment`` needs from a model (``encoder.EncoderSuite``,
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
        """The evaluator of single, zero-shot and merged models (``encoder_eval.Evaluator``'s
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


@runtime_checkable
class SuiteWithData(Suite, Protocol):
    """A suite that reads its own tasks (it accepts ``data_dir``; the vision suite)."""

    def load_tasks(self, preset: Any) -> tuple[Sequence[Any], Any]:
        """``(tasks, preset)``: the tasks, split and sized by ``preset`` (``n_val``,
        ``n_test``), and the preset adjusted to what was loaded (e.g. the given adapters' LoRA
        rank); a NamedTuple such as ``vision.VisionTasks``."""
        ...


@runtime_checkable
class SuiteWithMoments(Suite, Protocol):
    """A suite that can estimate each task's input second moments (``encoder.EncoderSuite``):
    what the grid's data-aware control (``grid.VARIANTS["net_utility_data"]``) needs."""

    def input_moments(self, tasks: Sequence[Any]) -> list[dict[str, Any]]:
        """One ``{module name: nu.InputMoments}`` per task (``nu.input_moments``): the inputs
        of every LoRA target under the base model (no LoRA) on a few hundred of the task's
        unlabelled training texts, padding dropped."""
        ...

    def moments_key(self) -> dict[str, Any]:
        """What determines :meth:`input_moments` besides the tasks' training texts (part of
        the data-aware jobs' cache keys only)."""
        ...


class ScoredSuite:
    """The plumbing of a suite that evaluates with a scorer of its own model (the language and
    NLI suites): the model's fingerprint, computed once by :meth:`fingerprint` (``weights``, part
    of every cache key), the scorer's counters as the suite's :meth:`timing`, and what its
    evaluator and job key start with.

    Attributes:
      name: the suite's name.
      model: the model :meth:`fingerprint` reads.
      scorer: what evaluates the model; its ``timing()`` is the suite's.
    """

    name: str
    model: Any
    scorer: Any
    _weights: str | None = None

    def fingerprint(self) -> str:
        """The model's fingerprint (a subclass's: e.g. ``lang_eval.model_fingerprint``)."""
        raise NotImplementedError

    @property
    def weights(self) -> str:
        """The model's fingerprint (computed once; part of every cache key)."""
        if self._weights is None:
            self._weights = self.fingerprint()
        return self._weights

    def timing(self) -> dict[str, Any]:
        """The scorer's work so far (passes, tokens, seconds, tokens/s)."""
        return self.scorer.timing()

    def cache_args(self, trained: Sequence[Any], cache_dir: Any) -> dict[str, Any]:
        """The evaluator's cache keywords: ``cache_dir``, the trained tasks' ``adapter_keys``
        and ``weights``."""
        keys = [t.info["cache_key"] for t in trained]
        return {"cache_dir": cache_dir, "adapter_keys": keys, "weights": self.weights}

    def key_start(self, code_version: Any) -> dict[str, Any]:
        """The first entries of :meth:`eval_key`: the suite, its code version and ``weights``."""
        return {"suite": self.name, "code_version": code_version, "weights": self.weights}


def require_modules(
    modules: Sequence[tuple[str, str]], error: Callable[[str, str], Exception]
) -> None:
    """Import each of ``modules`` (``(module, pip package)`` pairs) in turn; raise
    ``error(module, package)`` for the first that is not installed (a suite's ``requires``).
    """
    for mod, pip in modules:
        try:
            __import__(mod)
        except ImportError:
            raise error(mod, pip) from None


class AdapterArg(NamedTuple):
    """One item of ``--adapters``: ``NAME=DIR`` (``name`` set) or ``DIR`` (``name`` None)."""

    name: str | None
    path: str


def parse_adapters(text: str) -> tuple[AdapterArg, ...]:
    """The items of ``--adapters A,B`` or ``--adapters dtd=A,eurosat=B`` (a name is letters,
    digits, ``_``, ``-``, ``.`` before the first ``=``; anything else is a folder).

    Raises:
      InputError: an empty item, or an empty name or folder.

    Example:
      >>> parse_adapters("dtd=/a/dtd, /b/KnOTS_mnist")
      (AdapterArg(name='dtd', path='/a/dtd'), AdapterArg(name=None, path='/b/KnOTS_mnist'))
    """
    out = []
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            raise InputError(f"--adapters {text!r}: an empty item; expected DIR or NAME=DIR, ...")
        name, sep, path = item.partition("=")
        if sep and re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            if not path.strip():
                raise InputError(f"--adapters: {item!r} names no folder; expected NAME=DIR")
            out.append(AdapterArg(name, path.strip()))
        elif sep and not name:
            raise InputError(f"--adapters: {item!r} has no name before '='; expected NAME=DIR")
        else:
            out.append(AdapterArg(None, item))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class SuiteSpec:
    """A suite, declared once for the command line and the harness.

    Attributes:
      name: ``--suite NAME``.
      summary: one line for ``--help``: the model and how the tasks are answered.
      presets: returns ``{name: grid.Preset}``; it holds ``"quick"`` and every name in ``grids``.
      build: returns the :class:`Suite` (loads the model: called after every up-front check),
        called with the :attr:`flags` given as keywords (``build(model_dir="...")``).
      requires: raises :class:`SuiteUnavailable` (with the install command) when the suite's
        weights or readers are missing; called before any work, with the flags given.
      grids: the presets ``--grid`` may name (the first is the default); ``--quick`` picks
        ``"quick"``.
      cost: what a full run costs, for ``--help``.
      flags: which of :data:`FLAGS` (``--model-dir``, ``--data-dir``, ``--adapters``,
        ``--model-devices``) the suite accepts; ``netutility demo`` refuses the others.
    """

    name: str
    summary: str
    presets: Callable[[], Mapping[str, Any]]
    build: Callable[..., Suite]
    requires: Callable[..., None]
    grids: tuple[str, ...] = ("full",)
    cost: str = ""
    flags: tuple[str, ...] = ()

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
        if not isinstance(self.flags, tuple) or any(f not in FLAGS for f in self.flags):
            raise InputError(
                f"SuiteSpec {self.name!r}: flags={self.flags!r}; expected a tuple of names among "
                f"{FLAGS}."
            )

    def preset(self, grid: str | None, *, quick: bool) -> Any:
        """The preset ``--quick`` / ``--grid GRID`` selects (``grid`` None: the default).

        Raises:
          InputError: ``grid`` is not one of this suite's, or the preset is missing.
        """
        if grid is not None and grid not in self.grids:
            owners = [s.name for s in SUITES.values() if grid in s.grids]
            names = (
                f"{', '.join(owners[:-1])} and {owners[-1]}" if len(owners) > 1 else "".join(owners)
            )
            where = (
                f"is for the {names} suite{'s' if len(owners) > 1 else ''}"
                if owners
                else "is not a grid"
            )
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


#: The registered suites, by name, in registration order.
SUITES: dict[str, SuiteSpec] = {}
#: The names registered as built-in (``register(..., builtin=True)``): they cannot be removed.
_BUILTIN: set[str] = set()


def register(spec: SuiteSpec, *, replace: bool = False, builtin: bool = False) -> SuiteSpec:
    """Add ``spec`` to :data:`SUITES` (``replace``: allow a name that is taken; ``builtin``: a
    suite of this package, which :func:`unregister` refuses to remove). Returns ``spec``.

    Raises:
      InputError: not a :class:`SuiteSpec`, or its name is taken (and not ``replace``).
    """
    if not isinstance(spec, SuiteSpec):
        raise InputError(f"register: expected a SuiteSpec, got {type(spec).__name__}.")
    if spec.name in SUITES and not replace:
        raise InputError(
            f"register: suite {spec.name!r} is registered already; pass replace=True to replace it."
        )
    SUITES[spec.name] = spec
    if builtin:
        _BUILTIN.add(spec.name)
    return spec


def unregister(name: str) -> None:
    """Remove suite ``name`` (e.g. a test's toy suite); the built-in suites cannot be removed."""
    if name in _BUILTIN:
        raise InputError(f"unregister: {name!r} is a built-in suite.")
    SUITES.pop(name, None)


def get(name: str) -> SuiteSpec:
    """The spec of suite ``name``.

    Raises:
      InputError: no such suite (the message lists the registered ones, and where the built-in
        ones come from).
    """
    try:
        return SUITES[name]
    except KeyError:
        raise InputError(
            f"unknown suite {name!r}; registered suites: {', '.join(SUITES) or 'none'} (a suite "
            "registers when its module is imported: the built-in ones are "
            "netutility_jax.experiments.suites.<name>, which netutility demo imports)"
        ) from None
