"""``python -m netutility_jax.cli ARGS``: the ``netutility`` command (as the distributed merge's
supervisor and the tests run it)."""

from __future__ import annotations

import sys

from .entry import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
