"""netutility_jax/_core/checks.py: the wording shared by every error message."""

from __future__ import annotations

from netutility_jax._core.checks import size_text


def test_sizes_read_in_powers_of_1000():
    assert [size_text(n) for n in (0, 999, 1000, 3_410_000, 2.5e9, 7e15)] == [
        "0 bytes", "999 bytes", "1 kB", "3.41 MB", "2.5 GB", "7e+03 TB",
    ]  # fmt: skip
