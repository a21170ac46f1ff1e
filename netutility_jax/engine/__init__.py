"""The stacked engine: programs over buckets of stacked factors (one per stage, traceable).

:mod:`.traced` holds the merge that runs inside ``jax.jit``, ``jax.grad`` and ``jax.vmap``.
"""

from . import traced as traced

__all__ = ["traced"]
