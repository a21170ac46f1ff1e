"""``python -m netutility_jax.cli ARGS``: the ``netutility`` command (as the distributed merge's
supervisor and the tests run it). The process ends as soon as the command is done
(:func:`.entry.exit_now`: no interpreter teardown, about 0.5 s of a small merge)."""

from __future__ import annotations

from .entry import exit_now, main

__all__: list[str] = []

if __name__ == "__main__":
    exit_now(main())
