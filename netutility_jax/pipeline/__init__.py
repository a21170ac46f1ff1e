"""Stage 4, the pipeline: the entry points that run scoring, allocation and a merge operator
together. In memory (:mod:`.merging`: ``nu.merge``, ``nu.merge_adapters``), streamed from disk
(:mod:`.streaming`), planned before running (:mod:`.planning`), diagnosed (:mod:`.diagnostics`);
a merge's checked arguments (``_request``), its report (``_report``), the bucket loop
(``_run``) and the multi-process exchange (``_exchange``, ``_supervise``).
"""

__all__: list[str] = []
