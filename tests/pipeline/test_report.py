"""``netutility_jax.pipeline._report``: a report's ``h`` is NaN only where it is undefined (a task zero in
every module), never in place of another error."""

from __future__ import annotations

import math

import numpy as np
import pytest

from netutility_jax.errors import InputError
from netutility_jax.pipeline._report import heterogeneity_or_nan


def _adapters(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"q": {"lora_a": rng.normal(size=(8, 2)), "lora_b": rng.normal(size=(2, 4))}}
        for _ in range(3)
    ]


def test_h_is_nan_where_a_task_is_zero_everywhere():
    ads = _adapters()
    ads[1]["q"]["lora_b"] = np.zeros((2, 4))
    assert math.isnan(heterogeneity_or_nan(ads))


def test_h_of_other_inputs_is_their_variance_of_log_energies():
    ads = _adapters(1)
    e = [np.linalg.norm(ad["q"]["lora_a"] @ ad["q"]["lora_b"]) ** 2 for ad in ads]
    assert heterogeneity_or_nan(ads) == pytest.approx(float(np.var(np.log(e))), rel=1e-5)


def test_another_refusal_is_raised_not_reported_as_nan():
    """A NaN factor is the library's InputError (naming the module and task), which used to be
    swallowed into h = NaN."""
    ads = _adapters(2)
    ads[2]["q"]["lora_a"][0, 0] = np.nan
    with pytest.raises(InputError, match=r"module 'q', task 2"):
        heterogeneity_or_nan(ads)
