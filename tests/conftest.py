"""Shared pytest configuration; helpers and the dense reference live in ``_reference.py``.

The whole suite runs under strict dtype promotion (``jax_numpy_dtype_promotion="strict"``): an
implicit promotion in the library is a bug (STYLE.md). The ``test_strict_promotion_*`` tests also
check it explicitly for bf16/fp16/float32/float64 inputs.
"""

from __future__ import annotations

import os
import tempfile

import hypothesis
import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")

# No example database, and Hypothesis' other caches (it keeps one of source constants even without
# a database) go to the temp dir: the suite writes nothing into the repository.
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "netutility-jax-hypothesis")
)
# The CLI's persistent compilation cache is a global JAX setting: off for in-process CLI tests
# (tests/test_cli.py::test_compile_cache_* turn it on in their own processes).
os.environ["NETUTILITY_COMPILE_CACHE"] = "off"
hypothesis.settings.register_profile(
    "netutility", max_examples=15, deadline=None, database=None, derandomize=True
)
hypothesis.settings.load_profile("netutility")


@pytest.fixture(params=[3, 4], ids=lambda m: f"M{m}")
def m_tasks(request) -> int:
    return request.param
