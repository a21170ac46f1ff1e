"""The experiments' tests (``netutility_jax.experiments``), apart from the library's.

The built-in suites register themselves when their modules are imported, and ``netutility demo``
imports them all: importing the command here first gives every test the registry the command
sees, in its order, whichever test module imports a suite first.
"""

from __future__ import annotations

import netutility_jax.experiments.demo  # noqa: F401 (registers the built-in suites)
