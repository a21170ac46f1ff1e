"""Stage 1, scoring: thin SVDs of the LoRA updates from their factors (:mod:`.decompose`), the
Net Utility of every singular direction (:mod:`.utility`, ``nu.score``) and the data-aware
input moments (:mod:`.moments`); ``_run`` is one scoring run over an adapter set, ``_kernels``
the jitted programs, ``_grams`` the only ``d``-sized work, ``_errors`` the error reports.
"""

__all__: list[str] = []
