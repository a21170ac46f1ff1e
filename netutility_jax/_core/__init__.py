"""The private core every stage stands on: adapter trees and buckets, checks, linear algebra,
devices and meshes, host placement, stacked result tables, file output and provenance.

Nothing here is public; the stages (:mod:`~netutility_jax.scoring`,
:mod:`~netutility_jax.allocation`, :mod:`~netutility_jax.operators`,
:mod:`~netutility_jax.pipeline`) import from it, never the reverse.
"""

__all__: list[str] = []
