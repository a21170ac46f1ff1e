"""The stacked engine: programs over buckets of stacked factors (one per stage, traceable).

:mod:`.tables` holds per-module results stacked until asked for, :mod:`.traced` the merge that
runs inside ``jax.jit``, ``jax.grad`` and ``jax.vmap``, :mod:`.ta` Task Arithmetic as one
program over every bucket.
"""

__all__: list[str] = []
