"""netutility-jax: budget-aware LoRA merging across tasks with Net Utility, in JAX."""

from ._tree import extract_lora as extract_lora
from .allocate import allocate as allocate
from .analysis import budget_spent as budget_spent
from .analysis import kept_per_module as kept_per_module
from .analysis import kept_per_task as kept_per_task
from .analysis import non_prefix_fraction as non_prefix_fraction
from .analysis import retention_by_rank as retention_by_rank
from .decompose import LoraSVD as LoraSVD
from .decompose import lora_svd as lora_svd
from .merging import Report as Report
from .merging import fold as fold
from .merging import merge as merge
from .merging import merge_adapters as merge_adapters
from .merging import module_update as module_update
from .merging import to_lora as to_lora
from .utility import ModuleScores as ModuleScores
from .utility import Scores as Scores
from .utility import heterogeneity as heterogeneity
from .utility import score as score
from .utility import task_energies as task_energies

__version__ = "0.1.0"

__all__ = [
    "LoraSVD",
    "ModuleScores",
    "Report",
    "Scores",
    "allocate",
    "budget_spent",
    "extract_lora",
    "fold",
    "heterogeneity",
    "kept_per_module",
    "kept_per_task",
    "lora_svd",
    "merge",
    "merge_adapters",
    "module_update",
    "non_prefix_fraction",
    "retention_by_rank",
    "score",
    "task_energies",
    "to_lora",
]
