"""Stage 3, the merge operators: the methods (:mod:`.methods`), the spaces they run in
(:mod:`.spaces`), their per-bucket stages (``_stages``), the merge planner (``_plan``), and the
stacked engine: adapters stacked once (:mod:`.stacked`), every bucket as one program
(:mod:`.program`, :mod:`.ta`) and merges under ``jax.jit``/``jax.grad`` (:mod:`.traced`).
"""

__all__: list[str] = []
