"""Cases shared by the one-program merge tests (tests/pipeline/test_fused.py, TA, and
tests/pipeline/test_fused_stages.py, every other method): small adapters over three buckets with
a ragged rank, the dense update in float64, and a spy on the one-program route."""

from __future__ import annotations

import numpy as np

import netutility_jax as nu

M = 4
KINDS = {"q": (24, 24), "k": (24, 8), "up": (24, 40)}


def adapters(seed=0, layers=3, rank=4):
    """``M`` tasks' factors for ``layers`` x :data:`KINDS`; task 1's ``k`` modules one rank short."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(M):
        ad = {}
        for layer in range(layers):
            for kind, (d_in, d_out) in KINDS.items():
                r = rank - (i == 1 and kind == "k")  # a ragged rank in one bucket
                ad[f"l{layer}.{kind}"] = {
                    "lora_a": rng.normal(size=(d_in, r)).astype(np.float32) / np.sqrt(d_in),
                    "lora_b": rng.normal(size=(r, d_out)).astype(np.float32) * (1 + i),
                    "scale": 0.5 + i,
                }
        out.append(ad)
    return out


def dense(mod):
    """A module's ``scale * a @ b`` in float64."""
    a, b = (np.asarray(mod[k], np.float64) for k in ("lora_a", "lora_b"))
    return float(mod.get("scale", 1.0)) * a @ b


def spy(monkeypatch, module, name):
    """Record what ``module.name`` (the one-program route) returns in this test: a list that
    holds each call's result (None where the route declined)."""
    seen = []
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(module, name, wrapped)
    return seen


def by_stages(monkeypatch, module, name, *args, **kwargs):
    """``nu.merge_adapters(*args, **kwargs)`` with the one-program route ``module.name`` off."""
    with monkeypatch.context() as mp:
        mp.setattr(module, name, lambda *a, **k: None)
        return nu.merge_adapters(*args, **kwargs)
