"""Run by tests/operators/test_mesh.py in a fresh process with 8 forced CPU devices (XLA_FLAGS): scores
and merges of one device against the same calls with ``mesh=`` (8 devices, and 3 devices, which
pads 11 modules to 12). Prints one JSON line of findings for the test to assert on."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

import netutility_jax as nu
from netutility_jax._core import mesh as _mesh
from netutility_jax._core import tree as _tree
from netutility_jax.operators import _plan

DENSE_BYTES = _plan.DENSE_BYTES

ALL_CASES = [
    ("ta", "core", {}),
    ("tsv", "full", {}),
    ("iso_c", "core", {}),
    ("iso_cts", "full", {}),
    ("ties", "knots", {"density": 0.3}),
    ("ties", "core", {}),
    ("ties", "full", {}),
    ("dare", "core", {"p": 0.5, "key": "key"}),
    ("dare_ties", "knots", {"p": 0.3, "key": "prng"}),
    # a working-memory budget of 4 KiB: every module merged a few rows at a time
    ("dare_ties", "knots/rows", {"p": 0.3, "key": "key", "dense_bytes": 4096}),
    ("ties", "knots/rows", {"density": 0.3, "dense_bytes": 4096}),
]
FAST_CASES = [ALL_CASES[0]]


def adapters():
    """3 tasks, 11 layers x (q: 64->32, v: 64->48), ranks varying by task, task 2 lacks one
    module and one task is 8 times larger (so the scores are not symmetric)."""
    rng = np.random.default_rng(0)
    out = []
    for t, (rq, rv) in enumerate(((4, 6), (2, 6), (4, 3))):
        ad = {}
        for layer in range(11):
            for name, r, d_out in (("q", rq, 32), ("v", rv, 48)):
                if t == 2 and (layer, name) == (5, "v"):
                    ad[f"l{layer}.{name}"] = None
                    continue
                ad[f"l{layer}.{name}"] = {
                    "lora_a": rng.normal(size=(64, r)).astype(np.float32),
                    "lora_b": rng.normal(size=(r, d_out)).astype(np.float32) * (8.0 if t else 1),
                }
        out.append(ad)
    return out


def rel_diff(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    fin = np.isfinite(x)
    if not np.array_equal(fin, np.isfinite(y)) or not np.array_equal(x[~fin], y[~fin]):
        return float("inf")
    scale = max(np.abs(x[fin]).max(initial=0.0), 1e-30)
    return float(np.abs(x[fin] - y[fin]).max(initial=0.0) / scale)


_REFS: dict = {}  # case -> the one-device merge and its report


def _mode(ads, one, cases) -> dict:
    found: dict = {"cases": {}}
    for d in (8, 3) if len(cases) > 1 else (8,):  # 3 devices (11 modules padded to 12): slow
        mesh = nu.module_mesh(jax.devices()[:d])
        sc = nu.score(ads, mesh=mesh)
        found[f"score_{d}"] = {
            "lam": rel_diff(one.lam, sc.lam),
            "fields": max(
                rel_diff(getattr(one.modules[n], f), getattr(sc.modules[n], f))
                for n in one.modules
                for f in ("sigma", "benefit", "interference", "utility")
            ),
            "masks_equal": all(
                np.array_equal(nu.allocate(one, 5)[n], nu.allocate(sc, 5)[n]) for n in one.modules
            ),
        }
    mesh = nu.module_mesh()
    for method, space, opts in cases:
        opts = dict(opts)
        if opts.get("key") == "key":
            opts["key"] = jax.random.key(0)
        elif opts.get("key") == "prng":
            opts["key"] = jax.random.PRNGKey(1)
        _plan.DENSE_BYTES = opts.pop("dense_bytes", DENSE_BYTES)
        sp = space.split("/")[0]
        name = f"{method}/{space}"
        if name not in _REFS:  # the one-device merge: the same in both modes, computed once
            _REFS[name] = nu.merge_adapters(ads, budget=4, method=method, space=sp, **opts)
        ref, rep = _REFS[name]
        out, rep_m = nu.merge_adapters(ads, budget=4, method=method, space=sp, mesh=mesh, **opts)
        _plan.DENSE_BYTES = DENSE_BYTES
        found["cases"][name] = {
            "masks_equal": all(np.array_equal(rep.masks[n], rep_m.masks[n]) for n in rep.masks),
            "ranks_equal": rep.ranks == rep_m.ranks,
            "exact": all(
                np.array_equal(
                    np.asarray(nu.module_update(ref[n])), np.asarray(nu.module_update(out[n]))
                )
                for n in ref
            ),
            "rel": max(rel_diff(nu.module_update(ref[n]), nu.module_update(out[n])) for n in ref),
        }
    return found


def main(cases) -> dict:
    """Both ways a mesh runs: its devices' shares in turn (CPU's default) and one SPMD program
    (``NETUTILITY_MESH_SPMD=1``, what GPUs and TPUs run; safe on CPU at these small shapes)."""
    ads = adapters()
    one = nu.score(ads)
    found: dict = {"devices": jax.device_count()}
    st = _mesh.host_stack(
        _tree.collect(ads, fn="t")[1][0], np.float32, _mesh.padded(11, nu.module_mesh())
    )
    placed = _mesh.shard(st.a, nu.module_mesh())
    found["shards"] = sorted({tuple(s.data.shape) for s in placed.addressable_shards})
    found["n_shards"] = len(placed.addressable_shards)
    for mode in ("in_turn", "spmd"):
        os.environ["NETUTILITY_MESH_SPMD"] = "1" if mode == "spmd" else "0"
        found[mode] = _mode(ads, one, cases)
        if len(cases) > 1:
            found[mode]["cli"] = _cli(ads)
    return found


_CLI_REF: dict = {}


def _cli(ads) -> dict:
    """``netutility merge`` (streamed, small chunks) with ``--devices all`` (8) against
    ``--devices 1``: the written adapters, tensor for tensor."""
    import tempfile

    import safetensors.numpy

    from netutility_jax import cli

    with tempfile.TemporaryDirectory() as tmp:
        folders = []
        for i, ad in enumerate(ads):
            folders.append(f"{tmp}/task{i}")
            nu.peft.save_adapter({k: v for k, v in ad.items() if v is not None}, folders[-1])
        out = {}
        for devices in ("all", "1") if "1" not in _CLI_REF else ("all",):
            argv = ["merge", *folders, "--budget", "4", "--method", "tsv", "--space", "core"]
            argv += ["--chunk-mb", "0.05", "--devices", devices, "--out", f"{tmp}/out{devices}"]
            assert cli.main([*argv, "--no-plots", "--quiet"]) == 0
            out[devices] = safetensors.numpy.load_file(
                f"{tmp}/out{devices}/adapter_model.safetensors"
            )
        out["1"] = _CLI_REF.setdefault("1", out.get("1"))  # (one device: the same in both modes)
        return {
            "same_names": sorted(out["all"]) == sorted(out["1"]),
            "rel": max(rel_diff(out["all"][k], out["1"][k]) for k in out["1"]),
        }


if __name__ == "__main__":
    print(json.dumps(main(ALL_CASES if sys.argv[1:] == ["all"] else FAST_CASES)))
