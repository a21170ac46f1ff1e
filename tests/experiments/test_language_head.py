"""The language suite in the paper's head formulation (``suites.language_head``).

The tiny random Llama, tokenizer and tasks of ``test_language``. References:

* the label space: each task's labels in the first slots, the rest ``nli_data.UNUSED``, its
  texts raw (a pair task's parts split at ``tasks.PAIR_SEP``), written out here;
* masked logits and loss over a five-slot space in float64 numpy;
* single-text encoding against the tokenizer's own ``encode``, cut to ``max_len``;
* (slow) a whole tiny run: single-LoRA, zero-shot and merged correctness recomputed by
  independent passes (each task's adapter and head; ``nu.merge_adapters``), the PEFT export
  read back, the caches;
* (slow) PEFT on transformers' ``LlamaForSequenceClassification`` (``num_labels`` = the slots)
  loading an exported adapter and head: the same logits as ours.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_language import (
    HF_WARNINGS,
    hf_env,
    random_adapter,
    random_model,
    save_hf_llama,
    tiny_config,
    tiny_tasks,
    tiny_tok,
)

import netutility_jax as nu
from netutility_jax.errors import InputError, InputTypeError
from netutility_jax.experiments.data import nli_data as nd
from netutility_jax.experiments.data import tasks as tk
from netutility_jax.experiments.harness import grid as gr
from netutility_jax.experiments.harness import suites
from netutility_jax.experiments.models import llama
from netutility_jax.experiments.suites import language, language_head
from netutility_jax.experiments.suites import nli_head as nh

__all__ = ["hf_env", "tiny_tok"]  # fixtures shared with test_language

TINY = nh.NLITrainConfig(
    lora_rank=4, lora_alpha=8.0, lora_dropout=0.1, rows=4, row_len=16, learning_rate=1e-2,
    warmup_fraction=0.06, max_steps=6, max_epochs=2, eval_every=3, patience=2, eval_tokens=128,
)  # fmt: skip
TINY_PRESET = gr.Preset(
    name="tiny",
    tasks=(),
    seeds=(0,),
    train=TINY,
    grid=dataclasses.replace(language_head.QUICK.grid, budgets=(4,)),
    max_train=12,
    n_val=4,
    n_test=6,
)


def three_way() -> tk.Task:
    """A third tiny task with three labels (a word's first letter: a-h, i-p, q-z)."""
    words = ["apple", "bread", "cat", "door", "egg", "fish", "goat", "hat", "ink", "jam", "kite",
             "lamp", "moon", "nest", "owl", "pen", "queen", "rose", "sun", "tree", "umbrella",
             "van", "wolf", "yak"]  # fmt: skip
    rows = [(w, 0 if w[0] <= "h" else 1 if w[0] <= "p" else 2) for w in words]
    order = np.random.default_rng(3).permutation(len(rows))
    rows = [rows[i] for i in order]

    def split(r):
        return tk.Split(tuple(t for t, _ in r), np.asarray([y for _, y in r], np.int32))

    return tk.Task("letters", ("early", "middle", "late"), split(rows[:12]), split(rows[12:18]),
                   split(rows[18:]))  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tiny_tok):
    return random_model(tiny_config(tiny_tok.vocab_size)), tiny_tok


# ------------------------------------------------------------------------------- label space


def test_unified_task_slots_texts_and_errors():
    mood, pairs = tiny_tasks()
    u = language_head.unified_task(pairs, 3)
    assert u.labels == ("slot 0", "slot 1", "slot 2") and u.name == "pairs" and u.pair
    assert u.label_texts == ("opposite", "synonym", nd.UNUSED)
    for a, b in zip(pairs.splits.values(), u.splits.values(), strict=True):
        assert list(b.texts) == [tuple(t.split(" ; ")) for t in a.texts]
        np.testing.assert_array_equal(b.labels, a.labels)
    m = language_head.unified_task(mood, 2)
    assert m.train.texts == mood.train.texts and m.label_texts == mood.labels
    assert language_head.slot_labels(2) == ("slot 0", "slot 1")
    with pytest.raises(InputError, match=r"task 'letters' has 3 labels \(early, middle, late\); "
                       r"the label space has 2 slots"):  # fmt: skip
        language_head.unified_task(three_way(), 2)
    broken = dataclasses.replace(pairs, train=tk.Split(("no separator",), np.zeros(1, np.int32)))
    with pytest.raises(InputError, match=r"'pairs' is a pair task but the text 'no separator'"):
        language_head.unified_task(broken, 2)
    with pytest.raises(InputTypeError, match=r"expected a tasks\.Task, got dict"):
        language_head.unified_task({}, 2)
    for bad in (1, True, 2.0):
        with pytest.raises(InputError, match="expected an integer >= 2"):
            language_head.slot_labels(bad)


def test_heads_share_one_label_space(tiny):
    model, tok = tiny
    tasks = [*tiny_tasks(), three_way()]
    suite = language_head.LanguageHeadSuite(model, tok)
    heads = suite.heads(tasks)
    assert [h.used for h in heads] == [(True, True, False)] * 2 + [(True, True, True)]
    assert heads[1].names == ("opposite", "synonym", nd.UNUSED)
    np.testing.assert_array_equal(nh.used_mask(heads), [[1, 1, 0], [1, 1, 0], [1, 1, 1]])
    wide = language_head.LanguageHeadSuite(model, tok, num_classes=5)
    assert [len(h.used) for h in wide.heads(tasks)] == [5, 5, 5]
    with pytest.raises(InputError, match=r"must share one label space; they have \{'a': 2, 'b': 3"):
        nh.num_classes([nh.HeadSpec("a", (True, True), ("x", "y")),
                        nh.HeadSpec("b", (True, True, False), ("x", "y", nd.UNUSED))])  # fmt: skip
    with pytest.raises(InputError, match=r"task 'mood' has labels \['negative', 'positive'\]; "
                       r"the suite's tasks share the label space \['slot 0'"):  # fmt: skip
        nh.head_spec(tiny_tasks()[0], language_head.slot_labels(2))
    with pytest.raises(InputError, match="pass both model and tokenizer, or neither"):
        language_head.LanguageHeadSuite(model)
    with pytest.raises(InputTypeError, match="config is a LanguageTrainConfig; expected"):
        suite.train_tasks(tasks, heads, language.QUICK.train, cache_dir="unused")
    members = [m for m in dir(suites.Suite) if not m.startswith("_") and m != "name"]
    assert all(hasattr(suite, m) for m in members)
    spec = suites.get("language_head")
    assert spec.preset(None, quick=True) is language_head.QUICK
    assert spec.preset(None, quick=False) is language_head.FULL


def test_single_texts_encode_as_the_tokenizer_does(tiny):
    _, tok = tiny
    texts = ["good day", "awful trip", "kind", "lovely lovely lovely lovely song"]
    enc = nh.encode_pairs(tok, texts, max_len=5)
    for i, t in enumerate(texts):
        assert enc.row(i).tolist() == tok.encode(t)[:5], t
    mixed = nh.encode_pairs(tok, ["good day", ("day", "large")], max_len=16)
    assert mixed.row(0).tolist() == tok.encode("good day")
    assert mixed.row(1).tolist() == tok.encode("day") + tok.encode("large")


def test_masked_logits_and_loss_in_a_five_slot_space_float64():
    rng = np.random.default_rng(1)
    b, d, c = 10, 8, 5
    pooled = rng.normal(size=(b, d)).astype(np.float32)
    scores = rng.normal(size=(2, d, c)).astype(np.float32)
    heads = [
        nh.HeadSpec("x", (True, True, False, False, False), ("a", "b", *[nd.UNUSED] * 3)),
        nh.HeadSpec("y", (True, True, True, True, False), ("a", "b", "c", "d", nd.UNUSED)),
    ]
    used = nh.used_mask(heads)
    head = (np.arange(b) % 2).astype(np.int32)
    labels = np.where(head == 0, np.arange(b) % 2, np.arange(b) % 4).astype(np.int32)
    valid = np.ones(b, bool)
    z = np.asarray(jax.jit(nh.class_logits)(pooled, scores, head, used))
    raw = np.einsum("bd,bdc->bc", pooled.astype(np.float64), scores[head].astype(np.float64))
    np.testing.assert_allclose(z, np.where(used[head], raw, nh.MASK_LOGIT), rtol=1e-5, atol=1e-5)
    ce = []
    for i in range(b):
        zz = raw[i, used[head[i]]]
        ce.append(np.log(np.exp(zz - zz.max()).sum()) + zz.max() - zz[labels[i]])
    loss = jax.jit(nh.masked_loss)(jnp.asarray(z), labels, valid)
    np.testing.assert_allclose(float(loss), np.mean(ce), rtol=1e-5)


def test_evaluator_and_trainer_check_the_class_count(tiny):
    model, tok = tiny
    tasks = [*tiny_tasks(), three_way()]
    suite = language_head.LanguageHeadSuite(model, tok)
    heads = suite.heads(tasks)
    val, test = suite.eval_sets(tasks, heads, TINY)
    assert val.task_names == ("mood", "pairs", "letters") and len(val) == 16 + 16 + 6
    d = model.config.hidden_size
    with pytest.raises(InputError, match=rf"heads of shape \({d}, 2\); expected \({d}, 3\)"):
        nh.Evaluator(suite.scorer, [{}] * 3, [np.zeros((d, 2))] * 3, val, test)
    with pytest.raises(InputError, match="num_classes=1; expected an integer >= 2"):
        nh.Trainer(TINY, model, tok, num_classes=1)
    trainer = nh.Trainer(TINY, model, tok, num_classes=2)
    with pytest.raises(InputError, match=r"'letters''s head reads 3 classes; the trainer's heads "
                       r"have 2"):  # fmt: skip
        trainer.fit(suite.unified(tasks)[2], heads[2])


# ------------------------------------------------------------------------------- end to end


@pytest.mark.slow  # ~40 s: two tiny trainings, a grid of four merges, a cached rerun
def test_end_to_end_tiny_run_matches_independent_passes(tiny, tmp_path):
    model, tok = tiny
    tasks = [tiny_tasks()[0], three_way()]
    suite = language_head.LanguageHeadSuite(model, tok)
    kw = dict(suite=suite, task_list=tasks, cache_dir=tmp_path / "cache", progress=False)
    lines: list[str] = []
    res = language_head.run(TINY_PRESET, out=tmp_path / "out", log=lines.append, **kw)
    run_ = res.run
    (s,) = run_.seeds
    jobs = [j.key for j in run_.jobs]
    assert jobs == ["ta/full/R4/uniform", "ta/full/R4/net_utility", "ties/full/R4/uniform",
                    "ties/full/R4/net_utility"]  # fmt: skip
    trained = nh.train_tasks(
        suite.unified(tasks),
        run_.heads,
        TINY,
        model=model,
        tokenizer=tok,
        weights=suite.weights,
        cache_dir=tmp_path / "cache" / "language_head",
        progress=False,
        suite="language_head",
    )  # fmt: skip (from the cache)
    assert all(t.info["cache_hit"] for t in trained)
    assert [t.score.shape for t in trained] == [(model.config.hidden_size, 3)] * 2
    assert [t.info["steps"] for t in trained] == [6, 6]
    # the shared initialisation (the paper's): every task starts from the same A and head
    init = nh.Trainer(TINY, model, tok, num_classes=3)
    a, b = init.init("mood"), init.init("letters")
    np.testing.assert_array_equal(np.asarray(a["score"]), np.asarray(b["score"]))
    # single-LoRA and zero-shot (trained heads, no LoRA) accuracies from independent passes
    scores = np.stack([t.score for t in trained])
    used = nh.used_mask(run_.heads)
    for i, t in enumerate(tasks):
        sub = run_.test.only(i)
        single = suite.scorer.correct(sub, scores, used, trained[i].adapter)
        assert s.single_test[t.name] == float(single.mean())
        assert s.zero_shot_test[t.name] == float(suite.scorer.correct(sub, scores, used).mean())
    # the mood task's third slot is masked: never predicted
    z = suite.scorer.logits(run_.test, scores, used, trained[0].adapter)
    assert (z[run_.test.rows(0), 2] == nh.MASK_LOGIT).all()
    for key, rec in s.records.items():
        spec = gr.METHODS[rec["method"]]
        merged, _ = nu.merge_adapters(
            [t.adapter for t in trained], budget=4, method=spec.method,
            allocation=rec["allocation"], alpha="auto", **dict(spec.options),
        )  # fmt: skip
        want = suite.scorer.correct(run_.test, scores, used, merged, rec["coef"])
        np.testing.assert_array_equal(s.correct[key], want, err_msg=key)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["suite"] == "language_head" and results["train_config"]["init"] == "shared"
    assert "sequence classification (the paper's App. B)" in results["evaluation"]["formulation"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert md.startswith("# netutility demo --suite language_head (tiny)")
    assert "letters: 0 early, 1 middle, 2 late" in md and "3 numbered slots" in md
    # the adapters with their heads as PEFT folders, read back
    dirs = language_head.export_adapters(run_, tmp_path / "peft", cache_dir=tmp_path / "cache")
    assert [p.relative_to(tmp_path / "peft").as_posix() for p in dirs] == [
        "seed0/mood", "seed0/letters"
    ]  # fmt: skip
    back, w = nh.load_peft(dirs[1])
    np.testing.assert_array_equal(w, trained[1].score)
    for name, m in back.items():
        np.testing.assert_allclose(nu.module_update(m), nu.module_update(trained[1].adapter[name]),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    again = language_head.run(TINY_PRESET, log=lines.append, render_report=False, **kw)
    (s2,) = again.run.seeds
    assert all(r["cache_hit"] for r in s2.records.values())
    for key in jobs:
        np.testing.assert_array_equal(s2.correct[key], s.correct[key])


@pytest.mark.slow  # ~20 s: transformers and PEFT
@HF_WARNINGS
def test_export_loads_on_llama_for_sequence_classification(hf_env, tiny_tok, tmp_path):
    """An adapter and a five-slot head exported by ``nli_head.export_peft``, loaded by
    ``PeftModel.from_pretrained`` on transformers' ``LlamaForSequenceClassification``: its
    logits are ours (before masking)."""
    torch, transformers, peft = hf_env
    folder = tmp_path / "base"
    save_hf_llama(hf_env, tiny_tok, folder, seed=1, pad_token_id=tiny_tok.pad_id)
    model = llama.from_pretrained(folder).model
    scorer = nh.Scorer(model)
    adapter = random_adapter(scorer.folder, 4, seed=0, scale=2.0)
    rng = np.random.default_rng(0)
    score = rng.normal(scale=0.5, size=(32, 5)).astype(np.float32)
    texts = ["good day", "awful trip", ("day", "large"), "kind song"]
    head = nh.HeadSpec("t", (True,) * 5, tuple("abcde"))
    split = tk.Split(tuple(texts), np.zeros(len(texts), np.int32))
    ds = nh.make_set(tiny_tok, [head], [split], max_len=16)
    ours = scorer.logits(ds, score[None], nh.used_mask([head]), adapter)
    nh.export_peft(nh.HeadedTask("t", tuple("abcde"), adapter, {}, score), tmp_path / "t")
    base = transformers.LlamaForSequenceClassification.from_pretrained(
        folder, num_labels=5, pad_token_id=tiny_tok.pad_id, dtype=torch.float32
    )
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "t").eval()
    with torch.no_grad():
        for i, t in enumerate(texts):
            ids = tiny_tok.encode(t) if isinstance(t, str) else nh.encode_pairs(
                tiny_tok, [t], max_len=16).row(0).tolist()  # fmt: skip
            want = loaded(input_ids=torch.tensor([ids])).logits[0].double().numpy()
            np.testing.assert_allclose(ours[i], want, atol=5e-5, rtol=1e-5, err_msg=str(t))
    plain = scorer.logits(ds, score[None], nh.used_mask([head]))
    assert np.abs(plain - ours).max() > 0.05  # the adapter matters
