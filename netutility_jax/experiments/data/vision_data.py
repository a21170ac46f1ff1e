"""The vision suite's data: the 7 datasets of the paper's Table 1, their class names, prompt
templates, readers and validation splits.

**Datasets** (:data:`DATASETS`, in the paper's order :data:`ORDER`): DTD, EuroSAT, GTSRB, MNIST,
RESISC45, SUN397, SVHN, with the class names and CLIP prompt templates of the KnOTS code
(``dataset/*.py``, ``dataset/templates.py``; the templates are task-vectors' and CLIP's), written
out here. SUN397's 397 class names come from the data itself (:func:`class_name`): its class
folders (``a/abbey`` or KnOTS' flattened ``a_abbey`` -> ``"abbey"``, ``a/apartment_building/
outdoor`` -> ``"apartment building outdoor"``, KnOTS' rule ``folder[2:].replace("_", " ")``) or
the ``ClassLabel`` names of a parquet file. Any other dataset name is a dataset of your own: its
classes come from the data and its template is ``"a photo of a {c}."``. A dataset folder may
override both with ``classnames.txt`` (one name per line, in label order) and
``templates.txt`` (one template per line, ``{c}`` standing for the class name).

**Layouts** read (``DATA`` is ``--data-dir``; the dataset folder's name is matched without case,
``DATA/EuroSAT`` is eurosat's):

* an image-folder tree, ``DATA/<dataset>/<split>/<class>/*.jpg`` (``.jpeg .png .ppm .bmp .pgm
  .tif .tiff .webp``, any case; what torchvision's ``ImageFolder`` and the KnOTS code read). A
  class is every folder that directly holds images, named by its path below the split folder
  (so SUN397's original nested ``a/apartment_building/outdoor`` works); classes are sorted by
  that path with ``/`` read as ``_`` and labelled 0, 1, ... in that order (``ImageFolder``'s
  rule for flat trees; KnOTS' order for SUN397); images are in sorted order within a class.
* a Hugging Face dataset saved as parquet files, ``DATA/<dataset>/<split>-*.parquet`` or
  ``<split>.parquet``, also under ``DATA/<dataset>/data/`` (a hub repository's layout): an image
  column (``image`` or ``img``, the ``datasets`` Image feature: a struct with ``bytes``) and an
  integer label column (``label`` or ``labels``); rows are read in file-name order. Reading
  parquet needs ``pyarrow`` (``pip install pyarrow``), imported only when a parquet split is read.

Split folder and file names: ``train`` (or ``training``), ``val`` (``validation``, ``valid``),
``test`` (``testing``).

**Validation split** (:func:`holdout`). A dataset whose data has a validation split uses it
(DTD, EuroSAT and RESISC45 have one in KnOTS' data). For the others KnOTS (and the Core Space
code the paper builds on) holds out part of the **test** split: a stored permutation of the test
set (``dataset/shuffled_idxs/<dataset>_shuffled_idxs.pt``), its first ``int(0.2 n)`` indices
validation, the rest test (:data:`KNOTS_VAL_FRACTION`). This is the default here
(``holdout="test"``). With an index file (below) the split is KnOTS' exactly; without one the
permutation is ours: drawn from PCG64's raw output seeded by ``SeedSequence([seed, crc32(name)])``
(the same on every machine and numpy version). ``holdout="train"`` is task-vectors' protocol
instead (Ilharco et al.: ``min(int(0.1 n_train), 5000)`` training images, seeded; our
permutation, not torch's ``random_split``), for data with a train split.

**Index files** (KnOTS' permutations, converted): ``DATA/<dataset>/shuffled_idxs.npy``,
``.json`` or ``.txt``: a permutation of ``range(n_test)`` (a 1-d integer array; a JSON list; or
whitespace-separated integers), indices into the test split in reading order (image folders:
the order above; parquet: row order). Alternatively a JSON object ``{"val": [...], "test":
[...]}`` of disjoint test-split indices gives both sets explicitly. KnOTS ships ``.pt`` files
(``torch.save`` of a tensor), which are not unpickled here; convert one with
``python -c "import numpy, torch; numpy.save('shuffled_idxs.npy', torch.load('x.pt').numpy())"``.

**Sizes.** ``n_val`` / ``n_test`` (a preset's) keep a seeded uniform subset of that many
examples (ours; None keeps every example, as the paper does).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import InputError, MissingFileError

__all__ = [
    "DATASETS",
    "DEFAULT_TEMPLATES",
    "IMAGE_EXTENSIONS",
    "KNOTS_VAL_FRACTION",
    "ORDER",
    "TRAIN_VAL_FRACTION",
    "TRAIN_VAL_MAX",
    "DatasetSpec",
    "ImageRef",
    "Split",
    "VisionDataError",
    "VisionTask",
    "class_name",
    "dataset_dir",
    "dataset_spec",
    "find_split",
    "holdout",
    "load_images",
    "load_task",
    "parquet_reader",
    "read_index_file",
    "read_split",
    "subset",
]

#: Image file endings of an image-folder tree (torchvision's ``IMG_EXTENSIONS``), any case.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
#: KnOTS' validation share of the test split (``val_fraction`` of its vision configs).
KNOTS_VAL_FRACTION = 0.2
#: task-vectors' validation share of the train split, and its cap (``get_dataset``'s defaults).
TRAIN_VAL_FRACTION = 0.1
TRAIN_VAL_MAX = 5000
#: The template of a dataset of your own (and CLIP's most common one).
DEFAULT_TEMPLATES = ("a photo of a {c}.",)
_HOLDOUTS = ("test", "train")
_SPLITS = {
    "train": ("train", "training"),
    "val": ("val", "validation", "valid"),
    "test": ("test", "testing"),
}
_PYARROW = "reading parquet needs pyarrow: pip install pyarrow"


class VisionDataError(InputError):
    """A dataset folder the vision suite cannot read (the message names the path and the fix)."""


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A dataset of the vision suite.

    Attributes:
      name: the task's name (``dtd``); its folder is ``DATA/<name>`` (case ignored).
      classes: the class names in label order, or None: from the data (:func:`class_name`).
      templates: CLIP prompt templates, ``{c}`` standing for the class name.
      source: where the names and templates come from.
    """

    name: str
    classes: tuple[str, ...] | None
    templates: tuple[str, ...]
    source: str = "KnOTS dataset/*.py and dataset/templates.py"


_DTD = (
    "banded blotchy braided bubbly bumpy chequered cobwebbed cracked crosshatched crystalline "
    "dotted fibrous flecked freckled frilly gauzy grid grooved honeycombed interlaced knitted "
    "lacelike lined marbled matted meshed paisley perforated pitted pleated polka-dotted porous "
    "potholed scaly smeared spiralled sprinkled stained stratified striped studded swirly veined "
    "waffled woven wrinkled zigzagged"
).split()
# EuroSAT's folders (AnnualCrop, Forest, ..., SeaLake, sorted) renamed as KnOTS and CLIP do
_EUROSAT = (
    "annual crop land", "forest", "brushland or shrubland", "highway or road",
    "industrial buildings or commercial buildings", "pasture land", "permanent crop land",
    "residential buildings or homes or apartments", "river", "lake or sea",
)  # fmt: skip
_GTSRB = (
    "red and white circle 20 kph speed limit",
    "red and white circle 30 kph speed limit",
    "red and white circle 50 kph speed limit",
    "red and white circle 60 kph speed limit",
    "red and white circle 70 kph speed limit",
    "red and white circle 80 kph speed limit",
    "end / de-restriction of 80 kph speed limit",
    "red and white circle 100 kph speed limit",
    "red and white circle 120 kph speed limit",
    "red and white circle red car and black car no passing",
    "red and white circle red truck and black car no passing",
    "red and white triangle road intersection warning",
    "white and yellow diamond priority road",
    "red and white upside down triangle yield right-of-way",
    "stop",
    "empty red and white circle",
    "red and white circle no truck entry",
    "red circle with white horizonal stripe no entry",
    "red and white triangle with exclamation mark warning",
    "red and white triangle with black left curve approaching warning",
    "red and white triangle with black right curve approaching warning",
    "red and white triangle with black double curve approaching warning",
    "red and white triangle rough / bumpy road warning",
    "red and white triangle car skidding / slipping warning",
    "red and white triangle with merging / narrow lanes warning",
    "red and white triangle with person digging / construction / road work warning",
    "red and white triangle with traffic light approaching warning",
    "red and white triangle with person walking warning",
    "red and white triangle with child and person walking warning",
    "red and white triangle with bicyle warning",
    "red and white triangle with snowflake / ice warning",
    "red and white triangle with deer warning",
    "white circle with gray strike bar no speed limit",
    "blue circle with white right turn arrow mandatory",
    "blue circle with white left turn arrow mandatory",
    "blue circle with white forward arrow mandatory",
    "blue circle with white forward or right turn arrow mandatory",
    "blue circle with white forward or left turn arrow mandatory",
    "blue circle with white keep right arrow mandatory",
    "blue circle with white keep left arrow mandatory",
    "blue circle with white arrows indicating a traffic circle",
    "white circle with gray strike bar indicating no passing for cars has ended",
    "white circle with gray strike bar indicating no passing for trucks has ended",
)
_RESISC45 = tuple(
    c.replace("_", " ")
    for c in (
        "airplane airport baseball_diamond basketball_court beach bridge chaparral church "
        "circular_farmland cloud commercial_area dense_residential desert forest freeway "
        "golf_course ground_track_field harbor industrial_area intersection island lake meadow "
        "medium_residential mobile_home_park mountain overpass palace parking_lot railway "
        "railway_station rectangular_farmland river roundabout runway sea_ice ship snowberg "
        "sparse_residential stadium storage_tank tennis_court terrace thermal_power_station "
        "wetland"
    ).split()
)
_DIGITS = tuple(str(i) for i in range(10))


def _templates(*prefixes: str, suffix: str = "") -> tuple[str, ...]:
    return tuple(f"{p}{{c}}{suffix}" for p in prefixes)


#: The paper's 7 datasets (Table 1), by name.
DATASETS: dict[str, DatasetSpec] = {
    s.name: s
    for s in (
        DatasetSpec(
            "dtd",
            tuple(_DTD),
            tuple(
                f"a photo of {art} {{c}} {what}."
                for art in ("a", "the")
                for what in ("texture", "pattern", "thing", "object")
            ),
        ),
        DatasetSpec(
            "eurosat",
            _EUROSAT,
            _templates(
                "a centered satellite photo of ",
                "a centered satellite photo of a ",
                "a centered satellite photo of the ",
                suffix=".",
            ),
        ),
        DatasetSpec(
            "gtsrb",
            _GTSRB,
            tuple(
                f'a {how} photo of a "{{c}}" traffic sign.'
                for how in ("zoomed in", "centered", "close up")
            ),
        ),
        DatasetSpec("mnist", _DIGITS, ('a photo of the number: "{c}".',)),
        DatasetSpec(
            "resisc45",
            _RESISC45,
            tuple(
                f"{src} {kind} of {art}{{c}}."
                for art in ("", "a ", "the ")
                for kind in ("imagery", "photo", "view")
                for src in ("satellite", "aerial")
            ),
        ),
        DatasetSpec("sun397", None, _templates("a photo of a ", "a photo of the ", suffix=".")),
        DatasetSpec("svhn", _DIGITS, ('a photo of the number: "{c}".',)),
    )
}
#: The paper's order of the datasets (the order bare ``--adapters`` folders are matched in).
ORDER = tuple(DATASETS)


def dataset_spec(name: str) -> DatasetSpec:
    """The spec of ``name``: a built-in one, or a dataset of your own (classes from the data,
    :data:`DEFAULT_TEMPLATES`)."""
    if name in DATASETS:
        return DATASETS[name]
    return DatasetSpec(name, None, DEFAULT_TEMPLATES, source="your own dataset")


# ---------------------------------------------------------------------------------- folders


def dataset_dir(data_dir: str | os.PathLike, name: str) -> pathlib.Path:
    """``DATA/<name>``, matched without case (``DATA/EuroSAT`` for ``eurosat``).

    Raises:
      MissingFileError: no such folder (the message lists the folders there).
    """
    root = pathlib.Path(data_dir)
    exact = root / name
    if exact.is_dir():
        return exact
    try:
        found = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError as e:
        raise MissingFileError(f"--data-dir {root}: cannot list it ({e.strerror or e})") from None
    for p in found:
        if p.name.lower() == name.lower():
            return p
    have = ", ".join(p.name for p in found[:12]) or "none"
    raise MissingFileError(
        f"--data-dir {root}: no folder for dataset {name!r} (expected {root / name}; folders "
        f"there: {have})"
    )


class _Found(NamedTuple):
    kind: str  # "folder" or "parquet"
    paths: tuple[pathlib.Path, ...]


def find_split(ds_dir: pathlib.Path, split: str) -> _Found | None:
    """Where split ``split`` (``train``, ``val``, ``test``) of a dataset folder is: an image
    folder ``<ds_dir>/<split>/`` or parquet files ``<split>-*.parquet`` / ``<split>.parquet``
    (also under ``data/``); None if there is neither."""
    for alias in _SPLITS[split]:
        for base in (ds_dir, ds_dir / "data"):
            if not base.is_dir():
                continue
            files = sorted(
                p
                for p in base.iterdir()
                if p.is_file()
                and p.suffix.lower() == ".parquet"
                and (p.stem.lower() == alias or p.stem.lower().startswith(alias + "-"))
            )
            if files:
                return _Found("parquet", tuple(files))
        for p in sorted(ds_dir.iterdir()) if ds_dir.is_dir() else ():
            if p.is_dir() and p.name.lower() == alias:
                return _Found("folder", (p,))
    return None


# ------------------------------------------------------------------------------ class names


def class_name(key: str, *, flat_index: bool = False) -> str:
    """A class's name from its folder path (or a ``ClassLabel`` name) below the split, by KnOTS'
    SUN397 rule: the one-letter index folder dropped (``a/abbey``; with ``flat_index``, also
    KnOTS' flattened ``a_abbey``, SUN397's layout), ``_`` and ``/`` read as spaces.

    Example:
      >>> [class_name(k) for k in ("a/abbey", "/b/bakery/shop", "banded", "t_shirt")]
      ['abbey', 'bakery shop', 'banded', 't shirt']
      >>> class_name("a_apartment_building_outdoor", flat_index=True)
      'apartment building outdoor'
    """
    parts = key.strip("/").split("/")
    if len(parts) > 1 and re.fullmatch(r"[a-z]", parts[0]):
        parts = parts[1:]
    k = "_".join(parts)
    if flat_index and len(parts) == 1 and re.fullmatch(r"[a-z]_.+", k):
        k = k[2:]
    return k.replace("_", " ").strip()


# ---------------------------------------------------------------------------------- splits


class ImageRef(NamedTuple):
    """Where one image is: a file (``row`` -1) or row ``row`` of a parquet file."""

    path: str
    row: int = -1


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """The examples of one split: ``refs`` (:class:`ImageRef`) and ``labels`` ``(N,)`` int32.

    ``classes``: the class keys the data names (image folders: folder paths; parquet:
    ``ClassLabel`` names), or None.
    """

    refs: tuple[ImageRef, ...]
    labels: np.ndarray
    classes: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return len(self.refs)

    def take(self, index: Sequence[int] | np.ndarray) -> Split:
        """The examples at ``index``, in that order."""
        idx = np.asarray(index, np.int64)
        return Split(tuple(self.refs[i] for i in idx), self.labels[idx].copy(), self.classes)


def _image_folder(folder: pathlib.Path) -> Split:
    """The examples of an image-folder split (see the module doc for the rules)."""
    per_class: dict[str, list[str]] = {}
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs.sort()
        images = sorted(f for f in files if f.lower().endswith(IMAGE_EXTENSIONS))
        if images:
            rel = pathlib.Path(root).relative_to(folder).as_posix()
            if rel == ".":
                raise VisionDataError(
                    f"{folder}: images lie directly in the split folder; put each class's "
                    f"images in a folder of its own ({folder}/<class>/*.jpg)"
                )
            per_class[rel] = [os.path.join(root, f) for f in images]
    if not per_class:
        raise VisionDataError(
            f"{folder}: no images found (expected {folder}/<class>/*.jpg, .png, ...)"
        )
    keys = sorted(per_class, key=lambda k: k.replace("/", "_"))
    refs, labels = [], []
    for i, k in enumerate(keys):
        refs += [ImageRef(p) for p in per_class[k]]
        labels += [i] * len(per_class[k])
    return Split(tuple(refs), np.asarray(labels, np.int32), tuple(keys))


def parquet_reader() -> Any:
    """``pyarrow.parquet``, or a :class:`VisionDataError` saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise VisionDataError(_PYARROW) from None
    return pq


def _columns(schema: Any, f: pathlib.Path) -> tuple[str, str]:
    names = list(schema.names)
    image = next((n for n in ("image", "img") if n in names), None)
    label = next((n for n in ("label", "labels") if n in names), None)
    if image is None or label is None:
        raise VisionDataError(
            f"{f}: columns {names}; expected an image column ('image' or 'img', the datasets "
            "Image feature) and an integer label column ('label' or 'labels')"
        )
    return image, label


def _label_names(schema: Any, label: str) -> tuple[str, ...] | None:
    """The ``ClassLabel`` names a Hugging Face parquet file records in its schema metadata."""
    meta = schema.metadata or {}
    raw = meta.get(b"huggingface")
    if raw is None:
        return None
    try:
        feats = json.loads(raw)["info"]["features"]
        names = feats[label].get("names")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return tuple(str(n) for n in names) if isinstance(names, list) and names else None


def _parquet(files: Sequence[pathlib.Path]) -> Split:
    pq = parquet_reader()
    refs: list[ImageRef] = []
    labels: list[np.ndarray] = []
    classes = None
    for f in files:
        try:
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
            _, label = _columns(schema, f)
            col = pf.read(columns=[label]).column(0)
        except VisionDataError:
            raise
        except Exception as e:  # pyarrow's own errors (corrupt file, ...)
            raise VisionDataError(f"{f}: cannot read it as parquet ({e})") from None
        if col.null_count:
            raise VisionDataError(f"{f}: {col.null_count} row(s) have no {label!r}")
        lab = np.asarray(col.to_numpy(zero_copy_only=False))
        if not np.issubdtype(lab.dtype, np.integer):
            raise VisionDataError(
                f"{f}: column {label!r} holds {lab.dtype} values; expected integer class ids"
            )
        classes = classes or _label_names(schema, label)
        refs += [ImageRef(str(f), i) for i in range(len(lab))]
        labels.append(lab.astype(np.int64))
    lab = np.concatenate(labels) if labels else np.zeros(0, np.int64)
    if len(lab) and (lab.min() < 0 or (classes is not None and lab.max() >= len(classes))):
        raise VisionDataError(
            f"{files[0].parent}: labels run from {lab.min()} to {lab.max()}"
            + (f" but the files name {len(classes)} classes" if classes else "")
        )
    return Split(tuple(refs), lab.astype(np.int32), classes)


def read_split(found: _Found) -> Split:
    """The examples of a split :func:`find_split` found (no image is decoded)."""
    return _image_folder(found.paths[0]) if found.kind == "folder" else _parquet(found.paths)


# --------------------------------------------------------------------------- validation split


def _permutation(n: int, seed: int, *keys: int) -> np.ndarray:
    """A permutation of ``range(n)``, the same on every machine and numpy version."""
    bits = np.random.PCG64(np.random.SeedSequence([seed, *keys])).random_raw(n)
    return np.argsort(bits, kind="stable")


def _key(name: str) -> int:
    return zlib.crc32(name.encode())


def read_index_file(path: str | os.PathLike, n: int) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    """A KnOTS-style index file of a test split of ``n`` examples (see the module doc).

    Returns:
      a permutation of ``range(n)`` ``(n,)`` int64, or ``(val, test)`` index arrays from a JSON
      ``{"val": [...], "test": [...]}``.

    Raises:
      VisionDataError: unreadable; not a permutation of ``range(n)``; ``val`` and ``test`` not
        disjoint or out of range.
    """
    p = pathlib.Path(path)
    try:
        if p.suffix == ".npy":
            raw: Any = np.load(p, allow_pickle=False)
        elif p.suffix == ".json":
            raw = json.loads(p.read_text())
        else:
            raw = [int(t) for t in p.read_text().split()]
    except (OSError, ValueError) as e:
        raise VisionDataError(f"index file {p}: cannot read it ({e})") from None

    def ints(x: Any, what: str) -> np.ndarray:
        a = np.asarray(x)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise VisionDataError(f"index file {p}: {what} is not a 1-d list of integers")
        return a.astype(np.int64)

    if isinstance(raw, dict):
        if set(raw) != {"val", "test"}:
            raise VisionDataError(
                f"index file {p}: keys {sorted(raw)}; expected exactly 'val' and 'test'"
            )
        val, test = ints(raw["val"], "val"), ints(raw["test"], "test")
        both = np.concatenate([val, test])
        if both.size and (both.min() < 0 or both.max() >= n):
            raise VisionDataError(f"index file {p}: indices outside the test split's range(0, {n})")
        if len(np.unique(both)) != len(both):
            raise VisionDataError(f"index file {p}: 'val' and 'test' share or repeat indices")
        return val, test
    perm = ints(raw, "the permutation")
    if len(perm) != n or not np.array_equal(np.sort(perm), np.arange(n)):
        raise VisionDataError(
            f"index file {p}: holds {len(perm)} indices but is not a permutation of the test "
            f"split's {n} examples; it belongs to data in another order or of another size"
        )
    return perm


def holdout(
    n: int, *, fraction: float, cap: int | None = None, seed: int = 0, name: str = "",
    permutation: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Split ``range(n)`` into a held-out validation part and the rest (KnOTS' rule).

    ``val = perm[:k]``, ``rest = perm[k:]`` with ``k = int(n * fraction)`` (at most ``cap``),
    ``perm`` the given permutation (KnOTS' index file) or ours (PCG64 raw output seeded by
    ``SeedSequence([seed, crc32(name)])``).

    Returns:
      ``(val, rest)`` int64 index arrays, disjoint, together ``range(n)``.

    Example:
      >>> val, rest = holdout(10, fraction=0.2, name="mnist")
      >>> len(val), len(rest), sorted([*val, *rest]) == list(range(10))
      (2, 8, True)
    """
    perm = _permutation(n, seed, _key(name)) if permutation is None else np.asarray(permutation)
    k = int(n * fraction)
    k = k if cap is None else min(k, cap)
    return perm[:k].astype(np.int64), perm[k:].astype(np.int64)


def subset(split: Split, n: int | None, *, seed: int, name: str, part: str) -> Split:
    """At most ``n`` examples of ``split``: a seeded uniform subset in the split's order (ours);
    the split itself when ``n`` is None or not smaller."""
    if n is None or n >= len(split):
        return split
    keep = np.sort(_permutation(len(split), seed, _key(name), _key(part))[:n])
    return split.take(keep)


# ------------------------------------------------------------------------------------ tasks


@dataclasses.dataclass(frozen=True, eq=False)
class VisionTask:
    """One dataset of the vision suite, split (the harness's task: ``name``, ``labels``,
    ``label_texts``, ``pair``, ``source``, ``train``, ``val``, ``test``).

    Attributes:
      name: the dataset.
      labels: class names in label order.
      label_texts: each class's first prompt (what the report shows).
      templates: the prompt templates (``{c}`` the class name).
      source: where the data and the validation split came from.
      train: not used (the adapters are given): empty, or what is left of the train split.
      val, test: the evaluation splits.
      holdout: how validation was made: ``"val split"``, ``"knots index file"``,
        ``"test 20% (ours)"``, ``"train 10% (ours)"``.
    """

    name: str
    labels: tuple[str, ...]
    label_texts: tuple[str, ...]
    templates: tuple[str, ...]
    source: str
    train: Split
    val: Split
    test: Split
    holdout: str
    pair: bool = False

    def prompts(self) -> list[list[str]]:
        """Every class's prompts, one per template."""
        return [[t.replace("{c}", c) for t in self.templates] for c in self.labels]


def _lines(path: pathlib.Path) -> tuple[str, ...] | None:
    if not path.is_file():
        return None
    lines = tuple(s.strip() for s in path.read_text().splitlines() if s.strip())
    if not lines:
        raise VisionDataError(f"{path}: empty; one entry per line")
    return lines


def _index_file(ds_dir: pathlib.Path) -> pathlib.Path | None:
    found = [ds_dir / f"shuffled_idxs{ext}" for ext in (".npy", ".json", ".txt")]
    found = [p for p in found if p.is_file()]
    if len(found) > 1:
        raise VisionDataError(f"{ds_dir}: several index files {[p.name for p in found]}; keep one")
    if not found and (ds_dir / "shuffled_idxs.pt").is_file():
        raise VisionDataError(
            f"{ds_dir / 'shuffled_idxs.pt'}: KnOTS' torch file is not unpickled here; convert "
            "it: python -c \"import numpy, torch; numpy.save('shuffled_idxs.npy', "
            "torch.load('shuffled_idxs.pt').numpy())\""
        )
    return found[0] if found else None


def _classes(spec: DatasetSpec, ds_dir: pathlib.Path, splits: Sequence[Split]) -> tuple[str, ...]:
    """The class names: ``classnames.txt``, the spec's, else from the data; checked against
    the data's class count."""
    keys = next((s.classes for s in splits if s.classes is not None), None)
    for s in splits:
        if keys is not None and s.classes is not None and len(s.classes) != len(keys):
            raise VisionDataError(
                f"{ds_dir}: the splits have {len(keys)} and {len(s.classes)} classes; every "
                "split needs the same class folders"
            )
        if keys is not None and s.classes is not None and s.classes != keys:
            raise VisionDataError(
                f"{ds_dir}: the splits' classes differ ({_diff(keys, s.classes)}); every split "
                "needs the same class folders"
            )
    top = max(int(s.labels.max()) + 1 for s in splits if len(s))
    names = _lines(ds_dir / "classnames.txt") or spec.classes
    if names is None:
        if keys is None:
            raise VisionDataError(
                f"{ds_dir}: the data names no classes (parquet without ClassLabel names); "
                "write classnames.txt (one name per line, in label order)"
            )
        names = tuple(class_name(k, flat_index=spec.name == "sun397") for k in keys)
    n_data = len(keys) if keys is not None else top  # (labels alone: at least the largest + 1)
    if (keys is not None and len(names) != n_data) or top > len(names):
        raise VisionDataError(
            f"{ds_dir}: the data has {n_data} classes but {len(names)} class names are "
            f"declared for {spec.name!r}; the class folders (or labels) do not match the dataset"
        )
    return tuple(names)


def _diff(a: Sequence[str], b: Sequence[str]) -> str:
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    return f"{a[i]!r} vs {b[i]!r}"


def load_task(
    data_dir: str | os.PathLike,
    name: str,
    *,
    n_val: int | None = None,
    n_test: int | None = None,
    holdout_from: str = "test",
    seed: int = 0,
) -> VisionTask:
    """Dataset ``name`` from ``DATA/<name>``, with its validation split (module doc).

    Args:
      data_dir: ``--data-dir``.
      name: a key of :data:`DATASETS` or a dataset of your own.
      n_val, n_test: most examples kept (None: all).
      holdout_from: where validation comes from when the data has no validation split:
        ``"test"`` (KnOTS: 20% of test, the index file if there is one) or ``"train"``
        (task-vectors: 10% of train, at most 5000).
      seed: of our permutations and subsets (the data splits, not the merges).

    Raises:
      MissingFileError: no dataset folder, or no test split.
      VisionDataError: unreadable data, classes that do not match, a bad index file, parquet
        without pyarrow, ``holdout_from="train"`` without a train split.
    """
    if holdout_from not in _HOLDOUTS:
        raise InputError(f"load_task: holdout_from={holdout_from!r}; expected one of {_HOLDOUTS}")
    spec = dataset_spec(name)
    d = dataset_dir(data_dir, name)
    found = {s: find_split(d, s) for s in _SPLITS}
    if found["test"] is None:
        raise MissingFileError(
            f"{d}: no test split (expected {d}/test/<class>/*.jpg or {d}/test-*.parquet)"
        )
    test = read_split(found["test"])
    if found["val"] is not None:
        val = read_split(found["val"])
        how = "val split"
        splits = [val, test]
    elif holdout_from == "test":
        idx = _index_file(d)
        if idx is None:
            v, t = holdout(len(test), fraction=KNOTS_VAL_FRACTION, seed=seed, name=name)
            how = f"test {KNOTS_VAL_FRACTION:.0%} (ours)"
        else:
            got = read_index_file(idx, len(test))
            v, t = (
                got
                if isinstance(got, tuple)
                else holdout(len(test), fraction=KNOTS_VAL_FRACTION, permutation=got)
            )
            how = "knots index file"
        val, test = test.take(v), test.take(t)
        splits = [val, test]
    else:
        if found["train"] is None:
            raise VisionDataError(
                f"{d}: holdout from train needs a train split ({d}/train/ or train-*.parquet)"
            )
        train = read_split(found["train"])
        v, _ = holdout(
            len(train), fraction=TRAIN_VAL_FRACTION, cap=TRAIN_VAL_MAX, seed=seed, name=name
        )
        val = train.take(np.sort(v))
        how = f"train {TRAIN_VAL_FRACTION:.0%} (ours)"
        splits = [val, test]
    if not len(val) or not len(test):
        raise VisionDataError(
            f"{d}: {len(val)} validation and {len(test)} test examples; both need at least one"
        )
    labels = _classes(spec, d, splits)
    templates = _lines(d / "templates.txt") or spec.templates
    bad = [t for t in templates if "{c}" not in t]
    if bad:
        raise VisionDataError(f"{d}: template {bad[0]!r} has no {{c}} for the class name")
    val = subset(val, n_val, seed=seed, name=name, part="val")
    test = subset(test, n_test, seed=seed, name=name, part="test")
    return VisionTask(
        name=name,
        labels=labels,
        label_texts=tuple(templates[0].replace("{c}", c) for c in labels),
        templates=tuple(templates),
        source=f"{d} ({found['test'].kind}; validation: {how})",
        train=Split((), np.zeros(0, np.int32)),
        val=val,
        test=test,
        holdout=how,
    )


# ------------------------------------------------------------------------------------ images


class _Source(NamedTuple):
    """One image to decode: a file path, or the bytes of a parquet cell; ``where`` names it."""

    data: str | bytes
    where: str


def _sources(refs: Sequence[ImageRef]) -> Iterable[tuple[int, _Source]]:
    """``(position, source)`` of every ref, each parquet file read once, in batches of rows."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for i, r in enumerate(refs):
        if r.row < 0:
            yield i, _Source(r.path, r.path)
        else:
            by_file.setdefault(r.path, []).append((r.row, i))
    for path, wanted in by_file.items():
        pq = parquet_reader()
        pf = pq.ParquetFile(path)
        image, _ = _columns(pf.schema_arrow, pathlib.Path(path))
        rows = dict(wanted)
        offset = 0
        for batch in pf.iter_batches(batch_size=256, columns=[image]):
            col = batch.column(0)
            for j in range(len(col)):
                pos = rows.get(offset + j)
                if pos is None:
                    continue
                cell = col[j].as_py()
                data = cell.get("bytes") if isinstance(cell, Mapping) else cell
                if not isinstance(data, (bytes, bytearray)):
                    raise VisionDataError(
                        f"{path}: row {offset + j} has no image bytes (column {image!r}); save "
                        "the dataset with its images embedded"
                    )
                yield pos, _Source(bytes(data), f"{path} row {offset + j}")
            offset += len(col)


def _preprocessed(src: _Source, cfg: Any) -> np.ndarray:
    """One image decoded and preprocessed (``clip.preprocess``), ``(3, H, W)`` uint8."""
    from PIL import Image, UnidentifiedImageError

    from ..models import clip

    try:
        with Image.open(src.data if isinstance(src.data, str) else io.BytesIO(src.data)) as im:
            im.load()
            return clip.preprocess(im, cfg)[0].astype(np.uint8)
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
        raise VisionDataError(f"{src.where}: cannot decode the image ({e})") from None


def load_images(split: Split, config: Any, *, workers: int | None = None) -> np.ndarray:
    """The images of ``split`` preprocessed to ``(N, 3, H, W)`` uint8: CLIP's preprocessing
    (``clip.preprocess`` with ``config``) up to the crop, before rescaling and normalizing
    (those run on the device, exactly as ``clip.preprocess`` computes them). Images are decoded
    and resized in ``workers`` threads (PIL releases the GIL; default: the CPUs, at most 16).

    Raises:
      VisionDataError: an image that cannot be decoded; parquet without pyarrow; no images.
    """
    from concurrent.futures import ThreadPoolExecutor

    if not len(split):
        raise VisionDataError("load_images: the split holds no images")
    cfg = dataclasses.replace(config, do_rescale=False, do_normalize=False)
    workers = workers or min(16, os.cpu_count() or 1)
    out: np.ndarray | None = None
    chunk: list[tuple[int, _Source]] = []

    def flush(pool: ThreadPoolExecutor) -> None:
        nonlocal out
        for (pos, _), x in zip(
            chunk, pool.map(lambda c: _preprocessed(c[1], cfg), chunk), strict=True
        ):
            if out is None:
                out = np.zeros((len(split), *x.shape), np.uint8)
            if x.shape != out.shape[1:]:
                raise VisionDataError(
                    f"load_images: images of shapes {out.shape[1:]} and {x.shape} after "
                    "preprocessing; preprocessor_config.json must crop to one size"
                )
            out[pos] = x
        chunk.clear()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for item in _sources(split.refs):
            chunk.append(item)
            if len(chunk) >= 64 * workers:
                flush(pool)
        flush(pool)
    return out  # type: ignore[return-value]  # (the split is not empty: set above)
