"""The experiments' suites, each a model with its heads, training and evaluation: ``encoder``
(MiniLM, the built-in ``netutility demo``, with ``encoder_eval`` and ``train``), ``language``
(a Llama-family decoder scoring label words, with ``lang_eval`` and ``lang_train``),
``language_head`` (the same decoder with a classification head), ``vision`` (CLIP's zero-shot
heads) and ``nli`` (a 3-way classification head, ``nli_head``).

Each suite module registers its suite in the harness's registry
(:mod:`netutility_jax.experiments.harness.suites`) in one declaration, its ``SPEC``, when it is
imported; ``netutility demo`` imports them. Submodules are imported explicitly; nothing is
imported here (so that ``python -m netutility_jax.experiments.suites.nli`` runs its module
once).
"""

__all__: list[str] = []  # nothing is re-exported: import the submodules
