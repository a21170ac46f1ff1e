"""Stage 2, allocation: the budgeted choice of singular directions (:mod:`.allocate`,
``nu.allocate``: global top-k, per module, uniform, per-task floors in ``_min_share``) and the
summaries of a choice (:mod:`.analysis`).
"""

__all__: list[str] = []
