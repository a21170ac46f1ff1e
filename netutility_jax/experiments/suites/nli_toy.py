"""The NLI suite's toy setup: a tiny random Qwen3 folder and synthetic data, what CI runs on.

:func:`write_toy` writes it (``python -m netutility_jax.experiments.suites.nli --write-toy DIR``,
the suite module's entry point, calls it): a random ``Qwen3ForCausalLM`` with a byte-level BPE
``tokenizer.json`` trained on the synthetic text, and the six datasets of :mod:`nli_data` with
synthetic premise-hypothesis pairs in their hub formats and fields. Nothing here imports the
suite module (``python -m`` runs it once).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["write_toy"]

_WORDS = {
    "who": ["the cat", "a dog", "the man", "a girl", "the bird", "a child", "the woman", "a boy"],
    "act": ["runs", "sleeps", "eats", "sings", "jumps", "reads", "swims", "plays"],
    "where": ["in the park", "at home", "on the beach", "in the garden", "at school", "in town"],
    "extra": ["with a friend", "for an hour", "every morning", "in the rain", "very slowly"],
}
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _toy_pairs(rng: Any, n: int) -> list[tuple[str, str, int]]:
    """``n`` synthetic ``(premise, hypothesis, class)``: entailment repeats the premise's actor
    and act, contradiction negates it, neutral adds what the premise does not say."""
    out = []
    for _ in range(n):
        who, act, where = (rng.choice(_WORDS[k]) for k in ("who", "act", "where"))
        y = int(rng.integers(3))
        premise = f"{who.capitalize()} {act} {where}."
        if y == 0:
            hyp = f"{who.capitalize()} {act}."
        elif y == 2:
            hyp = f"{who.capitalize()} does not {act[:-1]}."
        else:
            hyp = f"{who.capitalize()} {act} {rng.choice(_WORDS['extra'])}."
        out.append((premise, hyp, y))
    return out


def _write_rows(path: pathlib.Path, fields: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(dict(zip(fields, r, strict=True))) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps([dict(zip(fields, r, strict=True)) for r in rows]))
    else:
        tsv = path.suffix == ".tsv"
        with path.open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, delimiter="\t" if tsv else ",", lineterminator="\n")
            if fields:
                w.writerow(fields)
            w.writerows(rows)


def _write_toy_data(data: pathlib.Path, rng: Any, sizes: Mapping[str, int]) -> None:
    """The six datasets in their hub formats (jsonl, json, csv, GLUE-style tsv, SciTail's
    headerless tsv), each split of ``sizes`` pairs; GLUE test files carry label -1 (hidden)."""
    for split, n in sizes.items():
        rows = _toy_pairs(rng, n)
        hidden = split == "test"
        # snli: jsonl with integer labels, a few without gold label (-1)
        snli = [(p, h, -1 if i % 17 == 5 else y) for i, (p, h, y) in enumerate(rows)]
        _write_rows(data / "snli" / f"{split}.jsonl", ("premise", "hypothesis", "label"), snli)
        # mnli: GLUE's parquet layout as json (validation_matched; hidden test labels)
        stem = {"validation": "validation_matched", "test": "test_matched"}.get(split, split)
        mnli = [(p, h, -1 if hidden else y, i) for i, (p, h, y) in enumerate(rows)]
        _write_rows(data / "mnli" / f"{stem}.json", ("premise", "hypothesis", "label", "idx"), mnli)
        # sick: csv with the hub's fields
        sick = [(i, p, h, y, 3.5) for i, (p, h, y) in enumerate(rows)]
        fields = ("pair_ID", "sentence_A", "sentence_B", "label", "relatedness_score")
        _write_rows(data / "sick" / f"{split}.csv", fields, sick)
        # qnli: csv, 0 = entailment, 1 = not_entailment
        qnli = [(f"What does {p[:-1]}?", h, -1 if hidden else int(y != 0), i) for i, (p, h, y) in
                enumerate(rows)]  # fmt: skip
        _write_rows(data / "qnli" / f"{split}.csv", ("question", "sentence", "label", "idx"), qnli)
        # rte: GLUE's original tsv, string labels
        rte = [(i, p, h, "entailment" if y == 0 else "not_entailment") for i, (p, h, y) in
               enumerate(rows)]  # fmt: skip
        if not hidden:
            _write_rows(
                data / "rte" / f"{split}.tsv", ("index", "sentence1", "sentence2", "label"), rte
            )
        # scitail: SciTail's own headerless tsv in the hub's tsv_format folder
        sci = [(p, h, "entails" if y == 0 else "neutral") for p, h, y in rows]
        _write_rows(data / "scitail" / "tsv_format" / f"{split}.tsv", (), sci)


def _toy_tokenizer(corpus: Sequence[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    return backend


def _write_toy_model(folder: pathlib.Path, backend: Any, seed: int) -> None:
    """A random ``Qwen3ForCausalLM`` folder (hidden 32, 2 layers, 4/2 heads of 8, tied head)."""
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file

    from ..models import llama

    vocab = backend.get_vocab_size()
    hf = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "pad_token_id": backend.token_to_id("<|endoftext|>"),
        "eos_token_id": backend.token_to_id("<|im_end|>"),
        "torch_dtype": "float32",
    }
    cfg = llama.LlamaConfig.from_hf(hf)
    model = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        shape = var.get_value().shape
        leaf = str(path[-1])
        value = (leaf == "scale") + rng.normal(scale=0.1 if leaf == "scale" else 0.3, size=shape)
        value = value.astype(np.float32)
        name = ".".join(map(str, path[:-1])) + (".weight" if leaf != "bias" else ".bias")
        tensors[name] = np.ascontiguousarray(value.T if leaf == "kernel" else value)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf, indent=1))
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "pad_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


def write_toy(
    folder: str | os.PathLike, *, seed: int = 0, sizes: Mapping[str, int] | None = None
) -> tuple[pathlib.Path, pathlib.Path]:
    """Write a tiny setup the NLI suite runs on in CI: ``(model_dir, data_dir)``.

    ``<folder>/model``: a random ``Qwen3ForCausalLM`` (hidden 32, 2 layers) with a byte-level BPE
    ``tokenizer.json`` trained on the synthetic text; ``<folder>/data``: the six datasets with
    synthetic pairs (:func:`_toy_pairs`) in their hub formats and fields (SNLI jsonl with some
    -1 labels, MNLI json with ``validation_matched`` and hidden test labels, SICK csv, QNLI csv,
    RTE GLUE tsv without a test file, SciTail headerless tsv under ``tsv_format/``); ``sizes``
    ``{"train": 200, "validation": 48, "test": 64}`` by default.
    """
    import numpy as np

    root = pathlib.Path(folder)
    sizes = dict(sizes or {"train": 200, "validation": 48, "test": 64})
    rng = np.random.default_rng(seed)
    data = root / "data"
    _write_toy_data(data, rng, sizes)
    corpus = [f"{p} {h}" for p, h, _ in _toy_pairs(np.random.default_rng(seed + 1), 400)]
    corpus += [f"What does {p[:-1]}?" for p, _, _ in _toy_pairs(np.random.default_rng(seed), 50)]
    _write_toy_model(root / "model", _toy_tokenizer(corpus), seed)
    return root / "model", data
