"""A model sharded over a device mesh (:mod:`netutility_jax.experiments.models.sharding`).

The 8-device checks run this file as a script in a child process with
``--xla_force_host_platform_device_count=8`` (JAX fixes its device count when it starts; this
process has one CPU device): a tiny Qwen3-shaped decoder with LoRA and a tiny CLIP vision tower,
unsharded against sharded over 8 devices, under jit: the logits, the image features and three
training steps of the library's LoRA step (``fitting.optimizers``), with where each array went.
The child prints one JSON line of findings; the tests here assert on it. The input checks run in
this process.

A second child (``python tests/experiments/test_sharding.py suites NLI_DIR CLIP_DIR``, slow tier) checks the
wiring: ``nli.NLISuite(mesh=)`` on ``nli_toy.write_toy``'s tiny Qwen3 folder over 4 of the 8 devices
and ``vision.VisionSuite(mesh=)`` on ``tests/experiments/test_vision.py``'s tiny CLIP folder over 8, against
the same suites unsharded (last-token logits, class logits, image features), the loaders placing
weights as they read them (``llama_load.build`` / ``clip_load.build`` with ``mesh=``), and three
steps of the NLI suite's trainer (``trainer.LoraTrainer.place``: replicated by default, or by
``shard_state`` when given) against the same steps on one device.
"""

from __future__ import annotations

import doctest
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from netutility_jax.errors import InputError, InputTypeError
from netutility_jax.experiments.models import clip, llama, sharding

DEVICES = 8
MIN_BYTES = 512  # tiny models: everything but the norms' scales is split
LLAMA = llama.LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    tie_word_embeddings=False,
    qk_norm=True,
    model_type="qwen3",
)
LORA = llama.LoRAConfig(rank=8, alpha=16.0, targets=llama.ALL_TARGETS)
CLIP = clip.CLIPConfig(
    clip.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, image_size=16,
        patch_size=4,
    ),
    clip.CLIPTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
        max_position_embeddings=16, eos_token_id=63,
    ),
    projection_dim=16,
)  # fmt: skip
CLIP_LORA = clip.LoRAConfig(rank=8, alpha=16.0, targets=clip.ALL_TARGETS)


# ------------------------------------------------------------------------------ the models


def _fill(model: nnx.Module, seed: int) -> nnx.Module:
    """Every array of an ``nnx.eval_shape`` model drawn from numpy (eager nnx init compiles each
    initializer); norm scales near 1."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        v = var.get_value()
        near_one = path[-1] == "scale"
        value = near_one + rng.normal(scale=0.1 if near_one else 0.3, size=v.shape)
        var.set_value(jnp.asarray(value, v.dtype))
    return model


def tiny_llama() -> llama.Llama:
    """The tiny decoder with fresh LoRA factors (``llama.add_lora``) whose ``B`` is then drawn
    too, so the adapters change the logits."""
    base = _fill(nnx.eval_shape(lambda: llama.Llama(LLAMA, rngs=nnx.Rngs(0))), 0)
    model = llama.add_lora(base, LORA, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(2)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        v = var.get_value()
        var.set_value(jnp.asarray(rng.normal(scale=0.3, size=v.shape), jnp.float32))
    return model


def tiny_clip() -> clip.CLIPModel:
    base = _fill(nnx.eval_shape(lambda: clip.CLIPModel(CLIP, rngs=nnx.Rngs(0))), 3)
    model = clip.add_lora(base, CLIP_LORA, rngs=nnx.Rngs(4))
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(var.get_value() + 0.05)  # B != 0
    return model


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    ids = rng.integers(1, LLAMA.vocab_size, size=(4, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 9:] = mask[3, :4] = 0  # right and left padding
    return np.where(mask != 0, ids, 0).astype(np.int32), mask


# ------------------------------------------------------------------------------- the child


def _rel(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30))


def _placement(state, mesh, min_bytes: int) -> dict:
    """Every parameter of at least ``min_bytes``: split over all the mesh's devices, each device
    holding ``1/n`` of it (its own shard); the others replicated."""
    n = mesh.size
    bad, big, shards = [], 0, 0
    for path, var in nnx.to_flat_state(state):
        x, name = var.get_value(), "/".join(map(str, path))
        devs = {s.device for s in x.addressable_shards}
        if x.nbytes < min_bytes or not isinstance(var, nnx.Param):
            if any(s.data.shape != x.shape for s in x.addressable_shards) or len(devs) != n:
                bad.append(f"{name}: small but not replicated")
            continue
        big += 1
        (dim,) = [i for i, a in enumerate(x.sharding.spec) if a is not None]
        want = tuple(s // n if i == dim else s for i, s in enumerate(x.shape))
        got = [tuple(s.data.shape) for s in x.addressable_shards]
        if len(x.sharding.device_set) != n or len(devs) != n or got != [want] * n:
            bad.append(f"{name}: {x.shape} in shards {got}")
        shards += sum(s.data.nbytes for s in x.addressable_shards) == x.nbytes
    return {"bad": bad, "big": big, "split_exactly": shards}


def _llama_child(mesh) -> dict:
    from netutility_jax.experiments.harness import fitting as ft

    ids, mask = batch()
    model = tiny_llama()
    forward = nnx.jit(lambda m, i, k: m(i, k))
    last = nnx.jit(llama.last_token_logits)
    want, want_last = np.asarray(forward(model, ids, mask)), np.asarray(last(model, ids, mask))

    def loss_fn(lora, base, ids, mask):
        m = nnx.merge(graphdef, lora, base)
        lp = jax.nn.log_softmax(m(ids, mask)[:, :-1], -1)
        nll = -jnp.take_along_axis(lp, ids[:, 1:, None], -1)[..., 0]
        w = mask[:, 1:].astype(jnp.float32)
        return (nll * w).sum() / w.sum()

    cfg = ft.TrainConfigBase(lora_rank=8, lora_alpha=16.0, learning_rate=1e-2, max_steps=10)
    tx, step = ft.optimizers(cfg, loss_fn)(cfg.max_steps)

    def train(m, mesh=None) -> tuple[list[float], dict]:
        _, lora, base = nnx.split(m, nnx.LoRAParam, ...)
        lora = jax.tree.map(jnp.array, lora)  # buffers of its own: the step donates them
        opt, losses = tx.init(lora), []
        if mesh is not None:  # the optimizer's state beside its factors (and its count
            # replicated: left on one device, the second step would compile again)
            opt = sharding.shard_state(opt, mesh, min_bytes=MIN_BYTES)[0]
        for _ in range(3):  # step 0 has learning rate 0 (warmup): 2 moves
            lora, opt, loss = step(lora, opt, base, ids, mask)
            losses.append(float(loss))
        return losses, lora

    graphdef = nnx.split(model, nnx.LoRAParam, ...)[0]
    want_losses, want_lora = train(model)

    before = step._cache_size()
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    same, summary = sharding.shard_model(model, mesh, min_bytes=MIN_BYTES)
    got, got_last = forward(model, ids, mask), last(model, ids, mask)
    got_losses, got_lora = train(model, mesh)
    compiled = [before, step._cache_size() - before]
    lora_specs = {
        "/".join(map(str, p)): [tuple(v.get_value().sharding.spec), summary.specs["/".join(map(str, p))]]
        for p, v in nnx.to_flat_state(got_lora)
    }  # fmt: skip
    return {
        "same_object": same is model,
        "placement": _placement(nnx.state(model), mesh, MIN_BYTES),
        "lora_split": sum(any(a is not None for a in s) for s, _ in lora_specs.values()),
        "lora_kept_sharding": all(tuple(a) == tuple(b) for a, b in lora_specs.values()),
        "n_lora": len(lora_specs),
        "step_compiled": compiled,
        "summary": {
            "devices": summary.devices,
            "total_bytes": summary.total_bytes,
            "bytes_per_device": summary.bytes_per_device,
            "sharded": summary.sharded,
            "replicated": summary.replicated,
            "n_specs": len(summary.specs),
        },
        "state_bytes": total,
        "device_bytes": max(
            sum(
                s.data.nbytes
                for x in jax.tree.leaves(nnx.state(model))
                for s in x.addressable_shards
                if s.device == d
            )
            for d in mesh.devices.flat
        ),
        "logits": _rel(want, got),
        "last_logits": _rel(want_last, got_last),
        "logits_scale": float(np.abs(want).max()),
        "losses": [want_losses, got_losses],
        "lora_moved": max(
            _rel(a, b)
            for a, b in zip(
                jax.tree.leaves(want_lora),
                jax.tree.leaves(nnx.state(model, nnx.LoRAParam)),
                strict=True,
            )
        ),
        "lora": max(
            _rel(a, b)
            for a, b in zip(jax.tree.leaves(want_lora), jax.tree.leaves(got_lora), strict=True)
        ),
    }


def _clip_child(mesh) -> dict:
    model = tiny_clip()
    x = np.random.default_rng(6).normal(size=(6, 3, 16, 16)).astype(np.float32)
    feats = nnx.jit(lambda m, x: m.get_image_features(x))
    want, want_batched = np.asarray(feats(model, x)), clip.image_features(model, x, batch_size=4)
    _, summary = sharding.shard_model(model, mesh, min_bytes=MIN_BYTES)
    got, got_batched = feats(model, x), clip.image_features(model, x, batch_size=4)
    return {
        "placement": _placement(nnx.state(model), mesh, MIN_BYTES),
        "sharded": summary.sharded,
        "bytes": [summary.bytes_per_device, summary.total_bytes],
        "features": _rel(want, got),
        "batched": _rel(want_batched, got_batched),
    }


def child() -> dict:
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as conftest.py
    mesh = sharding.model_mesh()
    return {
        "devices": jax.device_count(),
        "mesh": [list(mesh.axis_names), mesh.size],
        "llama": _llama_child(mesh),
        "clip": _clip_child(mesh),
    }


@pytest.fixture(scope="module")
def found() -> dict:
    out = _run_child()
    assert out["devices"] == DEVICES and out["mesh"] == [["model"], DEVICES]
    return out


# ------------------------------------------------------------------------------- the tests


@pytest.mark.slow  # (the 8-device child process: about 17 s of CPU)
def test_sharded_decoder_logits_match_and_each_device_holds_an_eighth(found):
    f = found["llama"]
    assert f["same_object"]  # placed in place
    p = f["placement"]
    assert not p["bad"], p["bad"]
    # 7 projections x (kernel, lora_a, lora_b) + embedding + lm_head; only the norms (32 or 8
    # floats) are replicated
    assert p["big"] == p["split_exactly"] == LLAMA.num_layers * 7 * 3 + 2
    s = f["summary"]
    assert s["devices"] == DEVICES and s["sharded"] == p["big"]
    assert (
        s["replicated"] == LLAMA.num_layers * 4 + 1
        and s["n_specs"] == s["sharded"] + s["replicated"]
    )
    assert s["total_bytes"] == f["state_bytes"]
    assert s["bytes_per_device"] == f["device_bytes"]  # what the devices really hold
    assert s["bytes_per_device"] < s["total_bytes"] / 7
    # float32 rounding (sums split over devices add in another order)
    assert f["logits_scale"] > 1 and f["logits"] <= 1e-5 and f["last_logits"] <= 1e-5


@pytest.mark.slow  # (the 8-device child process: about 17 s of CPU)
def test_sharded_lora_training_step_matches(found):
    f = found["llama"]
    want, got = f["losses"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want[2] < want[1]  # the steps moved the adapters
    assert f["lora_moved"] > 1e-3  # (the trained factors differ from the model's)
    assert f["lora"] <= 1e-5  # the same updated factors
    # the updated factors stay where they were put (split over the mesh)
    assert f["lora_split"] == f["n_lora"] == LLAMA.num_layers * 7 * 2 and f["lora_kept_sharding"]
    assert f["step_compiled"] == [1, 1]  # one compilation each way: the outputs fed back in fit


@pytest.mark.slow  # (the 8-device child process: about 17 s of CPU)
def test_sharded_clip_image_features_match(found):
    f = found["clip"]
    assert not f["placement"]["bad"], f["placement"]["bad"]
    assert f["sharded"] == f["placement"]["big"] > CLIP.vision_config.num_layers * 6 * 3
    assert f["bytes"][0] < f["bytes"][1] / 4
    assert f["features"] <= 1e-5 and f["batched"] <= 1e-5


# --------------------------------------------------------------- the suites' child (slow)


def _nli_suite_child(model_dir: str, data_dir: str, mesh) -> dict:
    import dataclasses

    from netutility_jax.experiments.models import llama_load, llama_model
    from netutility_jax.experiments.suites import nli
    from netutility_jax.experiments.suites import nli_head as nh

    one = nli.NLISuite(model_dir=model_dir, data_dir=data_dir)
    split = nli.NLISuite(model_dir=model_dir, data_dir=data_dir, mesh=mesh, min_bytes=MIN_BYTES)
    fn = "test"
    cfg, tensors = llama_load.read_folder(pathlib.Path(model_dir), fn)
    f32 = jnp.float32
    loaded = llama_load.build(
        fn, cfg, tensors, "t", llama_model.ModelOptions(None, f32, f32, None), mesh=mesh,
        min_bytes=MIN_BYTES,
    )  # fmt: skip
    rng = np.random.default_rng(7)
    ids = rng.integers(3, cfg.vocab_size, size=(4, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 9:] = mask[3, :4] = 0
    ids = np.where(mask != 0, ids, 0).astype(np.int32)
    last = nnx.jit(llama.last_token_logits)
    pooled = nnx.jit(lambda m, i, k: nh.pool_last(m.hidden_states(i, k), k))
    w = rng.normal(size=(cfg.hidden_size, nh.NUM_CLASSES))
    want_last = np.asarray(last(one.model, ids, mask))
    want_cls = np.asarray(pooled(one.model, ids, mask), np.float64) @ w

    # three steps of the suite's trainer (no dropout: the same steps on any mesh)
    tcfg = dataclasses.replace(nli.QUICK.train, lora_dropout=0.0)
    task = nli.load_tasks(["snli"], nli.QUICK, data_dir=data_dir)[0]
    head = nh.head_spec(task)

    def steps(suite, placer=None):
        tr = nh.Trainer(tcfg, suite.model, suite.tokenizer, scorer=suite.scorer)
        if placer is not None:
            tr.placer = placer
        c = tr.task_config(task)
        run = tr.prepare(task, head, c, None)
        tx, step = tr._optimizer(c.max_steps, c.learning_rate)
        # B drawn too (as tiny_llama's): from B = 0 Adam's first step is lr * sign(grad), and
        # the sign of a gradient entry near 0 is float32 noise
        rng = np.random.default_rng(3)
        state = jax.tree_util.tree_map_with_path(
            lambda p, x: (
                jnp.asarray(rng.normal(scale=0.3, size=x.shape), x.dtype)
                if "lora_b" in jax.tree_util.keystr(p)
                else x
            ),
            tr.init(task.name),
        )
        state = tr.place(state)
        opt = tr.place(tx.init(state))
        split_leaves = sum(
            any(a is not None for a in getattr(x.sharding, "spec", ()))
            for x in jax.tree.leaves(state)
        )  # as placed
        first, losses = jax.tree.map(np.asarray, state), []
        for d in range(3):  # the same rows each step: one batch shape
            b = run.batch(np.arange(c.rows), d)
            state, opt, loss = step(state, opt, tr.base_state, *b.args)
            losses.append(float(loss))
        on_mesh = all(len(x.sharding.device_set) == mesh.size for x in jax.tree.leaves(state))
        leaves = zip(jax.tree.leaves(first), jax.tree.leaves(state), strict=True)
        moved = max(_rel(a, b) for a, b in leaves)
        return {
            "mesh": None if tr.mesh is None else tr.mesh.size,
            "losses": losses,
            "state": [np.asarray(x) for x in jax.tree.leaves(state)],
            "on_mesh": on_mesh,
            "split_leaves": split_leaves,
            "moved": moved,
            "compiled": step._cache_size(),
        }

    want = steps(one)
    got = steps(split)
    shard = steps(split, lambda t: sharding.shard_state(t, mesh, min_bytes=MIN_BYTES)[0])

    def same(a, b):
        return max(_rel(x, y) for x, y in zip(a["state"], b["state"], strict=True))

    return {
        "model_devices": split.model_devices,
        "placement": _placement(nnx.state(split.model), mesh, MIN_BYTES),
        "loaded_placement": _placement(nnx.state(loaded), mesh, MIN_BYTES),
        "record": sharding.placement_record(split.placement),
        "key": [one.eval_key(tcfg).get("model_devices"), split.eval_key(tcfg).get("model_devices")],
        "description": split.description,
        "last_logits": _rel(want_last, last(split.model, ids, mask)),
        "loaded_last_logits": _rel(want_last, last(loaded, ids, mask)),
        "class_logits": _rel(want_cls, np.asarray(pooled(split.model, ids, mask), np.float64) @ w),
        "train": {
            "meshes": [want["mesh"], got["mesh"], shard["mesh"]],
            "losses": [want["losses"], got["losses"], shard["losses"]],
            "replicated": same(want, got),
            "shard_state": same(want, shard),
            "moved": want["moved"],
            "on_mesh": [got["on_mesh"], shard["on_mesh"]],
            "split_leaves": [got["split_leaves"], shard["split_leaves"]],
            "compiled": [want["compiled"], got["compiled"], shard["compiled"]],
        },
    }


def _clip_suite_child(clip_dir: str, mesh) -> dict:
    from netutility_jax.experiments.models import clip_load, clip_model
    from netutility_jax.experiments.suites import vision

    one = vision.VisionSuite(clip_dir, clip_dir, {})
    split = vision.VisionSuite(clip_dir, clip_dir, {}, mesh=mesh, min_bytes=MIN_BYTES)
    cfg, tensors = clip_load.read_folder(pathlib.Path(clip_dir), "test")
    f32 = jnp.float32
    loaded = clip_load.build(
        "test", cfg, tensors, "t", clip_model.ModelOptions(None, f32, f32, None), mesh=mesh,
        min_bytes=MIN_BYTES,
    )  # fmt: skip
    size = cfg.vision_config.image_size
    x = np.random.default_rng(8).normal(size=(6, 3, size, size)).astype(np.float32)
    want = clip.image_features(one.model, x, batch_size=4)
    return {
        "model_devices": split.model_devices,
        "placement": _placement(nnx.state(split.model), mesh, MIN_BYTES),
        "loaded_placement": _placement(nnx.state(loaded), mesh, MIN_BYTES),
        "sharded": split.placement.sharded,
        "key": split.eval_key(None).get("model_devices"),
        "features": _rel(want, clip.image_features(split.model, x, batch_size=4)),
        "loaded_features": _rel(want, clip.image_features(loaded, x, batch_size=4)),
    }


def suites_child(nli_dir: str, clip_dir: str) -> dict:
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as conftest.py
    root = pathlib.Path(nli_dir)
    return {
        "devices": jax.device_count(),
        "nli": _nli_suite_child(str(root / "model"), str(root / "data"), sharding.model_mesh(4)),
        "clip": _clip_suite_child(clip_dir, sharding.model_mesh()) if clip_dir else None,
    }


def _run_child(*args: str) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={DEVICES}"])
    env["NETUTILITY_COMPILE_CACHE"] = "off"
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def suites_found(tmp_path_factory) -> dict:
    """The suites' child's findings (the tiny CLIP folder only where torch and transformers,
    which write it, are installed)."""
    import importlib.util

    from netutility_jax.experiments.suites import nli_toy

    folder = tmp_path_factory.mktemp("nli_toy")
    nli_toy.write_toy(folder)
    clip_dir = ""
    if all(importlib.util.find_spec(m) for m in ("torch", "transformers", "PIL")):
        import test_vision

        clip_dir = str(test_vision.write_model(tmp_path_factory.mktemp("clip")))
    out = _run_child("suites", str(folder), clip_dir)
    assert out["devices"] == DEVICES
    return out


@pytest.mark.slow  # (an 8-device child process loading two tiny suites: about 40 s of CPU)
def test_nli_suite_on_a_mesh_matches_one_device(suites_found):
    f = suites_found["nli"]
    assert f["model_devices"] == 4  # 4 of the 8 devices (sharding.model_mesh(4))
    for where in ("placement", "loaded_placement"):  # shard_model, and placed while loading
        p = f[where]
        assert not p["bad"], p["bad"]
        assert p["big"] == p["split_exactly"] > 0
    r = f["record"]
    assert r["model_devices"] == 4 and r["bytes_per_device"] < r["total_bytes"]
    assert r["sharded"] == f["placement"]["big"]
    assert f["key"] == [None, 4]  # one device's job keys unchanged; a split model's its own
    assert "on a 4-device mesh" in f["description"]
    assert f["last_logits"] <= 1e-5 and f["loaded_last_logits"] <= 1e-5
    assert f["class_logits"] <= 1e-5


@pytest.mark.slow  # (the same child)
def test_nli_trainer_steps_on_a_sharded_model_match_one_device(suites_found):
    t = suites_found["nli"]["train"]
    assert t["meshes"] == [None, 4, 4]  # the trainer found the base state's mesh
    want, got, shard = t["losses"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(shard, want, rtol=1e-5)
    assert t["moved"] > 1e-3  # the steps changed the LoRA and head
    # the same updated LoRA factors and head, replicated (default) or by shard_state's rule
    assert t["replicated"] <= 1e-5 and t["shard_state"] <= 1e-5
    assert t["on_mesh"] == [True, True]
    assert t["split_leaves"][0] == 0 < t["split_leaves"][1]
    assert t["compiled"][1] <= 2 and t["compiled"][2] <= 2, t["compiled"]


@pytest.mark.slow  # (the same child)
def test_vision_suite_on_a_mesh_matches_one_device(suites_found):
    f = suites_found["clip"]
    if f is None:
        pytest.skip("torch and transformers write the tiny CLIP folder")
    assert f["model_devices"] == DEVICES and f["key"] == DEVICES
    for where in ("placement", "loaded_placement"):
        p = f[where]
        assert not p["bad"], p["bad"]
        assert p["big"] == p["split_exactly"] > 0
    assert f["sharded"] == f["placement"]["big"]
    assert f["features"] <= 1e-5 and f["loaded_features"] <= 1e-5


# ---------------------------------------------------------------------- in this process


def test_bad_input_is_refused_with_a_clear_error():
    dev = jax.local_devices()[0]
    with pytest.raises(InputError, match=r"sharding\.model_mesh: no devices given"):
        sharding.model_mesh([])
    with pytest.raises(InputError, match=r"sharding\.model_mesh: devices=0; this process has 1"):
        sharding.model_mesh(0)
    with pytest.raises(InputError, match=r"sharding\.model_mesh: devices=2; this process has 1"):
        sharding.model_mesh(2)
    with pytest.raises(InputTypeError, match=r"sharding\.model_mesh: devices holds a str \('cpu'"):
        sharding.model_mesh(["cpu"])
    with pytest.raises(InputTypeError, match=r"sharding\.model_mesh: devices is a str; expected"):
        sharding.model_mesh("cpu")
    with pytest.raises(InputError, match=r"sharding\.model_mesh: device .* is given 2 times"):
        sharding.model_mesh([dev, dev])
    with pytest.raises(InputTypeError, match=r"sharding\.model_mesh: axis=''; expected"):
        sharding.model_mesh(axis="")
    model = nnx.eval_shape(lambda: llama.Llama(LLAMA, rngs=nnx.Rngs(0)))
    mesh = sharding.model_mesh()
    with pytest.raises(InputTypeError, match=r"sharding\.shard_model: mesh is a list; expected a"):
        sharding.shard_model(model, jax.devices())
    two = jax.sharding.Mesh(np.array([dev]).reshape(1, 1), ("a", "b"))
    with pytest.raises(InputError, match=r"sharding\.shard_model: mesh has axes \('a', 'b'\)"):
        sharding.shard_model(model, two)
    with pytest.raises(
        InputTypeError, match=r"sharding\.shard_model: model is a dict; expected an"
    ):
        sharding.shard_model({"w": np.zeros(3)}, mesh)
    with pytest.raises(InputError, match=r"sharding\.shard_model: min_bytes=-1; expected 0 or"):
        sharding.shard_model(model, mesh, min_bytes=-1)
    with pytest.raises(InputTypeError, match=r"sharding\.shard_state: min_bytes is a float"):
        sharding.shard_state({}, mesh, min_bytes=1.5)
    with pytest.raises(InputError, match=r"shard_model: lm_head/kernel is a placeholder"):
        sharding.shard_model(model, mesh)  # an abstract model: nothing to place


def test_one_device_mesh_splits_nothing():
    state = {"w": np.ones((64, 64), np.float32), "b": np.ones(3, np.float32)}
    placed, summary = sharding.shard_state(state, sharding.model_mesh(1), min_bytes=0)
    assert summary.sharded == 0 and summary.replicated == 2
    assert summary.bytes_per_device == summary.total_bytes == 64 * 64 * 4 + 12
    np.testing.assert_array_equal(np.asarray(placed["w"]), state["w"])


def test_rule_prefers_column_and_row_axes_then_the_largest():
    spec = sharding.partition_spec

    def dims(path, shape, n=8, **kw):
        return tuple(spec(path, shape, int(np.prod(shape)) * 4, n, min_bytes=0, **kw))

    assert dims(("self_attn", "q_proj", "kernel"), (64, 16)) == (None, "model")  # d_out
    assert dims(("self_attn", "o_proj", "kernel"), (16, 64)) == ("model",)  # d_in
    assert dims(("mlp", "down_proj", "kernel"), (12, 64)) == (None, "model")  # d_in 12: next
    assert dims(("q_proj", "lora", "lora_a"), (64, 4)) == ("model",)
    assert dims(("o_proj", "lora", "lora_b"), (4, 64)) == (None, "model")
    assert dims(("embed_tokens", "embedding"), (96, 32)) == ("model",)  # the largest
    assert dims(("patch_embedding", "kernel"), (4, 4, 3, 32)) == (None, None, None, "model")
    assert dims(("w",), (16, 16), axis="x") == (None, "x")  # a tie: the last axis
    assert dims(("w",), (6, 10)) == ()  # no axis divides
    assert dims(("w",), (4,), n=8) == ()  # smaller than the mesh
    assert dims(("w",), (64, 64), n=1) == ()
    assert tuple(spec(("w",), (64, 64), 16384, 8)) == ()  # under MIN_BYTES (1 MiB)


def test_suites_refuse_a_bad_mesh_before_loading(tmp_path):
    from netutility_jax.experiments.suites import nli, vision

    gone = tmp_path / "no-model"  # never read: the mesh is checked first
    with pytest.raises(
        InputTypeError, match=r"NLISuite: mesh is a list; expected a jax\.sharding\.Mesh with one"
    ):
        nli.NLISuite(model_dir=gone, mesh=jax.devices())
    with pytest.raises(InputError, match=r"NLISuite: min_bytes=-1; expected 0 or more"):
        nli.NLISuite(model_dir=gone, mesh=sharding.model_mesh(), min_bytes=-1)
    two = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("a", "b"))
    with pytest.raises(InputError, match=r"VisionSuite: mesh has axes \('a', 'b'\)"):
        vision.VisionSuite(gone, gone, {}, mesh=two)
    with pytest.raises(InputTypeError, match=r"VisionSuite: mesh is a str"):
        vision.VisionSuite(gone, gone, {}, mesh="cpu")
    # the loaders themselves: the mesh before the folder
    from netutility_jax.experiments.models import clip

    with pytest.raises(
        InputTypeError, match=r"llama\.from_pretrained\(.*no-model'\): mesh is a str"
    ):
        llama.from_pretrained(gone, mesh="cpu")
    with pytest.raises(InputError, match=r"clip\.from_pretrained\(.*no-model'\): min_bytes=-1"):
        clip.from_pretrained(gone, mesh=sharding.model_mesh(), min_bytes=-1)


def test_nli_suite_on_a_one_device_mesh_records_its_placement(tmp_path):
    """``--model-devices 1`` (``nli.build(model_devices=1)``): the model placed by
    ``shard_model`` and by the loader, the same logits as without a mesh, the run's
    ``placement`` recorded, the job keys of one device unchanged."""
    import types

    from netutility_jax.experiments.models import llama_load, llama_model
    from netutility_jax.experiments.suites import nli, nli_toy

    model_dir, data_dir = nli_toy.write_toy(tmp_path, sizes={"train": 8, "validation": 4, "test": 4})
    plain = nli.NLISuite(model_dir=model_dir, data_dir=data_dir)
    suite = nli.build(model_dir=str(model_dir), data_dir=str(data_dir), model_devices=1)
    assert suite.mesh.size == suite.model_devices == 1 and plain.model_devices == 1
    assert suite.placement.devices == 1 and suite.placement.sharded == 0
    assert suite.placement.bytes_per_device == suite.placement.total_bytes
    cfg = nli.QUICK.train
    assert suite.eval_key(cfg) == plain.eval_key(cfg) and "model_devices" not in suite.eval_key(cfg)
    assert suite.description == plain.description
    fields = suite.report(types.SimpleNamespace(tasks=[])).fields(None)
    assert fields["placement"]["model_devices"] == 1
    assert fields["placement"]["platform"] == jax.local_devices()[0].platform
    assert fields["placement"]["total_bytes"] == suite.placement.total_bytes
    ids = np.array([[5, 6, 7, 8]], np.int32)
    mask = np.ones_like(ids)
    want = np.asarray(llama.last_token_logits(plain.model, ids, mask))
    np.testing.assert_array_equal(np.asarray(llama.last_token_logits(suite.model, ids, mask)), want)
    fn = "test"
    hf, tensors = llama_load.read_folder(model_dir, fn)
    f32 = jnp.float32
    opts = llama_model.ModelOptions(None, f32, f32, None)
    loaded = llama_load.build(fn, hf, tensors, "t", opts, mesh=sharding.model_mesh(1), min_bytes=0)
    np.testing.assert_array_equal(np.asarray(llama.last_token_logits(loaded, ids, mask)), want)
    with pytest.raises(InputTypeError, match=r"test: mesh is a str; expected a jax\.sharding"):
        llama_load.build(fn, hf, tensors, "t", opts, mesh="cpu")
    # --min-bytes 0: recorded with the placement; one device's job keys still unchanged
    small = nli.build(
        model_dir=str(model_dir), data_dir=str(data_dir), model_devices=1, min_bytes=0
    )
    assert small.min_bytes == 0 and small.eval_key(cfg) == plain.eval_key(cfg)
    rec = small.report(types.SimpleNamespace(tasks=[])).fields(None)["placement"]
    assert rec["min_bytes"] == 0
    assert fields["placement"]["min_bytes"] == sharding.MIN_BYTES
    assert sharding.split_key(8, 0) == {"model_devices": 8, "min_bytes": 0}
    assert sharding.split_key(8, sharding.MIN_BYTES) == {"model_devices": 8}


def test_trainer_places_fresh_state_by_the_placer_given_or_the_base_mesh():
    from netutility_jax.experiments.harness import fitting as ft
    from netutility_jax.experiments.harness import trainer

    cfg = ft.TrainConfigBase(lora_rank=2, lora_alpha=2.0, learning_rate=1e-2, max_steps=2)
    base = {"w": jnp.ones((8, 8), jnp.float32)}
    plain = trainer.LoraTrainer(cfg, lambda s, b: jnp.sum(s["a"]), base)
    tree = {"a": np.ones(3, np.float32)}
    assert plain.mesh is None and plain.place(tree) is tree  # one device: left where it is
    # a base state on a one-device mesh is not sharded: nothing to follow
    on_one = sharding.shard_state(base, sharding.model_mesh(1), min_bytes=0)[0]
    assert trainer.base_mesh(on_one) is None and trainer.base_mesh(base) is None
    seen = []

    def place(t):
        seen.append(t)
        return sharding.shard_state(t, sharding.model_mesh(1))[0]

    given = trainer.LoraTrainer(cfg, lambda s, b: jnp.sum(s["a"]), base, place=place)
    out = given.place(tree)
    assert seen == [tree] and isinstance(out["a"], jax.Array)
    np.testing.assert_array_equal(np.asarray(out["a"]), tree["a"])


def test_docstring_examples():
    res = doctest.testmod(sharding, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["suites"]:
        print(json.dumps(suites_child(sys.argv[2], sys.argv[3])))
    else:
        print(json.dumps(child()))
