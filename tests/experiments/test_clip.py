"""CLIP in Flax nnx: tiny random transformers CLIPModels, PEFT LoRA, CLIPImageProcessor.

Peers:
* transformers' ``CLIPModel`` (tiny random configs saved with ``save_pretrained``, safetensors,
  one file or sharded): ``get_image_features``, ``get_text_features`` (both end-of-text rules)
  and the logits, in float32, to ``1e-5``.
* PEFT: a ``get_peft_model`` LoRA (r=4, alpha=8, q/k/v/out_proj) with random factors saved by
  ``save_pretrained``, read by ``nu.peft.load_adapter``, folded or applied as LoRA layers; and
  back through ``nu.peft.save_adapter`` into ``PeftModel.from_pretrained``.
* ``CLIPImageProcessorPil`` (what ``CLIPImageProcessor`` is without torchvision, and the
  resampling transformers documents): exactly equal pixel values on odd images.
* openai/clip-vit-base-patch32, only where ``NETUTILITY_CLIP_DIR`` names a folder holding it.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import netutility_jax as nu
from netutility_jax.errors import InputError, InputTypeError, MissingFileError
from netutility_jax.experiments.models import clip
from netutility_jax.experiments.models.minilm import LoRALinear

torch = pytest.importorskip("torch", reason="torch is needed for the transformers peer")
transformers = pytest.importorskip("transformers", reason="transformers is the reference")
PIL_Image = pytest.importorskip("PIL.Image", reason="PIL is the image peer")

ATOL = 1e-5
EOS = 49  # the end-of-text id of the tiny vocabulary (99 ids); 2 selects the legacy rule
# transformers' PreTrainedModel.is_gradient_checkpointing, which PEFT calls when wrapping a model,
# emits this deprecation in transformers 5.x; it is not ours to fix (as in test_peft.py).
HF_WARNINGS = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)
CLIP_DIR = os.environ.get("NETUTILITY_CLIP_DIR", "")


@pytest.fixture(autouse=True)
def _offline_and_exact(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    # float32 products in full precision also on GPUs, whose XLA default is TF32 (~1e-3 off)
    with jax.default_matmul_precision("highest"):
        yield


def hf_config(*, eos=EOS, act="quick_gelu"):
    return transformers.CLIPConfig(
        text_config=dict(
            vocab_size=99,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=16,
            hidden_act=act,
            eos_token_id=eos,
            bos_token_id=97,
            pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=16,
            patch_size=4,
            hidden_act=act,
        ),
        projection_dim=24,
    )


def tiny_hf(*, eos=EOS, act="quick_gelu", seed=0):
    """A random CLIPModel whose every weight matters (LayerNorm gains around 1)."""
    torch.manual_seed(seed)
    model = transformers.CLIPModel(hf_config(eos=eos, act=act)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if name == "logit_scale":
                continue
            if "layer_norm" in name or "layrnorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * z)
            else:
                p.copy_(0.15 * z)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``(eos, act) -> (folder, transformers model)``, saved once per module."""
    cache = {}

    def get(eos=EOS, act="quick_gelu"):
        if (eos, act) not in cache:
            model = tiny_hf(eos=eos, act=act)
            d = tmp_path_factory.mktemp(f"clip_{eos}_{act}")
            model.save_pretrained(d)
            cache[eos, act] = (d, model)
        return cache[eos, act]

    return get


def pixels(n=3, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 3, 16, 16)).astype(np.float32)


def text_batch(eos):
    """Ids on which the two end-of-text rules disagree (the largest id is not the first eos),
    with right padding, a row padded with the eos id and a left-padded row."""
    e = eos
    ids = np.array(
        [
            [0, 5, 96, 7, e, 1, 1, 1, 1, 1],
            [0, 40, 80, 9, 10, 11, 12, 13, 14, e],
            [0, e, 50, 90, 60, e, e, e, e, e],
            [1, 1, 0, 6, 70, 3, e, 1, 1, 1],
        ]
    )
    mask = np.ones_like(ids)
    mask[0, 5:] = mask[2, 6:] = mask[3, :2] = mask[3, 7:] = 0
    return ids, mask


def hf_features(model, ids=None, mask=None, px=None):
    """transformers' projected embeddings (a tensor in 4.x, pooler_output in 5.x)."""
    with torch.no_grad():
        if px is not None:
            out = model.get_image_features(pixel_values=torch.tensor(px))
        else:
            m = None if mask is None else torch.tensor(mask)
            out = model.get_text_features(input_ids=torch.tensor(ids), attention_mask=m)
    return getattr(out, "pooler_output", out).numpy()


# ------------------------------------------------------------------------------ the forward


@pytest.mark.parametrize(
    ("eos", "act"),
    [(EOS, "quick_gelu"), pytest.param(2, "quick_gelu", marks=pytest.mark.slow),
     pytest.param(EOS, "gelu", marks=pytest.mark.slow)],
)  # fmt: skip
def test_from_pretrained_matches_transformers(folders, eos, act):
    folder, hf = folders(eos, act)
    model, cfg, image_cfg = clip.from_pretrained(folder)
    assert cfg.text_config.eos_token_id == eos and cfg.text_config.legacy_eos == (eos == 2)
    assert cfg.vision_config.hidden_act == act and cfg.projection_dim == 24
    assert image_cfg == clip.ImageProcessorConfig()  # no preprocessor_config.json
    px = pixels()
    ids, mask = text_batch(eos)

    img = np.asarray(model.get_image_features(px))
    np.testing.assert_allclose(img, hf_features(hf, px=px), atol=ATOL, rtol=ATOL)
    assert img.shape == (3, 24) and img.dtype == np.float32 and np.abs(img).max() > 0.2
    txt = np.asarray(model.get_text_features(ids, mask))
    np.testing.assert_allclose(txt, hf_features(hf, ids, mask), atol=ATOL, rtol=ATOL)
    no_mask = np.asarray(model.get_text_features(ids))
    np.testing.assert_allclose(no_mask, hf_features(hf, ids), atol=ATOL, rtol=ATOL)

    out = model(ids, px, mask)
    with torch.no_grad():
        want = hf(
            input_ids=torch.tensor(ids),
            pixel_values=torch.tensor(px),
            attention_mask=torch.tensor(mask),
        )
    for name in ("logits_per_image", "logits_per_text", "image_embeds", "text_embeds"):
        w = getattr(want, name).numpy()
        np.testing.assert_allclose(np.asarray(getattr(out, name)), w, atol=ATOL, rtol=ATOL)
    assert out.logits_per_image.shape == (3, 4)


def test_end_of_text_rules_pick_different_positions(folders):
    """The legacy rule reads argmax(ids), the other the first eos: on the same ids with the same
    weights they differ (each matches transformers in the test above)."""
    (new_dir, _), (old_dir, _) = folders(EOS), folders(2)
    new, _, _ = clip.from_pretrained(new_dir)
    old, _, _ = clip.from_pretrained(old_dir)
    ids, mask = text_batch(EOS)
    rows = (
        np.asarray(new.get_text_features(ids, mask)),
        np.asarray(old.get_text_features(ids, mask)),
    )
    # tiny_hf draws the same weights for both configs: only the pooled position differs
    assert np.abs(rows[0] - rows[1]).max() > 1e-2


# (~10-15 s; the default tier keeps the transformers comparisons; the slow tier runs in CI)
@pytest.mark.slow
def test_sharded_folder_and_param_dtype(folders, tmp_path):
    folder, hf = folders()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model, _, _ = clip.from_pretrained(tmp_path)
    ref, _, _ = clip.from_pretrained(folder)
    px = pixels(2)
    np.testing.assert_array_equal(model.get_image_features(px), ref.get_image_features(px))
    half, _, _ = clip.from_pretrained(folder, param_dtype=jnp.bfloat16)
    k = half.vision_model.encoder.layers[0].self_attn.q_proj.kernel[...]
    assert k.dtype == jnp.bfloat16
    cos = _cosine(half.get_image_features(px), ref.get_image_features(px))
    assert cos.min() > 0.99


def _cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


# (~10-15 s; the default tier keeps the transformers comparisons; the slow tier runs in CI)
@pytest.mark.slow
def test_bfloat16_compute_close_to_float32(folders):
    folder, _ = folders()
    model, _, _ = clip.from_pretrained(folder)
    fast, _, _ = clip.from_pretrained(folder, dtype=jnp.bfloat16)
    px = pixels()
    ids, mask = text_batch(EOS)
    got = fast.get_image_features(px)
    assert got.dtype == jnp.float32  # bf16 products, float32 out
    assert _cosine(got, model.get_image_features(px)).min() > 0.99
    assert (
        _cosine(fast.get_text_features(ids, mask), model.get_text_features(ids, mask)).min() > 0.99
    )
    again = clip.with_dtype(model, jnp.bfloat16)  # the same weights, shared
    np.testing.assert_array_equal(again.get_image_features(px), got)


# (~10-15 s; the default tier keeps the transformers comparisons; the slow tier runs in CI)
@pytest.mark.slow
def test_jit_batches_and_no_recompile(folders):
    folder, _ = folders()
    model, _, _ = clip.from_pretrained(folder)
    px = pixels(5, seed=1)
    eager = np.asarray(model.get_image_features(px))
    jitted = nnx.jit(lambda m, x: m.get_image_features(x))
    np.testing.assert_allclose(jitted(model, px), eager, atol=1e-6, rtol=1e-6)
    got = clip.image_features(model, px, batch_size=2)  # batches of 2, 2, 1 (padded)
    np.testing.assert_allclose(got, eager, atol=1e-6, rtol=1e-6)
    n0 = clip._image_features._cache_size()
    np.testing.assert_array_equal(clip.image_features(model, px[:3], batch_size=2), got[:3])
    assert clip._image_features._cache_size() == n0  # same batch shape: no new compilation
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda state, x: nnx.merge(graphdef, state).get_text_features(x))
    ids, _ = text_batch(EOS)
    np.testing.assert_allclose(f(state, ids), model.get_text_features(ids), atol=1e-6)


def test_input_errors(folders):
    model, cfg, _ = clip.from_pretrained(folders()[0])
    with pytest.raises(
        InputError, match=r"pixel_values \(2, 3, 9, 16\); expected \(B, 3, 16, 16\)"
    ):
        model.get_image_features(np.zeros((2, 3, 9, 16), np.float32))
    with pytest.raises(InputTypeError, match="normalized floats"):
        model.get_image_features(np.zeros((2, 3, 16, 16), np.uint8))
    with pytest.raises(InputError, match="sequence length 17 exceeds the model's 16 positions"):
        model.get_text_features(np.ones((1, 17), np.int32))
    with pytest.raises(InputTypeError, match="expected integers"):
        model.get_text_features(np.ones((1, 3), np.float32))
    with pytest.raises(InputError, match=r"must both be \(B, T\)"):
        model.get_text_features(np.ones((1, 3), np.int32), np.ones((1, 4), np.int32))
    with pytest.raises(InputTypeError, match=r"expected a clip\.CLIPConfig"):
        clip.CLIPModel({"projection_dim": 4}, rngs=nnx.Rngs(0))
    with pytest.raises(InputTypeError, match="dtype"):
        clip.CLIPModel(cfg, dtype=jnp.int32, rngs=nnx.Rngs(0))


# ------------------------------------------------------------------------------- bad folders


def _bad_config(folder, tmp_path, edit):
    d = tmp_path / "bad"
    shutil.copytree(folder, d)
    c = json.loads((d / "config.json").read_text())
    edit(c)
    (d / "config.json").write_text(json.dumps(c))
    return d


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(model_type="siglip"), "model_type 'siglip'"),
        (lambda c: c.update(architectures=["CLIPVisionModel"]), "architectures"),
        (lambda c: c.update(text_config=[1]), "text_config is a list"),
        (lambda c: c["vision_config"].update(patch_size="4"), r"vision_config.patch_size='4'"),
        (lambda c: c["vision_config"].update(hidden_act="tanh"), "vision_config.hidden_act='tanh'"),
        (lambda c: c["text_config"].update(eos_token_id=[2, 98]), r"text_config.eos_token_id="),
        (
            lambda c: c["text_config"].update(num_attention_heads=5),
            "text_config.hidden_size 32 is not divisible by text_config.num_attention_heads 5",
        ),
        (lambda c: c.update(projection_dim=0), "projection_dim=0"),
        (lambda c: c["vision_config"].update(layer_norm_eps=-1), "vision_config.layer_norm_eps"),
    ],
)
def test_bad_config_json(folders, tmp_path, edit, match):
    folder, _ = folders()
    with pytest.raises(InputError, match=match):
        clip.from_pretrained(_bad_config(folder, tmp_path, edit))


def test_weights_that_do_not_match_the_config(folders, tmp_path):
    folder, _ = folders()
    d = _bad_config(folder, tmp_path, lambda c: c["vision_config"].update(num_hidden_layers=3))
    with pytest.raises(InputError, match=r"no tensor 'vision_model.encoder.layers.2.layer_norm1"):
        clip.from_pretrained(d)
    d2 = _bad_config(folder, tmp_path / "2", lambda c: c["text_config"].update(vocab_size=98))
    with pytest.raises(
        InputError, match=r"'text_model.embeddings.token_embedding.weight' .*\(99, 32\)"
    ):
        clip.from_pretrained(d2)
    d3 = _bad_config(folder, tmp_path / "3", lambda c: c["text_config"].update(num_hidden_layers=1))
    with pytest.raises(InputError, match="weights this port does not use"):
        clip.from_pretrained(d3)
    with pytest.raises(MissingFileError, match="no such folder"):
        clip.from_pretrained(tmp_path / "absent")
    with pytest.raises(InputError, match="needs rngs"):
        clip.from_pretrained(folder, lora=clip.LoRAConfig(rank=2))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/abs.safetensors", "ok/../../x"])
def test_index_shard_paths_must_stay_in_the_folder(folders, tmp_path, shard):
    _, hf = folders()
    d = tmp_path / "sharded"
    hf.save_pretrained(d, max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match="not in the folder"):
        clip.from_pretrained(d)


def test_index_shard_link_leaving_the_folder_is_refused(folders, tmp_path):
    folder, _ = folders()
    d = tmp_path / "linked"
    d.mkdir()
    shutil.copy(folder / "config.json", d)
    (d / "model-00001.safetensors").symlink_to(folder / "model.safetensors")
    index = {"weight_map": {"logit_scale": "model-00001.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"'model-00001\.safetensors', which is not in the folder"):
        clip.from_pretrained(d)


# ------------------------------------------------------------------------------------- LoRA


def _peft_adapter(path, *, targets, seed=0):
    """A PEFT LoRA (r=4, alpha=8) on the tiny model with random A and B, saved to ``path``."""
    peft = pytest.importorskip("peft", reason="peft is the LoRA reference")
    base = tiny_hf()  # the weights of folders() (tiny_hf is deterministic)
    pm = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    ).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(path)
    return pm


@pytest.fixture(scope="module")
def peft_both(folders, tmp_path_factory):
    """PEFT LoRA on q/k/v/out_proj of both towers (target_modules as a list of names)."""
    path = tmp_path_factory.mktemp("peft_both") / "adapter"
    pm = _peft_adapter(path, targets=list(clip.LORA_TARGETS))
    return path, pm


@HF_WARNINGS
def test_peft_adapter_folds_and_applies_like_peft(folders, peft_both):
    folder, hf = folders()
    path, pm = peft_both
    adapter = nu.peft.load_adapter(path)
    assert len(adapter) == 2 * 2 * 4  # towers x layers x projections
    assert "vision_model.encoder.layers.1.self_attn.out_proj" in adapter
    assert {m["scale"] for m in adapter.values()} == {2.0}
    px = pixels()
    ids, mask = text_batch(EOS)
    want_img = hf_features(pm, px=px)
    want_txt = hf_features(pm, ids, mask)
    assert np.abs(want_img - hf_features(hf, px=px)).max() > 0.05  # the adapter matters

    model, _, _ = clip.from_pretrained(folder)
    folded = clip.fold_adapter(model, adapter)
    np.testing.assert_allclose(folded.get_image_features(px), want_img, atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(folded.get_text_features(ids, mask), want_txt, atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(model.get_image_features(px), hf_features(hf, px=px), atol=ATOL)

    lora = clip.LoRAConfig(rank=4, alpha=8.0, towers=("vision", "text"))
    with_lora, _, _ = clip.from_pretrained(folder, lora=lora, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(  # fresh adapters: B = 0
        with_lora.get_image_features(px), model.get_image_features(px), atol=1e-6
    )
    applied = nu.nnx.apply_adapter(with_lora, clip.nnx_names(adapter), mode="lora")
    np.testing.assert_allclose(applied.get_image_features(px), want_img, atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(applied.get_text_features(ids, mask), want_txt, atol=ATOL, rtol=ATOL)


@HF_WARNINGS
def test_adapter_round_trips_through_save_adapter_into_peft(folders, peft_both, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is the LoRA reference")
    folder, _ = folders()
    path, pm = peft_both
    lora = clip.LoRAConfig(rank=4, alpha=8.0, towers=("vision", "text"))
    model, _, _ = clip.from_pretrained(folder, lora=lora, rngs=nnx.Rngs(1))
    model = nu.nnx.apply_adapter(model, clip.nnx_names(nu.peft.load_adapter(path)), mode="lora")
    names = clip.peft_names(nu.nnx.extract_adapter(model))
    assert set(names) == set(nu.peft.load_adapter(path))
    assert list(clip.nnx_names(names)) == list(nu.nnx.extract_adapter(model))
    nu.peft.save_adapter(names, tmp_path / "back")
    loaded = peft.PeftModel.from_pretrained(tiny_hf(), tmp_path / "back").eval()
    px = pixels(2, seed=3)
    np.testing.assert_allclose(hf_features(loaded, px=px), hf_features(pm, px=px), atol=ATOL)
    np.testing.assert_allclose(model.get_image_features(px), hf_features(pm, px=px), atol=ATOL)


@HF_WARNINGS
def test_vision_tower_lora_as_knots(folders, tmp_path):
    """LoRA on the vision tower only (the KnOTS adapters): the default LoRAConfig."""
    folder, _ = folders()
    targets = r".*vision_model.*\.(q_proj|k_proj|v_proj|out_proj)"
    pm = _peft_adapter(tmp_path / "vision", targets=targets, seed=1)
    adapter = nu.peft.load_adapter(tmp_path / "vision")
    assert all(k.startswith("vision_model.encoder.layers.") for k in adapter) and len(adapter) == 8
    model, _, _ = clip.from_pretrained(
        folder, lora=clip.LoRAConfig(rank=4, alpha=8), rngs=nnx.Rngs(0)
    )
    assert len([m for _, m in nnx.iter_modules(model) if isinstance(m, LoRALinear)]) == 8
    applied = nu.nnx.apply_adapter(model, clip.nnx_names(adapter), mode="lora")
    px = pixels()
    np.testing.assert_allclose(applied.get_image_features(px), hf_features(pm, px=px), atol=ATOL)
    # a merge at half strength: W + 0.5 dK, as PEFT's update scaled by 0.5
    half = clip.fold_adapter(model, adapter, coef=0.5)
    for name, m in adapter.items():
        layer = nnx_layer(half, name)
        base = nnx_layer(model, name)
        dk = np.asarray(nu.module_update(m))
        np.testing.assert_allclose(layer.kernel[...] - base.kernel[...], 0.5 * dk, atol=1e-6)


def nnx_layer(model, peft_name):
    node = model
    for p in next(iter(clip.nnx_names({peft_name: 0}))).split("/"):
        node = node[int(p)] if p.isdigit() else getattr(node, p)
    return node


def test_names_and_lora_config_errors(folders):
    with pytest.raises(InputError, match="not a CLIP encoder layer's linear layer"):
        clip.nnx_names({"vision_model.embeddings.patch_embedding": 0})
    with pytest.raises(InputError, match="not a CLIP encoder layer's linear layer"):
        clip.peft_names({"text_projection": 0})
    assert clip.nnx_names({"text_model/encoder/layers/0/mlp/fc2": 1}) == {
        "text_model/encoder/layers/0/mlp/fc2": 1
    }
    folder, _ = folders()
    model, _, _ = clip.from_pretrained(folder)
    bad = {"vision_model.encoder.layers.5.self_attn.q_proj": {"delta": np.zeros((32, 32))}}
    with pytest.raises(InputError, match="names layer 5 but the vision_model has 2 layers"):
        clip.fold_adapter(model, bad)
    wrong = {"vision_model.encoder.layers.0.mlp.fc1": {"delta": np.zeros((32, 32))}}
    with pytest.raises(InputError, match="base kernel has shape"):
        clip.fold_adapter(model, wrong)
    with pytest.raises(InputError, match="unknown names"):
        clip.LoRAConfig(rank=2, targets=("o_proj",))
    with pytest.raises(InputError, match="towers"):
        clip.LoRAConfig(rank=2, towers=("audio",))
    with pytest.raises(InputError, match="rank=0"):
        clip.LoRAConfig(rank=0)


# ---------------------------------------------------------------------------- preprocessing


def _images():
    rng = np.random.default_rng(0)
    u8 = lambda *s: rng.integers(0, 256, s, dtype=np.uint8)
    pal = PIL_Image.fromarray(u8(30, 30)).convert("P")
    pal.info["transparency"] = 3  # a palette image with a transparent index
    return [
        PIL_Image.fromarray(u8(37, 53, 3)),  # landscape, odd sizes
        PIL_Image.fromarray(u8(301, 203, 3)),  # portrait, larger than the crop
        PIL_Image.fromarray(u8(11, 7)),  # grayscale, smaller than the crop
        PIL_Image.fromarray(u8(64, 64, 4)),  # RGBA, composited onto white
        PIL_Image.fromarray(u8(225, 224, 3)),  # one pixel off square
        pal,
    ]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"size": {"shortest_edge": 20}, "crop_size": {"height": 18, "width": 24}},
        {"size": {"height": 17, "width": 23}, "do_center_crop": False, "resample": 2},
        {"crop_size": {"height": 250, "width": 230}},  # larger than the resized image: padding
    ],
)
def test_preprocess_equals_clip_image_processor(kw):
    from transformers import CLIPImageProcessorPil

    hp = CLIPImageProcessorPil(**kw)
    cfg = dataclasses.replace(clip.ImageProcessorConfig.from_hf(hp.to_dict()), alpha=_hf_alpha())
    images = _images()
    for im in images:
        want = hp(images=im, return_tensors="np")["pixel_values"]
        got = clip.preprocess(im, cfg)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    if kw.get("do_center_crop", True):
        batch = clip.preprocess(images, cfg)
        np.testing.assert_array_equal(batch, hp(images=images, return_tensors="np")["pixel_values"])


def _hf_alpha():
    """How the installed transformers converts transparency: 5.24 composites onto white, 5.17
    and earlier drop the alpha channel."""
    from transformers import CLIPImageProcessorPil

    hp = CLIPImageProcessorPil(do_resize=False, do_center_crop=False, do_normalize=False)
    clear = PIL_Image.new("RGBA", (1, 1), (0, 0, 0, 0))
    return "white" if hp(images=clear, return_tensors="np")["pixel_values"].min() > 0.5 else "drop"


def test_alpha_modes():
    rgba = _images()[3]
    white, drop = (clip.ImageProcessorConfig(alpha=a) for a in clip.ALPHA_MODES)
    assert np.abs(clip.preprocess(rgba, white) - clip.preprocess(rgba, drop)).max() > 0.5
    opaque = _images()[0]
    np.testing.assert_array_equal(clip.preprocess(opaque, white), clip.preprocess(opaque, drop))
    np.testing.assert_array_equal(
        clip.preprocess(rgba.convert("RGB"), white), clip.preprocess(rgba, drop)
    )
    with pytest.raises(InputError, match="alpha='black'"):
        clip.ImageProcessorConfig(alpha="black")


def test_preprocessor_config_json(folders, tmp_path):
    from transformers import CLIPImageProcessorPil

    folder, _ = folders()
    d = tmp_path / "with_processor"
    shutil.copytree(folder, d)
    CLIPImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    ).save_pretrained(d)
    _, _, image_cfg = clip.from_pretrained(d)
    assert (image_cfg.size, image_cfg.crop_size, image_cfg.resample) == (16, (16, 16), 3)
    hp = CLIPImageProcessorPil.from_pretrained(d)
    im = _images()[1]
    np.testing.assert_array_equal(
        clip.preprocess(im, image_cfg), hp(images=im, return_tensors="np")["pixel_values"]
    )
    # the old format of openai/clip-vit-base-patch32: ints for size and crop_size
    old = {"crop_size": 224, "size": 224, "resample": 3, "do_center_crop": True}
    old |= {"feature_extractor_type": "CLIPFeatureExtractor", "do_normalize": True}
    assert clip.ImageProcessorConfig.from_hf(old) == clip.ImageProcessorConfig()
    for bad, match in [
        ({"size": {"shortest_edge": 224, "longest_edge": 300}}, "no 'longest_edge'"),
        ({"crop_size": {"height": 0, "width": 3}}, "crop_size"),
        ({"resample": 9}, "resample=9"),
        ({"image_std": [0.2, 0.0, 0.3]}, "image_std"),
        ({"do_resize": "yes"}, "do_resize='yes'"),
    ]:
        with pytest.raises(InputError, match=match):
            clip.ImageProcessorConfig.from_hf(bad)
    with pytest.raises(InputTypeError, match="expected a PIL image"):
        clip.preprocess([1.5])
    with pytest.raises(InputError, match="no images"):
        clip.preprocess([])
    no_crop = clip.ImageProcessorConfig(size=(4, 4), do_center_crop=False)
    assert clip.preprocess([np.zeros((5, 6, 3), np.uint8)] * 2, no_crop).shape == (2, 3, 4, 4)
    free = clip.ImageProcessorConfig(do_resize=False, do_center_crop=False)
    with pytest.raises(InputError, match="different shapes"):
        clip.preprocess(_images()[:2], free)


# (~10-15 s; the default tier keeps the transformers comparisons; the slow tier runs in CI)
@pytest.mark.slow
def test_docstring_examples():
    for name in ("clip", "clip_config", "clip_model", "clip_load", "clip_image"):
        mod = importlib.import_module(f"netutility_jax.experiments.models.{name}")
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert res.failed == 0, name


# ---------------------------------------------------------------------------- the real model


@pytest.mark.skipif(
    not (CLIP_DIR and pathlib.Path(CLIP_DIR).is_dir()),
    reason="set NETUTILITY_CLIP_DIR to a local openai/clip-vit-base-patch32 folder",
)
def test_openai_clip_vit_base_patch32():
    from transformers import CLIPImageProcessorPil, CLIPTokenizer

    model, cfg, image_cfg = clip.from_pretrained(CLIP_DIR)
    assert (cfg.vision_config.patch_size, cfg.vision_config.num_layers) == (32, 12)
    hf = transformers.CLIPModel.from_pretrained(CLIP_DIR, dtype=torch.float32).eval()
    hp = CLIPImageProcessorPil.from_pretrained(CLIP_DIR)
    tok = CLIPTokenizer.from_pretrained(CLIP_DIR)
    yy, xx = np.mgrid[0:240, 0:320]
    rgb = np.stack([xx * 255 // 319, yy * 255 // 239, (xx + yy) % 256], -1).astype(np.uint8)
    image = PIL_Image.fromarray(rgb)
    px = clip.preprocess(image, image_cfg)
    np.testing.assert_array_equal(px, hp(images=image, return_tensors="np")["pixel_values"])
    texts = ["a photo of a gradient", "a photo of a cat", "a diagram"]
    t = tok(texts, padding=True, return_tensors="np")
    ids, mask = t["input_ids"], t["attention_mask"]
    img = np.asarray(model.get_image_features(px))
    want = hf_features(hf, px=px)
    np.testing.assert_allclose(img, want, atol=1e-4 * np.abs(want).max(), rtol=1e-4)
    txt = np.asarray(model.get_text_features(ids, mask))
    want_t = hf_features(hf, ids, mask)
    np.testing.assert_allclose(txt, want_t, atol=1e-4 * np.abs(want_t).max(), rtol=1e-4)
    out = model(ids, px, mask)
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(ids),
            pixel_values=torch.tensor(px),
            attention_mask=torch.tensor(mask),
        )
    np.testing.assert_allclose(out.logits_per_image, ref.logits_per_image.numpy(), atol=1e-3)
