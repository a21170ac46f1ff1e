"""netutility-jax: budget-aware LoRA merging across tasks with Net Utility, in JAX.

The package follows the data: ``scoring`` (Net Utility of every singular direction), ``allocation``
(the budgeted choice), ``operators`` (the merge methods, spaces and the stacked engine) and
``pipeline`` (the entry points that run them together, in memory or streamed), on a private
``_core``. Every public name is here, as ``nu.<name>``. The public modules' earlier flat paths
(``netutility_jax.streaming``, ``netutility_jax.moments``, ...) still import, as the same module
objects (:data:`MODULE_PATHS`).

The numerical core (scoring, allocation, merging) is imported eagerly. The interop and tooling
submodules are imported on first use, so ``import netutility_jax`` stays light: ``nu.peft``
(PEFT checkpoints), ``nu.nnx`` (Flax nnx models), ``nu.checkpoint`` (orbax), ``nu.plots``
(matplotlib), ``nu.provenance`` (recording a result: versions, commit, atomic JSON and folder
writes) and ``nu.experiments`` (the built-in MiniLM experiment). ``nu.registry`` declares the
merge methods and spaces (their options, the spaces they run in, their kernels).
"""

import importlib as _importlib

from . import registry as registry
from ._core.mesh import module_mesh as module_mesh
from ._core.tree import extract_lora as extract_lora
from .allocation.allocate import allocate as allocate
from .allocation.analysis import budget_spent as budget_spent
from .allocation.analysis import kept_per_module as kept_per_module
from .allocation.analysis import kept_per_task as kept_per_task
from .allocation.analysis import non_prefix_fraction as non_prefix_fraction
from .allocation.analysis import retention_by_rank as retention_by_rank
from .errors import InputError as InputError
from .errors import InputTypeError as InputTypeError
from .errors import NetUtilityError as NetUtilityError
from .folders import MergeConfig as MergeConfig
from .folders import merge_folders as merge_folders
from .operators.stacked import StackedAdapters as StackedAdapters
from .operators.stacked import stack_adapters as stack_adapters
from .pipeline.diagnostics import Diagnostics as Diagnostics
from .pipeline.diagnostics import diagnose as diagnose
from .pipeline.merging import Report as Report
from .pipeline.merging import fold as fold
from .pipeline.merging import merge as merge
from .pipeline.merging import merge_adapters as merge_adapters
from .pipeline.merging import module_update as module_update
from .pipeline.merging import to_lora as to_lora
from .pipeline.planning import Plan as Plan
from .pipeline.planning import plan as plan
from .pipeline.streaming import merge_adapters_streaming as merge_adapters_streaming
from .scoring.decompose import LoraSVD as LoraSVD
from .scoring.decompose import lora_svd as lora_svd
from .scoring.moments import InputMoments as InputMoments
from .scoring.moments import input_moments as input_moments
from .scoring.moments import input_moments_dense as input_moments_dense
from .scoring.utility import INTERFERENCES as INTERFERENCES
from .scoring.utility import ModuleScores as ModuleScores
from .scoring.utility import Scores as Scores
from .scoring.utility import heterogeneity as heterogeneity
from .scoring.utility import score as score
from .scoring.utility import task_energies as task_energies

__version__ = "0.1.0"

#: The public modules' flat paths (``netutility_jax.<old>``) and where they live now.
MODULE_PATHS = {
    "utility": "scoring.utility",
    "decompose": "scoring.decompose",
    "moments": "scoring.moments",
    "allocate": "allocation.allocate",
    "analysis": "allocation.analysis",
    "methods": "operators.methods",
    "spaces": "operators.spaces",
    "merging": "pipeline.merging",
    "streaming": "pipeline.streaming",
    "planning": "pipeline.planning",
    "diagnostics": "pipeline.diagnostics",
    "engine.stacked": "operators.stacked",
    "engine.tables": "_core.tables",
}


def _register_module_paths() -> None:
    import sys
    import types

    engine = types.ModuleType(f"{__name__}.engine", "The stacked engine's earlier path.")
    engine.__all__ = []  # type: ignore[attr-defined]
    sys.modules[engine.__name__] = engine
    for old, new in MODULE_PATHS.items():
        mod = _importlib.import_module(f".{new}", __name__)
        sys.modules[f"{__name__}.{old}"] = mod
        owner, _, leaf = old.rpartition(".")
        if owner:
            setattr(engine, leaf, mod)
        elif old not in globals():  # nu.allocate stays the function
            globals()[old] = mod
    globals()["engine"] = engine


_register_module_paths()

_LAZY = ("checkpoint", "experiments", "nnx", "peft", "plots", "provenance")


def __getattr__(name: str):
    if name in _LAZY:
        mod = _importlib.import_module(f".{name}", __name__)
        globals()[name] = mod
        return mod
    raise AttributeError(f"module 'netutility_jax' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])


__all__ = [
    "INTERFERENCES",
    "Diagnostics",
    "InputError",
    "InputMoments",
    "InputTypeError",
    "LoraSVD",
    "MergeConfig",
    "ModuleScores",
    "NetUtilityError",
    "Plan",
    "Report",
    "Scores",
    "StackedAdapters",
    "allocate",
    "budget_spent",
    "checkpoint",
    "diagnose",
    "experiments",
    "extract_lora",
    "fold",
    "heterogeneity",
    "input_moments",
    "input_moments_dense",
    "kept_per_module",
    "kept_per_task",
    "lora_svd",
    "merge",
    "merge_adapters",
    "merge_adapters_streaming",
    "merge_folders",
    "module_mesh",
    "module_update",
    "nnx",
    "non_prefix_fraction",
    "peft",
    "plan",
    "plots",
    "provenance",
    "registry",
    "retention_by_rank",
    "score",
    "stack_adapters",
    "task_energies",
    "to_lora",
]
