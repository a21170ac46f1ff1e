"""The NLI suite: dataset readers, the classification head, masking, dropout, PEFT, the suite.

References and peers:

* readers: tiny files written here in each format (parquet, jsonl, json, csv, GLUE tsv,
  SciTail's headerless tsv) with each dataset's hub fields, checked against the pairs and the
  unified labels written;
* masking: the masked logits, their cross-entropy and its gradients against numpy float64 (a
  masked class is never predicted, takes no probability and gets no gradient);
* the head: transformers' ``Qwen3ForSequenceClassification`` (last non-pad token, ``score``
  without bias) on a tiny random Qwen3 (hidden 32, 2 layers) saved by ``save_pretrained`` and
  loaded by ``llama.from_pretrained``; pair encoding against transformers' fast tokenizer;
* export: ``peft.PeftModel.from_pretrained`` on ``Qwen3ForSequenceClassification`` loads the
  folder ``nli_head.export_peft`` writes (LoRA + ``score`` in ``modules_to_save``) and gives our
  logits; its keys are those PEFT's own ``save_pretrained`` writes;
* the schedule: transformers' ``get_linear_schedule_with_warmup``; clipping: torch's
  ``clip_grad_norm_`` rule in float64;
* end to end (slow): ``runner.run_experiment`` with :class:`nli.NLISuite` on ``nli_toy.write_toy``'s
  tiny Qwen3 and synthetic data, then from the cache, then rendered and exported.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import netutility_jax as nu
from netutility_jax.errors import InputError, MissingFileError
from netutility_jax.experiments.data import nli_data as nd
from netutility_jax.experiments.data import nli_tasks as nt
from netutility_jax.experiments.data import tasks as tk
from netutility_jax.experiments.harness import evaluate as ev_
from netutility_jax.experiments.harness import fitting as ft
from netutility_jax.experiments.harness import grid as gr
from netutility_jax.experiments.harness import runner, suites
from netutility_jax.experiments.models import llama
from netutility_jax.experiments.models.minilm import LoRALinear
from netutility_jax.experiments.suites import nli
from netutility_jax.experiments.suites import nli_head as nh

# transformers' PreTrainedModel.is_gradient_checkpointing, which PEFT calls when wrapping a model,
# emits this deprecation in transformers 5.x; it is not ours to fix (as in test_llama.py).
HF_WARNINGS = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)
HAVE_PYARROW = importlib.util.find_spec("pyarrow") is not None
ATOL = 1e-5


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """``nli_toy.write_toy``'s tiny Qwen3 folder and synthetic data, loaded."""
    folder = tmp_path_factory.mktemp("toy")
    assert nli.main(["--write-toy", str(folder)]) == 0
    model_dir, data_dir = folder / "model", folder / "data"
    model, tok, _ = llama.from_pretrained(model_dir)
    return model_dir, data_dir, model, tok


@pytest.fixture(scope="module")
def hf_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        torch = pytest.importorskip("torch", reason="torch is needed for the transformers peer")
        transformers = pytest.importorskip(
            "transformers", reason="transformers is needed as the reference"
        )
        yield torch, transformers


@pytest.fixture(scope="module")
def hf_qwen(hf_env, toy, tmp_path_factory):
    """A tiny random ``Qwen3ForCausalLM`` (hidden 32, 2 layers) saved by transformers, with the
    toy tokenizer, and our model loaded from it."""
    torch, transformers = hf_env
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(toy[0] / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    cfg = transformers.Qwen3Config(
        vocab_size=backend.get_vocab_size(), hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=256,
        pad_token_id=fast.pad_token_id,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * z if name.endswith("norm.weight") else 0.3 * z)
    folder = tmp_path_factory.mktemp("hf_qwen")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    ours, tok, _ = llama.from_pretrained(folder)
    return folder, fast, ours, tok


def seq_cls(hf_env, folder, pad_id, score):
    """transformers' ``Qwen3ForSequenceClassification`` on ``folder`` with head ``score``
    ``(D, 3)``."""
    torch, transformers = hf_env
    m = transformers.Qwen3ForSequenceClassification.from_pretrained(
        folder, num_labels=3, pad_token_id=pad_id, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        m.score.weight.copy_(torch.tensor(np.asarray(score).T))
    return m


def hf_logits(hf_env, model, fast, pairs):
    """transformers' logits of ``pairs`` in one right-padded batch (its own pooling)."""
    torch, _ = hf_env
    enc = fast(
        [p for p, _ in pairs], [h for _, h in pairs], padding=True, truncation=True,
        max_length=64, return_tensors="pt",
    )  # fmt: skip
    with torch.no_grad():
        return model(**enc).logits.numpy()


PAIRS = [
    ("The cat runs in the park.", "The cat runs."),
    ("A dog sleeps at home.", "A dog does not sleep."),
    ("The woman reads in the garden every morning.", "The woman reads with a friend."),
    ("A boy swims.", "A boy swims in the rain on the beach at school in town."),
    ("The bird sings at school.", "The bird sings."),
]


def random_adapter(module_names, shapes, rng, rank=4, scale=0.5):
    return {
        n: {
            "lora_a": rng.normal(scale=0.3, size=(shapes[n][0], rank)).astype(np.float32),
            "lora_b": rng.normal(scale=0.3, size=(rank, shapes[n][1])).astype(np.float32),
            "scale": scale,
        }
        for n in module_names
    }


def heads3():
    """Three heads: a three-way task, a QNLI-like (class 1 masked), a SciTail-like (class 2)."""
    return [
        nh.HeadSpec("three", (True, True, True), nd.LABELS),
        nh.HeadSpec("binary", (True, False, True), ("entailment", nd.UNUSED, "not_entailment")),
        nh.HeadSpec("sci", (True, True, False), ("entails", "neutral", nd.UNUSED)),
    ]


# ------------------------------------------------------------------------------------- readers


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


READER_CASES = {
    # dataset, file, text, expected pairs and classes, dropped
    "snli-jsonl-hub": (
        "snli", "train.jsonl",
        jsonl([{"premise": "a", "hypothesis": "b", "label": 2},
               {"premise": "c", "hypothesis": "d", "label": -1},
               {"premise": "e", "hypothesis": "f", "label": 0}]),
        [("a", "b", 2), ("e", "f", 0)], 1,
    ),
    "snli-jsonl-original": (
        "snli", "train.jsonl",
        jsonl([{"sentence1": "a", "sentence2": "b", "gold_label": "neutral", "annotator_labels": []},
               {"sentence1": "c", "sentence2": "d", "gold_label": "-"}]),
        [("a", "b", 1)], 1,
    ),
    "mnli-json-array": (
        "mnli", "train.json",
        json.dumps([{"premise": "a", "hypothesis": "b", "label": 1, "idx": 0},
                    {"premise": "c", "hypothesis": "d", "label": 2, "idx": 1}]),
        [("a", "b", 1), ("c", "d", 2)], 0,
    ),
    "mnli-json-columns": (
        "mnli", "train.json", json.dumps({"premise": ["a"], "hypothesis": ["b"], "label": [0]}),
        [("a", "b", 0)], 0,
    ),
    "sick-csv-hub": (
        "sick", "train.csv",
        'pair_ID,sentence_A,sentence_B,label,relatedness_score\n1,"a, quoted",b,0,4.5\n2,c,d,2,1.0\n',
        [("a, quoted", "b", 0), ("c", "d", 2)], 0,
    ),
    "sick-tsv-original": (
        "sick", "train.tsv",
        "pair_ID\tsentence_A\tsentence_B\tentailment_label\n1\ta\tb\tNEUTRAL\n2\tc\td\tENTAILMENT\n",
        [("a", "b", 1), ("c", "d", 0)], 0,
    ),
    "qnli-csv": (
        "qnli", "train.csv", "question,sentence,label,idx\nq?,s,1,0\nr?,t,0,1\n",
        [("q?", "s", 2), ("r?", "t", 0)], 0,
    ),
    "rte-glue-tsv": (  # GLUE's files hold unbalanced quotes: read unquoted
        "rte", "train.tsv",
        'index\tsentence1\tsentence2\tlabel\n0\tHe said "no\tb\tnot_entailment\n1\tc\td\tentailment\n',
        [('He said "no', "b", 2), ("c", "d", 0)], 0,
    ),
    "rte-superglue-jsonl": (
        "rte", "train.jsonl", jsonl([{"premise": "a", "hypothesis": "b", "label": 1, "idx": 0}]),
        [("a", "b", 2)], 0,
    ),
    "scitail-headerless-tsv": (
        "scitail", "tsv_format/train.tsv", "a\tb\tentails\nc\td\tneutral\n",
        [("a", "b", 0), ("c", "d", 1)], 0,
    ),
    "scitail-snli-format": (
        "scitail", "snli_format/train.jsonl",
        jsonl([{"sentence1": "a", "sentence2": "b", "gold_label": "entailment",
                "sentence1_parse": "(x)"}]),
        [("a", "b", 0)], 0,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(READER_CASES))
def test_readers_formats_and_fields(tmp_path, case):
    name, rel, text, want, dropped = READER_CASES[case]
    write(tmp_path / name / rel, text)
    split, files, n_dropped = nd.read_split(tmp_path, name, ("train",))
    assert files == [tmp_path / name / rel]
    assert list(split.texts) == [(p, h) for p, h, _ in want]
    np.testing.assert_array_equal(split.labels, [y for _, _, y in want])
    assert split.labels.dtype == np.int32 and n_dropped == dropped


@pytest.mark.skipif(not HAVE_PYARROW, reason="pyarrow reads parquet (pip install pyarrow)")
def test_parquet_files_shards_and_hub_folders(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(rows, fields=("premise", "hypothesis", "label")):
        return pa.table({f: [r[i] for r in rows] for i, f in enumerate(fields)})

    # the hub's layout: plain_text/train-0000k-of-00002.parquet, read in shard order
    pq.write_table(
        table([("a", "b", 0), ("c", "d", -1)]),
        write(tmp_path / "snli/plain_text/x", "").parent / "train-00000-of-00002.parquet",
    )
    pq.write_table(table([("e", "f", 2)]),
                   tmp_path / "snli/plain_text/train-00001-of-00002.parquet")  # fmt: skip
    split, files, dropped = nd.read_split(tmp_path, "snli", ("train",))
    assert [f.name for f in files] == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    assert list(split.texts) == [("a", "b"), ("e", "f")] and dropped == 1
    np.testing.assert_array_equal(split.labels, [0, 2])
    # a single parquet file at the top wins over subfolders; QNLI's fields and mapping
    pq.write_table(table([("q?", "s", 1)], ("question", "sentence", "label")),
                   write(tmp_path / "qnli/x", "").parent / "validation.parquet")  # fmt: skip
    split, _, _ = nd.read_split(tmp_path, "qnli", ("validation",))
    assert list(split.texts) == [("q?", "s")] and split.labels.tolist() == [2]
    # SciTail: tsv_format is preferred over snli_format
    pq.write_table(
        table([("a", "b", "neutral")]),
        write(tmp_path / "scitail/tsv_format/x", "").parent / "test.parquet",
    )
    pq.write_table(table([("c", "d", "entailment")], ("sentence1", "sentence2", "gold_label")),
                   write(tmp_path / "scitail/snli_format/x", "").parent / "test.parquet")  # fmt: skip
    split, files, _ = nd.read_split(tmp_path, "scitail", ("test",))
    assert files[0].parent.name == "tsv_format" and split.labels.tolist() == [1]
    # a missing field names the file, the field and the fields present
    bad = tmp_path / "sick" / "train.parquet"
    pq.write_table(table([("a", "b", 0)], ("sentence_A", "text", "label")), write(bad, "").parent
                   / "train.parquet")  # fmt: skip
    with pytest.raises(nd.NLIDataError, match=r"missing 'sentence_B'; the file has the fields "
                       r"\['label', 'sentence_A', 'text'\]"):  # fmt: skip
        nd.read_split(tmp_path, "sick", ("train",))


def test_parquet_without_pyarrow_names_the_install(tmp_path, monkeypatch):
    write(tmp_path / "snli" / "train.parquet", "not read")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    msg = r"snli/train.parquet is a parquet file; reading it needs pyarrow. Install it with: pip"
    with pytest.raises(nd.NLIDataError, match=msg + r" install pyarrow"):
        nd.read_split(tmp_path, "snli", ("train",))
    with pytest.raises(nd.NLIDataError, match="pip install pyarrow"):
        nd.check_data(tmp_path, ["snli"])


def test_reader_errors_name_file_row_and_fields(tmp_path):
    f = write(tmp_path / "snli" / "train.jsonl", jsonl([{"premise": "a", "text": "b", "label": 0}]))
    with pytest.raises(
        nd.NLIDataError,
        match=rf"{f}: the snli reader needs the fields \(premise, hypothesis, label\) or "
        r"\(sentence1, sentence2, gold_label\); missing 'hypothesis'; the file has the fields "
        r"\['label', 'premise', 'text'\]",
    ):
        nd.read_split(tmp_path, "snli", ("train",))
    write(f, jsonl([{"premise": "a", "hypothesis": "b", "label": 0}, {"premise": "c", "label": 0}]))
    with pytest.raises(nd.NLIDataError, match=r"record 2 lacks the field\(s\) \['hypothesis'\]"):
        nd.read_split(tmp_path, "snli", ("train",))
    g = write(tmp_path / "qnli" / "train.csv", "question,sentence,label\nq,s,2\n")
    with pytest.raises(
        nd.NLIDataError, match=rf"{g}, example 1: label='2' is not a qnli label; expected one of"
    ):
        nd.read_split(tmp_path, "qnli", ("train",))
    write(tmp_path / "rte" / "train.csv", "a,b\n")
    write(tmp_path / "rte" / "train.jsonl", "")
    with pytest.raises(nd.NLIDataError, match=r"holds split 'train' more than once"):
        nd.read_split(tmp_path, "rte", ("train",))
    for sub in ("one", "two"):
        write(tmp_path / "sick" / sub / "train.csv", "sentence_A,sentence_B,label\na,b,0\n")
    with pytest.raises(nd.NLIDataError, match=r"is in several subfolders of .*sick \(one, two\)"):
        nd.read_split(tmp_path, "sick", ("train",))
    with pytest.raises(MissingFileError, match=r"no folder .*mnli for dataset 'mnli'"):
        nd.read_split(tmp_path, "mnli", ("train",))
    with pytest.raises(nd.NLIDataError, match=r"unknown dataset 'anli'; the NLI suite reads snli"):
        nt.load_task(tmp_path, "anli")
    write(tmp_path / "scitail" / "train.tsv", "a\tb\tentails\n")
    with pytest.raises(MissingFileError, match=r"has no validation split in .*scitail: expected "
                       r"validation or dev"):  # fmt: skip
        nt.dataset_splits(tmp_path, "scitail")


def test_split_protocol_and_caps(toy):
    _, data, _, _ = toy
    # SNLI has a labelled test file: the official splits (rows without gold label dropped)
    s = nt.dataset_splits(data, "snli")
    assert s.protocol == "official"
    official_val, _, _ = nd.read_split(data, "snli", ("validation",))
    assert s.val.texts == official_val.texts
    # MNLI's test labels are hidden: test = validation_matched, validation held out of train
    m = nt.dataset_splits(data, "mnli")
    assert m.protocol == "validation_as_test"
    matched, files, _ = nd.read_split(data, "mnli", ("validation_matched",))
    assert m.test.texts == matched.texts and files[0].name == "validation_matched.json"
    train, _, _ = nd.read_split(data, "mnli", ("train",))
    assert len(m.val) == min(len(matched), len(train) // 10)
    assert len(m.train) + len(m.val) == len(train)
    assert sorted(m.train.texts + m.val.texts) == sorted(train.texts)  # a partition of train
    assert "held out" in m.sources["val"] and "hidden" in m.sources["test"]
    # RTE has no test file at all: the same protocol
    assert nt.dataset_splits(data, "rte").protocol == "validation_as_test"
    assert "no test file" in nt.dataset_splits(data, "rte").sources["test"]
    # the same draw every time; caps keep file order
    again = nt.dataset_splits(data, "mnli")
    assert again.val.texts == m.val.texts
    t = nt.load_task(data, "qnli", max_train=50, n_val=7, n_test=9)
    assert (len(t.train), len(t.val), len(t.test)) == (50, 7, 9)
    full = nt.load_task(data, "qnli")
    pos = {x: i for i, x in reversed(list(enumerate(full.train.texts)))}
    assert set(t.train.texts) <= set(pos) and len(set(full.train.texts)) > 50
    assert t.labels == nd.LABELS and t.label_texts == ("entailment", nd.UNUSED, "not_entailment")
    assert set(t.train.labels.tolist()) <= {0, 2} and t.pair
    sci = nt.load_task(data, "scitail")
    assert sci.label_texts == ("entails", "neutral", nd.UNUSED)
    assert set(sci.test.labels.tolist()) <= {0, 1}
    with pytest.raises(nd.NLIDataError, match=r"max_train=-1; expected an integer >= 0"):
        nt.load_task(data, "qnli", max_train=-1)


# ------------------------------------------------------------------------------------- masking


def test_masked_logits_loss_and_gradients_float64():
    rng = np.random.default_rng(0)
    b, d = 12, 16
    pooled = rng.normal(size=(b, d)).astype(np.float32)
    scores = rng.normal(size=(3, d, 3)).astype(np.float32)
    # the masked class of heads 1 and 2 would win every row unmasked
    pooled[:, 0] = 10.0
    scores[:, 0, :] = 0.0
    scores[1, 0, 1] = scores[2, 0, 2] = 100.0
    head = (np.arange(b) % 3).astype(np.int32)
    used = nh.used_mask(heads3())
    labels = np.asarray([[0, 1, 2][i % 3] if i % 3 == 0 else [0, 2][i % 2] if i % 3 == 1
                         else [0, 1][i % 2] for i in range(b)], np.int32)  # fmt: skip
    valid = np.arange(b) < 10
    z = np.asarray(jax.jit(nh.class_logits)(pooled, scores, head, used))
    # float64 reference: each row through its own head, the unused class at -1e10
    raw = np.einsum("bd,bdc->bc", pooled.astype(np.float64), scores[head].astype(np.float64))
    want = np.where(used[head], raw, nh.MASK_LOGIT)
    np.testing.assert_allclose(z, want, rtol=1e-5, atol=1e-5)
    assert (np.argmax(raw, 1)[head > 0] == head[head > 0]).all()  # unmasked, it would win
    pred = np.argmax(z, axis=1)
    assert not used[head, pred].__invert__().any()  # a masked class is never predicted
    # the loss is the cross-entropy over the used classes only
    ce = []
    for i in range(b):
        u = used[head[i]]
        zz = raw[i, u]
        lp = zz - zz.max() - np.log(np.exp(zz - zz.max()).sum())
        ce.append(-lp[list(np.flatnonzero(u)).index(labels[i])])
    ref = np.sum(np.asarray(ce) * valid) / valid.sum()
    loss = jax.jit(nh.masked_loss)(jnp.asarray(z), labels, valid)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)

    # gradients: none for a masked class's head column, and d loss / d pooled from used classes
    def f(pooled, scores):
        return nh.masked_loss(nh.class_logits(pooled, scores, head, used), labels, valid)

    gp, gs = jax.jit(jax.grad(f, argnums=(0, 1)))(jnp.asarray(pooled), jnp.asarray(scores))
    gs = np.asarray(gs)
    assert not gs[1, :, 1].any() and not gs[2, :, 2].any()
    assert np.abs(gs[0]).min() > 0 or np.abs(gs[0]).max() > 0
    p = np.zeros((b, 3))
    for i in range(b):
        u = used[head[i]]
        e = np.exp(raw[i, u] - raw[i, u].max())
        p[i, u] = e / e.sum()
    onehot = np.eye(3)[labels]
    dz = (p - onehot) * valid[:, None] / valid.sum()
    want_gp = np.einsum("bc,bdc->bd", dz, scores[head].astype(np.float64))
    np.testing.assert_allclose(np.asarray(gp), want_gp, rtol=1e-4, atol=1e-7)


def test_clip_gradient_is_torchs_global_norm_rule():
    rng = np.random.default_rng(1)
    tree = {"a": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.asarray(
        rng.normal(size=5), jnp.float32)}  # fmt: skip
    w = {k: np.asarray(rng.normal(size=v.shape)) for k, v in tree.items()}

    def loss(t, max_norm):
        t = nh.clip_gradient(t, max_norm)
        return sum(jnp.sum(t[k] * jnp.asarray(w[k], jnp.float32)) for k in t)

    for max_norm in (0.5, 100.0):
        g = jax.grad(loss)(tree, max_norm)
        norm = np.sqrt(sum((v**2).sum() for v in w.values()))
        coef = min(max_norm / (norm + 1e-6), 1.0)
        for k in w:
            np.testing.assert_allclose(np.asarray(g[k]), coef * w[k], rtol=1e-5)
    assert float(loss(tree, 0.5)) == pytest.approx(float(loss(tree, 100.0)))  # forward: identity


def test_schedule_is_transformers_linear_with_warmup(hf_env):
    torch, transformers = hf_env
    cfg = nh.NLITrainConfig(max_steps=50, learning_rate=3e-5, warmup_fraction=0.06)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-5)
    sched = transformers.get_linear_schedule_with_warmup(opt, 3, 50)  # ceil(0.06 * 50) = 3
    want = []
    for _ in range(50):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    got = [float(cfg.schedule()(s)) for s in range(50)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)
    assert cfg.steps_for(100) == 50 and nh.NLITrainConfig(rows=8).steps_for(100) == 130
    with pytest.raises(InputError, match=r"lora_dropout=1.0; expected 0 <= p < 1"):
        nh.NLITrainConfig(lora_dropout=1.0)


def test_paper_preset_is_table_3_and_table_2():
    p = nli.PAPER
    c = p.train
    assert (c.lora_rank, c.lora_alpha, c.lora_dropout, c.rows, c.row_len) == (
        16,
        16.0,
        0.1,
        1,
        2000,
    )
    assert (c.learning_rate, c.warmup_fraction, c.max_epochs) == (3e-5, 0.06, 10)
    assert (c.eval_every, c.patience, c.max_steps) == (4000, 3, nh.NO_STEP_CAP)
    assert p.tasks == nd.NAMES and (p.max_train, p.n_val, p.n_test) == (0, 0, 0)
    jobs = gr.grid_jobs(p.grid, full_capacity=6 * 16)
    keys = {j.key for j in jobs}
    for r in (64, 32, 16):
        for a in ("uniform", "net_utility"):
            assert f"ta/full/R{r}/{a}" in keys
            for m in ("dare", "ties"):
                assert {f"{m}/{sp}/R{r}/{a}" for sp in ("full", "core", "knots")} <= keys
            # TSV is the same merge in full and Core space (run once, reported for both)
            assert {f"tsv/full/R{r}/{a}", f"tsv/knots/R{r}/{a}"} <= keys
    assert {j.key for j in jobs if j.method.startswith("iso")} == {
        f"{m}/full/R16/{a}" for m in ("iso_c", "iso_c_tsv") for a in ("uniform", "net_utility")
    }
    assert nli.PRESETS["quick"] is nli.QUICK and set(nli.presets()) == {"quick", "paper"}


# ---------------------------------------------------------------------------- encoding, head


def test_pair_encoding_matches_transformers(hf_env, toy):
    _, transformers = hf_env
    model_dir, _, _, tok = toy
    fast = transformers.AutoTokenizer.from_pretrained(model_dir)
    premises, hyps = [p for p, _ in PAIRS], [h for _, h in PAIRS]
    for max_len in (64, 12, 7):
        enc = nh.encode_pairs(tok, PAIRS, max_len=max_len)
        want = fast(premises, hyps, truncation=True, max_length=max_len)["input_ids"]
        assert [enc.row(i).tolist() for i in range(len(PAIRS))] == want, max_len
    assert nh.encode_pairs(tok, PAIRS, max_len=7).lengths.max() == 7
    assert [nh.bucket_len(n) for n in (1, 16, 17, 24, 25, 33, 49, 97, 2000)] == [
        16, 16, 24, 24, 32, 48, 64, 128, 2048,
    ]  # fmt: skip


def test_set_batches_cover_every_pair_once(toy):
    _, data, _, tok = toy
    tasks = [nt.load_task(data, n, n_val=20, n_test=30) for n in ("snli", "qnli")]
    heads = [nh.head_spec(t) for t in tasks]
    ds = nh.make_set(tok, heads, [t.test for t in tasks], max_len=24, eval_tokens=128)
    seen = []
    for b in ds.batches:
        t = b.ids.shape[1]
        assert t == nh.bucket_len(t) and b.ids.shape[0] == max(1 << (128 // t).bit_length() >> 1, 1)
        for r, i in enumerate(b.index):
            if i < 0:
                assert not b.mask[r].any()
                continue
            seen.append(int(i))
            n = int(ds.lengths[i])
            assert b.mask[r, :n].all() and not b.mask[r, n:].any()
            np.testing.assert_array_equal(b.ids[r, :n], ds.ids[i, :n])
    assert sorted(seen) == list(range(len(ds)))
    assert ds.lengths.max() <= 24 and ds.tokens == ds.lengths.sum()
    only = ds.only("qnli")
    assert only.task_names == ("qnli",) and set(only.head.tolist()) == {1}
    np.testing.assert_array_equal(only.labels, tasks[1].test.labels)
    with pytest.raises(
        InputError, match=r"task 'qnli' has an example of class 1 but its head uses"
    ):
        nh.make_set(tok, heads, [tasks[0].test, tasks[0].test], max_len=24)
    bad = tk.Task("x", ("a", "b"), tasks[0].train, tasks[0].val, tasks[0].test)
    with pytest.raises(InputError, match=r"task 'x' has labels \['a', 'b'\]; the NLI suite's"):
        nh.head_spec(bad)


@pytest.mark.slow
def test_head_matches_transformers_qwen3_for_sequence_classification(hf_env, hf_qwen):
    folder, fast, model, tok = hf_qwen
    rng = np.random.default_rng(0)
    scores = rng.normal(scale=0.5, size=(3, model.config.hidden_size, 3)).astype(np.float32)
    heads = heads3()
    splits = [tk.Split(tuple(PAIRS), np.zeros(len(PAIRS), np.int32)) for _ in heads]
    ds = nh.make_set(tok, heads, splits, max_len=64, eval_tokens=64)
    assert len(ds.shapes) > 1  # several length buckets and batch sizes
    scorer = nh.Scorer(model)
    got = scorer.logits(ds, scores, nh.used_mask(heads))
    for t, h in enumerate(heads):
        hf = seq_cls(hf_env, folder, fast.pad_token_id, scores[t])
        want = hf_logits(hf_env, hf, fast, PAIRS)
        rows = ds.rows(t)
        assert np.abs(want).max() > 0.5  # not trivially small
        raw = got[rows]
        np.testing.assert_allclose(
            raw[:, list(h.used)], want[:, list(h.used)], atol=ATOL, rtol=1e-5
        )
        assert (raw[:, ~np.asarray(h.used)] == nh.MASK_LOGIT).all()
    assert scorer.timing()["passes"] == 1 and scorer.timing()["tokens"] == ds.tokens


@pytest.mark.slow
@HF_WARNINGS
def test_peft_export_loads_on_qwen3_for_sequence_classification(hf_env, hf_qwen, tmp_path):
    torch, transformers = hf_env
    peft = pytest.importorskip("peft", reason="peft is the adapter reference")
    folder, fast, model, tok = hf_qwen
    scorer = nh.Scorer(model)
    shapes = dict(scorer.folder._shapes)
    rng = np.random.default_rng(3)
    adapters = [random_adapter(scorer.module_names, shapes, rng) for _ in range(2)]
    scores = [rng.normal(scale=0.5, size=(model.config.hidden_size, 3)).astype(np.float32)
              for _ in range(2)]  # fmt: skip
    trained = [
        nh.HeadedTask(n, nd.LABELS, a, {}, s)
        for n, a, s in zip(("t0", "t1"), adapters, scores, strict=True)
    ]
    cfg = nh.export_peft(trained[0], tmp_path / "t0", base_model_name_or_path="tiny")
    assert cfg["modules_to_save"] == ["score"] and cfg["task_type"] == "SEQ_CLS"

    heads = [nh.HeadSpec("t0", (True, True, True), nd.LABELS)]
    ds = nh.make_set(tok, heads, [tk.Split(tuple(PAIRS), np.zeros(5, np.int32))], max_len=64)
    ours = scorer.logits(ds, scores[0][None], nh.used_mask(heads), adapters[0])
    base = transformers.Qwen3ForSequenceClassification.from_pretrained(
        folder, num_labels=3, pad_token_id=fast.pad_token_id, dtype=torch.float32
    )
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "t0").eval()
    want = hf_logits(hf_env, loaded, fast, PAIRS)
    np.testing.assert_allclose(ours, want, atol=ATOL, rtol=1e-5)
    plain = scorer.logits(ds, scores[0][None], nh.used_mask(heads))
    assert np.abs(plain - want).max() > 0.05  # the adapter matters

    # the same keys PEFT's own save_pretrained writes for a SEQ_CLS LoRA on q, k, v, o
    from safetensors.numpy import load_file

    own = peft.get_peft_model(
        transformers.Qwen3ForSequenceClassification.from_pretrained(
            folder, num_labels=3, pad_token_id=fast.pad_token_id
        ),
        peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=4,
                        target_modules=list(llama.LORA_TARGETS)),
    )  # fmt: skip
    own.save_pretrained(tmp_path / "peft_own")
    mine = load_file(str(tmp_path / "t0" / "adapter_model.safetensors"))
    theirs = load_file(str(tmp_path / "peft_own" / "adapter_model.safetensors"))
    assert set(mine) == set(theirs)
    assert mine["base_model.model.score.weight"].shape == (3, model.config.hidden_size)

    # round trip, and a merge exported once per task with that task's head
    back, w = nh.load_peft(tmp_path / "t0")
    np.testing.assert_allclose(w, scores[0], rtol=0, atol=0)
    for name, m in back.items():
        np.testing.assert_allclose(
            nu.module_update(m), nu.module_update(adapters[0][name]), rtol=1e-5, atol=1e-6
        )
    merged, _ = nu.merge_adapters(adapters, budget=4, method="tsv", space="full")
    paths = nh.export_merged(merged, trained, tmp_path / "merged")
    assert [p.name for p in paths] == ["t0", "t1"]
    for t, p in zip(trained, paths, strict=True):
        assert np.array_equal(nh.load_peft(p)[1], t.score)
    with pytest.raises(FileExistsError, match="exists and is not an empty folder"):
        nh.export_peft(trained[0], tmp_path / "t0")


# --------------------------------------------------------------------------------- dropout


def test_lora_dropout_layer_matches_numpy():
    layer = nh.DropoutLoRALinear(6, 5, lora_rank=3, lora_scale=2.0, lora_dropout=0.25,
                                 rngs=nnx.Rngs(0))  # fmt: skip
    rng = np.random.default_rng(0)
    layer.lora.lora_b.set_value(jnp.asarray(rng.normal(size=(3, 5)), jnp.float32))
    x = jnp.asarray(rng.normal(size=(4, 7, 6)), jnp.float32)
    key = jnp.asarray([7, 11], jnp.uint32)
    layer.dropout_key.set_value(key)
    call = nnx.jit(lambda lyr, x: lyr(x))
    y = np.asarray(call(layer, x))
    m = np.asarray(jax.random.bernoulli(key, 0.75, x.shape))
    assert 0 < m.mean() < 1
    k, bias = (np.asarray(v[...], np.float64) for v in (layer.kernel, layer.bias))
    a, b = (np.asarray(v[...], np.float64) for v in (layer.lora.lora_a, layer.lora.lora_b))
    xx = np.asarray(x, np.float64)
    want = xx @ k + bias + 2.0 * ((xx * m / 0.75) @ a @ b)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    # p = 0 is the plain scaled LoRA layer
    plain = LoRALinear(6, 5, lora_rank=3, lora_scale=2.0, rngs=nnx.Rngs(0))
    nodrop = nh.DropoutLoRALinear(6, 5, lora_rank=3, lora_scale=2.0, rngs=nnx.Rngs(0))
    for lyr in (plain, nodrop):
        lyr.lora.lora_b.set_value(layer.lora.lora_b[...])
    np.testing.assert_array_equal(np.asarray(call(plain, x)), np.asarray(call(nodrop, x)))


@pytest.mark.slow
def test_with_lora_dropout_keeps_names_and_base_outputs(toy):
    _, _, model, _ = toy
    lmodel = llama.add_lora(model, llama.LoRAConfig(4, 8.0), rngs=nnx.Rngs(1))
    names = list(nu.nnx.extract_adapter(lmodel))
    dmodel = nh.with_lora_dropout(lmodel, 0.5)
    assert list(nu.nnx.extract_adapter(dmodel)) == names
    n = sum(isinstance(m, nh.DropoutLoRALinear) for _, m in nnx.iter_modules(dmodel))
    assert n == len(names) == 2 * 4
    ids = jnp.asarray([[5, 9, 13, 2]], jnp.int32)
    mask = jnp.ones_like(ids)
    hidden = nnx.jit(lambda m, ids, mask: m.hidden_states(ids, mask))
    # B = 0: dropout on the LoRA branch's input changes nothing
    np.testing.assert_allclose(
        np.asarray(hidden(dmodel, ids, mask)), np.asarray(hidden(model, ids, mask)), atol=1e-6
    )


# -------------------------------------------------------------------------------- training


TINY = nh.NLITrainConfig(
    lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, rows=4, row_len=32, learning_rate=1e-2,
    warmup_fraction=0.0, max_steps=6, max_epochs=1, eval_every=3, patience=2, eval_tokens=256,
    max_grad_norm=0.0,
)  # fmt: skip


@pytest.mark.slow
def test_training_step_float64_loss_and_masked_column_untouched(toy):
    _, data, model, tok = toy
    task = nt.load_task(data, "qnli", max_train=16, n_val=8, n_test=8)
    head = nh.head_spec(task)
    trainer = nh.Trainer(dataclasses.replace(TINY, max_steps=20), model, tok)
    enc = nh.encode_pairs(tok, list(task.train.texts), max_len=32)
    labels = np.asarray(task.train.labels, np.int32)
    b = nh.train_batch(enc, labels, np.arange(4), rows=4, pad_id=0)
    params = trainer.init("qnli")
    score0 = np.asarray(params["score"])
    # B = 0: the LoRA model is the base model; the loss is float64 CE over the used classes
    pooled = np.asarray(nh.pool_last(model.hidden_states(b[0], b[1]), jnp.asarray(b[1])))
    z = pooled.astype(np.float64) @ score0.astype(np.float64)
    z = z[:, [0, 2]]
    lp = z - z.max(1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(1, keepdims=True))
    ref = -lp[np.arange(4), np.asarray(b[2]) // 2].mean()
    np.testing.assert_allclose(trainer.loss(params, head, *b), ref, rtol=1e-5)
    base_before = {p: np.array(v.get_value()) for p, v in nnx.to_flat_state(trainer.base_state)}
    tx, step = trainer._optimizer(20)
    opt = tx.init(params)
    losses = [trainer.loss(params, head, *b)]
    for i in range(6):
        params, opt, _ = step(params, opt, trainer.base_state, trainer.step_key("qnli", i), *b,
                              jnp.asarray(head.used))  # fmt: skip
        losses.append(trainer.loss(params, head, *b))
    assert losses[-1] < losses[0] - 0.05, losses
    score = np.asarray(params["score"])
    np.testing.assert_array_equal(score[:, 1], score0[:, 1])  # the masked class never moves
    assert np.abs(score[:, [0, 2]] - score0[:, [0, 2]]).max() > 0
    for p, v in nnx.to_flat_state(trainer.base_state):
        np.testing.assert_array_equal(np.asarray(v.get_value()), base_before[p], err_msg=str(p))
    # the same initial LoRA A and head for every task under init="shared" (the paper's regime)
    other = trainer.init("snli")
    np.testing.assert_array_equal(np.asarray(other["score"]), score0)


@pytest.mark.slow
def test_fit_cache_and_export(toy, tmp_path):
    _, data, model, tok = toy
    task = nt.load_task(data, "scitail", max_train=16, n_val=8, n_test=8)
    head = nh.head_spec(task)
    cfg = dataclasses.replace(TINY, lora_dropout=0.1, max_grad_norm=1.0)
    trainer = nh.Trainer(cfg, model, tok)
    kw = {"tokenizer": tok, "weights": "w", "dtype": "float32", "cache_dir": tmp_path / "c"}
    t = nh.train_task(task, head, cfg, trainer=trainer, **kw)
    assert isinstance(t, nh.HeadedTask) and not t.info["cache_hit"]
    assert t.info["steps"] == 4 and t.info["max_steps"] == 4  # 1 epoch of 16 pairs at 4 a step
    assert "score_head" not in t.info and t.score.shape == (model.config.hidden_size, 3)
    assert len(t.adapter) == 8 and {m["scale"] for m in t.adapter.values()} == {2.0}
    again = nh.train_task(task, head, cfg, **kw)  # no trainer: must come from the cache
    assert again.info["cache_hit"] and np.array_equal(again.score, t.score)
    for n in t.adapter:
        np.testing.assert_array_equal(again.adapter[n]["lora_b"], t.adapter[n]["lora_b"])
    with pytest.raises(InputError, match=r"'scitail' is not in the cache"):
        nh.train_task(task, head, dataclasses.replace(cfg, seed=1), **kw)
    path = ft.cache_path(tmp_path / "c", task, t.info["cache_key"])
    assert np.array_equal(nh.load_cached(path).score, t.score)


@pytest.mark.slow
def test_bfloat16_compute_close_to_float32(toy):
    _, data, model, tok = toy
    task = nt.load_task(data, "snli", max_train=8, n_val=8, n_test=16)
    heads = [nh.head_spec(task)]
    ds = nh.make_set(tok, heads, [task.test], max_len=32, eval_tokens=256)
    rng = np.random.default_rng(0)
    scorer = nh.Scorer(model)
    adapter = random_adapter(scorer.module_names, dict(scorer.folder._shapes), rng)
    scores = rng.normal(size=(1, model.config.hidden_size, 3)).astype(np.float32)
    used = nh.used_mask(heads)
    z32 = scorer.logits(ds, scores, used, adapter, 0.7)
    bf = llama.with_dtype(model, jnp.bfloat16)
    z16 = nh.Scorer(bf).logits(ds, scores, used, adapter, 0.7)
    assert z16.dtype == np.float32
    np.testing.assert_allclose(z16, z32, atol=0.05 * np.abs(z32).max())
    assert nli.NLISuite(model, tok, dtype=jnp.bfloat16).dtype == "bfloat16"
    # a bfloat16 training step with dropout: finite loss, float32 LoRA factors and head
    trainer = nh.Trainer(dataclasses.replace(TINY, lora_dropout=0.1), bf, tok)
    enc = nh.encode_pairs(tok, list(task.train.texts), max_len=32)
    b = nh.train_batch(enc, np.asarray(task.train.labels), np.arange(4), rows=4, pad_id=0)
    params = trainer.init("snli")
    tx, step = trainer._optimizer(6)
    params, _, loss = step(params, tx.init(params), trainer.base_state,
                           trainer.step_key("snli", 0), *b, jnp.asarray(heads[0].used))  # fmt: skip
    assert np.isfinite(float(loss))
    assert {np.dtype(x.dtype) for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}


@pytest.mark.slow
def test_toy_folder_is_a_transformers_qwen3(hf_env, toy):
    torch, transformers = hf_env
    model_dir, _, model, tok = toy
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = tok.encode("The cat runs in the park.")
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray([ids], jnp.int32)))[0]
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------- suite


def test_suite_declaration_and_wiring(toy, tmp_path):
    """The default-tier check of the suite: its declaration, its checks, and one evaluation of
    untrained adapters through the suite's sets and evaluator (each task with its own head)."""
    model_dir, data, model, tok = toy
    spec = nli.SPEC
    assert suites.get("nli") is spec  # registered by importing the module
    assert spec.name == "nli" and spec.flags == ("model_dir", "data_dir", "model_devices", "min_bytes")
    assert spec.preset(None, quick=False).name == "paper" and spec.preset(None, quick=True) is (
        nli.QUICK
    )
    with pytest.raises(nli.NLIUnavailable, match=r"needs --model-dir FOLDER .*--data-dir not"):
        spec.requires(model_dir=model_dir)
    with pytest.raises(
        nli.NLIUnavailable,
        match=r"--model-dir .*data has no config.json, tokenizer.json, \*.safetensors; the nli",
    ):
        spec.requires(model_dir=data, data_dir=data)
    with pytest.raises(nli.NLIUnavailable, match=r"holds none of the folders snli, mnli"):
        spec.requires(model_dir=model_dir, data_dir=tmp_path)
    spec.requires(model_dir=model_dir, data_dir=data)
    with pytest.raises(nli.NLIUnavailable, match=r"has no task 'anli'"):
        nli.load_tasks(["anli"], nli.QUICK, data_dir=data)

    suite = nli.NLISuite(model, tok, data_dir=data)
    assert isinstance(suite, suites.Suite)
    preset = nli.QUICK
    tasks, got = suite.load_tasks(dataclasses.replace(preset, n_val=8, n_test=12))
    assert isinstance(suite, suites.SuiteWithData) and got.n_val == 8
    heads = suite.heads(tasks)
    assert [h.used for h in heads] == [(True,) * 3, (True, False, True), (True, True, False)]
    val, test = suite.eval_sets(tasks, heads, preset.train)
    assert val.task_names == ("snli", "qnli", "scitail") and len(test) == 36
    rng = np.random.default_rng(0)
    shapes = dict(suite.scorer.folder._shapes)
    trained = [
        nh.HeadedTask(t.name, t.labels, random_adapter(suite.scorer.module_names, shapes, rng),
                      {"cache_key": f"k{i}"},
                      rng.normal(size=(model.config.hidden_size, 3)).astype(np.float32))
        for i, t in enumerate(tasks)
    ]  # fmt: skip
    ev = suite.evaluator(trained, heads, val, test, cache_dir=tmp_path / "cache")
    # single: each task's adapter and head on its own pairs
    for i, t in enumerate(tasks):
        sub = test.only(i)
        z = suite.scorer.logits(sub, ev.scores, ev.used, trained[i].adapter)
        assert ev.single_test[t.name] == pytest.approx(
            float((np.argmax(z, 1) == sub.labels).mean())
        )
    # a merge: one pass over every task's pairs, each read by its own head
    # a merge: task arithmetic written out (dense modules, as full-space merges return them)
    merged = {n: {"delta": sum(ev_.module_delta(t.adapter[n]) for t in trained)} for n in shapes}
    ok = ev.correct(test, merged, 0.5)
    for i in range(3):
        # task i's pairs alone, through its own head only
        sub = dataclasses.replace(test.only(i), head=np.zeros(len(test.rows(i)), np.int32))
        z = suite.scorer.logits(sub, ev.scores[i][None], ev.used[i][None], merged, 0.5)
        np.testing.assert_array_equal(ok[test.rows(i)], np.argmax(z, 1) == sub.labels)
    assert len(list((tmp_path / "cache" / "correct").glob("*.npz"))) == 4 * 3
    # another coefficient, the same shapes: nothing recompiles
    compiled = suite.scorer._pool._cache_size(), suite.scorer._classify._cache_size()
    ev.correct(test, merged, 0.7)
    assert (suite.scorer._pool._cache_size(), suite.scorer._classify._cache_size()) == compiled
    key = suite.eval_key(preset.train)
    assert key["suite"] == "nli" and key["dtype"] == "float32" and key["mask_logit"] == -1e10


@pytest.mark.slow
def test_end_to_end_quick_run_cached_rendered_exported(toy, tmp_path):
    _, data, model, tok = toy
    preset = dataclasses.replace(
        nli.QUICK,
        train=dataclasses.replace(nli.QUICK.train, max_epochs=1, eval_every=4),
        grid=gr.GridConfig(rows=(gr.Row("ta", "full"), gr.Row("ties", "full")), budgets=(16,),
                           full_capacity=False, weight_average=False),
        max_train=32, n_val=12, n_test=24,
    )  # fmt: skip
    suite = nli.NLISuite(model, tok, data_dir=data)
    tasks, preset = suite.load_tasks(preset)
    logs: list[str] = []
    run = runner.run_experiment(
        tasks, preset, suite=suite, cache_dir=tmp_path, progress=False, log=logs.append
    )
    assert run.suite == "nli" and len(run.seeds) == 1
    s = run.seeds[0]
    assert set(s.records) == {f"{m}/full/R16/{a}" for m in ("ta", "ties")
                              for a in ("uniform", "net_utility")}  # fmt: skip
    for r in s.records.values():
        assert np.isfinite(r["normalized"]) and not r["cache_hit"]
    assert all(not i["cache_hit"] and i["steps"] == 4 for i in s.training.values())
    assert any("trained 4 steps" in line for line in logs)
    assert (tmp_path / "nli" / "merges").is_dir()
    # a second run: everything from the caches, the same results
    again = runner.run_experiment(
        tasks, preset, suite=suite, cache_dir=tmp_path, progress=False, log=logs.append
    )
    s2 = again.seeds[0]
    assert all(i["cache_hit"] for i in s2.training.values())
    assert all(r["cache_hit"] for r in s2.records.values())
    for k in s.records:
        assert s2.records[k]["normalized"] == s.records[k]["normalized"]
    # rendered in the suite's wording; adapters exported with their heads
    from netutility_jax.experiments.harness import report

    exp = report.render(run, suite.report(run), command="test")
    assert exp.results["suite"] == "nli"
    assert exp.results["evaluation"]["mask_logit"] == -1e10
    assert "qnli: entailment <- entailment, neutral <- (unused)" in exp.markdown
    written = nli.export_adapters(run, tmp_path / "export", cache_dir=tmp_path)
    assert [p.name for p in written] == list(preset.tasks)
    adapter, score = nh.load_peft(written[1])
    assert score.shape == (model.config.hidden_size, 3) and len(adapter) == 8


@pytest.mark.slow
def test_demo_command_line_quick(toy, tmp_path, capsys):
    """``netutility demo --suite nli --quick --model-dir M --data-dir D`` on the toy setup (CI's
    run of the NLI suite's quick demo: the slow tier's, not a demo step of its own)."""
    from netutility_jax.experiments import demo

    model_dir, data, _, _ = toy
    argv = ["--suite", "nli", "--quick", "--out", str(tmp_path / "out"), "--cache-dir",
            str(tmp_path / "cache"), "--no-progress"]  # fmt: skip
    assert demo.main([*argv, "--model-dir", str(model_dir)]) == 2
    assert "--data-dir not given" in capsys.readouterr().err
    assert demo.main([*argv, "--model-dir", str(model_dir), "--data-dir", str(data)]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["suite"] == "nli" and results["preset"] == "quick"
    assert [t["name"] for t in results["tasks"]] == list(nli.QUICK.tasks)
    assert "# netutility demo --suite nli (quick)" in (tmp_path / "out" / "results.md").read_text()
