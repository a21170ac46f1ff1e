"""nu.score(alpha="auto") on a set with an all-zero adapter: the refusal names the argument,
the task index and (through the private ``_names``) the adapter, and carries both as
attributes for a caller that names them its own way (the CLI: ``--alpha``, the adapter's path)."""

from __future__ import annotations

import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax.errors import InputError


def _set():
    rng = np.random.default_rng(9)
    ok = {"p": {"lora_a": rng.normal(size=(8, 2)), "lora_b": rng.normal(size=(2, 4))}}
    zero = {"p": {"lora_a": np.ones((8, 2)), "lora_b": np.zeros((2, 4))}}
    return [ok, ok, zero]


def test_alpha_auto_refusal_names_the_argument_and_the_task():
    with pytest.raises(InputError) as info:
        nu.score(_set(), alpha="auto")
    msg = str(info.value)
    assert msg.startswith(
        "nu.score: alpha='auto' applies the heterogeneity rule, which needs every task's "
        "log-energy, but task 2 (adapters[2]) has a zero update in every module."
    )
    assert "pass a number for alpha= (1.0 Gram geometry, 0.0 row space)" in msg
    assert info.value.task_index == 2 and info.value.argument == "alpha"
    nu.score(_set(), alpha=1.0, lam=1.0)  # a number for alpha: no h needed


def test_heterogeneity_refusal_names_the_adapter_when_known():
    with pytest.raises(InputError, match=r"^nu\.heterogeneity: task 2 \('c'\) has a zero update"):
        nu.heterogeneity(_set(), _names=("a", "b", "c"))
    with pytest.raises(InputError) as info:
        nu.heterogeneity(_set())
    assert info.value.task_index == 2 and info.value.argument is None
