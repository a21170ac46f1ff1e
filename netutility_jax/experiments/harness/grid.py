"""What an experiment merges: methods, the grid of merges, the allocation variants, presets.

A **row** of the main table is a merge method in a space (the paper's Table 2 rows); every row is
merged at every budget ``R`` with the uniform allocation (the paper's baseline) and with Net
Utility. The **controls** show what the budget does: every direction (no budget), a random
allocation that keeps as many directions per module as Net Utility but picks them at random,
the zero-shot model and the weight average (TA with coefficient ``1 / M``, every direction).

Merges that the library documents as identical (``registry.MethodSpec.same_spaces``) are run
once and reported for every space they stand for (TA in every space; TSV, Iso-C and Iso-C + TSV
in full and Core space). Labels and identical spaces come from the library's method registry
(:mod:`netutility_jax.registry`); what is the experiment's own is here: the option values, the
coefficients the searches start from, and the "Iso-C + TSV" row.

Part of the harness: no model or suite is imported here. A :class:`Preset` is a suite's; the
encoder's (``QUICK``, ``FULL``, ``PAPER``, ``MECHANISM``, ``PRESETS``, ``DEFAULT_TASKS``) live in
:mod:`netutility_jax.experiments.suites.encoder`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ... import registry
from ...errors import InputError
from . import allocations as al

if TYPE_CHECKING:
    from .fitting import TrainConfigBase

__all__ = [
    "ALLOCATIONS",
    "METHODS",
    "PAPER_SEARCH",
    "SPACE_LABELS",
    "VARIANTS",
    "AllocationSpec",
    "GridConfig",
    "Job",
    "MethodSpec",
    "Preset",
    "Row",
    "grid_jobs",
]


SPACE_LABELS = {name: space.label for name, space in registry.SPACES.items()}
#: The two allocations of the main table (the paper's baseline and Net Utility); every other
#: variant of :data:`VARIANTS` is a control.
ALLOCATIONS = ("uniform", "net_utility")


@dataclasses.dataclass(frozen=True)
class AllocationSpec:
    """How a job chooses the directions it keeps: the main table's two allocations and the
    controls, declared once; the runner merges a job from its spec, the report labels it.

    Attributes:
      name: the job key's last part (``ta/full/R16/<name>``).
      label: the name in the report.
      library: ``nu.merge_adapters``' ``allocation`` (``"uniform"``, ``"net_utility"``,
        ``"all"``), or None for a control that builds masks (``masks``) or the weight average.
      lam_scale: with ``library="net_utility"``: lambda is ``lam_scale`` times the median rule's
        (0: energy only, the interference term off); None: the median rule itself.
      masks: a control's masks from Net Utility's own (same scope and budget), the scores and a
        seed: ``masks(reference, scores, seed=(...)) -> {name: bool (M, r_max)}``.
      draws: the control is random (its jobs are ``<name>1``, ``<name>2``, ...).
      budget: the job has a budget (``all`` and the weight average do not).
      what: one sentence for the report: what the control isolates.
      alpha: with ``library="net_utility"``: the scoring geometry of this control (0: row
        space, the paper's vision setting; 1: Gram), whatever the run's ``alpha``; None: the
        run's.
      choose_from: a control that merges nothing: per seed and budget, the one of these
        variants (run in the same grid, beside the same row) with the best validation score,
        its test result taken as is (``lam_val``: lambda chosen on validation).
      data: with ``library="net_utility"``: score with the tasks' input second moments
        (``nu.merge_adapters(..., input_moments=...)``, the suite's ``input_moments``: each
        task's LoRA-target inputs under the base model on its training texts), the data-aware
        geometry of docs/input_moments.md (this project's, not the paper's).
      interference: with ``library="net_utility"``: the scores' interference term
        (``nu.merge_adapters(..., interference=...)``): ``"overlap"``, the paper's, or
        ``"signed"``, this project's sign-aware one (docs/math.md 5b).
    """

    name: str
    label: str
    library: str | None = None
    lam_scale: float | None = None
    masks: Any = None
    draws: bool = False
    budget: bool = True
    what: str = ""
    alpha: float | None = None
    choose_from: tuple[str, ...] = ()
    data: bool = False
    interference: str = "overlap"


def _variants(*specs: AllocationSpec) -> dict[str, AllocationSpec]:
    return {s.name: s for s in specs}


#: Every allocation a grid job can use, by name.
VARIANTS: dict[str, AllocationSpec] = _variants(
    AllocationSpec("uniform", "Uniform", "uniform", what="the paper's baseline"),
    AllocationSpec("net_utility", "Net Utility", "net_utility", what="the paper's method"),
    AllocationSpec("all", "No budget", "all", budget=False, what="every direction"),
    AllocationSpec("average", "Weight average", budget=False, what="TA over every direction, 1/M"),
    AllocationSpec(
        "random",
        "Random (same count per module as Ours)",
        masks=al.random_allocation,
        draws=True,
        what="Net Utility's count per module, drawn over all candidates, tail directions included",
    ),
    AllocationSpec(
        "random_split",
        "Random split (each task's top directions)",
        masks=al.random_split_allocation,
        draws=True,
        what="Net Utility's count per module split among the tasks at random, each task "
        "keeping its top directions: what the choice of tasks adds beyond keeping top ones",
    ),
    AllocationSpec(
        "energy",
        "Energy only (lambda = 0)",
        "net_utility",
        lam_scale=0.0,
        what="the same global top-K without the interference term",
    ),
    *(
        AllocationSpec(
            f"lam_x{k:g}",
            f"lambda x {k:g}",
            "net_utility",
            lam_scale=k,
            what=f"the median rule's lambda times {k:g}",
        )
        for k in (0.25, 0.5, 2.0)
    ),
    *(
        AllocationSpec(
            f"alpha_{a}",
            f"alpha = {a} ({'row space' if a == 0 else 'Gram'})",
            "net_utility",
            alpha=float(a),
            what=f"Net Utility scored with alpha = {a} "
            + ("(row space, the paper's vision setting)" if a == 0 else "(Gram, its NLI setting)")
            + " instead of the heterogeneity rule",
        )
        for a in (0, 1)
    ),
    AllocationSpec(
        "net_utility_data",
        "Net Utility, data-aware (ours)",
        "net_utility",
        data=True,
        what="Net Utility with each task's input second moments as its geometry G_i (a few "
        "hundred unlabelled training texts through the base model; this project's answer to "
        "the paper's stated limitation, not the paper's method), the same global top-K",
    ),
    AllocationSpec(
        "signed",
        "Net Utility, sign-aware (ours)",
        "net_utility",
        interference="signed",
        what="Net Utility with the sign-aware interference term (only conflicting pairs of "
        "components count; this project's extension, docs/math.md 5b), the same global top-K",
    ),
    AllocationSpec(
        "lam_val",
        "lambda chosen on validation",
        choose_from=("energy", "lam_x0.25", "lam_x0.5", "net_utility", "lam_x2"),
        what="per seed and budget, the lambda of {0, 1/4, 1/2, 1, 2} x the median rule whose "
        "merge scores best on validation (no extra merges: the lambda controls' own jobs)",
    ),
)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A merge method of the grid.

    Attributes:
      label: name in the tables.
      method: ``nu.merge`` method.
      options: method options (``density``, ``p``, ``isotropize``).
      start: the first merge coefficient the validation search tries (see
        :func:`evaluate.select_coef`); later merges of the same method and space in a seed start
        from the coefficient chosen last.
      same_spaces: groups of spaces in which the method gives identical results.
    """

    label: str
    method: str
    options: tuple[tuple[str, Any], ...] = ()
    start: float = 1.0
    same_spaces: tuple[tuple[str, ...], ...] = (("full",), ("core",), ("knots",))

    def canonical_space(self, space: str, spaces: tuple[str, ...] | None = None) -> str:
        """The space in which a merge standing for ``space`` is run (the first of its group in
        ``spaces``, if given)."""
        for group in self.same_spaces:
            if space in group:
                if spaces is not None:
                    return next((s for s in group if s in spaces), space)
                return group[0]
        return space


def _method(
    method: str, options: tuple[tuple[str, Any], ...] = (), *, start: float = 1.0, label: str = ""
) -> MethodSpec:
    """The grid's entry for ``nu.merge`` method ``method``: its label (unless ``label``) and
    identical spaces from the library's registry, with the grid's options and start."""
    spec = registry.METHODS[method]
    return MethodSpec(label or spec.label, method, options, start, spec.same_spaces)


#: The grid's methods. TA and DARE sum 7 task updates (DARE after a random drop with rescaling),
#: so their search starts at 0.3; the others renormalize or average (start at 1). DARE: drop
#: rate p = 0.5 (LoRA updates are low rank and dense; the p = 0.9 used on full fine-tunes wipes
#: them out), a key from the seed. TIES: density 0.2 (the TIES paper's top 20%, the library
#: default). Iso-C + TSV: TSV with its spectrum flattened. Allocation scope is the paper's
#: (``registry.MethodSpec.budget_scope``): local (per module) for TIES and DARE, global
#: otherwise.
METHODS: dict[str, MethodSpec] = {
    "ta": _method("ta", start=0.3),
    "tsv": _method("tsv"),
    "ties": _method("ties", (("density", 0.2),)),
    "dare": _method("dare", (("p", 0.5),), start=0.3),
    "iso_c": _method("iso_c"),
    "iso_c_tsv": _method("tsv", (("isotropize", True),), label="Iso-C + TSV"),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """A row of the main table: ``method`` (a key of :data:`METHODS`) in ``space``.

    ``budgets``: the budgets this row is merged at (None: all of the grid's).
    """

    method: str
    space: str
    budgets: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """What is merged, per training seed.

    Attributes:
      rows: the main table (uniform and Net Utility at each budget).
      budgets: budgets R (average directions per module), the table's column groups.
      no_budget: ``(method, space)`` pairs also merged with every direction.
      random: ``(method, space)`` pairs with the random-allocation control at every budget.
      random_draws: random draws per seed and budget (the draws differ between seeds).
      controls: ``(method, space, variant)``: a control of :data:`VARIANTS` (``energy``,
        ``lam_x0.25``, ``random_split``, ...) merged at every budget beside that row.
      full_capacity: also merge TA with Net Utility at ``R = M r`` (budget-spent analysis; the
        uniform allocation there keeps everything, i.e. the no-budget TA).
      weight_average: also evaluate the weight average (TA, coefficient ``1 / M``, no search).
      search: ``(method, option, candidates)``: that option of the grid method (a key of
        :data:`METHODS`) is chosen per merge on validation, jointly with the coefficient, among
        ``candidates`` (TIES's ``density``, DARE's ``p``: the paper's searched pruning rate);
        the method's fixed value in :data:`METHODS` is then unused. The candidates are this
        project's choice.
    """

    rows: tuple[Row, ...]
    budgets: tuple[int, ...]
    no_budget: tuple[tuple[str, str], ...] = ()
    random: tuple[tuple[str, str], ...] = ()
    random_draws: int = 1
    controls: tuple[tuple[str, str, str], ...] = ()
    full_capacity: bool = True
    weight_average: bool = True
    search: tuple[tuple[str, str, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:
        seen = set()
        for entry in self.search:
            if not (isinstance(entry, tuple) and len(entry) == 3):
                raise InputError(
                    f"GridConfig: search entry {entry!r}; expected (method, option, candidates)."
                )
            method, option, cands = entry
            if method not in METHODS:
                raise InputError(
                    f"GridConfig: search entry {entry!r}: unknown method {method!r}; expected "
                    f"one of {sorted(METHODS)}."
                )
            if method in seen:
                raise InputError(f"GridConfig: method {method!r} is searched twice.")
            seen.add(method)
            opts = {o.name: o for o in registry.METHODS[METHODS[method].method].options}
            if option not in opts:
                raise InputError(
                    f"GridConfig: search entry {entry!r}: {option!r} is not an option of "
                    f"{METHODS[method].method!r} (options {sorted(opts)})."
                )
            if not (isinstance(cands, tuple) and cands and len(set(cands)) == len(cands)):
                raise InputError(
                    f"GridConfig: search entry {entry!r}: candidates must be a non-empty tuple "
                    "of distinct values."
                )
            for v in cands:
                try:
                    opts[option].check("GridConfig.search", v, name=option)
                except (InputError, TypeError) as e:
                    raise InputError(f"GridConfig: search entry {entry!r}: {e}") from None

    @property
    def spaces(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.space for r in self.rows))

    def searched(self, method: str) -> tuple[str, tuple[float, ...]] | None:
        """``(option, candidates)`` searched on validation for grid method ``method``, or None."""
        return next(((o, c) for m, o, c in self.search if m == method), None)


@dataclasses.dataclass(frozen=True)
class Job:
    """One distinct merge.

    Attributes:
      key: ``"ta/full/R16/net_utility"``, ``"ta/full/R16/random1"``, ``"ta/full/all"``,
        ``"average"``.
      method, space: what :func:`nu.merge` runs.
      spaces: the table spaces it stands for.
      budget: R (None for ``all`` and ``average``).
      allocation: a name of :data:`VARIANTS` (``uniform``, ``net_utility``, ``random``,
        ``all``, ``average``, ``energy``, ...).
      draw: the random draw (random controls only).
      ref: the Net Utility job whose per-module counts a mask control copies.
    """

    key: str
    method: str
    space: str
    spaces: tuple[str, ...]
    budget: int | None
    allocation: str
    draw: int = 0
    ref: str | None = None


def grid_jobs(grid: GridConfig, *, full_capacity: int) -> list[Job]:
    """The distinct merges of ``grid``, in run order (a random control after its reference).

    Args:
      grid: the grid.
      full_capacity: ``M r``, the budget of the full-capacity TA merge.
    """
    jobs: dict[str, Job] = {}

    def add(job: Job) -> None:
        if job.key in jobs:
            old = jobs[job.key]
            spaces = tuple(dict.fromkeys((*old.spaces, *job.spaces)))
            jobs[job.key] = dataclasses.replace(old, spaces=spaces)
        else:
            jobs[job.key] = job

    space_order = grid.spaces
    for row in grid.rows:
        spec = METHODS[row.method]
        canon = spec.canonical_space(row.space, space_order)
        for r in row.budgets or grid.budgets:
            for alloc in ALLOCATIONS:
                key = f"{row.method}/{canon}/R{r}/{alloc}"
                add(Job(key, row.method, canon, (row.space,), r, alloc))
            if (row.method, row.space) in grid.random:
                for d in range(1, grid.random_draws + 1):
                    key = f"{row.method}/{canon}/R{r}/random{d}"
                    ref = f"{row.method}/{canon}/R{r}/net_utility"
                    add(Job(key, row.method, canon, (row.space,), r, "random", d, ref))
    for method, space in grid.no_budget:
        canon = METHODS[method].canonical_space(space, space_order)
        add(Job(f"{method}/{canon}/all", method, canon, (space,), None, "all"))
    if grid.full_capacity:
        key = f"ta/full/R{full_capacity}/net_utility"
        add(Job(key, "ta", "full", ("full",), full_capacity, "net_utility"))
    if grid.weight_average:
        add(Job("average", "ta", "full", ("full",), None, "average"))
    # controls last: a job's coefficient search starts from the one chosen last for its method
    # and space, so adding controls leaves every other job's search (and result) as it was
    for method, space, name in grid.controls:
        var = VARIANTS[name]
        if var.choose_from:  # derived from other controls' jobs by the runner (no merge)
            have = {v for m, sp, v in grid.controls if (m, sp) == (method, space)} | {"net_utility"}
            missing = [v for v in var.choose_from if v not in have]
            if missing:
                raise InputError(
                    f"grid: control {name!r} of {method}/{space} chooses among "
                    f"{list(var.choose_from)}; add the controls {missing} beside it."
                )
            continue
        canon = METHODS[method].canonical_space(space, space_order)
        ref = f"{method}/{canon}/R{{r}}/net_utility"
        for r in grid.budgets:
            for d in range(1, grid.random_draws + 1) if var.draws else (0,):
                key = f"{method}/{canon}/R{r}/{name}{d or ''}"
                add(Job(key, method, canon, (space,), r, name, d, ref.format(r=r)))
    return list(jobs.values())


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named experiment: tasks, data sizes, training, seeds and grid.

    Attributes:
      name: ``"quick"``, ``"full"``, ``"paper"``, ... (a suite's presets: ``encoder.PRESETS``,
        ``language.PRESETS``, ...).
      tasks: the built-in tasks run when none are chosen.
      seeds: training seeds (the data splits are the same for every seed: split seed 0).
      train: training settings, the suite's :class:`fitting.TrainConfigBase` (``train.TrainConfig``
        for the encoder; its ``seed`` is replaced by each seed). The vision suite, which trains
        nothing, gives its ``VisionConfig`` (``lora_rank``, ``lora_alpha``, ``seed``).
      grid: the merges.
      max_train, n_val, n_test: split sizes (:func:`tasks.load_task`); at least ``n_val`` and
        ``n_test`` texts per task where the data allow.
    """

    name: str
    tasks: tuple[str, ...]
    seeds: tuple[int, ...]
    train: TrainConfigBase
    grid: GridConfig
    max_train: int
    n_val: int
    n_test: int


#: The paper searches TIES's pruning rate (and DARE's drop rate) per merge; the candidates are
#: this project's: TIES keeps the top 10-50% of entries, DARE drops 10-70% (at 0.9 a rank-16
#: update keeps too little; see :data:`METHODS`).
PAPER_SEARCH = (("ties", "density", (0.1, 0.2, 0.3, 0.5)), ("dare", "p", (0.1, 0.3, 0.5, 0.7)))
