"""The vision suite (``experiments.vision``, ``experiments.vision_data``): CLIP's zero-shot heads,
given PEFT LoRAs merged under rank budgets, image datasets from folders or parquet files.

Fixtures are real files: a tiny random transformers ``CLIPModel`` saved with ``save_pretrained``
(with a tiny ``CLIPTokenizer``'s ``tokenizer.json`` and a ``preprocessor_config.json``), image
folders of tiny random PNGs in the layouts users have (flat class folders, SUN397's nested ones,
a dataset's own validation split, a KnOTS index file), and PEFT LoRAs saved by ``get_peft_model``
with random ``lora_B`` (safetensors, the pickled ``adapter_model.bin``, and PEFT on the vision
tower itself as KnOTS trains). Run as a script (``python tests/experiments/test_vision.py DIR``) it writes
the same fixture for a command-line run (``.ci/run``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import zlib

import numpy as np
import pytest

from netutility_jax.errors import InputError, MissingFileError
from netutility_jax.experiments import demo
from netutility_jax.experiments.data import vision_data as vd
from netutility_jax.experiments.data import vision_images as vi
from netutility_jax.experiments.data import vision_tasks as vt
from netutility_jax.experiments.harness import suites

HAVE_PEERS = all(
    __import__("importlib").util.find_spec(m) is not None
    for m in ("torch", "transformers", "peft", "PIL")
)
needs_peers = pytest.mark.skipif(
    not HAVE_PEERS, reason="torch, transformers, peft and PIL build the fixture"
)
# transformers' PreTrainedModel.is_gradient_checkpointing, which PEFT calls when wrapping a model,
# emits this deprecation in transformers 5.x; it is not ours to fix (as in test_clip.py).
HF_WARNINGS = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

# the suite's fixture: the tiny CLIP's tokenizer vocabulary (BPE over a few letters; the
# end-of-text token has the largest id, as in CLIP's, so the legacy end-of-text rule applies)
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"
VOCAB = [
    *_CHARS,
    *(f"{c}</w>" for c in _CHARS),
    *"lo low</w> er</w> newer</w> wider</w> <unk> <|startoftext|> <|endoftext|>".split(),
]
MERGES = (("l", "o"), ("lo", "w</w>"), ("e", "r</w>"))
RANK, ALPHA = 8, 16
SIZE = 16  # image side of the tiny CLIP


def _tiny_clip(seed: int = 0):
    import torch
    import transformers

    cfg = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=len(VOCAB), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=24, eos_token_id=2, bos_token_id=0,
            pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            image_size=SIZE, patch_size=4,
        ),
        projection_dim=24,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.CLIPModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "logit_scale":
                continue
            z = torch.randn(p.shape, generator=g)
            if "layer_norm" in name or "layrnorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * z)
            else:
                p.copy_(0.15 * z)
    return model


def write_model(d: pathlib.Path) -> pathlib.Path:
    """A tiny random CLIP folder: config.json, model.safetensors, tokenizer.json,
    preprocessor_config.json."""
    from transformers import CLIPImageProcessorPil, CLIPTokenizer

    _tiny_clip().save_pretrained(d)
    tok = CLIPTokenizer(
        vocab={t: i for i, t in enumerate(VOCAB)}, merges=list(MERGES), unk_token="<unk>"
    )
    tok.save_pretrained(d)
    CLIPImageProcessorPil(
        size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}
    ).save_pretrained(d)
    return d


def _png(path: pathlib.Path, rng: np.random.Generator, hue: int) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = (int(x) for x in rng.integers(12, 28, 2))
    base = np.zeros((h, w, 3), np.int64)
    base[..., hue % 3] = 160
    noise = rng.integers(0, 96, (h, w, 3))
    Image.fromarray((base + noise).clip(0, 255).astype(np.uint8)).save(path)


def write_folder_split(root: pathlib.Path, classes, per_class: int, seed: int) -> None:
    """``root/<class>/<i>.png`` for every class (``classes``: folder paths, ``/`` nests)."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        for i in range(per_class):
            _png(root / name / f"img{i:03d}.png", rng, c)


#: The e2e datasets: a built-in one with declared classes (mnist: train + test, validation held
#: out of test), SUN397's nested original layout with a KnOTS index file, and a dataset of your
#: own with its own validation split and templates.
SUN_CLASSES = ("a/abbey", "b/bakery/shop", "c/coast")
OWN_CLASSES = ("low", "wider", "newer")


def write_data(d: pathlib.Path) -> pathlib.Path:
    digits = [str(i) for i in range(10)]
    write_folder_split(d / "mnist" / "train", digits, 2, seed=1)
    write_folder_split(d / "mnist" / "test", digits, 6, seed=2)
    write_folder_split(d / "SUN397" / "test", SUN_CLASSES, 10, seed=3)
    perm = np.random.default_rng(4).permutation(30)
    np.save(d / "SUN397" / "shuffled_idxs.npy", perm)
    write_folder_split(d / "shapes" / "val", OWN_CLASSES, 3, seed=5)
    write_folder_split(d / "shapes" / "test", OWN_CLASSES, 8, seed=6)
    (d / "shapes" / "templates.txt").write_text("a photo of a {c}.\na {c} thing.\n")
    return d


def write_adapter(path: pathlib.Path, *, seed: int, tower_only: bool = False, safe=True):
    """A PEFT LoRA (r=8, alpha=16) on q/k/v/out_proj of the tiny CLIP's vision tower with random
    factors: PEFT on ``CLIPModel`` (names ``vision_model.encoder...``), or on the tower itself
    as KnOTS trains (``encoder...``); ``safe=False`` writes the pickled ``adapter_model.bin``."""
    import peft
    import torch

    base = _tiny_clip()
    if tower_only:
        target, targets = base.vision_model, ["q_proj", "k_proj", "v_proj", "out_proj"]
    else:
        target, targets = base, r".*vision_model.*\.(q_proj|k_proj|v_proj|out_proj)"
    pm = peft.get_peft_model(
        target, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets)
    ).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(path, safe_serialization=safe)
    return pm


def write_fixture(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """The whole fixture under ``root``: ``model``, ``data``, ``adapters/{mnist,sun397,shapes}``."""
    root.mkdir(parents=True, exist_ok=True)
    out = {"model": write_model(root / "model"), "data": write_data(root / "data")}
    ad = root / "adapters"
    write_adapter(ad / "knots_lora_r8_mnist", seed=11)
    write_adapter(ad / "sun", seed=12, safe=False)
    write_adapter(ad / "own", seed=13, tower_only=True)
    out["adapters"] = ad
    return out


def adapters_arg(ad: pathlib.Path) -> str:
    return f"{ad / 'knots_lora_r8_mnist'},sun397={ad / 'sun'},shapes={ad / 'own'}"


# ----------------------------------------------------------------------------------- datasets


def test_the_seven_datasets_are_declared_as_knots_does():
    assert vd.ORDER == ("dtd", "eurosat", "gtsrb", "mnist", "resisc45", "sun397", "svhn")
    counts = {n: None if s.classes is None else len(s.classes) for n, s in vd.DATASETS.items()}
    assert counts == {"dtd": 47, "eurosat": 10, "gtsrb": 43, "mnist": 10, "resisc45": 45,
                      "sun397": None, "svhn": 10}  # fmt: skip
    templates = {n: len(s.templates) for n, s in vd.DATASETS.items()}
    assert templates == {"dtd": 8, "eurosat": 3, "gtsrb": 3, "mnist": 1, "resisc45": 18,
                         "sun397": 2, "svhn": 1}  # fmt: skip
    for s in vd.DATASETS.values():
        assert all(t.count("{c}") == 1 for t in s.templates), s.name
        assert s.classes is None or len(set(s.classes)) == len(s.classes), s.name
    # a few entries written out, checked against KnOTS' files by eye once and pinned here
    assert vd.DATASETS["dtd"].templates[0] == "a photo of a {c} texture."
    assert vd.DATASETS["dtd"].templates[7] == "a photo of the {c} object."
    assert vd.DATASETS["resisc45"].templates[:2] == (
        "satellite imagery of {c}.",
        "aerial imagery of {c}.",
    )
    assert vd.DATASETS["resisc45"].templates[-1] == "aerial view of the {c}."
    assert vd.DATASETS["gtsrb"].templates[1] == 'a centered photo of a "{c}" traffic sign.'
    assert vd.DATASETS["eurosat"].classes[2] == "brushland or shrubland"
    assert vd.DATASETS["resisc45"].classes[2] == "baseball diamond"
    assert vd.DATASETS["gtsrb"].classes[14] == "stop"
    assert vd.dataset_spec("mine").templates == vd.DEFAULT_TEMPLATES


def test_class_names_come_from_folders_as_knots_names_sun397():
    import doctest

    from netutility_jax.experiments.suites import vision_adapters

    for mod in (vd, vt, vision_adapters, suites):  # the docstring examples (class_name's, ...)
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert res.attempted > 0 and res.failed == 0, mod.__name__
    assert vd.class_name("a_abbey", flat_index=True) == vd.class_name("a/abbey") == "abbey"
    assert vd.class_name("a/apartment_building/outdoor") == "apartment building outdoor"
    assert vd.class_name("sea_ice", flat_index=True) == "sea ice"  # one letter only
    assert vd.class_name("t_shirt") == "t shirt"  # a dataset of your own keeps its names


def test_image_folder_tree_is_read_in_imagefolder_order(tmp_path):
    split = tmp_path / "sun397" / "test"
    write_folder_split(split, ("b/bakery/shop", "a/abbey", "a/apartment_building/outdoor"), 2, 0)
    (split / "a" / "abbey" / "notes.txt").write_text("not an image")
    (split / "a" / "abbey" / "UPPER.PNG").write_bytes((split / "a/abbey/img000.png").read_bytes())
    sp = vd.read_split(vd.find_split(tmp_path / "sun397", "test"))
    assert sp.classes == ("a/abbey", "a/apartment_building/outdoor", "b/bakery/shop")
    names = [pathlib.Path(r.path).relative_to(split).as_posix() for r in sp.refs]
    assert names[:3] == ["a/abbey/UPPER.PNG", "a/abbey/img000.png", "a/abbey/img001.png"]
    assert sp.labels.tolist() == [0, 0, 0, 1, 1, 2, 2]
    task = vt.load_task(tmp_path, "sun397")
    assert task.labels == ("abbey", "apartment building outdoor", "bakery shop")
    assert task.prompts()[2] == ["a photo of a bakery shop.", "a photo of the bakery shop."]
    assert "test 20% (ours)" in task.source
    # KnOTS' flattened SUN397 folders (a_abbey), in the same order
    flat = tmp_path / "flat"
    write_folder_split(flat / "SUN397" / "test", ("a_abbey", "b_bakery_shop", "c_coast"), 2, 0)
    assert vt.load_task(flat, "sun397").labels == ("abbey", "bakery shop", "coast")
    # images directly in a split folder, an empty split, a wrong class count
    write_folder_split(tmp_path / "x" / "test", ("",), 1, 0)
    with pytest.raises(vd.VisionDataError, match="images lie directly in the split folder"):
        vt.load_task(tmp_path, "x")
    (tmp_path / "y" / "test" / "empty").mkdir(parents=True)
    with pytest.raises(vd.VisionDataError, match="no images found"):
        vt.load_task(tmp_path, "y")
    write_folder_split(tmp_path / "mnist" / "test", ("0", "1", "2"), 5, 0)
    with pytest.raises(vd.VisionDataError, match="the data has 3 classes but 10 class names"):
        vt.load_task(tmp_path, "mnist")
    with pytest.raises(MissingFileError, match=r"no folder for dataset 'svhn'.*folders there: "):
        vt.load_task(tmp_path, "svhn")
    (tmp_path / "z" / "train").mkdir(parents=True)
    with pytest.raises(MissingFileError, match="no test split"):
        vt.load_task(tmp_path, "z")


def test_a_dataset_folder_is_found_without_case_and_overrides_names(tmp_path):
    write_folder_split(tmp_path / "EuroSAT" / "test", ("b", "a"), 3, 0)
    write_folder_split(tmp_path / "EuroSAT" / "val", ("b", "a"), 2, 1)
    (tmp_path / "EuroSAT" / "classnames.txt").write_text("first class\nsecond class\n")
    (tmp_path / "EuroSAT" / "templates.txt").write_text("satellite {c}\n")
    t = vt.load_task(tmp_path, "eurosat")
    assert t.labels == ("first class", "second class") and t.templates == ("satellite {c}",)
    assert (len(t.val), len(t.test), t.holdout) == (4, 6, "val split")
    (tmp_path / "EuroSAT" / "templates.txt").write_text("no placeholder\n")
    with pytest.raises(vd.VisionDataError, match=r"has no \{c\}"):
        vt.load_task(tmp_path, "eurosat")
    write_folder_split(tmp_path / "w" / "test", ("a", "b"), 3, 0)
    write_folder_split(tmp_path / "w" / "val", ("a", "c"), 3, 0)
    with pytest.raises(vd.VisionDataError, match="splits' classes differ \\('c' vs 'b'\\)"):
        vt.load_task(tmp_path, "w")


def test_validation_split_is_deterministic_and_disjoint(tmp_path):
    for n in (1, 7, 50, 101):
        v, t = vt.holdout(n, fraction=vt.KNOTS_VAL_FRACTION, name="gtsrb")
        v2, t2 = vt.holdout(n, fraction=vt.KNOTS_VAL_FRACTION, name="gtsrb")
        assert np.array_equal(v, v2) and np.array_equal(t, t2)
        assert len(v) == int(0.2 * n) and not set(v) & set(t)
        assert sorted([*v, *t]) == list(range(n))
    other, _ = vt.holdout(101, fraction=0.2, name="svhn")
    assert not np.array_equal(other, vt.holdout(101, fraction=0.2, name="gtsrb")[0])
    # pinned: our permutation is PCG64's raw output (the same on every numpy and machine)
    bits = np.random.PCG64(np.random.SeedSequence([0, zlib.crc32(b"gtsrb")])).random_raw(10)
    assert vt.holdout(10, fraction=0.2, name="gtsrb")[0].tolist() == np.argsort(bits)[:2].tolist()
    # task-vectors' rule: 10% of train, at most 5000
    v, rest = vt.holdout(60000, fraction=vt.TRAIN_VAL_FRACTION, cap=vt.TRAIN_VAL_MAX, name="m")
    assert (len(v), len(rest)) == (5000, 55000)

    # load_task: validation held out of test (KnOTS) or of train (task-vectors), never shared
    write_folder_split(tmp_path / "mnist" / "train", [str(i) for i in range(10)], 3, 1)
    write_folder_split(tmp_path / "mnist" / "test", [str(i) for i in range(10)], 4, 2)
    a = vt.load_task(tmp_path, "mnist")
    b = vt.load_task(tmp_path, "mnist")
    assert [r.path for r in a.val.refs] == [r.path for r in b.val.refs]
    assert (len(a.val), len(a.test)) == (8, 32) and a.holdout == "test 20% (ours)"
    assert not {r.path for r in a.val.refs} & {r.path for r in a.test.refs}
    c = vt.load_task(tmp_path, "mnist", holdout_from="train")
    assert (len(c.val), len(c.test), c.holdout) == (3, 40, "train 10% (ours)")
    assert all("/train/" in r.path for r in c.val.refs)
    assert not {r.path for r in c.val.refs} & {r.path for r in c.test.refs}
    # the preset's sizes: a seeded subset, in the split's order
    d = vt.load_task(tmp_path, "mnist", n_val=5, n_test=10)
    assert (len(d.val), len(d.test)) == (5, 10)
    assert {r.path for r in d.test.refs} <= {r.path for r in a.test.refs}
    order = [r.path for r in a.test.refs]
    assert [order.index(r.path) for r in d.test.refs] == sorted(
        order.index(r.path) for r in d.test.refs
    )
    with pytest.raises(InputError, match="holdout_from='val'"):
        vt.load_task(tmp_path, "mnist", holdout_from="val")
    write_folder_split(tmp_path / "own" / "test", ("p", "q"), 5, 0)
    with pytest.raises(vd.VisionDataError, match="needs a train split"):
        vt.load_task(tmp_path, "own", holdout_from="train")


def test_knots_index_files(tmp_path):
    write_folder_split(tmp_path / "svhn" / "test", [str(i) for i in range(10)], 2, 0)
    ds = tmp_path / "svhn"
    full = vt.load_task(tmp_path, "svhn")
    refs = [r.path for r in (*full.val.refs, *full.test.refs)]
    reading = sorted(refs, key=lambda p: (int(pathlib.Path(p).parent.name), p))
    perm = np.random.default_rng(0).permutation(20)
    np.save(ds / "shuffled_idxs.npy", perm)
    t = vt.load_task(tmp_path, "svhn")
    assert t.holdout == "knots index file"
    assert [r.path for r in t.val.refs] == [reading[i] for i in perm[:4]]  # int(0.2 * 20)
    assert [r.path for r in t.test.refs] == [reading[i] for i in perm[4:]]
    (ds / "shuffled_idxs.npy").unlink()
    (ds / "shuffled_idxs.json").write_text(json.dumps({"val": [3, 1], "test": [0, 2, 5]}))
    t = vt.load_task(tmp_path, "svhn")
    assert [r.path for r in t.val.refs] == [reading[3], reading[1]] and len(t.test) == 3
    for bad, match in [
        ([0, 1, 2], "holds 3 indices but is not a permutation of the test split's 20"),
        ([*range(19), 0], "not a permutation"),
        ({"val": [1], "test": [1, 2]}, "share or repeat"),
        ({"val": [25], "test": []}, "outside the test split's range"),
        ({"val": [1]}, "expected exactly 'val' and 'test'"),
        ([[1, 2]], "not a 1-d list of integers"),
    ]:
        (ds / "shuffled_idxs.json").write_text(json.dumps(bad))
        with pytest.raises(vd.VisionDataError, match=match):
            vt.load_task(tmp_path, "svhn")
    (ds / "shuffled_idxs.txt").write_text(" ".join(map(str, perm)))
    with pytest.raises(vd.VisionDataError, match="several index files"):
        vt.load_task(tmp_path, "svhn")
    (ds / "shuffled_idxs.json").unlink()
    assert vt.load_task(tmp_path, "svhn").holdout == "knots index file"  # whitespace ints
    (ds / "shuffled_idxs.txt").unlink()
    (ds / "shuffled_idxs.pt").write_bytes(b"PK")
    with pytest.raises(vd.VisionDataError, match="torch file is not unpickled here; convert it"):
        vt.load_task(tmp_path, "svhn")


def _write_parquet(path: pathlib.Path, images, labels, names=None, column="image"):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    cells = []
    for im in images:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="PNG")
        cells.append({"bytes": buf.getvalue(), "path": None})
    table = pa.table({column: cells, "label": pa.array(labels, pa.int64())})
    if names is not None:
        feats = {column: {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": names}}
        meta = {b"huggingface": json.dumps({"info": {"features": feats}}).encode()}
        table = table.replace_schema_metadata(meta)
    pq.write_table(table, path)


def test_parquet_files_of_a_hugging_face_dataset(tmp_path):
    pytest.importorskip("pyarrow", reason="pyarrow reads parquet (an optional extra)")
    from netutility_jax.experiments.models import clip

    rng = np.random.default_rng(0)
    ims = [rng.integers(0, 256, (20 + i, 17, 3), dtype=np.uint8) for i in range(12)]
    labels = [i % 3 for i in range(12)]
    names = ["/a/abbey", "/b/bakery/shop", "/c/coast"]
    data = tmp_path / "sun397" / "data"
    _write_parquet(data / "test-00000-of-00002.parquet", ims[:7], labels[:7], names)
    _write_parquet(data / "test-00001-of-00002.parquet", ims[7:], labels[7:], names)
    found = vd.find_split(tmp_path / "sun397", "test")
    assert found.kind == "parquet" and len(found.paths) == 2
    sp = vd.read_split(found)
    assert sp.labels.tolist() == labels and sp.classes == tuple(names)
    t = vt.load_task(tmp_path, "sun397")
    assert t.labels == ("abbey", "bakery shop", "coast")
    cfg = clip.ImageProcessorConfig(size=16, crop_size=(16, 16))
    got = vi.load_images(sp, cfg)
    want = clip.preprocess(ims, vd.dataclasses.replace(cfg, do_rescale=False, do_normalize=False))
    np.testing.assert_array_equal(got, want.astype(np.uint8))
    picked = sp.take([11, 2])
    np.testing.assert_array_equal(vi.load_images(picked, cfg), got[[11, 2]])
    # a dataset of your own without ClassLabel names needs classnames.txt
    _write_parquet(tmp_path / "own" / "test.parquet", ims[:6], [0, 1, 1, 0, 1, 0])
    with pytest.raises(vd.VisionDataError, match=r"write classnames\.txt"):
        vt.load_task(tmp_path, "own")
    (tmp_path / "own" / "classnames.txt").write_text("cat\ndog\n")
    assert vt.load_task(tmp_path, "own").labels == ("cat", "dog")
    _write_parquet(tmp_path / "bad" / "test.parquet", ims[:2], [0, 1], column="pixels")
    with pytest.raises(vd.VisionDataError, match="expected an image column"):
        vt.load_task(tmp_path, "bad")
    _write_parquet(tmp_path / "big" / "test.parquet", ims[:2], [0, 5], ["a", "b"])
    with pytest.raises(vd.VisionDataError, match="labels run from 0 to 5 but the files name 2"):
        vt.load_task(tmp_path, "big")


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "mnist").mkdir()
    (tmp_path / "mnist" / "test-00000-of-00001.parquet").write_bytes(b"PAR1")
    (tmp_path / "svhn" / "test" / "0").mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(
        vd.VisionDataError, match=r"^reading parquet needs pyarrow: pip install pyarrow$"
    ):
        vt.load_task(tmp_path, "mnist")
    # and the up-front check says so before any work (empty files stand in for the real ones)
    from netutility_jax.experiments.suites import vision_adapters

    model, ads = tmp_path / "model", tmp_path / "ads"
    for f in ("config.json", "tokenizer.json", "model.safetensors"):
        (model / f).parent.mkdir(exist_ok=True)
        (model / f).write_text("")
    for name in ("svhn", "mnist"):
        (ads / name).mkdir(parents=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (ads / name / f).write_text("")
    args = suites.parse_adapters(f"{ads / 'svhn'},{ads / 'mnist'}")
    with pytest.raises(InputError, match=r"mnist holds parquet files; .* pip install pyarrow$"):
        vision_adapters.check_folders(model, tmp_path, args)
    with pytest.raises(InputError, match=r"no folder for dataset 'eurosat'"):
        vision_adapters.check_folders(
            model, tmp_path, suites.parse_adapters(f"{ads / 'svhn'},eurosat={ads / 'mnist'}")
        )


# ------------------------------------------------------------------------- flags and adapters


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(list(argv))


def test_the_vision_suite_is_registered_with_its_flags():
    spec = suites.get("vision")
    assert spec.flags == suites.FLAGS
    assert suites.FLAGS == ("model_dir", "data_dir", "adapters", "model_devices", "min_bytes")
    assert spec.grids == ("paper",)
    assert suites.get("encoder").flags == suites.get("language").flags == ()
    with pytest.raises(ValueError, match="flags=\\('gpu',\\); expected a tuple of names among"):
        suites.SuiteSpec(
            name="t", summary="", presets=dict, build=dict, requires=dict, flags=("gpu",)
        )
    from netutility_jax.experiments.suites import vision

    paper = spec.preset(None, quick=False)
    assert paper is vision.PAPER and (paper.n_val, paper.n_test) == (None, None)
    jobs = vision.gr.grid_jobs(paper.grid, full_capacity=112)
    keys = [j.key for j in jobs]
    stands = {(j.method, s, j.budget, j.allocation) for j in jobs for s in j.spaces}
    for space in ("full", "core", "knots"):  # every cell of Table 1 (TSV in Core is run as Full)
        for m in ("tsv", "dare", "ties"):
            for r in (64, 32, 16):
                assert {(m, space, r, "uniform"), (m, space, r, "net_utility")} <= stands
    assert {
        "ta/full/R64/net_utility",
        "iso_c/full/R16/net_utility",
        "iso_c_tsv/full/R16/uniform",
        "ta/full/R112/net_utility",
    } <= set(keys)
    assert "iso_c/full/R64/uniform" not in keys
    assert spec.preset(None, quick=True) is vision.QUICK


def test_parse_and_match_adapters():
    from netutility_jax.experiments.suites import vision_adapters

    items = suites.parse_adapters("dtd=/a/x, /m/KnOTS-ViT-B-32_lora_R16_mnist,/b/one,/b/two")
    assert items[0] == suites.AdapterArg("dtd", "/a/x") and items[2] == (None, "/b/one")
    got = vision_adapters.match_adapters(items)
    assert {k: str(v) for k, v in got.items()} == {
        "dtd": "/a/x", "mnist": "/m/KnOTS-ViT-B-32_lora_R16_mnist", "eurosat": "/b/one",
        "gtsrb": "/b/two",
    }  # fmt: skip
    assert suites.parse_adapters("/p/with=sign/x") == (suites.AdapterArg(None, "/p/with=sign/x"),)
    for bad, match in [("a,,b", "an empty item"), ("dtd=", "names no folder"), ("=x", "no name")]:
        with pytest.raises(InputError, match=match):
            suites.parse_adapters(bad)
    with pytest.raises(InputError, match="dataset 'dtd' is given twice"):
        vision_adapters.match_adapters(suites.parse_adapters("dtd=/a,/b/lora_dtd"))
    with pytest.raises(InputError, match="at least 2 adapters, got 1"):
        vision_adapters.match_adapters(suites.parse_adapters("/a"))
    with pytest.raises(InputError, match="8 folder\\(s\\) without a dataset name and only 7"):
        vision_adapters.match_adapters(suites.parse_adapters(",".join(f"/x{i}" for i in range(8))))


def test_vision_names_map_peft_module_names_to_the_tower():
    from netutility_jax.experiments.suites import vision_adapters

    got = vision_adapters.vision_names({
        "vision_model.encoder.layers.3.self_attn.q_proj": 1,  # PEFT on CLIPModel
        "encoder.layers.0.self_attn.out_proj": 2,  # PEFT on the tower (KnOTS)
        "model.vision_model.encoder.layers.1.mlp.fc1": 3,
    })  # fmt: skip
    assert list(got) == [
        "vision_model.encoder.layers.3.self_attn.q_proj",
        "vision_model.encoder.layers.0.self_attn.out_proj",
        "vision_model.encoder.layers.1.mlp.fc1",
    ]
    with pytest.raises(InputError, match="is in CLIP's text tower"):
        vision_adapters.vision_names({"text_model.encoder.layers.0.self_attn.q_proj": 1})
    with pytest.raises(InputError, match="not a linear layer of CLIP's vision encoder"):
        vision_adapters.vision_names({"vision_model.embeddings.patch_embedding": 1})
    with pytest.raises(InputError, match="two modules map to"):
        vision_adapters.vision_names({"encoder.layers.0.self_attn.q_proj": 1,
                                      "vision_model.encoder.layers.0.self_attn.q_proj": 2})  # fmt: skip


def test_demo_refuses_flags_a_suite_does_not_take_before_any_work(tmp_path, capsys):
    out = tmp_path / "out"
    cases = [
        (["--model-dir", str(tmp_path)], "--model-dir is not used by the encoder suite (it accepts none of them); drop it"),
        (["--adapters", "a=/x"], "--adapters is not used by the encoder suite"),
        (["--suite", "language", "--data-dir", str(tmp_path)], "--data-dir is not used by the language suite"),
        (["--suite", "vision", "--tasks", "a,b"], "--tasks: the vision suite reads its tasks from its own folders"),
        (["--suite", "vision", "--task", "a=b.csv"], "--task: the vision suite reads its tasks"),
        (["--suite", "vision", "--init", "shared"], "--init: the vision suite trains nothing"),
        (["--suite", "vision", "--model-dir", str(tmp_path / "nope")], f"--model-dir {tmp_path / 'nope'}: no such folder"),
        (["--suite", "vision", "--data-dir", ""], "--data-dir is empty; give a folder"),
        (["--suite", "vision", "--adapters", f"dtd={tmp_path / 'f.txt'}"], f"--adapters dtd={tmp_path / 'f.txt'}: a file, not a folder"),
        (["--suite", "vision", "--adapters", "a,,b"], "--adapters 'a,,b': an empty item"),
        (["--suite", "vision", "--model-dir", str(tmp_path)], "the vision suite needs --data-dir, --adapters: --model-dir CLIP_FOLDER"),
        (["--suite", "vision", "--model-dir", str(tmp_path), "--data-dir", str(tmp_path), "--adapters", f"{tmp_path},{tmp_path}"], f"--model-dir {tmp_path}: no config.json"),
        (["--study", "regime", "--data-dir", str(tmp_path)], "--study regime runs on the encoder suite, which takes no --data-dir"),
    ]  # fmt: skip
    (tmp_path / "f.txt").write_text("x")
    for argv, msg in cases:
        rc = demo.main(["--out", str(out), *argv])
        err = capsys.readouterr().err
        assert rc == 2, argv
        assert err == f"netutility demo: error: {msg}\n" or err.startswith(
            f"netutility demo: error: {msg}"
        ), (argv, err)
        assert err.count("\n") == 1
    assert not out.exists()


# ----------------------------------------------------------------------- the suite, end to end


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """The tiny CLIP, its datasets and three PEFT adapters, written once for the module."""
    if not HAVE_PEERS:
        pytest.skip("torch, transformers, peft and PIL build the fixture")
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        return write_fixture(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def suite(fixture):
    from netutility_jax.experiments.suites import vision

    return vision.VisionSuite(
        fixture["model"], fixture["data"], suites.parse_adapters(adapters_arg(fixture["adapters"]))
    )


@pytest.fixture(scope="module")
def loaded(suite):
    from netutility_jax.experiments.suites import vision

    return suite.load_tasks(vision.QUICK)


def test_suite_wiring_tasks_adapters_and_heads(fixture, suite, loaded):
    """The default tier's check of the whole wiring: adapters matched and renamed, datasets
    split, the preset given the adapters' rank, tokenization as transformers', and heads equal
    to an independent float64 computation from the text tower's features."""
    from transformers import CLIPTokenizer

    from netutility_jax.experiments.suites import vision, vision_heads

    assert isinstance(suite, suites.SuiteWithData) and isinstance(suite, suites.Suite)
    tasks, preset = loaded
    assert [t.name for t in tasks] == ["mnist", "sun397", "shapes"]
    assert (preset.train.lora_rank, preset.train.lora_alpha) == (RANK, ALPHA)
    assert preset.grid == vision.QUICK.grid and vision.QUICK.train.lora_rank == 16
    assert [t.holdout for t in tasks] == ["test 20% (ours)", "knots index file", "val split"]
    assert [(len(t.val), len(t.test)) for t in tasks] == [(12, 48), (6, 24), (9, 24)]
    assert tasks[1].labels == ("abbey", "bakery shop", "coast")
    assert tasks[2].labels == ("low", "newer", "wider")  # sorted folders
    trained = suite.train_tasks(tasks, None, preset.train, cache_dir=None, progress=False, log=None)
    for t in trained:
        assert len(t.adapter) == 8 and all(
            n.startswith("vision_model.encoder.layers.") for n in t.adapter
        )
        assert {m["scale"] for m in t.adapter.values()} == {ALPHA / RANK}
        assert t.info["r"] == RANK and len(t.info["cache_key"]) == 64
    assert trained[1].info["files"] == ["adapter_config.json", "adapter_model.bin"]

    # tokenization: transformers' CLIPTokenizer on the same folder, padded with the end-of-text id
    texts = [p for t in tasks for cls in t.prompts() for p in cls]
    ids, mask = vision_heads.tokenize(suite.tokenizer, texts)
    want = CLIPTokenizer.from_pretrained(fixture["model"])(texts, padding=True)
    np.testing.assert_array_equal(mask, np.asarray(want["attention_mask"]))
    np.testing.assert_array_equal(
        np.where(mask > 0, ids, -1), np.where(mask > 0, want["input_ids"], -1)
    )
    long = vision_heads.tokenize(suite.tokenizer, ["w " * 40])[0]
    assert long.shape == (1, 24) and long[0, -1] == suite.tokenizer.eos_id

    # heads: float64 from the text features, mean of normalized templates, normalized, scaled
    heads = suite.heads(tasks)
    feats = vision_heads.text_features(suite.model, suite.tokenizer, texts).astype(np.float64)
    scale = np.exp(np.float64(np.asarray(suite.model.logit_scale[...])))
    at = 0
    for t, h in zip(tasks, heads, strict=True):
        rows = []
        for cls in t.prompts():
            e = feats[at : at + len(cls)]
            at += len(cls)
            m = (e / np.linalg.norm(e, axis=1, keepdims=True)).mean(0)
            rows.append(scale * m / np.linalg.norm(m))
        assert h.task == t.name and h.vectors.dtype == np.float32
        np.testing.assert_allclose(h.vectors, np.stack(rows), rtol=1e-5, atol=1e-5 * scale)
    assert len(suite.eval_key(preset.train)["heads"]) == 64


@HF_WARNINGS
def test_merged_adapter_folded_as_peft_applies_it(fixture, suite, loaded):
    """The backbone's features (uint8 pixels normalized on the device, the adapter folded into
    the kernels) equal transformers + PEFT's for each adapter, PEFT on the tower included."""
    import peft
    import torch

    from netutility_jax.experiments.models import clip
    from netutility_jax.experiments.suites import vision_eval

    tasks, preset = loaded
    val = vision_eval.make_image_set(
        ["shapes"], [tasks[2].val], suite.image_config, tokens=suite.tokens, batch_size=4
    )
    assert len(val) == 9 and val.slot_tokens == 12 * suite.tokens and val.tokens == 9 * 17
    from PIL import Image

    def read(path):
        with Image.open(path) as im:
            return im.copy()

    px = clip.preprocess([read(r.path) for r in tasks[2].val.refs], suite.image_config)
    # uint8 pixels normalized through the backbone's table: clip.preprocess's arrays, exactly
    lut = vision_eval._lut(suite.image_config)
    np.testing.assert_array_equal(lut[np.arange(3)[:, None, None], val.pixels.astype(int)], px)
    trained = suite.train_tasks(tasks, None, preset.train, cache_dir=None, progress=False, log=None)
    names = sorted(trained[0].adapter)
    bb = vision_eval.VisionBackbone(suite.model, suite.image_config, names)
    base = _tiny_clip()
    for t, sub in zip(trained, ("knots_lora_r8_mnist", "sun", "own"), strict=True):
        pm = (
            peft.PeftModel.from_pretrained(base.vision_model, fixture["adapters"] / sub)
            if sub == "own"
            else peft.PeftModel.from_pretrained(_tiny_clip(), fixture["adapters"] / sub)
        ).eval()
        with torch.no_grad():
            x = torch.tensor(px)
            if sub == "own":
                want = base.visual_projection(pm(pixel_values=x).pooler_output).numpy()
            else:
                want = pm.get_image_features(pixel_values=x)
                want = getattr(want, "pooler_output", want).numpy()
        want = want / np.linalg.norm(want, axis=1, keepdims=True)
        got = bb.embed(val, t.adapter)
        np.testing.assert_allclose(got, want, atol=2e-5)
        half = bb.embed(val, t.adapter, 0.5)
        folded = clip.fold_adapter(suite.model, t.adapter, coef=0.5)
        f = clip.image_features(folded, px)
        np.testing.assert_allclose(half, f / np.linalg.norm(f, axis=1, keepdims=True), atol=2e-5)
    assert bb.passes == 6


@pytest.mark.slow  # ~40 s on 2 cores: 7 merges, each compiled and searched on validation
@HF_WARNINGS
def test_quick_run_end_to_end_through_the_demo(fixture, suite, loaded, tmp_path, capsys):
    out, cache = tmp_path / "out", tmp_path / "cache"
    argv = [
        "--suite", "vision", "--quick", "--no-progress", "--out", str(out), "--cache-dir",
        str(cache), "--model-dir", str(fixture["model"]), "--data-dir", str(fixture["data"]),
        "--adapters", adapters_arg(fixture["adapters"]),
    ]  # fmt: skip
    assert demo.main(argv) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert (
        res["suite"] == "vision" and res["preset"] == "quick" and "--suite vision" in res["command"]
    )
    assert [t["name"] for t in res["tasks"]] == ["mnist", "sun397", "shapes"]
    assert res["evaluation"]["validation"]["sun397"] == "knots index file"
    assert res["train_config"]["lora_rank"] == RANK and res["train_config"]["trained"] is False
    assert set(res["adapters"]) == {"mnist", "sun397", "shapes"}
    keys = set(res["merges"]["0"])
    assert keys == {
        *(f"{m}/full/R16/{a}" for m in ("ta", "ties") for a in ("uniform", "net_utility")),
        "ta/full/all",
        "average",
        f"ta/full/R{3 * RANK}/net_utility",
    }
    (rec,) = [r for r in res["summary"] if r["method"] == "TA"]
    assert rec["test_examples"] == 96 and np.isfinite(rec["delta"])
    assert "vision suite, quick preset: normalized accuracy" in printed
    md = (out / "results.md").read_text()
    assert md.startswith("# netutility demo --suite vision (quick)")
    assert "Zero-shot heads (CLIP prompts per class): mnist: 1 template(s)" in md
    assert (cache / "vision" / "merges").is_dir()
    # a second run renders from the job cache, the same numbers
    assert demo.main([*argv, "--overwrite"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert all(r["cache_hit"] for r in again["merges"]["0"].values())
    assert again["summary"] == res["summary"]
    # the run's seed reads back (--seeds-from) and passes the check of a run of the same
    # experiment: what the runner expects is what the report wrote (the suite's train_config)
    from netutility_jax.experiments.harness import grid as gr
    from netutility_jax.experiments.harness import runner
    from netutility_jax.experiments.harness import seeds as sds

    tasks, preset = loaded
    heads = suite.heads(tasks)
    val, test = suite.eval_sets(tasks, heads, preset.train)
    run = runner.Run(
        preset=preset, tasks=tasks, seeds=[], val=val, test=test, heads=heads, alpha_arg="auto",
        jobs=gr.grid_jobs(preset.grid, full_capacity=len(tasks) * preset.train.lora_rank),
        seconds={}, backbone={}, suite=suite.name, eval_key=suite.eval_key(preset.train),
        fingerprint={"val": runner._fingerprint(val), "test": runner._fingerprint(test)},
    )  # fmt: skip
    expected = runner._expected(run, suite)
    assert expected["train_config"] == again["train_config"]
    assert expected["eval_key"] == again["eval_key"] and again["train_data"] is None
    assert expected["texts"] == again["texts"]
    sds.load(out).check(expected, test, len(val))


if __name__ == "__main__":  # python tests/experiments/test_vision.py DIR: the demo's flags for the fixture
    fx = write_fixture(pathlib.Path(sys.argv[1]))
    print(
        f"--model-dir {fx['model']} --data-dir {fx['data']} "
        f"--adapters {adapters_arg(fx['adapters'])}"
    )
